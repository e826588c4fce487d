//! Placement: which node a new sandbox goes to. A ready node (its lease runs, not draining)
//! with room (its sandboxes, as its last heartbeat counted them, plus what was placed on it
//! since, under its `max_sandboxes`); among them the ones that hold the image asked for first,
//! then the fewest sandboxes, then by name (so that a choice is the same for the same table).

use std::collections::HashMap;

use crate::db::{NodeRow, NodeState};

/// Why no node was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoRoom {
    pub ready: usize,
    pub full: usize,
    pub draining: usize,
    pub lost: usize,
}

impl std::fmt::Display for NoRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.ready + self.draining + self.lost == 0 {
            return write!(f, "no node has joined the control plane");
        }
        write!(
            f,
            "no ready node has room for a sandbox ({} ready, {} of them full; {} draining; {} \
             lost)",
            self.ready, self.full, self.draining, self.lost
        )
    }
}

/// The image reference `r` as a key two spellings of one reference share: Docker Hub's registry
/// and `library/` dropped, `:latest` added where neither a tag nor a digest is given.
pub fn image_key(r: &str) -> String {
    let r = r.trim();
    let (name, digest) = match r.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (r, None),
    };
    let mut name = name;
    for hub in ["docker.io/", "index.docker.io/", "registry-1.docker.io/"] {
        if let Some(rest) = name.strip_prefix(hub) {
            name = rest;
            break;
        }
    }
    let name = name.strip_prefix("library/").unwrap_or(name);
    let last = name.rsplit('/').next().unwrap_or(name);
    let mut key = name.to_string();
    if digest.is_none() && !last.contains(':') {
        key.push_str(":latest");
    }
    if let Some(d) = digest {
        key.push('@');
        key.push_str(d);
    }
    key
}

/// Whether `node` holds image `asked` (by reference or by digest).
pub fn holds_image(node: &NodeRow, asked: &str) -> bool {
    let want = image_key(asked);
    let digest = asked.split_once('@').map(|(_, d)| d);
    node.capacity
        .images
        .iter()
        .any(|i| image_key(i) == want || digest.is_some_and(|d| i == d || i.ends_with(d)))
}

/// The sandboxes a node holds as far as the control plane knows: its last count, plus those
/// placed on it since.
pub fn load(node: &NodeRow, pending: &HashMap<String, u64>) -> u64 {
    node.capacity.sandboxes + pending.get(&node.id).copied().unwrap_or(0)
}

/// The node a new sandbox goes to.
pub fn choose<'a>(
    nodes: &'a [NodeRow],
    pending: &HashMap<String, u64>,
    image: Option<&str>,
) -> Result<&'a NodeRow, NoRoom> {
    let mut why = NoRoom {
        ready: 0,
        full: 0,
        draining: 0,
        lost: 0,
    };
    let mut best: Option<(bool, u64, &str, &NodeRow)> = None;
    for n in nodes {
        match n.state {
            NodeState::Lost => {
                why.lost += 1;
                continue;
            }
            NodeState::Draining => {
                why.draining += 1;
                continue;
            }
            NodeState::Ready => why.ready += 1,
        }
        let l = load(n, pending);
        if l >= n.capacity.max_sandboxes {
            why.full += 1;
            continue;
        }
        let misses = !image.is_some_and(|i| holds_image(n, i));
        let key = (misses, l, n.name.as_str(), n);
        if best
            .as_ref()
            .is_none_or(|b| (key.0, key.1, key.2) < (b.0, b.1, b.2))
        {
            best = Some(key);
        }
    }
    best.map(|b| b.3).ok_or(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::Capacity;

    fn node(name: &str, state: NodeState, max: u64, now: u64, images: &[&str]) -> NodeRow {
        NodeRow {
            id: format!("nod-{name}"),
            name: name.into(),
            url: "http://127.0.0.1:1".into(),
            state,
            lease_until_ms: 0,
            build: "0123456789abcdef".into(),
            capacity: Capacity {
                max_sandboxes: max,
                sandboxes: now,
                images: images.iter().map(|s| s.to_string()).collect(),
            },
            registered_at_ms: 0,
            heartbeat_at_ms: 0,
            e2b_url: None,
            preview_url: None,
        }
    }

    #[test]
    fn image_keys() {
        assert_eq!(image_key("python:3.12"), "python:3.12");
        assert_eq!(image_key("docker.io/library/python:3.12"), "python:3.12");
        assert_eq!(image_key("alpine"), "alpine:latest");
        assert_eq!(
            image_key("docker.io/library/alpine:latest"),
            "alpine:latest"
        );
        assert_eq!(image_key("ghcr.io/o/app"), "ghcr.io/o/app:latest");
        assert_eq!(image_key("localhost:5000/app"), "localhost:5000/app:latest");
        assert_eq!(image_key("localhost:5000/app:1"), "localhost:5000/app:1");
        assert_eq!(
            image_key("ghcr.io/o/app@sha256:ab"),
            "ghcr.io/o/app@sha256:ab"
        );
    }

    #[test]
    fn fewest_sandboxes_first_and_pending_counts() {
        let nodes = vec![
            node("a", NodeState::Ready, 10, 3, &[]),
            node("b", NodeState::Ready, 10, 1, &[]),
        ];
        let mut pending = HashMap::new();
        assert_eq!(
            choose(&nodes, &pending, None).map(|n| n.name.as_str()),
            Ok("b")
        );
        pending.insert("nod-b".to_string(), 2);
        // b: 3, a: 3; a tie goes by name.
        assert_eq!(
            choose(&nodes, &pending, None).map(|n| n.name.as_str()),
            Ok("a")
        );
        pending.insert("nod-b".to_string(), 9);
        assert_eq!(
            choose(&nodes, &pending, None).map(|n| n.name.as_str()),
            Ok("a")
        );
    }

    #[test]
    fn the_image_holder_first_when_it_has_room() {
        let nodes = vec![
            node("a", NodeState::Ready, 10, 0, &["base"]),
            node(
                "b",
                NodeState::Ready,
                10,
                5,
                &["base", "docker.io/library/python:3.12"],
            ),
            node("c", NodeState::Ready, 5, 5, &["python:3.12"]),
        ];
        let p = HashMap::new();
        assert_eq!(
            choose(&nodes, &p, Some("python:3.12")).map(|n| n.name.as_str()),
            Ok("b")
        );
        assert_eq!(
            choose(&nodes, &p, Some("alpine")).map(|n| n.name.as_str()),
            Ok("a")
        );
        assert_eq!(choose(&nodes, &p, None).map(|n| n.name.as_str()), Ok("a"));
    }

    #[test]
    fn lost_draining_and_full_nodes_take_nothing() {
        let nodes = vec![
            node("a", NodeState::Lost, 10, 0, &[]),
            node("b", NodeState::Draining, 10, 0, &[]),
            node("c", NodeState::Ready, 2, 2, &[]),
        ];
        let why = choose(&nodes, &HashMap::new(), None).expect_err("no room");
        assert_eq!(
            why,
            NoRoom {
                ready: 1,
                full: 1,
                draining: 1,
                lost: 1
            }
        );
        assert!(why.to_string().contains("1 lost"), "{why}");
        let none = choose(&[], &HashMap::new(), None).expect_err("no node");
        assert!(none.to_string().contains("no node"), "{none}");
    }
}
