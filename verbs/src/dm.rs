//! Device memory: `ibv_alloc_dm`, `ibv_free_dm`, `ibv_memcpy_to_dm`/`ibv_memcpy_from_dm` and
//! `ibv_reg_dm_mr` over the driver's [`DeviceMemory`] (ABI 1.8). The checks and errnos are
//! those of `ibv_alloc_dm(3)` as rdma-core's mlx5 provider gives them: an allocation larger
//! than `max_dm_size` or with a comp_mask is `EINVAL`, no room left `ENOMEM`; a copy outside
//! the allocation is `EFAULT`, one whose offset or length is not a multiple of 4 `EINVAL`;
//! freeing memory that regions still use is `EBUSY`; a registration without
//! `IBV_ACCESS_ZERO_BASED` is `EINVAL`.

use crate::abi;
use crate::device::RbContext;
use crate::pd::RbPd;
use crate::state::{Kind, Owner, State};
use ringbell::DeviceMemory;
use ringbell_specs::cmd::DM_MAX_LOG_ALIGN;
use std::os::raw::c_int;

/// A ringbell device-memory allocation.
#[repr(C)]
pub(crate) struct RbDm {
    pub dm: abi::ibv_dm,
    /// Shared with the allocations imported from it (`ibv_import_dm`): the device keeps
    /// the memory until the last of them is freed or unimported.
    pub drv: std::rc::Rc<DeviceMemory>,
}

/// `ibv_alloc_dm`.
pub(crate) fn alloc(
    st: &mut State,
    c: &mut RbContext,
    attr: &abi::ibv_alloc_dm_attr,
) -> Result<*mut abi::ibv_dm, i32> {
    let max = u64::from(c.dev.caps().max_dm_size);
    if max == 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let len = attr.length as u64;
    if attr.comp_mask != 0 || len == 0 || len > max || attr.log_align_req > DM_MAX_LOG_ALIGN {
        return Err(libc::EINVAL);
    }
    let drv = c
        .dev
        .alloc_dm(len, attr.log_align_req)
        .map_err(|e| crate::errno_of(&e))?;
    let p = Box::into_raw(Box::new(RbDm {
        dm: abi::ibv_dm {
            context: c.ibv(),
            memcpy_to_dm: Some(memcpy_to_dm),
            memcpy_from_dm: Some(memcpy_from_dm),
            comp_mask: 0,
            handle: drv.num(),
        },
        drv: std::rc::Rc::new(drv),
    }));
    st.add(p as usize, Kind::Dm);
    Ok(p as *mut abi::ibv_dm)
}

/// `ibv_import_dm`: another handle, in context `c`, on the allocation `handle` names among
/// the allocations of `c`'s NIC in this process. None there: EINVAL.
pub(crate) fn import(
    st: &mut State,
    c: &mut RbContext,
    handle: u32,
) -> Result<*mut abi::ibv_dm, i32> {
    let found = st.live_of(Kind::Dm).into_iter().find_map(|p| {
        // SAFETY: the registry lists live allocations, allocated as `RbDm`; the lock is held.
        let o = unsafe { &*(p as *const RbDm) };
        (o.drv.device().same_as(&c.dev) && o.dm.handle == handle).then(|| (o.dm, o.drv.clone()))
    });
    let (dm, drv) = found.ok_or(libc::EINVAL)?;
    let p = Box::into_raw(Box::new(RbDm {
        dm: abi::ibv_dm {
            context: c.ibv(),
            ..dm
        },
        drv,
    }));
    st.add(p as usize, Kind::Dm);
    Ok(p as *mut abi::ibv_dm)
}

/// `ibv_free_dm`.
pub(crate) fn free(st: &mut State, dm: &mut RbDm) -> i32 {
    if std::rc::Rc::strong_count(&dm.drv) == 1 && dm.drv.in_use() {
        return libc::EBUSY;
    }
    st.remove(dm as *mut RbDm as usize);
    // SAFETY: `dm` is the `RbDm` `alloc` boxed, now out of the registry; dropping it frees
    // the device's memory.
    drop(unsafe { Box::from_raw(dm as *mut RbDm) });
    0
}

