//! Templates built through E2B's API (`Template.build`, `build_in_background`,
//! `get_build_status`, `exists`, tags) on the node's own verbs: a build is a sandbox of the
//! node made from the build's source, its steps run in it by the node's exec and file API
//! (`build.rs`), its start command started and its ready command awaited, then a snapshot of
//! the node taken of it. That snapshot is the template: a create whose `templateID` names it
//! (`name`, `name:tag` or its `templateID`) goes on from it.
//!
//! Names and tags are rows of the node's store (table `e2b_template_tags`: a name and tag to
//! the snapshot of a build and the defaults its steps set: user, working directory, env), so
//! they outlive a restart. Builds themselves (status, logs) are kept in memory: a build cut by
//! a restart is gone, its sandbox deleted by its expiry.
//!
//! `copy` uploads: `GET /templates/{id}/files/{hash}` answers a URL of this listener
//! (`PUT /e2b-uploads/{hash}?token=…`, the token a hash of the listener's secret and the files'
//! hash: the SDK sends no key there), the tar kept in `<data>/e2b-uploads/<hash>` and said
//! `present` to a later build of the same files (the one cache the node has) for a day after
//! it was last written or used.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::StreamExt;
use rusqlite::params;
use sbx_api::SandboxObject;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{parse_body, query_pairs, St};
use crate::e2b_error;
use crate::node::Node;
use crate::sync::LockExt;

mod build;

/// The tag of a name given without one.
pub(super) const DEFAULT_TAG: &str = "default";
/// Sandbox metadata keys of a template's defaults (not shown to E2B's callers).
pub(crate) const USER_KEY: &str = "e2b.user";
pub(crate) const WORKDIR_KEY: &str = "e2b.workdir";
pub(crate) const ENV_KEY: &str = "e2b.env";
/// The metadata key of a build's sandbox (its build id): not listed by E2B's lists.
pub(crate) const BUILD_KEY: &str = "e2b.build";
/// The longest value of a sandbox's metadata the node takes (sbx-api's limit).
const MAX_VALUE_CHARS: usize = 1024;
/// The most log entries a status answer holds (E2B's page).
const LOG_PAGE: usize = 100;
/// The most log entries a build keeps (then one saying so, and no more).
const MAX_LOGS: usize = 20_000;
/// The most builds kept in memory: the oldest ended ones are forgotten past it.
const MAX_BUILDS: usize = 256;
/// The largest upload of a `copy`'s files.
const MAX_UPLOAD: u64 = 4 << 30;
/// Names that are the node's own templates, never a build's.
const RESERVED: &[&str] = &["base", "code-interpreter-v1", "code-interpreter"];

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS e2b_template_tags (
  name TEXT NOT NULL,
  tag TEXT NOT NULL,
  template_id TEXT NOT NULL,
  build_id TEXT NOT NULL,
  snapshot_id TEXT NOT NULL,
  defaults TEXT NOT NULL,
  created_at_ns INTEGER NOT NULL,
  PRIMARY KEY (name, tag)
);
";

/// What a template's steps left for its sandboxes: envd's defaults for their commands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Defaults {
    /// `None`: envd's default user (`user`, or the image's own).
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub env: BTreeMap<String, String>,
}

impl Defaults {
    /// The defaults a sandbox's metadata carries (none for a sandbox of no built template).
    pub(crate) fn of(o: &SandboxObject) -> Defaults {
        Defaults::of_metadata(&o.metadata)
    }

    fn of_metadata(m: &BTreeMap<String, String>) -> Defaults {
        Defaults {
            user: m.get(USER_KEY).cloned(),
            workdir: m.get(WORKDIR_KEY).cloned(),
            env: serde_json::from_str(&Defaults::env_text(m)).unwrap_or_default(),
        }
    }

