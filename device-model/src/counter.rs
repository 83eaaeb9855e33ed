//! Event counters and triggered operations (ABI 1.3).
//!
//! A counter holds a success and an error value (64 bits each, wrapping). Completions of a
//! QP's posted work, receives and remote accesses add to the counters bound to them; the
//! host adds through the counter's MMIO window or UPDATE_CNTR. Every change is written back
//! to host memory when the counter has a writeback address, ends an armed wait with a
//! COUNTER event, and releases the triggered operations it satisfies.
//!
//! Triggered operations wait in one bounded table. Each counter keeps the ones that wait on
//! it ordered by (threshold, post sequence); a change pops every satisfied entry, in that
//! order, into the NIC's dispatch FIFO. The FIFO is drained in order, and a counter
//! operation taken from it may release more entries behind the ones already there, so one
//! update that passes several thresholds fires them in threshold order, then submission
//! order, and nothing is executed recursively. An entry leaves the table when it fires (or
//! is cancelled or flushed): it can never fire twice. A data transfer that fires becomes a
//! task of the NIC's own on its QP's send side; its completion adds one to its completion
//! counter (success or error) and writes a CQE flagged TRIGGERED when asked or on error.

use crate::env::{trace, Env, NicEvent, Stage, TraceEvent};
use crate::mem::key_index;
use crate::nic::Nic;
use crate::qp::{HwTask, SendWqe};
use ringbell_specs::cmd::*;
use ringbell_specs::cqe::{CntrWaitEnd, Cqe, CqeStatus, EventType, VendorSyndrome};
use ringbell_specs::wqe::{CtrlSeg, SendOpcode, SEG, WQEBB};
use ringbell_specs::SimTime;
use std::collections::{BTreeMap, VecDeque};
use zerocopy::{FromBytes, IntoBytes};

type Outcome = Result<Vec<u8>, CmdStatus>;

/// The counters bound to one QP or MR, one per event kind (bit n of [`CntrEvents`]).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct EventCntrs(pub(crate) [u32; 6]);

impl EventCntrs {
    /// The counter bound to `ev` (a single event bit), 0 when none.
    pub(crate) fn get(&self, ev: CntrEvents) -> u32 {
        if ev.is_empty() {
            return 0;
        }
        self.0[ev.bits().trailing_zeros() as usize % 6]
    }
    pub(crate) fn any(&self) -> bool {
        self.0.iter().any(|&c| c != 0)
    }
}

/// One event counter.
#[derive(Debug)]
pub(crate) struct Counter {
    pub(crate) pdn: u32,
    pub(crate) gen: u64,
    pub(crate) success: u64,
    pub(crate) error: u64,
    /// Writeback address; dropped after the first DMA fault.
    wb: Option<u64>,
    /// Bindings and triggered operations that name the counter.
    refs: u32,
    /// Armed wait: threshold and the error value when armed.
    wait: Option<(u64, u64)>,
    /// Pending operations compared with success + error, by (threshold, sequence).
    on_sum: BTreeMap<(u64, u64), u32>,
    /// Pending operations compared with success only.
    on_success: BTreeMap<(u64, u64), u32>,
}

/// What a triggered operation does when it fires.
#[derive(Debug)]
enum TrigOp {
    Wqe {
        qpn: u32,
        qp_gen: u64,
        wqe: SendWqe,
        operand: Option<(u32, u64)>,
        comp: u32,
        signaled: bool,
        wr_id: u64,
    },
    Cntr {
        target: u32,
        assign: bool,
        success: u64,
        error: u64,
    },
}

/// A pending triggered operation.
#[derive(Debug)]
struct Trigger {
    pdn: u32,
    cntr: u32,
    key: (u64, u64),
    op: TrigOp,
}

/// The triggered-operation table and the dispatch FIFO.
#[derive(Debug, Default)]
pub(crate) struct TriggerTable {
    slots: Vec<Option<Trigger>>,
    gens: Vec<u16>,
    free: Vec<u32>,
    in_use: u32,
    seq: u64,
    fifo: VecDeque<(u32, Trigger)>,
    draining: bool,
}

