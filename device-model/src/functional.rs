//! Functional (untimed) mode: whole RC messages handed from a requester straight to its
//! peer's responder, with no frames, no ACKs and one copy of the payload.
//!
//! The environment opts in ([`Env::functional`]). The send engine of an eligible QP
//! ([`Nic::fm_eligible`]) then takes its WQEs one after the other in one event: each eligible
//! one (WRITE, WRITE with immediate, SEND, SEND with immediate, inline or gathered; READ;
//! compare-and-swap and fetch-and-add) goes to [`Env::fm_deliver`], which runs
//! [`Nic::fm_receive`] on the peer NIC. The responder checks it exactly as the packet path
//! would (sequence, keys, bounds, rights, alignment, IOMMU, receive WQE from the RQ or a
//! plain SRQ, length, responder resources) and executes it only if it would succeed there:
//! a READ copies the responder's bytes into the requester's scatter list, an atomic runs on
//! the responder's memory and hands its original value back for the requester's list, and
//! the responder remembers both as its resources, as for a request packet. Anything else (an
//! error to report, an RNR, a message another message is in the middle of, a TM-SRQ,
//! counters) is refused with nothing changed, and the requester sends that WQE on the packet
//! path, where nothing else is outstanding, so ordering holds and errors are reported by the
//! same code. PSNs and MSNs advance on both sides as the packets would have advanced them,
//! so later work on the packet path continues the same sequence.
//!
//! Simulated time does not advance for the message itself: data is placed at the instant of
//! the send engine's event, and completions are queued from that instant (their CQE write
//! still costs the profile's PCIe and ordering delays, as on the packet path).

use crate::env::{Env, FmData, FmMsg, FmOp};
use crate::nic::Nic;
use crate::qp::{Qp, RecvCtx, Resource};
use crate::responder::recv_cqe;
use ringbell_specs::cmd::{Access, CntrEvents, QpState};
use ringbell_specs::cqe::{CqeOpcode, CqeStatus, VendorSyndrome, CQE_FLAG_IMM, CQE_FLAG_SOLICITED};
use ringbell_specs::wire::Opcode;
use ringbell_specs::wqe::{SendOpcode, WqeFlags, MAX_SEND_SGE};
use ringbell_specs::SimTime;

impl Nic {
    /// Whether the send engine of `qp` may run WQEs functionally now: RTS, nothing
    /// outstanding or waiting on the send side (so no packet of it is in flight and nothing
    /// completes out of order), no RNR wait, no counter bound to the QP, and no posted DMA
    /// write of this NIC still to land. UD and UC QPs always take the packet path.
    pub(crate) fn fm_eligible(&self, qp: &Qp, now: SimTime) -> bool {
        qp.state == QpState::Rts
            && !qp.ud
            && !qp.raw
            && !qp.uc
            && qp.xrc.is_none()
            && qp.req.outstanding.is_empty()
            && qp.req.hw_waiting.is_empty()
            && now >= qp.req.rnr_until
            && !qp.cntrs.any()
            && self.dma_pending == 0
    }

    /// Runs the WQEs of `qp` from its fetch index functionally, as long as the peer takes
    /// them. Returns true when it stopped at a WQE it started on the packet path (the last
    /// outstanding entry, whose first packet the caller sends).
    pub(crate) fn fm_run(&mut self, env: &mut dyn Env, qp: &mut Qp) -> bool {
        while qp.fetch != qp.sq.pi {
            let index = qp.fetch;
            let in_nic = qp.req.bf.as_ref().is_some_and(|(i, _)| *i == index);
            // Decoded into the NIC's scratch WQE, whose buffers are reused (boxed, so that
            // taking it out and putting it back moves a pointer).
            let mut wqe = self.fm_wqe.take().unwrap_or_default();
            match self.read_send_wqe(env, qp, index, &mut wqe) {
                Ok(true) => {}
                Ok(false) => {
                    self.fm_wqe = Some(wqe);
                    return false;
                }
                Err((e, nbb)) => {
                    self.fm_wqe = Some(wqe);
                    self.fail_wqe(env, qp, index, nbb, e);
                    return false;
                }
            }
            if self.fm_exec(env, qp, index, &wqe) {
                self.fm_wqe = Some(wqe);
                continue;
            }
            return self.start_decoded(env, qp, index, in_nic, *wqe);
        }
        false
    }

