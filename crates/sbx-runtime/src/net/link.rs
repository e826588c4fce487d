//! rtnetlink requests: links, addresses, routes.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoVeth, LinkAttribute,
    LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::nl::Conn;
use super::NetError;

/// Makes a veth pair: `host` in the namespace of `conn`, up, and `peer` made directly in the
/// namespace `peer_ns` (IFLA_NET_NS_FD in the peer's attributes: no move afterwards), down:
/// the kernel configures the peer before the pair is joined, when it cannot be opened yet
/// (ENOTCONN), so it is set up afterwards, from inside.
pub(crate) fn create_veth(
    conn: &mut Conn,
    host: &str,
    peer: &str,
    peer_ns: BorrowedFd<'_>,
) -> Result<(), NetError> {
    let mut peer_msg = LinkMessage::default();
    peer_msg.attributes = vec![
        LinkAttribute::IfName(peer.to_string()),
        LinkAttribute::NetNsFd(peer_ns.as_raw_fd()),
    ];
    let mut msg = LinkMessage::default();
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
    msg.attributes = vec![
        LinkAttribute::IfName(host.to_string()),
        LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg))),
        ]),
    ];
    conn.request(
        &format!("create veth {host}"),
        RouteNetlinkMessage::NewLink(msg),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}

/// Sets link `index` up.
pub(crate) fn set_up(conn: &mut Conn, index: u32) -> Result<(), NetError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
    conn.request(
        &format!("set link {index} up"),
        RouteNetlinkMessage::SetLink(msg),
        0,
    )
}

/// Sets link `index` down.
pub(crate) fn set_down(conn: &mut Conn, index: u32) -> Result<(), NetError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.header.change_mask = LinkFlags::Up;
    conn.request(
        &format!("set link {index} down"),
        RouteNetlinkMessage::SetLink(msg),
        0,
    )
}

/// Renames link `index` (it must be down).
pub(crate) fn rename(conn: &mut Conn, index: u32, name: &str) -> Result<(), NetError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.attributes = vec![LinkAttribute::IfName(name.to_string())];
    conn.request(
        &format!("rename link {index} to {name}"),
        RouteNetlinkMessage::SetLink(msg),
        0,
    )
}

/// Turns off IPv6 address generation on link `index` (no link-local address, so no DAD,
/// router solicitation or MLD from it). Before the link has a carrier: the kernel generates
/// the link-local address when it gets one.
pub(crate) fn no_ipv6_addresses(conn: &mut Conn, index: u32) -> Result<(), NetError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    msg.attributes = vec![LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
        vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
    )])];
    conn.request(
        &format!("no IPv6 addresses on link {index}"),
        RouteNetlinkMessage::SetLink(msg),
        0,
    )
}

/// Deletes link `index` (a veth: its peer too).
pub(crate) fn delete(conn: &mut Conn, index: u32) -> Result<(), NetError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    conn.request(
        &format!("delete link {index}"),
        RouteNetlinkMessage::DelLink(msg),
        0,
    )
}

/// The index of the link named `name`, if there is one.
pub(crate) fn index_of(conn: &mut Conn, name: &str) -> Result<Option<u32>, NetError> {
    let mut msg = LinkMessage::default();
    msg.attributes = vec![LinkAttribute::IfName(name.to_string())];
    match conn.get(
        &format!("find link {name}"),
        RouteNetlinkMessage::GetLink(msg),
    ) {
        Ok(replies) => Ok(replies.into_iter().find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(l.header.index),
            _ => None,
        })),
        Err(NetError::Netlink { source, .. }) if source.raw_os_error() == Some(libc::ENODEV) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Every link: (index, name).
pub(crate) fn list(conn: &mut Conn) -> Result<Vec<(u32, String)>, NetError> {
    let replies = conn.dump(
        "list links",
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
    )?;
    Ok(replies
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => {
                let name = l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                })?;
                Some((l.header.index, name))
            }
            _ => None,
        })
        .collect())
}

/// Adds `local`/32 to link `index`, point-to-point with `peer` (the kernel adds the route
/// to `peer` through the link, with `local` as its source).
pub(crate) fn add_p2p_address(
    conn: &mut Conn,
    index: u32,
    local: Ipv4Addr,
    peer: Ipv4Addr,
) -> Result<(), NetError> {
    let mut msg = AddressMessage::default();
    msg.header.family = AddressFamily::Inet;
    msg.header.prefix_len = 32;
    msg.header.index = index;
    msg.attributes = vec![
        AddressAttribute::Local(IpAddr::V4(local)),
        AddressAttribute::Address(IpAddr::V4(peer)),
    ];
    conn.request(
        &format!("add address {local} peer {peer} to link {index}"),
        RouteNetlinkMessage::NewAddress(msg),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}

/// Adds `local`/`prefix_len` to link `index` (a plain address with its subnet route).
#[cfg(test)]
pub(crate) fn add_address(
    conn: &mut Conn,
    index: u32,
    local: Ipv4Addr,
    prefix_len: u8,
) -> Result<(), NetError> {
    let mut msg = AddressMessage::default();
    msg.header.family = AddressFamily::Inet;
    msg.header.prefix_len = prefix_len;
    msg.header.index = index;
    msg.attributes = vec![
        AddressAttribute::Local(IpAddr::V4(local)),
        AddressAttribute::Address(IpAddr::V4(local)),
    ];
    conn.request(
        &format!("add address {local}/{prefix_len} to link {index}"),
        RouteNetlinkMessage::NewAddress(msg),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}

/// The IPv4 addresses (local) of link `index`.
pub(crate) fn addresses(conn: &mut Conn, index: u32) -> Result<Vec<Ipv4Addr>, NetError> {
    let mut req = AddressMessage::default();
    req.header.family = AddressFamily::Inet;
    let replies = conn.dump("list addresses", RouteNetlinkMessage::GetAddress(req))?;
    Ok(replies
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a) if a.header.index == index => {
                a.attributes.iter().find_map(|at| match at {
                    AddressAttribute::Local(IpAddr::V4(v4)) => Some(*v4),
                    _ => None,
                })
            }
            _ => None,
        })
        .collect())
}

/// Adds a route to `dest`/`prefix_len` through `gateway` (on-link) over link `index`;
/// `0.0.0.0/0` is the default route.
pub(crate) fn add_route(
    conn: &mut Conn,
    dest: Ipv4Addr,
    prefix_len: u8,
    gateway: Ipv4Addr,
    index: u32,
) -> Result<(), NetError> {
    let mut msg = RouteMessage::default();
    msg.header.address_family = AddressFamily::Inet;
    msg.header.destination_prefix_length = prefix_len;
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::Static;
    msg.header.scope = RouteScope::Universe;
    msg.header.kind = RouteType::Unicast;
    msg.attributes = vec![
        RouteAttribute::Gateway(RouteAddress::Inet(gateway)),
        RouteAttribute::Oif(index),
    ];
    if prefix_len > 0 {
        msg.attributes
            .push(RouteAttribute::Destination(RouteAddress::Inet(dest)));
    }
    conn.request(
        &format!("add route {dest}/{prefix_len} via {gateway}"),
        RouteNetlinkMessage::NewRoute(msg),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}
