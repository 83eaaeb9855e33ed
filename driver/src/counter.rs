//! Event counters and triggered operations (ABI 1.3).
//!
//! A [`Counter`] counts completions and arrivals as a success and an error value. It is
//! bound to a QP's events ([`Counter::bind_qp`]) or an MR's remote accesses
//! ([`Counter::bind_mr`]), changed by the host ([`Counter::add`], [`Counter::set`]) and read
//! three ways: [`Counter::get`] from the writeback the device keeps in host memory (no device
//! access at all), [`Counter::read`] through its registers, and [`Counter::wait`], which
//! arms a COUNTER event and lets the device run until it is reached.
//!
//! A triggered operation is a data transfer ([`QueuePair::post_triggered`]) or a counter
//! change ([`Counter::post_triggered_add`], [`Counter::post_triggered_set`]) that the device
//! holds until a counter reaches a threshold. They follow libfabric's deferred-work rules
//! (`fi_trigger(3)`): the threshold is compared with success + error (or success alone, on
//! request); operations fire in threshold order, then in the order they were posted; a
//! transfer's completion adds one to its completion counter and writes a CQE only when asked
//! (errors always write one); counter operations touch nothing but their target. The QP's own
//! bound counters do not count triggered transfers. [`ProtectionDomain::flush_triggered`]
//! and [`Device::cancel_triggered`] take pending operations back.

use crate::device::{DevInner, Device, DmaBuffer};
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain, Sge};
use crate::qp::{QueuePair, SendWr};
use ringbell_specs::cmd::{
    ArmCntrIn, BindCntrIn, CmdOpcode, CntrEvents, CntrWriteback, CreateCntrIn, FlushTriggeredIn,
    FlushTriggeredOut, ObjectIn, ObjectOut, PostTriggeredIn, QueryCntrOut, TrigFlags, TrigKind,
    UpdateCntrIn, CNTR_ASSIGN_ERROR, CNTR_ASSIGN_SUCCESS, CNTR_BIND_MR, CNTR_BIND_QP,
    CNTR_BIND_UNBIND,
};
use ringbell_specs::cqe::{CntrWaitEnd, EventType};
use ringbell_specs::regs;
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// The device side of a counter; destroyed when the last holder lets go.
#[derive(Debug)]
pub(crate) struct CntrObject {
    dev: Device,
    num: u32,
    pdn: u32,
    /// The writeback; `None` only while the object is dropped.
    wb: Option<DmaBuffer>,
    /// Triggered operations posted with this counter as their trigger, completion counter or
    /// target: dropping the counter cancels those still pending.
    ops: std::cell::RefCell<Vec<TriggerHandle>>,
    /// The PD outlives its counters.
    _pd: Rc<crate::mr::PdObject>,
}

/// How many times dropping a counter lets the device progress while completions that still
/// name it are in flight.
const DROP_PROGRESS: u32 = 1_000_000;

impl Drop for CntrObject {
    fn drop(&mut self) {
        let inner = &self.dev.inner;
        // Operations that name it cannot run correctly any more: take them back first
        // (those that fired already are unknown to the device and refuse the cancel).
        for h in self.ops.borrow().iter() {
            let _ = inner.destroy(CmdOpcode::CancelTriggered, h.0);
        }
        let _ = inner.command(
            CmdOpcode::FlushTriggered,
            FlushTriggeredIn {
                pdn: self.pdn.into(),
                cntr: self.num.into(),
            }
            .as_bytes(),
        );
        // A transfer that fired holds the counter until it completes: let it.
        let mut tries = 0;
        while inner.destroy(CmdOpcode::DestroyCntr, self.num).is_err() {
            tries += 1;
            if tries > DROP_PROGRESS || !inner.port.progress() {
                // The device still names the counter (it would write its writeback): keep
                // the writeback mapped for as long as the device lives, and the number to
                // retry at the next CREATE_CNTR.
                std::mem::forget(self.wb.take());
                inner.parked_cntrs.borrow_mut().push(self.num);
                return;
            }
        }
    }
}

/// An event counter: a success and an error value.
#[derive(Debug, Clone)]
pub struct Counter {
    pub(crate) obj: Rc<CntrObject>,
}

