//! The scale benchmark: N emulated NICs in one process, RC traffic in a ring or all-to-all,
//! and what it costs: wall time per message and per fabric event (beside the yardsticks of
//! the same run), resident memory per node, file descriptors and memory mappings.
//!
//! Every node opens a device on the fabric with one PD, one 64 KiB buffer, one CQ and its
//! RC QPs: in a ring, one to the next node and one from the previous; all-to-all, one per
//! peer (N − 1 per node, N (N − 1) in all, each connected to its peer's QP for this node).
//! Every QP that sends WRITEs `msgs` 8-byte inline messages into its peer's buffer with
//! `depth` outstanding. The harness polls only the nodes whose NIC raised an interrupt
//! (armed CQs), so its own cost per event does not grow with N.

use crate::{Fabric, FabricConfig};
use ringbell::{
    Access, CompletionQueue, ConnectOptions, Device, DmaBuffer, MemoryRegion, ProtectionDomain,
    QpInit, QueuePair, RemoteAddr, SendFlags, SendWr, WcStatus, WorkCompletion, WrOp,
};
use std::time::{Duration, Instant};

/// Which traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    /// Node i writes to node i + 1 (mod N).
    Ring,
    /// Every node writes to every other node, over one RC QP per ordered pair.
    AllToAll,
}

impl Pattern {
    /// The pattern's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Ring => "ring",
            Pattern::AllToAll => "all-to-all",
        }
    }
}

/// One run's parameters.
#[derive(Clone, Copy, Debug)]
pub struct ScaleConfig {
    /// Nodes.
    pub nodes: usize,
    /// Traffic.
    pub pattern: Pattern,
    /// Messages each sending QP writes.
    pub msgs: u32,
    /// Messages outstanding per QP.
    pub depth: u32,
    /// Root seed.
    pub seed: u64,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct ScaleOutcome {
    /// The run's parameters.
    pub cfg: ScaleConfig,
    /// RC QPs in all.
    pub qps: usize,
    /// Messages written (and completed).
    pub messages: u64,
    /// Fabric events run during the traffic.
    pub events: u64,
    /// Wall time of the set-up (devices, QPs, connections).
    pub setup: Duration,
    /// Wall time of the traffic.
    pub wall: Duration,
    /// Simulated time of the traffic, in picoseconds.
    pub sim_ps: u64,
    /// Resident memory the fabric and its nodes added by the end of the traffic, per node,
    /// in KiB.
    pub rss_kib_per_node: f64,
    /// Open file descriptors of the process with the fabric built.
    pub fds: usize,
    /// Memory mappings of the process with the fabric built.
    pub maps: usize,
}

impl ScaleOutcome {
    /// Wall nanoseconds per message.
    pub fn ns_per_message(&self) -> f64 {
        self.wall.as_nanos() as f64 / self.messages.max(1) as f64
    }

    /// Wall nanoseconds per fabric event.
    pub fn ns_per_event(&self) -> f64 {
        self.wall.as_nanos() as f64 / self.events.max(1) as f64
    }
}

const BUF: usize = 64 << 10;

struct Node {
    // Declared in drop order: QPs before the CQ, the MR before the buffer, the PD last.
    qps: Vec<QueuePair>,
    /// For each QP: its peer node (whose buffer it writes), or `None` for a QP that only
    /// receives (the ring's link from the previous node).
    peer: Vec<Option<usize>>,
    cq: CompletionQueue,
    mr: MemoryRegion,
    buf: DmaBuffer,
    _pd: ProtectionDomain,
    dev: Device,
    /// Per QP: messages posted and completed.
    posted: Vec<u32>,
    done: Vec<u32>,
}

fn err(e: ringbell::Error) -> String {
    e.to_string()
}

/// Resident set size of this process in KiB (`/proc/self/status`), 0 if unknown.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Open file descriptors of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Memory mappings of this process.
pub fn map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps").map_or(0, |s| s.lines().count())
}

