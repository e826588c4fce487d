//! Property tests of the request types' wire form: for every valid request `r` of each type
//! the node parses, `parse(to_json(r)) == r`, through the bytes a client sends
//! (`serde_json::to_vec`). What a client (sbx-client) writes is what the node reads.
//!
//! The requests are generated valid by construction (the rules across fields applied after
//! the fields are drawn). Fractions of seconds are drawn as whole milliseconds, the
//! precision every deadline of the API has.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use sbx_api::egress::{Egress, HostPattern, HttpRule, Inject, Target};
use sbx_api::run::{Runtime, STOP_SIGNALS};
use sbx_api::{
    parse_exec_request, parse_run_request, parse_sandbox_create, parse_sandbox_patch,
    parse_secret_put, parse_volume_create, signal_name, signal_number, valid_name, Command,
    Encoding, ExecRequest, Init, Limits, OnExpiry, Ready, Region, RunRequest, SandboxCreate,
    SandboxPatch, SecretEnv, SecretPut, Stop, Tmp, VolumeCreate, VolumeMount,
};
use serde_json::{json, Map, Value};

fn bytes_of(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("a request as JSON")
}

/// Text of any characters but NUL (which no command, path or variable may hold).
fn text(max: usize) -> impl Strategy<Value = String> {
    vec(
        prop_oneof![
            4 => proptest::char::range('a', 'z'),
            1 => Just(' '),
            1 => Just('"'),
            1 => Just('\\'),
            1 => Just('\n'),
            1 => Just('é'),
            1 => Just('😀'),
            1 => proptest::char::range('\u{1}', '\u{1f}'),
        ],
        0..=max,
    )
    .prop_map(|c| c.into_iter().collect())
}

fn nonempty_text(max: usize) -> impl Strategy<Value = String> {
    text(max).prop_filter("not empty", |s| !s.is_empty())
}

fn name() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?".prop_filter("a name", |s| valid_name(s))
}

fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        nonempty_text(20).prop_map(Command::Shell),
        (nonempty_text(8), vec(text(8), 0..4)).prop_map(|(first, rest)| {
            let mut a = vec![first];
            a.extend(rest);
            Command::Argv(a)
        }),
    ]
}

fn env() -> impl Strategy<Value = BTreeMap<String, String>> {
    btree_map("[A-Z_][A-Z0-9_]{0,6}", text(10), 0..4)
}

fn abs_path() -> impl Strategy<Value = String> {
    "(/[a-z0-9_.-]{1,6}){1,3}".prop_filter("no . or ..", |p| {
        p.split('/').all(|part| part != "." && part != "..")
    })
}

fn user() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z][a-z0-9]{0,7}",
        (0u32..=65535).prop_map(|u| u.to_string()),
        (0u32..=65535, 0u32..=65535).prop_map(|(u, g)| format!("{u}:{g}")),
    ]
}

/// Whole milliseconds from `lo` to `hi`, as a deadline.
fn millis(lo: u64, hi: u64) -> impl Strategy<Value = Duration> {
    (lo..=hi).prop_map(Duration::from_millis)
}

/// Seconds of whole milliseconds from `lo` to `hi` ms.
fn seconds(lo: u64, hi: u64) -> impl Strategy<Value = f64> {
    (lo..=hi).prop_map(|ms| ms as f64 / 1000.0)
}

/// Input and the encoding it is written in: text for utf8, any bytes for base64.
fn stdin_and_encoding() -> impl Strategy<Value = (Option<Vec<u8>>, Encoding)> {
    prop_oneof![
        option::of(text(16).prop_map(String::into_bytes)).prop_map(|s| (s, Encoding::Utf8)),
        option::of(vec(any::<u8>(), 0..16)).prop_map(|s| (s, Encoding::Base64)),
    ]
}

