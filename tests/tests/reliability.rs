//! RC reliability: each rule of the requester and responder under a targeted fault, with the
//! counters that prove what happened.

use ringbell::*;
use ringbell_emu::{
    Fabric, FabricConfig, FaultAction, FaultPlan, FaultRule, FrameKind, FrameMatch, LinkFaults,
};
use ringbell_tests::*;

/// Two nodes at MTU 1024 with a short ACK timeout (timeout 8 = 1.05 ms) and `retry_cnt`.
fn lossy_pair(retry_cnt: u8, timeout: u8) -> Pair {
    let fabric = Fabric::new(FabricConfig::new(2, 21));
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    connect(
        &mut a,
        &mut b,
        &ConnectOptions {
            path_mtu: 3,
            timeout,
            retry_cnt,
            ..Default::default()
        },
    );
    Pair { a, b, fabric }
}

fn to_b_qp(p: &Pair) -> FrameMatch {
    FrameMatch {
        from: Some(0),
        qpn: Some(p.b.qp.qpn()),
        ..Default::default()
    }
}

fn to_a_qp(p: &Pair, kind: FrameKind) -> FrameMatch {
    FrameMatch {
        from: Some(1),
        qpn: Some(p.a.qp.qpn()),
        kind: Some(kind),
        ..Default::default()
    }
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

#[test]
fn a_lost_data_packet_costs_one_sequence_nak_and_a_go_back_n() {
    let mut p = lossy_pair(7, 14);
    let data = pattern(5 * 1024, 1);
    p.a.buf.write(0, &data).unwrap();
    // The third of five WRITE packets is lost.
    p.fabric.add_fault_rule(FaultRule::drop_nth(to_b_qp(&p), 3));
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 65536,
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::Write(remote),
            &[p.a.mr.sge(0, 5 * 1024)],
        )])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    let mut got = vec![0u8; data.len()];
    p.b.buf.read(65536, &mut got).unwrap();
    assert_eq!(got, data);
    let (sa, sb) = (p.a.qp.stats().unwrap(), p.b.qp.stats().unwrap());
    assert_eq!(sb.seq_naks_sent, 1, "exactly one NAK for the gap");
    assert_eq!(
        sb.out_of_sequence, 2,
        "the two packets behind the gap were dropped"
    );
    assert_eq!(sa.seq_naks_received, 1);
    assert_eq!(sa.retransmitted, 3, "go-back-N resends packets 3, 4 and 5");
    assert_eq!(sa.timeouts, 0, "the NAK, not the timer, drove the retry");
    assert!(
        drain(&p.fabric, &mut p.a.cq).is_empty(),
        "one completion only"
    );
}

#[test]
fn a_lost_ack_is_recovered_by_the_timer_and_the_duplicate_is_not_delivered_twice() {
    let mut p = lossy_pair(7, 8);
    let rs = [p.b.mr.sge(0, 4096)];
    p.b.qp
        .post_recv(&[RecvWr { wr_id: 5, sgl: &rs }, RecvWr { wr_id: 6, sgl: &rs }])
        .unwrap();
    p.fabric
        .add_fault_rule(FaultRule::drop_nth(to_a_qp(&p, FrameKind::Ack), 1));
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Send, b"exactly once")])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    let r = drain(&p.fabric, &mut p.b.cq);
    assert_eq!(r.len(), 1, "the SEND was delivered once: {r:?}");
    let (sa, sb) = (p.a.qp.stats().unwrap(), p.b.qp.stats().unwrap());
    assert_eq!(sa.timeouts, 1);
    assert_eq!(sa.retransmitted, 1);
    assert_eq!(
        sb.duplicates_received, 1,
        "the resent SEND was re-acknowledged, not executed"
    );
    // The timeout took about 4.096 µs × 2^8.
    assert!(wc[0].timestamp_ps > 1_048_000_000, "{}", wc[0].timestamp_ps);
}

#[test]
fn a_lost_read_response_in_the_middle_is_read_again_from_there() {
    let mut p = lossy_pair(7, 8);
    let data = pattern(6 * 1024, 7);
    p.b.buf.write(4096, &data).unwrap();
    // The third of six READ responses is lost.
    p.fabric
        .add_fault_rule(FaultRule::drop_nth(to_a_qp(&p, FrameKind::ReadResponse), 3));
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 4096,
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::Read(remote),
            &[p.a.mr.sge(8192, 6 * 1024)],
        )])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(
        (wc[0].status, wc[0].byte_len),
        (WcStatus::Success, 6 * 1024)
    );
    let mut got = vec![0u8; data.len()];
    p.a.buf.read(8192, &mut got).unwrap();
    assert_eq!(got, data);
    let (sa, sb) = (p.a.qp.stats().unwrap(), p.b.qp.stats().unwrap());
    assert_eq!(sa.timeouts, 1, "responses carry no NAK: the timer notices");
    assert_eq!(
        sb.read_replays, 1,
        "the responder read again from the first missing packet"
    );
    // Responses 4..6 arrived after the gap and were ignored, then 3..6 came again: 6 + 4.
    assert_eq!(p.fabric.nic_stats(1).tx_frames, 10);
}

