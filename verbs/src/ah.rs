//! Address handles: where a UD send goes. On a RoCE port an address vector always has its
//! GRH (`is_global`), and the destination GID names the peer port: a ringbell GID is the
//! IPv4-mapped address of a NIC on the fabric, whose MAC the fabric's address plan gives.

use crate::abi;
use crate::device::mac_of_gid;
use crate::pd::RbPd;
use crate::state::{Kind, State};
use ringbell::AddressHandle;
use std::sync::atomic::{AtomicU32, Ordering};

/// A ringbell AH.
#[repr(C)]
pub(crate) struct RbAh {
    pub ah: abi::ibv_ah,
    pub pd: *mut RbPd,
    pub drv: AddressHandle,
}

/// Checks an address vector as a RoCE device does: port 1, a GRH with source GID index 0
/// (the port's one GID) and a destination GID that names a port of the fabric. The
/// destination's Ethernet and IPv4 addresses.
pub(crate) fn resolve(attr: &abi::ibv_ah_attr) -> Result<ringbell::AhAttr, i32> {
    if attr.port_num != 1 || attr.is_global == 0 || attr.grh.sgid_index != 0 {
        return Err(libc::EINVAL);
    }
    // SAFETY: every bit pattern is a valid `raw` view of the GID union.
    let dgid = unsafe { attr.grh.dgid.raw };
    let (mac, ip) = mac_of_gid(&dgid).ok_or(libc::EINVAL)?;
    Ok(ringbell::AhAttr { mac, ip })
}

/// `ibv_create_ah`.
pub(crate) fn create(
    st: &mut State,
    pd: &mut RbPd,
    attr: &abi::ibv_ah_attr,
) -> Result<*mut abi::ibv_ah, i32> {
    static HANDLES: AtomicU32 = AtomicU32::new(1);
    let a = resolve(attr)?;
    let drv = pd.drv.create_ah(&a).map_err(|e| crate::errno_of(&e))?;
    let p = Box::into_raw(Box::new(RbAh {
        ah: abi::ibv_ah {
            context: pd.pd.context,
            pd: &mut pd.pd,
            handle: HANDLES.fetch_add(1, Ordering::Relaxed),
        },
        pd,
        drv,
    }));
    pd.children += 1;
    st.add(p as usize, Kind::Ah);
    Ok(p as *mut abi::ibv_ah)
}

/// `ibv_destroy_ah`. A send already posted with the handle keeps its own copy of the
/// address, as on hardware.
pub(crate) fn destroy(st: &mut State, ah: &mut RbAh) -> i32 {
    st.remove(ah as *mut RbAh as usize);
    // SAFETY: an AH's PD outlives it (deallocating a PD with AHs is refused).
    unsafe { (*ah.pd).children -= 1 };
    // SAFETY: `ah` is the `RbAh` `create` boxed, now out of the registry.
    drop(unsafe { Box::from_raw(ah as *mut RbAh) });
    0
}
