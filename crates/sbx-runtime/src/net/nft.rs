//! The node's nftables table, spoken over netlink (nf_tables messages in nfnetlink batches).
//!
//! The table is loaded once, at [`super::Network::new`], in one transaction that replaces a
//! table of the same name (so a restarted node gets the current rules with no moment without
//! them). Per-sandbox data are elements of the set `live` (`host ifname . sandbox address`),
//! added when a namespace is leased and removed when it is released: one batch of one
//! message each.
//!
//! The table, written as nft would print it (P: the node's interface prefix, GW: the gateway):
//!
//! ```text
//! table inet T {
//!   set live      { type ifname . ipv4_addr }           # leased sandboxes: host veth . address
//!   set ports     { type inet_proto . inet_service }    # what sandboxes may reach on GW
//!   set refused4  { type ipv4_addr; flags interval }    # 0/8 10/8 100.64/10 127/8 169.254/16
//!                                                        # 172.16/12 192.168/16 224/3 + extra
//!   set allowed4  { type ipv4_addr; flags interval }    # the operator's allow-list
//!   set refused6  { type ipv6_addr; flags interval }    # ::/127 ::ffff:0:0/96 fc00::/7
//!                                                        # fe80::/10 ff00::/8
//!   set ctcount   { type ipv4_addr; flags dynamic }     # conntrack entries per sandbox
//!   chain prerouting { type filter hook prerouting priority mangle;
//!     iifname "P*" meta nfproto ipv4 iifname . ip saddr != @live drop   # not leased, spoofed
//!     iifname "P*" meta nfproto ipv4 ct state new
//!       add @ctcount { ip saddr ct count over N } drop                  # its share is full
//!     iifname "P*" meta nfproto ipv4 ct mark set ip saddr }             # conntrack: whose
//!   chain output { type filter hook output priority mangle;
//!     oifname "P*" meta nfproto ipv4 ct mark set ip daddr
//!     oifname "P*" meta nfproto ipv4 oifname . ip daddr != @live drop }  # not live: held
//!   chain input { type filter hook input priority filter;
//!     iifname "P*" jump sandbox_in }
//!   chain sandbox_in {
//!     ct state established,related accept
//!     meta nfproto ipv4 ip daddr GW meta l4proto . th dport @ports accept
//!     drop }                                            # the host's own addresses
//!   chain forward { type filter hook forward priority filter;
//!     iifname "P*" jump sandbox_out
//!     oifname "P*" jump sandbox_back }
//!   chain sandbox_out {
//!     oifname "P*" drop                                 # another sandbox
//!     ct state established,related accept
//!     meta nfproto ipv4 ip daddr RANGE drop             # the node's range, whatever is allowed
//!     meta nfproto ipv4 ip daddr @allowed4 accept
//!     meta nfproto ipv4 ip daddr @refused4 drop
//!     meta nfproto ipv6 ip6 daddr @refused6 drop
//!     meta nfproto ipv6 drop                            # IPv6 is not routed
//!     accept }
//!   chain sandbox_back {                                # into a sandbox from elsewhere
//!     oifname "P*" meta nfproto ipv4 oifname . ip daddr != @live drop
//!     ct state established,related accept
//!     drop }
//!   chain postrouting { type nat hook postrouting priority srcnat;
//!     iifname "P*" masquerade }
//! }
//! ```
//!
//! `ctcount` bounds the connections a sandbox has in the host's conntrack table, which the
//! host and every node share (N: `Ruleset::ct_limit`; no rule where it is 0): a new one past
//! N is dropped before it is confirmed, so it never takes a place in the table. Its own
//! connections to the gateway (the node's DNS, its proxy) count too.
//!
//! The conntrack mark of a sandbox's connections is its address (the 4 bytes as the kernel
//! keeps a u32: [`ct_mark`]), so releasing a sandbox flushes its entries with one message
//! (`super::ct::flush_mark`), and later per-sandbox rules can tell connections apart by mark as
//! well as by `iifname` or `ip saddr`.

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use netlink_packet_core::{DefaultNla, NLM_F_APPEND, NLM_F_CREATE};
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, ChainMessage, Cmp, DataAttribute, ExpressionAttribute, Expressions,
    Hook, HookNumber, Immediate, InetHookNumber, ListAttribute, Lookup, Meta, MetaKey,
    NfTablesMessage, Operator, Payload, Register, RuleAttribute, RuleMessage, SetAttribute,
    SetElementAttribute, SetElementFlags, SetElementList, SetElementMessage, SetFlags, SetMessage,
    TableAttribute, TableMessage, Verdict, VerdictAttribute,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

