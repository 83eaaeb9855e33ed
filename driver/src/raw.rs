//! Raw packet QPs and flow steering (ABI 1.12).
//!
//! A raw packet QP ([`QpType::RawPacket`](crate::QpType::RawPacket)) sends whole Ethernet
//! frames: a SEND's gather list (or inline data) is the frame, from the destination MAC
//! address to the end of the payload, without the FCS, 14 to 9,018 bytes. Nothing
//! acknowledges it; the send completes once the frame has left. It receives what a flow
//! rule ([`QueuePair::create_flow`]) steers to it: each frame whole, into the next receive
//! request. A frame to a multicast or broadcast address reaches every NIC of the fabric,
//! the sender's own included; a frame to the sender's own MAC address comes back to it.
//!
//! UD multicast (ABI 1.12) is here too: [`QueuePair::attach_mcast`].
//!
//! Set-up: RESET → INIT with the port ([`QueuePair::raw_ready`] does the three steps),
//! then INIT → RTR → RTS with no attributes.

use crate::cq::CompletionQueue;
use crate::device::Device;
use crate::error::Error;
use crate::mr::ProtectionDomain;
use crate::qp::QueuePair;
use crate::srq::SharedReceiveQueue;
use ringbell_specs::cmd::{
    CmdOpcode, CreateFlowIn, ModifyWqIn, QpAttr, QpAttrMask, QpState, SetQpRssIn, WQ_STATE_ERR,
    WQ_STATE_READY, WQ_STATE_RESET,
};
pub use ringbell_specs::cmd::{FlowMatch, RAW_MAX_FRAME, RAW_MIN_FRAME};
use ringbell_specs::regs;
use std::cell::RefCell;
use std::rc::Rc;
use zerocopy::IntoBytes;

/// What a flow rule matches: a frame's fields ([`FlowMatch::of_frame`]) that, under
/// `mask`, equal `value`. Of several rules that match a frame, the lowest `priority` wins,
/// then the oldest. The builder methods set a field's value and a full mask.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowRule {
    /// Lower wins.
    pub priority: u16,
    /// The fields' values (bits outside `mask` are ignored).
    pub value: FlowMatch,
    /// The bits compared.
    pub mask: FlowMatch,
}

impl FlowRule {
    /// Frames to destination MAC address `mac`.
    pub fn dst_mac(mut self, mac: [u8; 6]) -> Self {
        (self.value.dmac, self.mask.dmac) = (mac, [0xFF; 6]);
        self
    }
    /// Frames from source MAC address `mac`.
    pub fn src_mac(mut self, mac: [u8; 6]) -> Self {
        (self.value.smac, self.mask.smac) = (mac, [0xFF; 6]);
        self
    }
    /// Frames of EtherType `ty` (behind a VLAN tag, if the frame has one).
    pub fn ethertype(mut self, ty: u16) -> Self {
        (self.value.ethertype, self.mask.ethertype) = (ty.into(), 0xFFFF.into());
        self
    }
    /// IPv4 packets from `ip` (the EtherType is set too).
    pub fn ipv4_src(self, ip: [u8; 4]) -> Self {
        let mut r = self.ethertype(0x0800);
        (r.value.src_ip, r.mask.src_ip) = (mapped(ip), [0xFF; 16]);
        r
    }
    /// IPv4 packets to `ip` (the EtherType is set too).
    pub fn ipv4_dst(self, ip: [u8; 4]) -> Self {
        let mut r = self.ethertype(0x0800);
        (r.value.dst_ip, r.mask.dst_ip) = (mapped(ip), [0xFF; 16]);
        r
    }
    /// IPv6 packets from `ip` (the EtherType is set too).
    pub fn ipv6_src(self, ip: [u8; 16]) -> Self {
        let mut r = self.ethertype(0x86DD);
        (r.value.src_ip, r.mask.src_ip) = (ip, [0xFF; 16]);
        r
    }
    /// IPv6 packets to `ip` (the EtherType is set too).
    pub fn ipv6_dst(self, ip: [u8; 16]) -> Self {
        let mut r = self.ethertype(0x86DD);
        (r.value.dst_ip, r.mask.dst_ip) = (ip, [0xFF; 16]);
        r
    }
    /// IP packets of protocol (IPv4) or next header (IPv6) `proto`.
    pub fn ip_proto(mut self, proto: u8) -> Self {
        (self.value.ip_proto, self.mask.ip_proto) = (proto, 0xFF);
        self
    }
    /// TCP or UDP segments from port `port`.
    pub fn src_port(mut self, port: u16) -> Self {
        (self.value.src_port, self.mask.src_port) = (port.into(), 0xFFFF.into());
        self
    }
    /// TCP or UDP segments to port `port`.
    pub fn dst_port(mut self, port: u16) -> Self {
        (self.value.dst_port, self.mask.dst_port) = (port.into(), 0xFFFF.into());
        self
    }
    /// With priority `p` (lower wins).
    pub fn priority(mut self, p: u16) -> Self {
        self.priority = p;
        self
    }
}

