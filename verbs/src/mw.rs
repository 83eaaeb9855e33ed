//! Memory windows: `ibv_alloc_mw`, `ibv_dealloc_mw` and `ibv_bind_mw`, and the requests of
//! `ibv_post_send` and the `ibv_wr_*` builder that bind and invalidate them
//! (`IBV_WR_BIND_MW`, `IBV_WR_LOCAL_INV`, `IBV_WR_SEND_WITH_INV`), over the driver's
//! [`MemoryWindow`] (ABI 1.9). As with mlx5, the library checks the arguments and the
//! device checks the binding (a region without `IBV_ACCESS_MW_BIND`, of another PD, a range
//! beyond it): those complete with `IBV_WC_MW_BIND_ERR`.

use crate::abi;
use crate::pd::{RbMr, RbPd};
use crate::qp::RbQp;
use crate::state::{Kind, Owner, State};
use ringbell::{MemoryWindow, MwBind, MwType, SendWr, WrOp};
use std::os::raw::c_int;

/// A ringbell memory window.
#[repr(C)]
pub(crate) struct RbMw {
    pub mw: abi::ibv_mw,
    pub pd: *mut RbPd,
    pub drv: MemoryWindow,
}

/// Rights a window may be bound with: the remote ones, zero-based addressing, and local
/// write, which a window cannot give: it is dropped before the device sees the bind, as
/// ConnectX ignores it (rdma-core's tests bind windows with it).
const BIND_ACCESS: u32 = abi::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_READ
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC
    | abi::ibv_access_flags_IBV_ACCESS_ZERO_BASED;

/// `ibv_alloc_mw`: EOPNOTSUPP on a device without windows, EINVAL for a type that is
/// neither 1 nor 2.
pub(crate) fn alloc(st: &mut State, pd: &mut RbPd, kind: u32) -> Result<*mut abi::ibv_mw, i32> {
    // SAFETY: a PD's context outlives it (closing a context with PDs is refused).
    if unsafe { (*pd.ctx).dev.caps().max_mw } == 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let t = match kind {
        abi::ibv_mw_type_IBV_MW_TYPE_1 => MwType::Type1,
        abi::ibv_mw_type_IBV_MW_TYPE_2 => MwType::Type2,
        _ => return Err(libc::EINVAL),
    };
    let drv = pd.drv.alloc_mw(t).map_err(|e| crate::errno_of(&e))?;
    let p = Box::into_raw(Box::new(RbMw {
        mw: abi::ibv_mw {
            context: pd.pd.context,
            pd: &mut pd.pd,
            rkey: drv.key(),
            handle: drv.key(),
            type_: kind,
        },
        pd,
        drv,
    }));
    pd.children += 1;
    st.add(p as usize, Kind::Mw);
    Ok(p as *mut abi::ibv_mw)
}

/// `ibv_dealloc_mw`: a bound window is unbound (its region is free again).
pub(crate) fn dealloc(st: &mut State, mw: &mut RbMw) -> i32 {
    st.remove(mw as *mut RbMw as usize);
    // SAFETY: a window's PD outlives it (deallocating a PD with windows is refused).
    unsafe { (*mw.pd).children -= 1 };
    // SAFETY: `mw` is the `RbMw` `alloc` boxed, now out of the registry; dropping it
    // deallocates the device's window.
    drop(unsafe { Box::from_raw(mw as *mut RbMw) });
    0
}

/// The driver request binding window `mw` under `new_key` to what `info` names: EINVAL
/// for a window or region that is not a live ringbell one, a region missing while an
/// address or length is given, or rights a window cannot have.
pub(crate) fn bind_op(
    st: &State,
    mw: *mut abi::ibv_mw,
    new_key: u32,
    info: &abi::ibv_mw_bind_info,
) -> Result<WrOp, i32> {
    if st.owner(mw as usize) != Owner::Ours(Kind::Mw) {
        return Err(libc::EINVAL);
    }
    // SAFETY: the registry says `mw` is a live window (an `RbMw`); the lock is held.
    let key = unsafe { (*mw).rkey };
    if info.mw_access_flags & !BIND_ACCESS != 0 {
        return Err(libc::EINVAL);
    }
    let mr_key = if info.mr.is_null() {
        if info.addr != 0 || info.length != 0 {
            return Err(libc::EINVAL);
        }
        0
    } else {
        if st.owner(info.mr as usize) != Owner::Ours(Kind::Mr) {
            return Err(libc::EINVAL);
        }
        // SAFETY: the registry says it is a live MR, allocated as an `RbMr`.
        unsafe { (*(info.mr as *const RbMr)).drv.borrow().lkey() }
    };
    Ok(WrOp::BindMw(MwBind {
        mw_key: key,
        new_key,
        mr_key,
        addr: info.addr,
        len: info.length,
        access: info.mw_access_flags & !(abi::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE),
    }))
}

/// `ibv_bind_mw` (type 1 windows; libibverbs' inline checked the type and the region's
/// PD): posts the bind with the window's next key, which the window takes once posted.
/// Zero-based binding is EINVAL here, as mlx5 has it.
pub(crate) fn bind(st: &State, qp: &mut RbQp, mw: &mut RbMw, b: &abi::ibv_mw_bind) -> c_int {
    let info = &b.bind_info;
    if mw.mw.type_ != abi::ibv_mw_type_IBV_MW_TYPE_1
        || info.mw_access_flags & abi::ibv_access_flags_IBV_ACCESS_ZERO_BASED != 0
    {
        return libc::EINVAL;
    }
    let known = abi::ibv_send_flags_IBV_SEND_SIGNALED | abi::ibv_send_flags_IBV_SEND_FENCE;
    if b.send_flags & !known != 0 {
        return libc::EINVAL;
    }
    let new_key = ringbell::inc_rkey(mw.mw.rkey);
    let op = match bind_op(st, &mut mw.mw, new_key, info) {
        Ok(op) => op,
        Err(e) => return e,
    };
    let flags = crate::qp::flags_of(b.send_flags, qp.sq_sig_all);
    let wr = SendWr::new(b.wr_id, op, &[]).flags(flags);
    let r = crate::qp::post_result(qp.drv.post_send(&[wr]));
    if r == 0 {
        mw.mw.rkey = new_key;
    }
    r
}
