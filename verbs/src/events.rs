//! Completion events and asynchronous events: read from the NIC's event queue, routed to
//! the completion channel of the CQ or the async queue of the object's context.
//!
//! Each channel and each context's `async_fd` is a semaphore eventfd whose count is the
//! number of events waiting, so a program can `poll()` it. On the in-process emulator
//! nothing moves unless a call into the library moves it: a blocking
//! `ibv_get_cq_event`/`ibv_get_async_event` steps the fabric while it waits.

use crate::abi;
use crate::cq::RbCq;
use crate::device::RbContext;
use crate::qp::RbQp;
use crate::srq::RbSrq;
use crate::state::State;
use ringbell::AsyncEvent;
use ringbell_specs::cqe::EventType;
use std::os::fd::AsRawFd;

/// A new semaphore eventfd.
pub(crate) fn new_eventfd() -> Result<i32, i32> {
    // SAFETY: plain syscall; the descriptor returned is owned by the caller.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EMFILE));
    }
    Ok(fd)
}

/// Adds one to an eventfd's count.
pub(crate) fn eventfd_give(fd: i32) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live array to a descriptor the library owns.
    unsafe { libc::write(fd, one.as_ptr() as *const _, 8) };
}

/// Takes one from an eventfd's count (which the caller knows is positive).
pub(crate) fn eventfd_take(fd: i32) {
    let mut v = [0u8; 8];
    // SAFETY: reads 8 bytes into a live array from a descriptor the library owns. The
    // count is positive (one per queued event), so a semaphore read does not block.
    unsafe { libc::read(fd, v.as_mut_ptr() as *mut _, 8) };
}

