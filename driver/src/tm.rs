//! Hardware tag matching at the verbs level: creating a TM-SRQ, posting list operations
//! (ADD, DEL, SYNC) and reading the tag-matching fields of completions. The headers a tagged
//! message starts with ([`Tmh`], [`Rvh`]) are built by the sender into its own buffer.
//!
//! Handles of the matching list are chosen by the driver from a free list; a handle returns
//! to it when the device is done with the entry (its data completion, a successful DEL, or a
//! failed ADD). The driver asks the device for a completion of every ADD and DEL to learn
//! that, and hands the application only those it asked for.

use crate::cq::CompletionQueue;
use crate::device::DmaBuffer;
use crate::error::Error;
use crate::mr::{ProtectionDomain, Sge};
use crate::srq::{SharedReceiveQueue, SrqRings};
use ringbell_specs::cmd::{CmdOpcode, CreateSrqIn, CreateTmSrqIn};
use ringbell_specs::cqe::{Cqe, CqeOpcode, CqeStatus, CQE_FLAG_TM_DATA_VALID};
use ringbell_specs::regs;
pub use ringbell_specs::tm::{
    rndv_header, Rvh, Tmh, TmhOp, MAX_RNDV_HDR_SIZE, RNDV_HDR_LEN, RVH_LEN, TMH_LEN,
};
use ringbell_specs::tm::{TmOpEntry, TmOpcode, TM_OP_SIGNALED, TM_OP_SIZE, TM_OP_SYNC};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use zerocopy::IntoBytes;

/// What a list operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmOpKind {
    /// Append a tagged buffer: messages whose tag matches `tag` under `mask` land in `sge`
    /// (TMH stripped; a rendezvous is read into it by the NIC) and complete with
    /// `recv_wr_id`.
    Add {
        /// wr_id of the entry's receive completions.
        recv_wr_id: u64,
        /// The buffer (length 0 allowed).
        sge: Sge,
        /// Tag.
        tag: u64,
        /// Mask: 0 bits are "don't care".
        mask: u64,
    },
    /// Remove the entry `handle` (fails with TM_ERR if a message consumed it first).
    Del {
        /// The entry.
        handle: u32,
    },
    /// Only report the unexpected count.
    Sync,
}

/// A list operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmOp {
    /// wr_id of the operation's own completion.
    pub wr_id: u64,
    /// What it does.
    pub kind: TmOpKind,
    /// Deliver a completion for it (a failure always completes).
    pub signaled: bool,
    /// Software's count of unexpected messages, to bring the device back in sync.
    pub unexpected_cnt: Option<u32>,
    /// Output of an ADD: the entry's handle.
    pub handle: u32,
}

impl TmOp {
    /// An ADD of `sge` for `tag`/`mask`.
    pub fn add(wr_id: u64, recv_wr_id: u64, sge: Sge, tag: u64, mask: u64) -> TmOp {
        TmOp {
            wr_id,
            kind: TmOpKind::Add {
                recv_wr_id,
                sge,
                tag,
                mask,
            },
            signaled: true,
            unexpected_cnt: None,
            handle: 0,
        }
    }
    /// A DEL of `handle`.
    pub fn del(wr_id: u64, handle: u32) -> TmOp {
        TmOp {
            wr_id,
            kind: TmOpKind::Del { handle },
            signaled: true,
            unexpected_cnt: None,
            handle,
        }
    }
    /// A SYNC reporting `count`.
    pub fn sync(wr_id: u64, count: u32) -> TmOp {
        TmOp {
            wr_id,
            kind: TmOpKind::Sync,
            signaled: true,
            unexpected_cnt: Some(count),
            handle: 0,
        }
    }
    /// The same operation, also reporting `count`.
    pub fn with_count(mut self, count: u32) -> TmOp {
        self.unexpected_cnt = Some(count);
        self
    }
}

/// Parameters of [`ProtectionDomain::create_tm_srq`] beyond those of an SRQ.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TmCreate<'a> {
    pub(crate) cq: &'a CompletionQueue,
    pub(crate) max_num_tags: u32,
    pub(crate) max_ops: u32,
}

/// The list-operation ring of a TM-SRQ (owned by the SRQ handle).
#[derive(Debug)]
pub(crate) struct TmOps {
    ring: DmaBuffer,
    log: u8,
    pi: u32,
}

