//! Queue pairs and shared receive queues: contexts, the RC state machine, receive WQE
//! fetching and the flush of outstanding work on error.

use crate::env::{Env, NicEvent, Stage, TraceEvent};
use crate::nic::Nic;
use ringbell_specs::cmd::{Access, QpAttr, QpAttrMask as M, QpState};
use ringbell_specs::cqe::{
    Cqe, CqeOpcode, CqeStatus, DoorbellError, EventType, VendorSyndrome, CQE_FLAG_SRQ,
};
use ringbell_specs::wire::{AethSyndrome, NakCode};
use ringbell_specs::wqe::{CtrlSeg, DataSeg, SendOpcode, WqeFlags, RECV_LKEY_END, SEG, WQEBB};
use ringbell_specs::{regs, Psn, SimTime};
use std::collections::VecDeque;
use zerocopy::FromBytes;

/// A ring of work queue entries in host memory.
#[derive(Debug, Default, Clone)]
pub(crate) struct WorkQueue {
    pub(crate) iova: u64,
    pub(crate) log_size: u8,
    pub(crate) log_stride: u8,
    /// Producer index from the last doorbell.
    pub(crate) pi: u32,
    /// Device consumer index.
    pub(crate) ci: u32,
}

impl WorkQueue {
    pub(crate) fn size(&self) -> u32 {
        1 << self.log_size
    }
    pub(crate) fn slot_iova(&self, index: u32, stride: u64) -> u64 {
        self.iova
            .wrapping_add((index & (self.size() - 1)) as u64 * stride)
    }
}

/// A scatter/gather entry as the device reads it from a WQE.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sge {
    pub(crate) lkey: u32,
    pub(crate) addr: u64,
    pub(crate) len: u32,
}

/// A decoded, validated send WQE.
#[derive(Debug, Clone)]
pub(crate) struct SendWqe {
    pub(crate) op: SendOpcode,
    pub(crate) flags: WqeFlags,
    pub(crate) imm: u32,
    pub(crate) nbb: u32,
    pub(crate) raddr: u64,
    pub(crate) rkey: u32,
    /// (swap or add, compare).
    pub(crate) atomic: (u64, u64),
    /// Gather list (SEND/WRITE) or scatter list (READ, atomic result); empty when inline.
    pub(crate) sges: Vec<Sge>,
    /// Inline payload.
    pub(crate) inline: Vec<u8>,
    pub(crate) len: u64,
    /// The destination of a datagram (a WQE of a UD QP).
    pub(crate) ud: Option<UdDest>,
    /// A BIND_MW's bind segment (ABI 1.9).
    pub(crate) bind: crate::mw::BindReq,
    /// The XRC SRQ at the target of a request from an XRC initiator (ABI 1.11).
    pub(crate) xrc_srqn: u32,
}

/// Where a UD send WQE sends its datagram (its address segment, decoded).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct UdDest {
    pub(crate) qpn: u32,
    pub(crate) qkey: u32,
    pub(crate) mac: [u8; 6],
    pub(crate) ip: [u8; 4],
}

impl Default for SendWqe {
    fn default() -> Self {
        SendWqe::broken(SendOpcode::Send)
    }
}

impl SendWqe {
    /// A placeholder for a WQE that could not be decoded (it only ever completes in error).
    pub(crate) fn broken(op: SendOpcode) -> SendWqe {
        SendWqe {
            op,
            flags: WqeFlags::SIGNALED,
            imm: 0,
            nbb: 1,
            raddr: 0,
            rkey: 0,
            atomic: (0, 0),
            sges: Vec::new(),
            inline: Vec::new(),
            len: 0,
            ud: None,
            bind: Default::default(),
            xrc_srqn: 0,
        }
    }
    pub(crate) fn is_rd_atomic(&self) -> bool {
        matches!(
            self.op,
            SendOpcode::Read | SendOpcode::CmpSwap | SendOpcode::FetchAdd
        )
    }
}

/// A send WQE that has been started and not yet completed.
#[derive(Debug)]
pub(crate) struct Outstanding {
    pub(crate) wqe_index: u32,
    pub(crate) wqe: SendWqe,
    pub(crate) first_psn: Psn,
    /// PSNs the message uses (a READ uses one per response packet).
    pub(crate) npsn: u32,
    /// PSNs put on the wire in the current pass (READ and atomics: the request covers all).
    pub(crate) sent: u32,
    /// Most PSNs ever sent: anything below it that goes out again is a retransmission.
    pub(crate) sent_max: u32,
    /// PSNs known to have arrived: acknowledged (SEND/WRITE) or answered (READ responses).
    pub(crate) acked: u32,
    /// Earliest time the next packet's data is in the NIC.
    pub(crate) ready_at: SimTime,
    /// Set when the WQE failed; it completes with this status when it reaches the head.
    pub(crate) error: Option<(CqeStatus, VendorSyndrome)>,
    /// Finished: acknowledged, or its response arrived.
    pub(crate) done: bool,
    /// Set for the NIC's own work (no WQE, no send completion).
    pub(crate) hw: Option<HwTask>,
}

impl Outstanding {
    /// A task of the NIC's own, not yet numbered.
    pub(crate) fn task(wqe: SendWqe, task: HwTask, ready: SimTime) -> Outstanding {
        Outstanding {
            wqe_index: 0,
            wqe,
            first_psn: Psn::default(),
            npsn: 0,
            sent: 0,
            sent_max: 0,
            acked: 0,
            ready_at: ready,
            error: None,
            done: false,
            hw: Some(task),
        }
    }
    /// A WQE that puts no packet on the wire: a local operation already done (`done`), or
    /// one that failed before it started (`error`). It completes in order at the head.
    pub(crate) fn without_packets(
        wqe_index: u32,
        wqe: SendWqe,
        first_psn: Psn,
        at: SimTime,
        error: Option<(CqeStatus, VendorSyndrome)>,
        done: bool,
    ) -> Outstanding {
        Outstanding {
            wqe_index,
            wqe,
            first_psn,
            npsn: 0,
            sent: 0,
            sent_max: 0,
            acked: 0,
            ready_at: at,
            error,
            done,
            hw: None,
        }
    }
    pub(crate) fn last_psn(&self) -> Psn {
        self.first_psn.add(self.npsn.saturating_sub(1))
    }
    /// Whether `psn` belongs to this message.
    pub(crate) fn holds(&self, psn: Psn) -> bool {
        self.npsn > 0 && psn.diff(self.first_psn) >= 0 && self.last_psn().diff(psn) >= 0
    }
    pub(crate) fn is_rd_atomic(&self) -> bool {
        self.wqe.is_rd_atomic()
    }
    /// Still waiting for the network (not finished, not failed).
    pub(crate) fn pending(&self) -> bool {
        !self.done && self.error.is_none()
    }
}

