//! Completion queue entries (64 bytes) and event queue entries (32 bytes).
//!
//! Both rings use an owner (phase) bit in their last byte. The device writes entry `n` (an
//! absolute, ever-increasing index) with owner bit `((n >> log_size) & 1) ^ 1`, so the first
//! pass over a zeroed ring writes 1, the second 0, and so on: the bit flips on every wrap.
//! The driver owns entry `ci` when its owner bit equals `((ci >> log_size) & 1) ^ 1`, and reads
//! the rest of the entry only after that check (acquire). The device writes the owner byte
//! last.

use crate::cmd::abi_struct;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Bytes in a CQE.
pub const CQE_SIZE: usize = 64;
/// Bytes in an EQE.
pub const EQE_SIZE: usize = 32;

/// The owner bit the device writes for absolute entry index `n` of a ring of `1 << log` entries.
pub const fn owner_bit(n: u32, log: u8) -> u8 {
    (((n >> log) & 1) ^ 1) as u8
}

abi_struct!(
    /// A completion queue entry.
    Cqe, 64, {
        opcode: u8, status: u8, wqe_counter: U16, qpn: U32,
        byte_len: U32, imm: U32, timestamp: U64,
        flags: u8, vendor_syndrome: u8, ext_flags: u8, rsvd0: u8, srqn: U32,
        tm_tag: U64, tm_app_ctx: U32, tm_handle: U32, tm_hw_cnt: U16,
        src_mac: [u8; 6], src_ip: [u8; 4], src_qpn: [u8; 3], owner: u8,
    }
);

/// CQE flag (TM-SRQ): a list operation ran while the unexpected counts disagreed; software
/// should report its count with a SYNC.
pub const CQE_FLAG_TM_SYNC_REQ: u8 = 1 << 3;
/// CQE flag (TM-SRQ): the message matched a tagged buffer (`tm_tag`, `tm_app_ctx`,
/// `tm_handle` are valid).
pub const CQE_FLAG_TM_MATCH: u8 = 1 << 4;
/// CQE flag (TM-SRQ): the tagged buffer holds the message's data.
pub const CQE_FLAG_TM_DATA_VALID: u8 = 1 << 5;

/// CQE flag: the completion of a triggered operation (ABI 1.3). `tm_tag` holds the `wr_id`
/// it was posted with and `tm_handle` its handle; `wqe_counter` means nothing (the send
/// queue's ring is not involved).
pub const CQE_FLAG_TRIGGERED: u8 = 1 << 6;

/// CQE flag (ABI 1.5): a datagram received on a UD QP. `src_qpn`, `src_mac` and `src_ip`
/// name its sender, and the first [`GRH_LEN`] bytes of the receive buffer hold the GRH area
/// (its last 20 bytes the datagram's IPv4 header); `byte_len` counts them.
pub const CQE_FLAG_UD: u8 = 1 << 7;

/// Bytes at the head of a UD receive buffer that hold the GRH area, as verbs defines it.
pub const GRH_LEN: usize = 40;

impl Cqe {
    /// The sender's QPN of a UD receive completion (`src_qpn`, 24 bits little-endian).
    pub fn ud_src_qpn(&self) -> u32 {
        u32::from_le_bytes([self.src_qpn[0], self.src_qpn[1], self.src_qpn[2], 0])
    }
    /// Sets `src_qpn` from the low 24 bits of `qpn`.
    pub fn set_ud_src_qpn(&mut self, qpn: u32) {
        self.src_qpn.copy_from_slice(&qpn.to_le_bytes()[..3]);
    }
}

/// CQE extended flag (`ext_flags`, ABI 1.9): the received SEND invalidated a memory window;
/// `imm` holds the key it invalidated (`IBV_WC_WITH_INV`).
pub const CQE_EXT_FLAG_INV: u8 = 1 << 0;

/// CQE flag: `imm` holds immediate data.
pub const CQE_FLAG_IMM: u8 = 1 << 0;
/// CQE flag: the message had the solicited-event bit.
pub const CQE_FLAG_SOLICITED: u8 = 1 << 1;
/// CQE flag: the receive WQE came from the SRQ named in `srqn`; `wqe_counter` indexes it.
pub const CQE_FLAG_SRQ: u8 = 1 << 2;

