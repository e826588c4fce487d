//! File operations over an agent connection ([`AgentConn`]): one operation per connection, its
//! bytes streamed. An upload's bytes become data frames as they come (at most [`FRAME`] bytes
//! gathered), a download's data frames become chunks as they come (a queue of
//! [`DOWNLOAD_QUEUE`]); each side waits for the other, so a slow reader slows the writer and
//! memory does not grow with the size of a file.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use sbx_api::{ApiError, ErrorCode};
use sbx_proto::{
    read_frame, AgentMsg, Frame, FsErrorCode, FsFailure, FsOp, FsResult, HostMsg, Stream, MAX_DATA,
};
use sbx_runtime::sock::{ReadHalf, WriteHalf};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{AgentConn, AgentError};
use crate::node::files::Download;

/// The id of the one operation of a connection.
const OP: &str = "fs";

/// Upload bytes gathered into one data frame.
pub(crate) const FRAME: usize = MAX_DATA;

/// Download chunks queued for the reader.
pub(crate) const DOWNLOAD_QUEUE: usize = 4;

/// How long the rest of an upload is read (and dropped) after the agent refused it, so that the
/// client reads the answer instead of a reset connection.
const DRAIN_FOR: Duration = Duration::from_secs(30);

fn aborted(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::StreamAborted, message)
}

fn gone(e: impl std::fmt::Display) -> ApiError {
    aborted(format!("the connection to the sandbox's agent broke: {e}"))
}

fn broke(e: AgentError) -> ApiError {
    match e {
        AgentError::Closed => aborted("the sandbox's agent closed the connection"),
        e => gone(e),
    }
}

/// A failure of the agent as the API's error (one code for each).
pub fn api_error(f: FsFailure) -> ApiError {
    let code = match f.code {
        FsErrorCode::Invalid => ErrorCode::FsInvalid,
        FsErrorCode::NotFound => ErrorCode::PathNotFound,
        FsErrorCode::WrongType => ErrorCode::WrongType,
        FsErrorCode::Exists => ErrorCode::PathExists,
        FsErrorCode::NotEmpty => ErrorCode::NotEmpty,
        FsErrorCode::PermissionDenied => ErrorCode::PermissionDenied,
        FsErrorCode::Io => ErrorCode::IoError,
        FsErrorCode::BadPattern => ErrorCode::BadPattern,
        FsErrorCode::Aborted => ErrorCode::StreamAborted,
        FsErrorCode::Unsupported => ErrorCode::Unsupported,
    };
    let e = ApiError::new(code, f.message);
    match f.param {
        Some(p) => e.with_param(p),
        None => e,
    }
}

/// The agent answered an operation with another's result.
pub fn unexpected(r: &FsResult) -> ApiError {
    tracing::error!(result = ?r, "the agent answered a file operation with another's result");
    ApiError::internal()
}

