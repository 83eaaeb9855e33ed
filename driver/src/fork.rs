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
//! made in the parent, and the child only makes system calls, reading what to do from a
//! private anonymous mapping of their own (the heap may be adopted memory, still shared,
//! where the parent frees the plan and goes on allocating while the child works). The copies
//! are filled last, so that nothing changes memory between them and the fork: a heap arena
//! may be partly adopted (copied) and partly not (forked), and the two must agree. The
//! parent then closes its copies. The child has what fork gives any other memory, a copy as of the fork, and the
//! parent keeps its own. A child that keeps using a device in this process (the in-process
//! emulator was duplicated with it) drives its own copy. Once a device of the process lives
//! elsewhere (a served emulator, hardware), the driver's own files (rings, mailboxes, DMA
//! buffers: `memfd:ringbell-dma`) are left shared, since that device keeps using the
//! parent's: the child shares the device with its parent, as a child shares a kernel RDMA
//! context. Their commands and vfio-user exchanges take turns through a lock they share
//! ([`crate::vfio::SharedLock`]), as the kernel serializes a shared context's commands;
//! posting to one queue from both at once is theirs to avoid, as on hardware. Registered
//! program memory is copied all the same.
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
use nix::sys::mman::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};
use std::collections::BTreeMap;
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::ptr::NonNull;
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
    /// The original's name, for a report.
    name: String,
    /// (old, new) inodes.
    inodes: (u64, u64),
    maps: Vec<Segment>,
    fds: Vec<RawFd>,
    size: u64,
}

extern "C" fn before() {
    // Never unwind into the C library's fork.
    let _ = std::panic::catch_unwind(|| {
        // A plan an earlier fork left (its handlers did not run) goes with its steps.
        free(
            PLAN.swap(std::ptr::null_mut(), Ordering::AcqRel),
            STEPS.swap(std::ptr::null_mut(), Ordering::AcqRel),
        );
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
        let plan = unsafe { &mut *p };
        // The steps are written first: `fill` must be the last thing before the fork that
        // changes memory, so that a copy of the heap shows the allocator's state at the fork
        // (a heap arena may be partly adopted memory, copied, and partly not, forked).
        let steps = match steps(plan) {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: as above, not published.
                drop(unsafe { Box::from_raw(p) });
                eprintln!("ringbell: before fork: cannot copy device memory: {e}");
                return;
            }
        };
        if let Err(e) = fill(plan) {
            free(p, steps.as_ptr());
            eprintln!("ringbell: before fork: cannot copy device memory: {e}");
            return;
        }
        PLAN.store(p, Ordering::Release);
        STEPS.store(steps.as_ptr(), Ordering::Release);
    });
}

extern "C" fn in_parent() {
    // Dropping the plan closes the parent's descriptors of the copies (the child has its
    // own); the child reads nothing of it until its heap is its own.
    free(
        PLAN.swap(std::ptr::null_mut(), Ordering::AcqRel),
        STEPS.swap(std::ptr::null_mut(), Ordering::AcqRel),
    );
}

/// Drops a plan and unmaps its steps, either of which may be null.
fn free(plan: *mut Plan, steps: *mut Steps) {
    if !plan.is_null() {
        // SAFETY: a plan `before` leaked (`Box::into_raw`), taken out of PLAN, so nothing
        // else refers to it.
        drop(unsafe { Box::from_raw(plan) });
    }
    if let Some(s) = NonNull::new(steps) {
        // SAFETY: a mapping `steps` made, taken out of STEPS; its size is in its header.
        let _ = unsafe { munmap(s.cast(), s.as_ref().bytes) };
    }
}

extern "C" fn in_child() {
    let p = PLAN.swap(std::ptr::null_mut(), Ordering::AcqRel);
    let Some(s) = NonNull::new(STEPS.swap(std::ptr::null_mut(), Ordering::AcqRel)) else {
        return;
    };
    // SAFETY: the steps `before` wrote for this fork in a private anonymous mapping, this
    // process's own copy since the fork; read only. Nothing on the heap is read before
    // they are done: the heap may be adopted memory still shared with the parent, which
    // frees the plan and goes on allocating meanwhile.
    let steps =
        unsafe { std::slice::from_raw_parts(s.as_ptr().add(1).cast::<Step>(), s.as_ref().len) };
    // The first failure: which copy, where (address or descriptor), and why.
    let mut failed: Option<(usize, usize, nix::Error)> = None;
    for st in steps {
        if let Err(e) = st.run() {
            failed = failed.or(Some((st.copy, st.at(), e)));
        }
    }
    // The shared pages are replaced: the heap is this process's own, with the bytes it
    // had when `before` copied it, the plan among them; allocating is safe again.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: the plan `before` made, in this process's own copy of the heap now.
        if let Some(plan) = unsafe { p.as_ref() } {
            let pairs: Vec<(u64, u64)> = plan.copies.iter().map(|c| c.inodes).collect();
            crate::hostmem::renamed(&pairs);
            if let Some((i, at, e)) = failed {
                eprintln!(
                    "ringbell: after fork, some device memory stays shared with the parent \
                     ({} at {at:#x}: {e})",
                    plan.copies[i].name
                );
            }
        }
    });
    free(p, s.as_ptr());
}

