//! Offloaded collectives built only from triggered operations.
//!
//! Each rank arms its part of a collective once (posting triggered operations on the QPs
//! that connect it to its tree neighbours) and starts it with one counter add; from then on
//! the NICs run it alone: no host code runs between the start and the completion. The
//! wiring follows the binomial-tree schedules of triggered-ops reference §5.1 (barrier) and
//! §5.5 (allreduce with NIC atomics), and a binomial broadcast from any root.
//!
//! Every rank has one [`CollMember`]: a buffer registered for remote writes and atomics whose
//! remote accesses count on the member's `arrivals` counter, and a `sends` counter that
//! counts the completions of its own triggered transfers. The start is a host add of 1 to
//! `arrivals`, so thresholds are counts of "start + arrivals". Thresholds are cumulative
//! (reference §5.9): each collective's sit on top of the counts all earlier ones add, so one
//! member serves any number of collectives one after the other. Every rank must arm a
//! collective (and write its inputs) before any rank starts it, and the next one may be
//! armed once [`Armed::is_done`] holds on every rank; a peer that starts early then only
//! adds to counts this rank already expects.
//!
//! | Collective | Triggered operations per rank | Done when |
//! |---|---|---|
//! | barrier | 8-byte WRITE to the parent at `c + 1`, to each child at `c + 2` (root: `c + 1`) | arrivals reach the child threshold |
//! | broadcast | WRITE of the data to each child at 1 (root) or 2 | arrivals reach it, sends `c` |
//! | allreduce (u64 sum of `k`) | `k` FETCH_ADDs of the own partial sums into the parent at `c·k + 1`, a WRITE of the result to each child at `c·k + 1` (root) or `c·k + 2` | arrivals reach it, sends `k + c` (root `c`) |
//!
//! (`c` is the rank's number of children.) A broadcast payload of [`CHAIN_FROM`] bytes or
//! more goes to the children one at a time, each WRITE triggered by the completion of the
//! one before (on `sends`), largest subtree first: sent together they would share the link
//! and every subtree would get its data late.
//! A rank's partial sum is read by its FETCH_ADDs
//! when they fire (operand from memory), after every child's atomic has landed; the
//! parent's final WRITE can only come after that, so it never overtakes them.

use crate::counter::{Counter, TriggerHandle, TriggerOpts};
use crate::device::DmaBuffer;
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain, Sge};
use crate::qp::{QueuePair, RemoteAddr, SendWr, WrOp};
use ringbell_specs::cmd::{Access, CntrEvents};

/// Broadcast payloads from this size on are sent to one child at a time.
pub const CHAIN_FROM: u32 = 8192;

/// Offset of the data region in a member's buffer (the bytes before it take barrier tokens).
const DATA_OFF: u64 = 64;

/// The parent of `rank` in the binomial tree of `n` ranks rooted at `root`.
pub fn tree_parent(rank: usize, n: usize, root: usize) -> Option<usize> {
    let v = (rank + n - root % n) % n;
    if v == 0 {
        return None;
    }
    let hb = usize::BITS - 1 - v.leading_zeros();
    Some(((v & !(1 << hb)) + root) % n)
}

/// The children of `rank` in the binomial tree of `n` ranks rooted at `root`, the largest
/// subtree first (the order a broadcast should feed them): the child at relative offset
/// `2^i` roots every rank whose lowest bits match it, so the smallest offset is the largest
/// subtree.
pub fn tree_children(rank: usize, n: usize, root: usize) -> Vec<usize> {
    let v = (rank + n - root % n) % n;
    let depth = usize::BITS - (n.max(1) - 1).leading_zeros();
    let low = if v == 0 {
        0
    } else {
        usize::BITS - v.leading_zeros()
    };
    (low..depth)
        .map(|i| v + (1 << i))
        .filter(|&c| c < n)
        .map(|c| (c + root) % n)
        .collect()
}

