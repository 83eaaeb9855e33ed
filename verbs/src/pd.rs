//! Protection domains and memory regions.

use crate::abi;
use crate::device::RbContext;
use crate::state::{Kind, Owner, State};
use ringbell::{
    Access, Allocated, MemoryRegion, ProtectionDomain, QueueAlloc, QueueAllocator, QueueMem,
};
use std::cell::RefCell;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::rc::Rc;

/// A ringbell PD, or a parent domain (`ibv_alloc_parent_domain`), which is used wherever
/// a PD is and stands for the PD it was made from.
#[repr(C)]
pub(crate) struct RbPd {
    pub pd: abi::ibv_pd,
    pub ctx: *mut RbContext,
    /// The device PD; for a parent domain with allocators, a handle on it that takes queue
    /// memory from them.
    pub drv: ProtectionDomain,
    /// Live MRs, QPs, SRQs, AHs and CQs (deallocating with any: EBUSY); for a PD, also
    /// its parent domains.
    pub children: u32,
    /// A parent domain: the PD it was made from, and its thread domain.
    pub parent: Option<(*mut RbPd, *mut RbTd)>,
}

/// A thread domain (`ibv_alloc_td`): a promise that the objects made with it are used from
/// one thread at a time. The device needs nothing for it; it is kept and checked.
#[repr(C)]
pub(crate) struct RbTd {
    pub td: abi::ibv_td,
    pub ctx: *mut RbContext,
    /// Parent domains that use it (deallocating with any: EBUSY).
    pub users: u32,
}

/// `IBV_ALLOCATOR_USE_DEFAULT` (`(void *)-1`): an allocator's answer asking for the
/// provider's own memory.
const USE_DEFAULT: usize = usize::MAX;

/// The `resource_type` a parent domain's allocator is called with: the driver id (0,
/// `RDMA_DRIVER_UNKNOWN`: ringbell has none of rdma-core's) in the upper 32 bits and the
/// resource's code in the lower, numbered as mlx5 numbers them.
pub const RES_TYPE_QP: u64 = 1;
/// See [`RES_TYPE_QP`].
pub const RES_TYPE_DBR: u64 = 3;
/// See [`RES_TYPE_QP`].
pub const RES_TYPE_SRQ: u64 = 4;
/// See [`RES_TYPE_QP`].
pub const RES_TYPE_CQ: u64 = 5;

type AllocFn =
    unsafe extern "C" fn(*mut abi::ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut abi::ibv_pd, *mut c_void, *mut c_void, u64);

/// A parent domain's allocator callbacks, as the driver's [`QueueAllocator`].
struct CAlloc {
    pd: *mut abi::ibv_pd,
    ctx: *mut c_void,
    alloc: AllocFn,
    free: FreeFn,
}

fn res_type(kind: QueueMem) -> u64 {
    match kind {
        QueueMem::Qp => RES_TYPE_QP,
        QueueMem::Cq => RES_TYPE_CQ,
        QueueMem::Srq => RES_TYPE_SRQ,
        QueueMem::Doorbell => RES_TYPE_DBR,
    }
}

// SAFETY: ibv_alloc_parent_domain(3) makes the application's callback responsible for
// the memory it returns: a zeroed buffer of its own, of the size and alignment asked, not
// copied on write, kept until the provider frees it through the callback.
unsafe impl QueueAllocator for CAlloc {
    fn alloc(&self, size: usize, align: usize, kind: QueueMem) -> Allocated {
        // SAFETY: the application's callback with the arguments its man page gives it: the
        // parent domain, its context, the size, alignment and resource type.
        let p = unsafe { (self.alloc)(self.pd, self.ctx, size, align, res_type(kind)) };
        match p as usize {
            0 => Allocated::Failed,
            USE_DEFAULT => Allocated::UseDefault,
            _ => NonNull::new(p as *mut u8).map_or(Allocated::Failed, Allocated::At),
        }
    }
    fn free(&self, ptr: NonNull<u8>, kind: QueueMem) {
        // SAFETY: memory its `alloc` returned, given back once, as the callback expects.
        unsafe {
            (self.free)(
                self.pd,
                self.ctx,
                ptr.as_ptr() as *mut c_void,
                res_type(kind),
            )
        };
    }
}

