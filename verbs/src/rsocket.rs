//! rsockets (librdmacm's `r*` socket calls): byte streams over RC connections between
//! ringbell NICs, for programs written to `<rdma/rsocket.h>` (`rstream`, `rcopy`,
//! `riostream`, `librspreload`).
//!
//! A socket is an RDMA-CM id of the TCP port space on a channel of its own ([`Cma`]): its
//! address, port, listening and connection management are RDMA-CM's, so an rsocket's port
//! and an `rdma_cm` listener's exclude each other, as they would under librdmacm. The id
//! has no QP of the library's: the socket owns a driver QP, CQ and two registered buffers
//! and moves its QP itself (`CONNECT_RESPONSE` on the active side, before the accept on the
//! passive side).
//!
//! The stream (this library's own protocol: both ends must be rsockets of this library, as
//! both ends of an rsocket must be rsockets under librdmacm):
//! - Each side's receive buffer is cut into slots; every slot is a posted receive. The
//!   connection's private data tells the peer how many slots it may fill (its credits).
//! - Data goes as SENDs with immediate data of at most one slot each, one credit each. The
//!   immediate data carries the kind of message and the credits the sender returns: slots
//!   it has emptied since it last said so.
//! - A receiver that empties half its slots with nothing to send returns the credits in a
//!   message of its own. Such messages and the end of stream (a FIN, at `rshutdown` for
//!   writing or `rclose`) land in a few slots posted beyond the credits and are reposted at
//!   once.
//! - `rclose` waits (at most [`LINGER`]) until the peer has acknowledged every byte it
//!   sent, then sends the FIN and disconnects: nothing written before a close is lost.
//! - `riowrite` is an RDMA WRITE into a buffer the peer mapped with `riomap`; the peer
//!   tells its mappings (offset, address, key, length) in a message of its own, sent in the
//!   stream's order, so a write the peer's mapping covers arrives before anything sent
//!   after it.
//!
//! Progress is by polling, as for RDMA-CM: every call drives the socket's CQ and the NICs'
//! CMs; blocking calls poll until they can go on. The C boundary (descriptors, socket
//! addresses, buffers, `pollfd` and `fd_set`) is `rsocket_entry`.

use crate::cma::{Cma, ConnParam};
use crate::cma_abi::*;
use crate::rsocket_wire::{
    dgram_header, imm, parse_dgram_header, parse_imm, parse_private, private as conn_private, Kind,
    Notice, DGRAM_HEADER,
};
use crate::state::State;
use ringbell::{
    Access, AddressHandle, CompletionQueue, DmaBuffer, MemoryRegion, ProtectionDomain, QpInit,
    QpState, QpType, QueuePair, RecvWr, RemoteAddr, SendFlags, SendWr, UdDest, WcOpcode, WcStatus,
    WorkCompletion, WrOp,
};
use ringbell_specs::cmd::{QpAttr, QpAttrMask};
use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Bytes of one slot (the most one message carries).
pub const SLOT: usize = 16 << 10;
/// Slots each way unless `SO_SNDBUF`/`SO_RCVBUF` (or `RDMA_SQSIZE`/`RDMA_RQSIZE`) say.
const DEFAULT_SLOTS: u32 = 32;
/// Fewest and most slots a socket takes.
const MIN_SLOTS: u32 = 4;
const MAX_SLOTS: u32 = 256;
/// Receives posted beyond the credits, for credit returns, FINs and mapping notices.
const RESERVE: u32 = 8;
/// How long `rclose` waits for the peer to acknowledge what was sent.
pub const LINGER: Duration = Duration::from_secs(10);
/// A connected stream drives the NICs' CMs on one of this many passes.
const CM_EVERY: u32 = 16;
/// Remote IO mappings a side may announce (`RDMA_IOMAPSIZE` is capped to it).
const MAX_IOMAPS: i32 = 64;

/// `SOL_RDMA` and its options (`<rdma/rsocket.h>`).
pub const SOL_RDMA: i32 = 0x10000;
pub const RDMA_SQSIZE: i32 = 0;
pub const RDMA_RQSIZE: i32 = 1;
pub const RDMA_INLINE: i32 = 2;
pub const RDMA_IOMAPSIZE: i32 = 3;
pub const RDMA_ROUTE: i32 = 4;

/// Every rsocket of the process, by descriptor.
#[derive(Default)]
pub(crate) struct Rsockets {
    socks: BTreeMap<i32, Rsock>,
    /// The call looking at the sockets sleeps on their NIC's interrupt if nothing has
    /// come ([`Cma::rs_sleeping`]): its polls need not give a NIC that runs on its own its
    /// turn (a short nap on a served NIC) first.
    sleeper: bool,
}

/// Where a socket stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Bound,
    Listening,
    /// Active: the request is out.
    Connecting,
    /// Passive: accepted, the peer's RTU not seen yet (the QP receives already).
    Accepting,
    Connected,
    /// A connect that failed (its error in `err`).
    Failed,
}

/// Options, as set.
#[derive(Clone, Copy, Debug)]
struct Opts {
    reuseaddr: i32,
    keepalive: i32,
    keepidle: i32,
    oobinline: i32,
    linger: (i32, i32),
    nodelay: i32,
    maxseg: i32,
    sndbuf: i32,
    rcvbuf: i32,
    sqsize: i32,
    rqsize: i32,
    inline: i32,
    iomapsize: i32,
    v6only: i32,
}

impl Default for Opts {
    fn default() -> Self {
        let buf = (DEFAULT_SLOTS as usize * SLOT) as i32;
        Opts {
            reuseaddr: 0,
            keepalive: 0,
            keepidle: 7200,
            oobinline: 0,
            linger: (0, 0),
            nodelay: 0,
            maxseg: SLOT as i32,
            sndbuf: buf,
            rcvbuf: buf,
            sqsize: 0,
            rqsize: 0,
            inline: 0,
            iomapsize: 0,
            v6only: 0,
        }
    }
}

/// One rsocket.
struct Rsock {
    /// `AF_INET` or `AF_INET6` (addresses are shown in it).
    family: i32,
    nonblock: bool,
    chan: usize,
    id: usize,
    phase: Phase,
    /// `SO_ERROR`: the error of a connect that failed, until read.
    err: i32,
    opts: Opts,
    /// A listener's requests, not accepted yet: (id, the requester's credits).
    pending: VecDeque<(usize, u32)>,
    conn: Option<Conn>,
    /// A datagram socket's state (`SOCK_DGRAM`; `id` is then of the UDP port space).
    dgram: Option<Box<Dgram>>,
    /// Times the socket was driven.
    passes: u32,
}

/// A connection's resources and stream state. (Fields drop in order: the QP before its
/// CQ, the regions before their buffers, the PD last.)
struct Conn {
    qp: QueuePair,
    cq: CompletionQueue,
    smr: MemoryRegion,
    rmr: MemoryRegion,
    /// This side's mappings for the peer's `riowrite`s: (offset, region, user address).
    maps: Vec<(u64, MemoryRegion, u64)>,
    sbuf: DmaBuffer,
    rbuf: DmaBuffer,
    _pd: ProtectionDomain,
    nsend: u32,
    nrecv: u32,
    /// Free send slots.
    free: Vec<u32>,
    /// Sends posted and not completed (slots or not).
    inflight: u32,
    sq_depth: u32,
    /// Peer slots this side may fill.
    credits: u32,
    /// Own slots emptied since the peer was last told.
    owed: u32,
    /// Received data: (slot, length, bytes already read).
    rx: VecDeque<(u32, u32, u32)>,
    peer_maps: Vec<Notice>,
    fin_rcvd: bool,
    fin_sent: bool,
    shut_rd: bool,
    shut_wr: bool,
    /// The connection is closed (`DISCONNECTED`).
    gone: bool,
    /// A transfer failed: the connection is reset.
    broken: bool,
}

/// What a socket is ready for (`rpoll`'s bits).
pub const POLLIN: i16 = libc::POLLIN;
pub const POLLOUT: i16 = libc::POLLOUT;

/// The send side both kinds of socket share: a QP, a registered buffer cut into slots,
/// the free slots.
struct SendSlots<'a> {
    qp: &'a mut QueuePair,
    sbuf: &'a DmaBuffer,
    smr: &'a MemoryRegion,
    free: &'a mut Vec<u32>,
}

impl SendSlots<'_> {
    /// Copies `parts` one after the other into a free slot and posts one signaled request
    /// `op` of them (to `dest` on a UD QP); the slot goes back if that fails.
    fn post(&mut self, parts: &[&[u8]], op: WrOp, dest: Option<UdDest<'_>>) -> Result<(), i32> {
        let slot = self.free.pop().ok_or(libc::EAGAIN)?;
        let at = slot as usize * SLOT;
        let mut len = 0;
        let r = (|| {
            for p in parts {
                self.sbuf
                    .write(at + len, p)
                    .map_err(|e| crate::errno_of(&e))?;
                len += p.len();
            }
            let sge = [self.smr.sge(at as u64, len as u32)];
            let mut wr = SendWr::new(u64::from(slot), op, &sge).flags(SendFlags::SIGNALED);
            if let Some(d) = dest {
                wr = wr.to(d);
            }
            self.qp.post_send(&[wr]).map_err(|e| crate::errno_of(&e))
        })();
        if r.is_err() {
            self.free.push(slot);
        }
        r
    }
}

