//! One build: a sandbox of the node made from the source (`fromImage` / `fromTemplate`), the
//! steps run in it (RUN by the node's exec as the step's user, COPY unpacked by the node's
//! file API from the uploaded tar and put in place by an exec, ENV / WORKDIR / USER kept as
//! the defaults of the template's sandboxes), the start command started and its ready
//! command run until it succeeds, then a snapshot of the node taken of it and the sandbox
//! deleted. Every step's output is the build's log.

use std::collections::BTreeMap;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use sbx_api::files::UnpackRequest;
use sbx_api::{Command, Encoding, ExecRequest};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{Build, Defaults};
use crate::node::{Node, RunEvent};

/// How long the build's sandbox may live (it is deleted at its end; this is for a node
/// stopped mid-build).
const SANDBOX_LIFE: Duration = Duration::from_secs(2 * 3600);
/// How long the ready command is retried.
const READY_WAIT: Duration = Duration::from_secs(300);
/// The pause between two tries of the ready command.
const READY_PAUSE: Duration = Duration::from_millis(500);
/// E2B's step names of the phases around the steps.
const BASE_STEP: &str = "base";
const FINALIZE_STEP: &str = "finalize";

/// `POST /v2/templates/{id}/builds/{buildID}`'s body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(in crate::api) struct Start {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<Value>,
    #[allow(dead_code)]
    force: Option<bool>,
    steps: Option<Vec<Step>>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Step {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    files_hash: Option<String>,
}

/// Why a build failed, and at which step.
pub(super) struct Failure {
    pub step: String,
    pub message: String,
}

fn fail(step: &str, message: impl Into<String>) -> Failure {
    Failure {
        step: step.to_string(),
        message: message.into(),
    }
}

/// What the steps so far have set.
struct Cur {
    /// `None`: the image's own user.
    user: Option<String>,
    workdir: Option<String>,
    env: BTreeMap<String, String>,
    shell: String,
}

/// The build's sandbox, deleted when dropped unless kept.
struct Machine {
    node: Arc<Node>,
    id: String,
}

impl Drop for Machine {
    fn drop(&mut self) {
        let (node, id) = (self.node.clone(), self.id.clone());
        tokio::spawn(async move {
            let _ = node.delete_sandbox(&id).await;
        });
    }
}

