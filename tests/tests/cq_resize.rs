//! RESIZE_CQ (ABI 1.7): a CQ moved to a ring of another size keeps its unpolled completions
//! in order, goes on receiving completions across many laps of the new ring, refuses a size
//! that cannot hold what is waiting, and every bad input is a status with nothing changed.

use ringbell::*;
use ringbell_specs::cmd::{CmdOpcode, CmdStatus, ResizeCqIn};
use ringbell_tests::*;
use zerocopy::IntoBytes;

/// Posts `n` signaled 8-byte WRITEs from A to B with ids `first..first + n` and runs the
/// fabric until all have completed into A's CQ (nothing polled).
fn writes(p: &mut Pair, first: u64, n: u64) {
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 8)];
    for id in first..first + n {
        p.a.qp
            .post_send(&[SendWr::new(id, WrOp::Write(remote), &sge)])
            .unwrap();
    }
    settle(&p.fabric);
}

fn ids(p: &mut Pair) -> Vec<u64> {
    drain(&p.fabric, &mut p.a.cq)
        .iter()
        .map(|w| {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            w.wr_id
        })
        .collect()
}

/// [`writes`] in batches the send queue holds (its ring frees as completions are polled),
/// polling and checking each batch.
fn polled_writes(p: &mut Pair, first: u64, n: u64) {
    let mut id = first;
    while id < first + n {
        let k = (first + n - id).min(200);
        writes(p, id, k);
        assert_eq!(ids(p), (id..id + k).collect::<Vec<_>>());
        id += k;
    }
}

#[test]
fn a_grown_cq_keeps_its_completions_in_order_and_laps_the_new_ring() {
    let mut p = pair();
    assert_eq!(p.a.cq.capacity(), 1024);
    // The old ring's producer index past a lap boundary, then 200 waiting across it.
    polled_writes(&mut p, 0, 1000);
    writes(&mut p, 1000, 200);
    p.a.cq.resize(3000).unwrap();
    assert_eq!(p.a.cq.capacity(), 4096);
    assert_eq!(p.a.cq.query().unwrap().entries, 4096);
    assert_eq!(ids(&mut p), (1000..1200).collect::<Vec<_>>());
    // Three laps of the new ring.
    polled_writes(&mut p, 1200, 3 * 4096);
    assert!(!p.a.cq.query().unwrap().overflow);
}

#[test]
fn a_shrunk_cq_must_hold_what_waits() {
    let mut p = pair();
    writes(&mut p, 0, 5);
    // Two entries cannot hold five completions: refused, and nothing changes.
    match p.a.cq.resize(2) {
        Err(Error::Command { status, .. }) => assert_eq!(status, CmdStatus::BadSize),
        other => panic!("{other:?}"),
    }
    assert_eq!(p.a.cq.capacity(), 1024);
    // Eight can: the five move, in order, and the CQ goes on.
    p.a.cq.resize(8).unwrap();
    assert_eq!(p.a.cq.capacity(), 8);
    writes(&mut p, 5, 3);
    assert_eq!(ids(&mut p), (0..8).collect::<Vec<_>>());
    // Receives too: B's SEND lands in A's small CQ.
    let rs = [p.a.mr.sge(4096, 64)];
    p.a.qp
        .post_recv(&[RecvWr {
            wr_id: 77,
            sgl: &rs,
        }])
        .unwrap();
    let sge = [p.b.mr.sge(0, 16)];
    p.b.qp
        .post_send(&[SendWr::new(1, WrOp::Send, &sge)])
        .unwrap();
    let w = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((w[0].wr_id, w[0].opcode), (77, WcOpcode::Recv));
    // The same size again is nothing; 0 and beyond max_cqe are refused by the driver.
    p.a.cq.resize(7).unwrap();
    assert_eq!(p.a.cq.capacity(), 8);
    let max = p.a.dev.caps().max_cqe;
    for bad in [0, max + 1] {
        assert!(matches!(p.a.cq.resize(bad), Err(Error::InvalidArgument(_))));
    }
    assert_eq!(p.a.cq.capacity(), 8);
}

#[test]
fn a_resize_after_posting_finds_the_completions_of_the_work_before_it() {
    // The command takes the firmware's time: sends posted just before it have completed
    // into the old ring when it switches, so a ring too small for them is refused.
    let mut p = pair();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 8)];
    for id in 0..7 {
        p.a.qp
            .post_send(&[SendWr::new(id, WrOp::Write(remote), &sge)])
            .unwrap();
    }
    assert!(matches!(
        p.a.cq.resize(2),
        Err(Error::Command {
            status: CmdStatus::BadSize,
            ..
        })
    ));
    assert_eq!(ids(&mut p), (0..7).collect::<Vec<_>>());
}

