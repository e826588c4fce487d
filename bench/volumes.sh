#!/usr/bin/env bash
# Create -> running of a kept sandbox (POST /v1/sandboxes answered `running`) with no volume,
# with one volume, and with one volume given `copy` of the image's /etc: p50 and p95 of N
# rounds each (default 20), each sandbox deleted after; and create/delete of a volume. Warm
# pool 0 for all three, so that they compare (a create without volumes takes a warm sandbox
# when the pool has one: see the last line, with the pool on). Starts a node of its own. As
# root. PROFILE=debug uses target/debug instead of a release build. NO_DISK=1: the same node
# with --no-disk (sandboxes' directories plain, no volumes), creates without volume only: what
# a sandbox's subvolume costs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
need_cargo
profile="${PROFILE:-release}"
if [ "$profile" = release ]; then
  build_release sandboxd sbx-agent
fi
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
data=$(mktemp -d /tmp/sbx-bench-volumes.XXXXXX)
port=7796
start_node() {
  RUST_LOG=warn target/$profile/sandboxd --listen 127.0.0.1:$port --data-dir "$data" \
    --images-dir "$images" --cgroup-name sbx-bench-volumes --preview-listen off \
    --egress-default none --sleep-after-seconds never --warm-pool "$1" ${NO_DISK:+--no-disk} \
    >>"$data/sandboxd.log" 2>&1 &
  pid=$!
  wait_healthy $port
}
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; umount -l "$data/disk" 2>/dev/null; rm -rf "$data"' EXIT
bench() {
URL="http://127.0.0.1:$port" N="${N:-20}" WARM="$1" NO_DISK="${NO_DISK:-}" python3 - <<'PY'
import json, os, time, urllib.error, urllib.request

url, n, warm = os.environ["URL"], int(os.environ["N"]), os.environ["WARM"] != "0"
no_disk = os.environ.get("NO_DISK", "") != ""

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

def show(what, xs):
    print(f"{what:<44} p50 {pct(xs, 50) * 1000:7.1f} ms   p95 {pct(xs, 95) * 1000:7.1f} ms")

def creates(body, fresh_volume=None):
    xs = []
    for _ in range(n):
        b = json.loads(json.dumps(body))
        vid = None
        if fresh_volume is not None:
            vid = call("POST", "/v1/volumes", {})["id"]
            b["volumes"][0]["volume"] = vid
        t = time.perf_counter()
        sb = call("POST", "/v1/sandboxes", b)
        xs.append(time.perf_counter() - t)
        assert sb["status"] == "running", sb
        call("DELETE", f"/v1/sandboxes/{sb['id']}")
        if vid:
            call("DELETE", f"/v1/volumes/{vid}")
        if warm:
            time.sleep(0.3)  # the pool refills
    return xs

if no_disk:
    show("create -> running, --no-disk" + (" (warm pool 2)" if warm else ""), creates({}))
elif warm:
    show("create -> running, no volume (warm pool 2)", creates({}))
else:
    vol = call("POST", "/v1/volumes", {"name": "bench"})["id"]
    show("create -> running, no volume", creates({}))
    show("create -> running, one volume", creates({"volumes": [{"path": "/data", "volume": vol}]}))
    show("create -> running, one new volume, copy /etc",
         creates({"volumes": [{"path": "/etc", "volume": "", "copy": True}]}, fresh_volume=True))
    xs, ys = [], []
    for _ in range(n):
        t = time.perf_counter()
        v = call("POST", "/v1/volumes", {})
        xs.append(time.perf_counter() - t)
        t = time.perf_counter()
        call("DELETE", f"/v1/volumes/{v['id']}")
        ys.append(time.perf_counter() - t)
    show("POST /v1/volumes", xs)
    show("DELETE /v1/volumes/{id}", ys)
    call("DELETE", f"/v1/volumes/{vol}")
PY
}
start_node 0
bench 0
kill $pid; wait $pid 2>/dev/null || true
start_node 2
sleep 1
bench 2
