//! The requester: fetches send WQEs, validates them, segments messages at the path MTU into
//! RoCEv2 packets, and completes WQEs in order as ACKs and responses arrive.

use crate::env::{Env, NicEvent};
use crate::mem::KeyError;
use crate::nic::Nic;
use crate::qp::{Outstanding, Qp, Sge};
use ringbell_specs::cmd::{Access, QpState};
use ringbell_specs::cqe::{CqeStatus, DoorbellError, VendorSyndrome};
use ringbell_specs::wire::{AethSyndrome, NakCode, Opcode, Packet};
use ringbell_specs::wqe::{
    self, AtomicSeg, CtrlSeg, DataSeg, RaddrSeg, SendOpcode, WqeFlags, INLINE_MARK, MAX_DS, SEG,
    WQEBB,
};
use ringbell_specs::{Psn, SimTime};
use zerocopy::FromBytes;

/// A decoded send WQE.
struct SendWqe {
    op: SendOpcode,
    flags: WqeFlags,
    imm: u32,
    nbb: u32,
    raddr: u64,
    rkey: u32,
    atomic: (u64, u64),
    /// Gather/scatter list (empty when inline).
    sges: Vec<Sge>,
    /// Inline payload.
    inline: Vec<u8>,
    len: u64,
}

/// Why a WQE could not be started.
type WqeError = (CqeStatus, VendorSyndrome);

impl Nic {
    /// The send engine: starts at most one WQE, then reschedules itself.
    pub(crate) fn sq_process(&mut self, env: &mut dyn Env, qpn: u32) {
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        qp.req.scheduled = false;
        let again = self.start_next_wqe(env, &mut qp);
        let busy = qp.req.busy_until;
        self.qps.restore(qpn, qp);
        if again {
            // Do not run further ahead of the wire than a few frames.
            let horizon = self.egress_free - SimTime(2_000_000);
            self.kick_sq(env, qpn, busy.max(horizon));
        }
    }

    /// Returns whether more work may be startable.
    fn start_next_wqe(&mut self, env: &mut dyn Env, qp: &mut Qp) -> bool {
        if qp.state != QpState::Rts || qp.fetch == qp.sq.pi {
            return false;
        }
        if qp.req.outstanding.iter().any(|o| o.error.is_some()) {
            return false;
        }
        let now = env.now();
        let index = qp.fetch;
        let wqe = match self.read_send_wqe(env, qp, index) {
            Ok(Some(w)) => w,
            Ok(None) => return false,
            Err((e, nbb)) => {
                self.fail_wqe(env, qp, index, nbb, e);
                return false;
            }
        };
        let rd_atomic = matches!(
            wqe.op,
            SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd
        );
        if wqe.flags.contains(WqeFlags::FENCE) && qp.req.rd_atomic > 0 {
            return false; // resumed when the outstanding READs/atomics complete
        }
        if rd_atomic && qp.req.rd_atomic >= (qp.attr.max_rd_atomic as u32).max(1) {
            return false;
        }
        if let Err(e) = self.check_local(env, qp, &wqe) {
            self.fail_wqe(env, qp, index, wqe.nbb, e);
            return false;
        }
        let t = &self.cfg.timing;
        let fetched = now + SimTime(t.dma_read_rtt_ps);
        let gathers = !wqe.sges.is_empty() && !rd_atomic;
        let data_at = if gathers {
            fetched + SimTime(t.dma_read_rtt_ps)
        } else {
            fetched
        };
        let ready = data_at + SimTime(t.nic_tx_wqe_ps);
        let first_psn = qp.req.next_psn;
        let mtu = qp.mtu();
        let npsn = match wqe.op {
            SendOpcode::Read => (wqe.len as u32).div_ceil(mtu).max(1),
            SendOpcode::CmpSwap | SendOpcode::FetchAdd => 1,
            _ => {
                let n = (wqe.len as u32).div_ceil(mtu).max(1);
                if let Err(f) = self.emit_data_packets(env, qp, &wqe, first_psn, ready) {
                    self.iommu_fault(env, qp.qpn, f);
                    self.fail_wqe(
                        env,
                        qp,
                        index,
                        wqe.nbb,
                        (CqeStatus::GeneralErr, VendorSyndrome::IommuFault),
                    );
                    return false;
                }
                n
            }
        };
        match wqe.op {
            SendOpcode::Read => {
                let reth = ringbell_specs::wire::Reth {
                    va: wqe.raddr,
                    rkey: wqe.rkey,
                    len: wqe.len as u32,
                };
                let mut repr = self.packet_repr(qp, Opcode::ReadRequest, first_psn, true);
                repr.reth = Some(reth);
                self.emit(env, &repr, &[], ready);
            }
            SendOpcode::CmpSwap | SendOpcode::FetchAdd => {
                let opc = if wqe.op == SendOpcode::CmpSwap {
                    Opcode::CompareSwap
                } else {
                    Opcode::FetchAdd
                };
                let mut repr = self.packet_repr(qp, opc, first_psn, true);
                repr.atomic_eth = Some(ringbell_specs::wire::AtomicEth {
                    va: wqe.raddr,
                    rkey: wqe.rkey,
                    swap_add: wqe.atomic.0,
                    compare: wqe.atomic.1,
                });
                self.emit(env, &repr, &[], ready);
            }
            _ => {}
        }
        qp.req.next_psn = first_psn.add(npsn);
        if rd_atomic {
            qp.req.rd_atomic += 1;
        }
        qp.req.outstanding.push_back(Outstanding {
            wqe_index: index,
            op: wqe.op,
            signaled: wqe.flags.contains(WqeFlags::SIGNALED),
            first_psn,
            npsn,
            len: wqe.len as u32,
            sges: if rd_atomic { wqe.sges } else { Vec::new() },
            error: None,
            done: false,
        });
        qp.fetch = index.wrapping_add(wqe.nbb);
        qp.req.busy_until = now + SimTime(self.cfg.timing.nic_per_qp_wqe_ps);
        qp.fetch != qp.sq.pi
    }

