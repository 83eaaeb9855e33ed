//! Work queue entries.
//!
//! A send WQE is built from 16-byte segments and occupies one or more 64-byte basic blocks
//! (WQEBBs) of the send ring; the send queue producer index counts WQEBBs. The first segment
//! is always the [`CtrlSeg`]; then, by opcode:
//!
//! ```text
//! SEND, SEND_IMM        ctrl | data* or inline
//! WRITE, WRITE_IMM      ctrl | raddr | data* or inline
//! READ                  ctrl | raddr | data*          (local scatter list)
//! CMP_SWAP, FETCH_ADD   ctrl | raddr | atomic | data  (one 8-byte local result buffer)
//! UD SEND, SEND_IMM     ctrl | ud_addr (32 bytes) | data* or inline     (ABI 1.5)
//! SEND_INV              ctrl | data* or inline (the key to invalidate in `imm`; ABI 1.9)
//! BIND_MW               ctrl | bind (32 bytes)                           (ABI 1.9)
//! LOCAL_INV             ctrl (the key to invalidate in `imm`)            (ABI 1.9)
//! ATOMIC_WRITE          ctrl | raddr | inline (exactly 8 bytes)          (ABI 1.10)
//! ```
//!
//! A receive WQE is an array of [`DataSeg`] filling the queue's stride; the list ends at the
//! stride or at the first segment whose lkey is [`RECV_LKEY_END`].

use crate::cmd::abi_struct;
use bitflags::bitflags;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Bytes in a basic block of the send ring.
pub const WQEBB: usize = 64;
/// Bytes in one WQE segment.
pub const SEG: usize = 16;
/// Largest send WQE in bytes (four basic blocks).
pub const MAX_SEND_WQE: usize = 4 * WQEBB;
/// Largest number of 16-byte segments in a send WQE.
pub const MAX_DS: usize = MAX_SEND_WQE / SEG;
/// Most gather entries a SEND can carry (ctrl + 15 data segments).
pub const MAX_SEND_SGE: usize = MAX_DS - 1;
/// Most inline bytes in a SEND (ctrl, then a 4-byte inline header).
pub const MAX_INLINE_SEND: usize = MAX_SEND_WQE - SEG - 4;
/// Most inline bytes in a WRITE (ctrl, raddr, then a 4-byte inline header).
pub const MAX_INLINE_WRITE: usize = MAX_SEND_WQE - 2 * SEG - 4;
/// Most gather entries a UD SEND can carry (ctrl + 32-byte address + 13 data segments).
pub const MAX_UD_SEND_SGE: usize = MAX_DS - 1 - UD_ADDR_SEGS;
/// Most inline bytes in a UD SEND (ctrl, address, then a 4-byte inline header).
pub const MAX_INLINE_UD: usize = MAX_SEND_WQE - SEG - UD_ADDR_SEGS * SEG - 4;
/// 16-byte segments a [`UdAddrSeg`] takes.
pub const UD_ADDR_SEGS: usize = 2;
/// lkey that ends a receive WQE's scatter list early.
pub const RECV_LKEY_END: u32 = 0xFFFF_FFFF;
/// Bit 31 of an inline segment's byte count marks it as inline.
pub const INLINE_MARK: u32 = 1 << 31;

/// Send WQE opcodes (the `opcode` byte of the control segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SendOpcode {
    /// SEND.
    Send = 0x01,
    /// SEND with immediate data.
    SendImm = 0x02,
    /// RDMA WRITE.
    Write = 0x03,
    /// RDMA WRITE with immediate data.
    WriteImm = 0x04,
    /// RDMA READ.
    Read = 0x05,
    /// Atomic compare-and-swap.
    CmpSwap = 0x06,
    /// Atomic fetch-and-add.
    FetchAdd = 0x07,
    /// Bind a memory window (ABI 1.9).
    BindMw = 0x08,
    /// Invalidate a type 2 memory window locally (ABI 1.9).
    LocalInv = 0x09,
    /// SEND that invalidates a type 2 memory window at the responder (ABI 1.9).
    SendInv = 0x0A,
    /// IBTA 1.5 ATOMIC WRITE: 8 bytes, carried inline, written at the responder as one
    /// naturally aligned store (ABI 1.10).
    AtomicWrite = 0x0B,
}

