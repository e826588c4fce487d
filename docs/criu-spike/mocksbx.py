#!/usr/bin/python3
"""A stand-in for an sbx sandbox, laid out the way CRIU can checkpoint it.

sbx today (sbx-runtime init.rs) unshares mount/uts/ipc/pid/cgroup (+net) as HOST root and only
then, in stage 1, a user namespace: every namespace but the user one is owned by the host's
user namespace. CRIU refuses that ("One or more namespaces doesn't belong to the target user
namespace"). This mock makes the user namespace FIRST and the others from inside it (the layout
of rootless podman / docker userns-remap), and otherwise copies sbx's stage 0/1:
  - the sandbox's cgroups (v1: memory, cpu, pids, freezer) joined first
  - the agent's listening unix socket bound at DIR/agent.sock on the host before anything
  - the network namespace joined (--netns PATH: a namespace made by the host, as the node's
    pool does) or a new one with lo only (--nonet)
  - overlay root (lower: the base image; upper/work: DIR/), a tmpfs /dev with null, zero, full,
    random, urandom, tty bound from the host, devpts, /dev/shm, sysfs ro, /proc with masks,
    the CA bundle bound ro over /etc/ssl/certs/ca-certificates.crt
  - pivot_root, capabilities cut to Docker's default set, no_new_privs, seccomp (a small filter)
    and PR_SET_DUMPABLE 0, then the agent (mockagent.py) serves on the inherited listener.
The overlay and the other mounts are made by a HOST-root helper that setns()es into the
sandbox's mount namespace (a process in the new user namespace cannot reach the image layers
under the 0700 /var/lib/sbx/images, and may not bind host device nodes).

usage: mocksbx.py DIR [--netns PATH | --nonet] [--cgroup NAME]   -> prints "pid N"
"""
import ctypes, ctypes.util, os, socket, sys, json, struct

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
UID_BASE, UID_COUNT = 100000, 65536
IMAGE = "/var/lib/sbx/images/base/rootfs"


def check(r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def unshare(flags):
    check(libc.unshare(flags), "unshare %#x" % flags)


def setns(path, nstype=0):
    fd = os.open(path, os.O_RDONLY)
    check(libc.setns(fd, nstype), "setns " + path)
    os.close(fd)


def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None,
                     ctypes.c_ulong(flags), data.encode() if data else None), "mount %s on %s" % (src, dst))


def prctl(op, a=0, b=0, c=0, d=0):
    check(libc.prctl(op, ctypes.c_ulong(a), ctypes.c_ulong(b), ctypes.c_ulong(c), ctypes.c_ulong(d)), "prctl %d" % op)


def cgroup_dirs(name):
    """The sandbox's v1 cgroups, under this process's own cgroup in each hierarchy (as the node's)."""
    own = {}
    for line in open("/proc/self/cgroup"):
        _, ctrls, path = line.strip().split(":", 2)
        for c in ctrls.split(","):
            own[c] = path
    return ["/sys/fs/cgroup/%s%s/sbxmock/%s" % (c, own.get(c, "/").rstrip("/"), name)
            for c in ("memory", "cpu", "pids", "freezer")]