/// The calls the child makes before anything else (the steps of [`in_child`]): a header
/// and its steps, in a private anonymous mapping of their own, which `fork` copies.
static STEPS: AtomicPtr<Steps> = AtomicPtr::new(std::ptr::null_mut());

/// The header of the steps' mapping; `len` [`Step`]s follow it.
#[repr(C)]
struct Steps {
    /// Bytes of the mapping, header included.
    bytes: usize,
    len: usize,
}

/// One system call of the child: map a copy over a mapping of its original, or put it in
/// the place of one of the original's descriptors.
#[derive(Clone, Copy)]
#[repr(C)]
struct Step {
    /// The copy's index in the plan.
    copy: usize,
    /// The copy's descriptor.
    src: RawFd,
    /// The descriptor to replace, or -1 for a mapping.
    fd: RawFd,
    /// A mapping's protection ([`ProtFlags`] bits).
    prot: i32,
    addr: usize,
    len: usize,
    offset: i64,
}

impl Step {
    /// Where it acts: the mapping's address or the descriptor.
    fn at(&self) -> usize {
        if self.fd < 0 {
            self.addr
        } else {
            self.fd as usize
        }
    }

    /// Makes the call. System calls only.
    fn run(&self) -> nix::Result<()> {
        // SAFETY: the copy's descriptor, open in this process (inherited from the parent,
        // which made it before the fork).
        let src = unsafe { BorrowedFd::borrow_raw(self.src) };
        if self.fd >= 0 {
            let cloexec = fcntl(self.fd, FcntlArg::F_GETFD)
                .map(|b| FdFlag::from_bits_truncate(b).contains(FdFlag::FD_CLOEXEC))
                .unwrap_or(true);
            nix::unistd::dup2(src.as_raw_fd(), self.fd)?;
            if cloexec {
                fcntl(self.fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC))?;
            }
            return Ok(());
        }
        let (Some(addr), Some(len)) = (NonZeroUsize::new(self.addr), NonZeroUsize::new(self.len))
        else {
            return Ok(());
        };
        // SAFETY: replaces a mapping of ours with a mapping of the copy of its bytes at the
        // same addresses, length and protection: every pointer into it stays valid and
        // reads what it read when `before` copied it.
        unsafe {
            mmap(
                Some(addr),
                len,
                ProtFlags::from_bits_truncate(self.prot),
                MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                src,
                self.offset,
            )
        }
        .map(drop)
    }
}

/// Writes the child's steps for `plan` into a new private anonymous mapping.
fn steps(plan: &Plan) -> nix::Result<NonNull<Steps>> {
    let mut all = Vec::new();
    for (i, c) in plan.copies.iter().enumerate() {
        let src = c.copy.as_raw_fd();
        for s in &c.maps {
            let mut prot = ProtFlags::empty();
            prot.set(ProtFlags::PROT_READ, s.read);
            prot.set(ProtFlags::PROT_WRITE, s.write);
            all.push(Step {
                copy: i,
                src,
                fd: -1,
                prot: prot.bits(),
                addr: s.start,
                len: s.end - s.start,
                offset: s.offset as i64,
            });
        }
        all.extend(c.fds.iter().map(|&fd| Step {
            copy: i,
            src,
            fd,
            prot: 0,
            addr: 0,
            len: 0,
            offset: 0,
        }));
    }
    let bytes = std::mem::size_of::<Steps>() + std::mem::size_of_val(all.as_slice());
    let size = NonZeroUsize::new(bytes).expect("the header has a size");
    // SAFETY: a new private anonymous mapping the kernel places.
    let mem = unsafe {
        mmap_anonymous(
            None,
            size,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_PRIVATE,
        )?
    };
    let head = mem.cast::<Steps>();
    // SAFETY: the mapping is `bytes` long, page aligned and this function's alone: a header,
    // then room for every step (`Step`'s alignment, 8, divides the header's size, 16).
    unsafe {
        head.as_ptr().write(Steps {
            bytes,
            len: all.len(),
        });
        let first = head.as_ptr().add(1).cast::<Step>();
        std::ptr::copy_nonoverlapping(all.as_ptr(), first, all.len());
    }
    Ok(head)
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
            name: base.to_string(),
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
