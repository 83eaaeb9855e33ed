//! The requester: fetches send WQEs, validates them, segments messages at the path MTU into
//! RoCEv2 packets (lazily, a few frames ahead of the wire), and completes WQEs in order as
//! ACKs and responses arrive. Reliability: the local ACK timer with `retry_cnt`, go-back-N
//! after a sequence NAK or a timeout (READs resume where their responses stopped), implied
//! ACKs, RNR waits with `rnr_retry`, and the `max_rd_atomic`, fence and PSN-window limits.

use crate::env::{trace, Env, NicEvent, Stage, TraceEvent};
use crate::mem::KeyError;
use crate::nic::Nic;
use crate::qp::{HwTask, Outstanding, Qp, SendWqe, Sge, UdDest};
use ringbell_specs::cmd::{Access, QpState};
use ringbell_specs::cqe::{CqeStatus, DoorbellError, VendorSyndrome};
use ringbell_specs::wire::{self, AethSyndrome, AtomicEth, NakCode, Opcode, Packet, Reth};
use ringbell_specs::wqe::{
    self, AtomicSeg, BindSeg, CtrlSeg, DataSeg, RaddrSeg, SendOpcode, UdAddrSeg, WqeFlags,
    INLINE_MARK, MAX_DS, SEG, WQEBB,
};
use ringbell_specs::{Psn, SimTime};
use zerocopy::FromBytes;

/// Why a WQE could not be started.
type WqeError = (CqeStatus, VendorSyndrome);

/// How far ahead of the wire the send engine builds frames.
const HORIZON: SimTime = SimTime(2_000_000);
/// A packet asks for an ACK at least this often (and always at the end of a message).
const ACK_REQ_EVERY: u32 = 16;
/// Most PSNs a QP has unacknowledged: far enough below 2^23 that PSN comparisons stay exact.
pub(crate) const MAX_UNACKED_PSNS: u32 = 1 << 22;
/// Sets the length of a reused scratch buffer to `len` without zeroing bytes that the
/// caller is about to overwrite (only bytes beyond its old length are new, and zero).
pub(crate) fn scratch_len(v: &mut Vec<u8>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    } else {
        v.truncate(len);
    }
}

/// Decoded WQEs kept for reuse by the send engine (see `Nic::wqe_pool`).
const WQE_POOL_MAX: usize = 256;

/// The local ACK timeout for attribute `timeout`: 4.096 µs × 2^timeout; 0 is infinite.
pub(crate) fn ack_timeout(timeout: u8) -> Option<SimTime> {
    (timeout != 0).then(|| SimTime(4_096_000u64 << timeout.min(31)))
}

impl Nic {
    /// The send engine: sends at most one packet (continuing or resending a started message,
    /// else starting the next WQE), then reschedules itself.
    pub(crate) fn sq_process(&mut self, env: &mut dyn Env, qpn: u32) {
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        qp.req.scheduled = false;
        let again = self.send_engine(env, &mut qp);
        self.qps.restore(qpn, qp);
        if let Some(at) = again {
            self.kick_sq(env, qpn, at);
        }
    }

