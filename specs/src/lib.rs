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
pub mod types;
pub mod wire;
pub mod wqe;

pub use types::{Iova, Lkey, Psn, Qpn, Rkey, SimTime};

/// ABI major version implemented by this crate.
pub const ABI_MAJOR: u16 = 1;
/// ABI minor version implemented by this crate.
pub const ABI_MINOR: u16 = 0;
/// The value of the `ABI_VERSION` register: major in bits 31:16, minor in bits 15:0.
pub const ABI_VERSION: u32 = ((ABI_MAJOR as u32) << 16) | ABI_MINOR as u32;
