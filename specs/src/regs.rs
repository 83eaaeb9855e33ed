//! The BAR0 register map.
//!
//! BAR0 is 2 MiB. The first page holds identification, capabilities, the command interface,
//! the event queue and device status; doorbells live in pages of their own from
//! [`DB_BASE`] on, so a process can be given just the doorbell pages it needs; counter
//! windows follow from [`CNTR_BASE`], the second MiB holds one 256-byte BlueFlame slot per
//! QP from [`BF_BASE`] (ABI 1.4), and the next two MiB are the window onto the device's own
//! memory from [`DM_BASE`] (ABI 1.8; BAR0 is 4 MiB from then on). All registers
//! are 32 bits wide, little-endian, and accessed with aligned 32-bit loads and stores.
//! [`REGISTERS`] is the one table that both the driver and the model decode from.

use bitflags::bitflags;

/// Size of BAR0 in bytes (1 MiB up to ABI 1.3; the BlueFlame area doubled it in 1.4, the
/// device-memory window in 1.8).
pub const BAR0_SIZE: u64 = 4 << 20;
/// The value of the `MAGIC` register: "RBEL" in little-endian ASCII.
pub const MAGIC_VALUE: u32 = u32::from_le_bytes(*b"RBEL");
/// PCI vendor id the device reports (the reserved experimental id).
pub const PCI_VENDOR_ID: u16 = 0x1de5;
/// PCI device id of the ringbell NIC.
pub const PCI_DEVICE_ID: u16 = 0x0001;

/// Who may access a register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read only; writes are ignored and counted as a guest error.
    Ro,
    /// Read and write.
    Rw,
    /// Write only; reads return 0.
    Wo,
}

/// One entry of the register table.
#[derive(Clone, Copy, Debug)]
pub struct Register {
    /// Register name as used in ABI.md.
    pub name: &'static str,
    /// Byte offset in BAR0.
    pub offset: u64,
    /// Width in bytes (always 4 in ABI v1).
    pub width: u64,
    /// Access rights.
    pub access: Access,
    /// Value after reset (for RO identification registers: the value the device reports;
    /// capability registers report device-specific values and list 0 here).
    pub reset: u32,
    /// One-line description.
    pub doc: &'static str,
}

