//! RDMA-CM (`librdmacm`'s `rdma_*` calls) over ringbell NICs: IPv4 addresses, ports and
//! RC connections, made with the driver's connection manager ([`ringbell::cm`]) between
//! the NICs' general services QPs.
//!
//! What librdmacm asks of the kernel's `rdma_cm` is done here:
//! - addresses: a NIC's IPv4 address names it; the fabric's address plan
//!   ([`ringbell::AhAttr::on_fabric`]) resolves a destination, so address and route
//!   resolution complete at once (their events are queued by the call);
//! - ports: `rdma_bind_addr` and `rdma_listen` take a port of the port space
//!   (`RDMA_PS_TCP` or `RDMA_PS_IB`); a connection request names the service id
//!   `RDMA_IB_IP_PS_* | port`, as the kernel's does;
//! - connections: librdmacm's QP moves (INIT at `rdma_create_qp`, RTR and RTS before the
//!   REP on the passive side and on the REP on the active side, ERR at a disconnect) and the
//!   IB CM's REQ, REP, RTU, REJ, DREQ and DREP. The REQ carries a 36-byte header before the
//!   application's private data (its source port and addresses), as the kernel's CMA
//!   header does, so an application has 56 bytes in a request, 196 in an accept and 148 in
//!   a reject; events hand over the whole private area of the message, zero-filled.
//!
//! Progress: every call drives the NICs' CMs, and while a program has an event channel
//! the library's progress thread (`cma_entry`) does so every millisecond. A channel's
//! descriptor reads as ready exactly while events are queued on it ([`Cma::readiness`]);
//! `rdma_get_cm_event` on a descriptor made non-blocking returns `EAGAIN` when nothing is
//! queued.
//!
//! The C boundary (pointers, socket addresses, allocation) is `cma_entry`; this module is
//! the logic, under the library's lock.

use crate::abi;
use crate::cma_abi::*;
use crate::ops::{with_ctx_held, with_held};
use crate::qp::RbQp;
use crate::state::{Kind, State};
use ringbell::cm::{
    first_psn, CmEvent, ConnId, ConnectionManager, REJ_CONSUMER, REJ_INVALID_SERVICE_ID,
    SIDR_NO_SERVICE, SIDR_OK, SIDR_REJECTED,
};
use ringbell::{AhAttr, ConnectOptions, Endpoint};
use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};

/// Bytes of the header before the application's private data in a connection request.
pub const REQ_HEADER: usize = 36;
/// Private data of a request the application may give (the REQ's 92 less the header).
pub const MAX_CONNECT_PRIVATE: usize = ringbell::cm::MAX_REQ_PRIVATE - REQ_HEADER;
/// Private data of a datagram id's request (a SIDR REQ's 216 less the header).
pub const MAX_SIDR_PRIVATE: usize = ringbell::cm::MAX_SIDR_REQ_PRIVATE - REQ_HEADER;
/// Private data of a datagram id's accept or reject (a SIDR REP's).
pub const MAX_SIDR_REPLY_PRIVATE: usize = ringbell::cm::MAX_SIDR_REP_PRIVATE;
/// The Q_Key of datagram ids (librdmacm's `RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;
/// Private data of an accept.
pub const MAX_ACCEPT_PRIVATE: usize = ringbell::cm::MAX_REP_PRIVATE;
/// Private data of a reject.
pub const MAX_REJECT_PRIVATE: usize = ringbell::cm::MAX_REJ_PRIVATE;
/// The READ/atomic depth a NIC offers (the device's `max_qp_rd_atom`).
const MAX_DEPTH: u8 = 16;
/// The largest backlog of a listener (the kernel's `max_backlog` default).
pub const MAX_BACKLOG: usize = 1024;
/// First ephemeral port.
const EPHEMERAL: u16 = 32768;

/// A connection id of librdmacm's, as programs hold it, with the event it is on.
#[repr(C)]
pub struct RbCmId {
    pub id: rdma_cm_id,
}

/// An event handed to a program, with the private data its parameters point to.
#[repr(C)]
pub struct RbCmEvent {
    pub ev: rdma_cm_event,
    private: Vec<u8>,
    /// A datagram peer's QPN and Q_Key (what `param.ud` carries), kept readable.
    ud: Option<(u32, u32)>,
}

/// An event channel, as programs hold it.
#[repr(C)]
pub struct RbEventChannel {
    pub ch: rdma_event_channel,
}

/// Where an id stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listening,
    /// Active: REQ sent.
    Connecting(ConnId),
    /// Active without a QP: REP received, waiting for `rdma_establish`.
    Replied(ConnId),
    /// Passive: a request waiting for `rdma_accept` or `rdma_reject`.
    Requested(ConnId),
    /// Passive: REP sent.
    Accepting(ConnId),
    Connected(ConnId),
    /// The connection was up and is closed (`DISCONNECTED`): `rdma_disconnect` still
    /// answers 0, as the kernel's answers a disconnect the peer began.
    Disconnected,
    /// Closed, refused, or unreachable.
    Done,
}

/// The library's side of an id.
struct Id {
    id: Box<RbCmId>,
    chan: usize,
    nic: Option<usize>,
    phase: Phase,
    /// Bound or resolved source (an unspecified address: every NIC).
    src: SocketAddrV4,
    dst: SocketAddrV4,
    /// READ/atomic depths of a request not answered yet (the requester's view swapped).
    depths: (u8, u8),
    /// The peer's QP and the options the connection's QPs move with, once known (the
    /// request on the passive side, the reply on the active side): `rdma_init_qp_attr`.
    remote: Option<(Endpoint, ConnectOptions)>,
    /// The first PSN this side sends, once known.
    local_psn: Option<u32>,
    /// QP attributes `rdma_get_request` creates the new id's QP with (`rdma_create_ep`
    /// on a passive id).
    ep_qp: Option<abi::ibv_qp_init_attr>,
    /// CQs and channels the library made for the id's QP (destroyed with the id's QP at
    /// `rdma_destroy_ep`).
    made: Vec<(*mut abi::ibv_cq, *mut abi::ibv_comp_channel)>,
    /// Multicast groups joined (a datagram id's).
    groups: Vec<Ipv4Addr>,
    /// A listener's backlog: requests it may have queued and not handed out yet (more are
    /// refused, as the kernel's rdma_cm refuses them).
    backlog: usize,
    /// A datagram listener answered at once with this UD QP, whichever call drives the CM
    /// (a bound datagram rsocket's port), instead of through an event.
    answer_with: Option<u32>,
}

/// An event channel's queue. A synchronous id (made without a channel) has one of its own.
struct Chan {
    ch: Box<RbEventChannel>,
    events: VecDeque<Box<RbCmEvent>>,
    /// Whether the channel's descriptor was last made readable (it is while events are
    /// queued).
    ready: bool,
}

/// Everything RDMA-CM keeps, behind the library's lock.
#[derive(Default)]
pub(crate) struct Cma {
    cms: BTreeMap<usize, ConnectionManager>,
    ctxs: BTreeMap<usize, *mut abi::ibv_context>,
    /// The library's XRC domain of each NIC (made at the first XRC target or SRQ).
    xrcds: BTreeMap<usize, *mut abi::ibv_xrcd>,
    pds: BTreeMap<usize, *mut abi::ibv_pd>,
    ids: BTreeMap<usize, Id>,
    chans: BTreeMap<usize, Chan>,
    /// Channels destroyed (their addresses until reused): a late `rdma_get_cm_event` on one
    /// blocks instead of failing.
    gone_chans: std::collections::BTreeSet<usize>,
    /// Events handed out and not acknowledged yet.
    delivered: BTreeMap<usize, Box<RbCmEvent>>,
    /// Listening ids by (NIC, or every NIC; port).
    listeners: BTreeMap<(Option<usize>, u16), usize>,
    /// Ids by the connection their NIC's CM numbers.
    conns: BTreeMap<(usize, ConnId), usize>,
    next_port: u16,
    /// rsockets (`crate::rsocket`), whose ids are this module's.
    pub(crate) rs: crate::rsocket::Rsockets,
}

/// A connection request (REQ) or a datagram peer's (SIDR REQ), as a NIC's CM gave it.
struct Request {
    cid: ConnId,
    sid: u64,
    from: AhAttr,
    private: Vec<u8>,
    sidr: bool,
}

/// What a datagram event's `param.ud.private_data` points to: the message's private data,
/// or (`MULTICAST_JOIN`) the join's context, as librdmacm gives it.
enum UdData {
    Private(Vec<u8>),
    Context(*mut std::ffi::c_void),
}

/// What a connect or accept asks for (`struct rdma_conn_param`, copied).
#[derive(Clone, Debug, Default)]
pub(crate) struct ConnParam {
    pub private: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub qp_num: u32,
}

