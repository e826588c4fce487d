//! Watches: `WatchDir` (a server stream of the changes) and the polled watchers of
//! `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher` (the sync SDK's `watch_dir`). Both
//! are the node's `fs_watch` (inotify in the sandbox's agent); a watch ends when its caller
//! goes: the stream closed, the watcher removed, or not polled for [`WATCHER_IDLE`].

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{json, Value};

use super::entry::{entry_info, resolve, users_for, Users};
use crate::connect::{
    keepalive_interval, read_stream_request, read_unary, stream_error, stream_reply, unary_reply,
    Code, RpcError,
};
use crate::envd::Ctx;
use crate::node::files::{WatchEvent, WatchItem, WatchKind, Watcher as Watch};
use crate::sync::LockExt;

/// A watcher not polled for this long is removed.
pub const WATCHER_IDLE: Duration = Duration::from_secs(600);
/// The most events a watcher holds between polls (later ones are dropped, and counted).
pub const WATCHER_EVENTS: usize = 10_000;
/// The most watchers of the node.
pub const MAX_WATCHERS: usize = 1024;

#[derive(Deserialize, Default)]
#[serde(default)]
struct WatchReq {
    path: String,
    recursive: bool,
    /// Each event with the `EntryInfo` of what changed, when it is still there.
    #[serde(alias = "include_entry", rename = "includeEntry")]
    include_entry: bool,
    /// envd refuses a directory of a network filesystem (NFS, CIFS, FUSE) unless this is set.
    /// A sandbox here has none (its volumes are the node's directories): taken, nothing to
    /// lift.
    #[serde(alias = "allow_network_mounts", rename = "allowNetworkMounts")]
    #[allow(dead_code)]
    allow_network_mounts: bool,
}

/// What an event's entry is read with (`includeEntry`): the watched directory, resolved.
struct Entries {
    node: Arc<crate::node::Node>,
    sandbox: String,
    dir: String,
    users: Arc<Users>,
}

impl Entries {
    /// The event as proto JSON `FilesystemEvent`, with the entry of what changed when asked
    /// for and it is still there.
    async fn event(this: &Option<Entries>, e: &WatchEvent) -> Option<Value> {
        let mut v = event_json(e)?;
        if let Some(en) = this {
            let path = if e.name == "." {
                en.dir.clone()
            } else {
                format!("{}/{}", en.dir.trim_end_matches('/'), e.name)
            };
            if let Ok(entry) = en.node.fs_stat(&en.sandbox, &path).await {
                v["entry"] = entry_info(&entry, &en.users);
            }
        }
        Some(v)
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WatcherReq {
    #[serde(alias = "watcher_id")]
    #[serde(rename = "watcherId")]
    watcher_id: String,
}

/// The proto `EventType` of a kind (`None`: one envd has no name for).
fn event_type(k: WatchKind) -> Option<&'static str> {
    Some(match k {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
        WatchKind::Other => return None,
    })
}

/// A change as proto JSON `FilesystemEvent`.
fn event_json(e: &WatchEvent) -> Option<Value> {
    Some(json!({ "name": e.name, "type": event_type(e.kind)? }))
}

/// Starts the node's watch of the request's directory (and what its events' entries are read
/// with, when asked for).
async fn start(ctx: &Ctx, r: WatchReq) -> Result<(Watch, Option<Entries>), RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    let watch = ctx
        .node()
        .fs_watch(&ctx.sandbox, path.clone(), r.recursive)
        .await
        .map_err(|e| match e.code {
            sbx_api::ErrorCode::WrongType => RpcError::invalid(e.message),
            _ => e.into(),
        })?;
    let entries = r.include_entry.then(|| Entries {
        node: ctx.node().clone(),
        sandbox: ctx.sandbox.clone(),
        dir: path,
        users,
    });
    Ok((watch, entries))
}

