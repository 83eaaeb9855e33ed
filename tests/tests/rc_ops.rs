//! Every RC operation end to end through the driver and the emulated NIC.

use ringbell::*;
use ringbell_tests::*;

#[test]
fn write_lands_and_completes() {
    let mut p = pair();
    p.a.buf.write(0, b"hello, ringbell").unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 100,
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 15)];
    p.a.qp
        .post_send(&[SendWr::new(7, WrOp::Write(remote), &sge)])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(wc[0].wr_id, 7);
    assert_eq!(wc[0].opcode, WcOpcode::RdmaWrite);
    let mut got = [0u8; 15];
    p.b.buf.read(100, &mut got).unwrap();
    assert_eq!(&got, b"hello, ringbell");
}

fn recv_wr(p: &Side, wr_id: u64, off: u64, len: u32) -> [Sge; 1] {
    let _ = wr_id;
    [p.mr.sge(off, len)]
}

#[test]
fn send_recv_with_immediate_across_mtus() {
    for mtu in 1..=5u8 {
        let mut p = pair_with(2, mtu, 3);
        let len = 10_000u32;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + mtu as u32) as u8).collect();
        p.a.buf.write(0, &data).unwrap();
        let rs = recv_wr(&p.b, 1, 4096, 16384);
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 55,
                sgl: &rs,
            }])
            .unwrap();
        let sge = [p.a.mr.sge(0, len)];
        p.a.qp
            .post_send(&[SendWr::new(9, WrOp::SendImm(0xabcd), &sge)
                .flags(SendFlags::SIGNALED | SendFlags::SOLICITED)])
            .unwrap();
        let s = wait(&p.fabric, &mut p.a.cq, 1);
        assert_eq!(
            (s[0].wr_id, s[0].status, s[0].opcode),
            (9, WcStatus::Success, WcOpcode::Send)
        );
        let r = wait(&p.fabric, &mut p.b.cq, 1);
        assert_eq!(r[0].wr_id, 55);
        assert_eq!(r[0].status, WcStatus::Success);
        assert_eq!(r[0].opcode, WcOpcode::Recv);
        assert_eq!(r[0].byte_len, len);
        assert_eq!(r[0].imm, Some(0xabcd));
        assert!(r[0].solicited);
        let mut got = vec![0u8; len as usize];
        p.b.buf.read(4096, &mut got).unwrap();
        assert_eq!(got, data, "mtu code {mtu}");
    }
}

#[test]
fn scatter_gather_send_into_multi_sge_receive() {
    let mut p = pair_with(2, 1, 4);
    for i in 0..600u32 {
        p.a.buf
            .write(i as usize * 2, &[(i % 251) as u8, (i % 13) as u8])
            .unwrap();
    }
    // Gather three pieces, scatter into four.
    let g = [
        p.a.mr.sge(0, 100),
        p.a.mr.sge(500, 300),
        p.a.mr.sge(1000, 200),
    ];
    let s = [
        p.b.mr.sge(10_000, 50),
        p.b.mr.sge(20_000, 350),
        p.b.mr.sge(30_000, 150),
        p.b.mr.sge(40_000, 100),
    ];
    p.b.qp.post_recv(&[RecvWr { wr_id: 1, sgl: &s }]).unwrap();
    p.a.qp.post_send(&[SendWr::new(2, WrOp::Send, &g)]).unwrap();
    let r = wait(&p.fabric, &mut p.b.cq, 1);
    assert_eq!((r[0].status, r[0].byte_len), (WcStatus::Success, 600));
    let mut src = Vec::new();
    for (o, l) in [(0, 100), (500, 300), (1000, 200)] {
        let mut b = vec![0u8; l];
        p.a.buf.read(o, &mut b).unwrap();
        src.extend(b);
    }
    let mut dst = Vec::new();
    for (o, l) in [(10_000, 50), (20_000, 350), (30_000, 150), (40_000, 50)] {
        let mut b = vec![0u8; l];
        p.b.buf.read(o, &mut b).unwrap();
        dst.extend(b);
    }
    assert_eq!(src, dst);
}