/// `a` as a `struct sockaddr_in` at the start of a `struct sockaddr_storage`.
pub(crate) fn sockaddr_of(a: SocketAddrV4) -> [u64; 16] {
    let mut b = [0u8; 128];
    b[0..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
    b[2..4].copy_from_slice(&a.port().to_be_bytes());
    b[4..8].copy_from_slice(&a.ip().octets());
    let mut out = [0u64; 16];
    for (o, c) in out.iter_mut().zip(b.chunks_exact(8)) {
        *o = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
    }
    out
}

/// The RoCEv2 GID of an IPv4 address (`::ffff:a.b.c.d`).
fn gid_bytes(ip: Ipv4Addr) -> [u8; 16] {
    ip.to_ipv6_mapped().octets()
}

/// [`gid_bytes`] as libibverbs' union.
fn gid_of(ip: Ipv4Addr) -> abi::ibv_gid {
    abi::ibv_gid { raw: gid_bytes(ip) }
}

/// The service id of `port` in port space `ps`.
fn service_id(ps: u32, port: u16) -> u64 {
    (u64::from(ps) << 16) | u64::from(port)
}

/// `data` padded with zeroes to `len` bytes (the whole private area of a message).
fn padded(data: &[u8], len: usize) -> Vec<u8> {
    let mut v = data.to_vec();
    v.resize(len.max(data.len()), 0);
    v
}

impl Cma {
    /// A new event channel; `fd` is its descriptor. Returns its address.
    pub fn create_channel(&mut self, fd: i32) -> *mut rdma_event_channel {
        let mut ch = Box::new(RbEventChannel {
            ch: rdma_event_channel { fd },
        });
        let p: *mut rdma_event_channel = &mut ch.ch;
        self.gone_chans.remove(&(p as usize));
        self.chans.insert(
            p as usize,
            Chan {
                ch,
                events: VecDeque::new(),
                ready: false,
            },
        );
        p
    }

    /// Destroys channel `p`: EBUSY while an id uses it; its descriptor is returned to be
    /// closed.
    pub fn destroy_channel(&mut self, p: usize) -> Result<i32, i32> {
        let Some(c) = self.chans.get(&p) else {
            return Err(libc::EINVAL);
        };
        if self.ids.values().any(|i| i.chan == p) {
            return Err(libc::EBUSY);
        }
        let fd = c.ch.ch.fd;
        self.chans.remove(&p);
        self.gone_chans.insert(p);
        Ok(fd)
    }

    /// The descriptor of channel `p` (-1 for a synchronous id's own, or none).
    pub fn channel_fd(&self, p: usize) -> i32 {
        self.chans.get(&p).map_or(-1, |c| c.ch.ch.fd)
    }

    /// Whether `p` was a channel of this library, destroyed since (and its address not
    /// taken by another).
    pub fn was_channel(&self, p: usize) -> bool {
        self.gone_chans.contains(&p)
    }

    /// Whether `p` is an id of this library.
    pub fn is_id(&self, p: usize) -> bool {
        self.ids.contains_key(&p)
    }

    /// Whether `p` is an id made without a channel (whose calls wait for their events).
    pub fn is_sync(&self, p: usize) -> bool {
        self.ids
            .get(&p)
            .is_some_and(|i| self.chans.get(&i.chan).is_some_and(|c| c.ch.ch.fd < 0))
    }

    /// `rdma_create_id` on channel `chan` (a synchronous id: a channel of its own, made by
    /// the caller with descriptor -1).
    pub fn create_id(
        &mut self,
        chan: usize,
        context: *mut std::ffi::c_void,
        ps: u32,
    ) -> Result<*mut rdma_cm_id, i32> {
        if !self.chans.contains_key(&chan) {
            return Err(libc::EINVAL);
        }
        match ps {
            RDMA_PS_TCP | RDMA_PS_IB | RDMA_PS_UDP => {}
            // IPoIB's space is not offered.
            RDMA_PS_IPOIB => return Err(libc::EPROTONOSUPPORT),
            _ => return Err(libc::EINVAL),
        }
        let p = self.new_id(chan, context, ps);
        Ok(p)
    }

    fn new_id(&mut self, chan: usize, context: *mut std::ffi::c_void, ps: u32) -> *mut rdma_cm_id {
        let mut id = Box::new(RbCmId {
            id: rdma_cm_id {
                verbs: std::ptr::null_mut(),
                channel: self
                    .chans
                    .get_mut(&chan)
                    .map_or(std::ptr::null_mut(), |c| &mut c.ch.ch as *mut _),
                context,
                qp: std::ptr::null_mut(),
                route: rdma_route {
                    addr: rdma_addr {
                        src_storage: [0; 16],
                        dst_storage: [0; 16],
                        addr: rdma_ib_addr {
                            sgid: abi::ibv_gid { raw: [0; 16] },
                            dgid: abi::ibv_gid { raw: [0; 16] },
                            pkey: 0,
                        },
                    },
                    path_rec: std::ptr::null_mut(),
                    num_paths: 0,
                },
                ps,
                port_num: 0,
                event: std::ptr::null_mut(),
                send_cq_channel: std::ptr::null_mut(),
                send_cq: std::ptr::null_mut(),
                recv_cq_channel: std::ptr::null_mut(),
                recv_cq: std::ptr::null_mut(),
                srq: std::ptr::null_mut(),
                pd: std::ptr::null_mut(),
                qp_type: match ps {
                    RDMA_PS_UDP => abi::ibv_qp_type_IBV_QPT_UD,
                    _ => abi::ibv_qp_type_IBV_QPT_RC,
                },
            },
        });
        let p: *mut rdma_cm_id = &mut id.id;
        self.ids.insert(
            p as usize,
            Id {
                id,
                chan,
                nic: None,
                phase: Phase::Idle,
                src: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0),
                dst: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0),
                depths: (0, 0),
                remote: None,
                local_psn: None,
                ep_qp: None,
                made: Vec::new(),
                groups: Vec::new(),
                backlog: 0,
                answer_with: None,
            },
        );
        p
    }

    /// The IPv4 address of NIC `i` (opening it).
    pub(crate) fn nic_ip(st: &mut State, i: usize) -> Option<Ipv4Addr> {
        st.device(i).ok().map(|d| Ipv4Addr::from(d.caps().ip))
    }

    /// The NICs this process uses (on a served fabric, the one it claims or
    /// `RINGBELL_NIC` names), as `ibv_get_device_list` lists them.
    pub(crate) fn local_nics(st: &State) -> Vec<usize> {
        let choice = st.plan.choice();
        (0..st.nics.len()).filter(|&i| choice.includes(i)).collect()
    }

    /// The NIC of this process with address `ip`.
    pub(crate) fn nic_with(st: &mut State, ip: Ipv4Addr) -> Option<usize> {
        Self::local_nics(st)
            .into_iter()
            .find(|&i| Self::nic_ip(st, i) == Some(ip))
    }

    /// The context the library opened on NIC `i` (one per NIC, kept).
    fn ctx(&mut self, st: &mut State, i: usize) -> Result<*mut abi::ibv_context, i32> {
        if let Some(&c) = self.ctxs.get(&i) {
            return Ok(c);
        }
        let c = crate::device::open(st, i)?;
        self.ctxs.insert(i, c);
        Ok(c)
    }

    /// The CM of NIC `i`.
    fn cm(&mut self, st: &mut State, i: usize) -> Result<&mut ConnectionManager, i32> {
        match self.cms.entry(i) {
            std::collections::btree_map::Entry::Occupied(o) => Ok(o.into_mut()),
            std::collections::btree_map::Entry::Vacant(v) => {
                let dev = st.device(i)?;
                let cm = ConnectionManager::new(&dev).map_err(|e| crate::errno_of(&e))?;
                Ok(v.insert(cm))
            }
        }
    }

    fn fresh_port(&mut self) -> u16 {
        loop {
            let p = self.next_port.max(EPHEMERAL);
            self.next_port = if p == u16::MAX { EPHEMERAL } else { p + 1 };
            if !self.listeners.keys().any(|&(_, lp)| lp == p) {
                return p;
            }
        }
    }

    /// Sets id `p` on NIC `nic` (its context, port and source address).
    fn place(&mut self, st: &mut State, p: usize, nic: usize) -> Result<(), i32> {
        let ctx = self.ctx(st, nic)?;
        // An id on a device has the library's PD of that device, as librdmacm gives it.
        let pd = self.shared_pd(st, nic)?;
        let ip = Self::nic_ip(st, nic).ok_or(libc::ENODEV)?;
        let port = match self.ids.get(&p).map(|i| i.src.port()) {
            Some(0) | None => self.fresh_port(),
            Some(q) => q,
        };
        let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
        i.nic = Some(nic);
        i.src = SocketAddrV4::new(ip, port);
        i.id.id.verbs = ctx;
        if i.id.id.pd.is_null() {
            i.id.id.pd = pd;
        }
        i.id.id.port_num = 1;
        i.id.id.route.addr.src_storage = sockaddr_of(i.src);
        i.id.id.route.addr.addr.sgid = gid_of(ip);
        Ok(())
    }

    /// `rdma_bind_addr`: `addr`'s IPv4 address names a NIC of this process (or is
    /// unspecified: every NIC); port 0 takes a free port.
    pub fn bind(&mut self, st: &mut State, p: usize, addr: SocketAddrV4) -> Result<(), i32> {
        let phase = self.ids.get(&p).ok_or(libc::EINVAL)?.phase;
        if phase != Phase::Idle {
            return Err(libc::EINVAL);
        }
        let nic = match addr.ip().is_unspecified() {
            true => None,
            false => Some(Self::nic_with(st, *addr.ip()).ok_or(libc::EADDRNOTAVAIL)?),
        };
        let port = match addr.port() {
            0 => self.fresh_port(),
            q => {
                let taken = self
                    .listeners
                    .keys()
                    .any(|&(n, lp)| lp == q && (n.is_none() || nic.is_none() || n == nic))
                    || self.ids.iter().any(|(&k, i)| {
                        k != p
                            && i.phase == Phase::Bound
                            && i.src.port() == q
                            && (i.nic.is_none() || nic.is_none() || i.nic == nic)
                    });
                if taken {
                    return Err(libc::EADDRINUSE);
                }
                q
            }
        };
        {
            let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
            i.src = SocketAddrV4::new(*addr.ip(), port);
            i.id.id.route.addr.src_storage = sockaddr_of(i.src);
            i.phase = Phase::Bound;
        }
        if let Some(n) = nic {
            self.place(st, p, n)?;
        }
        Ok(())
    }

    /// `rdma_resolve_addr`: picks the NIC (the source's, the bound one, the destination's
    /// when it is local, or the first) and queues `ADDR_RESOLVED`, or `ADDR_ERROR` for a
    /// destination outside the fabric.
    pub fn resolve_addr(
        &mut self,
        st: &mut State,
        p: usize,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
    ) -> Result<(), i32> {
        let (phase, bound) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.phase, i.nic)
        };
        if !matches!(phase, Phase::Idle | Phase::Bound) {
            return Err(libc::EINVAL);
        }
        if let Some(s) = src {
            if phase == Phase::Idle && (!s.ip().is_unspecified() || s.port() != 0) {
                self.bind(st, p, s)?;
            }
        }
        let Some(&first) = Self::local_nics(st).first() else {
            return Err(libc::ENODEV);
        };
        let nic = match self.ids.get(&p).and_then(|i| i.nic).or(bound) {
            Some(n) => n,
            None => Self::nic_with(st, *dst.ip()).unwrap_or(first),
        };
        self.place(st, p, nic)?;
        // A NIC of the fabric, or a multicast group (which a datagram id joins).
        let reachable = AhAttr::on_fabric(dst.ip().octets()).is_some() || dst.ip().is_multicast();
        let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
        i.dst = dst;
        i.id.id.route.addr.dst_storage = sockaddr_of(dst);
        i.id.id.route.addr.addr.dgid = gid_of(*dst.ip());
        i.id.id.route.addr.addr.pkey = 0xFFFF;
        if reachable {
            i.phase = Phase::AddrResolved;
            self.queue(
                p,
                std::ptr::null_mut(),
                RDMA_CM_EVENT_ADDR_RESOLVED,
                0,
                None,
            );
        } else {
            self.queue(
                p,
                std::ptr::null_mut(),
                RDMA_CM_EVENT_ADDR_ERROR,
                -libc::EHOSTUNREACH,
                None,
            );
        }
        Ok(())
    }

    /// `rdma_resolve_route`: queues `ROUTE_RESOLVED` (one hop on the fabric).
    pub fn resolve_route(&mut self, p: usize) -> Result<(), i32> {
        let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
        if i.phase != Phase::AddrResolved {
            return Err(libc::EINVAL);
        }
        i.phase = Phase::RouteResolved;
        self.queue(
            p,
            std::ptr::null_mut(),
            RDMA_CM_EVENT_ROUTE_RESOLVED,
            0,
            None,
        );
        Ok(())
    }

    /// `rdma_listen`: connection requests to the id's port (on its NIC, or on every NIC of
    /// this process) come to it, up to `backlog` of them waiting to be handed out (0 or
    /// less, or more than [`MAX_BACKLOG`]: [`MAX_BACKLOG`], as the kernel takes it).
    pub fn listen(&mut self, st: &mut State, p: usize, backlog: i32) -> Result<(), i32> {
        let (phase, nic, port, ps) = {
            let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
            i.backlog = match usize::try_from(backlog) {
                Ok(b) if (1..=MAX_BACKLOG).contains(&b) => b,
                _ => MAX_BACKLOG,
            };
            (i.phase, i.nic, i.src.port(), i.id.id.ps)
        };
        let port = match phase {
            Phase::Bound => port,
            Phase::Idle => {
                self.bind(st, p, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
                self.ids[&p].src.port()
            }
            // A second listen on a listening id only changes its backlog.
            Phase::Listening => return Ok(()),
            _ => return Err(libc::EINVAL),
        };
        if self.listeners.contains_key(&(nic, port)) {
            return Err(libc::EADDRINUSE);
        }
        let nics: Vec<usize> = match nic {
            Some(n) => vec![n],
            None => Self::local_nics(st),
        };
        for n in nics {
            self.cm(st, n)?
                .listen(service_id(ps, port))
                .map_err(|e| crate::errno_of(&e))?;
        }
        self.listeners.insert((nic, port), p);
        if let Some(i) = self.ids.get_mut(&p) {
            i.phase = Phase::Listening;
        }
        Ok(())
    }

    /// `rdma_create_qp` (`attr` copied): the QP is made on the id's NIC (with the NIC's
    /// shared PD when `pd` is null, and CQs of its own when the attributes name none) and
    /// moved to INIT, as librdmacm does.
    pub fn create_qp(
        &mut self,
        st: &mut State,
        p: usize,
        pd: *mut abi::ibv_pd,
        attr: &mut abi::ibv_qp_init_attr,
    ) -> Result<(), i32> {
        let (nic, has_qp, ps) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.nic, !i.id.id.qp.is_null(), i.id.id.ps)
        };
        let nic = nic.ok_or(libc::EINVAL)?;
        if has_qp {
            return Err(libc::EINVAL);
        }
        // A datagram id takes a UD QP, a connected one an RC, UC or XRC initiator QP (an
        // XRC target has no PD or CQs: `adopt_qp`).
        let ud = ps == RDMA_PS_UDP;
        let fits = match attr.qp_type {
            abi::ibv_qp_type_IBV_QPT_UD => ud,
            abi::ibv_qp_type_IBV_QPT_RC
            | abi::ibv_qp_type_IBV_QPT_UC
            | abi::ibv_qp_type_IBV_QPT_XRC_SEND => !ud,
            _ => false,
        };
        if !fits {
            return Err(libc::EINVAL);
        }
        let ctx = self.ctx(st, nic)?;
        let pd = match pd.is_null() {
            true => self.shared_pd(st, nic)?,
            false => {
                // A PD of another device is refused, as librdmacm refuses it.
                let same = with_held(st, pd as *mut crate::pd::RbPd, Kind::Pd, |_, d| {
                    std::ptr::eq(d.pd.context, ctx)
                });
                if same != Some(true) {
                    return Err(libc::EINVAL);
                }
                pd
            }
        };
        let mut made = Vec::new();
        let idp = p;
        // An XRC initiator has no receive side (its send CQ stands for the receive CQ).
        let sides = match attr.qp_type {
            abi::ibv_qp_type_IBV_QPT_XRC_SEND => 1,
            _ => 2,
        };
        if attr.send_cq.is_null() || (sides == 2 && attr.recv_cq.is_null()) {
            let depth = attr.cap.max_send_wr.max(attr.cap.max_recv_wr).max(1) as i32;
            for which in 0..sides {
                let cq_slot = if which == 0 {
                    &mut attr.send_cq
                } else {
                    &mut attr.recv_cq
                };
                if !cq_slot.is_null() {
                    continue;
                }
                let (cq, ch) = with_ctx_held(st, ctx, |st, c| {
                    let ch = crate::cq::create_channel(st, c)?;
                    let cq = crate::cq::create(
                        st,
                        c,
                        depth,
                        ch as *mut crate::cq::RbChannel,
                        // The id is the CQ's context, as librdmacm makes an id's CQs
                        // (`rdma_get_send_comp` checks it).
                        idp as *mut std::ffi::c_void,
                        std::ptr::null_mut(),
                    )?;
                    Ok::<_, i32>((cq, ch))
                })
                .ok_or(libc::EINVAL)??;
                *cq_slot = cq as *mut abi::ibv_cq;
                made.push((cq as *mut abi::ibv_cq, ch));
            }
        }
        // The id's SRQ serves a QP made without one (`rdma_create_srq`).
        if attr.srq.is_null() {
            attr.srq = self.ids[&p].id.id.srq;
        }
        let mut ex = abi::ibv_qp_init_attr_ex {
            qp_context: attr.qp_context,
            send_cq: attr.send_cq,
            recv_cq: attr.recv_cq,
            srq: attr.srq,
            cap: attr.cap,
            qp_type: attr.qp_type,
            sq_sig_all: attr.sq_sig_all,
            comp_mask: abi::ibv_qp_init_attr_mask_IBV_QP_INIT_ATTR_PD,
            pd,
            ..Default::default()
        };
        let qp = crate::entry::create_qp_checked(st, pd, &mut ex)? as *mut abi::ibv_qp;
        attr.cap = ex.cap;
        attr.recv_cq = ex.recv_cq;
        self.adopt_qp(st, p, qp, attr, pd, made)
    }

    /// A QP just made for id `p` (by `create_qp`, or an XRC target the C boundary made in
    /// the library's XRC domain): moved to INIT (ready, for UD) and recorded as the id's,
    /// with the CQs and channels `made` for it. It is destroyed if it cannot move.
    pub fn adopt_qp(
        &mut self,
        st: &mut State,
        p: usize,
        qp: *mut abi::ibv_qp,
        attr: &abi::ibv_qp_init_attr,
        pd: *mut abi::ibv_pd,
        made: Vec<(*mut abi::ibv_cq, *mut abi::ibv_comp_channel)>,
    ) -> Result<(), i32> {
        let ud = self.ids.get(&p).ok_or(libc::EINVAL)?.id.id.ps == RDMA_PS_UDP;
        let moved = match ud {
            true => ud_up(st, qp),
            false => {
                let init = abi::ibv_qp_attr {
                    qp_state: abi::ibv_qp_state_IBV_QPS_INIT,
                    pkey_index: 0,
                    port_num: 1,
                    qp_access_flags: abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
                        | abi::ibv_access_flags_IBV_ACCESS_REMOTE_READ
                        | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC,
                    ..Default::default()
                };
                let mask = abi::ibv_qp_attr_mask_IBV_QP_STATE
                    | abi::ibv_qp_attr_mask_IBV_QP_PKEY_INDEX
                    | abi::ibv_qp_attr_mask_IBV_QP_PORT
                    | abi::ibv_qp_attr_mask_IBV_QP_ACCESS_FLAGS;
                move_qp(st, qp, &init, mask)
            }
        };
        if let Err(e) = moved {
            with_held(st, qp as *mut RbQp, Kind::Qp, crate::qp::destroy);
            return Err(e);
        }
        let groups = self.ids[&p].groups.clone();
        for g in groups {
            with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| {
                crate::flow::attach_mcast(q, gid_bytes(g))
            });
        }
        let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
        i.id.id.qp = qp;
        if !pd.is_null() {
            i.id.id.pd = pd;
        }
        i.id.id.qp_type = attr.qp_type;
        i.id.id.send_cq = attr.send_cq;
        i.id.id.recv_cq = attr.recv_cq;
        i.id.id.srq = attr.srq;
        for &(cq, ch) in &made {
            if std::ptr::eq(attr.send_cq, cq) {
                i.id.id.send_cq_channel = ch;
            }
            if std::ptr::eq(attr.recv_cq, cq) {
                i.id.id.recv_cq_channel = ch;
            }
        }
        i.made.extend(made);
        Ok(())
    }

    /// The QP type an id's QPs take (`rdma_create_ep`: the address information's): UD for a
    /// datagram id; RC, UC or an XRC side for a connected one.
    pub fn set_qp_type(&mut self, p: usize, t: u32) -> Result<(), i32> {
        let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
        let ud = i.id.id.ps == RDMA_PS_UDP;
        let fits = match t {
            abi::ibv_qp_type_IBV_QPT_UD => ud,
            abi::ibv_qp_type_IBV_QPT_RC
            | abi::ibv_qp_type_IBV_QPT_UC
            | abi::ibv_qp_type_IBV_QPT_XRC_SEND
            | abi::ibv_qp_type_IBV_QPT_XRC_RECV => !ud,
            _ => false,
        };
        if !fits {
            return Err(libc::EINVAL);
        }
        i.id.id.qp_type = t;
        Ok(())
    }

    /// Id `p`'s context and QP type, and the library's XRC domain of its NIC if it has one
    /// yet (`None` for an id on no NIC).
    pub fn xrc_place(
        &mut self,
        st: &mut State,
        p: usize,
    ) -> Option<(*mut abi::ibv_context, u32, *mut abi::ibv_xrcd)> {
        let i = self.ids.get(&p)?;
        let (nic, t) = (i.nic?, i.id.id.qp_type);
        let ctx = self.ctx(st, nic).ok()?;
        let x = self
            .xrcds
            .get(&nic)
            .copied()
            .unwrap_or(std::ptr::null_mut());
        Some((ctx, t, x))
    }

    /// Records `x` as the library's XRC domain of id `p`'s NIC (one per NIC, kept).
    pub fn set_xrcd(&mut self, p: usize, x: *mut abi::ibv_xrcd) {
        if let Some(nic) = self.ids.get(&p).and_then(|i| i.nic) {
            self.xrcds.entry(nic).or_insert(x);
        }
    }

    /// Records CQs and channels made for id `p` by the C boundary (an XRC SRQ's CQ): they
    /// go with the id's QP at `rdma_destroy_ep`.
    pub fn add_made(&mut self, p: usize, cq: *mut abi::ibv_cq, ch: *mut abi::ibv_comp_channel) {
        if let Some(i) = self.ids.get_mut(&p) {
            i.made.push((cq, ch));
            i.id.id.recv_cq = cq;
            i.id.id.recv_cq_channel = ch;
        }
    }

    /// The PD the library shares among its ids on NIC `nic` (made at first use).
    fn shared_pd(&mut self, st: &mut State, nic: usize) -> Result<*mut abi::ibv_pd, i32> {
        if let Some(&pd) = self.pds.get(&nic) {
            return Ok(pd);
        }
        let ctx = self.ctx(st, nic)?;
        let pd = with_ctx_held(st, ctx, crate::pd::alloc).ok_or(libc::EINVAL)??;
        self.pds.insert(nic, pd);
        Ok(pd)
    }

    /// `rdma_destroy_qp`; with `made`, also the CQs and channels the library made for it
    /// (`rdma_destroy_ep`).
    pub fn destroy_qp(&mut self, st: &mut State, p: usize, made: bool) {
        let Some(i) = self.ids.get_mut(&p) else {
            return;
        };
        let qp = std::mem::replace(&mut i.id.id.qp, std::ptr::null_mut());
        if !qp.is_null() {
            // The QP leaves its groups first (a QP in a group is not destroyed).
            for g in &i.groups {
                with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| {
                    crate::flow::detach_mcast(q, gid_bytes(*g))
                });
            }
            with_held(st, qp as *mut RbQp, Kind::Qp, crate::qp::destroy);
        }
        if made {
            for (cq, ch) in std::mem::take(&mut i.made) {
                with_held(st, cq as *mut crate::cq::RbCq, Kind::Cq, crate::cq::destroy);
                with_held(
                    st,
                    ch as *mut crate::cq::RbChannel,
                    Kind::Channel,
                    crate::cq::destroy_channel,
                );
            }
            i.id.id.send_cq = std::ptr::null_mut();
            i.id.id.recv_cq = std::ptr::null_mut();
            i.id.id.send_cq_channel = std::ptr::null_mut();
            i.id.id.recv_cq_channel = std::ptr::null_mut();
        }
    }

    /// `rdma_connect` (`param` copied; `None`: the defaults).
    pub fn connect(
        &mut self,
        st: &mut State,
        p: usize,
        param: Option<ConnParam>,
    ) -> Result<(), i32> {
        let (phase, nic, qp, dst, src, ps) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.phase, i.nic, i.id.id.qp, i.dst, i.src, i.id.id.ps)
        };
        if phase != Phase::RouteResolved {
            return Err(libc::EINVAL);
        }
        let nic = nic.ok_or(libc::EINVAL)?;
        let param = param.unwrap_or(ConnParam {
            responder_resources: MAX_DEPTH,
            initiator_depth: MAX_DEPTH,
            retry_count: 7,
            rnr_retry_count: 7,
            ..Default::default()
        });
        let ud = ps == RDMA_PS_UDP;
        let limit = match ud {
            true => MAX_SIDR_PRIVATE,
            false => MAX_CONNECT_PRIVATE,
        };
        if param.private.len() > limit {
            return Err(libc::EINVAL);
        }
        let peer = AhAttr::on_fabric(dst.ip().octets()).ok_or(libc::EHOSTUNREACH)?;
        let private = req_private(src, dst, &param.private);
        if ud {
            // Service id resolution: the peer's UD QP and Q_Key come back.
            let cid = self
                .cm(st, nic)?
                .sidr_request(peer, service_id(ps, dst.port()), &private)
                .map_err(|e| crate::errno_of(&e))?;
            self.conns.insert((nic, cid), p);
            if let Some(i) = self.ids.get_mut(&p) {
                i.phase = Phase::Connecting(cid);
            }
            return Ok(());
        }
        let qpn = match qp.is_null() {
            false => {
                with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| q.drv.qpn()).ok_or(libc::EINVAL)?
            }
            true => param.qp_num & 0x00FF_FFFF,
        };
        let opts = conn_options(&param);
        let cid = self
            .cm(st, nic)?
            .connect_external(peer, service_id(ps, dst.port()), qpn, &opts, &private)
            .map_err(|e| crate::errno_of(&e))?;
        self.conns.insert((nic, cid), p);
        if let Some(i) = self.ids.get_mut(&p) {
            i.phase = Phase::Connecting(cid);
        }
        Ok(())
    }

    /// `rdma_accept` (`param` copied; `None`: the request's depths): the id's QP moves to
    /// RTR and RTS, then the REP goes out.
    pub fn accept(
        &mut self,
        st: &mut State,
        p: usize,
        param: Option<ConnParam>,
    ) -> Result<(), i32> {
        let (phase, nic, qp, depths) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.phase, i.nic, i.id.id.qp, i.depths)
        };
        let Phase::Requested(cid) = phase else {
            return Err(libc::EINVAL);
        };
        let nic = nic.ok_or(libc::EINVAL)?;
        if qp.is_null() {
            // No QP on the id: the REP names the parameter's QP, which the program moves
            // itself (`ESTABLISHED` follows the RTU), as librdmacm lets it.
            let param = param.ok_or(libc::EINVAL)?;
            let qpn = param.qp_num & 0x00FF_FFFF;
            if qpn != 0 && self.ids[&p].id.id.ps == RDMA_PS_UDP {
                // A datagram request answered with the parameter's UD QP.
                if param.private.len() > MAX_SIDR_REPLY_PRIVATE {
                    return Err(libc::EINVAL);
                }
                self.cm(st, nic)?
                    .sidr_answer(cid, SIDR_OK, qpn, RDMA_UDP_QKEY, &param.private)
                    .map_err(|e| crate::errno_of(&e))?;
                self.finish(nic, cid);
                return Ok(());
            }
            if qpn == 0
                || param.private.len() > MAX_ACCEPT_PRIVATE
                || self.ids[&p].id.id.ps == RDMA_PS_UDP
            {
                return Err(libc::EINVAL);
            }
            let opts = conn_options(&param);
            let cm = self.cm(st, nic)?;
            let remote = cm.request(cid, &opts);
            cm.accept_external(cid, qpn, &opts, &param.private)
                .map_err(|e| crate::errno_of(&e))?;
            if let Some(i) = self.ids.get_mut(&p) {
                i.phase = Phase::Accepting(cid);
                i.remote = remote;
                i.local_psn = Some(first_psn(cid, qpn));
            }
            return Ok(());
        }
        if self.ids[&p].id.id.ps == RDMA_PS_UDP {
            // A datagram request is answered with the id's UD QP and Q_Key (no event
            // follows on this side).
            let private = param.map(|p| p.private).unwrap_or_default();
            if private.len() > MAX_SIDR_REPLY_PRIVATE {
                return Err(libc::EINVAL);
            }
            let qpn =
                with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| q.drv.qpn()).ok_or(libc::EINVAL)?;
            self.cm(st, nic)?
                .sidr_answer(cid, SIDR_OK, qpn, RDMA_UDP_QKEY, &private)
                .map_err(|e| crate::errno_of(&e))?;
            self.finish(nic, cid);
            return Ok(());
        }
        let param = param.unwrap_or(ConnParam {
            responder_resources: depths.0,
            initiator_depth: depths.1,
            retry_count: 7,
            rnr_retry_count: 7,
            ..Default::default()
        });
        if param.private.len() > MAX_ACCEPT_PRIVATE {
            return Err(libc::EINVAL);
        }
        let qpn =
            with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| q.drv.qpn()).ok_or(libc::EINVAL)?;
        let opts = conn_options(&param);
        let (remote, mine) = self.cm(st, nic)?.request(cid, &opts).ok_or(libc::EINVAL)?;
        qp_up(st, qp, &remote, &mine, first_psn(cid, qpn))?;
        if let Some(i) = self.ids.get_mut(&p) {
            i.remote = Some((remote, mine));
            i.local_psn = Some(first_psn(cid, qpn));
        }
        self.cm(st, nic)?
            .accept_external(cid, qpn, &opts, &param.private)
            .map_err(|e| crate::errno_of(&e))?;
        if let Some(i) = self.ids.get_mut(&p) {
            i.phase = Phase::Accepting(cid);
        }
        Ok(())
    }

    /// `rdma_reject`.
    pub fn reject(&mut self, st: &mut State, p: usize, private: &[u8]) -> Result<(), i32> {
        let (phase, nic) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.phase, i.nic)
        };
        let Phase::Requested(cid) = phase else {
            return Err(libc::EINVAL);
        };
        let ud = self.ids[&p].id.id.ps == RDMA_PS_UDP;
        let limit = match ud {
            true => MAX_SIDR_REPLY_PRIVATE,
            false => MAX_REJECT_PRIVATE,
        };
        if private.len() > limit {
            return Err(libc::EINVAL);
        }
        let nic = nic.ok_or(libc::EINVAL)?;
        let cm = self.cm(st, nic)?;
        match ud {
            true => cm.sidr_answer(cid, SIDR_REJECTED, 0, 0, private),
            false => cm.reject(cid, REJ_CONSUMER, private),
        }
        .map_err(|e| crate::errno_of(&e))?;
        self.finish(nic, cid);
        Ok(())
    }

    /// `rdma_establish`: the active side without a QP has moved its own.
    pub fn establish(&mut self, st: &mut State, p: usize) -> Result<(), i32> {
        let (phase, nic) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.phase, i.nic)
        };
        let Phase::Replied(cid) = phase else {
            return Err(libc::EINVAL);
        };
        let nic = nic.ok_or(libc::EINVAL)?;
        self.cm(st, nic)?
            .establish(cid)
            .map_err(|e| crate::errno_of(&e))?;
        if let Some(i) = self.ids.get_mut(&p) {
            i.phase = Phase::Connected(cid);
        }
        Ok(())
    }

    /// `rdma_disconnect`: the QP moves to ERR (its work requests flush) and the DREQ goes
    /// out; `DISCONNECTED` follows the peer's DREP.
    pub fn disconnect(&mut self, st: &mut State, p: usize) -> Result<(), i32> {
        let (phase, nic, qp) = {
            let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
            (i.phase, i.nic, i.id.id.qp)
        };
        let cid = match phase {
            Phase::Connected(c) | Phase::Accepting(c) => c,
            // The peer closed first: this side's QP still moves to ERR.
            Phase::Disconnected => {
                qp_err(st, qp);
                return Ok(());
            }
            _ => return Err(libc::EINVAL),
        };
        let nic = nic.ok_or(libc::EINVAL)?;
        qp_err(st, qp);
        self.cm(st, nic)?
            .disconnect(cid)
            .map_err(|e| crate::errno_of(&e))?;
        Ok(())
    }

    /// `rdma_destroy_id`: a connection it holds is closed (a DREQ, or a REJ to a request
    /// not answered), its listening stops, and its events not handed out yet go.
    pub fn destroy_id(&mut self, st: &mut State, p: usize) -> Result<(), i32> {
        let Some(i) = self.ids.get(&p) else {
            return Err(libc::EINVAL);
        };
        let (phase, nic) = (i.phase, i.nic);
        let event = i.id.id.event;
        if let Some(n) = nic {
            match phase {
                Phase::Connected(c) | Phase::Accepting(c) => {
                    if let Some(cm) = self.cms.get_mut(&n) {
                        let _ = cm.disconnect(c);
                    }
                    self.conns.remove(&(n, c));
                }
                Phase::Requested(c) => {
                    if let Some(cm) = self.cms.get_mut(&n) {
                        match i.id.id.ps {
                            RDMA_PS_UDP => {
                                let _ = cm.sidr_answer(c, SIDR_REJECTED, 0, 0, &[]);
                            }
                            _ => {
                                let _ = cm.reject(c, REJ_CONSUMER, &[]);
                            }
                        }
                    }
                    self.conns.remove(&(n, c));
                }
                Phase::Connecting(c) | Phase::Replied(c) => {
                    if let Some(cm) = self.cms.get_mut(&n) {
                        cm.forget(c);
                    }
                    self.conns.remove(&(n, c));
                }
                _ => {}
            }
        }
        if phase == Phase::Listening {
            let port = self.ids[&p].src.port();
            let ps = self.ids[&p].id.id.ps;
            self.listeners.remove(&(nic, port));
            let nics: Vec<usize> = match nic {
                Some(n) => vec![n],
                None => self.cms.keys().copied().collect(),
            };
            for n in nics {
                // Another listener on the same port (of one NIC, or of all) keeps it.
                let still = self
                    .listeners
                    .keys()
                    .any(|&(ln, lp)| lp == port && (ln.is_none() || ln == Some(n)));
                if !still {
                    if let Some(cm) = self.cms.get_mut(&n) {
                        cm.unlisten(service_id(ps, port));
                    }
                }
            }
        }
        if !event.is_null() {
            self.delivered.remove(&(event as usize));
        }
        self.destroy_qp(st, p, true);
        let i = self.ids.remove(&p).expect("checked above");
        // Requests to a listener that goes before it reported them are refused, and their
        // ids go with them, as the kernel refuses a listener's pending requests.
        let mut orphans = Vec::new();
        for c in self.chans.values_mut() {
            c.events.retain(|e| {
                let orphan = e.ev.listen_id as usize == p && e.ev.id as usize != p;
                if orphan {
                    orphans.push(e.ev.id as usize);
                }
                e.ev.id as usize != p && e.ev.listen_id as usize != p
            });
        }
        for o in orphans {
            let _ = self.destroy_id(st, o);
        }
        // A synchronous id's own channel goes with it.
        if self.chans.get(&i.chan).is_some_and(|c| c.ch.ch.fd < 0)
            && !self.ids.values().any(|o| o.chan == i.chan)
        {
            self.chans.remove(&i.chan);
        }
        Ok(())
    }

    /// `rdma_migrate_id`: the id's events go to channel `chan` from now on, those queued
    /// with them.
    pub fn migrate(&mut self, p: usize, chan: usize) -> Result<(), i32> {
        if !self.chans.contains_key(&chan) {
            return Err(libc::EINVAL);
        }
        let old = self.ids.get(&p).ok_or(libc::EINVAL)?.chan;
        let moved: Vec<Box<RbCmEvent>> = match self.chans.get_mut(&old) {
            Some(c) => {
                let (m, keep): (Vec<_>, Vec<_>) =
                    c.events.drain(..).partition(|e| e.ev.id as usize == p);
                c.events = keep.into();
                m
            }
            None => Vec::new(),
        };
        let c = self.chans.get_mut(&chan).expect("checked above");
        c.events.extend(moved);
        let chp: *mut rdma_event_channel = &mut c.ch.ch;
        let i = self.ids.get_mut(&p).expect("checked above");
        i.chan = chan;
        i.id.id.channel = chp;
        Ok(())
    }

    /// Saves the QP attributes `rdma_get_request` gives the ids of listening id `p`.
    pub fn set_ep_qp(&mut self, p: usize, attr: abi::ibv_qp_init_attr) {
        if let Some(i) = self.ids.get_mut(&p) {
            i.ep_qp = Some(attr);
        }
    }

    /// The QP attributes saved for listening id `p`.
    pub fn ep_qp(&self, p: usize) -> Option<abi::ibv_qp_init_attr> {
        self.ids.get(&p)?.ep_qp
    }

    /// The next event of channel `chan`, handed out (after driving every NIC's CM).
    pub fn next_event(
        &mut self,
        st: &mut State,
        chan: usize,
    ) -> Result<Option<*mut rdma_cm_event>, i32> {
        if !self.chans.contains_key(&chan) {
            return Err(libc::EINVAL);
        }
        self.progress(st);
        let Some(e) = self.chans.get_mut(&chan).and_then(|c| c.events.pop_front()) else {
            return Ok(None);
        };
        Ok(Some(self.hand_out(e)))
    }

    /// The next event of id `p` (a synchronous id's wait), handed out.
    pub fn next_event_of(
        &mut self,
        st: &mut State,
        p: usize,
    ) -> Result<Option<*mut rdma_cm_event>, i32> {
        let chan = self.ids.get(&p).ok_or(libc::EINVAL)?.chan;
        self.progress(st);
        let Some(c) = self.chans.get_mut(&chan) else {
            return Err(libc::EINVAL);
        };
        let Some(k) = c
            .events
            .iter()
            .position(|e| e.ev.id as usize == p || e.ev.listen_id as usize == p)
        else {
            return Ok(None);
        };
        let e = c.events.remove(k).expect("found above");
        Ok(Some(self.hand_out(e)))
    }

    fn hand_out(&mut self, mut e: Box<RbCmEvent>) -> *mut rdma_cm_event {
        let p: *mut rdma_cm_event = &mut e.ev;
        self.delivered.insert(p as usize, e);
        p
    }

    /// The (event, status, id) of a handed-out event.
    pub fn event_info(&self, ev: usize) -> Option<(u32, i32, usize)> {
        self.delivered
            .get(&ev)
            .map(|e| (e.ev.event, e.ev.status, e.ev.id as usize))
    }

    /// A handed-out event's private data (what its `param.conn.private_data` points to).
    pub fn event_private(&self, ev: usize) -> Option<&[u8]> {
        self.delivered.get(&ev).map(|e| &e.private[..])
    }

    /// The QPN and Q_Key a handed-out datagram event carries (`param.ud`).
    pub fn event_ud(&self, ev: usize) -> Option<(u32, u32)> {
        self.delivered.get(&ev)?.ud
    }

    /// Makes datagram listener `p` answer every request at once with UD QP `qpn` (as a
    /// kernel answers for a bound UDP socket), without an event.
    pub fn answer_with(&mut self, p: usize, qpn: u32) {
        if let Some(i) = self.ids.get_mut(&p) {
            i.answer_with = Some(qpn);
        }
    }

    /// Asks NIC `nic`'s CM for the device's interrupt on its next message (see
    /// [`ConnectionManager::arm`]); false when the NIC has no CM.
    pub fn arm_cm(&self, nic: usize) -> bool {
        self.cms.get(&nic).map(ConnectionManager::arm).is_some()
    }

    /// The NIC id `p` is on.
    pub fn id_nic(&self, p: usize) -> Option<usize> {
        self.ids.get(&p)?.nic
    }

    /// The peer's QP, the options to move a QP with and this side's first PSN, once all
    /// three are known (on the active side, the reply's): what `rdma_init_qp_attr` gives.
    pub fn peer_of(&self, p: usize) -> Option<(Endpoint, ConnectOptions, u32)> {
        let i = self.ids.get(&p)?;
        let (remote, opts) = i.remote?;
        Some((remote, opts, i.local_psn?))
    }

    /// A request on id `p` not answered yet: the requester's QP, the options both sides
    /// agree on under `param`, and the first PSN QP `qpn` sends from once the request is
    /// accepted with it (so that the QP is ready before the REP goes out).
    pub fn request_peer(
        &mut self,
        st: &mut State,
        p: usize,
        qpn: u32,
        param: &ConnParam,
    ) -> Result<(Endpoint, ConnectOptions, u32), i32> {
        let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
        let (Phase::Requested(cid), Some(nic)) = (i.phase, i.nic) else {
            return Err(libc::EINVAL);
        };
        let opts = conn_options(param);
        let (remote, mine) = self.cm(st, nic)?.request(cid, &opts).ok_or(libc::EINVAL)?;
        Ok((remote, mine, first_psn(cid, qpn)))
    }

    /// Sets `rdma_cm_id.event` of id `p` (a synchronous id's current event).
    pub fn set_current_event(&mut self, p: usize, ev: *mut rdma_cm_event) {
        if let Some(i) = self.ids.get_mut(&p) {
            i.id.id.event = ev;
        }
    }

    /// `rdma_ack_cm_event`.
    pub fn ack(&mut self, ev: usize) -> Result<(), i32> {
        let e = self.delivered.remove(&ev).ok_or(libc::EINVAL)?;
        let id = e.ev.id as usize;
        if let Some(i) = self.ids.get_mut(&id) {
            if i.id.id.event as usize == ev {
                i.id.id.event = std::ptr::null_mut();
            }
        }
        Ok(())
    }

    /// The contexts of every NIC (`rdma_get_devices`), opening them.
    pub fn devices(&mut self, st: &mut State) -> Vec<*mut abi::ibv_context> {
        Self::local_nics(st)
            .into_iter()
            .filter_map(|i| self.ctx(st, i).ok())
            .collect()
    }

    /// The (source, destination) addresses of id `p`.
    pub fn addrs(&self, p: usize) -> Option<(SocketAddrV4, SocketAddrV4)> {
        self.ids.get(&p).map(|i| (i.src, i.dst))
    }

    /// Queues event `kind` of id `p` on its channel.
    fn queue(
        &mut self,
        p: usize,
        listen: *mut rdma_cm_id,
        kind: u32,
        status: i32,
        conn: Option<(Vec<u8>, u8, u8)>,
    ) {
        let Some(i) = self.ids.get_mut(&p) else {
            return;
        };
        let idp: *mut rdma_cm_id = &mut i.id.id;
        let chan = i.chan;
        let (private, resp, init) = conn.unwrap_or_default();
        let mut e = Box::new(RbCmEvent {
            ev: rdma_cm_event {
                id: idp,
                listen_id: listen,
                event: kind,
                status,
                param: rdma_cm_event_param {
                    conn: rdma_conn_param {
                        private_data: std::ptr::null(),
                        private_data_len: 0,
                        responder_resources: resp,
                        initiator_depth: init,
                        flow_control: 0,
                        retry_count: 0,
                        rnr_retry_count: 0,
                        srq: 0,
                        qp_num: 0,
                    },
                },
            },
            private,
            ud: None,
        });
        // The private data lives in the event (its heap block does not move with it).
        if !e.private.is_empty() {
            let (data, len) = (e.private.as_ptr().cast(), e.private.len().min(255) as u8);
            // (Writing a union's field is safe; `conn` is the member these events use.)
            e.ev.param.conn.private_data = data;
            e.ev.param.conn.private_data_len = len;
        }
        if let Some(c) = self.chans.get_mut(&chan) {
            c.events.push_back(e);
        }
    }

    /// Queues `ESTABLISHED` of datagram id `p`: the peer's UD QP, Q_Key and address.
    /// Queues event `kind` of datagram id `p` with its `param.ud`: the peer (or group) to
    /// reach and, in `private_data`, the private data (`Some`) or the id's join context.
    fn queue_ud(
        &mut self,
        p: usize,
        kind: u32,
        private: UdData,
        ah: abi::ibv_ah_attr,
        qpn: u32,
        qkey: u32,
    ) {
        let (private, context) = match private {
            UdData::Private(v) => (v, std::ptr::null_mut()),
            UdData::Context(c) => (Vec::new(), c),
        };
        self.queue(p, std::ptr::null_mut(), kind, 0, None);
        let Some(chan) = self.ids.get(&p).map(|i| i.chan) else {
            return;
        };
        let Some(e) = self.chans.get_mut(&chan).and_then(|c| c.events.back_mut()) else {
            return;
        };
        e.private = private;
        e.ud = Some((qpn, qkey));
        let (data, len) = match e.private.is_empty() {
            true => (context as *const std::ffi::c_void, 0),
            false => (e.private.as_ptr().cast(), e.private.len().min(255) as u8),
        };
        e.ev.param = rdma_cm_event_param {
            ud: rdma_ud_param {
                private_data: data,
                private_data_len: len,
                ah_attr: ah,
                qp_num: qpn,
                qkey,
            },
        };
    }

    /// `rdma_join_multicast`: a datagram id on a NIC joins IPv4 group `group`; its QP (now,
    /// or when made) receives the group's datagrams. `MULTICAST_JOIN` follows at once,
    /// with the group's address, QPN `0xFFFFFF` and the Q_Key, and `context` in
    /// `private_data`, as librdmacm gives it.
    pub fn join(
        &mut self,
        st: &mut State,
        p: usize,
        group: Ipv4Addr,
        context: *mut std::ffi::c_void,
    ) -> Result<(), i32> {
        let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
        if i.id.id.ps != RDMA_PS_UDP || !group.is_multicast() {
            return Err(libc::EINVAL);
        }
        if i.nic.is_none() {
            return Err(libc::ENODEV);
        }
        if i.groups.contains(&group) {
            return Err(libc::EADDRINUSE);
        }
        let qp = i.id.id.qp;
        if !qp.is_null() {
            let r = with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| {
                crate::flow::attach_mcast(q, gid_bytes(group))
            })
            .ok_or(libc::EINVAL)?;
            if r != 0 {
                return Err(r);
            }
        }
        self.ids
            .get_mut(&p)
            .expect("checked above")
            .groups
            .push(group);
        let ah = ah_to(group);
        self.queue_ud(
            p,
            RDMA_CM_EVENT_MULTICAST_JOIN,
            UdData::Context(context),
            ah,
            ringbell_specs::cmd::MCAST_QPN,
            RDMA_UDP_QKEY,
        );
        Ok(())
    }

    /// `rdma_leave_multicast`: EADDRNOTAVAIL for a group the id has not joined.
    pub fn leave(&mut self, st: &mut State, p: usize, group: Ipv4Addr) -> Result<(), i32> {
        let i = self.ids.get_mut(&p).ok_or(libc::EINVAL)?;
        let k = i
            .groups
            .iter()
            .position(|g| *g == group)
            .ok_or(libc::EADDRNOTAVAIL)?;
        i.groups.remove(k);
        let qp = i.id.id.qp;
        if !qp.is_null() {
            with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| {
                crate::flow::detach_mcast(q, gid_bytes(group))
            });
        }
        Ok(())
    }

    /// The channel descriptors whose readiness must change: (descriptor, readable). A
    /// channel's descriptor is readable while it has events queued (the caller writes or
    /// drains the eventfd); recorded as done.
    pub fn readiness(&mut self) -> Vec<(i32, bool)> {
        let mut out = Vec::new();
        for c in self.chans.values_mut() {
            let want = !c.events.is_empty();
            if c.ch.ch.fd >= 0 && c.ready != want {
                c.ready = want;
                out.push((c.ch.ch.fd, want));
            }
        }
        out
    }

    /// Drives every NIC's CM and turns what happened into events. Never waits for a served
    /// NIC (`poll_nowait`): the callers pace themselves, and a non-blocking call (`rpoll`
    /// with no timeout) should cost no sleep.
    pub(crate) fn progress(&mut self, st: &mut State) {
        let mut got = Vec::new();
        for (&nic, cm) in self.cms.iter_mut() {
            while let Some(e) = cm.poll_nowait() {
                got.push((nic, e));
            }
        }
        for (nic, e) in got {
            self.on_cm_event(st, nic, e);
        }
    }

    /// Ends connection `id` of NIC `nic`'s CM: its id is done. The id, if it still lives.
    fn finish(&mut self, nic: usize, id: ConnId) -> Option<usize> {
        let p = self.conns.remove(&(nic, id))?;
        if let Some(i) = self.ids.get_mut(&p) {
            i.phase = Phase::Done;
        }
        Some(p)
    }

    fn on_cm_event(&mut self, st: &mut State, nic: usize, e: CmEvent) {
        let sidr = matches!(e, CmEvent::SidrRequest { .. });
        match e {
            CmEvent::ConnectRequest {
                id,
                service_id,
                from,
                private,
            }
            | CmEvent::SidrRequest {
                id,
                service_id,
                from,
                private,
            } => self.on_request(
                st,
                nic,
                Request {
                    cid: id,
                    sid: service_id,
                    from,
                    private,
                    sidr,
                },
            ),
            CmEvent::Replied {
                id,
                remote,
                local_psn,
                opts,
                private,
            } => {
                let Some(&p) = self.conns.get(&(nic, id)) else {
                    if let Some(cm) = self.cms.get_mut(&nic) {
                        let _ = cm.refuse(id);
                    }
                    return;
                };
                let qp = self.ids[&p].id.id.qp;
                if let Some(i) = self.ids.get_mut(&p) {
                    i.remote = Some((remote, opts));
                    i.local_psn = Some(local_psn);
                }
                let conn = Some((
                    padded(&private, MAX_ACCEPT_PRIVATE),
                    opts.max_dest_rd_atomic,
                    opts.max_rd_atomic,
                ));
                if qp.is_null() {
                    if let Some(i) = self.ids.get_mut(&p) {
                        i.phase = Phase::Replied(id);
                    }
                    self.queue(
                        p,
                        std::ptr::null_mut(),
                        RDMA_CM_EVENT_CONNECT_RESPONSE,
                        0,
                        conn,
                    );
                    return;
                }
                let cm = self.cms.get_mut(&nic).expect("the event came from it");
                match qp_up(st, qp, &remote, &opts, local_psn)
                    .and_then(|()| cm.establish(id).map_err(|e| crate::errno_of(&e)))
                {
                    Ok(()) => {
                        if let Some(i) = self.ids.get_mut(&p) {
                            i.phase = Phase::Connected(id);
                        }
                        self.queue(p, std::ptr::null_mut(), RDMA_CM_EVENT_ESTABLISHED, 0, conn);
                    }
                    Err(err) => {
                        let _ = cm.refuse(id);
                        self.finish(nic, id);
                        self.queue(
                            p,
                            std::ptr::null_mut(),
                            RDMA_CM_EVENT_CONNECT_ERROR,
                            -err,
                            None,
                        );
                    }
                }
            }
            CmEvent::Ready { id, .. } => {
                let Some(&p) = self.conns.get(&(nic, id)) else {
                    return;
                };
                if let Some(i) = self.ids.get_mut(&p) {
                    i.phase = Phase::Connected(id);
                }
                self.queue(p, std::ptr::null_mut(), RDMA_CM_EVENT_ESTABLISHED, 0, None);
            }
            CmEvent::Rejected {
                id,
                reason,
                private,
                ..
            } => {
                let Some(p) = self.finish(nic, id) else {
                    return;
                };
                let conn = Some((padded(&private, MAX_REJECT_PRIVATE), 0, 0));
                self.queue(
                    p,
                    std::ptr::null_mut(),
                    RDMA_CM_EVENT_REJECTED,
                    i32::from(reason),
                    conn,
                );
            }
            CmEvent::TimedOut { id, .. } => {
                let Some(p) = self.finish(nic, id) else {
                    return;
                };
                self.queue(
                    p,
                    std::ptr::null_mut(),
                    RDMA_CM_EVENT_UNREACHABLE,
                    -libc::ETIMEDOUT,
                    None,
                );
            }
            CmEvent::Disconnected { id } => {
                let Some(p) = self.finish(nic, id) else {
                    return;
                };
                if let Some(i) = self.ids.get_mut(&p) {
                    i.phase = Phase::Disconnected;
                }
                let qp = self
                    .ids
                    .get(&p)
                    .map_or(std::ptr::null_mut(), |i| i.id.id.qp);
                qp_err(st, qp);
                self.queue(p, std::ptr::null_mut(), RDMA_CM_EVENT_DISCONNECTED, 0, None);
            }
            CmEvent::SidrReply {
                id,
                status,
                from,
                qpn,
                qkey,
                private,
            } => {
                let Some(p) = self.finish(nic, id) else {
                    return;
                };
                if status != SIDR_OK {
                    self.queue(
                        p,
                        std::ptr::null_mut(),
                        RDMA_CM_EVENT_UNREACHABLE,
                        i32::from(status),
                        None,
                    );
                    return;
                }
                let private = padded(&private, MAX_SIDR_REPLY_PRIVATE);
                let ah = ah_to(Ipv4Addr::from(from.ip));
                let private = UdData::Private(private);
                self.queue_ud(p, RDMA_CM_EVENT_ESTABLISHED, private, ah, qpn, qkey);
            }
            // Connections whose QP the CM holds are the driver's own API's, not made here.
            CmEvent::Established { .. } => {}
        }
    }

    fn on_request(&mut self, st: &mut State, nic: usize, r: Request) {
        let Request {
            cid,
            sid,
            from,
            private,
            sidr,
        } = r;
        let port = (sid & 0xFFFF) as u16;
        let ps = ((sid >> 16) & 0xFFFF) as u32;
        let listener = self
            .listeners
            .get(&(Some(nic), port))
            .or_else(|| self.listeners.get(&(None, port)))
            .copied()
            .filter(|l| self.ids.get(l).is_some_and(|i| i.id.id.ps == ps))
            // A datagram request comes to a datagram id, a connection to a connected one.
            .filter(|_| sidr == (ps == RDMA_PS_UDP));
        let header_ok = private.len() >= REQ_HEADER && private[0] == 1;
        let (Some(l), true) = (listener, header_ok) else {
            self.refuse_request(nic, cid, sidr, true);
            return;
        };
        // A datagram rsocket's port is answered at once with its UD QP, whichever call
        // drives the CM, as a kernel answers for a bound UDP socket.
        if let Some(qpn) = self
            .ids
            .get(&l)
            .and_then(|i| i.answer_with)
            .filter(|_| sidr)
        {
            if let Some(cm) = self.cms.get_mut(&nic) {
                let _ = cm.sidr_answer(cid, SIDR_OK, qpn, RDMA_UDP_QKEY, &[]);
            }
            return;
        }
        // A listener whose backlog is full (requests from the fabric the program has not
        // taken yet) refuses more: the queue stays bounded whatever the peers send.
        let waiting = self.ids.get(&l).map_or(0, |li| {
            self.chans.get(&li.chan).map_or(0, |c| {
                c.events
                    .iter()
                    .filter(|e| e.ev.listen_id as usize == l)
                    .count()
            })
        });
        if waiting >= self.ids[&l].backlog {
            self.refuse_request(nic, cid, sidr, false);
            return;
        }
        let (chan, context, qp_type) = {
            let li = &self.ids[&l];
            (li.chan, li.id.id.context, li.id.id.qp_type)
        };
        let child = self.new_id(chan, context, ps) as usize;
        // The new id is of its listener's QP type, as librdmacm makes it.
        if let Some(i) = self.ids.get_mut(&child) {
            i.id.id.qp_type = qp_type;
        }
        let src_port = u16::from_be_bytes([private[2], private[3]]);
        let dst = SocketAddrV4::new(Ipv4Addr::from(from.ip), src_port);
        let depths = self
            .cms
            .get(&nic)
            .and_then(|cm| cm.request_depths(cid))
            .unwrap_or((0, 0));
        if let Some(i) = self.ids.get_mut(&child) {
            i.src = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port);
        }
        if self.place(st, child, nic).is_err() {
            self.ids.remove(&child);
            self.refuse_request(nic, cid, sidr, false);
            return;
        }
        let lp: *mut rdma_cm_id = match self.ids.get_mut(&l) {
            Some(li) => &mut li.id.id,
            None => std::ptr::null_mut(),
        };
        let i = self.ids.get_mut(&child).expect("made above");
        i.dst = dst;
        i.id.id.route.addr.dst_storage = sockaddr_of(dst);
        i.id.id.route.addr.addr.dgid = gid_of(*dst.ip());
        i.id.id.route.addr.addr.pkey = 0xFFFF;
        // The requester's initiator depth is this side's responder resources, and the
        // other way round (librdmacm's view of the request).
        i.depths = (depths.0.min(MAX_DEPTH), depths.1.min(MAX_DEPTH));
        // What `rdma_init_qp_attr` gives for RTR: the requester's QP, the request's depths.
        let asked = ConnParam {
            responder_resources: i.depths.0,
            initiator_depth: i.depths.1,
            retry_count: 7,
            rnr_retry_count: 7,
            ..Default::default()
        };
        i.remote = self
            .cms
            .get(&nic)
            .and_then(|cm| cm.request(cid, &conn_options(&asked)));
        i.phase = Phase::Requested(cid);
        self.conns.insert((nic, cid), child);
        let whole = match ps {
            RDMA_PS_UDP => MAX_SIDR_PRIVATE,
            _ => MAX_CONNECT_PRIVATE,
        };
        let conn = Some((padded(&private[REQ_HEADER..], whole), depths.0, depths.1));
        self.queue(child, lp, RDMA_CM_EVENT_CONNECT_REQUEST, 0, conn);
    }
}

