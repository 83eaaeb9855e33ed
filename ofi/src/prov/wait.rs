//! File-descriptor wait objects (`FI_WAIT_FD`, and the mutex and condition of
//! `FI_WAIT_MUTEX_COND` ones) of completion queues, event queues and
//! counters, wait sets, and `fi_trywait`.
//!
//! The descriptor `fi_control(FI_GETWAIT)` hands out is an epoll instance, so one
//! `poll`/`epoll_wait` on it wakes for either of two things:
//! - the queue's own eventfd, kept readable exactly while the queue holds an entry or an
//!   error (set at the end of every round of progress, and cleared when a read empties
//!   the queue), so another thread's progress wakes a waiter;
//! - the interrupt eventfd of every NIC the process has opened on a served fabric
//!   (`RINGBELL_SERVE`), added by `fi_trywait`. Before it says the application may block,
//!   `fi_trywait` arms every hardware CQ of the process's endpoints and the connection
//!   managers' CQs, so the next completion of any kind, a connection request included,
//!   raises an interrupt. The application then wakes, reads the queue (which runs the
//!   provider's progress and clears the interrupt) and, if the work was the provider's own,
//!   calls `fi_trywait` again.
//!
//! A counter's descriptor is readable while its values differ from those the application
//! last read or `fi_trywait` last reported; `fi_trywait` also arms the NIC's counter, as
//! a remote write it counts makes no completion. (Its values are read from the NIC's
//! registers: on a served NIC, four register reads a round of progress per such counter.)
//!
//! A wait set (`fi_wait_open`) holds the CQs and counters opened with `FI_WAIT_SET` and
//! it: `fi_wait` returns once one of them has something (a CQ an entry or an error, a
//! counter a value `fi_wait` has not reported yet), progressing meanwhile, and sleeping on
//! the set's descriptor in slices of at most 10 ms on a served fabric (its interrupts
//! armed as for `fi_trywait`), so another thread's progress is seen within a slice.
//!
//! On the in-process fabric nothing moves unless a call moves it: `fi_trywait` says
//! `-FI_EAGAIN` while a round of progress still moves the fabric, and `FI_SUCCESS` only when
//! the fabric is idle with nothing queued, after which only another thread's calls can
//! bring an entry (and make the queue's eventfd readable).

use super::{Errno, Obj, State, EAGAIN, EINVAL};
use crate::abi;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

/// A queue's `FI_WAIT_FD` wait object (and the descriptor behind an `FI_WAIT_MUTEX_COND`
/// one's condition).
pub struct FdWait {
    epoll: Epoll,
    ready: EventFd,
    /// Whether `ready` is readable now.
    signaled: bool,
    /// The NICs whose interrupt descriptor is in the epoll set.
    irqs: BTreeSet<usize>,
    /// An `FI_WAIT_MUTEX_COND` object's mutex and condition, broadcast when `ready` becomes
    /// readable.
    cond: Option<MutexCond>,
}

/// The mutex and condition variable of an `FI_WAIT_MUTEX_COND` wait object (fi_eq(3),
/// fi_cq(3), fi_cntr(3)), given to the application by `fi_control(FI_GETWAIT)` as a
/// `struct fi_mutex_cond`. The application waits on the condition holding the mutex, after
/// finding the queue empty; the provider broadcasts it when the queue gets something,
/// holding the mutex if it is free, so no wake-up falls between the look and the wait of a
/// waiter that holds it across both. When the mutex is held (by the calling thread itself,
/// which may hold it across its provider calls), the broadcast goes without it, as the
/// sockets provider signals, rather than wait for a release that may never come.
pub struct MutexCond {
    mutex: Box<std::cell::UnsafeCell<libc::pthread_mutex_t>>,
    cond: Box<std::cell::UnsafeCell<libc::pthread_cond_t>>,
}

impl MutexCond {
    fn new() -> MutexCond {
        MutexCond {
            mutex: Box::new(std::cell::UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER)),
            cond: Box::new(std::cell::UnsafeCell::new(libc::PTHREAD_COND_INITIALIZER)),
        }
    }

    /// The addresses the application is given (stable: both are boxed).
    pub fn parts(&self) -> abi::fi_mutex_cond {
        abi::fi_mutex_cond {
            mutex: self.mutex.get().cast(),
            cond: self.cond.get().cast(),
        }
    }

    fn broadcast(&self) {
        // SAFETY: both are initialized (statically) and live as long as `self`; pthread
        // calls on them from any thread are what they are for, and the mutex is unlocked
        // only when this thread's trylock took it.
        unsafe {
            let locked = libc::pthread_mutex_trylock(self.mutex.get()) == 0;
            libc::pthread_cond_broadcast(self.cond.get());
            if locked {
                libc::pthread_mutex_unlock(self.mutex.get());
            }
        }
    }
}

