//! The provider's objects (domains, completion queues, address vectors, memory regions,
//! endpoints, event queues) and their data path, in safe Rust, behind one process-wide lock.
//!
//! Every object libfabric sees is a leaked box holding its `fid_*` structure; the address of
//! that box is the key of the object in [`State::objs`], so a pointer that is not a live
//! object of the expected kind is refused (`-FI_EINVAL`) before anything reads it.
//!
//! Reliable datagrams over RC: an endpoint listens on its own CM service id; the first send
//! to an address connects an RC QP through [`ConnectionManager`] (the REQ's private data is
//! the sender's own 16-byte address, so the passive side knows whom the connection reaches);
//! sends wait until the connection is established. Every RC QP of an endpoint receives from
//! the endpoint's one SRQ and completes on its one driver CQ. Progress is manual: reading a
//! completion queue polls the CMs and the driver CQs.
//!
//! Tagged messages go over a second channel of RC connections per peer ([`CH_TAG`]) whose
//! QPs belong to the endpoint's tag matcher (the driver's [`ringbell::tagmatch`]): the NIC
//! matches them against the receives in its hardware list of the endpoint's TM-SRQ, and
//! the matcher's software half matches the rest in MPI order ([`tagged`] says what goes
//! where). On the in-process fabric ([`State::fabric`]) the polls of progress are what
//! steps the emulator; a CM with nothing to do but wait lets the idle clock run to its
//! next timer ([`ConnectionManager::poll`]).

mod av;
mod bounce;
mod dgram;
mod msgep;
mod multi;
pub mod names;
mod peek;
pub mod sep;
mod tagged;
mod wait;

use crate::abi;
use ringbell::cm::{CmEvent, ConnId, ConnectionManager, REJ_CONSUMER};
use ringbell::{
    Access, AhAttr, CompletionQueue, ConnectOptions, Device, DmaBuffer, MemoryRegion,
    ProtectionDomain, QpInit, QpState, QueuePair, RemoteAddr, SendWr, Sge, SharedReceiveQueue,
    WcOpcode, WcStatus, WorkCompletion, WrOp,
};
use ringbell::{Counter, TriggerHandle};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

mod trig;
pub use av::Av;
pub use msgep::{ConnReq, Eq, EqErr, EqEvent, ListenAttrs, MsgEp, Pep};
pub use sep::{Sep, MAX_EP_CTX};
pub use tagged::{TagCounts, EAGER_MAX};
pub use trig::{Trig, WorkOp};
pub use wait::{sleep_on, sleep_on_any, FdWait, WaitSet};

/// Length of an endpoint address.
pub const ADDR_LEN: usize = 16;
/// An endpoint address: magic "RB", version 1, reserved, the NIC's IPv4 address, the
/// endpoint's CM service id (little endian).
pub type Addr = [u8; ADDR_LEN];
/// The largest inline (injected) send.
pub const INJECT: usize = crate::info::INJECT_SIZE;
/// `FI_ADDR_UNSPEC`.
pub const ADDR_UNSPEC: u64 = u64::MAX;

/// An address as the fabric knows it: one whose IPv4 address is no NIC's (this host's,
/// such as 127.0.0.1) names the endpoint published under its service on this host
/// ([`names`]), if there is one; any other is itself.
pub fn resolve_addr(a: &Addr) -> Addr {
    match parse_addr(a) {
        Some((ip, service)) if AhAttr::on_fabric(ip).is_none() => {
            names::resolve(service).map_or(*a, |nic| make_addr(nic_ip(nic), service))
        }
        _ => *a,
    }
}

/// Builds an address.
pub fn make_addr(ip: [u8; 4], service: u64) -> Addr {
    let mut a = [0u8; ADDR_LEN];
    a[0] = b'R';
    a[1] = b'B';
    a[2] = 1;
    a[4..8].copy_from_slice(&ip);
    a[8..16].copy_from_slice(&service.to_le_bytes());
    a
}

/// The IPv4 address and service id of a valid address.
pub fn parse_addr(b: &[u8]) -> Option<([u8; 4], u64)> {
    if b.len() < ADDR_LEN || b[0] != b'R' || b[1] != b'B' || b[2] != 1 {
        return None;
    }
    let ip = [b[4], b[5], b[6], b[7]];
    let mut s = [0u8; 8];
    s.copy_from_slice(&b[8..16]);
    Some((ip, u64::from_le_bytes(s)))
}

/// The textual form of an address (`fi_av_straddr`): a `struct sockaddr_in` as
/// `fi_sockaddr_in://a.b.c.d:port` (libfabric's own form), the native address as
/// `ringbell://a.b.c.d/service`.
pub fn addr_str(b: &[u8]) -> String {
    if let Some((ip, port)) = parse_sockaddr_in(b) {
        return format!(
            "fi_sockaddr_in://{}.{}.{}.{}:{port}",
            ip[0], ip[1], ip[2], ip[3]
        );
    }
    match parse_addr(b) {
        Some((ip, s)) => format!("ringbell://{}.{}.{}.{}/{s:#x}", ip[0], ip[1], ip[2], ip[3]),
        None => "ringbell://invalid".to_string(),
    }
}

/// `AF_INET`, the family of a `struct sockaddr_in` (native byte order).
pub const AF_INET: u16 = 2;
/// Bytes of a `struct sockaddr_in`.
pub const SOCKADDR_IN_LEN: usize = 16;
/// The largest service number a `struct sockaddr_in` carries (its port).
pub const MAX_PORT: u64 = 0xFFFF;

/// How an object gives addresses out: the provider's own 16 bytes ([`make_addr`]), or a
/// `struct sockaddr_in` of the NIC's IPv4 address and the service number as its port
/// (`FI_SOCKADDR_IN`, which `FI_SOCKADDR` hints get too). Both are 16 bytes, and every
/// input accepts either ([`addr_from_bytes`]): the native magic "RB" is no address
/// family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Native,
    SockaddrIn,
}

impl Format {
    /// The format of an info's `addr_format` (anything but the sockaddr formats is the
    /// provider's own).
    pub fn of(addr_format: u32) -> Format {
        if addr_format == abi::FI_SOCKADDR_IN || addr_format == abi::FI_SOCKADDR {
            Format::SockaddrIn
        } else {
            Format::Native
        }
    }

    /// The info's `addr_format` for this format.
    pub fn addr_format(self) -> u32 {
        match self {
            Format::Native => crate::info::ADDR_FORMAT,
            Format::SockaddrIn => abi::FI_SOCKADDR_IN,
        }
    }

    /// Address `a` in this format. A service number too large for a port (which no
    /// sockaddr-format object is given) keeps the native form, which every input takes.
    pub fn out(self, a: &Addr) -> Addr {
        match (self, parse_addr(a)) {
            (Format::SockaddrIn, Some((ip, s))) if s <= MAX_PORT => sockaddr_in(ip, s as u16),
            _ => *a,
        }
    }
}

/// A `struct sockaddr_in`: family `AF_INET` (native endian), `port` and `ip` in network
/// byte order, eight zero bytes.
pub fn sockaddr_in(ip: [u8; 4], port: u16) -> Addr {
    let mut a = [0u8; ADDR_LEN];
    a[0..2].copy_from_slice(&AF_INET.to_ne_bytes());
    a[2..4].copy_from_slice(&port.to_be_bytes());
    a[4..8].copy_from_slice(&ip);
    a
}

/// The IPv4 address and port of a `struct sockaddr_in` (at least 16 bytes, family
/// `AF_INET`; the padding is not looked at).
pub fn parse_sockaddr_in(b: &[u8]) -> Option<([u8; 4], u16)> {
    if b.len() < SOCKADDR_IN_LEN || u16::from_ne_bytes([b[0], b[1]]) != AF_INET {
        return None;
    }
    Some(([b[4], b[5], b[6], b[7]], u16::from_be_bytes([b[2], b[3]])))
}

/// An address as the caller gave it, in either format: a native address, or a `struct
/// sockaddr_in` (which names the same endpoint as the native address of its IPv4 address
/// and its port as the service number). `None` for anything else, or too few bytes.
pub fn addr_from_bytes(b: &[u8]) -> Option<Addr> {
    if let Some((ip, port)) = parse_sockaddr_in(b) {
        return Some(make_addr(ip, u64::from(port)));
    }
    parse_addr(b)?;
    b.get(..ADDR_LEN)?.try_into().ok()
}

/// An address that names a peer (`fi_av_insert`, `fi_connect`), in either format; a
/// `struct sockaddr_in` must name one: not the wildcard 0.0.0.0 (`INADDR_ANY`, which only
/// a source address may be) and not port 0 (no endpoint has it). `-FI_EINVAL` otherwise.
pub fn dest_from_bytes(b: &[u8]) -> Result<Addr, Errno> {
    if let Some((ip, port)) = parse_sockaddr_in(b) {
        if ip == [0; 4] || port == 0 {
            return Err(EINVAL);
        }
    }
    addr_from_bytes(b).ok_or(EINVAL)
}

/// The access bits `fi_mr_reg(3)` defines.
const MR_ACCESS_BITS: u64 = (abi::FI_SEND
    | abi::FI_RECV
    | abi::FI_READ
    | abi::FI_WRITE
    | abi::FI_REMOTE_READ
    | abi::FI_REMOTE_WRITE
    | abi::FI_COLLECTIVE) as u64;

/// The device rights of a region registered with libfabric `access` bits: local use always
/// (buffers of any local operation); `FI_REMOTE_READ` lets peers read it, `FI_REMOTE_WRITE`
/// lets them write it and run atomics on it (fi_mr(3): "the target buffer of an RMA write or
/// atomic operation"). A bit `fi_mr_reg(3)` does not define is `-FI_EINVAL`.
pub fn mr_access(access: u64) -> Result<Access, Errno> {
    if access & !MR_ACCESS_BITS != 0 {
        return Err(EINVAL);
    }
    let mut acc = Access::LOCAL_WRITE;
    if access & abi::FI_REMOTE_READ as u64 != 0 {
        acc |= Access::REMOTE_READ;
    }
    if access & abi::FI_REMOTE_WRITE as u64 != 0 {
        acc |= Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    }
    Ok(acc)
}

/// What kind of object a key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Fabric,
    Eq,
    Pep,
    ConnReq,
    Domain,
    Cq,
    Av,
    Mr,
    Ep,
    Cntr,
    Alias,
    Poll,
    Wait,
    Stx,
}

/// A completion as libfabric's CQ formats carry it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub ctx: u64,
    pub flags: u64,
    pub len: u64,
    pub buf: u64,
    pub data: u64,
    pub tag: u64,
    /// Source address (`fi_cq_readfrom`): the sender's AV index for receives of datagram
    /// endpoints, tagged receives and, with FI_SOURCE, every receive; else not available.
    pub src: u64,
    /// Bytes lost to truncation (error entries).
    pub olen: u64,
    /// 0 for success, else a positive libfabric error number.
    pub err: i32,
    pub prov_errno: i32,
}

pub struct Cq {
    /// Words per entry: 1 (CONTEXT), 3 (MSG), 5 (DATA), 6 (TAGGED).
    pub words: usize,
    pub entries: VecDeque<Entry>,
    pub errs: VecDeque<Entry>,
    /// `fi_cq_signal` was called: the next `fi_cq_sread` that would wait returns.
    pub signaled: bool,
    /// The wait object asked for (`fi_cq_attr::wait_obj`) and, for `FI_WAIT_FD`, its
    /// descriptor ([`wait`]).
    pub wait_obj: u32,
    pub wait: Option<FdWait>,
    /// The wait set it belongs to (`FI_WAIT_SET`).
    pub wait_set: Option<usize>,
}

pub struct Domain {
    pub nic: usize,
    /// The address format of the info it was opened with.
    pub format: Format,
    pub pd: ProtectionDomain,
    /// Deferred work queued to the domain (`FI_QUEUE_WORK`) and not known to be over, by
    /// the address of its `struct fi_deferred_work`.
    pub work: HashMap<u64, trig::Work>,
    /// Where the bytes of untagged messages longer than their receive land (see
    /// [`SINK_LEN`]); made when the domain's first endpoint is enabled.
    sink: Option<Sink>,
}

