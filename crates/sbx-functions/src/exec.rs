//! `sandbox::exec` and `sandbox::run`: commands, waited for, their output capped.

use std::sync::Arc;

use sbx_api::functions::FnError;
use sbx_api::{ApiError, Encoding, ExecObject, ExecStatus};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use std::time::Duration;

use sbx_api::{Command, ExecRequest, RunRequest};

use super::*;
use crate::node::output::Collected;
use crate::node::Node;

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

/// A command's `timeout_ms`, capped by the node's `max_exec_timeout_ms` (its default).
pub(super) fn timeout_ms(f: &Fns, p: &Payload) -> Result<Duration, FnError> {
    let max = f.cfg.max_exec_timeout_ms;
    let ms = match p.u64("timeout_ms")? {
        Some(0) => return Err(FnError::invalid("timeout_ms must be over 0")),
        Some(t) => t.min(max),
        None => max,
    };
    Ok(Duration::from_millis(ms))
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

/// The command request of `argv` with a payload's `timeout_ms`, `env`, `workdir` and `stdin`
/// (those it has), checked as the HTTP API checks one.
pub(super) fn exec_request(
    f: &Fns,
    argv: Vec<String>,
    p: &Payload,
) -> Result<ExecRequest, FnError> {
    let limit = timeout_ms(f, p)?;
    let mut req = ExecRequest::new(Command::Argv(argv));
    req.timeout = Some(limit);
    req.wait_seconds = (limit.as_secs_f64() + 5.0).min(sbx_api::sandbox::MAX_WAIT_SECONDS);
    req.env = p.env()?.unwrap_or_default();
    req.cwd = p.str("workdir")?;
    req.stdin = p.str("stdin")?.map(String::into_bytes);
    req.check()?;
    Ok(req)
}

/// Runs a command in sandbox `id` through `Node::exec` and waits for its end. Returns the
/// reply, whether it timed out, and its timeout.
pub(super) async fn exec(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    id: &str,
    req: ExecRequest,
) -> Result<(Value, bool, Duration), FnError> {
    let limit = req.timeout.unwrap_or_default();
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
    let timed_out = obj.status == ExecStatus::TimedOut;
    Ok((reply(&obj), timed_out, limit))
}

/// The reply of `sandbox::exec` and `sandbox::run`: a command's ended exec object, its output
/// the last [`OUTPUT_CAP`] bytes of each stream.
fn reply(obj: &ExecObject) -> Value {
    let (so, se) = truncation(obj);
    let timed_out = obj.status == ExecStatus::TimedOut;
    let exit_code = obj.exit_code.unwrap_or(-1);
    json!({
        "stdout": obj.stdout,
        "stderr": obj.stderr,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "duration_ms": (obj.duration_seconds.unwrap_or(0.0) * 1000.0).round() as u64,
        "success": exit_code == 0 && !timed_out,
        "stdout_truncated": so,
        "stderr_truncated": se,
    })
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
        let create = CreateArgs {
            image,
            cpus: None,
            memory_mb: None,
            name: None,
            env: p.env()?.unwrap_or_default(),
            idle_timeout_secs: None,
            network: false,
        };
        let mut req = exec_request(f, argv, &p)?;
        // The sandbox has the env; the command, the sandbox's.
        req.env.clear();
        return run_kept(node, f, create, req, files, keep).await;
    }
    let limit = timeout_ms(f, &p)?;
    let mut req = RunRequest::new(Command::Argv(argv));
    req.image = Some(local);
    req.timeout = limit;
    req.env = p.env()?.unwrap_or_default();
    req.stdin = p.str("stdin")?.map(String::into_bytes);
    req.check()?;
    capacity(node)?;
    let plan = node.plan_run(req)?;
    let meta = plan.meta();
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(node.clone().run(plan, tx));
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        if let Some(obj) = c.take(&meta, ev) {
            return Ok(reply(&obj?));
        }
    }
    Err(ApiError::internal().into())
}

/// `sandbox::run` with files or `keep_sandbox`: create, write the files, exec, stop (unless
/// kept).
pub(super) async fn run_kept(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    create_args: CreateArgs,
    req: ExecRequest,
    files: Vec<Value>,
    keep: bool,
) -> Result<Value, FnError> {
    let (id, _) = create(node, f, create_args).await?;
    let r = async {
        for file in files {
            let Value::Object(mut m) = file else {
                return Err(FnError::invalid("files must be a list of {path, content}"));
            };
            m.insert("sandbox_id".into(), json!(id));
            m.entry("parents").or_insert(json!(true));
            fs_call(node, "write", &id, Payload(m)).await?;
        }
        exec(node, f, &id, req).await
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
