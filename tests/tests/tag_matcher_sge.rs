//! The tag matcher's interface for a caller with memory of its own (`TagMatcher::new_in`,
//! `recv_sge`, `send_sge`, as the libfabric provider uses it): receives and sends in the
//! caller's registered regions, 32-bit remote CQ data in CQ-data mode (the SEND immediate
//! for eager messages, the TMH context for rendezvous, where 0 reads as none),
//! receives filtered by source (software only), claims, and messages that reach a QP
//! before it joins the matcher. A property test checks matching, data and CQ data against
//! a plain MPI matching model with source filters.

use proptest::prelude::*;
use ringbell::tagmatch::{Peeked, TagConfig, TagEvent, TagMatcher, TagSend};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use std::collections::BTreeMap;

/// Bytes of one operation's region in a node's buffer.
const REGION: u64 = 1 << 15;
/// Operations per case at most (the regions of a node's buffer).
const MAX_OPS: usize = 64;

/// A node: its matcher, in a PD where the caller's buffer is registered too.
struct Node {
    m: TagMatcher,
    buf: DmaBuffer,
    mr: MemoryRegion,
    _pd: ProtectionDomain,
}

fn node(dev: &Device, cfg: TagConfig) -> Node {
    let pd = dev.alloc_pd().unwrap();
    let mut m = TagMatcher::new_in(&pd, cfg).unwrap();
    m.carry_cq_data();
    let buf = dev.alloc_dma(REGION as usize * MAX_OPS).unwrap();
    let mr = pd
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    Node {
        m,
        buf,
        mr,
        _pd: pd,
    }
}

/// A receiver (`b`) and `senders` senders; `b`'s connection `i` reaches sender `i`, which
/// reaches `b` on its connection 0.
struct Net {
    fabric: Fabric,
    b: Node,
    s: Vec<Node>,
    _devs: Vec<Device>,
}

fn net(senders: usize, cfg: TagConfig, seed: u64) -> Net {
    let fabric = Fabric::new(FabricConfig::new(senders + 1, seed));
    let devs: Vec<Device> = (0..=senders)
        .map(|n| Device::open(Box::new(fabric.port(n))).unwrap())
        .collect();
    let mut b = node(&devs[0], cfg);
    let opts = ConnectOptions {
        rnr_retry: 7,
        ..Default::default()
    };
    let mut s = Vec::new();
    for d in &devs[1..] {
        let mut n = node(d, cfg);
        let (cs, es) = n.m.add_conn().unwrap();
        let (cb, eb) = b.m.add_conn().unwrap();
        n.m.connect(cs, &eb, &opts).unwrap();
        b.m.connect(cb, &es, &opts).unwrap();
        s.push(n);
    }
    Net {
        fabric,
        b,
        s,
        _devs: devs,
    }
}

/// Runs the fabric and the senders' (and, if asked, the receiver's) progress until nothing
/// moves; returns the senders' and the receiver's events.
fn run(t: &mut Net, progress_b: bool) -> (Vec<TagEvent>, Vec<TagEvent>) {
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    loop {
        for _ in 0..10_000 {
            if !t.fabric.step() {
                break;
            }
        }
        let mut n = 0;
        for s in t.s.iter_mut() {
            n += s.m.progress().unwrap();
            ea.extend(std::iter::from_fn(|| s.m.next_event()));
        }
        if progress_b {
            n += t.b.m.progress().unwrap();
        }
        while let Some(e) = t.b.m.next_event() {
            if let TagEvent::Failed {
                id,
                status: WcStatus::TmRndvIncomplete,
            } = e
            {
                // As a caller does: the request is at the start of the receive's buffer.
                let mut hdr = [0u8; 32];
                t.b.buf.read((id * REGION) as usize, &mut hdr).unwrap();
                assert!(t.b.m.resume_rndv(id, &hdr));
                n += 1;
                continue;
            }
            eb.push(e);
        }
        if n == 0 && !t.fabric.step() {
            return (ea, eb);
        }
    }
}

fn pattern(id: u64, len: u32) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(29) ^ id.wrapping_mul(0x9E37_79B9) >> 5) as u8)
        .collect()
}