fn unique_ports() -> impl Strategy<Value = Vec<u16>> {
    vec(1u16..=65535, 0..5).prop_map(|mut v| {
        let mut seen = Vec::new();
        v.retain(|p| {
            let first = !seen.contains(p);
            seen.push(*p);
            first
        });
        v
    })
}

fn rfc3339() -> impl Strategy<Value = String> {
    (
        2000u32..2100,
        1u32..=12,
        1u32..=28,
        0u32..24,
        0u32..60,
        0u32..60,
    )
        .prop_map(|(y, mo, d, h, mi, s)| format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z"))
}

fn hostname() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?(\\.[a-z0-9]{1,6}){0,2}"
}

/// `runtime` in the canonical form the parser keeps.
fn runtime() -> impl Strategy<Value = Value> {
    let ulimits = (1i64..=1_048_576, 0i64..=1_048_576)
        .prop_map(|(a, b)| json!({"nofile": {"soft": a, "hard": (a + b).min(1_048_576)}}));
    let sysctls = (0u32..2000).prop_map(|n| json!({"net.ipv4.tcp_keepalive_time": n.to_string()}));
    let tmpfs = (
        "/run/[a-z]{1,6}",
        option::of(4096u64..1 << 30),
        0u32..=0o7777,
    )
        .prop_map(|(p, size, mode)| json!([{"path": p, "size_bytes": size, "mode": mode}]));
    let dns = (
        vec((any::<u8>(), any::<u8>()), 0..3),
        vec("[a-z]{1,6}\\.example", 0..3),
    )
        .prop_map(|(servers, search)| {
            let servers: Vec<String> = servers
                .iter()
                .map(|(a, b)| format!("10.0.{a}.{b}"))
                .collect();
            json!({"servers": servers, "search": search, "options": ["ndots:2"]})
        });
    (
        option::of(ulimits),
        option::of(sysctls),
        option::of(tmpfs),
        option::of(dns),
        option::of((1u64 << 20)..=(1u64 << 40)),
    )
        .prop_filter_map("a valid runtime", |(u, s, t, d, shm)| {
            let v =
                json!({"ulimits": u, "sysctls": s, "tmpfs": t, "dns": d, "shm_size_bytes": shm});
            Runtime::parse(&v).ok().map(|r| r.to_value())
        })
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<u32>().prop_map(|n| IpAddr::V4(Ipv4Addr::from(n))),
        any::<u128>().prop_map(|n| IpAddr::V6(Ipv6Addr::from(n))),
    ]
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        Just(Target::Any),
        (ip(), any::<u8>()).prop_map(|(ip, p)| {
            let max = if ip.is_ipv4() { 32 } else { 128 };
            Target::Net(
                ipnet::IpNet::new(ip, p % (max + 1))
                    .expect("a prefix")
                    .trunc(),
            )
        }),
        hostname().prop_map(Target::Name),
        hostname().prop_map(Target::Suffix),
    ]
}

fn host_pattern() -> impl Strategy<Value = HostPattern> {
    prop_oneof![
        hostname().prop_map(HostPattern::Name),
        hostname().prop_map(HostPattern::Suffix),
    ]
}

fn egress() -> impl Strategy<Value = Egress> {
    let http = (
        host_pattern(),
        vec(prop_oneof![Just("GET"), Just("POST"), Just("PATCH")], 0..3),
        vec(prop_oneof!["/[a-z*]{0,8}", Just("*".to_string())], 0..3),
    )
        .prop_map(|(host, methods, paths)| HttpRule {
            host,
            methods: methods.into_iter().map(String::from).collect(),
            paths,
        });
    let inject = (
        host_pattern(),
        name(),
        prop_oneof![Just("authorization"), Just("x-api-key")],
        prop_oneof![
            Just("{secret}".to_string()),
            "[A-Za-z ]{0,8}\\{secret\\}".prop_map(String::from)
        ],
    )
        .prop_map(|(host, secret, header, value)| Inject {
            host,
            secret,
            header: header.into(),
            value,
        });
    (
        any::<bool>(),
        vec(target(), 0..4),
        vec(target(), 0..4),
        vec(http, 0..3),
        vec(inject, 0..3),
        vec(1u16..=65535, 0..5),
    )
        .prop_map(|(default_deny, allow, deny, http, inject, mut ports)| {
            ports.sort_unstable();
            ports.dedup();
            Egress {
                default_deny,
                allow,
                deny,
                http,
                inject,
                deny_ports: ports,
            }
        })
}

