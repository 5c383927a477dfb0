//! A seccomp deny-list for the sandboxed command (x86_64 only): system calls that widen the
//! kernel surface or reach other processes fail with EPERM — new namespaces (`unshare`,
//! `setns`, namespace flags of `clone`), mounts, `ptrace` and cross-process memory access,
//! keyrings, `bpf`, `perf_event_open`, `userfaultfd`, io_uring, module and kexec loading.
//! `clone3` fails with ENOSYS so that libc falls back to `clone`, whose flags the filter can
//! inspect. `socket` and `socketpair` work only for AF_UNIX, AF_INET and AF_INET6; every other
//! address family (AF_NETLINK, AF_PACKET, AF_VSOCK, AF_ALG, AF_BLUETOOTH, ...: kernel code
//! no sandboxed program needs, some of it reaching past the network namespace, such as vsock
//! to the hypervisor) fails with EAFNOSUPPORT, as on a kernel built without it. Other
//! architectures and ABIs (x32, i386 entry points) are refused outright.
//! Installed with `PR_SET_NO_NEW_PRIVS` right before `exec`, best effort: where the kernel
//! refuses, the run goes on without it ([`crate::Capabilities::seccomp`] says which).

/// The filter program, or empty where this architecture has none.
pub(crate) fn filter() -> Vec<libc::sock_filter> {
    #[cfg(target_arch = "x86_64")]
    {
        build()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Vec::new()
    }
}

#[cfg(target_arch = "x86_64")]
fn build() -> Vec<libc::sock_filter> {
    // BPF_LD | BPF_W | BPF_ABS (the first two are 0).
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x05 | 0x10;
    const JGE_K: u16 = 0x05 | 0x30;
    const JSET_K: u16 = 0x05 | 0x40;
    const RET_K: u16 = 0x06;
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const X32_BIT: u32 = 0x4000_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_KILL_PROCESS: u32 = 0x8000_0000;
    // clone's namespace flags (CLONE_NEWTIME shares its bit with the exit signal there).
    const NS_FLAGS: u32 = 0x0002_0000
        | 0x0200_0000
        | 0x0400_0000
        | 0x0800_0000
        | 0x1000_0000
        | 0x2000_0000
        | 0x4000_0000;
    let denied: &[libc::c_long] = &[
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_fanotify_init,
        libc::SYS_open_tree,
        libc::SYS_move_mount,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_mount_setattr,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_syslog,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_iopl,
        libc::SYS_ioperm,
    ];
    #[derive(Clone, Copy)]
    enum To {
        Next,
        Allow,
        Eperm,
        Enosys,
        Eafnosupport,
        Kill,
        /// The check of `socket`'s address family below.
        SocketFamily,
    }
    // The address families `socket` and `socketpair` may use.
    const ALLOWED_FAMILIES: [u32; 3] = [
        libc::AF_UNIX as u32,
        libc::AF_INET as u32,
        libc::AF_INET6 as u32,
    ];
    let mut prog: Vec<(u16, u32, To, To)> = Vec::new();
    let stmt = |code: u16, k: u32| (code, k, To::Next, To::Next);
    prog.push(stmt(LD_W_ABS, 4)); // arch
    prog.push((JEQ_K, AUDIT_ARCH_X86_64, To::Next, To::Kill));
    prog.push(stmt(LD_W_ABS, 0)); // syscall number
    prog.push((JGE_K, X32_BIT, To::Eperm, To::Next));
    for &nr in denied {
        prog.push((JEQ_K, nr as u32, To::Eperm, To::Next));
    }
    prog.push((JEQ_K, libc::SYS_clone3 as u32, To::Enosys, To::Next));
    prog.push((JEQ_K, libc::SYS_socket as u32, To::SocketFamily, To::Next));
    prog.push((
        JEQ_K,
        libc::SYS_socketpair as u32,
        To::SocketFamily,
        To::Next,
    ));
    prog.push((JEQ_K, libc::SYS_clone as u32, To::Next, To::Allow));
    prog.push(stmt(LD_W_ABS, 16)); // low 32 bits of clone's flags
    prog.push((JSET_K, NS_FLAGS, To::Eperm, To::Allow));
    // The family: the first argument, an int (the kernel ignores the upper 32 bits).
    let socket_family = prog.len();
    prog.push(stmt(LD_W_ABS, 16));
    for (i, family) in ALLOWED_FAMILIES.iter().enumerate() {
        let miss = if i + 1 == ALLOWED_FAMILIES.len() {
            To::Eafnosupport
        } else {
            To::Next
        };
        prog.push((JEQ_K, *family, To::Allow, miss));
    }
    let allow = prog.len();
    let eperm = allow + 1;
    let enosys = allow + 2;
    let eafnosupport = allow + 3;
    let kill = allow + 4;
    let mut out: Vec<libc::sock_filter> = Vec::with_capacity(prog.len() + 5);
    for (i, (code, k, jt, jf)) in prog.into_iter().enumerate() {
        let off = |t: To| -> u8 {
            let target = match t {
                To::Next => i + 1,
                To::Allow => allow,
                To::Eperm => eperm,
                To::Enosys => enosys,
                To::Eafnosupport => eafnosupport,
                To::Kill => kill,
                To::SocketFamily => socket_family,
            };
            (target - i - 1) as u8
        };
        out.push(libc::sock_filter {
            code,
            jt: off(jt),
            jf: off(jf),
            k,
        });
    }
    let ret = |k: u32| libc::sock_filter {
        code: RET_K,
        jt: 0,
        jf: 0,
        k,
    };
    out.push(ret(RET_ALLOW));
    out.push(ret(RET_ERRNO | libc::EPERM as u32));
    out.push(ret(RET_ERRNO | libc::ENOSYS as u32));
    out.push(ret(RET_ERRNO | libc::EAFNOSUPPORT as u32));
    out.push(ret(RET_KILL_PROCESS));
    out
}

/// Installs `prog` on the calling thread (after fork, before exec: async-signal-safe).
/// Returns false where the kernel refused (the run goes on without the filter).
///
/// # Safety
/// Only to be called in the forked child; `prog` must outlive the call.
pub(crate) unsafe fn install(prog: &[libc::sock_filter]) -> bool {
    if prog.is_empty() || prog.len() > u16::MAX as usize {
        return false;
    }
    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
        return false;
    }
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    libc::syscall(
        libc::SYS_seccomp,
        1 as libc::c_ulong, // SECCOMP_SET_MODE_FILTER
        0 as libc::c_ulong,
        &fprog as *const libc::sock_fprog,
    ) == 0
}
