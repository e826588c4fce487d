//! Streams between a blocking worker (tar, zstd, the disk) and the store, with bounded memory.
//!
//! An upload: a `spawn_blocking` worker writes the plain stream into zstd, whose output a
//! [`ChannelWriter`] cuts into chunks of [`CHUNK`] bytes sent over a channel of
//! [`CHANNEL_CHUNKS`]; the async side puts them into a multipart upload (`WriteMultipart`,
//! parts of [`PART`] bytes, at most [`CONCURRENCY`] in flight). At most
//! `CHUNK * (CHANNEL_CHUNKS + 1) + PART * (CONCURRENCY + 1)` bytes are held, whatever the size.
//! A download: the object's byte stream goes over a channel to a worker that reads it through
//! zstd ([`ChannelReader`]), counted and hashed.
//!
//! Either side's failure stops the other; the store's error wins over the worker's (which then
//! only saw its channel closed). An upload that fails or whose future is dropped is aborted
//! ([`Aborting`]): nothing is left at its key.

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, Bytes};
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, WriteMultipart};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::error::{BlobError, Result};

/// The chunk the worker hands to the async side.
pub(crate) const CHUNK: usize = 1 << 20;
/// Chunks that may wait in the channel.
pub(crate) const CHANNEL_CHUNKS: usize = 4;
/// The size of a multipart upload's part (S3 wants at least 5 MiB but for the last).
pub(crate) const PART: usize = 8 << 20;
/// Parts uploaded at once.
pub(crate) const CONCURRENCY: usize = 4;
/// zstd's level: its default, fast enough for a node's uploads in the background.
pub(crate) const ZSTD_LEVEL: i32 = 3;

/// What one upload or download moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Moved {
    /// The plain stream's bytes (before zstd).
    pub bytes: u64,
    /// The object's bytes (zstd).
    pub stored_bytes: u64,
    /// The object's sha256, hex.
    pub sha256: String,
    pub ms: u64,
}

/// Bytes counted and hashed as they pass.
#[derive(Default)]
struct Tally {
    bytes: u64,
    sha: Sha256,
}

impl Tally {
    fn add(&mut self, b: &[u8]) {
        self.bytes += b.len() as u64;
        self.sha.update(b);
    }

    fn finish(self) -> (u64, String) {
        let digest = self.sha.finalize();
        let mut hex = String::with_capacity(64);
        for b in digest {
            hex.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
            hex.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
        }
        (self.bytes, hex)
    }
}

/// A writer or reader that counts what passes through it.
pub(crate) struct Counted<T> {
    pub inner: T,
    pub n: u64,
}

impl<T> Counted<T> {
    pub fn new(inner: T) -> Self {
        Counted { inner, n: 0 }
    }
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// The worker's end of an upload: zstd's output in chunks over the channel.
struct ChannelWriter {
    tx: mpsc::Sender<Bytes>,
    buf: Vec<u8>,
    tally: Tally,
}

impl ChannelWriter {
    fn new(tx: mpsc::Sender<Bytes>) -> Self {
        ChannelWriter {
            tx,
            buf: Vec::with_capacity(CHUNK),
            tally: Tally::default(),
        }
    }

