//! The address a connection was first sent to, before the node's DNAT turned it to the
//! egress proxy (`SO_ORIGINAL_DST`, read from the connection's conntrack entry).

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsFd;

use nix::sys::socket::{getsockopt, sockopt};

/// The original destination of an accepted IPv4 TCP connection that the kernel redirected
/// (DNAT / REDIRECT) to this socket's listener. A connection that was not redirected gives its
/// own local address; a socket that is not IPv4 TCP, an error (`ENOPROTOOPT`, `ENOENT`).
pub fn original_dst(sock: &impl AsFd) -> std::io::Result<SocketAddrV4> {
    let sin = getsockopt(sock, sockopt::OriginalDst).map_err(std::io::Error::from)?;
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_redirected_is_the_local_address_or_an_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        // Without conntrack (no nf_conntrack loaded) the kernel answers ENOENT; with it, the
        // connection's own destination.
        match original_dst(&s) {
            Ok(a) => assert_eq!(std::net::SocketAddr::V4(a), l.local_addr().expect("addr")),
            Err(e) => assert!(e.raw_os_error().is_some(), "{e}"),
        }
        drop(c);
        let u = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
        assert!(original_dst(&u).is_err());
    }
}