impl TriggerTable {
    /// Operations waiting in the table.
    pub fn in_use(&self) -> u32 {
        self.in_use
    }
    fn handle(&self, slot: u32) -> u32 {
        (self.gens[slot as usize] as u32) << 16 | (slot + 1)
    }
    /// The slot a live handle names.
    fn slot_of(&self, handle: u32) -> Option<u32> {
        let slot = (handle & 0xFFFF).checked_sub(1)?;
        let live = self.slots.get(slot as usize)?.is_some();
        (live && self.gens[slot as usize] as u32 == handle >> 16).then_some(slot)
    }
    fn insert(&mut self, cap: u32, t: Trigger) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None if (self.slots.len() as u32) < cap.min(0xFFFF) => {
                self.slots.push(None);
                self.gens.push(0);
                self.slots.len() as u32 - 1
            }
            None => return None,
        };
        self.slots[slot as usize] = Some(t);
        self.in_use += 1;
        Some(slot)
    }
    fn take(&mut self, slot: u32) -> Option<(u32, Trigger)> {
        let t = self.slots.get_mut(slot as usize)?.take()?;
        let handle = self.handle(slot);
        self.gens[slot as usize] = self.gens[slot as usize].wrapping_add(1);
        self.free.push(slot);
        self.in_use -= 1;
        Some((handle, t))
    }
}

/// The event a completed send WQE of opcode `op` counts as.
pub(crate) fn send_event(op: SendOpcode) -> CntrEvents {
    match op {
        SendOpcode::Send | SendOpcode::SendImm | SendOpcode::SendInv => CntrEvents::SEND,
        SendOpcode::Write | SendOpcode::WriteImm | SendOpcode::AtomicWrite => CntrEvents::WRITE,
        SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd => CntrEvents::READ,
        // Work of the NIC's own: no transfer to count.
        SendOpcode::BindMw | SendOpcode::LocalInv => CntrEvents::empty(),
    }
}

/// Whether a CQE reports a message received on its QP (once per message: a tagged match
/// whose data is still on its way is not one).
pub(crate) fn counts_as_recv(cqe: &Cqe) -> bool {
    use ringbell_specs::cqe::{CqeOpcode, CQE_FLAG_TM_DATA_VALID, CQE_FLAG_TM_MATCH};
    match CqeOpcode::from_u8(cqe.opcode) {
        Some(CqeOpcode::Recv | CqeOpcode::RecvRdmaWithImm | CqeOpcode::TmNoTag) => true,
        Some(CqeOpcode::TmRecv) => {
            cqe.status != 0
                || cqe.flags & CQE_FLAG_TM_MATCH == 0
                || cqe.flags & CQE_FLAG_TM_DATA_VALID != 0
        }
        _ => false,
    }
}

/// Decodes the one-block send WQE of a triggered operation.
fn decode_wqe(body: &[u8], max_msg: u32) -> Option<SendWqe> {
    let ctrl = CtrlSeg::read_from_bytes(body.get(..SEG)?).ok()?;
    let ds = ctrl.ds_count as usize;
    if ds == 0 || ds * SEG > WQEBB {
        return None;
    }
    let op = SendOpcode::from_u8(ctrl.opcode)?;
    // Memory-window work is not a transfer a counter can trigger (ABI 1.9).
    if op.is_local() || op == SendOpcode::SendInv {
        return None;
    }
    crate::requester::decode_send_wqe(&ctrl, op, &body[SEG..ds * SEG], 1, max_msg).ok()
}

