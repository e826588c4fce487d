"""sbx's code interpreter for E2B's `e2b-code-interpreter` SDK: the server it talks to on port
49999 of a sandbox (template code-interpreter-v1). Python 3 standard library only.

HTTP: GET /health; POST /execute {code, context_id?, language?, env_vars?} answers one JSON
object a line as the code runs (stdout, stderr, result, error, number_of_executions,
keepalive, end_of_execution); POST /contexts {language?, cwd?}; GET /contexts;
DELETE /contexts/{id}; POST /contexts/{id}/restart.

A context is one child process (its kernel): python (KERNEL_PY below), javascript or
typescript (node running kernel.js, given as argv[1] or found next to this file; TypeScript's
compiler, Debian's node-typescript, takes the types away), r (Rscript running KERNEL_R), java
(a JVM running KERNEL_JAVA, JShell's local engine; Debian's default-jdk-headless) or bash. The kernel reads one
command a line from a pipe and writes its messages (ready, result, error, done) to another; its
stdout and stderr are pipes read as they are written. One thread a kernel reads them all, and
ends with the kernel. A client that goes away mid-cell interrupts it (SIGINT); a kernel that
does not stop within 2 s is killed with its process group and started again.

Env: SBX_INTERP_PORT (default 49999), SBX_INTERP_CWD (default /home/user: made if missing).
"""

import codecs
import json
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time

SERVED = ("python", "javascript", "typescript", "r", "java", "bash")
KEEPALIVE = 5.0
GRACE = 2.0
KERNEL_JS = sys.argv[1] if len(sys.argv) > 1 else None

