//! Hardening of the node's hold on the host (issue #17): its sandboxes' cgroups at a stable
//! place no caller's scope owns (`sbx.slice/<node>` at each hierarchy's root), made again when
//! someone removes them; `/healthz` that answers 503 with the reason when the node cannot make
//! a sandbox; sandboxes of a node of the old layout (under its own cgroup) adopted after an
//! upgrade, and its empty folders removed.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{self, assert_error, get_json, TestNode};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

/// Polls `GET /healthz` until its status is `want`; the last (status, body).
fn healthz_until(node: &TestNode, want: u16) -> (u16, String) {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = node.get("/healthz", &[]);
        if r.status == want || Instant::now() > deadline {
            return (r.status, r.text());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kills every process of the node's sandboxes' groups and removes the groups (as a scope's
/// clean-up does), then the node's folders themselves.
fn remove_the_node_s_folders(node: &TestNode) -> Vec<PathBuf> {
    let dirs: Vec<PathBuf> = ["memory", "pids", "cpu", "freezer", "unified"]
        .iter()
        .filter_map(|c| node.cgroup_dir(c))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let deadline = Instant::now() + WAIT;
    for dir in &dirs {
        while dir.exists() {
            for sub in std::fs::read_dir(dir)
                .map(|rd| rd.flatten().map(|e| e.path()).collect::<Vec<_>>())
                .unwrap_or_default()
            {
                if !sub.is_dir() {
                    continue;
                }
                let _ = std::fs::write(sub.join("freezer.state"), "THAWED");
                let procs = std::fs::read_to_string(sub.join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    // SAFETY: kill has no memory effects.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
                let _ = std::fs::remove_dir(&sub);
            }
            let _ = std::fs::remove_dir(dir);
            assert!(
                Instant::now() < deadline,
                "could not remove {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    dirs
}

fn node_info(node: &TestNode) -> Value {
    let (status, v) = get_json(node, "/internal/node");
    assert_eq!(status, 200, "{v}");
    v
}

#[test]
fn sandboxes_cgroups_are_at_the_stable_place_not_in_the_caller_s_scope() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let info = node_info(&node);
    let places = info["cgroups"].as_array().expect("cgroups placement");
    assert!(!places.is_empty(), "{info}");
    // Where the test runs (a process API's per-job cgroup in the memory hierarchy), the
    // node's folder is not under the caller's cgroup but at the hierarchy's root.
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    for p in places {
        let folder = PathBuf::from(p["folder"].as_str().unwrap());
        if p["fallback"].is_null() {
            assert!(
                folder.ends_with(Path::new("sbx.slice").join(&node.cgroup_name)),
                "{p}"
            );
        } else {
            eprintln!("this hierarchy fell back: {p}");
        }
        assert!(folder.join(&id).is_dir(), "{p}: no group of {id}");
    }
    let agent = node.agent_pid(&id).expect("the sandbox's agent");
    let theirs = std::fs::read_to_string(format!("/proc/{agent}/cgroup")).unwrap();
    for line in theirs.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        let ctrls = line.split(':').nth(1).unwrap_or("");
        if ctrls
            .split(',')
            .any(|c| ["memory", "pids", "freezer", "cpu"].contains(&c))
        {
            let mine = own
                .lines()
                .find(|l| l.split(':').nth(1) == Some(ctrls))
                .and_then(|l| l.splitn(3, ':').nth(2))
                .unwrap_or("/");
            if mine != "/" {
                assert!(
                    !path.starts_with(&format!("{mine}/")),
                    "the sandbox is in the caller's {ctrls} cgroup {mine}: {path}"
                );
            }
            assert!(
                path.contains(&format!("/{}/{id}", node.cgroup_name)),
                "{line}"
            );
        }
    }
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn the_node_makes_its_cgroup_folders_again_when_they_are_gone() {
    // The failure: a scope's clean-up killed the warm sandboxes and removed the
    // node's folder; every create failed from then on, and /healthz still said ok.
    let node = TestNode::start_with(&["--warm-pool", "2"]);
    let deadline = Instant::now() + WAIT;
    while node.warm_ids().len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let removed = remove_the_node_s_folders(&node);
    assert!(!removed.is_empty());
    assert!(removed.iter().all(|d| !d.exists()));
    // A run (its warm sandboxes are dead: ended, and a new one made in the folders made again).
    let v = node.run_ok(&json!({ "command": "echo again" }));
    assert_eq!(v["stdout"], "again\n", "{v}");
    assert!(removed.iter().all(|d| d.is_dir()), "the folders are back");
    assert!(
        node.log_text().contains("made again"),
        "the node says what it did\n{}",
        node.log_tail(20)
    );
    // Removed again (with the warm sandboxes made since, if the pool refilled: it is not
    // waited for longer, a pool whose sandboxes all died is not refilled by a run that found
    // none alive): a kept sandbox is made too.
    let deadline = Instant::now() + Duration::from_secs(5);
    while node.warm_ids().len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    remove_the_node_s_folders(&node);
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let v = node.exec(&id, &json!({ "command": "echo kept" }));
    let v = node.exec_wait(&id, v["id"].as_str().unwrap(), WAIT);
    assert_eq!(common::stdout(&v), "kept\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn the_health_check_makes_the_folders_again_too() {
    // No warm pool: nothing but the health check makes them.
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let dirs = remove_the_node_s_folders(&node);
    assert!(dirs.iter().all(|d| !d.exists()));
    let deadline = Instant::now() + WAIT;
    while !dirs.iter().all(|d| d.is_dir()) && Instant::now() < deadline {
        let r = node.get("/healthz", &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        dirs.iter().all(|d| d.is_dir()),
        "made again by the health check"
    );
    let v = node.run_ok(&json!({ "command": "echo ok" }));
    assert_eq!(v["stdout"], "ok\n", "{v}");
    node.assert_clean(Duration::from_secs(10));
}

/// A read-only bind mount of an empty directory over a folder; undone when dropped.
struct Covered(CString);

impl Covered {
    fn over(target: &Path, empty: &Path) -> Covered {
        std::fs::create_dir_all(empty).unwrap();
        let src = CString::new(empty.as_os_str().as_encoded_bytes()).unwrap();
        let dst = CString::new(target.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: the strings are NUL-terminated and live for the calls; no data argument.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        assert_eq!(
            r,
            0,
            "bind {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        );
        let covered = Covered(dst);
        // SAFETY: as above.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                covered.0.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "read-only: {}", std::io::Error::last_os_error());
        covered
    }
}

impl Drop for Covered {
    fn drop(&mut self) {
        // SAFETY: the path is NUL-terminated and lives for the call.
        unsafe {
            libc::umount2(self.0.as_ptr(), libc::MNT_DETACH);
        }
    }
}

#[test]
fn healthz_is_503_with_the_reason_while_the_cgroups_are_unusable() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let (status, body) = healthz_until(&node, 200);
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let folder = node.cgroup_dir("memory").expect("the node's memory folder");
    {
        // Something that is no cgroup over the node's folder (read-only): no group can be
        // made in it.
        let _cover = Covered::over(&folder, &node.root.join("not-a-cgroup"));
        let (status, body) = healthz_until(&node, 503);
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        assert_error(status, &v, 503, "unavailable", None);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("cgroups:"), "{v}");
        assert!(msg.contains(&folder.display().to_string()), "{v}");
        // Each check, in the node's object.
        let info = node_info(&node);
        assert_eq!(info["health"]["ok"], false, "{info}");
        let checks = info["health"]["checks"].as_array().expect("checks");
        let cg = checks.iter().find(|c| c["name"] == "cgroups").unwrap();
        assert_eq!(cg["ok"], false, "{v}");
        for other in ["disk", "base_image"] {
            let c = checks.iter().find(|c| c["name"] == other).unwrap();
            assert_eq!(c["ok"], true, "{v}");
        }
        // And it is true: no sandbox is made.
        let (status, v) = node.run(&json!({ "command": "true" }));
        assert_ne!(status, 200, "a run in unusable cgroups: {v}");
    }
    let (status, body) = healthz_until(&node, 200);
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    assert_eq!(node_info(&node)["health"]["ok"], true);
    let v = node.run_ok(&json!({ "command": "echo back" }));
    assert_eq!(v["stdout"], "back\n", "{v}");
    node.assert_clean(Duration::from_secs(10));
}

/// Puts a symlink back when dropped.
struct Relink(PathBuf, PathBuf);

impl Drop for Relink {
    fn drop(&mut self) {
        let _ = std::os::unix::fs::symlink(&self.0, &self.1);
    }
}

#[test]
fn healthz_is_503_with_the_reason_while_the_base_image_is_missing() {
    // An images directory of its own whose base image is a link to the machine's: taking the
    // link away takes the base image away from this node alone.
    let node = TestNode::start_private_images(&["--warm-pool", "0"]);
    let link = node.images_dir.join("base");
    let target = std::fs::read_link(&link).expect("the base image is a link");
    std::fs::remove_file(&link).unwrap();
    let relink = Relink(target, link.clone());
    let (status, body) = healthz_until(&node, 503);
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    assert_error(status, &v, 503, "unavailable", None);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("base_image: no base image"),
        "{v}"
    );
    let info = node_info(&node);
    let checks = info["health"]["checks"].as_array().expect("checks");
    let base = checks.iter().find(|c| c["name"] == "base_image").unwrap();
    assert_eq!(base["ok"], false, "{v}");
    assert!(checks.iter().find(|c| c["name"] == "cgroups").unwrap()["ok"] == true);
    drop(relink);
    let (status, body) = healthz_until(&node, 200);
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_node_of_the_old_layout_is_upgraded_its_sandboxes_adopted_its_folders_removed() {
    // The old layout: the node's folder under its own cgroup (the tests' cgroup here).
    let mut node = TestNode::start_with(&["--warm-pool", "0", "--cgroup-parent", "own"]);
    let old = node.cgroup_dir("memory").expect("the old folder");
    let info = node_info(&node);
    assert!(
        info["cgroups"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| old == Path::new(p["folder"].as_str().unwrap())),
        "{info}"
    );
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(old.join(&id).is_dir());
    let agent = node.agent_pid(&id).expect("its agent");
    node.kill();
    // Upgraded: the default place.
    node.set_args(&["--warm-pool", "0"]);
    node.restart();
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    assert_eq!(node.agent_pid(&id), Some(agent), "the same agent, adopted");
    let v = node.exec(&id, &json!({ "command": "echo adopted" }));
    let v = node.exec_wait(&id, v["id"].as_str().unwrap(), WAIT);
    assert_eq!(common::stdout(&v), "adopted\n", "{v}");
    // A new sandbox goes to the stable place; the adopted one stays where it is.
    let new = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let stable = node.cgroup_dir("memory").unwrap();
    assert_ne!(stable, old);
    assert!(stable.join(&new).is_dir() && !old.join(&new).exists());
    assert!(old.join(&id).is_dir());
    // Its limits still hold where it is (the old group is its group).
    let v = node.run_ok(&json!({ "command": "true" }));
    assert_eq!(v["exit_code"], 0, "{v}");
    node.delete_sandbox(&id);
    assert!(!old.join(&id).exists(), "its old group went with it");
    // Killed (no clean stop), started again: the old folder, empty, is removed at start.
    node.kill();
    assert!(old.is_dir());
    node.restart();
    let deadline = Instant::now() + WAIT;
    while old.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !old.exists(),
        "the old layout's empty folder is removed at start"
    );
    assert!(
        node.log_text().contains("old layout"),
        "{}",
        node.log_tail(20)
    );
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{new}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    node.delete_sandbox(&new);
    node.assert_clean(Duration::from_secs(10));
}

/// Removes folders when dropped (the test's cgroup parent, after its node has gone).
struct RemoveDirs(Vec<PathBuf>);

impl Drop for RemoveDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[test]
fn a_given_cgroup_parent_is_where_the_folders_go() {
    let parent = format!("/{}", common::unique("sbx-parent-test"));
    // Declared before the node: dropped after it, when its folder is gone.
    let mut parents = RemoveDirs(Vec::new());
    let node = TestNode::start_with(&["--warm-pool", "0", "--cgroup-parent", &parent]);
    let info = node_info(&node);
    let folders: Vec<PathBuf> = info["cgroups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| PathBuf::from(p["folder"].as_str().unwrap()))
        .collect();
    parents.0 = folders
        .iter()
        .filter_map(|f| f.parent().map(Path::to_path_buf))
        .collect();
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    for p in info["cgroups"].as_array().unwrap() {
        let folder = PathBuf::from(p["folder"].as_str().unwrap());
        assert!(
            folder.ends_with(Path::new(&parent[1..]).join(&node.cgroup_name)),
            "{p}"
        );
        assert!(p["fallback"].is_null(), "{p}");
        assert!(folder.join(&id).is_dir(), "{p}");
    }
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
    drop(node);
    // The parent is the operator's: it stays; the node's folder in it went at its stop.
    for f in &folders {
        assert!(!f.exists(), "{}", f.display());
        assert!(f.parent().unwrap().is_dir());
    }
}

/// A cgroup folder in each hierarchy the node uses, standing for the scope (a login session's,
/// a shell's, a supervisor's) that started the node; removed when dropped.
struct Scope(Vec<PathBuf>);

impl Scope {
    /// Beside the node's folders' parent (`<hierarchy>/sbx.slice`), at each hierarchy's root.
    fn new(node: &TestNode) -> Scope {
        let name = common::unique("sbx-test-scope");
        let mut dirs = Vec::new();
        for ctrl in ["memory", "pids", "cpu", "freezer", "unified"] {
            let Some(folder) = node.cgroup_dir(ctrl) else {
                continue;
            };
            let slice = folder.parent().expect("the node's folder's parent");
            assert!(slice.ends_with("sbx.slice"), "{}", folder.display());
            let dir = slice.parent().expect("the hierarchy's root").join(&name);
            if !dirs.contains(&dir) {
                std::fs::create_dir(&dir).unwrap();
                dirs.push(dir);
            }
        }
        Scope(dirs)
    }

    fn add(&self, pid: u32) {
        for d in &self.0 {
            std::fs::write(d.join("cgroup.procs"), pid.to_string()).unwrap();
        }
    }

    /// What a scope's clean-up does: every process in it killed, its folders removed.
    fn clean_up(&self) {
        let deadline = Instant::now() + WAIT;
        for d in &self.0 {
            while d.exists() {
                let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
                for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    // SAFETY: kill has no memory effects.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
                let _ = std::fs::remove_dir(d);
                assert!(Instant::now() < deadline, "{} stays", d.display());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[test]
fn cleaning_up_the_scope_the_node_runs_in_leaves_its_sandboxes_running() {
    // The report: a node started from a shell; the shell's scope cleaned up; the
    // sandboxes were killed with it. Now they are not in the node's scope.
    let mut node = TestNode::start_with(&["--warm-pool", "0"]);
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let agent = node.agent_pid(&id).expect("its agent");
    let scope = Scope::new(&node);
    scope.add(node.pid().unwrap());
    scope.clean_up();
    node.kill();
    assert_eq!(
        node.agent_pid(&id),
        Some(agent),
        "the sandbox outlived the scope"
    );
    node.restart();
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let v = node.exec(&id, &json!({ "command": "echo alive" }));
    let v = node.exec_wait(&id, v["id"].as_str().unwrap(), WAIT);
    assert_eq!(common::stdout(&v), "alive\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}
