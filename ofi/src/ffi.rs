//! The C entry points of the provider's objects: they check every pointer against the
//! registry of live objects ([`prov::State::check`]), copy what libfabric passes into plain
//! values, and call the safe logic in [`prov`]. A pointer that is not a live object of the
//! expected kind gives `-FI_EINVAL`; a panic gives `-FI_EOTHER`.

use crate::abi;
use crate::prov::{self, Errno, Kind, Obj, State};
use std::ffi::{c_char, c_int, c_void};

fn neg(e: Errno) -> c_int {
    -(e as c_int)
}

/// Runs `f` under the lock, turning an error into its negated number and a panic into
/// `-FI_EOTHER`.
pub(crate) fn run(f: impl FnOnce(&mut State) -> Result<c_int, Errno>) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut st = prov::state();
        f(&mut st).unwrap_or_else(neg)
    }))
    .unwrap_or(neg(abi::FI_EOTHER))
}

/// As [`run`], for calls that return `ssize_t`.
fn run_s(f: impl FnOnce(&mut State) -> Result<isize, Errno>) -> isize {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut st = prov::state();
        f(&mut st).unwrap_or_else(|e| -(e as isize))
    }))
    .unwrap_or(-(abi::FI_EOTHER as isize))
}

/// [`publish`]es a new object opened in `parent` (its domain or fabric), which then may
/// not close before it.
fn adopt<T>(st: &mut State, fid: T, obj: Obj, parent: usize) -> *mut T {
    let p = publish(st, fid, obj);
    st.parents.insert(p as usize, parent);
    p
}

/// Publishes a new object: its `fid_*` structure boxed, registered under its address.
fn publish<T>(st: &mut State, fid: T, obj: Obj) -> *mut T {
    let p = Box::into_raw(Box::new(fid));
    st.objs.insert(p as usize, obj);
    p
}

