//! The node's DNS for its sandboxes: a forwarder on the gateway address (UDP and TCP, port
//! 53) that their /etc/resolv.conf names. Each question goes to the node's upstream servers
//! (`--dns-upstream`, else the host's /etc/resolv.conf) from the host, so a sandbox resolves
//! names though every private range (where a host's resolver usually is) is refused to it.
//! The answer goes back as it came. (Name rules, egress.allow/deny by name, are decided here
//! once they exist: the question is in the first bytes of the message.)

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long an upstream server has to answer before the next is asked.
const UPSTREAM_WAIT: Duration = Duration::from_secs(2);
/// The largest DNS message over UDP that is forwarded (EDNS0 allows up to 4096 in practice).
const MAX_UDP: usize = 4096;
/// Questions forwarded at once over UDP; more wait (a sandbox cannot open sockets on the host
/// without bound).
const MAX_IN_FLIGHT: usize = 256;

/// The upstream servers of the host's /etc/resolv.conf (port 53).
pub fn host_upstreams() -> Vec<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    parse_resolv_conf(&text)
}

fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver"))
                .then(|| w.next())
                .flatten()
                .and_then(|a| a.parse::<std::net::IpAddr>().ok())
                .map(|ip| SocketAddr::new(ip, 53))
        })
        .collect()
}

/// Serves the sandboxes' questions on `udp` and `tcp` (bound on the gateway) until the
/// runtime ends.
pub fn serve(udp: UdpSocket, tcp: TcpListener, upstreams: Vec<SocketAddr>) -> std::io::Result<()> {
    let upstreams = Arc::new(upstreams);
    let udp = Arc::new(tokio::net::UdpSocket::from_std(udp)?);
    let tcp = tokio::net::TcpListener::from_std(tcp)?;
    tokio::spawn(serve_udp(udp, upstreams.clone()));
    tokio::spawn(serve_tcp(tcp, upstreams));
    Ok(())
}

async fn serve_udp(sock: Arc<tokio::net::UdpSocket>, upstreams: Arc<Vec<SocketAddr>>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let mut buf = vec![0u8; MAX_UDP];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "dns: receive");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let question = buf[..n].to_vec();
        let (sock, upstreams) = (sock.clone(), upstreams.clone());
        tokio::spawn(async move {
            if let Some(answer) = ask_udp(&question, &upstreams).await {
                let _ = sock.send_to(&answer, from).await;
            }
            drop(permit);
        });
    }
}

/// The first answer of an upstream server to `question` over UDP, each tried in turn.
async fn ask_udp(question: &[u8], upstreams: &[SocketAddr]) -> Option<Vec<u8>> {
    if question.len() < 12 {
        return None;
    }
    for up in upstreams {
        let local: SocketAddr = if up.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let Ok(s) = tokio::net::UdpSocket::bind(local).await else {
            continue;
        };
        if s.connect(up).await.is_err() || s.send(question).await.is_err() {
            continue;
        }
        let mut buf = vec![0u8; MAX_UDP];
        // The answer to this question: its id, the first two bytes.
        let got = tokio::time::timeout(UPSTREAM_WAIT, async {
            loop {
                let n = s.recv(&mut buf).await.ok()?;
                if n >= 12 && buf[..2] == question[..2] {
                    return Some(n);
                }
            }
        })
        .await;
        if let Ok(Some(n)) = got {
            buf.truncate(n);
            return Some(buf);
        }
    }
    None
}

async fn serve_tcp(listener: tokio::net::TcpListener, upstreams: Arc<Vec<SocketAddr>>) {
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let upstreams = upstreams.clone();
        tokio::spawn(async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(30), tcp_session(conn, &upstreams)).await;
        });
    }
}

