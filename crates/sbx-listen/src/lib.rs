//! `sbx-listen`: the listeners of the node and of the control plane. An accept loop
//! ([`accept_loop`]) and the serving of each connection ([`serve_conn`]: hyper's HTTP/1.1, or
//! HTTP/1.1 and HTTP/2, upgrades kept for WebSockets), with what `axum::serve` and hyper's
//! builders lack, for every listener alike (the node's API, E2B's, the preview listener; the
//! control plane's API, E2B's and preview listeners):
//!
//! - a cap on open connections (`--max-connections` for the API): one over it is answered 503
//!   `unavailable` (retryable) and closed, with a log line;
//! - the header timeout (`--header-timeout-ms`): a request head that is not complete that long
//!   after its first byte closes the connection;
//! - the keep-alive timeout (`--keepalive-timeout-ms`): a connection with no request in flight
//!   and no byte of a next one is closed after it;
//! - the body-idle timeout (`--body-idle-timeout-ms`): a request body that is waited for while
//!   nothing is read from or written to its connection for that long fails (its handler gets
//!   an error, the connection closes). Only idle time counts, never total time: a body that
//!   keeps coming, however slowly, a body that waits while its answer streams (a stream
//!   forwarded both ways), and an answer that streams (an event stream, a download) are never
//!   cut; nor is an upgraded WebSocket, which leaves the connection's watch.
//! - fd exhaustion on accept: logged, one connection answered 503 through a descriptor kept in
//!   reserve for it, and accept backs off instead of spinning.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tower::ServiceExt;

/// The timeouts and the cap of the listener.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header: Duration,
    pub body_idle: Duration,
    pub keepalive: Duration,
    pub max_connections: usize,
}

impl Limits {
    /// Its timeouts.
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            header: self.header,
            body_idle: self.body_idle,
            keepalive: self.keepalive,
        }
    }
}

/// The timeouts of a listener's connections (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// From the first byte of a request head to its end.
    pub header: Duration,
    /// A request body waited for on a connection that reads and writes nothing.
    pub body_idle: Duration,
    /// A connection with no request in flight and no byte of a next one.
    pub keepalive: Duration,
}

impl Timeouts {
    /// The listeners that carry streams both ways (E2B's envd, whose SDKs send a keepalive on
    /// an input stream every 50 s; the preview listener, which forwards a sandbox's own
    /// services): the API's default header and keep-alive timeouts (`--header-timeout-ms`,
    /// `--keepalive-timeout-ms`), and a body may wait two minutes with its connection idle.
    pub const STREAMS: Timeouts = Timeouts {
        header: Duration::from_secs(10),
        body_idle: Duration::from_secs(120),
        keepalive: Duration::from_secs(60),
    };
}

/// How a listener's connections speak HTTP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 only (the API).
    Http1,
    /// HTTP/1.1 or HTTP/2 (with prior knowledge, or ALPN under TLS), by the connection's first
    /// bytes: hyper-util's auto builder.
    Http1And2,
}

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("the request body sent nothing for {0:?}")]
    BodyIdle(Duration),
    #[error("the request body: {0}")]
    Body(#[from] hyper::Error),
}

/// What the watchdog of a connection needs to know of it.
struct Activity {
    /// Requests whose answer is not over yet.
    in_flight: usize,
    /// Since when nothing is in flight.
    idle_since: Instant,
    /// When the first byte of a next request came, while nothing was in flight.
    head_since: Option<Instant>,
}

struct Conn {
    activity: Mutex<Activity>,
    changed: Notify,
    /// When the connection was accepted: the origin of `last_io`.
    start: Instant,
    /// Milliseconds from `start` to the last byte read or written.
    last_io: AtomicU64,
}