use super::nl::Conn;
use super::{NetError, Proto};

const NFNL_SUBSYS_NFTABLES: u16 = 10;

// Verdicts (linux/netfilter.h).
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
// nft's data types, for `nft list` to print the sets (the kernel does not read them).
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const TYPE_IFNAME: u32 = 41;
const TYPE_BITS: u32 = 6;
// Payload bases.
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
// Protocol families as `meta nfproto` loads them.
const NFPROTO_IPV4: u8 = 2;
const NFPROTO_IPV6: u8 = 10;
// The ct expression.
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFTA_CT_SREG: u16 = 4;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_MARK: u32 = 3;
const CT_STATE_NEW: u32 = 1 << 3;
const CT_STATE_ESTABLISHED: u32 = 1 << 1;
const CT_STATE_RELATED: u32 = 1 << 2;
const NFT_LOOKUP_F_INV: u32 = 1;
// Chain priorities.
const PRIO_MANGLE: i32 = -150;
const PRIO_FILTER: i32 = 0;
const PRIO_SRCNAT: i32 = 100;

/// IFNAMSIZ: how `meta iifname` loads a name (zero-padded).
const IFNAMSIZ: usize = 16;

pub(crate) const SET_LIVE: &str = "live";
const SET_PORTS: &str = "ports";
const SET_REFUSED4: &str = "refused4";
const SET_ALLOWED4: &str = "allowed4";
const SET_REFUSED6: &str = "refused6";
const SET_CTCOUNT: &str = "ctcount";
/// NFT_SET_EVAL: a set whose elements the rules add (`flags dynamic`).
const SET_F_EVAL: u32 = 0x20;
// The dynset expression (`add @set { key expr }`) and its connlimit.
const NFTA_DYNSET_SET_NAME: u16 = 1;
const NFTA_DYNSET_OP: u16 = 3;
const NFTA_DYNSET_SREG_KEY: u16 = 4;
const NFTA_DYNSET_EXPR: u16 = 7;
const NFT_DYNSET_OP_ADD: u32 = 0;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_CONNLIMIT_COUNT: u16 = 1;
const NFTA_CONNLIMIT_FLAGS: u16 = 2;
/// `ct count over N` (not `ct count N`).
const NFT_CONNLIMIT_F_INV: u32 = 1;
/// Verdict maps: a sandbox with rules of its own (address -> jump to its chains, [`super::policy`]).
pub(super) const MAP_FWD: &str = "fwd";
pub(super) const MAP_PRE: &str = "pre";
pub(super) const MAP_NAT: &str = "nat";
/// NFT_DATA_VERDICT: a map's data type for verdicts.
const DATA_VERDICT: u32 = 0xffff_ff00;
const PRIO_DSTNAT: i32 = -100;

/// What the table is made from.
#[derive(Debug, Clone)]
pub(crate) struct Ruleset {
    pub table: String,
    pub prefix: String,
    pub gateway: Ipv4Addr,
    pub range: Ipv4Net,
    pub ports: Vec<(Proto, u16)>,
    pub refused4: Vec<Ipv4Net>,
    pub allowed4: Vec<Ipv4Net>,
    pub refused6: Vec<Ipv6Net>,
    /// The most conntrack entries a sandbox has at once; 0: no limit.
    pub ct_limit: u32,
}

/// The conntrack mark of a sandbox's connections: its address's 4 bytes, read as the kernel
/// reads a register (native order), which is what `ct mark set ip saddr` stores.
pub(crate) fn ct_mark(addr: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(addr.octets())
}

pub(super) fn msg(inner: NfTablesMessage) -> NetfilterMessage {
    NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::Inet, 0, 0),
        inner,
    )
}

fn batch_control(inner: ControlMessage) -> NetfilterMessage {
    NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::Unspec, 0, NFNL_SUBSYS_NFTABLES),
        inner,
    )
}

/// Sends `msgs` as one transaction (each acknowledged).
pub(super) fn commit(
    conn: &mut Conn,
    what: &str,
    msgs: Vec<(NfTablesMessage, u16)>,
) -> Result<(), NetError> {
    let mut all = Vec::with_capacity(msgs.len() + 2);
    all.push((batch_control(ControlMessage::BatchBegin), 0, false));
    for (m, flags) in msgs {
        all.push((msg(m), flags, true));
    }
    all.push((batch_control(ControlMessage::BatchEnd), 0, false));
    conn.transact(what, all).map(|_| ())
}

// ---- expressions ----

pub(super) fn expr(e: Expressions) -> ListAttribute<ExpressionAttribute> {
    e.into()
}

