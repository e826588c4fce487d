//! Templates: an image with the settings that change its machine (start, start_command,
//! ready, env, limits, the pull secret). A template is built once, by the first sandbox of its
//! settings (answered `starting` while its image is pulled and its ready check waited for);
//! later sandboxes of the same settings are made from it: its image pinned by digest (no
//! registry request), its start command and check resolved the same way.
//!
//! What the namespace driver cannot clone is memory: a sandbox of a template starts its start
//! command again and is answered once its ready check passes (it passed once for the template).
//! A driver with snapshots (a microVM) would save the build machine here instead.
//!
//! Rows live in the `templates` table of the node's database; a build is also an entry of
//! [`Templates::building`], which the other first sandboxes of the same settings wait on, so
//! one pull and one build serve them all.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use rusqlite::{params, OptionalExtension};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::probe::Probe;
use crate::store::{Store, StoreError};
use crate::sync::LockExt;
use sbx_api::{Command, Field, TemplateObject, TemplateReady};

/// The key of the node's base template: the base image, the node's default shape, nothing
/// started.
pub const BASE: &str = "base";

/// What makes a template: two different settings are two templates.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Settings {
    /// As the create named it (`base` for the base image and the catalog names).
    pub image: String,
    /// A template with a login is its owner's: another key than the same image without.
    pub image_pull_secret: Option<String>,
    pub start: Option<bool>,
    pub start_command: Option<Command>,
    pub ready_command: Option<Command>,
    pub ready_probe: Option<Probe>,
    /// The env the start command sees; empty where nothing can be started.
    pub env: BTreeMap<String, String>,
    pub vcpus: u32,
    pub memory_bytes: u64,
    /// The runtime settings in their canonical form: a template of its own
    /// (`node::runtime_settings`). Absent from the hashed text when none, so the keys of
    /// templates without one are what they were.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::node::runtime_settings::read_kept"
    )]
    pub runtime: Option<sbx_api::run::Runtime>,
}

impl Settings {
    /// Whether these are the base template's settings, given the node's default shape.
    pub(crate) fn is_base(&self, default_vcpus: u32, default_memory: u64) -> bool {
        self.image == "base"
            && self.image_pull_secret.is_none()
            && self.start != Some(true)
            && self.start_command.is_none()
            && self.ready_command.is_none()
            && self.ready_probe.is_none()
            && self.vcpus == default_vcpus
            && self.memory_bytes == default_memory
            && self.runtime.is_none()
    }

    /// The template's key: `base`, or `img-` and 16 characters of the id alphabet taken from
    /// a SHA-256 of the settings.
    pub fn key(&self, default_vcpus: u32, default_memory: u64) -> String {
        if self.is_base(default_vcpus, default_memory) {
            return BASE.into();
        }
        let text = serde_json::to_vec(self).unwrap_or_default();
        let hash = Sha256::digest(&text);
        let mut seed = [0u8; 16];
        seed.copy_from_slice(&hash[..16]);
        sbx_api::derived_id("img", &seed)
    }
}

/// A template as the table keeps it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct TemplateRow {
    pub key: String,
    pub settings: Settings,
    /// `building`, `ready` or `failed`.
    pub status: String,
    /// The image's manifest digest (a pulled image), once built.
    pub digest: Option<String>,
    pub failure_code: Option<String>,
    pub failure: Option<String>,
    pub created_at_ns: i64,
    /// How long its build took, from the first sandbox's create to its check passing.
    pub built_ms: Option<u64>,
    /// The sandbox that built it.
    pub built_by: Option<String>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS templates (
  key TEXT PRIMARY KEY,
  settings TEXT NOT NULL,
  status TEXT NOT NULL,
  digest TEXT,
  failure_code TEXT,
  failure TEXT,
  created_at_ns INTEGER NOT NULL,
  built_ms INTEGER,
  built_by TEXT
);
";

#[derive(Debug, thiserror::Error)]
pub(crate) enum TemplateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("template settings: {0}")]
    Json(#[from] serde_json::Error),
}

/// How a build ended, as its waiters see it: `Err((failure_code, failure))`.
pub(crate) type BuildResult = Result<(), (String, String)>;