#[test]
fn write_with_immediate_consumes_a_receive() {
    let mut p = pair_with(2, 3, 5);
    let data = vec![0x5au8; 3000];
    p.a.buf.write(0, &data).unwrap();
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 77,
            sgl: &[],
        }])
        .unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 8192,
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(0, 3000)];
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::WriteImm(remote, 0x1234_5678), &sge)])
        .unwrap();
    let r = wait(&p.fabric, &mut p.b.cq, 1);
    assert_eq!(r[0].wr_id, 77);
    assert_eq!(r[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(r[0].imm, Some(0x1234_5678));
    assert_eq!(r[0].byte_len, 3000);
    let mut got = vec![0u8; 3000];
    p.b.buf.read(8192, &mut got).unwrap();
    assert_eq!(got, data);
    assert_eq!(wait(&p.fabric, &mut p.a.cq, 1)[0].status, WcStatus::Success);
}

#[test]
fn read_multi_packet_and_zero_length() {
    let mut p = pair_with(2, 2, 6);
    let data: Vec<u8> = (0..70_000u32).map(|i| (i ^ (i >> 8)) as u8).collect();
    p.b.buf.write(0, &data).unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let sge = [p.a.mr.sge(100_000, 70_000)];
    p.a.qp
        .post_send(&[
            SendWr::new(3, WrOp::Read(remote), &sge),
            SendWr::new(4, WrOp::Read(remote), &[]),
        ])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 2);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].opcode, wc[0].byte_len),
        (3, WcStatus::Success, WcOpcode::RdmaRead, 70_000)
    );
    assert_eq!(
        (wc[1].wr_id, wc[1].status, wc[1].byte_len),
        (4, WcStatus::Success, 0)
    );
    let mut got = vec![0u8; 70_000];
    p.a.buf.read(100_000, &mut got).unwrap();
    assert_eq!(got, data);
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    let mut p = pair();
    p.b.buf.write(64, &41u64.to_le_bytes()).unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 64,
        rkey: p.b.mr.rkey(),
    };
    let r0 = [p.a.mr.sge(0, 8)];
    let r1 = [p.a.mr.sge(8, 8)];
    let r2 = [p.a.mr.sge(16, 8)];
    p.a.qp
        .post_send(&[
            SendWr::new(1, WrOp::FetchAdd { remote, add: 1 }, &r0),
            SendWr::new(
                2,
                WrOp::CmpSwap {
                    remote,
                    compare: 42,
                    swap: 1000,
                },
                &r1,
            ),
            SendWr::new(
                3,
                WrOp::CmpSwap {
                    remote,
                    compare: 42,
                    swap: 5,
                },
                &r2,
            ),
        ])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 3);
    let ops: Vec<_> = wc.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
    assert_eq!(
        ops,
        vec![
            (1, WcStatus::Success, WcOpcode::FetchAdd),
            (2, WcStatus::Success, WcOpcode::CompSwap),
            (3, WcStatus::Success, WcOpcode::CompSwap)
        ]
    );
    assert_eq!(p.a.buf.read_u64(0).unwrap(), 41);
    assert_eq!(p.a.buf.read_u64(8).unwrap(), 42);
    assert_eq!(
        p.a.buf.read_u64(16).unwrap(),
        1000,
        "failed compare returns the current value"
    );
    assert_eq!(p.b.buf.read_u64(64).unwrap(), 1000);
}

#[test]
fn inline_send_and_write_and_unsignaled_batches() {
    let mut p = pair();
    let rs = [p.b.mr.sge(0, 4096)];
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 10,
            sgl: &rs,
        }])
        .unwrap();
    let msg = [0xeeu8; 200];
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 8000,
        rkey: p.b.mr.rkey(),
    };
    // 31 unsignaled inline writes and one signaled send: one completion frees all 32.
    let mut wrs = Vec::new();
    for i in 0..31u64 {
        wrs.push(
            SendWr::inline(
                i,
                WrOp::Write(RemoteAddr {
                    addr: remote.addr + i * 200,
                    ..remote
                }),
                &msg,
            )
            .flags(SendFlags::empty()),
        );
    }
    wrs.push(SendWr::inline(99, WrOp::Send, b"inline-send"));
    let before = p.a.qp.sq_free();
    p.a.qp.post_send(&wrs).unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (99, WcStatus::Success));
    assert_eq!(
        p.a.qp.sq_free(),
        before,
        "the signaled completion frees the unsignaled WQEs before it"
    );
    let r = wait(&p.fabric, &mut p.b.cq, 1);
    assert_eq!(r[0].byte_len, 11);
    let mut got = [0u8; 11];
    p.b.buf.read(0, &mut got).unwrap();
    assert_eq!(&got, b"inline-send");
    let mut w = vec![0u8; 31 * 200];
    p.b.buf.read(8000, &mut w).unwrap();
    assert!(w.iter().all(|b| *b == 0xee));
}

