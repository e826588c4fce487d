//! The seccomp filter of every sandbox: everything is allowed except what a sandbox never needs.
//!
//! Refused with EPERM: kernel modules, kexec, reboot, swap, accounting, the clock, the kernel
//! log, bpf, perf events, the key store, mounting (old and new mount API), pivot_root, namespace
//! changes (unshare, setns, clone with a namespace flag), handles that open files by inode
//! (open_by_handle_at), userfaultfd, raw I/O ports, quotactl, lookup_dcookie, personality
//! switches that disable ASLR are left to the kernel. clone3 answers ENOSYS, so that libcs fall
//! back to clone, whose flags a classic filter can read.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filter: {0}")]
    Build(String),
    #[error("seccomp install: {0}")]
    Install(String),
}

/// Syscalls refused outright.
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
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_quotactl,
    libc::SYS_lookup_dcookie,
    libc::SYS_vhangup,
    libc::SYS_nfsservctl,
];

const NS_FLAGS: [u64; 7] = [
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWCGROUP as u64,
];

fn arch() -> Result<TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e| SeccompError::Build(format!("{e:?}")))
}

fn build(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, action, arch()?)
        .map_err(|e| SeccompError::Build(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))
}

/// The two programs: the EPERM list and clone's flags; clone3 -> ENOSYS.
pub fn programs() -> Result<Vec<BpfProgram>, SeccompError> {
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|s| (*s, vec![])).collect();
    let mut clone_rules = Vec::new();
    for flag in NS_FLAGS {
        let cond = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )
        .map_err(|e| SeccompError::Build(e.to_string()))?;
        clone_rules
            .push(SeccompRule::new(vec![cond]).map_err(|e| SeccompError::Build(e.to_string()))?);
    }
    deny.insert(libc::SYS_clone, clone_rules);
    let eperm = build(deny, SeccompAction::Errno(libc::EPERM as u32))?;
    let clone3: BTreeMap<i64, Vec<SeccompRule>> =
        [(libc::SYS_clone3, vec![])].into_iter().collect();
    let enosys = build(clone3, SeccompAction::Errno(libc::ENOSYS as u32))?;
    Ok(vec![eperm, enosys])
}

/// Installs the filters on this thread (inherited by everything it starts). Needs
/// no_new_privs or CAP_SYS_ADMIN.
pub fn install() -> Result<(), SeccompError> {
    for p in programs()? {
        seccompiler::apply_filter(&p).map_err(|e| SeccompError::Install(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile() {
        let p = super::programs().unwrap();
        assert_eq!(p.len(), 2);
        assert!(p[0].len() > super::DENIED.len());
    }
}
