//! The command interface: a 256-byte mailbox in host memory, the `CMD_ADDR_*` registers that
//! point at it, `CMD_DOORBELL` that starts a command and `CMD_STATUS` that reports its end.
//!
//! Mailbox layout (all fields little-endian):
//!
//! ```text
//! 0x00  CmdHeader   opcode:u16 flags:u16 token:u32 rsvd:u64
//! 0x10  input parameters (command specific, 112 bytes)
//! 0x80  CmdResult   status:u8 rsvd:[u8;3] syndrome:u32 rsvd:u64
//! 0x90  output parameters (command specific, 112 bytes)
//! ```
//!
//! The device reads the whole mailbox, executes the command, writes the result half back and
//! then sets `CMD_STATUS` (and, when the header asks for it with [`CMD_FLAG_EVENT`], posts a
//! command-completion EQE).

use bitflags::bitflags;
use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// Size of the mailbox in bytes.
pub const MAILBOX_SIZE: usize = 256;
/// Offset of the input parameters.
pub const IN_OFFSET: usize = 0x10;
/// Offset of the result header.
pub const RESULT_OFFSET: usize = 0x80;
/// Offset of the output parameters.
pub const OUT_OFFSET: usize = 0x90;
/// Bytes available for input or output parameters.
pub const PARAMS_SIZE: usize = 112;