    /// The env's JSON as the metadata keeps it: `e2b.env`, then `e2b.env.1`, `e2b.env.2`…
    /// (a value is at most [`MAX_VALUE_CHARS`] characters).
    fn env_text(m: &BTreeMap<String, String>) -> String {
        let mut text = match m.get(ENV_KEY) {
            Some(t) => t.clone(),
            None => return String::new(),
        };
        for i in 1.. {
            match m.get(&format!("{ENV_KEY}.{i}")) {
                Some(t) => text.push_str(t),
                None => break,
            }
        }
        text
    }

    /// Whether `key` is one of the metadata keys of a template's defaults.
    pub(crate) fn is_key(key: &str) -> bool {
        key == USER_KEY
            || key == WORKDIR_KEY
            || key == ENV_KEY
            || key
                .strip_prefix(ENV_KEY)
                .and_then(|r| r.strip_prefix('.'))
                .is_some_and(|n| n.parse::<u32>().is_ok())
    }

    /// As metadata of a sandbox made from the template.
    pub(super) fn metadata(&self) -> Vec<(String, String)> {
        let mut m = Vec::new();
        if let Some(u) = &self.user {
            m.push((USER_KEY.to_string(), u.clone()));
        }
        if let Some(w) = &self.workdir {
            m.push((WORKDIR_KEY.to_string(), w.clone()));
        }
        if !self.env.is_empty() {
            let text: Vec<char> = json!(self.env).to_string().chars().collect();
            for (i, part) in text.chunks(MAX_VALUE_CHARS).enumerate() {
                let key = match i {
                    0 => ENV_KEY.to_string(),
                    i => format!("{ENV_KEY}.{i}"),
                };
                m.push((key, part.iter().collect()));
            }
        }
        m
    }
}

/// A name's tag as the store keeps it.
#[derive(Debug, Clone)]
pub(super) struct TagRow {
    pub name: String,
    pub tag: String,
    pub template_id: String,
    pub build_id: String,
    pub snapshot_id: String,
    pub defaults: Defaults,
    pub created_at_ns: i64,
}

/// One log line of a build.
#[derive(Debug, Clone)]
pub(super) struct LogEntry {
    at_ns: i128,
    level: &'static str,
    message: String,
    step: Option<String>,
}

impl LogEntry {
    fn json(&self) -> Value {
        let mut v = json!({
            "timestamp": sbx_api::format_rfc3339_millis(self.at_ns),
            "level": self.level,
            "message": self.message,
        });
        if let Some(s) = &self.step {
            v["step"] = json!(s);
        }
        v
    }
}

/// Where a build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// Asked for, its steps not sent yet.
    Waiting,
    Building,
    Ready,
    Error,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Waiting => "waiting",
            Status::Building => "building",
            Status::Ready => "ready",
            Status::Error => "error",
        }
    }
}

/// Why a build failed: its message and step (`base`, `1`…, `finalize`).
#[derive(Debug, Clone)]
struct Reason {
    message: String,
    step: Option<String>,
}

struct BuildState {
    status: Status,
    logs: Vec<LogEntry>,
    reason: Option<Reason>,
}

/// A build asked for (`POST /v3/templates`).
pub(super) struct Build {
    pub id: String,
    pub template_id: String,
    pub name: String,
    pub tags: Vec<String>,
    asked_ns: i128,
    state: Mutex<BuildState>,
}

impl Build {
    /// A line of the build's log.
    pub(super) fn log(&self, level: &'static str, step: Option<&str>, message: impl Into<String>) {
        let mut s = self.state.locked();
        let (level, message) = match s.logs.len() {
            n if n < MAX_LOGS => (level, message.into()),
            n if n == MAX_LOGS => (
                "warn",
                format!("more than {MAX_LOGS} lines of log: the rest is not kept"),
            ),
            _ => return,
        };
        s.logs.push(LogEntry {
            at_ns: crate::image::now_ns(),
            level,
            message,
            step: step.map(str::to_string),
        });
    }

