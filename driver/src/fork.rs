//! `fork(2)` and the memory the driver shares with its devices.
//!
//! DMA memory ([`crate::DmaMemory`]) and adopted caller memory ([`crate::hostmem`]) are
//! `MAP_SHARED` mappings of memory files. A child made by `fork` would inherit them shared,
//! not copied on write as the rest of its memory is: parent and child would then write the
//! same pages. For adopted pages that is the program's own heap or stack (a child's `malloc`
//! corrupts the parent's), and for the driver's rings and command mailbox it means two
//! processes driving one copy of each (an in-process emulator, which `fork` duplicated, then
//! reads one process's commands for the other).
//!
//! So the first memory file the driver makes installs `pthread_atfork` handlers
//! ([`install`]). Before the fork, in the parent, they copy every ringbell memory file the
//! process maps or holds (by name, `memfd:ringbell-*`, in `/proc/self/maps` and
//! `/proc/self/fd`) into a new memory file: the bytes as of the fork. In the child, they map
//! each copy over every mapping of its original, at the same addresses and with the same
//! protection (so the two views of an in-process device still alias), and put it in the
//! place of each descriptor of the original (`dup2`, keeping close-on-exec). The child's
//! first steps must not allocate before that is done: the C library's allocator may keep its
//! state in adopted pages, which are still shared until then; so the copies and the plan are
//! made in the parent, and the child only makes system calls. The parent then closes its
//! copies. The child has what fork gives any other memory, a copy as of the fork, and the
//! parent keeps its own. A child that keeps using a device in this process (the in-process
//! emulator was duplicated with it) drives its own copy. Once a device of the process lives
//! elsewhere (a served emulator, hardware), the driver's own files (rings, mailboxes, DMA
//! buffers: `memfd:ringbell-dma`) are left shared, since that device keeps using the
//! parent's: the child shares the device with its parent, as a child shares a kernel RDMA
//! context, and must not post work or commands on it while the parent does (nothing
//! serializes the two). Registered program memory is copied all the same.
//!
//! What stays shared: a file whose pages lie where the forking thread's calls into fork run
//! (stack memory the program registered, just below the caller of fork): the child runs on
//! them before it could replace them, so they stay shared as before. And, for a moment: the
//! C library's own fork code runs in the child before the handlers and resets its
//! allocator's locks, which may sit in adopted pages (a thread's arena). Copying costs the parent's `fork` a copy of the memory it shares with devices;
//! `posix_spawn` and `vfork`, which run no handlers, cost nothing.

use crate::hostmem::Segment;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::mman::{mmap, MapFlags, ProtFlags};
use std::collections::BTreeMap;
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Once;

/// Whether a device of this process lives elsewhere (hardware, a served emulator): it maps
/// the driver's own memory files, so a child keeps sharing them with it (see the module).
static ELSEWHERE: AtomicBool = AtomicBool::new(false);

/// Records that a device of this process lives in another process or in hardware.
pub(crate) fn device_elsewhere() {
    ELSEWHERE.store(true, Ordering::Relaxed);
}

/// The driver's own memory files (rings, mailboxes, DMA buffers).
const DMA_FILES: &str = "/memfd:ringbell-dma";

/// Stack below the handler's frame that fork's own calls may use.
const BUSY_STACK: usize = 64 << 10;

/// The names the driver gives its memory files start with this (after `/memfd:`).
const PREFIX: &str = "/memfd:ringbell-";

/// Installs the handlers, once per process.
pub(crate) fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers plain functions as the fork handlers; the child's only makes
        // system calls on data prepared before the fork until the shared pages are replaced.
        unsafe { nix::libc::pthread_atfork(Some(before), Some(in_parent), Some(in_child)) };
    });
}

/// The copies made for the fork under way (a leaked `Box<Plan>`, or null).
static PLAN: AtomicPtr<Plan> = AtomicPtr::new(std::ptr::null_mut());

