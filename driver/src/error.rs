//! Driver errors: typed, carrying the object and the reason.

use crate::port::PortError;
use ringbell_specs::cmd::{CmdOpcode, CmdStatus, QpState};

/// Everything that can go wrong in the driver.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Allocating or mapping DMA memory failed.
    #[error("DMA memory: {0}")]
    Memory(String),
    /// An access outside a DMA buffer.
    #[error("range {offset}+{len} is outside a buffer of {size} bytes")]
    OutOfBounds {
        /// Start of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Size of the buffer.
        size: usize,
    },
    /// The device's MAGIC register is wrong: this is not a ringbell NIC.
    #[error("not a ringbell device (magic {0:#010x})")]
    NotADevice(u32),
    /// The device speaks another ABI major version.
    #[error("device ABI {found_major}.{found_minor}, driver speaks {expected}.x")]
    AbiMismatch {
        /// Major version reported.
        found_major: u16,
        /// Minor version reported.
        found_minor: u16,
        /// Major version this driver implements.
        expected: u16,
    },
    /// A command failed with a device status.
    #[error("command {op:?} failed: {status:?}")]
    Command {
        /// The command.
        op: CmdOpcode,
        /// The device's status code.
        status: CmdStatus,
    },
    /// A command issued by raw opcode ([`crate::Device::raw_command`]) with an opcode this
    /// driver does not know failed; `status` is the device's status byte (see `CmdStatus`).
    #[error("raw command {opcode:#06x} failed with status {status}")]
    RawCommand {
        /// The opcode as written to the mailbox.
        opcode: u16,
        /// The raw status byte.
        status: u8,
    },
    /// A command reported a status this driver does not know.
    #[error("command {op:?} returned unknown status {status}")]
    UnknownStatus {
        /// The command.
        op: CmdOpcode,
        /// The raw status.
        status: u8,
    },
    /// The device stopped making progress while the driver waited for it.
    #[error("device idle while waiting for {0}")]
    DeviceIdle(&'static str),
    /// A command did not complete within the device's command timeout
    /// ([`crate::Device::set_command_timeout`]); the device is taken as lost, and later
    /// commands fail at once with [`Error::DeviceLost`].
    #[error(
        "command {opcode:#06x} did not complete within {waited:?}: the device is taken as lost"
    )]
    CommandTimeout {
        /// The command's opcode.
        opcode: u16,
        /// How long the driver waited.
        waited: std::time::Duration,
    },
    /// The device is gone (its connection broke, or an earlier command timed out): nothing
    /// more can be asked of it.
    #[error("the device is lost: {0}")]
    DeviceLost(String),
    /// The port delivers no interrupts (the in-process emulator: poll instead).
    #[error("this port delivers no interrupts")]
    NoInterrupt,
    /// Waiting for an interrupt failed.
    #[error("waiting for an interrupt: {0}")]
    Interrupt(String),
    /// A port operation failed.
    #[error(transparent)]
    Port(#[from] PortError),
    /// The work queue has no room for the request.
    #[error("{queue} full: {needed} slots needed, {free} free")]
    QueueFull {
        /// Which queue.
        queue: &'static str,
        /// Slots the request needs.
        needed: u32,
        /// Slots free.
        free: u32,
    },
    /// Posting is not allowed in the QP's state.
    #[error("QP {qpn} is in state {state:?}")]
    InvalidState {
        /// The QP.
        qpn: u32,
        /// Its state as the driver knows it.
        state: QpState,
    },
    /// Memory given for registration ([`crate::ProtectionDomain::reg_user_mr`]) is not
    /// mapped, or cannot be mapped for the device (EFAULT).
    #[error("cannot register {addr:#x}+{len:#x}: {reason}")]
    BadAddress {
        /// Start of the range.
        addr: u64,
        /// Length of the range.
        len: u64,
        /// What is wrong with it ("not mapped at 0x...", "not readable", ...).
        reason: String,
    },
    /// A request or attribute is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The device lacks the capability the request needs (its `CAPS` bit is clear).
    #[error("not supported by the device: {0}")]
    Unsupported(&'static str),
}