/// Runs one configuration.
pub fn run(cfg: ScaleConfig) -> Result<ScaleOutcome, String> {
    let n = cfg.nodes;
    if n < 2 {
        return Err("at least 2 nodes".into());
    }
    if cfg.depth == 0 || cfg.msgs == 0 {
        return Err("depth and messages must be at least 1".into());
    }
    let rss0 = rss_kib();
    let t_setup = Instant::now();
    let fabric = Fabric::new(FabricConfig::new(n, cfg.seed));
    let per_node = match cfg.pattern {
        Pattern::Ring => 2,
        Pattern::AllToAll => n - 1,
    };
    let mut nodes = Vec::with_capacity(n);
    for i in 0..n {
        nodes.push(open_node(&fabric, i, per_node, cfg.depth)?);
    }
    // Connections: (node, its QP index) pairs, both ends at once.
    let opts = ConnectOptions::default();
    let mut links = Vec::new();
    match cfg.pattern {
        Pattern::Ring => {
            for (i, node) in nodes.iter_mut().enumerate() {
                // QP 0 of i sends to i + 1, whose QP 1 receives from i.
                links.push(((i, 0), ((i + 1) % n, 1)));
                node.peer[0] = Some((i + 1) % n);
            }
        }
        Pattern::AllToAll => {
            // Node i's QP for peer j is at index j - (j > i).
            let idx = |i: usize, j: usize| j - usize::from(j > i);
            for (i, node) in nodes.iter_mut().enumerate() {
                for j in i + 1..n {
                    links.push(((i, idx(i, j)), (j, idx(j, i))));
                }
                for j in (0..n).filter(|&j| j != i) {
                    node.peer[idx(i, j)] = Some(j);
                }
            }
        }
    }
    use rand_core::RngCore;
    let mut rng = fabric.rng(7);
    for ((a, qa), (b, qb)) in links {
        let (pa, pb) = (rng.next_u32() & 0xFF_FFFF, rng.next_u32() & 0xFF_FFFF);
        let ea = nodes[a].qps[qa].endpoint(pa);
        let eb = nodes[b].qps[qb].endpoint(pb);
        nodes[a].qps[qa].connect(&eb, pa, &opts).map_err(err)?;
        nodes[b].qps[qb].connect(&ea, pb, &opts).map_err(err)?;
    }
    let remotes: Vec<(u64, u32)> = nodes.iter().map(|x| (x.mr.addr(), x.mr.rkey())).collect();
    let setup = t_setup.elapsed();
    let fds = fd_count();
    let maps = map_count();

    let senders: usize = nodes
        .iter()
        .map(|x| x.peer.iter().filter(|p| p.is_some()).count())
        .sum();
    let total = senders as u64 * cfg.msgs as u64;
    let events0 = fabric.stats().events;
    let sim0 = fabric.now().ps();
    let t = Instant::now();
    for (i, node) in nodes.iter_mut().enumerate() {
        node.cq.arm(false);
        for q in 0..node.qps.len() {
            post(node, q, cfg, &remotes, i)?;
        }
    }
    let mut completed = 0u64;
    let mut raised = Vec::new();
    let mut wc = [WorkCompletion::default(); 64];
    while completed < total {
        if !fabric.step() {
            return Err(format!(
                "the traffic stalled with {} of {total} messages complete",
                completed
            ));
        }
        fabric.take_raised(&mut raised);
        for &r in &raised {
            let node = &mut nodes[r];
            while node.dev.poll_event().is_some() {}
            loop {
                let k = node.cq.poll(&mut wc);
                for w in &wc[..k] {
                    if w.status != WcStatus::Success {
                        return Err(format!("node {r}: a WRITE failed: {:?}", w.status));
                    }
                    let q = w.wr_id as usize;
                    node.done[q] += 1;
                    completed += 1;
                    post(node, q, cfg, &remotes, r)?;
                }
                if k < wc.len() {
                    break;
                }
            }
            node.cq.arm(false);
        }
    }
    let wall = t.elapsed();
    let rss_kib_per_node = rss_kib().saturating_sub(rss0) as f64 / n as f64;
    // Every sender's last WRITE landed in its slot of its peer's buffer.
    for (i, node) in nodes.iter().enumerate() {
        for &p in node.peer.iter().flatten() {
            let got = nodes[p].buf.read_u64(slot(i)).map_err(err)?;
            if got != i as u64 {
                return Err(format!("node {p}: slot of node {i} holds {got}"));
            }
        }
    }
    Ok(ScaleOutcome {
        cfg,
        qps: n * per_node,
        messages: total,
        events: fabric.stats().events - events0,
        setup,
        wall,
        sim_ps: fabric.now().ps() - sim0,
        rss_kib_per_node,
        fds,
        maps,
    })
}