#[test]
fn bad_resize_commands_are_statuses_and_change_nothing() {
    let mut p = pair();
    writes(&mut p, 0, 3);
    let ring = p.a.dev.alloc_dma(64 * 64).unwrap();
    let cqn = p.a.cq.cqn();
    let good = ResizeCqIn {
        cqn: cqn.into(),
        log_size: 6,
        ci: 0.into(),
        ring_iova: ring.iova().into(),
        ..Default::default()
    };
    let status = |input: ResizeCqIn| match p
        .a
        .dev
        .raw_command(CmdOpcode::ResizeCq as u16, input.as_bytes())
    {
        Err(Error::Command { status, .. }) => status,
        other => panic!("{other:?}"),
    };
    let cases = [
        (
            ResizeCqIn {
                cqn: 999.into(),
                ..good
            },
            CmdStatus::BadResource,
        ),
        (
            ResizeCqIn {
                log_size: 0,
                ..good
            },
            CmdStatus::BadSize,
        ),
        (
            ResizeCqIn {
                log_size: 31,
                ..good
            },
            CmdStatus::BadSize,
        ),
        (
            ResizeCqIn {
                log_size: 1,
                ..good
            },
            CmdStatus::BadSize,
        ),
        (
            ResizeCqIn {
                ring_iova: (ring.iova() + 8).into(),
                ..good
            },
            CmdStatus::BadParam,
        ),
        // A consumer index past what the device wrote.
        (
            ResizeCqIn {
                ci: 4.into(),
                ..good
            },
            CmdStatus::BadParam,
        ),
        // Memory the device cannot reach.
        (
            ResizeCqIn {
                ring_iova: (1u64 << 50).into(),
                ..good
            },
            CmdStatus::DmaFault,
        ),
    ];
    for (input, want) in cases {
        assert_eq!(status(input), want, "{input:?}");
    }
    let q = p.a.cq.query().unwrap();
    assert_eq!((q.entries, q.pi, q.ci), (1024, 3, 0));
    assert_eq!(ids(&mut p), vec![0, 1, 2]);
}

#[test]
fn an_armed_cq_stays_armed_across_a_resize() {
    let mut p = pair();
    p.a.cq.arm(false);
    p.a.cq.resize(16).unwrap();
    let completion = |p: &Pair| {
        std::iter::from_fn(|| p.a.dev.poll_event())
            .filter(|e| e.kind == ringbell_specs::cqe::EventType::Completion)
            .count()
    };
    assert_eq!(completion(&p), 0, "no CQE yet, no event");
    writes(&mut p, 0, 1);
    assert_eq!(completion(&p), 1, "the first CQE in the new ring fires it");
    assert_eq!(ids(&mut p), vec![0]);
}

/// An arm whose CI is behind the CI the device has already seen (a served NIC polls its
/// doorbell page and can take a CI stored after the arm first): a CQE waiting past the
/// newer CI fires the event at once, so a program that arms, polls and waits is woken.
#[test]
fn an_arm_seen_after_a_newer_ci_fires_for_what_waits_past_it() {
    let mut p = pair();
    let completion = |p: &Pair| {
        std::iter::from_fn(|| p.a.dev.poll_event())
            .filter(|e| e.kind == ringbell_specs::cqe::EventType::Completion)
            .count()
    };
    writes(&mut p, 0, 2);
    // The driver polls one (its CI doorbell says 1); the second waits.
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(p.a.cq.poll(&mut wc), 1);
    assert_eq!(p.a.cq.query().unwrap().ci, 1);
    // The arm the driver wrote before that poll (CI 0) arrives only now.
    let arm = ringbell_specs::regs::CQ_DB_BASE
        + u64::from(p.a.cq.cqn()) * ringbell_specs::regs::DB_STRIDE
        + ringbell_specs::regs::DB_CQ_ARM;
    p.a.dev.port().write32(arm, 0);
    settle(&p.fabric);
    assert_eq!(
        completion(&p),
        1,
        "the CQE past CI 1 fires the event at once"
    );
    assert!(!p.a.cq.query().unwrap().armed);
    // Nothing waits past the device's CI: such an arm waits for the next CQE.
    assert_eq!(ids(&mut p), vec![1]);
    p.a.dev.port().write32(arm, 1);
    settle(&p.fabric);
    assert_eq!(completion(&p), 0);
    assert!(p.a.cq.query().unwrap().armed);
    writes(&mut p, 2, 1);
    assert_eq!(completion(&p), 1);
}
