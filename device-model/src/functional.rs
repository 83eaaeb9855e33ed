//! Functional (untimed) mode: whole RC messages handed from a requester straight to its
//! peer's responder, with no frames, no ACKs and one copy of the payload.
//!
//! The environment opts in ([`Env::functional`]). The send engine of an eligible QP
//! ([`Nic::fm_eligible`]) then takes its WQEs one after the other in one event: each eligible
//! one (WRITE, WRITE with immediate, SEND, SEND with immediate; inline or gathered) goes to
//! [`Env::fm_deliver`], which runs [`Nic::fm_receive`] on the peer NIC. The responder checks
//! it exactly as the packet path would (sequence, keys, bounds, rights, IOMMU, receive WQE,
//! length) and executes it only if it would succeed there; anything else (an error to
//! report, an RNR, a message another message is in the middle of, an SRQ, counters) is
//! refused with nothing changed, and the requester sends that WQE on the packet path, where
//! nothing else is outstanding, so ordering holds and errors are reported by the same code.
//! PSNs and MSNs advance on both sides as the packets would have advanced them, so later
//! work on the packet path (READs, atomics) continues the same sequence.
//!
//! Simulated time does not advance for the message itself: data is placed at the instant of
//! the send engine's event, and completions are queued from that instant (their CQE write
//! still costs the profile's PCIe and ordering delays, as on the packet path).

use crate::env::{Env, FmData, FmMsg, FmOp};
use crate::nic::Nic;
use crate::qp::{Qp, RecvCtx};
use crate::responder::recv_cqe;
use ringbell_specs::cmd::{Access, CntrEvents, QpState};
use ringbell_specs::cqe::{CqeOpcode, CqeStatus, VendorSyndrome, CQE_FLAG_IMM, CQE_FLAG_SOLICITED};
use ringbell_specs::wqe::{SendOpcode, WqeFlags};
use ringbell_specs::SimTime;

impl Nic {
    /// Whether the send engine of `qp` may run WQEs functionally now: RTS, nothing
    /// outstanding or waiting on the send side (so no packet of it is in flight and nothing
    /// completes out of order), no RNR wait, no counter bound to the QP, and no posted DMA
    /// write of this NIC still to land. UD QPs always take the packet path.
    pub(crate) fn fm_eligible(&self, qp: &Qp, now: SimTime) -> bool {
        qp.state == QpState::Rts
            && !qp.ud
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
            // Decoded into the NIC's scratch WQE, whose buffers are reused.
            let mut wqe = std::mem::take(&mut self.fm_wqe);
            match self.read_send_wqe(env, qp, index, &mut wqe) {
                Ok(true) => {}
                Ok(false) => {
                    self.fm_wqe = wqe;
                    return false;
                }
                Err((e, nbb)) => {
                    self.fm_wqe = wqe;
                    self.fail_wqe(env, qp, index, nbb, e);
                    return false;
                }
            }
            if self.fm_exec(env, qp, index, &wqe) {
                self.fm_wqe = wqe;
                continue;
            }
            return self.start_decoded(env, qp, index, in_nic, wqe);
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
            _ => return false,
        };
        // The local checks of the packet path, without their side effects: a WQE that would
        // fail them goes to the packet path, which reports the failure.
        let mut ranges = std::mem::take(&mut self.fm_ranges);
        ranges.clear();
        let mut ok = true;
        for s in &w.sges {
            if s.len == 0 {
                ok &= self
                    .check_key(qp.pdn, s.lkey, s.addr, 0, Access::empty())
                    .is_ok();
                continue;
            }
            match self.check_key(qp.pdn, s.lkey, s.addr, s.len as u64, Access::empty()) {
                Ok(iova) if env.dma_check(iova, s.len as usize).is_ok() => {
                    ranges.push((iova, s.len))
                }
                _ => ok = false,
            }
        }
        let npsn = (w.len as u32).div_ceil(qp.mtu()).max(1);
        let taken = ok && {
            let msg = FmMsg {
                dst_mac: qp.attr.dest_mac,
                dst_ip: qp.attr.dest_ip,
                src_ip: self.cfg.ip,
                dst_qpn: qp.attr.dest_qpn.get(),
                op,
                psn: qp.req.next_psn,
                npsn,
                mtu: qp.mtu(),
                raddr: w.raddr,
                rkey: w.rkey,
                imm: w.imm,
                solicited: w.flags.contains(WqeFlags::SOLICITED),
                len: w.len,
                data: if w.sges.is_empty() {
                    FmData::Inline(&w.inline)
                } else {
                    FmData::Gather(&ranges)
                },
            };
            env.fm_deliver(&msg)
        };
        self.fm_ranges = ranges;
        if !taken {
            return false;
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
        let c = qp.cntrs;
        self.qp_count(env, &c, crate::counter::send_event(w.op), true, now);
        true
    }

