//! Unreliable datagrams end to end (ABI 1.5): UD QPs, address handles, the GRH area and the
//! source fields of a receive, Q_Keys, the drop rules, SRQs, and every bad input the issue
//! names, through the driver and the emulated NIC.

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_specs::cmd::{QpAttr, QpAttrMask as M, QKEY_USE_QP};
use ringbell_specs::wqe::{CtrlSeg, DataSeg, SendOpcode, WqeFlags};
use ringbell_tests::*;
use zerocopy::IntoBytes;

const QKEY: u32 = 0x1111_2222;

/// A UD endpoint: device, PD, CQ, registered buffer and a UD QP in RTS.
struct Ud {
    qp: QueuePair,
    mr: MemoryRegion,
    buf: DmaBuffer,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    dev: Device,
}

fn ud_on(fabric: &Fabric, node: usize, qkey: u32) -> Ud {
    let dev = Device::open(Box::new(fabric.port(node))).expect("open");
    let pd = dev.alloc_pd().expect("pd");
    let buf = dev.alloc_dma(1 << 20).expect("dma");
    let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE).expect("mr");
    let cq = dev.create_cq(512).expect("cq");
    let mut init = QpInit::new(&cq, &cq);
    init.qp_type = QpType::Ud;
    init.max_inline = 128;
    let mut qp = pd.create_qp(&init).expect("ud qp");
    qp.ud_ready(qkey, 7).expect("ud ready");
    Ud {
        qp,
        mr,
        buf,
        cq,
        pd,
        dev,
    }
}

/// Another UD QP in `pd`, completing on `cq`, in RTS with Q_Key `qkey`.
fn ud_qp(pd: &ProtectionDomain, cq: &CompletionQueue, qkey: u32) -> QueuePair {
    let mut init = QpInit::new(cq, cq);
    init.qp_type = QpType::Ud;
    let mut qp = pd.create_qp(&init).expect("ud qp");
    qp.ud_ready(qkey, 0).expect("ud ready");
    qp
}

/// Sends `len` bytes at `off` of `u`'s buffer from `qp` (a QP in `u`'s PD) to `to`.
fn send_from(u: &Ud, qp: &mut QueuePair, to: &Ud, wr_id: u64, len: u32, qkey: u32) {
    let ah = u.pd.create_ah(&to.dev.ah_attr()).unwrap();
    let sge = [u.mr.sge(0, len)];
    let dest = UdDest {
        ah: &ah,
        qpn: to.qp.qpn(),
        qkey,
    };
    qp.post_send(&[SendWr::new(wr_id, WrOp::Send, &sge).to(dest)])
        .unwrap();
}

fn post_recv(u: &mut Ud, wr_id: u64, off: u64, len: u32) {
    let sge = [u.mr.sge(off, len)];
    u.qp.post_recv(&[RecvWr { wr_id, sgl: &sge }]).unwrap();
}

fn send(from: &mut Ud, to: &Ud, wr_id: u64, op: WrOp, off: u64, len: u32, qkey: u32) {
    let ah = from.pd.create_ah(&to.dev.ah_attr()).unwrap();
    let sge = [from.mr.sge(off, len)];
    let dest = UdDest {
        ah: &ah,
        qpn: to.qp.qpn(),
        qkey,
    };
    from.qp
        .post_send(&[SendWr::new(wr_id, op, &sge).to(dest)])
        .unwrap();
}

fn two(seed: u64) -> (Fabric, Ud, Ud) {
    let f = Fabric::new(FabricConfig::new(2, seed));
    let a = ud_on(&f, 0, QKEY);
    let b = ud_on(&f, 1, QKEY);
    (f, a, b)
}

