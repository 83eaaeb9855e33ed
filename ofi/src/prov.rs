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
//! completion queue polls the CMs and the driver CQs. On the in-process fabric
//! ([`State::fabric`]) those polls are what steps the emulator; a CM with nothing to do
//! but wait lets the idle clock run to its next timer ([`ConnectionManager::poll`]).

use crate::abi;
use ringbell::cm::{CmEvent, ConnId, ConnectionManager, REJ_CONSUMER};
use ringbell::{
    Access, AhAttr, CompletionQueue, ConnectOptions, Device, MemoryRegion, ProtectionDomain,
    QpInit, QueuePair, RecvWr, SendWr, Sge, SharedReceiveQueue, WcStatus, WrOp,
};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Length of an endpoint address.
pub const ADDR_LEN: usize = 16;
/// An endpoint address: magic "RB", version 1, reserved, the NIC's IPv4 address, the
/// endpoint's CM service id (little endian).
pub type Addr = [u8; ADDR_LEN];
/// The largest inline (injected) send.
pub const INJECT: usize = crate::info::INJECT_SIZE;
/// `FI_ADDR_UNSPEC`.
pub const ADDR_UNSPEC: u64 = u64::MAX;
/// Environment variable: use only NIC `i` of the plan.
pub const ENV_NIC: &str = "RINGBELL_NIC";

/// The NIC index `RINGBELL_NIC` selects, if any.
pub fn selected_nic() -> Option<usize> {
    std::env::var(ENV_NIC).ok()?.trim().parse().ok()
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

/// The textual form of an address (`fi_av_straddr`).
pub fn addr_str(b: &[u8]) -> String {
    match parse_addr(b) {
        Some((ip, s)) => format!("ringbell://{}.{}.{}.{}/{s:#x}", ip[0], ip[1], ip[2], ip[3]),
        None => "ringbell://invalid".to_string(),
    }
}

/// What kind of object a key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Fabric,
    Eq,
    Domain,
    Cq,
    Av,
    Mr,
    Ep,
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
    /// Source address (`fi_cq_readfrom`): always not available.
    pub src: u64,
    /// 0 for success, else a positive libfabric error number.
    pub err: i32,
    pub prov_errno: i32,
}

pub struct Cq {
    /// Words per entry: 1 (CONTEXT), 3 (MSG), 5 (DATA), 6 (TAGGED).
    pub words: usize,
    pub entries: VecDeque<Entry>,
    pub errs: VecDeque<Entry>,
}

pub struct Av {
    pub addrs: Vec<Option<Addr>>,
}

pub struct Domain {
    pub nic: usize,
    pub pd: ProtectionDomain,
}

pub struct Mr {
    pub mr: MemoryRegion,
}

enum Conn {
    /// Connecting (or accepting): the sends that wait.
    Pending(ConnId, Vec<Pending>),
    Up(ConnId, Box<QueuePair>),
}

struct Pending {
    wr_id: u64,
    sges: Vec<Sge>,
    inline: Option<Vec<u8>>,
    imm: Option<u32>,
}

struct Op {
    ctx: u64,
    send: bool,
    report: bool,
    buf: u64,
    _tmp: Vec<MemoryRegion>,
    /// An injected message too long to be inline: the copy its registration covers.
    _copy: Vec<u8>,
}

pub struct Ep {
    pub domain: usize,
    pub nic: usize,
    pub addr: Addr,
    pub service: u64,
    pub av: Option<usize>,
    pub txcq: Option<usize>,
    pub rxcq: Option<usize>,
    pub tx_selective: bool,
    pub rx_selective: bool,
    pub enabled: bool,
    conns: HashMap<Addr, Conn>,
    extra: Vec<Conn>,
    ops: HashMap<u64, Op>,
    next_wr: u64,
    srq: Option<SharedReceiveQueue>,
    cq: Option<CompletionQueue>,
}

pub enum Obj {
    Fabric,
    Eq,
    Domain(Domain),
    Cq(Cq),
    Av(Av),
    Mr(Mr),
    Ep(Box<Ep>),
}

