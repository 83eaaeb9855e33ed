//! The function tables libibverbs' inline calls go through: `struct ibv_context_ops`, the
//! extended verbs of `struct verbs_context`, the poll functions of `struct ibv_cq_ex` and
//! the builder of `struct ibv_qp_ex`. Each function checks its object pointer against the
//! registry, takes the lock and calls the verb.

use crate::abi;
use crate::cq::RbCq;
use crate::device::{self, RbContext};
use crate::qp::RbQp;
use crate::srq::RbSrq;
use crate::state::{lock, Kind, Owner, State};
use crate::{guard, set_errno};
use ringbell::{RemoteAddr, WrOp};
use std::ffi::{c_int, c_void};

/// Runs `f` on the live ringbell object `p` of kind `kind` under the lock; `fail` when `p`
/// is not one.
pub(crate) fn with<T, R: Copy>(
    p: *mut T,
    kind: Kind,
    fail: R,
    f: impl FnOnce(&mut State, &mut T) -> R,
) -> R {
    guard(fail, || {
        let mut st = lock();
        if st.owner(p as usize) != Owner::Ours(kind) {
            return fail;
        }
        // SAFETY: the registry says `p` is a live object of this kind, which the library
        // allocated as `T` (its C struct first); the lock is held.
        let o = unsafe { &mut *p };
        f(&mut st, o)
    })
}

/// Fills a context's tables.
pub(crate) fn fill(v: &mut abi::verbs_context) {
    let o = &mut v.context.ops;
    o.poll_cq = Some(poll_cq);
    o.req_notify_cq = Some(req_notify_cq);
    o.post_send = Some(post_send);
    o.post_recv = Some(post_recv);
    o.post_srq_recv = Some(post_srq_recv);
    o.alloc_mw = Some(alloc_mw);
    o.dealloc_mw = Some(dealloc_mw);
    o.bind_mw = Some(bind_mw);
    v.query_port = Some(query_port_ex);
    v.query_device_ex = Some(query_device_ex);
    v.create_cq_ex = Some(create_cq_ex);
    v.create_qp_ex = Some(create_qp_ex);
    v.create_srq_ex = Some(create_srq_ex);
    v.post_srq_ops = Some(post_srq_ops);
    v.get_srq_num = Some(get_srq_num);
    v.open_xrcd = Some(open_xrcd);
    v.ibv_create_flow = Some(create_flow);
    v.create_wq = Some(create_wq);
    v.modify_wq = Some(modify_wq);
    v.destroy_wq = Some(destroy_wq);
    v.create_rwq_ind_table = Some(create_rwq_ind_table);
    v.destroy_rwq_ind_table = Some(destroy_rwq_ind_table);
    v.ibv_destroy_flow = Some(destroy_flow);
    v.close_xrcd = Some(close_xrcd);
    v.query_rt_values = Some(query_rt_values);
    v.alloc_td = Some(alloc_td);
    v.dealloc_td = Some(dealloc_td);
    v.alloc_parent_domain = Some(alloc_parent_domain);
    v.alloc_dm = Some(alloc_dm);
    v.free_dm = Some(free_dm);
    v.reg_dm_mr = Some(reg_dm_mr);
    v.advise_mr = Some(advise_mr);
}

unsafe extern "C" fn alloc_mw(pd: *mut abi::ibv_pd, kind: abi::ibv_mw_type) -> *mut abi::ibv_mw {
    crate::entry::ptr_or_errno(with(
        pd as *mut crate::pd::RbPd,
        Kind::Pd,
        Err(libc::EINVAL),
        |st, pd| crate::mw::alloc(st, pd, kind),
    ))
}

unsafe extern "C" fn dealloc_mw(mw: *mut abi::ibv_mw) -> c_int {
    with(
        mw as *mut crate::mw::RbMw,
        Kind::Mw,
        libc::EINVAL,
        crate::mw::dealloc,
    )
}

unsafe extern "C" fn bind_mw(
    qp: *mut abi::ibv_qp,
    mw: *mut abi::ibv_mw,
    bind: *mut abi::ibv_mw_bind,
) -> c_int {
    // SAFETY: NULL or the caller's struct (ibv_bind_mw(3)).
    let Some(b) = (unsafe { bind.as_ref() }) else {
        return libc::EINVAL;
    };
    with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |st, qp| {
        if st.owner(mw as usize) != Owner::Ours(Kind::Mw) {
            return libc::EINVAL;
        }
        // SAFETY: the registry says `mw` is a live window, allocated as an `RbMw`; the lock
        // is held.
        let mw = unsafe { &mut *(mw as *mut crate::mw::RbMw) };
        crate::mw::bind(st, qp, mw, b)
    })
}

unsafe extern "C" fn advise_mr(
    pd: *mut abi::ibv_pd,
    advice: abi::ib_uverbs_advise_mr_advice,
    flags: u32,
    sg_list: *mut abi::ibv_sge,
    num_sges: u32,
) -> c_int {
    if sg_list.is_null() && num_sges > 0 {
        return libc::EINVAL;
    }
    with(
        pd as *mut crate::pd::RbPd,
        Kind::Pd,
        libc::EINVAL,
        |st, pd| {
            let sges = if num_sges == 0 {
                &[][..]
            } else {
                // SAFETY: the caller's array of `num_sges` entries (non-null, checked), as
                // ibv_advise_mr(3) takes it.
                unsafe { std::slice::from_raw_parts(sg_list, num_sges as usize) }
            };
            crate::pd::advise(st, pd, advice, flags, sges)
        },
    )
}

