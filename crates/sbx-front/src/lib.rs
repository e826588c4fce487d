//! `sbx-front`: what the node's front ends share (the HTTP API, E2B's, the preview listener),
//! so that none of them depends on another: where a request may come from and the node's
//! credentials taken out of it before a sandbox sees it ([`guard`]), the one accept loop with
//! its connection caps, timeouts and EMFILE handling ([`listen`]), forwarding a request into a
//! sandbox's port ([`upstream`]), an answer that holds its sandbox awake while it is sent
//! ([`held`]), and [`PortFront`], a front end that serves a port of every sandbox itself.

#![forbid(unsafe_code)]

pub mod guard;
pub mod held;
/// The accept loop and connection serving, shared with the control plane (`sbx-listen`).
pub use sbx_listen as listen;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

use axum::body::Body;
use hyper::{Request, Response};

/// A front end that serves one port of every sandbox itself (E2B's envd, on 49983): the
/// preview listener hands it the requests of `{port}-{sandbox}.{domain}`. The node's binary
/// wires it; the preview listener knows no front end by name.
pub trait PortFront: Send + Sync + 'static {
    /// The port it serves.
    fn port(&self) -> u16;
    /// Serves `req` of sandbox `sandbox` (an id or a name, as the host named it), from `peer`.
    fn serve(
        &self,
        req: Request<Body>,
        peer: SocketAddr,
        sandbox: String,
    ) -> Pin<Box<dyn Future<Output = Response<Body>> + Send + 'static>>;
}