#[test]
fn a_lost_atomic_ack_is_answered_from_the_saved_result() {
    let mut p = lossy_pair(7, 8);
    p.b.buf.write(0, &100u64.to_le_bytes()).unwrap();
    p.fabric
        .add_fault_rule(FaultRule::drop_nth(to_a_qp(&p, FrameKind::AtomicAck), 1));
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::FetchAdd { remote, add: 5 },
            &[p.a.mr.sge(0, 8)],
        )])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    assert_eq!(
        p.a.buf.read_u64(0).unwrap(),
        100,
        "the original value, from the replay"
    );
    assert_eq!(p.b.buf.read_u64(0).unwrap(), 105, "applied exactly once");
    assert_eq!(p.b.qp.stats().unwrap().atomic_replays, 1);
}

#[test]
fn retry_exhaustion_fails_the_oldest_and_flushes_the_rest() {
    for (retry_cnt, timeout) in [(0u8, 8u8), (3, 8), (7, 1)] {
        let mut p = lossy_pair(retry_cnt, timeout);
        // Every request to B is lost.
        p.fabric.add_fault_rule(FaultRule {
            when: to_b_qp(&p),
            nth: 1,
            times: 0,
            action: FaultAction::Drop,
        });
        let remote = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        };
        p.a.qp
            .post_send(&[
                SendWr::inline(1, WrOp::Write(remote), b"void").flags(SendFlags::empty()),
                SendWr::inline(2, WrOp::Send, b""),
            ])
            .unwrap();
        let got = outcomes(&p.fabric, &mut p.a.cq);
        assert_eq!(
            got,
            vec![(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)],
            "retry_cnt {retry_cnt}"
        );
        let s = p.a.qp.stats().unwrap();
        assert_eq!(s.timeouts, retry_cnt as u64 + 1);
        // Each attempt sends both packets: (retry_cnt + 1) × 2.
        assert_eq!(s.packets_sent, 2 * (retry_cnt as u64 + 1));
        assert_eq!(
            QpState::from_u8(p.a.qp.query().unwrap().state),
            Some(QpState::Err)
        );
    }
}

#[test]
fn timeout_zero_never_fires() {
    let mut p = lossy_pair(0, 0);
    p.fabric.add_fault_rule(FaultRule::drop_nth(to_b_qp(&p), 1));
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Send, b"lost")])
        .unwrap();
    let wc = drain(&p.fabric, &mut p.a.cq);
    assert!(wc.is_empty(), "{wc:?}");
    assert_eq!(p.a.qp.stats().unwrap().timeouts, 0);
    assert_eq!(
        QpState::from_u8(p.a.qp.query().unwrap().state),
        Some(QpState::Rts)
    );
}

#[test]
fn duplicated_and_reordered_frames_change_nothing() {
    let mut p = lossy_pair(7, 8);
    let rs: Vec<[Sge; 1]> = (0..4).map(|i| [p.b.mr.sge(i * 8192, 8192)]).collect();
    let wrs = recv_wrs(&rs);
    p.b.qp.post_recv(&wrs).unwrap();
    // Every request is duplicated; the second packet of each message is held back 3 µs.
    p.fabric.add_fault_rule(FaultRule {
        when: FrameMatch {
            opcode: Some(0x01),
            ..Default::default()
        },
        nth: 1,
        times: 0,
        action: FaultAction::Delay(ringbell_specs::SimTime(3_000_000)),
    });
    p.fabric.add_fault_rule(FaultRule {
        when: to_b_qp(&p),
        nth: 1,
        times: 0,
        action: FaultAction::Duplicate,
    });
    let data = pattern(4 * 3000, 9);
    p.a.buf.write(0, &data).unwrap();
    let sges: Vec<[Sge; 1]> = (0..4).map(|i| [p.a.mr.sge(i * 3000, 3000)]).collect();
    let sends: Vec<SendWr> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| SendWr::new(i as u64, WrOp::Send, s))
        .collect();
    p.a.qp.post_send(&sends).unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 4);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success));
    let r = wait(&p.fabric, &mut p.b.cq, 4);
    assert_eq!(
        r.iter().map(|w| (w.wr_id, w.byte_len)).collect::<Vec<_>>(),
        vec![(0, 3000), (1, 3000), (2, 3000), (3, 3000)]
    );
    assert!(
        drain(&p.fabric, &mut p.b.cq).is_empty(),
        "nothing delivered twice"
    );
    for i in 0..4 {
        let mut got = vec![0u8; 3000];
        p.b.buf.read(i * 8192, &mut got).unwrap();
        assert_eq!(got, data[i * 3000..(i + 1) * 3000]);
    }
    assert!(p.b.qp.stats().unwrap().duplicates_received > 0);
}