KERNEL_PY = r'''
import ast, base64, builtins, io, json, linecache, os, signal, sys, traceback, types
CTL, CMD = int(sys.argv[1]), int(sys.argv[2])
os.set_inheritable(CTL, False)
os.set_inheritable(CMD, False)
KFILE = sys._getframe().f_code.co_filename

def unread(fds, limit=2.0):
    # Waits (bounded) until the server has read what is in these pipes: stdout and stderr
    # before a message, the message before what the code writes next, so that the three
    # pipes keep the order they were written in.
    import fcntl, termios, time
    end = time.monotonic() + limit
    buf = bytearray(4)
    for fd in fds:
        while time.monotonic() < end:
            try:
                fcntl.ioctl(fd, termios.FIONREAD, buf)
            except OSError:
                break
            if not int.from_bytes(buf, sys.byteorder):
                break
            time.sleep(0.001)

def send(obj):
    data = (json.dumps(obj, default=str) + "\n").encode()
    ordered = obj.get("type") in ("result", "error")
    if ordered:
        unread((1, 2))
    while data:
        data = data[os.write(CTL, data):]
    if ordered:
        unread((CTL,))

def stream(fd):
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True)

sys.stdout, sys.stderr = stream(1), stream(2)
sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
main = types.ModuleType("__main__")
main.__dict__["__builtins__"] = builtins
sys.modules["__main__"] = main
NS = main.__dict__
LOOP = None

def flush():
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass

def b64(b):
    return base64.b64encode(b).decode()

REPRS = (("_repr_html_", "text/html"), ("_repr_markdown_", "text/markdown"),
         ("_repr_svg_", "image/svg+xml"), ("_repr_png_", "image/png"),
         ("_repr_jpeg_", "image/jpeg"), ("_repr_pdf_", "application/pdf"),
         ("_repr_latex_", "text/latex"), ("_repr_json_", "application/json"),
         ("_repr_javascript_", "application/javascript"))

def fig_png(fig):
    b = io.BytesIO()
    fig.savefig(b, format="png", bbox_inches="tight")
    return b64(b.getvalue())

def plain(v):
    # A value JSON takes: numpy's scalars as Python's, NaN as null.
    if hasattr(v, "item") and type(v).__module__ == "numpy":
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    return v

def unit(label):
    import re
    m = re.search(r"\(([^()]*)\)\s*$|\[([^\[\]]*)\]\s*$", label or "")
    return (m.group(1) if m.group(1) is not None else m.group(2)) if m else None

class Axis:
    # How an axis' numbers read: dates as ISO strings, categories as their names.
    def __init__(self, a, scale):
        conv = a.get_converter() if hasattr(a, "get_converter") else getattr(a, "converter", None)
        mod = type(conv).__module__ if conv is not None else ""
        self.scale, self.names = scale, None
        if mod == "matplotlib.dates":
            self.scale = "datetime"
        elif mod == "matplotlib.category":
            self.scale = "categorical"
            units = a.get_units()
            self.names = {v: k for k, v in getattr(units, "_mapping", {}).items()}
    def value(self, x):
        x = plain(x)
        if x is None:
            return None
        if self.scale == "datetime":
            from matplotlib.dates import num2date
            return num2date(x).isoformat()
        if self.names is not None:
            return self.names.get(int(round(x)), x) if isinstance(x, (int, float)) else x
        return x

def chart2d(ax, kind):
    xl, yl = ax.get_xlabel() or None, ax.get_ylabel() or None
    return {"type": kind, "title": ax.get_title() or None, "elements": [],
            "x_label": xl, "y_label": yl, "x_unit": unit(xl), "y_unit": unit(yl)}

def axes_chart(ax):
    from matplotlib.patches import Wedge
    from matplotlib.container import BarContainer
    from matplotlib.collections import PathCollection
    title = ax.get_title() or None
    wedges = [p for p in ax.patches if isinstance(p, Wedge)]
    if wedges:
        return {"type": "pie", "title": title, "elements": [
            {"label": w.get_label(), "angle": plain(abs(w.theta2 - w.theta1)), "radius": plain(w.r)} for w in wedges]}
    boxes = getattr(ax, "_sbx_boxes", None)
    if boxes:
        d = chart2d(ax, "box_and_whisker")
        names = [t.get_text() for t in ax.get_xticklabels()]
        for i, b in enumerate(boxes):
            label = b.get("label")
            if label is None:
                label = names[i] if i < len(names) else str(i + 1)
            d["elements"].append({"label": str(label), "min": plain(b["whislo"]), "first_quartile": plain(b["q1"]),
                                  "median": plain(b["med"]), "third_quartile": plain(b["q3"]),
                                  "max": plain(b["whishi"]), "outliers": [plain(f) for f in b.get("fliers", [])]})
        return d
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    if bars:
        d = chart2d(ax, "bar")
        horizontal = getattr(bars[0], "orientation", "vertical") == "horizontal"
        cat = Axis(ax.yaxis if horizontal else ax.xaxis, "linear")
        for c in bars:
            group = c.get_label()
            for r in c.patches:
                if horizontal:
                    pos, value = r.get_y() + r.get_height() / 2, r.get_width()
                else:
                    pos, value = r.get_x() + r.get_width() / 2, r.get_height()
                d["elements"].append({"label": str(cat.value(pos)), "group": group, "value": plain(value)})
        return d
    scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
    lines = ax.get_lines()
    if not scatters and not lines:
        return None
    d = chart2d(ax, "scatter" if scatters else "line")
    xa, ya = Axis(ax.xaxis, ax.get_xscale()), Axis(ax.yaxis, ax.get_yscale())
    d.update({"x_scale": xa.scale, "y_scale": ya.scale,
              "x_ticks": [xa.value(t) for t in ax.get_xticks()], "x_tick_labels": [t.get_text() for t in ax.get_xticklabels()],
              "y_ticks": [ya.value(t) for t in ax.get_yticks()], "y_tick_labels": [t.get_text() for t in ax.get_yticklabels()]})
    if scatters:
        series = [(c.get_label(), c.get_offsets()) for c in scatters]
    else:
        series = [(l.get_label(), l.get_xydata()) for l in lines]  # as the axes' numbers
    for label, pts in series:
        d["elements"].append({"label": label, "points": [[xa.value(x), ya.value(y)] for x, y in pts]})
    return d

def fig_chart(fig):
    charts = [c for c in (axes_chart(ax) for ax in fig.get_axes()) if c is not None]
    if len(charts) == 1:
        return charts[0]
    if not charts:
        return None
    sup = getattr(fig, "_suptitle", None)
    return {"type": "superchart", "title": sup.get_text() if sup is not None else None, "elements": charts}

def fig_bundle(fig):
    d = {"text/plain": repr(fig), "image/png": fig_png(fig)}
    try:
        c = fig_chart(fig)
        if c is not None:
            d["e2b/chart"] = c
    except Exception:
        pass
    return d

def frame_data(df):
    out = df.to_dict(orient="list")
    for k, col in out.items():
        out[k] = [x.isoformat() if hasattr(x, "isoformat") else plain(x) for x in col]
    return {str(k): v for k, v in out.items()}

def bundle(v):
    d = {"text/plain": repr(v)}
    t = type(v)
    for attr, mime in REPRS:
        f = getattr(t, attr, None)
        if f is None:
            continue
        try:
            r = f(v)
        except Exception:
            continue
        if isinstance(r, tuple):
            r = r[0]
        if r is None:
            continue
        d[mime] = b64(r) if isinstance(r, (bytes, bytearray)) else r
    if t.__module__.startswith("matplotlib.") and t.__name__ == "Figure":
        try:
            d.update(fig_bundle(v))
        except Exception:
            pass
    if t.__module__.startswith("pandas.") and t.__name__ == "DataFrame":
        try:
            d["e2b/data"] = frame_data(v)
        except Exception:
            pass
    return d

def display(*objs, **_):
    flush()
    for o in objs:
        send({"type": "result", "main": False, "data": bundle(o)})

def show_figures(*_a, **_k):
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    flush()
    for n in plt.get_fignums():
        fig = plt.figure(n)
        try:
            send({"type": "result", "main": False, "data": fig_bundle(fig)})
        except Exception as e:
            print("figure %s: %s" % (n, e), file=sys.stderr)
    plt.close("all")

class Inline:
    # matplotlib's backend "module://sbx_inline": Agg whose show() displays the figures.
    def create_module(self, spec):
        return None
    def exec_module(self, m):
        from matplotlib.backends import backend_agg
        m.__dict__.update({k: v for k, v in vars(backend_agg).items() if not k.startswith("__")})
        m.show = show_figures

class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "sbx_inline":
            import importlib.machinery
            return importlib.machinery.ModuleSpec(name, Inline())
        if name != "matplotlib":
            return None
        sys.meta_path.remove(Finder)
        sys.meta_path.append(Finder)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        ex = spec.loader.exec_module
        def exec_module(m):
            ex(m)
            if not os.environ.get("MPLBACKEND"):
                try:
                    m.rcParams["backend"] = "module://sbx_inline"
                except Exception:
                    pass
            try:  # a box plot's statistics, kept on its axes for its chart
                from matplotlib.axes import Axes
                bxp = Axes.bxp
                def keep(self, bxpstats, *a, **k):
                    self._sbx_boxes = list(getattr(self, "_sbx_boxes", [])) + [dict(b) for b in bxpstats]
                    return bxp(self, bxpstats, *a, **k)
                Axes.bxp = keep
            except Exception:
                pass
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Finder)

def system(cmd):
    import subprocess
    flush()
    subprocess.run(["/bin/bash", "-c", cmd], stdin=subprocess.DEVNULL)

def magics(code):
    # The IPython forms people paste: !cmd, %cd, %pip, %%bash/%%sh cells.
    lines = code.split("\n")
    first = lines[0].strip()
    if first in ("%%bash", "%%sh"):
        return "__sbx_system__(%r)" % "\n".join(lines[1:])
    out = []
    for line in lines:
        s = line.lstrip()
        ind = line[: len(line) - len(s)]
        if s.startswith("!"):
            line = ind + "__sbx_system__(%r)" % s[1:]
        elif s.startswith("%pip ") or s.startswith("%conda "):
            line = ind + "__sbx_system__(%r)" % (sys.executable + " -m pip " + s[5:] if s.startswith("%pip") else s[1:])
        elif s.startswith("%cd"):
            line = ind + "__import__('os').chdir(__import__('os').path.expanduser(%r or '~'))" % s[3:].strip()
        out.append(line)
    return "\n".join(out)

def report(e):
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == KFILE:
        tb = tb.tb_next
    if isinstance(e, SyntaxError) and tb is None:
        text = "".join(traceback.format_exception_only(type(e), e))
    else:
        text = "".join(traceback.format_exception(type(e), e, tb))
    try:
        value = str(e)
    except Exception:
        value = "<exception str() failed>"
    send({"type": "error", "name": type(e).__name__, "value": value, "traceback": text})

def run_code(co):
    global LOOP
    r = eval(co, NS)
    if co.co_flags & 0x80:  # CO_COROUTINE: top-level await
        if LOOP is None:
            import asyncio
            LOOP = asyncio.new_event_loop()
        r = LOOP.run_until_complete(r)
    return r

def cell(code, n):
    fname = "Cell In[%d]" % n
    try:
        tree = ast.parse(code, fname)
    except SyntaxError:
        alt = magics(code)
        if alt == code:
            raise
        try:
            tree = ast.parse(alt, fname)
        except SyntaxError:
            raise
        code = alt
    linecache.cache[fname] = (len(code), None, code.splitlines(True), fname)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    run_code(compile(tree, fname, "exec", flags=flags))
    if last is not None:
        v = run_code(compile(last, fname, "eval", flags=flags))
        if v is not None:
            builtins._ = v
            d = bundle(v)
            flush()
            send({"type": "result", "main": True, "data": d})
            if "image/png" in d and "matplotlib.pyplot" in sys.modules:
                try:
                    sys.modules["matplotlib.pyplot"].close(v)
                except Exception:
                    pass

def execute(req):
    n = req.get("n", 0)
    env = req.get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            cell(req["code"], n)
        finally:
            flush()
        show_figures()
    except BaseException as e:
        flush()
        report(e)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        flush()

NS["display"] = display
NS["__sbx_system__"] = system
signal.signal(signal.SIGINT, signal.SIG_IGN)
cmds = os.fdopen(CMD, "rb")
send({"type": "ready", "pid": os.getpid()})
while True:
    line = cmds.readline()
    if not line:
        break
    try:
        execute(json.loads(line))
    except BaseException as e:
        try:
            report(e)
        except BaseException:
            pass
    send({"type": "done"})
'''

