//! A sandbox's own egress rules in the node's table: objects of its slot `k`, made only for a
//! sandbox that has rules (one with none costs nothing more than its `live` element):
//!
//! ```text
//!   set x<k>   { type ipv4_addr; flags interval }     # the exceptions to its default
//!   set d<k>   { type inet_proto . inet_service }     # its deny_ports, TCP and UDP
//!   chain e<k> { meta l4proto . th dport @d<k> drop }             # from prerouting (@pre)
//!   chain n<k> {                                                  # from dnat (@nat)
//!     [names restricted: th dport 53 dnat to GW:53]               # any DNS server: the node's
//!     [proxied: tcp dport { 80, 443 } dnat to GW:PROXY] }
//!   chain p<k> {                                                  # from sandbox_out (@fwd)
//!     [names restricted: udp dport { 443, 853 } drop; tcp dport 853 drop]
//!     ip daddr @x<k> accept   (default deny: then drop)  |  ip daddr @x<k> drop
//!   }
//!   elements: pre[A] = jump e<k>, nat[A] = jump n<k>, fwd[A] = jump p<k>
//! ```
//!
//! Setting rules is one transaction (made if missing, flushed, filled), so a change holds at
//! once and whole; established connections are kept (they are accepted before any rule).
//! Removing them is one transaction as well, done at release with the rest.

use std::net::Ipv4Addr;

use netlink_packet_core::{DefaultNla, NLM_F_APPEND, NLM_F_CREATE};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainMessage, DataAttribute, ExpressionAttribute, Expressions, Immediate,
    ListAttribute, NfTablesMessage, Operator, Register, RuleAttribute, RuleMessage, SetAttribute,
    SetElementAttribute, SetElementList, SetElementMessage, SetMessage, Verdict, VerdictAttribute,
};

use super::nft::{
    accept, be32, chain, cmp, commit, drop_, elements, interval_keys, ip_daddr_in, lookup, meta,
    new_set, other, payload, port_key, rule, MAP_FWD, MAP_NAT, MAP_PRE,
};
use super::nl::Conn;
use super::{NetError, Proto};
use netlink_packet_netfilter::nftables::MetaKey;

/// What the kernel enforces for one sandbox (the node derives it from its egress rules).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxRules {
    /// Refuse every destination but `exceptions` (else allow every one but them).
    pub default_deny: bool,
    /// Ranges (first, last) whose verdict is not the default's.
    pub exceptions: Vec<(Ipv4Addr, Ipv4Addr)>,
    /// Ports refused to it, TCP and UDP, whatever else holds.
    pub deny_ports: Vec<u16>,
    /// Its TCP to ports 80 and 443 goes to the node's egress proxy.
    pub proxied: bool,
    /// Names are restricted: DNS is the node's alone (port 53 of any address is sent to the
    /// gateway's), and DNS over TLS (853) and QUIC (UDP 443) are refused.
    pub restrict_names: bool,
}

const TYPE_IPADDR: u32 = 7;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_BITS: u32 = 6;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
// The nat expression.
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
const NFT_NAT_DNAT: u32 = 1;
const NFPROTO_IPV4: u32 = 2;

fn names(slot: u32) -> [String; 5] {
    [
        format!("x{slot}"),
        format!("d{slot}"),
        format!("e{slot}"),
        format!("n{slot}"),
        format!("p{slot}"),
    ]
}

/// `meta l4proto P th dport N`.
fn proto_port(proto: Proto, port: u16) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        meta(MetaKey::L4Proto, Register::Reg1),
        cmp(Operator::Equal, Register::Reg1, vec![proto.number()]),
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, Register::Reg1),
        cmp(Operator::Equal, Register::Reg1, port.to_be_bytes().to_vec()),
    ]
}

fn dnat_to(gw: Ipv4Addr, port: u16) -> Vec<ListAttribute<ExpressionAttribute>> {
    let imm = |reg: Register, data: Vec<u8>| {
        ListAttribute::from(Expressions::Immediate(vec![
            Immediate::DestinationRegister(reg),
            Immediate::Data(DataAttribute::Value(data)),
        ]))
    };
    vec![
        imm(Register::Reg1, gw.octets().to_vec()),
        imm(Register::Reg2, port.to_be_bytes().to_vec()),
        other(
            "nat",
            vec![
                DefaultNla::new(NFTA_NAT_TYPE, be32(NFT_NAT_DNAT)),
                DefaultNla::new(NFTA_NAT_FAMILY, be32(NFPROTO_IPV4)),
                DefaultNla::new(NFTA_NAT_REG_ADDR_MIN, be32(Register::Reg1.into())),
                DefaultNla::new(NFTA_NAT_REG_PROTO_MIN, be32(Register::Reg2.into())),
            ],
        ),
    ]
}

fn flush_set(table: &str, set: &str) -> NfTablesMessage {
    NfTablesMessage::DeleteSetElement(SetElementMessage {
        attributes: vec![
            SetElementList::Table(table.to_string()),
            SetElementList::Set(set.to_string()),
        ],
    })
}

fn flush_chain(table: &str, chain: &str) -> NfTablesMessage {
    NfTablesMessage::DeleteRule(RuleMessage {
        attributes: vec![
            RuleAttribute::Table(table.to_string()),
            RuleAttribute::Chain(chain.to_string()),
        ],
    })
}

