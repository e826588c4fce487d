//! Fuzzing of the frame decoder ([`read_frame`]), bounded in time so that it runs in
//! `cargo test`: a seeded random harness (`SBX_FUZZ_SEED` to replay one seed, `SBX_FUZZ_ITERS`
//! and `SBX_FUZZ_SECONDS` for a longer run).
//! Properties: no panic on any input (random bytes, and valid streams of frames mutated at
//! random places), read as the host and as the agent, whole or in pieces of random sizes; a
//! stream of valid frames (messages of both sides, any JSON, data frames) reads back equal,
//! frame for frame, then ends cleanly, whatever the pieces the reader gets.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use sbx_proto::{
    encode_data, encode_msg, read_frame, AgentMsg, ExecFailKind, ExecSpec, Frame, HostMsg, Program,
    ProtoError, StartFailKind, StartFailure, Stream, MAX_DATA,
};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncRead, ReadBuf};

const DEFAULT_ITERS: u64 = 20_000;
const DEFAULT_BUDGET: Duration = Duration::from_secs(4);

/// SplitMix64: small, seeded, the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn string(&mut self, max: usize) -> String {
        const CHARS: &[char] = &[
            'a',
            'Z',
            '0',
            ' ',
            '/',
            '.',
            '-',
            '\0',
            '\n',
            '"',
            '\\',
            '\u{7f}',
            'é',
            '中',
            '😀',
            '\u{10ffff}',
            '\u{202e}',
        ];
        let n = self.below(max + 1);
        (0..n).map(|_| CHARS[self.below(CHARS.len())]).collect()
    }
    /// A string of at most 255 bytes (a data frame's id).
    fn id(&mut self) -> String {
        let mut s = self.string(80);
        while s.len() > 255 {
            s.pop();
        }
        s
    }
    /// Any JSON without floats (which serde_json need not write back bit for bit).
    fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth == 0 { 4 } else { 6 }) {
            0 => Value::Null,
            1 => Value::Bool(self.chance(50)),
            2 => {
                if self.chance(50) {
                    json!(self.next())
                } else {
                    json!(self.next() as i64)
                }
            }
            3 => Value::String(self.string(20)),
            4 => Value::Array((0..self.below(4)).map(|_| self.value(depth - 1)).collect()),
            _ => Value::Object(
                (0..self.below(4))
                    .map(|_| (self.string(6), self.value(depth - 1)))
                    .collect::<Map<_, _>>(),
            ),
        }
    }
    fn stream(&mut self) -> Stream {
        [Stream::Stdin, Stream::Stdout, Stream::Stderr, Stream::File][self.below(4)]
    }
    fn host_msg(&mut self) -> HostMsg {
        let id = self.string(24);
        match self.below(10) {
            0 => HostMsg::Exec(ExecSpec {
                exec_id: id,
                program: if self.chance(50) {
                    Program::Shell(self.string(40))
                } else {
                    Program::Argv((0..self.below(4)).map(|_| self.string(10)).collect())
                },
                env: (0..self.below(3))
                    .map(|_| (self.string(8), self.string(8)))
                    .collect(),
                cwd: self.chance(50).then(|| self.string(12)),
                user: self.chance(50).then(|| self.string(6)),
                timeout_ms: self.chance(50).then(|| self.next()),
                stdin_open: self.chance(50),
                stdin_null: self.chance(50),
                attach: self.chance(50),
                tty: self.chance(50),
                wait_for_reader: self.chance(50),
                rows: self.next() as u16,
                cols: self.next() as u16,
            }),
            1 => HostMsg::CloseStdin { exec_id: id },
            2 => HostMsg::Signal {
                exec_id: id,
                signal: self.next() as i32,
            },
            3 => HostMsg::Attach {
                exec_id: id,
                from: self.next(),
            },
            4 => HostMsg::Status { exec_id: id },
            5 => HostMsg::List,
            6 => HostMsg::Sync { token: self.next() },
            7 => HostMsg::Resize {
                exec_id: id,
                rows: self.next() as u16,
                cols: self.next() as u16,
            },
            8 => HostMsg::Watch {
                id,
                path: self.string(30),
                recursive: self.chance(50),
            },
            _ => HostMsg::FsEnd { id },
        }
    }
    fn agent_msg(&mut self) -> AgentMsg {
        let id = self.string(24);
        match self.below(6) {
            0 => AgentMsg::Hello {
                version: self.next() as u32,
                agent: self.string(10),
                features: (0..self.below(3)).map(|_| self.string(6)).collect(),
            },
            1 => AgentMsg::Started {
                exec_id: id,
                pid: self.next() as u32,
                started_at_ns: self.next() as i64,
                failed: self.chance(30).then(|| {
                    StartFailure::new(
                        [
                            StartFailKind::CwdMissing,
                            StartFailKind::CwdNotDirectory,
                            StartFailKind::NotFound,
                            StartFailKind::Permission,
                            StartFailKind::NotExecutable,
                            StartFailKind::Other,
                        ][self.below(6)],
                        self.string(30),
                    )
                }),
            },
            2 => AgentMsg::ExecFailed {
                exec_id: id,
                kind: [
                    ExecFailKind::NoSuchUser,
                    ExecFailKind::DuplicateId,
                    ExecFailKind::NoSuchExec,
                    ExecFailKind::Internal,
                ][self.below(4)],
                message: self.string(30),
            },
            3 => AgentMsg::Gap {
                exec_id: id,
                from: self.next(),
                to: self.next(),
            },
            4 => AgentMsg::FsOpened {
                id,
                size: self.next(),
                offset: self.next(),
                length: self.chance(50).then(|| self.next()),
            },
            _ => AgentMsg::Synced { token: self.next() },
        }
    }
    fn data(&mut self) -> (String, Stream, u64, Vec<u8>) {
        let n = if self.chance(3) { 70_000 } else { 300 };
        (self.id(), self.stream(), self.next(), self.bytes(n))
    }
}

