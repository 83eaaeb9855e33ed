//! Host memory behind an IOMMU: the driver's memory files, mapped a second time on the device
//! side at driver-chosen IOVAs. Every device access is translated and bounds-checked; an
//! address outside every mapping is a fault, never a touch. An access may run from one
//! mapping into the next when the two are adjacent in IOVA space, as a hardware IOMMU
//! translates page by page: the driver maps runs of adopted pages separately and registers
//! regions across them.

use memmap2::MmapRaw;
use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;
use ringbell::PortError;
use ringbell_model::DmaFault;
use std::cell::Cell;
use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;

/// Largest single mapping accepted (64 GiB: more is absurd for an emulated host).
pub const MAX_MAPPING: u64 = 1 << 36;

/// A mapped file: (device, inode).
type FileId = (u64, u64);

#[derive(Debug)]
struct Mapping {
    len: u64,
    map: MmapRaw,
    /// The mapped file (device, inode), mapped from its offset 0: two mappings of one file
    /// share their pages, at different addresses.
    file: FileId,
}

/// One node's IOMMU.
#[derive(Debug, Default)]
pub struct Iommu {
    /// Mappings by IOVA, sorted, none overlapping.
    maps: Vec<(u64, Mapping)>,
    /// The mapping the last translation hit (tried first: DMA comes in runs).
    last: Cell<usize>,
    /// On-demand paging ([`Iommu::map_process`]): IOVAs from this offset on, for
    /// [`PROCESS_SPAN`] bytes, are this process's virtual addresses, reached when used.
    process: Option<u64>,
}

/// Bytes of the process's address space an on-demand window covers: the user half of
/// x86-64's 4-level paging.
pub const PROCESS_SPAN: u64 = 1 << 47;

/// Reads one byte of every page of `[va, va + len)` of this process, up to 1024 pages a
/// call; the address of the first page that cannot be read, if any.
fn probe(va: usize, len: usize) -> Result<(), usize> {
    const PAGE: usize = 4096;
    const BATCH: usize = 1024;
    let first = va & !(PAGE - 1);
    let pages = (va + len - first).div_ceil(PAGE);
    let mut sink = [0u8; BATCH];
    let mut remote = [RemoteIoVec { base: 0, len: 1 }; BATCH];
    let mut done = 0;
    while done < pages {
        let n = (pages - done).min(BATCH);
        for (i, r) in remote[..n].iter_mut().enumerate() {
            r.base = (first + (done + i) * PAGE).max(va);
        }
        let got = process_vm_readv(
            Pid::this(),
            &mut [IoSliceMut::new(&mut sink[..n])],
            &remote[..n],
        )
        .unwrap_or(0);
        if got < n {
            return Err(remote[got].base);
        }
        done += n;
    }
    Ok(())
}

impl Iommu {
    /// Maps `len` bytes of memory file `fd` at `iova`.
    pub fn map(&mut self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
        let end = iova
            .checked_add(len)
            .ok_or(PortError::Overlap { iova, len })?;
        if len == 0 || len > MAX_MAPPING || !iova.is_multiple_of(4096) {
            return Err(PortError::MapFailed(format!(
                "bad mapping {iova:#x}+{len:#x}"
            )));
        }
        // The first mapping starting at or after `end`; the one before it must end by `iova`.
        let at = self.maps.partition_point(|(s, _)| *s < end);
        if let Some((s, m)) = at.checked_sub(1).map(|i| &self.maps[i]) {
            if s + m.len > iova {
                return Err(PortError::Overlap { iova, len });
            }
        }
        let file = File::from(
            fd.try_clone_to_owned()
                .map_err(|e| PortError::MapFailed(e.to_string()))?,
        );
        let meta = file
            .metadata()
            .map_err(|e| PortError::MapFailed(e.to_string()))?;
        let flen = meta.len();
        if flen < len {
            return Err(PortError::MapFailed(format!(
                "file holds {flen} bytes, {len} requested"
            )));
        }
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(&file)
            .map_err(|e| PortError::MapFailed(e.to_string()))?;
        let file = (meta.dev(), meta.ino());
        self.maps.insert(at, (iova, Mapping { len, map, file }));
        Ok(())
    }