macro_rules! abi_struct {
    ($(#[$m:meta])* $name:ident, $size:expr, { $( $(#[$fm:meta])* $f:ident : $t:ty ),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
        #[repr(C)]
        pub struct $name { $( $(#[$fm])* pub $f: $t ),* }
        const _: () = assert!(core::mem::size_of::<$name>() == $size);
    };
}
pub(crate) use abi_struct;

/// Command opcodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum CmdOpcode {
    /// Report the device's capabilities and limits.
    QueryDevice = 0x01,
    /// Read the port counters (`stats::PortStats`). ABI 1.1.
    QueryPortStats = 0x02,
    /// Allocate a protection domain.
    AllocPd = 0x10,
    /// Free a protection domain.
    FreePd = 0x11,
    /// Register a memory region.
    RegMr = 0x20,
    /// Deregister a memory region.
    DeregMr = 0x21,
    /// Change a memory region's translation, PD or access, keeping its keys. ABI 1.6.
    ReregMr = 0x22,
    /// Register part of a device-memory allocation as a zero-based memory region. ABI 1.8.
    RegDmMr = 0x23,
    /// Allocate a memory window. ABI 1.9.
    AllocMw = 0x24,
    /// Deallocate a memory window. ABI 1.9.
    DeallocMw = 0x25,
    /// Allocate an XRC domain. ABI 1.11.
    AllocXrcd = 0x26,
    /// Deallocate an XRC domain. ABI 1.11.
    DeallocXrcd = 0x27,
    /// Create a completion queue.
    CreateCq = 0x30,
    /// Query a completion queue.
    QueryCq = 0x31,
    /// Destroy a completion queue.
    DestroyCq = 0x32,
    /// Move a completion queue to a ring of another size, keeping its unpolled completions.
    /// ABI 1.7.
    ResizeCq = 0x33,
    /// Create a queue pair (RC, or UD since ABI 1.5).
    CreateQp = 0x40,
    /// Change a QP's state and attributes.
    ModifyQp = 0x41,
    /// Read a QP's state and attributes.
    QueryQp = 0x42,
    /// Destroy a queue pair.
    DestroyQp = 0x43,
    /// Read a QP's transport counters (`stats::QpStats`). ABI 1.1.
    QueryQpStats = 0x44,
    /// Read a QP's datagram counters (`stats::UdStats`). ABI 1.5.
    QueryQpUdStats = 0x45,
    /// Steer received frames that match a rule to a raw packet QP. ABI 1.12.
    CreateFlow = 0x46,
    /// Remove a flow-steering rule. ABI 1.12.
    DestroyFlow = 0x47,
    /// Give a raw packet QP an indirection table of receive WQs and a hash (RSS). ABI 1.12.
    SetQpRss = 0x48,
    /// Attach a UD QP to a multicast group. ABI 1.12.
    AttachMcast = 0x49,
    /// Detach a UD QP from a multicast group. ABI 1.12.
    DetachMcast = 0x4A,
    /// Create a shared receive queue.
    CreateSrq = 0x50,
    /// Set an SRQ's limit and arm the limit event.
    ArmSrq = 0x51,
    /// Destroy a shared receive queue.
    DestroySrq = 0x52,
    /// Create a tag-matching SRQ. ABI 1.2.
    CreateTmSrq = 0x53,
    /// Create an XRC SRQ. ABI 1.11.
    CreateXrcSrq = 0x54,
    /// Create a receive WQ: an SRQ with a CQ of its own, for RSS tables. ABI 1.12.
    CreateWq = 0x55,
    /// Move a receive WQ between RESET, READY and ERR. ABI 1.12.
    ModifyWq = 0x56,
    /// Create an event counter. ABI 1.3.
    CreateCntr = 0x60,
    /// Destroy an event counter. ABI 1.3.
    DestroyCntr = 0x61,
    /// Add to or assign a counter's values. ABI 1.3.
    UpdateCntr = 0x62,
    /// Read a counter. ABI 1.3.
    QueryCntr = 0x63,
    /// Bind a counter to (or unbind it from) a QP's or an MR's events. ABI 1.3.
    BindCntr = 0x64,
    /// Arm a counter's wait: a COUNTER event when a threshold is reached. ABI 1.3.
    ArmCntr = 0x65,
    /// Post a triggered operation. ABI 1.3.
    PostTriggered = 0x66,
    /// Cancel one pending triggered operation. ABI 1.3.
    CancelTriggered = 0x67,
    /// Cancel every pending triggered operation of a PD, or those waiting on one counter.
    /// ABI 1.3.
    FlushTriggered = 0x68,
    /// Allocate device memory. ABI 1.8.
    AllocDm = 0x70,
    /// Free a device-memory allocation. ABI 1.8.
    FreeDm = 0x71,
}

impl CmdOpcode {
    /// Decodes an opcode.
    pub fn from_u16(v: u16) -> Option<CmdOpcode> {
        use CmdOpcode::*;
        Some(match v {
            0x01 => QueryDevice,
            0x02 => QueryPortStats,
            0x10 => AllocPd,
            0x11 => FreePd,
            0x20 => RegMr,
            0x21 => DeregMr,
            0x22 => ReregMr,
            0x23 => RegDmMr,
            0x24 => AllocMw,
            0x25 => DeallocMw,
            0x26 => AllocXrcd,
            0x27 => DeallocXrcd,
            0x30 => CreateCq,
            0x31 => QueryCq,
            0x32 => DestroyCq,
            0x33 => ResizeCq,
            0x40 => CreateQp,
            0x41 => ModifyQp,
            0x42 => QueryQp,
            0x43 => DestroyQp,
            0x44 => QueryQpStats,
            0x45 => QueryQpUdStats,
            0x46 => CreateFlow,
            0x47 => DestroyFlow,
            0x48 => SetQpRss,
            0x49 => AttachMcast,
            0x4A => DetachMcast,
            0x50 => CreateSrq,
            0x51 => ArmSrq,
            0x52 => DestroySrq,
            0x53 => CreateTmSrq,
            0x54 => CreateXrcSrq,
            0x55 => CreateWq,
            0x56 => ModifyWq,
            0x60 => CreateCntr,
            0x61 => DestroyCntr,
            0x62 => UpdateCntr,
            0x63 => QueryCntr,
            0x64 => BindCntr,
            0x65 => ArmCntr,
            0x66 => PostTriggered,
            0x67 => CancelTriggered,
            0x68 => FlushTriggered,
            0x70 => AllocDm,
            0x71 => FreeDm,
            _ => return None,
        })
    }
}

/// Command status codes (the `status` byte of the result and bits 23:16 of `CMD_STATUS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum CmdStatus {
    /// Success.
    Ok = 0,
    /// Unknown opcode.
    BadOpcode = 1,
    /// A parameter is invalid (reserved bits, bad flags, bad attribute mask, bad value).
    BadParam = 2,
    /// An object number does not name an existing object.
    BadResource = 3,
    /// No free object of the kind is left.
    Exhausted = 4,
    /// The object is not in a state that allows the command (includes illegal QP transitions).
    BadState = 5,
    /// The object is still referenced by others (e.g. a CQ used by a QP).
    Busy = 6,
    /// Objects belong to different protection domains.
    BadPd = 7,
    /// The mailbox or a ring address could not be reached through the IOMMU.
    DmaFault = 8,
    /// A size is 0, not a power of two, or beyond the device limit.
    BadSize = 9,
}

impl CmdStatus {
    /// Decodes a status byte.
    pub fn from_u8(v: u8) -> Option<CmdStatus> {
        use CmdStatus::*;
        Some(match v {
            0 => Ok,
            1 => BadOpcode,
            2 => BadParam,
            3 => BadResource,
            4 => Exhausted,
            5 => BadState,
            6 => Busy,
            7 => BadPd,
            8 => DmaFault,
            9 => BadSize,
            _ => return None,
        })
    }
}

abi_struct!(
    /// Mailbox bytes 0x00..0x10. `flags` holds [`CMD_FLAG_EVENT`]; other bits are 0.
    CmdHeader, 16, { opcode: U16, flags: U16, token: U32, rsvd1: U64 }
);
/// Command header flag: post a CMD_DONE event when the command finishes (for drivers that
/// sleep on the EQ instead of polling `CMD_STATUS`).
pub const CMD_FLAG_EVENT: u16 = 1;
abi_struct!(
    /// Mailbox bytes 0x80..0x90.
    CmdResult, 16, { status: u8, rsvd0: [u8; 3], syndrome: U32, rsvd1: U64 }
);

abi_struct!(
    /// QUERY_DEVICE output.
    QueryDeviceOut, 100, {
        abi_version: U32, device_id: U32, caps: U32, max_qp: U32,
        max_cq: U32, max_srq: U32, max_mr: U32, max_pd: U32,
        max_qp_wr: U32, max_cqe: U32, max_sge: U32, max_inline: U32,
        max_msg_size: U32, max_rd_atomic: U32, mac: [u8; 6], mtu_caps: U16, ipv4: [u8; 4],
        max_num_tags: U32, max_tm_ops: U32, max_rndv_hdr_size: U32, tm_max_sge: U32,
        max_cntr: U32, max_triggered: U32, max_dm_size: U32, max_mw: U32,
    }
);
abi_struct!(
    /// Input naming one object by number (FREE_PD, QUERY_CQ, DESTROY_CQ, QUERY_QP,
    /// DESTROY_QP, DESTROY_SRQ) or by key (DEREG_MR: the lkey).
    ObjectIn, 4, { num: U32 }
);
abi_struct!(
    /// Output carrying one new object number (ALLOC_PD, CREATE_CQ, CREATE_QP, CREATE_SRQ).
    ObjectOut, 4, { num: U32 }
);
abi_struct!(
    /// REG_MR input. `va` is the address remote peers and SGEs use; `iova` is where the
    /// region starts in the device's IOMMU address space; the region is contiguous in IOVA.
    RegMrIn, 32, { pdn: U32, access: U32, va: U64, length: U64, iova: U64 }
);
abi_struct!(
    /// REG_MR output.
    RegMrOut, 8, { lkey: U32, rkey: U32 }
);
abi_struct!(
    /// REREG_MR input (ABI 1.6): the region's key, what changes ([`REREG_TRANSLATION`],
    /// [`REREG_PD`], [`REREG_ACCESS`]) and the new values; fields of what does not change are
    /// ignored.
    ReregMrIn, 40, { key: U32, flags: U32, pdn: U32, access: U32, va: U64, length: U64, iova: U64 }
);
abi_struct!(
    /// ALLOC_DM input (ABI 1.8): `length` bytes of device memory whose device address is a
    /// multiple of `1 << log_align`.
    AllocDmIn, 16, { length: U64, log_align: U32, rsvd0: U32 }
);
abi_struct!(
    /// ALLOC_DM output: the allocation's number and where it starts in device memory (byte
    /// `DM_BASE + offset` of BAR0).
    AllocDmOut, 16, { num: U32, rsvd0: U32, offset: U64 }
);
abi_struct!(
    /// REG_DM_MR input (ABI 1.8): `length` bytes of allocation `dm` from `offset` in it, as a
    /// zero-based region of PD `pdn` (its addresses run from 0).
    RegDmMrIn, 32, { pdn: U32, access: U32, dm: U32, rsvd0: U32, offset: U64, length: U64 }
);
abi_struct!(
    /// ALLOC_MW input (ABI 1.9): a window of type `mw_type` ([`MW_TYPE_1`] or
    /// [`MW_TYPE_2`]) in PD `pdn`. The output is an [`ObjectOut`] holding the window's key.
    AllocMwIn, 8, { pdn: U32, mw_type: U32 }
);
/// A type 1 memory window: bound through any QP of its PD, invalidated by binding it again
/// with length 0 (the `ibv_mw_type` value).
pub const MW_TYPE_1: u32 = 1;
/// A type 2 memory window: bound to one QP, which alone reaches memory through it; a BIND_MW
/// needs it unbound, a LOCAL_INV or a SEND with invalidate unbinds it (type 2B).
pub const MW_TYPE_2: u32 = 2;
/// Bit 31 of every memory window's key (index bit 23): window keys and region keys never
/// meet.
pub const MW_KEY_BIT: u32 = 1 << 31;
/// The largest `log_align` ALLOC_DM takes (a page).
pub const DM_MAX_LOG_ALIGN: u32 = 12;
/// REREG_MR flag: `va`, `length` and `iova` replace the region's.
pub const REREG_TRANSLATION: u32 = 1 << 0;
/// REREG_MR flag: the region moves to PD `pdn`.
pub const REREG_PD: u32 = 1 << 1;
/// REREG_MR flag: `access` replaces the region's.
pub const REREG_ACCESS: u32 = 1 << 2;
abi_struct!(
    /// CREATE_CQ input. The ring holds `1 << log_size` 64-byte CQEs; the doorbell record is
    /// 8 bytes: consumer index (u32) then arm sequence (u32).
    CreateCqIn, 24, { log_size: u8, rsvd0: [u8; 3], eq_vector: U32, ring_iova: U64, db_iova: U64 }
);
abi_struct!(
    /// RESIZE_CQ input (ABI 1.7): the CQ, its new ring of `1 << log_size` CQEs, and the
    /// consumer index the driver has polled to. The device copies the CQEs from `ci` to its
    /// producer index into the new ring from slot 0 and continues there; the doorbell record
    /// stays where it is, and the driver's consumer index restarts at 0.
    ResizeCqIn, 24, { cqn: U32, log_size: u8, rsvd0: [u8; 3], ci: U32, rsvd1: U32, ring_iova: U64 }
);
abi_struct!(
    /// QUERY_CQ output.
    QueryCqOut, 16, { log_size: u8, flags: u8, rsvd0: U16, pi: U32, ci: U32, rsvd1: U32 }
);
/// QUERY_CQ flag: the CQ is armed.
pub const CQ_FLAG_ARMED: u8 = 1;
/// QUERY_CQ flag: a CQE was lost because the ring was full.
pub const CQ_FLAG_OVERFLOW: u8 = 2;

abi_struct!(
    /// CREATE_QP input. The send queue holds `1 << sq_log_size` 64-byte blocks; the receive
    /// queue holds `1 << rq_log_size` entries of `1 << rq_log_stride` bytes (ignored with an
    /// SRQ). The doorbell record is 8 bytes: receive PI (u32) then send PI (u32).
    /// `qp_type` (ABI 1.5): [`QP_TYPE_RC`] (0, as before 1.5), [`QP_TYPE_UD`],
    /// [`QP_TYPE_GSI`], since ABI 1.7 [`QP_TYPE_UC`], and since ABI 1.11
    /// [`QP_TYPE_XRC_INI`] and [`QP_TYPE_XRC_TGT`]. `xrcdn` (ABI 1.11; reserved before): the
    /// XRC domain of an XRC target QP.
    CreateQpIn, 48, {
        pdn: U32, send_cqn: U32, recv_cqn: U32, srqn: U32,
        sq_log_size: u8, rq_log_size: u8, rq_log_stride: u8, qp_type: u8, xrcdn: U32,
        sq_iova: U64, rq_iova: U64, db_iova: U64,
    }
);
abi_struct!(
    /// QP attributes: MODIFY_QP input (after `qpn` and `attr_mask`) and QUERY_QP output.
    QpAttr, 48, {
        state: u8, cur_state: u8, path_mtu: u8, timeout: u8,
        retry_cnt: u8, rnr_retry: u8, min_rnr_timer: u8, max_rd_atomic: u8,
        max_dest_rd_atomic: u8, sq_draining: u8, pkey_index: U16, access: U32,
        dest_qpn: U32, rq_psn: U32, sq_psn: U32, dest_mac: [u8; 6], rsvd0: U16,
        dest_ip: [u8; 4], qkey: U32, rsvd2: U32,
    }
);

/// CREATE_QP `qp_type`: reliable connected (the only type before ABI 1.5).
pub const QP_TYPE_RC: u8 = 0;
/// CREATE_QP `qp_type` (ABI 1.7): unreliable connected. 3 is libibverbs' `IBV_QPT_UC`.
pub const QP_TYPE_UC: u8 = 3;
/// CREATE_QP `qp_type`: unreliable datagram (ABI 1.5). 4 is libibverbs' `IBV_QPT_UD`.
pub const QP_TYPE_UD: u8 = 4;
/// CREATE_QP `qp_type` (ABI 1.12): raw packet, a QP whose send WQEs carry whole Ethernet
/// frames and whose receive queue takes the frames that flow-steering rules
/// ([`CreateFlowIn`]) send it. 8 is libibverbs' `IBV_QPT_RAW_PACKET`.
pub const QP_TYPE_RAW_PACKET: u8 = 8;
/// The longest frame a raw packet QP sends or receives (without the FCS): a jumbo Ethernet
/// frame of 9,000 bytes of payload behind a header with a VLAN tag.
pub const RAW_MAX_FRAME: usize = 9018;
/// The shortest frame a raw packet QP sends: an Ethernet header.
pub const RAW_MIN_FRAME: usize = 14;
/// CREATE_QP `qp_type` (ABI 1.11): XRC initiator, a send-only RC QP whose requests name
/// an XRC SRQ at the target. 9 is libibverbs' `IBV_QPT_XRC_SEND`.
pub const QP_TYPE_XRC_INI: u8 = 9;
/// CREATE_QP `qp_type` (ABI 1.11): XRC target, a receive-only RC QP of an XRC domain that
/// delivers each request to the XRC SRQ it names. 10 is libibverbs' `IBV_QPT_XRC_RECV`.
pub const QP_TYPE_XRC_TGT: u8 = 10;
/// CREATE_QP `qp_type` (ABI 1.5): the general services QP, a UD QP that always gets QPN 1
/// (the IBTA's GSI, where connection management listens); one per device. 1 is the
/// kernel's `IB_QPT_GSI`.
pub const QP_TYPE_GSI: u8 = 1;
/// QPN of the general services QP.
pub const GSI_QPN: u32 = 1;
/// The well-known Q_Key of the general services QP (IBTA 13.4.6.3). Only that QP may have a
/// Q_Key with bit 31 set.
pub const GSI_QKEY: u32 = 0x8001_0000;
/// A Q_Key with bit 31 set in a UD send WQE means "use the sending QP's own Q_Key" (IBTA
/// 10.2.5); such a key is never a QP's own Q_Key (MODIFY_QP refuses it).
pub const QKEY_USE_QP: u32 = 1 << 31;
abi_struct!(
    /// MODIFY_QP input.
    ModifyQpIn, 56, { qpn: U32, attr_mask: U32, attr: QpAttr }
);
abi_struct!(
    /// CREATE_SRQ input. The ring holds `1 << log_size` entries of `1 << log_stride` bytes;
    /// the doorbell record is 4 bytes (producer index).
    CreateSrqIn, 32, {
        pdn: U32, log_size: u8, log_stride: u8, rsvd0: U16, limit: U32, rsvd1: U32,
        ring_iova: U64, db_iova: U64,
    }
);
abi_struct!(
    /// CREATE_TM_SRQ input (ABI 1.2): an SRQ (untagged ring as in CREATE_SRQ) plus a
    /// matching list of `max_num_tags` tagged buffers, a list-operation ring of
    /// `1 << ops_log_size` 64-byte entries, and the CQ that receives every completion of the
    /// TM-SRQ (receives, matches and list operations).
    CreateTmSrqIn, 56, {
        srq: CreateSrqIn, cqn: U32, max_num_tags: U32, ops_log_size: u8, rsvd0: [u8; 7],
        ops_iova: U64,
    }
);
abi_struct!(
    /// CREATE_XRC_SRQ input (ABI 1.11): an SRQ (as in CREATE_SRQ) of XRC domain `xrcdn`,
    /// whose receive completions go to CQ `cqn` (whichever XRC target QP took them).
    CreateXrcSrqIn, 40, { srq: CreateSrqIn, xrcdn: U32, cqn: U32 }
);
abi_struct!(
    /// The fields a flow-steering rule compares (ABI 1.12), as the device reads them from a
    /// frame: the Ethernet addresses and type (behind one VLAN tag, if the frame has one),
    /// the IP addresses (an IPv4 address as the IPv4-mapped IPv6 address `::ffff:a.b.c.d`),
    /// the IP protocol (IPv4) or next header (IPv6), and the TCP or UDP ports of an
    /// unfragmented packet. A field the frame does not have reads as zeros.
    FlowMatch, 52, {
        dmac: [u8; 6], smac: [u8; 6], ethertype: U16, src_ip: [u8; 16], dst_ip: [u8; 16],
        ip_proto: u8, rsvd0: u8, src_port: U16, dst_port: U16,
    }
);
abi_struct!(
    /// CREATE_FLOW input (ABI 1.12): frames whose fields, under `mask`, equal `value` go to
    /// raw packet QP `qpn`. Of several matching rules the lowest `priority` wins, then the
    /// oldest. Output: the rule's number ([`ObjectOut`]).
    CreateFlowIn, 112, { qpn: U32, priority: U16, rsvd0: U16, value: FlowMatch, mask: FlowMatch }
);

impl FlowMatch {
    /// Whether `self` (a frame's fields) equals `value` in every bit of `mask`.
    pub fn matches(&self, value: &FlowMatch, mask: &FlowMatch) -> bool {
        self.as_bytes()
            .iter()
            .zip(value.as_bytes())
            .zip(mask.as_bytes())
            .all(|((f, v), m)| f & m == v & m)
    }

    /// The fields of an Ethernet frame (without its FCS). Never fails: what a short or
    /// malformed frame lacks reads as zeros.
    pub fn of_frame(frame: &[u8]) -> FlowMatch {
        let mut m = FlowMatch::default();
        let Some(eth) = frame.get(..14) else {
            return m;
        };
        m.dmac.copy_from_slice(&eth[0..6]);
        m.smac.copy_from_slice(&eth[6..12]);
        let mut ty = u16::from_be_bytes([eth[12], eth[13]]);
        let mut at = 14;
        if ty == 0x8100 {
            let Some(inner) = frame.get(16..18) else {
                return m;
            };
            ty = u16::from_be_bytes([inner[0], inner[1]]);
            at = 18;
        }
        m.ethertype = ty.into();
        let l3 = &frame[at.min(frame.len())..];
        let (proto, l4) = match ty {
            0x0800 => {
                let Some(ip) = l3.get(..20) else {
                    return m;
                };
                let ihl = usize::from(ip[0] & 0x0F) * 4;
                if ip[0] >> 4 != 4 || ihl < 20 {
                    return m;
                }
                m.src_ip[10..12].fill(0xFF);
                m.dst_ip[10..12].fill(0xFF);
                m.src_ip[12..].copy_from_slice(&ip[12..16]);
                m.dst_ip[12..].copy_from_slice(&ip[16..20]);
                m.ip_proto = ip[9];
                // Only a first fragment with offset 0 and no more to come has the ports.
                let frag = u16::from_be_bytes([ip[6], ip[7]]) & 0x3FFF;
                (ip[9], if frag == 0 { l3.get(ihl..) } else { None })
            }
            0x86DD => {
                let Some(ip) = l3.get(..40) else {
                    return m;
                };
                if ip[0] >> 4 != 6 {
                    return m;
                }
                m.src_ip.copy_from_slice(&ip[8..24]);
                m.dst_ip.copy_from_slice(&ip[24..40]);
                m.ip_proto = ip[6];
                (ip[6], l3.get(40..))
            }
            _ => return m,
        };
        if let (6 | 17, Some(l4)) = (proto, l4) {
            if let Some(p) = l4.get(..4) {
                m.src_port = u16::from_be_bytes([p[0], p[1]]).into();
                m.dst_port = u16::from_be_bytes([p[2], p[3]]).into();
            }
        }
        m
    }
}

abi_struct!(
    /// ATTACH_MCAST and DETACH_MCAST input (ABI 1.12): UD QP `qpn` and the group's GID, an
    /// IPv4-mapped address of 224.0.0.0/4 (`::ffff:224.x.y.z`), RoCEv2's form of a group.
    McastIn, 24, { qpn: U32, rsvd0: U32, gid: [u8; 16] }
);
/// The destination QPN of a multicast datagram (IBTA 10.5.2.3): every QP attached to the
/// group of its destination address receives it.
pub const MCAST_QPN: u32 = 0xFF_FFFF;
/// The (group, QP) attachments a device with `CAPS.UD_MCAST` keeps at most (ABI 24.6):
/// ATTACH_MCAST past them is `EXHAUSTED`. Groups and the QPs of one group are bounded only by
/// this total.
pub const MAX_MCAST_ATTACH: u32 = 1024;
/// The IPv4 group address of a multicast GID (an IPv4-mapped address of 224.0.0.0/4).
pub fn mcast_group(gid: &[u8; 16]) -> Option<[u8; 4]> {
    let mapped = gid[..10] == [0; 10] && gid[10..12] == [0xFF, 0xFF];
    (mapped && gid[12] & 0xF0 == 0xE0).then(|| [gid[12], gid[13], gid[14], gid[15]])
}
/// The Ethernet address of IPv4 group `ip` (RFC 1112): `01:00:5e` and its low 23 bits.
pub fn mcast_mac(ip: [u8; 4]) -> [u8; 6] {
    [0x01, 0x00, 0x5E, ip[1] & 0x7F, ip[2], ip[3]]
}

abi_struct!(
    /// CREATE_WQ input (ABI 1.12): a receive WQ, an SRQ (as in CREATE_SRQ) whose receives
    /// complete on CQ `cqn`. It is reached only through an RSS table ([`SetQpRssIn`]), in
    /// state RESET until MODIFY_WQ makes it READY. It is destroyed with DESTROY_SRQ.
    CreateWqIn, 40, { srq: CreateSrqIn, cqn: U32, rsvd0: U32 }
);
abi_struct!(
    /// MODIFY_WQ input (ABI 1.12): the WQ's new state, [`WQ_STATE_RESET`],
    /// [`WQ_STATE_READY`] or [`WQ_STATE_ERR`]. Frames for a WQ that is not READY are
    /// dropped.
    ModifyWqIn, 8, { wqn: U32, state: u8, rsvd0: [u8; 3] }
);
/// MODIFY_WQ state: RESET.
pub const WQ_STATE_RESET: u8 = 0;
/// MODIFY_WQ state: READY.
pub const WQ_STATE_READY: u8 = 1;
/// MODIFY_WQ state: ERR.
pub const WQ_STATE_ERR: u8 = 2;
abi_struct!(
    /// SET_QP_RSS input (ABI 1.12): raw packet QP `qpn`, in RESET, receives through an
    /// indirection table of `1 << log_size` receive WQ numbers (u32 each, at `table_iova`,
    /// read once). A steered frame goes to entry `hash & (size - 1)`, where `hash` is the
    /// Toeplitz hash under the first `key_len` bytes of `key` of the frame's fields that
    /// `fields` selects ([`RSS_SRC_IPV4`] and the others; the key is `key` then `key_tail`),
    /// in the order source address,
    /// destination address, source port, destination port.
    SetQpRssIn, 64, {
        qpn: U32, fields: U32, log_size: u8, key_len: u8, rsvd0: U16, rsvd1: U32,
        table_iova: U64, key: [u8; 32], key_tail: [u8; 8],
    }
);

impl SetQpRssIn {
    /// The 40 key bytes (`key`, then `key_tail`).
    pub fn key_bytes(&self) -> [u8; 40] {
        let mut k = [0u8; 40];
        k[..32].copy_from_slice(&self.key);
        k[32..].copy_from_slice(&self.key_tail);
        k
    }
    /// Sets the key from up to 40 bytes (the rest zeros).
    pub fn set_key(&mut self, key: &[u8]) {
        let mut k = [0u8; 40];
        let n = key.len().min(40);
        k[..n].copy_from_slice(&key[..n]);
        self.key.copy_from_slice(&k[..32]);
        self.key_tail.copy_from_slice(&k[32..]);
    }
}
/// SET_QP_RSS field: the IPv4 source address (libibverbs' `IBV_RX_HASH_SRC_IPV4`).
pub const RSS_SRC_IPV4: u32 = 1 << 0;
/// SET_QP_RSS field: the IPv4 destination address.
pub const RSS_DST_IPV4: u32 = 1 << 1;
/// SET_QP_RSS field: the IPv6 source address.
pub const RSS_SRC_IPV6: u32 = 1 << 2;
/// SET_QP_RSS field: the IPv6 destination address.
pub const RSS_DST_IPV6: u32 = 1 << 3;
/// SET_QP_RSS field: the TCP source port.
pub const RSS_SRC_PORT_TCP: u32 = 1 << 4;
/// SET_QP_RSS field: the TCP destination port.
pub const RSS_DST_PORT_TCP: u32 = 1 << 5;
/// SET_QP_RSS field: the UDP source port.
pub const RSS_SRC_PORT_UDP: u32 = 1 << 6;
/// SET_QP_RSS field: the UDP destination port.
pub const RSS_DST_PORT_UDP: u32 = 1 << 7;
/// The largest RSS table: `1 << RSS_MAX_LOG_SIZE` entries.
pub const RSS_MAX_LOG_SIZE: u8 = 10;

/// The Toeplitz hash of `input` under `key` (Microsoft's RSS definition): for every set
/// bit of the input, from the first byte's high bit on, the 32 key bits starting at that
/// bit's position are XORed into the result. Key bits past the key's end read as zeros.
pub fn toeplitz(key: &[u8], input: &[u8]) -> u32 {
    let bit = |i: usize| key.get(i / 8).is_some_and(|b| b & (0x80 >> (i % 8)) != 0) as u32;
    let mut window: u32 = (0..32).fold(0, |w, i| w << 1 | bit(i));
    let mut hash = 0;
    for (n, byte) in input.iter().enumerate() {
        for b in 0..8 {
            if byte & (0x80 >> b) != 0 {
                hash ^= window;
            }
            window = window << 1 | bit(n * 8 + b + 32);
        }
    }
    hash
}

abi_struct!(
    /// ARM_SRQ input: raise SRQ_LIMIT once fewer than `limit` WQEs remain (0 disarms).
    ArmSrqIn, 8, { srqn: U32, limit: U32 }
);

abi_struct!(
    /// CREATE_CNTR input (ABI 1.3). `wb_iova`, when not 0, is where the device writes the
    /// counter's [`CntrWriteback`] after every change (16-byte aligned).
    CreateCntrIn, 16, { pdn: U32, flags: U32, wb_iova: U64 }
);
abi_struct!(
    /// The 16 bytes a counter writes back to host memory: success, then error.
    CntrWriteback, 16, { success: U64, error: U64 }
);
abi_struct!(
    /// UPDATE_CNTR input: each value is added, or assigned when its bit in `flags` is set
    /// ([`CNTR_ASSIGN_SUCCESS`], [`CNTR_ASSIGN_ERROR`]).
    UpdateCntrIn, 24, { cntr: U32, flags: U32, success: U64, error: U64 }
);
/// UPDATE_CNTR flag: assign `success` instead of adding it.
pub const CNTR_ASSIGN_SUCCESS: u32 = 1;
/// UPDATE_CNTR flag: assign `error` instead of adding it.
pub const CNTR_ASSIGN_ERROR: u32 = 2;
abi_struct!(
    /// QUERY_CNTR output: the values, the owning PD, how many triggered operations wait on
    /// the counter, and how many bindings and operations refer to it.
    QueryCntrOut, 32, {
        success: U64, error: U64, pdn: U32, pending: U32, refs: U32, rsvd0: U32,
    }
);
abi_struct!(
    /// BIND_CNTR input: count `events` ([`CntrEvents`]) of the QP (`kind` 1, `obj` the QPN)
    /// or MR (`kind` 2, `obj` the lkey) on `cntr`; with [`CNTR_BIND_UNBIND`] in `flags` the
    /// listed events stop being counted on it.
    BindCntrIn, 16, { cntr: U32, kind: u8, flags: u8, rsvd0: U16, obj: U32, events: U32 }
);
/// BIND_CNTR `kind`: `obj` is a QPN.
pub const CNTR_BIND_QP: u8 = 1;
/// BIND_CNTR `kind`: `obj` is an MR's lkey.
pub const CNTR_BIND_MR: u8 = 2;
/// BIND_CNTR flag: unbind instead of bind.
pub const CNTR_BIND_UNBIND: u8 = 1;

bitflags! {
    /// Events a counter can count (BIND_CNTR `events`). An MR only has the remote ones.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct CntrEvents: u32 {
        /// Posted SEND / SEND with immediate completed (success or error).
        const SEND = 1 << 0;
        /// A message (SEND, WRITE with immediate, tagged) was received on the QP.
        const RECV = 1 << 1;
        /// Posted READ, compare-and-swap or fetch-and-add completed.
        const READ = 1 << 2;
        /// Posted WRITE / WRITE with immediate completed.
        const WRITE = 1 << 3;
        /// A peer's READ was accepted at this QP / MR.
        const REMOTE_READ = 1 << 4;
        /// A peer's WRITE landed, or its atomic executed, at this QP / MR.
        const REMOTE_WRITE = 1 << 5;
    }
}

abi_struct!(
    /// ARM_CNTR input: raise one COUNTER event when success reaches `threshold`, or when the
    /// error value changes from what it is now. Arming again replaces the earlier wait.
    ArmCntrIn, 16, { cntr: U32, rsvd0: U32, threshold: U64 }
);

abi_struct!(
    /// POST_TRIGGERED input: a triggered operation held by the device until `trig_cntr`
    /// reaches `threshold` (success + error, or success alone with
    /// [`TrigFlags::SUCCESS_ONLY`]). `kind` is a [`TrigKind`]. For [`TrigKind::Wqe`],
    /// `target` is the QPN, `body` one 64-byte send WQE (control segment first; its
    /// `wqe_index` and SIGNALED flag are ignored), `comp_cntr` (0: none) counts its
    /// completion and `wr_id` is reported in its CQE. For the counter kinds, `target` is the
    /// counter changed and `body` holds [`CntrWriteback`]-shaped values; `comp_cntr` must be 0.
    PostTriggeredIn, 112, {
        trig_cntr: U32, comp_cntr: U32, threshold: U64,
        kind: u8, flags: u8, rsvd0: U16, target: U32, wr_id: U64,
        operand_addr: U64, operand_lkey: U32, rsvd1: U32,
        body: [U64; 8],
    }
);

impl PostTriggeredIn {
    /// The 64 bytes of `body`.
    pub fn body_bytes(&self) -> &[u8] {
        self.body.as_bytes()
    }
    /// Copies up to 64 bytes into `body` (the rest is zeroed).
    pub fn set_body(&mut self, bytes: &[u8]) {
        let mut b = [0u8; 64];
        let n = bytes.len().min(64);
        b[..n].copy_from_slice(&bytes[..n]);
        self.body = <[U64; 8]>::read_from_bytes(&b).unwrap_or_default();
    }
}

/// What a triggered operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TrigKind {
    /// Post the send WQE in `body` on QP `target`.
    Wqe = 0,
    /// Add the values in `body` to counter `target`.
    CntrAdd = 1,
    /// Assign the values in `body` to counter `target`.
    CntrSet = 2,
}