impl Drop for MutexCond {
    fn drop(&mut self) {
        // SAFETY: closing the queue ends the application's use of them (fi_close(3)); a
        // destroy of a mutex still held fails with EBUSY and leaves it as it was.
        unsafe {
            libc::pthread_cond_destroy(self.cond.get());
            libc::pthread_mutex_destroy(self.mutex.get());
        }
    }
}

impl std::fmt::Debug for FdWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdWait")
            .field("fd", &self.fd())
            .field("signaled", &self.signaled)
            .finish()
    }
}

fn os_err(e: nix::errno::Errno) -> Errno {
    match e {
        nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE | nix::errno::Errno::ENOMEM => {
            abi::FI_ENOMEM
        }
        _ => abi::FI_EOTHER,
    }
}

impl FdWait {
    /// A new wait object: an epoll set holding the queue's eventfd.
    pub fn new() -> Result<FdWait, Errno> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(os_err)?;
        let ready =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(os_err)?;
        epoll
            .add(ready.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, 0))
            .map_err(os_err)?;
        Ok(FdWait {
            epoll,
            ready,
            signaled: false,
            irqs: BTreeSet::new(),
            cond: None,
        })
    }

    /// The wait object of `wait_obj` for a queue or counter that has one: a descriptor for
    /// `FI_WAIT_FD`, with a mutex and condition beside it for `FI_WAIT_MUTEX_COND`; `None`
    /// for the polled kinds.
    pub fn of(wait_obj: u32) -> Result<Option<FdWait>, Errno> {
        match wait_obj {
            abi::fi_wait_obj_FI_WAIT_FD => FdWait::new().map(Some),
            abi::fi_wait_obj_FI_WAIT_MUTEX_COND => Ok(Some(FdWait {
                cond: Some(MutexCond::new()),
                ..FdWait::new()?
            })),
            _ => Ok(None),
        }
    }

    /// An `FI_WAIT_MUTEX_COND` object's mutex and condition.
    pub fn mutex_cond(&self) -> Option<&MutexCond> {
        self.cond.as_ref()
    }

    /// The descriptor the application waits on.
    pub fn fd(&self) -> RawFd {
        self.epoll.0.as_raw_fd()
    }

    /// Makes the queue's eventfd readable (`true`) or not.
    pub fn set(&mut self, ready: bool) {
        if ready == self.signaled {
            return;
        }
        let r = if ready {
            self.ready.write(1).map(|_| ())
        } else {
            self.ready.read().map(|_| ())
        };
        // Only a full counter (never: it holds 0 or 1) or an empty one (tracked) fails.
        self.signaled = ready && r.is_ok();
        if ready {
            if let Some(c) = &self.cond {
                c.broadcast();
            }
        }
    }

    /// Adds NIC `nic`'s interrupt descriptor to the set, once.
    fn watch(&mut self, nic: usize, irq: BorrowedFd<'_>) -> Result<(), Errno> {
        if self.irqs.insert(nic) {
            self.epoll
                .add(irq, EpollEvent::new(EpollFlags::EPOLLIN, nic as u64 + 1))
                .map_err(os_err)?;
        }
        Ok(())
    }
}

/// Whether descriptor `fd` is readable now.
fn readable(fd: BorrowedFd<'_>) -> bool {
    poll_in(fd, nix::poll::PollTimeout::ZERO)
}

/// Whether descriptor `fd` became readable within `timeout`.
fn poll_in(fd: BorrowedFd<'_>, timeout: nix::poll::PollTimeout) -> bool {
    let mut p = [nix::poll::PollFd::new(fd, nix::poll::PollFlags::POLLIN)];
    matches!(nix::poll::poll(&mut p, timeout), Ok(n) if n > 0)
}

/// A wait set (`fi_wait_open`, fi_wait(3)).
#[derive(Debug)]
pub struct WaitSet {
    /// What it was opened with (`FI_WAIT_UNSPEC`, `FI_WAIT_FD`, `FI_WAIT_MUTEX_COND` or
    /// `FI_WAIT_YIELD`).
    pub wait_obj: u32,
    /// Its descriptor (for `FI_WAIT_YIELD` too: `fi_wait` sleeps on it), readable while a
    /// member has something.
    pub wait: FdWait,
}

/// The longest `fi_wait` sleeps before it looks again.
const SLICE_MS: u64 = 10;