/// Bytes of the overflow every untagged receive ends with: an SGE after the caller's
/// buffers, in memory nobody reads, so that a message longer than the buffers still lands
/// (its excess there) and completes, reported as `FI_ETRUNC` with the bytes cut off
/// (fi_msg(3)), instead of failing the connection as an RC SEND too long for its receive
/// does. One per domain, shared by its endpoints. 64 MiB: on the emulator the memory file
/// is sparse (only bytes written take memory), but a device behind the kernel's VFIO pins
/// what is mapped; a message more than this longer than its receive still fails the
/// connection (`FI_EIO` at both ends), as before.
const SINK_LEN: u32 = 64 << 20;

/// The overflow of a domain's untagged receives (the registration before the memory).
struct Sink {
    mr: MemoryRegion,
    _buf: DmaBuffer,
}

/// An event counter (`fi_cntr_open`): the device's counter in the domain's PD.
pub struct Cntr {
    pub domain: usize,
    pub c: Counter,
    /// The wait set it belongs to (`FI_WAIT_SET`), with its values (success, error) as
    /// `fi_wait` last reported them.
    pub wait_set: Option<(usize, (u64, u64))>,
    /// Its descriptor (`FI_WAIT_FD`, [`wait`]), readable while its values (success,
    /// error) differ from `seen`: the values the application last read, or that
    /// `fi_trywait` last reported.
    pub wait: Option<FdWait>,
    pub seen: (u64, u64),
    /// The wait object it was opened with.
    pub wait_obj: u32,
}

/// The counters bound to an endpoint (`fi_ep_bind` with a counter), by key.
#[derive(Clone, Copy, Debug, Default)]
pub struct EpCntrs {
    pub send: Option<usize>,
    pub recv: Option<usize>,
    pub read: Option<usize>,
    pub write: Option<usize>,
    pub remote_read: Option<usize>,
    pub remote_write: Option<usize>,
}

pub struct Mr {
    pub mr: MemoryRegion,
    /// The device rights it was registered with.
    pub access: Access,
}

/// How long closing an endpoint waits for its sends to go out and complete.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(3);

/// The channel of a connection: untagged messages (received on the endpoint's SRQ) or
/// tagged messages (the QPs of the endpoint's tag matcher, on its TM-SRQ).
pub const CH_MSG: u8 = 0;
/// See [`CH_MSG`].
pub const CH_TAG: u8 = 1;

type ConnKey = (Addr, u8);

enum Conn {
    /// Connecting (or accepting): the sends that wait.
    Pending(ConnId, Vec<Pending>),
    Up(ConnId, Box<QueuePair>),
    /// A tagged channel's connection, up: connection `.1` of the endpoint's tag matcher,
    /// which owns the QP.
    Tag(ConnId, usize),
}

struct Pending {
    wr_id: u64,
    sges: Vec<Sge>,
    inline: Option<Vec<u8>>,
    imm: Option<u32>,
    /// Any other operation (RMA, atomics): posted as it is, over `sges` or `inline`.
    wr: Option<WrOp>,
    /// Posted as a triggered operation (held by the NIC until its counter reaches the
    /// threshold), not sent at once.
    trig: Option<trig::TrigPost>,
    /// A tagged send through the tag matcher (`wr_id` is its id).
    tsend: Option<tagged::TSendReq>,
}

struct Op {
    ctx: u64,
    send: bool,
    report: bool,
    buf: u64,
    /// A receive: the bytes its buffers hold (a longer message is truncated to them).
    room: u64,
    _tmp: Vec<MemoryRegion>,
    /// An injected message too long to be inline: the copy its registration covers.
    _copy: Vec<u8>,
    kind: OpKind,
}

/// What a work request of an endpoint is.
enum OpKind {
    /// An untagged send or receive.
    Msg,
    /// An RMA or atomic operation; its completion carries `flags`.
    Rma { flags: u64 },
    /// A triggered transfer (any kind); its completion carries `flags`.
    Trig(trig::TrigOp),
    /// The WQE over the free part of a multi-receive buffer.
    Multi(multi::MultiRecv),
}

/// The completion entry of an untagged message operation: `len` bytes at `buf`, `cut`
/// bytes cut off (an error entry `FI_ETRUNC`), or an error entry `FI_EIO` when work
/// completion `w` failed; remote CQ data from `w`.
fn msg_entry(ctx: u64, flags: u64, (len, buf): (u64, u64), cut: u64, w: &WorkCompletion) -> Entry {
    let ok = w.status == WcStatus::Success;
    Entry {
        ctx,
        flags,
        len,
        buf,
        src: ADDR_UNSPEC,
        olen: cut,
        err: match (ok, cut) {
            (false, _) => abi::FI_EIO as i32,
            (true, 0) => 0,
            (true, _) => abi::FI_ETRUNC as i32,
        },
        prov_errno: if ok { 0 } else { w.status as i32 },
        data: w.imm.map_or(0, u64::from),
        ..Default::default()
    }
}

/// The IPv4 address of NIC `i` in the fabric's address plan (node `i + 1`: `10.0.hi.lo`,
/// as [`AhAttr::on_fabric`] reads it).
pub fn nic_ip(i: usize) -> [u8; 4] {
    let n = i + 1;
    [10, 0, (n >> 8) as u8, n as u8]
}

/// A tagged send waiting for its completion (an eager send's, or a rendezvous send's FIN).
struct TSend {
    ctx: u64,
    report: bool,
    /// The copy the receiver reads, unless the data is eager or in a registered region.
    _bounce: Option<bounce::Bounce>,
}

pub struct Ep {
    pub domain: usize,
    pub nic: usize,
    pub addr: Addr,
    pub service: u64,
    /// The service number was the application's (`fi_getinfo` with `FI_SOURCE`): the
    /// endpoint is published under it while enabled ([`names`]).
    pub named: bool,
    /// The service number is one the provider claimed on the fabric ([`names::claim`],
    /// for the sockaddr formats), published from the start and withdrawn at close.
    pub claimed: bool,
    /// The format its addresses are given out in (`fi_getname`), its info's.
    pub format: Format,
    pub av: Option<usize>,
    pub txcq: Option<usize>,
    /// The shared transmit context it is bound to (`fi_ep_bind` of an stx).
    pub stx: Option<usize>,
    /// This endpoint is a shared receive context (`fi_srx_context`): an SRQ, receives
    /// posted to it and their operations, for the endpoints bound to it.
    pub srx: bool,
    /// The shared receive context it is bound to: its connections' QPs take receives
    /// from that context's SRQ, and completions of those receives are the context's.
    pub rx_shared: Option<usize>,
    pub rxcq: Option<usize>,
    pub tx_selective: bool,
    pub rx_selective: bool,
    /// The default operation flags (the info's `tx_attr`/`rx_attr->op_flags`): with
    /// selective completion, calls without a flags argument report iff these hold
    /// FI_COMPLETION (fi_endpoint(3)).
    pub tx_op_flags: u64,
    pub rx_op_flags: u64,
    pub enabled: bool,
    /// Accept tagged messages only from a receive's source address (FI_DIRECTED_RECV).
    pub directed: bool,
    /// Name the sender of every receive (FI_SOURCE): untagged receives look up the
    /// connection their message came on.
    pub source: bool,
    conns: HashMap<ConnKey, Conn>,
    extra: Vec<(ConnKey, Conn)>,
    /// Connections whose QP failed (a work request completed in error, which moves an RC
    /// QP to the error state): kept until the endpoint closes so that the work requests
    /// still on them complete (flushed); the next operation to that peer connects anew.
    dead: Vec<Conn>,
    ops: HashMap<u64, Op>,
    next_wr: u64,
    /// A datagram endpoint's UD QP ([`dgram`]); `None` for an RDM endpoint. (Declared
    /// before the CQ it completes on, so dropped first.)
    dgram: Option<Box<dgram::Dgram>>,
    /// A connected endpoint's state (`FI_EP_MSG`, [`msgep`]); `None` for RDM and datagram
    /// endpoints.
    pub msg: Option<MsgEp>,
    srq: Option<SharedReceiveQueue>,
    cq: Option<CompletionQueue>,
    /// The tag matcher of the tagged channel: its TM-SRQ, CQ and connections.
    tm: Option<ringbell::tagmatch::TagMatcher>,
    /// Tagged receives posted to the matcher, by id.
    trecvs: HashMap<u64, tagged::TRecv>,
    /// The peer each of the matcher's connections reaches, by connection index.
    tconn_peer: Vec<Addr>,
    /// Peers named as a receive's source: the matcher's peer id is the index.
    peer_ids: Vec<Addr>,
    /// Tagged sends waiting for their completion, by id.
    tsends: HashMap<u64, TSend>,
    /// Bound counters.
    pub cntrs: EpCntrs,
    /// The domain's overflow SGE that ends each untagged receive (see [`SINK_LEN`]), taken
    /// when the endpoint is enabled (the domain outlives its endpoints).
    sink: Option<Sge>,
    /// `FI_OPT_MIN_MULTI_RECV`: a multi-receive buffer with fewer bytes free is released.
    pub min_multi_recv: u64,
    /// A multi-receive buffer's WQE is on the SRQ: later receives wait in `rx_held`.
    multi_posted: bool,
    /// Receives posted behind a multi-receive buffer in use, in order ([`multi`]).
    rx_held: VecDeque<multi::Held>,
    /// A scalable endpoint, or one of its contexts ([`sep`]).
    pub sep: Option<Sep>,
    /// A shared receive context's kind, fixed by the first endpoint bound to it or the
    /// first receive posted to it: receives of datagram endpoints (each behind a GRH area,
    /// [`dgram`]) or of RC connections (each followed by the overflow).
    pub srx_dgram: Option<bool>,
}

pub enum Obj {
    Fabric,
    Eq(Eq),
    Pep(Pep),
    ConnReq(ConnReq),
    Domain(Box<Domain>),
    Cq(Cq),
    Av(Av),
    Mr(Mr),
    Ep(Box<Ep>),
    Cntr(Cntr),
    Alias(Alias),
    Poll(Poll),
    Wait(WaitSet),
    /// A shared transmit context (`fi_stx_context`) of a domain. Endpoints bound to it
    /// send as they would on contexts of their own: sharing is the application's way to
    /// bound resources, and each endpoint's sends keep their order and completions.
    Stx,
}

/// A poll set (`fi_poll_open`, fi_poll(3)): CQs and counters of one domain, checked for
/// events together.
#[derive(Debug, Default)]
pub struct Poll {
    /// The members in the order they were added, each counter with its values (success,
    /// error) as the poll set last reported them.
    pub members: Vec<(usize, Option<(u64, u64)>)>,
}

/// An alias of an endpoint (`fi_ep_alias`, fi_endpoint(3)): the same endpoint reached
/// through another `fid_ep`, with default operation flags of its own.
#[derive(Debug)]
pub struct Alias {
    /// The endpoint it stands for.
    pub ep: usize,
    pub tx_op_flags: u64,
    pub rx_op_flags: u64,
}

impl Obj {
    pub fn kind(&self) -> Kind {
        match self {
            Obj::Fabric => Kind::Fabric,
            Obj::Eq(_) => Kind::Eq,
            Obj::Pep(_) => Kind::Pep,
            Obj::ConnReq(_) => Kind::ConnReq,
            Obj::Domain(_) => Kind::Domain,
            Obj::Cq(_) => Kind::Cq,
            Obj::Av(_) => Kind::Av,
            Obj::Mr(_) => Kind::Mr,
            Obj::Ep(_) => Kind::Ep,
            Obj::Cntr(_) => Kind::Cntr,
            Obj::Alias(_) => Kind::Alias,
            Obj::Poll(_) => Kind::Poll,
            Obj::Wait(_) => Kind::Wait,
            Obj::Stx => Kind::Stx,
        }
    }
}

pub struct Nic {
    pub dev: Device,
    pub cm: ConnectionManager,
}