impl Conn {
    fn can_send(&self) -> bool {
        !self.shut_wr
            && !self.gone
            && !self.broken
            && self.credits > 0
            && !self.free.is_empty()
            && self.inflight < self.sq_depth
    }

    fn repost(&mut self, slot: u32) -> Result<(), i32> {
        let sge = [self.rmr.sge(u64::from(slot) * SLOT as u64, SLOT as u32)];
        self.qp
            .post_recv(&[RecvWr {
                wr_id: u64::from(slot),
                sgl: &sge,
            }])
            .map_err(|e| crate::errno_of(&e))
    }

    /// Posts a message without data (`kind`, with the credits owed).
    fn control(&mut self, kind: Kind) -> Result<(), i32> {
        let owed = std::mem::take(&mut self.owed);
        let wr =
            SendWr::new(u64::MAX, WrOp::SendImm(imm(kind, owed)), &[]).flags(SendFlags::SIGNALED);
        self.qp.post_send(&[wr]).map_err(|e| {
            self.owed += owed;
            crate::errno_of(&e)
        })?;
        self.inflight += 1;
        Ok(())
    }

    /// Takes the completions the CQ holds (`sleeper`: see [`Rsockets::sleeper`]).
    fn poll(&mut self, sleeper: bool) {
        let mut wc = [WorkCompletion::default(); 32];
        loop {
            let n = take(&mut self.cq, &mut wc, sleeper);
            for w in &wc[..n] {
                self.completed(w);
            }
            if n < wc.len() {
                break;
            }
        }
    }

    fn completed(&mut self, w: &WorkCompletion) {
        let ok = w.status == WcStatus::Success;
        match w.opcode {
            WcOpcode::Send | WcOpcode::RdmaWrite => {
                self.inflight = self.inflight.saturating_sub(1);
                if w.wr_id < u64::from(self.nsend) {
                    self.free.push(w.wr_id as u32);
                }
                if !ok && !self.gone {
                    self.broken = true;
                }
            }
            _ if !ok => {
                // A flushed receive: the QP is in error.
                if !self.gone {
                    self.broken = true;
                }
            }
            _ => {
                let slot = w.wr_id as u32;
                let (kind, credits) = parse_imm(w.imm.unwrap_or(0));
                self.credits = self.credits.saturating_add(credits);
                match kind {
                    Kind::Data if w.byte_len > 0 => self.rx.push_back((slot, w.byte_len, 0)),
                    Kind::Fin => {
                        self.fin_rcvd = true;
                        let _ = self.repost(slot);
                    }
                    Kind::Iomap => {
                        let mut b = [0u8; crate::rsocket_wire::NOTICE_LEN];
                        let got = w.byte_len as usize == b.len()
                            && self.rbuf.read(slot as usize * SLOT, &mut b).is_ok();
                        if let Some(m) = Notice::parse(&b).filter(|_| got) {
                            self.peer_maps.retain(|p| p.offset != m.offset);
                            if m.len > 0 {
                                self.peer_maps.push(m);
                            }
                        }
                        let _ = self.repost(slot);
                    }
                    _ => {
                        let _ = self.repost(slot);
                    }
                }
            }
        }
    }

    /// Sends as much of `data` as credits and slots allow now.
    fn send_some(&mut self, data: &[u8]) -> Result<usize, i32> {
        let mut sent = 0;
        while sent < data.len() && self.can_send() {
            let n = (data.len() - sent).min(SLOT);
            let op = WrOp::SendImm(imm(Kind::Data, self.owed));
            if let Err(e) = self.slots().post(&[&data[sent..sent + n]], op, None) {
                return match sent {
                    0 => Err(e),
                    _ => Ok(sent),
                };
            }
            self.owed = 0;
            self.credits -= 1;
            self.inflight += 1;
            sent += n;
        }
        Ok(sent)
    }

    fn slots(&mut self) -> SendSlots<'_> {
        SendSlots {
            qp: &mut self.qp,
            sbuf: &self.sbuf,
            smr: &self.smr,
            free: &mut self.free,
        }
    }

    /// Copies received bytes into `out` (consumed unless `peek`); returns how many.
    fn recv_some(&mut self, out: &mut [u8], peek: bool) -> usize {
        let mut got = 0;
        let mut k = 0;
        while got < out.len() {
            let Some(&(slot, len, off)) = self.rx.get(k) else {
                break;
            };
            let n = ((len - off) as usize).min(out.len() - got);
            let at = slot as usize * SLOT + off as usize;
            if self.rbuf.read(at, &mut out[got..got + n]).is_err() {
                break;
            }
            got += n;
            if peek {
                k += 1;
                continue;
            }
            if off as usize + n == len as usize {
                self.rx.pop_front();
                if self.repost(slot).is_ok() {
                    self.owed += 1;
                }
            } else if let Some(f) = self.rx.front_mut() {
                f.2 += n as u32;
            }
        }
        // Half the slots emptied and nothing going the other way: say so.
        if self.owed >= (self.nrecv / 2).max(1) && !self.gone && self.inflight < self.sq_depth {
            let _ = self.control(Kind::Credit);
        }
        got
    }
}

fn slots(bytes: i32, entries: i32) -> u32 {
    let n = match entries {
        e if e > 0 => e as u32,
        _ => (bytes.max(0) as usize / SLOT) as u32,
    };
    n.clamp(MIN_SLOTS, MAX_SLOTS)
}

/// A socket's QP (of type `ty`, in RESET), CQ, PD and registered send and receive buffers
/// on its NIC, cut into slots as its options ask (`extra` more of each for the QP's
/// queues and the receive buffer).
struct Bufs {
    qp: QueuePair,
    cq: CompletionQueue,
    pd: ProtectionDomain,
    nsend: u32,
    nrecv: u32,
    sbuf: DmaBuffer,
    rbuf: DmaBuffer,
    smr: MemoryRegion,
    rmr: MemoryRegion,
}

impl Bufs {
    fn new(st: &mut State, nic: usize, o: &Opts, extra: u32, ty: QpType) -> Result<Bufs, i32> {
        let e = |e: ringbell::Error| crate::errno_of(&e);
        let dev = st.device(nic)?;
        let nsend = slots(o.sndbuf, o.sqsize);
        let nrecv = slots(o.rcvbuf, o.rqsize);
        let pd = dev.alloc_pd().map_err(e)?;
        let sbuf = dev.alloc_dma(nsend as usize * SLOT).map_err(e)?;
        let rbuf = dev.alloc_dma((nrecv + extra) as usize * SLOT).map_err(e)?;
        let smr = pd.reg_mr(&sbuf, Access::LOCAL_WRITE).map_err(e)?;
        let rmr = pd.reg_mr(&rbuf, Access::LOCAL_WRITE).map_err(e)?;
        let cq = dev.create_cq(nsend + nrecv + 2 * extra).map_err(e)?;
        let mut init = QpInit::new(&cq, &cq);
        init.qp_type = ty;
        init.max_send_wr = nsend + extra;
        init.max_recv_wr = nrecv + extra;
        init.max_send_sge = 1;
        init.max_recv_sge = 1;
        init.max_inline = o.inline.clamp(0, 256) as u32;
        let qp = pd.create_qp(&init).map_err(e)?;
        Ok(Bufs {
            qp,
            cq,
            pd,
            nsend,
            nrecv,
            sbuf,
            rbuf,
            smr,
            rmr,
        })
    }
}

/// Whether (`level`, `name`) is an `int` option of an rsocket.
pub fn int_option(level: i32, name: i32) -> bool {
    matches!(
        (level, name),
        (
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR
                | libc::SO_KEEPALIVE
                | libc::SO_OOBINLINE
                | libc::SO_SNDBUF
                | libc::SO_RCVBUF
                | libc::SO_ERROR
                | libc::SO_TYPE
        ) | (
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY | libc::TCP_MAXSEG | libc::TCP_KEEPIDLE
        ) | (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)
            | (
                SOL_RDMA,
                RDMA_SQSIZE | RDMA_RQSIZE | RDMA_INLINE | RDMA_IOMAPSIZE
            )
    )
}

impl Cma {
    fn sock(&mut self, fd: i32) -> Result<&mut Rsock, i32> {
        self.rs.socks.get_mut(&fd).ok_or(libc::EBADF)
    }

    /// Whether `fd` is an rsocket.
    pub fn rs_is(&self, fd: i32) -> bool {
        self.rs.socks.contains_key(&fd)
    }

    /// `rsocket`: a stream socket of `family` on descriptor `fd` (the caller's).
    pub fn rs_socket(
        &mut self,
        fd: i32,
        family: i32,
        nonblock: bool,
        dgram: bool,
    ) -> Result<(), i32> {
        let chan = self.create_channel(fd) as usize;
        let ps = if dgram { RDMA_PS_UDP } else { RDMA_PS_TCP };
        let id = match self.create_id(chan, std::ptr::null_mut(), ps) {
            Ok(p) => p as usize,
            Err(e) => {
                let _ = self.destroy_channel(chan);
                return Err(e);
            }
        };
        self.rs.socks.insert(
            fd,
            Rsock {
                family,
                nonblock,
                chan,
                id,
                phase: Phase::Idle,
                err: 0,
                opts: Opts::default(),
                pending: VecDeque::new(),
                conn: None,
                dgram: dgram.then(Box::default),
                passes: 0,
            },
        );
        Ok(())
    }