#[test]
fn datagram_lands_after_the_grh_area_with_its_source() {
    let (f, mut a, mut b) = two(1);
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 13 + 1) as u8).collect();
    a.buf.write(0, &data).unwrap();
    post_recv(&mut b, 77, 4096, 2048);
    send(&mut a, &b, 5, WrOp::SendImm(0xfeed), 0, 1000, QKEY);
    let s = wait(&f, &mut a.cq, 1);
    assert_eq!(
        (s[0].wr_id, s[0].status, s[0].opcode, s[0].byte_len),
        (5, WcStatus::Success, WcOpcode::Send, 1000)
    );
    let r = wait(&f, &mut b.cq, 1);
    let r = r[0];
    assert_eq!(
        (r.wr_id, r.status, r.opcode),
        (77, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!(r.byte_len as usize, GRH_LEN + 1000);
    assert_eq!(r.imm, Some(0xfeed));
    let src = r.source.expect("UD source");
    assert_eq!(src.qpn, a.qp.qpn());
    assert_eq!(src.ah_attr(), a.dev.ah_attr());
    let mut got = vec![0u8; GRH_LEN + 1000];
    b.buf.read(4096, &mut got).unwrap();
    assert_eq!(&got[GRH_LEN..], &data[..]);
    // The GRH area: 20 bytes of zeros, then the IPv4 header from the sender.
    assert!(got[..20].iter().all(|&x| x == 0));
    assert_eq!(got[20] >> 4, 4, "IPv4 version");
    assert_eq!(&got[20 + 12..20 + 16], &a.dev.ah_attr().ip, "IPv4 source");
    assert_eq!(
        &got[20 + 16..20 + 20],
        &b.dev.ah_attr().ip,
        "IPv4 destination"
    );
    let st = b.qp.ud_stats().unwrap();
    assert_eq!(st.received, 1);
    assert_eq!(a.qp.ud_stats().unwrap().sent, 1);
    // An RC completion carries no source.
    let mut p = pair();
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 1,
            sgl: &[p.b.mr.sge(0, 64)],
        }])
        .unwrap();
    p.a.qp
        .post_send(&[SendWr::inline(2, WrOp::Send, b"rc")])
        .unwrap();
    assert_eq!(wait(&p.fabric, &mut p.b.cq, 1)[0].source, None);
}