/// A counter's state as the device reports it (QUERY_CNTR).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterInfo {
    /// Success value.
    pub success: u64,
    /// Error value.
    pub error: u64,
    /// Triggered operations waiting on the counter.
    pub pending: u32,
    /// Bindings and operations that name the counter.
    pub refs: u32,
}

/// How [`Counter::wait`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterWait {
    /// The success value reached the threshold; it is this.
    Reached(u64),
    /// The error value changed first (libfabric's `-FI_EAVAIL`); the values then.
    ErrorChanged {
        /// Success value.
        success: u64,
        /// Error value.
        error: u64,
    },
    /// The timeout passed (device time).
    TimedOut,
}

/// Options of a triggered data transfer.
#[derive(Clone, Copy, Debug, Default)]
pub struct TriggerOpts<'a> {
    /// Counter that counts the transfer's completion (success or error), if any.
    pub completion: Option<&'a Counter>,
    /// Write a CQE (flagged triggered) to the QP's send CQ on success too.
    pub signaled: bool,
    /// Compare the threshold with the success value only (default: success + error).
    pub success_only: bool,
    /// Atomics: read the add (fetch-and-add) or swap (compare-and-swap) operand from this
    /// 8-byte local buffer when the operation fires, not from the work request.
    pub operand: Option<Sge>,
}

/// A posted triggered operation, for [`Device::cancel_triggered`]; CQEs of triggered
/// transfers carry it in [`crate::WorkCompletion::trigger`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TriggerHandle(pub u32);

impl ProtectionDomain {
    /// Creates a counter at 0/0 with a host-memory writeback.
    pub fn create_counter(&self) -> Result<Counter, Error> {
        let dev = self.device();
        dev.inner.retry_parked_cntrs();
        let wb = dev.alloc_ring(std::mem::size_of::<CntrWriteback>())?;
        let num = dev.inner.create(
            CmdOpcode::CreateCntr,
            CreateCntrIn {
                pdn: self.pdn().into(),
                flags: 0.into(),
                wb_iova: wb.iova().into(),
            }
            .as_bytes(),
        )?;
        Ok(Counter {
            obj: Rc::new(CntrObject {
                dev: dev.clone(),
                num,
                pdn: self.pdn(),
                wb: Some(wb),
                ops: Default::default(),
                _pd: self.obj.clone(),
            }),
        })
    }

    /// Cancels the pending triggered operations of this PD (`cntr` `None`) or those waiting
    /// on `cntr`; returns how many. None of them fires, counts or completes.
    pub fn flush_triggered(&self, cntr: Option<&Counter>) -> Result<u32, Error> {
        let dev = self.device();
        if cntr.is_some_and(|c| !c.belongs_to(dev)) {
            return Err(Error::InvalidArgument("counter belongs to another device"));
        }
        let out = dev.inner.command(
            CmdOpcode::FlushTriggered,
            FlushTriggeredIn {
                pdn: self.pdn().into(),
                cntr: cntr.map_or(0, |c| c.num()).into(),
            }
            .as_bytes(),
        )?;
        Ok(FlushTriggeredOut::read_from_prefix(&out)
            .map(|(o, _)| o.flushed.get())
            .unwrap_or(0))
    }
}

impl Device {
    /// Cancels one pending triggered operation. An operation that fired, was cancelled or
    /// flushed already is unknown to the device: `Command { status: BadResource }`.
    pub fn cancel_triggered(&self, h: TriggerHandle) -> Result<(), Error> {
        self.inner.destroy(CmdOpcode::CancelTriggered, h.0)
    }
}

impl DevInner {
    /// Destroys counters whose destruction had to wait.
    pub(crate) fn retry_parked_cntrs(&self) {
        let parked = std::mem::take(&mut *self.parked_cntrs.borrow_mut());
        for n in parked {
            if self.destroy(CmdOpcode::DestroyCntr, n).is_err() {
                self.parked_cntrs.borrow_mut().push(n);
            }
        }
    }
}

impl Counter {
    /// The device's counter number.
    pub fn num(&self) -> u32 {
        self.obj.num
    }