    /// The socket's address family.
    pub fn rs_family(&self, fd: i32) -> Result<i32, i32> {
        self.rs.socks.get(&fd).map(|s| s.family).ok_or(libc::EBADF)
    }

    /// `rbind`.
    pub fn rs_bind(&mut self, st: &mut State, fd: i32, addr: SocketAddrV4) -> Result<(), i32> {
        if self.sock(fd)?.dgram.is_some() {
            return self.with_sock(st, fd, |c, st, s| c.dg_bind(st, s, addr));
        }
        let (phase, id) = {
            let s = self.sock(fd)?;
            (s.phase, s.id)
        };
        if phase != Phase::Idle {
            return Err(libc::EINVAL);
        }
        self.bind(st, id, addr)?;
        self.sock(fd)?.phase = Phase::Bound;
        Ok(())
    }

    /// `rlisten` (an unbound socket takes an ephemeral port on every NIC first).
    pub fn rs_listen(&mut self, st: &mut State, fd: i32, backlog: i32) -> Result<(), i32> {
        if self.sock(fd)?.dgram.is_some() {
            return Err(libc::EOPNOTSUPP);
        }
        let (phase, id) = {
            let s = self.sock(fd)?;
            (s.phase, s.id)
        };
        match phase {
            Phase::Idle => self.bind(st, id, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?,
            Phase::Bound => {}
            Phase::Listening => return Ok(()),
            _ => return Err(libc::EINVAL),
        }
        self.listen(st, id, backlog)?;
        self.sock(fd)?.phase = Phase::Listening;
        Ok(())
    }

    /// Drives socket `fd`: its CQ, then the CM's events on its channel.
    pub fn rs_pump(&mut self, st: &mut State, fd: i32) -> Result<(), i32> {
        let sleeper = self.rs.sleeper;
        self.with_sock(st, fd, |c, st, s| {
            if let Some(k) = s.conn.as_mut() {
                k.poll(sleeper);
            }
            if let Some(d) = s.dgram.as_mut() {
                d.poll(sleeper);
            }
            // A connected stream hears from RDMA-CM only of its end (the FIN comes through
            // the QP before it): the NICs' CMs are driven on one pass in CM_EVERY, not on
            // every one (each costs a poll of every NIC's CM).
            s.passes = s.passes.wrapping_add(1);
            if s.phase == Phase::Connected && s.dgram.is_none() && s.passes % CM_EVERY != 0 {
                return Ok(());
            }
            let r = c.events(st, s);
            if let Some(d) = s.dgram.as_mut() {
                d.flush();
            }
            r
        })
    }

    /// Runs `f` on socket `fd`, taken out of the table meanwhile.
    fn with_sock<R>(
        &mut self,
        st: &mut State,
        fd: i32,
        f: impl FnOnce(&mut Cma, &mut State, &mut Rsock) -> Result<R, i32>,
    ) -> Result<R, i32> {
        let mut s = self.rs.socks.remove(&fd).ok_or(libc::EBADF)?;
        let r = f(self, st, &mut s);
        self.rs.socks.insert(fd, s);
        r
    }

    fn events(&mut self, st: &mut State, s: &mut Rsock) -> Result<(), i32> {
        while let Some(ev) = self.next_event(st, s.chan)? {
            let ev = ev as usize;
            let (kind, status, id) = self.event_info(ev).unwrap_or_default();
            let private = self
                .event_private(ev)
                .map(<[u8]>::to_vec)
                .unwrap_or_default();
            let ud = self.event_ud(ev);
            let _ = self.ack(ev);
            match s.dgram.is_some() {
                true => self.dg_event(st, s, kind, id, ud),
                false => self.on_event(st, s, kind, status, id, &private),
            }
        }
        Ok(())
    }

    fn on_event(
        &mut self,
        st: &mut State,
        s: &mut Rsock,
        kind: u32,
        status: i32,
        id: usize,
        private: &[u8],
    ) {
        if s.phase == Phase::Listening && id != s.id {
            // A request, or news of one not accepted yet.
            match kind {
                RDMA_CM_EVENT_CONNECT_REQUEST => match parse_private(private) {
                    Some(c) => s.pending.push_back((id, c)),
                    _ => {
                        let _ = self.reject(st, id, &[]);
                        let _ = self.destroy_id(st, id);
                    }
                },
                RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_REJECTED => {
                    if let Some(k) = s.pending.iter().position(|&(p, _)| p == id) {
                        s.pending.remove(k);
                        let _ = self.destroy_id(st, id);
                    }
                }
                _ => {}
            }
            return;
        }
        let fail = |s: &mut Rsock, e: i32| {
            if s.phase == Phase::Connecting {
                s.phase = Phase::Failed;
                s.err = e;
            }
        };
        match kind {
            RDMA_CM_EVENT_CONNECT_RESPONSE => {
                let up = (|| {
                    let credits = parse_private(private).ok_or(libc::EPROTO)?;
                    let (remote, opts, psn) = self.peer_of(s.id).ok_or(libc::EINVAL)?;
                    let c = s.conn.as_mut().ok_or(libc::EINVAL)?;
                    c.qp.connect(&remote, psn, &opts)
                        .map_err(|e| crate::errno_of(&e))?;
                    c.credits = credits;
                    self.establish(st, s.id)
                })();
                match up {
                    Ok(()) => s.phase = Phase::Connected,
                    Err(e) => {
                        let _ = self.disconnect(st, s.id);
                        fail(s, e);
                    }
                }
            }
            RDMA_CM_EVENT_ESTABLISHED => {
                if matches!(s.phase, Phase::Accepting | Phase::Connecting) {
                    s.phase = Phase::Connected;
                }
            }
            RDMA_CM_EVENT_REJECTED => fail(s, libc::ECONNREFUSED),
            RDMA_CM_EVENT_UNREACHABLE => fail(s, libc::ETIMEDOUT),
            RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => fail(s, libc::EHOSTUNREACH),
            RDMA_CM_EVENT_CONNECT_ERROR => fail(
                s,
                match -status {
                    e if e > 0 => e,
                    _ => libc::ECONNREFUSED,
                },
            ),
            RDMA_CM_EVENT_DISCONNECTED => {
                if let Some(c) = s.conn.as_mut() {
                    // What arrived before the peer closed stays readable.
                    c.poll(false);
                    c.gone = true;
                    let _ = c.qp.to_error();
                }
                fail(s, libc::ECONNRESET);
            }
            _ => {}
        }
    }

    /// Makes the connection's resources on NIC `nic` (its receives posted).
    fn new_conn(&mut self, st: &mut State, nic: usize, o: &Opts) -> Result<Conn, i32> {
        let e = |e: ringbell::Error| crate::errno_of(&e);
        let Bufs {
            mut qp,
            cq,
            pd,
            nsend,
            nrecv,
            sbuf,
            rbuf,
            smr,
            rmr,
        } = Bufs::new(st, nic, o, RESERVE, QpType::Rc)?;
        let sq_depth = nsend + RESERVE;
        // INIT, so that the receives can be posted before the connection is up.
        let init = QpAttr {
            state: QpState::Init as u8,
            access: Access::REMOTE_WRITE.bits().into(),
            ..Default::default()
        };
        use QpAttrMask as M;
        qp.modify(M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, &init)
            .map_err(e)?;
        let mut c = Conn {
            qp,
            cq,
            smr,
            rmr,
            maps: Vec::new(),
            sbuf,
            rbuf,
            _pd: pd,
            nsend,
            nrecv,
            free: (0..nsend).rev().collect(),
            inflight: 0,
            sq_depth,
            credits: 0,
            owed: 0,
            rx: VecDeque::new(),
            peer_maps: Vec::new(),
            fin_rcvd: false,
            fin_sent: false,
            shut_rd: false,
            shut_wr: false,
            gone: false,
            broken: false,
        };
        for slot in 0..nrecv + RESERVE {
            c.repost(slot)?;
        }
        Ok(c)
    }

    fn conn_param(credits: u32, qpn: u32) -> ConnParam {
        ConnParam {
            private: conn_private(credits),
            responder_resources: 0,
            initiator_depth: 0,
            retry_count: 7,
            rnr_retry_count: 7,
            qp_num: qpn,
        }
    }

    /// `rconnect`: starts connecting (the caller waits for [`Cma::rs_connected`] unless
    /// the socket is non-blocking); true when done at once (a datagram socket's).
    pub fn rs_connect(&mut self, st: &mut State, fd: i32, dst: SocketAddrV4) -> Result<bool, i32> {
        if self.sock(fd)?.dgram.is_some() {
            return self
                .with_sock(st, fd, |c, st, s| c.dg_connect(st, s, dst))
                .map(|()| true);
        }
        let (phase, id, opts, chan) = {
            let s = self.sock(fd)?;
            (s.phase, s.id, s.opts, s.chan)
        };
        match phase {
            Phase::Idle | Phase::Bound => {}
            Phase::Connecting => return Err(libc::EALREADY),
            Phase::Connected | Phase::Accepting => return Err(libc::EISCONN),
            Phase::Listening | Phase::Failed => return Err(libc::EINVAL),
        }
        if dst.ip().is_unspecified() || dst.port() == 0 {
            return Err(libc::EINVAL);
        }
        self.resolve_addr(st, id, None, dst)?;
        // Address and route resolution complete in the calls; an address off the fabric
        // leaves its error event.
        let mut resolved = false;
        while let Some(ev) = self.next_event(st, chan)? {
            let (kind, _, _) = self.event_info(ev as usize).unwrap_or_default();
            let _ = self.ack(ev as usize);
            match kind {
                RDMA_CM_EVENT_ADDR_RESOLVED => resolved = true,
                RDMA_CM_EVENT_ADDR_ERROR => return Err(libc::EHOSTUNREACH),
                _ => {}
            }
        }
        if !resolved {
            return Err(libc::EHOSTUNREACH);
        }
        self.resolve_route(id)?;
        while let Some(ev) = self.next_event(st, chan)? {
            let _ = self.ack(ev as usize);
        }
        let nic = self.id_nic(id).ok_or(libc::ENODEV)?;
        let conn = self.new_conn(st, nic, &opts)?;
        let param = Self::conn_param(conn.nrecv, conn.qp.qpn());
        let s = self.sock(fd)?;
        s.conn = Some(conn);
        s.phase = Phase::Connecting;
        if let Err(e) = self.connect(st, id, Some(param)) {
            let s = self.sock(fd)?;
            s.conn = None;
            s.phase = Phase::Failed;
            return Err(e);
        }
        Ok(false)
    }

    /// Where a connect stands: Ok(true) connected, Ok(false) still going, Err its error
    /// (taken: `SO_ERROR` reads 0 after it).
    pub fn rs_connected(&mut self, st: &mut State, fd: i32) -> Result<bool, i32> {
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        match s.phase {
            Phase::Connected | Phase::Accepting => Ok(true),
            Phase::Connecting => Ok(false),
            Phase::Failed => Err(match std::mem::take(&mut s.err) {
                0 => libc::ECONNREFUSED,
                e => e,
            }),
            _ => Err(libc::ENOTCONN),
        }
    }

    /// `raccept`: the next request, accepted on a new socket on descriptor `newfd`
    /// (the caller's); Ok(None) when none is waiting. Gives the peer's address.
    pub fn rs_accept(
        &mut self,
        st: &mut State,
        fd: i32,
        newfd: i32,
    ) -> Result<Option<SocketAddrV4>, i32> {
        if self.sock(fd)?.dgram.is_some() {
            return Err(libc::EOPNOTSUPP);
        }
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        if s.phase != Phase::Listening {
            return Err(libc::EINVAL);
        }
        let Some((child, credits)) = s.pending.pop_front() else {
            return Ok(None);
        };
        let (family, opts) = (s.family, s.opts);
        let r = self.accept_child(st, child, credits, newfd, family, opts);
        if r.is_err() {
            let _ = self.reject(st, child, &[]);
            let _ = self.destroy_id(st, child);
        }
        r.map(Some)
    }

    fn accept_child(
        &mut self,
        st: &mut State,
        child: usize,
        credits: u32,
        newfd: i32,
        family: i32,
        opts: Opts,
    ) -> Result<SocketAddrV4, i32> {
        let nic = self.id_nic(child).ok_or(libc::EINVAL)?;
        let mut conn = self.new_conn(st, nic, &opts)?;
        let param = Self::conn_param(conn.nrecv, conn.qp.qpn());
        // The QP is ready before the REP goes out: the peer may send as soon as it has it.
        let (remote, o, psn) = self.request_peer(st, child, conn.qp.qpn(), &param)?;
        conn.qp
            .connect(&remote, psn, &o)
            .map_err(|e| crate::errno_of(&e))?;
        conn.credits = credits;
        let chan = self.create_channel(newfd) as usize;
        self.migrate(child, chan)?;
        if let Err(e) = self.accept(st, child, Some(param)) {
            let _ = self.destroy_channel(chan);
            return Err(e);
        }
        let peer = self.addrs(child).map(|a| a.1).ok_or(libc::EINVAL)?;
        self.rs.socks.insert(
            newfd,
            Rsock {
                family,
                nonblock: false,
                chan,
                id: child,
                phase: Phase::Accepting,
                err: 0,
                opts,
                pending: VecDeque::new(),
                conn: Some(conn),
                dgram: None,
                passes: 0,
            },
        );
        Ok(peer)
    }

    /// `rsend` and friends: bytes of `data` sent now (Ok(0) with `data` not empty: none
    /// could go yet).
    pub fn rs_send(&mut self, st: &mut State, fd: i32, data: &[u8]) -> Result<usize, i32> {
        if self.sock(fd)?.dgram.is_some() {
            return self.rs_sendto(st, fd, data, None);
        }
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        let c = match (s.phase, s.conn.as_mut()) {
            (Phase::Connected | Phase::Accepting, Some(c)) => c,
            (Phase::Connecting, _) => return Ok(0),
            _ => return Err(libc::ENOTCONN),
        };
        if c.shut_wr || c.gone || c.fin_sent {
            return Err(libc::EPIPE);
        }
        if c.broken {
            return Err(libc::ECONNRESET);
        }
        if s.phase == Phase::Accepting {
            // The peer's QP is ready once its RTU is out: wait for it.
            return Ok(0);
        }
        c.send_some(data)
    }

    /// `rrecv` and friends: Ok(Some(n)) bytes copied (0: end of stream), Ok(None) nothing
    /// yet.
    pub fn rs_recv(
        &mut self,
        st: &mut State,
        fd: i32,
        out: &mut [u8],
        peek: bool,
    ) -> Result<Option<(usize, Option<SocketAddrV4>)>, i32> {
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        if let Some(d) = s.dgram.as_mut() {
            return Ok(d.recv(out, peek).map(|(n, from)| (n, Some(from))));
        }
        let c = match (s.phase, s.conn.as_mut()) {
            (Phase::Connected | Phase::Accepting, Some(c)) => c,
            (Phase::Connecting, _) => return Ok(None),
            (Phase::Failed, Some(c)) if c.gone => c,
            _ => return Err(libc::ENOTCONN),
        };
        if out.is_empty() || c.shut_rd {
            return Ok(Some((0, None)));
        }
        let n = c.recv_some(out, peek);
        if n > 0 {
            return Ok(Some((n, None)));
        }
        if c.fin_rcvd || c.gone {
            return Ok(Some((0, None)));
        }
        if c.broken {
            return Err(libc::ECONNRESET);
        }
        Ok(None)
    }

    /// Whether the socket is non-blocking (`O_NONBLOCK`).
    pub fn rs_nonblock(&self, fd: i32) -> Result<bool, i32> {
        self.rs
            .socks
            .get(&fd)
            .map(|s| s.nonblock)
            .ok_or(libc::EBADF)
    }

    /// `rfcntl(F_SETFL)`.
    pub fn rs_set_nonblock(&mut self, fd: i32, on: bool) -> Result<(), i32> {
        self.sock(fd)?.nonblock = on;
        Ok(())
    }

    /// `rshutdown`.
    pub fn rs_shutdown(&mut self, st: &mut State, fd: i32, how: i32) -> Result<(), i32> {
        if let Some(d) = self.sock(fd)?.dgram.as_ref() {
            return match (how, d.peer) {
                (libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR, Some(_)) => Ok(()),
                (libc::SHUT_RD | libc::SHUT_WR | libc::SHUT_RDWR, None) => Err(libc::ENOTCONN),
                _ => Err(libc::EINVAL),
            };
        }
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        let (rd, wr) = match how {
            libc::SHUT_RD => (true, false),
            libc::SHUT_WR => (false, true),
            libc::SHUT_RDWR => (true, true),
            _ => return Err(libc::EINVAL),
        };
        let c = match (s.phase, s.conn.as_mut()) {
            (Phase::Connected | Phase::Accepting, Some(c)) => c,
            (Phase::Failed, Some(c)) if c.gone => c,
            _ => return Err(libc::ENOTCONN),
        };
        c.shut_rd |= rd;
        if wr {
            c.shut_wr = true;
            if !c.fin_sent && !c.gone && !c.broken {
                c.control(Kind::Fin)?;
                c.fin_sent = true;
            }
        }
        Ok(())
    }

    /// `rclose`, first part: the FIN goes out after what was sent. Ok(true) when the
    /// socket has nothing left in flight (the caller then calls [`Cma::rs_close`]).
    pub fn rs_drain(&mut self, st: &mut State, fd: i32) -> Result<bool, i32> {
        if self.sock(fd)?.dgram.is_some() {
            return self.rs_waiting(st, fd).map(|w| !w);
        }
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        let Some(c) = s.conn.as_mut() else {
            return Ok(true);
        };
        if c.gone || c.broken || !matches!(s.phase, Phase::Connected | Phase::Accepting) {
            return Ok(true);
        }
        if !c.fin_sent {
            if c.inflight >= c.sq_depth {
                return Ok(false);
            }
            c.shut_wr = true;
            c.control(Kind::Fin)?;
            c.fin_sent = true;
        }
        Ok(c.inflight == 0)
    }

    /// `rclose`, last part: the connection closed, the socket gone; its descriptor is
    /// the caller's to close.
    pub fn rs_close(&mut self, st: &mut State, fd: i32) -> Result<(), i32> {
        if let Some(d) = self.sock(fd)?.dgram.as_ref() {
            let ids: Vec<usize> = d.resolving.keys().copied().collect();
            for id in ids {
                let _ = self.destroy_id(st, id);
            }
        }
        let s = self.rs.socks.remove(&fd).ok_or(libc::EBADF)?;
        for (id, _) in &s.pending {
            let _ = self.reject(st, *id, &[]);
            let _ = self.destroy_id(st, *id);
        }
        if matches!(s.phase, Phase::Connected | Phase::Accepting) {
            let _ = self.disconnect(st, s.id);
        }
        let _ = self.destroy_id(st, s.id);
        let _ = self.destroy_channel(s.chan);
        drop(s);
        Ok(())
    }

    /// `rpoll`'s view of socket `fd`: which of `events` (and POLLERR, POLLHUP) hold.
    pub fn rs_ready(&mut self, st: &mut State, fd: i32, events: i16) -> Result<i16, i32> {
        self.rs_pump(st, fd)?;
        if let Some(d) = self.sock(fd)?.dgram.as_ref() {
            return Ok(d.ready() & (events | libc::POLLERR | libc::POLLHUP));
        }
        let s = self.sock(fd)?;
        let mut r = 0i16;
        match (s.phase, s.conn.as_ref()) {
            (Phase::Listening, _) if !s.pending.is_empty() => r |= POLLIN,
            (Phase::Failed, c) => {
                if c.is_some_and(|c| c.gone) {
                    r |= POLLIN | libc::POLLHUP;
                } else {
                    r |= POLLOUT | libc::POLLERR;
                }
            }
            (Phase::Connected | Phase::Accepting, Some(c)) => {
                if !c.rx.is_empty() || c.fin_rcvd || c.gone || c.shut_rd || c.broken {
                    r |= POLLIN;
                }
                if s.phase == Phase::Connected && (c.can_send() || c.shut_wr || c.gone) {
                    r |= POLLOUT;
                }
                // Hung up once everything the peer sent before closing is read (rpoll's
                // callers stop at POLLHUP).
                if c.gone && c.rx.is_empty() {
                    r |= libc::POLLHUP;
                }
                if c.broken {
                    r |= libc::POLLERR;
                }
            }
            _ => {}
        }
        Ok(r & (events | libc::POLLERR | libc::POLLHUP))
    }

    /// `rgetsockname`.
    pub fn rs_sockname(&self, fd: i32) -> Result<SocketAddrV4, i32> {
        if let Some(d) = self.rs.socks.get(&fd).and_then(|s| s.dgram.as_ref()) {
            return Ok(d
                .bound
                .unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)));
        }
        let s = self.rs.socks.get(&fd).ok_or(libc::EBADF)?;
        Ok(self
            .addrs(s.id)
            .map(|a| a.0)
            .unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)))
    }

    /// `rgetpeername`.
    pub fn rs_peername(&self, fd: i32) -> Result<SocketAddrV4, i32> {
        if let Some(d) = self.rs.socks.get(&fd).and_then(|s| s.dgram.as_ref()) {
            return d.peer.ok_or(libc::ENOTCONN);
        }
        let s = self.rs.socks.get(&fd).ok_or(libc::EBADF)?;
        match s.phase {
            Phase::Connected | Phase::Accepting => {
                self.addrs(s.id).map(|a| a.1).ok_or(libc::ENOTCONN)
            }
            _ => Err(libc::ENOTCONN),
        }
    }

    /// `rsetsockopt` of an `int` option (sizes apply to the socket's next connection).
    pub fn rs_setopt(&mut self, fd: i32, level: i32, name: i32, v: i32) -> Result<(), i32> {
        let s = self.sock(fd)?;
        let o = &mut s.opts;
        let flag = matches!(
            (level, name),
            (
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR | libc::SO_KEEPALIVE | libc::SO_OOBINLINE
            ) | (libc::IPPROTO_TCP, libc::TCP_NODELAY)
                | (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)
        );
        // A negative size or count is refused, as the kernel refuses it.
        if v < 0 && !flag {
            return Err(libc::EINVAL);
        }
        let slot = match (level, name) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => &mut o.reuseaddr,
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => &mut o.keepalive,
            (libc::SOL_SOCKET, libc::SO_OOBINLINE) => &mut o.oobinline,
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => &mut o.sndbuf,
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => &mut o.rcvbuf,
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => &mut o.nodelay,
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => &mut o.maxseg,
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => &mut o.keepidle,
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => &mut o.v6only,
            (SOL_RDMA, RDMA_SQSIZE) => &mut o.sqsize,
            (SOL_RDMA, RDMA_RQSIZE) => &mut o.rqsize,
            (SOL_RDMA, RDMA_INLINE) => &mut o.inline,
            (SOL_RDMA, RDMA_IOMAPSIZE) => &mut o.iomapsize,
            _ => return Err(libc::ENOPROTOOPT),
        };
        *slot = match (level, name) {
            (SOL_RDMA, RDMA_IOMAPSIZE) => v.min(MAX_IOMAPS),
            _ => v,
        };
        Ok(())
    }

    /// `rsetsockopt(SO_LINGER)`.
    pub fn rs_set_linger(&mut self, fd: i32, on: i32, secs: i32) -> Result<(), i32> {
        self.sock(fd)?.opts.linger = (on, secs);
        Ok(())
    }

    /// `rgetsockopt` of an `int` option (`SO_ERROR` is taken).
    pub fn rs_getopt(&mut self, fd: i32, level: i32, name: i32) -> Result<i32, i32> {
        let s = self.sock(fd)?;
        let o = &s.opts;
        let (nsend, nrecv) = match &s.conn {
            Some(c) => (c.nsend, c.nrecv),
            None => (slots(o.sndbuf, o.sqsize), slots(o.rcvbuf, o.rqsize)),
        };
        Ok(match (level, name) {
            (libc::SOL_SOCKET, libc::SO_ERROR) => std::mem::take(&mut s.err),
            (libc::SOL_SOCKET, libc::SO_TYPE) => match s.dgram {
                Some(_) => libc::SOCK_DGRAM,
                None => libc::SOCK_STREAM,
            },
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => o.reuseaddr,
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => o.keepalive,
            (libc::SOL_SOCKET, libc::SO_OOBINLINE) => o.oobinline,
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => (nsend as usize * SLOT) as i32,
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => (nrecv as usize * SLOT) as i32,
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => o.nodelay,
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => o.maxseg,
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => o.keepidle,
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => o.v6only,
            (SOL_RDMA, RDMA_SQSIZE) => nsend as i32,
            (SOL_RDMA, RDMA_RQSIZE) => nrecv as i32,
            (SOL_RDMA, RDMA_INLINE) => o.inline,
            (SOL_RDMA, RDMA_IOMAPSIZE) => o.iomapsize,
            _ => return Err(libc::ENOPROTOOPT),
        })
    }

    /// `rgetsockopt(SO_LINGER)`.
    pub fn rs_linger(&self, fd: i32) -> Result<(i32, i32), i32> {
        self.rs
            .socks
            .get(&fd)
            .map(|s| s.opts.linger)
            .ok_or(libc::EBADF)
    }

    /// `riomap` with a region the caller registered on the socket's NIC: announces it to
    /// the peer at `offset` (-1: the next free one). Gives the offset.
    pub fn rs_iomap(
        &mut self,
        st: &mut State,
        fd: i32,
        offset: i64,
        mr: MemoryRegion,
        len: u64,
        user: u64,
    ) -> Result<u64, i32> {
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        let limit = s.opts.iomapsize;
        let c = match (s.phase, s.conn.as_mut()) {
            (Phase::Connected | Phase::Accepting, Some(c)) if !c.gone && !c.broken => c,
            _ => return Err(libc::ENOTCONN),
        };
        if c.maps.len() >= limit.max(0) as usize {
            return Err(libc::ENOMEM);
        }
        let off = match offset {
            -1 => c
                .maps
                .iter()
                .map(|(o, m, _)| o + m.len())
                .max()
                .unwrap_or(0),
            o if o >= 0 => o as u64,
            _ => return Err(libc::EINVAL),
        };
        // The offset range fits 64 bits (as every mapping's does) and overlaps no other.
        let end = off.checked_add(len).ok_or(libc::EINVAL)?;
        if c.maps.iter().any(|(o, m, _)| off < o + m.len() && *o < end) {
            return Err(libc::EINVAL);
        }
        // The notice goes in the stream's order, into one of the peer's reserved slots.
        if c.free.is_empty() || c.inflight >= c.sq_depth {
            return Err(libc::EAGAIN);
        }
        let n = Notice {
            offset: off,
            addr: mr.addr(),
            len,
            rkey: mr.rkey(),
        };
        c.notice(&n.emit())?;
        c.maps.push((off, mr, user));
        Ok(off)
    }

    /// `riounmap`: the mapping of the caller's `[user, user + len)` goes (the peer is
    /// told); the region is handed back to be dropped.
    pub fn rs_iounmap(&mut self, st: &mut State, fd: i32, user: u64) -> Result<(), i32> {
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        let c = s.conn.as_mut().ok_or(libc::EINVAL)?;
        let k = c
            .maps
            .iter()
            .position(|m| m.2 == user)
            .ok_or(libc::EINVAL)?;
        let (off, _mr, _) = c.maps.remove(k);
        if !c.gone && !c.broken && !c.free.is_empty() && c.inflight < c.sq_depth {
            let end = Notice {
                offset: off,
                addr: 0,
                len: 0,
                rkey: 0,
            };
            let _ = c.notice(&end.emit());
        }
        Ok(())
    }

    /// The PD a `riomap` region must be registered with.
    pub fn rs_pd(&self, fd: i32) -> Result<ProtectionDomain, i32> {
        let s = self.rs.socks.get(&fd).ok_or(libc::EBADF)?;
        s.conn.as_ref().map(|c| c._pd.clone()).ok_or(libc::ENOTCONN)
    }

    /// `riowrite`: Ok(n) bytes of `data` written into the peer's mapping at `offset`
    /// now (0: no room yet).
    pub fn rs_iowrite(
        &mut self,
        st: &mut State,
        fd: i32,
        data: &[u8],
        offset: u64,
    ) -> Result<usize, i32> {
        self.rs_pump(st, fd)?;
        let s = self.sock(fd)?;
        let c = match (s.phase, s.conn.as_mut()) {
            (Phase::Connected, Some(c)) => c,
            (Phase::Accepting | Phase::Connecting, Some(_)) => return Ok(0),
            _ => return Err(libc::ENOTCONN),
        };
        if c.shut_wr || c.gone {
            return Err(libc::EPIPE);
        }
        let len = data.len() as u64;
        let m = c
            .peer_maps
            .iter()
            .find(|m| m.covers(offset, len))
            .copied()
            .ok_or(libc::EINVAL)?;
        let mut sent = 0usize;
        while sent < data.len() && !c.free.is_empty() && c.inflight < c.sq_depth {
            let n = (data.len() - sent).min(SLOT);
            let remote = RemoteAddr {
                addr: m.addr + (offset - m.offset) + sent as u64,
                rkey: m.rkey,
            };
            if let Err(e) = c
                .slots()
                .post(&[&data[sent..sent + n]], WrOp::Write(remote), None)
            {
                return match sent {
                    0 => Err(e),
                    _ => Ok(sent),
                };
            }
            c.inflight += 1;
            sent += n;
        }
        Ok(sent)
    }
}