    fn set(&self, status: Status, reason: Option<Reason>) {
        let mut s = self.state.locked();
        s.status = status;
        s.reason = reason;
    }
}

/// The template routes' state: the builds of this node's run, the upload tokens' secret.
pub struct Builds {
    builds: Mutex<HashMap<String, Arc<Build>>>,
    secret: [u8; 32],
}

impl Builds {
    pub fn new() -> Builds {
        let mut secret = [0u8; 32];
        // A secret of all zeros would make tokens anyone can compute: no uploads then.
        if getrandom::getrandom(&mut secret).is_err() {
            tracing::error!("no random bytes for the E2B upload secret: uploads are refused");
        }
        Builds {
            builds: Mutex::new(HashMap::new()),
            secret,
        }
    }

    fn token(&self, hash: &str) -> Option<String> {
        if self.secret == [0u8; 32] {
            return None;
        }
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(hash.as_bytes());
        Some(hex(&h.finalize()))
    }
}

impl Default for Builds {
    fn default() -> Self {
        Builds::new()
    }
}

pub(super) type Shared = Extension<Arc<Builds>>;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// E2B's template id of a name: stable, so each build of a name is one template.
fn template_id_of(name: &str) -> String {
    let h = Sha256::digest(name.as_bytes());
    let mut seed = [0u8; 16];
    seed.copy_from_slice(&h[..16]);
    sbx_api::derived_id("tpl", &seed)
}

/// A build id as E2B's are (a UUID, the SDK's models parse one).
fn new_build_id() -> String {
    let mut b = [0u8; 16];
    if getrandom::getrandom(&mut b).is_err() {
        let n = crate::image::now_ns().to_le_bytes();
        b.copy_from_slice(&n[..16]);
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// `name:tag` as a name and its tag (`None`: none given).
fn split_tag(s: &str) -> (&str, Option<&str>) {
    match s.rsplit_once(':') {
        Some((n, t)) if !n.is_empty() && !t.is_empty() && !t.contains('/') => (n, Some(t)),
        _ => (s, None),
    }
}

// --- the store ---

fn store_failed(e: impl std::fmt::Display) -> Response {
    tracing::error!(error = %e, "E2B templates' table");
    e2b_error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the node's store could not be read or written",
    )
}

fn with_table<T>(
    node: &Node,
    f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>,
) -> Result<T, Response> {
    node.with_front_table(|c| {
        c.execute_batch(SCHEMA)?;
        f(c)
    })
    .map_err(store_failed)
}

/// Every name's tags (a small table: one row per tag).
pub(super) fn rows(node: &Node) -> Result<Vec<TagRow>, Response> {
    with_table(node, |c| {
        let mut st = c.prepare(
            "SELECT name, tag, template_id, build_id, snapshot_id, defaults, created_at_ns \
             FROM e2b_template_tags ORDER BY created_at_ns",
        )?;
        let it = st.query_map([], |r| {
            let defaults: String = r.get(5)?;
            Ok(TagRow {
                name: r.get(0)?,
                tag: r.get(1)?,
                template_id: r.get(2)?,
                build_id: r.get(3)?,
                snapshot_id: r.get(4)?,
                defaults: serde_json::from_str(&defaults).unwrap_or_default(),
                created_at_ns: r.get(6)?,
            })
        })?;
        it.collect()
    })
}

fn put_row(node: &Node, r: &TagRow) -> Result<(), Response> {
    let defaults = serde_json::to_string(&r.defaults).map_err(store_failed)?;
    with_table(node, |c| {
        c.execute(
            "INSERT OR REPLACE INTO e2b_template_tags \
             (name, tag, template_id, build_id, snapshot_id, defaults, created_at_ns) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                r.name,
                r.tag,
                r.template_id,
                r.build_id,
                r.snapshot_id,
                defaults,
                r.created_at_ns
            ],
        )
        .map(|_| ())
    })
}

