//! Processes: spawning a sandbox's commands (inside the agent), reaping them, signals, pidfds.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
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
    /// Stdin is /dev/null instead of a pipe (a command given no input).
    pub stdin_null: bool,
    /// Resource limits the child sets (`prlimit`) before it executes: the sandbox's runtime
    /// ulimits ([`crate::rtset`]).
    pub rlimits: &'a [crate::rtset::Rlimit],
}

/// A started command: its pid (also its process group) and its ends of the pipes.
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    /// `None` when its stdin is /dev/null.
    pub stdin: Option<OwnedFd>,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// What the child of [`spawn_child`] needs, prepared before the clone: the child only reads it
/// and makes syscalls (no allocation, no lock, no libc wrapper that keeps process-wide state).
struct ChildPlan {
    program: CString,
    /// `argv` and `envp`: null-terminated arrays of pointers into `_strings`.
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    _strings: Vec<CString>,
    cwd: CString,
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    /// `prlimit` before the exec: (resource, limits).
    rlimits: Vec<(libc::c_int, libc::rlimit64)>,
    /// Descriptors that become the child's 0, 1 and 2 (all above 2).
    stdio: [RawFd; 3],
    /// A session of its own with stdin as its controlling terminal; else a process group of
    /// its own.
    on_terminal: bool,
    /// The signals the child must reset to their default action (bit `n - 1` for signal `n`):
    /// those this process catches, and SIGPIPE when ignored. `None`: not known, the child asks.
    to_reset: Option<u64>,
    /// The errno of the step that failed in the child (0: it executed the program). Written by
    /// the child, read by the parent after the child has executed or exited.
    err: AtomicI32,
}

fn cstring(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"))
}

