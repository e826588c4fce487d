//! Faults: the node is killed (SIGKILL) at a random instant of a create, an exec, an upload, a
//! delete, a sleep, a wake, a snapshot or a fork, and started again on the same data directory,
//! again and again (40 times by default; `SBX_FAULT_ITERATIONS`), from a seed
//! (`SBX_FAULT_SEED`, printed) so that a failure can be replayed. After each restart:
//! - every sandbox the node lists is whole: running, or sleeping and then woken, and it runs a
//!   command; one whose sleep was answered sleeps;
//! - every create that was answered is listed (unless deleted since); every delete that was
//!   answered is gone; a call cut by the kill left its sandbox whole or cleanly gone (a fork
//!   cut midway: its original runs on, each copy is whole or gone);
//! - a counter process started in each sandbox counts on (across sleeps, wakes and kills);
//! - every upload that was answered reads back byte for byte; every command that was answered
//!   has its object;
//! - every snapshot the node lists is ready (one cut midway is not listed), and every one
//!   answered is listed;
//! - nothing is left on the host of a sandbox the node does not list (or keep warm):
//!   processes, cgroups, mounts, directories, sleep images, snapshot directories, and no
//!   host interface on the node's range but its own.

#[allow(dead_code, unused_imports)]
#[path = "../it/common/mod.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{get_json, stdout, TestNode};
use serde_json::json;

/// splitmix64: a small generator whose sequence the seed fixes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Create,
    Exec,
    Upload,
    Delete,
    Sleep,
    Wake,
    Snapshot,
    Fork,
}

/// What the test knows of the node's state: what was answered.
#[derive(Default)]
struct Known {
    alive: Vec<String>,
    deleted: HashSet<String>,
    /// Uploads answered: (sandbox, path) -> bytes.
    uploads: HashMap<(String, String), Vec<u8>>,
    /// Commands answered: (sandbox, exec id).
    execs: Vec<(String, String)>,
    /// Sandboxes with the counter running ([`COUNTER`]).
    counting: HashSet<String>,
    /// Snapshots answered (of a snapshot or a fork).
    snapshots: Vec<String>,
}

/// A process of the sandbox's own that writes a count (20 a second) to /tmp/count.
const COUNTER: &str = "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &";

/// The count sandbox `id`'s counter wrote last, read on the host (its upper directory).
fn count(node: &TestNode, id: &str) -> Option<u64> {
    std::fs::read_to_string(node.sandbox_dir(id).join("upper/tmp/count"))
        .ok()
        .and_then(|t| t.trim().parse().ok())
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One call: its status and JSON body (null when it has none); `None` when the connection
/// failed or was cut (the node was killed).
fn send(method: &str, url: &str, body: &[u8]) -> Option<(u16, serde_json::Value)> {
    let req = ureq::request(method, url)
        .timeout(Duration::from_secs(60))
        .set(
            "Content-Type",
            if method == "PUT" {
                "application/octet-stream"
            } else {
                "application/json"
            },
        );
    let r = if body.is_empty() {
        req.call()
    } else {
        req.send_bytes(body)
    };
    let r = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(_) => return None,
    };
    let status = r.status();
    let mut text = Vec::new();
    std::io::Read::read_to_end(&mut r.into_reader(), &mut text).ok()?;
    Some((
        status,
        serde_json::from_slice(&text).unwrap_or(serde_json::Value::Null),
    ))
}

/// The sandboxes the node lists.
fn listed(node: &TestNode) -> HashSet<String> {
    let (s, v) = get_json(node, "/v1/sandboxes?limit=1000");
    assert_eq!(s, 200, "{v}");
    let items = v["data"]
        .as_array()
        .or(v.as_array())
        .cloned()
        .unwrap_or_default();
    items
        .iter()
        .filter_map(|s| s["id"].as_str().map(String::from))
        .collect()
}

fn status(node: &TestNode, id: &str) -> (u16, String) {
    let (s, v) = get_json(node, &format!("/v1/sandboxes/{id}"));
    (s, v["status"].as_str().unwrap_or_default().to_string())
}

