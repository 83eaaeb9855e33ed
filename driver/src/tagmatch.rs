//! A software tag-matching layer on top of a TM-SRQ: what an MPI-style runtime builds on.
//!
//! [`TagMatcher`] owns a TM-SRQ, a CQ, one RC QP per peer, a registered user region and a
//! staging region. It offers tagged send and receive with wildcard masks and MPI matching
//! order:
//! - **Sends** go eager (TMH + data in one SEND) up to `eager_max` bytes, rendezvous above:
//!   a 32-byte request (TMH + RVH) names the data, the receiver reads it and answers with a
//!   FIN, and only then is the send complete (its buffer free again).
//! - **Receives** first look through the unexpected queue. If nothing there matches, a
//!   receive goes to the hardware list when every earlier receive is there too, it is at
//!   least `hw_min` and `eager_max` bytes (so any eager message fits), and the list and its
//!   operation ring have room; otherwise it stays in software.
//! - **The shadow list** keeps every posted receive in posting order, hardware or not. A
//!   message the hardware could not match arrives "unexpected" (whole, in a staging buffer):
//!   software matches it against the shadow list; if the earliest match sits in hardware
//!   (appended while hardware and software disagreed on the unexpected count, so the
//!   hardware keeps it disabled), the entry is removed with a DEL *before* the SYNC that
//!   would enable it, and the message is delivered to it.
//! - **The unexpected queue** holds copies: an eager message's payload is copied out of its
//!   staging buffer, which goes back to the NIC at once, so unexpected traffic does not pin
//!   the staging buffers (and stall senders with RNR NAKs) until receives are posted.
//! - **Rendezvous** that hardware matched is finished by the NIC (READ, then FIN). One that
//!   arrived unexpected, or whose buffer was too small, is finished here: RDMA READ, then FIN.
//!
//! # What a caller can rely on
//! - **Nothing consumed is lost.** Every completion the layer takes from its CQ is recorded
//!   (as an event, an unexpected message or pending work) before anything that can fail is
//!   tried; an error returned by [`TagMatcher::progress`] never means a message was
//!   dropped. Staging buffers go back to the SRQ as each completes (the driver reuses SRQ
//!   slots out of order, ABI 5.2, so there is always room); one that cannot be posted waits
//!   and is posted by a later call.
//! - **Own work waits, per connection.** List operations (DEL, SYNC) that find the
//!   operation ring full wait in order and are posted as it drains (a DEL always before the
//!   SYNC that would enable its entry); a receive posted meanwhile stays in software.
//!   Rendezvous READs and FINs that find a connection's send queue full wait in that
//!   connection's own queue, so one stalled peer delays no other. Work that cannot be
//!   posted at all (the QP is gone or broken) ends its operation with
//!   [`TagEvent::Failed`] (`LOC_QP_OP_ERR`).
//! - **Every send ends**, with [`TagEvent::Send`] or [`TagEvent::Failed`]:
//!   - an error completion on a connection fails every rendezvous send of that connection
//!     still waiting for its FIN, with the same status;
//!   - a receiver that refuses a malformed rendezvous request (no whole RVH, or a request the
//!     NIC matched that cannot be read back) answers with a FIN whose TMH byte 1 is non-zero:
//!     the send fails with `REM_INV_REQ_ERR`;
//!   - a receiver whose READ fails moves its QP to ERR and cannot send a FIN. While
//!     rendezvous sends wait for FINs, a sender whose CQ stayed empty for
//!     [`TagConfig::keepalive_polls`] progress calls probes each such connection with a
//!     16-byte NO_TAG SEND (which receivers recycle at once). A peer QP in ERR never
//!     acknowledges it: after the connection's retries the probe fails, and with it the
//!     waiting sends (`RETRY_EXC_ERR`; `WR_FLUSH_ERR` when the sender's QP is already in
//!     ERR, as after a remote access error). At most one probe per connection is in flight.
//! - **The CQ cannot overflow**: it is sized for everything that can complete at once
//!   (staging buffers, two completions per hardware entry, the operation ring, and a full
//!   send queue per connection up to [`TagConfig::max_conns`]).
//! - **FINs are matched by connection, context and tag**: the 32-bit context is unique
//!   among a connection's waiting sends (a context still waiting is skipped when the
//!   counter wraps), and a FIN on another connection or with another tag matches nothing.
//!
//! Call [`TagMatcher::progress`] to move things along (or [`TagMatcher::progress_all`] for
//! several matchers that share an emulated fabric); finished operations come out of
//! [`TagMatcher::next_event`].

use crate::cq::{CompletionQueue, WorkCompletion};
use crate::device::{Device, DmaBuffer};
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain, Sge};
use crate::qp::{ConnectOptions, Endpoint, QpInit, QueuePair, RecvWr, RemoteAddr, SendWr, WrOp};
use crate::srq::SharedReceiveQueue;
use crate::tm::{rndv_header, Rvh, TmOp, Tmh, TmhOp, RNDV_HDR_LEN, TMH_LEN};
use ringbell_specs::cmd::Access;
use ringbell_specs::cqe::{CqeOpcode, CqeStatus};
use ringbell_specs::tm::tag_matches;
use std::collections::{BTreeMap, VecDeque};

/// What a [`TagMatcher`] did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Receives posted to the hardware list.
    pub hw_posted: u64,
    /// Messages the hardware matched.
    pub hw_matched: u64,
    /// Messages matched by software (unexpected ones and software-only receives).
    pub sw_matched: u64,
    /// Hardware entries taken back (DEL) because software matched them first.
    pub taken_back: u64,
    /// Rendezvous finished by software (READ and FIN from here).
    pub sw_rndv: u64,
    /// Unexpected arrivals dropped: rendezvous requests without a whole RVH, and untagged
    /// buffers that completed in error.
    pub dropped: u64,
    /// Rendezvous requests refused with an error FIN (the sender's send fails).
    pub refused: u64,
    /// Keepalive probes sent on connections whose rendezvous sends waited for a FIN.
    pub probes: u64,
}

/// Tuning of a [`TagMatcher`].
#[derive(Clone, Copy, Debug)]
pub struct TagConfig {
    /// Largest message sent eagerly; larger ones use rendezvous.
    pub eager_max: u32,
    /// Receives smaller than this are matched in software (hardware matching has a fixed
    /// cost that small messages do not repay). Receives smaller than `eager_max` are always
    /// matched in software: an eager message longer than a hardware-matched buffer is a
    /// length error that takes the connection down, as it would for an untagged SEND.
    pub hw_min: u32,
    /// Entries of the hardware list to use (0: none, pure software matching).
    pub hw_tags: u32,
    /// Untagged staging buffers for unexpected messages (at least 1).
    pub staging_slots: u32,
    /// Bytes of the user region.
    pub user_bytes: usize,
    /// Most connections ([`TagMatcher::add_conn`]). Their send completions go to CQs of
    /// room for [`CONNS_PER_CQ`] full send queues each, the first made with the matcher
    /// (sized for `max_conns` of them when fewer), the others when connections need them.
    pub max_conns: u32,
    /// Progress calls that find the CQ empty, while rendezvous sends wait for FINs, before
    /// their connections are probed (0: never probe).
    pub keepalive_polls: u32,
    /// Entries of the TM-SRQ's list-operation ring, rounded up to a power of two (0: four
    /// per hardware entry plus 16, at least 256; at least 2).
    pub list_ops: u32,
}

impl Default for TagConfig {
    fn default() -> Self {
        TagConfig {
            eager_max: 8192,
            hw_min: 1024,
            hw_tags: 64,
            staging_slots: 64,
            user_bytes: 1 << 22,
            max_conns: 16,
            keepalive_polls: 4096,
            list_ops: 0,
        }
    }
}

/// Something that finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TagEvent {
    /// Receive `id` got a message.
    Recv {
        /// The receive.
        id: u64,
        /// The message's tag.
        tag: u64,
        /// Bytes placed.
        len: u32,
        /// The message was longer than the receive buffer (the rest is lost).
        truncated: bool,
        /// The connection it came on.
        conn: usize,
    },
    /// Send `id` is complete: its buffer may be reused.
    Send {
        /// The send.
        id: u64,
    },
    /// Receive `id` was cancelled before any message matched it.
    Cancelled {
        /// The receive.
        id: u64,
    },
    /// Operation `id` (a send, or a receive whose rendezvous read failed) ended in error.
    Failed {
        /// The operation.
        id: u64,
        /// What the device reported (`LOC_QP_OP_ERR` when the work could not be posted,
        /// `REM_INV_REQ_ERR` when the receiver refused a rendezvous request).
        status: CqeStatus,
    },
}

/// Largest operation id (ids share the work-request id with an 8-bit kind).
pub const MAX_ID: u64 = (1 << K_SHIFT) - 1;

