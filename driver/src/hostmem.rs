//! Caller memory adopted for DMA: registering memory the application allocated itself.
//!
//! A device reaches host memory only through DMA mappings of memory files
//! ([`crate::Port::dma_map`]). To register an arbitrary range of the process (malloc, the
//! stack, an anonymous or file mapping, static data) as `ibv_reg_mr` does,
//! [`ProtectionDomain::reg_user_mr`] *adopts* its pages: the range is rounded to pages
//! `[a, b)`, a memory file of `b - a` bytes is created, the pages' current bytes are copied
//! into it, and the file is moved over `[a, b)` (`mremap` of a temporary `MAP_SHARED`
//! mapping, which replaces the old pages in one step). The program keeps its addresses and
//! its data; the device maps the same file at IOVA `a + `[`HOST_IOVA_OFFSET`]. Read-only
//! pages stay read-only. The pages are checked against `/proc/self/maps` first: a hole, or a
//! page that is not readable, executable, read-only while the device may write it, a shared
//! mapping of another file (its sharing would end) or a kernel mapping (`[vdso]`, `[vvar]`)
//! is refused with [`Error::BadAddress`] (EFAULT) before anything changes.
//!
//! **The calling thread's own memory.** Bytes the calling thread writes into `[a, b)` between
//! the copy and the move would be lost, and a thread always writes its stack. When the range
//! meets the calling thread's stack or thread area (TLS, the thread descriptor), the copy and
//! the move are made by a helper thread while the caller is parked in a `read(2)` on a pipe
//! (the helper waits until `/proc/self/task/<tid>/syscall` shows that read), and every
//! signal is blocked in both threads meanwhile. Other ranges are moved by the calling thread
//! itself, allocation-free and with signals blocked between the copy and the move.
//!
//! **Bookkeeping.** Adopted runs of pages (*extents*) are process-wide, one memory file each,
//! sorted by address. Each device maps whole extents and counts the memory regions that use
//! each of its mappings. A registration inside one extent reuses it (no copy). One that
//! overlaps or spans extents still backing their pages adopts only the pages no extent
//! holds, one new extent per run of them, and uses the extents side by side: they are
//! mapped at IOVA `VA + offset`, so a region across them is contiguous for the device, which
//! translates it page by page (an IOMMU does; so does the emulator's). Nothing adopted is
//! moved again, so work the device has in flight on those pages is undisturbed. Only when an
//! extent no longer backs its pages (the program replaced them while a region still used
//! them) is the union adopted as one new file, copying the current bytes: the old mappings
//! are unmapped from the device and the union mapped in their place, with the sum of their
//! counts. When the last region of a mapping is dropped (after its DEREG_MR) the
//! device unmaps it; when no device maps an extent any more it is forgotten (its pages stay
//! backed by the file, which is harmless). The file's descriptor is kept while an extent
//! lives, so that a second device can map it and a failed merge can be rolled back.
//!
//! **Limitations.**
//! - The copy and the move are not atomic with respect to *other* threads: a write that
//!   another thread makes to the same pages during a registration (to the range or to
//!   neighbouring bytes on its first and last page) can be lost. Register memory whose
//!   pages no other thread writes meanwhile (page-aligned buffers are safe).
//! - A merge (only over pages the program replaced under a live region) while the device
//!   writes into one of the old mappings can lose those writes, and a DMA in that window can
//!   fault: the device sees the new file from the moment it is mapped, before the copy.
//! - A merge that replaces an extent other devices map moves them to the new file too, when
//!   they are devices of this thread (devices are not `Send`, so a device adopts pages on
//!   its own thread). One of another thread cannot be reached from here: such a merge is
//!   refused ([`Error::InvalidArgument`]).
//! - A merge adopts the whole of the runs it joins: if the program has meanwhile unmapped
//!   part of a run (pages whose regions are all gone), the merge is refused as not mapped.
//! - One descriptor stays open per live extent (the device ports take their own copy).
//! - Adopted pages are `MAP_SHARED`: a child of `fork` would share them with its parent
//!   instead of copying them on write; [`crate::fork`] gives the child a copy of its own
//!   (made in the child when it starts, so a page the parent writes at that moment may be
//!   copied half-written, as a page a device writes during a fork may be on hardware).
//! - IOVAs are `VA + HOST_IOVA_OFFSET`: on an IOMMU with 48 address bits this covers the
//!   47-bit user address space of x86-64; an address above 2^47 (5-level paging, 52-bit
//!   Arm) needs an IOMMU with more bits, or the device refuses the mapping.

use crate::device::{DevInner, Device};
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain};
use nix::errno::Errno;
use nix::libc;
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::mman::{mmap, mprotect, munmap, MapFlags, ProtFlags};
use ringbell_specs::cmd::Access;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Added to a virtual address to make the IOVA at which adopted memory is mapped.
///
/// 2^47: x86-64 user addresses (4-level paging) are below it, so adopted IOVAs fall in
/// `[2^47, 2^48)`, which a 48-bit IOMMU (VT-d and AMD-Vi with 4-level tables, SMMUv3 with a
/// 48-bit input size) can map, and never meet the IOVAs the driver allocates for its own
/// buffers, which start at 4 GiB and are kept below this offset.
pub const HOST_IOVA_OFFSET: u64 = 1 << 47;

/// How long the helper thread waits to see the calling thread parked.
const PARK_TIMEOUT: Duration = Duration::from_secs(10);

/// Name of adopted memory files (`/memfd:ringbell-host` in `/proc/self/maps`).
const FILE_NAME: &std::ffi::CStr = c"ringbell-host";

/// The system page size (a multiple of 4 KiB).
fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a system constant; it has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p)
            .ok()
            .filter(|p| p.is_power_of_two() && *p >= 4096)
            .unwrap_or(4096)
    })
}

/// The IOVA of adopted address `va`.
pub(crate) fn iova(va: usize) -> u64 {
    va as u64 + HOST_IOVA_OFFSET
}

/// A run of adopted pages `[start, end)`: one memory file, mapped over them in place.
#[derive(Debug)]
struct Extent {
    end: usize,
    file: File,
    /// The file's inode, to recognise its mapping in `/proc/self/maps`.
    ino: u64,
    /// Devices that map it.
    devices: usize,
}

/// Every extent of the process, by start address; none overlap.
static EXTENTS: Mutex<BTreeMap<usize, Extent>> = Mutex::new(BTreeMap::new());

/// One device's mappings of extents, by start address, each with the number of memory
/// regions that use it.
#[derive(Debug, Default)]
pub(crate) struct HostRegions(RefCell<BTreeMap<usize, Region>>);

#[derive(Debug)]
struct Region {
    end: usize,
    mrs: usize,
}

/// The adopted pages one memory region uses: its count on each of the device's mappings it
/// lies in, given back on drop (which unmaps a mapping when it was the last).
#[derive(Debug)]
pub(crate) struct AdoptedPages {
    dev: Device,
    /// A page of the region in each mapping it uses (each inside the mapping that covers
    /// it, merges included; a merge sums the counts, so a mapping two of them lie in after
    /// one counts the region twice).
    pages: Vec<usize>,
    /// The caller's bytes `[start, end)` the pages were adopted for.
    range: (usize, usize),
}

impl Drop for AdoptedPages {
    fn drop(&mut self) {
        let mut extents = EXTENTS.lock().unwrap_or_else(PoisonError::into_inner);
        for &page in &self.pages {
            release(&self.dev, &mut extents, page);
        }
    }
}

/// Gives back one count on the device's mapping that holds `page`, unmapping it (and
/// forgetting its extent when no device maps it any more) when it was the last.
fn release(dev: &Device, extents: &mut BTreeMap<usize, Extent>, page: usize) {
    let mut regions = dev.inner.host.0.borrow_mut();
    let Some((&start, r)) = regions.range_mut(..=page).next_back() else {
        return;
    };
    debug_assert!(page < r.end);
    r.mrs -= 1;
    if r.mrs > 0 {
        return;
    }
    let end = r.end;
    regions.remove(&start);
    let _ = dev.inner.port.dma_unmap(iova(start), (end - start) as u64);
    if let Some(e) = extents.get_mut(&start) {
        e.devices -= 1;
        if e.devices == 0 {
            extents.remove(&start);
        }
    }
}

