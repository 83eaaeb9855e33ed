//! Every bad input of ABI v1: each gets the exact status or event the ABI specifies, and the
//! emulator keeps serving every other QP afterwards.

use ringbell::*;
use ringbell_specs::cmd::{CmdStatus, QpState};
use ringbell_specs::cqe::{DoorbellError, EventType, VendorSyndrome};
use ringbell_specs::regs;
use ringbell_tests::*;

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// After a fault on `p`, a fresh QP pair on the same devices still moves data correctly.
fn still_serving(p: &mut Pair) {
    let mut ia = QpInit::new(&p.a.cq, &p.a.cq);
    ia.max_inline = 0;
    let mut ib = QpInit::new(&p.b.cq, &p.b.cq);
    ib.max_inline = 0;
    let mut qa = p.a.pd.create_qp(&ia).unwrap();
    let mut qb = p.b.pd.create_qp(&ib).unwrap();
    let o = ConnectOptions::default();
    qa.connect(&qb.endpoint(5), 5, &o).unwrap();
    qb.connect(&qa.endpoint(5), 5, &o).unwrap();
    drain(&p.fabric, &mut p.a.cq);
    drain(&p.fabric, &mut p.b.cq);
    p.a.buf.write(900_000, b"still serving").unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 900_000,
        rkey: p.b.mr.rkey(),
    };
    qa.post_send(&[SendWr::new(
        4242,
        WrOp::Write(remote),
        &[p.a.mr.sge(900_000, 13)],
    )])
    .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (4242, WcStatus::Success));
    let mut got = [0u8; 13];
    p.b.buf.read(900_000, &mut got).unwrap();
    assert_eq!(&got, b"still serving");
}

fn qp_state(qp: &QueuePair) -> QpState {
    QpState::from_u8(qp.query().unwrap().state).unwrap()
}

fn events(dev: &Device) -> Vec<AsyncEvent> {
    std::iter::from_fn(|| dev.poll_event()).collect()
}

#[test]
fn unknown_opcode_and_malformed_segments_are_local_qp_op_errors_and_flush_the_rest() {
    for bad in [
        // Unknown opcode 0x7f, one segment.
        {
            let mut w = [0u8; 16];
            w[0] = 0x7f;
            w[4] = 1;
            w.to_vec()
        },
        // ds_count 0.
        {
            let mut w = [0u8; 16];
            w[0] = 0x03;
            w[4] = 0;
            w.to_vec()
        },
        // WRITE with no room for its remote-address segment (ds_count 1).
        {
            let mut w = [0u8; 16];
            w[0] = 0x03;
            w[4] = 1;
            w.to_vec()
        },
        // Inline flag without the inline mark.
        {
            let mut w = [0u8; 64];
            w[0] = 0x01;
            w[1] = 0x08 | 1;
            w[4] = 2;
            w.to_vec()
        },
    ] {
        let mut p = pair();
        let remote = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        };
        p.a.qp.post_raw_wqe(1, &bad).unwrap();
        let sge = [p.a.mr.sge(0, 8)];
        p.a.qp
            .post_send(&[
                SendWr::new(2, WrOp::Write(remote), &sge),
                SendWr::new(3, WrOp::Send, &sge),
            ])
            .unwrap();
        let got = outcomes(&p.fabric, &mut p.a.cq);
        assert_eq!(
            got,
            vec![
                (1, WcStatus::LocQpOpErr),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ],
            "{bad:02x?}"
        );
        assert_eq!(qp_state(&p.a.qp), QpState::Err);
        assert_eq!(p.fabric.nic_stats(0).tx_frames, 0, "nothing was sent");
        still_serving(&mut p);
    }
}

#[test]
fn bad_lkeys_are_local_protection_errors() {
    for syndrome in [
        VendorSyndrome::BadLkey,
        VendorSyndrome::WrongPd,
        VendorSyndrome::OutOfBounds,
        VendorSyndrome::NoAccess,
    ] {
        let mut p = pair();
        let other_pd = p.a.dev.alloc_pd().unwrap();
        let foreign = other_pd.reg_mr(&p.a.buf, Access::LOCAL_WRITE).unwrap();
        let readonly = p.a.pd.reg_mr(&p.a.buf, Access::empty()).unwrap();
        let remote = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        };
        let (op, sge) = match syndrome {
            VendorSyndrome::BadLkey => (
                WrOp::Write(remote),
                Sge {
                    addr: p.a.mr.addr(),
                    len: 8,
                    lkey: 0xdead_0000,
                },
            ),
            VendorSyndrome::WrongPd => (WrOp::Write(remote), foreign.sge(0, 8)),
            VendorSyndrome::OutOfBounds => (WrOp::Write(remote), p.a.mr.sge(BUF as u64 - 4, 8)),
            // A READ scatters into local memory: it needs LOCAL_WRITE.
            _ => (WrOp::Read(remote), readonly.sge(0, 8)),
        };
        p.a.qp
            .post_send(&[
                SendWr::new(9, op, &[sge]),
                SendWr::inline(10, WrOp::Send, b""),
            ])
            .unwrap();
        let wc = drain(&p.fabric, &mut p.a.cq);
        let got: Vec<_> = wc
            .iter()
            .map(|w| (w.wr_id, w.status, w.vendor_syndrome))
            .collect();
        assert_eq!(
            got,
            vec![
                (9, WcStatus::LocProtErr, syndrome as u8),
                (10, WcStatus::WrFlushErr, 0)
            ],
            "{syndrome:?}"
        );
        assert_eq!(qp_state(&p.a.qp), QpState::Err);
        assert_eq!(
            p.fabric.nic_stats(0).tx_frames,
            0,
            "{syndrome:?}: nothing was sent"
        );
        drop((foreign, readonly, other_pd));
        still_serving(&mut p);
    }
}