/// A reader that hands out its bytes in pieces of random sizes (1 to `max` bytes a read).
struct Pieces {
    bytes: Vec<u8>,
    at: usize,
    rng: Rng,
    max: usize,
}

impl AsyncRead for Pieces {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let max = self.max;
        let n = (1 + self.rng.below(max))
            .min(buf.remaining())
            .min(self.bytes.len() - self.at);
        let at = self.at;
        buf.put_slice(&self.bytes[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(()))
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

/// Runs `one` on inputs of `make` until the count or the budget is reached; a panic fails the
/// test with the input and the seed. Returns the executions.
fn fuzz(
    target: &str,
    mut make: impl FnMut(&mut Rng) -> Vec<u8>,
    mut one: impl FnMut(&[u8], &mut Rng),
) -> u64 {
    let seed = env_or("SBX_FUZZ_SEED", 0x5b7f_0017u64);
    let iters = env_or("SBX_FUZZ_ITERS", DEFAULT_ITERS);
    let budget = Duration::from_secs(env_or("SBX_FUZZ_SECONDS", DEFAULT_BUDGET.as_secs()));
    let mut rng = Rng(seed);
    let start = Instant::now();
    let mut n = 0;
    while n < iters && start.elapsed() < budget {
        let input = make(&mut rng);
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| one(&input, &mut rng))) {
            let what = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let shown = &input[..input.len().min(512)];
            panic!(
                "{target}: execution {n} (SBX_FUZZ_SEED={seed}) panicked: {what}\ninput: {shown:?}"
            );
        }
        n += 1;
    }
    println!(
        "fuzz {target}: {n} executions in {:.2?}, seed {seed}, no panic",
        start.elapsed()
    );
    assert!(n >= 1000, "{target}: only {n} executions");
    n
}

/// Encoded frames of every kind, and what each must read back as (host's messages, agent's
/// messages and data frames in one stream: each is read with the type of its side).
#[derive(Debug)]
enum Sent {
    Host(HostMsg),
    Agent(AgentMsg),
    Any(Value),
    Data(String, Stream, u64, Vec<u8>),
}

fn frames(rng: &mut Rng) -> (Vec<u8>, Vec<Sent>) {
    let mut out = Vec::new();
    let mut sent = Vec::new();
    for _ in 0..1 + rng.below(6) {
        let s = match rng.below(4) {
            0 => Sent::Host(rng.host_msg()),
            1 => Sent::Agent(rng.agent_msg()),
            2 => Sent::Any(rng.value(3)),
            _ => {
                let (id, stream, pos, bytes) = rng.data();
                Sent::Data(id, stream, pos, bytes)
            }
        };
        match &s {
            Sent::Host(m) => out.extend(encode_msg(m).unwrap()),
            Sent::Agent(m) => out.extend(encode_msg(m).unwrap()),
            Sent::Any(v) => out.extend(encode_msg(v).unwrap()),
            Sent::Data(id, stream, pos, bytes) => {
                assert!(bytes.len() <= MAX_DATA);
                out.extend(encode_data(id, *stream, *pos, bytes));
            }
        }
        sent.push(s);
    }
    (out, sent)
}

/// Reads frames until the end, an error or 64 frames: nothing may panic or hang.
async fn drain<M: for<'de> serde::Deserialize<'de>, R: AsyncRead + Unpin>(r: &mut R) -> usize {
    let mut n = 0;
    while n < 64 {
        match read_frame::<M, _>(r).await {
            Ok(Some(_)) => n += 1,
            Ok(None) | Err(_) => break,
        }
    }
    n
}

fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(5) {
            0 if !out.is_empty() => {
                let i = at.min(out.len() - 1);
                out[i] ^= 1 << rng.below(8);
            }
            1 if !out.is_empty() => {
                let end = (at + rng.below(8)).min(out.len());
                out.drain(at.min(end)..end);
            }
            2 => out.truncate(at),
            3 if out.len() >= 4 => {
                // A length prefix anywhere: small, at the limit, just over it, or huge.
                let len: u32 = [0, 1, 10, 11, 4 << 20, (4 << 20) + 1, u32::MAX][rng.below(7)];
                let i = at.min(out.len() - 4);
                out[i..i + 4].copy_from_slice(&len.to_le_bytes());
            }
            _ => {
                let b = rng.bytes(6);
                out.splice(at..at, b);
            }
        }
    }
    out
}

#[test]
fn fuzz_read_frame_never_panics() {
    let rt = runtime();
    fuzz(
        "read_frame (random and mutated input)",
        |rng| match rng.below(3) {
            0 => rng.bytes(64),
            1 => {
                // A data frame's header with random fields after a good length.
                let mut b = rng.bytes(40);
                let len = b.len().saturating_sub(4) as u32;
                if b.len() >= 5 {
                    b[..4].copy_from_slice(&len.to_le_bytes());
                    b[4] = 1 + rng.below(2) as u8;
                }
                b
            }
            _ => {
                let (valid, _) = frames(rng);
                mutate(rng, &valid)
            }
        },
        |input, rng| {
            rt.block_on(async {
                drain::<HostMsg, _>(&mut &input[..]).await;
                drain::<AgentMsg, _>(&mut &input[..]).await;
                let mut pieces = Pieces {
                    bytes: input.to_vec(),
                    at: 0,
                    rng: Rng(rng.next()),
                    max: 7,
                };
                drain::<Value, _>(&mut pieces).await;
            })
        },
    );
}

#[test]
fn fuzz_read_frame_round_trips() {
    let rt = runtime();
    let sent = std::cell::RefCell::new(Vec::new());
    let mut frames_read = 0u64;
    fuzz(
        "read_frame (valid frames round-trip)",
        |rng| {
            let (bytes, s) = frames(rng);
            *sent.borrow_mut() = s;
            bytes
        },
        |input, rng| {
            let max = [1, 3, 64, 1 << 20][rng.below(4)];
            let mut r = Pieces {
                bytes: input.to_vec(),
                at: 0,
                rng: Rng(rng.next()),
                max,
            };
            let sent = sent.take();
            rt.block_on(async {
                for s in &sent {
                    match s {
                        Sent::Host(m) => {
                            let f = read_frame::<HostMsg, _>(&mut r).await.unwrap();
                            assert_eq!(f, Some(Frame::Msg(m.clone())));
                        }
                        Sent::Agent(m) => {
                            let f = read_frame::<AgentMsg, _>(&mut r).await.unwrap();
                            assert_eq!(f, Some(Frame::Msg(m.clone())));
                        }
                        Sent::Any(v) => {
                            let f = read_frame::<Value, _>(&mut r).await.unwrap();
                            assert_eq!(f, Some(Frame::Msg(v.clone())));
                        }
                        Sent::Data(id, stream, pos, bytes) => {
                            let f = read_frame::<HostMsg, _>(&mut r).await.unwrap();
                            let want = Frame::Data {
                                exec_id: id.clone(),
                                stream: *stream,
                                pos: *pos,
                                bytes: bytes.clone(),
                            };
                            assert_eq!(f, Some(want));
                        }
                    }
                    frames_read += 1;
                }
                assert!(read_frame::<Value, _>(&mut r).await.unwrap().is_none());
            });
        },
    );
    println!("fuzz read_frame: {frames_read} frames read back equal");
}

/// A frame cut anywhere is an error (or a clean end when cut before its length), never a
/// frame and never a panic.
#[test]
fn fuzz_read_frame_cut_frames() {
    let rt = runtime();
    fuzz(
        "read_frame (cut frames)",
        |rng| {
            let (mut bytes, _) = frames(rng);
            let first = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize + 4;
            bytes.truncate(rng.below(first));
            bytes
        },
        |input, _| {
            rt.block_on(async {
                let r = read_frame::<Value, _>(&mut &input[..]).await;
                match r {
                    Ok(None) => assert!(input.len() < 4, "{} bytes read as the end", input.len()),
                    Ok(Some(f)) => panic!("a cut frame read as {f:?}"),
                    Err(ProtoError::Io(_)) => {}
                    Err(e) => assert!(input.len() >= 5, "{e}"),
                }
            })
        },
    );
}