fn check_id(id: u64) -> Result<(), Error> {
    if id > MAX_ID {
        return Err(Error::InvalidArgument(
            "operation id above TagMatcher MAX_ID",
        ));
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Where {
    Hw(u32),
    Sw,
    /// Taken out of the hardware list by software (a DEL is in flight or waiting).
    Cancelled,
}

/// Where a receive's data goes.
#[derive(Clone, Copy, Debug)]
enum Dst {
    /// The user region at this offset ([`TagMatcher::recv`]).
    User(u64),
    /// Registered memory of the caller's ([`TagMatcher::recv_sge`]).
    Mem(Sge),
}

#[derive(Clone, Copy, Debug)]
struct Posted {
    id: u64,
    tag: u64,
    mask: u64,
    dst: Dst,
    len: u32,
    at: Where,
    /// Only messages from connections of this peer ([`TagMatcher::set_peer`]).
    src: Option<u64>,
}

impl Posted {
    fn takes(&self, tag: u64, peer: u64) -> bool {
        tag_matches(tag, self.tag, self.mask) && self.src.is_none_or(|s| s == peer)
    }
}

/// What a receive posted with [`TagMatcher::recv_sge`] got, beyond its [`TagEvent::Recv`]
/// ([`TagMatcher::received`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Received {
    /// The sender's remote CQ data ([`TagMatcher::send_sge`]), in CQ-data mode.
    pub data: Option<u32>,
    /// The whole message's length (more than the bytes placed when it was truncated).
    pub msg_len: u32,
    /// An eager message software matched: its bytes (cut to the receive's length), for the
    /// caller to place (the matcher cannot write the caller's memory itself).
    pub payload: Option<Vec<u8>>,
    /// The NIC matched the message (a tagged buffer of the hardware list).
    pub hw: bool,
}

/// What a tagged send of [`TagMatcher::send_sge`] transmits.
#[derive(Clone, Copy, Debug)]
pub enum TagSend<'a> {
    /// Eager: these bytes, copied now into the connection's header ring (at most
    /// [`TAG_COPY_MAX`] and `eager_max`).
    Bytes(&'a [u8]),
    /// Eager: the bytes of these SGEs (registered in the matcher's PD, at most three), read
    /// when the SEND goes out; at most `eager_max` in all.
    Sges(&'a [Sge]),
    /// Rendezvous: the receiver reads `len` bytes at `remote` (REMOTE_READ in the matcher's
    /// PD), and the send completes with the receiver's FIN.
    Rndv {
        /// Where the data is.
        remote: RemoteAddr,
        /// Bytes.
        len: u32,
    },
}

/// An unexpected message, as [`TagMatcher::probe_from`] and [`TagMatcher::claim`] see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peeked {
    /// Its tag.
    pub tag: u64,
    /// Its length.
    pub len: u32,
    /// The connection it came on.
    pub conn: usize,
    /// Its remote CQ data (CQ-data mode).
    pub data: Option<u32>,
}

/// Most bytes [`TagSend::Bytes`] copies (a header slot less its TMH).
pub const TAG_COPY_MAX: usize = HDR as usize - TMH_LEN;

#[derive(Clone, Debug)]
struct Unexpected {
    tag: u64,
    conn: usize,
    /// Eager: the payload, copied out so that the staging buffer serves again at once.
    data: Vec<u8>,
    /// Rendezvous: where the data is.
    rndv: Option<Rvh>,
    tmh: Tmh,
    /// Remote CQ data (CQ-data mode).
    cq_data: Option<u32>,
}

impl Unexpected {
    fn peeked(&self) -> Peeked {
        Peeked {
            tag: self.tag,
            len: match self.rndv {
                Some(r) => r.len,
                None => self.data.len() as u32,
            },
            conn: self.conn,
            data: self.cq_data,
        }
    }
}

/// A software rendezvous in progress at the receiver.
#[derive(Clone, Copy, Debug)]
struct SwRndv {
    recv: Posted,
    conn: usize,
    tmh: Tmh,
    rvh: Rvh,
    data: Option<u32>,
}

/// A rendezvous send waiting for its FIN.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    id: u64,
    tag: u64,
    /// The TMH `app_ctx` it went with (in CQ-data mode its data, not the key's context).
    wire_ctx: u32,
    /// Its RVH, which the FIN echoes.
    rvh: Rvh,
}

const K_SHIFT: u32 = 56;
const K_SLOT: u64 = 1; // untagged staging receive
const K_EAGER: u64 = 2; // eager send
const K_RNDV_REQ: u64 = 3; // rendezvous request send
const K_READ: u64 = 4; // software rendezvous READ
const K_FIN: u64 = 5; // software rendezvous FIN
const K_OP: u64 = 6; // list operation
const K_CANCEL: u64 = 7; // DEL of a cancelled receive
const K_TAKEBACK: u64 = 8; // DEL of a receive an unexpected message goes to
const K_PROBE: u64 = 9; // keepalive probe
const K_REFUSE: u64 = 10; // error FIN for a refused rendezvous request
const K_EXT: u64 = 11; // the caller's own work on a connection's QP ([`ext_wr_id`])

/// The work-request id under which the caller posts work of its own on a connection's QP
/// ([`TagMatcher::conn_qp_mut`]); its completions come out of
/// [`TagMatcher::next_ext_completion`] with `wr_id` as given here (at most [`MAX_ID`]).
pub const fn ext_wr_id(wr_id: u64) -> u64 {
    wr(K_EXT, wr_id)
}

/// TMH byte 1 of a FIN that refuses the rendezvous (0 in every FIN that completes one).
const FIN_REFUSED: u8 = 1;

const fn wr(kind: u64, v: u64) -> u64 {
    kind << K_SHIFT | v & ((1 << K_SHIFT) - 1)
}

/// Bytes of a send header slot: TMH + RVH, or TMH + a copied eager payload.
const HDR: u64 = 256;
/// Send queue depth of a connection.
const SQ_DEPTH: u32 = 256;
/// Completions one connection's send queue can hold: its capacity in blocks (every send
/// WQE takes at least one; the matcher's take two at most).
const CONN_CQES: u32 = 2 * SQ_DEPTH;
/// Connections whose send completions one CQ of the matcher takes (room for the full send
/// queues of each).
pub const CONNS_PER_CQ: u32 = 64;
/// Header slots per connection: twice as many as the send queue can hold WQEs (at most
/// [`CONN_CQES`], one block each; `create_conn_qp` checks), so a slot is written again
/// only long after the send that used it completed (a retransmission gathers it again
/// until then).
const HDR_SLOTS: u64 = 2 * CONN_CQES as u64;

/// One connection: its QP, its ring of send headers and the work waiting for room in its
/// send queue.
#[derive(Debug)]
struct Conn {
    qp: QueuePair,
    hdr_mr: MemoryRegion,
    hdr_buf: DmaBuffer,
    /// Sends posted with a header so far.
    hdr_next: u64,
    /// Own work waiting for room in the send queue, in order.
    deferred: VecDeque<Internal>,
    /// Next rendezvous context to try.
    next_ctx: u32,
    /// A keepalive probe is in flight.
    probing: bool,
    /// Whom the connection reaches ([`TagMatcher::set_peer`]; its index until set).
    peer: u64,
}

/// A list operation of the matcher's own, waiting for room in the operation ring.
#[derive(Clone, Copy, Debug)]
enum ListOp {
    /// DEL of entry `handle`, completing as `wr(kind, id)`.
    Del { kind: u64, id: u64, handle: u32 },
    /// SYNC with this unexpected count.
    Sync(u32),
}

/// A tag-matching endpoint.
#[derive(Debug)]
pub struct TagMatcher {
    conns: Vec<Conn>,
    srq: SharedReceiveQueue,
    cq: CompletionQueue,
    /// CQs of the send queues of connections beyond the first [`CONNS_PER_CQ`], made as
    /// needed: `send_cqs[i]` takes those of QPs `(i + 1) * CONNS_PER_CQ` and on.
    send_cqs: Vec<CompletionQueue>,
    /// Connection QPs made so far ([`TagMatcher::create_conn_qp`]).
    conn_qps: u32,
    user_mr: MemoryRegion,
    user: DmaBuffer,
    staging_mr: MemoryRegion,
    staging: DmaBuffer,
    pd: ProtectionDomain,
    cfg: TagConfig,
    slot_bytes: u64,
    /// Own list operations waiting for room in the operation ring, in order.
    list_ops: VecDeque<ListOp>,
    /// Staging buffers whose repost failed: posted again by a later progress call.
    idle_slots: Vec<u32>,
    /// Connections with work in their `deferred` queue.
    deferred_conns: usize,
    /// Unexpected messages waiting for the DEL of the hardware receive they go to.
    reclaim: BTreeMap<u64, Unexpected>,
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Unexpected>,
    unexp_cnt: u32,
    /// Rendezvous sends waiting for their FIN, by (connection, context).
    sends: BTreeMap<(usize, u32), Waiting>,
    sw_rndv: BTreeMap<u64, SwRndv>,
    /// Tag, connection and `app_ctx` of a receive matched by hardware, between its MATCH
    /// and its data completions.
    matched: BTreeMap<u64, (u64, usize, u32)>,
    events: VecDeque<TagEvent>,
    wc: Vec<WorkCompletion>,
    stats: TagStats,
    syncs: u32,
    /// Progress calls in a row that found the CQ empty.
    idle_polls: u32,
    /// QPNs of QPs from `create_conn_qp` not yet added as connections.
    made: Vec<u32>,
    /// CQ-data mode ([`TagMatcher::carry_cq_data`]).
    cq_data: bool,
    /// Details of messages receives of [`TagMatcher::recv_sge`] got, until taken.
    received: BTreeMap<u64, Received>,
    /// Receives of [`TagMatcher::recv_sge`] whose rendezvous did not fit the hardware
    /// buffer: (receive, connection, tag, CQ data), until [`TagMatcher::resume_rndv`].
    incomplete: BTreeMap<u64, (Posted, usize, u64, Option<u32>)>,
    /// Unexpected messages claimed ([`TagMatcher::claim`]), by key.
    claimed: BTreeMap<u64, Unexpected>,
    /// Completions of the caller's own work ([`ext_wr_id`]).
    ext: VecDeque<WorkCompletion>,
    /// Messages that came on QPs of `made` before they were added, in arrival order.
    early: Vec<WorkCompletion>,
}

impl TagMatcher {
    /// A matcher on `dev` with no connection yet.
    pub fn new(dev: &Device, cfg: TagConfig) -> Result<TagMatcher, Error> {
        let pd = dev.alloc_pd()?;
        Self::with_pd(pd, cfg)
    }

    /// A matcher whose QPs, SRQ and regions are in `pd`, so that receives and sends may
    /// name the caller's regions of that PD ([`TagMatcher::recv_sge`],
    /// [`TagMatcher::send_sge`]).
    pub fn new_in(pd: &ProtectionDomain, cfg: TagConfig) -> Result<TagMatcher, Error> {
        Self::with_pd(pd.clone(), cfg)
    }