macro_rules! registers {
    ($( $const:ident = $off:literal, $acc:ident, $reset:expr, $doc:literal; )*) => {
        $( #[doc = $doc] pub const $const: u64 = $off; )*
        /// Every register of page 0, in offset order.
        pub const REGISTERS: &[Register] = &[
            $( Register { name: stringify!($const), offset: $off, width: 4,
                          access: Access::$acc, reset: $reset, doc: $doc }, )*
        ];
    };
}

registers! {
    MAGIC = 0x000, Ro, MAGIC_VALUE, "Identification magic, reads \"RBEL\".";
    ABI_VERSION = 0x004, Ro, crate::ABI_VERSION, "ABI version: major in 31:16, minor in 15:0.";
    DEVICE_ID = 0x008, Ro, 0, "Device instance id (node number on an emulated fabric).";
    CAPS = 0x00C, Ro, 0, "Capability flags, see [`Caps`].";
    MAX_QP = 0x010, Ro, 0, "Number of QP contexts; QPNs are 2..=MAX_QP+1 (0 and 1 are the IBTA's management QPs, never given out; ABI 1.4).";
    MAX_CQ = 0x014, Ro, 0, "Number of CQ contexts; CQNs are 1..MAX_CQ.";
    MAX_SRQ = 0x018, Ro, 0, "Number of SRQ contexts; SRQNs are 1..MAX_SRQ.";
    MAX_MR = 0x01C, Ro, 0, "Number of memory regions.";
    MAX_PD = 0x020, Ro, 0, "Number of protection domains; PDNs are 1..MAX_PD.";
    MAX_QP_WR = 0x024, Ro, 0, "Largest work queue, in entries (send: 64-byte blocks).";
    MAX_CQE = 0x028, Ro, 0, "Largest completion queue, in entries.";
    MAX_SGE = 0x02C, Ro, 0, "Most scatter/gather entries per send or receive WQE.";
    MAX_INLINE = 0x030, Ro, 0, "Most inline bytes in one send WQE (with a remote-address segment).";
    MAX_WQE_SIZE = 0x034, Ro, 0, "Largest send WQE in bytes.";
    MTU_CAPS = 0x038, Ro, 0, "Bit n set: path MTU code n (1=256 .. 5=4096) is supported.";
    TS_TICK_PS = 0x03C, Ro, 1, "Picoseconds per CQE/EQE timestamp tick.";
    MAX_MSG_SIZE = 0x040, Ro, 0, "Largest message in bytes.";
    MAX_RD_ATOMIC = 0x044, Ro, 0, "Largest max_rd_atomic / max_dest_rd_atomic per QP.";
    MAX_CNTR = 0x048, Ro, 0, "Number of event counters; counter numbers are 1..MAX_CNTR (ABI 1.3).";
    MAX_TRIGGERED = 0x04C, Ro, 0, "Entries of the triggered-operation table (ABI 1.3).";
    MAX_DM_SIZE = 0x050, Ro, 0, "Bytes of device memory (ABI 1.8); 0: none.";
    MAX_MW = 0x054, Ro, 0, "Number of memory windows (ABI 1.9); 0: none.";
    CMD_ADDR_LO = 0x080, Rw, 0, "Command mailbox IOVA, bits 31:0 (256-byte aligned).";
    CMD_ADDR_HI = 0x084, Rw, 0, "Command mailbox IOVA, bits 63:32.";
    CMD_DOORBELL = 0x088, Wo, 0, "Write a token to execute the command in the mailbox.";
    CMD_STATUS = 0x08C, Ro, 0, "Bit 31 busy; bits 23:16 status of the last command; 15:0 its token.";
    EQ_ADDR_LO = 0x090, Rw, 0, "Event queue IOVA, bits 31:0 (4 KiB aligned).";
    EQ_ADDR_HI = 0x094, Rw, 0, "Event queue IOVA, bits 63:32.";
    EQ_LOG_SIZE = 0x098, Rw, 0, "log2 of the EQ entry count; writing it (re)starts the EQ at index 0; 0 disables the EQ.";
    EQ_CI = 0x09C, Rw, 0, "EQ consumer index, written by the driver as it consumes EQEs.";
    DEV_STATUS = 0x0A0, Ro, 1, "Bit 0 ready; bit 1 fatal error; bit 2 EQ overflowed.";
    GUEST_ERRORS = 0x0A4, Ro, 0, "Count of guest programming errors seen (bad register access, bad doorbell).";
    LAST_ERROR = 0x0A8, Ro, 0, "Code of the last guest error, see [`GuestError`].";
    LAST_ERROR_INFO = 0x0AC, Ro, 0, "Object number or offset of the last guest error.";
    RESET = 0x0B0, Wo, 0, "Write [`RESET_KEY`] to reset the device: every object is destroyed.";
    CLOCK_LO = 0x0C0, Ro, 0, "Device clock in picoseconds, bits 31:0 (reading it latches bits 63:32).";
    CLOCK_HI = 0x0C4, Ro, 0, "Device clock bits 63:32 as latched by the last CLOCK_LO read.";
    MAC_LO = 0x0D0, Ro, 0, "Port MAC address bytes 0..4 (byte 0 in bits 7:0).";
    MAC_HI = 0x0D4, Ro, 0, "Port MAC address bytes 4..6 in bits 15:0.";
    IPV4_ADDR = 0x0D8, Ro, 0, "Port IPv4 address, first octet in bits 7:0.";
}

/// Value to write to [`RESET`].
pub const RESET_KEY: u32 = 0x5245_5345;

/// Start of the doorbell area.
pub const DB_BASE: u64 = 0x1_0000;
/// Bytes of doorbell per object.
pub const DB_STRIDE: u64 = 8;
/// Objects served by one 4 KiB doorbell page.
pub const DB_PER_PAGE: u64 = 4096 / DB_STRIDE;
/// QP doorbells: `QP_DB_BASE + qpn * 8`; +0 send queue producer index, +4 receive queue
/// producer index.
pub const QP_DB_BASE: u64 = DB_BASE;
/// SRQ doorbells: `SRQ_DB_BASE + srqn * 8`; +0 producer index of the untagged ring, +4 (a
/// TM-SRQ) producer index of the list-operation ring.
pub const SRQ_DB_BASE: u64 = DB_BASE + 0x4_0000;
/// CQ doorbells: `CQ_DB_BASE + cqn * 8`; +0 consumer index, +4 arm request.
pub const CQ_DB_BASE: u64 = DB_BASE + 0x6_0000;
/// Offset of the send doorbell within a QP's doorbell slot.
pub const DB_SQ: u64 = 0;
/// Offset of the receive doorbell within a QP's doorbell slot.
pub const DB_RQ: u64 = 4;
/// Offset of the list-operation doorbell within a TM-SRQ's slot.
pub const DB_SRQ_TM_OPS: u64 = 4;
/// Offset of the consumer-index doorbell within a CQ's slot.
pub const DB_CQ_CI: u64 = 0;
/// Offset of the arm doorbell within a CQ's slot.
pub const DB_CQ_ARM: u64 = 4;
/// Arm-doorbell bit: only solicited completions raise the event.
pub const CQ_ARM_SOLICITED: u32 = 1 << 31;
/// End of the doorbell area (exclusive).
pub const DB_END: u64 = DB_BASE + 0x8_0000;
const _: () = assert!(DB_END <= BAR0_SIZE);

/// Most QPs the doorbell area can address.
pub const DB_MAX_QP: u64 = (SRQ_DB_BASE - QP_DB_BASE) / DB_STRIDE;
/// Most SRQs the doorbell area can address.
pub const DB_MAX_SRQ: u64 = (CQ_DB_BASE - SRQ_DB_BASE) / DB_STRIDE;
/// Most CQs the doorbell area can address.
pub const DB_MAX_CQ: u64 = (DB_END - CQ_DB_BASE) / DB_STRIDE;

/// Start of the counter area (ABI 1.3): `CNTR_BASE + cntr * CNTR_STRIDE` is counter `cntr`'s
/// window of eight 32-bit registers (offsets `CNTR_*` below).
pub const CNTR_BASE: u64 = DB_END;
/// Bytes of register window per counter.
pub const CNTR_STRIDE: u64 = 32;
/// End of the counter area (exclusive).
pub const CNTR_END: u64 = 0x10_0000;
/// Most counters the counter area can address.
pub const CNTR_MAX: u64 = (CNTR_END - CNTR_BASE) / CNTR_STRIDE;
/// Counter window, write only: add the value to the success count.
pub const CNTR_ADD_SUCCESS: u64 = 0x00;
/// Counter window, write only: add the value to the error count.
pub const CNTR_ADD_ERROR: u64 = 0x04;
/// Counter window, read only: success bits 31:0; the read latches the other three.
pub const CNTR_SUCCESS_LO: u64 = 0x08;
/// Counter window, read only: success bits 63:32 as latched.
pub const CNTR_SUCCESS_HI: u64 = 0x0C;
/// Counter window, read only: error bits 31:0 as latched.
pub const CNTR_ERROR_LO: u64 = 0x10;
/// Counter window, read only: error bits 63:32 as latched.
pub const CNTR_ERROR_HI: u64 = 0x14;
const _: () = assert!(CNTR_BASE.is_multiple_of(4096) && CNTR_END <= BAR0_SIZE);

/// Start of the BlueFlame area (ABI 1.4): `BF_BASE + qpn * BF_STRIDE` is QP `qpn`'s slot.
/// Writing one whole send WQE (1 to 4 blocks, write-combined) there both hands the device
/// the WQE at the send queue's producer index and rings the send doorbell for it, so the
/// device starts it without fetching it from host memory.
pub const BF_BASE: u64 = CNTR_END;
/// Bytes of BlueFlame slot per QP: the largest send WQE.
pub const BF_STRIDE: u64 = crate::wqe::MAX_SEND_WQE as u64;
/// End of the BlueFlame area (exclusive).
pub const BF_END: u64 = 2 << 20;
/// QPs with a BlueFlame slot: QPNs below this.
pub const BF_MAX_QP: u64 = (BF_END - BF_BASE) / BF_STRIDE;
const _: () = assert!(BF_BASE.is_multiple_of(4096) && BF_END <= BAR0_SIZE);

/// Start of the device-memory window (ABI 1.8): byte `DM_BASE + a` of BAR0 is byte `a` of
/// the device's memory, for `a` below `MAX_DM_SIZE`. Aligned 32-bit loads and stores, and
/// write-combined bursts, reach it; memory the driver allocated with ALLOC_DM is what it
/// may use.
pub const DM_BASE: u64 = BF_END;
/// End of the device-memory window (exclusive): `MAX_DM_SIZE` is at most its size.
pub const DM_END: u64 = BAR0_SIZE;
/// The largest `MAX_DM_SIZE` the window can show.
pub const DM_MAX: u64 = DM_END - DM_BASE;
const _: () = assert!(DM_BASE.is_multiple_of(4096) && DM_END <= BAR0_SIZE);

/// Bits of `CMD_STATUS`.
pub const CMD_STATUS_BUSY: u32 = 1 << 31;
/// Bits of `DEV_STATUS`.
pub const DEV_STATUS_READY: u32 = 1;
/// Fatal-error bit of `DEV_STATUS`.
pub const DEV_STATUS_FATAL: u32 = 1 << 1;
/// EQ-overflow bit of `DEV_STATUS`.
pub const DEV_STATUS_EQ_OVERFLOW: u32 = 1 << 2;

bitflags! {
    /// Capability flags in `CAPS`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Caps: u32 {
        /// Reliable-connected QPs.
        const RC = 1 << 0;
        /// Shared receive queues.
        const SRQ = 1 << 1;
        /// Atomic compare-and-swap and fetch-and-add.
        const ATOMICS = 1 << 2;
        /// Inline data in send WQEs.
        const INLINE = 1 << 3;
        /// Timestamps in CQEs.
        const CQE_TIMESTAMP = 1 << 4;
        /// QUERY_PORT_STATS and QUERY_QP_STATS (ABI 1.1).
        const COUNTERS = 1 << 5;
        /// Tag-matching SRQs with rendezvous offload on RC (ABI 1.2).
        const TM_RC = 1 << 6;
        /// Event counters and triggered operations (ABI 1.3).
        const TRIGGERED = 1 << 7;
        /// BlueFlame: send WQEs written through BAR0 slots (ABI 1.4).
        const BLUEFLAME = 1 << 8;
        /// Unreliable datagram QPs, DETH on the wire and the UD CQE fields (ABI 1.5).
        const UD = 1 << 9;
        /// REREG_MR: a memory region's translation, PD or access changed in place (ABI 1.6).
        const REREG_MR = 1 << 10;
        /// Unreliable connected QPs: SEND and RDMA WRITE without acknowledgements (ABI 1.7).
        const UC = 1 << 11;
        /// RESIZE_CQ: a CQ moved to a ring of another size with its completions (ABI 1.7).
        const RESIZE_CQ = 1 << 12;
        /// Device memory: ALLOC_DM, FREE_DM, REG_DM_MR and the window at `DM_BASE`
        /// (ABI 1.8).
        const DEVICE_MEMORY = 1 << 13;
        /// Memory windows of types 1 and 2: ALLOC_MW, DEALLOC_MW, the BIND_MW and
        /// LOCAL_INV WQEs, SEND with invalidate (ABI 1.9).
        const MEMORY_WINDOW = 1 << 14;
        /// IBTA 1.5 ATOMIC WRITE: the ATOMIC_WRITE WQE and its wire opcode (ABI 1.10).
        const ATOMIC_WRITE = 1 << 15;
        /// XRC (ABI 1.11): XRC domains, XRC SRQs, the XRC initiator and target QPs, and
        /// the XRC transport on the wire.
        const XRC = 1 << 16;
        /// Raw packet QPs and flow steering (ABI 1.12): CREATE_QP type 8, CREATE_FLOW and
        /// DESTROY_FLOW, frames other than RoCE on the wire.
        const RAW_PACKET = 1 << 17;
        /// UD multicast (ABI 1.12): ATTACH_MCAST and DETACH_MCAST, datagrams to a group.
        const UD_MCAST = 1 << 18;
    }
}

