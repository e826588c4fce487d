use std::collections::BTreeSet;

use super::*;

fn allowed() -> Vec<(&'static str, libc::c_long)> {
    ALLOWED
        .iter()
        .chain(ALLOWED_ARCH)
        .chain(ALLOWED_NEW)
        .copied()
        .collect()
}

#[test]
fn filters_compile_within_the_kernels_limit() {
    let p = programs().unwrap();
    assert_eq!(p.len(), 3);
    // A search, not a list: fewer steps than syscalls allowed.
    assert!(p[0].len() < allowed().len(), "{}", p[0].len());
    assert!(
        p.iter().all(|p| p.len() < 4096),
        "{:?}",
        p.iter().map(Vec::len)
    );
    // Built once: the same programs the second time.
    assert!(std::ptr::eq(p, programs().unwrap()));
    let t = std::time::Instant::now();
    build_programs().unwrap();
    println!(
        "seccomp: {} + {} + {} instructions, built in {:?}",
        p[0].len(),
        p[1].len(),
        p[2].len(),
        t.elapsed()
    );
}

#[test]
fn the_allow_list_has_no_refused_syscall_and_no_duplicate() {
    let list = allowed();
    let mut names = BTreeSet::new();
    let mut numbers = BTreeSet::new();
    for (name, nr) in &list {
        assert!(names.insert(*name), "{name} twice");
        assert!(numbers.insert(*nr), "{name}: {nr} twice");
        assert!(!DENIED.contains(nr), "{name} ({nr}) is refused");
    }
    for nr in [
        libc::SYS_clone,
        libc::SYS_clone3,
        libc::SYS_socket,
        libc::SYS_personality,
    ] {
        assert!(!numbers.contains(&nr), "{nr} is conditional");
    }
}

/// The child's checks: each is a syscall, its arguments, and the result wanted (`Ok`: not -1;
/// `Err(errno)`).
type Check = (libc::c_long, [libc::c_long; 6], Result<(), i32>);

fn checks() -> Vec<Check> {
    let z = [0; 6];
    let eperm = Err(libc::EPERM);
    let ns = |f: libc::c_int| [(f | libc::SIGCHLD) as libc::c_long, 0, 0, 0, 0, 0];
    vec![
        (libc::SYS_getpid, z, Ok(())),
        (
            libc::SYS_socket,
            [libc::AF_UNIX as _, libc::SOCK_STREAM as _, 0, 0, 0, 0],
            Ok(()),
        ),
        (
            libc::SYS_socket,
            [libc::AF_INET as _, libc::SOCK_DGRAM as _, 0, 0, 0, 0],
            Ok(()),
        ),
        (
            libc::SYS_socket,
            [libc::AF_ALG as _, libc::SOCK_SEQPACKET as _, 0, 0, 0, 0],
            eperm,
        ),
        (
            libc::SYS_socket,
            [libc::AF_VSOCK as _, libc::SOCK_STREAM as _, 0, 0, 0, 0],
            eperm,
        ),
        (libc::SYS_personality, [0xffff_ffff, 0, 0, 0, 0, 0], Ok(())),
        (
            libc::SYS_personality,
            [libc::ADDR_NO_RANDOMIZE as _, 0, 0, 0, 0, 0],
            eperm,
        ),
        (libc::SYS_io_uring_setup, [1, 0, 0, 0, 0, 0], eperm),
        (libc::SYS_keyctl, z, eperm),
        (libc::SYS_bpf, z, eperm),
        (libc::SYS_userfaultfd, z, eperm),
        (libc::SYS_name_to_handle_at, z, eperm),
        (libc::SYS_adjtimex, z, eperm),
        (
            libc::SYS_unshare,
            [libc::CLONE_NEWUSER as _, 0, 0, 0, 0, 0],
            eperm,
        ),
        (libc::SYS_clone, ns(libc::CLONE_NEWUSER), eperm),
        (libc::SYS_clone, ns(libc::CLONE_NEWNET), eperm),
        (libc::SYS_clone3, z, Err(libc::ENOSYS)),
        // An x32 syscall (getpid with bit 30): refused, not ENOSYS.
        #[cfg(target_arch = "x86_64")]
        (0x4000_0000 | libc::SYS_getpid, z, eperm),
        // A syscall newer than the list (file_getattr, Linux 6.17).
        (468, z, eperm),
    ]
}

/// In a child of the test: installs the filter and runs the checks; exits with 0, or with the
/// index of the first check that failed plus one (100 + it if a clone made a child). Only
/// syscalls between fork and exit: the test's other threads may hold the allocator's lock.
#[test]
fn the_filter_answers_as_documented() {
    let programs = programs().unwrap();
    let checks = checks();
    // SAFETY: the child makes only syscalls (no allocation, no lock) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(99) };
        }
        for p in programs {
            if seccompiler::apply_filter(p).is_err() {
                // SAFETY: as above.
                unsafe { libc::_exit(98) };
            }
        }
        for (i, (nr, a, want)) in checks.iter().enumerate() {
            // SAFETY: every check's arguments are integers or null pointers; a clone that
            // succeeds leaves its child here, which exits at once.
            let r = unsafe { libc::syscall(*nr, a[0], a[1], a[2], a[3], a[4], a[5]) };
            if r == 0 && *nr == libc::SYS_clone {
                // SAFETY: as above.
                unsafe { libc::_exit(100 + i as i32) };
            }
            // SAFETY: reads this thread's errno.
            let errno = unsafe { *libc::__errno_location() };
            let ok = match want {
                Ok(()) => r != -1,
                Err(e) => r == -1 && errno == *e,
            };
            if !ok {
                // SAFETY: as above.
                unsafe { libc::_exit(1 + i as i32) };
            }
        }
        // fork (clone without namespace flags) still works.
        // SAFETY: the grandchild exits at once.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        }
        if child < 0 {
            // SAFETY: as above.
            unsafe { libc::_exit(97) };
        }
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just made.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    let code = libc::WEXITSTATUS(status);
    let which = |i: i32| checks.get((i - 1) as usize).map(|c| (c.0, c.1[0], c.2));
    assert_eq!(code, 0, "failed check: {:?}", which(code % 100));
}