/// A request's private data: the header (source port and addresses) and the
/// application's.
fn req_private(src: SocketAddrV4, dst: SocketAddrV4, app: &[u8]) -> Vec<u8> {
    let mut private = vec![0u8; REQ_HEADER];
    private[0] = 1;
    private[2..4].copy_from_slice(&src.port().to_be_bytes());
    private[4..8].copy_from_slice(&src.ip().octets());
    private[8..12].copy_from_slice(&dst.ip().octets());
    private.extend_from_slice(app);
    private
}

/// RESET → INIT (Q_Key [`RDMA_UDP_QKEY`]) → RTR → RTS: a datagram id's UD QP is ready at
/// once, as librdmacm moves it.
fn ud_up(st: &mut State, qp: *mut abi::ibv_qp) -> Result<(), i32> {
    let init = abi::ibv_qp_attr {
        qp_state: abi::ibv_qp_state_IBV_QPS_INIT,
        pkey_index: 0,
        port_num: 1,
        qkey: RDMA_UDP_QKEY,
        ..Default::default()
    };
    move_qp(
        st,
        qp,
        &init,
        abi::ibv_qp_attr_mask_IBV_QP_STATE
            | abi::ibv_qp_attr_mask_IBV_QP_PKEY_INDEX
            | abi::ibv_qp_attr_mask_IBV_QP_PORT
            | abi::ibv_qp_attr_mask_IBV_QP_QKEY,
    )?;
    let rtr = abi::ibv_qp_attr {
        qp_state: abi::ibv_qp_state_IBV_QPS_RTR,
        ..Default::default()
    };
    move_qp(st, qp, &rtr, abi::ibv_qp_attr_mask_IBV_QP_STATE)?;
    let rts = abi::ibv_qp_attr {
        qp_state: abi::ibv_qp_state_IBV_QPS_RTS,
        sq_psn: 0,
        ..Default::default()
    };
    move_qp(
        st,
        qp,
        &rts,
        abi::ibv_qp_attr_mask_IBV_QP_STATE | abi::ibv_qp_attr_mask_IBV_QP_SQ_PSN,
    )
}

