//! The exported libibverbs entry points. Each one decides whose object it was handed: a
//! ringbell object is served here, anything else goes to the system's libibverbs (with the
//! lock released). A null pointer, or a ringbell object already destroyed, gets the errno a
//! bad argument gets instead of a crash.

use crate::abi;
use crate::cq::{RbChannel, RbCq};
use crate::device::{self, RbContext};
use crate::events::Wait;
use crate::ops::{null_or, with, with_ctx};
use crate::pd::{RbMr, RbPd};
use crate::qp::RbQp;
use crate::real::forward;
use crate::srq::RbSrq;
use crate::state::{lock, Kind, Owner, State};

/// A blocking event read that found nothing.
#[derive(Clone, Copy)]
enum Wait2 {
    /// Non-blocking descriptor: EAGAIN.
    Again,
    /// Wait as said, then look again.
    Wait(Wait),
}

/// What a read of an event queued behind descriptor `fd` of NIC `nic` does when nothing
/// is queued: EAGAIN on a non-blocking descriptor, else let the NIC move and look again.
fn nothing_yet(st: &mut State, nic: usize, fd: c_int) -> Wait2 {
    if crate::events::nonblocking(fd) {
        Wait2::Again
    } else {
        Wait2::Wait(crate::events::wait_step(st, nic))
    }
}

/// Repeats `attempt` (which takes the lock) until it yields an event, waiting outside the
/// lock in between; `None` with errno EAGAIN when the descriptor is non-blocking, EINTR
/// when a signal handler interrupted the wait as it interrupts a `read(2)`.
fn wait_event<T>(mut attempt: impl FnMut() -> Result<T, Wait2>) -> Option<T> {
    let win = crate::events::SignalWindow::open();
    loop {
        match attempt() {
            Ok(v) => return Some(v),
            Err(Wait2::Again) => {
                set_errno(libc::EAGAIN);
                return None;
            }
            Err(Wait2::Wait(w)) => {
                if let Err(e) = crate::events::idle(w, &win) {
                    set_errno(e);
                    return None;
                }
            }
        }
    }
}
use crate::{guard, set_errno};
use std::ffi::{c_char, c_int, c_void};

/// Whose object `p` is (the lock is released again before anything is forwarded).
fn owner(p: usize) -> Owner {
    if p == 0 {
        return Owner::Dead;
    }
    guard(Owner::Dead, || lock().owner(p))
}

/// Owner of a device pointer: ours when it is one of the ringbell `struct ibv_device`s.
fn nic_of(dev: *mut abi::ibv_device) -> Option<usize> {
    guard(None, || lock().nic_of_ibdev(dev))
}

/// Returns null with `errno` set.
fn null_with<T>(e: i32) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

/// The object, or NULL with `errno` set.
pub(crate) fn ptr_or_errno<T, U>(r: Result<*mut T, i32>) -> *mut U {
    match r {
        Ok(p) => p as *mut U,
        Err(e) => null_with(e),
    }
}