/// The filter as seccompiler built it before the search (the list and the arguments' rules in
/// one program, each syscall compared in turn, then clone3 -> ENOSYS): the reference the
/// programs must answer like.
fn reference() -> Vec<BpfProgram> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        allowed().iter().map(|(_, nr)| (*nr, Vec::new())).collect();
    rules.insert(libc::SYS_clone3, Vec::new());
    rules.insert(
        libc::SYS_clone,
        vec![cond(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(NS_FLAGS),
            0,
        )
        .unwrap()],
    );
    rules.insert(
        libc::SYS_socket,
        vec![
            cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Lt, AF_ALG).unwrap(),
            cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, AF_ALG + 1).unwrap(),
            cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Gt, AF_VSOCK).unwrap(),
        ],
    );
    rules.insert(
        libc::SYS_personality,
        PERSONAS
            .iter()
            .map(|p| cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, *p).unwrap())
            .collect(),
    );
    let allow = build(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
    )
    .unwrap();
    let clone3 = [(libc::SYS_clone3, vec![])].into_iter().collect();
    let enosys = build(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )
    .unwrap();
    vec![allow, enosys]
}

/// Runs a classic BPF program over a `seccomp_data` as the kernel does (the instructions
/// seccompiler and the search use; any other fails the test).
fn run(p: &[sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
    let word = |off: u32| -> u32 {
        match off {
            0 => nr,
            4 => arch,
            o if (16..64).contains(&o) => {
                let a = args[((o - 16) / 8) as usize];
                if o % 8 == 0 {
                    a as u32
                } else {
                    (a >> 32) as u32
                }
            }
            o => panic!("load at {o}"),
        }
    };
    let (mut acc, mut pc) = (0u32, 0usize);
    for _ in 0..100_000 {
        let i = &p[pc];
        let code = u32::from(i.code);
        let jump = |taken: bool| pc + 1 + usize::from(if taken { i.jt } else { i.jf });
        pc = match code {
            c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => {
                acc = word(i.k);
                pc + 1
            }
            c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => {
                acc &= i.k;
                pc + 1
            }
            c if c == libc::BPF_JMP | libc::BPF_JA => pc + 1 + i.k as usize,
            c if c == libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K => jump(acc == i.k),
            c if c == libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K => jump(acc > i.k),
            c if c == libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K => jump(acc >= i.k),
            c if c == libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K => jump(acc & i.k != 0),
            c if c == libc::BPF_RET | libc::BPF_K => return i.k,
            c => panic!("instruction {c:#x} at {pc}"),
        };
    }
    panic!("no verdict")
}

/// The verdict of programs installed in turn: the kernel returns the most restrictive
/// (the lowest action, read as a signed number).
fn verdict(ps: &[BpfProgram], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
    ps.iter()
        .map(|p| run(p, nr, arch, args))
        .min_by_key(|v| (v & libc::SECCOMP_RET_ACTION_FULL) as i32)
        .unwrap()
}

/// The search answers as seccompiler's list did, for every syscall number (and x32's), the
/// architectures, and the arguments the conditional syscalls are refused or allowed on.
#[test]
fn the_search_answers_as_the_list() {
    let (new, old) = (programs().unwrap(), reference());
    let mut values: Vec<u64> = (0..64).map(|b| 1u64 << b).collect();
    values.extend(0..=64);
    values.extend(PERSONAS);
    values.extend(PERSONAS.iter().map(|p| p | 1 << 32));
    values.extend([
        NS_FLAGS,
        NS_FLAGS | 0x1_0000_0000,
        0x1_0000_0026,
        0x1_0000_0028,
        0xffff_ffff_ffff_ffff,
        (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_SIGHAND) as u64,
        (libc::CLONE_THREAD | libc::CLONE_NEWNET) as u64,
        libc::SIGCHLD as u64,
    ]);
    let mut checked = 0;
    let x32 = 0x4000_0000u32;
    for nr in (0u32..600)
        .chain((0..600).map(|n| n | x32))
        .chain([u32::MAX])
    {
        for arch in [AUDIT_ARCH, 0x4000_0003, 0] {
            let conditional =
                [libc::SYS_clone, libc::SYS_socket, libc::SYS_personality].contains(&i64::from(nr));
            let args: &[u64] = if conditional { &values } else { &[0, 7] };
            for &a in args {
                let a = [a, 0, 0, 0, 0, 0];
                assert_eq!(
                    verdict(new, nr, arch, a),
                    verdict(&old, nr, arch, a),
                    "syscall {nr:#x}, arch {arch:#x}, args {a:?}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 3600);
}
