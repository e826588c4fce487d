"""E2B's Python SDK (e2b, pinned by scripts/e2b-sdks.sh) against an sbx node, unchanged:
only E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it at the node. Run by
crates/sandboxd/tests/it/e2b.rs; prints one line per check and exits non-zero at the first
that fails."""

import io
import sys
import threading
import time

from e2b import (
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxQuery,
    TimeoutException,
)
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


s = Sandbox.create(metadata={"suite": "sdk-basics"}, envs={"A": "1"}, timeout=120)
check("create answers a sandbox id", s.sandbox_id.startswith("sbx-"), s.sandbox_id)
try:
    # Control plane.
    info = s.get_info()
    check("get_info: metadata", info.metadata == {"suite": "sdk-basics"}, str(info.metadata))
    check("get_info: running", str(info.state).endswith("running"), str(info.state))
    end_before = info.end_at
    s.set_timeout(600)
    check("set_timeout moves the end", s.get_info().end_at > end_before)
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "sdk-basics"})).next_items()
    check("list by metadata finds it", [i.sandbox_id for i in listed] == [s.sandbox_id])
    other = Sandbox.list(query=SandboxQuery(metadata={"suite": "none"})).next_items()
    check("list by other metadata finds nothing", other == [])
    check("is_running", s.is_running())

    # Commands.
    r = s.commands.run("echo hi")
    check("run: stdout", r.stdout == "hi\n" and r.exit_code == 0, repr(r))
    try:
        s.commands.run("echo oops >&2; exit 3")
        check("run: a failing command raises", False)
    except CommandExitException as e:
        check("run: exit code and stderr", e.exit_code == 3 and e.stderr == "oops\n", repr(e))
    r = s.commands.run("echo $A $B", envs={"B": "2"})
    check("run: env of the sandbox and of the command", r.stdout == "1 2\n", repr(r.stdout))
    check("run: cwd", s.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n")
    try:
        s.commands.run("pwd", cwd="/no/such/dir")
        check("run: a missing cwd raises", False)
    except InvalidArgumentException as e:
        check("run: a missing cwd is an invalid argument",
              "cwd '/no/such/dir' does not exist" in str(e), repr(e))
    check("run: default user and home", s.commands.run("whoami; pwd").stdout == "user\n/home/user\n")
    check("run: as root", s.commands.run("whoami", user="root").stdout == "root\n")
    t0 = time.time()
    try:
        s.commands.run("sleep 30", timeout=1)
        check("run: timeout raises", False)
    except TimeoutException:
        check("run: timeout raises TimeoutException", time.time() - t0 < 15)
    h = s.commands.run("sleep 60", background=True)
    check("background: a pid", h.pid > 0)
    check("commands.list has it", any(p.pid == h.pid for p in s.commands.list()))
    check("kill", s.commands.kill(h.pid))
    try:
        h.wait()
        check("a killed command's wait raises", False)
    except CommandExitException as e:
        check("a killed command's wait raises", e.exit_code != 0, repr(e))
    h = s.commands.run("cat", background=True, stdin=True)
    s.commands.send_stdin(h.pid, "hello\n")
    s.commands.send_stdin(h.pid, "again\n")
    s.commands.close_stdin(h.pid)
    r = h.wait()
    check("send_stdin + close_stdin", r.stdout == "hello\nagain\n", repr(r.stdout))
    got = []
    h = s.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", background=True)
    r = h.wait(on_stdout=lambda line: got.append(line))
    check("output streams as it comes", "".join(got) == "1\n2\n3\n", repr(got))

    # A terminal.
    data = bytearray()
    t = s.pty.create(PtySize(rows=24, cols=80))
    waiter = threading.Thread(target=lambda: t.wait(on_pty=lambda b: data.extend(b)), daemon=True)
    waiter.start()
    s.pty.resize(t.pid, PtySize(rows=30, cols=100))
    s.pty.send_stdin(t.pid, b"stty size; echo pty-$((6*7))\n")
    end = time.time() + 10
    while b"pty-42" not in data and time.time() < end:
        time.sleep(0.05)
    check("pty: input, output and resize", b"pty-42" in data and b"30 100" in data, repr(bytes(data)[-200:]))
    check("pty: kill", s.pty.kill(t.pid))
    waiter.join(10)

    # Files.
    base = "/home/user/sdk"
    check("make_dir", s.files.make_dir(base))
    check("make_dir of one that exists", s.files.make_dir(base) is False)
    s.files.write(f"{base}/a.txt", "hello text")
    s.files.write(f"{base}/b.bin", b"\x00\x01\x02")
    s.files.write(f"{base}/c.txt", io.BytesIO(b"from a stream"))
    s.files.write_files([WriteEntry(path=f"{base}/d/e.txt", data="nested")])
    check("read text", s.files.read(f"{base}/a.txt") == "hello text")
    check("read bytes", bytes(s.files.read(f"{base}/b.bin", format="bytes")) == b"\x00\x01\x02")
    stream = s.files.read(f"{base}/c.txt", format="stream")
    check("read stream", b"".join(stream) == b"from a stream")
    names = sorted(e.path for e in s.files.list(base, depth=2))
    check(
        "list with depth 2",
        names == [f"{base}/{n}" for n in ["a.txt", "b.bin", "c.txt", "d", "d/e.txt"]],
        str(names),
    )
    check("exists", s.files.exists(f"{base}/a.txt") and not s.files.exists(f"{base}/nope"))
    s.files.rename(f"{base}/a.txt", f"{base}/renamed.txt")
    check("rename", s.files.read(f"{base}/renamed.txt") == "hello text")
    s.files.remove(f"{base}/renamed.txt")
    check("remove", not s.files.exists(f"{base}/renamed.txt"))
    try:
        s.files.read(f"{base}/renamed.txt")
        check("read of a missing file raises", False)
    except NotFoundException:
        check("read of a missing file raises NotFoundException", True)
    check("a file written is the user's", s.commands.run(f"stat -c %U {base}/b.bin").stdout == "user\n")
    w = s.files.watch_dir(base)
    s.files.write(f"{base}/watched.txt", "x")
    s.files.remove(f"{base}/watched.txt")
    events = []
    end = time.time() + 10
    while time.time() < end:
        events += w.get_new_events()
        kinds = {(e.name, e.type) for e in events}
        if ("watched.txt", FilesystemEventType.REMOVE) in kinds:
            break
        time.sleep(0.2)
    w.stop()
    kinds = {(e.name, e.type) for e in events}
    check(
        "watch_dir sees create, write and remove",
        ("watched.txt", FilesystemEventType.CREATE) in kinds
        and ("watched.txt", FilesystemEventType.WRITE) in kinds
        and ("watched.txt", FilesystemEventType.REMOVE) in kinds,
        str(kinds),
    )

    # Connect by id from a second client.
    s2 = Sandbox.connect(s.sandbox_id)
    check("connect: the same sandbox", s2.commands.run("cat /home/user/sdk/d/e.txt").stdout == "nested")

    # Pause (the node's sleep: its processes saved with CRIU) and resume by connect: a process
    # started before goes on, with what it holds in memory.
    s.commands.run(
        "nohup python3 -c 'import time\nx = 41\nwhile True:\n    open(\"/tmp/x\", \"w\").write(str(x)); x += 1; time.sleep(0.2)' "
        ">/dev/null 2>&1 &"
    )
    # Its first count is there once python has started (a second or more on a busy host).
    deadline = time.time() + 20
    while True:
        seen = s.commands.run("cat /tmp/x 2>/dev/null || true").stdout.strip()
        if seen.isdigit() or time.time() > deadline:
            break
        time.sleep(0.2)
    before = int(seen)
    check("pause: paused", s.pause() is True)
    check("pause: the state is paused", Sandbox.get_info(s.sandbox_id).state.value == "paused")
    check("pause again: already paused", Sandbox.pause(s.sandbox_id) is False)
    s3 = Sandbox.connect(s.sandbox_id)
    check("connect resumes it", Sandbox.get_info(s.sandbox_id).state.value == "running")
    time.sleep(0.5)
    after = int(s3.commands.run("cat /tmp/x").stdout)
    check("resume: the process went on from its count", after > before, f"{before} then {after}")
finally:
    s.kill()
check("kill: gone from the list", all(i.sandbox_id != s.sandbox_id for i in Sandbox.list().next_items()))
try:
    Sandbox.connect(s.sandbox_id)
    check("connect to a killed sandbox raises", False)
except Exception as e:  # SandboxNotFoundException in 2.x
    check("connect to a killed sandbox raises", "not found" in str(e).lower(), repr(e))
print("all passed", flush=True)
