//! Memory windows (ABI 1.9): ALLOC_MW and DEALLOC_MW, the BIND_MW and LOCAL_INV work
//! requests, invalidation by a received SEND with invalidate, and the remote key check
//! through a window.
//!
//! A window is a key of its own over part of a memory region with remote rights of its own.
//! Window keys have bit 31 set ([`MW_KEY_BIT`]), region keys never do, so one bit tells a
//! remote key check which table to look in. A bound window holds its region: DEREG_MR and
//! REREG_MR are `BUSY` until it is unbound.

use crate::mem::{key_index, KeyError};
use crate::nic::Nic;
use ringbell_specs::cmd::{
    Access, AllocMwIn, CmdStatus, ObjectOut, MW_KEY_BIT, MW_TYPE_1, MW_TYPE_2,
};
use ringbell_specs::cqe::VendorSyndrome;
use ringbell_specs::wqe::MW_ZERO_BASED;
use zerocopy::IntoBytes;

/// A memory window.
#[derive(Debug)]
pub(crate) struct Mw {
    pub(crate) pdn: u32,
    /// Type 2 (bound to one QP) rather than type 1.
    pub(crate) type2: bool,
    /// The key remote peers use: its index never changes, its low 8 bits change with
    /// every bind.
    pub(crate) key: u32,
    pub(crate) bound: Option<Binding>,
}

/// What a bound window reaches.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Binding {
    /// The region's key (exact, so a region registered anew in its slot is not reached).
    pub(crate) mr_key: u32,
    /// The window's first address as remote peers name it (0 when zero-based).
    pub(crate) va: u64,
    pub(crate) len: u64,
    /// The region's address of the window's first byte.
    pub(crate) mr_addr: u64,
    pub(crate) access: Access,
    /// Type 2: the QP it was bound through, the only one that reaches memory through it.
    pub(crate) qpn: u32,
}

/// A decoded BIND_MW request (the WQE's bind segment).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BindReq {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) mw_key: u32,
    pub(crate) new_key: u32,
    pub(crate) mr_key: u32,
    pub(crate) access: u32,
}

/// Window index from a window key.
fn mw_index(key: u32) -> u32 {
    (key & !MW_KEY_BIT) >> 8
}

/// The remote rights a window may carry.
const MW_RIGHTS: u32 = Access::REMOTE_WRITE.bits()
    | Access::REMOTE_READ.bits()
    | Access::REMOTE_ATOMIC.bits()
    | MW_ZERO_BASED;

