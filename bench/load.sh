#!/usr/bin/env bash
# Load, then an audit of what the node left (issue #17). Against a node of its own (network on,
# as a user's): 1,000 POST /v1/run of `echo hi` at concurrency 32; then 200 kept sandboxes made
# at concurrency 32, each given a command, an upload of 64 KiB and its download (checked byte
# for byte), then deleted. Prints p50/p99 and errors of each part. Then the audit, while the
# node runs (its open descriptors, the rows it answers) and after it stopped (processes in its
# cgroups, its cgroup folders, mounts under its data directory, network namespaces and host
# interfaces it made, temporary files, rows in its database): every leak is printed and the
# script exits 1 if there is one. The node's disk is 8 GiB, each sandbox's 256 MiB promised
# eight times over (a default node promises no more than its disk holds: 200 sandboxes of
# 1 GiB would not fit).
#
# As root. SBX_BIN_DIR=target/debug uses built binaries instead of a release build;
# RUNS, KEPT and CONC change the sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
if [ -z "${SBX_BIN_DIR:-}" ]; then
  need_cargo
  build_release sandboxd sbx-agent
fi
bin="${SBX_BIN_DIR:-target/release}"
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
data=$(mktemp -d /tmp/sbx-bench-load.XXXXXX)
port=7793
cg=sbx-bench-load
printf 'max_sandboxes = 400\n' >"$data/config.toml"
ifaces_before=$(ls /sys/class/net | sort)
RUST_LOG=warn "$bin/sandboxd" --listen 127.0.0.1:$port --data-dir "$data/node" \
  --images-dir "$images" --cgroup-name $cg --preview-listen off --sleep-after-seconds never \
  --disk-image-bytes $((8 << 30)) --disk-bytes $((256 << 20)) --disk-overcommit 8 \
  --config "$data/config.toml" >"$data/sandboxd.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$data"' EXIT
wait_healthy $port
URL="http://127.0.0.1:$port" PID=$pid CG=$cg DATA="$data/node" IFACES_BEFORE="$ifaces_before" \
  RUNS="${RUNS:-1000}" KEPT="${KEPT:-200}" CONC="${CONC:-32}" python3 - <<'PY'
import concurrent.futures as cf, glob, json, os, signal, sqlite3, time, urllib.error, urllib.request

url, pid, cg, data = os.environ["URL"], int(os.environ["PID"]), os.environ["CG"], os.environ["DATA"]
runs, kept, conc = int(os.environ["RUNS"]), int(os.environ["KEPT"]), int(os.environ["CONC"])

def call(method, path, body=None, raw=None, ctype="application/json"):
    data_ = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data_, method=method, headers={"Content-Type": ctype})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, r.read()

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")

def fds():
    return len(os.listdir(f"/proc/{pid}/fd"))

def timed(f):
    t = time.perf_counter()
    try:
        f()
        return (time.perf_counter() - t) * 1000, None
    except Exception as e:  # an error is counted, not fatal
        return (time.perf_counter() - t) * 1000, repr(e)[:300]

def report(name, results):
    ms = [m for m, e in results if e is None]
    errs = [e for _, e in results if e is not None]
    print(f"{name:<34} n={len(results):<5} p50 {pct(ms, 50):8.1f} ms   p99 {pct(ms, 99):8.1f} ms   errors {len(errs)}")
    for e in errs[:5]:
        print("    error:", e)
    return len(errs)

# Warm up (the base template, the pools), then the node's descriptors at rest.
call("POST", "/v1/run", {"command": "true"})
time.sleep(2)
fds_before = fds()
_, b = call("GET", "/internal/node")
prefix = (json.loads(b).get("network") or {}).get("interface_prefix") or "\0"

def fd_kinds():
    kinds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        k = t.split(":")[0] if ":" in t else ("file " + t.rsplit("/", 1)[-1] if "/" in t else t)
        kinds[k] = kinds.get(k, 0) + 1
    return kinds

kinds_before = fd_kinds()

def one_run():
    s, b = call("POST", "/v1/run", {"command": "echo hi"})
    v = json.loads(b)
    assert s == 200 and v["exit_code"] == 0 and v["stdout"] == "hi\n", v

errors = 0
t0 = time.perf_counter()
with cf.ThreadPoolExecutor(conc) as ex:
    res = list(ex.map(lambda _: timed(one_run), range(runs)))
wall = time.perf_counter() - t0
errors += report(f"POST /v1/run x{runs} @{conc}", res)
print(f"{'':<34} {runs / wall:.0f} runs/s")

ids, made, execs, ups, downs, dels = [], [], [], [], [], []
blob = os.urandom(64 << 10)

