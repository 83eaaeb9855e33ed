//! Queue pairs, reliable connected and (since ABI 1.5) unreliable datagram: creation, the
//! connect sequence, posting sends and receives. Posting checks a work request, then writes its WQE segment by segment straight
//! into the ring, and rings one doorbell per batch: release fence, doorbell record, then the
//! MMIO store.

use crate::cq::CompletionQueue;
use crate::cq::CqObject;
use crate::device::{Device, DmaBuffer, QueueMem, RING_ALIGN};
use crate::dma::DmaMemory;
use crate::error::Error;
use crate::mr::{PdObject, ProtectionDomain, Sge};
use crate::srq::SharedReceiveQueue;
use crate::srq::SrqObject;
use bitflags::bitflags;
use ringbell_specs::cmd::{
    Access, CmdOpcode, CreateQpIn, ModifyQpIn, ObjectIn, QpAttr, QpAttrMask, QpState, QP_TYPE_GSI,
    QP_TYPE_RAW_PACKET, QP_TYPE_RC, QP_TYPE_UC, QP_TYPE_UD, QP_TYPE_XRC_INI, QP_TYPE_XRC_TGT,
};
use ringbell_specs::regs;
use ringbell_specs::stats::QpStats;
use ringbell_specs::wqe::{
    self, AtomicSeg, BindSeg, CtrlSeg, DataSeg, RaddrSeg, SendOpcode, UdAddrSeg, WqeFlags,
    INLINE_MARK, RECV_LKEY_END, SEG, WQEBB,
};
use std::cell::Cell;
use std::rc::Rc;
use zerocopy::{FromBytes, IntoBytes};

/// A remote buffer: address and rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    /// Remote address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
}

/// The operation of a send work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOp {
    /// SEND.
    Send,
    /// SEND with immediate data.
    SendImm(u32),
    /// RDMA WRITE.
    Write(RemoteAddr),
    /// RDMA WRITE with immediate data (consumes a receive WQE at the target).
    WriteImm(RemoteAddr, u32),
    /// RDMA READ into the gather list.
    Read(RemoteAddr),
    /// 64-bit compare-and-swap; the original value lands in the 8-byte gather entry.
    CmpSwap {
        /// Target.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// 64-bit fetch-and-add; the original value lands in the 8-byte gather entry.
    FetchAdd {
        /// Target.
        remote: RemoteAddr,
        /// Addend.
        add: u64,
    },
    /// SEND that, once received, invalidates the peer's type 2 memory window with this key
    /// (ABI 1.9; RC only). The receive completion reports the key.
    SendInv(u32),
    /// Binds (or, with length 0, unbinds) a memory window (ABI 1.9). No data.
    BindMw(MwBind),
    /// Invalidates the type 2 memory window with this key (ABI 1.9). No data.
    LocalInv(u32),
    /// IBTA 1.5 ATOMIC WRITE (ABI 1.10; RC only): the request's 8 inline bytes
    /// ([`SendWr::inline`]) stored whole at an 8-byte aligned remote address. Whatever the
    /// QP's `max_inline`: the bytes travel in the WQE.
    AtomicWrite(RemoteAddr),
}

/// What a [`WrOp::BindMw`] binds: the window, its key after the bind, and the part of a
/// memory region it covers with which remote rights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MwBind {
    /// The window's key now (for a type 2 window any key with its index).
    pub mw_key: u32,
    /// Its key after the bind: the same index (bits 31:8), the low 8 bits the caller's.
    pub new_key: u32,
    /// The memory region's lkey.
    pub mr_key: u32,
    /// First address of the window, in the region's addresses.
    pub addr: u64,
    /// Length; 0 unbinds.
    pub len: u64,
    /// Remote rights (`Access::REMOTE_WRITE`, `REMOTE_READ`, `REMOTE_ATOMIC` bits) and
    /// `wqe::MW_ZERO_BASED`.
    pub access: u32,
}

bitflags! {
    /// Send work request flags.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
    pub struct SendFlags: u8 {
        /// Generate a completion.
        const SIGNALED = 1 << 0;
        /// Wait for earlier READs and atomics.
        const FENCE = 1 << 1;
        /// Ask for a solicited event at the receiver.
        const SOLICITED = 1 << 2;
    }
}

/// A send work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: WrOp,
    /// Local buffers (gather for SEND/WRITE, scatter for READ and atomics).
    pub sgl: &'a [Sge],
    /// Inline payload for SEND/WRITE, used instead of `sgl`.
    pub inline: Option<&'a [u8]>,
    /// Flags.
    pub flags: SendFlags,
    /// The destination of a send on a UD QP (required there; ignored on RC).
    pub ud: Option<crate::UdDest<'a>>,
    /// The XRC SRQ at the target that receives a request of an XRC initiator QP (ABI 1.11;
    /// ignored on other QPs).
    pub xrc_srqn: u32,
}

impl<'a> SendWr<'a> {
    /// A signaled request with a gather list.
    pub fn new(wr_id: u64, op: WrOp, sgl: &'a [Sge]) -> Self {
        SendWr {
            wr_id,
            op,
            sgl,
            inline: None,
            flags: SendFlags::SIGNALED,
            ud: None,
            xrc_srqn: 0,
        }
    }
    /// A signaled request with inline data.
    pub fn inline(wr_id: u64, op: WrOp, data: &'a [u8]) -> Self {
        SendWr {
            wr_id,
            op,
            sgl: &[],
            inline: Some(data),
            flags: SendFlags::SIGNALED,
            ud: None,
            xrc_srqn: 0,
        }
    }
    /// Replaces the flags.
    pub fn flags(mut self, flags: SendFlags) -> Self {
        self.flags = flags;
        self
    }
    /// Names the XRC SRQ at the target that receives the request (XRC initiator QPs).
    pub fn xrc(mut self, srqn: u32) -> Self {
        self.xrc_srqn = srqn;
        self
    }

    /// The destination of a datagram (UD QPs).
    pub fn to(mut self, dest: crate::UdDest<'a>) -> Self {
        self.ud = Some(dest);
        self
    }
}

/// The transport of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QpType {
    /// Reliable connected.
    #[default]
    Rc,
    /// Unreliable datagram (ABI 1.5).
    Ud,
    /// Unreliable connected (ABI 1.7): connected like RC, SEND and RDMA WRITE only, never
    /// acknowledged (a lost packet loses its message, silently; a send completes once its
    /// last packet has left).
    Uc,
    /// The general services QP: a UD QP that always gets QPN 1, one per device, where
    /// connection management listens ([`crate::cm`]).
    Gsi,
    /// XRC initiator (ABI 1.11): an RC QP that only sends, each request naming the XRC SRQ
    /// at the target that receives it ([`SendWr::xrc`]); no receive queue.
    XrcIni,
    /// XRC target (ABI 1.11): an RC QP of an XRC domain that only receives, each request
    /// going to the XRC SRQ it names; made by [`crate::Xrcd::create_target_qp`].
    XrcTgt,
    /// Raw packet (ABI 1.12): sends whole Ethernet frames and receives the frames its flow
    /// rules steer to it ([`crate::raw`]).
    RawPacket,
}

/// A receive work request.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Buffers to scatter into.
    pub sgl: &'a [Sge],
}

/// QP creation parameters.
#[derive(Debug, Clone, Copy)]
pub struct QpInit<'a> {
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions.
    pub recv_cq: &'a CompletionQueue,
    /// SRQ to take receive WQEs from (then the QP has no RQ).
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Send requests that can be outstanding.
    pub max_send_wr: u32,
    /// Receive requests that can be outstanding.
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request.
    pub max_recv_sge: u32,
    /// Inline bytes per send request.
    pub max_inline: u32,
    /// The transport.
    pub qp_type: QpType,
}

impl<'a> QpInit<'a> {
    /// Defaults: 128 sends and receives, 4 SGEs each, 64 inline bytes.
    pub fn new(send_cq: &'a CompletionQueue, recv_cq: &'a CompletionQueue) -> Self {
        QpInit {
            send_cq,
            recv_cq,
            srq: None,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline: 64,
            qp_type: QpType::Rc,
        }
    }
}

/// What a peer needs to connect to a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Endpoint {
    /// QP number.
    pub qpn: u32,
    /// First PSN the QP will send.
    pub psn: u32,
    /// Port MAC address.
    pub mac: [u8; 6],
    /// Port IPv4 address.
    pub ip: [u8; 4],
}

/// Attributes of the connect sequence.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    /// Path MTU code, 1 (256) .. 5 (4096).
    pub path_mtu: u8,
    /// Remote operations the QP accepts.
    pub access: Access,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout; 0 = infinite).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// RNR timer code the responder asks peers to wait.
    pub min_rnr_timer: u8,
    /// Outstanding READs/atomics as requester.
    pub max_rd_atomic: u8,
    /// Outstanding READs/atomics as responder.
    pub max_dest_rd_atomic: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            path_mtu: 5,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
        }
    }
}