/// Before an endpoint closes: progress until what it was asked to send has gone out and
/// completed, for at most [`prov::LINGER`] (a program may post a send and close without
/// reading its completion; the message must still reach its peer, as on a NIC that sends it
/// at once, rather than die with its connection still being made). The lock is released
/// between rounds, so other threads (a receiver in the same process) go on meanwhile.
fn linger(key: usize) {
    let start = std::time::Instant::now();
    while start.elapsed() < prov::LINGER {
        let busy = run(|st| {
            if st.check(key, Kind::Ep).is_err() || st.in_use(key) {
                return Ok(0);
            }
            st.progress();
            Ok(c_int::from(st.tx_busy(key)))
        });
        if busy != 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

/// Frees the box of a registered object of kind `k` at `key` (just removed from the registry).
fn free_box(key: usize, k: Kind) {
    // SAFETY: `key` was registered by `publish` with a box of the type `k` names, and has
    // just been removed from the registry, so nothing reaches it any more.
    unsafe {
        match k {
            Kind::Fabric => drop(Box::from_raw(key as *mut abi::fid_fabric)),
            Kind::Eq => drop(Box::from_raw(key as *mut abi::fid_eq)),
            Kind::Pep => drop(Box::from_raw(key as *mut abi::fid_pep)),
            Kind::ConnReq => drop(Box::from_raw(key as *mut abi::fid)),
            Kind::Domain => drop(Box::from_raw(key as *mut abi::fid_domain)),
            Kind::Cq => drop(Box::from_raw(key as *mut abi::fid_cq)),
            Kind::Av => drop(Box::from_raw(key as *mut abi::fid_av)),
            Kind::Mr => drop(Box::from_raw(key as *mut abi::fid_mr)),
            Kind::Ep => drop(Box::from_raw(key as *mut abi::fid_ep)),
            Kind::Cntr => drop(Box::from_raw(key as *mut abi::fid_cntr)),
            Kind::Alias => drop(Box::from_raw(key as *mut abi::fid_ep)),
            Kind::Poll => drop(Box::from_raw(key as *mut abi::fid_poll)),
            Kind::Wait => drop(Box::from_raw(key as *mut abi::fid_wait)),
            Kind::Stx => drop(Box::from_raw(key as *mut abi::fid_stx)),
        }
    }
}

fn fid_of(fclass: u32, context: *mut c_void) -> abi::fid {
    abi::fid {
        fclass: fclass as usize,
        context,
        ops: &FID_OPS as *const abi::fi_ops as *mut abi::fi_ops,
    }
}

/// Writes `v` through an out-pointer, refusing NULL.
fn put<T>(out: *mut T, v: T) -> Result<(), Errno> {
    if out.is_null() {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: non-NULL; libfabric's out-parameters point at caller storage for one `T`.
    unsafe { out.write(v) };
    Ok(())
}

macro_rules! enosys {
    ($name:ident ($($t:ty),* $(,)?) -> $r:ty) => {
        unsafe extern "C" fn $name($(_: $t),*) -> $r {
            -(abi::FI_ENOSYS as $r)
        }
    };
}

// ---- fid operations, shared by every object ----

unsafe extern "C" fn obj_close(fid: *mut abi::fid) -> c_int {
    linger(fid as usize);
    run(|st| {
        let key = fid as usize;
        if st.in_use(key) {
            // Still holding objects, or bound to an endpoint (fi_domain(3), fi_cq(3),
            // fi_av(3), fi_cntr(3)).
            return Err(abi::FI_EBUSY);
        }
        let obj = st.objs.remove(&key).ok_or(abi::FI_EINVAL)?;
        st.parents.remove(&key);
        st.fd_waits.remove(&key);
        let k = obj.kind();
        if let Obj::Ep(ep) = &obj {
            st.close_ep(ep);
        }
        if let Obj::Pep(p) = &obj {
            st.close_pep(p);
        }
        drop(obj);
        free_box(key, k);
        Ok(0)
    })
}

unsafe extern "C" fn obj_bind(fid: *mut abi::fid, bfid: *mut abi::fid, flags: u64) -> c_int {
    run(|st| {
        let (key, b) = (fid as usize, bfid as usize);
        if st.check(key, Kind::Mr).is_ok() {
            return st.bind_mr_cntr(key, b, flags).map(|()| 0);
        }
        if let Some(Obj::Pep(_)) = st.objs.get(&key) {
            // fi_pep_bind: its event queue.
            st.check(b, Kind::Eq)?;
            if let Some(Obj::Pep(p)) = st.objs.get_mut(&key) {
                p.eq = Some(b);
            }
            return Ok(0);
        }
        st.check(key, Kind::Ep).map_err(|_| abi::FI_ENOSYS)?;
        let kind = st.objs.get(&b).map(Obj::kind).ok_or(abi::FI_EINVAL)?;
        if kind == Kind::Cntr {
            return st.bind_ep_cntr(key, b, flags).map(|()| 0);
        }
        let sel = flags & abi::FI_SELECTIVE_COMPLETION != 0;
        let ep = st.ep_mut(key)?;
        if ep.enabled {
            return Err(abi::FI_EOPBADSTATE);
        }
        // A scalable endpoint is bound to its AV alone (fi_scalable_ep_bind), its
        // contexts to anything but one (they use their endpoint's).
        match (ep.sep, kind) {
            (Some(prov::Sep::Root { .. }), Kind::Av) | (None, _) => {}
            (Some(prov::Sep::Root { .. }), _) | (Some(_), Kind::Av) => return Err(abi::FI_EINVAL),
            (Some(_), _) => {}
        }
        match kind {
            Kind::Av => ep.av = Some(b),
            // A shared receive context of the endpoint's own domain (not another
            // endpoint, nor a context bound to one).
            Kind::Ep => {
                let (dom, dgram) = (ep.domain, ep.is_dgram());
                let is_srx = matches!(st.objs.get(&b), Some(Obj::Ep(x)) if x.srx);
                if !is_srx || st.parents.get(&b) != Some(&dom) || b == key {
                    return Err(abi::FI_EINVAL);
                }
                // A context takes the receives of datagram endpoints or of RC
                // connections, not both.
                if dgram {
                    return st.dgram_bind_srx(key, b).map(|()| 0);
                }
                let x = st.ep_mut(b)?;
                if x.srx_dgram == Some(true) {
                    return Err(abi::FI_EINVAL);
                }
                x.srx_dgram = Some(false);
                st.ep_mut(key)?.rx_shared = Some(b);
            }
            // A shared transmit context of the endpoint's own domain.
            Kind::Stx => {
                let dom = ep.domain;
                if st.parents.get(&b) != Some(&dom) {
                    return Err(abi::FI_EINVAL);
                }
                st.ep_mut(key)?.stx = Some(b);
            }
            Kind::Cq => {
                if flags & abi::FI_TRANSMIT as u64 != 0 {
                    ep.txcq = Some(b);
                    ep.tx_selective = sel;
                }
                if flags & abi::FI_RECV as u64 != 0 {
                    ep.rxcq = Some(b);
                    ep.rx_selective = sel;
                }
            }
            // A connected endpoint's connection events; an RDM endpoint has none.
            Kind::Eq => {
                if let Some(m) = ep.msg.as_mut() {
                    m.eq = Some(b);
                }
            }
            _ => return Err(abi::FI_EINVAL),
        }
        Ok(0)
    })
}

unsafe extern "C" fn obj_control(fid: *mut abi::fid, cmd: c_int, arg: *mut c_void) -> c_int {
    let key = fid as usize;
    let kind = run(|st| Ok(st.objs.get(&key).map_or(-1, |o| o.kind() as c_int)));
    if kind == Kind::Domain as c_int && cmd as u32 == abi::FI_QUEUE_WORK {
        // Not under the lock: the work is posted through the endpoint's own entry points.
        // SAFETY: `arg` is NULL or the application's work request (fi_trigger(3)).
        return unsafe { queue_work(key, arg as *mut abi::fi_deferred_work) };
    }
    run(|st| {
        let kind = st.objs.get(&key).map(Obj::kind).ok_or(abi::FI_EINVAL)?;
        match (kind, cmd as u32) {
            (Kind::Ep, abi::FI_ENABLE) => st.enable(key).map(|()| 0),
            // An alias is enabled with its endpoint.
            (Kind::Alias, abi::FI_ENABLE) => st.enable(st.ep_key(key)).map(|()| 0),
            (Kind::Ep | Kind::Alias, abi::FI_ALIAS) => alias(st, key, arg as *mut abi::fi_alias),
            (Kind::Domain, abi::FI_CANCEL_WORK) => {
                if arg.is_null() {
                    return Err(abi::FI_EINVAL);
                }
                st.cancel_work(key, arg as u64).map(|()| 0)
            }
            (Kind::Domain, abi::FI_FLUSH_WORK) => {
                // NULL: all of the domain's work; else the work waiting on the triggering
                // counter of the request given.
                let w = arg as *const abi::fi_deferred_work;
                // SAFETY: NULL or the application's work request (fi_trigger(3)).
                let cntr = unsafe { w.as_ref() }.map(|w| w.triggering_cntr as usize);
                st.flush_work(key, cntr).map(|()| 0)
            }
            (
                Kind::Cq | Kind::Eq | Kind::Wait | Kind::Cntr,
                c @ (abi::FI_GETWAIT | abi::FI_GETWAITOBJ),
            ) => get_wait(st, key, c == abi::FI_GETWAIT, arg).map(|()| 0),
            (Kind::Ep | Kind::Alias, c @ (abi::FI_GETOPSFLAG | abi::FI_SETOPSFLAG)) => {
                ops_flags(st, key, c == abi::FI_SETOPSFLAG, arg as *mut u64).map(|()| 0)
            }
            _ => Err(abi::FI_ENOSYS),
        }
    })
}

/// `fi_control(cq or eq, FI_GETWAIT, int *fd)` (the descriptor of an `FI_WAIT_FD` queue;
/// `-FI_ENODATA` without one) or `FI_GETWAITOBJ` (`enum fi_wait_obj *`: what it was opened
/// with).
fn get_wait(st: &mut State, key: usize, fd: bool, arg: *mut c_void) -> Result<(), Errno> {
    if arg.is_null() {
        return Err(abi::FI_EINVAL);
    }
    let (obj, wait) = match st.objs.get(&key) {
        Some(Obj::Cq(c)) => (c.wait_obj, c.wait.as_ref()),
        Some(Obj::Eq(e)) => (e.wait_obj, e.wait.as_ref()),
        Some(Obj::Cntr(c)) => (c.wait_obj, c.wait.as_ref()),
        // A wait set of FI_WAIT_YIELD (or UNSPEC) has no descriptor to give.
        Some(Obj::Wait(w)) => (
            w.wait_obj,
            (w.wait_obj != abi::fi_wait_obj_FI_WAIT_YIELD).then_some(&w.wait),
        ),
        _ => return Err(abi::FI_EINVAL),
    };
    if fd {
        let wait = wait.ok_or(abi::FI_ENODATA)?;
        match wait.mutex_cond() {
            // SAFETY: non-NULL (checked); FI_GETWAIT's argument for an FI_WAIT_MUTEX_COND
            // object is the caller's `struct fi_mutex_cond` (fi_eq(3)).
            Some(mc) => unsafe { (arg as *mut abi::fi_mutex_cond).write_unaligned(mc.parts()) },
            // SAFETY: non-NULL (checked); FI_GETWAIT's argument is the caller's int (fi_cq(3)).
            None => unsafe { (arg as *mut c_int).write_unaligned(wait.fd()) },
        }
    } else {
        // SAFETY: non-NULL (checked); FI_GETWAITOBJ's argument is the caller's enum.
        unsafe { (arg as *mut abi::fi_wait_obj).write_unaligned(obj) };
    }
    Ok(())
}

/// `fi_control(ep, FI_GETOPSFLAG / FI_SETOPSFLAG, uint64_t *flags)` (fi_endpoint(3)): `flags`
/// names FI_TRANSMIT or FI_RECV (not both); get writes that side's default operation flags,
/// set replaces them with the other bits of `flags`.
fn ops_flags(st: &mut State, ep: usize, set: bool, arg: *mut u64) -> Result<(), Errno> {
    if arg.is_null() {
        return Err(abi::FI_EINVAL);
    }
    let (tx, rx) = (abi::FI_TRANSMIT as u64, abi::FI_RECV as u64);
    // SAFETY: non-NULL: the caller's flags word (fi_endpoint(3)).
    let f = unsafe { arg.read() };
    let side = match (f & tx != 0, f & rx != 0) {
        (true, false) => st.op_flags_mut(ep, false)?,
        (false, true) => st.op_flags_mut(ep, true)?,
        _ => return Err(abi::FI_EINVAL),
    };
    if set {
        *side = f & !(tx | rx);
    } else {
        // SAFETY: as above.
        unsafe { arg.write(*side) };
    }
    Ok(())
}

/// `fi_ep_alias` (`fi_control(ep, FI_ALIAS, &alias)`, fi_endpoint(3)): a new `fid_ep` for
/// the endpoint `key` names, with that endpoint's (or alias's) default operation flags and,
/// on the side `FI_TRANSMIT` or `FI_RECV` in the request's flags (exactly one), the request's
/// other flags instead. Operations posted through it are the endpoint's own; the endpoint
/// cannot close while it has aliases.
fn alias(st: &mut State, key: usize, arg: *mut abi::fi_alias) -> Result<c_int, Errno> {
    // SAFETY: NULL or the caller's request (fi_endpoint(3)).
    let a = unsafe { arg.as_ref() }.ok_or(abi::FI_EINVAL)?;
    if a.fid.is_null() {
        return Err(abi::FI_EINVAL);
    }
    let (tx, rx) = (abi::FI_TRANSMIT as u64, abi::FI_RECV as u64);
    let side_rx = match (a.flags & tx != 0, a.flags & rx != 0) {
        (true, false) => false,
        (false, true) => true,
        _ => return Err(abi::FI_EINVAL),
    };
    let ep = st.ep_key(key);
    let mut t = *st.op_flags_mut(key, false)?;
    let mut r = *st.op_flags_mut(key, true)?;
    *(if side_rx { &mut r } else { &mut t }) = a.flags & !(tx | rx);
    st.check(ep, Kind::Ep)?;
    // SAFETY: `ep` is a live endpoint of the registry, whose box starts with its `struct
    // fid`; the alias carries the endpoint's context.
    let context = unsafe { (*(ep as *const abi::fid)).context };
    let p = publish(
        st,
        ep_fid(context),
        Obj::Alias(prov::Alias {
            ep,
            tx_op_flags: t,
            rx_op_flags: r,
        }),
    );
    // SAFETY: non-NULL: where the caller wants the alias (fi_endpoint(3)).
    unsafe { a.fid.write(p as *mut abi::fid) };
    Ok(0)
}

/// `fi_control(domain, FI_QUEUE_WORK, work)`: the work's operation posted as a triggered
/// operation of its endpoint (transfers) or of the domain (counter operations).
///
/// # Safety
/// `work` is NULL or a deferred work request with its operation, as fi_trigger(3)
/// describes them, valid until the work completes or is cancelled.
unsafe fn queue_work(dom: usize, work: *mut abi::fi_deferred_work) -> c_int {
    // SAFETY: per the caller.
    let Some(w) = (unsafe { work.as_ref() }) else {
        return neg(abi::FI_EINVAL);
    };
    let comp = (!w.completion_cntr.is_null()).then_some(w.completion_cntr as usize);
    let trig = prov::Trig {
        cntr: w.triggering_cntr as usize,
        threshold: w.threshold,
        work: Some(prov::WorkOp {
            key: work as u64,
            comp,
        }),
    };
    // The endpoint a transfer names must be one of this domain's.
    let ep_ok = |ep: *mut abi::fid_ep| {
        run(|st| {
            st.check(dom, Kind::Domain)?;
            match st.ep_mut(st.ep_key(ep as usize)) {
                Ok(e) if e.domain == dom => Ok(0),
                _ => Err(abi::FI_EINVAL),
            }
        })
    };
    // Posts through `post` once `ep` is known to be one of this domain's endpoints.
    let on_ep = |ep: *mut abi::fid_ep, post: &dyn Fn() -> isize| match ep_ok(ep) {
        0 => post(),
        e => e as isize,
    };
    let r: isize = match w.op_type {
        abi::fi_op_type_FI_OP_CNTR_SET | abi::fi_op_type_FI_OP_CNTR_ADD => {
            // SAFETY: the union member `op_type` selects.
            let Some(c) = (unsafe { w.op.cntr.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            let set = w.op_type == abi::fi_op_type_FI_OP_CNTR_SET;
            return run(|st| {
                // Counter operations complete nothing: no completion counter (fi_trigger(3)).
                if comp.is_some() {
                    return Err(abi::FI_EINVAL);
                }
                st.queue_cntr_work(
                    dom,
                    work as u64,
                    (trig.cntr, trig.threshold),
                    c.cntr as usize,
                    c.value,
                    set,
                )
                .map(|()| 0)
            });
        }
        abi::fi_op_type_FI_OP_SEND => {
            // SAFETY: the union member `op_type` selects.
            let Some(o) = (unsafe { w.op.msg.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            on_ep(o.ep, &|| {
                // SAFETY: the operation's message, as the application gave it.
                unsafe { sendmsg_t(o.ep, &o.msg, o.flags, Some(trig)) }
            })
        }
        abi::fi_op_type_FI_OP_TSEND => {
            // SAFETY: the union member `op_type` selects.
            let Some(o) = (unsafe { w.op.tagged.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            on_ep(o.ep, &|| {
                // SAFETY: the operation's message, as the application gave it.
                unsafe { tsendmsg_t(o.ep, &o.msg, o.flags, Some(trig)) }
            })
        }
        abi::fi_op_type_FI_OP_READ | abi::fi_op_type_FI_OP_WRITE => {
            // SAFETY: the union member `op_type` selects.
            let Some(o) = (unsafe { w.op.rma.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            let write = w.op_type == abi::fi_op_type_FI_OP_WRITE;
            on_ep(o.ep, &|| {
                // SAFETY: the operation's message, as the application gave it.
                unsafe { rma_msg(o.ep, &o.msg, o.flags, write, Some(trig)) }
            })
        }
        abi::fi_op_type_FI_OP_ATOMIC => {
            // SAFETY: the union member `op_type` selects.
            let Some(o) = (unsafe { w.op.atomic.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            on_ep(o.ep, &|| {
                // SAFETY: the operation's message, as the application gave it.
                unsafe { atomicmsg_t(o.ep, &o.msg, o.flags, Some(trig)) }
            })
        }
        abi::fi_op_type_FI_OP_FETCH_ATOMIC => {
            // SAFETY: the union member `op_type` selects.
            let Some(o) = (unsafe { w.op.fetch_atomic.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            let f = &o.fetch;
            on_ep(o.ep, &|| {
                // SAFETY: the operation's messages, as the application gave them.
                unsafe {
                    fetchmsg_t(
                        o.ep,
                        &o.msg,
                        (f.msg_iov, f.desc, f.iov_count),
                        o.flags,
                        Some(trig),
                    )
                }
            })
        }
        abi::fi_op_type_FI_OP_COMPARE_ATOMIC => {
            // SAFETY: the union member `op_type` selects.
            let Some(o) = (unsafe { w.op.compare_atomic.as_ref() }) else {
                return neg(abi::FI_EINVAL);
            };
            let (f, c) = (&o.fetch, &o.compare);
            on_ep(o.ep, &|| {
                // SAFETY: the operation's messages, as the application gave them.
                unsafe {
                    compmsg_t(
                        o.ep,
                        &o.msg,
                        (c.msg_iov, c.desc, c.iov_count),
                        (f.msg_iov, f.desc, f.iov_count),
                        o.flags,
                        Some(trig),
                    )
                }
            })
        }
        // Receives cannot be triggered: the NIC's table holds send-side work only.
        abi::fi_op_type_FI_OP_RECV | abi::fi_op_type_FI_OP_TRECV => -(abi::FI_ENOSYS as isize),
        _ => -(abi::FI_EINVAL as isize),
    };
    r as c_int
}

/// The provider's own domain operations, opened with
/// `fi_open_ops(&domain->fid, RINGBELL_DOMAIN_OPS, 0, &ops, NULL)`: the device clock, so
/// that a program can time simulated work, and what an endpoint's tag matcher did (how
/// many tagged messages the NIC matched).
#[repr(C)]
pub struct DomainOps {
    pub size: usize,
    /// The domain's device clock in picoseconds (simulated time on the emulator); 0 for
    /// anything but a live domain.
    pub clock_ps: unsafe extern "C" fn(domain: *mut abi::fid) -> u64,
    /// Arms a counter: the device notes the time its success value reaches `threshold`.
    /// 0, or a negative error number.
    pub cntr_arm: unsafe extern "C" fn(cntr: *mut abi::fid_cntr, threshold: u64) -> c_int,
    /// 1 and the device time (picoseconds) at which an armed counter reached its threshold,
    /// 0 while it has not, `-FI_EIO` if its error value changed first, or another negative
    /// error number.
    pub cntr_reached: unsafe extern "C" fn(cntr: *mut abi::fid_cntr, ps: *mut u64) -> c_int,
    /// What endpoint `ep`'s tag matcher did so far, after a round of progress
    /// ([`prov::TagCounts`], six `uint64_t`: receives posted to the NIC's list, messages the
    /// NIC matched, messages software matched, receives taken back from the list,
    /// rendezvous finished by software, unexpected messages waiting). 0, or a negative
    /// error number (`-FI_EOPBADSTATE` before `fi_enable`).
    pub tag_counts: unsafe extern "C" fn(ep: *mut abi::fid_ep, out: *mut prov::TagCounts) -> c_int,
}

/// The name `fi_open_ops` takes for [`DomainOps`].
pub const DOMAIN_OPS_NAME: &std::ffi::CStr = c"ringbell_domain_ops_v1";

unsafe extern "C" fn dom_clock_ps(domain: *mut abi::fid) -> u64 {
    std::panic::catch_unwind(|| {
        let st = prov::state();
        st.clock_ps(domain as usize).unwrap_or(0)
    })
    .unwrap_or(0)
}

unsafe extern "C" fn dom_cntr_arm(cntr: *mut abi::fid_cntr, threshold: u64) -> c_int {
    with_cntr(cntr, |st, k| st.cntr_arm(k, threshold)).map_or_else(neg, |()| 0)
}

unsafe extern "C" fn dom_cntr_reached(cntr: *mut abi::fid_cntr, ps: *mut u64) -> c_int {
    match with_cntr(cntr, |st, k| {
        st.progress();
        st.cntr_reached(k)
    }) {
        Ok(Some(t)) => put(ps, t).map_or_else(neg, |()| 1),
        Ok(None) => 0,
        Err(e) => neg(e),
    }
}

unsafe extern "C" fn dom_tag_counts(ep: *mut abi::fid_ep, out: *mut prov::TagCounts) -> c_int {
    run(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        st.progress();
        let c = st.tag_counts(ep)?;
        put(out, c).map(|()| 0)
    })
}

static RB_DOMAIN_OPS: DomainOps = DomainOps {
    size: std::mem::size_of::<DomainOps>(),
    clock_ps: dom_clock_ps,
    cntr_arm: dom_cntr_arm,
    cntr_reached: dom_cntr_reached,
    tag_counts: dom_tag_counts,
};

unsafe extern "C" fn obj_ops_open(
    fid: *mut abi::fid,
    name: *const c_char,
    flags: u64,
    ops: *mut *mut c_void,
    _context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(fid as usize, Kind::Domain)
            .map_err(|_| abi::FI_ENOSYS)?;
        // SAFETY: NULL or the caller's NUL-terminated name (fi_open_ops(3)).
        let name = unsafe { crate::string(name) };
        if name.as_deref() != DOMAIN_OPS_NAME.to_str().ok() || flags != 0 {
            return Err(abi::FI_ENOSYS);
        }
        put(ops, &RB_DOMAIN_OPS as *const DomainOps as *mut c_void).map(|()| 0)
    })
}
enosys!(no_tostr(*const abi::fid, *mut c_char, usize) -> c_int);
enosys!(no_ops_set(*mut abi::fid, *const c_char, u64, *mut c_void, *mut c_void) -> c_int);

/// The `fid` operations of every object.
pub static FID_OPS: abi::fi_ops = abi::fi_ops {
    size: std::mem::size_of::<abi::fi_ops>(),
    close: Some(obj_close),
    bind: Some(obj_bind),
    control: Some(obj_control),
    ops_open: Some(obj_ops_open),
    tostr: Some(no_tostr),
    ops_set: Some(no_ops_set),
};

// ---- fabric ----

/// Registers a new fabric object.
pub fn new_fabric(context: *mut c_void, ops: *const abi::fi_ops_fabric) -> *mut abi::fid_fabric {
    let mut st = prov::state();
    publish(
        &mut st,
        abi::fid_fabric {
            fid: fid_of(abi::FI_CLASS_FABRIC, context),
            ops: ops as *mut _,
            api_version: crate::info::API_VERSION,
        },
        Obj::Fabric,
    )
}

/// `fi_domain`.
pub unsafe extern "C" fn domain_open(
    fabric: *mut abi::fid_fabric,
    info: *mut abi::fi_info,
    out: *mut *mut abi::fid_domain,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(fabric as usize, Kind::Fabric)?;
        if info.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: `info` is non-NULL: an info libfabric passes on (from getinfo), whose
        // domain attribute is NULL or valid.
        let nic = unsafe { info_nic(&*info) }?;
        let mut d = st.new_domain(nic)?;
        // SAFETY: as above.
        d.format = prov::Format::of(unsafe { (*info).addr_format });
        let p = adopt(
            st,
            abi::fid_domain {
                fid: fid_of(abi::FI_CLASS_DOMAIN, context),
                ops: &DOMAIN_OPS as *const _ as *mut _,
                mr: &MR_OPS as *const _ as *mut _,
            },
            Obj::Domain(Box::new(d)),
            fabric as usize,
        );
        put(out, p).map(|()| 0)
    })
}

// ---- event queues: the connection events of connected endpoints (fi_eq(3)) ----

pub unsafe extern "C" fn eq_open(
    fabric: *mut abi::fid_fabric,
    attr: *mut abi::fi_eq_attr,
    out: *mut *mut abi::fid_eq,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(fabric as usize, Kind::Fabric)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: NULL or the caller's attributes (fi_eq(3)).
        let wait_obj =
            unsafe { attr.as_ref() }.map_or(abi::fi_wait_obj_FI_WAIT_NONE, |a| a.wait_obj);
        // As for CQs: polling, a descriptor or a mutex and condition (prov::wait).
        let wait = queue_wait(wait_obj)?;
        let has_wait = wait.is_some();
        let p = adopt(
            st,
            abi::fid_eq {
                fid: fid_of(abi::FI_CLASS_EQ, context),
                ops: &EQ_OPS as *const _ as *mut _,
            },
            Obj::Eq(prov::Eq {
                wait_obj,
                wait,
                ..Default::default()
            }),
            fabric as usize,
        );
        if has_wait {
            st.fd_waits.insert(p as usize);
        }
        put(out, p).map(|()| 0)
    })
}

/// Writes event `e` as a `struct fi_eq_cm_entry` into `buf` (`len` bytes): the object's
/// fid, for a connection request a new info (whose `handle` names the request), then the
/// private data. The size written, or `-FI_ETOOSMALL`.
///
/// # Safety
/// `buf` is NULL or holds `len` bytes.
unsafe fn write_cm_entry(e: &prov::EqEvent, buf: *mut c_void, len: usize) -> Result<isize, Errno> {
    if e.written {
        // An application's own event (fi_eq_write): its entry as written.
        if buf.is_null() || len < e.data.len() {
            return Err(abi::FI_ETOOSMALL);
        }
        // SAFETY: `buf` holds `len >= data.len()` bytes (checked).
        unsafe { std::ptr::copy_nonoverlapping(e.data.as_ptr(), buf as *mut u8, e.data.len()) };
        return Ok(e.data.len() as isize);
    }
    let head = std::mem::size_of::<abi::fi_eq_cm_entry>();
    let size = head + e.data.len();
    if buf.is_null() || len < size {
        return Err(abi::FI_ETOOSMALL);
    }
    let info = match e.connreq {
        Some((nic, handle)) => {
            // The NIC's connected offer as fi_getinfo gives it without hints: with the
            // modes it asks of the application (FI_RX_CQ_DATA: remote CQ data consumes a
            // posted receive, which the endpoint opened with this info must know).
            let mut offer =
                crate::info::Offer::msg_for_nic(&ringbell::discover::NicPlan::name(nic));
            // In the listener's address format.
            if let Some(a) = &e.listen {
                offer.addr_format = a.format.addr_format();
            }
            let offer = crate::info::match_offer(
                crate::info::API_VERSION,
                &crate::info::Hints::default(),
                &offer,
            )
            .map_err(|_| abi::FI_ENOMEM)?;
            let i = crate::write_info(&offer).ok_or(abi::FI_ENOMEM)?;
            // SAFETY: `i` is the info just built (with its attributes), the caller's to
            // free with fi_freeinfo.
            unsafe {
                (*i).handle = handle as *mut abi::fid;
                // What the listener's info asked of its connections (its default
                // operation flags among them) holds for the endpoint that accepts.
                if let Some(a) = &e.listen {
                    (*i).caps = a.caps;
                    (*i).mode = a.mode;
                    if let Some(t) = (*i).tx_attr.as_mut() {
                        *t = a.tx;
                    }
                    if let Some(r) = (*i).rx_attr.as_mut() {
                        *r = a.rx;
                    }
                }
            }
            i
        }
        None => std::ptr::null_mut(),
    };
    let entry = abi::fi_eq_cm_entry {
        fid: e.fid as *mut abi::fid,
        info,
        data: Default::default(),
    };
    // SAFETY: `buf` holds `len >= size` bytes (checked): the entry, then the data.
    unsafe {
        (buf as *mut abi::fi_eq_cm_entry).write_unaligned(entry);
        std::ptr::copy_nonoverlapping(e.data.as_ptr(), (buf as *mut u8).add(head), e.data.len());
    }
    Ok(size as isize)
}

/// `fi_eq_read`: the next connection event (`FI_PEEK`: left in the queue).
///
/// # Safety
/// `event` is NULL or a `uint32_t` of the caller's; `buf` is NULL or holds `len` bytes.
unsafe fn eq_read_once(
    st: &mut State,
    eq: usize,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    flags: u64,
) -> Result<isize, Errno> {
    st.check(eq, Kind::Eq)?;
    let peek = flags & abi::FI_PEEK as u64 != 0;
    st.progress();
    let e = st.eq_next(eq)?;
    // SAFETY: per the caller.
    let n = unsafe { write_cm_entry(e, buf, len) }?;
    if !event.is_null() {
        // SAFETY: per the caller.
        unsafe { event.write(e.event) };
    }
    if !peek {
        st.eq_pop(eq);
    }
    Ok(n)
}

unsafe extern "C" fn eq_read(
    eq: *mut abi::fid_eq,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    flags: u64,
) -> isize {
    // SAFETY: the caller's pointers (fi_eq(3)).
    run_s(|st| unsafe { eq_read_once(st, eq as usize, event, buf, len, flags) })
}
unsafe extern "C" fn eq_readerr(
    eq: *mut abi::fid_eq,
    buf: *mut abi::fi_eq_err_entry,
    _: u64,
) -> isize {
    run_s(|st| {
        st.check(eq as usize, Kind::Eq)?;
        if buf.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let e = st.eq_take_err(eq as usize)?;
        let context = if st.objs.contains_key(&e.fid) {
            // SAFETY: `e.fid` is a live endpoint's key, whose box starts with its fid.
            unsafe { (*(e.fid as *const abi::fid)).context }
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: non-NULL: the caller's error entry (fi_eq(3)); the peer's data is not
        // handed out (err_data stays NULL).
        unsafe {
            buf.write(abi::fi_eq_err_entry {
                fid: e.fid as *mut abi::fid,
                context,
                data: 0,
                err: e.err as c_int,
                prov_errno: e.err as c_int,
                err_data: std::ptr::null_mut(),
                err_data_size: 0,
            })
        };
        Ok(std::mem::size_of::<abi::fi_eq_err_entry>() as isize)
    })
}
unsafe extern "C" fn eq_sread(
    eq: *mut abi::fid_eq,
    event: *mut u32,
    buf: *mut c_void,
    len: usize,
    timeout: c_int,
    flags: u64,
) -> isize {
    // Progress until an event or an error entry comes, or the timeout (in milliseconds; a
    // negative one for ever) runs out: -FI_EAGAIN.
    let start = std::time::Instant::now();
    loop {
        // SAFETY: the caller's pointers (fi_eq(3)).
        let r = run_s(|st| unsafe { eq_read_once(st, eq as usize, event, buf, len, flags) });
        if r != -(abi::FI_EAGAIN as isize)
            || (timeout >= 0 && start.elapsed().as_millis() >= timeout as u128)
        {
            return r;
        }
        if let Err(e) = rest(start, timeout) {
            return neg(e) as isize;
        }
    }
}
/// `fi_eq_write`: an event of the application's (its entry, `len` bytes at `buf`) joins
/// the queue; the bytes written, or `-FI_EINVAL` for a missing entry.
unsafe extern "C" fn eq_write(
    eq: *mut abi::fid_eq,
    event: u32,
    buf: *const c_void,
    len: usize,
    _flags: u64,
) -> isize {
    run_s(|st| {
        st.check(eq as usize, Kind::Eq)?;
        if buf.is_null() && len > 0 {
            return Err(abi::FI_EINVAL);
        }
        let entry = if len == 0 {
            &[][..]
        } else {
            // SAFETY: non-NULL (checked); the caller's entry of `len` bytes (fi_eq(3)).
            unsafe { std::slice::from_raw_parts(buf as *const u8, len) }
        };
        st.eq_write(eq as usize, event, entry)?;
        Ok(len as isize)
    })
}

static ERR_TEXT: &std::ffi::CStr = c"ringbell: operation failed";

/// Copies `ERR_TEXT` into `buf` (if given) and returns it.
fn strerror_into(buf: *mut c_char, len: usize) -> *const c_char {
    if buf.is_null() || len == 0 {
        return ERR_TEXT.as_ptr();
    }
    let b = ERR_TEXT.to_bytes();
    let n = b.len().min(len - 1);
    // SAFETY: `buf` holds `len` bytes (fi_cq_strerror(3)); `n + 1 <= len` are written.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    buf
}

unsafe extern "C" fn eq_strerror(
    _: *mut abi::fid_eq,
    _: c_int,
    _: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    strerror_into(buf, len)
}

static EQ_OPS: abi::fi_ops_eq = abi::fi_ops_eq {
    size: std::mem::size_of::<abi::fi_ops_eq>(),
    read: Some(eq_read),
    readerr: Some(eq_readerr),
    write: Some(eq_write),
    sread: Some(eq_sread),
    strerror: Some(eq_strerror),
};

// ---- domain ----

/// The wait object of a new CQ or EQ: polling (`FI_WAIT_NONE`, `FI_WAIT_UNSPEC`,
/// `FI_WAIT_YIELD`), a descriptor (`FI_WAIT_FD`) or a mutex and condition
/// (`FI_WAIT_MUTEX_COND`). A wait set (an EQ's: a CQ's is its caller's to take) and
/// pollfd lists are `-FI_ENOSYS`, anything else `-FI_EINVAL`.
fn queue_wait(wait_obj: u32) -> Result<Option<prov::FdWait>, Errno> {
    match wait_obj {
        abi::fi_wait_obj_FI_WAIT_NONE
        | abi::fi_wait_obj_FI_WAIT_UNSPEC
        | abi::fi_wait_obj_FI_WAIT_YIELD => Ok(None),
        abi::fi_wait_obj_FI_WAIT_FD | abi::fi_wait_obj_FI_WAIT_MUTEX_COND => {
            prov::FdWait::of(wait_obj)
        }
        abi::fi_wait_obj_FI_WAIT_SET | abi::fi_wait_obj_FI_WAIT_POLLFD => Err(abi::FI_ENOSYS),
        _ => Err(abi::FI_EINVAL),
    }
}

/// The wait set a CQ or counter of domain `dom` opened with `FI_WAIT_SET` joins: a live
/// wait set of the domain's fabric, else `-FI_EINVAL`.
fn wait_set_of(st: &State, dom: usize, set: *mut abi::fid_wait) -> Result<usize, Errno> {
    let set = set as usize;
    st.check(set, Kind::Wait)?;
    let fabric = st.parents.get(&dom).copied();
    if fabric.is_none() || st.parents.get(&set).copied() != fabric {
        return Err(abi::FI_EINVAL);
    }
    Ok(set)
}

/// `fi_wait_open` (fi_wait(3)): a wait set of `FI_WAIT_UNSPEC`, `FI_WAIT_FD`,
/// `FI_WAIT_MUTEX_COND` or `FI_WAIT_YIELD`; `attr->flags` must be 0. Pollfd lists are
/// `-FI_ENOSYS`.
pub unsafe extern "C" fn wait_open(
    fabric: *mut abi::fid_fabric,
    attr: *mut abi::fi_wait_attr,
    out: *mut *mut abi::fid_wait,
) -> c_int {
    run(|st| {
        st.check(fabric as usize, Kind::Fabric)?;
        // SAFETY: NULL or the caller's attributes (fi_wait(3)).
        let a = unsafe { attr.as_ref() }.ok_or(abi::FI_EINVAL)?;
        if out.is_null() || a.flags != 0 {
            return Err(abi::FI_EINVAL);
        }
        let wait = match a.wait_obj {
            abi::fi_wait_obj_FI_WAIT_UNSPEC | abi::fi_wait_obj_FI_WAIT_YIELD => {
                prov::FdWait::new()?
            }
            abi::fi_wait_obj_FI_WAIT_FD | abi::fi_wait_obj_FI_WAIT_MUTEX_COND => {
                prov::FdWait::of(a.wait_obj)?.ok_or(abi::FI_EINVAL)?
            }
            abi::fi_wait_obj_FI_WAIT_POLLFD => return Err(abi::FI_ENOSYS),
            _ => return Err(abi::FI_EINVAL),
        };
        let set = prov::WaitSet {
            wait_obj: a.wait_obj,
            wait,
        };
        let p = adopt(
            st,
            abi::fid_wait {
                fid: fid_of(abi::FI_CLASS_WAIT, std::ptr::null_mut()),
                ops: &WAIT_OPS as *const _ as *mut _,
            },
            Obj::Wait(set),
            fabric as usize,
        );
        st.fd_waits.insert(p as usize);
        put(out, p).map(|()| 0)
    })
}

/// `fi_wait`: returns 0 once a member of the set has something, `-FI_ETIMEDOUT` after
/// `timeout` ms (negative: no limit).
unsafe extern "C" fn wait_wait(set: *mut abi::fid_wait, timeout: c_int) -> c_int {
    let start = std::time::Instant::now();
    loop {
        let mut look = Ok(None);
        let r = run(|st| {
            look = st.wait_look(set as usize);
            Ok(0)
        });
        let (fd, moved) = match look {
            _ if r != 0 => return r,
            Err(e) => return neg(e),
            Ok(None) => return 0,
            Ok(Some(w)) => w,
        };
        let waited = start.elapsed().as_millis() as u64;
        if timeout >= 0 && waited >= timeout as u64 {
            return neg(abi::FI_ETIMEDOUT);
        }
        let left = (timeout >= 0).then(|| timeout as u64 - waited);
        match fd {
            Some(fd) => prov::sleep_on(&fd, left),
            None if moved => {}
            None => std::thread::yield_now(),
        }
    }
}

static WAIT_OPS: abi::fi_ops_wait = abi::fi_ops_wait {
    size: std::mem::size_of::<abi::fi_ops_wait>(),
    wait: Some(wait_wait),
};

unsafe extern "C" fn cq_open(
    dom: *mut abi::fid_domain,
    attr: *mut abi::fi_cq_attr,
    out: *mut *mut abi::fid_cq,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        // SAFETY: NULL or the caller's attributes (fi_cq_open(3)).
        let a = unsafe { attr.as_ref() }.ok_or(abi::FI_EINVAL)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let (wait, joins) = if a.wait_obj == abi::fi_wait_obj_FI_WAIT_SET {
            (None, Some(wait_set_of(st, dom as usize, a.wait_set)?))
        } else {
            (queue_wait(a.wait_obj)?, None)
        };
        let mut cq = prov::Cq::new(a.format, a.wait_obj)?;
        let fd = wait.is_some();
        cq.wait = wait;
        cq.wait_set = joins;
        let p = adopt(
            st,
            abi::fid_cq {
                fid: fid_of(abi::FI_CLASS_CQ, context),
                ops: &CQ_OPS as *const _ as *mut _,
            },
            Obj::Cq(cq),
            dom as usize,
        );
        if fd {
            st.fd_waits.insert(p as usize);
        }
        put(out, p).map(|()| 0)
    })
}

unsafe extern "C" fn av_open(
    dom: *mut abi::fid_domain,
    attr: *mut abi::fi_av_attr,
    out: *mut *mut abi::fid_av,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        // SAFETY: NULL or the caller's attributes (fi_av_open(3)).
        let a = unsafe { attr.as_ref() };
        if let Some(a) = a {
            // Receive-context bits leave room for an index (fi_rx_addr).
            if a.type_ > abi::fi_av_type_FI_AV_TABLE || a.rx_ctx_bits < 0 || a.rx_ctx_bits > 32 {
                return Err(abi::FI_EINVAL);
            }
        }
        let rx_ctx_bits = a.map_or(0, |a| a.rx_ctx_bits as u32);
        // SAFETY: NULL or a string of the caller's (fi_av_open(3)).
        let name = a.and_then(|a| unsafe { crate::string(a.name) });
        let read_only = a.is_some_and(|a| a.flags & abi::FI_READ as u64 != 0);
        // A read-only AV is a named one that exists (fi_av(3)).
        if read_only && name.is_none() {
            return Err(abi::FI_EINVAL);
        }
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let format = match st.objs.get(&(dom as usize)) {
            Some(Obj::Domain(d)) => d.format,
            _ => return Err(abi::FI_EINVAL),
        };
        let p = adopt(
            st,
            abi::fid_av {
                fid: fid_of(abi::FI_CLASS_AV, context),
                ops: &AV_OPS as *const _ as *mut _,
            },
            match &name {
                Some(n) => {
                    let count = a.map_or(0, |a| a.count);
                    let av = prov::Av::named(n, read_only, count, format, rx_ctx_bits)?;
                    // The map of a named AV: its fi_addr_t values, as every opener sees
                    // them (fi_av(3) map_addr), given back when the caller gave none.
                    if let Some(p) = av.map_addr().filter(|_| !attr.is_null()) {
                        // SAFETY: non-NULL: the caller's attributes, which fi_av_open(3)
                        // writes `map_addr` back into (no reference to them is held here).
                        unsafe {
                            if (*attr).map_addr.is_null() {
                                (*attr).map_addr = p as *mut c_void;
                            }
                        }
                    }
                    Obj::Av(av)
                }
                None => Obj::Av(prov::Av::new(format, rx_ctx_bits)),
            },
            dom as usize,
        );
        put(out, p).map(|()| 0)
    })
}

unsafe extern "C" fn endpoint(
    dom: *mut abi::fid_domain,
    info: *mut abi::fi_info,
    out: *mut *mut abi::fid_ep,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: NULL or the info libfabric passes on (fi_endpoint(3)).
        let info = unsafe { info.as_ref() };
        let mut named = info.and_then(info_service);
        let format = info.map_or(prov::Format::Native, |i| prov::Format::of(i.addr_format));
        // SAFETY: the info's attribute pointers are NULL or valid (fi_getinfo(3)).
        let dgram = info
            .and_then(|i| unsafe { i.ep_attr.as_ref() })
            .is_some_and(|a| a.type_ == abi::fi_ep_type_FI_EP_DGRAM);
        // SAFETY: as above.
        let msg_type = info
            .and_then(|i| unsafe { i.ep_attr.as_ref() })
            .is_some_and(|a| a.type_ == abi::fi_ep_type_FI_EP_MSG);
        // The connection request it is opened to accept (fi_cm(3)).
        // Or the passive endpoint whose address it takes (fi_endpoint(3)).
        let handle = info.map_or(0, |i| i.handle as usize);
        let (connreq, pep) = match st.objs.get(&handle) {
            // In a sockaddr format the endpoint that accepts has its listener's address,
            // as an accepted socket has (a connected endpoint is never published).
            Some(prov::Obj::ConnReq(r)) => {
                if format == prov::Format::SockaddrIn {
                    named = Some(r.service);
                }
                (Some(handle), None)
            }
            Some(prov::Obj::Pep(p)) => {
                named = Some(p.service);
                (None, Some(handle))
            }
            _ if handle != 0 => return Err(abi::FI_EINVAL),
            _ => (None, None),
        };
        let mut ep = st.new_ep(dom as usize, named, dgram, format)?;
        if let Some(p) = pep {
            let (_, was_named, claimed) = st.take_pep_addr(p, ep.nic)?;
            ep.named = was_named;
            ep.claimed = claimed;
        }
        if msg_type || connreq.is_some() || pep.is_some() {
            ep.msg = Some(prov::MsgEp {
                connreq,
                tagged: info.is_some_and(|i| i.caps & abi::FI_TAGGED as u64 != 0),
                ..Default::default()
            });
        }
        if let Some(i) = info {
            ep.directed = i.caps & abi::FI_DIRECTED_RECV != 0;
            ep.source = i.caps & abi::FI_SOURCE != 0;
            // SAFETY: the info's attribute pointers are NULL or valid (fi_getinfo(3)).
            if let Some(t) = unsafe { i.tx_attr.as_ref() } {
                ep.tx_op_flags = t.op_flags;
            }
            // SAFETY: as above.
            if let Some(r) = unsafe { i.rx_attr.as_ref() } {
                ep.rx_op_flags = r.op_flags;
            }
        }
        let p = adopt(st, ep_fid(context), Obj::Ep(Box::new(ep)), dom as usize);
        put(out, p).map(|()| 0)
    })
}

/// The `fid_ep` of an endpoint or alias: every one has the same operations.
fn ep_fid(context: *mut c_void) -> abi::fid_ep {
    abi::fid_ep {
        fid: fid_of(abi::FI_CLASS_EP, context),
        ops: &EP_OPS as *const _ as *mut _,
        cm: &CM_OPS as *const _ as *mut _,
        msg: &MSG_OPS as *const _ as *mut _,
        rma: &RMA_OPS as *const _ as *mut _,
        tagged: &TAGGED_OPS as *const _ as *mut _,
        atomic: &ATOMIC_OPS as *const _ as *mut _,
        collective: &COLL_OPS as *const _ as *mut _,
    }
}

/// `fi_scalable_ep` (fi_scalable_ep(3)): an RDM endpoint of `ep_attr->tx_ctx_cnt`
/// transmit and `rx_ctx_cnt` receive contexts (0 is 1; at most [`prov::MAX_EP_CTX`],
/// else `-FI_EINVAL`), which only holds the address, the AV and the listener; data moves
/// through its contexts (`fi_tx_context`, `fi_rx_context`).
unsafe extern "C" fn scalable_ep(
    dom: *mut abi::fid_domain,
    info: *mut abi::fi_info,
    out: *mut *mut abi::fid_ep,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        // SAFETY: NULL or the info libfabric passes on (fi_scalable_ep(3)).
        let info = unsafe { info.as_ref() }.ok_or(abi::FI_EINVAL)?;
        // SAFETY: the info's attribute pointers are NULL or valid (fi_getinfo(3)).
        let attr = unsafe { info.ep_attr.as_ref() }.ok_or(abi::FI_EINVAL)?;
        let count = |n: usize| match n {
            0 => Ok(1),
            n if n <= prov::MAX_EP_CTX => Ok(n),
            _ => Err(abi::FI_EINVAL),
        };
        let (tx, rx) = (count(attr.tx_ctx_cnt)?, count(attr.rx_ctx_cnt)?);
        if out.is_null()
            || (attr.type_ != abi::fi_ep_type_FI_EP_RDM
                && attr.type_ != abi::fi_ep_type_FI_EP_UNSPEC)
        {
            return Err(abi::FI_EINVAL);
        }
        let format = prov::Format::of(info.addr_format);
        let mut ep = st.new_ep(dom as usize, info_service(info), false, format)?;
        ep.sep = Some(prov::Sep::Root { tx, rx });
        ep.source = info.caps & abi::FI_SOURCE != 0;
        ep.directed = info.caps & abi::FI_DIRECTED_RECV != 0;
        // SAFETY: as above.
        if let Some(t) = unsafe { info.tx_attr.as_ref() } {
            ep.tx_op_flags = t.op_flags;
        }
        // SAFETY: as above.
        if let Some(r) = unsafe { info.rx_attr.as_ref() } {
            ep.rx_op_flags = r.op_flags;
        }
        let mut fid = ep_fid(context);
        fid.fid.fclass = abi::FI_CLASS_SEP as usize;
        let p = adopt(st, fid, Obj::Ep(Box::new(ep)), dom as usize);
        put(out, p).map(|()| 0)
    })
}

/// `fi_tx_context` / `fi_rx_context` of a scalable endpoint: context `index` (see
/// `prov::State::new_sep_ctx`), with the operation flags of `attr` when given (else the
/// scalable endpoint's). An endpoint that is not scalable has no contexts (`-FI_EINVAL`).
fn sep_ctx(
    sep: *mut abi::fid_ep,
    index: c_int,
    op_flags: Option<u64>,
    out: *mut *mut abi::fid_ep,
    context: *mut c_void,
    rx: bool,
) -> c_int {
    run(|st| {
        st.check(sep as usize, Kind::Ep)?;
        let index = usize::try_from(index).map_err(|_| abi::FI_EINVAL)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let mut e = st.new_sep_ctx(sep as usize, index, rx)?;
        if let Some(f) = op_flags {
            if rx {
                e.rx_op_flags = f;
            } else {
                e.tx_op_flags = f;
            }
        }
        let (source, directed) = {
            let s = st.ep_mut(sep as usize)?;
            (s.source, s.directed)
        };
        e.source = source;
        e.directed = directed;
        let dom = e.domain;
        let mut fid = ep_fid(context);
        fid.fid.fclass = if rx {
            abi::FI_CLASS_RX_CTX
        } else {
            abi::FI_CLASS_TX_CTX
        } as usize;
        let p = adopt(st, fid, Obj::Ep(Box::new(e)), dom);
        put(out, p).map(|()| 0)
    })
}
/// `fi_poll_open` (fi_poll(3)): an empty poll set of the domain; `attr->flags` is reserved
/// and must be 0.
unsafe extern "C" fn poll_open(
    dom: *mut abi::fid_domain,
    attr: *mut abi::fi_poll_attr,
    out: *mut *mut abi::fid_poll,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        // SAFETY: NULL or the caller's attributes (fi_poll(3)).
        if out.is_null() || unsafe { attr.as_ref() }.is_some_and(|a| a.flags != 0) {
            return Err(abi::FI_EINVAL);
        }
        let p = adopt(
            st,
            abi::fid_poll {
                fid: fid_of(abi::FI_CLASS_POLL, std::ptr::null_mut()),
                ops: &POLL_OPS as *const _ as *mut _,
            },
            Obj::Poll(prov::Poll::default()),
            dom as usize,
        );
        put(out, p).map(|()| 0)
    })
}

