//! Raw packet QPs and flow steering end to end (ABI 1.12): whole Ethernet frames sent by
//! SEND, steered by rules on the receiving NIC (fields, masks, priority, age), multicast to
//! every NIC and back to the sender's own, RoCE traffic untouched by rules, and what the
//! driver and the device refuse.

use proptest::prelude::*;
use ringbell::raw::{mapped, FlowRule};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_tests::*;

const MCAST: [u8; 6] = [0x01, 0x50, 0x56, 0x19, 0x20, 0xa7];
const SRC_MAC: [u8; 6] = [0x24, 0x8a, 0x07, 0xa5, 0x28, 0xc8];

fn raw_side(f: &Fabric, node: usize) -> Side {
    let mut s = side_of(f, node, Access::LOCAL_WRITE, QpType::RawPacket);
    s.qp.raw_ready().expect("raw QP to RTS");
    s
}

/// A fabric of two nodes with a raw packet QP in RTS on each, and node 1's MAC address.
fn two_raw(seed: u64) -> (Fabric, Side, Side, [u8; 6]) {
    let f = Fabric::new(FabricConfig::new(2, seed));
    let (a, b, b_mac) = raw_pair(&f);
    (f, a, b, b_mac)
}

/// A raw packet QP in RTS on nodes 0 and 1 of `f`, and node 1's MAC address.
fn raw_pair(f: &Fabric) -> (Side, Side, [u8; 6]) {
    let a = raw_side(f, 0);
    let b = raw_side(f, 1);
    let b_mac = b.dev.ah_attr().mac;
    (a, b, b_mac)
}

/// Another raw packet QP on `s`'s device, completing on `s`'s CQ, in RTS.
fn raw_qp(s: &Side) -> QueuePair {
    let mut init = QpInit::new(&s.cq, &s.cq);
    init.qp_type = QpType::RawPacket;
    init.max_recv_wr = 64;
    let mut qp = s.pd.create_qp(&init).expect("raw qp");
    qp.raw_ready().expect("raw QP to RTS");
    qp
}

/// An Ethernet frame: `dst`, `src`, then an IPv4 (`v6` false) or IPv6 header with protocol
/// `proto` (UDP 17 or TCP 6) from `sip` to `dip` and ports `sport` → `dport`, then `body`.
#[allow(clippy::too_many_arguments)]
fn frame(
    dst: [u8; 6],
    src: [u8; 6],
    v6: bool,
    proto: u8,
    sip: [u8; 16],
    dip: [u8; 16],
    (sport, dport): (u16, u16),
    body: &[u8],
) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    let l4_len = if proto == 6 { 20 } else { 8 } + body.len();
    if v6 {
        f.extend_from_slice(&0x86DDu16.to_be_bytes());
        f.extend_from_slice(&[0x60, 0, 0, 0]);
        f.extend_from_slice(&(l4_len as u16).to_be_bytes());
        f.extend_from_slice(&[proto, 64]);
        f.extend_from_slice(&sip);
        f.extend_from_slice(&dip);
    } else {
        f.extend_from_slice(&0x0800u16.to_be_bytes());
        f.extend_from_slice(&[0x45, 0]);
        f.extend_from_slice(&((20 + l4_len) as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
        f.extend_from_slice(&sip[12..]);
        f.extend_from_slice(&dip[12..]);
    }
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    if proto == 6 {
        f.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x10, 0xff, 0xff, 0, 0, 0, 0]);
    } else {
        f.extend_from_slice(&(l4_len as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0]);
    }
    f.extend_from_slice(body);
    f
}

fn udp4(dst: [u8; 6], sip: [u8; 4], dip: [u8; 4], ports: (u16, u16), body: &[u8]) -> Vec<u8> {
    frame(
        dst,
        SRC_MAC,
        false,
        17,
        mapped(sip),
        mapped(dip),
        ports,
        body,
    )
}

