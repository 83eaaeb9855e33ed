//! Emulation speed end to end, in wall-clock terms (`cargo bench -p ringbell-emu --bench
//! throughput`): how many messages, and how many payload bytes, the driver and two emulated
//! NICs move per second of the host CPU.
//!
//! Two nodes back to back (the perftest set-up), one RC QP pair, node 0 streaming RDMA WRITEs
//! to node 1 through the real driver (`post_send`, `poll_ready`) and the emulator (`Fabric`
//! stepped by the same thread: everything runs on one core). The timed cases put every
//! message through the discrete-event model with the default timing profile (doorbell, WQE
//! fetch, payload DMA, frames on the link, ACKs, CQE), so what is measured is the full cost
//! of emulating it, not only the data movement. The `*_functional` cases run the same driver
//! loop on a fabric in functional mode (`FabricConfig::functional`): the WRITEs go straight
//! to the peer's responder, a doorbell's worth per event, the payload in one copy between
//! the two IOMMU mappings, no frames and no ACKs.
//!
//! * `msg_rate/write_8B_inline_batch32`: 8-byte inline WRITEs posted 32 per `post_send` (one
//!   doorbell), the last of each batch signaled, at most 256 outstanding. One element is one
//!   message.
//! * `payload/write_64KiB`, `payload/write_1MiB`: WRITEs from a registered buffer, every one
//!   signaled, at most 8 outstanding (64 KiB) or 2 (1 MiB), path MTU 4096. Throughput is
//!   payload bytes per wall second.
//!
//! Before the timed runs each case runs once untimed and prints what one message costs the
//! fabric: events processed, frames delivered, and the simulated message or byte rate.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, Topology};
use std::time::Instant;

const BUF: usize = 2 << 20;

/// Two connected nodes; node 0 writes into node 1's buffer.
struct Pair {
    // Field order is drop order: QPs, then CQs, then the devices.
    qa: QueuePair,
    _qb: QueuePair,
    ca: CompletionQueue,
    _cb: CompletionQueue,
    ma: MemoryRegion,
    _mb: MemoryRegion,
    _ba: DmaBuffer,
    _bb: DmaBuffer,
    _a: Device,
    _b: Device,
    fabric: Fabric,
    remote: RemoteAddr,
    /// Messages posted and completed so far (wr_id of a signaled WR = messages up to it).
    posted: u64,
    completed: u64,
}