# R: one persistent Rscript a context. A command is the path of a file of the cell's code,
# its environment beside it (`<path>.post`: NAME<TAB>hex of the value, a line each). Each
# top-level expression is evaluated in the global environment; a visible value is printed, the
# last one is the cell's result; stdout is flushed after each.
KERNEL_R = r'''
a <- commandArgs(trailingOnly = TRUE)
ctl <- file(sprintf("/dev/fd/%s", a[1]), "w")
cmd <- file(sprintf("/dev/fd/%s", a[2]), "r")
js <- function(x) {
  x <- enc2utf8(paste(as.character(x), collapse = "\n"))
  x <- gsub("\\", "\\\\", x, fixed = TRUE)
  x <- gsub("\"", "\\\"", x, fixed = TRUE)
  x <- gsub("\n", "\\n", x, fixed = TRUE)
  x <- gsub("\r", "\\r", x, fixed = TRUE)
  x <- gsub("\t", "\\t", x, fixed = TRUE)
  paste0("\"", gsub("[[:cntrl:]]", "", x), "\"")
}
send <- function(...) {
  flush(stdout())
  writeLines(paste0("{", paste(..., sep = ","), "}"), ctl)
  flush(ctl)
}
kv <- function(k, v) paste0(js(k), ":", v)
err <- function(name, value, tb = "") send(kv("type", js("error")), kv("name", js(name)), kv("value", js(value)), kv("traceback", js(tb)))
unhex <- function(h) if (nchar(h) == 0) "" else rawToChar(as.raw(strtoi(substring(h, seq(1, nchar(h), 2), seq(2, nchar(h), 2)), 16L)))
cell <- function(path) {
  envf <- paste0(path, ".post")
  saved <- list()
  if (file.exists(envf)) {
    for (l in readLines(envf, warn = FALSE)) {
      p <- strsplit(l, "\t", fixed = TRUE)[[1]]
      saved[[p[1]]] <- Sys.getenv(p[1], unset = NA)
      do.call(Sys.setenv, setNames(list(unhex(if (length(p) > 1) p[2] else "")), p[1]))
    }
  }
  on.exit(for (k in names(saved)) if (is.na(saved[[k]])) Sys.unsetenv(k) else do.call(Sys.setenv, setNames(list(saved[[k]]), k)))
  tryCatch({
    exprs <- parse(file = path, keep.source = FALSE, encoding = "UTF-8")
    n <- length(exprs)
    for (i in seq_len(n)) {
      r <- withVisible(eval(exprs[[i]], envir = globalenv()))
      if (r$visible) {
        if (i == n) {
          assign(".Last.value", r$value, envir = globalenv())
          send(kv("type", js("result")), kv("main", "true"), paste0(js("data"), ":{", kv("text/plain", js(utils::capture.output(print(r$value)))), "}"))
        } else {
          print(r$value)
        }
      }
      flush(stdout())
    }
  }, interrupt = function(e) err("KeyboardInterrupt", "the cell was interrupted"),
  error = function(e) {
    call <- conditionCall(e)
    err(class(e)[1], conditionMessage(e), paste0("Error", if (!is.null(call)) paste0(" in ", paste(deparse(call), collapse = " ")) else "", ": ", conditionMessage(e)))
  })
}
send(kv("type", js("ready")), kv("pid", Sys.getpid()))
repeat {
  line <- readLines(cmd, n = 1)
  if (length(line) == 0) break
  cell(line)
  send(kv("type", js("done")))
}
'''