#[test]
fn srq_shared_by_several_qps() {
    let fabric = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(3, 8));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    // Node 0 receives on an SRQ from nodes 1 and 2.
    let dev = Device::open(Box::new(fabric.port(0))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(1 << 16).unwrap();
    let mr = pd.reg_mr(&buf, all).unwrap();
    let cq = dev.create_cq(64).unwrap();
    let mut srq = pd.create_srq(16, 1, 0).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.srq = Some(&srq);
    let mut q1 = pd.create_qp(&init).unwrap();
    let mut q2 = pd.create_qp(&init).unwrap();
    let mut s1 = side(&fabric, 1, all);
    let mut s2 = side(&fabric, 2, all);
    let o = ConnectOptions::default();
    q1.connect(&s1.qp.endpoint(1), 1, &o).unwrap();
    s1.qp.connect(&q1.endpoint(1), 1, &o).unwrap();
    q2.connect(&s2.qp.endpoint(2), 2, &o).unwrap();
    s2.qp.connect(&q2.endpoint(2), 2, &o).unwrap();
    let sges: Vec<[Sge; 1]> = (0..8).map(|i| [mr.sge(i * 1024, 1024)]).collect();
    let wrs: Vec<RecvWr> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: 100 + i as u64,
            sgl: s,
        })
        .collect();
    srq.post_recv(&wrs).unwrap();
    for k in 0..4u8 {
        s1.buf.write(0, &[1, k]).unwrap();
        s1.qp
            .post_send(&[SendWr::new(k as u64, WrOp::Send, &[s1.mr.sge(0, 2)])])
            .unwrap();
        s2.buf.write(0, &[2, k]).unwrap();
        s2.qp
            .post_send(&[SendWr::new(k as u64, WrOp::Send, &[s2.mr.sge(0, 2)])])
            .unwrap();
    }
    let mut cq = cq;
    let wc = wait(&fabric, &mut cq, 8);
    let mut ids: Vec<u64> = wc.iter().map(|w| w.wr_id).collect();
    ids.sort();
    assert_eq!(
        ids,
        (100..108).collect::<Vec<_>>(),
        "every SRQ buffer used exactly once"
    );
    let mut from = [0usize; 3];
    for w in &wc {
        assert_eq!(w.status, WcStatus::Success);
        let mut b = [0u8; 2];
        buf.read(((w.wr_id - 100) * 1024) as usize, &mut b).unwrap();
        from[b[0] as usize] += 1;
        assert!(w.qpn == q1.qpn() || w.qpn == q2.qpn());
    }
    assert_eq!(from, [0, 4, 4]);
    drop((q1, q2));
}

fn pair_opts(o: &ConnectOptions) -> Pair {
    let fabric = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(2, 9));
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    connect(&mut a, &mut b, o);
    Pair { a, b, fabric }
}

