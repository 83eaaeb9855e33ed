//! Protection domains and memory regions.

use crate::abi;
use crate::device::RbContext;
use crate::state::{Kind, State};
use ringbell::{Access, MemoryRegion, ProtectionDomain};

/// A ringbell PD.
#[repr(C)]
pub(crate) struct RbPd {
    pub pd: abi::ibv_pd,
    pub ctx: *mut RbContext,
    pub drv: ProtectionDomain,
    /// Live MRs, QPs, SRQs and AHs (deallocating with any: EBUSY).
    pub children: u32,
}

/// A ringbell MR.
#[repr(C)]
pub(crate) struct RbMr {
    pub mr: abi::ibv_mr,
    pub pd: *mut RbPd,
    pub drv: MemoryRegion,
}

/// Access bits that are hints a device may ignore (libibverbs' optional range).
const OPTIONAL_RANGE: u32 = ((1u32 << 30) - 1) & !(abi::IBV_ACCESS_OPTIONAL_FIRST - 1);
/// Access bits a ringbell MR understands.
const KNOWN: u32 = abi::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_READ
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC
    | abi::ibv_access_flags_IBV_ACCESS_MW_BIND
    | abi::ibv_access_flags_IBV_ACCESS_HUGETLB;

/// Checks MR access flags as the kernel does, returning the device's access set.
pub(crate) fn mr_access(access: u32) -> Result<Access, i32> {
    let access = access & !OPTIONAL_RANGE;
    if access & abi::ibv_access_flags_IBV_ACCESS_ON_DEMAND != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if access & !KNOWN != 0 {
        return Err(libc::EINVAL);
    }
    // Remote write or atomic access needs local write (IBTA o10-24).
    let needs_local = abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
        | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC;
    if access & needs_local != 0 && access & abi::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE == 0 {
        return Err(libc::EINVAL);
    }
    Ok(Access::from_bits_truncate(access & 0xf))
}

/// `ibv_alloc_pd`.
pub(crate) fn alloc(st: &mut State, c: &mut RbContext) -> Result<*mut abi::ibv_pd, i32> {
    let drv = c.dev.alloc_pd().map_err(|e| crate::errno_of(&e))?;
    let p = Box::into_raw(Box::new(RbPd {
        pd: abi::ibv_pd {
            context: c.ibv(),
            handle: drv.pdn(),
        },
        ctx: c,
        drv,
        children: 0,
    }));
    st.add(p as usize, Kind::Pd);
    Ok(p as *mut abi::ibv_pd)
}

/// `ibv_dealloc_pd`.
pub(crate) fn dealloc(st: &mut State, pd: &mut RbPd) -> i32 {
    if pd.children != 0 {
        return libc::EBUSY;
    }
    st.remove(pd as *mut RbPd as usize);
    // SAFETY: `pd` is the `RbPd` `alloc` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(pd as *mut RbPd) });
    0
}

/// `ibv_reg_mr_iova2`: registers `[addr, addr + len)` of this process's memory, addressed
/// by `iova` in work requests and by peers.
///
/// # Safety
/// `addr..addr + len` must be memory of this process that stays mapped while the MR lives
/// (the caller's promise to libibverbs too).
pub(crate) unsafe fn reg(
    st: &mut State,
    pd: &mut RbPd,
    addr: *mut u8,
    len: usize,
    iova: u64,
    access: u32,
) -> Result<*mut abi::ibv_mr, i32> {
    let acc = mr_access(access)?;
    if len == 0 || addr.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller's promise, passed on.
    let drv =
        unsafe { pd.drv.reg_user_mr(addr, len, iova, acc) }.map_err(|e| crate::errno_of(&e))?;
    let p = Box::into_raw(Box::new(RbMr {
        mr: abi::ibv_mr {
            context: pd.pd.context,
            pd: &mut pd.pd,
            addr: addr as *mut _,
            length: len,
            handle: drv.lkey(),
            lkey: drv.lkey(),
            rkey: drv.rkey(),
        },
        pd,
        drv,
    }));
    pd.children += 1;
    st.add(p as usize, Kind::Mr);
    Ok(p as *mut abi::ibv_mr)
}

