//! Offloaded collectives on N emulated NICs: the set-up a runtime would do (one device per
//! rank, QPs along the binomial tree, [`CollMember`]s exchanged), then each collective armed
//! on every rank, started with one counter add per rank, and run by the NICs alone. The
//! latency is simulated time from the starts to the last rank's completion, taken from the
//! COUNTER events' timestamps; every result is checked.

use crate::{Fabric, FabricConfig};
use ringbell::collective::{tree_children, tree_parent, Armed, CollMember, Peer};
use ringbell::{
    CompletionQueue, ConnectOptions, Device, Error, ProtectionDomain, QpInit, QueuePair,
};
use ringbell_specs::cqe::EventType;
use std::collections::BTreeMap;

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollOp {
    /// Barrier (on the group's tree).
    Barrier,
    /// Broadcast of `bytes` from `root`.
    Broadcast {
        /// The root rank.
        root: usize,
        /// Payload bytes.
        bytes: u32,
    },
    /// Allreduce (sum) of `elems` u64 values (on the group's tree).
    Allreduce {
        /// Elements.
        elems: usize,
    },
}

/// One collective's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollOutcome {
    /// Simulated picoseconds from the starts to the last rank's completion.
    pub latency_ps: u64,
    /// Most triggered operations one rank posted.
    pub max_ops: usize,
    /// Triggered operations over all ranks.
    pub total_ops: usize,
}

struct Rank {
    // Declared in drop order: QPs before the CQ, the member before the PD.
    qps: BTreeMap<usize, QueuePair>,
    member: CollMember,
    _cq: CompletionQueue,
    _pd: ProtectionDomain,
    dev: Device,
}

/// N ranks, one emulated NIC each, wired along the binomial tree of one root.
pub struct CollGroup {
    ranks: Vec<Rank>,
    root: usize,
    fabric: Fabric,
}

fn err(e: Error) -> String {
    e.to_string()
}

impl CollGroup {
    /// Builds `cfg.nodes` ranks with `capacity` bytes of collective buffer each, connected
    /// along the binomial tree rooted at `root` with `opts`.
    pub fn new(
        cfg: FabricConfig,
        root: usize,
        capacity: usize,
        opts: &ConnectOptions,
    ) -> Result<CollGroup, String> {
        let n = cfg.nodes;
        if root >= n {
            return Err(format!("root {root} is not one of the {n} ranks"));
        }
        let fabric = Fabric::new(cfg);
        let mut ranks = Vec::with_capacity(n);
        for r in 0..n {
            let dev = Device::open(Box::new(fabric.port(r))).map_err(err)?;
            let pd = dev.alloc_pd().map_err(err)?;
            let cq = dev.create_cq(256).map_err(err)?;
            let member = CollMember::new(&pd, capacity).map_err(err)?;
            ranks.push(Rank {
                qps: BTreeMap::new(),
                member,
                _cq: cq,
                _pd: pd,
                dev,
            });
        }
        for child in 0..n {
            let Some(parent) = tree_parent(child, n, root) else {
                continue;
            };
            let make = |r: usize| -> Result<QueuePair, String> {
                let rank = &ranks[r];
                let mut init = QpInit::new(&rank._cq, &rank._cq);
                init.max_send_wr = 64;
                init.max_recv_wr = 1;
                init.max_inline = 64;
                rank._pd.create_qp(&init).map_err(err)
            };
            let (mut qc, mut qp) = (make(child)?, make(parent)?);
            let (ec, ep) = (qc.endpoint(1000), qp.endpoint(2000));
            qc.connect(&ep, 1000, opts).map_err(err)?;
            qp.connect(&ec, 2000, opts).map_err(err)?;
            ranks[child].qps.insert(parent, qc);
            ranks[parent].qps.insert(child, qp);
        }
        Ok(CollGroup {
            ranks,
            root,
            fabric,
        })
    }

    /// The fabric.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// Rank `r`'s member.
    pub fn member(&self, r: usize) -> &CollMember {
        &self.ranks[r].member
    }