impl Conn {
    /// Sends a mapping notice (`K_IOMAP`) of `b` from a slot (into one of the peer's
    /// reserved receives, which it reposts at once: no credit).
    fn notice(&mut self, b: &[u8]) -> Result<(), i32> {
        let op = WrOp::SendImm(imm(Kind::Iomap, self.owed));
        self.slots().post(&[b], op, None)?;
        self.owed = 0;
        self.inflight += 1;
        Ok(())
    }
}

/// Datagrams waiting for their destination's QP to be resolved, at most.
const MAX_WAITING: usize = 64;
/// A received datagram's bytes before its header (the GRH area of a UD receive).
const DG_SKIP: usize = ringbell::GRH_LEN + DGRAM_HEADER;
/// The largest datagram payload.
pub const MAX_DATAGRAM: usize = ringbell::UD_MAX_PAYLOAD as usize - DGRAM_HEADER;

/// A datagram socket (`SOCK_DGRAM`): a UD QP on one NIC, its port listening in RDMA-CM's
/// UDP port space, so that a sender resolves (port → QPN) by service id resolution.
#[derive(Default)]
struct Dgram {
    /// The address as bound (the program's view), once bound.
    bound: Option<SocketAddrV4>,
    /// The connected peer (`rconnect`): the default destination and the only source.
    peer: Option<SocketAddrV4>,
    res: Option<DgRes>,
    /// Resolutions under way: RDMA-CM id → destination.
    resolving: BTreeMap<usize, SocketAddrV4>,
    /// Datagrams for destinations being resolved, in order.
    waiting: VecDeque<(SocketAddrV4, Vec<u8>)>,
    /// Received: (slot, payload length, source).
    rx: VecDeque<(u32, u32, SocketAddrV4)>,
}

