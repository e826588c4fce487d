#!/usr/bin/python3
"""mkusernet.py DIR N: what the node's pool would make per slot so that CRIU can dump the
sandbox: a user namespace (0 -> 100000, 65536 ids) and a network namespace OWNED BY IT, kept
by bind mounts at DIR/user and DIR/net; then a veth like the node's (eth0 = 10.99.N.2/32 in
the namespace, gateway 10.99.N.1 on the host side `crNh`) configured by host root.
mkusernet.py -d DIR N removes them."""
import ctypes, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "-d":
    d, n = sys.argv[2], sys.argv[3]
    for f in ("net", "user"):
        libc.umount2(("%s/%s" % (d, f)).encode(), 2)
    subprocess.run(["ip", "link", "del", "cr%sh" % n], stderr=subprocess.DEVNULL)
    sys.exit(0)
d, n = sys.argv[1], sys.argv[2]
os.makedirs(d, exist_ok=True)
r, w = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(0x10000000) == 0
    os.write(w, b"u"); os.read(r2, 1)
    assert libc.unshare(0x40000000) == 0
    os.write(w, b"n"); os.read(r2, 1)
    os._exit(0)
os.read(r, 1)
for f in ("uid_map", "gid_map"):
    open("/proc/%d/%s" % (pid, f), "w").write("0 100000 65536\n")
os.write(w2, b"1"); os.read(r, 1)
for f in ("user", "net"):
    p = "%s/%s" % (d, f)
    open(p, "w").close()
    assert libc.mount(("/proc/%d/ns/%s" % (pid, f)).encode(), p.encode(), None, 4096, None) == 0, ctypes.get_errno()
os.write(w2, b"2"); os.waitpid(pid, 0)
net = d + "/net"
sh = lambda c: subprocess.run(c, shell=True, check=True)
sh("ip link add cr%sh type veth peer name eth0 netns %s" % (n, net))
sh("ip addr add 10.99.%s.1/32 dev cr%sh && ip link set cr%sh up && ip route add 10.99.%s.2/32 dev cr%sh" % (n, n, n, n, n))
ns = "nsenter --net=%s " % net
sh(ns + "ip link set lo up && " + ns + "ip link set eth0 up && " + ns + "ip addr add 10.99.%s.2/32 dev eth0" % n)
sh(ns + "ip route add 10.99.%s.1/32 dev eth0 && " % n + ns + "ip route add default via 10.99.%s.1 dev eth0" % n)
print(d)
