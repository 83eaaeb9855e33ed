//! Receive WQs (`ibv_create_wq(3)`), their indirection tables
//! (`ibv_create_rwq_ind_table(3)`) and RSS raw packet QPs (`IBV_QP_INIT_ATTR_RX_HASH` with
//! `IBV_QP_INIT_ATTR_IND_TABLE`), over the driver's [`ringbell::raw`].
//!
//! A WQ is a receive queue with a CQ of its own, in RESET until `ibv_modify_wq` makes it
//! RDY; frames reach it only through an RSS QP's table, by the Toeplitz hash of the fields
//! the QP's hash configuration selects. An RSS QP only receives: it has no send queue,
//! `ibv_post_send` and `ibv_post_recv` on it are EINVAL, and its state does not matter.

use crate::abi;
use crate::cq::RbCq;
use crate::device::RbContext;
use crate::pd::RbPd;
use crate::qp::RbQp;
use crate::state::{Kind, Owner, State};
use ringbell::raw::WqState;
use ringbell::{QpInit, QpType, RecvWr, Sge, SharedReceiveQueue};

/// A ringbell receive WQ.
#[repr(C)]
pub(crate) struct RbWq {
    pub wq: abi::ibv_wq,
    pub ctx: *mut RbContext,
    pub pd: *mut RbPd,
    pub cq: *mut RbCq,
    pub drv: SharedReceiveQueue,
    pub max_sge: u32,
    /// Indirection tables that list it (destroying it with any: EBUSY).
    pub users: u32,
}

/// A ringbell indirection table.
#[repr(C)]
pub(crate) struct RbIndTable {
    pub t: abi::ibv_rwq_ind_table,
    pub ctx: *mut RbContext,
    pub wqs: Vec<*mut RbWq>,
    /// RSS QPs made with it (destroying it with any: EBUSY).
    pub users: u32,
}

/// `ibv_create_wq`.
pub(crate) fn create(
    st: &mut State,
    ctx: &mut RbContext,
    a: &mut abi::ibv_wq_init_attr,
) -> Result<*mut abi::ibv_wq, i32> {
    if a.comp_mask != 0 || a.create_flags != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if a.wq_type != abi::ibv_wq_type_IBV_WQT_RQ {
        return Err(libc::EINVAL);
    }
    if st.owner(a.pd as usize) != Owner::Ours(Kind::Pd)
        || st.owner(a.cq as usize) != Owner::Ours(Kind::Cq)
    {
        return Err(libc::EINVAL);
    }
    let me: *mut RbContext = ctx;
    // SAFETY: the registry says both are live objects of these kinds; the lock is held.
    let (pd, cq) = unsafe { (&mut *(a.pd as *mut RbPd), &mut *(a.cq as *mut RbCq)) };
    if pd.ctx != me || cq.ctx != me {
        return Err(libc::EINVAL);
    }
    let caps = ctx.dev.caps();
    if a.max_wr == 0 || a.max_wr > caps.max_qp_wr || a.max_sge == 0 || a.max_sge > caps.max_sge {
        return Err(libc::EINVAL);
    }
    let drv = pd
        .drv
        .create_recv_wq(&cq.drv, a.max_wr, a.max_sge)
        .map_err(|e| crate::errno_of(&e))?;
    let num = drv.srqn();
    // What the WQ really holds (libibverbs' callers read it back).
    a.max_wr = a.max_wr.next_power_of_two().max(2);
    let p = Box::into_raw(Box::new(RbWq {
        wq: abi::ibv_wq {
            context: ctx.ibv(),
            wq_context: a.wq_context,
            pd: &mut pd.pd,
            cq: cq as *mut RbCq as *mut abi::ibv_cq,
            wq_num: num,
            handle: num,
            state: abi::ibv_wq_state_IBV_WQS_RESET,
            wq_type: a.wq_type,
            post_recv: Some(crate::ops::post_wq_recv),
            ..Default::default()
        },
        ctx,
        pd,
        cq,
        drv,
        max_sge: a.max_sge,
        users: 0,
    }));
    // SAFETY: `p` was just allocated; the mutex and condition variable are initialised in
    // place, where they stay.
    unsafe {
        libc::pthread_mutex_init(&mut (*p).wq.mutex as *mut _ as *mut _, std::ptr::null());
        libc::pthread_cond_init(&mut (*p).wq.cond as *mut _ as *mut _, std::ptr::null());
    }
    pd.children += 1;
    cq.users += 1;
    st.add(p as usize, Kind::Wq);
    Ok(p as *mut abi::ibv_wq)
}

