//! Raw packet QPs and flow steering (ABI 1.12).
//!
//! A raw packet QP's send WQE carries a whole Ethernet frame, which the NIC puts on the
//! wire as it is (no RoCE headers, no acknowledgement; the WQE completes once the frame has
//! left). Frames that are not RoCEv2 go through the NIC's flow-steering rules: the rule
//! that matches with the lowest priority (then the oldest) gives the frame to its raw
//! packet QP, whose next receive WQE takes it whole. A frame no rule matches is dropped.

use crate::env::Env;
use crate::nic::Nic;
use crate::qp::Qp;
use ringbell_specs::cmd::{
    mcast_group, toeplitz, CmdStatus, CreateFlowIn, CreateWqIn, FlowMatch, McastIn, ModifyWqIn,
    ObjectOut, QpState, SetQpRssIn, MCAST_QPN, RSS_DST_IPV4, RSS_DST_IPV6, RSS_DST_PORT_TCP,
    RSS_DST_PORT_UDP, RSS_MAX_LOG_SIZE, RSS_SRC_IPV4, RSS_SRC_IPV6, RSS_SRC_PORT_TCP,
    RSS_SRC_PORT_UDP, WQ_STATE_ERR, WQ_STATE_READY, WQ_STATE_RESET,
};
use ringbell_specs::cqe::{CqeStatus, VendorSyndrome};
use ringbell_specs::wire;
use ringbell_specs::SimTime;
use zerocopy::FromBytes;

/// Flow-steering rules per NIC.
pub const MAX_FLOWS: u32 = 1024;
/// Multicast attachments (group, QP) per NIC.
pub const MAX_MCAST: u32 = ringbell_specs::cmd::MAX_MCAST_ATTACH;

/// One flow-steering rule.
#[derive(Debug)]
pub(crate) struct Flow {
    pub(crate) qpn: u32,
    pub(crate) priority: u16,
    /// Creation order: of rules of one priority, the oldest wins.
    pub(crate) seq: u64,
    /// Already masked.
    pub(crate) value: FlowMatch,
    pub(crate) mask: FlowMatch,
}

/// A raw packet QP's RSS table (ABI 1.12).
#[derive(Debug)]
pub(crate) struct Rss {
    fields: u32,
    key: [u8; 40],
    key_len: usize,
    /// Receive WQ numbers.
    table: Vec<u32>,
}

impl Rss {
    /// The WQ a frame of these fields goes to.
    fn wq_for(&self, m: &FlowMatch) -> u32 {
        let mut input = [0u8; 36];
        let mut n = 0;
        let mut put = |b: &[u8]| {
            input[n..n + b.len()].copy_from_slice(b);
            n += b.len();
        };
        let (src, dst) = match m.ethertype.get() {
            0x0800 => (
                (RSS_SRC_IPV4, &m.src_ip[12..]),
                (RSS_DST_IPV4, &m.dst_ip[12..]),
            ),
            0x86DD => ((RSS_SRC_IPV6, &m.src_ip[..]), (RSS_DST_IPV6, &m.dst_ip[..])),
            _ => ((0, &[][..]), (0, &[][..])),
        };
        for (bit, bytes) in [src, dst] {
            if bit != 0 && self.fields & bit != 0 {
                put(bytes);
            }
        }
        let ports = match m.ip_proto {
            6 => (RSS_SRC_PORT_TCP, RSS_DST_PORT_TCP),
            17 => (RSS_SRC_PORT_UDP, RSS_DST_PORT_UDP),
            _ => (0, 0),
        };
        if ports.0 != 0 && self.fields & ports.0 != 0 {
            put(&m.src_port.get().to_be_bytes());
        }
        if ports.1 != 0 && self.fields & ports.1 != 0 {
            put(&m.dst_port.get().to_be_bytes());
        }
        let hash = toeplitz(&self.key[..self.key_len], &input[..n]);
        self.table[hash as usize & (self.table.len() - 1)]
    }
}

