//! The ringbell device ABI, version 1, as Rust types.
//!
//! Everything that crosses the host/device boundary is defined here and in `specs/ABI.md`:
//! the BAR0 register map ([`regs`]), the command mailbox ([`cmd`]), send and receive work
//! queue entries ([`wqe`]), completion and event entries ([`cqe`]), and the RoCEv2 wire
//! headers ([`wire`]). The driver and the device model are both written against this crate,
//! never against each other.
#![forbid(unsafe_code)]

pub mod cmd;
pub mod cqe;
pub mod regs;
pub mod stats;
pub mod tm;
pub mod types;
pub mod wire;
pub mod wqe;

pub use types::{Iova, Lkey, Psn, Qpn, Rkey, SimTime};

/// ABI major version implemented by this crate.
pub const ABI_MAJOR: u16 = 1;
/// ABI minor version implemented by this crate.
pub const ABI_MINOR: u16 = 12;
/// The value of the `ABI_VERSION` register: major in bits 31:16, minor in bits 15:0.
pub const ABI_VERSION: u32 = ((ABI_MAJOR as u32) << 16) | ABI_MINOR as u32;

/// Golden vectors: hex dumps that pin the host-visible layouts. The unit tests of each module
/// assert them byte for byte, and ABI.md must carry each of them.
#[cfg(test)]
mod golden {
    pub(crate) const MODIFY_QP: &str = "0700000001010000020005000000000000000000000000001200000000000000000000000000000000000000000000000000000000000000";
    pub(crate) const WRITE_WQE: &str = "030103000300000000000000000000000020001000000000050100000000000008000000040200000030000000000000";
    pub(crate) const CQE: &str = "800005001200000000100000efbeadde87d612000000000001000000000000000000000000000000000000000000000000000000000000000000000000000001";
    pub(crate) const EQE: &str = "06000000030000000000adde000000002a000000000000000000000000000001";
    pub(crate) const UD_SEND_WQE: &str = "02010700040000000df0feca00000000120000004433221102000000000200000a00000200000000000000000000000008000000040200000030000000000000";
    pub(crate) const UD_CQE: &str = "8000020012000000300000000df0fecaa02526000000000081000000000000000000000000000000000000000000000000000200000000010a00000111000001";
    pub(crate) const UD_GRH: &str =
        "00000000000000000000000000000000000000004500004012344000401114770a0000010a000002";

    #[test]
    fn abi_md_carries_every_golden_vector() {
        let is_hex = |w: &str| w.chars().all(|c| c.is_ascii_hexdigit());
        // The hex words of the indented dump lines, concatenated.
        let dumps: String = include_str!("../ABI.md")
            .lines()
            .filter(|l| l.starts_with(' '))
            .flat_map(|l| l.split_whitespace().filter(|w| is_hex(w)))
            .collect();
        for (name, v) in [
            ("MODIFY_QP", MODIFY_QP),
            ("WRITE_WQE", WRITE_WQE),
            ("CQE", CQE),
            ("EQE", EQE),
            ("UD_SEND_WQE", UD_SEND_WQE),
            ("UD_CQE", UD_CQE),
            ("UD_GRH", UD_GRH),
        ] {
            assert!(dumps.contains(v), "ABI.md lacks the {name} golden vector");
        }
    }

    #[test]
    fn abi_md_is_the_version_of_the_crate() {
        let title = include_str!("../ABI.md").lines().next().unwrap_or_default();
        let want = format!(
            "# ringbell device ABI, version {}.{}",
            crate::ABI_MAJOR,
            crate::ABI_MINOR
        );
        assert_eq!(title, want);
        let register = format!(
            "`0x{:04X}_{:04X}`",
            crate::ABI_VERSION >> 16,
            crate::ABI_VERSION & 0xFFFF
        );
        assert!(
            include_str!("../ABI.md").contains(&format!("value {register}")),
            "ABI.md does not give the register value {register}"
        );
    }
}