/// An IPv4 address as the IPv4-mapped IPv6 address rules compare.
pub fn mapped(ip: [u8; 4]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[10..12].fill(0xFF);
    a[12..].copy_from_slice(&ip);
    a
}

/// A flow-steering rule. Dropping it removes the rule. The device refuses to destroy a QP
/// that a rule names (as Linux's `ibv_destroy_qp` is `EBUSY`): dropping the
/// [`QueuePair`] removes its remaining rules first, and their handles then do nothing.
#[derive(Debug)]
pub struct Flow {
    dev: Device,
    num: u32,
    /// The rule numbers of its QP (shared with it): a rule no longer listed is gone.
    held: Rc<RefCell<Vec<u32>>>,
}

impl Flow {
    /// The device's number for the rule.
    pub fn num(&self) -> u32 {
        self.num
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        let mut held = self.held.borrow_mut();
        if let Some(i) = held.iter().position(|&n| n == self.num) {
            held.swap_remove(i);
            let _ = self.dev.inner.destroy(CmdOpcode::DestroyFlow, self.num);
        }
    }
}

impl QueuePair {
    /// Steers the frames `rule` matches to this raw packet QP.
    pub fn create_flow(&self, rule: &FlowRule) -> Result<Flow, Error> {
        if !self.device().caps().caps.contains(regs::Caps::RAW_PACKET) {
            return Err(Error::Unsupported(
                "flow steering: the device lacks CAPS.RAW_PACKET",
            ));
        }
        if !self.raw {
            return Err(Error::InvalidArgument(
                "flow rules steer frames to raw packet QPs only",
            ));
        }
        let input = CreateFlowIn {
            qpn: self.qpn().into(),
            priority: rule.priority.into(),
            value: rule.value,
            mask: rule.mask,
            ..Default::default()
        };
        let num = self
            .device()
            .inner
            .create(CmdOpcode::CreateFlow, input.as_bytes())?;
        self.flows.borrow_mut().push(num);
        Ok(Flow {
            dev: self.device().clone(),
            num,
            held: self.flows.clone(),
        })
    }

    /// Flow rules that name this QP.
    pub fn flows_attached(&self) -> u32 {
        self.flows.borrow().len() as u32
    }

    /// Multicast groups this QP is attached to.
    pub fn mcast_attached(&self) -> u32 {
        self.mcast.borrow().len() as u32
    }

    /// Removes the rules that name this QP and detaches it from its groups (before its
    /// DESTROY_QP).
    pub(crate) fn release_steering(&self) {
        for n in self.flows.borrow_mut().drain(..) {
            let _ = self.device().inner.destroy(CmdOpcode::DestroyFlow, n);
        }
        for gid in self.mcast.borrow_mut().drain(..) {
            let _ = self.mcast_command(CmdOpcode::DetachMcast, gid);
        }
    }

    /// Takes a raw packet QP from RESET to RTS (INIT with port 1, then RTR and RTS).
    pub fn raw_ready(&mut self) -> Result<(), Error> {
        use QpAttrMask as M;
        let to = |s: QpState| QpAttr {
            state: s as u8,
            ..Default::default()
        };
        self.modify(M::STATE | M::PORT, &to(QpState::Init))?;
        self.modify(M::STATE, &to(QpState::Rtr))?;
        self.modify(M::STATE, &to(QpState::Rts))
    }
}

/// A receive WQ's state ([`SharedReceiveQueue::modify_wq`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WqState {
    /// Made so: frames for it are dropped.
    Reset,
    /// Receiving.
    Ready,
    /// Stopped: frames for it are dropped.
    Err,
}

