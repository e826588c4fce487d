#!/usr/bin/env bash
# What an evacuation and a recovery cost (issue #29): a fleet on this machine (a control plane
# with node leases of LEASE seconds, default 2, and three nodes, on loopback, one object store
# in a directory). Two numbers:
#  1. an evacuation of COUNT (default 20) sleeping sandboxes of node a: POST
#     /internal/nodes/a/evacuate to the batch ended (and each move's p50/p95, made to ended);
#  2. a node's death (SIGKILL of node b, which then holds about half of them, asleep) to its
#     sandboxes answering elsewhere: recoverNode asked every 100 ms from the kill (refused
#     lease_held until the lease and its grace ran out), then every sandbox's GET through the
#     control plane polled until it answers 200 from another node.
#
# As root, with CRIU (scripts/criu.sh) and the base image (/var/lib/sbx/images, or
# SBX_IMAGES_DIR). SBX_BIN_DIR=target/debug uses built binaries instead of a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
if [ -z "${SBX_BIN_DIR:-}" ]; then
  need_cargo
  scripts/criu.sh
  build_release sandboxd sbx-agent
fi
BIN="$(cd "${SBX_BIN_DIR:-target/release}" && pwd)" IMAGES="${SBX_IMAGES_DIR:-/var/lib/sbx/images}" \
  COUNT="${COUNT:-20}" LEASE="${LEASE:-2}" exec python3 - <<'PY'
import json, os, shutil, signal, socket, subprocess, tempfile, time
import urllib.error, urllib.request

