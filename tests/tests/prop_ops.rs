//! Property test: random mixes of RC operations against a plain reference model of both
//! nodes' memory. Every signaled operation completes exactly once, in post order, and both
//! memories end up exactly as the reference model says.

use proptest::prelude::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use ringbell_tests::*;

/// A's gather source: never written by the NIC.
const SRC: u64 = 0;
/// A's landing zone for READ data and atomic results.
const RES: u64 = 512 * 1024;
/// B's receive buffers for SENDs.
const RECV: u64 = 768 * 1024;
/// Span of random offsets.
const SPAN: u64 = 256 * 1024;

#[derive(Clone, Debug)]
enum Op {
    Write {
        src: u64,
        dst: u64,
        len: u32,
        inline: bool,
    },
    Read {
        dst: u64,
        src: u64,
        len: u32,
    },
    Send {
        src: u64,
        len: u32,
    },
    FetchAdd {
        at: u64,
        add: u64,
    },
    CmpSwap {
        at: u64,
        hit: bool,
        swap: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![0u32..64, 64u32..5000, 5000u32..40_000];
    prop_oneof![
        (
            0..SPAN - 40_000,
            0..SPAN - 40_000,
            len.clone(),
            any::<bool>()
        )
            .prop_map(|(src, dst, len, inline)| Op::Write {
                src,
                dst,
                len: if inline { len.min(200) } else { len },
                inline
            }),
        (0..SPAN / 2 - 40_000, 0..SPAN - 40_000, len.clone())
            .prop_map(|(dst, src, len)| Op::Read { dst, src, len }),
        (0..SPAN - 40_000, len).prop_map(|(src, len)| Op::Send { src, len }),
        (0..SPAN / 8, any::<u64>()).prop_map(|(at, add)| Op::FetchAdd { at: at * 8, add }),
        (0..SPAN / 8, any::<bool>(), any::<u64>()).prop_map(|(at, hit, swap)| Op::CmpSwap {
            at: at * 8,
            hit,
            swap
        }),
    ]
}

/// SIGNALED, plus FENCE when `[at, at + len)` overlaps the source of an earlier READ.
fn fenced(read_srcs: &[(u64, u64)], at: u64, len: u64) -> SendFlags {
    if read_srcs.iter().any(|&(a, b)| at < b && a < at + len) {
        SendFlags::SIGNALED | SendFlags::FENCE
    } else {
        SendFlags::SIGNALED
    }
}

fn run(mtu: u8, seed: u64, ops: &[Op], fill: u8, faults: FaultPlan) {
    let mut cfg = FabricConfig::new(2, seed);
    cfg.faults = faults;
    let fabric = Fabric::new(cfg);
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let mut a = side(&fabric, 0, all);
    let mut b = side(&fabric, 1, all);
    // A short ACK timeout (1 ms) keeps lossy runs short in simulated time.
    connect(
        &mut a,
        &mut b,
        &ConnectOptions {
            path_mtu: mtu,
            timeout: 8,
            ..Default::default()
        },
    );
    let mut p = Pair { a, b, fabric };
    // Distinct, position-dependent contents so misplaced bytes show.
    let a_init: Vec<u8> = (0..BUF)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2654435761)
                .rotate_left(fill as u32 % 32) as u8
        })
        .collect();
    let b_init: Vec<u8> = (0..BUF)
        .map(|i| {
            (i as u32 ^ 0x5a5a)
                .wrapping_mul(40503)
                .wrapping_add(fill as u32) as u8
        })
        .collect();
    p.a.buf.write(0, &a_init).unwrap();
    p.b.buf.write(0, &b_init).unwrap();
    let (mut ra, mut rb) = (a_init, b_init);
    let remote = |off: u64| RemoteAddr {
        addr: p.b.mr.addr() + off,
        rkey: p.b.mr.rkey(),
    };
    let mut res_next = RES + SPAN / 2; // atomic results go above READ destinations
    let mut recv_next = RECV;
    let mut expected = Vec::new();
    // Source ranges of the READs posted so far. RC lets a READ's responses carry data written
    // by a WRITE or atomic posted after it unless that request is fenced: like a correct
    // application, the test fences a request that overlaps an earlier READ.
    let mut read_srcs: Vec<(u64, u64)> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let id = i as u64;
        let sge;
        let wr = match *op {
            Op::Write {
                src,
                dst,
                len,
                inline,
            } => {
                let (s, d) = (src as usize, dst as usize);
                rb[d..d + len as usize]
                    .copy_from_slice(&ra[SRC as usize + s..SRC as usize + s + len as usize]);
                let fence = if read_srcs
                    .iter()
                    .any(|&(a, b)| dst < b && a < dst + len as u64)
                {
                    SendFlags::SIGNALED | SendFlags::FENCE
                } else {
                    SendFlags::SIGNALED
                };
                if inline {
                    let data = ra[s..s + len as usize].to_vec();
                    let wr_op = WrOp::Write(remote(dst));
                    p.a.qp
                        .post_send(&[SendWr::inline(id, wr_op, &data).flags(fence)])
                        .unwrap();
                    expected.push((id, WcOpcode::RdmaWrite));
                    continue;
                }
                sge = [p.a.mr.sge(SRC + src, len)];
                SendWr::new(id, WrOp::Write(remote(dst)), &sge).flags(fence)
            }
            Op::Read { dst, src, len } => {
                let (s, d) = (src as usize, (RES + dst) as usize);
                ra[d..d + len as usize].copy_from_slice(&rb[s..s + len as usize]);
                read_srcs.push((src, src + len as u64));
                sge = [p.a.mr.sge(RES + dst, len)];
                SendWr::new(id, WrOp::Read(remote(src)), &sge)
            }
            Op::Send { src, len } => {
                // Receives go one after the other through B's receive zone and start again
                // at its beginning when the next would not fit (messages land in order on
                // one QP, as the model copies them; nothing else touches the zone).
                if recv_next + len as u64 > BUF as u64 {
                    recv_next = RECV;
                }
                let d = recv_next as usize;
                rb[d..d + len as usize]
                    .copy_from_slice(&ra[src as usize..(src + len as u64) as usize]);
                let rs = [p.b.mr.sge(recv_next, len)];
                p.b.qp
                    .post_recv(&[RecvWr {
                        wr_id: 1000 + id,
                        sgl: &rs,
                    }])
                    .unwrap();
                recv_next += len as u64;
                sge = [p.a.mr.sge(SRC + src, len)];
                SendWr::new(id, WrOp::Send, &sge)
            }
            Op::FetchAdd { at, add } => {
                let a = at as usize;
                let old = u64::from_le_bytes(rb[a..a + 8].try_into().unwrap());
                rb[a..a + 8].copy_from_slice(&old.wrapping_add(add).to_le_bytes());
                ra[res_next as usize..res_next as usize + 8].copy_from_slice(&old.to_le_bytes());
                sge = [p.a.mr.sge(res_next, 8)];
                res_next += 8;
                SendWr::new(
                    id,
                    WrOp::FetchAdd {
                        remote: remote(at),
                        add,
                    },
                    &sge,
                )
                .flags(fenced(&read_srcs, at, 8))
            }
            Op::CmpSwap { at, hit, swap } => {
                let a = at as usize;
                let old = u64::from_le_bytes(rb[a..a + 8].try_into().unwrap());
                let compare = if hit { old } else { old ^ 1 };
                if hit {
                    rb[a..a + 8].copy_from_slice(&swap.to_le_bytes());
                }
                ra[res_next as usize..res_next as usize + 8].copy_from_slice(&old.to_le_bytes());
                sge = [p.a.mr.sge(res_next, 8)];
                res_next += 8;
                SendWr::new(
                    id,
                    WrOp::CmpSwap {
                        remote: remote(at),
                        compare,
                        swap,
                    },
                    &sge,
                )
                .flags(fenced(&read_srcs, at, 8))
            }
        };
        let opcode = match op {
            Op::Write { .. } => WcOpcode::RdmaWrite,
            Op::Read { .. } => WcOpcode::RdmaRead,
            Op::Send { .. } => WcOpcode::Send,
            Op::FetchAdd { .. } => WcOpcode::FetchAdd,
            Op::CmpSwap { .. } => WcOpcode::CompSwap,
        };
        expected.push((id, opcode));
        p.a.qp.post_send(&[wr]).unwrap();
        // Reap as we go so the send queue never fills.
        if p.a.qp.sq_free() < 16 {
            let done = wait(&p.fabric, &mut p.a.cq, 1);
            assert_eq!(done[0].status, WcStatus::Success);
            expected.retain(|e| e.0 != done[0].wr_id);
            // Earlier WQEs completed before it in order.
            assert!(
                expected.iter().all(|e| e.0 > done[0].wr_id),
                "out of order completion"
            );
        }
    }
    let wc = wait(&p.fabric, &mut p.a.cq, expected.len());
    let got: Vec<_> = wc.iter().map(|w| (w.wr_id, w.opcode)).collect();
    assert_eq!(
        got, expected,
        "every operation completes once, in post order"
    );
    assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    let sends = ops.iter().filter(|o| matches!(o, Op::Send { .. })).count();
    let rwc = wait(&p.fabric, &mut p.b.cq, sends);
    assert!(rwc
        .iter()
        .all(|w| w.status == WcStatus::Success && w.opcode == WcOpcode::Recv));
    assert!(
        drain(&p.fabric, &mut p.a.cq).is_empty() && drain(&p.fabric, &mut p.b.cq).is_empty(),
        "no extra completions"
    );
    let mut ma = vec![0u8; BUF];
    let mut mb = vec![0u8; BUF];
    p.a.buf.read(0, &mut ma).unwrap();
    p.b.buf.read(0, &mut mb).unwrap();
    assert!(ma == ra, "node A memory differs from the reference model");
    assert!(mb == rb, "node B memory differs from the reference model");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn random_operation_mixes_match_the_reference_model(
        mtu in 1u8..=5,
        seed in any::<u64>(),
        fill in any::<u8>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        run(mtu, seed, &ops, fill, FaultPlan::default());
    }

    /// The same under random faults drawn from `seed` (printed with any failure, it replays
    /// the run exactly): loss, duplication, reordering and corruption on both links.
    #[test]
    fn random_operation_mixes_survive_random_faults(
        mtu in 1u8..=5,
        seed in any::<u64>(),
        fill in any::<u8>(),
        drop in 0u32..30_000,
        duplicate in 0u32..10_000,
        reorder in 0u32..10_000,
        corrupt in 0u32..10_000,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let links = LinkFaults {
            drop_ppm: drop,
            duplicate_ppm: duplicate,
            reorder_ppm: reorder,
            reorder_delay: ringbell_specs::SimTime(3_000_000),
            corrupt_ppm: corrupt,
            down: Vec::new(),
        };
        run(mtu, seed, &ops, fill, FaultPlan { links, ..Default::default() });
    }
}
