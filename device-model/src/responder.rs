//! The receive path: frame validation, the responder (SEND, WRITE, READ, atomics, ACK/NAK
//! generation) and the hand-off of responses to the requester.

use crate::env::{trace, Env, NicEvent, Stage, TraceEvent};
use crate::nic::Nic;
use crate::qp::{Qp, RecvCtx, RecvTake, Reply, Resource, TmRecv, WriteCtx, XrcRole};
use crate::tm::{self, SlotState, TmCompletion};
use ringbell_specs::cmd::{Access, CntrEvents, QpState};
use ringbell_specs::cqe::{
    Cqe, CqeOpcode, CqeStatus, EventType, VendorSyndrome, CQE_EXT_FLAG_INV, CQE_FLAG_IMM,
    CQE_FLAG_SOLICITED, CQE_FLAG_SRQ, CQE_FLAG_TM_DATA_VALID, CQE_FLAG_TM_MATCH, CQE_FLAG_UD,
    GRH_LEN,
};
use ringbell_specs::tm::{rndv_header, Rvh, Tmh, TmhOp, MAX_RNDV_HDR_SIZE, RNDV_HDR_LEN, TMH_LEN};
use ringbell_specs::wire::{
    self, Aeth, AethSyndrome, BthRepr, Endpoint, NakCode, Opcode, Packet, PacketRepr,
};
use ringbell_specs::{Psn, Qpn, SimTime};

/// What went wrong with a request, and what the responder does about it.
enum Fault {
    /// NAK with this code, move to ERR; complete the current receive WQE with the status
    /// and its vendor syndrome.
    Fatal(NakCode, Option<(CqeStatus, VendorSyndrome)>),
    /// RNR NAK: no receive WQE; nothing consumed.
    Rnr,
}

impl Nic {
    /// A frame arrives from the wire.
    pub fn receive(&mut self, env: &mut dyn Env, frame: &[u8]) {
        self.receive_frame(env, frame, true);
    }

    /// A frame arrives from the wire exactly as a NIC of this model built it with its IPv4
    /// checksum and ICRC left unwritten ([`Env::defers_sums`]) and nothing changed on the
    /// way: every check but those of the two sums (which could only pass), then as
    /// [`Nic::receive`].
    pub fn receive_unsealed(&mut self, env: &mut dyn Env, frame: &[u8]) {
        self.receive_frame(env, frame, false);
    }

