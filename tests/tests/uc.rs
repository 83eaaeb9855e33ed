//! Unreliable connected QPs end to end (ABI 1.7): SEND and RDMA WRITE (with immediate) over
//! UC opcodes, nothing acknowledged, a lost packet losing its message and nothing else, the
//! receive WQE a lost SEND was filling reused by the next one, silent drops where RC would
//! NAK, and the bad inputs (READ and atomics, RC-only attributes, tag matching, triggered
//! work), through the driver and the emulated NIC.

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultRule, FrameMatch};
use ringbell_specs::cmd::{QpAttr, QpAttrMask as M};
use ringbell_specs::wire::Opcode;
use ringbell_specs::wqe::{CtrlSeg, DataSeg, RaddrSeg, SendOpcode};
use ringbell_tests::*;
use zerocopy::IntoBytes;

const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// One side with a UC QP in RESET.
fn uc_side(fabric: &Fabric, node: usize) -> Side {
    side_of(fabric, node, ALL, QpType::Uc)
}

/// Two nodes with connected UC QPs at path MTU 1024 (`path_mtu` 3).
fn uc_pair(seed: u64) -> Pair {
    let fabric = Fabric::new(FabricConfig::new(2, seed));
    let mut a = uc_side(&fabric, 0);
    let mut b = uc_side(&fabric, 1);
    connect(
        &mut a,
        &mut b,
        &ConnectOptions {
            path_mtu: 3,
            access: ALL,
            ..Default::default()
        },
    );
    Pair { a, b, fabric }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn post_recv(s: &mut Side, wr_id: u64, off: u64, len: u32) {
    let sge = [s.mr.sge(off, len)];
    s.qp.post_recv(&[RecvWr { wr_id, sgl: &sge }]).unwrap();
}

fn post(s: &mut Side, wr_id: u64, op: WrOp, off: u64, len: u32) {
    let sge = [s.mr.sge(off, len)];
    s.qp.post_send(&[SendWr::new(wr_id, op, &sge)]).unwrap();
}

fn to_b(p: &Pair) -> RemoteAddr {
    RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    }
}

/// Drops the `nth` frame (1-based) from node 0 to node 1 with BTH opcode `op`.
fn drop_nth(p: &Pair, op: Opcode, nth: u64) {
    p.fabric.add_fault_rule(FaultRule::drop_nth(
        FrameMatch {
            from: Some(0),
            opcode: Some(op.to_u8()),
            ..Default::default()
        },
        nth,
    ));
}

fn read(s: &Side, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    s.buf.read(off, &mut v).unwrap();
    v
}

#[test]
fn sends_and_writes_travel_as_uc_packets_and_nothing_answers() {
    let mut p = uc_pair(1);
    p.fabric.start_timeline(10_000).unwrap();
    let msg = pattern(2500, 3);
    p.a.buf.write(0, &msg).unwrap();
    post_recv(&mut p.b, 70, 0, 4096);
    post_recv(&mut p.b, 71, 8192, 64);
    post(&mut p.a, 1, WrOp::SendImm(0xabcd), 0, 2500);
    let r = to_b(&p);
    post(
        &mut p.a,
        2,
        WrOp::Write(RemoteAddr {
            addr: r.addr + 16384,
            ..r
        }),
        0,
        2500,
    );
    post(
        &mut p.a,
        3,
        WrOp::WriteImm(
            RemoteAddr {
                addr: r.addr + 32768,
                ..r
            },
            7,
        ),
        0,
        1024,
    );
    let s = wait(&p.fabric, &mut p.a.cq, 3);
    assert_eq!(
        s.iter()
            .map(|w| (w.wr_id, w.status, w.opcode))
            .collect::<Vec<_>>(),
        vec![
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::RdmaWrite),
            (3, WcStatus::Success, WcOpcode::RdmaWrite),
        ]
    );
    let r = wait(&p.fabric, &mut p.b.cq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].opcode, r[0].byte_len),
        (70, WcStatus::Success, WcOpcode::Recv, 2500)
    );
    assert_eq!(r[0].imm, Some(0xabcd));
    assert_eq!(
        (r[1].wr_id, r[1].status, r[1].opcode, r[1].imm),
        (71, WcStatus::Success, WcOpcode::RecvRdmaWithImm, Some(7))
    );
    settle(&p.fabric);
    assert_eq!(read(&p.b, 0, 2500), msg);
    assert_eq!(read(&p.b, 16384, 2500), msg);
    assert_eq!(read(&p.b, 32768, 1024), msg[..1024]);
    // Three packets per 2500-byte message at MTU 1024, one for the 1024-byte WRITE, all UC
    // opcodes; nothing came back.
    let tl = p.fabric.take_timeline().unwrap();
    let ops: Vec<u8> = tl
        .events()
        .iter()
        .filter(|e| e.ev.stage == ringbell_model::Stage::Rx)
        .map(|e| {
            assert_eq!(e.node, 1, "a frame reached the sender");
            e.ev.op
        })
        .collect();
    use Opcode::*;
    let want = [
        UcSendFirst,
        UcSendMiddle,
        UcSendLastImm,
        UcWriteFirst,
        UcWriteMiddle,
        UcWriteLast,
        UcWriteOnlyImm,
    ];
    assert_eq!(ops, want.map(Opcode::to_u8));
    assert_eq!(p.a.dev.port_stats().unwrap().rx_frames, 0);
    let st = p.b.qp.stats().unwrap();
    assert_eq!((st.uc_dropped, st.out_of_sequence, st.naks_sent), (0, 0, 0));
}