    fn peer(&self, r: usize, to: usize) -> Result<Peer<'_>, String> {
        let qp = self.ranks[r]
            .qps
            .get(&to)
            .ok_or_else(|| format!("rank {r} has no connection to {to}"))?;
        Ok(Peer {
            qp,
            remote: self.ranks[to].member.remote(),
        })
    }

    fn arm(&self, r: usize, op: CollOp) -> Result<Armed, String> {
        let n = self.size();
        if let CollOp::Broadcast { root, .. } = op {
            if root != self.root {
                return Err(format!(
                    "the group is wired for root {}, not {root}",
                    self.root
                ));
            }
        }
        let parent = tree_parent(r, n, self.root)
            .map(|p| self.peer(r, p))
            .transpose()?;
        let children = tree_children(r, n, self.root)
            .into_iter()
            .map(|c| self.peer(r, c))
            .collect::<Result<Vec<_>, _>>()?;
        let m = &self.ranks[r].member;
        match op {
            CollOp::Barrier => m.arm_barrier(parent, &children),
            CollOp::Broadcast { bytes, .. } => m.arm_broadcast(parent.is_none(), &children, bytes),
            CollOp::Allreduce { elems } => m.arm_allreduce(parent, &children, elems),
        }
        .map_err(err)
    }

    /// Arms `op` on every rank, starts it everywhere at one instant, runs the fabric until
    /// every rank is done and returns the latency. Data must be in place (see
    /// [`CollMember::write_data`]); the caller checks the results.
    pub fn run(&self, op: CollOp) -> Result<CollOutcome, String> {
        let armed = (0..self.size())
            .map(|r| self.arm(r, op))
            .collect::<Result<Vec<_>, _>>()?;
        // Completion is observed through COUNTER events, armed before the start so their
        // timestamps are the moments the conditions became true.
        let mut waiting = 0usize;
        for a in &armed {
            for (c, t) in a.done_conditions() {
                c.arm(*t).map_err(err)?;
                waiting += 1;
            }
        }
        let t0 = self.fabric.now().ps();
        for a in &armed {
            a.start();
        }
        let mut last = t0;
        // Only a rank whose NIC raised an interrupt (an event) has anything to poll: after
        // each step the fabric names them, so a step costs O(1), not O(ranks).
        let mut raised = Vec::new();
        self.fabric.take_raised(&mut raised);
        raised.clear();
        raised.extend(0..self.ranks.len());
        while waiting > 0 {
            for rank in raised.iter().filter_map(|&r| self.ranks.get(r)) {
                while let Some(e) = rank.dev.poll_event() {
                    if e.kind != EventType::Counter {
                        return Err(format!("unexpected device event {e:?}"));
                    }
                    if e.subtype != 0 {
                        return Err(format!(
                            "a transfer failed: counter {} reported an error",
                            e.obj
                        ));
                    }
                    last = last.max(e.timestamp);
                    waiting -= 1;
                }
            }
            if waiting > 0 && !self.fabric.step() {
                return Err(format!(
                    "the collective stalled with {waiting} completions missing"
                ));
            }
            self.fabric.take_raised(&mut raised);
        }
        if let Some(r) = armed.iter().position(|a| !a.is_done()) {
            return Err(format!("rank {r} reported done but its counters disagree"));
        }
        // Nothing more arrives and nothing is left waiting: every counter ends exactly at
        // its threshold and every triggered operation fired once.
        self.fabric.run_until_idle(50_000_000);
        for (r, a) in armed.iter().enumerate() {
            for (c, t) in a.done_conditions() {
                let info = c.query().map_err(err)?;
                if (info.success, info.error, info.pending) != (*t, 0, 0) {
                    return Err(format!(
                        "rank {r}: counter {} ended at {}/{} with {} pending, expected {t}/0/0",
                        c.num(),
                        info.success,
                        info.error,
                        info.pending
                    ));
                }
            }
        }
        Ok(CollOutcome {
            latency_ps: last - t0,
            max_ops: armed.iter().map(Armed::ops).max().unwrap_or(0),
            total_ops: armed.iter().map(Armed::ops).sum(),
        })
    }
}

/// A deterministic input for rank `r`, element `j`.
pub fn input(r: usize, j: usize) -> u64 {
    (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (j as u64).wrapping_mul(0x1000_0001)
}

/// Runs `op` `iters` times on a group and checks every result: broadcast payloads equal
/// the root's, allreduce sums equal the host's. Returns each run's outcome.
pub fn run_checked(group: &CollGroup, op: CollOp, iters: u32) -> Result<Vec<CollOutcome>, String> {
    let n = group.size();
    let mut out = Vec::new();
    for it in 0..iters {
        match op {
            CollOp::Barrier => {}
            CollOp::Broadcast { root, bytes } => {
                let data: Vec<u8> = (0..bytes)
                    .map(|i| {
                        (i as u8)
                            .wrapping_mul(31)
                            .wrapping_add(it as u8 + root as u8)
                    })
                    .collect();
                for r in 0..n {
                    let fill = if r == root {
                        data.clone()
                    } else {
                        vec![0xEE; bytes as usize]
                    };
                    group.member(r).write_data(&fill).map_err(err)?;
                }
            }
            CollOp::Allreduce { elems } => {
                for r in 0..n {
                    let v: Vec<u64> = (0..elems).map(|j| input(r, j + it as usize)).collect();
                    group.member(r).write_u64s(&v).map_err(err)?;
                }
            }
        }
        let o = group.run(op)?;
        match op {
            CollOp::Barrier => {}
            CollOp::Broadcast { root, bytes } => {
                let mut want = vec![0u8; bytes as usize];
                group.member(root).read_data(&mut want).map_err(err)?;
                for r in 0..n {
                    let mut got = vec![0u8; bytes as usize];
                    group.member(r).read_data(&mut got).map_err(err)?;
                    if got != want {
                        return Err(format!("rank {r} received a different payload"));
                    }
                }
            }
            CollOp::Allreduce { elems } => {
                let want: Vec<u64> = (0..elems)
                    .map(|j| (0..n).fold(0u64, |s, r| s.wrapping_add(input(r, j + it as usize))))
                    .collect();
                for r in 0..n {
                    let got = group.member(r).read_u64s(elems).map_err(err)?;
                    if got != want {
                        return Err(format!("rank {r} has sums {got:?}, expected {want:?}"));
                    }
                }
            }
        }
        out.push(o);
    }
    Ok(out)
}
