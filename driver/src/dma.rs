//! DMA memory: memfd-backed mappings shared with the device.
//!
//! The same memory file can be mapped into a real IOMMU (VFIO), handed to an out-of-process
//! emulator (vfio-user DMA_MAP with the descriptor) or reached in-process. The buffer is never
//! exposed as `&mut [u8]` while the device may write it: all access goes through copies and
//! volatile or atomic loads and stores on the raw mapping.

use crate::Error;
use memmap2::MmapRaw;
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::AsFd;
use std::sync::atomic::{fence, AtomicU8, Ordering};
use std::sync::Arc;

/// The memory a [`DmaMemory`] and its views share.
#[derive(Debug)]
enum Backing {
    /// A memory file of the driver's and its one mapping.
    Own { file: File, map: MmapRaw },
    /// Memory the caller allocated (a parent domain's allocator, see
    /// [`crate::QueueAllocator`]), adopted for the device at the same addresses: its first
    /// byte. The caller keeps it mapped while the buffer lives.
    Caller { addr: usize },
}

/// A zero-filled, memfd-backed buffer: a whole page-aligned memory file, or (for the
/// driver's own rings, see [`crate::device`]'s arena) a range of one.
#[derive(Debug)]
pub struct DmaMemory {
    backing: Arc<Backing>,
    /// Where this buffer starts in the mapping.
    off: usize,
    len: usize,
}

impl DmaMemory {
    /// Allocates `len` bytes (rounded up to 4 KiB).
    pub fn new(len: usize) -> Result<DmaMemory, Error> {
        let len = len
            .max(1)
            .checked_next_multiple_of(4096)
            .filter(|l| *l <= isize::MAX as usize)
            .ok_or_else(|| Error::Memory(format!("{len} bytes is more than can be mapped")))?;
        crate::fork::install();
        // Sealable: an out-of-process device (a vfio-user server) that maps the file seals
        // it against shrinking before it does.
        let fd = memfd_create(
            c"ringbell-dma",
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )
        .map_err(|e| Error::Memory(e.to_string()))?;
        let file = File::from(fd);
        file.set_len(len as u64)
            .map_err(|e| Error::Memory(e.to_string()))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| Error::Memory(e.to_string()))?;
        Ok(DmaMemory {
            backing: Arc::new(Backing::Own { file, map }),
            off: 0,
            len,
        })
    }

    /// `len` bytes of the caller's memory at `addr`, as a buffer.
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory of this process, mapped and not used as Rust memory
    /// for as long as the buffer (and any view of it) lives.
    pub(crate) unsafe fn caller(addr: *mut u8, len: usize) -> DmaMemory {
        DmaMemory {
            backing: Arc::new(Backing::Caller {
                addr: addr as usize,
            }),
            off: 0,
            len,
        }
    }

    /// A view of `len` bytes from `off` of this buffer, sharing its memory file and mapping
    /// (`None` if the range is not inside the buffer).
    pub(crate) fn view(&self, off: usize, len: usize) -> Option<DmaMemory> {
        self.check(off, len).ok()?;
        Some(DmaMemory {
            backing: self.backing.clone(),
            off: self.off + off,
            len,
        })
    }

    /// Where this buffer starts in its memory file.
    pub(crate) fn file_offset(&self) -> usize {
        self.off
    }

    /// The first byte of the buffer in the mapping.
    fn base(&self) -> *mut u8 {
        match &*self.backing {
            // SAFETY: `off` is inside the mapping (a view is checked against its parent when
            // made, and a whole file has offset 0), so the result stays in the same
            // allocation.
            Backing::Own { map, .. } => unsafe { map.as_mut_ptr().add(self.off) },
            // The caller's memory (see `DmaMemory::caller`), `off` inside it as above.
            Backing::Caller { addr } => (addr + self.off) as *mut u8,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: the minimum is one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory file, for mapping into a device (a view's bytes start at
    /// [`DmaMemory::file_offset`] in it); `None` for the caller's memory, which is mapped
    /// for the device when it is adopted.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &*self.backing {
            Backing::Own { file, .. } => Some(file.as_fd()),
            Backing::Caller { .. } => None,
        }
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), Error> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                size: self.len,
            });
        }
        Ok(())
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), Error> {
        self.check(offset, data.len())?;
        // SAFETY: the range is inside the live mapping (checked above); `data` cannot overlap
        // it because the mapping is never handed out as a Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.base().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), Error> {
        self.check(offset, out.len())?;
        // SAFETY: as in `write`; the source is inside the mapping and `out` is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(self.base().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<(), Error> {
        self.check(offset, len)?;
        // SAFETY: the range is inside the live mapping.
        unsafe { std::ptr::write_bytes(self.base().add(offset), byte, len) };
        Ok(())
    }

    /// The first `count` [`BLOCK`]-byte blocks as a ring (`count` a power of two), checked
    /// once per batch so that each block is reached without another check; `None` if they
    /// are not all inside the buffer.
    #[inline(always)]
    pub(crate) fn ring_blocks(&self, count: usize) -> Option<DmaRing<'_>> {
        if !count.is_power_of_two() || count > self.len / BLOCK {
            return None;
        }
        Some(DmaRing {
            ptr: self.base(),
            mask: count - 1,
            _mem: PhantomData,
        })
    }

    /// Reads one byte with acquire ordering (for owner bits the device writes last).
    pub(crate) fn load_acquire(&self, offset: usize) -> u8 {
        debug_assert!(offset < self.len);
        let offset = offset.min(self.len - 1);
        // SAFETY: in bounds; AtomicU8 has the alignment of u8, and the device writes this byte
        // with a single store.
        let a = unsafe { &*(self.base().add(offset) as *const AtomicU8) };
        a.load(Ordering::Acquire)
    }

    /// Writes a little-endian u32 after a release fence (doorbell records).
    pub(crate) fn store_u32_release(&self, offset: usize, v: u32) {
        fence(Ordering::Release);
        let _ = self.write(offset, &v.to_le_bytes());
    }
}

