//! Wall-clock cost of the host-side paths, measured with criterion (`cargo bench -p
//! ringbell-emu`): an 8-byte RDMA WRITE through the driver and the emulator from post to
//! completion, the software tag matcher's cost per message against list depth, a triggered
//! WRITE from the counter add that fires it to its completion count, and a whole offloaded
//! allreduce on 64 emulated NICs.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ringbell::tagmatch::{TagConfig, TagMatcher};
use ringbell::*;
use ringbell_emu::coll::{CollGroup, CollOp};
use ringbell_emu::{Fabric, FabricConfig};
use std::time::{Duration, Instant};

/// Two connected nodes: node 0 writes into node 1's registered buffer.
struct Two {
    // Declared in drop order: QPs before CQs, MRs before their buffers and PDs.
    qa: QueuePair,
    _qb: QueuePair,
    ca: CompletionQueue,
    _cb: CompletionQueue,
    ma: MemoryRegion,
    mb: MemoryRegion,
    _bufs: (DmaBuffer, DmaBuffer),
    pa: ProtectionDomain,
    _pb: ProtectionDomain,
    _devs: (Device, Device),
    fabric: Fabric,
}

impl Two {
    fn new() -> Two {
        let fabric = Fabric::new(FabricConfig::new(2, 1));
        let (a, b) = (
            Device::open(Box::new(fabric.port(0))).unwrap(),
            Device::open(Box::new(fabric.port(1))).unwrap(),
        );
        let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
        let (ba, bb) = (a.alloc_dma(4096).unwrap(), b.alloc_dma(4096).unwrap());
        let ma = pa.reg_mr(&ba, Access::LOCAL_WRITE).unwrap();
        let mb = pb
            .reg_mr(&bb, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let (ca, cb) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
        let mut qa = pa.create_qp(&QpInit::new(&ca, &ca)).unwrap();
        let mut qb = pb.create_qp(&QpInit::new(&cb, &cb)).unwrap();
        let o = ConnectOptions::default();
        let (ea, eb) = (qa.endpoint(1), qb.endpoint(2));
        qa.connect(&eb, 1, &o).unwrap();
        qb.connect(&ea, 2, &o).unwrap();
        Two {
            qa,
            _qb: qb,
            ca,
            _cb: cb,
            ma,
            mb,
            _bufs: (ba, bb),
            pa,
            _pb: pb,
            _devs: (a, b),
            fabric,
        }
    }

    /// Node 1's buffer, for node 0's WRITEs.
    fn remote(&self) -> RemoteAddr {
        RemoteAddr {
            addr: self.mb.addr(),
            rkey: self.mb.rkey(),
        }
    }
}

/// One 8-byte WRITE, posted, run through both emulated NICs, and its completion polled.
fn write_round_trip(c: &mut Criterion) {
    let mut t = Two::new();
    let remote = t.remote();
    let sge = [t.ma.sge(0, 8)];
    let mut wc = [WorkCompletion::default(); 1];
    c.bench_function("write_8B_post_to_completion", |bch| {
        bch.iter(|| {
            t.qa.post_send(&[SendWr::new(1, WrOp::Write(remote), &sge)])
                .unwrap();
            while t.ca.poll(&mut wc) == 0 {}
            assert_eq!(wc[0].status, WcStatus::Success);
        })
    });
}

/// Software matching: a message arrives unexpected with `depth` non-matching receives
/// posted ahead of the one it matches; measured from the receive to the event.
fn software_matching(c: &mut Criterion) {
    let mut g = c.benchmark_group("sw_match_per_message");
    for depth in [0u32, 64, 1024] {
        let fabric = Fabric::new(FabricConfig::new(2, 1));
        let (da, db) = (
            Device::open(Box::new(fabric.port(0))).unwrap(),
            Device::open(Box::new(fabric.port(1))).unwrap(),
        );
        let cfg = TagConfig {
            hw_tags: 0,
            staging_slots: 128,
            ..TagConfig::default()
        };
        let (mut s, mut r) = (
            TagMatcher::new(&da, cfg).unwrap(),
            TagMatcher::new(&db, cfg).unwrap(),
        );
        let ((cs, es), (cr, er)) = (s.add_conn().unwrap(), r.add_conn().unwrap());
        s.connect(cs, &er, &ConnectOptions::default()).unwrap();
        r.connect(cr, &es, &ConnectOptions::default()).unwrap();
        for k in 0..depth {
            r.recv((1 << 50) + k as u64, 1 << 40 | k as u64, u64::MAX, 0, 64)
                .unwrap();
        }
        let mut id = 0u64;
        g.bench_with_input(BenchmarkId::from_parameter(depth), &depth, |bch, _| {
            bch.iter(|| {
                id += 1;
                r.recv(id, 7, u64::MAX, 4096, 64).unwrap();
                s.send(id, cs, 7, 0, 64).unwrap();
                loop {
                    s.progress().unwrap();
                    while s.next_event().is_some() {}
                    r.progress().unwrap();
                    if r.next_event().is_some() {
                        break;
                    }
                }
            })
        });
    }
    g.finish();
}

/// A triggered 8-byte WRITE, armed beforehand (not timed): from the host's counter add that
/// releases it to its completion counter's writeback showing it done.
fn triggered_fire(c: &mut Criterion) {
    let t = Two::new();
    let remote = t.remote();
    let sge = [t.ma.sge(0, 8)];
    let wr = SendWr::new(1, WrOp::Write(remote), &sge);
    let (go, sent) = (
        t.pa.create_counter().unwrap(),
        t.pa.create_counter().unwrap(),
    );
    let mut base = 0u64;
    c.bench_function("triggered_write_add_to_completion", |bch| {
        bch.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(1000);
                for i in 1..=n {
                    let opts = TriggerOpts {
                        completion: Some(&sent),
                        ..Default::default()
                    };
                    t.qa.post_triggered(&go, base + i, &wr, opts).unwrap();
                }
                let start = Instant::now();
                for i in 1..=n {
                    go.add(1);
                    while sent.get().0 < base + i {
                        t.fabric.step();
                    }
                }
                total += start.elapsed();
                base += n;
                left -= n;
            }
            total
        })
    });
}

/// One allreduce of four u64 sums on 64 emulated NICs: arming on every rank (64 × 9
/// POST_TRIGGERED commands at most), the starts, and the NICs running it to completion.
fn allreduce_64(c: &mut Criterion) {
    let group =
        CollGroup::new(FabricConfig::new(64, 1), 0, 64, &ConnectOptions::default()).unwrap();
    c.bench_function("allreduce_4xu64_64_nics", |bch| {
        bch.iter(|| group.run(CollOp::Allreduce { elems: 4 }).unwrap())
    });
}

/// The yardsticks of this run (memcpy and pointer chase), printed before the benchmarks so
/// that their wall-clock figures can be given as ratios comparable across machines.
fn yardsticks(_c: &mut Criterion) {
    println!(
        "{}",
        ringbell_emu::yardstick::Yardstick::measure().describe()
    );
}

criterion_group!(
    benches,
    yardsticks,
    write_round_trip,
    software_matching,
    triggered_fire,
    allreduce_64
);
criterion_main!(benches);