impl Nic {
    /// Executes a counter or triggered-operation command.
    pub(crate) fn cntr_command(
        &mut self,
        env: &mut dyn Env,
        op: CmdOpcode,
        input: &[u8],
    ) -> Outcome {
        match op {
            CmdOpcode::CreateCntr => {
                let c: CreateCntrIn = read_params(input).ok_or(CmdStatus::BadParam)?;
                let wb = c.wb_iova.get();
                if c.flags.get() != 0 || !wb.is_multiple_of(16) {
                    return Err(CmdStatus::BadParam);
                }
                if wb != 0 && env.dma_check(wb, 16).is_err() {
                    return Err(CmdStatus::DmaFault);
                }
                let pdn = c.pdn.get();
                self.pds.get(pdn).ok_or(CmdStatus::BadResource)?;
                let gen = self.fresh_gen();
                let n = self
                    .cntrs
                    .insert_with(|_| Counter {
                        pdn,
                        gen,
                        success: 0,
                        error: 0,
                        wb: (wb != 0).then_some(wb),
                        refs: 0,
                        wait: None,
                        on_sum: BTreeMap::new(),
                        on_success: BTreeMap::new(),
                    })
                    .ok_or(CmdStatus::Exhausted)?;
                if let Some(pd) = self.pds.get_mut(pdn) {
                    pd.refs += 1;
                }
                self.cntr_writeback(env, n);
                Ok(ObjectOut { num: n.into() }.as_bytes().to_vec())
            }
            CmdOpcode::DestroyCntr => {
                let n = read_params::<ObjectIn>(input)
                    .ok_or(CmdStatus::BadParam)?
                    .num
                    .get();
                let c = self.cntrs.get(n).ok_or(CmdStatus::BadResource)?;
                if c.refs > 0 {
                    return Err(CmdStatus::Busy);
                }
                let pdn = c.pdn;
                self.cntrs.remove(n);
                if let Some(pd) = self.pds.get_mut(pdn) {
                    pd.refs = pd.refs.saturating_sub(1);
                }
                Ok(Vec::new())
            }
            CmdOpcode::UpdateCntr => {
                let u: UpdateCntrIn = read_params(input).ok_or(CmdStatus::BadParam)?;
                let flags = u.flags.get();
                if flags & !(CNTR_ASSIGN_SUCCESS | CNTR_ASSIGN_ERROR) != 0 {
                    return Err(CmdStatus::BadParam);
                }
                let n = u.cntr.get();
                self.cntrs.get(n).ok_or(CmdStatus::BadResource)?;
                self.cntr_apply(
                    env,
                    n,
                    (u.success.get(), flags & CNTR_ASSIGN_SUCCESS != 0),
                    (u.error.get(), flags & CNTR_ASSIGN_ERROR != 0),
                );
                Ok(Vec::new())
            }
            CmdOpcode::QueryCntr => {
                let n = read_params::<ObjectIn>(input)
                    .ok_or(CmdStatus::BadParam)?
                    .num
                    .get();
                let c = self.cntrs.get(n).ok_or(CmdStatus::BadResource)?;
                let out = QueryCntrOut {
                    success: c.success.into(),
                    error: c.error.into(),
                    pdn: c.pdn.into(),
                    pending: ((c.on_sum.len() + c.on_success.len()) as u32).into(),
                    refs: c.refs.into(),
                    ..Default::default()
                };
                Ok(out.as_bytes().to_vec())
            }
            CmdOpcode::BindCntr => self.bind_cntr(read_params(input).ok_or(CmdStatus::BadParam)?),
            CmdOpcode::ArmCntr => {
                let a: ArmCntrIn = read_params(input).ok_or(CmdStatus::BadParam)?;
                let n = a.cntr.get();
                let c = self.cntrs.get_mut(n).ok_or(CmdStatus::BadResource)?;
                c.wait = Some((a.threshold.get(), c.error));
                self.cntr_check_wait(env, n);
                Ok(Vec::new())
            }
            CmdOpcode::PostTriggered => {
                let t: PostTriggeredIn = read_params(input).ok_or(CmdStatus::BadParam)?;
                self.post_triggered(env, &t)
            }
            CmdOpcode::CancelTriggered => {
                let h = read_params::<ObjectIn>(input)
                    .ok_or(CmdStatus::BadParam)?
                    .num
                    .get();
                let slot = self.trig.slot_of(h).ok_or(CmdStatus::BadResource)?;
                self.trig_discard(slot);
                Ok(Vec::new())
            }
            CmdOpcode::FlushTriggered => {
                let f: FlushTriggeredIn = read_params(input).ok_or(CmdStatus::BadParam)?;
                let (pdn, cntr) = (f.pdn.get(), f.cntr.get());
                self.pds.get(pdn).ok_or(CmdStatus::BadResource)?;
                if cntr != 0 {
                    let c = self.cntrs.get(cntr).ok_or(CmdStatus::BadResource)?;
                    if c.pdn != pdn {
                        return Err(CmdStatus::BadPd);
                    }
                }
                let hit: Vec<u32> = (0..self.trig.slots.len() as u32)
                    .filter(|&s| {
                        self.trig.slots[s as usize]
                            .as_ref()
                            .is_some_and(|t| t.pdn == pdn && (cntr == 0 || t.cntr == cntr))
                    })
                    .collect();
                for &s in &hit {
                    self.trig_discard(s);
                }
                let out = FlushTriggeredOut {
                    flushed: (hit.len() as u32).into(),
                };
                Ok(out.as_bytes().to_vec())
            }
            _ => Err(CmdStatus::BadOpcode),
        }
    }