    fn with_pd(pd: ProtectionDomain, cfg: TagConfig) -> Result<TagMatcher, Error> {
        let dev = pd.device().clone();
        let dev = &dev;
        let caps = dev.caps();
        let tags = cfg.hw_tags.clamp(1, caps.max_num_tags.max(1));
        let slots = cfg.staging_slots.max(1);
        let max_ops = match cfg.list_ops {
            0 => (4 * tags + 16).max(256),
            n => n.max(2),
        }
        .min(caps.max_tm_ops);
        if cfg.max_conns == 0 {
            return Err(Error::InvalidArgument("TagConfig::max_conns is 0"));
        }
        // Everything that can complete before the next poll: each staging buffer once, each
        // hardware entry twice (MATCH, then data), the operation ring, and every connection's
        // send queue.
        let cqes = slots.next_power_of_two() as u64
            + 2 * tags as u64
            + max_ops.next_power_of_two() as u64
            + cfg.max_conns.min(CONNS_PER_CQ) as u64 * CONN_CQES as u64;
        if cqes > caps.max_cqe as u64 {
            return Err(Error::InvalidArgument(
                "TagConfig needs a CQ beyond the device's max_cqe (fewer max_conns)",
            ));
        }
        let cq = dev.create_cq(cqes as u32)?;
        let mut srq = pd.create_tm_srq(&cq, slots, 1, tags, max_ops)?;
        let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let user = dev.alloc_dma(cfg.user_bytes)?;
        let user_mr = pd.reg_mr(&user, all)?;
        let slot_bytes = (cfg.eager_max as u64 + TMH_LEN as u64).next_multiple_of(64);
        let staging = dev.alloc_dma((slot_bytes * slots as u64) as usize)?;
        let staging_mr = pd.reg_mr(&staging, all)?;
        for s in 0..slots {
            let sge = [staging_mr.sge(s as u64 * slot_bytes, slot_bytes as u32)];
            srq.post_recv(&[RecvWr {
                wr_id: wr(K_SLOT, s as u64),
                sgl: &sge,
            }])?;
        }
        Ok(TagMatcher {
            conns: Vec::new(),
            srq,
            cq,
            send_cqs: Vec::new(),
            conn_qps: 0,
            user_mr,
            user,
            staging_mr,
            staging,
            pd,
            cfg: TagConfig {
                hw_tags: if cfg.hw_tags == 0 { 0 } else { tags },
                staging_slots: slots,
                ..cfg
            },
            slot_bytes,
            list_ops: VecDeque::new(),
            idle_slots: Vec::new(),
            deferred_conns: 0,
            reclaim: BTreeMap::new(),
            posted: VecDeque::new(),
            unexpected: VecDeque::new(),
            unexp_cnt: 0,
            sends: BTreeMap::new(),
            sw_rndv: BTreeMap::new(),
            matched: BTreeMap::new(),
            events: VecDeque::new(),
            wc: vec![WorkCompletion::default(); 32],
            stats: TagStats::default(),
            syncs: 0,
            idle_polls: 0,
            made: Vec::new(),
            cq_data: false,
            received: BTreeMap::new(),
            incomplete: BTreeMap::new(),
            claimed: BTreeMap::new(),
            ext: VecDeque::new(),
            early: Vec::new(),
        })
    }

    /// The user region: sends read from it, receives land in it.
    pub fn user(&self) -> &DmaBuffer {
        &self.user
    }

    /// Opens a connection: returns its index and this side's endpoint for the peer.
    /// [`Error::InvalidArgument`] beyond [`TagConfig::max_conns`] connections.
    pub fn add_conn(&mut self) -> Result<(usize, Endpoint), Error> {
        let qp = self.create_conn_qp()?;
        let ep = qp.endpoint(self.conns.len() as u32 * 1000 + 1);
        Ok((self.add_qp(qp, None)?, ep))
    }

    /// Requests a completion event (the device's interrupt) for the next completion of any
    /// of this matcher's CQs, so that a process may sleep until one is written.
    pub fn arm(&self) {
        self.cq.arm(false);
        for cq in &self.send_cqs {
            cq.arm(false);
        }
    }

    /// A QP for a new connection, in RESET, on this matcher's CQ and TM-SRQ, to be
    /// connected by the caller (for example through [`crate::cm::ConnectionManager`], with
    /// `max_rd_atomic` and `max_dest_rd_atomic` of at least 1 for rendezvous) and then
    /// handed to [`TagMatcher::add_connected`].
    pub fn create_conn_qp(&mut self) -> Result<QueuePair, Error> {
        if self.conns.len() >= self.cfg.max_conns as usize {
            return Err(Error::InvalidArgument(
                "TagMatcher has TagConfig::max_conns connections already",
            ));
        }
        // Send completions go to the CQ of this QP's group; receives to the matcher's CQ.
        let group = (self.conn_qps / CONNS_PER_CQ) as usize;
        if group > self.send_cqs.len() {
            let cq = self.pd.device().create_cq(CONNS_PER_CQ * CONN_CQES)?;
            self.send_cqs.push(cq);
        }
        let send_cq = match group {
            0 => &self.cq,
            g => &self.send_cqs[g - 1],
        };
        let mut init = QpInit::new(send_cq, &self.cq);
        init.srq = Some(&self.srq);
        init.max_send_wr = SQ_DEPTH;
        init.max_send_sge = 4;
        let qp = self.pd.create_qp(&init)?;
        self.conn_qps += 1;
        if qp.sq_free() > CONN_CQES {
            return Err(Error::InvalidArgument(
                "send queue larger than the CQ room kept for a connection",
            ));
        }
        // The device reuses the QPN of a QP destroyed before it became a connection (its
        // connection was refused or timed out): what that QP left is no concern of the new
        // one, whose messages must not be parked for ever. Its staging buffers serve again.
        let qpn = qp.qpn();
        self.made.retain(|&n| n != qpn);
        let (stale, rest): (Vec<_>, Vec<_>) = self.early.drain(..).partition(|w| w.qpn == qpn);
        self.early = rest;
        for w in stale {
            if w.wr_id >> K_SHIFT == K_SLOT {
                self.recycle((w.wr_id & ((1 << K_SHIFT) - 1)) as u32);
            }
        }
        self.made.push(qpn);
        Ok(qp)
    }

    /// Adds a connection over `qp`, a QP from [`TagMatcher::create_conn_qp`] that the caller
    /// has connected (RTS); returns its index.
    pub fn add_connected(&mut self, qp: QueuePair) -> Result<usize, Error> {
        let peer = self.conns.len() as u64;
        self.add_connected_from(qp, peer)
    }

    /// As [`TagMatcher::add_connected`], for a connection that reaches `peer`
    /// ([`TagMatcher::set_peer`]): set before the messages that came on the QP before it
    /// was added are matched, so receives from that source can take them.
    pub fn add_connected_from(&mut self, qp: QueuePair, peer: u64) -> Result<usize, Error> {
        if qp.state() != crate::QpState::Rts {
            return Err(Error::InvalidState {
                qpn: qp.qpn(),
                state: qp.state(),
            });
        }
        self.add_qp(qp, Some(peer))
    }

    fn add_qp(&mut self, qp: QueuePair, peer: Option<u64>) -> Result<usize, Error> {
        let Some(at) = self.made.iter().position(|&n| n == qp.qpn()) else {
            return Err(Error::InvalidArgument(
                "the QP was not made by this TagMatcher's create_conn_qp",
            ));
        };
        if self.conns.len() >= self.cfg.max_conns as usize {
            return Err(Error::InvalidArgument(
                "TagMatcher has TagConfig::max_conns connections already",
            ));
        }
        self.made.swap_remove(at);
        let qpn = qp.qpn();
        // From the device's arena (256 KiB blocks of 1 MiB files): a few connections share a
        // memory file and a mapping, so hundreds of them do not cost hundreds of each.
        let hdr_buf = self.pd.device().alloc_ring((HDR * HDR_SLOTS) as usize)?;
        let hdr_mr = self.pd.reg_mr(&hdr_buf, Access::LOCAL_WRITE)?;
        self.conns.push(Conn {
            qp,
            hdr_mr,
            hdr_buf,
            hdr_next: 0,
            deferred: VecDeque::new(),
            next_ctx: 1,
            probing: false,
            peer: peer.unwrap_or(self.conns.len() as u64),
        });
        // What came on the QP before it was a connection, in arrival order.
        let (mine, rest): (Vec<_>, Vec<_>) = self.early.drain(..).partition(|w| w.qpn == qpn);
        self.early = rest;
        for w in &mine {
            let _ = self.handle(w);
        }
        Ok(self.conns.len() - 1)
    }

    /// Connects connection `conn` to the peer's endpoint.
    pub fn connect(
        &mut self,
        conn: usize,
        remote: &Endpoint,
        opts: &ConnectOptions,
    ) -> Result<(), Error> {
        let c = self
            .conns
            .get_mut(conn)
            .ok_or(Error::InvalidArgument("no such connection"))?;
        let psn = conn as u32 * 1000 + 1;
        c.qp.connect(
            remote,
            psn,
            &ConnectOptions {
                max_rd_atomic: opts.max_rd_atomic.max(1),
                max_dest_rd_atomic: opts.max_dest_rd_atomic.max(1),
                ..*opts
            },
        )
    }

    /// The next finished operation, if any.
    pub fn next_event(&mut self) -> Option<TagEvent> {
        self.events.pop_front()
    }

    /// Receives in the hardware list now.
    pub fn hw_posted(&self) -> usize {
        self.posted
            .iter()
            .filter(|p| matches!(p.at, Where::Hw(_)))
            .count()
    }

    /// The QP of connection `conn` (for its counters and state).
    pub fn conn(&self, conn: usize) -> Option<&QueuePair> {
        self.conns.get(conn).map(|c| &c.qp)
    }

    /// Counts of what this matcher did.
    pub fn stats(&self) -> TagStats {
        self.stats
    }

