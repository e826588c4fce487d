//! One netlink socket and the three exchanges this module needs: requests whose
//! acknowledgements are awaited (one, or an nftables batch of many), and dumps.
//!
//! The kernel handles a request to itself inside `sendmsg`, so by the time `send` returns
//! every acknowledgement and error of a request or a batch is queued on the socket: they are
//! read without blocking until the queue is empty (as nft does). Dumps are produced as they are
//! read, so they are read blocking until `NLMSG_DONE`.

use std::fmt::Debug;
use std::io;

use netlink_packet_core::{
    NetlinkBuffer, NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload,
    NetlinkSerializable, NlasIterator, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST,
};
use netlink_sys::{Socket, SocketAddr};

use super::NetError;

/// Room for one datagram: the kernel makes dump datagrams of at most 32 KiB.
const RECV_BUF: usize = 64 * 1024;
/// Set in an error message's flags when the kernel trimmed the echoed request (cap_ack).
const NLM_F_CAPPED: u16 = 0x100;
/// Set in an error message's flags when extended-ack attributes follow.
const NLM_F_ACK_TLVS: u16 = 0x200;
/// How long a blocking read waits for the kernel's answer.
const ANSWER_TIMEOUT_SECS: i64 = 10;
/// The extended ack attribute that carries the kernel's message.
const NLMSGERR_ATTR_MSG: u16 = 1;

/// A netlink socket bound in the network namespace of the thread that made it, for its life.
pub(crate) struct Conn {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("seq", &self.seq).finish()
    }
}

fn io_err(what: &str) -> impl FnOnce(io::Error) -> NetError + '_ {
    move |source| NetError::Io {
        what: what.to_string(),
        source,
    }
}

