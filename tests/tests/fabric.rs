//! Fabric-level behaviour: many nodes, switch contention, determinism.

use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_tests::*;

fn all() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Node i writes a tagged block into node i+1 (mod N); every write lands and completes.
fn ring_of_writes(n: usize, seed: u64) -> (Fabric, u64) {
    let fabric = Fabric::new(FabricConfig::new(n, seed));
    // Each node needs two QPs: one towards the next node, one from the previous.
    let mut out: Vec<Side> = (0..n).map(|i| side(&fabric, i, all())).collect();
    let mut inn: Vec<QueuePair> = out
        .iter()
        .map(|s| {
            let mut init = QpInit::new(&s.cq, &s.cq);
            init.max_inline = 0;
            s.pd.create_qp(&init).unwrap()
        })
        .collect();
    let o = ConnectOptions::default();
    for (i, s) in out.iter_mut().enumerate() {
        let j = (i + 1) % n;
        let (e_out, e_in) = (s.qp.endpoint(i as u32), inn[j].endpoint(j as u32 * 7));
        s.qp.connect(&e_in, i as u32, &o).unwrap();
        inn[j].connect(&e_out, j as u32 * 7, &o).unwrap();
    }
    for (i, s) in out.iter().enumerate() {
        s.buf.write(0, &vec![i as u8 + 1; 5000]).unwrap();
    }
    // Each node writes into its neighbour's buffer at offset 8192 with the neighbour's rkey.
    for i in 0..n {
        let j = (i + 1) % n;
        let remote = RemoteAddr {
            addr: out[j].mr.addr() + 8192,
            rkey: out[j].mr.rkey(),
        };
        let sge = [out[i].mr.sge(0, 5000)];
        out[i]
            .qp
            .post_send(&[SendWr::new(i as u64, WrOp::Write(remote), &sge)])
            .unwrap();
    }
    for (i, s) in out.iter_mut().enumerate() {
        let wc = wait(&fabric, &mut s.cq, 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (i as u64, WcStatus::Success));
    }
    settle(&fabric);
    for (j, s) in out.iter().enumerate() {
        let from = (j + n - 1) % n;
        let mut got = vec![0u8; 5000];
        s.buf.read(8192, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == from as u8 + 1), "node {j}");
    }
    inn.clear();
    (fabric.clone(), fabric.trace_digest())
}

#[test]
fn sixty_four_nodes_on_one_switch() {
    let (f, d1) = ring_of_writes(64, 11);
    assert_eq!(f.nodes(), 64);
    let (_, d2) = ring_of_writes(64, 11);
    assert_eq!(d1, d2, "same seed, same trace");
}

#[test]
fn incast_serializes_on_the_switch_egress_port() {
    let n = 9;
    let fabric = Fabric::new(FabricConfig::new(n, 2));
    let mut sink = side(&fabric, 0, all());
    let mut qps = Vec::new();
    let mut senders = Vec::new();
    let o = ConnectOptions::default();
    for i in 1..n {
        let mut s = side(&fabric, i, all());
        let mut init = QpInit::new(&sink.cq, &sink.cq);
        init.max_inline = 0;
        let mut q = sink.pd.create_qp(&init).unwrap();
        q.connect(&s.qp.endpoint(0), 0, &o).unwrap();
        s.qp.connect(&q.endpoint(0), 0, &o).unwrap();
        qps.push(q);
        senders.push(s);
    }
    settle(&fabric);
    let start = fabric.now();
    let len = 65536u32;
    for (k, s) in senders.iter_mut().enumerate() {
        let remote = RemoteAddr {
            addr: sink.mr.addr() + k as u64 * len as u64,
            rkey: sink.mr.rkey(),
        };
        let sge = [s.mr.sge(0, len)];
        s.qp.post_send(&[SendWr::new(k as u64, WrOp::Write(remote), &sge)])
            .unwrap();
    }
    let mut last = 0;
    for s in senders.iter_mut() {
        let wc = wait(&fabric, &mut s.cq, 1);
        assert_eq!(wc[0].status, WcStatus::Success);
        last = last.max(wc[0].timestamp_ps);
    }
    // Eight 64 KiB writes share one 100 Gb/s egress port: at least 8 * 5.24 µs.
    let total = last - start.ps();
    let floor = 8 * 65536 * 8 * 10; // ps at 100 Gb/s (10 ps per bit)
    assert!(
        total > floor,
        "{total} ps is faster than the port allows ({floor})"
    );
    assert!(
        total < floor * 13 / 10,
        "{total} ps: contention should cost little beyond the wire"
    );
    let _ = &mut sink;
    drop(qps);
}

/// `Fabric::run_until_cqe` stops right after the event that made a completion visible: a
/// harness that calls it instead of polling after every event sees every completion at the
/// same simulated instant and after the same number of events, and the two runs leave the
/// same trace. With nothing pending it returns false.
#[test]
fn running_to_the_next_cqe_sees_what_polling_after_every_event_sees() {
    // (event count, simulated ps, wr_ids) of each poll that found completions.
    fn run(to_next_cqe: bool) -> (Vec<(u64, u64, Vec<u64>)>, u64) {
        let mut p = pair_with(2, 5, 3);
        let remote = RemoteAddr {
            addr: p.b.mr.addr(),
            rkey: p.b.mr.rkey(),
        };
        for i in 0..40u64 {
            // Every third one signaled, sizes across the MTU so that some take two packets.
            let sge = [p.a.mr.sge(i * 64, 1 + (i as u32 * 331) % 6000)];
            let flags = if i % 3 == 2 {
                SendFlags::SIGNALED
            } else {
                SendFlags::empty()
            };
            let wr = SendWr::new(i, WrOp::Write(remote), &sge).flags(flags);
            p.a.qp.post_send(&[wr]).unwrap();
        }
        let mut seen = Vec::new();
        let mut wc = [WorkCompletion::default(); 16];
        let mut got = 0;
        while got < 13 {
            let k = p.a.cq.poll_ready(&mut wc);
            if k > 0 {
                let stats = p.fabric.stats();
                let ids = wc[..k].iter().map(|w| w.wr_id).collect();
                seen.push((stats.events, p.fabric.now().ps(), ids));
                got += k;
                continue;
            }
            let progressed = if to_next_cqe {
                p.fabric.run_until_cqe(&[0])
            } else {
                p.fabric.step()
            };
            assert!(progressed, "idle with {got} of 13 completions");
        }
        settle(&p.fabric);
        assert!(!p.fabric.run_until_cqe(&[0, 1]), "nothing pending, no CQE");
        (seen, p.fabric.trace_digest())
    }
    let (every_event, d1) = run(false);
    let (to_next, d2) = run(true);
    let polled: usize = every_event.iter().map(|s| s.2.len()).sum();
    assert_eq!(polled, 13, "every signaled WRITE completed");
    assert_eq!(every_event, to_next);
    assert_eq!(d1, d2);
}
