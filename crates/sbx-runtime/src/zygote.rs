//! The zygote: one process of the agent's binary (`sbx-agent zygote`), started by the node once,
//! that forks each sandbox's stage 0 (`sbx-agent init`, [`crate::init`]) instead of the node
//! executing the binary for every sandbox. An exec of the 6 MB agent is its mapping, its
//! relocations, its page faults and the C library's start (~0.5 ms of CPU a sandbox, issue
//! #31; docs/throughput.md); a fork of the small single-threaded zygote is a fraction of it.
//!
//! The node and the zygote share a `SOCK_SEQPACKET` pair (the zygote's on its stdin). A launch
//! is a socket pair of its own: the node sends one end over the zygote's socket (SCM_RIGHTS),
//! writes the stage's configuration to its end and shuts it for writing; the zygote forks, and
//! its child puts the received end on its stdin, stdout and stderr and runs stage 0, which reads
//! the configuration and writes `pid N` (or its error) to it; the node reads that until the
//! end. The child's parent is the zygote, which reaps it (SIGCHLD ignored); the sandbox's PID 1,
//! orphaned when stages 0 and 1 end, goes to the node, the subreaper, as before.
//!
//! The zygote ends when the node's end of its socket closes (the node stopped or died). A
//! zygote that is gone, or whose binary is no longer the file the node was started with (a new
//! build installed), is started again at the next launch; one found gone during a launch (its
//! socket hung up, or it answered nothing) is started again and the launch made once more.

use std::convert::Infallible;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};

/// The binary's file as a zygote was started from it: a rebuilt binary is another file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    mtime_ns: i128,
    size: u64,
}