#[derive(Default)]
pub struct State {
    pub objs: HashMap<usize, Obj>,
    pub nics: HashMap<usize, Nic>,
    pub next_service: u64,
    /// The in-process fabric (without `RINGBELL_SERVE`): made when its first NIC opens,
    /// with the plan's NIC count and seed, and kept for the life of the process.
    pub fabric: Option<ringbell_emu::Fabric>,
    /// The object each domain-level object was opened in (its domain), and each domain's
    /// and event queue's fabric: what `fi_close` of a parent checks.
    pub parents: HashMap<usize, usize>,
    /// COUNTER events of armed counters (the provider's timing ops), by NIC.
    pub cntr_events: HashMap<usize, Vec<ringbell::AsyncEvent>>,
    /// The counters (NIC, number) armed by the timing ops, whose events are kept; those
    /// `fi_trywait` arms only wake.
    pub timing_armed: std::collections::BTreeSet<(usize, u32)>,
    /// Whether `fi_trywait` has armed the NICs' interrupts: progress then clears them
    /// (a system call a round, which polling alone does not pay).
    pub irq_armed: bool,
    /// The CQs, EQs and wait sets with a descriptor ([`wait`]), which every round of
    /// progress brings in line.
    pub fd_waits: std::collections::BTreeSet<usize>,
}

/// The guarded state.
struct Locked(State);

// SAFETY: `State` holds single-threaded driver handles (`Rc`, `Cell`). It is reachable only
// through the process-wide mutex in `state`, so at most one thread touches any of it at a
// time, and nothing inside escapes a guard's lifetime (entry points copy plain values out
// before unlocking).
unsafe impl Send for Locked {}

/// A held lock on the process-wide state.
pub struct Guard(MutexGuard<'static, Locked>);

impl std::ops::Deref for Guard {
    type Target = State;
    fn deref(&self) -> &State {
        &self.0 .0
    }
}
impl std::ops::DerefMut for Guard {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.0 .0
    }
}

