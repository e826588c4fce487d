//! `filesystem.Filesystem`: stat, list, make, move, remove and watch the sandbox's files,
//! through the node's file operations (`Node::fs_op`, `Node::fs_watch`), which the sandbox's
//! agent runs inside it. Paths are envd's: relative to the user's home (`entry.rs`); what is
//! made belongs to the request's user, as envd makes it.

pub mod entry;
mod watch;

pub use watch::Watchers;

use axum::body::Body;
use axum::http::Request;
use axum::response::Response;
use sbx_api::ErrorCode;
use sbx_proto::{FsOp, FsResult};
use serde::Deserialize;
use serde_json::{json, Value};

use self::entry::{entry_info, parent, resolve, users_for};
use super::Ctx;
use crate::agent::files::unexpected;
use crate::connect::{read_unary, unary_reply, Code, RpcError};

#[derive(Deserialize, Default)]
#[serde(default)]
struct PathReq {
    path: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct MoveReq {
    source: String,
    destination: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ListReq {
    path: String,
    depth: u32,
}

/// The most levels ListDir walks.
const MAX_DEPTH: u32 = 64;

pub async fn call(ctx: Ctx, name: &str, req: Request<Body>) -> Response {
    match name {
        "WatchDir" => return watch::watch_dir(ctx, req).await,
        "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
            return watch::unary(ctx, name, req).await
        }
        _ => {}
    }
    let (parts, body) = req.into_parts();
    let r = match name {
        "Stat" => match read_unary::<PathReq>(&parts.headers, body).await {
            Ok(r) => stat(&ctx, r).await,
            Err(e) => Err(e),
        },
        "MakeDir" => match read_unary::<PathReq>(&parts.headers, body).await {
            Ok(r) => make_dir(&ctx, r).await,
            Err(e) => Err(e),
        },
        "Move" => match read_unary::<MoveReq>(&parts.headers, body).await {
            Ok(r) => move_(&ctx, r).await,
            Err(e) => Err(e),
        },
        "ListDir" => match read_unary::<ListReq>(&parts.headers, body).await {
            Ok(r) => list_dir(&ctx, r).await,
            Err(e) => Err(e),
        },
        "Remove" => match read_unary::<PathReq>(&parts.headers, body).await {
            Ok(r) => remove(&ctx, r).await,
            Err(e) => Err(e),
        },
        other => Err(RpcError::unimplemented(format!(
            "filesystem.Filesystem/{other} is not a method this node serves"
        ))),
    };
    unary_reply(r)
}

/// The entry of an operation's result.
fn entry_of(r: FsResult) -> Result<sbx_proto::FsEntry, RpcError> {
    match r {
        FsResult::Entry { entry, .. } => Ok(entry),
        other => Err(unexpected(&other).into()),
    }
}

async fn stat(ctx: &Ctx, r: PathReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    let e = entry_of(ctx.node().fs_op(&ctx.sandbox, FsOp::Stat { path }).await?)?;
    Ok(json!({ "entry": entry_info(&e, &users) }))
}

/// Makes `dir` and its missing parents, owned by the request's user: whether `dir` was made.
async fn make_dirs(ctx: &Ctx, dir: &str, owner: Option<String>) -> Result<FsResult, RpcError> {
    let op = FsOp::Mkdir {
        path: dir.to_string(),
        parents: true,
        mode: None,
        owner,
    };
    ctx.node()
        .fs_op(&ctx.sandbox, op)
        .await
        .map_err(|e| match e.code {
            ErrorCode::PathExists | ErrorCode::WrongType => {
                RpcError::invalid(format!("{dir}: a path on the way is not a directory"))
            }
            _ => e.into(),
        })
}

async fn make_dir(ctx: &Ctx, r: PathReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    match make_dirs(ctx, &path, users.owner(ctx.user())).await? {
        FsResult::Entry {
            created: false,
            entry,
        } if entry.kind == sbx_proto::FsKind::Dir => Err(RpcError::new(
            Code::AlreadyExists,
            format!("directory already exists: {path}"),
        )),
        r => Ok(json!({ "entry": entry_info(&entry_of(r)?, &users) })),
    }
}

async fn move_(ctx: &Ctx, r: MoveReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let home = users.home(ctx.user());
    let src = resolve(&r.source, &home)?;
    let dst = resolve(&r.destination, &home)?;
    // As envd: the destination's directories are made (the user's), then a rename that
    // replaces what is there.
    make_dirs(ctx, &parent(&dst), users.owner(ctx.user())).await?;
    let op = FsOp::Move {
        src,
        dst,
        overwrite: true,
    };
    let e = entry_of(ctx.node().fs_op(&ctx.sandbox, op).await?)?;
    Ok(json!({ "entry": entry_info(&e, &users) }))
}

async fn list_dir(ctx: &Ctx, r: ListReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    let depth = r.depth.clamp(1, MAX_DEPTH);
    let op = FsOp::List {
        path,
        limit: None,
        depth: Some(depth),
    };
    let res = ctx.node().fs_op(&ctx.sandbox, op).await.map_err(|e| {
        if e.code == ErrorCode::WrongType {
            RpcError::invalid(e.message)
        } else {
            e.into()
        }
    })?;
    match res {
        FsResult::List { entries, truncated } => {
            if truncated {
                tracing::info!(sandbox = %ctx.sandbox, "ListDir: the listing was cut at the agent's cap");
            }
            let entries: Vec<Value> = entries.iter().map(|e| entry_info(e, &users)).collect();
            Ok(json!({ "entries": entries }))
        }
        other => Err(unexpected(&other).into()),
    }
}

async fn remove(ctx: &Ctx, r: PathReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    let op = FsOp::Remove {
        path,
        recursive: true,
    };
    // As envd (a RemoveAll): what is not there is removed already.
    match ctx.node().fs_op(&ctx.sandbox, op).await {
        Ok(_) => Ok(json!({})),
        Err(e) if e.code == ErrorCode::PathNotFound => Ok(json!({})),
        Err(e) => Err(e.into()),
    }
}
