#!/usr/bin/env bash
# What a move costs (issue #28): a fleet on this machine (a control plane and two nodes, all
# three on loopback) and a kept sandbox with 50 MB of files (random bytes: incompressible) and
# a running process, moved back and forth N times (default 10) through each object store: a
# directory (file://) and SeaweedFS over S3 (scripts/seaweedfs.sh installs `weed`). Prints p50
# and p95 of the whole move (POST /internal/moves to the move `done`), of the old node's wait
# for the store (the release's `waited_ms`), and of the new node's disk and memory (the
# takeover's `disk_ms`, `memory_ms`, and where it read them: `source`). After each move the
# sandbox's process must still count and, at the end, its files be the same.
#
# As root, with CRIU (scripts/criu.sh) and the base image (/var/lib/sbx/images, or
# SBX_IMAGES_DIR). SBX_BIN_DIR=target/debug uses built binaries instead of a release build;
# N changes the count; STORES=dir or STORES=s3 runs one store only.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
if [ -z "${SBX_BIN_DIR:-}" ]; then
  need_cargo
  scripts/criu.sh
  build_release sandboxd sbx-agent
fi
stores="${STORES:-dir s3}"
weed=""
if [[ " $stores " == *" s3 "* ]]; then
  weed="${SBX_WEED:-$(scripts/seaweedfs.sh)}"
fi
BIN="$(cd "${SBX_BIN_DIR:-target/release}" && pwd)" IMAGES="${SBX_IMAGES_DIR:-/var/lib/sbx/images}" \
  WEED="$weed" STORES="$stores" N="${N:-10}" exec python3 - <<'PY'
import hashlib, json, os, shutil, signal, socket, subprocess, sys, tempfile, time
import urllib.error, urllib.request

BIN, IMAGES, WEED = os.environ["BIN"], os.environ["IMAGES"], os.environ["WEED"]
STORES, N = os.environ["STORES"].split(), int(os.environ["N"])
procs, dirs = [], []

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p

def call(base, method, path, body=None, ok=(200, 201, 202)):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        if e.code in ok:
            return json.loads(text)
        raise SystemExit(f"{method} {base}{path}: {e.code} {text}")

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

def spawn(args, log, env=None):
    p = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn", **(env or {})})
    procs.append(p)
    return p

def start_weed(root):
    ports = [free_port() for _ in range(8)]
    d = os.path.join(root, "weed")
    os.makedirs(d)
    log = os.path.join(root, "weed.log")
    p = subprocess.Popen([WEED, "server", "-s3", "-ip=127.0.0.1", f"-dir={d}",
                          f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}",
                          f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}",
                          f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
                          f"-s3.port={ports[6]}", f"-s3.port.grpc={ports[7]}",
                          "-s3.port.iceberg=0", "-s3.port.lance=0",
                          f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock",
                          "-master.volumeSizeLimitMB=256", "-volume.max=0"],
                         cwd=d, env={**os.environ, "TMPDIR": d}, stdout=open(log, "ab"),
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    procs.append(p)
    s3 = f"http://127.0.0.1:{ports[6]}"
    end = time.time() + 60
    while True:
        try:
            req = urllib.request.Request(s3 + "/sbx-bench", method="PUT")
            urllib.request.urlopen(req, timeout=5).read()
            req = urllib.request.Request(s3 + "/sbx-bench/probe", data=b"ok", method="PUT")
            urllib.request.urlopen(req, timeout=5).read()
            break
        except Exception as e:
            if time.time() > end or p.poll() is not None:
                raise SystemExit(f"SeaweedFS did not get ready: {e}")
            time.sleep(0.2)
    env = {"AWS_ENDPOINT_URL": s3, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "sbx-bench", "AWS_SECRET_ACCESS_KEY": "sbx-bench-secret-key"}
    return "s3://sbx-bench/moves", env, ports

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")

