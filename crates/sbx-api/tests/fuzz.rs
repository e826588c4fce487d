//! Fuzzing of the request parsers, bounded in time so that it runs in `cargo test`: a seeded
//! random harness (`SBX_FUZZ_SEED` to replay one seed, `SBX_FUZZ_ITERS` for a longer run).
//! Inputs: random bytes, random JSON documents built of the calls' own field names, byte-level
//! mutations of valid bodies, and valid bodies built by type.
//! Properties: no panic on any input; a body that parses parses the same once re-encoded
//! (`serde_json` out and in); a valid body built by type parses, and what it says comes out
//! unchanged (command, env, metadata, cwd, stdin, timeout, terminal size).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use base64::Engine;
use sbx_api::{parse_exec_request, parse_run_request, parse_sandbox_create, Command, Encoding};
use serde_json::{json, Map, Value};

/// Each target stops at this many executions or after this long (`SBX_FUZZ_SECONDS`),
/// whichever comes first.
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
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// A string of tricky characters: ASCII, `/`, `.`, `=`, NUL, controls, quotes, non-ASCII.
    fn string(&mut self, max: usize) -> String {
        const CHARS: &[char] = &[
            'a',
            'b',
            'Z',
            '0',
            '9',
            ' ',
            '/',
            '.',
            '=',
            '-',
            '_',
            ':',
            '\0',
            '\n',
            '\t',
            '"',
            '\\',
            '$',
            '*',
            '\u{7f}',
            'é',
            'ß',
            '中',
            '\u{202e}',
            '\u{fffd}',
            '😀',
            '\u{10ffff}',
        ];
        let n = self.below(max + 1);
        (0..n).map(|_| *self.pick(CHARS)).collect()
    }
    /// A string without NUL, `=` (when `no_eq`), and not empty.
    fn clean_string(&mut self, max: usize, no_eq: bool) -> String {
        let s: String = self
            .string(max)
            .chars()
            .filter(|c| *c != '\0' && !(no_eq && *c == '='))
            .collect();
        if s.is_empty() {
            "x".into()
        } else {
            s
        }
    }
    fn number(&mut self) -> Value {
        match self.below(8) {
            0 => json!(0),
            1 => json!(-1),
            2 => json!(self.next() as i64),
            3 => json!(self.next()),
            4 => json!(self.below(2000)),
            5 => json!((self.next() as f64) / 1e6),
            6 => json!(0.0005),
            _ => json!(1e300),
        }
    }
    /// A random JSON value; objects take their keys from `fields` most of the time.
    fn value(&mut self, fields: &[&str], depth: u32) -> Value {
        let kinds = if depth == 0 { 4 } else { 6 };
        match self.below(kinds) {
            0 => Value::Null,
            1 => Value::Bool(self.chance(50)),
            2 => self.number(),
            3 => Value::String(self.string(24)),
            4 => Value::Array(
                (0..self.below(5))
                    .map(|_| self.value(fields, depth - 1))
                    .collect(),
            ),
            _ => Value::Object(self.object(fields, depth - 1)),
        }
    }
    fn object(&mut self, fields: &[&str], depth: u32) -> Map<String, Value> {
        (0..self.below(8))
            .map(|_| {
                let key = if self.chance(80) {
                    self.pick(fields).to_string()
                } else {
                    self.string(8)
                };
                (key, self.value(fields, depth))
            })
            .collect()
    }
    /// `input` changed at a few random places.
    fn mutate(&mut self, input: &[u8]) -> Vec<u8> {
        const TOKENS: &[&[u8]] = &[
            b"{",
            b"}",
            b"[",
            b"]",
            b"\"",
            b",",
            b":",
            b"null",
            b"true",
            b"1e999",
            b"-0",
            b"\\u0000",
            b"\\ud800",
            b"\xff",
            b"\x00",
            b"\"command\"",
            b"[\"\"]",
            b"0.0001",
        ];
        let mut out = input.to_vec();
        for _ in 0..1 + self.below(4) {
            let at = self.below(out.len() + 1);
            match self.below(6) {
                0 if !out.is_empty() => {
                    let i = at.min(out.len() - 1);
                    out[i] ^= 1 << self.below(8);
                }
                1 if !out.is_empty() => {
                    let end = (at + self.below(8)).min(out.len());
                    out.drain(at.min(end)..end);
                }
                2 => {
                    let t = self.pick(TOKENS);
                    out.splice(at..at, t.iter().copied());
                }
                3 => out.truncate(at),
                4 if !out.is_empty() => {
                    let from = self.below(out.len());
                    let end = (from + self.below(16)).min(out.len());
                    let piece = out[from..end].to_vec();
                    out.splice(at..at, piece);
                }
                _ => {
                    let b = self.bytes(4);
                    out.splice(at..at, b);
                }
            }
        }
        out
    }
}