// ---- devices ----

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut abi::ibv_device {
    let mut real_n: c_int = 0;
    let real = forward!(
        "ibv_get_device_list",
        fn(*mut c_int) -> *mut *mut abi::ibv_device,
        (&mut real_n)
    )
    .unwrap_or(std::ptr::null_mut());
    let mut all: Vec<*mut abi::ibv_device> = Vec::new();
    if !real.is_null() {
        for i in 0..real_n.max(0) as usize {
            // SAFETY: libibverbs' list holds `real_n` devices.
            all.push(unsafe { *real.add(i) });
        }
    }
    let list = guard(std::ptr::null_mut(), || {
        let mut st = lock();
        // This process's NICs: on a served fabric the one it claims (or `RINGBELL_NIC`), as
        // the libfabric provider chooses (`ringbell::discover`).
        let choice = st.plan.choice();
        all.extend(
            st.nics
                .iter()
                .enumerate()
                .filter(|(i, _)| choice.includes(*i))
                .map(|(_, n)| n.ibdev),
        );
        let n = all.len();
        all.push(std::ptr::null_mut());
        let p = Box::into_raw(all.into_boxed_slice()) as *mut *mut abi::ibv_device;
        st.lists.insert(p as usize, real as usize);
        if !num.is_null() {
            // SAFETY: the caller's out-pointer, checked non-null.
            unsafe { *num = n as c_int };
        }
        p
    });
    if list.is_null() && !real.is_null() {
        // SAFETY: libibverbs' own list, returned to it.
        forward!(
            "ibv_free_device_list",
            fn(*mut *mut abi::ibv_device) -> (),
            (real)
        );
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut abi::ibv_device) {
    if list.is_null() {
        return;
    }
    let ours = guard(None, || lock().lists.remove(&(list as usize)));
    match ours {
        Some(real) => {
            let mut n = 0;
            // SAFETY: our list is NULL-terminated.
            while !unsafe { *list.add(n) }.is_null() {
                n += 1;
            }
            // SAFETY: the boxed slice `ibv_get_device_list` made, of n + 1 entries.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n + 1)) });
            if real != 0 {
                forward!(
                    "ibv_free_device_list",
                    fn(*mut *mut abi::ibv_device) -> (),
                    (real as *mut *mut abi::ibv_device)
                );
            }
        }
        None => {
            forward!(
                "ibv_free_device_list",
                fn(*mut *mut abi::ibv_device) -> (),
                (list)
            );
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut abi::ibv_device) -> *const c_char {
    if dev.is_null() {
        return null_with(libc::EINVAL);
    }
    if nic_of(dev).is_some() {
        // SAFETY: one of our devices; its name is a NUL-terminated array that lives forever.
        return unsafe { (*dev).name.as_ptr() };
    }
    forward!(
        "ibv_get_device_name",
        fn(*mut abi::ibv_device) -> *const c_char,
        (dev)
    )
    .unwrap_or(std::ptr::null())
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_guid(dev: *mut abi::ibv_device) -> u64 {
    if dev.is_null() {
        return 0;
    }
    match nic_of(dev) {
        Some(i) => device::guid_of_node(i),
        None => forward!(
            "ibv_get_device_guid",
            fn(*mut abi::ibv_device) -> u64,
            (dev)
        )
        .unwrap_or(0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_index(dev: *mut abi::ibv_device) -> c_int {
    if dev.is_null() {
        return -1;
    }
    match nic_of(dev) {
        Some(i) => device::INDEX_BASE + i as c_int,
        None => forward!(
            "ibv_get_device_index",
            fn(*mut abi::ibv_device) -> c_int,
            (dev)
        )
        .unwrap_or(-1),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(dev: *mut abi::ibv_device) -> *mut abi::ibv_context {
    if dev.is_null() {
        return null_with(libc::EINVAL);
    }
    match nic_of(dev) {
        Some(i) => ptr_or_errno(guard(Err(libc::EIO), || device::open(&mut lock(), i))),
        None => forward!(
            "ibv_open_device",
            fn(*mut abi::ibv_device) -> *mut abi::ibv_context,
            (dev)
        )
        .unwrap_or_else(|| null_with(libc::ENOSYS)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut abi::ibv_context) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => with_ctx(ctx, libc::EINVAL, device::close),
        Owner::Foreign => forward!(
            "ibv_close_device",
            fn(*mut abi::ibv_context) -> c_int,
            (ctx)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_device_attr,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) if !attr.is_null() => with_ctx(ctx, libc::EINVAL, |_, c| {
            // SAFETY: the caller's struct, checked non-null.
            device::query_device(c.dev.caps(), unsafe { &mut *attr });
            0
        }),
        Owner::Foreign => forward!(
            "ibv_query_device",
            fn(*mut abi::ibv_context, *mut abi::ibv_device_attr) -> c_int,
            (ctx, attr)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    ctx: *mut abi::ibv_context,
    port: u8,
    attr: *mut abi::ibv_port_attr,
) -> c_int {
    match owner(ctx as usize) {
        // The exported call fills the fields up to `link_layer` (the layout it had before
        // the extended query existed); the header's inline call uses the extended one.
        // SAFETY: the caller's arguments, passed on.
        Owner::Ours(Kind::Context) => unsafe {
            crate::ops::query_port_ex(
                ctx,
                port,
                attr,
                std::mem::offset_of!(abi::ibv_port_attr, flags),
            )
        },
        Owner::Foreign => forward!(
            "ibv_query_port",
            fn(*mut abi::ibv_context, u8, *mut abi::ibv_port_attr) -> c_int,
            (ctx, port, attr)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

/// The GID entry `index` of port `port`: EINVAL beyond the table, ENODATA for an empty entry.
fn gid_entry(c: &RbContext, port: u32, index: u32) -> Result<abi::ibv_gid_entry, i32> {
    if port != 1 || index >= device::GID_TABLE_LEN {
        return Err(libc::EINVAL);
    }
    if index != 0 {
        return Err(libc::ENODATA);
    }
    Ok(abi::ibv_gid_entry {
        gid: abi::ibv_gid {
            raw: device::gid_of(c.dev.caps()),
        },
        gid_index: 0,
        port_num: 1,
        gid_type: abi::ibv_gid_type_IBV_GID_TYPE_ROCE_V2,
        ndev_ifindex: 0,
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    ctx: *mut abi::ibv_context,
    port: u8,
    index: c_int,
    gid: *mut abi::ibv_gid,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) if !gid.is_null() => with_ctx(ctx, -1, |_, c| {
            match gid_entry(c, u32::from(port), index.max(-1) as u32) {
                Ok(e) => {
                    // SAFETY: the caller's struct, checked non-null.
                    unsafe { *gid = e.gid };
                    0
                }
                Err(libc::ENODATA) => {
                    // An empty entry reads as the zero GID, as libibverbs reports it.
                    // SAFETY: the caller's struct, checked non-null.
                    unsafe { *gid = abi::ibv_gid { raw: [0; 16] } };
                    0
                }
                Err(e) => {
                    set_errno(e);
                    -1
                }
            }
        }),
        Owner::Foreign => forward!(
            "ibv_query_gid",
            fn(*mut abi::ibv_context, u8, c_int, *mut abi::ibv_gid) -> c_int,
            (ctx, port, index, gid)
        )
        .unwrap_or(-1),
        _ => -1,
    }
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut abi::ibv_context,
    port: u32,
    index: u32,
    entry: *mut abi::ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if entry.is_null()
                || flags != 0
                || entry_size < std::mem::size_of::<abi::ibv_gid_entry>()
            {
                return libc::EINVAL;
            }
            with_ctx(ctx, libc::EINVAL, |_, c| match gid_entry(c, port, index) {
                Ok(e) => {
                    // SAFETY: the caller's struct, checked non-null and large enough.
                    unsafe { *entry = e };
                    0
                }
                Err(e) => e,
            })
        }
        Owner::Foreign => forward!(
            "_ibv_query_gid_ex",
            fn(*mut abi::ibv_context, u32, u32, *mut abi::ibv_gid_entry, u32, usize) -> c_int,
            (ctx, port, index, entry, flags, entry_size)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut abi::ibv_context,
    entries: *mut abi::ibv_gid_entry,
    max: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if flags != 0 || entry_size < std::mem::size_of::<abi::ibv_gid_entry>() {
                return -(libc::EINVAL as isize);
            }
            if max == 0 || entries.is_null() {
                return -(libc::EINVAL as isize);
            }
            with_ctx(ctx, -(libc::EINVAL as isize), |_, c| {
                match gid_entry(c, 1, 0) {
                    Ok(e) => {
                        // SAFETY: the caller's array of `max >= 1` entries of `entry_size` bytes.
                        unsafe { *entries = e };
                        1
                    }
                    Err(e) => -(e as isize),
                }
            })
        }
        Owner::Foreign => forward!(
            "_ibv_query_gid_table",
            fn(*mut abi::ibv_context, *mut abi::ibv_gid_entry, usize, u32, usize) -> isize,
            (ctx, entries, max, flags, entry_size)
        )
        .unwrap_or(-(libc::EINVAL as isize)),
        _ => -(libc::EINVAL as isize),
    }
}

/// libibverbs' private `ibv_query_gid_type` (its `enum ibv_gid_type_sysfs`: 1 = RoCE v2).
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut abi::ibv_context,
    port: u8,
    index: u32,
    ty: *mut c_int,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if ty.is_null() || port != 1 || index >= device::GID_TABLE_LEN {
                set_errno(libc::EINVAL);
                return -1;
            }
            // Index 0 is RoCE v2; an empty entry reads as 0 (IB/RoCE v1), as libibverbs
            // reports empty entries (`ibv_find_gid_index` walks past them).
            // SAFETY: the caller's out-pointer, checked non-null.
            unsafe { *ty = c_int::from(index == 0) };
            0
        }
        Owner::Foreign => forward!(
            "ibv_query_gid_type",
            fn(*mut abi::ibv_context, u8, u32, *mut c_int) -> c_int,
            (ctx, port, index, ty)
        )
        .unwrap_or(-1),
        _ => -1,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    ctx: *mut abi::ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if pkey.is_null() || port != 1 || index != 0 {
                return -1;
            }
            // SAFETY: the caller's out-pointer, checked non-null.
            unsafe { *pkey = 0xffff };
            0
        }
        Owner::Foreign => forward!(
            "ibv_query_pkey",
            fn(*mut abi::ibv_context, u8, c_int, *mut u16) -> c_int,
            (ctx, port, index, pkey)
        )
        .unwrap_or(-1),
        _ => -1,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(
    ctx: *mut abi::ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if port == 1 && pkey == 0xffff {
                0
            } else {
                set_errno(libc::ENOENT);
                -1
            }
        }
        Owner::Foreign => forward!(
            "ibv_get_pkey_index",
            fn(*mut abi::ibv_context, u8, u16) -> c_int,
            (ctx, port, pkey)
        )
        .unwrap_or(-1),
        _ => -1,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_device(cmd_fd: c_int) -> *mut abi::ibv_context {
    // A duplicate of a ringbell context's `cmd_fd` imports that context's device (within
    // this process: contexts are not shared with other processes); any other descriptor
    // is libibverbs'.
    match guard(Err(libc::EIO), || device::import(&mut lock(), cmd_fd)) {
        Ok(Some(p)) => p,
        Err(e) => null_with(e),
        Ok(None) => forward!(
            "ibv_import_device",
            fn(c_int) -> *mut abi::ibv_context,
            (cmd_fd)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
    }
}

// ---- PD and MR ----

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut abi::ibv_context) -> *mut abi::ibv_pd {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            ptr_or_errno(with_ctx(ctx, Err(libc::EINVAL), crate::pd::alloc))
        }
        Owner::Foreign => forward!(
            "ibv_alloc_pd",
            fn(*mut abi::ibv_context) -> *mut abi::ibv_pd,
            (ctx)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut abi::ibv_pd) -> c_int {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => with(pd as *mut RbPd, Kind::Pd, libc::EINVAL, crate::pd::dealloc),
        Owner::Foreign => {
            forward!("ibv_dealloc_pd", fn(*mut abi::ibv_pd) -> c_int, (pd)).unwrap_or(libc::EINVAL)
        }
        _ => libc::EINVAL,
    }
}

fn reg_ours(
    pd: *mut abi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut abi::ibv_mr {
    ptr_or_errno(with(
        pd as *mut RbPd,
        Kind::Pd,
        Err(libc::EINVAL),
        |st, pd| {
            // SAFETY: the program registers memory it owns, as libibverbs requires.
            unsafe { crate::pd::reg(st, pd, addr as *mut u8, len, iova, access as u32) }
        },
    ))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut abi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut abi::ibv_mr {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => reg_ours(pd, addr, len, addr as u64, access),
        Owner::Foreign => forward!(
            "ibv_reg_mr",
            fn(*mut abi::ibv_pd, *mut c_void, usize, c_int) -> *mut abi::ibv_mr,
            (pd, addr, len, access)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut abi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut abi::ibv_mr {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => reg_ours(pd, addr, len, iova, access),
        Owner::Foreign => forward!(
            "ibv_reg_mr_iova",
            fn(*mut abi::ibv_pd, *mut c_void, usize, u64, c_int) -> *mut abi::ibv_mr,
            (pd, addr, len, iova, access)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut abi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut abi::ibv_mr {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => reg_ours(pd, addr, len, iova, access as c_int),
        Owner::Foreign => forward!(
            "ibv_reg_mr_iova2",
            fn(*mut abi::ibv_pd, *mut c_void, usize, u64, u32) -> *mut abi::ibv_mr,
            (pd, addr, len, iova, access)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    pd: *mut abi::ibv_pd,
    offset: u64,
    len: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut abi::ibv_mr {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => null_with(libc::EOPNOTSUPP),
        Owner::Foreign => forward!(
            "ibv_reg_dmabuf_mr",
            fn(*mut abi::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut abi::ibv_mr,
            (pd, offset, len, iova, fd, access)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut abi::ibv_mr) -> c_int {
    match owner(mr as usize) {
        Owner::Ours(Kind::Mr) => with(mr as *mut RbMr, Kind::Mr, libc::EINVAL, crate::pd::dereg),
        Owner::Foreign => {
            forward!("ibv_dereg_mr", fn(*mut abi::ibv_mr) -> c_int, (mr)).unwrap_or(libc::EINVAL)
        }
        _ => libc::EINVAL,
    }
}

/// `ibv_rereg_mr`: a ringbell MR changes in place and keeps its keys (see `pd::rereg`).
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut abi::ibv_mr,
    flags: c_int,
    pd: *mut abi::ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> c_int {
    const ERR_INPUT: c_int = abi::ibv_rereg_mr_err_code_IBV_REREG_MR_ERR_INPUT;
    match owner(mr as usize) {
        Owner::Ours(Kind::Mr) => with(mr as *mut RbMr, Kind::Mr, ERR_INPUT, |st, m| {
            // SAFETY: the caller's arguments, as libibverbs takes them.
            unsafe { crate::pd::rereg(st, m, flags, pd, addr as *mut u8, len, access) }
        }),
        Owner::Foreign => forward!(
            "ibv_rereg_mr",
            fn(*mut abi::ibv_mr, c_int, *mut abi::ibv_pd, *mut c_void, usize, c_int) -> c_int,
            (mr, flags, pd, addr, len, access)
        )
        .unwrap_or(ERR_INPUT),
        _ => {
            set_errno(libc::EINVAL);
            ERR_INPUT
        }
    }
}

// ---- CQ and channels ----

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut abi::ibv_context,
) -> *mut abi::ibv_comp_channel {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            ptr_or_errno(with_ctx(ctx, Err(libc::EINVAL), crate::cq::create_channel))
        }
        Owner::Foreign => forward!(
            "ibv_create_comp_channel",
            fn(*mut abi::ibv_context) -> *mut abi::ibv_comp_channel,
            (ctx)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut abi::ibv_comp_channel) -> c_int {
    match owner(ch as usize) {
        Owner::Ours(Kind::Channel) => with(
            ch as *mut RbChannel,
            Kind::Channel,
            libc::EINVAL,
            crate::cq::destroy_channel,
        ),
        Owner::Foreign => forward!(
            "ibv_destroy_comp_channel",
            fn(*mut abi::ibv_comp_channel) -> c_int,
            (ch)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut abi::ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut abi::ibv_comp_channel,
    comp_vector: c_int,
) -> *mut abi::ibv_cq {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => ptr_or_errno(with_ctx(ctx, Err(libc::EINVAL), |st, c| {
            if comp_vector < 0 || comp_vector >= c.vctx.context.num_comp_vectors {
                return Err(libc::EINVAL);
            }
            if !null_or(st, channel as usize, Kind::Channel) {
                return Err(libc::EINVAL);
            }
            crate::cq::create(
                st,
                c,
                cqe,
                channel as *mut RbChannel,
                cq_context,
                std::ptr::null_mut(),
            )
        })),
        Owner::Foreign => forward!(
            "ibv_create_cq",
            fn(
                *mut abi::ibv_context,
                c_int,
                *mut c_void,
                *mut abi::ibv_comp_channel,
                c_int,
            ) -> *mut abi::ibv_cq,
            (ctx, cqe, cq_context, channel, comp_vector)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut abi::ibv_cq, cqe: c_int) -> c_int {
    match owner(cq as usize) {
        Owner::Ours(Kind::Cq) => with(cq as *mut RbCq, Kind::Cq, libc::EINVAL, |_, cq| {
            crate::cq::resize(cq, cqe)
        }),
        Owner::Foreign => forward!(
            "ibv_resize_cq",
            fn(*mut abi::ibv_cq, c_int) -> c_int,
            (cq, cqe)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut abi::ibv_cq) -> c_int {
    match owner(cq as usize) {
        Owner::Ours(Kind::Cq) => with(cq as *mut RbCq, Kind::Cq, libc::EINVAL, crate::cq::destroy),
        Owner::Foreign => {
            forward!("ibv_destroy_cq", fn(*mut abi::ibv_cq) -> c_int, (cq)).unwrap_or(libc::EINVAL)
        }
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut abi::ibv_comp_channel,
    cq: *mut *mut abi::ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    match owner(ch as usize) {
        Owner::Ours(Kind::Channel) => {
            if cq.is_null() || cq_context.is_null() {
                set_errno(libc::EINVAL);
                return -1;
            }
            let got = wait_event(|| {
                with(
                    ch as *mut RbChannel,
                    Kind::Channel,
                    Err(Wait2::Again),
                    |st, ch| {
                        // SAFETY: a channel's context outlives it.
                        let nic = unsafe { (*ch.ctx).nic };
                        crate::events::pump(st, nic);
                        match ch.queue.pop_front() {
                            Some(c) => {
                                crate::events::eventfd_take(ch.ch.fd);
                                // SAFETY: queued CQs are live (destroy removes them from the
                                // queue).
                                let c = unsafe { &mut *c };
                                Ok((c as *mut RbCq as *mut abi::ibv_cq, c.cq.cq_context))
                            }
                            None => Err(nothing_yet(st, nic, ch.ch.fd)),
                        }
                    },
                )
            });
            match got {
                Some((c, ctxp)) => {
                    // SAFETY: the caller's out-pointers, checked non-null.
                    unsafe {
                        *cq = c;
                        *cq_context = ctxp;
                    }
                    0
                }
                None => -1,
            }
        }
        Owner::Foreign => forward!(
            "ibv_get_cq_event",
            fn(*mut abi::ibv_comp_channel, *mut *mut abi::ibv_cq, *mut *mut c_void) -> c_int,
            (ch, cq, cq_context)
        )
        .unwrap_or(-1),
        _ => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut abi::ibv_cq, n: u32) {
    match owner(cq as usize) {
        Owner::Ours(Kind::Cq) => with(cq as *mut RbCq, Kind::Cq, (), |_, cq| {
            cq.cq.comp_events_completed = cq.cq.comp_events_completed.wrapping_add(n);
        }),
        Owner::Foreign => {
            forward!(
                "ibv_ack_cq_events",
                fn(*mut abi::ibv_cq, u32) -> (),
                (cq, n)
            );
        }
        _ => {}
    }
}

// ---- SRQ ----

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut abi::ibv_pd,
    attr: *mut abi::ibv_srq_init_attr,
) -> *mut abi::ibv_srq {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => {
            if attr.is_null() {
                return null_with(libc::EINVAL);
            }
            // SAFETY: the caller's struct, checked non-null.
            let a = unsafe { &mut *attr };
            let mut ex = abi::ibv_srq_init_attr_ex {
                srq_context: a.srq_context,
                attr: a.attr,
                srq_type: abi::ibv_srq_type_IBV_SRQT_BASIC,
                ..Default::default()
            };
            let r = with(pd as *mut RbPd, Kind::Pd, Err(libc::EINVAL), |st, pd| {
                crate::srq::create(st, pd, std::ptr::null_mut(), &mut ex)
            });
            a.attr = ex.attr;
            ptr_or_errno(r)
        }
        Owner::Foreign => forward!(
            "ibv_create_srq",
            fn(*mut abi::ibv_pd, *mut abi::ibv_srq_init_attr) -> *mut abi::ibv_srq,
            (pd, attr)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut abi::ibv_srq,
    attr: *mut abi::ibv_srq_attr,
    mask: c_int,
) -> c_int {
    match owner(srq as usize) {
        Owner::Ours(Kind::Srq) if !attr.is_null() => {
            with(srq as *mut RbSrq, Kind::Srq, libc::EINVAL, |_, s| {
                // SAFETY: the caller's struct, checked non-null.
                crate::srq::modify(s, unsafe { &*attr }, mask as u32)
            })
        }
        Owner::Foreign => forward!(
            "ibv_modify_srq",
            fn(*mut abi::ibv_srq, *mut abi::ibv_srq_attr, c_int) -> c_int,
            (srq, attr, mask)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(
    srq: *mut abi::ibv_srq,
    attr: *mut abi::ibv_srq_attr,
) -> c_int {
    match owner(srq as usize) {
        Owner::Ours(Kind::Srq) if !attr.is_null() => {
            with(srq as *mut RbSrq, Kind::Srq, libc::EINVAL, |_, s| {
                // SAFETY: the caller's struct, checked non-null.
                crate::srq::query(s, unsafe { &mut *attr })
            })
        }
        Owner::Foreign => forward!(
            "ibv_query_srq",
            fn(*mut abi::ibv_srq, *mut abi::ibv_srq_attr) -> c_int,
            (srq, attr)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut abi::ibv_srq) -> c_int {
    match owner(srq as usize) {
        Owner::Ours(Kind::Srq) => with(
            srq as *mut RbSrq,
            Kind::Srq,
            libc::EINVAL,
            crate::srq::destroy,
        ),
        Owner::Foreign => forward!("ibv_destroy_srq", fn(*mut abi::ibv_srq) -> c_int, (srq))
            .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

// ---- QP ----

/// Checks the pointers of a QP creation and creates it (lock held).
pub(crate) fn create_qp_checked(
    st: &mut State,
    pd: *mut abi::ibv_pd,
    a: &mut abi::ibv_qp_init_attr_ex,
) -> Result<*mut RbQp, i32> {
    // An XRC initiator has no receive side: a NULL receive CQ stands for its send CQ.
    if a.qp_type == abi::ibv_qp_type_IBV_QPT_XRC_SEND && a.recv_cq.is_null() {
        a.recv_cq = a.send_cq;
    }
    if st.owner(pd as usize) != Owner::Ours(Kind::Pd)
        || st.owner(a.send_cq as usize) != Owner::Ours(Kind::Cq)
        || st.owner(a.recv_cq as usize) != Owner::Ours(Kind::Cq)
        || !null_or(st, a.srq as usize, Kind::Srq)
    {
        return Err(libc::EINVAL);
    }
    let args = crate::qp::CreateArgs {
        pd: pd as *mut RbPd,
        send_cq: a.send_cq as *mut RbCq,
        recv_cq: a.recv_cq as *mut RbCq,
        srq: a.srq as *mut RbSrq,
    };
    crate::qp::create(st, &args, a)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut abi::ibv_pd,
    attr: *mut abi::ibv_qp_init_attr,
) -> *mut abi::ibv_qp {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => {
            if attr.is_null() {
                return null_with(libc::EINVAL);
            }
            // SAFETY: the caller's struct, checked non-null.
            let a = unsafe { &mut *attr };
            let mut ex = abi::ibv_qp_init_attr_ex {
                qp_context: a.qp_context,
                send_cq: a.send_cq,
                recv_cq: a.recv_cq,
                srq: a.srq,
                cap: a.cap,
                qp_type: a.qp_type,
                sq_sig_all: a.sq_sig_all,
                comp_mask: abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD,
                pd,
                ..Default::default()
            };
            let r = guard(Err(libc::EIO), || {
                create_qp_checked(&mut lock(), pd, &mut ex)
            });
            if r.is_ok() {
                a.cap = ex.cap;
            }
            ptr_or_errno(r)
        }
        Owner::Foreign => forward!(
            "ibv_create_qp",
            fn(*mut abi::ibv_pd, *mut abi::ibv_qp_init_attr) -> *mut abi::ibv_qp,
            (pd, attr)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut abi::ibv_qp,
    attr: *mut abi::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) if !attr.is_null() => {
            with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |_, q| {
                // SAFETY: the caller's struct, checked non-null.
                crate::qp::modify(q, unsafe { &*attr }, mask as u32)
            })
        }
        Owner::Foreign => forward!(
            "ibv_modify_qp",
            fn(*mut abi::ibv_qp, *mut abi::ibv_qp_attr, c_int) -> c_int,
            (qp, attr, mask)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut abi::ibv_qp,
    attr: *mut abi::ibv_qp_attr,
    mask: c_int,
    init: *mut abi::ibv_qp_init_attr,
) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) if !attr.is_null() && !init.is_null() => {
            with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |_, q| {
                // SAFETY: the caller's structs, checked non-null.
                crate::qp::query(q, unsafe { &mut *attr }, unsafe { &mut *init })
            })
        }
        Owner::Foreign => forward!(
            "ibv_query_qp",
            fn(*mut abi::ibv_qp, *mut abi::ibv_qp_attr, c_int, *mut abi::ibv_qp_init_attr) -> c_int,
            (qp, attr, mask, init)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp_data_in_order(
    qp: *mut abi::ibv_qp,
    op: u32,
    flags: u32,
) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => 0,
        Owner::Foreign => forward!(
            "ibv_query_qp_data_in_order",
            fn(*mut abi::ibv_qp, u32, u32) -> c_int,
            (qp, op, flags)
        )
        .unwrap_or(0),
        _ => 0,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut abi::ibv_qp) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |st, q| {
            // Flow rules and multicast groups hold their QP (uverbs: EBUSY).
            match q.drv.flows_attached() == 0 && q.drv.mcast_attached() == 0 {
                true => crate::qp::destroy(st, q),
                false => libc::EBUSY,
            }
        }),
        Owner::Foreign => {
            forward!("ibv_destroy_qp", fn(*mut abi::ibv_qp) -> c_int, (qp)).unwrap_or(libc::EINVAL)
        }
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut abi::ibv_qp) -> *mut abi::ibv_qp_ex {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => with(qp as *mut RbQp, Kind::Qp, std::ptr::null_mut(), |_, q| {
            if q.ex {
                &mut q.qpx as *mut abi::ibv_qp_ex
            } else {
                null_with(libc::EOPNOTSUPP)
            }
        }),
        Owner::Foreign => forward!(
            "ibv_qp_to_qp_ex",
            fn(*mut abi::ibv_qp) -> *mut abi::ibv_qp_ex,
            (qp)
        )
        .unwrap_or(std::ptr::null_mut()),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_ece(qp: *mut abi::ibv_qp, ece: *mut abi::ibv_ece) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => libc::EOPNOTSUPP,
        Owner::Foreign => forward!(
            "ibv_query_ece",
            fn(*mut abi::ibv_qp, *mut abi::ibv_ece) -> c_int,
            (qp, ece)
        )
        .unwrap_or(libc::EOPNOTSUPP),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_set_ece(qp: *mut abi::ibv_qp, ece: *mut abi::ibv_ece) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => libc::EOPNOTSUPP,
        Owner::Foreign => forward!(
            "ibv_set_ece",
            fn(*mut abi::ibv_qp, *mut abi::ibv_ece) -> c_int,
            (qp, ece)
        )
        .unwrap_or(libc::EOPNOTSUPP),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_attach_mcast(
    qp: *mut abi::ibv_qp,
    gid: *const abi::ibv_gid,
    lid: u16,
) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => {
            if gid.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: the caller's GID, checked non-null.
            let g = unsafe { (*gid).raw };
            with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |_, q| {
                crate::flow::attach_mcast(q, g)
            })
        }
        Owner::Foreign => forward!(
            "ibv_attach_mcast",
            fn(*mut abi::ibv_qp, *const abi::ibv_gid, u16) -> c_int,
            (qp, gid, lid)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_detach_mcast(
    qp: *mut abi::ibv_qp,
    gid: *const abi::ibv_gid,
    lid: u16,
) -> c_int {
    match owner(qp as usize) {
        Owner::Ours(Kind::Qp) => {
            if gid.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: the caller's GID, checked non-null.
            let g = unsafe { (*gid).raw };
            with(qp as *mut RbQp, Kind::Qp, libc::EINVAL, |_, q| {
                crate::flow::detach_mcast(q, g)
            })
        }
        Owner::Foreign => forward!(
            "ibv_detach_mcast",
            fn(*mut abi::ibv_qp, *const abi::ibv_gid, u16) -> c_int,
            (qp, gid, lid)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

// ---- address handles ----

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(
    pd: *mut abi::ibv_pd,
    attr: *mut abi::ibv_ah_attr,
) -> *mut abi::ibv_ah {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => {
            if attr.is_null() {
                return null_with(libc::EINVAL);
            }
            // SAFETY: the caller's struct, checked non-null.
            let a = unsafe { &*attr };
            ptr_or_errno(with(
                pd as *mut RbPd,
                Kind::Pd,
                Err(libc::EINVAL),
                |st, pd| crate::ah::create(st, pd, a),
            ))
        }
        Owner::Foreign => forward!(
            "ibv_create_ah",
            fn(*mut abi::ibv_pd, *mut abi::ibv_ah_attr) -> *mut abi::ibv_ah,
            (pd, attr)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut abi::ibv_ah) -> c_int {
    match owner(ah as usize) {
        Owner::Ours(Kind::Ah) => with(
            ah as *mut crate::ah::RbAh,
            Kind::Ah,
            libc::EINVAL,
            crate::ah::destroy,
        ),
        Owner::Foreign => {
            forward!("ibv_destroy_ah", fn(*mut abi::ibv_ah) -> c_int, (ah)).unwrap_or(libc::EINVAL)
        }
        _ => libc::EINVAL,
    }
}

/// `ibv_init_ah_from_wc` and `ibv_create_ah_from_wc` are libibverbs' generic code: they
/// read the GRH area of the receive buffer and the completion, and find the local GID
/// through `ibv_query_gid` and `ibv_query_gid_type` (both served here for a ringbell
/// context). A ringbell context is passed to them once checked live.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    ctx: *mut abi::ibv_context,
    port: u8,
    wc: *mut abi::ibv_wc,
    grh: *mut abi::ibv_grh,
    attr: *mut abi::ibv_ah_attr,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) if wc.is_null() || grh.is_null() || attr.is_null() => {
            set_errno(libc::EINVAL);
            -1
        }
        Owner::Ours(Kind::Context) | Owner::Foreign => forward!(
            "ibv_init_ah_from_wc",
            fn(
                *mut abi::ibv_context,
                u8,
                *mut abi::ibv_wc,
                *mut abi::ibv_grh,
                *mut abi::ibv_ah_attr,
            ) -> c_int,
            (ctx, port, wc, grh, attr)
        )
        .unwrap_or(-1),
        _ => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut abi::ibv_pd,
    wc: *mut abi::ibv_wc,
    grh: *mut abi::ibv_grh,
    port: u8,
) -> *mut abi::ibv_ah {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) if wc.is_null() || grh.is_null() => null_with(libc::EINVAL),
        Owner::Ours(Kind::Pd) | Owner::Foreign => forward!(
            "ibv_create_ah_from_wc",
            fn(*mut abi::ibv_pd, *mut abi::ibv_wc, *mut abi::ibv_grh, u8) -> *mut abi::ibv_ah,
            (pd, wc, grh, port)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resolve_eth_l2_from_gid(
    ctx: *mut abi::ibv_context,
    attr: *mut abi::ibv_ah_attr,
    mac: *mut u8,
    vid: *mut u16,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if attr.is_null() || mac.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: the caller's struct, checked non-null; any bit pattern is a valid GID.
            let gid = unsafe { (*attr).grh.dgid.raw };
            match device::mac_of_gid(&gid) {
                Some((m, _)) => {
                    // SAFETY: the caller's 6-byte MAC buffer and optional VLAN out-pointer.
                    unsafe {
                        std::ptr::copy_nonoverlapping(m.as_ptr(), mac, 6);
                        if !vid.is_null() {
                            *vid = 0xffff;
                        }
                    }
                    0
                }
                None => libc::EINVAL,
            }
        }
        Owner::Foreign => forward!(
            "ibv_resolve_eth_l2_from_gid",
            fn(*mut abi::ibv_context, *mut abi::ibv_ah_attr, *mut u8, *mut u16) -> c_int,
            (ctx, attr, mac, vid)
        )
        .unwrap_or(libc::EINVAL),
        _ => libc::EINVAL,
    }
}

// ---- import (objects shared between contexts of one process) ----

#[no_mangle]
pub unsafe extern "C" fn ibv_import_pd(
    ctx: *mut abi::ibv_context,
    handle: u32,
) -> *mut abi::ibv_pd {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => ptr_or_errno(with_ctx(ctx, Err(libc::EINVAL), |st, c| {
            crate::pd::import_pd(st, c, handle)
        })),
        Owner::Foreign => forward!(
            "ibv_import_pd",
            fn(*mut abi::ibv_context, u32) -> *mut abi::ibv_pd,
            (ctx, handle)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_mr(pd: *mut abi::ibv_pd, handle: u32) -> *mut abi::ibv_mr {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => ptr_or_errno(with(
            pd as *mut RbPd,
            Kind::Pd,
            Err(libc::EINVAL),
            |st, p| crate::pd::import_mr(st, p, handle),
        )),
        Owner::Foreign => forward!(
            "ibv_import_mr",
            fn(*mut abi::ibv_pd, u32) -> *mut abi::ibv_mr,
            (pd, handle)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_import_dm(
    ctx: *mut abi::ibv_context,
    handle: u32,
) -> *mut abi::ibv_dm {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => ptr_or_errno(with_ctx(ctx, Err(libc::EINVAL), |st, c| {
            crate::dm::import(st, c, handle)
        })),
        Owner::Foreign => forward!(
            "ibv_import_dm",
            fn(*mut abi::ibv_context, u32) -> *mut abi::ibv_dm,
            (ctx, handle)
        )
        .unwrap_or_else(|| null_with(libc::EINVAL)),
        _ => null_with(libc::EINVAL),
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_pd(pd: *mut abi::ibv_pd) {
    match owner(pd as usize) {
        Owner::Ours(Kind::Pd) => with(pd as *mut RbPd, Kind::Pd, (), crate::pd::unimport_pd),
        Owner::Foreign => {
            forward!("ibv_unimport_pd", fn(*mut abi::ibv_pd) -> (), (pd));
        }
        _ => {}
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_mr(mr: *mut abi::ibv_mr) {
    match owner(mr as usize) {
        // A region windows are bound to stays (EBUSY), as ibv_dereg_mr leaves it.
        Owner::Ours(Kind::Mr) => {
            with(mr as *mut RbMr, Kind::Mr, 0, crate::pd::dereg);
        }
        Owner::Foreign => {
            forward!("ibv_unimport_mr", fn(*mut abi::ibv_mr) -> (), (mr));
        }
        _ => {}
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_unimport_dm(dm: *mut abi::ibv_dm) {
    match owner(dm as usize) {
        // Memory regions still use keep it (EBUSY), as ibv_free_dm leaves it.
        Owner::Ours(Kind::Dm) => {
            with(dm as *mut crate::dm::RbDm, Kind::Dm, 0, crate::dm::free);
        }
        Owner::Foreign => {
            forward!("ibv_unimport_dm", fn(*mut abi::ibv_dm) -> (), (dm));
        }
        _ => {}
    }
}

// ---- async events ----

#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut abi::ibv_context,
    event: *mut abi::ibv_async_event,
) -> c_int {
    match owner(ctx as usize) {
        Owner::Ours(Kind::Context) => {
            if event.is_null() {
                set_errno(libc::EINVAL);
                return -1;
            }
            let got = wait_event(|| {
                with_ctx(ctx, Err(Wait2::Again), |st, c| {
                    crate::events::pump(st, c.nic);
                    match c.events.pop_front() {
                        Some(e) => {
                            crate::events::eventfd_take(c.vctx.context.async_fd);
                            Ok(e)
                        }
                        None => Err(nothing_yet(st, c.nic, c.vctx.context.async_fd)),
                    }
                })
            });
            match got {
                Some(e) => {
                    // SAFETY: the caller's struct, checked non-null.
                    unsafe { *event = e };
                    0
                }
                None => -1,
            }
        }
        Owner::Foreign => forward!(
            "ibv_get_async_event",
            fn(*mut abi::ibv_context, *mut abi::ibv_async_event) -> c_int,
            (ctx, event)
        )
        .unwrap_or(-1),
        _ => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut abi::ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: the caller's event, as `ibv_get_async_event` filled it; the union member read
    // is a plain pointer whichever member the event type selects.
    let (ty, elem) = unsafe { ((*event).event_type, (*event).element.qp as usize) };
    let handled = guard(true, || {
        let st = lock();
        let o = st.owner(elem);
        match o {
            Owner::Ours(kind) => {
                // SAFETY: a live ringbell object of `kind`, under the lock.
                unsafe {
                    match kind {
                        Kind::Qp => (*(elem as *mut RbQp)).qpx.qp_base.events_completed += 1,
                        Kind::Cq => (*(elem as *mut RbCq)).cq.async_events_completed += 1,
                        Kind::Srq => (*(elem as *mut RbSrq)).srq.events_completed += 1,
                        _ => {}
                    }
                }
                true
            }
            Owner::Dead => true,
            Owner::Foreign => false,
        }
    });
    let port_event = matches!(
        ty,
        abi::ibv_event_type_IBV_EVENT_PORT_ACTIVE
            | abi::ibv_event_type_IBV_EVENT_PORT_ERR
            | abi::ibv_event_type_IBV_EVENT_LID_CHANGE
            | abi::ibv_event_type_IBV_EVENT_PKEY_CHANGE
            | abi::ibv_event_type_IBV_EVENT_SM_CHANGE
            | abi::ibv_event_type_IBV_EVENT_CLIENT_REREGISTER
            | abi::ibv_event_type_IBV_EVENT_GID_CHANGE
            | abi::ibv_event_type_IBV_EVENT_DEVICE_FATAL
    );
    if !handled && !port_event {
        forward!(
            "ibv_ack_async_event",
            fn(*mut abi::ibv_async_event) -> (),
            (event)
        );
    }
}