/// The process-wide state, locked. A poisoned lock (a panic caught at an entry point) is
/// taken over: the state is consistent between calls.
pub fn state() -> Guard {
    static S: OnceLock<Mutex<Locked>> = OnceLock::new();
    let m = S.get_or_init(|| Mutex::new(Locked(State::default())));
    Guard(m.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A libfabric error number (positive).
pub type Errno = u32;
const EINVAL: Errno = abi::FI_EINVAL;
const EAGAIN: Errno = abi::FI_EAGAIN;

/// The connection manager's timing: the driver's first timeout (4 ms, doubling to 256 ms)
/// but repeated for about a minute, since progress is manual and a peer may not call into
/// the provider for seconds (registering large buffers, computing); the time-wait outlasts
/// the repeats.
fn cm_config() -> ringbell::cm::CmConfig {
    ringbell::cm::CmConfig {
        retries: 240,
        time_wait_ps: 120_000_000_000_000,
        ..Default::default()
    }
}

fn connect_opts() -> ConnectOptions {
    ConnectOptions::default()
}

impl State {
    /// Whether object `key` may not be closed yet: a fabric or domain with objects opened
    /// in it, or a CQ, AV or counter bound to an endpoint.
    pub fn in_use(&self, key: usize) -> bool {
        let bound =
            |f: &dyn Fn(&Ep) -> bool| self.objs.values().any(|o| matches!(o, Obj::Ep(e) if f(e)));
        match self.objs.get(&key).map(Obj::kind) {
            Some(Kind::Fabric | Kind::Domain) => self.parents.values().any(|&p| p == key),
            Some(Kind::Cq) => {
                bound(&|e| e.txcq == Some(key) || e.rxcq == Some(key)) || self.polled(key)
            }
            Some(Kind::Av) => bound(&|e| e.av == Some(key)),
            Some(Kind::Cntr) => self.cntr_bound(key) || self.polled(key),
            Some(Kind::Stx) => bound(&|e| e.stx == Some(key)),
            // A wait set outlives its members (fi_wait(3)).
            Some(Kind::Wait) => self.objs.values().any(|o| match o {
                Obj::Cq(c) => c.wait_set == Some(key),
                Obj::Cntr(c) => c.wait_set.is_some_and(|(w, _)| w == key),
                _ => false,
            }),
            // A poll set must be emptied before it closes (fi_poll(3)).
            Some(Kind::Poll) => {
                matches!(self.objs.get(&key), Some(Obj::Poll(p)) if !p.members.is_empty())
            }
            // An endpoint is released once its aliases are closed (fi_endpoint(3)), a
            // shared receive context once its endpoints are.
            // A scalable endpoint once its contexts are.
            Some(Kind::Ep) => {
                self.objs
                    .values()
                    .any(|o| matches!(o, Obj::Alias(a) if a.ep == key))
                    || bound(&|e| e.rx_shared == Some(key))
                    || bound(
                        &|e| matches!(e.sep, Some(Sep::Tx { sep, .. } | Sep::Rx { sep, .. }) if sep == key),
                    )
            }
            _ => false,
        }
    }

    /// Whether a poll set holds CQ or counter `key`.
    fn polled(&self, key: usize) -> bool {
        self.objs
            .values()
            .any(|o| matches!(o, Obj::Poll(p) if p.members.iter().any(|m| m.0 == key)))
    }

    fn poll_mut(&mut self, key: usize) -> Result<&mut Poll, Errno> {
        match self.objs.get_mut(&key) {
            Some(Obj::Poll(p)) => Ok(p),
            _ => Err(EINVAL),
        }
    }

    /// `fi_poll_add`: CQ or counter `fid` of the poll set's domain joins poll set `set`
    /// (once; a second add, or another kind of object, is `-FI_EINVAL`).
    pub fn poll_add(&mut self, set: usize, fid: usize) -> Result<(), Errno> {
        let dom = self.parents.get(&set).copied();
        if dom.is_none() || self.parents.get(&fid).copied() != dom {
            return Err(EINVAL);
        }
        let seen = match self.objs.get(&fid).map(Obj::kind) {
            Some(Kind::Cq) => None,
            Some(Kind::Cntr) => Some(self.cntr(fid)?.read()),
            _ => return Err(EINVAL),
        };
        let p = self.poll_mut(set)?;
        if p.members.iter().any(|m| m.0 == fid) {
            return Err(EINVAL);
        }
        p.members.push((fid, seen));
        Ok(())
    }

    /// `fi_poll_del`: `fid` leaves poll set `set` (`-FI_EINVAL` if it is not in it).
    pub fn poll_del(&mut self, set: usize, fid: usize) -> Result<(), Errno> {
        let p = self.poll_mut(set)?;
        let i = p.members.iter().position(|m| m.0 == fid).ok_or(EINVAL)?;
        p.members.remove(i);
        Ok(())
    }

    /// `fi_poll`: after a round of progress, up to `max` members with events, in the order
    /// they were added: a CQ holding an entry or error entry, a counter whose success or
    /// error value changed since the poll set last reported it (those not reported for
    /// want of room are reported next time).
    pub fn poll(&mut self, set: usize, max: usize) -> Result<Vec<usize>, Errno> {
        self.poll_mut(set)?;
        self.progress();
        let members = self.poll_mut(set)?.members.clone();
        let mut ready = Vec::new();
        for (i, (fid, seen)) in members.into_iter().enumerate() {
            if ready.len() == max {
                break;
            }
            match seen {
                None => {
                    let c = self.cq_mut(fid)?;
                    if !c.entries.is_empty() || !c.errs.is_empty() {
                        ready.push(fid);
                    }
                }
                Some(old) => {
                    let now = self.cntr(fid)?.read();
                    if now != old {
                        self.poll_mut(set)?.members[i].1 = Some(now);
                        ready.push(fid);
                    }
                }
            }
        }
        Ok(ready)
    }

    /// The endpoint that `key` names: itself, or the endpoint of an alias.
    pub fn ep_key(&self, key: usize) -> usize {
        match self.objs.get(&key) {
            Some(Obj::Alias(a)) => a.ep,
            _ => key,
        }
    }

    /// The default operation flags of endpoint or alias `key`: the receive side's when
    /// `rx`, else the transmit side's.
    pub fn op_flags_mut(&mut self, key: usize, rx: bool) -> Result<&mut u64, Errno> {
        let (tx, rx_flags) = match self.objs.get_mut(&key) {
            Some(Obj::Alias(a)) => (&mut a.tx_op_flags, &mut a.rx_op_flags),
            Some(Obj::Ep(e)) => (&mut e.tx_op_flags, &mut e.rx_op_flags),
            _ => return Err(EINVAL),
        };
        Ok(if rx { rx_flags } else { tx })
    }

    /// The object `key` if it is live and of kind `k`.
    pub fn check(&self, key: usize, k: Kind) -> Result<(), Errno> {
        match self.objs.get(&key) {
            Some(o) if o.kind() == k => Ok(()),
            _ => Err(EINVAL),
        }
    }

    pub fn cq_mut(&mut self, key: usize) -> Result<&mut Cq, Errno> {
        match self.objs.get_mut(&key) {
            Some(Obj::Cq(c)) => Ok(c),
            _ => Err(EINVAL),
        }
    }

    pub fn av_mut(&mut self, key: usize) -> Result<&mut Av, Errno> {
        match self.objs.get_mut(&key) {
            Some(Obj::Av(a)) => Ok(a),
            _ => Err(EINVAL),
        }
    }

    pub fn ep_mut(&mut self, key: usize) -> Result<&mut Ep, Errno> {
        match self.objs.get_mut(&key) {
            Some(Obj::Ep(e)) => Ok(e),
            _ => Err(EINVAL),
        }
    }

    fn domain(&self, key: usize) -> Result<&Domain, Errno> {
        match self.objs.get(&key) {
            Some(Obj::Domain(d)) => Ok(&**d),
            _ => Err(EINVAL),
        }
    }

    /// Opens NIC `i` (once per process) with its connection manager.
    pub fn open_nic(&mut self, i: usize) -> Result<(), Errno> {
        if self.nics.contains_key(&i) {
            return Ok(());
        }
        let plan = ringbell::discover::NicPlan::from_env();
        let dev =
            ringbell_emu::open_planned_nic(&plan, i, &mut self.fabric).map_err(|e| match e {
                ringbell_emu::PlannedNicError::NoSuchNic => abi::FI_ENODEV,
                e => {
                    eprintln!("ringbell-fi: rb{i}: {e}");
                    abi::FI_ENODEV
                }
            })?;
        let cm = ConnectionManager::with_config(&dev, cm_config()).map_err(|_| abi::FI_ENODEV)?;
        self.nics.insert(i, Nic { dev, cm });
        Ok(())
    }

    /// A new domain on NIC `nic`.
    pub fn new_domain(&mut self, nic: usize) -> Result<Domain, Errno> {
        self.open_nic(nic)?;
        let pd = self.nics[&nic].dev.alloc_pd().map_err(|_| abi::FI_ENOMEM)?;
        Ok(Domain {
            nic,
            format: Format::Native,
            pd,
            work: HashMap::new(),
            sink: None,
        })
    }

    /// The overflow SGE of domain `dom`'s untagged receives (see [`SINK_LEN`]), made when
    /// the domain's first endpoint is enabled.
    fn sink(&mut self, dom: usize) -> Result<Sge, Errno> {
        let d = self.domain(dom)?;
        if let Some(s) = &d.sink {
            return Ok(s.mr.sge(0, SINK_LEN));
        }
        let dev = &self.nics.get(&d.nic).ok_or(EINVAL)?.dev;
        let buf = dev
            .alloc_dma(SINK_LEN as usize)
            .map_err(|_| abi::FI_ENOMEM)?;
        let mr =
            d.pd.reg_mr(&buf, Access::LOCAL_WRITE)
                .map_err(|_| abi::FI_ENOMEM)?;
        let sge = mr.sge(0, SINK_LEN);
        match self.objs.get_mut(&dom) {
            Some(Obj::Domain(d)) => d.sink = Some(Sink { mr, _buf: buf }),
            _ => return Err(EINVAL),
        }
        Ok(sge)
    }

    /// Registers `len` bytes at `addr` (user memory) in domain `dom`.
    ///
    /// # Safety
    /// `addr..addr+len` is memory of this process that stays mapped while registered.
    pub unsafe fn reg(&self, dom: usize, addr: usize, len: usize) -> Result<MemoryRegion, Errno> {
        // SAFETY: per the caller.
        unsafe { self.reg_access(dom, addr, len, Access::LOCAL_WRITE | Access::REMOTE_READ) }
    }

    /// Registers `len` bytes at `addr` (user memory) in domain `dom` with the device rights
    /// `acc` (see [`mr_access`]).
    ///
    /// # Safety
    /// `addr..addr+len` is memory of this process that stays mapped while registered.
    pub unsafe fn reg_access(
        &self,
        dom: usize,
        addr: usize,
        len: usize,
        acc: Access,
    ) -> Result<MemoryRegion, Errno> {
        let d = self.domain(dom)?;
        // SAFETY: per the caller.
        unsafe { d.pd.reg_user_mr(addr as *mut u8, len, addr as u64, acc) }.map_err(|e| {
            eprintln!("ringbell-fi: registering {len} bytes at {addr:#x}: {e}");
            EINVAL
        })
    }

    /// A new endpoint in domain `dom`: on the service number `named` when the program chose
    /// one (it is published under it once enabled, [`names`]), else on one of this
    /// process's own.
    ///
    /// A datagram endpoint (`dgram`) gets its UD QP and CQ at once: its address names the
    /// QP ([`dgram`]).
    ///
    /// In a sockaddr format (`format`) the number must fit a port: the application's
    /// above 65535 is `-FI_EINVAL`, and the provider's own is claimed among the ephemeral
    /// ports ([`names::claim`]; `-FI_EADDRINUSE` when none is free).
    pub fn new_ep(
        &mut self,
        dom: usize,
        named: Option<u64>,
        dgram: bool,
        format: Format,
    ) -> Result<Ep, Errno> {
        let nic = self.domain(dom)?.nic;
        if format == Format::SockaddrIn && named.is_some_and(|s| s > MAX_PORT) {
            return Err(EINVAL);
        }
        let (ud, cq, sink) = if dgram {
            let (g, cq) = self.dgram_open(dom)?;
            (Some(Box::new(g)), Some(cq), Some(self.sink(dom)?))
        } else {
            (None, None, None)
        };
        let qpn = ud.as_ref().map(|g| g.qp.qpn());
        let service = match (named, qpn, format) {
            (Some(s), _, _) => s,
            (None, _, Format::SockaddrIn) => names::claim(nic, qpn).ok_or(abi::FI_EADDRINUSE)?,
            (None, Some(q), Format::Native) => dgram::DGRAM_SERVICE | u64::from(q),
            (None, None, Format::Native) => self.own_service(),
        };
        let ip = self.nics[&nic].cm.address().ip;
        Ok(Ep {
            domain: dom,
            nic,
            addr: make_addr(ip, service),
            service,
            named: named.is_some(),
            claimed: named.is_none() && format == Format::SockaddrIn,
            format,
            av: None,
            txcq: None,
            stx: None,
            srx: false,
            rx_shared: None,
            rxcq: None,
            tx_selective: false,
            rx_selective: false,
            tx_op_flags: 0,
            rx_op_flags: 0,
            enabled: false,
            directed: false,
            source: false,
            conns: HashMap::new(),
            extra: Vec::new(),
            dead: Vec::new(),
            ops: HashMap::new(),
            next_wr: 1,
            dgram: ud,
            msg: None,
            srq: None,
            cq,
            tm: None,
            trecvs: HashMap::new(),
            tconn_peer: Vec::new(),
            peer_ids: Vec::new(),
            tsends: HashMap::new(),
            cntrs: EpCntrs::default(),
            sink,
            min_multi_recv: multi::MIN_MULTI_RECV,
            multi_posted: false,
            rx_held: VecDeque::new(),
            sep: None,
            srx_dgram: None,
        })
    }

    /// `fi_enable`: the endpoint's SRQ and CQ, and its listener.
    pub fn enable(&mut self, ep: usize) -> Result<(), Errno> {
        let (dom, nic, service) = {
            let e = self.ep_mut(ep)?;
            if e.enabled {
                return Ok(());
            }
            // A scalable endpoint's contexts: each the queue of its side, the AV and the
            // listener their endpoint's.
            let (tx, rx) = match e.sep {
                Some(Sep::Root { .. }) => return self.enable_sep(ep),
                Some(Sep::Tx { .. }) => (true, false),
                Some(Sep::Rx { .. }) => (false, true),
                None => (true, true),
            };
            if (tx && e.txcq.is_none()) || (rx && e.rxcq.is_none()) {
                return Err(abi::FI_ENOCQ);
            }
            match &e.msg {
                None if e.sep.is_some() => {}
                // A connected endpoint reports on its event queue and needs no AV.
                Some(m) if m.eq.is_none() => return Err(abi::FI_ENOEQ),
                Some(_) => {}
                None if e.av.is_none() => return Err(abi::FI_ENOAV),
                None => {}
            }
            if let Some(g) = &e.dgram {
                // Nothing to listen on: its QP is ready since the endpoint was opened.
                if e.named {
                    names::publish(e.service, e.nic, Some(g.qp.qpn()));
                }
                e.enabled = true;
                let shared = e.rx_shared;
                if let Some(s) = shared {
                    self.srx_report_to(ep, s)?;
                }
                return Ok(());
            }
            (e.domain, e.nic, e.service)
        };
        let sink = self.sink(dom)?;
        let connected = self.objs_ep(ep)?.msg.is_some();
        let shared = self.objs_ep(ep)?.rx_shared;
        let (srq, cq, tm) = {
            let d = self.domain(dom)?;
            // The caller's buffers (iov_limit) and the overflow; none with a shared
            // receive context, whose SRQ the connections take receives from.
            let srq = match shared {
                Some(_) => None,
                None => Some(new_srq(d)?),
            };
            let dev = &self.nics[&nic].dev;
            let cq = dev.create_cq(8192).map_err(|_| abi::FI_ENOMEM)?;
            // (A connected endpoint has tagged messages when its info asked for them; one
            // of a shared receive context has none.)
            let tagged_msg = self.objs_ep(ep)?.msg.as_ref().is_some_and(|m| m.tagged);
            let tm = if (connected && !tagged_msg) || shared.is_some() {
                None
            } else {
                Some(tagged::matcher(&d.pd)?)
            };
            (srq, cq, tm)
        };
        if let Some(s) = shared {
            self.srx_report_to(ep, s)?;
        }
        let context = self.objs_ep(ep)?.sep.is_some();
        if !connected && !context {
            self.listen_on(nic, service)?;
        }
        // A connected endpoint's tagged channel listens on a number of its own.
        let tag_service = match (connected, &tm) {
            (true, Some(_)) => {
                let s = self.own_service();
                self.listen_on(nic, s)?;
                Some(s)
            }
            _ => None,
        };
        let e = self.ep_mut(ep)?;
        // A connected endpoint is reached through its peer's passive endpoint, never by
        // its own number: only an RDM endpoint, which listens on it, is published.
        if e.named && !connected && !context {
            names::publish(service, nic, None);
        }
        e.srq = srq;
        e.cq = Some(cq);
        e.tm = tm;
        if let Some(m) = e.msg.as_mut() {
            m.tag_service = tag_service;
        }
        e.sink = Some(sink);
        e.enabled = true;
        Ok(())
    }

    /// The receives of shared receive context `s` complete on the receive CQ of `ep`, the
    /// first endpoint bound to it that is enabled, and count on its receive counter.
    fn srx_report_to(&mut self, ep: usize, s: usize) -> Result<(), Errno> {
        let (rxcq, sel, recv) = {
            let e = self.objs_ep(ep)?;
            (e.rxcq, e.rx_selective, e.cntrs.recv)
        };
        let x = self.ep_mut(s)?;
        if x.rxcq.is_none() {
            x.rxcq = rxcq;
            x.rx_selective = sel;
            x.cntrs.recv = recv;
        }
        Ok(())
    }

    /// A shared receive context of domain `dom` (`fi_srx_context`): an endpoint that only
    /// receives, ready at once, whose operations have work request ids of their own
    /// ([`SRX_WR`]) so the bound endpoints' CQs can hand their completions back to it.
    pub fn new_srx(&mut self, dom: usize) -> Result<Ep, Errno> {
        let mut e = self.new_ep(dom, None, false, Format::Native)?;
        e.srq = Some(new_srq(self.domain(dom)?)?);
        e.sink = Some(self.sink(dom)?);
        e.srx = true;
        e.enabled = true;
        e.next_wr = SRX_WR;
        Ok(e)
    }

    /// The SRQ endpoint `e`'s connections take receives from: its own, or its shared
    /// receive context's.
    pub(super) fn rx_srq<'a>(&'a self, e: &'a Ep) -> Option<&'a SharedReceiveQueue> {
        match e.rx_shared {
            Some(s) => self.objs_ep(s).ok()?.srq.as_ref(),
            None => e.srq.as_ref(),
        }
    }

    /// Most bytes a work request of endpoint `ep` (on NIC `nic`) carries inline: a UD send's
    /// WQE also holds its destination.
    fn max_inline(&self, nic: usize, dgram: bool) -> Result<usize, Errno> {
        let dev = self.nics.get(&nic).ok_or(EINVAL)?.dev.caps().max_inline as usize;
        Ok(if dgram {
            dev.min(ringbell_specs::wqe::MAX_INLINE_UD)
        } else {
            dev
        })
    }

    /// A service number of this process's own, not yet used.
    fn own_service(&mut self) -> u64 {
        self.next_service += 1;
        ((std::process::id() as u64) << 20) | self.next_service
    }

    /// Stops listening on `service` of NIC `nic`, and withdraws its name if it had one.
    fn stop_listening(&mut self, nic: usize, service: u64, named: bool) {
        if let Some(n) = self.nics.get_mut(&nic) {
            n.cm.unlisten(service);
        }
        if named {
            names::unpublish(service, nic);
        }
    }

    /// Listens on `service` of NIC `nic`'s connection manager (`-FI_EADDRINUSE` when taken).
    fn listen_on(&mut self, nic: usize, service: u64) -> Result<(), Errno> {
        self.nics
            .get_mut(&nic)
            .ok_or(EINVAL)?
            .cm
            .listen(service)
            .map_err(|_| abi::FI_EADDRINUSE)
    }

    /// The local SGEs of user buffers `(addr, len, desc)`, registering those without a
    /// descriptor for the operation's lifetime.
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation completes.
    /// The data of an injected operation, copied now (the caller may reuse its buffers at
    /// once): inline when the NIC takes it inline, otherwise a registered copy, returned last,
    /// to keep with the operation until it completes. `-FI_EMSGSIZE` above the inject size.
    ///
    /// # Safety
    /// Each `(address, length, _)` of `bufs` is readable for its length.
    #[allow(clippy::type_complexity)]
    unsafe fn inject_copy(
        &self,
        dom: usize,
        max_inline: usize,
        bufs: &[(usize, usize, usize)],
    ) -> Result<(Vec<Sge>, Vec<MemoryRegion>, Option<Vec<u8>>, Vec<u8>), Errno> {
        let total: usize = bufs.iter().map(|b| b.1).sum();
        if total > INJECT {
            return Err(abi::FI_EMSGSIZE);
        }
        let mut data = Vec::with_capacity(total);
        for &(addr, len, _) in bufs {
            if len > 0 {
                // SAFETY: readable now, per the caller.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(addr as *const u8, len)
                });
            }
        }
        if data.len() <= max_inline {
            return Ok((Vec::new(), Vec::new(), Some(data), Vec::new()));
        }
        // SAFETY: `data` is this library's heap copy, kept with the operation (a Vec's
        // buffer does not move when the Vec does) until it completes.
        let mr = unsafe { self.reg(dom, data.as_ptr() as usize, data.len())? };
        let sge = Sge {
            addr: data.as_ptr() as u64,
            len: data.len() as u32,
            lkey: mr.lkey(),
        };
        Ok((vec![sge], vec![mr], None, data))
    }

    /// The data of a small transfer whose buffers have no descriptors, copied now to go
    /// inline in the work request (it fits the NIC's inline size): no registration, which
    /// would cost more than the copy, for memory the application may unmap once the
    /// transfer completes. `None` when a buffer has a descriptor, the data is empty or
    /// larger than the inline size. A triggered transfer reads its data when it fires, so
    /// its callers do not ask. A buffer that is not readable memory is left to the
    /// registration's path.
    fn small_inline(
        &self,
        max_inline: usize,
        bufs: &[(usize, usize, usize)],
    ) -> Result<Option<Vec<u8>>, Errno> {
        let total: usize = bufs.iter().map(|b| b.1).sum();
        if total == 0 || bufs.iter().any(|b| b.2 != 0) {
            return Ok(None);
        }
        if total > max_inline {
            return Ok(None);
        }
        let mut data = vec![0u8; total];
        let mut at = 0;
        for &(addr, len, _) in bufs {
            // A buffer that is not readable memory takes the registration's path, which
            // refuses it (-FI_EINVAL) rather than this library faulting on it.
            if !read_own(addr, &mut data[at..at + len]) {
                return Ok(None);
            }
            at += len;
        }
        Ok(Some(data))
    }

    /// The SGEs of buffers `(addr, len, desc)`: a buffer without a descriptor is registered
    /// for the operation with device rights `acc` (none for a buffer the NIC only reads,
    /// which may be read-only memory; `LOCAL_WRITE` for one it writes).
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes.
    unsafe fn sges(
        &self,
        dom: usize,
        bufs: &[(usize, usize, usize)],
        acc: Access,
    ) -> Result<(Vec<Sge>, Vec<MemoryRegion>), Errno> {
        let mut sges = Vec::new();
        let mut tmp = Vec::new();
        for &(addr, len, desc) in bufs {
            if len == 0 {
                continue;
            }
            let len32 = u32::try_from(len).map_err(|_| abi::FI_EMSGSIZE)?;
            let lkey = if desc != 0 {
                match self.objs.get(&desc) {
                    Some(Obj::Mr(m)) => m.mr.lkey(),
                    _ => return Err(EINVAL),
                }
            } else {
                // SAFETY: per the caller.
                let mr = unsafe { self.reg_access(dom, addr, len, acc)? };
                let k = mr.lkey();
                tmp.push(mr);
                k
            };
            sges.push(Sge {
                addr: addr as u64,
                len: len32,
                lkey,
            });
        }
        Ok((sges, tmp))
    }

    /// `fi_recv` and friends; `multi`: one buffer for many messages (`FI_MULTI_RECV`,
    /// see [`multi`]).
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes (a multi-receive buffer: until its release is reported).
    pub unsafe fn post_recv(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        ctx: u64,
        report: bool,
        multi: bool,
    ) -> Result<(), Errno> {
        self.sep_allows(ep, false)?;
        let (dom, sink) = {
            let e = self.ep_mut(ep)?;
            match (e.enabled, e.sink) {
                (true, Some(sink)) => (e.domain, sink),
                _ => return Err(abi::FI_EOPBADSTATE),
            }
        };
        if bufs.len() > crate::info::IOV_LIMIT {
            return Err(EINVAL);
        }
        // A multi-receive buffer is one buffer, with room for something (fi_msg(3)).
        if multi && (bufs.len() != 1 || bufs[0].1 == 0) {
            return Err(EINVAL);
        }
        let dgram = {
            let e = self.ep_mut(ep)?;
            // A datagram endpoint bound to a shared receive context takes no receives of
            // its own (as an RDM one has no SRQ: below).
            if e.dgram.is_some() && e.rx_shared.is_some() {
                return Err(abi::FI_EOPBADSTATE);
            }
            // The first receive of a shared context no endpoint is bound to yet fixes
            // it to RC connections' receives.
            if e.srx && e.srx_dgram.is_none() {
                e.srx_dgram = Some(false);
            }
            e.dgram.is_some() || e.srx_dgram == Some(true)
        };
        if dgram && multi {
            // Not offered to datagram endpoints.
            return Err(EINVAL);
        }
        // SAFETY: per the caller.
        let (mut sges, tmp) = unsafe { self.sges(dom, bufs, Access::LOCAL_WRITE)? };
        let room = sges.iter().map(|s| u64::from(s.len)).sum();
        let e = self.ep_mut(ep)?;
        // (A multi-receive buffer is one non-empty buffer: its SGE comes first.)
        let kind = if multi {
            OpKind::Multi(multi::MultiRecv::new(sges[0], e.min_multi_recv))
        } else {
            OpKind::Msg
        };
        let op = Op {
            ctx,
            send: false,
            report: report || !e.rx_selective,
            buf: bufs.first().map_or(0, |b| b.0 as u64),
            room,
            _tmp: tmp,
            _copy: Vec::new(),
            kind,
        };
        if dgram {
            return self.dgram_recv(ep, sink, &sges, op);
        }
        sges.push(sink);
        self.rx_post(ep, sges, op)
    }

    /// `fi_send` and friends; `inject` copies the data now and reports nothing.
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes; for `inject`, the buffers are readable now.
    pub unsafe fn post_send(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        req: SendReq,
    ) -> Result<(), Errno> {
        let SendReq {
            dest,
            ctx,
            inject,
            silent,
            report,
            imm,
            trig,
        } = req;
        self.sep_allows(ep, true)?;
        let (dom, nic, dgram) = {
            let e = self.ep_mut(ep)?;
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.domain, e.nic, e.dgram.is_some())
        };
        if dgram {
            if trig.is_some() {
                return Err(abi::FI_ENOSYS);
            }
            // One packet at most (fi_endpoint(3): max_msg_size).
            if bufs.iter().map(|b| b.1).sum::<usize>() > crate::info::DGRAM_MAX_MSG {
                return Err(abi::FI_EMSGSIZE);
            }
        }
        let peer = match self.msg_dest(ep)? {
            Some(a) => a,
            None => self.dest_peer(ep, dest)?,
        };
        let mut copy = Vec::new();
        let (sges, tmp, inline) = if inject {
            let max = self.max_inline(nic, dgram)?;
            // SAFETY: per the caller.
            let (sges, tmp, inline, data) = unsafe { self.inject_copy(dom, max, bufs)? };
            copy = data;
            (sges, tmp, inline)
        } else if let Some(d) = match trig {
            None => self.small_inline(self.max_inline(nic, dgram)?, bufs)?,
            Some(_) => None,
        } {
            (Vec::new(), Vec::new(), Some(d))
        } else {
            // SAFETY: per the caller.
            let (s, t) = unsafe { self.sges(dom, bufs, Access::empty())? };
            (s, t, None)
        };
        let e = self.ep_mut(ep)?;
        let wr_id = e.next_wr;
        e.next_wr += 1;
        let tx_selective = e.tx_selective;
        let p = Pending {
            wr_id,
            sges,
            inline,
            imm,
            wr: None,
            trig: None,
            tsend: None,
        };
        let op = Op {
            ctx,
            send: true,
            // Deferred work reports only with FI_COMPLETION (fi_trigger(3)).
            report: match trig {
                Some(Trig { work: Some(_), .. }) => report && !silent,
                _ => !silent && (report || !tx_selective),
            },
            buf: bufs.first().map_or(0, |b| b.0 as u64),
            room: 0,
            _tmp: tmp,
            _copy: copy,
            kind: OpKind::Msg,
        };
        if dgram {
            return self.dgram_send(ep, &peer, p, op);
        }
        if let Some(t) = trig {
            let flags = abi::FI_SEND as u64 | abi::FI_MSG as u64;
            return self.post_triggered_op(ep, (peer, CH_MSG), p, op, &t, flags, None);
        }
        self.transmit(ep, (peer, CH_MSG), p)?;
        self.ep_mut(ep)?.ops.insert(wr_id, op);
        Ok(())
    }

    /// `fi_read`, `fi_write`, `fi_writedata`, `fi_atomic` and friends: one work request to
    /// `req.dest` over the same connection as untagged sends (connecting on first use). The
    /// remote side is addressed by virtual address and the MR's key (`FI_MR_VIRT_ADDR`,
    /// `FI_MR_PROV_KEY`). `bufs` are the local buffers: the data written, the buffer read
    /// into, or an atomic's 8-byte result (none: a scratch word of the provider's).
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes; for `inject`, the buffers are readable now.
    pub unsafe fn post_rma(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        req: RmaReq,
    ) -> Result<(), Errno> {
        self.sep_allows(ep, true)?;
        let (dom, nic, tx_selective) = {
            let e = self.ep_mut(ep)?;
            if e.dgram.is_some() {
                // Datagram endpoints carry messages only.
                return Err(abi::FI_ENOSYS);
            }
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.domain, e.nic, e.tx_selective)
        };
        let peer = match self.msg_dest(ep)? {
            Some(a) => a,
            None => self.dest_peer(ep, req.dest)?,
        };
        let (addr, key) = match req.op {
            RmaOp::Write { addr, key, .. } | RmaOp::Read { addr, key } => (addr, key),
            RmaOp::FetchAdd { addr, key, .. } | RmaOp::CmpSwap { addr, key, .. } => {
                if addr % 8 != 0 {
                    return Err(EINVAL);
                }
                (addr, key)
            }
        };
        let report = !req.silent && (req.report || !tx_selective);
        let Ok(rkey) = u32::try_from(key) else {
            // Not a key this provider ever gives out: refused by "the target".
            let txcq = self.ep_mut(ep)?.txcq;
            self.count(ep, req.flags, false);
            self.push(
                txcq,
                Entry {
                    ctx: req.ctx,
                    flags: req.flags,
                    src: ADDR_UNSPEC,
                    err: abi::FI_EACCES as i32,
                    ..Default::default()
                },
            );
            return Ok(());
        };
        let remote = RemoteAddr { addr, rkey };
        let wr = match req.op {
            RmaOp::Write { imm: Some(i), .. } => WrOp::WriteImm(remote, i),
            RmaOp::Write { imm: None, .. } => WrOp::Write(remote),
            RmaOp::Read { .. } => WrOp::Read(remote),
            RmaOp::FetchAdd { add, .. } => WrOp::FetchAdd { remote, add },
            RmaOp::CmpSwap { compare, swap, .. } => WrOp::CmpSwap {
                remote,
                compare,
                swap,
            },
        };
        let atomic = matches!(req.op, RmaOp::FetchAdd { .. } | RmaOp::CmpSwap { .. });
        let mut copy = Vec::new();
        let (sges, tmp, inline) = if atomic && bufs.is_empty() {
            copy = vec![0u8; 8];
            // SAFETY: `copy` is this library's heap scratch word, kept with the operation
            // (a Vec's buffer does not move when the Vec does) until it completes.
            let mr = unsafe { self.reg(dom, copy.as_ptr() as usize, 8)? };
            let sge = Sge {
                addr: copy.as_ptr() as u64,
                len: 8,
                lkey: mr.lkey(),
            };
            (vec![sge], vec![mr], None)
        } else if req.inject {
            let max = self.max_inline(nic, false)?;
            // SAFETY: per the caller.
            let (sges, tmp, inline, data) = unsafe { self.inject_copy(dom, max, bufs)? };
            copy = data;
            (sges, tmp, inline)
        } else if let Some(d) = match (&req.op, &req.trig) {
            (RmaOp::Write { .. }, None) => self.small_inline(self.max_inline(nic, false)?, bufs)?,
            _ => None,
        } {
            (Vec::new(), Vec::new(), Some(d))
        } else {
            // The NIC reads a WRITE's source and writes every other operation's buffer.
            let acc = match req.op {
                RmaOp::Write { .. } => Access::empty(),
                _ => Access::LOCAL_WRITE,
            };
            // SAFETY: per the caller.
            let (s, t) = unsafe { self.sges(dom, bufs, acc)? };
            (s, t, None)
        };
        if atomic && sges.iter().map(|s| s.len).sum::<u32>() != 8 {
            return Err(EINVAL);
        }
        let e = self.ep_mut(ep)?;
        let wr_id = e.next_wr;
        e.next_wr += 1;
        let p = Pending {
            wr_id,
            sges,
            inline,
            imm: None,
            wr: Some(wr),
            trig: None,
            tsend: None,
        };
        let mut op = Op {
            ctx: req.ctx,
            send: true,
            report,
            buf: 0,
            room: 0,
            _tmp: tmp,
            _copy: copy,
            kind: OpKind::Rma { flags: req.flags },
        };
        if let Some(t) = req.trig {
            if t.work.is_some() {
                // Deferred work reports only with FI_COMPLETION (fi_trigger(3)).
                op.report = req.report && !req.silent;
            }
            // The operand is read when the operation fires, through a registration.
            let operand = if atomic && req.operand != 0 {
                // SAFETY: the operand buffer stays valid until the operation completes
                // (fi_atomic(3)), per the caller.
                let mr = unsafe { self.reg_access(dom, req.operand, 8, Access::empty())? };
                let sge = mr.sge(req.operand as u64 - mr.addr(), 8);
                op._tmp.push(mr);
                Some(sge)
            } else {
                None
            };
            return self.post_triggered_op(ep, (peer, CH_MSG), p, op, &t, req.flags, operand);
        }
        self.transmit(ep, (peer, CH_MSG), p)?;
        self.ep_mut(ep)?.ops.insert(wr_id, op);
        Ok(())
    }

    /// The address of AV entry `dest` of endpoint `ep`'s AV.
    fn peer(&mut self, ep: usize, dest: u64) -> Result<Addr, Errno> {
        self.peer_rx(ep, dest).map(|(a, _)| a)
    }

    /// The address AV index `dest` of endpoint `ep`'s AV names, and the receive context
    /// its top bits name (the AV's `rx_ctx_bits`; [`sep`]).
    fn peer_rx(&mut self, ep: usize, dest: u64) -> Result<(Addr, u64), Errno> {
        let av = self.ep_av(ep).ok_or(abi::FI_ENOAV)?;
        let av = self.av_mut(av)?;
        let (index, rx) = sep::split_rx(dest, av.rx_ctx_bits);
        let a = av.get(index).ok_or(EINVAL)?;
        Ok((a, rx))
    }

    /// The address a transmission to AV index `dest` of endpoint `ep` goes to: with the
    /// receive context the index names, if any ([`sep::with_rx`]; a context beyond 254 is
    /// no address, `-FI_EINVAL`).
    fn dest_peer(&mut self, ep: usize, dest: u64) -> Result<Addr, Errno> {
        let (a, rx) = self.peer_rx(ep, dest)?;
        let rx = u8::try_from(rx)
            .ok()
            .filter(|&r| r != sep::TX_ONLY)
            .ok_or(EINVAL)?;
        Ok(sep::with_rx(a, rx))
    }

    /// For an endpoint that names the senders of its receives (FI_SOURCE): the AV index of
    /// the peer whose connection's QP `qpn` took a receive, or `FI_ADDR_NOTAVAIL` (a peer the
    /// AV does not hold, or an endpoint that did not ask). AV entries that name a peer by
    /// this host's address and a service number are resolved to compare them.
    pub(crate) fn conn_source(&self, ep: usize, qpn: u32) -> u64 {
        let Ok(e) = self.objs_ep(ep) else {
            return ADDR_UNSPEC;
        };
        if !e.source {
            return ADDR_UNSPEC;
        }
        let peer = e
            .conns
            .iter()
            .chain(e.extra.iter().map(|(k, c)| (k, c)))
            .find_map(|(k, c)| match c {
                Conn::Up(_, qp) if qp.qpn() == qpn => Some(k.0),
                _ => None,
            });
        let Some(peer) = peer.map(|p| sep::base(&p)) else {
            return ADDR_UNSPEC;
        };
        match self.av_index(ep, &peer) {
            ADDR_UNSPEC => match self.ep_av(ep).and_then(|k| self.objs.get(&k)) {
                Some(Obj::Av(av)) => av
                    .position(|a| resolve_addr(a) == peer)
                    .map_or(ADDR_UNSPEC, |i| i as u64),
                _ => ADDR_UNSPEC,
            },
            i => i,
        }
    }

    /// The AV index of `addr` in endpoint `ep`'s AV, or `FI_ADDR_NOTAVAIL`.
    fn av_index(&self, ep: usize, addr: &Addr) -> u64 {
        match self.ep_av(ep).and_then(|k| self.objs.get(&k)) {
            Some(Obj::Av(av)) => av.position(|a| a == addr).map_or(ADDR_UNSPEC, |i| i as u64),
            _ => ADDR_UNSPEC,
        }
    }

    /// Posts `p` on endpoint `ep`'s connection `key`, or queues it until the connection is
    /// up, connecting first if there is none. A pending READ uses any connection of the
    /// channel to that peer that is up (an accepted one included).
    ///
    /// A triggered operation posted at once returns its handle.
    fn transmit(
        &mut self,
        ep: usize,
        key: ConnKey,
        p: Pending,
    ) -> Result<Option<TriggerHandle>, Errno> {
        let (dom, nic, own) = {
            let e = self.ep_mut(ep)?;
            (e.domain, e.nic, e.addr)
        };
        let e = self.ep_mut(ep)?;
        // Tagged messages to a peer all go over one connection, the first one made (ours or
        // the peer's): MPI order holds per sender, and two QPs would not keep it. A second
        // connection that crossed it (both sides connecting at once) only receives.
        if let Some(Conn::Tag(_, c)) = e.conns.get(&key) {
            let c = *c;
            return e.post_tag(c, &p);
        }
        if let Some(Conn::Up(_, qp)) = e.conns.get_mut(&key) {
            return post_pending(qp, &p, p.wr_id);
        }
        for (k, c) in e.extra.iter_mut() {
            if let (true, Conn::Up(_, qp)) = (*k == key && key.1 != CH_TAG, c) {
                return post_pending(qp, &p, p.wr_id);
            }
        }
        match e.conns.get_mut(&key) {
            Some(Conn::Up(..) | Conn::Tag(..)) => unreachable!("handled above"),
            Some(Conn::Pending(_, q)) => q.push(p),
            // A connected endpoint's one connection is made by fi_connect/fi_accept (its
            // tagged channel's as an RDM endpoint's are).
            None if e.msg.is_some() && key.1 != CH_TAG => return Err(abi::FI_ENOTCONN),
            None => {
                let (ip, service) = parse_addr(&key.0).ok_or(EINVAL)?;
                let ah = AhAttr::on_fabric(ip)
                    .or_else(|| AhAttr::on_fabric(nic_ip(names::resolve(service)?)))
                    .ok_or(abi::FI_EHOSTUNREACH)?;
                let qp = if key.1 == CH_TAG {
                    self.ep_mut(ep)?.tag_qp()?
                } else {
                    let e = self.objs_ep(ep)?;
                    new_qp(self.domain(dom)?, e, self.rx_srq(e))?
                };
                self.bind_remote_cntrs(ep, &qp, key.1);
                // A connected endpoint's tagged channel is known by its own address.
                let own = self
                    .objs_ep(ep)?
                    .msg
                    .as_ref()
                    .and_then(|m| m.tag_service)
                    .filter(|_| key.1 == CH_TAG)
                    .map_or(own, |s| make_addr([own[4], own[5], own[6], own[7]], s));
                let mut private = own.to_vec();
                private.push(key.1);
                // The receive context the connection is for ([`sep`]).
                private.push(key.0[3]);
                let id = self
                    .nics
                    .get_mut(&nic)
                    .ok_or(EINVAL)?
                    .cm
                    .connect(ah, service, qp, &connect_opts(), &private)
                    .map_err(|_| EAGAIN)?;
                self.ep_mut(ep)?
                    .conns
                    .insert(key, Conn::Pending(id, vec![p]));
            }
        }
        Ok(None)
    }

    fn objs_ep(&self, ep: usize) -> Result<&Ep, Errno> {
        match self.objs.get(&ep) {
            Some(Obj::Ep(e)) => Ok(e),
            _ => Err(EINVAL),
        }
    }

    /// Drives the CMs and every endpoint's completions into the completion queues, and
    /// the wait objects after them. Whether an in-process fabric moved.
    pub fn progress(&mut self) -> bool {
        let mut events = Vec::new();
        let mut moved = false;
        if self.irq_armed || !self.fd_waits.is_empty() {
            // Completion events come only from CQs fi_trywait armed.
            let nics: Vec<usize> = self.nics.keys().copied().collect();
            for i in nics {
                self.pump_events(i);
            }
        }
        for (&i, n) in self.nics.iter_mut() {
            moved |= n.dev.progress();
            while let Some(e) = n.cm.poll() {
                events.push((i, e));
            }
        }
        for (nic, ev) in events {
            self.on_cm_event(nic, ev);
        }
        let keys: Vec<usize> = self
            .objs
            .iter()
            .filter_map(|(&k, o)| match o {
                Obj::Ep(e) if e.cq.is_some() || e.srx => Some(k),
                _ => None,
            })
            .collect();
        // Datagrams taken from a shared receive context through different endpoints' QPs
        // are reported in the order the context's receives were consumed (their work
        // request ids follow the posts, and the SRQ is consumed in order), as one CQ of the
        // device would have them, not endpoint by endpoint.
        let mut shared_dgrams: Vec<(usize, WorkCompletion)> = Vec::new();
        for key in keys {
            // A datagram endpoint's shared receive context, looked up once per endpoint.
            let shared = self.shared_dgram_context(key);
            loop {
                let mut wc = [WorkCompletion::default(); 16];
                let k = match self.ep_mut(key) {
                    Ok(Ep { cq: Some(cq), .. }) => cq.poll(&mut wc),
                    _ => 0,
                };
                for w in &wc[..k] {
                    match shared {
                        Some(s) if w.wr_id & SRX_WR != 0 => shared_dgrams.push((s, *w)),
                        _ => self.on_wc(key, w),
                    }
                }
                if k < wc.len() {
                    break;
                }
            }
            self.tag_progress(key);
            self.rx_drain(key);
        }
        shared_dgrams.sort_by_key(|(s, w)| (*s, w.wr_id));
        for (s, w) in &shared_dgrams {
            self.on_wc(*s, w);
        }
        self.wait_sync_all();
        moved
    }

    /// Queues a completion (or an error completion) on CQ `cq`.
    fn push(&mut self, cq: Option<usize>, en: Entry) {
        if let Some(c) = cq.and_then(|k| self.cq_mut(k).ok()) {
            if en.err == 0 {
                c.entries.push_back(en);
            } else {
                c.errs.push_back(en);
            }
        }
    }

    /// The shared receive context datagram endpoint `ep` takes its receives from (its
    /// completions of them carry [`SRX_WR`]); `None` for any other endpoint.
    fn shared_dgram_context(&self, ep: usize) -> Option<usize> {
        let e = self.objs_ep(ep).ok()?;
        if e.srx || e.dgram.is_none() {
            return None;
        }
        e.rx_shared
    }

    /// Handles one driver completion of endpoint `ep`.
    fn on_wc(&mut self, ep: usize, w: &WorkCompletion) {
        let Ok(e) = self.ep_mut(ep) else { return };
        // A receive of the shared receive context, taken by this endpoint's connection.
        if w.wr_id & SRX_WR != 0 && !e.srx {
            if let Some(s) = e.rx_shared {
                return self.on_wc(s, w);
            }
        }
        let Some(op) = e.ops.remove(&w.wr_id) else {
            return;
        };
        let ok = w.status == WcStatus::Success;
        if !ok {
            e.retire(w.qpn);
        }
        let (txcq, rxcq, e_dgram) = (
            e.txcq,
            e.rxcq,
            e.dgram.is_some() || e.srx_dgram == Some(true),
        );
        match op.kind {
            OpKind::Multi(m) => self.on_multi_wc(ep, op, m, w),
            OpKind::Msg => {
                {
                    let (cq, mut flags) = if op.send {
                        (txcq, abi::FI_SEND as u64 | abi::FI_MSG as u64)
                    } else {
                        (rxcq, abi::FI_RECV as u64 | abi::FI_MSG as u64)
                    };
                    if !op.send && w.imm.is_some() {
                        flags |= abi::FI_REMOTE_CQ_DATA as u64;
                    }
                    let remote_write = !op.send && w.opcode == WcOpcode::RecvRdmaWithImm;
                    if remote_write {
                        // fi_writedata's remote CQ data (it consumed this posted receive).
                        flags = abi::FI_RMA as u64
                            | abi::FI_REMOTE_WRITE as u64
                            | abi::FI_REMOTE_CQ_DATA as u64;
                    }
                    // A message longer than the receive's buffers: the excess went to the
                    // domain's overflow (see SINK_LEN); the receive fails FI_ETRUNC with
                    // the bytes cut off, the connection and the sender are unaffected.
                    let received = if e_dgram && !op.send {
                        dgram::payload_len(w.byte_len)
                    } else {
                        u64::from(w.byte_len)
                    };
                    let cut = if ok && !op.send && !remote_write {
                        received.saturating_sub(op.room)
                    } else {
                        0
                    };
                    self.count(ep, flags, ok && cut == 0);
                    if ok && cut == 0 && !op.report {
                        return;
                    }
                    let mut en = msg_entry(
                        op.ctx,
                        flags,
                        if op.send || remote_write {
                            (0, 0)
                        } else {
                            (received - cut, op.buf)
                        },
                        cut,
                        w,
                    );
                    if e_dgram && !op.send {
                        en.src = self.dgram_source(ep, w);
                    } else if !op.send && !remote_write {
                        en.src = self.conn_source(ep, w.qpn);
                    }
                    self.push(cq, en);
                }
            }
            OpKind::Trig(t) => self.finish_trig(ep, t, w),
            OpKind::Rma { flags } => {
                self.count(ep, flags, ok);
                if ok && !op.report {
                    return;
                }
                let err = match w.status {
                    WcStatus::Success => 0,
                    WcStatus::RemAccessErr | WcStatus::RemInvReqErr => abi::FI_EACCES as i32,
                    _ => abi::FI_EIO as i32,
                };
                self.push(
                    txcq,
                    Entry {
                        ctx: op.ctx,
                        flags,
                        src: ADDR_UNSPEC,
                        err,
                        prov_errno: if ok { 0 } else { w.status as i32 },
                        ..Default::default()
                    },
                );
            }
        }
    }

    /// A tagged send is over: its completion (or error) goes to the transmit CQ.
    fn finish_tsend(&mut self, ep: usize, id: u64, ok: bool, prov_errno: i32) {
        let Ok(e) = self.ep_mut(ep) else { return };
        let Some(t) = e.tsends.remove(&id) else {
            return;
        };
        let txcq = e.txcq;
        self.count(ep, abi::FI_SEND as u64, ok);
        if ok && !t.report {
            return;
        }
        self.push(
            txcq,
            Entry {
                ctx: t.ctx,
                flags: abi::FI_SEND as u64 | abi::FI_TAGGED as u64,
                src: ADDR_UNSPEC,
                err: if ok { 0 } else { abi::FI_EIO as i32 },
                prov_errno,
                ..Default::default()
            },
        );
    }

    fn on_cm_event(&mut self, nic: usize, ev: CmEvent) {
        match ev {
            CmEvent::ConnectRequest {
                id,
                service_id,
                private,
                from,
            } => {
                if self.pep_request(nic, id, service_id, from, &private) {
                    return;
                }
                let rx = private.get(ADDR_LEN + 1).copied().unwrap_or(0);
                let key = self.rx_target(nic, service_id, rx);
                let peer: Option<Addr> = private.get(..ADDR_LEN).and_then(|b| b.try_into().ok());
                let chan = private.get(ADDR_LEN).copied().unwrap_or(CH_MSG);
                let (Some(key), Some(peer), true) = (key, peer, chan <= CH_TAG) else {
                    if let Some(n) = self.nics.get_mut(&nic) {
                        let _ = n.cm.reject(id, REJ_CONSUMER, &[]);
                    }
                    return;
                };
                let Ok(e) = self.objs_ep(key) else { return };
                let own = e.addr;
                let made = if chan == CH_TAG {
                    match self.ep_mut(key) {
                        Ok(e) => e.tag_qp(),
                        Err(err) => Err(err),
                    }
                } else {
                    match self.domain(e.domain) {
                        Ok(d) => new_qp(d, e, self.rx_srq(e)),
                        Err(err) => Err(err),
                    }
                };
                let Ok(qp) = made else {
                    if let Some(n) = self.nics.get_mut(&nic) {
                        let _ = n.cm.reject(id, REJ_CONSUMER, &[]);
                    }
                    return;
                };
                self.bind_remote_cntrs(key, &qp, chan);
                let Some(n) = self.nics.get_mut(&nic) else {
                    return;
                };
                if n.cm.accept(id, qp, &connect_opts(), &own).is_err() {
                    return;
                }
                let Ok(e) = self.ep_mut(key) else { return };
                // The peer connects again after its QP failed: ours has failed too (the
                // device moves both ends of an RC connection to the error state).
                let failed = match e.conns.get(&(peer, chan)) {
                    Some(Conn::Up(_, qp)) => qp.query_state().is_ok_and(|s| s == QpState::Err),
                    Some(Conn::Tag(_, c)) => e.tag_conn_failed(*c),
                    _ => false,
                };
                if failed {
                    if let Some(old) = e.conns.remove(&(peer, chan)) {
                        e.dead.push(old);
                    }
                }
                if let std::collections::hash_map::Entry::Vacant(v) = e.conns.entry((peer, chan)) {
                    v.insert(Conn::Pending(id, Vec::new()));
                } else {
                    e.extra.push(((peer, chan), Conn::Pending(id, Vec::new())));
                }
            }
            CmEvent::Established {
                id,
                mut qp,
                private,
            } => {
                if let Some(ep) = self.pending_tag_conn(nic, id) {
                    self.tag_established(ep, id, qp);
                    return;
                }
                let mut failed = Vec::new();
                'eps: for (&k, o) in self.objs.iter_mut() {
                    let Obj::Ep(e) = o else { continue };
                    if e.nic != nic {
                        continue;
                    }
                    let mut handles = Vec::new();
                    for c in e
                        .conns
                        .values_mut()
                        .chain(e.extra.iter_mut().map(|x| &mut x.1))
                    {
                        if let Conn::Pending(cid, q) = c {
                            if *cid == id {
                                for p in q.iter() {
                                    match post_pending(&mut qp, p, p.wr_id) {
                                        Ok(Some(h)) => handles.push((p.wr_id, h)),
                                        Ok(None) => {}
                                        // Only a triggered operation is refused here (the
                                        // send queue has room for what waited).
                                        Err(_) => failed.push((k, p.wr_id)),
                                    }
                                }
                                *c = Conn::Up(id, Box::new(qp));
                                for (wr_id, h) in handles {
                                    if let Some(OpKind::Trig(t)) =
                                        e.ops.get_mut(&wr_id).map(|o| &mut o.kind)
                                    {
                                        t.handle = Some(h);
                                    }
                                }
                                break 'eps;
                            }
                        }
                    }
                }
                for (k, wr_id) in failed {
                    if let Some(op) = self.ep_mut(k).ok().and_then(|e| e.ops.remove(&wr_id)) {
                        self.fail_op(k, op);
                    }
                }
                self.msg_cm_event(nic, id, msgep::MsgCm::Up(private));
            }
            CmEvent::Rejected { id, .. } | CmEvent::TimedOut { id, .. } => {
                self.msg_cm_event(
                    nic,
                    id,
                    match &ev {
                        CmEvent::Rejected { .. } => msgep::MsgCm::Refused,
                        _ => msgep::MsgCm::TimedOut,
                    },
                );
                let mut failed = Vec::new();
                let mut tsends = Vec::new();
                for (&k, o) in self.objs.iter_mut() {
                    let Obj::Ep(e) = o else { continue };
                    if e.nic != nic {
                        continue;
                    }
                    let gone: Vec<ConnKey> = e
                        .conns
                        .iter()
                        .filter(|(_, c)| matches!(c, Conn::Pending(cid, _) if *cid == id))
                        .map(|(a, _)| *a)
                        .collect();
                    for a in gone {
                        if let Some(Conn::Pending(_, q)) = e.conns.remove(&a) {
                            for p in q {
                                if p.tsend.is_some() {
                                    tsends.push((k, p.wr_id));
                                } else if let Some(op) = e.ops.remove(&p.wr_id) {
                                    failed.push((k, op));
                                }
                            }
                        }
                    }
                }
                for (k, op) in failed {
                    self.fail_op(k, op);
                }
                for (k, id) in tsends {
                    self.finish_tsend(k, id, false, 0);
                }
            }
            CmEvent::Disconnected { id } => {
                self.msg_cm_event(nic, id, msgep::MsgCm::Down);
                for o in self.objs.values_mut() {
                    let Obj::Ep(e) = o else { continue };
                    if e.nic == nic {
                        let gone = |c: &Conn| match c {
                            Conn::Up(cid, _) | Conn::Tag(cid, _) => *cid == id,
                            Conn::Pending(..) => false,
                        };
                        e.conns.retain(|_, c| !gone(c));
                        e.extra.retain(|(_, c)| !gone(c));
                    }
                }
            }
            // Only connections made with the caller moving its QP, and service id
            // resolution, end so; the provider hands its QPs to the CM and asks for no
            // SIDR.
            CmEvent::Replied { .. }
            | CmEvent::Ready { .. }
            | CmEvent::SidrRequest { .. }
            | CmEvent::SidrReply { .. } => {}
        }
    }

    /// An operation whose connection could not be made.
    fn fail_op(&mut self, ep: usize, op: Op) {
        match op.kind {
            // A receive waits for no connection.
            OpKind::Multi(_) => {}
            OpKind::Msg => {
                self.count(ep, abi::FI_SEND as u64, false);
                let txcq = self.ep_mut(ep).ok().and_then(|e| e.txcq);
                self.push(
                    txcq,
                    Entry {
                        ctx: op.ctx,
                        flags: abi::FI_SEND as u64 | abi::FI_MSG as u64,
                        err: abi::FI_EHOSTUNREACH as i32,
                        src: ADDR_UNSPEC,
                        ..Default::default()
                    },
                );
            }
            OpKind::Rma { flags } => {
                self.count(ep, flags, false);
                let txcq = self.ep_mut(ep).ok().and_then(|e| e.txcq);
                self.push(
                    txcq,
                    Entry {
                        ctx: op.ctx,
                        flags,
                        err: abi::FI_EHOSTUNREACH as i32,
                        src: ADDR_UNSPEC,
                        ..Default::default()
                    },
                );
            }
            OpKind::Trig(t) => self.fail_trig(ep, t),
        }
    }

    /// Whether endpoint `key` still has transmit work the provider holds or the network has
    /// not finished: sends waiting for their connection, untagged sends, RMA and atomics in
    /// flight, tagged sends waiting for their completion. Triggered operations do not count:
    /// their counter may never reach its threshold.
    pub fn tx_busy(&self, key: usize) -> bool {
        let Ok(e) = self.objs_ep(key) else {
            return false;
        };
        let waiting = |c: &Conn| matches!(c, Conn::Pending(_, v) if !v.is_empty());
        e.conns.values().any(waiting)
            || e.extra.iter().any(|(_, c)| waiting(c))
            || e.ops
                .values()
                .any(|o| o.send && !matches!(o.kind, OpKind::Trig(_)))
            || !e.tsends.is_empty()
    }

    /// Closes the endpoint's listener (before the endpoint is dropped).
    pub fn close_ep(&mut self, ep: &Ep) {
        if ep.claimed {
            names::unpublish(ep.service, ep.nic);
        }
        // (A scalable endpoint's contexts listen through it.)
        if !ep.enabled || ep.srx || matches!(ep.sep, Some(Sep::Tx { .. } | Sep::Rx { .. })) {
            return;
        }
        // Only an RDM endpoint listens; a datagram one may be published all the same (a
        // connected one never is).
        if let Some(s) = ep.msg.as_ref().and_then(|m| m.tag_service) {
            self.stop_listening(ep.nic, s, false);
        }
        if ep.dgram.is_none() && ep.msg.is_none() {
            self.stop_listening(ep.nic, ep.service, ep.named);
        } else if ep.named && ep.dgram.is_some() {
            names::unpublish(ep.service, ep.nic);
        }
    }
}