# Java: one JVM a context, running this source (java's single-file launch) with JShell's local
# engine: the cell's snippets are evaluated in turn, the last one's value is the cell's result
# (a String's text unquoted); what code writes to System.out and System.err comes as messages
# (each line's end a chunk of its own); the cell's env and the sandbox's are system properties
# (as E2B's Java kernel has them); SIGINT stops the running snippet. A command is the path of a
# file of the cell's code, with its env beside it as R's.
KERNEL_JAVA = r'''
import java.io.*;
import java.nio.charset.StandardCharsets;
import java.nio.file.*;
import java.util.*;
import jdk.jshell.*;

public class Kernel {
    static PrintStream ctl;

    static String js(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) b.append(String.format("\\u%04x", (int) c)); else b.append(c);
            }
        }
        return b.append('"').toString();
    }

    static synchronized void send(String json) {
        ctl.print(json + "\n");
        ctl.flush();
    }

    static void error(String name, String value, String tb) {
        send("{\"type\":\"error\",\"name\":" + js(name) + ",\"value\":" + js(value) + ",\"traceback\":" + js(tb) + "}");
    }

    /** What code writes to System.out or System.err: a message a write, as it is written. */
    static class Stream extends OutputStream {
        final String name;
        final ByteArrayOutputStream carry = new ByteArrayOutputStream();
        Stream(String name) { this.name = name; }
        public void write(int b) { write(new byte[] {(byte) b}, 0, 1); }
        public synchronized void write(byte[] b, int off, int len) {
            carry.write(b, off, len);
            byte[] all = carry.toByteArray();
            // An incomplete UTF-8 sequence at the end waits for its rest.
            int end = all.length, i = end - 1, back = 0;
            while (i >= 0 && back < 3 && (all[i] & 0xC0) == 0x80) { i--; back++; }
            if (i >= 0 && (all[i] & 0x80) != 0) {
                int need = (all[i] & 0xE0) == 0xC0 ? 2 : (all[i] & 0xF0) == 0xE0 ? 3 : 4;
                if (end - i < need) end = i;
            }
            carry.reset();
            carry.write(all, end, all.length - end);
            String text = new String(all, 0, end, StandardCharsets.UTF_8);
            // A line's end goes as a chunk of its own, as E2B's Java kernel streams println.
            if (text.length() > 1 && text.endsWith("\n")) {
                chunk(text.substring(0, text.length() - 1));
                chunk("\n");
            } else if (!text.isEmpty()) {
                chunk(text);
            }
        }

        void chunk(String text) {
            send("{\"type\":" + js(name) + ",\"text\":" + js(text) + "}");
        }
    }

    static String unquote(String v) {
        if (v == null || v.length() < 2 || v.charAt(0) != '"' || v.charAt(v.length() - 1) != '"') return v;
        StringBuilder b = new StringBuilder();
        for (int i = 1; i < v.length() - 1; i++) {
            char c = v.charAt(i);
            if (c != '\\' || i + 1 >= v.length() - 1) { b.append(c); continue; }
            char n = v.charAt(++i);
            switch (n) {
                case 'n': b.append('\n'); break;
                case 't': b.append('\t'); break;
                case 'r': b.append('\r'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'u':
                    if (i + 4 < v.length()) { b.append((char) Integer.parseInt(v.substring(i + 1, i + 5), 16)); i += 4; }
                    break;
                default: b.append(n);
            }
        }
        return b.toString();
    }

    static String unhex(String h) {
        byte[] b = new byte[h.length() / 2];
        for (int i = 0; i < b.length; i++) b[i] = (byte) Integer.parseInt(h.substring(2 * i, 2 * i + 2), 16);
        return new String(b, StandardCharsets.UTF_8);
    }

    static void cell(JShell sh, String path) throws IOException {
        String code = new String(Files.readAllBytes(Paths.get(path)), StandardCharsets.UTF_8);
        // The cell's environment, as system properties (E2B's Java kernel), put back after it.
        Map<String, String> saved = new HashMap<>();
        Path post = Paths.get(path + ".post");
        if (Files.exists(post)) {
            for (String l : Files.readAllLines(post, StandardCharsets.UTF_8)) {
                String[] p = l.split("\t", 2);
                saved.put(p[0], System.getProperty(p[0]));
                System.setProperty(p[0], unhex(p.length > 1 ? p[1] : ""));
            }
        }
        try {
            SourceCodeAnalysis sca = sh.sourceCodeAnalysis();
            List<String> snippets = new ArrayList<>();
            String rest = code;
            while (!rest.isBlank()) {
                SourceCodeAnalysis.CompletionInfo ci = sca.analyzeCompletion(rest);
                SourceCodeAnalysis.Completeness c = ci.completeness();
                if (c == SourceCodeAnalysis.Completeness.EMPTY) break;
                if (c.isComplete()) {
                    snippets.add(ci.source());
                    rest = ci.remaining();
                } else {
                    snippets.add(rest);
                    break;
                }
            }
            String result = null;
            for (int n = 0; n < snippets.size(); n++) {
                result = null;
                for (SnippetEvent ev : sh.eval(snippets.get(n))) {
                    if (ev.causeSnippet() != null) continue;
                    Snippet sn = ev.snippet();
                    if (ev.status() == Snippet.Status.REJECTED) {
                        StringBuilder m = new StringBuilder();
                        sh.diagnostics(sn).forEach(d -> m.append(d.getMessage(Locale.ROOT)).append('\n'));
                        error("CompilationException", m.toString().trim(), sn.source());
                        return;
                    }
                    if (ev.exception() != null) {
                        JShellException x = ev.exception();
                        String name = x instanceof EvalException ? ((EvalException) x).getExceptionClassName() : x.getClass().getName();
                        StringWriter tb = new StringWriter();
                        x.printStackTrace(new PrintWriter(tb));
                        error(name, String.valueOf(x.getMessage()), tb.toString());
                        return;
                    }
                    String type = sn instanceof VarSnippet ? ((VarSnippet) sn).typeName()
                        : sn instanceof ExpressionSnippet ? ((ExpressionSnippet) sn).typeName() : null;
                    boolean shown = sn.kind() == Snippet.Kind.EXPRESSION
                        || sn.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND;
                    if (shown && ev.value() != null && type != null && !type.equals("void")) {
                        result = type.equals("String") ? unquote(ev.value()) : ev.value();
                    }
                }
            }
            if (result != null) {
                send("{\"type\":\"result\",\"main\":true,\"data\":{\"text/plain\":" + js(result) + "}}");
            }
        } finally {
            System.out.flush();
            System.err.flush();
            for (Map.Entry<String, String> e : saved.entrySet()) {
                if (e.getValue() == null) System.clearProperty(e.getKey()); else System.setProperty(e.getKey(), e.getValue());
            }
        }
    }

    public static void main(String[] a) throws Exception {
        ctl = new PrintStream(new FileOutputStream("/dev/fd/" + a[0]), false, StandardCharsets.UTF_8);
        BufferedReader cmd = new BufferedReader(new InputStreamReader(new FileInputStream("/dev/fd/" + a[1]), StandardCharsets.UTF_8));
        // The sandbox's environment as system properties too, as E2B's Java kernel has it.
        for (Map.Entry<String, String> e : System.getenv().entrySet()) {
            if (System.getProperty(e.getKey()) == null) System.setProperty(e.getKey(), e.getValue());
        }
        System.setOut(new PrintStream(new Stream("stdout"), true, StandardCharsets.UTF_8));
        System.setErr(new PrintStream(new Stream("stderr"), true, StandardCharsets.UTF_8));
        JShell sh = JShell.builder().executionEngine("local").out(System.out).err(System.err).build();
        // An interrupt (SIGINT) stops the running snippet; the kernel lives on.
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), s -> sh.stop());
        // The first snippet pays for the compiler's start: made before the first cell, dropped.
        for (SnippetEvent ev : sh.eval("0")) sh.drop(ev.snippet());
        send("{\"type\":\"ready\",\"pid\":" + ProcessHandle.current().pid() + "}");
        String line;
        while ((line = cmd.readLine()) != null) {
            try {
                cell(sh, line);
            } catch (Throwable t) {
                error(t.getClass().getName(), String.valueOf(t.getMessage()), "");
            }
            send("{\"type\":\"done\"}");
        }
    }
}
'''


