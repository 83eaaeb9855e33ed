//! perftest-style runs through the real driver on two emulated nodes: latency by ping-pong
//! (WRITE, SEND) or round trip (READ), and streaming bandwidth. Every figure is simulated
//! time; the caller measures wall-clock time around them.

use crate::{Fabric, FabricConfig, Topology};
use ringbell::*;
use ringbell_specs::SimTime;

/// The operation a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerfOp {
    /// RDMA WRITE (latency: ping-pong, the receiver polls the last byte).
    Write,
    /// SEND/RECV (latency: ping-pong on receive completions).
    Send,
    /// RDMA READ (latency: round trip to the completion).
    Read,
    /// 8-byte fetch-and-add (latency: round trip to the completion; size is always 8).
    Atomic,
}

impl PerfOp {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            PerfOp::Write => "write",
            PerfOp::Send => "send",
            PerfOp::Read => "read",
            PerfOp::Atomic => "atomic",
        }
    }
}

/// One node of a perf run.
struct Node {
    /// The first QP (latency runs) and the others (multi-QP bandwidth).
    qps: Vec<QueuePair>,
    cq: CompletionQueue,
    mr: MemoryRegion,
    buf: DmaBuffer,
    _pd: ProtectionDomain,
    dev: Device,
}

/// Two connected nodes.
pub struct PerfPair {
    fabric: Fabric,
    a: Node,
    b: Node,
    max_inline: u32,
}

impl std::fmt::Debug for PerfPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerfPair")
            .field("fabric", &self.fabric)
            .finish()
    }
}

/// Bytes of each node's buffer.
pub const PERF_BUF: usize = 4 << 20;

fn open(fabric: &Fabric, node: usize, nqps: usize) -> Result<Node, Error> {
    let dev = Device::open(Box::new(fabric.port(node)))?;
    let pd = dev.alloc_pd()?;
    let buf = dev.alloc_dma(PERF_BUF)?;
    let mr = pd.reg_mr(
        &buf,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    )?;
    let cq = dev.create_cq(4096)?;
    let mut init = QpInit::new(&cq, &cq);
    init.max_send_wr = 512;
    init.max_recv_wr = 512;
    init.max_send_sge = 1;
    init.max_recv_sge = 1;
    init.max_inline = dev.caps().max_inline;
    let qps = (0..nqps.max(1))
        .map(|_| pd.create_qp(&init))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Node {
        qps,
        cq,
        mr,
        buf,
        _pd: pd,
        dev,
    })
}

impl PerfPair {
    /// Two nodes (back to back, or on a switch) connected at path MTU 4096. Initial PSNs
    /// come from the fabric's seed.
    pub fn new(seed: u64, topology: Topology) -> Result<PerfPair, Error> {
        let mut cfg = FabricConfig::new(2, seed);
        cfg.topology = topology;
        Self::with(cfg, &ConnectOptions::default())
    }

    /// Two nodes of a fabric built from `cfg` (which must have two nodes), connected with `o`.
    pub fn with(cfg: FabricConfig, o: &ConnectOptions) -> Result<PerfPair, Error> {
        Self::with_qps(cfg, o, 1)
    }

    /// As [`PerfPair::with`], with `nqps` connected QP pairs (bandwidth runs spread their
    /// messages over all of them; latency runs use the first).
    pub fn with_qps(cfg: FabricConfig, o: &ConnectOptions, nqps: usize) -> Result<PerfPair, Error> {
        let fabric = Fabric::new(cfg);
        let mut a = open(&fabric, 0, nqps)?;
        let mut b = open(&fabric, 1, nqps)?;
        use rand_core::RngCore;
        let mut rng = fabric.rng(1);
        for (qa, qb) in a.qps.iter_mut().zip(b.qps.iter_mut()) {
            let (pa, pb) = (rng.next_u32() & 0xFF_FFFF, rng.next_u32() & 0xFF_FFFF);
            let (ea, eb) = (qa.endpoint(pa), qb.endpoint(pb));
            qa.connect(&eb, pa, o)?;
            qb.connect(&ea, pb, o)?;
        }
        let max_inline = a.dev.caps().max_inline;
        Ok(PerfPair {
            fabric,
            a,
            b,
            max_inline,
        })
    }