/// Whether descriptor `fd` is in non-blocking mode.
pub(crate) fn nonblocking(fd: i32) -> bool {
    // SAFETY: F_GETFL on a descriptor; no memory involved.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Reads every event NIC `nic` has raised and routes it.
pub(crate) fn pump(st: &mut State, nic: usize) {
    let Some(dev) = st.nics[nic].dev.clone() else {
        return;
    };
    while let Some(e) = dev.poll_event() {
        route(st, nic, &e);
    }
}

fn route(st: &mut State, nic: usize, e: &AsyncEvent) {
    let kind = e.kind;
    match kind {
        EventType::Completion => {
            let Some(&p) = st.cqs.get(&(nic, e.obj)) else {
                return;
            };
            // SAFETY: the map holds live ringbell CQs only (removed on destroy).
            let cq = unsafe { &mut *(p as *mut RbCq) };
            if cq.channel.is_null() {
                return;
            }
            // SAFETY: a channel with CQs is live.
            let ch = unsafe { &mut *cq.channel };
            ch.queue.push_back(cq);
            eventfd_give(ch.ch.fd);
        }
        EventType::CqError => {
            if let Some(&p) = st.cqs.get(&(nic, e.obj)) {
                // SAFETY: live CQ (see above).
                let cq = unsafe { &mut *(p as *mut RbCq) };
                let mut ev = abi::ibv_async_event {
                    event_type: abi::ibv_event_type_IBV_EVENT_CQ_ERR,
                    ..Default::default()
                };
                ev.element.cq = cq as *mut RbCq as *mut abi::ibv_cq;
                post(cq.ctx, ev);
            }
        }
        EventType::QpFatal
        | EventType::QpReqErr
        | EventType::QpAccessErr
        | EventType::SqDrained => {
            if let Some(&p) = st.qps.get(&(nic, e.obj)) {
                // SAFETY: the map holds live ringbell QPs only.
                let qp = unsafe { &mut *(p as *mut RbQp) };
                let t = match kind {
                    EventType::QpFatal => abi::ibv_event_type_IBV_EVENT_QP_FATAL,
                    EventType::QpReqErr => abi::ibv_event_type_IBV_EVENT_QP_REQ_ERR,
                    EventType::QpAccessErr => abi::ibv_event_type_IBV_EVENT_QP_ACCESS_ERR,
                    _ => abi::ibv_event_type_IBV_EVENT_SQ_DRAINED,
                };
                let mut ev = abi::ibv_async_event {
                    event_type: t,
                    ..Default::default()
                };
                ev.element.qp = qp as *mut RbQp as *mut abi::ibv_qp;
                post(qp.ctx, ev);
                if kind != EventType::SqDrained {
                    last_wqe_reached(qp);
                }
            }
        }
        EventType::SrqLimit => {
            if let Some(&p) = st.srqs.get(&(nic, e.obj)) {
                // SAFETY: the map holds live ringbell SRQs only.
                let srq = unsafe { &mut *(p as *mut RbSrq) };
                srq.limit = 0;
                let mut ev = abi::ibv_async_event {
                    event_type: abi::ibv_event_type_IBV_EVENT_SRQ_LIMIT_REACHED,
                    ..Default::default()
                };
                ev.element.srq = srq as *mut RbSrq as *mut abi::ibv_srq;
                post(srq.ctx, ev);
            }
        }
        // Command completions are the driver's; IOMMU faults and doorbell errors also
        // show as the error completion or QP event they cause.
        _ => {}
    }
}

/// A QP on an SRQ that enters ERR (a fatal error, or `ibv_modify_qp`) reports its last WQE
/// reached: it takes no more receives from the SRQ (IBTA's Last WQE Reached event).
pub(crate) fn last_wqe_reached(qp: &mut RbQp) {
    if qp.srq.is_null() {
        return;
    }
    let mut last = abi::ibv_async_event {
        event_type: abi::ibv_event_type_IBV_EVENT_QP_LAST_WQE_REACHED,
        ..Default::default()
    };
    last.element.qp = qp as *mut RbQp as *mut abi::ibv_qp;
    post(qp.ctx, last);
}

/// Queues an async event on a context and makes its `async_fd` readable.
fn post(ctx: *mut RbContext, ev: abi::ibv_async_event) {
    // SAFETY: an object's context outlives it.
    let c = unsafe { &mut *ctx };
    c.events.push_back(ev);
    eventfd_give(c.vctx.context.async_fd);
}

/// What a blocking wait does next.
#[derive(Clone, Copy)]
pub(crate) enum Wait {
    /// The device moved: look again.
    Moved,
    /// The in-process fabric is idle: nothing changes until another thread calls in.
    Idle,
    /// A served NIC: wait on its interrupt eventfd.
    Interrupt(i32),
}

/// Lets NIC `nic` move for a blocking wait: one fabric step in-process, the interrupt
/// descriptor of a served NIC.
pub(crate) fn wait_step(st: &mut State, nic: usize) -> Wait {
    let Some(dev) = st.nics[nic].dev.clone() else {
        return Wait::Idle;
    };
    if let Some(fd) = dev.port().interrupt_fd(0) {
        return Wait::Interrupt(fd.as_raw_fd());
    }
    if dev.progress() {
        Wait::Moved
    } else {
        Wait::Idle
    }
}

/// Waits outside the lock as `w` says, in the window `win` of the blocking call: up to
/// 10 ms for an interrupt (cleared when it fired), a millisecond when idle. `Err(EINTR)`
/// when a signal handler ended the wait and the call fails for it, as a `read(2)` of a
/// uverbs descriptor does ([`OnSignal::Restart`]).
pub(crate) fn idle(w: Wait, win: &SignalWindow) -> Result<(), i32> {
    let ms = std::time::Duration::from_millis;
    match w {
        Wait::Moved => Ok(()),
        Wait::Idle => win.nap(ms(1), OnSignal::Restart),
        Wait::Interrupt(fd) => {
            if win.wait_fd(fd, ms(10), OnSignal::Restart)? {
                take_interrupt(fd);
            }
            Ok(())
        }
    }
}

/// Clears a device's interrupt eventfd `fd` that a wait found readable.
pub(crate) fn take_interrupt(fd: i32) {
    let mut v = [0u8; 8];
    // SAFETY: reads 8 bytes into the local buffer; the eventfd is readable, so this does not
    // block (another waiter may have cleared it meanwhile: then it fails with EAGAIN if the
    // descriptor is non-blocking, and a device's interrupt eventfd lives as long as the
    // process).
    unsafe { libc::read(fd, v.as_mut_ptr() as *mut _, 8) };
}

/// How a blocking call of the library answers a signal handler that ran while it waited:
/// as the kernel answers for the system call it stands for (signal(7)).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum OnSignal {
    /// `read(2)` of a uverbs or rdma_cm descriptor (`ibv_get_cq_event`,
    /// `rdma_get_cm_event`) and the socket calls (`rrecv`, `rsend`, `raccept`,
    /// `rconnect`): restarted when the handler was installed with `SA_RESTART`, `EINTR`
    /// otherwise.
    Restart,
    /// `poll(2)` and `select(2)` (`rpoll`, `rselect`): `EINTR` whatever the handler's flags.
    Fail,
}

