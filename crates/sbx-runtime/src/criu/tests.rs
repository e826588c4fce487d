//! Sleep → wake of real sandboxes (root, the base image, the agent built beside the tests, and
//! criu; skipped, saying so, without them).

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::*;
use crate::driver::{Driver, NamespaceDriver, Sandbox, SandboxSpec};
use crate::net::tests::{agent_and_rootfs, config, lab, root};

/// Counts the connections it accepts, in memory, and answers each with the count; holds
/// 40 MiB meanwhile.
const COUNTER: &str = "import socket\nn = 0\nblob = b'x' * (40 << 20)\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0', 8080))\ns.listen(16)\nwhile True:\n    c, _ = s.accept()\n    n += 1\n    c.sendall(str(n).encode())\n    c.close()\n";

fn criu_or_skip() -> Option<Criu> {
    if !root() {
        eprintln!("skipped: not root");
        return None;
    }
    let bin = ["/usr/local/sbin/criu", "/usr/sbin/criu"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file());
    let Some(bin) = bin else {
        eprintln!("skipped: criu is missing");
        return None;
    };
    match detect(&bin) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// One request to the agent of `sb` (through [`crate::sock::Conn::connect`], as the node
/// connects: in its network namespace, its listener checked), and its answer.
fn agent_request(sb: &Sandbox, msg: &sbx_proto::HostMsg) -> sbx_proto::AgentMsg {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let conn = crate::sock::Conn::connect(&sb.socket)
            .await
            .expect("connect to the agent");
        let (rd, mut wr) = conn.into_split();
        let mut rd = tokio::io::BufReader::new(rd);
        let hello = sbx_proto::read_frame::<sbx_proto::AgentMsg, _>(&mut rd)
            .await
            .expect("hello");
        assert!(matches!(
            hello,
            Some(sbx_proto::Frame::Msg(sbx_proto::AgentMsg::Hello { .. }))
        ));
        sbx_proto::write_msg(&mut wr, msg).await.expect("send");
        loop {
            match sbx_proto::read_frame::<sbx_proto::AgentMsg, _>(&mut rd)
                .await
                .expect("answer")
            {
                Some(sbx_proto::Frame::Msg(m)) => return m,
                Some(_) => continue,
                None => panic!("the agent closed the connection"),
            }
        }
    })
}

/// Starts COUNTER in the sandbox of `sb`, by its agent.
fn start_counter(sb: &Sandbox) {
    let spec = sbx_proto::ExecSpec {
        exec_id: "counter".into(),
        program: sbx_proto::Program::Argv(vec!["python3".into(), "-c".into(), COUNTER.into()]),
        env: Vec::new(),
        cwd: None,
        user: None,
        timeout_ms: None,
        stdin_open: false,
        stdin_null: true,
        attach: false,
        tty: false,
        wait_for_reader: false,
        rows: 24,
        cols: 80,
    };
    let answer = agent_request(sb, &sbx_proto::HostMsg::Exec(spec));
    assert!(
        matches!(answer, sbx_proto::AgentMsg::Started { .. }),
        "{answer:?}"
    );
}

fn set_dumpable(sb: &Sandbox, dumpable: bool) {
    let answer = agent_request(sb, &sbx_proto::HostMsg::SetDumpable { dumpable });
    assert_eq!(answer, sbx_proto::AgentMsg::Dumpable { dumpable });
}

/// One connection to the counter at `addr` from the network namespace `ns`: its count.
fn count(ns: OwnedFd, addr: SocketAddr) -> Result<u64, String> {
    crate::netns::in_netns_of_handle(ns, move || {
        let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        c.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut s = String::new();
        c.read_to_string(&mut s)?;
        s.trim()
            .parse::<u64>()
            .map_err(|_| std::io::Error::other(format!("answer {s:?}")))
    })
    .map_err(|e| e.to_string())
}

