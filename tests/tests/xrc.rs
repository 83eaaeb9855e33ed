//! XRC (ABI 1.11) end to end: an initiator on node A connected to one target QP on node B
//! reaches every XRC SRQ of the target's XRC domain, each request naming its SRQ; receives
//! complete on that SRQ's own CQ, reporting the target QP; RDMA WRITE, READ, atomics and
//! WRITE with immediate go through the target with the named SRQ's PD checking the key; a
//! request naming an SRQ of another domain, or none, is an invalid request (the initiator
//! sees `RemInvReqErr`); what the driver and the device refuse; the domain held by its
//! SRQs and targets.

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_tests::*;

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// A's initiator connected to B's target in `xrcd`; B has two XRC SRQs of the domain with
/// CQs of their own, and a third SRQ in another domain.
struct Xrc {
    fabric: Fabric,
    a: Side,
    ini: QueuePair,
    b: Side,
    tgt: QueuePair,
    srqs: Vec<(SharedReceiveQueue, CompletionQueue)>,
    other: (SharedReceiveQueue, CompletionQueue),
    _xrcds: (Xrcd, Xrcd),
}

fn xrc(functional: bool) -> Xrc {
    let mut cfg = FabricConfig::new(2, 21);
    cfg.functional = functional;
    let fabric = Fabric::new(cfg);
    let a = side(&fabric, 0, all());
    let b = side(&fabric, 1, all());
    let mut init = QpInit::new(&a.cq, &a.cq);
    init.qp_type = QpType::XrcIni;
    init.max_recv_wr = 0;
    let mut ini = a.pd.create_qp(&init).unwrap();
    let xrcd = b.dev.alloc_xrcd().unwrap();
    let mut tgt = xrcd.create_target_qp().unwrap();
    let srqs: Vec<_> = (0..2)
        .map(|_| {
            let cq = b.dev.create_cq(64).unwrap();
            let srq = b.pd.create_xrc_srq(&xrcd, &cq, 32, 2, 0).unwrap();
            (srq, cq)
        })
        .collect();
    let xrcd2 = b.dev.alloc_xrcd().unwrap();
    let cq = b.dev.create_cq(64).unwrap();
    let other = (b.pd.create_xrc_srq(&xrcd2, &cq, 8, 1, 0).unwrap(), cq);
    // 256-byte packets: messages of several packets name their SRQ in each.
    let o = ConnectOptions {
        path_mtu: 1,
        ..Default::default()
    };
    let (ei, et) = (ini.endpoint(100), tgt.endpoint(900));
    ini.connect(&et, 100, &o).unwrap();
    tgt.connect(&ei, 900, &o).unwrap();
    Xrc {
        fabric,
        a,
        ini,
        b,
        tgt,
        srqs,
        other,
        _xrcds: (xrcd, xrcd2),
    }
}

fn recv(x: &mut Xrc, srq: usize, wr_id: u64, off: u64) {
    let sge = [x.b.mr.sge(off, 4096)];
    x.srqs[srq]
        .0
        .post_recv(&[RecvWr { wr_id, sgl: &sge }])
        .unwrap();
}

fn send(x: &mut Xrc, srqn: u32, wr_id: u64, data: &[u8]) -> WorkCompletion {
    x.a.buf.write(0, data).unwrap();
    let sge = [x.a.mr.sge(0, data.len() as u32)];
    let wr = SendWr::new(wr_id, WrOp::Send, &sge).xrc(srqn);
    x.ini.post_send(&[wr]).unwrap();
    wait(&x.fabric, &mut x.a.cq, 1)[0]
}

#[test]
fn one_connection_reaches_every_srq_of_the_domain() {
    for functional in [false, true] {
        let mut x = xrc(functional);
        recv(&mut x, 0, 10, 0);
        recv(&mut x, 1, 11, 8192);
        let (s0, s1) = (x.srqs[0].0.srqn(), x.srqs[1].0.srqn());
        let wc = send(&mut x, s1, 1, b"to the second");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        let got = wait(&x.fabric, &mut x.srqs[1].1, 1)[0];
        assert_eq!(
            (got.wr_id, got.status, got.opcode, got.byte_len),
            (11, WcStatus::Success, WcOpcode::Recv, 13)
        );
        // The receive reports the target QP.
        assert_eq!(got.qpn, x.tgt.qpn());
        let mut b = [0u8; 13];
        x.b.buf.read(8192, &mut b).unwrap();
        assert_eq!(&b, b"to the second");
        assert_eq!(poll_all(&mut x.srqs[0].1).len(), 0);
        // A message longer than a packet, to the first SRQ.
        let big: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let wc = send(&mut x, s0, 2, &big);
        assert_eq!(wc.status, WcStatus::Success);
        let got = wait(&x.fabric, &mut x.srqs[0].1, 1)[0];
        assert_eq!((got.wr_id, got.byte_len), (10, 3000));
        let mut b = vec![0u8; 3000];
        x.b.buf.read(0, &mut b).unwrap();
        assert_eq!(b, big);
    }
}