#[test]
fn inline_datagrams_and_many_senders() {
    let f = Fabric::new(FabricConfig::new(4, 9));
    let mut r = ud_on(&f, 0, QKEY);
    let mut senders: Vec<Ud> = (1..4).map(|n| ud_on(&f, n, QKEY)).collect();
    for i in 0..6u64 {
        post_recv(&mut r, 100 + i, i * 256, 256);
    }
    for (k, s) in senders.iter_mut().enumerate() {
        let ah = s.pd.create_ah(&r.dev.ah_attr()).unwrap();
        for j in 0..2u8 {
            let msg = [k as u8 * 16 + j; 100];
            let dest = UdDest {
                ah: &ah,
                qpn: r.qp.qpn(),
                qkey: QKEY,
            };
            s.qp.post_send(&[SendWr::inline(j as u64, WrOp::Send, &msg).to(dest)])
                .unwrap();
        }
    }
    let got = wait(&f, &mut r.cq, 6);
    let mut seen = Vec::new();
    for w in &got {
        assert_eq!(w.status, WcStatus::Success);
        assert_eq!(w.byte_len as usize, GRH_LEN + 100);
        let src = w.source.unwrap();
        let k = senders
            .iter()
            .position(|s| s.qp.qpn() == src.qpn && s.dev.ah_attr() == src.ah_attr())
            .expect("a known sender");
        let mut body = [0u8; 100];
        r.buf
            .read((w.wr_id as usize - 100) * 256 + GRH_LEN, &mut body)
            .unwrap();
        assert!(
            body.iter().all(|&x| x >> 4 == k as u8),
            "payload of sender {k}"
        );
        seen.push((k, body[0] & 15));
    }
    seen.sort();
    assert_eq!(seen, vec![(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]);
    for s in &mut senders {
        assert_eq!(wait(&f, &mut s.cq, 2).len(), 2);
    }
}

#[test]
fn wrong_qkey_no_receive_and_small_buffer_are_dropped_and_counted() {
    let (f, mut a, mut b) = two(2);
    a.buf.write(0, &[0x5a; 512]).unwrap();
    // Wrong Q_Key: dropped, the receive WQE stays.
    post_recv(&mut b, 1, 0, 1024);
    send(&mut a, &b, 10, WrOp::Send, 0, 100, QKEY ^ 1);
    assert_eq!(
        wait(&f, &mut a.cq, 1)[0].status,
        WcStatus::Success,
        "the sender is never told"
    );
    settle(&f);
    assert!(drain(&f, &mut b.cq).is_empty());
    // Too long for the posted buffer (GRH area included): dropped, the WQE stays.
    send(
        &mut a,
        &b,
        11,
        WrOp::Send,
        0,
        1024 - GRH_LEN as u32 + 1,
        QKEY,
    );
    wait(&f, &mut a.cq, 1);
    assert!(drain(&f, &mut b.cq).is_empty());
    // Exactly fitting: taken.
    send(&mut a, &b, 12, WrOp::Send, 0, 1024 - GRH_LEN as u32, QKEY);
    wait(&f, &mut a.cq, 1);
    let r = wait(&f, &mut b.cq, 1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (1, WcStatus::Success, 1024)
    );
    // Nothing posted now: dropped.
    send(&mut a, &b, 13, WrOp::Send, 0, 8, QKEY);
    wait(&f, &mut a.cq, 1);
    assert!(drain(&f, &mut b.cq).is_empty());
    let st = b.qp.ud_stats().unwrap();
    assert_eq!(
        (
            st.received,
            st.qkey_dropped,
            st.too_long_dropped,
            st.no_recv_dropped
        ),
        (1, 1, 1, 1)
    );
    assert_eq!(
        b.qp.query_state().unwrap(),
        QpState::Rts,
        "no drop kills the QP"
    );
    // And it keeps serving.
    post_recv(&mut b, 2, 0, 256);
    send(&mut a, &b, 14, WrOp::Send, 0, 8, QKEY);
    assert_eq!(wait(&f, &mut b.cq, 1)[0].wr_id, 2);
}

#[test]
fn qkey_bit_31_sends_the_qps_own_qkey() {
    let (f, mut a, mut b) = two(3);
    post_recv(&mut b, 1, 0, 256);
    send(&mut a, &b, 1, WrOp::Send, 0, 16, QKEY_USE_QP);
    assert_eq!(wait(&f, &mut b.cq, 1)[0].status, WcStatus::Success);
    // A sender whose own Q_Key differs is refused through the same bit.
    let mut c = ud_qp(&a.pd, &a.cq, 0x42);
    send_from(&a, &mut c, &b, 2, 16, QKEY_USE_QP);
    wait(&f, &mut a.cq, 2);
    post_recv(&mut b, 2, 512, 256);
    settle(&f);
    assert!(drain(&f, &mut b.cq).is_empty());
    assert_eq!(b.qp.ud_stats().unwrap().qkey_dropped, 1);
}

#[test]
fn a_datagram_above_the_mtu_is_a_local_length_error() {
    let (f, mut a, mut b) = two(4);
    post_recv(&mut b, 1, 0, 8192);
    send(&mut a, &b, 1, WrOp::Send, 0, 4097, QKEY);
    let w = wait(&f, &mut a.cq, 1);
    assert_eq!(w[0].status, WcStatus::LocLenErr, "{w:?}");
    settle(&f);
    assert!(drain(&f, &mut b.cq).is_empty(), "nothing was sent");
    assert_eq!(b.qp.ud_stats().unwrap().received, 0);
    // The receiver and a fresh sender still work; 4096 bytes is one packet.
    let mut c = ud_qp(&a.pd, &a.cq, QKEY);
    send_from(&a, &mut c, &b, 2, 4096, QKEY);
    let r = wait(&f, &mut b.cq, 1);
    assert_eq!(
        (r[0].status, r[0].byte_len as usize),
        (WcStatus::Success, GRH_LEN + 4096)
    );
}

#[test]
fn rc_only_operations_on_a_ud_qp_are_refused() {
    let (f, mut a, b) = two(5);
    let ah = a.pd.create_ah(&b.dev.ah_attr()).unwrap();
    let dest = UdDest {
        ah: &ah,
        qpn: b.qp.qpn(),
        qkey: QKEY,
    };
    let sge = [a.mr.sge(0, 8)];
    let remote = RemoteAddr { addr: 0, rkey: 1 };
    for op in [
        WrOp::Write(remote),
        WrOp::WriteImm(remote, 1),
        WrOp::Read(remote),
        WrOp::CmpSwap {
            remote,
            compare: 0,
            swap: 1,
        },
        WrOp::FetchAdd { remote, add: 1 },
    ] {
        let e = a.qp.post_send(&[SendWr::new(1, op, &sge).to(dest)]);
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{op:?}: {e:?}");
    }
    // No destination at all.
    let e = a.qp.post_send(&[SendWr::new(1, WrOp::Send, &sge)]);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    // The device refuses an RC opcode in a UD WQE written by hand: LOC_QP_OP_ERR.
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Write as u8,
        flags: WqeFlags::SIGNALED.bits(),
        ds_count: 4,
        ..Default::default()
    };
    let mut raw = Vec::from(ctrl.as_bytes());
    raw.extend_from_slice(&[0u8; 32]);
    raw.extend_from_slice(
        DataSeg {
            byte_count: 8.into(),
            lkey: a.mr.lkey().into(),
            addr: a.mr.addr().into(),
        }
        .as_bytes(),
    );
    a.qp.post_raw_wqe(99, &raw).unwrap();
    let w = wait(&f, &mut a.cq, 1);
    assert_eq!(
        (w[0].wr_id, w[0].status),
        (99, WcStatus::LocQpOpErr),
        "{w:?}"
    );
}