/// The CQ data a receive reports for a send of `len` bytes with `d`: a rendezvous's
/// travels in the TMH context, where 0 means none.
fn sent_data(len: u32, d: Option<u32>) -> Option<u32> {
    if len > 240 && d == Some(0) {
        None
    } else {
        d
    }
}

fn cfg() -> TagConfig {
    TagConfig {
        eager_max: 240,
        hw_min: 0,
        hw_tags: 4,
        user_bytes: 64,
        ..TagConfig::default()
    }
}

/// Sends `len` bytes of sender `from`'s region `i` with `tag` and `data`: eager by copy,
/// eager from the region, or rendezvous from the region, as `i` and `len` say.
fn send(t: &mut Net, from: usize, i: u64, tag: u64, len: u32, data: Option<u32>) {
    let s = &mut t.s[from];
    let off = i * REGION;
    let bytes = pattern(i, len);
    s.buf.write(off as usize, &bytes).unwrap();
    if len > 240 {
        let remote = RemoteAddr {
            addr: s.mr.addr() + off,
            rkey: s.mr.rkey(),
        };
        s.m.send_sge(i, 0, tag, data, TagSend::Rndv { remote, len })
            .unwrap();
    } else if i.is_multiple_of(2) {
        s.m.send_sge(i, 0, tag, data, TagSend::Bytes(&bytes))
            .unwrap();
    } else {
        let sge = [s.mr.sge(off, len)];
        let sgl = if len == 0 { &sge[..0] } else { &sge[..] };
        s.m.send_sge(i, 0, tag, data, TagSend::Sges(sgl)).unwrap();
    }
}

/// What receive `id` of the receiver holds: the bytes the matcher hands over (an eager
/// message matched in software) or those in its region.
fn placed(t: &mut Net, id: u64, len: u32) -> (Vec<u8>, Option<u32>, u32, bool) {
    let r =
        t.b.m
            .received(id)
            .expect("details of a receive of recv_sge");
    let bytes = match r.payload {
        Some(p) => p,
        None => {
            let mut v = vec![0u8; len as usize];
            t.b.buf.read((id * REGION) as usize, &mut v).unwrap();
            v
        }
    };
    (bytes, r.data, r.msg_len, r.hw)
}

#[test]
fn cq_data_travels_eager_and_rendezvous_matched_by_the_nic_and_by_software() {
    let mut t = net(1, cfg(), 3);
    let datas = [None, Some(0), Some(7), Some(u32::MAX - 1), Some(u32::MAX)];
    let mut id = 0u64;
    let mut hw = 0;
    for &len in &[0u32, 5, 240, 241, 20_000] {
        for &d in &datas {
            for expected in [true, false] {
                id += 1;
                let rl = 20_000u32;
                let rsge = t.b.mr.sge(id * REGION, rl);
                let (mut sent, mut got) = (Vec::new(), Vec::new());
                let mut turn = |t: &mut Net, b: bool| {
                    let (s, g) = run(t, b);
                    sent.extend(s);
                    got.extend(g);
                };
                if expected {
                    t.b.m.recv_sge(id, id, u64::MAX, None, rsge).unwrap();
                    turn(&mut t, true);
                }
                send(&mut t, 0, id, id, len, d);
                turn(&mut t, false);
                if !expected {
                    turn(&mut t, true);
                    t.b.m.recv_sge(id, id, u64::MAX, None, rsge).unwrap();
                }
                turn(&mut t, true);
                assert!(sent.contains(&TagEvent::Send { id }), "{sent:?}");
                assert_eq!(
                    got,
                    vec![TagEvent::Recv {
                        id,
                        tag: id,
                        len,
                        truncated: false,
                        conn: 0
                    }]
                );
                let (bytes, data, msg_len, by_nic) = placed(&mut t, id, len);
                assert_eq!(bytes, pattern(id, len), "{len} bytes, data {d:?}");
                assert_eq!(data, sent_data(len, d), "{len} bytes, expected {expected}");
                assert_eq!(msg_len, len);
                // The NIC matches what was posted first.
                assert_eq!(by_nic, expected, "{len} bytes, data {d:?}");
                hw += u64::from(by_nic);
            }
        }
    }
    assert_eq!(t.b.m.stats().hw_matched, hw);
    assert_eq!(hw, 25, "every receive posted first");
}