impl ChildPlan {
    fn new(spec: &SpawnSpec<'_>, stdio: [RawFd; 3], on_terminal: bool) -> io::Result<ChildPlan> {
        let mut strings = Vec::with_capacity(spec.argv.len() + spec.env.len());
        for a in spec.argv {
            strings.push(cstring(a.as_bytes())?);
        }
        let argc = strings.len();
        for (k, v) in spec.env {
            strings.push(cstring(format!("{k}={v}").as_bytes())?);
        }
        // The CStrings' buffers do not move when the Vec holding them does.
        let ptrs = |s: &[CString]| -> Vec<*const libc::c_char> {
            s.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        Ok(ChildPlan {
            program: cstring(spec.program.as_os_str().as_bytes())?,
            argv: ptrs(&strings[..argc]),
            envp: ptrs(&strings[argc..]),
            _strings: strings,
            cwd: cstring(spec.cwd.as_os_str().as_bytes())?,
            uid: spec.uid,
            gid: spec.gid,
            groups: spec.groups.to_vec(),
            rlimits: spec.rlimits.iter().map(crate::rtset::Rlimit::raw).collect(),
            stdio,
            on_terminal,
            to_reset: signals_to_reset(),
            err: AtomicI32::new(0),
        })
    }
}

/// The signals a child of this process must reset before it executes (see
/// [`ChildPlan::to_reset`]), from the kernel's own account of this process's handlers: one read
/// of /proc/self/stat (kept open per thread) instead of a query per signal in every child.
fn signals_to_reset() -> Option<u64> {
    use std::os::unix::fs::FileExt;
    thread_local! {
        static STAT: Option<fs::File> = fs::File::open("/proc/self/stat").ok();
    }
    let mut buf = [0u8; 2048];
    let len = STAT.with(|f| f.as_ref()?.read_at(&mut buf, 0).ok())?;
    let (caught, ignored) = signal_masks_of_stat(buf.get(..len)?)?;
    let pipe = 1u64 << (libc::SIGPIPE - 1);
    Some(caught | (ignored & pipe))
}

/// The caught and the ignored signals of a /proc/PID/stat line (fields 34 and 33, counted
/// from the one after the command name, which may hold spaces and parentheses).
fn signal_masks_of_stat(stat: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(stat).ok()?;
    let after_name = &text[text.rfind(')')? + 1..];
    // Field 3 (the state) is the first after the name.
    let mut fields = after_name.split_ascii_whitespace();
    let ignored = fields.nth(33 - 3)?.parse().ok()?;
    let caught = fields.next()?.parse().ok()?;
    Some((caught, ignored))
}

/// The child of [`spawn_child`], on its own stack in the parent's memory (CLONE_VM) while the
/// parent waits (CLONE_VFORK). Only raw syscalls: glibc's setuid family would act on the
/// parent's threads (it shares their memory), and nothing here may allocate or lock.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildPlan` that `spawn_child` passed to clone; the parent keeps it
    // alive and does not touch it until this child has executed or exited.
    let plan = unsafe { &*(arg as *const ChildPlan) };
    let fail = |plan: &ChildPlan| -> libc::c_int {
        let e = io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL);
        plan.err.store(e.max(1), Ordering::SeqCst);
        // SAFETY: _exit ends this process at once, without running anything of the parent's
        // (no atexit handlers, no stdio flushing).
        unsafe { libc::_exit(127) }
    };
    // SAFETY: every call below is a raw syscall (or libc's thin async-signal-safe wrapper of
    // one) on memory the plan owns or on locals of this stack: sigaction and sigprocmask with
    // valid pointers, dup2/fcntl on descriptors the parent opened for the child, chdir and
    // execve on the plan's NUL-terminated strings and null-terminated pointer arrays,
    // setsid/setpgid/ioctl(TIOCSCTTY) on this process, setgroups/setresgid/setresuid through
    // syscall(2) so that they change this process only.
    unsafe {
        // Handlers of the parent must not run here (they would run on the parent's memory):
        // every caught signal goes back to its default; SIGPIPE too (Rust ignores it). Ignored
        // ones stay ignored, as with fork and exec. The mask the parent set (all blocked) is
        // cleared last, just before the exec. When the parent could tell which signals it
        // catches, only those are reset; else each one is asked.
        for sig in 1..=libc::SIGRTMAX().min(64) {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            let reset = match plan.to_reset {
                Some(set) => set & (1u64 << (sig - 1)) != 0,
                None => {
                    let mut old: libc::sigaction = std::mem::zeroed();
                    libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                        && old.sa_sigaction != libc::SIG_DFL
                        && (old.sa_sigaction != libc::SIG_IGN || sig == libc::SIGPIPE)
                }
            };
            if reset {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        for (fd, target) in plan.stdio.iter().zip(0..) {
            if libc::dup2(*fd, target) < 0 {
                return fail(plan);
            }
        }
        if libc::chdir(plan.cwd.as_ptr()) != 0 {
            return fail(plan);
        }
        if plan.on_terminal {
            if libc::setsid() < 0 {
                return fail(plan);
            }
            if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return fail(plan);
            }
        } else if libc::setpgid(0, 0) != 0 {
            return fail(plan);
        }
        for (resource, limit) in &plan.rlimits {
            let set = libc::syscall(
                libc::SYS_prlimit64,
                0,
                *resource,
                limit as *const libc::rlimit64,
                std::ptr::null_mut::<libc::rlimit64>(),
            );
            if set != 0 {
                return fail(plan);
            }
        }
        if libc::syscall(libc::SYS_setgroups, plan.groups.len(), plan.groups.as_ptr()) != 0 {
            return fail(plan);
        }
        if libc::syscall(libc::SYS_setresgid, plan.gid, plan.gid, plan.gid) != 0 {
            return fail(plan);
        }
        if libc::syscall(libc::SYS_setresuid, plan.uid, plan.uid, plan.uid) != 0 {
            return fail(plan);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(
            plan.program.as_ptr(),
            plan.argv.as_ptr(),
            plan.envp.as_ptr(),
        );
        fail(plan)
    }
}

/// The child's stack: its frames are small (no allocation, a few locals).
const CHILD_STACK: usize = 64 << 10;

/// Starts `plan`'s program in a child made with clone(CLONE_VM | CLONE_VFORK): no copy of the
/// parent's memory (as posix_spawn does), and this call returns once the child has executed
/// the program, or with the error of the step that failed.
fn spawn_child(plan: &ChildPlan) -> io::Result<u32> {
    thread_local! {
        /// The children's stack, made once per thread: a spawn borrows it while its child runs
        /// on it (CLONE_VFORK: until the child executes or exits), so no spawn pays for
        /// mapping and zeroing a fresh one.
        static STACK: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; CHILD_STACK]);
    }
    STACK.with_borrow_mut(|stack| spawn_child_on(plan, stack))
}

