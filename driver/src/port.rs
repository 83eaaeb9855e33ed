//! The `Port` trait: everything the driver needs from a device connection.
//!
//! A port gives register access to BAR0, DMA mappings of driver memory into the device's
//! I/O address space, and a progress hook. Kernel VFIO and vfio-user are the driver's own
//! backends; the emulator implements `Port` for in-process use. Real hardware leaves
//! [`Port::progress`] empty: time passes on its own.

use std::os::fd::BorrowedFd;

/// Errors a port reports.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PortError {
    /// The IOVA range overlaps an existing mapping.
    #[error("IOVA range {iova:#x}+{len:#x} overlaps an existing mapping")]
    Overlap {
        /// Start of the range.
        iova: u64,
        /// Length of the range.
        len: u64,
    },
    /// No mapping starts at this IOVA with this length.
    #[error("no DMA mapping at {iova:#x}+{len:#x}")]
    NotMapped {
        /// Start of the range.
        iova: u64,
        /// Length of the range.
        len: u64,
    },
    /// The memory could not be mapped on the device side.
    #[error("DMA map failed: {0}")]
    MapFailed(String),
}

/// A connection to one device.
pub trait Port {
    /// Reads the 32-bit register at `offset` in BAR0. A read does not pass earlier writes.
    fn read32(&self, offset: u64) -> u32;
    /// Writes the 32-bit register at `offset` in BAR0. Stores are posted and stay ordered,
    /// and every memory store the CPU made before the call is visible to the device before
    /// this one (on hardware the implementation issues the I/O write barrier its architecture
    /// needs, e.g. `dmb oshst` on Arm; x86 stores are ordered already).
    fn write32(&self, offset: u64, value: u32);
    /// Writes `data` (a multiple of 64 bytes, at most 256) at `offset` (64-byte aligned) in
    /// BAR0 as one write-combined burst (BlueFlame), ordered after every earlier store like
    /// [`Port::write32`]. The default issues 32-bit stores, which the device assembles; a
    /// port with a write-combining mapping sends it as one transaction.
    fn write_block(&self, offset: u64, data: &[u8]) {
        for (i, w) in data.chunks_exact(4).enumerate() {
            self.write32(
                offset + 4 * i as u64,
                u32::from_le_bytes([w[0], w[1], w[2], w[3]]),
            );
        }
    }
    /// Maps `len` bytes of the memory file `fd` (from offset 0) at `iova` for device DMA.
    fn dma_map(&self, fd: BorrowedFd<'_>, len: u64, iova: u64) -> Result<(), PortError>;
    /// Removes the mapping at `iova`.
    fn dma_unmap(&self, iova: u64, len: u64) -> Result<(), PortError>;
    /// Lets the device make progress. Returns `false` when the device is idle and nothing
    /// will change without further input (an emulator with an empty event queue); hardware
    /// returns `true`.
    fn progress(&self) -> bool;
    /// A descriptor that becomes readable when the device raises MSI-X vector `vector` (an
    /// eventfd: reading its 8-byte counter clears it), or `None` when the port delivers no
    /// interrupts and [`Port::progress`] drives the device (the in-process emulator).
    fn interrupt_fd(&self, _vector: u32) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Holds off the other processes that share this device (children of `fork` share a
    /// device outside the process, and its command mailbox) for as long as the guard lives:
    /// the driver holds it for each command, as the kernel serializes the commands of an
    /// RDMA context that processes share. `None` (the default): nothing to serialize (the
    /// in-process emulator, which a child of `fork` gets a copy of).
    fn exclusive(&self) -> Option<crate::vfio::SharedGuard<'_>> {
        None
    }
    /// Whether the device runs in lockstep with the caller, one [`Port::progress`] call at a
    /// time (the in-process emulator): a command then waits until it completes or the
    /// device goes idle, and no wall-clock timeout applies. Hardware and a device served by
    /// another process keep the default.
    fn lockstep(&self) -> bool {
        false
    }
    /// The caller has nothing to do until the device clock (`CLOCK_LO`/`CLOCK_HI`) reads
    /// `clock_ps`: a software timer, such as a retry of connection management. A device in
    /// lockstep whose event queue holds nothing earlier lets its idle clock run to that
    /// time; hardware and devices in another process, whose clocks run by themselves,
    /// keep the default, which does nothing.
    fn idle_until(&self, _clock_ps: u64) {}
    /// Why the port can no longer reach its device (a broken or timed-out connection), or
    /// `None` while it can. A port whose accesses cannot fail keeps the default.
    fn failure(&self) -> Option<String> {
        None
    }
    /// Lets the device reach this process's memory on demand (on-demand paging): IOVA
    /// [`crate::HOST_IOVA_OFFSET`]` + va` is the process's virtual address `va`, whatever is
    /// mapped there when the device gets to it; an unmapped page is a DMA fault then. Only a
    /// device that shares the process's address space can; the default refuses.
    fn map_process(&self) -> Result<(), PortError> {
        Err(PortError::MapFailed(
            "on-demand paging needs a device in this process".into(),
        ))
    }
}
