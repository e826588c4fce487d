//! CRIU's RPC (`criu swrk FD`): one request over a `SOCK_SEQPACKET` socket, protobuf messages
//! of CRIU's `images/rpc.proto` (the fields this node uses, with their numbers), and the
//! notifications CRIU sends where it would run an action script: answered here, in the node's
//! own process, instead of a program started for every step of a restore (six of them, ~3 ms
//! each).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use nix::sys::socket::{recv, send, MsgFlags};
use prost::Message;

use super::{io, keep_log, log_tail, CriuError};

/// `criu_opts`.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Opts {
    #[prost(int32, required, tag = "1")]
    pub images_dir_fd: i32,
    #[prost(int32, optional, tag = "2")]
    pub pid: Option<i32>,
    #[prost(bool, optional, tag = "3")]
    pub leave_running: Option<bool>,
    #[prost(bool, optional, tag = "5")]
    pub tcp_established: Option<bool>,
    #[prost(bool, optional, tag = "8")]
    pub file_locks: Option<bool>,
    #[prost(int32, optional, tag = "9")]
    pub log_level: Option<i32>,
    #[prost(string, optional, tag = "10")]
    pub log_file: Option<String>,
    #[prost(bool, optional, tag = "12")]
    pub notify_scripts: Option<bool>,
    #[prost(string, optional, tag = "13")]
    pub root: Option<String>,
    #[prost(int32, optional, tag = "17")]
    pub work_dir_fd: Option<i32>,
    #[prost(message, repeated, tag = "25")]
    pub cg_root: Vec<CgroupRoot>,
    #[prost(bool, optional, tag = "26")]
    pub rst_sibling: Option<bool>,
    #[prost(string, repeated, tag = "36")]
    pub irmap_scan_paths: Vec<String>,
    #[prost(string, repeated, tag = "37")]
    pub external: Vec<String>,
    #[prost(uint32, optional, tag = "38")]
    pub empty_ns: Option<u32>,
    #[prost(string, optional, tag = "44")]
    pub freeze_cgroup: Option<String>,
    #[prost(bool, optional, tag = "52")]
    pub tcp_close: Option<bool>,
    #[prost(string, optional, tag = "60")]
    pub cgroup_yard: Option<String>,
    /// `criu_network_lock_method`: 3 is SKIP.
    #[prost(int32, optional, tag = "64")]
    pub network_lock: Option<i32>,
}

/// `cgroup_root`.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct CgroupRoot {
    #[prost(string, optional, tag = "1")]
    pub ctrl: Option<String>,
    #[prost(string, required, tag = "2")]
    pub path: String,
}

/// `criu_network_lock_method.SKIP`.
pub(super) const NETWORK_LOCK_SKIP: i32 = 3;

/// `criu_req_type`.
pub(super) const DUMP: i32 = 1;
pub(super) const RESTORE: i32 = 2;
const NOTIFY: i32 = 6;

/// `criu_req`.
#[derive(Clone, PartialEq, prost::Message)]
struct Req {
    #[prost(int32, required, tag = "1")]
    kind: i32,
    #[prost(message, optional, tag = "2")]
    opts: Option<Opts>,
    #[prost(bool, optional, tag = "3")]
    notify_success: Option<bool>,
}

/// `criu_resp`.
#[derive(Clone, PartialEq, prost::Message)]
struct Resp {
    #[prost(int32, required, tag = "1")]
    kind: i32,
    #[prost(bool, required, tag = "2")]
    success: bool,
    #[prost(message, optional, tag = "4")]
    restore: Option<RestoreResp>,
    #[prost(message, optional, tag = "5")]
    notify: Option<Notify>,
    #[prost(int32, optional, tag = "7")]
    cr_errno: Option<i32>,
    #[prost(string, optional, tag = "9")]
    cr_errmsg: Option<String>,
}

/// `criu_restore_resp`.
#[derive(Clone, PartialEq, prost::Message)]
struct RestoreResp {
    #[prost(int32, required, tag = "1")]
    pid: i32,
}

/// `criu_notify`.
#[derive(Clone, PartialEq, prost::Message)]
struct Notify {
    #[prost(string, optional, tag = "1")]
    script: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pid: Option<i32>,
}

/// What a request's caller is told of each notification: the action's name (an action
/// script's: `setup-namespaces`, `post-restore`…) and the restored tree's root pid where CRIU
/// gives it. An error makes CRIU give up the request.
pub(super) type OnNotify<'a> = &'a mut dyn FnMut(&str, Option<u32>) -> Result<(), String>;