#[test]
fn a_corrupted_frame_is_dropped_by_the_icrc_check_and_resent() {
    let mut p = lossy_pair(7, 8);
    p.fabric.add_fault_rule(FaultRule {
        when: to_b_qp(&p),
        nth: 1,
        times: 1,
        action: FaultAction::Corrupt,
    });
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Write(remote), b"intact")])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    let mut got = [0u8; 6];
    p.b.buf.read(0, &mut got).unwrap();
    assert_eq!(&got, b"intact");
    assert!(
        p.b.dev
            .caps()
            .caps
            .contains(ringbell_specs::regs::Caps::COUNTERS),
        "the counters are announced"
    );
    assert_eq!(p.b.dev.port_stats().unwrap().rx_icrc_errors, 1);
    assert_eq!(p.a.qp.stats().unwrap().timeouts, 1);
}

#[test]
fn psns_wrap_around_under_loss() {
    let fabric = Fabric::new(FabricConfig::new(2, 4));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    let o = ConnectOptions {
        path_mtu: 1,
        timeout: 8,
        ..Default::default()
    };
    let start = 0x00FF_FFF0;
    a.qp.connect(&b.qp.endpoint(start), start, &o).unwrap();
    b.qp.connect(&a.qp.endpoint(start), start, &o).unwrap();
    let mut p = Pair { a, b, fabric };
    // 40 packets from PSN 0xFFFFF0 cross 0; the 20th (PSN 0x000003) is lost.
    p.fabric.add_fault_rule(FaultRule::drop_nth(
        FrameMatch {
            from: Some(0),
            ..Default::default()
        },
        20,
    ));
    let data = pattern(40 * 256, 3);
    p.a.buf.write(0, &data).unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let dst = [p.a.mr.sge(65536, 40 * 256)];
    p.a.qp
        .post_send(&[
            SendWr::new(1, WrOp::Write(remote), &[p.a.mr.sge(0, 40 * 256)]),
            SendWr::new(2, WrOp::Read(remote), &dst),
        ])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 2);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    let mut got = vec![0u8; data.len()];
    p.a.buf.read(65536, &mut got).unwrap();
    assert_eq!(got, data, "written across the wrap and read back");
    assert_eq!(p.b.qp.stats().unwrap().seq_naks_sent, 1);
}

#[test]
fn same_seed_same_digest_with_faults_and_different_seeds_differ() {
    let run = |seed: u64| {
        let mut cfg = FabricConfig::new(2, seed);
        cfg.faults = FaultPlan {
            links: LinkFaults {
                drop_ppm: 20_000,
                duplicate_ppm: 10_000,
                reorder_ppm: 10_000,
                reorder_delay: ringbell_specs::SimTime(2_000_000),
                corrupt_ppm: 5_000,
                down: vec![],
            },
            ..Default::default()
        };
        let fabric = Fabric::new(cfg);
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mut a = side(&fabric, 0, all);
        let mut b = side(&fabric, 1, all);
        connect(
            &mut a,
            &mut b,
            &ConnectOptions {
                timeout: 8,
                ..Default::default()
            },
        );
        let remote = RemoteAddr {
            addr: b.mr.addr(),
            rkey: b.mr.rkey(),
        };
        for i in 0..20u64 {
            a.qp.post_send(&[SendWr::new(i, WrOp::Write(remote), &[a.mr.sge(0, 20_000)])])
                .unwrap();
        }
        let wc = wait(&fabric, &mut a.cq, 20);
        assert!(wc.iter().all(|w| w.status == WcStatus::Success));
        (fabric.trace_digest(), fabric.fault_stats())
    };
    let (d1, f1) = run(5);
    let (d2, f2) = run(5);
    assert_eq!((d1, &f1), (d2, &f2));
    assert!(
        f1.dropped + f1.duplicated + f1.delayed + f1.corrupted > 0,
        "{f1:?}"
    );
    let (d3, _) = run(6);
    assert_ne!(d1, d3);
}