    fn inner(&self) -> &DevInner {
        &self.obj.dev.inner
    }

    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        Rc::ptr_eq(&self.obj.dev.inner, &dev.inner)
    }

    fn window(&self, reg: u64) -> u64 {
        regs::CNTR_BASE + self.obj.num as u64 * regs::CNTR_STRIDE + reg
    }

    /// Success and error as last written back to host memory: no device access, so the
    /// cheap way to poll (the device writes back after every change).
    pub fn get(&self) -> (u64, u64) {
        let Some(wb) = &self.obj.wb else {
            return (0, 0);
        };
        (wb.read_u64(0).unwrap_or(0), wb.read_u64(8).unwrap_or(0))
    }

    /// Remembers that operation `h` names this counter.
    fn named_by(&self, h: TriggerHandle) {
        let mut ops = self.obj.ops.borrow_mut();
        // Keep the list short: forget handles the device no longer knows only when it grows.
        if ops.len() >= 4096 {
            ops.clear();
        }
        ops.push(h);
    }

    /// Success and error read from the device's registers (exact at the time of the read).
    pub fn read(&self) -> (u64, u64) {
        let p = self.inner().port.as_ref();
        let lo = p.read32(self.window(regs::CNTR_SUCCESS_LO)) as u64;
        let hi = p.read32(self.window(regs::CNTR_SUCCESS_HI)) as u64;
        let elo = p.read32(self.window(regs::CNTR_ERROR_LO)) as u64;
        let ehi = p.read32(self.window(regs::CNTR_ERROR_HI)) as u64;
        (hi << 32 | lo, ehi << 32 | elo)
    }

    /// Adds `v` to the success value with one register store (posted: a later
    /// [`Counter::read`] sees it).
    pub fn add(&self, v: u32) {
        self.inner()
            .port
            .write32(self.window(regs::CNTR_ADD_SUCCESS), v);
    }

    /// Adds `v` to the error value with one register store.
    pub fn add_error(&self, v: u32) {
        self.inner()
            .port
            .write32(self.window(regs::CNTR_ADD_ERROR), v);
    }

    fn update(&self, flags: u32, success: u64, error: u64) -> Result<(), Error> {
        self.inner()
            .command(
                CmdOpcode::UpdateCntr,
                UpdateCntrIn {
                    cntr: self.num().into(),
                    flags: flags.into(),
                    success: success.into(),
                    error: error.into(),
                }
                .as_bytes(),
            )
            .map(|_| ())
    }

    /// Adds 64-bit amounts to both values (one command).
    pub fn add_wide(&self, success: u64, error: u64) -> Result<(), Error> {
        self.update(0, success, error)
    }

    /// Sets the success value (libfabric: only well defined while nothing else updates it).
    pub fn set(&self, success: u64) -> Result<(), Error> {
        self.update(CNTR_ASSIGN_SUCCESS, success, 0)
    }

    /// Sets the error value.
    pub fn set_error(&self, error: u64) -> Result<(), Error> {
        self.update(CNTR_ASSIGN_ERROR, 0, error)
    }

    /// The device's view: values, pending operations, references.
    pub fn query(&self) -> Result<CounterInfo, Error> {
        let out = self.inner().command(
            CmdOpcode::QueryCntr,
            ObjectIn {
                num: self.num().into(),
            }
            .as_bytes(),
        )?;
        let q = QueryCntrOut::read_from_prefix(&out)
            .map(|(q, _)| q)
            .unwrap_or_default();
        Ok(CounterInfo {
            success: q.success.get(),
            error: q.error.get(),
            pending: q.pending.get(),
            refs: q.refs.get(),
        })
    }

    fn bind(&self, kind: u8, flags: u8, obj: u32, events: CntrEvents) -> Result<(), Error> {
        self.inner()
            .command(
                CmdOpcode::BindCntr,
                BindCntrIn {
                    cntr: self.num().into(),
                    kind,
                    flags,
                    obj: obj.into(),
                    events: events.bits().into(),
                    ..Default::default()
                }
                .as_bytes(),
            )
            .map(|_| ())
    }

    /// Counts `events` of `qp` (its posted work's completions, its receives, remote
    /// accesses to it). One counter per event kind per QP: another counter already bound
    /// to one of them is `Busy`; a QP of another PD is `BadPd`.
    pub fn bind_qp(&self, qp: &QueuePair, events: CntrEvents) -> Result<(), Error> {
        if !qp.belongs_to(&self.obj.dev) {
            return Err(Error::InvalidArgument("QP belongs to another device"));
        }
        self.bind(CNTR_BIND_QP, 0, qp.qpn(), events)?;
        qp.keep(self.obj.clone());
        Ok(())
    }

    /// Stops counting `events` of `qp` on this counter.
    pub fn unbind_qp(&self, qp: &QueuePair, events: CntrEvents) -> Result<(), Error> {
        // By number: another device's QP could name one of this device's.
        if !qp.belongs_to(&self.obj.dev) {
            return Err(Error::InvalidArgument("QP belongs to another device"));
        }
        self.bind(CNTR_BIND_QP, CNTR_BIND_UNBIND, qp.qpn(), events)
    }

    /// Counts remote accesses through `mr` (REMOTE_READ, REMOTE_WRITE; atomics count as
    /// writes). The MR must grant the matching remote access.
    pub fn bind_mr(&self, mr: &MemoryRegion, events: CntrEvents) -> Result<(), Error> {
        if !mr.belongs_to(&self.obj.dev) {
            return Err(Error::InvalidArgument("MR belongs to another device"));
        }
        self.bind(CNTR_BIND_MR, 0, mr.lkey(), events)?;
        mr.keep(self.obj.clone());
        Ok(())
    }

    /// Stops counting `events` of `mr` on this counter.
    pub fn unbind_mr(&self, mr: &MemoryRegion, events: CntrEvents) -> Result<(), Error> {
        if !mr.belongs_to(&self.obj.dev) {
            return Err(Error::InvalidArgument("MR belongs to another device"));
        }
        self.bind(CNTR_BIND_MR, CNTR_BIND_UNBIND, mr.lkey(), events)
    }

    /// Waits until the success value reaches `threshold` or the error value changes, letting
    /// the device run (on hardware the caller would sleep on the event's interrupt).
    /// `timeout_ps` is device time; `None` waits for as long as the device has work. An
    /// idle device with the threshold unreached is `DeviceIdle`.
    pub fn wait(&self, threshold: u64, timeout_ps: Option<u64>) -> Result<CounterWait, Error> {
        let dev = &self.obj.dev;
        let deadline = timeout_ps.map(|t| dev.clock_ps().saturating_add(t));
        let (_, err0) = self.read();
        self.inner().command(
            CmdOpcode::ArmCntr,
            ArmCntrIn {
                cntr: self.num().into(),
                threshold: threshold.into(),
                ..Default::default()
            }
            .as_bytes(),
        )?;
        // The device takes its error snapshot when it executes ARM_CNTR, a command time after
        // `err0` was read: a change in between raises no event, so look for one here.
        let (success, error) = self.read();
        if success >= threshold {
            return Ok(CounterWait::Reached(success));
        }
        if error != err0 {
            return Ok(CounterWait::ErrorChanged { success, error });
        }
        loop {
            while let Some(e) = dev
                .inner
                .take_event(|e| e.kind == EventType::Counter && e.obj == self.num())
            {
                let (success, error) = self.read();
                // An event from an earlier, abandoned wait does not end this one.
                if e.subtype == CntrWaitEnd::Reached as u8 && success >= threshold {
                    return Ok(CounterWait::Reached(success));
                }
                if e.subtype == CntrWaitEnd::ErrorChanged as u8 && error != err0 {
                    return Ok(CounterWait::ErrorChanged { success, error });
                }
            }
            if deadline.is_some_and(|d| dev.clock_ps() >= d) {
                return Ok(CounterWait::TimedOut);
            }
            if !dev.progress() {
                return Err(Error::DeviceIdle("a counter wait"));
            }
        }
    }

    fn post(&self, t: &PostTriggeredIn, others: &[&Counter]) -> Result<TriggerHandle, Error> {
        let out = self
            .inner()
            .command(CmdOpcode::PostTriggered, t.as_bytes())?;
        let h = TriggerHandle(
            ObjectOut::read_from_prefix(&out)
                .map(|(o, _)| o.num.get())
                .unwrap_or(0),
        );
        for c in others {
            c.named_by(h);
        }
        Ok(h)
    }

    fn post_cntr_op(
        &self,
        kind: TrigKind,
        threshold: u64,
        target: &Counter,
        values: (u64, u64),
        success_only: bool,
    ) -> Result<TriggerHandle, Error> {
        if !target.belongs_to(&self.obj.dev) {
            return Err(Error::InvalidArgument("counter belongs to another device"));
        }
        let mut t = PostTriggeredIn {
            trig_cntr: self.num().into(),
            threshold: threshold.into(),
            kind: kind as u8,
            flags: if success_only {
                TrigFlags::SUCCESS_ONLY.bits()
            } else {
                0
            },
            target: target.num().into(),
            ..Default::default()
        };
        t.set_body(
            CntrWriteback {
                success: values.0.into(),
                error: values.1.into(),
            }
            .as_bytes(),
        );
        self.post(&t, &[target])
    }

    /// When this counter reaches `threshold`, adds `success` and `error` to `target` (which
    /// may be this counter).
    pub fn post_triggered_add(
        &self,
        threshold: u64,
        target: &Counter,
        success: u64,
        error: u64,
    ) -> Result<TriggerHandle, Error> {
        self.post_cntr_op(
            TrigKind::CntrAdd,
            threshold,
            target,
            (success, error),
            false,
        )
    }

    /// When this counter reaches `threshold`, sets `target` to `success` / `error`.
    pub fn post_triggered_set(
        &self,
        threshold: u64,
        target: &Counter,
        success: u64,
        error: u64,
    ) -> Result<TriggerHandle, Error> {
        self.post_cntr_op(
            TrigKind::CntrSet,
            threshold,
            target,
            (success, error),
            false,
        )
    }
}