    fn bind_cntr(&mut self, b: BindCntrIn) -> Outcome {
        let n = b.cntr.get();
        let pdn = self.cntrs.get(n).ok_or(CmdStatus::BadResource)?.pdn;
        let events = CntrEvents::from_bits(b.events.get()).ok_or(CmdStatus::BadParam)?;
        let unbind = match b.flags {
            0 => false,
            CNTR_BIND_UNBIND => true,
            _ => return Err(CmdStatus::BadParam),
        };
        if events.is_empty() {
            return Err(CmdStatus::BadParam);
        }
        let obj = b.obj.get();
        let (slots, obj_pdn) = match b.kind {
            CNTR_BIND_QP => {
                let qp = self.qps.get(obj).ok_or(CmdStatus::BadResource)?;
                (qp.cntrs, qp.pdn)
            }
            CNTR_BIND_MR => {
                let mr = self
                    .mrs
                    .get(key_index(obj))
                    .filter(|m| m.key == obj)
                    .ok_or(CmdStatus::BadResource)?;
                if !(CntrEvents::REMOTE_READ | CntrEvents::REMOTE_WRITE).contains(events) {
                    return Err(CmdStatus::BadParam);
                }
                let can_read = mr.access.contains(Access::REMOTE_READ);
                let can_write = mr
                    .access
                    .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
                if !unbind
                    && ((events.contains(CntrEvents::REMOTE_READ) && !can_read)
                        || (events.contains(CntrEvents::REMOTE_WRITE) && !can_write))
                {
                    return Err(CmdStatus::BadParam);
                }
                (mr.cntrs, mr.pdn)
            }
            _ => return Err(CmdStatus::BadParam),
        };
        if obj_pdn != pdn {
            return Err(CmdStatus::BadPd);
        }
        let mut new = slots;
        let mut delta: i64 = 0;
        for ev in events.iter() {
            let i = ev.bits().trailing_zeros() as usize;
            match (unbind, slots.0[i]) {
                (false, 0) => {
                    new.0[i] = n;
                    delta += 1;
                }
                (false, c) if c == n => {}
                (false, _) => return Err(CmdStatus::Busy),
                (true, c) if c == n => {
                    new.0[i] = 0;
                    delta -= 1;
                }
                (true, _) => return Err(CmdStatus::BadParam),
            }
        }
        match b.kind {
            CNTR_BIND_QP => {
                if let Some(qp) = self.qps.get_mut(obj) {
                    qp.cntrs = new;
                }
            }
            _ => {
                if let Some(mr) = self.mrs.get_mut(key_index(obj)) {
                    mr.cntrs = new;
                }
            }
        }
        if let Some(c) = self.cntrs.get_mut(n) {
            c.refs = (c.refs as i64 + delta).max(0) as u32;
        }
        Ok(Vec::new())
    }

