//! Completion queues (classic and extended) and completion channels.

use crate::abi;
use crate::device::RbContext;
use crate::state::{Kind, State};
use ringbell::{CompletionQueue, WorkCompletion};
use std::collections::VecDeque;

/// A ringbell CQ. The extended CQ's layout is used for every CQ: `struct ibv_cq` is its
/// prefix, so `ibv_cq_ex_to_cq` is a cast, as in libibverbs.
#[repr(C)]
pub(crate) struct RbCq {
    pub cq: abi::ibv_cq_ex,
    pub ctx: *mut RbContext,
    pub drv: CompletionQueue,
    pub channel: *mut RbChannel,
    /// QPs and SRQs that report here (destroying with any: EBUSY).
    pub users: u32,
    /// The parent domain it was made with (`IBV_CQ_INIT_ATTR_MASK_PD`), or NULL.
    pub pd: *mut crate::pd::RbPd,
    /// Extended polling: the entry `start_poll`/`next_poll` made current.
    pub cur: WorkCompletion,
    /// Its context's [`RbContext::wall_offset_ns`].
    pub wall_offset_ns: u64,
}

/// A ringbell completion channel.
#[repr(C)]
pub(crate) struct RbChannel {
    pub ch: abi::ibv_comp_channel,
    pub ctx: *mut RbContext,
    /// CQs with an event waiting, oldest first.
    pub queue: VecDeque<*mut RbCq>,
}

/// `ibv_create_comp_channel`.
pub(crate) fn create_channel(
    st: &mut State,
    c: &mut RbContext,
) -> Result<*mut abi::ibv_comp_channel, i32> {
    let fd = crate::events::new_eventfd()?;
    let p = Box::into_raw(Box::new(RbChannel {
        ch: abi::ibv_comp_channel {
            context: c.ibv(),
            fd,
            refcnt: 0,
        },
        ctx: c,
        queue: VecDeque::new(),
    }));
    st.add(p as usize, Kind::Channel);
    Ok(p as *mut abi::ibv_comp_channel)
}

/// `ibv_destroy_comp_channel`.
pub(crate) fn destroy_channel(st: &mut State, ch: &mut RbChannel) -> i32 {
    if ch.ch.refcnt != 0 {
        return libc::EBUSY;
    }
    st.remove(ch as *mut RbChannel as usize);
    // SAFETY: the eventfd `create_channel` made, owned by the channel.
    unsafe { libc::close(ch.ch.fd) };
    // SAFETY: the `RbChannel` `create_channel` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(ch as *mut RbChannel) });
    0
}

/// `ibv_create_cq` / `ibv_create_cq_ex`.
pub(crate) fn create(
    st: &mut State,
    c: &mut RbContext,
    cqe: i32,
    channel: *mut RbChannel,
    cq_context: *mut libc::c_void,
    pd: *mut crate::pd::RbPd,
) -> Result<*mut RbCq, i32> {
    if cqe <= 0 || cqe as u32 > c.dev.caps().max_cqe {
        return Err(libc::EINVAL);
    }
    if !channel.is_null() {
        // SAFETY: the caller checked `channel` is a live ringbell channel.
        let ch = unsafe { &*channel };
        if !std::ptr::eq(ch.ctx, c) {
            return Err(libc::EINVAL);
        }
    }
    // SAFETY: NULL or a live parent domain the caller checked, under the lock.
    let drv_pd = unsafe { pd.as_ref() }.map(|p| &p.drv);
    let drv = c
        .dev
        .create_cq_in(cqe as u32, drv_pd)
        .map_err(|e| crate::errno_of(&e))?;
    let mut cq = abi::ibv_cq_ex {
        context: c.ibv(),
        channel: channel as *mut abi::ibv_comp_channel,
        cq_context,
        handle: drv.cqn(),
        cqe: drv.capacity().min(i32::MAX as u32) as i32,
        comp_mask: 0,
        ..Default::default()
    };
    crate::ops::fill_cq_ex(&mut cq);
    let cqn = drv.cqn();
    let p = Box::into_raw(Box::new(RbCq {
        cq,
        ctx: c,
        drv,
        channel,
        users: 0,
        pd,
        cur: WorkCompletion::default(),
        wall_offset_ns: c.wall_offset_ns,
    }));
    if !pd.is_null() {
        // SAFETY: as above.
        unsafe { (*pd).children += 1 };
    }
    // SAFETY: `p` was just allocated; the mutex and condition variable are initialised in
    // place, where they stay.
    unsafe {
        libc::pthread_mutex_init(&mut (*p).cq.mutex as *mut _ as *mut _, std::ptr::null());
        libc::pthread_cond_init(&mut (*p).cq.cond as *mut _ as *mut _, std::ptr::null());
    }
    if !channel.is_null() {
        // SAFETY: checked live above.
        unsafe { (*channel).ch.refcnt += 1 };
    }
    st.add(p as usize, Kind::Cq);
    st.cqs.insert((c.nic, cqn), p as usize);
    Ok(p)
}