/// CQE opcodes (the libibverbs `ibv_wc_opcode` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CqeOpcode {
    /// A SEND or SEND with immediate completed.
    Send = 0,
    /// An RDMA WRITE (with or without immediate) completed.
    RdmaWrite = 1,
    /// An RDMA READ completed.
    RdmaRead = 2,
    /// A compare-and-swap completed.
    CompSwap = 3,
    /// A fetch-and-add completed.
    FetchAdd = 4,
    /// A memory window was bound (ABI 1.9).
    BindMw = 5,
    /// A local invalidation completed (ABI 1.9).
    LocalInv = 6,
    /// An ATOMIC WRITE completed (ABI 1.10; the `ibv_wc_opcode` value).
    AtomicWrite = 9,
    /// A SEND was received.
    Recv = 128,
    /// An RDMA WRITE with immediate consumed a receive WQE.
    RecvRdmaWithImm = 129,
    /// TM-SRQ: an ADD list operation completed.
    TmAdd = 130,
    /// TM-SRQ: a DEL list operation completed.
    TmDel = 131,
    /// TM-SRQ: a SYNC list operation completed.
    TmSync = 132,
    /// TM-SRQ: a tagged message was received (matched, or unexpected without flags).
    TmRecv = 133,
    /// TM-SRQ: a message without a tag (NO_TAG or FIN) was received.
    TmNoTag = 134,
}

impl CqeOpcode {
    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Option<CqeOpcode> {
        use CqeOpcode::*;
        Some(match v {
            0 => Send,
            1 => RdmaWrite,
            2 => RdmaRead,
            3 => CompSwap,
            4 => FetchAdd,
            5 => BindMw,
            6 => LocalInv,
            9 => AtomicWrite,
            128 => Recv,
            129 => RecvRdmaWithImm,
            130 => TmAdd,
            131 => TmDel,
            132 => TmSync,
            133 => TmRecv,
            134 => TmNoTag,
            _ => return None,
        })
    }
    /// Whether the completion belongs to the receive side or a TM-SRQ (opcodes 128 and up:
    /// RECV, RECV_RDMA_WITH_IMM and every tag-matching opcode).
    pub fn is_recv(self) -> bool {
        (self as u8) & 0x80 != 0
    }
    /// Whether the completion is of a send work request (SEND, RDMA_WRITE, RDMA_READ,
    /// COMP_SWAP, FETCH_ADD): the complement of [`CqeOpcode::is_recv`].
    pub fn is_send(self) -> bool {
        !self.is_recv()
    }
    /// Whether the completion reports a received message (RECV, RECV_RDMA_WITH_IMM,
    /// TM_RECV, TM_NO_TAG), as opposed to a send or a TM-SRQ list operation.
    pub fn is_message(self) -> bool {
        self.is_recv() && !self.is_tm_op()
    }
    /// Whether the completion is a TM-SRQ list operation.
    pub fn is_tm_op(self) -> bool {
        matches!(
            self,
            CqeOpcode::TmAdd | CqeOpcode::TmDel | CqeOpcode::TmSync
        )
    }
}

/// Completion status (the libibverbs `ibv_wc_status` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CqeStatus {
    /// The operation completed.
    Success = 0,
    /// Local length error: a receive buffer too small, or a gather list too long.
    LocLenErr = 1,
    /// Local QP operation error: malformed WQE, unknown opcode.
    LocQpOpErr = 2,
    /// Local protection error: bad lkey, wrong PD, out of bounds, missing LOCAL_WRITE.
    LocProtErr = 4,
    /// Flushed because the QP is in the error state.
    WrFlushErr = 5,
    /// A memory-window bind failed (ABI 1.9).
    MwBindErr = 6,
    /// Unexpected response opcode from the responder.
    BadRespErr = 7,
    /// Local access error.
    LocAccessErr = 8,
    /// The responder reported an invalid request.
    RemInvReqErr = 9,
    /// The responder reported a remote access error.
    RemAccessErr = 10,
    /// The responder reported a remote operational error.
    RemOpErr = 11,
    /// Transport retries exhausted.
    RetryExcErr = 12,
    /// RNR retries exhausted.
    RnrRetryExcErr = 13,
    /// Fatal device error.
    FatalErr = 19,
    /// General error; `vendor_syndrome` says more (see [`VendorSyndrome`]).
    GeneralErr = 21,
    /// TM-SRQ: the list operation failed (DEL of an entry already consumed or never added,
    /// ADD into a slot in use, a handle beyond the list).
    TmErr = 22,
    /// TM-SRQ: a rendezvous matched a tagged buffer too small for its data; the request is
    /// in the buffer and software finishes the transfer.
    TmRndvIncomplete = 23,
}

