//! The `ready.tcp` and `ready.http` checks: tried by the node from the host, through a socket
//! made in the sandbox's network namespace (sbx-runtime `netns`), so nothing runs in the
//! sandbox and an image without a shell can be checked.
//!
//! The address tried is 127.0.0.2: a service that listens on every address (0.0.0.0 or `::`)
//! takes it, one bound to 127.0.0.1 alone does not, as the spec asks of a service the preview
//! URLs are to reach.

use std::time::Duration;

use http_body_util::Empty;
use hyper_util::rt::TokioIo;
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
    /// Tries the check once in the network namespace `ns` names (a handle on the sandbox's
    /// agent: [`sbx_runtime::Sandbox::netns_handle`]). `Err` says what it got.
    pub async fn try_once(&self, ns: std::os::fd::OwnedFd) -> Result<(), String> {
        let port = match self {
            Probe::Tcp { port } | Probe::Http { port, .. } => *port,
        };
        let socket = tokio::task::spawn_blocking(move || {
            sbx_runtime::netns::in_netns_of_handle(ns, tokio::net::TcpSocket::new_v4)
        })
        .await
        .map_err(|e| format!("the probe's thread: {e}"))?
        .map_err(|e| format!("no socket in the sandbox's network: {e}"))?;
        let addr = std::net::SocketAddr::from((PROBE_ADDR, port));
        let stream = match tokio::time::timeout(Duration::from_secs(1), socket.connect(addr)).await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("tcp port {port}: {e}")),
            Err(_) => return Err(format!("tcp port {port}: no answer in 1 s")),
        };
        let Probe::Http { path, .. } = self else {
            return Ok(());
        };
        match tokio::time::timeout(Duration::from_secs(2), get(stream, port, path)).await {
            Ok(Ok(status)) if (200..400).contains(&status) => Ok(()),
            Ok(Ok(status)) => Err(format!("GET {path} on port {port}: HTTP {status}")),
            Ok(Err(e)) => Err(format!("GET {path} on port {port}: {e}")),
            Err(_) => Err(format!("GET {path} on port {port}: no answer in 2 s")),
        }
    }
}

/// One GET over `stream`; its status.
async fn get(stream: tokio::net::TcpStream, port: u16, path: &str) -> Result<u16, String> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, format!("localhost:{port}"))
        .header(hyper::header::USER_AGENT, "sbx-ready-check")
        .body(Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let res = sender.send_request(req).await.map_err(|e| e.to_string());
    conn.abort();
    Ok(res?.status().as_u16())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    // The node's own network namespace stands in for a sandbox's (joining it needs root).
    #[test]
    fn a_listener_on_every_address_passes_and_one_on_127_0_0_1_alone_does_not() {
        if !nix_root() {
            return;
        }
        let rt = rt();
        let every = std::net::TcpListener::bind("0.0.0.0:0").expect("bind");
        let port = every.local_addr().expect("addr").port();
        assert_eq!(
            rt.block_on(Probe::Tcp { port }.try_once(own_netns())),
            Ok(())
        );
        drop(every);
        let local = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = local.local_addr().expect("addr").port();
        let got = rt.block_on(Probe::Tcp { port }.try_once(own_netns()));
        assert!(
            got.as_ref()
                .is_err_and(|e| e.contains(&format!("port {port}"))),
            "{got:?}"
        );
    }

    #[test]
    fn an_http_check_wants_a_status_from_200_to_399() {
        if !nix_root() {
            return;
        }
        let rt = rt();
        let listener = std::net::TcpListener::bind("0.0.0.0:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            for status in ["204 No Content", "503 Service Unavailable"] {
                let Ok((mut c, _)) = listener.accept() else {
                    return;
                };
                let mut buf = [0u8; 1024];
                let _ = c.read(&mut buf);
                let _ = write!(c, "HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
            }
        });
        let check = Probe::Http {
            port,
            path: "/health".into(),
        };
        assert_eq!(rt.block_on(check.try_once(own_netns())), Ok(()));
        let got = rt.block_on(check.try_once(own_netns()));
        assert!(
            got.as_ref().is_err_and(|e| e.contains("HTTP 503")),
            "{got:?}"
        );
        let _ = server.join();
    }

    /// A handle on this process, whose namespace stands in for a sandbox's.
    fn own_netns() -> std::os::fd::OwnedFd {
        sbx_runtime::process::PidFd::open(std::process::id())
            .and_then(|p| p.try_clone_fd())
            .expect("pidfd")
    }

    fn nix_root() -> bool {
        std::fs::read_to_string("/proc/self/status")
            .map(|s| {
                s.lines()
                    .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
            })
            .unwrap_or(false)
    }
}
