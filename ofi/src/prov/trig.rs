//! Counters and triggered operations: `fi_cntr(3)`, the `FI_TRIGGER` flag and the deferred
//! work queue of `fi_trigger(3)`, executed by the NIC's triggered-operation table.
//!
//! **Counters** are the device's counters ([`Counter`]) in the domain's PD. The provider adds
//! to an endpoint's bound counters when it completes an operation (any completion, reported
//! or not: injects and selective completion count too; errors count on the error value).
//! `FI_REMOTE_READ` / `FI_REMOTE_WRITE` counters are the device's own: bound to every QP of
//! the endpoint's untagged channel and to memory regions (`fi_mr_bind`), they count
//! without the host.
//!
//! **Triggered transfers** (`FI_TRIGGER` with `struct fi_triggered_context`, and deferred
//! work with `struct fi_deferred_work`) are posted to the NIC with `POST_TRIGGERED` on the
//! RC connection to the peer (connected first if it is not, the operation waiting in the
//! provider until it is: the only case in which the host holds one). The NIC fires them in
//! threshold order, then in submission order, reads their buffers then, and counts their
//! completion on the completion counter itself, so chains of triggered work proceed without
//! the host. `FI_TRIGGER` operations compare the threshold with the counter's success value
//! and count on the endpoint's bound counter; deferred work compares success + error and
//! counts on `completion_cntr` only, with no endpoint completion unless `FI_COMPLETION`.
//! Triggered tagged sends carry at most [`super::EAGER_MAX`] bytes (the eager protocol: one
//! SEND of header and data); receives cannot be triggered (`-FI_ENOSYS`): the NIC's table
//! holds send-side work only.

use super::*;

/// A triggered operation as libfabric asks for it.
#[derive(Clone, Copy, Debug)]
pub struct Trig {
    /// The trigger counter (a key).
    pub cntr: usize,
    pub threshold: u64,
    /// Deferred work; `None` for the `FI_TRIGGER` flag.
    pub work: Option<WorkOp>,
}

/// What deferred work adds to a triggered operation.
#[derive(Clone, Copy, Debug)]
pub struct WorkOp {
    /// The address of its `struct fi_deferred_work` (what `FI_CANCEL_WORK` names).
    pub key: u64,
    /// `completion_cntr` (a key).
    pub comp: Option<usize>,
}

/// A queued work request of a domain.
#[derive(Clone, Copy, Debug)]
pub enum Work {
    /// A transfer: the endpoint and work request id of its operation.
    Xfer { ep: usize, wr_id: u64, cntr: usize },
    /// A counter operation: the NIC's handle.
    Cntr { handle: TriggerHandle, cntr: usize },
}

impl Work {
    fn cntr(&self) -> usize {
        match *self {
            Work::Xfer { cntr, .. } | Work::Cntr { cntr, .. } => cntr,
        }
    }
}

/// What the NIC is given for a triggered operation.
pub(super) struct TrigPost {
    trigger: Counter,
    threshold: u64,
    success_only: bool,
    comp: Option<Counter>,
    operand: Option<Sge>,
}

/// The provider's record of a triggered transfer until it completes.
#[derive(Clone, Copy, Debug)]
pub(super) struct TrigOp {
    /// The NIC's handle; `None` while the operation waits for its connection.
    pub handle: Option<TriggerHandle>,
    ctx: u64,
    /// The completion's flags.
    flags: u64,
    /// Report a successful completion.
    report: bool,
    /// Report nothing, errors included (deferred work without `FI_COMPLETION`).
    quiet: bool,
    /// The deferred work it is (its key).
    work: Option<u64>,
    /// The completion counter the NIC counts on.
    comp: Option<usize>,
    /// An endpoint counter the host counts on (deferred work with `FI_COMPLETION`).
    host: Option<usize>,
}

/// Posts a triggered transfer on `qp`.
pub(super) fn post(
    qp: &mut QueuePair,
    t: &TrigPost,
    wr: &SendWr<'_>,
) -> Result<TriggerHandle, Errno> {
    let opts = ringbell::TriggerOpts {
        completion: t.comp.as_ref(),
        signaled: true,
        success_only: t.success_only,
        operand: t.operand,
    };
    qp.post_triggered(&t.trigger, t.threshold, wr, opts)
        .map_err(trig_errno)
}