fn spawn_child_on(plan: &ChildPlan, stack: &mut [u8]) -> io::Result<u32> {
    // The top of the stack (it grows down), 16-byte aligned.
    let top = {
        let end = stack.as_mut_ptr_range().end as usize;
        (end & !15) as *mut libc::c_void
    };
    // SAFETY: an all-zero sigset_t is a valid value of this plain C struct; sigfillset and
    // pthread_sigmask only write into the sets we pass. Blocking every signal around the clone
    // keeps this process's handlers from running in the child before it resets them.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
    }
    // SAFETY: child_main only reads `plan` and makes raw syscalls (see it) on its own stack,
    // `stack`, which outlives the child's use of it: with CLONE_VFORK this thread is suspended
    // until the child has executed a program (its memory is then its own) or exited.
    let pid = unsafe {
        libc::clone(
            child_main,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            plan as *const ChildPlan as *mut libc::c_void,
        )
    };
    let clone_err = io::Error::last_os_error();
    // SAFETY: restores the mask saved above; pthread_sigmask only reads it.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
    if pid < 0 {
        return Err(clone_err);
    }
    let err = plan.err.load(Ordering::SeqCst);
    if err != 0 {
        // The child has exited: reap it here, so that no one waits for it.
        let mut status = 0;
        // SAFETY: waitpid writes only into `status`, a live local.
        unsafe {
            libc::waitpid(pid, &mut status, 0);
        }
        return Err(io::Error::from_raw_os_error(err));
    }
    Ok(pid as u32)
}

/// A descriptor above 2 (the child's stdio slots), close-on-exec.
fn above_stdio(fd: OwnedFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    use nix::fcntl::{fcntl, FcntlArg};
    let raw = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(3)).map_err(io::Error::from)?;
    // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// A pipe, both ends close-on-exec and above 2: `(read end, write end)`.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    Ok((above_stdio(r)?, above_stdio(w)?))
}

/// /dev/null, opened once per thread (close-on-exec, above 2; children get it by dup2).
fn dev_null() -> io::Result<RawFd> {
    thread_local! {
        static DEV_NULL: std::cell::OnceCell<OwnedFd> = const { std::cell::OnceCell::new() };
    }
    DEV_NULL.with(|n| {
        if let Some(fd) = n.get() {
            return Ok(fd.as_raw_fd());
        }
        let fd = above_stdio(OwnedFd::from(fs::File::open("/dev/null")?))?;
        Ok(n.get_or_init(|| fd).as_raw_fd())
    })
}

/// Starts a command in a process group of its own, with fresh pipes for its stdio.
/// The error is the `exec` failure (ENOENT, EACCES, ...), which the caller maps to 127/126.
pub fn spawn(spec: &SpawnSpec<'_>) -> io::Result<Spawned> {
    // A command given no input reads /dev/null; else its stdin is a pipe.
    let (stdin_r, stdin, stdin_raw) = if spec.stdin_null {
        (None, None, dev_null()?)
    } else {
        let (r, w) = pipe()?;
        let raw = r.as_raw_fd();
        (Some(r), Some(w), raw)
    };
    let (stdout, stdout_w) = pipe()?;
    let (stderr, stderr_w) = pipe()?;
    let plan = ChildPlan::new(
        spec,
        [stdin_raw, stdout_w.as_raw_fd(), stderr_w.as_raw_fd()],
        false,
    )?;
    let pid = spawn_child(&plan)?;
    // The child's ends are closed here: the command holds its own copies.
    drop((stdin_r, stdout_w, stderr_w));
    // The child is reaped by `reap_any`.
    Ok(Spawned {
        pid,
        stdin,
        stdout,
        stderr,
    })
}