/// `ibv_alloc_td`.
pub(crate) fn alloc_td(
    st: &mut State,
    c: &mut RbContext,
    attr: &abi::ibv_td_init_attr,
) -> Result<*mut abi::ibv_td, i32> {
    if attr.comp_mask != 0 {
        return Err(libc::EINVAL);
    }
    let p = Box::into_raw(Box::new(RbTd {
        td: abi::ibv_td { context: c.ibv() },
        ctx: c,
        users: 0,
    }));
    st.add(p as usize, Kind::Td);
    Ok(p as *mut abi::ibv_td)
}

/// `ibv_dealloc_td`.
pub(crate) fn dealloc_td(st: &mut State, td: &mut RbTd) -> i32 {
    if td.users != 0 {
        return libc::EBUSY;
    }
    st.remove(td as *mut RbTd as usize);
    // SAFETY: `td` is the `RbTd` `alloc_td` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(td as *mut RbTd) });
    0
}

/// `ibv_alloc_parent_domain`: `attr.pd` a PD (not a parent domain) of this context,
/// `attr.td` NULL or a thread domain of it, `comp_mask` of `ALLOCATORS` and `PD_CONTEXT`
/// only (otherwise EINVAL). With both callbacks set, the rings and doorbell records of the
/// QPs, SRQs and CQs made with the parent domain come from them.
pub(crate) fn alloc_parent(
    st: &mut State,
    c: &mut RbContext,
    attr: &abi::ibv_parent_domain_init_attr,
) -> Result<*mut abi::ibv_pd, i32> {
    let known = abi::ibv_parent_domain_init_attr_mask_IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS
        | abi::ibv_parent_domain_init_attr_mask_IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
    if attr.comp_mask & !known != 0 || st.owner(attr.pd as usize) != Owner::Ours(Kind::Pd) {
        return Err(libc::EINVAL);
    }
    // SAFETY: the registry says `pd` is a live PD, allocated as an `RbPd`; the lock is held.
    let pd = unsafe { &mut *(attr.pd as *mut RbPd) };
    if !std::ptr::eq(pd.ctx, c) || pd.parent.is_some() {
        return Err(libc::EINVAL);
    }
    let td = attr.td as *mut RbTd;
    if !td.is_null() {
        if st.owner(td as usize) != Owner::Ours(Kind::Td) {
            return Err(libc::EINVAL);
        }
        // SAFETY: a live thread domain (checked), under the lock.
        if !std::ptr::eq(unsafe { (*td).ctx }, c) {
            return Err(libc::EINVAL);
        }
    }
    let pd_context = if attr.comp_mask
        & abi::ibv_parent_domain_init_attr_mask_IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT
        != 0
    {
        attr.pd_context
    } else {
        std::ptr::null_mut()
    };
    let callbacks = match (attr.alloc, attr.free) {
        (Some(a), Some(f))
            if attr.comp_mask
                & abi::ibv_parent_domain_init_attr_mask_IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS
                != 0 =>
        {
            Some((a, f))
        }
        _ => None,
    };
    let p = Box::into_raw(Box::new(RbPd {
        pd: abi::ibv_pd {
            context: c.ibv(),
            handle: pd.pd.handle,
        },
        ctx: c,
        drv: pd.drv.clone(),
        children: 0,
        parent: Some((pd as *mut RbPd, td)),
    }));
    if let Some((alloc, free)) = callbacks {
        // SAFETY: `p` was just allocated and is not shared yet.
        let me = unsafe { &mut *p };
        me.drv = pd.drv.with_allocator(QueueAlloc(Rc::new(CAlloc {
            pd: &mut me.pd,
            ctx: pd_context,
            alloc,
            free,
        })));
    }
    pd.children += 1;
    if !td.is_null() {
        // SAFETY: checked live above.
        unsafe { (*td).users += 1 };
    }
    st.add(p as usize, Kind::Pd);
    Ok(p as *mut abi::ibv_pd)
}