impl Nic {
    /// CREATE_FLOW: a rule for raw packet QP `qpn` in RTR or any earlier state.
    pub(crate) fn create_flow(&mut self, p: CreateFlowIn) -> Result<u32, CmdStatus> {
        let qpn = p.qpn.get();
        let qp = self.qps.get_mut(qpn).ok_or(CmdStatus::BadResource)?;
        if !qp.raw {
            return Err(CmdStatus::BadParam);
        }
        if p.rsvd0.get() != 0 || p.value.rsvd0 != 0 || p.mask.rsvd0 != 0 {
            return Err(CmdStatus::BadParam);
        }
        let mut value = p.value;
        for (v, m) in zerocopy::IntoBytes::as_mut_bytes(&mut value)
            .iter_mut()
            .zip(zerocopy::IntoBytes::as_bytes(&p.mask))
        {
            *v &= m;
        }
        self.flow_seq += 1;
        let flow = Flow {
            qpn,
            priority: p.priority.get(),
            seq: self.flow_seq,
            value,
            mask: p.mask,
        };
        let n = self
            .flows
            .insert_with(|_| flow)
            .ok_or(CmdStatus::Exhausted)?;
        qp.flows += 1;
        self.flows_live += 1;
        Ok(n)
    }

    /// DESTROY_FLOW.
    pub(crate) fn destroy_flow(&mut self, n: u32) -> Result<(), CmdStatus> {
        let f = self.flows.remove(n).ok_or(CmdStatus::BadResource)?;
        self.flows_live -= 1;
        if let Some(qp) = self.qps.get_mut(f.qpn) {
            qp.flows = qp.flows.saturating_sub(1);
        }
        Ok(())
    }

    /// CREATE_WQ: an SRQ whose receives complete on its own CQ, in RESET.
    pub(crate) fn create_wq(&mut self, p: CreateWqIn) -> crate::cmd::Outcome {
        let cqn = p.cqn.get();
        if self.cqs.get(cqn).is_none() {
            return Err(CmdStatus::BadResource);
        }
        if p.rsvd0.get() != 0 {
            return Err(CmdStatus::BadParam);
        }
        let out = self.create_srq(p.srq, None, Some((0, cqn)))?;
        let n = ObjectOut::read_from_prefix(&out).map_or(0, |(o, _)| o.num.get());
        if let Some(s) = self.srqs.get_mut(n) {
            s.wq_state = WQ_STATE_RESET;
        }
        if let Some(cq) = self.cqs.get_mut(cqn) {
            cq.refs += 1;
        }
        Ok(out)
    }

    /// MODIFY_WQ.
    pub(crate) fn modify_wq(&mut self, p: ModifyWqIn) -> Result<(), CmdStatus> {
        let s = self
            .srqs
            .get_mut(p.wqn.get())
            .filter(|s| matches!(s.xrc, Some((0, _))))
            .ok_or(CmdStatus::BadResource)?;
        if !matches!(p.state, WQ_STATE_RESET | WQ_STATE_READY | WQ_STATE_ERR) {
            return Err(CmdStatus::BadParam);
        }
        s.wq_state = p.state;
        Ok(())
    }

    /// SET_QP_RSS: a raw packet QP in RESET takes an indirection table of receive WQs.
    pub(crate) fn set_qp_rss(&mut self, env: &mut dyn Env, p: SetQpRssIn) -> Result<(), CmdStatus> {
        let qpn = p.qpn.get();
        let qp = self.qps.get(qpn).ok_or(CmdStatus::BadResource)?;
        if !qp.raw || qp.rss.is_some() || qp.state != QpState::Reset {
            return Err(CmdStatus::BadState);
        }
        let known = RSS_SRC_IPV4
            | RSS_DST_IPV4
            | RSS_SRC_IPV6
            | RSS_DST_IPV6
            | RSS_SRC_PORT_TCP
            | RSS_DST_PORT_TCP
            | RSS_SRC_PORT_UDP
            | RSS_DST_PORT_UDP;
        if p.fields.get() & !known != 0
            || p.key_len > 40
            || p.log_size > RSS_MAX_LOG_SIZE
            || p.rsvd0.get() != 0
            || p.rsvd1.get() != 0
        {
            return Err(CmdStatus::BadParam);
        }
        let mut raw = vec![0u8; 4 << p.log_size];
        if env.dma_read(p.table_iova.get(), &mut raw).is_err() {
            return Err(CmdStatus::DmaFault);
        }
        let table: Vec<u32> = raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if table.iter().any(|&n| {
            !self
                .srqs
                .get(n)
                .is_some_and(|s| matches!(s.xrc, Some((0, _))))
        }) {
            return Err(CmdStatus::BadResource);
        }
        for &n in &table {
            if let Some(s) = self.srqs.get_mut(n) {
                s.refs += 1;
            }
        }
        let rss = Rss {
            fields: p.fields.get(),
            key: p.key_bytes(),
            key_len: p.key_len.into(),
            table,
        };
        if let Some(qp) = self.qps.get_mut(qpn) {
            qp.rss = Some(Box::new(rss));
        }
        Ok(())
    }

