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
    assert_eq!(p.len(), 2);
    assert!(p[0].len() > allowed().len(), "{}", p[0].len());
    assert!(p[0].len() < 4096, "{} instructions", p[0].len());
    // Built once: the same programs the second time.
    assert!(std::ptr::eq(p, programs().unwrap()));
    let t = std::time::Instant::now();
    build_programs().unwrap();
    println!(
        "seccomp: {} + {} instructions, built in {:?}",
        p[0].len(),
        p[1].len(),
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
