//! The seccomp filter of every sandbox: an allow list derived from Docker's default profile
//! (moby/profiles `seccomp/default.json`), read for a container whose root holds exactly the
//! capabilities the sandbox root keeps (`KEEP_CAPS` in `init.rs`: CHOWN, DAC_OVERRIDE, FSETID,
//! FOWNER, MKNOD, NET_RAW, SETGID, SETUID, SETFCAP, SETPCAP, NET_BIND_SERVICE, SYS_CHROOT, KILL,
//! AUDIT_WRITE). Every syscall not allowed answers EPERM; clone3 answers ENOSYS, so that libcs
//! fall back to clone, whose flags a classic filter can read.
//!
//! Allowed, as in Docker's profile:
//! - its unconditional list ([`ALLOWED`], [`ALLOWED_NEW`], and the x86_64-only entries);
//! - ptrace, process_vm_readv and process_vm_writev (Docker allows them on kernels >= 4.8; the
//!   kernel's own ptrace checks apply: without CAP_SYS_PTRACE a process reaches only dumpable
//!   processes of its own uid, and the agent, PID 1, is not dumpable);
//! - chroot (the sandbox root keeps CAP_SYS_CHROOT);
//! - clone without any namespace flag (NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET,
//!   NEWCGROUP: Docker's mask 0x7e020000);
//! - socket for every family but AF_ALG (38) and AF_VSOCK (40);
//! - personality(0), (PER_LINUX32), (UNAME26), (PER_LINUX32|UNAME26) and the query (0xffffffff):
//!   no persona that turns ASLR off or makes pages executable.
//!
//! Refused, as in Docker's profile for a root without CAP_SYS_ADMIN, SYS_BOOT, SYS_MODULE,
//! SYS_PACCT, SYS_PTRACE, SYS_RAWIO, SYS_TIME, SYS_TTY_CONFIG, SYS_NICE, SYSLOG, BPF, PERFMON,
//! DAC_READ_SEARCH: the mount API old and new (mount, umount2, pivot_root, fsopen, fsconfig,
//! fsmount, fspick, move_mount, open_tree, mount_setattr), unshare, setns, clone with a namespace
//! flag, bpf, perf_event_open, fanotify_init, lookup_dcookie, quotactl(_fd), sethostname,
//! setdomainname, syslog, the lsm_* calls, reboot, kernel modules, acct, kcmp, pidfd_getfd,
//! process_madvise, iopl, ioperm, settimeofday, clock_settime, vhangup, the NUMA memory policy
//! calls (mbind, get/set_mempolicy...), open_by_handle_at; and everything Docker does not list:
//! io_uring_setup/enter/register, keyctl, add_key, request_key, userfaultfd, kexec_load,
//! kexec_file_load, swapon/off, move_pages, and any syscall newer than the list.
//!
//! Deviations from Docker's profile (all stricter):
//! - adjtimex and clock_adjtime are refused (Docker allows them; the kernel lets anyone read
//!   the clock's state with them, and sets nothing without CAP_SYS_TIME). Nothing a sandbox runs
//!   needs them; sbx refused them before the allow list.
//! - name_to_handle_at is refused (Docker allows it): file handles are what open_by_handle_at
//!   takes, and sbx refused both before the allow list.
//! - Only the native ABI is allowed: a syscall of another architecture (the i386 ABI through
//!   `int 0x80` on x86_64) kills the process (the filter's architecture check), and x32 syscalls
//!   (numbers with bit 30 set) answer EPERM. Docker allows its list for the x86 and x32
//!   sub-architectures too.
//!
//! The filter is three programs: the allow list (a binary search over the syscall's number, see
//! [`allow_program`]), the refusals that read arguments (clone, socket, personality; built by
//! seccompiler), then clone3 -> ENOSYS. The first allows clone, socket, personality and clone3
//! so that the others decide: of an ERRNO and an ALLOW, the kernel returns the ERRNO. All are
//! built once per process (~130 + ~40 + 10 instructions). Since Linux 5.11 the kernel caches the
//! verdict of every syscall the filters allow whatever its arguments (it works it out for
//! every number when a filter is installed: the shorter the program, the cheaper the install),
//! so allowed syscalls other than clone, socket and personality do not run them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

