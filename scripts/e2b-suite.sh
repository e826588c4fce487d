#!/usr/bin/env bash
# E2B's own Python SDK test suite (e2b-dev/E2B, packages/python-sdk/tests), unchanged, against
# a node of ours: `scripts/e2b-suite.sh SUITE_DIR [pytest arguments…]`, SUITE_DIR a checkout of
# E2B's packages/python-sdk (its tests/ and pytest.ini). The SDK is the pinned `e2b` of
# scripts/e2b-sdks.sh (installed through the machine's pip source), its test tools beside it.
#
# Without E2B_API_URL it starts a node of its own (target/debug/sandboxd, a temporary data
# directory, an API key, the E2B and preview listeners on free loopback ports, a disk of 4 GiB
# or $SBX_E2B_SUITE_DISK_BYTES promised 16 times over) and stops it at the end; with E2B_API_URL (and E2B_API_KEY, E2B_DOMAIN) it drives that node. The SDK is
# pointed at the node by E2B_API_URL = E2B_SANDBOX_URL = the E2B listener, E2B_DOMAIN = the
# preview listener. A JUnit report goes to $SBX_E2B_SUITE_REPORT (default
# target/e2b-suite/report.xml), a summary to standard output.
#
# pytest runs as a program, not `python -m pytest`, so that the checkout's own `e2b` folder is
# not imported in place of the pinned SDK.
#
# The suite is not on a package registry (the `e2b` sdist has no tests), and a CI machine here
# reaches only the registries: give it a checkout made elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -d "$1/tests" ]; then
  echo "usage: scripts/e2b-suite.sh SUITE_DIR [pytest arguments…]  (SUITE_DIR: E2B's packages/python-sdk)" >&2
  exit 2
fi
suite="$(cd "$1" && pwd)"
shift
scripts/e2b-sdks.sh
sdk="${SBX_E2B_SDK_DIR:-$PWD/target/e2b-sdk}"
py="$sdk/venv/bin/python"
tools="pytest>=9.0.3,<10 pytest-xdist>=3.3.1,<4 python-dotenv>=1.0.0,<2 pytest-dotenv>=0.5.2,<0.6 pytest-asyncio>=1.3.0,<2 pytest-timeout>=2.4.0,<3"
if [ "$(cat "$sdk/suite-tools" 2>/dev/null)" != "$tools" ]; then
  # shellcheck disable=SC2086
  "$sdk/venv/bin/pip" install -q --disable-pip-version-check $tools
  echo "$tools" > "$sdk/suite-tools"
fi
out="$PWD/target/e2b-suite"
mkdir -p "$out"
report="${SBX_E2B_SUITE_REPORT:-$out/report.xml}"

free_port() {
  "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

node_pid=""
work=""
cleanup() {
  if [ -n "$node_pid" ]; then
    kill -TERM "$node_pid" 2>/dev/null || true
    wait "$node_pid" 2>/dev/null || true
  fi
  [ -z "$work" ] || rm -rf "$work"
}
trap cleanup EXIT

if [ -z "${E2B_API_URL:-}" ]; then
  [ -x target/debug/sandboxd ] || cargo build -p sandboxd
  images="${SBX_TEST_IMAGES:-/var/lib/sbx/images}"
  target/debug/sandboxd --images-dir "$images" build-base --code-interpreter >/dev/null
  work="$(mktemp -d /tmp/sbx-e2b-suite-XXXXXX)"
  key="e2b_$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  echo "$key" > "$work/keys"
  api="127.0.0.1:$(free_port)"
  e2b="127.0.0.1:$(free_port)"
  preview="127.0.0.1:$(free_port)"
  target/debug/sandboxd --listen "$api" --data-dir "$work/data" --images-dir "$images" \
    --api-keys "$work/keys" --e2b-listen "$e2b" --preview-listen "$preview" \
    --cgroup-name "sbx-e2b-suite-$$" \
    --disk-image-bytes "${SBX_E2B_SUITE_DISK_BYTES:-4294967296}" --disk-overcommit 16 \
    >"$out/node.log" 2>&1 &
  node_pid=$!
  for _ in $(seq 1 300); do
    if "$py" -c "import urllib.request,sys; urllib.request.urlopen('http://$api/healthz', timeout=1)" 2>/dev/null; then
      break
    fi
    kill -0 "$node_pid" 2>/dev/null || { echo "sbx: the node did not start: $out/node.log" >&2; tail -20 "$out/node.log" >&2; exit 1; }
    sleep 0.1
  done
  export E2B_API_URL="http://$e2b" E2B_SANDBOX_URL="http://$e2b" E2B_API_KEY="$key"
  export E2B_DOMAIN="$preview"
fi
export E2B_SANDBOX_URL="${E2B_SANDBOX_URL:-$E2B_API_URL}"
unset E2B_DEBUG E2B_ACCESS_TOKEN
echo "sbx: E2B's suite ($suite) against $E2B_API_URL, sandboxes' hosts under ${E2B_DOMAIN:-}" >&2
status=0
(cd "$suite" && "$sdk/venv/bin/pytest" -p no:cacheprovider --junitxml="$report" -q -rfE "${@:-tests}") || status=$?
"$py" - "$report" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"sbx: E2B's suite: {n['tests']} tests, {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
PY
exit "$status"
