//! `sandbox::exec` and `sandbox::run`: commands, waited for, their output capped.

use std::sync::Arc;

use sbx_api::functions::FnError;
use sbx_api::{ApiError, Encoding, ExecObject, ExecStatus};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::*;
use crate::node::{Node, RunEvent};

/// The argv of `sandbox::exec`: `argv`, `cmd` + `args`, or `cmd` split at whitespace (not a
/// shell: no variables, quotes or pipes).
pub(super) fn exec_argv(p: &Payload) -> Result<Vec<String>, FnError> {
    let argv = p.str_list("argv")?.unwrap_or_default();
    let args = p.str_list("args")?.unwrap_or_default();
    let cmd = p.str("cmd")?.unwrap_or_default();
    let out: Vec<String> = if !argv.is_empty() {
        if !cmd.is_empty() || !args.is_empty() {
            return Err(FnError::invalid("give argv, or cmd (and args), not both"));
        }
        argv
    } else if cmd.trim().is_empty() {
        return Err(FnError::invalid("cmd (or argv) is required"));
    } else if args.is_empty() {
        cmd.split_whitespace().map(String::from).collect()
    } else {
        std::iter::once(cmd).chain(args).collect()
    };
    Ok(out)
}

/// The argv that runs `code` in `lang`.
pub(super) fn lang_argv(lang: &str, code: &str) -> Result<Vec<String>, FnError> {
    let (bin, flag) = match lang {
        "python" => ("python3", "-c"),
        "node" => ("node", "-e"),
        "shell" => ("sh", "-c"),
        path if path.starts_with('/') => {
            let base = path.rsplit('/').next().unwrap_or("");
            (path, if base.starts_with("node") { "-e" } else { "-c" })
        }
        other => {
            return Err(FnError::invalid(format!(
                "lang {other} is not node, python, shell or an interpreter's absolute path"
            )))
        }
    };
    Ok(vec![bin.to_string(), flag.to_string(), code.to_string()])
}

pub(super) fn timeout_ms(f: &Fns, p: &Payload) -> Result<u64, FnError> {
    let max = f.cfg.max_exec_timeout_ms;
    match p.u64("timeout_ms")? {
        Some(0) => Err(FnError::invalid("timeout_ms must be over 0")),
        Some(t) => Ok(t.min(max)),
        None => Ok(max),
    }
}

pub(super) fn truncation(obj: &ExecObject) -> (bool, bool) {
    let cap = OUTPUT_CAP as u64;
    let (o, e) = (obj.output.stdout_bytes > cap, obj.output.stderr_bytes > cap);
    if obj.truncated && !o && !e {
        // Bytes were dropped before the tails (a gap): which stream is not known.
        return (true, true);
    }
    (o, e)
}

/// Runs `argv` in sandbox `id` through `Node::exec` and waits for its end. Returns the reply,
/// whether it timed out, and its timeout.
pub(super) async fn exec(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    id: &str,
    argv: Vec<String>,
    p: &Payload,
) -> Result<(Value, bool, u64), FnError> {
    let limit = timeout_ms(f, p)?;
    let mut body = Map::new();
    body.insert("command".into(), json!(argv));
    body.insert("timeout_seconds".into(), json!(limit as f64 / 1000.0));
    let wait = (limit as f64 / 1000.0 + 5.0).min(sbx_api::sandbox::MAX_WAIT_SECONDS);
    body.insert("wait_seconds".into(), json!(wait));
    if let Some(env) = p.env()? {
        body.insert("env".into(), json!(env));
    }
    if let Some(w) = p.str("workdir")? {
        body.insert("cwd".into(), json!(w));
    }
    if let Some(s) = p.str("stdin")? {
        body.insert("stdin".into(), json!(s));
    }
    let bytes =
        serde_json::to_vec(&Value::Object(body)).map_err(|_| FnError::new("S300", "json"))?;
    let req = sbx_api::parse_exec_request(&bytes)?;
    f.touch(id);
    let r = node.exec(id, req, None).await;
    f.touch(id);
    let mut obj = r?;
    while obj.status == ExecStatus::Running {
        obj = node
            .exec_get(
                id,
                &obj.id,
                sbx_api::sandbox::MAX_WAIT_SECONDS,
                Encoding::Utf8,
            )
            .await?;
        f.touch(id);
    }
    let (so, se) = truncation(&obj);
    let timed_out = obj.status == ExecStatus::TimedOut;
    let exit_code = obj.exit_code.unwrap_or(-1);
    Ok((
        json!({
            "stdout": obj.stdout,
            "stderr": obj.stderr,
            "exit_code": exit_code,
            "timed_out": timed_out,
            "duration_ms": (obj.duration_seconds.unwrap_or(0.0) * 1000.0).round() as u64,
            "success": exit_code == 0 && !timed_out,
            "stdout_truncated": so,
            "stderr_truncated": se,
        }),
        timed_out,
        limit,
    ))
}