/// `ibv_modify_wq`: the state (RESET, RDY, ERR), checked against the current one when
/// `IBV_WQ_ATTR_CURR_STATE` is given. Flags are EOPNOTSUPP.
pub(crate) fn modify(w: &mut RbWq, a: &abi::ibv_wq_attr) -> i32 {
    let known =
        abi::ibv_wq_attr_mask_IBV_WQ_ATTR_STATE | abi::ibv_wq_attr_mask_IBV_WQ_ATTR_CURR_STATE;
    if a.attr_mask & !known != 0 {
        return libc::EOPNOTSUPP;
    }
    if a.attr_mask & abi::ibv_wq_attr_mask_IBV_WQ_ATTR_CURR_STATE != 0
        && a.curr_wq_state != w.wq.state
    {
        return libc::EINVAL;
    }
    if a.attr_mask & abi::ibv_wq_attr_mask_IBV_WQ_ATTR_STATE == 0 {
        return 0;
    }
    let to = match a.wq_state {
        abi::ibv_wq_state_IBV_WQS_RESET => WqState::Reset,
        abi::ibv_wq_state_IBV_WQS_RDY => WqState::Ready,
        abi::ibv_wq_state_IBV_WQS_ERR => WqState::Err,
        _ => return libc::EINVAL,
    };
    if let Err(e) = w.drv.modify_wq(to) {
        return crate::errno_of(&e);
    }
    w.wq.state = a.wq_state;
    0
}

