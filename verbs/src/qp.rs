//! Queue pairs, reliable connected and unreliable datagram: creation, the state machine with
//! libibverbs' attribute masks, and both posting interfaces (`ibv_post_send` work request
//! lists and the `ibv_wr_*` builder). A UD send names its destination by address handle,
//! remote QPN and Q_Key.

use crate::abi;
use crate::ah::RbAh;
use crate::cq::RbCq;
use crate::device::{mac_of_gid, RbContext};
use crate::pd::RbPd;
use crate::srq::RbSrq;
use crate::state::{Kind, Owner, State};
use ringbell::{
    QpInit, QpState, QpType, QueuePair, RecvWr, RemoteAddr, SendFlags, SendWr, Sge, UdDest, WrOp,
};
use ringbell_specs::cmd::{QpAttr, QpAttrMask};
use ringbell_specs::wqe::{MAX_INLINE_UD, MAX_UD_SEND_SGE};

/// Most SGEs a work request may carry through this library.
pub(crate) const MAX_SGE: usize = 32;

/// A work request built with the `ibv_wr_*` calls, waiting for `ibv_wr_complete`.
#[derive(Debug)]
pub(crate) struct Pending {
    wr_id: u64,
    flags: u32,
    op: WrOp,
    sgl: Vec<Sge>,
    inline: Option<Vec<u8>>,
    /// `ibv_wr_set_ud_addr`: the address handle (as the program's pointer, checked when the
    /// request is posted), remote QPN and Q_Key.
    ud: Option<(usize, u32, u32)>,
    /// `ibv_wr_set_xrc_srqn`: the SRQ at the target (XRC initiators).
    xrc_srqn: u32,
}

/// A ringbell QP: the extended QP layout (whose prefix is `struct ibv_qp`) and the state
/// behind it.
#[repr(C)]
pub(crate) struct RbQp {
    pub qpx: abi::ibv_qp_ex,
    pub ctx: *mut RbContext,
    pub pd: *mut RbPd,
    pub send_cq: *mut RbCq,
    pub recv_cq: *mut RbCq,
    pub srq: *mut RbSrq,
    /// An XRC target's domain (null otherwise).
    pub xrcd: *mut crate::xrc::RbXrcd,
    pub drv: QueuePair,
    /// An unreliable datagram QP (else RC).
    pub ud: bool,
    /// An XRC initiator (`IBV_QPT_XRC_SEND`) or target (`IBV_QPT_XRC_RECV`).
    pub xrc: Option<QpType>,
    pub cap: abi::ibv_qp_cap,
    pub sq_sig_all: bool,
    /// Whether `ibv_qp_to_qp_ex` hands out the builder (created with send ops flags).
    pub ex: bool,
    pub send_ops_flags: u64,
    /// The address vector of the last modify that set one (for `ibv_query_qp`).
    pub ah_attr: abi::ibv_ah_attr,
    /// Builder state between `ibv_wr_start` and `ibv_wr_complete`.
    pub building: Option<Vec<Pending>>,
    /// The first error a builder call hit (reported by `ibv_wr_complete`).
    pub build_err: i32,
    /// Gathered inline payload of the request being posted (no allocation per post).
    inline_buf: Vec<u8>,
    /// An RSS QP's indirection table (NULL for any other QP): it only receives, through
    /// the table's WQs.
    pub ind_table: *mut crate::wq::RbIndTable,
    /// The multicast groups a raw packet QP is attached to, each through a rule on its MAC
    /// address (a UD QP's groups are the driver's: `QueuePair::mcast_attached`).
    pub mcast: Vec<([u8; 16], ringbell::raw::Flow)>,
}

/// The send operations a ringbell QP can build.
pub(crate) const SEND_OPS: u64 = (abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_WRITE
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND_WITH_IMM
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_READ
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND_WITH_INV
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_LOCAL_INV
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_BIND_MW
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_ATOMIC_WRITE)
    as u64;

/// The send operations a UC QP can build: SEND and RDMA WRITE, with or without immediate.
pub(crate) const SEND_OPS_UC: u64 = (abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_WRITE
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND_WITH_IMM
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_LOCAL_INV
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_BIND_MW)
    as u64;

/// The send operations a UD QP can build.
pub(crate) const SEND_OPS_UD: u64 = (abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND
    | abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND_WITH_IMM)
    as u64;

/// The send operations a raw packet QP can build: SEND of a whole frame.
pub(crate) const SEND_OPS_RAW: u64 = abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_SEND as u64;

/// Checked pointers of a creation request.
pub(crate) struct CreateArgs {
    pub pd: *mut RbPd,
    pub send_cq: *mut RbCq,
    pub recv_cq: *mut RbCq,
    pub srq: *mut RbSrq,
}

