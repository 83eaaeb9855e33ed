//! Property test: several QPs between two nodes under random faults, with messages up to
//! 1 MiB. Every operation completes exactly once, in post order per QP, with the right data;
//! no SEND is delivered twice; every FETCH_ADD from every QP is applied exactly once (the
//! counter ends at the sum).

use proptest::prelude::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use ringbell_tests::*;

const MIB: u64 = 1 << 20;
/// Per-QP space in each buffer.
const REGION: u64 = 2 * MIB;
/// B's read-only source of READs, after the QP regions.
const READ_SRC: u64 = 6 * MIB;
/// B's shared FETCH_ADD counter.
const COUNTER: u64 = 8 * MIB - 8;

#[derive(Clone, Debug)]
enum Op {
    Write(u32),
    Read(u32),
    Send(u32),
    FetchAdd(u64),
}

fn size() -> impl Strategy<Value = u32> {
    prop_oneof![8 => 0u32..256, 4 => 256u32..16_384, 1 => 131_072u32..=1_048_576]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        size().prop_map(Op::Write),
        size().prop_map(Op::Read),
        size().prop_map(Op::Send),
        any::<u32>().prop_map(|v| Op::FetchAdd(v as u64 | 1)),
    ]
}

fn fill(i: u64, salt: u64) -> u8 {
    (i.wrapping_mul(0x9E37_79B9).wrapping_add(salt) >> 7) as u8
}

