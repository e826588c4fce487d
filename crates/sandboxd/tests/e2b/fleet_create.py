"""E2B's Python SDK against a fleet's control plane (its --e2b-listen), unchanged: creates a
sandbox, runs a command, writes a file, starts a web server in it (port 8000, serving
/home/user) and a WebSocket echo server (port 8001), and leaves it running. Run by
crates/sandboxd/tests/fleet/e2b.rs, which then moves the sandbox to the other node and runs
fleet_connect.py. Prints `sandbox: ID`, a line per check, and exits non-zero at the first that
fails."""

import sys
import time

from e2b import Sandbox


def check(what, cond, detail=""):
    if not cond:
        print(f"FAILED: {what} {detail}", flush=True)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


s = Sandbox.create(metadata={"suite": "fleet"}, timeout=900)
check("create answers a sandbox id", s.sandbox_id.startswith("sbx-"), s.sandbox_id)
print(f"sandbox: {s.sandbox_id}", flush=True)
r = s.commands.run("echo hi from $(hostname)")
check("run: stdout", r.stdout.startswith("hi from") and r.exit_code == 0, repr(r))
s.files.write("/home/user/fleet.txt", "written before the move")
check("write, read", s.files.read("/home/user/fleet.txt") == "written before the move")
got = []
h = s.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", background=True)
h.wait(on_stdout=lambda line: got.append(line))
check("output streams as it comes", "".join(got) == "1\n2\n3\n", repr(got))
s.commands.run(
    "nohup python3 -m http.server 8000 --directory /home/user >/dev/null 2>&1 &"
)
deadline = time.time() + 30
while True:
    r = s.commands.run(
        "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/fleet.txt').read().decode())\" 2>/dev/null || true"
    )
    if "written before the move" in r.stdout or time.time() > deadline:
        break
    time.sleep(0.3)
check("the web server serves in the sandbox", "written before the move" in r.stdout, repr(r.stdout))
# A WebSocket echo server on port 8001 (the standard library only): the handshake, then each
# text frame the client sends (masked) comes back unmasked.
WS = r"""
import base64, hashlib, socket, threading
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        d = c.recv(4096)
        if not d:
            return
        head += d
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    def read(n):
        b = b""
        while len(b) < n:
            d = c.recv(n - len(b))
            if not d:
                raise EOFError
            b += d
        return b
    try:
        while True:
            b0, b1 = read(2)
            n = b1 & 127
            mask = read(4)
            data = bytes(x ^ mask[i % 4] for i, x in enumerate(read(n)))
            if b0 & 15 == 8:
                c.sendall(bytes([0x88, 0]))
                return
            c.sendall(bytes([0x81, len(data)]) + data)
    except EOFError:
        return
    finally:
        c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8001))
s.listen(8)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
s.files.write("/home/user/ws.py", WS)
s.commands.run("nohup python3 /home/user/ws.py >/dev/null 2>&1 &")
deadline = time.time() + 30
while True:
    r = s.commands.run("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8001)).close(); print('up')\" 2>/dev/null || true")
    if "up" in r.stdout or time.time() > deadline:
        break
    time.sleep(0.3)
check("the WebSocket server listens in the sandbox", "up" in r.stdout, repr(r.stdout))
listed = Sandbox.list().next_items()
check("list through the control plane has it", s.sandbox_id in [i.sandbox_id for i in listed])
print("all passed", flush=True)