/// The errno of a refused POST_TRIGGERED: a full table is `-FI_ENOSPC` (the operations
/// waiting in it must fire or be cancelled first).
fn trig_errno(e: ringbell::Error) -> Errno {
    use ringbell_specs::cmd::CmdStatus;
    match e {
        ringbell::Error::Command { status, .. } => match status {
            CmdStatus::Exhausted => abi::FI_ENOSPC,
            CmdStatus::BadState => abi::FI_EOPBADSTATE,
            CmdStatus::BadParam | CmdStatus::BadResource | CmdStatus::BadPd => EINVAL,
            _ => abi::FI_EIO,
        },
        ringbell::Error::InvalidArgument(_) => EINVAL,
        _ => abi::FI_EIO,
    }
}

/// Data segments a triggered WQE (one 64-byte block) holds for an operation.
fn max_sges(p: &Pending) -> usize {
    match p.wr {
        None => 3,
        Some(WrOp::FetchAdd { .. } | WrOp::CmpSwap { .. }) => 1,
        Some(_) => 2,
    }
}

impl State {
    /// A live counter `key` of domain `dom`.
    fn cntr_of(&self, key: usize, dom: usize) -> Result<&Counter, Errno> {
        match self.objs.get(&key) {
            Some(Obj::Cntr(c)) if c.domain == dom => Ok(&c.c),
            _ => Err(EINVAL),
        }
    }

    /// The counter of endpoint `ep` that counts completions with `flags`. Remote accesses
    /// are the device's to count.
    fn ep_cntr(&self, ep: usize, flags: u64) -> Option<usize> {
        let c = &self.objs_ep(ep).ok()?.cntrs;
        let f = |b: u32| flags & b as u64 != 0;
        if f(abi::FI_REMOTE_READ | abi::FI_REMOTE_WRITE) {
            None
        } else if f(abi::FI_SEND) {
            c.send
        } else if f(abi::FI_RECV) {
            c.recv
        } else if f(abi::FI_READ) {
            c.read
        } else if f(abi::FI_WRITE) {
            c.write
        } else {
            None
        }
    }

    /// Adds one to counter `key`'s success or error value.
    fn add_to(&self, key: usize, ok: bool) {
        if let Some(Obj::Cntr(c)) = self.objs.get(&key) {
            if ok {
                c.c.add(1);
            } else {
                c.c.add_error(1);
            }
        }
    }

    /// Counts a completion with `flags` of endpoint `ep` on its bound counter.
    pub(super) fn count(&self, ep: usize, flags: u64, ok: bool) {
        if let Some(k) = self.ep_cntr(ep, flags) {
            self.add_to(k, ok);
        }
    }

    /// The device clock of domain `dom`, in picoseconds.
    pub fn clock_ps(&self, dom: usize) -> Result<u64, Errno> {
        let nic = self.domain(dom)?.nic;
        Ok(self.nics.get(&nic).ok_or(EINVAL)?.dev.clock_ps())
    }

    /// Arms counter `key`: the device notes the time its success value reaches `threshold`
    /// (see [`State::cntr_reached`]).
    pub fn cntr_arm(&mut self, key: usize, threshold: u64) -> Result<(), Errno> {
        let (dom, num) = match self.objs.get(&key) {
            Some(Obj::Cntr(c)) => (c.domain, c.c.num()),
            _ => return Err(EINVAL),
        };
        let nic = self.domain(dom)?.nic;
        self.timing_armed.insert((nic, num));
        self.cntr(key)?.arm(threshold).map_err(|_| abi::FI_EIO)
    }

    /// The device time at which armed counter `key` reached its threshold, if it has.
    pub fn cntr_reached(&mut self, key: usize) -> Result<Option<u64>, Errno> {
        let (dom, num) = match self.objs.get(&key) {
            Some(Obj::Cntr(c)) => (c.domain, c.c.num()),
            _ => return Err(EINVAL),
        };
        let nic = self.domain(dom)?.nic;
        self.nics.get(&nic).ok_or(EINVAL)?;
        self.pump_events(nic);
        let stash = self.cntr_events.entry(nic).or_default();
        let at = stash.iter().position(|e| e.obj == num);
        match at.map(|i| stash.remove(i)) {
            None => Ok(None),
            Some(e) if e.subtype == 0 => Ok(Some(e.timestamp)),
            Some(_) => Err(abi::FI_EIO),
        }
    }