/// A datagram socket's resources (fields drop in order: the QP before its CQ, the address
/// handles and regions before the PD).
struct DgRes {
    qp: QueuePair,
    cq: CompletionQueue,
    /// Resolved destinations: address handle, QPN, Q_Key.
    peers: BTreeMap<SocketAddrV4, (AddressHandle, u32, u32)>,
    smr: MemoryRegion,
    rmr: MemoryRegion,
    sbuf: DmaBuffer,
    rbuf: DmaBuffer,
    pd: ProtectionDomain,
    port: u16,
    nsend: u32,
    free: Vec<u32>,
    inflight: u32,
    sq_depth: u32,
}

impl DgRes {
    fn repost(&mut self, slot: u32) {
        let sge = [self.rmr.sge(u64::from(slot) * SLOT as u64, SLOT as u32)];
        let _ = self.qp.post_recv(&[RecvWr {
            wr_id: u64::from(slot),
            sgl: &sge,
        }]);
    }

    fn can_post(&self) -> bool {
        !self.free.is_empty() && self.inflight < self.sq_depth
    }

    /// Sends `data` to resolved `dst` (false: no slot free now).
    fn post(&mut self, dst: SocketAddrV4, data: &[u8]) -> Result<bool, i32> {
        let Some((ah, qpn, qkey)) = self.peers.get(&dst) else {
            return Err(libc::EHOSTUNREACH);
        };
        if !self.can_post() {
            return Ok(false);
        }
        let dest = UdDest {
            ah,
            qpn: *qpn,
            qkey: *qkey,
        };
        let head = dgram_header(self.port);
        let mut slots = SendSlots {
            qp: &mut self.qp,
            sbuf: &self.sbuf,
            smr: &self.smr,
            free: &mut self.free,
        };
        slots.post(&[&head, data], WrOp::Send, Some(dest))?;
        self.inflight += 1;
        Ok(true)
    }
}