    fn post_triggered(&mut self, env: &mut dyn Env, t: &PostTriggeredIn) -> Outcome {
        let kind = TrigKind::from_u8(t.kind).ok_or(CmdStatus::BadParam)?;
        let flags = TrigFlags::from_bits(t.flags).ok_or(CmdStatus::BadParam)?;
        let trig = t.trig_cntr.get();
        let pdn = self.cntrs.get(trig).ok_or(CmdStatus::BadResource)?.pdn;
        let same_pd = |nic: &Nic, c: u32| match nic.cntrs.get(c) {
            None => Err(CmdStatus::BadResource),
            Some(c) if c.pdn != pdn => Err(CmdStatus::BadPd),
            Some(_) => Ok(()),
        };
        let comp = t.comp_cntr.get();
        let body = t.body_bytes();
        let op = match kind {
            TrigKind::Wqe => {
                let qpn = t.target.get();
                let qp = self.qps.get(qpn).ok_or(CmdStatus::BadResource)?;
                if qp.pdn != pdn {
                    return Err(CmdStatus::BadPd);
                }
                // Triggered transfers are RC work requests (their WQE has no UD address, and
                // a READ or atomic has no UC form).
                if qp.ud || qp.uc || qp.raw {
                    return Err(CmdStatus::BadParam);
                }
                if matches!(qp.state, QpState::Reset | QpState::Err | QpState::Sqe) {
                    return Err(CmdStatus::BadState);
                }
                let qp_gen = qp.gen;
                if comp != 0 {
                    same_pd(self, comp)?;
                }
                let wqe = decode_wqe(body, self.cfg.max_msg_size).ok_or(CmdStatus::BadParam)?;
                let operand = if flags.contains(TrigFlags::OPERAND_FROM_MEM) {
                    let addr = t.operand_addr.get();
                    if !wqe.op.is_atomic() || !addr.is_multiple_of(8) {
                        return Err(CmdStatus::BadParam);
                    }
                    Some((t.operand_lkey.get(), addr))
                } else {
                    None
                };
                TrigOp::Wqe {
                    qpn,
                    qp_gen,
                    wqe,
                    operand,
                    comp,
                    signaled: flags.contains(TrigFlags::COMPLETION),
                    wr_id: t.wr_id.get(),
                }
            }
            TrigKind::CntrAdd | TrigKind::CntrSet => {
                if comp != 0
                    || flags.intersects(TrigFlags::COMPLETION | TrigFlags::OPERAND_FROM_MEM)
                {
                    return Err(CmdStatus::BadParam);
                }
                let target = t.target.get();
                same_pd(self, target)?;
                let v = CntrWriteback::read_from_bytes(&body[..16]).unwrap_or_default();
                TrigOp::Cntr {
                    target,
                    assign: kind == TrigKind::CntrSet,
                    success: v.success.get(),
                    error: v.error.get(),
                }
            }
        };
        let seq = self.trig.seq;
        let key = (t.threshold.get(), seq);
        let success_only = flags.contains(TrigFlags::SUCCESS_ONLY);
        let refs = Self::trig_refs(trig, &op);
        let slot = self
            .trig
            .insert(
                self.cfg.max_triggered,
                Trigger {
                    pdn,
                    cntr: trig,
                    key,
                    op,
                },
            )
            .ok_or(CmdStatus::Exhausted)?;
        self.trig.seq += 1;
        for c in refs.into_iter().flatten() {
            if let Some(c) = self.cntrs.get_mut(c) {
                c.refs += 1;
            }
        }
        if let Some(c) = self.cntrs.get_mut(trig) {
            let list = if success_only {
                &mut c.on_success
            } else {
                &mut c.on_sum
            };
            list.insert(key, slot);
        }
        let handle = self.trig.handle(slot);
        // Already satisfied: it fires now, behind anything released before it.
        self.cntr_release(trig);
        self.trig_drain(env);
        Ok(ObjectOut { num: handle.into() }.as_bytes().to_vec())
    }