#[test]
fn bad_receive_buffer_key_fails_both_sides_with_class_a() {
    // A key that does not exist, one of another PD, one without LOCAL_WRITE.
    for case in 0..3 {
        let mut p = pair();
        let other_pd = p.b.dev.alloc_pd().unwrap();
        let foreign = other_pd.reg_mr(&p.b.buf, Access::LOCAL_WRITE).unwrap();
        let readonly = p.b.pd.reg_mr(&p.b.buf, Access::empty()).unwrap();
        let sge = match case {
            0 => Sge {
                addr: p.b.mr.addr(),
                len: 64,
                lkey: 0x1234_5600,
            },
            1 => foreign.sge(0, 64),
            _ => readonly.sge(0, 64),
        };
        p.b.buf.fill(0, 64, 0xcc).unwrap();
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 5,
                sgl: &[sge],
            }])
            .unwrap();
        p.a.qp
            .post_send(&[SendWr::inline(6, WrOp::Send, b"x")])
            .unwrap();
        let s = drain(&p.fabric, &mut p.a.cq);
        assert_eq!(
            (s[0].wr_id, s[0].status),
            (6, WcStatus::RemOpErr),
            "case {case}"
        );
        let r = drain(&p.fabric, &mut p.b.cq);
        assert_eq!(
            (r[0].wr_id, r[0].status),
            (5, WcStatus::LocProtErr),
            "case {case}"
        );
        assert_eq!(qp_state(&p.a.qp), QpState::Err);
        assert_eq!(qp_state(&p.b.qp), QpState::Err);
        let mut got = [0u8; 64];
        p.b.buf.read(0, &mut got).unwrap();
        assert!(
            got.iter().all(|b| *b == 0xcc),
            "case {case}: nothing written"
        );
        drop((foreign, readonly, other_pd));
        still_serving(&mut p);
    }
}

#[test]
fn bad_rkeys_are_remote_access_errors_and_leave_memory_untouched() {
    let limited = [
        Access::LOCAL_WRITE,
        Access::LOCAL_WRITE | Access::REMOTE_READ,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    ];
    for case in 0..6 {
        let mut p = pair();
        let mr =
            p.b.pd
                .reg_mr_range(&p.b.buf, 4096, 4096, limited[case % 3])
                .unwrap();
        p.b.buf.fill(0, BUF, 0xcc).unwrap();
        let res = [p.a.mr.sge(0, 8)];
        let src = [p.a.mr.sge(0, 64)];
        let (op, sgl): (WrOp, &[Sge]) = match case {
            0 => (
                WrOp::Write(RemoteAddr {
                    addr: mr.addr(),
                    rkey: mr.rkey() ^ 0x100,
                }),
                &src,
            ), // wrong key
            1 => (
                WrOp::Write(RemoteAddr {
                    addr: mr.addr() + 4090,
                    rkey: mr.rkey(),
                }),
                &src,
            ), // out of bounds
            2 => (
                WrOp::Read(RemoteAddr {
                    addr: mr.addr(),
                    rkey: mr.rkey(),
                }),
                &src,
            ), // LOCAL_WRITE|REMOTE_WRITE: no REMOTE_READ
            3 => (
                WrOp::Write(RemoteAddr {
                    addr: mr.addr(),
                    rkey: mr.rkey(),
                }),
                &src,
            ), // no REMOTE_WRITE
            4 => (
                WrOp::FetchAdd {
                    remote: RemoteAddr {
                        addr: mr.addr(),
                        rkey: mr.rkey(),
                    },
                    add: 1,
                },
                &res,
            ), // no REMOTE_ATOMIC
            _ => (
                WrOp::Read(RemoteAddr {
                    addr: mr.addr() - 8,
                    rkey: mr.rkey(),
                }),
                &src,
            ), // below the MR
        };
        let mr = if case == 2 {
            p.b.pd
                .reg_mr_range(
                    &p.b.buf,
                    4096,
                    4096,
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                )
                .unwrap()
        } else {
            mr
        };
        let op = match (case, op) {
            (2, WrOp::Read(_)) => WrOp::Read(RemoteAddr {
                addr: mr.addr(),
                rkey: mr.rkey(),
            }),
            (_, o) => o,
        };
        p.a.qp
            .post_send(&[SendWr::new(1, op, sgl), SendWr::new(2, WrOp::Send, sgl)])
            .unwrap();
        let got = outcomes(&p.fabric, &mut p.a.cq);
        assert_eq!(
            got,
            vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)],
            "case {case}"
        );
        assert_eq!(qp_state(&p.a.qp), QpState::Err);
        assert_eq!(
            qp_state(&p.b.qp),
            QpState::Err,
            "the responder's QP goes to ERR too"
        );
        assert!(events(&p.b.dev)
            .iter()
            .any(|e| e.kind == EventType::QpAccessErr && e.obj == p.b.qp.qpn()));
        let mut mem = vec![0u8; BUF];
        p.b.buf.read(0, &mut mem).unwrap();
        assert!(
            mem.iter().all(|b| *b == 0xcc),
            "case {case}: responder memory touched"
        );
        drop(mr);
        still_serving(&mut p);
    }
}