/// Reads `cq` (`sleeper`: see [`Rsockets::sleeper`]; a device in lockstep is given its turn
/// whatever the caller, as it moves only when polled).
fn take(cq: &mut CompletionQueue, wc: &mut [WorkCompletion], sleeper: bool) -> usize {
    match sleeper && !cq.lockstep() {
        true => cq.poll_ready(wc),
        false => cq.poll(wc),
    }
}

impl Dgram {
    /// Takes the completions the CQ holds: sends free their slots, received datagrams
    /// of this library from the peer (if connected) queue (`sleeper`: see
    /// [`Rsockets::sleeper`]).
    fn poll(&mut self, sleeper: bool) {
        let Some(r) = self.res.as_mut() else { return };
        let mut wc = [WorkCompletion::default(); 32];
        loop {
            let n = take(&mut r.cq, &mut wc, sleeper);
            for w in &wc[..n] {
                let slot = w.wr_id as u32;
                if w.opcode == WcOpcode::Send {
                    r.inflight = r.inflight.saturating_sub(1);
                    if slot < r.nsend {
                        r.free.push(slot);
                    }
                    continue;
                }
                if w.status != WcStatus::Success {
                    continue;
                }
                let mut head = [0u8; DGRAM_HEADER];
                let at = slot as usize * SLOT + ringbell::GRH_LEN;
                let from = (w.byte_len as usize >= DG_SKIP)
                    .then(|| r.rbuf.read(at, &mut head).ok())
                    .flatten()
                    .and_then(|()| parse_dgram_header(&head))
                    .zip(w.source)
                    .map(|(port, src)| SocketAddrV4::new(Ipv4Addr::from(src.ip), port));
                match from {
                    Some(f) if self.peer.is_none_or(|p| p == f) => {
                        self.rx.push_back((slot, w.byte_len - DG_SKIP as u32, f))
                    }
                    _ => r.repost(slot),
                }
            }
            if n < wc.len() {
                break;
            }
        }
    }

    /// Sends what waits for destinations now resolved, in order, while slots allow.
    fn flush(&mut self) {
        let Some(r) = self.res.as_mut() else { return };
        while let Some((dst, _)) = self.waiting.front() {
            if !r.peers.contains_key(dst) || !r.can_post() {
                break;
            }
            let (dst, data) = self.waiting.pop_front().expect("looked at above");
            let _ = r.post(dst, &data);
        }
    }