/// Sends `f` from `s`'s QP (from its buffer at offset 0) and waits for the send completion.
fn send_frame(fab: &Fabric, s: &mut Side, f: &[u8], wr_id: u64) -> WcStatus {
    s.buf.write(0, f).unwrap();
    let sge = [s.mr.sge(0, f.len() as u32)];
    s.qp.post_send(&[SendWr::new(wr_id, WrOp::Send, &sge)])
        .unwrap();
    let c = wait(fab, &mut s.cq, 1);
    assert_eq!(c[0].wr_id, wr_id);
    c[0].status
}

fn post_recvs(qp: &mut QueuePair, mr: &MemoryRegion, base: u64, n: u64) {
    for i in 0..n {
        let sge = [mr.sge(base + i * 16384, 16384)];
        qp.post_recv(&[RecvWr {
            wr_id: base + i,
            sgl: &sge,
        }])
        .unwrap();
    }
}

#[test]
fn a_frame_arrives_whole_at_the_qp_its_rule_names() {
    let (f, mut a, mut b, b_mac) = two_raw(1);
    let flow =
        b.qp.create_flow(&FlowRule::default().dst_mac(b_mac))
            .expect("flow");
    assert_eq!(b.qp.flows_attached(), 1);
    post_recvs(&mut b.qp, &b.mr, 1 << 16, 4);
    let body: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let fr = udp4(b_mac, [1, 1, 1, 1], [2, 2, 2, 2], (1234, 5678), &body);
    assert_eq!(send_frame(&f, &mut a, &fr, 9), WcStatus::Success);
    let r = wait(&f, &mut b.cq, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len as usize),
        (1 << 16, WcStatus::Success, WcOpcode::Recv, fr.len())
    );
    assert_eq!(r.source, None);
    let mut got = vec![0u8; fr.len()];
    b.buf.read(1 << 16, &mut got).unwrap();
    assert_eq!(got, fr, "the frame as sent, headers included");
    // A frame no rule matches is dropped and counted; with no rule left on the NIC, it is
    // a frame that is not RoCE, as before raw packet QPs.
    let mut other = fr.clone();
    other[0] ^= 2;
    let dropped = f.nic_stats(1).rx_dropped;
    assert_eq!(send_frame(&f, &mut a, &other, 10), WcStatus::Success);
    assert_eq!(f.nic_stats(1).rx_dropped, dropped);
    drop(flow);
    assert_eq!(b.qp.flows_attached(), 0);
    let (dropped, malformed) = (f.nic_stats(1).rx_dropped, f.nic_stats(1).rx_malformed);
    assert_eq!(send_frame(&f, &mut a, &fr, 11), WcStatus::Success);
    assert!(drain(&f, &mut b.cq).is_empty());
    assert_eq!(f.nic_stats(1).rx_dropped, dropped);
    assert_eq!(f.nic_stats(1).rx_malformed, malformed + 1);
}

#[test]
fn multicast_reaches_every_nic_and_loops_back_to_the_sender() {
    let f = Fabric::new(FabricConfig::new(3, 2));
    let mut a = raw_side(&f, 0);
    let mut b = raw_side(&f, 1);
    let mut c = raw_side(&f, 2);
    // On the sender's own NIC a second QP has the rule; the sending QP has none.
    let mut own = raw_qp(&a);
    let rule = FlowRule::default().dst_mac(MCAST).src_mac(SRC_MAC);
    let _fo = own.create_flow(&rule).unwrap();
    let _fb = b.qp.create_flow(&rule).unwrap();
    post_recvs(&mut own, &a.mr, 1 << 16, 2);
    post_recvs(&mut a.qp, &a.mr, 1 << 18, 2);
    post_recvs(&mut b.qp, &b.mr, 1 << 16, 2);
    post_recvs(&mut c.qp, &c.mr, 1 << 16, 2);
    let fr = udp4(MCAST, [1, 1, 1, 1], [2, 2, 2, 2], (1, 2), b"multicast");
    assert_eq!(send_frame(&f, &mut a, &fr, 1), WcStatus::Success);
    let got_own = wait(&f, &mut a.cq, 1)[0];
    assert_eq!((got_own.qpn, got_own.wr_id), (own.qpn(), 1 << 16));
    let got_b = wait(&f, &mut b.cq, 1)[0];
    assert_eq!(got_b.byte_len as usize, fr.len());
    // Node 2 has no rule, node 0's sending QP none either.
    assert!(drain(&f, &mut c.cq).is_empty());
    assert!(drain(&f, &mut a.cq).is_empty());
    let mut back = vec![0u8; fr.len()];
    a.buf.read(1 << 16, &mut back).unwrap();
    assert_eq!(back, fr);
}