def host_mounts(d, root):
    """Run by a host-root helper inside the sandbox's mount namespace (setns)."""
    mount("overlay", root, "overlay", 0,
          "lowerdir=%s,upperdir=%s/upper,workdir=%s/work" % (IMAGE, d, d))
    dev = root + "/dev"
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "size=65536k,mode=755,uid=%d,gid=%d" % (UID_BASE, UID_BASE))
    for n in ("null", "zero", "full", "random", "urandom", "tty"):
        open(dev + "/" + n, "w").close()
        mount("/dev/" + n, dev + "/" + n, None, MS_BIND)
    for n in ("pts", "shm"):
        os.mkdir(dev + "/" + n)
    mount("devpts", dev + "/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620,gid=%d" % (UID_BASE + 5))
    os.symlink("pts/ptmx", dev + "/ptmx")
    mount("shm", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=65536k,uid=%d,gid=%d" % (UID_BASE, UID_BASE))
    for n, t in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(t, dev + "/" + n)
    os.chown(dev, UID_BASE, UID_BASE)
    mount("sysfs", root + "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    ca = "/etc/ssl/certs/ca-certificates.crt"
    if os.path.isfile(root + ca) and not os.path.islink(root + ca):
        mount(ca, root + ca, None, MS_BIND)
        mount(None, root + ca, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def seccomp_minimal():
    """A small seccomp filter (deny kexec_load, 246, with EPERM; allow the rest), with TSYNC off."""
    # struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; }
    BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
    prog = [(BPF_LD_W_ABS, 0, 0, 0), (BPF_JEQ_K, 0, 1, 246), (BPF_RET_K, 0, 0, 0x00050000 | 1),
            (BPF_RET_K, 0, 0, 0x7fff0000)]
    buf = b"".join(struct.pack("HBBI", *i) for i in prog)
    cbuf = ctypes.create_string_buffer(buf)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fp = Fprog(len(prog), ctypes.cast(cbuf, ctypes.c_void_p))
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fp), 0, 0), "seccomp")


DOCKER_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31}  # chown dac_override fowner fsetid kill setgid setuid setpcap net_bind_service net_raw sys_chroot mknod audit_write setfcap


HOST_EXE = None