fn file_id(path: &Path) -> io::Result<FileId> {
    let m = std::fs::metadata(path)?;
    Ok(FileId {
        dev: m.dev(),
        ino: m.ino(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        size: m.size(),
    })
}

/// A running zygote, as the node holds it.
#[derive(Debug)]
struct Running {
    control: OwnedFd,
    child: Mutex<Child>,
    exe: FileId,
}

impl Running {
    fn start(agent: &Path) -> io::Result<Running> {
        let exe = file_id(agent)?;
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        let child = Command::new(agent)
            .arg0("sbx-agent")
            .arg("zygote")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .env_clear()
            .spawn()?;
        Ok(Running {
            control: ours,
            child: Mutex::new(child),
            exe,
        })
    }

    /// Whether it still runs and its binary is still the agent's file. A zygote that was
    /// killed closes its end of the socket before it is a zombie to reap, and it closes it only
    /// when it ends: a hung-up socket is a zygote gone even while `try_wait` does not see it.
    fn usable(&self, agent: &Path) -> bool {
        let alive = match self.child.lock() {
            Ok(mut c) => matches!(c.try_wait(), Ok(None)),
            Err(_) => false,
        };
        alive && !self.hung_up() && file_id(agent).is_ok_and(|id| id == self.exe)
    }

    /// Whether the zygote's end of the control socket is closed (it ended).
    fn hung_up(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        let mut fds = [PollFd::new(self.control.as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => false,
            Ok(_) => fds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
            Err(_) => true,
        }
    }

    fn launch(&self, config: &[u8]) -> io::Result<String> {
        let (ours, theirs) = UnixStream::pair()?;
        let fds = [theirs.as_raw_fd()];
        sendmsg::<()>(
            self.control.as_raw_fd(),
            &[IoSlice::new(b"L")],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(io::Error::from)?;
        drop(theirs);
        let mut s = ours;
        s.write_all(config)?;
        s.shutdown(std::net::Shutdown::Write)?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(mut c) = self.child.lock() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The node's handle of its zygote: started at the first launch, started again when it is
/// gone or its binary changed.
#[derive(Debug)]
pub struct Zygote {
    agent: PathBuf,
    running: Mutex<Option<std::sync::Arc<Running>>>,
}

impl Zygote {
    pub fn new(agent: &Path) -> Zygote {
        Zygote {
            agent: agent.to_path_buf(),
            running: Mutex::new(None),
        }
    }

    fn current(&self) -> io::Result<std::sync::Arc<Running>> {
        let mut r = self
            .running
            .lock()
            .map_err(|_| io::Error::other("the zygote's lock is poisoned"))?;
        if let Some(z) = r.as_ref() {
            if z.usable(&self.agent) {
                return Ok(z.clone());
            }
        }
        let z = std::sync::Arc::new(Running::start(&self.agent)?);
        *r = Some(z.clone());
        Ok(z)
    }

    /// Runs stage 0 with `config` (the JSON of [`crate::init::InitConfig`]) in a child of the
    /// zygote: what it wrote (`pid N`, or its error). An error: the zygote could not be
    /// reached (none could be started, or it ended under the launch); the caller executes
    /// `sbx-agent init` itself then.
    ///
    /// A zygote found gone at the launch (killed, or ended, before it forked) is started again
    /// once and the launch made on the new one: the node's next sandboxes are not left to the
    /// slower path. Its child, if it forked one, wrote nothing, not even a pid.
    pub fn launch(&self, config: &[u8]) -> io::Result<String> {
        let mut gone = None;
        for _ in 0..2 {
            let z = self.current()?;
            let result = z.launch(config);
            // Nothing at all, or no way to send, from a zygote that ended: it ended before its
            // child wrote (the child writes at least its pid or an error), or before it read
            // the launch. Anything else is the launch's answer.
            let failed = match &result {
                Ok(out) => out.is_empty(),
                Err(_) => true,
            };
            if !failed || z.usable(&self.agent) {
                return result;
            }
            gone = Some(match result {
                Ok(_) => io::Error::other("the zygote ended during the launch"),
                Err(e) => e,
            });
        }
        Err(gone.unwrap_or_else(|| io::Error::other("the zygote ended during the launch")))
    }
}

/// The zygote's loop (`sbx-agent zygote`), on the socket it has on its stdin: for each
/// descriptor received, a child with it as stdin, stdout and stderr runs `stage0` (which never
/// returns). Returns when the node's end of the socket closes.
pub fn serve(stage0: impl Fn() -> Infallible) -> io::Result<()> {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: setting a signal's disposition to SIG_IGN installs no handler code.
    unsafe { signal(Signal::SIGCHLD, SigHandler::SigIgn) }.map_err(io::Error::from)?;
    // SAFETY: descriptor 0 is the socket the node gave this process as its stdin; nothing
    // else of this process owns it.
    let control = unsafe { OwnedFd::from_raw_fd(0) };
    loop {
        let mut byte = [0u8; 1];
        let mut iov = [IoSliceMut::new(&mut byte)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let msg = match recvmsg::<()>(
            control.as_raw_fd(),
            &mut iov,
            Some(space.as_mut_slice()),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        if msg.bytes == 0 {
            return Ok(());
        }
        let mut received: Vec<OwnedFd> = Vec::new();
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    // SAFETY: SCM_RIGHTS gave this process these descriptors: new, and owned
                    // by nothing else.
                    received.extend(
                        fds.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
        }
        let Some(conn) = received.into_iter().next() else {
            continue;
        };
        // SAFETY: this process is single-threaded (the zygote starts no thread), so the child
        // may run any code after the fork.
        match unsafe { nix::unistd::fork() } {
            Ok(nix::unistd::ForkResult::Child) => {
                // SAFETY: as above: the default disposition, no handler code.
                let _ = unsafe { signal(Signal::SIGCHLD, SigHandler::SigDfl) };
                for to in 0..3 {
                    // SAFETY: dup2 onto the standard descriptors; `conn` stays open for the
                    // call. Descriptor 0 was the node's socket (`control`), which this child
                    // never uses again: `stage0` does not return, so `control` is never
                    // dropped here.
                    if unsafe { libc::dup2(conn.as_raw_fd(), to) } < 0 {
                        std::process::exit(1);
                    }
                }
                drop(conn);
                stage0();
            }
            // The child has its copy; a failed fork drops the connection, which the node
            // reads as an empty answer.
            Ok(nix::unistd::ForkResult::Parent { .. }) | Err(_) => drop(conn),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for the agent's binary: a script (the zygote's protocol is not spoken; these
    /// tests are of its keeping).
    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("agent");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn pid(z: &Zygote) -> u32 {
        z.current().unwrap().child.lock().unwrap().id()
    }

    #[test]
    fn a_zygote_is_kept_then_started_again_when_its_binary_changes_or_it_ends() {
        let dir = crate::TempDir::new("zygote-kept");
        let agent = script(dir.path(), "exec sleep 30");
        let z = Zygote::new(&agent);
        let first = pid(&z);
        assert_eq!(pid(&z), first, "the same zygote serves the next launch");
        // A new build installed: another file at the same path.
        std::fs::remove_file(&agent).unwrap();
        script(dir.path(), "exec sleep 31");
        let second = pid(&z);
        assert_ne!(second, first, "a changed binary starts another zygote");
        // The first was ended when it was replaced (dropped, killed and reaped).
        assert!(!Path::new(&format!("/proc/{first}")).exists());
        // Killed: started again.
        crate::process::kill_pid(second, libc::SIGKILL);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_ne!(pid(&z), second, "a zygote that ended is started again");
    }

    #[test]
    fn a_zygote_whose_socket_hung_up_is_not_used_though_not_yet_reaped() {
        let dir = crate::TempDir::new("zygote-hup");
        let agent = script(dir.path(), "exec sleep 30");
        let alive = Running::start(&agent).unwrap();
        assert!(!alive.hung_up() && alive.usable(&agent));
        // Its socket closed while the process still runs (as a killed zygote's is before it
        // is a zombie): not usable.
        let agent = script(dir.path(), "exec 0<&-; exec sleep 30");
        let closed = Running::start(&agent).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !closed.hung_up() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(closed.hung_up());
        assert!(matches!(closed.child.lock().unwrap().try_wait(), Ok(None)));
        assert!(!closed.usable(&agent));
    }

    #[test]
    fn a_zygote_that_ends_at_once_is_an_error_for_the_caller_to_fall_back() {
        let dir = crate::TempDir::new("zygote-ends");
        let z = Zygote::new(&script(dir.path(), "exit 0"));
        assert!(z.launch(b"{}").is_err());
    }
}
