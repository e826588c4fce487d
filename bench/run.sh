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
build_release sandboxd sbx-agent sbx-bench
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
target/release/sandboxd --images-dir "$images" build-base >&2
data=$(mktemp -d /tmp/sbx-bench.XXXXXX)
port=7799
# Each node's disk of its own size (a default node reserves half of what the host has free, and
# promises a sandbox 1 GiB: concurrency 8 beside the warm pool would find it full).
disk=(--disk-image-bytes $((4 << 30)) --disk-bytes $((256 << 20)) --disk-overcommit 8)
RUST_LOG=warn target/release/sandboxd --listen 127.0.0.1:$port --data-dir "$data" \
  --images-dir "$images" --cgroup-name sbx-bench --preview-listen off "${disk[@]}" \
  >"$data/sandboxd.log" 2>&1 &
pid=$!
# A second node whose sandboxes have no network, for the network's cost.
data2=$(mktemp -d /tmp/sbx-bench.XXXXXX)
port2=7798
RUST_LOG=warn target/release/sandboxd --listen 127.0.0.1:$port2 --data-dir "$data2" \
  --images-dir "$images" --cgroup-name sbx-bench-lo --egress-default none --preview-listen off \
  "${disk[@]}" \
  >"$data2/sandboxd.log" 2>&1 &
pid2=$!
trap 'stop_nodes $pid $pid2 -- "$data" "$data2"' EXIT
for p in $port $port2; do
  for _ in $(seq 1 200); do
    curl -sf "http://127.0.0.1:$p/healthz" >/dev/null 2>&1 && break
    sleep 0.05
  done
done
target/release/sbx-bench --url "http://127.0.0.1:$port" --url-no-net "http://127.0.0.1:$port2" \
  --rootfs "$images/base/rootfs" "$@"
echo
bench/nat.sh "http://127.0.0.1:$port"
echo
bench/e2b.sh
echo
bench/sleep.sh