/// `fi_poll`: the contexts of up to `count` members with events (fi_poll(3)).
unsafe extern "C" fn poll_poll(
    set: *mut abi::fid_poll,
    ctx: *mut *mut c_void,
    count: c_int,
) -> c_int {
    run(|st| {
        st.check(set as usize, Kind::Poll)?;
        let max = usize::try_from(count).map_err(|_| abi::FI_EINVAL)?;
        if ctx.is_null() && max > 0 {
            return Err(abi::FI_EINVAL);
        }
        let ready = st.poll(set as usize, max)?;
        for (i, &fid) in ready.iter().enumerate() {
            // SAFETY: `fid` is a live CQ or counter of the registry (its box starts with its
            // `struct fid`), and `ctx` holds `count` > `i` pointers (fi_poll(3)).
            unsafe { ctx.add(i).write((*(fid as *const abi::fid)).context) };
        }
        Ok(ready.len() as c_int)
    })
}

unsafe extern "C" fn poll_add(set: *mut abi::fid_poll, fid: *mut abi::fid, _flags: u64) -> c_int {
    run(|st| {
        st.check(set as usize, Kind::Poll)?;
        st.poll_add(set as usize, fid as usize).map(|()| 0)
    })
}

unsafe extern "C" fn poll_del(set: *mut abi::fid_poll, fid: *mut abi::fid, _flags: u64) -> c_int {
    run(|st| {
        st.check(set as usize, Kind::Poll)?;
        st.poll_del(set as usize, fid as usize).map(|()| 0)
    })
}

