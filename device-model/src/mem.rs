//! Protection domains and memory regions: keys, bounds and access checks, and the
//! translation from an MR address to an IOVA.

use crate::env::{DmaFault, Env};
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
    /// The device-memory allocation the region lies in (ABI 1.8), 0 for host memory.
    pub(crate) dm: u32,
    /// Counters bound to remote accesses through this MR.
    pub(crate) cntrs: crate::counter::EventCntrs,
    /// Memory windows bound to it (ABI 1.9).
    pub(crate) mw_refs: u32,
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
        let off = offset_in(mr.va, mr.len, addr, len).ok_or(KeyError::OutOfBounds)?;
        Ok(mr.iova.wrapping_add(off))
    }
}

/// Where `[addr, addr + len)` starts in `[base, base + size)`, if it lies inside it.
pub(crate) fn offset_in(base: u64, size: u64, addr: u64, len: u64) -> Option<u64> {
    let off = addr.wrapping_sub(base);
    (addr >= base && len <= size && off <= size - len).then_some(off)
}

/// Where device memory sits in the model's address space: a region registered over a DM
/// allocation translates to `DM_APERTURE + device address`, which no IOVA reaches (REG_MR
/// and REREG_MR refuse ranges that end above it), so the data paths tell the two apart by
/// the address alone.
pub(crate) const DM_APERTURE: u64 = 1 << 63;

/// One device-memory allocation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DmAlloc {
    /// Device address of its first byte.
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// Memory regions registered over it.
    pub(crate) refs: u32,
}

/// The device's own memory (ABI 1.8): `size` bytes, allocated in pieces by ALLOC_DM, read
/// and written by the host through the BAR0 window and by the NIC through the regions
/// registered over it. The bytes are made when the first allocation is.
#[derive(Debug, Default)]
pub(crate) struct DevMem {
    pub(crate) size: u64,
    bytes: Vec<u8>,
    /// Allocations by number (index + 1).
    allocs: Vec<Option<DmAlloc>>,
}

/// Most allocations at once.
pub(crate) const MAX_DM_ALLOCS: usize = 256;

impl DevMem {
    pub(crate) fn new(size: u64) -> DevMem {
        DevMem {
            size,
            ..Default::default()
        }
    }

    /// Allocation `num`.
    pub(crate) fn get(&self, num: u32) -> Option<&DmAlloc> {
        let i = (num as usize).checked_sub(1)?;
        self.allocs.get(i)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, num: u32) -> Option<&mut DmAlloc> {
        let i = (num as usize).checked_sub(1)?;
        self.allocs.get_mut(i)?.as_mut()
    }

    /// Allocates `len` bytes at a multiple of `align` (a power of two): the lowest gap
    /// between allocations that fits. The bytes are zeroed, so nothing of an earlier user
    /// shows. `None` when no gap fits or every number is taken.
    pub(crate) fn alloc(&mut self, len: u64, align: u64) -> Option<(u32, u64)> {
        if len == 0 || len > self.size {
            return None;
        }
        let mut taken: Vec<(u64, u64)> = self
            .allocs
            .iter()
            .flatten()
            .map(|a| (a.offset, a.offset + a.len))
            .collect();
        taken.sort_unstable();
        let mut at = 0u64;
        for (start, end) in taken.iter().copied().chain([(self.size, self.size)]) {
            let here = at.next_multiple_of(align);
            if here.checked_add(len).is_some_and(|e| e <= start) {
                break;
            }
            at = at.max(end);
        }
        let at = at.next_multiple_of(align);
        if at.checked_add(len).is_none_or(|e| e > self.size) {
            return None;
        }
        let slot = match self.allocs.iter().position(Option::is_none) {
            Some(i) => i,
            None if self.allocs.len() < MAX_DM_ALLOCS => {
                self.allocs.push(None);
                self.allocs.len() - 1
            }
            None => return None,
        };
        if self.bytes.is_empty() {
            self.bytes = vec![0; self.size as usize];
        }
        self.bytes[at as usize..(at + len) as usize].fill(0);
        self.allocs[slot] = Some(DmAlloc {
            offset: at,
            len,
            refs: 0,
        });
        Some((slot as u32 + 1, at))
    }

    /// Frees allocation `num`.
    pub(crate) fn free(&mut self, num: u32) {
        if let Some(a) = (num as usize)
            .checked_sub(1)
            .and_then(|i| self.allocs.get_mut(i))
        {
            *a = None;
        }
    }

    /// The bytes of `[addr, addr + len)` of device memory, if all of it exists.
    fn range(&self, addr: u64, len: usize) -> Option<std::ops::Range<usize>> {
        let end = addr.checked_add(len as u64)?;
        (end <= self.bytes.len() as u64).then_some(addr as usize..end as usize)
    }

    /// A 32-bit load through the BAR0 window; `None` outside the memory (beyond its size,
    /// or before the first allocation made it).
    pub(crate) fn load(&self, addr: u64) -> Option<u32> {
        self.range(addr, 4)
            .map(|r| u32::from_le_bytes(self.bytes[r].try_into().unwrap_or([0; 4])))
    }

    /// A store through the BAR0 window; `false` (nothing stored) outside the memory.
    pub(crate) fn store(&mut self, addr: u64, data: &[u8]) -> bool {
        match self.range(addr, data.len()) {
            Some(r) => {
                self.bytes[r].copy_from_slice(data);
                true
            }
            None => false,
        }
    }

    /// Reads at a model address: device memory for an address in the aperture, else host
    /// memory through the IOMMU.
    pub(crate) fn read(
        &self,
        env: &mut dyn Env,
        iova: u64,
        buf: &mut [u8],
    ) -> Result<(), DmaFault> {
        if iova < DM_APERTURE {
            return env.dma_read(iova, buf);
        }
        let r = self
            .range(iova - DM_APERTURE, buf.len())
            .ok_or(DmaFault { iova })?;
        buf.copy_from_slice(&self.bytes[r]);
        Ok(())
    }

    /// Writes at a model address (see [`DevMem::read`]).
    pub(crate) fn write(
        &mut self,
        env: &mut dyn Env,
        iova: u64,
        data: &[u8],
    ) -> Result<(), DmaFault> {
        if iova < DM_APERTURE {
            return env.dma_write(iova, data);
        }
        let r = self
            .range(iova - DM_APERTURE, data.len())
            .ok_or(DmaFault { iova })?;
        self.bytes[r].copy_from_slice(data);
        Ok(())
    }

    /// Checks a model address range (see [`DevMem::read`]).
    pub(crate) fn check(&self, env: &dyn Env, iova: u64, len: usize) -> Result<(), DmaFault> {
        if iova < DM_APERTURE {
            return env.dma_check(iova, len);
        }
        self.range(iova - DM_APERTURE, len)
            .map(|_| ())
            .ok_or(DmaFault { iova })
    }
}
