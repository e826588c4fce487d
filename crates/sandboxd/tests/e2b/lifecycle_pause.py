"""E2B's Python SDK against an sbx node: a sandbox's life as E2B's SDK sees it. Pause (the
node's sleep, held asleep) makes `is_running()` false and the state `paused`; a paused sandbox
does not time out; connect resumes it with a fresh timeout; connect never shortens a running
one's; a shortened timeout ends it (`is_running()` false, not an error); a command whose
sandbox is killed under it ends with E2B's message; `lifecycle` autoPause without autoResume
waits for connect; what the node does not do (a filesystem-only pause) is refused; an MCP
gateway that cannot start leaves no sandbox. Run by crates/sandboxd/tests/it/e2b.rs; prints
one line per check and exits non-zero at the first that fails."""

import sys
import time
import uuid
from datetime import datetime, timezone
from typing import Any, cast

import httpx

from e2b import Sandbox, SandboxException, SandboxQuery, SandboxState, TimeoutException


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def state(s):
    return Sandbox.get_info(s.sandbox_id).state


def left_s(s):
    return (Sandbox.get_info(s.sandbox_id).end_at - datetime.now(timezone.utc)).total_seconds()


made = []
try:
    # Pause and connect.
    s = Sandbox.create(timeout=3)
    made.append(s)
    check("a new sandbox runs", s.is_running())
    check("pause", s.pause() is True)
    check("paused: is_running() is false", s.is_running() is False)
    check("paused: its state", state(s) == SandboxState.PAUSED)
    time.sleep(4)
    check("paused past its timeout: still paused, not ended", state(s) == SandboxState.PAUSED)
    r = Sandbox.connect(s.sandbox_id, timeout=60)
    check("connect resumes it", r.is_running() and s.is_running() and state(s) == SandboxState.RUNNING)
    check("a resumed sandbox times out afresh", 50 < left_s(s) <= 61, str(left_s(s)))
    check("and it works", r.commands.run("echo back").stdout == "back\n")

    # Connect to a running one: its end moves later, never earlier.
    Sandbox.connect(s.sandbox_id, timeout=5)
    check("connect with a shorter timeout keeps the end", left_s(s) > 40, str(left_s(s)))
    Sandbox.connect(s.sandbox_id, timeout=600)
    check("connect with a longer timeout extends it", left_s(s) > 500, str(left_s(s)))

    # A filesystem-only pause is refused, not done with memory.
    try:
        s.pause(keep_memory=False)
        check("a filesystem-only pause is refused", False)
    except SandboxException as e:
        check("a filesystem-only pause is refused", "filesystem-only" in str(e), repr(e))
    check("and the sandbox runs on", s.is_running())

    # A shortened timeout ends it: is_running() answers false.
    s.set_timeout(2)
    time.sleep(4)
    check("past a shortened timeout: is_running() is false", s.is_running(request_timeout=5) is False)

    # A command whose sandbox is killed under it.
    k = Sandbox.create(timeout=60)
    made.append(k)
    cmd = k.commands.run("sleep 60", background=True)
    k.kill()
    try:
        cmd.wait()
        check("a command of a killed sandbox raises", False)
    except TimeoutException as e:
        check(
            "a command of a killed sandbox: E2B's message",
            "sandbox was killed or reached its end of life" in str(e),
            repr(e),
        )

    # autoPause without autoResume: paused at its timeout, and only connect wakes it.
    a = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": False})
    made.append(a)
    a.files.write("/home/user/kept.txt", "kept")
    deadline = time.time() + 30
    while state(a) != SandboxState.PAUSED and time.time() < deadline:
        time.sleep(0.5)
    check("autoPause: paused at its timeout", state(a) == SandboxState.PAUSED)
    check("autoPause: is_running() is false", a.is_running() is False)
    check("autoPause: still paused after a request", state(a) == SandboxState.PAUSED)
    a.connect()
    check("autoPause: connect resumes it", state(a) == SandboxState.RUNNING and a.is_running())
    check("autoPause: its files are kept", a.files.read("/home/user/kept.txt") == "kept")

    # autoResume: paused at its timeout (a command's output followed then is let go of), and
    # woken by a request to one of its ports (the preview listener: {port}-{id}.{domain}).
    w = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    made.append(w)
    served = w.commands.run("python3 -m http.server 8000 --directory /etc", background=True)
    deadline = time.time() + 30
    while state(w) != SandboxState.PAUSED and time.time() < deadline:
        time.sleep(0.5)
    check("autoResume: paused at its timeout", state(w) == SandboxState.PAUSED)
    host = w.get_host(8000)
    name, _, port = host.rpartition(":")
    res = httpx.get(f"http://127.0.0.1:{port}/hostname", headers={"Host": name}, timeout=30)
    check("autoResume: a request to its port is answered", res.status_code == 200, f"{res.status_code} {res.text[:200]}")
    check("autoResume: and woke it", state(w) == SandboxState.RUNNING and w.is_running())

    # An MCP gateway the template cannot start: E2B's SDK kills the sandbox it made.
    tag = {"lifecycle_mcp": str(uuid.uuid4())}
    try:
        Sandbox.create("base", timeout=60, metadata=tag, mcp=cast(Any, {"invalid_server": {}}))
        check("an MCP gateway that cannot start fails the create", False)
    except SandboxException as e:
        check("an MCP gateway that cannot start fails the create", "Failed to start MCP gateway" in str(e), repr(e))
    left = Sandbox.list(query=SandboxQuery(metadata=tag)).next_items()
    check("and leaves no sandbox", left == [], str(left))
finally:
    for x in made:
        try:
            x.kill()
        except Exception:
            pass
print("all passed", flush=True)
