//! The software tag-matching layer (`ringbell::tagmatch`) end to end on two emulated nodes,
//! and a property test of its matching order against a plain MPI matching model while the
//! receiver's software lags behind the hardware.

use proptest::prelude::*;
use ringbell::tagmatch::{TagConfig, TagEvent, TagMatcher};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use std::collections::{BTreeMap, VecDeque};

/// Bytes of one operation's region in the user buffer.
const REGION: u64 = 1 << 16;

/// Senders `a` (and `c`, when there are three nodes) connected to receiver `b`; `b`'s
/// connection `i` goes to sender `i`.
struct Two {
    fabric: Fabric,
    a: TagMatcher,
    b: TagMatcher,
    c: Option<TagMatcher>,
    _devs: Vec<Device>,
}

fn net(nodes: usize, cfg: TagConfig, faults: FaultPlan, seed: u64) -> Two {
    let mut fc = FabricConfig::new(nodes, seed);
    fc.faults = faults;
    let fabric = Fabric::new(fc);
    let devs: Vec<Device> = (0..nodes)
        .map(|n| Device::open(Box::new(fabric.port(n))).unwrap())
        .collect();
    let mut b = TagMatcher::new(&devs[0], cfg).unwrap();
    let opts = ConnectOptions {
        path_mtu: 3,
        rnr_retry: 7,
        ..Default::default()
    };
    let mut senders = Vec::new();
    for d in &devs[1..] {
        let mut s = TagMatcher::new(d, cfg).unwrap();
        let (cs, es) = s.add_conn().unwrap();
        let (cb, eb) = b.add_conn().unwrap();
        s.connect(cs, &eb, &opts).unwrap();
        b.connect(cb, &es, &opts).unwrap();
        senders.push(s);
    }
    let c = (nodes > 2).then(|| senders.pop().unwrap());
    Two {
        fabric,
        a: senders.pop().unwrap(),
        b,
        c,
        _devs: devs,
    }
}

fn two(cfg: TagConfig, faults: FaultPlan, seed: u64) -> Two {
    net(2, cfg, faults, seed)
}

/// Runs the fabric and the senders' (and, if asked, the receiver's) progress until nothing
/// moves; returns the senders' and the receiver's events.
fn run(t: &mut Two, progress_b: bool) -> (Vec<TagEvent>, Vec<TagEvent>) {
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    loop {
        // Bounded: a sender retrying after RNR NAKs keeps the fabric busy until the
        // receiver's software hands buffers back.
        for _ in 0..10_000 {
            if !t.fabric.step() {
                break;
            }
        }
        let mut n = t.a.progress().unwrap();
        ea.extend(std::iter::from_fn(|| t.a.next_event()));
        if let Some(c) = t.c.as_mut() {
            n += c.progress().unwrap();
            // Operation ids are unique across senders, so their events can share a list.
            ea.extend(std::iter::from_fn(|| c.next_event()));
        }
        if progress_b {
            n += t.b.progress().unwrap();
        }
        eb.extend(std::iter::from_fn(|| t.b.next_event()));
        if n == 0 && !t.fabric.step() {
            return (ea, eb);
        }
    }
}

fn pattern(id: u64, len: u32) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(31) ^ id.wrapping_mul(0x9E37_79B9) >> 3) as u8)
        .collect()
}

fn put(m: &TagMatcher, off: u64, data: &[u8]) {
    m.user().write(off as usize, data).unwrap();
}

fn get(m: &TagMatcher, off: u64, len: u32) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    m.user().read(off as usize, &mut v).unwrap();
    v
}