    /// Messages waiting in the unexpected queue.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len()
    }

    /// Posts receive `id` for messages whose tag matches `tag` under `mask`, into `len` bytes
    /// of the user region at `off`. Refused ([`Error::InvalidArgument`],
    /// [`Error::OutOfBounds`]) for an id above [`MAX_ID`] or in use by a pending receive,
    /// or a buffer outside the user region; never for lack of room in the hardware list
    /// or its operation ring (the receive then stays in software).
    pub fn recv(&mut self, id: u64, tag: u64, mask: u64, off: u64, len: u32) -> Result<(), Error> {
        check_id(id)?;
        if self.id_in_use(id) {
            return Err(Error::InvalidArgument("receive id already in use"));
        }
        if off
            .checked_add(len as u64)
            .is_none_or(|e| e > self.user.len() as u64)
        {
            return Err(Error::OutOfBounds {
                offset: off as usize,
                len: len as usize,
                size: self.user.len(),
            });
        }
        self.post_recv(Posted {
            id,
            tag,
            mask,
            dst: Dst::User(off),
            len,
            at: Where::Sw,
            src: None,
        });
        Ok(())
    }

    /// Posts receive `id` for messages whose tag matches `tag` under `mask` (and, with
    /// `src`, that come on a connection of that peer, [`TagMatcher::set_peer`]) into `buf`,
    /// registered memory of the matcher's PD ([`TagMatcher::new_in`]). As
    /// [`TagMatcher::recv`] otherwise, and a receive with a source stays in software (the
    /// NIC does not filter by connection). What the message brought beyond its
    /// [`TagEvent::Recv`] (CQ data, whole length, and the bytes of an eager message matched
    /// in software, which the caller places) is in [`TagMatcher::received`]. A rendezvous
    /// the NIC matched into a buffer too small for it ends in [`TagEvent::Failed`] with
    /// `TmRndvIncomplete`: the buffer starts with the request, and
    /// [`TagMatcher::resume_rndv`] finishes it.
    pub fn recv_sge(
        &mut self,
        id: u64,
        tag: u64,
        mask: u64,
        src: Option<u64>,
        buf: Sge,
    ) -> Result<(), Error> {
        check_id(id)?;
        if self.id_in_use(id) {
            return Err(Error::InvalidArgument("receive id already in use"));
        }
        self.post_recv(Posted {
            id,
            tag,
            mask,
            dst: Dst::Mem(buf),
            len: buf.len,
            at: Where::Sw,
            src,
        });
        Ok(())
    }

    fn id_in_use(&self, id: u64) -> bool {
        self.posted.iter().any(|p| p.id == id)
            || self.sw_rndv.contains_key(&id)
            || self.incomplete.contains_key(&id)
    }

    /// The sge of `len` bytes of receive `r`'s buffer.
    fn dst_sge(&self, r: &Posted, len: u32) -> Sge {
        match r.dst {
            Dst::User(off) => self.user_mr.sge(off, len),
            Dst::Mem(s) => Sge { len, ..s },
        }
    }

    fn post_recv(&mut self, r: Posted) {
        let (id, tag, mask, len) = (r.id, r.tag, r.mask, r.len);
        // The earliest unexpected message that matches is this receive's.
        let conns = &self.conns;
        if let Some(i) = self
            .unexpected
            .iter()
            .position(|u| r.takes(u.tag, conns[u.conn].peer))
        {
            if let Some(u) = self.unexpected.remove(i) {
                self.deliver_unexpected(r, u);
                return;
            }
        }
        // To hardware only behind receives that are all in hardware (so the list count is
        // the posted count), only while the list and its operation ring have room, and only
        // when no list operation of ours waits (it must reach the device first).
        if self.cfg.hw_tags > 0
            && r.src.is_none()
            && len >= self.cfg.hw_min.max(self.cfg.eager_max)
            && self.posted.len() < self.cfg.hw_tags as usize
            && self.srq.tm_free_tags() > 0
            && self.srq.tm_free_ops() > 0
            && self.list_ops.is_empty()
            && self.posted.iter().all(|p| matches!(p.at, Where::Hw(_)))
        {
            let sge = self.dst_sge(&r, len);
            let mut op = [TmOp::add(wr(K_OP, id), id, sge, tag, mask).with_count(self.unexp_cnt)];
            op[0].signaled = false;
            if self.srq.post_tm_ops(&mut op).is_ok() {
                self.stats.hw_posted += 1;
                self.posted.push_back(Posted {
                    at: Where::Hw(op[0].handle),
                    ..r
                });
                return;
            }
        }
        self.posted.push_back(r);
    }

    /// Sets whom connection `conn` reaches: receives with a source
    /// ([`TagMatcher::recv_sge`]) take messages of connections with that peer. Messages
    /// already unexpected keep the peer they came with; to name the peer of a connection
    /// before any of its messages is matched, add it with
    /// [`TagMatcher::add_connected_from`].
    pub fn set_peer(&mut self, conn: usize, peer: u64) -> Result<(), Error> {
        let c = self
            .conns
            .get_mut(conn)
            .ok_or(Error::InvalidArgument("no such connection"))?;
        c.peer = peer;
        Ok(())
    }

    /// CQ-data mode: sends carry 32 bits of remote CQ data ([`TagMatcher::send_sge`]) and
    /// receives report it ([`Received::data`]). An eager message carries it as the
    /// immediate data of its SEND; a rendezvous request in its TMH `app_ctx`, which the NIC
    /// reports with its match (and drops any other part of the request: its immediate, the
    /// bytes after the RVH, ABI O38). `app_ctx` 0 reads as no data, so a rendezvous sent
    /// with data 0 arrives without data (whose value is 0 either way): 32 bits cannot say
    /// "none" besides 2^32 values, and a request the NIC would not match (to carry more in
    /// software) would let later messages overtake it in the hardware list. A rendezvous
    /// send's FIN is then found by its tag, `app_ctx` and RVH. Both sides of a connection
    /// must be in the same mode; set it before the first connection.
    pub fn carry_cq_data(&mut self) {
        self.cq_data = true;
    }

    /// The details of the message receive `id` (posted with [`TagMatcher::recv_sge`]) got,
    /// once its [`TagEvent::Recv`] is out; taken once.
    pub fn received(&mut self, id: u64) -> Option<Received> {
        self.received.remove(&id)
    }

    /// Finishes a rendezvous the NIC matched into receive `id`'s too-small buffer (its
    /// [`TagEvent::Failed`] with `TmRndvIncomplete`): `hdr` is the start of that buffer
    /// (TMH and RVH, 32 bytes). The data is read in software, cut to the buffer, and the
    /// receive completes as usual (truncated). A request that cannot be parsed fails the
    /// receive (`REM_INV_REQ_ERR`) and its send. Returns false for no such receive.
    pub fn resume_rndv(&mut self, id: u64, hdr: &[u8]) -> bool {
        let Some((p, conn, tag, data)) = self.incomplete.remove(&id) else {
            return false;
        };
        match (Tmh::parse(hdr), hdr.get(TMH_LEN..).and_then(Rvh::parse)) {
            (Some(tmh), Some(rvh)) => self.start_sw_rndv(p, conn, tmh, rvh, data),
            (tmh, _) => {
                let tmh = tmh.unwrap_or(Tmh {
                    opcode: TmhOp::Rndv as u8,
                    app_ctx: 0,
                    tag,
                });
                self.refuse(conn, tmh);
                self.events.push_back(TagEvent::Failed {
                    id,
                    status: CqeStatus::RemInvReqErr,
                });
            }
        }
        true
    }

    /// The earliest unexpected message whose tag matches `tag` under `mask` (and that came
    /// from peer `src`, if given), without receiving it.
    pub fn probe_from(&self, tag: u64, mask: u64, src: Option<u64>) -> Option<Peeked> {
        self.find_unexpected(tag, mask, src)
            .map(|i| self.unexpected[i].peeked())
    }

    fn find_unexpected(&self, tag: u64, mask: u64, src: Option<u64>) -> Option<usize> {
        self.unexpected.iter().position(|u| {
            tag_matches(u.tag, tag, mask) && src.is_none_or(|s| self.conns[u.conn].peer == s)
        })
    }

    /// As [`TagMatcher::probe_from`], and the message found is set aside under `key`: no
    /// receive takes it but [`TagMatcher::recv_claimed`] with that key. None when nothing
    /// matches or `key` holds a claim already.
    pub fn claim(&mut self, key: u64, tag: u64, mask: u64, src: Option<u64>) -> Option<Peeked> {
        if self.claimed.contains_key(&key) {
            return None;
        }
        let i = self.find_unexpected(tag, mask, src)?;
        let u = self.unexpected.remove(i)?;
        let p = u.peeked();
        self.claimed.insert(key, u);
        Some(p)
    }

    /// Receives the message claimed under `key` into `buf` as receive `id` (it completes
    /// like any receive of [`TagMatcher::recv_sge`]). Ok(false): no such claim.
    pub fn recv_claimed(&mut self, key: u64, id: u64, buf: Sge) -> Result<bool, Error> {
        check_id(id)?;
        if self.id_in_use(id) {
            return Err(Error::InvalidArgument("receive id already in use"));
        }
        let Some(u) = self.claimed.remove(&key) else {
            return Ok(false);
        };
        let r = Posted {
            id,
            tag: u.tag,
            mask: u64::MAX,
            dst: Dst::Mem(buf),
            len: buf.len,
            at: Where::Sw,
            src: None,
        };
        self.deliver_unexpected(r, u);
        Ok(true)
    }

    /// Drops the message claimed under `key` (a rendezvous is answered with its FIN, so
    /// its send completes) and returns what it was; None for no such claim.
    pub fn discard_claimed(&mut self, key: u64) -> Option<Peeked> {
        let u = self.claimed.remove(&key)?;
        Some(self.drop_unexpected(u))
    }

    /// Drops the earliest unexpected message [`TagMatcher::probe_from`] would find, as
    /// [`TagMatcher::discard_claimed`] does.
    pub fn discard(&mut self, tag: u64, mask: u64, src: Option<u64>) -> Option<Peeked> {
        let i = self.find_unexpected(tag, mask, src)?;
        let u = self.unexpected.remove(i)?;
        Some(self.drop_unexpected(u))
    }

    fn drop_unexpected(&mut self, u: Unexpected) -> Peeked {
        if let Some(rvh) = u.rndv {
            let fin = rndv_header(
                &Tmh {
                    opcode: TmhOp::Fin as u8,
                    ..u.tmh
                },
                &rvh,
            );
            self.post_internal(u.conn, Internal::Refuse { msg: fin });
        }
        u.peeked()
    }

    /// Gives the message claimed under `key` back to the unexpected queue, first (it was
    /// found before those still there). Returns false for no such claim.
    pub fn unclaim(&mut self, key: u64) -> bool {
        let Some(u) = self.claimed.remove(&key) else {
            return false;
        };
        self.unexpected.push_front(u);
        true
    }

    /// The QP of connection `conn`, to post work of the caller's own under
    /// [`ext_wr_id`] (a triggered SEND of a tagged message, say).
    pub fn conn_qp_mut(&mut self, conn: usize) -> Option<&mut QueuePair> {
        self.conns.get_mut(conn).map(|c| &mut c.qp)
    }

    /// The next completion of work posted under [`ext_wr_id`], with its `wr_id` as given
    /// there.
    pub fn next_ext_completion(&mut self) -> Option<WorkCompletion> {
        self.ext.pop_front()
    }

    /// The earliest message in the unexpected queue whose tag matches `tag` under `mask`, as
    /// (tag, length in bytes, connection), without receiving it. Only messages software has
    /// seen count: call [`TagMatcher::progress`] first.
    pub fn probe(&self, tag: u64, mask: u64) -> Option<(u64, u32, usize)> {
        self.unexpected
            .iter()
            .find(|u| tag_matches(u.tag, tag, mask))
            .map(|u| {
                let len = match u.rndv {
                    Some(r) => r.len,
                    None => u.data.len() as u32,
                };
                (u.tag, len, u.conn)
            })
    }

    /// Cancels receive `id` if no message has matched it yet: a receive in software goes at
    /// once, one in the hardware list with a DEL (which waits for room in the operation
    /// ring if it must). [`TagEvent::Cancelled`] reports success; if a message wins the
    /// race the receive completes as usual instead. Returns false when `id` is not a posted
    /// receive (already matched, being cancelled, or never posted).
    pub fn cancel(&mut self, id: u64) -> Result<bool, Error> {
        let Some(i) = self.posted.iter().position(|p| p.id == id) else {
            return Ok(false);
        };
        match self.posted[i].at {
            Where::Sw => {
                self.posted.remove(i);
                self.events.push_back(TagEvent::Cancelled { id });
            }
            Where::Hw(handle) => {
                self.posted[i].at = Where::Cancelled;
                self.list_op(ListOp::Del {
                    kind: K_CANCEL,
                    id,
                    handle,
                });
            }
            Where::Cancelled => return Ok(false),
        }
        Ok(true)
    }

    /// Sends `len` bytes of the user region at `off` with `tag` on connection `conn`.
    /// Refused ([`Error::InvalidArgument`], [`Error::OutOfBounds`]) for an id above
    /// [`MAX_ID`], an unknown connection or a buffer outside the user region;
    /// [`Error::QueueFull`] when the connection's send queue is full (nothing was sent:
    /// progress, then try again), [`Error::InvalidState`] before the connection is up. A
    /// send that was posted always ends in [`TagEvent::Send`] or [`TagEvent::Failed`].
    pub fn send(
        &mut self,
        id: u64,
        conn: usize,
        tag: u64,
        off: u64,
        len: u32,
    ) -> Result<(), Error> {
        check_id(id)?;
        if conn >= self.conns.len() {
            return Err(Error::InvalidArgument("no such connection"));
        }
        if off
            .checked_add(len as u64)
            .is_none_or(|e| e > self.user.len() as u64)
        {
            return Err(Error::OutOfBounds {
                offset: off as usize,
                len: len as usize,
                size: self.user.len(),
            });
        }
        if len <= self.cfg.eager_max {
            let sge = [self.user_mr.sge(off, len)];
            self.send_sge(
                id,
                conn,
                tag,
                None,
                TagSend::Sges(&sge[..usize::from(len > 0)]),
            )
        } else {
            let remote = RemoteAddr {
                addr: self.user_mr.addr() + off,
                rkey: self.user_mr.rkey(),
            };
            self.send_sge(id, conn, tag, None, TagSend::Rndv { remote, len })
        }
    }

    /// Sends `what` with `tag` on connection `conn`, with remote CQ data `data` (CQ-data
    /// mode only, [`TagMatcher::carry_cq_data`]). The caller chooses eager or rendezvous:
    /// an eager message longer than `eager_max` is refused, since a hardware-matched
    /// receive may be as short as that. Otherwise as [`TagMatcher::send`].
    pub fn send_sge(
        &mut self,
        id: u64,
        conn: usize,
        tag: u64,
        data: Option<u32>,
        what: TagSend<'_>,
    ) -> Result<(), Error> {
        check_id(id)?;
        if conn >= self.conns.len() {
            return Err(Error::InvalidArgument("no such connection"));
        }
        if data.is_some() && !self.cq_data {
            return Err(Error::InvalidArgument("CQ data outside CQ-data mode"));
        }
        let eager = Tmh {
            opcode: TmhOp::Eager as u8,
            app_ctx: 0,
            tag,
        };
        let op = match data {
            Some(d) => WrOp::SendImm(d),
            None => WrOp::Send,
        };
        match what {
            TagSend::Bytes(b) => {
                if b.len() > TAG_COPY_MAX || b.len() > self.cfg.eager_max as usize {
                    return Err(Error::InvalidArgument("eager copy beyond its room"));
                }
                let mut msg = [0u8; HDR as usize];
                msg[..TMH_LEN].copy_from_slice(&eager.to_bytes());
                msg[TMH_LEN..TMH_LEN + b.len()].copy_from_slice(b);
                let sgl = [self.header(conn, &msg[..TMH_LEN + b.len()])?];
                let c = &mut self.conns[conn];
                c.qp.post_send(&[SendWr::new(wr(K_EAGER, id), op, &sgl)])?;
                c.hdr_next += 1;
            }
            TagSend::Sges(sges) => {
                let total: u64 = sges.iter().map(|s| s.len as u64).sum();
                if sges.len() > 3 || total > self.cfg.eager_max as u64 {
                    return Err(Error::InvalidArgument(
                        "eager send beyond eager_max or three SGEs",
                    ));
                }
                let mut sgl = [Sge::default(); 4];
                sgl[0] = self.header(conn, &eager.to_bytes())?;
                sgl[1..=sges.len()].copy_from_slice(sges);
                let c = &mut self.conns[conn];
                c.qp.post_send(&[SendWr::new(wr(K_EAGER, id), op, &sgl[..=sges.len()])])?;
                c.hdr_next += 1;
            }
            TagSend::Rndv { remote, len } => {
                let ctx = free_ctx(&self.sends, conn, self.conns[conn].next_ctx);
                // In CQ-data mode the context on the wire is the data, and the FIN is found
                // by tag, context and RVH.
                let wire_ctx = match (self.cq_data, data) {
                    (false, _) => ctx,
                    (true, d) => d.unwrap_or(0),
                };
                let rvh = Rvh {
                    va: remote.addr,
                    rkey: remote.rkey,
                    len,
                };
                let msg = rndv_header(
                    &Tmh {
                        opcode: TmhOp::Rndv as u8,
                        app_ctx: wire_ctx,
                        tag,
                    },
                    &rvh,
                );
                let sgl = [self.header(conn, &msg)?];
                let c = &mut self.conns[conn];
                c.qp.post_send(&[SendWr::new(wr(K_RNDV_REQ, id), WrOp::Send, &sgl)])?;
                c.hdr_next += 1;
                c.next_ctx = ctx.wrapping_add(1).max(1);
                self.sends.insert(
                    (conn, ctx),
                    Waiting {
                        id,
                        tag,
                        wire_ctx,
                        rvh,
                    },
                );
            }
        }
        Ok(())
    }

    /// Polls the CQ once (letting the device progress if it is empty) and handles what came;
    /// returns how many completions were handled. Every completion polled is recorded
    /// before anything that can fail is tried; an error (the first one) says that some of
    /// the matcher's own work could not be posted and will be tried again, never that a
    /// message was lost. With several matchers on one emulated fabric, use
    /// [`TagMatcher::progress_all`].
    pub fn progress(&mut self) -> Result<usize, Error> {
        self.handle_completions(true)
    }

    /// Handles the completions already in the CQ without progressing the device: for
    /// callers that drive an emulated fabric themselves (measurements in simulated time,
    /// where a poll of an empty CQ would run the fabric ahead while another matcher still
    /// has work).
    pub fn progress_ready(&mut self) -> Result<usize, Error> {
        self.handle_completions(false)
    }

    /// Progress for several matchers, on one emulated fabric or on several devices: handles
    /// every matcher's ready completions, and only when none had any lets each matcher's
    /// device progress once and handles what that brought. Returns the completions handled
    /// in all; the first error, after every matcher was served.
    pub fn progress_all(matchers: &mut [&mut TagMatcher]) -> Result<usize, Error> {
        let mut first = Ok(());
        let mut serve = |ms: &mut [&mut TagMatcher]| {
            let mut n = 0;
            for m in ms.iter_mut() {
                match m.progress_ready() {
                    Ok(k) => n += k,
                    Err(e) => {
                        if first.is_ok() {
                            first = Err(e);
                        }
                    }
                }
            }
            n
        };
        let mut n = serve(matchers);
        if n == 0 {
            for m in matchers.iter() {
                m.pd.device().progress();
            }
            n = serve(matchers);
        }
        first.map(|_| n)
    }

    fn handle_completions(&mut self, progress_device: bool) -> Result<usize, Error> {
        let mut wc = std::mem::take(&mut self.wc);
        // The matcher's CQ (progressing the device first if asked), then those of the send
        // queues of connections beyond the first group. Every completion polled is handled
        // even if one fails: the first error is returned.
        let (mut n, mut failed) = (0, None);
        for g in 0..=self.send_cqs.len() {
            let m = match g {
                0 if progress_device => self.cq.poll(&mut wc),
                0 => self.cq.poll_ready(&mut wc),
                g => self.send_cqs[g - 1].poll_ready(&mut wc),
            };
            for w in &wc[..m] {
                if let Err(e) = self.handle(w) {
                    failed.get_or_insert(e);
                }
            }
            n += m;
        }
        let mut r = failed.map_or(Ok(n), Err);
        self.wc = wc;
        if !self.idle_slots.is_empty() {
            if let (Err(e), true) = (self.repost_idle(), r.is_ok()) {
                r = Err(e);
            }
        }
        if !self.list_ops.is_empty() {
            self.flush_list_ops();
        }
        if self.deferred_conns > 0 {
            for conn in 0..self.conns.len() {
                self.retry_deferred(conn);
            }
        }
        if n == 0 {
            self.idle();
        } else {
            self.idle_polls = 0;
        }
        r
    }

    fn handle(&mut self, w: &WorkCompletion) -> Result<(), Error> {
        let (kind, v) = (w.wr_id >> K_SHIFT, w.wr_id & ((1 << K_SHIFT) - 1));
        if w.opcode.is_message() && self.made.contains(&w.qpn) {
            // A message on a QP of ours that is not a connection yet (its peer sent as
            // soon as its side was up): kept, and handled when the QP is added. Its
            // unexpected count waits too, so entries added meanwhile stay disabled.
            self.early.push(*w);
            return Ok(());
        }
        if kind == K_EXT && !w.opcode.is_recv() {
            // The caller's own work: its completion is the caller's. A failure broke the
            // connection, so the rendezvous sends waiting on it fail too.
            self.ext.push_back(WorkCompletion { wr_id: v, ..*w });
            if w.status != CqeStatus::Success {
                if let Some(conn) = self.conn_of(w.qpn) {
                    self.fail_conn(conn, w.status);
                }
            }
            return Ok(());
        }
        match w.opcode {
            CqeOpcode::TmAdd | CqeOpcode::TmDel | CqeOpcode::TmSync => {
                self.list_completion(w, kind, v);
                Ok(())
            }
            CqeOpcode::TmRecv | CqeOpcode::TmNoTag if kind == K_SLOT => self.untagged(w, v as u32),
            CqeOpcode::TmRecv => {
                self.hw_recv(w);
                Ok(())
            }
            // A receive buffer of the staging ring that completed some other way (a WRITE
            // with immediate from the peer, say): it serves again.
            _ if kind == K_SLOT => {
                self.recycle(v as u32);
                Ok(())
            }
            _ if w.status != CqeStatus::Success => {
                // A send, request, READ or FIN failed: report it against its operation,
                // and fail the rendezvous sends the broken connection still owes a FIN.
                let id = match kind {
                    K_READ | K_FIN => self.sw_rndv.remove(&v).map(|s| s.recv.id),
                    // Unless its connection's failure already reported it.
                    K_RNDV_REQ => {
                        let before = self.sends.len();
                        self.sends.retain(|_, s| s.id != v);
                        (self.sends.len() != before).then_some(v)
                    }
                    K_EAGER => Some(v),
                    _ => None,
                };
                if let Some(id) = id {
                    self.events.push_back(TagEvent::Failed {
                        id,
                        status: w.status,
                    });
                }
                if let Some(conn) = self.conn_of(w.qpn) {
                    if kind == K_PROBE {
                        self.conns[conn].probing = false;
                    }
                    self.fail_conn(conn, w.status);
                }
                Ok(())
            }
            _ => {
                match kind {
                    K_EAGER => self.events.push_back(TagEvent::Send { id: v }),
                    K_READ => {
                        if let Some(s) = self.sw_rndv.get(&v).copied() {
                            // Data read: tell the sender its buffer is free.
                            let fin = rndv_header(
                                &Tmh {
                                    opcode: TmhOp::Fin as u8,
                                    ..s.tmh
                                },
                                &s.rvh,
                            );
                            self.post_internal(s.conn, Internal::Fin { id: v, msg: fin });
                        }
                    }
                    K_FIN => {
                        if let Some(s) = self.sw_rndv.remove(&v) {
                            let truncated = s.rvh.len > s.recv.len;
                            self.record(&s.recv, s.data, s.rvh.len, None, false);
                            self.events.push_back(TagEvent::Recv {
                                id: s.recv.id,
                                tag: s.tmh.tag,
                                len: s.rvh.len.min(s.recv.len),
                                truncated,
                                conn: s.conn,
                            });
                        }
                    }
                    K_PROBE => {
                        if let Some(conn) = self.conn_of(w.qpn) {
                            self.conns[conn].probing = false;
                        }
                    }
                    _ => {}
                }
                Ok(())
            }
        }
    }

    /// A list operation's completion: only failures, SYNC requests, DELs and every 16th
    /// SYNC are delivered.
    fn list_completion(&mut self, w: &WorkCompletion, kind: u64, v: u64) {
        if w.opcode == CqeOpcode::TmAdd && w.tm_sync_req {
            self.request_sync();
        }
        if w.opcode == CqeOpcode::TmAdd && w.status != CqeStatus::Success {
            // The device refused the entry: the receive was never posted.
            if let Some(i) = self.posted.iter().position(|p| p.id == v) {
                self.posted.remove(i);
                self.events.push_back(TagEvent::Failed {
                    id: v,
                    status: w.status,
                });
            }
            return;
        }
        if w.opcode != CqeOpcode::TmDel {
            return;
        }
        match kind {
            K_TAKEBACK => {
                if let Some(u) = self.reclaim.remove(&v) {
                    let i = self.posted.iter().position(|p| p.id == v);
                    match (w.status, i) {
                        (CqeStatus::Success, Some(i)) => {
                            if let Some(p) = self.posted.remove(i) {
                                self.deliver_unexpected(p, u);
                            }
                        }
                        // The hardware matched the entry first: it completes as usual.
                        _ => self.match_unexpected(u),
                    }
                }
            }
            // Taken out before any message matched it. (On TM_ERR a message got there
            // first, and the receive completes as usual.)
            K_CANCEL if w.status == CqeStatus::Success => {
                if let Some(i) = self.posted.iter().position(|p| p.id == v) {
                    self.posted.remove(i);
                    self.events.push_back(TagEvent::Cancelled { id: v });
                }
            }
            _ => {}
        }
    }

    /// A receive the hardware matched: its MATCH, then its data completion.
    fn hw_recv(&mut self, w: &WorkCompletion) {
        let conn = self.conn_of(w.qpn).unwrap_or(0);
        if w.tm_match && !w.tm_data_valid {
            self.matched.insert(w.wr_id, (w.tag, conn, w.app_ctx));
            return;
        }
        let Some(i) = self.posted.iter().position(|p| p.id == w.wr_id) else {
            return;
        };
        let Some(p) = self.posted.remove(i) else {
            return;
        };
        let (tag, conn, app_ctx) = self
            .matched
            .remove(&w.wr_id)
            .unwrap_or((w.tag, conn, w.app_ctx));
        self.stats.hw_matched += 1;
        // Eager data comes as the SEND's immediate, a rendezvous's in its context.
        let data = if self.cq_data {
            w.imm.or(ctx_data(app_ctx))
        } else {
            None
        };
        if w.status == CqeStatus::TmRndvIncomplete {
            // The request is at the start of the buffer: finish in software.
            let off = match p.dst {
                Dst::User(off) => off,
                Dst::Mem(_) => {
                    // The caller reads it back and resumes ([`TagMatcher::resume_rndv`]).
                    self.incomplete.insert(p.id, (p, conn, tag, data));
                    self.events.push_back(TagEvent::Failed {
                        id: p.id,
                        status: CqeStatus::TmRndvIncomplete,
                    });
                    return;
                }
            };
            let mut req = [0u8; RNDV_HDR_LEN];
            let read = self.user.read(off as usize, &mut req).is_ok();
            if let (true, Some(tmh), Some(rvh)) =
                (read, Tmh::parse(&req), Rvh::parse(&req[TMH_LEN..]))
            {
                self.start_sw_rndv(p, conn, tmh, rvh, data);
                return;
            }
            // Nothing to read from: the receive fails, and so does the send.
            let tmh = Tmh {
                opcode: TmhOp::Rndv as u8,
                app_ctx: w.app_ctx,
                tag,
            };
            self.refuse(conn, tmh);
            self.events.push_back(TagEvent::Failed {
                id: p.id,
                status: CqeStatus::RemInvReqErr,
            });
            return;
        }
        if w.status != CqeStatus::Success {
            self.events.push_back(TagEvent::Failed {
                id: p.id,
                status: w.status,
            });
            return;
        }
        self.record(&p, data, w.byte_len, None, true);
        self.events.push_back(TagEvent::Recv {
            id: p.id,
            tag,
            len: w.byte_len,
            truncated: false,
            conn,
        });
    }

    /// Writes `bytes` into connection `conn`'s next header slot. The slot counts as used
    /// once the send is posted (the caller advances `hdr_next`).
    fn header(&self, conn: usize, bytes: &[u8]) -> Result<crate::mr::Sge, Error> {
        let c = &self.conns[conn];
        let at = (c.hdr_next % HDR_SLOTS) * HDR;
        c.hdr_buf.write(at as usize, bytes)?;
        Ok(c.hdr_mr.sge(at, bytes.len() as u32))
    }

    /// The waiting send a FIN on `conn` answers ([`fin_match`]).
    fn fin_key(
        &self,
        conn: usize,
        t: &Tmh,
        rvh: Option<Rvh>,
        refused: bool,
    ) -> Option<(usize, u32)> {
        fin_match(&self.sends, self.cq_data, conn, t, rvh, refused)
    }

    /// Keeps what receive `r` (of [`TagMatcher::recv_sge`]) got, for
    /// [`TagMatcher::received`].
    fn record(
        &mut self,
        r: &Posted,
        data: Option<u32>,
        msg_len: u32,
        payload: Option<Vec<u8>>,
        hw: bool,
    ) {
        if matches!(r.dst, Dst::Mem(_)) {
            self.received.insert(
                r.id,
                Received {
                    data,
                    msg_len,
                    payload,
                    hw,
                },
            );
        }
    }

    fn conn_of(&self, qpn: u32) -> Option<usize> {
        self.conns.iter().position(|c| c.qp.qpn() == qpn)
    }

    /// A message in staging slot `slot`: a FIN for one of our sends, or an unexpected one.
    /// It is recorded first; then the slot goes back to the SRQ; then the count to the
    /// device.
    fn untagged(&mut self, w: &WorkCompletion, slot: u32) -> Result<(), Error> {
        let base = slot as u64 * self.slot_bytes;
        let mut hdr = [0u8; RNDV_HDR_LEN];
        let n = (w.byte_len as usize).min(hdr.len());
        let read = self.staging.read(base as usize, &mut hdr[..n]);
        let tmh = Tmh::parse(&hdr[..n]);
        let conn = self.conn_of(w.qpn);
        match (w.opcode, tmh) {
            (CqeOpcode::TmNoTag, Some(t)) if t.opcode == TmhOp::Fin as u8 => {
                let rvh = Rvh::parse(&hdr[TMH_LEN.min(n)..n]);
                let key = self.fin_key(conn.unwrap_or(usize::MAX), &t, rvh, hdr[1] != 0);
                if let Some(key) = key {
                    if let Some(s) = self.sends.remove(&key) {
                        self.events.push_back(if hdr[1] == 0 {
                            TagEvent::Send { id: s.id }
                        } else {
                            TagEvent::Failed {
                                id: s.id,
                                status: CqeStatus::RemInvReqErr,
                            }
                        });
                    }
                }
                self.recycle(slot);
                read.map(|_| ())
            }
            (CqeOpcode::TmRecv, _) if w.status != CqeStatus::Success => {
                // The device counted it when it took the buffer; its bytes are not a message.
                self.unexp_cnt = self.unexp_cnt.wrapping_add(1);
                self.stats.dropped += 1;
                self.recycle(slot);
                self.request_sync();
                Ok(())
            }
            (CqeOpcode::TmRecv, Some(t)) => {
                self.unexp_cnt = self.unexp_cnt.wrapping_add(1);
                let rndv = (t.opcode == TmhOp::Rndv as u8)
                    .then(|| Rvh::parse(&hdr[TMH_LEN.min(n)..n]))
                    .flatten();
                let cq_data = match (self.cq_data, rndv.is_some()) {
                    (false, _) => None,
                    (true, false) => w.imm,
                    (true, true) => ctx_data(t.app_ctx),
                };
                let conn = match conn {
                    Some(c) if t.opcode != TmhOp::Rndv as u8 || rndv.is_some() => c,
                    _ => {
                        // A rendezvous request without a whole RVH names no data to read:
                        // refused, and its sender told.
                        self.stats.dropped += 1;
                        if let Some(c) = conn {
                            self.refuse(c, t);
                        }
                        self.recycle(slot);
                        self.request_sync();
                        return Ok(());
                    }
                };
                let mut data = Vec::new();
                let mut copied = Ok(());
                if rndv.is_none() {
                    data.resize((w.byte_len as usize).saturating_sub(TMH_LEN), 0);
                    copied = self.staging.read(base as usize + TMH_LEN, &mut data);
                }
                let u = Unexpected {
                    tag: t.tag,
                    conn,
                    data,
                    rndv,
                    tmh: t,
                    cq_data,
                };
                self.match_unexpected(u);
                self.recycle(slot);
                // The count goes to the device after any DEL the match needed.
                self.request_sync();
                copied
            }
            _ => {
                self.recycle(slot);
                read.map(|_| ())
            }
        }
    }

    /// Gives unexpected message `u` to the earliest posted receive it matches (MPI order),
    /// or queues it. A receive the hardware is already filling (between its MATCH and data
    /// completions) is not a candidate. A receive in the hardware list was appended while
    /// hardware and software disagreed on the unexpected count, so the hardware keeps it
    /// disabled: it is taken back with a DEL, posted before the SYNC that would enable it,
    /// and `u` is delivered when the DEL succeeds. (Should the DEL fail because a message
    /// got the entry after all, `u` is matched again.)
    fn match_unexpected(&mut self, u: Unexpected) {
        let peer = self.conns[u.conn].peer;
        let hit = self.posted.iter().position(|p| {
            p.takes(u.tag, peer)
                && match p.at {
                    Where::Sw => true,
                    Where::Hw(_) => !self.matched.contains_key(&p.id),
                    Where::Cancelled => false,
                }
        });
        let Some(i) = hit else {
            self.unexpected.push_back(u);
            return;
        };
        let p = self.posted[i];
        if let Where::Hw(handle) = p.at {
            self.posted[i].at = Where::Cancelled;
            self.stats.taken_back += 1;
            self.reclaim.insert(p.id, u);
            self.list_op(ListOp::Del {
                kind: K_TAKEBACK,
                id: p.id,
                handle,
            });
            return;
        }
        self.posted.remove(i);
        self.deliver_unexpected(p, u);
    }

    /// Tells the hardware how many unexpected messages software has seen. Nothing to tell
    /// when software matches alone.
    fn request_sync(&mut self) {
        if self.cfg.hw_tags == 0 {
            return;
        }
        self.list_op(ListOp::Sync(self.unexp_cnt));
    }

    /// Queues a list operation behind those waiting, and posts what the ring takes. A SYNC
    /// right behind a waiting SYNC replaces its count (counts only grow); a SYNC is never
    /// moved before a DEL queued ahead of it.
    fn list_op(&mut self, op: ListOp) {
        queue_list_op(&mut self.list_ops, op);
        self.flush_list_ops();
    }

    /// Posts waiting list operations in order while the ring has room. Ring slots of
    /// unsignaled operations come back only with a later completion, so every 16th SYNC is
    /// signaled, and so is one that takes the ring's last free entry.
    fn flush_list_ops(&mut self) {
        while let Some(&op) = self.list_ops.front() {
            let free = self.srq.tm_free_ops();
            if free == 0 {
                return;
            }
            let mut tm = match op {
                ListOp::Del { kind, id, handle } => TmOp::del(wr(kind, id), handle),
                ListOp::Sync(count) => TmOp {
                    signaled: free == 1 || self.syncs.wrapping_add(1).is_multiple_of(16),
                    ..TmOp::sync(wr(K_OP, 0), count)
                },
            };
            if self.srq.post_tm_ops(std::slice::from_mut(&mut tm)).is_err() {
                // Tried again by the next progress call.
                return;
            }
            if matches!(op, ListOp::Sync(_)) {
                self.syncs = self.syncs.wrapping_add(1);
            }
            self.list_ops.pop_front();
        }
    }

    /// Hands staging buffer `slot` back to the SRQ; if that fails it waits for the next
    /// progress call.
    fn recycle(&mut self, slot: u32) {
        if self.post_slot(slot).is_err() {
            self.idle_slots.push(slot);
        }
    }

    fn post_slot(&mut self, slot: u32) -> Result<(), Error> {
        let sge = [self
            .staging_mr
            .sge(slot as u64 * self.slot_bytes, self.slot_bytes as u32)];
        self.srq.post_recv(&[RecvWr {
            wr_id: wr(K_SLOT, slot as u64),
            sgl: &sge,
        }])
    }

    /// Posts the staging buffers that waited.
    fn repost_idle(&mut self) -> Result<(), Error> {
        while let Some(&slot) = self.idle_slots.last() {
            self.post_slot(slot)?;
            self.idle_slots.pop();
        }
        Ok(())
    }

    /// Hands an unexpected message to receive `r`.
    fn deliver_unexpected(&mut self, r: Posted, u: Unexpected) {
        self.stats.sw_matched += 1;
        if let Some(rvh) = u.rndv {
            self.start_sw_rndv(r, u.conn, u.tmh, rvh, u.cq_data);
            return;
        }
        let n = u.data.len().min(r.len as usize);
        let full = u.data.len();
        let placed = match r.dst {
            // Within the user region: `recv` checked the buffer.
            Dst::User(off) => self.user.write(off as usize, &u.data[..n]),
            // The caller places it.
            Dst::Mem(_) => {
                let msg_len = u.data.len() as u32;
                let mut data = u.data;
                data.truncate(n);
                self.record(&r, u.cq_data, msg_len, Some(data), false);
                Ok(())
            }
        };
        self.events.push_back(match placed {
            Ok(()) => TagEvent::Recv {
                id: r.id,
                tag: u.tag,
                len: n as u32,
                truncated: full > n,
                conn: u.conn,
            },
            Err(_) => TagEvent::Failed {
                id: r.id,
                status: CqeStatus::LocProtErr,
            },
        });
    }

    /// Reads a rendezvous's data into receive `r`, then sends the FIN.
    fn start_sw_rndv(&mut self, r: Posted, conn: usize, tmh: Tmh, rvh: Rvh, data: Option<u32>) {
        self.stats.sw_rndv += 1;
        let n = rvh.len.min(r.len);
        self.sw_rndv.insert(
            r.id,
            SwRndv {
                recv: r,
                conn,
                tmh,
                rvh,
                data,
            },
        );
        if n == 0 {
            // Nothing to read (an empty message, or an empty receive): the FIN at once.
            let msg = rndv_header(
                &Tmh {
                    opcode: TmhOp::Fin as u8,
                    ..tmh
                },
                &rvh,
            );
            self.post_internal(conn, Internal::Fin { id: r.id, msg });
            return;
        }
        let remote = RemoteAddr {
            addr: rvh.va,
            rkey: rvh.rkey,
        };
        let read = Internal::Read {
            id: r.id,
            sge: self.dst_sge(&r, n),
            remote,
        };
        self.post_internal(conn, read);
    }

    /// Answers rendezvous request `tmh` on `conn` with a refusing FIN.
    fn refuse(&mut self, conn: usize, tmh: Tmh) {
        self.stats.refused += 1;
        let mut msg = rndv_header(
            &Tmh {
                opcode: TmhOp::Fin as u8,
                ..tmh
            },
            &Rvh::default(),
        );
        msg[1] = FIN_REFUSED;
        self.post_internal(conn, Internal::Refuse { msg });
    }

    /// Fails every rendezvous send of connection `conn` still waiting for its FIN.
    fn fail_conn(&mut self, conn: usize, status: CqeStatus) {
        let keys: Vec<(usize, u32)> = self
            .sends
            .range((conn, 0)..=(conn, u32::MAX))
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(s) = self.sends.remove(&k) {
                self.events.push_back(TagEvent::Failed { id: s.id, status });
            }
        }
    }

    /// The CQ was empty: after `keepalive_polls` such calls in a row, probes the
    /// connections whose rendezvous sends wait for a FIN.
    fn idle(&mut self) {
        if self.cfg.keepalive_polls == 0 || self.sends.is_empty() {
            self.idle_polls = 0;
            return;
        }
        self.idle_polls += 1;
        if self.idle_polls < self.cfg.keepalive_polls {
            return;
        }
        self.idle_polls = 0;
        let mut waiting: Vec<usize> = self.sends.keys().map(|&(c, _)| c).collect();
        waiting.dedup();
        for c in waiting {
            if !self.conns[c].probing {
                self.conns[c].probing = true;
                self.stats.probes += 1;
                self.post_internal(c, Internal::Probe);
            }
        }
    }

    /// Posts work of the matcher's own. A full send queue does not lose it: it waits in
    /// the connection's queue and is posted, in order, as completions make room. Work that
    /// cannot be posted at all fails its operation.
    fn post_internal(&mut self, conn: usize, w: Internal) {
        if self.conns[conn].deferred.is_empty() {
            match self.try_post(conn, w) {
                Ok(()) => return,
                Err(Error::QueueFull { .. }) => {}
                Err(_) => return self.internal_failed(conn, w),
            }
            self.deferred_conns += 1;
        }
        self.conns[conn].deferred.push_back(w);
    }

    /// Own work that could not be posted: its operation fails.
    fn internal_failed(&mut self, conn: usize, w: Internal) {
        let id = match w {
            Internal::Read { id, .. } | Internal::Fin { id, .. } => id,
            Internal::Probe => {
                self.conns[conn].probing = false;
                self.fail_conn(conn, CqeStatus::LocQpOpErr);
                return;
            }
            Internal::Refuse { .. } => return,
        };
        if let Some(s) = self.sw_rndv.remove(&id) {
            self.events.push_back(TagEvent::Failed {
                id: s.recv.id,
                status: CqeStatus::LocQpOpErr,
            });
        }
    }

    fn try_post(&mut self, conn: usize, w: Internal) -> Result<(), Error> {
        let mut msg = [0u8; RNDV_HDR_LEN];
        let (kind, id, len) = match w {
            Internal::Read { id, sge, remote } => {
                let sgl = [sge];
                return self.conns[conn].qp.post_send(&[SendWr::new(
                    wr(K_READ, id),
                    WrOp::Read(remote),
                    &sgl,
                )]);
            }
            Internal::Fin { id, msg: m } => {
                msg = m;
                (K_FIN, id, RNDV_HDR_LEN)
            }
            Internal::Refuse { msg: m } => {
                msg = m;
                (K_REFUSE, 0, RNDV_HDR_LEN)
            }
            Internal::Probe => {
                let probe = Tmh {
                    opcode: TmhOp::NoTag as u8,
                    app_ctx: 0,
                    tag: 0,
                };
                msg[..TMH_LEN].copy_from_slice(&probe.to_bytes());
                (K_PROBE, 0, TMH_LEN)
            }
        };
        let sgl = [self.header(conn, &msg[..len])?];
        let c = &mut self.conns[conn];
        c.qp.post_send(&[SendWr::new(wr(kind, id), WrOp::Send, &sgl)])?;
        c.hdr_next += 1;
        Ok(())
    }

    /// Posts what waited for room in connection `conn`'s send queue.
    fn retry_deferred(&mut self, conn: usize) {
        if self.conns[conn].deferred.is_empty() {
            return;
        }
        while let Some(&w) = self.conns[conn].deferred.front() {
            match self.try_post(conn, w) {
                Err(Error::QueueFull { .. }) => return,
                Err(_) => {
                    self.conns[conn].deferred.pop_front();
                    self.internal_failed(conn, w);
                }
                Ok(()) => {
                    self.conns[conn].deferred.pop_front();
                }
            }
        }
        self.deferred_conns -= 1;
    }
}