impl Conn {
    /// A socket of `protocol` (`netlink_sys::protocols::NETLINK_*`) in the calling thread's
    /// network namespace.
    pub(crate) fn new(protocol: isize) -> Result<Self, NetError> {
        let mut sock = Socket::new(protocol).map_err(io_err("netlink socket"))?;
        sock.bind_auto().map_err(io_err("netlink bind"))?;
        sock.connect(&SocketAddr::new(0, 0))
            .map_err(io_err("netlink connect"))?;
        // Small acknowledgements (the request is not echoed), with the kernel's reason on error.
        sock.set_cap_ack(true).map_err(io_err("NETLINK_CAP_ACK"))?;
        sock.set_ext_ack(true).map_err(io_err("NETLINK_EXT_ACK"))?;
        // A reply that never comes ends a blocking read instead of hanging the caller.
        let timeout = nix::sys::time::TimeVal::new(ANSWER_TIMEOUT_SECS, 0);
        nix::sys::socket::setsockopt(&sock, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
            .map_err(|e| NetError::Io {
                what: "SO_RCVTIMEO".into(),
                source: e.into(),
            })?;
        Ok(Conn {
            sock,
            seq: 0,
            buf: Vec::with_capacity(RECV_BUF),
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Reads one datagram into `self.buf`. `Ok(false)`: nothing queued (non-blocking read).
    fn recv(&mut self, block: bool) -> Result<bool, NetError> {
        self.buf.clear();
        let flags = if block { 0 } else { libc::MSG_DONTWAIT };
        match self.sock.recv(&mut self.buf, flags | libc::MSG_TRUNC) {
            Ok(n) if n > RECV_BUF => Err(NetError::Netlink {
                what: "netlink receive".into(),
                source: io::Error::other(format!("a datagram of {n} bytes was cut")),
            }),
            Ok(_) => Ok(true),
            Err(e) if !block && e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => self.recv(block),
            Err(e) => Err(NetError::Io {
                what: "netlink receive".into(),
                source: e,
            }),
        }
    }

    /// The messages of the datagram in `self.buf`.
    fn parse<I>(&self) -> Result<Vec<NetlinkMessage<I>>, NetError>
    where
        I: NetlinkDeserializable + Debug,
    {
        let mut out = Vec::new();
        let mut at = 0;
        while at + 16 <= self.buf.len() {
            let rest = &self.buf[at..];
            let len = NetlinkBuffer::new_checked(rest)
                .map_err(|e| decode("netlink header", e))?
                .length() as usize;
            if len < 16 || len > rest.len() {
                break;
            }
            out.push(
                NetlinkMessage::<I>::deserialize(&rest[..len])
                    .map_err(|e| decode("netlink message", e))?,
            );
            at += (len + 3) & !3;
        }
        Ok(out)
    }

    /// Sends the messages of one transaction (an nftables batch, or a single rtnetlink or
    /// conntrack request) and returns once each message flagged `ack` was answered: the first
    /// error the kernel reported, if any. `what` names the transaction in errors.
    pub(crate) fn transact<I>(
        &mut self,
        what: &str,
        msgs: Vec<(I, u16, bool)>,
    ) -> Result<Vec<I>, NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        let mut out = Vec::new();
        let mut waiting = Vec::new();
        let mut ours = Vec::new();
        for (inner, flags, ack) in msgs {
            let seq = self.next_seq();
            ours.push(seq);
            let mut header = NetlinkHeader::default();
            header.flags = NLM_F_REQUEST | flags | if ack { NLM_F_ACK } else { 0 };
            header.sequence_number = seq;
            let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner));
            msg.finalize();
            let start = out.len();
            out.resize(start + msg.buffer_len(), 0);
            msg.serialize(&mut out[start..]);
            if ack {
                waiting.push(seq);
            }
        }
        self.sock.send(&out, 0).map_err(io_err("netlink send"))?;
        let mut first_err: Option<NetError> = None;
        let mut replies = Vec::new();
        // The answers are queued by now; blocking reads only wait for one still on its way
        // (bounded by the socket's receive timeout). After an error, what else is queued (the
        // other answers of a failed batch) is read without waiting.
        while !waiting.is_empty() {
            if !self.recv(first_err.is_none())? {
                break;
            }
            for msg in self.parse::<I>()? {
                let seq = msg.header.sequence_number;
                if !ours.contains(&seq) {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Error(ref e) => {
                        waiting.retain(|s| *s != seq);
                        if e.code.is_some() && first_err.is_none() {
                            first_err = Some(NetError::Netlink {
                                what: what.to_string(),
                                source: kernel_error(&msg.header, e),
                            });
                        }
                    }
                    NetlinkPayload::InnerMessage(m) => replies.push(m),
                    _ => {}
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        if !waiting.is_empty() {
            return Err(NetError::Netlink {
                what: what.to_string(),
                source: io::Error::other("the kernel did not answer"),
            });
        }
        Ok(replies)
    }

    /// One request: `flags` besides REQUEST and ACK (e.g. CREATE | EXCL).
    pub(crate) fn request<I>(&mut self, what: &str, inner: I, flags: u16) -> Result<(), NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        self.transact(what, vec![(inner, flags, true)]).map(|_| ())
    }

    /// One request whose answer is a message (a get that is not a dump).
    pub(crate) fn get<I>(&mut self, what: &str, inner: I) -> Result<Vec<I>, NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        self.transact(what, vec![(inner, 0, true)])
    }

    /// Dumps what `inner` asks for. A dump the kernel marks as interrupted (what it lists
    /// changed meanwhile: NLM_F_DUMP_INTR) is done again, up to three times.
    pub(crate) fn dump<I>(&mut self, what: &str, inner: I) -> Result<Vec<I>, NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + Debug + Clone,
    {
        let mut tries = 0;
        loop {
            let (items, interrupted) = self.dump_once(what, inner.clone())?;
            tries += 1;
            if !interrupted || tries >= 3 {
                return Ok(items);
            }
        }
    }

    fn dump_once<I>(&mut self, what: &str, inner: I) -> Result<(Vec<I>, bool), NetError>
    where
        I: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        let seq = self.next_seq();
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(inner));
        msg.finalize();
        let mut out = vec![0; msg.buffer_len()];
        msg.serialize(&mut out);
        self.sock.send(&out, 0).map_err(io_err("netlink send"))?;
        let mut items = Vec::new();
        let mut interrupted = false;
        loop {
            self.recv(true)?;
            for msg in self.parse::<I>()? {
                if msg.header.sequence_number != seq {
                    continue;
                }
                interrupted |= msg.header.flags & NLM_F_DUMP_INTR != 0;
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok((items, interrupted)),
                    NetlinkPayload::Error(ref e) if e.code.is_some() => {
                        return Err(NetError::Netlink {
                            what: what.to_string(),
                            source: kernel_error(&msg.header, e),
                        })
                    }
                    NetlinkPayload::InnerMessage(m) => items.push(m),
                    _ => {}
                }
            }
        }
    }
}

fn decode(what: &str, e: netlink_packet_core::DecodeError) -> NetError {
    NetError::Netlink {
        what: what.to_string(),
        source: io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
    }
}

/// The errno of an error message, with the kernel's extended-ack text when it gave one.
fn kernel_error(header: &NetlinkHeader, e: &netlink_packet_core::ErrorMessage) -> io::Error {
    let errno = e.to_io();
    if header.flags & NLM_F_ACK_TLVS == 0 {
        return errno;
    }
    // `e.header` is the echoed request (only its header when capped), then attributes.
    let echoed = if header.flags & NLM_F_CAPPED != 0 {
        16
    } else {
        e.header
            .get(..4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(|b| u32::from_ne_bytes(b) as usize)
            .unwrap_or(16)
    };
    let tlvs = e.header.get((echoed + 3) & !3..).unwrap_or(&[]);
    for nla in NlasIterator::new(tlvs).flatten() {
        if nla.kind() == NLMSGERR_ATTR_MSG {
            let text = String::from_utf8_lossy(nla.value());
            let text = text.trim_end_matches('\0');
            return io::Error::new(errno.kind(), format!("{errno} ({text})"));
        }
    }
    errno
}