#[derive(Debug, Clone, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filter: {0}")]
    Build(String),
    #[error("seccomp install: {0}")]
    Install(String),
}

/// Docker's unconditional allow list, the entries present on every architecture sbx builds for
/// (names Docker lists for 32-bit ABIs only, like `chown32` or `socketcall`, have no number
/// here), without adjtimex, clock_adjtime and name_to_handle_at (see the module's deviations).
pub const ALLOWED: &[(&str, libc::c_long)] = &[
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("bind", libc::SYS_bind),
    ("brk", libc::SYS_brk),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    ("chdir", libc::SYS_chdir),
    ("clock_getres", libc::SYS_clock_getres),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("close", libc::SYS_close),
    ("close_range", libc::SYS_close_range),
    ("connect", libc::SYS_connect),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("dup", libc::SYS_dup),
    ("dup3", libc::SYS_dup3),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("eventfd2", libc::SYS_eventfd2),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    ("fadvise64", libc::SYS_fadvise64),
    ("fallocate", libc::SYS_fallocate),
    ("fanotify_mark", libc::SYS_fanotify_mark),
    ("fchdir", libc::SYS_fchdir),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    ("fchown", libc::SYS_fchown),
    ("fchownat", libc::SYS_fchownat),
    ("fcntl", libc::SYS_fcntl),
    ("fdatasync", libc::SYS_fdatasync),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("flock", libc::SYS_flock),
    ("fremovexattr", libc::SYS_fremovexattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("fstat", libc::SYS_fstat),
    ("fstatfs", libc::SYS_fstatfs),
    ("fsync", libc::SYS_fsync),
    ("ftruncate", libc::SYS_ftruncate),
    ("futex", libc::SYS_futex),
    ("futex_waitv", libc::SYS_futex_waitv),
    ("getcpu", libc::SYS_getcpu),
    ("getcwd", libc::SYS_getcwd),
    ("getdents64", libc::SYS_getdents64),
    ("getegid", libc::SYS_getegid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getgroups", libc::SYS_getgroups),
    ("getitimer", libc::SYS_getitimer),
    ("getpeername", libc::SYS_getpeername),
    ("getpgid", libc::SYS_getpgid),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("getpriority", libc::SYS_getpriority),
    ("getrandom", libc::SYS_getrandom),
    ("getresgid", libc::SYS_getresgid),
    ("getresuid", libc::SYS_getresuid),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("getrusage", libc::SYS_getrusage),
    ("getsid", libc::SYS_getsid),
    ("getsockname", libc::SYS_getsockname),
    ("getsockopt", libc::SYS_getsockopt),
    ("gettid", libc::SYS_gettid),
    ("gettimeofday", libc::SYS_gettimeofday),
    ("getuid", libc::SYS_getuid),
    ("getxattr", libc::SYS_getxattr),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    ("io_cancel", libc::SYS_io_cancel),
    ("ioctl", libc::SYS_ioctl),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_getevents", libc::SYS_io_getevents),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("ioprio_set", libc::SYS_ioprio_set),
    ("io_setup", libc::SYS_io_setup),
    ("io_submit", libc::SYS_io_submit),
    ("kill", libc::SYS_kill),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("linkat", libc::SYS_linkat),
    ("listen", libc::SYS_listen),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("lseek", libc::SYS_lseek),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("madvise", libc::SYS_madvise),
    ("membarrier", libc::SYS_membarrier),
    ("memfd_create", libc::SYS_memfd_create),
    ("memfd_secret", libc::SYS_memfd_secret),
    ("mincore", libc::SYS_mincore),
    ("mkdirat", libc::SYS_mkdirat),
    ("mknodat", libc::SYS_mknodat),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("mlockall", libc::SYS_mlockall),
    ("mmap", libc::SYS_mmap),
    ("mprotect", libc::SYS_mprotect),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_open", libc::SYS_mq_open),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mremap", libc::SYS_mremap),
    ("mseal", libc::SYS_mseal),
    ("msgctl", libc::SYS_msgctl),
    ("msgget", libc::SYS_msgget),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgsnd", libc::SYS_msgsnd),
    ("msync", libc::SYS_msync),
    ("munlock", libc::SYS_munlock),
    ("munlockall", libc::SYS_munlockall),
    ("munmap", libc::SYS_munmap),
    ("nanosleep", libc::SYS_nanosleep),
    ("newfstatat", libc::SYS_newfstatat),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("pipe2", libc::SYS_pipe2),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("ppoll", libc::SYS_ppoll),
    ("prctl", libc::SYS_prctl),
    ("pread64", libc::SYS_pread64),
    ("preadv", libc::SYS_preadv),
    ("preadv2", libc::SYS_preadv2),
    ("prlimit64", libc::SYS_prlimit64),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("pselect6", libc::SYS_pselect6),
    ("pwrite64", libc::SYS_pwrite64),
    ("pwritev", libc::SYS_pwritev),
    ("pwritev2", libc::SYS_pwritev2),
    ("read", libc::SYS_read),
    ("readahead", libc::SYS_readahead),
    ("readlinkat", libc::SYS_readlinkat),
    ("readv", libc::SYS_readv),
    ("recvfrom", libc::SYS_recvfrom),
    ("recvmmsg", libc::SYS_recvmmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("removexattr", libc::SYS_removexattr),
    ("renameat2", libc::SYS_renameat2),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("rseq", libc::SYS_rseq),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_yield", libc::SYS_sched_yield),
    ("seccomp", libc::SYS_seccomp),
    ("semctl", libc::SYS_semctl),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semtimedop", libc::SYS_semtimedop),
    ("sendfile", libc::SYS_sendfile),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("sendmsg", libc::SYS_sendmsg),
    ("sendto", libc::SYS_sendto),
    ("setfsgid", libc::SYS_setfsgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setgid", libc::SYS_setgid),
    ("setgroups", libc::SYS_setgroups),
    ("setitimer", libc::SYS_setitimer),
    ("setpgid", libc::SYS_setpgid),
    ("setpriority", libc::SYS_setpriority),
    ("setregid", libc::SYS_setregid),
    ("setresgid", libc::SYS_setresgid),
    ("setresuid", libc::SYS_setresuid),
    ("setreuid", libc::SYS_setreuid),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("setsid", libc::SYS_setsid),
    ("setsockopt", libc::SYS_setsockopt),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("setuid", libc::SYS_setuid),
    ("setxattr", libc::SYS_setxattr),
    ("shmat", libc::SYS_shmat),
    ("shmctl", libc::SYS_shmctl),
    ("shmdt", libc::SYS_shmdt),
    ("shmget", libc::SYS_shmget),
    ("shutdown", libc::SYS_shutdown),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("signalfd4", libc::SYS_signalfd4),
    ("socketpair", libc::SYS_socketpair),
    ("splice", libc::SYS_splice),
    ("statfs", libc::SYS_statfs),
    ("statx", libc::SYS_statx),
    ("symlinkat", libc::SYS_symlinkat),
    ("sync", libc::SYS_sync),
    ("syncfs", libc::SYS_syncfs),
    ("sysinfo", libc::SYS_sysinfo),
    ("tee", libc::SYS_tee),
    ("tgkill", libc::SYS_tgkill),
    ("timer_create", libc::SYS_timer_create),
    ("timer_delete", libc::SYS_timer_delete),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_settime", libc::SYS_timer_settime),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("times", libc::SYS_times),
    ("tkill", libc::SYS_tkill),
    ("truncate", libc::SYS_truncate),
    ("umask", libc::SYS_umask),
    ("uname", libc::SYS_uname),
    ("unlinkat", libc::SYS_unlinkat),
    ("utimensat", libc::SYS_utimensat),
    ("vmsplice", libc::SYS_vmsplice),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
    // Not in Docker's unconditional list: allowed by its conditional entries for this root.
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("chroot", libc::SYS_chroot),
];

/// Docker's unconditional entries that exist only on x86_64 (the legacy calls that newer
/// architectures replaced with their `*at` forms), and its x86_64 arch entries.
#[cfg(target_arch = "x86_64")]
pub const ALLOWED_ARCH: &[(&str, libc::c_long)] = &[
    ("access", libc::SYS_access),
    ("alarm", libc::SYS_alarm),
    ("chmod", libc::SYS_chmod),
    ("chown", libc::SYS_chown),
    ("creat", libc::SYS_creat),
    ("dup2", libc::SYS_dup2),
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_ctl_old", libc::SYS_epoll_ctl_old),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("epoll_wait_old", libc::SYS_epoll_wait_old),
    ("eventfd", libc::SYS_eventfd),
    ("fork", libc::SYS_fork),
    ("futimesat", libc::SYS_futimesat),
    ("getdents", libc::SYS_getdents),
    ("getpgrp", libc::SYS_getpgrp),
    ("getrlimit", libc::SYS_getrlimit),
    ("get_thread_area", libc::SYS_get_thread_area),
    ("inotify_init", libc::SYS_inotify_init),
    ("lchown", libc::SYS_lchown),
    ("link", libc::SYS_link),
    ("lstat", libc::SYS_lstat),
    ("mkdir", libc::SYS_mkdir),
    ("mknod", libc::SYS_mknod),
    ("open", libc::SYS_open),
    ("pause", libc::SYS_pause),
    ("pipe", libc::SYS_pipe),
    ("poll", libc::SYS_poll),
    ("readlink", libc::SYS_readlink),
    ("rename", libc::SYS_rename),
    ("renameat", libc::SYS_renameat),
    ("rmdir", libc::SYS_rmdir),
    ("select", libc::SYS_select),
    ("setrlimit", libc::SYS_setrlimit),
    ("set_thread_area", libc::SYS_set_thread_area),
    ("signalfd", libc::SYS_signalfd),
    ("stat", libc::SYS_stat),
    ("symlink", libc::SYS_symlink),
    ("sync_file_range", libc::SYS_sync_file_range),
    ("time", libc::SYS_time),
    ("unlink", libc::SYS_unlink),
    ("utime", libc::SYS_utime),
    ("utimes", libc::SYS_utimes),
    ("vfork", libc::SYS_vfork),
    ("arch_prctl", libc::SYS_arch_prctl),
    ("modify_ldt", libc::SYS_modify_ldt),
    ("io_pgetevents", 333),
    ("uretprobe", 335),
];

#[cfg(target_arch = "aarch64")]
pub const ALLOWED_ARCH: &[(&str, libc::c_long)] =
    &[("io_pgetevents", 292), ("sync_file_range", 84)];

/// Docker's unconditional entries newer than the `libc` crate's tables: numbers from the
/// kernel's unified table (the same on every architecture since Linux 5.1).
pub const ALLOWED_NEW: &[(&str, libc::c_long)] = &[
    ("cachestat", 451),
    ("fchmodat2", 452),
    ("map_shadow_stack", 453),
    ("futex_wake", 454),
    ("futex_wait", 455),
    ("futex_requeue", 456),
    ("statmount", 457),
    ("listmount", 458),
    ("setxattrat", 463),
    ("getxattrat", 464),
    ("listxattrat", 465),
    ("removexattrat", 466),
];

/// Syscalls that must never be allowed: what sbx refused before the allow list, and io_uring.
/// Nothing here may appear in the allow lists (a unit test checks it).
pub const DENIED: &[libc::c_long] = &[
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_syslog,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_userfaultfd,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_iopl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_ioperm,
    libc::SYS_quotactl,
    libc::SYS_lookup_dcookie,
    libc::SYS_vhangup,
    libc::SYS_nfsservctl,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_kcmp,
    libc::SYS_pidfd_getfd,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_mbind,
    libc::SYS_set_mempolicy,
    libc::SYS_move_pages,
];

/// The namespace flags clone must not carry (Docker's mask 0x7e020000).
const NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

/// The socket families refused: AF_ALG (the kernel's crypto API) and AF_VSOCK.
const AF_ALG: u64 = 38;
const AF_VSOCK: u64 = 40;

/// The personas allowed: PER_LINUX, PER_LINUX32, UNAME26, both, and the query.
const PERSONAS: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

fn arch() -> Result<TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e| SeccompError::Build(format!("{e:?}")))
}

fn cond(
    arg: u8,
    len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompRule, SeccompError> {
    let c = SeccompCondition::new(arg, len, op, value)
        .map_err(|e| SeccompError::Build(e.to_string()))?;
    SeccompRule::new(vec![c]).map_err(|e| SeccompError::Build(e.to_string()))
}

/// The syscalls the first program allows whatever their arguments: the lists, and clone,
/// socket and personality, whose arguments the second program reads, and clone3, which the
/// third answers.
fn allowed_numbers() -> Result<BTreeSet<u32>, SeccompError> {
    ALLOWED
        .iter()
        .chain(ALLOWED_ARCH)
        .chain(ALLOWED_NEW)
        .map(|(_, nr)| *nr)
        .chain([
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_socket,
            libc::SYS_personality,
        ])
        .map(|nr| u32::try_from(nr).map_err(|_| SeccompError::Build(format!("syscall {nr}"))))
        .collect()
}

/// The audit architecture of this build (`AUDIT_ARCH_*` of linux/audit.h): 64-bit,
/// little-endian, the ELF machine.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 62 | 0x8000_0000 | 0x4000_0000;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 183 | 0x8000_0000 | 0x4000_0000;

/// Offsets in the kernel's `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

fn stmt(code: u32, k: u32) -> sock_filter {
    sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

const RET_EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;

/// The allow list as a binary search over the syscall's number: another architecture kills
/// the process (as seccompiler's check does), then the number is compared with the bounds of
/// the ranges of allowed numbers, halving them at each step, down to the verdict of the range
/// it falls in (allow, or EPERM). seccompiler compares the number with every listed syscall in
/// turn (1,580 steps for this list): the kernel runs such a program through its emulator for
/// every syscall number when it installs it (the cache of syscalls always allowed), 0.6 ms of
/// CPU per sandbox; a search of the ~60 ranges is ~130 steps, and ~7 of them per syscall.
fn allow_program(allowed: &BTreeSet<u32>) -> Result<BpfProgram, SeccompError> {
    // The number line cut into ranges of one verdict: (first number, allowed).
    let mut ranges: Vec<(u32, bool)> = vec![(0, allowed.contains(&0))];
    for &nr in allowed {
        let last = ranges.last().map(|r| r.1).unwrap_or(false);
        if !last {
            ranges.push((nr, true));
        }
        let next = nr.saturating_add(1);
        if next > nr && !allowed.contains(&next) {
            ranges.push((next, false));
        }
    }
    let mut p = vec![
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, DATA_ARCH),
        sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt: 1,
            jf: 0,
            k: AUDIT_ARCH,
        },
        stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, DATA_NR),
    ];
    search(&ranges, &mut p)?;
    Ok(p)
}

