//! E2B's metrics of sandboxes over time: every running sandbox of the node is measured every
//! [`EVERY`] (its cgroup's memory and CPU time, the node's `sandbox_usage`), the last
//! [`KEPT`] samples of each kept while the node keeps it. `GET /sandboxes/{id}/metrics`
//! answers the samples of a time range (`start`, `end`: Unix seconds, both ends in; by
//! default from its start to now), a sample of now added when the range reaches now and the
//! last is older than a second; `GET /sandboxes/metrics?sandbox_ids=` the latest of each.
//! A sample's `cpuUsedPct` is the share of its CPUs used since the sample before it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, MethodRouter};
use axum::Json;
use sbx_api::{SandboxObject, SandboxStatus};
use serde_json::{json, Map, Value};

use super::{find, query_pairs, St};
use crate::e2b_error;
use crate::node::sandbox::ListQuery;
use crate::node::Node;
use crate::sync::LockExt;

/// How often every running sandbox is measured (E2B's collection bucket).
const EVERY: Duration = Duration::from_secs(5);
/// The most samples kept of a sandbox (an hour of them).
const KEPT: usize = 720;
/// How old the last sample may be before a query that reaches now takes one.
const FRESH_NS: i128 = 1_000_000_000;
const NS: i128 = 1_000_000_000;

/// One measure of a sandbox.
#[derive(Clone, Debug, PartialEq)]
struct Sample {
    at_ns: i128,
    cpu_ns: u64,
    mem_used: u64,
    cpu_pct: f64,
}

/// The samples of every sandbox measured, by id.
#[derive(Default)]
pub(super) struct Samples {
    by_id: Mutex<HashMap<String, VecDeque<Sample>>>,
}

impl Samples {
    /// The samples, and their taking every [`EVERY`] in the background while the node and
    /// they are used (none outside a runtime: then samples are taken by queries only).
    pub(super) fn start(node: &Arc<Node>) -> Arc<Samples> {
        let s = Arc::new(Samples::default());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(take_every(Arc::downgrade(node), Arc::downgrade(&s)));
        }
        s
    }

    /// Measures sandbox `o` now (when it runs) and keeps the sample.
    fn take(&self, node: &Node, o: &SandboxObject, now_ns: i128) {
        if o.status != SandboxStatus::Running {
            return;
        }
        let Some((mem_used, cpu_ns)) = node.sandbox_usage(&o.id) else {
            return;
        };
        let mut by_id = self.by_id.locked();
        let kept = by_id.entry(o.id.clone()).or_default();
        // Since the sample before (of this run: CPU time only grows within one), or since
        // it started.
        let since = kept
            .back()
            .filter(|p| p.cpu_ns <= cpu_ns && p.at_ns < now_ns)
            .map(|p| (p.at_ns, p.cpu_ns))
            .or_else(|| {
                o.started_at
                    .as_deref()
                    .and_then(sbx_api::parse_rfc3339)
                    .filter(|s| *s < now_ns)
                    .map(|s| (s, 0))
            });
        let cpus = f64::from(o.limits.vcpus.max(1));
        let cpu_pct = match since {
            Some((at, cpu)) => {
                ((cpu_ns - cpu) as f64 / ((now_ns - at) as f64 * cpus) * 100.0).clamp(0.0, 100.0)
            }
            None => 0.0,
        };
        kept.push_back(Sample {
            at_ns: now_ns,
            cpu_ns,
            mem_used,
            cpu_pct: (cpu_pct * 100.0).round() / 100.0,
        });
        while kept.len() > KEPT {
            kept.pop_front();
        }
    }

    /// Measures every running sandbox of the node; forgets those it keeps no more.
    fn take_all(&self, node: &Node) {
        let now = crate::image::now_ns();
        let mut seen = std::collections::HashSet::new();
        let mut cursor = None;
        loop {
            let q = ListQuery {
                status: None,
                metadata: Vec::new(),
                limit: 100,
                cursor: cursor.take(),
            };
            let (list, next) = node.list_sandboxes(&q);
            for o in &list {
                seen.insert(o.id.clone());
                self.take(node, o, now);
            }
            match next {
                Some(n) => cursor = Some(n),
                None => break,
            }
        }
        self.by_id.locked().retain(|id, _| seen.contains(id));
    }

    /// The samples of sandbox `id` whose second is within `[start, end]` (Unix seconds).
    fn range(&self, id: &str, start: Option<i64>, end: Option<i64>) -> Vec<Sample> {
        let by_id = self.by_id.locked();
        let Some(kept) = by_id.get(id) else {
            return Vec::new();
        };
        kept.iter()
            .filter(|s| {
                let sec = s.at_ns.div_euclid(NS) as i64;
                start.is_none_or(|a| sec >= a) && end.is_none_or(|b| sec <= b)
            })
            .cloned()
            .collect()
    }

    fn last(&self, id: &str) -> Option<Sample> {
        self.by_id.locked().get(id).and_then(|k| k.back().cloned())
    }
}

async fn take_every(node: Weak<Node>, samples: Weak<Samples>) {
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (Some(node), Some(samples)) = (node.upgrade(), samples.upgrade()) else {
            return;
        };
        samples.take_all(&node);
    }
}