unsafe extern "C" fn alloc_dm(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_alloc_dm_attr,
) -> *mut abi::ibv_dm {
    // SAFETY: NULL or the caller's struct (ibv_alloc_dm(3)).
    unsafe { make_with(ctx, attr, crate::dm::alloc) }
}

unsafe extern "C" fn free_dm(dm: *mut abi::ibv_dm) -> c_int {
    with(
        dm as *mut crate::dm::RbDm,
        Kind::Dm,
        libc::EINVAL,
        crate::dm::free,
    )
}

unsafe extern "C" fn reg_dm_mr(
    pd: *mut abi::ibv_pd,
    dm: *mut abi::ibv_dm,
    offset: u64,
    len: usize,
    access: std::os::raw::c_uint,
) -> *mut abi::ibv_mr {
    crate::entry::ptr_or_errno(with(
        pd as *mut crate::pd::RbPd,
        Kind::Pd,
        Err(libc::EINVAL),
        |st, pd| crate::dm::reg_mr(st, pd, dm, offset, len, access),
    ))
}

/// Runs `f` on the live ringbell context `ctx` and the caller's attributes `attr` (NULL:
/// EINVAL) under the lock, and returns the object it makes, or NULL with `errno` set.
///
/// # Safety
/// `attr` is NULL or points to the caller's struct.
unsafe fn make_with<A, T>(
    ctx: *mut abi::ibv_context,
    attr: *mut A,
    f: impl FnOnce(&mut State, &mut RbContext, &A) -> Result<*mut T, i32>,
) -> *mut T {
    // SAFETY: per the caller.
    let Some(a) = (unsafe { attr.as_ref() }) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    crate::entry::ptr_or_errno(with_ctx(ctx, Err(libc::EINVAL), |st, c| f(st, c, a)))
}

unsafe extern "C" fn alloc_td(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_td_init_attr,
) -> *mut abi::ibv_td {
    // SAFETY: NULL or the caller's struct (ibv_alloc_td(3)).
    unsafe { make_with(ctx, attr, crate::pd::alloc_td) }
}

unsafe extern "C" fn dealloc_td(td: *mut abi::ibv_td) -> c_int {
    with(
        td as *mut crate::pd::RbTd,
        Kind::Td,
        libc::EINVAL,
        crate::pd::dealloc_td,
    )
}

unsafe extern "C" fn alloc_parent_domain(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_parent_domain_init_attr,
) -> *mut abi::ibv_pd {
    // SAFETY: NULL or the caller's struct (ibv_alloc_parent_domain(3)).
    unsafe { make_with(ctx, attr, crate::pd::alloc_parent) }
}

unsafe extern "C" fn poll_cq(cq: *mut abi::ibv_cq, n: c_int, wc: *mut abi::ibv_wc) -> c_int {
    if n < 0 || (n > 0 && wc.is_null()) {
        return -libc::EINVAL;
    }
    with(cq as *mut RbCq, Kind::Cq, -libc::EINVAL, |st, cq| {
        let out = if n == 0 {
            &mut []
        } else {
            // SAFETY: the caller's array of `n` entries (checked non-null when n > 0).
            unsafe { std::slice::from_raw_parts_mut(wc, n as usize) }
        };
        crate::cq::poll(st, cq, out)
    })
}

unsafe extern "C" fn req_notify_cq(cq: *mut abi::ibv_cq, solicited_only: c_int) -> c_int {
    with(cq as *mut RbCq, Kind::Cq, libc::EINVAL, |st, cq| {
        cq.drv.arm(solicited_only != 0);
        // SAFETY: a CQ's context outlives it.
        let nic = unsafe { (*cq.ctx).nic };
        crate::events::pump(st, nic);
        0
    })
}

unsafe extern "C" fn post_send(
    qp: *mut abi::ibv_qp,
    wr: *mut abi::ibv_send_wr,
    bad: *mut *mut abi::ibv_send_wr,
) -> c_int {
    with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |st, qp| {
        // SAFETY: the caller's list, as libibverbs requires it.
        unsafe { crate::qp::post_send(st, qp, wr, bad) }
    })
}

unsafe extern "C" fn post_recv(
    qp: *mut abi::ibv_qp,
    wr: *mut abi::ibv_recv_wr,
    bad: *mut *mut abi::ibv_recv_wr,
) -> c_int {
    with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |_, qp| {
        // SAFETY: the caller's list.
        unsafe { crate::qp::post_recv(qp, wr, bad) }
    })
}

unsafe extern "C" fn post_srq_recv(
    srq: *mut abi::ibv_srq,
    wr: *mut abi::ibv_recv_wr,
    bad: *mut *mut abi::ibv_recv_wr,
) -> c_int {
    with(srq as *mut RbSrq, Kind::Srq, libc::EINVAL, |_, srq| {
        // SAFETY: the caller's list.
        unsafe { crate::srq::post_recv(srq, wr, bad) }
    })
}

unsafe extern "C" fn post_srq_ops(
    srq: *mut abi::ibv_srq,
    op: *mut abi::ibv_ops_wr,
    bad: *mut *mut abi::ibv_ops_wr,
) -> c_int {
    with(srq as *mut RbSrq, Kind::Srq, libc::EINVAL, |_, srq| {
        // SAFETY: the caller's list.
        unsafe { crate::srq::post_ops(srq, op, bad) }
    })
}

/// The most specs a rule may have, and the largest spec read.
const MAX_FLOW_SPECS: usize = 16;
const MAX_FLOW_SPEC: usize = 256;