    /// Copies the next datagram into `out` (the rest of a longer one is dropped, as a
    /// datagram socket drops it): its length copied and its source.
    fn recv(&mut self, out: &mut [u8], peek: bool) -> Option<(usize, SocketAddrV4)> {
        let r = self.res.as_mut()?;
        let &(slot, len, from) = self.rx.front()?;
        let n = (len as usize).min(out.len());
        let _ = r.rbuf.read(slot as usize * SLOT + DG_SKIP, &mut out[..n]);
        if !peek {
            self.rx.pop_front();
            r.repost(slot);
        }
        Some((n, from))
    }

    fn ready(&self) -> i16 {
        let mut r = 0;
        if !self.rx.is_empty() {
            r |= POLLIN;
        }
        if self.res.as_ref().is_none_or(DgRes::can_post) && self.waiting.len() < MAX_WAITING {
            r |= POLLOUT;
        }
        r
    }
}

impl Cma {
    /// Binds datagram socket `s`: its port listens in the UDP port space of its NIC (the
    /// address's; the unspecified or a loopback address: the process's first NIC), and its
    /// UD QP is made.
    fn dg_bind(&mut self, st: &mut State, s: &mut Rsock, addr: SocketAddrV4) -> Result<(), i32> {
        if s.dgram.as_ref().is_some_and(|d| d.bound.is_some()) {
            return Err(libc::EINVAL);
        }
        // The unspecified and loopback addresses take the first NIC, as the kernel's
        // rdma_cm binds a loopback address to its first device.
        let nic = match addr.ip().is_unspecified() || addr.ip().is_loopback() {
            true => *Self::local_nics(st).first().ok_or(libc::ENODEV)?,
            false => Self::nic_with(st, *addr.ip()).ok_or(libc::EADDRNOTAVAIL)?,
        };
        let ip = Self::nic_ip(st, nic).ok_or(libc::ENODEV)?;
        self.bind(st, s.id, SocketAddrV4::new(ip, addr.port()))?;
        let port = self.addrs(s.id).map(|a| a.0.port()).ok_or(libc::EINVAL)?;
        self.listen(st, s.id, 0)?;
        let res = self.dg_res(st, nic, &s.opts, port)?;
        self.answer_with(s.id, res.qp.qpn());
        let d = s.dgram.as_mut().ok_or(libc::EINVAL)?;
        d.res = Some(res);
        d.bound = Some(SocketAddrV4::new(*addr.ip(), port));
        s.phase = Phase::Bound;
        Ok(())
    }

    fn dg_res(&mut self, st: &mut State, nic: usize, o: &Opts, port: u16) -> Result<DgRes, i32> {
        let e = |e: ringbell::Error| crate::errno_of(&e);
        let Bufs {
            mut qp,
            cq,
            pd,
            nsend,
            nrecv,
            sbuf,
            rbuf,
            smr,
            rmr,
        } = Bufs::new(st, nic, o, 0, QpType::Ud)?;
        qp.ud_ready(crate::cma::RDMA_UDP_QKEY, 0).map_err(e)?;
        let mut r = DgRes {
            qp,
            cq,
            peers: BTreeMap::new(),
            smr,
            rmr,
            sbuf,
            rbuf,
            pd,
            port,
            nsend,
            free: (0..nsend).rev().collect(),
            inflight: 0,
            sq_depth: nsend,
        };
        for slot in 0..nrecv {
            r.repost(slot);
        }
        Ok(r)
    }

    /// `rconnect` on a datagram socket: the default destination and only source.
    fn dg_connect(&mut self, st: &mut State, s: &mut Rsock, dst: SocketAddrV4) -> Result<(), i32> {
        if dst.ip().is_unspecified() || dst.port() == 0 {
            return Err(libc::EINVAL);
        }
        if s.dgram.as_ref().is_some_and(|d| d.bound.is_none()) {
            self.dg_bind(st, s, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        }
        let d = s.dgram.as_mut().ok_or(libc::EINVAL)?;
        d.peer = Some(dst);
        // Datagrams from others, queued already, go.
        if let Some(r) = d.res.as_mut() {
            d.rx.retain(|&(slot, _, from)| {
                let keep = from == dst;
                if !keep {
                    r.repost(slot);
                }
                keep
            });
        }
        Ok(())
    }

    /// Runs `f` for a call that, when `sleeps`, sleeps on the sockets' NIC's interrupt (see
    /// [`Cma::rs_arm`]) if `f` finds nothing to do: its polls of the sockets' CQs skip the
    /// turn a poll gives a served NIC when it finds nothing, a nap of tens of µs before
    /// every sleep. A call that returns empty-handed instead (a non-blocking one, which a
    /// program calls again at once) keeps the turn, which lets the server run when
    /// programs spin on both cores.
    pub fn rs_sleeping<R>(
        &mut self,
        st: &mut State,
        sleeps: bool,
        f: impl FnOnce(&mut Cma, &mut State) -> R,
    ) -> R {
        self.rs.sleeper = sleeps;
        let r = f(self, st);
        self.rs.sleeper = false;
        r
    }

    /// Readies sockets `fds` for a sleep until something happens to them, and gives the
    /// descriptor to sleep on: the interrupt of the one served NIC they are all on, with
    /// their CQs and that NIC's CM armed (an arm with completions waiting fires at once, so
    /// nothing that came since the sockets were last looked at is slept through) and the
    /// NIC's event queue drained first (its events routed, as every verbs call routes
    /// them). None (the caller naps instead) on the in-process fabric, which moves only
    /// when called, and for sockets on no NIC yet or on several.
    pub fn rs_arm(&mut self, st: &mut State, fds: &[i32]) -> Option<i32> {
        let mut nic = None;
        for fd in fds {
            let n = self.id_nic(self.rs.socks.get(fd)?.id)?;
            if nic.is_some_and(|m| m != n) {
                return None;
            }
            nic = Some(n);
        }
        let nic = nic?;
        let dev = st.nics.get(nic)?.dev.clone()?;
        let irq = dev.port().interrupt_fd(0)?.as_raw_fd();
        crate::events::pump(st, nic);
        for fd in fds {
            let Some(s) = self.rs.socks.get(fd) else {
                continue;
            };
            if let Some(k) = &s.conn {
                k.cq.arm(false);
            }
            if let Some(r) = s.dgram.as_ref().and_then(|d| d.res.as_ref()) {
                r.cq.arm(false);
            }
        }
        // Connection requests and replies, SIDR answers and disconnects come to the CM.
        self.arm_cm(nic).then_some(irq)
    }

    /// Whether datagrams of socket `fd` wait for their destination's resolution (after
    /// driving it).
    pub fn rs_waiting(&mut self, st: &mut State, fd: i32) -> Result<bool, i32> {
        self.rs_pump(st, fd)?;
        Ok(self
            .sock(fd)?
            .dgram
            .as_ref()
            .is_some_and(|d| !d.waiting.is_empty()))
    }

    /// `rsendto` (`dst` None: the connected peer): Ok(the length) once the datagram is
    /// sent or waits for its destination's resolution, Ok(0) when no slot is free now.
    pub fn rs_sendto(
        &mut self,
        st: &mut State,
        fd: i32,
        data: &[u8],
        dst: Option<SocketAddrV4>,
    ) -> Result<usize, i32> {
        self.rs_pump(st, fd)?;
        self.with_sock(st, fd, |c, st, s| {
            let Some(d) = s.dgram.as_ref() else {
                // A stream's destination is its peer.
                return Err(libc::EISCONN);
            };
            let dst = dst.or(d.peer).ok_or(libc::EDESTADDRREQ)?;
            if data.len() > MAX_DATAGRAM {
                return Err(libc::EMSGSIZE);
            }
            if dst.ip().is_unspecified() || dst.port() == 0 {
                return Err(libc::EINVAL);
            }
            if d.bound.is_none() {
                c.dg_bind(st, s, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
            }
            let d = s.dgram.as_mut().ok_or(libc::EINVAL)?;
            let r = d.res.as_mut().ok_or(libc::EINVAL)?;
            if r.peers.contains_key(&dst) && !d.waiting.iter().any(|w| w.0 == dst) {
                return Ok(match r.post(dst, data)? {
                    true => data.len(),
                    false => 0,
                });
            }
            if d.waiting.len() >= MAX_WAITING {
                return Ok(0);
            }
            if !r.peers.contains_key(&dst) && !d.resolving.values().any(|&v| v == dst) {
                // Which QP serves the port: service id resolution from a CM id of the
                // socket's channel (its answer comes as an event).
                let id = c.create_id(s.chan, std::ptr::null_mut(), RDMA_PS_UDP)? as usize;
                let started = c
                    .resolve_addr(st, id, None, dst)
                    .and_then(|()| c.resolve_route(id))
                    .and_then(|()| c.connect(st, id, None));
                if let Err(e) = started {
                    let _ = c.destroy_id(st, id);
                    return Err(match e {
                        libc::EINVAL => libc::EHOSTUNREACH,
                        e => e,
                    });
                }
                let d = s.dgram.as_mut().ok_or(libc::EINVAL)?;
                d.resolving.insert(id, dst);
            }
            let d = s.dgram.as_mut().ok_or(libc::EINVAL)?;
            d.waiting.push_back((dst, data.to_vec()));
            Ok(data.len())
        })
    }

    /// An RDMA-CM event on a datagram socket's channel: the answer to one of its own
    /// resolutions.
    fn dg_event(
        &mut self,
        st: &mut State,
        s: &mut Rsock,
        kind: u32,
        id: usize,
        ud: Option<(u32, u32)>,
    ) {
        let Some(d) = s.dgram.as_mut() else { return };
        if kind == RDMA_CM_EVENT_CONNECT_REQUEST {
            // (A bound socket's port is answered by RDMA-CM itself with its QP; this is a
            // socket whose QP could not be made.)
            let _ = self.reject(st, id, &[]);
            let _ = self.destroy_id(st, id);
            return;
        }
        let Some(dst) = d.resolving.get(&id).copied() else {
            return;
        };
        match kind {
            RDMA_CM_EVENT_ESTABLISHED => {
                if let (Some(r), Some((qpn, qkey))) = (d.res.as_mut(), ud) {
                    let ah = ringbell::AhAttr::on_fabric(dst.ip().octets())
                        .and_then(|a| r.pd.create_ah(&a).ok());
                    if let Some(ah) = ah {
                        r.peers.insert(dst, (ah, qpn, qkey));
                    }
                }
            }
            RDMA_CM_EVENT_ADDR_RESOLVED | RDMA_CM_EVENT_ROUTE_RESOLVED => return,
            // Refused, unreachable, no such port: what waited for it is lost, as a
            // datagram to nobody is.
            _ => {}
        }
        d.resolving.remove(&id);
        if d.res.as_ref().is_none_or(|r| !r.peers.contains_key(&dst)) {
            d.waiting.retain(|w| w.0 != dst);
        }
        let _ = self.destroy_id(st, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cma_entry::call;
    use proptest::prelude::*;

    /// What a test does next on a connected pair (a: the connecting side, b: the
    /// accepted one).
    #[derive(Clone, Debug)]
    enum Op {
        /// a sends this many bytes (what fits now).
        SendA(usize),
        /// b sends this many bytes.
        SendB(usize),
        /// b receives at most this many (peeking first when the flag is set).
        RecvB(usize, bool),
        /// a receives at most this many.
        RecvA(usize, bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..40_000).prop_map(Op::SendA),
            (1usize..40_000).prop_map(Op::SendB),
            (1usize..40_000, any::<bool>()).prop_map(|(n, p)| Op::RecvB(n, p)),
            (1usize..40_000, any::<bool>()).prop_map(|(n, p)| Op::RecvA(n, p)),
        ]
    }

    /// The stream's byte `i` one way (`dir` 0 or 1).
    fn byte(dir: u8, i: usize) -> u8 {
        (i as u8)
            .wrapping_mul(31)
            .wrapping_add(dir)
            .wrapping_add((i >> 8) as u8)
    }

    /// The reference model of one direction: bytes sent and bytes received so far.
    #[derive(Default)]
    struct Way {
        sent: usize,
        got: usize,
    }

    fn run<R>(f: impl FnOnce(&mut Cma, &mut State) -> Result<R, i32>) -> Result<R, i32> {
        call(Err(libc::EIO), f)
    }

    /// Descriptors for the test's sockets (keys only: the logic never reads them).
    static NEXT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(1 << 20);
    fn fd() -> i32 {
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// A connected, non-blocking pair on the in-process fabric's two NICs, with four
    /// slots each way (so that credits run out): (a, b, listener).
    fn pair(port: u16) -> (i32, i32, i32) {
        let (l, a, b) = (fd(), fd(), fd());
        let small = 4 * SLOT as i32;
        run(|c, st| {
            for s in [l, a] {
                c.rs_socket(s, libc::AF_INET, true, false)?;
                c.rs_setopt(s, libc::SOL_SOCKET, libc::SO_SNDBUF, small)?;
                c.rs_setopt(s, libc::SOL_SOCKET, libc::SO_RCVBUF, small)?;
            }
            c.rs_bind(st, l, SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), port))?;
            c.rs_listen(st, l, 4)?;
            c.rs_connect(st, a, SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), port))
        })
        .expect("set-up");
        let mut accepted = false;
        for _ in 0..10_000 {
            if !accepted {
                accepted = run(|c, st| c.rs_accept(st, l, b))
                    .expect("accept")
                    .is_some();
            }
            if accepted && run(|c, st| c.rs_connected(st, a)).expect("connect") {
                // b's side is up once its ESTABLISHED is seen: sending waits for it.
                return (a, b, l);
            }
        }
        panic!("no connection");
    }