def bench(kind):
    root = tempfile.mkdtemp(prefix=f"sbx-bench-move-{kind}.")
    dirs.append(root)
    env, weed_ports = {}, []
    if kind == "dir":
        url = "file://" + os.path.join(root, "store")
        os.makedirs(os.path.join(root, "store"))
    else:
        url, env, weed_ports = start_weed(root)
    ctl_port = free_port()
    ctl = f"http://127.0.0.1:{ctl_port}"
    p = spawn([f"{BIN}/sandboxd", "control", "--listen", f"127.0.0.1:{ctl_port}",
               "--data-dir", os.path.join(root, "control"), "--store", url],
              os.path.join(root, "control.log"), env)
    wait_http(ctl + "/healthz", p, os.path.join(root, "control.log"), "the control plane")
    nodes = {}
    for name in ("a", "b"):
        port = free_port()
        log = os.path.join(root, f"node-{name}.log")
        cg = f"sbx-bench-move-{kind}-{name}"
        p = spawn([f"{BIN}/sandboxd", "--listen", f"127.0.0.1:{port}",
                   "--data-dir", os.path.join(root, f"node-{name}"), "--images-dir", IMAGES,
                   "--agent", f"{BIN}/sbx-agent", "--cgroup-name", cg,
                   "--preview-listen", "off", "--sleep-after-seconds", "never", "--warm-pool", "0",
                   "--control", ctl, "--node-name", name, "--store", url], log, env)
        wait_http(f"http://127.0.0.1:{port}/healthz", p, log, f"node {name}")
        nodes[name] = f"http://127.0.0.1:{port}"
    end = time.time() + 30
    while sorted(n["name"] for n in call(ctl, "GET", "/internal/nodes")["data"]
                 if n["state"] == "ready") != ["a", "b"]:
        if time.time() > end:
            raise SystemExit("the nodes did not join")
        time.sleep(0.1)
    # The sandbox on a (b draining meanwhile).
    call(ctl, "POST", "/internal/nodes/b/drain", {"draining": True})
    sb = call(ctl, "POST", "/v1/sandboxes", {"sleep_after_seconds": None})
    call(ctl, "POST", "/internal/nodes/b/drain", {"draining": False})
    sid = sb["id"]
    for _ in range(600):
        if call(ctl, "GET", f"/v1/sandboxes/{sid}")["status"] == "running":
            break
        time.sleep(0.1)
    def sh(line):
        r = call(ctl, "POST", f"/v1/sandboxes/{sid}/exec", {"command": line, "wait_seconds": 120})
        if r.get("exit_code") != 0:
            raise SystemExit(f"{line}: {r}")
        return r["stdout"]
    sh("mkdir -p /root/files && for i in $(seq 1 50); do head -c 1048576 /dev/urandom > /root/files/f$i; done; sync")
    sums = sh("cd /root/files && sha256sum f* | sha256sum")
    sh("setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.1; done' >/dev/null 2>&1 </dev/null &")
    time.sleep(0.5)
    rows = {"move (POST to done)": [], "release: wait for the store": [],
            "takeover: disk": [], "takeover: memory": []}
    sources = {}
    on = "a"
    last = int(sh("cat /tmp/c"))
    for i in range(N):
        to = "b" if on == "a" else "a"
        t = time.perf_counter()
        mv = call(ctl, "POST", "/internal/moves", {"sandbox_id": sid, "to": to})
        while mv["step"] not in ("done", "failed"):
            time.sleep(0.02)
            mv = call(ctl, "GET", f"/internal/moves/{mv['id']}")
        took = time.perf_counter() - t
        if mv["step"] != "done":
            raise SystemExit(f"move {i + 1} failed: {json.dumps(mv)}")
        rows["move (POST to done)"].append(took * 1000)
        rows["release: wait for the store"].append(mv["release"]["waited_ms"])
        rows["takeover: disk"].append(mv["takeover"]["disk_ms"])
        rows["takeover: memory"].append(mv["takeover"]["memory_ms"])
        src = mv["takeover"]["source"]
        sources[src] = sources.get(src, 0) + 1
        on = to
        now = int(sh("cat /tmp/c"))
        if now < last:
            raise SystemExit(f"the process began again after move {i + 1}: {now} < {last}")
        last = now
    time.sleep(0.3)
    if int(sh("cat /tmp/c")) <= last:
        raise SystemExit("the process stopped counting")
    if sh("cd /root/files && sha256sum f* | sha256sum") != sums:
        raise SystemExit("the files changed")
    call(ctl, "DELETE", f"/v1/sandboxes/{sid}")
    for p in list(procs):
        stop(p)
    return rows, sources

def stop(p):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    procs.remove(p)

results = {}
try:
    for kind in STORES:
        results[kind] = bench(kind)
finally:
    for p in list(procs):
        stop(p)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)

print(f"moves of a kept sandbox with 50 MB of files (random) and a process, back and forth "
      f"between two nodes on one machine ({os.cpu_count()} cores), {N} each")
print(f"{'store':6} {'what':30} {'runs':>5} {'p50 ms':>9} {'p95 ms':>9}")
for kind, (rows, sources) in results.items():
    for k, xs in rows.items():
        print(f"{kind:6} {k:30} {len(xs):>5} {pct(xs, 50):>9.1f} {pct(xs, 95):>9.1f}")
    print(f"{kind:6} {'takeover source':30} {', '.join(f'{s}: {n}' for s, n in sources.items())}")
PY