    fn send(&mut self) -> io::Result<()> {
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tally.add(&chunk);
        self.tx
            .blocking_send(Bytes::from(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the upload stopped"))
    }

    /// Sends what is left; the object's size and sha256.
    fn finish(mut self) -> io::Result<(u64, String)> {
        if !self.buf.is_empty() {
            self.send()?;
        }
        Ok(self.tally.finish())
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = (CHUNK - self.buf.len()).min(b.len());
        self.buf.extend_from_slice(&b[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A multipart upload aborted when dropped before it was finished (a failure, or the
/// caller's future dropped): the store keeps none of its parts.
struct Aborting {
    upload: Option<WriteMultipart>,
}

impl Aborting {
    async fn abort(&mut self) {
        if let Some(w) = self.upload.take() {
            if let Err(e) = w.abort().await {
                tracing::debug!("aborting an upload: {e}");
            }
        }
    }
}

impl Drop for Aborting {
    fn drop(&mut self) {
        if let Some(w) = self.upload.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    if let Err(e) = w.abort().await {
                        tracing::debug!("aborting a dropped upload: {e}");
                    }
                });
            }
        }
    }
}

/// Where a stream goes to or comes from, for the errors.
#[derive(Clone)]
pub(crate) struct Target {
    pub store: Arc<dyn ObjectStore>,
    pub path: ObjectPath,
    /// The store's description, for errors.
    pub desc: String,
}

impl Target {
    pub fn key(&self) -> String {
        self.path.to_string()
    }

    pub fn store_err(&self, source: object_store::Error) -> BlobError {
        match source {
            object_store::Error::NotFound { .. } => BlobError::NotFound {
                key: self.key(),
                store: self.desc.clone(),
            },
            source => BlobError::Store {
                key: self.key(),
                store: self.desc.clone(),
                source,
            },
        }
    }
}

/// Uploads what `produce` writes (the plain stream), zstd-compressed, to `target`.
/// `produce` runs on a blocking thread; its errors are its own (the paths it read).
pub(crate) async fn upload<T, F>(target: &Target, produce: F) -> Result<(T, Moved)>
where
    T: Send + 'static,
    F: FnOnce(&mut dyn Write) -> Result<T> + Send + 'static,
{
    let started = Instant::now();
    let upload = target
        .store
        .put_multipart(&target.path)
        .await
        .map_err(|e| target.store_err(e))?;
    let mut writer = Aborting {
        upload: Some(WriteMultipart::new_with_chunk_size(upload, PART)),
    };
    let (tx, mut rx) = mpsc::channel::<Bytes>(CHANNEL_CHUNKS);
    let key = target.key();
    let worker = tokio::task::spawn_blocking(move || -> Result<(T, u64, u64, String)> {
        let stopped = |e: io::Error| BlobError::Io {
            path: key.clone().into(),
            source: e,
        };
        let enc = zstd::Encoder::new(ChannelWriter::new(tx), ZSTD_LEVEL).map_err(stopped)?;
        let mut counted = Counted::new(enc);
        let made = produce(&mut counted)?;
        let bytes = counted.n;
        let channel = counted.inner.finish().map_err(stopped)?;
        let (stored, sha) = channel.finish().map_err(stopped)?;
        Ok((made, bytes, stored, sha))
    });
    let mut failed = None;
    while let Some(chunk) = rx.recv().await {
        let Some(w) = writer.upload.as_mut() else {
            break;
        };
        if let Err(e) = w.wait_for_capacity(CONCURRENCY).await {
            failed = Some(target.store_err(e));
            break;
        }
        w.put(chunk);
    }
    // The worker sees its channel closed and stops, if it had not ended.
    drop(rx);
    let done = worker.await;
    if let Some(e) = failed {
        writer.abort().await;
        return Err(e);
    }
    let (made, bytes, stored_bytes, sha256) = match done {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            writer.abort().await;
            return Err(e);
        }
        Err(e) => {
            writer.abort().await;
            return Err(BlobError::Worker {
                key: target.key(),
                why: e.to_string(),
            });
        }
    };
    if let Some(w) = writer.upload.take() {
        // finish aborts the upload itself when it fails.
        w.finish().await.map_err(|e| target.store_err(e))?;
    }
    Ok((
        made,
        Moved {
            bytes,
            stored_bytes,
            sha256,
            ms: elapsed_ms(started),
        },
    ))
}

/// What a download is checked against (a manifest's part).
#[derive(Debug, Clone)]
pub(crate) struct Expect {
    pub bytes: u64,
    pub stored_bytes: u64,
    pub sha256: Option<String>,
}

enum Msg {
    Data(Bytes),
    End,
}

/// The worker's end of a download: the object's bytes, counted and hashed; an error when the
/// stream stops before its end.
struct ChannelReader {
    rx: mpsc::Receiver<Msg>,
    cur: Bytes,
    ended: bool,
    tally: Tally,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if !self.cur.is_empty() {
                let n = self.cur.len().min(buf.len());
                buf[..n].copy_from_slice(&self.cur[..n]);
                self.tally.add(&buf[..n]);
                self.cur.advance(n);
                return Ok(n);
            }
            if self.ended || buf.is_empty() {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Msg::Data(b)) => self.cur = b,
                Some(Msg::End) => self.ended = true,
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the download stopped before the object's end",
                    ))
                }
            }
        }
    }
}

/// Runs its closure when dropped armed: what a download made is taken away whether it failed
/// or its future was dropped.
struct OnFail<C: FnOnce()> {
    undo: Option<C>,
}

impl<C: FnOnce()> OnFail<C> {
    fn disarm(mut self) {
        self.undo = None;
    }
}

impl<C: FnOnce()> Drop for OnFail<C> {
    fn drop(&mut self) {
        if let Some(undo) = self.undo.take() {
            undo();
        }
    }
}

