#!/usr/bin/env bash
# Benchmark: POST /v1/run of `echo hi` over HTTP against `runc run` of the same command on the
# same rootfs, at concurrency 1 and 8, in one run. As root. Prints a table.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
install_node_packages
install_packages runc curl
need_cargo
cargo build --release --quiet --bin sandboxd --bin sbx-agent --bin sbx-bench
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
target/release/sandboxd --images-dir "$images" build-base >&2
data=$(mktemp -d /tmp/sbx-bench.XXXXXX)
port=7799
RUST_LOG=warn target/release/sandboxd --listen 127.0.0.1:$port --data-dir "$data" \
  --images-dir "$images" --cgroup-name sbx-bench >"$data/sandboxd.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.05
done
target/release/sbx-bench --url "http://127.0.0.1:$port" --rootfs "$images/base/rootfs" "$@"