fn count_when_up(ns: impl Fn() -> OwnedFd, addr: SocketAddr) -> u64 {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        match count(ns(), addr) {
            Ok(n) => return n,
            Err(e) if Instant::now() >= end => panic!("the counter does not answer: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

struct Cleanup<'a> {
    driver: &'a NamespaceDriver,
    sandbox: Option<Sandbox>,
    dir: PathBuf,
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        if let Some(sb) = self.sandbox.take() {
            let _ = self.driver.destroy(&sb);
        }
        let _ = self.driver.remove_leftovers("sbcriu");
        self.driver.release();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spec(rootfs: &Path, dir: &Path, netns: Option<PathBuf>) -> SandboxSpec {
    let base = SandboxSpec::for_test("sbcriu", rootfs, dir);
    SandboxSpec {
        limits: crate::Limits {
            memory_bytes: 512 << 20,
            ..base.limits
        },
        netns,
        ..base
    }
}

/// A sandbox's counter keeps its count and serves TCP across sleep → wake; its memory is
/// given back while it sleeps. With a network, it answers on its address from the node.
fn sleep_and_wake(with_network: bool) {
    let Some(criu) = criu_or_skip() else {
        return;
    };
    let Some((agent, rootfs)) = agent_and_rootfs() else {
        eprintln!("skipped: no sbx-agent beside the tests, or no base image");
        return;
    };
    let tag = if with_network { "net" } else { "nonet" };
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("sbx-criu-test-{tag}-{pid}"));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let lab = with_network.then(|| lab(config()));
    let lease = lab.as_ref().map(|l| l.net().take().expect("lease"));
    let driver = NamespaceDriver::with_cgroup_name(
        agent,
        &format!("sbx-criu-test-{tag}-{pid}"),
        &dir.display().to_string(),
        100_000,
        65_536,
    )
    .expect("driver");
    let spec = spec(&rootfs, &dir, lease.as_ref().map(|l| l.ns_path()));
    let mut c = Cleanup {
        driver: &driver,
        sandbox: None,
        dir: dir.clone(),
    };
    let sb = driver.create(&spec).expect("create");
    let group = crate::cgroup::Cgroups::discover(&format!("sbx-criu-test-{tag}-{pid}"))
        .expect("cgroups")
        .group("sbcriu");
    start_counter(&sb);
    c.sandbox = Some(sb);
    // From inside its namespace, or from the node's to its address.
    let at = |sb: &Sandbox| -> (Box<dyn Fn() -> OwnedFd>, SocketAddr) {
        match (&lab, &lease) {
            (Some(l), Some(lease)) => {
                let node = l.node.try_clone().expect("dup");
                (
                    Box::new(move || node.try_clone().expect("dup")),
                    SocketAddr::new(lease.address().into(), 8080),
                )
            }
            _ => {
                let h = sb.netns_handle().expect("handle");
                (
                    Box::new(move || h.try_clone().expect("dup")),
                    "127.0.0.1:8080".parse().expect("addr"),
                )
            }
        }
    };
    let (ns, addr) = at(c.sandbox.as_ref().expect("sandbox"));
    assert_eq!(count_when_up(&ns, addr), 1);
    assert_eq!(count(ns(), addr), Ok(2));
    let awake = group.memory_current().expect("memory");

    set_dumpable(c.sandbox.as_ref().expect("sandbox"), true);
    let images = dir.join("images");
    let t = Instant::now();
    driver
        .sleep(
            c.sandbox.as_ref().expect("sandbox"),
            &criu,
            &images,
            with_network,
        )
        .expect("sleep");
    eprintln!("sleep: {:?}", t.elapsed());
    assert!(!c.sandbox.as_ref().expect("sandbox").is_alive());
    let asleep = group.memory_current().expect("memory");
    assert!(
        asleep < awake / 2,
        "memory while asleep {asleep}, awake {awake}"
    );

    let t = Instant::now();
    let woken = driver
        .wake(&spec, &criu, &images, lease.as_ref())
        .expect("wake");
    eprintln!("wake: {:?}", t.elapsed());
    assert!(woken.is_alive());
    c.sandbox = Some(woken);
    let (ns, addr) = at(c.sandbox.as_ref().expect("sandbox"));
    assert_eq!(count(ns(), addr), Ok(3), "the count goes on");
    // The node reaches the restored agent as before (its listener's pid is the new one).
    set_dumpable(c.sandbox.as_ref().expect("sandbox"), false);
    // The agent's listener came back in the sandbox's namespace, and is its own.
    let sb = c.sandbox.as_ref().expect("sandbox");
    let h = sb.netns_handle().expect("handle");
    let peer = crate::netns::in_netns_of_handle(h, || {
        let s = std::os::unix::net::UnixStream::connect_addr(
            &<std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
                crate::init::AGENT_SOCKET.as_bytes(),
            )?,
        )?;
        crate::sock::peer_pid(&s)
    })
    .expect("the agent's listener");
    eprintln!("agent pid {}, listener's pid {peer}", sb.pid);
    drop(c);
    drop(lease);
    drop(lab);
}

#[test]
fn a_sandbox_without_network_keeps_its_memory_across_sleep_and_wake() {
    sleep_and_wake(false);
}

#[test]
fn a_sandbox_with_network_keeps_its_memory_and_address_across_sleep_and_wake() {
    sleep_and_wake(true);
}

#[test]
fn versions_are_read() {
    assert_eq!(parse_version("Version: 4.2.1\n"), Some((4, 2, 1)));
    assert_eq!(parse_version("Version: 4.2\nGitID: x"), Some((4, 2, 0)));
    assert_eq!(parse_version("nothing"), None);
    assert_eq!(key("/dev/.sbx-agent"), "m_dev__sbx-agent");
}

/// The mount points `pid` sees (its mountinfo's fifth fields).
fn mount_points_of(pid: &str) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .expect("mountinfo")
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect()
}