/// `s` clipped to `[lo, hi)`.
fn clip(s: &Segment, lo: usize, hi: usize) -> Segment {
    let start = s.start.max(lo);
    Segment {
        start,
        end: s.end.min(hi),
        offset: s.offset + (start - s.start) as u64,
        ..s.clone()
    }
}

/// The segments of `segs` (sorted, adjacent) that meet `[lo, hi)`, clipped to it.
fn within(segs: &[Segment], lo: usize, hi: usize) -> Vec<Segment> {
    segs.iter()
        .filter(|g| g.start < hi && g.end > lo)
        .map(|g| clip(g, lo, hi))
        .collect()
}

impl ProtectionDomain {
    /// Registers `len` bytes of this process's memory at `addr` (malloc, the stack, an
    /// anonymous or file mapping, static data), as `ibv_reg_mr` does; the region's address
    /// (what SGEs and remote peers use) is `mr_addr` — `addr as u64` for the usual
    /// virtual-address region, anything else as `ibv_reg_mr_iova2` allows.
    ///
    /// The pages holding the range are *adopted*: replaced in place by a memory file with
    /// the same bytes at the same addresses, and that file mapped for the device at IOVA
    /// `page + `[`HOST_IOVA_OFFSET`] (a range on the calling thread's own stack is moved by
    /// a helper thread while this one is parked in `read(2)`). Registrations that share
    /// pages share the device mappings of those pages: one that overlaps adopted pages
    /// without lying inside them adopts only the pages around them (the program replacing
    /// adopted pages under a live region is the exception: then the union is adopted anew,
    /// and a device writing into the old pages meanwhile can lose those writes). The region keeps its pages mapped for the device until it is dropped
    /// (after its DEREG_MR); the pages stay file-backed afterwards.
    ///
    /// Errors: [`Error::InvalidArgument`] for `len == 0`, a range that wraps, or one whose
    /// merge would move pages a device of another thread maps;
    /// [`Error::BadAddress`] (EFAULT) when a page of the range is not mapped, not readable,
    /// executable, read-only while `access` lets the device write, a shared mapping (of
    /// another file: its sharing would end) or a kernel mapping (`[vdso]`, `[vvar]`);
    /// [`Error::Memory`] and [`Error::Port`] when the memory file or the device mapping
    /// cannot be made.
    ///
    /// # Safety
    ///
    /// The caller owns `[addr, addr + len)` and keeps it mapped (not unmapped, remapped or
    /// freed to the system) while the region lives, and accepts that the pages holding it
    /// are remapped in place: no other thread may write to those pages, the neighbouring
    /// bytes on the first and last page included, during the call (their writes could be
    /// lost). After `fork` the child gets a copy of the pages, as of the fork ([`crate::fork`]).
    pub unsafe fn reg_user_mr(
        &self,
        addr: *mut u8,
        len: usize,
        mr_addr: u64,
        access: Access,
    ) -> Result<MemoryRegion, Error> {
        let (start, end) = user_range(addr, len, mr_addr)?;
        let pages = adopt(&self.dev, start, end, device_writes(access))?;
        let mut mr = self.reg_mr_raw(mr_addr, len as u64, iova(start), access)?;
        mr.host = Some(pages);
        Ok(mr)
    }
}

impl MemoryRegion {
    /// `ibv_rereg_mr` of a region of this process's memory: [`MemoryRegion::rereg_raw`]
    /// with `pd`, `access` and, for `range` `(addr, len, mr_addr)`, the pages of
    /// `[addr, addr + len)` adopted first, as [`ProtectionDomain::reg_user_mr`] adopts them
    /// (with its errors, and nothing changed). A region that becomes writable has its
    /// pages checked for writing again. The pages the region leaves are given back after
    /// the device has taken the change.
    ///
    /// # Safety
    ///
    /// As [`ProtectionDomain::reg_user_mr`], for the new range.
    pub unsafe fn rereg_user(
        &mut self,
        pd: Option<&ProtectionDomain>,
        range: Option<(*mut u8, usize, u64)>,
        access: Option<Access>,
    ) -> Result<(), Error> {
        let write = device_writes(access.unwrap_or(self.access()));
        let (pages, r) = match range {
            Some((addr, len, mr_addr)) => {
                let (start, end) = user_range(addr, len, mr_addr)?;
                let pages = adopt(&self.dev, start, end, write)?;
                (Some(pages), Some((mr_addr, len as u64, iova(start))))
            }
            // The same pages, now for writing: checked (and held) again.
            None if write && !device_writes(self.access()) => match &self.host {
                Some(h) => (Some(adopt(&self.dev, h.range.0, h.range.1, true)?), None),
                None => (None, None),
            },
            None => (None, None),
        };
        self.rereg_raw(&crate::mr::Rereg {
            pd,
            access,
            range: r,
        })?;
        if let Some(p) = pages {
            self.host = Some(p);
        }
        Ok(())
    }
}

/// Adopts the pages of `len` bytes at `addr` for memory of a queue the caller allocated
/// (see [`crate::QueueAllocator`]), writable by the device, as a registration would: the
/// device maps them at `iova(addr)` until the result is dropped.
///
/// # Safety
/// As [`ProtectionDomain::reg_user_mr`], for `[addr, addr + len)`.
pub(crate) unsafe fn adopt_queue(
    dev: &Device,
    addr: *mut u8,
    len: usize,
) -> Result<AdoptedPages, Error> {
    let (start, end) = user_range(addr, len, addr as u64)?;
    adopt(dev, start, end, true)
}

/// Whether a region with `access` lets the device write its pages.
fn device_writes(access: Access) -> bool {
    access.intersects(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
}

/// The bytes `[start, end)` of a registration of `len` bytes at `addr` with region address
/// `mr_addr`, or why there are none: a length of 0, or a range that wraps.
fn user_range(addr: *mut u8, len: usize, mr_addr: u64) -> Result<(usize, usize), Error> {
    if len == 0 {
        return Err(Error::InvalidArgument("memory region of length 0"));
    }
    let start = addr as usize;
    let end = start
        .checked_add(len)
        .ok_or(Error::InvalidArgument("address + length wraps"))?;
    if mr_addr.checked_add(len as u64).is_none() {
        return Err(Error::InvalidArgument(
            "region address + length wraps 64 bits",
        ));
    }
    Ok((start, end))
}

/// An EFAULT-class error for the registration of `[start, end)`.
fn bad(start: usize, end: usize, reason: String) -> Error {
    Error::BadAddress {
        addr: start as u64,
        len: (end - start) as u64,
        reason,
    }
}

thread_local! {
    /// The devices of this thread that have adopted pages (devices are not `Send`, so a
    /// device's pages are adopted on its thread): a merge of extents moves every one of them
    /// that maps a merged extent to the new file.
    static DEVICES: RefCell<Vec<std::rc::Weak<DevInner>>> = const { RefCell::new(Vec::new()) };
}

/// Notes `dev` among this thread's devices (once).
fn note_device(dev: &Device) {
    DEVICES.with(|all| {
        let mut all = all.borrow_mut();
        all.retain(|w| w.strong_count() > 0);
        if !all
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Rc::as_ptr(&dev.inner)))
        {
            all.push(Rc::downgrade(&dev.inner));
        }
    });
}

/// This thread's devices other than `dev` that map one of the extents starting at `over`.
fn devices_mapping(dev: &Device, over: &[usize]) -> Vec<Rc<DevInner>> {
    DEVICES.with(|all| {
        all.borrow()
            .iter()
            .filter_map(std::rc::Weak::upgrade)
            .filter(|d| !Rc::ptr_eq(d, &dev.inner))
            .filter(|d| d.host.0.borrow().keys().any(|k| over.contains(k)))
            .collect()
    })
}