impl CqeStatus {
    /// Decodes a status byte.
    pub fn from_u8(v: u8) -> Option<CqeStatus> {
        use CqeStatus::*;
        Some(match v {
            0 => Success,
            1 => LocLenErr,
            2 => LocQpOpErr,
            4 => LocProtErr,
            5 => WrFlushErr,
            6 => MwBindErr,
            7 => BadRespErr,
            8 => LocAccessErr,
            9 => RemInvReqErr,
            10 => RemAccessErr,
            11 => RemOpErr,
            12 => RetryExcErr,
            13 => RnrRetryExcErr,
            19 => FatalErr,
            21 => GeneralErr,
            22 => TmErr,
            23 => TmRndvIncomplete,
            _ => return None,
        })
    }
}

/// Detail in an error CQE's `vendor_syndrome`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum VendorSyndrome {
    /// No detail.
    None = 0,
    /// A DMA address was outside every IOMMU mapping.
    IommuFault = 1,
    /// The WQE opcode is unknown.
    BadOpcode = 2,
    /// The WQE's segment count or layout is malformed.
    BadSegment = 3,
    /// The lkey does not exist.
    BadLkey = 4,
    /// The lkey's MR belongs to another PD.
    WrongPd = 5,
    /// The address range is outside the MR.
    OutOfBounds = 6,
    /// The MR lacks a required access right.
    NoAccess = 7,
    /// The message is longer than the device maximum or the buffer.
    TooLong = 8,
    /// A memory-window operation named a window it cannot act on: no such window, a key
    /// or index that does not match, the wrong type or state (ABI 1.9).
    BadMw = 9,
}

abi_struct!(
    /// An event queue entry.
    Eqe, 32, {
        event_type: u8, subtype: u8, rsvd0: U16, obj: U32, info: U64, timestamp: U64,
        rsvd1: [u8; 7], owner: u8,
    }
);

/// EQE event types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum EventType {
    /// A CQ armed through its arm doorbell received a CQE; `obj` is the CQN.
    Completion = 0x00,
    /// A QP entered ERR for a reason not tied to a WQE; `obj` is the QPN.
    QpFatal = 0x01,
    /// A QP's requester detected a transport error; `obj` is the QPN.
    QpReqErr = 0x02,
    /// A QP's responder detected an access violation; `obj` is the QPN.
    QpAccessErr = 0x03,
    /// A CQ overflowed; `obj` is the CQN. The CQE was lost.
    CqError = 0x04,
    /// An SRQ fell below its armed limit; `obj` is the SRQN.
    SrqLimit = 0x05,
    /// A DMA address was outside every IOMMU mapping; `info` is the IOVA, `obj` the QPN or 0.
    IommuFault = 0x06,
    /// A command finished; `obj` is its token, `subtype` its status.
    CmdDone = 0x07,
    /// A doorbell was rejected; `obj` is the object number, `subtype` the [`DoorbellError`],
    /// `info` the index written.
    DoorbellError = 0x08,
    /// A QP in SQD has drained its send queue; `obj` is the QPN.
    SqDrained = 0x09,
    /// An armed counter wait ended (ABI 1.3); `obj` is the counter, `subtype` a
    /// [`CntrWaitEnd`], `info` the success value then.
    Counter = 0x0A,
}

/// Why a counter wait ended (`subtype` of a [`EventType::Counter`] EQE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CntrWaitEnd {
    /// The success value reached the threshold.
    Reached = 0,
    /// The error value changed.
    ErrorChanged = 1,
}

impl EventType {
    /// Decodes an event type byte.
    pub fn from_u8(v: u8) -> Option<EventType> {
        use EventType::*;
        Some(match v {
            0x00 => Completion,
            0x01 => QpFatal,
            0x02 => QpReqErr,
            0x03 => QpAccessErr,
            0x04 => CqError,
            0x05 => SrqLimit,
            0x06 => IommuFault,
            0x07 => CmdDone,
            0x08 => DoorbellError,
            0x09 => SqDrained,
            0x0A => Counter,
            _ => return None,
        })
    }
}