/// What a create does about its template.
pub enum Plan {
    /// The base template: nothing to build.
    Base,
    /// The template is built: make the sandbox from it.
    Ready,
    /// This create builds it; the builder reports through [`Builder`].
    Build(Builder),
    /// Another create builds it: wait for its end, then make the sandbox from it.
    Wait(watch::Receiver<Option<BuildResult>>),
}

/// The builder's end of a build. Dropped without [`Templates::ready`] or [`Templates::failed`]
/// (its sandbox deleted midway), the build counts as cancelled: the waiters build again.
pub struct Builder {
    key: String,
    tx: Option<watch::Sender<Option<BuildResult>>>,
    started: std::time::Instant,
}

/// The failure code of a build whose sandbox went away midway: waiters build it again.
pub(crate) const CANCELLED: &str = "cancelled";

pub struct Templates {
    building: Mutex<HashMap<String, watch::Receiver<Option<BuildResult>>>>,
}

impl Templates {
    /// Makes the table; a build the node was doing when it stopped did not finish: failed.
    pub fn open(store: &Store) -> Result<Templates, StoreError> {
        store.with_conn(|c| {
            c.execute_batch(SCHEMA)?;
            c.execute(
                "UPDATE templates SET status='failed', failure_code='boot_failed', \
                 failure='the node stopped while it was built' WHERE status='building'",
                [],
            )
            .map(|_| ())
        })?;
        Ok(Templates {
            building: Mutex::new(HashMap::new()),
        })
    }

    /// Decides what a create of `settings` (whose key is `key`) does.
    pub(crate) fn plan(
        &self,
        store: &Store,
        key: &str,
        settings: &Settings,
        sandbox: &str,
    ) -> Result<Plan, TemplateError> {
        if key == BASE {
            return Ok(Plan::Base);
        }
        let mut building = self.building.locked();
        if let Some(rx) = building.get(key) {
            // A build whose builder was dropped unfinished has ended: build again.
            if rx.borrow().is_none() && rx.has_changed().is_ok() {
                return Ok(Plan::Wait(rx.clone()));
            }
            building.remove(key);
        }
        if let Some(row) = get(store, key)? {
            if row.status == "ready" {
                return Ok(Plan::Ready);
            }
        }
        let row = TemplateRow {
            key: key.into(),
            settings: settings.clone(),
            status: "building".into(),
            digest: None,
            failure_code: None,
            failure: None,
            created_at_ns: crate::image::now_ns() as i64,
            built_ms: None,
            built_by: Some(sandbox.into()),
        };
        put(store, &row)?;
        let (tx, rx) = watch::channel(None);
        building.insert(key.into(), rx);
        Ok(Plan::Build(Builder {
            key: key.into(),
            tx: Some(tx),
            started: std::time::Instant::now(),
        }))
    }

    pub fn finish(
        &self,
        store: &Store,
        b: &mut Builder,
        result: BuildResult,
        digest: Option<String>,
    ) {
        let Some(tx) = b.tx.take() else {
            return;
        };
        if let Ok(Some(mut row)) = get(store, &b.key) {
            match &result {
                Ok(()) => {
                    row.status = "ready".into();
                    row.digest = digest;
                    row.built_ms = Some(b.started.elapsed().as_millis() as u64);
                    row.failure_code = None;
                    row.failure = None;
                }
                Err((code, why)) => {
                    row.status = "failed".into();
                    row.failure_code = Some(code.clone());
                    row.failure = Some(why.clone());
                }
            }
            if let Err(e) = put(store, &row) {
                tracing::error!(template = %b.key, error = %e, "template row");
            }
        }
        self.building.locked().remove(&b.key);
        let _ = tx.send(Some(result));
    }

    /// The build passed: the template is ready, pinned to `digest` (a pulled image's).
    pub fn ready(&self, store: &Store, mut b: Builder, digest: Option<String>) {
        tracing::info!(template = %b.key, ms = b.started.elapsed().as_millis() as u64, "template ready");
        self.finish(store, &mut b, Ok(()), digest);
    }

    /// The build failed with the sandbox's `failure_code` and `failure`.
    pub fn failed(&self, store: &Store, mut b: Builder, code: &str, why: &str) {
        let result = Err((code.to_string(), why.to_string()));
        self.finish(store, &mut b, result, None);
    }

