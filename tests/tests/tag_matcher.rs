//! The software tag-matching layer (`ringbell::tagmatch`) end to end on emulated nodes, and
//! property tests of its matching against a plain MPI matching model: several senders whose
//! multi-packet messages interleave, a receiver whose software lags behind its NIC, staging
//! pools and hardware lists from minimal to large, and loss.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use ringbell::tagmatch::{TagConfig, TagEvent, TagMatcher, TagStats};
use ringbell::*;
use ringbell_emu::{
    Fabric, FabricConfig, FaultAction, FaultPlan, FaultRule, FrameKind, FrameMatch, LinkFaults,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Bytes of one operation's region in the user buffer.
const REGION: u64 = 1 << 16;

/// A receiver `b` and its senders; `b`'s connection `i` goes to sender `s[i]`, which reaches
/// `b` on its connection 0.
struct Net {
    fabric: Fabric,
    b: TagMatcher,
    s: Vec<TagMatcher>,
    _devs: Vec<Device>,
}

fn net_mtu(nodes: usize, cfg: TagConfig, faults: FaultPlan, seed: u64, mtu: u8) -> Net {
    let mut fc = FabricConfig::new(nodes, seed);
    fc.faults = faults;
    let fabric = Fabric::new(fc);
    let devs: Vec<Device> = (0..nodes)
        .map(|n| Device::open(Box::new(fabric.port(n))).unwrap())
        .collect();
    let mut b = TagMatcher::new(&devs[0], cfg).unwrap();
    let opts = ConnectOptions {
        path_mtu: mtu,
        rnr_retry: 7,
        ..Default::default()
    };
    let mut s = Vec::new();
    for d in &devs[1..] {
        let mut m = TagMatcher::new(d, cfg).unwrap();
        let (cs, es) = m.add_conn().unwrap();
        let (cb, eb) = b.add_conn().unwrap();
        m.connect(cs, &eb, &opts).unwrap();
        b.connect(cb, &es, &opts).unwrap();
        s.push(m);
    }
    Net {
        fabric,
        b,
        s,
        _devs: devs,
    }
}

/// Path MTU 1024.
fn net(nodes: usize, cfg: TagConfig, faults: FaultPlan, seed: u64) -> Net {
    net_mtu(nodes, cfg, faults, seed, 3)
}

fn two(cfg: TagConfig, faults: FaultPlan, seed: u64) -> Net {
    net(2, cfg, faults, seed)
}

/// Runs the fabric and the senders' (and, if asked, the receiver's) progress until nothing
/// moves; returns the senders' and the receiver's events.
fn run(t: &mut Net, progress_b: bool) -> (Vec<TagEvent>, Vec<TagEvent>) {
    let (mut ea, mut eb) = (Vec::new(), Vec::new());
    loop {
        // Bounded: a sender retrying after RNR NAKs keeps the fabric busy until the
        // receiver's software hands buffers back.
        for _ in 0..10_000 {
            if !t.fabric.step() {
                break;
            }
        }
        let mut n = 0;
        for m in t.s.iter_mut() {
            n += m.progress().unwrap();
            // Operation ids are unique across senders, so their events can share a list.
            ea.extend(std::iter::from_fn(|| m.next_event()));
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

/// Two matchers on two nodes joined by `conns` connections (RNR retried forever).
fn pair_with_conns(
    cfg: TagConfig,
    seed: u64,
    conns: usize,
) -> (Fabric, [Device; 2], TagMatcher, TagMatcher) {
    let fabric = Fabric::new(FabricConfig::new(2, seed));
    let devs = [
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    ];
    let (mut a, mut b) = (
        TagMatcher::new(&devs[0], cfg).unwrap(),
        TagMatcher::new(&devs[1], cfg).unwrap(),
    );
    let opts = ConnectOptions {
        rnr_retry: 7,
        ..Default::default()
    };
    for _ in 0..conns {
        let ((ca, ea), (cb, eb)) = (a.add_conn().unwrap(), b.add_conn().unwrap());
        a.connect(ca, &eb, &opts).unwrap();
        b.connect(cb, &ea, &opts).unwrap();
    }
    (fabric, devs, a, b)
}

/// A raw RC QP on node 0 (any bytes it sends reach the matcher as they are) connected to a
/// matcher on node 1; returns the matcher's connection to it too.
fn raw_peer() -> (Fabric, ringbell_tests::Side, Device, TagMatcher, usize) {
    let fabric = Fabric::new(FabricConfig::new(2, 9));
    let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let mut raw = ringbell_tests::side(&fabric, 0, all);
    let dev = Device::open(Box::new(fabric.port(1))).unwrap();
    let mut m = TagMatcher::new(&dev, TagConfig::default()).unwrap();
    let (c, ep) = m.add_conn().unwrap();
    let opts = ConnectOptions::default();
    raw.qp.connect(&ep, 5, &opts).unwrap();
    m.connect(c, &raw.qp.endpoint(5), &opts).unwrap();
    (fabric, raw, dev, m, c)
}

/// Every eager send completes; a rendezvous send completes once its receiver read it, and
/// only then; no send fails. `sends` are (id, length), `matched` says whether a receive got
/// a send.
fn sends_end(
    sends: impl Iterator<Item = (u64, u32)>,
    eager_max: u32,
    matched: impl Fn(u64) -> bool,
    sent: &[TagEvent],
) {
    for (id, len) in sends {
        let done = sent.contains(&TagEvent::Send { id });
        let should = len <= eager_max || matched(id);
        assert_eq!(done, should, "send {id} ({len} bytes) completion; {sent:?}");
    }
    assert!(
        sent.iter().all(|e| matches!(e, TagEvent::Send { .. })),
        "{sent:?}"
    );
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
    put(&t.s[0], 0, &pattern(10, 2000));
    t.s[0].send(10, 0, 0x55, 0, 2000).unwrap();
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
    put(&t.s[0], REGION, &pattern(11, 40_000));
    t.s[0].send(11, 0, 0x77, REGION, 40_000).unwrap();
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
    put(&t.s[0], 2 * REGION, &pattern(12, 30_000));
    t.s[0].send(12, 0, 0x99, 2 * REGION, 30_000).unwrap();
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
    put(&t.s[0], 3 * REGION, &pattern(13, 3000));
    t.s[0].send(13, 0, 0x42, 3 * REGION, 3000).unwrap();
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
    put(&t.s[0], 0, &pattern(1, 5000));
    t.s[0].send(1, 0, 9, 0, 5000).unwrap();
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
    put(&t.s[0], REGION, &pattern(4, 6000));
    t.s[0].send(4, 0, 9, REGION, 6000).unwrap();
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
    assert!(t.s[0].send(1, 5, 0, 0, 1).is_err());
    assert!(t.s[0].send(1, 0, 0, size, 1).is_err());
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

/// MPI matching when every message arrives in send order: a message goes to the earliest
/// posted receive it matches, a receive to the earliest unexpected message it matches.
/// Returns receive id -> send id.
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
                let s = &mut t.s[from];
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
    let sends = ops.iter().enumerate().filter_map(|(i, o)| match *o {
        Op::Send { len, .. } => Some((i as u64, len)),
        _ => None,
    });
    sends_end(
        sends,
        cfg.eager_max,
        |m| want.values().any(|&x| x == m),
        &sent,
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

/// The widened property test: a script of several senders' sends, receives, and fabric
/// steps with no software looking, so that multi-packet messages interleave and receives
/// are posted before, while and after their messages arrive.
#[derive(Clone, Debug)]
enum Step {
    Send {
        from: usize,
        tag: u64,
        len: u32,
    },
    Recv {
        tag: u64,
        wild: bool,
        len: u32,
    },
    /// This many fabric events, no software progress.
    Fabric(u16),
    /// The fabric runs until it is idle (at most 20,000 events), the senders progressing and
    /// the receiver's software not looking.
    Settle,
    /// Everything moves until nothing does, everyone progressing.
    Progress,
}

#[derive(Clone, Debug)]
struct Case {
    senders: usize,
    mtu: u8,
    staging: u32,
    hw_tags: u32,
    drop_ppm: u32,
    seed: u64,
    steps: Vec<Step>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        2usize..=4,
        1u8..=5,
        prop_oneof![Just(1u32), Just(2), Just(3), Just(8), Just(64)],
        prop_oneof![Just(1u32), Just(2), Just(4), Just(8), Just(1024)],
        prop_oneof![2 => Just(0u32), 1 => 0u32..=30_000],
        any::<u64>(),
    )
        .prop_flat_map(|(senders, mtu, staging, hw_tags, drop_ppm, seed)| {
            // A receiver that lags while its few staging buffers are full makes senders
            // retry after RNR NAKs, which are no forward progress: with loss, their ACK
            // timeouts add up to retry_cnt and end the connection, as IBTA has it. Lossy
            // runs get a pool that lagging software does not exhaust.
            let staging = if drop_ppm > 0 {
                staging.max(64)
            } else {
                staging
            };
            // Eager sizes from nothing to many packets (8 KiB is 32 packets at MTU 256);
            // rendezvous above.
            let len = prop_oneof![0u32..64, 1u32..=8192, 9000u32..20_000];
            let step = prop_oneof![
                5 => (0..senders, 0u64..4, len.clone())
                    .prop_map(|(from, tag, len)| Step::Send { from, tag, len }),
                4 => (0u64..4, any::<bool>(), len)
                    .prop_map(|(tag, wild, len)| Step::Recv { tag, wild, len }),
                3 => (1u16..300).prop_map(Step::Fabric),
                1 => Just(Step::Settle),
                1 => Just(Step::Progress),
            ];
            proptest::collection::vec(step, 1..40).prop_map(move |steps| Case {
                senders,
                mtu,
                staging,
                hw_tags,
                drop_ppm,
                seed,
                steps,
            })
        })
}

fn selector(tag: u64, wild: bool) -> (u64, u64) {
    (tag, if wild { 0xfff0 } else { u64::MAX })
}

/// Whether MPI matching yields `got` (receive id -> send id) for some order of arrival: each
/// sender's messages arrive in its order, each after its send and before the next
/// `Progress` (or the end); a message goes to the earliest pending receive it matches, a
/// receive to the earliest unexpected message it matches. A depth-first search over
/// arrivals and postings, pruned by `got` and by states already refuted.
fn mpi_feasible(steps: &[Step], senders: usize, got: &BTreeMap<u64, u64>) -> bool {
    struct S<'a> {
        recvs: Vec<(usize, u64, u64)>,
        msgs: Vec<Vec<(usize, u64)>>,
        deadline: Vec<usize>,
        /// The tag of each send, by step.
        tags: Vec<u64>,
        got: &'a BTreeMap<u64, u64>,
        by_send: BTreeMap<u64, u64>,
        refuted: BTreeSet<(usize, Vec<usize>, Vec<u64>)>,
    }
    fn go(
        s: &mut S<'_>,
        j: usize,
        p: &mut Vec<usize>,
        unexp: &mut Vec<u64>,
        pend: &mut Vec<usize>,
    ) -> bool {
        let key = (j, p.clone(), unexp.clone());
        if s.refuted.contains(&key) {
            return false;
        }
        let done_msgs = (0..p.len()).all(|k| p[k] == s.msgs[k].len());
        if j == s.recvs.len() && done_msgs {
            return pend
                .iter()
                .all(|&r| !s.got.contains_key(&(s.recvs[r].0 as u64)))
                && unexp.iter().all(|m| !s.by_send.contains_key(m));
        }
        let next_recv_at = s.recvs.get(j).map_or(usize::MAX, |r| r.0);
        // A message of sender k arrives.
        for k in 0..p.len() {
            let Some(&(at, tag)) = s.msgs[k].get(p[k]) else {
                continue;
            };
            if at > next_recv_at {
                continue;
            }
            let m = at as u64;
            let hit = pend
                .iter()
                .position(|&r| tag & s.recvs[r].2 == s.recvs[r].1 & s.recvs[r].2);
            match hit {
                Some(i) => {
                    let r = pend[i];
                    if s.got.get(&(s.recvs[r].0 as u64)) != Some(&m) {
                        continue;
                    }
                    pend.remove(i);
                    p[k] += 1;
                    if go(s, j, p, unexp, pend) {
                        return true;
                    }
                    p[k] -= 1;
                    pend.insert(i, r);
                }
                None => {
                    // Its receive, if any, must not be posted yet.
                    if s.by_send.get(&m).is_some_and(|&r| {
                        s.recvs
                            .iter()
                            .position(|x| x.0 as u64 == r)
                            .is_some_and(|ri| ri < j)
                    }) {
                        continue;
                    }
                    unexp.push(m);
                    p[k] += 1;
                    if go(s, j, p, unexp, pend) {
                        return true;
                    }
                    p[k] -= 1;
                    unexp.pop();
                }
            }
        }
        // Receive j is posted: every message whose deadline passed has arrived.
        if let Some(&(at, tag, mask)) = s.recvs.get(j) {
            let late = (0..p.len()).any(|k| {
                s.msgs[k]
                    .get(p[k])
                    .is_some_and(|&(mat, _)| s.deadline[mat] < at)
            });
            if !late {
                let want = s.got.get(&(at as u64)).copied();
                let hit = unexp
                    .iter()
                    .position(|&m| s.tags[m as usize] & mask == tag & mask);
                match hit {
                    Some(i) if want == Some(unexp[i]) => {
                        let m = unexp.remove(i);
                        if go(s, j + 1, p, unexp, pend) {
                            return true;
                        }
                        unexp.insert(i, m);
                    }
                    Some(_) => {}
                    None => {
                        pend.push(j);
                        if go(s, j + 1, p, unexp, pend) {
                            return true;
                        }
                        pend.pop();
                    }
                }
            }
        }
        s.refuted.insert(key);
        false
    }
    let mut recvs = Vec::new();
    let mut msgs = vec![Vec::new(); senders];
    let mut deadline = vec![steps.len(); steps.len()];
    let mut open = Vec::new();
    for (i, st) in steps.iter().enumerate() {
        match *st {
            Step::Send { from, tag, .. } => {
                msgs[from].push((i, tag));
                open.push(i);
            }
            Step::Recv { tag, wild, .. } => {
                let (t, m) = selector(tag, wild);
                recvs.push((i, t, m));
            }
            Step::Progress => {
                for o in open.drain(..) {
                    deadline[o] = i;
                }
            }
            _ => {}
        }
    }
    let by_send = got.iter().map(|(&r, &m)| (m, r)).collect();
    let tags = steps
        .iter()
        .map(|st| match *st {
            Step::Send { tag, .. } => tag,
            _ => 0,
        })
        .collect();
    let mut s = S {
        recvs,
        msgs,
        deadline,
        tags,
        got,
        by_send,
        refuted: BTreeSet::new(),
    };
    go(
        &mut s,
        0,
        &mut vec![0; senders],
        &mut Vec::new(),
        &mut Vec::new(),
    )
}

/// What the widened test saw, over all its cases.
#[derive(Debug, Default)]
struct Reached {
    cases: u64,
    receiver: TagStats,
    multi_packet_eager: u64,
    rnr_naks: u64,
    list_full: u64,
    retransmitted: u64,
}

fn run_case(c: &Case, reached: &mut Reached) -> Result<(), TestCaseError> {
    let cfg = TagConfig {
        hw_tags: c.hw_tags,
        staging_slots: c.staging,
        ..TagConfig::default()
    };
    let faults = FaultPlan {
        links: LinkFaults {
            drop_ppm: c.drop_ppm,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut t = net_mtu(c.senders + 1, cfg, faults, c.seed, c.mtu);
    let mtu_bytes = 128u32 << c.mtu;
    let (mut sent, mut got) = (Vec::new(), Vec::new());
    for (i, st) in c.steps.iter().enumerate() {
        let (i, off) = (i as u64, i as u64 * REGION);
        match *st {
            Step::Send { from, tag, len } => {
                put(&t.s[from], off, &pattern(i, len));
                t.s[from].send(i, 0, tag, off, len).unwrap();
                if len > mtu_bytes && len <= cfg.eager_max {
                    reached.multi_packet_eager += 1;
                }
            }
            Step::Recv { tag, wild, len } => {
                let (tag, mask) = selector(tag, wild);
                t.b.recv(i, tag, mask, off, len).unwrap();
                if t.b.hw_posted() == t.b.stats().hw_posted as usize
                    && t.b.hw_posted() >= c.hw_tags as usize
                {
                    reached.list_full += 1;
                }
            }
            Step::Fabric(n) => {
                for _ in 0..n {
                    if !t.fabric.step() {
                        break;
                    }
                }
            }
            Step::Settle => {
                for _ in 0..20_000 {
                    if !t.fabric.step() {
                        break;
                    }
                    for m in t.s.iter_mut() {
                        m.progress_ready().unwrap();
                        sent.extend(std::iter::from_fn(|| m.next_event()));
                    }
                }
            }
            Step::Progress => {
                let (ea, eb) = run(&mut t, true);
                sent.extend(ea);
                got.extend(eb);
            }
        }
    }
    let (ea, eb) = run(&mut t, true);
    sent.extend(ea);
    got.extend(eb);

    // Exactly once, with the right data, length and truncation. Receives are told their
    // sends in posting order, so that messages no byte tells apart (one sender, one tag,
    // all truncated to the same bytes) go to receives in the order MPI gives them.
    got.sort_by_key(|e| match *e {
        TagEvent::Recv { id, .. } => id,
        _ => 0,
    });
    let mut pairs = BTreeMap::new();
    for e in &got {
        let TagEvent::Recv {
            id,
            tag,
            len,
            truncated,
            conn,
        } = *e
        else {
            return Err(TestCaseError::fail(format!("receiver event {e:?}")));
        };
        let Some(m) = got_send(c, &t, (id, tag, len, conn), &pairs) else {
            return Err(TestCaseError::fail(format!(
                "receive {id}: no send of tag {tag} on connection {conn}"
            )));
        };
        let (Step::Send { len: sl, .. }, Step::Recv { len: rl, .. }) =
            (&c.steps[m as usize], &c.steps[id as usize])
        else {
            unreachable!()
        };
        prop_assert_eq!(
            len,
            (*sl).min(*rl),
            "receive {}: length (from send {})",
            id,
            m
        );
        prop_assert_eq!(truncated, sl > rl, "receive {}: truncation", id);
        prop_assert!(
            pairs.insert(id, m).is_none(),
            "receive {} completed twice",
            id
        );
    }
    prop_assert!(
        mpi_feasible(&c.steps, c.senders, &pairs),
        "no MPI arrival order gives this matching: {:?}",
        pairs
    );
    let sends = c.steps.iter().enumerate().filter_map(|(i, st)| match *st {
        Step::Send { len, .. } => Some((i as u64, len)),
        _ => None,
    });
    sends_end(
        sends,
        cfg.eager_max,
        |m| pairs.values().any(|&x| x == m),
        &sent,
    );
    reached.cases += 1;
    let r = t.b.stats();
    let a = &mut reached.receiver;
    a.hw_posted += r.hw_posted;
    a.hw_matched += r.hw_matched;
    a.sw_matched += r.sw_matched;
    a.taken_back += r.taken_back;
    a.sw_rndv += r.sw_rndv;
    a.dropped += r.dropped;
    for s in &t.s {
        let st = s.conn(0).unwrap().stats().unwrap();
        reached.rnr_naks += st.rnr_naks_received;
        reached.retransmitted += st.retransmitted;
    }
    Ok(())
}

/// The send that receive `id` got, told by its data: the earliest send of `tag` from the
/// sender of `conn` that no receive took yet, whose length gives this one, and whose bytes
/// (as many as the receive holds) are those in the buffer.
fn got_send(
    c: &Case,
    t: &Net,
    (id, tag, len, conn): (u64, u64, u32, usize),
    taken: &BTreeMap<u64, u64>,
) -> Option<u64> {
    let Step::Recv { len: rl, .. } = c.steps[id as usize] else {
        return None;
    };
    let data = get(&t.b, id * REGION, len);
    c.steps.iter().enumerate().find_map(|(i, st)| match *st {
        Step::Send {
            from,
            tag: st,
            len: sl,
        } if from == conn
            && st == tag
            && sl.min(rl) == len
            && !taken.values().any(|&x| x == i as u64)
            && pattern(i as u64, sl)[..len as usize] == data[..] =>
        {
            Some(i as u64)
        }
        _ => None,
    })
}

#[test]
fn matching_follows_mpi_order_with_interleaved_senders() {
    // TM_CASES=N soaks it with more cases.
    let cases = std::env::var("TM_CASES").ok().and_then(|v| v.parse().ok());
    let mut runner = TestRunner::new(Config {
        cases: cases.unwrap_or(160),
        failure_persistence: None,
        ..Config::default()
    });
    let reached = std::cell::RefCell::new(Reached::default());
    let r = runner.run(&case(), |c| run_case(&c, &mut reached.borrow_mut()));
    let reached = reached.into_inner();
    eprintln!("{reached:#?}");
    if let Err(e) = r {
        panic!("{e}");
    }
    // The paths the cases are for were all taken.
    let s = reached.receiver;
    assert!(reached.multi_packet_eager > 100, "{reached:?}");
    assert!(
        s.hw_matched > 0 && s.sw_matched > 0 && s.taken_back > 0 && s.sw_rndv > 0,
        "{reached:?}"
    );
    assert!(
        reached.rnr_naks > 0 && reached.list_full > 0 && reached.retransmitted > 0,
        "{reached:?}"
    );
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
        put(&t.s[0], i * 4096, &pattern(i, 3000));
        t.s[0].send(i, 0, 100 + i, i * 4096, 3000).unwrap();
    }
    for _ in 0..200 {
        t.fabric.step();
    }
    assert!(t.s[0].conn(0).unwrap().stats().unwrap().rnr_naks_received > 0);
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
    let (fabric, mut raw, _dev, mut m, c) = raw_peer();
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
    put(&t.s[0], 0, &pattern(3, 50));
    t.s[0].send(3, 0, 5, 0, 50).unwrap();
    t.s[0].send(4, 0, 6, 0, 50).unwrap();
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
    put(&t.s[0], REGION, &pattern(8, 20_000));
    t.s[0].send(8, 0, 9, REGION, 20_000).unwrap();
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

/// Progresses sender `a` and receiver `b` until `n` sends have completed and `n` messages
/// arrived, each message (id, tag, length) checked by `check` against `b`, and a message
/// arriving twice a failure; every event is a send on `a` and a receive on `b`.
fn sends_arrive(
    a: &mut TagMatcher,
    b: &mut TagMatcher,
    n: usize,
    mut check: impl FnMut(&TagMatcher, u64, u64, u32),
) {
    let (mut got, mut sent) = (BTreeSet::new(), 0);
    for _ in 0..50_000_000 {
        if got.len() == n && sent == n {
            return;
        }
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
            check(b, id, tag, len);
            assert!(got.insert(id), "message {id} twice");
        }
    }
    panic!("{} of {n} received, {sent} sent", got.len());
}

#[test]
fn connections_beyond_one_cq_group_carry_their_sends() {
    // 130 connections: their send completions go to three CQs (64 connections each), made
    // as the connections come.
    let cfg = TagConfig {
        staging_slots: 8192,
        max_conns: 1024,
        eager_max: 64,
        hw_min: 0,
        ..TagConfig::default()
    };
    let conns = 130u64;
    let (fabric, _devs, mut a, mut b) = pair_with_conns(cfg, 12, conns as usize);
    let mut next = 0u64;
    let mut exchange =
        |a: &mut TagMatcher, b: &mut TagMatcher, on: &[u64], len: u32, idle: bool| {
            let ids: Vec<u64> = (next..next + on.len() as u64).collect();
            next += ids.len() as u64;
            let at = |i: u64| (i % 8192) * 256;
            for &i in &ids {
                b.recv(i, i, u64::MAX, at(i), len).unwrap();
            }
            for (&i, &c) in ids.iter().zip(on) {
                a.user().write(at(i) as usize, &pattern(i, len)).unwrap();
                a.send(i, c as usize, i, at(i), len).unwrap();
            }
            if idle {
                // Everything the NICs can do without the matchers' software, before either
                // looks at a CQ: every send completion is in a CQ at once.
                fabric.run_until_idle(u64::MAX);
            }
            sends_arrive(a, b, ids.len(), |b, id, tag, l| {
                assert_eq!((tag, l), (id, len));
                assert_eq!(get(b, at(id), l), pattern(id, l), "message {id}");
            });
        };
    // Eager and rendezvous messages on every connection.
    let every: Vec<u64> = (0..conns).cycle().take(conns as usize * 3).collect();
    exchange(&mut a, &mut b, &every, 8, false);
    exchange(&mut a, &mut b, &every, 256, false);
    // 120 eager sends on each connection of the second group, all complete before the
    // sender polls: its CQ for that group must hold 7,680 completions.
    let second: Vec<u64> = (64..128).cycle().take(64 * 120).collect();
    exchange(&mut a, &mut b, &second, 8, true);
}

#[test]
fn many_sends_in_flight_on_many_connections_keep_their_headers() {
    // Five connections with 250 sends each in flight at once: every send's header must
    // survive until the NIC has sent (and could resend) it.
    let cfg = TagConfig {
        staging_slots: 16,
        ..TagConfig::default()
    };
    let (_fabric, _devs, mut a, mut b) = pair_with_conns(cfg, 11, 5);
    let n = 1250u64;
    for i in 0..n {
        b.recv(i, i, u64::MAX, i * 8, 8).unwrap();
    }
    for i in 0..n {
        a.user().write(i as usize * 8, &i.to_le_bytes()).unwrap();
        a.send(i, (i % 5) as usize, i, i * 8, 8).unwrap();
    }
    sends_arrive(&mut a, &mut b, n as usize, |b, id, tag, len| {
        assert_eq!((tag, len), (id, 8));
        let mut v = [0u8; 8];
        b.user().read(id as usize * 8, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), id);
    });
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
    put(&t.s[0], 0, &pattern(1, 20_000));
    t.s[0].send(1, 0, 3, 0, 20_000).unwrap();
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
        t.s[0].progress().unwrap();
        t.b.progress().unwrap();
        ea.extend(std::iter::from_fn(|| t.s[0].next_event()));
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
    assert_eq!(t.s[0].unexpected_len() as u64, queued);
}

#[test]
fn a_receive_the_nic_is_filling_is_not_given_a_second_message() {
    let mut t = two(TagConfig::default(), FaultPlan::default(), 13);
    // A wildcard receive in the NIC's list takes a rendezvous; while the NIC reads it, an
    // eager message that also matches arrives unexpected.
    t.b.recv(1, 0, 0, 0, 50_000).unwrap();
    assert_eq!(t.b.hw_posted(), 1);
    put(&t.s[0], 0, &pattern(10, 40_000));
    put(&t.s[0], REGION, &pattern(11, 100));
    t.s[0].send(10, 0, 0x77, 0, 40_000).unwrap();
    t.s[0].send(11, 0, 0x78, REGION, 100).unwrap();
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
    }
    // Each fails exactly once. The rendezvous send (4) fails as soon as its connection
    // breaks, before the flushes of the eager sends queued ahead of it reach the CQ.
    let mut ids: Vec<u64> = events
        .iter()
        .map(|e| match *e {
            TagEvent::Failed { id, .. } => id,
            _ => panic!("{events:?}"),
        })
        .collect();
    ids.sort();
    assert_eq!(ids, vec![1, 2, 3, 4], "{events:?}");
}

/// Events of `m` until `done` holds for them, progressing every matcher of `t` together.
fn until(t: &mut Net, who: usize, done: impl Fn(&[TagEvent]) -> bool) -> Vec<TagEvent> {
    let mut got = Vec::new();
    for _ in 0..2_000_000 {
        let mut all: Vec<&mut TagMatcher> = t.s.iter_mut().collect();
        all.push(&mut t.b);
        TagMatcher::progress_all(&mut all).unwrap();
        let m = if who == usize::MAX {
            &mut t.b
        } else {
            &mut t.s[who]
        };
        got.extend(std::iter::from_fn(|| m.next_event()));
        if done(&got) {
            return got;
        }
    }
    panic!("not done: {got:?}");
}

#[test]
fn multi_packet_eager_messages_of_several_senders_all_wait_unexpected() {
    // The reproduction: path MTU 1024, default TagConfig, nothing posted. Two (then three)
    // senders' eager messages of 8,000, 7,000 (and 6,000) bytes interleave their packets
    // into the staging buffers; a shorter one finishes first in a later buffer. Every one
    // must wait in the unexpected queue and be received; before the fix the second and
    // third were lost and progress failed with QueueFull.
    for senders in [2usize, 3] {
        let mut t = net(senders + 1, TagConfig::default(), FaultPlan::default(), 21);
        let lens = [8000u32, 7000, 6000];
        for (k, &len) in lens.iter().enumerate().take(senders) {
            put(&t.s[k], 0, &pattern(k as u64, len));
            t.s[k].send(k as u64, 0, 7, 0, len).unwrap();
        }
        let (ea, eb) = run(&mut t, true);
        assert!(eb.is_empty(), "{eb:?}");
        assert_eq!(ea.len(), senders, "{ea:?}");
        assert_eq!(t.b.unexpected_len(), senders);
        for k in 0..senders as u64 {
            t.b.recv(100 + k, 0, 0, k * REGION, 8192).unwrap();
        }
        let events: Vec<TagEvent> = std::iter::from_fn(|| t.b.next_event()).collect();
        let mut got: Vec<(usize, u32)> = events
            .into_iter()
            .map(|e| match e {
                TagEvent::Recv { id, len, conn, .. } => {
                    assert_eq!(
                        get(&t.b, (id - 100) * REGION, len),
                        pattern(conn as u64, len)
                    );
                    (conn, len)
                }
                _ => panic!("{e:?}"),
            })
            .collect();
        got.sort();
        let want: Vec<(usize, u32)> = (0..senders).map(|k| (k, lens[k])).collect();
        assert_eq!(got, want);
        assert_eq!(t.b.unexpected_len(), 0);
    }
}

#[test]
fn a_rendezvous_whose_read_fails_fails_its_send_too() {
    // Every READ response to the receiver is lost: its READ ends in RETRY_EXC_ERR and its
    // QP in ERR, so no FIN can come. The sender's keepalive probe finds the peer gone.
    let cfg = TagConfig {
        keepalive_polls: 64,
        ..TagConfig::default()
    };
    let mut t = two(cfg, FaultPlan::default(), 31);
    t.fabric.add_fault_rule(FaultRule {
        when: FrameMatch {
            to: Some(0),
            kind: Some(FrameKind::ReadResponse),
            ..Default::default()
        },
        nth: 1,
        times: 0,
        action: FaultAction::Drop,
    });
    put(&t.s[0], 0, &pattern(1, 30_000));
    t.s[0].send(1, 0, 5, 0, 30_000).unwrap();
    run(&mut t, true);
    t.b.recv(2, 5, u64::MAX, 0, 30_000).unwrap();
    let eb = until(&mut t, usize::MAX, |e| !e.is_empty());
    assert!(matches!(eb[..], [TagEvent::Failed { id: 2, .. }]), "{eb:?}");
    let ea = until(&mut t, 0, |e| !e.is_empty());
    assert!(
        matches!(
            ea[..],
            [TagEvent::Failed {
                id: 1,
                status: WcStatus::RetryExcErr
            }]
        ),
        "{ea:?}"
    );
    assert!(t.s[0].stats().probes >= 1);
}

#[test]
fn a_malformed_rendezvous_request_is_refused_and_its_sender_told() {
    use ringbell::tm::{Tmh, TmhOp};
    let (_fabric, mut raw, _dev, mut m, _c) = raw_peer();
    raw.qp
        .post_recv(&[RecvWr {
            wr_id: 50,
            sgl: &[raw.mr.sge(1000, 64)],
        }])
        .unwrap();
    // A RNDV request of 20 bytes: a TMH naming context 77 and no RVH.
    let tmh = Tmh {
        opcode: TmhOp::Rndv as u8,
        app_ctx: 77,
        tag: 3,
    };
    raw.buf.write(0, &tmh.to_bytes()).unwrap();
    raw.qp
        .post_send(&[SendWr::new(1, WrOp::Send, &[raw.mr.sge(0, 20)])])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    let mut fin = None;
    for _ in 0..100_000 {
        m.progress().unwrap();
        let n = raw.cq.poll(&mut wc);
        if let Some(w) = wc[..n].iter().find(|w| w.wr_id == 50) {
            fin = Some(*w);
            break;
        }
    }
    let fin = fin.expect("no answer to the malformed request");
    assert_eq!(fin.status, WcStatus::Success);
    let mut b = [0u8; 32];
    raw.buf.read(1000, &mut b).unwrap();
    let t = Tmh::parse(&b).unwrap();
    assert_eq!((t.opcode, t.app_ctx, t.tag), (TmhOp::Fin as u8, 77, 3));
    assert_ne!(b[1], 0, "a refusing FIN");
    assert_eq!((m.stats().refused, m.stats().dropped), (1, 1));
    assert_eq!(m.unexpected_len(), 0);
}

#[test]
fn a_fin_on_another_connection_completes_nothing() {
    use ringbell::tm::{rndv_header, Rvh, Tmh, TmhOp};
    // Matcher M sends a rendezvous to P (connection 0, context 1); a raw peer R on
    // connection 1 sends a FIN for context 1 with the same tag. Only P's FIN may complete it.
    let fabric = Fabric::new(FabricConfig::new(3, 17));
    let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let (dm, dp) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    let mut raw = ringbell_tests::side(&fabric, 2, all);
    let (mut m, mut p) = (
        TagMatcher::new(&dm, TagConfig::default()).unwrap(),
        TagMatcher::new(&dp, TagConfig::default()).unwrap(),
    );
    let opts = ConnectOptions::default();
    let ((cm, em), (cp, ep)) = (m.add_conn().unwrap(), p.add_conn().unwrap());
    m.connect(cm, &ep, &opts).unwrap();
    p.connect(cp, &em, &opts).unwrap();
    let (cr, er) = m.add_conn().unwrap();
    raw.qp.connect(&er, 9, &opts).unwrap();
    m.connect(cr, &raw.qp.endpoint(9), &opts).unwrap();
    put(&m, 0, &pattern(1, 20_000));
    m.send(1, cm, 6, 0, 20_000).unwrap();
    let fin = rndv_header(
        &Tmh {
            opcode: TmhOp::Fin as u8,
            app_ctx: 1,
            tag: 6,
        },
        &Rvh::default(),
    );
    raw.buf.write(0, &fin).unwrap();
    raw.qp
        .post_send(&[SendWr::new(1, WrOp::Send, &[raw.mr.sge(0, 32)])])
        .unwrap();
    let mut events = Vec::new();
    for _ in 0..20_000 {
        TagMatcher::progress_all(&mut [&mut m, &mut p]).unwrap();
        events.extend(std::iter::from_fn(|| m.next_event()));
    }
    assert!(events.is_empty(), "{events:?}");
    p.recv(1, 6, u64::MAX, 0, 20_000).unwrap();
    for _ in 0..20_000 {
        TagMatcher::progress_all(&mut [&mut m, &mut p]).unwrap();
        events.extend(std::iter::from_fn(|| m.next_event()));
    }
    assert_eq!(events, vec![TagEvent::Send { id: 1 }]);
    assert_eq!(get(&p, 0, 20_000), pattern(1, 20_000));
}

#[test]
fn one_stalled_connection_delays_no_other() {
    // Connection 0 of the receiver has a full send queue towards a sender that does not
    // look (its READ waits), while connection 1's rendezvous is read and finished at once.
    let cfg = TagConfig {
        staging_slots: 2,
        ..TagConfig::default()
    };
    let mut t = net(3, cfg, FaultPlan::default(), 12);
    put(&t.s[0], 0, &pattern(1, 20_000));
    t.s[0].send(1, 0, 3, 0, 20_000).unwrap();
    put(&t.s[1], 0, &pattern(2, 20_000));
    t.s[1].send(2, 0, 4, 0, 20_000).unwrap();
    run(&mut t, true);
    assert_eq!(t.b.unexpected_len(), 2);
    // Fill the receiver's send queue towards sender 0 (which will not look).
    let mut queued = 0;
    while t.b.send(100 + queued, 0, 50, 0, 8).is_ok() {
        queued += 1;
    }
    t.b.recv(10, 3, u64::MAX, REGION, 20_000).unwrap();
    t.b.recv(11, 4, u64::MAX, 2 * REGION, 20_000).unwrap();
    // Only the receiver and sender 1 progress.
    let mut eb = Vec::new();
    for _ in 0..200_000 {
        TagMatcher::progress_all(&mut [&mut t.b, &mut t.s[1]]).unwrap();
        eb.extend(std::iter::from_fn(|| t.b.next_event()));
        if eb
            .iter()
            .any(|e| matches!(e, TagEvent::Recv { id: 11, .. }))
        {
            break;
        }
    }
    assert!(
        eb.contains(&TagEvent::Recv {
            id: 11,
            tag: 4,
            len: 20_000,
            truncated: false,
            conn: 1
        }),
        "{eb:?}"
    );
    assert!(!eb
        .iter()
        .any(|e| matches!(e, TagEvent::Recv { id: 10, .. })));
    // Sender 0 wakes up: everything on connection 0 completes too.
    let eb = until(&mut t, usize::MAX, |e| {
        e.iter().any(|e| matches!(e, TagEvent::Recv { id: 10, .. }))
    });
    assert!(eb.contains(&TagEvent::Recv {
        id: 10,
        tag: 3,
        len: 20_000,
        truncated: false,
        conn: 0
    }));
    assert_eq!(get(&t.b, REGION, 20_000), pattern(1, 20_000));
}

#[test]
fn a_full_operation_ring_keeps_receives_in_software() {
    // A list-operation ring of two entries: two ADDs fill it; the third receive, though
    // the list has room, stays in software instead of failing. All three complete.
    let cfg = TagConfig {
        hw_tags: 8,
        list_ops: 2,
        ..TagConfig::default()
    };
    let mut t = two(cfg, FaultPlan::default(), 41);
    for i in 0..3u64 {
        t.b.recv(i, i, u64::MAX, i * REGION, 9000).unwrap();
    }
    assert_eq!(t.b.hw_posted(), 2);
    for i in 0..3u64 {
        put(&t.s[0], i * REGION, &pattern(i, 5000));
        t.s[0].send(10 + i, 0, i, i * REGION, 5000).unwrap();
    }
    let (_, eb) = run(&mut t, true);
    assert_eq!(eb.len(), 3, "{eb:?}");
    for i in 0..3u64 {
        assert_eq!(get(&t.b, i * REGION, 5000), pattern(i, 5000));
    }
    assert_eq!(t.b.stats().hw_matched, 2);
}

#[test]
fn completions_of_many_full_send_queues_fit_the_cq() {
    // Twenty connections, each with a full send queue of small sends, all complete before
    // the sender polls once: more than twice what the former fixed 4,096-entry CQ held.
    let cfg = TagConfig {
        staging_slots: 64,
        max_conns: 20,
        ..TagConfig::default()
    };
    let (_fabric, _devs, mut a, mut b) = pair_with_conns(cfg, 51, 20);
    assert!(a.add_conn().is_err(), "beyond max_conns");
    let mut n = 0u64;
    for c in 0..20 {
        while a.send(n, c, n, 0, 8).is_ok() {
            n += 1;
        }
    }
    assert!(n > 8192, "{n}");
    // Only the receiver's software runs until everything has arrived.
    let mut got = 0;
    for _ in 0..5_000_000 {
        if got >= n {
            break;
        }
        b.progress().unwrap();
        assert_eq!(b.next_event(), None, "nothing is posted at the receiver");
        got = b.unexpected_len() as u64;
    }
    assert_eq!(got, n, "arrived");
    let mut sent = 0;
    for _ in 0..5_000_000 {
        if sent >= n {
            break;
        }
        a.progress().unwrap();
        while let Some(e) = a.next_event() {
            assert!(matches!(e, TagEvent::Send { .. }), "{e:?}");
            sent += 1;
        }
    }
    assert_eq!(sent, n, "sends completed");
    assert_eq!(a.next_event(), None);
}