#[test]
fn receive_buffer_too_small_is_a_local_length_error() {
    let mut p = pair();
    let small = [p.b.mr.sge(0, 100)];
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 8,
            sgl: &small,
        }])
        .unwrap();
    p.b.buf.fill(0, 4096, 0xcc).unwrap();
    let big = [p.a.mr.sge(0, 5000)];
    p.a.qp
        .post_send(&[SendWr::new(9, WrOp::Send, &big)])
        .unwrap();
    let r = drain(&p.fabric, &mut p.b.cq);
    assert_eq!((r[0].wr_id, r[0].status), (8, WcStatus::LocLenErr));
    let s = drain(&p.fabric, &mut p.a.cq);
    assert_eq!((s[0].wr_id, s[0].status), (9, WcStatus::RemInvReqErr));
    still_serving(&mut p);
}

#[test]
fn posting_beyond_the_ring_is_refused_before_touching_it() {
    let mut p = pair();
    let free = p.a.qp.sq_free();
    let wrs: Vec<SendWr> = (0..free as u64 + 1)
        .map(|i| SendWr::inline(i, WrOp::Send, b"").flags(SendFlags::empty()))
        .collect();
    let sent_before = p.fabric.nic_stats(0).tx_frames;
    match p.a.qp.post_send(&wrs) {
        Err(Error::QueueFull {
            free: 0, needed: 1, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // The ones that fitted were posted; nothing beyond the ring was written.
    assert_eq!(p.a.qp.sq_free(), 0);
    let _ = sent_before;
    // Receive queue too.
    let rs = [p.b.mr.sge(0, 8)];
    let many: Vec<RecvWr> = (0..300).map(|i| RecvWr { wr_id: i, sgl: &rs }).collect();
    assert!(matches!(
        p.b.qp.post_recv(&many),
        Err(Error::QueueFull { .. })
    ));
}

#[test]
fn doorbell_beyond_what_was_posted_is_reported_and_reads_nothing() {
    let mut p = pair();
    let qpn = p.a.qp.qpn();
    let db = regs::QP_DB_BASE + qpn as u64 * regs::DB_STRIDE + regs::DB_SQ;
    // Further ahead than the ring holds.
    p.a.dev.port().write32(db, 100_000);
    settle(&p.fabric);
    let ev = events(&p.a.dev);
    assert!(
        ev.iter().any(|e| e.kind == EventType::DoorbellError
            && e.subtype == DoorbellError::IndexOutOfRange as u8
            && e.obj == qpn),
        "{ev:?}"
    );
    // Within the ring but over blocks never written.
    p.a.dev.port().write32(db, 3);
    settle(&p.fabric);
    let ev = events(&p.a.dev);
    assert!(
        ev.iter()
            .any(|e| e.kind == EventType::DoorbellError
                && e.subtype == DoorbellError::StaleWqe as u8),
        "{ev:?}"
    );
    assert_eq!(
        p.fabric.nic_stats(0).tx_frames,
        0,
        "no stale WQE was executed"
    );
    assert!(drain(&p.fabric, &mut p.a.cq).is_empty());
    // The QP itself still works: the device forgot the bad doorbell.
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Write(remote), b"ok")])
        .unwrap();
    assert_eq!(wait(&p.fabric, &mut p.a.cq, 1)[0].status, WcStatus::Success);
    // A doorbell for a QP that does not exist.
    p.a.dev
        .port()
        .write32(regs::QP_DB_BASE + 4000 * regs::DB_STRIDE, 1);
    settle(&p.fabric);
    assert!(events(&p.a.dev)
        .iter()
        .any(|e| e.kind == EventType::DoorbellError
            && e.subtype == DoorbellError::NoSuchObject as u8
            && e.obj == 4000));
    still_serving(&mut p);
}

