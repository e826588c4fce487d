#!/usr/bin/python3
"""mockctl.py SOCK 'command'  |  mockctl.py SOCK --bg 'command'"""
import ctypes, json, os, socket, sys
# SOCK may be net:PID to reach "@sbx-agent" in the network namespace of PID (the agent)
if sys.argv[1].startswith("net:"):
    fd = os.open("/proc/%s/ns/net" % sys.argv[1][4:], os.O_RDONLY)
    assert ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) == 0
    sys.argv[1] = "\0sbx-agent"
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
req = {"bg": sys.argv[3]} if sys.argv[2] == "--bg" else {"cmd": sys.argv[2]}
s.sendall(json.dumps(req).encode() + b"\n")
buf = b""
while not buf.endswith(b"\n"):
    b = s.recv(65536)
    if not b: break
    buf += b
r = json.loads(buf)
print(r.get("out", r).rstrip() if "out" in r else r)