#[test]
fn eager_and_rendezvous_expected_and_unexpected() {
    let mut t = two(TagConfig::default(), FaultPlan::default(), 3);
    // Expected eager into the hardware list (the buffer holds any eager message).
    t.b.recv(1, 0x55, u64::MAX, 0, 8192).unwrap();
    assert_eq!(t.b.hw_posted(), 1);
    put(&t.a, 0, &pattern(10, 2000));
    t.a.send(10, 0, 0x55, 0, 2000).unwrap();
    let (ea, eb) = run(&mut t, true);
    assert_eq!(ea, vec![TagEvent::Send { id: 10 }]);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 1,
            tag: 0x55,
            len: 2000,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(get(&t.b, 0, 2000), pattern(10, 2000));
    assert_eq!(t.b.hw_posted(), 0);

    // Expected rendezvous (40 KiB): the NIC reads, then FINs; the send completes on the FIN.
    t.b.recv(2, 0x77, u64::MAX, REGION, 50_000).unwrap();
    put(&t.a, REGION, &pattern(11, 40_000));
    t.a.send(11, 0, 0x77, REGION, 40_000).unwrap();
    let (ea, eb) = run(&mut t, true);
    assert_eq!(ea, vec![TagEvent::Send { id: 11 }]);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 2,
            tag: 0x77,
            len: 40_000,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(get(&t.b, REGION, 40_000), pattern(11, 40_000));

    // Unexpected rendezvous: nothing posted, so it waits; the receive finishes it in
    // software (READ then FIN) and the send completes only then.
    put(&t.a, 2 * REGION, &pattern(12, 30_000));
    t.a.send(12, 0, 0x99, 2 * REGION, 30_000).unwrap();
    let (ea, eb) = run(&mut t, true);
    assert!(ea.is_empty() && eb.is_empty(), "{ea:?} {eb:?}");
    assert_eq!(t.b.unexpected_len(), 1);
    t.b.recv(3, 0x90, 0xf0, 2 * REGION, 30_000).unwrap();
    assert_eq!(t.b.unexpected_len(), 0);
    let (ea, eb) = run(&mut t, true);
    assert_eq!(ea, vec![TagEvent::Send { id: 12 }]);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 3,
            tag: 0x99,
            len: 30_000,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(get(&t.b, 2 * REGION, 30_000), pattern(12, 30_000));

    // Unexpected eager, then a receive smaller than the message: truncated.
    put(&t.a, 3 * REGION, &pattern(13, 3000));
    t.a.send(13, 0, 0x42, 3 * REGION, 3000).unwrap();
    run(&mut t, true);
    t.b.recv(4, 0x42, u64::MAX, 3 * REGION, 1000).unwrap();
    let (_, eb) = run(&mut t, true);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 4,
            tag: 0x42,
            len: 1000,
            truncated: true,
            conn: 0
        }]
    );
    assert_eq!(get(&t.b, 3 * REGION, 1000), pattern(13, 3000)[..1000]);
    let s = t.b.stats();
    assert_eq!(
        (s.hw_posted, s.hw_matched, s.sw_matched, s.sw_rndv),
        (2, 2, 2, 1)
    );
}

#[test]
fn software_takes_back_a_disabled_hardware_entry() {
    let mut t = two(TagConfig::default(), FaultPlan::default(), 5);
    // The message reaches the receiver's NIC before the receive is posted, and the
    // receiver's software has not seen it when it posts: the entry goes to hardware with a
    // stale count, so hardware keeps it disabled and reports the message unexpected.
    put(&t.a, 0, &pattern(1, 5000));
    t.a.send(1, 0, 9, 0, 5000).unwrap();
    run(&mut t, false);
    t.b.recv(2, 9, u64::MAX, REGION, 9000).unwrap();
    t.b.recv(3, 9, u64::MAX, 2 * REGION, 9000).unwrap();
    assert_eq!(t.b.hw_posted(), 2);
    let (_, eb) = run(&mut t, true);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 2,
            tag: 9,
            len: 5000,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(t.b.stats().taken_back, 1);
    assert_eq!(t.b.hw_posted(), 1);
    // After the SYNC the remaining entry is live: the next message is matched by hardware.
    put(&t.a, REGION, &pattern(4, 6000));
    t.a.send(4, 0, 9, REGION, 6000).unwrap();
    let (_, eb) = run(&mut t, true);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 3,
            tag: 9,
            len: 6000,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(get(&t.b, 2 * REGION, 6000), pattern(4, 6000));
    assert_eq!(t.b.stats().hw_matched, 1);
}

#[test]
fn bad_input_is_refused() {
    let mut t = two(TagConfig::default(), FaultPlan::default(), 4);
    let size = t.b.user().len() as u64;
    assert!(t.b.recv(1, 0, 0, size - 10, 11).is_err());
    assert!(t.b.recv(1 << 60, 0, 0, 0, 1).is_err());
    assert!(t.a.send(1, 5, 0, 0, 1).is_err());
    assert!(t.a.send(1, 0, 0, size, 1).is_err());
    t.b.recv(7, 1, u64::MAX, 0, 10).unwrap();
    assert!(t.b.recv(7, 1, u64::MAX, 0, 10).is_err());
}

