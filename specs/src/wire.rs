//! RoCEv2 wire format: the frames ringbell devices exchange on the simulated link.
//!
//! This module owns the byte layout of a reliable-connected (RC) RoCEv2 packet over IPv4:
//! the outer Ethernet II, IPv4 and UDP headers, the InfiniBand Base Transport Header (BTH),
//! the extended transport headers (RETH, AETH, AtomicETH, AtomicAckETH, ImmDt), the pad
//! bytes and the invariant CRC (ICRC). Each header has a validated `Repr` with `parse` and
//! `emit`; [`PacketRepr`] and [`parse_packet`] build and check whole frames. All wire fields
//! are big-endian as the IBTA specifies, except the ICRC, which is stored least-significant
//! byte first. `specs/WIRE.md` is the prose version of this module, with golden vectors.

use core::fmt;

use crate::types::{Psn, Qpn};

/// UDP destination port that marks a RoCEv2 packet.
pub const ROCEV2_UDP_PORT: u16 = 4791;
/// Ethernet II header length (no 802.1Q tag).
pub const ETH_HDR_LEN: usize = 14;
/// IPv4 header length (no options).
pub const IPV4_HDR_LEN: usize = 20;
/// UDP header length.
pub const UDP_HDR_LEN: usize = 8;
/// Base Transport Header length.
pub const BTH_LEN: usize = 12;
/// RDMA Extended Transport Header length.
pub const RETH_LEN: usize = 16;
/// ACK Extended Transport Header length.
pub const AETH_LEN: usize = 4;
/// Atomic Extended Transport Header length.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Atomic ACK Extended Transport Header length.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Immediate data header length.
pub const IMMDT_LEN: usize = 4;
/// Datagram Extended Transport Header length (UD: Q_Key and source QP).
pub const DETH_LEN: usize = 8;
/// Invariant CRC length.
pub const ICRC_LEN: usize = 4;
/// Bytes of Ethernet+IPv4+UDP in front of the BTH.
pub const ROCE_OUTER_LEN: usize = ETH_HDR_LEN + IPV4_HDR_LEN + UDP_HDR_LEN;

/// EtherType of IPv4.
pub const ETHERTYPE_IPV4: u16 = 0x0800;
/// IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;
/// IPv4 flags/fragment-offset word with only Don't Fragment set.
pub const IPV4_FLAG_DF: u16 = 0x4000;
/// The default partition key (full member of the default partition).
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// AETH ACK credit code meaning "no credit limit".
pub const AETH_CREDITS_UNLIMITED: u8 = 0x1F;

// Offsets of the masked fields inside the headers, for the ICRC.
const IPV4_TOS_OFF: usize = 1;
const IPV4_TTL_OFF: usize = 8;
const IPV4_CSUM_OFF: usize = 10;
const UDP_CSUM_OFF: usize = 6;
const BTH_FECN_BYTE: usize = 4;

/// Why a frame or header was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireError {
    /// The buffer ends before a header or before the length its headers announce.
    Truncated,
    /// EtherType is not IPv4, or the IP version field is not 4.
    NotIpv4,
    /// IPv4 header length (IHL) is not 5: options are not supported.
    BadIpHeader,
    /// The IPv4 packet is a fragment (MF set or non-zero fragment offset).
    Fragmented,
    /// IPv4 header checksum mismatch.
    BadIpChecksum,
    /// IPv4 protocol is not UDP.
    NotUdp,
    /// IPv4 total length is too small to hold the IPv4 and UDP headers.
    BadLength,
    /// UDP destination port is not 4791.
    NotRoce,
    /// UDP length disagrees with the IPv4 total length.
    BadUdpLength,
    /// BTH transport header version is not 0.
    BadTver,
    /// BTH opcode is not one ringbell speaks (RC 0x00..=0x14, UC 0x20..=0x2B, UD 0x64..=0x65).
    UnknownOpcode(u8),
    /// Payload bytes after the headers of an opcode that carries none.
    UnexpectedPayload,
    /// BTH pad count larger than the payload, or payload plus pad not a multiple of 4.
    BadPad,
    /// Invariant CRC mismatch.
    BadIcrc,
    /// AETH syndrome with a reserved type or a set reserved bit 7.
    BadSyndrome(u8),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated => write!(f, "frame truncated"),
            WireError::NotIpv4 => write!(f, "not an IPv4 frame"),
            WireError::BadIpHeader => write!(f, "IPv4 header length is not 20 bytes"),
            WireError::Fragmented => write!(f, "IPv4 fragment"),
            WireError::BadIpChecksum => write!(f, "IPv4 header checksum mismatch"),
            WireError::NotUdp => write!(f, "IPv4 protocol is not UDP"),
            WireError::BadLength => write!(f, "IPv4 total length too small"),
            WireError::NotRoce => write!(f, "UDP destination port is not 4791"),
            WireError::BadUdpLength => write!(f, "UDP length disagrees with IPv4 total length"),
            WireError::BadTver => write!(f, "BTH transport version is not 0"),
            WireError::UnknownOpcode(op) => write!(f, "unknown opcode {op:#04x}"),
            WireError::UnexpectedPayload => write!(f, "payload on an opcode that carries none"),
            WireError::BadPad => write!(f, "BTH pad count inconsistent with payload"),
            WireError::BadIcrc => write!(f, "ICRC mismatch"),
            WireError::BadSyndrome(s) => write!(f, "reserved AETH syndrome {s:#04x}"),
        }
    }
}

impl std::error::Error for WireError {}

/// The opcodes ringbell speaks (BTH byte 0): RC (transport bits 7:5 = 000), since ABI 1.5
/// the two UD SEND opcodes (transport bits 7:5 = 011) and since ABI 1.7 the UC SEND and RDMA
/// WRITE opcodes (transport bits 7:5 = 001; the low five bits are the RC operation's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// SEND_FIRST.
    SendFirst = 0x00,
    /// SEND_MIDDLE.
    SendMiddle = 0x01,
    /// SEND_LAST.
    SendLast = 0x02,
    /// SEND_LAST_WITH_IMMEDIATE.
    SendLastImm = 0x03,
    /// SEND_ONLY.
    SendOnly = 0x04,
    /// SEND_ONLY_WITH_IMMEDIATE.
    SendOnlyImm = 0x05,
    /// RDMA_WRITE_FIRST.
    WriteFirst = 0x06,
    /// RDMA_WRITE_MIDDLE.
    WriteMiddle = 0x07,
    /// RDMA_WRITE_LAST.
    WriteLast = 0x08,
    /// RDMA_WRITE_LAST_WITH_IMMEDIATE.
    WriteLastImm = 0x09,
    /// RDMA_WRITE_ONLY.
    WriteOnly = 0x0A,
    /// RDMA_WRITE_ONLY_WITH_IMMEDIATE.
    WriteOnlyImm = 0x0B,
    /// RDMA_READ_REQUEST.
    ReadRequest = 0x0C,
    /// RDMA_READ_RESPONSE_FIRST.
    ReadResponseFirst = 0x0D,
    /// RDMA_READ_RESPONSE_MIDDLE.
    ReadResponseMiddle = 0x0E,
    /// RDMA_READ_RESPONSE_LAST.
    ReadResponseLast = 0x0F,
    /// RDMA_READ_RESPONSE_ONLY.
    ReadResponseOnly = 0x10,
    /// ACKNOWLEDGE (ACK, RNR NAK or NAK, by the AETH syndrome).
    Acknowledge = 0x11,
    /// ATOMIC_ACKNOWLEDGE.
    AtomicAcknowledge = 0x12,
    /// CMP_SWAP.
    CompareSwap = 0x13,
    /// FETCH_ADD.
    FetchAdd = 0x14,
    /// SEND_LAST_WITH_INVALIDATE (ABI 1.9): BTH, IETH, payload.
    SendLastInv = 0x16,
    /// SEND_ONLY_WITH_INVALIDATE (ABI 1.9): BTH, IETH, payload.
    SendOnlyInv = 0x17,
    /// ATOMIC_WRITE (IBTA 1.5; ABI 1.10): BTH, RETH, 8 payload bytes.
    AtomicWrite = 0x1D,
    /// UC SEND_FIRST (ABI 1.7).
    UcSendFirst = 0x20,
    /// UC SEND_MIDDLE (ABI 1.7).
    UcSendMiddle = 0x21,
    /// UC SEND_LAST (ABI 1.7).
    UcSendLast = 0x22,
    /// UC SEND_LAST_WITH_IMMEDIATE (ABI 1.7).
    UcSendLastImm = 0x23,
    /// UC SEND_ONLY (ABI 1.7).
    UcSendOnly = 0x24,
    /// UC SEND_ONLY_WITH_IMMEDIATE (ABI 1.7).
    UcSendOnlyImm = 0x25,
    /// UC RDMA_WRITE_FIRST (ABI 1.7).
    UcWriteFirst = 0x26,
    /// UC RDMA_WRITE_MIDDLE (ABI 1.7).
    UcWriteMiddle = 0x27,
    /// UC RDMA_WRITE_LAST (ABI 1.7).
    UcWriteLast = 0x28,
    /// UC RDMA_WRITE_LAST_WITH_IMMEDIATE (ABI 1.7).
    UcWriteLastImm = 0x29,
    /// UC RDMA_WRITE_ONLY (ABI 1.7).
    UcWriteOnly = 0x2A,
    /// UC RDMA_WRITE_ONLY_WITH_IMMEDIATE (ABI 1.7).
    UcWriteOnlyImm = 0x2B,
    /// UD SEND_ONLY (ABI 1.5): BTH, DETH, payload.
    UdSendOnly = 0x64,
    /// UD SEND_ONLY_WITH_IMMEDIATE (ABI 1.5): BTH, DETH, ImmDt, payload.
    UdSendOnlyImm = 0x65,
}

impl Opcode {
    /// Every opcode, in numeric order.
    pub const ALL: [Opcode; 38] = [
        Opcode::SendFirst,
        Opcode::SendMiddle,
        Opcode::SendLast,
        Opcode::SendLastImm,
        Opcode::SendOnly,
        Opcode::SendOnlyImm,
        Opcode::WriteFirst,
        Opcode::WriteMiddle,
        Opcode::WriteLast,
        Opcode::WriteLastImm,
        Opcode::WriteOnly,
        Opcode::WriteOnlyImm,
        Opcode::ReadRequest,
        Opcode::ReadResponseFirst,
        Opcode::ReadResponseMiddle,
        Opcode::ReadResponseLast,
        Opcode::ReadResponseOnly,
        Opcode::Acknowledge,
        Opcode::AtomicAcknowledge,
        Opcode::CompareSwap,
        Opcode::FetchAdd,
        Opcode::SendLastInv,
        Opcode::SendOnlyInv,
        Opcode::AtomicWrite,
        Opcode::UcSendFirst,
        Opcode::UcSendMiddle,
        Opcode::UcSendLast,
        Opcode::UcSendLastImm,
        Opcode::UcSendOnly,
        Opcode::UcSendOnlyImm,
        Opcode::UcWriteFirst,
        Opcode::UcWriteMiddle,
        Opcode::UcWriteLast,
        Opcode::UcWriteLastImm,
        Opcode::UcWriteOnly,
        Opcode::UcWriteOnlyImm,
        Opcode::UdSendOnly,
        Opcode::UdSendOnlyImm,
    ];

    /// The opcode with BTH byte 0 equal to `v`, if it is one ringbell knows.
    pub fn from_u8(v: u8) -> Option<Opcode> {
        BY_BYTE[usize::from(v)]
    }