    /// The counters a pending operation holds a reference on.
    fn trig_refs(trig: u32, op: &TrigOp) -> [Option<u32>; 2] {
        let other = match *op {
            TrigOp::Wqe { comp, .. } => comp,
            TrigOp::Cntr { target, .. } => target,
        };
        [Some(trig), (other != 0).then_some(other)]
    }

    fn cntr_unref(&mut self, n: u32) {
        if let Some(c) = self.cntrs.get_mut(n) {
            c.refs = c.refs.saturating_sub(1);
        }
    }

    /// Removes a pending operation without running it.
    fn trig_discard(&mut self, slot: u32) {
        let Some((_, t)) = self.trig.take(slot) else {
            return;
        };
        if let Some(c) = self.cntrs.get_mut(t.cntr) {
            c.on_sum.remove(&t.key);
            c.on_success.remove(&t.key);
        }
        for c in Self::trig_refs(t.cntr, &t.op).into_iter().flatten() {
            self.cntr_unref(c);
        }
    }

    /// Drops the pending operations that would run on QP `qpn` (being destroyed).
    pub(crate) fn trig_discard_qp(&mut self, qpn: u32) {
        let hit: Vec<u32> = (0..self.trig.slots.len() as u32)
            .filter(|&s| {
                matches!(
                    self.trig.slots[s as usize],
                    Some(Trigger { op: TrigOp::Wqe { qpn: q, .. }, .. }) if q == qpn
                )
            })
            .collect();
        for s in hit {
            self.trig_discard(s);
        }
    }

    /// Releases the entries of counter `n` that its value satisfies into the FIFO.
    fn cntr_release(&mut self, n: u32) {
        let Some(c) = self.cntrs.get_mut(n) else {
            return;
        };
        let sum = c.success as u128 + c.error as u128;
        let mut out: Vec<((u64, u64), u32)> = Vec::new();
        while let Some(e) = c.on_sum.first_entry() {
            if e.key().0 as u128 > sum {
                break;
            }
            let (k, s) = e.remove_entry();
            out.push((k, s));
        }
        while let Some(e) = c.on_success.first_entry() {
            if e.key().0 > c.success {
                break;
            }
            let (k, s) = e.remove_entry();
            out.push((k, s));
        }
        out.sort_unstable_by_key(|&(k, _)| k);
        for (_, slot) in out {
            if let Some((h, t)) = self.trig.take(slot) {
                self.cntr_unref(t.cntr);
                self.trig.fifo.push_back((h, t));
            }
        }
    }

    /// Runs released operations in FIFO order (never recursively).
    fn trig_drain(&mut self, env: &mut dyn Env) {
        if self.trig.draining {
            return;
        }
        self.trig.draining = true;
        while let Some((handle, t)) = self.trig.fifo.pop_front() {
            self.trig_fire(env, handle, t.op);
        }
        self.trig.draining = false;
    }