#[derive(Clone, Debug)]
enum Op {
    Send { from: usize, tag: u64, len: u32 },
    Recv { tag: u64, wild: bool, len: u32 },
    Progress,
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0u32..64, 1024u32..3000, 9000u32..20_000];
    prop_oneof![
        4 => (0usize..2, 0u64..4, len.clone()).prop_map(|(from, tag, len)| Op::Send { from, tag, len }),
        4 => (0u64..4, any::<bool>(), len).prop_map(|(tag, wild, len)| Op::Recv { tag, wild, len }),
        1 => Just(Op::Progress),
    ]
}

/// MPI matching: a message goes to the earliest posted receive it matches, a receive to the
/// earliest unexpected message it matches. Returns receive id -> send id.
fn oracle(ops: &[Op]) -> BTreeMap<u64, u64> {
    let mut posted: Vec<(u64, u64, u64)> = Vec::new();
    let mut unexpected: VecDeque<(u64, u64)> = VecDeque::new();
    let mut out = BTreeMap::new();
    for (i, o) in ops.iter().enumerate() {
        let i = i as u64;
        match *o {
            Op::Send { tag, .. } => match posted.iter().position(|&(_, t, m)| tag & m == t & m) {
                Some(p) => {
                    out.insert(posted.remove(p).0, i);
                }
                None => unexpected.push_back((i, tag)),
            },
            Op::Recv { tag, wild, .. } => {
                let m = if wild { 0xfff0 } else { u64::MAX };
                match unexpected.iter().position(|&(_, t)| t & m == tag & m) {
                    Some(p) => {
                        out.insert(i, unexpected.remove(p).unwrap().0);
                    }
                    None => posted.push((i, tag, m)),
                }
            }
            Op::Progress => {}
        }
    }
    out
}