    /// Removes every mapping (the client that made them is gone); returns how many there were.
    pub fn clear(&mut self) -> usize {
        let n = self.maps.len();
        self.maps.clear();
        self.last.set(0);
        self.process = None;
        n
    }

    /// Opens the on-demand window: IOVA `offset + va` reaches this process's virtual address
    /// `va` (below [`PROCESS_SPAN`]) when the device uses it, through `process_vm_readv(2)`
    /// and `process_vm_writev(2)` on the process itself, so a page that is not mapped (or
    /// not writable, for a write) is a DMA fault, never a crash. Memory-file mappings at
    /// the same IOVAs (adopted pages) are found first; they are the same memory. Only for
    /// a device in the process whose memory it is: the in-process emulator.
    pub fn map_process(&mut self, offset: u64) {
        self.process = Some(offset);
    }

    /// The process address of `[iova, iova + len)` in the on-demand window, if it lies there.
    fn process_addr(&self, iova: u64, len: usize) -> Option<usize> {
        let off = self.process?;
        let va = iova.checked_sub(off)?;
        let end = va.checked_add(len as u64)?;
        (end <= PROCESS_SPAN).then_some(va as usize)
    }

    /// Removes the mapping that starts at `iova` with length `len`.
    pub fn unmap(&mut self, iova: u64, len: u64) -> Result<(), PortError> {
        match self.maps.binary_search_by_key(&iova, |(s, _)| *s) {
            Ok(i) if self.maps[i].1.len == len => {
                self.maps.remove(i);
                self.last.set(0);
                Ok(())
            }
            _ => Err(PortError::NotMapped { iova, len }),
        }
    }

    /// Pointer and remaining length for `[iova, iova + len)` if one mapping covers it.
    fn translate(&self, iova: u64, len: usize) -> Result<*mut u8, DmaFault> {
        self.locate(iova, len).map(|(p, _)| p)
    }

    /// [`Iommu::translate`], with the mapped file and the offset of `iova` in it.
    fn locate(&self, iova: u64, len: usize) -> Result<(*mut u8, (FileId, u64)), DmaFault> {
        let hit = |i: usize| {
            self.maps
                .get(i)
                .filter(|(s, m)| iova >= *s && iova - s < m.len)
        };
        let (start, m) = match hit(self.last.get()) {
            Some(e) => e,
            None => {
                let i = self
                    .maps
                    .partition_point(|(s, _)| *s <= iova)
                    .checked_sub(1)
                    .ok_or(DmaFault { iova })?;
                self.last.set(i);
                &self.maps[i]
            }
        };
        let off = iova - start;
        if off.checked_add(len as u64).is_none_or(|e| e > m.len) {
            let first_bad = if off >= m.len { iova } else { start + m.len };
            return Err(DmaFault { iova: first_bad });
        }
        // SAFETY: off + len <= m.len, which is inside the live mapping.
        Ok((
            unsafe { m.map.as_mut_ptr().add(off as usize) },
            (m.file, off),
        ))
    }

    /// For `[iova, iova + len)` running across mappings that are adjacent in IOVA space:
    /// checks that they cover it, then calls `each(pointer, length, offset in the range)`
    /// for each piece in order (nothing is called when a byte is not covered; the fault
    /// names the first such byte). The usual access, inside one mapping, is
    /// [`Iommu::locate`]'s.
    #[cold]
    fn spanning(
        &self,
        iova: u64,
        len: usize,
        mut each: impl FnMut(*mut u8, usize, usize),
    ) -> Result<(), DmaFault> {
        self.walk(iova, len, &mut |_, _, _| {})?;
        self.walk(iova, len, &mut each)
    }