#[test]
fn an_address_handle_of_another_pd_is_refused() {
    let (_f, mut a, b) = two(6);
    let other = a.dev.alloc_pd().unwrap();
    let ah = other.create_ah(&b.dev.ah_attr()).unwrap();
    let sge = [a.mr.sge(0, 8)];
    let dest = UdDest {
        ah: &ah,
        qpn: b.qp.qpn(),
        qkey: QKEY,
    };
    let e = a.qp.post_send(&[SendWr::new(1, WrOp::Send, &sge).to(dest)]);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    // Nothing was posted.
    settle(&_f);
    assert!(drain(&_f, &mut a.cq).is_empty());
    assert!(a
        .pd
        .create_ah(&AhAttr {
            mac: [1, 0, 0, 0, 0, 0],
            ip: [10, 0, 0, 9]
        })
        .is_err());
    assert!(a
        .pd
        .create_ah(&AhAttr {
            mac: [2, 0, 0, 0, 0, 0],
            ip: [0; 4]
        })
        .is_err());
}

#[test]
fn each_transport_drops_the_others_packets() {
    let f = Fabric::new(FabricConfig::new(2, 7));
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mut rc_a = side(&f, 0, all);
    let mut rc_b = side(&f, 1, all);
    let mut u = ud_qp(&rc_b.pd, &rc_b.cq, QKEY);
    // RC traffic aimed at the UD QP: dropped there; the RC sender runs out of retries.
    let opts = ConnectOptions {
        timeout: 1,
        retry_cnt: 1,
        ..Default::default()
    };
    let at_ud = Endpoint {
        qpn: u.qpn(),
        ..rc_b.qp.endpoint(0)
    };
    rc_a.qp.connect(&at_ud, 0, &opts).unwrap();
    rc_a.qp
        .post_send(&[SendWr::inline(1, WrOp::Send, b"to a UD QP")])
        .unwrap();
    let w = wait(&f, &mut rc_a.cq, 1);
    assert_eq!(w[0].status, WcStatus::RetryExcErr, "{w:?}");
    assert!(u.ud_stats().unwrap().wrong_transport_dropped >= 1);
    assert_eq!(u.query_state().unwrap(), QpState::Rts);
    // UD traffic aimed at an RC QP: dropped there, and the RC QP still works.
    let mut rc_c = {
        let mut init = QpInit::new(&rc_a.cq, &rc_a.cq);
        init.max_inline = 64;
        rc_a.pd.create_qp(&init).unwrap()
    };
    rc_b.qp
        .connect(&rc_c.endpoint(0), 0, &Default::default())
        .unwrap();
    rc_c.connect(&rc_b.qp.endpoint(0), 0, &Default::default())
        .unwrap();
    let ah = rc_b.pd.create_ah(&rc_b.dev.ah_attr()).unwrap();
    let sge = [rc_b.mr.sge(0, 8)];
    u.post_send(&[SendWr::new(3, WrOp::Send, &sge).to(UdDest {
        ah: &ah,
        qpn: rc_b.qp.qpn(),
        qkey: QKEY,
    })])
    .unwrap();
    let s = wait(&f, &mut rc_b.cq, 1);
    assert_eq!((s[0].wr_id, s[0].status), (3, WcStatus::Success));
    settle(&f);
    assert_eq!(rc_b.qp.ud_stats().unwrap().wrong_transport_dropped, 1);
    rc_b.qp
        .post_recv(&[RecvWr {
            wr_id: 4,
            sgl: &[rc_b.mr.sge(0, 64)],
        }])
        .unwrap();
    rc_c.post_send(&[SendWr::inline(5, WrOp::Send, b"still fine")])
        .unwrap();
    let r = wait(&f, &mut rc_b.cq, 1);
    assert_eq!((r[0].wr_id, r[0].status), (4, WcStatus::Success));
}