impl Conn {
    fn new() -> Conn {
        let now = Instant::now();
        Conn {
            activity: Mutex::new(Activity {
                in_flight: 0,
                idle_since: now,
                head_since: None,
            }),
            changed: Notify::new(),
            start: now,
            last_io: AtomicU64::new(0),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Activity) -> T) -> T {
        // A panic while it was held leaves nothing half-done in it: its fields are times.
        let mut a = self
            .activity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut a)
    }

    /// A byte was read or written now.
    fn io_now(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_io.fetch_max(ms, Ordering::Relaxed);
    }

    /// When a byte was last read or written.
    fn last_io(&self) -> Instant {
        self.start + Duration::from_millis(self.last_io.load(Ordering::Relaxed))
    }
}

/// A request in flight on its connection, until its answer's body is dropped.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn new(conn: &Arc<Conn>) -> InFlight {
        conn.with(|a| {
            a.in_flight += 1;
            a.head_since = None;
        });
        conn.changed.notify_one();
        InFlight(conn.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.with(|a| {
            a.in_flight -= 1;
            if a.in_flight == 0 {
                a.idle_since = Instant::now();
                a.head_since = None;
            }
        });
        self.0.changed.notify_one();
    }
}

/// The connection's stream (a socket, a TLS stream), noting the first byte of a request head
/// and when bytes last went either way.
struct Watched<I> {
    io: I,
    conn: Arc<Conn>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.io_now();
            let started = self.conn.with(|a| {
                let start = a.in_flight == 0 && a.head_since.is_none();
                if start {
                    a.head_since = Some(Instant::now());
                }
                start
            });
            if started {
                self.conn.changed.notify_one();
            }
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.conn.io_now();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.conn.io_now();
        }
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A request body that fails when it is waited for and its connection reads and writes
/// nothing for `idle`: only the time spent waiting counts, not the time the handler takes
/// between reads, nor the time while its answer is being written.
struct IdleBody {
    inner: Incoming,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    waiting: bool,
    conn: Arc<Conn>,
}

