//! Ctrl-C (SIGINT) and SIGTERM (what schedulers and `docker stop` send): the handler only
//! records which signal arrived; the step loop then checkpoints and stops, and the
//! `composer-rl` process exits 130 (SIGINT) or 143 (SIGTERM).

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal that asked the run to stop (0: none yet).
static PENDING: AtomicI32 = AtomicI32::new(0);

/// Which signal interrupted a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interrupt {
    /// Ctrl-C.
    Sigint,
    /// SIGTERM (schedulers, `docker stop`, `kill`).
    Sigterm,
}

impl Interrupt {
    /// The shell's exit status for a process stopped by this signal: 128 + signal number.
    pub fn exit_code(self) -> u8 {
        match self {
            Interrupt::Sigint => 130,
            Interrupt::Sigterm => 143,
        }
    }

    /// The signal's name.
    pub fn name(self) -> &'static str {
        match self {
            Interrupt::Sigint => "SIGINT",
            Interrupt::Sigterm => "SIGTERM",
        }
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    // The first signal wins: a SIGTERM after a Ctrl-C still reports the Ctrl-C.
    let _ = PENDING.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
}

/// Installs the SIGINT and SIGTERM handlers and forgets a signal of an earlier run in this
/// process (library use, tests).
pub fn install() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only does an atomic compare-exchange, which is async-signal-safe.
        let _ = unsafe { sigaction(sig, &action) };
    }
    PENDING.store(0, Ordering::SeqCst);
}

/// The signal that asked the run to stop, if one did.
pub fn pending() -> Option<Interrupt> {
    match PENDING.load(Ordering::SeqCst) {
        libc::SIGINT => Some(Interrupt::Sigint),
        libc::SIGTERM => Some(Interrupt::Sigterm),
        _ => None,
    }
}

/// Raises `sig` in this process (the test hooks: the real signal path, handler included).
pub(crate) fn raise(sig: Interrupt) {
    let n = match sig {
        Interrupt::Sigint => libc::SIGINT,
        Interrupt::Sigterm => libc::SIGTERM,
    };
    // SAFETY: raising a signal whose handler (installed by `install`) only stores an atomic.
    unsafe {
        libc::raise(n);
    }
}