/// Bytes in a [`DmaBlock`].
pub(crate) const BLOCK: usize = 64;

/// A power-of-two number of blocks at the start of a [`DmaMemory`], all inside it.
#[derive(Clone, Copy)]
pub(crate) struct DmaRing<'a> {
    ptr: *mut u8,
    mask: usize,
    _mem: PhantomData<&'a DmaMemory>,
}

impl<'a> DmaRing<'a> {
    /// Block `index` modulo the ring's size.
    #[inline(always)]
    pub(crate) fn block(self, index: usize) -> DmaBlock<'a> {
        DmaBlock {
            // SAFETY: `index & mask < count` and `count * BLOCK <= len` (checked when the ring
            // was made), so the block is inside the live mapping, which `'a` keeps alive.
            ptr: unsafe { self.ptr.add((index & self.mask) * BLOCK) },
            _mem: PhantomData,
        }
    }
}

/// [`BLOCK`] bytes inside a live mapping, written only by copies (never exposed as a slice).
pub(crate) struct DmaBlock<'a> {
    ptr: *mut u8,
    _mem: PhantomData<&'a DmaMemory>,
}

impl DmaBlock<'_> {
    /// Stores `words` as little-endian u64s from byte `8 * W` of the block on (`W + N <= 8`,
    /// checked at compile time).
    #[inline(always)]
    pub(crate) fn write_u64s<const W: usize, const N: usize>(&self, words: [u64; N]) {
        const { assert!(W + N <= BLOCK / 8) };
        let bytes: [[u8; 8]; N] = words.map(u64::to_le_bytes);
        // SAFETY: bytes `8 * W .. 8 * (W + N)` are inside the block (asserted at compile
        // time), which is inside the live mapping; the destination is only reached through
        // raw pointers, so no Rust reference to it exists, and an unaligned store has no
        // alignment requirement.
        unsafe {
            self.ptr
                .add(8 * W)
                .cast::<[[u8; 8]; N]>()
                .write_unaligned(bytes)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_pages_zero_fills_and_checks_bounds() {
        let m = DmaMemory::new(100).unwrap();
        assert_eq!(m.len(), 4096);
        let mut b = [1u8; 16];
        m.read(4080, &mut b).unwrap();
        assert_eq!(b, [0; 16]);
        m.write(10, b"abc").unwrap();
        m.read(10, &mut b[..3]).unwrap();
        assert_eq!(&b[..3], b"abc");
        assert!(matches!(
            m.write(4095, b"xy"),
            Err(Error::OutOfBounds {
                offset: 4095,
                len: 2,
                size: 4096
            })
        ));
        assert!(m.read(usize::MAX, &mut b).is_err());
        assert!(m.fill(4000, 97, 0).is_err());
        assert_eq!(m.load_acquire(11), b'b');
    }

    #[test]
    fn ring_blocks_are_checked_once_and_written_as_words() {
        let m = DmaMemory::new(4096).unwrap();
        assert!(m.ring_blocks(4096 / BLOCK * 2).is_none());
        assert!(m.ring_blocks(3).is_none());
        let ring = m.ring_blocks(4096 / BLOCK).unwrap();
        let b = ring.block(4096 / BLOCK * 5 - 1);
        b.write_u64s::<0, 1>([0x0807_0605_0403_0201]);
        b.write_u64s::<6, 2>([u64::MAX, 0x1122_3344_5566_7788]);
        let mut got = [0u8; BLOCK];
        m.read(4096 - BLOCK, &mut got).unwrap();
        assert_eq!(&got[..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&got[8..48], &[0; 40]);
        assert_eq!(&got[48..56], &[0xFF; 8]);
        assert_eq!(&got[56..], &0x1122_3344_5566_7788u64.to_le_bytes());
    }

    #[test]
    fn the_memory_file_maps_the_same_pages() {
        let m = DmaMemory::new(8192).unwrap();
        m.write(5000, b"shared").unwrap();
        let other = memmap2::MmapOptions::new()
            .len(8192)
            .map_raw(&m.fd().unwrap())
            .unwrap();
        // SAFETY: the second mapping is 8192 bytes long; bytes 5000..5006 are in it.
        let got = unsafe { std::slice::from_raw_parts(other.as_ptr().add(5000), 6) };
        assert_eq!(got, b"shared");
    }

    #[test]
    fn views_share_the_file_and_stay_in_their_range() {
        let m = DmaMemory::new(8192).unwrap();
        let v = m.view(4096, 128).unwrap();
        assert_eq!((v.len(), v.file_offset()), (128, 4096));
        v.write(0, b"arena").unwrap();
        let mut b = [0u8; 5];
        m.read(4096, &mut b).unwrap();
        assert_eq!(&b, b"arena", "a view writes the parent's bytes");
        assert!(v.write(124, b"12345").is_err(), "beyond the view");
        assert!(m.view(8000, 200).is_none(), "beyond the parent");
        let w = v.view(64, 64).unwrap();
        assert_eq!(w.file_offset(), 4096 + 64);
        assert!(v.ring_blocks(2).is_some() && v.ring_blocks(4).is_none());
    }
}