BASH_LOOP = r'''
exec 62<&"$2" 63>&"$1"; eval "exec $1>&- $2<&-"
printf '{"type":"ready","pid":%d}\n' $$ >&63
while IFS= read -r -u 62 __sbx_f; do
  source "$__sbx_f" 62<&- 63>&-
  __sbx_rc=$?
  [ -f "$__sbx_f.post" ] && source "$__sbx_f.post" 62<&- 63>&-
  rm -f "$__sbx_f" "$__sbx_f.post"
  printf '{"type":"done","rc":%d}\n' "$__sbx_rc" >&63
done
'''


def now():
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat()


def new_id():
    h = bytearray(os.urandom(16))
    h[6] = (h[6] & 0x0F) | 0x40
    h[8] = (h[8] & 0x3F) | 0x80
    h = h.hex()
    return "-".join((h[:8], h[8:12], h[12:16], h[16:20], h[20:]))


def log(*a):
    print("interp:", *a, file=sys.stderr, flush=True)


def kernel_js():
    if KERNEL_JS is not None:
        return KERNEL_JS
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.js")
    with open(path, encoding="utf-8") as f:
        return f.read()


def kernel_argv(lang, ctl, cmd):
    if lang == "python":
        return [sys.executable or "python3", "-c", KERNEL_PY, str(ctl), str(cmd)]
    if lang in ("javascript", "typescript"):
        return ["node", "--expose-internals", "-e", kernel_js(), lang, str(ctl), str(cmd)]
    if lang == "r":
        return ["Rscript", "--vanilla", "-e", KERNEL_R, str(ctl), str(cmd)]
    if lang == "java":
        return ["java", "-XX:+UseSerialGC", "-Xshare:auto", java_source(), str(ctl), str(cmd)]
    return ["bash", "--noprofile", "--norc", "-c", BASH_LOOP, "bash", str(ctl), str(cmd)]


JAVA_SOURCE = []
JAVA_LOCK = threading.Lock()


def java_source():
    """The Java kernel's source as a file (java launches a single source file), written once
    into a directory of this server's own."""
    with JAVA_LOCK:
        if not JAVA_SOURCE:
            import tempfile

            d = tempfile.mkdtemp(prefix="sbx-interp-java-")
            path = os.path.join(d, "Kernel.java")
            with open(path, "w", encoding="utf-8") as f:
                f.write(KERNEL_JAVA)
            JAVA_SOURCE.append(path)
        return JAVA_SOURCE[0]