pub(super) async fn watch_dir(ctx: Ctx, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let r = match read_stream_request::<WatchReq>(&parts.headers, body).await {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    let (watch, entries) = match start(&ctx, r).await {
        Ok(w) => w,
        Err(e) => return stream_error(e),
    };
    let keepalive = keepalive_interval(&parts.headers).map(|d| (d, json!({ "keepalive": {} })));
    stream_reply(keepalive, move |out| async move {
        // The whole watch (not only its receiver, as a closure would capture): its task lives
        // as long as the stream.
        let mut watch = watch;
        if !out.send(&json!({ "start": {} })).await {
            return Ok(());
        }
        loop {
            let item = tokio::select! {
                item = watch.next() => item,
                _ = out.closed() => return Ok(()),
            };
            match item {
                Some(WatchItem::Events { events, overflow }) => {
                    if overflow {
                        tracing::info!(sandbox = %ctx.sandbox, "WatchDir: the kernel's queue overflowed; changes were lost");
                    }
                    for e in &events {
                        let Some(e) = Entries::event(&entries, e).await else {
                            continue;
                        };
                        if !out.send(&json!({ "filesystem": e })).await {
                            return Ok(());
                        }
                    }
                }
                Some(WatchItem::Ended(e)) => return Err(e.into()),
                None => return Err(RpcError::internal("the watch ended")),
            }
        }
    })
}

/// What a watcher holds between polls.
struct Held {
    events: VecDeque<Value>,
    /// When the latest change came.
    last: Option<Instant>,
    /// Why it ended (answered once its events are taken).
    error: Option<RpcError>,
    dropped: u64,
    polled: Instant,
}

struct Watcher {
    sandbox: String,
    held: Arc<Mutex<Held>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // The task owns the watch: aborting it drops it, which ends the watch in the agent.
        self.task.abort();
    }
}

/// Watchers made by CreateWatcher, by id.
#[derive(Default)]
pub struct Watchers {
    by_id: Arc<Mutex<HashMap<String, Watcher>>>,
}

fn new_id() -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::getrandom(&mut b);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("w{hex}")
}

/// Moves the watch's changes into `held` until it ends or is not polled for
/// [`WATCHER_IDLE`] (then the watcher is removed).
async fn collect(
    mut watch: Watch,
    entries: Option<Entries>,
    held: Arc<Mutex<Held>>,
    by_id: Arc<Mutex<HashMap<String, Watcher>>>,
    id: String,
) {
    loop {
        let idle_until = held.locked().polled + WATCHER_IDLE;
        let item = tokio::select! {
            item = watch.next() => item,
            _ = tokio::time::sleep_until(idle_until.into()) => {
                if held.locked().polled + WATCHER_IDLE <= Instant::now() {
                    tracing::info!(watcher = %id, "a watcher not polled for 10 minutes is removed");
                    // Removing it aborts this task: take it out of the map, drop it later.
                    let w = by_id.locked().remove(&id);
                    drop(watch);
                    tokio::spawn(async move { drop(w) });
                    return;
                }
                continue;
            }
        };
        // The entries read before the lock is taken.
        let item = match item {
            Some(WatchItem::Events { events, .. }) => {
                let mut out = Vec::with_capacity(events.len());
                for e in &events {
                    out.extend(Entries::event(&entries, e).await);
                }
                Ok(out)
            }
            other => Err(other),
        };
        let mut h = held.locked();
        match item {
            Ok(events) => {
                for e in events {
                    if h.events.len() >= WATCHER_EVENTS {
                        h.dropped += 1;
                    } else {
                        h.events.push_back(e);
                        h.last = Some(Instant::now());
                    }
                }
            }
            Err(Some(WatchItem::Ended(e))) => {
                h.error = Some(e.into());
                return;
            }
            Err(_) => {
                h.error = Some(RpcError::internal("the watch ended"));
                return;
            }
        }
    }
}

pub(super) async fn unary(ctx: Ctx, name: &str, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let watchers = &ctx.state().watchers;
    let r = match name {
        "CreateWatcher" => match read_unary::<WatchReq>(&parts.headers, body).await {
            Ok(r) => create(&ctx, watchers, r).await,
            Err(e) => Err(e),
        },
        "GetWatcherEvents" => match read_unary::<WatcherReq>(&parts.headers, body).await {
            Ok(r) => events(&ctx, watchers, r).await,
            Err(e) => Err(e),
        },
        _ => match read_unary::<WatcherReq>(&parts.headers, body).await {
            Ok(r) => remove(&ctx, watchers, r),
            Err(e) => Err(e),
        },
    };
    unary_reply(r)
}

