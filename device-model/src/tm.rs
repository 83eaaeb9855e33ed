//! Hardware tag matching on a TM-SRQ: the matching list, list operations, the
//! unexpected-count synchronization, and the completions of tagged receives.
//!
//! The list holds up to `max_num_tags` entries in slots the driver names. An entry appended
//! while hardware and software disagree on the number of unexpected messages is disabled
//! until a list operation reports the right count; entries appended earlier keep matching.
//! Matching searches enabled entries oldest first with `((tag ^ entry) & mask) == 0`.

use crate::env::Env;
use crate::mem::KeyError;
use crate::nic::Nic;
use crate::qp::{Sge, WorkQueue};
use ringbell_specs::cmd::Access;
use ringbell_specs::cqe::{
    Cqe, CqeOpcode, CqeStatus, DoorbellError, VendorSyndrome, CQE_FLAG_SRQ, CQE_FLAG_TM_DATA_VALID,
    CQE_FLAG_TM_MATCH, CQE_FLAG_TM_SYNC_REQ,
};
use ringbell_specs::tm::{
    tag_matches, TmOpEntry, TmOpcode, TM_OP_SIGNALED, TM_OP_SIZE, TM_OP_SYNC,
};
use zerocopy::FromBytes;

/// Where a slot of the matching list is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// Not in the list: an ADD may fill it.
    Free,
    /// In the list, waiting for a message.
    Listed,
    /// Matched; its data is still arriving (multi-packet eager, rendezvous read).
    Busy,
}

/// One slot of the matching list.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TmSlot {
    pub(crate) state: SlotState,
    pub(crate) tag: u64,
    pub(crate) mask: u64,
    pub(crate) sge: Sge,
    pub(crate) enabled: bool,
    /// Append order.
    pub(crate) seq: u64,
}

/// Tag-matching state of a TM-SRQ.
#[derive(Debug)]
pub(crate) struct TmState {
    /// CQ of every completion of the TM-SRQ.
    pub(crate) cqn: u32,
    pub(crate) slots: Vec<TmSlot>,
    seq: u64,
    /// Unexpected tagged messages delivered (16 bits, wrapping).
    pub(crate) hw_cnt: u16,
    /// The count software last reported.
    pub(crate) sw_cnt: u16,
    /// The list-operation ring.
    pub(crate) ops: WorkQueue,
}

impl TmState {
    pub(crate) fn new(cqn: u32, tags: u32, ops: WorkQueue) -> TmState {
        let free = TmSlot {
            state: SlotState::Free,
            tag: 0,
            mask: 0,
            sge: Sge {
                lkey: 0,
                addr: 0,
                len: 0,
            },
            enabled: false,
            seq: 0,
        };
        TmState {
            cqn,
            slots: vec![free; tags as usize],
            seq: 0,
            hw_cnt: 0,
            sw_cnt: 0,
            ops,
        }
    }

    fn in_sync(&self) -> bool {
        self.hw_cnt == self.sw_cnt
    }

    /// Software reports its count: in sync again, every listed entry matches.
    fn report(&mut self, count: u32) {
        self.sw_cnt = count as u16;
        if self.in_sync() {
            for s in self
                .slots
                .iter_mut()
                .filter(|s| s.state == SlotState::Listed)
            {
                s.enabled = true;
            }
        }
    }

    /// The oldest enabled entry matching `tag`, and how many entries a walk of the list in
    /// order compares to find it (all enabled entries on a miss).
    pub(crate) fn find(&self, tag: u64) -> (Option<usize>, usize) {
        let mut best: Option<usize> = None;
        let mut enabled = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.state != SlotState::Listed || !s.enabled {
                continue;
            }
            enabled += 1;
            if tag_matches(tag, s.tag, s.mask) && best.is_none_or(|b| self.slots[b].seq > s.seq) {
                best = Some(i);
            }
        }
        let compared = match best {
            Some(b) => {
                let seq = self.slots[b].seq;
                self.slots
                    .iter()
                    .filter(|s| s.state == SlotState::Listed && s.enabled && s.seq <= seq)
                    .count()
            }
            None => enabled,
        };
        (best, compared)
    }

    /// A message went unexpected: hardware is out of sync until software reports it.
    pub(crate) fn count_unexpected(&mut self) {
        self.hw_cnt = self.hw_cnt.wrapping_add(1);
    }
}