/// Makes a pipe hold 1 MiB: a command that writes a lot wakes its reader less often. Done by
/// the reader once a command turns out to write that much (a short command pays nothing). The
/// size is capped by the system (fs.pipe-max-size); a refusal keeps the default.
pub fn grow_pipe(fd: &impl AsFd) {
    let _ = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETPIPE_SZ(1 << 20));
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

/// The process that traces `pid` (ptrace), if one does (and `pid` still exists).
pub fn tracer_of(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|t| t.trim().parse().ok())
        .filter(|t| *t != 0)
}

/// Whether a thread of process `pid` waits in a vfork for its child to execute or exit (the
/// kernel's wait channel `kernel_clone`, where that wait is; `wait_for_vfork_done` on kernels
/// that do not inline it).
pub fn in_vfork(pid: u32) -> bool {
    let Ok(threads) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    threads.flatten().any(|t| {
        fs::read_to_string(t.path().join("wchan"))
            .is_ok_and(|w| w.trim() == "kernel_clone" || w.contains("vfork"))
    })
}

/// A process's command name (`/proc/PID/comm`), if it exists.
pub fn comm_of(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end().to_string())
}

/// Sends `sig` to a process; errors (it is gone) are ignored.
pub fn kill_pid(pid: u32, sig: i32) {
    // SAFETY: kill has no memory effects.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// CLOCK_BOOTTIME in milliseconds: monotonic, counting a suspend, the same inside a sandbox
/// and on its host (sandboxes have no time namespace). A node's lease is told to its sandboxes'
/// agents in it.
pub fn boottime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives across the call.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if r != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1000)
        .saturating_add(ts.tv_nsec as u64 / 1_000_000)
}

/// Sends `sig` to every process this one may signal but itself: `kill(-1, sig)`. Only PID 1 of
/// a sandbox calls it (its PID namespace bounds what -1 reaches); anywhere else it would
/// signal the host's processes, so it refuses unless this process is PID 1.
pub fn signal_all_others(sig: i32) -> io::Result<()> {
    if std::process::id() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "only PID 1 of a sandbox signals every process of it",
        ));
    }
    // SAFETY: kill has no memory effects; -1 addresses every process of this PID namespace
    // the caller may signal, but the caller.
    let r = unsafe { libc::kill(-1, sig) };
    if r == 0 {
        Ok(())
    } else {
        let e = io::Error::last_os_error();
        // ESRCH: no other process.
        if e.raw_os_error() == Some(libc::ESRCH) {
            Ok(())
        } else {
            Err(e)
        }
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

/// This process's limit on open files (the soft one, which `open`, `accept` and `socket`
/// meet); `None` when there is none.
pub fn nofile_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) if soft != RLIM_INFINITY => Some(soft),
        _ => None,
    }
}

/// Raises this process's soft limit on open files to its hard limit (each sandbox costs the
/// node descriptors: its agent's pidfd, connections, watches). Returns the limit in force
/// after: (soft, hard); `u64::MAX` stands for none.
pub fn raise_nofile_limit() -> io::Result<(u64, u64)> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(io::Error::from)?;
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(io::Error::from)?;
    Ok((soft, hard))
}

/// A kernel setting of /proc/sys (e.g. `kernel/pid_max`) read as a number.
pub fn sysctl_u64(name: &str) -> Option<u64> {
    std::fs::read_to_string(Path::new("/proc/sys").join(name))
        .ok()?
        .trim()
        .parse()
        .ok()
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

    /// Another descriptor of the same process handle (for work on another thread).
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
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
    // openpty's descriptors are not close-on-exec: these must not leak into other commands.
    for fd in [&pty.master, &pty.slave] {
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .map_err(io::Error::from)?;
    }
    let slave = above_stdio(pty.slave)?;
    let fd = slave.as_raw_fd();
    let plan = ChildPlan::new(spec, [fd, fd, fd], true)?;
    let pid = spawn_child(&plan)?;
    drop(slave);
    set_nonblocking(&pty.master)?;
    Ok(SpawnedPty {
        pid,
        master: pty.master,
    })
}

