#!/usr/bin/env bash
# NAT throughput: a sandbox of the node at $1 (its API URL) downloads 512 MiB from a "test
# internet" namespace made here (198.18.0.2, the benchmarking range, routed from the host
# through a veth of its own): through the kernel's NAT alone, with egress rules of its own
# (default deny, the server's address allowed: the per-sandbox chains), and through the
# node's egress proxy (port 80 of a sandbox whose names are restricted). Prints MB/s. As root.
set -euo pipefail
url="$1"
ns=sbxbinet
cleanup() {
  [ -n "${srv:-}" ] && kill "$srv" 2>/dev/null || true
  ip link del sbxbinet0 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  rm -rf /dev/shm/sbx-bench-nat
}
trap cleanup EXIT
cleanup
mkdir -p /dev/shm/sbx-bench-nat
head -c $((512 << 20)) /dev/zero > /dev/shm/sbx-bench-nat/blob
ip netns add "$ns"
ip link add sbxbinet0 type veth peer name sbxbinet1
ip link set sbxbinet1 netns "$ns"
ip addr add 198.18.0.1/24 dev sbxbinet0
ip link set sbxbinet0 up
ip -n "$ns" addr add 198.18.0.2/24 dev sbxbinet1
ip -n "$ns" link set sbxbinet1 up
ip -n "$ns" link set lo up
ip -n "$ns" route add default via 198.18.0.1
ip netns exec "$ns" python3 - 2>/dev/null <<'PY' &
import http.server, threading
class H(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *a, **k): super().__init__(*a, directory='/dev/shm/sbx-bench-nat', **k)
    def log_message(self, *a): pass
    def copyfile(self, src, dst):
        # sendfile: the server is not what is measured.
        dst.flush()
        self.connection.sendfile(src)
for port in (80, 8080):
    s = http.server.ThreadingHTTPServer(('0.0.0.0', port), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
threading.Event().wait()
PY
srv=$!
for _ in $(seq 1 100); do
  curl -sfI -o /dev/null --max-time 1 http://198.18.0.2:8080/blob && break
  sleep 0.1
done
measure() {
  local label="$1" port="$2" egress="$3"
  local body
  body=$(printf '{"command":["curl","-s","-o","/dev/null","-w","%%{speed_download}","http://198.18.0.2:%s/blob"],"egress":%s,"timeout_seconds":120}' "$port" "$egress")
  local out
  out=$(curl -s -X POST "$url/v1/run" -H 'content-type: application/json' -d "$body")
  python3 -c 'import json,sys
label=sys.argv[1]; d=json.loads(sys.argv[2])
s=d.get("stdout") or ""
try: print(f"{label:<44} {float(s)/1e6:8.0f} MB/s")
except ValueError: print(f"{label:<44} failed: {d}")' "$label" "$out"
}
echo "NAT throughput (a sandbox downloading 512 MiB from the test internet)"
measure "kernel NAT, no rules of its own" 8080 null
measure "kernel NAT, default deny + address allowed" 8080 '{"default":"deny","allow":["198.18.0.2"]}'
measure "through the egress proxy (port 80)" 80 '{"default":"deny","allow":["198.18.0.2"]}'
