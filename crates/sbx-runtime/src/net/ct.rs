//! Conntrack entries of the node's namespace, over ctnetlink.

use std::net::IpAddr;

use netlink_packet_core::DefaultNla;
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};

use super::nl::Conn;
use super::NetError;

const CTA_MARK_MASK: u16 = 21;

/// One conntrack entry, by its original direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtEntry {
    /// IP protocol number.
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub mark: u32,
    orig: Vec<Tuple>,
}

fn message(inner: ConntrackMessage) -> NetfilterMessage {
    // Version 0 with family AF_INET: dumps give IPv4 entries; a flush is not limited to a
    // family (ctnetlink reads the family of a flush only with version 1).
    NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::IPv4, 0, 0),
        inner,
    )
}

/// Deletes every entry whose mark is `mark`: one message, the kernel walks its table.
pub(crate) fn flush_mark(conn: &mut Conn, mark: u32) -> Result<(), NetError> {
    let m = message(ConntrackMessage::Delete(vec![
        ConntrackAttribute::CtaMark(mark),
        ConntrackAttribute::Other(DefaultNla::new(
            CTA_MARK_MASK,
            u32::MAX.to_be_bytes().to_vec(),
        )),
    ]));
    match conn.request("flush conntrack entries by mark", m, 0) {
        // Nothing matched.
        Err(NetError::Netlink { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        r => r,
    }
}

/// The IPv4 entries of the namespace.
pub(crate) fn list(conn: &mut Conn) -> Result<Vec<CtEntry>, NetError> {
    let replies = conn.dump(
        "list conntrack entries",
        message(ConntrackMessage::Get(vec![])),
    )?;
    let mut out = Vec::new();
    for r in replies {
        let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = r.inner else {
            continue;
        };
        let mut entry = CtEntry {
            proto: 0,
            src: IpAddr::from([0, 0, 0, 0]),
            dst: IpAddr::from([0, 0, 0, 0]),
            mark: 0,
            orig: Vec::new(),
        };
        for a in attrs {
            match a {
                ConntrackAttribute::CtaTupleOrig(tuple) => {
                    for t in &tuple {
                        match t {
                            Tuple::Ip(ips) => {
                                for ip in ips {
                                    match ip {
                                        IPTuple::SourceAddress(s) => entry.src = *s,
                                        IPTuple::DestinationAddress(d) => entry.dst = *d,
                                        _ => {}
                                    }
                                }
                            }
                            Tuple::Proto(ps) => {
                                for p in ps {
                                    if let ProtoTuple::Protocol(n) = p {
                                        entry.proto = (*n).into();
                                    }
                                }
                            }
                            _ => {}
                        }
                    }
                    entry.orig = tuple;
                }
                ConntrackAttribute::CtaMark(m) => entry.mark = m,
                _ => {}
            }
        }
        out.push(entry);
    }
    Ok(out)
}

/// Deletes one entry by its original tuple. One that is gone already is not an error.
pub(crate) fn delete(conn: &mut Conn, entry: &CtEntry) -> Result<(), NetError> {
    let m = message(ConntrackMessage::Delete(vec![
        ConntrackAttribute::CtaTupleOrig(entry.orig.clone()),
    ]));
    match conn.request("delete a conntrack entry", m, 0) {
        Err(NetError::Netlink { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        r => r,
    }
}