impl Cma {
    /// Refuses request `cid` of NIC `nic`'s CM: nobody listens (`unknown`), or the
    /// library could not take it.
    fn refuse_request(&mut self, nic: usize, cid: ConnId, sidr: bool, unknown: bool) {
        let Some(cm) = self.cms.get_mut(&nic) else {
            return;
        };
        let _ = match (sidr, unknown) {
            (true, true) => cm.sidr_answer(cid, SIDR_NO_SERVICE, 0, 0, &[]),
            (true, false) => cm.sidr_answer(cid, SIDR_REJECTED, 0, 0, &[]),
            (false, true) => cm.reject(cid, REJ_INVALID_SERVICE_ID, &[]),
            (false, false) => cm.reject(cid, REJ_CONSUMER, &[]),
        };
    }
}

/// Address handle attributes that reach `ip` (a NIC, or a multicast group) over the
/// fabric.
fn ah_to(ip: Ipv4Addr) -> abi::ibv_ah_attr {
    let mut ah = abi::ibv_ah_attr {
        is_global: 1,
        port_num: 1,
        ..Default::default()
    };
    ah.grh.dgid = gid_of(ip);
    ah.grh.hop_limit = 64;
    ah
}

/// The connection options of `param` (depths capped at the NIC's).
fn conn_options(param: &ConnParam) -> ConnectOptions {
    ConnectOptions {
        max_rd_atomic: param.initiator_depth.min(MAX_DEPTH),
        max_dest_rd_atomic: param.responder_resources.min(MAX_DEPTH),
        retry_cnt: param.retry_count.min(7),
        rnr_retry: param.rnr_retry_count.min(7),
        ..ConnectOptions::default()
    }
}

