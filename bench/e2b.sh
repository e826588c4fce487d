#!/usr/bin/env bash
# E2B's Python SDK against a node: the time of Sandbox.create() (answered once the sandbox
# runs), of commands.run("echo hi") in it, of kill(), and of a code interpreter's first
# run_code; p50 and p95 of N rounds (default 30). Starts a release node with --e2b-listen of
# its own. The SDKs come from scripts/e2b-sdks.sh. As root.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
need_root
need_cargo
scripts/e2b-sdks.sh
build_release sandboxd sbx-agent
images="${SBX_IMAGES_DIR:-/var/lib/sbx/images}"
# The images first (a node with --e2b-listen builds the code interpreter's at start when it is
# missing or older, and answers only then): minutes, not part of what is measured.
target/release/sandboxd --images-dir "$images" build-base --code-interpreter >&2
data=$(mktemp -d /tmp/sbx-bench-e2b.XXXXXX)
port=7797
e2b=7796
# A disk of its own size, as run.sh's (a default node takes half of what the host has free).
RUST_LOG=warn target/release/sandboxd --listen 127.0.0.1:$port --data-dir "$data" \
  --images-dir "$images" --cgroup-name sbx-bench-e2b --preview-listen off \
  --disk-image-bytes $((4 << 30)) --disk-bytes $((512 << 20)) --disk-overcommit 8 \
  --e2b-listen 127.0.0.1:$e2b >"$data/sandboxd.log" 2>&1 &
pid=$!
trap 'stop_nodes $pid -- "$data"' EXIT
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
  sleep 0.05
done
sdk="${SBX_E2B_SDK_DIR:-$PWD/target/e2b-sdk}"
E2B_API_URL=http://127.0.0.1:$e2b E2B_SANDBOX_URL=http://127.0.0.1:$e2b E2B_API_KEY=e2b_bench \
  N="${N:-30}" "$sdk/venv/bin/python" - <<'PY'
import os, statistics, time
from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

n = int(os.environ["N"])
def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
rows = {"Sandbox.create()": [], "commands.run('echo hi')": [], "kill()": []}
Sandbox.create().kill()  # warm: the SDK's connections, the node's pool
for _ in range(n):
    t = time.perf_counter(); s = Sandbox.create(); rows["Sandbox.create()"].append(time.perf_counter() - t)
    t = time.perf_counter(); r = s.commands.run("echo hi"); rows["commands.run('echo hi')"].append(time.perf_counter() - t)
    assert r.stdout == "hi\n"
    t = time.perf_counter(); s.kill(); rows["kill()"].append(time.perf_counter() - t)
ci = {"code interpreter: create": [], "code interpreter: first run_code('1+1')": []}
CodeSandbox.create().kill()  # the template's first build
for _ in range(max(3, n // 3)):
    t = time.perf_counter(); c = CodeSandbox.create(); ci["code interpreter: create"].append(time.perf_counter() - t)
    t = time.perf_counter(); e = c.run_code("1+1"); ci["code interpreter: first run_code('1+1')"].append(time.perf_counter() - t)
    assert e.text == "2", e
    c.kill()
rows.update(ci)
print("E2B's Python SDK (e2b 2.63.0) against a node, on this machine (2 cores)")
print(f"{'what':44} {'runs':>5} {'p50 ms':>9} {'p95 ms':>9}")
for k, xs in rows.items():
    print(f"{k:44} {len(xs):>5} {pct(xs, 50) * 1000:>9.2f} {pct(xs, 95) * 1000:>9.2f}")
PY