#[test]
fn rnr_waits_for_a_receive_then_delivers_once() {
    // Infinite RNR retry, 10 µs timer: the SEND and the WRITE with immediate wait until the
    // receives are posted, then each lands exactly once.
    let mut p = pair_opts(&ConnectOptions {
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..Default::default()
    });
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 64,
        rkey: p.b.mr.rkey(),
    };
    p.a.qp
        .post_send(&[
            SendWr::inline(1, WrOp::Send, b"first"),
            SendWr::inline(2, WrOp::WriteImm(remote, 7), b"second"),
        ])
        .unwrap();
    // Let several RNR rounds pass with nothing posted.
    let until = p.fabric.now().ps() + 50_000_000;
    while p.fabric.now().ps() < until && p.fabric.step() {}
    assert!(drain_ready(&mut p.b.cq).is_empty());
    assert!(
        drain_ready(&mut p.a.cq).is_empty(),
        "no completion while the receiver is not ready"
    );
    let rs = [p.b.mr.sge(0, 64)];
    p.b.qp
        .post_recv(&[
            RecvWr {
                wr_id: 10,
                sgl: &rs,
            },
            RecvWr {
                wr_id: 11,
                sgl: &rs,
            },
        ])
        .unwrap();
    let s = wait(&p.fabric, &mut p.a.cq, 2);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    let r = wait(&p.fabric, &mut p.b.cq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].byte_len, r[0].opcode),
        (10, 5, WcOpcode::Recv)
    );
    assert_eq!(
        (r[1].wr_id, r[1].imm, r[1].opcode),
        (11, Some(7), WcOpcode::RecvRdmaWithImm)
    );
    assert!(
        drain(&p.fabric, &mut p.b.cq).is_empty(),
        "nothing delivered twice"
    );
    let mut got = [0u8; 6];
    p.b.buf.read(64, &mut got).unwrap();
    assert_eq!(&got, b"second");
}

#[test]
fn rnr_retries_exhausted() {
    for rnr_retry in [0u8, 2] {
        let mut p = pair_opts(&ConnectOptions {
            rnr_retry,
            min_rnr_timer: 1,
            ..Default::default()
        });
        p.a.qp
            .post_send(&[
                SendWr::inline(1, WrOp::Send, b"nobody listens"),
                SendWr::inline(2, WrOp::Send, b""),
            ])
            .unwrap();
        let got = outcomes(&p.fabric, &mut p.a.cq);
        assert_eq!(
            got,
            vec![(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)]
        );
        assert_eq!(
            QpState::from_u8(p.a.qp.query().unwrap().state),
            Some(QpState::Err)
        );
        // rnr_retry + 1 attempts, each answered by one RNR NAK.
        assert_eq!(p.fabric.nic_stats(1).rnr_naks_sent, rnr_retry as u64 + 1);
    }
}

fn drain_ready(cq: &mut CompletionQueue) -> Vec<WorkCompletion> {
    let mut wc = [WorkCompletion::default(); 16];
    let n = cq.poll_ready(&mut wc);
    wc[..n].to_vec()
}

#[test]
fn read_and_atomic_behind_a_write_see_its_data() {
    let mut p = pair();
    p.a.buf.write(0, &[0xab; 4096]).unwrap();
    p.a.buf.write(8192, &5u64.to_le_bytes()).unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 65536,
        rkey: p.b.mr.rkey(),
    };
    let word = RemoteAddr {
        addr: p.b.mr.addr() + 128,
        rkey: p.b.mr.rkey(),
    };
    let src = [p.a.mr.sge(0, 4096)];
    let w8 = [p.a.mr.sge(8192, 8)];
    let dst = [p.a.mr.sge(16384, 4096)];
    let res = [p.a.mr.sge(32768, 8)];
    // Posted back to back: the READ and the FETCH_ADD reach the responder while the WRITEs'
    // data is still on its way to host memory.
    p.a.qp
        .post_send(&[
            SendWr::new(1, WrOp::Write(remote), &src).flags(SendFlags::empty()),
            SendWr::new(2, WrOp::Write(word), &w8).flags(SendFlags::empty()),
            SendWr::new(3, WrOp::Read(remote), &dst),
            SendWr::new(
                4,
                WrOp::FetchAdd {
                    remote: word,
                    add: 10,
                },
                &res,
            ),
        ])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 2);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success));
    let mut got = vec![0u8; 4096];
    p.a.buf.read(16384, &mut got).unwrap();
    assert!(
        got.iter().all(|b| *b == 0xab),
        "the READ returned memory older than the WRITE before it"
    );
    assert_eq!(
        p.a.buf.read_u64(32768).unwrap(),
        5,
        "the FETCH_ADD saw the written value"
    );
    assert_eq!(p.b.buf.read_u64(128).unwrap(), 15);
}

