//! The C boundary of RDMA-CM ([`crate::cma`]): librdmacm's exported `rdma_*` functions.
//! Pointer checks, socket addresses and private data copied in, results copied out; the
//! logic is safe Rust in `cma`, under the library's lock.

use crate::abi;
use crate::cma::{self, Cma, ConnParam};
use crate::cma_abi::*;
use crate::events::{OnSignal, SignalWindow};
use crate::state::{lock, State};
use crate::{guard, set_errno};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

/// Runs `f` on the RDMA-CM state and the library's state, under the lock.
pub(crate) fn call<R>(fail: R, f: impl FnOnce(&mut Cma, &mut State) -> R) -> R {
    guard(fail, || {
        let mut st = lock();
        let mut c = std::mem::take(&mut st.cma);
        // The state goes back even if `f` panics (a bug), so that one failed call does not
        // forget every id and channel.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut c, &mut st)));
        // A channel's descriptor reads as ready exactly while it has events queued.
        for (fd, ready) in c.readiness() {
            set_ready(fd, ready);
        }
        st.cma = c;
        r.unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Makes channel descriptor `fd` (an eventfd the library made, holding 0 or 1) readable
/// or not.
fn set_ready(fd: i32, ready: bool) {
    let mut v = 1u64;
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: a channel's own eventfd (open while the channel lives, under the lock), a
    // local pollfd and eight bytes of a local. A write of 1 never blocks; the read is made
    // only when the descriptor is readable (a program that drained it itself would
    // otherwise block this call under the lock).
    unsafe {
        match ready {
            true => {
                libc::write(fd, (&v as *const u64).cast(), 8);
            }
            false => {
                if libc::poll(&mut p, 1, 0) == 1 {
                    libc::read(fd, (&mut v as *mut u64).cast(), 8);
                }
            }
        }
    };
}

/// Event channels programs made and have not destroyed.
static CHANNELS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How often the library's progress thread drives the NICs' CMs while a channel exists.
const PROGRESS_GAP: Duration = Duration::from_millis(1);

/// Starts, once, the thread that drives the NICs' CMs while any event channel exists, as
/// the kernel's rdma_cm does for librdmacm: events arrive, and channel descriptors become
/// readable, whether or not the program calls into the library (a program that sleeps in
/// `poll` or `epoll` on the descriptor is woken).
fn start_progress() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        // SAFETY: registers plain functions that only touch atomics as the fork handlers.
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_done), Some(fork_done)) };
        let spawned = std::thread::Builder::new()
            .name("ringbell-cm".into())
            .spawn(|| {
                // The program's signals are not for this thread: a process-directed one
                // (`alarm`) goes to a thread of the program, where it ends the blocking
                // call it was meant to end.
                let _blocked = SignalWindow::open();
                loop {
                    if CHANNELS.load(Relaxed) == 0 || !enter_pass() {
                        std::thread::sleep(PROGRESS_GAP * 10);
                        continue;
                    }
                    call((), |c, st| c.progress(st));
                    IN_PASS.store(false, SeqCst);
                    std::thread::sleep(PROGRESS_GAP);
                }
            });
        // Without the thread, events still arrive in the program's own calls.
        drop(spawned);
    });
}

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

/// A fork is under way: the progress thread takes no pass (so that it never holds the
/// library's lock in the parent at the fork, which would leave the child's copy locked).
static FORKING: AtomicBool = AtomicBool::new(false);
/// The progress thread is in a pass (or about to be).
static IN_PASS: AtomicBool = AtomicBool::new(false);

/// Whether the progress thread may take a pass now (then it is marked in one).
fn enter_pass() -> bool {
    IN_PASS.store(true, SeqCst);
    if FORKING.load(SeqCst) {
        IN_PASS.store(false, SeqCst);
        return false;
    }
    true
}

extern "C" fn fork_prepare() {
    FORKING.store(true, SeqCst);
    while IN_PASS.load(SeqCst) {
        std::thread::yield_now();
    }
}

extern "C" fn fork_done() {
    FORKING.store(false, SeqCst);
}

/// 0, or -1 with `errno`.
pub(crate) fn rc(r: Result<(), i32>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    }
}

/// How long a waiting call sleeps between two polls of the NICs.
pub(crate) const POLL_GAP: Duration = Duration::from_micros(100);

