#!/usr/bin/env bash
# Benchmark of sandbox networking (sbx_runtime::net): p50/p99 of taking a ready network
# namespace from the pool (the request path), releasing one, and preparing one (off the path),
# then the leak audit after the cycles. Runs in network namespaces of its own: the machine's
# tables, routes and interfaces are not touched. As root. Prints a table.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
need_cargo
build_release sbx-bench-net
target/release/sbx-bench-net "$@"
