//! The node's DNS for its sandboxes: a forwarder on the gateway address (UDP and TCP, port
//! 53) that their /etc/resolv.conf names. Each question goes to the node's upstream servers
//! (`--dns-upstream`, else the host's /etc/resolv.conf) from the host, so a sandbox resolves
//! names though every private range (where a host's resolver usually is) is refused to it.
//! The answer goes back as it came. A sandbox whose egress rules refuse the name asked gets
//! NXDOMAIN from the node itself, and nothing is asked upstream.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::net::Policies;

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
pub fn serve(
    udp: UdpSocket,
    tcp: TcpListener,
    upstreams: Vec<SocketAddr>,
    policies: Arc<Policies>,
) -> std::io::Result<()> {
    let upstreams = Arc::new(upstreams);
    let udp = Arc::new(tokio::net::UdpSocket::from_std(udp)?);
    let tcp = tokio::net::TcpListener::from_std(tcp)?;
    tokio::spawn(serve_udp(udp, upstreams.clone(), policies.clone()));
    tokio::spawn(serve_tcp(tcp, upstreams, policies));
    Ok(())
}

/// The name a question asks about (lower-case, no trailing dot), and where the question
/// section ends; `None` for a message that is not one plain question.
fn question_name(msg: &[u8]) -> Option<(String, usize)> {
    if msg.len() < 12 || msg[4..6] != [0, 1] {
        return None;
    }
    let mut at = 12;
    let mut name = String::new();
    loop {
        let len = usize::from(*msg.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        // A compression pointer has no place in a question.
        if len > 63 {
            return None;
        }
        let label = msg.get(at..at + len)?;
        if !name.is_empty() {
            name.push('.');
        }
        name.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
        at += len;
    }
    let end = at + 4;
    (end <= msg.len()).then_some((name, end))
}

/// NXDOMAIN for `question` (its header and question, nothing else).
fn nxdomain(question: &[u8], end: usize) -> Vec<u8> {
    let mut a = question[..end].to_vec();
    a[2] = 0x80 | (question[2] & 0x79); // QR, the opcode and RD asked
    a[3] = 0x80 | 3; // RA, NXDOMAIN
    a[6..12].fill(0);
    a
}

/// The node's own answer where the sandbox at `from` may not have the name resolved.
fn refusal(question: &[u8], from: std::net::IpAddr, policies: &Policies) -> Option<Vec<u8>> {
    let (name, end) = question_name(question)?;
    (!policies.name_allowed(from, &name)).then(|| nxdomain(question, end))
}

async fn serve_udp(
    sock: Arc<tokio::net::UdpSocket>,
    upstreams: Arc<Vec<SocketAddr>>,
    policies: Arc<Policies>,
) {
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
        if let Some(no) = refusal(&question, from.ip(), &policies) {
            let _ = sock.send_to(&no, from).await;
            continue;
        }
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

async fn serve_tcp(
    listener: tokio::net::TcpListener,
    upstreams: Arc<Vec<SocketAddr>>,
    policies: Arc<Policies>,
) {
    loop {
        let Ok((conn, from)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (upstreams, policies) = (upstreams.clone(), policies.clone());
        tokio::spawn(async move {
            let session = tcp_session(conn, from.ip(), &upstreams, &policies);
            let _ = tokio::time::timeout(Duration::from_secs(30), session).await;
        });
    }
}

/// Questions over one TCP connection (each a 2-byte length and the message), each asked of
/// the upstream servers over TCP.
async fn tcp_session(
    mut conn: tokio::net::TcpStream,
    from: std::net::IpAddr,
    upstreams: &[SocketAddr],
    policies: &Policies,
) -> std::io::Result<()> {
    loop {
        let len = match conn.read_u16().await {
            Ok(l) => usize::from(l),
            Err(_) => return Ok(()),
        };
        let mut question = vec![0u8; len];
        conn.read_exact(&mut question).await?;
        let answer = match refusal(&question, from, policies) {
            Some(no) => no,
            None => match ask_tcp(&question, upstreams).await {
                Some(a) => a,
                None => return Ok(()),
            },
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
    fn a_question_s_name_and_its_nxdomain() {
        let q: Vec<u8> = [
            0x12, 0x34, 0x01, 0x20, 0, 1, 0, 0, 0, 0, 0, 1, 3, b'A', b'b', b'c', 2, b'i', b'o', 0,
            0, 1, 0, 1, 0, 0, 41, 16, 0, 0, 0, 0, 0, 0, 0,
        ]
        .to_vec();
        let (name, end) = question_name(&q).unwrap();
        assert_eq!((name.as_str(), end), ("abc.io", 24));
        let a = nxdomain(&q, end);
        assert_eq!(a.len(), 24);
        assert_eq!(&a[..2], &[0x12, 0x34]);
        assert_eq!(a[2], 0x81, "QR and RD");
        assert_eq!(a[3] & 0x0f, 3, "NXDOMAIN");
        assert_eq!(&a[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert!(question_name(&q[..20]).is_none(), "cut short");
    }

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
        serve(udp, tcp, upstreams, Arc::new(Policies::default())).unwrap();

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
