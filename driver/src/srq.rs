//! Shared receive queues: one pool of receive WQEs for several QPs of a PD.

use crate::device::{Device, DmaBuffer, QueueMem, RING_ALIGN};
use crate::error::Error;
use crate::mr::{PdObject, ProtectionDomain};
use crate::qp::{write_recv_wqe, RecvWr};
use ringbell_specs::cmd::{ArmSrqIn, CmdOpcode, CreateSrqIn};
use ringbell_specs::regs;
use ringbell_specs::wqe::SEG;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use zerocopy::IntoBytes;

/// Receive bookkeeping shared with CQs.
///
/// The device takes SRQ WQEs in ring order and reads each one once, when it takes it
/// (ABI 5.2), but completes them in any order (several QPs, messages of several packets).
/// A completion of WQE `i` therefore proves that every WQE up to `i` has been taken, and
/// their ring slots may be written again at once, even if some of them are still being
/// filled: their wr_ids move to `held` until they complete. Slots thus come back out of
/// order, as from rdma-core's SRQ free list, and a ring of `n` entries always has room for
/// `n` buffers reposted as they complete.
#[derive(Debug)]
pub(crate) struct SrqRings {
    mask: u32,
    wrid: Box<[Cell<u64>]>,
    /// Every WQE before this index has been taken by the device; its slot is free unless
    /// reposted.
    taken: Cell<u32>,
    pi: Cell<u32>,
    /// WQEs taken and not completed whose slots may have been written again: (index,
    /// wr_id). At most one per QP filling a message, so short.
    held: RefCell<Vec<(u32, u64)>>,
    /// Tag-matching bookkeeping, for a TM-SRQ.
    pub(crate) tm: Option<crate::tm::TmRings>,
}

impl SrqRings {
    fn new(log: u8, tm: Option<crate::tm::TmRings>) -> SrqRings {
        SrqRings {
            mask: (1 << log) - 1,
            wrid: (0..1u32 << log).map(|_| Cell::new(0)).collect(),
            taken: Cell::new(0),
            pi: Cell::new(0),
            held: RefCell::new(Vec::with_capacity(16)),
            tm,
        }
    }

    /// Entries that can be posted now.
    fn free(&self, pi: u32) -> u32 {
        (self.mask + 1) - pi.wrapping_sub(self.taken.get())
    }

    /// An SRQ CQE for entry `counter` (the low 16 bits of its index): its wr_id, or `None`
    /// for an entry that is not posted or already completed (the CQE is skipped).
    pub(crate) fn complete(&self, counter: u16) -> Option<u64> {
        let taken = self.taken.get();
        let ahead = counter.wrapping_sub(taken as u16) as u32;
        if ahead < self.pi.get().wrapping_sub(taken) {
            let idx = taken.wrapping_add(ahead);
            // The WQEs before it were taken too and are still being filled: their slots are
            // free, their wr_ids wait for their completions. (In order: nothing to keep.)
            if ahead > 0 {
                let mut held = self.held.borrow_mut();
                for j in 0..ahead {
                    let j = taken.wrapping_add(j);
                    held.push((j, self.wrid[(j & self.mask) as usize].get()));
                }
            }
            self.taken.set(idx.wrapping_add(1));
            return Some(self.wrid[(idx & self.mask) as usize].get());
        }
        let mut held = self.held.borrow_mut();
        let i = held.iter().position(|&(j, _)| j as u16 == counter)?;
        Some(held.swap_remove(i).1)
    }
}

/// A shared receive queue.
#[derive(Debug)]
pub struct SharedReceiveQueue {
    pub(crate) obj: Rc<SrqObject>,
    log: u8,
    stride_log: u8,
    max_sge: u32,
    pi: u32,
    pub(crate) rings: Rc<SrqRings>,
    /// The list-operation ring of a TM-SRQ.
    pub(crate) tm_ops: Option<crate::tm::TmOps>,
}