def make():
    s, b = call("POST", "/v1/sandboxes", {"sleep_after_seconds": None})
    v = json.loads(b)
    sid = v["id"]
    for _ in range(600):
        s, b = call("GET", f"/v1/sandboxes/{sid}")
        if json.loads(b)["status"] == "running":
            break
        time.sleep(0.05)
    ids.append(sid)

with cf.ThreadPoolExecutor(conc) as ex:
    made = list(ex.map(lambda _: timed(make), range(kept)))
errors += report(f"create kept sandbox x{kept} @{conc}", made)

def exec_(sid):
    s, b = call("POST", f"/v1/sandboxes/{sid}/exec", {"command": "echo $HOSTNAME", "wait_seconds": 60})
    v = json.loads(b)
    assert v["exit_code"] == 0 and v["stdout"].strip(), v

def up(sid):
    s, _ = call("PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/blob", raw=blob, ctype="application/octet-stream")
    assert s in (200, 201), s

def down(sid):
    s, b = call("GET", f"/v1/sandboxes/{sid}/files?path=/tmp/blob")
    assert s == 200 and b == blob, (s, len(b))

def delete(sid):
    s, _ = call("DELETE", f"/v1/sandboxes/{sid}")
    assert s in (200, 204), s

for name, f, out in [("exec in each", exec_, execs), ("upload 64 KiB to each", up, ups),
                     ("download it, byte for byte", down, downs), ("delete each", delete, dels)]:
    with cf.ThreadPoolExecutor(conc) as ex:
        out.extend(ex.map(lambda sid: timed(lambda: f(sid)), list(ids)))
    errors += report(f"{name} @{conc}", out)

# The audit while it runs: its descriptors back to rest, no sandbox it answers for.
leaks = []
for _ in range(60):
    if fds() <= fds_before + 4:
        break
    time.sleep(0.5)
print(f"node's open descriptors: {fds_before} at rest before, {fds()} after")
if fds() > fds_before + 4:
    after = fd_kinds()
    grown = {k: f"{kinds_before.get(k, 0)} -> {n}" for k, n in after.items() if n > kinds_before.get(k, 0)}
    leaks.append(f"descriptors: {fds_before} -> {fds()}: {grown}")
_, b = call("GET", "/v1/sandboxes")
listed = json.loads(b)
listed = listed.get("data", listed) if isinstance(listed, dict) else listed
if listed:
    leaks.append(f"sandboxes still listed: {len(listed)}")

# Then stopped: nothing of it may stay.
os.kill(pid, signal.SIGTERM)
for _ in range(600):
    if not os.path.exists(f"/proc/{pid}"):
        break
    time.sleep(0.1)
procs = []
for p in glob.glob("/proc/[0-9]*/cgroup"):
    try:
        if f"/{cg}/" in open(p).read():
            procs.append(p.split("/")[2])
    except OSError:
        pass
if procs:
    leaks.append(f"processes in its cgroups: {procs[:10]}")
groups = [d for d in glob.glob(f"/sys/fs/cgroup/**/{cg}/*/", recursive=True)]
if groups:
    leaks.append(f"cgroup folders: {groups[:5]}")
mounts = [l for l in open("/proc/self/mountinfo") if data in l]
if mounts:
    leaks.append(f"mounts under its data directory: {len(mounts)}: {mounts[:3]}")
before = set(os.environ["IFACES_BEFORE"].split())
def ours():
    return sorted(i for i in set(os.listdir("/sys/class/net")) - before if i.startswith(prefix))
new_ifaces = ours()
if new_ifaces:
    # The kernel removes a namespace's veth in batches: give it a moment.
    time.sleep(10)
    new_ifaces = ours()
if new_ifaces:
    leaks.append(f"host interfaces: {new_ifaces[:10]}")
left = []
for root, dirs, files in os.walk(os.path.join(data, "sandboxes")):
    left += [os.path.join(root, f) for f in files] + [os.path.join(root, d) for d in dirs]
temps = [os.path.join(r, f) for r, _, fs in os.walk(data) for f in fs if ".tmp" in f or f.startswith("tmp")]
if left or temps:
    leaks.append(f"files left: {(left + temps)[:10]}")
db = sqlite3.connect(f"file:{os.path.join(data, 'state.db')}?mode=ro", uri=True)
for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'"):
    if table in ("sandboxes", "execs"):
        n = db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        if n:
            leaks.append(f"rows in {table}: {n}")
print(f"errors: {errors}; leaks after the audit: {len(leaks)}")
for l in leaks:
    print("    leak:", l)
raise SystemExit(1 if errors or leaks else 0)
PY