fn open_node(fabric: &Fabric, i: usize, qps: usize, depth: u32) -> Result<Node, String> {
    let dev = Device::open(Box::new(fabric.port(i))).map_err(err)?;
    let pd = dev.alloc_pd().map_err(err)?;
    let buf = dev.alloc_dma(BUF).map_err(err)?;
    let mr = pd
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .map_err(err)?;
    let entries = (qps as u32 * depth).clamp(64, dev.caps().max_cqe);
    let cq = dev.create_cq(entries).map_err(err)?;
    let mut init = QpInit::new(&cq, &cq);
    init.max_send_wr = depth;
    init.max_recv_wr = 1;
    init.max_send_sge = 1;
    init.max_recv_sge = 1;
    init.max_inline = 8;
    let qps = (0..qps)
        .map(|_| pd.create_qp(&init))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    let k = qps.len();
    Ok(Node {
        qps,
        peer: vec![None; k],
        cq,
        mr,
        buf,
        _pd: pd,
        dev,
        posted: vec![0; k],
        done: vec![0; k],
    })
}

/// The offset of node `i`'s 8-byte slot in every buffer it writes.
fn slot(i: usize) -> usize {
    (i * 8) % BUF
}

/// Posts on QP `q` of `node` (node index `me`) what its depth allows.
fn post(
    node: &mut Node,
    q: usize,
    cfg: ScaleConfig,
    remotes: &[(u64, u32)],
    me: usize,
) -> Result<(), String> {
    let Some(peer) = node.peer[q] else {
        return Ok(());
    };
    let (addr, rkey) = remotes[peer];
    let data = (me as u64).to_le_bytes();
    while node.posted[q] < cfg.msgs && node.posted[q] - node.done[q] < cfg.depth {
        // Each sender writes its own 8-byte slot of the peer's buffer.
        let remote = RemoteAddr {
            addr: addr + slot(me) as u64,
            rkey,
        };
        let wr = SendWr::inline(q as u64, WrOp::Write(remote), &data).flags(SendFlags::SIGNALED);
        node.qps[q].post_send(&[wr]).map_err(err)?;
        node.posted[q] += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_of_a_small_all_to_all_completes_and_lands() {
        let cfg = ScaleConfig {
            nodes: 5,
            pattern: Pattern::AllToAll,
            msgs: 7,
            depth: 3,
            seed: 3,
        };
        let o = run(cfg).unwrap();
        assert_eq!(o.qps, 20);
        assert_eq!(o.messages, 20 * 7);
        assert!(o.events > o.messages, "{o:?}");
        assert!(o.sim_ps > 0);
    }

    #[test]
    fn a_ring_sends_once_per_node() {
        let cfg = ScaleConfig {
            nodes: 6,
            pattern: Pattern::Ring,
            msgs: 10,
            depth: 4,
            seed: 1,
        };
        let o = run(cfg).unwrap();
        assert_eq!(o.qps, 12);
        assert_eq!(o.messages, 60);
    }
}
