"""Holds what sbx-agent holds (and more), to see criu dump/restore them: a pidfd of a child,
a pipe to that child, an inotify watch, an flock, an eventfd, an epoll set, a socketpair, a
memfd, a deleted-but-open file. Prints a check of each on SIGUSR1 into /tmp/features.txt."""
import ctypes, fcntl, os, select, signal, socket, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
child = subprocess.Popen(["sleep", "100000"], stdin=subprocess.PIPE)
pidfd = os.pidfd_open(child.pid)
ino = libc.inotify_init1(os.O_NONBLOCK)
os.makedirs("/tmp/watched", exist_ok=True)
wd = libc.inotify_add_watch(ino, b"/tmp/watched", 0x100 | 0x200)  # IN_CREATE | IN_DELETE
lockf = open("/tmp/lockfile", "w"); fcntl.flock(lockf, fcntl.LOCK_EX)
efd = os.eventfd(0)
ep = select.epoll(); ep.register(efd, select.EPOLLIN); ep.register(pidfd, select.EPOLLIN)
a, b = socket.socketpair()
mfd = os.memfd_create("sbx-test"); os.write(mfd, b"memfd-content")
dl = open("/tmp/deleted", "w+"); dl.write("deleted-but-open"); dl.flush(); os.unlink("/tmp/deleted")
def report(*_):
    out = []
    out.append("pidfd poll (child alive -> no event): %s" % (select.select([pidfd], [], [], 0)[0] == []))
    open("/tmp/watched/new", "w").close(); time.sleep(0.05)
    try: out.append("inotify event: %d bytes" % len(os.read(ino, 4096)))
    except BlockingIOError: out.append("inotify: NO EVENT")
    out.append("flock held: %s" % (subprocess.run(["flock", "-n", "/tmp/lockfile", "true"]).returncode != 0))
    os.eventfd_write(efd, 1); out.append("epoll sees eventfd: %s" % bool(ep.poll(0))); os.eventfd_read(efd)
    a.send(b"ping"); out.append("socketpair: %s" % b.recv(10))
    os.lseek(mfd, 0, 0); out.append("memfd: %s" % os.read(mfd, 100))
    dl.seek(0); out.append("deleted file: %s" % dl.read())
    child.stdin.write(b"x"); child.stdin.flush(); out.append("pipe to child: ok")
    open("/tmp/features.txt", "w").write("\n".join(out) + "\n")
    os.unlink("/tmp/watched/new")
signal.signal(signal.SIGUSR1, report)
while True:
    time.sleep(1)