static POLL_OPS: abi::fi_ops_poll = abi::fi_ops_poll {
    size: std::mem::size_of::<abi::fi_ops_poll>(),
    poll: Some(poll_poll),
    poll_add: Some(poll_add),
    poll_del: Some(poll_del),
};
/// `fi_stx_context`: a shared transmit context of the domain (see `prov::Obj::Stx`).
/// `attr`, when given, may ask for no more than an endpoint's transmit queue.
unsafe extern "C" fn stx_ctx(
    dom: *mut abi::fid_domain,
    attr: *mut abi::fi_tx_attr,
    out: *mut *mut abi::fid_stx,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: NULL or the caller's attributes (fi_endpoint(3)).
        if let Some(a) = unsafe { attr.as_ref() } {
            let o = crate::info::Offer::for_nic("");
            if a.size > o.tx_size || a.iov_limit > o.iov_limit || a.inject_size > o.inject_size {
                return Err(abi::FI_EINVAL);
            }
        }
        let p = adopt(
            st,
            abi::fid_stx {
                fid: fid_of(abi::FI_CLASS_STX_CTX, context),
                ops: &EP_OPS as *const _ as *mut _,
            },
            Obj::Stx,
            dom as usize,
        );
        put(out, p).map(|()| 0)
    })
}

/// `fi_srx_context`: a shared receive context of the domain, an endpoint that only
/// receives (untagged messages; see `prov::State::new_srx`), bound to endpoints with
/// `fi_ep_bind`. `attr`, when given, may ask for no more than an endpoint's receive queue.
unsafe extern "C" fn srx_ctx(
    dom: *mut abi::fid_domain,
    attr: *mut abi::fi_rx_attr,
    out: *mut *mut abi::fid_ep,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let mut op_flags = 0;
        // SAFETY: NULL or the caller's attributes (fi_endpoint(3)).
        if let Some(a) = unsafe { attr.as_ref() } {
            let o = crate::info::Offer::for_nic("");
            if a.size > o.rx_size
                || a.iov_limit > o.iov_limit
                || a.caps & abi::FI_TAGGED as u64 != 0
            {
                return Err(abi::FI_EINVAL);
            }
            op_flags = a.op_flags;
        }
        let mut e = st.new_srx(dom as usize)?;
        e.rx_op_flags = op_flags;
        let mut fid = ep_fid(context);
        fid.fid.fclass = abi::FI_CLASS_SRX_CTX as usize;
        let p = adopt(st, fid, Obj::Ep(Box::new(e)), dom as usize);
        put(out, p).map(|()| 0)
    })
}
enosys!(
    no_query_collective(
        *mut abi::fid_domain,
        abi::fi_collective_op,
        *mut abi::fi_collective_attr,
        u64,
    ) -> c_int
);
enosys!(
    no_endpoint2(
        *mut abi::fid_domain,
        *mut abi::fi_info,
        *mut *mut abi::fid_ep,
        u64,
        *mut c_void,
    ) -> c_int
);

static DOMAIN_OPS: abi::fi_ops_domain = abi::fi_ops_domain {
    size: std::mem::size_of::<abi::fi_ops_domain>(),
    av_open: Some(av_open),
    cq_open: Some(cq_open),
    endpoint: Some(endpoint),
    scalable_ep: Some(scalable_ep),
    cntr_open: Some(cntr_open),
    poll_open: Some(poll_open),
    stx_ctx: Some(stx_ctx),
    srx_ctx: Some(srx_ctx),
    query_atomic: Some(dom_query_atomic),
    query_collective: Some(no_query_collective),
    endpoint2: Some(no_endpoint2),
};

// ---- counters ----

/// `fi_cntr_open`: completion-event counters (`FI_CNTR_EVENTS_COMP`); waiting polls, so
/// every wait object but a file descriptor or a wait set is taken.
unsafe extern "C" fn cntr_open(
    dom: *mut abi::fid_domain,
    attr: *mut abi::fi_cntr_attr,
    out: *mut *mut abi::fid_cntr,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let (mut joins, mut fd, mut wait_obj) = (None, None, abi::fi_wait_obj_FI_WAIT_NONE);
        // SAFETY: NULL or the caller's attributes (fi_cntr_open(3)).
        if let Some(a) = unsafe { attr.as_ref() } {
            if a.events != abi::fi_cntr_events_FI_CNTR_EVENTS_COMP {
                return Err(abi::FI_ENOSYS);
            }
            if a.flags != 0 {
                return Err(abi::FI_EINVAL);
            }
            match a.wait_obj {
                abi::fi_wait_obj_FI_WAIT_NONE
                | abi::fi_wait_obj_FI_WAIT_UNSPEC
                | abi::fi_wait_obj_FI_WAIT_YIELD => {}
                abi::fi_wait_obj_FI_WAIT_SET => {
                    joins = Some(wait_set_of(st, dom as usize, a.wait_set)?);
                }
                abi::fi_wait_obj_FI_WAIT_FD | abi::fi_wait_obj_FI_WAIT_MUTEX_COND => {
                    fd = prov::FdWait::of(a.wait_obj)?
                }
                abi::fi_wait_obj_FI_WAIT_POLLFD => return Err(abi::FI_ENOSYS),
                _ => return Err(abi::FI_EINVAL),
            }
            wait_obj = a.wait_obj;
        }
        let mut c = st.new_cntr(dom as usize)?;
        c.wait_set = joins.map(|w| (w, c.c.read()));
        c.seen = c.c.read();
        c.wait_obj = wait_obj;
        let has_fd = fd.is_some();
        c.wait = fd;
        let p = adopt(
            st,
            abi::fid_cntr {
                fid: fid_of(abi::FI_CLASS_CNTR, context),
                ops: &CNTR_OPS as *const _ as *mut _,
            },
            Obj::Cntr(c),
            dom as usize,
        );
        if has_fd {
            st.fd_waits.insert(p as usize);
        }
        put(out, p).map(|()| 0)
    })
}

/// Runs `f` on live counter `c` under the lock; `None` for a dead one or a panic.
fn with_cntr<T>(
    c: *mut abi::fid_cntr,
    f: impl FnOnce(&mut State, usize) -> Result<T, Errno>,
) -> Result<T, Errno> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut st = prov::state();
        st.check(c as usize, Kind::Cntr)?;
        f(&mut st, c as usize)
    }))
    .unwrap_or(Err(abi::FI_EOTHER))
}

/// Both values of counter `c` after a round of progress (manual progress: reading a counter
/// is what moves the provider's work on).
fn cntr_values(c: *mut abi::fid_cntr) -> Result<(u64, u64), Errno> {
    with_cntr(c, |st, k| {
        st.progress();
        Ok(st.cntr(k)?.read())
    })
}

unsafe extern "C" fn cntr_read(c: *mut abi::fid_cntr) -> u64 {
    cntr_values_seen(c).map_or(0, |v| v.0)
}

unsafe extern "C" fn cntr_readerr(c: *mut abi::fid_cntr) -> u64 {
    cntr_values_seen(c).map_or(0, |v| v.1)
}

/// [`cntr_values`], as the application reads them: a descriptor of the counter quiets.
fn cntr_values_seen(c: *mut abi::fid_cntr) -> Result<(u64, u64), Errno> {
    with_cntr(c, |st, k| {
        st.progress();
        let v = st.cntr(k)?.read();
        st.cntr_seen(k, v);
        Ok(v)
    })
}

/// Applies `f` to counter `c`'s device counter.
fn cntr_update(
    c: *mut abi::fid_cntr,
    f: impl FnOnce(&ringbell::Counter) -> Result<(), ringbell::Error>,
) -> c_int {
    with_cntr(c, |st, k| f(st.cntr(k)?).map_err(|_| abi::FI_EIO)).map_or_else(neg, |()| 0)
}

/// Adds to counter `c`: one posted register store when the amount fits 32 bits, else a
/// command.
unsafe extern "C" fn cntr_add(c: *mut abi::fid_cntr, v: u64) -> c_int {
    cntr_update(c, |x| match u32::try_from(v) {
        Ok(v) => {
            x.add(v);
            Ok(())
        }
        Err(_) => x.add_wide(v, 0),
    })
}

unsafe extern "C" fn cntr_adderr(c: *mut abi::fid_cntr, v: u64) -> c_int {
    cntr_update(c, |x| match u32::try_from(v) {
        Ok(v) => {
            x.add_error(v);
            Ok(())
        }
        Err(_) => x.add_wide(0, v),
    })
}

unsafe extern "C" fn cntr_set(c: *mut abi::fid_cntr, v: u64) -> c_int {
    cntr_update(c, |x| x.set(v))
}

unsafe extern "C" fn cntr_seterr(c: *mut abi::fid_cntr, v: u64) -> c_int {
    cntr_update(c, |x| x.set_error(v))
}

/// `fi_cntr_wait`: progresses until the success value reaches `threshold` (0), the error
/// value changes (`-FI_EAVAIL`) or `timeout` milliseconds pass (`-FI_ETIMEDOUT`; a negative
/// timeout waits for ever). The lock is let go between rounds.
unsafe extern "C" fn cntr_wait(c: *mut abi::fid_cntr, threshold: u64, timeout: c_int) -> c_int {
    let start = std::time::Instant::now();
    let err0 = match with_cntr(c, |st, k| Ok(st.cntr(k)?.read().1)) {
        Ok(e) => e,
        Err(e) => return neg(e),
    };
    let mut round = 0u32;
    loop {
        match cntr_values(c) {
            Err(e) => return neg(e),
            Ok((_, e)) if e != err0 => return neg(abi::FI_EAVAIL),
            Ok((s, _)) if s >= threshold => return 0,
            Ok(_) => {}
        }
        if timeout >= 0 && start.elapsed().as_millis() >= timeout as u128 {
            return neg(abi::FI_ETIMEDOUT);
        }
        round += 1;
        if round % 64 == 0 {
            std::thread::sleep(std::time::Duration::from_micros(50));
        } else {
            std::thread::yield_now();
        }
    }
}

static CNTR_OPS: abi::fi_ops_cntr = abi::fi_ops_cntr {
    size: std::mem::size_of::<abi::fi_ops_cntr>(),
    read: Some(cntr_read),
    readerr: Some(cntr_readerr),
    add: Some(cntr_add),
    set: Some(cntr_set),
    wait: Some(cntr_wait),
    adderr: Some(cntr_adderr),
    seterr: Some(cntr_seterr),
};

// ---- memory registration ----

#[allow(clippy::too_many_arguments)]
fn mr_reg_one(
    st: &mut State,
    dom: usize,
    buf: usize,
    len: usize,
    access: u64,
    offset: u64,
    out: *mut *mut abi::fid_mr,
    context: *mut c_void,
) -> Result<c_int, Errno> {
    st.check(dom, Kind::Domain)?;
    // fi_mr(3): the offset "is reserved for future use and must be 0".
    if out.is_null() || buf == 0 || len == 0 || offset != 0 {
        return Err(abi::FI_EINVAL);
    }
    let acc = prov::mr_access(access)?;
    // SAFETY: the application registers its own mapped memory (fi_mr_reg(3)) and keeps it
    // mapped until it closes the region.
    let mr = unsafe { st.reg_access(dom, buf, len, acc)? };
    let key = mr.rkey() as u64;
    let p = adopt(
        st,
        abi::fid_mr {
            fid: fid_of(abi::FI_CLASS_MR, context),
            mem_desc: std::ptr::null_mut(),
            key,
        },
        Obj::Mr(prov::Mr { mr, access: acc }),
        dom,
    );
    // SAFETY: `p` was just allocated by `publish`.
    unsafe { (*p).mem_desc = p as *mut c_void };
    put(out, p).map(|()| 0)
}

unsafe extern "C" fn mr_reg(
    fid: *mut abi::fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    offset: u64,
    _key: u64,
    _flags: u64,
    out: *mut *mut abi::fid_mr,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        mr_reg_one(
            st,
            fid as usize,
            buf as usize,
            len,
            access,
            offset,
            out,
            context,
        )
    })
}

/// The `(base, len)` pairs of an iovec array.
///
/// # Safety
/// `iov` is NULL or holds `count` iovecs.
unsafe fn iovs(iov: *const abi::iovec, count: usize) -> Result<Vec<(usize, usize)>, Errno> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if iov.is_null() || count > 64 {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: `count` iovecs, per the caller.
    let v = unsafe { std::slice::from_raw_parts(iov, count) };
    Ok(v.iter().map(|i| (i.iov_base as usize, i.iov_len)).collect())
}

unsafe extern "C" fn mr_regv(
    fid: *mut abi::fid,
    iov: *const abi::iovec,
    count: usize,
    access: u64,
    offset: u64,
    _key: u64,
    _flags: u64,
    out: *mut *mut abi::fid_mr,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(fid as usize, Kind::Domain)?;
        // SAFETY: `count` iovecs (fi_mr_regv(3)).
        let v = unsafe { iovs(iov, count)? };
        let [(b, l)] = v[..] else {
            return Err(abi::FI_EINVAL);
        };
        mr_reg_one(st, fid as usize, b, l, access, offset, out, context)
    })
}

unsafe extern "C" fn mr_regattr(
    fid: *mut abi::fid,
    attr: *const abi::fi_mr_attr,
    _flags: u64,
    out: *mut *mut abi::fid_mr,
) -> c_int {
    run(|st| {
        st.check(fid as usize, Kind::Domain)?;
        // SAFETY: NULL or the caller's attributes (fi_mr_regattr(3)).
        let a = unsafe { attr.as_ref() }.ok_or(abi::FI_EINVAL)?;
        // SAFETY: `iov_count` iovecs, per fi_mr_regattr(3).
        let v = unsafe { iovs(a.mr_iov, a.iov_count)? };
        let [(b, l)] = v[..] else {
            return Err(abi::FI_EINVAL);
        };
        mr_reg_one(st, fid as usize, b, l, a.access, a.offset, out, a.context)
    })
}

static MR_OPS: abi::fi_ops_mr = abi::fi_ops_mr {
    size: std::mem::size_of::<abi::fi_ops_mr>(),
    reg: Some(mr_reg),
    regv: Some(mr_regv),
    regattr: Some(mr_regattr),
};

// ---- completion queue ----

/// Copies taken entries out: `words` u64s per entry into `buf`, sources into `src`.
fn copy_out(buf: *mut c_void, src: *mut u64, w: &[u64], s: &[u64]) -> isize {
    // SAFETY: `buf` holds `count` entries of the CQ's format (fi_cq_read(3)) and `w` is at
    // most `count` entries of that format; `src`, when given, holds `count` addresses.
    unsafe {
        std::ptr::copy_nonoverlapping(w.as_ptr(), buf as *mut u64, w.len());
        if !src.is_null() {
            std::ptr::copy_nonoverlapping(s.as_ptr(), src, s.len());
        }
    }
    s.len() as isize
}

fn cq_read_inner(cq: *mut abi::fid_cq, buf: *mut c_void, count: usize, src: *mut u64) -> isize {
    run_s(|st| {
        st.check(cq as usize, Kind::Cq)?;
        if buf.is_null() && count > 0 {
            return Err(abi::FI_EINVAL);
        }
        st.progress();
        let taken = st.cq_mut(cq as usize)?.take(count);
        st.wait_sync(cq as usize);
        let (w, s) = taken?;
        Ok(copy_out(buf, src, &w, &s))
    })
}