    /// Lets go of a QP's RSS table (DESTROY_QP).
    pub(crate) fn release_rss(&mut self, qp: &mut Qp) {
        for n in qp.rss.take().map(|r| r.table).unwrap_or_default() {
            if let Some(s) = self.srqs.get_mut(n) {
                s.refs = s.refs.saturating_sub(1);
            }
        }
    }

    /// ATTACH_MCAST: UD QP `qpn` receives the datagrams to the group (attaching it twice
    /// changes nothing).
    pub(crate) fn attach_mcast(&mut self, p: McastIn) -> Result<(), CmdStatus> {
        let qpn = p.qpn.get();
        let group = mcast_group(&p.gid).ok_or(CmdStatus::BadParam)?;
        let qp = self.qps.get_mut(qpn).ok_or(CmdStatus::BadResource)?;
        if !qp.ud || qpn == ringbell_specs::cmd::GSI_QPN || p.rsvd0.get() != 0 {
            return Err(CmdStatus::BadParam);
        }
        if self.mcast.contains(&(group, qpn)) {
            return Ok(());
        }
        if self.mcast.len() >= MAX_MCAST as usize {
            return Err(CmdStatus::Exhausted);
        }
        qp.flows += 1;
        self.mcast.push((group, qpn));
        Ok(())
    }

    /// DETACH_MCAST: `BAD_RESOURCE` when the QP is not attached to the group.
    pub(crate) fn detach_mcast(&mut self, p: McastIn) -> Result<(), CmdStatus> {
        let qpn = p.qpn.get();
        let group = mcast_group(&p.gid).ok_or(CmdStatus::BadParam)?;
        let at = self
            .mcast
            .iter()
            .position(|&m| m == (group, qpn))
            .ok_or(CmdStatus::BadResource)?;
        self.mcast.remove(at);
        if let Some(qp) = self.qps.get_mut(qpn) {
            qp.flows = qp.flows.saturating_sub(1);
        }
        Ok(())
    }