#[test]
fn a_lost_packet_loses_its_send_and_the_receive_is_filled_by_the_next() {
    let mut p = uc_pair(2);
    drop_nth(&p, Opcode::UcSendMiddle, 1);
    let (m1, m2) = (pattern(3000, 1), pattern(2100, 9));
    p.a.buf.write(0, &m1).unwrap();
    p.a.buf.write(4096, &m2).unwrap();
    post_recv(&mut p.b, 10, 0, 4096);
    post_recv(&mut p.b, 11, 4096, 4096);
    post(&mut p.a, 1, WrOp::Send, 0, 3000);
    post(&mut p.a, 2, WrOp::Send, 4096, 2100);
    // The sender is never told: both complete.
    let s = wait(&p.fabric, &mut p.a.cq, 2);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    let r = drain(&p.fabric, &mut p.b.cq);
    // The first receive took the second message; the second receive is still posted.
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (10, WcStatus::Success, 2100)
    );
    assert_eq!(read(&p.b, 0, 2100), m2);
    let st = p.b.qp.stats().unwrap();
    // The LAST of the first message arrived after the gap: out of sequence, dropped.
    assert_eq!((st.out_of_sequence, st.uc_dropped), (1, 1));
    assert_eq!(p.b.qp.query_state().unwrap(), QpState::Rts);
    // The second receive takes the next message.
    post(&mut p.a, 3, WrOp::SendImm(5), 0, 100);
    let r = wait(&p.fabric, &mut p.b.cq, 1);
    assert_eq!((r[0].wr_id, r[0].byte_len, r[0].imm), (11, 100, Some(5)));
    // A receive parked by a lost SEND is flushed when the QP goes to ERR, before the ones
    // behind it.
    post_recv(&mut p.b, 12, 0, 4096);
    post_recv(&mut p.b, 13, 4096, 4096);
    drop_nth(&p, Opcode::UcSendMiddle, 1);
    post(&mut p.a, 4, WrOp::Send, 0, 3000);
    wait(&p.fabric, &mut p.a.cq, 1);
    assert!(drain(&p.fabric, &mut p.b.cq).is_empty());
    p.b.qp.to_error().unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.b.cq),
        vec![(12, WcStatus::WrFlushErr), (13, WcStatus::WrFlushErr)]
    );
}

#[test]
fn a_write_after_a_lost_write_lands_and_the_lost_one_stops_where_it_broke() {
    let mut p = uc_pair(3);
    drop_nth(&p, Opcode::UcWriteMiddle, 1);
    let m = pattern(3000, 4);
    p.a.buf.write(0, &m).unwrap();
    p.b.buf.write(0, &[0xEE; 8192]).unwrap();
    let r = to_b(&p);
    post(&mut p.a, 1, WrOp::Write(r), 0, 3000);
    post(
        &mut p.a,
        2,
        WrOp::Write(RemoteAddr {
            addr: r.addr + 4096,
            ..r
        }),
        0,
        3000,
    );
    let s = wait(&p.fabric, &mut p.a.cq, 2);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    settle(&p.fabric);
    // First packet landed, the rest of that message did not; the second message is whole.
    assert_eq!(read(&p.b, 0, 1024), m[..1024]);
    assert_eq!(read(&p.b, 1024, 1976), vec![0xEE; 1976]);
    assert_eq!(read(&p.b, 4096, 3000), m);
    let st = p.b.qp.stats().unwrap();
    assert_eq!((st.out_of_sequence, st.uc_dropped), (1, 1));
}