#[test]
fn the_node_killed_at_random_points_of_calls_and_checkpoints_loses_nothing() {
    let seed = env_u64("SBX_FAULT_SEED", 20261202);
    let iterations = env_u64("SBX_FAULT_ITERATIONS", 40);
    eprintln!(
        "faults: seed {seed}, {iterations} iterations (SBX_FAULT_SEED, SBX_FAULT_ITERATIONS)"
    );
    let mut rng = Rng(seed);
    // On the network: a sleep, wake or fork also has veths and nft elements to leave whole.
    // A range of its own (the default ones of nodes of other tests may be the same), so that
    // every interface on it is this node's.
    let range = format!("10.253.{}.0/24", std::process::id() % 250);
    // With a node's warm pool: a kill may cut the making of a warm sandbox too.
    let mut node = TestNode::start_with(&[
        "--sleep-after-seconds",
        "never",
        "--egress-default",
        "allow",
        "--net-range",
        &range,
        "--warm-pool",
        "2",
    ]);
    let mut known = Known::default();
    let (mut cut, mut answered) = (0, 0);
    for i in 0..iterations {
        let op = match (known.alive.len(), rng.below(8)) {
            (0, _) => Op::Create,
            (n, _) if n >= 5 => Op::Delete,
            (_, 0) => Op::Create,
            (_, 1) => Op::Exec,
            (_, 2) => Op::Upload,
            (_, 3) => Op::Delete,
            (_, 4) => Op::Sleep,
            (_, 5) => Op::Wake,
            (_, 6) => Op::Snapshot,
            _ => Op::Fork,
        };
        let target = if known.alive.is_empty() {
            String::new()
        } else {
            known.alive[rng.below(known.alive.len() as u64) as usize].clone()
        };
        // Within the call's usual time here, so that the kill lands before, during or after.
        let window = match op {
            Op::Create => 250,
            Op::Exec => 60,
            Op::Upload => 40,
            Op::Delete => 150,
            Op::Sleep => 200,
            Op::Wake => 140,
            Op::Snapshot => 200,
            Op::Fork => 320,
        };
        // A wake's sandbox sleeps first (answered, before the kill's window).
        if op == Op::Wake {
            let (st, v) = send(
                "POST",
                &node.url(&format!("/v1/sandboxes/{target}/sleep")),
                b"{}",
            )
            .expect("a sleep's answer");
            assert_eq!(st, 200, "iteration {i}: sleep {target} before a wake: {v}");
            assert_eq!(v["status"], "sleeping", "{v}");
        }
        let delay = Duration::from_millis(rng.below(window));
        let blob = rng.bytes(256 << 10);
        let path = format!("/tmp/up-{i}");
        let pid = node.pid().expect("the node runs");
        let began = Instant::now();
        let (outcome, took): (Option<serde_json::Value>, Duration) = std::thread::scope(|s| {
            let call = s.spawn(|| {
                let t0 = Instant::now();
                let r = match op {
                    Op::Create => send("POST", &node.url("/v1/sandboxes"), b"{}")
                        .filter(|(st, _)| *st == 201)
                        .map(|(_, v)| v),
                    Op::Exec => send(
                        "POST",
                        &node.url(&format!("/v1/sandboxes/{target}/exec")),
                        br#"{"command": "echo $((6*7))", "wait_seconds": 10}"#,
                    )
                    .filter(|(st, _)| *st == 201)
                    .map(|(_, v)| v),
                    Op::Upload => send(
                        "PUT",
                        &node.url(&format!("/v1/sandboxes/{target}/files?path={path}")),
                        &blob,
                    )
                    .filter(|(st, _)| *st < 300)
                    .map(|(_, v)| v),
                    Op::Delete => {
                        send("DELETE", &node.url(&format!("/v1/sandboxes/{target}")), b"")
                            .filter(|(st, _)| *st < 300)
                            .map(|(_, v)| v)
                    }
                    Op::Sleep | Op::Wake => send(
                        "POST",
                        &node.url(&format!(
                            "/v1/sandboxes/{target}/{}",
                            if op == Op::Sleep { "sleep" } else { "wake" }
                        )),
                        b"{}",
                    )
                    .filter(|(st, _)| *st == 200)
                    .map(|(_, v)| v),
                    Op::Snapshot => send(
                        "POST",
                        &node.url(&format!("/v1/sandboxes/{target}/snapshots")),
                        b"{}",
                    )
                    .filter(|(st, _)| *st == 201)
                    .map(|(_, v)| v),
                    Op::Fork => send(
                        "POST",
                        &node.url(&format!("/v1/sandboxes/{target}/fork")),
                        br#"{"count": 1}"#,
                    )
                    .filter(|(st, _)| *st == 201)
                    .map(|(_, v)| v),
                };
                (r, t0.elapsed())
            });
            std::thread::sleep(delay);
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            call.join().unwrap_or((None, Duration::ZERO))
        });
        node.kill();
        match (&outcome, op) {
            (Some(v), Op::Create) => {
                known
                    .alive
                    .push(v["id"].as_str().expect("an id").to_string());
            }
            (Some(v), Op::Exec) => {
                known.execs.push((
                    target.clone(),
                    v["id"].as_str().expect("an exec id").to_string(),
                ));
            }
            (Some(_), Op::Upload) => {
                known.uploads.insert((target.clone(), path.clone()), blob);
            }
            (Some(_), Op::Delete) => {
                known.alive.retain(|a| *a != target);
                known.deleted.insert(target.clone());
            }
            (Some(v), Op::Sleep) => {
                assert_eq!(v["status"], "sleeping", "iteration {i}: {v}");
            }
            (Some(v), Op::Wake) => {
                assert_eq!(v["status"], "running", "iteration {i}: {v}");
            }
            (Some(v), Op::Snapshot) => {
                known
                    .snapshots
                    .push(v["id"].as_str().expect("a snapshot id").to_string());
            }
            (Some(v), Op::Fork) => {
                known.snapshots.push(
                    v["snapshot"]["id"]
                        .as_str()
                        .expect("the fork's snapshot")
                        .to_string(),
                );
                known.alive.push(
                    v["sandboxes"][0]["id"]
                        .as_str()
                        .expect("the fork's sandbox")
                        .to_string(),
                );
            }
            (None, _) => {}
        }
        eprintln!(
            "faults: {i}: {op:?} {target} killed after {} ms: {}",
            delay.as_millis(),
            if outcome.is_some() {
                format!("answered in {} ms", took.as_millis())
            } else {
                "cut".to_string()
            }
        );
        if outcome.is_some() {
            answered += 1;
        } else {
            cut += 1;
        }
        node.restart();
        // A delete cut by the kill may have taken its sandbox or not.
        let uncertain = match (op, &outcome) {
            (Op::Delete, None) => Some(target.as_str()),
            _ => None,
        };
        // A sleep answered: the sandbox sleeps after the restart (its processes on disk).
        let asleep = match (op, &outcome) {
            (Op::Sleep, Some(_)) => Some(target.as_str()),
            _ => None,
        };
        check(
            &node,
            &mut known,
            i,
            op,
            outcome.is_some(),
            uncertain,
            asleep,
        );
        eprintln!(
            "faults: {i}: restarted and checked, {} ms in all",
            began.elapsed().as_millis()
        );
    }
    eprintln!(
        "faults: {iterations} kills survived ({answered} after the call was answered, {cut} cutting it); {} sandboxes, {} uploads and {} commands checked at the end",
        known.alive.len(),
        known.uploads.len(),
        known.execs.len()
    );
    for id in known.alive.clone() {
        node.delete_sandbox(&id);
    }
    for id in &known.snapshots {
        let r = node.delete(&format!("/v1/snapshots/{id}"), &[]);
        assert_eq!(r.status, 200, "delete snapshot {id}");
    }
    node.assert_clean(Duration::from_secs(20));
}