/// Completion bookkeeping shared between a QP and the CQs that report on it.
#[derive(Debug)]
pub(crate) struct QpRings {
    sq_mask: u32,
    sq_wrid: Box<[Cell<u64>]>,
    sq_nbb: Box<[Cell<u8>]>,
    sq_ci: Cell<u32>,
    sq_pi: Cell<u32>,
    rq_mask: u32,
    rq_wrid: Box<[Cell<u64>]>,
    rq_ci: Cell<u32>,
    rq_pi: Cell<u32>,
    /// The device clock when the QP was last reset (0: never): a completion of it written
    /// no later is the earlier incarnation's ([`QpRings::before_reset`]).
    reset_ps: Cell<u64>,
}

impl QpRings {
    /// Empty bookkeeping for a send ring of `2^sq_log` blocks and a receive ring of
    /// `2^rq_log` entries.
    pub(crate) fn new(sq_log: u8, rq_log: u8) -> QpRings {
        let cells = |n: u32| (0..n).map(|_| Cell::new(0u64)).collect::<Box<[_]>>();
        QpRings {
            sq_mask: (1 << sq_log) - 1,
            sq_wrid: cells(1 << sq_log),
            sq_nbb: (0..1u32 << sq_log).map(|_| Cell::new(1u8)).collect(),
            sq_ci: Cell::new(0),
            sq_pi: Cell::new(0),
            rq_mask: (1u32 << rq_log) - 1,
            rq_wrid: cells(1 << rq_log),
            rq_ci: Cell::new(0),
            rq_pi: Cell::new(0),
            reset_ps: Cell::new(0),
        }
    }

    /// Whether a completion of this QP stamped `timestamp_ps` was written before its last
    /// reset. Such completions are dropped when polled, as rdma-core's providers clean a QP's
    /// completions from its CQs when it is reset (mlx5's `mlx5_cq_clean`): the ring indices
    /// start again at 0, and an old completion would otherwise complete a new request. The
    /// device voids completions still on their way at the reset, so every old one was
    /// written by then and every new one after (each takes commands and a post).
    pub(crate) fn before_reset(&self, timestamp_ps: u64) -> bool {
        let reset = self.reset_ps.get();
        reset != 0 && timestamp_ps <= reset
    }
    /// A send CQE for the WQE at `counter`: its wr_id, and everything up to and including it
    /// is free again (unsignaled WQEs complete implicitly). `None` for a counter outside the
    /// posted window (a completion of an earlier incarnation of the QP): it is skipped.
    pub(crate) fn complete_send(&self, counter: u16) -> Option<u64> {
        let ci = self.sq_ci.get();
        let idx = ci.wrapping_add(counter.wrapping_sub(ci as u16) as u32);
        if idx.wrapping_sub(ci) >= self.sq_pi.get().wrapping_sub(ci) {
            return None;
        }
        let slot = (idx & self.sq_mask) as usize;
        self.sq_ci
            .set(idx.wrapping_add(self.sq_nbb[slot].get().max(1) as u32));
        Some(self.sq_wrid[slot].get())
    }
    /// A receive CQE for RQ entry `counter`; receives complete in order, so anything but the
    /// oldest posted entry is skipped (`None`).
    pub(crate) fn complete_recv(&self, counter: u16) -> Option<u64> {
        let ci = self.rq_ci.get();
        if ci == self.rq_pi.get() || counter != ci as u16 {
            return None;
        }
        self.rq_ci.set(ci.wrapping_add(1));
        self.rq_wrid
            .get((ci & self.rq_mask) as usize)
            .map(Cell::get)
    }
}

/// A send WQE's segments and size, decided (and checked) before anything is written.
#[derive(Clone, Copy, Debug)]
struct SendPlan {
    opcode: SendOpcode,
    raddr: Option<RemoteAddr>,
    /// Swap-or-add and compare operands.
    atomic: Option<(u64, u64)>,
    /// The address segment of a UD send.
    ud: Option<UdAddrSeg>,
    /// The bind segment of a BIND_MW.
    bind: Option<BindSeg>,
    imm: u32,
    flags: WqeFlags,
    /// Size in 16-byte segments.
    ds: usize,
}

/// Where an encoded send WQE goes, by byte offset in the WQE.
trait WqeSink {
    /// Writes at most one segment's bytes at a segment-aligned offset.
    fn seg(&mut self, off: usize, bytes: &[u8]) -> Result<(), Error>;
    /// Writes bytes at any offset.
    fn put(&mut self, off: usize, bytes: &[u8]) -> Result<(), Error>;
}