    /// Reads and decodes WQE `index`. `Ok(None)`: the WQE is stale (doorbell error raised).
    fn read_send_wqe(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        index: u32,
    ) -> Result<Option<SendWqe>, (WqeError, u32)> {
        let mut raw = [0u8; MAX_DS * SEG];
        let first = qp.sq.slot_iova(index, WQEBB as u64);
        if let Err(f) = env.dma_read(first, &mut raw[..WQEBB]) {
            self.iommu_fault(env, qp.qpn, f.iova);
            return Err(((CqeStatus::GeneralErr, VendorSyndrome::IommuFault), 1));
        }
        let ctrl = CtrlSeg::read_from_bytes(&raw[..SEG]).unwrap_or_default();
        // An all-zero control segment was never written (no opcode is 0). Without this check
        // a fresh ring's block 0 (index 0) would pass the wqe_index test and be reported as a
        // malformed WQE instead of a doorbell rung before its WQE was written.
        let unwritten = ctrl == CtrlSeg::default();
        if ctrl.wqe_index.get() != index as u16 || unwritten {
            // Nothing valid was written here: forget the doorbell past this point.
            qp.sq.pi = index;
            self.doorbell_error(env, qp.qpn, DoorbellError::StaleWqe, index);
            return Ok(None);
        }
        let ds = ctrl.ds_count as usize;
        if ds == 0 || ds > MAX_DS {
            return Err(((CqeStatus::LocQpOpErr, VendorSyndrome::BadSegment), 1));
        }
        let nbb = wqe::wqebbs(ds) as u32;
        let posted = qp.sq.pi.wrapping_sub(index);
        if nbb > posted {
            // The WQE claims more blocks than the doorbell covers. If a covered block starts a
            // WQE of its own (its control segment carries its index), ds_count is corrupt and
            // this WQE ends there, so the WQEs behind it still get their flush completions;
            // otherwise the doorbell ended inside this WQE and it takes every posted block.
            let mut end = posted;
            for b in 1..posted {
                let at = qp.sq.slot_iova(index.wrapping_add(b), WQEBB as u64);
                let mut c = [0u8; SEG];
                let own = env.dma_read(at, &mut c).is_ok()
                    && CtrlSeg::read_from_bytes(&c).is_ok_and(|c| {
                        c != CtrlSeg::default() && c.wqe_index.get() == index.wrapping_add(b) as u16
                    });
                if own {
                    end = b;
                    break;
                }
            }
            return Err(((CqeStatus::LocQpOpErr, VendorSyndrome::BadSegment), end));
        }
        for b in 1..nbb {
            let at = qp.sq.slot_iova(index.wrapping_add(b), WQEBB as u64);
            let s = b as usize * WQEBB;
            if let Err(f) = env.dma_read(at, &mut raw[s..s + WQEBB]) {
                self.iommu_fault(env, qp.qpn, f.iova);
                return Err(((CqeStatus::GeneralErr, VendorSyndrome::IommuFault), nbb));
            }
        }
        let bad = |s| Err(((CqeStatus::LocQpOpErr, s), nbb));
        let Some(op) = SendOpcode::from_u8(ctrl.opcode) else {
            return bad(VendorSyndrome::BadOpcode);
        };
        let Some(flags) = WqeFlags::from_bits(ctrl.flags) else {
            return bad(VendorSyndrome::BadSegment);
        };
        let body = &raw[SEG..ds * SEG];
        let mut w = SendWqe {
            op,
            flags,
            imm: ctrl.imm.get(),
            nbb,
            raddr: 0,
            rkey: 0,
            atomic: (0, 0),
            sges: Vec::new(),
            inline: Vec::new(),
            len: 0,
        };
        let mut rest = body;
        if op.has_raddr() {
            let Some((r, tail)) = split_seg::<RaddrSeg>(rest) else {
                return bad(VendorSyndrome::BadSegment);
            };
            w.raddr = r.raddr.get();
            w.rkey = r.rkey.get();
            rest = tail;
        }
        if op.is_atomic() {
            let Some((a, tail)) = split_seg::<AtomicSeg>(rest) else {
                return bad(VendorSyndrome::BadSegment);
            };
            w.atomic = (a.swap_add.get(), a.compare.get());
            rest = tail;
        }
        if flags.contains(WqeFlags::INLINE) {
            if matches!(
                op,
                SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd
            ) || rest.len() < 4
            {
                return bad(VendorSyndrome::BadSegment);
            }
            let bc = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let n = (bc & !INLINE_MARK) as usize;
            if bc & INLINE_MARK == 0 || n > rest.len() - 4 {
                return bad(VendorSyndrome::BadSegment);
            }
            w.inline = rest[4..4 + n].to_vec();
            w.len = n as u64;
        } else {
            for chunk in rest.chunks_exact(SEG) {
                let d = DataSeg::read_from_bytes(chunk).unwrap_or_default();
                w.sges.push(Sge {
                    lkey: d.lkey.get(),
                    addr: d.addr.get(),
                    len: d.byte_count.get(),
                });
                w.len += d.byte_count.get() as u64;
            }
            if w.len > self.cfg.max_msg_size as u64 {
                return Err(((CqeStatus::LocLenErr, VendorSyndrome::TooLong), nbb));
            }
            if op.is_atomic() && (w.sges.len() != 1 || w.len != 8) {
                return bad(VendorSyndrome::BadSegment);
            }
        }
        if op.is_atomic() {
            w.len = 8;
        }
        Ok(Some(w))
    }