/// What a completion of a TM-SRQ reports.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TmCompletion {
    pub(crate) opcode: u8,
    pub(crate) status: u8,
    pub(crate) syndrome: u8,
    pub(crate) flags: u8,
    /// `Cqe::ext_flags` (ABI 1.9).
    pub(crate) ext_flags: u8,
    pub(crate) counter: u32,
    pub(crate) qpn: u32,
    pub(crate) handle: u32,
    pub(crate) tag: u64,
    pub(crate) app_ctx: u32,
    pub(crate) byte_len: u32,
    pub(crate) imm: u32,
}

impl Nic {
    /// Writes a completion to a TM-SRQ's CQ.
    pub(crate) fn tm_complete(&mut self, env: &mut dyn Env, srqn: u32, c: TmCompletion) {
        let Some(tm) = self.srqs.get(srqn).and_then(|s| s.tm.as_ref()) else {
            return;
        };
        let (cqn, hw_cnt) = (tm.cqn, tm.hw_cnt);
        let cqe = Cqe {
            opcode: c.opcode,
            status: c.status,
            wqe_counter: (c.counter as u16).into(),
            qpn: c.qpn.into(),
            byte_len: c.byte_len.into(),
            imm: c.imm.into(),
            flags: c.flags,
            ext_flags: c.ext_flags,
            vendor_syndrome: c.syndrome,
            srqn: srqn.into(),
            tm_tag: c.tag.into(),
            tm_app_ctx: c.app_ctx.into(),
            tm_handle: c.handle.into(),
            tm_hw_cnt: hw_cnt.into(),
            ..Default::default()
        };
        let now = env.now();
        self.complete(env, 0, cqn, now, cqe);
    }

    /// The list-operation doorbell of TM-SRQ `srqn`: runs every operation up to `value`.
    pub(crate) fn tm_ops_doorbell(&mut self, env: &mut dyn Env, srqn: u32, value: u32) {
        let Some(tm) = self.srqs.get_mut(srqn).and_then(|s| s.tm.as_mut()) else {
            self.doorbell_error(env, srqn, DoorbellError::NoSuchObject, value);
            return;
        };
        let ops = &mut tm.ops;
        if value.wrapping_sub(ops.ci) > ops.size() || (value.wrapping_sub(ops.pi) as i32) < 0 {
            self.doorbell_error(env, srqn, DoorbellError::IndexOutOfRange, value);
            return;
        }
        ops.pi = value;
        loop {
            let Some(tm) = self.srqs.get_mut(srqn).and_then(|s| s.tm.as_mut()) else {
                return;
            };
            if tm.ops.ci == tm.ops.pi {
                return;
            }
            let index = tm.ops.ci;
            let at = tm.ops.slot_iova(index, TM_OP_SIZE as u64);
            let mut raw = [0u8; TM_OP_SIZE];
            if let Err(f) = env.dma_read(at, &mut raw) {
                self.iommu_fault(env, 0, f.iova);
                return;
            }
            let op = TmOpEntry::read_from_bytes(&raw).unwrap_or_default();
            if op.index.get() != index as u16 || op.opcode == 0 {
                // Not written (or not visible) before the doorbell: forget the rest.
                if let Some(tm) = self.srqs.get_mut(srqn).and_then(|s| s.tm.as_mut()) {
                    tm.ops.pi = index;
                }
                self.doorbell_error(env, srqn, DoorbellError::StaleWqe, index);
                return;
            }
            if let Some(tm) = self.srqs.get_mut(srqn).and_then(|s| s.tm.as_mut()) {
                tm.ops.ci = index.wrapping_add(1);
            }
            self.tm_exec_op(env, srqn, index, &op);
        }
    }

