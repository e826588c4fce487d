//! `GET /v1/sandboxes` across nodes: each node's page (oldest first, as a node lists), merged
//! in creation order, cut at `limit`; the fleet's `next_cursor` holds where each node's list
//! was left (`fc1~<node id>=<the node's own cursor>`, `=` alone where it starts over, `=!` where
//! it is through), so that every sandbox is listed once across pages whichever node has it.

use std::collections::BTreeMap;

use serde_json::Value;

/// Where a node's list was left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pos {
    /// From its first sandbox.
    Start,
    /// After the node's own cursor.
    After(String),
    /// Listed to its end.
    Done,
}

/// The fleet's cursor: where each node's list was left. A node it does not name is listed from
/// its start (a node that joined since the first page).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FleetCursor(pub BTreeMap<String, Pos>);

const PREFIX: &str = "fc1";

fn plain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
}

impl FleetCursor {
    pub fn pos(&self, node_id: &str) -> &Pos {
        self.0.get(node_id).unwrap_or(&Pos::Start)
    }

    pub fn encode(&self) -> String {
        let mut out = PREFIX.to_string();
        for (id, pos) in &self.0 {
            out.push('~');
            out.push_str(id);
            out.push('=');
            match pos {
                Pos::Start => {}
                Pos::After(c) => out.push_str(c),
                Pos::Done => out.push('!'),
            }
        }
        out
    }

    /// A cursor as [`FleetCursor::encode`] wrote it; `None` for anything else.
    pub fn decode(s: &str) -> Option<FleetCursor> {
        let rest = s.strip_prefix(PREFIX)?;
        let mut map = BTreeMap::new();
        if rest.is_empty() {
            return Some(FleetCursor(map));
        }
        let rest = rest.strip_prefix('~')?;
        for part in rest.split('~') {
            let (id, c) = part.split_once('=')?;
            if !plain(id) {
                return None;
            }
            let pos = match c {
                "" => Pos::Start,
                "!" => Pos::Done,
                c if plain(c) => Pos::After(c.to_string()),
                _ => return None,
            };
            map.insert(id.to_string(), pos);
        }
        Some(FleetCursor(map))
    }

    /// Whether no node has anything left.
    pub fn all_done(&self, nodes: &[String]) -> bool {
        nodes.iter().all(|n| self.pos(n) == &Pos::Done)
    }
}

/// The order of a sandbox object among all: its creation time (RFC 3339 of fixed width
/// compares as text), then its id.
fn key(v: &Value) -> (String, String) {
    (
        v.get("created_at")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        v.get("id")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
    )
}

/// Merges the nodes' pages (each in its node's order) in creation order, keeping each node's
/// own order, up to `limit` objects: the objects taken with the index of their page, and how
/// many were taken of each page.
pub fn merge(pages: Vec<Vec<Value>>, limit: usize) -> (Vec<(usize, Value)>, Vec<usize>) {
    let mut taken = vec![0usize; pages.len()];
    let mut iters: Vec<std::iter::Peekable<std::vec::IntoIter<Value>>> = pages
        .into_iter()
        .map(|p| p.into_iter().peekable())
        .collect();
    let mut out = Vec::new();
    while out.len() < limit {
        let mut best: Option<(usize, (String, String))> = None;
        for (i, it) in iters.iter_mut().enumerate() {
            if let Some(v) = it.peek() {
                let k = key(v);
                if best.as_ref().is_none_or(|(_, b)| k < *b) {
                    best = Some((i, k));
                }
            }
        }
        let Some((i, _)) = best else { break };
        if let Some(v) = iters[i].next() {
            taken[i] += 1;
            out.push((i, v));
        }
    }
    (out, taken)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sb(t: &str, id: &str) -> Value {
        json!({ "id": id, "created_at": t })
    }

    #[test]
    fn cursors_round_trip_and_refuse_what_they_did_not_write() {
        let mut c = FleetCursor::default();
        c.0.insert(
            "nod-a".into(),
            Pos::After("00000000000000000012.sbx-x".into()),
        );
        c.0.insert("nod-b".into(), Pos::Done);
        c.0.insert("nod-c".into(), Pos::Start);
        let s = c.encode();
        assert_eq!(s, "fc1~nod-a=00000000000000000012.sbx-x~nod-b=!~nod-c=");
        assert_eq!(FleetCursor::decode(&s), Some(c.clone()));
        assert_eq!(c.pos("nod-z"), &Pos::Start);
        assert!(!c.all_done(&["nod-b".into(), "nod-c".into()]));
        assert!(c.all_done(&["nod-b".into()]));
        for bad in [
            "",
            "fc2",
            "fc1~",
            "fc1~a",
            "fc1~a=b c",
            "fc1~=x",
            "00000.sbx-1",
        ] {
            assert_eq!(FleetCursor::decode(bad), None, "{bad}");
        }
        assert_eq!(FleetCursor::decode("fc1"), Some(FleetCursor::default()));
    }

    #[test]
    fn merge_keeps_each_nodes_order_and_cuts_at_the_limit() {
        let a = vec![
            sb("2024-01-01T00:00:01.000Z", "sbx-a1"),
            sb("2024-01-01T00:00:03.000Z", "sbx-a2"),
        ];
        let b = vec![
            sb("2024-01-01T00:00:02.000Z", "sbx-b1"),
            sb("2024-01-01T00:00:04.000Z", "sbx-b2"),
            sb("2024-01-01T00:00:05.000Z", "sbx-b3"),
        ];
        let (out, taken) = merge(vec![a.clone(), b.clone()], 3);
        let ids: Vec<&str> = out
            .iter()
            .map(|(_, v)| v["id"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(ids, ["sbx-a1", "sbx-b1", "sbx-a2"]);
        assert_eq!(taken, [2, 1]);
        let (out, taken) = merge(vec![a, b], 100);
        assert_eq!(out.len(), 5);
        assert_eq!(taken, [2, 3]);
        let (out, taken) = merge(vec![], 10);
        assert!(out.is_empty() && taken.is_empty());
    }
}