/// `ibv_create_qp` / `ibv_create_qp_ex`, after the pointers were checked.
pub(crate) fn create(
    st: &mut State,
    a: &CreateArgs,
    attr: &mut abi::ibv_qp_init_attr_ex,
) -> Result<*mut RbQp, i32> {
    const SUPPORTED_MASK: u32 = abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD
        | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_CREATE_FLAGS
        | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    let qp_type = match attr.qp_type {
        abi::ibv_qp_type_IBV_QPT_RC => QpType::Rc,
        abi::ibv_qp_type_IBV_QPT_UC => QpType::Uc,
        abi::ibv_qp_type_IBV_QPT_UD => QpType::Ud,
        abi::ibv_qp_type_IBV_QPT_XRC_SEND => QpType::XrcIni,
        abi::ibv_qp_type_IBV_QPT_RAW_PACKET => QpType::RawPacket,
        // A target is made in its XRC domain (ibv_create_qp_ex with IBV_QP_INIT_ATTR_XRCD).
        abi::ibv_qp_type_IBV_QPT_XRC_RECV => return Err(libc::EINVAL),
        _ => return Err(libc::EOPNOTSUPP),
    };
    let ini = qp_type == QpType::XrcIni;
    let ud = qp_type == QpType::Ud;
    if attr.comp_mask & !SUPPORTED_MASK != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if attr.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_CREATE_FLAGS != 0
        && attr.create_flags != 0
    {
        return Err(libc::EOPNOTSUPP);
    }
    let ex = attr.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0;
    let ops = match qp_type {
        QpType::Ud => SEND_OPS_UD,
        QpType::Uc => SEND_OPS_UC,
        QpType::RawPacket => SEND_OPS_RAW,
        _ => SEND_OPS,
    };
    if ex && attr.send_ops_flags & !ops != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: the entry point checked every pointer in `a` names a live ringbell object
    // (or is null where allowed), and holds the lock.
    let (pd, scq, rcq) = unsafe { (&mut *a.pd, &mut *a.send_cq, &mut *a.recv_cq) };
    // SAFETY: as above.
    let srq = unsafe { a.srq.as_mut() };
    // SAFETY: a PD's context outlives it.
    let ctx = unsafe { &mut *pd.ctx };
    // The CQs and the SRQ must be the same context's objects (as the kernel looks them up in
    // the same device file).
    if scq.ctx != pd.ctx || rcq.ctx != pd.ctx || srq.as_ref().is_some_and(|s| s.ctx != pd.ctx) {
        return Err(libc::EINVAL);
    }
    let caps = ctx.dev.caps().clone();
    let c = &mut attr.cap;
    let max_sge = caps.max_sge.min(MAX_SGE as u32);
    // A UD WQE also holds the destination, which leaves less room for the gather list or
    // the inline data (as on mlx5, a request beyond what a WQE holds is refused).
    let (max_send_sge, max_inline) = if ud {
        (
            max_sge.min(MAX_UD_SEND_SGE as u32),
            caps.max_inline.min(MAX_INLINE_UD as u32),
        )
    } else {
        (max_sge, caps.max_inline)
    };
    // An XRC initiator only sends: its receive side is ignored.
    if ini {
        if srq.is_some() {
            return Err(libc::EINVAL);
        }
        (c.max_recv_wr, c.max_recv_sge) = (0, 0);
    }
    if c.max_send_wr > caps.max_qp_wr
        || (srq.is_none() && c.max_recv_wr > caps.max_qp_wr)
        || c.max_send_sge > max_send_sge
        || c.max_recv_sge > max_sge
        || c.max_inline_data > max_inline
    {
        return Err(libc::EINVAL);
    }
    let mut init = QpInit::new(&scq.drv, &rcq.drv);
    init.qp_type = qp_type;
    init.srq = srq.as_ref().map(|s| &s.drv);
    init.max_send_wr = c.max_send_wr.max(1);
    init.max_recv_wr = if srq.is_some() || ini {
        0
    } else {
        c.max_recv_wr.max(1)
    };
    init.max_send_sge = c.max_send_sge.max(1);
    init.max_recv_sge = c.max_recv_sge.max(1);
    init.max_inline = c.max_inline_data;
    let drv = pd.drv.create_qp(&init).map_err(|e| crate::errno_of(&e))?;
    // What the QP really has (libibverbs writes it back into the caller's attributes).
    c.max_send_wr = init.max_send_wr;
    // The receive ring as the driver made it: every entry takes a request (so the request
    // after the last one reported here is refused with ENOMEM, as on mlx5, which reports its
    // rounded-up ring too).
    c.max_recv_wr = drv.recv_queue_depth();
    c.max_send_sge = init.max_send_sge;
    // The inline room the WQE size gives (mlx5 reports and honours it too).
    c.max_inline_data = drv.max_inline();
    c.max_recv_sge = if srq.is_some() || ini {
        0
    } else {
        init.max_recv_sge
    };
    let p = publish(
        st,
        ctx,
        Some((pd, a.send_cq, a.recv_cq, a.srq)),
        drv,
        attr,
        qp_type,
    )?;
    pd.children += 1;
    scq.users += 1;
    rcq.users += 1;
    if let Some(s) = srq {
        s.users += 1;
    }
    Ok(p)
}