fn delete_row(node: &Node, name: &str, tag: &str) -> Result<(), Response> {
    with_table(node, |c| {
        c.execute(
            "DELETE FROM e2b_template_tags WHERE name=?1 AND tag=?2",
            params![name, tag],
        )
        .map(|_| ())
    })
}

/// Deletes the snapshots no tag names any more (of `candidates`).
async fn drop_unnamed(node: &Arc<Node>, candidates: &[String]) {
    let Ok(left) = rows(node) else { return };
    for s in candidates {
        if !left.iter().any(|r| &r.snapshot_id == s) {
            if let Err(e) = node.delete_snapshot(s).await {
                tracing::warn!(snapshot = %s, error = %e.message, "a template's snapshot");
            }
        }
    }
}

/// The row a `templateID` of a create (or `fromTemplate`) names: `name`, `name:tag` or a
/// template id, its tag `default` when none is given.
pub(super) fn resolve(node: &Node, template: &str) -> Option<TagRow> {
    if template.is_empty() || RESERVED.contains(&template) {
        return None;
    }
    let (name, tag) = split_tag(template);
    let tag = tag.unwrap_or(DEFAULT_TAG);
    rows(node)
        .ok()?
        .into_iter()
        .find(|r| (r.name == name || r.template_id == name) && r.tag == tag)
}

/// The rows of a name or template id.
fn of_name(all: &[TagRow], name: &str) -> Vec<TagRow> {
    all.iter()
        .filter(|r| r.name == name || r.template_id == name)
        .cloned()
        .collect()
}

// --- routes ---

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct BuildRequest {
    name: Option<String>,
    alias: Option<String>,
    tags: Option<Vec<String>>,
    #[allow(dead_code)]
    cpu_count: Option<u32>,
    #[allow(dead_code)]
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u64>,
    #[allow(dead_code)]
    min_free_disk_mb: Option<u64>,
}

/// How long an upload is kept after it was last written or used.
const UPLOAD_KEPT: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// Removes the uploads not written or used for [`UPLOAD_KEPT`] (and uploads cut off).
async fn tidy_uploads(dir: std::path::PathBuf) {
    let _ = tokio::task::spawn_blocking(move || {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > UPLOAD_KEPT);
            if old {
                let _ = std::fs::remove_file(e.path());
            }
        }
    })
    .await;
}

/// `POST /v3/templates {name, tags}`: a build of `name` (`name:tag` names its tag), 202 with
/// its ids. The steps come with `POST /v2/templates/{id}/builds/{buildID}`.
pub(super) async fn request_build(State(node): St, Extension(b): Shared, body: Bytes) -> Response {
    let r: BuildRequest = match parse_body(&body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    tidy_uploads(node.cfg.data_dir.join(UPLOADS)).await;
    let Some(full) = r.name.or(r.alias).filter(|n| !n.trim().is_empty()) else {
        return e2b_error(StatusCode::BAD_REQUEST, "name: name the template");
    };
    let (name, tag) = split_tag(full.trim());
    if RESERVED.contains(&name) {
        return e2b_error(
            StatusCode::CONFLICT,
            format!("{name} is a template of the node itself"),
        );
    }
    let mut tags: Vec<String> = tag.map(str::to_string).into_iter().collect();
    for t in r.tags.unwrap_or_default() {
        if t.is_empty() || t.contains(':') {
            return e2b_error(StatusCode::BAD_REQUEST, format!("tag {t:?} is not a tag"));
        }
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.is_empty() {
        tags.push(DEFAULT_TAG.into());
    }
    let build = Arc::new(Build {
        id: new_build_id(),
        template_id: template_id_of(name),
        name: name.to_string(),
        tags: tags.clone(),
        asked_ns: crate::image::now_ns(),
        state: Mutex::new(BuildState {
            status: Status::Waiting,
            logs: Vec::new(),
            reason: None,
        }),
    });
    {
        let mut all = b.builds.locked();
        if all.len() >= MAX_BUILDS {
            let mut ended: Vec<(i128, String)> = all
                .values()
                .filter(|x| matches!(x.state.locked().status, Status::Ready | Status::Error))
                .map(|x| (x.asked_ns, x.id.clone()))
                .collect();
            ended.sort();
            for (_, id) in ended.iter().take(all.len() + 1 - MAX_BUILDS) {
                all.remove(id);
            }
        }
        all.insert(build.id.clone(), build.clone());
    }
    (
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": build.template_id,
            "buildID": build.id,
            "public": false,
            "names": [name],
            "aliases": [name],
            "tags": tags,
        })),
    )
        .into_response()
}