/// Runs the build to its end: `Ok` once its template is recorded.
pub(super) async fn run(
    node: &Arc<Node>,
    build: &Arc<Build>,
    spec: Start,
    uploads: &FsPath,
) -> Result<(), Failure> {
    if let Err(e) = node.checkpointer() {
        return Err(fail(
            BASE_STEP,
            format!(
                "this node keeps no templates built through E2B's API: they are snapshots \
                 ({})",
                e.message
            ),
        ));
    }
    let (body, inherited) = source(node, build, &spec)?;
    let from = spec
        .from_template
        .as_deref()
        .or(spec.from_image.as_deref())
        .unwrap_or("base");
    build.log("info", Some(BASE_STEP), format!("[base] FROM {from}"));
    let create = sbx_api::parse_sandbox_create(body.to_string().as_bytes())
        .map_err(|e| fail(BASE_STEP, format!("the build's sandbox: {}", e.message)))?;
    let o = node
        .create_sandbox(create)
        .await
        .map_err(|e| fail(BASE_STEP, format!("the build's sandbox: {}", e.message)))?;
    let machine = Machine {
        node: node.clone(),
        id: o.id.clone(),
    };
    super::super::wait_running(node, &o.id)
        .await
        .map_err(|why| {
            fail(
                BASE_STEP,
                format!("the build's sandbox did not start: {why}"),
            )
        })?;
    let users = node
        .fs_users(&o.id)
        .await
        .map_err(|e| fail(BASE_STEP, format!("the sandbox's users: {}", e.message)))?;
    let shell = match node.fs_stat(&o.id, "/bin/bash").await {
        Ok(_) => "/bin/bash",
        Err(_) => "/bin/sh",
    };
    let mut cur = match inherited {
        Some(d) => Cur {
            user: d.user,
            workdir: d.workdir,
            env: d.env,
            shell: shell.into(),
        },
        // E2B's default user when the image has it (its home the working directory), else
        // the image's own.
        None => {
            let u = users
                .users
                .iter()
                .find(|u| u.name == crate::envd::DEFAULT_USER);
            Cur {
                user: u.map(|u| u.name.clone()),
                workdir: u.map(|u| u.home.clone()),
                env: BTreeMap::new(),
                shell: shell.into(),
            }
        }
    };
    let steps = spec.steps.unwrap_or_default();
    let n = steps.len();
    for (i, st) in steps.iter().enumerate() {
        let name = (i + 1).to_string();
        build.log(
            "info",
            Some(&name),
            format!("[builder {}/{n}] {} {}", i + 1, st.kind, st.args.join(" ")),
        );
        step(node, build, &machine.id, &mut cur, st, &name, uploads).await?;
    }
    if let Some(start) = spec.start_cmd.as_deref().filter(|s| !s.is_empty()) {
        build.log("info", Some(FINALIZE_STEP), format!("[start] {start}"));
        let req = exec_req(&cur, cur.user.clone(), start);
        node.exec(&machine.id, req, None)
            .await
            .map_err(|e| fail(FINALIZE_STEP, format!("the start command: {}", e.message)))?;
    }
    if let Some(ready) = spec.ready_cmd.as_deref().filter(|s| !s.is_empty()) {
        build.log("info", Some(FINALIZE_STEP), format!("[ready] {ready}"));
        let end = tokio::time::Instant::now() + READY_WAIT;
        loop {
            let req = exec_req(&cur, cur.user.clone(), ready);
            let code = run_cmd(node, build, &machine.id, req, FINALIZE_STEP, "debug")
                .await
                .map_err(|m| fail(FINALIZE_STEP, format!("the ready command: {m}")))?;
            if code == 0 {
                break;
            }
            if tokio::time::Instant::now() >= end {
                return Err(fail(
                    FINALIZE_STEP,
                    format!(
                        "the ready command '{ready}' did not succeed in {} s",
                        READY_WAIT.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(READY_PAUSE).await;
        }
    }
    build.log("info", Some(FINALIZE_STEP), "[finalize] snapshot");
    let snap = {
        let _use = super::super::snapshots::in_use(node, &machine.id)
            .await
            .map_err(|_| fail(FINALIZE_STEP, "the build's sandbox could not be used"))?;
        node.snapshot_sandbox(&machine.id, None)
            .await
            .map_err(|e| fail(FINALIZE_STEP, format!("the snapshot: {}", e.message)))?
    };
    let defaults = Defaults {
        user: cur.user,
        workdir: cur.workdir,
        env: cur.env,
    };
    if let Err(why) = super::record(node, build, &snap.id, &defaults).await {
        let _ = node.delete_snapshot(&snap.id).await;
        return Err(fail(FINALIZE_STEP, why));
    }
    build.log(
        "info",
        Some(FINALIZE_STEP),
        format!("Template {} built (snapshot {})", build.name, snap.id),
    );
    drop(machine);
    Ok(())
}

/// The node's create of the build's sandbox, and the defaults of the template it goes on
/// from (`None`: an image, E2B's defaults).
fn source(node: &Node, build: &Build, spec: &Start) -> Result<(Value, Option<Defaults>), Failure> {
    let mut body = Map::new();
    let mut inherited = None;
    if spec
        .from_image_registry
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        return Err(fail(
            BASE_STEP,
            "fromImageRegistry (a registry's login) is not served by this node",
        ));
    }
    match (spec.from_template.as_deref(), spec.from_image.as_deref()) {
        (Some(t), _) => match t.trim() {
            "" | "base" => {}
            t if t.starts_with("snap-") => {
                body.insert("snapshot".into(), json!(t));
            }
            t if t.starts_with("img-") => {
                body.insert("template".into(), json!(t));
            }
            t => match super::resolve(node, t) {
                Some(r) => {
                    body.insert("snapshot".into(), json!(r.snapshot_id));
                    inherited = Some(r.defaults);
                }
                None => {
                    return Err(fail(BASE_STEP, format!("no template {t} on this node")));
                }
            },
        },
        // E2B's base image is the node's.
        (None, Some(i)) if i == "e2bdev/base" || i.starts_with("e2bdev/base:") => {}
        (None, Some(i)) => {
            body.insert("image".into(), json!(i));
        }
        (None, None) => {
            return Err(fail(
                BASE_STEP,
                "name the build's source: fromImage or fromTemplate",
            ))
        }
    }
    body.insert(
        "expires_at".into(),
        json!(sbx_api::format_rfc3339_millis(
            crate::image::now_ns() + SANDBOX_LIFE.as_nanos() as i128
        )),
    );
    body.insert("metadata".into(), json!({ super::BUILD_KEY: build.id }));
    Ok((Value::Object(body), inherited))
}

/// A command of the build: `cmd` by the shell as `user`, in the working directory, with the
/// env the steps set.
fn exec_req(cur: &Cur, user: Option<String>, cmd: &str) -> ExecRequest {
    let mut req = ExecRequest::new(Command::Argv(vec![
        cur.shell.clone(),
        "-c".into(),
        cmd.into(),
    ]));
    req.env = cur.env.clone();
    req.cwd = cur.workdir.clone();
    req.user = user;
    req
}

/// Runs a command to its end, its output lines the build's log at `level`: its exit code,
/// or why it could not run.
async fn run_cmd(
    node: &Arc<Node>,
    build: &Build,
    sandbox: &str,
    req: ExecRequest,
    step: &str,
    level: &'static str,
) -> Result<i32, String> {
    let obj = node
        .exec_must_start(sandbox, req, None)
        .await
        .map_err(|e| e.message)?;
    let (_, _, mut rx) = node
        .exec_output_events(sandbox, &obj.id, 0, Encoding::Utf8)
        .await
        .map_err(|e| e.message)?;
    let mut partial = String::new();
    let flush = |text: &str, all: bool, partial: &mut String| {
        partial.push_str(text);
        while let Some(i) = partial.find('\n') {
            let line: String = partial.drain(..=i).collect();
            build.log(level, Some(step), line.trim_end().to_string());
        }
        if all && !partial.is_empty() {
            build.log(level, Some(step), std::mem::take(partial));
        }
    };
    loop {
        match rx.recv().await {
            Some(RunEvent::Output { data, .. }) => {
                flush(&String::from_utf8_lossy(&data), false, &mut partial);
            }
            Some(RunEvent::Exited { exit, .. }) => {
                flush("", true, &mut partial);
                return Ok(if exit.signal.is_some() && exit.exit_code == 0 {
                    128 + exit.signal.unwrap_or(0)
                } else {
                    exit.exit_code
                });
            }
            Some(RunEvent::Failed(e)) => return Err(e.message),
            Some(_) => {}
            None => return Err("the command's output ended before its end".into()),
        }
    }
}

/// Whether `spec` (`name`, `uid`, `name:group`) is a user of the sandbox (its /etc/passwd
/// now: a step may have added one).
async fn known_user(node: &Node, sandbox: &str, spec: &str) -> bool {
    let name = spec.split(':').next().unwrap_or(spec);
    if name.parse::<u32>().is_ok() {
        return true;
    }
    node.fs_users(sandbox)
        .await
        .is_ok_and(|u| u.users.iter().any(|u| u.name == name))
}

/// A path of a step: as given when absolute, else under the working directory.
fn under(cur: &Cur, p: &str) -> String {
    if p.starts_with('/') {
        p.to_string()
    } else {
        format!(
            "{}/{p}",
            cur.workdir.as_deref().unwrap_or("").trim_end_matches('/')
        )
    }
}

/// The shell script of a COPY: the files of the unpacked context `$1` that `$2` matches put
/// at `$3` (into it when it is a directory, ends with `/` or several match; a directory's
/// contents into it, as Docker's COPY), owned by `$4`, mode `$5`, relative to `$6`.
const COPY_SCRIPT: &str = r#"
ctx=$1 src=$2 dest=$3 own=$4 mode=$5 wd=$6
mk() { [ -d "$1" ] && return 0; mkdir -p -- "$1" || exit 1; [ -z "$own" ] || chown -- "$own" "$1"; }
cd "$ctx" || exit 1
if [ -n "$own" ]; then chown -R -h -- "$own" . || exit 1; fi
set -- $src
if [ ! -e "$1" ] && [ ! -L "$1" ]; then echo "no file of the build's context matches $src" >&2; exit 1; fi
if [ -n "$mode" ]; then for f in "$@"; do [ -L "$f" ] || chmod -R -- "$mode" "$f" || exit 1; done; fi
cd "${wd:-/}" 2>/dev/null || cd /
case "$dest" in /*) ;; *) dest="$PWD/$dest" ;; esac
into=0
[ $# -gt 1 ] && into=1
case "$dest" in */) into=1 ;; esac
for f in "$@"; do
  if [ -d "$ctx/$f" ] && [ ! -L "$ctx/$f" ]; then mk "$dest"; cp -a -- "$ctx/$f/." "$dest/" || exit 1
  elif [ $into = 1 ] || [ -d "$dest" ]; then mk "$dest"; cp -a -- "$ctx/$f" "$dest/" || exit 1
  else mk "$(dirname -- "$dest")"; cp -a -- "$ctx/$f" "$dest" || exit 1
  fi
done
rm -rf -- "$ctx"
"#;

/// The same script as root through `sh` with its arguments.
fn script_req(script: &str, args: &[&str]) -> ExecRequest {
    let mut argv = vec![
        "/bin/sh".to_string(),
        "-c".into(),
        script.into(),
        "sh".into(),
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    let mut req = ExecRequest::new(Command::Argv(argv));
    req.user = Some("root".into());
    req
}

/// The uploaded tar of `hash` as a stream of its (ungzipped) bytes.
fn tar_stream(
    path: std::path::PathBuf,
) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, String>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let send = |r: Result<Bytes, String>| tx.blocking_send(r).is_ok();
        let f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                send(Err(e.to_string()));
                return;
            }
        };
        let mut f = std::io::BufReader::new(f);
        let mut magic = [0u8; 2];
        let gz = match f.read(&mut magic) {
            Ok(2) => magic == [0x1f, 0x8b],
            _ => false,
        };
        let head = std::io::Cursor::new(magic.to_vec());
        let mut r: Box<dyn Read> = if gz {
            Box::new(flate2::read::GzDecoder::new(head.chain(f)))
        } else {
            Box::new(head.chain(f))
        };
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if !send(Ok(Bytes::copy_from_slice(&buf[..n]))) {
                        return;
                    }
                }
                Err(e) => {
                    send(Err(e.to_string()));
                    return;
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[allow(clippy::too_many_arguments)]
async fn step(
    node: &Arc<Node>,
    build: &Build,
    sandbox: &str,
    cur: &mut Cur,
    st: &Step,
    name: &str,
    uploads: &FsPath,
) -> Result<(), Failure> {
    let arg = |i: usize| st.args.get(i).map(String::as_str).filter(|s| !s.is_empty());
    match st.kind.as_str() {
        "RUN" => {
            let cmd = arg(0).ok_or_else(|| fail(name, "RUN: no command"))?;
            let user = arg(1).map(str::to_string).or_else(|| cur.user.clone());
            if let Some(u) = user.as_deref() {
                if !known_user(node, sandbox, u).await {
                    return Err(fail(
                        name,
                        format!(
                            "failed to run command '{cmd}': command failed: unauthenticated: \
                             invalid username: '{u}'"
                        ),
                    ));
                }
            }
            let code = run_cmd(node, build, sandbox, exec_req(cur, user, cmd), name, "info")
                .await
                .map_err(|m| fail(name, format!("failed to run command '{cmd}': {m}")))?;
            if code != 0 {
                return Err(fail(
                    name,
                    format!("failed to run command '{cmd}': exit status {code}"),
                ));
            }
        }
        "COPY" => {
            let src = arg(0).ok_or_else(|| fail(name, "COPY: no source"))?;
            let dest = arg(1).ok_or_else(|| fail(name, "COPY: no destination"))?;
            let own = arg(2).map(str::to_string).or_else(|| cur.user.clone());
            let mode = arg(3).unwrap_or("");
            let hash = st
                .files_hash
                .as_deref()
                .filter(|h| super::is_hash(h))
                .ok_or_else(|| fail(name, "COPY: no filesHash"))?;
            let tar = uploads.join(hash);
            if !tar.is_file() {
                return Err(fail(
                    name,
                    format!("the files of COPY {src} were not uploaded"),
                ));
            }
            let ctx = format!("/tmp/.e2b-copy-{}-{name}", build.id);
            let u = UnpackRequest {
                path: ctx.clone(),
                parents: true,
                owner: Some("root".into()),
                preserve_owners: false,
            };
            node.fs_unpack(sandbox, u, tar_stream(tar))
                .await
                .map_err(|e| fail(name, format!("COPY {src}: {}", e.message)))?;
            let wd = cur.workdir.clone().unwrap_or_else(|| "/".into());
            let req = script_req(
                COPY_SCRIPT,
                &[&ctx, src, dest, own.as_deref().unwrap_or(""), mode, &wd],
            );
            let code = run_cmd(node, build, sandbox, req, name, "info")
                .await
                .map_err(|m| fail(name, format!("COPY {src}: {m}")))?;
            if code != 0 {
                return Err(fail(name, format!("COPY {src} {dest}: exit status {code}")));
            }
        }
        "ENV" => {
            for kv in st.args.chunks(2) {
                if let [k, v] = kv {
                    cur.env.insert(k.clone(), v.clone());
                }
            }
        }
        "WORKDIR" => {
            let w = arg(0).ok_or_else(|| fail(name, "WORKDIR: no directory"))?;
            let path = under(cur, w);
            let own = cur.user.clone().unwrap_or_default();
            let req = script_req(
                r#"[ -d "$1" ] || { mkdir -p -- "$1" && { [ -z "$2" ] || chown -- "$2" "$1"; }; }"#,
                &[&path, &own],
            );
            let code = run_cmd(node, build, sandbox, req, name, "info")
                .await
                .map_err(|m| fail(name, format!("WORKDIR {w}: {m}")))?;
            if code != 0 {
                return Err(fail(name, format!("WORKDIR {w}: exit status {code}")));
            }
            cur.workdir = Some(path);
        }
        "USER" => {
            let u = arg(0).ok_or_else(|| fail(name, "USER: no user"))?;
            if !known_user(node, sandbox, u).await {
                return Err(fail(name, format!("USER {u}: invalid username: '{u}'")));
            }
            cur.user = Some(u.to_string());
        }
        other => {
            return Err(fail(
                name,
                format!("the step {other} is not one this node builds"),
            ))
        }
    }
    Ok(())
}