/// Copies the bytes at `addr` of this process into `out`; false if any of them is not
/// readable memory (or the kernel refuses the call): `process_vm_readv(2)` on this process
/// reports a bad address as `EFAULT` where reading it directly would fault.
fn read_own(addr: usize, out: &mut [u8]) -> bool {
    if out.is_empty() {
        return true;
    }
    let local = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: out.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: out.len(),
    };
    // SAFETY: `local` describes `out`, writable for its length; the kernel checks
    // `remote` against this process's mappings and copies nothing it cannot read.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == out.len() as isize
}

/// Work request ids of a shared receive context's operations carry this bit.
const SRX_WR: u64 = 1 << 62;

/// An endpoint's SRQ: the caller's buffers (`iov_limit`) and the overflow.
fn new_srq(d: &Domain) -> Result<SharedReceiveQueue, Errno> {
    let sges = crate::info::IOV_LIMIT as u32 + 1;
    d.pd.create_srq(1024, sges, 0).map_err(|_| abi::FI_ENOMEM)
}

/// A QP of the untagged channel (the tagged channel's come from the tag matcher,
/// [`Ep::tag_qp`]), receiving from `srq` (the endpoint's, or its shared receive
/// context's).
fn new_qp(d: &Domain, e: &Ep, srq: Option<&SharedReceiveQueue>) -> Result<QueuePair, Errno> {
    let cq = e.cq.as_ref().ok_or(abi::FI_EOPBADSTATE)?;
    let mut init = QpInit::new(cq, cq);
    init.srq = srq;
    init.max_inline = d.pd.device().caps().max_inline.min(INJECT as u32);
    init.max_send_wr = 256;
    init.max_send_sge = 4;
    d.pd.create_qp(&init).map_err(|e| {
        eprintln!("ringbell-fi: creating a QP: {e}");
        abi::FI_ENOMEM
    })
}

