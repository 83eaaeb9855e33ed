//! Bounce buffers for tagged messages: application memory passed without a descriptor
//! (`desc` NULL, as Open MPI passes it with `mr_mode` 0) is not registered in place for the
//! data the NIC moves; the provider copies it through DMA memory of its own. A tagged
//! receive with such buffers (or with several) gets a bounce buffer of its length when it
//! is posted, since the NIC may match it and write it at any time.
//!
//! Registering application memory in place adopts its pages ([`ringbell::hostmem`]): a later
//! registration that overlaps adopted pages without lying inside them adopts the union
//! anew, and while that happens a device in another process (a served NIC) that reads or
//! writes the old pages can lose its writes or fault (a `GeneralErr` completion). Buffers
//! of an MPI program share pages all the time (two `malloc`s, a send and a receive buffer
//! side by side), and a rendezvous keeps its buffer in use for a round trip, so a send
//! buffer is copied into a bounce buffer the receiver reads from, and a receive reads into
//! a bounce buffer copied out when the read completes. A buffer with a descriptor (a region
//! the application registered) is used in place.

use super::{Errno, State};
use ringbell::{Access, DmaBuffer, MemoryRegion, Sge};

/// DMA memory of the provider, registered in a domain, standing in for application memory.
pub(super) struct Bounce {
    buf: DmaBuffer,
    mr: MemoryRegion,
}

impl Bounce {
    /// The address of the first byte, in the region's address space.
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// One SGE of the first `len` bytes.
    pub fn sge(&self, len: u32) -> Sge {
        Sge {
            addr: self.mr.addr(),
            len,
            lkey: self.mr.lkey(),
        }
    }

    /// Reads the first bytes of the buffer into `out`.
    pub fn read(&self, out: &mut [u8]) -> Result<(), Errno> {
        self.buf.read(0, out).map_err(|_| crate::abi::FI_EIO)
    }

    /// Copies the first `n` bytes out to the application's buffers `sges` (their `addr` is a
    /// process address), in order.
    ///
    /// # Safety
    /// Each SGE names memory of this process, writable for its length.
    pub unsafe fn copy_out(&self, sges: &[Sge], n: u64) -> Result<(), Errno> {
        let mut at = 0usize;
        let n = n as usize;
        for s in sges {
            let l = (s.len as usize).min(n - at);
            if l == 0 {
                break;
            }
            // SAFETY: writable for `s.len >= l` bytes, per the caller; no other reference to
            // that memory is live in this library.
            let out = unsafe { std::slice::from_raw_parts_mut(s.addr as *mut u8, l) };
            self.buf.read(at, out).map_err(|_| crate::abi::FI_EIO)?;
            at += l;
        }
        Ok(())
    }
}

/// Copies `data` to the application's buffers `sges` (their `addr` is a process address),
/// in order, as far as they reach.
///
/// # Safety
/// Each SGE names memory of this process, writable for its length.
pub(super) unsafe fn copy_to_user(sges: &[Sge], data: &[u8]) -> Result<(), Errno> {
    let mut at = 0usize;
    for s in sges {
        let l = (s.len as usize).min(data.len() - at);
        if l == 0 {
            break;
        }
        // SAFETY: writable for `s.len >= l` bytes, per the caller; `l` bytes of `data`
        // from `at` exist; the two do not overlap (`data` is the provider's copy).
        unsafe { std::ptr::copy_nonoverlapping(data[at..].as_ptr(), s.addr as *mut u8, l) };
        at += l;
    }
    Ok(())
}

/// The application's buffers as SGEs of process addresses (lkey 0: for copies only), each
/// checked to be writable memory of this process (`-FI_EINVAL` if not: the data is copied
/// into it when the receive completes).
pub(super) fn user_sges(bufs: &[(usize, usize, usize)]) -> Result<Vec<Sge>, Errno> {
    bufs.iter()
        .filter(|b| b.1 > 0)
        .map(|&(addr, len, _)| {
            if !ringbell::is_mapped(addr, len, true) {
                return Err(crate::abi::FI_EINVAL);
            }
            Ok(Sge {
                addr: addr as u64,
                len: u32::try_from(len).map_err(|_| crate::abi::FI_EMSGSIZE)?,
                lkey: 0,
            })
        })
        .collect()
}

impl State {
    /// A bounce buffer of `len` (> 0) bytes in domain `dom`, which the NIC may write and
    /// peers may read.
    pub(super) fn bounce(&self, dom: usize, len: usize) -> Result<Bounce, Errno> {
        let d = self.domain(dom)?;
        let buf =
            d.pd.device()
                .alloc_dma(len)
                .map_err(|_| crate::abi::FI_ENOMEM)?;
        let mr =
            d.pd.reg_mr_range(&buf, 0, len, Access::LOCAL_WRITE | Access::REMOTE_READ)
                .map_err(|_| crate::abi::FI_ENOMEM)?;
        Ok(Bounce { buf, mr })
    }

    /// A bounce buffer holding a copy of the application's buffers `bufs` (`total` bytes,
    /// > 0).
    ///
    /// # Safety
    /// Each `(address, length, _)` of `bufs` is readable for its length.
    pub(super) unsafe fn bounce_from(
        &self,
        dom: usize,
        bufs: &[(usize, usize, usize)],
        total: usize,
    ) -> Result<Bounce, Errno> {
        // What the application names must be its readable memory (`-FI_EINVAL` if not).
        if bufs
            .iter()
            .any(|&(addr, len, _)| len > 0 && !ringbell::is_mapped(addr, len, false))
        {
            return Err(crate::abi::FI_EINVAL);
        }
        let b = self.bounce(dom, total)?;
        let mut at = 0;
        for &(addr, len, _) in bufs.iter().filter(|b| b.1 > 0) {
            // SAFETY: readable now, per the caller.
            let data = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            b.buf.write(at, data).map_err(|_| crate::abi::FI_ENOMEM)?;
            at += len;
        }
        Ok(b)
    }
}
