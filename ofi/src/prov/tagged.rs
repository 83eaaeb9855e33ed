//! Tagged messages (`fi_tsend`, `fi_trecv` and friends) over the driver's tag matcher
//! ([`ringbell::tagmatch::TagMatcher`]): each endpoint has one, in its domain's PD, with a
//! TM-SRQ and a CQ of its own; the QPs of the tagged channel ([`CH_TAG`]), connected on first
//! use through the connection manager like the untagged ones, are the matcher's.
//!
//! - **Sends** of up to [`EAGER_MAX`] bytes go eager: the TMH and a copy of the data in
//!   one SEND, complete when it is. Larger ones go rendezvous: a request (TMH + RVH) names
//!   the data, which stays where it is when it lies in a region the application registered
//!   with `FI_REMOTE_READ`, else in a bounce copy ([`super::bounce`]); the receiver reads it
//!   and answers with a FIN, which completes the send.
//! - **Receives** go to the NIC's hardware list when they qualify: at least [`EAGER_MAX`]
//!   bytes (an eager message longer than a hardware buffer would take the connection down),
//!   no source (`FI_DIRECTED_RECV` with an address: the NIC has no source filter), every
//!   earlier receive of the endpoint in the list too, and room in the list. The NIC then
//!   matches them, places eager data, and for a rendezvous reads the data and sends the FIN
//!   itself. Everything else is matched by the matcher's software half, in MPI order (its
//!   shadow list and the unexpected-count SYNC keep hardware and software consistent).
//! - **Buffers**: a receive into one buffer of a registered region is placed in place; a
//!   receive with buffers without a descriptor, or with several buffers, gets a bounce
//!   buffer of its length (the NIC writes it, the provider copies it out on completion).
//! - **Remote CQ data** (32 bits, `cq_data_size` 4) travels as the eager SEND's immediate
//!   data, or in the rendezvous request's TMH context, which the NIC reports with a match
//!   (the matcher's CQ-data mode, [`TagMatcher::carry_cq_data`]).
//! - Peeks, claims and discards ([`super::peek`]) see the unexpected messages, those
//!   software holds; a message the NIC matched is never unexpected.

use super::bounce::{self, Bounce};
use super::{
    abi, Addr, Conn, ConnId, Entry, Ep, Errno, Obj, Pending, SendReq, State, TRecvReq, TSend,
    ADDR_UNSPEC, CH_TAG, EAGAIN, EINVAL, INJECT,
};
use ringbell::tagmatch::{ext_wr_id, TagConfig, TagEvent, TagMatcher, TagSend, TAG_COPY_MAX};
use ringbell::{Access, ProtectionDomain, QpState, QueuePair, RemoteAddr, Sge};
use ringbell::{TriggerHandle, WcStatus};

/// The largest tagged message sent eagerly (TMH and data in one SEND); larger ones use
/// rendezvous. Also the smallest receive the NIC's list takes.
pub const EAGER_MAX: usize = TAG_COPY_MAX;

/// Environment variable: entries of the NIC's list an endpoint uses (0: software matching
/// only); 128 by default.
pub const ENV_HW_TAGS: &str = "RINGBELL_TM_HW_TAGS";

/// Most connections of an endpoint's tagged channel over its life: as many as a fabric has
/// NICs. The matcher adds a CQ for their send queues every 64 connections, and takes their
/// header rings from the device's arena, so a connection costs what it uses.
const MAX_CONNS: u32 = 1024;

/// What the tag matcher of an endpoint did, for `fi_open_ops("ringbell_domain_ops_v1")`'s
/// `tag_counts` (the driver's [`ringbell::tagmatch::TagStats`], in C layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagCounts {
    /// Receives posted to the NIC's list.
    pub hw_posted: u64,
    /// Messages the NIC matched.
    pub hw_matched: u64,
    /// Messages software matched (unexpected ones and receives that stayed in software).
    pub sw_matched: u64,
    /// Receives taken back from the NIC's list for an unexpected message.
    pub taken_back: u64,
    /// Rendezvous finished by software (READ and FIN from the provider).
    pub sw_rndv: u64,
    /// Unexpected messages waiting now.
    pub unexpected: u64,
}

