//! Connected endpoints (`FI_EP_MSG`, fi_cm(3)): a passive endpoint listens on a service
//! number of its NIC's connection manager and reports each connection request on its event
//! queue (`FI_CONNREQ`, with an info whose `handle` names the request); an endpoint opened
//! with that info accepts (`fi_accept`) or the passive endpoint rejects (`fi_reject`); an
//! active endpoint connects (`fi_connect`) to a passive endpoint's address. Either side's
//! event queue reports `FI_CONNECTED` once the connection is up (the active side with the
//! acceptor's private data), an error entry `FI_ECONNREFUSED` (or `FI_ETIMEDOUT`) when it
//! cannot be made, and `FI_SHUTDOWN` when either side shuts it down (`fi_shutdown`).
//!
//! The endpoint is an RDM endpoint with one connection (one RC QP on its SRQ): messages,
//! RMA and atomics go over it whatever address they name.
//!
//! Tagged messages (an endpoint whose info has `FI_TAGGED`) go over a tagged channel of
//! the endpoint's own, as an RDM endpoint's do ([`CH_TAG`], [`tagged`]): once enabled
//! the endpoint listens on a second service number of the process's, and each side of a
//! connection gives the other the address of that channel ahead of the application's
//! private data ([`TAG_PREFIX`] bytes, all zero for an endpoint without one); the first
//! tagged send connects it, and both sides then send over that one connection.

use super::*;

/// An event queue's entries.
#[derive(Default)]
pub struct Eq {
    pub events: VecDeque<EqEvent>,
    pub errs: VecDeque<EqErr>,
    /// The wait object asked for (`fi_eq_attr::wait_obj`) and, for `FI_WAIT_FD`, its
    /// descriptor.
    pub wait_obj: u32,
    pub wait: Option<super::FdWait>,
}

/// One event: `event` (`FI_CONNREQ`, `FI_CONNECTED`, `FI_SHUTDOWN`) of object `fid` (an
/// endpoint or passive endpoint's key), with a connection request's handle and the peer's
/// private data.
pub struct EqEvent {
    pub event: u32,
    pub fid: usize,
    /// A connection request (`FI_CONNREQ`): the NIC and the handle's key.
    pub connreq: Option<(usize, usize)>,
    pub data: Vec<u8>,
    /// A connection request's: what its listener's info asked.
    pub listen: Option<ListenAttrs>,
    /// An event the application wrote (`fi_eq_write`): `data` is its whole entry, read
    /// back as written.
    pub written: bool,
}

/// An error entry: a connection of endpoint `fid` that could not be made (the peer's
/// private data of a rejection is not passed on).
pub struct EqErr {
    pub fid: usize,
    pub err: u32,
}

/// A passive endpoint.
pub struct Pep {
    pub nic: usize,
    pub service: u64,
    pub named: bool,
    /// The number is one the provider claimed ([`names::claim`]), withdrawn at close.
    pub claimed: bool,
    /// The format of its info: `fi_getname` gives its address in it, and the requests it
    /// reports carry it.
    pub format: Format,
    pub addr: Addr,
    pub eq: Option<usize>,
    pub listening: bool,
    /// What the info it was opened with asked of its connections, passed on in every
    /// `FI_CONNREQ`'s info.
    pub attrs: Option<ListenAttrs>,
}

/// The parts of a passive endpoint's info that a connection request's info carries:
/// capabilities, modes, and the transmit and receive attributes (default operation flags
/// such as `FI_MULTI_RECV` among them), as fi_getinfo gave them to the listener.
#[derive(Clone, Copy, Debug)]
pub struct ListenAttrs {
    pub format: Format,
    pub caps: u64,
    pub mode: u64,
    pub tx: abi::fi_tx_attr,
    pub rx: abi::fi_rx_attr,
}