/// The checks after a restart (see the module doc); `known` is brought up to date with what a
/// cut call left.
fn check(
    node: &TestNode,
    known: &mut Known,
    i: u64,
    op: Op,
    answered: bool,
    uncertain: Option<&str>,
    asleep: Option<&str>,
) {
    let ctx = format!("iteration {i} ({op:?}, answered: {answered})");
    let list = listed(node);
    for id in known
        .alive
        .iter()
        .filter(|id| Some(id.as_str()) != uncertain)
    {
        assert!(
            list.contains(id),
            "{ctx}: sandbox {id} was answered and is lost"
        );
    }
    for id in &known.deleted {
        assert!(!list.contains(id), "{ctx}: deleted sandbox {id} is back");
        assert_eq!(status(node, id).0, 404, "{ctx}: deleted sandbox {id}");
    }
    // A sandbox made by a cut create is the node's now: whole (checked below) and known.
    for id in &list {
        if !known.alive.contains(id) && !known.deleted.contains(id) {
            known.alive.push(id.clone());
        }
    }
    // A cut delete either took the sandbox or left it whole.
    known.alive.retain(|id| {
        let kept = list.contains(id);
        if !kept {
            known.deleted.insert(id.clone());
        }
        kept
    });
    known.uploads.retain(|(sb, _), _| known.alive.contains(sb));
    known.execs.retain(|(sb, _)| known.alive.contains(sb));
    if let Some(id) = asleep {
        assert_eq!(
            status(node, id).1,
            "sleeping",
            "{ctx}: {id} was answered asleep"
        );
    }
    // The counts before the sandboxes are woken: a counter goes on from where it was.
    let before: HashMap<String, u64> = known
        .counting
        .iter()
        .filter_map(|id| count(node, id).map(|n| (id.clone(), n)))
        .collect();
    for id in &known.alive {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (s, st) = status(node, id);
            assert_eq!(s, 200, "{ctx}: {id}");
            if st == "running" {
                break;
            }
            if st == "sleeping" {
                // Asleep (a sleep answered, or one the kill cut after its dump): it wakes.
                let r = send(
                    "POST",
                    &node.url(&format!("/v1/sandboxes/{id}/wake")),
                    b"{}",
                );
                let (ws, wv) = r.expect("a wake's answer");
                assert_eq!(
                    (ws, wv["status"].as_str()),
                    (200, Some("running")),
                    "{ctx}: sandbox {id} does not wake: {wv}\n{}",
                    node.log_tail(40)
                );
                break;
            }
            assert!(
                st == "starting" && Instant::now() < end,
                "{ctx}: sandbox {id} is {st} after the restart\n{}",
                node.log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let r = send(
            "POST",
            &node.url(&format!("/v1/sandboxes/{id}/exec")),
            br#"{"command": "echo whole", "wait_seconds": 20}"#,
        );
        let whole = matches!(&r, Some((201, v)) if stdout(v) == "whole\n");
        assert!(
            whole,
            "{ctx}: {id} does not run a command: {r:?}\n{}\n{}",
            diagnose(node, id),
            node.log_tail(40)
        );
    }
    // Every counter counts on: its processes were kept through whatever the kill cut.
    let counted: Vec<String> = known
        .counting
        .iter()
        .filter(|id| known.alive.contains(id))
        .cloned()
        .collect();
    for id in &counted {
        let from = before.get(id).copied().unwrap_or(0);
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let now = count(node, id).unwrap_or(0);
            if now > from {
                break;
            }
            assert!(
                Instant::now() < end,
                "{ctx}: the counter of {id} stopped at {from} (its processes were lost)\n{}",
                node.log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for id in &known.alive {
        if !known.counting.contains(id) {
            let v = node.exec(id, &json!({ "command": COUNTER, "wait_seconds": 10 }));
            assert_eq!(v["exit_code"], 0, "{ctx}: {id}: {v}");
        }
    }
    known.counting = known.alive.iter().cloned().collect();
    // Snapshots: every one listed is ready (a snapshot cut midway is not listed), every one
    // answered is listed; at most two are kept.
    let (s, v) = get_json(node, "/v1/snapshots");
    assert_eq!(s, 200, "{v}");
    let snaps: Vec<(String, String)> = v["data"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|o| {
            (
                o["id"].as_str().unwrap_or_default().to_string(),
                o["status"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    for (id, st) in &snaps {
        assert_eq!(st, "ready", "{ctx}: snapshot {id}");
        if !known.snapshots.contains(id) {
            known.snapshots.push(id.clone());
        }
    }
    for id in &known.snapshots {
        assert!(
            snaps.iter().any(|(s, _)| s == id),
            "{ctx}: snapshot {id} was answered and is lost"
        );
    }
    while known.snapshots.len() > 2 {
        let id = known.snapshots.remove(0);
        let r = node.delete(&format!("/v1/snapshots/{id}"), &[]);
        assert_eq!(r.status, 200, "{ctx}: delete snapshot {id}");
    }
    for ((sb, path), blob) in &known.uploads {
        let url = node.url(&format!("/v1/sandboxes/{sb}/files?path={path}"));
        let r = ureq::get(&url).call().expect("a download");
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut r.into_reader(), &mut got).expect("its body");
        assert!(
            got == *blob,
            "{ctx}: the upload {sb}:{path} reads back {} bytes, not the {} answered",
            got.len(),
            blob.len()
        );
    }
    for (sb, exec) in &known.execs {
        let (s, v) = get_json(node, &format!("/v1/sandboxes/{sb}/exec/{exec}"));
        assert_eq!(
            s, 200,
            "{ctx}: command {exec} of {sb} was answered and is lost: {v}"
        );
    }
    // Nothing of a sandbox the node neither lists nor keeps warm.
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let traces = node.all_sandbox_traces();
        let warm = node.pool_ids();
        let mut orphans: Vec<String> = traces
            .into_iter()
            .filter(|t| {
                !known.alive.iter().any(|id| t.contains(id.as_str()))
                    && !warm.iter().any(|id| t.contains(id.as_str()))
            })
            .collect();
        orphans.extend(checkpoint_leftovers(node, known));
        orphans.extend(foreign_links(node));
        if orphans.is_empty() {
            break;
        }
        assert!(
            Instant::now() < end,
            "{ctx}: orphans: {orphans:#?}\n{}",
            node.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What is left of checkpoints that no sandbox or snapshot accounts for: sleep images (every
/// sandbox is awake after the checks) and snapshot directories the node does not list.
fn checkpoint_leftovers(node: &TestNode, known: &Known) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(node.data_dir.join("sleep"))
        .into_iter()
        .flatten()
        .flatten()
    {
        out.push(format!("sleep images {}", e.path().display()));
    }
    for e in std::fs::read_dir(node.data_dir.join("snapshots"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if !known.snapshots.contains(&name) {
            out.push(format!("snapshot directory {}", e.path().display()));
        }
    }
    out
}

/// Host interfaces with an address on the node's range that are not the node's own (a veth's
/// host side retired by a restore and left behind).
fn foreign_links(node: &TestNode) -> Vec<String> {
    let (s, v) = get_json(node, "/internal/node");
    assert_eq!(s, 200, "{v}");
    let (Some(range), Some(prefix)) = (
        v["network"]["range"].as_str(),
        v["network"]["interface_prefix"].as_str(),
    ) else {
        return Vec::new();
    };
    let net: ipnet::Ipv4Net = range.parse().expect("the node's range");
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .expect("ip addr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = f.get(1)?.split('@').next()?.to_string();
            let addr = f
                .get(3)?
                .split('/')
                .next()?
                .parse::<std::net::Ipv4Addr>()
                .ok()?;
            (net.contains(&addr) && !name.starts_with(prefix))
                .then(|| format!("interface {name} on the node's range: {l}"))
        })
        .collect()
}

/// What the host says of sandbox `id`'s processes (for a failure's message): its freezer
/// cgroups' states, and each process's state, tracer and freezer cgroup.
fn diagnose(node: &TestNode, id: &str) -> String {
    let mut out = Vec::new();
    if let Some(dir) = node.cgroup_dir("freezer") {
        for g in [id.to_string(), format!("{id}.hold")] {
            let d = dir.join(&g);
            let state = std::fs::read_to_string(d.join("freezer.state")).unwrap_or_default();
            let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
            out.push(format!(
                "freezer {g}: {} {:?}",
                state.trim(),
                procs.split_whitespace().collect::<Vec<_>>()
            ));
            for pid in procs.split_whitespace() {
                let status =
                    std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                let keep: Vec<&str> = status
                    .lines()
                    .filter(|l| {
                        l.starts_with("Name:")
                            || l.starts_with("State:")
                            || l.starts_with("TracerPid:")
                    })
                    .collect();
                out.push(format!("  {pid}: {}", keep.join(" ")));
            }
        }
    }
    out.join("\n")
}
