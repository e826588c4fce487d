"""E2B's code interpreter SDK (e2b-code-interpreter, pinned by scripts/e2b-sdks.sh) against an
sbx node, unchanged: template code-interpreter-v1, the interpreter on port 49999 of the
sandbox. Run by crates/sandboxd/tests/it/e2b.rs."""

import sys
import time

from e2b_code_interpreter import Sandbox


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


s = Sandbox.create(timeout=120)
try:
    s.run_code("x = 1")
    e = s.run_code("x + 1")
    check("state across two calls", e.text == "2", repr(e))
    e = s.run_code("1 / 0")
    check(
        "an error's name, value and traceback",
        e.error is not None
        and e.error.name == "ZeroDivisionError"
        and "division by zero" in e.error.value
        and "ZeroDivisionError" in e.error.traceback,
        repr(e.error),
    )
    seen = []
    t0 = time.time()
    e = s.run_code(
        "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.4)\n",
        on_stdout=lambda m: seen.append((time.time() - t0, m.line)),
    )
    lines = [l for _, l in seen]
    check("a print is streamed", lines == ["tick 0\n", "tick 1\n", "tick 2\n"], repr(seen))
    check("streamed before the cell ends", seen[0][0] < seen[-1][0] - 0.5, repr(seen))
    check("logs keep stdout", e.logs.stdout == ["tick 0\n", "tick 1\n", "tick 2\n"], repr(e.logs))
    js = s.create_code_context(language="js")
    s.run_code("let y = 40", context=js)
    e = s.run_code("y + 2", context=js)
    check("a JavaScript context keeps its state", e.text == "42", repr(e))
    e = s.run_code("x", context=s.create_code_context(language="python"))
    check("a new context has its own state", e.error is not None and e.error.name == "NameError", repr(e))
finally:
    s.kill()
print("all passed", flush=True)