/// A connection request not yet answered.
pub struct ConnReq {
    pub nic: usize,
    pub id: ConnId,
    /// The requester's NIC.
    pub from: AhAttr,
    /// The service number of the passive endpoint it came to: in a sockaddr format the
    /// endpoint that accepts it has that address (as an accepted socket has its
    /// listener's).
    pub service: u64,
    /// The address of the requester's tagged channel, if it has one.
    pub peer_tag: Option<Addr>,
}

/// A connected endpoint's state.
#[derive(Default)]
pub struct MsgEp {
    pub eq: Option<usize>,
    /// The request it was opened to accept (`info->handle`).
    pub connreq: Option<usize>,
    /// Its one connection, once asked for.
    pub id: Option<ConnId>,
    pub key: Option<ConnKey>,
    /// Its info asked for tagged messages: it has a tagged channel once enabled.
    pub tagged: bool,
    /// The service number its tagged channel listens on.
    pub tag_service: Option<u64>,
    /// The address of the peer's tagged channel, as the peer gave it when connecting.
    pub peer_tag: Option<Addr>,
    /// It accepted its connection (it did not ask for it).
    pub accepted: bool,
}

/// Bytes ahead of the application's private data in a connection request or reply: the
/// address of the sender's tagged channel (zero: none).
pub const TAG_PREFIX: usize = ADDR_LEN;

/// The tagged channel's address in the head of private data `p`, if any.
fn tag_prefix_of(p: &[u8]) -> Option<Addr> {
    let a: Addr = p.get(..TAG_PREFIX)?.try_into().ok()?;
    parse_addr(&a).map(|_| a)
}

impl State {
    /// A passive endpoint on NIC `nic`, on service number `named` (the application's) or one
    /// of this process's own (in a sockaddr format a claimed port, as for endpoints:
    /// [`State::new_ep`]).
    pub fn new_pep(
        &mut self,
        nic: usize,
        named: Option<u64>,
        format: Format,
    ) -> Result<Pep, Errno> {
        if format == Format::SockaddrIn && named.is_some_and(|s| s > MAX_PORT) {
            return Err(EINVAL);
        }
        self.open_nic(nic)?;
        let service = match (named, format) {
            (Some(s), _) => s,
            (None, Format::SockaddrIn) => names::claim(nic, None).ok_or(abi::FI_EADDRINUSE)?,
            (None, Format::Native) => self.own_service(),
        };
        let ip = self.nics[&nic].cm.address().ip;
        Ok(Pep {
            nic,
            service,
            named: named.is_some(),
            claimed: named.is_none() && format == Format::SockaddrIn,
            format,
            addr: make_addr(ip, service),
            eq: None,
            listening: false,
            attrs: None,
        })
    }

    fn pep_mut(&mut self, key: usize) -> Result<&mut Pep, Errno> {
        match self.objs.get_mut(&key) {
            Some(Obj::Pep(p)) => Ok(p),
            _ => Err(EINVAL),
        }
    }

    /// `fi_listen`: needs an event queue.
    pub fn listen(&mut self, key: usize) -> Result<(), Errno> {
        let p = self.pep_mut(key)?;
        if p.listening {
            return Ok(());
        }
        if p.eq.is_none() {
            return Err(abi::FI_ENOEQ);
        }
        let (nic, service, named) = (p.nic, p.service, p.named);
        self.listen_on(nic, service)?;
        if named {
            names::publish(service, nic, None);
        }
        self.pep_mut(key)?.listening = true;
        Ok(())
    }

    /// Before a passive endpoint is dropped.
    pub fn close_pep(&mut self, p: &Pep) {
        if p.listening {
            self.stop_listening(p.nic, p.service, p.named);
        }
        if p.claimed {
            names::unpublish(p.service, p.nic);
        }
    }