/// An endpoint's tag matcher, in `pd`.
pub(super) fn matcher(pd: &ProtectionDomain) -> Result<TagMatcher, Errno> {
    let hw_tags = std::env::var(ENV_HW_TAGS)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(128);
    let cfg = TagConfig {
        eager_max: EAGER_MAX as u32,
        hw_min: 0,
        hw_tags,
        staging_slots: 256,
        user_bytes: 64,
        max_conns: MAX_CONNS,
        ..TagConfig::default()
    };
    let mut tm = TagMatcher::new_in(pd, cfg).map_err(|e| {
        eprintln!("ringbell-fi: creating a tag matcher: {e}");
        abi::FI_ENOMEM
    })?;
    tm.carry_cq_data();
    Ok(tm)
}

/// What a tagged send transmits.
pub(super) enum TWhat {
    /// Eager: a copy of the data.
    Bytes(Vec<u8>),
    /// Rendezvous: the receiver reads `len` bytes there.
    Rndv(RemoteAddr, u32),
}

/// A tagged send through the matcher, possibly waiting for its connection.
pub(super) struct TSendReq {
    pub tag: u64,
    pub data: Option<u32>,
    pub what: TWhat,
}

/// A tagged receive posted to the matcher.
pub(super) struct TRecv {
    pub ctx: u64,
    pub tag: u64,
    pub buf: u64,
    pub report: bool,
    /// The application's buffers, by process address (what the provider copies into).
    user: Vec<Sge>,
    /// What the NIC or the matcher writes: the one registered buffer in place, or the
    /// bounce buffer.
    dst: Sge,
    bounce: Option<Bounce>,
}

/// What a tagged receive got.
struct Got {
    tag: u64,
    len: u64,
    msg_len: u64,
    data: Option<u32>,
    from: Option<Addr>,
    ok: bool,
    prov_errno: i32,
}

impl Ep {
    /// A QP for a new connection of the tagged channel.
    pub(super) fn tag_qp(&mut self) -> Result<QueuePair, Errno> {
        let tm = self.tm.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
        tm.create_conn_qp().map_err(|e| {
            eprintln!("ringbell-fi: a tagged connection: {e}");
            EAGAIN
        })
    }

    /// Whether connection `c` of the matcher has failed (its QP is in the error state).
    pub(super) fn tag_conn_failed(&self, c: usize) -> bool {
        self.tm
            .as_ref()
            .and_then(|t| t.conn(c))
            .is_some_and(|qp| qp.query_state().is_ok_and(|s| s == QpState::Err))
    }

    /// Posts `p` on connection `c` of the matcher: a tagged send, or (a triggered send)
    /// work of the provider's own on the connection's QP.
    pub(super) fn post_tag(
        &mut self,
        c: usize,
        p: &Pending,
    ) -> Result<Option<TriggerHandle>, Errno> {
        let tm = self.tm.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
        if let Some(t) = &p.tsend {
            let what = match &t.what {
                TWhat::Bytes(b) => TagSend::Bytes(b),
                TWhat::Rndv(remote, len) => TagSend::Rndv {
                    remote: *remote,
                    len: *len,
                },
            };
            return tm
                .send_sge(p.wr_id, c, t.tag, t.data, what)
                .map(|()| None)
                .map_err(|_| EAGAIN);
        }
        let qp = tm.conn_qp_mut(c).ok_or(EINVAL)?;
        super::post_pending(qp, p, ext_wr_id(p.wr_id))
    }

    /// The matcher's peer id of address `a`.
    fn peer_id(&mut self, a: Addr) -> u64 {
        match self.peer_ids.iter().position(|p| *p == a) {
            Some(i) => i as u64,
            None => {
                self.peer_ids.push(a);
                (self.peer_ids.len() - 1) as u64
            }
        }
    }