/// Adopts the pages of `[start, end)` for `dev` (`write`: the device may write them).
fn adopt(dev: &Device, start: usize, end: usize, write: bool) -> Result<AdoptedPages, Error> {
    let page = page_size();
    let a = start - start % page;
    let b = end
        .checked_next_multiple_of(page)
        .ok_or(Error::InvalidArgument("address + length wraps"))?;
    if (b as u64).checked_add(HOST_IOVA_OFFSET).is_none() {
        return Err(bad(start, end, "above the device's address space".into()));
    }
    note_device(dev);
    let mut extents = EXTENTS.lock().unwrap_or_else(PoisonError::into_inner);
    // The extents that overlap the pages, highest first.
    let over: Vec<usize> = extents
        .range(..b)
        .rev()
        .take_while(|(_, e)| e.end > a)
        .map(|(s, _)| *s)
        .collect();
    // The mappings of `[lo, hi)`, each checked (for writing where it meets `[a, b)`).
    let checked = |lo: usize, hi: usize| -> Result<Vec<Segment>, Error> {
        let segs = segments(lo, hi).map_err(|r| bad(start, end, r))?;
        for s in &segs {
            s.check(write && s.start < b && s.end > a)
                .map_err(|r| bad(start, end, format!("{r} (page {:#x})", s.start)))?;
        }
        Ok(segs)
    };
    // Pages inside or over extents still holding their pages: the extents are used as they
    // are, only the pages between them (and around them) are adopted, a new extent each,
    // and the region uses the mappings side by side (IOVA is VA + offset, so they are
    // contiguous for the device). Nothing adopted moves: work the device has in flight on
    // those pages is undisturbed.
    let segs = checked(a, b)?;
    let intact = over.iter().all(|&s| {
        let e = &extents[&s];
        backs(&within(&segs, s.max(a), e.end.min(b)), s, e.ino)
    });
    if intact {
        return adopt_between(dev, &mut extents, &over, (a, b), &segs, (start, end));
    }
    // Otherwise (an extent no longer holds its pages: the program replaced them under a
    // live region) adopt the union of the pages and the extents they overlap, for this device
    // and for every other device of this thread that maps one of those extents: each is
    // moved to the new file with it.
    let ua = over.last().map_or(a, |&s| s.min(a));
    let ub = over.first().map_or(b, |s| extents[s].end.max(b));
    let segs = checked(ua, ub)?;
    let peers = devices_mapping(dev, &over);
    // Every mapping of those extents must be reachable (a device of another thread is not).
    let maps = |d: &DevInner, s: &usize| d.host.0.borrow().contains_key(s);
    if over.iter().any(|s| {
        usize::from(maps(&dev.inner, s)) + peers.iter().filter(|p| maps(p, s)).count()
            != extents[s].devices
    }) {
        return Err(Error::InvalidArgument(
            "the range overlaps pages adopted for a device of another thread and does not \
             lie inside them",
        ));
    }
    let involved: Vec<(&DevInner, Vec<usize>)> = std::iter::once(&*dev.inner)
        .chain(peers.iter().map(|p| &**p))
        .map(|d| (d, over.iter().copied().filter(|s| maps(d, s)).collect()))
        .collect();
    let len = ub - ua;
    let file = new_file(len)?;
    let ino = file
        .metadata()
        .map_err(|e| Error::Memory(e.to_string()))?
        .ino();
    // The devices first (they can be put back as they were), then the program's pages.
    let restore = |unmapped: &[(&DevInner, usize)]| {
        for (d, s) in unmapped {
            let e = &extents[s];
            let _ = d.port.dma_map(e.file.as_fd(), (e.end - s) as u64, iova(*s));
        }
    };
    let mut unmapped: Vec<(&DevInner, usize)> = Vec::new();
    for (d, starts) in &involved {
        for s in starts {
            if let Err(e) = d.port.dma_unmap(iova(*s), (extents[s].end - s) as u64) {
                restore(&unmapped);
                return Err(e.into());
            }
            unmapped.push((d, *s));
        }
    }
    let unmap_new = |n: usize| {
        for (d, _) in &involved[..n] {
            let _ = d.port.dma_unmap(iova(ua), len as u64);
        }
    };
    for (i, (d, _)) in involved.iter().enumerate() {
        if let Err(e) = d.port.dma_map(file.as_fd(), len as u64, iova(ua)) {
            unmap_new(i);
            restore(&unmapped);
            return Err(e.into());
        }
    }
    if let Err(e) = transplant(ua, len, &file, &segs) {
        unmap_new(involved.len());
        restore(&unmapped);
        return Err(e);
    }
    for (i, (d, starts)) in involved.iter().enumerate() {
        let mut regs = d.host.0.borrow_mut();
        // This device's new region counts the registration being made.
        let mut mrs = usize::from(i == 0);
        for s in starts {
            mrs += regs.remove(s).map_or(0, |r| r.mrs);
        }
        regs.insert(ua, Region { end: ub, mrs });
    }
    for s in &over {
        extents.remove(s);
    }
    extents.insert(
        ua,
        Extent {
            end: ub,
            file,
            ino,
            devices: involved.len(),
        },
    );
    Ok(AdoptedPages {
        dev: dev.clone(),
        pages: vec![a],
        range: (start, end),
    })
}

/// Counts one more region on `dev`'s mapping of extent `s`, mapping the extent for `dev`
/// first if it does not map it yet. [`release`] gives the count back.
fn count_on(dev: &Device, extents: &mut BTreeMap<usize, Extent>, s: usize) -> Result<(), Error> {
    let mut regs = dev.inner.host.0.borrow_mut();
    if let Some(r) = regs.get_mut(&s) {
        r.mrs += 1;
        return Ok(());
    }
    let e = extents
        .get_mut(&s)
        .ok_or(Error::InvalidArgument("no adopted pages there"))?;
    dev.inner
        .port
        .dma_map(e.file.as_fd(), (e.end - s) as u64, iova(s))?;
    regs.insert(s, Region { end: e.end, mrs: 1 });
    e.devices += 1;
    Ok(())
}

/// Adopts the pages of `[a, b)` that none of the extents `over` (highest first; each still
/// holding its pages) holds, one new extent per run, and counts a region over all of them
/// on `dev`'s mappings (a range inside one extent adopts nothing). `segs`: the checked
/// segments of `[a, b)`. A failure gives back every count taken (runs already moved stay
/// file-backed, as forgotten extents do).
fn adopt_between(
    dev: &Device,
    extents: &mut BTreeMap<usize, Extent>,
    over: &[usize],
    (a, b): (usize, usize),
    segs: &[Segment],
    range: (usize, usize),
) -> Result<AdoptedPages, Error> {
    let mut gaps = Vec::new();
    let mut at = a;
    for &s in over.iter().rev() {
        if s > at {
            gaps.push((at, s));
        }
        at = at.max(extents[&s].end);
    }
    if at < b {
        gaps.push((at, b));
    }
    let mut pages = Vec::new();
    let mut step = |extents: &mut BTreeMap<usize, Extent>, r: Result<usize, Error>| match r {
        Ok(page) => {
            pages.push(page);
            Ok(())
        }
        Err(e) => {
            for &p in &pages {
                release(dev, extents, p);
            }
            Err(e)
        }
    };
    // The extents first (a count is given back as easily as taken), then the runs between
    // them (moving pages cannot be undone).
    for &s in over {
        let r = count_on(dev, extents, s).map(|()| s);
        step(extents, r)?;
    }
    for &(ga, gb) in &gaps {
        let r = adopt_run(dev, extents, ga, gb, &within(segs, ga, gb)).map(|()| ga);
        step(extents, r)?;
    }
    Ok(AdoptedPages {
        dev: dev.clone(),
        pages,
        range,
    })
}

/// Adopts the pages `[ga, gb)` (segments `segs`) as a new extent mapped by `dev`, counting
/// one region on it.
fn adopt_run(
    dev: &Device,
    extents: &mut BTreeMap<usize, Extent>,
    ga: usize,
    gb: usize,
    segs: &[Segment],
) -> Result<(), Error> {
    let len = gb - ga;
    let file = new_file(len)?;
    let ino = file
        .metadata()
        .map_err(|e| Error::Memory(e.to_string()))?
        .ino();
    let port = &dev.inner.port;
    port.dma_map(file.as_fd(), len as u64, iova(ga))?;
    if let Err(e) = transplant(ga, len, &file, segs) {
        let _ = port.dma_unmap(iova(ga), len as u64);
        return Err(e);
    }
    dev.inner
        .host
        .0
        .borrow_mut()
        .insert(ga, Region { end: gb, mrs: 1 });
    extents.insert(
        ga,
        Extent {
            end: gb,
            file,
            ino,
            devices: 1,
        },
    );
    Ok(())
}