#[test]
fn rdma_and_atomics_go_through_the_target() {
    let mut x = xrc(false);
    let s0 = x.srqs[0].0.srqn();
    let remote = RemoteAddr {
        addr: x.b.mr.addr() + 4096,
        rkey: x.b.mr.rkey(),
    };
    x.a.buf.write(0, b"written over xrc").unwrap();
    let sge = [x.a.mr.sge(0, 16)];
    let wr = SendWr::new(1, WrOp::Write(remote), &sge).xrc(s0);
    x.ini.post_send(&[wr]).unwrap();
    assert_eq!(wait(&x.fabric, &mut x.a.cq, 1)[0].status, WcStatus::Success);
    let mut b = [0u8; 16];
    x.b.buf.read(4096, &mut b).unwrap();
    assert_eq!(&b, b"written over xrc");
    // READ it back elsewhere.
    let sge = [x.a.mr.sge(1024, 16)];
    let wr = SendWr::new(2, WrOp::Read(remote), &sge).xrc(s0);
    x.ini.post_send(&[wr]).unwrap();
    assert_eq!(wait(&x.fabric, &mut x.a.cq, 1)[0].status, WcStatus::Success);
    let mut a = [0u8; 16];
    x.a.buf.read(1024, &mut a).unwrap();
    assert_eq!(&a, b"written over xrc");
    // Fetch-and-add.
    x.b.buf.write(8192, &40u64.to_le_bytes()).unwrap();
    let sge = [x.a.mr.sge(2048, 8)];
    let wr = SendWr::new(
        3,
        WrOp::FetchAdd {
            remote: RemoteAddr {
                addr: x.b.mr.addr() + 8192,
                ..remote
            },
            add: 2,
        },
        &sge,
    )
    .xrc(s0);
    x.ini.post_send(&[wr]).unwrap();
    assert_eq!(wait(&x.fabric, &mut x.a.cq, 1)[0].status, WcStatus::Success);
    let mut w = [0u8; 8];
    x.a.buf.read(2048, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 40);
    x.b.buf.read(8192, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 42);
    // WRITE with immediate consumes a receive of the named SRQ.
    recv(&mut x, 1, 77, 0);
    let s1 = x.srqs[1].0.srqn();
    let sge = [x.a.mr.sge(0, 4)];
    let wr = SendWr::new(4, WrOp::WriteImm(remote, 0xfeed), &sge).xrc(s1);
    x.ini.post_send(&[wr]).unwrap();
    assert_eq!(wait(&x.fabric, &mut x.a.cq, 1)[0].status, WcStatus::Success);
    let got = wait(&x.fabric, &mut x.srqs[1].1, 1)[0];
    assert_eq!(
        (got.wr_id, got.opcode, got.imm),
        (77, WcOpcode::RecvRdmaWithImm, Some(0xfeed))
    );
}

#[test]
fn a_request_naming_an_srq_outside_the_domain_is_invalid() {
    for bad in [true, false] {
        let mut x = xrc(false);
        let srqn = if bad { x.other.0.srqn() } else { 0x00AB_CDEF };
        let sge = [x.other.0.srqn()].map(|_| x.b.mr.sge(0, 64));
        x.other
            .0
            .post_recv(&[RecvWr {
                wr_id: 5,
                sgl: &sge,
            }])
            .unwrap();
        let wc = send(&mut x, srqn, 9, b"nobody");
        assert_eq!(wc.status, WcStatus::RemInvReqErr, "{wc:?}");
        assert_eq!(x.ini.query().unwrap().state, QpState::Err as u8);
        assert_eq!(x.tgt.query().unwrap().state, QpState::Err as u8);
        // Nothing was delivered anywhere.
        settle(&x.fabric);
        assert!(poll_all(&mut x.other.1).is_empty());
        assert!(x.srqs.iter_mut().all(|(_, cq)| poll_all(cq).is_empty()));
    }
}

