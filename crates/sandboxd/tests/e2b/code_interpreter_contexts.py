"""E2B's code interpreter SDK (e2b-code-interpreter) against an sbx node: contexts (list,
cwd per language, restart, remove), streaming callbacks in order, and an execution's
`timeout` interrupting the running code. Run by crates/sandboxd/tests/it/e2b.rs."""

import sys
import time

from e2b.exceptions import TimeoutException
from e2b_code_interpreter import Sandbox


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


s = Sandbox.create(timeout=180)
try:
    # The callbacks, in the order the code wrote.
    seen = []
    e = s.run_code(
        "import sys\nprint('a', flush=True)\nprint('b', file=sys.stderr, flush=True)\n"
        "display(41)\nprint('c', flush=True)\n42",
        on_stdout=lambda m: seen.append(("out", m.line)),
        on_stderr=lambda m: seen.append(("err", m.line)),
        on_result=lambda r: seen.append(("result", r.text, r.is_main_result)),
    )
    check(
        "stdout, stderr and results stream in order",
        seen == [("out", "a\n"), ("err", "b\n"), ("result", "41", False), ("out", "c\n"), ("result", "42", True)],
        repr(seen),
    )
    check("and are kept in the execution", e.logs.stdout == ["a\n", "c\n"] and e.logs.stderr == ["b\n"] and e.text == "42", repr(e))
    errors = []
    s.run_code("raise ValueError('boom')", on_error=lambda err: errors.append((err.name, err.value)))
    check("on_error", errors == [("ValueError", "boom")], repr(errors))

    # Contexts: their own directory, per language.
    py = s.create_code_context(cwd="/tmp", language="python")
    js = s.create_code_context(cwd="/tmp", language="javascript")
    sh = s.create_code_context(cwd="/tmp", language="bash")
    check("a context's cwd and language", (py.cwd, py.language, js.language, sh.language) == ("/tmp", "python", "javascript", "bash"), repr((py.cwd, py.language, js.language, sh.language)))
    e = s.run_code("import os\nos.getcwd()", context=py)
    check("python runs in its cwd", e.text == "/tmp", repr(e))
    e = s.run_code("process.cwd()", context=js)
    check("javascript runs in its cwd", e.text == "'/tmp'" or e.text == "/tmp", repr(e))
    e = s.run_code("pwd", context=sh)
    check("bash runs in its cwd", e.logs.stdout == ["/tmp\n"], repr(e))
    e = s.run_code("import os\nos.getcwd()")
    check("the default context runs in /home/user", e.text == "/home/user", repr(e))

    listed = {c.id: c for c in s.list_code_contexts()}
    check("list_code_contexts has them", all(c.id in listed for c in (py, js, sh)), repr(listed))
    check("with their language and cwd", (listed[js.id].language, listed[js.id].cwd) == ("javascript", "/tmp"), repr(vars(listed[js.id])))
    langs = {c.language for c in listed.values()}
    check("and the default python context", "python" in langs and len(listed) >= 4, repr(langs))

    # Restart: the same context, its state gone.
    s.run_code("kept = 7", context=py)
    check("state before a restart", s.run_code("kept", context=py).text == "7")
    s.restart_code_context(py)
    e = s.run_code("kept", context=py)
    check("a restarted context has lost its state", e.error is not None and e.error.name == "NameError", repr(e))
    e = s.run_code("import os\nos.getcwd()", context=py)
    check("and keeps its cwd", e.text == "/tmp", repr(e))

    # A timeout interrupts the code; the context goes on with its state.
    s.run_code("before = 1", context=py)
    t0 = time.time()
    try:
        s.run_code("import time\nwhile True:\n    time.sleep(0.1)", context=py, timeout=2)
        check("a timeout raises", False)
    except TimeoutException as err:
        check("a timeout raises TimeoutException", "timed out" in str(err), repr(err))
    check("after about the timeout", time.time() - t0 < 10, repr(time.time() - t0))
    e = s.run_code("before + 1", context=py)
    check("the interrupted python context goes on with its state", e.text == "2", repr(e))
    e = s.run_code("let n = 5", context=js)
    try:
        s.run_code("while (true) {}", context=js, timeout=2)
        check("a javascript timeout raises", False)
    except TimeoutException:
        check("a javascript timeout raises TimeoutException", True)
    e = s.run_code("n + 1", context=js)
    check("the interrupted javascript context goes on with its state", e.text == "6", repr(e))

    # Remove: gone from the list.
    s.remove_code_context(sh)
    check("a removed context is not listed", sh.id not in {c.id for c in s.list_code_contexts()})
finally:
    s.kill()
print("all passed", flush=True)