    fn receive_frame(&mut self, env: &mut dyn Env, frame: &[u8], check_sums: bool) {
        self.stats.rx_frames += 1;
        if self.steers(frame) {
            self.steer(env, frame);
            return;
        }
        let parsed = if check_sums {
            wire::parse_packet(frame)
        } else {
            wire::parse_packet_unsealed(frame)
        };
        // Read in place: the parsed headers are a few hundred bytes.
        let pkt = match &parsed {
            Ok(p) => p,
            Err(wire::WireError::BadIcrc) => {
                self.stats.rx_icrc_errors += 1;
                return;
            }
            Err(_) => {
                self.stats.rx_malformed += 1;
                return;
            }
        };
        if pkt.repr.dst.ip != self.cfg.ip {
            if pkt.repr.dst.ip[0] & 0xF0 == 0xE0 {
                self.rx_multicast(env, pkt, frame);
            } else {
                self.stats.rx_dropped += 1;
            }
            return;
        }
        let qpn = pkt.repr.bth.dest_qp.get();
        if env.tracing() {
            let now = env.now();
            let end = now + SimTime(self.cfg.timing.nic_rx_pkt_ps);
            env.trace(
                TraceEvent::new(Stage::Rx, now, end)
                    .qpn(qpn)
                    .psn(pkt.repr.bth.psn.get())
                    .op(pkt.repr.bth.opcode)
                    .bytes(frame.len()),
            );
        }
        let Some(mut qp) = self.qps.remove(qpn) else {
            self.stats.rx_dropped += 1;
            return;
        };
        let op = Opcode::from_u8(pkt.repr.bth.opcode);
        if op.is_some_and(Opcode::is_ud) != qp.ud
            || op.is_some_and(Opcode::is_uc) != qp.uc
            || pkt.repr.xrc.is_some() != qp.xrc.is_some()
        {
            // Traffic of another transport: RC at a UD or UC QP, a datagram at a connected
            // QP, UC at an RC QP.
            qp.ud_stats.wrong_transport_dropped += 1;
            self.stats.rx_dropped += 1;
        } else if qp.ud {
            if pkt.repr.bth.pkey == 0xFFFF
                && matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            {
                self.rx_datagram(env, &mut qp, pkt, frame);
            } else {
                self.stats.rx_dropped += 1;
            }
        } else if pkt.repr.src.ip != qp.attr.dest_ip || pkt.repr.bth.pkey != 0xFFFF {
            self.stats.rx_dropped += 1;
        } else if qp.uc {
            if matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
                self.uc_request(env, &mut qp, pkt);
            } else {
                self.stats.rx_dropped += 1;
            }
        } else if Opcode::from_u8(pkt.repr.bth.opcode).is_some_and(|o| o.is_response()) {
            self.handle_response(env, &mut qp, pkt);
        } else if matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            self.handle_request(env, &mut qp, pkt);
        } else {
            self.stats.rx_dropped += 1;
        }
        self.qps.restore(qpn, qp);
    }

    /// The headers of a packet from `qp` to its peer.
    pub(crate) fn packet_repr(
        &self,
        qp: &Qp,
        opcode: Opcode,
        psn: Psn,
        ack_req: bool,
    ) -> PacketRepr {
        let dest = Qpn::from_bits(qp.attr.dest_qpn.get());
        PacketRepr {
            src: Endpoint {
                mac: self.cfg.mac,
                ip: self.cfg.ip,
            },
            dst: Endpoint {
                mac: qp.attr.dest_mac,
                ip: qp.attr.dest_ip,
            },
            udp_src_port: wire::udp_src_port(Qpn::from_bits(qp.qpn), dest),
            ip_id: psn.get() as u16,
            tos: 0,
            ttl: 64,
            bth: BthRepr {
                opcode: opcode as u8,
                solicited: false,
                mig_req: false,
                pad: 0,
                tver: 0,
                pkey: 0xFFFF,
                fecn: false,
                becn: false,
                dest_qp: dest,
                ack_req,
                psn,
            },
            reth: None,
            aeth: None,
            atomic_eth: None,
            atomic_ack: None,
            imm: None,
            deth: None,
            // An XRC QP's packets are XRC's; a request's SRQ number is its WQE's.
            xrc: qp.xrc.map(|_| 0),
        }
    }

    /// Builds a frame of QP `qpn` and sends it once `ready`.
    pub(crate) fn emit(
        &mut self,
        env: &mut dyn Env,
        qpn: u32,
        repr: &PacketRepr,
        payload: &[u8],
        ready: SimTime,
    ) {
        let mut frame = env.buffer();
        frame.clear();
        frame.reserve(repr.frame_len(payload.len()));
        if env.defers_sums() {
            repr.emit_unsealed(payload, &mut frame);
        } else {
            repr.emit(payload, &mut frame);
        }
        let (len, start) = (frame.len(), ready.max(self.egress_free));
        self.send_frame(env, ready, frame);
        let done = self.egress_free;
        trace(env, || {
            TraceEvent::new(Stage::Serialize, start, done)
                .qpn(qpn)
                .psn(repr.bth.psn.get())
                .op(repr.bth.opcode)
                .bytes(len)
        });
    }

    /// Acknowledges (or NAKs) `psn`. Responses leave in PSN order: while READ or atomic
    /// responses are still owed, the ACK queues behind them.
    fn send_ack(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        psn: Psn,
        syndrome: AethSyndrome,
        ready: SimTime,
    ) {
        if qp.uc {
            // UC is never acknowledged, whatever a packet's AckReq bit says.
            return;
        }
        let msn = qp.resp.msn;
        if qp.resp.queue.is_empty() {
            self.emit_ack(env, qp, psn, syndrome, msn, ready);
        } else {
            qp.resp.queue.push_back(Reply::Ack { psn, syndrome, msn });
        }
    }

    fn emit_ack(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        psn: Psn,
        syndrome: AethSyndrome,
        msn: u32,
        ready: SimTime,
    ) {
        let mut repr = self.packet_repr(qp, Opcode::Acknowledge, psn, false);
        repr.aeth = Some(Aeth {
            syndrome,
            msn: msn & 0x00FF_FFFF,
        });
        match syndrome {
            AethSyndrome::Nak(NakCode::PsnSequenceError) => {
                self.stats.naks_sent += 1;
                qp.stats.seq_naks_sent += 1;
            }
            AethSyndrome::Nak(_) => {
                self.stats.naks_sent += 1;
                qp.stats.naks_sent += 1;
            }
            AethSyndrome::RnrNak { .. } => {
                self.stats.rnr_naks_sent += 1;
                qp.stats.rnr_naks_sent += 1;
            }
            AethSyndrome::Ack { .. } => {}
        }
        self.emit(env, qp.qpn, &repr, &[], ready);
    }

    /// An XRC target (ABI 1.11) takes the PD, the receive WQEs and the CQ of the XRC SRQ
    /// each request names in its XRCETH, which must be an SRQ of the target's XRC domain
    /// (else the request is invalid); a message in progress keeps the SRQ it started on. A
    /// request to an initiator, which only sends, is invalid.
    fn bind_xrc_target(&self, qp: &mut Qp, pkt: &Packet<'_>) -> Result<(), Fault> {
        let invalid = Fault::Fatal(NakCode::InvalidRequest, None);
        let xrcdn = match qp.xrc {
            None => return Ok(()),
            // An initiator has no receive side: a request to it is invalid.
            Some(XrcRole::Ini) => return Err(invalid),
            Some(XrcRole::Tgt { xrcdn }) => xrcdn,
        };
        let srqn = pkt.repr.xrc.unwrap_or(0);
        if (qp.resp.recv.is_some() || qp.resp.write.is_some()) && srqn != qp.srqn {
            return Err(invalid);
        }
        let Some((srq, cqn)) = self
            .srqs
            .get(srqn)
            .and_then(|s| s.xrc.filter(|&(x, _)| x == xrcdn).map(|(_, c)| (s, c)))
        else {
            return Err(invalid);
        };
        qp.srqn = srqn;
        qp.pdn = srq.pdn;
        qp.recv_cqn = cqn;
        Ok(())
    }

    fn handle_request(&mut self, env: &mut dyn Env, qp: &mut Qp, pkt: &Packet<'_>) {
        let ready = env.now() + SimTime(self.cfg.timing.nic_rx_pkt_ps);
        if qp.resp.dead {
            // A fatal error is queued behind earlier responses: nothing more is accepted.
            self.stats.rx_dropped += 1;
            return;
        }
        let psn = pkt.repr.bth.psn;
        let d = psn.diff(qp.resp.epsn);
        if d < 0 {
            qp.stats.duplicates_received += 1;
            self.duplicate_request(env, qp, pkt, ready);
            return;
        }
        if d > 0 {
            qp.stats.out_of_sequence += 1;
            if !qp.resp.nak_sent {
                qp.resp.nak_sent = true;
                let e = qp.resp.epsn;
                self.send_ack(
                    env,
                    qp,
                    e,
                    AethSyndrome::Nak(NakCode::PsnSequenceError),
                    ready,
                );
            }
            return;
        }
        qp.resp.nak_sent = false;
        let Some(op) = Opcode::from_u8(pkt.repr.bth.opcode) else {
            return;
        };
        let r = self.bind_xrc_target(qp, pkt).and_then(|()| match op {
            Opcode::SendFirst
            | Opcode::SendMiddle
            | Opcode::SendLast
            | Opcode::SendLastImm
            | Opcode::SendOnly
            | Opcode::SendOnlyImm
            | Opcode::SendLastInv
            | Opcode::SendOnlyInv => self.rx_send(env, qp, pkt, op, ready),
            Opcode::WriteFirst
            | Opcode::WriteMiddle
            | Opcode::WriteLast
            | Opcode::WriteLastImm
            | Opcode::WriteOnly
            | Opcode::WriteOnlyImm => self.rx_write(env, qp, pkt, op, ready),
            Opcode::ReadRequest => self.rx_read(env, qp, pkt, ready),
            Opcode::CompareSwap | Opcode::FetchAdd => self.rx_atomic(env, qp, pkt, op, ready),
            Opcode::AtomicWrite => self.rx_atomic_write(env, qp, pkt, ready),
            _ => Err(Fault::Fatal(NakCode::InvalidRequest, None)),
        });
        match r {
            Ok(()) => {}
            Err(Fault::Rnr) => {
                // The packets already behind this one are out of sequence now; the RNR NAK is
                // the one NAK they get (the requester resends from this PSN after the timer).
                qp.resp.nak_sent = true;
                let timer = qp.attr.min_rnr_timer;
                self.send_ack(env, qp, psn, AethSyndrome::RnrNak { timer }, ready);
            }
            Err(Fault::Fatal(code, status)) if !qp.resp.queue.is_empty() => {
                // Requests accepted before this one are answered first.
                qp.resp.dead = true;
                qp.resp.queue.push_back(Reply::Fatal { psn, code, status });
            }
            Err(Fault::Fatal(code, status)) => {
                self.responder_fatal(env, qp, psn, code, status, ready)
            }
        }
    }

    /// A UC packet for `qp` (in RTR, RTS or SQD). Nothing is acknowledged. A packet after a
    /// gap in the PSNs loses the message in progress; a FIRST or ONLY packet starts a new
    /// one at its own PSN. A packet the RC responder would NAK (out of its message's order,
    /// no receive WQE, a bad R_Key, range or rights, a SEND too long for its WQE) is dropped
    /// with the rest of its message and counted in `uc_dropped`; the QP keeps serving. A
    /// receive WQE of the QP's own RQ that a lost message was filling is kept for the next
    /// SEND; one taken from an SRQ completes in error (see [`Nic::uc_abandon`]). Only a fault
    /// of this side (a receive WQE whose keys fail, memory the IOMMU does not map) completes
    /// that WQE in error and moves the QP to ERR, as on RC, without a NAK.
    fn uc_request(&mut self, env: &mut dyn Env, qp: &mut Qp, pkt: &Packet<'_>) {
        let ready = env.now() + SimTime(self.cfg.timing.nic_rx_pkt_ps);
        let Some(op) = Opcode::from_u8(pkt.repr.bth.opcode).filter(|o| o.is_uc()) else {
            return;
        };
        let op = op.base();
        let psn = pkt.repr.bth.psn;
        let lost = (CqeStatus::RemInvReqErr, VendorSyndrome::None);
        if psn != qp.resp.epsn {
            qp.stats.out_of_sequence += 1;
            self.uc_abandon(env, qp, lost, ready);
        } else if op.is_first() {
            // A new message while one is unfinished: the sender gave up on that one.
            self.uc_abandon(env, qp, lost, ready);
        }
        qp.resp.epsn = psn;
        let r = if op.is_send() {
            self.rx_send(env, qp, pkt, op, ready)
        } else {
            self.rx_write(env, qp, pkt, op, ready)
        };
        match r {
            Ok(()) => {}
            Err(Fault::Fatal(code @ NakCode::RemoteOperationalError, status)) => {
                self.responder_fatal(env, qp, psn, code, status, ready)
            }
            Err(e) => {
                qp.stats.uc_dropped += 1;
                self.stats.rx_dropped += 1;
                // A SEND too long for its WQE reports what RC's receiver reports.
                let status = match e {
                    Fault::Fatal(_, Some(s @ (CqeStatus::LocLenErr, _))) => s,
                    _ => lost,
                };
                self.uc_abandon(env, qp, status, ready);
                qp.resp.epsn = psn.add(1);
            }
        }
    }

    /// UC: the message in progress is lost; a WRITE's context is forgotten. The receive WQE
    /// a SEND was filling is reused when it is the QP's own: it is parked for the next SEND
    /// (from its start). One taken from an SRQ cannot go back to it: it completes with
    /// `status` and the QP serves on (the IBTA's class E; rxe does the same).
    fn uc_abandon(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        status: (CqeStatus, VendorSyndrome),
        ready: SimTime,
    ) {
        if let Some(mut rc) = qp.resp.recv.take() {
            if rc.srqn != 0 {
                self.finish_recv(env, qp, rc, status, 0, 0, 0, ready);
            } else {
                rc.offset = 0;
                qp.resp.parked = Some(rc);
            }
        }
        qp.resp.write = None;
    }

    /// A class A/C error: NAK, complete the receive WQE in progress with `status`, move to ERR.
    fn responder_fatal(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        psn: Psn,
        code: NakCode,
        status: Option<(CqeStatus, VendorSyndrome)>,
        ready: SimTime,
    ) {
        self.send_ack(env, qp, psn, AethSyndrome::Nak(code), ready);
        // The receive WQE the failed message was filling completes in error (an invalid
        // request without a more precise status: LOC_QP_OP_ERR, as rdmavt reports it).
        if let Some(rc) = qp.resp.recv.take() {
            let status = status.unwrap_or((CqeStatus::LocQpOpErr, VendorSyndrome::None));
            self.finish_recv(env, qp, rc, status, 0, 0, 0, ready);
        }
        if code == NakCode::RemoteAccessError {
            self.post_event(env, EventType::QpAccessErr, 0, qp.qpn, 0);
        }
        self.flush(env, qp);
    }

    /// Checks the opcode sequence: a FIRST/ONLY may not interrupt a message in progress, and
    /// MIDDLE/LAST must continue one of the same kind.
    fn check_sequence(qp: &Qp, op: Opcode, is_send: bool) -> Result<(), Fault> {
        let in_send = qp.resp.recv.is_some();
        let in_progress = if is_send {
            in_send
        } else {
            qp.resp.write.is_some()
        };
        let other = if is_send {
            qp.resp.write.is_some()
        } else {
            in_send
        };
        let ok = if op.is_first() {
            !in_progress && !other
        } else {
            in_progress
        };
        if ok {
            Ok(())
        } else {
            Err(Fault::Fatal(NakCode::InvalidRequest, None))
        }
    }

    fn mtu_check(qp: &Qp, op: Opcode, len: usize) -> Result<(), Fault> {
        let mtu = qp.mtu() as usize;
        // FIRST and MIDDLE carry exactly one MTU; LAST carries 1..=MTU; ONLY 0..=MTU.
        let ok = match (op.is_first(), op.is_last()) {
            (true, true) => len <= mtu,
            (false, true) => (1..=mtu).contains(&len),
            _ => len == mtu,
        };
        if ok {
            Ok(())
        } else {
            Err(Fault::Fatal(NakCode::InvalidRequest, None))
        }
    }

    fn rx_send(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        op: Opcode,
        mut ready: SimTime,
    ) -> Result<(), Fault> {
        Self::check_sequence(qp, op, true)?;
        Self::mtu_check(qp, op, pkt.payload.len())?;
        if op.is_first() {
            let tm = self.srqs.get(qp.srqn).is_some_and(|s| s.tm.is_some());
            let ctx = if tm {
                match self.tm_first_packet(env, qp, pkt, op, &mut ready)? {
                    Some(ctx) => ctx,
                    None => {
                        // A rendezvous request, taken whole by tag matching.
                        qp.resp.epsn = qp.resp.epsn.add(1);
                        qp.resp.msn = qp.resp.msn.wrapping_add(1);
                        if pkt.repr.bth.ack_req {
                            self.send_ack(
                                env,
                                qp,
                                pkt.repr.bth.psn,
                                AethSyndrome::Ack { credits: 0x1F },
                                ready,
                            );
                        }
                        return Ok(());
                    }
                }
            } else if let Some(parked) = qp.resp.parked.take() {
                parked
            } else {
                let (wqe_index, srqn, sges) = match self.take_recv_wqe(env, qp) {
                    Ok(Some(w)) => w,
                    Ok(None) => return Err(Fault::Rnr),
                    Err(iova) => {
                        self.iommu_fault(env, qp.qpn, iova);
                        return Err(Fault::Fatal(NakCode::RemoteOperationalError, None));
                    }
                };
                RecvCtx {
                    wqe_index,
                    srqn,
                    sges,
                    offset: 0,
                    strip: 0,
                    tm: None,
                }
            };
            qp.resp.recv = Some(ctx);
        }
        let Some(rc) = qp.resp.recv.as_ref() else {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        };
        // The TMH of a matched eager message is not data: it is not written.
        let skip = rc
            .strip
            .saturating_sub(rc.offset)
            .min(pkt.payload.len() as u64) as usize;
        let data = &pkt.payload[skip..];
        let dst = rc.offset + skip as u64 - rc.strip;
        let cap: u64 = rc.sges.iter().map(|s| s.len as u64).sum();
        let end = rc.offset + pkt.payload.len() as u64;
        let too_long = Fault::Fatal(
            NakCode::InvalidRequest,
            Some((CqeStatus::LocLenErr, VendorSyndrome::TooLong)),
        );
        if end > self.cfg.max_msg_size as u64 || dst + data.len() as u64 > cap {
            return Err(too_long);
        }
        // SEND with invalidate (ABI 1.9): the window must be one this QP may invalidate,
        // checked before any of the last packet's data lands.
        let inv = match (op.has_ieth(), pkt.repr.imm) {
            (true, Some(key)) => {
                Some(self.invalidation(qp.pdn, Some(qp.qpn), key).map_err(|s| {
                    Fault::Fatal(NakCode::InvalidRequest, Some((CqeStatus::LocProtErr, s)))
                })?)
            }
            _ => None,
        };
        let sges = rc.sges.clone();
        self.scatter(env, qp.pdn, qp.qpn, &sges, dst, data, ready)
            .map_err(|(s, syn)| match s {
                CqeStatus::LocLenErr => Fault::Fatal(NakCode::InvalidRequest, Some((s, syn))),
                // A bad receive WQE (key, PD, rights) or an unreachable buffer: class A.
                _ => Fault::Fatal(NakCode::RemoteOperationalError, Some((s, syn))),
            })?;
        qp.resp.epsn = qp.resp.epsn.add(1);
        if let Some(rc) = qp.resp.recv.as_mut() {
            rc.offset += pkt.payload.len() as u64;
        }
        if op.is_last() {
            if let Some(rc) = qp.resp.recv.take() {
                qp.resp.msn = qp.resp.msn.wrapping_add(1);
                let mut flags = 0u16;
                if let Some(idx) = inv {
                    self.unbind(idx);
                    flags |= u16::from(CQE_EXT_FLAG_INV) << 8;
                } else if pkt.repr.imm.is_some() {
                    flags |= u16::from(CQE_FLAG_IMM);
                }
                if pkt.repr.bth.solicited {
                    flags |= u16::from(CQE_FLAG_SOLICITED);
                }
                let len = (rc.offset - rc.strip) as u32;
                self.finish_recv(
                    env,
                    qp,
                    rc,
                    (CqeStatus::Success, VendorSyndrome::None),
                    len,
                    flags,
                    pkt.repr.imm.unwrap_or(0),
                    ready,
                );
            }
        }
        if pkt.repr.bth.ack_req {
            self.send_ack(
                env,
                qp,
                pkt.repr.bth.psn,
                AethSyndrome::Ack { credits: 0x1F },
                ready,
            );
        }
        Ok(())
    }

    /// A datagram for UD QP `qp` (in RTR, RTS or SQD). A wrong Q_Key, no posted receive WQE,
    /// or a WQE too small for the GRH area and the payload drops it, counted in the QP's
    /// [`UdStats`](ringbell_specs::stats::UdStats); the QP keeps serving and the sender is
    /// never told. Otherwise the GRH area and the payload are scattered into the WQE and the
    /// completion names the sender.
    pub(crate) fn rx_datagram(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        frame: &[u8],
    ) {
        let ready = env.now() + SimTime(self.cfg.timing.nic_rx_pkt_ps);
        let deth = pkt.repr.deth.unwrap_or_default();
        if deth.qkey != qp.attr.qkey.get() {
            qp.ud_stats.qkey_dropped += 1;
            self.stats.rx_dropped += 1;
            return;
        }
        // The GRH area: 20 bytes of zeros, then the IPv4 header as received (RoCEv2), its
        // checksum as the sender sealed it (an unsealed frame carries zeros there).
        let mut grh = [0u8; GRH_LEN];
        let ip = frame
            .get(wire::ETH_HDR_LEN..wire::ETH_HDR_LEN + wire::IPV4_HDR_LEN)
            .unwrap_or_default();
        grh[GRH_LEN - ip.len()..].copy_from_slice(ip);
        wire::write_ipv4_checksum(&mut grh[GRH_LEN - ip.len()..]);
        let Some(mut cqe) = self.place_datagram(env, qp, &[&grh, pkt.payload], ready) else {
            return;
        };
        cqe.flags |= CQE_FLAG_UD;
        if let Some(imm) = pkt.repr.imm {
            cqe.flags |= CQE_FLAG_IMM;
            cqe.imm = imm.into();
        }
        if pkt.repr.bth.solicited {
            cqe.flags |= CQE_FLAG_SOLICITED;
        }
        cqe.src_mac = pkt.repr.src.mac;
        cqe.src_ip = pkt.repr.src.ip;
        cqe.set_ud_src_qpn(deth.src_qp.get());
        qp.ud_stats.received += 1;
        self.complete(env, qp.gen, qp.recv_cqn, ready, cqe);
    }

    /// Places an unacknowledged message (a UD datagram, a raw packet QP's frame), `parts`
    /// one after the other, into `qp`'s next receive WQE. No WQE, or one too small, drops
    /// it, counted in the QP's [`UdStats`](ringbell_specs::stats::UdStats); an unreadable
    /// receive ring raises IOMMU_FAULT and moves the QP to ERR (the driver's mistake); a bad
    /// WQE (key, PD, rights, an unmapped buffer) completes in error and moves the QP to ERR,
    /// as on RC. Otherwise the receive's successful CQE, for the caller to finish and
    /// complete.
    pub(crate) fn place_datagram(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        parts: &[&[u8]],
        ready: SimTime,
    ) -> Option<Cqe> {
        let need: usize = parts.iter().map(|p| p.len()).sum();
        let (wqe_index, srqn, sges) = match self.take_recv_wqe_for(env, qp, need as u64) {
            Ok(RecvTake::Wqe(i, srqn, sges)) => (i, srqn, sges),
            Ok(RecvTake::Empty) => {
                qp.ud_stats.no_recv_dropped += 1;
                self.stats.rx_dropped += 1;
                return None;
            }
            Ok(RecvTake::TooSmall) => {
                qp.ud_stats.too_long_dropped += 1;
                self.stats.rx_dropped += 1;
                return None;
            }
            Err(iova) => {
                self.iommu_fault(env, qp.qpn, iova);
                self.stats.rx_dropped += 1;
                self.flush(env, qp);
                return None;
            }
        };
        let mut at = 0u64;
        let mut placed = Ok(());
        for p in parts {
            placed = placed.and_then(|()| self.scatter(env, qp.pdn, qp.qpn, &sges, at, p, ready));
            at += p.len() as u64;
        }
        let rc = RecvCtx {
            wqe_index,
            srqn,
            sges: Vec::new(),
            offset: 0,
            strip: 0,
            tm: None,
        };
        if let Err((status, syndrome)) = placed {
            let mut cqe = recv_cqe(qp.qpn, &rc, status, 0);
            cqe.vendor_syndrome = syndrome as u8;
            self.complete(env, qp.gen, qp.recv_cqn, ready, cqe);
            self.flush(env, qp);
            return None;
        }
        Some(recv_cqe(qp.qpn, &rc, CqeStatus::Success, need as u32))
    }

    /// Completes a receive WQE (ordinary, untagged on a TM-SRQ, or a matched tagged buffer).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn finish_recv(
        &mut self,
        env: &mut dyn Env,
        qp: &Qp,
        rc: RecvCtx,
        (status, syndrome): (CqeStatus, VendorSyndrome),
        byte_len: u32,
        flags: u16,
        imm: u32,
        ready: SimTime,
    ) {
        // The CQE's `flags` in the low byte, its `ext_flags` (ABI 1.9) in the high one.
        let (ext, flags) = ((flags >> 8) as u8, flags as u8);
        let mut c = TmCompletion {
            ext_flags: ext,
            status: status as u8,
            syndrome: syndrome as u8,
            counter: rc.wqe_index,
            qpn: qp.qpn,
            byte_len: if status == CqeStatus::Success {
                byte_len
            } else {
                0
            },
            imm,
            ..Default::default()
        };
        match rc.tm {
            None => {
                let mut cqe = recv_cqe(qp.qpn, &rc, status, byte_len);
                cqe.flags |= flags;
                cqe.ext_flags = ext;
                cqe.imm = imm.into();
                cqe.vendor_syndrome = syndrome as u8;
                self.complete(env, qp.gen, qp.recv_cqn, ready, cqe);
                return;
            }
            Some(TmRecv::Unexpected) | Some(TmRecv::NoTag) => {
                c.opcode = if rc.tm == Some(TmRecv::NoTag) {
                    CqeOpcode::TmNoTag
                } else {
                    CqeOpcode::TmRecv
                } as u8;
                c.flags = tm::UNTAGGED | flags;
            }
            Some(TmRecv::Matched {
                handle,
                tag,
                app_ctx,
                multi,
            }) => {
                c.opcode = CqeOpcode::TmRecv as u8;
                c.handle = handle;
                c.flags = flags;
                // An error completion carries no match and no valid data (7.1: byte_len 0).
                if status == CqeStatus::Success {
                    c.flags |= if multi {
                        CQE_FLAG_TM_DATA_VALID
                    } else {
                        tm::MATCHED_DATA
                    };
                    if !multi {
                        (c.tag, c.app_ctx) = (tag, app_ctx);
                    }
                }
                self.tm_free_slot(rc.srqn, handle);
            }
        }
        self.tm_complete(env, rc.srqn, c);
    }

    /// The first packet of a message on a TM-SRQ: match it, or take an untagged buffer.
    /// `Ok(None)`: a rendezvous request, consumed here. The list walk delays `ready`.
    fn tm_first_packet(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        op: Opcode,
        ready: &mut SimTime,
    ) -> Result<Option<RecvCtx>, Fault> {
        let srqn = qp.srqn;
        let p = pkt.payload;
        let tmh = Tmh::parse(p);
        let kind = match tmh.map(|t| TmhOp::from_u8(t.opcode)) {
            None => TmRecv::NoTag,
            Some(None) => return Err(Fault::Fatal(NakCode::InvalidRequest, None)),
            Some(Some(TmhOp::NoTag | TmhOp::Fin)) => TmRecv::NoTag,
            Some(Some(_)) => TmRecv::Unexpected,
        };
        let tmh = tmh.unwrap_or_default();
        let rndv = tmh.opcode == TmhOp::Rndv as u8;
        // A rendezvous request the device cannot take (longer than max_rndv_hdr_size, no
        // RVH, more than one packet, or arriving before the QP can send its READ: RTR) is
        // never matched: software gets it unexpected.
        let matchable = kind == TmRecv::Unexpected
            && (!rndv
                || (op.is_last()
                    && qp.state == QpState::Rts
                    && p.len() >= RNDV_HDR_LEN
                    && p.len() <= MAX_RNDV_HDR_SIZE as usize));
        if matchable {
            let Some(tm) = self.srqs.get(srqn).and_then(|s| s.tm.as_ref()) else {
                return Ok(None);
            };
            let (hit, compared) = tm.find(tmh.tag);
            let t = &self.cfg.timing;
            let before = *ready;
            *ready =
                *ready + SimTime(t.tm_match_fixed_ps + t.tm_match_per_entry_ps * compared as u64);
            let ready = *ready;
            trace(env, || {
                TraceEvent::new(Stage::TagMatch, before, ready)
                    .qpn(qp.qpn)
                    .obj(srqn)
                    .psn(pkt.repr.bth.psn.get())
                    .bytes(compared)
            });
            if let Some(h) = hit {
                let slot = tm.slots[h];
                let handle = h as u32;
                let matched = TmCompletion {
                    opcode: CqeOpcode::TmRecv as u8,
                    flags: CQE_FLAG_TM_MATCH,
                    counter: handle,
                    qpn: qp.qpn,
                    handle,
                    tag: tmh.tag,
                    app_ctx: tmh.app_ctx,
                    ..Default::default()
                };
                self.set_slot(srqn, handle, SlotState::Busy);
                if rndv {
                    let rvh = Rvh::parse(&p[TMH_LEN..]).unwrap_or_default();
                    if rvh.len as u64 <= slot.sge.len as u64 {
                        let fin = rndv_header(
                            &Tmh {
                                opcode: TmhOp::Fin as u8,
                                ..tmh
                            },
                            &rvh,
                        );
                        self.tm_complete(env, srqn, matched);
                        self.start_rndv_read(env, qp, srqn, handle, rvh, slot.sge, fin, ready);
                    } else {
                        // Too small for the data: the request goes into the buffer and
                        // software finishes the transfer.
                        let n = p.len().min(slot.sge.len as usize);
                        let r = self.scatter(env, qp.pdn, qp.qpn, &[slot.sge], 0, &p[..n], ready);
                        let status = match r {
                            Ok(()) => (CqeStatus::TmRndvIncomplete, VendorSyndrome::None),
                            Err(e) => e,
                        };
                        let c = TmCompletion {
                            status: status.0 as u8,
                            syndrome: status.1 as u8,
                            flags: tm::MATCHED_DATA,
                            byte_len: p.len() as u32,
                            ..matched
                        };
                        self.tm_free_slot(srqn, handle);
                        self.tm_complete(env, srqn, c);
                    }
                    return Ok(None);
                }
                let multi = !op.is_last();
                if multi {
                    self.tm_complete(env, srqn, matched);
                }
                let tm = TmRecv::Matched {
                    handle,
                    tag: tmh.tag,
                    app_ctx: tmh.app_ctx,
                    multi,
                };
                return Ok(Some(RecvCtx {
                    wqe_index: handle,
                    srqn,
                    sges: vec![slot.sge],
                    offset: 0,
                    strip: TMH_LEN as u64,
                    tm: Some(tm),
                }));
            }
        }
        let (wqe_index, srqn, sges) = match self.take_recv_wqe(env, qp) {
            Ok(Some(w)) => w,
            Ok(None) => return Err(Fault::Rnr),
            Err(iova) => {
                self.iommu_fault(env, qp.qpn, iova);
                return Err(Fault::Fatal(NakCode::RemoteOperationalError, None));
            }
        };
        if kind == TmRecv::Unexpected {
            if let Some(tm) = self.srqs.get_mut(srqn).and_then(|s| s.tm.as_mut()) {
                tm.count_unexpected();
            }
        }
        Ok(Some(RecvCtx {
            wqe_index,
            srqn,
            sges,
            offset: 0,
            strip: 0,
            tm: Some(kind),
        }))
    }

    fn set_slot(&mut self, srqn: u32, handle: u32, state: SlotState) {
        if let Some(s) = self
            .srqs
            .get_mut(srqn)
            .and_then(|s| s.tm.as_mut())
            .and_then(|t| t.slots.get_mut(handle as usize))
        {
            s.state = state;
        }
    }

    fn rx_write(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        op: Opcode,
        ready: SimTime,
    ) -> Result<(), Fault> {
        Self::check_sequence(qp, op, false)?;
        Self::mtu_check(qp, op, pkt.payload.len())?;
        // Every check comes before any side effect, so an RNR NAK or an error leaves the
        // responder exactly as it was (the retried packet is checked afresh).
        let (rkey, va, remaining, total) = if op.is_first() {
            let Some(reth) = pkt.repr.reth else {
                return Err(Fault::Fatal(NakCode::InvalidRequest, None));
            };
            if !qp.access().contains(Access::REMOTE_WRITE) || reth.len > self.cfg.max_msg_size {
                return Err(Fault::Fatal(NakCode::InvalidRequest, None));
            }
            self.check_rkey(
                qp.pdn,
                qp.qpn,
                reth.rkey,
                reth.va,
                reth.len as u64,
                Access::REMOTE_WRITE,
            )
            .map_err(|_| Fault::Fatal(NakCode::RemoteAccessError, None))?;
            (reth.rkey, reth.va, reth.len, reth.len)
        } else {
            let Some(w) = qp.resp.write.as_ref() else {
                return Err(Fault::Fatal(NakCode::InvalidRequest, None));
            };
            (w.rkey, w.va, w.remaining, w.total)
        };
        let n = pkt.payload.len() as u32;
        if n > remaining || (op.is_last() && n != remaining) {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        }
        let iova = if n > 0 {
            let iova = self
                .check_rkey(qp.pdn, qp.qpn, rkey, va, n as u64, Access::REMOTE_WRITE)
                .map_err(|_| Fault::Fatal(NakCode::RemoteAccessError, None))?;
            if let Err(f) = self.dm.check(env, iova, n as usize) {
                self.iommu_fault(env, qp.qpn, f.iova);
                return Err(Fault::Fatal(NakCode::RemoteOperationalError, None));
            }
            Some(iova)
        } else {
            None
        };
        // WRITE with immediate needs a receive WQE before anything of its last packet lands
        // (on UC, the one a lost SEND left parked comes first: receive WQEs complete in order).
        let recv = if op.has_immdt() {
            if let Some(p) = qp.resp.parked.take() {
                Some((p.wqe_index, p.srqn, p.sges))
            } else {
                match self.take_recv_wqe(env, qp) {
                    Ok(Some(w)) => Some(w),
                    Ok(None) => return Err(Fault::Rnr),
                    Err(iova) => {
                        self.iommu_fault(env, qp.qpn, iova);
                        return Err(Fault::Fatal(NakCode::RemoteOperationalError, None));
                    }
                }
            }
        } else {
            None
        };
        if let Some(iova) = iova {
            self.post_dma_write(env, ready, iova, pkt.payload, qp.qpn);
        }
        qp.resp.epsn = qp.resp.epsn.add(1);
        qp.resp.write = (!op.is_last()).then(|| WriteCtx {
            rkey,
            va: va.wrapping_add(n as u64),
            remaining: remaining - n,
            total,
        });
        if op.is_last() {
            qp.resp.msn = qp.resp.msn.wrapping_add(1);
            let c = qp.cntrs;
            self.qp_count(env, &c, CntrEvents::REMOTE_WRITE, true, ready);
            self.mr_count(env, rkey, CntrEvents::REMOTE_WRITE, ready);
            if let Some((index, srqn, sges)) = recv {
                let rc = RecvCtx {
                    wqe_index: index,
                    srqn,
                    sges,
                    offset: 0,
                    strip: 0,
                    tm: None,
                };
                let mut cqe = recv_cqe(qp.qpn, &rc, CqeStatus::Success, total);
                cqe.opcode = CqeOpcode::RecvRdmaWithImm as u8;
                cqe.flags |= CQE_FLAG_IMM
                    | if pkt.repr.bth.solicited {
                        CQE_FLAG_SOLICITED
                    } else {
                        0
                    };
                cqe.imm = pkt.repr.imm.unwrap_or(0).into();
                let cqn = qp.recv_cqn;
                self.complete(env, qp.gen, cqn, ready, cqe);
            }
        }
        if pkt.repr.bth.ack_req {
            self.send_ack(
                env,
                qp,
                pkt.repr.bth.psn,
                AethSyndrome::Ack { credits: 0x1F },
                ready,
            );
        }
        Ok(())
    }

    /// IBTA 1.5 ATOMIC WRITE (ABI 1.10): 8 bytes to a naturally aligned address the R_Key
    /// allows writing, stored whole: an RDMA WRITE_ONLY of exactly 8 aligned bytes, which
    /// [`Nic::rx_write`] checks and executes. Another length or a misaligned address is an
    /// invalid request; a duplicate is acknowledged without being written again (as any
    /// duplicate WRITE).
    fn rx_atomic_write(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        ready: SimTime,
    ) -> Result<(), Fault> {
        let whole = pkt
            .repr
            .reth
            .is_some_and(|r| r.len == 8 && r.va.is_multiple_of(8));
        if !whole || pkt.payload.len() != 8 {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        }
        self.rx_write(env, qp, pkt, Opcode::WriteOnly, ready)
    }

    fn rx_read(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        ready: SimTime,
    ) -> Result<(), Fault> {
        if qp.resp.recv.is_some() || qp.resp.write.is_some() {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        }
        let Some(reth) = pkt.repr.reth else {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        };
        if !qp.access().contains(Access::REMOTE_READ)
            || reth.len > self.cfg.max_msg_size
            || qp.attr.max_dest_rd_atomic == 0
        {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        }
        self.check_rkey(
            qp.pdn,
            qp.qpn,
            reth.rkey,
            reth.va,
            reth.len as u64,
            Access::REMOTE_READ,
        )
        .map_err(|_| Fault::Fatal(NakCode::RemoteAccessError, None))?;
        let first = pkt.repr.bth.psn;
        let n = reth.len.div_ceil(qp.mtu()).max(1);
        qp.resp.epsn = first.add(n);
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        self.remember(
            qp,
            Resource::Read {
                first,
                last: first.add(n - 1),
                va: reth.va,
                rkey: reth.rkey,
                pdn: qp.pdn,
                len: reth.len,
            },
        );
        let not_before = self.after_posted_writes(ready);
        if not_before > ready {
            trace(env, || {
                TraceEvent::new(Stage::RespWait, ready, not_before)
                    .qpn(qp.qpn)
                    .psn(first.get())
            });
        }
        let msn = qp.resp.msn;
        let c = qp.cntrs;
        self.qp_count(env, &c, CntrEvents::REMOTE_READ, true, ready);
        self.mr_count(env, reth.rkey, CntrEvents::REMOTE_READ, ready);
        self.queue_reply(
            env,
            qp,
            Reply::Read {
                first,
                va: reth.va,
                rkey: reth.rkey,
                pdn: qp.pdn,
                len: reth.len,
                next: 0,
                msn,
                not_before,
            },
        );
        Ok(())
    }

    fn rx_atomic(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        op: Opcode,
        ready: SimTime,
    ) -> Result<(), Fault> {
        if qp.resp.recv.is_some() || qp.resp.write.is_some() {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        }
        let Some(a) = pkt.repr.atomic_eth else {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        };
        if !qp.access().contains(Access::REMOTE_ATOMIC)
            || a.va % 8 != 0
            || qp.attr.max_dest_rd_atomic == 0
        {
            return Err(Fault::Fatal(NakCode::InvalidRequest, None));
        }
        let iova = self
            .check_rkey(qp.pdn, qp.qpn, a.rkey, a.va, 8, Access::REMOTE_ATOMIC)
            .map_err(|_| Fault::Fatal(NakCode::RemoteAccessError, None))?;
        let psn = pkt.repr.bth.psn;
        qp.resp.epsn = qp.resp.epsn.add(1);
        qp.resp.msn = qp.resp.msn.wrapping_add(1);
        let request = (op as u8, a.va, a.rkey, a.swap_add, a.compare);
        self.remember(
            qp,
            Resource::Atomic {
                psn,
                orig: None,
                request,
            },
        );
        let not_before = self.after_posted_writes(ready);
        if not_before > ready {
            trace(env, || {
                TraceEvent::new(Stage::RespWait, ready, not_before)
                    .qpn(qp.qpn)
                    .psn(psn.get())
            });
        }
        let reply = Reply::Atomic {
            psn,
            iova,
            cas: op == Opcode::CompareSwap,
            swap_add: a.swap_add,
            compare: a.compare,
            msn: qp.resp.msn,
            not_before,
            result: None,
        };
        self.queue_reply(env, qp, reply);
        // The atomic itself runs as soon as the writes before it have landed, so writes
        // arriving after it cannot slip in while its answer waits behind READ responses.
        env.schedule(
            not_before,
            NicEvent::AtomicExec {
                qpn: qp.qpn,
                gen: qp.gen,
                psn,
            },
        );

        Ok(())
    }

    /// Keeps a READ/atomic for duplicates; the oldest is forgotten beyond `max_dest_rd_atomic`.
    pub(crate) fn remember(&mut self, qp: &mut Qp, r: Resource) {
        let cap = (qp.attr.max_dest_rd_atomic as usize).max(1);
        while qp.resp.resources.len() >= cap {
            qp.resp.resources.pop_front();
        }
        qp.resp.resources.push_back(r);
    }

    /// A request behind the expected PSN. SEND/WRITE are acknowledged again and never
    /// executed twice; a READ is read again from memory (its rkey checked again); an atomic is
    /// answered with the value saved when it ran. Anything not remembered is dropped.
    fn duplicate_request(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        pkt: &Packet<'_>,
        ready: SimTime,
    ) {
        let psn = pkt.repr.bth.psn;
        let msn = qp.resp.msn;
        match Opcode::from_u8(pkt.repr.bth.opcode) {
            Some(Opcode::ReadRequest) => {
                let Some(reth) = pkt.repr.reth else { return };
                let mtu = qp.mtu() as u64;
                let found = qp.resp.resources.iter().find_map(|r| match *r {
                    Resource::Read {
                        first,
                        last,
                        va,
                        rkey,
                        pdn,
                        len,
                    } if psn.diff(first) >= 0 && last.diff(psn) >= 0 && rkey == reth.rkey => {
                        // The request must ask for what the original's remaining responses
                        // carried: the same bytes from this PSN on, or fewer.
                        let skip = psn.diff(first) as u64 * mtu;
                        let ok = reth.va == va.wrapping_add(skip)
                            && reth.len as u64 <= (len as u64).saturating_sub(skip);
                        ok.then_some(pdn)
                    }
                    _ => None,
                });
                if let Some(pdn) = found {
                    qp.stats.read_replays += 1;
                    let not_before = self.after_posted_writes(ready);
                    self.queue_reply(
                        env,
                        qp,
                        Reply::Read {
                            first: psn,
                            va: reth.va,
                            rkey: reth.rkey,
                            pdn,
                            len: reth.len,
                            next: 0,
                            msn,
                            not_before,
                        },
                    );
                }
            }
            Some(Opcode::CompareSwap | Opcode::FetchAdd) => {
                // The same PSN with other operands is not a duplicate: it is dropped.
                let request = pkt
                    .repr
                    .atomic_eth
                    .map(|a| (pkt.repr.bth.opcode, a.va, a.rkey, a.swap_add, a.compare));
                let saved = qp.resp.resources.iter().find_map(|r| match *r {
                    Resource::Atomic {
                        psn: p,
                        orig,
                        request: q,
                    } if p == psn && Some(q) == request => Some(orig),
                    _ => None,
                });
                // Not executed yet: its answer is still to come.
                if let Some(Some(orig)) = saved {
                    qp.stats.atomic_replays += 1;
                    self.queue_reply(env, qp, Reply::AtomicReplay { psn, orig, msn });
                }
            }
            Some(op) if op.is_request() => {
                let last = qp.resp.epsn.add(Psn::MASK);
                self.send_ack(env, qp, last, AethSyndrome::Ack { credits: 0x1F }, ready);
            }
            _ => {}
        }
    }

    /// Queues a response and makes sure the responder engine runs.
    fn queue_reply(&mut self, env: &mut dyn Env, qp: &mut Qp, reply: Reply) {
        qp.resp.queue.push_back(reply);
        if !qp.resp.engine_scheduled {
            qp.resp.engine_scheduled = true;
            let at = env.now();
            env.schedule(
                at,
                NicEvent::Respond {
                    qpn: qp.qpn,
                    gen: qp.gen,
                },
            );
        }
    }

    /// The responder engine: sends what the head of the queue owes (one READ response packet
    /// at a time, a few frames ahead of the wire), then reschedules itself.
    pub(crate) fn respond(&mut self, env: &mut dyn Env, qpn: u32) {
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        qp.resp.engine_scheduled = false;
        let again = self.respond_one(env, &mut qp);
        if let Some(at) = again {
            if !qp.resp.engine_scheduled {
                qp.resp.engine_scheduled = true;
                env.schedule(at, NicEvent::Respond { qpn, gen: qp.gen });
            }
        }
        self.qps.restore(qpn, qp);
    }

    fn respond_one(&mut self, env: &mut dyn Env, qp: &mut Qp) -> Option<SimTime> {
        let now = env.now();
        if !matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            qp.resp.queue.clear();
            return None;
        }
        let front = qp.resp.queue.front()?.clone();
        let t = &self.cfg.timing;
        let (rtt, extra) = (t.dma_read_rtt_ps, t.nic_read_resp_extra_ps);
        match front {
            Reply::Read { not_before, .. } | Reply::Atomic { not_before, .. }
                if not_before > now =>
            {
                return Some(not_before)
            }
            Reply::Read {
                first,
                va,
                rkey,
                pdn,
                len,
                next,
                msn,
                ..
            } => {
                let mtu = qp.mtu();
                let n = len.div_ceil(mtu).max(1);
                let off = next as u64 * mtu as u64;
                let plen = (len as u64 - off.min(len as u64)).min(mtu as u64) as usize;
                // The MR is looked up again for every packet: it may be gone by now.
                let iova = if plen > 0 {
                    match self.check_rkey(
                        pdn,
                        qp.qpn,
                        rkey,
                        va.wrapping_add(off),
                        plen as u64,
                        Access::REMOTE_READ,
                    ) {
                        Ok(iova) => Some(iova),
                        Err(_) => {
                            qp.resp.queue.pop_front();
                            self.fatal_now(env, qp, first.add(next), NakCode::RemoteAccessError);
                            return None;
                        }
                    }
                } else {
                    None
                };
                let mut payload = std::mem::take(&mut self.scratch);
                crate::requester::scratch_len(&mut payload, plen);
                if iova.is_none() {
                    payload.fill(0);
                }
                if let Some(iova) = iova {
                    if let Err(f) = self.dm.read(env, iova, &mut payload) {
                        self.scratch = payload;
                        self.iommu_fault(env, qp.qpn, f.iova);
                        qp.resp.queue.pop_front();
                        self.fatal_now(env, qp, first.add(next), NakCode::RemoteOperationalError);
                        return None;
                    }
                }
                let opcode = match (next == 0, next + 1 == n) {
                    (true, true) => Opcode::ReadResponseOnly,
                    (true, false) => Opcode::ReadResponseFirst,
                    (false, false) => Opcode::ReadResponseMiddle,
                    (false, true) => Opcode::ReadResponseLast,
                };
                let mut repr = self.packet_repr(qp, opcode, first.add(next), false);
                if opcode.has_aeth() {
                    repr.aeth = Some(Aeth {
                        syndrome: AethSyndrome::Ack { credits: 0x1F },
                        msn: msn & 0x00FF_FFFF,
                    });
                }
                // The first packet pays the DMA read round trip and the response set-up;
                // later ones stream behind it.
                let from = if next == 0 {
                    now + SimTime(rtt + extra)
                } else {
                    now
                };
                let start = from.max(self.pcie_read_free);
                let at = self.reserve_pcie_read(from, plen);
                if env.tracing() {
                    let psn = first.add(next).get();
                    let ev = |s, a, b| TraceEvent::new(s, a, b).qpn(qp.qpn).psn(psn);
                    if next == 0 {
                        env.trace(ev(Stage::ReadRespSetup, now, from).bytes(len as usize));
                    }
                    if plen > 0 {
                        env.trace(ev(Stage::PayloadRead, start, at).bytes(plen));
                    }
                }
                self.emit(env, qp.qpn, &repr, &payload, at);
                self.scratch = payload;
                if next + 1 < n {
                    if let Some(Reply::Read { next: nx, .. }) = qp.resp.queue.front_mut() {
                        *nx += 1;
                    }
                } else {
                    qp.resp.queue.pop_front();
                }
            }
            Reply::Atomic {
                psn, msn, result, ..
            } => {
                let result = match result {
                    Some(r) => r,
                    None => self.execute_atomic(env, qp, 0)?,
                };
                qp.resp.queue.pop_front();
                match result {
                    Ok(orig) => {
                        trace(env, || {
                            TraceEvent::new(Stage::AtomicFetch, now, now + SimTime(rtt))
                                .qpn(qp.qpn)
                                .psn(psn.get())
                                .bytes(8)
                        });
                        self.emit_atomic_ack(env, qp, psn, orig, msn, now + SimTime(rtt))
                    }
                    Err(iova) => {
                        self.iommu_fault(env, qp.qpn, iova);
                        self.fatal_now(env, qp, psn, NakCode::RemoteOperationalError);
                        return None;
                    }
                }
            }
            Reply::AtomicReplay { psn, orig, msn } => {
                qp.resp.queue.pop_front();
                self.emit_atomic_ack(env, qp, psn, orig, msn, now);
            }
            Reply::Ack { psn, syndrome, msn } => {
                qp.resp.queue.pop_front();
                self.emit_ack(env, qp, psn, syndrome, msn, now);
            }
            Reply::Fatal { psn, code, status } => {
                qp.resp.queue.pop_front();
                self.responder_fatal(env, qp, psn, code, status, now);
                return None;
            }
        }
        if qp.resp.queue.is_empty() {
            None
        } else {
            Some(now.max(self.egress_free - SimTime(2_000_000)))
        }
    }

    /// Runs the atomic `psn` of a responder QP (the `AtomicExec` event).
    pub(crate) fn atomic_exec(&mut self, env: &mut dyn Env, qpn: u32, psn: Psn) {
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        let pos = qp
            .resp
            .queue
            .iter()
            .position(|r| matches!(r, Reply::Atomic { psn: p, result: None, .. } if *p == psn));
        if let Some(i) = pos {
            self.execute_atomic(env, &mut qp, i);
        }
        self.qps.restore(qpn, qp);
    }

    /// Executes the (not yet executed) atomic at queue position `i` and records its result in
    /// the queue and in the responder resources.
    fn execute_atomic(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        i: usize,
    ) -> Option<Result<u64, u64>> {
        let Some(Reply::Atomic {
            psn,
            iova,
            cas,
            swap_add,
            compare,
            result,
            ..
        }) = qp.resp.queue.get_mut(i)
        else {
            return None;
        };
        let mut cur = [0u8; 8];
        let dm = &mut self.dm;
        let r = dm
            .read(env, *iova, &mut cur)
            .and_then(|_| {
                let orig = u64::from_le_bytes(cur);
                let new = match (*cas, orig == *compare) {
                    (true, true) => *swap_add,
                    (true, false) => orig,
                    (false, _) => orig.wrapping_add(*swap_add),
                };
                dm.write(env, *iova, &new.to_le_bytes()).map(|_| orig)
            })
            .map_err(|f| f.iova);
        *result = Some(r);
        let psn = *psn;
        if let Ok(orig) = r {
            let mut rkey = None;
            for res in qp.resp.resources.iter_mut() {
                if let Resource::Atomic {
                    psn: p,
                    orig: o,
                    request,
                } = res
                {
                    if *p == psn {
                        *o = Some(orig);
                        rkey = Some(request.2);
                    }
                }
            }
            // Counted once it has executed; one that faults is NAKed and counts nothing.
            let (c, now) = (qp.cntrs, env.now());
            self.qp_count(env, &c, CntrEvents::REMOTE_WRITE, true, now);
            if let Some(rkey) = rkey {
                self.mr_count(env, rkey, CntrEvents::REMOTE_WRITE, now);
            }
        }
        Some(r)
    }

    fn emit_atomic_ack(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        psn: Psn,
        orig: u64,
        msn: u32,
        at: SimTime,
    ) {
        let mut repr = self.packet_repr(qp, Opcode::AtomicAcknowledge, psn, false);
        repr.aeth = Some(Aeth {
            syndrome: AethSyndrome::Ack { credits: 0x1F },
            msn: msn & 0x00FF_FFFF,
        });
        repr.atomic_ack = Some(orig);
        self.emit(env, qp.qpn, &repr, &[], at);
    }

    /// A fatal error found while answering: NAK it and move to ERR at once.
    fn fatal_now(&mut self, env: &mut dyn Env, qp: &mut Qp, psn: Psn, code: NakCode) {
        let now = env.now();
        qp.resp.queue.clear();
        self.responder_fatal(env, qp, psn, code, None, now);
    }
}

/// A receive-side CQE for receive WQE `rc`.
pub(crate) fn recv_cqe(qpn: u32, rc: &RecvCtx, status: CqeStatus, byte_len: u32) -> Cqe {
    Cqe {
        opcode: CqeOpcode::Recv as u8,
        status: status as u8,
        wqe_counter: (rc.wqe_index as u16).into(),
        qpn: qpn.into(),
        byte_len: byte_len.into(),
        flags: if rc.srqn != 0 { CQE_FLAG_SRQ } else { 0 },
        srqn: rc.srqn.into(),
        ..Default::default()
    }
}