    fn trig_fire(&mut self, env: &mut dyn Env, handle: u32, op: TrigOp) {
        match op {
            TrigOp::Cntr {
                target,
                assign,
                success,
                error,
            } => {
                self.cntr_unref(target);
                self.cntr_apply(env, target, (success, assign), (error, assign));
            }
            TrigOp::Wqe {
                qpn,
                qp_gen,
                mut wqe,
                operand,
                comp,
                signaled,
                wr_id,
            } => {
                let comp_gen = self.cntrs.get(comp).map_or(0, |c| c.gen);
                let task = HwTask::Triggered {
                    handle,
                    comp,
                    comp_gen,
                    signaled,
                    wr_id,
                };
                let t = &self.cfg.timing;
                // An operand read from host memory costs a DMA read first.
                let fetch = if operand.is_some() {
                    t.dma_read_rtt_ps
                } else {
                    0
                };
                let ready = env.now() + SimTime(t.trig_dispatch_ps + fetch);
                let now = env.now();
                trace(env, || {
                    TraceEvent::new(Stage::TriggerDispatch, now, ready)
                        .qpn(qpn)
                        .obj(handle)
                        .op(wqe.op as u8)
                        .bytes(wqe.len as usize)
                });
                let Some(mut qp) = self.qps.remove(qpn) else {
                    // The QP went away (a reset): nothing to report on, but the count moves.
                    self.trig_count(env, comp, comp_gen, false, ready);
                    return;
                };
                if qp.gen != qp_gen {
                    self.qps.restore(qpn, qp);
                    self.trig_count(env, comp, comp_gen, false, ready);
                    return;
                }
                let mut err = None;
                if let Some((lkey, addr)) = operand {
                    let mut b = [0u8; 8];
                    match self.check_key(qp.pdn, lkey, addr, 8, Access::empty()) {
                        Err(e) => err = Some((CqeStatus::LocProtErr, e.syndrome())),
                        Ok(iova) => match self.dm.read(env, iova, &mut b) {
                            Err(f) => {
                                self.iommu_fault(env, qpn, f.iova);
                                err = Some((CqeStatus::GeneralErr, VendorSyndrome::IommuFault));
                            }
                            Ok(()) => wqe.atomic.0 = u64::from_le_bytes(b),
                        },
                    }
                }
                self.start_triggered(env, &mut qp, wqe, task, err, ready);
                self.qps.restore(qpn, qp);
            }
        }
    }

    /// Adds one to completion counter `comp` (if it still is the counter of generation
    /// `gen`) when the data it stands for is visible, at `ready`; drops its reference.
    pub(crate) fn trig_count(
        &mut self,
        env: &mut dyn Env,
        comp: u32,
        gen: u64,
        ok: bool,
        ready: SimTime,
    ) {
        if comp == 0 {
            return;
        }
        if self.cntrs.get(comp).is_some_and(|c| c.gen == gen) {
            self.cntr_unref(comp);
            self.cntr_schedule(env, comp, ok, ready);
        }
    }

    /// Schedules +1 on counter `n` (success or error) for when writes posted before `ready`
    /// are visible.
    pub(crate) fn cntr_schedule(&mut self, env: &mut dyn Env, n: u32, ok: bool, ready: SimTime) {
        let Some(c) = self.cntrs.get(n) else {
            return;
        };
        let gen = c.gen;
        let at = self.after_posted_writes(ready);
        env.schedule(
            at,
            NicEvent::CntrUpdate {
                cntr: n,
                gen,
                success: ok as u64,
                error: !ok as u64,
            },
        );
    }

    /// The CQE of a triggered data transfer.
    pub(crate) fn trig_cqe(
        qpn: u32,
        wqe: &SendWqe,
        handle: u32,
        wr_id: u64,
        status: (CqeStatus, VendorSyndrome),
    ) -> Cqe {
        let mut cqe = Self::send_cqe(qpn, 0, wqe, status.0, status.1);
        cqe.flags |= ringbell_specs::cqe::CQE_FLAG_TRIGGERED;
        cqe.tm_tag = wr_id.into();
        cqe.tm_handle = handle.into();
        cqe
    }

    /// Adds to (or assigns) counter `n`'s values, then writes it back, checks its wait and
    /// fires what it releases.
    pub(crate) fn cntr_apply(&mut self, env: &mut dyn Env, n: u32, s: (u64, bool), e: (u64, bool)) {
        let Some(c) = self.cntrs.get_mut(n) else {
            return;
        };
        c.success = if s.1 {
            s.0
        } else {
            c.success.wrapping_add(s.0)
        };
        c.error = if e.1 { e.0 } else { c.error.wrapping_add(e.0) };
        let (success, error) = (c.success, c.error);
        let now = env.now();
        trace(env, || {
            TraceEvent::at(Stage::CounterUpdate, now)
                .obj(n)
                .psn(success as u32)
                .bytes(error as usize)
        });
        self.cntr_writeback(env, n);
        self.cntr_check_wait(env, n);
        self.cntr_release(n);
        self.trig_drain(env);
    }

