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

/// Waits outside the lock as `w` says: up to 10 ms for an interrupt (cleared when it
/// fired), a millisecond when idle.
pub(crate) fn idle(w: Wait) {
    match w {
        Wait::Moved => {}
        Wait::Idle => std::thread::sleep(std::time::Duration::from_millis(1)),
        Wait::Interrupt(fd) => {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd; `fd` is the device's interrupt eventfd, which lives
            // as long as the device, i.e. the process.
            let n = unsafe { libc::poll(&mut pfd, 1, 10) };
            if n > 0 {
                let mut v = [0u8; 8];
                // SAFETY: clears the eventfd's counter (non-blocking: it is readable).
                unsafe { libc::read(fd, v.as_mut_ptr() as *mut _, 8) };
            }
        }
    }
}