#[test]
fn objects_can_be_dropped_in_any_order() {
    let fabric = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(2, 12));
    let dev = Device::open(Box::new(fabric.port(0))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16).unwrap();
    let srq = pd.create_srq(4, 1, 0).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.srq = Some(&srq);
    let qp = pd.create_qp(&init).unwrap();
    let (pdn, cqn, srqn, qpn) = (pd.pdn(), cq.cqn(), srq.srqn(), qp.qpn());
    let query = |op: u16, n: u32| dev.raw_command(op, &n.to_le_bytes());
    // Dropping the PD, CQ and SRQ handles first: the QP still refers to them on the device.
    drop((pd, cq, srq));
    assert!(query(0x31, cqn).is_ok(), "the CQ lives while its QP does");
    assert!(query(0x42, qpn).is_ok());
    drop(qp);
    // Now everything is gone on the device: QP, then SRQ, CQ and PD.
    for (op, n) in [(0x42u16, qpn), (0x31, cqn), (0x52, srqn), (0x11, pdn)] {
        assert!(
            matches!(
                query(op, n),
                Err(Error::Command {
                    status: ringbell_specs::cmd::CmdStatus::BadResource,
                    ..
                })
            ),
            "object {n} of command {op:#x} still exists"
        );
    }
}

#[test]
fn a_fatal_nak_comes_after_the_responses_owed_before_it() {
    for atomic in [false, true] {
        let mut p = pair();
        let remote = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        };
        let sge = [p.a.mr.sge(0, 8)];
        let first = if atomic {
            SendWr::new(1, WrOp::FetchAdd { remote, add: 1 }, &sge)
        } else {
            SendWr::new(1, WrOp::Read(remote), &sge)
        };
        let bad = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey() ^ 0x100,
        };
        p.a.qp
            .post_send(&[first, SendWr::inline(2, WrOp::Write(bad), b"x")])
            .unwrap();
        let got = outcomes(&p.fabric, &mut p.a.cq);
        assert_eq!(
            got,
            vec![(1, WcStatus::Success), (2, WcStatus::RemAccessErr)],
            "atomic {atomic}"
        );
    }
}

#[test]
fn an_rnr_nak_does_not_overtake_read_responses() {
    for atomic in [false, true] {
        let mut p = pair();
        let remote = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        };
        let w = [p.a.mr.sge(0, 4096)];
        let r = if atomic {
            [p.a.mr.sge(8192, 8)]
        } else {
            [p.a.mr.sge(8192, 4096)]
        };
        let second = if atomic {
            SendWr::new(2, WrOp::FetchAdd { remote, add: 1 }, &r)
        } else {
            SendWr::new(2, WrOp::Read(remote), &r)
        };
        p.a.qp
            .post_send(&[
                SendWr::new(1, WrOp::Write(remote), &w),
                second,
                SendWr::inline(3, WrOp::Send, b"late"),
            ])
            .unwrap();
        // Nobody receives yet: the SEND is RNR-NAKed behind the WRITE and the READ/atomic.
        let until = p.fabric.now().ps() + 30_000_000;
        while p.fabric.now().ps() < until && p.fabric.step() {}
        let rs = [p.b.mr.sge(100_000, 64)];
        p.b.qp.post_recv(&[RecvWr { wr_id: 9, sgl: &rs }]).unwrap();
        let wc = wait(&p.fabric, &mut p.a.cq, 3);
        let got: Vec<_> = wc.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(
            got,
            vec![
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::Success)
            ],
            "atomic {atomic}"
        );
        assert_eq!(wait(&p.fabric, &mut p.b.cq, 1)[0].wr_id, 9);
    }
}

#[test]
fn the_rnr_wait_is_not_cut_short() {
    // min_rnr_timer 14 = 1.28 ms: a stream of SENDs to a receiver without buffers gets one
    // RNR NAK, then nothing until the timer has run.
    let mut p = pair_opts(&ConnectOptions {
        rnr_retry: 7,
        min_rnr_timer: 14,
        ..Default::default()
    });
    let sge = [p.a.mr.sge(0, 4096)];
    let wrs: Vec<SendWr> = (0..60).map(|i| SendWr::new(i, WrOp::Send, &sge)).collect();
    p.a.qp.post_send(&wrs).unwrap();
    let start = p.fabric.now().ps();
    while p.fabric.now().ps() < start + 1_200_000_000 && p.fabric.step() {}
    assert_eq!(
        p.fabric.nic_stats(1).rnr_naks_sent,
        1,
        "a retry came before the RNR timer ran out"
    );
    while p.fabric.now().ps() < start + 1_400_000_000 && p.fabric.step() {}
    assert_eq!(
        p.fabric.nic_stats(1).rnr_naks_sent,
        2,
        "the retry after 1.28 ms"
    );
}