fn ready() -> impl Strategy<Value = Ready> {
    prop_oneof![
        (1u16..=65535).prop_map(|port| Ready::Tcp { port }),
        (1u16..=65535, "/[a-z0-9/?=]{0,10}").prop_map(|(port, path)| Ready::Http { port, path }),
        command().prop_map(Ready::Command),
    ]
}

fn stop() -> impl Strategy<Value = Stop> {
    (
        option::of(proptest::sample::select(&STOP_SIGNALS[..])),
        option::of(0u32..=600_000),
    )
        .prop_map(|(sig, grace_ms)| Stop {
            signal: sig.map(|s| signal_number(s).map(signal_name).unwrap_or(s.into())),
            grace_ms,
        })
}

fn volume_mount() -> impl Strategy<Value = VolumeMount> {
    (
        abs_path(),
        name(),
        any::<bool>(),
        any::<bool>(),
        option::of(Just(
            json!({"name": "disks/vol-0123456789abcdef/e1/r0000000001-ab"}),
        )),
    )
        .prop_map(|(path, volume, read_only, copy, version)| VolumeMount {
            path,
            volume,
            read_only,
            copy,
            version,
        })
}

/// Where a sandbox is made from.
#[derive(Clone, Debug)]
enum Source {
    Base,
    Image(String, Option<String>),
    Snapshot(String),
    Template(String),
}

fn source() -> impl Strategy<Value = Source> {
    prop_oneof![
        Just(Source::Base),
        ("[a-z]{1,8}(:[0-9]{1,2})?", option::of(name())).prop_map(|(i, s)| Source::Image(i, s)),
        name().prop_map(Source::Snapshot),
        prop_oneof![Just("base".to_string()), "img-[a-z0-9]{8}"].prop_map(Source::Template),
    ]
}