#[test]
fn dma_outside_every_mapping_is_an_iommu_fault() {
    let mut p = pair();
    let hole = 0x7000_0000_0000u64;
    let ghost =
        p.a.pd
            .reg_mr_raw(hole, 4096, hole, Access::LOCAL_WRITE)
            .unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    p.b.buf.fill(0, 4096, 0xcc).unwrap();
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::Write(remote), &[ghost.sge(0, 64)])])
        .unwrap();
    let wc = drain(&p.fabric, &mut p.a.cq);
    assert_eq!(
        (wc[0].status, wc[0].vendor_syndrome),
        (WcStatus::GeneralErr, VendorSyndrome::IommuFault as u8)
    );
    let ev = events(&p.a.dev);
    assert!(
        ev.iter()
            .any(|e| e.kind == EventType::IommuFault && e.info == hole),
        "{ev:?}"
    );
    let mut mem = vec![0u8; 4096];
    p.b.buf.read(0, &mut mem).unwrap();
    assert!(mem.iter().all(|b| *b == 0xcc));
    // The responder side: a remote MR over unmapped IOVA.
    let mut p = pair();
    let ghost_b = p.b.pd.reg_mr_raw(hole, 4096, hole, all()).unwrap();
    let remote = RemoteAddr {
        addr: hole,
        rkey: ghost_b.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::inline(2, WrOp::Write(remote), b"data")])
        .unwrap();
    let wc = drain(&p.fabric, &mut p.a.cq);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::RemOpErr));
    assert!(events(&p.b.dev)
        .iter()
        .any(|e| e.kind == EventType::IommuFault && e.info == hole));
    still_serving(&mut p);
}

#[test]
fn cq_overflow_raises_the_cq_error_event() {
    let mut p = pair();
    let mut tiny = p.a.dev.create_cq(2).unwrap();
    let mut init = QpInit::new(&tiny, &tiny);
    init.max_inline = 64;
    let mut qa = p.a.pd.create_qp(&init).unwrap();
    let mut qb = p.b.pd.create_qp(&QpInit::new(&p.b.cq, &p.b.cq)).unwrap();
    let o = ConnectOptions::default();
    qa.connect(&qb.endpoint(1), 1, &o).unwrap();
    qb.connect(&qa.endpoint(1), 1, &o).unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let wrs: Vec<SendWr> = (0..5)
        .map(|i| SendWr::inline(i, WrOp::Write(remote), b"z"))
        .collect();
    qa.post_send(&wrs).unwrap();
    settle(&p.fabric);
    let ev = events(&p.a.dev);
    assert!(
        ev.iter()
            .any(|e| e.kind == EventType::CqError && e.obj == tiny.cqn()),
        "{ev:?}"
    );
    assert!(tiny.query().unwrap().overflow);
    assert_eq!(
        drain(&p.fabric, &mut tiny).len(),
        2,
        "the ring holds what fitted"
    );
    drop(qa);
    still_serving(&mut p);
}

