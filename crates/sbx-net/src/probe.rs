//! The node's [`Prober`]: the `ready.tcp` and `ready.http` checks tried from the host,
//! through a socket made in the sandbox's network namespace (sbx-runtime `netns`); an HTTP
//! check is one GET (hyper's client) whose status is 200 to 399.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::time::Duration;

use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use sbx_node::probe::{Probe, ProbeResult, Prober, PROBE_ADDR};

/// The checks tried over TCP and HTTP/1.1.
#[derive(Clone, Copy, Debug, Default)]
pub struct NetProber;

impl Prober for NetProber {
    fn try_once<'a>(
        &'a self,
        check: &'a Probe,
        ns: OwnedFd,
    ) -> Pin<Box<dyn Future<Output = ProbeResult> + Send + 'a>> {
        Box::pin(try_once(check, ns))
    }
}

/// Tries `check` once in the network namespace `ns` names.
pub async fn try_once(check: &Probe, ns: OwnedFd) -> ProbeResult {
    let port = check.port();
    let socket = tokio::task::spawn_blocking(move || {
        sbx_runtime::netns::in_netns_of_handle(ns, tokio::net::TcpSocket::new_v4)
    })
    .await
    .map_err(|e| format!("the probe's thread: {e}"))?
    .map_err(|e| format!("no socket in the sandbox's network: {e}"))?;
    let addr = std::net::SocketAddr::from((PROBE_ADDR, port));
    let stream = match tokio::time::timeout(Duration::from_secs(1), socket.connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(format!("tcp port {port}: {e}")),
        Err(_) => return Err(format!("tcp port {port}: no answer in 1 s")),
    };
    let Probe::Http { path, .. } = check else {
        return Ok(());
    };
    match tokio::time::timeout(Duration::from_secs(2), get(stream, port, path)).await {
        Ok(Ok(status)) if (200..400).contains(&status) => Ok(()),
        Ok(Ok(status)) => Err(format!("GET {path} on port {port}: HTTP {status}")),
        Ok(Err(e)) => Err(format!("GET {path} on port {port}: {e}")),
        Err(_) => Err(format!("GET {path} on port {port}: no answer in 2 s")),
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
            rt.block_on(try_once(&Probe::Tcp { port }, own_netns())),
            Ok(())
        );
        drop(every);
        let local = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = local.local_addr().expect("addr").port();
        let got = rt.block_on(try_once(&Probe::Tcp { port }, own_netns()));
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
        assert_eq!(rt.block_on(try_once(&check, own_netns())), Ok(()));
        let got = rt.block_on(try_once(&check, own_netns()));
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
