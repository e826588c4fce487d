#!/usr/bin/env bash
# The tests, on a fresh Debian/Ubuntu machine, as root: installs what they need, builds, makes
# the base image once (cached in /var/lib/sbx/images, or $SBX_TEST_IMAGES), and runs every test
# against real sandboxes. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/lib.sh
need_root
install_node_packages
install_packages docker-registry dnsmasq-base iproute2 nftables python3 python3-venv
need_cargo
need_nextest
export SBX_TEST_IMAGES="${SBX_TEST_IMAGES:-/var/lib/sbx/images}"
# The iii engine for the interop test (crates/sandboxd/tests/it/iii.rs), when the shared tools have it.
if [ -z "${III_BIN:-}" ] && [ -x ../shared/tools/iii ]; then
  export III_BIN="$(cd ../shared/tools && pwd)/iii"
fi
# CRIU >= 4.2 for sleep, snapshots and forks (tests/it/sleep.rs checkpoints real sandboxes).
scripts/criu.sh
# E2B's own SDKs (PyPI and npm, pinned) for the E2B compatibility tests (tests/it/e2b.rs).
scripts/e2b-sdks.sh
# The fleet's services on loopback: PostgreSQL (the control plane's second store,
# crates/sbx-control) and SeaweedFS (an S3 server for the object store, crates/sbx-blob), both
# started here; PostgreSQL is stopped again at the end if this started it.
if [ -z "${SBX_TEST_PG_URL:-}" ]; then
  pg_was_up="$(pg_lsclusters -h 2>/dev/null | awk '$2 == "main" && $4 ~ /online/' || true)"
  SBX_TEST_PG_URL="$(scripts/postgres.sh)"
  export SBX_TEST_PG_URL
  [ -n "$pg_was_up" ] || trap 'scripts/postgres.sh stop || true' EXIT
fi
export SBX_WEED="${SBX_WEED:-$(scripts/seaweedfs.sh)}"
cargo build --workspace --all-targets
target/debug/sandboxd --images-dir "$SBX_TEST_IMAGES" build-base --code-interpreter
# Every test binary at once, each test in a process of its own (.config/nextest.toml); then
# the doc tests, which nextest does not run, whatever the first found.
status=0
cargo nextest run --workspace || status=$?
cargo test --workspace --doc || status=$?
exit "$status"
