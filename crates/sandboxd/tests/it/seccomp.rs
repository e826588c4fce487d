//! The seccomp allow list, seen from inside a real sandbox: every syscall Docker's default
//! profile refuses to a root without the capabilities a sandbox drops answers EPERM (clone3:
//! ENOSYS), and what programs need still works (python3, node, pip, apt, bash).

use std::time::Duration;

use crate::common::{stdout, TestNode};
use serde_json::json;

const CLEAN: Duration = Duration::from_secs(10);

/// Syscalls refused by the filter (x86_64 numbers): Docker's list for a root without
/// CAP_SYS_ADMIN, SYS_BOOT, SYS_MODULE, SYS_PACCT, SYS_PTRACE, SYS_RAWIO, SYS_TIME,
/// SYS_TTY_CONFIG, SYS_NICE, SYSLOG, BPF, PERFMON, DAC_READ_SEARCH, what it does not list at
/// all, and sbx's own three (adjtimex, clock_adjtime, name_to_handle_at). Called with zero
/// arguments: the kernel itself would answer most of them with EFAULT, EINVAL, EBADF or ENOSYS,
/// so EPERM is the filter's answer.
#[cfg(target_arch = "x86_64")]
const REFUSED: &[(&str, u32)] = &[
    // CAP_SYS_ADMIN's
    ("bpf", 321),
    ("fanotify_init", 300),
    ("fsconfig", 431),
    ("fsmount", 432),
    ("fsopen", 430),
    ("fspick", 433),
    ("lookup_dcookie", 212),
    ("lsm_get_self_attr", 459),
    ("lsm_set_self_attr", 460),
    ("lsm_list_modules", 461),
    ("mount", 165),
    ("mount_setattr", 442),
    ("move_mount", 429),
    ("open_tree", 428),
    ("perf_event_open", 298),
    ("quotactl", 179),
    ("quotactl_fd", 443),
    ("setdomainname", 171),
    ("sethostname", 170),
    ("setns", 308),
    ("syslog", 103),
    ("umount2", 166),
    ("unshare", 272),
    // the other capabilities'
    ("open_by_handle_at", 304),
    ("reboot", 169),
    ("init_module", 175),
    ("finit_module", 313),
    ("delete_module", 176),
    ("acct", 163),
    ("kcmp", 312),
    ("pidfd_getfd", 438),
    ("process_madvise", 440),
    ("iopl", 172),
    ("ioperm", 173),
    ("settimeofday", 164),
    ("clock_settime", 227),
    ("vhangup", 153),
    ("get_mempolicy", 239),
    ("set_mempolicy", 238),
    ("mbind", 237),
    ("set_mempolicy_home_node", 450),
    // not in Docker's list at all
    ("io_uring_setup", 425),
    ("io_uring_enter", 426),
    ("io_uring_register", 427),
    ("keyctl", 250),
    ("add_key", 248),
    ("request_key", 249),
    ("userfaultfd", 323),
    ("kexec_load", 246),
    ("kexec_file_load", 320),
    ("swapon", 167),
    ("swapoff", 168),
    ("pivot_root", 155),
    ("move_pages", 279),
    ("nfsservctl", 180),
    ("uselib", 134),
    ("ustat", 136),
    ("sysfs", 139),
    ("_sysctl", 156),
    ("create_module", 174),
    ("get_kernel_syms", 177),
    ("query_module", 178),
    ("open_tree_attr", 467),
    ("file_getattr", 468),
    ("file_setattr", 469),
    // sbx's deviations from Docker
    ("adjtimex", 159),
    ("clock_adjtime", 305),
    ("name_to_handle_at", 303),
];

/// Runs `script` with python3 in a sandbox; its stdout's lines.
fn python(node: &TestNode, script: &str) -> Vec<String> {
    let v = node.run_ok(&json!({ "command": ["python3", "-c", script], "timeout_seconds": 120 }));
    assert_eq!(v["exit_code"], 0, "{v}");
    stdout(&v).lines().map(str::to_string).collect()
}