fn check(ops: &[Op], cfg: TagConfig, faults: FaultPlan, seed: u64) {
    let mut t = net(3, cfg, faults, seed);
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    for (i, o) in ops.iter().enumerate() {
        let (i, off) = (i as u64, i as u64 * REGION);
        match *o {
            Op::Send { from, tag, len } => {
                let s = if from == 0 {
                    &mut t.a
                } else {
                    t.c.as_mut().unwrap()
                };
                put(s, off, &pattern(i, len));
                s.send(i, 0, tag, off, len).unwrap();
                // Delivered to the receiver's NIC, but the receiver's software does not look.
                let (ea, eb) = run(&mut t, false);
                sent.extend(ea);
                got.extend(eb);
            }
            Op::Recv { tag, wild, len } => {
                let m = if wild { 0xfff0 } else { u64::MAX };
                t.b.recv(i, tag, m, off, len).unwrap();
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
        assert_eq!(
            get(&t.b, id * REGION, len),
            pattern(s, *sl)[..len as usize],
            "receive {id}: data of send {s}"
        );
        assert!(seen.insert(id, s).is_none(), "receive {id} completed twice");
    }
    assert_eq!(seen, want, "matching differs from MPI order");
    // Every eager send completes; a rendezvous send completes once its receiver read it.
    let matched: Vec<u64> = want.values().copied().collect();
    for (i, o) in ops.iter().enumerate() {
        if let Op::Send { len, .. } = *o {
            let done = sent.contains(&TagEvent::Send { id: i as u64 });
            let should = len <= cfg.eager_max || matched.contains(&(i as u64));
            assert_eq!(done, should, "send {i} ({len} bytes) completion; {sent:?}");
        }
    }
    assert_eq!(
        sent.len(),
        sent.iter()
            .filter(|e| matches!(e, TagEvent::Send { .. }))
            .count()
    );
}

fn small_hw() -> TagConfig {
    TagConfig {
        hw_tags: 4,
        user_bytes: 64 << 16,
        ..TagConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn matching_follows_mpi_order(ops in proptest::collection::vec(op(), 1..40), seed in any::<u64>()) {
        check(&ops, small_hw(), FaultPlan::default(), seed);
    }

    #[test]
    fn matching_follows_mpi_order_in_software_only(ops in proptest::collection::vec(op(), 1..30)) {
        check(&ops, TagConfig { hw_tags: 0, ..small_hw() }, FaultPlan::default(), 1);
    }

    #[test]
    fn matching_follows_mpi_order_under_loss(
        ops in proptest::collection::vec(op(), 1..25),
        seed in any::<u64>(),
        drop in 0u32..30_000,
    ) {
        let faults = FaultPlan {
            links: LinkFaults { drop_ppm: drop, ..Default::default() },
            ..Default::default()
        };
        check(&ops, small_hw(), faults, seed);
    }
}

#[test]
fn unexpected_messages_beyond_the_staging_buffers_wait_for_rnr_retries() {
    let cfg = TagConfig {
        staging_slots: 4,
        ..TagConfig::default()
    };
    let mut t = two(cfg, FaultPlan::default(), 6);
    // Ten unexpected messages, four staging buffers, a receiver that does not look: the
    // fifth is RNR-NAKed and retried until software hands buffers back.
    for i in 0..10u64 {
        put(&t.a, i * 4096, &pattern(i, 3000));
        t.a.send(i, 0, 100 + i, i * 4096, 3000).unwrap();
    }
    for _ in 0..200 {
        t.fabric.step();
    }
    assert!(t.a.conn(0).unwrap().stats().unwrap().rnr_naks_received > 0);
    for i in (0..10u64).rev() {
        t.b.recv(50 + i, 100 + i, u64::MAX, i * 4096, 3000).unwrap();
    }
    let (ea, eb) = run(&mut t, true);
    assert_eq!(ea.len(), 10, "{ea:?}");
    assert_eq!(eb.len(), 10, "{eb:?}");
    for e in eb {
        let TagEvent::Recv { id, tag, len, .. } = e else {
            panic!("{e:?}")
        };
        assert_eq!((tag, len), (id - 50 + 100, 3000));
        assert_eq!(get(&t.b, (id - 50) * 4096, 3000), pattern(id - 50, 3000));
    }
}

#[test]
fn a_rendezvous_request_without_its_header_is_dropped_and_matching_goes_on() {
    use ringbell::tm::{Tmh, TmhOp};
    let fabric = Fabric::new(FabricConfig::new(2, 9));
    let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let mut raw = ringbell_tests::side(&fabric, 0, all);
    let dev = Device::open(Box::new(fabric.port(1))).unwrap();
    let mut m = TagMatcher::new(&dev, TagConfig::default()).unwrap();
    let (c, ep) = m.add_conn().unwrap();
    let opts = ConnectOptions::default();
    raw.qp.connect(&ep, 5, &opts).unwrap();
    m.connect(c, &raw.qp.endpoint(5), &opts).unwrap();
    // A RNDV request 20 bytes long: a TMH and no RVH.
    let tmh = |op: TmhOp, tag| {
        Tmh {
            opcode: op as u8,
            app_ctx: 0,
            tag,
        }
        .to_bytes()
    };
    raw.buf.write(0, &tmh(TmhOp::Rndv, 3)).unwrap();
    raw.buf.write(100, &tmh(TmhOp::Eager, 4)).unwrap();
    raw.buf.write(116, b"still here").unwrap();
    raw.qp
        .post_send(&[
            SendWr::new(1, WrOp::Send, &[raw.mr.sge(0, 20)]),
            SendWr::new(2, WrOp::Send, &[raw.mr.sge(100, 26)]),
        ])
        .unwrap();
    m.recv(7, 4, u64::MAX, 0, 100).unwrap();
    let mut got = Vec::new();
    for _ in 0..10_000 {
        m.progress().unwrap();
        got.extend(std::iter::from_fn(|| m.next_event()));
        if !got.is_empty() && !fabric.step() {
            break;
        }
    }
    assert_eq!(m.stats().dropped, 1);
    assert_eq!(m.unexpected_len(), 0);
    assert_eq!(
        got,
        vec![TagEvent::Recv {
            id: 7,
            tag: 4,
            len: 10,
            truncated: false,
            conn: c
        }]
    );
    assert_eq!(get(&m, 0, 10), b"still here");
}

#[test]
fn cancelled_receives_match_nothing() {
    let mut t = two(TagConfig::default(), FaultPlan::default(), 10);
    // One receive in the hardware list, one in software (too small for hardware).
    t.b.recv(1, 5, u64::MAX, 0, 9000).unwrap();
    t.b.recv(2, 6, u64::MAX, REGION, 100).unwrap();
    assert_eq!(t.b.hw_posted(), 1);
    assert!(t.b.cancel(1).unwrap());
    assert!(t.b.cancel(2).unwrap());
    assert!(!t.b.cancel(2).unwrap(), "already cancelled");
    assert!(!t.b.cancel(99).unwrap(), "never posted");
    let (_, eb) = run(&mut t, true);
    let mut ids: Vec<u64> = eb
        .iter()
        .map(|e| match *e {
            TagEvent::Cancelled { id } => id,
            _ => panic!("{e:?}"),
        })
        .collect();
    ids.sort();
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(t.b.hw_posted(), 0);
    // Messages for both tags now arrive unexpected and wait.
    put(&t.a, 0, &pattern(3, 50));
    t.a.send(3, 0, 5, 0, 50).unwrap();
    t.a.send(4, 0, 6, 0, 50).unwrap();
    let (_, eb) = run(&mut t, true);
    assert!(eb.is_empty(), "{eb:?}");
    assert_eq!(t.b.unexpected_len(), 2);
    assert_eq!(t.b.probe(6, u64::MAX), Some((6, 50, 0)));
    assert_eq!(
        t.b.probe(4, 0xfff0),
        Some((5, 50, 0)),
        "the earliest that matches"
    );
    assert_eq!(t.b.probe(7, u64::MAX), None);
    put(&t.a, REGION, &pattern(8, 20_000));
    t.a.send(8, 0, 9, REGION, 20_000).unwrap();
    run(&mut t, true);
    assert_eq!(
        t.b.probe(9, u64::MAX),
        Some((9, 20_000, 0)),
        "a rendezvous: its full length"
    );
    // A new receive takes the first.
    t.b.recv(5, 5, u64::MAX, 2 * REGION, 100).unwrap();
    assert_eq!(
        t.b.next_event(),
        Some(TagEvent::Recv {
            id: 5,
            tag: 5,
            len: 50,
            truncated: false,
            conn: 0
        })
    );
    assert_eq!(get(&t.b, 2 * REGION, 50), pattern(3, 50));
}

#[test]
fn many_sends_in_flight_on_many_connections_keep_their_headers() {
    // Five connections with 250 sends each in flight at once: every send's header must
    // survive until the NIC has sent (and could resend) it.
    let cfg = TagConfig {
        staging_slots: 16,
        ..TagConfig::default()
    };
    let fabric = Fabric::new(FabricConfig::new(2, 11));
    let (da, db) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    let (mut a, mut b) = (
        TagMatcher::new(&da, cfg).unwrap(),
        TagMatcher::new(&db, cfg).unwrap(),
    );
    let opts = ConnectOptions {
        rnr_retry: 7,
        ..Default::default()
    };
    for _ in 0..5 {
        let ((ca, ea), (cb, eb)) = (a.add_conn().unwrap(), b.add_conn().unwrap());
        a.connect(ca, &eb, &opts).unwrap();
        b.connect(cb, &ea, &opts).unwrap();
    }
    let n = 1250u64;
    for i in 0..n {
        b.recv(i, i, u64::MAX, i * 8, 8).unwrap();
    }
    for i in 0..n {
        a.user().write(i as usize * 8, &i.to_le_bytes()).unwrap();
        a.send(i, (i % 5) as usize, i, i * 8, 8).unwrap();
    }
    let mut got = 0;
    let mut sent = 0;
    while got < n || sent < n {
        a.progress().unwrap();
        b.progress().unwrap();
        while let Some(e) = a.next_event() {
            assert!(matches!(e, TagEvent::Send { .. }), "{e:?}");
            sent += 1;
        }
        while let Some(e) = b.next_event() {
            let TagEvent::Recv { id, tag, len, .. } = e else {
                panic!("{e:?}")
            };
            assert_eq!((tag, len), (id, 8));
            let mut v = [0u8; 8];
            b.user().read(id as usize * 8, &mut v).unwrap();
            assert_eq!(u64::from_le_bytes(v), id);
            got += 1;
        }
    }
}

#[test]
fn a_rendezvous_read_waits_for_room_in_a_full_send_queue() {
    let cfg = TagConfig {
        staging_slots: 2,
        ..TagConfig::default()
    };
    let mut t = two(cfg, FaultPlan::default(), 12);
    let steps = |f: &Fabric, n: usize| {
        for _ in 0..n {
            if !f.step() {
                break;
            }
        }
    };
    // An unexpected rendezvous request reaches B.
    put(&t.a, 0, &pattern(1, 20_000));
    t.a.send(1, 0, 3, 0, 20_000).unwrap();
    steps(&t.fabric, 5000);
    t.b.progress_ready().unwrap();
    assert_eq!(t.b.unexpected_len(), 1);
    // B fills its send queue with messages A (not looking, two staging buffers) RNR-NAKs.
    let mut queued = 0;
    while queued < 1000 {
        match t.b.send(100 + queued, 0, 50, 0, 8) {
            Ok(()) => queued += 1,
            Err(Error::QueueFull { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(queued >= 200, "{queued}");
    steps(&t.fabric, 2000);
    // The receive matches; its READ cannot be posted yet, and is not lost.
    t.b.recv(10, 3, u64::MAX, REGION, 20_000).unwrap();
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    for _ in 0..200_000 {
        t.a.progress().unwrap();
        t.b.progress().unwrap();
        ea.extend(std::iter::from_fn(|| t.a.next_event()));
        eb.extend(std::iter::from_fn(|| t.b.next_event()));
        if ea.contains(&TagEvent::Send { id: 1 }) && eb.len() as u64 == queued + 1 {
            break;
        }
    }
    assert!(ea.contains(&TagEvent::Send { id: 1 }), "{ea:?}");
    assert!(eb.contains(&TagEvent::Recv {
        id: 10,
        tag: 3,
        len: 20_000,
        truncated: false,
        conn: 0
    }));
    assert_eq!(get(&t.b, REGION, 20_000), pattern(1, 20_000));
    assert_eq!(t.a.unexpected_len() as u64, queued);
}

#[test]
fn a_receive_the_nic_is_filling_is_not_given_a_second_message() {
    let mut t = two(TagConfig::default(), FaultPlan::default(), 13);
    // A wildcard receive in the NIC's list takes a rendezvous; while the NIC reads it, an
    // eager message that also matches arrives unexpected.
    t.b.recv(1, 0, 0, 0, 50_000).unwrap();
    assert_eq!(t.b.hw_posted(), 1);
    put(&t.a, 0, &pattern(10, 40_000));
    put(&t.a, REGION, &pattern(11, 100));
    t.a.send(10, 0, 0x77, 0, 40_000).unwrap();
    t.a.send(11, 0, 0x78, REGION, 100).unwrap();
    let (ea, eb) = run(&mut t, true);
    assert_eq!(
        eb,
        vec![TagEvent::Recv {
            id: 1,
            tag: 0x77,
            len: 40_000,
            truncated: false,
            conn: 0
        }]
    );
    assert_eq!(get(&t.b, 0, 40_000), pattern(10, 40_000));
    assert_eq!(t.b.unexpected_len(), 1);
    t.b.recv(2, 0, 0, REGION, 1000).unwrap();
    assert_eq!(
        t.b.next_event(),
        Some(TagEvent::Recv {
            id: 2,
            tag: 0x78,
            len: 100,
            truncated: false,
            conn: 0
        })
    );
    let mut ea = ea;
    ea.sort_by_key(|e| format!("{e:?}"));
    assert_eq!(
        ea,
        vec![TagEvent::Send { id: 10 }, TagEvent::Send { id: 11 }]
    );
}

#[test]
fn work_flushed_by_a_broken_connection_is_reported_failed() {
    // B's staging buffers hold 1 KiB eager messages; a 5000-byte one breaks the connection.
    let small = TagConfig {
        eager_max: 1024,
        ..TagConfig::default()
    };
    let fabric = Fabric::new(FabricConfig::new(2, 14));
    let (da, db) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    let mut a = TagMatcher::new(&da, TagConfig::default()).unwrap();
    let mut b = TagMatcher::new(&db, small).unwrap();
    let ((ca, ea), (cb, eb)) = (a.add_conn().unwrap(), b.add_conn().unwrap());
    a.connect(ca, &eb, &ConnectOptions::default()).unwrap();
    b.connect(cb, &ea, &ConnectOptions::default()).unwrap();
    a.send(1, ca, 1, 0, 5000).unwrap();
    a.send(2, ca, 2, 0, 100).unwrap();
    a.send(3, ca, 3, 0, 100).unwrap();
    a.send(4, ca, 4, 0, 20_000).unwrap();
    let mut events = Vec::new();
    for _ in 0..100_000 {
        a.progress().unwrap();
        b.progress().unwrap();
        events.extend(std::iter::from_fn(|| a.next_event()));
        if events.len() == 4 {
            break;
        }
    }
    let ids: Vec<u64> = events
        .iter()
        .map(|e| match *e {
            TagEvent::Failed { id, .. } => id,
            _ => panic!("{events:?}"),
        })
        .collect();
    assert_eq!(ids, vec![1, 2, 3, 4], "{events:?}");
}