/// Makes the `RbQp` of a device QP just created on context `ctx`, with its PD, CQs and
/// SRQ (none for an XRC target), and records it. The creator counts the uses.
pub(crate) fn publish(
    st: &mut State,
    ctx: &mut RbContext,
    uses: Option<(&mut RbPd, *mut RbCq, *mut RbCq, *mut RbSrq)>,
    drv: QueuePair,
    attr: &abi::ibv_qp_init_attr_ex,
    qp_type: QpType,
) -> Result<*mut RbQp, i32> {
    let ex = attr.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0;
    let qpn = drv.qpn();
    let (pd, scq, rcq, srq) = match uses {
        Some((pd, s, r, q)) => (pd as *mut RbPd, s, r, q),
        None => Default::default(),
    };
    let mut qpx = abi::ibv_qp_ex::default();
    qpx.qp_base.context = ctx.ibv();
    qpx.qp_base.qp_context = attr.qp_context;
    // SAFETY: a live PD when given (the caller's), else null.
    qpx.qp_base.pd = unsafe { pd.as_mut() }.map_or(std::ptr::null_mut(), |p| &mut p.pd);
    qpx.qp_base.send_cq = scq as *mut abi::ibv_cq;
    qpx.qp_base.recv_cq = rcq as *mut abi::ibv_cq;
    qpx.qp_base.srq = srq as *mut abi::ibv_srq;
    qpx.qp_base.handle = qpn;
    qpx.qp_base.qp_num = qpn;
    qpx.qp_base.state = abi::ibv_qp_state_IBV_QPS_RESET;
    qpx.qp_base.qp_type = attr.qp_type;
    if ex {
        crate::ops::fill_qp_ex(&mut qpx);
    }
    let p = Box::into_raw(Box::new(RbQp {
        qpx,
        ctx,
        pd,
        send_cq: scq,
        recv_cq: rcq,
        srq,
        xrcd: std::ptr::null_mut(),
        drv,
        ud: qp_type == QpType::Ud,
        xrc: matches!(qp_type, QpType::XrcIni | QpType::XrcTgt).then_some(qp_type),
        cap: attr.cap,
        sq_sig_all: attr.sq_sig_all != 0,
        ex,
        send_ops_flags: if ex { attr.send_ops_flags } else { 0 },
        ah_attr: abi::ibv_ah_attr::default(),
        building: None,
        build_err: 0,
        inline_buf: Vec::with_capacity(attr.cap.max_inline_data as usize),
        ind_table: std::ptr::null_mut(),
        mcast: Vec::new(),
    }));
    // SAFETY: `p` was just allocated; the mutex and condition variable are initialised in
    // place, where they stay.
    unsafe {
        libc::pthread_mutex_init(
            &mut (*p).qpx.qp_base.mutex as *mut _ as *mut _,
            std::ptr::null(),
        );
        libc::pthread_cond_init(
            &mut (*p).qpx.qp_base.cond as *mut _ as *mut _,
            std::ptr::null(),
        );
    }
    st.add(p as usize, Kind::Qp);
    st.qps.insert((ctx.nic, qpn), p as usize);
    Ok(p)
}

/// `ibv_destroy_qp`.
pub(crate) fn destroy(st: &mut State, qp: &mut RbQp) -> i32 {
    let p = qp as *mut RbQp;
    st.remove(p as usize);
    // SAFETY: a QP's context, PD, CQs and SRQ outlive it (their destroy is refused while
    // it lives).
    unsafe {
        st.qps.remove(&((*qp.ctx).nic, qp.drv.qpn()));
        if let Some(pd) = qp.pd.as_mut() {
            pd.children -= 1;
        }
        if let Some(c) = qp.send_cq.as_mut() {
            c.users -= 1;
        }
        if let Some(c) = qp.recv_cq.as_mut() {
            c.users -= 1;
        }
        if let Some(s) = qp.srq.as_mut() {
            s.users -= 1;
        }
        if let Some(x) = qp.xrcd.as_mut() {
            x.users -= 1;
        }
        if let Some(t) = qp.ind_table.as_mut() {
            t.users -= 1;
        }
    }
    // The QP's multicast groups and rules go with it (the driver removes them first).
    qp.mcast.clear();
    // SAFETY: the `RbQp` `create` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(p) });
    0
}