impl QueuePair {
    /// Posts `wr` as a triggered transfer on this QP: the device holds it until `trigger`
    /// reaches `threshold` (at once if it has) and then sends it as if just posted, reading
    /// its buffers then. The work request must fit one 64-byte WQE block: a SEND with up to
    /// three SGEs or 44 inline bytes, a WRITE with up to two SGEs or 28 inline bytes, a READ
    /// with up to two SGEs, an atomic with its one SGE. Its `wr_id`
    /// comes back in the triggered CQE, if one is written.
    pub fn post_triggered(
        &self,
        trigger: &Counter,
        threshold: u64,
        wr: &SendWr<'_>,
        opts: TriggerOpts<'_>,
    ) -> Result<TriggerHandle, Error> {
        if !trigger.belongs_to(self.device())
            || opts
                .completion
                .is_some_and(|c| !c.belongs_to(self.device()))
        {
            return Err(Error::InvalidArgument("counter belongs to another device"));
        }
        let body = self.encode_triggered(wr)?;
        let mut flags = TrigFlags::empty();
        flags.set(TrigFlags::COMPLETION, opts.signaled);
        flags.set(TrigFlags::SUCCESS_ONLY, opts.success_only);
        flags.set(TrigFlags::OPERAND_FROM_MEM, opts.operand.is_some());
        let operand = opts.operand.unwrap_or_default();
        let mut t = PostTriggeredIn {
            trig_cntr: trigger.num().into(),
            comp_cntr: opts.completion.map_or(0, |c| c.num()).into(),
            threshold: threshold.into(),
            kind: TrigKind::Wqe as u8,
            flags: flags.bits(),
            target: self.qpn().into(),
            wr_id: wr.wr_id.into(),
            operand_addr: operand.addr.into(),
            operand_lkey: operand.lkey.into(),
            ..Default::default()
        };
        t.set_body(&body);
        match opts.completion {
            Some(c) => trigger.post(&t, &[c]),
            None => trigger.post(&t, &[]),
        }
    }
}

impl Counter {
    /// Arms the device's wait without waiting: one COUNTER event (see
    /// [`Device::poll_event`]) when the success value reaches `threshold` or the error value
    /// changes. Arming again replaces the earlier wait.
    pub fn arm(&self, threshold: u64) -> Result<(), Error> {
        self.inner()
            .command(
                CmdOpcode::ArmCntr,
                ArmCntrIn {
                    cntr: self.num().into(),
                    threshold: threshold.into(),
                    ..Default::default()
                }
                .as_bytes(),
            )
            .map(|_| ())
    }
}