/// The fields of a run drawn in groups, each boxed: one strategy of forty parts is too deep a
/// type for a test thread's stack.
fn run_request() -> impl Strategy<Value = RunRequest> {
    let machine = (
        command(),
        option::of(any::<bool>()),
        option::of(command()),
        option::of(ready()),
        option::of(egress()),
        option::of(any::<bool>()),
        prop_oneof![Just(Tmp::Disk), Just(Tmp::Memory)],
        option::of(runtime()),
        option::of(Just(Init::Systemd)),
        any::<bool>(),
        source(),
        (option::of(1u32..=32), option::of(64u64..=4096)),
    )
        .boxed();
    let sandbox = (
        option::of(name()),
        env(),
        btree_map("[a-z.]{1,10}", text(12), 0..4),
        vec(volume_mount(), 0..3),
        (unique_ports(), option::of(unique_ports())),
        option::of(Just(json!([{"port": 22}]))),
        option::of(option::of(seconds(1000, 1_000_000_000_000))),
    )
        .boxed();
    let life = (
        option::of(rfc3339()),
        prop_oneof![
            Just(OnExpiry::Delete),
            Just(OnExpiry::Sleep),
            Just(OnExpiry::Hold)
        ],
        any::<bool>(),
        (
            option::of(0u32..=60_000),
            option::of(0u32..=900_000),
            option::of(1000u32..=86_400_000),
        ),
        option::of((0u32..24, 0u32..60).prop_map(|(h, m)| format!("{h:02}:{m:02}"))),
        option::of(Just(json!({"every_seconds": 60}))),
        option::of(1000u64..=i64::MAX as u64),
        option::of(hostname()),
        option::of(stop()),
    )
        .boxed();
    let run = (
        btree_map("S[A-Z0-9_]{0,6}", nonempty_text(10), 0..3),
        option::of(abs_path()),
        option::of(user()),
        millis(1, 1_000_000_000_000),
        stdin_and_encoding(),
        option::of(any::<bool>()),
        any::<bool>(),
        option::of(prop_oneof![
            Just(Region::Na),
            Just(Region::Eu),
            Just(Region::Ap)
        ]),
    )
        .boxed();
    (machine, sandbox, life, run).prop_map(|(m, s, l, x)| {
        let mut r = RunRequest::new(m.0);
        (r.start, r.start_command, r.ready) = (m.1, m.2, m.3);
        r.egress = m.4.map(|e| e.to_json());
        (
            r.guest_mitigations,
            r.tmp,
            r.runtime,
            r.init,
            r.project_network,
        ) = (m.5, m.6, m.7, m.8, m.9);
        match m.10 {
            Source::Base => {}
            Source::Image(i, secret) => {
                r.image = Some(i);
                r.image_pull_secret = secret;
            }
            Source::Snapshot(s) => r.snapshot = Some(s),
            Source::Template(t) => r.template = Some(t),
        }
        r.limits = Limits {
            vcpus: m.11 .0,
            memory_bytes: m.11 .1.map(|n| n * (2 << 20)),
        };
        let (name, env, metadata, volumes, ports, inbound, sleep_after) = s;
        // secret_env's names are none of env's.
        r.secret_env = SecretEnv(
            x.0.into_iter()
                .filter(|(k, _)| !env.contains_key(k))
                .collect(),
        );
        (r.name, r.env, r.metadata, r.volumes) = (name, env, metadata, volumes);
        (r.public_ports, r.public_ports_except) = ports;
        (r.inbound, r.sleep_after_seconds) = (inbound, sleep_after);
        (r.expires_at, r.on_expiry, r.held_asleep) = (l.0, l.1, l.2);
        (r.sleep_notice_ms, r.sleep_hold_max_ms, r.suspend_after_ms) = l.3;
        (r.wake_daily_at, r.checkpoint, r.delete_after_idle_ms) = (l.4, l.5, l.6);
        (r.hostname, r.stop) = (l.7, l.8);
        (r.cwd, r.user, r.timeout) = (x.1, x.2, x.3);
        (r.stdin, r.encoding) = x.4;
        (r.stream, r.wait_for_reader, r.region) = (x.5, x.6, x.7);
        valid_across_fields(&mut r);
        r
    })
}

/// The rules across fields, applied by dropping what breaks them.
fn valid_across_fields(r: &mut RunRequest) {
    if r.snapshot.is_some() || r.template.is_some() {
        (r.start, r.start_command, r.ready, r.runtime, r.init) = (None, None, None, None, None);
    }
    if r.init.is_some() {
        (r.start, r.start_command, r.ready) = (None, None, None);
    }
    if r.start == Some(false) {
        r.start_command = None;
    }
    if r.start != Some(true) && r.start_command.is_none() {
        r.ready = None;
    }
}

fn exec_request() -> impl Strategy<Value = ExecRequest> {
    (
        command(),
        env(),
        option::of(abs_path()),
        option::of(user()),
        option::of(millis(1, 1_000_000_000_000)),
        stdin_and_encoding(),
        (any::<bool>(), any::<bool>(), 1u16..=1000, 1u16..=1000),
        seconds(0, 300_000),
        any::<bool>(),
        option::of(any::<bool>()),
    )
        .prop_map(
            |(command, env, cwd, user, timeout, (stdin, encoding), tty, wait, wfr, stream)| {
                ExecRequest {
                    command,
                    env,
                    cwd,
                    user,
                    timeout,
                    stdin,
                    stdin_open: tty.0,
                    encoding,
                    tty: tty.1,
                    rows: tty.2,
                    cols: tty.3,
                    wait_seconds: wait,
                    wait_for_reader: wfr,
                    stream,
                }
            },
        )
}