/// Requester (send side) state.
#[derive(Debug, Default)]
pub(crate) struct Requester {
    /// PSN of the next new message.
    pub(crate) next_psn: Psn,
    pub(crate) outstanding: VecDeque<Outstanding>,
    /// READ and atomic WQEs outstanding.
    pub(crate) rd_atomic: u32,
    /// The NIC's own READs waiting for `max_rd_atomic` to allow them (PSNs not yet taken).
    pub(crate) hw_waiting: VecDeque<Outstanding>,
    pub(crate) scheduled: bool,
    /// Earliest time the per-QP processing unit takes the next WQE.
    pub(crate) busy_until: SimTime,
    /// Transport retries used since the last forward progress.
    pub(crate) retries_used: u8,
    /// A transport retry is under way and no progress has been made since.
    pub(crate) retrying: bool,
    /// The PSN the last go-back-N resent from, until progress is made.
    pub(crate) rewound_to: Option<Psn>,
    /// RNR retries used since the last forward progress.
    pub(crate) rnr_used: u8,
    /// No transmission before this time (an RNR NAK asked us to wait).
    pub(crate) rnr_until: SimTime,
    /// When the local ACK timer expires, if it runs.
    pub(crate) timer_deadline: Option<SimTime>,
    /// When the earliest scheduled ACK-timer event fires.
    pub(crate) timer_event: Option<SimTime>,
    /// Packets sent since the last one that asked for an ACK.
    pub(crate) since_ack_req: u32,
    /// The WQE last written through the QP's BlueFlame slot, with its index: the send
    /// engine takes it from here instead of fetching it.
    pub(crate) bf: Option<(u32, Vec<u8>)>,
    /// False only when no entry of `outstanding` has failed (set whenever one may have; the
    /// send engine clears it when it looks and finds none), so that the engine does not
    /// walk the list for a failure on every step.
    pub(crate) maybe_failed: bool,
    /// The leading entries of `outstanding` known to need no packet sent (finished,
    /// failed, or every packet sent): the send engine looks for work after them. Lowered
    /// by a rewind and by every entry taken off the front.
    pub(crate) sent_prefix: usize,
}

impl Requester {
    /// Appends an outstanding entry.
    pub(crate) fn push(&mut self, o: Outstanding) {
        self.maybe_failed |= o.error.is_some();
        self.outstanding.push_back(o);
    }

    /// Takes the oldest outstanding entry off the list.
    pub(crate) fn pop_front(&mut self) -> Option<Outstanding> {
        let o = self.outstanding.pop_front()?;
        self.sent_prefix = self.sent_prefix.saturating_sub(1);
        Some(o)
    }

    /// Marks outstanding entry `i` failed with `e`.
    pub(crate) fn fail(&mut self, i: usize, e: (CqeStatus, VendorSyndrome)) {
        if let Some(o) = self.outstanding.get_mut(i) {
            o.error = Some(e);
            self.maybe_failed = true;
        }
    }

    /// The first entry before `before` that still has a packet to send, from the known
    /// prefix on (which grows past every entry found to need none).
    pub(crate) fn first_unsent(&mut self, before: usize) -> Option<usize> {
        let mut k = self.sent_prefix;
        while k < before.min(self.outstanding.len()) {
            let o = &self.outstanding[k];
            if o.pending() && o.sent < o.npsn {
                self.sent_prefix = k;
                return Some(k);
            }
            k += 1;
        }
        self.sent_prefix = self.sent_prefix.max(k);
        None
    }

    /// The first failed entry, if any.
    pub(crate) fn first_failed(&mut self) -> Option<usize> {
        if !self.maybe_failed {
            return None;
        }
        let f = self.outstanding.iter().position(|o| o.error.is_some());
        self.maybe_failed = f.is_some();
        f
    }
}

pub use ringbell_specs::stats::{QpStats, UdStats};

/// What [`Nic::take_recv_wqe_for`] found.
#[derive(Debug)]
pub(crate) enum RecvTake {
    /// A WQE, taken: (index, srqn, scatter list).
    Wqe(u32, u32, Vec<Sge>),
    /// None is posted.
    Empty,
    /// The next one is smaller than asked; it stays posted.
    TooSmall,
}

/// A receive WQE being filled by a multi-packet SEND.
#[derive(Debug)]
pub(crate) struct RecvCtx {
    /// RQ/SRQ entry, or the tagged slot of a matched message.
    pub(crate) wqe_index: u32,
    pub(crate) srqn: u32,
    pub(crate) sges: Vec<Sge>,
    /// Message bytes received so far.
    pub(crate) offset: u64,
    /// Leading message bytes that are not data (the TMH of a matched eager message).
    pub(crate) strip: u64,
    /// How a TM-SRQ took the message (None: an ordinary receive).
    pub(crate) tm: Option<TmRecv>,
}

/// How a TM-SRQ took a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TmRecv {
    /// A tagged message nothing matched: whole, into an untagged buffer.
    Unexpected,
    /// NO_TAG or FIN: whole, into an untagged buffer.
    NoTag,
    /// An eager message that matched slot `handle`; `multi`: its MATCH completion went out
    /// with the first packet.
    Matched {
        handle: u32,
        tag: u64,
        app_ctx: u32,
        multi: bool,
    },
}

/// Work the NIC does on a QP's send side for itself (rendezvous offload), with no WQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HwTask {
    /// The RDMA READ of a matched rendezvous into tagged slot `handle`; then the FIN.
    RndvRead {
        srqn: u32,
        handle: u32,
        fin: [u8; ringbell_specs::tm::RNDV_HDR_LEN],
    },
    /// The FIN that tells the sender its buffer is free.
    Fin,
    /// A triggered data transfer: its completion counts on `comp` (generation `comp_gen`)
    /// and writes a CQE flagged TRIGGERED when `signaled` or on error.
    Triggered {
        handle: u32,
        comp: u32,
        comp_gen: u64,
        signaled: bool,
        wr_id: u64,
    },
}

/// A multi-packet RDMA WRITE in progress.
#[derive(Debug)]
pub(crate) struct WriteCtx {
    pub(crate) rkey: u32,
    pub(crate) va: u64,
    pub(crate) remaining: u32,
    pub(crate) total: u32,
}