/// A ringbell MR. Its region is shared with the MRs imported from it (`ibv_import_mr`):
/// the device keeps the region until the last of them is deregistered or unimported.
#[repr(C)]
pub(crate) struct RbMr {
    pub mr: abi::ibv_mr,
    pub pd: *mut RbPd,
    pub drv: Rc<RefCell<MemoryRegion>>,
}

/// Access bits that are hints a device may ignore (libibverbs' optional range).
pub(crate) const OPTIONAL_RANGE: u32 = ((1u32 << 30) - 1) & !(abi::IBV_ACCESS_OPTIONAL_FIRST - 1);
/// Access bits a ringbell MR understands.
const KNOWN: u32 = abi::ibv_access_flags_IBV_ACCESS_LOCAL_WRITE
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_READ
    | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC
    | abi::ibv_access_flags_IBV_ACCESS_MW_BIND
    | abi::ibv_access_flags_IBV_ACCESS_HUGETLB;

/// Checks MR access flags as the kernel does, returning the device's access set.
/// `IBV_ACCESS_ON_DEMAND` is the caller's to take out first (`reg`): here it is
/// EOPNOTSUPP (device memory, re-registration).
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
    Ok(Access::from_bits_truncate(access & 0x1f))
}

/// `ibv_alloc_pd`.
pub(crate) fn alloc(st: &mut State, c: &mut RbContext) -> Result<*mut abi::ibv_pd, i32> {
    let drv = c.dev.alloc_pd().map_err(|e| crate::errno_of(&e))?;
    Ok(publish_pd(st, c, drv))
}

/// Makes the `struct ibv_pd` of a handle on device PD `drv` in context `c` and records it.
fn publish_pd(st: &mut State, c: &mut RbContext, drv: ProtectionDomain) -> *mut abi::ibv_pd {
    let p = Box::into_raw(Box::new(RbPd {
        pd: abi::ibv_pd {
            context: c.ibv(),
            handle: drv.pdn(),
        },
        ctx: c,
        drv,
        children: 0,
        parent: None,
    }));
    st.add(p as usize, Kind::Pd);
    p as *mut abi::ibv_pd
}

/// `ibv_dealloc_pd` (of a PD or a parent domain).
pub(crate) fn dealloc(st: &mut State, pd: &mut RbPd) -> i32 {
    if pd.children != 0 {
        return libc::EBUSY;
    }
    if let Some((base, td)) = pd.parent {
        // SAFETY: a PD with parent domains cannot be deallocated, nor a thread domain
        // with users, so both are live.
        unsafe {
            (*base).children -= 1;
            if !td.is_null() {
                (*td).users -= 1;
            }
        }
    }
    st.remove(pd as *mut RbPd as usize);
    // SAFETY: `pd` is the `RbPd` `alloc` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(pd as *mut RbPd) });
    0
}

/// `ibv_import_pd`: another handle, in context `c`, on the PD `handle` names among the PDs
/// of `c`'s NIC in this process (parent domains are not PDs a handle names). The device's
/// PD stays while any handle on it does. No such PD: EINVAL.
pub(crate) fn import_pd(
    st: &mut State,
    c: &mut RbContext,
    handle: u32,
) -> Result<*mut abi::ibv_pd, i32> {
    let found = st.live_of(Kind::Pd).into_iter().find_map(|p| {
        // SAFETY: the registry lists live PDs, allocated as `RbPd`; the lock is held.
        let o = unsafe { &*(p as *const RbPd) };
        // SAFETY: a PD's context outlives it.
        let nic = unsafe { (*o.ctx).nic };
        (o.parent.is_none() && nic == c.nic && o.pd.handle == handle).then(|| o.drv.clone())
    });
    let drv = found.ok_or(libc::EINVAL)?;
    Ok(publish_pd(st, c, drv))
}