    /// The BTH byte 0 value.
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// The IBTA name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Opcode::SendFirst => "SEND_FIRST",
            Opcode::SendMiddle => "SEND_MIDDLE",
            Opcode::SendLast => "SEND_LAST",
            Opcode::SendLastImm => "SEND_LAST_WITH_IMMEDIATE",
            Opcode::SendOnly => "SEND_ONLY",
            Opcode::SendOnlyImm => "SEND_ONLY_WITH_IMMEDIATE",
            Opcode::WriteFirst => "RDMA_WRITE_FIRST",
            Opcode::WriteMiddle => "RDMA_WRITE_MIDDLE",
            Opcode::WriteLast => "RDMA_WRITE_LAST",
            Opcode::WriteLastImm => "RDMA_WRITE_LAST_WITH_IMMEDIATE",
            Opcode::WriteOnly => "RDMA_WRITE_ONLY",
            Opcode::WriteOnlyImm => "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
            Opcode::ReadRequest => "RDMA_READ_REQUEST",
            Opcode::ReadResponseFirst => "RDMA_READ_RESPONSE_FIRST",
            Opcode::ReadResponseMiddle => "RDMA_READ_RESPONSE_MIDDLE",
            Opcode::ReadResponseLast => "RDMA_READ_RESPONSE_LAST",
            Opcode::ReadResponseOnly => "RDMA_READ_RESPONSE_ONLY",
            Opcode::Acknowledge => "ACKNOWLEDGE",
            Opcode::AtomicAcknowledge => "ATOMIC_ACKNOWLEDGE",
            Opcode::CompareSwap => "CMP_SWAP",
            Opcode::FetchAdd => "FETCH_ADD",
            Opcode::SendLastInv => "SEND_LAST_WITH_INVALIDATE",
            Opcode::SendOnlyInv => "SEND_ONLY_WITH_INVALIDATE",
            Opcode::AtomicWrite => "ATOMIC_WRITE",
            Opcode::UcSendFirst => "UC_SEND_FIRST",
            Opcode::UcSendMiddle => "UC_SEND_MIDDLE",
            Opcode::UcSendLast => "UC_SEND_LAST",
            Opcode::UcSendLastImm => "UC_SEND_LAST_WITH_IMMEDIATE",
            Opcode::UcSendOnly => "UC_SEND_ONLY",
            Opcode::UcSendOnlyImm => "UC_SEND_ONLY_WITH_IMMEDIATE",
            Opcode::UcWriteFirst => "UC_RDMA_WRITE_FIRST",
            Opcode::UcWriteMiddle => "UC_RDMA_WRITE_MIDDLE",
            Opcode::UcWriteLast => "UC_RDMA_WRITE_LAST",
            Opcode::UcWriteLastImm => "UC_RDMA_WRITE_LAST_WITH_IMMEDIATE",
            Opcode::UcWriteOnly => "UC_RDMA_WRITE_ONLY",
            Opcode::UcWriteOnlyImm => "UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE",
            Opcode::UdSendOnly => "UD_SEND_ONLY",
            Opcode::UdSendOnlyImm => "UD_SEND_ONLY_WITH_IMMEDIATE",
        }
    }

    /// The RC operation with the same headers and meaning: a UC opcode's RC twin (same low
    /// five bits); any other opcode itself.
    pub const fn base(self) -> Opcode {
        match self {
            Opcode::UcSendFirst => Opcode::SendFirst,
            Opcode::UcSendMiddle => Opcode::SendMiddle,
            Opcode::UcSendLast => Opcode::SendLast,
            Opcode::UcSendLastImm => Opcode::SendLastImm,
            Opcode::UcSendOnly => Opcode::SendOnly,
            Opcode::UcSendOnlyImm => Opcode::SendOnlyImm,
            Opcode::UcWriteFirst => Opcode::WriteFirst,
            Opcode::UcWriteMiddle => Opcode::WriteMiddle,
            Opcode::UcWriteLast => Opcode::WriteLast,
            Opcode::UcWriteLastImm => Opcode::WriteLastImm,
            Opcode::UcWriteOnly => Opcode::WriteOnly,
            Opcode::UcWriteOnlyImm => Opcode::WriteOnlyImm,
            op => op,
        }
    }

    /// The UC opcode of an RC SEND or RDMA WRITE opcode; `None` for an operation UC does not
    /// have (READ, atomics, responses) and for UD.
    pub fn to_uc(self) -> Option<Opcode> {
        match self.base() {
            op if op.is_send() || op.is_write() => Opcode::from_u8(op as u8 | 0x20),
            _ => None,
        }
    }

    /// A UC opcode (ABI 1.7).
    pub const fn is_uc(self) -> bool {
        (self as u8) & 0xE0 == 0x20
    }

    /// This opcode's bits in [`TRAITS`].
    #[inline]
    const fn traits(self, bits: u16) -> bool {
        TRAITS[self as usize] & bits != 0
    }

    /// A RETH follows the BTH.
    pub const fn has_reth(self) -> bool {
        self.traits(T_RETH)
    }

    /// An AETH follows the BTH.
    pub const fn has_aeth(self) -> bool {
        self.traits(T_AETH)
    }

    /// An AtomicETH follows the BTH.
    pub const fn has_atomic_eth(self) -> bool {
        self.traits(T_ATOMIC_ETH)
    }

    /// An AtomicAckETH follows the AETH.
    pub const fn has_atomic_ack_eth(self) -> bool {
        self.traits(T_ATOMIC_ACK)
    }

    /// An ImmDt header is present (after the RETH or DETH, if any).
    pub const fn has_immdt(self) -> bool {
        self.traits(T_IMMDT)
    }

    /// An IETH follows the BTH: the SEND_*_WITH_INVALIDATE opcodes (ABI 1.9). Its R_Key is
    /// carried in [`PacketRepr::imm`].
    pub const fn has_ieth(self) -> bool {
        self.traits(T_IETH)
    }

    /// A DETH follows the BTH: the UD opcodes.
    pub const fn has_deth(self) -> bool {
        self.is_ud()
    }

    /// A UD opcode (ABI 1.5).
    pub const fn is_ud(self) -> bool {
        self.traits(T_UD)
    }

    /// Handled by the responder: SEND, RDMA WRITE, RDMA READ request and atomics.
    pub fn is_request(self) -> bool {
        !self.is_response()
    }

    /// Handled by the requester: read responses, ACK and atomic ACK.
    pub fn is_response(self) -> bool {
        self.traits(T_RESPONSE)
    }

    /// An RC or UC SEND opcode (any position, with or without immediate).
    pub fn is_send(self) -> bool {
        self.traits(T_SEND)
    }

    /// An RC or UC RDMA WRITE opcode (any position, with or without immediate).
    pub fn is_write(self) -> bool {
        self.traits(T_WRITE)
    }

    /// An RDMA READ response opcode (any position).
    pub fn is_read_response(self) -> bool {
        self.traits(T_READ_RESPONSE)
    }

    /// An atomic request (CMP_SWAP or FETCH_ADD).
    pub fn is_atomic(self) -> bool {
        self.has_atomic_eth()
    }

    /// An ATOMIC WRITE request (IBTA 1.5; ABI 1.10).
    pub fn is_atomic_write(self) -> bool {
        self.traits(T_ATOMIC_WRITE)
    }

    /// Starts a message: a FIRST or ONLY packet, or a single-packet operation.
    pub fn is_first(self) -> bool {
        self.traits(T_FIRST)
    }

    /// Ends a message: a LAST or ONLY packet, or a single-packet operation.
    pub fn is_last(self) -> bool {
        self.traits(T_LAST)
    }

    /// The bits of [`TRAITS`] for this opcode, from its definition: the table's source.
    const fn traits_of(self) -> u16 {
        use Opcode::*;
        // A UC opcode has its RC twin's headers and position.
        let b = self.base();
        let mut t = 0;
        if matches!(
            b,
            WriteFirst | WriteOnly | WriteOnlyImm | ReadRequest | AtomicWrite
        ) {
            t |= T_RETH;
        }
        if matches!(b, AtomicWrite) {
            t |= T_ATOMIC_WRITE;
        }
        if matches!(
            b,
            ReadResponseFirst
                | ReadResponseLast
                | ReadResponseOnly
                | Acknowledge
                | AtomicAcknowledge
        ) {
            t |= T_AETH;
        }
        if matches!(b, CompareSwap | FetchAdd) {
            t |= T_ATOMIC_ETH;
        }
        if matches!(b, AtomicAcknowledge) {
            t |= T_ATOMIC_ACK;
        }
        if matches!(
            b,
            SendLastImm | SendOnlyImm | WriteLastImm | WriteOnlyImm | UdSendOnlyImm
        ) {
            t |= T_IMMDT;
        }
        if matches!(b, SendLastInv | SendOnlyInv) {
            t |= T_IETH | T_SEND;
        }
        if matches!(b, UdSendOnly | UdSendOnlyImm) {
            t |= T_UD;
        }
        if matches!(
            b,
            ReadResponseFirst
                | ReadResponseMiddle
                | ReadResponseLast
                | ReadResponseOnly
                | Acknowledge
                | AtomicAcknowledge
        ) {
            t |= T_RESPONSE;
        }
        if (b as u8) <= SendOnlyImm as u8 {
            t |= T_SEND;
        }
        if (b as u8) >= WriteFirst as u8 && (b as u8) <= WriteOnlyImm as u8 {
            t |= T_WRITE;
        }
        if (b as u8) >= ReadResponseFirst as u8 && (b as u8) <= ReadResponseOnly as u8 {
            t |= T_READ_RESPONSE;
        }
        if !matches!(
            b,
            SendMiddle
                | SendLast
                | SendLastImm
                | SendLastInv
                | WriteMiddle
                | WriteLast
                | WriteLastImm
                | ReadResponseMiddle
                | ReadResponseLast
        ) {
            t |= T_FIRST;
        }
        if !matches!(
            b,
            SendFirst
                | SendMiddle
                | WriteFirst
                | WriteMiddle
                | ReadResponseFirst
                | ReadResponseMiddle
        ) {
            t |= T_LAST;
        }
        t
    }

    /// BTH plus the extended headers of this opcode, in bytes.
    pub fn header_len(self) -> usize {
        usize::from(HEADER_LEN[self as usize])
    }

    /// [`Opcode::header_len`] worked out from the per-header predicates (the table's source).
    const fn header_len_of(self) -> usize {
        let mut len = BTH_LEN;
        if self.has_deth() {
            len += DETH_LEN;
        }
        if self.has_reth() {
            len += RETH_LEN;
        }
        if self.has_aeth() {
            len += AETH_LEN;
        }
        if self.has_atomic_eth() {
            len += ATOMIC_ETH_LEN;
        }
        if self.has_atomic_ack_eth() {
            len += ATOMIC_ACK_ETH_LEN;
        }
        if self.has_immdt() || self.has_ieth() {
            len += IMMDT_LEN;
        }
        len
    }

    /// The packet may carry payload bytes (SEND, RDMA WRITE, read responses, UD SEND,
    /// ATOMIC WRITE).
    pub fn has_payload(self) -> bool {
        self.is_send()
            || self.is_write()
            || self.is_read_response()
            || self.is_ud()
            || self.is_atomic_write()
    }
}

/// [`Opcode::from_u8`] as a table over every byte value.
const BY_BYTE: [Option<Opcode>; 256] = {
    let mut t = [None; 256];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        t[Opcode::ALL[i] as usize] = Some(Opcode::ALL[i]);
        i += 1;
    }
    t
};

// The bits of an opcode's entry in [`TRAITS`], one per predicate.
const T_RETH: u16 = 1 << 0;
const T_AETH: u16 = 1 << 1;
const T_ATOMIC_ETH: u16 = 1 << 2;
const T_ATOMIC_ACK: u16 = 1 << 3;
const T_IMMDT: u16 = 1 << 4;
const T_UD: u16 = 1 << 5;
const T_RESPONSE: u16 = 1 << 6;
const T_SEND: u16 = 1 << 7;
const T_WRITE: u16 = 1 << 8;
const T_READ_RESPONSE: u16 = 1 << 9;
const T_FIRST: u16 = 1 << 10;
const T_LAST: u16 = 1 << 11;
const T_ATOMIC_WRITE: u16 = 1 << 13;
const T_IETH: u16 = 1 << 12;

/// Every predicate of every opcode, by opcode byte (others 0, never read): one load answers
/// any of them on the packet path.
const TRAITS: [u16; Opcode::UdSendOnlyImm as usize + 1] = {
    let mut t = [0u16; Opcode::UdSendOnlyImm as usize + 1];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        let op = Opcode::ALL[i];
        t[op as usize] = op.traits_of();
        i += 1;
    }
    t
};

/// [`Opcode::header_len`] by opcode byte, for every opcode (others 0, never read).
const HEADER_LEN: [u8; Opcode::UdSendOnlyImm as usize + 1] = {
    let mut t = [0u8; Opcode::UdSendOnlyImm as usize + 1];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        let op = Opcode::ALL[i];
        t[op as usize] = op.header_len_of() as u8;
        i += 1;
    }
    t
};

impl From<Opcode> for u8 {
    fn from(op: Opcode) -> u8 {
        op as u8
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `frame` is RoCEv2 by its outer headers alone (EtherType IPv4, IHL 5, protocol
/// UDP, destination port 4791), without checking them: what a NIC with flow-steering rules
/// gives its transport rather than its rules (ABI 1.12).
pub fn is_rocev2(frame: &[u8]) -> bool {
    let Some(h) = frame.get(..ROCE_OUTER_LEN) else {
        return false;
    };
    let ip = &h[ETH_HDR_LEN..];
    let udp = &h[ETH_HDR_LEN + IPV4_HDR_LEN..];
    h[12..14] == ETHERTYPE_IPV4.to_be_bytes()
        && ip[0] == 0x45
        && ip[9] == IPPROTO_UDP
        && udp[2..4] == ROCEV2_UDP_PORT.to_be_bytes()
}

/// Number of pad bytes that bring `payload_len` to a multiple of 4.
pub fn pad_len(payload_len: usize) -> u8 {
    (payload_len.wrapping_neg() & 3) as u8
}

fn be_u16(b: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([b[off], b[off + 1]])
}

fn be_u24(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([0, b[off], b[off + 1], b[off + 2]])
}

fn be_u32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn be_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(a)
}

fn put_u24(out: &mut [u8], off: usize, v: u32) {
    out[off..off + 3].copy_from_slice(&v.to_be_bytes()[1..]);
}

/// Fixed BTH fields (smoltcp style Repr).
///
/// The reserved bits (byte 4 bits 5:0 and byte 8 bits 6:0) are ignored on parse and written
/// as zero on emit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BthRepr {
    /// Raw opcode byte, so unknown opcodes can be represented; see [`Opcode::from_u8`].
    pub opcode: u8,
    /// SE: solicited event.
    pub solicited: bool,
    /// M: path migration request (ringbell sends 0, receivers ignore it).
    pub mig_req: bool,
    /// PadCnt, 0..=3 (only the low 2 bits are emitted).
    pub pad: u8,
    /// Transport header version, must be 0 (only the low 4 bits are emitted).
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// FECN congestion bit (masked in the ICRC).
    pub fecn: bool,
    /// BECN congestion bit (masked in the ICRC).
    pub becn: bool,
    /// Destination QP number.
    pub dest_qp: Qpn,
    /// A: acknowledge request.
    pub ack_req: bool,
    /// Packet sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// Parses the first [`BTH_LEN`] bytes of `b`. Any bit pattern is a valid BTH here; the
    /// TVer and opcode checks belong to [`parse_packet`].
    #[inline]
    pub fn parse(b: &[u8]) -> Result<BthRepr, WireError> {
        if b.len() < BTH_LEN {
            return Err(WireError::Truncated);
        }
        Ok(BthRepr {
            opcode: b[0],
            solicited: b[1] & 0x80 != 0,
            mig_req: b[1] & 0x40 != 0,
            pad: (b[1] >> 4) & 0x3,
            tver: b[1] & 0x0F,
            pkey: be_u16(b, 2),
            fecn: b[4] & 0x80 != 0,
            becn: b[4] & 0x40 != 0,
            dest_qp: Qpn::from_bits(be_u24(b, 5)),
            ack_req: b[8] & 0x80 != 0,
            psn: Psn::new(be_u24(b, 9)),
        })
    }

    /// Writes the BTH into `out[..12]`.
    ///
    /// # Panics
    /// If `out` is shorter than [`BTH_LEN`].
    pub fn emit(&self, out: &mut [u8]) {
        let out = &mut out[..BTH_LEN];
        out[0] = self.opcode;
        out[1] = (u8::from(self.solicited) << 7)
            | (u8::from(self.mig_req) << 6)
            | ((self.pad & 0x3) << 4)
            | (self.tver & 0x0F);
        out[2..4].copy_from_slice(&self.pkey.to_be_bytes());
        out[4] = (u8::from(self.fecn) << 7) | (u8::from(self.becn) << 6);
        put_u24(out, 5, self.dest_qp.get());
        out[8] = u8::from(self.ack_req) << 7;
        put_u24(out, 9, self.psn.get());
    }
}

/// RDMA Extended Transport Header: the remote buffer of an RDMA WRITE or READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// DMA length: the whole message length (WRITE) or the bytes requested (READ).
    pub len: u32,
}