    /// Checks the local keys of a WQE and that its buffers are reachable through the IOMMU.
    fn check_local(&mut self, env: &mut dyn Env, qp: &Qp, w: &SendWqe) -> Result<(), WqeError> {
        let need = match w.op {
            SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd => Access::LOCAL_WRITE,
            _ => Access::empty(),
        };
        for s in &w.sges {
            let iova = self
                .check_key(qp.pdn, s.lkey, s.addr, s.len as u64, need)
                .map_err(|e: KeyError| (CqeStatus::LocProtErr, e.syndrome()))?;
            if s.len > 0 {
                if let Err(f) = env.dma_check(iova, s.len as usize) {
                    self.iommu_fault(env, qp.qpn, f.iova);
                    return Err((CqeStatus::GeneralErr, VendorSyndrome::IommuFault));
                }
            }
        }
        Ok(())
    }

    /// Copies `out.len()` message bytes starting at `offset` out of a gather list.
    pub(crate) fn gather(
        &self,
        env: &mut dyn Env,
        pdn: u32,
        sges: &[Sge],
        mut offset: u64,
        out: &mut [u8],
    ) -> Result<(), u64> {
        let mut done = 0;
        for s in sges {
            if done == out.len() {
                break;
            }
            let len = s.len as u64;
            if offset >= len {
                offset -= len;
                continue;
            }
            let n = ((len - offset) as usize).min(out.len() - done);
            let iova = self
                .check_key(pdn, s.lkey, s.addr + offset, n as u64, Access::empty())
                .map_err(|_| s.addr)?;
            env.dma_read(iova, &mut out[done..done + n])
                .map_err(|f| f.iova)?;
            done += n;
            offset = 0;
        }
        Ok(())
    }

