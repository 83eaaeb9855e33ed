//! Protection domains and memory regions: keys, bounds and access checks, and the
//! translation from an MR address to an IOVA.

use crate::nic::Nic;
use ringbell_specs::cmd::Access;
use ringbell_specs::cqe::VendorSyndrome;

/// A protection domain.
#[derive(Debug, Default)]
pub(crate) struct Pd {
    /// Objects (MRs, QPs, SRQs) that name this PD.
    pub(crate) refs: u32,
}

/// A memory region: `[va, va + len)` backed by `[iova, iova + len)`.
#[derive(Debug)]
pub(crate) struct Mr {
    pub(crate) pdn: u32,
    pub(crate) key: u32,
    pub(crate) access: Access,
    pub(crate) va: u64,
    pub(crate) len: u64,
    pub(crate) iova: u64,
    /// Counters bound to remote accesses through this MR.
    pub(crate) cntrs: crate::counter::EventCntrs,
}

/// Why a key check failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyError {
    NoSuchKey,
    WrongPd,
    OutOfBounds,
    NoAccess,
}

impl KeyError {
    pub(crate) fn syndrome(self) -> VendorSyndrome {
        match self {
            KeyError::NoSuchKey => VendorSyndrome::BadLkey,
            KeyError::WrongPd => VendorSyndrome::WrongPd,
            KeyError::OutOfBounds => VendorSyndrome::OutOfBounds,
            KeyError::NoAccess => VendorSyndrome::NoAccess,
        }
    }
}

/// MR index from a key: the key is `index << 8 | tag`.
pub(crate) fn key_index(key: u32) -> u32 {
    key >> 8
}

impl Nic {
    /// Checks `[addr, addr + len)` through `key` for PD `pdn` with `need` rights and
    /// returns the IOVA of `addr`. Zero-length ranges are not looked up.
    pub(crate) fn check_key(
        &self,
        pdn: u32,
        key: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<u64, KeyError> {
        if len == 0 {
            return Ok(0);
        }
        let mr = self
            .mrs
            .get(key_index(key))
            .filter(|m| m.key == key)
            .ok_or(KeyError::NoSuchKey)?;
        if mr.pdn != pdn {
            return Err(KeyError::WrongPd);
        }
        if !mr.access.contains(need) {
            return Err(KeyError::NoAccess);
        }
        let off = addr.wrapping_sub(mr.va);
        if addr < mr.va || len > mr.len || off > mr.len - len {
            return Err(KeyError::OutOfBounds);
        }
        Ok(mr.iova.wrapping_add(off))
    }
}
