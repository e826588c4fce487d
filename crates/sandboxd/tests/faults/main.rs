//! Faults: the node is killed (SIGKILL) at a random instant of a create, an exec, an upload or a
//! delete, and started again on the same data directory, again and again (at least 50 times;
//! `SBX_FAULT_ITERATIONS`), from a seed (`SBX_FAULT_SEED`, printed) so that a failure can be
//! replayed. After each restart:
//! - every sandbox the node lists is whole: running, and it runs a command;
//! - every create that was answered is listed (unless deleted since); every delete that was
//!   answered is gone; a call cut by the kill left its sandbox whole or cleanly gone;
//! - every upload that was answered reads back byte for byte; every command that was answered
//!   has its object;
//! - nothing is left on the host of a sandbox the node does not list (or keep warm):
//!   processes, cgroups, mounts, directories.

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

#[derive(Debug, Clone, Copy)]
enum Op {
    Create,
    Exec,
    Upload,
    Delete,
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
fn the_node_killed_at_random_points_of_create_exec_upload_and_delete_loses_nothing() {
    let seed = env_u64("SBX_FAULT_SEED", 20261202);
    let iterations = env_u64("SBX_FAULT_ITERATIONS", 50);
    eprintln!(
        "faults: seed {seed}, {iterations} iterations (SBX_FAULT_SEED, SBX_FAULT_ITERATIONS)"
    );
    let mut rng = Rng(seed);
    let mut node = TestNode::start_with(&["--sleep-after-seconds", "never"]);
    let mut known = Known::default();
    let (mut cut, mut answered) = (0, 0);
    for i in 0..iterations {
        let op = match (known.alive.len(), rng.below(4)) {
            (0, _) => Op::Create,
            (n, _) if n >= 6 => Op::Delete,
            (_, 0) => Op::Create,
            (_, 1) => Op::Exec,
            (_, 2) => Op::Upload,
            _ => Op::Delete,
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
        };
        let delay = Duration::from_millis(rng.below(window));
        let blob = rng.bytes(256 << 10);
        let path = format!("/tmp/up-{i}");
        let pid = node.pid().expect("the node runs");
        let outcome: Option<serde_json::Value> = std::thread::scope(|s| {
            let call = s.spawn(|| match op {
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
                Op::Delete => send("DELETE", &node.url(&format!("/v1/sandboxes/{target}")), b"")
                    .filter(|(st, _)| *st < 300)
                    .map(|(_, v)| v),
            });
            std::thread::sleep(delay);
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
            call.join().unwrap_or(None)
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
            (None, _) => {}
        }
        eprintln!(
            "faults: {i}: {op:?} {target} killed after {} ms: {}",
            delay.as_millis(),
            if outcome.is_some() { "answered" } else { "cut" }
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
        check(&node, &mut known, i, op, outcome.is_some(), uncertain);
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
    for id in &known.alive {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let (s, st) = status(node, id);
            assert_eq!(s, 200, "{ctx}: {id}");
            if st == "running" {
                break;
            }
            assert!(
                st == "starting" && Instant::now() < end,
                "{ctx}: sandbox {id} is {st} after the restart\n{}",
                node.log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let v = node.exec(id, &json!({ "command": "echo whole", "wait_seconds": 20 }));
        assert_eq!(stdout(&v), "whole\n", "{ctx}: {id}: {v}");
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
        let warm = node.warm_ids();
        let orphans: Vec<String> = node
            .all_sandbox_traces()
            .into_iter()
            .filter(|t| {
                !known.alive.iter().any(|id| t.contains(id.as_str()))
                    && !warm.iter().any(|id| t.contains(id.as_str()))
            })
            .collect();
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
