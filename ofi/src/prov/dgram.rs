//! Datagram endpoints (`FI_EP_DGRAM`): unreliable, unconnected messages, each at most one
//! packet, over one UD QP per endpoint. Nothing is connected: a send names its peer through
//! the AV, and goes out with an address handle (one per peer NIC, kept) and the peer's QP
//! number.
//!
//! A datagram endpoint's address is its NIC's IPv4 address and a service number that
//! carries its QP number ([`DGRAM_SERVICE`] set): the name `fi_getname` gives is enough to
//! reach it. One opened on a service number of the application's choosing (`FI_SOURCE`) is
//! published under that number with its QP number ([`names`](super::names)), so that an
//! address made of this host's IPv4 address and the number reaches it too.
//!
//! A receive's buffers follow a 40-byte area of the provider's where the NIC puts the GRH
//! (no `FI_MSG_PREFIX`); a datagram longer than a receive's buffers, or one arriving with no
//! receive posted, is dropped by the NIC, as on any UD QP, and nobody is told.

use super::*;
use ringbell::{AddressHandle, QpType, RecvWr, UdDest};

/// The Q_Key of every datagram endpoint.
pub const QKEY: u32 = 0x5242_0001;
/// Service numbers of datagram endpoints: this bit and the QP number in the low 24 bits.
pub const DGRAM_SERVICE: u64 = 1 << 62;
/// Bytes at the head of every UD receive that the NIC fills with the GRH area.
const GRH: u64 = ringbell::GRH_LEN as u64;
/// Depth of a datagram endpoint's send and receive queues.
const DEPTH: u32 = 1024;

/// A datagram endpoint's QP and the address handles it made, by peer IPv4 address.
pub struct Dgram {
    pub(super) qp: QueuePair,
    ahs: HashMap<[u8; 4], AddressHandle>,
}

impl State {
    /// The UD QP (in ready-to-send state) and CQ of a new datagram endpoint in domain
    /// `dom`.
    pub(super) fn dgram_open(&mut self, dom: usize) -> Result<(Dgram, CompletionQueue), Errno> {
        let d = self.domain(dom)?;
        let dev = d.pd.device();
        let cq = dev.create_cq(2 * DEPTH).map_err(|_| abi::FI_ENOMEM)?;
        let qp = ud_qp(d, &cq, None)?;
        Ok((
            Dgram {
                qp,
                ahs: HashMap::new(),
            },
            cq,
        ))
    }

    /// Where a datagram to `peer` goes: the peer NIC's IPv4 address and the QP number. An
    /// address whose service is not a datagram endpoint's is looked up among the names of
    /// this fabric; none there is `-FI_EHOSTUNREACH`.
    fn dgram_dest(peer: &Addr) -> Result<([u8; 4], u32), Errno> {
        let (ip, service) = parse_addr(peer).ok_or(EINVAL)?;
        if service & DGRAM_SERVICE != 0 {
            return Ok((ip, (service & 0xFF_FFFF) as u32));
        }
        match names::resolve_full(service) {
            Some((nic, Some(qpn))) => Ok((AhAttr::on_fabric(ip).map_or(nic_ip(nic), |_| ip), qpn)),
            _ => Err(abi::FI_EHOSTUNREACH),
        }
    }

    /// Sends one datagram of endpoint `ep` to `peer` (its AV's address): `p`'s data (SGEs or
    /// inline bytes) and immediate, completing as operation `op`.
    pub(super) fn dgram_send(
        &mut self,
        ep: usize,
        peer: &Addr,
        p: Pending,
        op: Op,
    ) -> Result<(), Errno> {
        let (ip, qpn) = Self::dgram_dest(peer)?;
        let attr = AhAttr::on_fabric(ip).ok_or(abi::FI_EHOSTUNREACH)?;
        let dom = self.objs_ep(ep)?.domain;
        let known = match &self.objs_ep(ep)?.dgram {
            Some(g) => g.ahs.get(&ip).cloned(),
            None => return Err(EINVAL),
        };
        let ah = match known {
            Some(ah) => ah,
            None => self
                .domain(dom)?
                .pd
                .create_ah(&attr)
                .map_err(|_| abi::FI_EHOSTUNREACH)?,
        };
        let e = self.ep_mut(ep)?;
        let g = e.dgram.as_mut().ok_or(EINVAL)?;
        let wr_op = match p.imm {
            Some(i) => WrOp::SendImm(i),
            None => WrOp::Send,
        };
        let to = UdDest {
            ah: &ah,
            qpn,
            qkey: QKEY,
        };
        let wr = match &p.inline {
            Some(d) => SendWr::inline(p.wr_id, wr_op, d),
            None => SendWr::new(p.wr_id, wr_op, &p.sges),
        };
        g.qp.post_send(&[wr.to(to).flags(ringbell::SendFlags::SIGNALED)])
            .map_err(|_| EAGAIN)?;
        g.ahs.entry(ip).or_insert(ah);
        e.ops.insert(p.wr_id, op);
        Ok(())
    }

