"""E2B's network rules of a sandbox through E2B's Python SDK (pinned by scripts/e2b-sdks.sh)
against an sbx node: at create (allowOut, denyOut, allow_internet_access) and changed while
it runs (`update_network`, which replaces them all). The target is the test internet of
crates/sandboxd/tests/it/network.rs: HTTP on 203.0.113.10:8080, which the Rust test starts.
Run by crates/sandboxd/tests/it/e2b.rs; prints one line per check and exits non-zero at the
first that fails."""

import sys

from e2b import (
    Sandbox,
    SandboxException,
    SandboxNetworkOpts,
    SandboxNotFoundException,
)

TARGET = "http://203.0.113.10:8080/"


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def reaches(s):
    r = s.commands.run(
        f"curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout 3 --max-time 5 {TARGET} || true"
    )
    return r.stdout.strip() == "200"


made = []
try:
    s = Sandbox.create(timeout=120)
    made.append(s)
    check("open by default", reaches(s))
    s.update_network({"deny_out": ["203.0.113.10"]})
    check("update: denied by address", not reaches(s))
    s.update_network({})
    check("update: an empty one clears them", reaches(s))
    s.update_network({"allow_internet_access": False})
    check("update: no internet access", not reaches(s))
    s.update_network({"deny_out": lambda ctx: [ctx.all_traffic], "allow_out": ["203.0.113.10"]})
    check("update: allow over a deny of all", reaches(s))
    s.update_network({"deny_out": lambda ctx: [ctx.all_traffic], "allow_out": ["203.0.113.11"]})
    check("update: allowed elsewhere only", not reaches(s))
    try:
        s.update_network({"rules": {"example.com": [{"transform": {"headers": {"A": "b"}}}]}})
        check("update: transforms are refused", False)
    except SandboxException as e:
        check("update: transforms are refused", "501" in str(e), str(e))
    check("a refused update changed nothing", not reaches(s))

    closed = Sandbox.create(
        timeout=60, network=SandboxNetworkOpts(deny_out=lambda ctx: [ctx.all_traffic])
    )
    made.append(closed)
    check("create: a deny of all", not reaches(closed))
    closed.update_network({})
    check("update: opened", reaches(closed))

    gone = Sandbox.create(timeout=30)
    gone.kill()
    try:
        gone.update_network({})
        check("a killed sandbox's rules: not found", False)
    except SandboxNotFoundException:
        check("a killed sandbox's rules: not found", True)
    print("all passed", flush=True)
finally:
    for x in made:
        try:
            x.kill()
        except Exception:
            pass