/// `ibv_destroy_wq`: EBUSY while an indirection table lists it.
pub(crate) fn destroy(st: &mut State, w: &mut RbWq) -> i32 {
    if w.users > 0 {
        return libc::EBUSY;
    }
    let p = w as *mut RbWq;
    st.remove(p as usize);
    // SAFETY: a WQ's PD and CQ outlive it (their destroy is refused while it lives).
    unsafe {
        (*w.pd).children -= 1;
        (*w.cq).users -= 1;
    }
    // SAFETY: the `RbWq` `create` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// `wq->post_recv`.
///
/// # Safety
/// `wr` must be a valid list of `struct ibv_recv_wr`; `bad` null or writable.
pub(crate) unsafe fn post_recv(
    w: &mut RbWq,
    wr: *mut abi::ibv_recv_wr,
    bad: *mut *mut abi::ibv_recv_wr,
) -> i32 {
    let mut sges = [Sge::default(); crate::qp::MAX_SGE];
    let max_sge = w.max_sge;
    // SAFETY: the caller's list; each request is valid, as libibverbs requires.
    unsafe {
        crate::qp::post_list(wr, bad, |r| {
            crate::qp::recv_sges(r, max_sge, &mut sges).map_or_else(
                |e| e,
                |n| {
                    crate::qp::post_result(w.drv.post_recv(&[RecvWr {
                        wr_id: r.wr_id,
                        sgl: &sges[..n],
                    }]))
                },
            )
        })
    }
}

/// `ibv_create_rwq_ind_table`, with the WQ pointers read at the boundary: a power of two
/// of live WQs of this context (`1 << log_ind_tbl_size` of them).
pub(crate) fn create_table(
    st: &mut State,
    ctx: &mut RbContext,
    log: u32,
    wqs: &[*mut abi::ibv_wq],
) -> Result<*mut abi::ibv_rwq_ind_table, i32> {
    let me: *mut RbContext = ctx;
    if log > u32::from(ringbell::raw::RSS_MAX_LOG_SIZE) || wqs.len() != 1 << log {
        return Err(libc::EINVAL);
    }
    let mut list = Vec::with_capacity(wqs.len());
    for &w in wqs {
        if st.owner(w as usize) != Owner::Ours(Kind::Wq) {
            return Err(libc::EINVAL);
        }
        let w = w as *mut RbWq;
        // SAFETY: the registry says it is a live WQ; the lock is held.
        if unsafe { (*w).ctx } != me {
            return Err(libc::EINVAL);
        }
        list.push(w);
    }
    for &w in &list {
        // SAFETY: as above.
        unsafe { (*w).users += 1 };
    }
    let p = Box::into_raw(Box::new(RbIndTable {
        t: abi::ibv_rwq_ind_table {
            context: ctx.ibv(),
            ..Default::default()
        },
        ctx,
        wqs: list,
        users: 0,
    }));
    // A number of its own: its address's low bits are as unique as anything while it lives.
    // SAFETY: just allocated.
    unsafe {
        (*p).t.ind_tbl_handle = (p as usize >> 4) as i32;
        (*p).t.ind_tbl_num = (*p).t.ind_tbl_handle;
    }
    st.add(p as usize, Kind::IndTable);
    Ok(p as *mut abi::ibv_rwq_ind_table)
}

/// `ibv_destroy_rwq_ind_table`: EBUSY while an RSS QP uses it.
pub(crate) fn destroy_table(st: &mut State, t: &mut RbIndTable) -> i32 {
    if t.users > 0 {
        return libc::EBUSY;
    }
    let p = t as *mut RbIndTable;
    st.remove(p as usize);
    for &w in &t.wqs {
        // SAFETY: a table's WQs outlive it (their destroy is refused while it lives).
        unsafe { (*w).users -= 1 };
    }
    // SAFETY: the `RbIndTable` `create_table` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// `ibv_create_qp_ex` of an RSS QP: a raw packet QP in `a.pd` receiving through the table
/// `a.rwq_ind_tbl` by the hash `a.rx_hash_conf` (whose key the boundary read into `key`).
pub(crate) fn create_rss_qp(
    st: &mut State,
    ctx: &mut RbContext,
    a: &mut abi::ibv_qp_init_attr_ex,
    key: &[u8],
) -> Result<*mut RbQp, i32> {
    let need = abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD
        | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_RX_HASH
        | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_IND_TABLE;
    let known = need | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_CREATE_FLAGS;
    if a.comp_mask & !known != 0 || a.create_flags != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if a.comp_mask & need != need || a.qp_type != abi::ibv_qp_type_IBV_QPT_RAW_PACKET {
        return Err(libc::EINVAL);
    }
    let h = &a.rx_hash_conf;
    let fields_known = (1u64 << 8) - 1;
    if h.rx_hash_function != abi::ibv_rx_hash_function_flags_IBV_RX_HASH_FUNC_TOEPLITZ as u8
        || h.rx_hash_fields_mask & !fields_known != 0
    {
        return Err(libc::EOPNOTSUPP);
    }
    if st.owner(a.pd as usize) != Owner::Ours(Kind::Pd)
        || st.owner(a.rwq_ind_tbl as usize) != Owner::Ours(Kind::IndTable)
    {
        return Err(libc::EINVAL);
    }
    let me: *mut RbContext = ctx;
    // SAFETY: the registry says both are live objects of these kinds; the lock is held.
    let (pd, table) = unsafe {
        (
            &mut *(a.pd as *mut RbPd),
            &mut *(a.rwq_ind_tbl as *mut RbIndTable),
        )
    };
    if pd.ctx != me || table.ctx != me {
        return Err(libc::EINVAL);
    }
    // SAFETY: a table's WQs outlive it; the lock is held.
    let wqs: Vec<&RbWq> = table.wqs.iter().map(|&w| unsafe { &*w }).collect();
    // The QP's own queues are never used: the smallest the device makes, on the first
    // WQ's CQ.
    // SAFETY: a WQ's CQ outlives it.
    let cq = unsafe { &(*wqs[0].cq).drv };
    let mut init = QpInit::new(cq, cq);
    init.qp_type = QpType::RawPacket;
    init.max_send_wr = 1;
    init.max_recv_wr = 1;
    let drv = pd.drv.create_qp(&init).map_err(|e| crate::errno_of(&e))?;
    let drvs: Vec<&SharedReceiveQueue> = wqs.iter().map(|w| &w.drv).collect();
    drv.set_rss(h.rx_hash_fields_mask as u32, key, &drvs)
        .map_err(|e| crate::errno_of(&e))?;
    a.cap = abi::ibv_qp_cap::default();
    let p = crate::qp::publish(
        st,
        ctx,
        Some((
            pd,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )),
        drv,
        a,
        QpType::RawPacket,
    )?;
    // SAFETY: just made.
    unsafe { (*p).ind_table = table };
    pd.children += 1;
    table.users += 1;
    Ok(p)
}
