//! The typed event streams: a command's events ([`ExecEvents`]: `POST /v1/run`,
//! `POST …/run` and `GET …/exec/{id}/output` as streams), read on from where they stopped when
//! the connection drops; and an image pull's ([`PullEvents`]).

use std::io::{BufReader, Read};
use std::time::Duration;

use sbx_api::{Encoding, ExecObject, GapData, OutputData};
use serde::de::DeserializeOwned;

use crate::answers::Pulled;
use crate::sse::{Frame, FrameReader};
use crate::{Client, Error, NodeError};

/// A stream's body, as read off the connection.
pub(crate) type Body = Box<dyn Read + Send + Sync + 'static>;

/// How much of a stream is read ahead: output events come in pieces of up to a few hundred
/// KiB.
const READ_AHEAD: usize = 1 << 20;

/// One event of a command's stream.
#[derive(Clone, Debug, PartialEq)]
pub enum ExecEvent {
    /// It started: the exec object, running.
    Start(ExecObject),
    /// Bytes it wrote to stdout (text, or base64 as the request's encoding says).
    Stdout(OutputData),
    /// Bytes it wrote to stderr.
    Stderr(OutputData),
    /// Output no longer kept was skipped.
    Gap(GapData),
    /// It ended: the exec object, final. The last event.
    Exit(ExecObject),
}

/// Where a dropped stream is read on from: a command of a kept sandbox.
#[derive(Clone, Debug)]
struct Resume {
    client: Client,
    sandbox: String,
    exec: String,
    encoding: Encoding,
}

/// A command's events, in order, until its `exit` (then `None`). An `error` event ends the
/// stream as an `Err` ([`Error::Node`]).
///
/// When the connection drops before the end, a stream of a kept sandbox's command is read on
/// from the last event's id (`GET …/output` with `Last-Event-ID`), up to
/// [`ExecEvents::max_reconnects`] times, a pause apart; events are neither lost nor repeated.
/// A `/v1/run` stream cannot be: its sandbox goes with the connection
/// ([`Error::StreamEnded`]). A `POST …/run` stream can, once its `start` event named the
/// command.
pub struct ExecEvents {
    reader: Option<FrameReader<BufReader<Body>>>,
    resume: Option<Resume>,
    /// Named by the start event (`POST …/run`): read on through this client.
    resume_after_start: Option<(Client, Encoding)>,
    last_id: Option<u64>,
    /// Whether a connection was made (or given).
    connected: bool,
    done: bool,
    reconnects: u32,
    max_reconnects: u32,
    pause: Duration,
    bytes: u64,
}

impl ExecEvents {
    /// A stream that ends with its connection (`POST /v1/run`).
    pub(crate) fn once(body: Body) -> ExecEvents {
        ExecEvents::new(Some(body), None, None)
    }

    /// A stream read on through `client` once its start event names the command
    /// (`POST …/run`).
    pub(crate) fn after_start(body: Body, client: Client, encoding: Encoding) -> ExecEvents {
        ExecEvents::new(Some(body), None, Some((client, encoding)))
    }

    /// The output of a command of a kept sandbox, from `from`; `body` is `None` to connect at
    /// the first read.
    pub(crate) fn output(
        body: Option<Body>,
        client: Client,
        sandbox: &str,
        exec: &str,
        from: u64,
        encoding: Encoding,
    ) -> ExecEvents {
        let mut e = ExecEvents::new(
            body,
            Some(Resume {
                client,
                sandbox: sandbox.to_string(),
                exec: exec.to_string(),
                encoding,
            }),
            None,
        );
        e.last_id = (from > 0).then_some(from);
        e
    }

    fn new(
        body: Option<Body>,
        resume: Option<Resume>,
        resume_after_start: Option<(Client, Encoding)>,
    ) -> ExecEvents {
        ExecEvents {
            connected: body.is_some(),
            reader: body.map(|b| FrameReader::new(BufReader::with_capacity(READ_AHEAD, b))),
            resume,
            resume_after_start,
            last_id: None,
            done: false,
            reconnects: 0,
            max_reconnects: 30,
            pause: Duration::from_millis(500),
            bytes: 0,
        }
    }

    /// How many times a dropped stream is read on (default 30), and the pause before each
    /// (default 0.5 s).
    pub fn max_reconnects(mut self, n: u32, pause: Duration) -> ExecEvents {
        self.max_reconnects = n;
        self.pause = pause;
        self
    }

    /// The id of the last event read: the position in the output it reached.
    pub fn last_id(&self) -> Option<u64> {
        self.last_id
    }

    /// How many times the stream was read on after a drop.
    pub fn reconnects(&self) -> u32 {
        self.reconnects
    }

    /// Bytes read off the wire, over every connection.
    pub fn bytes_read(&self) -> u64 {
        self.bytes + self.reader.as_ref().map_or(0, FrameReader::bytes_read)
    }

    /// Reads the events to the end and answers the final exec object, handing each output
    /// event to `output` (`true` for stderr) and each gap to `gap`.
    pub fn wait(
        self,
        mut output: impl FnMut(bool, &OutputData) -> std::io::Result<()>,
        mut gap: impl FnMut(&GapData),
    ) -> Result<ExecObject, Error> {
        for ev in self {
            match ev? {
                ExecEvent::Stdout(d) => output(false, &d)?,
                ExecEvent::Stderr(d) => output(true, &d)?,
                ExecEvent::Gap(g) => gap(&g),
                ExecEvent::Exit(o) => return Ok(o),
                ExecEvent::Start(_) => {}
            }
        }
        Err(Error::StreamEnded { reconnects: 0 })
    }