/// The build `build` of template `template`, or 404.
fn find_build(b: &Builds, template: &str, build: &str) -> Result<Arc<Build>, Response> {
    b.builds
        .locked()
        .get(build)
        .filter(|x| x.template_id == template || x.name == template)
        .cloned()
        .ok_or_else(|| {
            e2b_error(
                StatusCode::NOT_FOUND,
                format!("no build {build} of template {template} on this node"),
            )
        })
}

/// `/v2/templates/{*rest}`: `POST {id}/builds/{buildID}` starts a build with its steps.
pub(super) async fn v2(
    State(node): St,
    Extension(b): Shared,
    method: Method,
    Path(rest): Path<String>,
    body: Bytes,
) -> Response {
    let parts: Vec<&str> = rest.split('/').collect();
    let (template, build_id) = match (method, parts.as_slice()) {
        (Method::POST, [t, "builds", id]) => (*t, *id),
        _ => return super::not_yet_templates().await,
    };
    let build = match find_build(&b, template, build_id) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let spec: build::Start = match parse_body(&body) {
        Ok(s) => s,
        Err(r) => return r,
    };
    {
        let mut s = build.state.locked();
        if s.status != Status::Waiting {
            return e2b_error(
                StatusCode::CONFLICT,
                format!("build {build_id} was started already"),
            );
        }
        s.status = Status::Building;
    }
    let data = node.cfg.data_dir.join(UPLOADS);
    tokio::spawn(async move {
        let end = build::run(&node, &build, spec, &data).await;
        match end {
            Ok(()) => build.set(Status::Ready, None),
            Err(f) => {
                build.log("error", Some(&f.step), f.message.clone());
                build.set(
                    Status::Error,
                    Some(Reason {
                        message: f.message,
                        step: Some(f.step),
                    }),
                );
            }
        }
    });
    StatusCode::ACCEPTED.into_response()
}

/// The uploads' directory under the node's data directory.
const UPLOADS: &str = "e2b-uploads";

/// Whether `hash` is a files' hash as the SDK makes them (hex of a SHA-256).
fn is_hash(hash: &str) -> bool {
    (16..=128).contains(&hash.len()) && hash.bytes().all(|c| c.is_ascii_hexdigit())
}

/// `/templates/{*rest}`: aliases, tags, files, build status, deletes.
pub(super) async fn dispatch(
    State(node): St,
    Extension(b): Shared,
    method: Method,
    Path(rest): Path<String>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parts: Vec<&str> = rest.split('/').collect();
    match (method, parts.as_slice()) {
        (Method::GET, ["aliases", alias]) => alias_of(&node, alias),
        (Method::POST, ["tags"]) => assign_tags(&node, &body),
        (Method::DELETE, ["tags"]) => remove_tags(&node, &body).await,
        (Method::GET, [id, "tags"]) => tags_of(&node, id),
        (Method::GET, [id, "files", hash]) => upload_link(&node, &b, &headers, id, hash),
        (Method::GET, [template, "builds", build, "status"]) => {
            status(&b, template, build, q.as_deref())
        }
        (Method::DELETE, [id]) => match delete(&node, id).await {
            Some(r) => r,
            None => super::snapshots::delete(&node, id).await,
        },
        _ => super::not_yet_templates().await,
    }
}