/// Aborts a task when dropped.
pub(crate) struct TaskGuard(pub tokio::task::JoinHandle<()>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An operation without bytes: its result.
pub async fn call(mut conn: AgentConn, op: FsOp) -> Result<FsResult, ApiError> {
    conn.send(&HostMsg::Fs { id: OP.into(), op })
        .await
        .map_err(broke)?;
    loop {
        let answer = match conn.recv().await.map_err(broke)? {
            Frame::Msg(AgentMsg::FsDone { result, .. }) => Ok(result),
            Frame::Msg(AgentMsg::FsError { error, .. }) => Err(api_error(error)),
            _ => continue,
        };
        // Answered: the connection serves the next operation on the same agent.
        conn.release();
        return answer;
    }
}

/// The agent's messages, read on a task of their own (reading a frame is not cancel-safe).
async fn read_msgs(mut rd: BufReader<ReadHalf>, tx: mpsc::Sender<Result<AgentMsg, String>>) {
    loop {
        let m = match read_frame::<AgentMsg, _>(&mut rd).await {
            Ok(Some(Frame::Msg(m))) => Ok(m),
            Ok(Some(Frame::Data { .. })) => continue,
            Ok(None) => Err("the sandbox's agent closed the connection".to_string()),
            Err(e) => Err(e.to_string()),
        };
        let end = m.is_err();
        if tx.send(m).await.is_err() || end {
            return;
        }
    }
}

fn answer(m: Option<Result<AgentMsg, String>>) -> Result<FsResult, ApiError> {
    match m {
        Some(Ok(AgentMsg::FsDone { result, .. })) => Ok(result),
        Some(Ok(AgentMsg::FsError { error, .. })) => Err(api_error(error)),
        Some(Ok(other)) => {
            tracing::error!(msg = ?other, "unexpected message during an upload");
            Err(ApiError::internal())
        }
        Some(Err(e)) => Err(gone(e)),
        None => Err(aborted("the sandbox's agent went away")),
    }
}

async fn write_frames(
    wr: &mut BufWriter<WriteHalf>,
    data: &[u8],
    pos: &mut u64,
) -> std::io::Result<()> {
    for chunk in data.chunks(MAX_DATA) {
        wr.write_all(&sbx_proto::encode_data_header(
            OP,
            Stream::File,
            *pos,
            chunk.len(),
        ))
        .await?;
        wr.write_all(chunk).await?;
        *pos += chunk.len() as u64;
    }
    Ok(())
}

/// Reads what is left of an upload's bytes, for at most [`DRAIN_FOR`].
async fn drain<S, E>(bytes: &mut S)
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
{
    let _ = tokio::time::timeout(DRAIN_FOR, async {
        while let Some(Ok(_)) = bytes.next().await {}
    })
    .await;
}

/// An upload: `op`, `bytes` as data frames as they are read, their end; the agent's result.
/// The agent may fail it midway (its answer comes before the end): the rest of the bytes are
/// read and dropped, and its error answered. An error of `bytes` aborts the upload (the old
/// file stays).
pub async fn upload<S, E>(conn: AgentConn, op: FsOp, mut bytes: S) -> Result<FsResult, ApiError>
where
    S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let (rd, wr) = conn.into_parts();
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let (mtx, mut mrx) = mpsc::channel(4);
    let _reader = TaskGuard(tokio::spawn(read_msgs(rd, mtx)));
    let start = sbx_proto::encode_msg(&HostMsg::Fs { id: OP.into(), op })
        .map_err(crate::fail::internal("encoding a file operation"))?;
    let broke = |e: std::io::Error, mrx: &mut mpsc::Receiver<Result<AgentMsg, String>>| {
        // The agent's own answer says more than a broken pipe, when it sent one.
        match mrx.try_recv() {
            Ok(m) => answer(Some(m)).and(Err(gone(&e))),
            Err(_) => Err(gone(e)),
        }
    };
    if let Err(e) = async {
        wr.write_all(&start).await?;
        wr.flush().await
    }
    .await
    {
        return broke(e, &mut mrx);
    }
    let mut buf: Vec<u8> = Vec::with_capacity(FRAME);
    let mut pos = 0u64;
    loop {
        tokio::select! {
            m = mrx.recv() => {
                let r = answer(m);
                drain(&mut bytes).await;
                return r;
            }
            chunk = bytes.next() => match chunk {
                Some(Ok(chunk)) => {
                    let r = if buf.is_empty() && chunk.len() >= FRAME {
                        write_frames(&mut wr, &chunk, &mut pos).await
                    } else {
                        buf.extend_from_slice(&chunk);
                        if buf.len() >= FRAME {
                            let r = write_frames(&mut wr, &buf, &mut pos).await;
                            buf.clear();
                            r
                        } else {
                            Ok(())
                        }
                    };
                    if let Err(e) = r {
                        return broke(e, &mut mrx);
                    }
                }
                Some(Err(e)) => {
                    // Dropping the connection aborts the upload: the old file stays.
                    return Err(aborted(format!("the request body broke off: {e}"))
                        .with_param("body"));
                }
                None => break,
            }
        }
    }
    let end = sbx_proto::encode_msg(&HostMsg::FsEnd { id: OP.into() })
        .map_err(crate::fail::internal("encoding an upload's end"))?;
    let finish = async {
        write_frames(&mut wr, &buf, &mut pos).await?;
        wr.write_all(&end).await?;
        wr.flush().await
    };
    if let Err(e) = finish.await {
        return broke(e, &mut mrx);
    }
    answer(mrx.recv().await)
}