/// A tree neighbour: the connected QP to it and the base of its member's buffer.
#[derive(Clone, Copy, Debug)]
pub struct Peer<'a> {
    /// The QP connected to the neighbour.
    pub qp: &'a QueuePair,
    /// The neighbour's [`CollMember::remote`].
    pub remote: RemoteAddr,
}

/// One rank's collective resources.
#[derive(Debug)]
pub struct CollMember {
    /// Counts the start (host add) and every remote write or atomic into the buffer.
    pub arrivals: Counter,
    /// Counts the completions of this rank's triggered transfers.
    pub sends: Counter,
    mr: MemoryRegion,
    buf: DmaBuffer,
    capacity: usize,
    /// What `arrivals` and `sends` reach when every collective armed so far is done: the
    /// base of the next one's thresholds.
    expect: std::cell::Cell<(u64, u64)>,
}

/// A collective armed on one rank.
#[derive(Debug)]
pub struct Armed {
    start: Counter,
    done: Vec<(Counter, u64)>,
    handles: Vec<TriggerHandle>,
}

impl CollMember {
    /// Resources for collectives of up to `capacity` bytes of data (broadcast payload, or
    /// `capacity / 8` allreduce elements).
    pub fn new(pd: &ProtectionDomain, capacity: usize) -> Result<CollMember, Error> {
        if capacity == 0 || !capacity.is_multiple_of(8) {
            return Err(Error::InvalidArgument(
                "collective capacity must be a non-zero multiple of 8",
            ));
        }
        let dev = pd.device();
        let buf = dev.alloc_dma(DATA_OFF as usize + 2 * capacity)?;
        let mr = pd.reg_mr(
            &buf,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )?;
        let arrivals = pd.create_counter()?;
        arrivals.bind_mr(&mr, CntrEvents::REMOTE_WRITE)?;
        let sends = pd.create_counter()?;
        Ok(CollMember {
            arrivals,
            sends,
            mr,
            buf,
            capacity,
            expect: std::cell::Cell::new((0, 0)),
        })
    }

    /// What neighbours need to reach this member (give it to them as [`Peer::remote`]).
    pub fn remote(&self) -> RemoteAddr {
        RemoteAddr {
            addr: self.mr.addr(),
            rkey: self.mr.rkey(),
        }
    }

    /// Bytes of data a collective may use.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Writes the broadcast payload (on the root) or the allreduce input.
    pub fn write_data(&self, data: &[u8]) -> Result<(), Error> {
        if data.len() > self.capacity {
            return Err(Error::InvalidArgument(
                "data longer than the member's capacity",
            ));
        }
        self.buf.write(DATA_OFF as usize, data)
    }

    /// Reads `out.len()` bytes of the data region (the broadcast payload once it arrived).
    pub fn read_data(&self, out: &mut [u8]) -> Result<(), Error> {
        if out.len() > self.capacity {
            return Err(Error::InvalidArgument(
                "read longer than the member's capacity",
            ));
        }
        self.buf.read(DATA_OFF as usize, out)
    }

