//! Processes: spawning a sandbox's commands (inside the agent), reaping them, signals, pidfds.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A command to start, fully resolved.
#[derive(Debug, Clone)]
pub struct SpawnSpec<'a> {
    /// The file to execute.
    pub program: &'a Path,
    /// All arguments, the first one included.
    pub argv: &'a [String],
    /// The whole environment.
    pub env: &'a [(String, String)],
    pub cwd: &'a Path,
    pub uid: u32,
    pub gid: u32,
    pub groups: &'a [u32],
}

/// A started command: its pid (also its process group) and its ends of the pipes.
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// The command of `spec`, to run as its user; with `on_terminal` it starts a session whose
/// controlling terminal is its stdin (which the caller sets to a PTY's slave).
fn command(spec: &SpawnSpec<'_>, on_terminal: bool) -> Command {
    let mut cmd = Command::new(spec.program);
    if let Some((first, rest)) = spec.argv.split_first() {
        cmd.arg0(first);
        cmd.args(rest);
    }
    cmd.env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(spec.cwd);
    let (uid, gid) = (spec.uid, spec.gid);
    let groups: Vec<libc::gid_t> = spec.groups.to_vec();
    // SAFETY: the closure runs in the child between fork and exec. It only makes the
    // async-signal-safe syscalls setsid, ioctl(TIOCSCTTY) on fd 0 (set up by std before the
    // closure runs), setgroups, setresgid and setresuid, on memory prepared before the fork
    // (`groups` is moved in, not allocated there).
    unsafe {
        cmd.pre_exec(move || {
            if on_terminal {
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::setresgid(gid, gid, gid) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::setresuid(uid, uid, uid) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Starts a command in a process group of its own, with fresh pipes for its stdio.
/// The error is the `exec` failure (ENOENT, EACCES, ...), which the caller maps to 127/126.
pub fn spawn(spec: &SpawnSpec<'_>) -> io::Result<Spawned> {
    let mut cmd = command(spec, false);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn()?;
    let pid = child.id();
    let take = |o: Option<OwnedFd>| o.ok_or_else(|| io::Error::other("missing pipe"));
    let stdin = take(child.stdin.take().map(OwnedFd::from))?;
    let stdout = take(child.stdout.take().map(OwnedFd::from))?;
    let stderr = take(child.stderr.take().map(OwnedFd::from))?;
    // Larger pipes: a command that writes a lot wakes its reader less often. The size is
    // capped by the system (fs.pipe-max-size); a refusal keeps the default.
    for p in [&stdout, &stderr] {
        let _ = nix::fcntl::fcntl(p, nix::fcntl::FcntlArg::F_SETPIPE_SZ(1 << 20));
    }
    // The child is reaped by `reap_any`, not by std: forgetting the handle only drops its
    // (already taken) pipes.
    drop(child);
    Ok(Spawned {
        pid,
        stdin,
        stdout,
        stderr,
    })
}

/// How a reaped process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Exited(i32),
    Signaled(i32),
}

/// A reaped process with its resource usage (and its waited-for children's).
#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    pub pid: u32,
    pub ended: Ended,
    pub cpu: Duration,
    pub max_rss_bytes: u64,
}

/// Reaps one child that has ended, without blocking. `None` when none has.
pub fn reap_any() -> Option<Reaped> {
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 writes only into the two out-pointers, which point to live locals.
    let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut ru) };
    if pid <= 0 {
        return None;
    }
    let ended = if libc::WIFSIGNALED(status) {
        Ended::Signaled(libc::WTERMSIG(status))
    } else {
        Ended::Exited(libc::WEXITSTATUS(status))
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    Some(Reaped {
        pid: pid as u32,
        ended,
        cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
        max_rss_bytes: (ru.ru_maxrss as u64) * 1024,
    })
}

/// Sends `sig` to a process; errors (it is gone) are ignored.
pub fn kill_pid(pid: u32, sig: i32) {
    // SAFETY: kill has no memory effects.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Sends `sig` to a process group; errors (it is gone) are ignored.
pub fn kill_group(pgid: u32, sig: i32) {
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill has no memory effects; a negative pid addresses the group.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), sig);
    }
}

/// Makes this process the reaper of its orphaned descendants (the node reaps its agents).
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer argument and touches no memory.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A pidfd: a handle on a process that a reused pid cannot fool.
#[derive(Debug)]
pub struct PidFd {
    fd: OwnedFd,
    pid: u32,
}

impl PidFd {
    pub fn open(pid: u32) -> io::Result<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the syscall returned a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(PidFd { fd, pid })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends a signal to the process, if it still runs.
    pub fn signal(&self, sig: i32) -> io::Result<()> {
        // SAFETY: pidfd_send_signal with a null siginfo touches no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the process has ended (the pidfd is readable then).
    pub fn has_exited(&self) -> bool {
        self.wait_exit(Duration::ZERO)
    }

    /// Waits up to `timeout` for the process to end; reaps it when it is our child.
    pub fn wait_exit(&self, timeout: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: poll reads and writes the one pollfd we pass, which lives on the stack.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r <= 0 {
            return false;
        }
        // SAFETY: an all-zero siginfo is a valid value of this plain C struct; waitid
        // writes only into it. ECHILD (not our child) is fine: its parent reaps it.
        unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PIDFD,
                self.fd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG,
            );
        }
        true
    }
}

/// The start time of a process (clock ticks since boot), to tell a pid reused from the one
/// recorded.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    after.split_whitespace().nth(19)?.parse().ok()
}

/// A command started on a terminal: its pid (a session leader with the terminal as its
/// controlling one) and the terminal's master side, non-blocking.
#[derive(Debug)]
pub struct SpawnedPty {
    pub pid: u32,
    pub master: OwnedFd,
}

/// Starts a command on a new PTY of `rows` x `cols`.
pub fn spawn_pty(spec: &SpawnSpec<'_>, rows: u16, cols: u16) -> io::Result<SpawnedPty> {
    let size = nix::pty::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(Some(&size), None).map_err(io::Error::from)?;
    let slave = pty.slave;
    let mut cmd = command(spec, true);
    cmd.stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave));
    let child = cmd.spawn()?;
    let pid = child.id();
    drop(child);
    set_nonblocking(&pty.master)?;
    Ok(SpawnedPty {
        pid,
        master: pty.master,
    })
}

/// Makes a descriptor non-blocking (for a reactor).
pub fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(fd, FcntlArg::F_GETFL).map_err(io::Error::from)?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(io::Error::from)?;
    Ok(())
}

/// Sets a terminal's size (its foreground process group gets SIGWINCH).
pub fn set_winsize(master: &OwnedFd, rows: u16, cols: u16) -> io::Result<()> {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads the winsize we pass, which lives on the stack for the call.
    if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads what is there now (non-blocking): `Ok(0)` at the end.
pub fn read_nb(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    nix::unistd::read(fd, buf).map_err(io::Error::from)
}

/// Writes what can be written now (non-blocking).
pub fn write_nb(fd: &OwnedFd, buf: &[u8]) -> io::Result<usize> {
    nix::unistd::write(fd, buf).map_err(io::Error::from)
}

/// Registers a descriptor with the current tokio reactor, for readiness-driven I/O.
pub fn async_fd(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd always answers the same descriptor from as_raw_fd and closes it only
    // when dropped, which happens after the AsyncFd (its owner) has deregistered it.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}