/// Tag-matching bookkeeping shared with the CQ.
#[derive(Debug)]
pub(crate) struct TmRings {
    op_mask: u32,
    op_wrid: Box<[Cell<u64>]>,
    op_signaled: Box<[Cell<bool>]>,
    ops_ci: Cell<u32>,
    recv_wrid: Box<[Cell<u64>]>,
    free: RefCell<VecDeque<u32>>,
}

impl TmRings {
    fn ops_free(&self, pi: u32) -> u32 {
        (self.op_mask + 1) - pi.wrapping_sub(self.ops_ci.get())
    }

    /// Handles and wr_ids of a TM completion that is not an untagged receive.
    pub(crate) fn complete(&self, c: &Cqe, op: CqeOpcode, status: CqeStatus) -> Option<u64> {
        let handle = c.tm_handle.get();
        if op.is_tm_op() {
            let ci = self.ops_ci.get();
            let counter = c.wqe_counter.get();
            let idx = ci.wrapping_add(counter.wrapping_sub(ci as u16) as u32);
            let slot = (idx & self.op_mask) as usize;
            self.ops_ci.set(idx.wrapping_add(1));
            let freed = match op {
                CqeOpcode::TmAdd => status != CqeStatus::Success,
                CqeOpcode::TmDel => status == CqeStatus::Success,
                _ => false,
            };
            if freed {
                self.free.borrow_mut().push_back(handle);
            }
            if !self.op_signaled[slot].get() && status == CqeStatus::Success {
                return None;
            }
            return Some(self.op_wrid[slot].get());
        }
        // A receive into a tagged buffer: done with the entry on its data completion.
        let wr_id = self.recv_wrid.get(handle as usize)?.get();
        if c.flags & CQE_FLAG_TM_DATA_VALID != 0 || status != CqeStatus::Success {
            self.free.borrow_mut().push_back(handle);
        }
        Some(wr_id)
    }
}

/// Sends CREATE_TM_SRQ; returns the SRQN and the bookkeeping.
pub(crate) fn create(
    pd: &ProtectionDomain,
    srq: CreateSrqIn,
    t: &TmCreate<'_>,
) -> Result<(u32, TmRings, TmOps), Error> {
    let caps = pd.dev.caps();
    if t.max_num_tags == 0
        || t.max_num_tags > caps.max_num_tags
        || t.max_ops == 0
        || t.max_ops > caps.max_tm_ops
    {
        return Err(Error::InvalidArgument(
            "max_num_tags or max_ops is 0 or beyond the device limit",
        ));
    }
    let log = t.max_ops.next_power_of_two().trailing_zeros().max(1) as u8;
    let ring = pd.dev.alloc_ring((1usize << log) * TM_OP_SIZE)?;
    let input = CreateTmSrqIn {
        srq,
        cqn: t.cq.cqn().into(),
        max_num_tags: t.max_num_tags.into(),
        ops_log_size: log,
        ops_iova: ring.iova().into(),
        ..Default::default()
    };
    let srqn = pd
        .dev
        .inner
        .create(CmdOpcode::CreateTmSrq, input.as_bytes())?;
    let n = 1u32 << log;
    let rings = TmRings {
        op_mask: n - 1,
        op_wrid: (0..n).map(|_| Cell::new(0)).collect(),
        op_signaled: (0..n).map(|_| Cell::new(false)).collect(),
        ops_ci: Cell::new(0),
        recv_wrid: (0..t.max_num_tags).map(|_| Cell::new(0)).collect(),
        free: RefCell::new((0..t.max_num_tags).collect()),
    };
    Ok((srqn, rings, TmOps { ring, log, pi: 0 }))
}

impl ProtectionDomain {
    /// Creates a TM-SRQ: an SRQ of `max_wr` untagged buffers of up to `max_sge` SGEs, a
    /// matching list of `max_num_tags` tagged buffers, room for `max_ops` list operations in
    /// flight, and `cq` for every completion of the TM-SRQ (receives, matches, list ops).
    pub fn create_tm_srq(
        &self,
        cq: &CompletionQueue,
        max_wr: u32,
        max_sge: u32,
        max_num_tags: u32,
        max_ops: u32,
    ) -> Result<SharedReceiveQueue, Error> {
        self.create_srq_inner(
            max_wr,
            max_sge,
            0,
            Some(TmCreate {
                cq,
                max_num_tags,
                max_ops,
            }),
            None,
        )
    }
}