    /// Receives into a fresh buffer: the bytes, or None (nothing yet).
    fn recv(s: i32, max: usize, peek: bool) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; max];
        match run(|c, st| c.rs_recv(st, s, &mut buf, peek)).expect("recv") {
            Some((n, _)) => {
                buf.truncate(n);
                Some(buf)
            }
            None => None,
        }
    }

    fn check(dir: u8, w: &mut Way, got: &[u8], consume: bool) -> Result<(), TestCaseError> {
        prop_assert!(w.got + got.len() <= w.sent, "more received than sent");
        for (k, &v) in got.iter().enumerate() {
            prop_assert_eq!(
                v,
                byte(dir, w.got + k),
                "byte {} one way {}",
                w.got + k,
                dir
            );
        }
        if consume {
            w.got += got.len();
        }
        Ok(())
    }

    static PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(40_000);

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Whatever the sizes and order of sends, receives and peeks, each way delivers every
        /// byte sent exactly once, in order (a peek shows what the next receive takes), and
        /// after both ends shut down writing each reads the rest, then the end of stream.
        #[test]
        fn a_stream_delivers_every_byte_once_in_order(ops in prop::collection::vec(op(), 1..40)) {
            let port = PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (a, b, l) = pair(port);
            let (mut ab, mut ba) = (Way::default(), Way::default());
            let send = |s: i32, dir: u8, w: &mut Way, n: usize| {
                let data: Vec<u8> = (w.sent..w.sent + n).map(|i| byte(dir, i)).collect();
                let k = run(|c, st| c.rs_send(st, s, &data)).expect("send");
                assert!(k <= n);
                w.sent += k;
            };
            for o in ops {
                match o {
                    Op::SendA(n) => send(a, 0, &mut ab, n),
                    Op::SendB(n) => send(b, 1, &mut ba, n),
                    Op::RecvB(n, peek) | Op::RecvA(n, peek) => {
                        let (s, dir, w) = match o {
                            Op::RecvB(..) => (b, 0, &mut ab),
                            _ => (a, 1, &mut ba),
                        };
                        if peek {
                            if let Some(p) = recv(s, n, true) {
                                check(dir, w, &p, false)?;
                                // The receive that follows starts with what the peek showed.
                                let got = recv(s, p.len(), false).unwrap_or_default();
                                prop_assert_eq!(&got, &p);
                                check(dir, w, &got, true)?;
                            }
                        } else if let Some(got) = recv(s, n, false) {
                            prop_assert!(!got.is_empty() || w.got == w.sent);
                            check(dir, w, &got, true)?;
                        }
                    }
                }
            }
            // Each way then carries 200,000 bytes more, ten times its buffers, with its
            // receiver reading as they come: every credit must come back.
            for (tx, rx, dir, w) in [(a, b, 0u8, &mut ab), (b, a, 1, &mut ba)] {
                let goal = w.sent + 200_000;
                let mut passes = 0;
                while w.got < goal {
                    passes += 1;
                    prop_assert!(
                        passes < 20_000,
                        "stuck one way {} at {} of {}",
                        dir,
                        w.got,
                        goal
                    );
                    if w.sent < goal {
                        send(tx, dir, w, (goal - w.sent).min(30_000));
                    }
                    if let Some(got) = recv(rx, 50_000, false) {
                        check(dir, w, &got, true)?;
                    }
                }
            }
            // Both ends finish writing, then read everything left, then the end.
            run(|c, st| {
                c.rs_shutdown(st, a, libc::SHUT_WR)?;
                c.rs_shutdown(st, b, libc::SHUT_WR)
            })
            .expect("shutdown");
            for (s, dir, w) in [(b, 0u8, &mut ab), (a, 1, &mut ba)] {
                let mut ended = false;
                for _ in 0..100_000 {
                    match recv(s, 50_000, false) {
                        Some(got) if got.is_empty() => {
                            ended = true;
                            break;
                        }
                        Some(got) => check(dir, w, &got, true)?,
                        None => {}
                    }
                }
                prop_assert!(ended, "no end of stream one way {}", dir);
                prop_assert_eq!(w.got, w.sent, "bytes lost one way {}", dir);
            }
            run(|c, st| {
                for s in [a, b, l] {
                    c.rs_close(st, s)?;
                }
                Ok(())
            })
            .expect("close");
        }
    }

    #[test]
    fn slot_counts_follow_the_buffer_sizes_within_bounds() {
        assert_eq!(slots(65536, 0), 4);
        assert_eq!(slots(1 << 20, 0), 64);
        assert_eq!(slots(0, 0), MIN_SLOTS);
        assert_eq!(slots(i32::MAX, 0), MAX_SLOTS);
        assert_eq!(slots(1 << 20, 8), 8);
    }
}