/// Whether a descriptor has something to read (data or its end) right now, without waiting.
pub fn readable_now(fd: &impl AsRawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd we pass, which lives on the stack.
    let r = unsafe { libc::poll(&mut pfd, 1, 0) };
    r != 0
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn wait(pid: u32) -> i32 {
        let mut status = 0;
        // SAFETY: waitpid writes only into `status`, a live local.
        unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
        status
    }

    fn spec<'a>(
        program: &'a Path,
        argv: &'a [String],
        env: &'a [(String, String)],
        cwd: &'a Path,
        uid: u32,
    ) -> SpawnSpec<'a> {
        SpawnSpec {
            program,
            argv,
            env,
            cwd,
            uid,
            gid: uid,
            groups: &[],
            stdin_null: false,
            rlimits: &[],
        }
    }

    #[test]
    fn a_command_gets_its_limits_and_the_spawner_keeps_its_own() {
        use crate::rtset::{Resource, Rlimit};
        let argv = [
            "sh".to_string(),
            "-c".into(),
            "ulimit -Sn; ulimit -Hn; ulimit -Sc".into(),
        ];
        let env = [("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let limits = [
            Rlimit {
                resource: Resource::Nofile,
                soft: Some(77),
                hard: Some(99),
            },
            Rlimit {
                resource: Resource::Core,
                soft: Some(0),
                hard: Some(0),
            },
        ];
        let before = nofile_limit();
        // SAFETY: getuid and getgid have no memory effects.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let s = SpawnSpec {
            stdin_null: true,
            gid,
            rlimits: &limits,
            ..spec(Path::new("/bin/sh"), &argv, &env, Path::new("/"), uid)
        };
        let mut child = spawn(&s).unwrap();
        let mut out = String::new();
        fs::File::from(std::mem::replace(&mut child.stdout, pipe().unwrap().0))
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(wait(child.pid), 0);
        assert_eq!(out, "77\n99\n0\n");
        assert_eq!(
            nofile_limit(),
            before,
            "the spawner's own limit is unchanged"
        );
    }

    #[test]
    fn the_signals_to_reset_are_the_caught_ones_and_an_ignored_sigpipe() {
        // A name with spaces and a parenthesis must not shift the fields.
        let line = b"42 (a b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 9 1000 100 18446744073709551615 1 1 0 0 0 0 0 4096 16386 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
        assert_eq!(signal_masks_of_stat(line), Some((16386, 4096)));
        assert_eq!(signal_masks_of_stat(b"garbage"), None);
        // This process: Rust's runtime ignores SIGPIPE, so it is reset in children.
        let set = signals_to_reset().expect("this process's handlers");
        assert_ne!(set & (1 << (libc::SIGPIPE - 1)), 0, "{set:#x}");
        // And a child sees it at its default: a writer to a closed pipe dies of it.
        let argv = ["cat".to_string(), "/proc/self/status".into()];
        // SAFETY: getuid and getgid have no memory effects.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let s = SpawnSpec {
            stdin_null: true,
            gid,
            ..spec(Path::new("/bin/cat"), &argv, &[], Path::new("/"), uid)
        };
        let mut child = spawn(&s).unwrap();
        let mut out = String::new();
        fs::File::from(std::mem::replace(&mut child.stdout, pipe().unwrap().0))
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(wait(child.pid), 0);
        let ignored = out
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .expect("SigIgn in the child's status");
        assert_eq!(
            ignored & (1 << (libc::SIGPIPE - 1)),
            0,
            "SIGPIPE ignored: {ignored:#x}"
        );
    }

    #[test]
    fn a_command_given_no_stdin_reads_dev_null() {
        let argv = [
            "sh".to_string(),
            "-c".into(),
            "cat; readlink /proc/self/fd/0; echo done".into(),
        ];
        let env = [("PATH".to_string(), "/usr/bin:/bin".to_string())];
        // SAFETY: getuid has no memory effects.
        let me = unsafe { libc::getuid() };
        let s = SpawnSpec {
            stdin_null: true,
            // SAFETY: getgid has no memory effects.
            gid: unsafe { libc::getgid() },
            ..spec(Path::new("/bin/sh"), &argv, &env, Path::new("/"), me)
        };
        let mut child = spawn(&s).unwrap();
        assert!(child.stdin.is_none(), "no pipe to write to");
        let mut out = String::new();
        fs::File::from(std::mem::replace(&mut child.stdout, pipe().unwrap().0))
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(wait(child.pid), 0);
        assert_eq!(out, "/dev/null\ndone\n");
    }

    #[test]
    fn a_command_gets_its_arguments_environment_directory_user_and_group() {
        // SAFETY: geteuid has no memory effects.
        let root = unsafe { libc::geteuid() } == 0;
        let uid = if root { 65534 } else { 0 };
        let argv = [
            "sh".to_string(),
            "-c".into(),
            r#"echo "$0 $X $(pwd) $(id -u) $(ps -o pgid= -p $$ | tr -d ' ')=$$""#.into(),
        ];
        let env = [
            ("X".to_string(), "x y".to_string()),
            ("PATH".into(), "/usr/bin:/bin".into()),
        ];
        let s = spec(Path::new("/bin/sh"), &argv, &env, Path::new("/tmp"), uid);
        let s = if root {
            s
        } else {
            // Without root the user cannot change: run as who we are.
            SpawnSpec {
                // SAFETY: getuid and getgid have no memory effects.
                uid: unsafe { libc::getuid() },
                // SAFETY: as above.
                gid: unsafe { libc::getgid() },
                ..s
            }
        };
        let mut child = spawn(&s).unwrap();
        drop(child.stdin);
        let mut out = String::new();
        fs::File::from(std::mem::replace(&mut child.stdout, pipe().unwrap().0))
            .read_to_string(&mut out)
            .unwrap();
        assert_eq!(wait(child.pid), 0);
        let pid = child.pid;
        let want_uid = if root {
            "65534".to_string()
        } else {
            s.uid.to_string()
        };
        assert_eq!(out, format!("sh x y /tmp {want_uid} {pid}={pid}\n"));
    }

    #[test]
    fn exec_failures_are_errors_of_the_spawn() {
        let argv = ["x".to_string()];
        // SAFETY: getuid and getgid have no memory effects.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let mut s = spec(Path::new("/nonexistent/x"), &argv, &[], Path::new("/"), uid);
        s.gid = gid;
        assert_eq!(spawn(&s).unwrap_err().kind(), io::ErrorKind::NotFound);
        s.program = Path::new("/tmp");
        assert_eq!(spawn(&s).unwrap_err().raw_os_error(), Some(libc::EACCES));
        s.program = Path::new("/bin/true");
        s.cwd = Path::new("/nonexistent");
        assert_eq!(spawn(&s).unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}

/// Makes the calling process dumpable (`PR_SET_DUMPABLE`) or not. The agent is not dumpable
/// while a sandbox is awake: a process of the sandbox (which has no CAP_SYS_PTRACE) can then
/// neither ptrace it nor read its memory or descriptors in /proc. A checkpoint needs it
/// dumpable (CRIU opens its namespace files from inside the sandbox's user namespace).
pub fn set_dumpable(on: bool) -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes integer arguments and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, on as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the calling process is dumpable.
pub fn is_dumpable() -> bool {
    // SAFETY: PR_GET_DUMPABLE takes no argument and touches no memory.
    unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) == 1 }
}