impl Reth {
    /// Parses the first [`RETH_LEN`] bytes of `b`.
    #[inline]
    pub fn parse(b: &[u8]) -> Result<Reth, WireError> {
        if b.len() < RETH_LEN {
            return Err(WireError::Truncated);
        }
        Ok(Reth {
            va: be_u64(b, 0),
            rkey: be_u32(b, 8),
            len: be_u32(b, 12),
        })
    }

    /// Writes the RETH into `out[..16]`.
    ///
    /// # Panics
    /// If `out` is shorter than [`RETH_LEN`].
    pub fn emit(&self, out: &mut [u8]) {
        let out = &mut out[..RETH_LEN];
        out[0..8].copy_from_slice(&self.va.to_be_bytes());
        out[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        out[12..16].copy_from_slice(&self.len.to_be_bytes());
    }
}

/// Atomic Extended Transport Header: operands of CMP_SWAP and FETCH_ADD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AtomicEth {
    /// Remote virtual address (8-byte aligned for a valid request).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value (CMP_SWAP) or addend (FETCH_ADD).
    pub swap_add: u64,
    /// Compare value (CMP_SWAP; 0 for FETCH_ADD).
    pub compare: u64,
}

impl AtomicEth {
    /// Parses the first [`ATOMIC_ETH_LEN`] bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<AtomicEth, WireError> {
        if b.len() < ATOMIC_ETH_LEN {
            return Err(WireError::Truncated);
        }
        Ok(AtomicEth {
            va: be_u64(b, 0),
            rkey: be_u32(b, 8),
            swap_add: be_u64(b, 12),
            compare: be_u64(b, 20),
        })
    }

    /// Writes the AtomicETH into `out[..28]`.
    ///
    /// # Panics
    /// If `out` is shorter than [`ATOMIC_ETH_LEN`].
    pub fn emit(&self, out: &mut [u8]) {
        let out = &mut out[..ATOMIC_ETH_LEN];
        out[0..8].copy_from_slice(&self.va.to_be_bytes());
        out[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        out[12..20].copy_from_slice(&self.swap_add.to_be_bytes());
        out[20..28].copy_from_slice(&self.compare.to_be_bytes());
    }
}

/// Datagram Extended Transport Header (UD): the Q_Key the receiver checks and the sending
/// QP, which the receive completion reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Deth {
    /// Queue key.
    pub qkey: u32,
    /// Source QP number (24 bits on the wire; the byte before it is reserved).
    pub src_qp: Qpn,
}

impl Deth {
    /// Parses the first [`DETH_LEN`] bytes of `b`; the reserved byte is ignored.
    pub fn parse(b: &[u8]) -> Result<Deth, WireError> {
        if b.len() < DETH_LEN {
            return Err(WireError::Truncated);
        }
        Ok(Deth {
            qkey: be_u32(b, 0),
            src_qp: Qpn::from_bits(be_u24(b, 5)),
        })
    }

    /// Writes the DETH into `out[..8]`, the reserved byte as zero.
    ///
    /// # Panics
    /// If `out` is shorter than [`DETH_LEN`].
    pub fn emit(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.qkey.to_be_bytes());
        out[4] = 0;
        put_u24(out, 5, self.src_qp.get());
    }
}

/// NAK codes (AETH syndrome type 11).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    /// PSN sequence error (0x60).
    PsnSequenceError = 0,
    /// Invalid request (0x61).
    InvalidRequest = 1,
    /// Remote access error (0x62).
    RemoteAccessError = 2,
    /// Remote operational error (0x63).
    RemoteOperationalError = 3,
    /// Invalid RD request (0x64; never valid for RC, but representable).
    InvalidRdRequest = 4,
}

impl NakCode {
    /// The NAK code for the 5-bit value field. The reserved codes 5..=31 (syndromes
    /// 0x65..=0x7F) decode as [`NakCode::RemoteOperationalError`], as rxe does.
    pub fn from_value(v: u8) -> NakCode {
        match v & 0x1F {
            0 => NakCode::PsnSequenceError,
            1 => NakCode::InvalidRequest,
            2 => NakCode::RemoteAccessError,
            4 => NakCode::InvalidRdRequest,
            _ => NakCode::RemoteOperationalError,
        }
    }
}

/// The AETH syndrome byte, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AethSyndrome {
    /// ACK (type 00) with a 5-bit credit code; 0x1F means no credit limit.
    Ack {
        /// Credit code, see [`credit_count`].
        credits: u8,
    },
    /// RNR NAK (type 01) with a 5-bit RNR timer code, see [`rnr_timer_ps`].
    RnrNak {
        /// RNR timer code.
        timer: u8,
    },
    /// NAK (type 11).
    Nak(NakCode),
}

impl AethSyndrome {
    /// Decodes a syndrome byte. Bit 7 set or type 10 is [`WireError::BadSyndrome`]; reserved
    /// NAK codes 0x65..=0x7F decode as [`NakCode::RemoteOperationalError`].
    #[inline]
    pub fn from_u8(v: u8) -> Result<AethSyndrome, WireError> {
        let value = v & 0x1F;
        match v >> 5 {
            0b000 => Ok(AethSyndrome::Ack { credits: value }),
            0b001 => Ok(AethSyndrome::RnrNak { timer: value }),
            0b011 => Ok(AethSyndrome::Nak(NakCode::from_value(value))),
            _ => Err(WireError::BadSyndrome(v)),
        }
    }

    /// Encodes the syndrome byte (value fields are masked to 5 bits).
    pub fn to_u8(self) -> u8 {
        match self {
            AethSyndrome::Ack { credits } => credits & 0x1F,
            AethSyndrome::RnrNak { timer } => 0x20 | (timer & 0x1F),
            AethSyndrome::Nak(code) => 0x60 | code as u8,
        }
    }
}

/// ACK Extended Transport Header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aeth {
    /// ACK, RNR NAK or NAK.
    pub syndrome: AethSyndrome,
    /// Message sequence number (24 bits; emit keeps the low 24 bits).
    pub msn: u32,
}

impl Aeth {
    /// Parses the first [`AETH_LEN`] bytes of `b`.
    #[inline]
    pub fn parse(b: &[u8]) -> Result<Aeth, WireError> {
        if b.len() < AETH_LEN {
            return Err(WireError::Truncated);
        }
        Ok(Aeth {
            syndrome: AethSyndrome::from_u8(b[0])?,
            msn: be_u24(b, 1),
        })
    }

    /// Writes the AETH into `out[..4]`.
    ///
    /// # Panics
    /// If `out` is shorter than [`AETH_LEN`].
    pub fn emit(&self, out: &mut [u8]) {
        let out = &mut out[..AETH_LEN];
        out[0] = self.syndrome.to_u8();
        put_u24(out, 1, self.msn & 0x00FF_FFFF);
    }
}

/// Number of receive WQEs an ACK credit code grants; `None` for 0x1F (no limit).
/// Codes above 0x1F are read modulo 32.
pub fn credit_count(code: u8) -> Option<u32> {
    const TABLE: [u32; 31] = [
        0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
        2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
    ];
    TABLE.get(usize::from(code & 0x1F)).copied()
}

/// RNR timer code (0..=31) to picoseconds (code 0 = 655.36 ms). Codes above 31 are read
/// modulo 32.
pub fn rnr_timer_ps(code: u8) -> u64 {
    const TABLE_US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    TABLE_US[usize::from(code & 0x1F)] * 1_000_000
}

/// UDP source port for a QP pair, from the `rdma_calc_flow_label` fold: the product of the
/// two QPNs folded to 20 bits, then to 14 bits, with the top two bits set. Symmetric in its
/// arguments, so both ends of a connection pick the same port.
pub fn udp_src_port(lqpn: Qpn, rqpn: Qpn) -> u16 {
    let mut v = u64::from(lqpn.get()) * u64::from(rqpn.get());
    v ^= v >> 20;
    v ^= v >> 40;
    let fl = (v & 0xF_FFFF) as u32;
    0xC000 | ((fl & 0x3FFF) ^ ((fl & 0xF_C000) >> 14)) as u16
}

/// Addresses of one RoCEv2 endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Endpoint {
    /// Ethernet MAC address.
    pub mac: [u8; 6],
    /// IPv4 address.
    pub ip: [u8; 4],
}

/// Everything in a RoCEv2 packet except the payload.
///
/// On parse, exactly the extended headers of the opcode are `Some`. On emit, the headers are
/// chosen by `bth.opcode`: a header the opcode needs but the repr lacks is written as zeros,
/// a header the opcode does not have is ignored, and an unknown opcode gets no extended
/// headers at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketRepr {
    /// Sender addresses (Ethernet source, IPv4 source).
    pub src: Endpoint,
    /// Receiver addresses (Ethernet destination, IPv4 destination).
    pub dst: Endpoint,
    /// UDP source port (flow entropy, see [`udp_src_port`]).
    pub udp_src_port: u16,
    /// IPv4 identification (covered by the ICRC).
    pub ip_id: u16,
    /// IPv4 type of service, DSCP<<2 | ECN (masked in the ICRC).
    pub tos: u8,
    /// IPv4 time to live (masked in the ICRC).
    pub ttl: u8,
    /// Base transport header. `bth.pad` is ignored on emit and computed from the payload.
    pub bth: BthRepr,
    /// DETH, for the UD opcodes (ABI 1.5).
    pub deth: Option<Deth>,
    /// RETH, for WRITE_FIRST, WRITE_ONLY, WRITE_ONLY_WITH_IMMEDIATE and READ_REQUEST.
    pub reth: Option<Reth>,
    /// AETH, for read responses except MIDDLE, ACKNOWLEDGE and ATOMIC_ACKNOWLEDGE.
    pub aeth: Option<Aeth>,
    /// AtomicETH, for CMP_SWAP and FETCH_ADD.
    pub atomic_eth: Option<AtomicEth>,
    /// AtomicAckETH: the original remote value, for ATOMIC_ACKNOWLEDGE.
    pub atomic_ack: Option<u64>,
    /// ImmDt: the four immediate bytes read as a big-endian u32, for the *_WITH_IMMEDIATE
    /// opcodes; for the *_WITH_INVALIDATE opcodes (ABI 1.9) the IETH, the R_Key to
    /// invalidate, which sits where a SEND's ImmDt would.
    pub imm: Option<u32>,
    /// XRC (ABI 1.11): `Some` for a packet of the XRC transport, whose BTH opcode byte is
    /// [`XRC_PREFIX`] `|` the RC opcode kept in `bth.opcode`. On a request the XRCETH, right
    /// after the BTH, carries this XRC SRQ number (24 bits); a response has no XRCETH (0
    /// here).
    pub xrc: Option<u32>,
}

/// The transport bits 7:5 of an XRC opcode (ABI 1.11): `0xA0 |` the RC opcode.
pub const XRC_PREFIX: u8 = 0xA0;
/// Bytes of the XRCETH (ABI 1.11): 8 reserved bits, then the XRC SRQ number.
pub const XRCETH_LEN: usize = 4;

impl PacketRepr {
    /// The opcode, if `bth.opcode` is a known RC opcode.
    pub fn opcode(&self) -> Option<Opcode> {
        Opcode::from_u8(self.bth.opcode)
    }

    /// BTH plus extended headers as emitted for this repr's opcode (and transport).
    pub fn header_len(&self) -> usize {
        self.opcode()
            .map_or(BTH_LEN, |op| op.header_len() + self.xrceth_len(op))
    }

    /// The XRCETH's bytes for a packet of opcode `op`: on XRC requests only.
    fn xrceth_len(&self, op: Opcode) -> usize {
        if self.xrc.is_some() && op.is_request() {
            XRCETH_LEN
        } else {
            0
        }
    }