impl SendOpcode {
    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Option<SendOpcode> {
        use SendOpcode::*;
        Some(match v {
            0x01 => Send,
            0x02 => SendImm,
            0x03 => Write,
            0x04 => WriteImm,
            0x05 => Read,
            0x06 => CmpSwap,
            0x07 => FetchAdd,
            0x08 => BindMw,
            0x09 => LocalInv,
            0x0A => SendInv,
            0x0B => AtomicWrite,
            _ => return None,
        })
    }
    /// Whether a remote-address segment follows the control segment.
    pub fn has_raddr(self) -> bool {
        matches!(
            self,
            SendOpcode::Write
                | SendOpcode::WriteImm
                | SendOpcode::Read
                | SendOpcode::CmpSwap
                | SendOpcode::FetchAdd
                | SendOpcode::AtomicWrite
        )
    }
    /// A SEND of any kind (plain, with immediate, with invalidate).
    pub fn is_send(self) -> bool {
        matches!(
            self,
            SendOpcode::Send | SendOpcode::SendImm | SendOpcode::SendInv
        )
    }
    /// Done by the NIC alone, without a packet (BIND_MW, LOCAL_INV; ABI 1.9).
    pub fn is_local(self) -> bool {
        matches!(self, SendOpcode::BindMw | SendOpcode::LocalInv)
    }
    /// Whether an atomic segment follows the remote-address segment.
    pub fn is_atomic(self) -> bool {
        matches!(self, SendOpcode::CmpSwap | SendOpcode::FetchAdd)
    }
    /// Whether the WQE carries immediate data.
    pub fn has_imm(self) -> bool {
        matches!(self, SendOpcode::SendImm | SendOpcode::WriteImm)
    }
}

bitflags! {
    /// Control segment flags.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct WqeFlags: u8 {
        /// Write a CQE when the WQE completes successfully.
        const SIGNALED = 1 << 0;
        /// Wait for earlier READs and atomics to complete before starting.
        const FENCE = 1 << 1;
        /// Set the solicited-event bit on the last packet.
        const SOLICITED = 1 << 2;
        /// The data is an inline segment, not a gather list.
        const INLINE = 1 << 3;
    }
}

abi_struct!(
    /// Control segment: the first 16 bytes of every send WQE. `xrc_srqn` (ABI 1.11; reserved
    /// before): on an XRC initiator QP, the XRC SRQ at the target that receives the request
    /// (low 24 bits); ignored on other QPs. `wqe_index` must equal the low
    /// 16 bits of the WQEBB counter at which the WQE starts; the device rejects a doorbell that
    /// makes it fetch a block whose index does not match (a stale or unwritten WQE).
    CtrlSeg, 16, {
        opcode: u8, flags: u8, wqe_index: U16, ds_count: u8, rsvd0: u8, rsvd1: U16,
        imm: U32, xrc_srqn: U32,
    }
);
abi_struct!(
    /// Remote-address segment.
    RaddrSeg, 16, { raddr: U64, rkey: U32, rsvd0: U32 }
);
abi_struct!(
    /// Atomic segment: swap (CMP_SWAP) or add (FETCH_ADD) operand, and the compare operand.
    AtomicSeg, 16, { swap_add: U64, compare: U64 }
);
abi_struct!(
    /// UD address segment (ABI 1.5): the destination of a datagram, right after the control
    /// segment of every send WQE on a UD QP. `dest_qpn` uses its low 24 bits; a `qkey` with
    /// bit 31 set ([`crate::cmd::QKEY_USE_QP`]) sends the QP's own Q_Key. Reserved bytes are
    /// ignored.
    UdAddrSeg, 32, {
        dest_qpn: U32, qkey: U32, dest_mac: [u8; 6], rsvd0: U16,
        dest_ip: [u8; 4], rsvd1: U32, rsvd2: U64,
    }
);
abi_struct!(
    /// Memory-window bind segment (ABI 1.9), right after the control segment of a BIND_MW
    /// WQE. `mw_key` names the window (bits 31:8; for a type 1 window its current key,
    /// exactly); after the bind the window's key is `new_key`, which has the same index.
    /// The window covers `[addr, addr + length)` of the memory region `mr_key` with the
    /// remote rights `access` (`cmd::Access` bits; [`MW_ZERO_BASED`] for a window whose
    /// addresses start at 0). `length` 0 unbinds the window.
    BindSeg, 32, {
        addr: U64, length: U64, mw_key: U32, new_key: U32, mr_key: U32, access: U32,
    }
);
/// `BindSeg::access` bit: the window is zero-based (its first byte has address 0); the
/// libibverbs value of `IBV_ACCESS_ZERO_BASED`.
pub const MW_ZERO_BASED: u32 = 1 << 5;
/// 16-byte segments a [`BindSeg`] takes.
pub const BIND_SEGS: usize = 2;

abi_struct!(
    /// Scatter/gather entry.
    DataSeg, 16, { byte_count: U32, lkey: U32, addr: U64 }
);