    /// `fi_setname` of endpoint or passive endpoint `key`: address `a` (either format,
    /// [`addr_from_bytes`]) becomes its own, before it is enabled or listens
    /// (`-FI_EOPBADSTATE` after). Its IPv4 address is the wildcard, the NIC's own or an
    /// address of this host that is no NIC's (all name the NIC, as a socket bound to
    /// them would be reached); another NIC's is `-FI_EADDRNOTAVAIL`. Port (service) 0
    /// keeps the number it has (fi_cm(3): the provider assigns one); another becomes the
    /// application's, as one given with `FI_SOURCE` is (published while it listens).
    pub fn setname(&mut self, key: usize, b: &[u8]) -> Result<(), Errno> {
        let (ip, service) = addr_from_bytes(b)
            .and_then(|a| parse_addr(&a))
            .ok_or(EINVAL)?;
        let (nic, format, busy) = match self.objs.get(&key) {
            Some(Obj::Pep(p)) => (p.nic, p.format, p.listening),
            Some(Obj::Ep(e)) if !e.srx => (e.nic, e.format, e.enabled),
            _ => return Err(EINVAL),
        };
        if busy {
            return Err(abi::FI_EOPBADSTATE);
        }
        if format == Format::SockaddrIn && service > MAX_PORT {
            return Err(EINVAL);
        }
        let own = self.nics.get(&nic).ok_or(EINVAL)?.cm.address().ip;
        if ip != [0; 4] && ip != own && AhAttr::on_fabric(ip).is_some() {
            return Err(abi::FI_EADDRNOTAVAIL);
        }
        if service == 0 {
            return Ok(());
        }
        let (old, claimed) = match self.objs.get_mut(&key) {
            Some(Obj::Pep(p)) => {
                let was = (p.service, p.claimed);
                (p.service, p.named, p.claimed) = (service, true, false);
                p.addr = make_addr(own, service);
                was
            }
            Some(Obj::Ep(e)) => {
                let was = (e.service, e.claimed);
                (e.service, e.named, e.claimed) = (service, true, false);
                e.addr = make_addr(own, service);
                was
            }
            _ => return Err(EINVAL),
        };
        if claimed && old != service {
            names::unpublish(old, nic);
        }
        Ok(())
    }

    /// What an endpoint opened with `info->handle` naming passive endpoint `pep`
    /// (fi_endpoint(3)) takes from it: its service number, whether it was the
    /// application's, and its claim on it. The passive endpoint stops listening and keeps
    /// nothing. `-FI_EINVAL` for a passive endpoint of another NIC than `nic`.
    pub fn take_pep_addr(&mut self, pep: usize, nic: usize) -> Result<(u64, bool, bool), Errno> {
        let p = self.pep_mut(pep)?;
        if p.nic != nic {
            return Err(EINVAL);
        }
        let (service, named, claimed, listening) = (p.service, p.named, p.claimed, p.listening);
        p.claimed = false;
        p.listening = false;
        if listening {
            self.stop_listening(nic, service, named);
        }
        Ok((service, named, claimed))
    }

    /// The NIC and service number of passive endpoint `pep`.
    pub fn pep_addr(&mut self, pep: usize) -> Result<(usize, u64), Errno> {
        let p = self.pep_mut(pep)?;
        Ok((p.nic, p.service))
    }