/// `ibv_unimport_pd`: drops this handle (the device's PD stays for the others, and for
/// none it goes). A handle objects were made with is kept: they need it.
pub(crate) fn unimport_pd(st: &mut State, pd: &mut RbPd) {
    if pd.parent.is_none() {
        let _ = dealloc(st, pd);
    }
}

/// `ibv_import_mr`: another handle, in `pd`, on the region whose handle (its lkey) is
/// `handle` among the regions of `pd`'s device PD. None there: EINVAL. The region stays
/// registered while any handle on it does.
pub(crate) fn import_mr(
    st: &mut State,
    pd: &mut RbPd,
    handle: u32,
) -> Result<*mut abi::ibv_mr, i32> {
    let pdn = pd.drv.pdn();
    // SAFETY: a PD's context outlives it.
    let nic = unsafe { (*pd.ctx).nic };
    let found = st.live_of(Kind::Mr).into_iter().find_map(|p| {
        // SAFETY: the registry lists live MRs, allocated as `RbMr`; the lock is held.
        let o = unsafe { &*(p as *const RbMr) };
        // SAFETY: an MR's PD, and the PD's context, outlive it.
        let (opd, onic) = unsafe { ((*o.pd).drv.pdn(), (*(*o.pd).ctx).nic) };
        (onic == nic && opd == pdn && o.mr.handle == handle).then(|| (o.mr, o.drv.clone()))
    });
    let (mr, drv) = found.ok_or(libc::EINVAL)?;
    let p = Box::into_raw(Box::new(RbMr {
        mr: abi::ibv_mr {
            context: pd.pd.context,
            pd: &mut pd.pd,
            ..mr
        },
        pd,
        drv,
    }));
    pd.children += 1;
    st.add(p as usize, Kind::Mr);
    Ok(p as *mut abi::ibv_mr)
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
    let on_demand = access & abi::ibv_access_flags_IBV_ACCESS_ON_DEMAND != 0;
    let acc = mr_access(access & !abi::ibv_access_flags_IBV_ACCESS_ON_DEMAND)?;
    // An implicit region on demand: the whole address space (ibv_reg_mr(3)).
    let implicit = on_demand && addr.is_null() && len == usize::MAX;
    if len == 0 || (addr.is_null() && !implicit) {
        return Err(libc::EINVAL);
    }
    let drv = if on_demand {
        // On-demand paging: nothing is moved; a device elsewhere cannot (EOPNOTSUPP).
        if !pd.drv.device().on_demand() {
            return Err(libc::EOPNOTSUPP);
        }
        if implicit {
            pd.drv
                .reg_odp_mr(0, ringbell::HOST_IOVA_OFFSET as usize, 0, acc)
        } else {
            pd.drv.reg_odp_mr(addr as usize, len, iova, acc)
        }
    } else {
        // SAFETY: the caller's promise, passed on.
        match unsafe { pd.drv.reg_user_mr(addr, len, iova, acc) } {
            // Memory whose pages cannot be moved onto a memory file (a shared mapping, huge
            // pages, code) but is mapped as the access needs: a NIC in this process reaches
            // it in place, as it reaches a region on demand.
            Err(ringbell::Error::BadAddress { .. })
                if pd.drv.device().on_demand()
                    && ringbell::is_mapped(
                        addr as usize,
                        len,
                        acc.contains(Access::LOCAL_WRITE),
                    ) =>
            {
                pd.drv.reg_odp_mr(addr as usize, len, iova, acc)
            }
            r => r,
        }
    }
    .map_err(|e| crate::errno_of(&e))?;
    Ok(publish_mr(st, pd, drv, addr as *mut _, len))
}