#[test]
fn ud_qps_share_an_srq() {
    let f = Fabric::new(FabricConfig::new(2, 8));
    let mut a = ud_on(&f, 0, QKEY);
    let dev = Device::open(Box::new(f.port(1))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(1 << 16).unwrap();
    let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE).unwrap();
    let mut cq = dev.create_cq(64).unwrap();
    let mut srq = pd.create_srq(64, 1, 0).unwrap();
    let mut qps = Vec::new();
    for _ in 0..2 {
        let mut init = QpInit::new(&cq, &cq);
        init.qp_type = QpType::Ud;
        init.srq = Some(&srq);
        let mut qp = pd.create_qp(&init).unwrap();
        qp.ud_ready(QKEY, 0).unwrap();
        qps.push(qp);
    }
    for i in 0..4u64 {
        srq.post_recv(&[RecvWr {
            wr_id: 50 + i,
            sgl: &[mr.sge(i * 1024, 1024)],
        }])
        .unwrap();
    }
    let ah = a.pd.create_ah(&dev.ah_attr()).unwrap();
    for (i, qp) in qps.iter().chain(qps.iter()).enumerate() {
        let msg = [i as u8; 32];
        let dest = UdDest {
            ah: &ah,
            qpn: qp.qpn(),
            qkey: QKEY,
        };
        a.qp.post_send(&[SendWr::inline(i as u64, WrOp::Send, &msg).to(dest)])
            .unwrap();
    }
    let got = wait(&f, &mut cq, 4);
    let mut per_qp = [0; 2];
    for w in &got {
        assert_eq!(w.status, WcStatus::Success);
        assert_eq!(w.source.unwrap().qpn, a.qp.qpn());
        let k = qps.iter().position(|q| q.qpn() == w.qpn).unwrap();
        per_qp[k] += 1;
    }
    assert_eq!(per_qp, [2, 2]);
    wait(&f, &mut a.cq, 4);
}