/// An IPv4 socket address from `p` (null: none). IPv4-mapped IPv6 addresses and the
/// unspecified IPv6 address are taken as their IPv4 forms; anything else is
/// EAFNOSUPPORT.
///
/// # Safety
/// `p` is null or points to a socket address of its family's size.
unsafe fn sockaddr_in(p: *const libc::sockaddr) -> Result<Option<SocketAddrV4>, i32> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: per the contract, at least the family is readable.
    let family = unsafe { (*p).sa_family } as c_int;
    match family {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a `sockaddr_in`.
            let s = unsafe { std::ptr::read_unaligned(p as *const libc::sockaddr_in) };
            Ok(Some(SocketAddrV4::new(
                Ipv4Addr::from(s.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a `sockaddr_in6`.
            let s = unsafe { std::ptr::read_unaligned(p as *const libc::sockaddr_in6) };
            let ip6 = std::net::Ipv6Addr::from(s.sin6_addr.s6_addr);
            let ip = match ip6.to_ipv4_mapped() {
                Some(v4) => v4,
                None if ip6.is_unspecified() => Ipv4Addr::UNSPECIFIED,
                None => return Err(libc::EAFNOSUPPORT),
            };
            Ok(Some(SocketAddrV4::new(ip, u16::from_be(s.sin6_port))))
        }
        _ => Err(libc::EAFNOSUPPORT),
    }
}

/// A copy of `*p` (null: none), its private data included.
///
/// # Safety
/// `p` is null or points to a `struct rdma_conn_param` whose `private_data` holds
/// `private_data_len` bytes when it is not null.
unsafe fn conn_param(p: *const rdma_conn_param) -> Option<ConnParam> {
    if p.is_null() {
        return None;
    }
    // SAFETY: per the contract.
    let c = unsafe { &*p };
    let private = match c.private_data.is_null() {
        true => Vec::new(),
        // SAFETY: per the contract, `private_data_len` bytes.
        false => unsafe {
            std::slice::from_raw_parts(c.private_data as *const u8, c.private_data_len as usize)
        }
        .to_vec(),
    };
    Some(ConnParam {
        private,
        responder_resources: c.responder_resources,
        initiator_depth: c.initiator_depth,
        retry_count: c.retry_count,
        rnr_retry_count: c.rnr_retry_count,
        qp_num: c.qp_num,
    })
}

/// Waits for the next event of synchronous id `id`; returns it handed out, with its kind
/// and status.
fn wait_of(id: usize) -> Result<(*mut rdma_cm_event, u32, i32), i32> {
    let win = SignalWindow::open();
    loop {
        let r = call(Err(libc::EIO), |c, st| {
            let e = c.next_event_of(st, id)?;
            Ok(e.and_then(|e| c.event_info(e as usize).map(|(k, s, _)| (e, k, s))))
        })?;
        if let Some(x) = r {
            return Ok(x);
        }
        win.nap(POLL_GAP, OnSignal::Restart)?;
    }
}

/// For a synchronous id: waits for the event a call queued and keeps it as the id's
/// `event` (acknowledging the one before), as librdmacm does, so that the program may read
/// it (`rdma_xclient` reads the accept's private data there). The call fails as the event's
/// status says: a reject is ECONNREFUSED, a negative status its errno, a positive one
/// itself.
fn complete_sync(id: usize) -> Result<(), i32> {
    if !call(false, |c, _| c.is_sync(id)) {
        return Ok(());
    }
    let (e, kind, status) = wait_of(id)?;
    call((), |c, _| {
        if c.is_id(id) {
            // SAFETY: a live id of this library, under the lock.
            let before = unsafe { (*(id as *mut rdma_cm_id)).event };
            if !before.is_null() {
                let _ = c.ack(before as usize);
            }
            c.set_current_event(id, e);
        }
    });
    match (kind, status) {
        (_, 0) => Ok(()),
        (RDMA_CM_EVENT_REJECTED, _) => Err(libc::ECONNREFUSED),
        (_, s) if s < 0 => Err(-s),
        (_, s) => Err(s),
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    // The descriptor reads as ready while events are queued: an eventfd holding 1 then, 0
    // otherwise (see `call`), in blocking mode unless the program sets O_NONBLOCK.
    // SAFETY: creating a descriptor.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return std::ptr::null_mut();
    }
    let ch = call(std::ptr::null_mut(), |c, _| c.create_channel(fd));
    if !ch.is_null() {
        CHANNELS.fetch_add(1, Relaxed);
        start_progress();
    }
    ch
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    if let Ok(fd) = call(Err(libc::EINVAL), |c, _| c.destroy_channel(ch as usize)) {
        CHANNELS.fetch_sub(1, Relaxed);
        if fd >= 0 {
            // SAFETY: the channel's own descriptor, closed once with it.
            unsafe { libc::close(fd) };
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    ch: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: u32,
) -> c_int {
    if id.is_null() {
        return rc(Err(libc::EINVAL));
    }
    let r = call(Err(libc::EIO), |c, _| {
        // Without a channel the id is synchronous: its calls wait for their events on a
        // channel of its own.
        let chan = match ch.is_null() {
            true => c.create_channel(-1) as usize,
            false => ch as usize,
        };
        let r = c.create_id(chan, context, ps);
        if r.is_err() && ch.is_null() {
            let _ = c.destroy_channel(chan);
        }
        r
    });
    match r {
        Ok(p) => {
            // SAFETY: checked non-null; the caller's out-parameter.
            unsafe { *id = p };
            0
        }
        Err(e) => rc(Err(e)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    rc(call(Err(libc::EIO), |c, st| c.destroy_id(st, id as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    // SAFETY: the caller's address.
    let a = match unsafe { sockaddr_in(addr) } {
        Ok(Some(a)) => a,
        Ok(None) => return rc(Err(libc::EINVAL)),
        Err(e) => return rc(Err(e)),
    };
    rc(call(Err(libc::EIO), |c, st| c.bind(st, id as usize, a)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    // SAFETY: the caller's addresses.
    let (s, d) = match unsafe { (sockaddr_in(src), sockaddr_in(dst)) } {
        (Ok(s), Ok(Some(d))) => (s, d),
        (Err(e), _) | (_, Err(e)) => return rc(Err(e)),
        _ => return rc(Err(libc::EINVAL)),
    };
    let r = call(Err(libc::EIO), |c, st| {
        c.resolve_addr(st, id as usize, s, d)
    });
    rc(r.and_then(|()| complete_sync(id as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    let r = call(Err(libc::EIO), |c, _| c.resolve_route(id as usize));
    rc(r.and_then(|()| complete_sync(id as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    rc(call(Err(libc::EIO), |c, st| {
        c.listen(st, id as usize, backlog)
    }))
}

/// The library's XRC domain of id `id`'s NIC (opened at the first need, kept) and the id's
/// context and QP type.
fn lib_xrcd(id: *mut rdma_cm_id) -> Result<(*mut abi::ibv_context, u32, *mut abi::ibv_xrcd), i32> {
    let (ctx, t, x) = call(None, |c, st| c.xrc_place(st, id as usize)).ok_or(libc::EINVAL)?;
    if !x.is_null() {
        return Ok((ctx, t, x));
    }
    let mut attr = abi::ibv_xrcd_init_attr {
        comp_mask: abi::ibv_xrcd_init_attr_mask_IBV_XRCD_INIT_ATTR_FD
            | abi::ibv_xrcd_init_attr_mask_IBV_XRCD_INIT_ATTR_OFLAGS,
        fd: -1,
        oflags: libc::O_CREAT,
    };
    // SAFETY: the id's context (a live ringbell context) and a local attribute block.
    let x = unsafe { crate::ops::open_xrcd(ctx, &mut attr) };
    if x.is_null() {
        return Err(libc::ENOMEM);
    }
    call((), |c, _| c.set_xrcd(id as usize, x));
    Ok((ctx, t, x))
}

/// `rdma_create_qp` with attributes `a` (copied): an XRC target is made in the library's
/// XRC domain (it has no PD or CQs) and adopted; any other QP is made by `Cma::create_qp`.
fn create_qp_any(
    id: *mut rdma_cm_id,
    pd: *mut abi::ibv_pd,
    a: &mut abi::ibv_qp_init_attr,
) -> Result<(), i32> {
    if a.qp_type != abi::ibv_qp_type_IBV_QPT_XRC_RECV {
        return call(Err(libc::EIO), |c, st| c.create_qp(st, id as usize, pd, a));
    }
    let has_qp = call(Err(libc::EINVAL), |c, _| match c.is_id(id as usize) {
        // SAFETY: a live id of this library, under the lock.
        true => Ok(!unsafe { (*id).qp }.is_null()),
        false => Err(libc::EINVAL),
    })?;
    let (ctx, t, xrcd) = lib_xrcd(id)?;
    if has_qp || t == abi::ibv_qp_type_IBV_QPT_UD {
        return Err(libc::EINVAL);
    }
    let mut ex = abi::ibv_qp_init_attr_ex {
        qp_context: a.qp_context,
        qp_type: abi::ibv_qp_type_IBV_QPT_XRC_RECV,
        comp_mask: abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_XRCD,
        xrcd,
        ..Default::default()
    };
    // SAFETY: the id's context and a local attribute block.
    let qp = unsafe { crate::ops::create_qp_ex(ctx, &mut ex) };
    if qp.is_null() {
        return Err(crate::errno());
    }
    a.cap = ex.cap;
    call(Err(libc::EIO), |c, st| {
        c.adopt_qp(st, id as usize, qp, a, std::ptr::null_mut(), Vec::new())
    })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut abi::ibv_pd,
    attr: *mut abi::ibv_qp_init_attr,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes, checked non-null; copied in, written back.
    let mut a = unsafe { std::ptr::read(attr) };
    let r = create_qp_any(id, pd, &mut a);
    if r.is_ok() {
        // SAFETY: as above.
        unsafe { std::ptr::write(attr, a) };
    }
    rc(r)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut abi::ibv_qp_init_attr_ex,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes, checked non-null.
    let x = unsafe { &mut *attr };
    // What a connected QP of ringbell takes beyond `ibv_qp_init_attr`: nothing.
    if x.comp_mask & !abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD != 0 {
        return rc(Err(libc::EOPNOTSUPP));
    }
    let mut a = abi::ibv_qp_init_attr {
        qp_context: x.qp_context,
        send_cq: x.send_cq,
        recv_cq: x.recv_cq,
        srq: x.srq,
        cap: x.cap,
        qp_type: x.qp_type,
        sq_sig_all: x.sq_sig_all,
    };
    let pd = match x.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD {
        0 => std::ptr::null_mut(),
        _ => x.pd,
    };
    let r = create_qp_any(id, pd, &mut a);
    if r.is_ok() {
        x.send_cq = a.send_cq;
        x.recv_cq = a.recv_cq;
        x.cap = a.cap;
    }
    rc(r)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    call((), |c, st| c.destroy_qp(st, id as usize, false));
}

#[no_mangle]
pub unsafe extern "C" fn rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    // SAFETY: the caller's parameters.
    let p = unsafe { conn_param(param) };
    let r = call(Err(libc::EIO), |c, st| c.connect(st, id as usize, p));
    rc(r.and_then(|()| complete_sync(id as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_establish(id: *mut rdma_cm_id) -> c_int {
    rc(call(Err(libc::EIO), |c, st| c.establish(st, id as usize)))
}

/// Acknowledges the request event a synchronous id still holds (`rdma_get_request`).
fn drop_current_event(id: *mut rdma_cm_id) {
    call((), |c, _| {
        if c.is_id(id as usize) {
            // SAFETY: a live id of this library, under the lock.
            let ev = unsafe { (*id).event };
            if !ev.is_null() {
                let _ = c.ack(ev as usize);
            }
        }
    });
}

#[no_mangle]
pub unsafe extern "C" fn rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    // SAFETY: the caller's parameters.
    let p = unsafe { conn_param(param) };
    let r = call(Err(libc::EIO), |c, st| c.accept(st, id as usize, p));
    if r.is_ok() {
        drop_current_event(id);
    }
    rc(r.and_then(|()| complete_sync(id as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    let private = match data.is_null() {
        true => Vec::new(),
        // SAFETY: the caller's `len` bytes.
        false => unsafe { std::slice::from_raw_parts(data as *const u8, len as usize) }.to_vec(),
    };
    let r = call(Err(libc::EIO), |c, st| c.reject(st, id as usize, &private));
    if r.is_ok() {
        drop_current_event(id);
    }
    rc(r)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut rdma_cm_id,
    data: *const c_void,
    len: u8,
) -> c_int {
    // SAFETY: as `rdma_reject`.
    unsafe { rdma_reject(id, data, len) }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    rc(call(Err(libc::EIO), |c, st| c.disconnect(st, id as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_notify(id: *mut rdma_cm_id, _event: c_int) -> c_int {
    // Connections are established by the RTU alone: nothing to notify.
    match call(false, |c, _| c.is_id(id as usize)) {
        true => 0,
        false => rc(Err(libc::EINVAL)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_cm_event(
    ch: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    if event.is_null() || ch.is_null() {
        return rc(Err(libc::EINVAL));
    }
    let mut waited = false;
    let win = SignalWindow::open();
    loop {
        // (The descriptor is read under the lock: another thread may destroy the channel
        // as soon as it is released.)
        let got = call(Err(libc::EIO), |c, st| {
            let e = c.next_event(st, ch as usize)?;
            Ok((e, c.channel_fd(ch as usize)))
        });
        let fd = match got {
            Ok((Some(e), _)) => {
                // SAFETY: checked non-null; the caller's out-parameter.
                unsafe { *event = e };
                return 0;
            }
            Ok((None, fd)) => fd,
            // The channel was destroyed while this call waited on it, or before it, by
            // another thread (rping's main thread destroys it while its event thread goes
            // on): the call blocks, as a read(2) on a descriptor another thread closes
            // does, instead of failing the thread that did nothing wrong; a signal ends it
            // as it ends that read (the call's window blocks signals outside its sleeps).
            Err(libc::EINVAL) if waited || call(false, |c, _| c.was_channel(ch as usize)) => loop {
                if let Err(e) = win.nap(Duration::from_secs(3600), OnSignal::Restart) {
                    return rc(Err(e));
                }
            },
            Err(e) => return rc(Err(e)),
        };
        waited = true;
        // SAFETY: querying a descriptor's flags (one closed meanwhile only fails).
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if fl >= 0 && fl & libc::O_NONBLOCK != 0 {
            return rc(Err(libc::EAGAIN));
        }
        // As a read(2) of the channel's descriptor: EINTR for a handler without SA_RESTART.
        if let Err(e) = win.nap(POLL_GAP, OnSignal::Restart) {
            return rc(Err(e));
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    rc(call(Err(libc::EIO), |c, _| c.ack(event as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_migrate_id(
    id: *mut rdma_cm_id,
    ch: *mut rdma_event_channel,
) -> c_int {
    rc(call(Err(libc::EIO), |c, _| {
        c.migrate(id as usize, ch as usize)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    _optlen: usize,
) -> c_int {
    if !call(false, |c, _| c.is_id(id as usize)) || optval.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // The options change nothing on the fabric (one traffic class, addresses per NIC,
    // the CM's own timeouts): accepted as the kernel accepts them.
    match (level, optname) {
        (RDMA_OPTION_ID, RDMA_OPTION_ID_TOS)
        | (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR)
        | (RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY)
        | (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT)
        | (RDMA_OPTION_IB, RDMA_OPTION_IB_PATH) => 0,
        _ => rc(Err(libc::ENOSYS)),
    }
}

/// The port of an id's address (network order).
fn port_of(id: *mut rdma_cm_id, src: bool) -> u16 {
    call(None, |c, _| c.addrs(id as usize))
        .map_or(0, |(s, d)| if src { s.port() } else { d.port() })
        .to_be()
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, true)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    port_of(id, false)
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut abi::ibv_context {
    let mut v = call(Vec::new(), |c, st| c.devices(st));
    if !num.is_null() {
        // SAFETY: the caller's out-parameter, checked non-null.
        unsafe { *num = v.len() as c_int };
    }
    v.push(std::ptr::null_mut());
    Box::into_raw(v.into_boxed_slice()) as *mut *mut abi::ibv_context
}

#[no_mangle]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut abi::ibv_context) {
    if list.is_null() {
        return;
    }
    let mut n = 0;
    // SAFETY: a list from `rdma_get_devices`, ended by a null entry.
    while !unsafe { *list.add(n) }.is_null() {
        n += 1;
    }
    // SAFETY: the boxed slice `rdma_get_devices` leaked, `n + 1` entries long.
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n + 1)) });
}

#[no_mangle]
pub unsafe extern "C" fn rdma_event_str(event: u32) -> *const c_char {
    cma::event_str(event).as_ptr()
}

/// An `rdma_addrinfo` with the addresses it points to.
#[repr(C)]
struct AddrInfo {
    ai: rdma_addrinfo,
    src: [u64; 16],
    dst: [u64; 16],
}

/// An IPv4 address named by `node` (numeric, or a host name the resolver knows).
fn lookup(node: &str) -> Option<Ipv4Addr> {
    if let Ok(ip) = node.parse::<Ipv4Addr>() {
        return Some(ip);
    }
    use std::net::ToSocketAddrs;
    (node, 0)
        .to_socket_addrs()
        .ok()?
        .find_map(|a| match a.ip() {
            std::net::IpAddr::V4(v4) => Some(v4),
            std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped(),
        })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    if res.is_null() || (node.is_null() && service.is_null()) {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: C strings of the caller, when not null.
    let text = |p: *const c_char| (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) });
    let node = text(node).map(|s| s.to_string_lossy().into_owned());
    let port = match text(service).map(|s| s.to_string_lossy().into_owned()) {
        None => 0,
        Some(s) => match s.parse::<u16>() {
            Ok(p) => p,
            Err(_) => return rc(Err(libc::EINVAL)),
        },
    };
    // SAFETY: the caller's hints, when not null.
    let h = (!hints.is_null()).then(|| unsafe { &*hints });
    let flags = h.map_or(0, |h| h.ai_flags);
    let passive = flags & RAI_PASSIVE != 0;
    let ip = match &node {
        Some(n) => match lookup(n) {
            Some(ip) => ip,
            None => return rc(Err(libc::EADDRNOTAVAIL)),
        },
        None => Ipv4Addr::UNSPECIFIED,
    };
    let addr = SocketAddrV4::new(ip, port);
    let mut b = Box::new(AddrInfo {
        ai: rdma_addrinfo {
            ai_flags: flags,
            ai_family: libc::AF_INET,
            ai_qp_type: h
                .map(|h| h.ai_qp_type)
                .filter(|&t| t != 0)
                .unwrap_or(abi::ibv_qp_type_IBV_QPT_RC as c_int),
            ai_port_space: h
                .map(|h| h.ai_port_space)
                .filter(|&t| t != 0)
                .unwrap_or(RDMA_PS_TCP as c_int),
            ai_src_len: 0,
            ai_dst_len: 0,
            ai_src_addr: std::ptr::null_mut(),
            ai_dst_addr: std::ptr::null_mut(),
            ai_src_canonname: std::ptr::null_mut(),
            ai_dst_canonname: std::ptr::null_mut(),
            ai_route_len: 0,
            ai_route: std::ptr::null_mut(),
            ai_connect_len: 0,
            ai_connect: std::ptr::null_mut(),
            ai_next: std::ptr::null_mut(),
        },
        src: cma::sockaddr_of(addr),
        dst: cma::sockaddr_of(addr),
    });
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    if passive {
        b.ai.ai_src_addr = b.src.as_mut_ptr() as *mut libc::sockaddr;
        b.ai.ai_src_len = len;
    } else {
        b.ai.ai_dst_addr = b.dst.as_mut_ptr() as *mut libc::sockaddr;
        b.ai.ai_dst_len = len;
    }
    // SAFETY: checked non-null; the caller's out-parameter.
    unsafe { *res = Box::into_raw(b) as *mut rdma_addrinfo };
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut p = res;
    while !p.is_null() {
        // SAFETY: every entry came from `rdma_getaddrinfo`'s `Box<AddrInfo>` (its first
        // member), freed once here.
        let b = unsafe { Box::from_raw(p as *mut AddrInfo) };
        p = b.ai.ai_next;
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut abi::ibv_pd,
    qp_init_attr: *mut abi::ibv_qp_init_attr,
) -> c_int {
    if id.is_null() || res.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's address information, checked non-null.
    let r = unsafe { &*res };
    // SAFETY: its addresses, when not null.
    let (src, dst) = match unsafe { (sockaddr_in(r.ai_src_addr), sockaddr_in(r.ai_dst_addr)) } {
        (Ok(s), Ok(d)) => (s, d),
        (Err(e), _) | (_, Err(e)) => return rc(Err(e)),
    };
    let ps = match r.ai_port_space {
        0 => RDMA_PS_TCP,
        p => p as u32,
    };
    let mut p: *mut rdma_cm_id = std::ptr::null_mut();
    // SAFETY: a synchronous id into a local.
    if unsafe { rdma_create_id(std::ptr::null_mut(), &mut p, std::ptr::null_mut(), ps) } != 0 {
        return -1;
    }
    // The id's QP type is the address information's (librdmacm's rdma_create_id2).
    if r.ai_qp_type != 0 {
        if let Err(e) = call(Err(libc::EIO), |c, _| {
            c.set_qp_type(p as usize, r.ai_qp_type as u32)
        }) {
            call((), |c, st| {
                let _ = c.destroy_id(st, p as usize);
            });
            return rc(Err(e));
        }
    }
    let attr = (!qp_init_attr.is_null()).then(|| {
        // SAFETY: the caller's attributes, checked non-null.
        let mut a = unsafe { std::ptr::read(qp_init_attr) };
        // The QP's type is the address information's, as librdmacm sets it.
        if r.ai_qp_type != 0 {
            a.qp_type = r.ai_qp_type as u32;
        }
        a
    });
    let made = if r.ai_flags & RAI_PASSIVE != 0 {
        let bind = src.unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
        call(Err(libc::EIO), |c, st| {
            c.bind(st, p as usize, bind)?;
            if let Some(a) = attr {
                c.set_ep_qp(p as usize, a);
            }
            Ok(())
        })
        .map(|()| {
            if !pd.is_null() {
                // SAFETY: the id just made, under no other thread's eyes yet.
                unsafe { (*p).pd = pd };
            }
        })
    } else {
        match dst {
            None => Err(libc::EINVAL),
            Some(d) => call(Err(libc::EIO), |c, st| {
                c.resolve_addr(st, p as usize, src, d)
            })
            .and_then(|()| complete_sync(p as usize))
            .and_then(|()| call(Err(libc::EIO), |c, _| c.resolve_route(p as usize)))
            .and_then(|()| complete_sync(p as usize))
            .and_then(|()| match attr {
                None => Ok(()),
                Some(mut a) => {
                    let r = create_qp_any(p, pd, &mut a);
                    if r.is_ok() {
                        // SAFETY: the caller's attributes, written back.
                        unsafe { std::ptr::write(qp_init_attr, a) };
                    }
                    r
                }
            }),
        }
    };
    match made {
        Ok(()) => {
            // SAFETY: checked non-null; the caller's out-parameter.
            unsafe { *id = p };
            0
        }
        Err(e) => {
            call((), |c, st| {
                let _ = c.destroy_id(st, p as usize);
            });
            rc(Err(e))
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    // Its QP, CQs and SRQ go with it, as librdmacm's rdma_destroy_ep takes them.
    // SAFETY: the caller's id (checked inside).
    unsafe { rdma_destroy_srq(id) };
    call((), |c, st| {
        let _ = c.destroy_id(st, id as usize);
    });
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut rdma_cm_id,
    id: *mut *mut rdma_cm_id,
) -> c_int {
    if id.is_null() || !call(false, |c, _| c.is_sync(listen as usize)) {
        return rc(Err(libc::EINVAL));
    }
    let (e, kind, status) = match wait_of(listen as usize) {
        Ok(x) => x,
        Err(err) => return rc(Err(err)),
    };
    if kind != RDMA_CM_EVENT_CONNECT_REQUEST {
        call((), |c, _| {
            let _ = c.ack(e as usize);
        });
        return rc(Err(if status < 0 {
            -status
        } else {
            libc::ECONNABORTED
        }));
    }
    // SAFETY: an event just handed out (alive until acknowledged).
    let child = unsafe { (*e).id };
    let saved = call(None, |c, _| {
        c.set_current_event(child as usize, e);
        // SAFETY: a live listening id of this library (it is synchronous), under the lock.
        c.ep_qp(listen as usize)
            .map(|a| (a, unsafe { (*listen).pd }))
    });
    let r = match saved {
        None => Ok(()),
        Some((mut a, pd)) => {
            // The listening endpoint's type (an XRC target included) goes to the new id.
            let _ = call(Err(libc::EIO), |c, _| {
                c.set_qp_type(child as usize, a.qp_type)
            });
            create_qp_any(child, pd, &mut a)
        }
    };
    match r {
        Ok(()) => {
            // SAFETY: checked non-null; the caller's out-parameter.
            unsafe { *id = child };
            0
        }
        Err(err) => {
            // SAFETY: the request's id, refused and destroyed.
            unsafe {
                rdma_reject(child, std::ptr::null(), 0);
                rdma_destroy_id(child);
            }
            rc(Err(err))
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    attr: *mut abi::ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    if attr.is_null() || mask.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes, checked non-null: the state asked for is read.
    let state = unsafe { (*attr).qp_state };
    match call(Err(libc::EIO), |c, _| c.init_qp_attr(id as usize, state)) {
        Ok((a, m)) => {
            // SAFETY: as above; the attributes and mask are written.
            unsafe {
                *attr = a;
                *mask = m as c_int;
            }
            0
        }
        Err(e) => rc(Err(e)),
    }
}

/// The IPv4 group a join or leave names.
///
/// # Safety
/// As [`sockaddr_in`].
unsafe fn group_of(addr: *const libc::sockaddr) -> Result<Ipv4Addr, i32> {
    // SAFETY: per the contract.
    match unsafe { sockaddr_in(addr) }? {
        Some(a) => Ok(*a.ip()),
        None => Err(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: the caller's address.
    let g = match unsafe { group_of(addr) } {
        Ok(g) => g,
        Err(e) => return rc(Err(e)),
    };
    rc(call(Err(libc::EIO), |c, st| {
        c.join(st, id as usize, g, context)
    }))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_join_multicast_ex(
    id: *mut rdma_cm_id,
    attr: *mut c_void,
    context: *mut c_void,
) -> c_int {
    // struct rdma_cm_join_mc_attr_ex: comp_mask (u32), join_flags (u32), addr (pointer).
    #[repr(C)]
    struct JoinEx {
        comp_mask: u32,
        join_flags: u32,
        addr: *mut libc::sockaddr,
    }
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes, checked non-null.
    let a = unsafe { std::ptr::read(attr as *const JoinEx) };
    const ADDRESS: u32 = 1;
    const JOIN_FLAGS: u32 = 2;
    if a.comp_mask & !(ADDRESS | JOIN_FLAGS) != 0 || a.comp_mask & ADDRESS == 0 {
        return rc(Err(libc::EINVAL));
    }
    // Full members only (RDMA_MC_JOIN_FLAG_FULLMEMBER): a send-only join would still
    // receive here.
    if a.comp_mask & JOIN_FLAGS != 0 && a.join_flags != 0 {
        return rc(Err(libc::EOPNOTSUPP));
    }
    // SAFETY: as `rdma_join_multicast`.
    unsafe { rdma_join_multicast(id, a.addr, context) }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_leave_multicast(
    id: *mut rdma_cm_id,
    addr: *mut libc::sockaddr,
) -> c_int {
    // SAFETY: the caller's address.
    let g = match unsafe { group_of(addr) } {
        Ok(g) => g,
        Err(e) => return rc(Err(e)),
    };
    rc(call(Err(libc::EIO), |c, st| c.leave(st, id as usize, g)))
}

/// The (context, PD) an id's SRQ is made on: the id's NIC and `pd`, or the id's PD.
fn srq_place(
    id: *mut rdma_cm_id,
    pd: *mut abi::ibv_pd,
) -> Result<(*mut abi::ibv_context, *mut abi::ibv_pd), i32> {
    call(Err(libc::EIO), |c, _| {
        if !c.is_id(id as usize) {
            return Err(libc::EINVAL);
        }
        // SAFETY: a live id of this library, under the lock.
        let i = unsafe { &*id };
        if i.verbs.is_null() || !i.srq.is_null() {
            return Err(libc::EINVAL);
        }
        Ok((i.verbs, if pd.is_null() { i.pd } else { pd }))
    })
}

/// Records `srq` as id `id`'s (and its PD, if the id had none), as librdmacm does.
fn set_srq(id: *mut rdma_cm_id, srq: *mut abi::ibv_srq, pd: *mut abi::ibv_pd) {
    call((), |c, _| {
        if c.is_id(id as usize) {
            // SAFETY: a live id of this library, under the lock.
            let i = unsafe { &mut *id };
            i.srq = srq;
            if i.pd.is_null() {
                i.pd = pd;
            }
        }
    });
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut abi::ibv_pd,
    attr: *mut abi::ibv_srq_init_attr,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes, checked non-null.
    let a = unsafe { &*attr };
    // An XRC target's id gets an XRC SRQ, any other a basic one (librdmacm's choice).
    let xrc = call(false, |c, _| {
        // SAFETY: a live id of this library, under the lock.
        c.is_id(id as usize) && unsafe { (*id).qp_type } == abi::ibv_qp_type_IBV_QPT_XRC_RECV
    });
    let mut ex = abi::ibv_srq_init_attr_ex {
        srq_context: a.srq_context,
        attr: a.attr,
        comp_mask: abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_TYPE
            | abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_PD,
        srq_type: if xrc {
            abi::ibv_srq_type_IBV_SRQT_XRC
        } else {
            abi::ibv_srq_type_IBV_SRQT_BASIC
        },
        pd,
        ..Default::default()
    };
    // SAFETY: a local attribute block.
    let r = unsafe { rdma_create_srq_ex(id, &mut ex) };
    if r == 0 {
        // SAFETY: the caller's attributes: the limits the SRQ has.
        unsafe { (*attr).attr = ex.attr };
    }
    r
}

/// An XRC SRQ's domain and CQ for id `id` (the library's XRC domain; the id's receive CQ,
/// or one made for it with a completion channel, as librdmacm makes it).
fn xrc_srq_parts(
    id: *mut rdma_cm_id,
    depth: u32,
) -> Result<(*mut abi::ibv_xrcd, *mut abi::ibv_cq), i32> {
    let (ctx, _, xrcd) = lib_xrcd(id)?;
    let cq = call(std::ptr::null_mut(), |c, _| match c.is_id(id as usize) {
        // SAFETY: a live id of this library, read under the lock.
        true => unsafe { (*id).recv_cq },
        false => std::ptr::null_mut(),
    });
    if !cq.is_null() {
        return Ok((xrcd, cq));
    }
    // SAFETY: the id's context.
    let ch = unsafe { crate::entry::ibv_create_comp_channel(ctx) };
    if ch.is_null() {
        return Err(crate::errno());
    }
    // SAFETY: as above; the id is the CQ's context, as for the id's other CQs.
    let cq = unsafe {
        crate::entry::ibv_create_cq(ctx, depth.max(1) as c_int, id as *mut c_void, ch, 0)
    };
    if cq.is_null() {
        let e = crate::errno();
        // SAFETY: the channel just made.
        unsafe { crate::entry::ibv_destroy_comp_channel(ch) };
        return Err(e);
    }
    call((), |c, _| c.add_made(id as usize, cq, ch));
    Ok((xrcd, cq))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut abi::ibv_srq_init_attr_ex,
) -> c_int {
    if attr.is_null() {
        return rc(Err(libc::EINVAL));
    }
    // SAFETY: the caller's attributes, checked non-null.
    let a = unsafe { &mut *attr };
    // librdmacm asks for the type.
    if a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_TYPE == 0 {
        return rc(Err(libc::EINVAL));
    }
    let given = match a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_PD {
        0 => std::ptr::null_mut(),
        _ => a.pd,
    };
    let (ctx, pd) = match srq_place(id, given) {
        Ok(x) => x,
        Err(e) => return rc(Err(e)),
    };
    a.pd = pd;
    a.comp_mask |= abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_PD;
    if a.srq_type == abi::ibv_srq_type_IBV_SRQT_XRC {
        // The library's XRC domain and a CQ, unless the caller gave them.
        let need_x = a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_XRCD == 0
            || a.xrcd.is_null();
        let need_cq =
            a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_CQ == 0 || a.cq.is_null();
        if need_x || need_cq {
            match xrc_srq_parts(id, a.attr.max_wr) {
                Ok((x, cq)) => {
                    if need_x {
                        a.xrcd = x;
                    }
                    if need_cq {
                        a.cq = cq;
                    }
                }
                Err(e) => return rc(Err(e)),
            }
        }
        a.comp_mask |= abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_XRCD
            | abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_CQ;
    }
    // SAFETY: the id's context and the caller's attributes.
    let srq = unsafe { crate::ops::create_srq_ex(ctx, attr) };
    if srq.is_null() {
        return -1;
    }
    set_srq(id, srq, pd);
    0
}

#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_srq(id: *mut rdma_cm_id) {
    let srq = call(std::ptr::null_mut(), |c, _| {
        if !c.is_id(id as usize) {
            return std::ptr::null_mut();
        }
        // SAFETY: a live id of this library, under the lock.
        std::mem::replace(unsafe { &mut (*id).srq }, std::ptr::null_mut())
    });
    if !srq.is_null() {
        // SAFETY: the SRQ the id held.
        unsafe { crate::entry::ibv_destroy_srq(srq) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn rdma_set_local_ece(
    _id: *mut rdma_cm_id,
    _ece: *mut abi::ibv_ece,
) -> c_int {
    // Enhanced connection establishment: the NICs offer no options to negotiate.
    rc(Err(libc::EOPNOTSUPP))
}

#[no_mangle]
pub unsafe extern "C" fn rdma_get_remote_ece(
    _id: *mut rdma_cm_id,
    _ece: *mut abi::ibv_ece,
) -> c_int {
    rc(Err(libc::EOPNOTSUPP))
}
