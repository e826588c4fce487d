//! Sockets of the node's services on the gateway address (its DNS, later its egress proxy):
//! bound with IP_FREEBIND, since the gateway is an address of the sandboxes' host-side veths
//! only, and there may be none yet when the node starts.

use std::net::{SocketAddrV4, TcpListener, UdpSocket};

use nix::sys::socket::{
    bind, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    SockaddrIn,
};

use super::NetError;

fn sys(what: &str) -> impl FnOnce(nix::Error) -> NetError + '_ {
    move |e| NetError::Io {
        what: what.to_string(),
        source: std::io::Error::from(e),
    }
}

/// A UDP socket and a TCP listener on `addr` (non-blocking, close-on-exec), bound whether or
/// not the address is on an interface yet.
pub fn bind_gateway(addr: SocketAddrV4) -> Result<(UdpSocket, TcpListener), NetError> {
    let flags = SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK;
    let sa = SockaddrIn::from(addr);
    let udp =
        socket(AddressFamily::Inet, SockType::Datagram, flags, None).map_err(sys("udp socket"))?;
    setsockopt(&udp, sockopt::IpFreebind, &true).map_err(sys("IP_FREEBIND"))?;
    setsockopt(&udp, sockopt::ReuseAddr, &true).map_err(sys("SO_REUSEADDR"))?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&udp), &sa).map_err(sys("bind udp"))?;
    let tcp =
        socket(AddressFamily::Inet, SockType::Stream, flags, None).map_err(sys("tcp socket"))?;
    setsockopt(&tcp, sockopt::IpFreebind, &true).map_err(sys("IP_FREEBIND"))?;
    setsockopt(&tcp, sockopt::ReuseAddr, &true).map_err(sys("SO_REUSEADDR"))?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&tcp), &sa).map_err(sys("bind tcp"))?;
    listen(&tcp, Backlog::new(128).map_err(sys("backlog"))?).map_err(sys("listen"))?;
    Ok((UdpSocket::from(udp), TcpListener::from(tcp)))
}
