//! Address vectors (`fi_av_open`, fi_av(3)): a table of peer addresses, an `fi_addr_t`
//! being an index into it (for `FI_AV_MAP` and `FI_AV_TABLE` alike), in the process, or,
//! for a named AV (`attr->name`, the `FI_SHARED_AV` capability), in a memory file of this
//! host that every process opening the AV by that name maps.
//!
//! A named AV is the file `/dev/shm/ringbell-av-NAME`: a header (magic, capacity, the
//! number of slots handed out, the creator's process id), then `capacity` `fi_addr_t`s (the
//! entry's own index while it holds an address, `FI_ADDR_NOTAVAIL` otherwise: what
//! `attr->map_addr` points at), then the 16-byte addresses. Processes read entries from the
//! file at each use, so an address inserted by one is usable by the others at once; a slot
//! is claimed with an atomic add, its address written before its `fi_addr_t` says it is
//! there. Opened with `FI_READ` the AV must exist and takes no inserts or removals
//! (`-FI_EINVAL`). The process that created the file removes its name when it closes the
//! AV (processes that have it open keep their mapping); a file whose creator is gone is
//! made anew by the next process that opens the name for writing.

use super::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// `FI_ADDR_NOTAVAIL`.
const NOTAVAIL: u64 = u64::MAX;
/// The first word of a named AV's file.
const MAGIC: u64 = u64::from_le_bytes(*b"RBAV0001");
/// Header words: magic, capacity, slots handed out, creator's pid.
const HEADER_WORDS: usize = 4;
/// Fewest slots a named AV is made with (the application's `count` when larger).
pub const MIN_NAMED_CAPACITY: usize = 1024;

/// A shared, read-write mapping of a whole file.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, reached only through `Shared`, which the
// provider's state lock serializes within the process.
unsafe impl Send for Mapping {}