/// Checks a copy of `len` bytes at `offset` of `dm` as the driver does (the range, then
/// the alignment, mlx5's order), with mlx5's errnos: EFAULT outside the allocation, EINVAL
/// unaligned; then a NULL host buffer is EINVAL.
fn check_copy(dm: &RbDm, offset: u64, len: usize, host_null: bool) -> Result<(), i32> {
    match dm.drv.window(offset, len) {
        Err(ringbell::Error::OutOfBounds { .. }) => Err(libc::EFAULT),
        Err(e) => Err(crate::errno_of(&e)),
        Ok(_) if host_null && len > 0 => Err(libc::EINVAL),
        Ok(_) => Ok(()),
    }
}

unsafe extern "C" fn memcpy_to_dm(
    dm: *mut abi::ibv_dm,
    offset: u64,
    host: *const libc::c_void,
    len: usize,
) -> c_int {
    crate::ops::with(dm as *mut RbDm, Kind::Dm, libc::EINVAL, |_, dm| {
        if let Err(e) = check_copy(dm, offset, len, host.is_null()) {
            return e;
        }
        let data = if len == 0 {
            &[][..]
        } else {
            // SAFETY: the caller's buffer of `len` bytes (non-null, checked), as
            // ibv_memcpy_to_dm(3) takes it.
            unsafe { std::slice::from_raw_parts(host as *const u8, len) }
        };
        match dm.drv.write(offset, data) {
            Ok(()) => 0,
            Err(e) => crate::errno_of(&e),
        }
    })
}

unsafe extern "C" fn memcpy_from_dm(
    host: *mut libc::c_void,
    dm: *mut abi::ibv_dm,
    offset: u64,
    len: usize,
) -> c_int {
    crate::ops::with(dm as *mut RbDm, Kind::Dm, libc::EINVAL, |_, dm| {
        if let Err(e) = check_copy(dm, offset, len, host.is_null()) {
            return e;
        }
        let out = if len == 0 {
            &mut [][..]
        } else {
            // SAFETY: the caller's buffer of `len` bytes (non-null, checked), as
            // ibv_memcpy_from_dm(3) takes it.
            unsafe { std::slice::from_raw_parts_mut(host as *mut u8, len) }
        };
        match dm.drv.read(offset, out) {
            Ok(()) => 0,
            Err(e) => crate::errno_of(&e),
        }
    })
}

/// `ibv_reg_dm_mr`: a zero-based region (`addr` NULL) over `len` bytes of `dm` from
/// `offset`.
pub(crate) fn reg_mr(
    st: &mut State,
    pd: &mut RbPd,
    dm: *mut abi::ibv_dm,
    offset: u64,
    len: usize,
    access: u32,
) -> Result<*mut abi::ibv_mr, i32> {
    if access & abi::ibv_access_flags_IBV_ACCESS_ZERO_BASED == 0 {
        return Err(libc::EINVAL);
    }
    let acc = crate::pd::mr_access(access & !abi::ibv_access_flags_IBV_ACCESS_ZERO_BASED)?;
    if st.owner(dm as usize) != Owner::Ours(Kind::Dm) {
        return Err(libc::EINVAL);
    }
    // SAFETY: a live ringbell DM (checked), under the lock.
    let rdm = unsafe { &*(dm as *const RbDm) };
    if !std::ptr::eq(rdm.dm.context, pd.pd.context) {
        return Err(libc::EINVAL);
    }
    let drv = pd
        .drv
        .reg_dm_mr(&rdm.drv, offset, len as u64, acc)
        .map_err(|e| crate::errno_of(&e))?;
    Ok(crate::pd::publish_mr(
        st,
        pd,
        drv,
        std::ptr::null_mut(),
        len,
    ))
}
