//! Unix stream connections between the node and an agent that wake their task only for what it
//! waits on.
//!
//! A tokio `UnixStream` is registered for reading and writing at once, so every read the peer
//! makes (which frees room in the socket) wakes the writer's reactor with a writable event it did
//! not ask for: on a connection carrying one short request and one short answer, that is one
//! needless wakeup per message, each a context switch. Here the socket is registered for reading
//! only; a write goes straight to the socket, and only a write that finds it full registers a
//! second descriptor of the same socket for writability, until a write gets through again.

use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::LazyLock;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use nix::sys::socket::{sendmsg, shutdown, MsgFlags, Shutdown, UnixAddr};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// `fd` registered with the current reactor for `interest`.
fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd always answers the same descriptor from as_raw_fd and closes it only
    // when dropped, which happens after the AsyncFd (its owner) has deregistered it.
    unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(|e| e.into_parts().1)
}

struct Shared {
    /// The socket, registered for reading only.
    read: AsyncFd<OwnedFd>,
    /// A second descriptor of the socket registered for writability, while a write waits for
    /// room.
    write_wait: Mutex<Option<AsyncFd<OwnedFd>>>,
}

/// A connected unix stream socket (see the module's text).
pub struct Conn(Arc<Shared>);

/// The reading side of a [`Conn`].
pub struct ReadHalf(Arc<Shared>);

/// The writing side of a [`Conn`].
pub struct WriteHalf(Arc<Shared>);

impl Conn {
    /// Connects to the agent known by `path` (a sandbox's [`crate::Sandbox::socket`]): to
    /// its listener in its sandbox's network namespace when the driver registered it
    /// ([`register_agent`]), checked to be the agent's; else to the socket at `path`.
    pub async fn connect(path: &Path) -> io::Result<Conn> {
        if let Some((pid, handle)) = registered(path) {
            return Conn::from_std(connect_agent(pid, handle)?);
        }
        let stream = tokio::net::UnixStream::connect(path).await?;
        Conn::from_std(stream.into_std()?)
    }

    /// Takes a connected stream (for instance one a tokio listener accepted and let go with
    /// `into_std`).
    pub fn from_std(stream: std::os::unix::net::UnixStream) -> io::Result<Conn> {
        stream.set_nonblocking(true)?;
        let read = register(OwnedFd::from(stream), Interest::READABLE)?;
        Ok(Conn(Arc::new(Shared {
            read,
            write_wait: Mutex::new(None),
        })))
    }

    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        (ReadHalf(self.0.clone()), WriteHalf(self.0))
    }
}

impl AsFd for ReadHalf {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.read.get_ref().as_fd()
    }
}

impl AsRawFd for ReadHalf {
    fn as_raw_fd(&self) -> RawFd {
        self.0.read.get_ref().as_raw_fd()
    }
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut ready = ready!(self.0.read.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match ready.try_io(|fd| crate::process::read_nb(fd.get_ref(), unfilled)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // Stale readiness: cleared by try_io; wait for the next.
                Err(_would_block) => continue,
            }
        }
    }
}

/// Sends what the socket takes now of `bufs`, in order.
fn send_now(fd: BorrowedFd<'_>, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    sendmsg::<UnixAddr>(
        fd.as_raw_fd(),
        bufs,
        &[],
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(io::Error::from)
}