/// Codes of `LAST_ERROR`: programming errors the device noticed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum GuestError {
    /// No error recorded.
    None = 0,
    /// Access to an offset no register occupies, or not 4-byte aligned.
    BadOffset = 1,
    /// Write to a read-only register.
    ReadOnly = 2,
    /// Doorbell for an object that does not exist.
    BadDoorbellObject = 3,
    /// Doorbell index beyond what the ring holds or behind the device's index.
    BadDoorbellIndex = 4,
    /// Command doorbell while a command is executing.
    CommandBusy = 5,
}

/// Looks up the register at `offset` in page 0.
pub fn register_at(offset: u64) -> Option<&'static Register> {
    REGISTERS.iter().find(|r| r.offset == offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_do_not_overlap_and_are_aligned() {
        for w in REGISTERS.windows(2) {
            assert!(
                w[0].offset + w[0].width <= w[1].offset,
                "{} overlaps {}",
                w[0].name,
                w[1].name
            );
        }
        for r in REGISTERS {
            assert_eq!(r.offset % r.width, 0, "{} misaligned", r.name);
            assert!(
                r.offset + r.width <= DB_BASE,
                "{} is in the doorbell area",
                r.name
            );
        }
    }

    #[test]
    fn doorbell_areas_are_page_aligned_and_in_bar() {
        for base in [QP_DB_BASE, SRQ_DB_BASE, CQ_DB_BASE, DB_END] {
            assert_eq!(base % 4096, 0);
        }
        assert_eq!(register_at(MAGIC).unwrap().reset, 0x4c45_4252);
    }

    #[test]
    fn capability_bits() {
        assert_eq!(Caps::UD.bits(), 1 << 9);
        assert_eq!(Caps::REREG_MR.bits(), 1 << 10);
        assert_eq!(Caps::UC.bits(), 1 << 11);
        assert_eq!(Caps::RESIZE_CQ.bits(), 1 << 12);
        assert_eq!(Caps::DEVICE_MEMORY.bits(), 1 << 13);
        assert_eq!(Caps::MEMORY_WINDOW.bits(), 1 << 14);
        assert_eq!(Caps::ATOMIC_WRITE.bits(), 1 << 15);
        assert_eq!(Caps::XRC.bits(), 1 << 16);
        assert_eq!(Caps::RAW_PACKET.bits(), 1 << 17);
        assert_eq!(Caps::UD_MCAST.bits(), 1 << 18);
        // Bits 0..18 are defined (ABI 1.12); 31:19 are reserved.
        assert_eq!(Caps::all().bits(), 0x7_FFFF);
        assert_eq!(Caps::from_bits(1 << 19), None);
        // The device-memory window follows the BlueFlame area to the end of the 4 MiB BAR.
        assert_eq!(
            (DM_BASE, DM_END, BAR0_SIZE),
            (0x20_0000, 0x40_0000, 0x40_0000)
        );
        assert_eq!(MAX_DM_SIZE, 0x050);
    }
}
