//! What rsockets of this library tell each other, besides the stream's bytes: the
//! connection's private data, the immediate data of every message, and the notice of a
//! remote IO mapping. Everything here is read from a peer, so every parser takes any
//! bytes.

/// The version byte of the connection's private data.
pub const VERSION: u8 = 1;
/// Bytes of a mapping notice.
pub const NOTICE_LEN: usize = 28;

/// The kinds of message (the immediate data's top four bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Stream bytes.
    Data,
    /// Credits alone.
    Credit,
    /// End of stream.
    Fin,
    /// A remote IO mapping (or its end).
    Iomap,
    /// Anything else (ignored, its slot reposted).
    Other(u8),
}

impl Kind {
    fn code(self) -> u32 {
        match self {
            Kind::Data => 0,
            Kind::Credit => 1,
            Kind::Fin => 2,
            Kind::Iomap => 3,
            Kind::Other(c) => u32::from(c & 0xF),
        }
    }
}

/// The immediate data of a message: its kind and the credits it returns (16 bits).
pub fn imm(kind: Kind, credits: u32) -> u32 {
    kind.code() << 28 | (credits & 0xFFFF)
}

/// The kind and credits of a message's immediate data.
pub fn parse_imm(v: u32) -> (Kind, u32) {
    let kind = match v >> 28 {
        0 => Kind::Data,
        1 => Kind::Credit,
        2 => Kind::Fin,
        3 => Kind::Iomap,
        c => Kind::Other(c as u8),
    };
    (kind, v & 0xFFFF)
}

/// The connection's private data: version, three reserved bytes, the slots the sender
/// offers (big-endian).
pub fn private(credits: u32) -> Vec<u8> {
    let mut v = vec![VERSION, 0, 0, 0];
    v.extend_from_slice(&credits.to_be_bytes());
    v
}

/// The credits a peer's private data offers (None: not an rsocket of this library, or
/// none offered).
pub fn parse_private(b: &[u8]) -> Option<u32> {
    match b {
        [VERSION, _, _, _, a, b, c, d, ..] => {
            Some(u32::from_be_bytes([*a, *b, *c, *d])).filter(|&c| c > 0)
        }
        _ => None,
    }
}

/// A remote IO mapping a peer announced: the stream offset it answers to, its address,
/// length and key. A length of 0 ends the mapping at that offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Notice {
    pub offset: u64,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl Notice {
    /// The notice's bytes (little-endian).
    pub fn emit(&self) -> [u8; NOTICE_LEN] {
        let mut b = [0u8; NOTICE_LEN];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Reads a notice (None: not [`NOTICE_LEN`] bytes, or a mapping whose end does not fit
    /// 64 bits).
    pub fn parse(b: &[u8]) -> Option<Notice> {
        let b: &[u8; NOTICE_LEN] = b.try_into().ok()?;
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let n = Notice {
            offset: word(0),
            addr: word(8),
            len: word(16),
            rkey: u32::from_le_bytes([b[24], b[25], b[26], b[27]]),
        };
        n.offset.checked_add(n.len)?;
        n.addr.checked_add(n.len)?;
        Some(n)
    }

    /// Whether the mapping takes `[offset, offset + len)` whole.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        offset >= self.offset
            && offset
                .checked_add(len)
                .is_some_and(|end| end <= self.offset + self.len)
    }
}

/// Bytes of the header before a datagram's payload.
pub const DGRAM_HEADER: usize = 8;

/// A datagram's header: version, a reserved byte, the sender's port (big-endian), four
/// reserved bytes. (The sender's address is the received packet's.)
pub fn dgram_header(port: u16) -> [u8; DGRAM_HEADER] {
    let p = port.to_be_bytes();
    [VERSION, 0, p[0], p[1], 0, 0, 0, 0]
}

/// The sender's port a datagram's header gives (None: not one of this library's).
pub fn parse_dgram_header(b: &[u8]) -> Option<u16> {
    match b {
        [VERSION, _, a, b, _, _, _, _, ..] => Some(u16::from_be_bytes([*a, *b])),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_round_trips_and_foreign_data_is_refused() {
        assert_eq!(parse_private(&private(32)), Some(32));
        assert_eq!(parse_private(&private(0)), None);
        assert_eq!(parse_private(&[0u8; 56]), None);
        assert_eq!(parse_private(&[VERSION, 0, 0]), None);
    }

    #[test]
    fn immediate_data_keeps_kind_and_credits_apart() {
        assert_eq!(parse_imm(imm(Kind::Fin, 0x1_0005)), (Kind::Fin, 5));
        assert_eq!(parse_imm(imm(Kind::Data, 7)), (Kind::Data, 7));
        assert_eq!(parse_imm(0xF000_0000), (Kind::Other(15), 0));
    }

    #[test]
    fn datagram_headers_round_trip() {
        assert_eq!(parse_dgram_header(&dgram_header(7174)), Some(7174));
        assert_eq!(parse_dgram_header(&[2, 0, 1, 1, 0, 0, 0, 0]), None);
        assert_eq!(parse_dgram_header(&[VERSION, 0, 1]), None);
    }

    #[test]
    fn notices_round_trip_and_overflowing_ones_are_refused() {
        let n = Notice {
            offset: 4096,
            addr: 0x7f00_0000,
            len: 100,
            rkey: 9,
        };
        assert_eq!(Notice::parse(&n.emit()), Some(n));
        assert!(n.covers(4096, 100) && n.covers(4100, 0) && !n.covers(4096, 101));
        assert!(!n.covers(u64::MAX, 2));
        let mut b = n.emit();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(Notice::parse(&b), None);
        assert_eq!(Notice::parse(&b[..27]), None);
    }
}