#[test]
fn a_rendezvous_the_nic_matched_into_a_small_buffer_is_resumed_by_the_caller() {
    let mut t = net(1, cfg(), 4);
    let sge = t.b.mr.sge(REGION, 1000);
    t.b.m.recv_sge(1, 9, u64::MAX, None, sge).unwrap();
    run(&mut t, true);
    send(&mut t, 0, 2, 9, 5000, Some(77));
    run(&mut t, false);
    // The receiver's own progress, without the resuming `run` does.
    let mut got = Vec::new();
    for _ in 0..100 {
        while t.fabric.step() {}
        t.b.m.progress().unwrap();
        got.extend(std::iter::from_fn(|| t.b.m.next_event()));
    }
    assert_eq!(
        got,
        vec![TagEvent::Failed {
            id: 1,
            status: WcStatus::TmRndvIncomplete
        }]
    );
    // The caller reads the request back from its buffer.
    let mut hdr = [0u8; 32];
    t.b.buf.read(REGION as usize, &mut hdr).unwrap();
    assert!(t.b.m.resume_rndv(1, &hdr));
    assert!(!t.b.m.resume_rndv(1, &hdr), "once");
    let (sent, got) = run(&mut t, true);
    assert_eq!(
        got,
        vec![TagEvent::Recv {
            id: 1,
            tag: 9,
            len: 1000,
            truncated: true,
            conn: 0
        }]
    );
    assert_eq!(sent, vec![TagEvent::Send { id: 2 }]);
    let r = t.b.m.received(1).unwrap();
    assert_eq!((r.data, r.msg_len, r.hw), (Some(77), 5000, false));
    let mut v = vec![0u8; 1000];
    t.b.buf.read(REGION as usize, &mut v).unwrap();
    assert_eq!(v, pattern(2, 5000)[..1000]);
}

