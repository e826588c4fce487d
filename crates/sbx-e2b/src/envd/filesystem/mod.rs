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
use serde::Deserialize;
use serde_json::{json, Value};

use self::entry::{entry_info, parent, resolve, users_for};
use super::Ctx;
use crate::connect::{read_unary, unary_reply, Code, RpcError};
use crate::node::files::{FileKind, FsMade};

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

async fn stat(ctx: &Ctx, r: PathReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    let e = ctx.node().fs_stat(&ctx.sandbox, &path).await?;
    Ok(json!({ "entry": entry_info(&e, &users) }))
}

/// Makes `dir` and its missing parents, owned by the request's user: whether `dir` was made.
async fn make_dirs(ctx: &Ctx, dir: &str, owner: Option<String>) -> Result<FsMade, RpcError> {
    ctx.node()
        .fs_mkdir(&ctx.sandbox, dir, true, None, owner)
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
        FsMade {
            created: false,
            entry,
        } if entry.kind == FileKind::Dir => Err(RpcError::new(
            Code::AlreadyExists,
            format!("directory already exists: {path}"),
        )),
        made => Ok(json!({ "entry": entry_info(&made.entry, &users) })),
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
    let e = ctx.node().fs_move(&ctx.sandbox, &src, &dst, true).await?;
    Ok(json!({ "entry": entry_info(&e, &users) }))
}

async fn list_dir(ctx: &Ctx, r: ListReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    let depth = r.depth.clamp(1, MAX_DEPTH);
    let listing = ctx
        .node()
        .fs_list(&ctx.sandbox, &path, None, Some(depth))
        .await
        .map_err(|e| {
            if e.code == ErrorCode::WrongType {
                RpcError::invalid(e.message)
            } else {
                e.into()
            }
        })?;
    if listing.truncated {
        tracing::info!(sandbox = %ctx.sandbox, "ListDir: the listing was cut at the agent's cap");
    }
    let entries: Vec<Value> = listing
        .entries
        .iter()
        .map(|e| entry_info(e, &users))
        .collect();
    Ok(json!({ "entries": entries }))
}

async fn remove(ctx: &Ctx, r: PathReq) -> Result<Value, RpcError> {
    let users = users_for(ctx, ctx.user()).await?;
    let path = resolve(&r.path, &users.home(ctx.user()))?;
    // As envd (a RemoveAll): what is not there is removed already.
    match ctx.node().fs_remove(&ctx.sandbox, &path, true).await {
        Ok(_) => Ok(json!({})),
        Err(e) if e.code == ErrorCode::PathNotFound => Ok(json!({})),
        Err(e) => Err(e.into()),
    }
}