#[test]
fn workers_wait_in_namespaces_of_their_own_are_made_again_off_the_path_and_end_with_the_node() {
    let Some(criu) = criu_or_skip() else {
        return;
    };
    // None waits yet: the first is started for the request.
    assert_eq!(criu.workers.ready(), 0);
    let w = criu.workers.take(&criu).expect("a worker");
    let pid = w.child.id().to_string();
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).expect("ns link");
    assert_ne!(ns(&pid), ns("self"), "a worker's mounts are its own");
    // A restore's root mounted in its namespace is seen there, not on the host.
    struct Gone(PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let tmp = std::env::temp_dir().join(format!("sbx-criu-worker-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let _gone = Gone(tmp.clone());
    for d in ["lower", "upper", "work", "root"] {
        std::fs::create_dir_all(tmp.join(d)).expect("mkdir");
    }
    std::fs::write(tmp.join("lower/seen"), "lower").expect("write");
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        tmp.join("lower").display(),
        tmp.join("upper").display(),
        tmp.join("work").display()
    );
    w.mount_root(&tmp.join("root"), &data)
        .expect("mount in the worker");
    let root = tmp.join("root").display().to_string();
    assert!(
        mount_points_of(&pid).contains(&root),
        "mounted in the worker"
    );
    assert!(!mount_points_of("self").contains(&root), "not on the host");
    assert!(!tmp.join("root/seen").exists());
    // Given no request, it ends when its socket closes (and takes its mount with it).
    let super::worker::Worker {
        sock, mut child, ..
    } = w;
    drop(sock);
    let end = Instant::now() + Duration::from_secs(5);
    let ended = loop {
        if let Ok(Some(_)) = child.try_wait() {
            break true;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        ended,
        "a worker given no request ends when its socket closes"
    );
    // Workers are made ahead, off the request's path, up to READY.
    criu.workers.refill(&criu);
    let end = Instant::now() + Duration::from_secs(20);
    while criu.workers.ready() < super::worker::READY && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let ready = criu.workers.ready_pids();
    assert_eq!(ready.len(), super::worker::READY);
    // One that ended while it waited is not given out.
    crate::process::kill_pid(ready[ready.len() - 1], libc::SIGKILL);
    std::thread::sleep(Duration::from_millis(100));
    let w = criu.workers.take(&criu).expect("a worker");
    assert_ne!(w.child.id(), ready[ready.len() - 1]);
    assert!(ready.contains(&w.child.id()));
    // Stopped (the node ends): those waiting end, none is made again.
    criu.workers.refill(&criu);
    let end = Instant::now() + Duration::from_secs(20);
    while criu.workers.ready() < super::worker::READY && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let waiting = criu.workers.ready_pids();
    assert!(!waiting.is_empty());
    criu.stop_workers();
    assert_eq!(criu.workers.ready(), 0);
    for pid in waiting {
        assert!(
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_err(),
            "worker {pid} ended and was reaped"
        );
    }
    criu.workers.refill(&criu);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(criu.workers.ready(), 0);
    let super::worker::Worker {
        sock, mut child, ..
    } = w;
    drop(sock);
    let _ = child.wait();
}