unsafe extern "C" fn create_flow(
    qp: *mut abi::ibv_qp,
    attr: *mut abi::ibv_flow_attr,
) -> *mut abi::ibv_flow {
    use crate::flow::Spec;
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct, checked non-null; read only.
    let a = unsafe { std::ptr::read_unaligned(attr) };
    if a.num_of_specs as usize > MAX_FLOW_SPECS {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // The specs follow the attributes, each starting with its type and size
    // (`struct ibv_flow_spec`'s header), each read as the struct its type names when its
    // size holds one.
    let mut specs = Vec::with_capacity(a.num_of_specs as usize);
    // SAFETY: libibverbs' layout: the specs are laid out right after the attributes.
    let mut at = unsafe { (attr as *const u8).add(std::mem::size_of::<abi::ibv_flow_attr>()) };
    for _ in 0..a.num_of_specs {
        // SAFETY: a spec header (type, size) at `at`, per ibv_create_flow(3).
        let (ty, size) = unsafe {
            (
                std::ptr::read_unaligned(at as *const u32),
                std::ptr::read_unaligned(at.add(4) as *const u16) as usize,
            )
        };
        if !(8..=MAX_FLOW_SPEC).contains(&size) {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
        /// Reads the spec at `at` as a `T` when `size` holds one.
        ///
        /// # Safety
        /// `at` points at a spec of `size` readable bytes.
        unsafe fn read<T>(at: *const u8, size: usize) -> Option<T> {
            // SAFETY: `size` bytes are readable and `T` fits in them.
            (size >= std::mem::size_of::<T>())
                .then(|| unsafe { std::ptr::read_unaligned(at as *const T) })
        }
        // SAFETY: the caller's spec of `size` bytes.
        let spec = unsafe {
            match ty {
                abi::ibv_flow_spec_type_IBV_FLOW_SPEC_ETH => read(at, size).map(Spec::Eth),
                abi::ibv_flow_spec_type_IBV_FLOW_SPEC_IPV4 => read(at, size).map(Spec::Ipv4),
                abi::ibv_flow_spec_type_IBV_FLOW_SPEC_IPV4_EXT => read(at, size).map(Spec::Ipv4Ext),
                abi::ibv_flow_spec_type_IBV_FLOW_SPEC_IPV6 => read(at, size).map(Spec::Ipv6),
                abi::ibv_flow_spec_type_IBV_FLOW_SPEC_TCP
                | abi::ibv_flow_spec_type_IBV_FLOW_SPEC_UDP => read(at, size).map(Spec::TcpUdp),
                _ => Some(Spec::Unsupported),
            }
        };
        let Some(spec) = spec else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        specs.push(spec);
        // SAFETY: the next spec follows this one.
        at = unsafe { at.add(size) };
    }
    match with(qp as *mut RbQp, Kind::Qp, Err(libc::EINVAL), |st, q| {
        crate::flow::create(st, q, &a, &specs)
    }) {
        Ok(p) => p,
        Err(e) => {
            if crate::debug() {
                eprintln!(
                    "ringbell-verbs: ibv_create_flow refused (errno {e}): type {}, flags {:#x}, port {}, {} specs",
                    a.type_, a.flags, a.port, a.num_of_specs
                );
            }
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

unsafe extern "C" fn destroy_flow(f: *mut abi::ibv_flow) -> c_int {
    with(
        f as *mut crate::flow::RbFlow,
        Kind::Flow,
        libc::EINVAL,
        crate::flow::destroy,
    )
}

unsafe extern "C" fn create_wq(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_wq_init_attr,
) -> *mut abi::ibv_wq {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct (the verb writes the real size back into it).
    let a = unsafe { &mut *attr };
    match with_ctx(ctx, Err(libc::EINVAL), |st, c| crate::wq::create(st, c, a)) {
        Ok(p) => p,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

unsafe extern "C" fn modify_wq(wq: *mut abi::ibv_wq, attr: *mut abi::ibv_wq_attr) -> c_int {
    if attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller's struct, checked non-null; read only.
    let a = unsafe { std::ptr::read_unaligned(attr) };
    with(
        wq as *mut crate::wq::RbWq,
        Kind::Wq,
        libc::EINVAL,
        |_, w| crate::wq::modify(w, &a),
    )
}

unsafe extern "C" fn destroy_wq(wq: *mut abi::ibv_wq) -> c_int {
    with(
        wq as *mut crate::wq::RbWq,
        Kind::Wq,
        libc::EINVAL,
        crate::wq::destroy,
    )
}

/// `wq->post_recv`.
pub(crate) unsafe extern "C" fn post_wq_recv(
    wq: *mut abi::ibv_wq,
    wr: *mut abi::ibv_recv_wr,
    bad: *mut *mut abi::ibv_recv_wr,
) -> c_int {
    with(
        wq as *mut crate::wq::RbWq,
        Kind::Wq,
        libc::EINVAL,
        |_, w| {
            // SAFETY: the caller's list.
            unsafe { crate::wq::post_recv(w, wr, bad) }
        },
    )
}

unsafe extern "C" fn create_rwq_ind_table(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_rwq_ind_table_init_attr,
) -> *mut abi::ibv_rwq_ind_table {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct, checked non-null; read only.
    let a = unsafe { std::ptr::read_unaligned(attr) };
    if a.comp_mask != 0 {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    if a.log_ind_tbl_size > u32::from(ringbell::raw::RSS_MAX_LOG_SIZE) || a.ind_tbl.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's array of `1 << log_ind_tbl_size` WQ pointers, checked non-null.
    let wqs = unsafe { std::slice::from_raw_parts(a.ind_tbl, 1 << a.log_ind_tbl_size) }.to_vec();
    match with_ctx(ctx, Err(libc::EINVAL), |st, c| {
        crate::wq::create_table(st, c, a.log_ind_tbl_size, &wqs)
    }) {
        Ok(p) => p,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

unsafe extern "C" fn destroy_rwq_ind_table(t: *mut abi::ibv_rwq_ind_table) -> c_int {
    with(
        t as *mut crate::wq::RbIndTable,
        Kind::IndTable,
        libc::EINVAL,
        crate::wq::destroy_table,
    )
}

pub(crate) unsafe extern "C" fn open_xrcd(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_xrcd_init_attr,
) -> *mut abi::ibv_xrcd {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct, checked non-null; read only.
    let a = unsafe { &*attr };
    match with_ctx(ctx, Err(libc::EINVAL), |st, c| crate::xrc::open(st, c, a)) {
        Ok(p) => p,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

unsafe extern "C" fn close_xrcd(x: *mut abi::ibv_xrcd) -> c_int {
    with(
        x as *mut crate::xrc::RbXrcd,
        Kind::Xrcd,
        libc::EINVAL,
        crate::xrc::close,
    )
}

unsafe extern "C" fn get_srq_num(srq: *mut abi::ibv_srq, num: *mut u32) -> c_int {
    if num.is_null() {
        return libc::EINVAL;
    }
    with(srq as *mut RbSrq, Kind::Srq, libc::EINVAL, |_, srq| {
        // SAFETY: the caller's out-pointer, checked non-null.
        unsafe { *num = srq.drv.srqn() };
        0
    })
}

/// Copies `src` into the first `len` bytes of `dst` (zero-filling past `src`): extended
/// query verbs write only as much of their output as the caller's struct has.
///
/// # Safety
/// `dst` must be writable for `len` bytes.
unsafe fn copy_out<T>(src: &T, dst: *mut T, len: usize) {
    let n = len.min(std::mem::size_of::<T>());
    // SAFETY: `src` is a live `T` of at least `n` bytes; `dst` is writable for `len >= n`.
    unsafe { std::ptr::copy_nonoverlapping(src as *const T as *const u8, dst as *mut u8, n) };
    if len > n {
        // SAFETY: the caller's buffer is `len` bytes long.
        unsafe { std::ptr::write_bytes((dst as *mut u8).add(n), 0, len - n) };
    }
}

pub(crate) unsafe extern "C" fn query_port_ex(
    ctx: *mut abi::ibv_context,
    port: u8,
    attr: *mut abi::ibv_port_attr,
    len: usize,
) -> c_int {
    if attr.is_null() {
        return libc::EINVAL;
    }
    with_ctx(ctx, libc::EINVAL, |_, c| {
        if port != 1 {
            return libc::EINVAL;
        }
        let mut a = abi::ibv_port_attr::default();
        device::query_port(c.dev.caps(), &mut a);
        // SAFETY: the caller's struct of `len` bytes.
        unsafe { copy_out(&a, attr, len) };
        0
    })
}

pub(crate) unsafe extern "C" fn query_device_ex(
    ctx: *mut abi::ibv_context,
    input: *const abi::ibv_query_device_ex_input,
    attr: *mut abi::ibv_device_attr_ex,
    len: usize,
) -> c_int {
    if attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a non-null input is the caller's struct.
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return libc::EINVAL;
    }
    with_ctx(ctx, libc::EINVAL, |_, c| {
        let mut a = abi::ibv_device_attr_ex::default();
        device::query_device_ex(c.dev.caps(), c.dev.on_demand(), &mut a);
        // SAFETY: the caller's struct of `len` bytes.
        unsafe { copy_out(&a, attr, len) };
        0
    })
}

unsafe extern "C" fn query_rt_values(
    ctx: *mut abi::ibv_context,
    values: *mut abi::ibv_values_ex,
) -> c_int {
    if values.is_null() {
        return libc::EINVAL;
    }
    with_ctx(ctx, libc::EINVAL, |_, c| {
        // SAFETY: the caller's struct.
        let v = unsafe { &mut *values };
        let known = abi::ibv_values_mask_IBV_VALUES_MASK_RAW_CLOCK;
        if v.comp_mask & !known != 0 {
            return libc::EINVAL;
        }
        if v.comp_mask & known != 0 {
            let ps = c.dev.clock_ps();
            v.raw_clock = abi::timespec {
                tv_sec: (ps / 1_000_000_000_000) as i64,
                tv_nsec: ((ps / 1000) % 1_000_000_000) as i64,
            };
        }
        0
    })
}

/// [`with`] for a context pointer (programs hold the `context` member, not the start).
pub(crate) fn with_ctx<R: Copy>(
    ctx: *mut abi::ibv_context,
    fail: R,
    f: impl FnOnce(&mut State, &mut RbContext) -> R,
) -> R {
    guard(fail, || {
        let mut st = lock();
        if st.owner(ctx as usize) != Owner::Ours(Kind::Context) {
            return fail;
        }
        // SAFETY: a live ringbell context, under the lock.
        let c = unsafe { device::ctx(ctx) };
        f(&mut st, c)
    })
}

/// [`with`] for a caller that holds the lock already: `None` when `p` is not a live
/// object of `kind`.
pub(crate) fn with_held<T, R>(
    st: &mut State,
    p: *mut T,
    kind: Kind,
    f: impl FnOnce(&mut State, &mut T) -> R,
) -> Option<R> {
    if p.is_null() || st.owner(p as usize) != Owner::Ours(kind) {
        return None;
    }
    // SAFETY: the registry says `p` is a live object of this kind, which the library
    // allocated as `T` (its C struct first); the caller holds the lock.
    let o = unsafe { &mut *p };
    Some(f(st, o))
}

/// [`with_ctx`] for a caller that holds the lock already.
pub(crate) fn with_ctx_held<R>(
    st: &mut State,
    ctx: *mut abi::ibv_context,
    f: impl FnOnce(&mut State, &mut RbContext) -> R,
) -> Option<R> {
    if ctx.is_null() || st.owner(ctx as usize) != Owner::Ours(Kind::Context) {
        return None;
    }
    // SAFETY: a live ringbell context; the caller holds the lock.
    let c = unsafe { device::ctx(ctx) };
    Some(f(st, c))
}

/// Whether `p` is null or a live ringbell object of `kind`.
pub(crate) fn null_or(st: &State, p: usize, kind: Kind) -> bool {
    p == 0 || st.owner(p) == Owner::Ours(kind)
}

unsafe extern "C" fn create_cq_ex(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_cq_init_attr_ex,
) -> *mut abi::ibv_cq_ex {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct.
    let a = unsafe { &*attr };
    let r = with_ctx(ctx, Err(libc::EINVAL), |st, c| {
        let known_mask = abi::ibv_cq_init_attr_mask_IBV_CQ_INIT_ATTR_MASK_FLAGS
            | abi::ibv_cq_init_attr_mask_IBV_CQ_INIT_ATTR_MASK_PD;
        let known_flags = abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_BYTE_LEN
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_IMM
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_QP_NUM
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_SRC_QP
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_SLID
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_SL
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_DLID_PATH_BITS
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_COMPLETION_TIMESTAMP
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK
            | abi::ibv_create_cq_wc_flags_IBV_WC_EX_WITH_TM_INFO;
        if a.comp_mask & !known_mask != 0 || a.wc_flags & !u64::from(known_flags) != 0 {
            return Err(libc::EOPNOTSUPP);
        }
        if a.comp_mask & abi::ibv_cq_init_attr_mask_IBV_CQ_INIT_ATTR_MASK_FLAGS != 0 && a.flags != 0
        {
            return Err(libc::EOPNOTSUPP);
        }
        // With MASK_PD, a parent domain of this context (a plain PD: EINVAL, as mlx5).
        let pd = if a.comp_mask & abi::ibv_cq_init_attr_mask_IBV_CQ_INIT_ATTR_MASK_PD != 0 {
            if st.owner(a.parent_domain as usize) != Owner::Ours(Kind::Pd) {
                return Err(libc::EINVAL);
            }
            // SAFETY: a live ringbell PD (checked), under the lock.
            let pd = unsafe { &mut *(a.parent_domain as *mut crate::pd::RbPd) };
            if pd.parent.is_none() || !std::ptr::eq(pd.ctx, c) {
                return Err(libc::EINVAL);
            }
            pd as *mut crate::pd::RbPd
        } else {
            std::ptr::null_mut()
        };
        if !null_or(st, a.channel as usize, Kind::Channel)
            || a.comp_vector >= c.vctx.context.num_comp_vectors as u32
            || a.cqe > i32::MAX as u32
        {
            return Err(libc::EINVAL);
        }
        crate::cq::create(
            st,
            c,
            a.cqe as i32,
            a.channel as *mut crate::cq::RbChannel,
            a.cq_context,
            pd,
        )
    });
    match r {
        Ok(p) => p as *mut abi::ibv_cq_ex,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

pub(crate) unsafe extern "C" fn create_qp_ex(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_qp_init_attr_ex,
) -> *mut abi::ibv_qp {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct (the verb writes the real capacities back into it).
    let a = unsafe { &mut *attr };
    // An RSS QP's hash key, copied from the caller's buffer.
    let mut key = Vec::new();
    if a.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_RX_HASH != 0 {
        let h = &a.rx_hash_conf;
        if h.rx_hash_key_len > 40 || (h.rx_hash_key_len > 0 && h.rx_hash_key.is_null()) {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
        if h.rx_hash_key_len > 0 {
            // SAFETY: the caller's key of `rx_hash_key_len` bytes, checked non-null.
            key.extend_from_slice(unsafe {
                std::slice::from_raw_parts(h.rx_hash_key, h.rx_hash_key_len.into())
            });
        }
    }
    let r = with_ctx(ctx, Err(libc::EINVAL), |st, c| {
        if a.qp_type == abi::ibv_qp_type_IBV_QPT_XRC_RECV {
            return crate::xrc::create_target(st, c, a);
        }
        if a.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD == 0 {
            return Err(libc::EINVAL);
        }
        if a.comp_mask
            & (abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_IND_TABLE
                | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_RX_HASH)
            != 0
        {
            return crate::wq::create_rss_qp(st, c, a, &key);
        }
        crate::entry::create_qp_checked(st, a.pd, a)
    });
    match r {
        Ok(p) => p as *mut abi::ibv_qp,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

pub(crate) unsafe extern "C" fn create_srq_ex(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_srq_init_attr_ex,
) -> *mut abi::ibv_srq {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's struct.
    let a = unsafe { &mut *attr };
    let r = with_ctx(ctx, Err(libc::EINVAL), |st, _| {
        let known = abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_TYPE
            | abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_PD
            | abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_CQ
            | abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_TM
            | abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_XRCD;
        if a.comp_mask & !known != 0 {
            return Err(libc::EOPNOTSUPP);
        }
        if a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_PD == 0 {
            return Err(libc::EINVAL);
        }
        if a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_TYPE == 0 {
            a.srq_type = abi::ibv_srq_type_IBV_SRQT_BASIC;
        }
        match a.srq_type {
            abi::ibv_srq_type_IBV_SRQT_BASIC => {}
            abi::ibv_srq_type_IBV_SRQT_TM => {
                if a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_TM == 0
                    || a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_CQ == 0
                {
                    return Err(libc::EINVAL);
                }
            }
            abi::ibv_srq_type_IBV_SRQT_XRC => {
                if a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_XRCD == 0
                    || a.comp_mask & abi::ibv_srq_init_attr_mask_IBV_SRQ_INIT_ATTR_CQ == 0
                    || st.owner(a.xrcd as usize) != Owner::Ours(Kind::Xrcd)
                {
                    return Err(libc::EINVAL);
                }
            }
            _ => return Err(libc::EOPNOTSUPP),
        }
        let cq = if a.srq_type == abi::ibv_srq_type_IBV_SRQT_TM
            || a.srq_type == abi::ibv_srq_type_IBV_SRQT_XRC
        {
            a.cq as usize
        } else {
            0
        };
        if st.owner(a.pd as usize) != Owner::Ours(Kind::Pd) || !null_or(st, cq, Kind::Cq) {
            return Err(libc::EINVAL);
        }
        // SAFETY: checked live above; the lock is held.
        let pd = unsafe { &mut *(a.pd as *mut crate::pd::RbPd) };
        crate::srq::create(st, pd, cq as *mut RbCq, a)
    });
    match r {
        Ok(p) => p as *mut abi::ibv_srq,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    }
}

// ---- struct ibv_cq_ex ----

/// Fills an extended CQ's poll functions.
pub(crate) fn fill_cq_ex(cq: &mut abi::ibv_cq_ex) {
    cq.start_poll = Some(start_poll);
    cq.next_poll = Some(next_poll);
    cq.end_poll = Some(end_poll);
    cq.read_opcode = Some(read_opcode);
    cq.read_vendor_err = Some(read_vendor_err);
    cq.read_byte_len = Some(read_byte_len);
    cq.read_imm_data = Some(read_imm_data);
    cq.read_qp_num = Some(read_qp_num);
    cq.read_src_qp = Some(read_src_qp);
    cq.read_wc_flags = Some(read_wc_flags);
    cq.read_slid = Some(read_slid);
    cq.read_sl = Some(read_sl);
    cq.read_dlid_path_bits = Some(read_dlid_path_bits);
    cq.read_completion_ts = Some(read_completion_ts);
    cq.read_completion_wallclock_ns = Some(read_completion_wallclock_ns);
    cq.read_cvlan = Some(read_cvlan);
    cq.read_flow_tag = Some(read_flow_tag);
    cq.read_tm_info = Some(read_tm_info);
}

fn poll_one(st: &mut State, cq: &mut RbCq, progress: bool) -> c_int {
    let mut w = [ringbell::WorkCompletion::default()];
    let n = if progress {
        cq.drv.poll(&mut w)
    } else {
        cq.drv.poll_ready(&mut w)
    };
    if n == 0 {
        if progress {
            // SAFETY: a CQ's context outlives it.
            let nic = unsafe { (*cq.ctx).nic };
            crate::events::pump(st, nic);
        }
        return libc::ENOENT;
    }
    cq.cur = w[0];
    cq.cq.status = w[0].status as u32;
    cq.cq.wr_id = w[0].wr_id;
    0
}

unsafe extern "C" fn start_poll(
    cq: *mut abi::ibv_cq_ex,
    attr: *mut abi::ibv_poll_cq_attr,
) -> c_int {
    // SAFETY: a non-null attr is the caller's struct.
    if !attr.is_null() && unsafe { (*attr).comp_mask } != 0 {
        return libc::EINVAL;
    }
    with(cq as *mut RbCq, Kind::Cq, libc::EINVAL, |st, cq| {
        poll_one(st, cq, true)
    })
}

unsafe extern "C" fn next_poll(cq: *mut abi::ibv_cq_ex) -> c_int {
    with(cq as *mut RbCq, Kind::Cq, libc::EINVAL, |st, cq| {
        poll_one(st, cq, false)
    })
}

unsafe extern "C" fn end_poll(_cq: *mut abi::ibv_cq_ex) {}

/// Reads a field of the current completion of an extended CQ.
fn read<R: Copy + Default>(cq: *mut abi::ibv_cq_ex, f: impl FnOnce(&RbCq) -> R) -> R {
    with(cq as *mut RbCq, Kind::Cq, R::default(), |_, cq| f(cq))
}

unsafe extern "C" fn read_opcode(cq: *mut abi::ibv_cq_ex) -> abi::ibv_wc_opcode {
    read(cq, |c| c.cur.opcode as u32)
}
unsafe extern "C" fn read_vendor_err(cq: *mut abi::ibv_cq_ex) -> u32 {
    read(cq, |c| u32::from(c.cur.vendor_syndrome))
}
unsafe extern "C" fn read_byte_len(cq: *mut abi::ibv_cq_ex) -> u32 {
    read(cq, |c| c.cur.byte_len)
}
unsafe extern "C" fn read_imm_data(cq: *mut abi::ibv_cq_ex) -> abi::__be32 {
    // The immediate data (network order), or the key a SEND with invalidate unbound
    // (`ibv_wc_read_invalidated_rkey` reads it here, in host order).
    read(cq, |c| match c.cur.invalidated {
        Some(key) => key,
        None => c.cur.imm.unwrap_or(0).to_be(),
    })
}
unsafe extern "C" fn read_qp_num(cq: *mut abi::ibv_cq_ex) -> u32 {
    read(cq, |c| c.cur.qpn)
}
unsafe extern "C" fn read_src_qp(cq: *mut abi::ibv_cq_ex) -> u32 {
    read(cq, |c| c.cur.source.map_or(0, |s| s.qpn))
}
unsafe extern "C" fn read_wc_flags(cq: *mut abi::ibv_cq_ex) -> u32 {
    read(cq, |c| crate::cq::wc_flags_of(&c.cur) as u32)
}
unsafe extern "C" fn read_slid(_cq: *mut abi::ibv_cq_ex) -> u32 {
    0
}
unsafe extern "C" fn read_sl(cq: *mut abi::ibv_cq_ex) -> u8 {
    read(cq, |c| crate::cq::sl_of(&c.cur))
}
unsafe extern "C" fn read_dlid_path_bits(_cq: *mut abi::ibv_cq_ex) -> u8 {
    0
}
unsafe extern "C" fn read_completion_ts(cq: *mut abi::ibv_cq_ex) -> u64 {
    read(cq, |c| c.cur.timestamp_ps)
}
/// The completion's device time as real time: the context's offset plus the device
/// picoseconds in nanoseconds.
unsafe extern "C" fn read_completion_wallclock_ns(cq: *mut abi::ibv_cq_ex) -> u64 {
    read(cq, |c| c.wall_offset_ns + c.cur.timestamp_ps / 1000)
}
unsafe extern "C" fn read_cvlan(_cq: *mut abi::ibv_cq_ex) -> u16 {
    0
}
unsafe extern "C" fn read_flow_tag(_cq: *mut abi::ibv_cq_ex) -> u32 {
    0
}
unsafe extern "C" fn read_tm_info(cq: *mut abi::ibv_cq_ex, info: *mut abi::ibv_wc_tm_info) {
    if info.is_null() {
        return;
    }
    let (tag, app_ctx) = read(cq, |c| (c.cur.tag, c.cur.app_ctx));
    // SAFETY: the caller's struct, checked non-null.
    unsafe {
        (*info).tag = tag;
        (*info).priv_ = app_ctx;
    }
}

// ---- struct ibv_qp_ex ----

/// Fills an extended QP's builder functions.
pub(crate) fn fill_qp_ex(q: &mut abi::ibv_qp_ex) {
    q.wr_start = Some(wr_start);
    q.wr_complete = Some(wr_complete);
    q.wr_abort = Some(wr_abort);
    q.wr_send = Some(wr_send);
    q.wr_send_imm = Some(wr_send_imm);
    q.wr_rdma_write = Some(wr_rdma_write);
    q.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    q.wr_rdma_read = Some(wr_rdma_read);
    q.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    q.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    q.wr_set_sge = Some(wr_set_sge);
    q.wr_set_sge_list = Some(wr_set_sge_list);
    q.wr_set_inline_data = Some(wr_set_inline_data);
    q.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    q.wr_bind_mw = Some(wr_bind_mw);
    q.wr_local_inv = Some(wr_local_inv);
    q.wr_send_inv = Some(wr_send_inv);
    q.wr_send_tso = Some(wr_send_tso);
    q.wr_set_ud_addr = Some(wr_set_ud_addr);
    q.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
    q.wr_atomic_write = Some(wr_atomic_write);
}

fn qpx(q: *mut abi::ibv_qp_ex, f: impl FnOnce(&mut RbQp)) {
    with(q as *mut RbQp, Kind::Qp, (), |_, qp| f(qp))
}

fn unsupported(q: *mut abi::ibv_qp_ex) {
    qpx(q, |qp| qp.build_err = libc::EOPNOTSUPP)
}

type Ops = abi::ibv_qp_create_send_ops_flags;

fn ops(f: Ops) -> u64 {
    f as u64
}

unsafe extern "C" fn wr_start(q: *mut abi::ibv_qp_ex) {
    qpx(q, |qp| qp.wr_start())
}
unsafe extern "C" fn wr_complete(q: *mut abi::ibv_qp_ex) -> c_int {
    with(q as *mut RbQp, Kind::Qp, libc::EINVAL, |st, qp| {
        qp.wr_complete(st)
    })
}
unsafe extern "C" fn wr_abort(q: *mut abi::ibv_qp_ex) {
    qpx(q, |qp| qp.wr_abort())
}
unsafe extern "C" fn wr_send(q: *mut abi::ibv_qp_ex) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::Send,
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND),
        )
    })
}
unsafe extern "C" fn wr_send_imm(q: *mut abi::ibv_qp_ex, imm: abi::__be32) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::SendImm(u32::from_be(imm)),
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND_WITH_IMM),
        )
    })
}
unsafe extern "C" fn wr_rdma_write(q: *mut abi::ibv_qp_ex, rkey: u32, addr: u64) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::Write(RemoteAddr { addr, rkey }),
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_WRITE),
        )
    })
}
unsafe extern "C" fn wr_rdma_write_imm(
    q: *mut abi::ibv_qp_ex,
    rkey: u32,
    addr: u64,
    imm: abi::__be32,
) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::WriteImm(RemoteAddr { addr, rkey }, u32::from_be(imm)),
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM),
        )
    })
}
unsafe extern "C" fn wr_rdma_read(q: *mut abi::ibv_qp_ex, rkey: u32, addr: u64) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::Read(RemoteAddr { addr, rkey }),
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_READ),
        )
    })
}
unsafe extern "C" fn wr_atomic_cmp_swp(
    q: *mut abi::ibv_qp_ex,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::CmpSwap {
                remote: RemoteAddr { addr, rkey },
                compare,
                swap,
            },
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP),
        )
    })
}
unsafe extern "C" fn wr_atomic_fetch_add(q: *mut abi::ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::FetchAdd {
                remote: RemoteAddr { addr, rkey },
                add,
            },
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD),
        )
    })
}
unsafe extern "C" fn wr_set_sge(q: *mut abi::ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    let sge = abi::ibv_sge { addr, length, lkey };
    qpx(q, |qp| qp.wr_set_sges(std::slice::from_ref(&sge)))
}
unsafe extern "C" fn wr_set_sge_list(q: *mut abi::ibv_qp_ex, n: usize, list: *const abi::ibv_sge) {
    if n > 0 && list.is_null() {
        return unsupported(q);
    }
    let sges = if n == 0 {
        &[]
    } else {
        // SAFETY: the caller's array of `n` entries, checked non-null.
        unsafe { std::slice::from_raw_parts(list, n) }
    };
    qpx(q, |qp| qp.wr_set_sges(sges))
}
unsafe extern "C" fn wr_set_inline_data(q: *mut abi::ibv_qp_ex, addr: *mut c_void, len: usize) {
    if len > 0 && addr.is_null() {
        return unsupported(q);
    }
    let data = if len == 0 {
        &[][..]
    } else {
        // SAFETY: the caller's buffer of `len` bytes, checked non-null.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
    };
    qpx(q, |qp| qp.wr_set_inline(&[data]))
}
unsafe extern "C" fn wr_set_inline_data_list(
    q: *mut abi::ibv_qp_ex,
    n: usize,
    list: *const abi::ibv_data_buf,
) {
    if n > 0 && list.is_null() {
        return unsupported(q);
    }
    let bufs = if n == 0 {
        &[][..]
    } else {
        // SAFETY: the caller's array of `n` entries, checked non-null.
        unsafe { std::slice::from_raw_parts(list, n) }
    };
    let mut parts: Vec<&[u8]> = Vec::with_capacity(n);
    for b in bufs {
        if b.length == 0 {
            continue;
        }
        if b.addr.is_null() {
            return unsupported(q);
        }
        // SAFETY: the caller's buffer of `length` bytes, checked non-null.
        parts.push(unsafe { std::slice::from_raw_parts(b.addr as *const u8, b.length) });
    }
    qpx(q, |qp| qp.wr_set_inline(&parts))
}
unsafe extern "C" fn wr_bind_mw(
    q: *mut abi::ibv_qp_ex,
    mw: *mut abi::ibv_mw,
    rkey: u32,
    info: *const abi::ibv_mw_bind_info,
) {
    // SAFETY: NULL or the caller's struct.
    let Some(info) = (unsafe { info.as_ref() }) else {
        return unsupported(q);
    };
    with(
        q as *mut RbQp,
        Kind::Qp,
        (),
        |st, qp| match crate::mw::bind_op(st, mw, rkey, info) {
            Ok(op) => qp.wr_op(
                op,
                ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_BIND_MW),
            ),
            Err(e) => qp.build_err = qp.build_err.max(e),
        },
    )
}
unsafe extern "C" fn wr_local_inv(q: *mut abi::ibv_qp_ex, rkey: u32) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::LocalInv(rkey),
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_LOCAL_INV),
        )
    })
}
unsafe extern "C" fn wr_send_inv(q: *mut abi::ibv_qp_ex, rkey: u32) {
    qpx(q, |qp| {
        qp.wr_op(
            WrOp::SendInv(rkey),
            ops(abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND_WITH_INV),
        )
    })
}
unsafe extern "C" fn wr_send_tso(q: *mut abi::ibv_qp_ex, _hdr: *mut c_void, _sz: u16, _mss: u16) {
    unsupported(q)
}
unsafe extern "C" fn wr_set_ud_addr(
    q: *mut abi::ibv_qp_ex,
    ah: *mut abi::ibv_ah,
    qpn: u32,
    qkey: u32,
) {
    qpx(q, |qp| qp.wr_set_ud_addr(ah as usize, qpn, qkey))
}
unsafe extern "C" fn wr_set_xrc_srqn(q: *mut abi::ibv_qp_ex, srqn: u32) {
    qpx(q, |qp| qp.wr_set_xrc_srqn(srqn))
}
unsafe extern "C" fn wr_atomic_write(
    q: *mut abi::ibv_qp_ex,
    rkey: u32,
    addr: u64,
    atomic_wr: *const c_void,
) {
    if atomic_wr.is_null() {
        return unsupported(q);
    }
    // SAFETY: the caller's 8 bytes (`atomic_wr`, checked non-null), read unaligned as
    // libibverbs allows any alignment.
    let bytes = unsafe { (atomic_wr as *const [u8; 8]).read_unaligned() };
    qpx(q, |qp| qp.wr_atomic_write(RemoteAddr { addr, rkey }, bytes))
}
