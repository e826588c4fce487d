"""E2B's Python SDK against an sbx node: a sandbox's life as E2B's SDK sees it. Pause (the
node's sleep, held asleep) makes `is_running()` false and the state `paused`; a paused sandbox
does not time out; connect resumes it with a fresh timeout; connect never shortens a running
one's; a shortened timeout ends it (`is_running()` false, not an error); a command whose
sandbox is killed under it ends with E2B's message; `lifecycle` autoPause without autoResume
waits for connect; a filesystem-only pause (explicit, or at the timeout) keeps the files and
ends the processes (the node's restart, then its sleep; connect boots it again); a connect
with `on_resume="reboot"` boots a paused sandbox again; an auto-resumed sandbox times out
again; an MCP gateway that cannot start leaves no sandbox. Run by crates/sandboxd/tests/it/e2b.rs; prints
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

    # A filesystem-only pause: its files are kept, its processes end; connect boots it again.
    s.files.write("/home/user/fs-only.txt", "persisted")
    s.commands.run("sleep 1000", background=True)
    pids = lambda x: x.commands.run("pgrep -x sleep || true").stdout.split()
    check("before the pause: the process runs", len(pids(s)) == 1, str(pids(s)))
    check("a filesystem-only pause", s.pause(mode="filesystem") is True)
    check("fs-only paused: is_running() is false", s.is_running() is False)
    check("fs-only paused: its state", state(s) == SandboxState.PAUSED)
    r = s.connect(timeout=60)
    check("fs-only: connect resumes it", r.is_running() and state(s) == SandboxState.RUNNING)
    check("fs-only: its files are kept", r.files.read("/home/user/fs-only.txt") == "persisted")
    check("fs-only: its processes are gone", pids(r) == [], str(pids(r)))
    check("fs-only: it times out afresh", 50 < left_s(s) <= 61, str(left_s(s)))

    # A full pause resumed with on_resume="reboot": booted again over its disk.
    s.commands.run("sleep 1000", background=True)
    check("a pause with memory", s.pause() is True)
    r = Sandbox.connect(s.sandbox_id, timeout=60, on_resume="reboot")
    check("reboot: connect resumes it", r.is_running())
    check("reboot: files kept", r.files.read("/home/user/fs-only.txt") == "persisted")
    check("reboot: processes gone", pids(r) == [], str(pids(r)))
    check("reboot: a running sandbox's connect with it is nothing", Sandbox.connect(s.sandbox_id, on_resume="reboot").is_running())

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

    # An auto-resumed sandbox times out again (E2B's: its create's timeout, at least 5
    # minutes), and pauses again at its end.
    check("autoResume: a woken sandbox has an end again", 290 < left_s(w) <= 301, str(left_s(w)))
    w.set_timeout(2)
    deadline = time.time() + 30
    while state(w) != SandboxState.PAUSED and time.time() < deadline:
        time.sleep(0.5)
    check("autoResume: paused again at its timeout", state(w) == SandboxState.PAUSED)
    res = httpx.get(f"http://127.0.0.1:{port}/hostname", headers={"Host": name}, timeout=30)
    check("autoResume: woken again by a request", res.status_code == 200 and state(w) == SandboxState.RUNNING)
    check("autoResume: and given its end again", 290 < left_s(w) <= 301, str(left_s(w)))

    # autoPause filesystem-only: at its timeout its processes end; connect boots it again.
    f = Sandbox.create(timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    made.append(f)
    f.files.write("/home/user/auto-fs.txt", "auto")
    f.commands.run("sleep 1000", background=True)
    deadline = time.time() + 30
    while state(f) != SandboxState.PAUSED and time.time() < deadline:
        time.sleep(0.5)
    check("autoPause fs-only: paused at its timeout", state(f) == SandboxState.PAUSED)
    f.connect(timeout=60)
    check("autoPause fs-only: connect resumes it", f.is_running())
    check("autoPause fs-only: files kept", f.files.read("/home/user/auto-fs.txt") == "auto")
    check("autoPause fs-only: processes gone", pids(f) == [], str(pids(f)))
    try:
        Sandbox.create(timeout=3, lifecycle=cast(Any, {"on_timeout": {"action": "pause", "mode": "filesystem"}, "auto_resume": True}))
        check("fs-only with autoResume is refused", False)
    except Exception as e:
        check("fs-only with autoResume is refused", "auto_resume" in str(e) or "autoResume" in str(e), repr(e))

    # maskRequestHost: the Host a sandbox's port is sent, through the preview listener and
    # through E2B's sandbox URL, ${PORT} replaced.
    m = Sandbox.create(timeout=60, network={"mask_request_host": "custom-host.example.com:${PORT}"})
    made.append(m)
    m.files.write("/home/user/host.py", (
        "import http.server\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        b = (self.headers.get('Host', '') + '|' + self.headers.get('X-Forwarded-Host', '')).encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers(); self.wfile.write(b)\n"
        "    def log_message(self, *a): pass\n"
        "http.server.ThreadingHTTPServer(('', 8080), H).serve_forever()\n"
    ))
    m.commands.run("python3 /home/user/host.py", background=True)
    host = m.get_host(8080)
    name, _, pport = host.rpartition(":")
    deadline = time.time() + 20
    res = None
    while time.time() < deadline:
        try:
            res = httpx.get(f"http://127.0.0.1:{pport}/", headers={"Host": name}, timeout=10)
            if res.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    check("mask: the preview listener sends the masked Host", res is not None and res.text.split("|")[0] == "custom-host.example.com:8080", res.text if res else "")
    check("mask: and the client's in X-Forwarded-Host", res.text.split("|")[1] == name, res.text)
    import os
    res = httpx.get(os.environ["E2B_SANDBOX_URL"] + "/", headers={"E2b-Sandbox-Id": m.sandbox_id, "E2b-Sandbox-Port": "8080"}, timeout=10)
    check("mask: so does E2B's sandbox URL", res.status_code == 200 and res.text.split("|")[0] == "custom-host.example.com:8080", f"{res.status_code} {res.text}")
    check("mask: not in the sandbox's metadata", Sandbox.get_info(m.sandbox_id).metadata == {}, str(Sandbox.get_info(m.sandbox_id).metadata))

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