    /// `fi_connect` of endpoint `ep` to address `to` with private data `param`.
    pub fn connect(&mut self, ep: usize, to: &Addr, param: &[u8]) -> Result<(), Errno> {
        let e = self.objs_ep(ep)?;
        if !e.enabled {
            return Err(abi::FI_EOPBADSTATE);
        }
        let m = e.msg.as_ref().ok_or(EINVAL)?;
        if m.id.is_some() || m.connreq.is_some() {
            return Err(abi::FI_EISCONN);
        }
        let nic = e.nic;
        let addr = resolve_addr(to);
        let (ip, service) = parse_addr(&addr).ok_or(EINVAL)?;
        let ah = AhAttr::on_fabric(ip).ok_or(abi::FI_EHOSTUNREACH)?;
        let qp = new_qp(self.domain(e.domain)?, e, self.rx_srq(e))?;
        let private = [&self.tag_prefix(ep)?[..], param].concat();
        // The endpoint's FI_REMOTE_WRITE/FI_REMOTE_READ counters count on its one QP.
        self.bind_remote_cntrs(ep, &qp, CH_MSG);
        let id = self
            .nics
            .get_mut(&nic)
            .ok_or(EINVAL)?
            .cm
            .connect(ah, service, qp, &connect_opts(), &private)
            .map_err(|_| EINVAL)?;
        let key = (addr, CH_MSG);
        let e = self.ep_mut(ep)?;
        e.conns.insert(key, Conn::Pending(id, Vec::new()));
        let m = e.msg.as_mut().ok_or(EINVAL)?;
        m.id = Some(id);
        m.key = Some(key);
        Ok(())
    }

    /// `fi_accept` of the request endpoint `ep` was opened for, with private data `param`.
    pub fn accept(&mut self, ep: usize, param: &[u8]) -> Result<(), Errno> {
        let e = self.objs_ep(ep)?;
        if !e.enabled {
            return Err(abi::FI_EOPBADSTATE);
        }
        let handle = e.msg.as_ref().and_then(|m| m.connreq).ok_or(EINVAL)?;
        if e.msg.as_ref().is_some_and(|m| m.id.is_some()) {
            return Err(abi::FI_EISCONN);
        }
        let Some(Obj::ConnReq(r)) = self.objs.get(&handle) else {
            return Err(EINVAL);
        };
        let (nic, id, from, peer_tag) = (r.nic, r.id, r.from, r.peer_tag);
        if nic != e.nic {
            return Err(EINVAL);
        }
        let qp = new_qp(self.domain(e.domain)?, e, self.rx_srq(e))?;
        let private = [&self.tag_prefix(ep)?[..], param].concat();
        self.bind_remote_cntrs(ep, &qp, CH_MSG);
        self.nics
            .get_mut(&nic)
            .ok_or(EINVAL)?
            .cm
            .accept(id, qp, &connect_opts(), &private)
            .map_err(|_| abi::FI_ECONNABORTED)?;
        let key = (make_addr(from.ip, u64::from(id.0)), CH_MSG);
        self.free_connreq(handle);
        let e = self.ep_mut(ep)?;
        e.msg.as_mut().ok_or(EINVAL)?.connreq = None;
        e.conns.insert(key, Conn::Pending(id, Vec::new()));
        let m = e.msg.as_mut().ok_or(EINVAL)?;
        m.id = Some(id);
        m.key = Some(key);
        m.peer_tag = peer_tag;
        m.accepted = true;
        Ok(())
    }

    /// What endpoint `ep` puts ahead of its private data: its tagged channel's address.
    fn tag_prefix(&self, ep: usize) -> Result<Addr, Errno> {
        let e = self.objs_ep(ep)?;
        let ip = self.nics.get(&e.nic).ok_or(EINVAL)?.cm.address().ip;
        Ok(match e.msg.as_ref().and_then(|m| m.tag_service) {
            Some(s) => make_addr(ip, s),
            None => [0; TAG_PREFIX],
        })
    }

    /// Where the tagged messages of connected endpoint `ep` go: its peer's tagged channel
    /// (`-FI_ENOTCONN` before the connection is made, or when the peer has none).
    pub(super) fn tag_dest(&self, ep: usize) -> Result<Option<Addr>, Errno> {
        match self.objs_ep(ep)?.msg.as_ref() {
            Some(m) => m.peer_tag.map(Some).ok_or(abi::FI_ENOTCONN),
            None => Ok(None),
        }
    }

    /// Forgets connection request `handle` and frees its `struct fid`.
    fn free_connreq(&mut self, handle: usize) {
        if self.objs.remove(&handle).is_some() {
            // SAFETY: a registered connection request's key is the box `pep_request` made,
            // just removed from the registry, so nothing reaches it any more.
            drop(unsafe { Box::from_raw(handle as *mut abi::fid) });
        }
    }