pub(super) fn meta(key: MetaKey, reg: Register) -> ListAttribute<ExpressionAttribute> {
    expr(Expressions::Meta(vec![
        Meta::Key(key),
        Meta::DestinationRegister(reg),
    ]))
}

pub(super) fn cmp(
    op: Operator,
    reg: Register,
    data: Vec<u8>,
) -> ListAttribute<ExpressionAttribute> {
    expr(Expressions::Cmp(vec![
        Cmp::SourceRegister(reg),
        Cmp::Op(op),
        Cmp::Data(DataAttribute::Value(data)),
    ]))
}

pub(super) fn payload(
    base: u32,
    offset: u32,
    len: u32,
    reg: Register,
) -> ListAttribute<ExpressionAttribute> {
    expr(Expressions::Payload(vec![
        Payload::DestinationRegister(reg),
        Payload::Base(base),
        Payload::Offset(offset),
        Payload::Len(len),
    ]))
}

pub(super) fn lookup(set: &str, reg: Register, invert: bool) -> ListAttribute<ExpressionAttribute> {
    let mut attrs = vec![Lookup::Set(set.to_string()), Lookup::SourceRegister(reg)];
    if invert {
        attrs.push(Lookup::Flags(NFT_LOOKUP_F_INV));
    }
    expr(Expressions::Lookup(attrs))
}

pub(super) fn verdict(code: Verdict, chain: Option<&str>) -> ListAttribute<ExpressionAttribute> {
    let mut v = vec![VerdictAttribute::Code(code)];
    if let Some(c) = chain {
        v.push(VerdictAttribute::Chain(c.to_string()));
    }
    expr(Expressions::Immediate(vec![
        Immediate::DestinationRegister(Register::Verdict),
        Immediate::Data(DataAttribute::Verdict(v)),
    ]))
}

pub(super) fn accept() -> ListAttribute<ExpressionAttribute> {
    verdict(Verdict::Other(NF_ACCEPT), None)
}

pub(super) fn drop_() -> ListAttribute<ExpressionAttribute> {
    verdict(Verdict::Other(NF_DROP), None)
}

pub(super) fn jump(chain: &str) -> ListAttribute<ExpressionAttribute> {
    verdict(Verdict::Jump, Some(chain))
}

pub(super) fn be32(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

pub(super) fn other(name: &str, attrs: Vec<DefaultNla>) -> ListAttribute<ExpressionAttribute> {
    expr(Expressions::Other {
        expression_type: name.to_string(),
        attributes: attrs,
    })
}

/// `iifname "P*"` (or oifname): the first bytes of the name.
fn ifname_prefix(key: MetaKey, prefix: &str) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        meta(key, Register::Reg1),
        cmp(Operator::Equal, Register::Reg1, prefix.as_bytes().to_vec()),
    ]
}

pub(super) fn nfproto(proto: u8) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        meta(MetaKey::Nfproto, Register::Reg1),
        cmp(Operator::Equal, Register::Reg1, vec![proto]),
    ]
}

/// `ct state established,related`.
fn ct_established() -> Vec<ListAttribute<ExpressionAttribute>> {
    ct_state(CT_STATE_ESTABLISHED | CT_STATE_RELATED)
}

/// `ct state new`.
fn ct_new() -> Vec<ListAttribute<ExpressionAttribute>> {
    ct_state(CT_STATE_NEW)
}

/// `ct state` is one of the states of `mask`.
fn ct_state(mask: u32) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        other(
            "ct",
            vec![
                DefaultNla::new(NFTA_CT_DREG, be32(Register::Reg1.into())),
                DefaultNla::new(NFTA_CT_KEY, be32(NFT_CT_STATE)),
            ],
        ),
        expr(Expressions::Bitwise(vec![
            Bitwise::SourceRegister(Register::Reg1),
            Bitwise::DestinationRegister(Register::Reg1),
            Bitwise::Length(4),
            Bitwise::Mask(DataAttribute::Value(mask.to_ne_bytes().to_vec())),
            Bitwise::Xor(DataAttribute::Value(0u32.to_ne_bytes().to_vec())),
        ])),
        cmp(
            Operator::NotEqual,
            Register::Reg1,
            0u32.to_ne_bytes().to_vec(),
        ),
    ]
}

/// A nested attribute of `attrs`.
fn nested(kind: u16, attrs: &[DefaultNla]) -> DefaultNla {
    use netlink_packet_core::Emitable;
    let mut value = vec![0u8; attrs.buffer_len()];
    attrs.emit(&mut value);
    DefaultNla::new(kind | netlink_packet_core::NLA_F_NESTED, value)
}