BIN, IMAGES = os.environ["BIN"], os.environ["IMAGES"]
COUNT, LEASE = int(os.environ["COUNT"]), os.environ["LEASE"]
procs, dirs = [], []

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def call(base, method, path, body=None, ok=(200, 201, 202)):
    """The answer's status and JSON body (any status)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text

def must(base, method, path, body=None):
    s, v = call(base, method, path, body)
    if s not in (200, 201, 202):
        raise SystemExit(f"{method} {base}{path}: {s} {v}")
    return v

def wait_http(url, proc, log, what, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.05)
    with open(log) as f:
        tail = f.read()[-3000:]
    raise SystemExit(f"{what} did not start:\n{tail}")

def spawn(args, log):
    p = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    procs.append(p)
    return p

def stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.remove(p)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")

def ms_of(t):
    # RFC 3339 with milliseconds, UTC.
    from datetime import datetime
    return datetime.strptime(t, "%Y-%m-%dT%H:%M:%S.%fZ").timestamp() * 1000

def bench():
    root = tempfile.mkdtemp(prefix="sbx-bench-recover.")
    dirs.append(root)
    url = "file://" + os.path.join(root, "store")
    os.makedirs(os.path.join(root, "store"))
    ctl_port = free_port()
    ctl = f"http://127.0.0.1:{ctl_port}"
    p = spawn([f"{BIN}/sandboxd", "control", "--listen", f"127.0.0.1:{ctl_port}",
               "--data-dir", os.path.join(root, "control"), "--store", url,
               "--node-lease-seconds", LEASE], os.path.join(root, "control.log"))
    wait_http(ctl + "/healthz", p, os.path.join(root, "control.log"), "the control plane")
    nodes, starts = {}, {}
    for name in ("a", "b", "c"):
        port = free_port()
        log = os.path.join(root, f"node-{name}.log")
        args = [f"{BIN}/sandboxd", "--listen", f"127.0.0.1:{port}",
                   "--data-dir", os.path.join(root, f"node-{name}"), "--images-dir", IMAGES,
                   "--agent", f"{BIN}/sbx-agent", "--cgroup-name", f"sbx-bench-recover-{name}",
                   "--preview-listen", "off", "--sleep-after-seconds", "never", "--warm-pool", "0",
                   "--disk-image-bytes", str(2 << 30), "--disk-bytes", str(256 << 20),
                   "--disk-overcommit", "4",
                   "--control", ctl, "--node-name", name, "--store", url]
        p = spawn(args, log)
        wait_http(f"http://127.0.0.1:{port}/healthz", p, log, f"node {name}")
        nodes[name] = p
        starts[name] = (args, log, f"http://127.0.0.1:{port}/healthz")
    end = time.time() + 30
    while sorted(n["name"] for n in must(ctl, "GET", "/internal/nodes")["data"]
                 if n["state"] == "ready") != ["a", "b", "c"]:
        if time.time() > end:
            raise SystemExit("the nodes did not join")
        time.sleep(0.1)
    # COUNT sandboxes on a (b and c draining meanwhile), each with a file, asleep.
    for n in ("b", "c"):
        must(ctl, "POST", f"/internal/nodes/{n}/drain", {"draining": True})
    ids = []
    for i in range(COUNT):
        sid = must(ctl, "POST", "/v1/sandboxes", {"sleep_after_seconds": None})["id"]
        for _ in range(600):
            if must(ctl, "GET", f"/v1/sandboxes/{sid}")["status"] == "running":
                break
            time.sleep(0.05)
        r = must(ctl, "POST", f"/v1/sandboxes/{sid}/exec",
                 {"command": f"echo {i} > /root/n", "wait_seconds": 60})
        if r.get("exit_code") != 0:
            raise SystemExit(f"exec: {r}")
        must(ctl, "POST", f"/v1/sandboxes/{sid}/sleep", {})
        ids.append(sid)
    for n in ("b", "c"):
        must(ctl, "POST", f"/internal/nodes/{n}/drain", {"draining": False})

    # 1. The evacuation.
    t = time.perf_counter()
    b = must(ctl, "POST", "/internal/nodes/a/evacuate", {})
    while b["ended_at"] is None:
        time.sleep(0.02)
        b = must(ctl, "GET", f"/internal/batches/{b['id']}")
    evac_ms = (time.perf_counter() - t) * 1000
    if b["counts"]["done"] != COUNT:
        raise SystemExit(f"the evacuation: {json.dumps(b['counts'])}")
    per_move = [ms_of(m["ended_at"]) - ms_of(m["created_at"]) for m in b["moves"]]
    where = {}
    for sid in ids:
        n = must(ctl, "GET", f"/v1/sandboxes/{sid}")["node"]["name"]
        where.setdefault(n, []).append(sid)

    # 2. b dies; recovered as soon as its lease and grace allow; its sandboxes answer elsewhere.
    must(ctl, "POST", "/internal/nodes/a/drain", {"draining": False})
    lost = where.get("b", [])
    t = time.perf_counter()
    nodes["b"].kill()
    nodes["b"].wait()
    while True:
        s, v = call(ctl, "POST", "/internal/nodes/b/recover", {})
        if s == 202:
            rcv = v["id"]
            break
        if s != 409 or v.get("error", {}).get("code") != "lease_held":
            raise SystemExit(f"recover: {s} {v}")
        time.sleep(0.1)
    accepted_ms = (time.perf_counter() - t) * 1000
    pending = set(lost)
    answered = {}
    while pending:
        for sid in list(pending):
            s, v = call(ctl, "GET", f"/v1/sandboxes/{sid}")
            if s == 200 and v["node"]["name"] != "b":
                answered[sid] = (time.perf_counter() - t) * 1000
                pending.discard(sid)
        if time.perf_counter() - t > 600:
            raise SystemExit(f"still not answering elsewhere: {sorted(pending)}")
        time.sleep(0.02)
    rb = must(ctl, "GET", f"/internal/batches/{rcv}")
    while rb["ended_at"] is None:
        time.sleep(0.05)
        rb = must(ctl, "GET", f"/internal/batches/{rcv}")
    for sid in lost[:3]:
        r = must(ctl, "POST", f"/v1/sandboxes/{sid}/exec", {"command": "cat /root/n", "wait_seconds": 60})
        if r.get("exit_code") != 0 or r["stdout"].strip() != str(ids.index(sid)):
            raise SystemExit(f"a recovered sandbox's file: {r}")
    # b started again (its copies of what was recovered are `taken`: it removes them), then
    # every sandbox deleted, so that the nodes' stop leaves nothing running.
    args, log, health = starts["b"]
    wait_http(health, spawn(args, log), log, "node b again")
    end = time.time() + 30
    while any(n["state"] == "lost" for n in must(ctl, "GET", "/internal/nodes")["data"]):
        if time.time() > end:
            raise SystemExit("node b did not join again")
        time.sleep(0.1)
    for sid in ids:
        must(ctl, "DELETE", f"/v1/sandboxes/{sid}")
    return evac_ms, per_move, where, accepted_ms, answered, rb

results = None
try:
    results = bench()
finally:
    for p in list(procs):
        stop(p)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)

evac_ms, per_move, where, accepted_ms, answered, rb = results
print(f"a fleet of three nodes and a control plane on one machine ({os.cpu_count()} cores), "
      f"node leases of {LEASE} s, the store a directory")
print(f"evacuation of {COUNT} sleeping sandboxes (4 moves at a time): {evac_ms:.0f} ms in all; "
      f"a move p50 {pct(per_move, 50):.0f} ms, p95 {pct(per_move, 95):.0f} ms; "
      f"to {', '.join(f'{n}: {len(v)}' for n, v in sorted(where.items()))}")
xs = list(answered.values())
print(f"node b killed (holding {len(answered)} sleeping sandboxes): recoverNode accepted after "
      f"{accepted_ms:.0f} ms (lease and grace); its sandboxes answering elsewhere: first "
      f"{min(xs):.0f} ms, p50 {pct(xs, 50):.0f} ms, all {max(xs):.0f} ms after the kill; "
      f"recovery {json.dumps(rb['counts'])}")
PY
