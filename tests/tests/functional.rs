//! Functional (untimed) mode of the fabric (`FabricConfig::functional`): the same scripts in
//! timed and in functional mode leave the same memory on both nodes and the same completions
//! on every CQ; and the eligibility rules (what goes straight to the peer, what falls back to
//! the packet path) hold.

use proptest::prelude::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use ringbell_specs::cqe::EventType;
use ringbell_tests::*;

/// A's gather source: never written by the NIC.
const SRC: u64 = 0;
/// A's landing zone for READ data and atomic results.
const RES: u64 = 512 * 1024;
/// B's atomic targets.
const ATOM: u64 = 256 * 1024;
/// B's receive buffers, `RECV_LEN` each.
const RECV: u64 = 512 * 1024;
const RECV_LEN: u64 = 16 * 1024;
/// Span of WRITE targets / READ sources in B, and of sources in A.
const SPAN: u64 = 256 * 1024;
const MAX_LEN: u32 = 16 * 1024;

#[derive(Clone, Copy, Debug)]
enum Key {
    Good,
    /// An rkey naming no MR.
    Bad,
    /// Past the end of the MR.
    OutOfBounds,
}

#[derive(Clone, Debug)]
enum Op {
    Write {
        src: u64,
        dst: u64,
        len: u32,
        inline: bool,
        imm: Option<u32>,
        key: Key,
    },
    Send {
        src: u64,
        len: u32,
        inline: bool,
        imm: Option<u32>,
    },
    Read {
        dst: u64,
        src: u64,
        len: u32,
    },
    FetchAdd {
        at: u64,
        add: u64,
    },
    CmpSwap {
        at: u64,
        compare: u64,
        swap: u64,
    },
}

fn len() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..=64, 65u32..=4096, 4097..=MAX_LEN]
}

fn key() -> impl Strategy<Value = Key> {
    prop_oneof![38 => Just(Key::Good), 1 => Just(Key::Bad), 1 => Just(Key::OutOfBounds)]
}

fn op() -> impl Strategy<Value = Op> {
    let imm = proptest::option::of(any::<u32>());
    prop_oneof![
        8 => (0..SPAN - MAX_LEN as u64, 0..SPAN - MAX_LEN as u64, len(), any::<bool>(), imm.clone(), key())
            .prop_map(|(src, dst, len, inline, imm, key)| Op::Write {
                src,
                dst,
                len: if inline { len.min(200) } else { len },
                inline,
                imm,
                key
            }),
        5 => (0..SPAN - MAX_LEN as u64, len(), any::<bool>(), imm)
            .prop_map(|(src, len, inline, imm)| Op::Send {
                src,
                len: if inline { len.min(200) } else { len },
                inline,
                imm
            }),
        1 => (0..SPAN / 2 - MAX_LEN as u64, 0..SPAN - MAX_LEN as u64, len())
            .prop_map(|(dst, src, len)| Op::Read { dst, src, len }),
        1 => (0..512u64, any::<u64>()).prop_map(|(at, add)| Op::FetchAdd { at: at * 8, add }),
        // Targets hold 0xEE.. or what earlier atomics left: compare with that half the time.
        1 => (0..512u64, any::<bool>(), any::<u64>()).prop_map(|(at, hit, swap)| Op::CmpSwap {
            at: at * 8,
            compare: if hit { u64::from_le_bytes([0xEE; 8]) } else { swap ^ 1 },
            swap,
        }),
    ]
}

/// A completion as compared between the modes: (wr_id, status, opcode, byte_len, imm). As
/// in verbs, only wr_id and status are defined for an error completion: a flushed WQE
/// reports its length only if the send engine had started it when the QP failed, which
/// depends on timing, so the other fields are compared for successful completions only.
type Seen = (u64, WcStatus, Option<(String, u32, Option<u32>, bool)>);

fn seen(w: &WorkCompletion) -> Seen {
    let detail = (w.status == WcStatus::Success)
        .then(|| (format!("{:?}", w.opcode), w.byte_len, w.imm, w.solicited));
    (w.wr_id, w.status, detail)
}