impl Cma {
    /// `rdma_init_qp_attr`: the attributes (and mask) that move a QP of id `p` to `state`
    /// as the library moves its own: INIT once the id is on a NIC, RTR once the peer's QP
    /// is known (the request, or the reply), RTS once this side's first PSN is (the
    /// accept, or the reply). EINVAL before that, or for another state.
    pub fn init_qp_attr(&self, p: usize, state: u32) -> Result<(abi::ibv_qp_attr, u32), i32> {
        let i = self.ids.get(&p).ok_or(libc::EINVAL)?;
        i.nic.ok_or(libc::EINVAL)?;
        let ud = i.id.id.ps == RDMA_PS_UDP;
        match state {
            abi::ibv_qp_state_IBV_QPS_INIT => {
                let mut a = abi::ibv_qp_attr {
                    qp_state: state,
                    pkey_index: 0,
                    port_num: 1,
                    ..Default::default()
                };
                let mut mask = abi::ibv_qp_attr_mask_IBV_QP_STATE
                    | abi::ibv_qp_attr_mask_IBV_QP_PKEY_INDEX
                    | abi::ibv_qp_attr_mask_IBV_QP_PORT;
                if ud {
                    a.qkey = RDMA_UDP_QKEY;
                    mask |= abi::ibv_qp_attr_mask_IBV_QP_QKEY;
                } else {
                    a.qp_access_flags = abi::ibv_access_flags_IBV_ACCESS_REMOTE_WRITE
                        | abi::ibv_access_flags_IBV_ACCESS_REMOTE_READ
                        | abi::ibv_access_flags_IBV_ACCESS_REMOTE_ATOMIC;
                    mask |= abi::ibv_qp_attr_mask_IBV_QP_ACCESS_FLAGS;
                }
                Ok((a, mask))
            }
            abi::ibv_qp_state_IBV_QPS_RTR if ud => Ok((
                abi::ibv_qp_attr {
                    qp_state: state,
                    ..Default::default()
                },
                abi::ibv_qp_attr_mask_IBV_QP_STATE,
            )),
            abi::ibv_qp_state_IBV_QPS_RTS if ud => Ok((
                abi::ibv_qp_attr {
                    qp_state: state,
                    ..Default::default()
                },
                abi::ibv_qp_attr_mask_IBV_QP_STATE | abi::ibv_qp_attr_mask_IBV_QP_SQ_PSN,
            )),
            abi::ibv_qp_state_IBV_QPS_RTR => {
                let (remote, o) = i.remote.as_ref().ok_or(libc::EINVAL)?;
                Ok(rtr_attr(remote, o))
            }
            abi::ibv_qp_state_IBV_QPS_RTS => {
                let (_, o) = i.remote.as_ref().ok_or(libc::EINVAL)?;
                let psn = i.local_psn.ok_or(libc::EINVAL)?;
                Ok(rts_attr(o, psn))
            }
            _ => Err(libc::EINVAL),
        }
    }
}

