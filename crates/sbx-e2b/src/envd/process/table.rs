//! The processes started through envd, node-wide: (sandbox, pid) -> the node's command (its
//! exec id), its tag and config. An entry is made at Start and goes when its command's end is
//! known plus [`RETAIN`] (a late Connect still learns the exit, as envd keeps it 30 s), or at
//! once when its sandbox stops or goes (its agent's connection ends): the table holds the
//! running processes and the few that just ended, no more.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use super::wire::{EndEvent, ProcessConfig, Selector};
use crate::connect::RpcError;
use crate::sync::LockExt;

/// How long an ended process is kept for Connect (envd's `terminatedRetentionTTL`).
pub const RETAIN: Duration = Duration::from_secs(30);

/// A process of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The node's command.
    pub exec_id: String,
    pub tag: Option<String>,
    /// As the Start request gave it.
    pub config: ProcessConfig,
    /// On a terminal (input and output are `pty`).
    pub tty: bool,
    /// Its end, once known.
    pub end: Option<EndEvent>,
    /// Order of starts: of two with one tag, the later one is found.
    seq: u64,
}

impl Entry {
    pub fn new(exec_id: String, tag: Option<String>, config: ProcessConfig, tty: bool) -> Entry {
        Entry {
            exec_id,
            tag,
            config,
            tty,
            end: None,
            seq: 0,
        }
    }
}

#[derive(Default)]
struct Inner {
    by_key: HashMap<(String, u32), Entry>,
    seq: u64,
}

/// Processes started through envd.
#[derive(Default)]
pub struct Processes {
    inner: Mutex<Inner>,
}

impl Processes {
    /// Records a process that started (a pid reused replaces what was kept of the earlier one).
    pub fn insert(&self, sandbox: &str, pid: u32, mut entry: Entry) {
        let mut g = self.inner.locked();
        g.seq += 1;
        entry.seq = g.seq;
        g.by_key.insert((sandbox.to_string(), pid), entry);
    }

    /// The running process `sel` names in `sandbox`.
    pub fn running(&self, sandbox: &str, sel: &Selector) -> Result<(u32, Entry), RpcError> {
        self.find(sandbox, sel, false)
    }

    /// The process `sel` names in `sandbox`, running or just ended (the running one first).
    pub fn any(&self, sandbox: &str, sel: &Selector) -> Result<(u32, Entry), RpcError> {
        self.find(sandbox, sel, true)
    }

    fn find(&self, sandbox: &str, sel: &Selector, ended: bool) -> Result<(u32, Entry), RpcError> {
        let g = self.inner.locked();
        let found = match sel {
            Selector::Pid(pid) => g
                .by_key
                .get(&(sandbox.to_string(), *pid))
                .filter(|e| ended || e.end.is_none())
                .map(|e| (*pid, e)),
            Selector::Tag(tag) => g
                .by_key
                .iter()
                .filter(|((s, _), e)| s == sandbox && e.tag.as_deref() == Some(tag.as_str()))
                .filter(|(_, e)| ended || e.end.is_none())
                .max_by_key(|(_, e)| (e.end.is_none(), e.seq))
                .map(|((_, pid), e)| (*pid, e)),
        };
        found
            .map(|(pid, e)| (pid, e.clone()))
            .ok_or_else(|| sel.not_found())
    }

    /// The running processes of `sandbox`, by pid.
    pub fn list(&self, sandbox: &str) -> Vec<(u32, Entry)> {
        let g = self.inner.locked();
        let mut v: Vec<(u32, Entry)> = g
            .by_key
            .iter()
            .filter(|((s, _), e)| s == sandbox && e.end.is_none())
            .map(|((_, pid), e)| (*pid, e.clone()))
            .collect();
        v.sort_by_key(|(pid, _)| *pid);
        v
    }

