//! A command's output gathered into its exec object: the tails of its streams, its gaps, its
//! end. Runs, kept commands and the functions interface collect output here.

use std::collections::VecDeque;

use bytes::Bytes;
use sbx_api::{ApiError, Encoding, ExecObject, ExecObjectKind, ExecStatus, ExecUsage, OutputInfo};

use super::RunEvent;

/// Which of a command's output streams bytes came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    /// The stream of bytes the agent sent (any but stderr is output).
    pub(crate) fn of(s: sbx_proto::Stream) -> Stream {
        match s {
            sbx_proto::Stream::Stderr => Stream::Stderr,
            _ => Stream::Stdout,
        }
    }
}

/// How a command ended by itself or was ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It ended by itself, with any exit code.
    Exited,
    /// A signal ended it.
    Killed,
    /// Its deadline was up and it was killed.
    TimedOut,
}

impl From<sbx_proto::ExitStatus> for ExitStatus {
    fn from(s: sbx_proto::ExitStatus) -> ExitStatus {
        match s {
            sbx_proto::ExitStatus::Exited => ExitStatus::Exited,
            sbx_proto::ExitStatus::Killed => ExitStatus::Killed,
            sbx_proto::ExitStatus::TimedOut => ExitStatus::TimedOut,
        }
    }
}

impl ExitStatus {
    /// The status of a command the node recorded as ended (a row's final object): the
    /// inverse of [`ExitStatus::exec_status`]; `Running`, which an ended command's object
    /// never has, reads as `Exited`.
    pub(crate) fn of_exec(s: ExecStatus) -> ExitStatus {
        match s {
            ExecStatus::Exited | ExecStatus::Running => ExitStatus::Exited,
            ExecStatus::TimedOut => ExitStatus::TimedOut,
            ExecStatus::Killed => ExitStatus::Killed,
        }
    }

    /// Its status as the exec object says it.
    pub(crate) fn exec_status(self) -> ExecStatus {
        match self {
            ExitStatus::Exited => ExecStatus::Exited,
            ExitStatus::Killed => ExecStatus::Killed,
            ExitStatus::TimedOut => ExecStatus::TimedOut,
        }
    }
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ExitInfo {
    pub status: ExitStatus,
    pub exit_code: i32,
    /// The signal number that ended it, if one did.
    pub signal: Option<i32>,
    pub duration_ns: u64,
    pub cpu_ns: u64,
    pub max_rss_bytes: u64,
}

impl From<sbx_proto::ExitInfo> for ExitInfo {
    fn from(x: sbx_proto::ExitInfo) -> ExitInfo {
        ExitInfo {
            status: x.status.into(),
            exit_code: x.exit_code,
            signal: x.signal,
            duration_ns: x.duration_ns,
            cpu_ns: x.cpu_ns,
            max_rss_bytes: x.max_rss_bytes,
        }
    }
}

/// A kept command as its agent tells it now: its start, its output counters and, once it has
/// ended, how.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecProgress {
    pub pid: u32,
    pub started_at_ns: i64,
    pub output: OutputCounts,
    pub exit: Option<ExitInfo>,
}

impl From<sbx_proto::ExecState> for ExecProgress {
    fn from(s: sbx_proto::ExecState) -> ExecProgress {
        ExecProgress {
            pid: s.pid,
            started_at_ns: s.started_at_ns,
            output: s.output.into(),
            exit: s.exit.map(ExitInfo::from),
        }
    }
}

/// A command's output counters: bytes of each stream, and the positions of the oldest byte
/// kept and after the newest.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputCounts {
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub start: u64,
    pub end: u64,
}

impl From<sbx_proto::OutputCounts> for OutputCounts {
    fn from(o: sbx_proto::OutputCounts) -> OutputCounts {
        OutputCounts {
            stdout_bytes: o.stdout_bytes,
            stderr_bytes: o.stderr_bytes,
            start: o.start,
            end: o.end,
        }
    }
}

/// What every exec object of a command shares.
#[derive(Clone)]
pub struct ExecMeta {
    pub sandbox_id: String,
    pub exec_id: String,
    pub command: String,
    pub encoding: Encoding,
    pub tty: bool,
}

#[derive(Default, Clone, Copy)]
pub struct Started {
    pub pid: u32,
    pub started_at_ns: i64,
}

/// A command's output as it comes, gathered for its exec object: what is known of its start,
/// the tails of both streams, whether bytes were lost on the way (a gap). Runs (JSON answers and
/// the functions interface), kept commands that are waited for, and a kept command's object
/// read back from its agent all gather here.
#[derive(Default)]
pub struct Collected {
    pub started: Started,
    out: Tail,
    err: Tail,
    pub gap: bool,
}

impl Collected {
    /// Gathering for a command whose start is known.
    pub fn of(started: Started) -> Collected {
        Collected {
            started,
            ..Collected::default()
        }
    }

    pub fn push(&mut self, stream: Stream, data: Bytes) {
        match stream {
            Stream::Stderr => self.err.push_bytes(data),
            Stream::Stdout => self.out.push_bytes(data),
        }
    }

    /// The exec object as it stands: ended when `exit` is given.
    pub fn object(
        &mut self,
        meta: &ExecMeta,
        exit: Option<&ExitInfo>,
        output: OutputCounts,
    ) -> ExecObject {
        exec_object(
            meta,
            &self.started,
            exit,
            output,
            &mut self.out,
            &mut self.err,
            self.gap,
        )
    }

