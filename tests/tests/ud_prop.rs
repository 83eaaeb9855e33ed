//! Property test: random datagram traffic on a lossy fabric, against a reference model.
//!
//! Two to five nodes, one to three UD QPs each (on a node's own SRQ or each on its own RQ),
//! each with one of two Q_Keys; random receive buffers (none, tiny, exact, large; one or two
//! scatter entries); datagrams of 0..=4096 bytes between random QPs (a node's own QPs
//! included), sent inline or gathered from one to three pieces, as SEND or SEND_WITH_IMM,
//! with the right Q_Key, a wrong one, or the sender's own (`QKEY_USE_QP`); links that lose,
//! duplicate, hold back and corrupt frames at random rates.
//!
//! What arrived where is read from the fabric's timeline: every frame a NIC takes off the
//! wire is an `Rx` stage naming its destination QP and PSN, and each sender QP sends from a
//! PSN range of its own, so an `Rx` names the datagram. The reference model replays those
//! arrivals in order through the UD receive rules (wrong Q_Key: dropped; nothing posted:
//! dropped; head receive too small for the 40-byte GRH area plus the payload: dropped, the
//! receive stays; otherwise the head receive takes it) and the test checks:
//!
//! - every send completes once, in post order, SUCCESS: the sender is never told of a drop;
//! - every receive completion is the one the model predicts (queue, order, wr_id), SUCCESS,
//!   `byte_len` = 40 + len, with the right immediate, solicited bit and source (QPN, MAC,
//!   IPv4); the buffer holds 20 zero bytes and the IPv4 header (sender to receiver), then the
//!   payload byte for byte, and nothing past it is touched; untaken buffers are untouched;
//!   the IPv4 header in the GRH area is the sender's (identification = PSN, TTL, length,
//!   checksum, addresses);
//! - per QP, `UdStats` are the model's: sent, received, and each drop reason, so
//!   received + qkey_dropped + no_recv_dropped + too_long_dropped == datagrams that arrived;
//!   one packet (`QpStats::packets_sent`, the port's `tx_frames`) per datagram sent;
//! - over the fabric: datagrams sent + frames the fault injector duplicated - frames it
//!   dropped (`FaultStats::dropped`: random loss; no rule or link-down is active) == frames
//!   delivered == arrivals at QPs + frames the receivers' ICRC check refused (the corrupted
//!   ones); arrivals == deliveries + receiver drops; each NIC's `rx_dropped` is the sum of
//!   its QPs' drops. Without duplication: sent == delivered + receiver drops + lost +
//!   corrupted.
//!
//! Duplication: a real UD NIC has no way to tell a duplicated datagram from a second one, so
//! it delivers both copies if receives are posted. With `duplicate_ppm` 0 the test asserts
//! every datagram arrives, and is delivered, at most once; with it on, at most twice, and
//! every delivery (a copy included) is an intact copy of a datagram that was sent, checked
//! by the same model.

use proptest::prelude::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use ringbell_model::Stage;
use ringbell_specs::cmd::QKEY_USE_QP;
use ringbell_specs::wire::Opcode;
use ringbell_tests::{lossy_links, poll_all, settle};
use std::collections::{HashMap, VecDeque};

/// The two Q_Keys QPs are given.
const QKEYS: [u32; 2] = [0x1111_2222, 0x0BAD_CAFE];
/// Each node's buffer: sends gathered from the first half, receives land in the second.
const BUF: usize = 2 << 20;
const RECV_AREA: u64 = 1 << 20;
/// Gap left between pieces and buffers (never written by anything).
const GAP: u64 = 64;
/// What untouched receive bytes hold.
const SENTINEL: u8 = 0xEE;
/// PSN range of each sender QP.
const PSN_BLOCK: u32 = 0x1000;

#[derive(Clone, Debug)]
struct NodeSpec {
    srq: bool,
    /// Per QP: its Q_Key index and the receives posted to it (to the SRQ, in QP order, when
    /// the node has one).
    qps: Vec<(usize, Vec<Vec<u32>>)>,
}

#[derive(Clone, Copy, Debug)]
enum Key {
    Right,
    Wrong,
    OwnQp,
}