    /// Functional mode, on the responder: executes the whole message `msg` if the packet path
    /// would accept every packet of it and complete it successfully; otherwise returns false
    /// with nothing changed (the requester then sends it as packets). See the module notes.
    pub fn fm_receive(&mut self, env: &mut dyn Env, msg: &FmMsg<'_>) -> bool {
        if msg.dst_ip != self.cfg.ip || self.dma_pending != 0 {
            return false;
        }
        let Some(mut qp) = self.qps.remove(msg.dst_qpn) else {
            return false;
        };
        let done = self.fm_accept(env, &mut qp, msg);
        self.qps.restore(msg.dst_qpn, qp);
        done
    }

    fn fm_accept(&mut self, env: &mut dyn Env, qp: &mut Qp, msg: &FmMsg<'_>) -> bool {
        let idle = matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            && !qp.ud
            && msg.src_ip == qp.attr.dest_ip
            && !qp.resp.dead
            && qp.resp.queue.is_empty()
            && qp.resp.recv.is_none()
            && qp.resp.write.is_none()
            && qp.resp.epsn == msg.psn
            // A receive WQE comes from the QP's own RQ (SRQs and tag matching: packets).
            && (qp.srqn == 0 || msg.op == FmOp::Write)
            && !qp.cntrs.any()
            && msg.len <= self.cfg.max_msg_size as u64;
        // Every packet the requester would cut must pass this side's size checks.
        let mtu = qp.mtu();
        let sizes_ok = if msg.npsn == 1 {
            msg.len <= mtu as u64
        } else {
            msg.mtu == mtu
        };
        if !idle || !sizes_ok {
            return false;
        }
        let now = env.now();
        let mut dst = std::mem::take(&mut self.fm_dst);
        dst.clear();
        let is_write = matches!(msg.op, FmOp::Write | FmOp::WriteImm);
        let has_imm = matches!(msg.op, FmOp::WriteImm | FmOp::SendImm);
        // WRITE with immediate and SEND need a receive WQE (none: the packet path's RNR).
        let recv = if msg.op == FmOp::Write {
            None
        } else {
            if qp.rq.ci == qp.rq.pi {
                return self.fm_refuse(dst);
            }
            match self.read_recv_wqe(env, &qp.rq, qp.rq.ci) {
                Ok(sges) => Some(sges),
                Err(_) => return self.fm_refuse(dst),
            }
        };
        if is_write {
            if !qp.access().contains(Access::REMOTE_WRITE) {
                return self.fm_refuse(dst);
            }
            let Ok(iova) =
                self.check_key(qp.pdn, msg.rkey, msg.raddr, msg.len, Access::REMOTE_WRITE)
            else {
                return self.fm_refuse(dst);
            };
            if msg.len > 0 {
                if env.dma_check(iova, msg.len as usize).is_err() {
                    return self.fm_refuse(dst);
                }
                dst.push((iova, msg.len as u32));
            }
        } else {
            // The scatter list of the receive WQE, over the message's bytes.
            let mut left = msg.len;
            for s in recv.as_deref().unwrap_or_default() {
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
        if let Err(f) = fm_copy(env, msg.data, &dst) {
            // Checked above on both sides; only a mapping gone within this event gets here.
            self.iommu_fault(env, qp.qpn, f.iova);
        }
        self.fm_dst = dst;
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
            let c = qp.cntrs;
            self.qp_count(env, &c, CntrEvents::REMOTE_WRITE, true, now);
            self.mr_count(env, msg.rkey, CntrEvents::REMOTE_WRITE, now);
        }
        if let Some(sges) = recv {
            let rc = RecvCtx {
                wqe_index: qp.rq.ci,
                srqn: 0,
                sges,
                offset: 0,
                strip: 0,
                tm: None,
            };
            qp.rq.ci = qp.rq.ci.wrapping_add(1);
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
                    flags,
                    imm,
                    now,
                );
            }
        }
        true
    }

    /// Refuses a message, giving the range buffer back for the next one.
    fn fm_refuse(&mut self, v: Vec<(u64, u32)>) -> bool {
        self.fm_dst = v;
        false
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