/// The RTR attributes towards `remote` under `o`, and their mask.
fn rtr_attr(remote: &Endpoint, o: &ConnectOptions) -> (abi::ibv_qp_attr, u32) {
    let mut rtr = abi::ibv_qp_attr {
        qp_state: abi::ibv_qp_state_IBV_QPS_RTR,
        path_mtu: u32::from(o.path_mtu),
        dest_qp_num: remote.qpn,
        rq_psn: remote.psn,
        max_dest_rd_atomic: o.max_dest_rd_atomic,
        min_rnr_timer: o.min_rnr_timer,
        ah_attr: ah_to(Ipv4Addr::from(remote.ip)),
        ..Default::default()
    };
    rtr.ah_attr.port_num = 1;
    let mask = abi::ibv_qp_attr_mask_IBV_QP_STATE
        | abi::ibv_qp_attr_mask_IBV_QP_AV
        | abi::ibv_qp_attr_mask_IBV_QP_PATH_MTU
        | abi::ibv_qp_attr_mask_IBV_QP_DEST_QPN
        | abi::ibv_qp_attr_mask_IBV_QP_RQ_PSN
        | abi::ibv_qp_attr_mask_IBV_QP_MAX_DEST_RD_ATOMIC
        | abi::ibv_qp_attr_mask_IBV_QP_MIN_RNR_TIMER;
    (rtr, mask)
}