/// Signals a fault raises: never blocked (a fault while one is blocked kills the process),
/// and never what ends a sleep.
const SYNCHRONOUS: [i32; 7] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGILL,
    libc::SIGFPE,
    libc::SIGTRAP,
    libc::SIGABRT,
    libc::SIGSYS,
];

/// The signals of a blocking call of the library. While it is open, the thread's
/// asynchronous signals are blocked except inside the call's sleeps, which take them
/// atomically (`ppoll(2)` with the thread's own mask). A signal that comes while the call
/// looks for its event (under the library's lock) is so taken in the next sleep and ends
/// it, as it would end the system call the library stands for, instead of running between
/// a look and a sleep, unseen. Closing the window restores the mask.
pub(crate) struct SignalWindow {
    /// The thread's mask before the call.
    own: libc::sigset_t,
}

impl SignalWindow {
    pub(crate) fn open() -> SignalWindow {
        let mut block = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        let mut own = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigfillset initialises `block` (sigdelset only edits it); pthread_sigmask
        // reads it and writes the thread's previous mask into `own`, which it cannot fail to
        // do with SIG_BLOCK and valid pointers.
        unsafe {
            libc::sigfillset(block.as_mut_ptr());
            for s in SYNCHRONOUS {
                libc::sigdelset(block.as_mut_ptr(), s);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, block.as_ptr(), own.as_mut_ptr());
            SignalWindow {
                own: own.assume_init(),
            }
        }
    }

    /// Sleeps `d`, taking signals; `Err(EINTR)` when a handler ran and a call of kind `k`
    /// fails for it. Otherwise (the time passed, or the call restarts) the caller looks
    /// again.
    pub(crate) fn nap(&self, d: std::time::Duration, k: OnSignal) -> Result<(), i32> {
        self.ppoll(&mut [], d, k).map(|_| ())
    }

    /// Waits up to `d` for `fd` to be readable, taking signals: whether it is, or
    /// `Err(EINTR)` as [`SignalWindow::nap`].
    pub(crate) fn wait_fd(
        &self,
        fd: i32,
        d: std::time::Duration,
        k: OnSignal,
    ) -> Result<bool, i32> {
        let mut p = [libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        }];
        self.ppoll(&mut p, d, k)
    }

    fn ppoll(
        &self,
        fds: &mut [libc::pollfd],
        d: std::time::Duration,
        k: OnSignal,
    ) -> Result<bool, i32> {
        let ts = libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `fds` is a live array of `fds.len()` pollfds (none: a plain sleep), `ts`
        // and the thread's own mask are locals.
        let n = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, &self.own) };
        if n < 0 && crate::errno() == libc::EINTR {
            return match k {
                OnSignal::Restart if handlers_restart(&self.own) => Ok(false),
                _ => Err(libc::EINTR),
            };
        }
        Ok(n > 0)
    }
}

impl Drop for SignalWindow {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `open`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.own, std::ptr::null_mut()) };
    }
}

/// Whether every handler that could have run on a thread whose mask is `own` was installed
/// with `SA_RESTART`. The signal that ran is not known; the kernel restarts a `read(2)` only
/// for a handler with the flag, so one without it among those that could have run is taken
/// to be the one (a program that sets `SIGALRM` without `SA_RESTART` to end a blocking
/// wait, as qperf does, gets its `EINTR`). Signals a fault raises and those the thread
/// blocks are left out.
fn handlers_restart(own: &libc::sigset_t) -> bool {
    (1..=libc::SIGRTMAX())
        .filter(|s| !SYNCHRONOUS.contains(s) && *s != libc::SIGKILL && *s != libc::SIGSTOP)
        .all(|s| {
            // SAFETY: reads the caller's set.
            if unsafe { libc::sigismember(own, s) } == 1 {
                return true;
            }
            // SAFETY: a zeroed sigaction is valid for the kernel to overwrite.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: only reads the disposition of signal `s` into `old` (the new action is
            // null); glibc's own signals answer EINVAL and are passed over.
            if unsafe { libc::sigaction(s, std::ptr::null(), &mut old) } != 0 {
                return true;
            }
            old.sa_sigaction == libc::SIG_DFL
                || old.sa_sigaction == libc::SIG_IGN
                || old.sa_flags & libc::SA_RESTART != 0
        })
}