    /// The process of command `exec_id` ended so.
    pub fn ended(&self, sandbox: &str, pid: u32, exec_id: &str, end: EndEvent) {
        let mut g = self.inner.locked();
        if let Some(e) = g.by_key.get_mut(&(sandbox.to_string(), pid)) {
            if e.exec_id == exec_id {
                e.end = Some(end);
            }
        }
    }

    /// Forgets the process of command `exec_id` (not a later one with its pid).
    pub fn remove(&self, sandbox: &str, pid: u32, exec_id: &str) {
        let mut g = self.inner.locked();
        let key = (sandbox.to_string(), pid);
        if g.by_key.get(&key).is_some_and(|e| e.exec_id == exec_id) {
            g.by_key.remove(&key);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.locked().by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connect::Code;

    fn entry(exec: &str, tag: Option<&str>) -> Entry {
        Entry::new(
            exec.into(),
            tag.map(String::from),
            ProcessConfig::default(),
            false,
        )
    }

    fn end() -> EndEvent {
        EndEvent {
            exit_code: 0,
            exited: true,
            status: "exit status 0".into(),
            error: None,
        }
    }

    #[test]
    fn selectors_find_processes_of_their_sandbox() {
        let p = Processes::default();
        p.insert("sbx-a", 10, entry("exe-1", Some("web")));
        p.insert("sbx-a", 11, entry("exe-2", None));
        p.insert("sbx-b", 10, entry("exe-3", Some("web")));
        assert_eq!(
            p.running("sbx-a", &Selector::Pid(10)).unwrap().1.exec_id,
            "exe-1"
        );
        assert_eq!(
            p.running("sbx-b", &Selector::Pid(10)).unwrap().1.exec_id,
            "exe-3"
        );
        assert_eq!(
            p.running("sbx-b", &Selector::Tag("web".into())).unwrap(),
            (10, p.running("sbx-b", &Selector::Pid(10)).unwrap().1)
        );
        let e = p.running("sbx-b", &Selector::Pid(11)).unwrap_err();
        assert_eq!(e.code, Code::NotFound);
        assert_eq!(e.message, "process with pid 11 not found");
        let e = p.running("sbx-a", &Selector::Tag("db".into())).unwrap_err();
        assert_eq!(e.message, "process with tag db not found");
        let pids: Vec<u32> = p.list("sbx-a").into_iter().map(|(pid, _)| pid).collect();
        assert_eq!(pids, [10, 11]);
    }

    #[test]
    fn ended_processes_are_kept_for_connect_only_then_go() {
        let p = Processes::default();
        p.insert("sbx-a", 10, entry("exe-1", Some("web")));
        p.ended("sbx-a", 10, "exe-1", end());
        assert!(p.running("sbx-a", &Selector::Pid(10)).is_err());
        assert!(p.list("sbx-a").is_empty());
        let (_, e) = p.any("sbx-a", &Selector::Tag("web".into())).unwrap();
        assert_eq!(e.end, Some(end()));
        // A later process with the tag is found first; its pid reused replaces the old one.
        p.insert("sbx-a", 12, entry("exe-2", Some("web")));
        assert_eq!(p.any("sbx-a", &Selector::Tag("web".into())).unwrap().0, 12);
        p.insert("sbx-a", 10, entry("exe-9", None));
        p.remove("sbx-a", 10, "exe-1");
        assert_eq!(
            p.running("sbx-a", &Selector::Pid(10)).unwrap().1.exec_id,
            "exe-9"
        );
        p.remove("sbx-a", 10, "exe-9");
        p.remove("sbx-a", 12, "exe-2");
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn the_later_of_two_running_with_a_tag_is_found() {
        let p = Processes::default();
        p.insert("sbx-a", 30, entry("exe-1", Some("t")));
        p.insert("sbx-a", 20, entry("exe-2", Some("t")));
        assert_eq!(
            p.running("sbx-a", &Selector::Tag("t".into())).unwrap().0,
            20
        );
    }
}