    /// Executes WQE `index` (decoded as `w`) functionally if it is eligible and the peer
    /// takes it; false (nothing changed) otherwise.
    fn fm_exec(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        index: u32,
        w: &crate::qp::SendWqe,
    ) -> bool {
        let op = match w.op {
            SendOpcode::Write => FmOp::Write,
            SendOpcode::WriteImm => FmOp::WriteImm,
            SendOpcode::Send => FmOp::Send,
            SendOpcode::SendImm => FmOp::SendImm,
            SendOpcode::Read => FmOp::Read,
            SendOpcode::CmpSwap => FmOp::CmpSwap,
            SendOpcode::FetchAdd => FmOp::FetchAdd,
            // Memory-window work, invalidating SENDs and ATOMIC WRITEs take the packet path.
            SendOpcode::BindMw
            | SendOpcode::LocalInv
            | SendOpcode::SendInv
            | SendOpcode::AtomicWrite => return false,
        };
        // READ data and an atomic's result are written into the local list.
        let (local, need) = match op {
            FmOp::Read => (Access::LOCAL_WRITE, w.len),
            FmOp::CmpSwap | FmOp::FetchAdd => (Access::LOCAL_WRITE, 8),
            _ => (Access::empty(), 0),
        };
        // The local checks of the packet path, without their side effects: a WQE that would
        // fail them goes to the packet path, which reports the failure. The ranges are kept
        // on the stack: a WQE has at most MAX_SEND_SGE of them (any more: the packet path).
        let mut buf = [(0u64, 0u32); MAX_SEND_SGE];
        let (mut n, mut total) = (0usize, 0u64);
        let mut ok = true;
        for s in &w.sges {
            if s.len == 0 {
                ok &= self.check_key(qp.pdn, s.lkey, s.addr, 0, local).is_ok();
                continue;
            }
            match self.check_key(qp.pdn, s.lkey, s.addr, s.len as u64, local) {
                Ok(iova) if env.dma_check(iova, s.len as usize).is_ok() => match buf.get_mut(n) {
                    Some(r) => {
                        *r = (iova, s.len);
                        n += 1;
                        total += u64::from(s.len);
                    }
                    None => ok = false,
                },
                _ => ok = false,
            }
        }
        let ranges = &buf[..n];
        // The results must fit the local list (else the packet path's length error).
        ok &= total >= need;
        let mtu = qp.mtu();
        let npsn = match op {
            FmOp::CmpSwap | FmOp::FetchAdd => 1,
            _ => (w.len as u32).div_ceil(mtu).max(1),
        };
        let taken = if !ok {
            None
        } else {
            let msg = FmMsg {
                dst_mac: qp.attr.dest_mac,
                dst_ip: qp.attr.dest_ip,
                src_ip: self.cfg.ip,
                dst_qpn: qp.attr.dest_qpn.get(),
                op,
                psn: qp.req.next_psn,
                npsn,
                mtu,
                raddr: w.raddr,
                rkey: w.rkey,
                imm: w.imm,
                solicited: w.flags.contains(WqeFlags::SOLICITED),
                len: w.len,
                data: if w.sges.is_empty() {
                    FmData::Inline(&w.inline)
                } else {
                    FmData::Gather(ranges)
                },
                atomic: w.atomic,
            };
            env.fm_deliver(&msg)
        };
        let Some(orig) = taken else {
            return false;
        };
        // An atomic's original value lands in the local list, as its ACK would put it.
        if matches!(op, FmOp::CmpSwap | FmOp::FetchAdd) {
            let bytes = orig.to_le_bytes();
            let mut off = 0usize;
            for &(iova, n) in ranges {
                let n = (n as usize).min(bytes.len() - off);
                if n == 0 {
                    break;
                }
                if let Err(f) = env.dma_write(iova, &bytes[off..off + n]) {
                    // Checked above; only a mapping gone within this event gets here.
                    self.iommu_fault(env, qp.qpn, f.iova);
                    break;
                }
                off += n;
            }
        }
        // As when the message's last ACK arrives: PSNs used, progress made, completed.
        let now = env.now();
        qp.req.next_psn = qp.req.next_psn.add(npsn);
        qp.fetch = index.wrapping_add(w.nbb);
        qp.req.since_ack_req = 0;
        qp.req.retries_used = 0;
        qp.req.retrying = false;
        qp.req.rewound_to = None;
        qp.req.rnr_used = 0;
        qp.req.timer_deadline = None;
        if w.flags.contains(WqeFlags::SIGNALED) {
            let cqe = Self::send_cqe(qp.qpn, index, w, CqeStatus::Success, VendorSyndrome::None);
            self.complete(env, qp.gen, qp.send_cqn, now, cqe);
        }
        // (An eligible QP has no counter bound; the check keeps this path whole.)
        if qp.cntrs.any() {
            let c = qp.cntrs;
            self.qp_count(env, &c, crate::counter::send_event(w.op), true, now);
        }
        true
    }

