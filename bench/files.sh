#!/usr/bin/env bash
# Benchmark of the file API: upload and download of 1 GiB (PUT/GET /v1/sandboxes/{id}/files)
# over loopback, with the node's peak RSS (sampled, and VmHWM from /proc/<pid>/status), then a
# 2 GiB pass each way for memory. As root. Prints a table. Goal: >= 500 MB/s each way, and a
# node whose memory does not grow with the size of a file.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
install_node_packages
install_packages curl
need_cargo
build_release sandboxd sbx-agent sbx-bench-files
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
target/release/sandboxd --images-dir "$images" build-base >&2
data=$(mktemp -d /var/tmp/sbx-bench-files.XXXXXX)
port=7798
RUST_LOG=warn target/release/sandboxd --listen 127.0.0.1:$port --data-dir "$data" \
  --images-dir "$images" --cgroup-name sbx-bench-files --warm-pool 0 >"$data/sandboxd.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.05
done
target/release/sbx-bench-files --url "http://127.0.0.1:$port" --pid "$pid" \
  --bytes $((1 << 30)) --memory-pass-bytes $((2 << 30)) "$@"