def child_env():
    return {k: v for k, v in os.environ.items() if not k.startswith("SBX_INTERP_")}


class Kernel:
    """One child process of a context, and the thread that reads its pipes into `q`."""

    def __init__(self, lang, cwd):
        self.lang = lang
        self.q = queue.Queue()
        self.busy = False
        self.stopping = False
        self.ready = threading.Event()
        self.returncode = None
        self.wlock = threading.Lock()  # self.cmd is closed under it: never written once closed
        ctl_r, ctl_w = os.pipe()
        cmd_r, cmd_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                kernel_argv(lang, ctl_w, cmd_r),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(ctl_w, cmd_r),
                cwd=cwd,
                env=child_env(),
                start_new_session=True,
            )
        except BaseException:
            os.close(ctl_r)
            os.close(cmd_w)
            raise
        finally:
            os.close(ctl_w)
            os.close(cmd_r)
        self.ctl, self.cmd = ctl_r, cmd_w
        threading.Thread(target=self._read, name="kernel-%d" % self.proc.pid, daemon=True).start()

    @property
    def dead(self):
        return self.returncode is not None

    def send_line(self, line):
        """A command; False if the kernel is gone (its exit is in `q` then)."""
        data = (line + "\n").encode()
        with self.wlock:
            if self.cmd is None:
                return False
            try:
                while data:
                    data = data[os.write(self.cmd, data):]
                return True
            except OSError:
                return False

    def interrupt(self):
        try:
            os.kill(self.proc.pid, signal.SIGINT)
        except OSError:
            pass

    def kill(self):
        for f in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), lambda: self.proc.kill()):
            try:
                f()
            except OSError:
                pass

    def stop(self):
        self.stopping = True
        self.kill()

    def _read(self):
        sel = selectors.DefaultSelector()
        decoders = {}
        for f, kind in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"), (self.ctl, "ctl")):
            fd = f if isinstance(f, int) else f.fileno()
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, kind)
            decoders[fd] = codecs.getincrementaldecoder("utf-8")("replace")
        buf = b""

        def read(key):
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:  # drain() read it since the select that named it
                return None
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fd)
                return key.data == "ctl"
            if key.data == "ctl":
                return data
            text = decoders[key.fd].decode(data)
            if text and self.busy:
                self.q.put((key.data, text))
            return None

        def drain():
            # What the kernel wrote before its message is in the pipes already.
            while True:
                ready = [k for k, _ in sel.select(0) if k.data != "ctl"]
                if not ready:
                    return
                for k in ready:
                    read(k)

        try:
            ctl_open = True
            while ctl_open:
                for key, _ in sel.select(1.0):
                    r = read(key)
                    if r is True:
                        ctl_open = False
                    elif isinstance(r, bytes):
                        buf += r
                        while b"\n" in buf:
                            line, buf = buf.split(b"\n", 1)
                            try:
                                msg = json.loads(line)
                            except ValueError:
                                continue
                            if msg.get("type") == "ready":
                                self.ready.set()
                                continue
                            drain()
                            self.q.put(("msg", msg))
                if ctl_open and self.proc.poll() is not None:
                    ctl_open = False
            drain()
        finally:
            self.kill()
            try:
                self.returncode = self.proc.wait()
            except Exception:
                self.returncode = -1
            sel.close()
            for f in (self.proc.stdout, self.proc.stderr):
                f.close()
            os.close(self.ctl)
            with self.wlock:
                os.close(self.cmd)
                self.cmd = None
            self.ready.set()
            self.q.put(("exit", self.returncode))


class ClientGone(Exception):
    pass