/// `add @ctcount { ip saddr ct count over limit } drop`: the source address's entry of the
/// set counts its connections; past `limit` the packet is dropped.
fn ct_count_over(limit: u32) -> Vec<ListAttribute<ExpressionAttribute>> {
    let connlimit = [
        DefaultNla::new(NFTA_EXPR_NAME, b"connlimit\0".to_vec()),
        nested(
            NFTA_EXPR_DATA,
            &[
                DefaultNla::new(NFTA_CONNLIMIT_COUNT, be32(limit)),
                DefaultNla::new(NFTA_CONNLIMIT_FLAGS, be32(NFT_CONNLIMIT_F_INV)),
            ],
        ),
    ];
    let mut name = SET_CTCOUNT.as_bytes().to_vec();
    name.push(0);
    vec![
        payload(NFT_PAYLOAD_NETWORK_HEADER, 12, 4, Register::Reg1),
        other(
            "dynset",
            vec![
                DefaultNla::new(NFTA_DYNSET_SET_NAME, name),
                DefaultNla::new(NFTA_DYNSET_OP, be32(NFT_DYNSET_OP_ADD)),
                DefaultNla::new(NFTA_DYNSET_SREG_KEY, be32(Register::Reg1.into())),
                nested(NFTA_DYNSET_EXPR, &connlimit),
            ],
        ),
        drop_(),
    ]
}

/// `ct mark set ip saddr` (offset 12) or `ip daddr` (16).
fn ct_mark_from(offset: u32) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        payload(NFT_PAYLOAD_NETWORK_HEADER, offset, 4, Register::Reg1),
        other(
            "ct",
            vec![
                DefaultNla::new(NFTA_CT_KEY, be32(NFT_CT_MARK)),
                DefaultNla::new(NFTA_CT_SREG, be32(Register::Reg1.into())),
            ],
        ),
    ]
}

pub(super) fn ip_daddr_in(set: &str) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        payload(NFT_PAYLOAD_NETWORK_HEADER, 16, 4, Register::Reg1),
        lookup(set, Register::Reg1, false),
    ]
}

// ---- keys ----

/// The key of a `live` element: the host ifname padded to IFNAMSIZ, then the address.
pub(crate) fn live_key(ifname: &str, addr: Ipv4Addr) -> Vec<u8> {
    let mut key = vec![0u8; IFNAMSIZ + 4];
    let n = ifname.len().min(IFNAMSIZ - 1);
    key[..n].copy_from_slice(&ifname.as_bytes()[..n]);
    key[IFNAMSIZ..].copy_from_slice(&addr.octets());
    key
}

fn parse_live_key(key: &[u8]) -> Option<(String, Ipv4Addr)> {
    if key.len() != IFNAMSIZ + 4 {
        return None;
    }
    let name = &key[..IFNAMSIZ];
    let end = name.iter().position(|b| *b == 0).unwrap_or(IFNAMSIZ);
    let name = String::from_utf8_lossy(&name[..end]).into_owned();
    let a: [u8; 4] = key[IFNAMSIZ..].try_into().ok()?;
    Some((name, Ipv4Addr::from(a)))
}

pub(super) fn port_key(proto: Proto, port: u16) -> Vec<u8> {
    let mut key = vec![0u8; 8];
    key[0] = proto.number();
    key[4..6].copy_from_slice(&port.to_be_bytes());
    key
}

// ---- sets ----

pub(super) fn new_set(
    table: &str,
    name: &str,
    id: u32,
    key_type: u32,
    key_len: u32,
    interval: bool,
) -> NfTablesMessage {
    let mut attrs = vec![
        SetAttribute::Table(table.to_string()),
        SetAttribute::Name(name.to_string()),
        SetAttribute::KeyType(key_type),
        SetAttribute::KeyLen(key_len),
        SetAttribute::Id(id),
    ];
    if interval {
        attrs.push(SetAttribute::Flags(SetFlags::Interval));
    }
    NfTablesMessage::NewSet(SetMessage { attributes: attrs })
}

/// A map from a sandbox's address to a verdict (a jump to its chain).
fn verdict_map(table: &str, name: &str, id: u32) -> NfTablesMessage {
    NfTablesMessage::NewSet(SetMessage {
        attributes: vec![
            SetAttribute::Table(table.to_string()),
            SetAttribute::Name(name.to_string()),
            SetAttribute::Flags(SetFlags::Map),
            SetAttribute::KeyType(TYPE_IPADDR),
            SetAttribute::KeyLen(4),
            SetAttribute::DataType(DATA_VERDICT),
            SetAttribute::Id(id),
        ],
    })
}