    /// [`Iommu::spanning`]'s walk over the pieces, calling `f` as it goes.
    fn walk(
        &self,
        iova: u64,
        len: usize,
        f: &mut dyn FnMut(*mut u8, usize, usize),
    ) -> Result<(), DmaFault> {
        let (mut at, mut done) = (iova, 0usize);
        let mut i = self
            .maps
            .partition_point(|(s, _)| *s <= iova)
            .checked_sub(1)
            .ok_or(DmaFault { iova })?;
        while done < len {
            let (start, m) = self.maps.get(i).ok_or(DmaFault { iova: at })?;
            if at < *start || at - start >= m.len {
                return Err(DmaFault { iova: at });
            }
            let off = at - start;
            let n = ((len - done) as u64).min(m.len - off) as usize;
            // SAFETY: off + n <= m.len, inside the live mapping.
            f(unsafe { m.map.as_mut_ptr().add(off as usize) }, n, done);
            at += n as u64;
            done += n;
            i += 1;
        }
        Ok(())
    }

    /// Checks that the range is mapped. In the on-demand window, that every page of it is
    /// mapped now (a one-byte read of each, so a page the process has not mapped fails
    /// here, before the device acknowledges anything; whether it is writable shows when it
    /// is written).
    pub fn check(&self, iova: u64, len: usize) -> Result<(), DmaFault> {
        match self
            .translate(iova, len)
            .map_err(|_| self.spanning(iova, len, |_, _, _| {}))
        {
            Err(Ok(_)) => Ok(()),
            Err(Err(f)) => match self.process_addr(iova, len) {
                Some(va) if len > 0 => probe(va, len).map_err(|bad| DmaFault {
                    iova: iova + (bad - va) as u64,
                }),
                Some(_) => Ok(()),
                None => Err(f),
            },
            Ok(_) => Ok(()),
        }
    }