/// A response the responder owes, in PSN order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// READ responses from PSN `first`: `len` bytes at `va` through `rkey` (looked up again for
    /// every packet, in PD `pdn`: an XRC target's changes with each request), `next` packets
    /// already sent.
    Read {
        first: Psn,
        va: u64,
        rkey: u32,
        pdn: u32,
        len: u32,
        next: u32,
        msn: u32,
        not_before: SimTime,
    },
    /// An atomic, executed at `not_before` (in arrival order with the writes around it) and
    /// answered when its turn in the queue comes.
    Atomic {
        psn: Psn,
        iova: u64,
        cas: bool,
        swap_add: u64,
        compare: u64,
        msn: u32,
        not_before: SimTime,
        /// `None` until executed; then the original value, or the IOVA that faulted.
        result: Option<Result<u64, u64>>,
    },
    /// An atomic answered again with its saved original value.
    AtomicReplay { psn: Psn, orig: u64, msn: u32 },
    /// An acknowledgement or NAK.
    Ack {
        psn: Psn,
        syndrome: AethSyndrome,
        msn: u32,
    },
    /// A fatal error found after earlier requests were accepted: NAK, then ERR.
    Fatal {
        psn: Psn,
        code: NakCode,
        status: Option<(CqeStatus, VendorSyndrome)>,
    },
}

/// A READ or atomic the responder remembers, to answer a duplicate of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resource {
    Read {
        first: Psn,
        last: Psn,
        va: u64,
        rkey: u32,
        /// The PD the key was checked in.
        pdn: u32,
        len: u32,
    },
    Atomic {
        psn: Psn,
        orig: Option<u64>,
        /// The request itself (opcode, va, rkey, operands): a duplicate must match it.
        request: (u8, u64, u32, u64, u64),
    },
}

/// Responder (receive side) state.
#[derive(Debug, Default)]
pub(crate) struct Responder {
    pub(crate) epsn: Psn,
    pub(crate) msn: u32,
    pub(crate) recv: Option<RecvCtx>,
    pub(crate) write: Option<WriteCtx>,
    pub(crate) nak_sent: bool,
    /// Responses not yet sent, in PSN order.
    pub(crate) queue: VecDeque<Reply>,
    pub(crate) engine_scheduled: bool,
    /// A fatal error is queued: further requests are dropped.
    pub(crate) dead: bool,
    /// The last `max_dest_rd_atomic` READs and atomics.
    pub(crate) resources: VecDeque<Resource>,
    /// UC: the receive WQE of a SEND that was lost on the way, kept for the next SEND,
    /// which fills it from the start (IBTA: the WQE is reused).
    pub(crate) parked: Option<RecvCtx>,
}

/// An RC queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    pub(crate) qpn: u32,
    pub(crate) pdn: u32,
    pub(crate) state: QpState,
    pub(crate) send_cqn: u32,
    pub(crate) recv_cqn: u32,
    pub(crate) srqn: u32,
    pub(crate) sq: WorkQueue,
    pub(crate) rq: WorkQueue,
    /// Next send WQEBB to start.
    pub(crate) fetch: u32,
    pub(crate) attr: QpAttr,
    pub(crate) req: Requester,
    pub(crate) resp: Responder,
    pub(crate) stats: QpStats,
    /// An unreliable-datagram QP (ABI 1.5); RC otherwise.
    pub(crate) ud: bool,
    /// An unreliable-connected QP (ABI 1.7): connected like RC, no ACKs, SEND and WRITE.
    pub(crate) uc: bool,
    /// An XRC initiator or target (ABI 1.11): RC on the XRC transport.
    pub(crate) xrc: Option<XrcRole>,
    /// A raw packet QP (ABI 1.12): whole Ethernet frames, steered to it by flow rules.
    pub(crate) raw: bool,
    /// Flow-steering rules that name this QP, and multicast groups it is attached to: it
    /// cannot be destroyed while any remains.
    pub(crate) flows: u32,
    /// A raw packet QP's RSS table (ABI 1.12): it receives through these WQs.
    pub(crate) rss: Option<Box<crate::raw::Rss>>,
    /// Datagram counters (UD QPs; `wrong_transport_dropped` on every QP).
    pub(crate) ud_stats: UdStats,
    /// Context generation, see [`crate::NicEvent::SqProcess`].
    pub(crate) gen: u64,
    /// Counters bound to the QP's events.
    pub(crate) cntrs: crate::counter::EventCntrs,
}

impl Qp {
    pub(crate) fn mtu(&self) -> u32 {
        ringbell_specs::cmd::mtu_bytes(self.attr.path_mtu).unwrap_or(256)
    }
    pub(crate) fn access(&self) -> Access {
        Access::from_bits_truncate(self.attr.access.get())
    }
    /// Oldest send WQEBB the device has not completed.
    pub(crate) fn sq_tail(&self) -> u32 {
        // The NIC's own work (rendezvous READ, FIN) holds no SQ slot.
        self.req
            .outstanding
            .iter()
            .find(|o| o.hw.is_none())
            .map_or(self.fetch, |o| o.wqe_index)
    }
}

/// The part an XRC QP plays (ABI 1.11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XrcRole {
    /// Sends only; each request names the XRC SRQ at the target (the WQE's `xrc_srqn`).
    Ini,
    /// Receives only, for XRC domain `xrcdn`: each request goes to the XRC SRQ it names,
    /// which gives it its PD, its receive WQE and its CQ.
    Tgt { xrcdn: u32 },
}

/// A shared receive queue.
#[derive(Debug)]
pub(crate) struct Srq {
    pub(crate) pdn: u32,
    /// An XRC SRQ (ABI 1.11): its XRC domain and the CQ its receives complete on; a
    /// receive WQ (ABI 1.12): domain 0 and its CQ.
    pub(crate) xrc: Option<(u32, u32)>,
    /// A receive WQ's state (ABI 1.12): frames reach it only when READY.
    pub(crate) wq_state: u8,
    pub(crate) wq: WorkQueue,
    pub(crate) limit: u32,
    pub(crate) refs: u32,
    /// Tag matching, for a TM-SRQ.
    pub(crate) tm: Option<Box<crate::tm::TmState>>,
}