    fn cntr_writeback(&mut self, env: &mut dyn Env, n: u32) {
        let Some(c) = self.cntrs.get_mut(n) else {
            return;
        };
        let Some(wb) = c.wb else {
            return;
        };
        let v = CntrWriteback {
            success: c.success.into(),
            error: c.error.into(),
        };
        if let Err(f) = env.dma_write(wb, v.as_bytes()) {
            c.wb = None;
            self.iommu_fault(env, 0, f.iova);
        }
    }

    fn cntr_check_wait(&mut self, env: &mut dyn Env, n: u32) {
        let Some(c) = self.cntrs.get_mut(n) else {
            return;
        };
        let Some((thr, err0)) = c.wait else {
            return;
        };
        let why = if c.success >= thr {
            CntrWaitEnd::Reached
        } else if c.error != err0 {
            CntrWaitEnd::ErrorChanged
        } else {
            return;
        };
        c.wait = None;
        let v = c.success;
        self.post_event(env, EventType::Counter, why as u8, n, v);
    }

    /// Counts `ev` on the QP's bound counter, if any.
    pub(crate) fn qp_count(
        &mut self,
        env: &mut dyn Env,
        cntrs: &EventCntrs,
        ev: CntrEvents,
        ok: bool,
        ready: SimTime,
    ) {
        if !cntrs.any() {
            return;
        }
        let n = cntrs.get(ev);
        if n != 0 {
            self.cntr_schedule(env, n, ok, ready);
        }
    }

    /// Counts a remote access `ev` through `rkey` on the MR's bound counter, if any.
    pub(crate) fn mr_count(
        &mut self,
        env: &mut dyn Env,
        rkey: u32,
        ev: CntrEvents,
        ready: SimTime,
    ) {
        let n = match self.mrs.get(key_index(rkey)) {
            Some(m) if m.key == rkey => m.cntrs.get(ev),
            _ => 0,
        };
        if n != 0 {
            self.cntr_schedule(env, n, true, ready);
        }
    }

    /// Releases the counter references of a QP's or MR's bindings (it is being destroyed).
    pub(crate) fn unbind_all(&mut self, cntrs: &EventCntrs) {
        for &c in cntrs.0.iter().filter(|&&c| c != 0) {
            self.cntr_unref(c);
        }
    }

    /// Reads a register of the counter area.
    pub(crate) fn cntr_mmio_read(&mut self, offset: u64) -> Option<u32> {
        let rel = offset - ringbell_specs::regs::CNTR_BASE;
        let n = (rel / ringbell_specs::regs::CNTR_STRIDE) as u32;
        let reg = rel % ringbell_specs::regs::CNTR_STRIDE;
        use ringbell_specs::regs::*;
        match reg {
            CNTR_SUCCESS_LO => {
                let c = self.cntrs.get(n)?;
                self.cntr_latch = (c.success, c.error);
                Some(c.success as u32)
            }
            CNTR_SUCCESS_HI => Some((self.cntr_latch.0 >> 32) as u32),
            CNTR_ERROR_LO => Some(self.cntr_latch.1 as u32),
            CNTR_ERROR_HI => Some((self.cntr_latch.1 >> 32) as u32),
            _ => None,
        }
    }

    /// Writes a register of the counter area; false for an offset or counter that is not
    /// there.
    pub(crate) fn cntr_mmio_write(&mut self, env: &mut dyn Env, offset: u64, value: u32) -> bool {
        use ringbell_specs::regs::*;
        let rel = offset - CNTR_BASE;
        let n = (rel / CNTR_STRIDE) as u32;
        let add = match rel % CNTR_STRIDE {
            CNTR_ADD_SUCCESS => ((value as u64, false), (0, false)),
            CNTR_ADD_ERROR => ((0, false), (value as u64, false)),
            _ => return false,
        };
        if self.cntrs.get(n).is_none() {
            return false;
        }
        self.cntr_apply(env, n, add.0, add.1);
        true
    }
}