/// Posts `p` on `qp` as work request `wr_id`: sent now, or, for a triggered operation,
/// handed to the NIC's table (its handle returned).
fn post_pending(
    qp: &mut QueuePair,
    p: &Pending,
    wr_id: u64,
) -> Result<Option<TriggerHandle>, Errno> {
    let op = match (p.wr, p.imm) {
        (Some(w), _) => w,
        (None, Some(i)) => WrOp::SendImm(i),
        (None, None) => WrOp::Send,
    };
    let wr = match &p.inline {
        Some(d) => SendWr::inline(wr_id, op, d),
        None => SendWr::new(wr_id, op, &p.sges),
    };
    if let Some(t) = &p.trig {
        return trig::post(qp, t, &wr).map(Some);
    }
    qp.post_send(&[wr.flags(ringbell::SendFlags::SIGNALED)])
        .map(|()| None)
        .map_err(|_| EAGAIN)
}

impl Cq {
    pub fn new(format: u32, wait_obj: u32) -> Result<Cq, Errno> {
        let words = match format {
            abi::fi_cq_format_FI_CQ_FORMAT_UNSPEC | abi::fi_cq_format_FI_CQ_FORMAT_CONTEXT => 1,
            abi::fi_cq_format_FI_CQ_FORMAT_MSG => 3,
            abi::fi_cq_format_FI_CQ_FORMAT_DATA => 5,
            abi::fi_cq_format_FI_CQ_FORMAT_TAGGED => 6,
            _ => return Err(EINVAL),
        };
        Ok(Cq {
            words,
            entries: VecDeque::new(),
            errs: VecDeque::new(),
            signaled: false,
            // (The caller gives it its wait object.)
            wait: None,
            wait_obj,
            wait_set: None,
        })
    }

