//! Terminals: `GET /v1/sandboxes/{id}/exec/{exec_id}/terminal` upgrades to a WebSocket bound to
//! a command that runs on a PTY (`tty: true`). Client to node: binary messages are input;
//! text messages are JSON controls, `{"type":"resize","rows":R,"cols":C}` or
//! `{"type":"input","data":"..."}`. Node to client: binary messages are output (from `from`,
//! default 0, so the screen so far is replayed; the output is kept in the command's ring like
//! any command's), then a text message `{"type":"exit", ...the exec object's status, exit_code,
//! signal}` and a close. A release of the sandbox (a move to another node) ends it with a text
//! message `{"type":"error","error":{..."code":"sandbox_moved"...},"to","epoch","offset"}`
//! (`offset`: the output position sent up to) and a close.
//!
//! The session is the node's terminal (`crate::node::terminal`), whose output is read ahead by
//! a task of its own: a read is never cut midway by a message from the client. A client
//! message (fragments included) is at most [`MAX_MESSAGE`] bytes; a longer one ends the
//! session with a close frame 1009 (message too big).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{close_code, CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Path, Query, State};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};

use crate::node::terminal::{TerminalError, TerminalEvent, TerminalTarget};
use crate::{AppState, HttpResult, RequestId};

/// The most bytes of one message from the client, all its fragments together.
pub const MAX_MESSAGE: usize = 4 << 20;

pub(super) async fn terminal(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    Path((id, exec_id)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> HttpResult<Response> {
    let from = match q.get("from").map(|v| v.parse::<u64>()) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return Err(ApiError::invalid_field("from", "from must be a position").into())
        }
    };
    let target = st.node.terminal(&id, &exec_id)?;
    let ws = ws.map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidField,
            format!("this route is a WebSocket: {e}"),
        )
        .with_param("Upgrade")
    })?;
    let held = st.node.use_sandbox(&id).await.transpose()?;
    // A release of the sandbox ends the session with `sandbox_moved`.
    let moved = st.node.moved_signal(&id);
    let docs = st.docs_url.clone();
    Ok(ws
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
        .on_upgrade(move |ws| async move {
            // The sandbox stays awake while its terminal is open, unless a sleep asked for
            // cuts it.
            let cut = held.as_ref().map(|h| h.cut());
            let _held = held;
            let cut = async move {
                match cut {
                    Some(c) => c.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = session(ws, target, from, moved, (rid.0, docs)) => {
                    if let Err(e) = r {
                        tracing::info!(error = %e, "terminal session ended");
                    }
                }
                () = cut => tracing::info!("terminal closed: the sandbox was put to sleep"),
            }
        }))
}

pub(super) async fn session(
    ws: WebSocket,
    target: TerminalTarget,
    from: u64,
    moved: impl std::future::Future<Output = ApiError>,
    (rid, docs): (String, Option<String>),
) -> Result<(), TerminalError> {
    let mut term = target.open(from).await?;
    let (mut tx, mut rx) = ws.split();
    // The position of the command's output the session has sent up to.
    let mut offset = from;
    tokio::pin!(moved);
    loop {
        tokio::select! {
            e = &mut moved => {
                // `{"type":"error", "error": {...}, "to", "epoch", "offset"}`, then a close.
                let e = e.with_beside("offset", json!(offset));
                let mut end = sbx_api::error_body(&e, &rid, docs.as_deref());
                if let Some(o) = end.as_object_mut() {
                    o.insert("type".into(), json!("error"));
                }
                let _ = tx.send(Message::Text(end.to_string().into())).await;
                let _ = tx.send(Message::Close(None)).await;
                return Ok(());
            }
            msg = rx.next() => {
                let msg = match msg {
                    Some(Ok(msg)) => msg,
                    Some(Err(e)) => {
                        // A message over the cap (or a broken one): said with a close frame.
                        let too_big = matches!(
                            std::error::Error::source(&e)
                                .and_then(|s| s.downcast_ref::<tungstenite::Error>()),
                            Some(tungstenite::Error::Capacity(_))
                        );
                        let (code, reason) = if too_big {
                            (close_code::SIZE, "message over 4 MiB")
                        } else {
                            (close_code::PROTOCOL, "invalid message")
                        };
                        tracing::info!(error = %e, "terminal: client message refused");
                        let _ = tx
                            .send(Message::Close(Some(CloseFrame {
                                code,
                                reason: reason.into(),
                            })))
                            .await;
                        return Ok(());
                    }
                    None => return Ok(()),
                };
                match msg {
                    Message::Binary(b) => {
                        term.input(&b).await?;
                    }
                    Message::Text(t) => {
                        let v: Value = serde_json::from_str(t.as_str()).unwrap_or(Value::Null);
                        match v["type"].as_str() {
                            Some("resize") => {
                                let rows = v["rows"].as_u64().unwrap_or(24).clamp(1, 1000) as u16;
                                let cols = v["cols"].as_u64().unwrap_or(80).clamp(1, 1000) as u16;
                                term.resize(rows, cols).await?;
                            }
                            Some("input") => {
                                let data = v["data"].as_str().unwrap_or("");
                                term.input(data.as_bytes()).await?;
                            }
                            _ => {}
                        }
                    }
                    Message::Close(_) => return Ok(()),
                    _ => {}
                }
            }
            event = term.next_event() => {
                match event? {
                    TerminalEvent::Output(bytes) => {
                        offset += bytes.len() as u64;
                        if tx.send(Message::Binary(bytes.into())).await.is_err() {
                            return Ok(());
                        }
                    }
                    TerminalEvent::Exit { status, exit_code, signal } => {
                        let end = json!({
                            "type": "exit",
                            "status": status.as_str(),
                            "exit_code": exit_code,
                            "signal": signal.map(sbx_api::signal_name),
                        });
                        let _ = tx.send(Message::Text(end.to_string().into())).await;
                        let _ = tx.send(Message::Close(None)).await;
                        return Ok(());
                    }
                }
            }
        }
    }
}