/// Moves `fd` to descriptor `to`, without close-on-exec (it is meant for an exec): `to` is
/// then open and owned by no value of this process.
pub fn move_to_inheritable(fd: OwnedFd, to: RawFd) -> io::Result<()> {
    use std::os::fd::IntoRawFd;
    let raw = fd.into_raw_fd();
    if raw != to {
        // SAFETY: dup2 onto `to`, which the caller gives up (it is about to exec); `raw` is
        // ours (taken from the OwnedFd) and closed right after.
        let r = unsafe { libc::dup2(raw, to) };
        // SAFETY: `raw` is ours alone (see above).
        unsafe { libc::close(raw) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: F_SETFD on a descriptor the caller holds changes only its flags.
    if unsafe { libc::fcntl(to, libc::F_SETFD, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Takes a listening unix socket inherited at descriptor `fd` (once, at start), and marks it
/// close-on-exec.
pub fn take_inherited_listener(fd: RawFd) -> io::Result<std::os::unix::net::UnixListener> {
    // SAFETY: F_GETFD only checks that the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut ty: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_TYPE writes one c_int into `ty`, whose size is passed in `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            &mut ty as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 || ty != libc::SOCK_STREAM {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is not a stream socket"),
        ));
    }
    // SAFETY: the descriptor is open, is a socket, and is taken once at start by this
    // process's only owner of it.
    let l = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
    // SAFETY: F_SETFD on the descriptor just taken changes only its flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(l)
}

/// Makes a user namespace that maps uids and gids `0 base count`, and a network namespace
/// owned by it, and returns a handle on the network namespace (which holds its user
/// namespace). A thread of a multithreaded process cannot make a user namespace, so a child
/// process is cloned into both (it only waits on a pipe); its maps are written, the
/// namespace opened, and the child ends. For the network pool's thread, off any request path.
pub fn userns_with_netns((base, count): (u32, u32)) -> io::Result<OwnedFd> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (r_raw, w_raw) = (r.as_raw_fd(), w.as_raw_fd());
    let flags = (libc::CLONE_NEWUSER | libc::CLONE_NEWNET | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: a fork-like clone (no new stack: the child runs on a copy of this one). The
    // child calls only close, read and _exit, which are async-signal-safe and touch no lock
    // or allocator state another thread of the parent may have held.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    if pid == 0 {
        let mut b = 0u8;
        // SAFETY: see above; `b` is this stack's own byte.
        unsafe {
            libc::close(w_raw);
            libc::read(r_raw, &mut b as *mut u8 as *mut libc::c_void, 1);
            libc::_exit(0);
        }
    }
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    let pid = pid as i32;
    drop(r);
    let result = (|| {
        let map = format!("0 {base} {count}\n");
        fs::write(format!("/proc/{pid}/uid_map"), &map)?;
        fs::write(format!("/proc/{pid}/gid_map"), &map)?;
        fs::File::open(format!("/proc/{pid}/ns/net")).map(OwnedFd::from)
    })();
    if result.is_err() {
        kill_pid(pid as u32, libc::SIGKILL);
    }
    // The child reads a byte and exits. (Not the pipe's end: a child that another thread
    // clones meanwhile holds a copy of `w` until it execs or ends.)
    let _ = nix::unistd::write(&w, b"x");
    drop(w);
    // Reaped here, unless a reaper of the process's took it first (ECHILD).
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    result
}

/// Mounts made in a new mount namespace of a child before it execs (for a criu worker: a
/// tmpfs as its /run, its cgroup yard's scratch): prepared before the fork, applied in the
/// child with raw syscalls only. A restore's root is mounted later ([`mount_overlay_in`]).
#[derive(Debug)]
pub struct PrivateMount {
    /// A detached tmpfs (with a `sbx` folder) a clone of which is shown as /run, the host's
    /// /run/sbx in it.
    run: Option<std::sync::Arc<OwnedFd>>,
    /// A folder (which exists on the host) given a tmpfs of its own, last.
    scratch: Option<CString>,
}

impl PrivateMount {
    /// A clone of the detached mount `run` (a tmpfs with a `sbx` folder) over /run, with the
    /// host's /run/sbx in it.
    pub fn new(run: Option<std::sync::Arc<OwnedFd>>) -> PrivateMount {
        PrivateMount { run, scratch: None }
    }

    /// Also a small tmpfs at `dir` (a folder that exists on the host), mounted last: a place
    /// of the namespace's own for what criu mounts (its cgroup yard), gone with it.
    pub fn with_scratch(mut self, dir: &Path) -> io::Result<PrivateMount> {
        self.scratch = Some(CString::new(dir.as_os_str().as_bytes())?);
        Ok(self)
    }

    /// In the child (between fork and exec): a mount namespace of its own, its mounts slaves
    /// of the host's (an unmount on the host reaches it where the host's mount is shared;
    /// nothing mounted in it reaches the host), with the mount made in it.
    pub fn apply(&self) -> io::Result<()> {
        // SAFETY: unshare takes flags only.
        if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: every pointer is to a NUL-terminated string that lives for the call, or null.
        let r = unsafe {
            libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        if let Some(run) = &self.run {
            // Best effort: where it fails, criu runs with the host's /run (and learns the
            // kernel again). The host's /run/sbx is cloned first (/run is covered next), the
            // tmpfs's clone goes over /run, then /run/sbx's over its `sbx`.
            use rustix::mount::{move_mount, open_tree, MoveMountFlags, OpenTreeFlags};
            let clone = OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC;
            let empty = MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH;
            let here = rustix::fs::CWD;
            if let Ok(sbx) = open_tree(here, c"/run/sbx", clone | OpenTreeFlags::AT_RECURSIVE) {
                if let Ok(tmp) = open_tree(run, c"", clone | OpenTreeFlags::AT_EMPTY_PATH) {
                    if move_mount(&tmp, c"", here, c"/run", empty).is_ok() {
                        let _ = move_mount(&sbx, c"", here, c"/run/sbx", empty);
                    }
                }
            }
        }
        if let Some(dir) = &self.scratch {
            // SAFETY: as above; the options string is a literal.
            let r = unsafe {
                libc::mount(
                    c"sbx-criu-scratch".as_ptr(),
                    dir.as_ptr(),
                    c"tmpfs".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                    c"size=1m,mode=0700".as_ptr() as *const libc::c_void,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Mounts an overlay with options `data` at `target` in the mount namespace of process `pid`
/// (a criu worker of the node's, waiting in a [`PrivateMount`] of its own), from a thread that
/// joins that namespace for the call. `pid` must be a child of this process not yet waited
/// for (its pid cannot be reused meanwhile).
pub fn mount_overlay_in(pid: u32, target: &Path, data: &str) -> io::Result<()> {
    use nix::sched::CloneFlags;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))?;
    let (target, data) = (target.to_path_buf(), data.to_string());
    std::thread::spawn(move || -> io::Result<()> {
        // A thread shares its filesystem context (root, cwd) with the process until it
        // unshares it; setns into a mount namespace needs it its own.
        nix::sched::unshare(CloneFlags::CLONE_FS).map_err(io::Error::from)?;
        nix::sched::setns(&ns, CloneFlags::CLONE_NEWNS).map_err(io::Error::from)?;
        nix::mount::mount(
            Some("overlay"),
            &target,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(data.as_str()),
        )
        .map_err(io::Error::from)
    })
    .join()
    .map_err(|_| io::Error::other("the mount's thread panicked"))?
}

/// Sets the hostname of the UTS namespace of process `pid` (a restored copy of a sandbox
/// takes a name of its own), from a thread that joins it for the call.
pub fn set_hostname_of(pid: u32, name: &str) -> io::Result<()> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/uts"))?;
    let name = name.to_string();
    std::thread::spawn(move || -> io::Result<()> {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWUTS).map_err(io::Error::from)?;
        nix::unistd::sethostname(&name).map_err(io::Error::from)
    })
    .join()
    .map_err(|_| io::Error::other("the hostname's thread panicked"))?
}
