//! Unreliable datagrams (ABI 1.5): address handles, the destination of a UD send, the
//! sender a UD receive completion names, and the UD state sequence of a [`QueuePair`].
//!
//! A UD QP is created like an RC one with [`QpType::Ud`](crate::QpType::Ud) in
//! [`QpInit`](crate::QpInit). It needs no peer: [`QueuePair::ud_ready`] takes it from RESET
//! to RTS with its Q_Key. Each send names its destination ([`UdDest`]: an
//! [`AddressHandle`], the remote QPN and Q_Key), carries one packet's worth of data (the
//! path MTU, 4096 bytes here), and completes once the datagram has left. A receive buffer
//! gets the 40-byte GRH area first and the payload after it; its completion's
//! [`source`](crate::WorkCompletion::source) says who sent it. A datagram the receiver
//! cannot take (wrong Q_Key, no receive posted, buffer too small) is dropped and counted in
//! [`QueuePair::ud_stats`]; nobody is told.

use crate::device::Device;
use crate::error::Error;
use crate::mr::{PdObject, ProtectionDomain};
use crate::qp::QueuePair;
use ringbell_specs::cmd::{
    CmdOpcode, ObjectIn, QpAttr, QpAttrMask, QpState, GSI_QKEY, GSI_QPN, QKEY_USE_QP,
};
use ringbell_specs::stats::UdStats;
use std::rc::Rc;
use zerocopy::IntoBytes;

/// Bytes at the head of every UD receive buffer that hold the GRH area (the datagram's
/// IPv4 header in the last 20 of them).
pub const GRH_LEN: usize = ringbell_specs::cqe::GRH_LEN;

/// Largest UD payload: one packet at the largest path MTU.
pub const UD_MAX_PAYLOAD: u32 = 4096;

/// Where datagrams go: a port's Ethernet and IPv4 addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct AhAttr {
    /// Destination MAC address.
    pub mac: [u8; 6],
    /// Destination IPv4 address.
    pub ip: [u8; 4],
}

impl AhAttr {
    /// The address of multicast group `ip` (224.0.0.0/4; `None` otherwise): its Ethernet
    /// address is the group's (`01:00:5e` and the low 23 bits). A datagram to it goes to
    /// QPN [`MCAST_QPN`](ringbell_specs::cmd::MCAST_QPN) and reaches every QP attached to
    /// the group ([`QueuePair::attach_mcast`](crate::QueuePair::attach_mcast)).
    pub fn multicast(ip: [u8; 4]) -> Option<AhAttr> {
        (ip[0] & 0xF0 == 0xE0).then(|| AhAttr {
            mac: ringbell_specs::cmd::mcast_mac(ip),
            ip,
        })
    }

    /// The port with IPv4 address `ip` on a ringbell fabric, or `None` for an address
    /// outside its plan. The emulated fabric gives node `n` (counting from 1) the IPv4
    /// address `10.0.hi.lo` and the MAC address `02:00:00:00:hi:lo` (`hi`, `lo`: the bytes
    /// of `n`), so the IPv4 address alone names a port (where a real network would ask its
    /// neighbour table).
    pub fn on_fabric(ip: [u8; 4]) -> Option<AhAttr> {
        if ip[0] != 10 || ip[1] != 0 || ip[2..] == [0, 0] {
            return None;
        }
        Some(AhAttr {
            mac: [0x02, 0, 0, 0, ip[2], ip[3]],
            ip,
        })
    }
}

/// An address handle: a destination, created in a protection domain. A UD send may use it
/// only on a QP of the same PD.
#[derive(Debug, Clone)]
pub struct AddressHandle {
    attr: AhAttr,
    pd: Rc<PdObject>,
}

impl AddressHandle {
    /// The destination.
    pub fn attr(&self) -> AhAttr {
        self.attr
    }
    pub(crate) fn in_pd(&self, pd: &Rc<PdObject>) -> bool {
        Rc::ptr_eq(&self.pd, pd)
    }
}

impl ProtectionDomain {
    /// Creates an address handle for `attr` in this PD. A multicast or broadcast MAC, or
    /// the IPv4 addresses 0.0.0.0 and 255.255.255.255, are refused (`InvalidArgument`),
    /// except a multicast group's ([`AhAttr::multicast`]; ABI 1.12).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle, Error> {
        let group =
            attr.ip[0] & 0xF0 == 0xE0 && attr.mac == ringbell_specs::cmd::mcast_mac(attr.ip);
        if attr.mac[0] & 1 != 0 && !group {
            return Err(Error::InvalidArgument(
                "address handle: a multicast or broadcast MAC",
            ));
        }
        if attr.ip == [0; 4] || attr.ip == [255; 4] {
            return Err(Error::InvalidArgument(
                "address handle: IPv4 0.0.0.0 or 255.255.255.255",
            ));
        }
        Ok(AddressHandle {
            attr: *attr,
            pd: self.obj.clone(),
        })
    }
}

/// The destination of one UD send.
#[derive(Clone, Copy, Debug)]
pub struct UdDest<'a> {
    /// The address, in the sending QP's PD.
    pub ah: &'a AddressHandle,
    /// The remote QP number (24 bits).
    pub qpn: u32,
    /// The remote Q_Key; bit 31 set sends the sending QP's own Q_Key instead.
    pub qkey: u32,
}

/// Who sent a received datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct UdSource {
    /// The sending QP.
    pub qpn: u32,
    /// The sender's MAC address.
    pub mac: [u8; 6],
    /// The sender's IPv4 address.
    pub ip: [u8; 4],
}

impl UdSource {
    /// The sender's address, to answer it through an address handle.
    pub fn ah_attr(&self) -> AhAttr {
        AhAttr {
            mac: self.mac,
            ip: self.ip,
        }
    }
}

impl QueuePair {
    /// RESET → INIT → RTR → RTS for a UD QP with Q_Key `qkey` (bit 31 clear, except
    /// [`GSI_QKEY`] on the general services QP), sending from PSN `sq_psn`.
    pub fn ud_ready(&mut self, qkey: u32, sq_psn: u32) -> Result<(), Error> {
        use QpAttrMask as M;
        if qkey & QKEY_USE_QP != 0 && !(self.qpn() == GSI_QPN && qkey == GSI_QKEY) {
            return Err(Error::InvalidArgument("a QP's own Q_Key has bit 31 clear"));
        }
        let attr = |state: QpState| QpAttr {
            state: state as u8,
            qkey: qkey.into(),
            sq_psn: (sq_psn & 0x00FF_FFFF).into(),
            ..Default::default()
        };
        self.modify(
            M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY,
            &attr(QpState::Init),
        )?;
        self.modify(M::STATE, &attr(QpState::Rtr))?;
        self.modify(M::STATE | M::SQ_PSN, &attr(QpState::Rts))
    }

    /// The QP's datagram counters: sent, received, and every drop by reason.
    pub fn ud_stats(&self) -> Result<UdStats, Error> {
        let out = self.device().inner.command(
            CmdOpcode::QueryQpUdStats,
            ObjectIn {
                num: self.qpn().into(),
            }
            .as_bytes(),
        )?;
        Ok(UdStats::decode(&out))
    }
}

impl Device {
    /// This device's own address, as a peer's address handle names it.
    pub fn ah_attr(&self) -> AhAttr {
        let c = self.caps();
        AhAttr {
            mac: c.mac,
            ip: c.ip,
        }
    }
}