    /// Transport counters of both QPs and both ports: (QP A, QP B, port A, port B).
    pub fn stats(&self) -> Result<(QpStats, QpStats, PortStats, PortStats), Error> {
        Ok((
            self.a.qps[0].stats()?,
            self.b.qps[0].stats()?,
            self.a.dev.port_stats()?,
            self.b.dev.port_stats()?,
        ))
    }

    /// The fabric.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    fn now(&self) -> SimTime {
        self.fabric.now()
    }

    fn step(&self) -> Result<(), Error> {
        ran(self.fabric.step())
    }

    /// Runs to the next completion of one of `nodes` (see [`Fabric::run_until_cqe`]).
    fn run_until_cqe(&self, nodes: &[usize]) -> Result<(), Error> {
        ran(self.fabric.run_until_cqe(nodes))
    }

    /// Mean one-way latency (WRITE, SEND) or round-trip latency (READ, atomic) of
    /// `size`-byte messages over `iters` iterations, in simulated time.
    pub fn latency(&mut self, op: PerfOp, size: u32, iters: u32) -> Result<SimTime, Error> {
        let s = self.latency_samples(op, size, iters)?;
        let sum: u64 = s.iter().map(|t| t.ps()).sum();
        Ok(SimTime(sum / s.len().max(1) as u64))
    }

    /// One latency per iteration: one-way for WRITE and SEND (ping-pong: both directions are
    /// samples, `2 * iters` of them), round trip for READ and atomics.
    pub fn latency_samples(
        &mut self,
        op: PerfOp,
        size: u32,
        iters: u32,
    ) -> Result<Vec<SimTime>, Error> {
        let size = size.clamp(1, (PERF_BUF / 2) as u32);
        self.quiesce()?;
        let mut out = Vec::with_capacity(2 * iters as usize);
        match op {
            PerfOp::Read | PerfOp::Atomic => {
                for i in 0..iters {
                    let start = self.now();
                    let remote = RemoteAddr {
                        addr: self.b.mr.addr(),
                        rkey: self.b.mr.rkey(),
                    };
                    let (wr_op, len) = if op == PerfOp::Read {
                        (WrOp::Read(remote), size)
                    } else {
                        (WrOp::FetchAdd { remote, add: 1 }, 8)
                    };
                    let sge = [self.a.mr.sge(0, len)];
                    self.a.qps[0].post_send(&[SendWr::new(i as u64, wr_op, &sge)])?;
                    self.wait_cq(true)?;
                    out.push(self.now() - start);
                }
            }
            PerfOp::Write | PerfOp::Send => {
                for i in 0..iters {
                    let tag = (i % 255) as u8 + 1;
                    for forward in [true, false] {
                        let start = self.now();
                        self.one_way(op, size, tag, forward)?;
                        out.push(self.now() - start);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Sends one message from A to B (`forward`) or back, and waits until the receiver sees it.
    fn one_way(&mut self, op: PerfOp, size: u32, tag: u8, forward: bool) -> Result<(), Error> {
        let inline = size <= self.max_inline;
        let (src, dst) = if forward {
            (&mut self.a, &mut self.b)
        } else {
            (&mut self.b, &mut self.a)
        };
        let last = size as usize - 1;
        src.buf.write(last, &[tag])?;
        let sge = [src.mr.sge(0, size)];
        let mut payload = [0u8; 256];
        let data = if inline {
            src.buf.read(0, &mut payload[..size as usize])?;
            Some(&payload[..size as usize])
        } else {
            None
        };
        let wr_op = match op {
            PerfOp::Send => {
                let rs = [dst.mr.sge(PERF_BUF as u64 / 2, size)];
                dst.qps[0].post_recv(&[RecvWr { wr_id: 0, sgl: &rs }])?;
                WrOp::Send
            }
            _ => WrOp::Write(RemoteAddr {
                addr: dst.mr.addr() + PERF_BUF as u64 / 2,
                rkey: dst.mr.rkey(),
            }),
        };
        let wr = match data {
            Some(d) => SendWr::inline(0, wr_op, d),
            None => SendWr::new(0, wr_op, &sge),
        };
        src.qps[0].post_send(&[wr])?;
        // The receiver spins: on the last byte (WRITE) or on its receive CQ (SEND).
        let mut wc = [WorkCompletion::default(); 4];
        loop {
            let (src, dst) = if forward {
                (&mut self.a, &mut self.b)
            } else {
                (&mut self.b, &mut self.a)
            };
            if op == PerfOp::Send {
                let n = dst.cq.poll_ready(&mut wc);
                if wc[..n].iter().any(|w| w.opcode.is_recv()) {
                    if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success) {
                        return Err(Error::InvalidArgument(status_text(w.status)));
                    }
                    break;
                }
            } else if dst.buf.load_acquire(PERF_BUF / 2 + last)? == tag {
                break;
            }
            // Reap the sender's completions as they come so the ring never fills.
            let n = src.cq.poll_ready(&mut wc);
            if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success) {
                return Err(Error::InvalidArgument(status_text(w.status)));
            }
            self.step()?;
        }
        Ok(())
    }

    /// Runs the fabric until idle and reaps every completion left from earlier runs.
    fn quiesce(&mut self) -> Result<(), Error> {
        self.fabric.run_until_quiet();
        let mut wc = [WorkCompletion::default(); 32];
        for cq in [&mut self.a.cq, &mut self.b.cq] {
            loop {
                let n = cq.poll_ready(&mut wc);
                if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success) {
                    return Err(Error::InvalidArgument(status_text(w.status)));
                }
                if n == 0 {
                    break;
                }
            }
        }
        Ok(())
    }

    fn wait_cq(&mut self, on_a: bool) -> Result<WorkCompletion, Error> {
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            let cq = if on_a { &mut self.a.cq } else { &mut self.b.cq };
            if cq.poll_ready(&mut wc) == 1 {
                if wc[0].status != WcStatus::Success {
                    return Err(Error::InvalidArgument(status_text(wc[0].status)));
                }
                return Ok(wc[0]);
            }
            self.step()?;
        }
    }

    /// Streams `count` `size`-byte messages of `op` (WRITE, SEND or READ) from A to B with up to
    /// `depth` outstanding, every 16th signaled; returns payload bandwidth in bits per
    /// second of simulated time. Never inlined, so that a profiler can be told to count
    /// just this call (`--toggle-collect='*PerfPair*bandwidth*'`) in a whole-program build.
    #[inline(never)]
    pub fn bandwidth(
        &mut self,
        op: PerfOp,
        size: u32,
        count: u32,
        depth: u32,
    ) -> Result<f64, Error> {
        Ok(self.throughput(op, size, count, depth)?.0)
    }

    /// As [`PerfPair::bandwidth`], spread round-robin over every QP pair (`depth` outstanding
    /// on each): payload bits per second and messages per second of simulated time.
    pub fn throughput(
        &mut self,
        op: PerfOp,
        size: u32,
        count: u32,
        depth: u32,
    ) -> Result<(f64, f64), Error> {
        let size = size.clamp(1, (PERF_BUF / 2) as u32);
        let depth = depth.clamp(16, 256);
        self.quiesce()?;
        let nq = self.a.qps.len() as u32;
        let start = self.now();
        // Per QP: its share of the messages, posted, completed, receives posted.
        let quota: Vec<u32> = (0..nq)
            .map(|q| count / nq + u32::from(q < count % nq))
            .collect();
        let (mut posted, mut completed) = (vec![0u32; nq as usize], vec![0u32; nq as usize]);
        let mut recv_posted = vec![0u32; nq as usize];
        let mut wc = [WorkCompletion::default(); 32];
        let sge = [self.a.mr.sge(0, size)];
        let remote = RemoteAddr {
            addr: self.b.mr.addr() + PERF_BUF as u64 / 2,
            rkey: self.b.mr.rkey(),
        };
        let qpn_index: std::collections::BTreeMap<u32, usize> = self
            .a
            .qps
            .iter()
            .enumerate()
            .map(|(i, q)| (q.qpn(), i))
            .collect();
        let mut last_done = start;
        let total = |v: &[u32]| v.iter().sum::<u32>();
        while total(&completed) < count {
            for q in 0..nq as usize {
                if op == PerfOp::Send {
                    while recv_posted[q] < quota[q] && recv_posted[q] < completed[q] + 2 * depth {
                        let rs = [self.b.mr.sge(PERF_BUF as u64 / 2, size)];
                        self.b.qps[q].post_recv(&[RecvWr { wr_id: 0, sgl: &rs }])?;
                        recv_posted[q] += 1;
                    }
                }
                while posted[q] < quota[q] && posted[q] - completed[q] < depth {
                    let signaled = posted[q] % 16 == 15 || posted[q] + 1 == quota[q];
                    let flags = if signaled {
                        SendFlags::SIGNALED
                    } else {
                        SendFlags::empty()
                    };
                    let wr_op = match op {
                        PerfOp::Send => WrOp::Send,
                        PerfOp::Read => WrOp::Read(RemoteAddr {
                            addr: self.b.mr.addr(),
                            rkey: self.b.mr.rkey(),
                        }),
                        _ => WrOp::Write(remote),
                    };
                    self.a.qps[q]
                        .post_send(&[SendWr::new(posted[q] as u64, wr_op, &sge).flags(flags)])?;
                    posted[q] += 1;
                }
            }
            let n = self.a.cq.poll_ready(&mut wc);
            for w in &wc[..n] {
                if w.status != WcStatus::Success {
                    return Err(Error::InvalidArgument(status_text(w.status)));
                }
                if let Some(&q) = qpn_index.get(&w.qpn) {
                    completed[q] = w.wr_id as u32 + 1;
                }
                last_done = SimTime(w.timestamp_ps);
            }
            // Only SENDs complete anything on B (its receives); WRITEs and READs leave its
            // CQ empty, so polling it after every event would only measure the harness.
            if op == PerfOp::Send {
                let m = self.b.cq.poll_ready(&mut wc);
                if wc[..m].iter().any(|w| w.status != WcStatus::Success) {
                    return Err(Error::InvalidArgument("receive failed"));
                }
            }
            if n == 0 {
                // Nothing to post until a completion shows: run to the next CQE of A (or
                // of B, whose receives a SEND completes), not one event per poll.
                let watch: &[usize] = if op == PerfOp::Send { &[0, 1] } else { &[0] };
                self.run_until_cqe(watch)?;
            }
        }
        let secs = ((last_done - start).ps() as f64 / 1e12).max(1e-12);
        Ok((count as f64 * size as f64 * 8.0 / secs, count as f64 / secs))
    }
}

/// A fabric that ran out of events before the harness got what it waits for is an error.
fn ran(progressed: bool) -> Result<(), Error> {
    if progressed {
        Ok(())
    } else {
        Err(Error::DeviceIdle("a perf run"))
    }
}

fn status_text(s: WcStatus) -> &'static str {
    match s {
        WcStatus::Success => "success",
        WcStatus::WrFlushErr => "completion flushed",
        WcStatus::RemAccessErr => "remote access error",
        WcStatus::RetryExcErr => "retries exhausted",
        _ => "completion error",
    }
}