#[test]
fn malformed_commands_get_status_codes() {
    let mut p = pair();
    let dev = &p.a.dev;
    let status = |r: Result<[u8; 112], Error>| match r {
        Err(Error::Command { status, .. }) => Some(status as u8),
        Err(Error::RawCommand { status, .. }) => Some(status),
        Ok(_) => None,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        status(dev.raw_command(0x7777, &[])),
        Some(CmdStatus::BadOpcode as u8)
    );
    // Object numbers out of range.
    for op in [0x11u16, 0x31, 0x32, 0x42, 0x43, 0x52] {
        assert_eq!(
            status(dev.raw_command(op, &0x00ff_ffffu32.to_le_bytes())),
            Some(CmdStatus::BadResource as u8),
            "op {op:#x}"
        );
    }
    // CQ of size 0 and beyond the limit.
    assert!(matches!(dev.create_cq(0), Err(Error::InvalidArgument(_))));
    let mut cq_in = [0u8; 24];
    cq_in[0] = 0;
    assert_eq!(
        status(dev.raw_command(0x30, &cq_in)),
        Some(CmdStatus::BadSize as u8)
    );
    cq_in[0] = 31;
    assert_eq!(
        status(dev.raw_command(0x30, &cq_in)),
        Some(CmdStatus::BadSize as u8)
    );
    // A QP naming a CQ that exists only on another device.
    let other_cq = p.b.dev.create_cq(4096).unwrap();
    let mut qp_in = [0u8; 48];
    qp_in[0..4].copy_from_slice(&p.a.pd.pdn().to_le_bytes());
    qp_in[4..8].copy_from_slice(&(other_cq.cqn() + 50).to_le_bytes());
    qp_in[8..12].copy_from_slice(&(other_cq.cqn() + 50).to_le_bytes());
    qp_in[16] = 4;
    qp_in[17] = 4;
    qp_in[18] = 4;
    assert_eq!(
        status(dev.raw_command(0x40, &qp_in)),
        Some(CmdStatus::BadResource as u8)
    );
    // The typed API refuses another device's CQ outright.
    assert!(matches!(
        p.a.pd.create_qp(&QpInit::new(&other_cq, &other_cq)),
        Err(Error::InvalidArgument(_))
    ));
    // Sizes 0 and beyond the limit for a QP.
    qp_in[4..8].copy_from_slice(&p.a.cq.cqn().to_le_bytes());
    qp_in[8..12].copy_from_slice(&p.a.cq.cqn().to_le_bytes());
    qp_in[16] = 0;
    assert_eq!(
        status(dev.raw_command(0x40, &qp_in)),
        Some(CmdStatus::BadSize as u8)
    );
    qp_in[16] = 30;
    assert_eq!(
        status(dev.raw_command(0x40, &qp_in)),
        Some(CmdStatus::BadSize as u8)
    );
    // An MR of length 0, bad access flags (REMOTE_WRITE without LOCAL_WRITE).
    assert!(matches!(
        p.a.pd.reg_mr_raw(0x1000, 0, 0x1000, Access::LOCAL_WRITE),
        Err(Error::Command {
            status: CmdStatus::BadSize,
            ..
        })
    ));
    assert!(matches!(
        p.a.pd.reg_mr_raw(0x1000, 64, 0x1000, Access::REMOTE_WRITE),
        Err(Error::Command {
            status: CmdStatus::BadParam,
            ..
        })
    ));
    // REREG_MR: every refusal leaves the region as it was; a key no MR has is BAD_RESOURCE.
    let mut mr =
        p.a.pd
            .reg_mr_raw(0x1000, 64, 0x1000, Access::LOCAL_WRITE)
            .unwrap();
    let refused = |r: Result<(), Error>| match r {
        Err(Error::Command { status, .. }) => Some(status),
        _ => None,
    };
    assert_eq!(
        refused(mr.rereg_raw(&Rereg::default())),
        Some(CmdStatus::BadParam),
        "nothing to change"
    );
    let remote_only = Rereg {
        access: Some(Access::REMOTE_WRITE),
        ..Default::default()
    };
    assert_eq!(
        refused(mr.rereg_raw(&remote_only)),
        Some(CmdStatus::BadParam)
    );
    let empty = Rereg {
        range: Some((0x2000, 0, 0x2000)),
        ..Default::default()
    };
    assert_eq!(refused(mr.rereg_raw(&empty)), Some(CmdStatus::BadSize));
    let wraps = Rereg {
        range: Some((u64::MAX - 8, 64, 0x2000)),
        ..Default::default()
    };
    assert_eq!(refused(mr.rereg_raw(&wraps)), Some(CmdStatus::BadSize));
    let foreign = Rereg {
        pd: Some(&p.b.pd),
        ..Default::default()
    };
    assert!(matches!(
        mr.rereg_raw(&foreign),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        (mr.addr(), mr.len(), mr.access(), mr.pdn()),
        (0x1000, 64, Access::LOCAL_WRITE, p.a.pd.pdn())
    );
    let mut rereg_in = [0u8; 40];
    rereg_in[..4].copy_from_slice(&(mr.lkey() ^ 0xFF).to_le_bytes());
    rereg_in[4..8].copy_from_slice(&4u32.to_le_bytes());
    assert_eq!(
        status(dev.raw_command(0x22, &rereg_in)),
        Some(CmdStatus::BadResource as u8)
    );
    drop(mr);
    // Illegal QP transition: RTS -> INIT.
    let attr = ringbell_specs::cmd::QpAttr {
        state: QpState::Init as u8,
        ..Default::default()
    };
    assert!(matches!(
        p.a.qp.modify(ringbell_specs::cmd::QpAttrMask::STATE, &attr),
        Err(Error::Command {
            status: CmdStatus::BadState,
            ..
        })
    ));
    // Freeing a PD still in use.
    assert_eq!(
        status(dev.raw_command(0x11, &p.a.pd.pdn().to_le_bytes())),
        Some(CmdStatus::Busy as u8)
    );
    drop(other_cq);
    still_serving(&mut p);
}

#[test]
fn posting_in_the_wrong_state_and_the_drain_idiom() {
    let f = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(2, 3));
    let mut s = side(&f, 0, all());
    assert!(matches!(
        s.qp.post_send(&[SendWr::inline(1, WrOp::Send, b"")]),
        Err(Error::InvalidState {
            state: QpState::Reset,
            ..
        })
    ));
    assert!(matches!(
        s.qp.post_recv(&[RecvWr { wr_id: 1, sgl: &[] }]),
        Err(Error::InvalidState { .. })
    ));
    let mut p = pair();
    p.a.qp.to_error().unwrap();
    p.a.qp
        .post_send(&[SendWr::inline(77, WrOp::Send, b"")])
        .unwrap();
    let rs = [p.a.mr.sge(0, 8)];
    p.a.qp
        .post_recv(&[RecvWr {
            wr_id: 78,
            sgl: &rs,
        }])
        .unwrap();
    let wc = drain(&p.fabric, &mut p.a.cq);
    let mut got: Vec<_> = wc.iter().map(|w| (w.wr_id, w.status)).collect();
    got.sort_by_key(|g| g.0);
    assert_eq!(
        got,
        vec![(77, WcStatus::WrFlushErr), (78, WcStatus::WrFlushErr)]
    );
    still_serving(&mut p);
}

#[test]
fn garbage_frames_are_dropped_and_counted() {
    let mut p = pair();
    let before = p.fabric.nic_stats(1);
    for frame in [vec![], vec![0u8; 10], vec![0xffu8; 200], {
        let mut v = vec![0u8; 100];
        v[12] = 0x08;
        v
    }] {
        p.fabric.inject_frame(1, frame);
    }
    settle(&p.fabric);
    let after = p.fabric.nic_stats(1);
    assert_eq!(after.rx_malformed - before.rx_malformed, 4);
    assert_eq!(after.tx_frames, before.tx_frames, "no answer to garbage");
    still_serving(&mut p);
}