/// `ip saddr vmap @map`.
fn saddr_vmap(map: &str) -> Vec<ListAttribute<ExpressionAttribute>> {
    vec![
        payload(NFT_PAYLOAD_NETWORK_HEADER, 12, 4, Register::Reg1),
        expr(Expressions::Lookup(vec![
            Lookup::Set(map.to_string()),
            Lookup::SourceRegister(Register::Reg1),
            Lookup::DestinationRegister(Register::Verdict),
        ])),
    ]
}

pub(super) fn elements(
    table: &str,
    set: &str,
    keys: Vec<(Vec<u8>, bool)>,
    add: bool,
) -> NfTablesMessage {
    let elems = keys
        .into_iter()
        .map(|(key, end)| {
            let mut e = vec![SetElementAttribute::Key(DataAttribute::Value(key))];
            if end {
                e.push(SetElementAttribute::Flags(SetElementFlags::IntervalEnd));
            }
            ListAttribute::Element(e)
        })
        .collect();
    let m = SetElementMessage {
        attributes: vec![
            SetElementList::Table(table.to_string()),
            SetElementList::Set(set.to_string()),
            SetElementList::Elements(elems),
        ],
    };
    if add {
        NfTablesMessage::NewSetElement(m)
    } else {
        NfTablesMessage::DeleteSetElement(m)
    }
}