unsafe extern "C" fn cq_read(cq: *mut abi::fid_cq, buf: *mut c_void, count: usize) -> isize {
    cq_read_inner(cq, buf, count, std::ptr::null_mut())
}

unsafe extern "C" fn cq_readfrom(
    cq: *mut abi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src: *mut abi::fi_addr_t,
) -> isize {
    cq_read_inner(cq, buf, count, src)
}

fn cq_sread_inner(
    cq: *mut abi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src: *mut u64,
    timeout: c_int,
) -> isize {
    let start = std::time::Instant::now();
    loop {
        let r = cq_read_inner(cq, buf, count, src);
        if r != -(abi::FI_EAGAIN as isize) {
            return r;
        }
        // fi_cq_signal unblocks a waiting reader: it returns -FI_EAGAIN at once.
        let signaled = run(|st| Ok(std::mem::take(&mut st.cq_mut(cq as usize)?.signaled) as c_int));
        if signaled == 1 || (timeout >= 0 && start.elapsed().as_millis() >= timeout as u128) {
            return r;
        }
        if let Err(e) = rest(start, timeout) {
            return neg(e) as isize;
        }
    }
}

/// How long a blocking read looks again at once (each look gives a served NIC its turn,
/// a nap of tens of µs) before it sleeps on the NICs' interrupts, which take longer to
/// wake it: a quick answer is not slowed, and a long wait costs no CPU.
const LOOK_FIRST: std::time::Duration = std::time::Duration::from_millis(1);

/// Waits a while in a blocking read that found nothing (`timeout` ms from `start`;
/// negative: no limit): for its first [`LOOK_FIRST`] not at all, then on served NICs until
/// the next interrupt of one of them (at most a slice, so another thread's progress is
/// seen too), in-process not at all (the caller's next look moves the fabric).
/// `-FI_EINTR` when a signal handler ran during a sleep.
fn rest(start: std::time::Instant, timeout: c_int) -> Result<(), Errno> {
    let mut fds = None;
    if start.elapsed() >= LOOK_FIRST {
        run(|st| {
            fds = st.rest_fds();
            Ok(0)
        });
    }
    match fds {
        Some(fds) => {
            let waited = start.elapsed().as_millis() as u64;
            let left = (timeout >= 0).then(|| (timeout as u64).saturating_sub(waited));
            prov::sleep_on_any(&fds, left)
        }
        None => {
            std::thread::yield_now();
            Ok(())
        }
    }
}

unsafe extern "C" fn cq_sread(
    cq: *mut abi::fid_cq,
    buf: *mut c_void,
    count: usize,
    _cond: *const c_void,
    timeout: c_int,
) -> isize {
    cq_sread_inner(cq, buf, count, std::ptr::null_mut(), timeout)
}

unsafe extern "C" fn cq_sreadfrom(
    cq: *mut abi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src: *mut abi::fi_addr_t,
    _cond: *const c_void,
    timeout: c_int,
) -> isize {
    cq_sread_inner(cq, buf, count, src, timeout)
}

unsafe extern "C" fn cq_readerr(
    cq: *mut abi::fid_cq,
    out: *mut abi::fi_cq_err_entry,
    _flags: u64,
) -> isize {
    run_s(|st| {
        st.check(cq as usize, Kind::Cq)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let e = st
            .cq_mut(cq as usize)?
            .errs
            .pop_front()
            .ok_or(abi::FI_EAGAIN)?;
        // SAFETY: `out` is non-NULL and points at the caller's error entry.
        let o = unsafe { &mut *out };
        o.op_context = e.ctx as *mut c_void;
        o.flags = e.flags;
        o.len = e.len as usize;
        o.buf = e.buf as *mut c_void;
        o.data = e.data;
        o.tag = e.tag;
        o.olen = e.olen as usize;
        o.err = e.err;
        o.prov_errno = e.prov_errno;
        // err_data is the caller's buffer when err_data_size > 0 (API >= 1.5): leave it.
        o.err_data_size = 0;
        Ok(1)
    })
}

unsafe extern "C" fn cq_signal(cq: *mut abi::fid_cq) -> c_int {
    run(|st| {
        st.cq_mut(cq as usize)?.signaled = true;
        Ok(0)
    })
}

unsafe extern "C" fn cq_strerror(
    _: *mut abi::fid_cq,
    _: c_int,
    _: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    strerror_into(buf, len)
}

static CQ_OPS: abi::fi_ops_cq = abi::fi_ops_cq {
    size: std::mem::size_of::<abi::fi_ops_cq>(),
    read: Some(cq_read),
    readfrom: Some(cq_readfrom),
    readerr: Some(cq_readerr),
    sread: Some(cq_sread),
    sreadfrom: Some(cq_sreadfrom),
    signal: Some(cq_signal),
    strerror: Some(cq_strerror),
};

// ---- address vector ----

unsafe extern "C" fn av_insert(
    av: *mut abi::fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut abi::fi_addr_t,
    flags: u64,
    ctx: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(av as usize, Kind::Av)?;
        if count == 0 {
            return Ok(0);
        }
        if addr.is_null() || count > (1 << 20) {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: `count` packed addresses of the AV's format (fi_av_insert(3)): the
        // provider's own and `struct sockaddr_in` are both ADDR_LEN bytes.
        let b = unsafe { std::slice::from_raw_parts(addr as *const u8, count * prov::ADDR_LEN) };
        // FI_SYNC_ERR: `ctx` is an array of `count` ints, each address's status.
        let sync_err = flags & abi::FI_SYNC_ERR != 0;
        if sync_err && ctx.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let a = st.av_mut(av as usize)?;
        let mut n = 0;
        for (i, c) in b.chunks(prov::ADDR_LEN).enumerate() {
            // Either format; an address that names no endpoint fails alone, its entry
            // FI_ADDR_NOTAVAIL (fi_av(3)).
            let (v, status) = match prov::dest_from_bytes(c) {
                Ok(x) => match a.insert(prov::resolve_addr(&x)) {
                    Ok(i) => {
                        n += 1;
                        (i, 0)
                    }
                    // A read-only AV takes none.
                    Err(e) if e == abi::FI_EINVAL => return Err(e),
                    Err(e) => (prov::ADDR_UNSPEC, e as c_int),
                },
                Err(e) => (prov::ADDR_UNSPEC, e as c_int),
            };
            if !fi_addr.is_null() {
                // SAFETY: `fi_addr`, when given, holds `count` entries (fi_av_insert(3)).
                unsafe { *fi_addr.add(i) = v };
            }
            if sync_err {
                // SAFETY: with FI_SYNC_ERR `ctx` holds `count` ints (fi_av(3)).
                unsafe { *(ctx as *mut c_int).add(i) = status };
            }
        }
        Ok(n)
    })
}

enosys!(
    av_insertsvc(
        *mut abi::fid_av,
        *const c_char,
        *const c_char,
        *mut abi::fi_addr_t,
        u64,
        *mut c_void,
    ) -> c_int
);
enosys!(
    av_insertsym(
        *mut abi::fid_av,
        *const c_char,
        usize,
        *const c_char,
        usize,
        *mut abi::fi_addr_t,
        u64,
        *mut c_void,
    ) -> c_int
);
enosys!(
    av_set(
        *mut abi::fid_av,
        *mut abi::fi_av_set_attr,
        *mut *mut abi::fid_av_set,
        *mut c_void,
    ) -> c_int
);

unsafe extern "C" fn av_remove(
    av: *mut abi::fid_av,
    fi_addr: *mut abi::fi_addr_t,
    count: usize,
    _flags: u64,
) -> c_int {
    run(|st| {
        st.check(av as usize, Kind::Av)?;
        if count == 0 {
            return Ok(0);
        }
        if fi_addr.is_null() || count > (1 << 20) {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: `count` addresses (fi_av_remove(3)).
        let v = unsafe { std::slice::from_raw_parts(fi_addr, count) }.to_vec();
        let a = st.av_mut(av as usize)?;
        for x in v {
            a.remove(x)?;
        }
        Ok(0)
    })
}

unsafe extern "C" fn av_lookup(
    av: *mut abi::fid_av,
    fi_addr: abi::fi_addr_t,
    addr: *mut c_void,
    addrlen: *mut usize,
) -> c_int {
    run(|st| {
        st.check(av as usize, Kind::Av)?;
        if addrlen.is_null() {
            return Err(abi::FI_EINVAL);
        }
        let v = st.av_mut(av as usize)?;
        // In the AV's format (fi_av(3): that of the addresses it stores).
        let a = v
            .get(fi_addr)
            .map(|a| v.format.out(&a))
            .ok_or(abi::FI_EINVAL)?;
        // SAFETY: `addrlen` is non-NULL: the caller's buffer length.
        let have = unsafe { *addrlen };
        if !addr.is_null() {
            // SAFETY: `addr` holds `have` bytes (fi_av_lookup(3)); at most that many are written.
            unsafe {
                std::ptr::copy_nonoverlapping(a.as_ptr(), addr as *mut u8, have.min(a.len()))
            };
        }
        // SAFETY: as above.
        unsafe { *addrlen = a.len() };
        Ok(0)
    })
}

unsafe extern "C" fn av_straddr(
    _av: *mut abi::fid_av,
    addr: *const c_void,
    buf: *mut c_char,
    len: *mut usize,
) -> *const c_char {
    if addr.is_null() || buf.is_null() || len.is_null() {
        return std::ptr::null();
    }
    // SAFETY: `addr` is one of this provider's addresses (fi_av_straddr(3)).
    let a = unsafe { std::slice::from_raw_parts(addr as *const u8, prov::ADDR_LEN) };
    let s = prov::addr_str(a);
    // SAFETY: `len` is non-NULL: the length of `buf`.
    let have = unsafe { *len };
    if have > 0 {
        let n = s.len().min(have - 1);
        // SAFETY: `buf` holds `have` bytes; `n + 1 <= have` are written.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
            *buf.add(n) = 0;
        }
    }
    // SAFETY: as above.
    unsafe { *len = s.len() + 1 };
    buf
}

static AV_OPS: abi::fi_ops_av = abi::fi_ops_av {
    size: std::mem::size_of::<abi::fi_ops_av>(),
    insert: Some(av_insert),
    insertsvc: Some(av_insertsvc),
    insertsym: Some(av_insertsym),
    remove: Some(av_remove),
    lookup: Some(av_lookup),
    straddr: Some(av_straddr),
    av_set: Some(av_set),
};

// ---- endpoint ----

/// `fi_cancel`: tagged receives still waiting (prov/peek.rs); 0 once submitted.
unsafe extern "C" fn ep_cancel(fid: *mut abi::fid, ctx: *mut c_void) -> isize {
    run_s(|st| {
        let ep = st.ep_key(fid as usize);
        st.check(ep, Kind::Ep)?;
        st.cancel(ep, ctx as u64)?;
        Ok(0)
    })
}
/// `fi_getopt` (fi_endpoint(3)): `FI_OPT_MIN_MULTI_RECV` at level `FI_OPT_ENDPOINT`, a
/// `size_t`; `*optlen` is its size on return (`-FI_ETOOSMALL` if the caller's was less).
/// Any other option: `-FI_ENOPROTOOPT`.
unsafe extern "C" fn ep_getopt(
    fid: *mut abi::fid,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut usize,
) -> c_int {
    run(|st| {
        let key = fid as usize;
        let pep = matches!(st.objs.get(&key), Some(prov::Obj::Pep(_)));
        let ep = st.ep_key(key);
        let connected = pep || st.ep_mut(ep).is_ok_and(|e| e.msg.is_some());
        let cm_data = level == abi::FI_OPT_ENDPOINT as c_int
            && name == abi::FI_OPT_CM_DATA_SIZE as c_int
            && connected;
        if !pep {
            st.check(ep, Kind::Ep)?;
        }
        if !cm_data {
            min_multi_recv_opt(level, name)?;
        }
        if val.is_null() || len.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // FI_OPT_CM_DATA_SIZE of a connected or passive endpoint: the most private data a
        // connection call carries.
        let min = if cm_data {
            CM_DATA_MAX
        } else {
            st.ep_mut(ep)?.min_multi_recv as usize
        };
        // SAFETY: non-NULL: the caller's length word (fi_endpoint(3)).
        let room = unsafe { len.read() };
        // SAFETY: as above.
        unsafe { len.write(std::mem::size_of::<usize>()) };
        if room < std::mem::size_of::<usize>() {
            return Err(abi::FI_ETOOSMALL);
        }
        // SAFETY: non-NULL, `*optlen` (at least a size_t's) bytes of the caller's.
        unsafe { (val as *mut usize).write_unaligned(min) };
        Ok(0)
    })
}

/// `fi_setopt`: `FI_OPT_MIN_MULTI_RECV` (a `size_t`, for the multi-receive buffers posted
/// after it); any other option `-FI_ENOPROTOOPT`.
unsafe extern "C" fn ep_setopt(
    fid: *mut abi::fid,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: usize,
) -> c_int {
    run(|st| {
        let ep = st.ep_key(fid as usize);
        st.check(ep, Kind::Ep)?;
        min_multi_recv_opt(level, name)?;
        if val.is_null() || len != std::mem::size_of::<usize>() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: non-NULL, a size_t of the caller's (`optlen` checked).
        let min = unsafe { (val as *const usize).read_unaligned() };
        st.ep_mut(ep)?.min_multi_recv = min as u64;
        Ok(0)
    })
}

/// Whether (`level`, `name`) is the one option endpoints have.
fn min_multi_recv_opt(level: c_int, name: c_int) -> Result<(), Errno> {
    if level == abi::FI_OPT_ENDPOINT as c_int && name == abi::FI_OPT_MIN_MULTI_RECV as c_int {
        Ok(())
    } else {
        Err(abi::FI_ENOPROTOOPT)
    }
}
unsafe extern "C" fn ep_tx_ctx(
    sep: *mut abi::fid_ep,
    index: c_int,
    attr: *mut abi::fi_tx_attr,
    out: *mut *mut abi::fid_ep,
    context: *mut c_void,
) -> c_int {
    // SAFETY: NULL or the caller's attributes (fi_endpoint(3)).
    let flags = unsafe { attr.as_ref() }.map(|a| a.op_flags);
    sep_ctx(sep, index, flags, out, context, false)
}

unsafe extern "C" fn ep_rx_ctx(
    sep: *mut abi::fid_ep,
    index: c_int,
    attr: *mut abi::fi_rx_attr,
    out: *mut *mut abi::fid_ep,
    context: *mut c_void,
) -> c_int {
    // SAFETY: NULL or the caller's attributes (fi_endpoint(3)).
    let flags = unsafe { attr.as_ref() }.map(|a| a.op_flags);
    sep_ctx(sep, index, flags, out, context, true)
}
enosys!(ep_size_left(*mut abi::fid_ep) -> isize);

static EP_OPS: abi::fi_ops_ep = abi::fi_ops_ep {
    size: std::mem::size_of::<abi::fi_ops_ep>(),
    cancel: Some(ep_cancel),
    getopt: Some(ep_getopt),
    setopt: Some(ep_setopt),
    tx_ctx: Some(ep_tx_ctx),
    rx_ctx: Some(ep_rx_ctx),
    rx_size_left: Some(ep_size_left),
    tx_size_left: Some(ep_size_left),
};

