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
//!   least `hw_min` and `eager_max` bytes (so any eager message fits), and the list has room; otherwise it stays in software.
//! - **The shadow list** keeps every posted receive in posting order, hardware or not. A
//!   message the hardware could not match arrives "unexpected" (whole, in a staging buffer):
//!   software matches it against the shadow list; if the earliest match sits in hardware
//!   (appended while hardware and software disagreed on the unexpected count, so the
//!   hardware keeps it disabled), the entry is removed with a DEL *before* the SYNC that
//!   would enable it, and the message is delivered to it.
//! - **The unexpected queue** holds copies: an eager message's payload is copied out of its
//!   staging buffer, which goes back to the NIC at once, so unexpected traffic does not pin
//!   the staging buffers (and stall senders with RNR NAKs) until receives are posted.
//! - **Own work** (software rendezvous READs and FINs) that finds a send queue full waits
//!   and is posted as completions make room: never lost.
//! - **Rendezvous** that hardware matched is finished by the NIC (READ, then FIN). One that
//!   arrived unexpected, or whose buffer was too small, is finished here: RDMA READ, then FIN.
//!
//! Call [`TagMatcher::progress`] to move things along; finished operations come out of
//! [`TagMatcher::next_event`].

use crate::cq::{CompletionQueue, WorkCompletion};
use crate::device::{Device, DmaBuffer};
use crate::error::Error;
use crate::mr::{MemoryRegion, ProtectionDomain};
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
    /// Untagged staging buffers for unexpected messages.
    pub staging_slots: u32,
    /// Bytes of the user region.
    pub user_bytes: usize,
}