    /// Segments a SEND or WRITE into packets and puts them on the wire.
    fn emit_data_packets(
        &mut self,
        env: &mut dyn Env,
        qp: &Qp,
        w: &SendWqe,
        first_psn: Psn,
        ready: SimTime,
    ) -> Result<(), u64> {
        let mtu = qp.mtu() as u64;
        let n = w.len.div_ceil(mtu).max(1);
        let is_send = matches!(w.op, SendOpcode::Send | SendOpcode::SendImm);
        let mut payload = std::mem::take(&mut self.scratch);
        let mut at = ready;
        for i in 0..n {
            let off = i * mtu;
            let len = (w.len - off).min(mtu) as usize;
            payload.clear();
            payload.resize(len, 0);
            if w.sges.is_empty() {
                payload.copy_from_slice(&w.inline[off as usize..off as usize + len]);
            } else {
                self.gather(env, qp.pdn, &w.sges, off, &mut payload)?;
                at = at.max(ready + SimTime(self.cfg.timing.pcie_read_ps(len)));
            }
            let (first, last) = (i == 0, i + 1 == n);
            let opcode = match (is_send, first, last, w.op.has_imm()) {
                (true, true, true, false) => Opcode::SendOnly,
                (true, true, true, true) => Opcode::SendOnlyImm,
                (true, true, false, _) => Opcode::SendFirst,
                (true, false, false, _) => Opcode::SendMiddle,
                (true, false, true, false) => Opcode::SendLast,
                (true, false, true, true) => Opcode::SendLastImm,
                (false, true, true, false) => Opcode::WriteOnly,
                (false, true, true, true) => Opcode::WriteOnlyImm,
                (false, true, false, _) => Opcode::WriteFirst,
                (false, false, false, _) => Opcode::WriteMiddle,
                (false, false, true, false) => Opcode::WriteLast,
                (false, false, true, true) => Opcode::WriteLastImm,
            };
            let mut repr = self.packet_repr(qp, opcode, first_psn.add(i as u32), last);
            repr.bth.solicited = last && w.flags.contains(WqeFlags::SOLICITED);
            if opcode.has_reth() {
                repr.reth = Some(ringbell_specs::wire::Reth {
                    va: w.raddr,
                    rkey: w.rkey,
                    len: w.len as u32,
                });
            }
            if opcode.has_immdt() {
                repr.imm = Some(w.imm);
            }
            self.emit(env, &repr, &payload, at);
        }
        self.scratch = payload;
        Ok(())
    }

    /// Fails WQE `index` (it completes with `e` once everything before it has completed).
    fn fail_wqe(&mut self, env: &mut dyn Env, qp: &mut Qp, index: u32, nbb: u32, e: WqeError) {
        qp.req.outstanding.push_back(Outstanding {
            wqe_index: index,
            op: SendOpcode::Send,
            signaled: true,
            first_psn: qp.req.next_psn,
            npsn: 0,
            len: 0,
            sges: Vec::new(),
            error: Some(e),
            done: false,
        });
        // Keep the opcode the WQE had, if it could be read, for the error CQE.
        let mut b = [0u8; 16];
        if env
            .dma_read(qp.sq.slot_iova(index, WQEBB as u64), &mut b)
            .is_ok()
        {
            if let (Ok(c), Some(o)) = (CtrlSeg::read_from_bytes(&b), qp.req.outstanding.back_mut())
            {
                o.op = SendOpcode::from_u8(c.opcode).unwrap_or(SendOpcode::Send);
            }
        }
        qp.fetch = index.wrapping_add(nbb.max(1));
        self.complete_in_order(env, qp);
    }