#[test]
fn completions_in_flight_do_not_reach_a_recreated_cq() {
    let mut p = pair();
    let cq = p.a.dev.create_cq(256).unwrap();
    let cqn = cq.cqn();
    let mut init = QpInit::new(&cq, &cq);
    init.max_inline = 0;
    let mut qa = p.a.pd.create_qp(&init).unwrap();
    let mut qb = p.b.pd.create_qp(&QpInit::new(&p.b.cq, &p.b.cq)).unwrap();
    let o = ConnectOptions::default();
    qa.connect(&qb.endpoint(3), 3, &o).unwrap();
    qb.connect(&qa.endpoint(3), 3, &o).unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 4096)];
    let wrs: Vec<SendWr> = (0..64)
        .map(|i| SendWr::new(i, WrOp::Write(remote), &sge))
        .collect();
    qa.post_send(&wrs).unwrap();
    // Destroy QP and CQ while completions are still on their way, then take the same CQN.
    drop(qa);
    drop(cq);
    let mut fresh = p.a.dev.create_cq(256).unwrap();
    assert_eq!(fresh.cqn(), cqn, "the CQN is reused");
    assert!(
        drain(&p.fabric, &mut fresh).is_empty(),
        "a stale completion reached the new CQ"
    );
    drop(qb);
    still_serving(&mut p);
}

#[test]
fn reset_with_completions_in_flight_then_reuse() {
    // SENDs stuck behind RNR, then ERR (flush), then RESET while flush CQEs are on their way:
    // the driver skips completions of the old incarnation and the QP works again after a
    // fresh connect.
    let mut p = pair();
    let wrs: Vec<SendWr> = (0..8)
        .map(|i| SendWr::inline(i, WrOp::Send, b"early"))
        .collect();
    p.a.qp.post_send(&wrs).unwrap();
    for _ in 0..40 {
        p.fabric.step();
    }
    p.a.qp.to_error().unwrap();
    reset_a(&mut p);
    let stale = drain(&p.fabric, &mut p.a.cq);
    assert!(
        stale
            .iter()
            .all(|w| w.status == WcStatus::WrFlushErr && w.wr_id < 8),
        "{stale:?}"
    );
    assert_eq!(
        p.a.qp.sq_free(),
        256 * 4 / 4 * 4,
        "the ring is whole again after RESET"
    );
    send_again_after_reset(&mut p);
}

/// Moves A's QP to RESET.
fn reset_a(p: &mut Pair) {
    let attr = ringbell_specs::cmd::QpAttr {
        state: QpState::Reset as u8,
        ..Default::default()
    };
    p.a.qp
        .modify(ringbell_specs::cmd::QpAttrMask::STATE, &attr)
        .unwrap();
}

/// Reconnects A's reset QP to B (B's receive side expects A's PSN 100 onwards: B never got
/// anything) and sends one message, the first request of A's new incarnation (ring index 0):
/// it completes as itself, and is the only completion A sees.
fn send_again_after_reset(p: &mut Pair) {
    let eb = p.b.qp.endpoint(9000);
    p.a.qp
        .connect(&eb, 100, &ConnectOptions::default())
        .unwrap();
    let rs = [p.b.mr.sge(0, 64)];
    p.b.qp.post_recv(&[RecvWr { wr_id: 1, sgl: &rs }]).unwrap();
    p.a.qp
        .post_send(&[SendWr::inline(50, WrOp::Send, b"again")])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status),
        (50, WcStatus::Success),
        "{wc:?}"
    );
    assert!(drain(&p.fabric, &mut p.a.cq).is_empty());
    assert_eq!(wait(&p.fabric, &mut p.b.cq, 1)[0].byte_len, 5);
}

#[test]
fn completions_left_in_the_cq_at_reset_do_not_complete_new_requests() {
    // As rdma-core's providers clean a reset QP's completions from its CQs: flush completions
    // still unpolled in the CQ when the QP is reset (its ring indices start again at 0) are
    // never reported, and the first request after the reset completes as itself.
    let mut p = pair();
    let wrs: Vec<SendWr> = (0..8)
        .map(|i| SendWr::inline(i, WrOp::Send, b"early"))
        .collect();
    p.a.qp.post_send(&wrs).unwrap();
    p.a.qp.to_error().unwrap();
    // Every flush completion lands in the CQ; none is polled.
    for _ in 0..20_000 {
        p.fabric.step();
    }
    reset_a(&mut p);
    // Index 0 again: an old completion of index 0 would report the new request as flushed.
    send_again_after_reset(&mut p);
}