    /// Writes allreduce inputs.
    pub fn write_u64s(&self, v: &[u64]) -> Result<(), Error> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.write_data(&bytes)
    }

    /// Reads `n` allreduce elements (the result once the collective is done).
    pub fn read_u64s(&self, n: usize) -> Result<Vec<u64>, Error> {
        (0..n)
            .map(|i| self.buf.read_u64(DATA_OFF as usize + 8 * i))
            .collect()
    }

    /// The thresholds' base: the counts every earlier collective adds, not the counters'
    /// values now (a peer may already have started the next collective and counted here).
    fn bases(&self) -> Result<(u64, u64), Error> {
        let (_, ae) = self.arrivals.get();
        let (_, se) = self.sends.get();
        if ae != 0 || se != 0 {
            return Err(Error::InvalidArgument(
                "a collective counter has errors: an earlier collective failed",
            ));
        }
        Ok(self.expect.get())
    }

    fn write_to(
        &self,
        peer: &Peer<'_>,
        at: u64,
        len: u32,
        threshold: u64,
    ) -> Result<TriggerHandle, Error> {
        let sge = [self.mr.sge(DATA_OFF, len)];
        let remote = RemoteAddr {
            addr: peer.remote.addr + DATA_OFF + at,
            rkey: peer.remote.rkey,
        };
        peer.qp.post_triggered(
            &self.arrivals,
            threshold,
            &SendWr::new(0, WrOp::Write(remote), &sge),
            self.opts(),
        )
    }

    fn token_to(&self, peer: &Peer<'_>, threshold: u64) -> Result<TriggerHandle, Error> {
        let token = [1u8; 8];
        peer.qp.post_triggered(
            &self.arrivals,
            threshold,
            &SendWr::inline(0, WrOp::Write(peer.remote), &token),
            self.opts(),
        )
    }

    fn opts(&self) -> TriggerOpts<'_> {
        TriggerOpts {
            completion: Some(&self.sends),
            ..Default::default()
        }
    }

    fn armed(&self, handles: Vec<TriggerHandle>, arrivals: u64, sends: u64) -> Armed {
        self.expect.set((arrivals, sends));
        Armed {
            start: self.arrivals.clone(),
            done: vec![
                (self.arrivals.clone(), arrivals),
                (self.sends.clone(), sends),
            ],
            handles,
        }
    }

    /// Arms a barrier (binomial tree rooted at the rank without `parent`).
    pub fn arm_barrier(
        &self,
        parent: Option<Peer<'_>>,
        children: &[Peer<'_>],
    ) -> Result<Armed, Error> {
        let (a, s) = self.bases()?;
        let c = children.len() as u64;
        let mut h = Vec::new();
        if let Some(p) = &parent {
            h.push(self.token_to(p, a + c + 1)?);
        }
        let down = a + c + 1 + parent.is_some() as u64;
        for ch in children {
            h.push(self.token_to(ch, down)?);
        }
        Ok(self.armed(h, down, s + parent.is_some() as u64 + c))
    }

    /// Arms a broadcast of `len` bytes from the root (the rank with `is_root`) down the
    /// binomial tree; `children` in [`tree_children`] order.
    pub fn arm_broadcast(
        &self,
        is_root: bool,
        children: &[Peer<'_>],
        len: u32,
    ) -> Result<Armed, Error> {
        if len == 0 || len as usize > self.capacity {
            return Err(Error::InvalidArgument(
                "broadcast length must be 1..=capacity bytes",
            ));
        }
        let (a, s) = self.bases()?;
        let have = a + 1 + !is_root as u64;
        let mut h = Vec::new();
        for (i, ch) in children.iter().enumerate() {
            if len < CHAIN_FROM || i == 0 {
                h.push(self.write_to(ch, 0, len, have)?);
            } else {
                // Large payloads go to one child after the other (the previous WRITE
                // acknowledged), so the largest subtree gets the whole link first.
                let sge = [self.mr.sge(DATA_OFF, len)];
                let remote = RemoteAddr {
                    addr: ch.remote.addr + DATA_OFF,
                    rkey: ch.remote.rkey,
                };
                h.push(ch.qp.post_triggered(
                    &self.sends,
                    s + i as u64,
                    &SendWr::new(0, WrOp::Write(remote), &sge),
                    self.opts(),
                )?);
            }
        }
        Ok(self.armed(h, have, s + children.len() as u64))
    }

    /// Arms an allreduce (sum) of `elems` u64 values written with
    /// [`CollMember::write_u64s`]; the result replaces them on every rank.
    pub fn arm_allreduce(
        &self,
        parent: Option<Peer<'_>>,
        children: &[Peer<'_>],
        elems: usize,
    ) -> Result<Armed, Error> {
        if elems == 0 || elems * 8 > self.capacity {
            return Err(Error::InvalidArgument(
                "allreduce needs 1..=capacity/8 elements",
            ));
        }
        let (a, s) = self.bases()?;
        let (c, k) = (children.len() as u64, elems as u64);
        let reduced = a + c * k + 1;
        let mut h = Vec::new();
        if let Some(p) = &parent {
            for j in 0..k {
                let result = [self.mr.sge(DATA_OFF + self.capacity as u64 + 8 * j, 8)];
                let remote = RemoteAddr {
                    addr: p.remote.addr + DATA_OFF + 8 * j,
                    rkey: p.remote.rkey,
                };
                let operand: Sge = self.mr.sge(DATA_OFF + 8 * j, 8);
                h.push(p.qp.post_triggered(
                    &self.arrivals,
                    reduced,
                    &SendWr::new(0, WrOp::FetchAdd { remote, add: 0 }, &result),
                    TriggerOpts {
                        operand: Some(operand),
                        ..self.opts()
                    },
                )?);
            }
        }
        let down = reduced + parent.is_some() as u64;
        for ch in children {
            h.push(self.write_to(ch, 0, (k * 8) as u32, down)?);
        }
        let own = if parent.is_some() { k } else { 0 };
        Ok(self.armed(h, down, s + own + c))
    }
}

impl Armed {
    /// Starts the collective on this rank (one posted register store).
    pub fn start(&self) {
        self.start.add(1);
    }

    /// Whether this rank's part is complete: everything it waits for arrived and its own
    /// transfers completed (read from the counters' writeback, no device access).
    pub fn is_done(&self) -> bool {
        self.done.iter().all(|(c, t)| c.get().0 >= *t)
    }

    /// The (counter, success threshold) pairs that define completion, for
    /// [`Counter::arm`] or [`Counter::wait`].
    pub fn done_conditions(&self) -> &[(Counter, u64)] {
        &self.done
    }

    /// The triggered operations this rank posted.
    pub fn ops(&self) -> usize {
        self.handles.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_trees_span_every_rank_once_for_any_root() {
        for n in 1..=70 {
            let depth = (n as f64).log2().ceil() as usize;
            for root in 0..n {
                assert_eq!(tree_parent(root, n, root), None);
                let mut seen = vec![0u32; n];
                seen[root] += 1;
                for r in 0..n {
                    let kids = tree_children(r, n, root);
                    for &k in &kids {
                        assert_eq!(tree_parent(k, n, root), Some(r), "n {n} root {root}");
                        seen[k] += 1;
                    }
                    // Largest subtree first.
                    let size = |c: usize| {
                        (0..n)
                            .filter(|&x| {
                                let mut y = x;
                                loop {
                                    if y == c {
                                        return true;
                                    }
                                    match tree_parent(y, n, root) {
                                        Some(p) => y = p,
                                        None => return false,
                                    }
                                }
                            })
                            .count()
                    };
                    let sizes: Vec<usize> = kids.iter().map(|&k| size(k)).collect();
                    assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
                    // Depth of every rank is at most ceil(log2 n).
                    let (mut d, mut x) = (0, r);
                    while let Some(p) = tree_parent(x, n, root) {
                        x = p;
                        d += 1;
                    }
                    assert!(d <= depth, "n {n} rank {r} depth {d}");
                }
                assert!(seen.iter().all(|&s| s == 1), "n {n} root {root}: {seen:?}");
            }
        }
    }

    #[test]
    fn the_eight_rank_tree_of_the_reference() {
        // triggered-ops reference §5.1, N = 8.
        assert_eq!(tree_children(0, 8, 0), vec![1, 2, 4]);
        assert_eq!(tree_children(1, 8, 0), vec![3, 5]);
        assert_eq!(tree_children(2, 8, 0), vec![6]);
        assert_eq!(tree_children(3, 8, 0), vec![7]);
        assert!(tree_children(4, 8, 0).is_empty());
        assert_eq!(tree_parent(7, 8, 0), Some(3));
        assert_eq!(tree_parent(6, 8, 0), Some(2));
        // Rooted elsewhere the shape moves with the root.
        assert_eq!(tree_children(5, 8, 5), vec![6, 7, 1]);
    }
}