impl Nic {
    /// ALLOC_MW: a new unbound window; the output is its key.
    pub(crate) fn alloc_mw(&mut self, p: AllocMwIn) -> Result<Vec<u8>, CmdStatus> {
        if self.cfg.max_mw == 0 {
            return Err(CmdStatus::BadOpcode);
        }
        let kind = p.mw_type.get();
        if kind != MW_TYPE_1 && kind != MW_TYPE_2 {
            return Err(CmdStatus::BadParam);
        }
        let pdn = p.pdn.get();
        if self.pds.get(pdn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        self.mr_tag = self.mr_tag.wrapping_add(1);
        let tag = self.mr_tag as u32;
        let idx = self
            .mws
            .insert_with(|idx| Mw {
                pdn,
                type2: kind == MW_TYPE_2,
                key: MW_KEY_BIT | idx << 8 | tag,
                bound: None,
            })
            .ok_or(CmdStatus::Exhausted)?;
        if let Some(pd) = self.pds.get_mut(pdn) {
            pd.refs += 1;
        }
        let key = MW_KEY_BIT | idx << 8 | tag;
        Ok(ObjectOut { num: key.into() }.as_bytes().to_vec())
    }

    /// DEALLOC_MW: `key` names the window by its index (bits 30:8); a bound window is
    /// unbound first.
    pub(crate) fn dealloc_mw(&mut self, key: u32) -> Result<Vec<u8>, CmdStatus> {
        if key & MW_KEY_BIT == 0 || self.mws.get(mw_index(key)).is_none() {
            return Err(CmdStatus::BadResource);
        }
        self.unbind(mw_index(key));
        if let Some(mw) = self.mws.remove(mw_index(key)) {
            if let Some(pd) = self.pds.get_mut(mw.pdn) {
                pd.refs = pd.refs.saturating_sub(1);
            }
        }
        Ok(Vec::new())
    }

    /// Unbinds window `idx`, releasing its region.
    pub(crate) fn unbind(&mut self, idx: u32) {
        let Some(b) = self.mws.get_mut(idx).and_then(|w| w.bound.take()) else {
            return;
        };
        if let Some(mr) = self.mrs.get_mut(key_index(b.mr_key)) {
            mr.mw_refs = mr.mw_refs.saturating_sub(1);
        }
    }

    /// Unbinds every type 2 window bound through QP `qpn` (it is being destroyed, and its
    /// number may name another QP later).
    pub(crate) fn unbind_qp_windows(&mut self, qpn: u32) {
        let idxs: Vec<u32> = self
            .mws
            .iter()
            .filter(|(_, w)| w.type2 && w.bound.is_some_and(|b| b.qpn == qpn))
            .map(|(i, _)| i)
            .collect();
        for i in idxs {
            self.unbind(i);
        }
    }

    /// Executes a BIND_MW of QP `qpn` in PD `pdn`. Every check comes first; a refused bind
    /// changes nothing.
    pub(crate) fn bind_mw(
        &mut self,
        pdn: u32,
        qpn: u32,
        b: &BindReq,
    ) -> Result<(), VendorSyndrome> {
        let idx = mw_index(b.mw_key);
        let mw = self
            .mws
            .get(idx)
            .filter(|_| b.mw_key & MW_KEY_BIT != 0)
            .ok_or(VendorSyndrome::BadMw)?;
        if mw.pdn != pdn {
            return Err(VendorSyndrome::WrongPd);
        }
        // A type 1 window is named by its current key; a type 2 window must be free. The
        // new key keeps the window's index.
        let stale = if mw.type2 {
            mw.bound.is_some()
        } else {
            mw.key != b.mw_key
        };
        if stale || b.new_key & !0xFF != mw.key & !0xFF {
            return Err(VendorSyndrome::BadMw);
        }
        let type2 = mw.type2;
        if b.len == 0 {
            self.unbind(idx);
            if let Some(w) = self.mws.get_mut(idx) {
                w.key = b.new_key;
            }
            return Ok(());
        }
        if b.access & !MW_RIGHTS != 0 {
            return Err(VendorSyndrome::BadSegment);
        }
        let access = Access::from_bits_truncate(b.access);
        self.check_key(pdn, b.mr_key, b.addr, b.len, Access::MW_BIND)
            .map_err(KeyError::syndrome)?;
        let mr = self
            .mrs
            .get(key_index(b.mr_key))
            .ok_or(VendorSyndrome::BadLkey)?;
        if access.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
            && !mr.access.contains(Access::LOCAL_WRITE)
        {
            return Err(VendorSyndrome::NoAccess);
        }
        let binding = Binding {
            mr_key: b.mr_key,
            va: if b.access & MW_ZERO_BASED != 0 {
                0
            } else {
                b.addr
            },
            len: b.len,
            mr_addr: b.addr,
            access,
            qpn: if type2 { qpn } else { 0 },
        };
        self.unbind(idx);
        if let Some(mr) = self.mrs.get_mut(key_index(b.mr_key)) {
            mr.mw_refs += 1;
        }
        if let Some(w) = self.mws.get_mut(idx) {
            w.key = b.new_key;
            w.bound = Some(binding);
        }
        Ok(())
    }

    /// Invalidates the type 2 window `key` for a QP in PD `pdn` (LOCAL_INV). Nothing
    /// changes when it fails.
    pub(crate) fn invalidate(&mut self, pdn: u32, key: u32) -> Result<(), VendorSyndrome> {
        let idx = self.invalidation(pdn, None, key)?;
        self.unbind(idx);
        Ok(())
    }

    /// Whether a QP in PD `pdn` may invalidate the type 2 window `key`: by LOCAL_INV (`qpn`
    /// None), or by a SEND with invalidate received on QP `qpn`, which must be the one the
    /// window was bound through. Returns the window's index.
    pub(crate) fn invalidation(
        &self,
        pdn: u32,
        qpn: Option<u32>,
        key: u32,
    ) -> Result<u32, VendorSyndrome> {
        let idx = mw_index(key);
        let mw = self
            .mws
            .get(idx)
            .filter(|w| key & MW_KEY_BIT != 0 && w.key == key && w.type2)
            .ok_or(VendorSyndrome::BadMw)?;
        let b = mw.bound.ok_or(VendorSyndrome::BadMw)?;
        if mw.pdn != pdn || qpn.is_some_and(|q| q != b.qpn) {
            return Err(VendorSyndrome::WrongPd);
        }
        Ok(idx)
    }

    /// Checks a remote access of `[addr, addr + len)` with `need` through `key`, received on
    /// QP `qpn` in PD `pdn`: a region's key as [`Nic::check_key`] checks it, or a window's.
    /// Returns the IOVA of `addr`.
    #[inline]
    pub(crate) fn check_rkey(
        &self,
        pdn: u32,
        qpn: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<u64, KeyError> {
        if key & MW_KEY_BIT == 0 {
            return self.check_key(pdn, key, addr, len, need);
        }
        self.check_window(pdn, qpn, key, addr, len, need)
    }

    #[cold]
    fn check_window(
        &self,
        pdn: u32,
        qpn: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<u64, KeyError> {
        if len == 0 {
            return Ok(0);
        }
        let mw = self
            .mws
            .get(mw_index(key))
            .filter(|w| w.key == key)
            .ok_or(KeyError::NoSuchKey)?;
        let b = mw.bound.ok_or(KeyError::NoSuchKey)?;
        if mw.pdn != pdn || (mw.type2 && b.qpn != qpn) {
            return Err(KeyError::WrongPd);
        }
        if !b.access.contains(need) {
            return Err(KeyError::NoAccess);
        }
        let off = crate::mem::offset_in(b.va, b.len, addr, len).ok_or(KeyError::OutOfBounds)?;
        // The bytes are the region's: translated as the region's own key would be.
        self.check_key(
            mw.pdn,
            b.mr_key,
            b.mr_addr.wrapping_add(off),
            len,
            Access::empty(),
        )
    }
}