    /// Moves the tagged connections whose QP failed out of use: the next send to the
    /// peer connects anew.
    fn retire_failed_tags(&mut self) {
        let failed: Vec<usize> = (0..self.tconn_peer.len())
            .filter(|&c| self.tag_conn_failed(c))
            .collect();
        if failed.is_empty() {
            return;
        }
        let dead = |c: &Conn| matches!(c, Conn::Tag(_, i) if failed.contains(i));
        self.conns.retain(|_, c| !dead(c));
        self.extra.retain(|(_, c)| !dead(c));
    }
}

impl State {
    /// The buffers of a tagged receive: the application's (process addresses), where the
    /// data lands, and the bounce buffer if that is one.
    pub(super) fn trecv_buffers(
        &self,
        dom: usize,
        bufs: &[(usize, usize, usize)],
    ) -> Result<(Vec<Sge>, Sge, Option<Bounce>), Errno> {
        let parts: Vec<_> = bufs.iter().filter(|b| b.1 > 0).copied().collect();
        let cap: usize = parts.iter().map(|b| b.1).sum();
        let cap32 = u32::try_from(cap).map_err(|_| abi::FI_EMSGSIZE)?;
        for &(_, _, desc) in &parts {
            if desc != 0 && !matches!(self.objs.get(&desc), Some(Obj::Mr(_))) {
                return Err(EINVAL);
            }
        }
        match parts[..] {
            [] => Ok((Vec::new(), Sge::default(), None)),
            [(addr, _, desc)] if desc != 0 => {
                let lkey = match self.objs.get(&desc) {
                    Some(Obj::Mr(m)) => m.mr.lkey(),
                    _ => return Err(EINVAL),
                };
                let s = Sge {
                    addr: addr as u64,
                    len: cap32,
                    lkey,
                };
                Ok((vec![s], s, None))
            }
            _ => {
                let user = bounce::user_sges(&parts)?;
                let b = self.bounce(dom, cap)?;
                let dst = b.sge(cap32);
                Ok((user, dst, Some(b)))
            }
        }
    }

    /// Registers a tagged receive `id` (posted to the matcher by the caller) for its
    /// completion.
    fn trecv_record(&mut self, ep: usize, id: u64, req: &TRecvReq, report: bool, bufs: Bufs) {
        if let Ok(e) = self.ep_mut(ep) {
            e.trecvs.insert(
                id,
                TRecv {
                    ctx: req.ctx,
                    tag: req.tag,
                    buf: bufs.0,
                    report,
                    user: bufs.1,
                    dst: bufs.2,
                    bounce: bufs.3,
                },
            );
        }
    }