/// Records that the memory files with these inodes were replaced by copies (old, new) in a
/// child of `fork` ([`crate::fork`]), so that the extents they back are recognised by their
/// new inodes. Nothing changes if the table is held (by a thread the fork did not copy).
pub(crate) fn renamed(pairs: &[(u64, u64)]) {
    let mut extents = match EXTENTS.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    for e in extents.values_mut() {
        if let Some(&(_, new)) = pairs.iter().find(|(old, _)| *old == e.ino) {
            e.ino = new;
        }
    }
}

/// A zero-filled memory file of `len` bytes (sealable, as a vfio-user server requires).
fn new_file(len: usize) -> Result<File, Error> {
    crate::fork::install();
    let fd = memfd_create(
        FILE_NAME,
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .map_err(|e| Error::Memory(format!("memfd_create: {e}")))?;
    let file = File::from(fd);
    file.set_len(len as u64)
        .map_err(|e| Error::Memory(format!("sizing a memory file to {len:#x} bytes: {e}")))?;
    Ok(file)
}

/// Whether every segment maps file `ino` at the offset that puts its byte 0 at `start`.
fn backs(segs: &[Segment], start: usize, ino: u64) -> bool {
    segs.iter()
        .all(|s| s.shared && s.inode == ino && s.offset == (s.start - start) as u64)
}

/// One line of `/proc/self/maps`, clipped to the range asked about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) read: bool,
    pub(crate) write: bool,
    exec: bool,
    pub(crate) shared: bool,
    /// File offset of `start`.
    pub(crate) offset: u64,
    pub(crate) inode: u64,
    pub(crate) name: String,
}

impl Segment {
    /// Parses a line of `/proc/self/maps`.
    pub(crate) fn parse(line: &str) -> Option<Segment> {
        let mut f = line.splitn(6, ' ');
        let (range, perms, offset, _dev, inode) =
            (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
        let name = f.next().unwrap_or("").trim_start().to_string();
        let (s, e) = range.split_once('-')?;
        let p = perms.as_bytes();
        if p.len() < 4 {
            return None;
        }
        Some(Segment {
            start: usize::from_str_radix(s, 16).ok()?,
            end: usize::from_str_radix(e, 16).ok()?,
            read: p[0] == b'r',
            write: p[1] == b'w',
            exec: p[2] == b'x',
            shared: p[3] == b's',
            offset: u64::from_str_radix(offset, 16).ok()?,
            inode: inode.parse().ok()?,
            name,
        })
    }

    /// Why these pages cannot be adopted (`write`: the device may write them), if so.
    fn check(&self, write: bool) -> Result<(), String> {
        let special = self.name.starts_with('[')
            && !(self.name == "[heap]"
                || self.name.starts_with("[stack")
                || self.name.starts_with("[anon:"));
        if special {
            return Err(format!("a kernel mapping ({})", self.name));
        }
        if !self.read {
            return Err("not readable".into());
        }
        if self.exec {
            return Err("executable".into());
        }
        if self.shared && !self.name.starts_with("/memfd:ringbell-host") {
            return Err(format!(
                "a shared mapping of {:?} (adopting it would end its sharing)",
                self.name
            ));
        }
        if self.name.contains("anon_hugepage") {
            return Err(HUGE_PAGES.into());
        }
        if write && !self.write {
            return Err("read-only, and the device may write the region".into());
        }
        Ok(())
    }
}

/// Why pages of a huge-page mapping (`MAP_HUGETLB`) cannot be adopted: a memory file of
/// normal pages cannot take their place.
pub(crate) const HUGE_PAGES: &str = "huge pages";

/// Whether `[addr, addr + len)` is mapped in this process and readable, and writable too
/// if `write` (`/proc/self/maps`, read only as far as the range): for libraries that copy
/// to or from memory an application names and must refuse what is not memory.
pub fn is_mapped(addr: usize, len: usize, write: bool) -> bool {
    let Some(end) = addr.checked_add(len).filter(|_| addr != 0) else {
        return false;
    };
    segments(addr, end).is_ok_and(|segs| segs.iter().all(|s| s.read && (!write || s.write)))
}

/// The mappings that cover `[a, b)`, clipped to it; an error names the first hole. Reads
/// `/proc/self/maps` only as far as `b`.
fn segments(a: usize, b: usize) -> Result<Vec<Segment>, String> {
    use std::io::BufRead;
    let maps = File::open("/proc/self/maps").map_err(|e| format!("/proc/self/maps: {e}"))?;
    let mut failed = None;
    let lines = std::io::BufReader::new(maps)
        .lines()
        .map_while(|l| l.map_err(|e| failed = Some(e)).ok());
    let r = segments_in(lines, a, b);
    match failed {
        Some(e) => Err(format!("reading /proc/self/maps: {e}")),
        None => r,
    }
}

/// [`segments`] over the lines of a maps file.
fn segments_in(
    lines: impl Iterator<Item = impl AsRef<str>>,
    a: usize,
    b: usize,
) -> Result<Vec<Segment>, String> {
    let mut out = Vec::new();
    let mut at = a;
    for mut s in lines.filter_map(|l| Segment::parse(l.as_ref())) {
        if s.end <= at {
            continue;
        }
        if s.start >= b {
            break;
        }
        if s.start > at {
            break;
        }
        s.offset += (at - s.start) as u64;
        s.start = at;
        s.end = s.end.min(b);
        at = s.end;
        out.push(s);
        if at == b {
            return Ok(out);
        }
    }
    Err(format!("not mapped at {at:#x}"))
}

/// Copies `[at, at + len)` into `file` and moves the file over it, keeping read-only
/// segments read-only.
fn transplant(at: usize, len: usize, file: &File, segs: &[Segment]) -> Result<(), Error> {
    let size = NonZeroUsize::new(len).ok_or(Error::InvalidArgument("empty range"))?;
    // SAFETY: a new shared mapping of our own memory file at an address the kernel chooses;
    // it overlaps nothing, and only `Plan::execute` or the munmap below touch it.
    let tmp = unsafe {
        mmap(
            None,
            size,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            file,
            0,
        )
    }
    .map_err(|e| Error::Memory(format!("mapping a memory file of {len:#x} bytes: {e}")))?;
    let plan = Plan {
        at,
        len,
        tmp: tmp.as_ptr() as usize,
        readonly: segs
            .iter()
            .filter(|s| !s.write)
            .map(|s| (s.start, s.end - s.start))
            .collect(),
    };
    let outcome = if meets_current_thread(at, at + len) {
        plan.execute_parked()
    } else {
        let _blocked = SignalsBlocked::new();
        // SAFETY: `[at, at + len)` is mapped and readable (checked against /proc/self/maps
        // under the extents lock), `tmp` is ours; this thread writes nothing in the range
        // (it meets neither its stack nor its thread area, and `execute` allocates
        // nothing); no signal handler runs here; other threads are the caller's contract.
        match unsafe { plan.execute() } {
            Ok(()) => Outcome::Done,
            Err(e) => Outcome::Failed(e),
        }
    };
    let fail = |why: String| {
        // SAFETY: the move did not happen, so `tmp` is still our mapping of `len` bytes.
        let _ = unsafe { munmap(tmp, len) };
        Err(Error::Memory(why))
    };
    match outcome {
        Outcome::Done => Ok(()),
        Outcome::Failed(e) => fail(format!(
            "moving a memory file over {at:#x}+{len:#x}: {e} (the memory is unchanged)"
        )),
        Outcome::NotRun(why) => fail(why),
        // Whether `tmp` still exists is unknown: leave it (a leak, not a corruption).
        Outcome::Unknown => Err(Error::Memory(
            "the thread that moves the calling thread's own pages failed".into(),
        )),
    }
}

/// What became of a [`Plan`].
#[derive(Debug)]
enum Outcome {
    /// The pages were copied and the file moved over them.
    Done,
    /// The move failed: the pages are as they were, the temporary mapping still there.
    Failed(Errno),
    /// Nothing was done.
    NotRun(String),
    /// The helper thread died: whether the move happened is unknown.
    Unknown,
}

/// The copy and the move: plain numbers, so that a helper thread can carry it out.
#[derive(Debug)]
struct Plan {
    /// Start of the pages.
    at: usize,
    len: usize,
    /// The temporary mapping of the memory file, `len` bytes.
    tmp: usize,
    /// Segments (start, length) to make read-only again after the move.
    readonly: Vec<(usize, usize)>,
}

impl Plan {
    /// Copies the pages into the temporary mapping and moves it over them. Allocates
    /// nothing and writes no memory but the temporary mapping and its own stack.
    ///
    /// # Safety
    ///
    /// `[at, at + len)` is mapped and readable, `tmp` is a mapping of `len` bytes that
    /// nothing else uses, and no thread writes to `[at, at + len)` during the call.
    unsafe fn execute(&self) -> Result<(), Errno> {
        let (from, to) = (self.at as *const u8, self.tmp as *mut u8);
        // SAFETY: both ranges are mapped (the caller's contract), they are distinct
        // mappings, and nobody writes the source meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(from, to, self.len) };
        if self.tmp == 0 || self.at == 0 {
            return Err(Errno::EINVAL);
        }
        // The move is the raw system call, not libc's `mremap`: a library that interposes
        // `mremap` to watch the program's memory (UCX's memory hooks, which forward only
        // four arguments and so lose the target address of `MREMAP_FIXED`) must neither
        // redirect it nor take it for the program unmapping its own memory, since the
        // program sees the same bytes at the same addresses afterwards.
        // SAFETY: moves our temporary mapping over `[at, at + len)`, replacing the pages it
        // has just copied in one step (a failure leaves both as they were).
        let moved = unsafe {
            libc::syscall(
                libc::SYS_mremap,
                self.tmp,
                self.len,
                self.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                self.at,
            )
        };
        if moved == -1 {
            return Err(Errno::last());
        }
        if moved as usize != self.at {
            // Not possible with MREMAP_FIXED; never report a move that did not happen.
            return Err(Errno::EFAULT);
        }
        for &(s, l) in &self.readonly {
            if let Some(p) = NonNull::new(s as *mut libc::c_void) {
                // SAFETY: `[s, s + l)` is inside the range just moved, which was read-only
                // before: this restores its protection (a failure leaves it writable).
                let _ = unsafe { mprotect(p, l, ProtFlags::PROT_READ) };
            }
        }
        Ok(())
    }

