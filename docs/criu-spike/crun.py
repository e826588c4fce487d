#!/usr/bin/python3
"""crun.py [--listen PATH[@NETNS]] [--netns NETNS] [--cgroups DIR,DIR..] -- criu ARGS...
Runs criu with what the node would hand it:
  --listen PATH[@NETNS]: a fresh listening unix socket bound at PATH (made in the network
      namespace NETNS when given), passed to criu as fd 3 (criu args can say --inherit-fd fd[3]:...)
  --netns NETNS: an open network namespace passed as fd 4 (--inherit-fd fd[4]:KEY on restore)
  --cgroups a,b: criu itself joins these cgroup dirs first (for --manage-cgroups=ignore)
Prints the wall time criu took."""
import os, socket, sys, time, ctypes
libc = ctypes.CDLL(None, use_errno=True)
args = sys.argv[1:]
i = args.index("--")
opts, cmd = args[:i], args[i + 1:]
o = dict(zip(opts[::2], opts[1::2]))
if "--cgroups" in o:
    for cg in o["--cgroups"].split(","):
        os.makedirs(cg, exist_ok=True)
        open(cg + "/cgroup.procs", "w").write(str(os.getpid()))
keep = []
if "--listen" in o:
    path, _, ns = o["--listen"].partition("@")
    if ns:
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        f = os.open(ns, os.O_RDONLY); libc.setns(f, 0x40000000); os.close(f)
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(4096)
    if ns:
        libc.setns(own, 0x40000000); os.close(own)
    fd = s.detach()
    if fd != 3:
        os.dup2(fd, 3); os.close(fd)
    keep.append(3)
    print("listener ino", os.fstat(3).st_ino, file=sys.stderr)
if "--netns" in o:
    f = os.open(o["--netns"], os.O_RDONLY)
    if f != 4:
        os.dup2(f, 4); os.close(f)
    keep.append(4)
for k in keep:
    os.set_inheritable(k, True)
t = time.monotonic()
pid = os.fork()
if pid == 0:
    os.execvp(cmd[0], cmd)
_, st = os.waitpid(pid, 0)
print("criu took %.1f ms, exit %d" % ((time.monotonic() - t) * 1000, os.waitstatus_to_exitcode(st)), file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(st))
