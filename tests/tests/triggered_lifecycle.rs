//! Counters and triggered operations across QP state changes, failures at fire time and the life of driver objects (PDs, parked counters).

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_specs::cmd::{CmdOpcode, CmdStatus, ObjectIn, QpAttr, QpAttrMask};
use ringbell_specs::cqe::EventType;
use ringbell_tests::*;
use zerocopy::IntoBytes;

fn remote(s: &Side, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: s.mr.addr() + off,
        rkey: s.mr.rkey(),
    }
}

/// A pair whose A side may have one READ/atomic outstanding as requester.
fn pair_rd1() -> Pair {
    let fabric = Fabric::new(FabricConfig::new(2, 1));
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    let o = ConnectOptions {
        max_rd_atomic: 1,
        ..Default::default()
    };
    connect(&mut a, &mut b, &o);
    Pair { a, b, fabric }
}

fn modify_state(qp: &mut QueuePair, to: QpState) {
    qp.modify(
        QpAttrMask::STATE,
        &QpAttr {
            state: to as u8,
            ..Default::default()
        },
    )
    .unwrap();
}

/// A triggered READ that waits for `max_rd_atomic` while its QP goes through SQD starts
/// once the QP is back in RTS (it used to wait forever, and the send queue with it).
#[test]
fn waiting_triggered_read_is_started_after_sqd_to_rts() {
    let mut p = pair_rd1();
    // A long READ holds the only rd_atomic credit.
    let big = [p.a.mr.sge(0, 512 * 1024)];
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::Read(remote(&p.b, 0)), &big)])
        .unwrap();
    let go = p.a.pd.create_counter().unwrap();
    let small = [p.a.mr.sge(600_000, 8)];
    p.a.qp
        .post_triggered(
            &go,
            1,
            &SendWr::new(2, WrOp::Read(remote(&p.b, 8)), &small),
            TriggerOpts {
                signaled: true,
                ..Default::default()
            },
        )
        .unwrap();
    go.add(1);
    while go.read().0 == 0 {
        p.fabric.step();
    }
    // The triggered READ has fired and waits behind the big READ. Drain the send queue.
    modify_state(&mut p.a.qp, QpState::Sqd);
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
    settle(&p.fabric);
    modify_state(&mut p.a.qp, QpState::Rts);
    // Back in RTS: the waiting triggered READ must run, and new posted work after it.
    let host = [p.a.mr.sge(700_000, 8)];
    p.a.qp
        .post_send(&[SendWr::new(3, WrOp::Write(remote(&p.b, 64)), &host)])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 2);
    let got: Vec<(u64, WcStatus)> = wc.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, vec![(2, WcStatus::Success), (3, WcStatus::Success)]);
}

/// Two triggered READs, the second waiting for the first's credit: the credit freed in SQD,
/// a larger `max_rd_atomic` and the return to RTS start it (they used not to).
#[test]
fn waiting_triggered_read_is_started_after_sqd_raises_max_rd_atomic() {
    let mut p = pair_rd1();
    let go = p.a.pd.create_counter().unwrap();
    let big = [p.a.mr.sge(0, 512 * 1024)];
    let small = [p.a.mr.sge(600_000, 8)];
    for (id, sgl, off) in [(1u64, &big, 0u64), (2, &small, 8)] {
        p.a.qp
            .post_triggered(
                &go,
                1,
                &SendWr::new(id, WrOp::Read(remote(&p.b, off)), sgl),
                TriggerOpts {
                    signaled: true,
                    ..Default::default()
                },
            )
            .unwrap();
    }
    go.add(1);
    while go.read().0 == 0 {
        p.fabric.step();
    }
    modify_state(&mut p.a.qp, QpState::Sqd);
    // The first READ completes in SQD; the second is still waiting for a credit.
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
    settle(&p.fabric);
    // SQD -> SQD raising the limit, then back to RTS.
    p.a.qp
        .modify(
            QpAttrMask::STATE | QpAttrMask::MAX_QP_RD_ATOMIC,
            &QpAttr {
                state: QpState::Sqd as u8,
                max_rd_atomic: 16,
                ..Default::default()
            },
        )
        .unwrap();
    modify_state(&mut p.a.qp, QpState::Rts);
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::Success));
}

/// A triggered transfer that fails its local checks at fire time fails in its turn, behind
/// NIC tasks that fired before it and wait for `max_rd_atomic` (it used to overtake them,
/// and the earlier READ was flushed instead of run).
#[test]
fn failed_triggered_transfer_does_not_overtake_an_earlier_waiting_one() {
    let mut p = pair_rd1();
    let big = [p.a.mr.sge(0, 512 * 1024)];
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::Read(remote(&p.b, 0)), &big)])
        .unwrap();
    let go = p.a.pd.create_counter().unwrap();
    let small = [p.a.mr.sge(600_000, 8)];
    let signaled = TriggerOpts {
        signaled: true,
        ..Default::default()
    };
    // Fires first, waits for the credit held by READ 1.
    p.a.qp
        .post_triggered(
            &go,
            1,
            &SendWr::new(2, WrOp::Read(remote(&p.b, 8)), &small),
            signaled,
        )
        .unwrap();
    // Fires second, fails its lkey check.
    let mut bad = p.a.mr.sge(600_100, 8);
    bad.lkey ^= 0x00ab_cd00;
    let bad = [bad];
    p.a.qp
        .post_triggered(
            &go,
            1,
            &SendWr::new(3, WrOp::Write(remote(&p.b, 16)), &bad),
            signaled,
        )
        .unwrap();
    go.add(1);
    let wc = wait(&p.fabric, &mut p.a.cq, 3);
    let got: Vec<(u64, WcStatus)> = wc.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::LocProtErr)
        ]
    );
}

/// Dropping a counter that an operation still names raises no IOMMU fault: the driver
/// cancels the operations that name it and keeps the writeback mapped while the device may
/// write it (the buffer used to be unmapped).
#[test]
fn parked_counter_change_raises_no_iommu_fault() {
    let p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    c.post_triggered_add(5, &t, 1, 0).unwrap();
    drop(t); // parked: c's operation names it
    c.add(5);
    settle(&p.fabric);
    let mut evs = Vec::new();
    while let Some(e) = p.a.dev.poll_event() {
        evs.push(e);
    }
    assert!(
        !evs.iter().any(|e| e.kind == EventType::IommuFault),
        "spurious events: {evs:?}"
    );
}

/// A counter holds its PD: dropping the PD before the counter frees it once the counter
/// goes (FREE_PD used to fail silently and leak the PD).
#[test]
fn dropping_a_pd_before_its_counter_frees_the_pd() {
    let p = pair();
    let pd = p.a.dev.alloc_pd().unwrap();
    let pdn = pd.pdn();
    let c = pd.create_counter().unwrap();
    drop(pd);
    drop(c);
    // The PD should be gone now: FREE_PD of it is BAD_RESOURCE.
    let r = p.a.dev.raw_command(
        CmdOpcode::FreePd as u16,
        ObjectIn { num: pdn.into() }.as_bytes(),
    );
    match r {
        Err(Error::Command { status, .. }) => assert_eq!(status, CmdStatus::BadResource),
        other => panic!("PD {pdn} was still allocated (leaked): {other:?}"),
    }
}