#[cfg(target_arch = "x86_64")]
#[test]
fn dockers_refused_syscalls_answer_eperm_in_a_sandbox() {
    let node = TestNode::start();
    let table: String = REFUSED
        .iter()
        .map(|(name, nr)| format!("('{name}', {nr}), "))
        .collect();
    let script = format!(
        "import ctypes\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         libc.syscall.restype = ctypes.c_long\n\
         def sys(nr, *a):\n\
         \x20   ctypes.set_errno(0)\n\
         \x20   r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) for x in a])\n\
         \x20   return 'ok' if r != -1 else {{1: 'EPERM', 38: 'ENOSYS'}}.get(ctypes.get_errno(), 'errno %d' % ctypes.get_errno())\n\
         for name, nr in [{table}]:\n\
         \x20   print(name, sys(nr, 0, 0, 0, 0, 0, 0))\n\
         SIGCHLD = 17\n\
         print('unshare(NEWUSER)', sys(272, 0x10000000))\n\
         print('unshare(NEWNS)', sys(272, 0x20000))\n\
         print('clone(NEWUSER)', sys(56, 0x10000000 | SIGCHLD, 0, 0, 0, 0))\n\
         print('clone(NEWNET)', sys(56, 0x40000000 | SIGCHLD, 0, 0, 0, 0))\n\
         print('clone(NEWPID)', sys(56, 0x20000000 | SIGCHLD, 0, 0, 0, 0))\n\
         print('clone3', sys(435, 0, 0))\n\
         print('setns', sys(308, 0, 0x40000000))\n\
         print('mount(tmpfs)', 'EPERM' if libc.mount(b'none', b'/mnt', b'tmpfs', 0, None) == -1 and ctypes.get_errno() == 1 else 'not refused')\n\
         print('personality(ADDR_NO_RANDOMIZE)', sys(135, 0x0040000))\n\
         print('personality(READ_IMPLIES_EXEC)', sys(135, 0x0400000))\n\
         print('socket(AF_ALG)', sys(41, 38, 5, 0))\n\
         print('socket(AF_VSOCK)', sys(41, 40, 1, 0))\n\
         print('x32 getpid', sys(0x40000000 | 39))\n\
         print('ptrace(ATTACH, 1)', sys(101, 16, 1, 0, 0))\n\
         print('ptrace(SEIZE, 1)', sys(101, 0x4206, 1, 0, 0))\n"
    );
    let lines = python(&node, &script);
    let mut want: Vec<String> = REFUSED
        .iter()
        .map(|(name, _)| format!("{name} EPERM"))
        .collect();
    for l in [
        "unshare(NEWUSER) EPERM",
        "unshare(NEWNS) EPERM",
        "clone(NEWUSER) EPERM",
        "clone(NEWNET) EPERM",
        "clone(NEWPID) EPERM",
        "clone3 ENOSYS",
        "setns EPERM",
        "mount(tmpfs) EPERM",
        "personality(ADDR_NO_RANDOMIZE) EPERM",
        "personality(READ_IMPLIES_EXEC) EPERM",
        "socket(AF_ALG) EPERM",
        "socket(AF_VSOCK) EPERM",
        "x32 getpid EPERM",
        // Allowed by the filter (as in Docker's profile), refused by the kernel: the agent is
        // not dumpable and the sandbox root has no CAP_SYS_PTRACE.
        "ptrace(ATTACH, 1) EPERM",
        "ptrace(SEIZE, 1) EPERM",
    ] {
        want.push(l.to_string());
    }
    let wrong: Vec<String> = want
        .iter()
        .zip(&lines)
        .filter(|(w, l)| w != l)
        .map(|(w, l)| format!("wanted {w:?}, got {l:?}"))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert_eq!(lines.len(), want.len(), "{lines:#?}");
    node.assert_clean(CLEAN);
}