/// One stream's last [`OUTPUT_CAP`] bytes.
#[derive(Default)]
pub(super) struct Capped {
    buf: Vec<u8>,
    total: u64,
}

impl Capped {
    fn push(&mut self, d: &[u8]) {
        self.total += d.len() as u64;
        self.buf.extend_from_slice(d);
        if self.buf.len() > 2 * OUTPUT_CAP {
            let over = self.buf.len() - OUTPUT_CAP;
            self.buf.drain(..over);
        }
    }
    fn text(&self) -> String {
        let from = self.buf.len().saturating_sub(OUTPUT_CAP);
        let mut s = &self.buf[from..];
        if from > 0 {
            let skip = s
                .iter()
                .take(3)
                .take_while(|b| (**b & 0xC0) == 0x80)
                .count();
            s = &s[skip..];
        }
        String::from_utf8_lossy(s).into_owned()
    }
    fn truncated(&self) -> bool {
        self.total > OUTPUT_CAP as u64
    }
}

pub(super) async fn run(node: &Arc<Node>, f: &Arc<Fns>, p: Payload) -> Result<Value, FnError> {
    p.known(&[
        "image",
        "lang",
        "code",
        "files",
        "env",
        "stdin",
        "timeout_ms",
        "keep_sandbox",
    ])?;
    let image = p.req_str("image")?;
    let local = local_image(f, &image)?;
    let argv = lang_argv(&p.req_str("lang")?, &p.req_str("code")?)?;
    let keep = p.bool("keep_sandbox")?.unwrap_or(false);
    let files = match p.get("files") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| json!({ "path": k, "content": v }))
            .collect(),
        Some(_) => return Err(FnError::invalid("files must be a list of {path, content}")),
    };
    if keep || !files.is_empty() {
        return run_kept(node, f, &p, &image, argv, files, keep).await;
    }
    let limit = timeout_ms(f, &p)?;
    let mut body = Map::new();
    body.insert("image".into(), json!(local));
    body.insert("command".into(), json!(argv));
    body.insert("timeout_seconds".into(), json!(limit as f64 / 1000.0));
    if let Some(env) = p.env()? {
        body.insert("env".into(), json!(env));
    }
    if let Some(s) = p.str("stdin")? {
        body.insert("stdin".into(), json!(s));
    }
    let req = sbx_api::parse_run_value(&Value::Object(body))?;
    capacity(node, f)?;
    let plan = node.plan_run(req)?;
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(node.clone().run(plan, tx));
    let (mut out, mut err) = (Capped::default(), Capped::default());
    let mut gap = false;
    while let Some(ev) = rx.recv().await {
        match ev {
            RunEvent::Started { .. } => {}
            RunEvent::Output { stream, data, .. } => match stream {
                sbx_proto::Stream::Stderr => err.push(&data),
                _ => out.push(&data),
            },
            RunEvent::Gap { .. } => gap = true,
            RunEvent::Exited { exit, .. } => {
                let timed_out = exit.status == sbx_proto::ExitStatus::TimedOut;
                return Ok(json!({
                    "stdout": out.text(),
                    "stderr": err.text(),
                    "exit_code": exit.exit_code,
                    "timed_out": timed_out,
                    "duration_ms": exit.duration_ns / 1_000_000,
                    "success": exit.exit_code == 0 && !timed_out,
                    "stdout_truncated": out.truncated() || gap,
                    "stderr_truncated": err.truncated() || gap,
                }));
            }
            RunEvent::Failed(e) => return Err(e.into()),
        }
    }
    Err(ApiError::internal().into())
}

/// `sandbox::run` with files or `keep_sandbox`: create, write the files, exec, stop (unless
/// kept).
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_kept(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    p: &Payload,
    image: &str,
    argv: Vec<String>,
    files: Vec<Value>,
    keep: bool,
) -> Result<Value, FnError> {
    let mut c = Map::new();
    c.insert("image".into(), json!(image));
    if let Some(env) = p.env()? {
        c.insert("env".into(), json!(env));
    }
    let (id, _) = create(node, f, &Payload(c)).await?;
    let r = async {
        for file in files {
            let Value::Object(mut m) = file else {
                return Err(FnError::invalid("files must be a list of {path, content}"));
            };
            m.insert("sandbox_id".into(), json!(id));
            m.entry("parents").or_insert(json!(true));
            fs_call(node, "write", &id, Payload(m)).await?;
        }
        let mut e = Map::new();
        for k in ["stdin", "timeout_ms"] {
            if let Some(v) = p.get(k) {
                e.insert(k.into(), v.clone());
            }
        }
        exec(node, f, &id, argv, &Payload(e)).await
    }
    .await;
    if !keep || r.is_err() {
        let _ = stop(node, f, &id, false).await;
    }
    let (mut reply, _, _) = r?;
    if keep {
        reply["sandbox_id"] = json!(id);
    }
    Ok(reply)
}