/// The RTS attributes under `o`, sending from `psn`, and their mask.
fn rts_attr(o: &ConnectOptions, psn: u32) -> (abi::ibv_qp_attr, u32) {
    let rts = abi::ibv_qp_attr {
        qp_state: abi::ibv_qp_state_IBV_QPS_RTS,
        sq_psn: psn & 0x00FF_FFFF,
        timeout: o.timeout,
        retry_cnt: o.retry_cnt,
        rnr_retry: o.rnr_retry,
        max_rd_atomic: o.max_rd_atomic,
        ..Default::default()
    };
    let mask = abi::ibv_qp_attr_mask_IBV_QP_STATE
        | abi::ibv_qp_attr_mask_IBV_QP_SQ_PSN
        | abi::ibv_qp_attr_mask_IBV_QP_TIMEOUT
        | abi::ibv_qp_attr_mask_IBV_QP_RETRY_CNT
        | abi::ibv_qp_attr_mask_IBV_QP_RNR_RETRY
        | abi::ibv_qp_attr_mask_IBV_QP_MAX_QP_RD_ATOMIC;
    (rts, mask)
}

/// Moves QP `qp` (a ringbell `ibv_qp`) with `attr` under `mask`.
fn move_qp(
    st: &mut State,
    qp: *mut abi::ibv_qp,
    attr: &abi::ibv_qp_attr,
    mask: u32,
) -> Result<(), i32> {
    match with_held(st, qp as *mut RbQp, Kind::Qp, |_, q| {
        crate::qp::modify(q, attr, mask)
    }) {
        Some(0) => Ok(()),
        Some(e) => Err(e),
        None => Err(libc::EINVAL),
    }
}