/// What `before` prepared: every allocation it needs is made before the first byte is
/// copied, and nothing is freed until after the fork, so that the copies of adopted heap
/// pages show the allocator's state as the fork leaves it.
struct Plan {
    copies: Vec<Copy>,
    /// A buffer for files that nothing maps.
    buf: Vec<u8>,
}

/// One memory file of ours and its copy.
struct Copy {
    copy: File,
    /// (old, new) inodes.
    inodes: (u64, u64),
    maps: Vec<Segment>,
    fds: Vec<RawFd>,
    size: u64,
}

extern "C" fn before() {
    // Never unwind into the C library's fork.
    let _ = std::panic::catch_unwind(|| {
        let plan = match plan() {
            Ok(p) if !p.copies.is_empty() => p,
            Ok(_) => return,
            Err(e) => {
                eprintln!("ringbell: before fork: cannot copy device memory: {e}");
                return;
            }
        };
        let p = Box::into_raw(plan);
        // SAFETY: just leaked above; only this thread sees it until it is published.
        if let Err(e) = fill(unsafe { &mut *p }) {
            // SAFETY: as above, not published.
            drop(unsafe { Box::from_raw(p) });
            eprintln!("ringbell: before fork: cannot copy device memory: {e}");
            return;
        }
        let old = PLAN.swap(p, Ordering::AcqRel);
        if !old.is_null() {
            // SAFETY: a plan an earlier fork left (its handlers did not run), made by
            // `Box::into_raw` here and no longer reachable from PLAN.
            drop(unsafe { Box::from_raw(old) });
        }
    });
}

extern "C" fn in_parent() {
    let p = PLAN.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !p.is_null() {
        // SAFETY: the plan `before` leaked for this fork, taken out of PLAN; dropping it
        // closes the parent's descriptors of the copies (the child has its own).
        drop(unsafe { Box::from_raw(p) });
    }
}

extern "C" fn in_child() {
    let p = PLAN.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if p.is_null() {
        return;
    }
    // SAFETY: the plan `before` made, inherited from the parent and taken out of PLAN; read
    // only (no allocation) until every copy is in place.
    let plan = unsafe { &*p };
    let mut ok = true;
    for c in &plan.copies {
        ok &= put_in_place(c).is_ok();
    }
    // The shared pages are replaced: allocating is safe again.
    let _ = std::panic::catch_unwind(|| {
        let pairs: Vec<(u64, u64)> = plan.copies.iter().map(|c| c.inodes).collect();
        crate::hostmem::renamed(&pairs);
        if !ok {
            eprintln!("ringbell: after fork, some device memory stays shared with the parent");
        }
    });
    // SAFETY: as above; nothing else refers to the plan.
    drop(unsafe { Box::from_raw(p) });
}