    /// The live counter `key`.
    pub fn cntr(&self, key: usize) -> Result<&Counter, Errno> {
        match self.objs.get(&key) {
            Some(Obj::Cntr(c)) => Ok(&c.c),
            _ => Err(EINVAL),
        }
    }

    /// A new counter in domain `dom` (`fi_cntr_open`).
    pub fn new_cntr(&mut self, dom: usize) -> Result<Cntr, Errno> {
        let c = self.domain(dom)?.pd.create_counter().map_err(|e| {
            eprintln!("ringbell-fi: creating a counter: {e}");
            abi::FI_ENOMEM
        })?;
        Ok(Cntr {
            domain: dom,
            c,
            wait_set: None,
            wait: None,
            seen: (0, 0),
            wait_obj: abi::fi_wait_obj_FI_WAIT_NONE,
        })
    }

    /// Whether counter `key` is bound to an endpoint.
    pub fn cntr_bound(&self, key: usize) -> bool {
        self.objs.values().any(|o| match o {
            Obj::Ep(e) => {
                let c = &e.cntrs;
                [
                    c.send,
                    c.recv,
                    c.read,
                    c.write,
                    c.remote_read,
                    c.remote_write,
                ]
                .contains(&Some(key))
            }
            _ => false,
        })
    }

    /// `fi_ep_bind(ep, cntr, flags)`: the counter counts the endpoint's completions of the
    /// kinds `flags` names (`FI_SEND`, `FI_RECV`, `FI_READ`, `FI_WRITE`) and the remote
    /// accesses to it (`FI_REMOTE_READ`, `FI_REMOTE_WRITE`).
    pub fn bind_ep_cntr(&mut self, ep: usize, cntr: usize, flags: u64) -> Result<(), Errno> {
        const KINDS: u64 = (abi::FI_SEND
            | abi::FI_RECV
            | abi::FI_READ
            | abi::FI_WRITE
            | abi::FI_REMOTE_READ
            | abi::FI_REMOTE_WRITE) as u64;
        let dom = self.objs_ep(ep)?.domain;
        self.cntr_of(cntr, dom)?;
        if flags & !KINDS != 0 || flags == 0 {
            return Err(EINVAL);
        }
        let e = self.ep_mut(ep)?;
        if e.enabled {
            return Err(abi::FI_EOPBADSTATE);
        }
        let c = &mut e.cntrs;
        for (bit, slot) in [
            (abi::FI_SEND, &mut c.send),
            (abi::FI_RECV, &mut c.recv),
            (abi::FI_READ, &mut c.read),
            (abi::FI_WRITE, &mut c.write),
            (abi::FI_REMOTE_READ, &mut c.remote_read),
            (abi::FI_REMOTE_WRITE, &mut c.remote_write),
        ] {
            if flags & bit as u64 != 0 {
                *slot = Some(cntr);
            }
        }
        Ok(())
    }

    /// `fi_mr_bind(mr, cntr, flags)`: the counter counts peers' accesses to the region
    /// (`FI_REMOTE_WRITE`: writes and atomics; `FI_REMOTE_READ`: reads), on the device. The
    /// region must allow them.
    pub fn bind_mr_cntr(&mut self, mr: usize, cntr: usize, flags: u64) -> Result<(), Errno> {
        let c = self.cntr(cntr)?;
        let Some(Obj::Mr(m)) = self.objs.get(&mr) else {
            return Err(EINVAL);
        };
        if flags & !((abi::FI_REMOTE_READ | abi::FI_REMOTE_WRITE) as u64) != 0 || flags == 0 {
            return Err(EINVAL);
        }
        let mut ev = ringbell::CntrEvents::empty();
        if flags & abi::FI_REMOTE_READ as u64 != 0 {
            ev |= ringbell::CntrEvents::REMOTE_READ;
        }
        if flags & abi::FI_REMOTE_WRITE as u64 != 0 {
            ev |= ringbell::CntrEvents::REMOTE_WRITE;
        }
        c.bind_mr(&m.mr, ev).map_err(|e| match e {
            ringbell::Error::Command {
                status: ringbell_specs::cmd::CmdStatus::Busy,
                ..
            } => abi::FI_EBUSY,
            _ => EINVAL,
        })
    }