/// `GET /templates/aliases/{alias}`: 200 with its template id, 404 when there is none.
fn alias_of(node: &Node, alias: &str) -> Response {
    if RESERVED.contains(&alias) {
        return Json(json!({"templateID": alias, "public": true})).into_response();
    }
    let all = match rows(node) {
        Ok(r) => r,
        Err(r) => return r,
    };
    match all.iter().find(|r| r.name == alias) {
        Some(r) => Json(json!({"templateID": r.template_id, "public": false})).into_response(),
        None => e2b_error(
            StatusCode::NOT_FOUND,
            format!("no template named {alias} on this node"),
        ),
    }
}

/// `GET /templates/{id}/builds/{buildID}/status?logsOffset=&limit=`.
fn status(b: &Builds, template: &str, build: &str, q: Option<&str>) -> Response {
    let build = match find_build(b, template, build) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let pairs = query_pairs(q);
    let num = |k: &str| {
        pairs
            .iter()
            .find(|(n, _)| n == k)
            .and_then(|(_, v)| v.parse::<usize>().ok())
    };
    let from = num("logsOffset").unwrap_or(0);
    let limit = num("limit").unwrap_or(LOG_PAGE).clamp(1, LOG_PAGE);
    let s = build.state.locked();
    let entries: Vec<Value> = s
        .logs
        .iter()
        .skip(from)
        .take(limit)
        .map(LogEntry::json)
        .collect();
    let mut v = json!({
        "templateID": build.template_id,
        "buildID": build.id,
        "status": s.status.as_str(),
        "logEntries": entries,
        "logs": [],
    });
    if let Some(r) = &s.reason {
        let tail: Vec<Value> = s
            .logs
            .iter()
            .rev()
            .take(20)
            .rev()
            .map(LogEntry::json)
            .collect();
        v["reason"] = json!({"message": r.message, "logEntries": tail});
        if let Some(step) = &r.step {
            v["reason"]["step"] = json!(step);
        }
    }
    Json(v).into_response()
}

/// `GET /templates/{id}/files/{hash}`: whether the files are here (uploaded before: the
/// SDK skips their upload unless forced), and where to put them. 201 as E2B's.
fn upload_link(
    node: &Node,
    b: &Builds,
    headers: &HeaderMap,
    _template: &str,
    hash: &str,
) -> Response {
    if !is_hash(hash) {
        return e2b_error(StatusCode::BAD_REQUEST, format!("{hash:?} is not a hash"));
    }
    let Some(token) = b.token(hash) else {
        return e2b_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "uploads are off on this node",
        );
    };
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    // A use keeps it another day.
    let path = node.cfg.data_dir.join(UPLOADS).join(hash);
    let present = std::fs::File::options()
        .append(true)
        .open(&path)
        .and_then(|f| f.set_modified(std::time::SystemTime::now()))
        .is_ok();
    (
        StatusCode::CREATED,
        Json(json!({
            "present": present,
            "url": format!("http://{host}/e2b-uploads/{hash}?token={token}"),
        })),
    )
        .into_response()
}