#[test]
fn the_lowest_priority_then_the_oldest_rule_wins() {
    let (f, mut a, b, b_mac) = two_raw(3);
    let mut q: Vec<QueuePair> = (0..3).map(|_| raw_qp(&b)).collect();
    for (i, qp) in q.iter_mut().enumerate() {
        post_recvs(qp, &b.mr, (i as u64 + 1) << 16, 4);
    }
    let any = FlowRule::default().dst_mac(b_mac);
    let udp = any.ipv4_dst([2, 2, 2, 2]).ip_proto(17).dst_port(5678);
    let f0 = q[0].create_flow(&any.priority(5)).unwrap();
    let _f1 = q[1].create_flow(&udp.priority(3)).unwrap();
    let _f2 = q[2].create_flow(&any.priority(5)).unwrap();
    let mut cq = b.cq;
    let to = |port| udp4(b_mac, [1, 1, 1, 1], [2, 2, 2, 2], (1, port), b"x");
    // The UDP rule has the lowest priority; another port falls to the older of the two
    // broad rules; once it is gone, to the younger.
    send_frame(&f, &mut a, &to(5678), 1);
    assert_eq!(wait(&f, &mut cq, 1)[0].qpn, q[1].qpn());
    send_frame(&f, &mut a, &to(5679), 2);
    assert_eq!(wait(&f, &mut cq, 1)[0].qpn, q[0].qpn());
    drop(f0);
    send_frame(&f, &mut a, &to(5679), 3);
    assert_eq!(wait(&f, &mut cq, 1)[0].qpn, q[2].qpn());
}

#[test]
fn ipv6_tcp_rules_and_prefix_masks() {
    let (f, mut a, mut b, b_mac) = two_raw(4);
    let sip: [u8; 16] = [
        0xa0, 0xa1, 0, 0, 0, 0, 0, 0, 0, 0, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7,
    ];
    let mut rule = FlowRule::default().ipv6_src(sip).ip_proto(6).src_port(80);
    // Only the first 64 bits of the source.
    rule.mask.src_ip = [
        0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let _fl = b.qp.create_flow(&rule).unwrap();
    post_recvs(&mut b.qp, &b.mr, 1 << 16, 8);
    let mut other = sip;
    other[15] ^= 0xFF;
    let mut far = sip;
    far[0] ^= 1;
    let cases = [
        (
            frame(b_mac, SRC_MAC, true, 6, other, sip, (80, 9), b"a"),
            true,
        ),
        (
            frame(b_mac, SRC_MAC, true, 6, far, sip, (80, 9), b"b"),
            false,
        ),
        (
            frame(b_mac, SRC_MAC, true, 17, sip, sip, (80, 9), b"c"),
            false,
        ),
        (
            frame(b_mac, SRC_MAC, true, 6, sip, sip, (81, 9), b"d"),
            false,
        ),
        (
            frame(b_mac, SRC_MAC, false, 6, sip, sip, (80, 9), b"e"),
            false,
        ),
    ];
    for (i, (fr, hit)) in cases.iter().enumerate() {
        send_frame(&f, &mut a, fr, i as u64);
        let got = drain(&f, &mut b.cq);
        assert_eq!(got.len(), *hit as usize, "case {i}");
    }
}

#[test]
fn rules_leave_roce_traffic_to_the_transport() {
    let mut p = pair();
    // A rule that matches every frame, on B's NIC, for a raw QP of B's.
    let mut raw = raw_qp(&p.b);
    let _all = raw.create_flow(&FlowRule::default()).unwrap();
    post_recvs(&mut raw, &p.b.mr, 1 << 16, 2);
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 7,
            sgl: &[p.b.mr.sge(0, 64)],
        }])
        .unwrap();
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Send, b"roce")])
        .unwrap();
    let r = wait(&p.fabric, &mut p.b.cq, 1)[0];
    assert_eq!((r.qpn, r.wr_id, r.byte_len), (p.b.qp.qpn(), 7, 4));
    assert_eq!(wait(&p.fabric, &mut p.a.cq, 1)[0].status, WcStatus::Success);
    assert!(
        drain(&p.fabric, &mut p.b.cq).is_empty(),
        "nothing for the raw QP"
    );
}