#[test]
fn a_write_with_immediate_after_a_lost_send_completes_the_parked_receive_in_order() {
    let mut p = uc_pair(4);
    drop_nth(&p, Opcode::UcSendLast, 1);
    p.a.buf.write(0, &pattern(2000, 5)).unwrap();
    post_recv(&mut p.b, 20, 0, 4096);
    post_recv(&mut p.b, 21, 4096, 4096);
    post(&mut p.a, 1, WrOp::Send, 0, 2000);
    let r = to_b(&p);
    post(&mut p.a, 2, WrOp::WriteImm(r, 99), 0, 8);
    wait(&p.fabric, &mut p.a.cq, 2);
    let r = drain(&p.fabric, &mut p.b.cq);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(
        (r[0].wr_id, r[0].opcode, r[0].imm),
        (20, WcOpcode::RecvRdmaWithImm, Some(99))
    );
}

#[test]
fn what_rc_would_nak_is_dropped_silently_and_the_qp_serves_on() {
    let mut p = uc_pair(5);
    p.a.buf.write(0, &pattern(4096, 6)).unwrap();
    // No receive posted: an RC responder sends an RNR NAK; UC drops the SEND.
    post(&mut p.a, 1, WrOp::Send, 0, 10);
    // A bad rkey, and a range outside the region.
    let r = to_b(&p);
    post(
        &mut p.a,
        2,
        WrOp::Write(RemoteAddr {
            rkey: r.rkey ^ 0x100,
            ..r
        }),
        0,
        10,
    );
    post(
        &mut p.a,
        3,
        WrOp::Write(RemoteAddr {
            addr: r.addr + BUF as u64 - 4,
            ..r
        }),
        0,
        10,
    );
    let s = wait(&p.fabric, &mut p.a.cq, 3);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    settle(&p.fabric);
    assert_eq!(p.b.qp.stats().unwrap().uc_dropped, 3);
    // A SEND longer than the receive WQE (three packets into 2000 bytes) is dropped; the
    // WQE waits for the next SEND.
    post_recv(&mut p.b, 30, 0, 2000);
    post(&mut p.a, 4, WrOp::Send, 0, 2500);
    post(&mut p.a, 5, WrOp::Send, 0, 1500);
    wait(&p.fabric, &mut p.a.cq, 2);
    let got = drain(&p.fabric, &mut p.b.cq);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].wr_id, got[0].byte_len), (30, 1500));
    // The second packet of the long SEND overflowed the WQE; its third was out of order.
    assert_eq!(p.b.qp.stats().unwrap().uc_dropped, 5);
    assert_eq!(p.b.qp.query_state().unwrap(), QpState::Rts);
    assert_eq!(p.b.dev.port_stats().unwrap().naks_sent, 0);
    assert_eq!(p.a.dev.port_stats().unwrap().rx_frames, 0);
}

#[test]
fn a_bad_receive_wqe_fails_it_and_moves_the_receiver_to_err_without_a_nak() {
    let mut p = uc_pair(6);
    let sge = [Sge {
        addr: p.b.mr.addr(),
        len: 64,
        lkey: p.b.mr.lkey() ^ 0x100,
    }];
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 40,
            sgl: &sge,
        }])
        .unwrap();
    post_recv(&mut p.b, 41, 0, 64);
    post(&mut p.a, 1, WrOp::Send, 0, 8);
    wait(&p.fabric, &mut p.a.cq, 1);
    let r = outcomes(&p.fabric, &mut p.b.cq);
    assert_eq!(
        r,
        vec![(40, WcStatus::LocProtErr), (41, WcStatus::WrFlushErr)]
    );
    assert_eq!(p.b.qp.query_state().unwrap(), QpState::Err);
    assert_eq!(p.a.dev.port_stats().unwrap().rx_frames, 0);
}