/// `PUT /e2b-uploads/{hash}?token=`: a `copy`'s tar (gzipped or not), kept for the build.
/// No key: the token of `upload_link` says the node made the URL.
pub(super) async fn upload(
    State(node): St,
    Extension(b): Shared,
    Path(hash): Path<String>,
    RawQuery(q): RawQuery,
    body: Body,
) -> Response {
    let pairs = query_pairs(q.as_deref());
    let given = pairs.iter().find(|(k, _)| k == "token").map(|(_, v)| v);
    let ok = is_hash(&hash)
        && b.token(&hash)
            .zip(given)
            .is_some_and(|(t, g)| Sha256::digest(t.as_bytes()) == Sha256::digest(g.as_bytes()));
    if !ok {
        return e2b_error(StatusCode::FORBIDDEN, "not an upload URL of this node");
    }
    let dir = node.cfg.data_dir.join(UPLOADS);
    if let Err(e) = tokio::fs::create_dir_all(&dir).await {
        return store_failed(e);
    }
    let tmp = dir.join(format!(".{hash}.{}", sbx_api::new_id("up")));
    let done = async {
        use tokio::io::AsyncWriteExt;
        let mut f = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| e.to_string())?;
        let mut stream = body.into_data_stream();
        let mut n: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            n += chunk.len() as u64;
            if n > MAX_UPLOAD {
                return Err(format!("an upload is at most {MAX_UPLOAD} bytes"));
            }
            f.write_all(&chunk).await.map_err(|e| e.to_string())?;
        }
        f.flush().await.map_err(|e| e.to_string())?;
        tokio::fs::rename(&tmp, dir.join(&hash))
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match done {
        Ok(()) => StatusCode::OK.into_response(),
        Err(why) => {
            let _ = tokio::fs::remove_file(&tmp).await;
            e2b_error(StatusCode::BAD_REQUEST, format!("the upload: {why}"))
        }
    }
}