struct Outcome {
    mem_a: Vec<u8>,
    mem_b: Vec<u8>,
    cq_a: Vec<Seen>,
    cq_b: Vec<Seen>,
    frames: u64,
}

fn new_fabric(functional: bool) -> Fabric {
    let mut cfg = FabricConfig::new(2, 7);
    cfg.functional = functional;
    Fabric::new(cfg)
}

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Runs `script` (posted in batches of the given sizes, each op signaled or not) on a fresh
/// 2-node fabric and returns what it left.
fn run(script: &[(Op, bool)], batches: &[usize], functional: bool, on_srq: bool) -> Outcome {
    let fabric = new_fabric(functional);
    let mut a = side(&fabric, 0, all());
    let mut b = side(&fabric, 1, all());
    // B's receives come from an SRQ (its QP replaced by one on the SRQ) or from its RQ.
    let mut srq = on_srq.then(|| b.pd.create_srq(256, 1, 0).unwrap());
    if let Some(srq) = &srq {
        let mut init = QpInit::new(&b.cq, &b.cq);
        init.srq = Some(srq);
        b.qp = b.pd.create_qp(&init).unwrap();
    }
    connect(&mut a, &mut b, &ConnectOptions::default());
    for i in 0..BUF {
        a.buf.write(i, &[(i * 7 + 3) as u8]).unwrap();
    }
    b.buf.fill(0, BUF, 0xEE).unwrap();
    // A receive WQE for every message that needs one.
    let needs = script
        .iter()
        .filter(|(o, _)| matches!(o, Op::Send { .. } | Op::Write { imm: Some(_), .. }))
        .count();
    let sgls: Vec<[Sge; 1]> = (0..needs as u64)
        .map(|i| [b.mr.sge(RECV + i * RECV_LEN, RECV_LEN as u32)])
        .collect();
    if !sgls.is_empty() {
        match &mut srq {
            Some(srq) => srq.post_recv(&recv_wrs(&sgls)).unwrap(),
            None => b.qp.post_recv(&recv_wrs(&sgls)).unwrap(),
        }
    }
    let remote = |at: u64, key: Key| match key {
        Key::Good => RemoteAddr {
            addr: b.mr.addr() + at,
            rkey: b.mr.rkey(),
        },
        Key::Bad => RemoteAddr {
            addr: b.mr.addr() + at,
            rkey: b.mr.rkey() ^ 0x4400,
        },
        Key::OutOfBounds => RemoteAddr {
            addr: b.mr.addr() + BUF as u64 - 8,
            rkey: b.mr.rkey(),
        },
    };
    let mut read_srcs: Vec<(u64, u64)> = Vec::new();
    let payload: Vec<u8> = (0..256u32).map(|i| (i * 13 + 1) as u8).collect();
    let mut posted = 0usize;
    let mut sizes = batches.iter().copied().cycle();
    while posted < script.len() {
        let k = sizes.next().unwrap_or(1).max(1).min(script.len() - posted);
        let chunk = &script[posted..posted + k];
        // An odd source offset gathers from two pieces (the second 100 bytes further on).
        let sgls: Vec<Vec<Sge>> = chunk
            .iter()
            .map(|(o, _)| match o {
                Op::Write { src, len, .. } | Op::Send { src, len, .. } if src % 2 == 1 => {
                    let h = *len / 2;
                    vec![
                        a.mr.sge(SRC + src, h),
                        a.mr.sge(SRC + src + h as u64 + 100, *len - h),
                    ]
                }
                Op::Write { src, len, .. } | Op::Send { src, len, .. } => {
                    vec![a.mr.sge(SRC + src, *len)]
                }
                Op::Read { dst, len, .. } => vec![a.mr.sge(RES + dst, *len)],
                Op::FetchAdd { .. } | Op::CmpSwap { .. } => {
                    vec![a.mr.sge(RES + SPAN / 2 + (posted as u64 % 512) * 8, 8)]
                }
            })
            .collect();
        let mut wrs = Vec::new();
        for (i, (o, signaled)) in chunk.iter().enumerate() {
            let id = (posted + i) as u64 + 1;
            let mut flags = if *signaled {
                SendFlags::SIGNALED
            } else {
                SendFlags::empty()
            };
            // Some SENDs and WRITEs ask for a solicited event.
            if let Op::Write { src, .. } | Op::Send { src, .. } = o {
                if src % 3 == 0 {
                    flags |= SendFlags::SOLICITED;
                }
            }
            let fence = |at: u64, len: u64| read_srcs.iter().any(|&(x, y)| at < y && x < at + len);
            let wr = match o {
                Op::Write {
                    src,
                    dst,
                    len,
                    inline,
                    imm,
                    key,
                } => {
                    if fence(*dst, *len as u64) {
                        flags |= SendFlags::FENCE;
                    }
                    let r = remote(*dst, *key);
                    let op = match imm {
                        Some(v) => WrOp::WriteImm(r, *v),
                        None => WrOp::Write(r),
                    };
                    if *inline {
                        let s = (*src % 56) as usize;
                        SendWr::inline(id, op, &payload[s..s + *len as usize])
                    } else {
                        SendWr::new(id, op, &sgls[i])
                    }
                }
                Op::Send {
                    src,
                    len,
                    inline,
                    imm,
                } => {
                    let op = match imm {
                        Some(v) => WrOp::SendImm(*v),
                        None => WrOp::Send,
                    };
                    if *inline {
                        let s = (*src % 56) as usize;
                        SendWr::inline(id, op, &payload[s..s + *len as usize])
                    } else {
                        SendWr::new(id, op, &sgls[i])
                    }
                }
                Op::Read { src, len, .. } => {
                    read_srcs.push((*src, *src + *len as u64));
                    SendWr::new(id, WrOp::Read(remote(*src, Key::Good)), &sgls[i])
                }
                Op::FetchAdd { at, add } => SendWr::new(
                    id,
                    WrOp::FetchAdd {
                        remote: remote(ATOM + at, Key::Good),
                        add: *add,
                    },
                    &sgls[i],
                ),
                Op::CmpSwap { at, compare, swap } => SendWr::new(
                    id,
                    WrOp::CmpSwap {
                        remote: remote(ATOM + at, Key::Good),
                        compare: *compare,
                        swap: *swap,
                    },
                    &sgls[i],
                ),
            };
            wrs.push(wr.flags(flags));
        }
        // A full send queue (or a QP in error) refuses the batch: let work complete first.
        let mut tries = 0;
        loop {
            match a.qp.post_send(&wrs) {
                Ok(()) => break,
                Err(_) if tries < 10_000 && fabric.step() => tries += 1,
                Err(_) => {
                    // The QP is in error and will take nothing more.
                    posted = script.len();
                    break;
                }
            }
        }
        if posted < script.len() {
            posted += k;
        }
        // Interleave some progress with posting.
        fabric.run_until_idle(3);
    }
    let cq_a = drain(&fabric, &mut a.cq).iter().map(seen).collect();
    let cq_b = drain(&fabric, &mut b.cq).iter().map(seen).collect();
    let mut mem_a = vec![0u8; BUF];
    let mut mem_b = vec![0u8; BUF];
    a.buf.read(0, &mut mem_a).unwrap();
    b.buf.read(0, &mut mem_b).unwrap();
    // B's QP goes before the SRQ it takes receives from.
    drop(b);
    drop(srq);
    Outcome {
        mem_a,
        mem_b,
        cq_a,
        cq_b,
        frames: fabric.stats().frames_delivered,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn functional_mode_matches_timed_mode(
        script in proptest::collection::vec((op(), any::<bool>()), 1..40),
        batches in proptest::collection::vec(1usize..8, 1..6),
        on_srq in any::<bool>(),
    ) {
        let timed = run(&script, &batches, false, on_srq);
        let fm = run(&script, &batches, true, on_srq);
        prop_assert_eq!(&timed.cq_a, &fm.cq_a, "completions on A");
        prop_assert_eq!(&timed.cq_b, &fm.cq_b, "completions on B");
        prop_assert!(timed.mem_a == fm.mem_a, "memory of A differs");
        prop_assert!(timed.mem_b == fm.mem_b, "memory of B differs");
        // Without errors, functional mode carries the work with fewer frames, never more.
        // After an error it need not: a message it ran at once can let a later one (say a
        // WRITE fenced behind a READ) go out before the NAK that fails the QP arrives, where
        // the timed run flushed it unsent. Completions and memory agree either way.
        let clean = fm.cq_a.iter().chain(&fm.cq_b).all(|s| s.1 == WcStatus::Success);
        if clean {
            prop_assert!(
                fm.frames <= timed.frames,
                "frames: functional {}, timed {}",
                fm.frames,
                timed.frames
            );
        }
    }
}

/// A connected pair on a fabric in functional mode (or not).
fn fm_pair(functional: bool) -> (Fabric, Side, Side) {
    let fabric = new_fabric(functional);
    let mut a = side(&fabric, 0, all());
    let mut b = side(&fabric, 1, all());
    connect(&mut a, &mut b, &ConnectOptions::default());
    (fabric, a, b)
}

fn write(a: &mut Side, b: &Side, id: u64, at: u64, len: u32) {
    let r = RemoteAddr {
        addr: b.mr.addr() + at,
        rkey: b.mr.rkey(),
    };
    let sge = [a.mr.sge(0, len)];
    a.qp.post_send(&[SendWr::new(id, WrOp::Write(r), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
}

fn ok(fabric: &Fabric, cq: &mut CompletionQueue) {
    let w = wait(fabric, cq, 1);
    assert_eq!(w[0].status, WcStatus::Success, "{w:?}");
}

#[test]
fn eligible_writes_and_sends_take_no_frames() {
    for functional in [false, true] {
        let (fabric, mut a, mut b) = fm_pair(functional);
        let f0 = fabric.stats().frames_delivered;
        a.buf.write(0, b"functional").unwrap();
        write(&mut a, &b, 1, 100, 10);
        ok(&fabric, &mut a.cq);
        let sgl = [[b.mr.sge(4096, 64)]];
        b.qp.post_recv(&recv_wrs(&sgl)).unwrap();
        let sge = [a.mr.sge(0, 10)];
        a.qp.post_send(&[SendWr::new(2, WrOp::SendImm(7), &sge).flags(SendFlags::SIGNALED)])
            .unwrap();
        ok(&fabric, &mut a.cq);
        let w = wait(&fabric, &mut b.cq, 1);
        assert_eq!((w[0].byte_len, w[0].imm), (10, Some(7)));
        let mut got = [0u8; 10];
        b.buf.read(100, &mut got).unwrap();
        assert_eq!(&got, b"functional");
        b.buf.read(4096, &mut got).unwrap();
        assert_eq!(&got, b"functional");
        let frames = fabric.stats().frames_delivered - f0;
        assert_eq!(
            frames == 0,
            functional,
            "{frames} frames, functional {functional}"
        );
    }
}

#[test]
fn reads_and_atomics_go_straight_and_the_psns_stay_in_step() {
    let (fabric, mut a, mut b) = fm_pair(true);
    let pattern: Vec<u8> = (0..5000u32).map(|i| (i * 31 + 7) as u8).collect();
    a.buf.write(0, &pattern).unwrap();
    write(&mut a, &b, 1, 0, 5000);
    ok(&fabric, &mut a.cq);
    // A two-packet READ of what the WRITE left: no frames, the bytes back in A.
    let r = RemoteAddr {
        addr: b.mr.addr(),
        rkey: b.mr.rkey(),
    };
    let sge = [a.mr.sge(8192, 5000)];
    a.qp.post_send(&[SendWr::new(2, WrOp::Read(r), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    let w = wait(&fabric, &mut a.cq, 1);
    assert_eq!((w[0].status, w[0].byte_len), (WcStatus::Success, 5000));
    let mut y = vec![0u8; 5000];
    a.buf.read(8192, &mut y).unwrap();
    assert_eq!(y, pattern);
    // Fetch-and-add, then a compare-and-swap that hits and one that misses.
    b.buf.write(65536, &40u64.to_le_bytes()).unwrap();
    let at = RemoteAddr {
        addr: b.mr.addr() + 65536,
        rkey: b.mr.rkey(),
    };
    let res = [a.mr.sge(16384, 8)];
    let ops = [
        WrOp::FetchAdd { remote: at, add: 2 },
        WrOp::CmpSwap {
            remote: at,
            compare: 42,
            swap: 7,
        },
        WrOp::CmpSwap {
            remote: at,
            compare: 42,
            swap: 9,
        },
    ];
    let mut origs = Vec::new();
    for (i, op) in ops.into_iter().enumerate() {
        a.qp.post_send(&[SendWr::new(3 + i as u64, op, &res).flags(SendFlags::SIGNALED)])
            .unwrap();
        ok(&fabric, &mut a.cq);
        origs.push(a.buf.read_u64(16384).unwrap());
    }
    assert_eq!(origs, [40, 42, 7]);
    assert_eq!(b.buf.read_u64(65536).unwrap(), 7);
    assert_eq!(fabric.stats().frames_delivered, 0);
    // A SEND with no receive posted takes the packet path (RNR, then retried); the PSNs
    // the functional messages used keep both sides in step, so it and the next READ work.
    let sge = [a.mr.sge(0, 16)];
    a.qp.post_send(&[SendWr::new(6, WrOp::Send, &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    fabric.run_until_idle(200);
    let after_send = fabric.stats().frames_delivered;
    assert!(after_send > 0);
    let sgl = [[b.mr.sge(32768, 64)]];
    b.qp.post_recv(&recv_wrs(&sgl)).unwrap();
    ok(&fabric, &mut a.cq);
    ok(&fabric, &mut b.cq);
    settle(&fabric);
    let after_send = fabric.stats().frames_delivered.max(after_send);
    let sge = [a.mr.sge(20000, 100)];
    a.qp.post_send(&[SendWr::new(7, WrOp::Read(r), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    ok(&fabric, &mut a.cq);
    settle(&fabric);
    assert_eq!(fabric.stats().frames_delivered, after_send);
    let mut z = vec![0u8; 100];
    a.buf.read(20000, &mut z).unwrap();
    assert_eq!(z, pattern[..100]);
}

/// A READ or an atomic the packet path would refuse (a key that is not the responder's,
/// bytes beyond its MR) is reported by the packet path, as in timed mode.
#[test]
fn refused_reads_and_atomics_take_the_packet_path() {
    let (fabric, mut a, b) = fm_pair(true);
    let r = RemoteAddr {
        addr: b.mr.addr() + 8,
        rkey: b.mr.rkey() ^ 0x4400,
    };
    let res = [a.mr.sge(0, 8)];
    a.qp.post_send(&[
        SendWr::new(1, WrOp::FetchAdd { remote: r, add: 1 }, &res).flags(SendFlags::SIGNALED)
    ])
    .unwrap();
    let w = wait(&fabric, &mut a.cq, 1);
    assert_eq!(w[0].status, WcStatus::RemAccessErr);
    assert!(fabric.stats().frames_delivered > 0);

    // A READ that runs past the end of the responder's MR: the packet path's NAK.
    let (fabric, mut a, b) = fm_pair(true);
    let r = RemoteAddr {
        addr: b.mr.addr() + BUF as u64 - 4,
        rkey: b.mr.rkey(),
    };
    let sge = [a.mr.sge(0, 8)];
    a.qp.post_send(&[SendWr::new(1, WrOp::Read(r), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    let w = wait(&fabric, &mut a.cq, 1);
    assert_eq!(w[0].status, WcStatus::RemAccessErr);
    assert!(fabric.stats().frames_delivered > 0);
}

#[test]
fn refused_messages_take_the_packet_path() {
    // No receive WQE: the SEND goes as packets (RNR NAK, then retried once one is posted).
    let (fabric, mut a, mut b) = fm_pair(true);
    let sge = [a.mr.sge(0, 16)];
    a.qp.post_send(&[SendWr::new(1, WrOp::Send, &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    fabric.run_until_idle(200);
    assert!(fabric.stats().frames_delivered > 0);
    let sgl = [[b.mr.sge(0, 64)]];
    b.qp.post_recv(&recv_wrs(&sgl)).unwrap();
    ok(&fabric, &mut a.cq);
    ok(&fabric, &mut b.cq);

    // A bad rkey: the packet path reports it (NAK, remote access error).
    let (fabric, mut a, b) = fm_pair(true);
    let r = RemoteAddr {
        addr: b.mr.addr(),
        rkey: b.mr.rkey() ^ 0x4400,
    };
    let sge = [a.mr.sge(0, 8)];
    a.qp.post_send(&[SendWr::new(1, WrOp::Write(r), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    let w = wait(&fabric, &mut a.cq, 1);
    assert_eq!(w[0].status, WcStatus::RemAccessErr);
    assert!(fabric.stats().frames_delivered >= 2);
}

#[test]
fn counters_faults_tm_srqs_and_mtu_mismatch_are_not_eligible() {
    // A responder QP on a plain SRQ: WRITEs and SENDs go straight, the SEND into the
    // SRQ's receive (and the SRQ's limit event fires as the packet path would fire it).
    let fabric = new_fabric(true);
    let mut a = side(&fabric, 0, all());
    let dev = Device::open(Box::new(fabric.port(1))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(BUF).unwrap();
    let mr = pd.reg_mr(&buf, all()).unwrap();
    let cq = dev.create_cq(64).unwrap();
    let mut srq = pd.create_srq(16, 1, 0).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.srq = Some(&srq);
    let mut qb = pd.create_qp(&init).unwrap();
    let (ea, eb) = (a.qp.endpoint(1), qb.endpoint(2));
    a.qp.connect(&eb, 1, &ConnectOptions::default()).unwrap();
    qb.connect(&ea, 2, &ConnectOptions::default()).unwrap();
    settle(&fabric);
    let f0 = fabric.stats().frames_delivered;
    let r = RemoteAddr {
        addr: mr.addr(),
        rkey: mr.rkey(),
    };
    let sge = [a.mr.sge(0, 8)];
    a.qp.post_send(&[SendWr::new(1, WrOp::Write(r), &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    ok(&fabric, &mut a.cq);
    assert_eq!(fabric.stats().frames_delivered, f0);
    let sgl = [[mr.sge(0, 64)], [mr.sge(64, 64)]];
    srq.post_recv(&recv_wrs(&sgl)).unwrap();
    srq.arm(2).unwrap();
    a.buf.write(0, b"to the srq").unwrap();
    let sge = [a.mr.sge(0, 10)];
    a.qp.post_send(&[SendWr::new(2, WrOp::Send, &sge).flags(SendFlags::SIGNALED)])
        .unwrap();
    ok(&fabric, &mut a.cq);
    let mut cq = cq;
    let w = wait(&fabric, &mut cq, 1);
    assert_eq!((w[0].status, w[0].byte_len), (WcStatus::Success, 10));
    let mut got = [0u8; 10];
    buf.read(0, &mut got).unwrap();
    assert_eq!(&got, b"to the srq");
    assert_eq!(fabric.stats().frames_delivered, f0);
    let ev = std::iter::from_fn(|| dev.poll_event()).find(|e| e.kind == EventType::SrqLimit);
    assert!(
        ev.is_some_and(|e| e.obj == srq.srqn() && e.info == 1),
        "{ev:?}"
    );
    drop(qb);

    // A counter bound to the requester QP.
    let (fabric, mut a, b) = fm_pair(true);
    let c = a.pd.create_counter().unwrap();
    c.bind_qp(&a.qp, CntrEvents::WRITE).unwrap();
    settle(&fabric);
    let f0 = fabric.stats().frames_delivered;
    write(&mut a, &b, 1, 0, 8);
    ok(&fabric, &mut a.cq);
    assert!(fabric.stats().frames_delivered > f0);

    // A fault plan on the fabric (even one that never fires).
    let (fabric, mut a, b) = fm_pair(true);
    fabric.set_faults(FaultPlan {
        links: LinkFaults {
            drop_ppm: 1,
            ..Default::default()
        },
        ..Default::default()
    });
    write(&mut a, &b, 1, 0, 8);
    ok(&fabric, &mut a.cq);
    assert!(fabric.stats().frames_delivered > 0);

    // Path MTUs that differ: a multi-packet message is refused (the packet path fails it).
    let fabric = new_fabric(true);
    let mut a = side(&fabric, 0, all());
    let mut b = side(&fabric, 1, all());
    let (ea, eb) = (a.qp.endpoint(1), b.qp.endpoint(2));
    a.qp.connect(&eb, 1, &ConnectOptions::default()).unwrap();
    let small = ConnectOptions {
        path_mtu: 3,
        ..Default::default()
    };
    b.qp.connect(&ea, 2, &small).unwrap();
    settle(&fabric);
    // One packet at either MTU: taken.
    write(&mut a, &b, 1, 0, 1000);
    ok(&fabric, &mut a.cq);
    assert_eq!(fabric.stats().frames_delivered, 0);
    write(&mut a, &b, 2, 0, 3000);
    let w = wait(&fabric, &mut a.cq, 1);
    assert_ne!(w[0].status, WcStatus::Success);
    assert!(fabric.stats().frames_delivered > 0);
}

/// One memory file mapped by both nodes (two IOMMU mappings of the same pages): a WRITE
/// whose source and destination overlap in that file lands what the source held when it
/// was sent, as on the packet path, in whichever direction the two overlap.
#[test]
fn a_write_between_two_mappings_of_one_file_copies_the_source_as_sent() {
    const LEN: u32 = 64 * 1024;
    const IOVA: u64 = 1 << 40;
    // (source offset, destination offset) in the shared file.
    for (src, dst) in [(0u64, 64u64), (64, 0), (0, 4096), (4096 + 8, 4096)] {
        for functional in [false, true] {
            let (fabric, mut a, b) = fm_pair(functional);
            let mem = DmaMemory::new(4 * LEN as usize).unwrap();
            let len = mem.len() as u64;
            a.dev.port().dma_map(mem.fd().unwrap(), len, IOVA).unwrap();
            b.dev.port().dma_map(mem.fd().unwrap(), len, IOVA).unwrap();
            let mr_a = a.pd.reg_mr_raw(IOVA, len, IOVA, all()).unwrap();
            let mr_b = b.pd.reg_mr_raw(IOVA, len, IOVA, all()).unwrap();
            let pattern: Vec<u8> = (0..len as usize)
                .map(|i| (i * 31 + i / 251) as u8)
                .collect();
            mem.write(0, &pattern).unwrap();
            let r = RemoteAddr {
                addr: mr_b.addr() + dst,
                rkey: mr_b.rkey(),
            };
            let sge = [mr_a.sge(src, LEN)];
            a.qp.post_send(&[SendWr::new(1, WrOp::Write(r), &sge).flags(SendFlags::SIGNALED)])
                .unwrap();
            ok(&fabric, &mut a.cq);
            settle(&fabric);
            let mut out = vec![0u8; len as usize];
            mem.read(0, &mut out).unwrap();
            let mut want = pattern.clone();
            want[dst as usize..(dst + LEN as u64) as usize]
                .copy_from_slice(&pattern[src as usize..(src + LEN as u64) as usize]);
            assert!(out == want, "src {src} dst {dst} functional {functional}");
        }
    }
}

#[test]
fn mr_counters_count_functional_writes_and_a_dead_responder_refuses() {
    // A counter bound to the responder's MR counts functional WRITEs (zero-length too).
    let (fabric, mut a, mut b) = fm_pair(true);
    let c = b.pd.create_counter().unwrap();
    c.bind_mr(&b.mr, CntrEvents::REMOTE_WRITE).unwrap();
    settle(&fabric);
    write(&mut a, &b, 1, 0, 64);
    write(&mut a, &b, 2, 64, 0);
    ok(&fabric, &mut a.cq);
    ok(&fabric, &mut a.cq);
    settle(&fabric);
    assert_eq!(c.query().unwrap().success, 2);
    assert_eq!(fabric.stats().frames_delivered, 0);
    // The responder QP in ERR: the WRITE goes as packets and fails.
    b.qp.to_error().unwrap();
    settle(&fabric);
    write(&mut a, &b, 3, 0, 64);
    let w = wait(&fabric, &mut a.cq, 1);
    assert_ne!(w[0].status, WcStatus::Success);
}