class Context:
    def __init__(self, lang, cwd):
        self.id = new_id()
        self.language = lang
        self.cwd = cwd
        self.lock = threading.Lock()  # one cell at a time, as a Jupyter kernel
        self.mu = threading.Lock()  # the kernel's swaps
        self.count = 0
        self.removed = False
        self.kernel = Kernel(lang, cwd)

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def current(self):
        """The context's kernel, started again if it has ended (OSError if it cannot be)."""
        with self.mu:
            if self.kernel.dead and not self.removed:
                self.kernel = Kernel(self.language, self.cwd)
                self.count = 0
            return self.kernel

    def replace(self, old):
        """Kills `old` and starts a new kernel if `old` is still the context's."""
        old.stop()
        with self.mu:
            if self.kernel is old and not self.removed:
                try:
                    self.kernel = Kernel(self.language, self.cwd)
                    self.count = 0
                except OSError as e:  # current() tries again at the next cell
                    log("context %s: could not start its %s kernel again: %s" % (self.id, self.language, e))

    def restart(self):
        """Raises OSError if the new kernel cannot be started (the old one is stopped)."""
        with self.mu:
            old = self.kernel
            old.stop()
            self.kernel = Kernel(self.language, self.cwd)
            self.count = 0

    def remove(self):
        with self.mu:
            self.removed = True
            self.kernel.stop()

    def execute(self, code, env, emit, gone):
        """Runs one cell; `emit(obj)` writes a line (raises ClientGone), `gone()` says
        whether the client has hung up."""
        while not self.lock.acquire(timeout=0.5):
            if gone():
                return
        try:
            self._execute(code, env, emit, gone)
        finally:
            self.lock.release()

    def _execute(self, code, env, emit, gone):
        try:
            k = self.current()
        except OSError as e:
            emit({"type": "error", "name": "ContextNotStarted", "value": "could not start the context's %s kernel: %s" % (self.language, e), "traceback": ""})
            return
        if self.removed:
            emit({"type": "error", "name": "ContextNotFound", "value": "Context %s was removed" % self.id, "traceback": ""})
            return
        while True:  # what a previous cell left
            try:
                k.q.get_nowait()
            except queue.Empty:
                break
        self.count += 1
        n = self.count
        cellfile = None
        k.busy = True
        try:
            if self.language == "bash":
                cellfile = bash_cell(code, env)
                k.send_line(cellfile)
            elif self.language in ("r", "java"):
                cellfile = file_cell(code, env, ".java" if self.language == "java" else ".R")
                k.send_line(cellfile)
            else:
                k.send_line(json.dumps({"op": "exec", "code": code, "env": env, "n": n}))
            emit({"type": "number_of_executions", "execution_count": n})
            last = time.monotonic()
            while True:
                try:
                    ev = k.q.get(timeout=0.5)
                except queue.Empty:
                    if gone():
                        raise ClientGone()
                    if k.dead and k.q.empty():  # its exit was taken for a previous cell's
                        ev = ("exit", k.returncode)
                    else:
                        ev = None
                if ev is None:
                    if time.monotonic() - last >= KEEPALIVE:
                        emit({"type": "keepalive"})
                        last = time.monotonic()
                    continue
                kind = ev[0]
                if kind in ("stdout", "stderr"):
                    emit({"type": kind, "text": ev[1], "timestamp": now()})
                elif kind == "exit":
                    if k.stopping:
                        err = ("ContextRestarting", "Context was restarted")
                    else:
                        err = ("ContextRestarting", "The context's %s process ended (exit status %s) and was started again: its state is lost" % (self.language, ev[1]))
                    emit({"type": "error", "name": err[0], "value": err[1], "traceback": ""})
                    self.replace(k)
                    return
                else:
                    msg = ev[1]
                    t = msg.get("type")
                    if t == "done":
                        rc = msg.get("rc")
                        if rc:
                            emit({"type": "error", "name": "ExitError", "value": "exit status %d" % rc, "traceback": ""})
                        return
                    if t in ("stdout", "stderr"):  # the Java kernel's output
                        emit({"type": t, "text": str(msg.get("text", "")), "timestamp": now()})
                    elif t == "result":
                        emit(result(msg.get("data") or {}, bool(msg.get("main"))))
                    elif t == "error":
                        emit({"type": "error", "name": str(msg.get("name", "")), "value": str(msg.get("value", "")), "traceback": str(msg.get("traceback", ""))})
                last = time.monotonic()
        except ClientGone:
            self._cancel(k)
        finally:
            k.busy = False
            if cellfile:
                for p in (cellfile, cellfile + ".post"):
                    try:
                        os.unlink(p)
                    except OSError:
                        pass

    def _cancel(self, k):
        """The client went away mid-cell: interrupt, and kill what does not stop."""
        if self.language != "bash":
            k.interrupt()
            deadline = time.monotonic() + GRACE
            while time.monotonic() < deadline:
                try:
                    ev = k.q.get(timeout=deadline - time.monotonic())
                except queue.Empty:
                    break
                if ev[0] == "exit":
                    self.replace(k)
                    return
                if ev[0] == "msg" and ev[1].get("type") == "done":
                    return
        log("context %s: killing its %s kernel (cell cancelled)" % (self.id, self.language))
        self.replace(k)