async fn create(ctx: &Ctx, watchers: &Watchers, r: WatchReq) -> Result<Value, RpcError> {
    if watchers.by_id.locked().len() >= MAX_WATCHERS {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("the node holds {MAX_WATCHERS} watchers: remove some (RemoveWatcher)"),
        ));
    }
    let (watch, entries) = start(ctx, r).await?;
    let id = new_id();
    let held = Arc::new(Mutex::new(Held {
        events: VecDeque::new(),
        error: None,
        dropped: 0,
        polled: Instant::now(),
        last: None,
    }));
    let mut map = watchers.by_id.locked();
    let task = tokio::spawn(collect(
        watch,
        entries,
        held.clone(),
        watchers.by_id.clone(),
        id.clone(),
    ));
    map.insert(
        id.clone(),
        Watcher {
            sandbox: ctx.sandbox.clone(),
            held,
            task,
        },
    );
    Ok(json!({ "watcherId": id }))
}

fn no_watcher(id: &str) -> RpcError {
    RpcError::not_found(format!("watcher with id {id} not found"))
}

/// A poll takes the changes already made, which reach the node a moment after they are made
/// (the agent reads them from the kernel and sends them over): it waits [`SETTLE`] at least,
/// and while changes keep coming until none has come for [`SETTLE`], at most [`POLL_WAIT`].
const SETTLE: Duration = Duration::from_millis(40);
const POLL_WAIT: Duration = Duration::from_millis(500);

async fn events(ctx: &Ctx, watchers: &Watchers, r: WatcherReq) -> Result<Value, RpcError> {
    let held = match watchers.by_id.locked().get(&r.watcher_id) {
        Some(w) if w.sandbox == ctx.sandbox => w.held.clone(),
        _ => return Err(no_watcher(&r.watcher_id)),
    };
    let start = Instant::now();
    loop {
        let (last, ended) = {
            let h = held.locked();
            (h.last, h.error.is_some())
        };
        let now = Instant::now();
        let quiet = last.is_none_or(|l| now.duration_since(l) >= SETTLE);
        if ended
            || now.duration_since(start) >= POLL_WAIT
            || (quiet && now.duration_since(start) >= SETTLE)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut h = held.locked();
    h.polled = Instant::now();
    if h.dropped > 0 {
        tracing::info!(watcher = %r.watcher_id, dropped = h.dropped, "a watcher dropped changes between polls");
        h.dropped = 0;
    }
    if h.events.is_empty() {
        if let Some(e) = h.error.clone() {
            return Err(e);
        }
    }
    let events: Vec<Value> = h.events.drain(..).collect();
    Ok(json!({ "events": events }))
}

fn remove(ctx: &Ctx, watchers: &Watchers, r: WatcherReq) -> Result<Value, RpcError> {
    let mut map = watchers.by_id.locked();
    match map.get(&r.watcher_id) {
        Some(w) if w.sandbox == ctx.sandbox => {}
        _ => return Err(no_watcher(&r.watcher_id)),
    }
    let w = map.remove(&r.watcher_id);
    drop(map);
    drop(w);
    Ok(json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_map_to_envd_names() {
        let e = WatchEvent {
            name: "d/a.txt".into(),
            kind: WatchKind::Create,
        };
        assert_eq!(
            event_json(&e).unwrap(),
            json!({"name": "d/a.txt", "type": "EVENT_TYPE_CREATE"})
        );
        assert_eq!(event_type(WatchKind::Chmod), Some("EVENT_TYPE_CHMOD"));
        assert_eq!(event_type(WatchKind::Other), None);
        let r: WatcherReq = serde_json::from_str(r#"{"watcher_id":"w1"}"#).unwrap();
        assert_eq!(r.watcher_id, "w1");
        let r: WatcherReq = serde_json::from_str(r#"{"watcherId":"w2"}"#).unwrap();
        assert_eq!(r.watcher_id, "w2");
    }
}
