"""E2B's Python SDK against a fleet's control plane, after the sandbox fleet_create.py made was
moved to another node: connects to it by id (argv[1]) through the same E2B_API_URL and
E2B_SANDBOX_URL, reads the file written before the move, runs commands and writes again. Run by
crates/sandboxd/tests/fleet/e2b.rs; a line per check, non-zero at the first that fails."""

import sys

from e2b import Sandbox


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


sid = sys.argv[1]
s = Sandbox.connect(sid)
check("connect: the same sandbox", s.sandbox_id == sid, s.sandbox_id)
check("is_running", s.is_running())
check("the file written before the move", s.files.read("/home/user/fleet.txt") == "written before the move")
r = s.commands.run("echo again; cat /home/user/fleet.txt")
check("run after the move", r.stdout == "again\nwritten before the move" and r.exit_code == 0, repr(r))
got = []
h = s.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", background=True)
h.wait(on_stdout=lambda line: got.append(line))
check("output streams as it comes", "".join(got) == "1\n2\n3\n", repr(got))
s.files.write("/home/user/after.txt", "written after the move")
check("write after the move", s.files.read("/home/user/after.txt") == "written after the move")
info = Sandbox.get_info(sid)
check("get_info: running", str(info.state).endswith("running"), str(info.state))
check("get_info: metadata", info.metadata == {"suite": "fleet"}, str(info.metadata))
print("all passed", flush=True)
