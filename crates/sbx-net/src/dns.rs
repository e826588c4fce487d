//! The node's DNS for its sandboxes: a forwarder on the gateway address (UDP and TCP, port
//! 53) that their /etc/resolv.conf names. Each question goes to the node's upstream servers
//! (`--dns-upstream`, else the host's /etc/resolv.conf) from the host, so a sandbox resolves
//! names though every private range (where a host's resolver usually is) is refused to it.
//! The answer goes back as it came. A sandbox whose egress rules refuse the name asked gets
//! NXDOMAIN from the node itself, and nothing is asked upstream.
//!
//! One sandbox cannot take what the others need ([`DnsLimits`]): questions over UDP in flight
//! (waiting for an upstream) are counted per sandbox and for all; one past either is answered
//! SERVFAIL at once, and the loop that reads questions never waits. TCP connections are
//! counted the same way (one past is closed at once); an idle one is closed after a few
//! seconds (RFC 7766), a whole session after 30 s.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use sbx_node::node::net::DnsLimits;
use sbx_node::node::net::Policies;

use crate::egress::share::Shares;

/// How long an upstream server has to answer before the next is asked.
const UPSTREAM_WAIT: Duration = Duration::from_secs(2);
/// The largest DNS message over UDP that is forwarded (EDNS0 allows up to 4096 in practice).
const MAX_UDP: usize = 4096;
/// How long a TCP session lasts at most.
const TCP_SESSION: Duration = Duration::from_secs(30);

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
    limits: DnsLimits,
) -> std::io::Result<()> {
    let upstreams = Arc::new(upstreams);
    let udp = Arc::new(tokio::net::UdpSocket::from_std(udp)?);
    let tcp = tokio::net::TcpListener::from_std(tcp)?;
    let in_flight = Shares::new(limits.udp_per_sandbox, limits.udp_total);
    let conns = Shares::new(limits.tcp_per_sandbox, limits.tcp_total);
    tokio::spawn(serve_udp(
        udp,
        upstreams.clone(),
        policies.clone(),
        in_flight,
    ));
    tokio::spawn(serve_tcp(tcp, upstreams, policies, conns, limits.tcp_idle));
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

/// SERVFAIL for `question` (its header and question, as resolvers match an answer to what
/// they asked; the header alone for a message that is not one plain question): what a
/// sandbox past its share is told at once.
fn servfail(question: &[u8]) -> Option<Vec<u8>> {
    if question.len() < 12 {
        return None;
    }
    let mut a = match question_name(question) {
        Some((_, end)) => {
            let mut a = question[..end].to_vec();
            a[6..12].fill(0);
            a
        }
        None => {
            let mut a = question[..12].to_vec();
            a[4..12].fill(0);
            a
        }
    };
    a[2] = 0x80 | (question[2] & 0x79);
    a[3] = 0x80 | 2; // RA, SERVFAIL
    Some(a)
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
    in_flight: Arc<Shares>,
) {
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
        let question = buf[..n].to_vec();
        if let Some(no) = refusal(&question, from.ip(), &policies) {
            let _ = sock.send_to(&no, from).await;
            continue;
        }
        // Past the sandbox's share (or everybody's): SERVFAIL now; the next question, maybe
        // another sandbox's, is read at once.
        let Some(permit) = in_flight.take(from.ip()) else {
            if let Some(no) = servfail(&question) {
                let _ = sock.try_send_to(&no, from);
            }
            continue;
        };
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
    conns: Arc<Shares>,
    idle: Duration,
) {
    loop {
        let Ok((conn, from)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        // Past the sandbox's share (or everybody's): closed now.
        let Some(share) = conns.take(from.ip()) else {
            tracing::debug!(%from, "dns: the sandbox's share of TCP connections is full, closed");
            drop(conn);
            continue;
        };
        let (upstreams, policies) = (upstreams.clone(), policies.clone());
        tokio::spawn(async move {
            let session = tcp_session(conn, from.ip(), &upstreams, &policies, idle);
            let _ = tokio::time::timeout(TCP_SESSION, session).await;
            drop(share);
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
    idle: Duration,
) -> std::io::Result<()> {
    loop {
        // A whole question within `idle`, or the connection is closed.
        let read = async {
            let len = usize::from(conn.read_u16().await?);
            let mut question = vec![0u8; len];
            conn.read_exact(&mut question).await?;
            Ok::<_, std::io::Error>(question)
        };
        let question = match tokio::time::timeout(idle, read).await {
            Ok(Ok(q)) => q,
            Ok(Err(_)) | Err(_) => return Ok(()),
        };
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
        let f = servfail(&q).unwrap();
        assert_eq!(&f[..2], &[0x12, 0x34]);
        assert_eq!((f[2], f[3] & 0x0f), (0x81, 2), "QR, RD and SERVFAIL");
        assert_eq!(
            &f[4..12],
            &[0, 1, 0, 0, 0, 0, 0, 0],
            "the question, nothing else"
        );
        assert_eq!(&f[12..], &q[12..24]);
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
        // (A UDP port whose TCP twin is free: another test may hold that one.)
        let (up_udp, up_tcp, port) = loop {
            let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
            let port = udp.local_addr().unwrap().port();
            if let Ok(tcp) = TcpListener::bind(("127.0.0.1", port)) {
                break (udp, tcp, port);
            }
        };
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
        let limits = DnsLimits::default();
        serve(udp, tcp, upstreams, Arc::new(Policies::default()), limits).unwrap();

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

    /// A question for `name` with id `id`.
    fn question(id: u16, name: &str) -> Vec<u8> {
        let mut q = id.to_be_bytes().to_vec();
        q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        q
    }

    /// One sandbox asking without end of a name whose server never answers takes its share
    /// of questions in flight, then gets SERVFAIL at once; another sandbox's questions are
    /// answered meanwhile. Its TCP connections past its share are closed, and an idle one
    /// after the idle time.
    #[tokio::test]
    async fn one_sandbox_cannot_take_the_dns_of_the_others() {
        // The upstream: answers every name but those under slow.test, which it drops.
        let up = UdpSocket::bind("127.0.0.1:0").unwrap();
        let up_at = up.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut b = [0u8; 512];
            while let Ok((n, from)) = up.recv_from(&mut b) {
                let slow = question_name(&b[..n]).is_some_and(|(q, _)| q.ends_with("slow.test"));
                if !slow {
                    b[2] |= 0x80;
                    let _ = up.send_to(&b[..n], from);
                }
            }
        });
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = udp.local_addr().unwrap();
        let tcp = TcpListener::bind(at).unwrap();
        udp.set_nonblocking(true).unwrap();
        tcp.set_nonblocking(true).unwrap();
        let limits = DnsLimits {
            udp_per_sandbox: 4,
            tcp_per_sandbox: 2,
            tcp_idle: Duration::from_millis(300),
            ..DnsLimits::default()
        };
        serve(udp, tcp, vec![up_at], Arc::new(Policies::default()), limits).unwrap();

        // The first sandbox (127.0.0.1) asks for slow names without end.
        let a = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let flood = {
            let a = a.clone();
            tokio::spawn(async move {
                for i in 0u32.. {
                    let q = question((i % 60000) as u16, &format!("n{i}.slow.test"));
                    if a.send_to(&q, at).await.is_err() {
                        return;
                    }
                    if i % 64 == 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            })
        };
        // It is told SERVFAIL.
        let mut b = [0u8; 512];
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), a.recv_from(&mut b))
            .await
            .expect("an answer past its share")
            .unwrap();
        assert!(n >= 12);
        assert_eq!(b[3] & 0x0f, 2, "SERVFAIL");
        // Another sandbox (127.0.0.4) is answered.
        let other = tokio::net::UdpSocket::bind("127.0.0.4:0").await.unwrap();
        other.send_to(&question(7, "fast.test"), at).await.unwrap();
        let (n, _) = tokio::time::timeout(Duration::from_secs(5), other.recv_from(&mut b))
            .await
            .expect("another sandbox's question answered while the first floods")
            .unwrap();
        assert_eq!(&b[..2], &7u16.to_be_bytes());
        assert_eq!(b[3] & 0x0f, 0);
        assert!(n > 12);
        flood.abort();

        // TCP: two connections held; a third is closed at once, before it asks anything.
        let c1 = tokio::net::TcpStream::connect(at).await.unwrap();
        let c2 = tokio::net::TcpStream::connect(at).await.unwrap();
        let mut c3 = tokio::net::TcpStream::connect(at).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), c3.read(&mut b))
            .await
            .expect("closed at once");
        assert!(matches!(got, Ok(0) | Err(_)));
        // Idle ones are closed after the idle time.
        for mut c in [c1, c2] {
            let got = tokio::time::timeout(Duration::from_secs(5), c.read(&mut b))
                .await
                .expect("an idle connection closed");
            assert!(matches!(got, Ok(0) | Err(_)));
        }
    }
}