fn run(seed: u64, per_qp: Vec<Vec<Op>>, links: LinkFaults) {
    let mut cfg = FabricConfig::new(2, seed);
    cfg.faults = FaultPlan {
        links,
        ..Default::default()
    };
    let fabric = Fabric::new(cfg);
    let all =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let (da, db) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    let (pa, pb) = (da.alloc_pd().unwrap(), db.alloc_pd().unwrap());
    let (ba, bb) = (
        da.alloc_dma(8 * MIB as usize).unwrap(),
        db.alloc_dma(8 * MIB as usize).unwrap(),
    );
    let (ma, mb) = (pa.reg_mr(&ba, all).unwrap(), pb.reg_mr(&bb, all).unwrap());
    let src: Vec<u8> = (0..8 * MIB).map(|i| fill(i, seed)).collect();
    ba.write(0, &src).unwrap();
    bb.write(0, &src).unwrap();
    bb.write(COUNTER as usize, &0u64.to_le_bytes()).unwrap();
    let (mut ca, mut cb) = (da.create_cq(4096).unwrap(), db.create_cq(4096).unwrap());
    let o = ConnectOptions {
        timeout: 8,
        ..Default::default()
    };
    let mut qps = Vec::new();
    for q in 0..per_qp.len() {
        let mut init = QpInit::new(&ca, &ca);
        init.max_send_wr = 64;
        let mut a = pa.create_qp(&init).unwrap();
        let mut init = QpInit::new(&cb, &cb);
        init.max_recv_wr = 64;
        let mut b = pb.create_qp(&init).unwrap();
        let (psa, psb) = (q as u32 * 1000 + 7, 0x00FF_FF00 + q as u32);
        a.connect(&b.endpoint(psb), psa, &o).unwrap();
        b.connect(&a.endpoint(psa), psb, &o).unwrap();
        qps.push((a, b));
    }
    // Post everything, checking afterwards; each QP works in its own region of each buffer.
    let mut expect_a: Vec<Vec<(u64, WcOpcode)>> = vec![Vec::new(); qps.len()];
    let mut expect_recv: Vec<Vec<(u64, u32, u64)>> = vec![Vec::new(); qps.len()];
    let mut writes = Vec::new(); // (B offset, A offset, len)
    let mut reads = Vec::new(); // (A offset, B offset, len)
    let mut adds = 0u64;
    let mut results = Vec::new(); // A offsets of FETCH_ADD results
    for (q, ops) in per_qp.iter().enumerate() {
        let base = q as u64 * REGION;
        let mut next = base;
        let mut recv_next = base + MIB;
        for (i, op) in ops.iter().enumerate() {
            let id = i as u64;
            let (a, b) = &mut qps[q];
            let mut take = |len: u32| {
                let at = next;
                next += (len as u64).max(8).next_multiple_of(8);
                (at, next <= base + MIB)
            };
            match *op {
                Op::Write(len) => {
                    let (at, fits) = take(len);
                    if !fits {
                        continue;
                    }
                    let sgl = [ma.sge(at, len)];
                    let wr = SendWr::new(
                        id,
                        WrOp::Write(RemoteAddr {
                            addr: mb.addr() + at,
                            rkey: mb.rkey(),
                        }),
                        &sgl,
                    );
                    a.post_send(&[wr]).unwrap();
                    writes.push((at, at, len));
                    expect_a[q].push((id, WcOpcode::RdmaWrite));
                }
                Op::Read(len) => {
                    let (at, fits) = take(len);
                    if !fits {
                        continue;
                    }
                    let from = READ_SRC + (i as u64 * 4096) % MIB;
                    let from = from.min(8 * MIB - 8 - len as u64);
                    let sgl = [ma.sge(at, len)];
                    let wr = SendWr::new(
                        id,
                        WrOp::Read(RemoteAddr {
                            addr: mb.addr() + from,
                            rkey: mb.rkey(),
                        }),
                        &sgl,
                    );
                    a.post_send(&[wr]).unwrap();
                    reads.push((at, from, len));
                    expect_a[q].push((id, WcOpcode::RdmaRead));
                }
                Op::Send(len) => {
                    let at = recv_next;
                    recv_next += (len as u64).max(8).next_multiple_of(8);
                    if recv_next > base + REGION {
                        continue;
                    }
                    b.post_recv(&[RecvWr {
                        wr_id: 1000 + id,
                        sgl: &[mb.sge(at, len)],
                    }])
                    .unwrap();
                    // Gathered from A's read-only upper area (nothing lands there).
                    let s = READ_SRC + (i as u64 * 977) % MIB;
                    a.post_send(&[SendWr::new(id, WrOp::Send, &[ma.sge(s, len)])])
                        .unwrap();
                    expect_recv[q].push((1000 + id, len, at));
                    writes.push((at, s, len));
                    expect_a[q].push((id, WcOpcode::Send));
                }
                Op::FetchAdd(v) => {
                    let (at, fits) = take(8);
                    if !fits {
                        // Past the QP's region: the result would land in another QP's.
                        continue;
                    }
                    let sgl = [ma.sge(at, 8)];
                    let remote = RemoteAddr {
                        addr: mb.addr() + COUNTER,
                        rkey: mb.rkey(),
                    };
                    let wr = SendWr::new(id, WrOp::FetchAdd { remote, add: v }, &sgl);
                    a.post_send(&[wr]).unwrap();
                    adds = adds.wrapping_add(v);
                    results.push((at, v));
                    expect_a[q].push((id, WcOpcode::FetchAdd));
                }
            }
        }
    }
    let total: usize = expect_a.iter().map(Vec::len).sum();
    let wc = wait(&fabric, &mut ca, total);
    for (q, (a, _)) in qps.iter().enumerate() {
        let got: Vec<_> = wc
            .iter()
            .filter(|w| w.qpn == a.qpn())
            .map(|w| (w.wr_id, w.opcode))
            .collect();
        assert_eq!(got, expect_a[q], "QP {q}: exactly once, in post order");
    }
    assert!(
        wc.iter().all(|w| w.status == WcStatus::Success),
        "{:?}",
        wc.iter().find(|w| w.status != WcStatus::Success)
    );
    let recvs: usize = expect_recv.iter().map(Vec::len).sum();
    let rwc = wait(&fabric, &mut cb, recvs);
    for (q, (_, b)) in qps.iter().enumerate() {
        let got: Vec<_> = rwc
            .iter()
            .filter(|w| w.qpn == b.qpn())
            .map(|w| (w.wr_id, w.byte_len))
            .collect();
        let want: Vec<_> = expect_recv[q]
            .iter()
            .map(|&(id, len, _)| (id, len))
            .collect();
        assert_eq!(got, want, "QP {q}: every SEND delivered once, in order");
    }
    assert!(
        drain(&fabric, &mut ca).is_empty() && drain(&fabric, &mut cb).is_empty(),
        "no extra completions"
    );
    for &(dst, s, len) in &writes {
        let mut got = vec![0u8; len as usize];
        bb.read(dst as usize, &mut got).unwrap();
        assert!(
            got[..] == src[s as usize..(s + len as u64) as usize],
            "data at B {dst:#x}"
        );
    }
    for &(dst, from, len) in &reads {
        let mut got = vec![0u8; len as usize];
        ba.read(dst as usize, &mut got).unwrap();
        assert!(
            got[..] == src[from as usize..(from + len as u64) as usize],
            "READ into A {dst:#x}"
        );
    }
    assert_eq!(
        bb.read_u64(COUNTER as usize).unwrap(),
        adds,
        "every FETCH_ADD applied exactly once"
    );
    let mut origs: Vec<u64> = results
        .iter()
        .map(|&(at, _)| ba.read_u64(at as usize).unwrap())
        .collect();
    origs.sort();
    origs.dedup();
    // The adds are never 0, so the counter only grows: every FETCH_ADD saw a value of its own.
    assert_eq!(
        origs.len(),
        results.len(),
        "two FETCH_ADDs returned the same original value"
    );
    drop(qps);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn several_qps_large_messages_random_faults(
        seed in any::<u64>(),
        per_qp in proptest::collection::vec(proptest::collection::vec(op(), 1..16), 2..=3),
        drop in 0u32..20_000,
        duplicate in 0u32..5_000,
        reorder in 0u32..5_000,
        corrupt in 0u32..5_000,
    ) {
        let links = LinkFaults {
            drop_ppm: drop,
            duplicate_ppm: duplicate,
            reorder_ppm: reorder,
            reorder_delay: ringbell_specs::SimTime(3_000_000),
            corrupt_ppm: corrupt,
            down: Vec::new(),
        };
        run(seed, per_qp, links);
    }
}