impl State {
    /// Whether wait set `set` has a member with something, taking a counter's new values
    /// as reported when `report`.
    fn set_ready(&mut self, set: usize, report: bool) -> bool {
        let mut ready = false;
        for o in self.objs.values_mut() {
            match o {
                Obj::Cq(c) if c.wait_set == Some(set) => {
                    ready |= !c.entries.is_empty() || !c.errs.is_empty();
                }
                Obj::Cntr(c) => {
                    if let Some((_, seen)) = c.wait_set.as_mut().filter(|(w, _)| *w == set) {
                        let now = c.c.read();
                        if now != *seen {
                            ready = true;
                            if report {
                                *seen = now;
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        ready
    }

    /// The wait object and readiness of queue `key` (a CQ or an EQ, or a wait set), if it
    /// has one.
    fn wait_of(&mut self, key: usize) -> Option<(&mut FdWait, bool)> {
        if let Some(Obj::Wait(_)) = self.objs.get(&key) {
            let ready = self.set_ready(key, false);
            let Some(Obj::Wait(w)) = self.objs.get_mut(&key) else {
                return None;
            };
            return Some((&mut w.wait, ready));
        }
        match self.objs.get_mut(&key)? {
            Obj::Cq(c) => {
                let ready = !c.entries.is_empty() || !c.errs.is_empty();
                c.wait.as_mut().map(|w| (w, ready))
            }
            Obj::Eq(e) => {
                let ready = !e.events.is_empty() || !e.errs.is_empty();
                e.wait.as_mut().map(|w| (w, ready))
            }
            Obj::Cntr(c) => {
                let ready = c.wait.is_some() && c.c.read() != c.seen;
                c.wait.as_mut().map(|w| (w, ready))
            }
            _ => None,
        }
    }

    /// Counter `key`'s values as the application has now seen them (`fi_cntr_read`,
    /// `fi_cntr_readerr`): its descriptor quiets until they change.
    pub fn cntr_seen(&mut self, key: usize, now: (u64, u64)) {
        if let Some(Obj::Cntr(c)) = self.objs.get_mut(&key) {
            c.seen = now;
        }
        self.wait_sync(key);
    }

    /// Brings queue `key`'s eventfd in line with what the queue holds.
    pub fn wait_sync(&mut self, key: usize) {
        // (Every CQ read calls this: a process without wait objects pays one check.)
        if self.fd_waits.is_empty() {
            return;
        }
        if let Some((w, ready)) = self.wait_of(key) {
            w.set(ready);
        }
    }

    /// Brings every wait object in line (the end of a round of progress).
    pub(super) fn wait_sync_all(&mut self) {
        if self.fd_waits.is_empty() {
            return;
        }
        let keys: Vec<usize> = self.fd_waits.iter().copied().collect();
        for k in keys {
            self.wait_sync(k);
        }
    }

    /// Takes the device events NIC `nic` has raised: completion events only wake waiters
    /// (their interrupt did), COUNTER events are kept for [`State::cntr_reached`]. A served
    /// NIC's interrupt is cleared first, so one raised after this point stays readable.
    pub(super) fn pump_events(&mut self, nic: usize) {
        let Some(n) = self.nics.get(&nic) else { return };
        let dev = n.dev.clone();
        if let Some(irq) = dev.port().interrupt_fd(0).filter(|_| self.irq_armed) {
            if readable(irq) {
                let mut v = [0u8; 8];
                let _ = nix::unistd::read(irq.as_raw_fd(), &mut v);
            }
        }
        while let Some(e) = dev.poll_event() {
            if e.kind == ringbell_specs::cqe::EventType::Counter
                && self.timing_armed.contains(&(nic, e.obj))
            {
                self.cntr_events.entry(nic).or_default().push(e);
            }
        }
    }

    /// One look of `fi_wait` on wait set `set`: `Ok(None)` when a member has something,
    /// else how to wait before the next look: the set's descriptor to sleep on (a served
    /// fabric, everything armed), or none (in-process: look again at once when the
    /// fabric moved).
    pub fn wait_look(&mut self, set: usize) -> Result<Option<(Option<OwnedFd>, bool)>, Errno> {
        if !matches!(self.objs.get(&set), Some(Obj::Wait(_))) {
            return Err(EINVAL);
        }
        let moved = self.progress();
        if self.set_ready(set, true) {
            return Ok(None);
        }
        match self.trywait(&[set]) {
            Ok(()) => {
                let Some(Obj::Wait(w)) = self.objs.get(&set) else {
                    return Err(EINVAL);
                };
                // A descriptor of its own, to sleep on without the lock.
                let fd = w.wait.epoll.0.try_clone().map_err(|_| abi::FI_ENOMEM)?;
                Ok(Some((Some(fd), moved)))
            }
            Err(e) if e == EAGAIN => Ok(Some((None, moved))),
            Err(e) => Err(e),
        }
    }

    /// `fi_trywait`: `-FI_EAGAIN` when one of `keys` (CQs, EQs and counters with an
    /// `FI_WAIT_FD` wait object, wait sets) holds something (a counter: changed since it
    /// was last read or reported) or the in-process fabric still moves; else every
    /// hardware source of work is armed to interrupt and the caller may block on the
    /// descriptors. Any other object is `-FI_EINVAL`.
    pub fn trywait(&mut self, keys: &[usize]) -> Result<(), Errno> {
        for &k in keys {
            if self.wait_of(k).is_none() {
                return Err(EINVAL);
            }
        }
        if keys.is_empty() {
            return Ok(());
        }
        // Two rounds: an idle in-process fabric's clock may have run to a timer in the
        // first, whose event the second then takes.
        let moved = self.progress() | self.progress();
        let mut ready = false;
        for &k in keys {
            if let Some((_, true)) = self.wait_of(k) {
                ready = true;
                // A counter's change is reported once (as by a read of it).
                if let Some(Obj::Cntr(c)) = self.objs.get_mut(&k) {
                    c.seen = c.c.read();
                }
            }
        }
        if ready {
            self.wait_sync_all();
            return Err(EAGAIN);
        }
        let served: Vec<usize> = self
            .nics
            .iter()
            .filter(|(_, n)| n.dev.port().interrupt_fd(0).is_some())
            .map(|(&i, _)| i)
            .collect();
        if served.len() < self.nics.len() && moved {
            // In-process: the next round may still bring something.
            return Err(EAGAIN);
        }
        for &k in keys {
            for &nic in &served {
                let dev = self.nics[&nic].dev.clone();
                let Some(irq) = dev.port().interrupt_fd(0) else {
                    continue;
                };
                if let Some((w, _)) = self.wait_of(k) {
                    w.watch(nic, irq)?;
                }
            }
        }
        self.irq_armed |= !served.is_empty();
        // A counter with a descriptor also counts what makes no completion (remote
        // writes and reads): its device counter raises an event at the next success or
        // at any error.
        for &k in keys {
            if let Some(Obj::Cntr(c)) = self.objs.get(&k) {
                c.c.arm(c.seen.0 + 1).map_err(|_| abi::FI_EIO)?;
            }
        }
        self.arm_all();
        Ok(())
    }

    /// Arms everything that can complete: a completion of any endpoint, or a message to a
    /// connection manager. Arming with completions already written fires at once.
    fn arm_all(&self) {
        for n in self.nics.values() {
            n.cm.arm();
        }
        for o in self.objs.values() {
            if let Obj::Ep(e) = o {
                if let Some(cq) = &e.cq {
                    cq.arm(false);
                }
                if let Some(tm) = &e.tm {
                    tm.arm();
                }
            }
        }
    }

    /// For a blocking read (`fi_cq_sread`, `fi_eq_sread`) that found nothing: the
    /// interrupt descriptors of the process's NICs, all served, with everything that can
    /// complete armed, so a sleep on them ends at the next completion or connection
    /// message of any of them. `None` (the caller looks again at once) when the process has
    /// a NIC of the in-process fabric, which moves only when called, or none.
    pub fn rest_fds(&mut self) -> Option<Vec<OwnedFd>> {
        if self.nics.is_empty() {
            return None;
        }
        let mut fds = Vec::with_capacity(self.nics.len());
        for n in self.nics.values() {
            fds.push(n.dev.port().interrupt_fd(0)?.try_clone_to_owned().ok()?);
        }
        self.irq_armed = true;
        self.arm_all();
        Some(fds)
    }
}

/// Sleeps until one of `fds` is readable or [`SLICE_MS`] (at most `left_ms`) passed;
/// `-FI_EINTR` when a signal handler ran meanwhile (as libfabric's own waits return).
pub fn sleep_on_any(fds: &[OwnedFd], left_ms: Option<u64>) -> Result<(), Errno> {
    let ms = left_ms.map_or(SLICE_MS, |l| l.min(SLICE_MS)) as u16;
    let mut p: Vec<nix::poll::PollFd<'_>> = fds
        .iter()
        .map(|f| nix::poll::PollFd::new(f.as_fd(), nix::poll::PollFlags::POLLIN))
        .collect();
    match nix::poll::poll(&mut p, nix::poll::PollTimeout::from(ms)) {
        Err(nix::errno::Errno::EINTR) => Err(abi::FI_EINTR),
        _ => Ok(()),
    }
}

/// Sleeps until descriptor `fd` is readable or [`SLICE_MS`] (at most `left_ms`) passed.
pub fn sleep_on(fd: &OwnedFd, left_ms: Option<u64>) {
    // (A signal only ends the slice early: the caller looks again.)
    let _ = sleep_on_any(std::slice::from_ref(fd), left_ms);
}