    /// Functional mode, on the responder: executes the whole message `msg` if the packet path
    /// would accept every packet of it and complete it successfully; otherwise returns false
    /// with nothing changed (the requester then sends it as packets). See the module notes.
    pub fn fm_receive(&mut self, env: &mut dyn Env, msg: &FmMsg<'_>) -> Option<u64> {
        if msg.dst_ip != self.cfg.ip || self.dma_pending != 0 {
            return None;
        }
        let mut qp = self.qps.remove(msg.dst_qpn)?;
        let done = self.fm_accept(env, &mut qp, msg);
        self.qps.restore(msg.dst_qpn, qp);
        done
    }

    fn fm_accept(&mut self, env: &mut dyn Env, qp: &mut Qp, msg: &FmMsg<'_>) -> Option<u64> {
        let is_write = matches!(msg.op, FmOp::Write | FmOp::WriteImm);
        let is_atomic = matches!(msg.op, FmOp::CmpSwap | FmOp::FetchAdd);
        let rd_atomic = is_atomic || msg.op == FmOp::Read;
        let needs_recv = matches!(msg.op, FmOp::Send | FmOp::SendImm | FmOp::WriteImm);
        // A receive WQE from the QP's own RQ or from a plain SRQ (a TM-SRQ matches tags:
        // packets).
        let srq_ok =
            qp.srqn == 0 || !needs_recv || self.srqs.get(qp.srqn).is_some_and(|s| s.tm.is_none());
        let idle = matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            && !qp.ud
            && !qp.raw
            && !qp.uc
            && qp.xrc.is_none()
            && msg.src_ip == qp.attr.dest_ip
            && !qp.resp.dead
            && qp.resp.queue.is_empty()
            && qp.resp.recv.is_none()
            && qp.resp.write.is_none()
            && qp.resp.epsn == msg.psn
            && srq_ok
            && !qp.cntrs.any()
            && msg.len <= self.cfg.max_msg_size as u64
            && (!rd_atomic || qp.attr.max_dest_rd_atomic != 0);
        // Every packet the requester would cut must pass this side's size checks (a READ
        // request is one packet; its responses are cut at this side's MTU).
        let mtu = qp.mtu();
        let sizes_ok = if rd_atomic || msg.npsn == 1 {
            rd_atomic || msg.len <= mtu as u64
        } else {
            msg.mtu == mtu
        };
        if !idle || !sizes_ok {
            return None;
        }
        if msg.op == FmOp::Read && msg.len.div_ceil(mtu as u64).max(1) != msg.npsn as u64 {
            return None;
        }
        if rd_atomic {
            return self.fm_read_atomic(env, qp, msg);
        }
        let now = env.now();
        let has_imm = matches!(msg.op, FmOp::WriteImm | FmOp::SendImm);
        // WRITE with immediate and SEND need a receive WQE (none: the packet path's RNR).
        let recv = if needs_recv {
            let wq = if qp.srqn == 0 {
                &qp.rq
            } else {
                match self.srqs.get(qp.srqn) {
                    Some(srq) => &srq.wq,
                    None => return None,
                }
            };
            if wq.ci == wq.pi {
                return None;
            }
            let (wq, ci) = (wq.clone(), wq.ci);
            match self.read_recv_wqe(env, &wq, ci) {
                Ok(sges) => Some((ci, sges)),
                Err(_) => return None,
            }
        } else {
            None
        };
        // Where the payload goes: a WRITE's one range, or the receive WQE's scatter list (in
        // the NIC's reused vector).
        let mut one = None;
        let mut dst = Vec::new();
        if is_write {
            if !qp.access().contains(Access::REMOTE_WRITE) {
                return None;
            }
            let Ok(iova) = self.check_rkey(
                qp.pdn,
                qp.qpn,
                msg.rkey,
                msg.raddr,
                msg.len,
                Access::REMOTE_WRITE,
            ) else {
                return None;
            };
            if msg.len > 0 {
                if env.dma_check(iova, msg.len as usize).is_err() {
                    return None;
                }
                one = Some((iova, msg.len as u32));
            }
        } else {
            dst = std::mem::take(&mut self.fm_dst);
            dst.clear();
            // The scatter list of the receive WQE, over the message's bytes.
            let mut left = msg.len;
            for s in recv.as_ref().map(|r| &r.1[..]).unwrap_or_default() {
                if left == 0 {
                    break;
                }
                let n = (s.len as u64).min(left);
                let Ok(iova) = self.check_key(qp.pdn, s.lkey, s.addr, n, Access::LOCAL_WRITE)
                else {
                    return self.fm_refuse(dst);
                };
                if n > 0 {
                    if env.dma_check(iova, n as usize).is_err() {
                        return self.fm_refuse(dst);
                    }
                    dst.push((iova, n as u32));
                }
                left -= n;
            }
            if left > 0 {
                return self.fm_refuse(dst);
            }
        }
        // Accepted: the payload in one copy, then the state the packets would leave.
        let ranges = match &one {
            Some(r) => std::slice::from_ref(r),
            None => &dst[..],
        };
        if let Err(f) = fm_copy(env, msg.data, ranges) {
            // Checked above on both sides; only a mapping gone within this event gets here.
            self.iommu_fault(env, qp.qpn, f.iova);
        }
        if !is_write {
            self.fm_dst = dst;
        }
        qp.resp.epsn = qp.resp.epsn.add(msg.npsn);
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        qp.resp.nak_sent = false;
        let mut flags = 0;
        if has_imm {
            flags |= CQE_FLAG_IMM;
        }
        if msg.solicited {
            flags |= CQE_FLAG_SOLICITED;
        }
        if is_write {
            // (An idle QP has no counter bound; the check keeps this path whole.)
            if qp.cntrs.any() {
                let c = qp.cntrs;
                self.qp_count(env, &c, CntrEvents::REMOTE_WRITE, true, now);
            }
            self.mr_count(env, msg.rkey, CntrEvents::REMOTE_WRITE, now);
        }
        if let Some((index, sges)) = recv {
            let rc = RecvCtx {
                wqe_index: index,
                srqn: qp.srqn,
                sges,
                offset: 0,
                strip: 0,
                tm: None,
            };
            if qp.srqn == 0 {
                qp.rq.ci = qp.rq.ci.wrapping_add(1);
            } else {
                self.srq_consumed(env, qp.srqn);
            }
            if is_write {
                let mut cqe = recv_cqe(qp.qpn, &rc, CqeStatus::Success, msg.len as u32);
                cqe.opcode = CqeOpcode::RecvRdmaWithImm as u8;
                cqe.flags |= flags;
                cqe.imm = msg.imm.into();
                self.complete(env, qp.gen, qp.recv_cqn, now, cqe);
            } else {
                let imm = if has_imm { msg.imm } else { 0 };
                self.finish_recv(
                    env,
                    qp,
                    rc,
                    (CqeStatus::Success, VendorSyndrome::None),
                    msg.len as u32,
                    flags.into(),
                    imm,
                    now,
                );
            }
        }
        Some(0)
    }