impl ProtectionDomain {
    /// Creates an SRQ of at least `max_wr` entries with `max_sge` SGEs each; `limit` arms
    /// the SRQ_LIMIT event (0: not armed).
    pub fn create_srq(
        &self,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<SharedReceiveQueue, Error> {
        self.create_srq_inner(max_wr, max_sge, limit, None, None)
    }

    /// Creates an SRQ, or (with `tm`) a TM-SRQ whose list operations and every completion
    /// go through `tm`.
    pub(crate) fn create_srq_inner(
        &self,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
        tm: Option<crate::tm::TmCreate<'_>>,
        // An SRQ with a CQ of its own: of an XRC domain (an XRC SRQ), or of none (a receive
        // WQ, ABI 1.12).
        xrc: Option<(Option<&crate::Xrcd>, &crate::CompletionQueue)>,
    ) -> Result<SharedReceiveQueue, Error> {
        if max_wr == 0 || max_wr > self.dev.caps().max_qp_wr || max_sge == 0 || max_sge > 32 {
            return Err(Error::InvalidArgument("SRQ size or SGE count out of range"));
        }
        let log = max_wr.next_power_of_two().trailing_zeros().max(1) as u8;
        let stride_log = (max_sge as usize * SEG)
            .next_power_of_two()
            .trailing_zeros() as u8;
        let a = self.alloc.as_ref();
        let len = (1usize << log) << stride_log;
        let ring = self
            .dev
            .alloc_queue_mem(len, RING_ALIGN, QueueMem::Srq, a)?;
        let db = self.dev.alloc_queue_mem(64, 64, QueueMem::Doorbell, a)?;
        let input = CreateSrqIn {
            pdn: self.pdn.into(),
            log_size: log,
            log_stride: stride_log,
            limit: limit.into(),
            ring_iova: ring.iova().into(),
            db_iova: db.iova().into(),
            ..Default::default()
        };
        let (srqn, tm_rings, tm_ops) = match (tm, xrc) {
            (None, Some((None, cq))) => {
                let input = ringbell_specs::cmd::CreateWqIn {
                    srq: input,
                    cqn: cq.cqn().into(),
                    ..Default::default()
                };
                let n = self
                    .dev
                    .inner
                    .create(CmdOpcode::CreateWq, input.as_bytes())?;
                (n, None, None)
            }
            (None, Some((Some(x), cq))) => {
                let input = ringbell_specs::cmd::CreateXrcSrqIn {
                    srq: input,
                    xrcdn: x.num().into(),
                    cqn: cq.cqn().into(),
                };
                let n = self
                    .dev
                    .inner
                    .create(CmdOpcode::CreateXrcSrq, input.as_bytes())?;
                (n, None, None)
            }
            (None, None) => (
                self.dev
                    .inner
                    .create(CmdOpcode::CreateSrq, input.as_bytes())?,
                None,
                None,
            ),
            (Some(t), _) => {
                let (n, rings, ops) = crate::tm::create(self, input, &t)?;
                (n, Some(rings), Some(ops))
            }
        };
        let rings = Rc::new(SrqRings::new(log, tm_rings));
        self.dev.inner.srqs.borrow_mut().insert(srqn, rings.clone());
        let obj = Rc::new(SrqObject {
            dev: self.dev.clone(),
            srqn,
            ring,
            db,
            _pd: self.obj.clone(),
            _xrc: xrc.map(|(x, cq)| (x.cloned(), cq.keepalive())),
        });
        Ok(SharedReceiveQueue {
            obj,
            log,
            stride_log,
            max_sge,
            pi: 0,
            rings,
            tm_ops,
        })
    }
}

impl SharedReceiveQueue {
    /// The SRQ number.
    pub fn srqn(&self) -> u32 {
        self.obj.srqn
    }

    /// Its device.
    pub(crate) fn device(&self) -> &Device {
        &self.obj.dev
    }

    /// Whether this SRQ lives on `dev` (SRQ numbers are per device).
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        Rc::ptr_eq(&self.obj.dev.inner, &dev.inner)
    }

    /// A handle that keeps the SRQ alive (held by the QPs that use it).
    pub(crate) fn keepalive(&self) -> Rc<SrqObject> {
        self.obj.clone()
    }