def file_cell(code, env, suffix):
    """A cell for R and Java: its code in a file, its env beside it (`<path>.post`)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="sbx-cell-", suffix=suffix)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(code + "\n")
    if env:
        with open(path + ".post", "w", encoding="utf-8") as f:
            f.write("".join("%s\t%s\n" % (k, str(v).encode().hex()) for k, v in env.items()))
    return path


def bash_cell(code, env):
    import tempfile

    fd, path = tempfile.mkstemp(prefix="sbx-cell-", suffix=".sh")
    pre, post = [], []
    for i, (key, val) in enumerate(env.items()):
        q = "'" + str(val).replace("'", "'\\''") + "'"
        pre.append('__sbx_o%d="${%s-__sbx_unset}"; export %s=%s' % (i, key, key, q))
        post.append('if [ "$__sbx_o%d" = __sbx_unset ]; then unset %s; else %s="$__sbx_o%d"; fi; unset __sbx_o%d' % (i, key, key, i, i))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(pre + [code, ""]))
    if post:
        with open(path + ".post", "w", encoding="utf-8") as f:
            f.write("\n".join(post) + "\n")
    return path


MIMES = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript", "e2b/data": "data", "e2b/chart": "chart",
}


def result(data, main):
    out = {"type": "result"}
    extra = {}
    for mime, v in data.items():
        if mime in MIMES:
            out[MIMES[mime]] = v
        else:
            extra[mime] = v
    t = out.get("text")
    if isinstance(t, str) and len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        out["text"] = t[1:-1]  # as E2B's server: a string's quotes go
    out["extra"] = extra
    out["is_main_result"] = main
    return out


CONTEXTS = {}
DEFAULTS = {}
GLOCK = threading.Lock()
DEFAULT_CWD = os.environ.get("SBX_INTERP_CWD") or "/home/user"


def normalize(language):
    if not language:
        return "python"
    lang = str(language).strip().lower()
    return {"js": "javascript", "ts": "typescript", "py": "python", "python3": "python", "sh": "bash", "rlang": "r"}.get(lang, lang)


class BadRequest(Exception):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status
        self.text = text


def unserved(lang):
    return BadRequest(400, "language %r is not served by this sandbox's code interpreter: it serves %s" % (lang, ", ".join(SERVED)))


def new_context(lang, cwd=None):
    if lang not in SERVED:
        raise unserved(lang)
    if cwd is None:
        cwd = DEFAULT_CWD
        try:
            os.makedirs(cwd, exist_ok=True)
        except OSError:
            cwd = os.getcwd()
    elif not os.path.isdir(cwd):
        raise BadRequest(400, "cwd %r is not a directory in the sandbox" % cwd)
    try:
        ctx = Context(lang, cwd)
    except OSError as e:
        raise BadRequest(500, "Failed to create context: could not start the %s kernel: %s" % (lang, e))
    with GLOCK:
        CONTEXTS[ctx.id] = ctx
    return ctx


def default_context(lang):
    with GLOCK:
        cid = DEFAULTS.get(lang)
        ctx = CONTEXTS.get(cid) if cid else None
        if ctx is not None:
            return ctx
    if lang not in SERVED:
        raise unserved(lang)
    ctx = new_context(lang)
    with GLOCK:
        cid = DEFAULTS.get(lang)
        if cid in CONTEXTS:  # another request made one meanwhile
            CONTEXTS.pop(ctx.id, None)
            ctx.remove()
            return CONTEXTS[cid]
        DEFAULTS[lang] = ctx.id
    return ctx


def serve(port):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(Routes, BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "sbx-interp"
        timeout = 600

        def setup(self):
            super().setup()
            import socket

            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.allow_reuse_address = True
    return ThreadingHTTPServer(("0.0.0.0", port), Handler)


class Routes:
    """The routes, mixed into http.server's handler (imported once the kernel is starting)."""

    def log_message(self, *a):
        pass

    def reply(self, status, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else (json.dumps(body) if ctype == "application/json" else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def text(self, status, text):
        self.reply(status, text, "text/plain; charset=utf-8")

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
        else:
            n = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(n) if n else b""
        if not data.strip():
            return {}
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise BadRequest(422, "the body is not JSON: %s" % e)
        if not isinstance(obj, dict):
            raise BadRequest(422, "the body is not a JSON object")
        return obj

    def route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        try:
            if path == "/health":
                if method != "GET":
                    return self.reply(405, {"detail": "Method Not Allowed"})
                ctx = CONTEXTS.get(DEFAULTS.get("python"))
                if ctx is not None:
                    ctx.kernel.ready.wait(10)
                return self.reply(200, "OK")
            if path == "/execute" and method == "POST":
                return self.execute(self.body())
            if path == "/contexts":
                if method == "GET":
                    with GLOCK:
                        ctxs = [c.info() for c in CONTEXTS.values()]
                    return self.reply(200, ctxs)
                if method == "POST":
                    req = self.body()
                    cwd = req.get("cwd")
                    if cwd is not None and not isinstance(cwd, str):
                        raise BadRequest(422, "cwd must be a string")
                    return self.reply(200, new_context(normalize(req.get("language")), cwd or None).info())
            if len(parts) in (2, 3) and parts[0] == "contexts":
                with GLOCK:
                    ctx = CONTEXTS.get(parts[1])
                if len(parts) == 2 and method == "DELETE":
                    if ctx is None:
                        return self.text(404, "Context %s not found" % parts[1])
                    with GLOCK:
                        CONTEXTS.pop(ctx.id, None)
                    ctx.remove()
                    return self.reply(200, None)
                if len(parts) == 3 and parts[2] == "restart" and method == "POST":
                    if ctx is None:
                        return self.text(404, "Context %s not found" % parts[1])
                    try:
                        ctx.restart()
                    except OSError as e:
                        return self.text(500, "Failed to restart context %s: %s" % (ctx.id, e))
                    return self.reply(200, None)
            if path in ("/execute", "/contexts") or parts[0] == "contexts" and len(parts) <= 3:
                return self.reply(405, {"detail": "Method Not Allowed"})
            return self.reply(404, {"detail": "Not Found"})
        except BadRequest as e:
            return self.text(e.status, e.text) if e.status != 422 else self.reply(422, {"detail": e.text})

    def do_GET(self):
        self.route("GET")

    def do_POST(self):
        self.route("POST")

    def do_DELETE(self):
        self.route("DELETE")

    def gone(self):
        import select
        import socket

        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def execute(self, req):
        code = req.get("code")
        if not isinstance(code, str):
            raise BadRequest(422, "code must be a string")
        cid, language = req.get("context_id"), req.get("language")
        env = req.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and "\0" not in k for k in env):
            raise BadRequest(422, "env_vars must be an object of names to strings")
        env = {k: "" if v is None else str(v) for k, v in env.items()}
        if cid and language:
            raise BadRequest(400, "Only one of context_id or language can be provided")
        if cid:
            with GLOCK:
                ctx = CONTEXTS.get(cid)
            if ctx is None:
                raise BadRequest(404, "Context %s not found" % cid)
        else:
            ctx = default_context(normalize(language))
        if ctx.language == "bash":
            import re
            bad = [k for k in env if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k)]
            if bad:
                raise BadRequest(422, "env_vars: %r cannot be a shell variable's name" % bad[0])
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def emit(obj):
            data = (json.dumps(obj) + "\n").encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            except OSError:
                raise ClientGone()

        try:
            ctx.execute(code, env, emit, self.gone)
            emit({"type": "end_of_execution"})
            self.wfile.write(b"0\r\n\r\n")
        except (ClientGone, OSError):
            self.close_connection = True


def main():
    port = int(os.environ.get("SBX_INTERP_PORT") or 49999)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:  # the kernel starts while the HTTP server is imported
        ctx = new_context("python")
        DEFAULTS["python"] = ctx.id
    except BadRequest as e:
        log(e.text)
    srv = serve(port)
    log("listening on port %d" % port)
    try:
        srv.serve_forever(poll_interval=0.5)
    finally:
        for c in list(CONTEXTS.values()):
            c.remove()


if __name__ == "__main__":
    main()