    /// Total frame length (no Ethernet FCS) for `payload_len` payload bytes, including pad
    /// and ICRC.
    pub fn frame_len(&self, payload_len: usize) -> usize {
        (ROCE_OUTER_LEN + self.header_len() + ICRC_LEN)
            .saturating_add(payload_len)
            .saturating_add(usize::from(pad_len(payload_len)))
    }

    /// Appends the whole frame to `out`: Ethernet II, IPv4 (no options, DF, UDP, correct
    /// header checksum), UDP (destination 4791, checksum 0), BTH with the pad count computed
    /// from `payload`, the extended headers in IBTA order for the opcode, the payload, zero
    /// pad to 4 bytes and the ICRC (least-significant byte first).
    ///
    /// Never panics. A payload on an opcode that carries none is written anyway (the receiver
    /// rejects it). A frame whose IPv4 total length would exceed 65535 gets length fields
    /// saturated at 65535 and is rejected by [`parse_packet`]; callers segment by PMTU.
    pub fn emit(&self, payload: &[u8], out: &mut Vec<u8>) {
        let start = out.len();
        self.emit_unsealed(payload, out);
        seal(&mut out[start..]);
    }

    /// As [`PacketRepr::emit`], but the two sums over the frame's bytes, the IPv4 header
    /// checksum and the ICRC, are left as zeros: for a sender that lets whoever first needs
    /// the bytes compute them with [`seal`] (a simulated fabric that carries the frame
    /// untouched to a receiver can skip both sums on both sides, see
    /// [`parse_packet_unsealed`]).
    pub fn emit_unsealed(&self, payload: &[u8], out: &mut Vec<u8>) {
        /// The longest run of headers: outer ones, then BTH and every extended header.
        const MAX_HDR: usize = ROCE_OUTER_LEN
            + BTH_LEN
            + XRCETH_LEN
            + DETH_LEN
            + RETH_LEN
            + ATOMIC_ETH_LEN
            + AETH_LEN
            + ATOMIC_ACK_ETH_LEN
            + IMMDT_LEN;
        const IP: usize = ETH_HDR_LEN;
        const UDP: usize = ETH_HDR_LEN + IPV4_HDR_LEN;
        let pad = pad_len(payload.len());
        let frame_len = self.frame_len(payload.len());
        let ip_total = u16::try_from(frame_len - ETH_HDR_LEN).unwrap_or(u16::MAX);
        let udp_len = ip_total.saturating_sub(IPV4_HDR_LEN as u16);

        // All headers are written into one block, appended at once.
        let mut h = [0u8; MAX_HDR];
        // Ethernet II.
        h[0..6].copy_from_slice(&self.dst.mac);
        h[6..12].copy_from_slice(&self.src.mac);
        h[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        // IPv4, its checksum left for [`seal`].
        h[IP] = 0x45;
        h[IP + IPV4_TOS_OFF] = self.tos;
        h[IP + 2..IP + 4].copy_from_slice(&ip_total.to_be_bytes());
        h[IP + 4..IP + 6].copy_from_slice(&self.ip_id.to_be_bytes());
        h[IP + 6..IP + 8].copy_from_slice(&IPV4_FLAG_DF.to_be_bytes());
        h[IP + IPV4_TTL_OFF] = self.ttl;
        h[IP + 9] = IPPROTO_UDP;
        h[IP + 12..IP + 16].copy_from_slice(&self.src.ip);
        h[IP + 16..IP + 20].copy_from_slice(&self.dst.ip);
        // UDP, checksum 0.
        h[UDP..UDP + 2].copy_from_slice(&self.udp_src_port.to_be_bytes());
        h[UDP + 2..UDP + 4].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
        h[UDP + 4..UDP + 6].copy_from_slice(&udp_len.to_be_bytes());

        // BTH and extended headers.
        let opcode = match self.xrc {
            Some(_) => self.bth.opcode | XRC_PREFIX,
            None => self.bth.opcode,
        };
        let bth = BthRepr {
            pad,
            opcode,
            ..self.bth
        };
        bth.emit(&mut h[ROCE_OUTER_LEN..]);
        let mut off = ROCE_OUTER_LEN + BTH_LEN;
        if let Some(op) = self.opcode() {
            if let (Some(srqn), XRCETH_LEN) = (self.xrc, self.xrceth_len(op)) {
                h[off..off + XRCETH_LEN].copy_from_slice(&(srqn & 0x00FF_FFFF).to_be_bytes());
                off += XRCETH_LEN;
            }
            if op.has_deth() {
                self.deth.unwrap_or_default().emit(&mut h[off..]);
                off += DETH_LEN;
            }
            if op.has_reth() {
                self.reth.unwrap_or_default().emit(&mut h[off..]);
                off += RETH_LEN;
            }
            if op.has_aeth() {
                if let Some(aeth) = self.aeth {
                    aeth.emit(&mut h[off..]);
                }
                off += AETH_LEN;
            }
            if op.has_atomic_eth() {
                self.atomic_eth.unwrap_or_default().emit(&mut h[off..]);
                off += ATOMIC_ETH_LEN;
            }
            if op.has_atomic_ack_eth() {
                let orig = self.atomic_ack.unwrap_or(0);
                h[off..off + ATOMIC_ACK_ETH_LEN].copy_from_slice(&orig.to_be_bytes());
                off += ATOMIC_ACK_ETH_LEN;
            }
            if op.has_immdt() || op.has_ieth() {
                let imm = self.imm.unwrap_or(0);
                h[off..off + IMMDT_LEN].copy_from_slice(&imm.to_be_bytes());
                off += IMMDT_LEN;
            }
        }
        // Room for the longest pad, so that the append of the pad below never reallocates.
        out.reserve(frame_len.saturating_add(3));
        out.extend_from_slice(&h[..off]);
        out.extend_from_slice(payload);
        // Pad, then room for the ICRC: an append of a fixed length cut back to the one
        // wanted is a store or two, where one of a length known only here is a call.
        let end = out.len() + usize::from(pad) + ICRC_LEN;
        out.extend_from_slice(&[0u8; 3 + ICRC_LEN]);
        out.truncate(end);
    }
}

/// A parsed frame borrowing the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Every header field.
    pub repr: PacketRepr,
    /// The payload, without pad bytes.
    pub payload: &'a [u8],
}

/// The IPv4 header checksum of a 20-byte header, computed as if its checksum field were 0.
fn ipv4_checksum(ip: &[u8]) -> u16 {
    let ip = &ip[..IPV4_HDR_LEN];
    let mut sum: u32 = 0;
    for (i, w) in ip.chunks_exact(2).enumerate() {
        // The checksum's own word counts as zero.
        let word = u32::from(u16::from_be_bytes([w[0], w[1]]));
        sum += if i == IPV4_CSUM_OFF / 2 { 0 } else { word };
    }
    // Ten 16-bit words: two folds bring the sum into 16 bits.
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    !(sum as u16)
}

/// Writes the header checksum of the 20-byte IPv4 header at the start of `ip` (nothing if
/// `ip` is shorter): for a receiver that shows the header of a frame that may have arrived
/// unsealed ([`parse_packet_unsealed`]) as the sender would have sealed it. On a header
/// whose checksum is already right it changes nothing.
pub fn write_ipv4_checksum(ip: &mut [u8]) {
    if ip.len() >= IPV4_HDR_LEN {
        let csum = ipv4_checksum(ip);
        ip[IPV4_CSUM_OFF..IPV4_CSUM_OFF + 2].copy_from_slice(&csum.to_be_bytes());
    }
}

/// ICRC over `ip_to_end`: the bytes from the IPv4 header to just before the ICRC.
/// The caller guarantees at least IPv4 + UDP + BTH bytes.
fn icrc_of(ip_to_end: &[u8]) -> u32 {
    const MASKED_LEN: usize = IPV4_HDR_LEN + UDP_HDR_LEN + BTH_LEN;
    let mut masked = [0u8; MASKED_LEN];
    masked.copy_from_slice(&ip_to_end[..MASKED_LEN]);
    masked[IPV4_TOS_OFF] = 0xFF;
    masked[IPV4_TTL_OFF] = 0xFF;
    masked[IPV4_CSUM_OFF] = 0xFF;
    masked[IPV4_CSUM_OFF + 1] = 0xFF;
    masked[IPV4_HDR_LEN + UDP_CSUM_OFF] = 0xFF;
    masked[IPV4_HDR_LEN + UDP_CSUM_OFF + 1] = 0xFF;
    masked[IPV4_HDR_LEN + UDP_HDR_LEN + BTH_FECN_BYTE] = 0xFF;
    let mut h = crc32fast::Hasher::new();
    // Stand-in for the masked InfiniBand LRH that RoCEv2 does not carry.
    h.update(&[0xFF; 8]);
    h.update(&masked);
    h.update(&ip_to_end[MASKED_LEN..]);
    h.finalize()
}

/// Checks the outer headers and returns the IPv4 total length.
fn check_outer(frame: &[u8]) -> Result<usize, WireError> {
    if frame.len() < ETH_HDR_LEN {
        return Err(WireError::Truncated);
    }
    if be_u16(frame, 12) != ETHERTYPE_IPV4 {
        return Err(WireError::NotIpv4);
    }
    let ip = &frame[ETH_HDR_LEN..];
    if ip.is_empty() {
        return Err(WireError::Truncated);
    }
    if ip[0] >> 4 != 4 {
        return Err(WireError::NotIpv4);
    }
    if ip[0] & 0x0F != 5 {
        return Err(WireError::BadIpHeader);
    }
    if ip.len() < IPV4_HDR_LEN {
        return Err(WireError::Truncated);
    }
    let total = usize::from(be_u16(ip, 2));
    if total < IPV4_HDR_LEN + UDP_HDR_LEN {
        return Err(WireError::BadLength);
    }
    if ip.len() < total {
        return Err(WireError::Truncated);
    }
    Ok(total)
}

/// The ICRC of a frame (Ethernet header first, ICRC bytes last) computed with the masked
/// IPv4 TOS/TTL/checksum, UDP checksum and BTH byte 4, after an 8-byte 0xFF prefix, without
/// looking at the stored ICRC. The ICRC sits in the last 4 bytes the IPv4 total length
/// covers; bytes after that (Ethernet padding) are ignored.
pub fn compute_icrc(frame: &[u8]) -> Result<u32, WireError> {
    let total = check_outer(frame)?;
    if total < IPV4_HDR_LEN + UDP_HDR_LEN + BTH_LEN + ICRC_LEN {
        return Err(WireError::Truncated);
    }
    let ip = &frame[ETH_HDR_LEN..ETH_HDR_LEN + total - ICRC_LEN];
    Ok(icrc_of(ip))
}

/// Writes the two sums [`PacketRepr::emit_unsealed`] leaves as zeros: the IPv4 header
/// checksum and the ICRC (in the frame's last four IPv4 bytes). Works on any frame whose
/// outer headers are sound; a frame too short or malformed to carry an ICRC is left as it is.
pub fn seal(frame: &mut [u8]) {
    let Ok(total) = check_outer(frame) else {
        return;
    };
    if total < IPV4_HDR_LEN + UDP_HDR_LEN + BTH_LEN + ICRC_LEN {
        return;
    }
    let end = ETH_HDR_LEN + total;
    write_ipv4_checksum(&mut frame[ETH_HDR_LEN..]);
    let icrc = icrc_of(&frame[ETH_HDR_LEN..end - ICRC_LEN]);
    frame[end - ICRC_LEN..end].copy_from_slice(&icrc.to_le_bytes());
}

/// Parses and fully validates a frame: Ethernet type, IPv4 version/IHL=5/not a fragment/
/// protocol/total length vs frame, header checksum, UDP destination port 4791 and length,
/// BTH TVer == 0, known RC opcode, extended headers present per opcode, pad, ICRC, AETH
/// syndrome. Never panics; every rejection is a distinct [`WireError`] variant.
///
/// Lenient on purpose: bytes after the IPv4 total length (Ethernet minimum-size padding) are
/// ignored, as are the UDP checksum, the IPv4 DF flag, the BTH reserved bits and the values
/// of the pad bytes (the ICRC still covers the last three).
pub fn parse_packet(frame: &[u8]) -> Result<Packet<'_>, WireError> {
    parse(frame, true)
}

/// As [`parse_packet`], every check but those of the two sums (IPv4 header checksum and
/// ICRC): for a frame whose sums are known to be what its sender would have written over
/// exactly these bytes (built by [`PacketRepr::emit_unsealed`] and carried unmodified), where
/// each sum would only be computed twice to compare equal. Input from anywhere else goes
/// through [`parse_packet`]; [`seal`] followed by [`parse_packet`] accepts exactly what this
/// accepts.
pub fn parse_packet_unsealed(frame: &[u8]) -> Result<Packet<'_>, WireError> {
    parse(frame, false)
}