    /// Takes up to `max` entries as the words of this CQ's format (and their sources), or
    /// `-FI_EAVAIL`/`-FI_EAGAIN`.
    pub fn take(&mut self, max: usize) -> Result<(Vec<u64>, Vec<u64>), Errno> {
        if !self.errs.is_empty() {
            return Err(abi::FI_EAVAIL);
        }
        if self.entries.is_empty() {
            return Err(EAGAIN);
        }
        let mut w = Vec::new();
        let mut src = Vec::new();
        while src.len() < max {
            let Some(e) = self.entries.pop_front() else {
                break;
            };
            w.extend_from_slice(&[e.ctx, e.flags, e.len, e.buf, e.data, e.tag][..self.words]);
            src.push(e.src);
        }
        Ok((w, src))
    }
}

/// How a tagged receive is posted.
#[derive(Clone, Copy, Debug)]
pub struct TRecvReq {
    /// The application's context, returned in the completion.
    pub ctx: u64,
    pub tag: u64,
    pub ignore: u64,
    /// The source (an AV index, or `FI_ADDR_UNSPEC`); used with FI_DIRECTED_RECV.
    pub src: u64,
    /// Report a completion even under `FI_SELECTIVE_COMPLETION`.
    pub report: bool,
}

impl Ep {
    /// A datagram endpoint ([`dgram`]).
    pub fn is_dgram(&self) -> bool {
        self.dgram.is_some()
    }