#[test]
fn what_the_driver_and_the_device_refuse() {
    let f = Fabric::new(FabricConfig::new(2, 5));
    let mut a = raw_side(&f, 0);
    // A frame shorter than an Ethernet header, and one longer than a jumbo frame.
    assert_eq!(send_frame(&f, &mut a, &[0u8; 13], 1), WcStatus::LocLenErr);
    // The QP is in ERR after a failed send: the next cases each get a fresh one.
    a.qp = raw_qp(&a);
    let big = vec![0u8; RAW_MAX_FRAME_TEST + 1];
    assert_eq!(send_frame(&f, &mut a, &big, 2), WcStatus::LocLenErr);
    a.qp = raw_qp(&a);
    assert_eq!(
        send_frame(&f, &mut a, &vec![0u8; RAW_MAX_FRAME_TEST], 3),
        WcStatus::Success
    );
    // SEND only.
    let sge = [a.mr.sge(0, 64)];
    let write = WrOp::Write(RemoteAddr { addr: 0, rkey: 1 });
    assert!(matches!(
        a.qp.post_send(&[SendWr::new(4, write, &sge)]),
        Err(Error::InvalidArgument(_))
    ));
    // Rules steer to raw packet QPs only.
    let rc = side(&f, 1, Access::LOCAL_WRITE);
    assert!(matches!(
        rc.qp.create_flow(&FlowRule::default()),
        Err(Error::InvalidArgument(_))
    ));
}

const RAW_MAX_FRAME_TEST: usize = ringbell::raw::RAW_MAX_FRAME;

/// The reference: rule `r` matches a frame of these fields when every field it sets agrees.
#[derive(Clone, Debug)]
struct Pkt {
    dst_bcast: bool,
    v6: bool,
    proto: u8,
    sip: u8,
    dport: u16,
}

#[derive(Clone, Debug)]
struct RefRule {
    priority: u16,
    v6: Option<bool>,
    proto: Option<u8>,
    sip: Option<u8>,
    dport: Option<u16>,
    mcast: Option<bool>,
}

impl RefRule {
    fn matches(&self, p: &Pkt) -> bool {
        self.v6.is_none_or(|v| v == p.v6)
            && self.proto.is_none_or(|v| v == p.proto)
            && self.sip.is_none_or(|v| v == p.sip)
            && self.dport.is_none_or(|v| v == p.dport)
            && self.mcast.is_none_or(|v| v == p.dst_bcast)
    }
    fn rule(&self, unicast: [u8; 6]) -> FlowRule {
        let mut r = FlowRule::default().priority(self.priority);
        let addr = |b: u8, v6: bool| match v6 {
            true => [b; 16],
            false => mapped([b; 4]),
        };
        if let Some(v6) = self.v6 {
            r = r.ethertype(if v6 { 0x86DD } else { 0x0800 });
            if let Some(s) = self.sip {
                r = match v6 {
                    true => r.ipv6_src(addr(s, true)),
                    false => r.ipv4_src([s; 4]),
                };
            }
        }
        if let Some(p) = self.proto {
            r = r.ip_proto(p);
        }
        if let Some(d) = self.dport {
            r = r.dst_port(d);
        }
        if let Some(m) = self.mcast {
            r = r.dst_mac(if m { MCAST } else { unicast });
        }
        r
    }
}

