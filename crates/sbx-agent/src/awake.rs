//! `/run/sbx/awake`: programs of the sandbox hold it awake.
//!
//! A program connects to the unix socket and sends `+` before it answers a request whose work
//! goes on after the answer, and `-` when that work is done; its connection's end (it closed
//! it, or died) lowers every hold it raised. The node asks the agent what is held
//! ([`sbx_proto::HostMsg::Awake`]) once the sandbox's idle time has run out, and may have the
//! programs connected told `sleep N\n` (milliseconds) before it stops the sandbox.
//!
//! Anything else a program sends is ignored. A connection costs the agent a task and a small
//! buffer; at most [`MAX_CONNECTIONS`] are served at once (more are closed at once).

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::spawn_local;

/// The most connections served at once.
pub const MAX_CONNECTIONS: usize = 1024;

/// The holds of the sandbox's programs.
#[derive(Default)]
pub struct Awake {
    state: RefCell<State>,
}

#[derive(Default)]
struct State {
    next: u64,
    conns: HashMap<u64, Conn>,
    /// When the holds last fell to none.
    lowered: Option<Instant>,
}

struct Conn {
    holds: u32,
    notices: mpsc::UnboundedSender<String>,
}

/// What the node is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub holds: u32,
    pub connected: u32,
    pub lowered_ms_ago: Option<u64>,
}

impl State {
    fn total(&self) -> u32 {
        self.conns
            .values()
            .fold(0u32, |n, c| n.saturating_add(c.holds))
    }
}

impl Awake {
    /// Serves `path` (made anew, writable by every user of the sandbox); `None` if it cannot
    /// be bound (the image's /run is read-only, say): the sandbox is then never held.
    pub fn serve(path: &Path) -> Option<Rc<Awake>> {
        let listener = bind(path).ok()?;
        let awake = Rc::new(Awake::default());
        spawn_local(accept(awake.clone(), listener));
        Some(awake)
    }

    /// The holds now.
    pub fn held(&self) -> Held {
        let st = self.state.borrow();
        let holds = st.total();
        Held {
            holds,
            connected: u32::try_from(st.conns.len()).unwrap_or(u32::MAX),
            lowered_ms_ago: match (holds, st.lowered) {
                (0, Some(t)) => Some(u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)),
                _ => None,
            },
        }
    }

    /// Tells every program connected that the sandbox stops in `ms` milliseconds.
    pub fn notify(&self, ms: u32) {
        let line = format!("sleep {ms}\n");
        for c in self.state.borrow().conns.values() {
            let _ = c.notices.send(line.clone());
        }
    }

    /// Applies what connection `id` sent.
    fn apply(&self, id: u64, bytes: &[u8]) {
        let mut st = self.state.borrow_mut();
        let before = st.total();
        if let Some(c) = st.conns.get_mut(&id) {
            for b in bytes {
                match b {
                    b'+' => c.holds = c.holds.saturating_add(1),
                    b'-' => c.holds = c.holds.saturating_sub(1),
                    _ => {}
                }
            }
        }
        if before > 0 && st.total() == 0 {
            st.lowered = Some(Instant::now());
        }
    }

    /// Connection `id` ended: its holds are lowered.
    fn end(&self, id: u64) {
        let mut st = self.state.borrow_mut();
        let before = st.total();
        st.conns.remove(&id);
        if before > 0 && st.total() == 0 {
            st.lowered = Some(Instant::now());
        }
    }
}

fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A socket file left by an earlier agent (a sandbox made from a copy of this one's disk).
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

async fn accept(awake: Rc<Awake>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let id = {
                    let mut st = awake.state.borrow_mut();
                    if st.conns.len() >= MAX_CONNECTIONS {
                        continue;
                    }
                    st.next += 1;
                    st.next
                };
                spawn_local(connection(awake.clone(), id, stream));
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
        }
    }
}

async fn connection(awake: Rc<Awake>, id: u64, stream: UnixStream) {
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    awake.state.borrow_mut().conns.insert(
        id,
        Conn {
            holds: 0,
            notices: tx,
        },
    );
    let mut buf = [0u8; 256];
    loop {
        tokio::select! {
            n = rd.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => awake.apply(id, &buf[..n]),
            },
            Some(line) = rx.recv() => {
                // A program that does not read its notices is not waited for.
                let write = wr.write_all(line.as_bytes());
                if tokio::time::timeout(std::time::Duration::from_millis(100), write)
                    .await
                    .map_or(true, |r| r.is_err())
                {
                    break;
                }
            }
        }
    }
    awake.end(id);
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Holds rise and fall by `+` and `-`, a closed connection lowers its own, and a notice
    /// reaches every program connected.
    #[test]
    fn holds_and_notices() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("run/sbx/awake");
            let awake = Awake::serve(&path).unwrap();
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o666);
            assert_eq!(awake.held().connected, 0);

            let mut a = UnixStream::connect(&path).await.unwrap();
            let mut b = UnixStream::connect(&path).await.unwrap();
            a.write_all(b"++\n").await.unwrap();
            b.write_all(b"+").await.unwrap();
            settle().await;
            let h = awake.held();
            assert_eq!((h.holds, h.connected, h.lowered_ms_ago), (3, 2, None));

            a.write_all(b"-").await.unwrap();
            settle().await;
            assert_eq!(awake.held().holds, 2);

            awake.notify(250);
            let mut line = [0u8; 10];
            b.read_exact(&mut line).await.unwrap();
            assert_eq!(&line, b"sleep 250\n");

            // b's end lowers its hold, a's `-` its last: none is held.
            drop(b);
            a.write_all(b"-").await.unwrap();
            settle().await;
            let h = awake.held();
            assert_eq!((h.holds, h.connected), (0, 1));
            assert!(h.lowered_ms_ago.is_some());
            drop(a);
            settle().await;
            assert_eq!(awake.held().connected, 0);
        });
    }
}