/// Number of 64-byte blocks a WQE of `ds_count` segments occupies.
pub const fn wqebbs(ds_count: usize) -> usize {
    (ds_count * SEG).div_ceil(WQEBB)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_write_wqe() {
        let ctrl = CtrlSeg {
            opcode: SendOpcode::Write as u8,
            flags: (WqeFlags::SIGNALED).bits(),
            wqe_index: 3.into(),
            ds_count: 3,
            imm: 0.into(),
            ..Default::default()
        };
        let raddr = RaddrSeg {
            raddr: 0x1000_2000.into(),
            rkey: 0x0000_0105.into(),
            ..Default::default()
        };
        let data = DataSeg {
            byte_count: 8.into(),
            lkey: 0x0000_0204.into(),
            addr: 0x3000.into(),
        };
        let mut wqe = Vec::new();
        wqe.extend_from_slice(ctrl.as_bytes());
        wqe.extend_from_slice(raddr.as_bytes());
        wqe.extend_from_slice(data.as_bytes());
        let hex: String = wqe.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, crate::golden::WRITE_WQE);
    }

    /// The UD SEND_IMM that sends the datagram of WIRE.md 9.9: one block, the address
    /// segment between the control segment and the gather list.
    #[test]
    fn golden_ud_send_wqe() {
        let ctrl = CtrlSeg {
            opcode: SendOpcode::SendImm as u8,
            flags: WqeFlags::SIGNALED.bits(),
            wqe_index: 7.into(),
            ds_count: (1 + UD_ADDR_SEGS + 1) as u8,
            imm: 0xCAFE_F00D.into(),
            ..Default::default()
        };
        let addr = UdAddrSeg {
            dest_qpn: 0x12.into(),
            qkey: 0x1122_3344.into(),
            dest_mac: [0x02, 0, 0, 0, 0, 0x02],
            dest_ip: [10, 0, 0, 2],
            ..Default::default()
        };
        let data = DataSeg {
            byte_count: 8.into(),
            lkey: 0x0000_0204.into(),
            addr: 0x3000.into(),
        };
        let mut wqe = Vec::new();
        wqe.extend_from_slice(ctrl.as_bytes());
        wqe.extend_from_slice(addr.as_bytes());
        wqe.extend_from_slice(data.as_bytes());
        assert_eq!(wqe.len(), usize::from(ctrl.ds_count) * SEG);
        assert_eq!(wqebbs(usize::from(ctrl.ds_count)), 1);
        let hex: String = wqe.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, crate::golden::UD_SEND_WQE);
    }

    #[test]
    fn ud_address_segment_layout() {
        use core::mem::{offset_of, size_of};
        assert_eq!(size_of::<UdAddrSeg>(), UD_ADDR_SEGS * SEG);
        assert_eq!(offset_of!(UdAddrSeg, dest_qpn), 0x00);
        assert_eq!(offset_of!(UdAddrSeg, qkey), 0x04);
        assert_eq!(offset_of!(UdAddrSeg, dest_mac), 0x08);
        assert_eq!(offset_of!(UdAddrSeg, rsvd0), 0x0E);
        assert_eq!(offset_of!(UdAddrSeg, dest_ip), 0x10);
        assert_eq!(offset_of!(UdAddrSeg, rsvd1), 0x14);
        assert_eq!(offset_of!(UdAddrSeg, rsvd2), 0x18);
        // Little-endian like every host structure; the MAC and IPv4 bytes in wire order.
        let a = UdAddrSeg {
            dest_qpn: 0x00AB_CDEF.into(),
            qkey: 0x8000_0001.into(),
            dest_mac: [1, 2, 3, 4, 5, 6],
            dest_ip: [192, 168, 0, 9],
            ..Default::default()
        };
        let b = a.as_bytes();
        assert_eq!(&b[..8], &[0xEF, 0xCD, 0xAB, 0x00, 0x01, 0x00, 0x00, 0x80]);
        assert_eq!(&b[8..14], &[1, 2, 3, 4, 5, 6]);
        assert_eq!(&b[16..20], &[192, 168, 0, 9]);
        assert_eq!(UdAddrSeg::read_from_bytes(b), Ok(a));
        // The UD limits: one control segment and two address segments before the data.
        assert_eq!(MAX_UD_SEND_SGE + 1 + UD_ADDR_SEGS, MAX_DS);
        assert_eq!(1 + UD_ADDR_SEGS + (4 + MAX_INLINE_UD).div_ceil(SEG), MAX_DS);
        assert_eq!(MAX_INLINE_UD % SEG, SEG - 4);
    }

    #[test]
    fn sizes() {
        assert_eq!(wqebbs(1), 1);
        assert_eq!(wqebbs(4), 1);
        assert_eq!(wqebbs(5), 2);
        assert_eq!(wqebbs(MAX_DS), 4);
        assert_eq!(MAX_INLINE_WRITE, 220);
        assert_eq!(MAX_INLINE_SEND, 236);
        assert_eq!(MAX_INLINE_UD, 204);
        assert_eq!(MAX_UD_SEND_SGE, 13);
        for v in 0..=255u8 {
            if let Some(op) = SendOpcode::from_u8(v) {
                assert_eq!(op as u8, v);
            }
        }
    }
}