    /// The AV index of the endpoint a datagram of endpoint `ep` came from (`fi_cq_readfrom`),
    /// or `FI_ADDR_NOTAVAIL` when its AV holds no address of it.
    pub(super) fn dgram_source(&self, ep: usize, w: &WorkCompletion) -> u64 {
        let Some(from) = w.source else {
            return ADDR_UNSPEC;
        };
        let Some(Obj::Av(av)) = self
            .objs_ep(ep)
            .ok()
            .and_then(|e| e.av)
            .and_then(|k| self.objs.get(&k))
        else {
            return ADDR_UNSPEC;
        };
        let is = |a: &Addr, named: bool| {
            let unnamed = parse_addr(a).is_some_and(|(_, s)| s & DGRAM_SERVICE != 0);
            // Addresses that carry their QP number first; a named one costs a look-up.
            unnamed != named && Self::dgram_dest(a).is_ok_and(|d| d == (from.ip, from.qpn))
        };
        [false, true]
            .into_iter()
            .find_map(|named| av.position(|a| is(a, named)))
            .map_or(ADDR_UNSPEC, |i| i as u64)
    }

    /// Posts a receive of endpoint `ep` over `sges` (the caller's buffers), behind the
    /// domain's scratch area `grh` that takes the GRH.
    /// `fi_ep_bind` of datagram endpoint `ep` (not enabled yet) to shared receive context
    /// `srx`: its UD QP is made anew on the context's SRQ (UD QPs take receives from an
    /// SRQ like RC QPs, ABI 18.7), so its address, which carries the QP number, changes
    /// (`fi_getname` after the bind gives the new one). A context that took receives or
    /// endpoints of another type is `-FI_EINVAL`.
    pub fn dgram_bind_srx(&mut self, ep: usize, srx: usize) -> Result<(), Errno> {
        let x = self.objs_ep(srx)?;
        if x.srx_dgram == Some(false) {
            return Err(EINVAL);
        }
        let srq = x.srq.as_ref().ok_or(EINVAL)?;
        let e = self.objs_ep(ep)?;
        let cq = e.cq.as_ref().ok_or(EINVAL)?;
        let qp = ud_qp(self.domain(e.domain)?, cq, Some(srq))?;
        let qpn = qp.qpn();
        let e = self.ep_mut(ep)?;
        if let Some(g) = e.dgram.as_mut() {
            g.qp = qp;
        }
        e.rx_shared = Some(srx);
        // The number that carries the QP number follows it; a claimed one is published
        // anew with it (a number of the application's is published when enabled).
        if e.service & DGRAM_SERVICE != 0 && !e.named && !e.claimed {
            e.service = DGRAM_SERVICE | u64::from(qpn);
            e.addr = make_addr([e.addr[4], e.addr[5], e.addr[6], e.addr[7]], e.service);
        } else if e.claimed {
            names::publish(e.service, e.nic, Some(qpn));
        }
        self.ep_mut(srx)?.srx_dgram = Some(true);
        Ok(())
    }

    pub(super) fn dgram_recv(
        &mut self,
        ep: usize,
        grh: Sge,
        sges: &[Sge],
        op: Op,
    ) -> Result<(), Errno> {
        let e = self.ep_mut(ep)?;
        let wr_id = e.next_wr;
        e.next_wr += 1;
        let mut sgl = Vec::with_capacity(sges.len() + 1);
        sgl.push(Sge {
            len: GRH as u32,
            ..grh
        });
        sgl.extend_from_slice(sges);
        // The endpoint's QP, or a shared receive context's SRQ.
        let posted = match (e.dgram.as_mut(), e.srq.as_mut()) {
            (Some(g), _) => g.qp.post_recv(&[RecvWr { wr_id, sgl: &sgl }]),
            (None, Some(srq)) if e.srx => srq.post_recv(&[RecvWr { wr_id, sgl: &sgl }]),
            _ => return Err(EINVAL),
        };
        posted.map_err(|_| EAGAIN)?;
        e.ops.insert(wr_id, op);
        Ok(())
    }
}

/// A UD QP of domain `d` (ready to send) completing on `cq`, taking its receives from
/// `srq` when given.
fn ud_qp(
    d: &Domain,
    cq: &CompletionQueue,
    srq: Option<&SharedReceiveQueue>,
) -> Result<QueuePair, Errno> {
    let mut init = QpInit::new(cq, cq);
    init.qp_type = QpType::Ud;
    init.srq = srq;
    init.max_send_wr = DEPTH;
    init.max_recv_wr = DEPTH;
    init.max_send_sge = crate::info::IOV_LIMIT as u32;
    // The GRH area, then the caller's buffers.
    init.max_recv_sge = crate::info::IOV_LIMIT as u32 + 1;
    init.max_inline = ringbell_specs::wqe::MAX_INLINE_UD as u32;
    let mut qp = d.pd.create_qp(&init).map_err(|e| {
        eprintln!("ringbell-fi: creating a UD QP: {e}");
        abi::FI_ENOMEM
    })?;
    qp.ud_ready(QKEY, 0).map_err(|_| abi::FI_ENOMEM)?;
    Ok(qp)
}

/// The payload bytes of a datagram receive that completed with `byte_len` (the GRH area
/// counted in it).
pub(super) fn payload_len(byte_len: u32) -> u64 {
    u64::from(byte_len).saturating_sub(GRH)
}