    /// Ends a build that was given up (its sandbox deleted midway).
    pub fn cancel(&self, store: &Store, mut b: Builder) {
        let result = Err((
            CANCELLED.to_string(),
            "its first sandbox was deleted".into(),
        ));
        self.finish(store, &mut b, result, None);
    }
}

impl Drop for Builder {
    fn drop(&mut self) {
        // A builder dropped unfinished (a panic, a task ended) leaves no waiter hanging.
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Some(Err((
                CANCELLED.to_string(),
                "the build was given up".to_string(),
            ))));
        }
    }
}

/// Waits for a build's end.
pub async fn wait(mut rx: watch::Receiver<Option<BuildResult>>) -> BuildResult {
    loop {
        if let Some(r) = rx.borrow_and_update().clone() {
            return r;
        }
        if rx.changed().await.is_err() {
            // The sender is gone without a word: the builder's task ended.
            return rx.borrow().clone().unwrap_or(Err((
                CANCELLED.to_string(),
                "the build was given up".to_string(),
            )));
        }
    }
}

impl crate::node::Node {
    /// The node's templates as GET /internal/node lists them: `base` first, then every one
    /// built or being built (env by names only).
    pub fn template_objects(&self) -> Vec<TemplateObject> {
        let mut out = vec![self.base_template_object()];
        let rows = list(&self.store).unwrap_or_else(|e| {
            tracing::error!(error = %e, "templates");
            Vec::new()
        });
        out.extend(rows.iter().map(object_of));
        out
    }

    /// The base template as GET /internal/node lists it.
    pub(crate) fn base_template_object(&self) -> TemplateObject {
        TemplateObject {
            built_by: Field::Absent,
            built_ms: Field::Absent,
            created_at: None,
            digest: Field::Absent,
            env: None,
            failure: Field::Absent,
            failure_code: Field::Absent,
            image: "base".into(),
            image_pull_secret: Field::Absent,
            key: BASE.into(),
            memory_bytes: self.cfg.default_memory_bytes,
            ready: Field::Absent,
            start: Field::Absent,
            start_command: Field::Absent,
            status: "ready".into(),
            vcpus: self.cfg.default_vcpus,
        }
    }
}

/// A template as the API shows it (env by names only).
pub(crate) fn object_of(t: &TemplateRow) -> TemplateObject {
    let s = &t.settings;
    let ready = match (&s.ready_command, &s.ready_probe) {
        (Some(c), _) => Some(TemplateReady::Command(c.display())),
        (None, Some(Probe::Tcp { port })) => Some(TemplateReady::Tcp { port: *port }),
        (None, Some(Probe::Http { port, path })) => Some(TemplateReady::Http {
            path: path.clone(),
            port: *port,
        }),
        (None, None) => None,
    };
    TemplateObject {
        built_by: Field::given(t.built_by.clone()),
        built_ms: Field::given(t.built_ms),
        created_at: Some(sbx_api::format_rfc3339_millis(i128::from(t.created_at_ns))),
        digest: Field::given(t.digest.clone()),
        env: Some(s.env.keys().cloned().collect()),
        failure: Field::given(t.failure.clone()),
        failure_code: Field::given(t.failure_code.clone()),
        image: s.image.clone(),
        image_pull_secret: Field::given(s.image_pull_secret.clone()),
        key: t.key.clone(),
        memory_bytes: s.memory_bytes,
        ready: Field::given(ready),
        start: Field::given(s.start),
        start_command: Field::given(s.start_command.as_ref().map(|c| c.display())),
        status: t.status.clone(),
        vcpus: s.vcpus,
    }
}

impl crate::node::Node {
    /// After an explicit pull of `reference` that got `digest`: the ready templates of that
    /// reference built of another digest are forgotten (their sandboxes keep running, their
    /// restarts pull the reference again). How many.
    pub fn forget_moved_templates(&self, reference: &str, digest: &str) -> usize {
        let rows = list(&self.store).unwrap_or_default();
        let mut n = 0;
        for t in rows {
            let same_ref = sbx_image::parse_reference(&t.settings.image)
                .is_ok_and(|r| r.to_string() == reference);
            if same_ref && t.status == "ready" && t.digest.as_deref().is_some_and(|d| d != digest) {
                let gone = self
                    .store
                    .with_conn(|c| c.execute("DELETE FROM templates WHERE key=?1", params![t.key]));
                if gone.is_ok() {
                    tracing::info!(template = %t.key, image = %reference, "template of a moved tag forgotten");
                    n += 1;
                }
            }
        }
        n
    }
}