/// A download: `op`, the agent's `FsOpened`, then its data frames as chunks. A failure midway
/// ends the chunks with an error.
pub async fn download(mut conn: AgentConn, op: FsOp) -> Result<Download, ApiError> {
    conn.send(&HostMsg::Fs { id: OP.into(), op })
        .await
        .map_err(broke)?;
    let (size, offset, length) = loop {
        match conn.recv().await.map_err(broke)? {
            Frame::Msg(AgentMsg::FsOpened {
                size,
                offset,
                length,
                ..
            }) => break (size, offset, length),
            Frame::Msg(AgentMsg::FsError { error, .. }) => return Err(api_error(error)),
            Frame::Msg(AgentMsg::FsDone { result, .. }) => return Err(unexpected(&result)),
            _ => {}
        }
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(DOWNLOAD_QUEUE);
    tokio::spawn(pump(conn, tx, length));
    Ok(Download {
        size,
        offset,
        length,
        chunks: ReceiverStream::new(rx),
    })
}

async fn pump(
    mut conn: AgentConn,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    length: Option<u64>,
) {
    let cut = |why: String| std::io::Error::other(why);
    let mut got = 0u64;
    loop {
        let f = tokio::select! {
            f = conn.recv() => f,
            // The reader hung up: dropping the connection stops the agent.
            _ = tx.closed() => return,
        };
        let item = match f {
            Ok(Frame::Data {
                stream: Stream::File,
                bytes,
                ..
            }) => {
                got += bytes.len() as u64;
                Ok(Bytes::from(bytes))
            }
            Ok(Frame::Msg(AgentMsg::FsDone { .. })) => {
                if length.is_some_and(|l| l != got) {
                    let _ = tx
                        .send(Err(cut(format!("{got} bytes sent of {length:?}"))))
                        .await;
                }
                return;
            }
            Ok(Frame::Msg(AgentMsg::FsError { error, .. })) => {
                tracing::warn!(error = %error.message, "a download failed midway");
                let _ = tx.send(Err(cut(error.message))).await;
                return;
            }
            Ok(_) => continue,
            Err(e) => {
                let _ = tx.send(Err(cut(broke(e).message))).await;
                return;
            }
        };
        if tx.send(item).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_proto::FsFailure;

    #[test]
    fn every_agent_failure_has_its_own_code() {
        let codes = [
            FsErrorCode::Invalid,
            FsErrorCode::NotFound,
            FsErrorCode::WrongType,
            FsErrorCode::Exists,
            FsErrorCode::NotEmpty,
            FsErrorCode::PermissionDenied,
            FsErrorCode::Io,
            FsErrorCode::BadPattern,
            FsErrorCode::Aborted,
            FsErrorCode::Unsupported,
        ];
        let s: Vec<&str> = codes
            .iter()
            .map(|c| {
                api_error(FsFailure::new(*c, "x").param("path"))
                    .s_code()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            s,
            ["S210", "S211", "S212", "S213", "S214", "S215", "S216", "S217", "S218", "S219"]
        );
        let e = api_error(FsFailure::new(FsErrorCode::NotFound, "gone").param("dst"));
        assert_eq!(e.param.as_deref(), Some("dst"));
        assert_eq!(e.status(), 404);
    }
}