    /// Takes a run's next event: its exec object once it has ended, its error if it failed,
    /// nothing before.
    pub fn take(&mut self, meta: &ExecMeta, ev: RunEvent) -> Option<Result<ExecObject, ApiError>> {
        match ev {
            RunEvent::Started { pid, started_at_ns } => {
                self.started = Started { pid, started_at_ns };
            }
            RunEvent::Output { stream, data, .. } => self.push(stream, Bytes::from(data)),
            RunEvent::Gap { .. } => self.gap = true,
            RunEvent::Exited { exit, output } => {
                return Some(Ok(self.object(meta, Some(&exit), output)))
            }
            RunEvent::Failed(e) => return Some(Err(e)),
        }
        None
    }
}

/// The last bytes of one stream: the latest chunks, shared with whoever else holds them (no
/// copy per chunk), made contiguous only when asked for.
pub struct Tail {
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    len: usize,
    flat: Vec<u8>,
}

impl Default for Tail {
    fn default() -> Tail {
        Tail::new()
    }
}

impl Tail {
    pub fn new() -> Tail {
        Tail {
            chunks: VecDeque::new(),
            len: 0,
            flat: Vec::new(),
        }
    }
    pub(crate) fn push_bytes(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let cap = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES;
        self.len += data.len();
        self.chunks.push_back(data);
        // Chunks wholly before the last `cap` bytes are dropped.
        while let Some(front) = self.chunks.front() {
            if self.len - front.len() < cap {
                break;
            }
            self.len -= front.len();
            self.chunks.pop_front();
        }
    }
    pub fn bytes(&mut self, encoding: Encoding) -> &[u8] {
        let cap = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES;
        let mut skip = self.len.saturating_sub(cap);
        self.flat.clear();
        self.flat.reserve(self.len - skip);
        for c in &self.chunks {
            let from = skip.min(c.len());
            skip -= from;
            self.flat.extend_from_slice(&c[from..]);
        }
        let s = &self.flat[..];
        if encoding == Encoding::Base64 {
            // Bytes, not text: the tail is the last bytes, whatever they are.
            return s;
        }
        // A tail cut inside a UTF-8 character starts after it.
        let skip = s
            .iter()
            .take(3)
            .take_while(|b| (**b & 0xC0) == 0x80)
            .count();
        &s[skip..]
    }
}

/// The exec object of a command: `exit` when it has ended, its output counters, the tails.
pub fn exec_object(
    meta: &ExecMeta,
    started: &Started,
    exit: Option<&ExitInfo>,
    output: OutputCounts,
    stdout: &mut Tail,
    stderr: &mut Tail,
    gap: bool,
) -> ExecObject {
    let cap = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES as u64;
    let (status, exit_code, signal, duration, usage) = match exit {
        Some(x) => (
            x.status.exec_status(),
            Some(x.exit_code),
            x.signal.map(sbx_api::signal_name),
            Some(x.duration_ns as f64 / 1e9),
            Some(ExecUsage {
                cpu_seconds: x.cpu_ns as f64 / 1e9,
                max_memory_bytes: x.max_rss_bytes,
            }),
        ),
        None => (ExecStatus::Running, None, None, None, None),
    };
    let truncated =
        gap || output.start > 0 || output.stdout_bytes > cap || output.stderr_bytes > cap;
    ExecObject {
        id: meta.exec_id.clone(),
        object: ExecObjectKind::Exec,
        sandbox_id: meta.sandbox_id.clone(),
        command: meta.command.clone(),
        tty: meta.tty,
        status,
        exit_code,
        signal,
        started_at: sbx_api::format_rfc3339_millis(i128::from(started.started_at_ns)),
        pid: started.pid,
        duration_seconds: duration,
        usage,
        output: OutputInfo {
            stdout_bytes: output.stdout_bytes,
            stderr_bytes: output.stderr_bytes,
            start: output.start,
            end: output.end,
        },
        stdout: meta.encoding.encode(stdout.bytes(meta.encoding)),
        stderr: meta.encoding.encode(stderr.bytes(meta.encoding)),
        truncated,
        encoding: meta.encoding,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_mebibyte() {
        let mut t = Tail::new();
        t.push_bytes(Bytes::from(vec![b'a'; 1 << 20]));
        t.push_bytes(Bytes::from_static(b"bc"));
        let b = t.bytes(Encoding::Utf8);
        assert_eq!(b.len(), 1 << 20);
        assert_eq!(&b[b.len() - 2..], b"bc");
        // Binary output is cut where the last mebibyte starts, even inside what would be a
        // UTF-8 character.
        let mut t = Tail::new();
        t.push_bytes(Bytes::from(vec![0x80; (1 << 20) + 5]));
        assert_eq!(t.bytes(Encoding::Base64).len(), 1 << 20);
        assert_eq!(t.bytes(Encoding::Utf8).len(), (1 << 20) - 3);
    }

    /// The agent's status and the HTTP API's are the same words, and the node's status goes
    /// to the API's and back on ended commands.
    #[test]
    fn exit_statuses_keep_their_words() {
        use sbx_proto::ExitStatus as Proto;
        for s in [Proto::Exited, Proto::TimedOut, Proto::Killed] {
            let node = ExitStatus::from(s);
            let api = node.exec_status();
            assert_eq!(
                serde_json::to_string(&s).expect("json"),
                format!("\"{}\"", api.as_str())
            );
            assert_eq!(ExitStatus::of_exec(api), node);
        }
        assert_eq!(ExitStatus::of_exec(ExecStatus::Running), ExitStatus::Exited);
    }
}