fn parse(frame: &[u8], check_sums: bool) -> Result<Packet<'_>, WireError> {
    let total = check_outer(frame)?;
    let ip = &frame[ETH_HDR_LEN..ETH_HDR_LEN + total];
    if check_sums && be_u16(ip, IPV4_CSUM_OFF) != ipv4_checksum(ip) {
        return Err(WireError::BadIpChecksum);
    }
    if be_u16(ip, 6) & 0x3FFF != 0 {
        return Err(WireError::Fragmented);
    }
    if ip[9] != IPPROTO_UDP {
        return Err(WireError::NotUdp);
    }
    let udp = &ip[IPV4_HDR_LEN..];
    if be_u16(udp, 2) != ROCEV2_UDP_PORT {
        return Err(WireError::NotRoce);
    }
    if usize::from(be_u16(udp, 4)) != udp.len() {
        return Err(WireError::BadUdpLength);
    }
    let ib = &udp[UDP_HDR_LEN..];
    if ib.len() < BTH_LEN + ICRC_LEN {
        return Err(WireError::Truncated);
    }
    let mut bth = BthRepr::parse(ib)?;
    if bth.tver != 0 {
        return Err(WireError::BadTver);
    }
    let raw = bth.opcode;
    // XRC (ABI 1.11): the RC opcode under transport bits 101.
    let xrc_frame = raw & 0xE0 == XRC_PREFIX;
    if xrc_frame {
        bth.opcode = raw & 0x1F;
    }
    let op = Opcode::from_u8(bth.opcode).ok_or(WireError::UnknownOpcode(raw))?;
    let xrceth = xrc_frame && op.is_request();
    let hdr_len = op.header_len() + if xrceth { XRCETH_LEN } else { 0 };
    let icrc_off = ib.len() - ICRC_LEN;
    if icrc_off < hdr_len {
        return Err(WireError::Truncated);
    }
    let carried = icrc_off - hdr_len;
    if carried != 0 && !op.has_payload() {
        return Err(WireError::UnexpectedPayload);
    }
    let pad = usize::from(bth.pad);
    if pad > carried || carried & 3 != 0 {
        return Err(WireError::BadPad);
    }
    let stored = u32::from_le_bytes([
        ib[icrc_off],
        ib[icrc_off + 1],
        ib[icrc_off + 2],
        ib[icrc_off + 3],
    ]);
    if check_sums && icrc_of(&ip[..total - ICRC_LEN]) != stored {
        return Err(WireError::BadIcrc);
    }

    let mut off = BTH_LEN;
    let mut take = |len: usize| {
        let s = &ib[off..off + len];
        off += len;
        s
    };
    let xrc = match (xrc_frame, xrceth) {
        (false, _) => None,
        (true, false) => Some(0),
        (true, true) => Some(be_u32(take(XRCETH_LEN), 0) & 0x00FF_FFFF),
    };
    let deth = if op.has_deth() {
        Some(Deth::parse(take(DETH_LEN))?)
    } else {
        None
    };
    let reth = if op.has_reth() {
        Some(Reth::parse(take(RETH_LEN))?)
    } else {
        None
    };
    let aeth = if op.has_aeth() {
        Some(Aeth::parse(take(AETH_LEN))?)
    } else {
        None
    };
    let atomic_eth = if op.has_atomic_eth() {
        Some(AtomicEth::parse(take(ATOMIC_ETH_LEN))?)
    } else {
        None
    };
    let atomic_ack = if op.has_atomic_ack_eth() {
        Some(be_u64(take(ATOMIC_ACK_ETH_LEN), 0))
    } else {
        None
    };
    let imm = if op.has_immdt() || op.has_ieth() {
        Some(be_u32(take(IMMDT_LEN), 0))
    } else {
        None
    };

    let repr = PacketRepr {
        dst: Endpoint {
            mac: mac_at(frame, 0),
            ip: ipv4_at(ip, 16),
        },
        src: Endpoint {
            mac: mac_at(frame, 6),
            ip: ipv4_at(ip, 12),
        },
        udp_src_port: be_u16(udp, 0),
        ip_id: be_u16(ip, 4),
        tos: ip[IPV4_TOS_OFF],
        ttl: ip[IPV4_TTL_OFF],
        bth,
        deth,
        reth,
        aeth,
        atomic_eth,
        atomic_ack,
        imm,
        xrc,
    };
    Ok(Packet {
        repr,
        payload: &ib[hdr_len..icrc_off - pad],
    })
}

fn mac_at(b: &[u8], off: usize) -> [u8; 6] {
    let mut m = [0u8; 6];
    m.copy_from_slice(&b[off..off + 6]);
    m
}