    /// One step of the send engine; returns when to run again, if there is more to do now.
    fn send_engine(&mut self, env: &mut dyn Env, qp: &mut Qp) -> Option<SimTime> {
        let now = env.now();
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) {
            return None;
        }
        if now < qp.req.rnr_until {
            return Some(qp.req.rnr_until);
        }
        // Waiting tasks of the NIC's own may start now (credits freed while the QP was in
        // SQD, or a larger max_rd_atomic).
        if qp.state == QpState::Rts && !qp.req.hw_waiting.is_empty() {
            self.start_waiting_hw(env, qp, now);
        }
        let next =
            |nic: &Nic, qp: &Qp| Some(now.max(qp.req.busy_until).max(nic.egress_free - HORIZON));
        // A failed WQE completes once everything before it has; until then the WQEs before it
        // still go out (and again, on a retry), and nothing after it does.
        let failed = qp.req.first_failed();
        let before = failed.unwrap_or(qp.req.outstanding.len());
        if let Some(i) = qp.req.first_unsent(before) {
            self.send_packet(env, qp, i);
            return next(self, qp);
        }
        // New work starts only in RTS (SQD finishes what it started).
        if failed.is_some() || qp.state != QpState::Rts || qp.fetch == qp.sq.pi {
            return None;
        }
        if env.functional() && self.fm_eligible(qp, now) {
            // Whole messages straight to the peer, until one needs the packet path.
            if self.fm_run(env, qp) {
                let i = qp.req.outstanding.len() - 1;
                self.send_packet(env, qp, i);
                return next(self, qp);
            }
            return None;
        }
        if self.start_wqe(env, qp) {
            let i = qp.req.outstanding.len() - 1;
            self.send_packet(env, qp, i);
            return next(self, qp);
        }
        None
    }

    /// Starts the WQE at the fetch index: validates it and queues it as outstanding. Returns
    /// false when nothing was started (stale WQE, a limit reached, or the WQE failed).
    fn start_wqe(&mut self, env: &mut dyn Env, qp: &mut Qp) -> bool {
        // The NIC's own waiting work (triggered transfers, rendezvous READs) was queued
        // before this WQE is started: it goes first.
        if !qp.req.hw_waiting.is_empty() {
            return false;
        }
        let index = qp.fetch;
        // A WQE written through the BlueFlame slot is in the NIC already.
        let in_nic = qp.req.bf.as_ref().is_some_and(|(i, _)| *i == index);
        let mut wqe = self.wqe_pool.pop().unwrap_or_default();
        match self.read_send_wqe(env, qp, index, &mut wqe) {
            Ok(true) => {}
            Ok(false) => {
                self.wqe_pool.push(wqe);
                return false;
            }
            Err((e, nbb)) => {
                self.wqe_pool.push(wqe);
                self.fail_wqe(env, qp, index, nbb, e);
                return false;
            }
        }
        self.start_decoded(env, qp, index, in_nic, wqe)
    }

    /// Starts WQE `index`, already read and decoded as `wqe` (`in_nic`: it came through
    /// BlueFlame). Returns false when nothing was started (a limit reached, or it failed).
    pub(crate) fn start_decoded(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        index: u32,
        in_nic: bool,
        wqe: SendWqe,
    ) -> bool {
        let now = env.now();
        let rd_atomic = wqe.is_rd_atomic();
        // Resumed when the outstanding READs/atomics complete.
        if wqe.flags.contains(WqeFlags::FENCE) && qp.req.rd_atomic > 0 {
            return false;
        }
        if wqe.op.is_local() {
            self.run_local(env, qp, index, wqe);
            return false;
        }
        if rd_atomic && qp.req.rd_atomic >= (qp.attr.max_rd_atomic as u32).max(1) {
            return false;
        }
        let mtu = qp.mtu();
        // A datagram is one packet: longer than the path MTU is a local length error.
        if (qp.ud && wqe.len > mtu as u64) || (qp.raw && !crate::raw::raw_len_ok(wqe.len)) {
            self.fail_wqe(
                env,
                qp,
                index,
                wqe.nbb,
                (CqeStatus::LocLenErr, VendorSyndrome::TooLong),
            );
            return false;
        }
        let npsn = match wqe.op {
            _ if qp.raw => 1,
            SendOpcode::CmpSwap | SendOpcode::FetchAdd => 1,
            _ => (wqe.len as u32).div_ceil(mtu).max(1),
        };
        // Keep the unacknowledged PSN span well inside the comparison window.
        if let Some(front) = qp.req.outstanding.front() {
            let span = qp
                .req
                .next_psn
                .add(npsn)
                .diff(front.first_psn.add(front.acked));
            if span < 0 || span as u32 > MAX_UNACKED_PSNS {
                return false;
            }
        }
        if let Err(e) = self.check_local(env, qp, &wqe) {
            self.fail_wqe(env, qp, index, wqe.nbb, e);
            return false;
        }
        let t = &self.cfg.timing;
        let fetched = if in_nic {
            now
        } else {
            now + SimTime(t.dma_read_rtt_ps)
        };
        let gathers = !wqe.sges.is_empty() && !rd_atomic;
        let data_at = if gathers {
            fetched + SimTime(t.dma_read_rtt_ps)
        } else {
            fetched
        };
        let first_psn = qp.req.next_psn;
        qp.req.next_psn = first_psn.add(npsn);
        let (op, len) = (wqe.op as u8, wqe.len as usize);
        if rd_atomic {
            qp.req.rd_atomic += 1;
        }
        qp.fetch = index.wrapping_add(wqe.nbb);
        qp.req.busy_until = now + SimTime(t.nic_per_qp_wqe_ps);
        qp.req.push(Outstanding {
            wqe_index: index,
            wqe,
            first_psn,
            npsn,
            sent: 0,
            sent_max: 0,
            acked: 0,
            ready_at: SimTime(0),
            error: None,
            done: false,
            hw: None,
        });
        let tx = SimTime(self.cfg.timing.nic_tx_wqe_ps);
        let issue = self.reserve_msg(data_at);
        if let Some(o) = qp.req.outstanding.back_mut() {
            o.ready_at = issue + tx;
        }
        if env.tracing() {
            let ev = |s, a, b| {
                TraceEvent::new(s, a, b)
                    .qpn(qp.qpn)
                    .psn(index)
                    .op(op)
                    .bytes(len)
            };
            env.trace(match in_nic {
                true => ev(Stage::BlueFlameWqe, now, now),
                false => ev(Stage::WqeFetch, now, fetched),
            });
            if gathers {
                env.trace(ev(Stage::PayloadFetch, fetched, data_at));
            }
            if issue > data_at {
                env.trace(ev(Stage::MsgRateWait, data_at, issue));
            }
            env.trace(ev(Stage::TxBuild, issue, issue + tx));
        }
        true
    }

    /// Runs a BIND_MW or LOCAL_INV (ABI 1.9): the NIC does it at once, without a packet,
    /// and it completes in order behind the work before it. A failure is `MW_BIND_ERR`
    /// and moves the QP to ERR.
    fn run_local(&mut self, env: &mut dyn Env, qp: &mut Qp, index: u32, wqe: SendWqe) {
        let done = match wqe.op {
            SendOpcode::BindMw => self.bind_mw(qp.pdn, qp.qpn, &wqe.bind),
            _ => self.invalidate(qp.pdn, wqe.imm),
        };
        qp.fetch = index.wrapping_add(wqe.nbb);
        qp.req.busy_until = env.now() + SimTime(self.cfg.timing.nic_per_qp_wqe_ps);
        qp.req.push(Outstanding::without_packets(
            index,
            wqe,
            qp.req.next_psn,
            env.now(),
            done.err().map(|s| (CqeStatus::MwBindErr, s)),
            true,
        ));
        self.complete_in_order(env, qp);
        // The send engine goes on with the WQEs behind it.
        if qp.fetch != qp.sq.pi && qp.state == QpState::Rts {
            let now = env.now();
            self.kick_qp_sq(env, qp, now);
        }
    }

    /// The headers of a request of WQE `w` from `qp`: on an XRC initiator (ABI 1.11), with
    /// the XRCETH naming the target's SRQ.
    fn request_repr(
        &self,
        qp: &Qp,
        w: &SendWqe,
        opcode: Opcode,
        psn: Psn,
        ack_req: bool,
    ) -> wire::PacketRepr {
        let mut repr = self.packet_repr(qp, opcode, psn, ack_req);
        if repr.xrc.is_some() {
            repr.xrc = Some(w.xrc_srqn);
        }
        repr
    }

    /// Puts the next packet of outstanding WQE `i` on the wire.
    fn send_packet(&mut self, env: &mut dyn Env, qp: &mut Qp, i: usize) {
        if qp.raw {
            self.send_raw(env, qp, i);
            return;
        }
        if qp.ud {
            self.send_datagram(env, qp, i);
            return;
        }
        let now = env.now();
        let mtu = qp.mtu();
        let pdn = qp.pdn;
        let o = &qp.req.outstanding[i];
        let ready = o.ready_at.max(now);
        let (first_psn, npsn, k, acked) = (o.first_psn, o.npsn, o.sent, o.acked);
        let retransmit = k < o.sent_max;
        let w = &o.wqe;
        let mut next_ready = ready;
        let psn;
        match w.op {
            SendOpcode::Read => {
                // One request for everything not answered yet (all of it the first time).
                let done = acked as u64 * mtu as u64;
                psn = first_psn.add(acked);
                let mut repr = self.request_repr(qp, w, Opcode::ReadRequest, psn, true);
                repr.reth = Some(Reth {
                    va: w.raddr.wrapping_add(done),
                    rkey: w.rkey,
                    len: (w.len.saturating_sub(done)) as u32,
                });
                self.emit(env, qp.qpn, &repr, &[], ready);
                qp.req.since_ack_req = 0;
                let o = &mut qp.req.outstanding[i];
                o.sent = npsn;
            }
            SendOpcode::CmpSwap | SendOpcode::FetchAdd => {
                psn = first_psn;
                let opcode = if w.op == SendOpcode::CmpSwap {
                    Opcode::CompareSwap
                } else {
                    Opcode::FetchAdd
                };
                let mut repr = self.request_repr(qp, w, opcode, psn, true);
                repr.atomic_eth = Some(AtomicEth {
                    va: w.raddr,
                    rkey: w.rkey,
                    swap_add: w.atomic.0,
                    compare: w.atomic.1,
                });
                self.emit(env, qp.qpn, &repr, &[], ready);
                qp.req.since_ack_req = 0;
                qp.req.outstanding[i].sent = 1;
            }
            _ => {
                psn = first_psn.add(k);
                let off = k as u64 * mtu as u64;
                let len = (w.len.saturating_sub(off)).min(mtu as u64) as usize;
                let mut payload = std::mem::take(&mut self.scratch);
                scratch_len(&mut payload, len);
                let gathered = if w.sges.is_empty() {
                    let end = (off as usize + len).min(w.inline.len());
                    payload[..end - off as usize].copy_from_slice(&w.inline[off as usize..end]);
                    payload[end - off as usize..].fill(0);
                    Ok(())
                } else {
                    let start = ready.max(self.pcie_read_free);
                    next_ready = self.reserve_pcie_read(ready, len);
                    trace(env, || {
                        TraceEvent::new(Stage::PayloadRead, start, next_ready)
                            .qpn(qp.qpn)
                            .psn(psn.get())
                            .bytes(len)
                    });
                    let sges = &qp.req.outstanding[i].wqe.sges;
                    self.gather(env, qp.qpn, pdn, sges, off, &mut payload)
                };
                if let Err(e) = gathered {
                    self.scratch = payload;
                    qp.req.fail(i, e);
                    self.complete_in_order(env, qp);
                    return;
                }
                let w = &qp.req.outstanding[i].wqe;
                let is_send = w.op.is_send();
                let (first, last) = (k == 0, k + 1 == npsn);
                let opcode = match (is_send, first, last, w.op.has_imm()) {
                    _ if w.op == SendOpcode::AtomicWrite => Opcode::AtomicWrite,
                    (true, true, true, _) if w.op == SendOpcode::SendInv => Opcode::SendOnlyInv,
                    (true, false, true, _) if w.op == SendOpcode::SendInv => Opcode::SendLastInv,
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
                // UC: the same operation with transport bits 001, and no ACK ever asked.
                let (opcode, ack_req) = if qp.uc {
                    (opcode.to_uc().unwrap_or(opcode), false)
                } else {
                    qp.req.since_ack_req += 1;
                    let ack_req = last || qp.req.since_ack_req >= ACK_REQ_EVERY;
                    if ack_req {
                        qp.req.since_ack_req = 0;
                    }
                    (opcode, ack_req)
                };
                let w = &qp.req.outstanding[i].wqe;
                let mut repr = self.request_repr(qp, w, opcode, psn, ack_req);
                repr.bth.solicited = last && w.flags.contains(WqeFlags::SOLICITED);
                if opcode.has_reth() {
                    repr.reth = Some(Reth {
                        va: w.raddr,
                        rkey: w.rkey,
                        len: w.len as u32,
                    });
                }
                if opcode.has_immdt() || opcode.has_ieth() {
                    repr.imm = Some(w.imm);
                }
                // The packet leaves once its payload has crossed PCIe (the reads of later
                // packets overlap its transmission on the shared read path).
                self.emit(env, qp.qpn, &repr, &payload, next_ready);
                self.scratch = payload;
                qp.req.outstanding[i].sent = k + 1;
            }
        }
        let _ = psn;
        let o = &mut qp.req.outstanding[i];
        o.ready_at = next_ready;
        o.sent_max = o.sent_max.max(o.sent);
        qp.stats.packets_sent += 1;
        if retransmit {
            qp.stats.retransmitted += 1;
        }
        if qp.uc {
            // Unacknowledged: a message is done once its last packet has left.
            if o.sent == o.npsn {
                o.done = true;
                let left = self.egress_free;
                self.complete_in_order_at(env, qp, left);
            }
            return;
        }
        self.arm_ack_timer(env, qp);
    }

    /// Sends outstanding WQE `i` of a UD QP as one datagram (BTH, DETH, ImmDt) and completes
    /// it once the frame has left: UD is unacknowledged, so nothing waits for the peer.
    fn send_datagram(&mut self, env: &mut dyn Env, qp: &mut Qp, i: usize) {
        let now = env.now();
        let o = &qp.req.outstanding[i];
        let ready = o.ready_at.max(now);
        let psn = o.first_psn;
        let w = &o.wqe;
        // A WQE decoded without an address (a triggered operation aimed at a UD QP).
        let Some(dest) = w.ud else {
            qp.req
                .fail(i, (CqeStatus::LocQpOpErr, VendorSyndrome::BadSegment));
            self.complete_in_order(env, qp);
            return;
        };
        let len = w.len as usize;
        let mut payload = std::mem::take(&mut self.scratch);
        scratch_len(&mut payload, len);
        let mut next_ready = ready;
        let gathered = if w.sges.is_empty() {
            let n = len.min(w.inline.len());
            payload[..n].copy_from_slice(&w.inline[..n]);
            payload[n..].fill(0);
            Ok(())
        } else {
            let start = ready.max(self.pcie_read_free);
            next_ready = self.reserve_pcie_read(ready, len);
            trace(env, || {
                TraceEvent::new(Stage::PayloadRead, start, next_ready)
                    .qpn(qp.qpn)
                    .psn(psn.get())
                    .bytes(len)
            });
            let sges = w.sges.clone();
            self.gather(env, qp.qpn, qp.pdn, &sges, 0, &mut payload)
        };
        if let Err(e) = gathered {
            self.scratch = payload;
            qp.req.fail(i, e);
            self.complete_in_order(env, qp);
            return;
        }
        let w = &qp.req.outstanding[i].wqe;
        let opcode = match w.op.has_imm() {
            true => Opcode::UdSendOnlyImm,
            false => Opcode::UdSendOnly,
        };
        let repr = self.datagram_repr(qp, &dest, opcode, psn, w);
        self.emit(env, qp.qpn, &repr, &payload, next_ready);
        self.scratch = payload;
        self.sent_unacknowledged(env, qp, i);
    }

    /// Outstanding WQE `i`'s one packet (a datagram, a raw frame) has been handed to the
    /// egress port: nothing will acknowledge it, so it is done, and it completes in order
    /// once the frame has left.
    pub(crate) fn sent_unacknowledged(&mut self, env: &mut dyn Env, qp: &mut Qp, i: usize) {
        let o = &mut qp.req.outstanding[i];
        (o.sent, o.sent_max, o.done) = (1, 1, true);
        qp.stats.packets_sent += 1;
        qp.ud_stats.sent += 1;
        let left = self.egress_free;
        self.complete_in_order_at(env, qp, left);
    }

    /// The headers of a datagram from UD QP `qp` to `dest`.
    fn datagram_repr(
        &self,
        qp: &Qp,
        dest: &UdDest,
        opcode: Opcode,
        psn: Psn,
        w: &SendWqe,
    ) -> wire::PacketRepr {
        let mut repr = self.packet_repr(qp, opcode, psn, false);
        let dest_qp = ringbell_specs::Qpn::from_bits(dest.qpn);
        repr.dst = wire::Endpoint {
            mac: dest.mac,
            ip: dest.ip,
        };
        repr.bth.dest_qp = dest_qp;
        repr.bth.solicited = w.flags.contains(WqeFlags::SOLICITED);
        repr.udp_src_port = wire::udp_src_port(ringbell_specs::Qpn::from_bits(qp.qpn), dest_qp);
        let qkey = match dest.qkey & ringbell_specs::cmd::QKEY_USE_QP {
            0 => dest.qkey,
            _ => qp.attr.qkey.get(),
        };
        repr.deth = Some(wire::Deth {
            qkey,
            src_qp: ringbell_specs::Qpn::from_bits(qp.qpn),
        });
        if opcode.has_immdt() {
            repr.imm = Some(w.imm);
        }
        repr
    }

    /// Reads and decodes WQE `index`. `Ok(None)`: the WQE is stale (doorbell error raised).
    pub(crate) fn read_send_wqe(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        index: u32,
        out: &mut SendWqe,
    ) -> Result<bool, (WqeError, u32)> {
        let mut raw = [0u8; MAX_DS * SEG];
        let first = qp.sq.slot_iova(index, WQEBB as u64);
        let bf = match qp.req.bf.take() {
            Some((i, wqe)) if i == index => Some(wqe),
            _ => None,
        };
        match &bf {
            Some(wqe) => raw[..wqe.len().min(WQEBB)].copy_from_slice(&wqe[..wqe.len().min(WQEBB)]),
            None => {
                if let Err(f) = env.dma_read(first, &mut raw[..WQEBB]) {
                    self.iommu_fault(env, qp.qpn, f.iova);
                    return Err(((CqeStatus::GeneralErr, VendorSyndrome::IommuFault), 1));
                }
            }
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
            return Ok(false);
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
            if let Some(wqe) = bf.as_ref().filter(|w| w.len() >= s + WQEBB) {
                raw[s..s + WQEBB].copy_from_slice(&wqe[s..s + WQEBB]);
                continue;
            }
            if let Err(f) = env.dma_read(at, &mut raw[s..s + WQEBB]) {
                self.iommu_fault(env, qp.qpn, f.iova);
                return Err(((CqeStatus::GeneralErr, VendorSyndrome::IommuFault), nbb));
            }
        }
        let Some(op) = SendOpcode::from_u8(ctrl.opcode) else {
            return Err(((CqeStatus::LocQpOpErr, VendorSyndrome::BadOpcode), nbb));
        };
        // UC has SEND and RDMA WRITE only (and binds and local invalidation, which need
        // no packet); SEND with invalidate and ATOMIC WRITE are RC's alone.
        if qp.uc
            && matches!(
                op,
                SendOpcode::Read
                    | SendOpcode::CmpSwap
                    | SendOpcode::FetchAdd
                    | SendOpcode::SendInv
                    | SendOpcode::AtomicWrite
            )
        {
            return Err(((CqeStatus::LocQpOpErr, VendorSyndrome::BadOpcode), nbb));
        }
        // A raw packet QP sends frames: SEND (no immediate, no invalidation) and the local
        // operations.
        if qp.raw
            && !matches!(
                op,
                SendOpcode::Send | SendOpcode::BindMw | SendOpcode::LocalInv
            )
        {
            return Err((crate::raw::RAW_BAD_OP, nbb));
        }
        decode_send_wqe_into(
            &ctrl,
            op,
            &raw[SEG..ds * SEG],
            nbb,
            self.cfg.max_msg_size,
            qp.ud,
            out,
        )
        .map(|_| true)
        .map_err(|e| (e, nbb))
    }

    /// Checks the local keys of a WQE and that its buffers are reachable through the IOMMU.
    pub(crate) fn check_local(
        &mut self,
        env: &mut dyn Env,
        qp: &Qp,
        w: &SendWqe,
    ) -> Result<(), WqeError> {
        let need = match w.op {
            SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd => Access::LOCAL_WRITE,
            _ => Access::empty(),
        };
        for s in &w.sges {
            let iova = self
                .check_key(qp.pdn, s.lkey, s.addr, s.len as u64, need)
                .map_err(|e: KeyError| (CqeStatus::LocProtErr, e.syndrome()))?;
            if s.len > 0 {
                if let Err(f) = self.dm.check(env, iova, s.len as usize) {
                    self.iommu_fault(env, qp.qpn, f.iova);
                    return Err((CqeStatus::GeneralErr, VendorSyndrome::IommuFault));
                }
            }
        }
        Ok(())
    }

    /// Copies `out.len()` message bytes starting at `offset` out of a gather list.
    /// A key that no longer checks out is a local protection error; an address the IOMMU
    /// does not map raises IOMMU_FAULT and fails the WQE with GENERAL_ERR.
    pub(crate) fn gather(
        &mut self,
        env: &mut dyn Env,
        qpn: u32,
        pdn: u32,
        sges: &[Sge],
        mut offset: u64,
        out: &mut [u8],
    ) -> Result<(), WqeError> {
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
                .check_key(
                    pdn,
                    s.lkey,
                    s.addr.wrapping_add(offset),
                    n as u64,
                    Access::empty(),
                )
                .map_err(|e| (CqeStatus::LocProtErr, e.syndrome()))?;
            if let Err(f) = self.dm.read(env, iova, &mut out[done..done + n]) {
                self.iommu_fault(env, qpn, f.iova);
                return Err((CqeStatus::GeneralErr, VendorSyndrome::IommuFault));
            }
            done += n;
            offset = 0;
        }
        // A list shorter than `out` leaves zeros, not what the buffer held before.
        out[done..].fill(0);
        Ok(())
    }

    /// The NIC's own RDMA READ of a matched rendezvous: `rvh.len` bytes into the tagged buffer
    /// `sge`, on this QP, behind whatever it is sending; the FIN follows its completion.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_rndv_read(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        srqn: u32,
        handle: u32,
        rvh: ringbell_specs::tm::Rvh,
        sge: Sge,
        fin: [u8; ringbell_specs::tm::RNDV_HDR_LEN],
        ready: SimTime,
    ) {
        let wqe = SendWqe {
            op: SendOpcode::Read,
            flags: WqeFlags::empty(),
            imm: 0,
            nbb: 0,
            raddr: rvh.va,
            rkey: rvh.rkey,
            atomic: (0, 0),
            sges: vec![Sge {
                len: rvh.len,
                ..sge
            }],
            inline: Vec::new(),
            len: rvh.len as u64,
            ud: None,
            bind: Default::default(),
            xrc_srqn: 0,
        };
        self.push_hw_task(env, qp, wqe, HwTask::RndvRead { srqn, handle, fin }, ready);
    }

    /// Queues work the NIC does for itself on `qp`'s send side (no WQE, no send CQE). Its
    /// READs obey `max_rd_atomic` as posted READs do: past the limit they wait, and whatever
    /// the NIC queues after a waiting task waits behind it, so its work starts in order.
    fn push_hw_task(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        wqe: SendWqe,
        task: HwTask,
        ready: SimTime,
    ) {
        let o = Outstanding::task(wqe, task, ready);
        let limit = (qp.attr.max_rd_atomic as u32).max(1);
        if !qp.req.hw_waiting.is_empty() || (o.is_rd_atomic() && qp.req.rd_atomic >= limit) {
            qp.req.hw_waiting.push_back(o);
            return;
        }
        self.start_hw_task(env, qp, o, ready);
    }

    /// Numbers a task of the NIC's own and puts it behind the send side's outstanding work.
    fn start_hw_task(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        mut o: Outstanding,
        ready: SimTime,
    ) {
        o.npsn = match o.wqe.op {
            SendOpcode::CmpSwap | SendOpcode::FetchAdd => 1,
            _ => (o.wqe.len as u32).div_ceil(qp.mtu()).max(1),
        };
        if o.is_rd_atomic() {
            qp.req.rd_atomic += 1;
        }
        o.first_psn = qp.req.next_psn;
        qp.req.next_psn = o.first_psn.add(o.npsn);
        o.ready_at = self.reserve_msg(ready) + SimTime(self.cfg.timing.nic_tx_wqe_ps);
        qp.req.push(o);
        self.kick_qp_sq(env, qp, ready);
    }

    /// Starts the NIC's waiting tasks in order, as far as `max_rd_atomic` allows. A task that
    /// failed before it could start takes its place in the outstanding list and completes
    /// (in error) in turn.
    fn start_waiting_hw(&mut self, env: &mut dyn Env, qp: &mut Qp, ready: SimTime) {
        let limit = (qp.attr.max_rd_atomic as u32).max(1);
        let mut failed = false;
        while let Some(front) = qp.req.hw_waiting.front() {
            let ok = front.error.is_none();
            if ok && front.is_rd_atomic() && qp.req.rd_atomic >= limit {
                break;
            }
            let Some(mut o) = qp.req.hw_waiting.pop_front() else {
                break;
            };
            if ok {
                self.start_hw_task(env, qp, o, ready);
            } else {
                o.first_psn = qp.req.next_psn;
                qp.req.push(o);
                failed = true;
                break;
            }
        }
        if failed {
            self.complete_in_order_at(env, qp, ready);
        }
    }

    /// Starts a triggered data transfer that just fired on `qp`: as a task of the NIC's own
    /// behind the send side's outstanding work, or, when it cannot start (`err`, bad local
    /// keys, the QP not sending), as a failed one that completes in turn.
    pub(crate) fn start_triggered(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        wqe: SendWqe,
        task: HwTask,
        err: Option<WqeError>,
        ready: SimTime,
    ) {
        if !matches!(qp.state, QpState::Rts | QpState::Sqd) {
            let o = Outstanding::task(wqe, task, ready);
            self.hw_task_done(
                env,
                qp,
                &o,
                (CqeStatus::WrFlushErr, VendorSyndrome::None),
                ready,
            );
            return;
        }
        let err = match err {
            Some(e) => Some(e),
            None => self.check_local(env, qp, &wqe).err(),
        };
        if let Some(e) = err {
            let mut o = Outstanding::task(wqe, task, ready);
            o.error = Some(e);
            if !qp.req.hw_waiting.is_empty() {
                // It fired after the tasks still waiting: it fails in its turn, behind them.
                qp.req.hw_waiting.push_back(o);
                return;
            }
            o.first_psn = qp.req.next_psn;
            qp.req.push(o);
            self.complete_in_order_at(env, qp, ready);
            return;
        }
        self.push_hw_task(env, qp, wqe, task, ready);
    }

    /// A task of the NIC's own finished (or failed, or was flushed with `status`).
    pub(crate) fn hw_task_done(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        o: &Outstanding,
        status: (CqeStatus, VendorSyndrome),
        ready: SimTime,
    ) {
        if let Some(HwTask::Triggered {
            handle,
            comp,
            comp_gen,
            signaled,
            wr_id,
        }) = o.hw
        {
            let ok = status.0 == CqeStatus::Success;
            if signaled || !ok {
                let cqe = Self::trig_cqe(qp.qpn, &o.wqe, handle, wr_id, status);
                self.complete(env, qp.gen, qp.send_cqn, ready, cqe);
            }
            self.trig_count(env, comp, comp_gen, ok, ready);
            return;
        }
        if let Some(HwTask::RndvRead { srqn, handle, fin }) = o.hw {
            let ok = status.0 == CqeStatus::Success;
            let c = crate::tm::TmCompletion {
                opcode: ringbell_specs::cqe::CqeOpcode::TmRecv as u8,
                status: status.0 as u8,
                syndrome: status.1 as u8,
                flags: if ok {
                    ringbell_specs::cqe::CQE_FLAG_TM_DATA_VALID
                } else {
                    0
                },
                counter: handle,
                qpn: qp.qpn,
                handle,
                byte_len: if ok { o.wqe.len as u32 } else { 0 },
                ..Default::default()
            };
            self.tm_free_slot(srqn, handle);
            self.tm_complete(env, srqn, c);
            if status.0 == CqeStatus::Success {
                let fin = SendWqe {
                    op: SendOpcode::Send,
                    flags: WqeFlags::empty(),
                    imm: 0,
                    nbb: 0,
                    raddr: 0,
                    rkey: 0,
                    atomic: (0, 0),
                    sges: Vec::new(),
                    inline: fin.to_vec(),
                    len: fin.len() as u64,
                    ud: None,
                    bind: Default::default(),
                    xrc_srqn: 0,
                };
                self.push_hw_task(env, qp, fin, HwTask::Fin, ready);
            }
        }
    }

    /// Fails WQE `index` (it completes with `e` once everything before it has completed).
    pub(crate) fn fail_wqe(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        index: u32,
        nbb: u32,
        e: WqeError,
    ) {
        // Keep the opcode the WQE had, if it can be read, for the error CQE.
        let mut b = [0u8; 16];
        let op = env
            .dma_read(qp.sq.slot_iova(index, WQEBB as u64), &mut b)
            .ok()
            .and_then(|_| CtrlSeg::read_from_bytes(&b).ok())
            .and_then(|c| SendOpcode::from_u8(c.opcode))
            .unwrap_or(SendOpcode::Send);
        qp.req.push(Outstanding::without_packets(
            index,
            SendWqe::broken(op),
            qp.req.next_psn,
            env.now(),
            Some(e),
            false,
        ));
        qp.fetch = index.wrapping_add(nbb.max(1));
        self.complete_in_order(env, qp);
    }

    /// Arms the local ACK timer unless it runs already (or the QP's timeout is infinite).
    /// One timer event per QP is in flight at most: moving the deadline later only updates
    /// it, and the event, when it fires early, sleeps again until the deadline.
    fn arm_ack_timer(&mut self, env: &mut dyn Env, qp: &mut Qp) {
        if qp.req.timer_deadline.is_some() {
            return;
        }
        if let Some(t) = ack_timeout(qp.attr.timeout) {
            let deadline = env.now() + t;
            qp.req.timer_deadline = Some(deadline);
            // A new event only when none is due by the deadline (the timeout may have been
            // lowered since the pending one was scheduled).
            if qp.req.timer_event.is_none_or(|at| at > deadline) {
                qp.req.timer_event = Some(deadline);
                env.schedule(
                    deadline,
                    NicEvent::AckTimer {
                        qpn: qp.qpn,
                        gen: qp.gen,
                    },
                );
            }
        }
    }

    /// Stops the ACK timer (its event, if any, fires into nothing).
    fn stop_ack_timer(qp: &mut Qp) {
        qp.req.timer_deadline = None;
    }

    /// Forward progress: the retry counters reload and the timer restarts for what is left.
    fn progress(&mut self, env: &mut dyn Env, qp: &mut Qp) {
        qp.req.retries_used = 0;
        qp.req.retrying = false;
        qp.req.rewound_to = None;
        qp.req.rnr_used = 0;
        Self::stop_ack_timer(qp);
        if qp.req.outstanding.iter().any(|o| o.pending() && o.sent > 0) {
            self.arm_ack_timer(env, qp);
        }
    }

    /// The ACK timer event of `qpn` fired.
    pub(crate) fn ack_timer(&mut self, env: &mut dyn Env, qpn: u32) {
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        let now = env.now();
        if qp.req.timer_event.is_some_and(|at| at <= now) {
            qp.req.timer_event = None;
        }
        match qp.req.timer_deadline {
            Some(d) if d > now => {
                // Re-armed since this event was scheduled: sleep until the new deadline.
                if qp.req.timer_event.is_none_or(|at| at > d) {
                    qp.req.timer_event = Some(d);
                    env.schedule(d, NicEvent::AckTimer { qpn, gen: qp.gen });
                }
            }
            Some(_) if matches!(qp.state, QpState::Rts | QpState::Sqd) => {
                qp.req.timer_deadline = None;
                // An RNR wait has its own timer; the ACK timer must not cut it short.
                let waiting = now < qp.req.rnr_until;
                if let Some(una) = self.oldest_unanswered(&qp).filter(|_| !waiting) {
                    qp.stats.timeouts += 1;
                    trace(env, || {
                        TraceEvent::at(Stage::AckTimeout, now)
                            .qpn(qpn)
                            .psn(una.get())
                    });
                    self.retry_from(env, &mut qp, una);
                }
            }
            _ => qp.req.timer_deadline = None,
        }
        self.qps.restore(qpn, qp);
    }

    /// The PSN of the oldest request not yet answered, if any was sent.
    fn oldest_unanswered(&self, qp: &Qp) -> Option<Psn> {
        let o = qp.req.outstanding.iter().find(|o| o.pending())?;
        (o.sent > 0 || o.sent_max > 0).then(|| o.first_psn.add(o.acked))
    }

    /// A transport retry (timeout, sequence NAK, lost READ response): go back to `psn`, or
    /// fail its WQE with RETRY_EXC_ERR when `retry_cnt` retries are used up.
    fn retry_from(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn) {
        if qp.req.retries_used >= qp.attr.retry_cnt {
            self.fail_at(env, qp, psn, CqeStatus::RetryExcErr);
            return;
        }
        qp.req.retries_used += 1;
        qp.req.retrying = true;
        let now = env.now();
        self.rewind(env, qp, psn, now);
    }

    /// Go-back-N: every unfinished message from the one holding `psn` is sent again, that
    /// one from `psn` (a READ from its first unanswered response). Runs at `at`.
    fn rewind(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn, at: SimTime) {
        let now = env.now();
        trace(env, || {
            TraceEvent::at(Stage::Retry, now).qpn(qp.qpn).psn(psn.get())
        });
        qp.req.rewound_to = Some(psn);
        let Some(i) = qp
            .req
            .outstanding
            .iter()
            .position(|o| o.pending() && o.last_psn().diff(psn) >= 0)
        else {
            return;
        };
        let t = &self.cfg.timing;
        // The data is fetched from host memory again.
        let ready = at + SimTime(t.dma_read_rtt_ps + t.nic_tx_wqe_ps);
        for (j, o) in qp.req.outstanding.iter_mut().enumerate().skip(i) {
            if !o.pending() {
                continue;
            }
            o.sent = match o.wqe.op {
                SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd => 0,
                _ if j == i => (psn.diff(o.first_psn).max(0) as u32)
                    .max(o.acked)
                    .min(o.npsn),
                _ => o.acked,
            };
            o.ready_at = ready;
        }
        qp.req.sent_prefix = qp.req.sent_prefix.min(i);
        qp.req.since_ack_req = 0;
        Self::stop_ack_timer(qp);
        self.kick_qp_sq(env, qp, at);
    }

    /// Schedules the send engine of a QP that is out of the table.
    fn kick_qp_sq(&mut self, env: &mut dyn Env, qp: &mut Qp, at: SimTime) {
        if !qp.req.scheduled {
            qp.req.scheduled = true;
            env.schedule(
                at.max(qp.req.busy_until),
                NicEvent::SqProcess {
                    qpn: qp.qpn,
                    gen: qp.gen,
                },
            );
        }
    }

    /// Fails the WQE holding `psn` (the oldest unfinished one if none holds it).
    fn fail_at(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn, status: CqeStatus) {
        let pos = qp
            .req
            .outstanding
            .iter()
            .position(|o| o.pending() && o.holds(psn));
        let pos = pos.or_else(|| qp.req.outstanding.iter().position(|o| o.pending()));
        if let Some(i) = pos {
            qp.req.fail(i, (status, VendorSyndrome::None));
        }
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
        let mut progressed;
        match op {
            Opcode::Acknowledge => {
                let Some(aeth) = pkt.repr.aeth else { return };
                match aeth.syndrome {
                    AethSyndrome::Ack { .. } => {
                        progressed = self.ack_through(qp, psn, true);
                        progressed |= self.lost_responses(env, qp, psn);
                    }
                    AethSyndrome::RnrNak { timer } => {
                        qp.stats.rnr_naks_received += 1;
                        progressed = self.ack_through(qp, psn, false);
                        if progressed {
                            self.progress(env, qp);
                        }
                        self.rnr_nak(env, qp, psn, timer);
                        self.complete_in_order_at(env, qp, ready);
                        return;
                    }
                    AethSyndrome::Nak(NakCode::PsnSequenceError) => {
                        qp.stats.seq_naks_received += 1;
                        progressed = self.ack_through(qp, psn, false);
                        if progressed {
                            self.progress(env, qp);
                        }
                        // A copy of a NAK already acted on (no progress since) is not a new loss.
                        let repeat = qp.req.rewound_to == Some(psn);
                        if !repeat
                            && qp
                                .req
                                .outstanding
                                .iter()
                                .any(|o| o.pending() && o.holds(psn))
                        {
                            self.retry_from(env, qp, psn);
                        }
                        self.complete_in_order_at(env, qp, ready);
                        return;
                    }
                    AethSyndrome::Nak(code) => {
                        qp.stats.naks_received += 1;
                        progressed = self.ack_through(qp, psn, false);
                        let status = match code {
                            NakCode::InvalidRequest => CqeStatus::RemInvReqErr,
                            NakCode::RemoteAccessError => CqeStatus::RemAccessErr,
                            _ => CqeStatus::RemOpErr,
                        };
                        self.fail_at(env, qp, psn, status);
                    }
                }
            }
            Opcode::ReadResponseFirst
            | Opcode::ReadResponseMiddle
            | Opcode::ReadResponseLast
            | Opcode::ReadResponseOnly => {
                progressed = self.ack_through(qp, psn, false);
                progressed |= self.read_response(env, qp, pkt, op, ready);
                progressed |= self.lost_responses(env, qp, psn);
            }
            Opcode::AtomicAcknowledge => {
                progressed = self.ack_through(qp, psn, false);
                progressed |= self.atomic_ack(env, qp, pkt, ready);
                progressed |= self.lost_responses(env, qp, psn);
            }
            _ => return,
        }
        if progressed {
            self.progress(env, qp);
        }
        self.complete_in_order_at(env, qp, ready);
    }

    /// A READ response: accepted only at the PSN the READ expects next.
    fn read_response(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        op: Opcode,
        ready: SimTime,
    ) -> bool {
        let psn = pkt.repr.bth.psn;
        let mtu = qp.mtu() as u64;
        let (pdn, qpn) = (qp.pdn, qp.qpn);
        let Some(i) = Self::oldest_holding(qp, psn) else {
            return false;
        };
        let o = &qp.req.outstanding[i];
        if o.wqe.op != SendOpcode::Read {
            qp.req
                .fail(i, (CqeStatus::BadRespErr, VendorSyndrome::None));
            return false;
        }
        if o.first_psn.add(o.acked) != psn {
            // A duplicate, or one after a lost response: the timer or a retry deals with it.
            return false;
        }
        let offset = o.acked as u64 * mtu;
        let remaining = o.wqe.len.saturating_sub(offset);
        let last = psn == o.last_psn();
        let len = pkt.payload.len() as u64;
        let aeth_ok = !op.has_aeth()
            || pkt
                .repr
                .aeth
                .is_some_and(|a| matches!(a.syndrome, AethSyndrome::Ack { .. }));
        let shape_ok = if last {
            op.is_last() && len == remaining
        } else {
            !op.is_last() && len == mtu
        };
        if !aeth_ok || !shape_ok {
            qp.req
                .fail(i, (CqeStatus::BadRespErr, VendorSyndrome::None));
            return false;
        }
        let sges = o.wqe.sges.clone();
        if let Err(e) = self.scatter(env, pdn, qpn, &sges, offset, pkt.payload, ready) {
            qp.req.fail(i, e);
            return false;
        }
        let o = &mut qp.req.outstanding[i];
        o.acked += 1;
        o.done = last;
        true
    }

    /// The oldest unfinished WQE, if `psn` belongs to it. Responses are taken in order: one
    /// for a later READ or atomic means an earlier response was lost, and the retry asks for
    /// it again.
    fn oldest_holding(qp: &Qp, psn: Psn) -> Option<usize> {
        let i = qp.req.outstanding.iter().position(|o| o.pending())?;
        qp.req.outstanding[i].holds(psn).then_some(i)
    }

    /// An atomic ACK: the original value lands in the WQE's buffer.
    fn atomic_ack(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        ready: SimTime,
    ) -> bool {
        let psn = pkt.repr.bth.psn;
        let (pdn, qpn) = (qp.pdn, qp.qpn);
        let Some(i) = Self::oldest_holding(qp, psn) else {
            return false;
        };
        let (Some(orig), true) = (
            pkt.repr.atomic_ack,
            qp.req.outstanding[i].wqe.op.is_atomic(),
        ) else {
            qp.req
                .fail(i, (CqeStatus::BadRespErr, VendorSyndrome::None));
            return false;
        };
        let sges = qp.req.outstanding[i].wqe.sges.clone();
        let r = self.scatter(env, pdn, qpn, &sges, 0, &orig.to_le_bytes(), ready);
        let o = &mut qp.req.outstanding[i];
        match r {
            Ok(()) => {
                o.acked = 1;
                o.done = true;
                true
            }
            Err(e) => {
                o.error = Some(e);
                qp.req.maybe_failed = true;
                false
            }
        }
    }

    /// A response for `psn` proves every READ/atomic before it was executed: one still
    /// unanswered lost its responses, and is asked again (a transport retry).
    fn lost_responses(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn) -> bool {
        // Right after a retry, responses to the requests before it (duplicate ACKs among
        // them) are still on their way: they prove nothing new until progress is made.
        if qp.req.retrying {
            return false;
        }
        if qp.req.rd_atomic == 0 {
            return false;
        }
        // Entries are in PSN order: none from the first that starts at or after `psn` on
        // can have ended before it.
        let lost = qp
            .req
            .outstanding
            .iter()
            .take_while(|o| o.npsn == 0 || o.first_psn.diff(psn) < 0)
            .find(|o| o.pending() && o.is_rd_atomic() && o.sent > 0 && o.last_psn().diff(psn) < 0);
        if let Some(o) = lost {
            let at = o.first_psn.add(o.acked);
            self.retry_from(env, qp, at);
        }
        false
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
            if let Err(f) = self.dm.check(env, iova, n) {
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

    /// Marks SEND/WRITE packets up to `psn` (inclusive or not) acknowledged; returns whether
    /// anything new was acknowledged.
    fn ack_through(&mut self, qp: &mut Qp, psn: Psn, inclusive: bool) -> bool {
        let mut progressed = false;
        for o in qp.req.outstanding.iter_mut() {
            if o.is_rd_atomic() || !o.pending() || o.npsn == 0 {
                continue;
            }
            let upto = psn.diff(o.first_psn) + inclusive as i32;
            if upto <= 0 {
                break;
            }
            let acked = (upto as u32).min(o.npsn).min(o.sent_max);
            if acked > o.acked {
                o.acked = acked;
                o.done = acked == o.npsn;
                progressed = true;
            }
        }
        progressed
    }

    /// An RNR NAK for `psn`: wait the NAK's time and send again from `psn`, or fail with
    /// RNR_RETRY_EXC_ERR when `rnr_retry` is used up (7 is infinite).
    fn rnr_nak(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn, timer: u8) {
        // A stale RNR NAK (nothing outstanding holds its PSN), or a copy of the one we are
        // already waiting on, changes nothing.
        let stale = !qp
            .req
            .outstanding
            .iter()
            .any(|o| o.pending() && o.holds(psn));
        let repeat = env.now() < qp.req.rnr_until && qp.req.rewound_to == Some(psn);
        if stale || repeat {
            return;
        }
        if qp.attr.rnr_retry != 7 {
            if qp.req.rnr_used >= qp.attr.rnr_retry {
                self.fail_at(env, qp, psn, CqeStatus::RnrRetryExcErr);
                return;
            }
            qp.req.rnr_used += 1;
        }
        let at = env.now() + SimTime(wire::rnr_timer_ps(timer));
        qp.req.rnr_until = at;
        let now = env.now();
        trace(env, || {
            TraceEvent::new(Stage::RnrWait, now, at)
                .qpn(qp.qpn)
                .psn(psn.get())
        });
        self.rewind(env, qp, psn, at);
    }

    pub(crate) fn complete_in_order(&mut self, env: &mut dyn Env, qp: &mut Qp) {
        let now = env.now();
        self.complete_in_order_at(env, qp, now);
    }

    /// Completes finished WQEs from the head of the outstanding list, in order.
    pub(crate) fn complete_in_order_at(&mut self, env: &mut dyn Env, qp: &mut Qp, ready: SimTime) {
        let mut freed = false;
        while let Some(front) = qp.req.outstanding.front() {
            if let Some((status, syn)) = front.error {
                let Some(o) = qp.req.pop_front() else {
                    break;
                };
                if o.hw.is_some() {
                    self.hw_task_done(env, qp, &o, (status, syn), ready);
                } else {
                    let cqe = Self::send_cqe(qp.qpn, o.wqe_index, &o.wqe, status, syn);
                    self.complete(env, qp.gen, qp.send_cqn, ready, cqe);
                    let ev = crate::counter::send_event(o.wqe.op);
                    self.qp_count(env, &qp.cntrs, ev, false, ready);
                }
                // The QP is in error: everything else is flushed.
                self.flush(env, qp);
                return;
            }
            if !front.done {
                break;
            }
            let Some(o) = qp.req.pop_front() else {
                break;
            };
            if o.hw.is_some() {
                self.hw_task_done(
                    env,
                    qp,
                    &o,
                    (CqeStatus::Success, VendorSyndrome::None),
                    ready,
                );
            } else {
                if o.wqe.flags.contains(WqeFlags::SIGNALED) {
                    let cqe = Self::send_cqe(
                        qp.qpn,
                        o.wqe_index,
                        &o.wqe,
                        CqeStatus::Success,
                        VendorSyndrome::None,
                    );
                    self.complete(env, qp.gen, qp.send_cqn, ready, cqe);
                }
                let ev = crate::counter::send_event(o.wqe.op);
                self.qp_count(env, &qp.cntrs, ev, true, ready);
            }
            if o.is_rd_atomic() {
                qp.req.rd_atomic = qp.req.rd_atomic.saturating_sub(1);
            }
            if self.wqe_pool.len() < WQE_POOL_MAX {
                self.wqe_pool.push(o.wqe);
            }
            freed = true;
        }
        // Completions may unblock a fence, the READ/atomic limit or the PSN window. The
        // NIC's own waiting READs go first: they were queued before anything posted now.
        if freed && qp.state == QpState::Rts && !qp.req.hw_waiting.is_empty() {
            self.start_waiting_hw(env, qp, ready);
        }
        if freed && qp.fetch != qp.sq.pi && qp.state == QpState::Rts {
            self.kick_qp_sq(env, qp, ready);
        }
    }
}

/// Decodes a send WQE from its control segment, opcode and the segments after the control
/// segment (`nbb` blocks in all). Shared by the send queue and triggered operations.
pub(crate) fn decode_send_wqe(
    ctrl: &CtrlSeg,
    op: SendOpcode,
    body: &[u8],
    nbb: u32,
    max_msg: u32,
) -> Result<SendWqe, WqeError> {
    let mut w = SendWqe::broken(op);
    decode_send_wqe_into(ctrl, op, body, nbb, max_msg, false, &mut w).map(|_| w)
}

/// [`decode_send_wqe`] into `w`, whose buffers (gather list, inline payload) are reused, so
/// that functional mode's small messages neither allocate nor move a decoded WQE around. On
/// an error `w` holds a partly decoded WQE. `ud`: the WQE of a UD QP, which carries a
/// [`UdAddrSeg`] after the control segment and may only SEND.
pub(crate) fn decode_send_wqe_into(
    ctrl: &CtrlSeg,
    op: SendOpcode,
    body: &[u8],
    nbb: u32,
    max_msg: u32,
    ud: bool,
    w: &mut SendWqe,
) -> Result<(), WqeError> {
    let bad = |s| Err((CqeStatus::LocQpOpErr, s));
    let Some(flags) = WqeFlags::from_bits(ctrl.flags) else {
        return bad(VendorSyndrome::BadSegment);
    };
    w.op = op;
    w.flags = flags;
    w.imm = ctrl.imm.get();
    w.nbb = nbb;
    w.raddr = 0;
    w.rkey = 0;
    w.atomic = (0, 0);
    w.sges.clear();
    w.inline.clear();
    w.len = 0;
    w.ud = None;
    w.bind = Default::default();
    w.xrc_srqn = ctrl.xrc_srqn.get() & 0x00FF_FFFF;
    let mut rest = body;
    if ud {
        if !matches!(op, SendOpcode::Send | SendOpcode::SendImm) {
            return bad(VendorSyndrome::BadOpcode);
        }
        if rest.len() < wqe::UD_ADDR_SEGS * SEG {
            return bad(VendorSyndrome::BadSegment);
        }
        let Ok((a, tail)) = UdAddrSeg::read_from_prefix(rest) else {
            return bad(VendorSyndrome::BadSegment);
        };
        w.ud = Some(UdDest {
            qpn: a.dest_qpn.get() & 0x00FF_FFFF,
            qkey: a.qkey.get(),
            mac: a.dest_mac,
            ip: a.dest_ip,
        });
        rest = tail;
    }
    if op.is_local() {
        // BIND_MW: ctrl | bind; LOCAL_INV: ctrl (the key in `imm`). No data, never inline.
        if flags.contains(WqeFlags::INLINE) {
            return bad(VendorSyndrome::BadSegment);
        }
        if op == SendOpcode::BindMw {
            let Ok((b, _)) = BindSeg::read_from_prefix(rest) else {
                return bad(VendorSyndrome::BadSegment);
            };
            w.bind = crate::mw::BindReq {
                addr: b.addr.get(),
                len: b.length.get(),
                mw_key: b.mw_key.get(),
                new_key: b.new_key.get(),
                mr_key: b.mr_key.get(),
                access: b.access.get(),
            };
        }
        return Ok(());
    }
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
        w.inline.extend_from_slice(&rest[4..4 + n]);
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
        if w.len > max_msg as u64 {
            return Err((CqeStatus::LocLenErr, VendorSyndrome::TooLong));
        }
        if op.is_atomic() && (w.sges.len() != 1 || w.len != 8) {
            return bad(VendorSyndrome::BadSegment);
        }
    }
    if op.is_atomic() {
        w.len = 8;
    }
    // ATOMIC WRITE: its 8 bytes inline, nothing else.
    if op == SendOpcode::AtomicWrite && (!flags.contains(WqeFlags::INLINE) || w.len != 8) {
        return bad(VendorSyndrome::BadSegment);
    }
    Ok(())
}

fn split_seg<T: FromBytes>(b: &[u8]) -> Option<(T, &[u8])> {
    if b.len() < SEG {
        return None;
    }
    let v = T::read_from_prefix(b).ok()?.0;
    Some((v, &b[SEG..]))
}
