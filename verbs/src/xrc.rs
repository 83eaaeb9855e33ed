//! XRC (`ibv_open_xrcd(3)`): XRC domains, XRC SRQs (`IBV_SRQT_XRC`), and the XRC initiator
//! (`IBV_QPT_XRC_SEND`) and target (`IBV_QPT_XRC_RECV`) QPs, over the driver's
//! [`ringbell::Xrcd`].
//!
//! A domain opened with a file (`IBV_XRCD_INIT_ATTR_FD`) is shared by every open of the
//! same file on the NIC in this process, as the kernel shares one per inode: `O_CREAT`
//! makes it when none exists (without it, EINVAL), `O_CREAT | O_EXCL` refuses one that does
//! (EINVAL). `fd` -1 makes a domain of its own.

use crate::abi;
use crate::device::RbContext;
use crate::qp::RbQp;
use crate::state::{Kind, State};
use ringbell::{QpType, Xrcd};

/// A ringbell XRC domain handle.
#[repr(C)]
pub(crate) struct RbXrcd {
    pub xrcd: abi::ibv_xrcd,
    pub ctx: *mut RbContext,
    pub drv: Xrcd,
    /// The (device, inode) of the file it was opened with.
    pub inode: Option<(u64, u64)>,
    /// XRC SRQs and target QPs made with it (closing with any: EBUSY).
    pub users: u32,
}

/// `ibv_open_xrcd`.
pub(crate) fn open(
    st: &mut State,
    c: &mut RbContext,
    attr: &abi::ibv_xrcd_init_attr,
) -> Result<*mut abi::ibv_xrcd, i32> {
    let fd_bit = abi::ibv_xrcd_init_attr_mask_IBV_XRCD_INIT_ATTR_FD;
    let oflags_bit = abi::ibv_xrcd_init_attr_mask_IBV_XRCD_INIT_ATTR_OFLAGS;
    if attr.comp_mask >= abi::ibv_xrcd_init_attr_mask_IBV_XRCD_INIT_ATTR_RESERVED {
        return Err(libc::EOPNOTSUPP);
    }
    if attr.comp_mask & fd_bit == 0 || attr.comp_mask & oflags_bit == 0 {
        return Err(libc::EINVAL);
    }
    if attr.oflags & !(libc::O_CREAT | libc::O_EXCL) != 0 {
        return Err(libc::EINVAL);
    }
    let inode = match attr.fd {
        -1 => None,
        fd => Some(crate::device::inode_of(fd).ok_or(libc::EBADF)?),
    };
    let shared = inode.and_then(|ino| {
        st.live_of(Kind::Xrcd).into_iter().find_map(|p| {
            // SAFETY: the registry lists live domains, allocated as `RbXrcd`; the lock is
            // held.
            let x = unsafe { &*(p as *const RbXrcd) };
            // SAFETY: a domain's context outlives it.
            let nic = unsafe { (*x.ctx).nic };
            (nic == c.nic && x.inode == Some(ino)).then(|| x.drv.clone())
        })
    });
    let create = attr.oflags & libc::O_CREAT != 0;
    let drv = match shared {
        Some(_) if create && attr.oflags & libc::O_EXCL != 0 => return Err(libc::EINVAL),
        Some(d) => d,
        None if inode.is_some() && !create => return Err(libc::EINVAL),
        None => c.dev.alloc_xrcd().map_err(|e| crate::errno_of(&e))?,
    };
    let p = Box::into_raw(Box::new(RbXrcd {
        xrcd: abi::ibv_xrcd { context: c.ibv() },
        ctx: c,
        drv,
        inode,
        users: 0,
    }));
    st.add(p as usize, Kind::Xrcd);
    Ok(p as *mut abi::ibv_xrcd)
}

/// `ibv_close_xrcd`.
pub(crate) fn close(st: &mut State, x: &mut RbXrcd) -> i32 {
    if x.users != 0 {
        return libc::EBUSY;
    }
    st.remove(x as *mut RbXrcd as usize);
    // SAFETY: the `RbXrcd` `open` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(x as *mut RbXrcd) });
    0
}

/// `ibv_create_qp_ex` of an XRC target (`IBV_QPT_XRC_RECV`): a QP of the domain
/// `attr.xrcd` names, with no PD, CQ, SRQ or queues of its own.
pub(crate) fn create_target(
    st: &mut State,
    c: &mut RbContext,
    attr: &mut abi::ibv_qp_init_attr_ex,
) -> Result<*mut RbQp, i32> {
    let known = abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_XRCD
        | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD
        | abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_CREATE_FLAGS;
    if attr.comp_mask & !known != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if attr.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_XRCD == 0
        || st.owner(attr.xrcd as usize) != crate::state::Owner::Ours(Kind::Xrcd)
    {
        return Err(libc::EINVAL);
    }
    if attr.comp_mask & abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_CREATE_FLAGS != 0
        && attr.create_flags != 0
    {
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: checked live above; the lock is held.
    let x = unsafe { &mut *(attr.xrcd as *mut RbXrcd) };
    if !std::ptr::eq(x.ctx, c) {
        return Err(libc::EINVAL);
    }
    let drv = x.drv.create_target_qp().map_err(|e| crate::errno_of(&e))?;
    attr.cap = abi::ibv_qp_cap::default();
    let p = crate::qp::publish(st, c, None, drv, attr, QpType::XrcTgt)?;
    // SAFETY: `p` was just made.
    unsafe { (*p).xrcd = x };
    x.users += 1;
    Ok(p)
}