#[test]
fn what_is_refused() {
    let mut x = xrc(false);
    // A target does not send and has no receive queue; an initiator has none either.
    let sge = [x.b.mr.sge(0, 8)];
    assert!(matches!(
        x.tgt.post_send(&[SendWr::new(1, WrOp::Send, &sge)]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        x.tgt.post_recv(&[RecvWr {
            wr_id: 1,
            sgl: &sge
        }]),
        Err(Error::InvalidArgument(_))
    ));
    let sge = [x.a.mr.sge(0, 8)];
    assert!(matches!(
        x.ini.post_recv(&[RecvWr {
            wr_id: 1,
            sgl: &sge
        }]),
        Err(Error::InvalidArgument(_))
    ));
    // An initiator with an SRQ; a target made as a PD's QP.
    let srq = x.a.pd.create_srq(8, 1, 0).unwrap();
    let mut init = QpInit::new(&x.a.cq, &x.a.cq);
    init.qp_type = QpType::XrcIni;
    init.srq = Some(&srq);
    assert!(matches!(
        x.a.pd.create_qp(&init),
        Err(Error::InvalidArgument(_))
    ));
    init.srq = None;
    init.qp_type = QpType::XrcTgt;
    assert!(matches!(
        x.a.pd.create_qp(&init),
        Err(Error::InvalidArgument(_))
    ));
    // An RC QP cannot take its receives from an XRC SRQ.
    let mut init = QpInit::new(&x.b.cq, &x.b.cq);
    init.srq = Some(&x.srqs[0].0);
    assert!(matches!(
        x.b.pd.create_qp(&init),
        Err(Error::Command {
            status: ringbell_specs::cmd::CmdStatus::BadParam,
            ..
        })
    ));
    // An XRC SRQ on a CQ of another device.
    let xrcd = x.a.dev.alloc_xrcd().unwrap();
    assert!(matches!(
        x.a.pd.create_xrc_srq(&xrcd, &x.b.cq, 8, 1, 0),
        Err(Error::InvalidArgument(_))
    ));
    // An SRQ and a target keep their domain: the handle goes, the domain stays.
    let srq = x.a.pd.create_xrc_srq(&xrcd, &x.a.cq, 8, 1, 0).unwrap();
    let tgt = xrcd.create_target_qp().unwrap();
    let num = xrcd.num();
    drop(xrcd);
    let again = x.a.dev.alloc_xrcd().unwrap();
    assert_ne!(again.num(), num);
    drop((srq, tgt));
}

mod routing {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Msg {
        /// A SEND of `len` bytes to SRQ `srq`.
        Send { srq: usize, len: u32 },
        /// A WRITE with immediate of `len` bytes to SRQ `srq` (consumes one of its receives).
        WriteImm { srq: usize, len: u32 },
        /// An RDMA WRITE of `len` bytes (no receive), naming SRQ `srq`.
        Write { srq: usize, len: u32 },
    }

    fn msg() -> impl Strategy<Value = Msg> {
        let len = prop_oneof![0u32..64, 200u32..1200];
        prop_oneof![
            (0usize..2, len.clone()).prop_map(|(srq, len)| Msg::Send { srq, len }),
            (0usize..2, len.clone()).prop_map(|(srq, len)| Msg::WriteImm { srq, len }),
            (0usize..2, len).prop_map(|(srq, len)| Msg::Write { srq, len }),
        ]
    }

    /// A receive one SRQ must report: wr_id, length, opcode, source offset, message index.
    type Expected = (u64, u32, WcOpcode, u64, usize);

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

        /// Over a fabric that drops, duplicates, reorders and corrupts, every request
        /// completes in order at the initiator, and each SRQ's CQ reports exactly the
        /// messages that named it, in order, with their bytes (a reference model: one
        /// queue of expected receives per SRQ).
        #[test]
        fn each_srq_gets_exactly_its_messages_in_order(
            msgs in proptest::collection::vec(msg(), 1..24),
            seed in 0u64..500,
        ) {
            let mut cfg = FabricConfig::new(2, seed);
            cfg.faults = lossy(30_000);
            let fabric = Fabric::new(cfg);
            let mut a = side(&fabric, 0, all());
            let b = side(&fabric, 1, all());
            let mut init = QpInit::new(&a.cq, &a.cq);
            init.qp_type = QpType::XrcIni;
            let mut ini = a.pd.create_qp(&init).unwrap();
            let xrcd = b.dev.alloc_xrcd().unwrap();
            let mut tgt = xrcd.create_target_qp().unwrap();
            let mut srqs: Vec<_> = (0..2)
                .map(|_| {
                    let cq = b.dev.create_cq(64).unwrap();
                    (b.pd.create_xrc_srq(&xrcd, &cq, 32, 1, 0).unwrap(), cq)
                })
                .collect();
            let o = ConnectOptions { path_mtu: 1, timeout: 8, retry_cnt: 7, ..Default::default() };
            let (ei, et) = (ini.endpoint(7), tgt.endpoint(70));
            ini.connect(&et, 7, &o).unwrap();
            tgt.connect(&ei, 70, &o).unwrap();
            // Receive slot i of every SRQ: 2 KiB at (srq * 32 + i) * 2 KiB of B's buffer.
            let slot = |srq: usize, i: usize| ((srq * 32 + i) * 2048) as u64;
            for (s, (srq, _)) in srqs.iter_mut().enumerate() {
                for i in 0..24 {
                    let sge = [b.mr.sge(slot(s, i), 2048)];
                    srq.post_recv(&[RecvWr { wr_id: (s * 100 + i) as u64, sgl: &sge }]).unwrap();
                }
            }
            // The reference: per SRQ, the (wr_id, length, opcode, source offset) expected.
            let mut expect: [Vec<Expected>; 2] = Default::default();
            let data: Vec<u8> = (0..BUF as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
            a.buf.write(0, &data[..256 * 1024]).unwrap();
            let write_at = 900 * 1024u64;
            let mut ini_ops = Vec::new();
            for (k, m) in msgs.iter().enumerate() {
                let src = (k as u64) * 4096;
                let (srq, len) = match *m {
                    Msg::Send { srq, len } | Msg::WriteImm { srq, len } | Msg::Write { srq, len } => (srq, len),
                };
                let srqn = srqs[srq].0.srqn();
                let sge = [a.mr.sge(src, len)];
                let remote = RemoteAddr { addr: b.mr.addr() + write_at + k as u64 * 2048, rkey: b.mr.rkey() };
                let (op, wc_op, recv) = match m {
                    Msg::Send { .. } => (WrOp::Send, WcOpcode::Send, Some(WcOpcode::Recv)),
                    Msg::WriteImm { .. } => (WrOp::WriteImm(remote, k as u32), WcOpcode::RdmaWrite, Some(WcOpcode::RecvRdmaWithImm)),
                    Msg::Write { .. } => (WrOp::Write(remote), WcOpcode::RdmaWrite, None),
                };
                if let Some(r) = recv {
                    let i = expect[srq].len();
                    expect[srq].push(((srq * 100 + i) as u64, len, r, src, k));
                }
                ini_ops.push(wc_op);
                ini.post_send(&[SendWr::new(k as u64, op, &sge).xrc(srqn)]).unwrap();
            }
            let got = drain(&fabric, &mut a.cq);
            prop_assert_eq!(got.len(), msgs.len(), "{:?}", got);
            for (k, w) in got.iter().enumerate() {
                prop_assert_eq!((w.wr_id, w.status, w.opcode), (k as u64, WcStatus::Success, ini_ops[k]));
            }
            let mut b_now = vec![0u8; BUF];
            b.buf.read(0, &mut b_now).unwrap();
            for (s, (_, cq)) in srqs.iter_mut().enumerate() {
                let rx = poll_all(cq);
                prop_assert_eq!(rx.len(), expect[s].len(), "SRQ {}: {:?}", s, rx);
                for (w, &(wr_id, len, op, src, k)) in rx.iter().zip(&expect[s]) {
                    prop_assert_eq!((w.wr_id, w.status, w.opcode, w.byte_len), (wr_id, WcStatus::Success, op, len));
                    prop_assert_eq!(w.qpn, tgt.qpn());
                    let (at, imm) = match op {
                        WcOpcode::Recv => (slot(s, (wr_id as usize) % 100), None),
                        _ => (write_at + k as u64 * 2048, Some(k as u32)),
                    };
                    prop_assert_eq!(w.imm, imm);
                    let (at, src, len) = (at as usize, src as usize, len as usize);
                    prop_assert_eq!(&b_now[at..at + len], &data[src..src + len], "message {}", k);
                }
            }
            // RDMA WRITEs landed too.
            for (k, m) in msgs.iter().enumerate() {
                if let Msg::Write { len, .. } = *m {
                    let at = (write_at + k as u64 * 2048) as usize;
                    let src = k * 4096;
                    prop_assert_eq!(&b_now[at..at + len as usize], &data[src..src + len as usize]);
                }
            }
        }
    }
}

/// A request arriving at an initiator (which only sends) is invalid: the initiator NAKs it
/// and goes to ERR, taking nothing.
#[test]
fn a_request_to_an_initiator_is_invalid() {
    use ringbell_specs::wire::{BthRepr, Endpoint, Opcode, PacketRepr, DEFAULT_PKEY};
    use ringbell_specs::{Psn, Qpn};
    let mut x = xrc(false);
    let (ei, et) = (x.ini.endpoint(100), x.tgt.endpoint(900));
    let repr = PacketRepr {
        src: Endpoint {
            mac: et.mac,
            ip: et.ip,
        },
        dst: Endpoint {
            mac: ei.mac,
            ip: ei.ip,
        },
        udp_src_port: 0xC000,
        ip_id: 1,
        tos: 0,
        ttl: 64,
        bth: BthRepr {
            opcode: Opcode::SendOnly as u8,
            solicited: false,
            mig_req: false,
            pad: 0,
            tver: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: Qpn::from_bits(x.ini.qpn()),
            ack_req: true,
            psn: Psn::new(900),
        },
        deth: None,
        reth: None,
        aeth: None,
        atomic_eth: None,
        atomic_ack: None,
        imm: None,
        xrc: Some(x.srqs[0].0.srqn()),
    };
    let mut f = Vec::new();
    repr.emit(b"unasked", &mut f);
    x.fabric.inject_frame(0, f);
    settle(&x.fabric);
    assert_eq!(x.ini.query().unwrap().state, QpState::Err as u8);
    assert_eq!(x.ini.stats().unwrap().naks_sent, 1);
    assert!(poll_all(&mut x.a.cq).is_empty());
}

/// A READ's responses keep checking its key in the PD of the SRQ it named, while later
/// requests name an SRQ of another PD.
#[test]
fn a_read_streams_on_while_later_requests_name_another_pd() {
    let mut x = xrc(false);
    let pd2 = x.b.dev.alloc_pd().unwrap();
    let cq2 = x.b.dev.create_cq(16).unwrap();
    let buf2 = x.b.dev.alloc_dma(4096).unwrap();
    let mr2 = pd2.reg_mr(&buf2, all()).unwrap();
    let xrcd = x._xrcds.0.clone();
    let mut srq2 = pd2.create_xrc_srq(&xrcd, &cq2, 8, 1, 0).unwrap();
    srq2.post_recv(&[RecvWr {
        wr_id: 55,
        sgl: &[mr2.sge(0, 4096)],
    }])
    .unwrap();
    let data: Vec<u8> = (0..16384u32).map(|i| (i % 251) as u8).collect();
    x.b.buf.write(65536, &data).unwrap();
    let s0 = x.srqs[0].0.srqn();
    let remote = RemoteAddr {
        addr: x.b.mr.addr() + 65536,
        rkey: x.b.mr.rkey(),
    };
    // 16 KiB in 256-byte responses, then a SEND to the other PD's SRQ right behind it.
    let sge = [x.a.mr.sge(131072, 16384)];
    let read = SendWr::new(1, WrOp::Read(remote), &sge).xrc(s0);
    let msg = [x.a.mr.sge(0, 32)];
    let send = SendWr::new(2, WrOp::Send, &msg).xrc(srq2.srqn());
    x.ini.post_send(&[read, send]).unwrap();
    let wc = wait(&x.fabric, &mut x.a.cq, 2);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    let mut got = vec![0u8; 16384];
    x.a.buf.read(131072, &mut got).unwrap();
    assert_eq!(got, data);
    assert_eq!(wait(&x.fabric, &mut { cq2 }, 1)[0].wr_id, 55);
}