impl TrigKind {
    /// Decodes a kind byte.
    pub fn from_u8(v: u8) -> Option<TrigKind> {
        Some(match v {
            0 => TrigKind::Wqe,
            1 => TrigKind::CntrAdd,
            2 => TrigKind::CntrSet,
            _ => return None,
        })
    }
}

bitflags! {
    /// POST_TRIGGERED `flags`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct TrigFlags: u8 {
        /// Write a CQE when the operation completes successfully (errors always write one).
        const COMPLETION = 1 << 0;
        /// Compare the threshold with the success value only (default: success + error).
        const SUCCESS_ONLY = 1 << 1;
        /// Atomics: read the 8-byte add (fetch-and-add) or swap (compare-and-swap) operand
        /// from `operand_addr` through `operand_lkey` when the operation fires.
        const OPERAND_FROM_MEM = 1 << 2;
    }
}

abi_struct!(
    /// FLUSH_TRIGGERED input: cancel the pending operations of PD `pdn` (`cntr` 0) or those
    /// waiting on counter `cntr`.
    FlushTriggeredIn, 8, { pdn: U32, cntr: U32 }
);
abi_struct!(
    /// FLUSH_TRIGGERED output: how many operations were cancelled.
    FlushTriggeredOut, 4, { flushed: U32 }
);