/// Downloads the object at `target` and hands its plain stream (zstd undone) to `consume` on a
/// blocking thread, then reads the stream to its end and checks it against `expect`. When
/// `consume` or a check fails, or the download stops (its future dropped included), `on_fail`
/// runs (to take away what `consume` made).
pub(crate) async fn download<T, F, C>(
    target: &Target,
    expect: Option<Expect>,
    consume: F,
    on_fail: C,
) -> Result<(T, Moved)>
where
    T: Send + 'static,
    F: FnOnce(&mut dyn Read) -> Result<T> + Send + 'static,
    C: FnOnce() + Send + 'static,
{
    let started = Instant::now();
    let guard = OnFail {
        undo: Some(on_fail),
    };
    let got = target
        .store
        .get(&target.path)
        .await
        .map_err(|e| target.store_err(e))?;
    let mut stream = got.into_stream();
    let (tx, rx) = mpsc::channel::<Msg>(16);
    let key = target.key();
    let worker = tokio::task::spawn_blocking(move || -> Result<(T, u64, u64, String)> {
        // Dropped armed (on this thread) when the stream fails, is cut, or does not check.
        let res = consume_stream(&key, rx, expect, consume);
        if res.is_ok() {
            guard.disarm();
        }
        res
    });
    let mut failed = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(b) => {
                if tx.send(Msg::Data(b)).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                failed = Some(target.store_err(e));
                break;
            }
        }
    }
    if failed.is_none() {
        // A worker that stopped early has its own error to tell.
        let _ = tx.send(Msg::End).await;
    }
    drop(tx);
    let done = worker.await;
    if let Some(e) = failed {
        return Err(e);
    }
    let (made, bytes, stored_bytes, sha256) = match done {
        Ok(v) => v?,
        Err(e) => {
            return Err(BlobError::Worker {
                key: target.key(),
                why: e.to_string(),
            })
        }
    };
    Ok((
        made,
        Moved {
            bytes,
            stored_bytes,
            sha256,
            ms: elapsed_ms(started),
        },
    ))
}

fn consume_stream<T, F>(
    key: &str,
    rx: mpsc::Receiver<Msg>,
    expect: Option<Expect>,
    consume: F,
) -> Result<(T, u64, u64, String)>
where
    F: FnOnce(&mut dyn Read) -> Result<T>,
{
    let corrupt = |e: io::Error| BlobError::Corrupt {
        key: key.to_string(),
        why: e.to_string(),
    };
    let reader = ChannelReader {
        rx,
        cur: Bytes::new(),
        ended: false,
        tally: Tally::default(),
    };
    let dec = zstd::Decoder::new(reader).map_err(corrupt)?;
    let mut counted = Tagged {
        inner: Counted::new(dec),
        failed: None,
    };
    let made = match consume(&mut counted) {
        Ok(v) => v,
        // An error of the stream (zstd's, or the download stopped) is the object's, whatever
        // the consumer made of it.
        Err(e) => {
            return Err(match counted.failed {
                Some(why) => BlobError::Corrupt {
                    key: key.to_string(),
                    why,
                },
                None => e,
            })
        }
    };
    let mut counted = counted.inner;
    // What follows the consumer's end (tar's padding) up to the object's end, so that a
    // truncated or damaged object is found.
    io::copy(&mut counted, &mut io::sink()).map_err(corrupt)?;
    let bytes = counted.n;
    let reader = counted.inner.finish().into_inner();
    let (stored, sha) = reader.tally.finish();
    if let Some(x) = expect {
        if x.stored_bytes != stored || x.bytes != bytes {
            return Err(BlobError::Corrupt {
                key: key.to_string(),
                why: format!(
                    "{stored} bytes stored, {bytes} plain; the manifest says {} and {}",
                    x.stored_bytes, x.bytes
                ),
            });
        }
        if let Some(want) = x.sha256 {
            if want != sha {
                return Err(BlobError::Corrupt {
                    key: key.to_string(),
                    why: format!("sha256 {sha}; the manifest says {want}"),
                });
            }
        }
    }
    Ok((made, bytes, stored, sha))
}

/// A reader that remembers its first error.
struct Tagged<R> {
    inner: R,
    failed: Option<String>,
}

impl<R: Read> Read for Tagged<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf).inspect_err(|e| {
            if self.failed.is_none() {
                self.failed = Some(e.to_string());
            }
        })
    }
}

fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}
