//! ringbell-verbs: ringbell NICs for unmodified libibverbs programs.
//!
//! Built as `libringbell_verbs.so` and loaded with `LD_PRELOAD`, the library adds ringbell
//! NICs (`rb0`, `rb1`, ...) to `ibv_get_device_list` beside the system's own devices. It
//! defines every exported libibverbs entry point that can receive a ringbell object:
//! ringbell objects are served here, over the `ringbell` driver; anything else is passed to
//! the system's libibverbs untouched. Contexts are laid out as libibverbs' `struct
//! verbs_context`, with `struct ibv_context_ops`, the extended verbs, `struct ibv_cq_ex`
//! and `struct ibv_qp_ex` filled in, so the header's static inline calls
//! (`ibv_post_send`, `ibv_poll_cq`, `ibv_post_srq_ops`, `ibv_start_poll`, `ibv_wr_*`, ...)
//! reach ringbell directly.
//!
//! Where the NICs come from:
//! - by default, an in-process emulated fabric of [`state::DEFAULT_NICS`] NICs with seed
//!   [`state::DEFAULT_SEED`] (`RINGBELL_NICS`, `RINGBELL_SEED` change them);
//! - with `RINGBELL_SERVE=DIR`, the NICs of a running `ringbell-emu serve --socket DIR`,
//!   so that separate processes reach each other.
//!
//! It also answers `stat(2)` and `access(2)` for the device nodes of its NICs when they do
//! not exist (`devnode`), as libraries such as UCX look for a device's node before using it.
//!
//! The C boundary lives in `entry` (exported functions) and `ops` (function tables):
//! pointer checks and layout conversion; the verbs themselves are safe Rust over the driver.

#[doc(hidden)]
pub mod abi;
mod ah;
mod cma;
#[doc(hidden)]
pub mod cma_abi;
mod cma_entry;
mod cq;
mod device;
mod devnode;
mod dm;
mod entry;
mod events;
mod flow;
mod mw;
mod ops;
mod pd;
mod qp;
mod real;
mod rsocket;
mod rsocket_entry;
#[doc(hidden)]
pub mod rsocket_wire;
mod srq;
pub mod state;
mod wq;
mod xrc;

pub use device::{FW_VER, VENDOR_ID, VENDOR_PART_ID};

/// The errno a driver error stands for, as rdma-core's providers report the same failure.
pub(crate) fn errno_of(e: &ringbell::Error) -> i32 {
    use ringbell::Error as E;
    if debug() {
        eprintln!("ringbell-verbs: {e}");
    }
    use ringbell_specs::cmd::CmdStatus as S;
    match e {
        E::Command { status, .. } => match status {
            S::BadOpcode => libc::EOPNOTSUPP,
            S::Exhausted => libc::ENOMEM,
            S::Busy => libc::EBUSY,
            S::DmaFault => libc::EFAULT,
            _ => libc::EINVAL,
        },
        E::QueueFull { .. } => libc::ENOMEM,
        E::BadAddress { .. } => libc::EFAULT,
        E::Memory(_) => libc::ENOMEM,
        E::InvalidState { .. } | E::InvalidArgument(_) | E::OutOfBounds { .. } => libc::EINVAL,
        E::Unsupported(_) => libc::EOPNOTSUPP,
        E::Port(_) => libc::EFAULT,
        _ => libc::EIO,
    }
}

/// Whether `RINGBELL_VERBS_DEBUG` asks for every refusal's reason on stderr.
pub(crate) fn debug() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("RINGBELL_VERBS_DEBUG").is_some_and(|v| v != "0"))
}

/// The calling thread's `errno`.
pub(crate) fn errno() -> i32 {
    // SAFETY: `__errno_location` returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() }
}

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Runs an entry point's body; a panic (a bug, never an input) becomes `fail` instead of
/// unwinding into C.
pub(crate) fn guard<R>(fail: R, f: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            set_errno(libc::EIO);
            fail
        }
    }
}