#[test]
fn claims_discards_and_unclaims_of_unexpected_messages() {
    let mut t = net(2, cfg(), 5);
    send(&mut t, 0, 1, 5, 100, Some(1));
    send(&mut t, 1, 2, 5, 3000, None);
    send(&mut t, 0, 3, 6, 3000, Some(3));
    run(&mut t, true);
    let b = &mut t.b.m;
    assert_eq!(b.unexpected_len(), 3);
    // From sender 1 only: its rendezvous.
    assert_eq!(
        b.probe_from(5, u64::MAX, Some(1)),
        Some(Peeked {
            tag: 5,
            len: 3000,
            conn: 1,
            data: None
        })
    );
    let first = Peeked {
        tag: 5,
        len: 100,
        conn: 0,
        data: Some(1),
    };
    assert_eq!(b.claim(10, 5, u64::MAX, None), Some(first));
    assert_eq!(
        b.claim(10, 5, u64::MAX, None),
        None,
        "a key holds one claim"
    );
    assert!(b.unclaim(10));
    assert_eq!(b.claim(11, 0, 0, None), Some(first), "given back first");
    // A claimed message goes to the receive of its key only.
    let sge = t.b.mr.sge(4 * REGION, 200);
    t.b.m.recv_sge(4, 5, u64::MAX, None, sge).unwrap();
    let (_, got) = run(&mut t, true);
    assert_eq!(
        got,
        vec![TagEvent::Recv {
            id: 4,
            tag: 5,
            len: 200,
            truncated: true,
            conn: 1
        }],
        "sender 1's rendezvous, cut to the receive"
    );
    let sge = t.b.mr.sge(5 * REGION, 200);
    assert!(t.b.m.recv_claimed(11, 5, sge).unwrap());
    let (_, got) = run(&mut t, true);
    assert_eq!(
        got,
        vec![TagEvent::Recv {
            id: 5,
            tag: 5,
            len: 100,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(t.b.m.received(5).unwrap().payload, Some(pattern(1, 100)));
    // A discarded rendezvous completes its send (the FIN), and nothing is received.
    let d = t.b.m.discard(6, u64::MAX, None).unwrap();
    assert_eq!((d.len, d.data), (3000, Some(3)));
    let (sent, got) = run(&mut t, true);
    assert!(sent.contains(&TagEvent::Send { id: 3 }), "{sent:?}");
    assert!(got.is_empty());
    assert_eq!(t.b.m.unexpected_len(), 0);
}

#[test]
fn messages_that_reach_a_qp_before_it_joins_wait_for_it_and_its_peer() {
    let fabric = Fabric::new(FabricConfig::new(2, 6));
    let devs = [
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    ];
    let (mut a, mut b) = (node(&devs[0], cfg()), node(&devs[1], cfg()));
    let opts = ConnectOptions::default();
    let (ca, ea) = a.m.add_conn().unwrap();
    // b's side is connected, but not yet a connection of b's matcher.
    let mut qp = b.m.create_conn_qp().unwrap();
    qp.connect(&ea, 1, &opts).unwrap();
    a.m.connect(ca, &qp.endpoint(1), &opts).unwrap();
    // A receive posted meanwhile goes to the NIC's list (disabled once software lags).
    b.m.recv_sge(1, 3, u64::MAX, None, b.mr.sge(REGION, 4096))
        .unwrap();
    a.m.send_sge(7, ca, 3, Some(5), TagSend::Bytes(b"early"))
        .unwrap();
    a.m.send_sge(8, ca, 3, Some(6), TagSend::Bytes(b"later"))
        .unwrap();
    let mut events = Vec::new();
    for _ in 0..200 {
        while fabric.step() {}
        a.m.progress().unwrap();
        b.m.progress().unwrap();
        events.extend(std::iter::from_fn(|| b.m.next_event()));
    }
    // A receive from that peer only, posted before the connection names its peer: the
    // message that waited is matched once it does.
    b.m.recv_sge(2, 3, u64::MAX, Some(42), b.mr.sge(2 * REGION, 4096))
        .unwrap();
    let conn = b.m.add_connected_from(qp, 42).unwrap();
    for _ in 0..200 {
        while fabric.step() {}
        b.m.progress().unwrap();
        events.extend(std::iter::from_fn(|| b.m.next_event()));
    }
    let recv = |id: u64, len: u32| TagEvent::Recv {
        id,
        tag: 3,
        len,
        truncated: false,
        conn,
    };
    assert_eq!(
        events,
        vec![recv(1, 5), recv(2, 5)],
        "in send order, none lost"
    );
    let mut first = b.m.received(1).unwrap();
    if first.payload.is_none() {
        let mut v = vec![0u8; 5];
        b.buf.read(REGION as usize, &mut v).unwrap();
        first.payload = Some(v);
    }
    assert_eq!(
        (first.payload.as_deref(), first.data),
        (Some(&b"early"[..]), Some(5))
    );
    assert_eq!(b.m.received(2).unwrap().data, Some(6));
}

#[derive(Clone, Debug)]
enum Op {
    Send {
        from: usize,
        tag: u64,
        len: u32,
        data: Option<u32>,
    },
    Recv {
        tag: u64,
        wild: bool,
        src: Option<usize>,
        len: u32,
    },
    Progress,
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0u32..64, 200u32..300, 3000u32..9000];
    let data = prop_oneof![
        Just(None),
        any::<u32>().prop_map(Some),
        Just(Some(0)),
        Just(Some(u32::MAX))
    ];
    prop_oneof![
        4 => (0usize..2, 0u64..4, len.clone(), data)
            .prop_map(|(from, tag, len, data)| Op::Send { from, tag, len, data }),
        4 => (0u64..4, any::<bool>(), prop_oneof![3 => Just(None), 1 => (0usize..2).prop_map(Some)], len)
            .prop_map(|(tag, wild, src, len)| Op::Recv { tag, wild, src, len }),
        1 => Just(Op::Progress),
    ]
}

/// MPI matching with source filters when every message arrives in send order: a message
/// goes to the earliest posted receive that takes it (tag under the mask, and the source
/// if the receive names one), a receive to the earliest unexpected message it takes.
/// Returns receive id -> send id.
fn oracle(ops: &[Op]) -> BTreeMap<u64, u64> {
    let mut posted: Vec<(u64, u64, u64, Option<usize>)> = Vec::new();
    let mut unexpected: Vec<(u64, u64, usize)> = Vec::new();
    let mut out = BTreeMap::new();
    let takes = |t: u64, m: u64, s: Option<usize>, tag: u64, from: usize| {
        tag & m == t & m && s.is_none_or(|s| s == from)
    };
    for (i, o) in ops.iter().enumerate() {
        let i = i as u64;
        match *o {
            Op::Send { tag, from, .. } => {
                match posted
                    .iter()
                    .position(|&(_, t, m, s)| takes(t, m, s, tag, from))
                {
                    Some(p) => {
                        out.insert(posted.remove(p).0, i);
                    }
                    None => unexpected.push((i, tag, from)),
                }
            }
            Op::Recv { tag, wild, src, .. } => {
                let m = if wild { 0xfff0 } else { u64::MAX };
                match unexpected
                    .iter()
                    .position(|&(_, t, f)| takes(tag, m, src, t, f))
                {
                    Some(p) => {
                        out.insert(i, unexpected.remove(p).0);
                    }
                    None => posted.push((i, tag, m, src)),
                }
            }
            Op::Progress => {}
        }
    }
    out
}

fn check(ops: &[Op], cfg: TagConfig, seed: u64) {
    let mut t = net(2, cfg, seed);
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    for (i, o) in ops.iter().enumerate() {
        let i = i as u64;
        match *o {
            Op::Send {
                from,
                tag,
                len,
                data,
            } => {
                send(&mut t, from, i, tag, len, data);
                // Delivered to the receiver's NIC, but the receiver's software does not look.
                let (ea, eb) = run(&mut t, false);
                sent.extend(ea);
                got.extend(eb);
            }
            Op::Recv {
                tag,
                wild,
                src,
                len,
            } => {
                let m = if wild { 0xfff0 } else { u64::MAX };
                let sge = t.b.mr.sge(i * REGION, len);
                t.b.m
                    .recv_sge(i, tag, m, src.map(|s| s as u64), sge)
                    .unwrap();
            }
            Op::Progress => {
                let (ea, eb) = run(&mut t, true);
                sent.extend(ea);
                got.extend(eb);
            }
        }
    }
    let (ea, eb) = run(&mut t, true);
    sent.extend(ea);
    got.extend(eb);

    let want = oracle(ops);
    let mut seen = BTreeMap::new();
    for e in &got {
        let TagEvent::Recv {
            id,
            tag,
            len,
            truncated,
            conn,
        } = *e
        else {
            panic!("receiver event {e:?}");
        };
        let Some(&s) = want.get(&id) else {
            panic!("receive {id} completed but the model leaves it unmatched; events {got:?}")
        };
        let (
            Op::Send {
                from,
                tag: st,
                len: sl,
                data,
            },
            Op::Recv { len: rl, .. },
        ) = (&ops[s as usize], &ops[id as usize])
        else {
            unreachable!()
        };
        assert_eq!(conn, *from, "receive {id}: connection");
        assert_eq!(tag, *st, "receive {id}: tag");
        assert_eq!(len, (*sl).min(*rl), "receive {id}: length (from send {s})");
        assert_eq!(truncated, sl > rl, "receive {id}: truncation");
        let (bytes, d, msg_len, _) = placed(&mut t, id, len);
        assert_eq!(
            d,
            sent_data(*sl, *data),
            "receive {id}: CQ data of send {s}"
        );
        assert_eq!(msg_len, *sl, "receive {id}: message length");
        assert_eq!(
            bytes,
            pattern(s, *sl)[..len as usize],
            "receive {id}: data of send {s}"
        );
        assert!(seen.insert(id, s).is_none(), "receive {id} completed twice");
    }
    assert_eq!(seen, want, "matching differs from MPI order");
    for (i, o) in ops.iter().enumerate() {
        let Op::Send { len, .. } = *o else { continue };
        let id = i as u64;
        let done = sent.contains(&TagEvent::Send { id });
        let should = len <= 240 || want.values().any(|&x| x == id);
        assert_eq!(done, should, "send {id} ({len} bytes) completion; {sent:?}");
    }
    assert!(
        sent.iter().all(|e| matches!(e, TagEvent::Send { .. })),
        "{sent:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn caller_memory_cq_data_and_sources_follow_mpi_order(
        ops in proptest::collection::vec(op(), 1..MAX_OPS),
        seed in any::<u64>(),
    ) {
        check(&ops, cfg(), seed);
    }

    #[test]
    fn the_same_in_software_only(ops in proptest::collection::vec(op(), 1..30)) {
        check(&ops, TagConfig { hw_tags: 0, ..cfg() }, 1);
    }
}