    /// The connection dropped (or was never made): connect again from the last id, or end.
    fn reconnect(&mut self) -> Result<(), Error> {
        if let Some(r) = self.reader.take() {
            self.bytes += r.bytes_read();
        }
        let Some(resume) = &self.resume else {
            return Err(Error::StreamEnded {
                reconnects: self.reconnects,
            });
        };
        // A stream not connected yet connects at once; a dropped one after a pause.
        let mut first = !self.connected;
        loop {
            if !first {
                if self.reconnects >= self.max_reconnects {
                    return Err(Error::StreamEnded {
                        reconnects: self.reconnects,
                    });
                }
                self.reconnects += 1;
                std::thread::sleep(self.pause);
            }
            first = false;
            self.connected = true;
            match resume.client.output_body(
                &resume.sandbox,
                &resume.exec,
                self.last_id,
                resume.encoding,
            ) {
                Ok(body) => {
                    self.reader =
                        Some(FrameReader::new(BufReader::with_capacity(READ_AHEAD, body)));
                    return Ok(());
                }
                Err(Error::Transport(_)) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn event(&mut self, f: Frame) -> Result<Option<ExecEvent>, Error> {
        if let Some(id) = f.id_u64() {
            self.last_id = Some(id);
        }
        Ok(Some(match f.event.as_str() {
            "start" => {
                let o: ExecObject = data(&f)?;
                if let Some((client, encoding)) = self.resume_after_start.take() {
                    self.resume = Some(Resume {
                        client,
                        sandbox: o.sandbox_id.clone(),
                        exec: o.id.clone(),
                        encoding,
                    });
                }
                ExecEvent::Start(o)
            }
            "stdout" => ExecEvent::Stdout(data(&f)?),
            "stderr" => ExecEvent::Stderr(data(&f)?),
            "gap" => ExecEvent::Gap(data(&f)?),
            "exit" => {
                self.done = true;
                ExecEvent::Exit(data(&f)?)
            }
            "error" => {
                self.done = true;
                let body: serde_json::Value = data(&f)?;
                return Err(match NodeError::from_body(0, body) {
                    Some(e) => Error::Node(Box::new(e)),
                    None => Error::Decode(format!("an error event: {}", f.data)),
                });
            }
            // A kind of a newer node: not this client's to read.
            _ => return Ok(None),
        }))
    }
}

/// The data of an event, as `T`.
fn data<T: DeserializeOwned>(f: &Frame) -> Result<T, Error> {
    f.data_as()
        .map_err(|e| Error::Decode(format!("the data of a {} event: {e}", f.event)))
}

impl Iterator for ExecEvents {
    type Item = Result<ExecEvent, Error>;

    fn next(&mut self) -> Option<Result<ExecEvent, Error>> {
        loop {
            if self.done {
                return None;
            }
            let frame = match self.reader.as_mut().map(FrameReader::next_frame) {
                Some(Ok(Some(f))) => f,
                // Dropped, cut off, or not connected yet.
                Some(Ok(None)) | Some(Err(_)) | None => {
                    if let Err(e) = self.reconnect() {
                        self.done = true;
                        return Some(Err(e));
                    }
                    continue;
                }
            };
            match self.event(frame) {
                Ok(Some(ev)) => return Some(Ok(ev)),
                Ok(None) => continue,
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

/// One event of an image pull.
#[derive(Clone, Debug, PartialEq)]
pub enum PullEvent {
    /// A layer's bytes so far.
    Progress {
        /// `sha256:…`.
        layer: String,
        done: u64,
        total: u64,
    },
    /// The image is the node's. The last event.
    Done(Pulled),
    /// The pull failed (`registry_auth_failed`, `invalid_image`, `image_pull_failed`, ...).
    /// The last event.
    Failed { code: String, message: String },
}

/// An image pull's events until `done` or `failed`.
pub struct PullEvents {
    reader: FrameReader<BufReader<Body>>,
    done: bool,
}

impl PullEvents {
    pub(crate) fn new(body: Body) -> PullEvents {
        PullEvents {
            reader: FrameReader::new(BufReader::new(body)),
            done: false,
        }
    }
}

#[derive(serde::Deserialize)]
struct Progress {
    layer: String,
    done: u64,
    total: u64,
}

#[derive(serde::Deserialize)]
struct Failure {
    code: String,
    message: String,
}

impl Iterator for PullEvents {
    type Item = Result<PullEvent, Error>;

    fn next(&mut self) -> Option<Result<PullEvent, Error>> {
        while !self.done {
            let f = match self.reader.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) | Err(_) => {
                    self.done = true;
                    return Some(Err(Error::StreamEnded { reconnects: 0 }));
                }
            };
            let ev = match f.event.as_str() {
                "progress" => data::<Progress>(&f).map(|p| PullEvent::Progress {
                    layer: p.layer,
                    done: p.done,
                    total: p.total,
                }),
                "done" => data(&f).map(PullEvent::Done),
                "error" => data::<Failure>(&f).map(|e| PullEvent::Failed {
                    code: e.code,
                    message: e.message,
                }),
                _ => continue,
            };
            self.done = !matches!(ev, Ok(PullEvent::Progress { .. }));
            return Some(ev);
        }
        None
    }
}
