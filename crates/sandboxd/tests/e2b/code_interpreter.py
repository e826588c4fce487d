"""E2B's code interpreter SDK (e2b-code-interpreter, pinned by scripts/e2b-sdks.sh) against an
sbx node, unchanged: template code-interpreter-v1, the interpreter on port 49999 of the
sandbox. Run by crates/sandboxd/tests/it/e2b.rs."""

import sys
import time

from e2b.exceptions import TimeoutException
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
    s.run_code("import { join } from 'path'\nimport * as os from 'os'", context=js)
    e = s.run_code("join('a', 'b') + ' ' + typeof os.hostname", context=js)
    check("ESM imports in JavaScript stay for the next cells", e.text == "a/b function", repr(e))
    ts = s.create_code_context(language="typescript")
    check("a TypeScript context", ts.language == "typescript", repr(ts.language))
    e = s.run_code(
        "interface P { x: number }\nconst p: P = { x: 40 }\nfunction add(a: number, b: number): number { return a + b }",
        context=ts,
    )
    check("TypeScript with types runs", e.error is None, repr(e))
    e = s.run_code("add(p.x, 2) as number", context=ts)
    check("a TypeScript context keeps its state", e.text == "42", repr(e))
    e = s.run_code("const z: string = 'ts'; z.toUpperCase()", language="ts")
    check("language='ts' runs TypeScript", e.text == "TS", repr(e))
    r = s.create_code_context(language="r")
    e = s.run_code("v <- c(1, 2, 3)\ncat('from R\\n')\nSys.getenv('SBX_R')", context=r, envs={"SBX_R": "env of R"})
    check("an R context runs, prints and has the cell's env", e.logs.stdout == ["from R\n"] and e.text == '[1] "env of R"', repr(e))
    e = s.run_code("sum(v) * 7", context=r)
    check("an R context keeps its state", e.text == "[1] 42", repr(e))
    e = s.run_code("stop('boom')", context=r)
    check("an R error", e.error is not None and e.error.value == "boom", repr(e))
    try:
        s.run_code("Sys.sleep(30)", context=r, timeout=2)
        check("an R timeout raises", False)
    except TimeoutException:
        pass
    e = s.run_code("sum(v)", context=r)
    check("an interrupted R context keeps its state", e.text == "[1] 6", repr(e))
    j = s.create_code_context(language="java")
    check("a Java context", j.language == "java", repr(j.language))
    e = s.run_code('System.out.println("Hello, World!")', context=j)
    check("a Java context prints (a line's end a chunk of its own)", e.logs.stdout == ["Hello, World!", "\n"], repr(e))
    e = s.run_code('int q = 6;\nSystem.getProperty("SBX_J") + " " + (q * 7)', context=j, envs={"SBX_J": "env of Java"})
    check("a Java cell's env is system properties, its last value the result", e.text == "env of Java 42", repr(e))
    e = s.run_code("q + 1", context=j)
    check("a Java context keeps its state", e.text == "7", repr(e))
    e = s.run_code('System.getProperty("SBX_J", "gone")', context=j)
    check("a Java cell's env ends with it", e.text == "gone", repr(e))
    e = s.run_code('Integer.parseInt("x")', language="java")
    check("a Java exception", e.error is not None and e.error.name == "java.lang.NumberFormatException", repr(e))
    e = s.run_code("x", context=s.create_code_context(language="python"))
    check("a new context has its own state", e.error is not None and e.error.name == "NameError", repr(e))
finally:
    s.kill()
print("all passed", flush=True)
