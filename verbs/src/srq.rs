//! Shared receive queues, with tag matching (`IBV_SRQT_TM`) and its list operations.

use crate::abi;
use crate::cq::RbCq;
use crate::device::RbContext;
use crate::pd::RbPd;
use crate::qp::{post_list, post_result, recv_sges, MAX_SGE};
use crate::state::{Kind, State};
use ringbell::tm::TmOp;
use ringbell::{RecvWr, Sge, SharedReceiveQueue};

/// A ringbell SRQ.
#[repr(C)]
pub(crate) struct RbSrq {
    pub srq: abi::ibv_srq,
    pub ctx: *mut RbContext,
    pub pd: *mut RbPd,
    /// The TM-SRQ's or XRC SRQ's CQ (null for a plain SRQ).
    pub cq: *mut RbCq,
    /// An XRC SRQ's domain (null otherwise).
    pub xrcd: *mut crate::xrc::RbXrcd,
    pub drv: SharedReceiveQueue,
    pub max_wr: u32,
    pub max_sge: u32,
    /// The armed limit (0: not armed; the device disarms when it fires).
    pub limit: u32,
    /// QPs using the SRQ (destroying with any: EBUSY).
    pub users: u32,
    pub tm: bool,
}

/// `ibv_create_srq` / `ibv_create_srq_ex` after the pointers were checked (`cq` is null
/// unless a TM-SRQ asks for one).
pub(crate) fn create(
    st: &mut State,
    pd: &mut RbPd,
    cq: *mut RbCq,
    attr: &mut abi::ibv_srq_init_attr_ex,
) -> Result<*mut RbSrq, i32> {
    // SAFETY: a PD's context outlives it.
    let ctx = unsafe { &mut *pd.ctx };
    let caps = ctx.dev.caps().clone();
    let a = &mut attr.attr;
    if a.max_wr == 0
        || a.max_wr > caps.max_qp_wr
        || a.max_sge == 0
        || a.max_sge > caps.max_sge.min(MAX_SGE as u32)
        || a.srq_limit > a.max_wr
    {
        return Err(libc::EINVAL);
    }
    let tm = attr.srq_type == abi::ibv_srq_type_IBV_SRQT_TM;
    let xrcd = match attr.srq_type {
        abi::ibv_srq_type_IBV_SRQT_XRC => attr.xrcd as *mut crate::xrc::RbXrcd,
        _ => std::ptr::null_mut(),
    };
    let drv = if !xrcd.is_null() {
        if cq.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: both checked live by the caller.
        let (cq, x) = unsafe { (&*cq, &*xrcd) };
        if cq.ctx != pd.ctx || x.ctx != pd.ctx {
            return Err(libc::EINVAL);
        }
        pd.drv
            .create_xrc_srq(&x.drv, &cq.drv, a.max_wr, a.max_sge, a.srq_limit)
    } else if tm {
        if cq.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: checked live by the caller.
        let cq = unsafe { &*cq };
        if cq.ctx != pd.ctx {
            return Err(libc::EINVAL);
        }
        let t = &attr.tm_cap;
        if caps.max_num_tags == 0 {
            return Err(libc::EOPNOTSUPP);
        }
        if t.max_num_tags == 0
            || t.max_num_tags > caps.max_num_tags
            || t.max_ops == 0
            || t.max_ops > caps.max_tm_ops
        {
            return Err(libc::EINVAL);
        }
        pd.drv
            .create_tm_srq(&cq.drv, a.max_wr, a.max_sge, t.max_num_tags, t.max_ops)
            .and_then(|s| {
                if a.srq_limit > 0 {
                    s.arm(a.srq_limit)?;
                }
                Ok(s)
            })
    } else {
        pd.drv.create_srq(a.max_wr, a.max_sge, a.srq_limit)
    }
    .map_err(|e| crate::errno_of(&e))?;
    let srqn = drv.srqn();
    let (max_wr, max_sge, limit) = (a.max_wr, a.max_sge, a.srq_limit);
    let p = Box::into_raw(Box::new(RbSrq {
        srq: abi::ibv_srq {
            context: ctx.ibv(),
            srq_context: attr.srq_context,
            pd: &mut pd.pd,
            handle: srqn,
            ..Default::default()
        },
        ctx,
        pd,
        cq,
        xrcd,
        drv,
        max_wr,
        max_sge,
        limit,
        users: 0,
        tm,
    }));
    // SAFETY: `p` was just allocated; the mutex and condition variable are initialised in
    // place, where they stay.
    unsafe {
        libc::pthread_mutex_init(&mut (*p).srq.mutex as *mut _ as *mut _, std::ptr::null());
        libc::pthread_cond_init(&mut (*p).srq.cond as *mut _ as *mut _, std::ptr::null());
    }
    pd.children += 1;
    if !cq.is_null() {
        // SAFETY: checked live by the caller.
        unsafe { (*cq).users += 1 };
    }
    // SAFETY: checked live by the caller.
    if let Some(x) = unsafe { xrcd.as_mut() } {
        x.users += 1;
    }
    // SAFETY: see above (`ctx` is the PD's live context).
    let nic = unsafe { (*pd.ctx).nic };
    st.add(p as usize, Kind::Srq);
    st.srqs.insert((nic, srqn), p as usize);
    Ok(p)
}