#[test]
fn rnr_exhaustion_fails_the_wqe_that_was_nakked() {
    let mut p = pair_opts(&ConnectOptions {
        rnr_retry: 0,
        ..Default::default()
    });
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let w = [p.a.mr.sge(0, 64)];
    let r = [p.a.mr.sge(4096, 64)];
    p.a.qp
        .post_send(&[
            SendWr::new(1, WrOp::Write(remote), &w),
            SendWr::new(2, WrOp::Read(remote), &r),
            SendWr::inline(3, WrOp::Send, b"x"),
        ])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(
        got,
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::RnrRetryExcErr)
        ]
    );
}

#[test]
fn pipelined_sends_meeting_rnr_on_an_srq_reposted_slowly_all_land_once() {
    // The receiver's SRQ holds one receive at a time, reposted only some simulated
    // microseconds after each completion (a host slower than the wire): every SEND of a
    // burst meets RNR NAKs, those behind it are dropped as out of sequence and sent again,
    // and each lands exactly once, in order.
    let fabric = ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(2, 21));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let dev = Device::open(Box::new(fabric.port(0))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(1 << 16).unwrap();
    let mr = pd.reg_mr(&buf, all).unwrap();
    let mut cq = dev.create_cq(64).unwrap();
    let mut srq = pd.create_srq(16, 1, 0).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.srq = Some(&srq);
    let mut q = pd.create_qp(&init).unwrap();
    let mut s = side(&fabric, 1, all);
    let o = ConnectOptions::default();
    q.connect(&s.qp.endpoint(1), 1, &o).unwrap();
    s.qp.connect(&q.endpoint(1), 1, &o).unwrap();
    const N: u64 = 6;
    let post = |srq: &mut SharedReceiveQueue, i: u64| {
        let sge = [mr.sge(i * 1024, 1024)];
        srq.post_recv(&[RecvWr {
            wr_id: 100 + i,
            sgl: &sge,
        }])
        .unwrap();
    };
    post(&mut srq, 0);
    for k in 0..N {
        s.buf.write(k as usize * 64, &[k as u8; 64]).unwrap();
    }
    let wrs: Vec<[Sge; 1]> = (0..N).map(|k| [s.mr.sge(k * 64, 64)]).collect();
    let sends: Vec<SendWr> = wrs
        .iter()
        .enumerate()
        .map(|(k, g)| SendWr::new(k as u64, WrOp::Send, g))
        .collect();
    s.qp.post_send(&sends).unwrap();
    let mut got = Vec::new();
    let mut repost_at = None;
    let mut posted = 1;
    let limit = fabric.now().ps() + 5_000_000_000;
    while got.len() < N as usize && fabric.now().ps() < limit {
        if !fabric.step() {
            break;
        }
        for w in drain_ready(&mut cq) {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            got.push(w.wr_id);
            repost_at = Some(fabric.now().ps() + 150_000_000);
        }
        if repost_at.is_some_and(|t| fabric.now().ps() >= t) && posted < N {
            post(&mut srq, posted);
            posted += 1;
            repost_at = None;
        }
    }
    assert_eq!(got, (100..100 + N).collect::<Vec<_>>());
    for k in 0..N {
        let mut b = [0u8; 64];
        buf.read(k as usize * 1024, &mut b).unwrap();
        assert_eq!(b, [k as u8; 64], "message {k} in receive {k}");
    }
    let sent = wait(&fabric, &mut s.cq, N as usize);
    assert!(
        sent.iter().all(|w| w.status == WcStatus::Success),
        "{sent:?}"
    );
    let st = dev.port_stats().unwrap();
    assert!(st.rnr_naks_sent >= N - 1, "RNR met: {st:?}");
}