#[derive(Clone, Debug)]
struct Dgram {
    /// Sending and receiving QP, as indices into all QPs (taken modulo their number).
    src: usize,
    dst: usize,
    len: u32,
    key: Key,
    imm: Option<u32>,
    inline: bool,
    /// Gather cut points (modulo len + 1); one to three pieces.
    cuts: Vec<u32>,
    solicited: bool,
}

/// Receive capacities at the edges of the datagram lengths below: GRH area + 0, 1, 64, 65,
/// 4095, 4096 bytes.
const EDGE_CAPS: [u32; 6] = [40, 41, 104, 105, 4135, 4136];
/// Datagram lengths at those edges.
const EDGE_LENS: [u32; 6] = [0, 1, 64, 65, 4095, 4096];

fn recv_spec() -> impl Strategy<Value = Vec<u32>> {
    let sge = prop_oneof![
        2 => 1u32..=64,
        3 => 65u32..=2100,
        2 => Just(4136u32),
        1 => 4137u32..=4400,
    ];
    prop_oneof![
        3 => proptest::collection::vec(sge, 1..=2),
        // An edge capacity, in one scatter entry or split in two (inside the GRH area or
        // inside the payload).
        2 => prop::sample::select(&EDGE_CAPS[..]).prop_map(|c| vec![c]),
        1 => (prop::sample::select(&EDGE_CAPS[..]), any::<u32>())
            .prop_map(|(c, a)| {
                let a = 1 + a % (c - 1);
                vec![a, c - a]
            }),
    ]
}

fn node_spec() -> impl Strategy<Value = NodeSpec> {
    (
        prop::bool::weighted(0.3),
        proptest::collection::vec(
            (0usize..2, proptest::collection::vec(recv_spec(), 0..=8)),
            1..=3,
        ),
    )
        .prop_map(|(srq, qps)| NodeSpec { srq, qps })
}

fn dgram() -> impl Strategy<Value = Dgram> {
    let len = prop_oneof![
        1 => Just(0u32),
        3 => 1u32..=64,
        4 => 65u32..4096,
        1 => Just(4096u32),
        2 => prop::sample::select(&EDGE_LENS[..]),
    ];
    let key = prop_oneof![6 => Just(Key::Right), 2 => Just(Key::Wrong), 2 => Just(Key::OwnQp)];
    (
        (0usize..64, 0usize..64, len, key),
        (
            proptest::option::of(any::<u32>()),
            any::<bool>(),
            proptest::collection::vec(any::<u32>(), 0..=2),
            any::<bool>(),
        ),
    )
        .prop_map(
            |((src, dst, len, key), (imm, inline, cuts, solicited))| Dgram {
                src,
                dst,
                len,
                key,
                imm,
                inline,
                cuts,
                solicited,
            },
        )
}

// Payload byte `i` of datagram `d`.
use ringbell_tests::message_byte as fill;

/// The IPv4 header in the GRH area of a receive: the datagram's, as received (ABI 18.3,
/// 18.4): identification the PSN's low 16 bits, TOS 0, TTL 64, UDP, the length of the frame's
/// IP part (headers, ImmDt, payload, pad, ICRC), a valid checksum, the two addresses.
fn check_ipv4(h: &[u8], d: &Dgram, psn: u32, src: [u8; 4], dst: [u8; 4]) {
    let be16 = |i: usize| u16::from_be_bytes([h[i], h[i + 1]]);
    let imm = if d.imm.is_some() { 4 } else { 0 };
    let pad = (4 - d.len % 4) % 4;
    let total = 20 + 8 + 12 + 8 + imm + d.len + pad + 4;
    assert_eq!((h[0], h[1]), (0x45, 0), "IPv4 version, IHL, TOS");
    assert_eq!(be16(2) as u32, total, "IPv4 total length");
    assert_eq!(be16(4) as u32, psn & 0xFFFF, "IPv4 identification");
    assert_eq!((h[8], h[9]), (64, 17), "IPv4 TTL, protocol");
    let sum: u32 = (0..10).map(|i| be16(2 * i) as u32).sum();
    assert_eq!((sum % 0xFFFF) as u16, 0, "IPv4 header checksum");
    assert_eq!(
        (&h[12..16], &h[16..20]),
        (&src[..], &dst[..]),
        "IPv4 addresses"
    );
}