/// Questions over one TCP connection (each a 2-byte length and the message), each asked of
/// the upstream servers over TCP.
async fn tcp_session(
    mut conn: tokio::net::TcpStream,
    upstreams: &[SocketAddr],
) -> std::io::Result<()> {
    loop {
        let len = match conn.read_u16().await {
            Ok(l) => usize::from(l),
            Err(_) => return Ok(()),
        };
        let mut question = vec![0u8; len];
        conn.read_exact(&mut question).await?;
        let Some(answer) = ask_tcp(&question, upstreams).await else {
            return Ok(());
        };
        let len = u16::try_from(answer.len()).unwrap_or(u16::MAX);
        conn.write_u16(len).await?;
        conn.write_all(&answer[..usize::from(len)]).await?;
    }
}

async fn ask_tcp(question: &[u8], upstreams: &[SocketAddr]) -> Option<Vec<u8>> {
    let len = u16::try_from(question.len()).ok()?;
    for up in upstreams {
        let asked = tokio::time::timeout(UPSTREAM_WAIT, async {
            let mut s = tokio::net::TcpStream::connect(up).await.ok()?;
            s.write_u16(len).await.ok()?;
            s.write_all(question).await.ok()?;
            let n = usize::from(s.read_u16().await.ok()?);
            let mut answer = vec![0u8; n];
            s.read_exact(&mut answer).await.ok()?;
            Some(answer)
        })
        .await;
        if let Ok(Some(a)) = asked {
            return Some(a);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nameservers_of_a_resolv_conf() {
        let got = parse_resolv_conf(
            "# comment\nnameserver 10.0.0.2\nsearch x\nnameserver ::1\nnameserver bad\n",
        );
        assert_eq!(
            got,
            vec![
                "10.0.0.2:53".parse::<SocketAddr>().unwrap(),
                "[::1]:53".parse().unwrap()
            ]
        );
    }

    /// A question over UDP and over TCP reaches a server (played on loopback) and its answer
    /// comes back whole, with the question's id.
    #[tokio::test]
    async fn questions_are_forwarded_and_answers_come_back() {
        // The upstream: answers each message with itself, its QR bit set.
        let up_udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = up_udp.local_addr().unwrap().port();
        let up_tcp = TcpListener::bind(("127.0.0.1", port)).unwrap();
        std::thread::spawn(move || {
            let mut b = [0u8; 512];
            while let Ok((n, from)) = up_udp.recv_from(&mut b) {
                b[2] |= 0x80;
                let _ = up_udp.send_to(&b[..n], from);
            }
        });
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for c in up_tcp.incoming() {
                let Ok(mut c) = c else { return };
                let mut l = [0u8; 2];
                if c.read_exact(&mut l).is_err() {
                    continue;
                }
                let mut m = vec![0u8; usize::from(u16::from_be_bytes(l))];
                let _ = c.read_exact(&mut m);
                m[2] |= 0x80;
                let _ = c.write_all(&l);
                let _ = c.write_all(&m);
            }
        });
        let upstreams = vec![SocketAddr::from(([127, 0, 0, 1], port))];
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = udp.local_addr().unwrap();
        let tcp = TcpListener::bind(at).unwrap();
        udp.set_nonblocking(true).unwrap();
        tcp.set_nonblocking(true).unwrap();
        serve(udp, tcp, upstreams).unwrap();

        let q: Vec<u8> = [
            0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 3, b'a', b'b', b'c', 0, 0, 1, 0, 1,
        ]
        .to_vec();
        let c = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.send_to(&q, at).await.unwrap();
        let mut b = [0u8; 512];
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), c.recv_from(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b[..2], &q[..2]);
        assert_eq!(b[2], q[2] | 0x80);
        assert_eq!(n, q.len());

        let mut t = tokio::net::TcpStream::connect(at).await.unwrap();
        t.write_u16(q.len() as u16).await.unwrap();
        t.write_all(&q).await.unwrap();
        let n = usize::from(t.read_u16().await.unwrap());
        let mut a = vec![0u8; n];
        t.read_exact(&mut a).await.unwrap();
        assert_eq!(&a[..2], &q[..2]);
        assert_eq!(a[2], q[2] | 0x80);
    }
}
