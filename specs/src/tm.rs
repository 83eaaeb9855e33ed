//! Hardware tag matching (ABI 1.2): the headers a tagged message carries, the list-operation
//! entry a driver posts to a TM-SRQ, and the limits.
//!
//! A tagged message is an ordinary RC SEND whose payload starts with a 16-byte Tag Matching
//! Header (TMH); a rendezvous request follows it with a 16-byte Rendezvous Header (RVH).
//! Both are big-endian, like every wire header.
//!
//! ```text
//! TMH  0 opcode | 1..4 reserved | 4..8 app_ctx (BE32) | 8..16 tag (BE64)
//! RVH 16..24 va (BE64) | 24..28 rkey (BE32) | 28..32 len (BE32)
//! ```

use crate::cmd::abi_struct;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Bytes in a TMH.
pub const TMH_LEN: usize = 16;
/// Bytes in an RVH.
pub const RVH_LEN: usize = 16;
/// Largest rendezvous request (TMH + RVH + user bytes) the device matches.
pub const MAX_RNDV_HDR_SIZE: u32 = 64;
/// Scatter entries per tagged buffer.
pub const TM_MAX_SGE: u32 = 1;
/// Bytes in a list-operation entry.
pub const TM_OP_SIZE: usize = 64;

/// TMH opcodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TmhOp {
    /// Not a tagged message: never matched, delivered whole to an untagged buffer.
    NoTag = 0,
    /// Rendezvous request: TMH + RVH (+ user bytes).
    Rndv = 1,
    /// End of a rendezvous, sent by the receiver's NIC: a copy of TMH + RVH.
    Fin = 2,
    /// Eager: TMH + payload.
    Eager = 3,
}

impl TmhOp {
    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Option<TmhOp> {
        Some(match v {
            0 => TmhOp::NoTag,
            1 => TmhOp::Rndv,
            2 => TmhOp::Fin,
            3 => TmhOp::Eager,
            _ => return None,
        })
    }
}

/// Tag Matching Header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Tmh {
    /// Raw opcode byte ([`TmhOp`]).
    pub opcode: u8,
    /// Opaque context, returned with a match.
    pub app_ctx: u32,
    /// The tag.
    pub tag: u64,
}

impl Tmh {
    /// Parses the first 16 bytes of `b`.
    pub fn parse(b: &[u8]) -> Option<Tmh> {
        let b: &[u8; 16] = b.get(..TMH_LEN)?.try_into().ok()?;
        Some(Tmh {
            opcode: b[0],
            app_ctx: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            tag: u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        })
    }
    /// The 16 wire bytes (reserved bytes zero).
    pub fn to_bytes(&self) -> [u8; TMH_LEN] {
        let mut b = [0u8; TMH_LEN];
        b[0] = self.opcode;
        b[4..8].copy_from_slice(&self.app_ctx.to_be_bytes());
        b[8..16].copy_from_slice(&self.tag.to_be_bytes());
        b
    }
}

/// Rendezvous Header: where the receiver reads the data from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Rvh {
    /// Sender buffer address.
    pub va: u64,
    /// Sender rkey (REMOTE_READ).
    pub rkey: u32,
    /// Bytes to read.
    pub len: u32,
}

impl Rvh {
    /// Parses the 16 bytes at `b` (the RVH follows the TMH).
    pub fn parse(b: &[u8]) -> Option<Rvh> {
        let b: &[u8; 16] = b.get(..RVH_LEN)?.try_into().ok()?;
        Some(Rvh {
            va: u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            rkey: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
            len: u32::from_be_bytes([b[12], b[13], b[14], b[15]]),
        })
    }
    /// The 16 wire bytes.
    pub fn to_bytes(&self) -> [u8; RVH_LEN] {
        let mut b = [0u8; RVH_LEN];
        b[..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..16].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Bytes of a rendezvous header: TMH then RVH (a request, or the FIN that answers it).
pub const RNDV_HDR_LEN: usize = TMH_LEN + RVH_LEN;

/// The wire bytes of a rendezvous request or FIN: `tmh` followed by `rvh`.
pub fn rndv_header(tmh: &Tmh, rvh: &Rvh) -> [u8; RNDV_HDR_LEN] {
    let mut b = [0u8; RNDV_HDR_LEN];
    b[..TMH_LEN].copy_from_slice(&tmh.to_bytes());
    b[TMH_LEN..].copy_from_slice(&rvh.to_bytes());
    b
}

/// List-operation opcodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TmOpcode {
    /// Append a tagged buffer to the matching list in slot `handle`.
    Add = 1,
    /// Remove the entry in slot `handle`.
    Del = 2,
    /// Only report the unexpected count.
    Sync = 3,
}

impl TmOpcode {
    /// Decodes an opcode byte.
    pub fn from_u8(v: u8) -> Option<TmOpcode> {
        Some(match v {
            1 => TmOpcode::Add,
            2 => TmOpcode::Del,
            3 => TmOpcode::Sync,
            _ => return None,
        })
    }
}

/// List-operation flag: write a completion.
pub const TM_OP_SIGNALED: u8 = 1 << 0;
/// List-operation flag: `unexpected_cnt` carries software's count of unexpected messages.
pub const TM_OP_SYNC: u8 = 1 << 1;

abi_struct!(
    /// A list-operation entry (64 bytes) of a TM-SRQ's operation ring. `index` must equal the
    /// low 16 bits of the entry's position, as the `wqe_index` of a send WQE. The driver
    /// names the slot (`handle`, below `max_num_tags`) an ADD fills and a DEL empties.
    TmOpEntry, 64, {
        opcode: u8, flags: u8, index: U16, handle: U32, unexpected_cnt: U32, rsvd0: U32,
        tag: U64, mask: U64, addr: U64, lkey: U32, len: U32, rsvd1: [u8; 16],
    }
);

/// Whether a message tag matches an entry: `((msg ^ tag) & mask) == 0`.
pub const fn tag_matches(msg: u64, tag: u64, mask: u64) -> bool {
    (msg ^ tag) & mask == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_big_endian() {
        let t = Tmh {
            opcode: TmhOp::Rndv as u8,
            app_ctx: 0x0102_0304,
            tag: 0x1122_3344_5566_7788,
        };
        let b = t.to_bytes();
        assert_eq!(
            b,
            [1, 0, 0, 0, 1, 2, 3, 4, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]
        );
        assert_eq!(Tmh::parse(&b), Some(t));
        let r = Rvh {
            va: 0x1000,
            rkey: 0x105,
            len: 4096,
        };
        assert_eq!(Rvh::parse(&r.to_bytes()), Some(r));
        assert_eq!(Tmh::parse(&b[..15]), None);
        assert!(tag_matches(0x1234, 0x1200, 0xff00));
        assert!(!tag_matches(0x1334, 0x1200, 0xff00));
        assert!(tag_matches(u64::MAX, 0, 0));
    }
}