/// The waiting send a FIN on `conn` answers: by context and tag; in CQ-data mode, where the
/// context on the wire is the data and not unique, also by the RVH the FIN echoes, the
/// first by key among equals (sends with the same tag, data and RVH name the same memory,
/// so which of them completes first does not matter). A refusing FIN echoes no RVH.
fn fin_match(
    sends: &BTreeMap<(usize, u32), Waiting>,
    cq_data: bool,
    conn: usize,
    t: &Tmh,
    rvh: Option<Rvh>,
    refused: bool,
) -> Option<(usize, u32)> {
    if !cq_data {
        let key = (conn, t.app_ctx);
        return sends
            .get(&key)
            .is_some_and(|s| s.tag == t.tag)
            .then_some(key);
    }
    sends
        .range((conn, 0)..=(conn, u32::MAX))
        .filter(|(_, s)| s.tag == t.tag && s.wire_ctx == t.app_ctx)
        .find(|(_, s)| refused || Some(s.rvh) == rvh)
        .map(|(k, _)| *k)
}

/// The CQ data a rendezvous request's `app_ctx` carries in CQ-data mode (0: none).
fn ctx_data(app_ctx: u32) -> Option<u32> {
    (app_ctx != 0).then_some(app_ctx)
}

/// The first rendezvous context from `start` (wrapping, never 0) that no send of
/// connection `conn` waiting for its FIN uses.
fn free_ctx(sends: &BTreeMap<(usize, u32), Waiting>, conn: usize, start: u32) -> u32 {
    let mut ctx = start.max(1);
    while sends.contains_key(&(conn, ctx)) {
        ctx = ctx.wrapping_add(1).max(1);
    }
    ctx
}

