//! The lock that processes sharing a device take turns with (`ringbell::vfio::SharedLock`),
//! across `fork`. Alone in its test binary: a fork while other tests of the same process
//! register memory on other threads is outside what the driver's fork handling supports
//! (`driver/src/fork.rs`).

use nix::libc;
use std::sync::atomic::{AtomicU32, Ordering};

#[test]
fn children_of_fork_wait_for_the_lock_their_parent_holds() {
    let lock = ringbell::vfio::SharedLock::new().expect("a shared lock");
    // A word of memory shared with the child.
    // SAFETY: a fresh anonymous shared mapping of one page, checked below.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    // SAFETY: the page is mapped, zeroed, aligned and lives until the munmap below.
    let flag = unsafe { &*(page as *const AtomicU32) };
    let g = lock.lock();
    // Recursive for the thread that holds it.
    drop(lock.lock());
    // SAFETY: the child only locks, stores one word and exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let _g = lock.lock();
        flag.store(1, Ordering::SeqCst);
        // SAFETY: ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(0) };
    }
    // While the parent holds the lock, the child cannot get past it.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(flag.load(Ordering::SeqCst), 0, "the child got in");
    drop(g);
    let mut status = 0;
    // SAFETY: waits for the child made above.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert_eq!(status, 0, "the child ended with status {status:#x}");
    assert_eq!(flag.load(Ordering::SeqCst), 1, "the child took the lock");
    // SAFETY: the page mapped above; `flag` is not used after this.
    unsafe { libc::munmap(page, 4096) };
}