/// Why a doorbell was rejected (`subtype` of a [`EventType::DoorbellError`] EQE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DoorbellError {
    /// The producer index is more than a ring ahead of the consumer, or behind it.
    IndexOutOfRange = 1,
    /// The WQE at the consumer index does not carry the expected `wqe_index`: it was not
    /// written (or not made visible) before the doorbell.
    StaleWqe = 2,
    /// The doorbell names an object that does not exist.
    NoSuchObject = 3,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_bit_flips_every_wrap() {
        assert_eq!(owner_bit(0, 2), 1);
        assert_eq!(owner_bit(3, 2), 1);
        assert_eq!(owner_bit(4, 2), 0);
        assert_eq!(owner_bit(8, 2), 1);
    }

    #[test]
    fn golden_cqe() {
        let cqe = Cqe {
            opcode: CqeOpcode::Recv as u8,
            status: CqeStatus::Success as u8,
            wqe_counter: 5.into(),
            qpn: 0x12.into(),
            byte_len: 4096.into(),
            imm: 0xdead_beef.into(),
            timestamp: 1_234_567.into(),
            flags: CQE_FLAG_IMM,
            owner: 1,
            ..Default::default()
        };
        let hex: String = cqe.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, crate::golden::CQE);
        for v in 0..=255u8 {
            if let Some(s) = CqeStatus::from_u8(v) {
                assert_eq!(s as u8, v);
            }
            if let Some(o) = CqeOpcode::from_u8(v) {
                assert_eq!(o as u8, v);
            }
            if let Some(e) = EventType::from_u8(v) {
                assert_eq!(e as u8, v);
            }
        }
    }

    /// The receive completion of the datagram of WIRE.md 9.9 at QP 0x12: 40 bytes of GRH
    /// area plus 8 of payload, immediate data, the sender in the source fields.
    #[test]
    fn golden_ud_cqe() {
        let mut cqe = Cqe {
            opcode: CqeOpcode::Recv as u8,
            status: CqeStatus::Success as u8,
            wqe_counter: 2.into(),
            qpn: 0x12.into(),
            byte_len: (GRH_LEN as u32 + 8).into(),
            imm: 0xCAFE_F00D.into(),
            timestamp: 2_500_000.into(),
            flags: CQE_FLAG_IMM | CQE_FLAG_UD,
            src_mac: [0x02, 0, 0, 0, 0, 0x01],
            src_ip: [10, 0, 0, 1],
            owner: 1,
            ..Default::default()
        };
        cqe.set_ud_src_qpn(0x11);
        let hex: String = cqe.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, crate::golden::UD_CQE);
    }

    #[test]
    fn ud_source_fields() {
        use core::mem::offset_of;
        assert_eq!(offset_of!(Cqe, tm_hw_cnt), 0x30);
        assert_eq!(offset_of!(Cqe, src_mac), 0x32);
        assert_eq!(offset_of!(Cqe, src_ip), 0x38);
        assert_eq!(offset_of!(Cqe, src_qpn), 0x3C);
        assert_eq!(offset_of!(Cqe, owner), 0x3F);
        assert_eq!(CQE_FLAG_UD, 0x80);
        // Every flag has its own bit.
        let flags = [
            CQE_FLAG_IMM,
            CQE_FLAG_SOLICITED,
            CQE_FLAG_SRQ,
            CQE_FLAG_TM_SYNC_REQ,
            CQE_FLAG_TM_MATCH,
            CQE_FLAG_TM_DATA_VALID,
            CQE_FLAG_TRIGGERED,
            CQE_FLAG_UD,
        ];
        assert_eq!(flags.iter().fold(0u8, |a, f| a | f), 0xFF);
        let mut c = Cqe::default();
        assert_eq!(c.ud_src_qpn(), 0);
        c.set_ud_src_qpn(0x00AB_CDEF);
        assert_eq!(c.src_qpn, [0xEF, 0xCD, 0xAB]);
        assert_eq!(c.ud_src_qpn(), 0x00AB_CDEF);
        // Only the low 24 bits are kept, and the owner byte after them is untouched.
        c.owner = 1;
        c.set_ud_src_qpn(0xFF12_3456);
        assert_eq!(c.ud_src_qpn(), 0x12_3456);
        assert_eq!(c.owner, 1);
        assert_eq!(&c.as_bytes()[0x3C..], &[0x56, 0x34, 0x12, 0x01]);
        for qpn in [0, 1, 2, 0x11, 0x7FFF, 0x00FF_FFFF] {
            c.set_ud_src_qpn(qpn);
            assert_eq!(c.ud_src_qpn(), qpn);
        }
    }

    #[test]
    fn golden_eqe() {
        let eqe = Eqe {
            event_type: EventType::IommuFault as u8,
            obj: 3.into(),
            info: 0xdead_0000.into(),
            timestamp: 42.into(),
            owner: 1,
            ..Default::default()
        };
        let hex: String = eqe.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, crate::golden::EQE);
    }
}
