"""The mock agent: PID 1 of a mock sandbox. Serves the node on the listening unix socket it was
given (fd 3): one request a line, JSON {"cmd": "..."} -> runs `sh -c` and answers
{"rc", "out"}; {"bg": "..."} starts a command in the background. Keeps each connection open
(as the node's idle pool does), reaps every child."""
import json, os, selectors, signal, socket, subprocess, sys


def serve(fd):
    # as sbx-agent: not dumpable (no process of the sandbox may ptrace it or open its fds);
    # set after the exec (an exec makes a process dumpable again)
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    lst = socket.socket(fileno=fd)
    lst.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(lst, selectors.EVENT_READ)
    bufs = {}
    signal.signal(signal.SIGCHLD, lambda *a: None)
    while True:
        try:
            while True:
                p, _ = os.waitpid(-1, os.WNOHANG)
                if p == 0:
                    break
        except ChildProcessError:
            pass
        for key, _ in sel.select(timeout=1):
            s = key.fileobj
            if s is lst:
                try:
                    c, _ = lst.accept()
                except BlockingIOError:
                    continue
                sel.register(c, selectors.EVENT_READ)
                bufs[c] = b""
                continue
            data = s.recv(65536)
            if not data:
                sel.unregister(s); s.close(); bufs.pop(s, None)
                continue
            bufs[s] += data
            while b"\n" in bufs[s]:
                line, bufs[s] = bufs[s].split(b"\n", 1)
                req = json.loads(line)
                if "bg" in req:
                    p = subprocess.Popen(["/bin/sh", "-c", req["bg"]], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
                    ans = {"pid": p.pid}
                else:
                    r = subprocess.run(["/bin/sh", "-c", req["cmd"]], capture_output=True, timeout=60)
                    ans = {"rc": r.returncode, "out": r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")}
                s.sendall(json.dumps(ans).encode() + b"\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