/// `ibv_rereg_mr` on a ringbell MR: libibverbs' own checks of the arguments first
/// (`IBV_REREG_MR_ERR_INPUT`), then the kernel's and the device's (`IBV_REREG_MR_ERR_CMD`):
/// no change asked for, a PD that is not a live PD of the MR's context, bad access bits,
/// pages that cannot be registered; `errno` says which. On success the MR keeps its keys and
/// `mr` shows the new PD, address and length; on failure nothing changed.
///
/// # Safety
/// `pd` is NULL or a pointer the program got from libibverbs; with
/// `IBV_REREG_MR_CHANGE_TRANSLATION` the program owns `[addr, addr + len)`, as for
/// `ibv_reg_mr`.
pub(crate) unsafe fn rereg(
    st: &mut State,
    mr: &mut RbMr,
    flags: i32,
    pd: *mut abi::ibv_pd,
    addr: *mut u8,
    len: usize,
    access: i32,
) -> i32 {
    const ERR_INPUT: i32 = abi::ibv_rereg_mr_err_code_IBV_REREG_MR_ERR_INPUT;
    const ERR_CMD: i32 = abi::ibv_rereg_mr_err_code_IBV_REREG_MR_ERR_CMD;
    let fail = |code: i32, e: i32| {
        crate::set_errno(e);
        code
    };
    let translation = flags & abi::ibv_rereg_mr_flags_IBV_REREG_MR_CHANGE_TRANSLATION as i32 != 0;
    let change_pd = flags & abi::ibv_rereg_mr_flags_IBV_REREG_MR_CHANGE_PD as i32 != 0;
    let change_access = flags & abi::ibv_rereg_mr_flags_IBV_REREG_MR_CHANGE_ACCESS as i32 != 0;
    if flags & !(abi::ibv_rereg_mr_flags_IBV_REREG_MR_FLAGS_SUPPORTED as i32) != 0
        || (translation && (len == 0 || addr.is_null()))
        || (access != 0 && !change_access)
    {
        return fail(ERR_INPUT, libc::EINVAL);
    }
    if flags == 0 {
        return fail(ERR_CMD, libc::EINVAL);
    }
    let new_pd = if change_pd {
        // A live ringbell PD of the same context.
        if st.owner(pd as usize) != crate::state::Owner::Ours(Kind::Pd) {
            return fail(ERR_CMD, libc::EINVAL);
        }
        // SAFETY: the registry says `pd` is a live PD, allocated as an `RbPd`; the lock is
        // held.
        let p = unsafe { &mut *(pd as *mut RbPd) };
        if p.pd.context != mr.mr.context {
            return fail(ERR_CMD, libc::EINVAL);
        }
        Some(p)
    } else {
        None
    };
    let acc = if change_access {
        match mr_access(access as u32) {
            Ok(a) => Some(a),
            Err(e) => return fail(ERR_CMD, e),
        }
    } else {
        None
    };
    let range = translation.then_some((addr, len, addr as u64));
    let drv_pd = new_pd.as_ref().map(|p| &p.drv);
    // SAFETY: the caller's promise for the new range, passed on.
    if let Err(e) = unsafe { mr.drv.rereg_user(drv_pd, range, acc) } {
        return fail(ERR_CMD, crate::errno_of(&e));
    }
    if let Some(p) = new_pd {
        // SAFETY: an MR's PD outlives it (deallocating a PD with MRs is refused).
        unsafe { (*mr.pd).children -= 1 };
        p.children += 1;
        mr.pd = p;
        mr.mr.pd = &mut p.pd;
    }
    if translation {
        mr.mr.addr = addr as *mut _;
        mr.mr.length = len;
    }
    0
}

/// `ibv_dereg_mr`.
pub(crate) fn dereg(st: &mut State, mr: &mut RbMr) -> i32 {
    st.remove(mr as *mut RbMr as usize);
    // SAFETY: an MR's PD outlives it (deallocating a PD with MRs is refused).
    unsafe { (*mr.pd).children -= 1 };
    // SAFETY: `mr` is the `RbMr` `reg` boxed, now out of the registry; dropping it
    // deregisters the region, then releases its memory's mapping.
    drop(unsafe { Box::from_raw(mr as *mut RbMr) });
    0
}
