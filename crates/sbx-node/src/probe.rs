//! The `ready.tcp` and `ready.http` checks: what they are (kept with templates and sandboxes)
//! and the [`Prober`] that tries them. The node tries a check from the host, through a socket
//! made in the sandbox's network namespace, so nothing runs in the sandbox and an image
//! without a shell can be checked. The prober is given to the node when it is built: the
//! node's binary gives sbx-net's, which speaks HTTP (the core speaks none).
//!
//! The address tried is [`PROBE_ADDR`], 127.0.0.2: a service that listens on every address
//! (0.0.0.0 or `::`) takes it, one bound to 127.0.0.1 alone does not, as the spec asks of a
//! service the preview URLs are to reach.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;

use serde::{Deserialize, Serialize};

/// The address a probe connects to in the sandbox's network namespace.
pub const PROBE_ADDR: [u8; 4] = [127, 0, 0, 2];

/// A check tried from the host.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Probe {
    /// The port takes a TCP connection.
    Tcp { port: u16 },
    /// A GET of `path` on the port answers 200 to 399.
    Http { port: u16, path: String },
}

impl Probe {
    /// The port the check connects to.
    pub fn port(&self) -> u16 {
        match self {
            Probe::Tcp { port } | Probe::Http { port, .. } => *port,
        }
    }
}

/// What one try of a check comes to: `Err` says what it got instead.
pub type ProbeResult = Result<(), String>;

/// Tries checks.
pub trait Prober: Send + Sync + 'static {
    /// Tries `check` once in the network namespace `ns` names (a handle on the sandbox's
    /// agent: [`sbx_runtime::Sandbox::netns_handle`]).
    fn try_once<'a>(
        &'a self,
        check: &'a Probe,
        ns: OwnedFd,
    ) -> Pin<Box<dyn Future<Output = ProbeResult> + Send + 'a>>;
}