    /// A datagram to a multicast address: to every UD QP attached to its group (in RTR,
    /// RTS or SQD, with the default P_Key), each as its own datagram; its destination QPN
    /// must be the multicast QPN. Nothing attached: dropped.
    pub(crate) fn rx_multicast(&mut self, env: &mut dyn Env, pkt: &wire::Packet<'_>, frame: &[u8]) {
        let op = wire::Opcode::from_u8(pkt.repr.bth.opcode);
        let group = pkt.repr.dst.ip;
        if pkt.repr.bth.dest_qp.get() != MCAST_QPN
            || !op.is_some_and(wire::Opcode::is_ud)
            || pkt.repr.bth.pkey != 0xFFFF
        {
            self.stats.rx_dropped += 1;
            return;
        }
        let mut delivered = false;
        for i in 0..self.mcast.len() {
            let (g, qpn) = self.mcast[i];
            if g != group {
                continue;
            }
            let Some(mut qp) = self.qps.remove(qpn) else {
                continue;
            };
            if matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
                self.rx_datagram(env, &mut qp, pkt, frame);
                delivered = true;
            }
            self.qps.restore(qpn, qp);
        }
        if !delivered {
            self.stats.rx_dropped += 1;
        }
    }

    /// Whether a received frame is one for the flow-steering rules rather than the
    /// transport (never, while the NIC has no rules).
    pub(crate) fn steers(&self, frame: &[u8]) -> bool {
        self.flows_live > 0 && !wire::is_rocev2(frame)
    }

    /// A frame that is not RoCEv2 arrives: to the raw packet QP of the best matching rule.
    pub(crate) fn steer(&mut self, env: &mut dyn Env, frame: &[u8]) {
        let key = FlowMatch::of_frame(frame);
        let best = self
            .flows
            .iter()
            .filter(|(_, f)| key.matches(&f.value, &f.mask))
            .min_by_key(|(_, f)| (f.priority, f.seq))
            .map(|(_, f)| f.qpn);
        let Some(qpn) = best else {
            self.stats.rx_dropped += 1;
            return;
        };
        let Some(mut qp) = self.qps.remove(qpn) else {
            self.stats.rx_dropped += 1;
            return;
        };
        if let Some(rss) = &qp.rss {
            // An RSS QP has no state of its own that matters: the WQ the hash picks
            // receives the frame, when READY, and completes it on the WQ's CQ.
            let wqn = rss.wq_for(&key);
            match self.srqs.get(wqn) {
                Some(s) if s.wq_state == WQ_STATE_READY => {
                    let cqn = s.xrc.map_or(0, |(_, c)| c);
                    let saved = (qp.srqn, qp.pdn, qp.recv_cqn);
                    (qp.srqn, qp.pdn, qp.recv_cqn) = (wqn, s.pdn, cqn);
                    self.rx_raw(env, &mut qp, frame);
                    (qp.srqn, qp.pdn, qp.recv_cqn) = saved;
                }
                _ => self.stats.rx_dropped += 1,
            }
        } else if matches!(qp.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            self.rx_raw(env, &mut qp, frame);
        } else {
            self.stats.rx_dropped += 1;
        }
        self.qps.restore(qpn, qp);
    }

    /// A frame for raw packet QP `qp`: scattered whole into its next receive WQE. No WQE,
    /// or one too small, drops it (counted as the UD counters count datagrams).
    fn rx_raw(&mut self, env: &mut dyn Env, qp: &mut Qp, frame: &[u8]) {
        let ready = env.now() + SimTime(self.cfg.timing.nic_rx_pkt_ps);
        if let Some(cqe) = self.place_datagram(env, qp, &[frame], ready) {
            qp.ud_stats.received += 1;
            self.complete(env, qp.gen, qp.recv_cqn, ready, cqe);
        }
    }

    /// Sends outstanding WQE `i` of a raw packet QP: its gathered (or inline) bytes are the
    /// frame. It completes once the frame has left.
    pub(crate) fn send_raw(&mut self, env: &mut dyn Env, qp: &mut Qp, i: usize) {
        let now = env.now();
        let o = &qp.req.outstanding[i];
        let ready = o.ready_at.max(now);
        let w = &o.wqe;
        let len = w.len as usize;
        let mut frame = env.buffer();
        frame.clear();
        frame.resize(len, 0);
        let mut next_ready = ready;
        let gathered = if w.sges.is_empty() {
            let n = len.min(w.inline.len());
            frame[..n].copy_from_slice(&w.inline[..n]);
            Ok(())
        } else {
            next_ready = self.reserve_pcie_read(ready, len);
            let sges = w.sges.clone();
            self.gather(env, qp.qpn, qp.pdn, &sges, 0, &mut frame)
        };
        if let Err(e) = gathered {
            env.recycle(frame);
            qp.req.fail(i, e);
            self.complete_in_order(env, qp);
            return;
        }
        self.send_frame(env, next_ready, frame);
        self.sent_unacknowledged(env, qp, i);
    }
}

/// The check a raw packet QP's send WQE gets when it starts: a frame from an Ethernet
/// header to a jumbo frame.
pub(crate) fn raw_len_ok(len: u64) -> bool {
    (ringbell_specs::cmd::RAW_MIN_FRAME as u64..=ringbell_specs::cmd::RAW_MAX_FRAME as u64)
        .contains(&len)
}

/// Why a raw packet QP refuses a send opcode: it has SEND and the local operations only.
pub(crate) const RAW_BAD_OP: (CqeStatus, VendorSyndrome) =
    (CqeStatus::LocQpOpErr, VendorSyndrome::BadOpcode);