#[test]
fn what_programs_need_still_works_under_the_filter() {
    let node = TestNode::start();
    // The status shows the three filters (the allow list, the arguments' refusals, clone3);
    // fork, fork+exec, threads, sockets, mmap, the personality query, chroot (CAP_SYS_CHROOT),
    // pidfds, memfd, eventfd, inotify, multiprocessing.
    let script = "import ctypes, mmap, os, socket, subprocess, threading, multiprocessing\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         libc.syscall.restype = ctypes.c_long\n\
         st = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n\
         print('seccomp', st['Seccomp'].strip(), st['Seccomp_filters'].strip(), st['NoNewPrivs'].strip())\n\
         pid = os.fork()\n\
         if pid == 0:\n\
         \x20   os._exit(7)\n\
         print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n\
         print('exec', subprocess.run(['/bin/sh', '-c', 'echo hi'], capture_output=True, text=True).stdout.strip())\n\
         out = []\n\
         t = threading.Thread(target=lambda: out.append('thread'))\n\
         t.start(); t.join(); print(out[0])\n\
         for fam, typ in [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM), (socket.AF_UNIX, socket.SOCK_STREAM), (socket.AF_NETLINK, socket.SOCK_RAW)]:\n\
         \x20   socket.socket(fam, typ).close()\n\
         print('sockets')\n\
         m = mmap.mmap(-1, 1 << 20); m[0:2] = b'ok'; print('mmap', m[0:2].decode())\n\
         print('personality', libc.syscall(135, ctypes.c_long(0xffffffff)) != -1)\n\
         print('chroot', libc.chroot(b'/'))\n\
         fd = os.pidfd_open(os.getpid()); os.close(fd); print('pidfd')\n\
         fd = os.memfd_create('x'); os.close(fd); print('memfd')\n\
         fd = os.eventfd(0); os.close(fd); print('eventfd')\n\
         with multiprocessing.Pool(2) as p:\n\
         \x20   print('pool', sum(p.map(abs, [-1, -2, -3])))\n";
    let lines = python(&node, script);
    assert_eq!(
        lines,
        [
            "seccomp 2 3 0",
            "fork 7",
            "exec hi",
            "thread",
            "sockets",
            "mmap ok",
            "personality True",
            "chroot 0",
            "pidfd",
            "memfd",
            "eventfd",
            "pool 6",
        ]
    );
    // node (libuv falls back from io_uring), worker threads, child processes, fs.
    let js = "const {execFileSync} = require('child_process');\n\
         const {Worker} = require('worker_threads');\n\
         const fs = require('fs');\n\
         fs.writeFileSync('/tmp/n.txt', 'node-fs');\n\
         console.log(fs.readFileSync('/tmp/n.txt', 'utf8'));\n\
         console.log(execFileSync('/bin/echo', ['node-exec']).toString().trim());\n\
         new Worker('require(\"worker_threads\").parentPort.postMessage(6*7)', {eval: true})\n\
         \x20 .on('message', m => { console.log('worker', m); });\n";
    let v = node.run_ok(&json!({ "command": ["node", "-e", js], "timeout_seconds": 120 }));
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(stdout(&v), "node-fs\nnode-exec\nworker 42\n", "{v}");
    // pip and apt's offline work: pip's own checks, apt's cache and a simulated install (apt
    // drops to its _apt user with setresuid), dpkg's database.
    let v = node.run_ok(&json!({
        "command": "set -e; pip --version >/dev/null && echo pip; \
                    pip list 2>/dev/null | grep -qi '^pip ' && echo pip-list; \
                    apt-cache policy bash | grep -q Installed && echo apt-cache; \
                    apt-get -s -o Debug::NoLocking=1 install --reinstall bash >/dev/null && echo apt-get; \
                    dpkg -s bash | grep -q '^Status: install ok' && echo dpkg; \
                    bash -c 'coproc { echo co; }; read -r x <&${COPROC[0]}; echo bash-$x'",
        "timeout_seconds": 120
    }));
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(
        stdout(&v),
        "pip\npip-list\napt-cache\napt-get\ndpkg\nbash-co\n",
        "{v}"
    );
    node.assert_clean(CLEAN);
}