    /// [`Plan::execute`] on a helper thread while this thread is parked in `read(2)`, so
    /// that it writes nothing, not even its stack, between the copy and the move.
    fn execute_parked(self) -> Outcome {
        #[cfg(test)]
        tests::PARKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (rx, tx) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
            Ok(p) => p,
            Err(e) => return Outcome::NotRun(format!("pipe2: {e}")),
        };
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let rfd = rx.as_raw_fd();
        // Blocked before the spawn: the helper inherits the mask, and no handler runs on
        // either thread until both are done.
        let blocked = SignalsBlocked::new();
        let helper = std::thread::Builder::new()
            .name("ringbell-adopt".into())
            .spawn(move || {
                if let Err(why) = wait_parked(tid, rfd) {
                    return Outcome::NotRun(why);
                }
                // SAFETY: the range was checked mapped and readable, `tmp` is the plan's
                // own mapping, and the only thread that writes the range (the caller: its
                // stack or thread area) is parked in the kernel with every signal blocked
                // until `tx` is written or closed, below.
                let r = unsafe { self.execute() };
                let _ = nix::unistd::write(&tx, &[1]);
                match r {
                    Ok(()) => Outcome::Done,
                    Err(e) => Outcome::Failed(e),
                }
            });
        let helper = match helper {
            Ok(h) => h,
            Err(e) => return Outcome::NotRun(format!("spawning a thread: {e}")),
        };
        // Parked: returns when the helper has written the pipe or closed it (it is gone).
        let mut byte = [0u8; 1];
        while let Err(Errno::EINTR) = nix::unistd::read(rfd, &mut byte) {}
        drop(blocked);
        helper.join().unwrap_or(Outcome::Unknown)
    }
}

/// Waits until thread `tid` is blocked in `read(fd, ...)`.
fn wait_parked(tid: libc::pid_t, fd: RawFd) -> Result<(), String> {
    let path = format!("/proc/self/task/{tid}/syscall");
    let deadline = Instant::now() + PARK_TIMEOUT;
    loop {
        let now = std::fs::read_to_string(&path).map_err(|e| {
            format!(
                "the range meets the calling thread's stack, and {path} (which shows when the \
                 thread is parked) cannot be read: {e}"
            )
        })?;
        if parked_in_read(&now, fd) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the calling thread was not seen parked in read({fd}) within {PARK_TIMEOUT:?} \
                 ({path}: {:?})",
                now.trim()
            ));
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Whether a `/proc/<pid>/task/<tid>/syscall` line shows a blocked `read` of `fd`.
fn parked_in_read(line: &str, fd: RawFd) -> bool {
    let mut f = line.split_whitespace();
    let nr = f.next().and_then(|n| n.parse::<i64>().ok());
    let arg0 = f
        .next()
        .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok());
    nr == Some(libc::SYS_read) && arg0 == Some(fd as u64)
}

/// Bytes below the current stack pointer taken as the calling thread's live stack (the
/// frames of the copy and the move, and of the calls they make).
const STACK_MARGIN: usize = 256 << 10;

/// Whether `[a, b)` meets memory the calling thread writes as it runs: its stack, and its
/// thread area (thread descriptor and static TLS, next to the thread pointer).
///
/// The stack is what `pthread_getattr_np` reports, widened to [`STACK_MARGIN`] on either
/// side of the current stack pointer: for the main thread glibc takes the stack's extent from
/// `/proc/self/maps`, where an adopted run of stack pages splits the stack's mapping in two,
/// after which it reports only the part above the run (or, if the run holds the top of the
/// stack, only the run).
#[inline(never)]
fn meets_current_thread(a: usize, b: usize) -> bool {
    let meets = |lo: usize, hi: usize| a < hi && lo < b;
    // SAFETY: pthread_self and __errno_location have no preconditions.
    let (tp, errno) = unsafe {
        (
            libc::pthread_self() as usize,
            libc::__errno_location() as usize,
        )
    };
    let lo = tp.min(errno).saturating_sub(64 << 10);
    let hi = tp.max(errno).saturating_add(8 << 10);
    if meets(lo, hi) {
        return true;
    }
    let probe = 0u8;
    let sp = std::hint::black_box(std::ptr::addr_of!(probe)) as usize;
    match current_stack() {
        Some((lo, hi)) => meets(
            lo.min(sp.saturating_sub(STACK_MARGIN)),
            hi.max(sp.saturating_add(STACK_MARGIN)),
        ),
        // Unknown: take the careful way.
        None => true,
    }
}

