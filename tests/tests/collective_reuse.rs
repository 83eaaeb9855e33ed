//! Collectives reused one after the other, and remote-access counting of atomics.

use ringbell::collective::{CollMember, Peer};
use ringbell::*;
use ringbell_tests::*;

/// Barrier 2 completes when a peer arms and starts it before this rank has armed it
/// (thresholds used to be read from the counters at arm time: one too high here).
#[test]
fn second_barrier_completes_when_a_peer_starts_before_this_rank_arms() {
    let p = pair();
    let ma = CollMember::new(&p.a.pd, 64).unwrap();
    let mb = CollMember::new(&p.b.pd, 64).unwrap();
    let to_b = Peer {
        qp: &p.a.qp,
        remote: mb.remote(),
    };
    let to_a = Peer {
        qp: &p.b.qp,
        remote: ma.remote(),
    };
    // Barrier 1: both armed, then both started.
    let ra = ma.arm_barrier(None, &[to_b]).unwrap();
    let rb = mb.arm_barrier(Some(to_a), &[]).unwrap();
    ra.start();
    rb.start();
    settle(&p.fabric);
    assert!(ra.is_done() && rb.is_done(), "barrier 1");
    // Barrier 2: the leaf is quicker.
    let rb = mb.arm_barrier(Some(to_a), &[]).unwrap();
    rb.start();
    settle(&p.fabric);
    let ra = ma.arm_barrier(None, &[to_b]).unwrap();
    ra.start();
    settle(&p.fabric);
    assert!(
        ra.is_done() && rb.is_done(),
        "barrier 2 hung: root {:?}, leaf {:?}",
        ma.arrivals.get(),
        mb.arrivals.get()
    );
}

/// ABI 15.4: "Only accepted requests count ... a request the responder NAKs counts nothing
/// anywhere." An atomic whose target the IOMMU does not map passes the key check, is counted
/// (REMOTE_WRITE is scheduled in `rx_atomic`), then faults when it executes and is NAKed:
/// the requester sees an error, the target's counter a success.
#[test]
fn atomic_that_faults_at_the_target_is_not_counted() {
    let mut p = pair();
    // An MR over an IOVA nothing is mapped at.
    let hole = 0x7f00_0000_0000u64;
    let mr =
        p.b.pd
            .reg_mr_raw(
                hole,
                4096,
                hole,
                Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
            )
            .unwrap();
    let c = p.b.pd.create_counter().unwrap();
    c.bind_mr(&mr, CntrEvents::REMOTE_WRITE).unwrap();
    let res = [p.a.mr.sge(0, 8)];
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::FetchAdd {
                remote: RemoteAddr {
                    addr: hole,
                    rkey: mr.rkey(),
                },
                add: 1,
            },
            &res,
        )])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(got.len(), 1);
    assert_ne!(got[0].1, WcStatus::Success, "{got:?}");
    assert_eq!(c.read(), (0, 0), "a NAKed atomic was counted");
}