/// Runs one request of `kind` with `opts` through the `criu swrk` `worker` (started ahead,
/// or now: [`super::worker::Workers`]), answering its notifications with `on_notify`. Returns
/// the restored tree's root pid for a restore. `log` is the log CRIU writes (for errors, and
/// for `SBX_CRIU_LOG_DIR`). The worker ends with the request.
pub(super) fn call(
    action: &'static str,
    kind: i32,
    opts: Opts,
    worker: super::worker::Worker,
    on_notify: OnNotify<'_>,
    log: &Path,
) -> Result<Option<u32>, CriuError> {
    let started = std::time::Instant::now();
    let super::worker::Worker {
        sock,
        mut child,
        stderr,
    } = worker;
    let result = converse(&sock, kind, opts, on_notify);
    let answered_us = started.elapsed().as_micros() as u64;
    drop(sock);
    if let Ok(pid) = result {
        keep_log(action, log);
        tracing::debug!(action, answered_us, "criu");
        // It answered once all was done; what it does after (its namespace torn down: up to
        // ~15 ms after a dump) is not waited for. Reaped off the request's path.
        let _ = std::thread::Builder::new()
            .name("criu-reap".into())
            .spawn(move || {
                let _ = child.wait();
                if let Some(t) = stderr {
                    let _ = t.join();
                }
            });
        return Ok(pid);
    }
    let status = child.wait().map_err(io("wait for criu"))?;
    let err = stderr.and_then(|t| t.join().ok()).unwrap_or_default();
    keep_log(action, log);
    tracing::debug!(
        action,
        answered_us,
        total_us = started.elapsed().as_micros() as u64,
        "criu failed"
    );
    match result {
        Ok(_) => Err(failed(action, status.to_string(), log, &err, None)),
        Err(Talk::Refused(why)) => Err(failed(action, status.to_string(), log, &err, Some(why))),
        Err(Talk::Broken(why)) => Err(failed(action, status.to_string(), log, &err, Some(why))),
    }
}

enum Talk {
    /// CRIU answered that the request failed (its errno and message).
    Refused(String),
    /// The conversation itself failed.
    Broken(String),
}

fn failed(
    action: &'static str,
    status: String,
    log: &Path,
    stderr: &str,
    why: Option<String>,
) -> CriuError {
    let mut text = log_tail(log);
    if text.is_empty() {
        text = stderr.trim().to_string();
    }
    if let Some(w) = why {
        text = if text.is_empty() {
            w
        } else {
            format!("{w}: {text}")
        };
    }
    CriuError::Failed {
        action,
        status,
        log: text,
    }
}

fn converse(
    sock: &OwnedFd,
    kind: i32,
    opts: Opts,
    on_notify: OnNotify<'_>,
) -> Result<Option<u32>, Talk> {
    let req = Req {
        kind,
        opts: Some(opts),
        notify_success: None,
    };
    put(sock, &req)?;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())
            .map_err(|e| Talk::Broken(format!("read from criu: {e}")))?;
        if n == 0 {
            return Err(Talk::Broken("criu ended without an answer".into()));
        }
        let resp =
            Resp::decode(&buf[..n]).map_err(|e| Talk::Broken(format!("criu's answer: {e}")))?;
        if resp.kind == NOTIFY {
            let note = resp.notify.unwrap_or_default();
            let script = note.script.unwrap_or_default();
            let pid = note.pid.and_then(|p| u32::try_from(p).ok());
            let ok = match on_notify(&script, pid) {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!(step = %script, error = %e, "criu's notification");
                    false
                }
            };
            put(
                sock,
                &Req {
                    kind: NOTIFY,
                    opts: None,
                    notify_success: Some(ok),
                },
            )?;
            continue;
        }
        if resp.kind != kind {
            return Err(Talk::Broken(format!(
                "criu answered a request of type {} to one of type {kind}",
                resp.kind
            )));
        }
        if !resp.success {
            let errno = resp
                .cr_errno
                .map(|e| format!(" ({})", std::io::Error::from_raw_os_error(e)))
                .unwrap_or_default();
            return Err(Talk::Refused(format!(
                "{}{errno}",
                resp.cr_errmsg.as_deref().unwrap_or("failed")
            )));
        }
        return Ok(resp.restore.and_then(|r| u32::try_from(r.pid).ok()));
    }
}

fn put(sock: &OwnedFd, req: &Req) -> Result<(), Talk> {
    send(
        sock.as_fd().as_raw_fd(),
        &req.encode_to_vec(),
        MsgFlags::empty(),
    )
    .map(|_| ())
    .map_err(|e| Talk::Broken(format!("write to criu: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_encodes_as_criu_reads_it() {
        // criu_req { type: RESTORE, opts { images_dir_fd: 5, network_lock: SKIP, external:
        // ["a"] } }, field by field as protobuf writes them.
        let req = Req {
            kind: RESTORE,
            opts: Some(Opts {
                images_dir_fd: 5,
                external: vec!["a".into()],
                network_lock: Some(NETWORK_LOCK_SKIP),
                ..Default::default()
            }),
            notify_success: None,
        };
        let bytes = req.encode_to_vec();
        assert_eq!(
            bytes,
            vec![8, 2, 18, 9, 8, 5, 170, 2, 1, b'a', 128, 4, 3],
            "{bytes:?}"
        );
    }

    #[test]
    fn a_notification_decodes() {
        // criu_resp { type: NOTIFY, success: true, notify { script: "setup-namespaces", pid: 7 } }
        let mut b = vec![8, 6, 16, 1, 42];
        let script = b"setup-namespaces";
        b.push((2 + script.len() + 2) as u8);
        b.push(10);
        b.push(script.len() as u8);
        b.extend_from_slice(script);
        b.extend_from_slice(&[16, 7]);
        let r = Resp::decode(&b[..]).expect("decode");
        assert_eq!(r.kind, NOTIFY);
        let n = r.notify.expect("notify");
        assert_eq!(n.script.as_deref(), Some("setup-namespaces"));
        assert_eq!(n.pid, Some(7));
    }
}