    /// Device read.
    pub fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        let p = match self.translate(iova, buf.len()) {
            Ok(p) => p,
            Err(_) => {
                let n = buf.len();
                let out = buf.as_mut_ptr();
                // SAFETY: as below, for each piece (inside its live mapping), into `buf` at
                // the piece's offset (the pieces add up to `buf.len()`).
                let pieces = self.spanning(iova, n, |p, k, at| unsafe {
                    std::ptr::copy_nonoverlapping(p, out.add(at), k)
                });
                let Err(f) = pieces else {
                    return Ok(());
                };
                let va = self.process_addr(iova, buf.len()).ok_or(f)?;
                let n = buf.len();
                let remote = [RemoteIoVec { base: va, len: n }];
                return match process_vm_readv(Pid::this(), &mut [IoSliceMut::new(buf)], &remote) {
                    Ok(k) if k == n => Ok(()),
                    _ => Err(DmaFault { iova }),
                };
            }
        };
        // SAFETY: `p..p+len` is inside a live mapping (translate); `buf` is a separate Rust
        // allocation. The in-process emulator runs in lockstep with the driver, so no store
        // to this memory races with the copy; across processes the bytes are plain data.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// Device write.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<(), DmaFault> {
        let p = match self.translate(iova, data.len()) {
            Ok(p) => p,
            Err(_) => {
                // SAFETY: as below, for each piece (inside its live mapping), from `data` at
                // the piece's offset (the pieces add up to `data.len()`).
                let pieces = self.spanning(iova, data.len(), |p, k, at| unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr().add(at), p, k)
                });
                let Err(f) = pieces else {
                    return Ok(());
                };
                let va = self.process_addr(iova, data.len()).ok_or(f)?;
                let remote = [RemoteIoVec {
                    base: va,
                    len: data.len(),
                }];
                return match process_vm_writev(Pid::this(), &[IoSlice::new(data)], &remote) {
                    Ok(k) if k == data.len() => Ok(()),
                    _ => Err(DmaFault { iova }),
                };
            }
        };
        // SAFETY: as in `read`, with the copy in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// Device-to-device copy (functional mode): `len` bytes from `src_iova` in `src`'s
    /// mappings to `iova` in this IOMMU's, in one copy (through a buffer only when the two
    /// ranges are the same pages of one mapped file).
    pub fn copy_from(
        &self,
        iova: u64,
        src: &Iommu,
        src_iova: u64,
        len: usize,
    ) -> Result<(), DmaFault> {
        let (d, s) = (self.locate(iova, len), src.locate(src_iova, len));
        let (Ok((d, (d_file, d_off))), Ok((s, (s_file, s_off)))) = (d, s) else {
            // The on-demand window, or a range across mappings, at either end: through a
            // buffer, each side as it reads and writes.
            let mut bounce = vec![0u8; len];
            src.read(src_iova, &mut bounce)?;
            return self.write(iova, &bounce);
        };
        // Two mappings of one file are the same pages at different addresses, so an overlap
        // of the two ranges shows in the file offsets, not in the pointers (a memmove would
        // pick its direction from the pointers and smear the data). Such a copy goes through
        // a buffer: the destination gets the source as it was, as a frame would carry it.
        if d_file == s_file && d_off < s_off + len as u64 && s_off < d_off + len as u64 {
            let mut bounce = vec![0u8; len];
            src.read(src_iova, &mut bounce)?;
            return self.write(iova, &bounce);
        }
        // SAFETY: both ranges are inside live mappings (locate). They do not overlap: ranges
        // of different files, or of different parts of one file, are different pages, and
        // one mapping's addresses overlap exactly where its file offsets do. As in `read`,
        // the in-process emulator runs in lockstep with the driver, so no store to this
        // memory races with the copy.
        unsafe { std::ptr::copy_nonoverlapping(s, d, len) };
        Ok(())
    }

    /// Number of live mappings.
    pub fn len(&self) -> usize {
        self.maps.len()
    }

    /// Whether there is no mapping.
    pub fn is_empty(&self) -> bool {
        self.maps.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    use std::os::fd::AsFd;

    fn file(len: u64, fill: u8) -> File {
        let f = File::from(memfd_create(c"iommu-test", MemFdCreateFlag::empty()).unwrap());
        f.set_len(len).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![fill; len as usize], 0).unwrap();
        f
    }

    /// Two mappings side by side in IOVA space are one range for the device; a gap, or the
    /// end of the last mapping, is a fault at its first byte.
    #[test]
    fn accesses_run_across_adjacent_mappings_and_fault_at_a_gap() {
        let mut io = Iommu::default();
        let (a, b, c) = (file(8192, 1), file(4096, 2), file(4096, 3));
        io.map(a.as_fd(), 8192, 0x10000).unwrap();
        io.map(b.as_fd(), 4096, 0x12000).unwrap();
        // A gap of one page, then c.
        io.map(c.as_fd(), 4096, 0x14000).unwrap();
        let mut got = vec![0u8; 200];
        io.read(0x12000 - 100, &mut got).unwrap();
        assert_eq!(&got[..100], &[1; 100][..]);
        assert_eq!(&got[100..], &[2; 100][..]);
        io.write(0x12000 - 4, &[9; 8]).unwrap();
        io.read(0x12000 - 8, &mut got[..16]).unwrap();
        assert_eq!(
            &got[..16],
            &[1, 1, 1, 1, 9, 9, 9, 9, 9, 9, 9, 9, 2, 2, 2, 2]
        );
        io.check(0x10000, 12288).unwrap();
        assert_eq!(io.check(0x10000, 12289), Err(DmaFault { iova: 0x13000 }));
        assert_eq!(
            io.read(0x12ff0, &mut got[..32]),
            Err(DmaFault { iova: 0x13000 })
        );
        assert_eq!(io.write(0x13ff0, &[0; 32]), Err(DmaFault { iova: 0x13ff0 }));
        // Across mappings both ways in a device-to-device copy.
        let mut other = Iommu::default();
        let d = file(4096, 0);
        other.map(d.as_fd(), 4096, 0x40000).unwrap();
        other.copy_from(0x40000, &io, 0x11f00, 512).unwrap();
        let mut back = vec![0u8; 512];
        other.read(0x40000, &mut back).unwrap();
        io.read(0x11f00, &mut got[..]).unwrap();
        let mut want = vec![0u8; 512];
        io.read(0x11f00, &mut want).unwrap();
        assert_eq!(back, want);
        io.copy_from(0x11ff0, &other, 0x40000, 64).unwrap();
    }
}