impl ProtectionDomain {
    /// A receive WQ (ABI 1.12): a receive queue whose requests complete on `cq`, reached
    /// only through an RSS table ([`QueuePair::set_rss`]). It starts in RESET.
    pub fn create_recv_wq(
        &self,
        cq: &CompletionQueue,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<SharedReceiveQueue, Error> {
        if !self.device().caps().caps.contains(regs::Caps::RAW_PACKET) {
            return Err(Error::Unsupported(
                "receive WQs: the device lacks CAPS.RAW_PACKET",
            ));
        }
        if !cq.belongs_to(self.device()) {
            return Err(Error::InvalidArgument("CQ belongs to another device"));
        }
        self.create_srq_inner(max_wr, max_sge, 0, None, Some((None, cq)))
    }
}

impl SharedReceiveQueue {
    /// Moves a receive WQ to `state`.
    pub fn modify_wq(&self, state: WqState) -> Result<(), Error> {
        let input = ModifyWqIn {
            wqn: self.srqn().into(),
            state: match state {
                WqState::Reset => WQ_STATE_RESET,
                WqState::Ready => WQ_STATE_READY,
                WqState::Err => WQ_STATE_ERR,
            },
            ..Default::default()
        };
        self.device()
            .inner
            .command(CmdOpcode::ModifyWq, input.as_bytes())
            .map(|_| ())
    }
}

/// What an RSS hash covers ([`QueuePair::set_rss`]): `RSS_*` bits of
/// [`ringbell_specs::cmd`], libibverbs' `IBV_RX_HASH_*` values.
pub use ringbell_specs::cmd::{
    RSS_DST_IPV4, RSS_DST_IPV6, RSS_DST_PORT_TCP, RSS_DST_PORT_UDP, RSS_MAX_LOG_SIZE, RSS_SRC_IPV4,
    RSS_SRC_IPV6, RSS_SRC_PORT_TCP, RSS_SRC_PORT_UDP,
};

impl QueuePair {
    /// Makes this raw packet QP (in RESET) receive through `wqs` (a power of two of them,
    /// at most `1 << RSS_MAX_LOG_SIZE`, receive WQs of its device): a frame a flow rule
    /// steers to it goes to `wqs[toeplitz(key, fields of the frame) % wqs.len()]`. The
    /// WQs stay alive while the QP does.
    pub fn set_rss(
        &self,
        fields: u32,
        key: &[u8],
        wqs: &[&SharedReceiveQueue],
    ) -> Result<(), Error> {
        if !self.raw {
            return Err(Error::InvalidArgument("RSS is for raw packet QPs"));
        }
        if !wqs.len().is_power_of_two()
            || wqs.len() > 1 << RSS_MAX_LOG_SIZE
            || key.len() > 40
            || wqs.iter().any(|w| !w.belongs_to(self.device()))
        {
            return Err(Error::InvalidArgument(
                "RSS: a power of two of this device's WQs, and a key of at most 40 bytes",
            ));
        }
        // From the driver's DMA arena: no memory file of its own for a table read once.
        let table = self.device().alloc_ring(4 * wqs.len())?;
        for (i, w) in wqs.iter().enumerate() {
            table.write(i * 4, &w.srqn().to_le_bytes())?;
        }
        let mut input = SetQpRssIn {
            qpn: self.qpn().into(),
            fields: fields.into(),
            log_size: wqs.len().trailing_zeros() as u8,
            key_len: key.len() as u8,
            table_iova: table.iova().into(),
            ..Default::default()
        };
        input.set_key(key);
        self.device()
            .inner
            .command(CmdOpcode::SetQpRss, input.as_bytes())?;
        self.rss
            .borrow_mut()
            .extend(wqs.iter().map(|w| w.keepalive()));
        Ok(())
    }
}

impl QueuePair {
    /// Attaches this UD QP to the multicast group of `gid` (an IPv4-mapped address of
    /// 224.0.0.0/4): it receives the datagrams sent to the group ([`AhAttr::multicast`],
    /// QPN [`MCAST_QPN`](ringbell_specs::cmd::MCAST_QPN)) while it is attached. Attaching
    /// twice changes nothing. The device refuses to destroy a QP that is still attached:
    /// dropping the [`QueuePair`] detaches it first.
    ///
    /// [`AhAttr::multicast`]: crate::AhAttr::multicast
    pub fn attach_mcast(&self, gid: [u8; 16]) -> Result<(), Error> {
        self.mcast_command(CmdOpcode::AttachMcast, gid)?;
        let mut m = self.mcast.borrow_mut();
        if !m.contains(&gid) {
            m.push(gid);
        }
        Ok(())
    }

    /// Detaches this QP from the group of `gid` (not attached: the device's `BAD_RESOURCE`).
    pub fn detach_mcast(&self, gid: [u8; 16]) -> Result<(), Error> {
        self.mcast_command(CmdOpcode::DetachMcast, gid)?;
        self.mcast.borrow_mut().retain(|g| *g != gid);
        Ok(())
    }

    fn mcast_command(&self, op: CmdOpcode, gid: [u8; 16]) -> Result<(), Error> {
        if !self.device().caps().caps.contains(regs::Caps::UD_MCAST) {
            return Err(Error::Unsupported(
                "multicast: the device lacks CAPS.UD_MCAST",
            ));
        }
        let input = ringbell_specs::cmd::McastIn {
            qpn: self.qpn().into(),
            gid,
            ..Default::default()
        };
        self.device()
            .inner
            .command(op, input.as_bytes())
            .map(|_| ())
    }
}