fn egress_patch() -> impl Strategy<Value = Option<Option<Map<String, Value>>>> {
    option::of(option::of((egress(), vec(any::<bool>(), 6)).prop_map(
        |(e, nulls)| {
            let mut keys = match e.to_json() {
                Value::Object(m) => m,
                _ => Map::new(),
            };
            for (k, null) in ["default", "allow", "deny", "http", "inject", "deny_ports"]
                .iter()
                .zip(nulls)
            {
                if null {
                    keys.insert((*k).into(), Value::Null);
                }
            }
            keys
        },
    )))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_run_request_reads_back_as_itself(r in run_request()) {
        prop_assert_eq!(r.check(), Ok(()));
        prop_assert_eq!(parse_run_request(&bytes_of(&r.to_json())), Ok(r));
    }

    #[test]
    fn a_sandbox_create_reads_back_as_itself(mut r in run_request()) {
        // A create's spec: no command and none of the fields of a command.
        r.command = Command::Argv(Vec::new());
        (r.stdin, r.encoding, r.stream, r.wait_for_reader) = (None, Encoding::Utf8, None, false);
        r.timeout = RunRequest::new(Command::Argv(Vec::new())).timeout;
        let c = SandboxCreate { spec: r, network: None };
        prop_assert_eq!(parse_sandbox_create(&bytes_of(&c.to_json())), Ok(c));
    }

    #[test]
    fn an_exec_request_reads_back_as_itself(r in exec_request()) {
        prop_assert_eq!(r.check(), Ok(()));
        prop_assert_eq!(parse_exec_request(&bytes_of(&r.to_json())), Ok(r));
    }

    #[test]
    fn egress_rules_read_back_as_themselves(e in egress()) {
        let back = Egress::parse(&serde_json::from_slice(&bytes_of(&e.to_json())).unwrap());
        prop_assert_eq!(back, Ok(e));
    }

    #[test]
    fn a_sandbox_patch_reads_back_as_itself(
        egress in egress_patch(),
        expires_at in option::of(option::of(rfc3339())),
        held_asleep in option::of(any::<bool>()),
    ) {
        let p = SandboxPatch { egress, expires_at, held_asleep };
        prop_assert_eq!(parse_sandbox_patch(&bytes_of(&p.to_json())), Ok(p));
    }

    #[test]
    fn a_volume_create_reads_back_as_itself(
        name in option::of(name()),
        size_bytes in option::of((1u64 << 20)..=u64::MAX),
        shared in any::<bool>(),
    ) {
        let c = VolumeCreate { name, size_bytes, shared };
        prop_assert_eq!(parse_volume_create(&bytes_of(&c.to_json())), Ok(c));
    }

    #[test]
    fn a_secret_put_reads_back_as_itself(
        value in nonempty_text(64),
        hosts in option::of(vec(prop_oneof![hostname(), hostname().prop_map(|h| format!("*.{h}"))], 0..4)),
    ) {
        let hosts = hosts.map(|mut h| { h.dedup(); h });
        let p = SecretPut { value, allowed_hosts: hosts };
        prop_assert_eq!(parse_secret_put(&bytes_of(&p.to_json())), Ok(p));
    }
}

#[test]
fn defaults_are_left_out() {
    let mut e = ExecRequest::new(Command::Argv(vec!["ls".into()]));
    assert_eq!(e.to_json(), json!({"command": ["ls"]}));
    e.timeout = Some(Duration::from_millis(2007));
    assert_eq!(
        e.to_json(),
        json!({"command": ["ls"], "timeout_seconds": 2.007})
    );
    let c = SandboxCreate {
        spec: RunRequest::new(Command::Argv(Vec::new())),
        network: None,
    };
    assert_eq!(c.to_json(), json!({}));
    assert_eq!(VolumeCreate::default().to_json(), json!({}));
}