#[test]
fn a_link_down_interval_is_ridden_out_by_retries() {
    let mut cfg = FabricConfig::new(2, 8);
    // Node 1's link is down from 10 µs to 1.5 ms.
    let mut per_node = std::collections::BTreeMap::new();
    per_node.insert(
        1,
        LinkFaults {
            down: vec![(
                ringbell_specs::SimTime(10_000_000),
                ringbell_specs::SimTime(1_500_000_000),
            )],
            ..Default::default()
        },
    );
    cfg.faults = FaultPlan {
        per_node,
        ..Default::default()
    };
    let fabric = Fabric::new(cfg);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    connect(
        &mut a,
        &mut b,
        &ConnectOptions {
            timeout: 8,
            retry_cnt: 7,
            ..Default::default()
        },
    );
    // Let the clock reach the outage.
    while fabric.now().ps() < 10_000_000 && fabric.step() {}
    let remote = RemoteAddr {
        addr: b.mr.addr(),
        rkey: b.mr.rkey(),
    };
    a.qp.post_send(&[SendWr::inline(1, WrOp::Write(remote), b"after the outage")])
        .unwrap();
    let wc = wait(&fabric, &mut a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    assert!(wc[0].timestamp_ps > 1_500_000_000);
    assert!(fabric.fault_stats().link_down >= 1);
    let _ = &mut b;
}

#[test]
fn a_failed_wqe_waits_for_the_retries_of_the_work_before_it() {
    // The ACK of the first WRITE is lost; the second WRITE has a bad lkey. The first must
    // still be resent and complete before the second fails.
    let mut p = lossy_pair(7, 8);
    p.fabric
        .add_fault_rule(FaultRule::drop_nth(to_a_qp(&p, FrameKind::Ack), 1));
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let bad = [Sge {
        addr: p.a.mr.addr(),
        len: 8,
        lkey: 0xdead_0000,
    }];
    p.a.qp
        .post_send(&[
            SendWr::inline(1, WrOp::Write(remote), b"first"),
            SendWr::new(2, WrOp::Write(remote), &bad),
        ])
        .unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.a.cq),
        vec![(1, WcStatus::Success), (2, WcStatus::LocProtErr)]
    );
    assert_eq!(p.a.qp.stats().unwrap().timeouts, 1);
    // The same behind an RNR wait: the SEND is resent once a receive is posted.
    let mut p = lossy_pair(7, 8);
    p.a.qp
        .post_send(&[
            SendWr::inline(1, WrOp::Send, b"first"),
            SendWr::new(
                2,
                WrOp::Send,
                &[Sge {
                    addr: p.a.mr.addr(),
                    len: 8,
                    lkey: 0xdead_0000,
                }],
            ),
        ])
        .unwrap();
    for _ in 0..200 {
        p.fabric.step();
    }
    let rs = [p.b.mr.sge(0, 64)];
    p.b.qp.post_recv(&[RecvWr { wr_id: 7, sgl: &rs }]).unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.a.cq),
        vec![(1, WcStatus::Success), (2, WcStatus::LocProtErr)]
    );
}

#[test]
fn copies_of_a_nak_do_not_use_up_retries() {
    // retry_cnt 1 and every NAK delivered twice: one lost packet needs one retry, not two.
    let mut p = lossy_pair(1, 8);
    p.fabric.add_fault_rule(FaultRule::drop_nth(to_b_qp(&p), 2));
    p.fabric.add_fault_rule(FaultRule {
        when: to_a_qp(&p, FrameKind::Ack),
        nth: 1,
        times: 0,
        action: FaultAction::Duplicate,
    });
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::Write(remote),
            &[p.a.mr.sge(0, 4 * 1024)],
        )])
        .unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.a.cq),
        vec![(1, WcStatus::Success)]
    );
    assert_eq!(
        p.a.qp.stats().unwrap().seq_naks_received,
        2,
        "the NAK and its copy"
    );
    // rnr_retry 1 and every RNR NAK delivered twice: the one retry is still sent.
    let fabric = Fabric::new(FabricConfig::new(2, 22));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    connect(
        &mut a,
        &mut b,
        &ConnectOptions {
            rnr_retry: 1,
            min_rnr_timer: 1,
            ..Default::default()
        },
    );
    let p = Pair { a, b, fabric };
    p.fabric.add_fault_rule(FaultRule {
        when: to_a_qp(&p, FrameKind::Ack),
        nth: 1,
        times: 0,
        action: FaultAction::Duplicate,
    });
    let mut p = p;
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Send, b"x")])
        .unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.a.cq),
        vec![(1, WcStatus::RnrRetryExcErr)]
    );
    assert_eq!(
        p.b.qp.stats().unwrap().rnr_naks_sent,
        2,
        "the first try and the one retry"
    );
}