/// E2B's `SandboxMetric` of a sample of sandbox `o`.
fn metric_json(o: &SandboxObject, s: &Sample) -> Value {
    json!({
        "timestamp": sbx_api::format_rfc3339_millis(s.at_ns),
        "timestampUnix": s.at_ns.div_euclid(NS) as i64,
        "cpuCount": o.limits.vcpus.max(1),
        "cpuUsedPct": s.cpu_pct,
        "memUsed": s.mem_used,
        "memTotal": o.limits.memory_bytes,
        // Not measured: the page cache apart, and disk (a sandbox's files are on the
        // node's disk, not a disk of a fixed size).
        "memCache": 0,
        "diskUsed": 0,
        "diskTotal": 0,
    })
}

/// A query's Unix seconds `name`, if given.
fn seconds(pairs: &[(String, String)], name: &str) -> Result<Option<i64>, Response> {
    match pairs.iter().find(|(k, v)| k == name && !v.is_empty()) {
        None => Ok(None),
        Some((_, v)) => v.parse::<i64>().map(Some).map_err(|_| {
            e2b_error(
                StatusCode::BAD_REQUEST,
                format!("{name} {v:?} is not a time in Unix seconds"),
            )
        }),
    }
}

/// `GET /sandboxes/{id}/metrics?start=&end=`.
fn one(samples: Arc<Samples>) -> MethodRouter<Arc<Node>> {
    get(
        move |State(node): St, Path(id): Path<String>, RawQuery(q): RawQuery| {
            let samples = samples.clone();
            async move {
                let pairs = query_pairs(q.as_deref());
                let (start, end) = match (seconds(&pairs, "start"), seconds(&pairs, "end")) {
                    (Ok(a), Ok(b)) => (a, b),
                    (Err(r), _) | (_, Err(r)) => return r,
                };
                if let (Some(a), Some(b)) = (start, end) {
                    if a > b {
                        return e2b_error(StatusCode::BAD_REQUEST, "start is after end");
                    }
                }
                let o = match find(&node, &id) {
                    Ok(o) => o,
                    Err(r) => return r,
                };
                let now = crate::image::now_ns();
                let reaches_now = end.is_none_or(|b| i128::from(b) >= now.div_euclid(NS));
                let stale = samples.last(&o.id).is_none_or(|s| now - s.at_ns > FRESH_NS);
                if reaches_now && stale {
                    samples.take(&node, &o, now);
                }
                let items: Vec<Value> = samples
                    .range(&o.id, start, end)
                    .iter()
                    .map(|s| metric_json(&o, s))
                    .collect();
                Json(Value::Array(items)).into_response()
            }
        },
    )
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest sample of each (one taken now when
/// it has none fresh); a sandbox not on the node is left out.
fn many(samples: Arc<Samples>) -> MethodRouter<Arc<Node>> {
    get(move |State(node): St, RawQuery(q): RawQuery| {
        let samples = samples.clone();
        async move {
            let pairs = query_pairs(q.as_deref());
            let now = crate::image::now_ns();
            let mut out = Map::new();
            for id in pairs
                .iter()
                .filter(|(k, _)| k == "sandbox_ids")
                .flat_map(|(_, v)| v.split(',').map(|s| s.trim().to_string()))
                .filter(|s| !s.is_empty())
            {
                let Ok(o) = find(&node, &id) else { continue };
                if samples.last(&o.id).is_none_or(|s| now - s.at_ns > FRESH_NS) {
                    samples.take(&node, &o, now);
                }
                if let Some(s) = samples.last(&o.id) {
                    out.insert(id, metric_json(&o, &s));
                }
            }
            Json(json!({ "sandboxes": out })).into_response()
        }
    })
}

/// The two routes' handlers over one set of samples, taken in the background from now.
pub(super) fn routes(node: &Arc<Node>) -> (MethodRouter<Arc<Node>>, MethodRouter<Arc<Node>>) {
    let samples = Samples::start(node);
    (one(samples.clone()), many(samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(sec: i64) -> Sample {
        Sample {
            at_ns: i128::from(sec) * NS + 400_000_000,
            cpu_ns: 0,
            mem_used: 1,
            cpu_pct: 0.0,
        }
    }

    #[test]
    fn a_range_holds_the_samples_of_its_seconds_both_ends_in() {
        let s = Samples::default();
        s.by_id
            .locked()
            .insert("a".into(), [at(10), at(15), at(20)].into_iter().collect());
        let secs = |r: Vec<Sample>| -> Vec<i64> {
            r.iter().map(|x| x.at_ns.div_euclid(NS) as i64).collect()
        };
        assert_eq!(secs(s.range("a", None, None)), vec![10, 15, 20]);
        assert_eq!(secs(s.range("a", Some(15), Some(20))), vec![15, 20]);
        assert_eq!(secs(s.range("a", Some(11), None)), vec![15, 20]);
        assert_eq!(secs(s.range("a", None, Some(14))), vec![10]);
        assert!(s.range("a", Some(0), Some(9)).is_empty());
        assert!(s.range("b", None, None).is_empty());
        assert_eq!(s.last("a"), Some(at(20)));
    }
}