    /// Posts receive requests and rings the doorbell once.
    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), Error> {
        let start = self.pi;
        let mut result = Ok(());
        for wr in wrs {
            let free = self.rings.free(self.pi);
            if free == 0 {
                result = Err(Error::QueueFull {
                    queue: "shared receive queue",
                    needed: 1,
                    free,
                });
                break;
            }
            if wr.sgl.len() > self.max_sge as usize {
                result = Err(Error::InvalidArgument("more SGEs than the SRQ's max_sge"));
                break;
            }
            let slot = (self.pi & ((1 << self.log) - 1)) as usize;
            if let Err(e) = write_recv_wqe(
                &self.obj.ring,
                slot << self.stride_log,
                1 << self.stride_log,
                wr.sgl,
            ) {
                result = Err(e);
                break;
            }
            self.rings.wrid[slot].set(wr.wr_id);
            self.pi = self.pi.wrapping_add(1);
            self.rings.pi.set(self.pi);
        }
        if self.pi != start {
            self.obj.db.mem().store_u32_release(0, self.pi);
            self.obj.dev.inner.port.write32(
                regs::SRQ_DB_BASE + self.obj.srqn as u64 * regs::DB_STRIDE,
                self.pi,
            );
        }
        result
    }

    /// Arms the SRQ_LIMIT event: it fires once fewer than `limit` WQEs remain.
    pub fn arm(&self, limit: u32) -> Result<(), Error> {
        let input = ArmSrqIn {
            srqn: self.obj.srqn.into(),
            limit: limit.into(),
        };
        self.obj
            .dev
            .inner
            .command(CmdOpcode::ArmSrq, input.as_bytes())
            .map(|_| ())
    }
}

/// The device object behind an SRQ and its memory; QPs on the SRQ hold it too.
#[derive(Debug)]
pub(crate) struct SrqObject {
    pub(crate) dev: Device,
    pub(crate) srqn: u32,
    ring: DmaBuffer,
    db: DmaBuffer,
    _pd: Rc<PdObject>,
    /// An XRC SRQ's domain and CQ (ABI 1.11), or a receive WQ's CQ (ABI 1.12).
    _xrc: Option<(Option<crate::Xrcd>, Rc<crate::cq::CqObject>)>,
}

impl Drop for SrqObject {
    fn drop(&mut self) {
        let _ = self.dev.inner.destroy(CmdOpcode::DestroySrq, self.srqn);
        self.dev.inner.srqs.borrow_mut().remove(&self.srqn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A model of the device (takes WQEs in ring order, completes the taken ones in any
        /// order) against the bookkeeping: every completion returns the wr_id posted for
        /// that WQE, exactly once, and a slot is offered again only once the device has
        /// taken the WQE in it.
        #[test]
        fn out_of_order_completion(
            log in 1u8..5,
            script in proptest::collection::vec((0u8..3, any::<u16>()), 1..400),
        ) {
            let r = SrqRings::new(log, None);
            let size = 1u32 << log;
            let (mut pi, mut dev_ci, mut next_id) = (0u32, 0u32, 0u64);
            // The device's view: index -> wr_id of WQEs taken and not completed.
            let mut filling: Vec<(u32, u64)> = Vec::new();
            let mut ring: Vec<Option<u64>> = vec![None; size as usize];
            for (what, pick) in script {
                match what {
                    0 => {
                        // Post while there is room; the slot must not hold an untaken WQE.
                        if r.free(pi) > 0 {
                            prop_assert!(pi.wrapping_sub(dev_ci) < size, "slot of an untaken WQE reused");
                            r.wrid[(pi & r.mask) as usize].set(next_id);
                            ring[(pi & r.mask) as usize] = Some(next_id);
                            pi += 1;
                            r.pi.set(pi);
                            next_id += 1;
                        }
                    }
                    1 => {
                        if dev_ci != pi {
                            let id = ring[(dev_ci & r.mask) as usize].take().unwrap();
                            filling.push((dev_ci, id));
                            dev_ci += 1;
                        }
                    }
                    _ => {
                        if !filling.is_empty() {
                            let (idx, id) = filling.remove(pick as usize % filling.len());
                            prop_assert_eq!(r.complete(idx as u16), Some(id));
                            prop_assert_eq!(r.complete(idx as u16), None, "completed twice");
                        }
                    }
                }
            }
            // Everything taken completes; then the whole ring is free again.
            while dev_ci != pi {
                let id = ring[(dev_ci & r.mask) as usize].take().unwrap();
                filling.push((dev_ci, id));
                dev_ci += 1;
            }
            for (idx, id) in filling.drain(..).rev() {
                prop_assert_eq!(r.complete(idx as u16), Some(id));
            }
            prop_assert_eq!(r.free(pi), size);
            prop_assert!(r.held.borrow().is_empty());
        }
    }
}