impl WriteHalf {
    fn waiter(&self) -> std::sync::MutexGuard<'_, Option<AsyncFd<OwnedFd>>> {
        self.0
            .write_wait
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let fd = self.0.read.get_ref().as_fd();
        loop {
            match send_now(fd, bufs) {
                Ok(n) => {
                    // Room again: writability is not watched any more.
                    self.waiter().take();
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let mut waiter = self.waiter();
                    if waiter.is_none() {
                        let second = fd.try_clone_to_owned()?;
                        *waiter = Some(register(second, Interest::WRITABLE)?);
                    }
                    let Some(w) = waiter.as_ref() else {
                        continue;
                    };
                    match w.poll_write_ready(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        // Readiness seen: cleared, then the send is tried again (a readiness
                        // that comes meanwhile is kept by the reactor until then).
                        Poll::Ready(Ok(mut ready)) => ready.clear_ready(),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let fd = self.0.read.get_ref().as_raw_fd();
        Poll::Ready(shutdown(fd, Shutdown::Write).map_err(io::Error::from))
    }
}

/// Agents whose listener is the abstract socket [`crate::init::AGENT_SOCKET`] of their
/// sandbox's network namespace, by the path that names them to the node
/// ([`crate::Sandbox::socket`]): their host pid and a pidfd (which names their namespaces even
/// if the pid is reused).
static AGENTS: LazyLock<Mutex<AgentMap>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Agents by name: (host pid, pidfd).
type AgentMap = HashMap<PathBuf, (u32, Arc<OwnedFd>)>;

fn agents() -> std::sync::MutexGuard<'static, AgentMap> {
    AGENTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// [`Conn::connect`] on `key` reaches the agent of host pid `pid` (`pidfd` a handle on it) in
/// its network namespace from now on.
pub fn register_agent(key: &Path, pid: u32, pidfd: OwnedFd) {
    agents().insert(key.to_path_buf(), (pid, Arc::new(pidfd)));
}

/// Forgets `key`'s agent if it is still the agent of host pid `pid`.
pub fn unregister_agent(key: &Path, pid: u32) {
    let mut a = agents();
    if a.get(key).is_some_and(|(p, _)| *p == pid) {
        a.remove(key);
    }
}

fn registered(key: &Path) -> Option<(u32, Arc<OwnedFd>)> {
    agents().get(key).map(|(p, h)| (*p, h.clone()))
}

/// Connects to the abstract socket `name` from a thread in the network namespace of the
/// process `pidfd` names, without blocking (a full backlog is an error, not a wait), and
/// checks that the listener is process `pid`'s (`SO_PEERCRED` of a listener names the process
/// that called listen(): a process of the sandbox that bound the name first is refused).
fn connect_agent(pid: u32, pidfd: Arc<OwnedFd>) -> io::Result<std::os::unix::net::UnixStream> {
    use nix::sys::socket::{self, AddressFamily, SockFlag, SockType};
    let handle = pidfd.try_clone()?;
    let stream = crate::netns::in_netns_of_handle(handle, || {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        let addr = UnixAddr::new_abstract(crate::init::AGENT_SOCKET.as_bytes())?;
        socket::connect(fd.as_raw_fd(), &addr)?;
        Ok(std::os::unix::net::UnixStream::from(fd))
    })?;
    let peer = peer_pid(&stream)?;
    if peer != pid as i32 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the listener @{} is process {peer}'s, not the agent's ({pid})",
                crate::init::AGENT_SOCKET
            ),
        ));
    }
    Ok(stream)
}

/// The pid of a unix socket's peer (`SO_PEERCRED`), as seen in the caller's PID namespace: 0
/// for a process outside it.
pub fn peer_pid(fd: &impl AsFd) -> io::Result<i32> {
    let cred = nix::sys::socket::getsockopt(fd, nix::sys::socket::sockopt::PeerCredentials)?;
    Ok(cred.pid())
}

/// A listening unix socket bound to the abstract name `name` in the caller's network
/// namespace.
pub fn bind_abstract(name: &str) -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    std::os::unix::net::UnixListener::bind_addr(&addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn pair() -> (Conn, Conn) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        (Conn::from_std(a).unwrap(), Conn::from_std(b).unwrap())
    }

    #[tokio::test]
    async fn messages_go_both_ways_and_the_end_is_seen() {
        let (a, b) = pair();
        let (mut ar, mut aw) = a.into_split();
        let (mut br, mut bw) = b.into_split();
        aw.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        br.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        bw.write_all_buf(&mut &b"pong"[..]).await.unwrap();
        ar.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        aw.shutdown().await.unwrap();
        let mut rest = Vec::new();
        br.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_that_fills_the_socket_waits_for_room_and_loses_nothing() {
        let (a, b) = pair();
        let (_ar, mut aw) = a.into_split();
        let (mut br, _bw) = b.into_split();
        // Far more than a socket buffer holds: the writer must wait for the reader, often.
        let data: Vec<u8> = (0..(16u32 << 20)).map(|i| (i % 251) as u8).collect();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            for chunk in sent.chunks(100_000) {
                aw.write_all(chunk).await.unwrap();
            }
            aw.shutdown().await.unwrap();
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 7919];
        loop {
            let n = br.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            // A slow reader now and then.
            if got.len() % 5 == 0 {
                tokio::task::yield_now().await;
            }
        }
        writer.await.unwrap();
        assert_eq!(got.len(), data.len());
        assert!(got == data, "the bytes differ");
    }

    #[tokio::test]
    async fn vectored_writes_keep_their_order() {
        let (a, b) = pair();
        let (_ar, mut aw) = a.into_split();
        let (mut br, _bw) = b.into_split();
        let parts = [
            IoSlice::new(b"one "),
            IoSlice::new(b"two "),
            IoSlice::new(b"three"),
        ];
        let n = aw.write_vectored(&parts).await.unwrap();
        assert_eq!(n, 13);
        let mut got = [0u8; 13];
        br.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"one two three");
    }
}