/// Appends the search of `ranges` (sorted by first number): one range is its verdict; more
/// are split in two halves, `number >= first of the upper half` jumping over the lower half's
/// steps (a search of n ranges is 2n - 1 steps).
fn search(ranges: &[(u32, bool)], p: &mut BpfProgram) -> Result<(), SeccompError> {
    match ranges {
        [] => Err(SeccompError::Build("no range".into())),
        [(_, allow)] => {
            let ret = if *allow {
                libc::SECCOMP_RET_ALLOW
            } else {
                RET_EPERM
            };
            p.push(stmt(libc::BPF_RET | libc::BPF_K, ret));
            Ok(())
        }
        _ => {
            let (lower, upper) = ranges.split_at(ranges.len() / 2);
            let jt = u8::try_from(2 * lower.len() - 1)
                .map_err(|_| SeccompError::Build(format!("{} ranges", ranges.len())))?;
            p.push(sock_filter {
                code: (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16,
                jt,
                jf: 0,
                k: upper[0].0,
            });
            search(lower, p)?;
            search(upper, p)
        }
    }
}

/// What the second program refuses (EPERM) of the syscalls the first allows: clone with a
/// namespace flag, socket of AF_ALG or AF_VSOCK, a persona not listed. Everything else it
/// allows (the first program decides).
fn refused_arguments() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut rules = BTreeMap::new();
    // clone's flags are its first argument on x86_64 and aarch64 (s390 alone swaps them): a
    // rule per namespace flag, any one refuses.
    rules.insert(
        libc::SYS_clone,
        (0..64)
            .map(|bit| 1u64 << bit)
            .filter(|f| NS_FLAGS & f != 0)
            .map(|f| cond(0, SeccompCmpArgLen::Qword, SeccompCmpOp::MaskedEq(f), f))
            .collect::<Result<_, _>>()?,
    );
    // The kernel reads socket's family as an int.
    rules.insert(
        libc::SYS_socket,
        vec![
            cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, AF_ALG)?,
            cond(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, AF_VSOCK)?,
        ],
    );
    // One rule: the persona is none of those allowed.
    let not_listed = PERSONAS
        .iter()
        .map(|p| {
            SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *p)
                .map_err(|e| SeccompError::Build(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(
        libc::SYS_personality,
        vec![SeccompRule::new(not_listed).map_err(|e| SeccompError::Build(e.to_string()))?],
    );
    Ok(rules)
}

fn build(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(rules, mismatch, matched, arch()?)
        .map_err(|e| SeccompError::Build(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))
}

fn build_programs() -> Result<Vec<BpfProgram>, SeccompError> {
    let allow = allow_program(&allowed_numbers()?)?;
    let arguments = build(
        refused_arguments()?,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
    )?;
    let clone3: BTreeMap<i64, Vec<SeccompRule>> =
        [(libc::SYS_clone3, vec![])].into_iter().collect();
    let enosys = build(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )?;
    Ok(vec![allow, arguments, enosys])
}

/// The three programs, in the order they are installed: the allow list, the arguments'
/// refusals, clone3 -> ENOSYS. Built once per process.
pub fn programs() -> Result<&'static [BpfProgram], SeccompError> {
    static PROGRAMS: OnceLock<Result<Vec<BpfProgram>, SeccompError>> = OnceLock::new();
    match PROGRAMS.get_or_init(build_programs) {
        Ok(p) => Ok(p),
        Err(e) => Err(e.clone()),
    }
}

/// Installs the filters on this thread (inherited by everything it starts). Needs
/// no_new_privs or CAP_SYS_ADMIN in the thread's user namespace; sets no_new_privs itself
/// never (seccompiler's `apply_filter` would), so that a sandbox's setuid files still work.
pub fn install() -> Result<(), SeccompError> {
    for p in programs()? {
        let len = u16::try_from(p.len())
            .map_err(|_| SeccompError::Install(format!("a program of {} steps", p.len())))?;
        let prog = libc::sock_fprog {
            len,
            // seccompiler's `sock_filter` is `#[repr(C)]` with the kernel's fields (code, jt,
            // jf, k): the same layout as libc's. The kernel only reads it (copy_from_user).
            filter: p.as_ptr().cast::<libc::sock_filter>().cast_mut(),
        };
        // SAFETY: seccomp(SECCOMP_SET_MODE_FILTER, 0, &prog): `prog` points at `p`'s steps,
        // which live (in the static PROGRAMS) past the call; the kernel copies them.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                0 as libc::c_ulong,
                &prog as *const libc::sock_fprog,
            )
        };
        if rc != 0 {
            return Err(SeccompError::Install(
                std::io::Error::last_os_error().to_string(),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
