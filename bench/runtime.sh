#!/usr/bin/env bash
# Runtime settings (issue #16): p50 and p95 of N (default 20) kept sandboxes of the base image
# from POST /v1/sandboxes to `running` (the create answers once it is): without runtime
# (taken from the warm pool), without runtime and without a warm pool, and with runtime
# (ulimits, sysctls, two tmpfs, /dev/shm's size: made at init, never warm). Starts a node of
# its own; PROFILE=debug uses target/debug (default release). As root.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
need_cargo
profile="${PROFILE:-release}"
if [ "$profile" = release ]; then
  build_release sandboxd sbx-agent
else
  cargo build --quiet --bin sandboxd --bin sbx-agent
fi
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
data=$(mktemp -d /tmp/sbx-bench-runtime.XXXXXX)
port=7796
start_node() {
  RUST_LOG=warn target/$profile/sandboxd --listen 127.0.0.1:$port --data-dir "$data/$1" \
    --images-dir "$images" --cgroup-name sbx-bench-runtime --preview-listen off \
    --egress-default none --sleep-after-seconds never --warm-pool "$2" \
    >"$data/sandboxd-$1.log" 2>&1 &
  pid=$!
  wait_healthy $port
}
stop_node() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
trap 'stop_node; rm -rf "$data"' EXIT
measure() {
  URL="http://127.0.0.1:$port" N="${N:-20}" WHAT="$1" RUNTIME="$2" python3 - <<'PY'
import json, os, time, urllib.request
url, n, what = os.environ["URL"], int(os.environ["N"]), os.environ["WHAT"]
runtime = json.loads(os.environ["RUNTIME"])
def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")
body = {} if runtime is None else {"runtime": runtime}
call("DELETE", f"/v1/sandboxes/{call('POST', '/v1/sandboxes', body)['id']}")  # its template
xs = []
for _ in range(n):
    t = time.perf_counter()
    sb = call("POST", "/v1/sandboxes", body)
    xs.append(time.perf_counter() - t)
    assert sb["status"] == "running", sb
    call("DELETE", f"/v1/sandboxes/{sb['id']}")
    time.sleep(0.3)  # the warm pool refills
xs.sort()
pct = lambda p: xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] * 1000
print(f"{what:44} {n:>5} {pct(50):>9.1f} {pct(95):>9.1f}")
PY
}
RT='{"ulimits": {"nofile": 1024, "nproc": 512}, "sysctls": {"kernel.shmmax": "1073741824", "net.ipv4.ip_unprivileged_port_start": "80"}, "tmpfs": ["/run/app", {"path": "/scratch", "size_bytes": 67108864}], "shm_size_bytes": 268435456}'
echo "create -> running of a kept sandbox ($profile build, $(nproc) cores)"
printf '%-44s %5s %9s %9s\n' what runs "p50 ms" "p95 ms"
start_node warm 2
measure "no runtime (warm pool)" null
measure "runtime (made at init)" "$RT"
stop_node
start_node cold 0
measure "no runtime, no warm pool" null
stop_node