    /// `fi_reject` of request `handle` by passive endpoint `pep`.
    pub fn reject(&mut self, pep: usize, handle: usize, param: &[u8]) -> Result<(), Errno> {
        let nic = self.pep_mut(pep)?.nic;
        let Some(Obj::ConnReq(r)) = self.objs.get(&handle) else {
            return Err(EINVAL);
        };
        if r.nic != nic {
            return Err(EINVAL);
        }
        let id = r.id;
        self.free_connreq(handle);
        self.nics
            .get_mut(&nic)
            .ok_or(EINVAL)?
            .cm
            .reject(id, REJ_CONSUMER, param)
            .map_err(|_| EINVAL)
    }

    /// `fi_shutdown`: the connection is closed; both sides' event queues report
    /// `FI_SHUTDOWN`.
    pub fn shutdown(&mut self, ep: usize) -> Result<(), Errno> {
        let e = self.objs_ep(ep)?;
        let nic = e.nic;
        let id = e.msg.as_ref().ok_or(EINVAL)?.id.ok_or(abi::FI_ENOTCONN)?;
        self.nics
            .get_mut(&nic)
            .ok_or(EINVAL)?
            .cm
            .disconnect(id)
            .map_err(|_| abi::FI_ENOTCONN)
    }

    /// The connection a message, RMA or atomic of connected endpoint `ep` goes over.
    pub(super) fn msg_dest(&self, ep: usize) -> Result<Option<Addr>, Errno> {
        match &self.objs_ep(ep)?.msg {
            None => Ok(None),
            Some(m) => m.key.map(|k| Some(k.0)).ok_or(abi::FI_ENOTCONN),
        }
    }

    /// `fi_eq_write`: event `event` with entry `entry` (read back as written) joins event
    /// queue `eq`, and wakes its waiters.
    pub fn eq_write(&mut self, eq: usize, event: u32, entry: &[u8]) -> Result<(), Errno> {
        if !matches!(self.objs.get(&eq), Some(Obj::Eq(_))) {
            return Err(EINVAL);
        }
        self.eq_push(
            Some(eq),
            Ok(EqEvent {
                event,
                fid: 0,
                connreq: None,
                data: entry.to_vec(),
                listen: None,
                written: true,
            }),
        );
        self.wait_sync(eq);
        Ok(())
    }

    fn eq_push(&mut self, eq: Option<usize>, ev: Result<EqEvent, EqErr>) {
        if let Some(Obj::Eq(q)) = eq.and_then(|k| self.objs.get_mut(&k)) {
            match ev {
                Ok(e) => q.events.push_back(e),
                Err(e) => q.errs.push_back(e),
            }
        }
    }

    /// A connection request for a listening passive endpoint of NIC `nic` on `service`:
    /// reported on its event queue (true), or none listens there (false).
    pub(super) fn pep_request(
        &mut self,
        nic: usize,
        id: ConnId,
        service: u64,
        from: AhAttr,
        private: &[u8],
    ) -> bool {
        let Some((key, eq, listen)) = self.objs.iter().find_map(|(&k, o)| match o {
            Obj::Pep(p) if p.listening && p.nic == nic && p.service == service => {
                Some((k, p.eq, p.attrs))
            }
            _ => None,
        }) else {
            return false;
        };
        // The handle: a `struct fid` of class FI_CLASS_CONNREQ, a key of the registry
        // (freed when the request is answered, [`free_connreq`]).
        let handle = Box::into_raw(Box::new(abi::fid {
            fclass: abi::FI_CLASS_CONNREQ as usize,
            context: std::ptr::null_mut(),
            ops: std::ptr::null_mut(),
        })) as usize;
        self.objs.insert(
            handle,
            Obj::ConnReq(ConnReq {
                nic,
                id,
                from,
                service,
                peer_tag: tag_prefix_of(private),
            }),
        );
        self.eq_push(
            eq,
            Ok(EqEvent {
                event: abi::FI_CONNREQ,
                fid: key,
                connreq: Some((nic, handle)),
                data: private.get(TAG_PREFIX..).unwrap_or_default().to_vec(),
                listen,
                written: false,
            }),
        );
        true
    }

