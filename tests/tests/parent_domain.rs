//! Queue memory from a parent domain's allocator (`ibv_alloc_parent_domain(3)`,
//! [`ProtectionDomain::with_allocator`]): the rings and doorbell records of the QPs, SRQs
//! and CQs made through it come from the allocator, are used by the device in place, and
//! go back to it when the queue is destroyed; the allocator may send the driver to its own
//! memory, refuse, or give memory the driver cannot take, each with a clear error and
//! nothing kept.

use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_tests::*;
use std::cell::{Cell, RefCell};
use std::ptr::NonNull;
use std::rc::Rc;

/// What the test allocator does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Fresh pages of its own (an anonymous mapping per call), filled with 0xEE so the
    /// driver's zeroing shows.
    Give,
    /// The driver's own memory.
    Default,
    /// None.
    Refuse,
    /// An address one byte past an aligned one.
    Misaligned,
    /// Read-only pages.
    ReadOnly,
}

#[derive(Default)]
struct Log {
    /// (size, align, kind, address) of every allocation given.
    given: Vec<(usize, usize, QueueMem, usize)>,
    /// Addresses given back.
    freed: Vec<usize>,
    asked: usize,
}

struct TestAlloc {
    mode: Cell<Mode>,
    log: RefCell<Log>,
}

fn map(len: usize, prot: ProtFlags) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping, never unmapped.
    let p = unsafe {
        mmap_anonymous(
            None,
            std::num::NonZeroUsize::new(len).unwrap(),
            prot,
            MapFlags::MAP_PRIVATE,
        )
    }
    .unwrap();
    p.as_ptr() as *mut u8
}

// SAFETY: every address given is fresh mapped memory of this allocator, never used by the
// test until the driver gives it back (and then left mapped).
unsafe impl QueueAllocator for TestAlloc {
    fn alloc(&self, size: usize, align: usize, kind: QueueMem) -> Allocated {
        let mut log = self.log.borrow_mut();
        log.asked += 1;
        let len = size.next_multiple_of(4096) + 4096;
        let p = match self.mode.get() {
            Mode::Default => return Allocated::UseDefault,
            Mode::Refuse => return Allocated::Failed,
            Mode::Give => {
                let p = map(len, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE);
                // SAFETY: `len` bytes of ours.
                unsafe { std::ptr::write_bytes(p, 0xEE, len) };
                p
            }
            // SAFETY: inside the mapping.
            Mode::Misaligned => unsafe {
                map(len, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE).add(1)
            },
            Mode::ReadOnly => map(len, ProtFlags::PROT_READ),
        };
        log.given.push((size, align, kind, p as usize));
        NonNull::new(p).map_or(Allocated::Failed, Allocated::At)
    }
    fn free(&self, ptr: NonNull<u8>, _kind: QueueMem) {
        self.log.borrow_mut().freed.push(ptr.as_ptr() as usize);
    }
}

fn alloc(mode: Mode) -> Rc<TestAlloc> {
    Rc::new(TestAlloc {
        mode: Cell::new(mode),
        log: RefCell::default(),
    })
}

/// A side whose CQ, QP (and optionally an SRQ) come from `a` through a parent domain.
struct PdSide {
    qp: QueuePair,
    srq: Option<SharedReceiveQueue>,
    cq: CompletionQueue,
    mr: MemoryRegion,
    _buf: DmaBuffer,
    _parent: ProtectionDomain,
    _pd: ProtectionDomain,
    _dev: Device,
}