impl Mapping {
    fn of(file: &std::fs::File, len: usize) -> Result<Mapping, Errno> {
        use std::os::fd::AsRawFd;
        // SAFETY: a new shared mapping of `len` bytes of an open file (the kernel picks
        // the address); every access to it goes through atomics or byte copies, since
        // other processes write it too.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(abi::FI_ENOMEM);
        }
        Ok(Mapping {
            ptr: p as *mut u8,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, unmapped once; nothing of it outlives `self`
        // (the map address given to the application is valid while the AV is open).
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A named AV's mapping.
pub struct Shared {
    map: Mapping,
    capacity: usize,
    read_only: bool,
    /// This process made the file: its name goes when the AV closes.
    path: Option<std::path::PathBuf>,
}

/// An address vector.
pub struct Av {
    local: Vec<Option<Addr>>,
    shared: Option<Shared>,
    /// Bits at the top of an address that name a receive context (`rx_ctx_bits`,
    /// `fi_rx_addr`): the rest is the index.
    pub rx_ctx_bits: u32,
    /// The format of its domain's info: `fi_av_lookup` gives addresses in it.
    pub format: Format,
}

impl Av {
    /// An AV of this process.
    pub fn new(format: Format, rx_ctx_bits: u32) -> Av {
        Av {
            local: Vec::new(),
            shared: None,
            rx_ctx_bits,
            format,
        }
    }

    /// The named AV `name`: opened (`read_only`: it must exist) or created with room for
    /// `count` addresses (at least [`MIN_NAMED_CAPACITY`]). `-FI_EINVAL` for a name that is
    /// not a plain file name, or a read-only AV that does not exist.
    pub fn named(
        name: &str,
        read_only: bool,
        count: usize,
        format: Format,
        rx_ctx_bits: u32,
    ) -> Result<Av, Errno> {
        let plain = !name.is_empty()
            && name.len() <= 200
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !plain {
            return Err(EINVAL);
        }
        let path = std::path::PathBuf::from(format!("/dev/shm/ringbell-av-{name}"));
        let shared = if read_only {
            Shared::open(&path, true)?.ok_or(EINVAL)?
        } else {
            Shared::open_or_create(&path, count.max(MIN_NAMED_CAPACITY))?
        };
        Ok(Av {
            local: Vec::new(),
            shared: Some(shared),
            rx_ctx_bits,
            format,
        })
    }

    /// The `fi_addr_t` table of a named AV (`attr->map_addr`): entry `i` is `i` while it
    /// holds an address.
    pub fn map_addr(&self) -> Option<*mut u64> {
        self.shared
            .as_ref()
            .map(|s| s.word_ptr(HEADER_WORDS) as *mut u64)
    }

    /// The address at `index`, if any.
    pub fn get(&self, index: u64) -> Option<Addr> {
        let i = usize::try_from(index).ok()?;
        match &self.shared {
            Some(s) => s.get(i),
            None => self.local.get(i).copied().flatten(),
        }
    }

    /// The index of the first address for which `f` holds.
    pub fn position(&self, f: impl Fn(&Addr) -> bool) -> Option<usize> {
        match &self.shared {
            Some(s) => (0..s.used()).find(|&i| s.get(i).is_some_and(|a| f(&a))),
            None => self.local.iter().position(|a| a.as_ref().is_some_and(&f)),
        }
    }

    /// Adds `a`; its index. `-FI_EINVAL` on a read-only AV, `-FI_ENOSPC` when a named
    /// AV is full.
    pub fn insert(&mut self, a: Addr) -> Result<u64, Errno> {
        match &mut self.shared {
            Some(s) => s.insert(a).map(|i| i as u64),
            None => {
                self.local.push(Some(a));
                Ok((self.local.len() - 1) as u64)
            }
        }
    }

    /// Empties entry `index` (`-FI_EINVAL` for one never handed out, or on a read-only
    /// AV).
    pub fn remove(&mut self, index: u64) -> Result<(), Errno> {
        let i = usize::try_from(index).map_err(|_| EINVAL)?;
        match &mut self.shared {
            Some(s) => s.remove(i),
            None => {
                *self.local.get_mut(i).ok_or(EINVAL)? = None;
                Ok(())
            }
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Shared {
    /// Bytes of a file of `capacity` slots; `None` when that is more than an address space
    /// holds (a capacity read from a file another process wrote is not trusted).
    fn len(capacity: usize) -> Option<usize> {
        let words = HEADER_WORDS.checked_add(capacity)?.checked_mul(8)?;
        words.checked_add(ADDR_LEN.checked_mul(capacity)?)
    }

    /// Word `i` of the mapping.
    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the mapping holds `len(capacity)` bytes, at least `HEADER_WORDS +
        // capacity` 8-byte words from its page-aligned start, and callers pass `i` below
        // that; it is shared memory other processes change, which is what atomics are for.
        unsafe { &*(self.word_ptr(i) as *const AtomicU64) }
    }

    fn word_ptr(&self, i: usize) -> *mut u8 {
        debug_assert!(8 * (i + 1) <= self.map.len);
        self.map.ptr.wrapping_add(8 * i)
    }

    /// Opens the existing file at `path` (`None` if there is none, or it is not a named
    /// AV's).
    fn open(path: &std::path::Path, read_only: bool) -> Result<Option<Shared>, Errno> {
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(_) => return Err(abi::FI_EACCES),
        };
        let size = file.metadata().map_err(|_| EINVAL)?.len() as usize;
        if size < 8 * HEADER_WORDS {
            return Ok(None);
        }
        let map = Mapping::of(&file, size)?;
        let mut s = Shared {
            map,
            capacity: 0,
            read_only,
            path: None,
        };
        let capacity = s.word(1).load(Ordering::Acquire) as usize;
        if s.word(0).load(Ordering::Acquire) != MAGIC
            || Shared::len(capacity).is_none_or(|l| l > size)
        {
            return Ok(None);
        }
        s.capacity = capacity;
        Ok(Some(s))
    }

    /// Opens the file at `path` for writing, creating it with `capacity` slots when there
    /// is none or its creator is gone.
    fn open_or_create(path: &std::path::Path, capacity: usize) -> Result<Shared, Errno> {
        let len = Shared::len(capacity).ok_or(abi::FI_ENOMEM)?;
        for _ in 0..8 {
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
            {
                Ok(file) => {
                    file.set_len(len as u64).map_err(|_| abi::FI_ENOMEM)?;
                    let map = Mapping::of(&file, len)?;
                    let s = Shared {
                        map,
                        capacity,
                        read_only: false,
                        path: Some(path.to_path_buf()),
                    };
                    for i in 0..capacity {
                        s.word(HEADER_WORDS + i).store(NOTAVAIL, Ordering::Relaxed);
                    }
                    s.word(1).store(capacity as u64, Ordering::Relaxed);
                    s.word(2).store(0, Ordering::Relaxed);
                    s.word(3)
                        .store(u64::from(std::process::id()), Ordering::Relaxed);
                    s.word(0).store(MAGIC, Ordering::Release);
                    return Ok(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    match Shared::open(path, false)? {
                        Some(s) if s.creator_alive() => return Ok(s),
                        // Its creator is gone (or another is still writing its header:
                        // then it is young, and alive).
                        Some(_) => {
                            let _ = std::fs::remove_file(path);
                        }
                        None => std::thread::sleep(std::time::Duration::from_millis(1)),
                    }
                }
                Err(_) => return Err(abi::FI_EACCES),
            }
        }
        Err(abi::FI_EBUSY)
    }

    fn creator_alive(&self) -> bool {
        let pid = self.word(3).load(Ordering::Acquire) as i32;
        std::path::Path::new(&format!("/proc/{pid}")).exists()
    }

    /// Slots handed out.
    fn used(&self) -> usize {
        (self.word(2).load(Ordering::Acquire) as usize).min(self.capacity)
    }

    fn addr_offset(&self, i: usize) -> usize {
        8 * (HEADER_WORDS + self.capacity) + ADDR_LEN * i
    }

    fn get(&self, i: usize) -> Option<Addr> {
        if i >= self.used() || self.word(HEADER_WORDS + i).load(Ordering::Acquire) != i as u64 {
            return None;
        }
        let at = self.addr_offset(i);
        let mut a = [0u8; ADDR_LEN];
        // SAFETY: slot `i < capacity` lies within the mapping (`len(capacity)` bytes); a
        // copy out of shared memory, written before its index was published (Acquire).
        unsafe { std::ptr::copy_nonoverlapping(self.map.ptr.add(at), a.as_mut_ptr(), ADDR_LEN) };
        Some(a)
    }

    fn insert(&mut self, a: Addr) -> Result<usize, Errno> {
        if self.read_only {
            return Err(EINVAL);
        }
        let i = self.word(2).fetch_add(1, Ordering::AcqRel) as usize;
        if i >= self.capacity {
            self.word(2).fetch_sub(1, Ordering::AcqRel);
            return Err(abi::FI_ENOSPC);
        }
        let at = self.addr_offset(i);
        // SAFETY: slot `i < capacity` lies within the mapping; it is this process's alone
        // (claimed by the atomic add) until its index is published below (Release).
        unsafe { std::ptr::copy_nonoverlapping(a.as_ptr(), self.map.ptr.add(at), ADDR_LEN) };
        self.word(HEADER_WORDS + i)
            .store(i as u64, Ordering::Release);
        Ok(i)
    }

    fn remove(&mut self, i: usize) -> Result<(), Errno> {
        if self.read_only || i >= self.used() {
            return Err(EINVAL);
        }
        self.word(HEADER_WORDS + i)
            .store(NOTAVAIL, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(n: u8) -> Addr {
        make_addr([10, 0, 0, n], u64::from(n))
    }

    #[test]
    fn a_named_av_is_one_table_for_every_opener_and_read_only_openers_only_read() {
        let name = format!("unit-{}", std::process::id());
        // A read-only AV must exist.
        assert_eq!(
            Av::named(&name, true, 4, Format::Native, 0).err(),
            Some(EINVAL)
        );
        let mut w = Av::named(&name, false, 4, Format::Native, 0).unwrap();
        assert_eq!(w.insert(addr(1)), Ok(0));
        let mut r = Av::named(&name, true, 0, Format::Native, 0).unwrap();
        let mut w2 = Av::named(&name, false, 0, Format::Native, 0).unwrap();
        // What one inserts, the others see, at the same index, in the map too.
        assert_eq!(w2.insert(addr(2)), Ok(1));
        assert_eq!(r.get(0), Some(addr(1)));
        assert_eq!(r.get(1), Some(addr(2)));
        assert_eq!(w.get(1), Some(addr(2)));
        assert_eq!(r.position(|a| *a == addr(2)), Some(1));
        // SAFETY: the map of `MIN_NAMED_CAPACITY` (> 2) words, mapped while `r` lives.
        let map = unsafe { std::slice::from_raw_parts(r.map_addr().unwrap(), 3) };
        assert_eq!(map, &[0, 1, NOTAVAIL]);
        // Read-only: no inserts, no removals.
        assert_eq!(r.insert(addr(3)), Err(EINVAL));
        assert_eq!(r.remove(0), Err(EINVAL));
        // A removal is seen by all; an index never handed out is no entry.
        assert_eq!(w2.remove(0), Ok(()));
        assert_eq!(r.get(0), None);
        assert_eq!(w.remove(7), Err(EINVAL));
        // The creator's close removes the name; the others keep their mapping.
        drop(w);
        assert_eq!(r.get(1), Some(addr(2)));
        assert_eq!(
            Av::named(&name, true, 0, Format::Native, 0).err(),
            Some(EINVAL)
        );
        // Names are plain file names.
        assert_eq!(
            Av::named("../x", false, 0, Format::Native, 0).err(),
            Some(EINVAL)
        );
        assert_eq!(
            Av::named("", false, 0, Format::Native, 0).err(),
            Some(EINVAL)
        );
    }

    #[test]
    fn a_named_av_whose_creator_is_gone_is_made_anew() {
        let name = format!("unit-stale-{}", std::process::id());
        let mut a = Av::named(&name, false, 0, Format::Native, 0).unwrap();
        a.insert(addr(1)).unwrap();
        // As if its creator had died: a pid that is no process, and its name kept.
        let s = a.shared.as_mut().unwrap();
        s.word(3).store(u64::from(u32::MAX >> 1), Ordering::Release);
        let path = s.path.take().unwrap();
        let b = Av::named(&name, false, 0, Format::Native, 0).unwrap();
        assert_eq!(b.get(0), None);
        drop(b);
        assert!(!path.exists());
    }

    #[test]
    fn a_local_av_indexes_its_addresses() {
        let mut a = Av::new(Format::Native, 0);
        assert_eq!(a.insert(addr(1)), Ok(0));
        assert_eq!(a.insert(addr(2)), Ok(1));
        assert_eq!(a.remove(0), Ok(()));
        assert_eq!(a.get(0), None);
        assert_eq!(a.get(1), Some(addr(2)));
        assert_eq!(a.remove(2), Err(EINVAL));
        assert!(a.map_addr().is_none());
    }
}