fn jump_element(table: &str, map: &str, addr: Ipv4Addr, chain: &str, add: bool) -> NfTablesMessage {
    let mut e = vec![SetElementAttribute::Key(DataAttribute::Value(
        addr.octets().to_vec(),
    ))];
    if add {
        e.push(SetElementAttribute::Data(DataAttribute::Verdict(vec![
            VerdictAttribute::Code(Verdict::Jump),
            VerdictAttribute::Chain(chain.to_string()),
        ])));
    }
    let m = SetElementMessage {
        attributes: vec![
            SetElementList::Table(table.to_string()),
            SetElementList::Set(map.to_string()),
            SetElementList::Elements(vec![ListAttribute::Element(e)]),
        ],
    };
    if add {
        NfTablesMessage::NewSetElement(m)
    } else {
        NfTablesMessage::DeleteSetElement(m)
    }
}

/// Sets slot `slot`'s (address `addr`) rules: one transaction.
pub(crate) fn apply(
    conn: &mut Conn,
    table: &str,
    slot: u32,
    addr: Ipv4Addr,
    gateway: Ipv4Addr,
    proxy_port: Option<u16>,
    r: &SandboxRules,
) -> Result<(), NetError> {
    let t = table;
    let c = NLM_F_CREATE;
    let [x, d, e, n, p] = names(slot);
    let id = 1000 + slot * 2;
    let mut m: Vec<(NfTablesMessage, u16)> = vec![
        (new_set(t, &x, id, TYPE_IPADDR, 4, true), c),
        (
            new_set(
                t,
                &d,
                id + 1,
                TYPE_INET_PROTOCOL << TYPE_BITS | TYPE_INET_SERVICE,
                8,
                false,
            ),
            c,
        ),
        (flush_set(t, &x), 0),
        (flush_set(t, &d), 0),
        (chain(t, &e), c),
        (chain(t, &n), c),
        (chain(t, &p), c),
        (flush_chain(t, &e), 0),
        (flush_chain(t, &n), 0),
        (flush_chain(t, &p), 0),
    ];
    let ranges: Vec<(u128, u128)> = r
        .exceptions
        .iter()
        .map(|(a, b)| (u128::from(u32::from(*a)), u128::from(u32::from(*b))))
        .collect();
    let xkeys = interval_keys(ranges, 4);
    if !xkeys.is_empty() {
        m.push((elements(t, &x, xkeys, true), c));
    }
    let dkeys: Vec<(Vec<u8>, bool)> = r
        .deny_ports
        .iter()
        .flat_map(|port| [(Proto::Tcp, *port), (Proto::Udp, *port)])
        .map(|(proto, port)| (port_key(proto, port), false))
        .collect();
    if !dkeys.is_empty() {
        m.push((elements(t, &d, dkeys, true), c));
    }
    let add = |m: &mut Vec<(NfTablesMessage, u16)>, ch: &str, exprs| {
        m.push((rule(t, ch, exprs), c | NLM_F_APPEND));
    };
    add(
        &mut m,
        &e,
        vec![vec![
            meta(MetaKey::L4Proto, Register::Reg1),
            payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, Register::Reg32_01),
            lookup(&d, Register::Reg1, false),
            drop_(),
        ]],
    );
    // DNS asked of any server goes to the node's, which answers by the rules.
    if r.restrict_names {
        for proto in [Proto::Udp, Proto::Tcp] {
            add(
                &mut m,
                &n,
                vec![proto_port(proto, 53), dnat_to(gateway, 53)],
            );
        }
    }
    if let (true, Some(port)) = (r.proxied, proxy_port) {
        for dport in [80, 443] {
            add(
                &mut m,
                &n,
                vec![proto_port(Proto::Tcp, dport), dnat_to(gateway, port)],
            );
        }
    }
    if r.restrict_names {
        for (proto, port) in [(Proto::Udp, 443), (Proto::Udp, 853), (Proto::Tcp, 853)] {
            add(&mut m, &p, vec![proto_port(proto, port), vec![drop_()]]);
        }
    }
    let verdict = if r.default_deny { accept() } else { drop_() };
    add(&mut m, &p, vec![ip_daddr_in(&x), vec![verdict]]);
    if r.default_deny {
        add(&mut m, &p, vec![vec![drop_()]]);
    }
    for (map, ch) in [(MAP_PRE, &e), (MAP_NAT, &n), (MAP_FWD, &p)] {
        m.push((jump_element(t, map, addr, ch, true), c));
    }
    commit(conn, &format!("set the egress rules of slot {slot}"), m)
}

/// Removes slot `slot`'s rules (missing ones are not an error).
pub(crate) fn remove(
    conn: &mut Conn,
    table: &str,
    slot: u32,
    addr: Ipv4Addr,
) -> Result<(), NetError> {
    let t = table;
    let [x, d, e, n, p] = names(slot);
    let mut m: Vec<(NfTablesMessage, u16)> = Vec::new();
    for map in [MAP_PRE, MAP_NAT, MAP_FWD] {
        m.push((jump_element(t, map, addr, "", false), 0));
    }
    for ch in [&e, &n, &p] {
        m.push((flush_chain(t, ch), 0));
        m.push((
            NfTablesMessage::DeleteChain(ChainMessage {
                attributes: vec![
                    ChainAttribute::Table(t.to_string()),
                    ChainAttribute::Name(ch.clone()),
                ],
            }),
            0,
        ));
    }
    for set in [&x, &d] {
        m.push((
            NfTablesMessage::DeleteSet(SetMessage {
                attributes: vec![
                    SetAttribute::Table(t.to_string()),
                    SetAttribute::Name(set.clone()),
                ],
            }),
            0,
        ));
    }
    match commit(conn, &format!("remove the egress rules of slot {slot}"), m) {
        Err(NetError::Netlink { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            Ok(())
        }
        r => r,
    }
}