    /// A READ or an atomic, under the packet path's checks: the READ's bytes copied into the
    /// requester's ranges, the atomic executed on this side's memory (its original value
    /// returned for the requester's list), the responder's resources and counters as the
    /// request packet would leave them.
    fn fm_read_atomic(&mut self, env: &mut dyn Env, qp: &mut Qp, msg: &FmMsg<'_>) -> Option<u64> {
        let now = env.now();
        let first = msg.psn;
        if msg.op == FmOp::Read {
            let FmData::Gather(to) = msg.data else {
                return None;
            };
            if !qp.access().contains(Access::REMOTE_READ) {
                return None;
            }
            let iova = self
                .check_rkey(
                    qp.pdn,
                    qp.qpn,
                    msg.rkey,
                    msg.raddr,
                    msg.len,
                    Access::REMOTE_READ,
                )
                .ok()?;
            // Mapped for the device (writable is what the IOMMU port can check, and a
            // mapping it may write it may read): else the packet path reports the fault.
            if msg.len > 0 && env.dma_check(iova, msg.len as usize).is_err() {
                return None;
            }
            // The requester's ranges cover the length (checked there): one copy per range.
            let (mut src, mut left) = (iova, msg.len);
            for &(peer, n) in to {
                let n = u64::from(n).min(left);
                if n == 0 {
                    break;
                }
                if let Err(f) = env.dma_copy_to_peer(peer, src, n as usize) {
                    // Mapped on both sides (checked); only a mapping gone now gets here.
                    self.iommu_fault(env, qp.qpn, f.iova);
                    break;
                }
                src = src.wrapping_add(n);
                left -= n;
            }
            qp.resp.epsn = first.add(msg.npsn);
            qp.resp.msn = qp.resp.msn.wrapping_add(1);
            qp.resp.nak_sent = false;
            self.remember(
                qp,
                Resource::Read {
                    first,
                    last: first.add(msg.npsn - 1),
                    va: msg.raddr,
                    rkey: msg.rkey,
                    pdn: qp.pdn,
                    len: msg.len as u32,
                },
            );
            let c = qp.cntrs;
            self.qp_count(env, &c, CntrEvents::REMOTE_READ, true, now);
            self.mr_count(env, msg.rkey, CntrEvents::REMOTE_READ, now);
            return Some(0);
        }
        if !qp.access().contains(Access::REMOTE_ATOMIC) || !msg.raddr.is_multiple_of(8) {
            return None;
        }
        let iova = self
            .check_rkey(
                qp.pdn,
                qp.qpn,
                msg.rkey,
                msg.raddr,
                8,
                Access::REMOTE_ATOMIC,
            )
            .ok()?;
        let mut cur = [0u8; 8];
        env.dma_check(iova, 8).ok()?;
        env.dma_read(iova, &mut cur).ok()?;
        let orig = u64::from_le_bytes(cur);
        let (swap_add, compare) = msg.atomic;
        let cas = msg.op == FmOp::CmpSwap;
        let new = match (cas, orig == compare) {
            (true, true) => swap_add,
            (true, false) => orig,
            (false, _) => orig.wrapping_add(swap_add),
        };
        if let Err(f) = env.dma_write(iova, &new.to_le_bytes()) {
            self.iommu_fault(env, qp.qpn, f.iova);
        }
        qp.resp.epsn = first.add(1);
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        qp.resp.nak_sent = false;
        let op = if cas {
            Opcode::CompareSwap
        } else {
            Opcode::FetchAdd
        };
        self.remember(
            qp,
            Resource::Atomic {
                psn: first,
                orig: Some(orig),
                request: (op as u8, msg.raddr, msg.rkey, swap_add, compare),
            },
        );
        let c = qp.cntrs;
        self.qp_count(env, &c, CntrEvents::REMOTE_WRITE, true, now);
        self.mr_count(env, msg.rkey, CntrEvents::REMOTE_WRITE, now);
        Some(orig)
    }