    /// Moves the connection whose QP is `qpn` (now in the error state) out of use.
    fn retire(&mut self, qpn: u32) {
        let up = |c: &Conn| matches!(c, Conn::Up(_, qp) if qp.qpn() == qpn);
        if let Some(k) = self.conns.iter().find(|(_, c)| up(c)).map(|(k, _)| *k) {
            if let Some(c) = self.conns.remove(&k) {
                self.dead.push(c);
            }
        }
        if let Some(i) = self.extra.iter().position(|(_, c)| up(c)) {
            let (_, c) = self.extra.remove(i);
            self.dead.push(c);
        }
    }
}

/// How a send goes out.
#[derive(Clone, Copy, Debug)]
pub struct SendReq {
    /// The destination (an AV index).
    pub dest: u64,
    /// The application's context, returned in the completion.
    pub ctx: u64,
    /// Copy the data now (`FI_INJECT`).
    pub inject: bool,
    /// Report no completion (the `fi_inject` calls; not `FI_INJECT` in a `*msg` call).
    pub silent: bool,
    /// Report a completion even under `FI_SELECTIVE_COMPLETION`.
    pub report: bool,
    /// Immediate data (`fi_senddata`).
    pub imm: Option<u32>,
    /// A triggered send.
    pub trig: Option<Trig>,
}

/// The remote side of an RMA or atomic operation ([`State::post_rma`]).
#[derive(Clone, Copy, Debug)]
pub enum RmaOp {
    /// RDMA WRITE of the local buffers to `addr`, with remote CQ data `imm`.
    Write {
        addr: u64,
        key: u64,
        imm: Option<u32>,
    },
    /// RDMA READ from `addr` into the local buffers.
    Read { addr: u64, key: u64 },
    /// 64-bit fetch-and-add at `addr` (8-byte aligned).
    FetchAdd { addr: u64, key: u64, add: u64 },
    /// 64-bit compare-and-swap at `addr` (8-byte aligned).
    CmpSwap {
        addr: u64,
        key: u64,
        compare: u64,
        swap: u64,
    },
}

/// How an RMA or atomic operation goes out.
#[derive(Clone, Copy, Debug)]
pub struct RmaReq {
    /// The destination (an AV index).
    pub dest: u64,
    /// The application's context, returned in the completion.
    pub ctx: u64,
    /// Copy the data now (`FI_INJECT`).
    pub inject: bool,
    /// Report no completion (the `fi_inject` calls; not `FI_INJECT` in a `*msg` call).
    pub silent: bool,
    /// Report a completion even under `FI_SELECTIVE_COMPLETION`.
    pub report: bool,
    /// The completion's flags (`FI_RMA | FI_WRITE`, ...).
    pub flags: u64,
    /// What is done at the target.
    pub op: RmaOp,
    /// A triggered operation.
    pub trig: Option<Trig>,
    /// A triggered atomic's operand: the local 8 bytes it is read from when it fires.
    pub operand: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sockaddr_in_and_the_native_address_of_its_ip_and_port_are_one_address() {
        let sin = sockaddr_in([127, 0, 0, 1], 9228);
        // As C lays out a struct sockaddr_in: family in native order, port big endian.
        assert_eq!(u16::from_ne_bytes([sin[0], sin[1]]), AF_INET);
        assert_eq!(&sin[2..4], &[0x24, 0x0c]);
        assert_eq!(&sin[4..8], &[127, 0, 0, 1]);
        assert_eq!(&sin[8..], &[0; 8]);
        assert_eq!(parse_sockaddr_in(&sin), Some(([127, 0, 0, 1], 9228)));
        let native = make_addr([127, 0, 0, 1], 9228);
        assert_eq!(addr_from_bytes(&sin), Some(native));
        assert_eq!(addr_from_bytes(&native), Some(native));
        assert_eq!(Format::SockaddrIn.out(&native), sin);
        assert_eq!(Format::Native.out(&native), native);
        // The native magic is no address family: neither reads as the other.
        assert_eq!(parse_sockaddr_in(&native), None);
        assert_eq!(parse_addr(&sin), None);
        // A number too large for a port keeps the native form.
        let big = make_addr([10, 0, 0, 1], 1 << 40);
        assert_eq!(Format::SockaddrIn.out(&big), big);
    }

    #[test]
    fn what_is_no_address_is_refused() {
        // Too short, another family, all zeros.
        assert_eq!(addr_from_bytes(&sockaddr_in([1, 2, 3, 4], 5)[..15]), None);
        let mut inet6 = sockaddr_in([1, 2, 3, 4], 5);
        inet6[0..2].copy_from_slice(&10u16.to_ne_bytes());
        assert_eq!(addr_from_bytes(&inet6), None);
        assert_eq!(addr_from_bytes(&[0; 16]), None);
        // As a destination: no wildcard, no port 0.
        assert_eq!(dest_from_bytes(&[0; 16]), Err(EINVAL));
        assert_eq!(dest_from_bytes(&sockaddr_in([0; 4], 80)), Err(EINVAL));
        assert_eq!(dest_from_bytes(&sockaddr_in([10, 0, 0, 1], 0)), Err(EINVAL));
        assert_eq!(
            dest_from_bytes(&sockaddr_in([10, 0, 0, 1], 80)),
            Ok(make_addr([10, 0, 0, 1], 80))
        );
        // The native form is taken as before (service 0 included: a NIC's address).
        let n = make_addr([10, 0, 0, 1], 0);
        assert_eq!(dest_from_bytes(&n), Ok(n));
    }

    #[test]
    fn formats_of_infos_and_their_text() {
        assert_eq!(Format::of(abi::FI_SOCKADDR), Format::SockaddrIn);
        assert_eq!(Format::of(abi::FI_SOCKADDR_IN), Format::SockaddrIn);
        assert_eq!(Format::of(abi::FI_FORMAT_UNSPEC), Format::Native);
        assert_eq!(Format::of(crate::info::ADDR_FORMAT), Format::Native);
        assert_eq!(Format::SockaddrIn.addr_format(), abi::FI_SOCKADDR_IN);
        assert_eq!(
            addr_str(&sockaddr_in([10, 0, 0, 2], 49152)),
            "fi_sockaddr_in://10.0.0.2:49152"
        );
        assert_eq!(
            addr_str(&make_addr([10, 0, 0, 2], 0x10)),
            "ringbell://10.0.0.2/0x10"
        );
        assert_eq!(addr_str(&[0; 16]), "ringbell://invalid");
    }
}