    /// Binds endpoint `ep`'s remote-access counters to `qp`, a QP of channel `chan`.
    pub(super) fn bind_remote_cntrs(&self, ep: usize, qp: &QueuePair, chan: u8) {
        let Ok(e) = self.objs_ep(ep) else { return };
        if chan != CH_MSG {
            return;
        }
        let (r, w) = (e.cntrs.remote_read, e.cntrs.remote_write);
        for (key, ev) in [
            (r, ringbell::CntrEvents::REMOTE_READ),
            (w, ringbell::CntrEvents::REMOTE_WRITE),
        ] {
            if let Some(Obj::Cntr(c)) = key.and_then(|k| self.objs.get(&k)) {
                if let Err(err) = c.c.bind_qp(qp, ev) {
                    eprintln!("ringbell-fi: binding a counter to a QP: {err}");
                }
            }
        }
    }

    /// Posts operation `op` (work request `p`, on connection `key` of endpoint `ep`) as the
    /// triggered operation `t`; `flags` are its completion's.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post_triggered_op(
        &mut self,
        ep: usize,
        key: ConnKey,
        mut p: Pending,
        mut op: Op,
        t: &Trig,
        flags: u64,
        operand: Option<Sge>,
    ) -> Result<(), Errno> {
        let dom = self.objs_ep(ep)?.domain;
        let trigger = self.cntr_of(t.cntr, dom)?.clone();
        let (comp, comp_key, host) = match t.work {
            Some(w) => {
                let comp = match w.comp {
                    Some(k) => Some(self.cntr_of(k, dom)?.clone()),
                    None => None,
                };
                let host = if op.report {
                    self.ep_cntr(ep, flags)
                } else {
                    None
                };
                (comp, w.comp, host)
            }
            None => {
                let k = self.ep_cntr(ep, flags);
                let comp = match k {
                    Some(k) => Some(self.cntr_of(k, dom)?.clone()),
                    None => None,
                };
                (comp, k, None)
            }
        };
        // The NIC reads the data when the operation fires: data given inline (an inject)
        // is kept in a registered copy of the provider's.
        if let Some(d) = p.inline.take() {
            op._copy = d;
            // SAFETY: `op._copy` is this library's heap copy, kept with the operation (a
            // Vec's buffer does not move when the Vec does) until it completes.
            let mr = unsafe { self.reg(dom, op._copy.as_ptr() as usize, op._copy.len())? };
            p.sges = vec![Sge {
                addr: op._copy.as_ptr() as u64,
                len: op._copy.len() as u32,
                lkey: mr.lkey(),
            }];
            op._tmp.push(mr);
        }
        if p.sges.len() > max_sges(&p) {
            return Err(EINVAL);
        }
        p.trig = Some(TrigPost {
            trigger,
            threshold: t.threshold,
            success_only: t.work.is_none(),
            comp,
            operand,
        });
        let deferred = t.work.is_some();
        let report = op.report;
        let wr_id = p.wr_id;
        let handle = self.transmit(ep, key, p)?;
        op.kind = OpKind::Trig(TrigOp {
            handle,
            ctx: op.ctx,
            flags,
            report,
            quiet: deferred && !report,
            work: t.work.map(|w| w.key),
            comp: comp_key,
            host,
        });
        self.ep_mut(ep)?.ops.insert(wr_id, op);
        if let Some(w) = t.work {
            if let Some(Obj::Domain(d)) = self.objs.get_mut(&dom) {
                d.work.insert(
                    w.key,
                    Work::Xfer {
                        ep,
                        wr_id,
                        cntr: t.cntr,
                    },
                );
            }
        }
        Ok(())
    }

    /// A triggered tagged send (eager only: at most [`EAGER_MAX`] bytes, else
    /// `-FI_ENOSYS`): one SEND (on the tag matcher's connection, as work of the provider's
    /// own) of the TMH, from a registered copy of the provider's, and the data, read from the application's buffers when it fires (from a
    /// copy taken now for an inject).
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes, and is readable now.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn post_tsend_triggered(
        &mut self,
        ep: usize,
        (dom, own, peer): (usize, Addr, Addr),
        bufs: &[(usize, usize, usize)],
        req: SendReq,
        tag: u64,
        t: Trig,
    ) -> Result<(), Errno> {
        let total: usize = bufs.iter().map(|b| b.1).sum();
        if total > EAGER_MAX {
            return Err(abi::FI_ENOSYS);
        }
        let _ = own;
        let e = self.ep_mut(ep)?;
        let id = e.next_wr;
        e.next_wr += 1;
        let tx_selective = e.tx_selective;
        // An eager tagged message: the TMH, then the data; remote CQ data as the SEND's
        // immediate (the tag matcher's CQ-data mode).
        let tmh = ringbell::tm::Tmh {
            opcode: ringbell::tm::TmhOp::Eager as u8,
            app_ctx: 0,
            tag,
        };
        let mut hdr = tmh.to_bytes().to_vec();
        let (data, mut tmp) = if req.inject {
            for &(addr, len, _) in bufs.iter().filter(|b| b.1 > 0) {
                // SAFETY: readable now, per the caller.
                hdr.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len)
                });
            }
            (Vec::new(), Vec::new())
        } else {
            // SAFETY: per the caller.
            unsafe { self.sges(dom, bufs, Access::empty())? }
        };
        // SAFETY: `hdr` is this library's heap copy, kept with the operation (a Vec's buffer
        // does not move when the Vec does) until it completes.
        let mr = unsafe { self.reg(dom, hdr.as_ptr() as usize, hdr.len())? };
        let mut sges = vec![Sge {
            addr: hdr.as_ptr() as u64,
            len: hdr.len() as u32,
            lkey: mr.lkey(),
        }];
        sges.extend(data);
        tmp.push(mr);
        let p = Pending {
            wr_id: id,
            sges,
            inline: None,
            imm: req.imm,
            wr: None,
            trig: None,
            tsend: None,
        };
        let report = match t.work {
            Some(_) => req.report && !req.silent,
            None => !req.silent && (req.report || !tx_selective),
        };
        let op = Op {
            ctx: req.ctx,
            send: true,
            report,
            buf: 0,
            room: 0,
            _tmp: tmp,
            _copy: hdr,
            kind: OpKind::Msg,
        };
        let flags = abi::FI_SEND as u64 | abi::FI_TAGGED as u64;
        self.post_triggered_op(ep, (peer, CH_TAG), p, op, &t, flags, None)
    }

    /// Forgets deferred work `key` of endpoint `ep`'s domain (it is over).
    fn forget_work(&mut self, ep: usize, key: Option<u64>) {
        let Some(key) = key else { return };
        let Ok(dom) = self.objs_ep(ep).map(|e| e.domain) else {
            return;
        };
        if let Some(Obj::Domain(d)) = self.objs.get_mut(&dom) {
            d.work.remove(&key);
        }
    }

    /// A triggered transfer completed (its CQE).
    pub(super) fn finish_trig(&mut self, ep: usize, t: TrigOp, w: &WorkCompletion) {
        let ok = w.status == WcStatus::Success;
        self.forget_work(ep, t.work);
        if let Some(k) = t.host {
            self.add_to(k, ok);
        }
        if (ok && !t.report) || (!ok && t.quiet) {
            return;
        }
        let txcq = self.objs_ep(ep).ok().and_then(|e| e.txcq);
        let err = match w.status {
            WcStatus::Success => 0,
            WcStatus::RemAccessErr | WcStatus::RemInvReqErr => abi::FI_EACCES as i32,
            WcStatus::WrFlushErr => abi::FI_ECANCELED as i32,
            _ => abi::FI_EIO as i32,
        };
        self.push(
            txcq,
            Entry {
                ctx: t.ctx,
                flags: t.flags,
                src: ADDR_UNSPEC,
                err,
                prov_errno: if ok { 0 } else { w.status as i32 },
                ..Default::default()
            },
        );
    }

    /// A triggered transfer that never reached the NIC (its connection failed): an error
    /// on its completion counter, and an error completion unless it is quiet.
    pub(super) fn fail_trig(&mut self, ep: usize, t: TrigOp) {
        self.forget_work(ep, t.work);
        for k in [t.comp, t.host].into_iter().flatten() {
            self.add_to(k, false);
        }
        if t.quiet {
            return;
        }
        let txcq = self.objs_ep(ep).ok().and_then(|e| e.txcq);
        self.push(
            txcq,
            Entry {
                ctx: t.ctx,
                flags: t.flags,
                src: ADDR_UNSPEC,
                err: abi::FI_EHOSTUNREACH as i32,
                ..Default::default()
            },
        );
    }

    /// Queues a counter operation (`FI_OP_CNTR_ADD` / `FI_OP_CNTR_SET`) of domain `dom`:
    /// when `cntr` reaches `threshold` (success + error), `target` gets `value` added to its
    /// success value or its success value set to `value` (and its error value cleared).
    pub fn queue_cntr_work(
        &mut self,
        dom: usize,
        key: u64,
        (cntr, threshold): (usize, u64),
        target: usize,
        value: u64,
        set: bool,
    ) -> Result<(), Errno> {
        self.check(dom, Kind::Domain)?;
        let trig = self.cntr_of(cntr, dom)?;
        let tgt = self.cntr_of(target, dom)?;
        let r = if set {
            trig.post_triggered_set(threshold, tgt, value, 0)
        } else {
            trig.post_triggered_add(threshold, tgt, value, 0)
        };
        let handle = r.map_err(trig_errno)?;
        if let Some(Obj::Domain(d)) = self.objs.get_mut(&dom) {
            d.work.insert(key, Work::Cntr { handle, cntr });
        }
        Ok(())
    }

    /// `FI_CANCEL_WORK`: takes back deferred work `key` of domain `dom` that has not fired;
    /// `-FI_ENOENT` for work the domain does not hold (never queued, fired, cancelled or
    /// flushed).
    pub fn cancel_work(&mut self, dom: usize, key: u64) -> Result<(), Errno> {
        let nic = match self.objs.get_mut(&dom) {
            Some(Obj::Domain(d)) => d.nic,
            _ => return Err(EINVAL),
        };
        let w = match self.objs.get_mut(&dom) {
            Some(Obj::Domain(d)) => d.work.remove(&key),
            _ => None,
        };
        let dev = self.nics.get(&nic).ok_or(EINVAL)?.dev.clone();
        match w.ok_or(abi::FI_ENOENT)? {
            Work::Cntr { handle, .. } => dev.cancel_triggered(handle).map_err(|_| abi::FI_ENOENT),
            Work::Xfer { ep, wr_id, .. } => {
                let e = self.ep_mut(ep).map_err(|_| abi::FI_ENOENT)?;
                let handle = match e.ops.get(&wr_id).map(|o| &o.kind) {
                    Some(OpKind::Trig(t)) => t.handle,
                    _ => return Err(abi::FI_ENOENT),
                };
                match handle {
                    Some(h) => dev.cancel_triggered(h).map_err(|_| abi::FI_ENOENT)?,
                    None => {
                        // Still waiting for its connection, in the provider.
                        for c in e
                            .conns
                            .values_mut()
                            .chain(e.extra.iter_mut().map(|x| &mut x.1))
                        {
                            if let Conn::Pending(_, q) = c {
                                q.retain(|p| p.wr_id != wr_id);
                            }
                        }
                    }
                }
                e.ops.remove(&wr_id);
                Ok(())
            }
        }
    }

    /// `FI_FLUSH_WORK`: cancels the deferred work of domain `dom` that has not fired, all of
    /// it or (`cntr`) that waiting on one triggering counter.
    pub fn flush_work(&mut self, dom: usize, cntr: Option<usize>) -> Result<(), Errno> {
        let keys: Vec<u64> = match self.objs.get(&dom) {
            Some(Obj::Domain(d)) => d
                .work
                .iter()
                .filter(|(_, w)| cntr.is_none_or(|c| w.cntr() == c))
                .map(|(&k, _)| k)
                .collect(),
            _ => return Err(EINVAL),
        };
        for k in keys {
            // Work that fired in the meantime is not there to cancel.
            let _ = self.cancel_work(dom, k);
        }
        Ok(())
    }
}