    /// Handles a response packet (ACK, NAK, READ response, atomic ACK) for `qp`.
    pub(crate) fn handle_response(&mut self, env: &mut dyn Env, qp: &mut Qp, pkt: &Packet<'_>) {
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) {
            self.stats.rx_dropped += 1;
            return;
        }
        let psn = pkt.repr.bth.psn;
        let Some(op) = Opcode::from_u8(pkt.repr.bth.opcode) else {
            return;
        };
        let ready = env.now() + SimTime(self.cfg.timing.nic_rx_pkt_ps);
        match op {
            Opcode::Acknowledge => {
                let Some(aeth) = pkt.repr.aeth else { return };
                match aeth.syndrome {
                    AethSyndrome::Ack { .. } => self.ack_through(qp, psn, true),
                    AethSyndrome::RnrNak { timer } => self.rnr_nak(env, qp, psn, timer),
                    AethSyndrome::Nak(NakCode::PsnSequenceError) => {
                        self.rewind(env, qp, psn, ready)
                    }
                    AethSyndrome::Nak(code) => {
                        self.ack_through(qp, psn, false);
                        let status = match code {
                            NakCode::InvalidRequest => CqeStatus::RemInvReqErr,
                            NakCode::RemoteAccessError => CqeStatus::RemAccessErr,
                            _ => CqeStatus::RemOpErr,
                        };
                        // The NAK names the PSN of the failed request: charge the WQE whose
                        // PSN range holds it (the oldest unfinished one if none does).
                        let holds = |o: &Outstanding| {
                            o.npsn > 0 && psn.diff(o.first_psn) >= 0 && o.last_psn().diff(psn) >= 0
                        };
                        let pos = qp
                            .req
                            .outstanding
                            .iter()
                            .position(|o| !o.done && o.error.is_none() && holds(o));
                        let pos = pos.or_else(|| {
                            qp.req
                                .outstanding
                                .iter()
                                .position(|o| !o.done && o.error.is_none())
                        });
                        if let Some(o) = pos.and_then(|i| qp.req.outstanding.get_mut(i)) {
                            o.error = Some((status, VendorSyndrome::None));
                        }
                    }
                }
            }
            Opcode::ReadResponseFirst
            | Opcode::ReadResponseMiddle
            | Opcode::ReadResponseLast
            | Opcode::ReadResponseOnly => {
                self.ack_through(qp, psn, false);
                let mtu = qp.mtu() as u64;
                let pdn = qp.pdn;
                let Some(o) = qp.req.outstanding.iter_mut().find(|o| {
                    o.op == SendOpcode::Read
                        && !o.done
                        && psn.diff(o.first_psn) >= 0
                        && o.last_psn().diff(psn) >= 0
                }) else {
                    return;
                };
                let offset = psn.diff(o.first_psn) as u64 * mtu;
                let payload = pkt.payload;
                if offset + payload.len() as u64 > o.len as u64 {
                    o.error = Some((CqeStatus::BadRespErr, VendorSyndrome::TooLong));
                } else {
                    let sges = o.sges.clone();
                    let is_last = op.is_last();
                    let qpn = qp.qpn;
                    match self.scatter(env, pdn, qpn, &sges, offset, payload, ready) {
                        Ok(_) => {}
                        Err(e) => {
                            if let Some(o) = qp
                                .req
                                .outstanding
                                .iter_mut()
                                .find(|o| o.op == SendOpcode::Read && !o.done)
                            {
                                o.error = Some(e);
                            }
                        }
                    }
                    if is_last {
                        if let Some(o) = qp
                            .req
                            .outstanding
                            .iter_mut()
                            .find(|o| o.op == SendOpcode::Read && !o.done && o.error.is_none())
                        {
                            o.done = true;
                        }
                    }
                }
            }
            Opcode::AtomicAcknowledge => {
                self.ack_through(qp, psn, false);
                let Some(orig) = pkt.repr.atomic_ack else {
                    return;
                };
                let pdn = qp.pdn;
                let qpn = qp.qpn;
                let Some(o) = qp
                    .req
                    .outstanding
                    .iter_mut()
                    .find(|o| o.op.is_atomic() && o.first_psn == psn && !o.done)
                else {
                    return;
                };
                let sges = o.sges.clone();
                let r = self.scatter(env, pdn, qpn, &sges, 0, &orig.to_le_bytes(), ready);
                if let Some(o) = qp
                    .req
                    .outstanding
                    .iter_mut()
                    .find(|o| o.op.is_atomic() && o.first_psn == psn && !o.done)
                {
                    match r {
                        Ok(()) => o.done = true,
                        Err(e) => o.error = Some(e),
                    }
                }
            }
            _ => {}
        }
        self.complete_in_order_at(env, qp, ready);
    }

    /// Writes response data into a local scatter list (the writes land after the PCIe delay).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn scatter(
        &mut self,
        env: &mut dyn Env,
        pdn: u32,
        qpn: u32,
        sges: &[Sge],
        mut offset: u64,
        data: &[u8],
        ready: SimTime,
    ) -> Result<(), WqeError> {
        let mut done = 0usize;
        for s in sges {
            if done == data.len() {
                break;
            }
            let len = s.len as u64;
            if offset >= len {
                offset -= len;
                continue;
            }
            let n = ((len - offset) as usize).min(data.len() - done);
            let iova = self
                .check_key(pdn, s.lkey, s.addr + offset, n as u64, Access::LOCAL_WRITE)
                .map_err(|e| (CqeStatus::LocProtErr, e.syndrome()))?;
            if let Err(f) = env.dma_check(iova, n) {
                self.iommu_fault(env, qpn, f.iova);
                return Err((CqeStatus::GeneralErr, VendorSyndrome::IommuFault));
            }
            self.post_dma_write(env, ready, iova, &data[done..done + n], qpn);
            done += n;
            offset = 0;
        }
        if done < data.len() {
            return Err((CqeStatus::LocLenErr, VendorSyndrome::TooLong));
        }
        Ok(())
    }

    /// Marks SEND/WRITE WQEs whose last PSN is before `psn` (or at it, when `inclusive`) acked.
    fn ack_through(&mut self, qp: &mut Qp, psn: Psn, inclusive: bool) {
        for o in qp.req.outstanding.iter_mut() {
            if o.is_rd_atomic() || o.error.is_some() || o.npsn == 0 {
                continue;
            }
            let d = psn.diff(o.last_psn());
            if d > 0 || (inclusive && d == 0) {
                o.done = true;
            }
        }
    }

    /// Go back to the WQE holding `psn` and send again from there.
    fn rewind(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn, at: SimTime) {
        self.ack_through(qp, psn, false);
        let Some(pos) = qp
            .req
            .outstanding
            .iter()
            .position(|o| !o.done && o.error.is_none())
        else {
            return;
        };
        let o = &qp.req.outstanding[pos];
        qp.fetch = o.wqe_index;
        qp.req.next_psn = o.first_psn;
        let dropped = qp.req.outstanding.split_off(pos);
        qp.req.rd_atomic = qp
            .req
            .rd_atomic
            .saturating_sub(dropped.iter().filter(|o| o.is_rd_atomic()).count() as u32);
        if !qp.req.scheduled {
            qp.req.scheduled = true;
            env.schedule(
                at,
                NicEvent::SqProcess {
                    qpn: qp.qpn,
                    gen: qp.gen,
                },
            );
        }
    }

    fn rnr_nak(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn, timer: u8) {
        if qp.attr.rnr_retry != 7 {
            if qp.req.rnr_left == 0 {
                qp.req.rnr_left = qp.attr.rnr_retry + 1;
            }
            qp.req.rnr_left -= 1;
            if qp.req.rnr_left == 0 {
                self.ack_through(qp, psn, false);
                if let Some(o) = qp
                    .req
                    .outstanding
                    .iter_mut()
                    .find(|o| !o.done && o.error.is_none())
                {
                    o.error = Some((CqeStatus::RnrRetryExcErr, VendorSyndrome::None));
                }
                return;
            }
        }
        let wait = SimTime(ringbell_specs::wire::rnr_timer_ps(timer));
        let at = env.now() + wait;
        self.rewind(env, qp, psn, at);
    }

    fn complete_in_order(&mut self, env: &mut dyn Env, qp: &mut Qp) {
        let now = env.now();
        self.complete_in_order_at(env, qp, now);
    }

    /// Completes finished WQEs from the head of the outstanding list, in order.
    fn complete_in_order_at(&mut self, env: &mut dyn Env, qp: &mut Qp, ready: SimTime) {
        let mut freed = false;
        while let Some(front) = qp.req.outstanding.front() {
            if let Some((status, syn)) = front.error {
                let cqe = Self::send_cqe(qp.qpn, front, status, syn);
                self.complete(env, qp.gen, qp.send_cqn, ready, cqe);
                qp.req.outstanding.pop_front();
                // The QP is in error: everything else is flushed.
                self.flush(env, qp);
                return;
            }
            if !front.done {
                break;
            }
            if front.signaled {
                let cqe = Self::send_cqe(qp.qpn, front, CqeStatus::Success, VendorSyndrome::None);
                self.complete(env, qp.gen, qp.send_cqn, ready, cqe);
            }
            if front.is_rd_atomic() {
                qp.req.rd_atomic = qp.req.rd_atomic.saturating_sub(1);
                freed = true;
            }
            qp.req.rnr_left = 0;
            qp.req.outstanding.pop_front();
        }
        if freed && qp.fetch != qp.sq.pi && !qp.req.scheduled && qp.state == QpState::Rts {
            qp.req.scheduled = true;
            env.schedule(
                ready,
                NicEvent::SqProcess {
                    qpn: qp.qpn,
                    gen: qp.gen,
                },
            );
        }
    }
}

fn split_seg<T: FromBytes>(b: &[u8]) -> Option<(T, &[u8])> {
    if b.len() < SEG {
        return None;
    }
    let v = T::read_from_prefix(b).ok()?.0;
    Some((v, &b[SEG..]))
}