/// Copies address `a` into the caller's `addr` of `*len` bytes (fi_cm(3)): `*len` becomes
/// its size; `-FI_ETOOSMALL` when it does not fit.
fn give_addr(a: &[u8], addr: *mut c_void, len: *mut usize) -> Result<c_int, Errno> {
    if len.is_null() {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: `len` is non-NULL: the caller's buffer length.
    let have = unsafe { *len };
    // SAFETY: as above.
    unsafe { *len = a.len() };
    if have < a.len() || addr.is_null() {
        return Err(abi::FI_ETOOSMALL);
    }
    // SAFETY: `addr` holds `have >= a.len()` bytes (fi_getname(3)).
    unsafe { std::ptr::copy_nonoverlapping(a.as_ptr(), addr as *mut u8, a.len()) };
    Ok(0)
}

unsafe extern "C" fn cm_getname(fid: *mut abi::fid, addr: *mut c_void, len: *mut usize) -> c_int {
    run(|st| {
        let a = match st.objs.get(&(fid as usize)) {
            Some(prov::Obj::Pep(p)) => p.format.out(&p.addr),
            _ => {
                // (A scalable endpoint's context has its endpoint's address.)
                let e = st.ep_mut(st.ep_key(fid as usize))?;
                e.format.out(&prov::sep::base(&e.addr))
            }
        };
        give_addr(&a, addr, len)
    })
}

unsafe extern "C" fn cm_getpeer(ep: *mut abi::fid_ep, addr: *mut c_void, len: *mut usize) -> c_int {
    run(|st| {
        let key = st.ep_key(ep as usize);
        let e = st.ep_mut(key)?;
        let m = e.msg.as_ref().ok_or(abi::FI_ENOSYS)?;
        let peer = e.format.out(&m.key.ok_or(abi::FI_ENOTCONN)?.0);
        give_addr(&peer, addr, len)
    })
}

/// The caller's private data of a connection call: `len` bytes at `p` (at most what the
/// connection manager carries).
fn param<'a>(p: *const c_void, len: usize) -> Result<&'a [u8], Errno> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() || len > CM_DATA_MAX {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: non-NULL: `len` bytes of the caller's (fi_cm(3)).
    Ok(unsafe { std::slice::from_raw_parts(p as *const u8, len) })
}

/// Most private data a connection call carries (what every CM message has room for).
const CM_DATA_MAX: usize = 56;

unsafe extern "C" fn cm_connect(
    ep: *mut abi::fid_ep,
    addr: *const c_void,
    p: *const c_void,
    len: usize,
) -> c_int {
    run(|st| {
        if addr.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: non-NULL: an address of the endpoint's format (fi_cm(3)), ADDR_LEN bytes
        // (the provider's own or a `struct sockaddr_in`, either taken).
        let to = unsafe { std::slice::from_raw_parts(addr as *const u8, prov::ADDR_LEN) };
        let to = prov::dest_from_bytes(to)?;
        st.connect(st.ep_key(ep as usize), &to, param(p, len)?)
            .map(|()| 0)
    })
}

unsafe extern "C" fn cm_listen(pep: *mut abi::fid_pep) -> c_int {
    run(|st| st.listen(pep as usize).map(|()| 0))
}

unsafe extern "C" fn cm_accept(ep: *mut abi::fid_ep, p: *const c_void, len: usize) -> c_int {
    run(|st| {
        st.accept(st.ep_key(ep as usize), param(p, len)?)
            .map(|()| 0)
    })
}

unsafe extern "C" fn cm_reject(
    pep: *mut abi::fid_pep,
    handle: *mut abi::fid,
    p: *const c_void,
    len: usize,
) -> c_int {
    run(|st| {
        st.reject(pep as usize, handle as usize, param(p, len)?)
            .map(|()| 0)
    })
}

unsafe extern "C" fn cm_shutdown(ep: *mut abi::fid_ep, _: u64) -> c_int {
    run(|st| st.shutdown(st.ep_key(ep as usize)).map(|()| 0))
}

/// `fi_setname` of an endpoint (before `fi_enable`) or passive endpoint (before
/// `fi_listen`): [`prov::State::setname`]. An address shorter than the provider's
/// 16 bytes (those of a `struct sockaddr_in` too) is `-FI_EINVAL`.
unsafe extern "C" fn cm_setname(fid: *mut abi::fid, addr: *mut c_void, len: usize) -> c_int {
    run(|st| {
        if addr.is_null() || len < prov::ADDR_LEN {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: non-NULL: `len >= ADDR_LEN` bytes of the caller's (fi_cm(3)); only the
        // first ADDR_LEN are read.
        let b = unsafe { std::slice::from_raw_parts(addr as *const u8, prov::ADDR_LEN) };
        st.setname(st.ep_key(fid as usize), b).map(|()| 0)
    })
}
enosys!(cm_join(*mut abi::fid_ep, *const c_void, u64, *mut *mut abi::fid_mc, *mut c_void) -> c_int);

/// The service number an application chose (fi_getinfo with FI_SOURCE): in the info's
/// source address, when it is one of this provider's with a number.
fn info_service(info: &abi::fi_info) -> Option<u64> {
    if info.src_addr.is_null() || info.src_addrlen < prov::ADDR_LEN {
        return None;
    }
    // SAFETY: non-NULL, `src_addrlen >= ADDR_LEN` bytes (fi_getinfo(3)).
    let a = unsafe { std::slice::from_raw_parts(info.src_addr as *const u8, prov::ADDR_LEN) };
    prov::addr_from_bytes(a)
        .and_then(|a| prov::parse_addr(&a))
        .map(|(_, s)| s)
        .filter(|&s| s != 0)
}

/// The NIC an info names by its domain (`rbN`), or this process's default NIC when it
/// names none; `-FI_ENODATA` for another name.
///
/// # Safety
/// `info`'s domain attribute is NULL or valid, its name NULL or a string (fi_getinfo(3)).
unsafe fn info_nic(info: &abi::fi_info) -> Result<usize, Errno> {
    // SAFETY: per the caller.
    let name = unsafe { info.domain_attr.as_ref() }.and_then(|d| unsafe { crate::string(d.name) });
    match name {
        Some(n) => n
            .strip_prefix("rb")
            .and_then(|i| i.parse::<usize>().ok())
            .ok_or(abi::FI_ENODATA),
        None => Ok(crate::claim::default_nic()),
    }
}

/// `fi_passive_ep`: a passive endpoint on the NIC of `info`'s domain, on the service number
/// of its source address when the application chose one (FI_SOURCE).
pub unsafe extern "C" fn passive_ep(
    fabric: *mut abi::fid_fabric,
    info: *mut abi::fi_info,
    out: *mut *mut abi::fid_pep,
    context: *mut c_void,
) -> c_int {
    run(|st| {
        st.check(fabric as usize, Kind::Fabric)?;
        if out.is_null() {
            return Err(abi::FI_EINVAL);
        }
        // SAFETY: NULL or the info libfabric passes on (fi_endpoint(3)).
        let info = unsafe { info.as_ref() }.ok_or(abi::FI_EINVAL)?;
        // SAFETY: the info libfabric passes on (fi_getinfo(3)).
        let nic = unsafe { info_nic(info) }?;
        let named = info_service(info);
        let format = prov::Format::of(info.addr_format);
        let mut pep = st.new_pep(nic, named, format)?;
        // SAFETY: an info's attribute pointers are NULL or its own (fi_getinfo(3)).
        let (tx, rx) = unsafe { (info.tx_attr.as_ref(), info.rx_attr.as_ref()) };
        pep.attrs = Some(prov::ListenAttrs {
            format,
            caps: info.caps,
            mode: info.mode,
            tx: tx.copied().unwrap_or_default(),
            rx: rx.copied().unwrap_or_default(),
        });
        let p = adopt(
            st,
            abi::fid_pep {
                fid: fid_of(abi::FI_CLASS_PEP, context),
                ops: &EP_OPS as *const _ as *mut _,
                cm: &CM_OPS as *const _ as *mut _,
            },
            prov::Obj::Pep(pep),
            fabric as usize,
        );
        put(out, p).map(|()| 0)
    })
}

static CM_OPS: abi::fi_ops_cm = abi::fi_ops_cm {
    size: std::mem::size_of::<abi::fi_ops_cm>(),
    setname: Some(cm_setname),
    getname: Some(cm_getname),
    getpeer: Some(cm_getpeer),
    connect: Some(cm_connect),
    listen: Some(cm_listen),
    accept: Some(cm_accept),
    reject: Some(cm_reject),
    shutdown: Some(cm_shutdown),
    join: Some(cm_join),
};

// ---- messages ----

/// `(addr, len, desc)` of an iovec array and its descriptors.
///
/// # Safety
/// `iov` holds `count` iovecs; `desc` is NULL or holds `count` descriptors.
unsafe fn bufs(
    iov: *const abi::iovec,
    desc: *mut *mut c_void,
    count: usize,
) -> Result<Vec<(usize, usize, usize)>, Errno> {
    // SAFETY: per the caller.
    let v = unsafe { iovs(iov, count)? };
    let d: Vec<usize> = if desc.is_null() {
        vec![0; count]
    } else {
        // SAFETY: `count` descriptors, per the caller.
        unsafe { std::slice::from_raw_parts(desc, count) }
            .iter()
            .map(|p| *p as usize)
            .collect()
    };
    Ok(v.into_iter().zip(d).map(|((a, l), d)| (a, l, d)).collect())
}

/// Whether a call without a flags argument asks for a completion: the endpoint's default
/// operation flags hold FI_COMPLETION (transmit side, or receive side when `rx`). Only
/// consulted under selective completion (fi_endpoint(3)).
fn dflt(ep: *mut abi::fid_ep, rx: bool) -> bool {
    dflt_flags(ep, rx) & abi::FI_COMPLETION as u64 != 0
}

/// The default operation flags of endpoint or alias `ep` (receive side when `rx`); 0 for
/// anything else.
fn dflt_flags(ep: *mut abi::fid_ep, rx: bool) -> u64 {
    let mut st = prov::state();
    st.op_flags_mut(ep as usize, rx).map_or(0, |f| *f)
}

/// What the endpoint's (or alias's) default transmit flags ask of a transfer posted without
/// a flags argument, read once: whether it reports a completion (`FI_COMPLETION`, under
/// selective completion), and its trigger when they hold `FI_TRIGGER`, its context then
/// being a triggered context (fi_trigger(3); an alias made with `FI_TRANSMIT | FI_TRIGGER`
/// is how a program asks).
///
/// # Safety
/// With `FI_TRIGGER` in those flags, `ctx` is NULL or a triggered context.
unsafe fn tx_dflt(
    ep: *mut abi::fid_ep,
    ctx: *mut c_void,
) -> Result<(bool, Option<prov::Trig>), Errno> {
    let f = dflt_flags(ep, false);
    // SAFETY: per the caller.
    let trig = unsafe { trigger_of(f, ctx)? };
    Ok((f & abi::FI_COMPLETION as u64 != 0, trig))
}

/// An untagged receive with operation flags `flags` (the call's, or the endpoint's
/// defaults): `FI_COMPLETION` (under selective completion) and `FI_MULTI_RECV` count.
fn recv_common(
    ep: *mut abi::fid_ep,
    b: &[(usize, usize, usize)],
    ctx: *mut c_void,
    flags: u64,
) -> isize {
    let report = flags & abi::FI_COMPLETION as u64 != 0;
    let multi = flags & abi::FI_MULTI_RECV as u64 != 0;
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        // SAFETY: the application's receive buffers stay valid until their completion
        // (fi_msg(3)), a multi-receive buffer until its release.
        unsafe { st.post_recv(ep, b, ctx as u64, report, multi)? };
        Ok(0)
    })
}

#[allow(clippy::too_many_arguments)]
/// How a send takes its data.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inject {
    No,
    /// An `fi_inject` call: copied now, no completion.
    Call,
    /// `FI_INJECT` in a `*msg` call: copied now, completed as usual.
    Flag,
}

#[allow(clippy::too_many_arguments)]
fn send_common(
    ep: *mut abi::fid_ep,
    b: &[(usize, usize, usize)],
    dest: u64,
    ctx: *mut c_void,
    inject: Inject,
    report: bool,
    imm: Option<u32>,
    trig: Option<prov::Trig>,
) -> isize {
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        // SAFETY: the application's send buffers stay valid until their completion, or
        // are read now for an inject (fi_msg(3)).
        unsafe {
            st.post_send(
                ep,
                b,
                prov::SendReq {
                    dest,
                    ctx: ctx as u64,
                    inject: inject != Inject::No,
                    silent: inject == Inject::Call,
                    report,
                    imm,
                    trig,
                },
            )?
        };
        Ok(0)
    })
}