struct Node {
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    srq: Option<SharedReceiveQueue>,
    mr: MemoryRegion,
    buf: DmaBuffer,
    pd: ProtectionDomain,
    dev: Device,
}

struct Qp {
    qp: QueuePair,
    node: usize,
    qkey: u32,
    /// First PSN it sends from.
    psn0: u32,
}

/// A posted receive: its scatter list as (offset in the node's buffer, length).
#[derive(Clone, Debug)]
struct Recv {
    wr_id: u64,
    sges: Vec<(u64, u32)>,
}

impl Recv {
    fn capacity(&self) -> u64 {
        self.sges.iter().map(|&(_, l)| l as u64).sum()
    }
}

/// A receive queue: `(node, None)` for a node's SRQ, `(node, Some(qp))` for a QP's own RQ.
type QueueKey = (usize, Option<usize>);

/// What one case saw, for the summary line.
#[derive(Debug, Default)]
struct Figures {
    nodes: usize,
    qps: usize,
    datagrams: usize,
    arrived: usize,
    delivered: usize,
    fault_dropped: u64,
    duplicated: u64,
    corrupted: u64,
    qkey_dropped: u64,
    no_recv_dropped: u64,
    too_long_dropped: u64,
}

fn run(
    seed: u64,
    specs: Vec<NodeSpec>,
    mut dgrams: Vec<Dgram>,
    links: LinkFaults,
    psn_base: u32,
) -> Figures {
    let duplicate_ppm = links.duplicate_ppm;
    let mut cfg = FabricConfig::new(specs.len(), seed);
    cfg.faults = FaultPlan {
        links,
        ..Default::default()
    };
    let fabric = Fabric::new(cfg);

    // Nodes and QPs.
    let mut nodes = Vec::new();
    let mut qps: Vec<Qp> = Vec::new();
    for (n, spec) in specs.iter().enumerate() {
        let dev = Device::open(Box::new(fabric.port(n))).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let buf = dev.alloc_dma(BUF).unwrap();
        let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE).unwrap();
        buf.write(
            RECV_AREA as usize,
            &vec![SENTINEL; BUF - RECV_AREA as usize],
        )
        .unwrap();
        let send_cq = dev.create_cq(1024).unwrap();
        let recv_cq = dev.create_cq(1024).unwrap();
        let srq = spec.srq.then(|| pd.create_srq(64, 2, 0).unwrap());
        for &(k, _) in &spec.qps {
            let mut init = QpInit::new(&send_cq, &recv_cq);
            init.qp_type = QpType::Ud;
            init.srq = srq.as_ref();
            init.max_send_wr = 64;
            init.max_recv_wr = 8;
            init.max_send_sge = 3;
            init.max_recv_sge = 2;
            init.max_inline = 204;
            let mut qp = pd.create_qp(&init).unwrap();
            let psn0 = (psn_base + qps.len() as u32 * PSN_BLOCK) & 0x00FF_FFFF;
            qp.ud_ready(QKEYS[k], psn0).unwrap();
            qps.push(Qp {
                qp,
                node: n,
                qkey: QKEYS[k],
                psn0,
            });
        }
        nodes.push(Node {
            send_cq,
            recv_cq,
            srq,
            mr,
            buf,
            pd,
            dev,
        });
    }
    let nq = qps.len();
    for d in &mut dgrams {
        d.src %= nq;
        d.dst %= nq;
    }

    // Receives: a queue per SRQ node, else per QP.
    let mut queues: HashMap<QueueKey, VecDeque<Recv>> = HashMap::new();
    let mut all_recvs: Vec<(usize, Recv)> = Vec::new();
    let mut next_off = vec![RECV_AREA; nodes.len()];
    let mut g = 0;
    for (n, spec) in specs.iter().enumerate() {
        for (_, recvs) in &spec.qps {
            let key = (n, (!spec.srq).then_some(g));
            for sizes in recvs {
                let wr_id = (n as u64) << 32 | all_recvs.len() as u64;
                let mut sges = Vec::new();
                for &l in sizes {
                    sges.push((next_off[n], l));
                    next_off[n] += (l as u64).next_multiple_of(GAP) + GAP;
                }
                let r = Recv { wr_id, sges };
                let sgl: Vec<Sge> = r.sges.iter().map(|&(o, l)| nodes[n].mr.sge(o, l)).collect();
                let wr = RecvWr { wr_id, sgl: &sgl };
                match &mut nodes[n].srq {
                    Some(srq) => srq.post_recv(&[wr]).unwrap(),
                    None => qps[g].qp.post_recv(&[wr]).unwrap(),
                }
                queues.entry(key).or_default().push_back(r.clone());
                all_recvs.push((n, r));
            }
            g += 1;
        }
    }
    assert!(next_off.iter().all(|&o| o <= BUF as u64));
    settle(&fabric);

    // Datagrams, traced from here on.
    fabric.start_timeline(4_000_000).unwrap();
    let mut payloads: Vec<Vec<u8>> = Vec::new();
    let mut send_off = vec![0u64; nodes.len()];
    let mut sent_by: Vec<Vec<usize>> = vec![Vec::new(); nq];
    let mut by_psn: HashMap<u32, usize> = HashMap::new();
    let mut psn_of = Vec::new();
    let mut qkey_of = Vec::new();
    for (i, d) in dgrams.iter().enumerate() {
        let (s, t) = (&qps[d.src], &qps[d.dst]);
        let n = s.node;
        let data: Vec<u8> = (0..d.len as usize).map(|b| fill(seed, i, b)).collect();
        let qkey = match d.key {
            Key::Right => t.qkey,
            Key::Wrong => t.qkey ^ 0x0000_0100,
            Key::OwnQp => QKEY_USE_QP,
        };
        qkey_of.push(if qkey == QKEY_USE_QP { s.qkey } else { qkey });
        let ah = nodes[n].pd.create_ah(&nodes[t.node].dev.ah_attr()).unwrap();
        let dest = UdDest {
            ah: &ah,
            qpn: t.qp.qpn(),
            qkey,
        };
        let op = match d.imm {
            Some(v) => WrOp::SendImm(v),
            None => WrOp::Send,
        };
        let mut flags = SendFlags::SIGNALED;
        if d.solicited {
            flags |= SendFlags::SOLICITED;
        }
        let wr_id = 1_000_000 + i as u64;
        let sgl: Vec<Sge>;
        let wr = if d.inline && d.len <= 204 {
            SendWr::inline(wr_id, op, &data)
        } else {
            let mut cuts: Vec<usize> = d
                .cuts
                .iter()
                .map(|&c| c as usize % (data.len() + 1))
                .collect();
            cuts.sort();
            let mut pieces = Vec::new();
            let mut from = 0;
            for c in cuts.into_iter().chain([data.len()]) {
                let at = send_off[n];
                nodes[n].buf.write(at as usize, &data[from..c]).unwrap();
                pieces.push(nodes[n].mr.sge(at, (c - from) as u32));
                send_off[n] += ((c - from) as u64).next_multiple_of(GAP) + GAP;
                from = c;
            }
            assert!(send_off[n] <= RECV_AREA);
            sgl = pieces;
            SendWr::new(wr_id, op, &sgl)
        };
        let psn = (s.psn0 + sent_by[d.src].len() as u32) & 0x00FF_FFFF;
        by_psn.insert(psn, i);
        psn_of.push(psn);
        sent_by[d.src].push(i);
        qps[d.src]
            .qp
            .post_send(&[wr.flags(flags).to(dest)])
            .unwrap();
        payloads.push(data);
    }
    settle(&fabric);
    let tl = fabric.take_timeline().unwrap();
    assert_eq!(tl.dropped(), 0, "timeline cap too small");

    // Send completions: one per datagram, in post order per QP, SUCCESS.
    for (n, node) in nodes.iter_mut().enumerate() {
        let got = poll_all(&mut node.send_cq);
        for (q, qp) in qps.iter().enumerate().filter(|(_, q)| q.node == n) {
            let mine: Vec<_> = got
                .iter()
                .filter(|w| w.qpn == qp.qp.qpn())
                .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len))
                .collect();
            let want: Vec<_> = sent_by[q]
                .iter()
                .map(|&i| {
                    (
                        1_000_000 + i as u64,
                        WcStatus::Success,
                        WcOpcode::Send,
                        dgrams[i].len,
                    )
                })
                .collect();
            assert_eq!(mine, want, "send completions of QP {q}");
        }
        assert_eq!(
            got.len(),
            qps.iter()
                .enumerate()
                .filter(|(_, q)| q.node == n)
                .map(|(q, _)| sent_by[q].len())
                .sum::<usize>(),
            "node {n}: no stray send completion"
        );
    }

    // Arrivals, in the order each NIC took them off the wire.
    let qp_at: HashMap<(usize, u32), usize> = qps
        .iter()
        .enumerate()
        .map(|(g, q)| ((q.node, q.qp.qpn()), g))
        .collect();
    let mut arrivals = Vec::new(); // (receiving QP, datagram)
    let mut copies = vec![0u32; dgrams.len()];
    for e in tl.events().iter().filter(|e| e.ev.stage == Stage::Rx) {
        let q = *qp_at
            .get(&(e.node, e.ev.qpn))
            .unwrap_or_else(|| panic!("a frame for no QP: {e:?}"));
        let i = *by_psn
            .get(&e.ev.psn)
            .unwrap_or_else(|| panic!("a frame no one sent: {e:?}"));
        assert_eq!(dgrams[i].dst, q, "datagram {i} went to the wrong QP");
        let op = match dgrams[i].imm {
            Some(_) => Opcode::UdSendOnlyImm,
            None => Opcode::UdSendOnly,
        };
        assert_eq!(e.ev.op, op as u8, "{e:?}");
        copies[i] += 1;
        arrivals.push((q, i));
    }
    let most = if duplicate_ppm == 0 { 1 } else { 2 };
    assert!(
        copies.iter().all(|&c| c <= most),
        "a datagram arrived more than {most} times: {copies:?}"
    );

    // The reference model.
    #[derive(Default, Clone, Debug, PartialEq)]
    struct Expect {
        received: u64,
        qkey_dropped: u64,
        no_recv_dropped: u64,
        too_long_dropped: u64,
    }
    let mut expect = vec![Expect::default(); nq];
    // Per queue, the (recv, receiving QP, datagram) taken, in order.
    let mut taken: HashMap<QueueKey, Vec<(Recv, usize, usize)>> = HashMap::new();
    for &(q, i) in &arrivals {
        let n = qps[q].node;
        let key = (n, (!specs[n].srq).then_some(q));
        if qkey_of[i] != qps[q].qkey {
            expect[q].qkey_dropped += 1;
            continue;
        }
        let queue = queues.entry(key).or_default();
        match queue.front() {
            None => expect[q].no_recv_dropped += 1,
            Some(r) if r.capacity() < GRH_LEN as u64 + dgrams[i].len as u64 => {
                expect[q].too_long_dropped += 1
            }
            Some(_) => {
                let r = queue.pop_front().unwrap();
                expect[q].received += 1;
                taken.entry(key).or_default().push((r, q, i));
            }
        }
    }

    // Receive completions: exactly the model's, per queue in order, with intact data.
    let attrs: Vec<AhAttr> = nodes.iter().map(|n| n.dev.ah_attr()).collect();
    let mut delivered = vec![0u32; dgrams.len()];
    let mut consumed = std::collections::HashSet::new();
    for (n, node) in nodes.iter_mut().enumerate() {
        let got = poll_all(&mut node.recv_cq);
        let mut keys: Vec<_> = taken.keys().filter(|k| k.0 == n).copied().collect();
        keys.sort();
        let mut seen = 0;
        for key in keys {
            let want = &taken[&key];
            let mine: Vec<&WorkCompletion> = got
                .iter()
                .filter(|w| match key.1 {
                    Some(q) => w.qpn == qps[q].qp.qpn(),
                    None => true,
                })
                .collect();
            seen += mine.len();
            assert_eq!(
                mine.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
                want.iter().map(|t| t.0.wr_id).collect::<Vec<_>>(),
                "receives taken from queue {key:?}"
            );
            for (w, (r, q, i)) in mine.iter().zip(want) {
                let (d, s) = (&dgrams[*i], &qps[dgrams[*i].src]);
                let len = d.len as usize;
                assert_eq!(
                    (w.status, w.opcode, w.qpn, w.byte_len as usize),
                    (
                        WcStatus::Success,
                        WcOpcode::Recv,
                        qps[*q].qp.qpn(),
                        GRH_LEN + len
                    ),
                    "datagram {i}: {w:?}"
                );
                assert_eq!(w.imm, d.imm, "datagram {i}: immediate");
                assert_eq!(w.solicited, d.solicited, "datagram {i}: solicited");
                let src = w.source.expect("a UD receive names its source");
                assert_eq!(
                    src,
                    UdSource {
                        qpn: s.qp.qpn(),
                        mac: attrs[s.node].mac,
                        ip: attrs[s.node].ip,
                    },
                    "datagram {i}: source"
                );
                delivered[*i] += 1;
                consumed.insert(r.wr_id);
                // The buffer, read back through its scatter list.
                let mut bytes = Vec::new();
                for &(o, l) in &r.sges {
                    let mut b = vec![0u8; l as usize];
                    node.buf.read(o as usize, &mut b).unwrap();
                    bytes.extend_from_slice(&b);
                }
                assert!(bytes[..20].iter().all(|&b| b == 0), "GRH area: 20 zeros");
                check_ipv4(&bytes[20..40], d, psn_of[*i], attrs[s.node].ip, attrs[n].ip);
                assert!(
                    bytes[GRH_LEN..GRH_LEN + len] == payloads[*i][..],
                    "datagram {i}: payload"
                );
                assert!(
                    bytes[GRH_LEN + len..].iter().all(|&b| b == SENTINEL),
                    "datagram {i}: bytes past the payload were written"
                );
            }
        }
        assert_eq!(
            seen,
            got.len(),
            "node {n}: a receive completion nobody expected"
        );
    }
    for (n, r) in &all_recvs {
        if consumed.contains(&r.wr_id) {
            continue;
        }
        for &(o, l) in &r.sges {
            let mut b = vec![0u8; l as usize];
            nodes[*n].buf.read(o as usize, &mut b).unwrap();
            assert!(
                b.iter().all(|&x| x == SENTINEL),
                "a receive never taken was written"
            );
        }
    }
    if duplicate_ppm == 0 {
        assert!(
            delivered.iter().all(|&c| c <= 1),
            "a datagram was delivered twice without duplication"
        );
    }

    // The counters.
    let mut f = Figures {
        nodes: nodes.len(),
        qps: nq,
        datagrams: dgrams.len(),
        arrived: arrivals.len(),
        delivered: delivered.iter().map(|&c| c as usize).sum(),
        ..Default::default()
    };
    let mut node_drops = vec![0u64; nodes.len()];
    let mut icrc_errors = 0;
    for (q, qp) in qps.iter().enumerate() {
        let st = qp.qp.ud_stats().unwrap();
        let got = Expect {
            received: st.received,
            qkey_dropped: st.qkey_dropped,
            no_recv_dropped: st.no_recv_dropped,
            too_long_dropped: st.too_long_dropped,
        };
        assert_eq!(got, expect[q], "UD stats of QP {q}");
        assert_eq!(st.sent, sent_by[q].len() as u64, "QP {q}: sent");
        assert_eq!(
            qp.qp.stats().unwrap().packets_sent,
            st.sent,
            "QP {q}: a packet per datagram"
        );
        assert_eq!(st.wrong_transport_dropped, 0);
        let arrived = arrivals.iter().filter(|a| a.0 == q).count() as u64;
        assert_eq!(
            st.received + st.qkey_dropped + st.no_recv_dropped + st.too_long_dropped,
            arrived,
            "QP {q}: every arrival is received or dropped for a reason"
        );
        node_drops[qp.node] += st.qkey_dropped + st.no_recv_dropped + st.too_long_dropped;
        f.qkey_dropped += st.qkey_dropped;
        f.no_recv_dropped += st.no_recv_dropped;
        f.too_long_dropped += st.too_long_dropped;
    }
    for (n, &drops) in node_drops.iter().enumerate() {
        let ns = fabric.nic_stats(n);
        assert_eq!(ns.rx_dropped, drops, "node {n}: rx_dropped");
        let sent: usize = (0..nq)
            .filter(|&q| qps[q].node == n)
            .map(|q| sent_by[q].len())
            .sum();
        assert_eq!(ns.tx_frames, sent as u64, "node {n}: a frame per datagram");
        assert_eq!(ns.rx_malformed, 0, "node {n}");
        icrc_errors += ns.rx_icrc_errors;
    }
    // FaultStats: `dropped` counts random losses (no rule or link-down is active here),
    // `duplicated` frames delivered twice, `corrupted` frames delivered with a flipped bit,
    // which the receiver's ICRC check drops before anything else looks at them (so they
    // are no arrival at a QP); a corrupted frame that is also duplicated fails twice.
    let fs = fabric.fault_stats();
    assert_eq!((fs.link_down, fs.rule_hits), (0, 0));
    assert!(fs.corrupted <= icrc_errors && icrc_errors <= 2 * fs.corrupted);
    let delivered_frames = fabric.stats().frames_delivered;
    let sent = dgrams.len() as u64;
    assert_eq!(
        sent + fs.duplicated - fs.dropped,
        delivered_frames,
        "sent + duplicated - dropped by the fault injector == delivered frames ({fs:?})"
    );
    assert_eq!(delivered_frames, arrivals.len() as u64 + icrc_errors);
    assert_eq!(
        arrivals.len() as u64,
        f.delivered as u64 + f.qkey_dropped + f.no_recv_dropped + f.too_long_dropped,
        "every arrival is a receive or a counted drop"
    );
    if duplicate_ppm == 0 {
        assert_eq!(fs.duplicated, 0);
        assert_eq!(icrc_errors, fs.corrupted);
        assert_eq!(
            sent,
            f.delivered as u64
                + f.qkey_dropped
                + f.no_recv_dropped
                + f.too_long_dropped
                + fs.dropped
                + fs.corrupted,
            "sent == delivered + receiver drops + frames lost or corrupted on the wire"
        );
    }
    f.fault_dropped = fs.dropped;
    f.duplicated = fs.duplicated;
    f.corrupted = fs.corrupted;
    drop(qps);
    f
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn lossy_datagram_traffic_matches_the_reference_model(
        seed in any::<u64>(),
        nodes in proptest::collection::vec(node_spec(), 2..=5),
        dgrams in proptest::collection::vec(dgram(), 1..=64),
        drop_ppm in prop_oneof![1 => Just(0u32), 3 => 0u32..=300_000],
        duplicate_ppm in prop_oneof![1 => Just(0u32), 1 => 1u32..=200_000],
        reorder_ppm in prop_oneof![2 => Just(0u32), 1 => 1u32..=200_000],
        corrupt_ppm in prop_oneof![3 => Just(0u32), 1 => 1u32..=100_000],
        psn_base in 0u32..=0x00FF_FFFF,
    ) {
        let links = lossy_links(drop_ppm, duplicate_ppm, reorder_ppm, corrupt_ppm);
        let f = run(seed, nodes, dgrams, links, psn_base);
        eprintln!(
            "ud_prop: {} nodes, {} QPs, {} datagrams (drop {drop_ppm} ppm, duplicate \
             {duplicate_ppm} ppm, corrupt {corrupt_ppm} ppm): {} lost on the wire, {} \
             duplicated, {} corrupted, {} arrived, {} delivered, dropped by receivers: {} \
             Q_Key, {} no receive, {} too long",
            f.nodes, f.qps, f.datagrams, f.fault_dropped, f.duplicated, f.corrupted,
            f.arrived, f.delivered, f.qkey_dropped, f.no_recv_dropped, f.too_long_dropped,
        );
    }
}