    /// The connected endpoint of NIC `nic` whose connection is `id`.
    fn msg_ep_of(&self, nic: usize, id: ConnId) -> Option<(usize, Option<usize>)> {
        self.objs.iter().find_map(|(&k, o)| match o {
            Obj::Ep(e) if e.nic == nic => e
                .msg
                .as_ref()
                .filter(|m| m.id == Some(id))
                .map(|m| (k, m.eq)),
            _ => None,
        })
    }

    /// What a CM event means to a connected endpoint: its event queue's entry.
    pub(super) fn msg_cm_event(&mut self, nic: usize, id: ConnId, what: MsgCm) {
        let Some((ep, eq)) = self.msg_ep_of(nic, id) else {
            return;
        };
        // The active side: the acceptor's reply, its tagged channel's address first.
        let what = match what {
            MsgCm::Up(data) => {
                let Ok(e) = self.ep_mut(ep) else { return };
                let active = e.msg.as_ref().is_some_and(|m| !m.accepted);
                if active && data.len() >= TAG_PREFIX {
                    if let Some(m) = e.msg.as_mut() {
                        m.peer_tag = tag_prefix_of(&data);
                    }
                    MsgCm::Up(data[TAG_PREFIX..].to_vec())
                } else {
                    MsgCm::Up(data)
                }
            }
            w => w,
        };
        let ev = match what {
            MsgCm::Up(data) => Ok(EqEvent {
                event: abi::FI_CONNECTED,
                fid: ep,
                connreq: None,
                data,
                listen: None,
                written: false,
            }),
            MsgCm::Refused => Err(EqErr {
                fid: ep,
                err: abi::FI_ECONNREFUSED,
            }),
            MsgCm::TimedOut => Err(EqErr {
                fid: ep,
                err: abi::FI_ETIMEDOUT,
            }),
            MsgCm::Down => Ok(EqEvent {
                event: abi::FI_SHUTDOWN,
                fid: ep,
                connreq: None,
                data: Vec::new(),
                listen: None,
                written: false,
            }),
        };
        self.eq_push(eq, ev);
    }

    /// The next event of event queue `eq`, left there, or `-FI_EAVAIL` when an error entry
    /// waits, `-FI_EAGAIN` when nothing does (the caller progresses first).
    pub fn eq_next(&self, eq: usize) -> Result<&EqEvent, Errno> {
        let Some(Obj::Eq(q)) = self.objs.get(&eq) else {
            return Err(EINVAL);
        };
        if !q.errs.is_empty() {
            return Err(abi::FI_EAVAIL);
        }
        q.events.front().ok_or(EAGAIN)
    }

    /// Removes the next event of event queue `eq` (read with [`State::eq_next`]).
    pub fn eq_pop(&mut self, eq: usize) {
        if let Some(Obj::Eq(q)) = self.objs.get_mut(&eq) {
            q.events.pop_front();
        }
        self.wait_sync(eq);
    }

    /// The next error entry of event queue `eq`.
    pub fn eq_take_err(&mut self, eq: usize) -> Result<EqErr, Errno> {
        let Some(Obj::Eq(q)) = self.objs.get_mut(&eq) else {
            return Err(EINVAL);
        };
        let e = q.errs.pop_front().ok_or(EAGAIN);
        self.wait_sync(eq);
        e
    }
}

/// What became of a connected endpoint's connection.
pub(super) enum MsgCm {
    Up(Vec<u8>),
    Refused,
    TimedOut,
    Down,
}
