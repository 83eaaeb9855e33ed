//! A lock shared with the children of `fork`.
//!
//! A child of `fork` shares its parent's device when that device lives outside the process
//! (hardware, or a served emulator): the same command mailbox and, over vfio-user, the same
//! socket. The kernel serializes a real RDMA context's commands between the processes that
//! share it; this lock does the same for ringbell's. It is a robust, process-shared,
//! recursive POSIX mutex in a page of anonymous shared memory, made before any fork: every
//! process descended from its maker locks the same mutex. When a holder dies, the next
//! locker takes it over (`EOWNERDEAD`, then marked consistent); what the dead holder left
//! half done is the protocol's to notice (a vfio-user exchange cut short breaks the
//! connection, as before).

use nix::libc;
use std::ptr::NonNull;

/// A mutex shared by this process and the children it forks afterwards.
#[derive(Debug)]
pub struct SharedLock {
    mutex: NonNull<libc::pthread_mutex_t>,
}

/// Holds a [`SharedLock`] until dropped.
#[derive(Debug)]
pub struct SharedGuard<'a> {
    lock: &'a SharedLock,
}

impl SharedLock {
    /// A new, unlocked lock; `None` if the page or the mutex could not be made (the caller
    /// then goes on unserialized, as before).
    pub fn new() -> Option<SharedLock> {
        let len = std::mem::size_of::<libc::pthread_mutex_t>();
        // SAFETY: a fresh anonymous shared mapping of `len` bytes, which nothing else
        // references; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let mutex = NonNull::new(p as *mut libc::pthread_mutex_t)?;
        // SAFETY: `attr` lives on this stack frame and is initialised before use and
        // destroyed after; `mutex` points at the mapping above, page-aligned and large
        // enough, which only this call has seen so far.
        let ok = unsafe {
            let mut attr = std::mem::MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
            let a = attr.as_mut_ptr();
            let ok = libc::pthread_mutexattr_init(a) == 0
                && libc::pthread_mutexattr_setpshared(a, libc::PTHREAD_PROCESS_SHARED) == 0
                && libc::pthread_mutexattr_setrobust(a, libc::PTHREAD_MUTEX_ROBUST) == 0
                && libc::pthread_mutexattr_settype(a, libc::PTHREAD_MUTEX_RECURSIVE) == 0
                && libc::pthread_mutex_init(mutex.as_ptr(), a) == 0;
            libc::pthread_mutexattr_destroy(a);
            ok
        };
        let lock = SharedLock { mutex };
        ok.then_some(lock)
    }

    /// Waits for the lock (taking it over from a holder that died) and holds it until the
    /// guard is dropped. The same thread may take it again while it holds it.
    pub fn lock(&self) -> SharedGuard<'_> {
        // SAFETY: `mutex` was initialised in `new` and stays mapped while `self` lives.
        unsafe {
            if libc::pthread_mutex_lock(self.mutex.as_ptr()) == libc::EOWNERDEAD {
                libc::pthread_mutex_consistent(self.mutex.as_ptr());
            }
        }
        SharedGuard { lock: self }
    }
}

impl Drop for SharedGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: this thread holds the mutex (taken in `lock`), which stays mapped while
        // the lock, which the guard borrows, lives.
        unsafe {
            libc::pthread_mutex_unlock(self.lock.mutex.as_ptr());
        }
    }
}

impl Drop for SharedLock {
    fn drop(&mut self) {
        // Only this process's view goes: others may still use the mutex.
        // SAFETY: the mapping made in `new`, of this size; no guard outlives `self`.
        unsafe {
            libc::munmap(
                self.mutex.as_ptr() as *mut libc::c_void,
                std::mem::size_of::<libc::pthread_mutex_t>(),
            );
        }
    }
}