#[derive(Debug, Deserialize)]
struct AssignBody {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags {target: "name:tag", tags}`: the target's build under more tags.
fn assign_tags(node: &Node, body: &Bytes) -> Response {
    let a: AssignBody = match parse_body(body) {
        Ok(a) => a,
        Err(r) => return r,
    };
    let Some(src) = resolve(node, &a.target) else {
        return e2b_error(
            StatusCode::NOT_FOUND,
            format!("no template {} on this node", a.target),
        );
    };
    if a.tags.is_empty() || a.tags.iter().any(|t| t.is_empty() || t.contains(':')) {
        return e2b_error(StatusCode::BAD_REQUEST, "tags: one or more tags, no ':'");
    }
    for t in &a.tags {
        let row = TagRow {
            tag: t.clone(),
            created_at_ns: crate::image::now_ns() as i64,
            ..src.clone()
        };
        if let Err(r) = put_row(node, &row) {
            return r;
        }
    }
    (
        StatusCode::CREATED,
        Json(json!({"buildID": src.build_id, "tags": a.tags})),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct RemoveBody {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags {name, tags}`: 204; a snapshot no tag names any more is deleted.
async fn remove_tags(node: &Arc<Node>, body: &Bytes) -> Response {
    let r: RemoveBody = match parse_body(body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let all = match rows(node) {
        Ok(a) => a,
        Err(resp) => return resp,
    };
    let mine = of_name(&all, &r.name);
    if mine.is_empty() {
        return e2b_error(
            StatusCode::NOT_FOUND,
            format!("no template {} on this node", r.name),
        );
    }
    let mut dropped = Vec::new();
    for t in &r.tags {
        if let Some(row) = mine.iter().find(|x| &x.tag == t) {
            if let Err(resp) = delete_row(node, &row.name, t) {
                return resp;
            }
            dropped.push(row.snapshot_id.clone());
        }
    }
    drop_unnamed(node, &dropped).await;
    StatusCode::NO_CONTENT.into_response()
}

/// `GET /templates/{id}/tags`: the tags of a name or template id.
fn tags_of(node: &Node, id: &str) -> Response {
    let all = match rows(node) {
        Ok(a) => a,
        Err(r) => return r,
    };
    let mine = of_name(&all, id);
    if mine.is_empty() {
        return e2b_error(
            StatusCode::NOT_FOUND,
            format!("no template {id} on this node"),
        );
    }
    let v: Vec<Value> = mine
        .iter()
        .map(|r| {
            json!({
                "tag": r.tag,
                "buildID": r.build_id,
                "createdAt": sbx_api::format_rfc3339_millis(i128::from(r.created_at_ns)),
            })
        })
        .collect();
    Json(Value::Array(v)).into_response()
}

/// `DELETE /templates/{id}` of a built template (by name or id): its tags and snapshots go,
/// 204. `None` when no built template has that name (a snapshot's delete then).
async fn delete(node: &Arc<Node>, id: &str) -> Option<Response> {
    let all = match rows(node) {
        Ok(a) => a,
        Err(r) => return Some(r),
    };
    let mine = of_name(&all, id);
    if mine.is_empty() {
        return None;
    }
    for r in &mine {
        if let Err(resp) = delete_row(node, &r.name, &r.tag) {
            return Some(resp);
        }
    }
    let snaps: Vec<String> = mine.iter().map(|r| r.snapshot_id.clone()).collect();
    drop_unnamed(node, &snaps).await;
    Some(StatusCode::NO_CONTENT.into_response())
}

/// Records a finished build's tags (a tag given again moves to it; the snapshot it named
/// goes when no tag names it any more).
pub(super) async fn record(
    node: &Arc<Node>,
    build: &Build,
    snapshot_id: &str,
    defaults: &Defaults,
) -> Result<(), String> {
    let all = rows(node).map_err(|_| "the node's store could not be read".to_string())?;
    let mut replaced = Vec::new();
    for t in &build.tags {
        if let Some(old) = all.iter().find(|r| r.name == build.name && &r.tag == t) {
            replaced.push(old.snapshot_id.clone());
        }
        let row = TagRow {
            name: build.name.clone(),
            tag: t.clone(),
            template_id: build.template_id.clone(),
            build_id: build.id.clone(),
            snapshot_id: snapshot_id.to_string(),
            defaults: defaults.clone(),
            created_at_ns: crate::image::now_ns() as i64,
        };
        put_row(node, &row).map_err(|_| "the node's store could not be written".to_string())?;
    }
    drop_unnamed(node, &replaced).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_at_their_tag() {
        assert_eq!(split_tag("a"), ("a", None));
        assert_eq!(split_tag("a:v1"), ("a", Some("v1")));
        assert_eq!(split_tag("e2b-test:v1-x"), ("e2b-test", Some("v1-x")));
        assert_eq!(split_tag(":x"), (":x", None));
    }

    #[test]
    fn build_ids_are_uuids_and_template_ids_stable() {
        let id = new_build_id();
        assert_eq!(id.len(), 36);
        assert_eq!(id.as_bytes()[14], b'4');
        assert_ne!(id, new_build_id());
        assert_eq!(template_id_of("x"), template_id_of("x"));
        assert_ne!(template_id_of("x"), template_id_of("y"));
        assert!(template_id_of("x").starts_with("tpl-"));
    }

    #[test]
    fn defaults_go_through_metadata() {
        let d = Defaults {
            user: Some("root".into()),
            workdir: Some("/app".into()),
            env: [("A".to_string(), "1".to_string())].into(),
        };
        let m: BTreeMap<String, String> = d.metadata().into_iter().collect();
        assert_eq!(Defaults::of_metadata(&m), d);
        // A long env goes in several values, each within the node's limit.
        let long = Defaults {
            env: (0..100)
                .map(|i| (format!("VAR_{i}"), "x".repeat(40)))
                .collect(),
            ..d.clone()
        };
        let meta = long.metadata();
        assert!(meta.len() > 4, "{}", meta.len());
        assert!(meta
            .iter()
            .all(|(k, v)| Defaults::is_key(k) && v.chars().count() <= 1024));
        let m: BTreeMap<String, String> = meta.into_iter().collect();
        assert_eq!(Defaults::of_metadata(&m), long);
        assert!(!Defaults::is_key("e2b.envx") && !Defaults::is_key("e2b.env.x"));
        assert_eq!(Defaults::of_metadata(&BTreeMap::new()), Defaults::default());
    }
}