/// A WQE built in a zeroed stack buffer (triggered operations).
impl WqeSink for [u8; wqe::MAX_SEND_WQE] {
    fn seg(&mut self, off: usize, bytes: &[u8]) -> Result<(), Error> {
        self.put(off, bytes)
    }
    fn put(&mut self, off: usize, bytes: &[u8]) -> Result<(), Error> {
        self[off..off + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

/// The send ring from the block at the producer index on: WQE byte `off` is ring byte
/// `(start + off) % size`, so a WQE continues at the start of the ring when it reaches the
/// end, block by block, as the device reads it.
struct RingSink<'a> {
    ring: &'a DmaMemory,
    start: usize,
    /// Ring size in bytes (a power of two, a whole number of blocks).
    size: usize,
}

impl WqeSink for RingSink<'_> {
    #[inline(always)]
    fn seg(&mut self, off: usize, bytes: &[u8]) -> Result<(), Error> {
        // A segment never straddles the end of the ring: the ring is whole blocks.
        self.ring.write((self.start + off) & (self.size - 1), bytes)
    }
    #[inline(always)]
    fn put(&mut self, off: usize, bytes: &[u8]) -> Result<(), Error> {
        let at = (self.start + off) & (self.size - 1);
        let n = bytes.len();
        // 8 to 16 bytes (the common short inline payload) as two 8-byte copies that may
        // overlap, instead of a call to `memcpy`.
        if at + n <= self.size && (8..=16).contains(&n) {
            self.ring.write(at, &bytes[..8])?;
            return self.ring.write(at + n - 8, &bytes[n - 8..]);
        }
        let first = n.min(self.size - at);
        self.ring.write(at, &bytes[..first])?;
        if first < bytes.len() {
            self.ring.write(0, &bytes[first..])?;
        }
        Ok(())
    }
}

/// Checks `wr` against a QP's limits and decides its WQE's segments and size. `ud_pd`: the
/// QP is a UD QP of this PD.
#[inline(always)]
fn plan_send_wqe(
    wr: &SendWr<'_>,
    max_inline: u32,
    max_send_sge: u32,
    ud_pd: Option<&Rc<PdObject>>,
) -> Result<SendPlan, Error> {
    let (opcode, raddr, atomic, imm) = match wr.op {
        WrOp::Send => (SendOpcode::Send, None, None, 0),
        WrOp::SendImm(i) => (SendOpcode::SendImm, None, None, i),
        WrOp::Write(r) => (SendOpcode::Write, Some(r), None, 0),
        WrOp::WriteImm(r, i) => (SendOpcode::WriteImm, Some(r), None, i),
        WrOp::Read(r) => (SendOpcode::Read, Some(r), None, 0),
        WrOp::CmpSwap {
            remote,
            compare,
            swap,
        } => (SendOpcode::CmpSwap, Some(remote), Some((swap, compare)), 0),
        WrOp::FetchAdd { remote, add } => (SendOpcode::FetchAdd, Some(remote), Some((add, 0)), 0),
        WrOp::SendInv(key) => (SendOpcode::SendInv, None, None, key),
        WrOp::BindMw(_) => (SendOpcode::BindMw, None, None, 0),
        WrOp::LocalInv(key) => (SendOpcode::LocalInv, None, None, key),
        WrOp::AtomicWrite(r) => (SendOpcode::AtomicWrite, Some(r), None, 0),
    };
    if opcode.is_local() {
        if ud_pd.is_some() {
            return Err(Error::InvalidArgument(
                "a UD QP sends only SEND and SEND with immediate",
            ));
        }
        if !wr.sgl.is_empty() || wr.inline.is_some() {
            return Err(Error::InvalidArgument(
                "binding and invalidating windows carry no data",
            ));
        }
        let bind = match wr.op {
            WrOp::BindMw(b) => Some(BindSeg {
                addr: b.addr.into(),
                length: b.len.into(),
                mw_key: b.mw_key.into(),
                new_key: b.new_key.into(),
                mr_key: b.mr_key.into(),
                access: b.access.into(),
            }),
            _ => None,
        };
        let ds = 1 + bind.map_or(0, |_| wqe::BIND_SEGS);
        return Ok(SendPlan {
            opcode,
            raddr: None,
            atomic: None,
            ud: None,
            bind,
            imm,
            flags: WqeFlags::from_bits_truncate(wr.flags.bits()),
            ds,
        });
    }
    let mut off = SEG;
    let mut ud = None;
    if let Some(pd) = ud_pd {
        let Some(dest) = wr.ud else {
            return Err(Error::InvalidArgument(
                "a send on a UD QP needs a destination (address handle, QPN, Q_Key)",
            ));
        };
        if !matches!(opcode, SendOpcode::Send | SendOpcode::SendImm) {
            return Err(Error::InvalidArgument(
                "a UD QP sends only SEND and SEND with immediate",
            ));
        }
        if !dest.ah.in_pd(pd) {
            return Err(Error::InvalidArgument(
                "the address handle belongs to another protection domain",
            ));
        }
        if dest.qpn > 0x00FF_FFFF {
            return Err(Error::InvalidArgument("a QPN has 24 bits"));
        }
        let a = dest.ah.attr();
        ud = Some(UdAddrSeg {
            dest_qpn: dest.qpn.into(),
            qkey: dest.qkey.into(),
            dest_mac: a.mac,
            dest_ip: a.ip,
            ..Default::default()
        });
        off += wqe::UD_ADDR_SEGS * SEG;
    }
    if raddr.is_some() {
        off += SEG;
    }
    if atomic.is_some() {
        if wr.sgl.len() != 1 || wr.sgl[0].len != 8 || wr.inline.is_some() {
            return Err(Error::InvalidArgument(
                "atomics need exactly one 8-byte SGE",
            ));
        }
        if raddr.is_some_and(|r| r.addr % 8 != 0) {
            return Err(Error::InvalidArgument(
                "atomic target must be 8-byte aligned",
            ));
        }
        off += SEG;
    }
    let mut flags = WqeFlags::from_bits_truncate(wr.flags.bits());
    let max_inline = match atomic_write_inline(wr, raddr) {
        Some(Err(e)) => return Err(e),
        Some(Ok(n)) => n,
        None => max_inline,
    };
    if let Some(data) = wr.inline {
        if matches!(
            opcode,
            SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd
        ) {
            return Err(Error::InvalidArgument(
                "inline data only for SEND and WRITE",
            ));
        }
        if data.len() > max_inline as usize || off + 4 + data.len() > wqe::MAX_SEND_WQE {
            return Err(Error::InvalidArgument("inline data longer than max_inline"));
        }
        flags |= WqeFlags::INLINE;
        off += (4 + data.len()).next_multiple_of(SEG);
    } else {
        if wr.sgl.len() > max_send_sge as usize || off + wr.sgl.len() * SEG > wqe::MAX_SEND_WQE {
            return Err(Error::InvalidArgument("more SGEs than max_send_sge"));
        }
        off += wr.sgl.len() * SEG;
    }
    Ok(SendPlan {
        opcode,
        raddr,
        atomic,
        ud,
        bind: None,
        imm,
        flags,
        ds: off / SEG,
    })
}

/// For an ATOMIC WRITE, checks its data and target and gives the inline limit that applies
/// to it (its 8 bytes travel in the WQE whatever the QP's `max_inline`); `None` for any
/// other request.
#[inline(always)]
fn atomic_write_inline(wr: &SendWr<'_>, raddr: Option<RemoteAddr>) -> Option<Result<u32, Error>> {
    if !matches!(wr.op, WrOp::AtomicWrite(_)) {
        return None;
    }
    Some(
        if wr.inline.map(<[u8]>::len) != Some(8) || !wr.sgl.is_empty() {
            Err(Error::InvalidArgument(
                "an ATOMIC WRITE carries exactly 8 inline bytes",
            ))
        } else if raddr.is_some_and(|r| r.addr % 8 != 0) {
            Err(Error::InvalidArgument(
                "atomic target must be 8-byte aligned",
            ))
        } else {
            Ok(8)
        },
    )
}

/// Writes the WQE `plan` describes for `wr`, with `wqe_index` in its control segment: every
/// segment, and zeros from the end of the data to the end of the last block.
#[inline(always)]
fn emit_send_wqe(
    wr: &SendWr<'_>,
    plan: &SendPlan,
    wqe_index: u16,
    out: &mut impl WqeSink,
) -> Result<(), Error> {
    let ctrl = CtrlSeg {
        opcode: plan.opcode as u8,
        flags: plan.flags.bits(),
        wqe_index: wqe_index.into(),
        ds_count: plan.ds as u8,
        imm: plan.imm.into(),
        xrc_srqn: wr.xrc_srqn.into(),
        ..Default::default()
    };
    out.seg(0, ctrl.as_bytes())?;
    let mut off = SEG;
    if let Some(b) = &plan.bind {
        let b = b.as_bytes();
        out.seg(off, &b[..SEG])?;
        out.seg(off + SEG, &b[SEG..])?;
        off += 2 * SEG;
        for z in (off..WQEBB).step_by(SEG) {
            out.seg(z, &[0u8; SEG])?;
        }
        return Ok(());
    }
    if let Some(a) = &plan.ud {
        let b = a.as_bytes();
        out.seg(off, &b[..SEG])?;
        out.seg(off + SEG, &b[SEG..])?;
        off += 2 * SEG;
    }
    if let Some(r) = plan.raddr {
        let seg = RaddrSeg {
            raddr: r.addr.into(),
            rkey: r.rkey.into(),
            ..Default::default()
        };
        out.seg(off, seg.as_bytes())?;
        off += SEG;
    }
    if let Some((sa, cmp)) = plan.atomic {
        let seg = AtomicSeg {
            swap_add: sa.into(),
            compare: cmp.into(),
        };
        out.seg(off, seg.as_bytes())?;
        off += SEG;
    }
    let end = wqe::wqebbs(plan.ds) * WQEBB;
    if let Some(data) = wr.inline {
        // Zero everything from here to the end of the last block, then write the byte count
        // and the data over the zeros.
        for z in (off..end).step_by(SEG) {
            out.seg(z, &[0u8; SEG])?;
        }
        out.seg(off, &(data.len() as u32 | INLINE_MARK).to_le_bytes())?;
        return out.put(off + 4, data);
    }
    for s in wr.sgl {
        let seg = DataSeg {
            byte_count: s.len.into(),
            lkey: s.lkey.into(),
            addr: s.addr.into(),
        };
        out.seg(off, seg.as_bytes())?;
        off += SEG;
    }
    for z in (off..end).step_by(SEG) {
        out.seg(z, &[0u8; SEG])?;
    }
    Ok(())
}

/// The WQE of the common small post, one block, as its eight little-endian words: an inline
/// SEND or WRITE (with or without immediate data) carrying 8 to 12 bytes, or a SEND, WRITE
/// (with or without immediate data) or READ with at most one SGE (READ not on a UC QP, `uc`).
/// `None` for any other request, including one over `max_inline` or `max_send_sge` (the
/// general path encodes it, or reports the error). Byte for byte what [`emit_send_wqe`]
/// writes for the same request.
#[inline(always)]
fn small_wqe(
    wr: &SendWr<'_>,
    max_inline: u32,
    max_send_sge: u32,
    uc: bool,
    wqe_index: u16,
) -> Option<[u64; 8]> {
    if wr.xrc_srqn != 0 {
        return None;
    }
    let (opcode, raddr, imm) = if let WrOp::Write(r) = wr.op {
        (SendOpcode::Write, Some(r), 0)
    } else {
        match wr.op {
            WrOp::WriteImm(r, i) => (SendOpcode::WriteImm, Some(r), i),
            WrOp::Send => (SendOpcode::Send, None, 0),
            WrOp::SendImm(i) => (SendOpcode::SendImm, None, i),
            WrOp::Read(r) if !uc && wr.inline.is_none() => (SendOpcode::Read, Some(r), 0),
            _ => return None,
        }
    };
    let mut flags = WqeFlags::from_bits_truncate(wr.flags.bits());
    // The segment after ctrl | [raddr]: the inline count and 8..=12 bytes, or the one data
    // segment, or nothing.
    let (data, nseg): ([u64; 2], u64) = match wr.inline {
        Some(data) => {
            let n = data.len();
            if !(8..=12).contains(&n) || n > max_inline as usize {
                return None;
            }
            flags |= WqeFlags::INLINE;
            // Data bytes 0..4 follow the count; bytes 4..n are the top n - 4 bytes of the
            // last eight.
            let first = u64::from_le_bytes(*data.first_chunk::<8>()?);
            let last = u64::from_le_bytes(*data.last_chunk::<8>()?);
            (
                [
                    (n as u32 | INLINE_MARK) as u64 | first << 32,
                    last >> (8 * (12 - n)),
                ],
                1,
            )
        }
        None => match wr.sgl {
            [] => ([0, 0], 0),
            [s] if max_send_sge >= 1 => ([s.len as u64 | (s.lkey as u64) << 32, s.addr], 1),
            _ => return None,
        },
    };
    let ds: u64 = 1 + raddr.is_some() as u64 + nseg;
    let ctrl = [
        opcode as u64 | (flags.bits() as u64) << 8 | (wqe_index as u64) << 16 | ds << 32,
        imm as u64,
    ];
    Some(match raddr {
        Some(r) => [
            ctrl[0],
            ctrl[1],
            r.addr,
            r.rkey as u64,
            data[0],
            data[1],
            0,
            0,
        ],
        None => [ctrl[0], ctrl[1], data[0], data[1], 0, 0, 0, 0],
    })
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub struct QueuePair {
    dev: Device,
    qpn: u32,
    rings: Rc<QpRings>,
    sq: DmaBuffer,
    rq: Option<DmaBuffer>,
    db: DmaBuffer,
    sq_log: u8,
    sq_pi: u32,
    rq_log: u8,
    rq_stride_log: u8,
    rq_pi: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline: u32,
    /// The device has a BlueFlame slot for this QP.
    bf: bool,
    /// A UD QP.
    ud: bool,
    /// A UC QP.
    uc: bool,
    /// An XRC initiator or target (ABI 1.11).
    xrc: Option<QpType>,
    /// A raw packet QP (ABI 1.12), the numbers of the flow rules that name it (shared with
    /// their handles), and the multicast groups it is attached to: dropping the QP removes
    /// them first, as the device would not destroy it otherwise.
    pub(crate) raw: bool,
    pub(crate) flows: Rc<std::cell::RefCell<Vec<u32>>>,
    pub(crate) mcast: std::cell::RefCell<Vec<[u8; 16]>>,
    /// The receive WQs of its RSS table, alive while it is.
    pub(crate) rss: std::cell::RefCell<Vec<Rc<crate::srq::SrqObject>>>,
    state: QpState,
    /// Counters bound to the QP live at least as long as it (dropped after DESTROY_QP).
    cntrs: std::cell::RefCell<Vec<Rc<crate::counter::CntrObject>>>,
    /// The objects the device QP refers to stay alive at least as long as it (an XRC
    /// target's: its XRC domain only).
    _uses: Uses,
}

/// What a QP's device object refers to (held for their lifetimes, never read).
#[derive(Debug)]
#[allow(dead_code)]
enum Uses {
    Qp(
        Rc<PdObject>,
        Rc<CqObject>,
        Rc<CqObject>,
        Option<Rc<SrqObject>>,
    ),
    XrcTarget(crate::Xrcd),
}

impl ProtectionDomain {
    /// Creates a QP in RESET: RC, or UD with `init.qp_type` (then the device must have
    /// `Caps::UD`, `max_inline` is at most `wqe::MAX_INLINE_UD` and `max_send_sge` at most
    /// `wqe::MAX_UD_SEND_SGE`).
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<QueuePair, Error> {
        // CQ and SRQ numbers are per device: another device's number would name an unrelated
        // object here, or none.
        if !init.send_cq.belongs_to(&self.dev)
            || !init.recv_cq.belongs_to(&self.dev)
            || init.srq.is_some_and(|s| !s.belongs_to(&self.dev))
        {
            return Err(Error::InvalidArgument(
                "CQ or SRQ belongs to another device",
            ));
        }
        let caps = self.dev.caps();
        if init.max_send_sge > caps.max_sge
            || init.max_recv_sge > caps.max_sge
            || init.max_recv_sge > 32
        {
            return Err(Error::InvalidArgument("more SGEs than the device supports"));
        }
        if init.max_inline > caps.max_inline {
            return Err(Error::InvalidArgument("max_inline beyond the device limit"));
        }
        let ud = matches!(init.qp_type, QpType::Ud | QpType::Gsi);
        let uc = init.qp_type == QpType::Uc;
        let ini = init.qp_type == QpType::XrcIni;
        let raw = init.qp_type == QpType::RawPacket;
        if raw && !caps.caps.contains(regs::Caps::RAW_PACKET) {
            return Err(Error::Unsupported(
                "raw packet QPs: the device lacks CAPS.RAW_PACKET",
            ));
        }
        if init.qp_type == QpType::XrcTgt {
            return Err(Error::InvalidArgument(
                "an XRC target QP is made by its XRC domain (Xrcd::create_target_qp)",
            ));
        }
        if ini && !caps.caps.contains(regs::Caps::XRC) {
            return Err(Error::Unsupported("XRC QPs: the device lacks CAPS.XRC"));
        }
        if ini && init.srq.is_some() {
            return Err(Error::InvalidArgument(
                "an XRC initiator QP has no receive side",
            ));
        }
        if ud && !caps.caps.contains(regs::Caps::UD) {
            return Err(Error::Unsupported("UD QPs: the device lacks CAPS.UD"));
        }
        if uc && !caps.caps.contains(regs::Caps::UC) {
            return Err(Error::Unsupported("UC QPs: the device lacks CAPS.UC"));
        }
        if ud
            && (init.max_inline as usize > wqe::MAX_INLINE_UD
                || init.max_send_sge as usize > wqe::MAX_UD_SEND_SGE)
        {
            return Err(Error::InvalidArgument(
                "a UD send holds at most 13 SGEs or 204 inline bytes",
            ));
        }
        if init.max_send_wr == 0
            || init.max_send_wr > caps.max_qp_wr
            || (init.srq.is_none()
                && !ini
                && (init.max_recv_wr == 0 || init.max_recv_wr > caps.max_qp_wr))
        {
            return Err(Error::InvalidArgument(
                "queue size is 0 or beyond max_qp_wr",
            ));
        }
        // Worst-case WQE: ctrl + raddr + atomic, or ctrl + raddr + the gather list or inline data.
        let ds = if ud {
            // ctrl + address, then the gather list or inline data.
            let head = 1 + wqe::UD_ADDR_SEGS;
            (head + init.max_send_sge as usize)
                .max(head + (4 + init.max_inline as usize).div_ceil(SEG))
        } else {
            (2 + init.max_send_sge as usize)
                .max(3)
                .max(2 + (4 + init.max_inline as usize).div_ceil(SEG))
        };
        let nbb = wqe::wqebbs(ds.min(wqe::MAX_DS)) as u32;
        // The inline data a WQE of that size holds, at least what was asked (as mlx5 gives
        // back the room its WQEs really have): the segments after the control and address
        // ones, less the inline header.
        let head = if ud { 1 + wqe::UD_ADDR_SEGS } else { 2 };
        let room = (nbb as usize * wqe::WQEBB).saturating_sub(head * SEG + 4);
        let room = if ud {
            room.min(wqe::MAX_INLINE_UD)
        } else {
            room
        };
        let max_inline = init
            .max_inline
            .max(room.min(caps.max_inline as usize) as u32);
        // The device takes rings of 2 entries or more (a one-request queue gets two).
        let sq_entries = (init.max_send_wr * nbb)
            .next_power_of_two()
            .max(2)
            .min(caps.max_qp_wr.next_power_of_two());
        let sq_log = sq_entries.trailing_zeros() as u8;
        let rq_stride_log = (init.max_recv_sge.max(1) as usize * SEG)
            .next_power_of_two()
            .trailing_zeros() as u8;
        let rq_log = if init.srq.is_some() || ini {
            0
        } else {
            init.max_recv_wr.next_power_of_two().trailing_zeros().max(1) as u8
        };
        let a = self.alloc.as_ref();
        let sq =
            self.dev
                .alloc_queue_mem((1usize << sq_log) * WQEBB, RING_ALIGN, QueueMem::Qp, a)?;
        let rq = if init.srq.is_none() && !ini {
            let len = (1usize << rq_log) << rq_stride_log;
            Some(self.dev.alloc_queue_mem(len, RING_ALIGN, QueueMem::Qp, a)?)
        } else {
            None
        };
        let db = self.dev.alloc_queue_mem(64, 64, QueueMem::Doorbell, a)?;
        let input = CreateQpIn {
            pdn: self.pdn.into(),
            send_cqn: init.send_cq.cqn().into(),
            recv_cqn: init.recv_cq.cqn().into(),
            srqn: init.srq.map_or(0, |s| s.srqn()).into(),
            sq_log_size: sq_log,
            rq_log_size: rq_log,
            rq_log_stride: rq_stride_log,
            sq_iova: sq.iova().into(),
            rq_iova: rq.as_ref().map_or(0, |r| r.iova()).into(),
            db_iova: db.iova().into(),
            qp_type: match init.qp_type {
                QpType::Rc => QP_TYPE_RC,
                QpType::Uc => QP_TYPE_UC,
                QpType::Ud => QP_TYPE_UD,
                QpType::Gsi => QP_TYPE_GSI,
                QpType::XrcIni => QP_TYPE_XRC_INI,
                QpType::XrcTgt => QP_TYPE_XRC_TGT,
                QpType::RawPacket => QP_TYPE_RAW_PACKET,
            },
            ..Default::default()
        };
        let qpn = self
            .dev
            .inner
            .create(CmdOpcode::CreateQp, input.as_bytes())?;
        let rings = Rc::new(QpRings::new(sq_log, rq_log));
        self.dev.inner.qps.borrow_mut().insert(qpn, rings.clone());
        Ok(QueuePair {
            dev: self.dev.clone(),
            qpn,
            rings,
            sq,
            rq,
            db,
            sq_log,
            sq_pi: 0,
            rq_log,
            rq_stride_log,
            rq_pi: 0,
            max_send_sge: init.max_send_sge,
            max_recv_sge: init.max_recv_sge,
            max_inline,
            state: QpState::Reset,
            bf: caps.caps.contains(regs::Caps::BLUEFLAME) && (qpn as u64) < regs::BF_MAX_QP,
            ud,
            uc,
            xrc: ini.then_some(QpType::XrcIni),
            raw,
            flows: Default::default(),
            mcast: Default::default(),
            rss: Default::default(),
            cntrs: Default::default(),
            _uses: Uses::Qp(
                self.obj.clone(),
                init.send_cq.keepalive(),
                init.recv_cq.keepalive(),
                init.srq.map(|s| s.keepalive()),
            ),
        })
    }
}

impl QueuePair {
    /// An XRC target QP of XRC domain `xrcd` (ABI 1.11): no queues of its own (a minimal
    /// send ring and doorbell record are kept for the layout), no PD, CQ or SRQ.
    pub(crate) fn xrc_target(xrcd: &crate::Xrcd) -> Result<QueuePair, Error> {
        let dev = xrcd.device().clone();
        let sq_log = 1u8;
        let sq = dev.alloc_queue_mem(2 * WQEBB, RING_ALIGN, QueueMem::Qp, None)?;
        let db = dev.alloc_queue_mem(64, 64, QueueMem::Doorbell, None)?;
        let input = CreateQpIn {
            qp_type: QP_TYPE_XRC_TGT,
            xrcdn: xrcd.num().into(),
            ..Default::default()
        };
        let qpn = dev.inner.create(CmdOpcode::CreateQp, input.as_bytes())?;
        let rings = Rc::new(QpRings::new(sq_log, 0));
        dev.inner.qps.borrow_mut().insert(qpn, rings.clone());
        Ok(QueuePair {
            dev,
            qpn,
            rings,
            sq,
            rq: None,
            db,
            sq_log,
            sq_pi: 0,
            rq_log: 0,
            rq_stride_log: 0,
            rq_pi: 0,
            max_send_sge: 0,
            max_recv_sge: 0,
            max_inline: 0,
            state: QpState::Reset,
            bf: false,
            ud: false,
            uc: false,
            xrc: Some(QpType::XrcTgt),
            raw: false,
            flows: Default::default(),
            mcast: Default::default(),
            rss: Default::default(),
            cntrs: Default::default(),
            _uses: Uses::XrcTarget(xrcd.clone()),
        })
    }

    pub(crate) fn device(&self) -> &Device {
        &self.dev
    }
    pub(crate) fn belongs_to(&self, dev: &Device) -> bool {
        self.dev.same_as(dev)
    }
    pub(crate) fn keep(&self, c: Rc<crate::counter::CntrObject>) {
        self.cntrs.borrow_mut().push(c);
    }

    /// Encodes `wr` as the one-block WQE of a triggered operation (control segment with
    /// index 0 first).
    pub(crate) fn encode_triggered(&self, wr: &SendWr<'_>) -> Result<[u8; WQEBB], Error> {
        if self.ud || self.uc || self.raw {
            return Err(Error::InvalidArgument("triggered operations run on RC QPs"));
        }
        let plan = plan_send_wqe(wr, self.max_inline, self.max_send_sge, None)?;
        if plan.ds * SEG > WQEBB {
            return Err(Error::InvalidArgument(
                "a triggered work request must fit one 64-byte WQE block",
            ));
        }
        let mut buf = [0u8; wqe::MAX_SEND_WQE];
        emit_send_wqe(wr, &plan, 0, &mut buf)?;
        let mut out = [0u8; WQEBB];
        out.copy_from_slice(&buf[..WQEBB]);
        Ok(out)
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The state as of the last modify this driver made (the device may have moved the QP
    /// to ERR since; [`QueuePair::query`] asks it).
    pub fn state(&self) -> QpState {
        self.state
    }

    /// This QP's side of a connection, sending from `psn`.
    pub fn endpoint(&self, psn: u32) -> Endpoint {
        let c = self.dev.caps();
        Endpoint {
            qpn: self.qpn,
            psn: psn & 0x00FF_FFFF,
            mac: c.mac,
            ip: c.ip,
        }
    }

    /// Modifies the QP (all or nothing; see the ABI's transition table).
    pub fn modify(&mut self, mask: QpAttrMask, attr: &QpAttr) -> Result<(), Error> {
        let input = ModifyQpIn {
            qpn: self.qpn.into(),
            attr_mask: mask.bits().into(),
            attr: *attr,
        };
        self.dev
            .inner
            .command(CmdOpcode::ModifyQp, input.as_bytes())?;
        if mask.contains(QpAttrMask::STATE) {
            self.state = QpState::from_u8(attr.state).unwrap_or(self.state);
            if self.state == QpState::Reset {
                self.sq_pi = 0;
                self.rq_pi = 0;
                self.rings.sq_ci.set(0);
                self.rings.rq_ci.set(0);
                self.rings.sq_pi.set(0);
                self.rings.rq_pi.set(0);
                // Completions written before now are the old incarnation's (on a device
                // that stamps them; without stamps nothing tells them apart).
                if self.dev.caps().caps.contains(regs::Caps::CQE_TIMESTAMP) {
                    self.rings.reset_ps.set(self.dev.clock_ps());
                }
            }
        }
        Ok(())
    }

    /// The QP's state as the device has it now (it may have moved to ERR by itself).
    pub fn query_state(&self) -> Result<QpState, Error> {
        let a = self.query()?;
        a.qp_state()
            .ok_or(Error::InvalidArgument("QUERY_QP returned an unknown state"))
    }

    /// Reads the QP's attributes and state from the device ([`QpAttr::qp_state`] gives the
    /// state typed).
    pub fn query(&self) -> Result<QpAttr, Error> {
        let out = self.dev.inner.command(
            CmdOpcode::QueryQp,
            ObjectIn {
                num: self.qpn.into(),
            }
            .as_bytes(),
        )?;
        Ok(QpAttr::read_from_prefix(&out)
            .map(|(a, _)| a)
            .unwrap_or_default())
    }

    /// The QP's transport counters (retransmissions, NAKs, RNR events, duplicates, ...).
    pub fn stats(&self) -> Result<QpStats, Error> {
        let out = self.dev.inner.command(
            CmdOpcode::QueryQpStats,
            ObjectIn {
                num: self.qpn.into(),
            }
            .as_bytes(),
        )?;
        Ok(QpStats::decode(&out))
    }

    /// Moves the QP to ERR: outstanding work is flushed with WR_FLUSH_ERR completions.
    pub fn to_error(&mut self) -> Result<(), Error> {
        self.modify(
            QpAttrMask::STATE,
            &QpAttr {
                state: QpState::Err as u8,
                ..Default::default()
            },
        )
    }

    /// RESET → INIT → RTR → RTS towards `remote`, sending from `local_psn`.
    pub fn connect(
        &mut self,
        remote: &Endpoint,
        local_psn: u32,
        o: &ConnectOptions,
    ) -> Result<(), Error> {
        self.to_rtr(remote, o)?;
        self.to_rts(local_psn, o)
    }

    /// RESET → INIT → RTR towards `remote`: the QP serves the peer's requests from now on
    /// (the first half of [`QueuePair::connect`]; the passive side of a connection stops
    /// here until the peer is ready).
    pub fn to_rtr(&mut self, remote: &Endpoint, o: &ConnectOptions) -> Result<(), Error> {
        use QpAttrMask as M;
        let init = QpAttr {
            state: QpState::Init as u8,
            access: o.access.bits().into(),
            ..Default::default()
        };
        self.modify(M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, &init)?;
        // UC, and an XRC initiator (which only sends), have no READ/atomic resources as
        // responder and no RNR timer.
        let rc_only = match self.uc || self.xrc == Some(QpType::XrcIni) {
            true => M::empty(),
            false => M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
        };
        let rtr = QpAttr {
            state: QpState::Rtr as u8,
            path_mtu: o.path_mtu,
            dest_qpn: remote.qpn.into(),
            rq_psn: remote.psn.into(),
            max_dest_rd_atomic: o.max_dest_rd_atomic,
            min_rnr_timer: o.min_rnr_timer,
            dest_mac: remote.mac,
            dest_ip: remote.ip,
            ..Default::default()
        };
        self.modify(
            M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | rc_only,
            &rtr,
        )
    }

    /// RTR → RTS, sending from `local_psn` (the second half of [`QueuePair::connect`]).
    pub fn to_rts(&mut self, local_psn: u32, o: &ConnectOptions) -> Result<(), Error> {
        use QpAttrMask as M;
        let rts = QpAttr {
            state: QpState::Rts as u8,
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
            sq_psn: (local_psn & 0x00FF_FFFF).into(),
            max_rd_atomic: o.max_rd_atomic,
            ..Default::default()
        };
        // UC has no ACK timer, retries or READ/atomic credits; an XRC target (which only
        // receives) has the timer alone.
        let rc_only = match (self.uc, self.xrc) {
            (true, _) => M::empty(),
            (_, Some(QpType::XrcTgt)) => M::TIMEOUT,
            _ => M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::MAX_QP_RD_ATOMIC,
        };
        self.modify(M::STATE | M::SQ_PSN | rc_only, &rts)
    }

    /// Inline bytes a request may carry: at least `QpInit::max_inline`, and whatever more
    /// the QP's WQE size holds.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    /// Receive requests the QP's own receive queue holds (its ring, rounded up from
    /// `max_recv_wr` to a power of two, two at least); 0 on an SRQ.
    pub fn recv_queue_depth(&self) -> u32 {
        match self.rq {
            Some(_) => 1 << self.rq_log,
            None => 0,
        }
    }

    /// Free send-queue blocks.
    pub fn sq_free(&self) -> u32 {
        (1u32 << self.sq_log) - self.sq_pi.wrapping_sub(self.rings.sq_ci.get())
    }

    /// Posts send requests and rings the doorbell once. On an error, the requests before the
    /// failing one are posted (and the doorbell rung for them); the rest are not.
    ///
    /// Refused here: [`Error::InvalidState`] in RESET, INIT or RTR (in ERR the requests are
    /// accepted and flushed); [`Error::QueueFull`] when the send queue has no room;
    /// [`Error::InvalidArgument`] for more SGEs than `max_send_sge`, inline data above
    /// `max_inline` or on a READ or atomic, or an atomic without exactly one 8-byte SGE or
    /// with an unaligned target.
    ///
    /// What the completion then says (ABI.md 7.1 and 10.8): `LOC_LEN_ERR` for a
    /// message above MAX_MSG_SIZE, `LOC_QP_OP_ERR` for a malformed WQE, `LOC_PROT_ERR`
    /// when a local key check fails, `REM_INV_REQ_ERR` / `REM_ACCESS_ERR` / `REM_OP_ERR`
    /// for the peer's NAK (a receive too small, a bad rkey or range, a responder fault),
    /// `RNR_RETRY_EXC_ERR` after `rnr_retry` RNR NAKs, `RETRY_EXC_ERR` after `retry_cnt`
    /// timeouts or sequence NAKs without forward progress, `BAD_RESP_ERR` for a response
    /// of the wrong kind, and `WR_FLUSH_ERR` for every request behind the first error (the
    /// QP is then in ERR). A READ that is retried asks only for the part not yet received:
    /// the retry starts at the first missing response PSN, and the bytes already placed
    /// stay.
    pub fn post_send(&mut self, wrs: &[SendWr<'_>]) -> Result<(), Error> {
        if self.xrc == Some(QpType::XrcTgt) {
            return Err(Error::InvalidArgument("an XRC target QP does not send"));
        }
        if matches!(self.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(Error::InvalidState {
                qpn: self.qpn,
                state: self.state,
            });
        }
        let start = self.sq_pi;
        let mask = (1u32 << self.sq_log) - 1;
        let mut pi = start;
        let mut result = Ok(());
        // Per batch: the ring's mapping, the consumer index (the device does not move it
        // while we post) and the limits.
        let ring = self.sq.mem().ring_blocks(mask as usize + 1);
        let rings = &*self.rings;
        let wrids = &rings.sq_wrid[..];
        let nbbs = &rings.sq_nbb[..];
        let ring = ring.filter(|_| wrids.len() > mask as usize && nbbs.len() > mask as usize);
        let ci = rings.sq_ci.get();
        let (max_inline, max_send_sge, uc) = (self.max_inline, self.max_send_sge, self.uc);
        // The words of the first WQE, if it took the small path (what a lone WQE's BlueFlame
        // block holds).
        let mut first_words = None;
        for wr in wrs {
            // The common small post (one block, written as whole words): no plan, no
            // segment-by-segment writes. Anything else, and every error, takes the general
            // path, which encodes the same bytes.
            if let Some(ring) = ring.filter(|_| !self.ud && !self.raw) {
                if pi.wrapping_sub(ci) <= mask {
                    if let Some(words) = small_wqe(wr, max_inline, max_send_sge, uc, pi as u16) {
                        let slot = (pi & mask) as usize;
                        ring.block(slot).write_u64s::<0, 8>(words);
                        wrids[slot].set(wr.wr_id);
                        nbbs[slot].set(1);
                        if pi == start {
                            first_words = Some(words);
                        }
                        pi = pi.wrapping_add(1);
                        continue;
                    }
                }
            }
            match self.write_send_wqe(wr, pi) {
                Ok(nbb) => pi = pi.wrapping_add(nbb),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.sq_pi = pi;
        self.rings.sq_pi.set(pi);
        if pi != start {
            self.db.mem().store_u32_release(4, pi);
            match first_words {
                // One small WQE: its BlueFlame block is the words just written to the ring.
                Some(words) if self.bf && pi == start.wrapping_add(1) => {
                    let mut block = [0u8; WQEBB];
                    for (b, w) in block.chunks_exact_mut(8).zip(words) {
                        b.copy_from_slice(&w.to_le_bytes());
                    }
                    self.dev
                        .inner
                        .port
                        .write_block(regs::BF_BASE + self.qpn as u64 * regs::BF_STRIDE, &block);
                }
                _ => self.ring_sq(start),
            }
        }
        result
    }

    /// Tells the device about the WQEs from `start` to the producer index: a single WQE goes
    /// through the QP's BlueFlame slot (the device need not fetch it), more take the send
    /// doorbell.
    fn ring_sq(&self, start: u32) {
        let port = &self.dev.inner.port;
        let mask = (1u32 << self.sq_log) - 1;
        let nbb = self.sq_pi.wrapping_sub(start);
        let single = self.rings.sq_nbb[(start & mask) as usize].get() as u32 == nbb;
        // The WQE must be contiguous in the ring to be copied in one go.
        if self.bf && single && (start & mask) + nbb <= mask + 1 {
            let mut wqe = [0u8; wqe::MAX_SEND_WQE];
            let len = nbb as usize * WQEBB;
            let slot = (start & mask) as usize * WQEBB;
            if self.sq.read(slot, &mut wqe[..len]).is_ok() {
                port.write_block(
                    regs::BF_BASE + self.qpn as u64 * regs::BF_STRIDE,
                    &wqe[..len],
                );
                return;
            }
        }
        port.write32(
            regs::QP_DB_BASE + self.qpn as u64 * regs::DB_STRIDE + regs::DB_SQ,
            self.sq_pi,
        );
    }

    /// Testing hook: copies `bytes` (1..=256, a whole send WQE as the device reads it) into
    /// the send queue at the producer index, overwriting the control segment's `wqe_index`
    /// with the correct value, records `wr_id` for its completion, and rings the send
    /// doorbell. Nothing else is checked, so conformance suites can hand the device an
    /// unknown opcode or a malformed segment list. The WQE occupies `bytes.len()` rounded up
    /// to 64-byte blocks; a device that reads another size from `ds_count` will complete it
    /// under a different index. Not for applications.
    #[doc(hidden)]
    pub fn post_raw_wqe(&mut self, wr_id: u64, bytes: &[u8]) -> Result<(), Error> {
        if matches!(self.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(Error::InvalidState {
                qpn: self.qpn,
                state: self.state,
            });
        }
        if bytes.is_empty() || bytes.len() > wqe::MAX_SEND_WQE {
            return Err(Error::InvalidArgument("a raw WQE is 1..=256 bytes"));
        }
        let nbb = bytes.len().div_ceil(WQEBB) as u32;
        let free = self.sq_free();
        if nbb > free {
            return Err(Error::QueueFull {
                queue: "send queue",
                needed: nbb,
                free,
            });
        }
        let mut buf = [0u8; wqe::MAX_SEND_WQE];
        buf[..bytes.len()].copy_from_slice(bytes);
        buf[2..4].copy_from_slice(&(self.sq_pi as u16).to_le_bytes());
        let mask = (1u32 << self.sq_log) - 1;
        for b in 0..nbb {
            let slot = (self.sq_pi.wrapping_add(b) & mask) as usize * WQEBB;
            self.sq
                .write(slot, &buf[b as usize * WQEBB..(b as usize + 1) * WQEBB])?;
        }
        let slot = (self.sq_pi & mask) as usize;
        self.rings.sq_wrid[slot].set(wr_id);
        self.rings.sq_nbb[slot].set(nbb as u8);
        self.sq_pi = self.sq_pi.wrapping_add(nbb);
        self.rings.sq_pi.set(self.sq_pi);
        self.db.mem().store_u32_release(4, self.sq_pi);
        self.dev.inner.port.write32(
            regs::QP_DB_BASE + self.qpn as u64 * regs::DB_STRIDE + regs::DB_SQ,
            self.sq_pi,
        );
        Ok(())
    }

    /// Writes the WQE of `wr` into the ring at producer index `pi` and records its wr_id
    /// and size; returns its size in blocks (advancing the producer index and ringing the
    /// doorbell are the caller's). Nothing is written unless the request is valid and fits.
    #[inline(always)]
    fn write_send_wqe(&self, wr: &SendWr<'_>, pi: u32) -> Result<u32, Error> {
        if self.uc
            && matches!(
                wr.op,
                WrOp::Read(_) | WrOp::CmpSwap { .. } | WrOp::FetchAdd { .. } | WrOp::AtomicWrite(_)
            )
        {
            return Err(Error::InvalidArgument(
                "a UC QP sends only SEND and RDMA WRITE",
            ));
        }
        if self.raw && !matches!(wr.op, WrOp::Send | WrOp::BindMw(..) | WrOp::LocalInv(_)) {
            return Err(Error::InvalidArgument(
                "a raw packet QP sends frames with SEND only",
            ));
        }
        let ud_pd = match (&self._uses, self.ud) {
            (Uses::Qp(pd, ..), true) => Some(pd),
            _ => None,
        };
        let plan = plan_send_wqe(wr, self.max_inline, self.max_send_sge, ud_pd)?;
        let nbb = wqe::wqebbs(plan.ds) as u32;
        let free = (1u32 << self.sq_log) - pi.wrapping_sub(self.rings.sq_ci.get());
        if nbb > free {
            return Err(Error::QueueFull {
                queue: "send queue",
                needed: nbb,
                free,
            });
        }
        let mask = (1u32 << self.sq_log) - 1;
        // Segments go straight into the ring: building the WQE in a stack buffer and copying
        // it costs a store-forwarding stall per 16 bytes (wide loads of bytes just written by
        // narrower stores), which dominated the cost of a post.
        let mut out = RingSink {
            ring: self.sq.mem(),
            start: (pi & mask) as usize * WQEBB,
            size: (mask as usize + 1) * WQEBB,
        };
        emit_send_wqe(wr, &plan, pi as u16, &mut out)?;
        let slot = (pi & mask) as usize;
        self.rings.sq_wrid[slot].set(wr.wr_id);
        self.rings.sq_nbb[slot].set(nbb as u8);
        Ok(nbb)
    }

    /// Posts receive requests (not for QPs on an SRQ).
    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), Error> {
        if self.state == QpState::Reset {
            return Err(Error::InvalidState {
                qpn: self.qpn,
                state: self.state,
            });
        }
        let Some(rq) = &self.rq else {
            return Err(Error::InvalidArgument(match self.xrc {
                Some(_) => "an XRC QP has no receive queue; post to its XRC SRQ",
                None => "QP uses an SRQ; post to the SRQ",
            }));
        };
        let start = self.rq_pi;
        let mut result = Ok(());
        for wr in wrs {
            let free = (1u32 << self.rq_log) - self.rq_pi.wrapping_sub(self.rings.rq_ci.get());
            if free == 0 {
                result = Err(Error::QueueFull {
                    queue: "receive queue",
                    needed: 1,
                    free,
                });
                break;
            }
            if wr.sgl.len() > self.max_recv_sge as usize {
                result = Err(Error::InvalidArgument("more SGEs than max_recv_sge"));
                break;
            }
            let slot = (self.rq_pi & ((1 << self.rq_log) - 1)) as usize;
            if let Err(e) = write_recv_wqe(
                rq,
                slot << self.rq_stride_log,
                1 << self.rq_stride_log,
                wr.sgl,
            ) {
                result = Err(e);
                break;
            }
            self.rings.rq_wrid[slot].set(wr.wr_id);
            self.rq_pi = self.rq_pi.wrapping_add(1);
            self.rings.rq_pi.set(self.rq_pi);
        }
        if self.rq_pi != start {
            self.db.mem().store_u32_release(0, self.rq_pi);
            self.dev.inner.port.write32(
                regs::QP_DB_BASE + self.qpn as u64 * regs::DB_STRIDE + regs::DB_RQ,
                self.rq_pi,
            );
        }
        result
    }
}

/// Writes a receive WQE (data segments, then an end marker if room is left).
pub(crate) fn write_recv_wqe(
    ring: &DmaBuffer,
    at: usize,
    stride: usize,
    sgl: &[Sge],
) -> Result<(), Error> {
    let mut buf = [0u8; 32 * SEG];
    let mut off = 0;
    for s in sgl {
        buf[off..off + SEG].copy_from_slice(
            DataSeg {
                byte_count: s.len.into(),
                lkey: s.lkey.into(),
                addr: s.addr.into(),
            }
            .as_bytes(),
        );
        off += SEG;
    }
    if off < stride {
        buf[off..off + SEG].copy_from_slice(
            DataSeg {
                byte_count: 0.into(),
                lkey: RECV_LKEY_END.into(),
                addr: 0.into(),
            }
            .as_bytes(),
        );
        off += SEG;
    }
    ring.write(at, &buf[..off.min(stride)])
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.release_steering();
        let _ = self.dev.inner.destroy(CmdOpcode::DestroyQp, self.qpn);
        self.dev.inner.qps.borrow_mut().remove(&self.qpn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rings(sq_log: u32) -> QpRings {
        QpRings::new(sq_log as u8, 3)
    }

    proptest! {
        /// Against a plain model: WQEs of 1..=4 blocks posted in a ring of 2^k blocks, some
        /// signaled; each signaled CQE returns its wr_id and frees exactly the blocks up to
        /// and including its WQE, across 16-bit counter wraps.
        #[test]
        fn send_completion_bookkeeping(start in 0u32..200_000, sizes in proptest::collection::vec((1u32..=4, any::<bool>()), 1..400)) {
            let r = rings(6);
            r.sq_ci.set(start);
            r.sq_pi.set(start);
            let mut pi = start;
            let mut pending: Vec<(u32, u32, u64, bool)> = Vec::new();
            for (i, (nbb, signaled)) in sizes.iter().enumerate() {
                // Free the ring the way a driver would: by completing the oldest signaled WQE.
                while pi.wrapping_sub(r.sq_ci.get()) + nbb > 64 {
                    let pos = pending.iter().position(|p| p.3).expect("ring full of unsignaled WQEs");
                    let (idx, n, wr_id, _) = pending[pos];
                    prop_assert_eq!(r.complete_send(idx as u16), Some(wr_id));
                    prop_assert_eq!(r.sq_ci.get(), idx.wrapping_add(n));
                    pending.drain(..=pos);
                }
                let slot = (pi & r.sq_mask) as usize;
                r.sq_wrid[slot].set(i as u64);
                r.sq_nbb[slot].set(*nbb as u8);
                pending.push((pi, *nbb, i as u64, *signaled || pending.len() > 8));
                pi = pi.wrapping_add(*nbb);
                r.sq_pi.set(pi);
                // A counter outside [ci, pi) is not ours.
                prop_assert_eq!(r.complete_send(pi as u16), None);
                prop_assert_eq!(r.complete_send(r.sq_ci.get().wrapping_sub(1) as u16), None);
            }
        }

        /// The WQE written straight into the ring (at any block, wrapping past the end) and
        /// the one built for a triggered operation are, byte for byte, what the encoder that
        /// built WQEs in a stack buffer and copied them block by block produced; a request it
        /// refused is refused with the same error, and nothing outside the WQE's blocks is
        /// touched.
        #[test]
        fn wqe_bytes_match_the_stack_buffer_encoder(
            kind in 0u8..11,
            addr in prop_oneof![any::<u64>(), any::<u64>().prop_map(|a| a & !7)],
            rkey in any::<u32>(),
            imm in any::<u32>(),
            operands in any::<(u64, u64)>(),
            inline in proptest::option::of(prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..250),
                proptest::collection::vec(any::<u8>(), 6..14),
            ]),
            sgl in proptest::collection::vec(
                (prop_oneof![Just(8u32), any::<u32>()], any::<u32>(), any::<u64>()), 0..18),
            flags in 0u8..8,
            max_inline in prop_oneof![Just(256u32), 0u32..300],
            max_send_sge in prop_oneof![Just(16u32), 0u32..18],
            wqe_index in any::<u16>(),
            start_block in 0usize..8,
            xrc_srqn in prop_oneof![Just(0u32), 1u32..0x0100_0000],
        ) {
            let remote = RemoteAddr { addr, rkey };
            let op = match kind {
                0 => WrOp::Send,
                1 => WrOp::SendImm(imm),
                2 => WrOp::Write(remote),
                3 => WrOp::WriteImm(remote, imm),
                4 => WrOp::Read(remote),
                5 => WrOp::CmpSwap { remote, compare: operands.0, swap: operands.1 },
                6 => WrOp::FetchAdd { remote, add: operands.0 },
                7 => WrOp::SendInv(imm),
                8 => WrOp::BindMw(MwBind {
                    mw_key: rkey,
                    new_key: imm,
                    mr_key: rkey ^ imm,
                    addr,
                    len: operands.0,
                    access: operands.1 as u32,
                }),
                9 => WrOp::LocalInv(imm),
                _ => WrOp::AtomicWrite(remote),
            };
            let sgl: Vec<Sge> = sgl
                .iter()
                .map(|&(len, lkey, addr)| Sge { addr, len, lkey })
                .collect();
            let wr = SendWr {
                wr_id: 1,
                op,
                sgl: &sgl,
                inline: inline.as_deref(),
                flags: SendFlags::from_bits_truncate(flags),
                ud: None,
                xrc_srqn,
            };
            let want = reference_wqe(&wr, max_inline, max_send_sge, wqe_index);
            let plan = plan_send_wqe(&wr, max_inline, max_send_sge, None);
            match (&want, &plan) {
                (Err(w), Err(g)) => {
                    prop_assert_eq!(w, &format!("{g:?}"));
                    prop_assert!(small_wqe(&wr, max_inline, max_send_sge, false, wqe_index).is_none());
                }
                (Ok(want), Ok(plan)) => {
                    const BLOCKS: usize = 8;
                    let mem = DmaMemory::new(BLOCKS * WQEBB).unwrap();
                    mem.fill(0, BLOCKS * WQEBB, 0xEE).unwrap();
                    let mut out = RingSink { ring: &mem, start: start_block * WQEBB, size: BLOCKS * WQEBB };
                    emit_send_wqe(&wr, plan, wqe_index, &mut out).unwrap();
                    let nbb = want.len() / WQEBB;
                    prop_assert_eq!(nbb, wqe::wqebbs(plan.ds));
                    for b in 0..BLOCKS {
                        let mut got = [0u8; WQEBB];
                        mem.read((start_block + b) % BLOCKS * WQEBB, &mut got).unwrap();
                        if b < nbb {
                            prop_assert_eq!(&got[..], &want[b * WQEBB..(b + 1) * WQEBB], "block {}", b);
                        } else {
                            prop_assert_eq!(got, [0xEE; WQEBB], "block {} is not the WQE's", b);
                        }
                    }
                    let mut buf = [0u8; wqe::MAX_SEND_WQE];
                    emit_send_wqe(&wr, plan, wqe_index, &mut buf).unwrap();
                    prop_assert_eq!(&buf[..want.len()], &want[..]);
                    let small = small_wqe(&wr, max_inline, max_send_sge, false, wqe_index);
                    // Every valid non-atomic request with at most one SGE, or with 8..=12
                    // inline bytes, takes the small path; a UC QP's READ does not.
                    let inline_small = inline.as_ref().is_some_and(|d| (8..=12).contains(&d.len()));
                    let sgl_small = inline.is_none() && sgl.len() <= 1;
                    prop_assert_eq!(
                        small.is_some(),
                        kind <= 4 && (inline_small || sgl_small) && xrc_srqn == 0
                    );
                    if kind == 4 {
                        prop_assert!(small_wqe(&wr, max_inline, max_send_sge, true, wqe_index).is_none());
                    }
                    if let Some(words) = small {
                        prop_assert_eq!(nbb, 1);
                        mem.fill(0, BLOCKS * WQEBB, 0xEE).unwrap();
                        mem.ring_blocks(BLOCKS).unwrap().block(start_block).write_u64s::<0, 8>(words);
                        let mut got = [0u8; WQEBB];
                        mem.read(start_block * WQEBB, &mut got).unwrap();
                        prop_assert_eq!(&got[..], &want[..], "small inline WQE");
                    }
                }
                (w, g) => prop_assert!(false, "reference {:?}, plan {:?}", w, g),
            }
        }
    }

    /// The send WQE encoder as it was before WQEs were written straight into the ring: built
    /// in a zeroed stack buffer, the control segment last. Returns the WQE's whole blocks.
    fn reference_wqe(
        wr: &SendWr<'_>,
        max_inline: u32,
        max_send_sge: u32,
        wqe_index: u16,
    ) -> Result<Vec<u8>, String> {
        let mut buf = [0u8; wqe::MAX_SEND_WQE];
        let (opcode, raddr, atomic, imm) = match wr.op {
            WrOp::Send => (SendOpcode::Send, None, None, 0),
            WrOp::SendImm(i) => (SendOpcode::SendImm, None, None, i),
            WrOp::Write(r) => (SendOpcode::Write, Some(r), None, 0),
            WrOp::WriteImm(r, i) => (SendOpcode::WriteImm, Some(r), None, i),
            WrOp::Read(r) => (SendOpcode::Read, Some(r), None, 0),
            WrOp::CmpSwap {
                remote,
                compare,
                swap,
            } => (SendOpcode::CmpSwap, Some(remote), Some((swap, compare)), 0),
            WrOp::FetchAdd { remote, add } => {
                (SendOpcode::FetchAdd, Some(remote), Some((add, 0)), 0)
            }
            WrOp::SendInv(key) => (SendOpcode::SendInv, None, None, key),
            WrOp::BindMw(_) => (SendOpcode::BindMw, None, None, 0),
            WrOp::LocalInv(key) => (SendOpcode::LocalInv, None, None, key),
            WrOp::AtomicWrite(r) => (SendOpcode::AtomicWrite, Some(r), None, 0),
        };
        let err = |e: Error| Err(format!("{e:?}"));
        if opcode.is_local() {
            if !wr.sgl.is_empty() || wr.inline.is_some() {
                return err(Error::InvalidArgument(
                    "binding and invalidating windows carry no data",
                ));
            }
            let mut ds = 1;
            if let WrOp::BindMw(b) = wr.op {
                let seg = BindSeg {
                    addr: b.addr.into(),
                    length: b.len.into(),
                    mw_key: b.mw_key.into(),
                    new_key: b.new_key.into(),
                    mr_key: b.mr_key.into(),
                    access: b.access.into(),
                };
                buf[SEG..3 * SEG].copy_from_slice(seg.as_bytes());
                ds = 3;
            }
            let ctrl = CtrlSeg {
                opcode: opcode as u8,
                flags: WqeFlags::from_bits_truncate(wr.flags.bits()).bits(),
                ds_count: ds,
                imm: imm.into(),
                wqe_index: wqe_index.into(),
                xrc_srqn: wr.xrc_srqn.into(),
                ..Default::default()
            };
            buf[..SEG].copy_from_slice(ctrl.as_bytes());
            return Ok(buf[..WQEBB].to_vec());
        }
        let mut off = SEG;
        if let Some(r) = raddr {
            buf[off..off + SEG].copy_from_slice(
                RaddrSeg {
                    raddr: r.addr.into(),
                    rkey: r.rkey.into(),
                    ..Default::default()
                }
                .as_bytes(),
            );
            off += SEG;
        }
        if let Some((sa, cmp)) = atomic {
            if wr.sgl.len() != 1 || wr.sgl[0].len != 8 || wr.inline.is_some() {
                return err(Error::InvalidArgument(
                    "atomics need exactly one 8-byte SGE",
                ));
            }
            if raddr.is_some_and(|r| r.addr % 8 != 0) {
                return err(Error::InvalidArgument(
                    "atomic target must be 8-byte aligned",
                ));
            }
            buf[off..off + SEG].copy_from_slice(
                AtomicSeg {
                    swap_add: sa.into(),
                    compare: cmp.into(),
                }
                .as_bytes(),
            );
            off += SEG;
        }
        let mut flags = WqeFlags::from_bits_truncate(wr.flags.bits());
        if let WrOp::AtomicWrite(r) = wr.op {
            if wr.inline.map(<[u8]>::len) != Some(8) || !wr.sgl.is_empty() {
                return err(Error::InvalidArgument(
                    "an ATOMIC WRITE carries exactly 8 inline bytes",
                ));
            }
            if r.addr % 8 != 0 {
                return err(Error::InvalidArgument(
                    "atomic target must be 8-byte aligned",
                ));
            }
        }
        let max_inline = if matches!(wr.op, WrOp::AtomicWrite(_)) {
            8
        } else {
            max_inline
        };
        if let Some(data) = wr.inline {
            if matches!(
                opcode,
                SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd
            ) {
                return err(Error::InvalidArgument(
                    "inline data only for SEND and WRITE",
                ));
            }
            if data.len() > max_inline as usize || off + 4 + data.len() > buf.len() {
                return err(Error::InvalidArgument("inline data longer than max_inline"));
            }
            flags |= WqeFlags::INLINE;
            buf[off..off + 4].copy_from_slice(&(data.len() as u32 | INLINE_MARK).to_le_bytes());
            buf[off + 4..off + 4 + data.len()].copy_from_slice(data);
            off += (4 + data.len()).next_multiple_of(SEG);
        } else {
            if wr.sgl.len() > max_send_sge as usize || off + wr.sgl.len() * SEG > buf.len() {
                return err(Error::InvalidArgument("more SGEs than max_send_sge"));
            }
            for s in wr.sgl {
                buf[off..off + SEG].copy_from_slice(
                    DataSeg {
                        byte_count: s.len.into(),
                        lkey: s.lkey.into(),
                        addr: s.addr.into(),
                    }
                    .as_bytes(),
                );
                off += SEG;
            }
        }
        let ds = off / SEG;
        let ctrl = CtrlSeg {
            opcode: opcode as u8,
            flags: flags.bits(),
            ds_count: ds as u8,
            imm: imm.into(),
            wqe_index: wqe_index.into(),
            xrc_srqn: wr.xrc_srqn.into(),
            ..Default::default()
        };
        buf[..SEG].copy_from_slice(ctrl.as_bytes());
        Ok(buf[..wqe::wqebbs(ds) * WQEBB].to_vec())
    }
}