fn ref_rule() -> impl Strategy<Value = RefRule> {
    (
        0u16..3,
        proptest::option::of(any::<bool>()),
        proptest::option::of(prop_oneof![Just(6u8), Just(17u8)]),
        proptest::option::of(1u8..3),
        proptest::option::of(1u16..3),
        proptest::option::of(any::<bool>()),
    )
        .prop_map(|(priority, v6, proto, sip, dport, mcast)| RefRule {
            priority,
            v6,
            proto,
            sip: sip.filter(|_| v6.is_some()),
            dport,
            mcast,
        })
}

fn pkt() -> impl Strategy<Value = Pkt> {
    (
        any::<bool>(),
        any::<bool>(),
        prop_oneof![Just(6u8), Just(17u8)],
        1u8..3,
        1u16..3,
    )
        .prop_map(|(dst_bcast, v6, proto, sip, dport)| Pkt {
            dst_bcast,
            v6,
            proto,
            sip,
            dport,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Against a reference matcher over the same fields: every frame reaches the QP of the
    /// first rule by (priority, age) that matches it, or none, whole.
    #[test]
    fn steering_follows_priority_and_age(rules in proptest::collection::vec(ref_rule(), 1..5),
                                         pkts in proptest::collection::vec(pkt(), 1..10)) {
        let (f, mut a, b, b_mac) = two_raw(6);
        let mut qps: Vec<QueuePair> = rules.iter().map(|_| raw_qp(&b)).collect();
        let mut flows = Vec::new();
        for (i, (r, qp)) in rules.iter().zip(&mut qps).enumerate() {
            flows.push(qp.create_flow(&r.rule(b_mac)).unwrap());
            post_recvs(qp, &b.mr, i as u64 * 10 * 16384, 10);
        }
        let mut cq = b.cq;
        for (k, p) in pkts.iter().enumerate() {
            let dst = if p.dst_bcast { MCAST } else { b_mac };
            let ip = |v: u8| if p.v6 { [v; 16] } else { mapped([v; 4]) };
            let fr = frame(dst, SRC_MAC, p.v6, p.proto, ip(p.sip), ip(9), (7, p.dport), &[k as u8; 33]);
            prop_assert_eq!(send_frame(&f, &mut a, &fr, k as u64), WcStatus::Success);
            let want = rules
                .iter()
                .enumerate()
                .filter(|(_, r)| r.matches(p))
                .min_by_key(|(i, r)| (r.priority, *i))
                .map(|(i, _)| qps[i].qpn());
            let got = drain(&f, &mut cq);
            prop_assert_eq!(got.iter().map(|c| c.qpn).collect::<Vec<_>>(), want.into_iter().collect::<Vec<_>>());
            if let (Some(c), Some(i)) = (got.first(), want.and_then(|q| qps.iter().position(|x| x.qpn() == q))) {
                // The receive's offset: its QP's block of ten, then its place in it.
                let base = i as u64 * 10 * 16384;
                let off = base + (c.wr_id - base) * 16384;
                let mut back = vec![0u8; fr.len()];
                b.buf.read(off as usize, &mut back).unwrap();
                prop_assert_eq!(c.byte_len as usize, fr.len());
                prop_assert_eq!(back, fr);
            }
        }
        drop(flows);
    }
}

#[test]
fn rss_spreads_frames_over_its_wqs_by_the_toeplitz_hash() {
    use ringbell::raw::*;
    let (f, mut a, mut b, b_mac) = two_raw(7);
    let key: Vec<u8> = (0..40u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    let mut cqs: Vec<CompletionQueue> = (0..4).map(|_| b.dev.create_cq(64).unwrap()).collect();
    let mut wqs: Vec<SharedReceiveQueue> = cqs
        .iter()
        .map(|cq| b.pd.create_recv_wq(cq, 32, 1).unwrap())
        .collect();
    let mut init = QpInit::new(&b.cq, &b.cq);
    init.qp_type = QpType::RawPacket;
    let rss = b.pd.create_qp(&init).unwrap();
    let fields = RSS_SRC_IPV4 | RSS_DST_IPV4 | RSS_SRC_PORT_UDP | RSS_DST_PORT_UDP;
    rss.set_rss(fields, &key, &wqs.iter().collect::<Vec<_>>())
        .unwrap();
    // A second table, or RSS on an RC QP, is refused.
    assert!(rss.set_rss(fields, &key, &[&wqs[0]]).is_err());
    assert!(b.qp.set_rss(fields, &key, &[&wqs[0]]).is_err());
    let _fl = rss
        .create_flow(&FlowRule::default().dst_mac(b_mac))
        .unwrap();
    for (i, w) in wqs.iter_mut().enumerate() {
        let base = i as u64 * 32 * 256;
        for j in 0..32u64 {
            let sge = [b.mr.sge(base + j * 256, 256)];
            w.post_recv(&[RecvWr {
                wr_id: base + j,
                sgl: &sge,
            }])
            .unwrap();
        }
    }
    // WQ 3 stays in RESET: what the hash sends it is dropped.
    for w in &wqs[..3] {
        w.modify_wq(WqState::Ready).unwrap();
    }
    let mut want = [0usize; 4];
    for i in 0..32u8 {
        let (sip, dip, sp, dp) = (
            [i, i + 1, i + 2, i + 3],
            [2, 2, 2, 2],
            1000 + i as u16,
            5678u16,
        );
        let fr = udp4(b_mac, sip, dip, (sp, dp), &[i; 20]);
        assert_eq!(send_frame(&f, &mut a, &fr, i.into()), WcStatus::Success);
        let input = [&sip[..], &dip[..], &sp.to_be_bytes(), &dp.to_be_bytes()].concat();
        let wq = ringbell_specs::cmd::toeplitz(&key, &input) as usize & 3;
        let dropped = f.nic_stats(1).rx_dropped;
        settle(&f);
        let got: Vec<usize> = cqs
            .iter_mut()
            .enumerate()
            .flat_map(|(k, cq)| poll_all(cq).into_iter().map(move |_| k))
            .collect();
        if wq == 3 {
            assert!(got.is_empty());
            assert_eq!(f.nic_stats(1).rx_dropped, dropped + 1);
        } else {
            assert_eq!(got, vec![wq], "frame {i}");
        }
        want[wq] += 1;
    }
    assert!(
        want.iter().filter(|&&n| n > 0).count() >= 3,
        "the hash spreads: {want:?}"
    );
    assert!(poll_all(&mut b.cq).is_empty(), "nothing on the QP's own CQ");
}

#[test]
fn a_corrupted_frame_is_dropped_never_delivered() {
    // Half the frames get a bit flipped on the way: the receiver's MAC finds the FCS wrong
    // and drops them; every frame that arrives is the frame sent.
    let mut cfg = FabricConfig::new(2, 8);
    cfg.faults.links = lossy_links(0, 0, 0, 500_000);
    let f = Fabric::new(cfg);
    let (mut a, mut b, b_mac) = raw_pair(&f);
    let _fl =
        b.qp.create_flow(&FlowRule::default().dst_mac(b_mac))
            .unwrap();
    post_recvs(&mut b.qp, &b.mr, 0, 40);
    let mut sent = Vec::new();
    for i in 0..40u8 {
        let fr = udp4(b_mac, [1, 1, 1, i], [2, 2, 2, 2], (1, 2), &[i; 64]);
        assert_eq!(send_frame(&f, &mut a, &fr, i.into()), WcStatus::Success);
        sent.push(fr);
    }
    let got = drain(&f, &mut b.cq);
    let dropped = f.stats().frames_fcs_dropped as usize;
    assert!(
        dropped > 5 && got.len() > 5,
        "{dropped} dropped, {} got",
        got.len()
    );
    assert_eq!(got.len() + dropped, 40);
    for (k, c) in got.iter().enumerate() {
        let mut back = vec![0u8; c.byte_len as usize];
        b.buf.read((c.wr_id * 16384) as usize, &mut back).unwrap();
        assert!(sent.contains(&back), "receive {k} is a frame that was sent");
    }
}

#[test]
fn dropping_a_qp_removes_its_rules_and_groups_first() {
    let (f, mut a, b, b_mac) = two_raw(9);
    let mut qp = raw_qp(&b);
    let rule = qp.create_flow(&FlowRule::default().dst_mac(b_mac)).unwrap();
    post_recvs(&mut qp, &b.mr, 0, 2);
    let fr = udp4(b_mac, [1, 1, 1, 1], [2, 2, 2, 2], (1, 2), b"x");
    send_frame(&f, &mut a, &fr, 1);
    settle(&f);
    let qpn = qp.qpn();
    // The QP goes before its rule's handle: the device destroys both (no rule is left to
    // steer the next frame, which is then not RoCE to a NIC without rules), and the
    // handle's drop afterwards does nothing.
    drop(qp);
    drop(rule);
    let malformed = f.nic_stats(1).rx_malformed;
    send_frame(&f, &mut a, &fr, 2);
    settle(&f);
    assert_eq!(f.nic_stats(1).rx_malformed, malformed + 1);
    // The QP number is free again: the device destroyed the QP.
    assert_eq!(raw_qp(&b).qpn(), qpn);
}

#[test]
fn raw_frames_in_a_capture_and_a_timeline_arrive_unchanged() {
    // A capture seals what it records only when it is RoCE: raw frames are recorded and
    // delivered as sent, multicast copies included.
    let f = Fabric::new(FabricConfig::new(2, 10));
    f.start_capture(std::io::sink()).unwrap();
    f.start_timeline(10_000).unwrap();
    let (mut a, mut b, b_mac) = raw_pair(&f);
    let _fl =
        b.qp.create_flow(&FlowRule::default().dst_mac(b_mac))
            .unwrap();
    let _fm =
        b.qp.create_flow(&FlowRule::default().dst_mac(MCAST))
            .unwrap();
    post_recvs(&mut b.qp, &b.mr, 0, 4);
    let frames = [
        udp4(b_mac, [1, 1, 1, 1], [2, 2, 2, 2], (1, 2), &[7; 100]),
        udp4(MCAST, [1, 1, 1, 1], [2, 2, 2, 2], (1, 2), &[8; 100]),
        vec![0xAB; 14],
    ];
    for (i, fr) in frames.iter().enumerate() {
        let mut fr = fr.clone();
        if i == 2 {
            fr[..6].copy_from_slice(&b_mac);
        }
        assert_eq!(send_frame(&f, &mut a, &fr, i as u64), WcStatus::Success);
        let got = wait(&f, &mut b.cq, 1)[0];
        let mut back = vec![0u8; got.byte_len as usize];
        b.buf.read((got.wr_id * 16384) as usize, &mut back).unwrap();
        assert_eq!(back, fr, "frame {i}");
    }
    settle(&f);
    let st = f.stop_capture().unwrap();
    // Three sent, the multicast one flooded to both NICs.
    assert_eq!(st.frames, 4);
    assert!(f.take_timeline().is_some());
}