#[test]
fn a_reregistered_region_moves_keeps_its_key_and_counts_on_its_new_pd() {
    // REREG_MR (ABI 1.6): a WRITE with the region's unchanged key lands at its new range; the
    // region follows its new PD (the old one may be freed), and without remote write access
    // the same WRITE is a remote access error that leaves memory untouched.
    let mut p = pair();
    let mut mr = p.b.pd.reg_mr(&p.b.buf, all()).unwrap();
    let base = p.b.buf.iova();
    let rkey = mr.rkey();
    let moved = Rereg {
        range: Some((0x5_0000_0000, 4096, base + 65536)),
        ..Default::default()
    };
    mr.rereg_raw(&moved).unwrap();
    assert_eq!(
        (mr.rkey(), mr.addr(), mr.len()),
        (rkey, 0x5_0000_0000, 4096)
    );
    p.a.buf.write(0, b"moved region").unwrap();
    let write = |p: &mut Pair, id: u64| {
        p.a.qp
            .post_send(&[SendWr::new(
                id,
                WrOp::Write(RemoteAddr {
                    addr: 0x5_0000_0000 + 100,
                    rkey,
                }),
                &[p.a.mr.sge(0, 12)],
            )])
            .unwrap();
        wait(&p.fabric, &mut p.a.cq, 1)[0].status
    };
    assert_eq!(write(&mut p, 1), WcStatus::Success);
    let mut got = [0u8; 12];
    p.b.buf.read(65536 + 100, &mut got).unwrap();
    assert_eq!(&got, b"moved region");
    // Another PD of B's device and back.
    let other = p.b.dev.alloc_pd().unwrap();
    let to_other = Rereg {
        pd: Some(&other),
        ..Default::default()
    };
    mr.rereg_raw(&to_other).unwrap();
    assert_eq!(mr.pdn(), other.pdn());
    // The device counts the region on its new PD: freeing that PD is BUSY now.
    let free_other = p.b.dev.raw_command(0x11, &other.pdn().to_le_bytes());
    assert!(
        matches!(
            free_other,
            Err(Error::Command {
                status: CmdStatus::Busy,
                ..
            })
        ),
        "{free_other:?}"
    );
    let back = Rereg {
        pd: Some(&p.b.pd),
        ..Default::default()
    };
    mr.rereg_raw(&back).unwrap();
    drop(other);
    // Read-only for peers: the WRITE is refused and memory stays as it was.
    let read_only = Rereg {
        access: Some(Access::REMOTE_READ),
        ..Default::default()
    };
    mr.rereg_raw(&read_only).unwrap();
    p.a.buf.write(0, b"not allowed!").unwrap();
    assert_eq!(write(&mut p, 2), WcStatus::RemAccessErr);
    p.b.buf.read(65536 + 100, &mut got).unwrap();
    assert_eq!(&got, b"moved region");
}

#[test]
fn srq_slot_is_retired_when_its_qp_resets_mid_message() {
    let fabric = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(2, 5));
    let mut a = side(&fabric, 0, all());
    let dev = Device::open(Box::new(fabric.port(1))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(1 << 20).unwrap();
    let mr = pd.reg_mr(&buf, all()).unwrap();
    let mut cq = dev.create_cq(64).unwrap();
    let mut srq = pd.create_srq(4, 1, 0).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.srq = Some(&srq);
    let mut qb = pd.create_qp(&init).unwrap();
    let o = ConnectOptions {
        path_mtu: 1,
        ..Default::default()
    };
    qb.connect(&a.qp.endpoint(1), 1, &o).unwrap();
    a.qp.connect(&qb.endpoint(1), 1, &o).unwrap();
    let sges: Vec<[Sge; 1]> = (0..4).map(|i| [mr.sge(i * 65536, 65536)]).collect();
    let wrs = recv_wrs(&sges);
    srq.post_recv(&wrs).unwrap();
    // A 64 KiB SEND at MTU 256 is 256 packets; reset B after the first few.
    a.qp.post_send(&[SendWr::new(1, WrOp::Send, &[a.mr.sge(0, 65536)])])
        .unwrap();
    while fabric.nic_stats(1).rx_frames < 10 {
        assert!(fabric.step());
    }
    let attr = ringbell_specs::cmd::QpAttr {
        state: QpState::Reset as u8,
        ..Default::default()
    };
    qb.modify(ringbell_specs::cmd::QpAttrMask::STATE, &attr)
        .unwrap();
    let wc = drain(&fabric, &mut cq);
    assert_eq!(wc.len(), 1, "{wc:?}");
    assert_eq!((wc[0].wr_id, wc[0].status), (0, WcStatus::WrFlushErr));
    // The SRQ has all four slots again.
    let more: Vec<RecvWr> = sges
        .iter()
        .map(|s| RecvWr { wr_id: 9, sgl: s })
        .take(1)
        .collect();
    srq.post_recv(&more).unwrap();
    drop(qb);
}

#[test]
fn a_register_read_sees_the_writes_before_it() {
    let p = pair();
    let port = p.a.dev.port();
    let old = port.read32(regs::CMD_ADDR_LO);
    port.write32(regs::CMD_ADDR_LO, 0x1234_5600);
    assert_eq!(port.read32(regs::CMD_ADDR_LO), 0x1234_5600);
    port.write32(regs::CMD_ADDR_LO, old);
    assert_eq!(port.read32(regs::CMD_ADDR_LO), old);
}