fn ipv4_at(b: &[u8], off: usize) -> [u8; 4] {
    [b[off], b[off + 1], b[off + 2], b[off + 3]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Independent reflected CRC-32 (polynomial 0xEDB88320), one bit at a time, returning
    /// the raw register (no final inversion).
    fn crc32_register(mut reg: u32, data: &[u8]) -> u32 {
        for &b in data {
            reg ^= u32::from(b);
            for _ in 0..8 {
                reg = if reg & 1 != 0 {
                    (reg >> 1) ^ 0xEDB8_8320
                } else {
                    reg >> 1
                };
            }
        }
        reg
    }

    fn crc32_bitwise(data: &[u8]) -> u32 {
        !crc32_register(0xFFFF_FFFF, data)
    }

    /// The ICRC of a frame without trailing padding, computed from scratch: copy, mask,
    /// prefix, bitwise CRC.
    fn reference_icrc(frame: &[u8]) -> u32 {
        let mut m = vec![0xFFu8; 8];
        m.extend_from_slice(&frame[ETH_HDR_LEN..frame.len() - ICRC_LEN]);
        let ip = 8;
        let udp = ip + 20;
        let bth = udp + 8;
        m[ip + 1] = 0xFF; // TOS
        m[ip + 8] = 0xFF; // TTL
        m[ip + 10] = 0xFF; // header checksum
        m[ip + 11] = 0xFF;
        m[udp + 6] = 0xFF; // UDP checksum
        m[udp + 7] = 0xFF;
        m[bth + 4] = 0xFF; // FECN, BECN, reserved
        crc32_bitwise(&m)
    }

    fn stored_icrc(frame: &[u8]) -> u32 {
        let n = frame.len();
        u32::from_le_bytes([frame[n - 4], frame[n - 3], frame[n - 2], frame[n - 1]])
    }

    #[test]
    fn bitwise_crc_is_standard_crc32() {
        assert_eq!(crc32_bitwise(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32_register(0xFFFF_FFFF, &[0xFF; 8]), 0xDEBB_20E3);
        let mut h = crc32fast::Hasher::new();
        h.update(b"123456789");
        assert_eq!(h.finalize(), 0xCBF4_3926);
    }

    fn alice() -> Endpoint {
        Endpoint {
            mac: [0x02, 0x00, 0x00, 0x00, 0x00, 0x01],
            ip: [10, 0, 0, 1],
        }
    }

    fn bob() -> Endpoint {
        Endpoint {
            mac: [0x02, 0x00, 0x00, 0x00, 0x00, 0x02],
            ip: [10, 0, 0, 2],
        }
    }

    /// A request from alice (QP 0x11) to bob (QP 0x12) or a response from bob to alice.
    fn base(op: Opcode, psn: u32) -> PacketRepr {
        let (src, dst, dest_qp) = if op.is_response() {
            (bob(), alice(), 0x11)
        } else {
            (alice(), bob(), 0x12)
        };
        PacketRepr {
            src,
            dst,
            udp_src_port: udp_src_port(Qpn::from_bits(0x11), Qpn::from_bits(0x12)),
            ip_id: 0x1234,
            tos: 0,
            ttl: 64,
            bth: BthRepr {
                opcode: op as u8,
                solicited: false,
                mig_req: false,
                pad: 0,
                tver: 0,
                pkey: DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qp: Qpn::from_bits(dest_qp),
                ack_req: op.is_request() && op.is_last(),
                psn: Psn::new(psn),
            },
            deth: None,
            reth: None,
            aeth: None,
            atomic_eth: None,
            atomic_ack: None,
            xrc: None,
            imm: None,
        }
    }

    const GOLDEN_SEND_ONLY: &str = concat!(
        "0200000000020200000000010800",
        "4500003412344000401114830a0000010a000002",
        "c13212b700200000",
        "0430ffff0000001280000100",
        "68656c6c6f",
        "000000",
        "07dd0a63",
    );
    const GOLDEN_WRITE_ONLY_IMM: &str = concat!(
        "0200000000020200000000010800",
        "45000048123440004011146f0a0000010a000002",
        "c13212b700340000",
        "0b80ffff0000001280000101",
        "00007f000000100000002a0100000008",
        "01020304",
        "72696e6762656c6c",
        "ff4591fd",
    );
    const GOLDEN_READ_REQUEST: &str = concat!(
        "0200000000020200000000010800",
        "4500003c123440004011147b0a0000010a000002",
        "c13212b700280000",
        "0c00ffff0000001280000102",
        "00007f000000200000002a0100002000",
        "859fd578",
    );
    const GOLDEN_READ_RESPONSE_ONLY: &str = concat!(
        "0200000000010200000000020800",
        "45000038123440004011147f0a0000020a000001",
        "c13212b700240000",
        "1020ffff0000001100000102",
        "1f000002",
        "deadbeef0001",
        "0000",
        "78031c67",
    );
    const GOLDEN_ACK: &str = concat!(
        "0200000000010200000000020800",
        "4500003012344000401114870a0000020a000001",
        "c13212b7001c0000",
        "1100ffff0000001100000101",
        "1f000001",
        "49ef32fd",
    );
    const GOLDEN_RNR_NAK: &str = concat!(
        "0200000000010200000000020800",
        "4500003012344000401114870a0000020a000001",
        "c13212b7001c0000",
        "1100ffff0000001100000100",
        "2e000000",
        "ab69c2ff",
    );
    const GOLDEN_COMPARE_SWAP: &str = concat!(
        "0200000000020200000000010800",
        "45000048123440004011146f0a0000010a000002",
        "c13212b700340000",
        "1300ffff0000001280000103",
        "00007f000000300800002a0111112222333344445555666677778888",
        "eb060f55",
    );
    const GOLDEN_ATOMIC_ACK: &str = concat!(
        "0200000000010200000000020800",
        "45000038123440004011147f0a0000020a000001",
        "c13212b700240000",
        "1200ffff0000001100000103",
        "1f000003",
        "5555666677778888",
        "2c3ad9db",
    );

    const GOLDEN_UD_SEND_ONLY_IMM: &str = concat!(
        "0200000000020200000000010800",
        "4500004012344000401114770a0000010a000002",
        "c13212b7002c0000",
        "6500ffff0000001200000200",
        "1122334400000011",
        "cafef00d",
        "646174616772616d",
        "533a30e3",
    );

    /// The UD datagram of the golden vectors: QP 0x11 of A to QP 0x12 of B, Q_Key
    /// 0x1122_3344, PSN 0x200, immediate 0xCAFE_F00D, no AckReq.
    fn golden_ud() -> PacketRepr {
        let base = base(Opcode::UdSendOnlyImm, 0x200);
        PacketRepr {
            bth: BthRepr {
                ack_req: false,
                ..base.bth
            },
            deth: Some(Deth {
                qkey: 0x1122_3344,
                src_qp: Qpn::from_bits(0x11),
            }),
            imm: Some(0xCAFE_F00D),
            ..base
        }
    }

    /// (name, repr, payload, expected hex).
    fn golden() -> Vec<(&'static str, PacketRepr, Vec<u8>, &'static str)> {
        let send = PacketRepr {
            bth: BthRepr {
                pad: 3,
                ..base(Opcode::SendOnly, 0x100).bth
            },
            ..base(Opcode::SendOnly, 0x100)
        };
        let write = PacketRepr {
            bth: BthRepr {
                solicited: true,
                ..base(Opcode::WriteOnlyImm, 0x101).bth
            },
            reth: Some(Reth {
                va: 0x0000_7F00_0000_1000,
                rkey: 0x0000_2A01,
                len: 8,
            }),
            imm: Some(0x0102_0304),
            ..base(Opcode::WriteOnlyImm, 0x101)
        };
        let read = PacketRepr {
            reth: Some(Reth {
                va: 0x0000_7F00_0000_2000,
                rkey: 0x0000_2A01,
                len: 0x2000,
            }),
            ..base(Opcode::ReadRequest, 0x102)
        };
        let read_resp = PacketRepr {
            bth: BthRepr {
                pad: 2,
                ..base(Opcode::ReadResponseOnly, 0x102).bth
            },
            aeth: Some(Aeth {
                syndrome: AethSyndrome::Ack {
                    credits: AETH_CREDITS_UNLIMITED,
                },
                msn: 2,
            }),
            ..base(Opcode::ReadResponseOnly, 0x102)
        };
        let ack = PacketRepr {
            aeth: Some(Aeth {
                syndrome: AethSyndrome::Ack {
                    credits: AETH_CREDITS_UNLIMITED,
                },
                msn: 1,
            }),
            ..base(Opcode::Acknowledge, 0x101)
        };
        let rnr = PacketRepr {
            aeth: Some(Aeth {
                syndrome: AethSyndrome::RnrNak { timer: 14 },
                msn: 0,
            }),
            ..base(Opcode::Acknowledge, 0x100)
        };
        let cas = PacketRepr {
            atomic_eth: Some(AtomicEth {
                va: 0x0000_7F00_0000_3008,
                rkey: 0x0000_2A01,
                swap_add: 0x1111_2222_3333_4444,
                compare: 0x5555_6666_7777_8888,
            }),
            ..base(Opcode::CompareSwap, 0x103)
        };
        let atomic_ack = PacketRepr {
            aeth: Some(Aeth {
                syndrome: AethSyndrome::Ack {
                    credits: AETH_CREDITS_UNLIMITED,
                },
                msn: 3,
            }),
            atomic_ack: Some(0x5555_6666_7777_8888),
            ..base(Opcode::AtomicAcknowledge, 0x103)
        };
        vec![
            ("SEND_ONLY", send, b"hello".to_vec(), GOLDEN_SEND_ONLY),
            (
                "RDMA_WRITE_ONLY_WITH_IMMEDIATE",
                write,
                b"ringbell".to_vec(),
                GOLDEN_WRITE_ONLY_IMM,
            ),
            ("RDMA_READ_REQUEST", read, vec![], GOLDEN_READ_REQUEST),
            (
                "RDMA_READ_RESPONSE_ONLY",
                read_resp,
                vec![0xDE, 0xAD, 0xBE, 0xEF, 0x00, 0x01],
                GOLDEN_READ_RESPONSE_ONLY,
            ),
            ("ACKNOWLEDGE (ACK)", ack, vec![], GOLDEN_ACK),
            ("ACKNOWLEDGE (RNR NAK)", rnr, vec![], GOLDEN_RNR_NAK),
            ("CMP_SWAP", cas, vec![], GOLDEN_COMPARE_SWAP),
            ("ATOMIC_ACKNOWLEDGE", atomic_ack, vec![], GOLDEN_ATOMIC_ACK),
            (
                "UD_SEND_ONLY_WITH_IMMEDIATE",
                golden_ud(),
                b"datagram".to_vec(),
                GOLDEN_UD_SEND_ONLY_IMM,
            ),
        ]
    }

    fn emit_vec(repr: &PacketRepr, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        repr.emit(payload, &mut f);
        f
    }

    /// Recomputes the IPv4 header checksum and the ICRC after a test edited a frame.
    fn fix_checksums(f: &mut [u8]) {
        let ip = ETH_HDR_LEN;
        if f.len() >= ip + IPV4_HDR_LEN {
            let c = ipv4_checksum(&f[ip..ip + IPV4_HDR_LEN]);
            f[ip + IPV4_CSUM_OFF..ip + IPV4_CSUM_OFF + 2].copy_from_slice(&c.to_be_bytes());
        }
        if let Ok(icrc) = compute_icrc(f) {
            let end = ip + usize::from(be_u16(f, ip + 2));
            f[end - ICRC_LEN..end].copy_from_slice(&icrc.to_le_bytes());
        }
    }

    /// Flips every bit after the Ethernet header: only the masked UDP checksum and BTH byte 4
    /// may be accepted, and they must leave the ICRC unchanged.
    fn assert_bit_flips_rejected(frame: &[u8]) {
        let masked = [
            ROCE_OUTER_LEN - 2,
            ROCE_OUTER_LEN - 1,
            ROCE_OUTER_LEN + BTH_FECN_BYTE,
        ];
        let icrc = stored_icrc(frame);
        let mut f = frame.to_vec();
        for i in ETH_HDR_LEN..frame.len() {
            for bit in 0..8 {
                f[i] ^= 1 << bit;
                let r = parse_packet(&f);
                if masked.contains(&i) {
                    assert!(r.is_ok(), "masked byte {i} bit {bit}: {r:?}");
                    assert_eq!(compute_icrc(&f), Ok(icrc));
                } else {
                    assert!(r.is_err(), "flip of byte {i} bit {bit} accepted");
                }
                f[i] ^= 1 << bit;
            }
        }
    }

    #[test]
    fn golden_vectors_match_emitter_and_independent_crc() {
        for (name, repr, payload, expected) in golden() {
            let frame = emit_vec(&repr, &payload);
            assert_eq!(hex::encode(&frame), expected, "{name}");
            assert_eq!(frame, hex::decode(expected).unwrap(), "{name}");
            assert_eq!(frame.len(), repr.frame_len(payload.len()), "{name}");
            assert_eq!(reference_icrc(&frame), stored_icrc(&frame), "{name}");
            assert_eq!(compute_icrc(&frame), Ok(stored_icrc(&frame)), "{name}");
            let p = parse_packet(&frame).unwrap();
            assert_eq!(p.repr, repr, "{name}");
            assert_eq!(p.payload, &payload[..], "{name}");
        }
    }

    #[test]
    fn golden_vectors_are_in_wire_md() {
        let doc: String = include_str!("../WIRE.md").split_whitespace().collect();
        for (name, _, _, expected) in golden() {
            assert!(doc.contains(expected), "{name} vector missing from WIRE.md");
        }
    }

    #[test]
    fn golden_vectors_reject_bit_flips() {
        for (_, repr, payload, _) in golden() {
            assert_bit_flips_rejected(&emit_vec(&repr, &payload));
        }
    }

    #[test]
    fn masked_fields_do_not_change_icrc() {
        let (_, repr, payload, _) = golden().swap_remove(0);
        let icrc_with = |edit: &dyn Fn(&mut PacketRepr)| {
            let mut r = repr;
            edit(&mut r);
            compute_icrc(&emit_vec(&r, &payload)).unwrap()
        };
        let base = icrc_with(&|_| ());
        assert_eq!(icrc_with(&|r| r.ttl = 1), base);
        assert_eq!(icrc_with(&|r| r.tos = 0xB9), base);
        assert_eq!(icrc_with(&|r| r.bth.fecn = true), base);
        assert_eq!(icrc_with(&|r| r.bth.becn = true), base);
        let mut f = emit_vec(&repr, &payload);
        f[ROCE_OUTER_LEN - 2..ROCE_OUTER_LEN].copy_from_slice(&[0xAB, 0xCD]);
        f[ROCE_OUTER_LEN + BTH_FECN_BYTE] |= 0x3F;
        assert_eq!(compute_icrc(&f), Ok(base));
        assert_eq!(parse_packet(&f).unwrap().repr, repr);

        // Covered fields change it.
        assert_ne!(icrc_with(&|r| r.ip_id = 0x1235), base);
        assert_ne!(icrc_with(&|r| r.bth.ack_req = !r.bth.ack_req), base);
        assert_ne!(icrc_with(&|r| r.udp_src_port = 0xC001), base);
        assert_ne!(icrc_with(&|r| r.bth.pkey = 0x7FFF), base);
    }

    #[test]
    fn ethernet_padding_is_ignored() {
        let (_, repr, payload, _) = golden().swap_remove(0);
        let mut f = emit_vec(&repr, &payload);
        let icrc = compute_icrc(&f);
        f.extend_from_slice(&[0xEE; 10]);
        assert_eq!(compute_icrc(&f), icrc);
        let p = parse_packet(&f).unwrap();
        assert_eq!((p.repr, p.payload), (repr, &payload[..]));
    }

    #[test]
    fn each_rejection_has_its_own_error() {
        let frame = |i: usize| {
            let (_, repr, payload, _) = golden().swap_remove(i);
            emit_vec(&repr, &payload)
        };
        let ack = frame(4);
        let edit = |f: &[u8], e: &dyn Fn(&mut Vec<u8>)| {
            let mut f = f.to_vec();
            e(&mut f);
            fix_checksums(&mut f);
            parse_packet(&f).map(|p| p.repr)
        };
        let raw = |f: &[u8], e: &dyn Fn(&mut Vec<u8>)| {
            let mut f = f.to_vec();
            e(&mut f);
            parse_packet(&f).map(|p| p.repr)
        };
        assert_eq!(raw(&ack, &|f| f[12] = 0x86), Err(WireError::NotIpv4));
        assert_eq!(raw(&ack, &|f| f[14] = 0x65), Err(WireError::NotIpv4));
        assert_eq!(raw(&ack, &|f| f[14] = 0x46), Err(WireError::BadIpHeader));
        assert_eq!(raw(&ack, &|f| f[25] ^= 1), Err(WireError::BadIpChecksum));
        assert_eq!(edit(&ack, &|f| f[20] = 0x20), Err(WireError::Fragmented));
        assert_eq!(edit(&ack, &|f| f[21] = 0x08), Err(WireError::Fragmented));
        assert_eq!(edit(&ack, &|f| f[20] = 0x00).map(|_| ()), Ok(()));
        assert_eq!(edit(&ack, &|f| f[23] = 6), Err(WireError::NotUdp));
        assert_eq!(edit(&ack, &|f| f[17] = 27), Err(WireError::BadLength));
        assert_eq!(edit(&ack, &|f| f[37] = 0xB8), Err(WireError::NotRoce));
        assert_eq!(edit(&ack, &|f| f[39] += 1), Err(WireError::BadUdpLength));
        assert_eq!(edit(&ack, &|f| f[43] |= 1), Err(WireError::BadTver));
        assert_eq!(
            edit(&ack, &|f| f[42] = 0x15),
            Err(WireError::UnknownOpcode(0x15))
        );
        assert_eq!(
            edit(&ack, &|f| f[42] = 0x2C),
            Err(WireError::UnknownOpcode(0x2C))
        );
        assert_eq!(edit(&ack, &|f| f[42] = 0x0C), Err(WireError::Truncated));
        assert_eq!(
            edit(&ack, &|f| f[54] = 0x40),
            Err(WireError::BadSyndrome(0x40))
        );
        assert_eq!(
            edit(&ack, &|f| f[54] = 0x9F),
            Err(WireError::BadSyndrome(0x9F))
        );
        let last = ack.len() - 1;
        assert_eq!(raw(&ack, &|f| f[last] ^= 0x80), Err(WireError::BadIcrc));

        // Lengths that agree with each other but leave no room for BTH + ICRC.
        let short = |f: &mut Vec<u8>| {
            f.truncate(ROCE_OUTER_LEN + BTH_LEN);
            f[17] = (IPV4_HDR_LEN + UDP_HDR_LEN + BTH_LEN) as u8;
            f[39] = (UDP_HDR_LEN + BTH_LEN) as u8;
        };
        assert_eq!(edit(&ack, &short), Err(WireError::Truncated));

        // Payload on an ACK.
        let (_, ack_repr, _, _) = golden().swap_remove(4);
        let f = emit_vec(&ack_repr, &[1, 2, 3, 4]);
        assert_eq!(
            parse_packet(&f).map(|_| ()),
            Err(WireError::UnexpectedPayload)
        );

        // Pad larger than the payload, and payload plus pad not a multiple of 4.
        let (_, send, _, _) = golden().swap_remove(0);
        let empty = emit_vec(&send, &[]);
        assert_eq!(edit(&empty, &|f| f[43] = 0x20), Err(WireError::BadPad));
        let hello = frame(0);
        let odd = |f: &mut Vec<u8>| {
            f.remove(f.len() - ICRC_LEN - 1);
            f[17] -= 1;
            f[39] -= 1;
        };
        assert_eq!(edit(&hello, &odd), Err(WireError::BadPad));
    }

    #[test]
    fn unknown_opcodes_emit_bth_only() {
        let repr = PacketRepr {
            bth: BthRepr {
                opcode: 0x66,
                ..base(Opcode::SendOnly, 0).bth
            },
            reth: Some(Reth::default()),
            imm: Some(7),
            ..base(Opcode::SendOnly, 0)
        };
        let f = emit_vec(&repr, b"abc");
        assert_eq!(f.len(), ROCE_OUTER_LEN + BTH_LEN + 4 + ICRC_LEN);
        assert_eq!(f.len(), repr.frame_len(3));
        assert_eq!(
            parse_packet(&f).map(|_| ()),
            Err(WireError::UnknownOpcode(0x66))
        );
    }

    #[test]
    fn oversized_payload_does_not_panic() {
        let (_, repr, _, _) = golden().swap_remove(0);
        let payload = vec![0x5A; 70_000];
        let f = emit_vec(&repr, &payload);
        assert_eq!(f.len(), repr.frame_len(payload.len()));
        assert!(parse_packet(&f).is_err());
        assert_eq!(repr.frame_len(usize::MAX), usize::MAX);
    }

    /// XRC (ABI 1.11): a request is its RC opcode under transport bits 101 with an XRCETH
    /// (the SRQ number) right after the BTH; a response has no XRCETH; both parse back to
    /// the RC opcode with `xrc` set, and an XRC byte whose low bits name no RC opcode is
    /// unknown.
    #[test]
    fn xrc_requests_carry_an_xrceth() {
        let mut send = base(Opcode::SendOnly, 7);
        send.xrc = Some(0x12_3456);
        let mut f = Vec::new();
        send.emit(b"hello!!!", &mut f);
        let ib = ROCE_OUTER_LEN;
        assert_eq!(f[ib], 0xA4);
        assert_eq!(
            &f[ib + BTH_LEN..ib + BTH_LEN + XRCETH_LEN],
            &[0, 0x12, 0x34, 0x56]
        );
        assert_eq!(send.header_len(), BTH_LEN + XRCETH_LEN);
        assert_eq!(f.len(), send.frame_len(8));
        let p = parse_packet(&f).unwrap();
        assert_eq!((p.repr, p.payload), (send, &b"hello!!!"[..]));
        // A WRITE: the XRCETH comes before the RETH.
        let mut write = base(Opcode::WriteOnly, 8);
        write.reth = Some(Reth {
            va: 0x1000,
            rkey: 0x55,
            len: 4,
        });
        write.xrc = Some(9);
        let mut f = Vec::new();
        write.emit(b"abcd", &mut f);
        assert_eq!(f[ib], 0xAA);
        assert_eq!(be_u32(&f, ib + BTH_LEN), 9);
        assert_eq!(be_u32(&f, ib + BTH_LEN + XRCETH_LEN + 8), 0x55);
        assert_eq!(parse_packet(&f).unwrap().repr, write);
        // An ACK: no XRCETH.
        let mut ack = base(Opcode::Acknowledge, 7);
        ack.aeth = Some(Aeth {
            syndrome: AethSyndrome::Ack { credits: 3 },
            msn: 1,
        });
        ack.xrc = Some(0);
        let mut f = Vec::new();
        ack.emit(&[], &mut f);
        assert_eq!(f[ib], 0xB1);
        assert_eq!(ack.header_len(), BTH_LEN + AETH_LEN);
        assert_eq!(parse_packet(&f).unwrap().repr, ack);
        // 0xB5: the low bits name no RC opcode.
        f[ib] = 0xB5;
        seal(&mut f);
        assert_eq!(
            parse_packet(&f).map(|_| ()),
            Err(WireError::UnknownOpcode(0xB5))
        );
    }

    #[test]
    fn opcode_table() {
        use Opcode::*;
        for (i, op) in Opcode::ALL.iter().enumerate() {
            if !op.is_ud() && !op.is_uc() && !op.has_ieth() && !op.is_atomic_write() {
                assert_eq!(usize::from(op.to_u8()), i);
            }
            assert_eq!(Opcode::from_u8(op.to_u8()), Some(*op));
            assert_ne!(op.is_request(), op.is_response());
            assert!(!op.name().is_empty());
        }
        for v in 0x15..=0xFFu8 {
            if !matches!(v, 0x16 | 0x17 | 0x1D | 0x64 | 0x65 | 0x20..=0x2B) {
                assert_eq!(Opcode::from_u8(v), None);
            }
        }
        assert!(UdSendOnly.is_ud() && UdSendOnlyImm.is_ud() && !SendOnly.is_ud());
        // ABI 1.9: the two SENDs with invalidate, RC only, an IETH where ImmDt would be.
        assert_eq!((SendLastInv.to_u8(), SendOnlyInv.to_u8()), (0x16, 0x17));
        for op in [SendLastInv, SendOnlyInv] {
            assert!(
                op.is_send() && op.is_last() && op.has_ieth() && !op.has_immdt(),
                "{op}"
            );
            assert_eq!(op.to_uc(), None);
        }
        assert!(!SendLastInv.is_first() && SendOnlyInv.is_first());
        assert_eq!(SendOnlyInv.name(), "SEND_ONLY_WITH_INVALIDATE");
        assert!(Opcode::ALL.iter().filter(|o| o.has_ieth()).count() == 2);
        // ABI 1.10: IBTA 1.5's ATOMIC WRITE, one packet with a RETH and 8 payload bytes;
        // not an RDMA WRITE (no UC twin) and not an atomic with an AtomicETH.
        assert_eq!(AtomicWrite.to_u8(), 0x1D);
        assert!(AtomicWrite.is_first() && AtomicWrite.is_last() && AtomicWrite.has_reth());
        assert!(AtomicWrite.has_payload() && AtomicWrite.is_request());
        assert!(!AtomicWrite.is_write() && !AtomicWrite.is_atomic() && !AtomicWrite.is_send());
        assert_eq!(AtomicWrite.to_uc(), None);
        assert_eq!(AtomicWrite.name(), "ATOMIC_WRITE");
        assert!(Opcode::ALL.iter().filter(|o| o.is_atomic_write()).count() == 1);
        let lens = [
            (SendFirst, 12),
            (SendMiddle, 12),
            (SendLast, 12),
            (SendLastImm, 16),
            (SendOnly, 12),
            (SendOnlyImm, 16),
            (WriteFirst, 28),
            (WriteMiddle, 12),
            (WriteLast, 12),
            (WriteLastImm, 16),
            (WriteOnly, 28),
            (WriteOnlyImm, 32),
            (ReadRequest, 28),
            (ReadResponseFirst, 16),
            (ReadResponseMiddle, 12),
            (ReadResponseLast, 16),
            (ReadResponseOnly, 16),
            (Acknowledge, 16),
            (AtomicAcknowledge, 24),
            (CompareSwap, 40),
            (FetchAdd, 40),
            (SendLastInv, 16),
            (SendOnlyInv, 16),
            (AtomicWrite, 28),
            (UdSendOnly, 20),
            (UdSendOnlyImm, 24),
        ];
        for (op, len) in lens {
            assert_eq!(op.header_len(), len, "{op}");
        }
        let responses = [
            ReadResponseFirst,
            ReadResponseMiddle,
            ReadResponseLast,
            ReadResponseOnly,
            Acknowledge,
            AtomicAcknowledge,
        ];
        let first_only = [SendFirst, WriteFirst, ReadResponseFirst];
        let last_only = [
            SendLast,
            SendLastImm,
            SendLastInv,
            WriteLast,
            WriteLastImm,
            ReadResponseLast,
        ];
        let middle = [SendMiddle, WriteMiddle, ReadResponseMiddle];
        let no_payload = [
            ReadRequest,
            Acknowledge,
            AtomicAcknowledge,
            CompareSwap,
            FetchAdd,
        ];
        for op in Opcode::ALL {
            assert_eq!(op.is_response(), responses.contains(&op), "{op}");
            // A UC opcode sits where its RC twin does in a message.
            let b = op.base();
            assert_eq!(
                op.is_first(),
                !middle.contains(&b) && !last_only.contains(&b),
                "{op}"
            );
            assert_eq!(
                op.is_last(),
                !middle.contains(&b) && !first_only.contains(&b),
                "{op}"
            );
            assert_eq!(op.has_payload(), !no_payload.contains(&op), "{op}");
        }
    }

    #[test]
    fn uc_opcodes_are_the_rc_send_and_write_ones_with_transport_001() {
        use Opcode::*;
        let mut n = 0;
        for op in Opcode::ALL.into_iter().filter(|o| o.is_uc()) {
            n += 1;
            let rc = op.base();
            assert_eq!(op.to_u8() >> 5, 0b001, "{op}");
            assert_eq!(op.to_u8() & 0x1F, rc.to_u8(), "{op}");
            assert!(!rc.is_uc() && (rc.is_send() || rc.is_write()), "{op}");
            assert_eq!(rc.to_uc(), Some(op), "{op}");
            assert_eq!(op.to_uc(), Some(op), "{op}");
            assert_eq!(op.header_len(), rc.header_len(), "{op}");
            assert_eq!(op.has_reth(), rc.has_reth(), "{op}");
            assert_eq!(op.has_immdt(), rc.has_immdt(), "{op}");
            assert_eq!((op.is_send(), op.is_write()), (rc.is_send(), rc.is_write()));
            assert_eq!((op.is_first(), op.is_last()), (rc.is_first(), rc.is_last()));
            assert!(op.is_request() && op.has_payload() && !op.is_ud(), "{op}");
            assert!(op.name().starts_with("UC_") && op.name().ends_with(rc.name()));
        }
        assert_eq!(n, 12);
        for op in [ReadRequest, CompareSwap, FetchAdd, Acknowledge, UdSendOnly] {
            assert_eq!(op.to_uc(), None, "{op}");
            assert!(!op.is_uc() && op.base() == op, "{op}");
        }
        assert_eq!(UcSendOnly.to_u8(), 0x24);
        assert_eq!(UcWriteOnlyImm.to_u8(), 0x2B);
        // A UC frame parses with the headers of its RC twin.
        let (_, mut repr, _, _) = golden().swap_remove(0);
        repr.bth.opcode = UcWriteOnlyImm.to_u8();
        repr.reth = Some(Reth {
            va: 0x1000,
            rkey: 0x42,
            len: 3,
        });
        repr.imm = Some(0xDEAD_BEEF);
        let f = emit_vec(&repr, b"abc");
        let p = parse_packet(&f).expect("a UC frame parses");
        assert_eq!(p.repr.opcode(), Some(UcWriteOnlyImm));
        assert_eq!(
            (p.repr.reth, p.repr.imm, p.payload),
            (repr.reth, repr.imm, &b"abc"[..])
        );
    }

    #[test]
    fn ud_opcodes_and_deth() {
        use Opcode::*;
        for (op, rc) in [(UdSendOnly, SendOnly), (UdSendOnlyImm, SendOnlyImm)] {
            // Transport bits 7:5 = 011 (UD), operation bits those of the RC SEND_ONLY.
            assert_eq!(op.to_u8() >> 5, 0b011, "{op}");
            assert_eq!(op.to_u8() & 0x1F, rc.to_u8(), "{op}");
            assert_eq!(op.header_len(), rc.header_len() + DETH_LEN, "{op}");
            assert!(op.has_deth() && op.is_ud() && op.is_request(), "{op}");
            assert!(op.is_first() && op.is_last() && op.has_payload(), "{op}");
            assert!(!op.is_send() && !op.has_reth() && !op.has_aeth(), "{op}");
            assert!(!op.has_atomic_eth() && !op.has_atomic_ack_eth(), "{op}");
        }
        assert_eq!(UdSendOnly.to_u8(), 0x64);
        assert_eq!(UdSendOnlyImm.to_u8(), 0x65);
        assert!(!UdSendOnly.has_immdt() && UdSendOnlyImm.has_immdt());
        assert_eq!(UdSendOnly.name(), "UD_SEND_ONLY");
        assert_eq!(UdSendOnlyImm.name(), "UD_SEND_ONLY_WITH_IMMEDIATE");
        for op in Opcode::ALL {
            assert_eq!(op.has_deth(), op.is_ud(), "{op}");
        }
        // 0x64 is also the AETH syndrome of an invalid RD request: a different byte.
        assert_eq!(
            AethSyndrome::from_u8(0x64),
            Ok(AethSyndrome::Nak(NakCode::InvalidRdRequest))
        );
        assert_eq!(Opcode::from_u8(0x66), None);
        assert_eq!(Opcode::from_u8(0x60), None);

        // DETH: Q_Key, one reserved byte, source QP, all big-endian.
        let d = Deth {
            qkey: 0x1122_3344,
            src_qp: Qpn::from_bits(0x00AB_CDEF),
        };
        let mut b = [0xEEu8; DETH_LEN + 2];
        d.emit(&mut b);
        assert_eq!(
            &b[..DETH_LEN],
            &[0x11, 0x22, 0x33, 0x44, 0x00, 0xAB, 0xCD, 0xEF]
        );
        assert_eq!(&b[DETH_LEN..], &[0xEE, 0xEE], "emit writes 8 bytes only");
        assert_eq!(Deth::parse(&b), Ok(d));
        b[4] = 0x5A;
        assert_eq!(Deth::parse(&b), Ok(d), "the reserved byte is ignored");
        assert_eq!(Deth::parse(&b[..DETH_LEN - 1]), Err(WireError::Truncated));

        // In the golden datagram the DETH follows the BTH, and the ImmDt the DETH.
        let f = emit_vec(&golden_ud(), b"datagram");
        let ib = ROCE_OUTER_LEN;
        assert_eq!(f[ib], 0x65);
        assert_eq!(f[ib + 8] & 0x80, 0, "no AckReq on a datagram");
        assert_eq!(
            &f[ib + BTH_LEN..ib + BTH_LEN + DETH_LEN],
            &[0x11, 0x22, 0x33, 0x44, 0x00, 0x00, 0x00, 0x11]
        );
        assert_eq!(
            &f[ib + BTH_LEN + DETH_LEN..ib + UdSendOnlyImm.header_len()],
            &[0xCA, 0xFE, 0xF0, 0x0D]
        );
        let p = parse_packet(&f).unwrap();
        assert_eq!(p.repr.deth, golden_ud().deth);
        assert_eq!(p.payload, b"datagram");
        // A datagram's reserved DETH byte is covered by the ICRC.
        let mut g = f.clone();
        g[ib + BTH_LEN + 4] = 1;
        assert_eq!(parse_packet(&g).map(|_| ()), Err(WireError::BadIcrc));
        fix_checksums(&mut g);
        assert_eq!(parse_packet(&g).unwrap().repr, golden_ud());

        // A UD SEND_ONLY without immediate is 4 bytes shorter and carries no ImmDt.
        let plain = PacketRepr {
            bth: BthRepr {
                opcode: UdSendOnly as u8,
                ..golden_ud().bth
            },
            imm: None,
            ..golden_ud()
        };
        let f = emit_vec(&plain, b"datagram");
        assert_eq!(
            f.len() + IMMDT_LEN,
            emit_vec(&golden_ud(), b"datagram").len()
        );
        assert_eq!(parse_packet(&f).unwrap().repr, plain);
    }

    /// The GRH area a UD receive buffer starts with (ABI.md 18.4): 20 zero bytes, then the
    /// IPv4 header of the datagram as received. For the golden datagram it is ABI.md's
    /// vector.
    #[test]
    fn grh_area_of_the_golden_datagram() {
        let f = emit_vec(&golden_ud(), b"datagram");
        let mut grh = vec![0u8; crate::cqe::GRH_LEN - IPV4_HDR_LEN];
        grh.extend_from_slice(&f[ETH_HDR_LEN..ETH_HDR_LEN + IPV4_HDR_LEN]);
        assert_eq!(grh.len(), crate::cqe::GRH_LEN);
        assert_eq!(hex::encode(&grh), crate::golden::UD_GRH);
        // The sender's IPv4 address is at bytes 32..36 of the area.
        assert_eq!(&grh[32..36], &golden_ud().src.ip);
    }

    #[test]
    fn syndrome_byte_decoding() {
        for v in 0..=0xFFu8 {
            let s = AethSyndrome::from_u8(v);
            match v {
                0x00..=0x1F => assert_eq!(s, Ok(AethSyndrome::Ack { credits: v })),
                0x20..=0x3F => assert_eq!(s, Ok(AethSyndrome::RnrNak { timer: v & 0x1F })),
                0x60..=0x64 => assert_eq!(s.unwrap().to_u8(), v),
                0x65..=0x7F => {
                    assert_eq!(s, Ok(AethSyndrome::Nak(NakCode::RemoteOperationalError)))
                }
                _ => assert_eq!(s, Err(WireError::BadSyndrome(v))),
            }
            if let Ok(s) = s {
                if v < 0x65 {
                    assert_eq!(s.to_u8(), v);
                }
            }
        }
        assert_eq!(
            AethSyndrome::from_u8(0x61),
            Ok(AethSyndrome::Nak(NakCode::InvalidRequest))
        );
    }

    #[test]
    fn timer_and_credit_tables() {
        assert_eq!(rnr_timer_ps(0), 655_360_000_000);
        assert_eq!(rnr_timer_ps(1), 10_000_000);
        assert_eq!(rnr_timer_ps(14), 1_280_000_000);
        assert_eq!(rnr_timer_ps(25), 61_440_000_000);
        assert_eq!(rnr_timer_ps(31), 491_520_000_000);
        for c in 2..32u8 {
            assert!(rnr_timer_ps(c) > rnr_timer_ps(c - 1));
        }
        assert_eq!(credit_count(0), Some(0));
        assert_eq!(credit_count(5), Some(6));
        assert_eq!(credit_count(0x1E), Some(32768));
        assert_eq!(credit_count(AETH_CREDITS_UNLIMITED), None);
    }

    #[test]
    fn udp_source_port_values() {
        let port = |a, b| udp_src_port(Qpn::from_bits(a), Qpn::from_bits(b));
        // Worked out by hand from the fold.
        assert_eq!(port(0x11, 0x12), 0xC132);
        assert_eq!(port(1, 1), 0xC001);
        assert_eq!(port(0x1234, 0x5678), 0xC01A);
        assert_eq!(port(0xFF_FFFF, 0xFF_FFFE), 0xFF12);
    }

    #[test]
    fn errors_display() {
        assert_eq!(
            WireError::UnknownOpcode(0x15).to_string(),
            "unknown opcode 0x15"
        );
        let e: Box<dyn std::error::Error> = Box::new(WireError::BadIcrc);
        assert_eq!(e.to_string(), "ICRC mismatch");
    }

    fn arb_qpn() -> impl Strategy<Value = Qpn> {
        (0..=Qpn::MAX).prop_map(Qpn::from_bits)
    }

    fn arb_bth() -> impl Strategy<Value = BthRepr> {
        (
            any::<u8>(),
            any::<bool>(),
            any::<bool>(),
            0u8..4,
            0u8..16,
            any::<u16>(),
            any::<bool>(),
            any::<bool>(),
            arb_qpn(),
            any::<bool>(),
            (0..=Psn::MASK).prop_map(Psn::new),
        )
            .prop_map(
                |(
                    opcode,
                    solicited,
                    mig_req,
                    pad,
                    tver,
                    pkey,
                    fecn,
                    becn,
                    dest_qp,
                    ack_req,
                    psn,
                )| {
                    BthRepr {
                        opcode,
                        solicited,
                        mig_req,
                        pad,
                        tver,
                        pkey,
                        fecn,
                        becn,
                        dest_qp,
                        ack_req,
                        psn,
                    }
                },
            )
    }

    fn arb_reth() -> impl Strategy<Value = Reth> {
        (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(va, rkey, len)| Reth {
            va,
            rkey,
            len,
        })
    }

    fn arb_atomic_eth() -> impl Strategy<Value = AtomicEth> {
        (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
            |(va, rkey, swap_add, compare)| AtomicEth {
                va,
                rkey,
                swap_add,
                compare,
            },
        )
    }

    fn arb_aeth() -> impl Strategy<Value = Aeth> {
        let syndrome = prop_oneof![
            (0u8..32).prop_map(|credits| AethSyndrome::Ack { credits }),
            (0u8..32).prop_map(|timer| AethSyndrome::RnrNak { timer }),
            prop::sample::select(vec![
                NakCode::PsnSequenceError,
                NakCode::InvalidRequest,
                NakCode::RemoteAccessError,
                NakCode::RemoteOperationalError,
                NakCode::InvalidRdRequest,
            ])
            .prop_map(AethSyndrome::Nak),
        ];
        (syndrome, 0..=0xFF_FFFFu32).prop_map(|(syndrome, msn)| Aeth { syndrome, msn })
    }

    fn arb_endpoint() -> impl Strategy<Value = Endpoint> {
        (any::<[u8; 6]>(), any::<[u8; 4]>()).prop_map(|(mac, ip)| Endpoint { mac, ip })
    }

    /// A packet repr consistent with its opcode (what `parse_packet` returns) and a payload.
    fn arb_packet() -> impl Strategy<Value = (PacketRepr, Vec<u8>)> {
        (
            prop::sample::select(Opcode::ALL.to_vec()),
            arb_endpoint(),
            arb_endpoint(),
            (any::<u16>(), any::<u16>(), any::<u8>(), any::<u8>()),
            arb_bth(),
            arb_reth(),
            arb_aeth(),
            arb_atomic_eth(),
            any::<u64>(),
            any::<u32>(),
            prop::collection::vec(any::<u8>(), 0..80),
            prop::option::of(0..=0xFF_FFFFu32),
        )
            .prop_map(
                |(
                    op,
                    src,
                    dst,
                    (sport, ip_id, tos, ttl),
                    bth,
                    reth,
                    aeth,
                    atomic,
                    orig,
                    imm,
                    mut payload,
                    xrc,
                )| {
                    if !op.has_payload() {
                        payload.clear();
                    }
                    let repr = PacketRepr {
                        src,
                        dst,
                        udp_src_port: sport,
                        ip_id,
                        tos,
                        ttl,
                        bth: BthRepr {
                            opcode: op as u8,
                            tver: 0,
                            pad: pad_len(payload.len()),
                            ..bth
                        },
                        deth: op.has_deth().then_some(Deth {
                            qkey: imm ^ 0x8000_0001,
                            src_qp: Qpn::from_bits(orig as u32),
                        }),
                        reth: op.has_reth().then_some(reth),
                        aeth: op.has_aeth().then_some(aeth),
                        atomic_eth: op.has_atomic_eth().then_some(atomic),
                        atomic_ack: op.has_atomic_ack_eth().then_some(orig),
                        imm: (op.has_immdt() || op.has_ieth()).then_some(imm),
                        // XRC (ABI 1.11): RC opcodes only; a response has no XRCETH.
                        xrc: xrc.filter(|_| !op.is_uc() && !op.is_ud()).map(|n| {
                            if op.is_request() {
                                n
                            } else {
                                0
                            }
                        }),
                    };
                    (repr, payload)
                },
            )
    }

    proptest! {
        #[test]
        fn bth_roundtrip(r in arb_bth()) {
            let mut b = [0u8; BTH_LEN];
            r.emit(&mut b);
            prop_assert_eq!(BthRepr::parse(&b), Ok(r));
            prop_assert_eq!(BthRepr::parse(&b[..BTH_LEN - 1]), Err(WireError::Truncated));
        }

        #[test]
        fn reth_roundtrip(r in arb_reth()) {
            let mut b = [0u8; RETH_LEN];
            r.emit(&mut b);
            prop_assert_eq!(Reth::parse(&b), Ok(r));
            prop_assert_eq!(Reth::parse(&b[..RETH_LEN - 1]), Err(WireError::Truncated));
        }

        #[test]
        fn aeth_roundtrip(r in arb_aeth()) {
            let mut b = [0u8; AETH_LEN];
            r.emit(&mut b);
            prop_assert_eq!(Aeth::parse(&b), Ok(r));
            prop_assert_eq!(Aeth::parse(&b[..AETH_LEN - 1]), Err(WireError::Truncated));
        }

        #[test]
        fn atomic_eth_roundtrip(r in arb_atomic_eth()) {
            let mut b = [0u8; ATOMIC_ETH_LEN];
            r.emit(&mut b);
            prop_assert_eq!(AtomicEth::parse(&b), Ok(r));
            prop_assert_eq!(AtomicEth::parse(&b[..ATOMIC_ETH_LEN - 1]), Err(WireError::Truncated));
        }

        #[test]
        fn deth_roundtrip(qkey in any::<u32>(), src_qp in arb_qpn(), rsvd in any::<u8>()) {
            let d = Deth { qkey, src_qp };
            let mut b = [0xFFu8; DETH_LEN];
            d.emit(&mut b);
            prop_assert_eq!(b[4], 0);
            prop_assert_eq!(Deth::parse(&b), Ok(d));
            b[4] = rsvd;
            prop_assert_eq!(Deth::parse(&b), Ok(d));
            prop_assert_eq!(Deth::parse(&b[..DETH_LEN - 1]), Err(WireError::Truncated));
        }

        #[test]
        fn packet_roundtrip((repr, payload) in arb_packet()) {
            let f = emit_vec(&repr, &payload);
            prop_assert_eq!(f.len(), repr.frame_len(payload.len()));
            prop_assert_eq!(reference_icrc(&f), stored_icrc(&f));
            let p = parse_packet(&f).unwrap();
            prop_assert_eq!(p.repr, repr);
            prop_assert_eq!(p.payload, &payload[..]);
        }

        #[test]
        fn an_unsealed_frame_sealed_later_is_the_emitted_frame((repr, payload) in arb_packet()) {
            let sealed = emit_vec(&repr, &payload);
            let mut f = Vec::new();
            repr.emit_unsealed(&payload, &mut f);
            prop_assert_eq!(f.len(), sealed.len());
            prop_assert_eq!(&f[f.len() - ICRC_LEN..], &[0u8; ICRC_LEN][..]);
            let csum = ETH_HDR_LEN + IPV4_CSUM_OFF;
            prop_assert_eq!(&f[csum..csum + 2], &[0u8; 2][..]);
            // Only the two sums differ from the sealed frame.
            let mut masked = sealed.clone();
            masked[csum..csum + 2].fill(0);
            let n = masked.len();
            masked[n - ICRC_LEN..].fill(0);
            prop_assert_eq!(&f, &masked);
            // Unsealed, it parses only without the checks of the sums, to the same packet.
            let full = parse_packet(&f).map(|_| ());
            prop_assert!(
                matches!(full, Err(WireError::BadIpChecksum | WireError::BadIcrc)),
                "an unsealed frame passed the full parse: {:?}", full
            );
            let p = parse_packet_unsealed(&f).unwrap();
            prop_assert_eq!(p.repr, repr);
            prop_assert_eq!(p.payload, &payload[..]);
            seal(&mut f);
            prop_assert_eq!(&f, &sealed);
            // Sealing never touches a frame too short to hold an ICRC.
            for n in 0..f.len() {
                let mut cut = sealed[..n].to_vec();
                seal(&mut cut);
                prop_assert_eq!(&cut[..], &sealed[..n]);
            }
        }

        #[test]
        fn packet_truncations_are_rejected((repr, payload) in arb_packet()) {
            let f = emit_vec(&repr, &payload);
            for n in 0..f.len() {
                prop_assert_eq!(parse_packet(&f[..n]).map(|_| ()), Err(WireError::Truncated));
                prop_assert!(compute_icrc(&f[..n]).is_err());
            }
        }

        #[test]
        fn packet_bit_flips_are_rejected((repr, payload) in arb_packet()) {
            assert_bit_flips_rejected(&emit_vec(&repr, &payload));
        }

        #[test]
        fn parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse_packet(&bytes);
            let _ = compute_icrc(&bytes);
        }

        #[test]
        fn mutated_frames_never_panic(
            (repr, payload) in arb_packet(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            fix in any::<bool>(),
        ) {
            let mut f = emit_vec(&repr, &payload);
            for (at, v) in edits {
                let i = ETH_HDR_LEN + at.index(f.len() - ETH_HDR_LEN);
                f[i] = v;
            }
            f.truncate(ETH_HDR_LEN + cut.index(f.len() - ETH_HDR_LEN + 1));
            if fix {
                fix_checksums(&mut f);
            }
            if let Ok(p) = parse_packet(&f) {
                // Whatever was accepted re-emits to a frame that parses the same.
                let again = emit_vec(&p.repr, p.payload);
                let q = parse_packet(&again).unwrap();
                prop_assert_eq!(q.repr, p.repr);
                prop_assert_eq!(q.payload, p.payload);
            }
        }

        #[test]
        fn emit_never_panics(
            bth in arb_bth(),
            deth in proptest::option::of((any::<u32>(), arb_qpn())),
            reth in proptest::option::of(arb_reth()),
            aeth in proptest::option::of(arb_aeth()),
            atomic_eth in proptest::option::of(arb_atomic_eth()),
            atomic_ack in proptest::option::of(any::<u64>()),
            imm in proptest::option::of(any::<u32>()),
            payload in prop::collection::vec(any::<u8>(), 0..40),
        ) {
            let deth = deth.map(|(qkey, src_qp)| Deth { qkey, src_qp });
            let repr = PacketRepr {
                bth, deth, reth, aeth, atomic_eth, atomic_ack, imm, ..base(Opcode::SendOnly, 0)
            };
            let f = emit_vec(&repr, &payload);
            prop_assert_eq!(f.len(), repr.frame_len(payload.len()));
            prop_assert_eq!(compute_icrc(&f), Ok(stored_icrc(&f)));
        }

        #[test]
        fn udp_source_port_is_symmetric(a in arb_qpn(), b in arb_qpn()) {
            let p = udp_src_port(a, b);
            prop_assert_eq!(p, udp_src_port(b, a));
            prop_assert_eq!(p & 0xC000, 0xC000);
        }
    }
}