fn row_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<TemplateRow> {
    let text: String = r.get(1)?;
    let settings = serde_json::from_str(&text).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Text, Box::new(e))
    })?;
    Ok(TemplateRow {
        key: r.get(0)?,
        settings,
        status: r.get(2)?,
        digest: r.get(3)?,
        failure_code: r.get(4)?,
        failure: r.get(5)?,
        created_at_ns: r.get(6)?,
        built_ms: r.get::<_, Option<i64>>(7)?.map(|v| v as u64),
        built_by: r.get(8)?,
    })
}

const COLS: &str =
    "key, settings, status, digest, failure_code, failure, created_at_ns, built_ms, built_by";

/// The template `key`, if the node has it.
pub(crate) fn get(store: &Store, key: &str) -> Result<Option<TemplateRow>, TemplateError> {
    Ok(store.with_conn(|c| {
        c.query_row(
            &format!("SELECT {COLS} FROM templates WHERE key=?1"),
            params![key],
            row_of,
        )
        .optional()
    })?)
}

/// Every template, oldest first.
pub(crate) fn list(store: &Store) -> Result<Vec<TemplateRow>, TemplateError> {
    Ok(store.with_conn(|c| {
        let mut st = c.prepare(&format!(
            "SELECT {COLS} FROM templates ORDER BY created_at_ns, key"
        ))?;
        let rows = st.query_map([], row_of)?;
        rows.collect::<rusqlite::Result<Vec<_>>>()
    })?)
}

