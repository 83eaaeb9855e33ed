//! Shared receive queues: one pool of receive WQEs for several QPs of a PD.

use crate::device::{Device, DmaBuffer};
use crate::error::Error;
use crate::mr::{PdObject, ProtectionDomain};
use crate::qp::{write_recv_wqe, RecvWr};
use ringbell_specs::cmd::{ArmSrqIn, CmdOpcode, CreateSrqIn};
use ringbell_specs::regs;
use ringbell_specs::wqe::SEG;
use std::cell::Cell;
use std::rc::Rc;
use zerocopy::IntoBytes;

/// Receive bookkeeping shared with CQs. SRQ entries complete in any order (several QPs);
/// a slot is reused only once every slot before it has completed.
#[derive(Debug)]
pub(crate) struct SrqRings {
    mask: u32,
    wrid: Box<[Cell<u64>]>,
    done: Box<[Cell<bool>]>,
    ci: Cell<u32>,
    pi: Cell<u32>,
    /// Tag-matching bookkeeping, for a TM-SRQ.
    pub(crate) tm: Option<crate::tm::TmRings>,
}

impl SrqRings {
    /// An SRQ CQE for entry `counter`: its wr_id, or `None` for an entry that is not posted
    /// or already completed (the CQE is skipped).
    pub(crate) fn complete(&self, counter: u16) -> Option<u64> {
        let ci = self.ci.get();
        let idx = ci.wrapping_add(counter.wrapping_sub(ci as u16) as u32);
        let slot = (idx & self.mask) as usize;
        if idx.wrapping_sub(ci) >= self.pi.get().wrapping_sub(ci) || self.done[slot].get() {
            return None;
        }
        self.done[slot].set(true);
        loop {
            let s = (self.ci.get() & self.mask) as usize;
            if self.ci.get() == self.pi.get() || !self.done[s].get() {
                break;
            }
            self.done[s].set(false);
            self.ci.set(self.ci.get().wrapping_add(1));
        }
        Some(self.wrid[slot].get())
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
        self.create_srq_inner(max_wr, max_sge, limit, None)
    }

    /// Creates an SRQ, or (with `tm`) a TM-SRQ whose list operations and every completion
    /// go through `tm`.
    pub(crate) fn create_srq_inner(
        &self,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
        tm: Option<crate::tm::TmCreate<'_>>,
    ) -> Result<SharedReceiveQueue, Error> {
        if max_wr == 0 || max_wr > self.dev.caps().max_qp_wr || max_sge == 0 || max_sge > 32 {
            return Err(Error::InvalidArgument("SRQ size or SGE count out of range"));
        }
        let log = max_wr.next_power_of_two().trailing_zeros().max(1) as u8;
        let stride_log = (max_sge as usize * SEG)
            .next_power_of_two()
            .trailing_zeros() as u8;
        let ring = self.dev.alloc_dma((1usize << log) << stride_log)?;
        let db = self.dev.alloc_dma(64)?;
        let input = CreateSrqIn {
            pdn: self.pdn.into(),
            log_size: log,
            log_stride: stride_log,
            limit: limit.into(),
            ring_iova: ring.iova().into(),
            db_iova: db.iova().into(),
            ..Default::default()
        };
        let (srqn, tm_rings, tm_ops) = match tm {
            None => (
                self.dev
                    .inner
                    .create(CmdOpcode::CreateSrq, input.as_bytes())?,
                None,
                None,
            ),
            Some(t) => {
                let (n, rings, ops) = crate::tm::create(self, input, &t)?;
                (n, Some(rings), Some(ops))
            }
        };
        let rings = Rc::new(SrqRings {
            mask: (1 << log) - 1,
            wrid: (0..1u32 << log).map(|_| Cell::new(0)).collect(),
            done: (0..1u32 << log).map(|_| Cell::new(false)).collect(),
            ci: Cell::new(0),
            pi: Cell::new(0),
            tm: tm_rings,
        });
        self.dev.inner.srqs.borrow_mut().insert(srqn, rings.clone());
        let obj = Rc::new(SrqObject {
            dev: self.dev.clone(),
            srqn,
            ring,
            db,
            _pd: self.obj.clone(),
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
            let free = (1u32 << self.log) - self.pi.wrapping_sub(self.rings.ci.get());
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
        /// Completions in any order return the right wr_id, and the consumer index only passes
        /// a slot once every slot before it has completed.
        #[test]
        fn out_of_order_completion(order in Just((0u32..16).collect::<Vec<_>>()).prop_shuffle()) {
            let r = SrqRings {
                mask: 15,
                wrid: (0..16).map(|i| Cell::new(100 + i)).collect(),
                done: (0..16).map(|_| Cell::new(false)).collect(),
                ci: Cell::new(0),
                pi: Cell::new(16),
                tm: None,
            };
            let mut finished = [false; 16];
            for idx in order {
                prop_assert_eq!(r.complete(idx as u16), Some(100 + idx as u64));
                prop_assert_eq!(r.complete(idx as u16), None, "completed twice");
                finished[idx as usize] = true;
                let expect = finished.iter().take_while(|f| **f).count() as u32;
                prop_assert_eq!(r.ci.get(), expect);
            }
        }
    }
}
