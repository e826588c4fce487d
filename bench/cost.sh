#!/usr/bin/env bash
# What a run costs in CPU (issue #31), on a shared machine: CPU time, not wall time. A node of
# its own in a cpuacct cgroup of its own (its sandboxes' processes are its children: they are
# counted there too, the node moves them to its memory/cpu/pids/freezer groups only), then
# RUNS runs of `echo hi` at each concurrency of CONCS (a client outside that cgroup). Prints,
# per concurrency: runs/s, p50, and CPU ms per run of the node and its sandboxes (cpuacct,
# user and system), and of the whole machine (/proc/stat: includes the kernel's workers that
# release namespaces, btrfs's cleaner, and whatever else runs on the machine meanwhile).
# PERF=1: a `perf record -a -g` of each concurrency's runs, kept in $PERF_DIR (default
# /tmp/sbx-cost-perf) for `perf report`.
#
# As root. SBX_BIN_DIR: where sandboxd and sbx-agent are (default target/release, built if
# absent). NET=0: a node of --egress-default none; DISK=0: of --no-disk (no btrfs subvolume
# per sandbox); WARM: --warm-pool (default 2). The disk is bench/run.sh's otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
bin="${SBX_BIN_DIR:-target/release}"
if [ ! -x "$bin/sandboxd" ]; then
  need_cargo
  build_release sandboxd sbx-agent
fi
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
data=$(mktemp -d /tmp/sbx-cost.XXXXXX)
port=${PORT:-7791}
cg=/sys/fs/cgroup/cpuacct/sbx-cost-$$
mkdir "$cg"
net=()
[ "${NET:-1}" = 0 ] && net=(--egress-default none)
disk=(--disk-image-bytes $((4 << 30)) --disk-bytes $((256 << 20)) --disk-overcommit 8)
[ "${DISK:-1}" = 0 ] && disk=(--no-disk)
pid=
cleanup() {
  set +e
  [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  # The node's disk stays mounted when it did not start: nothing of it may be left.
  for m in $(awk -v d="$data/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
  rm -rf "$data"
  # Every process of the cgroup is gone with the node (its sandboxes are ended by its stop).
  for _ in $(seq 1 100); do rmdir "$cg" 2>/dev/null && break; sleep 0.1; done
}
trap cleanup EXIT
(
  echo $BASHPID >"$cg/cgroup.procs"
  exec env RUST_LOG=warn "$bin/sandboxd" --listen 127.0.0.1:$port --data-dir "$data/node" \
    --images-dir "$images" --cgroup-name sbx-cost --preview-listen off \
    --warm-pool "${WARM:-2}" "${disk[@]}" "${net[@]}" >"$data/sandboxd.log" 2>&1
) &
pid=$!
wait_healthy $port || { cat "$data/sandboxd.log" >&2; exit 1; }
URL="http://127.0.0.1:$port" CG="$cg" DATA="$data/node" RUNS="${RUNS:-400}" CONCS="${CONCS:-1 8}" \
  PERF="${PERF:-0}" PERF_DIR="${PERF_DIR:-/tmp/sbx-cost-perf}" NET="${NET:-1}" DISK="${DISK:-1}" python3 - <<'PY'
import concurrent.futures as cf, http.client, json, os, subprocess, threading, time

url, cg = os.environ["URL"], os.environ["CG"]
host, port = url.split("//")[1].split(":")
runs = int(os.environ["RUNS"])
tls = threading.local()
hz = os.sysconf("SC_CLK_TCK")

def run():
    c = getattr(tls, "c", None)
    if c is None:
        c = tls.c = http.client.HTTPConnection(host, int(port), timeout=60)
    t = time.perf_counter()
    c.request("POST", "/v1/run", body=b'{"command":["echo","hi"]}',
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    b = r.read()
    v = json.loads(b)
    assert r.status == 200 and v["stdout"] == "hi\n", b[:300]
    return (time.perf_counter() - t) * 1e3

def cgroup_cpu():
    ns = int(open(f"{cg}/cpuacct.usage").read())
    st = dict(l.split() for l in open(f"{cg}/cpuacct.stat"))
    return ns / 1e6, int(st["user"]) * 1000 / hz, int(st["system"]) * 1000 / hz

def machine_busy():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]
    return (sum(f[:8]) - idle) * 1000 / hz

for _ in range(20):
    run()
time.sleep(3)
print(f"echo hi per run, network {'on' if os.environ['NET'] != '0' else 'off'}, disk {'off' if os.environ['DISK'] == '0' else 'on'}, {os.cpu_count()} cores; "
      f"load average before: {open('/proc/loadavg').read().split()[0]}")
print(f"{'conc':>4} {'runs':>5} {'runs/s':>7} {'p50 ms':>7} {'p95 ms':>7} "
      f"{'node+sbx CPU ms/run':>20} {'(user':>6} {'sys)':>6} {'machine CPU ms/run':>19}")
for conc in [int(c) for c in os.environ["CONCS"].split()]:
    perf = None
    if os.environ["PERF"] == "1":
        os.makedirs(os.environ["PERF_DIR"], exist_ok=True)
        out = os.path.join(os.environ["PERF_DIR"], f"conc{conc}-net{os.environ['NET']}.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-a", "-g", "-F", "499", "-o", out],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
    c0, b0, t0 = cgroup_cpu(), machine_busy(), time.perf_counter()
    try:
        with cf.ThreadPoolExecutor(conc) as ex:
            lat = sorted(ex.map(lambda _: run(), range(runs)))
    finally:
        # A failed run stops the recording too.
        wall = time.perf_counter() - t0
        c1, b1 = cgroup_cpu(), machine_busy()
        if perf:
            perf.send_signal(2)
            perf.wait()
    p = lambda q: lat[min(len(lat) - 1, int(round(q * (len(lat) - 1))))]
    print(f"{conc:>4} {runs:>5} {runs / wall:>7.1f} {p(0.5):>7.2f} {p(0.95):>7.2f} "
          f"{(c1[0] - c0[0]) / runs:>20.2f} {(c1[1] - c0[1]) / runs:>6.2f} {(c1[2] - c0[2]) / runs:>6.2f} "
          f"{(b1 - b0) / runs:>19.2f}")
    # Sandboxes whose teardown is still under way (their directories, each a disk promised).
    left = len(os.listdir(os.path.join(os.environ["DATA"], "sandboxes")))
    print(f"     sandbox directories right after: {left} (the warm pool's included)")
    time.sleep(2)
PY