def stage1(root, agent_args):
    global HOST_EXE
    os.setsid()  # else criu: "A session leader of N(1) is outside of its pid namespace"
    if "--fexec" in sys.argv:
        # as sbx-agent is today: a binary of the host, outside the sandbox's root (here the host's
        # python3, opened before pivot_root and exec'd through its descriptor)
        HOST_EXE = os.open("/usr/bin/python3", os.O_RDONLY)
    os.chdir(root)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for n in ("kcore", "keys", "timer_list", "sysrq-trigger"):
        p = root + "/proc/" + n
        if os.path.exists(p):
            mount("/dev/null", p, None, MS_BIND)
    check(libc.syscall(155, b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "umount the old root")
    os.chdir("/")
    for c in range(0, 41):
        if c not in DOCKER_CAPS:
            try:
                prctl(24, c)  # PR_CAPBSET_DROP
            except OSError:
                pass
    prctl(38, 1)  # PR_SET_NO_NEW_PRIVS
    seccomp_minimal()
    prctl(4, 0)  # PR_SET_DUMPABLE 0


def main():
    d = os.path.abspath(sys.argv[1])
    args = sys.argv[2:]
    netns = args[args.index("--netns") + 1] if "--netns" in args else None
    userns = args[args.index("--userns") + 1] if "--userns" in args else None
    cgname = args[args.index("--cgroup") + 1] if "--cgroup" in args else os.path.basename(d)
    exec_agent = "--host-agent" not in args
    root = d + "/rootfs"
    for sub in ("upper", "work", "rootfs"):
        os.makedirs(d + "/" + sub, exist_ok=True)
    os.chown(d + "/upper", UID_BASE, UID_BASE)
    for cg in cgroup_dirs(cgname):
        os.makedirs(cg, exist_ok=True)
        open(cg + "/cgroup.procs", "w").write(str(os.getpid()))
    sock = d + "/agent.sock"
    if os.path.exists(sock):
        os.unlink(sock)
    sp_parent, sp_child = socket.socketpair()
    if netns and not userns:
        setns(netns, CLONE_NEWNET)
    r1, w1 = os.pipe()   # child -> parent
    r2, w2 = os.pipe()   # parent -> child
    pid = os.fork()
    if pid == 0:
        os.close(r1); os.close(w2)
        if userns:
            # the pool's user namespace, which owns the pool's network namespace
            setns(userns, CLONE_NEWUSER)
            setns(netns, CLONE_NEWNET)
            os.write(w1, b"u"); os.read(r2, 1)
        else:
            unshare(CLONE_NEWUSER)
            os.write(w1, b"u"); os.read(r2, 1)            # maps written
        os.setresgid(0, 0, 0); os.setresuid(0, 0, 0)
        flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWCGROUP
        if not netns:
            flags |= CLONE_NEWNET
        unshare(flags)
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        socket.sethostname(os.path.basename(d))
        os.system("ip link set lo up 2>/dev/null")  # host binary; the sandbox's own netns
        unshare(CLONE_NEWPID)  # after the last helper process: its first child is PID 1
        os.write(w1, b"m"); os.read(r2, 1)            # host mounts done
        _, fds, _, _ = socket.recv_fds(sp_child, 1, 1)  # the listener, made in this netns by the host
        lst = socket.socket(fileno=fds[0])
        sp_child.close(); sp_parent.close()
        g = os.fork()
        if g == 0:
            stage1(root, None)
            os.write(w1, b"R")
            fd = lst.detach()
            os.set_inheritable(fd, True)
            os.dup2(fd, 3)
            if fd != 3:
                os.close(fd)
            nul = os.open("/dev/null", os.O_RDWR)
            for i in (0, 1, 2):
                os.dup2(nul, i)
            for i in (r2, w1, nul):
                os.close(i)
            if HOST_EXE is not None:
                os.dup2(HOST_EXE, 5)
                os.closerange(6, 4096); os.closerange(4, 5)
                os.execve(5, ["sbx-agent", "/.sbx/mockagent.py", "3"], {})
            os.closerange(4, 4096)  # nothing the node's parent left open (criu: external pipes)
            if exec_agent:
                # the agent's program inside the image (the rootfs's python3, the script in /)
                exe = "/.sbxbin/python3" if "--binexe" in sys.argv else "/usr/bin/python3"
                os.execv(exe, ["sbx-agent", "/.sbx/mockagent.py", "3"])
            sys.path.insert(0, "/.sbx")
            import mockagent
            mockagent.serve(3)
            os._exit(0)
        os.write(w1, b"g" + str(g).encode())
        os._exit(0)
    os.close(w1); os.close(r2)
    assert os.read(r1, 1) == b"u"
    for f, m in () if userns else (("uid_map", "0 %d %d\n" % (UID_BASE, UID_COUNT)), ("gid_map", "0 %d %d\n" % (UID_BASE, UID_COUNT))):
        with open("/proc/%d/%s" % (pid, f), "w") as fh:
            fh.write(m)
    os.write(w2, b"1")
    assert os.read(r1, 1) == b"m"
    h = os.fork()
    if h == 0:
        try:
            # The agent's listening socket: made in the sandbox's network namespace (criu finds
            # only the sockets of the namespaces it dumps), bound at the host path by host root.
            setns("/proc/%d/ns/net" % pid, CLONE_NEWNET)
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # --abstract: "@sbx-agent" in the sandbox's own network namespace (criu restores it
            # as it is; the node connects from a thread setns()ed into that namespace)
            lst.bind("\0sbx-agent" if "--abstract" in args else sock)
            lst.listen(4096)
            socket.send_fds(sp_parent, [b"l"], [lst.fileno()])
            setns("/proc/%d/ns/mnt" % pid, CLONE_NEWNS)
            host_mounts(d, root)
            # the agent script, placed where the sandbox sees it (a ro bind of the host file)
            os.makedirs(root + "/.sbx", exist_ok=True)
            here = os.path.dirname(os.path.abspath(__file__))
            mount(here, root + "/.sbx", None, MS_BIND)
            if "--binexe" in args:
                # the agent's binary from a host directory bound read-only into the sandbox
                os.makedirs(root + "/.sbxbin", exist_ok=True)
                mount("/tmp/criu-bin-py", root + "/.sbxbin", None, MS_BIND)
                mount(None, root + "/.sbxbin", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            mount(None, root + "/.sbx", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os._exit(0)
        except Exception as e:
            print("host mounts:", e, file=sys.stderr)
            os._exit(1)
    _, st = os.waitpid(h, 0)
    if st != 0:
        os.kill(pid, 9)
        sys.exit(1)
    os.write(w2, b"2")
    msg = b""
    while not msg.endswith(b"R") and len(msg) < 64:
        b = os.read(r1, 64)
        if not b:
            break
        msg += b
    os.waitpid(pid, 0)
    g = int(msg[1:].rstrip(b"R").decode())
    print("pid", g)


if __name__ == "__main__":
    main()