impl Pair {
    fn new(functional: bool) -> Pair {
        let mut cfg = FabricConfig::new(2, 1);
        cfg.topology = Topology::BackToBack;
        cfg.functional = functional;
        let fabric = Fabric::new(cfg);
        let a = Device::open(Box::new(fabric.port(0))).unwrap();
        let b = Device::open(Box::new(fabric.port(1))).unwrap();
        let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
        let (ba, bb) = (a.alloc_dma(BUF).unwrap(), b.alloc_dma(BUF).unwrap());
        let ma = pa.reg_mr(&ba, Access::LOCAL_WRITE).unwrap();
        let mb = pb
            .reg_mr(&bb, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let (ca, cb) = (a.create_cq(1024).unwrap(), b.create_cq(64).unwrap());
        let init = QpInit {
            max_send_wr: 512,
            max_send_sge: 1,
            ..QpInit::new(&ca, &ca)
        };
        let mut qa = pa.create_qp(&init).unwrap();
        let mut qb = pb.create_qp(&QpInit::new(&cb, &cb)).unwrap();
        let o = ConnectOptions::default();
        let (ea, eb) = (qa.endpoint(1), qb.endpoint(2));
        qa.connect(&eb, 1, &o).unwrap();
        qb.connect(&ea, 2, &o).unwrap();
        fabric.run_until_quiet();
        Pair {
            remote: RemoteAddr {
                addr: mb.addr(),
                rkey: mb.rkey(),
            },
            qa,
            _qb: qb,
            ca,
            _cb: cb,
            ma,
            _mb: mb,
            _ba: ba,
            _bb: bb,
            _a: a,
            _b: b,
            fabric,
            posted: 0,
            completed: 0,
        }
    }

    /// Streams `count` messages of `size` bytes (inline when `inline`), `batch` WRs per
    /// `post_send` with the last signaled, at most `depth` outstanding, and waits for the last
    /// completion.
    fn stream(&mut self, count: u64, size: u32, inline: bool, batch: usize, depth: u64) {
        let payload = [0x5Au8; 8];
        let sge = [self.ma.sge(0, size)];
        let op = WrOp::Write(self.remote);
        let end = self.posted + count;
        let mut wc = [WorkCompletion::default(); 32];
        let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(batch);
        while self.completed < end {
            while self.posted < end && self.posted - self.completed + batch as u64 <= depth {
                let k = (batch as u64).min(end - self.posted) as usize;
                wrs.clear();
                for i in 0..k {
                    let id = self.posted + i as u64 + 1;
                    let wr = if inline {
                        SendWr::inline(id, op, &payload[..size as usize])
                    } else {
                        SendWr::new(id, op, &sge)
                    };
                    wrs.push(wr.flags(if i + 1 == k {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    }));
                }
                self.qa.post_send(&wrs).unwrap();
                self.posted += k as u64;
            }
            let n = self.ca.poll_ready(&mut wc);
            for w in &wc[..n] {
                assert_eq!(w.status, WcStatus::Success);
                self.completed = w.wr_id;
            }
            if n == 0 {
                assert!(self.fabric.step(), "fabric idle with messages outstanding");
            }
        }
    }
}

struct Case {
    name: &'static str,
    size: u32,
    inline: bool,
    batch: usize,
    depth: u64,
    /// Messages in the untimed characterisation run.
    probe: u64,
    /// Functional mode.
    functional: bool,
}

fn run_case(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, c: &Case) {
    let mut p = Pair::new(c.functional);
    // Characterise one message (untimed).
    let (s0, t0, w0) = (p.fabric.stats(), p.fabric.now(), Instant::now());
    p.stream(c.probe, c.size, c.inline, c.batch, c.depth);
    let (s1, t1, wall) = (p.fabric.stats(), p.fabric.now(), w0.elapsed());
    let per = |x: u64| x as f64 / c.probe as f64;
    let sim_s = (t1 - t0).ps() as f64 / 1e12;
    let wall_s = wall.as_secs_f64();
    eprintln!(
        "{}: {} messages: {:.2} events/msg, {:.2} frames/msg; wall {:.3} s ({:.0} ns/event, \
         {:.3} M msg/s, {:.3} GB/s); simulated {:.3} M msg/s, {:.3} GB/s",
        c.name,
        c.probe,
        per(s1.events - s0.events),
        per(s1.frames_delivered - s0.frames_delivered),
        wall_s,
        wall_s * 1e9 / (s1.events - s0.events) as f64,
        c.probe as f64 / wall_s / 1e6,
        c.probe as f64 * c.size as f64 / wall_s / 1e9,
        c.probe as f64 / sim_s / 1e6,
        c.probe as f64 * c.size as f64 / sim_s / 1e9,
    );
    g.bench_function(c.name, |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            p.stream(iters, c.size, c.inline, c.batch, c.depth);
            t.elapsed()
        })
    });
}

fn msg_rate(c: &mut Criterion) {
    let mut g = c.benchmark_group("msg_rate");
    g.throughput(Throughput::Elements(1));
    for (name, functional, probe) in [
        ("write_8B_inline_batch32", false, 200_000),
        ("write_8B_inline_batch32_functional", true, 2_000_000),
    ] {
        run_case(
            &mut g,
            &Case {
                name,
                size: 8,
                inline: true,
                batch: 32,
                depth: 256,
                probe,
                functional,
            },
        );
    }
    g.finish();
}

fn payload(c: &mut Criterion) {
    let mut g = c.benchmark_group("payload");
    g.sample_size(20);
    for (name, size, depth, probe, functional) in [
        ("write_64KiB", 64u32 << 10, 8u64, 4000u64, false),
        ("write_1MiB", 1 << 20, 2, 400, false),
        ("write_64KiB_functional", 64 << 10, 8, 20_000, true),
        ("write_1MiB_functional", 1 << 20, 2, 2000, true),
    ] {
        g.throughput(Throughput::Bytes(size as u64));
        run_case(
            &mut g,
            &Case {
                name,
                size,
                inline: false,
                batch: 1,
                depth,
                probe,
                functional,
            },
        );
    }
    g.finish();
}

/// The yardsticks of this run (memcpy and pointer chase), printed before the benchmarks so
/// that their wall-clock figures can be given as ratios comparable across machines.
fn yardsticks(_c: &mut Criterion) {
    println!(
        "{}",
        ringbell_emu::yardstick::Yardstick::measure().describe()
    );
}

criterion_group!(benches, yardsticks, msg_rate, payload);
criterion_main!(benches);