#[test]
fn reads_and_atomics_are_refused_on_uc() {
    let mut p = uc_pair(7);
    let sge = [p.a.mr.sge(0, 8)];
    let r = to_b(&p);
    for op in [
        WrOp::Read(r),
        WrOp::FetchAdd { remote: r, add: 1 },
        WrOp::CmpSwap {
            remote: r,
            compare: 0,
            swap: 1,
        },
    ] {
        let e = p.a.qp.post_send(&[SendWr::new(1, op, &sge)]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
    // Written straight into the ring, the device fails the READ as a bad opcode for the
    // transport and the QP moves to ERR.
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Read as u8,
        ds_count: 3,
        flags: 1,
        ..Default::default()
    };
    let raddr = RaddrSeg {
        raddr: r.addr.into(),
        rkey: r.rkey.into(),
        ..Default::default()
    };
    let data = DataSeg {
        byte_count: 8.into(),
        lkey: p.a.mr.lkey().into(),
        addr: p.a.mr.addr().into(),
    };
    let mut wqe = Vec::new();
    wqe.extend_from_slice(ctrl.as_bytes());
    wqe.extend_from_slice(raddr.as_bytes());
    wqe.extend_from_slice(data.as_bytes());
    p.a.qp.post_raw_wqe(9, &wqe).unwrap();
    let w = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((w[0].wr_id, w[0].status), (9, WcStatus::LocQpOpErr));
    assert_eq!(p.a.qp.query_state().unwrap(), QpState::Err);
}

#[test]
fn uc_transitions_refuse_rc_only_attributes() {
    let f = Fabric::new(FabricConfig::new(2, 8));
    let mut a = uc_side(&f, 0);
    let init = QpAttr {
        state: QpState::Init as u8,
        ..Default::default()
    };
    a.qp.modify(M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, &init)
        .unwrap();
    let e = a.qp.endpoint(0);
    let rtr = QpAttr {
        state: QpState::Rtr as u8,
        path_mtu: 3,
        dest_qpn: 5.into(),
        dest_mac: e.mac,
        dest_ip: e.ip,
        max_dest_rd_atomic: 1,
        ..Default::default()
    };
    let base = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN;
    for extra in [M::MAX_DEST_RD_ATOMIC, M::MIN_RNR_TIMER, M::QKEY] {
        let err = a.qp.modify(base | extra, &rtr).unwrap_err();
        assert!(matches!(err, Error::Command { .. }), "{extra:?}: {err:?}");
    }
    a.qp.modify(base, &rtr).unwrap();
    let rts = QpAttr {
        state: QpState::Rts as u8,
        timeout: 14,
        retry_cnt: 7,
        ..Default::default()
    };
    for extra in [M::TIMEOUT, M::RETRY_CNT, M::RNR_RETRY, M::MAX_QP_RD_ATOMIC] {
        assert!(a.qp.modify(M::STATE | M::SQ_PSN | extra, &rts).is_err());
    }
    assert!(a.qp.modify(M::STATE, &rts).is_err(), "SQ_PSN is required");
    a.qp.modify(M::STATE | M::SQ_PSN, &rts).unwrap();
    assert_eq!(a.qp.query_state().unwrap(), QpState::Rts);
}

#[test]
fn uc_takes_no_tag_matching_srq_and_no_triggered_work() {
    let f = Fabric::new(FabricConfig::new(2, 9));
    let a = uc_side(&f, 0);
    let tm = a.pd.create_tm_srq(&a.cq, 16, 1, 16, 16).expect("tm srq");
    let mut init = QpInit::new(&a.cq, &a.cq);
    init.qp_type = QpType::Uc;
    init.srq = Some(&tm);
    assert!(matches!(a.pd.create_qp(&init), Err(Error::Command { .. })));
    // An ordinary SRQ is fine.
    let srq = a.pd.create_srq(16, 1, 0).expect("srq");
    init.srq = Some(&srq);
    a.pd.create_qp(&init).expect("uc qp on an srq");
    let c = a.pd.create_counter().unwrap();
    let sge = [a.mr.sge(0, 8)];
    let wr = SendWr::new(1, WrOp::Send, &sge);
    assert!(matches!(
        a.qp.post_triggered(&c, 1, &wr, TriggerOpts::default()),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn rc_and_uc_do_not_talk() {
    let fabric = Fabric::new(FabricConfig::new(2, 10));
    let mut a = side(&fabric, 0, ALL);
    let mut b = uc_side(&fabric, 1);
    let o = ConnectOptions {
        retry_cnt: 1,
        timeout: 1,
        ..Default::default()
    };
    connect(&mut a, &mut b, &o);
    post_recv(&mut b, 1, 0, 64);
    post(&mut a, 1, WrOp::Send, 0, 8);
    let w = wait(&fabric, &mut a.cq, 1);
    assert_eq!(w[0].status, WcStatus::RetryExcErr);
    settle(&fabric);
    assert!(b.qp.ud_stats().unwrap().wrong_transport_dropped >= 1);
    assert!(drain(&fabric, &mut b.cq).is_empty());
}

/// A UC QP on an SRQ: the receive a SEND lost halfway was filling cannot go back to the SRQ,
/// so it completes with REM_INV_REQ_ERR and the QP serves on; a SEND too long for its SRQ
/// receive completes that receive with LOC_LEN_ERR. The next SEND takes the next receive.
#[test]
fn uc_on_an_srq_completes_the_receive_of_a_lost_send_in_error() {
    let mut p = uc_pair(11);
    let mut srq = p.b.pd.create_srq(16, 1, 0).expect("srq");
    let mut init = QpInit::new(&p.b.cq, &p.b.cq);
    init.qp_type = QpType::Uc;
    init.srq = Some(&srq);
    let mut bq = p.b.pd.create_qp(&init).unwrap();
    // A's QP now talks to the SRQ QP.
    let o = ConnectOptions {
        path_mtu: 3,
        access: ALL,
        ..Default::default()
    };
    p.a.qp.to_error().unwrap();
    let reset = QpAttr {
        state: QpState::Reset as u8,
        ..Default::default()
    };
    p.a.qp.modify(M::STATE, &reset).unwrap();
    let (ea, eb) = (p.a.qp.endpoint(500), bq.endpoint(600));
    p.a.qp.connect(&eb, 500, &o).unwrap();
    bq.connect(&ea, 600, &o).unwrap();
    drain(&p.fabric, &mut p.a.cq);
    let m = pattern(2500, 8);
    p.a.buf.write(0, &m).unwrap();
    for (i, off, len) in [
        (90u64, 0u64, 4096u32),
        (91, 4096, 4096),
        (92, 8192, 1000),
        (93, 12288, 4096),
    ] {
        let sge = [p.b.mr.sge(off, len)];
        srq.post_recv(&[RecvWr {
            wr_id: i,
            sgl: &sge,
        }])
        .unwrap();
    }
    drop_nth(&p, Opcode::UcSendMiddle, 1);
    post(&mut p.a, 1, WrOp::Send, 0, 2500);
    post(&mut p.a, 2, WrOp::Send, 0, 300);
    // Too long for receive 92 (1000 bytes): its second packet overflows it.
    post(&mut p.a, 3, WrOp::Send, 0, 2500);
    post(&mut p.a, 4, WrOp::SendImm(4), 0, 100);
    let s = wait(&p.fabric, &mut p.a.cq, 4);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    let r = drain(&p.fabric, &mut p.b.cq);
    assert_eq!(
        r.iter()
            .map(|w| (w.wr_id, w.status, w.qpn))
            .collect::<Vec<_>>(),
        vec![
            (90, WcStatus::RemInvReqErr, bq.qpn()),
            (91, WcStatus::Success, bq.qpn()),
            (92, WcStatus::LocLenErr, bq.qpn()),
            (93, WcStatus::Success, bq.qpn()),
        ]
    );
    assert_eq!(
        (r[1].byte_len, r[3].byte_len, r[3].imm),
        (300, 100, Some(4))
    );
    assert_eq!(bq.query_state().unwrap(), QpState::Rts);
    // Packets dropped: the first SEND's LAST (after the gap), and all three of the third's
    // (its first packet already overflows the 1000-byte receive).
    assert_eq!(bq.stats().unwrap().uc_dropped, 4);
}