/// (required, optional) attribute masks of a UD transition, per the IBTA table: no path,
/// no peer, only the Q_Key and the own send PSN.
fn ud_transition_masks(from: QpState, to: QpState) -> Option<(M, M)> {
    use QpState::*;
    let e = M::empty();
    Some(match (from, to) {
        (Reset, Init) => (M::PKEY_INDEX | M::PORT | M::QKEY, e),
        (Init, Init) => (e, M::PKEY_INDEX | M::PORT | M::QKEY),
        (Init, Rtr) => (e, M::PKEY_INDEX | M::QKEY),
        (Rtr, Rts) => (M::SQ_PSN, M::CUR_STATE | M::QKEY),
        (Rts, Rts) | (Sqd, Rts) => (e, M::CUR_STATE | M::QKEY),
        (Rts, Sqd) => (e, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (e, M::PKEY_INDEX | M::QKEY),
        _ => return transition_masks(from, to).filter(|(r, o)| r.is_empty() && o.is_empty()),
    })
}

/// (required, optional) attribute masks of a raw packet QP's transition (ABI 1.12), as
/// Linux's table has them: the port to enter INIT, nothing else; transitions to RESET and
/// ERR are RC's.
fn raw_transition_masks(from: QpState, to: QpState) -> Option<(M, M)> {
    use QpState::*;
    let e = M::empty();
    Some(match (from, to) {
        (Reset, Init) => (M::PORT, e),
        (Init, Init) => (e, M::PORT),
        (Init, Rtr) | (Rtr, Rts) => (e, e),
        (Rts, Rts) | (Sqd, Rts) => (e, M::CUR_STATE),
        (Rts, Sqd) => (e, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (e, e),
        _ => return transition_masks(from, to).filter(|(r, o)| r.is_empty() && o.is_empty()),
    })
}

/// (required, optional) attribute masks of a UC transition, per the IBTA table: RC's without
/// what only acknowledged traffic uses (the ACK timer and retries, READ/atomic resources and
/// the RNR timer). Transitions to RESET and ERR are RC's.
fn uc_transition_masks(from: QpState, to: QpState) -> Option<(M, M)> {
    use QpState::*;
    let e = M::empty();
    Some(match (from, to) {
        (Reset, Init) => (M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, e),
        (Init, Init) => (e, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
        (Init, Rtr) => (
            M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
            M::ACCESS_FLAGS | M::PKEY_INDEX,
        ),
        (Rtr, Rts) => (M::SQ_PSN, M::CUR_STATE | M::ACCESS_FLAGS),
        (Rts, Rts) | (Sqd, Rts) => (e, M::CUR_STATE | M::ACCESS_FLAGS),
        (Rts, Sqd) => (e, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (e, M::PORT | M::AV | M::ACCESS_FLAGS | M::PKEY_INDEX),
        _ => return transition_masks(from, to).filter(|(r, o)| r.is_empty() && o.is_empty()),
    })
}

/// (required, optional) attribute masks of an XRC transition (ABI 1.11), as the IBTA and
/// Linux's table have them: an initiator is RC without the receive side's attributes (READ
/// and atomic resources as responder, the RNR timer), a target RC without the send side's
/// (retries, READ and atomic resources as requester). The rest is RC's.
fn xrc_transition_masks(role: XrcRole, from: QpState, to: QpState) -> Option<(M, M)> {
    use QpState::*;
    let e = M::empty();
    let ini = role == XrcRole::Ini;
    Some(match (from, to) {
        (Init, Rtr) if ini => (
            M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
            M::ACCESS_FLAGS | M::PKEY_INDEX,
        ),
        (Rtr, Rts) if ini => (
            M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
            M::CUR_STATE | M::ACCESS_FLAGS,
        ),
        (Rts, Rts) | (Sqd, Rts) if ini => (e, M::CUR_STATE | M::ACCESS_FLAGS),
        (Rtr, Rts) => (
            M::TIMEOUT | M::SQ_PSN,
            M::CUR_STATE | M::ACCESS_FLAGS | M::MIN_RNR_TIMER,
        ),
        _ => return transition_masks(from, to),
    })
}

/// (required, optional) attribute masks of an RC transition, per the IBTA table.
fn transition_masks(from: QpState, to: QpState) -> Option<(M, M)> {
    use QpState::*;
    let e = M::empty();
    Some(match (from, to) {
        (Reset, Init) => (M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, e),
        (Init, Init) => (e, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
        (Init, Rtr) => (
            M::AV
                | M::PATH_MTU
                | M::DEST_QPN
                | M::RQ_PSN
                | M::MAX_DEST_RD_ATOMIC
                | M::MIN_RNR_TIMER,
            M::ACCESS_FLAGS | M::PKEY_INDEX,
        ),
        (Rtr, Rts) => (
            M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
            M::CUR_STATE | M::ACCESS_FLAGS | M::MIN_RNR_TIMER,
        ),
        (Rts, Rts) | (Sqd, Rts) => (e, M::CUR_STATE | M::ACCESS_FLAGS | M::MIN_RNR_TIMER),
        (Rts, Sqd) => (e, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (
            e,
            M::PORT
                | M::AV
                | M::TIMEOUT
                | M::RETRY_CNT
                | M::RNR_RETRY
                | M::MAX_QP_RD_ATOMIC
                | M::MAX_DEST_RD_ATOMIC
                | M::ACCESS_FLAGS
                | M::PKEY_INDEX
                | M::MIN_RNR_TIMER,
        ),
        (Init | Rtr | Rts | Sqd | Sqe, Reset) | (Init | Rtr | Rts | Sqd | Sqe, Err) => (e, e),
        (Err, Reset) | (Err, Err) | (Reset, Reset) | (Reset, Err) => (e, e),
        _ => return None,
    })
}

/// Why a MODIFY_QP was refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ModifyError {
    BadParam,
    BadState,
}

/// Validates a modify against the QP's current state and the device limits; all or nothing.
pub(crate) fn check_modify(
    qp: &Qp,
    mask: M,
    a: &QpAttr,
    max_rd_atomic: u32,
) -> Result<QpState, ModifyError> {
    let to = if mask.contains(M::STATE) {
        QpState::from_u8(a.state).ok_or(ModifyError::BadParam)?
    } else {
        qp.state
    };
    let masks = match (qp.ud, qp.uc, qp.xrc) {
        _ if qp.raw => raw_transition_masks(qp.state, to),
        (true, _, _) => ud_transition_masks(qp.state, to),
        (_, true, _) => uc_transition_masks(qp.state, to),
        (_, _, Some(role)) => xrc_transition_masks(role, qp.state, to),
        _ => transition_masks(qp.state, to),
    };
    let (req, opt) = masks.ok_or(ModifyError::BadState)?;
    let given = mask - M::STATE;
    if !given.difference(req | opt).is_empty() || !given.contains(req) {
        return Err(ModifyError::BadParam);
    }
    if mask.contains(M::CUR_STATE) {
        if !matches!(
            qp.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            return Err(ModifyError::BadParam);
        }
        if QpState::from_u8(a.cur_state) != Some(qp.state) {
            return Err(ModifyError::BadState);
        }
    }
    let ok = (!mask.contains(M::PATH_MTU) || (1..=5).contains(&a.path_mtu))
        && (!mask.contains(M::TIMEOUT) || a.timeout <= 31)
        && (!mask.contains(M::RETRY_CNT) || a.retry_cnt <= 7)
        && (!mask.contains(M::RNR_RETRY) || a.rnr_retry <= 7)
        && (!mask.contains(M::MIN_RNR_TIMER) || a.min_rnr_timer <= 31)
        && (!mask.contains(M::MAX_QP_RD_ATOMIC) || (a.max_rd_atomic as u32) <= max_rd_atomic)
        && (!mask.contains(M::MAX_DEST_RD_ATOMIC)
            || (a.max_dest_rd_atomic as u32) <= max_rd_atomic)
        && (!mask.contains(M::DEST_QPN)
            || a.dest_qpn.get() <= 0x00FF_FFFF && a.dest_qpn.get() != 0)
        && (!mask.contains(M::ACCESS_FLAGS) || Access::from_bits(a.access.get()).is_some())
        && (!mask.contains(M::PKEY_INDEX) || a.pkey_index.get() == 0)
        && (!mask.contains(M::QKEY)
            || a.qkey.get() & ringbell_specs::cmd::QKEY_USE_QP == 0
            || (qp.qpn == ringbell_specs::cmd::GSI_QPN
                && a.qkey.get() == ringbell_specs::cmd::GSI_QKEY));
    if !ok {
        return Err(ModifyError::BadParam);
    }
    Ok(to)
}

impl Nic {
    /// Applies a validated modify.
    pub(crate) fn apply_modify(
        &mut self,
        env: &mut dyn Env,
        qpn: u32,
        mask: M,
        a: &QpAttr,
        to: QpState,
    ) {
        let Some(qp) = self.qps.get_mut(qpn) else {
            return;
        };
        let t = &mut qp.attr;
        if mask.contains(M::ACCESS_FLAGS) {
            t.access = a.access;
        }
        if mask.contains(M::AV) {
            t.dest_mac = a.dest_mac;
            t.dest_ip = a.dest_ip;
        }
        if mask.contains(M::PATH_MTU) {
            t.path_mtu = a.path_mtu;
        }
        if mask.contains(M::TIMEOUT) {
            t.timeout = a.timeout;
        }
        if mask.contains(M::RETRY_CNT) {
            t.retry_cnt = a.retry_cnt;
        }
        if mask.contains(M::RNR_RETRY) {
            t.rnr_retry = a.rnr_retry;
        }
        if mask.contains(M::MIN_RNR_TIMER) {
            t.min_rnr_timer = a.min_rnr_timer;
        }
        if mask.contains(M::MAX_QP_RD_ATOMIC) {
            t.max_rd_atomic = a.max_rd_atomic;
        }
        if mask.contains(M::MAX_DEST_RD_ATOMIC) {
            t.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if mask.contains(M::DEST_QPN) {
            t.dest_qpn = a.dest_qpn;
        }
        if mask.contains(M::QKEY) {
            t.qkey = a.qkey;
        }
        if mask.contains(M::RQ_PSN) {
            t.rq_psn = (a.rq_psn.get() & Psn::MASK).into();
            qp.resp.epsn = Psn::new(a.rq_psn.get());
        }
        if mask.contains(M::SQ_PSN) {
            t.sq_psn = (a.sq_psn.get() & Psn::MASK).into();
            qp.req.next_psn = Psn::new(a.sq_psn.get());
        }
        let from = qp.state;
        qp.state = to;
        qp.attr.state = to as u8;
        match to {
            QpState::Reset => self.reset_qp(env, qpn),
            QpState::Err if from != QpState::Err => self.flush_qp(env, qpn),
            QpState::Rts => {
                let now = env.now();
                self.kick_sq(env, qpn, now)
            }
            _ => {}
        }
    }

    /// RESET: every queue emptied without completions, transport state cleared, and a new
    /// generation so that work scheduled for the old incarnation (send engine runs, deferred
    /// responses, CQEs) dies with it.
    pub(crate) fn reset_qp(&mut self, env: &mut dyn Env, qpn: u32) {
        let gen = self.fresh_gen();
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        self.release_srq_wqe(env, &mut qp);
        qp.sq.pi = 0;
        qp.sq.ci = 0;
        qp.rq.pi = 0;
        qp.rq.ci = 0;
        qp.fetch = 0;
        qp.req = Requester::default();
        qp.resp = Responder::default();
        qp.gen = gen;
        self.qps.restore(qpn, qp);
    }

    /// A receive WQE taken from an SRQ and not completed belongs to the SRQ, not to the QP:
    /// when the QP lets go of it (reset, destroy) it completes with WR_FLUSH_ERR so the SRQ
    /// slot is retired.
    pub(crate) fn release_srq_wqe(&mut self, env: &mut dyn Env, qp: &mut Qp) {
        // The NIC's own rendezvous work holds tagged buffers of the SRQ: they complete with
        // WR_FLUSH_ERR and go back to the list's free slots.
        let now = env.now();
        let (mut hw, own): (VecDeque<Outstanding>, VecDeque<Outstanding>) =
            std::mem::take(&mut qp.req.outstanding)
                .into_iter()
                .partition(|o| o.hw.is_some());
        qp.req.outstanding = own;
        hw.append(&mut qp.req.hw_waiting);
        for o in &hw {
            self.hw_task_done(
                env,
                qp,
                o,
                (CqeStatus::WrFlushErr, VendorSyndrome::None),
                now,
            );
        }
        let held = qp.resp.recv.take_if(|rc| rc.srqn != 0);
        if let Some(rc) = held.or_else(|| qp.resp.parked.take_if(|rc| rc.srqn != 0)) {
            let now = env.now();
            if rc.tm.is_some() {
                // TM-SRQ completions are not tied to the QP: they are written regardless.
                self.finish_recv(
                    env,
                    qp,
                    rc,
                    (CqeStatus::WrFlushErr, VendorSyndrome::None),
                    0,
                    0,
                    0,
                    now,
                );
                return;
            }
            let cqe = Cqe {
                opcode: CqeOpcode::Recv as u8,
                status: CqeStatus::WrFlushErr as u8,
                wqe_counter: (rc.wqe_index as u16).into(),
                qpn: qp.qpn.into(),
                flags: CQE_FLAG_SRQ,
                srqn: rc.srqn.into(),
                ..Default::default()
            };
            self.complete(env, 0, qp.recv_cqn, now, cqe);
        }
    }

    /// Schedules the send engine of `qpn` if it is not already scheduled.
    pub(crate) fn kick_sq(&mut self, env: &mut dyn Env, qpn: u32, at: SimTime) {
        if let Some(qp) = self.qps.get_mut(qpn) {
            if !qp.req.scheduled {
                qp.req.scheduled = true;
                env.schedule(
                    at.max(qp.req.busy_until),
                    NicEvent::SqProcess { qpn, gen: qp.gen },
                );
            }
        }
    }

    /// A BlueFlame write to QP `qpn`'s slot: the whole WQE at the send queue's producer
    /// index, and the doorbell for it. Anything else (wrong index, no control segment, fewer
    /// bytes than the WQE's blocks) is a stale-WQE doorbell error and is ignored.
    pub(crate) fn bf_write(&mut self, env: &mut dyn Env, qpn: u32, data: &[u8]) {
        let Some(qp) = self.qps.get_mut(qpn) else {
            self.doorbell_error(env, qpn, DoorbellError::NoSuchObject, 0);
            return;
        };
        let index = qp.sq.pi;
        let ctrl = data
            .get(..SEG)
            .and_then(|c| CtrlSeg::read_from_bytes(c).ok())
            .unwrap_or_default();
        let ds = ctrl.ds_count as usize;
        let nbb = ringbell_specs::wqe::wqebbs(ds.max(1)) as u32;
        let whole =
            (1..=ringbell_specs::wqe::MAX_DS).contains(&ds) && data.len() >= nbb as usize * WQEBB;
        if ctrl == CtrlSeg::default() || ctrl.wqe_index.get() != index as u16 || !whole {
            self.doorbell_error(env, qpn, DoorbellError::StaleWqe, index);
            return;
        }
        // The copy reuses the buffer of the QP's previous one.
        let mut buf = qp.req.bf.take().map(|(_, b)| b).unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(&data[..nbb as usize * WQEBB]);
        qp.req.bf = Some((index, buf));
        self.qp_doorbell(env, qpn, regs::DB_SQ, index.wrapping_add(nbb));
        // A refused doorbell (the ring is full) refuses the copy too: a later doorbell over
        // this index must run what the ring holds then.
        if let Some(qp) = self.qps.get_mut(qpn) {
            if qp.sq.pi == index {
                qp.req.bf = None;
            }
        }
    }

    pub(crate) fn qp_doorbell(&mut self, env: &mut dyn Env, qpn: u32, which: u64, value: u32) {
        let Some(qp) = self.qps.get_mut(qpn) else {
            self.doorbell_error(env, qpn, DoorbellError::NoSuchObject, value);
            return;
        };
        let in_range = |wq: &WorkQueue, tail: u32| {
            let ahead = value.wrapping_sub(tail);
            ahead <= wq.size() && value.wrapping_sub(wq.pi) as i32 >= 0
        };
        if which == regs::DB_SQ {
            if !in_range(&qp.sq, qp.sq_tail()) {
                self.doorbell_error(env, qpn, DoorbellError::IndexOutOfRange, value);
                return;
            }
            qp.sq.pi = value;
            match qp.state {
                QpState::Rts => {
                    let now = env.now();
                    self.kick_sq(env, qpn, now)
                }
                QpState::Err => self.flush_qp(env, qpn),
                _ => {}
            }
        } else {
            if qp.srqn != 0 || !in_range(&qp.rq, qp.rq.ci) {
                self.doorbell_error(env, qpn, DoorbellError::IndexOutOfRange, value);
                return;
            }
            qp.rq.pi = value;
            if qp.state == QpState::Err {
                self.flush_qp(env, qpn);
            }
        }
    }

    pub(crate) fn srq_doorbell(&mut self, env: &mut dyn Env, srqn: u32, which: u64, value: u32) {
        if which == regs::DB_SRQ_TM_OPS {
            self.tm_ops_doorbell(env, srqn, value);
            return;
        }
        let Some(srq) = self.srqs.get_mut(srqn) else {
            self.doorbell_error(env, srqn, DoorbellError::NoSuchObject, value);
            return;
        };
        let ahead = value.wrapping_sub(srq.wq.ci);
        if ahead > srq.wq.size() || (value.wrapping_sub(srq.wq.pi) as i32) < 0 {
            self.doorbell_error(env, srqn, DoorbellError::IndexOutOfRange, value);
            return;
        }
        srq.wq.pi = value;
    }

    /// Reads the scatter list of receive WQE `index` of a ring with `1 << log_stride` bytes
    /// per entry.
    pub(crate) fn read_recv_wqe(
        &mut self,
        env: &mut dyn Env,
        wq: &WorkQueue,
        index: u32,
    ) -> Result<Vec<Sge>, u64> {
        let stride = 1u64 << wq.log_stride;
        let at = wq.slot_iova(index, stride);
        let mut buf = [0u8; 16 * 32];
        let n = (stride as usize).min(buf.len());
        env.dma_read(at, &mut buf[..n]).map_err(|f| f.iova)?;
        let mut sges = Vec::new();
        for chunk in buf[..n].chunks_exact(SEG) {
            let Ok(d) = DataSeg::read_from_bytes(chunk) else {
                break;
            };
            if d.lkey.get() == RECV_LKEY_END {
                break;
            }
            sges.push(Sge {
                lkey: d.lkey.get(),
                addr: d.addr.get(),
                len: d.byte_count.get(),
            });
        }
        Ok(sges)
    }

    /// Takes the next receive WQE for `qpn` from its RQ or SRQ: (index, srqn, sges).
    /// `Ok(None)` when none is posted.
    #[allow(clippy::type_complexity)]
    pub(crate) fn take_recv_wqe(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
    ) -> Result<Option<(u32, u32, Vec<Sge>)>, u64> {
        Ok(match self.take_recv_wqe_for(env, qp, 0)? {
            RecvTake::Wqe(index, srqn, sges) => Some((index, srqn, sges)),
            RecvTake::Empty | RecvTake::TooSmall => None,
        })
    }

    /// The WQE at the consumer index of SRQ `srqn` was taken: the index moves on, and the
    /// SRQ's limit event fires when fewer than its limit are left.
    pub(crate) fn srq_consumed(&mut self, env: &mut dyn Env, srqn: u32) {
        if let Some(srq) = self.srqs.get_mut(srqn) {
            srq.wq.ci = srq.wq.ci.wrapping_add(1);
            let left = srq.wq.pi.wrapping_sub(srq.wq.ci);
            if srq.limit != 0 && left < srq.limit {
                srq.limit = 0;
                self.post_event(env, EventType::SrqLimit, 0, srqn, left as u64);
            }
        }
    }

    /// Takes the next receive WQE for `qpn` if its capacity is at least `need` bytes; a
    /// smaller one is read and left in place.
    pub(crate) fn take_recv_wqe_for(
        &mut self,
        env: &mut dyn Env,
        qp: &mut Qp,
        need: u64,
    ) -> Result<RecvTake, u64> {
        let fits = |sges: &[Sge]| sges.iter().map(|s| u64::from(s.len)).sum::<u64>() >= need;
        if qp.srqn != 0 {
            let Some(srq) = self.srqs.get_mut(qp.srqn) else {
                return Ok(RecvTake::Empty);
            };
            if srq.wq.ci == srq.wq.pi {
                return Ok(RecvTake::Empty);
            }
            let wq = srq.wq.clone();
            let index = wq.ci;
            let sges = self.read_recv_wqe(env, &wq, index)?;
            if !fits(&sges) {
                return Ok(RecvTake::TooSmall);
            }
            let srqn = qp.srqn;
            self.srq_consumed(env, srqn);
            Ok(RecvTake::Wqe(index, srqn, sges))
        } else {
            if qp.rq.ci == qp.rq.pi {
                return Ok(RecvTake::Empty);
            }
            let index = qp.rq.ci;
            let wq = qp.rq.clone();
            let sges = self.read_recv_wqe(env, &wq, index)?;
            if !fits(&sges) {
                return Ok(RecvTake::TooSmall);
            }
            qp.rq.ci = qp.rq.ci.wrapping_add(1);
            Ok(RecvTake::Wqe(index, 0, sges))
        }
    }

    /// Queues a CQE write at `ready` plus the PCIe write and CQE-after-data delays. The CQE is
    /// dropped if the QP (generation `qp_gen`; 0: no QP check) is reset or destroyed first.
    pub(crate) fn complete(
        &mut self,
        env: &mut dyn Env,
        qp_gen: u64,
        cqn: u32,
        ready: SimTime,
        cqe: Cqe,
    ) {
        let start = ready.max(self.pcie_write_free);
        let t = self.reserve_pcie_write(ready, 64) + SimTime(self.cfg.timing.nic_cqe_after_data_ps);
        if env.tracing() {
            let (done, vis) = (
                self.pcie_write_free,
                t - SimTime(self.cfg.timing.nic_cqe_after_data_ps),
            );
            let ev = |s, a, b| {
                TraceEvent::new(s, a, b)
                    .qpn(cqe.qpn.get())
                    .obj(cqn)
                    .psn(cqe.wqe_counter.get() as u32)
                    .op(cqe.opcode)
                    .status(cqe.status)
            };
            env.trace(ev(Stage::CqeDma, start, done).bytes(64));
            env.trace(ev(Stage::CqeVisible, done, vis));
            env.trace(ev(Stage::CqeOrder, vis, t));
        }
        let gen = self.cqs.get(cqn).map_or(0, |c| c.gen);
        // A box of a CQE already written, if any (one allocation per CQE otherwise).
        let cqe = match self.cqe_pool.pop() {
            Some(mut b) => {
                *b = cqe;
                b
            }
            None => Box::new(cqe),
        };
        env.schedule(
            t,
            NicEvent::CqeWrite {
                cqn,
                gen,
                qp_gen,
                cqe,
            },
        );
    }

    /// Builds a send-side CQE.
    pub(crate) fn send_cqe(
        qpn: u32,
        wqe_index: u32,
        wqe: &SendWqe,
        status: CqeStatus,
        syndrome: VendorSyndrome,
    ) -> Cqe {
        let opcode = match wqe.op {
            SendOpcode::Send | SendOpcode::SendImm | SendOpcode::SendInv => CqeOpcode::Send,
            SendOpcode::Write | SendOpcode::WriteImm => CqeOpcode::RdmaWrite,
            SendOpcode::Read => CqeOpcode::RdmaRead,
            SendOpcode::CmpSwap => CqeOpcode::CompSwap,
            SendOpcode::FetchAdd => CqeOpcode::FetchAdd,
            SendOpcode::BindMw => CqeOpcode::BindMw,
            SendOpcode::LocalInv => CqeOpcode::LocalInv,
            SendOpcode::AtomicWrite => CqeOpcode::AtomicWrite,
        };
        Cqe {
            opcode: opcode as u8,
            status: status as u8,
            wqe_counter: (wqe_index as u16).into(),
            qpn: qpn.into(),
            byte_len: (wqe.len as u32).into(),
            vendor_syndrome: syndrome as u8,
            ..Default::default()
        }
    }

    /// Moves `qpn` to ERR (if it is not there) and flushes every outstanding and posted WQE.
    pub(crate) fn flush_qp(&mut self, env: &mut dyn Env, qpn: u32) {
        let Some(mut qp) = self.qps.remove(qpn) else {
            return;
        };
        self.flush(env, &mut qp);
        self.qps.restore(qpn, qp);
    }

    /// Moves `qp` (taken out of the table) to ERR and flushes its work.
    pub(crate) fn flush(&mut self, env: &mut dyn Env, qp: &mut Qp) {
        let qpn = qp.qpn;
        qp.state = QpState::Err;
        qp.attr.state = QpState::Err as u8;
        let now = env.now();
        while let Some(o) = qp.req.pop_front() {
            if o.hw.is_some() {
                self.hw_task_done(
                    env,
                    qp,
                    &o,
                    (CqeStatus::WrFlushErr, VendorSyndrome::None),
                    now,
                );
                continue;
            }
            let cqe = Self::send_cqe(
                qpn,
                o.wqe_index,
                &o.wqe,
                CqeStatus::WrFlushErr,
                VendorSyndrome::None,
            );
            self.complete(env, qp.gen, qp.send_cqn, now, cqe);
            self.qp_count(
                env,
                &qp.cntrs,
                crate::counter::send_event(o.wqe.op),
                false,
                now,
            );
        }
        for o in std::mem::take(&mut qp.req.hw_waiting) {
            self.hw_task_done(
                env,
                qp,
                &o,
                (CqeStatus::WrFlushErr, VendorSyndrome::None),
                now,
            );
        }
        qp.req.rd_atomic = 0;
        qp.req.timer_deadline = None;
        qp.resp.queue.clear();
        qp.resp.dead = false;
        // WQEs posted but never started: read each control segment to learn its size.
        let mut guard = 0;
        while qp.fetch != qp.sq.pi && guard <= qp.sq.size() {
            guard += 1;
            let mut b = [0u8; 16];
            let at = qp.sq.slot_iova(qp.fetch, WQEBB as u64);
            let ctrl = env
                .dma_read(at, &mut b)
                .ok()
                .and_then(|_| CtrlSeg::read_from_bytes(&b).ok());
            let (op, nbb) = match ctrl {
                Some(c)
                    if c.wqe_index.get() == qp.fetch as u16 && (1..=16).contains(&c.ds_count) =>
                {
                    (
                        SendOpcode::from_u8(c.opcode).unwrap_or(SendOpcode::Send),
                        ringbell_specs::wqe::wqebbs(c.ds_count as usize) as u32,
                    )
                }
                _ => (SendOpcode::Send, 1),
            };
            let cqe = Self::send_cqe(
                qpn,
                qp.fetch,
                &SendWqe::broken(op),
                CqeStatus::WrFlushErr,
                VendorSyndrome::None,
            );
            self.complete(env, qp.gen, qp.send_cqn, now, cqe);
            self.qp_count(env, &qp.cntrs, crate::counter::send_event(op), false, now);
            if qp.sq.pi.wrapping_sub(qp.fetch) < nbb {
                qp.fetch = qp.sq.pi;
            } else {
                qp.fetch = qp.fetch.wrapping_add(nbb);
            }
        }
        qp.fetch = qp.sq.pi;
        // At most one of the two holds a WQE (a parked one is reused by the next SEND).
        if let Some(rc) = qp.resp.recv.take().or_else(|| qp.resp.parked.take()) {
            self.finish_recv(
                env,
                qp,
                rc,
                (CqeStatus::WrFlushErr, VendorSyndrome::None),
                0,
                0,
                0,
                now,
            );
        }
        qp.resp.write = None;
        if qp.srqn == 0 {
            while qp.rq.ci != qp.rq.pi {
                let idx = qp.rq.ci;
                self.flush_recv(env, qp, idx, 0, now);
                qp.rq.ci = qp.rq.ci.wrapping_add(1);
            }
        }
    }

    fn flush_recv(&mut self, env: &mut dyn Env, qp: &Qp, index: u32, srqn: u32, now: SimTime) {
        let cqe = Cqe {
            opcode: CqeOpcode::Recv as u8,
            status: CqeStatus::WrFlushErr as u8,
            wqe_counter: (index as u16).into(),
            qpn: qp.qpn.into(),
            flags: if srqn != 0 { CQE_FLAG_SRQ } else { 0 },
            srqn: srqn.into(),
            ..Default::default()
        };
        self.complete(env, qp.gen, qp.recv_cqn, now, cqe);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qp_in(state: QpState) -> Qp {
        Qp {
            qpn: 1,
            pdn: 1,
            state,
            send_cqn: 1,
            recv_cqn: 1,
            srqn: 0,
            sq: WorkQueue::default(),
            rq: WorkQueue::default(),
            fetch: 0,
            attr: QpAttr::default(),
            req: Requester::default(),
            resp: Responder::default(),
            stats: QpStats::default(),
            ud: false,
            uc: false,
            xrc: None,
            raw: false,
            flows: 0,
            rss: None,
            ud_stats: UdStats::default(),
            gen: 1,
            cntrs: Default::default(),
        }
    }

    const STATES: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];

    fn valid_attr(to: QpState) -> QpAttr {
        QpAttr {
            state: to as u8,
            path_mtu: 5,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 4,
            max_dest_rd_atomic: 4,
            dest_qpn: 9.into(),
            ..Default::default()
        }
    }

    /// Every transition of the table: exactly the required mask succeeds; dropping any
    /// required bit or adding any bit outside required ∪ optional fails with BadParam; pairs
    /// not in the table fail with BadState.
    #[test]
    fn transition_table_is_enforced_bit_by_bit() {
        for from in STATES {
            for to in STATES {
                let qp = qp_in(from);
                let a = QpAttr {
                    cur_state: from as u8,
                    ..valid_attr(to)
                };
                match transition_masks(from, to) {
                    None => assert_eq!(
                        check_modify(&qp, M::STATE, &a, 16),
                        Err(ModifyError::BadState),
                        "{from:?}->{to:?}"
                    ),
                    Some((req, opt)) => {
                        assert_eq!(
                            check_modify(&qp, M::STATE | req, &a, 16),
                            Ok(to),
                            "{from:?}->{to:?}"
                        );
                        assert_eq!(
                            check_modify(&qp, M::STATE | req | opt, &a, 16),
                            Ok(to),
                            "{from:?}->{to:?} all optional"
                        );
                        for bit in req.iter() {
                            assert_eq!(
                                check_modify(&qp, M::STATE | (req - bit), &a, 16),
                                Err(ModifyError::BadParam)
                            );
                        }
                        for bit in M::all().iter() {
                            if !(req | opt | M::STATE).contains(bit) {
                                assert_eq!(
                                    check_modify(&qp, M::STATE | req | bit, &a, 16),
                                    Err(ModifyError::BadParam),
                                    "{from:?}->{to:?} + {bit:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn attribute_ranges_are_checked() {
        let qp = qp_in(QpState::Init);
        let req = M::STATE
            | M::AV
            | M::PATH_MTU
            | M::DEST_QPN
            | M::RQ_PSN
            | M::MAX_DEST_RD_ATOMIC
            | M::MIN_RNR_TIMER;
        for bad in [
            QpAttr {
                path_mtu: 0,
                ..valid_attr(QpState::Rtr)
            },
            QpAttr {
                path_mtu: 6,
                ..valid_attr(QpState::Rtr)
            },
            QpAttr {
                min_rnr_timer: 32,
                ..valid_attr(QpState::Rtr)
            },
            QpAttr {
                max_dest_rd_atomic: 17,
                ..valid_attr(QpState::Rtr)
            },
            QpAttr {
                dest_qpn: 0.into(),
                ..valid_attr(QpState::Rtr)
            },
            QpAttr {
                dest_qpn: (1 << 24).into(),
                ..valid_attr(QpState::Rtr)
            },
        ] {
            assert_eq!(
                check_modify(&qp, req, &bad, 16),
                Err(ModifyError::BadParam),
                "{bad:?}"
            );
        }
        let qp = qp_in(QpState::Rtr);
        let req =
            M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC;
        for bad in [
            QpAttr {
                timeout: 32,
                ..valid_attr(QpState::Rts)
            },
            QpAttr {
                retry_cnt: 8,
                ..valid_attr(QpState::Rts)
            },
            QpAttr {
                rnr_retry: 8,
                ..valid_attr(QpState::Rts)
            },
            QpAttr {
                max_rd_atomic: 17,
                ..valid_attr(QpState::Rts)
            },
        ] {
            assert_eq!(
                check_modify(&qp, req, &bad, 16),
                Err(ModifyError::BadParam),
                "{bad:?}"
            );
        }
        // CUR_STATE must match, and is only legal from RTR, RTS, SQD, SQE.
        let a = QpAttr {
            cur_state: QpState::Rts as u8,
            ..valid_attr(QpState::Rts)
        };
        assert_eq!(
            check_modify(&qp, req | M::CUR_STATE, &a, 16),
            Err(ModifyError::BadState)
        );
        let a = QpAttr {
            cur_state: QpState::Rtr as u8,
            ..valid_attr(QpState::Rts)
        };
        assert_eq!(
            check_modify(&qp, req | M::CUR_STATE, &a, 16),
            Ok(QpState::Rts)
        );
        let init = qp_in(QpState::Init);
        let a = QpAttr {
            cur_state: QpState::Init as u8,
            ..valid_attr(QpState::Err)
        };
        assert_eq!(
            check_modify(&init, M::STATE | M::CUR_STATE, &a, 16),
            Err(ModifyError::BadParam)
        );
        // An unknown state byte.
        let a = QpAttr {
            state: 9,
            ..Default::default()
        };
        assert_eq!(
            check_modify(&init, M::STATE, &a, 16),
            Err(ModifyError::BadParam)
        );
    }
}