fn qp_state_of(s: u32) -> Option<QpState> {
    Some(match s {
        abi::ibv_qp_state_IBV_QPS_RESET => QpState::Reset,
        abi::ibv_qp_state_IBV_QPS_INIT => QpState::Init,
        abi::ibv_qp_state_IBV_QPS_RTR => QpState::Rtr,
        abi::ibv_qp_state_IBV_QPS_RTS => QpState::Rts,
        abi::ibv_qp_state_IBV_QPS_SQD => QpState::Sqd,
        abi::ibv_qp_state_IBV_QPS_SQE => QpState::Sqe,
        abi::ibv_qp_state_IBV_QPS_ERR => QpState::Err,
        _ => return None,
    })
}

/// `ibv_modify_qp`: libibverbs' masks are the device's; the device checks each transition's
/// required and optional attributes (IBTA table) and refuses anything else with EINVAL.
pub(crate) fn modify(qp: &mut RbQp, attr: &abi::ibv_qp_attr, mask: u32) -> i32 {
    // The kernel drops the attributes an XRC QP's one side does not have before checking
    // the transition (uverbs' modify_qp_mask), so programs pass RC's masks for both.
    let mask = match qp.xrc {
        Some(QpType::XrcIni) => {
            mask & !(abi::ibv_qp_attr_mask_IBV_QP_MAX_DEST_RD_ATOMIC
                | abi::ibv_qp_attr_mask_IBV_QP_MIN_RNR_TIMER)
        }
        Some(QpType::XrcTgt) => {
            mask & !(abi::ibv_qp_attr_mask_IBV_QP_MAX_QP_RD_ATOMIC
                | abi::ibv_qp_attr_mask_IBV_QP_RETRY_CNT
                | abi::ibv_qp_attr_mask_IBV_QP_RNR_RETRY)
        }
        _ => mask,
    };
    let mut a = QpAttr::default();
    if mask & abi::ibv_qp_attr_mask_IBV_QP_STATE != 0 {
        match qp_state_of(attr.qp_state) {
            Some(s) => a.state = s as u8,
            None => return libc::EINVAL,
        }
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_CUR_STATE != 0 {
        match qp_state_of(attr.cur_qp_state) {
            Some(s) => a.cur_state = s as u8,
            None => return libc::EINVAL,
        }
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_PORT != 0 && attr.port_num != 1 {
        return libc::EINVAL;
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_PKEY_INDEX != 0 && attr.pkey_index != 0 {
        return libc::EINVAL;
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_AV != 0 {
        let ah = &attr.ah_attr;
        if ah.is_global == 0 || ah.grh.sgid_index != 0 || ah.port_num > 1 {
            // A RoCE port needs the GRH; its GID table has one entry.
            return libc::EINVAL;
        }
        // SAFETY: every bit pattern is a valid `raw` view of the GID union.
        let dgid = unsafe { ah.grh.dgid.raw };
        match mac_of_gid(&dgid) {
            // A connection has one peer: a group address is no path.
            Some((mac, _)) if mac[0] & 1 != 0 => return libc::EINVAL,
            Some((mac, ip)) => {
                a.dest_mac = mac;
                a.dest_ip = ip;
            }
            None => return libc::EINVAL,
        }
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_ACCESS_FLAGS != 0 {
        // The remote rights matter; the other memory-access flags (a program may pass its
        // regions' flags, IBV_ACCESS_ON_DEMAND included, as rdma-core's tests do) are
        // accepted and ignored, as mlx5 does. A bit no flag has is EINVAL.
        let known = abi::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE
            | abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
            | abi::ibv_access_flags_IBV_ACCESS_REMOTE_READ
            | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC
            | abi::ibv_access_flags_IBV_ACCESS_MW_BIND
            | abi::ibv_access_flags_IBV_ACCESS_ZERO_BASED
            | abi::ibv_access_flags_IBV_ACCESS_ON_DEMAND
            | abi::ibv_access_flags_IBV_ACCESS_HUGETLB
            | crate::pd::OPTIONAL_RANGE;
        if attr.qp_access_flags & !known != 0 {
            return libc::EINVAL;
        }
        a.access = (attr.qp_access_flags & 0xe).into();
    }
    a.path_mtu = attr.path_mtu as u8;
    a.timeout = attr.timeout;
    a.retry_cnt = attr.retry_cnt;
    a.rnr_retry = attr.rnr_retry;
    a.min_rnr_timer = attr.min_rnr_timer;
    a.max_rd_atomic = attr.max_rd_atomic;
    a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
    a.dest_qpn = attr.dest_qp_num.into();
    a.rq_psn = attr.rq_psn.into();
    a.sq_psn = attr.sq_psn.into();
    a.pkey_index = attr.pkey_index.into();
    a.qkey = attr.qkey.into();
    let was = qp.drv.state();
    if let Err(e) = qp.drv.modify(QpAttrMask::from_bits_retain(mask), &a) {
        return crate::errno_of(&e);
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_AV != 0 {
        qp.ah_attr = attr.ah_attr;
    }
    if mask & abi::ibv_qp_attr_mask_IBV_QP_STATE != 0 {
        qp.qpx.qp_base.state = attr.qp_state;
        if attr.qp_state == abi::ibv_qp_state_IBV_QPS_ERR && was != QpState::Err {
            crate::events::last_wqe_reached(qp);
        }
    }
    0
}

/// `ibv_query_qp`.
pub(crate) fn query(
    qp: &mut RbQp,
    attr: &mut abi::ibv_qp_attr,
    init: &mut abi::ibv_qp_init_attr,
) -> i32 {
    let q = match qp.drv.query() {
        Ok(q) => q,
        Err(e) => return crate::errno_of(&e),
    };
    *attr = abi::ibv_qp_attr {
        qp_state: u32::from(q.state),
        cur_qp_state: u32::from(q.state),
        path_mtu: u32::from(q.path_mtu),
        rq_psn: q.rq_psn.get(),
        sq_psn: q.sq_psn.get(),
        dest_qp_num: q.dest_qpn.get(),
        qp_access_flags: q.access.get(),
        cap: qp.cap,
        ah_attr: qp.ah_attr,
        pkey_index: q.pkey_index.get(),
        sq_draining: q.sq_draining,
        max_rd_atomic: q.max_rd_atomic,
        max_dest_rd_atomic: q.max_dest_rd_atomic,
        min_rnr_timer: q.min_rnr_timer,
        port_num: 1,
        timeout: q.timeout,
        retry_cnt: q.retry_cnt,
        rnr_retry: q.rnr_retry,
        qkey: q.qkey.get(),
        ..Default::default()
    };
    *init = abi::ibv_qp_init_attr {
        qp_context: qp.qpx.qp_base.qp_context,
        send_cq: qp.send_cq as *mut abi::ibv_cq,
        recv_cq: qp.recv_cq as *mut abi::ibv_cq,
        srq: qp.srq as *mut abi::ibv_srq,
        cap: qp.cap,
        qp_type: qp.qpx.qp_base.qp_type,
        sq_sig_all: i32::from(qp.sq_sig_all),
    };
    qp.qpx.qp_base.state = attr.qp_state;
    0
}

pub(crate) fn flags_of(send_flags: u32, sig_all: bool) -> SendFlags {
    let mut f = SendFlags::empty();
    if sig_all || send_flags & abi::ibv_send_flags_IBV_SEND_SIGNALED != 0 {
        f |= SendFlags::SIGNALED;
    }
    if send_flags & abi::ibv_send_flags_IBV_SEND_FENCE != 0 {
        f |= SendFlags::FENCE;
    }
    if send_flags & abi::ibv_send_flags_IBV_SEND_SOLICITED != 0 {
        f |= SendFlags::SOLICITED;
    }
    f
}

/// The operation of a classic send work request.
///
/// # Safety
/// `wr` must be a valid `struct ibv_send_wr`.
unsafe fn op_of(st: &State, wr: &abi::ibv_send_wr) -> Result<WrOp, i32> {
    // SAFETY: the union members read are the ones the opcode selects; every bit pattern of
    // these plain integers is valid.
    let (rdma, atomic, imm) = unsafe { (wr.wr.rdma, wr.wr.atomic, wr.__bindgen_anon_1.imm_data) };
    let ra = RemoteAddr {
        addr: rdma.remote_addr,
        rkey: rdma.rkey,
    };
    Ok(match wr.opcode {
        abi::ibv_wr_opcode_IBV_WR_SEND => WrOp::Send,
        abi::ibv_wr_opcode_IBV_WR_SEND_WITH_IMM => WrOp::SendImm(u32::from_be(imm)),
        abi::ibv_wr_opcode_IBV_WR_RDMA_WRITE => WrOp::Write(ra),
        abi::ibv_wr_opcode_IBV_WR_RDMA_WRITE_WITH_IMM => WrOp::WriteImm(ra, u32::from_be(imm)),
        abi::ibv_wr_opcode_IBV_WR_RDMA_READ => WrOp::Read(ra),
        abi::ibv_wr_opcode_IBV_WR_ATOMIC_CMP_AND_SWP => WrOp::CmpSwap {
            remote: RemoteAddr {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            },
            compare: atomic.compare_add,
            swap: atomic.swap,
        },
        abi::ibv_wr_opcode_IBV_WR_ATOMIC_FETCH_AND_ADD => WrOp::FetchAdd {
            remote: RemoteAddr {
                addr: atomic.remote_addr,
                rkey: atomic.rkey,
            },
            add: atomic.compare_add,
        },
        // The key to invalidate, in host order (the union's `invalidate_rkey`).
        abi::ibv_wr_opcode_IBV_WR_SEND_WITH_INV => WrOp::SendInv(imm),
        abi::ibv_wr_opcode_IBV_WR_LOCAL_INV => WrOp::LocalInv(imm),
        abi::ibv_wr_opcode_IBV_WR_BIND_MW => {
            // SAFETY: the member the opcode selects; plain values and pointers.
            let b = unsafe { wr.__bindgen_anon_2.bind_mw };
            crate::mw::bind_op(st, b.mw, b.rkey, &b.bind_info)?
        }
        _ => return Err(libc::EINVAL),
    })
}

fn allows_inline(op: &WrOp) -> bool {
    matches!(
        op,
        WrOp::Send | WrOp::SendImm(_) | WrOp::Write(_) | WrOp::WriteImm(..)
    )
}

/// A C list of work requests (linked through `next`).
pub(crate) trait WrList {
    /// The next request.
    fn next(&self) -> *mut Self;
}

impl WrList for abi::ibv_send_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}
impl WrList for abi::ibv_recv_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}
impl WrList for abi::ibv_ops_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

/// Posts each request of the list `wr` in turn with `post`; on a refusal `*bad` names the
/// refused request (the ones before it stay posted) and its errno is returned.
///
/// # Safety
/// `wr` must be a valid list (as libibverbs requires); `bad` null or writable.
pub(crate) unsafe fn post_list<W: WrList>(
    mut wr: *mut W,
    bad: *mut *mut W,
    mut post: impl FnMut(&mut W) -> i32,
) -> i32 {
    while !wr.is_null() {
        // SAFETY: the caller's list, one element at a time.
        let w = unsafe { &mut *wr };
        let r = post(w);
        if r != 0 {
            if !bad.is_null() {
                // SAFETY: `bad` is the caller's out-pointer, checked non-null.
                unsafe { *bad = wr };
            }
            return r;
        }
        wr = w.next();
    }
    0
}

/// `ibv_post_send`.
///
/// # Safety
/// `wr` must be a valid list of `struct ibv_send_wr` (as libibverbs requires), and the
/// addresses of inline requests readable memory of the stated length.
pub(crate) unsafe fn post_send(
    st: &State,
    qp: &mut RbQp,
    wr: *mut abi::ibv_send_wr,
    bad: *mut *mut abi::ibv_send_wr,
) -> i32 {
    let mut sges = [Sge::default(); MAX_SGE];
    // An RSS QP has no send queue.
    if !qp.ind_table.is_null() {
        return refuse_first(wr, bad);
    }
    // SAFETY: the caller's list; each request is valid, as libibverbs requires.
    unsafe { post_list(wr, bad, |w| post_one_send(st, qp, w, &mut sges)) }
}

/// The address handle a UD request names: a live ringbell AH (its PD is checked against
/// the QP's when the request is posted), else EINVAL.
fn ah_of(st: &State, ah: usize) -> Result<&ringbell::AddressHandle, i32> {
    if st.owner(ah) != Owner::Ours(Kind::Ah) {
        return Err(libc::EINVAL);
    }
    // SAFETY: the registry says `ah` is a live AH, allocated as an `RbAh`; the reference
    // lives no longer than the borrow of the state, which is behind the lock (an AH is
    // destroyed only through the state).
    Ok(unsafe { &(*(ah as *const RbAh)).drv })
}

/// The destination of a UD send: UD QPs send only SEND and SEND with immediate, and
/// every request needs a live address handle.
fn ud_dest<'a>(
    st: &'a State,
    op: &WrOp,
    ah: usize,
    qpn: u32,
    qkey: u32,
) -> Result<UdDest<'a>, i32> {
    if !matches!(op, WrOp::Send | WrOp::SendImm(_)) {
        return Err(libc::EINVAL);
    }
    Ok(UdDest {
        ah: ah_of(st, ah)?,
        qpn,
        qkey,
    })
}

/// # Safety
/// As [`post_send`], for one request.
unsafe fn post_one_send(
    st: &State,
    qp: &mut RbQp,
    w: &abi::ibv_send_wr,
    sges: &mut [Sge; MAX_SGE],
) -> i32 {
    // SAFETY: the caller's request.
    let op = match unsafe { op_of(st, w) } {
        Ok(op) => op,
        Err(e) => return e,
    };
    let ud = if qp.ud {
        // SAFETY: the `ud` member is the one a request on a UD QP uses; plain values.
        let u = unsafe { w.wr.ud };
        match ud_dest(st, &op, u.ah as usize, u.remote_qpn, u.remote_qkey) {
            Ok(d) => Some(d),
            Err(e) => return e,
        }
    } else {
        None
    };
    let xrc_srqn = match qp.xrc {
        // SAFETY: the `xrc` member of the `qp_type` union is the one a request on an XRC
        // initiator uses; a plain value.
        Some(QpType::XrcIni) => unsafe { w.qp_type.xrc.remote_srqn },
        _ => 0,
    };
    let known = abi::ibv_send_flags_IBV_SEND_FENCE
        | abi::ibv_send_flags_IBV_SEND_SIGNALED
        | abi::ibv_send_flags_IBV_SEND_SOLICITED
        | abi::ibv_send_flags_IBV_SEND_INLINE;
    if w.send_flags & !known != 0 {
        return libc::EINVAL;
    }
    let n = w.num_sge;
    if n < 0 || n as u32 > qp.cap.max_send_sge || (n > 0 && w.sg_list.is_null()) {
        return libc::ENOMEM;
    }
    let n = n as usize;
    let list: &[abi::ibv_sge] = if n == 0 {
        &[]
    } else {
        // SAFETY: the caller's gather list of `n` entries (checked non-null when n > 0).
        unsafe { std::slice::from_raw_parts(w.sg_list, n) }
    };
    let flags = flags_of(w.send_flags, qp.sq_sig_all);
    let inline = w.send_flags & abi::ibv_send_flags_IBV_SEND_INLINE != 0 && allows_inline(&op);
    if inline {
        let total: u64 = list.iter().map(|s| u64::from(s.length)).sum();
        if total > u64::from(qp.cap.max_inline_data) {
            return libc::ENOMEM;
        }
        let mut buf = std::mem::take(&mut qp.inline_buf);
        buf.clear();
        for s in list {
            if s.length == 0 {
                continue;
            }
            // SAFETY: an inline request names process memory by address (no key); the
            // program promises it is readable for `length` bytes, as libibverbs requires.
            let src = unsafe {
                std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
            };
            buf.extend_from_slice(src);
        }
        let r = qp.drv.post_send(&[SendWr {
            wr_id: w.wr_id,
            op,
            sgl: &[],
            inline: Some(&buf),
            flags,
            ud,
            xrc_srqn,
        }]);
        qp.inline_buf = buf;
        return post_result(r);
    }
    for (d, s) in sges.iter_mut().zip(list) {
        *d = Sge {
            addr: s.addr,
            len: s.length,
            lkey: s.lkey,
        };
    }
    let wr = SendWr {
        wr_id: w.wr_id,
        op,
        sgl: &sges[..n],
        inline: None,
        flags,
        ud,
        xrc_srqn,
    };
    post_result(qp.drv.post_send(&[wr]))
}

/// `ibv_post_recv`.
///
/// # Safety
/// `wr` must be a valid list of `struct ibv_recv_wr`.
pub(crate) unsafe fn post_recv(
    qp: &mut RbQp,
    wr: *mut abi::ibv_recv_wr,
    bad: *mut *mut abi::ibv_recv_wr,
) -> i32 {
    // An RSS QP receives through its table's WQs.
    if !qp.ind_table.is_null() {
        return refuse_first(wr, bad);
    }
    let mut sges = [Sge::default(); MAX_SGE];
    let max_sge = qp.cap.max_recv_sge;
    let on_srq = !qp.srq.is_null();
    // SAFETY: the caller's list; each request is valid, as libibverbs requires.
    unsafe {
        post_list(wr, bad, |w| {
            if on_srq {
                return libc::EINVAL;
            }
            recv_sges(w, max_sge, &mut sges).map_or_else(
                |e| e,
                |n| {
                    post_result(qp.drv.post_recv(&[RecvWr {
                        wr_id: w.wr_id,
                        sgl: &sges[..n],
                    }]))
                },
            )
        })
    }
}

/// Refuses a whole list with EINVAL, naming its first request as the bad one.
fn refuse_first<W>(wr: *mut W, bad: *mut *mut W) -> i32 {
    if !bad.is_null() {
        // SAFETY: `bad` is the caller's out-pointer, checked non-null.
        unsafe { *bad = wr };
    }
    libc::EINVAL
}

/// The errno of a driver post (0 when it went through).
pub(crate) fn post_result(r: Result<(), ringbell::Error>) -> i32 {
    r.map_or_else(|e| crate::errno_of(&e), |_| 0)
}

/// Copies a receive request's scatter list into `out`; its length.
///
/// # Safety
/// `w` must be a valid receive request.
pub(crate) unsafe fn recv_sges(
    w: &abi::ibv_recv_wr,
    max: u32,
    out: &mut [Sge; MAX_SGE],
) -> Result<usize, i32> {
    let n = w.num_sge;
    if n < 0 || n as u32 > max || (n > 0 && w.sg_list.is_null()) {
        return Err(libc::EINVAL);
    }
    if n == 0 {
        return Ok(0);
    }
    // SAFETY: the caller's list of `n` entries, checked non-null.
    let list = unsafe { std::slice::from_raw_parts(w.sg_list, n as usize) };
    for (d, s) in out.iter_mut().zip(list) {
        *d = Sge {
            addr: s.addr,
            len: s.length,
            lkey: s.lkey,
        };
    }
    Ok(n as usize)
}

// ---- the ibv_wr_* builder ----

impl RbQp {
    /// `ibv_wr_start`.
    pub fn wr_start(&mut self) {
        let mut v = self.building.take().unwrap_or_default();
        v.clear();
        self.building = Some(v);
        self.build_err = 0;
    }

    /// Starts a request of the builder with the QP's current `wr_id` and `wr_flags`.
    pub fn wr_op(&mut self, op: WrOp, needs: u64) {
        if self.send_ops_flags & needs == 0 {
            self.build_err = self.build_err.max(libc::EINVAL);
        }
        let (wr_id, flags) = (self.qpx.wr_id, self.qpx.wr_flags);
        match &mut self.building {
            Some(v) => v.push(Pending {
                wr_id,
                flags,
                op,
                sgl: Vec::new(),
                inline: None,
                ud: None,
                xrc_srqn: 0,
            }),
            None => self.build_err = libc::EINVAL,
        }
    }

    fn last(&mut self) -> Option<&mut Pending> {
        self.building.as_mut().and_then(|v| v.last_mut())
    }

    /// `ibv_wr_set_sge(_list)`.
    pub fn wr_set_sges(&mut self, sges: &[abi::ibv_sge]) {
        let max = self.cap.max_send_sge as usize;
        match self.last() {
            Some(p) if sges.len() <= max => {
                p.sgl.clear();
                p.inline = None;
                p.sgl.extend(sges.iter().map(|s| Sge {
                    addr: s.addr,
                    len: s.length,
                    lkey: s.lkey,
                }));
            }
            _ => self.build_err = libc::EINVAL,
        }
    }

    /// `ibv_wr_set_inline_data(_list)`: the bytes are copied now.
    pub fn wr_set_inline(&mut self, parts: &[&[u8]]) {
        let max = self.cap.max_inline_data as usize;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        match self.last() {
            Some(p) if total <= max && allows_inline(&p.op) => {
                p.sgl.clear();
                p.inline = Some(parts.concat());
            }
            _ => self.build_err = libc::EINVAL,
        }
    }

    /// `ibv_wr_atomic_write`: an ATOMIC WRITE of these 8 bytes (copied now).
    pub fn wr_atomic_write(&mut self, remote: RemoteAddr, bytes: [u8; 8]) {
        self.wr_op(
            WrOp::AtomicWrite(remote),
            abi::ibv_qp_create_send_ops_flags_IBV_QP_EX_WITH_ATOMIC_WRITE as u64,
        );
        if let Some(p) = self.last() {
            p.inline = Some(bytes.to_vec());
        }
    }

    /// `ibv_wr_set_xrc_srqn`: the SRQ at the target of the request being built (XRC
    /// initiators; EOPNOTSUPP at `ibv_wr_complete` on other QPs).
    pub fn wr_set_xrc_srqn(&mut self, srqn: u32) {
        if self.xrc != Some(QpType::XrcIni) {
            self.build_err = self.build_err.max(libc::EOPNOTSUPP);
            return;
        }
        match self.last() {
            Some(p) => p.xrc_srqn = srqn,
            None => self.build_err = libc::EINVAL,
        }
    }

    /// `ibv_wr_set_ud_addr`: the destination of the request being built (UD QPs).
    pub fn wr_set_ud_addr(&mut self, ah: usize, qpn: u32, qkey: u32) {
        if !self.ud {
            self.build_err = self.build_err.max(libc::EOPNOTSUPP);
            return;
        }
        match self.last() {
            Some(p) => p.ud = Some((ah, qpn, qkey)),
            None => self.build_err = libc::EINVAL,
        }
    }

    /// `ibv_wr_complete`: posts what was built (nothing when a builder call failed).
    pub fn wr_complete(&mut self, st: &State) -> i32 {
        let Some(v) = self.building.take() else {
            return libc::EINVAL;
        };
        let mut r = self.build_err;
        if r == 0 {
            for p in &v {
                let flags = flags_of(p.flags, self.sq_sig_all);
                let ud = match (self.ud, p.ud) {
                    (false, _) => None,
                    (true, Some((ah, qpn, qkey))) => match ud_dest(st, &p.op, ah, qpn, qkey) {
                        Ok(d) => Some(d),
                        Err(e) => {
                            r = e;
                            break;
                        }
                    },
                    // No destination: the driver refuses the request.
                    (true, None) => None,
                };
                let wr = SendWr {
                    wr_id: p.wr_id,
                    op: p.op,
                    sgl: &p.sgl,
                    inline: p.inline.as_deref(),
                    flags,
                    ud,
                    xrc_srqn: p.xrc_srqn,
                };
                if let Err(e) = self.drv.post_send(&[wr]) {
                    r = crate::errno_of(&e);
                    break;
                }
            }
        }
        self.build_err = 0;
        r
    }

    /// `ibv_wr_abort`.
    pub fn wr_abort(&mut self) {
        self.building = None;
        self.build_err = 0;
    }
}