    /// `fi_trecv` and friends: to the matcher (see the module documentation).
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes.
    pub unsafe fn post_trecv(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        req: TRecvReq,
    ) -> Result<(), Errno> {
        self.sep_allows(ep, false)?;
        let (dom, directed, selective) = {
            let e = self.ep_mut(ep)?;
            if e.dgram.is_some() {
                // Datagram endpoints carry untagged messages only.
                return Err(abi::FI_ENOSYS);
            }
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.domain, e.directed, e.rx_selective)
        };
        let src = if directed && req.src != ADDR_UNSPEC {
            Some(self.peer(ep, req.src)?)
        } else {
            None
        };
        let (user, dst, bounce) = self.trecv_buffers(dom, bufs)?;
        let e = self.ep_mut(ep)?;
        let id = e.next_wr;
        e.next_wr += 1;
        let src = src.map(|a| e.peer_id(a));
        let tm = e.tm.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
        tm.recv_sge(id, req.tag, !req.ignore, src, dst)
            .map_err(|_| EINVAL)?;
        let buf = bufs.first().map_or(0, |b| b.0 as u64);
        let report = req.report || !selective;
        self.trecv_record(ep, id, &req, report, (buf, user, dst, bounce));
        self.drain_tag_events(ep);
        Ok(())
    }

    /// A receive of the message claimed with `req.ctx` (`FI_CLAIM`, [`super::peek`]):
    /// `-FI_EINVAL` when there is none.
    pub(super) fn trecv_claimed(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        req: TRecvReq,
        report: bool,
    ) -> Result<(), Errno> {
        let dom = self.ep_mut(ep)?.domain;
        let (user, dst, bounce) = self.trecv_buffers(dom, bufs)?;
        let e = self.ep_mut(ep)?;
        let id = e.next_wr;
        e.next_wr += 1;
        let tm = e.tm.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
        if !tm.recv_claimed(req.ctx, id, dst).map_err(|_| EINVAL)? {
            return Err(EINVAL);
        }
        let buf = bufs.first().map_or(0, |b| b.0 as u64);
        self.trecv_record(ep, id, &req, report, (buf, user, dst, bounce));
        self.drain_tag_events(ep);
        Ok(())
    }

    /// `fi_tsend` and friends (see the module documentation).
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes, and is readable now.
    pub unsafe fn post_tsend(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        req: SendReq,
        tag: u64,
    ) -> Result<(), Errno> {
        self.sep_allows(ep, true)?;
        let (dom, own) = {
            let e = self.ep_mut(ep)?;
            if e.dgram.is_some() {
                return Err(abi::FI_ENOSYS);
            }
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.domain, e.addr)
        };
        // (A connected endpoint's go to its peer's tagged channel, whatever the address.)
        let peer = match self.tag_dest(ep)? {
            Some(a) => a,
            None => self.dest_peer(ep, req.dest)?,
        };
        let total: usize = bufs.iter().map(|b| b.1).sum();
        if req.inject && total > INJECT {
            return Err(abi::FI_EMSGSIZE);
        }
        if let Some(t) = req.trig {
            // SAFETY: per the caller.
            return unsafe { self.post_tsend_triggered(ep, (dom, own, peer), bufs, req, tag, t) };
        }
        let parts: Vec<_> = bufs.iter().filter(|b| b.1 > 0).copied().collect();
        let mut bounced = None;
        let what = if total <= EAGER_MAX {
            let mut copy = Vec::with_capacity(total);
            for &(addr, len, _) in &parts {
                // SAFETY: readable now, per the caller.
                copy.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len)
                });
            }
            TWhat::Bytes(copy)
        } else {
            let len = u32::try_from(total).map_err(|_| abi::FI_EMSGSIZE)?;
            let (va, rkey) = match parts[..] {
                [(_, _, desc)]
                    if desc != 0 && !matches!(self.objs.get(&desc), Some(Obj::Mr(_))) =>
                {
                    return Err(EINVAL)
                }
                // The receiver reads the data in place when the application's region lets
                // peers read it; otherwise from a bounce buffer (below).
                [(addr, _, desc)]
                    if matches!(self.objs.get(&desc),
                        Some(Obj::Mr(m)) if m.access.contains(Access::REMOTE_READ)) =>
                {
                    match self.objs.get(&desc) {
                        Some(Obj::Mr(m)) => (addr as u64, m.mr.rkey()),
                        _ => return Err(EINVAL),
                    }
                }
                _ => {
                    // SAFETY: readable now, per the caller.
                    let b = unsafe { self.bounce_from(dom, &parts, total)? };
                    let at = (b.addr(), b.rkey());
                    bounced = Some(b);
                    at
                }
            };
            TWhat::Rndv(RemoteAddr { addr: va, rkey }, len)
        };
        let e = self.ep_mut(ep)?;
        let id = e.next_wr;
        e.next_wr += 1;
        let report = !req.silent && (req.report || !e.tx_selective);
        e.tsends.insert(
            id,
            TSend {
                ctx: req.ctx,
                report,
                _bounce: bounced,
            },
        );
        let p = Pending {
            wr_id: id,
            sges: Vec::new(),
            inline: None,
            imm: None,
            wr: None,
            trig: None,
            tsend: Some(TSendReq {
                tag,
                data: req.imm,
                what,
            }),
        };
        if let Err(err) = self.transmit(ep, (peer, CH_TAG), p) {
            self.ep_mut(ep)?.tsends.remove(&id);
            return Err(err);
        }
        Ok(())
    }

    /// The endpoint whose tagged channel waits for connection `id` of NIC `nic`.
    pub(super) fn pending_tag_conn(&self, nic: usize, id: ConnId) -> Option<usize> {
        self.objs.iter().find_map(|(&k, o)| match o {
            Obj::Ep(e) if e.nic == nic => {
                let waits = |key: &(Addr, u8), c: &Conn| {
                    key.1 == CH_TAG && matches!(c, Conn::Pending(cid, _) if *cid == id)
                };
                (e.conns.iter().any(|(key, c)| waits(key, c))
                    || e.extra.iter().any(|(key, c)| waits(key, c)))
                .then_some(k)
            }
            _ => None,
        })
    }

    /// Connection `id` of endpoint `ep`'s tagged channel is up: its QP joins the matcher,
    /// and what waited for it is posted.
    pub(super) fn tag_established(&mut self, ep: usize, id: ConnId, qp: QueuePair) {
        let Ok(e) = self.ep_mut(ep) else { return };
        let waiting = |c: &Conn| matches!(c, Conn::Pending(cid, _) if *cid == id);
        let Some(key) = e
            .conns
            .iter()
            .find(|(_, c)| waiting(c))
            .map(|(k, _)| *k)
            .or_else(|| e.extra.iter().find(|(_, c)| waiting(c)).map(|(k, _)| *k))
        else {
            return;
        };
        let pid = e.peer_id(key.0);
        let added = match e.tm.as_mut() {
            Some(tm) => tm.add_connected_from(qp, pid),
            None => Err(ringbell::Error::InvalidArgument("no tag matcher")),
        };
        let slot = match e.conns.get_mut(&key) {
            Some(c) if waiting(c) => Some(c),
            _ => e.extra.iter_mut().find(|(_, c)| waiting(c)).map(|(_, c)| c),
        };
        let Some(slot) = slot else { return };
        let queue = match (added, &mut *slot) {
            (Ok(c), s) => {
                let old = std::mem::replace(s, Conn::Tag(id, c));
                if e.tconn_peer.len() <= c {
                    e.tconn_peer.resize(c + 1, key.0);
                }
                e.tconn_peer[c] = key.0;
                match old {
                    Conn::Pending(_, q) => q.into_iter().map(|p| (Some(c), p)).collect(),
                    _ => Vec::new(),
                }
            }
            (Err(err), Conn::Pending(_, q)) => {
                eprintln!("ringbell-fi: a tagged connection: {err}");
                std::mem::take(q).into_iter().map(|p| (None, p)).collect()
            }
            _ => Vec::new(),
        };
        if matches!(slot, Conn::Pending(..)) {
            e.conns.retain(|_, c| !waiting(c));
            e.extra.retain(|(_, c)| !waiting(c));
        }
        let mut failed = Vec::new();
        for (c, p) in queue {
            let posted = match c {
                Some(c) => e.post_tag(c, &p),
                None => Err(abi::FI_EHOSTUNREACH),
            };
            match posted {
                Ok(Some(h)) => {
                    if let Some(super::OpKind::Trig(t)) =
                        e.ops.get_mut(&p.wr_id).map(|o| &mut o.kind)
                    {
                        t.handle = Some(h);
                    }
                }
                Ok(None) => {}
                Err(_) => failed.push(p),
            }
        }
        for p in failed {
            if p.tsend.is_some() {
                self.finish_tsend(ep, p.wr_id, false, 0);
            } else if let Some(op) = self.ep_mut(ep).ok().and_then(|e| e.ops.remove(&p.wr_id)) {
                self.fail_op(ep, op);
            }
        }
    }

    /// Lets endpoint `ep`'s matcher handle its completions, and turns what finished into
    /// completion entries.
    pub(super) fn tag_progress(&mut self, ep: usize) {
        if let Ok(Ep { tm: Some(tm), .. }) = self.ep_mut(ep) {
            if tm.progress().is_ok_and(|n| n > 0) {
                for _ in 0..64 {
                    if !tm.progress_ready().is_ok_and(|n| n > 0) {
                        break;
                    }
                }
            }
        }
        self.drain_tag_events(ep);
    }

    /// Turns the matcher's finished operations into completion entries.
    pub(super) fn drain_tag_events(&mut self, ep: usize) {
        let mut failed = false;
        loop {
            let (ev, ext) = match self.ep_mut(ep) {
                Ok(Ep { tm: Some(tm), .. }) => (tm.next_event(), tm.next_ext_completion()),
                _ => return,
            };
            if ev.is_none() && ext.is_none() {
                break;
            }
            if let Some(w) = ext {
                failed |= w.status != WcStatus::Success;
                self.on_wc(ep, &w);
            }
            if let Some(ev) = ev {
                failed |= matches!(ev, TagEvent::Failed { .. });
                self.on_tag_event(ep, ev);
            }
        }
        if failed {
            if let Ok(e) = self.ep_mut(ep) {
                e.retire_failed_tags();
            }
        }
    }

    fn on_tag_event(&mut self, ep: usize, ev: TagEvent) {
        match ev {
            TagEvent::Send { id } => self.finish_tsend(ep, id, true, 0),
            TagEvent::Recv {
                id,
                tag,
                len,
                truncated,
                conn,
            } => {
                let Ok(e) = self.ep_mut(ep) else { return };
                let Some(r) = e.trecvs.remove(&id) else {
                    return;
                };
                let info =
                    e.tm.as_mut()
                        .and_then(|t| t.received(id))
                        .unwrap_or_default();
                let from = e.tconn_peer.get(conn).copied();
                let placed = match (&info.payload, &r.bounce) {
                    // SAFETY: a receive's buffers are the application's memory, mapped and
                    // writable until the receive completes (the contract of `post_trecv`);
                    // the payload is cut to their length.
                    (Some(p), _) => unsafe { bounce::copy_to_user(&r.user, p) },
                    // SAFETY: as above; `len` bytes fit the buffers.
                    (None, Some(b)) => unsafe { b.copy_out(&r.user, len as u64) },
                    (None, None) => Ok(()),
                };
                let msg_len = if truncated {
                    info.msg_len.max(len)
                } else {
                    len
                };
                let got = Got {
                    tag,
                    len: len as u64,
                    msg_len: msg_len as u64,
                    data: info.data,
                    from,
                    ok: placed.is_ok(),
                    prov_errno: 0,
                };
                self.finish_trecv(ep, r, got);
            }
            TagEvent::Failed { id, status } => {
                let Ok(e) = self.ep_mut(ep) else { return };
                if e.tsends.contains_key(&id) {
                    self.finish_tsend(ep, id, false, status as i32);
                    return;
                }
                if status == WcStatus::TmRndvIncomplete {
                    // A rendezvous the NIC matched into a too-small buffer: the request is
                    // at its start; the matcher reads the data (truncated) in software.
                    let hdr = e.trecvs.get(&id).map(|r| r.head());
                    if let (Some(hdr), Some(tm)) = (hdr, e.tm.as_mut()) {
                        tm.resume_rndv(id, &hdr);
                        return;
                    }
                }
                let Some(r) = e.trecvs.remove(&id) else {
                    return;
                };
                let got = Got {
                    tag: r.tag,
                    len: 0,
                    msg_len: 0,
                    data: None,
                    from: None,
                    ok: false,
                    prov_errno: status as i32,
                };
                self.finish_trecv(ep, r, got);
            }
            TagEvent::Cancelled { id } => {
                let Ok(e) = self.ep_mut(ep) else { return };
                let Some(r) = e.trecvs.remove(&id) else {
                    return;
                };
                let rxcq = e.rxcq;
                self.push(
                    rxcq,
                    Entry {
                        ctx: r.ctx,
                        flags: abi::FI_RECV as u64 | abi::FI_TAGGED as u64,
                        buf: r.buf,
                        tag: r.tag,
                        src: ADDR_UNSPEC,
                        err: abi::FI_ECANCELED as i32,
                        ..Default::default()
                    },
                );
            }
        }
    }

    /// A tagged receive is over: its completion (an error entry `FI_ETRUNC` when the
    /// message was longer than the buffer), and the receive counter.
    fn finish_trecv(&mut self, ep: usize, r: TRecv, g: Got) {
        let Ok(e) = self.ep_mut(ep) else { return };
        let rxcq = e.rxcq;
        let truncated = g.ok && g.msg_len > g.len;
        self.count(ep, abi::FI_RECV as u64, g.ok && !truncated);
        if g.ok && !truncated && !r.report {
            return;
        }
        let mut flags = abi::FI_RECV as u64 | abi::FI_TAGGED as u64;
        if g.data.is_some() {
            flags |= abi::FI_REMOTE_CQ_DATA as u64;
        }
        let src = g.from.map_or(ADDR_UNSPEC, |a| self.av_index(ep, &a));
        self.push(
            rxcq,
            Entry {
                ctx: r.ctx,
                flags,
                len: g.len,
                buf: r.buf,
                data: g.data.map_or(0, u64::from),
                tag: g.tag,
                src,
                olen: if truncated { g.msg_len - g.len } else { 0 },
                err: match (g.ok, truncated) {
                    (false, _) => abi::FI_EIO as i32,
                    (true, true) => abi::FI_ETRUNC as i32,
                    (true, false) => 0,
                },
                prov_errno: g.prov_errno,
            },
        );
    }

    /// What endpoint `ep`'s tag matcher did so far.
    pub fn tag_counts(&self, ep: usize) -> Result<TagCounts, Errno> {
        let tm = self.objs_ep(ep)?.tm.as_ref().ok_or(abi::FI_EOPBADSTATE)?;
        let s = tm.stats();
        Ok(TagCounts {
            hw_posted: s.hw_posted,
            hw_matched: s.hw_matched,
            sw_matched: s.sw_matched,
            taken_back: s.taken_back,
            sw_rndv: s.sw_rndv,
            unexpected: tm.unexpected_len() as u64,
        })
    }
}

/// The buffers of a receive: the first address, the application's SGEs, where the data
/// lands, the bounce buffer.
type Bufs = (u64, Vec<Sge>, Sge, Option<Bounce>);

impl TRecv {
    /// The first bytes of where the data landed (a rendezvous request, after a
    /// `TmRndvIncomplete`).
    fn head(&self) -> [u8; 32] {
        let mut h = [0u8; 32];
        let n = (self.dst.len as usize).min(h.len());
        match &self.bounce {
            Some(b) => {
                let _ = b.read(&mut h[..n]);
            }
            None if n > 0 => {
                // SAFETY: the receive's one buffer is the application's registered memory,
                // mapped until the receive completes (the contract of `post_trecv`), and
                // at least `n` bytes long; the NIC finished writing it (its completion).
                let src = unsafe { std::slice::from_raw_parts(self.dst.addr as *const u8, n) };
                h[..n].copy_from_slice(src);
            }
            None => {}
        }
        h
    }
}

/// The peer connection `conn` of endpoint `e`'s matcher reaches.
pub(super) fn peer_of(e: &Ep, conn: usize) -> Option<Addr> {
    e.tconn_peer.get(conn).copied()
}