/// Queues `op` behind the list operations waiting in `q`. A SYNC right behind a waiting
/// SYNC replaces its count (counts only grow); nothing is ever moved before a DEL.
fn queue_list_op(q: &mut VecDeque<ListOp>, op: ListOp) {
    if let (ListOp::Sync(c), Some(ListOp::Sync(last))) = (op, q.back_mut()) {
        *last = c;
    } else {
        q.push_back(op);
    }
}

/// Work the matcher posts for itself.
#[derive(Clone, Copy, Debug)]
enum Internal {
    /// The READ of a software rendezvous into receive `id`, into `sge`.
    Read {
        id: u64,
        sge: Sge,
        remote: RemoteAddr,
    },
    /// The FIN of the software rendezvous into receive `id`.
    Fin { id: u64, msg: [u8; RNDV_HDR_LEN] },
    /// A FIN refusing a rendezvous request.
    Refuse { msg: [u8; RNDV_HDR_LEN] },
    /// A keepalive: a 16-byte NO_TAG SEND the peer recycles at once.
    Probe,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// FIN matching in CQ-data mode against a plain model (a list of waiting sends): a
        /// FIN finds a send of its connection with its tag, context and RVH exactly when
        /// the model has one; a refusing FIN needs only tag and context. Contexts and RVHs
        /// come from small sets, so that many sends share them.
        #[test]
        fn fins_find_a_send_with_their_tag_context_and_rvh(
            waiting in proptest::collection::vec((0usize..3, 0u64..3, 0u32..3, 0u64..3), 0..30),
            fin in (0usize..3, 0u64..3, 0u32..3, 0u64..3, any::<bool>()),
        ) {
            let rvh = |v: u64| Rvh { va: 0x1000 * v, rkey: 7, len: 100 };
            let mut sends = BTreeMap::new();
            for (i, &(conn, tag, ctx, va)) in waiting.iter().enumerate() {
                let w = Waiting { id: i as u64, tag, wire_ctx: ctx, rvh: rvh(va) };
                sends.insert((conn, i as u32 + 1), w);
            }
            let (conn, tag, ctx, va, refused) = fin;
            let t = Tmh { opcode: TmhOp::Fin as u8, app_ctx: ctx, tag };
            let got = fin_match(&sends, true, conn, &t, Some(rvh(va)), refused);
            let model = waiting.iter().any(|&(c, tg, cx, v)| {
                c == conn && tg == tag && cx == ctx && (refused || v == va)
            });
            prop_assert_eq!(got.is_some(), model);
            if let Some(k) = got {
                let s = sends[&k];
                prop_assert_eq!(k.0, conn);
                prop_assert_eq!((s.tag, s.wire_ctx), (tag, ctx));
                prop_assert!(refused || s.rvh == rvh(va));
            }
        }