/// A send posted without a flags argument: completion and trigger from the default flags.
fn send_dflt(
    ep: *mut abi::fid_ep,
    b: &[(usize, usize, usize)],
    dest: u64,
    ctx: *mut c_void,
    imm: Option<u32>,
) -> isize {
    // SAFETY: the context of a send posted with FI_TRIGGER in the default flags.
    match unsafe { tx_dflt(ep, ctx) } {
        Ok((report, t)) => send_common(ep, b, dest, ctx, Inject::No, report, imm, t),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn msg_recv(
    ep: *mut abi::fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    _src: abi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    recv_common(
        ep,
        &[(buf as usize, len, desc as usize)],
        ctx,
        dflt_flags(ep, true),
    )
}

unsafe extern "C" fn msg_recvv(
    ep: *mut abi::fid_ep,
    iov: *const abi::iovec,
    desc: *mut *mut c_void,
    count: usize,
    _src: abi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: `count` iovecs and descriptors (fi_recvv(3)).
    match unsafe { bufs(iov, desc, count) } {
        Ok(b) => recv_common(ep, &b, ctx, dflt_flags(ep, true)),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn msg_recvmsg(
    ep: *mut abi::fid_ep,
    msg: *const abi::fi_msg,
    flags: u64,
) -> isize {
    // SAFETY: NULL or the caller's message (fi_recvmsg(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(abi::FI_EINVAL as isize);
    };
    if flags & abi::FI_TRIGGER as u64 != 0 {
        // The NIC's table holds send-side work only.
        return -(abi::FI_ENOSYS as isize);
    }
    // SAFETY: the message's `iov_count` iovecs and descriptors.
    match unsafe { bufs(m.msg_iov, m.desc, m.iov_count) } {
        Ok(b) => recv_common(ep, &b, m.context, flags),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn msg_send(
    ep: *mut abi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest: abi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    send_dflt(ep, &[(buf as usize, len, desc as usize)], dest, ctx, None)
}

unsafe extern "C" fn msg_sendv(
    ep: *mut abi::fid_ep,
    iov: *const abi::iovec,
    desc: *mut *mut c_void,
    count: usize,
    dest: abi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: `count` iovecs and descriptors (fi_sendv(3)).
    match unsafe { bufs(iov, desc, count) } {
        Ok(b) => send_dflt(ep, &b, dest, ctx, None),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn msg_sendmsg(
    ep: *mut abi::fid_ep,
    msg: *const abi::fi_msg,
    flags: u64,
) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe { sendmsg_t(ep, msg, flags, None) }
}

/// `fi_sendmsg`, or deferred work's send (`work`).
///
/// # Safety
/// `msg` is NULL or a message as fi_sendmsg(3) describes it.
unsafe fn sendmsg_t(
    ep: *mut abi::fid_ep,
    msg: *const abi::fi_msg,
    flags: u64,
    work: Option<prov::Trig>,
) -> isize {
    // SAFETY: NULL or the caller's message (fi_sendmsg(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(abi::FI_EINVAL as isize);
    };
    // SAFETY: the context of a message sent with FI_TRIGGER (fi_trigger(3)).
    let trig = match work.map_or_else(|| unsafe { trigger_of(flags, m.context) }, |t| Ok(Some(t))) {
        Ok(t) => t,
        Err(e) => return -(e as isize),
    };
    // SAFETY: the message's `iov_count` iovecs and descriptors.
    match unsafe { bufs(m.msg_iov, m.desc, m.iov_count) } {
        Ok(b) => send_common(
            ep,
            &b,
            m.addr,
            m.context,
            if flags & abi::FI_INJECT as u64 != 0 {
                Inject::Flag
            } else {
                Inject::No
            },
            flags & abi::FI_COMPLETION as u64 != 0,
            (flags & abi::FI_REMOTE_CQ_DATA as u64 != 0).then_some(m.data as u32),
            trig,
        ),
        Err(e) => -(e as isize),
    }
}

/// The trigger of an operation posted with `FI_TRIGGER`, whose context is a
/// `struct fi_triggered_context` (fi_trigger(3)); `None` without the flag. Threshold
/// triggers only (`-FI_ENOSYS` for others).
///
/// # Safety
/// With `FI_TRIGGER` in `flags`, `ctx` is NULL or a triggered context.
unsafe fn trigger_of(flags: u64, ctx: *mut c_void) -> Result<Option<prov::Trig>, Errno> {
    if flags & abi::FI_TRIGGER as u64 == 0 {
        return Ok(None);
    }
    // SAFETY: per the caller.
    let c = unsafe { (ctx as *const abi::fi_triggered_context).as_ref() }.ok_or(abi::FI_EINVAL)?;
    if c.event_type != abi::fi_trigger_event_FI_TRIGGER_THRESHOLD {
        return Err(abi::FI_ENOSYS);
    }
    // SAFETY: the threshold member, which FI_TRIGGER_THRESHOLD selects.
    let th = unsafe { c.trigger.threshold };
    Ok(Some(prov::Trig {
        cntr: th.cntr as usize,
        threshold: th.threshold as u64,
        work: None,
    }))
}

unsafe extern "C" fn msg_inject(
    ep: *mut abi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: abi::fi_addr_t,
) -> isize {
    send_common(
        ep,
        &[(buf as usize, len, 0)],
        dest,
        std::ptr::null_mut(),
        Inject::Call,
        false,
        None,
        None,
    )
}

unsafe extern "C" fn msg_senddata(
    ep: *mut abi::fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest: abi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    send_dflt(
        ep,
        &[(buf as usize, len, desc as usize)],
        dest,
        ctx,
        Some(data as u32),
    )
}

unsafe extern "C" fn msg_injectdata(
    ep: *mut abi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: abi::fi_addr_t,
) -> isize {
    send_common(
        ep,
        &[(buf as usize, len, 0)],
        dest,
        std::ptr::null_mut(),
        Inject::Call,
        false,
        Some(data as u32),
        None,
    )
}

static MSG_OPS: abi::fi_ops_msg = abi::fi_ops_msg {
    size: std::mem::size_of::<abi::fi_ops_msg>(),
    recv: Some(msg_recv),
    recvv: Some(msg_recvv),
    recvmsg: Some(msg_recvmsg),
    send: Some(msg_send),
    sendv: Some(msg_sendv),
    sendmsg: Some(msg_sendmsg),
    inject: Some(msg_inject),
    senddata: Some(msg_senddata),
    injectdata: Some(msg_injectdata),
};

// ---- tagged messages ----

use abi::{
    fi_addr_t as A, fi_datatype as Dt, fi_ioc as Ioc, fi_op as Op, fid_ep as Ep, iovec as Iov,
};
type V = *mut c_void;
type Cv = *const c_void;
type Dv = *mut *mut c_void;

fn trecv_common(ep: *mut Ep, b: &[(usize, usize, usize)], req: prov::TRecvReq) -> isize {
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        // SAFETY: the application's receive buffers stay valid until their completion
        // (fi_tagged(3)).
        unsafe { st.post_trecv(ep, b, req)? };
        Ok(0)
    })
}

fn tsend_common(ep: *mut Ep, b: &[(usize, usize, usize)], req: prov::SendReq, tag: u64) -> isize {
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        // SAFETY: the application's send buffers stay valid until their completion and are
        // readable now (fi_tagged(3)).
        unsafe { st.post_tsend(ep, b, req, tag)? };
        Ok(0)
    })
}

/// A tagged send posted without a flags argument: completion and trigger from the default
/// flags (whatever `req` says of them).
fn tsend_dflt(ep: *mut Ep, b: &[(usize, usize, usize)], mut req: prov::SendReq, tag: u64) -> isize {
    // SAFETY: the context of a send posted with FI_TRIGGER in the default flags.
    match unsafe { tx_dflt(ep, req.ctx as V) } {
        Ok((report, t)) => {
            req.report = report;
            req.trig = t;
            tsend_common(ep, b, req, tag)
        }
        Err(e) => -(e as isize),
    }
}

fn sreq(dest: A, ctx: V, inject: bool, report: bool, imm: Option<u32>) -> prov::SendReq {
    prov::SendReq {
        dest,
        ctx: ctx as u64,
        inject,
        silent: inject,
        report,
        imm,
        trig: None,
    }
}

unsafe extern "C" fn t_recv(
    ep: *mut Ep,
    buf: V,
    len: usize,
    desc: V,
    src: A,
    tag: u64,
    ignore: u64,
    ctx: V,
) -> isize {
    let req = prov::TRecvReq {
        ctx: ctx as u64,
        tag,
        ignore,
        src,
        report: dflt(ep, true),
    };
    trecv_common(ep, &[(buf as usize, len, desc as usize)], req)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn t_recvv(
    ep: *mut Ep,
    iov: *const Iov,
    desc: Dv,
    count: usize,
    src: A,
    tag: u64,
    ignore: u64,
    ctx: V,
) -> isize {
    let req = prov::TRecvReq {
        ctx: ctx as u64,
        tag,
        ignore,
        src,
        report: dflt(ep, true),
    };
    // SAFETY: `count` iovecs and descriptors (fi_trecvv(3)).
    match unsafe { bufs(iov, desc, count) } {
        Ok(b) => trecv_common(ep, &b, req),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn t_recvmsg(ep: *mut Ep, msg: *const abi::fi_msg_tagged, flags: u64) -> isize {
    // SAFETY: NULL or the caller's message (fi_trecvmsg(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(abi::FI_EINVAL as isize);
    };
    if flags & abi::FI_TRIGGER as u64 != 0 {
        // The NIC's table holds send-side work only.
        return -(abi::FI_ENOSYS as isize);
    }
    let req = prov::TRecvReq {
        ctx: m.context as u64,
        tag: m.tag,
        ignore: m.ignore,
        src: m.addr,
        report: flags & abi::FI_COMPLETION as u64 != 0,
    };
    // SAFETY: the message's `iov_count` iovecs and descriptors.
    let b = match unsafe { bufs(m.msg_iov, m.desc, m.iov_count) } {
        Ok(b) => b,
        Err(e) => return -(e as isize),
    };
    let special = flags & (abi::FI_PEEK as u64 | abi::FI_CLAIM | abi::FI_DISCARD);
    if special == 0 {
        return trecv_common(ep, &b, req);
    }
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        // SAFETY: the application's receive buffers stay valid until their completion
        // (fi_tagged(3)).
        unsafe { st.trecv_special(ep, &b, req, special)? };
        Ok(0)
    })
}

unsafe extern "C" fn t_send(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    desc: V,
    dest: A,
    tag: u64,
    ctx: V,
) -> isize {
    let b = [(buf as usize, len, desc as usize)];
    tsend_dflt(ep, &b, sreq(dest, ctx, false, false, None), tag)
}

unsafe extern "C" fn t_sendv(
    ep: *mut Ep,
    iov: *const Iov,
    desc: Dv,
    count: usize,
    dest: A,
    tag: u64,
    ctx: V,
) -> isize {
    // SAFETY: `count` iovecs and descriptors (fi_tsendv(3)).
    match unsafe { bufs(iov, desc, count) } {
        Ok(b) => tsend_dflt(ep, &b, sreq(dest, ctx, false, false, None), tag),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn t_sendmsg(ep: *mut Ep, msg: *const abi::fi_msg_tagged, flags: u64) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe { tsendmsg_t(ep, msg, flags, None) }
}

/// `fi_tsendmsg`, or deferred work's tagged send (`work`).
///
/// # Safety
/// `msg` is NULL or a message as fi_tsendmsg(3) describes it.
unsafe fn tsendmsg_t(
    ep: *mut Ep,
    msg: *const abi::fi_msg_tagged,
    flags: u64,
    work: Option<prov::Trig>,
) -> isize {
    // SAFETY: NULL or the caller's message (fi_tsendmsg(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(abi::FI_EINVAL as isize);
    };
    // SAFETY: the context of a message sent with FI_TRIGGER (fi_trigger(3)).
    let trig = match work.map_or_else(|| unsafe { trigger_of(flags, m.context) }, |t| Ok(Some(t))) {
        Ok(t) => t,
        Err(e) => return -(e as isize),
    };
    let mut req = sreq(
        m.addr,
        m.context,
        flags & abi::FI_INJECT as u64 != 0,
        flags & abi::FI_COMPLETION as u64 != 0,
        (flags & abi::FI_REMOTE_CQ_DATA as u64 != 0).then_some(m.data as u32),
    );
    req.trig = trig;
    // FI_INJECT in a message: the data is copied, the completion reported as usual.
    req.silent = false;
    // SAFETY: the message's `iov_count` iovecs and descriptors.
    match unsafe { bufs(m.msg_iov, m.desc, m.iov_count) } {
        Ok(b) => tsend_common(ep, &b, req, m.tag),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn t_inject(ep: *mut Ep, buf: Cv, len: usize, dest: A, tag: u64) -> isize {
    let b = [(buf as usize, len, 0)];
    tsend_common(
        ep,
        &b,
        sreq(dest, std::ptr::null_mut(), true, false, None),
        tag,
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn t_senddata(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    desc: V,
    data: u64,
    dest: A,
    tag: u64,
    ctx: V,
) -> isize {
    let b = [(buf as usize, len, desc as usize)];
    tsend_dflt(
        ep,
        &b,
        sreq(dest, ctx, false, false, Some(data as u32)),
        tag,
    )
}

unsafe extern "C" fn t_injectdata(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    data: u64,
    dest: A,
    tag: u64,
) -> isize {
    let b = [(buf as usize, len, 0)];
    let req = sreq(dest, std::ptr::null_mut(), true, false, Some(data as u32));
    tsend_common(ep, &b, req, tag)
}

static TAGGED_OPS: abi::fi_ops_tagged = abi::fi_ops_tagged {
    size: std::mem::size_of::<abi::fi_ops_tagged>(),
    recv: Some(t_recv),
    recvv: Some(t_recvv),
    recvmsg: Some(t_recvmsg),
    send: Some(t_send),
    sendv: Some(t_sendv),
    sendmsg: Some(t_sendmsg),
    inject: Some(t_inject),
    senddata: Some(t_senddata),
    injectdata: Some(t_injectdata),
};

// ---- RMA ----

const RMA_WRITE: u64 = abi::FI_RMA as u64 | abi::FI_WRITE as u64;
const RMA_READ: u64 = abi::FI_RMA as u64 | abi::FI_READ as u64;

fn rma_common(ep: *mut Ep, b: &[(usize, usize, usize)], req: prov::RmaReq) -> isize {
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        // SAFETY: the application's local buffers stay valid until their completion and,
        // for injects, are readable now (fi_rma(3), fi_atomic(3)).
        unsafe { st.post_rma(ep, b, req)? };
        Ok(0)
    })
}

#[allow(clippy::too_many_arguments)]
fn rma_req(
    dest: A,
    ctx: V,
    inject: bool,
    report: bool,
    flags: u64,
    op: prov::RmaOp,
) -> prov::RmaReq {
    prov::RmaReq {
        dest,
        ctx: ctx as u64,
        inject,
        silent: inject,
        report,
        flags,
        op,
        trig: None,
        operand: 0,
    }
}

/// An RMA transfer posted without a flags argument: completion and trigger from the
/// default flags (whatever `req` says of them).
fn rma_dflt(ep: *mut Ep, b: &[(usize, usize, usize)], mut req: prov::RmaReq) -> isize {
    // SAFETY: the context of a transfer posted with FI_TRIGGER in the default flags.
    match unsafe { tx_dflt(ep, req.ctx as V) } {
        Ok((report, t)) => {
            req.report = report;
            req.trig = t;
            rma_common(ep, b, req)
        }
        Err(e) => -(e as isize),
    }
}

fn write_op(addr: u64, key: u64, imm: Option<u64>) -> prov::RmaOp {
    prov::RmaOp::Write {
        addr,
        key,
        imm: imm.map(|d| d as u32),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn r_read(
    ep: *mut Ep,
    buf: V,
    len: usize,
    desc: V,
    src: A,
    addr: u64,
    key: u64,
    ctx: V,
) -> isize {
    let op = prov::RmaOp::Read { addr, key };
    rma_dflt(
        ep,
        &[(buf as usize, len, desc as usize)],
        rma_req(src, ctx, false, false, RMA_READ, op),
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn r_readv(
    ep: *mut Ep,
    iov: *const Iov,
    desc: Dv,
    count: usize,
    src: A,
    addr: u64,
    key: u64,
    ctx: V,
) -> isize {
    let op = prov::RmaOp::Read { addr, key };
    // SAFETY: `count` iovecs and descriptors (fi_readv(3)).
    match unsafe { bufs(iov, desc, count) } {
        Ok(b) => rma_dflt(ep, &b, rma_req(src, ctx, false, false, RMA_READ, op)),
        Err(e) => -(e as isize),
    }
}

/// The single remote segment of an RMA message.
///
/// # Safety
/// `m.rma_iov` is NULL or holds `m.rma_iov_count` entries.
unsafe fn rma_iov1(m: &abi::fi_msg_rma) -> Result<abi::fi_rma_iov, Errno> {
    if m.rma_iov.is_null() || m.rma_iov_count != 1 {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: one entry, per the caller.
    Ok(unsafe { *m.rma_iov })
}

/// `fi_readmsg` / `fi_writemsg`, or deferred work's RMA (`work`).
///
/// # Safety
/// `msg` is NULL or a message as fi_readmsg(3) describes it.
unsafe fn rma_msg(
    ep: *mut Ep,
    msg: *const abi::fi_msg_rma,
    flags: u64,
    write: bool,
    work: Option<prov::Trig>,
) -> isize {
    // SAFETY: NULL or the caller's message (fi_readmsg(3), fi_writemsg(3)).
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return -(abi::FI_EINVAL as isize);
    };
    // SAFETY: the context of a message sent with FI_TRIGGER (fi_trigger(3)).
    let trig = match work.map_or_else(|| unsafe { trigger_of(flags, m.context) }, |t| Ok(Some(t))) {
        Ok(t) => t,
        Err(e) => return -(e as isize),
    };
    // SAFETY: the message's remote segments.
    let r = match unsafe { rma_iov1(m) } {
        Ok(r) => r,
        Err(e) => return -(e as isize),
    };
    let report = flags & abi::FI_COMPLETION as u64 != 0;
    let inject = write && flags & abi::FI_INJECT as u64 != 0;
    let (op, cflags) = if write {
        let imm = (flags & abi::FI_REMOTE_CQ_DATA as u64 != 0).then_some(m.data);
        (write_op(r.addr, r.key, imm), RMA_WRITE)
    } else {
        (
            prov::RmaOp::Read {
                addr: r.addr,
                key: r.key,
            },
            RMA_READ,
        )
    };
    // SAFETY: the message's `iov_count` iovecs and descriptors.
    match unsafe { bufs(m.msg_iov, m.desc, m.iov_count) } {
        Ok(b) if b.iter().map(|x| x.1).sum::<usize>() <= r.len => {
            let mut req = rma_req(m.addr, m.context, inject, report, cflags, op);
            req.trig = trig;
            // FI_INJECT in a message: the data is copied, the completion reported as usual.
            req.silent = false;
            rma_common(ep, &b, req)
        }
        Ok(_) => -(abi::FI_EINVAL as isize),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn r_readmsg(ep: *mut Ep, msg: *const abi::fi_msg_rma, flags: u64) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe { rma_msg(ep, msg, flags, false, None) }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn r_write(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    desc: V,
    dest: A,
    addr: u64,
    key: u64,
    ctx: V,
) -> isize {
    let op = write_op(addr, key, None);
    rma_dflt(
        ep,
        &[(buf as usize, len, desc as usize)],
        rma_req(dest, ctx, false, false, RMA_WRITE, op),
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn r_writev(
    ep: *mut Ep,
    iov: *const Iov,
    desc: Dv,
    count: usize,
    dest: A,
    addr: u64,
    key: u64,
    ctx: V,
) -> isize {
    let op = write_op(addr, key, None);
    // SAFETY: `count` iovecs and descriptors (fi_writev(3)).
    match unsafe { bufs(iov, desc, count) } {
        Ok(b) => rma_dflt(ep, &b, rma_req(dest, ctx, false, false, RMA_WRITE, op)),
        Err(e) => -(e as isize),
    }
}

unsafe extern "C" fn r_writemsg(ep: *mut Ep, msg: *const abi::fi_msg_rma, flags: u64) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe { rma_msg(ep, msg, flags, true, None) }
}

unsafe extern "C" fn r_inject(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    dest: A,
    addr: u64,
    key: u64,
) -> isize {
    let op = write_op(addr, key, None);
    let req = rma_req(dest, std::ptr::null_mut(), true, false, RMA_WRITE, op);
    rma_common(ep, &[(buf as usize, len, 0)], req)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn r_writedata(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    desc: V,
    data: u64,
    dest: A,
    addr: u64,
    key: u64,
    ctx: V,
) -> isize {
    let op = write_op(addr, key, Some(data));
    rma_dflt(
        ep,
        &[(buf as usize, len, desc as usize)],
        rma_req(dest, ctx, false, false, RMA_WRITE, op),
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn r_injectdata(
    ep: *mut Ep,
    buf: Cv,
    len: usize,
    data: u64,
    dest: A,
    addr: u64,
    key: u64,
) -> isize {
    let op = write_op(addr, key, Some(data));
    let req = rma_req(dest, std::ptr::null_mut(), true, false, RMA_WRITE, op);
    rma_common(ep, &[(buf as usize, len, 0)], req)
}

static RMA_OPS: abi::fi_ops_rma = abi::fi_ops_rma {
    size: std::mem::size_of::<abi::fi_ops_rma>(),
    read: Some(r_read),
    readv: Some(r_readv),
    readmsg: Some(r_readmsg),
    write: Some(r_write),
    writev: Some(r_writev),
    writemsg: Some(r_writemsg),
    inject: Some(r_inject),
    writedata: Some(r_writedata),
    injectdata: Some(r_injectdata),
};

// ---- atomics: FI_SUM (fi_atomic, fi_fetch_atomic) and FI_CSWAP (fi_compare_atomic) on
// FI_UINT64 and FI_INT64, one element per operation ----

const ATOMIC_WRITE: u64 = abi::FI_ATOMIC as u64 | abi::FI_WRITE as u64;
const ATOMIC_READ: u64 = abi::FI_ATOMIC as u64 | abi::FI_READ as u64;

/// Which atomic call is asked about.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Write,
    Fetch,
    Compare,
}

/// Whether `(dt, op)` is supported by call `c` (fi_atomic(3)): 64-bit integers only, FI_SUM
/// for fi_atomic and fi_fetch_atomic, FI_CSWAP for fi_compare_atomic.
fn supported(c: Call, dt: Dt, op: Op) -> bool {
    let int64 = dt == abi::fi_datatype_FI_UINT64 || dt == abi::fi_datatype_FI_INT64;
    int64
        && match c {
            Call::Write | Call::Fetch => op == abi::fi_op_FI_SUM,
            Call::Compare => op == abi::fi_op_FI_CSWAP,
        }
}

fn valid_common(ep: *mut Ep, c: Call, dt: Dt, op: Op, count: *mut usize) -> c_int {
    run(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        if !supported(c, dt, op) {
            return Err(abi::FI_EOPNOTSUPP);
        }
        put(count, 1).map(|()| 0)
    })
}

unsafe extern "C" fn a_writevalid(ep: *mut Ep, dt: Dt, op: Op, count: *mut usize) -> c_int {
    valid_common(ep, Call::Write, dt, op, count)
}

unsafe extern "C" fn a_readwritevalid(ep: *mut Ep, dt: Dt, op: Op, count: *mut usize) -> c_int {
    valid_common(ep, Call::Fetch, dt, op, count)
}

unsafe extern "C" fn a_compwritevalid(ep: *mut Ep, dt: Dt, op: Op, count: *mut usize) -> c_int {
    valid_common(ep, Call::Compare, dt, op, count)
}

unsafe extern "C" fn dom_query_atomic(
    dom: *mut abi::fid_domain,
    dt: Dt,
    op: Op,
    attr: *mut abi::fi_atomic_attr,
    flags: u64,
) -> c_int {
    run(|st| {
        st.check(dom as usize, Kind::Domain)?;
        if flags & abi::FI_TAGGED as u64 != 0 {
            // No atomics into tagged receive buffers.
            return Err(abi::FI_EOPNOTSUPP);
        }
        let c = match flags & (abi::FI_FETCH_ATOMIC | abi::FI_COMPARE_ATOMIC) {
            0 => Call::Write,
            abi::FI_FETCH_ATOMIC => Call::Fetch,
            abi::FI_COMPARE_ATOMIC => Call::Compare,
            _ => return Err(abi::FI_EINVAL),
        };
        if !supported(c, dt, op) {
            return Err(abi::FI_EOPNOTSUPP);
        }
        put(attr, abi::fi_atomic_attr { count: 1, size: 8 }).map(|()| 0)
    })
}

/// Reads one 64-bit operand.
///
/// # Safety
/// `p` is NULL or points at `count` elements of 8 bytes.
unsafe fn operand(p: Cv, count: usize) -> Result<u64, Errno> {
    if count > 1 {
        // More elements than the valid calls allow (fi_atomic(3)).
        return Err(abi::FI_EMSGSIZE);
    }
    if p.is_null() || count == 0 {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: one readable 8-byte element, per the caller (fi_atomic(3) buffers need not
    // be aligned).
    Ok(unsafe { (p as *const u64).read_unaligned() })
}

/// The single element of an ioc array.
///
/// # Safety
/// `ioc` is NULL or holds `count` entries; `desc` NULL or `count` descriptors.
unsafe fn ioc1(ioc: *const Ioc, desc: Dv, count: usize) -> Result<(Cv, usize, usize), Errno> {
    if ioc.is_null() || count != 1 {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: one entry each, per the caller.
    let (i, d) = unsafe { (*ioc, if desc.is_null() { 0 } else { *desc as usize }) };
    Ok((i.addr as Cv, i.count, d))
}

/// One atomic operation: `buf` holds the operand, `cmp` the compare value (FI_CSWAP),
/// `res` with its descriptor the fetched value (NULL for fi_atomic).
#[allow(clippy::too_many_arguments)]
fn atomic_common(
    ep: *mut Ep,
    c: Call,
    (buf, count): (Cv, usize),
    cmp: Cv,
    res: (usize, usize),
    (dest, addr, key): (A, u64, u64),
    t: (Dt, Op, V, bool, bool),
) -> isize {
    // Completion and trigger from the default flags; an injected atomic reports nothing
    // and has no context to trigger by.
    let (mut t, mut trig) = (t, None);
    if !t.3 {
        // SAFETY: the context of an atomic posted with FI_TRIGGER in the default flags.
        match unsafe { tx_dflt(ep, t.2) } {
            Ok((report, tr)) => (t.4, trig) = (report, tr),
            Err(e) => return -(e as isize),
        }
    }
    atomic_common_t(ep, c, (buf, count), cmp, res, (dest, addr, key), t, trig)
}

/// [`atomic_common`], triggered by `trig` (the operand is read when it fires).
#[allow(clippy::too_many_arguments)]
fn atomic_common_t(
    ep: *mut Ep,
    c: Call,
    (buf, count): (Cv, usize),
    cmp: Cv,
    res: (usize, usize),
    (dest, addr, key): (A, u64, u64),
    (dt, op, ctx, inject, report): (Dt, Op, V, bool, bool),
    trig: Option<prov::Trig>,
) -> isize {
    run_s(|st| {
        let ep = st.ep_key(ep as usize);
        st.check(ep, Kind::Ep)?;
        if !supported(c, dt, op) {
            return Err(abi::FI_EOPNOTSUPP);
        }
        // SAFETY: the operands are readable now (fi_atomic(3)).
        let v = unsafe { operand(buf, count)? };
        let (rop, flags) = match c {
            Call::Compare => {
                // SAFETY: as above.
                let compare = unsafe { operand(cmp, 1)? };
                let swap = v;
                let r = prov::RmaOp::CmpSwap {
                    addr,
                    key,
                    compare,
                    swap,
                };
                (r, ATOMIC_READ)
            }
            Call::Fetch => (prov::RmaOp::FetchAdd { addr, key, add: v }, ATOMIC_READ),
            Call::Write => (prov::RmaOp::FetchAdd { addr, key, add: v }, ATOMIC_WRITE),
        };
        let b: Vec<(usize, usize, usize)> = if c == Call::Write {
            Vec::new()
        } else if res.0 == 0 {
            return Err(abi::FI_EINVAL);
        } else {
            vec![(res.0, 8, res.1)]
        };
        let mut req = rma_req(dest, ctx, inject, report, flags, rop);
        req.trig = trig;
        req.operand = buf as usize;
        // SAFETY: the result buffer stays valid until the completion (fi_atomic(3)).
        unsafe { st.post_rma(ep, &b, req)? };
        Ok(0)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_write(
    ep: *mut Ep,
    buf: Cv,
    count: usize,
    _desc: V,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
    ctx: V,
) -> isize {
    let null = std::ptr::null();
    atomic_common(
        ep,
        Call::Write,
        (buf, count),
        null,
        (0, 0),
        (dest, addr, key),
        (dt, op, ctx, false, false),
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_writev(
    ep: *mut Ep,
    iov: *const Ioc,
    desc: Dv,
    count: usize,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
    ctx: V,
) -> isize {
    // SAFETY: `count` iocs and descriptors (fi_atomicv(3)).
    match unsafe { ioc1(iov, desc, count) } {
        Ok((b, n, _)) => {
            let t = (dt, op, ctx, false, false);
            atomic_common(
                ep,
                Call::Write,
                (b, n),
                std::ptr::null(),
                (0, 0),
                (dest, addr, key),
                t,
            )
        }
        Err(e) => -(e as isize),
    }
}

/// The single remote element of an atomic message.
///
/// # Safety
/// `m.rma_iov` is NULL or holds `m.rma_iov_count` entries.
unsafe fn rma_ioc1(m: &abi::fi_msg_atomic) -> Result<(u64, u64), Errno> {
    if m.rma_iov.is_null() || m.rma_iov_count != 1 {
        return Err(abi::FI_EINVAL);
    }
    // SAFETY: one entry, per the caller.
    let r = unsafe { *m.rma_iov };
    match r.count {
        1 => {}
        0 => return Err(abi::FI_EINVAL),
        _ => return Err(abi::FI_EMSGSIZE),
    }
    Ok((r.addr, r.key))
}

/// An atomic message's operand and remote element.
///
/// # Safety
/// `msg` is NULL or the caller's message, with its arrays as fi_atomicmsg(3) says.
unsafe fn atomic_msg<'a>(
    msg: *const abi::fi_msg_atomic,
) -> Result<(&'a abi::fi_msg_atomic, Cv, usize, u64, u64), Errno> {
    // SAFETY: per the caller; the message outlives the call it is used in.
    let m = unsafe { msg.as_ref() }.ok_or(abi::FI_EINVAL)?;
    // SAFETY: per the caller.
    let (b, n, _) = unsafe { ioc1(m.msg_iov, m.desc, m.iov_count)? };
    // SAFETY: per the caller.
    let (addr, key) = unsafe { rma_ioc1(m)? };
    Ok((m, b, n, addr, key))
}

unsafe extern "C" fn a_writemsg(ep: *mut Ep, msg: *const abi::fi_msg_atomic, flags: u64) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe { atomicmsg_t(ep, msg, flags, None) }
}

/// `fi_atomicmsg`, or deferred work's atomic (`work`).
///
/// # Safety
/// `msg` is NULL or a message as fi_atomicmsg(3) describes it.
unsafe fn atomicmsg_t(
    ep: *mut Ep,
    msg: *const abi::fi_msg_atomic,
    flags: u64,
    work: Option<prov::Trig>,
) -> isize {
    // SAFETY: as libfabric gave it.
    match unsafe { atomic_msg(msg) } {
        Ok((m, b, n, addr, key)) => {
            // SAFETY: the context of a message sent with FI_TRIGGER (fi_trigger(3)).
            let trig = match work
                .map_or_else(|| unsafe { trigger_of(flags, m.context) }, |t| Ok(Some(t)))
            {
                Ok(t) => t,
                Err(e) => return -(e as isize),
            };
            // FI_INJECT changes nothing: the operand is read now (or, triggered, when the
            // operation fires), and the completion is reported as usual.
            let report = flags & abi::FI_COMPLETION as u64 != 0;
            let null = std::ptr::null();
            let t = (m.datatype, m.op, m.context, false, report);
            atomic_common_t(
                ep,
                Call::Write,
                (b, n),
                null,
                (0, 0),
                (m.addr, addr, key),
                t,
                trig,
            )
        }
        Err(e) => -(e as isize),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_inject(
    ep: *mut Ep,
    buf: Cv,
    count: usize,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
) -> isize {
    let null = std::ptr::null();
    let t = (dt, op, std::ptr::null_mut(), true, false);
    atomic_common(
        ep,
        Call::Write,
        (buf, count),
        null,
        (0, 0),
        (dest, addr, key),
        t,
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_readwrite(
    ep: *mut Ep,
    buf: Cv,
    count: usize,
    _desc: V,
    res: V,
    res_desc: V,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
    ctx: V,
) -> isize {
    let null = std::ptr::null();
    let r = (res as usize, res_desc as usize);
    atomic_common(
        ep,
        Call::Fetch,
        (buf, count),
        null,
        r,
        (dest, addr, key),
        (dt, op, ctx, false, false),
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_readwritev(
    ep: *mut Ep,
    iov: *const Ioc,
    desc: Dv,
    count: usize,
    resv: *mut Ioc,
    res_desc: Dv,
    res_count: usize,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
    ctx: V,
) -> isize {
    // SAFETY: `count` and `res_count` iocs and descriptors (fi_fetch_atomicv(3)).
    match unsafe { (ioc1(iov, desc, count), ioc1(resv, res_desc, res_count)) } {
        (Ok((b, n, _)), Ok((r, 1, rd))) => {
            let t = (dt, op, ctx, false, false);
            atomic_common(
                ep,
                Call::Fetch,
                (b, n),
                std::ptr::null(),
                (r as usize, rd),
                (dest, addr, key),
                t,
            )
        }
        (Err(e), _) | (_, Err(e)) => -(e as isize),
        _ => -(abi::FI_EINVAL as isize),
    }
}

unsafe extern "C" fn a_readwritemsg(
    ep: *mut Ep,
    msg: *const abi::fi_msg_atomic,
    resv: *mut Ioc,
    res_desc: Dv,
    res_count: usize,
    flags: u64,
) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe { fetchmsg_t(ep, msg, (resv, res_desc, res_count), flags, None) }
}

/// `fi_fetch_atomicmsg`, or deferred work's fetching atomic (`work`).
///
/// # Safety
/// `msg` and the result array are as fi_fetch_atomicmsg(3) describes them.
unsafe fn fetchmsg_t(
    ep: *mut Ep,
    msg: *const abi::fi_msg_atomic,
    (resv, res_desc, res_count): (*mut Ioc, Dv, usize),
    flags: u64,
    work: Option<prov::Trig>,
) -> isize {
    // SAFETY: as libfabric gave them (fi_fetch_atomicmsg(3)).
    match unsafe { (atomic_msg(msg), ioc1(resv, res_desc, res_count)) } {
        (Ok((m, b, n, addr, key)), Ok((r, 1, rd))) => {
            // SAFETY: the context of a message sent with FI_TRIGGER (fi_trigger(3)).
            let trig = match work
                .map_or_else(|| unsafe { trigger_of(flags, m.context) }, |t| Ok(Some(t)))
            {
                Ok(t) => t,
                Err(e) => return -(e as isize),
            };
            let report = flags & abi::FI_COMPLETION as u64 != 0;
            let t = (m.datatype, m.op, m.context, false, report);
            atomic_common_t(
                ep,
                Call::Fetch,
                (b, n),
                std::ptr::null(),
                (r as usize, rd),
                (m.addr, addr, key),
                t,
                trig,
            )
        }
        (Err(e), _) | (_, Err(e)) => -(e as isize),
        _ => -(abi::FI_EINVAL as isize),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_compwrite(
    ep: *mut Ep,
    buf: Cv,
    count: usize,
    _desc: V,
    cmp: Cv,
    _cmp_desc: V,
    res: V,
    res_desc: V,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
    ctx: V,
) -> isize {
    let r = (res as usize, res_desc as usize);
    atomic_common(
        ep,
        Call::Compare,
        (buf, count),
        cmp,
        r,
        (dest, addr, key),
        (dt, op, ctx, false, false),
    )
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_compwritev(
    ep: *mut Ep,
    iov: *const Ioc,
    desc: Dv,
    count: usize,
    cmpv: *const Ioc,
    cmp_desc: Dv,
    cmp_count: usize,
    resv: *mut Ioc,
    res_desc: Dv,
    res_count: usize,
    dest: A,
    addr: u64,
    key: u64,
    dt: Dt,
    op: Op,
    ctx: V,
) -> isize {
    // SAFETY: the iocs and descriptors with their counts (fi_compare_atomicv(3)).
    let all = unsafe {
        (
            ioc1(iov, desc, count),
            ioc1(cmpv, cmp_desc, cmp_count),
            ioc1(resv, res_desc, res_count),
        )
    };
    match all {
        (Ok((b, n, _)), Ok((c, 1, _)), Ok((r, 1, rd))) => {
            let t = (dt, op, ctx, false, false);
            atomic_common(
                ep,
                Call::Compare,
                (b, n),
                c,
                (r as usize, rd),
                (dest, addr, key),
                t,
            )
        }
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => -(e as isize),
        _ => -(abi::FI_EINVAL as isize),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn a_compwritemsg(
    ep: *mut Ep,
    msg: *const abi::fi_msg_atomic,
    cmpv: *const Ioc,
    cmp_desc: Dv,
    cmp_count: usize,
    resv: *mut Ioc,
    res_desc: Dv,
    res_count: usize,
    flags: u64,
) -> isize {
    // SAFETY: passed on as libfabric gave them.
    unsafe {
        compmsg_t(
            ep,
            msg,
            (cmpv, cmp_desc, cmp_count),
            (resv, res_desc, res_count),
            flags,
            None,
        )
    }
}

/// `fi_compare_atomicmsg`, or deferred work's compare-and-swap (`work`).
///
/// # Safety
/// `msg` and the arrays are as fi_compare_atomicmsg(3) describes them.
unsafe fn compmsg_t(
    ep: *mut Ep,
    msg: *const abi::fi_msg_atomic,
    (cmpv, cmp_desc, cmp_count): (*const Ioc, Dv, usize),
    (resv, res_desc, res_count): (*mut Ioc, Dv, usize),
    flags: u64,
    work: Option<prov::Trig>,
) -> isize {
    // SAFETY: as libfabric gave them (fi_compare_atomicmsg(3)).
    let all = unsafe {
        (
            atomic_msg(msg),
            ioc1(cmpv, cmp_desc, cmp_count),
            ioc1(resv, res_desc, res_count),
        )
    };
    match all {
        (Ok((m, b, n, addr, key)), Ok((c, 1, _)), Ok((r, 1, rd))) => {
            // SAFETY: the context of a message sent with FI_TRIGGER (fi_trigger(3)).
            let trig = match work
                .map_or_else(|| unsafe { trigger_of(flags, m.context) }, |t| Ok(Some(t)))
            {
                Ok(t) => t,
                Err(e) => return -(e as isize),
            };
            let report = flags & abi::FI_COMPLETION as u64 != 0;
            let t = (m.datatype, m.op, m.context, false, report);
            atomic_common_t(
                ep,
                Call::Compare,
                (b, n),
                c,
                (r as usize, rd),
                (m.addr, addr, key),
                t,
                trig,
            )
        }
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => -(e as isize),
        _ => -(abi::FI_EINVAL as isize),
    }
}

static ATOMIC_OPS: abi::fi_ops_atomic = abi::fi_ops_atomic {
    size: std::mem::size_of::<abi::fi_ops_atomic>(),
    write: Some(a_write),
    writev: Some(a_writev),
    writemsg: Some(a_writemsg),
    inject: Some(a_inject),
    readwrite: Some(a_readwrite),
    readwritev: Some(a_readwritev),
    readwritemsg: Some(a_readwritemsg),
    compwrite: Some(a_compwrite),
    compwritev: Some(a_compwritev),
    compwritemsg: Some(a_compwritemsg),
    writevalid: Some(a_writevalid),
    readwritevalid: Some(a_readwritevalid),
    compwritevalid: Some(a_compwritevalid),
};

// ---- collectives: not implemented ----

enosys!(c_barrier(*mut Ep, A, V) -> isize);
enosys!(c_broadcast(*mut Ep, V, usize, V, A, A, Dt, u64, V) -> isize);
enosys!(c_alltoall(*mut Ep, Cv, usize, V, V, V, A, Dt, u64, V) -> isize);
enosys!(c_allreduce(*mut Ep, Cv, usize, V, V, V, A, Dt, Op, u64, V) -> isize);
enosys!(c_allgather(*mut Ep, Cv, usize, V, V, V, A, Dt, u64, V) -> isize);
enosys!(c_reduce(*mut Ep, Cv, usize, V, V, V, A, A, Dt, Op, u64, V) -> isize);
enosys!(c_scatter(*mut Ep, Cv, usize, V, V, V, A, A, Dt, u64, V) -> isize);
enosys!(c_msg(*mut Ep, *const abi::fi_msg_collective, *mut Ioc, Dv, usize, u64) -> isize);
enosys!(c_barrier2(*mut Ep, A, u64, V) -> isize);

static COLL_OPS: abi::fi_ops_collective = abi::fi_ops_collective {
    size: std::mem::size_of::<abi::fi_ops_collective>(),
    barrier: Some(c_barrier),
    broadcast: Some(c_broadcast),
    alltoall: Some(c_alltoall),
    allreduce: Some(c_allreduce),
    allgather: Some(c_allgather),
    reduce_scatter: Some(c_allreduce),
    reduce: Some(c_reduce),
    scatter: Some(c_scatter),
    gather: Some(c_scatter),
    msg: Some(c_msg),
    barrier2: Some(c_barrier2),
};