/// `ibv_destroy_srq`.
pub(crate) fn destroy(st: &mut State, srq: &mut RbSrq) -> i32 {
    if srq.users != 0 {
        return libc::EBUSY;
    }
    let p = srq as *mut RbSrq;
    st.remove(p as usize);
    // SAFETY: an SRQ's context, PD and CQ outlive it.
    unsafe {
        st.srqs.remove(&((*srq.ctx).nic, srq.drv.srqn()));
        (*srq.pd).children -= 1;
        if let Some(cq) = srq.cq.as_mut() {
            cq.users -= 1;
        }
        if let Some(x) = srq.xrcd.as_mut() {
            x.users -= 1;
        }
    }
    // SAFETY: the `RbSrq` `create` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// `ibv_modify_srq`: the limit can be armed; ringbell SRQs are not resized.
pub(crate) fn modify(srq: &mut RbSrq, attr: &abi::ibv_srq_attr, mask: u32) -> i32 {
    let known = abi::ibv_srq_attr_mask_IBV_SRQ_MAX_WR | abi::ibv_srq_attr_mask_IBV_SRQ_LIMIT;
    if mask & !known != 0 || mask & abi::ibv_srq_attr_mask_IBV_SRQ_MAX_WR != 0 {
        return libc::EINVAL;
    }
    if mask & abi::ibv_srq_attr_mask_IBV_SRQ_LIMIT != 0 {
        if attr.srq_limit > srq.max_wr {
            return libc::EINVAL;
        }
        if let Err(e) = srq.drv.arm(attr.srq_limit) {
            return crate::errno_of(&e);
        }
        srq.limit = attr.srq_limit;
    }
    0
}

/// `ibv_query_srq`.
pub(crate) fn query(srq: &RbSrq, attr: &mut abi::ibv_srq_attr) -> i32 {
    *attr = abi::ibv_srq_attr {
        max_wr: srq.max_wr,
        max_sge: srq.max_sge,
        srq_limit: srq.limit,
    };
    0
}

/// `ibv_post_srq_recv`.
///
/// # Safety
/// `wr` must be a valid list of `struct ibv_recv_wr`.
pub(crate) unsafe fn post_recv(
    srq: &mut RbSrq,
    wr: *mut abi::ibv_recv_wr,
    bad: *mut *mut abi::ibv_recv_wr,
) -> i32 {
    let mut sges = [Sge::default(); MAX_SGE];
    let max_sge = srq.max_sge;
    // SAFETY: the caller's list; each request is valid, as libibverbs requires.
    unsafe {
        post_list(wr, bad, |w| {
            recv_sges(w, max_sge, &mut sges).map_or_else(
                |e| e,
                |n| {
                    post_result(srq.drv.post_recv(&[RecvWr {
                        wr_id: w.wr_id,
                        sgl: &sges[..n],
                    }]))
                },
            )
        })
    }
}

/// `ibv_post_srq_ops`: tag-matching list operations; an ADD's handle is written back.
///
/// # Safety
/// `op` must be a valid list of `struct ibv_ops_wr`.
pub(crate) unsafe fn post_ops(
    srq: &mut RbSrq,
    op: *mut abi::ibv_ops_wr,
    bad: *mut *mut abi::ibv_ops_wr,
) -> i32 {
    if !srq.tm {
        if !bad.is_null() {
            // SAFETY: the caller's out-pointer, checked non-null.
            unsafe { *bad = op };
        }
        return libc::EINVAL;
    }
    // SAFETY: the caller's list; each operation is valid, as libibverbs requires.
    unsafe { post_list(op, bad, |o| post_op(srq, o)) }
}

/// # Safety
/// `o` must be a valid operation.
unsafe fn post_op(srq: &mut RbSrq, o: &mut abi::ibv_ops_wr) -> i32 {
    let t = &o.tm;
    let mut top = match o.opcode {
        abi::ibv_ops_wr_opcode_IBV_WR_TAG_ADD => {
            let add = &t.add;
            if add.num_sge < 0 || add.num_sge > 1 || (add.num_sge == 1 && add.sg_list.is_null()) {
                return libc::EINVAL;
            }
            let sge = if add.num_sge == 1 {
                // SAFETY: one entry, checked non-null.
                let s = unsafe { &*add.sg_list };
                Sge {
                    addr: s.addr,
                    len: s.length,
                    lkey: s.lkey,
                }
            } else {
                Sge::default()
            };
            TmOp::add(o.wr_id, add.recv_wr_id, sge, add.tag, add.mask)
        }
        abi::ibv_ops_wr_opcode_IBV_WR_TAG_DEL => TmOp::del(o.wr_id, t.handle),
        abi::ibv_ops_wr_opcode_IBV_WR_TAG_SYNC => TmOp::sync(o.wr_id, t.unexpected_cnt),
        _ => return libc::EINVAL,
    };
    let flags = o.flags as u32;
    if flags & !(abi::ibv_ops_flags_IBV_OPS_SIGNALED | abi::ibv_ops_flags_IBV_OPS_TM_SYNC) != 0 {
        return libc::EINVAL;
    }
    top.signaled = flags & abi::ibv_ops_flags_IBV_OPS_SIGNALED != 0;
    if flags & abi::ibv_ops_flags_IBV_OPS_TM_SYNC != 0 {
        top = top.with_count(t.unexpected_cnt);
    } else if o.opcode != abi::ibv_ops_wr_opcode_IBV_WR_TAG_SYNC {
        top.unexpected_cnt = None;
    }
    let mut ops = [top];
    match srq.drv.post_tm_ops(&mut ops) {
        Ok(()) => {
            if o.opcode == abi::ibv_ops_wr_opcode_IBV_WR_TAG_ADD {
                o.tm.handle = ops[0].handle;
            }
            0
        }
        Err(e) => crate::errno_of(&e),
    }
}