impl Default for TagConfig {
    fn default() -> Self {
        TagConfig {
            eager_max: 8192,
            hw_min: 1024,
            hw_tags: 64,
            staging_slots: 64,
            user_bytes: 1 << 22,
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
        /// What the device reported.
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
    /// Taken out of the hardware list by software (a DEL is in flight).
    Cancelled,
}

#[derive(Clone, Copy, Debug)]
struct Posted {
    id: u64,
    tag: u64,
    mask: u64,
    off: u64,
    len: u32,
    at: Where,
}

#[derive(Clone, Debug)]
struct Unexpected {
    tag: u64,
    conn: usize,
    /// Eager: the payload, copied out so that the staging buffer serves again at once.
    data: Vec<u8>,
    /// Rendezvous: where the data is.
    rndv: Option<Rvh>,
    tmh: Tmh,
}

/// A software rendezvous in progress at the receiver.
#[derive(Clone, Copy, Debug)]
struct SwRndv {
    recv: Posted,
    conn: usize,
    tmh: Tmh,
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

fn wr(kind: u64, v: u64) -> u64 {
    kind << K_SHIFT | v & ((1 << K_SHIFT) - 1)
}

/// Bytes of a send header slot (TMH + RVH).
const HDR: u64 = 64;
/// Send queue depth of a connection.
const SQ_DEPTH: u32 = 256;
/// Header slots per connection: twice the send queue, so a slot is written again only long
/// after the send that used it completed (a retransmission gathers it again until then).
const HDR_SLOTS: u64 = 2 * SQ_DEPTH as u64;

/// A connection's ring of send headers (TMH, TMH + RVH, FIN).
#[derive(Debug)]
struct HdrRing {
    mr: MemoryRegion,
    buf: DmaBuffer,
    /// Sends posted with a header so far.
    next: u64,
}

/// A tag-matching endpoint.
#[derive(Debug)]
pub struct TagMatcher {
    conns: Vec<QueuePair>,
    srq: SharedReceiveQueue,
    cq: CompletionQueue,
    user_mr: MemoryRegion,
    user: DmaBuffer,
    staging_mr: MemoryRegion,
    staging: DmaBuffer,
    pd: ProtectionDomain,
    cfg: TagConfig,
    slot_bytes: u64,
    hdrs: Vec<HdrRing>,
    /// Own work waiting for room in a send queue.
    deferred: VecDeque<(usize, Internal)>,
    /// Unexpected messages waiting for the DEL of the hardware receive they go to.
    reclaim: BTreeMap<u64, Unexpected>,
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Unexpected>,
    unexp_cnt: u32,
    sends: BTreeMap<u64, u64>,
    sw_rndv: BTreeMap<u64, SwRndv>,
    /// Tag of a receive matched by hardware, between its MATCH and its data completions.
    matched: BTreeMap<u64, (u64, usize)>,
    events: VecDeque<TagEvent>,
    next_send_ctx: u32,
    wc: Vec<WorkCompletion>,
    stats: TagStats,
    syncs: u32,
}

impl TagMatcher {
    /// A matcher on `dev` with no connection yet.
    pub fn new(dev: &Device, cfg: TagConfig) -> Result<TagMatcher, Error> {
        let pd = dev.alloc_pd()?;
        let cq = dev.create_cq(4096)?;
        let tags = cfg.hw_tags.clamp(1, dev.caps().max_num_tags.max(1));
        let mut srq = pd.create_tm_srq(
            &cq,
            cfg.staging_slots.max(2),
            1,
            tags,
            (4 * tags + 16).max(256),
        )?;
        let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let user = dev.alloc_dma(cfg.user_bytes)?;
        let user_mr = pd.reg_mr(&user, all)?;
        let slot_bytes = (cfg.eager_max as u64 + TMH_LEN as u64).next_multiple_of(64);
        let staging = dev.alloc_dma((slot_bytes * cfg.staging_slots.max(2) as u64) as usize)?;
        let staging_mr = pd.reg_mr(&staging, all)?;
        for s in 0..cfg.staging_slots.max(2) {
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
            user_mr,
            user,
            staging_mr,
            staging,
            pd,
            cfg: TagConfig {
                hw_tags: if cfg.hw_tags == 0 { 0 } else { tags },
                ..cfg
            },
            slot_bytes,
            hdrs: Vec::new(),
            deferred: VecDeque::new(),
            reclaim: BTreeMap::new(),
            posted: VecDeque::new(),
            unexpected: VecDeque::new(),
            unexp_cnt: 0,
            sends: BTreeMap::new(),
            sw_rndv: BTreeMap::new(),
            matched: BTreeMap::new(),
            events: VecDeque::new(),
            next_send_ctx: 1,
            wc: vec![WorkCompletion::default(); 32],
            stats: TagStats::default(),
            syncs: 0,
        })
    }

    /// The user region: sends read from it, receives land in it.
    pub fn user(&self) -> &DmaBuffer {
        &self.user
    }

    /// Opens a connection: returns its index and this side's endpoint for the peer.
    pub fn add_conn(&mut self) -> Result<(usize, Endpoint), Error> {
        let mut init = QpInit::new(&self.cq, &self.cq);
        init.srq = Some(&self.srq);
        init.max_send_wr = SQ_DEPTH;
        init.max_send_sge = 2;
        let qp = self.pd.create_qp(&init)?;
        let buf = self.pd.device().alloc_dma((HDR * HDR_SLOTS) as usize)?;
        let mr = self.pd.reg_mr(&buf, Access::LOCAL_WRITE)?;
        let ep = qp.endpoint(self.conns.len() as u32 * 1000 + 1);
        self.conns.push(qp);
        self.hdrs.push(HdrRing { mr, buf, next: 0 });
        Ok((self.conns.len() - 1, ep))
    }

    /// Connects connection `conn` to the peer's endpoint.
    pub fn connect(
        &mut self,
        conn: usize,
        remote: &Endpoint,
        opts: &ConnectOptions,
    ) -> Result<(), Error> {
        let qp = self
            .conns
            .get_mut(conn)
            .ok_or(Error::InvalidArgument("no such connection"))?;
        let psn = conn as u32 * 1000 + 1;
        qp.connect(
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
        self.conns.get(conn)
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
    /// of the user region at `off`.
    pub fn recv(&mut self, id: u64, tag: u64, mask: u64, off: u64, len: u32) -> Result<(), Error> {
        check_id(id)?;
        if self.posted.iter().any(|p| p.id == id) || self.sw_rndv.contains_key(&id) {
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
        let r = Posted {
            id,
            tag,
            mask,
            off,
            len,
            at: Where::Sw,
        };
        // The earliest unexpected message that matches is this receive's.
        if let Some(i) = self
            .unexpected
            .iter()
            .position(|u| tag_matches(u.tag, tag, mask))
        {
            if let Some(u) = self.unexpected.remove(i) {
                return self.deliver_unexpected(r, u);
            }
        }
        // To hardware only behind receives that are all in hardware (so the list count is
        // the posted count), and only while the list has room.
        if self.cfg.hw_tags > 0
            && len >= self.cfg.hw_min.max(self.cfg.eager_max)
            && self.posted.len() < self.cfg.hw_tags as usize
            && self.srq.tm_free_tags() > 0
            && self.posted.iter().all(|p| matches!(p.at, Where::Hw(_)))
        {
            let sge = self.user_mr.sge(off, len);
            let mut op = [TmOp::add(wr(K_OP, id), id, sge, tag, mask).with_count(self.unexp_cnt)];
            op[0].signaled = false;
            self.srq.post_tm_ops(&mut op)?;
            self.stats.hw_posted += 1;
            self.posted.push_back(Posted {
                at: Where::Hw(op[0].handle),
                ..r
            });
        } else {
            self.posted.push_back(r);
        }
        Ok(())
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
    /// once, one in the hardware list with a DEL. [`TagEvent::Cancelled`] reports success;
    /// if a message wins the race the receive completes as usual instead. Returns false when
    /// `id` is not a posted receive (already matched, or never posted).
    pub fn cancel(&mut self, id: u64) -> Result<bool, Error> {
        let Some(i) = self.posted.iter().position(|p| p.id == id) else {
            return Ok(false);
        };
        match self.posted[i].at {
            Where::Sw => {
                self.posted.remove(i);
                self.events.push_back(TagEvent::Cancelled { id });
            }
            Where::Hw(h) => {
                self.srq
                    .post_tm_ops(&mut [TmOp::del(wr(K_CANCEL, id), h)])?;
                self.posted[i].at = Where::Cancelled;
            }
            Where::Cancelled => return Ok(false),
        }
        Ok(true)
    }

    /// Sends `len` bytes of the user region at `off` with `tag` on connection `conn`.
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
            let tmh = Tmh {
                opcode: TmhOp::Eager as u8,
                app_ctx: 0,
                tag,
            };
            let sgl = [
                self.header(conn, &tmh.to_bytes())?,
                self.user_mr.sge(off, len),
            ];
            let n = if len == 0 { 1 } else { 2 };
            self.conns[conn].post_send(&[SendWr::new(wr(K_EAGER, id), WrOp::Send, &sgl[..n])])?;
            self.hdrs[conn].next += 1;
        } else {
            let ctx = self.next_send_ctx;
            self.next_send_ctx = self.next_send_ctx.wrapping_add(1).max(1);
            let req = rndv_header(
                &Tmh {
                    opcode: TmhOp::Rndv as u8,
                    app_ctx: ctx,
                    tag,
                },
                &Rvh {
                    va: self.user_mr.addr() + off,
                    rkey: self.user_mr.rkey(),
                    len,
                },
            );
            let sgl = [self.header(conn, &req)?];
            self.conns[conn].post_send(&[SendWr::new(wr(K_RNDV_REQ, id), WrOp::Send, &sgl)])?;
            self.hdrs[conn].next += 1;
            self.sends.insert(ctx as u64, id);
        }
        Ok(())
    }

    /// Polls the CQ once (letting the device progress if it is empty) and handles what came;
    /// returns how many completions were handled.
    pub fn progress(&mut self) -> Result<usize, Error> {
        self.handle_completions(true)
    }

    /// Handles the completions already in the CQ without progressing the device: for
    /// callers that drive an emulated fabric themselves (several matchers on one fabric, or
    /// measurements in simulated time, where a poll of an empty CQ would run the fabric
    /// ahead while another matcher still has work).
    pub fn progress_ready(&mut self) -> Result<usize, Error> {
        self.handle_completions(false)
    }

    fn handle_completions(&mut self, progress_device: bool) -> Result<usize, Error> {
        let mut wc = std::mem::take(&mut self.wc);
        let n = if progress_device {
            self.cq.poll(&mut wc)
        } else {
            self.cq.poll_ready(&mut wc)
        };
        // Every completion polled is handled even if one fails: the first error is returned.
        let mut r = Ok(n);
        for w in &wc[..n] {
            if let (Err(e), true) = (self.handle(w), r.is_ok()) {
                r = Err(e);
            }
        }
        self.wc = wc;
        if n > 0 && !self.deferred.is_empty() {
            if let (Err(e), true) = (self.retry_deferred(), r.is_ok()) {
                r = Err(e);
            }
        }
        r
    }

    fn handle(&mut self, w: &WorkCompletion) -> Result<(), Error> {
        let (kind, v) = (w.wr_id >> K_SHIFT, w.wr_id & ((1 << K_SHIFT) - 1));
        match w.opcode {
            CqeOpcode::TmAdd | CqeOpcode::TmDel | CqeOpcode::TmSync => {
                // Only failures, SYNC requests and cancelling DELs are delivered.
                if w.opcode == CqeOpcode::TmAdd && w.tm_sync_req {
                    self.sync()?;
                }
                if w.opcode == CqeOpcode::TmDel && kind == K_TAKEBACK {
                    if let Some(u) = self.reclaim.remove(&v) {
                        let i = self.posted.iter().position(|p| p.id == v);
                        match (w.status, i) {
                            (CqeStatus::Success, Some(i)) => {
                                if let Some(p) = self.posted.remove(i) {
                                    return self.deliver_unexpected(p, u);
                                }
                            }
                            // The hardware matched the entry first: it completes as usual.
                            _ => return self.match_unexpected(u),
                        }
                    }
                    return Ok(());
                }
                if w.opcode == CqeOpcode::TmDel
                    && kind == K_CANCEL
                    && w.status == CqeStatus::Success
                {
                    // Taken out before any message matched it. (On TM_ERR a message got
                    // there first, and the receive completes as usual.)
                    if let Some(i) = self.posted.iter().position(|p| p.id == v) {
                        self.posted.remove(i);
                        self.events.push_back(TagEvent::Cancelled { id: v });
                    }
                }
                Ok(())
            }
            CqeOpcode::TmRecv | CqeOpcode::TmNoTag if kind == K_SLOT => self.untagged(w, v as u32),
            CqeOpcode::TmRecv => {
                // A receive the hardware matched.
                let conn = self.conn_of(w.qpn);
                if w.tm_match && !w.tm_data_valid {
                    self.matched.insert(w.wr_id, (w.tag, conn));
                    return Ok(());
                }
                let Some(i) = self.posted.iter().position(|p| p.id == w.wr_id) else {
                    return Ok(());
                };
                let Some(p) = self.posted.remove(i) else {
                    return Ok(());
                };
                let (tag, conn) = self.matched.remove(&w.wr_id).unwrap_or((w.tag, conn));
                self.stats.hw_matched += 1;
                if w.status == CqeStatus::TmRndvIncomplete {
                    // The request is at the start of the buffer: finish in software.
                    let mut req = [0u8; RNDV_HDR_LEN];
                    self.user.read(p.off as usize, &mut req)?;
                    let (Some(tmh), Some(rvh)) = (Tmh::parse(&req), Rvh::parse(&req[TMH_LEN..]))
                    else {
                        return Ok(());
                    };
                    return self.start_sw_rndv(p, conn, tmh, rvh);
                }
                if w.status != CqeStatus::Success {
                    self.events.push_back(TagEvent::Failed {
                        id: p.id,
                        status: w.status,
                    });
                    return Ok(());
                }
                self.events.push_back(TagEvent::Recv {
                    id: p.id,
                    tag,
                    len: w.byte_len,
                    truncated: false,
                    conn,
                });
                Ok(())
            }
            // A receive buffer of the staging ring that completed some other way (a WRITE
            // with immediate from the peer, say): it serves again.
            _ if kind == K_SLOT => self.repost(v as u32),
            _ if w.status != CqeStatus::Success => {
                // A send, request, READ or FIN failed: report it against its operation.
                let id = match kind {
                    K_READ | K_FIN => self.sw_rndv.remove(&v).map(|s| s.recv.id),
                    K_RNDV_REQ => {
                        self.sends.retain(|_, s| *s != v);
                        Some(v)
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
                Ok(())
            }
            _ => match kind {
                K_EAGER => {
                    self.events.push_back(TagEvent::Send { id: v });
                    Ok(())
                }
                K_READ => {
                    let Some(s) = self.sw_rndv.get(&v).copied() else {
                        return Ok(());
                    };
                    // Data read: tell the sender its buffer is free.
                    let fin = rndv_header(
                        &Tmh {
                            opcode: TmhOp::Fin as u8,
                            ..s.tmh
                        },
                        &s.rvh,
                    );
                    self.post_internal(s.conn, Internal::Fin { id: v, msg: fin })
                }
                K_FIN => {
                    if let Some(s) = self.sw_rndv.remove(&v) {
                        let truncated = s.rvh.len > s.recv.len;
                        self.events.push_back(TagEvent::Recv {
                            id: s.recv.id,
                            tag: s.tmh.tag,
                            len: s.rvh.len.min(s.recv.len),
                            truncated,
                            conn: s.conn,
                        });
                    }
                    Ok(())
                }
                _ => Ok(()),
            },
        }
    }

    /// Writes `bytes` into connection `conn`'s next header slot. The slot counts as used
    /// once the send is posted (the caller advances `next`).
    fn header(&self, conn: usize, bytes: &[u8]) -> Result<crate::mr::Sge, Error> {
        let h = &self.hdrs[conn];
        let at = (h.next % HDR_SLOTS) * HDR;
        h.buf.write(at as usize, bytes)?;
        Ok(h.mr.sge(at, bytes.len() as u32))
    }

    fn conn_of(&self, qpn: u32) -> usize {
        self.conns.iter().position(|q| q.qpn() == qpn).unwrap_or(0)
    }

    /// A message in staging slot `slot`: a FIN for one of our sends, or an unexpected one.
    fn untagged(&mut self, w: &WorkCompletion, slot: u32) -> Result<(), Error> {
        let base = slot as u64 * self.slot_bytes;
        let mut hdr = [0u8; RNDV_HDR_LEN];
        let n = (w.byte_len as usize).min(hdr.len());
        self.staging.read(base as usize, &mut hdr[..n])?;
        let tmh = Tmh::parse(&hdr[..n]);
        let conn = self.conn_of(w.qpn);
        match (w.opcode, tmh) {
            (CqeOpcode::TmNoTag, Some(t)) if t.opcode == TmhOp::Fin as u8 => {
                if let Some(id) = self.sends.remove(&(t.app_ctx as u64)) {
                    self.events.push_back(TagEvent::Send { id });
                }
                self.repost(slot)
            }
            (CqeOpcode::TmRecv, _) if w.status != CqeStatus::Success => {
                // The device counted it when it took the buffer; its bytes are not a message.
                self.unexp_cnt = self.unexp_cnt.wrapping_add(1);
                self.stats.dropped += 1;
                self.repost(slot)?;
                self.sync()
            }
            (CqeOpcode::TmRecv, Some(t)) => {
                self.unexp_cnt = self.unexp_cnt.wrapping_add(1);
                let rndv = (t.opcode == TmhOp::Rndv as u8)
                    .then(|| Rvh::parse(&hdr[TMH_LEN..n]))
                    .flatten();
                if t.opcode == TmhOp::Rndv as u8 && rndv.is_none() {
                    // A rendezvous request without a whole RVH names no data to read.
                    self.stats.dropped += 1;
                    self.repost(slot)?;
                    return self.sync();
                }
                let mut data = Vec::new();
                if rndv.is_none() {
                    data.resize((w.byte_len as usize).saturating_sub(TMH_LEN), 0);
                    let base = slot as u64 * self.slot_bytes;
                    self.staging.read(base as usize + TMH_LEN, &mut data)?;
                }
                self.repost(slot)?;
                let u = Unexpected {
                    tag: t.tag,
                    conn,
                    data,
                    rndv,
                    tmh: t,
                };
                let r = self.match_unexpected(u);
                // The count goes to the device even if matching failed.
                let synced = self.sync();
                r.and(synced)
            }
            _ => self.repost(slot),
        }
    }

    /// Gives unexpected message `u` to the earliest posted receive it matches (MPI order),
    /// or queues it. A receive the hardware is already filling (between its MATCH and data
    /// completions) is not a candidate. A receive in the hardware list was appended while
    /// hardware and software disagreed on the unexpected count, so the hardware keeps it
    /// disabled: it is taken back with a DEL, posted before the SYNC that would enable it,
    /// and `u` is delivered when the DEL succeeds. (Should the DEL fail because a message
    /// got the entry after all, `u` is matched again.)
    fn match_unexpected(&mut self, u: Unexpected) -> Result<(), Error> {
        let hit = self.posted.iter().position(|p| {
            tag_matches(u.tag, p.tag, p.mask)
                && match p.at {
                    Where::Sw => true,
                    Where::Hw(_) => !self.matched.contains_key(&p.id),
                    Where::Cancelled => false,
                }
        });
        let Some(i) = hit else {
            self.unexpected.push_back(u);
            return Ok(());
        };
        let p = self.posted[i];
        if let Where::Hw(h) = p.at {
            if let Err(e) = self
                .srq
                .post_tm_ops(&mut [TmOp::del(wr(K_TAKEBACK, p.id), h)])
            {
                // No DEL, no take-back: the message waits in the queue.
                self.unexpected.push_back(u);
                return Err(e);
            }
            self.posted[i].at = Where::Cancelled;
            self.stats.taken_back += 1;
            self.reclaim.insert(p.id, u);
            return Ok(());
        }
        self.posted.remove(i);
        self.deliver_unexpected(p, u)
    }

    /// Tells the hardware how many unexpected messages software has seen. Nothing to tell
    /// when software matches alone. Every 16th SYNC is signaled: ring slots of unsignaled
    /// operations come back only with a later completion.
    fn sync(&mut self) -> Result<(), Error> {
        if self.cfg.hw_tags == 0 {
            return Ok(());
        }
        self.syncs = self.syncs.wrapping_add(1);
        self.srq.post_tm_ops(&mut [TmOp {
            signaled: self.syncs.is_multiple_of(16),
            ..TmOp::sync(wr(K_OP, 0), self.unexp_cnt)
        }])
    }

    fn repost(&mut self, slot: u32) -> Result<(), Error> {
        let sge = [self
            .staging_mr
            .sge(slot as u64 * self.slot_bytes, self.slot_bytes as u32)];
        self.srq.post_recv(&[RecvWr {
            wr_id: wr(K_SLOT, slot as u64),
            sgl: &sge,
        }])
    }

    /// Hands an unexpected message to receive `r`.
    fn deliver_unexpected(&mut self, r: Posted, u: Unexpected) -> Result<(), Error> {
        self.stats.sw_matched += 1;
        if let Some(rvh) = u.rndv {
            return self.start_sw_rndv(r, u.conn, u.tmh, rvh);
        }
        let n = u.data.len().min(r.len as usize);
        self.user.write(r.off as usize, &u.data[..n])?;
        self.events.push_back(TagEvent::Recv {
            id: r.id,
            tag: u.tag,
            len: n as u32,
            truncated: u.data.len() > n,
            conn: u.conn,
        });
        Ok(())
    }

    /// Reads a rendezvous's data into receive `r`, then sends the FIN.
    fn start_sw_rndv(&mut self, r: Posted, conn: usize, tmh: Tmh, rvh: Rvh) -> Result<(), Error> {
        self.stats.sw_rndv += 1;
        let n = rvh.len.min(r.len);
        self.sw_rndv.insert(
            r.id,
            SwRndv {
                recv: r,
                conn,
                tmh,
                rvh,
            },
        );
        let remote = RemoteAddr {
            addr: rvh.va,
            rkey: rvh.rkey,
        };
        let read = Internal::Read {
            id: r.id,
            off: r.off,
            len: n,
            remote,
        };
        self.post_internal(conn, read)
    }

    /// Posts work of the matcher's own. A full send queue does not lose it: it waits and
    /// is posted, in order, as completions make room.
    fn post_internal(&mut self, conn: usize, w: Internal) -> Result<(), Error> {
        if self.deferred.is_empty() {
            match self.try_post(conn, w) {
                Err(Error::QueueFull { .. }) => {}
                r => return r,
            }
        }
        self.deferred.push_back((conn, w));
        Ok(())
    }

    fn try_post(&mut self, conn: usize, w: Internal) -> Result<(), Error> {
        match w {
            Internal::Read {
                id,
                off,
                len,
                remote,
            } => {
                let sgl = [self.user_mr.sge(off, len)];
                self.conns[conn].post_send(&[SendWr::new(wr(K_READ, id), WrOp::Read(remote), &sgl)])
            }
            Internal::Fin { id, msg } => {
                let sgl = [self.header(conn, &msg)?];
                self.conns[conn].post_send(&[SendWr::new(wr(K_FIN, id), WrOp::Send, &sgl)])?;
                self.hdrs[conn].next += 1;
                Ok(())
            }
        }
    }

    /// Posts what waited for room in a send queue.
    fn retry_deferred(&mut self) -> Result<(), Error> {
        while let Some(&(conn, w)) = self.deferred.front() {
            match self.try_post(conn, w) {
                Err(Error::QueueFull { .. }) => break,
                r => {
                    self.deferred.pop_front();
                    r?;
                }
            }
        }
        Ok(())
    }
}

/// Work the matcher posts for itself.
#[derive(Clone, Copy, Debug)]
enum Internal {
    /// The READ of a software rendezvous into receive `id`: `len` bytes at `off`.
    Read {
        id: u64,
        off: u64,
        len: u32,
        remote: RemoteAddr,
    },
    /// The FIN of the software rendezvous into receive `id`.
    Fin { id: u64, msg: [u8; RNDV_HDR_LEN] },
}