fn seed() -> u64 {
    std::env::var("SBX_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5b7f_0017)
}

fn budget() -> Duration {
    std::env::var("SBX_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_BUDGET)
}

fn iters() -> u64 {
    std::env::var("SBX_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_ITERS)
}

/// Runs `one` on inputs made by `make` until the count or the budget is reached; a panic fails
/// the test with the input (escaped) and where to replay it. Returns the executions.
fn fuzz(
    target: &str,
    mut make: impl FnMut(&mut Rng) -> Vec<u8>,
    mut one: impl FnMut(&[u8], &mut Rng),
) -> u64 {
    let seed = seed();
    let mut rng = Rng(seed);
    let (iters, budget) = (iters(), budget());
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
            panic!(
                "{target}: execution {n} (SBX_FUZZ_SEED={seed}) panicked: {what}\ninput: {:?}",
                String::from_utf8_lossy(&input)
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

const RUN_FIELDS: &[&str] = &[
    "command",
    "start",
    "start_command",
    "ready",
    "egress",
    "tmp",
    "runtime",
    "init",
    "image",
    "limits",
    "name",
    "env",
    "metadata",
    "volumes",
    "public_ports",
    "inbound",
    "sleep_after_seconds",
    "expires_at",
    "on_expiry",
    "hostname",
    "stop",
    "secret_env",
    "cwd",
    "user",
    "timeout_seconds",
    "stdin",
    "encoding",
    "stream",
    "wait_for_reader",
    "region",
    "memory_bytes",
    "vcpus",
    "disk_bytes",
    "tcp",
    "http",
    "command",
    "signal",
    "grace_seconds",
];

/// The exec call's fields, as the parser knows them.
const EXEC_FIELDS: &[&str] = &sbx_api::sandbox::EXEC_FIELDS;

/// Valid bodies of the run call, written by hand: the seeds of the mutations.
fn run_seeds() -> Vec<Vec<u8>> {
    [
        json!({"command": "echo hi"}),
        json!({"command": ["python3", "-c", "print(1)"], "env": {"A": "b"}, "cwd": "/tmp",
               "timeout_seconds": 2.5, "stdin": "aGk=", "encoding": "base64"}),
        json!({"command": "ls", "limits": {"memory_bytes": 536870912, "vcpus": 1},
               "metadata": {"k": "v"}, "name": "web-1", "hostname": "box",
               "start_command": ["sleep", "9"], "ready": {"tcp": 8080},
               "stop": {"signal": "SIGTERM", "grace_seconds": 5}, "public_ports": [8080],
               "sleep_after_seconds": null, "expires_at": "2030-01-01T00:00:00Z",
               "egress": {"allow": ["example.com"]}, "tmp": "memory", "stream": false}),
    ]
    .iter()
    .map(|v| serde_json::to_vec(v).unwrap())
    .collect()
}

fn exec_seeds() -> Vec<Vec<u8>> {
    [
        json!({"command": "echo hi"}),
        json!({"command": ["cat"], "stdin": "aGk=", "encoding": "base64", "stdin_open": true,
               "env": {"X": "1"}, "cwd": "/", "timeout_seconds": 1, "wait_seconds": 3}),
        json!({"command": "bash", "tty": true, "rows": 40, "cols": 120, "stream": true,
               "wait_for_reader": true, "user": "root"}),
    ]
    .iter()
    .map(|v| serde_json::to_vec(v).unwrap())
    .collect()
}

/// One input of the four kinds, `seeds` for the mutations.
fn input(rng: &mut Rng, fields: &[&str], seeds: &[Vec<u8>], valid: &[u8]) -> Vec<u8> {
    match rng.below(4) {
        0 => rng.bytes(64),
        1 => serde_json::to_vec(&Value::Object(rng.object(fields, 3))).unwrap(),
        2 => {
            let s = rng.pick(seeds).clone();
            rng.mutate(&s)
        }
        _ => valid.to_vec(),
    }
}

/// The same parse once the JSON is re-encoded (if it is JSON at all).
fn reencoded(body: &[u8]) -> Option<Vec<u8>> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .map(|v| serde_json::to_vec(&v).unwrap())
}

/// A valid command, its JSON and the [`Command`] it must parse to.
fn command(rng: &mut Rng) -> (Value, Command) {
    if rng.chance(50) {
        let s = rng.clean_string(40, false);
        (json!(s), Command::Shell(s))
    } else {
        let args: Vec<String> = (0..1 + rng.below(5))
            .map(|i| {
                if i == 0 {
                    rng.clean_string(12, false)
                } else {
                    rng.string(12).replace('\0', "")
                }
            })
            .collect();
        (json!(args), Command::Argv(args))
    }
}

fn env(rng: &mut Rng) -> BTreeMap<String, String> {
    (0..rng.below(5))
        .map(|_| (rng.clean_string(10, true), rng.string(20).replace('\0', "")))
        .collect()
}

/// What a valid body built by type says, to compare with what the parser made of it.
struct Said {
    command: Command,
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    stdin: Option<Vec<u8>>,
    encoding: Encoding,
    timeout_ms: Option<u64>,
}

fn valid_common(rng: &mut Rng, obj: &mut Map<String, Value>) -> Said {
    let (cv, command) = command(rng);
    obj.insert("command".into(), cv);
    let env = env(rng);
    if !env.is_empty() || rng.chance(30) {
        obj.insert("env".into(), json!(env));
    }
    let cwd = rng
        .chance(50)
        .then(|| format!("/{}", rng.string(20).replace('\0', "")));
    if let Some(c) = &cwd {
        obj.insert("cwd".into(), json!(c));
    }
    let encoding = if rng.chance(50) {
        Encoding::Base64
    } else {
        Encoding::Utf8
    };
    let stdin = rng.chance(50).then(|| match encoding {
        Encoding::Base64 => rng.bytes(40),
        Encoding::Utf8 => rng.string(20).into_bytes(),
    });
    if let Some(b) = &stdin {
        let text = match encoding {
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(b),
            Encoding::Utf8 => String::from_utf8(b.clone()).unwrap(),
        };
        obj.insert("stdin".into(), json!(text));
    }
    if encoding == Encoding::Base64 || rng.chance(20) {
        let name = if encoding == Encoding::Base64 {
            "base64"
        } else {
            "utf8"
        };
        obj.insert("encoding".into(), json!(name));
    }
    let timeout_ms = rng.chance(50).then(|| 1 + rng.below(10_000_000) as u64);
    if let Some(ms) = timeout_ms {
        obj.insert("timeout_seconds".into(), json!(ms as f64 / 1000.0));
    }
    Said {
        command,
        env,
        cwd,
        stdin,
        encoding,
        timeout_ms,
    }
}

/// A deadline of `ms` whole milliseconds written as seconds comes back as `ms`: `seconds_to_ms`
/// takes a product a hair above a whole number (2056.11 * 1000.0 = 2056110.0000000002) as that
/// number.
fn within_a_ms(got: Duration, ms: u64) {
    let got = got.as_millis() as u64;
    assert_eq!(got, ms, "{ms} ms came back as {got} ms");
}

#[test]
fn fuzz_parse_run_request() {
    let seeds = run_seeds();
    let mut valid_ok = 0u64;
    let said: RefCell<Option<Said>> = RefCell::new(None);
    fuzz(
        "parse_run_request",
        |rng| {
            let mut obj = Map::new();
            let s = valid_common(rng, &mut obj);
            let mut metadata = Map::new();
            for _ in 0..rng.below(4) {
                metadata.insert(rng.clean_string(20, false), json!(rng.string(30)));
            }
            if !metadata.is_empty() {
                obj.insert("metadata".into(), Value::Object(metadata));
            }
            let valid = serde_json::to_vec(&Value::Object(obj)).unwrap();
            let body = input(rng, RUN_FIELDS, &seeds, &valid);
            *said.borrow_mut() = (body == valid).then_some(s);
            body
        },
        |body, _| {
            let first = parse_run_request(body);
            if let Some(again) = reencoded(body) {
                assert_eq!(parse_run_request(&again).ok(), first.clone().ok());
            }
            if let Some(s) = said.take() {
                let r = first.unwrap_or_else(|e| panic!("a valid body refused: {e:?}"));
                assert_eq!(r.command, s.command);
                assert_eq!(r.env, s.env);
                assert_eq!(r.cwd, s.cwd);
                assert_eq!(r.stdin, s.stdin);
                assert_eq!(r.encoding, s.encoding);
                if let Some(ms) = s.timeout_ms {
                    within_a_ms(r.timeout, ms);
                }
                valid_ok += 1;
            }
        },
    );
    println!("fuzz parse_run_request: {valid_ok} valid bodies round-tripped");
    assert!(valid_ok > 100);
}

#[test]
fn fuzz_parse_exec_request() {
    let seeds = exec_seeds();
    let mut valid_ok = 0u64;
    let said: RefCell<Option<(Said, u16, u16, bool)>> = RefCell::new(None);
    fuzz(
        "parse_exec_request",
        |rng| {
            let mut obj = Map::new();
            let s = valid_common(rng, &mut obj);
            let (rows, cols) = (1 + rng.below(1000) as u16, 1 + rng.below(1000) as u16);
            let tty = rng.chance(50);
            obj.insert("rows".into(), json!(rows));
            obj.insert("cols".into(), json!(cols));
            obj.insert("tty".into(), json!(tty));
            obj.insert("wait_seconds".into(), json!(rng.below(300)));
            let valid = serde_json::to_vec(&Value::Object(obj)).unwrap();
            let body = input(rng, EXEC_FIELDS, &seeds, &valid);
            *said.borrow_mut() = (body == valid).then_some((s, rows, cols, tty));
            body
        },
        |body, _| {
            let first = parse_exec_request(body);
            if let Some(again) = reencoded(body) {
                let second = parse_exec_request(&again);
                assert_eq!(
                    format!("{:?}", second.as_ref().ok()),
                    format!("{:?}", first.as_ref().ok())
                );
            }
            if let Some((s, rows, cols, tty)) = said.take() {
                let r = first.unwrap_or_else(|e| panic!("a valid body refused: {e:?}"));
                assert_eq!(r.command, s.command);
                assert_eq!(r.env, s.env);
                assert_eq!(r.cwd, s.cwd);
                assert_eq!(r.stdin, s.stdin);
                assert_eq!(r.encoding, s.encoding);
                assert_eq!(r.timeout.is_some(), s.timeout_ms.is_some());
                if let (Some(t), Some(ms)) = (r.timeout, s.timeout_ms) {
                    within_a_ms(t, ms);
                }
                assert_eq!((r.rows, r.cols, r.tty), (rows, cols, tty));
                valid_ok += 1;
            }
        },
    );
    println!("fuzz parse_exec_request: {valid_ok} valid bodies round-tripped");
    assert!(valid_ok > 100);
}

#[test]
fn fuzz_parse_sandbox_create() {
    let seeds = run_seeds();
    fuzz(
        "parse_sandbox_create",
        |rng| input(rng, RUN_FIELDS, &seeds, b"{}"),
        |body, _| {
            let first = parse_sandbox_create(body);
            if let Some(again) = reencoded(body) {
                let second = parse_sandbox_create(&again);
                assert_eq!(
                    format!("{:?}", second.as_ref().ok()),
                    format!("{:?}", first.as_ref().ok())
                );
            }
        },
    );
}