impl SharedReceiveQueue {
    /// Free handles of the matching list (tagged buffers that can still be added).
    pub fn tm_free_tags(&self) -> usize {
        self.rings.tm.as_ref().map_or(0, |t| t.free.borrow().len())
    }

    /// Free entries of the list-operation ring: operations that can be posted now (0 for
    /// an SRQ without tag matching).
    pub fn tm_free_ops(&self) -> u32 {
        match (self.rings.tm.as_ref(), self.tm_ops.as_ref()) {
            (Some(t), Some(ring)) => t.ops_free(ring.pi),
            _ => 0,
        }
    }

    /// Posts list operations and rings the doorbell once. Each ADD gets its handle written
    /// back into `handle`. On an error the operations before the failing one are posted.
    pub fn post_tm_ops(&mut self, ops: &mut [TmOp]) -> Result<(), Error> {
        let (Some(t), Some(ring)) = (self.rings.tm.as_ref(), self.tm_ops.as_mut()) else {
            return Err(Error::InvalidArgument("not a TM-SRQ"));
        };
        let start = ring.pi;
        let mut result = Ok(());
        for op in ops.iter_mut() {
            let free = t.ops_free(ring.pi);
            if free == 0 {
                result = Err(Error::QueueFull {
                    queue: "TM operation ring",
                    needed: 1,
                    free,
                });
                break;
            }
            let mut e = TmOpEntry {
                index: (ring.pi as u16).into(),
                ..Default::default()
            };
            // ADD and DEL always complete on the device, so handles are returned; the
            // application sees only the completions it asked for.
            let mut flags = if op.signaled { TM_OP_SIGNALED } else { 0 };
            match op.kind {
                TmOpKind::Add {
                    recv_wr_id,
                    sge,
                    tag,
                    mask,
                } => {
                    let Some(h) = t.free.borrow_mut().pop_front() else {
                        result = Err(Error::QueueFull {
                            queue: "TM tag list",
                            needed: 1,
                            free: 0,
                        });
                        break;
                    };
                    op.handle = h;
                    t.recv_wrid[h as usize].set(recv_wr_id);
                    e.opcode = TmOpcode::Add as u8;
                    e.handle = h.into();
                    e.tag = tag.into();
                    e.mask = mask.into();
                    e.addr = sge.addr.into();
                    e.lkey = sge.lkey.into();
                    e.len = sge.len.into();
                    flags |= TM_OP_SIGNALED;
                }
                TmOpKind::Del { handle } => {
                    e.opcode = TmOpcode::Del as u8;
                    e.handle = handle.into();
                    flags |= TM_OP_SIGNALED;
                }
                TmOpKind::Sync => e.opcode = TmOpcode::Sync as u8,
            }
            if let Some(c) = op.unexpected_cnt {
                flags |= TM_OP_SYNC;
                e.unexpected_cnt = c.into();
            }
            e.flags = flags;
            let slot = (ring.pi & t.op_mask) as usize;
            t.op_wrid[slot].set(op.wr_id);
            t.op_signaled[slot].set(op.signaled);
            if let Err(err) = ring.ring.write(slot * TM_OP_SIZE, e.as_bytes()) {
                result = Err(err);
                break;
            }
            ring.pi = ring.pi.wrapping_add(1);
        }
        if ring.pi != start {
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            let db =
                regs::SRQ_DB_BASE + self.obj.srqn as u64 * regs::DB_STRIDE + regs::DB_SRQ_TM_OPS;
            self.obj.dev.inner.port.write32(db, ring.pi);
        }
        let _ = ring.log;
        result
    }
}

/// Whether a completion came from a TM-SRQ's list or a tagged buffer (not an untagged one).
pub(crate) fn tm_completion(
    rings: &SrqRings,
    c: &Cqe,
    op: CqeOpcode,
    status: CqeStatus,
) -> Option<u64> {
    rings.tm.as_ref()?.complete(c, op, status)
}