impl Obj {
    pub fn kind(&self) -> Kind {
        match self {
            Obj::Fabric => Kind::Fabric,
            Obj::Eq => Kind::Eq,
            Obj::Domain(_) => Kind::Domain,
            Obj::Cq(_) => Kind::Cq,
            Obj::Av(_) => Kind::Av,
            Obj::Mr(_) => Kind::Mr,
            Obj::Ep(_) => Kind::Ep,
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

fn connect_opts() -> ConnectOptions {
    ConnectOptions::default()
}

impl State {
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
            Some(Obj::Domain(d)) => Ok(d),
            _ => Err(EINVAL),
        }
    }

    /// Opens NIC `i` (once per process) with its connection manager.
    pub fn open_nic(&mut self, i: usize) -> Result<(), Errno> {
        if self.nics.contains_key(&i) {
            return Ok(());
        }
        let plan = ringbell::discover::NicPlan::from_env();
        let src = plan.nics.get(i).cloned().ok_or(abi::FI_ENODEV)?;
        let dev = match src {
            ringbell::discover::NicSource::Served(path) => {
                let port = ringbell::VfioPort::connect(&path).map_err(|e| {
                    eprintln!("ringbell-fi: {}: {e}", path.display());
                    abi::FI_ENODEV
                })?;
                Device::open(Box::new(port)).map_err(|e| {
                    eprintln!("ringbell-fi: opening rb{i}: {e}");
                    abi::FI_ENODEV
                })?
            }
            ringbell::discover::NicSource::InProcess(node) => {
                let (n, seed) = (plan.nics.len(), plan.seed);
                let fabric = self.fabric.get_or_insert_with(|| {
                    ringbell_emu::Fabric::new(ringbell_emu::FabricConfig::new(n, seed))
                });
                Device::open(Box::new(fabric.port(node))).map_err(|e| {
                    eprintln!("ringbell-fi: opening rb{i}: {e}");
                    abi::FI_ENODEV
                })?
            }
        };
        let cm = ConnectionManager::new(&dev).map_err(|_| abi::FI_ENODEV)?;
        self.nics.insert(i, Nic { dev, cm });
        Ok(())
    }

    /// A new domain on NIC `nic`.
    pub fn new_domain(&mut self, nic: usize) -> Result<Domain, Errno> {
        self.open_nic(nic)?;
        let pd = self.nics[&nic].dev.alloc_pd().map_err(|_| abi::FI_ENOMEM)?;
        Ok(Domain { nic, pd })
    }

    /// Registers `len` bytes at `addr` (user memory) in domain `dom`.
    ///
    /// # Safety
    /// `addr..addr+len` is memory of this process that stays mapped while registered.
    pub unsafe fn reg(&self, dom: usize, addr: usize, len: usize) -> Result<MemoryRegion, Errno> {
        let d = self.domain(dom)?;
        let acc = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        // SAFETY: per the caller.
        unsafe { d.pd.reg_user_mr(addr as *mut u8, len, addr as u64, acc) }.map_err(|e| {
            eprintln!("ringbell-fi: registering {len} bytes at {addr:#x}: {e}");
            EINVAL
        })
    }

    /// A new endpoint in domain `dom`.
    pub fn new_ep(&mut self, dom: usize) -> Result<Ep, Errno> {
        let nic = self.domain(dom)?.nic;
        self.next_service += 1;
        let service = ((std::process::id() as u64) << 20) | self.next_service;
        let ip = self.nics[&nic].cm.address().ip;
        Ok(Ep {
            domain: dom,
            nic,
            addr: make_addr(ip, service),
            service,
            av: None,
            txcq: None,
            rxcq: None,
            tx_selective: false,
            rx_selective: false,
            enabled: false,
            conns: HashMap::new(),
            extra: Vec::new(),
            ops: HashMap::new(),
            next_wr: 1,
            srq: None,
            cq: None,
        })
    }

    /// `fi_enable`: the endpoint's SRQ and CQ, and its listener.
    pub fn enable(&mut self, ep: usize) -> Result<(), Errno> {
        let (dom, nic, service) = {
            let e = self.ep_mut(ep)?;
            if e.enabled {
                return Ok(());
            }
            if e.txcq.is_none() || e.rxcq.is_none() || e.av.is_none() {
                return Err(abi::FI_ENOCQ);
            }
            (e.domain, e.nic, e.service)
        };
        let (srq, cq) = {
            let d = self.domain(dom)?;
            let srq = d.pd.create_srq(1024, 4, 0).map_err(|_| abi::FI_ENOMEM)?;
            let cq = self.nics[&nic]
                .dev
                .create_cq(4096)
                .map_err(|_| abi::FI_ENOMEM)?;
            (srq, cq)
        };
        self.nics
            .get_mut(&nic)
            .ok_or(EINVAL)?
            .cm
            .listen(service)
            .map_err(|_| abi::FI_EADDRINUSE)?;
        let e = self.ep_mut(ep)?;
        e.srq = Some(srq);
        e.cq = Some(cq);
        e.enabled = true;
        Ok(())
    }

    /// The local SGEs of user buffers `(addr, len, desc)`, registering those without a
    /// descriptor for the operation's lifetime.
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation completes.
    unsafe fn sges(
        &self,
        dom: usize,
        bufs: &[(usize, usize, usize)],
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
                let mr = unsafe { self.reg(dom, addr, len)? };
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

    /// `fi_recv` and friends.
    ///
    /// # Safety
    /// Every buffer is memory of this process that stays mapped until the operation
    /// completes.
    pub unsafe fn post_recv(
        &mut self,
        ep: usize,
        bufs: &[(usize, usize, usize)],
        ctx: u64,
        report: bool,
    ) -> Result<(), Errno> {
        let dom = {
            let e = self.ep_mut(ep)?;
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            e.domain
        };
        // SAFETY: per the caller.
        let (sges, tmp) = unsafe { self.sges(dom, bufs)? };
        let e = self.ep_mut(ep)?;
        let wr_id = e.next_wr;
        e.next_wr += 1;
        let srq = e.srq.as_mut().ok_or(abi::FI_EOPBADSTATE)?;
        srq.post_recv(&[RecvWr { wr_id, sgl: &sges }])
            .map_err(|_| EAGAIN)?;
        let report = report || !e.rx_selective;
        e.ops.insert(
            wr_id,
            Op {
                ctx,
                send: false,
                report,
                buf: bufs.first().map_or(0, |b| b.0 as u64),
                _tmp: tmp,
                _copy: Vec::new(),
            },
        );
        Ok(())
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
            report,
            imm,
        } = req;
        let (dom, nic, av, own) = {
            let e = self.ep_mut(ep)?;
            if !e.enabled {
                return Err(abi::FI_EOPBADSTATE);
            }
            (e.domain, e.nic, e.av.ok_or(abi::FI_ENOAV)?, e.addr)
        };
        let peer = self
            .av_mut(av)?
            .addrs
            .get(usize::try_from(dest).map_err(|_| EINVAL)?)
            .copied()
            .flatten()
            .ok_or(EINVAL)?;
        let mut copy = Vec::new();
        let (sges, tmp, inline) = if inject {
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
            let max_inline = self.nics.get(&nic).ok_or(EINVAL)?.dev.caps().max_inline as usize;
            if data.len() <= max_inline {
                (Vec::new(), Vec::new(), Some(data))
            } else {
                // SAFETY: `data` is this library's heap copy, kept with the operation (a
                // Vec's buffer does not move when the Vec does) until it completes.
                let mr = unsafe { self.reg(dom, data.as_ptr() as usize, data.len())? };
                let sge = Sge {
                    addr: data.as_ptr() as u64,
                    len: data.len() as u32,
                    lkey: mr.lkey(),
                };
                copy = data;
                (vec![sge], vec![mr], None)
            }
        } else {
            // SAFETY: per the caller.
            let (s, t) = unsafe { self.sges(dom, bufs)? };
            (s, t, None)
        };
        let e = self.ep_mut(ep)?;
        let wr_id = e.next_wr;
        e.next_wr += 1;
        let report = !inject && (report || !e.tx_selective);
        let p = Pending {
            wr_id,
            sges,
            inline,
            imm,
        };
        match e.conns.get_mut(&peer) {
            Some(Conn::Up(_, qp)) => post_pending(qp, &p)?,
            Some(Conn::Pending(_, q)) => q.push(p),
            None => {
                let (ip, service) = parse_addr(&peer).ok_or(EINVAL)?;
                let ah = AhAttr::on_fabric(ip).ok_or(abi::FI_EHOSTUNREACH)?;
                let qp = new_qp(self.domain(dom)?, self.objs_ep(ep)?)?;
                let id = self
                    .nics
                    .get_mut(&nic)
                    .ok_or(EINVAL)?
                    .cm
                    .connect(ah, service, qp, &connect_opts(), &own)
                    .map_err(|_| EAGAIN)?;
                self.ep_mut(ep)?
                    .conns
                    .insert(peer, Conn::Pending(id, vec![p]));
            }
        }
        self.ep_mut(ep)?.ops.insert(
            wr_id,
            Op {
                ctx,
                send: true,
                report,
                buf: bufs.first().map_or(0, |b| b.0 as u64),
                _tmp: tmp,
                _copy: copy,
            },
        );
        Ok(())
    }

    fn objs_ep(&self, ep: usize) -> Result<&Ep, Errno> {
        match self.objs.get(&ep) {
            Some(Obj::Ep(e)) => Ok(e),
            _ => Err(EINVAL),
        }
    }

    /// Drives the CMs and every endpoint's completions into the completion queues.
    pub fn progress(&mut self) {
        let mut events = Vec::new();
        for (&i, n) in self.nics.iter_mut() {
            n.dev.progress();
            while let Some(e) = n.cm.poll() {
                events.push((i, e));
            }
        }
        for (nic, ev) in events {
            self.on_cm_event(nic, ev);
        }
        let mut out: Vec<(usize, Entry)> = Vec::new();
        for o in self.objs.values_mut() {
            let Obj::Ep(e) = o else { continue };
            let Some(cq) = e.cq.as_mut() else { continue };
            let mut wc = [ringbell::WorkCompletion::default(); 16];
            loop {
                let k = cq.poll(&mut wc);
                for w in &wc[..k] {
                    let Some(op) = e.ops.remove(&w.wr_id) else {
                        continue;
                    };
                    let ok = w.status == WcStatus::Success;
                    if !ok || op.report {
                        let (cq, mut flags) = if op.send {
                            (e.txcq, abi::FI_SEND as u64 | abi::FI_MSG as u64)
                        } else {
                            (e.rxcq, abi::FI_RECV as u64 | abi::FI_MSG as u64)
                        };
                        if !op.send && w.imm.is_some() {
                            flags |= abi::FI_REMOTE_CQ_DATA as u64;
                        }
                        let Some(cq) = cq else { continue };
                        out.push((
                            cq,
                            Entry {
                                ctx: op.ctx,
                                flags,
                                len: if op.send { 0 } else { w.byte_len as u64 },
                                buf: if op.send { 0 } else { op.buf },
                                src: ADDR_UNSPEC,
                                err: if ok { 0 } else { abi::FI_EIO as i32 },
                                prov_errno: if ok { 0 } else { w.status as i32 },
                                data: w.imm.map_or(0, u64::from),
                                tag: 0,
                            },
                        ));
                    }
                }
                if k < wc.len() {
                    break;
                }
            }
        }
        for (cq, en) in out {
            if let Ok(c) = self.cq_mut(cq) {
                if en.err == 0 {
                    c.entries.push_back(en);
                } else {
                    c.errs.push_back(en);
                }
            }
        }
    }

    fn on_cm_event(&mut self, nic: usize, ev: CmEvent) {
        match ev {
            CmEvent::ConnectRequest {
                id,
                service_id,
                private,
                ..
            } => {
                let key = self.objs.iter().find_map(|(&k, o)| match o {
                    Obj::Ep(e) if e.enabled && e.nic == nic && e.service == service_id => Some(k),
                    _ => None,
                });
                let peer: Option<Addr> = private.get(..ADDR_LEN).and_then(|b| b.try_into().ok());
                let (Some(key), Some(peer)) = (key, peer) else {
                    if let Some(n) = self.nics.get_mut(&nic) {
                        let _ = n.cm.reject(id, REJ_CONSUMER, &[]);
                    }
                    return;
                };
                let Ok(e) = self.objs_ep(key) else { return };
                let own = e.addr;
                let Ok(d) = self.domain(e.domain) else { return };
                let Ok(qp) = new_qp(d, e) else {
                    if let Some(n) = self.nics.get_mut(&nic) {
                        let _ = n.cm.reject(id, REJ_CONSUMER, &[]);
                    }
                    return;
                };
                let Some(n) = self.nics.get_mut(&nic) else {
                    return;
                };
                if n.cm.accept(id, qp, &connect_opts(), &own).is_err() {
                    return;
                }
                let Ok(e) = self.ep_mut(key) else { return };
                if let std::collections::hash_map::Entry::Vacant(v) = e.conns.entry(peer) {
                    v.insert(Conn::Pending(id, Vec::new()));
                } else {
                    e.extra.push(Conn::Pending(id, Vec::new()));
                }
            }
            CmEvent::Established { id, mut qp, .. } => {
                for o in self.objs.values_mut() {
                    let Obj::Ep(e) = o else { continue };
                    if e.nic != nic {
                        continue;
                    }
                    for c in e.conns.values_mut().chain(e.extra.iter_mut()) {
                        if let Conn::Pending(cid, q) = c {
                            if *cid == id {
                                for p in q.iter() {
                                    let _ = post_pending(&mut qp, p);
                                }
                                *c = Conn::Up(id, Box::new(qp));
                                return;
                            }
                        }
                    }
                }
            }
            CmEvent::Rejected { id, .. } | CmEvent::TimedOut { id, .. } => {
                let mut failed = Vec::new();
                for o in self.objs.values_mut() {
                    let Obj::Ep(e) = o else { continue };
                    if e.nic != nic {
                        continue;
                    }
                    let gone: Vec<Addr> = e
                        .conns
                        .iter()
                        .filter(|(_, c)| matches!(c, Conn::Pending(cid, _) if *cid == id))
                        .map(|(a, _)| *a)
                        .collect();
                    for a in gone {
                        if let Some(Conn::Pending(_, q)) = e.conns.remove(&a) {
                            for p in q {
                                if let Some(op) = e.ops.remove(&p.wr_id) {
                                    if let Some(cq) = e.txcq {
                                        failed.push((cq, op.ctx));
                                    }
                                }
                            }
                        }
                    }
                }
                for (cq, ctx) in failed {
                    if let Ok(c) = self.cq_mut(cq) {
                        c.errs.push_back(Entry {
                            ctx,
                            flags: abi::FI_SEND as u64 | abi::FI_MSG as u64,
                            err: abi::FI_EHOSTUNREACH as i32,
                            src: ADDR_UNSPEC,
                            ..Default::default()
                        });
                    }
                }
            }
            CmEvent::Disconnected { id } => {
                for o in self.objs.values_mut() {
                    let Obj::Ep(e) = o else { continue };
                    if e.nic == nic {
                        e.conns
                            .retain(|_, c| !matches!(c, Conn::Up(cid, _) if *cid == id));
                    }
                }
            }
        }
    }

    /// Closes the endpoint's listener (before the endpoint is dropped).
    pub fn close_ep(&mut self, ep: &Ep) {
        if ep.enabled {
            if let Some(n) = self.nics.get_mut(&ep.nic) {
                n.cm.unlisten(ep.service);
            }
        }
    }
}

fn new_qp(d: &Domain, e: &Ep) -> Result<QueuePair, Errno> {
    let cq = e.cq.as_ref().ok_or(abi::FI_EOPBADSTATE)?;
    let mut init = QpInit::new(cq, cq);
    init.srq = e.srq.as_ref();
    init.max_inline = d.pd.device().caps().max_inline.min(INJECT as u32);
    init.max_send_wr = 256;
    init.max_send_sge = 4;
    d.pd.create_qp(&init).map_err(|e| {
        eprintln!("ringbell-fi: creating a QP: {e}");
        abi::FI_ENOMEM
    })
}

fn post_pending(qp: &mut QueuePair, p: &Pending) -> Result<(), Errno> {
    let op = match p.imm {
        Some(i) => WrOp::SendImm(i),
        None => WrOp::Send,
    };
    let wr = match &p.inline {
        Some(d) => SendWr::inline(p.wr_id, op, d),
        None => SendWr::new(p.wr_id, op, &p.sges),
    };
    qp.post_send(&[wr.flags(ringbell::SendFlags::SIGNALED)])
        .map_err(|_| EAGAIN)
}

impl Cq {
    pub fn new(format: u32) -> Result<Cq, Errno> {
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

/// How a send goes out.
#[derive(Clone, Copy, Debug)]
pub struct SendReq {
    /// The destination (an AV index).
    pub dest: u64,
    /// The application's context, returned in the completion.
    pub ctx: u64,
    /// Copy the data now and report no completion.
    pub inject: bool,
    /// Report a completion even under `FI_SELECTIVE_COMPLETION`.
    pub report: bool,
    /// Immediate data (`fi_senddata`).
    pub imm: Option<u32>,
}
