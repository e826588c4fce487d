#!/usr/bin/env bash
# Sleep, wake, snapshots and forks of a sandbox holding 50 MB resident (a Python process):
# p50 and p95 of N rounds (default 10) of freeze and thaw (the cgroup freezer, as the node
# pauses an idle sandbox), POST …/sleep, POST …/wake, POST …/snapshots, a sandbox made from a
# snapshot (a fork's restore), POST …/fork {count: 1} and {count: 4} (its copies restored as
# many at once as there are cores); and the disk a snapshot takes. Starts a
# release node of its own. As root, with CRIU (scripts/criu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
need_cargo
scripts/criu.sh
build_release sandboxd sbx-agent
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
data=$(mktemp -d /tmp/sbx-bench-sleep.XXXXXX)
port=7795
# A disk of its own size, as run.sh's (a default node takes half of what the host has free:
# on a full host, too little for a fork of 4 beside its parent and snapshot).
RUST_LOG=warn target/release/sandboxd --listen 127.0.0.1:$port --data-dir "$data" \
  --images-dir "$images" --cgroup-name sbx-bench-sleep --preview-listen off \
  --sleep-after-seconds never \
  --disk-image-bytes $((4 << 30)) --disk-bytes $((256 << 20)) --disk-overcommit 8 \
  >"$data/sandboxd.log" 2>&1 &
pid=$!
trap 'stop_nodes $pid -- "$data"' EXIT
wait_healthy $port
URL="http://127.0.0.1:$port" CG=sbx-bench-sleep N="${N:-10}" python3 - <<'PY'
import json, os, time, urllib.error, urllib.request

url, cg, n = os.environ["URL"], os.environ["CG"], int(os.environ["N"])

def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{method} {path}: {e.code} {e.read().decode()}")

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

COUNTER = ("import socket\nblob = bytearray(b'x') * (50 << 20)\nn = 0\ns = socket.socket()\n"
           "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', 7000))\n"
           "s.listen(16)\nwhile True:\n    c, _ = s.accept()\n    if c.recv(1) == b'+':\n        n += 1\n        c.sendall(str(n).encode())\n    c.close()\n")
READY = "import socket; socket.create_connection(('127.0.0.1', 7000), timeout=1)"
sb = call("POST", "/v1/sandboxes", {"start_command": ["python3", "-c", COUNTER],
                                     "ready": {"command": 'python3 -c "' + READY + '"'},
                                     "sleep_after_seconds": None})
sid = sb["id"]
# The first sandbox of its settings builds their template: answered starting.
for _ in range(1200):
    if call("GET", f"/v1/sandboxes/{sid}")["status"] == "running":
        break
    time.sleep(0.1)
else:
    raise SystemExit(f"not running: {sb}")
def ask(s):
    ask = "import socket; c = socket.create_connection(('127.0.0.1', 7000), timeout=5); c.sendall(b'+'); print(c.recv(9))"
    r = call("POST", f"/v1/sandboxes/{s}/exec", {"command": ["python3", "-c", ask], "wait_seconds": 30})
    assert r["exit_code"] == 0, r

import glob
def cgroup_file(ctrl, name):
    # Under the node's own cgroup in each hierarchy.
    found = glob.glob(f"/sys/fs/cgroup/{ctrl}/**/{cg}/{sid}/{name}", recursive=True)
    assert found, (ctrl, name)
    return found[0]
freezer = cgroup_file("freezer", "freezer.state")
mem = cgroup_file("memory", "memory.usage_in_bytes")
rows = {k: [] for k in ["freeze", "thaw", "sleep", "wake", "snapshot", "sandbox from a snapshot", "fork (count 1)", "fork (count 4)"]}
def state():
    with open(freezer) as f:
        return f.read().strip()
def put(v, want):
    t = time.perf_counter()
    with open(freezer, "w") as f:
        f.write(v)
    while state() != want:
        pass
    return time.perf_counter() - t
awake = int(open(mem).read())
for _ in range(n):
    rows["freeze"].append(put("FROZEN", "FROZEN"))
    rows["thaw"].append(put("THAWED", "THAWED"))
asleep = None
for _ in range(n):
    t = time.perf_counter(); call("POST", f"/v1/sandboxes/{sid}/sleep", {}); rows["sleep"].append(time.perf_counter() - t)
    asleep = int(open(mem).read())
    t = time.perf_counter(); call("POST", f"/v1/sandboxes/{sid}/wake", {}); rows["wake"].append(time.perf_counter() - t)
    ask(sid)
sizes = []
for _ in range(n):
    t = time.perf_counter(); snap = call("POST", f"/v1/sandboxes/{sid}/snapshots", {}); rows["snapshot"].append(time.perf_counter() - t)
    sizes.append(snap["size_bytes"])
    t = time.perf_counter(); made = call("POST", "/v1/sandboxes", {"snapshot": snap["id"]}); rows["sandbox from a snapshot"].append(time.perf_counter() - t)
    ask(made["id"])
    call("DELETE", f"/v1/sandboxes/{made['id']}")
    call("DELETE", f"/v1/snapshots/{snap['id']}")
for count in (1, 4):
    for _ in range(n):
        t = time.perf_counter(); f = call("POST", f"/v1/sandboxes/{sid}/fork", {"count": count}); rows[f"fork (count {count})"].append(time.perf_counter() - t)
        assert len(f["sandboxes"]) == count, f
        for s in f["sandboxes"]:
            call("DELETE", f"/v1/sandboxes/{s['id']}")
        call("DELETE", f"/v1/snapshots/{f['snapshot']['id']}")
call("DELETE", f"/v1/sandboxes/{sid}")
print("sleep, wake, snapshots and forks of a sandbox holding 50 MB resident (2 cores)")
print(f"{'what':28} {'runs':>5} {'p50 ms':>9} {'p95 ms':>9}")
for k, xs in rows.items():
    print(f"{k:28} {len(xs):>5} {pct(xs, 50) * 1000:>9.2f} {pct(xs, 95) * 1000:>9.2f}")
print(f"memory of its cgroup: awake {awake / 2**20:.1f} MiB, asleep {asleep / 2**20:.1f} MiB")
print(f"a snapshot takes {pct(sizes, 50) / 2**20:.1f} MiB on disk (p50)")
print("goals: freeze/thaw <= 1 ms, wake and fork <= 150 ms")
PY
