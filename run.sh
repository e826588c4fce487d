#!/usr/bin/env bash
# The main job, on a fresh Debian/Ubuntu machine, as root: installs what sbx needs, builds it,
# starts a node (sandboxd) on its defaults and runs a command in a sandbox. With no arguments
# the command is python3 -c 'print(2+2)', which prints 4. Build logs go to stderr.
#   ./run.sh                      -> 4
#   ./run.sh -- node -e 'console.log(6*7)'
set -euo pipefail
cd "$(dirname "$0")"
. scripts/lib.sh
need_root
install_node_packages
need_cargo
# CRIU >= 4.2: sandboxes sleep to disk, are snapshotted and forked with it. A node runs without
# it too (those calls are then 503 not_served_here).
scripts/criu.sh >&2 || echo "sbx: going on without CRIU" >&2
build_release sandboxd sbx sbx-agent >&2
[ "${1:-}" = "--" ] && shift
if [ "$#" -eq 0 ]; then
  set -- python3 -c 'print(2+2)'
fi
# sbx starts a node when none answers (building its base image first, with progress).
exec target/release/sbx run -- "$@"