/// The calling thread's stack `[lo, hi)`.
fn current_stack() -> Option<(usize, usize)> {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: pthread_getattr_np initialises `attr` for the calling thread when it returns 0.
    if unsafe { libc::pthread_getattr_np(libc::pthread_self(), attr.as_mut_ptr()) } != 0 {
        return None;
    }
    let (mut addr, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: `attr` was initialised above; the out-pointers are valid locals.
    let r = unsafe { libc::pthread_attr_getstack(attr.as_ptr(), &mut addr, &mut size) };
    // SAFETY: `attr` was initialised by pthread_getattr_np and is destroyed once.
    unsafe { libc::pthread_attr_destroy(attr.as_mut_ptr()) };
    (r == 0).then(|| (addr as usize, (addr as usize).saturating_add(size)))
}

/// Every signal blocked on the calling thread until dropped.
struct SignalsBlocked(libc::sigset_t);

impl SignalsBlocked {
    fn new() -> SignalsBlocked {
        let mut all = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        let mut old = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigfillset initialises `all`; pthread_sigmask reads it and writes the
        // previous mask into `old` (it cannot fail with SIG_BLOCK and valid pointers).
        unsafe {
            libc::sigfillset(all.as_mut_ptr());
            libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), old.as_mut_ptr());
            SignalsBlocked(old.assume_init())
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::port::{Port, PortError};
    use memmap2::MmapRaw;
    use nix::sys::mman::mmap_anonymous;
    use ringbell_specs::regs;
    use std::cell::Cell;
    use std::os::fd::BorrowedFd;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Plans carried out by a helper thread (any test's).
    pub(super) static PARKED: AtomicUsize = AtomicUsize::new(0);

    /// A device that completes every command (status OK, zero outputs) and keeps its own
    /// mapping of every memory file it is given, by IOVA.
    #[derive(Default)]
    struct Recorder {
        token: Cell<u32>,
        maps: Rc<RefCell<BTreeMap<u64, MmapRaw>>>,
        /// DMA_MAPs still to refuse.
        refuse: Rc<Cell<u32>>,
    }

    impl Port for Recorder {
        fn read32(&self, offset: u64) -> u32 {
            match offset {
                regs::MAGIC => regs::MAGIC_VALUE,
                regs::ABI_VERSION => ringbell_specs::ABI_VERSION,
                regs::CMD_STATUS => self.token.get(),
                _ => 0,
            }
        }
        fn write32(&self, offset: u64, value: u32) {
            if offset == regs::CMD_DOORBELL {
                self.token.set(value);
            }
        }
        fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError> {
            if self.refuse.get() > 0 {
                self.refuse.set(self.refuse.get() - 1);
                return Err(PortError::MapFailed("refused".into()));
            }
            let map = memmap2::MmapOptions::new()
                .len(len as usize)
                .map_raw(&fd)
                .map_err(|e| PortError::MapFailed(e.to_string()))?;
            let mut maps = self.maps.borrow_mut();
            if maps
                .range(..iova + len)
                .next_back()
                .is_some_and(|(s, m)| s + m.len() as u64 > iova)
            {
                return Err(PortError::Overlap { iova, len });
            }
            maps.insert(iova, map);
            Ok(())
        }
        fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError> {
            let mut maps = self.maps.borrow_mut();
            match maps.get(&iova) {
                Some(m) if m.len() as u64 == len => {
                    maps.remove(&iova);
                    Ok(())
                }
                _ => Err(PortError::NotMapped { iova, len }),
            }
        }
        fn progress(&self) -> bool {
            true
        }
    }

    type Maps = Rc<RefCell<BTreeMap<u64, MmapRaw>>>;

    fn device() -> (Device, Maps) {
        let (dev, maps, _) = refusing_device();
        (dev, maps)
    }

    /// [`device`], with the number of DMA mappings it will refuse next.
    fn refusing_device() -> (Device, Maps, Rc<Cell<u32>>) {
        let port = Recorder::default();
        let (maps, refuse) = (port.maps.clone(), port.refuse.clone());
        (Device::open(Box::new(port)).unwrap(), maps, refuse)
    }

    /// The device's view of `len` bytes at address `va` (through its mapping at VA + offset).
    fn device_view(maps: &Maps, va: usize, len: usize) -> Vec<u8> {
        let iova = iova(va);
        let maps = maps.borrow();
        let (s, m) = maps.range(..=iova).next_back().expect("mapped");
        let off = (iova - s) as usize;
        assert!(off + len <= m.len(), "crosses the end of the mapping");
        let mut out = vec![0u8; len];
        // SAFETY: `off + len` is inside the device's mapping (asserted).
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr().add(off), out.as_mut_ptr(), len) };
        out
    }

    /// Anonymous private pages, unmapped on drop.
    struct Anon(NonNull<libc::c_void>, usize);

    impl Anon {
        fn new(len: usize, prot: ProtFlags) -> Anon {
            // SAFETY: a new private anonymous mapping the kernel places.
            let p = unsafe {
                nix::sys::mman::mmap_anonymous(
                    None,
                    NonZeroUsize::new(len).unwrap(),
                    prot,
                    MapFlags::MAP_PRIVATE,
                )
            }
            .unwrap();
            Anon(p, len)
        }
        fn ptr(&self) -> *mut u8 {
            self.0.as_ptr().cast()
        }
    }

    impl Drop for Anon {
        fn drop(&mut self) {
            // SAFETY: our mapping (or what adoption moved over it, same range).
            let _ = unsafe { munmap(self.0, self.1) };
        }
    }

    /// The line of /proc/self/maps that covers `addr`.
    fn map_of(addr: usize) -> Segment {
        segments(addr, addr + 1).unwrap().remove(0)
    }

    #[test]
    fn maps_lines_parse_and_clip() {
        let maps = "1000-3000 rw-p 00000000 00:00 0 \n\
                    3000-5000 r--s 00002000 00:01 77                         /memfd:ringbell-host (deleted)\n\
                    6000-7000 r-xp 00000000 08:01 12 /usr/lib/a b.so\n";
        let s = segments_in(maps.lines(), 0x2000, 0x4000).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            (s[0].start, s[0].end, s[0].offset),
            (0x2000, 0x3000, 0x1000)
        );
        assert!(s[0].read && s[0].write && !s[0].shared && s[0].name.is_empty());
        assert_eq!(
            (s[1].start, s[1].end, s[1].offset),
            (0x3000, 0x4000, 0x2000)
        );
        assert!(s[1].shared && !s[1].write && s[1].inode == 77);
        assert_eq!(s[1].name, "/memfd:ringbell-host (deleted)");
        assert!(s[1].check(false).is_ok());
        assert!(s[1].check(true).unwrap_err().contains("read-only"));
        assert_eq!(
            segments_in(maps.lines(), 0x4000, 0x6800).unwrap_err(),
            "not mapped at 0x5000"
        );
        assert_eq!(
            segments_in(maps.lines(), 0x0, 0x1000).unwrap_err(),
            "not mapped at 0x0"
        );
        let x = segments_in(maps.lines(), 0x6000, 0x7000).unwrap();
        assert_eq!(x[0].name, "/usr/lib/a b.so");
        assert_eq!(x[0].check(false).unwrap_err(), "executable");
        let v = Segment::parse("7ffd-7fff r--p 00000000 00:00 0 [vvar]").unwrap();
        assert!(v.check(false).unwrap_err().contains("[vvar]"));
        let h = Segment::parse("1-2 rw-p 00000000 00:00 0 [heap]").unwrap();
        assert!(h.check(true).is_ok());
    }

    #[test]
    fn a_parked_read_is_recognised() {
        let nr = libc::SYS_read;
        assert!(parked_in_read(
            &format!("{nr} 0x7 0x7ffc00 0x1 0x0 0x0 0x0 0x7ffc 0x7f00\n"),
            7
        ));
        assert!(!parked_in_read(&format!("{nr} 0x8 0x0 0x1\n"), 7));
        assert!(!parked_in_read("running\n", 7));
        assert!(!parked_in_read("-1 0x7ffc 0x7f00\n", 7));
    }

    #[test]
    fn adopted_pages_keep_their_bytes_and_the_device_sees_the_same_memory() {
        let (dev, maps) = device();
        let pd = dev.alloc_pd().unwrap();
        let mem = Anon::new(4 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
        let p = mem.ptr();
        assert!(!meets_current_thread(p as usize, p as usize + 4 * 4096));
        for i in 0..4 * 4096 {
            // SAFETY: inside our mapping.
            unsafe { p.add(i).write((i % 251) as u8) };
        }
        let before = maps.borrow().len();
        // SAFETY: `mem` is ours, mapped while the region lives, and no other thread uses it.
        let mr = unsafe {
            pd.reg_user_mr(
                p.wrapping_add(100),
                8000,
                p as u64 + 100,
                Access::LOCAL_WRITE,
            )
        }
        .unwrap();
        assert_eq!((mr.addr(), mr.len()), (p as u64 + 100, 8000));
        assert_eq!(maps.borrow().len(), before + 1);
        let m = map_of(p as usize);
        assert!(
            m.shared && m.name.starts_with("/memfd:ringbell-host"),
            "{m:?}"
        );
        // The program's bytes, all of them, kept; the two pages are one mapping.
        let mut now = vec![0u8; 4 * 4096];
        // SAFETY: inside our mapping.
        unsafe { std::ptr::copy_nonoverlapping(p, now.as_mut_ptr(), now.len()) };
        assert!(now.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        assert_eq!(device_view(&maps, p as usize, 8192), now[..8192]);
        // The third page was not adopted.
        assert!(!map_of(p as usize + 8192).shared);
        // Writes from either side are seen by the other.
        // SAFETY: inside our mapping.
        unsafe { p.add(5).write(0xAB) };
        assert_eq!(device_view(&maps, p as usize + 5, 1), [0xAB]);
        drop(mr);
        assert_eq!(maps.borrow().len(), before);
        assert!(EXTENTS.lock().unwrap().get(&(p as usize)).is_none());
        // Still the program's memory, still writable.
        // SAFETY: inside our mapping.
        unsafe { p.add(6).write(0xCD) };
        // SAFETY: inside our mapping.
        assert_eq!(unsafe { (p.add(5).read(), p.add(6).read()) }, (0xAB, 0xCD));
    }

    #[test]
    fn a_buffer_on_the_callers_stack_is_adopted_while_the_caller_is_parked() {
        let (dev, maps) = device();
        let pd = dev.alloc_pd().unwrap();
        let mut buf = [0u8; 3000];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = i as u8 ^ 0x5A;
        }
        let p = buf.as_mut_ptr();
        assert!(meets_current_thread(p as usize, p as usize + 1));
        let parked = PARKED.load(Ordering::Relaxed);
        // SAFETY: `buf` lives until the end of the test, after the region.
        let mr = unsafe { pd.reg_user_mr(p, buf.len(), p as u64, Access::LOCAL_WRITE) }.unwrap();
        assert!(
            PARKED.load(Ordering::Relaxed) > parked,
            "not moved by a helper"
        );
        // The frames of this thread survived (we are still running), and so did the bytes.
        let want: Vec<u8> = (0..3000).map(|i| i as u8 ^ 0x5A).collect();
        assert_eq!(std::hint::black_box(&buf)[..], want[..]);
        assert_eq!(device_view(&maps, p as usize, 3000), want);
        let m = map_of(p as usize);
        assert!(m.name.starts_with("/memfd:ringbell-host"), "{m:?}");
        buf[7] = 7;
        assert_eq!(device_view(&maps, p as usize + 7, 1), [7]);
        drop(mr);
        std::hint::black_box(&mut buf)[8] = 8;
        assert_eq!(buf[7..9], [7, 8]);
    }

    #[test]
    fn overlapping_registrations_share_mappings_and_adopt_only_new_pages() {
        for first_dropped in [0, 1] {
            let (dev, maps) = device();
            let pd = dev.alloc_pd().unwrap();
            let mem = Anon::new(8 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
            let (p, base) = (mem.ptr(), mem.ptr() as usize);
            let before = maps.borrow().len();
            // SAFETY: `mem` is ours and outlives the regions.
            let a = unsafe { pd.reg_user_mr(p.wrapping_add(4096), 8192, 0, Access::empty()) };
            let first = map_of(base + 4096);
            // SAFETY: as above.
            let b = unsafe { pd.reg_user_mr(p.wrapping_add(10000), 9000, 0, Access::empty()) };
            let mrs = [a.unwrap(), b.unwrap()];
            // Pages 1 and 2 are the first region's, adopted once and not moved again
            // (the same file backs them); pages 3 and 4 are a new run of their own.
            assert_eq!(map_of(base + 4096).inode, first.inode);
            assert_ne!(map_of(base + 3 * 4096).inode, first.inode);
            assert_eq!(maps.borrow().len(), before + 2);
            let len_at = |va: usize| maps.borrow().get(&iova(va)).map(|m| m.len());
            assert_eq!(len_at(base + 4096), Some(2 * 4096));
            assert_eq!(len_at(base + 3 * 4096), Some(2 * 4096));
            let regs = dev.inner.host.0.borrow();
            assert_eq!(regs[&(base + 4096)].mrs, 2);
            assert_eq!(regs[&(base + 3 * 4096)].mrs, 1);
            drop(regs);
            // A third inside the first run: no new file, no new mapping.
            // SAFETY: as above.
            let c = unsafe { pd.reg_user_mr(p.wrapping_add(8192), 10, 0, Access::empty()) };
            assert_eq!(dev.inner.host.0.borrow()[&(base + 4096)].mrs, 3);
            assert_eq!(maps.borrow().len(), before + 2);
            drop(c);
            // SAFETY: inside `mem`.
            unsafe { p.add(4096 * 2 + 1).write(9) };
            // SAFETY: inside `mem`.
            unsafe { p.add(4096 * 4 + 1).write(8) };
            assert_eq!(device_view(&maps, base + 4096 * 2 + 1, 1), [9]);
            assert_eq!(device_view(&maps, base + 4096 * 4 + 1, 1), [8]);
            let [x, y] = mrs;
            let (gone, kept) = if first_dropped == 0 { (x, y) } else { (y, x) };
            drop(gone);
            // Dropping the first leaves both runs to the second; dropping the second
            // leaves the first run only.
            let left = if first_dropped == 0 { 2 } else { 1 };
            assert_eq!(maps.borrow().len(), before + left);
            assert_eq!(device_view(&maps, base + 4096 * 2 + 1, 1), [9]);
            drop(kept);
            assert_eq!(maps.borrow().len(), before);
            assert!(dev.inner.host.0.borrow().is_empty());
        }
    }

    #[test]
    fn memory_that_cannot_be_adopted_is_refused_and_left_alone() {
        let (dev, maps) = device();
        let pd = dev.alloc_pd().unwrap();
        let before = maps.borrow().len();
        // Unmapped: page 1 is below mmap_min_addr. (A hole punched into a mapping of this
        // test could be filled by another test's mapping meanwhile.)
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(0x1000 as *mut u8, 100, 0x1000, Access::empty()) };
        match r {
            Err(Error::BadAddress { addr, len, reason }) => {
                assert_eq!((addr, len), (0x1000, 100));
                assert!(reason.contains("not mapped at 0x1000"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // Readable memory running into memory that is not: nothing adopted.
        let mem = Anon::new(3 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
        let p = mem.ptr();
        // SAFETY: changes the protection of the last page of our own mapping.
        unsafe {
            mprotect(
                NonNull::new(p.add(8192).cast()).unwrap(),
                4096,
                ProtFlags::PROT_NONE,
            )
        }
        .unwrap();
        // SAFETY: `mem` is ours.
        unsafe { p.write(1) };
        // SAFETY: the registration fails before touching anything.
        let r = unsafe { pd.reg_user_mr(p, 3 * 4096, p as u64, Access::empty()) };
        assert!(
            matches!(&r, Err(Error::BadAddress { reason, .. }) if reason.contains("not readable")),
            "{r:?}"
        );
        assert!(!map_of(p as usize).shared, "the readable part was adopted");
        // Not readable.
        let none = Anon::new(4096, ProtFlags::PROT_NONE);
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(none.ptr(), 10, 0, Access::empty()) };
        assert!(
            matches!(&r, Err(Error::BadAddress { reason, .. }) if reason.contains("not readable")),
            "{r:?}"
        );
        // Read-only memory for a region the device may write; fine for one it only reads.
        let ro = Anon::new(4096, ProtFlags::PROT_READ);
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(ro.ptr(), 10, 0, Access::LOCAL_WRITE) };
        assert!(matches!(r, Err(Error::BadAddress { .. })), "{r:?}");
        // SAFETY: `ro` is ours and outlives the region.
        let mr = unsafe { pd.reg_user_mr(ro.ptr(), 10, 0, Access::REMOTE_READ) }.unwrap();
        let m = map_of(ro.ptr() as usize);
        assert!(
            m.shared && !m.write,
            "read-only pages stay read-only: {m:?}"
        );
        drop(mr);
        // Length 0, wrapping ranges.
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(p, 0, 0, Access::empty()) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(usize::MAX as *mut u8, 2, 0, Access::empty()) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(p, 10, u64::MAX - 5, Access::empty()) };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        // A shared mapping of another file (the driver's own DMA memory).
        let dma = dev.alloc_dma(4096).unwrap();
        let shared = MmapRaw::map_raw(&dma.mem().fd().unwrap()).unwrap();
        // SAFETY: refused before any access.
        let r = unsafe { pd.reg_user_mr(shared.as_mut_ptr(), 10, 0, Access::empty()) };
        assert!(
            matches!(&r, Err(Error::BadAddress { reason, .. }) if reason.contains("shared")),
            "{r:?}"
        );
        drop(dma);
        assert_eq!(maps.borrow().len(), before);
    }

    #[test]
    fn new_pages_the_device_refuses_are_rolled_back() {
        let (dev, maps, refuse) = refusing_device();
        let pd = dev.alloc_pd().unwrap();
        let mem = Anon::new(4 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
        let (p, base) = (mem.ptr(), mem.ptr() as usize);
        // SAFETY: inside `mem`.
        unsafe { p.add(4100).write(0x31) };
        // SAFETY: `mem` is ours and outlives the regions.
        let m1 = unsafe { pd.reg_user_mr(p, 8192, 0, Access::LOCAL_WRITE) }.unwrap();
        let before = map_of(base);
        refuse.set(1);
        // SAFETY: as above.
        let r = unsafe { pd.reg_user_mr(p.wrapping_add(4096), 8192, 0, Access::LOCAL_WRITE) };
        assert!(matches!(r, Err(Error::Port(_))), "{r:?}");
        assert_eq!(refuse.get(), 0);
        // The program's pages and the device's mapping are as they were.
        assert_eq!(map_of(base).inode, before.inode);
        assert!(!map_of(base + 8192).shared);
        assert_eq!(maps.borrow().get(&iova(base)).map(|m| m.len()), Some(8192));
        // SAFETY: inside `mem`.
        unsafe { p.add(4101).write(0x32) };
        assert_eq!(device_view(&maps, base + 4100, 2), [0x31, 0x32]);
        // SAFETY: as above.
        let m2 =
            unsafe { pd.reg_user_mr(p.wrapping_add(4096), 8192, 0, Access::LOCAL_WRITE) }.unwrap();
        // The first run as it was, and the new page beside it.
        assert_eq!(maps.borrow().get(&iova(base)).map(|m| m.len()), Some(8192));
        assert_eq!(
            maps.borrow().get(&iova(base + 8192)).map(|m| m.len()),
            Some(4096)
        );
        assert_eq!(map_of(base).inode, before.inode);
        assert_eq!(device_view(&maps, base + 4100, 2), [0x31, 0x32]);
        drop((m1, m2));
        assert!(maps.borrow().get(&iova(base)).is_none());
    }

    #[test]
    fn a_region_inside_a_run_needs_only_its_own_pages_usable() {
        let (dev, maps) = device();
        let pd = dev.alloc_pd().unwrap();
        let mem = Anon::new(3 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
        let (p, base) = (mem.ptr(), mem.ptr() as usize);
        // SAFETY: `mem` is ours; page 2 is closed below only after its region is gone.
        let m1 = unsafe { pd.reg_user_mr(p, 3 * 4096, 0, Access::LOCAL_WRITE) }.unwrap();
        // SAFETY: as above.
        let m2 = unsafe { pd.reg_user_mr(p, 100, 0, Access::LOCAL_WRITE) }.unwrap();
        drop(m1);
        // SAFETY: page 2 is ours and no region uses it any more.
        unsafe {
            mprotect(
                NonNull::new(p.add(8192).cast()).unwrap(),
                4096,
                ProtFlags::PROT_NONE,
            )
        }
        .unwrap();
        // SAFETY: as above.
        let m3 =
            unsafe { pd.reg_user_mr(p.wrapping_add(4096), 100, 0, Access::LOCAL_WRITE) }.unwrap();
        assert_eq!(dev.inner.host.0.borrow()[&base].mrs, 2);
        drop((m2, m3));
        assert!(maps.borrow().get(&iova(base)).is_none());
    }

    /// A run whose pages the program replaced while a region still used them no longer
    /// backs them: a registration over it adopts the union anew, with the program's
    /// current bytes, and the device sees the same memory as the program.
    #[test]
    fn pages_replaced_under_a_region_are_adopted_anew_with_the_union() {
        let (dev, maps) = device();
        let pd = dev.alloc_pd().unwrap();
        let mem = Anon::new(3 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
        let (p, base) = (mem.ptr(), mem.ptr() as usize);
        // SAFETY: `mem` is ours and outlives the regions.
        let m1 = unsafe { pd.reg_user_mr(p, 8192, 0, Access::LOCAL_WRITE) }.unwrap();
        let first = map_of(base).inode;
        // The program maps fresh private pages over page 1 (a contract the region's owner
        // breaks, but a registration must still see the memory as it is now).
        // SAFETY: page 1 of our own mapping, replaced by an anonymous page.
        unsafe {
            mmap_anonymous(
                NonZeroUsize::new(base + 4096),
                NonZeroUsize::new(4096).unwrap(),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED,
            )
        }
        .unwrap();
        // SAFETY: inside `mem`.
        unsafe { p.add(4096 + 5).write(0x42) };
        // SAFETY: as above.
        let m2 = unsafe { pd.reg_user_mr(p, 3 * 4096, 0, Access::LOCAL_WRITE) }.unwrap();
        assert_ne!(map_of(base).inode, first);
        assert_eq!(map_of(base).inode, map_of(base + 8192).inode);
        assert_eq!(
            maps.borrow().get(&iova(base)).map(|m| m.len()),
            Some(3 * 4096)
        );
        assert_eq!(device_view(&maps, base + 4096 + 5, 1), [0x42]);
        assert_eq!(dev.inner.host.0.borrow()[&base].mrs, 2);
        drop((m1, m2));
        assert!(maps.borrow().get(&iova(base)).is_none());
    }

    #[test]
    fn a_second_device_maps_the_same_file_and_new_pages_beside_it() {
        let (d1, m1) = device();
        let (d2, m2) = device();
        let (pd1, pd2) = (d1.alloc_pd().unwrap(), d2.alloc_pd().unwrap());
        let mem = Anon::new(4 * 4096, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
        let (p, base) = (mem.ptr(), mem.ptr() as usize);
        // SAFETY: `mem` is ours and outlives the regions.
        let a = unsafe { pd1.reg_user_mr(p, 8192, 0, Access::LOCAL_WRITE) }.unwrap();
        // SAFETY: as above.
        let b =
            unsafe { pd2.reg_user_mr(p.wrapping_add(4000), 100, 0, Access::LOCAL_WRITE) }.unwrap();
        // SAFETY: inside `mem`.
        unsafe { p.add(4050).write(0x77) };
        assert_eq!(device_view(&m1, base + 4050, 1), [0x77]);
        assert_eq!(device_view(&m2, base + 4050, 1), [0x77]);
        let first = map_of(base).inode;
        // A range of device 2 reaching past the shared run: the run stays as it is, mapped
        // by both devices; the page past it is a run of its own, mapped by device 2.
        // SAFETY: inside `mem`, which outlives the region.
        let c =
            unsafe { pd2.reg_user_mr(p.wrapping_add(4096), 8192, 0, Access::LOCAL_WRITE) }.unwrap();
        {
            let ex = EXTENTS.lock().unwrap();
            assert_eq!((ex[&base].devices, ex[&base].end), (2, base + 8192));
            assert_eq!(
                (ex[&(base + 8192)].devices, ex[&(base + 8192)].end),
                (1, base + 3 * 4096)
            );
        }
        assert_eq!(map_of(base).inode, first);
        // SAFETY: inside `mem`.
        unsafe { p.add(9000).write(0x55) };
        assert_eq!(device_view(&m2, base + 9000, 1), [0x55]);
        assert!(m1.borrow().get(&iova(base + 8192)).is_none());
        for m in [&m1, &m2] {
            assert_eq!(device_view(m, base + 4050, 1), [0x77], "kept");
        }
        drop(a);
        assert_eq!(device_view(&m2, base + 4050, 1), [0x77]);
        drop((b, c));
        assert!(EXTENTS.lock().unwrap().get(&base).is_none());
        assert!(EXTENTS.lock().unwrap().get(&(base + 8192)).is_none());
    }
}