#[test]
fn ud_state_masks_follow_the_ibta_table() {
    let f = Fabric::new(FabricConfig::new(1, 1));
    let dev = Device::open(Box::new(f.port(0))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let cq = dev.create_cq(16).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.qp_type = QpType::Ud;
    let mut ud = pd.create_qp(&init).unwrap();
    let mut rc = pd.create_qp(&QpInit::new(&cq, &cq)).unwrap();
    let at = |s: QpState, qkey: u32| QpAttr {
        state: s as u8,
        qkey: qkey.into(),
        ..Default::default()
    };
    let bad = |r: Result<(), Error>| {
        assert!(
            matches!(&r, Err(Error::Command { status, .. }) if format!("{status:?}") == "BadParam"),
            "{r:?}"
        )
    };
    // UD RESET -> INIT needs the Q_Key; RC never takes one.
    bad(ud.modify(M::STATE | M::PKEY_INDEX | M::PORT, &at(QpState::Init, 1)));
    bad(rc.modify(
        M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS | M::QKEY,
        &at(QpState::Init, 1),
    ));
    // A Q_Key with bit 31 set cannot be a QP's own.
    bad(ud.modify(
        M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
        &at(QpState::Init, QKEY_USE_QP | 1),
    ));
    // UD takes no path attributes.
    ud.modify(
        M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
        &at(QpState::Init, 5),
    )
    .unwrap();
    bad(ud.modify(M::STATE | M::AV | M::DEST_QPN, &at(QpState::Rtr, 5)));
    ud.modify(M::STATE, &at(QpState::Rtr, 5)).unwrap();
    bad(ud.modify(M::STATE, &at(QpState::Rts, 5)));
    ud.modify(M::STATE | M::SQ_PSN | M::QKEY, &at(QpState::Rts, 6))
        .unwrap();
    assert_eq!(ud.query().unwrap().qkey.get(), 6);
    assert!(matches!(
        ud.ud_ready(QKEY_USE_QP, 0),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn multicast_reaches_every_attached_qp_once_and_no_other() {
    use ringbell_specs::cmd::MCAST_QPN;
    let f = Fabric::new(FabricConfig::new(3, 21));
    let mut a = ud_on(&f, 0, QKEY);
    let mut b = ud_on(&f, 1, QKEY);
    let mut c = ud_on(&f, 2, QKEY);
    // A second QP on node 2, attached too; node 1's QP is attached, node 0's (the sender's
    // own NIC) as well, after the first datagram.
    let mut c2 = ud_qp(&c.pd, &c.cq, QKEY);
    let gid = |ip: [u8; 4]| {
        let mut g = [0u8; 16];
        g[10..12].fill(0xFF);
        g[12..].copy_from_slice(&ip);
        g
    };
    let group = [239, 1, 2, 3];
    for qp in [&b.qp, &c.qp, &c2] {
        qp.attach_mcast(gid(group)).unwrap();
    }
    b.qp.attach_mcast(gid(group)).unwrap();
    // Not a group address; a QP of another transport.
    assert!(b.qp.attach_mcast(gid([10, 0, 0, 2])).is_err());
    let mut p = pair();
    assert!(p.a.qp.attach_mcast(gid(group)).is_err());
    for (u, base) in [(&mut b, 0), (&mut c, 0)] {
        post_recv(u, 1, base, 1024);
        post_recv(u, 2, base + 1024, 1024);
    }
    for i in 0..2u64 {
        let sge = [c.mr.sge(8192 + i * 1024, 1024)];
        c2.post_recv(&[RecvWr {
            wr_id: 10 + i,
            sgl: &sge,
        }])
        .unwrap();
    }
    let ah = a.pd.create_ah(&AhAttr::multicast(group).unwrap()).unwrap();
    let msg = *b"to the group";
    let send = |a: &mut Ud, id| {
        let dest = UdDest {
            ah: &ah,
            qpn: MCAST_QPN,
            qkey: QKEY,
        };
        a.qp.post_send(&[SendWr::inline(id, WrOp::Send, &msg).to(dest)])
            .unwrap();
    };
    send(&mut a, 7);
    assert_eq!(wait(&f, &mut a.cq, 1)[0].status, WcStatus::Success);
    let got_b = drain(&f, &mut b.cq);
    let got_c = drain(&f, &mut c.cq);
    assert_eq!(got_b.len(), 1, "node 1's QP, once though attached twice");
    assert_eq!(got_c.len(), 2, "both QPs of node 2");
    for w in got_b.iter().chain(&got_c) {
        assert_eq!(
            (w.status, w.byte_len as usize),
            (WcStatus::Success, GRH_LEN + msg.len())
        );
        assert_eq!(w.source.unwrap().qpn, a.qp.qpn());
    }
    let mut body = [0u8; 12];
    c.buf.read(8192 + GRH_LEN, &mut body).unwrap();
    assert_eq!(body, msg);
    // The sender's own NIC delivers to its attached QP; a detached QP gets nothing.
    a.qp.attach_mcast(gid(group)).unwrap();
    post_recv(&mut a, 30, 0, 1024);
    c.qp.detach_mcast(gid(group)).unwrap();
    assert!(
        c.qp.detach_mcast(gid(group)).is_err(),
        "not attached any more"
    );
    send(&mut a, 8);
    let got_a = wait(&f, &mut a.cq, 2);
    assert!(got_a
        .iter()
        .any(|w| w.wr_id == 30 && w.opcode == WcOpcode::Recv));
    assert_eq!(drain(&f, &mut b.cq).len(), 1);
    let got_c = drain(&f, &mut c.cq);
    assert_eq!(
        got_c.iter().map(|w| w.qpn).collect::<Vec<_>>(),
        vec![c2.qpn()]
    );
    // A group datagram to a QPN other than the multicast one is dropped.
    let dest = UdDest {
        ah: &ah,
        qpn: b.qp.qpn(),
        qkey: QKEY,
    };
    a.qp.post_send(&[SendWr::inline(9, WrOp::Send, &msg).to(dest)])
        .unwrap();
    assert_eq!(wait(&f, &mut a.cq, 1)[0].wr_id, 9);
    assert!(drain(&f, &mut b.cq).is_empty());
    for qp in [&a.qp, &b.qp] {
        qp.detach_mcast(gid(group)).unwrap();
    }
    // Dropping a QP still attached detaches it first: the device destroys it (its number
    // is free again) and the group reaches nothing on its NIC.
    let n = c2.qpn();
    assert_eq!(c2.mcast_attached(), 1);
    drop(c2);
    assert_eq!(ud_qp(&c.pd, &c.cq, QKEY).qpn(), n);
    let _ = &mut p;
}