/// Makes the `struct ibv_mr` of a region the device registered (`addr` and `len` as the
/// program sees them), counts it as a child of its PD and records it.
pub(crate) fn publish_mr(
    st: &mut State,
    pd: &mut RbPd,
    drv: MemoryRegion,
    addr: *mut libc::c_void,
    len: usize,
) -> *mut abi::ibv_mr {
    let p = Box::into_raw(Box::new(RbMr {
        mr: abi::ibv_mr {
            context: pd.pd.context,
            pd: &mut pd.pd,
            addr,
            length: len,
            handle: drv.lkey(),
            lkey: drv.lkey(),
            rkey: drv.rkey(),
        },
        pd,
        drv: Rc::new(RefCell::new(drv)),
    }));
    pd.children += 1;
    st.add(p as usize, Kind::Mr);
    p as *mut abi::ibv_mr
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
    // A region on demand or of device memory is re-registered by registering anew.
    if mr.drv.borrow().on_demand() || mr.mr.addr.is_null() {
        return fail(ERR_CMD, libc::EOPNOTSUPP);
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
    if let Err(e) = unsafe { mr.drv.borrow_mut().rereg_user(drv_pd, range, acc) } {
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
    // Memory windows bound to it keep it registered (EBUSY), as on a ConnectX device. A
    // region still imported elsewhere stays for the other handles.
    if Rc::strong_count(&mr.drv) == 1 {
        if let Err(e) = mr.drv.borrow_mut().dereg() {
            return crate::errno_of(&e);
        }
    }
    st.remove(mr as *mut RbMr as usize);
    // SAFETY: an MR's PD outlives it (deallocating a PD with MRs is refused).
    unsafe { (*mr.pd).children -= 1 };
    // SAFETY: `mr` is the `RbMr` `reg` boxed, now out of the registry; dropping it
    // deregisters the region, then releases its memory's mapping.
    drop(unsafe { Box::from_raw(mr as *mut RbMr) });
    0
}

/// `ibv_advise_mr`: checks the advice, the flags and every SGE against the PD's regions on
/// demand, as ibv_advise_mr(3) lists the errors. A region on demand is always present for
/// the NIC (it reads the process's pages when it uses them), so a valid prefetch, with or
/// without `IBV_ADVISE_MR_FLAG_FLUSH`, has nothing left to do.
pub(crate) fn advise(st: &State, pd: &RbPd, advice: u32, flags: u32, sges: &[abi::ibv_sge]) -> i32 {
    const PREFETCH_WRITE: u32 =
        abi::ib_uverbs_advise_mr_advice_IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE;
    const NO_FAULT: u32 =
        abi::ib_uverbs_advise_mr_advice_IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT;
    const FLUSH: u32 = 1;
    if advice > NO_FAULT {
        return libc::EOPNOTSUPP;
    }
    if flags & !FLUSH != 0 || sges.is_empty() {
        return libc::EINVAL;
    }
    let mrs = st.live_of(Kind::Mr);
    for s in sges {
        let found = mrs.iter().find_map(|&p| {
            // SAFETY: the registry lists live MRs, allocated as `RbMr`; the lock is held.
            let mr = unsafe { &*(p as *const RbMr) };
            (mr.mr.lkey == s.lkey && std::ptr::eq(mr.pd, pd)).then_some(mr)
        });
        let Some(mr) = found else {
            return libc::EFAULT;
        };
        let drv = mr.drv.borrow();
        if !drv.on_demand() {
            return libc::EINVAL;
        }
        let off = s.addr.wrapping_sub(drv.addr());
        if s.addr < drv.addr() || off.saturating_add(u64::from(s.length)) > drv.len() {
            return libc::EFAULT;
        }
        if advice == PREFETCH_WRITE && !drv.access().contains(Access::LOCAL_WRITE) {
            return libc::EPERM;
        }
    }
    0
}