/// QP states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum QpState {
    /// Just created or reset.
    Reset = 0,
    /// Initialised; receives may be posted.
    Init = 1,
    /// Ready to receive.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Send queue drain.
    Sqd = 4,
    /// Send queue error (not used by RC; accepted in the encoding only).
    Sqe = 5,
    /// Error: everything is flushed.
    Err = 6,
}

impl QpAttr {
    /// `state` as a [`QpState`] (`None` for a byte no state has).
    pub fn qp_state(&self) -> Option<QpState> {
        QpState::from_u8(self.state)
    }
    /// `cur_state` as a [`QpState`].
    pub fn cur_qp_state(&self) -> Option<QpState> {
        QpState::from_u8(self.cur_state)
    }
    /// These attributes with `state` set to `s`.
    pub fn with_state(mut self, s: QpState) -> QpAttr {
        self.state = s as u8;
        self
    }
}

impl QpState {
    /// Decodes a state byte.
    pub fn from_u8(v: u8) -> Option<QpState> {
        use QpState::*;
        Some(match v {
            0 => Reset,
            1 => Init,
            2 => Rtr,
            3 => Rts,
            4 => Sqd,
            5 => Sqe,
            6 => Err,
            _ => return None,
        })
    }
}

bitflags! {
    /// MODIFY_QP attribute mask (the libibverbs bit values).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct QpAttrMask: u32 {
        /// `state` is valid.
        const STATE = 1 << 0;
        /// `cur_state` is valid.
        const CUR_STATE = 1 << 1;
        /// Raise SQ_DRAINED when entering SQD (accepted, ignored by v1).
        const EN_SQD_ASYNC_NOTIFY = 1 << 2;
        /// `access` is valid.
        const ACCESS_FLAGS = 1 << 3;
        /// `pkey_index` is valid.
        const PKEY_INDEX = 1 << 4;
        /// Port number (v1 has one port; accepted).
        const PORT = 1 << 5;
        /// `qkey` is valid (UD QPs only, ABI 1.5).
        const QKEY = 1 << 6;
        /// Address vector: `dest_mac`, `dest_ip`.
        const AV = 1 << 7;
        /// `path_mtu` is valid.
        const PATH_MTU = 1 << 8;
        /// `timeout` is valid.
        const TIMEOUT = 1 << 9;
        /// `retry_cnt` is valid.
        const RETRY_CNT = 1 << 10;
        /// `rnr_retry` is valid.
        const RNR_RETRY = 1 << 11;
        /// `rq_psn` is valid.
        const RQ_PSN = 1 << 12;
        /// `max_rd_atomic` is valid.
        const MAX_QP_RD_ATOMIC = 1 << 13;
        /// `min_rnr_timer` is valid.
        const MIN_RNR_TIMER = 1 << 15;
        /// `sq_psn` is valid.
        const SQ_PSN = 1 << 16;
        /// `max_dest_rd_atomic` is valid.
        const MAX_DEST_RD_ATOMIC = 1 << 17;
        /// `dest_qpn` is valid.
        const DEST_QPN = 1 << 20;
    }
}