    /// Refuses a message, giving the range buffer back for the next one.
    fn fm_refuse(&mut self, v: Vec<(u64, u32)>) -> Option<u64> {
        self.fm_dst = v;
        None
    }
}

/// Copies a functional message's payload into the responder's ranges `dst`.
fn fm_copy(env: &mut dyn Env, src: FmData<'_>, dst: &[(u64, u32)]) -> Result<(), crate::DmaFault> {
    match src {
        FmData::Inline(bytes) => {
            let mut off = 0usize;
            for &(iova, n) in dst {
                let n = n as usize;
                env.dma_write(iova, &bytes[off..off + n])?;
                off += n;
            }
        }
        FmData::Gather(ranges) => {
            let mut src = ranges.iter().copied();
            let (mut s_iova, mut s_left) = (0u64, 0u64);
            for &(mut d_iova, n) in dst {
                let mut d_left = n as u64;
                while d_left > 0 {
                    while s_left == 0 {
                        let Some((i, l)) = src.next() else {
                            return Err(crate::DmaFault { iova: d_iova });
                        };
                        (s_iova, s_left) = (i, l as u64);
                    }
                    let k = d_left.min(s_left);
                    env.dma_copy_from_peer(d_iova, s_iova, k as usize)?;
                    d_iova = d_iova.wrapping_add(k);
                    s_iova = s_iova.wrapping_add(k);
                    d_left -= k;
                    s_left -= k;
                }
            }
        }
    }
    Ok(())
}