fn pd_side(fabric: &Fabric, node: usize, a: &Rc<TestAlloc>, srq: bool) -> PdSide {
    let dev = Device::open(Box::new(fabric.port(node))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let parent = pd.with_allocator(QueueAlloc(a.clone()));
    let buf = dev.alloc_dma(1 << 16).unwrap();
    let mr = parent
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let cq = dev.create_cq_in(256, Some(&parent)).unwrap();
    let srq = srq.then(|| parent.create_srq(64, 1, 0).unwrap());
    let mut init = QpInit::new(&cq, &cq);
    init.srq = srq.as_ref();
    let qp = parent.create_qp(&init).unwrap();
    PdSide {
        qp,
        srq,
        cq,
        mr,
        _buf: buf,
        _parent: parent,
        _pd: pd,
        _dev: dev,
    }
}

#[test]
fn queues_of_a_parent_domain_live_in_its_allocators_memory() {
    for with_srq in [false, true] {
        let fabric = Fabric::new(FabricConfig::new(2, 3));
        let (xa, xb) = (alloc(Mode::Give), alloc(Mode::Give));
        let mut a = pd_side(&fabric, 0, &xa, false);
        let mut b = pd_side(&fabric, 1, &xb, with_srq);
        {
            let log = xb.log.borrow();
            let kinds: Vec<QueueMem> = log.given.iter().map(|g| g.2).collect();
            // CQ ring and doorbell; (SRQ ring and doorbell); QP rings and doorbell.
            let mut want = vec![QueueMem::Cq, QueueMem::Doorbell];
            if with_srq {
                want.extend([QueueMem::Srq, QueueMem::Doorbell, QueueMem::Qp]);
            } else {
                want.extend([QueueMem::Qp, QueueMem::Qp]);
            }
            want.push(QueueMem::Doorbell);
            assert_eq!(kinds, want);
            for &(size, align, kind, addr) in &log.given {
                assert_eq!(addr % align, 0);
                assert_eq!(align, if kind == QueueMem::Doorbell { 64 } else { 4096 });
                // The driver zeroed what it took.
                // SAFETY: the allocator's mapping, `size` bytes.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, size) };
                assert!(bytes.iter().all(|&b| b == 0), "{kind:?} not zeroed");
            }
        }
        let (ea, eb) = (a.qp.endpoint(100), b.qp.endpoint(9000));
        a.qp.connect(&eb, 100, &ConnectOptions::default()).unwrap();
        b.qp.connect(&ea, 9000, &ConnectOptions::default()).unwrap();
        // 100 SENDs A -> B and 100 WRITEs, through rings in the allocators' memory: more
        // than the rings hold, so they lap.
        for i in 0..100u64 {
            let rs = [b.mr.sge(64 * (i % 8), 64)];
            match &mut b.srq {
                Some(s) => s.post_recv(&[RecvWr { wr_id: i, sgl: &rs }]).unwrap(),
                None => b.qp.post_recv(&[RecvWr { wr_id: i, sgl: &rs }]).unwrap(),
            }
            let data = [i as u8; 16];
            a.qp.post_send(&[SendWr::inline(i, WrOp::Send, &data)])
                .unwrap();
            let w = wait(&fabric, &mut b.cq, 1);
            assert_eq!(
                (w[0].wr_id, w[0].status, w[0].byte_len),
                (i, WcStatus::Success, 16)
            );
            let remote = RemoteAddr {
                addr: b.mr.addr() + 4096,
                rkey: b.mr.rkey(),
            };
            a.qp.post_send(&[SendWr::inline(1000 + i, WrOp::Write(remote), &data)])
                .unwrap();
            let w = wait(&fabric, &mut a.cq, 2);
            assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
        }
        // A resize takes its new ring from the allocator too; the old one goes back.
        let before = xa.log.borrow().given.len();
        a.cq.resize(1024).unwrap();
        {
            let log = xa.log.borrow();
            assert_eq!(log.given.len(), before + 1);
            assert_eq!(log.given[before].2, QueueMem::Cq);
            assert_eq!(log.freed, vec![log.given[0].3], "the old CQ ring went back");
        }
        drop(a);
        drop(b);
        // Everything given went back, once.
        for x in [&xa, &xb] {
            let log = x.log.borrow();
            let mut given: Vec<usize> = log.given.iter().map(|g| g.3).collect();
            let mut freed = log.freed.clone();
            given.sort_unstable();
            freed.sort_unstable();
            assert_eq!(given, freed);
        }
    }
}

#[test]
fn an_allocator_can_send_the_driver_to_its_own_memory_or_refuse() {
    let fabric = Fabric::new(FabricConfig::new(2, 4));
    let dev = Device::open(Box::new(fabric.port(0))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let x = alloc(Mode::Default);
    let parent = pd.with_allocator(QueueAlloc(x.clone()));
    // USE_DEFAULT: the driver's own memory; the queue works.
    let cq = dev.create_cq_in(16, Some(&parent)).unwrap();
    let qp = parent.create_qp(&QpInit::new(&cq, &cq)).unwrap();
    assert_eq!(x.log.borrow().asked, 5);
    assert!(x.log.borrow().given.is_empty());
    drop(qp);
    // Refused, misaligned, read-only: the creation fails with the driver's error, and what
    // was given goes back.
    for (mode, check) in [
        (Mode::Refuse, "memory"),
        (Mode::Misaligned, "invalid"),
        (Mode::ReadOnly, "fault"),
    ] {
        x.mode.set(mode);
        let e = dev.create_cq_in(16, Some(&parent)).unwrap_err();
        match (check, &e) {
            ("memory", Error::Memory(_))
            | ("invalid", Error::InvalidArgument(_))
            | ("fault", Error::BadAddress { .. }) => {}
            _ => panic!("{mode:?}: {e:?}"),
        }
        let q = parent.create_qp(&QpInit::new(&cq, &cq)).unwrap_err();
        assert_eq!(std::mem::discriminant(&q), std::mem::discriminant(&e));
        let log = x.log.borrow();
        let mut given: Vec<usize> = log.given.iter().map(|g| g.3).collect();
        let mut freed = log.freed.clone();
        given.sort_unstable();
        freed.sort_unstable();
        assert_eq!(given, freed, "{mode:?}: everything given went back");
    }
    // The PD itself (not the parent domain) still uses the driver's memory.
    let asked = x.log.borrow().asked;
    let _q = pd.create_qp(&QpInit::new(&cq, &cq)).unwrap();
    assert_eq!(x.log.borrow().asked, asked);
    // A PD of another device is refused.
    let other = Device::open(Box::new(fabric.port(1))).unwrap();
    assert!(matches!(
        other.create_cq_in(16, Some(&parent)),
        Err(Error::InvalidArgument(_))
    ));
}