bitflags! {
    /// Memory and QP access flags (the libibverbs bit values).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Access: u32 {
        /// The device may write through the lkey.
        const LOCAL_WRITE = 1 << 0;
        /// Remote peers may RDMA WRITE.
        const REMOTE_WRITE = 1 << 1;
        /// Remote peers may RDMA READ.
        const REMOTE_READ = 1 << 2;
        /// Remote peers may perform atomics.
        const REMOTE_ATOMIC = 1 << 3;
        /// Memory windows may be bound to the region (ABI 1.9).
        const MW_BIND = 1 << 4;
    }
}

/// Path MTU code (1 = 256 .. 5 = 4096) to bytes.
pub fn mtu_bytes(code: u8) -> Option<u32> {
    match code {
        1..=5 => Some(128 << code),
        _ => None,
    }
}

/// Reads a typed parameter struct from the front of a mailbox parameter area.
pub fn read_params<T: FromBytes>(area: &[u8]) -> Option<T> {
    T::read_from_prefix(area).ok().map(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toeplitz_matches_the_rss_verification_vectors() {
        // Microsoft's RSS verification key and the first two IPv4 cases (source address,
        // destination address, source port, destination port).
        let key = [
            0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67, 0x25, 0x3d, 0x43, 0xa3,
            0x8f, 0xb0, 0xd0, 0xca, 0x2b, 0xcb, 0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3,
            0x80, 0x30, 0xf2, 0x0c, 0x6a, 0x42, 0xb7, 0x3b, 0xbe, 0xac, 0x01, 0xfa,
        ];
        let case = |src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16| {
            let ip = [src, dst].concat();
            let all = [
                ip.clone(),
                sp.to_be_bytes().to_vec(),
                dp.to_be_bytes().to_vec(),
            ]
            .concat();
            (toeplitz(&key, &ip), toeplitz(&key, &all))
        };
        assert_eq!(
            case([66, 9, 149, 187], [161, 142, 100, 80], 2794, 1766),
            (0x323e_8fc2, 0x51cc_c178)
        );
        assert_eq!(
            case([199, 92, 111, 2], [65, 69, 140, 83], 14230, 4739),
            (0xd718_262a, 0xc626_b0ea)
        );
        assert_eq!(toeplitz(&key, &[]), 0);
        assert_eq!(toeplitz(&[], &[0xff; 8]), 0);
    }

    #[test]
    fn a_frame_s_flow_fields() {
        let mut f = vec![0u8; 14 + 4 + 20 + 8];
        f[..6].copy_from_slice(&[1, 2, 3, 4, 5, 6]);
        f[6..12].copy_from_slice(&[7, 8, 9, 10, 11, 12]);
        // A VLAN tag, then IPv4 with UDP 1234 -> 5678.
        f[12..14].copy_from_slice(&[0x81, 0x00]);
        f[16..18].copy_from_slice(&[0x08, 0x00]);
        f[18] = 0x45;
        f[18 + 9] = 17;
        f[18 + 12..18 + 16].copy_from_slice(&[1, 1, 1, 1]);
        f[18 + 16..18 + 20].copy_from_slice(&[2, 2, 2, 2]);
        f[38..40].copy_from_slice(&1234u16.to_be_bytes());
        f[40..42].copy_from_slice(&5678u16.to_be_bytes());
        let m = FlowMatch::of_frame(&f);
        assert_eq!(
            (m.dmac, m.smac),
            ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
        );
        assert_eq!((m.ethertype.get(), m.ip_proto), (0x0800, 17));
        assert_eq!(
            m.src_ip,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 1, 1, 1, 1]
        );
        assert_eq!(&m.dst_ip[12..], &[2, 2, 2, 2]);
        assert_eq!((m.src_port.get(), m.dst_port.get()), (1234, 5678));
        // A later fragment has no ports; a cut frame keeps what it has.
        let mut frag = f.clone();
        frag[18 + 7] = 1;
        assert_eq!(FlowMatch::of_frame(&frag).dst_port.get(), 0);
        let cut = FlowMatch::of_frame(&f[..20]);
        assert_eq!((cut.ethertype.get(), cut.src_ip), (0x0800, [0; 16]));
        assert_eq!(FlowMatch::of_frame(&f[..5]), FlowMatch::default());
        // Matching under masks.
        let mask = FlowMatch {
            dst_port: 0xFFFF.into(),
            ..Default::default()
        };
        let mut value = FlowMatch {
            dst_port: 5678.into(),
            ..Default::default()
        };
        assert!(m.matches(&value, &mask));
        value.dst_port = 5679.into();
        assert!(!m.matches(&value, &mask));
        assert!(
            m.matches(&value, &FlowMatch::default()),
            "an empty mask matches all"
        );
    }

    #[test]
    fn mtu_codes() {
        assert_eq!(mtu_bytes(1), Some(256));
        assert_eq!(mtu_bytes(5), Some(4096));
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(6), None);
    }

    #[test]
    fn opcodes_and_statuses_round_trip() {
        for v in 0..=u16::MAX {
            if let Some(op) = CmdOpcode::from_u16(v) {
                assert_eq!(op as u16, v);
            }
        }
        for v in 0..=u8::MAX {
            if let Some(s) = CmdStatus::from_u8(v) {
                assert_eq!(s as u8, v);
            }
            if let Some(s) = QpState::from_u8(v) {
                assert_eq!(s as u8, v);
            }
        }
    }

    #[test]
    fn ud_commands_and_fields() {
        use core::mem::offset_of;
        assert_eq!(CmdOpcode::from_u16(0x45), Some(CmdOpcode::QueryQpUdStats));
        assert_eq!(CmdOpcode::QueryQpUdStats as u16, 0x45);
        // ABI 1.12: CREATE_FLOW and DESTROY_FLOW after it.
        assert_eq!(CmdOpcode::from_u16(0x46), Some(CmdOpcode::CreateFlow));
        assert_eq!(CmdOpcode::from_u16(0x47), Some(CmdOpcode::DestroyFlow));
        assert_eq!(CmdOpcode::from_u16(0x48), Some(CmdOpcode::SetQpRss));
        assert_eq!(CmdOpcode::from_u16(0x49), Some(CmdOpcode::AttachMcast));
        assert_eq!(CmdOpcode::from_u16(0x4A), Some(CmdOpcode::DetachMcast));
        assert_eq!(CmdOpcode::from_u16(0x4B), None);
        assert_eq!(offset_of!(McastIn, gid), 0x08);
        assert_eq!(MCAST_QPN, 0xFF_FFFF);
        assert_eq!(CmdOpcode::from_u16(0x55), Some(CmdOpcode::CreateWq));
        assert_eq!(CmdOpcode::from_u16(0x56), Some(CmdOpcode::ModifyWq));
        assert_eq!(CmdOpcode::from_u16(0x57), None);
        assert_eq!(offset_of!(CreateWqIn, cqn), 0x20);
        assert_eq!(offset_of!(SetQpRssIn, table_iova), 0x10);
        assert_eq!(offset_of!(SetQpRssIn, key), 0x18);
        assert_eq!(QP_TYPE_RAW_PACKET, 8);
        assert_eq!(offset_of!(FlowMatch, ethertype), 0x0C);
        assert_eq!(offset_of!(FlowMatch, src_ip), 0x0E);
        assert_eq!(offset_of!(FlowMatch, ip_proto), 0x2E);
        assert_eq!(offset_of!(FlowMatch, dst_port), 0x32);
        assert_eq!(offset_of!(CreateFlowIn, value), 0x08);
        assert_eq!(offset_of!(CreateFlowIn, mask), 0x3C);
        // ABI 1.6: REREG_MR, after DEREG_MR.
        assert_eq!(CmdOpcode::from_u16(0x22), Some(CmdOpcode::ReregMr));
        // ABI 1.8: REG_DM_MR after it, ALLOC_DM and FREE_DM in a block of their own.
        assert_eq!(CmdOpcode::from_u16(0x23), Some(CmdOpcode::RegDmMr));
        // ABI 1.9: ALLOC_MW and DEALLOC_MW after it.
        assert_eq!(CmdOpcode::from_u16(0x24), Some(CmdOpcode::AllocMw));
        assert_eq!(CmdOpcode::from_u16(0x25), Some(CmdOpcode::DeallocMw));
        // ABI 1.11: ALLOC_XRCD and DEALLOC_XRCD after them, CREATE_XRC_SRQ after
        // CREATE_TM_SRQ; CREATE_QP's reserved word at 0x14 names the target's XRC domain.
        assert_eq!(CmdOpcode::from_u16(0x26), Some(CmdOpcode::AllocXrcd));
        assert_eq!(CmdOpcode::from_u16(0x27), Some(CmdOpcode::DeallocXrcd));
        assert_eq!(CmdOpcode::from_u16(0x28), None);
        assert_eq!(CmdOpcode::from_u16(0x54), Some(CmdOpcode::CreateXrcSrq));
        assert_eq!(offset_of!(CreateQpIn, xrcdn), 0x14);
        assert_eq!(offset_of!(CreateXrcSrqIn, xrcdn), 0x20);
        assert_eq!((QP_TYPE_XRC_INI, QP_TYPE_XRC_TGT), (9, 10));
        assert_eq!(offset_of!(AllocMwIn, mw_type), 0x04);
        assert_eq!(offset_of!(QueryDeviceOut, max_mw), 0x60);
        assert_eq!(Access::MW_BIND.bits(), 1 << 4);
        assert_eq!(CmdOpcode::from_u16(0x70), Some(CmdOpcode::AllocDm));
        assert_eq!(CmdOpcode::from_u16(0x71), Some(CmdOpcode::FreeDm));
        assert_eq!(CmdOpcode::from_u16(0x72), None);
        assert_eq!(offset_of!(AllocDmIn, log_align), 0x08);
        assert_eq!(offset_of!(AllocDmOut, offset), 0x08);
        assert_eq!(offset_of!(RegDmMrIn, dm), 0x08);
        assert_eq!(offset_of!(RegDmMrIn, offset), 0x10);
        assert_eq!(offset_of!(RegDmMrIn, length), 0x18);
        assert_eq!(offset_of!(QueryDeviceOut, max_dm_size), 0x5C);
        // ABI 1.7: RESIZE_CQ, after DESTROY_CQ.
        assert_eq!(CmdOpcode::from_u16(0x33), Some(CmdOpcode::ResizeCq));
        assert_eq!(CmdOpcode::from_u16(0x34), None);
        assert_eq!(offset_of!(ResizeCqIn, ci), 0x08);
        assert_eq!(offset_of!(ResizeCqIn, ring_iova), 0x10);
        assert_eq!(offset_of!(ReregMrIn, va), 0x10);
        assert_eq!(offset_of!(ReregMrIn, iova), 0x20);
        assert_eq!((REREG_TRANSLATION, REREG_PD, REREG_ACCESS), (1, 2, 4));
        assert_eq!(
            crate::stats::UdStats::SIZE,
            48,
            "QUERY_QP_UD_STATS output: 6 u64"
        );
        // CREATE_QP byte 0x13 and QpAttr 0x28, reserved before 1.5.
        assert_eq!(offset_of!(CreateQpIn, qp_type), 0x13);
        assert_eq!(offset_of!(QpAttr, qkey), 0x28);
        assert_eq!(
            offset_of!(ModifyQpIn, attr) + offset_of!(QpAttr, qkey),
            0x30
        );
        assert_eq!((QP_TYPE_RC, QP_TYPE_UD), (0, 4));
        assert_eq!(QKEY_USE_QP, 0x8000_0000);
        // QKEY is the libibverbs IBV_QP_QKEY bit, between PORT and AV.
        assert_eq!(QpAttrMask::QKEY.bits(), 1 << 6);
        assert_eq!(QpAttrMask::PORT.bits() << 1, QpAttrMask::QKEY.bits());
        assert_eq!(QpAttrMask::QKEY.bits() << 1, QpAttrMask::AV.bits());
        assert_eq!(QpAttrMask::from_bits(1 << 6), Some(QpAttrMask::QKEY));
        for bit in [14, 18, 19, 21, 31] {
            assert_eq!(QpAttrMask::from_bits(1 << bit), None, "bit {bit}");
        }
        // A UD RESET -> INIT input: state INIT, PKEY_INDEX | PORT | QKEY, Q_Key 0x1122_3344.
        let m = ModifyQpIn {
            qpn: 0x11.into(),
            attr_mask: (QpAttrMask::STATE
                | QpAttrMask::PKEY_INDEX
                | QpAttrMask::PORT
                | QpAttrMask::QKEY)
                .bits()
                .into(),
            attr: QpAttr {
                state: QpState::Init as u8,
                qkey: 0x1122_3344.into(),
                ..Default::default()
            },
        };
        let b = m.as_bytes();
        assert_eq!(&b[..9], &[0x11, 0, 0, 0, 0x71, 0, 0, 0, 1]);
        assert_eq!(&b[0x30..0x34], &[0x44, 0x33, 0x22, 0x11]);
        assert!(b[9..0x30].iter().chain(&b[0x34..]).all(|&x| x == 0));
    }

    #[test]
    fn golden_modify_qp_mailbox() {
        let m = ModifyQpIn {
            qpn: 7.into(),
            attr_mask: (QpAttrMask::STATE | QpAttrMask::PATH_MTU).bits().into(),
            attr: QpAttr {
                state: QpState::Rtr as u8,
                path_mtu: 5,
                dest_qpn: 0x12.into(),
                ..Default::default()
            },
        };
        let hex: String = m.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
        // qpn 7 | mask STATE|PATH_MTU | state RTR, path_mtu 5 | ... | dest_qpn 0x12 | zeros
        assert_eq!(hex, crate::golden::MODIFY_QP);
        assert!(core::mem::size_of::<ModifyQpIn>() <= PARAMS_SIZE);
        assert!(core::mem::size_of::<QueryDeviceOut>() <= PARAMS_SIZE);
    }
}