impl hyper::body::Body for IdleBody {
    type Data = Bytes;
    type Error = ListenError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ListenError>>> {
        let this = &mut *self;
        if !this.waiting {
            this.waiting = true;
            let at = tokio::time::Instant::now() + this.idle;
            this.timer.as_mut().reset(at);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(r) => {
                this.waiting = false;
                Poll::Ready(r.map(|f| f.map_err(ListenError::Body)))
            }
            Poll::Pending => loop {
                match this.timer.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(()) => {
                        // Bytes went either way meanwhile (an answer that streams while its
                        // request's body waits): idle from then on.
                        let due = this.conn.last_io() + this.idle;
                        if due <= Instant::now() {
                            return Poll::Ready(Some(Err(ListenError::BodyIdle(this.idle))));
                        }
                        this.timer.as_mut().reset(due.into());
                    }
                }
            },
        }
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An answer's body, holding its request in flight until it is over.
struct Answer {
    inner: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for Answer {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Log lines that may come in floods: at most one a second, with how many were left out.
struct Throttled {
    last: AtomicU64,
    skipped: AtomicU64,
    start: Instant,
}

impl Throttled {
    fn new() -> Throttled {
        Throttled {
            last: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            start: Instant::now(),
        }
    }
    /// Whether to log now, and how many were skipped since the last line.
    fn take(&self) -> Option<u64> {
        let now = self.start.elapsed().as_millis() as u64 + 1000;
        let last = self.last.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.skipped.swap(0, Ordering::Relaxed));
        }
        self.skipped.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// Serves `app` on `listener` until `stop` resolves; then waits up to 5 s for open
/// connections.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    // Told to every connection when the node stops: an idle one closes at once, a busy one
    // after its answer (it is not kept alive).
    let (stopping, _) = watch::channel(false);
    let told = stopping.clone();
    let stop = async move {
        stop.await;
        let _ = told.send(true);
    };
    let how = RouterListener {
        name: "API listener",
        max_connections: limits.max_connections,
        timeouts: limits.timeouts(),
        protocol: Protocol::Http1,
    };
    serve_router(listener, app, how, stop, Some(stopping)).await;
}

/// The connections a listener that carries streams (E2B's, a preview listener) takes at once.
pub const MAX_STREAM_CONNECTIONS: usize = 1024;

/// Serves `app` on `listener` as a listener that carries streams both ways (E2B's, a preview
/// listener): HTTP/1.1 or HTTP/2, [`Timeouts::STREAMS`], at most `max_connections` at once,
/// until the future is dropped. `name` is the log's.
pub async fn serve_streams(
    listener: TcpListener,
    name: &'static str,
    app: Router,
    max_connections: usize,
) {
    let how = RouterListener {
        name,
        max_connections,
        timeouts: Timeouts::STREAMS,
        protocol: Protocol::Http1And2,
    };
    serve_router(listener, app, how, std::future::pending(), None).await;
}

/// How a listener serves a router: its log's name, its cap, its connections' timeouts and
/// protocol.
#[derive(Clone, Copy)]
struct RouterListener {
    name: &'static str,
    max_connections: usize,
    timeouts: Timeouts,
    protocol: Protocol,
}

/// Serves `app` on `listener` as `how` says until `stop` resolves; `stopping` (when there is
/// one) is told to each connection at the stop.
async fn serve_router(
    listener: TcpListener,
    app: Router,
    how: RouterListener,
    stop: impl Future<Output = ()>,
    stopping: Option<watch::Sender<bool>>,
) {
    accept_loop(
        listener,
        how.name,
        how.max_connections,
        stop,
        move |stream, peer| {
            let app = app.clone();
            serve_conn(
                stream,
                peer,
                how.timeouts,
                how.protocol,
                stopping.as_ref().map(watch::Sender::subscribe),
                move |req| {
                    let app = app.clone();
                    async move {
                        match app.oneshot(req).await {
                            Ok(r) => r,
                            Err(never) => match never {},
                        }
                    }
                },
            )
        },
    )
    .await;
}

/// The accept loop of every listener of the node (the API, E2B's, the preview listener):
/// each connection accepted is served by `conn` on a task of its own while it holds one of
/// `max_connections` places. A connection past the cap is answered 503 `unavailable`
/// (retryable) and closed; when the process runs out of descriptors, one connection is answered
/// 503 through a descriptor kept in reserve and accept backs off instead of spinning; both
/// logged (throttled) with `name`. When `stop` resolves, open connections get up to 5 s.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    name: &'static str,
    max_connections: usize,
    stop: impl Future<Output = ()>,
    conn: F,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max_connections));
    let over_cap = Throttled::new();
    let no_fds = Throttled::new();
    // A descriptor kept for the one connection answered when the process has no more.
    let mut reserve = std::fs::File::open("/dev/null").ok();
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = &mut stop => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) if out_of_fds(&e) => {
                if let Some(skipped) = no_fds.take() {
                    tracing::error!(
                        error = %e,
                        listener = name,
                        open = max_connections - slots.available_permits(),
                        skipped,
                        "out of file descriptors: a connection is refused"
                    );
                }
                // The reserve makes room for one accept, answered 503; then a pause, so that
                // descriptors come free before the next try.
                if reserve.take().is_some() {
                    if let Ok((s, _)) = listener.accept().await {
                        refuse(s).await;
                    }
                    reserve = std::fs::File::open("/dev/null").ok();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, listener = name, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Some(skipped) = over_cap.take() {
                tracing::warn!(
                    max_connections,
                    listener = name,
                    %peer,
                    skipped,
                    "connection cap reached: a connection is refused (503)"
                );
            }
            tokio::spawn(refuse(stream));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let serving = conn(stream, peer);
        tokio::spawn(async move {
            serving.await;
            drop(slot);
        });
    }
    // Stopping: what is open gets a moment to finish.
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(Duration::from_secs(5), slots.acquire_many(all)).await;
}

/// EMFILE or ENFILE: the process or the system has no descriptor left.
fn out_of_fds(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Answers 503 `unavailable` on a connection the node does not serve, and closes it (after
/// reading what the client sent meanwhile, at most 0.5 s, so that the answer is not lost to a
/// reset).
async fn refuse(mut s: TcpStream) {
    let rid = sbx_api::new_request_id();
    let err = sbx_api::ApiError::new(
        sbx_api::ErrorCode::Unavailable,
        "the node serves as many connections as it may; try again",
    );
    let body = sbx_api::error_body(&err, &rid, None).to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nx-request-id: {rid}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        s.shutdown().await?;
        let mut sink = [0u8; 4096];
        while s.read(&mut sink).await? > 0 {}
        Ok::<(), io::Error>(())
    })
    .await;
}