    fn tm_exec_op(&mut self, env: &mut dyn Env, srqn: u32, index: u32, op: &TmOpEntry) {
        let pdn = self.srqs.get(srqn).map_or(0, |s| s.pdn);
        let handle = op.handle.get();
        let sge = Sge {
            lkey: op.lkey.get(),
            addr: op.addr.get(),
            len: op.len.get(),
        };
        // A buffer the device could never write is refused when it is added.
        let key = if sge.len == 0 {
            Ok(0)
        } else {
            self.check_key(pdn, sge.lkey, sge.addr, sge.len as u64, Access::LOCAL_WRITE)
        };
        let Some(tm) = self.srqs.get_mut(srqn).and_then(|s| s.tm.as_mut()) else {
            return;
        };
        if op.flags & TM_OP_SYNC != 0 {
            tm.report(op.unexpected_cnt.get());
        }
        let out_of_sync = !tm.in_sync();
        let mut c = TmCompletion {
            counter: index,
            handle,
            ..Default::default()
        };
        let (opcode, status, syndrome) = match TmOpcode::from_u8(op.opcode) {
            Some(TmOpcode::Add) => {
                let status = match (tm.slots.get(handle as usize).map(|s| s.state), key) {
                    (Some(SlotState::Free), Ok(_)) => {
                        tm.seq += 1;
                        tm.slots[handle as usize] = TmSlot {
                            state: SlotState::Listed,
                            tag: op.tag.get(),
                            mask: op.mask.get(),
                            sge,
                            enabled: !out_of_sync,
                            seq: tm.seq,
                        };
                        (CqeStatus::Success, VendorSyndrome::None)
                    }
                    (Some(SlotState::Free), Err(e)) => {
                        (CqeStatus::LocProtErr, KeyError::syndrome(e))
                    }
                    _ => (CqeStatus::TmErr, VendorSyndrome::None),
                };
                (CqeOpcode::TmAdd, status.0, status.1)
            }
            Some(TmOpcode::Del) => match tm.slots.get_mut(handle as usize) {
                Some(s) if s.state == SlotState::Listed => {
                    s.state = SlotState::Free;
                    (CqeOpcode::TmDel, CqeStatus::Success, VendorSyndrome::None)
                }
                // Consumed by a message, never added, or beyond the list.
                _ => (CqeOpcode::TmDel, CqeStatus::TmErr, VendorSyndrome::None),
            },
            Some(TmOpcode::Sync) => (CqeOpcode::TmSync, CqeStatus::Success, VendorSyndrome::None),
            None => (
                CqeOpcode::TmSync,
                CqeStatus::LocQpOpErr,
                VendorSyndrome::BadOpcode,
            ),
        };
        // A failed operation always reports, so software learns about it.
        if op.flags & TM_OP_SIGNALED != 0 || status != CqeStatus::Success {
            c.opcode = opcode as u8;
            c.status = status as u8;
            c.syndrome = syndrome as u8;
            if out_of_sync && matches!(opcode, CqeOpcode::TmAdd | CqeOpcode::TmDel) {
                c.flags = CQE_FLAG_TM_SYNC_REQ;
            }
            self.tm_complete(env, srqn, c);
        }
    }

    /// Releases slot `handle` of TM-SRQ `srqn` once its message is done.
    pub(crate) fn tm_free_slot(&mut self, srqn: u32, handle: u32) {
        if let Some(s) = self
            .srqs
            .get_mut(srqn)
            .and_then(|s| s.tm.as_mut())
            .and_then(|t| t.slots.get_mut(handle as usize))
        {
            s.state = SlotState::Free;
        }
    }
}

/// Flags of the completion of a receive that matched.
pub(crate) const MATCHED_DATA: u8 = CQE_FLAG_TM_MATCH | CQE_FLAG_TM_DATA_VALID;
/// Flags of an untagged receive's completion.
pub(crate) const UNTAGGED: u8 = CQE_FLAG_SRQ;

#[cfg(test)]
mod tests {
    use super::*;

    fn state(n: u32) -> TmState {
        TmState::new(1, n, WorkQueue::default())
    }

    fn add(t: &mut TmState, h: usize, tag: u64, mask: u64) {
        t.seq += 1;
        let enabled = t.in_sync();
        t.slots[h] = TmSlot {
            state: SlotState::Listed,
            tag,
            mask,
            sge: Sge {
                lkey: 0,
                addr: 0,
                len: 0,
            },
            enabled,
            seq: t.seq,
        };
    }

    #[test]
    fn oldest_enabled_match_wins_and_out_of_sync_entries_wait() {
        let mut t = state(8);
        add(&mut t, 5, 0x10, u64::MAX);
        add(&mut t, 2, 0x10, u64::MAX);
        add(&mut t, 3, 0, 0);
        assert_eq!(t.find(0x10).0, Some(5), "appended first");
        assert_eq!(t.find(0x99).0, Some(3), "mask 0 matches anything");
        t.slots[3].state = SlotState::Free;
        t.count_unexpected();
        add(&mut t, 0, 0x77, u64::MAX);
        assert_eq!(t.find(0x77).0, None, "appended out of sync: disabled");
        assert_eq!(t.find(0x10).0, Some(5), "older entries keep matching");
        t.report(0);
        assert_eq!(t.find(0x77).0, None, "a stale count changes nothing");
        t.report(1);
        assert_eq!(t.find(0x77).0, Some(0));
    }
}
