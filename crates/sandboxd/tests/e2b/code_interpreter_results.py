"""E2B's code interpreter SDK (e2b-code-interpreter) against an sbx node: results as E2B's
template gives them. The data stack (numpy, pandas, matplotlib) is in the sandbox; rich reprs,
display(), matplotlib figures as png and E2B's chart objects, DataFrames as data and html.
Run by crates/sandboxd/tests/it/e2b.rs."""

import base64
import sys

from e2b_code_interpreter import Sandbox
from e2b_code_interpreter.charts import ChartType


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def run(s, code, **kw):
    e = s.run_code(code, **kw)
    if e.error is not None:
        print(f"FAILED: {code!r} raised {e.error.name}: {e.error.value}\n{e.error.traceback}", flush=True)
        sys.exit(1)
    return e


def one_chart(e):
    charts = [r for r in e.results if getattr(r, "chart", None) is not None]
    check("one chart result", len(charts) == 1, repr(e.results))
    r = charts[0]
    check("a chart comes with its png", base64.b64decode(r.png)[:8] == b"\x89PNG\r\n\x1a\n", repr(r.png[:20]))
    return r.chart


s = Sandbox.create(timeout=180)
try:
    e = run(s, "import numpy, pandas, matplotlib\nnumpy.arange(4).sum(), pandas.__version__ != '', matplotlib.get_backend()")
    check("numpy, pandas and matplotlib are there", e.text.startswith("(6, True, "), repr(e.text))

    e = run(
        s,
        """
class Rich:
    def _repr_html_(self): return '<b>rich</b>'
    def _repr_markdown_(self): return '**rich**'
    def _repr_svg_(self): return '<svg xmlns="http://www.w3.org/2000/svg"></svg>'
    def _repr_png_(self): return b'\\x89PNG\\r\\n\\x1a\\nrich'
    def _repr_jpeg_(self): return b'\\xff\\xd8\\xffrich'
    def _repr_latex_(self): return r'$\\alpha$'
    def _repr_json_(self): return {'rich': [1, 2]}
    def _repr_javascript_(self): return 'console.log(1)'
    def __repr__(self): return 'Rich()'
display(Rich())
Rich()
""",
    )
    check("display() and the last expression are two results", len(e.results) == 2, repr(e.results))
    shown, main = e.results
    check("display()'s result is not the main one", not shown.is_main_result and main.is_main_result)
    for r in (shown, main):
        check("text", r.text == "Rich()", repr(r.text))
        check("html", r.html == "<b>rich</b>", repr(r.html))
        check("markdown", r.markdown == "**rich**", repr(r.markdown))
        check("svg", r.svg.startswith("<svg"), repr(r.svg))
        check("png (base64)", base64.b64decode(r.png) == b"\x89PNG\r\n\x1a\nrich", repr(r.png))
        check("jpeg (base64)", base64.b64decode(r.jpeg) == b"\xff\xd8\xffrich", repr(r.jpeg))
        check("latex", r.latex == "$\\alpha$", repr(r.latex))
        check("json", r.json == {"rich": [1, 2]}, repr(r.json))
        check("javascript", r.javascript == "console.log(1)", repr(r.javascript))
    check("formats", set(main.formats()) >= {"html", "markdown", "svg", "png", "jpeg", "latex", "json", "javascript"}, repr(list(main.formats())))

    e = run(
        s,
        """
import pandas as pd
df = pd.DataFrame({'name': ['a', 'b', 'c'], 'n': [1, 2, 3], 'x': [0.5, None, 2.5]})
df
""",
    )
    r = e.results[0]
    check(
        "a DataFrame's data",
        r.data == {"name": ["a", "b", "c"], "n": [1, 2, 3], "x": [0.5, None, 2.5]},
        repr(r.data),
    )
    check("a DataFrame's html", "<table" in r.html and "<td>b</td>" in r.html, repr(r.html))
    check("a DataFrame's text", "name" in r.text and "2.5" in r.text, repr(r.text))

    e = run(
        s,
        """
import matplotlib.pyplot as plt
import numpy as np
x = np.linspace(0, 10, 50)
plt.figure()
plt.plot(x, np.sin(x), label='sin(x)')
plt.plot(x, np.cos(x), label='cos(x)')
plt.xlabel('Time (s)')
plt.ylabel('Amplitude [Hz]')
plt.title('Waves')
plt.legend()
plt.show()
""",
    )
    c = one_chart(e)
    check("a line chart", c.type == ChartType.LINE, repr(c.type))
    check("its title and labels", (c.title, c.x_label, c.y_label) == ("Waves", "Time (s)", "Amplitude [Hz]"), repr(c.to_dict()))
    check("its units", (c.x_unit, c.y_unit) == ("s", "Hz"), repr((c.x_unit, c.y_unit)))
    check("its scales", (c.x_scale.value, c.y_scale.value) == ("linear", "linear"))
    check("its series", [el.label for el in c.elements] == ["sin(x)", "cos(x)"], repr([el.label for el in c.elements]))
    check("its points", len(c.elements[0].points) == 50 and c.elements[1].points[0] == (0.0, 1.0), repr(c.elements[1].points[:2]))
    check("its ticks", len(c.x_ticks) == len(c.x_tick_labels) > 0 and all(isinstance(t, str) for t in c.x_tick_labels), repr(c.x_tick_labels))

    e = run(
        s,
        """
plt.figure()
plt.bar(['Author A', 'Author B', 'Author C'], [100, 200, 300], label='Books Sold')
plt.xlabel('Authors')
plt.ylabel('Sold (books)')
plt.title('Book Sales')
plt.show()
""",
    )
    c = one_chart(e)
    check("a bar chart", c.type == ChartType.BAR, repr(c.type))
    check(
        "its bars",
        [(b.label, b.group, b.value) for b in c.elements]
        == [("Author A", "Books Sold", 100), ("Author B", "Books Sold", 200), ("Author C", "Books Sold", 300)],
        repr([(b.label, b.group, b.value) for b in c.elements]),
    )
    check("its y unit", c.y_unit == "books", repr(c.y_unit))

    e = run(
        s,
        """
plt.figure()
plt.pie([1, 1, 2], labels=['A', 'B', 'C'])
plt.title('Shares')
plt.show()
""",
    )
    c = one_chart(e)
    check("a pie chart", c.type == ChartType.PIE and c.title == "Shares", repr(c.to_dict()))
    check(
        "its wedges",
        [(w.label, round(w.angle), w.radius) for w in c.elements] == [("A", 90, 1), ("B", 90, 1), ("C", 180, 1)],
        repr([(w.label, w.angle, w.radius) for w in c.elements]),
    )

    e = run(
        s,
        """
plt.figure()
plt.scatter([1, 2, 3], [4, 5, 6], label='pts')
plt.show()
""",
    )
    c = one_chart(e)
    check("a scatter chart", c.type == ChartType.SCATTER, repr(c.type))
    check("its points", c.elements[0].label == "pts" and c.elements[0].points == [(1, 4), (2, 5), (3, 6)], repr(c.elements[0].points))

    e = run(
        s,
        """
fig, ax = plt.subplots()
ax.boxplot([[1, 2, 3, 4, 5], [2, 4, 6, 8, 40]], labels=['one', 'two'])
ax.set_title('Boxes')
fig
""",
    )
    c = one_chart(e)
    check("a box and whisker chart", c.type == ChartType.BOX_AND_WHISKER and c.title == "Boxes", repr(c.to_dict()))
    b = c.elements[0]
    check("its first box", (b.label, b.min, b.first_quartile, b.median, b.third_quartile, b.max) == ("one", 1, 2, 3, 4, 5), repr(c.to_dict()))
    check("its second box's outlier", c.elements[1].label == "two" and c.elements[1].outliers == [40], repr(c.to_dict()))

    e = run(
        s,
        """
fig, (a, b) = plt.subplots(1, 2)
a.plot([1, 2], [3, 4])
b.bar(['x', 'y'], [1, 2])
fig.suptitle('Both')
plt.show()
""",
    )
    c = one_chart(e)
    check("a superchart", c.type == ChartType.SUPERCHART and c.title == "Both", repr(c.to_dict()))
    check("its charts", [x.type for x in c.elements] == [ChartType.LINE, ChartType.BAR], repr([x.type for x in c.elements]))

    e = run(
        s,
        """
import pandas as pd
dates = pd.date_range('2024-01-01', periods=3, freq='D')
plt.figure()
plt.plot(dates, [1, 2, 3], label='d')
plt.show()
""",
    )
    c = one_chart(e)
    check("a datetime axis", c.x_scale.value == "datetime", repr(c.x_scale))
    check("its points' dates", c.elements[0].points[0][0].startswith("2024-01-01T00:00:00"), repr(c.elements[0].points))
finally:
    s.kill()
print("all passed", flush=True)