/// INIT → RTR towards `remote` → RTS sending from `psn`, as librdmacm moves a connected QP.
fn qp_up(
    st: &mut State,
    qp: *mut abi::ibv_qp,
    remote: &Endpoint,
    o: &ConnectOptions,
    psn: u32,
) -> Result<(), i32> {
    let (rtr, m) = rtr_attr(remote, o);
    move_qp(st, qp, &rtr, m)?;
    let (rts, m) = rts_attr(o, psn);
    move_qp(st, qp, &rts, m)
}

/// Moves QP `qp` (if any) to ERR: its outstanding work requests flush.
fn qp_err(st: &mut State, qp: *mut abi::ibv_qp) {
    if qp.is_null() {
        return;
    }
    let err = abi::ibv_qp_attr {
        qp_state: abi::ibv_qp_state_IBV_QPS_ERR,
        ..Default::default()
    };
    let _ = move_qp(st, qp, &err, abi::ibv_qp_attr_mask_IBV_QP_STATE);
}

/// `rdma_event_str`.
pub fn event_str(e: u32) -> &'static std::ffi::CStr {
    match e {
        RDMA_CM_EVENT_ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        RDMA_CM_EVENT_ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        RDMA_CM_EVENT_ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        RDMA_CM_EVENT_ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        RDMA_CM_EVENT_CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        RDMA_CM_EVENT_CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        RDMA_CM_EVENT_CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        RDMA_CM_EVENT_UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        RDMA_CM_EVENT_REJECTED => c"RDMA_CM_EVENT_REJECTED",
        RDMA_CM_EVENT_ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        RDMA_CM_EVENT_DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        RDMA_CM_EVENT_DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        RDMA_CM_EVENT_MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        RDMA_CM_EVENT_MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        RDMA_CM_EVENT_ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        RDMA_CM_EVENT_TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage_bytes(s: &[u64; 16]) -> Vec<u8> {
        s.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    #[test]
    fn service_ids_are_the_kernels() {
        assert_eq!(service_id(RDMA_PS_TCP, 7174), 0x0000_0000_0106_1C06);
        assert_eq!(service_id(RDMA_PS_IB, 1), 0x0000_0000_013F_0001);
    }

    #[test]
    fn socket_addresses_are_laid_out_as_sockaddr_in() {
        let s = sockaddr_of(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 7174));
        let b = storage_bytes(&s);
        assert_eq!(&b[0..2], &(libc::AF_INET as u16).to_ne_bytes());
        assert_eq!(&b[2..4], &7174u16.to_be_bytes());
        assert_eq!(&b[4..8], &[10, 0, 0, 2]);
        assert!(b[8..].iter().all(|&x| x == 0));
    }

    #[test]
    fn private_areas_are_zero_filled_to_the_message() {
        assert_eq!(padded(&[1, 2], 4), vec![1, 2, 0, 0]);
        assert_eq!(padded(&[1, 2, 3], 2), vec![1, 2, 3]);
    }
}