        /// Outside CQ-data mode the context is the key: only that send, and only with the
        /// FIN's tag.
        #[test]
        fn fins_find_their_context_outside_cq_data_mode(
            ctxs in proptest::collection::btree_set(1u32..20, 0..10),
            ctx in 1u32..20,
            tag in 0u64..2,
        ) {
            let sends: BTreeMap<(usize, u32), Waiting> = ctxs
                .iter()
                .map(|&c| ((0, c), Waiting { id: c as u64, tag: 1, wire_ctx: c, rvh: Rvh::default() }))
                .collect();
            let t = Tmh { opcode: TmhOp::Fin as u8, app_ctx: ctx, tag };
            let got = fin_match(&sends, false, 0, &t, None, false);
            prop_assert_eq!(got, (ctxs.contains(&ctx) && tag == 1).then_some((0, ctx)));
        }

        /// CQ data in a rendezvous context: every value but 0 reads back as sent.
        #[test]
        fn rendezvous_cq_data_reads_back(d in any::<u32>()) {
            prop_assert_eq!(ctx_data(d), (d != 0).then_some(d));
        }
    }

    #[test]
    fn a_waiting_sync_takes_the_newer_count_but_never_passes_a_del() {
        let mut q: VecDeque<ListOp> = VecDeque::new();
        let push = queue_list_op;
        push(&mut q, ListOp::Sync(1));
        push(&mut q, ListOp::Sync(2));
        push(
            &mut q,
            ListOp::Del {
                kind: K_TAKEBACK,
                id: 1,
                handle: 3,
            },
        );
        push(&mut q, ListOp::Sync(3));
        let shape: Vec<String> = q.iter().map(|o| format!("{o:?}")).collect();
        assert_eq!(q.len(), 3, "{shape:?}");
        assert_eq!(
            shape,
            vec!["Sync(2)", "Del { kind: 8, id: 1, handle: 3 }", "Sync(3)"]
        );
    }

    #[test]
    fn a_rendezvous_context_still_waiting_is_skipped_when_the_counter_wraps() {
        let w = Waiting {
            id: 1,
            tag: 2,
            wire_ctx: 0,
            rvh: Rvh::default(),
        };
        let mut sends = BTreeMap::new();
        for ctx in [u32::MAX, 1, 2] {
            sends.insert((0, ctx), w);
        }
        sends.insert((1, 3), w);
        assert_eq!(free_ctx(&sends, 0, u32::MAX), 3, "wraps past 0, 1 and 2");
        assert_eq!(free_ctx(&sends, 1, 3), 4, "per connection");
        assert_eq!(free_ctx(&sends, 2, 0), 1, "0 is never a context");
        assert_eq!(free_ctx(&sends, 0, 7), 7);
    }
}
