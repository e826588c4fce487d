//! `sandbox::fs::*`: the file operations, through the node's own (`crate::node::files`): the
//! same parameters, checks and error codes as `/v1/sandboxes/{id}/files…`.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt;
use sbx_api::files::{FsCall, FsParams, WriteRequest};
use sbx_api::functions::FnError;
use serde_json::{json, Map, Value};

use super::{Payload, INLINE_MAX};
use crate::node::files::{FsRead, FsReply};
use crate::node::Node;

/// An answer's object as the function's JSON.
fn object_of(r: FsReply) -> Result<Value, FnError> {
    serde_json::to_value(r.object).map_err(|e| {
        tracing::error!(error = %e, "a file operation's answer as JSON");
        FnError::from(sbx_api::ApiError::internal())
    })
}

/// What a URL's path or query value keeps as it is: the unreserved characters and `/`.
const KEEP: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

/// `s` percent-escaped for a URL's path or query.
fn pct(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, KEEP).to_string()
}

/// `sandbox::fs::{op}` in sandbox `id` with the payload's other fields.
pub(super) async fn fs_call(
    node: &Arc<Node>,
    op: &str,
    id: &str,
    p: Payload,
) -> Result<Value, FnError> {
    let mut rest = p.0;
    rest.remove("sandbox_id");
    let call = |c: FsCall, rest: Map<String, Value>| async move {
        Payload(rest.clone()).known(c.fields())?;
        let req = c.request(&FsParams::from_payload(rest))?;
        object_of(node.fs_call(id, &req).await?)
    };
    match op {
        "mkdir" => call(FsCall::Mkdir, rest).await,
        "rm" => call(FsCall::Remove, rest).await,
        "chmod" => call(FsCall::Chmod, rest).await,
        "grep" => call(FsCall::Grep, rest).await,
        "sed" => call(FsCall::Sed, rest).await,
        "stat" => call(FsCall::Stat, rest).await,
        "ls" => call(FsCall::List, rest).await,
        "mv" => {
            let q = Payload(rest);
            q.known(&["src", "dst", "overwrite"])?;
            let mut m = Map::new();
            m.insert("path".into(), json!(q.req_str("src")?));
            m.insert("dst".into(), json!(q.req_str("dst")?));
            if let Some(o) = q.bool("overwrite")? {
                m.insert("overwrite".into(), json!(o));
            }
            call(FsCall::Move, m).await
        }
        "write" => {
            let q = Payload(rest);
            q.known(&["path", "content", "content_b64", "mode", "parents", "owner"])?;
            let bytes = match (q.get("content"), q.str("content_b64")?) {
                (Some(_), Some(_)) => {
                    return Err(FnError::invalid("give content or content_b64, not both"))
                }
                (Some(Value::String(s)), None) => s.clone().into_bytes(),
                (Some(v), None) => v.to_string().into_bytes(),
                (None, Some(b)) => base64::engine::general_purpose::STANDARD
                    .decode(b.trim())
                    .map_err(|_| FnError::invalid("content_b64 is not base64"))?,
                (None, None) => return Err(FnError::invalid("content or content_b64 is required")),
            };
            let mut m = q.0;
            m.remove("content");
            m.remove("content_b64");
            let w = WriteRequest::parse(&FsParams::from_payload(m))?;
            let once =
                futures_util::stream::iter([Ok::<_, std::convert::Infallible>(Bytes::from(bytes))]);
            let r = node.fs_write(id, w.into(), once).await?;
            object_of(r.reply())
        }
        "read" => {
            let q = Payload(rest);
            q.known(&["path"])?;
            let path = q.req_str("path")?;
            let mut d = node.fs_read(id, FsRead::whole(path.clone())).await?;
            let size = d.size;
            let mut reply = json!({
                "path": path,
                "size": size,
                "content": {
                    "method": "GET",
                    "url": format!("/v1/sandboxes/{}/files?path={}", pct(id), pct(&path)),
                },
            });
            if size <= INLINE_MAX {
                let mut bytes = Vec::with_capacity(size as usize);
                while let Some(chunk) = d.chunks.next().await {
                    let chunk = chunk.map_err(|e| {
                        FnError::new("S218", format!("the file's bytes broke off: {e}"))
                    })?;
                    if bytes.len() + chunk.len() > INLINE_MAX as usize {
                        // The file grew since it was opened: its first bytes are not all of it.
                        break;
                    }
                    bytes.extend_from_slice(&chunk);
                }
                match std::str::from_utf8(&bytes) {
                    Ok(s) => reply["body"] = json!(s),
                    Err(_) => {
                        reply["content_b64"] =
                            json!(base64::engine::general_purpose::STANDARD.encode(&bytes))
                    }
                }
            }
            Ok(reply)
        }
        other => Err(FnError::new(
            "S304",
            format!("no function sandbox::fs::{other}"),
        )),
    }
}