/// Interval-set elements of `ranges` ([first, last] as integers): each range's start, then an
/// interval end at last + 1 (none where the range reaches the top). Overlapping or touching
/// ranges are merged first: the kernel refuses overlaps.
pub(super) fn interval_keys(mut ranges: Vec<(u128, u128)>, bytes: usize) -> Vec<(Vec<u8>, bool)> {
    ranges.sort();
    let mut merged: Vec<(u128, u128)> = Vec::new();
    for (a, b) in ranges {
        match merged.last_mut() {
            Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    let max = if bytes == 16 {
        u128::MAX
    } else {
        (1u128 << (bytes * 8)) - 1
    };
    let key = |v: u128| v.to_be_bytes()[16 - bytes..].to_vec();
    let mut out = Vec::new();
    for (a, b) in merged {
        out.push((key(a), false));
        if b < max {
            out.push((key(b + 1), true));
        }
    }
    out
}

fn v4_ranges(nets: &[Ipv4Net]) -> Vec<(u128, u128)> {
    nets.iter()
        .map(|n| {
            (
                u32::from(n.network()) as u128,
                u32::from(n.broadcast()) as u128,
            )
        })
        .collect()
}

fn v6_ranges(nets: &[Ipv6Net]) -> Vec<(u128, u128)> {
    nets.iter()
        .map(|n| (u128::from(n.network()), u128::from(n.broadcast())))
        .collect()
}

// ---- chains and rules ----

fn base_chain(
    table: &str,
    name: &str,
    hook: InetHookNumber,
    prio: i32,
    kind: &str,
) -> NfTablesMessage {
    NfTablesMessage::NewChain(ChainMessage {
        attributes: vec![
            ChainAttribute::Table(table.to_string()),
            ChainAttribute::Name(name.to_string()),
            ChainAttribute::Hook(vec![
                Hook::Number(HookNumber::Inet(hook)),
                Hook::Priority(prio as u32),
            ]),
            ChainAttribute::Type(kind.to_string()),
            ChainAttribute::Policy(NF_ACCEPT),
        ],
    })
}

pub(super) fn chain(table: &str, name: &str) -> NfTablesMessage {
    NfTablesMessage::NewChain(ChainMessage {
        attributes: vec![
            ChainAttribute::Table(table.to_string()),
            ChainAttribute::Name(name.to_string()),
        ],
    })
}

pub(super) fn rule(
    table: &str,
    chain: &str,
    exprs: Vec<Vec<ListAttribute<ExpressionAttribute>>>,
) -> NfTablesMessage {
    NfTablesMessage::NewRule(RuleMessage {
        attributes: vec![
            RuleAttribute::Table(table.to_string()),
            RuleAttribute::Chain(chain.to_string()),
            RuleAttribute::Expressions(exprs.into_iter().flatten().collect()),
        ],
    })
}

fn table_msg(name: &str, new: bool) -> NfTablesMessage {
    let m = TableMessage {
        attributes: vec![TableAttribute::Name(name.to_string())],
    };
    if new {
        NfTablesMessage::NewTable(m)
    } else {
        NfTablesMessage::DeleteTable(m)
    }
}

/// Loads the table, replacing one of the same name, in one transaction; `keep` are `live`
/// elements to have in it from the start (those of the table replaced).
pub(crate) fn load(
    conn: &mut Conn,
    rs: &Ruleset,
    keep: &[(String, Ipv4Addr)],
) -> Result<(), NetError> {
    let t = rs.table.as_str();
    let p = rs.prefix.as_str();
    let c = NLM_F_CREATE;
    let mut m: Vec<(NfTablesMessage, u16)> = vec![
        // Made if missing, so that the delete that follows always finds it.
        (table_msg(t, true), c),
        (table_msg(t, false), 0),
        (table_msg(t, true), c),
        (
            new_set(
                t,
                SET_LIVE,
                1,
                TYPE_IFNAME << TYPE_BITS | TYPE_IPADDR,
                (IFNAMSIZ + 4) as u32,
                false,
            ),
            c,
        ),
        (
            new_set(
                t,
                SET_PORTS,
                2,
                TYPE_INET_PROTOCOL << TYPE_BITS | TYPE_INET_SERVICE,
                8,
                false,
            ),
            c,
        ),
        (new_set(t, SET_REFUSED4, 3, TYPE_IPADDR, 4, true), c),
        (new_set(t, SET_ALLOWED4, 4, TYPE_IPADDR, 4, true), c),
        (new_set(t, SET_REFUSED6, 5, TYPE_IP6ADDR, 16, true), c),
        (verdict_map(t, MAP_FWD, 6), c),
        (verdict_map(t, MAP_PRE, 7), c),
        (verdict_map(t, MAP_NAT, 8), c),
        (
            NfTablesMessage::NewSet(SetMessage {
                attributes: vec![
                    SetAttribute::Table(t.to_string()),
                    SetAttribute::Name(SET_CTCOUNT.to_string()),
                    SetAttribute::Flags(SetFlags::from_bits_retain(SET_F_EVAL)),
                    SetAttribute::KeyType(TYPE_IPADDR),
                    SetAttribute::KeyLen(4),
                    SetAttribute::Id(9),
                ],
            }),
            c,
        ),
    ];
    let mut fill = |set: &str, keys: Vec<(Vec<u8>, bool)>| {
        if !keys.is_empty() {
            m.push((elements(t, set, keys, true), c));
        }
    };
    fill(
        SET_LIVE,
        keep.iter().map(|(n, a)| (live_key(n, *a), false)).collect(),
    );
    fill(
        SET_PORTS,
        rs.ports
            .iter()
            .map(|(proto, port)| (port_key(*proto, *port), false))
            .collect(),
    );
    fill(SET_REFUSED4, interval_keys(v4_ranges(&rs.refused4), 4));
    fill(SET_ALLOWED4, interval_keys(v4_ranges(&rs.allowed4), 4));
    fill(SET_REFUSED6, interval_keys(v6_ranges(&rs.refused6), 16));

    use InetHookNumber as H;
    for (name, hook, prio, kind) in [
        ("prerouting", H::PreRouting, PRIO_MANGLE, "filter"),
        ("output", H::LocalOut, PRIO_MANGLE, "filter"),
        ("input", H::LocalIn, PRIO_FILTER, "filter"),
        ("forward", H::Forward, PRIO_FILTER, "filter"),
        ("postrouting", H::PostRouting, PRIO_SRCNAT, "nat"),
        ("dnat", H::PreRouting, PRIO_DSTNAT, "nat"),
    ] {
        m.push((base_chain(t, name, hook, prio, kind), c));
    }
    for name in ["sandbox_in", "sandbox_out", "sandbox_back"] {
        m.push((chain(t, name), c));
    }
    let iif = || ifname_prefix(MetaKey::Iifname, p);
    let oif = || ifname_prefix(MetaKey::Oifname, p);
    let gw = rs.gateway.octets().to_vec();
    let mut rules = vec![
        // prerouting: only leased sandboxes, each with its own address.
        ("prerouting", not_live(MetaKey::Iifname, p)),
        // Its share of the host's conntrack table.
        (
            "prerouting",
            vec![
                iif(),
                nfproto(NFPROTO_IPV4),
                ct_new(),
                ct_count_over(rs.ct_limit),
            ],
        ),
        (
            "prerouting",
            vec![iif(), nfproto(NFPROTO_IPV4), ct_mark_from(12)],
        ),
        // A sandbox's own deny_ports (before the proxy's DNAT hides the port).
        (
            "prerouting",
            vec![iif(), nfproto(NFPROTO_IPV4), saddr_vmap(MAP_PRE)],
        ),
        // Its ports 80 and 443 to the egress proxy.
        (
            "dnat",
            vec![iif(), nfproto(NFPROTO_IPV4), saddr_vmap(MAP_NAT)],
        ),
        (
            "output",
            vec![oif(), nfproto(NFPROTO_IPV4), ct_mark_from(16)],
        ),
        // Nothing from the host reaches a sandbox that is not live (held while CRIU saves or
        // restores its sockets: the node's network lock), nor from elsewhere (sandbox_back).
        ("output", not_live(MetaKey::Oifname, p)),
        ("input", vec![iif(), vec![jump("sandbox_in")]]),
        ("sandbox_in", vec![ct_established(), vec![accept()]]),
        (
            "sandbox_in",
            vec![
                nfproto(NFPROTO_IPV4),
                vec![
                    payload(NFT_PAYLOAD_NETWORK_HEADER, 16, 4, Register::Reg1),
                    cmp(Operator::Equal, Register::Reg1, gw),
                    meta(MetaKey::L4Proto, Register::Reg1),
                    payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, Register::Reg32_01),
                    lookup(SET_PORTS, Register::Reg1, false),
                    accept(),
                ],
            ],
        ),
        ("sandbox_in", vec![vec![drop_()]]),
        ("forward", vec![iif(), vec![jump("sandbox_out")]]),
        ("forward", vec![oif(), vec![jump("sandbox_back")]]),
        ("sandbox_out", vec![oif(), vec![drop_()]]),
        ("sandbox_out", vec![ct_established(), vec![accept()]]),
        (
            "sandbox_out",
            vec![
                nfproto(NFPROTO_IPV4),
                vec![
                    payload(NFT_PAYLOAD_NETWORK_HEADER, 16, 4, Register::Reg1),
                    expr(Expressions::Bitwise(vec![
                        Bitwise::SourceRegister(Register::Reg1),
                        Bitwise::DestinationRegister(Register::Reg1),
                        Bitwise::Length(4),
                        Bitwise::Mask(DataAttribute::Value(rs.range.netmask().octets().to_vec())),
                        Bitwise::Xor(DataAttribute::Value(vec![0; 4])),
                    ])),
                    cmp(
                        Operator::Equal,
                        Register::Reg1,
                        rs.range.network().octets().to_vec(),
                    ),
                    drop_(),
                ],
            ],
        ),
        // Refused but what the operator opens: `ip daddr @refused4 ip daddr != @allowed4`.
        (
            "sandbox_out",
            vec![
                nfproto(NFPROTO_IPV4),
                ip_daddr_in(SET_REFUSED4),
                vec![lookup(SET_ALLOWED4, Register::Reg1, true), drop_()],
            ],
        ),
        (
            "sandbox_out",
            vec![
                nfproto(NFPROTO_IPV6),
                vec![
                    payload(NFT_PAYLOAD_NETWORK_HEADER, 24, 16, Register::Reg1),
                    lookup(SET_REFUSED6, Register::Reg1, false),
                    drop_(),
                ],
            ],
        ),
        ("sandbox_out", vec![nfproto(NFPROTO_IPV6), vec![drop_()]]),
        // A sandbox's own rules.
        (
            "sandbox_out",
            vec![nfproto(NFPROTO_IPV4), saddr_vmap(MAP_FWD)],
        ),
        ("sandbox_out", vec![vec![accept()]]),
        ("sandbox_back", not_live(MetaKey::Oifname, p)),
        ("sandbox_back", vec![ct_established(), vec![accept()]]),
        ("sandbox_back", vec![vec![drop_()]]),
        ("postrouting", vec![iif(), vec![other("masq", vec![])]]),
    ];
    if rs.ct_limit == 0 {
        rules.remove(1);
    }
    for (ch, exprs) in rules {
        m.push((rule(t, ch, exprs), c | NLM_F_APPEND));
    }
    commit(conn, &format!("load nftables table inet {t}"), m)
}

/// `iifname "P*" meta nfproto ipv4 iifname . ip saddr != @live drop` (from a sandbox not
/// leased, or of an address not its own), or with `oifname` and `ip daddr` (to a sandbox
/// whose element is not in `live`: one held).
fn not_live(key: MetaKey, prefix: &str) -> Vec<Vec<ListAttribute<ExpressionAttribute>>> {
    // The sandbox's address: the source going out, the destination coming in.
    let addr_at = if matches!(key, MetaKey::Iifname) {
        12
    } else {
        16
    };
    vec![
        ifname_prefix(key, prefix),
        nfproto(NFPROTO_IPV4),
        vec![
            meta(key, Register::Reg1),
            payload(NFT_PAYLOAD_NETWORK_HEADER, addr_at, 4, Register::Reg32_04),
            lookup(SET_LIVE, Register::Reg1, true),
        ],
        vec![drop_()],
    ]
}

/// Deletes table `table` (for tests and a node's uninstall). A missing table is not an error.
pub(crate) fn delete_table(conn: &mut Conn, table: &str) -> Result<(), NetError> {
    let m = vec![
        (table_msg(table, true), NLM_F_CREATE),
        (table_msg(table, false), 0),
    ];
    commit(conn, &format!("delete nftables table inet {table}"), m)
}

/// Adds (`add`) or removes a `live` element. Adding one that is there, or removing one that is
/// not, is not an error.
pub(crate) fn set_live(
    conn: &mut Conn,
    table: &str,
    ifname: &str,
    addr: Ipv4Addr,
    add: bool,
) -> Result<(), NetError> {
    let m = elements(table, SET_LIVE, vec![(live_key(ifname, addr), false)], add);
    let what = if add { "add" } else { "remove" };
    match commit(
        conn,
        &format!("{what} element {ifname} . {addr}"),
        vec![(m, if add { NLM_F_CREATE } else { 0 })],
    ) {
        Err(NetError::Netlink { source, .. })
            if !add && source.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        r => r,
    }
}

/// The elements of `live`, or `None` where the table (or the set) is missing.
pub(crate) fn list_live(
    conn: &mut Conn,
    table: &str,
) -> Result<Option<Vec<(String, Ipv4Addr)>>, NetError> {
    let req = SetElementMessage {
        attributes: vec![
            SetElementList::Table(table.to_string()),
            SetElementList::Set(SET_LIVE.to_string()),
        ],
    };
    let replies = match conn.dump(
        "list live elements",
        msg(NfTablesMessage::GetSetElement(req)),
    ) {
        Ok(r) => r,
        Err(NetError::Netlink { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for r in replies {
        let netlink_packet_netfilter::NetfilterMessageInner::NfTables(
            NfTablesMessage::NewSetElement(m),
        ) = r.inner
        else {
            continue;
        };
        for a in m.attributes {
            let SetElementList::Elements(elems) = a else {
                continue;
            };
            for e in elems {
                let ListAttribute::Element(attrs) = e else {
                    continue;
                };
                for at in attrs {
                    if let SetElementAttribute::Key(DataAttribute::Value(k)) = at {
                        if let Some(x) = parse_live_key(&k) {
                            out.push(x);
                        }
                    }
                }
            }
        }
    }
    Ok(Some(out))
}

/// The refused IPv4 ranges every node has (before the operator's extra ones).
pub(crate) fn default_refused4() -> Vec<Ipv4Net> {
    [
        (Ipv4Addr::new(0, 0, 0, 0), 8),
        (Ipv4Addr::new(10, 0, 0, 0), 8),
        (Ipv4Addr::new(100, 64, 0, 0), 10),
        (Ipv4Addr::new(127, 0, 0, 0), 8),
        (Ipv4Addr::new(169, 254, 0, 0), 16),
        (Ipv4Addr::new(172, 16, 0, 0), 12),
        (Ipv4Addr::new(192, 168, 0, 0), 16),
        // Multicast and the reserved 240/4 (with the broadcast address).
        (Ipv4Addr::new(224, 0, 0, 0), 3),
    ]
    .into_iter()
    .filter_map(|(a, l)| Ipv4Net::new(a, l).ok())
    .collect()
}

/// The refused IPv6 ranges (IPv6 is not routed yet: all of it is dropped after these).
pub(crate) fn default_refused6() -> Vec<Ipv6Net> {
    [
        (Ipv6Addr::UNSPECIFIED, 127),
        (Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96),
        (Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0), 7),
        (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
        (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8),
    ]
    .into_iter()
    .filter_map(|(a, l)| Ipv6Net::new(a, l).ok())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_keys_merge_and_end_after_the_last_address() {
        let k = interval_keys(vec![(10, 20), (15, 30), (31, 40), (50, 60)], 4);
        assert_eq!(
            k,
            vec![
                (10u32.to_be_bytes().to_vec(), false),
                (41u32.to_be_bytes().to_vec(), true),
                (50u32.to_be_bytes().to_vec(), false),
                (61u32.to_be_bytes().to_vec(), true),
            ]
        );
        // A range to the top has no end element.
        let k = interval_keys(vec![(0xe000_0000, 0xffff_ffff)], 4);
        assert_eq!(k, vec![(0xe000_0000u32.to_be_bytes().to_vec(), false)]);
    }

    #[test]
    fn live_keys_read_back() {
        let k = live_key("sbx12", Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(k.len(), 20);
        assert_eq!(
            parse_live_key(&k),
            Some(("sbx12".to_string(), Ipv4Addr::new(10, 1, 2, 3)))
        );
    }
}