fn put(store: &Store, row: &TemplateRow) -> Result<(), TemplateError> {
    let settings = serde_json::to_string(&row.settings)?;
    store.with_conn(|c| {
        c.execute(
            &format!(
                "INSERT OR REPLACE INTO templates ({COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9)"
            ),
            params![
                row.key,
                settings,
                row.status,
                row.digest,
                row.failure_code,
                row.failure,
                row.created_at_ns,
                row.built_ms.map(|v| v as i64),
                row.built_by
            ],
        )
        .map(|_| ())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(image: &str) -> Settings {
        Settings {
            image: image.into(),
            image_pull_secret: None,
            start: None,
            start_command: None,
            ready_command: None,
            ready_probe: None,
            env: BTreeMap::new(),
            vcpus: 1,
            memory_bytes: 512 << 20,
            runtime: None,
        }
    }

    fn store() -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "sbx-templates-{}-{}",
            std::process::id(),
            sbx_api::new_id("t")
        ));
        let _ = std::fs::create_dir_all(&dir);
        let s = Store::open(&dir.join("state.db")).expect("store");
        (s, dir)
    }

    #[test]
    fn keys_tell_settings_apart_and_the_base_is_base() {
        let base = settings("base");
        assert_eq!(base.key(1, 512 << 20), BASE);
        assert_ne!(
            base.key(2, 512 << 20),
            BASE,
            "another shape is another template"
        );
        let mut a = settings("127.0.0.1:5000/app:1");
        let k1 = a.key(1, 512 << 20);
        assert!(sbx_api::is_id("img", &k1), "{k1}");
        assert_eq!(
            k1,
            a.clone().key(1, 512 << 20),
            "the same settings, the same key"
        );
        a.start_command = Some(Command::Shell("serve".into()));
        assert_ne!(a.key(1, 512 << 20), k1);
        let mut b = settings("127.0.0.1:5000/app:1");
        b.image_pull_secret = Some("reg".into());
        assert_ne!(
            b.key(1, 512 << 20),
            k1,
            "a login makes a template of its own"
        );
        // The key of settings without a runtime is the hash of the text without the field.
        let mut c = settings("base");
        let rt = |n: u32| {
            sbx_api::run::Runtime::parse(&serde_json::json!({"ulimits": {"nofile": n}}))
                .expect("a runtime")
        };
        c.runtime = Some(rt(64));
        // Hashed in its canonical form, as the node always kept it.
        assert_eq!(
            serde_json::to_value(&c).expect("json")["runtime"],
            rt(64).to_value()
        );
        let kc = c.key(1, 512 << 20);
        assert!(
            sbx_api::is_id("img", &kc),
            "a runtime is never the base: {kc}"
        );
        let mut d = c.clone();
        d.runtime = Some(rt(65));
        assert_ne!(d.key(1, 512 << 20), kc, "another runtime, another template");
        assert!(!serde_json::to_string(&a).unwrap().contains("runtime"));
    }

    /// A store in a directory of its own, its templates, settings of `image` and their key.
    fn fixture(image: &str) -> (Store, std::path::PathBuf, Templates, Settings, String) {
        let (store, dir) = store();
        let t = Templates::open(&store).expect("open");
        let s = settings(image);
        let key = s.key(1, 512 << 20);
        (store, dir, t, s, key)
    }

    /// The first create of `s` (it builds) and a second one (it waits).
    pub(crate) fn build_and_wait(
        t: &Templates,
        store: &Store,
        key: &str,
        s: &Settings,
    ) -> (Builder, watch::Receiver<Option<BuildResult>>) {
        let Ok(Plan::Build(builder)) = t.plan(store, key, s, "sbx-a") else {
            panic!("the first create builds");
        };
        let Ok(Plan::Wait(rx)) = t.plan(store, key, s, "sbx-b") else {
            panic!("the second waits");
        };
        (builder, rx)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt")
    }

    #[test]
    fn one_build_the_others_wait_and_a_ready_template_is_found() {
        let (store, dir, t, s, key) = fixture("127.0.0.1:5000/app:1");
        let (builder, rx) = build_and_wait(&t, &store, &key, &s);
        t.ready(&store, builder, Some("sha256:ab".into()));
        let rt = rt();
        assert_eq!(rt.block_on(wait(rx)), Ok(()));
        let Ok(Plan::Ready) = t.plan(&store, &key, &s, "sbx-c") else {
            panic!("later creates find it ready");
        };
        let row = get(&store, &key).ok().flatten().expect("row");
        assert_eq!(row.digest.as_deref(), Some("sha256:ab"));
        assert_eq!(row.built_by.as_deref(), Some("sbx-a"));
        assert_eq!(row.settings, s);
        assert_eq!(list(&store).map(|l| l.len()).ok(), Some(1));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_failed_build_tells_its_waiters_and_is_built_again_next_time() {
        let (store, dir, t, s, key) = fixture("127.0.0.1:5000/app:2");
        let (builder, rx) = build_and_wait(&t, &store, &key, &s);
        t.failed(&store, builder, "registry_auth_failed", "401");
        let rt = rt();
        assert_eq!(
            rt.block_on(wait(rx)),
            Err(("registry_auth_failed".to_string(), "401".to_string()))
        );
        let row = get(&store, &key).ok().flatten().expect("row");
        assert_eq!(row.status, "failed");
        let Ok(Plan::Build(again)) = t.plan(&store, &key, &s, "sbx-c") else {
            panic!("a failed template is built again");
        };
        // A dropped builder (its sandbox gone) cancels: the waiter hears it, and the next
        // create builds.
        let Ok(Plan::Wait(rx)) = t.plan(&store, &key, &s, "sbx-d") else {
            panic!("wait");
        };
        drop(again);
        let got = rt.block_on(wait(rx));
        assert!(matches!(got, Err((ref c, _)) if c == CANCELLED), "{got:?}");
        assert!(matches!(
            t.plan(&store, &key, &s, "sbx-e"),
            Ok(Plan::Build(_))
        ));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_build_the_node_did_not_finish_is_failed_at_the_next_start() {
        let (store, dir, t, s, key) = fixture("127.0.0.1:5000/app:3");
        let b = t.plan(&store, &key, &s, "sbx-a");
        assert!(matches!(b, Ok(Plan::Build(_))));
        std::mem::forget(b);
        drop(t);
        let _t = Templates::open(&store).expect("open");
        let row = get(&store, &key).ok().flatten().expect("row");
        assert_eq!(row.status, "failed");
        let _ = std::fs::remove_dir_all(dir);
    }
}