/// When a connection with nothing in flight is closed, and which timeout that is: the header
/// timeout from the first byte of a request, else the keep-alive timeout.
fn due(conn: &Conn, t: Timeouts) -> Option<(Instant, &'static str)> {
    conn.with(|a| {
        if a.in_flight > 0 {
            None
        } else if let Some(h) = a.head_since {
            Some((h + t.header, "header"))
        } else {
            Some((a.idle_since + t.keepalive, "keep-alive"))
        }
    })
}

/// Serves one connection `io` (accepted from `peer`) with `handler` under `timeouts`: its
/// requests, their bodies watched for idleness and `ConnectInfo(peer)` among their
/// extensions, until the client closes it, a timeout closes it, or `stopping` turns true (the
/// node stops: closed at once when nothing is in flight, else after its answer). Upgrades
/// (WebSockets) are kept.
pub async fn serve_conn<I, H, F>(
    io: I,
    peer: SocketAddr,
    timeouts: Timeouts,
    protocol: Protocol,
    stopping: Option<watch::Receiver<bool>>,
    handler: H,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let conn = Arc::new(Conn::new());
    let io = TokioIo::new(Watched {
        io,
        conn: conn.clone(),
    });
    let handler = Arc::new(handler);
    let svc_conn = conn.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let in_flight = InFlight::new(&svc_conn);
        let conn = svc_conn.clone();
        let mut req = req.map(|b| {
            Body::new(IdleBody {
                inner: b,
                idle: timeouts.body_idle,
                timer: Box::pin(tokio::time::sleep(timeouts.body_idle)),
                waiting: false,
                conn,
            })
        });
        req.extensions_mut().insert(ConnectInfo(peer));
        let answer = handler(req);
        async move {
            let resp = answer.await;
            Ok::<_, Infallible>(resp.map(|b| {
                Body::new(Answer {
                    inner: b,
                    _in_flight: in_flight,
                })
            }))
        }
    });
    match protocol {
        Protocol::Http1 => {
            let serving = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, svc)
                .with_upgrades();
            watch_conn(
                serving,
                |s| s.graceful_shutdown(),
                &conn,
                timeouts,
                peer,
                stopping,
            )
            .await;
        }
        Protocol::Http1And2 => {
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let serving = builder.serve_connection_with_upgrades(io, svc);
            watch_conn(
                serving,
                |s| s.graceful_shutdown(),
                &conn,
                timeouts,
                peer,
                stopping,
            )
            .await;
        }
    }
}

/// Drives a connection being served until it ends, closing it when a timeout of `t` passes
/// with nothing in flight, or when the node stops.
async fn watch_conn<S, E>(
    serving: S,
    graceful: impl Fn(Pin<&mut S>),
    conn: &Conn,
    t: Timeouts,
    peer: SocketAddr,
    mut stopping: Option<watch::Receiver<bool>>,
) where
    S: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tokio::pin!(serving);
    loop {
        // A change of the connection's activity wakes this; a deadline that passed is looked
        // at again before the connection is closed.
        let changed = conn.changed.notified();
        let deadline = due(conn, t);
        let timer = async {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        let stop = async {
            match stopping.as_mut() {
                Some(s) if !*s.borrow() => {
                    if s.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut serving => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "connection ended");
                }
                return;
            }
            () = changed => {}
            () = stop => {
                // The node stops: nothing in flight, closed now; else closed after its answer.
                if conn.with(|a| a.in_flight == 0) {
                    return;
                }
                graceful(serving.as_mut());
            }
            () = timer => {
                let now = Instant::now();
                if let Some((_, why)) = due(conn, t).filter(|(at, _)| *at <= now) {
                    tracing::debug!(%peer, timeout = why, "connection closed: timed out");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