/// `ibv_destroy_cq`.
pub(crate) fn destroy(st: &mut State, cq: &mut RbCq) -> i32 {
    if cq.users != 0 {
        return libc::EBUSY;
    }
    let p = cq as *mut RbCq;
    st.remove(p as usize);
    // SAFETY: a CQ's context outlives it.
    let nic = unsafe { (*cq.ctx).nic };
    st.cqs.remove(&(nic, cq.drv.cqn()));
    if !cq.pd.is_null() {
        // SAFETY: a parent domain with CQs cannot be deallocated, so it is live.
        unsafe { (*cq.pd).children -= 1 };
    }
    if !cq.channel.is_null() {
        // SAFETY: a channel with CQs cannot be destroyed, so it is live.
        let ch = unsafe { &mut *cq.channel };
        ch.ch.refcnt -= 1;
        // Events still queued for this CQ go with it.
        let before = ch.queue.len();
        ch.queue.retain(|&q| q != p);
        for _ in ch.queue.len()..before {
            crate::events::eventfd_take(ch.ch.fd);
        }
    }
    // SAFETY: the `RbCq` `create` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(p) });
    0
}

/// `ibv_resize_cq` (RESIZE_CQ, ABI 1.7): the CQ moves to a ring of at least `cqe` entries
/// with the completions not yet polled, and `cq->cqe` says how many it now has. EINVAL for
/// `cqe` below 1 or above `max_cqe`, or below the number of completions waiting (as mlx5);
/// EOPNOTSUPP from a device without the command.
pub(crate) fn resize(cq: &mut RbCq, cqe: i32) -> i32 {
    if cqe <= 0 {
        return libc::EINVAL;
    }
    if let Err(e) = cq.drv.resize(cqe as u32) {
        return crate::errno_of(&e);
    }
    cq.cq.cqe = cq.drv.capacity().min(i32::MAX as u32) as i32;
    0
}

/// Converts a driver completion to libibverbs' `struct ibv_wc`.
pub(crate) fn to_ibv_wc(w: &WorkCompletion, out: &mut abi::ibv_wc) {
    *out = abi::ibv_wc {
        wr_id: w.wr_id,
        status: w.status as u32,
        opcode: w.opcode as u32,
        vendor_err: u32::from(w.vendor_syndrome),
        byte_len: w.byte_len,
        qp_num: w.qpn,
        wc_flags: wc_flags_of(w) as u32,
        // A datagram: the sending QP, and in `sl` the RoCE packet type (see `sl_of`).
        // RoCE has no LIDs or P_Key indices to report (0).
        src_qp: w.source.map_or(0, |s| s.qpn),
        sl: sl_of(w),
        ..Default::default()
    };
    if let Some(imm) = w.imm {
        out.__bindgen_anon_1.imm_data = imm.to_be();
    }
    if let Some(key) = w.invalidated {
        out.__bindgen_anon_1.invalidated_rkey = key;
    }
}

/// What a ConnectX-class NIC reports in a receive completion's `sl` on a RoCE port: not a
/// service level (RoCE has none) but the received frame's type, bit 3 for a UDP header
/// (RoCEv2) and bits 2..0 its L3 header (0 GRH, 1 IPv6, 2 IPv4). Datagram receivers read it
/// to know where the GRH area holds the destination address (UCX's `ud_verbs` drops packets
/// whose destination is not one of its GIDs). Every ringbell frame is RoCEv2 over IPv4; a
/// completion of a connected QP reports 0.
pub(crate) const ROCE_V2_IPV4_SL: u8 = 0x8 | 0x2;

/// The `sl` of a completion: [`ROCE_V2_IPV4_SL`] for a datagram's receive, else 0.
pub(crate) fn sl_of(w: &WorkCompletion) -> u8 {
    if w.source.is_some() {
        ROCE_V2_IPV4_SL
    } else {
        0
    }
}

/// The `ibv_wc_flags` of a completion.
pub(crate) fn wc_flags_of(w: &WorkCompletion) -> u64 {
    let mut f = 0;
    if w.imm.is_some() {
        f |= abi::ibv_wc_flags_IBV_WC_WITH_IMM;
    }
    if w.invalidated.is_some() {
        f |= abi::ibv_wc_flags_IBV_WC_WITH_INV;
    }
    if w.source.is_some() {
        // A datagram's receive buffer starts with the GRH area (RoCEv2 over IPv4: 20 zero
        // bytes, then the IPv4 header), which `ibv_init_ah_from_wc` reads.
        f |= abi::ibv_wc_flags_IBV_WC_GRH;
    }
    if w.tm_sync_req {
        f |= abi::ibv_wc_flags_IBV_WC_TM_SYNC_REQ;
    }
    if w.tm_match {
        f |= abi::ibv_wc_flags_IBV_WC_TM_MATCH;
    }
    if w.tm_data_valid {
        f |= abi::ibv_wc_flags_IBV_WC_TM_DATA_VALID;
    }
    u64::from(f)
}

/// `ibv_poll_cq`: up to `out.len()` completions. When the ring is empty the device is
/// given one step, and events it raised are routed.
pub(crate) fn poll(st: &mut State, cq: &mut RbCq, out: &mut [abi::ibv_wc]) -> i32 {
    let mut buf = [WorkCompletion::default(); 16];
    let mut n = 0;
    while n < out.len() {
        let want = (out.len() - n).min(buf.len());
        let got = if n == 0 {
            cq.drv.poll(&mut buf[..want])
        } else {
            cq.drv.poll_ready(&mut buf[..want])
        };
        for (w, o) in buf[..got].iter().zip(&mut out[n..]) {
            to_ibv_wc(w, o);
        }
        n += got;
        if got < want {
            break;
        }
    }
    if n == 0 {
        // SAFETY: a CQ's context outlives it.
        let nic = unsafe { (*cq.ctx).nic };
        crate::events::pump(st, nic);
    }
    n as i32
}
