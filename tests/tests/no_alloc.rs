//! The fast path allocates nothing: posting (batched, inline, gather lists) and polling.
//! A counting global allocator watches this test binary; the emulator's own per-frame
//! buffers are created while the fabric steps, which the measured region excludes.

use ringbell::*;
use ringbell_tests::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The counter is global: the tests of this binary take turns, so that one's set-up does not
/// count in another's measured region.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn post_send_post_recv_and_poll_do_not_allocate() {
    let _turn = one_at_a_time();
    let mut p = pair();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 64), p.a.mr.sge(4096, 64)];
    let rs = [p.b.mr.sge(8192, 256)];
    let mut wc = [WorkCompletion::default(); 32];
    let mut measured = 0;
    for round in 0..50 {
        let before = ALLOCS.load(Ordering::Relaxed);
        let batch = [
            SendWr::inline(1, WrOp::Write(remote), &[7u8; 100]).flags(SendFlags::empty()),
            SendWr::new(2, WrOp::Write(remote), &sge).flags(SendFlags::empty()),
            SendWr::inline(3, WrOp::Send, b"ping"),
        ];
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: round,
                sgl: &rs,
            }])
            .unwrap();
        p.a.qp.post_send(&batch).unwrap();
        let n = p.a.cq.poll_ready(&mut wc) + p.b.cq.poll_ready(&mut wc);
        let after = ALLOCS.load(Ordering::Relaxed);
        // Warm-up rounds let the emulator's event queue reach its working capacity.
        if round >= 10 {
            assert_eq!(after - before, 0, "round {round}: the fast path allocated");
            measured += 1;
        }
        let _ = n;
        settle(&p.fabric);
        // Polling completions that are there (hits) allocates nothing either.
        let before = ALLOCS.load(Ordering::Relaxed);
        let (ha, hb) = (p.a.cq.poll_ready(&mut wc), p.b.cq.poll_ready(&mut wc));
        let after = ALLOCS.load(Ordering::Relaxed);
        assert_eq!((ha, hb), (1, 1), "one signaled send, one receive");
        if round >= 10 {
            assert_eq!(after - before, 0, "round {round}: polling allocated");
        }
    }
    assert_eq!(measured, 40);
}

#[test]
fn ud_post_send_and_poll_do_not_allocate() {
    let _turn = one_at_a_time();
    let f = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(2, 5));
    let a = side(&f, 0, Access::LOCAL_WRITE);
    let b = side(&f, 1, Access::LOCAL_WRITE);
    let ud = |s: &Side| {
        let mut init = QpInit::new(&s.cq, &s.cq);
        init.qp_type = QpType::Ud;
        init.max_inline = 128;
        let mut qp = s.pd.create_qp(&init).unwrap();
        qp.ud_ready(0x77, 0).unwrap();
        qp
    };
    let (mut qa, mut qb) = (ud(&a), ud(&b));
    let (mut cqa, mut cqb) = (a.cq, b.cq);
    let ah = a.pd.create_ah(&b.dev.ah_attr()).unwrap();
    let dest = UdDest {
        ah: &ah,
        qpn: qb.qpn(),
        qkey: 0x77,
    };
    let sge = [a.mr.sge(0, 512)];
    let rs = [b.mr.sge(0, 1024)];
    let mut wc = [WorkCompletion::default(); 8];
    for round in 0..40 {
        let before = ALLOCS.load(Ordering::Relaxed);
        qb.post_recv(&[RecvWr {
            wr_id: round,
            sgl: &rs,
        }])
        .unwrap();
        qa.post_send(&[
            SendWr::inline(1, WrOp::Send, &[5u8; 100])
                .to(dest)
                .flags(SendFlags::empty()),
            SendWr::new(2, WrOp::SendImm(round as u32), &sge).to(dest),
        ])
        .unwrap();
        let after = ALLOCS.load(Ordering::Relaxed);
        if round >= 10 {
            assert_eq!(after - before, 0, "round {round}: a UD post allocated");
        }
        settle(&f);
        let before = ALLOCS.load(Ordering::Relaxed);
        let (na, nb) = (cqa.poll_ready(&mut wc), cqb.poll_ready(&mut wc[4..]));
        let after = ALLOCS.load(Ordering::Relaxed);
        assert_eq!((na, nb), (1, 1), "one signaled send, one datagram taken");
        assert!(wc[4].source.is_some());
        if round >= 10 {
            assert_eq!(
                after - before,
                0,
                "round {round}: polling a UD CQ allocated"
            );
        }
    }
    // The second datagram of each round found no receive posted: dropped and counted.
    assert_eq!(qb.ud_stats().unwrap().no_recv_dropped, 40);
}