/// A request frame from node 0's QP to node 1's QP, built by hand.
fn raw_request(
    p: &Pair,
    opcode: ringbell_specs::wire::Opcode,
    psn: u32,
    payload: &[u8],
    reth: Option<ringbell_specs::wire::Reth>,
) -> Vec<u8> {
    use ringbell_specs::wire::{BthRepr, Endpoint, PacketRepr};
    let (ea, eb) = (p.a.qp.endpoint(0), p.b.qp.endpoint(0));
    let repr = PacketRepr {
        src: Endpoint {
            mac: ea.mac,
            ip: ea.ip,
        },
        dst: Endpoint {
            mac: eb.mac,
            ip: eb.ip,
        },
        udp_src_port: 0xC000,
        ip_id: 1,
        tos: 0,
        ttl: 64,
        bth: BthRepr {
            opcode: opcode as u8,
            solicited: false,
            mig_req: false,
            pad: 0,
            tver: 0,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            dest_qp: ringbell_specs::Qpn::from_bits(eb.qpn),
            ack_req: true,
            psn: ringbell_specs::Psn::new(psn),
        },
        deth: None,
        reth,
        aeth: None,
        atomic_eth: None,
        atomic_ack: None,
        imm: None,
        xrc: None,
    };
    let mut f = Vec::new();
    repr.emit(payload, &mut f);
    f
}

#[test]
fn packet_length_rules_are_enforced_by_the_responder() {
    use ringbell_specs::wire::{Opcode, Reth};
    // (opcode, payload length, RETH length): each breaks one rule at MTU 4096.
    let cases: [(Opcode, usize, Option<u32>); 4] = [
        (Opcode::WriteFirst, 100, Some(9000)), // FIRST shorter than the MTU
        (Opcode::SendFirst, 4097, None),       // FIRST longer than the MTU
        (Opcode::WriteOnly, 4097, Some(4097)), // ONLY longer than the MTU
        (Opcode::WriteOnly, 10, Some(20)),     // payload differs from the RETH length
    ];
    for (op, len, rlen) in cases {
        let mut p = pair();
        let rs = [p.b.mr.sge(0, 8192)];
        p.b.qp.post_recv(&[RecvWr { wr_id: 1, sgl: &rs }]).unwrap();
        p.b.buf.fill(0, 8192, 0xcc).unwrap();
        settle(&p.fabric);
        let reth = rlen.map(|l| Reth {
            va: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
            len: l,
        });
        let f = raw_request(&p, op, 100, &vec![0xab; len], reth);
        p.fabric.inject_frame(1, f);
        settle(&p.fabric);
        assert_eq!(qp_state(&p.b.qp), QpState::Err, "{op:?} {len}");
        assert_eq!(
            p.b.qp.stats().unwrap().naks_sent,
            1,
            "{op:?}: one NAK (invalid request)"
        );
        let mut mem = vec![0u8; 8192];
        p.b.buf.read(0, &mut mem).unwrap();
        assert!(mem.iter().all(|b| *b == 0xcc), "{op:?}: nothing written");
    }
    // A LAST packet with no payload is illegal too.
    let mut p = pair();
    let rs = [p.b.mr.sge(0, 16384)];
    p.b.qp.post_recv(&[RecvWr { wr_id: 1, sgl: &rs }]).unwrap();
    settle(&p.fabric);
    p.fabric.inject_frame(
        1,
        raw_request(&p, Opcode::SendFirst, 100, &[1u8; 4096], None),
    );
    p.fabric
        .inject_frame(1, raw_request(&p, Opcode::SendLast, 101, &[], None));
    settle(&p.fabric);
    assert_eq!(qp_state(&p.b.qp), QpState::Err);
    let r = drain(&p.fabric, &mut p.b.cq);
    assert_eq!(r.len(), 1, "the receive WQE completes in error: {r:?}");
    assert_ne!(r[0].status, WcStatus::Success);
}

#[test]
fn an_mr_deregistered_while_a_read_streams_ends_it_with_a_remote_access_error() {
    let mut p = pair_with(2, 1, 3);
    let mr =
        p.b.pd
            .reg_mr(&p.b.buf, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .unwrap();
    let remote = RemoteAddr {
        addr: mr.addr(),
        rkey: mr.rkey(),
    };
    // 512 KiB at MTU 256: 2048 response packets, sent a few at a time.
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::Read(remote),
            &[p.a.mr.sge(0, 512 * 1024)],
        )])
        .unwrap();
    while p.fabric.nic_stats(0).rx_frames < 20 {
        assert!(p.fabric.step());
    }
    drop(mr);
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(got, vec![(1, WcStatus::RemAccessErr)]);
    assert_eq!(qp_state(&p.b.qp), QpState::Err);
    assert!(
        p.fabric.nic_stats(1).tx_frames < 2048,
        "the stream stopped when the key went away"
    );
}

#[test]
fn zero_length_read_and_write_ignore_the_rkey() {
    let mut p = pair();
    let junk = RemoteAddr {
        addr: 0xdead_beef,
        rkey: 0x1234_5678,
    };
    p.a.qp
        .post_send(&[
            SendWr::new(1, WrOp::Write(junk), &[]),
            SendWr::new(2, WrOp::Read(junk), &[]),
        ])
        .unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.a.cq),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(qp_state(&p.b.qp), QpState::Rts);
}
