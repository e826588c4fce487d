//! A watch of a directory over its own agent connection ([`HostMsg::Watch`]): the agent's
//! batches of changes as they come, as the node's [`WatchItem`]s. Dropping the [`Watcher`]
//! closes the connection, which ends the watch in the agent.

use sbx_api::ApiError;
use sbx_proto::{AgentMsg, Frame, HostMsg};
use tokio::sync::mpsc;

use super::files::{api_error, TaskGuard};
use super::{AgentConn, AgentError};
use crate::node::files::{WatchItem, Watcher};

/// The id of the one watch of a connection.
const ID: &str = "w";

/// Batches queued for the watch's reader (the agent waits while it is full, and the kernel
/// bounds what it holds meanwhile).
pub(crate) const QUEUE: usize = 16;

fn broke(e: AgentError) -> ApiError {
    ApiError::new(
        sbx_api::ErrorCode::StreamAborted,
        format!("the watch's connection to the sandbox's agent broke: {e}"),
    )
}

/// What ends a watch from outside: its sandbox going to sleep (the signal turns true; a
/// connection open to the agent cannot be checkpointed), and what the watch holds while its
/// connection is open (the node counts it).
pub struct Ends {
    pub asleep: tokio::sync::watch::Receiver<bool>,
    pub hold: Box<dyn Send>,
}

/// Starts watching `path` (`recursive`: the directories under it too) on `conn`.
pub async fn watch(
    mut conn: AgentConn,
    path: String,
    recursive: bool,
    ends: Option<Ends>,
) -> Result<Watcher, ApiError> {
    conn.send(&HostMsg::Watch {
        id: ID.into(),
        path,
        recursive,
    })
    .await
    .map_err(broke)?;
    loop {
        match conn.recv().await.map_err(broke)? {
            Frame::Msg(AgentMsg::WatchStarted { .. }) => break,
            Frame::Msg(AgentMsg::WatchEnded { error, .. }) => {
                return Err(match error {
                    Some(f) => api_error(f),
                    None => broke(AgentError::Closed),
                })
            }
            _ => {}
        }
    }
    let (tx, rx) = mpsc::channel(QUEUE);
    let task = tokio::spawn(pump(conn, tx, ends));
    Ok(Watcher {
        items: rx,
        _task: TaskGuard(task),
    })
}

async fn pump(mut conn: AgentConn, tx: mpsc::Sender<WatchItem>, ends: Option<Ends>) {
    let (mut asleep, _hold) = match ends {
        Some(e) => (Some(e.asleep), Some(e.hold)),
        None => (None, None),
    };
    let sleeps = async move {
        match asleep.as_mut() {
            Some(a) => a.wait_for(|s| *s).await.map(|_| ()).ok(),
            None => std::future::pending().await,
        }
    };
    tokio::pin!(sleeps);
    loop {
        let f = tokio::select! {
            f = conn.recv() => f,
            // The reader is gone: dropping the connection ends the watch in the agent.
            _ = tx.closed() => return,
            _ = &mut sleeps => {
                drop(conn);
                let _ = tx
                    .send(WatchItem::Ended(ApiError::new(
                        sbx_api::ErrorCode::StreamAborted,
                        "the sandbox went to sleep: the watch ended (watch again once it is awake)",
                    )))
                    .await;
                return;
            }
        };
        let item = match f {
            Ok(Frame::Msg(AgentMsg::WatchEvents {
                events, overflow, ..
            })) => WatchItem::Events {
                events: events.into_iter().map(Into::into).collect(),
                overflow,
            },
            Ok(Frame::Msg(AgentMsg::WatchEnded { error, .. })) => WatchItem::Ended(match error {
                Some(f) => api_error(f),
                None => broke(AgentError::Closed),
            }),
            Ok(_) => continue,
            Err(e) => WatchItem::Ended(broke(e)),
        };
        let end = matches!(item, WatchItem::Ended(_));
        if tx.send(item).await.is_err() || end {
            return;
        }
    }
}