/// Lists every ringbell memory file this process maps or holds and makes an empty copy of
/// each, of its size.
fn plan() -> std::io::Result<Box<Plan>> {
    let mut files: BTreeMap<u64, (String, Vec<Segment>, Vec<RawFd>, u64)> = BTreeMap::new();
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    for s in maps.lines().filter_map(Segment::parse) {
        if s.shared && s.name.starts_with(PREFIX) {
            let f = files.entry(s.inode).or_default();
            f.0.clone_from(&s.name);
            f.3 = f.3.max(s.offset + (s.end - s.start) as u64);
            f.1.push(s);
        }
    }
    for e in std::fs::read_dir("/proc/self/fd")?.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<RawFd>().ok()) else {
            continue;
        };
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        let link = link.to_string_lossy().into_owned();
        if !link.starts_with(PREFIX) {
            continue;
        }
        // SAFETY: a descriptor this process holds (listed just now), borrowed to duplicate it.
        let dup = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned();
        let Ok(meta) = dup.map(File::from).and_then(|f| f.metadata()) else {
            continue;
        };
        let f = files.entry(meta.ino()).or_default();
        if f.0.is_empty() {
            f.0 = link;
        }
        f.3 = f.3.max(meta.len());
        f.2.push(fd);
    }
    // Pages where the forking thread's calls into fork run (below this frame): the child
    // runs its handler on them before it can replace them, so a copy made now would not
    // hold its frames. A file with such pages (stack memory a program registered) stays
    // shared.
    let here = &files as *const _ as usize;
    let busy = here.saturating_sub(BUSY_STACK)..here.saturating_add(4096);
    files.retain(|_, f| !f.1.iter().any(|s| s.start < busy.end && s.end > busy.start));
    // With a device elsewhere, its rings and mailboxes stay the parent's and the device's.
    if ELSEWHERE.load(Ordering::Relaxed) {
        files.retain(|_, f| !f.0.starts_with(DMA_FILES));
    }
    let mut copies = Vec::with_capacity(files.len());
    for (ino, (name, maps, fds, size)) in files {
        let base = name
            .trim_start_matches("/memfd:")
            .trim_end_matches(" (deleted)");
        let cname = std::ffi::CString::new(base).unwrap_or_else(|_| c"ringbell-fork".into());
        let copy = File::from(memfd_create(
            &cname,
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )?);
        copy.set_len(size)?;
        let new = copy.metadata()?.ino();
        copies.push(Copy {
            copy,
            inodes: (ino, new),
            maps,
            fds,
            size,
        });
    }
    Ok(Box::new(Plan {
        copies,
        buf: vec![0; 1 << 16],
    }))
}

/// Copies the bytes: of every mapped range, or of the file where nothing maps it. Makes no
/// allocation.
fn fill(plan: &mut Plan) -> std::io::Result<()> {
    for c in &plan.copies {
        for s in c.maps.iter().filter(|s| s.read) {
            // SAFETY: `[start, end)` is a readable mapping of this process, listed in
            // /proc/self/maps just now; only read, as bytes, for this copy (a device or
            // another thread writing it meanwhile changes which bytes are copied, not their
            // validity).
            let bytes =
                unsafe { std::slice::from_raw_parts(s.start as *const u8, s.end - s.start) };
            c.copy.write_all_at(bytes, s.offset)?;
        }
        if let (true, Some(&fd)) = (c.maps.is_empty(), c.fds.first()) {
            // SAFETY: a descriptor this process holds, borrowed for the reads.
            let src = unsafe { BorrowedFd::borrow_raw(fd) };
            let mut at = 0u64;
            while at < c.size {
                let n = nix::sys::uio::pread(src, &mut plan.buf, at as i64)?;
                if n == 0 {
                    break;
                }
                c.copy.write_all_at(&plan.buf[..n], at)?;
                at += n as u64;
            }
        }
    }
    Ok(())
}

/// In the child: maps the copy over each mapping of the original and puts it in the place of
/// each of its descriptors. System calls only.
fn put_in_place(c: &Copy) -> nix::Result<()> {
    for s in &c.maps {
        let mut prot = ProtFlags::empty();
        if s.read {
            prot |= ProtFlags::PROT_READ;
        }
        if s.write {
            prot |= ProtFlags::PROT_WRITE;
        }
        let (Some(addr), Some(len)) = (
            NonZeroUsize::new(s.start),
            NonZeroUsize::new(s.end - s.start),
        ) else {
            continue;
        };
        // SAFETY: replaces a mapping of ours with a mapping of the copy of its bytes at the
        // same addresses, length and protection: every pointer into it stays valid and
        // reads what it read at the fork.
        unsafe {
            mmap(
                Some(addr),
                len,
                prot,
                MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                c.copy.as_fd(),
                s.offset as i64,
            )?
        };
    }
    for &fd in &c.fds {
        let cloexec = fcntl(fd, FcntlArg::F_GETFD)
            .map(|b| FdFlag::from_bits_truncate(b).contains(FdFlag::FD_CLOEXEC))
            .unwrap_or(true);
        nix::unistd::dup2(c.copy.as_raw_fd(), fd)?;
        if cloexec {
            fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
        }
    }
    Ok(())
}
