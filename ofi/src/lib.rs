//! `libringbell_fi.so`: a libfabric provider for ringbell NICs, loaded by libfabric 1.17
//! from a directory named in `FI_PROVIDER_PATH`.
//!
//! It registers as `ringbell` and answers `fi_getinfo` with one reliable-datagram
//! (`FI_EP_RDM`) offer per NIC of the process's NIC plan ([`ringbell::discover`]:
//! `RINGBELL_SERVE`, else an in-process fabric of `RINGBELL_NICS` NICs), or only NIC `i`
//! when `RINGBELL_NIC=i` is set, or on a served fabric only the NIC this process claimed by
//! lock file ([`claim`]), matched against the caller's hints ([`info`]). Fabrics,
//! domains, (minimal) event queues, completion queues, address vectors, memory registration
//! and endpoints with message and tagged transfers are implemented ([`prov`]: reliable
//! datagrams over RC connections made on demand through the datagram connection manager;
//! tagged messages matched by the NIC's tag-matching SRQ through the driver's tag matcher,
//! which matches in software what the NIC's list does not hold, `prov::tagged`); RMA,
//! atomics, counters and triggered operations too.
//!
//! NICs are served (`RINGBELL_SERVE`: each process opens its own NIC of a
//! `ringbell-emu serve`) or, by default, in-process: the provider then hosts a
//! [`ringbell_emu::Fabric`] of `RINGBELL_NICS` NICs seeded by `RINGBELL_SEED`, made when
//! the first domain opens, as the verbs library does. That fabric runs in lockstep with the
//! process: reading a completion queue steps it (and lets its idle clock run to the
//! connection manager's next timer when nothing else is due), so one process can use rb0
//! and rb1 and exchange messages between them.
//!
//! The C boundary is this file (`fi_getinfo`, `fi_fabric`) and `ffi.rs` (the objects): it
//! checks pointers, converts between libfabric's structures and the safe models of [`info`]
//! and [`prov`], and allocates what libfabric frees (`fi_freeinfo` uses libc `free`) with
//! libc.

pub mod abi;
pub mod claim;
mod ffi;
pub mod info;
pub mod prov;

use info::{Hints, Offer, QueueHints};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// libfabric's error numbers are returned negated.
fn neg(e: u32) -> c_int {
    -(e as c_int)
}

/// The provider structure. libfabric writes its own context into it, so it is a leaked,
/// writable allocation, made once.
fn provider() -> *mut abi::fi_provider {
    static P: OnceLock<usize> = OnceLock::new();
    *P.get_or_init(|| {
        let p = Box::new(abi::fi_provider {
            version: info::PROVIDER_VERSION,
            fi_version: info::API_VERSION,
            context: Default::default(),
            name: c"ringbell".as_ptr(),
            getinfo: Some(getinfo),
            fabric: Some(fabric),
            cleanup: Some(cleanup),
        });
        Box::into_raw(p) as usize
    }) as *mut abi::fi_provider
}

/// The entry point libfabric looks up in every provider library it loads.
#[no_mangle]
pub extern "C" fn fi_prov_ini() -> *mut abi::fi_provider {
    provider()
}

unsafe extern "C" fn cleanup() {}

/// Runs `f`, turning a panic into `-FI_EOTHER` (a panic must not unwind into C).
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(neg(abi::FI_EOTHER))
}

/// A C string as an owned Rust string (`None` for NULL or a non-UTF-8 string).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub(crate) unsafe fn string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL and NUL-terminated, per the caller.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .ok()
        .map(str::to_string)
}

/// Reads a caller's hints into the safe model.
///
/// # Safety
/// `h` is NULL or points to a `struct fi_info` whose non-NULL attribute pointers and strings
/// are valid, as `fi_getinfo(3)` requires of hints.
unsafe fn read_hints(h: *const abi::fi_info) -> Hints {
    // SAFETY: per the caller, `h` is NULL or valid.
    let Some(h) = (unsafe { h.as_ref() }) else {
        return Hints::default();
    };
    let mut out = Hints {
        caps: h.caps,
        mode: Some(h.mode),
        addr_format: h.addr_format,
        handle: h.handle as usize,
        ..Default::default()
    };
    if !h.dest_addr.is_null() && h.dest_addrlen > 0 && h.dest_addrlen <= 4096 {
        // SAFETY: `dest_addr` holds `dest_addrlen` bytes (fi_getinfo(3)); bounded above.
        let b = unsafe { std::slice::from_raw_parts(h.dest_addr as *const u8, h.dest_addrlen) };
        out.dest_addr = Some(b.to_vec());
    }
    if !h.src_addr.is_null() && h.src_addrlen > 0 && h.src_addrlen <= 4096 {
        // SAFETY: `src_addr` holds `src_addrlen` bytes (fi_getinfo(3)); bounded above.
        let b = unsafe { std::slice::from_raw_parts(h.src_addr as *const u8, h.src_addrlen) };
        out.src_addr = Some(b.to_vec());
    }
    // SAFETY: each attribute pointer is NULL or valid, per the caller.
    if let Some(e) = unsafe { h.ep_attr.as_ref() } {
        out.ep_type = e.type_;
        out.protocol = e.protocol;
        out.max_msg_size = e.max_msg_size;
        out.mem_tag_format = e.mem_tag_format;
        out.ctx_cnt = (e.tx_ctx_cnt, e.rx_ctx_cnt);
    }
    // SAFETY: as above.
    if let Some(t) = unsafe { h.tx_attr.as_ref() } {
        out.tx = Some(QueueHints {
            caps: t.caps,
            mode: t.mode,
            op_flags: t.op_flags,
            msg_order: t.msg_order,
            inject_size: t.inject_size,
            size: t.size,
            iov_limit: t.iov_limit,
        });
    }
    // SAFETY: as above.
    if let Some(r) = unsafe { h.rx_attr.as_ref() } {
        out.rx = Some(QueueHints {
            caps: r.caps,
            mode: r.mode,
            op_flags: r.op_flags,
            msg_order: r.msg_order,
            inject_size: 0,
            size: r.size,
            iov_limit: r.iov_limit,
        });
    }
    // SAFETY: as above.
    if let Some(d) = unsafe { h.domain_attr.as_ref() } {
        // SAFETY: `name` is NULL or a string, per the caller.
        out.domain_name = unsafe { string(d.name) };
        out.threading = d.threading;
        out.control_progress = d.control_progress;
        out.data_progress = d.data_progress;
        out.resource_mgmt = d.resource_mgmt;
        out.av_type = d.av_type;
        out.mr_mode = Some(d.mr_mode);
        out.domain_caps = d.caps;
        out.cq_data_size = d.cq_data_size;
    }
    // SAFETY: as above.
    if let Some(f) = unsafe { h.fabric_attr.as_ref() } {
        // SAFETY: the names are NULL or strings, per the caller.
        out.fabric_name = unsafe { string(f.name) };
        // SAFETY: as above.
        out.prov_name = unsafe { string(f.prov_name) };
    }
    out
}

/// A zeroed libc allocation of one `T` (libfabric frees it with `free`).
fn calloc<T>() -> Option<*mut T> {
    // SAFETY: calloc may be called with any sizes; the result is checked for NULL.
    let p = unsafe { libc::calloc(1, std::mem::size_of::<T>()) } as *mut T;
    (!p.is_null()).then_some(p)
}

/// A libc copy of `s` (libfabric frees it with `free`).
fn strdup(s: &str) -> Option<*mut c_char> {
    let c = std::ffi::CString::new(s).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string; the result is checked for NULL.
    let p = unsafe { libc::strdup(c.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Frees a list built by [`write_info`] (on an allocation failure half way), every part
/// with libc `free`, as libfabric's `fi_freeinfo` does with a list a provider returned
/// (the tests free lists from `getinfo` with it).
///
/// # Safety
/// `i` is NULL or a list this library built, not yet handed to libfabric.
pub unsafe fn free_info(mut i: *mut abi::fi_info) {
    while !i.is_null() {
        // SAFETY: built by write_info: every pointer is NULL or a libc allocation.
        unsafe {
            let next = (*i).next;
            if let Some(d) = (*i).domain_attr.as_ref() {
                libc::free(d.name as *mut c_void);
            }
            if let Some(f) = (*i).fabric_attr.as_ref() {
                libc::free(f.name as *mut c_void);
            }
            for p in [
                (*i).tx_attr as *mut c_void,
                (*i).rx_attr as *mut c_void,
                (*i).ep_attr as *mut c_void,
                (*i).domain_attr as *mut c_void,
                (*i).fabric_attr as *mut c_void,
                (*i).dest_addr,
                (*i).src_addr,
                i as *mut c_void,
            ] {
                libc::free(p);
            }
            i = next;
        }
    }
}

/// Builds the `struct fi_info` of `o`, or `None` when memory runs out.
pub(crate) fn write_info(o: &Offer) -> Option<*mut abi::fi_info> {
    let i = calloc::<abi::fi_info>()?;
    let fill = || -> Option<()> {
        let tx = calloc::<abi::fi_tx_attr>()?;
        let rx = calloc::<abi::fi_rx_attr>()?;
        let ep = calloc::<abi::fi_ep_attr>()?;
        let dom = calloc::<abi::fi_domain_attr>()?;
        let fab = calloc::<abi::fi_fabric_attr>()?;
        // SAFETY: every pointer was just allocated, zeroed, with its type's size; they are
        // linked into `i` at once, so `free_info` frees them on a later failure.
        unsafe {
            (*i).tx_attr = tx;
            (*i).rx_attr = rx;
            (*i).ep_attr = ep;
            (*i).domain_attr = dom;
            (*i).fabric_attr = fab;
            (*i).caps = o.caps;
            (*i).mode = o.mode;
            (*i).addr_format = o.addr_format;
            *tx = abi::fi_tx_attr {
                caps: o.caps & info::TX_CAPS,
                mode: o.mode,
                op_flags: o.tx_op_flags,
                msg_order: o.msg_order(),
                comp_order: 0,
                inject_size: o.inject_size,
                size: o.tx_size,
                iov_limit: o.iov_limit,
                rma_iov_limit: 1,
                tclass: 0,
            };
            *rx = abi::fi_rx_attr {
                caps: o.caps & info::RX_CAPS,
                mode: o.mode,
                op_flags: o.rx_op_flags,
                msg_order: o.msg_order(),
                comp_order: 0,
                total_buffered_recv: 0,
                size: o.rx_size,
                iov_limit: o.iov_limit,
            };
            (*ep).type_ = o.ep_type;
            (*ep).protocol = abi::FI_PROTO_UNSPEC;
            (*ep).protocol_version = 1;
            (*ep).max_msg_size = o.max_msg_size;
            (*ep).mem_tag_format = info::MEM_TAG_FORMAT;
            (*ep).tx_ctx_cnt = if o.shared_tx { usize::MAX } else { o.ctx_cnt.0 };
            (*ep).rx_ctx_cnt = if o.shared_rx { usize::MAX } else { o.ctx_cnt.1 };
            (*dom).threading = o.threading;
            (*dom).control_progress = o.progress;
            (*dom).data_progress = o.progress;
            (*dom).resource_mgmt = o.resource_mgmt;
            (*dom).av_type = o.av_type;
            (*dom).mr_mode = o.mr_mode;
            (*dom).mr_key_size = 4;
            (*dom).cq_data_size = o.cq_data_size;
            (*dom).cq_cnt = 4096;
            (*dom).ep_cnt = 4096;
            (*dom).tx_ctx_cnt = 4096;
            (*dom).rx_ctx_cnt = 4096;
            // Scalable endpoints are RDM ones (fi_scalable_ep).
            let ctx = if o.ep_type == abi::fi_ep_type_FI_EP_RDM {
                info::MAX_EP_CTX
            } else {
                1
            };
            (*dom).max_ep_tx_ctx = ctx;
            (*dom).max_ep_rx_ctx = ctx;
            (*dom).cntr_cnt = 4096;
            (*dom).mr_iov_limit = 1;
            (*dom).mr_cnt = 16384;
            (*dom).caps =
                info::FI_LOCAL_COMM | info::FI_REMOTE_COMM | (o.caps & info::FI_SHARED_AV);
            (*dom).name = strdup(&o.domain)?;
            (*fab).name = strdup(info::PROVIDER_NAME)?;
            for (a, at, len) in [
                (&o.dest_addr, &mut (*i).dest_addr, &mut (*i).dest_addrlen),
                (&o.src_addr, &mut (*i).src_addr, &mut (*i).src_addrlen),
            ] {
                if let Some(a) = a {
                    let p = libc::malloc(a.len().max(1)) as *mut u8;
                    if p.is_null() {
                        return None;
                    }
                    std::ptr::copy_nonoverlapping(a.as_ptr(), p, a.len());
                    *at = p as *mut c_void;
                    *len = a.len();
                }
            }
        }
        Some(())
    };
    match fill() {
        Some(()) => Some(i),
        None => {
            // SAFETY: `i` was built here and not handed out.
            unsafe { free_info(i) };
            None
        }
    }
}

/// `fi_getinfo` for this provider: one RDM offer per NIC that matches the hints.
/// The IPv4 address `node` names (dotted, or a host name the resolver knows), if any.
fn node_ip(node: &str) -> Option<[u8; 4]> {
    use std::net::ToSocketAddrs;
    if let Ok(ip) = node.parse::<std::net::Ipv4Addr>() {
        return Some(ip.octets());
    }
    (node, 0u16)
        .to_socket_addrs()
        .ok()?
        .find_map(|a| match a.ip() {
            std::net::IpAddr::V4(ip) => Some(ip.octets()),
            std::net::IpAddr::V6(_) => None,
        })
}

/// The flag libfabric's utility providers add when they ask for core providers to layer on
/// (`OFI_CORE_PROV_ONLY` of libfabric's internal `ofi.h`, the same since 1.x).
const OFI_CORE_PROV_ONLY: u64 = 1 << 59;

unsafe extern "C" fn getinfo(
    version: u32,
    node: *const c_char,
    service: *const c_char,
    flags: u64,
    hints: *const abi::fi_info,
    out: *mut *mut abi::fi_info,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return neg(abi::FI_EINVAL);
        }
        // A node names an IPv4 address (a name that does not resolve matches nothing). With
        // FI_SOURCE it is the local address: a NIC's address selects that NIC; another
        // local address (such as 127.0.0.1, which programs pass for their out-of-band
        // exchange) selects none in particular. Without it, it is the peer's, which the
        // endpoint's address vector names later: any NIC serves.
        // SAFETY: NULL or the application's NUL-terminated node (fi_getinfo(3)).
        let node = unsafe { string(node) };
        let ip = match node.as_deref().map(node_ip) {
            None => None,
            Some(None) => return neg(abi::FI_ENODATA),
            Some(ip) => ip,
        };
        let mut src_ip = ip.filter(|_| flags & abi::FI_SOURCE != 0);
        // A peer's node and service (its endpoint's CM service id, a number) make its
        // address: the offers carry it as their destination.
        // SAFETY: NULL or the application's NUL-terminated service (fi_getinfo(3)).
        let service = unsafe { string(service) }.and_then(|s| s.parse::<u64>().ok());
        // SAFETY: libfabric passes the application's hints, NULL or valid (fi_getinfo(3)).
        let h = unsafe { read_hints(hints) };
        // In a sockaddr format a service number is a port: one larger is no address.
        if prov::Format::of(h.addr_format) == prov::Format::SockaddrIn
            && service.is_some_and(|s| s > prov::MAX_PORT)
        {
            return neg(abi::FI_EINVAL);
        }
        // With FI_SOURCE the number is the program's own endpoint's (below); without, the
        // peer's.
        let (mut src_service, dest) = if flags & abi::FI_SOURCE != 0 {
            (service, None)
        } else {
            (
                None,
                ip.zip(service)
                    .map(|(ip, s)| prov::make_addr(ip, s).to_vec()),
            )
        };
        // A source address in the hints (either format) says the same as a node and
        // service with FI_SOURCE: its IPv4 address selects a NIC unless it is the wildcard
        // (any NIC) or no NIC's, and its number (if not 0) is the endpoint's.
        if let Some((sip, ss)) = h
            .src_addr
            .as_deref()
            .and_then(prov::addr_from_bytes)
            .and_then(|a| prov::parse_addr(&a))
        {
            if src_ip.is_none() && sip != [0; 4] {
                src_ip = Some(sip);
            }
            if src_service.is_none() && ss != 0 {
                if prov::Format::of(h.addr_format) == prov::Format::SockaddrIn
                    && ss > prov::MAX_PORT
                {
                    return neg(abi::FI_EINVAL);
                }
                src_service = Some(ss);
            }
        }
        // A passive endpoint as the hints' handle (fi_getinfo(3)): the offers carry it, and
        // are those of its NIC (an endpoint opened with one takes its address).
        let pep = (h.handle != 0)
            .then(|| prov::state().pep_addr(h.handle).ok())
            .flatten();
        let plan = ringbell::discover::NicPlan::from_env();
        let mut head: *mut abi::fi_info = std::ptr::null_mut();
        let mut tail: *mut *mut abi::fi_info = &mut head;
        let choice = plan.choice();
        for i in 0..plan.nics.len() {
            if !choice.includes(i) || pep.is_some_and(|(nic, _)| nic != i) {
                continue;
            }
            let ip = prov::nic_ip(i);
            if src_ip.is_some_and(|s| s != ip && ringbell::AhAttr::on_fabric(s).is_some()) {
                continue;
            }
            let name = ringbell::discover::NicPlan::name(i);
            // Each NIC's RDM offer, then its datagram and connected ones, which a utility
            // provider asking for a core provider to layer on (libfabric's ofi_rxd and
            // ofi_rxm, RDM over datagrams or connections) does not get: the NIC's own RDM
            // endpoints are what an application asking for RDM must find first, as
            // libfabric itself keeps utility providers off efa.
            let layering = flags & OFI_CORE_PROV_ONLY != 0;
            let offers = [
                Offer::for_nic(&name),
                Offer::dgram_for_nic(&name),
                Offer::msg_for_nic(&name),
            ];
            for mut offer in offers
                .into_iter()
                .filter(|o| !(layering && o.ep_type != abi::fi_ep_type_FI_EP_RDM))
            {
                // The NIC's address, with no endpoint yet (service 0), or with the service
                // number a program gave with FI_SOURCE, which its endpoint then takes.
                offer.src_addr = Some(prov::make_addr(ip, src_service.unwrap_or(0)).to_vec());
                if dest.is_some() && h.dest_addr.is_none() {
                    offer.dest_addr = dest.clone();
                }
                let o = match info::match_offer(version, &h, &offer) {
                    Ok(o) => o,
                    Err(why) => {
                        // Why an application's hints get nothing, for whoever asks.
                        if std::env::var_os("RINGBELL_FI_DEBUG").is_some() {
                            eprintln!(
                                "ringbell-fi: fi_getinfo: {} does not match: {why:?} (hints: caps {:#x}, mode {:x?}, mr_mode {:x?})",
                                offer.domain, h.caps, h.mode, h.mr_mode
                            );
                        }
                        continue;
                    }
                };
                let Some(node) = write_info(&o) else {
                    // SAFETY: the list was built here and not handed out.
                    unsafe { free_info(head) };
                    return neg(abi::FI_ENOMEM);
                };
                if pep.is_some() {
                    // SAFETY: `node` was just built here.
                    unsafe { (*node).handle = h.handle as *mut abi::fid };
                }
                // SAFETY: `tail` points at `head` or at the `next` of the last node built here.
                unsafe {
                    *tail = node;
                    tail = &mut (*node).next;
                }
            }
        }
        if head.is_null() {
            return neg(abi::FI_ENODATA);
        }
        // SAFETY: `out` is non-NULL (checked) and the caller's to write.
        unsafe { *out = head };
        0
    })
}

/// `fi_trywait`: whether the application may block on the descriptors of `fids` (CQs and
/// EQs opened with `FI_WAIT_FD`; see `prov::wait`).
unsafe extern "C" fn trywait(
    fabric: *mut abi::fid_fabric,
    fids: *mut *mut abi::fid,
    count: c_int,
) -> c_int {
    ffi::run(|st| {
        st.check(fabric as usize, prov::Kind::Fabric)?;
        let n = usize::try_from(count).map_err(|_| abi::FI_EINVAL)?;
        if fids.is_null() && n > 0 {
            return Err(abi::FI_EINVAL);
        }
        let keys: Vec<usize> = (0..n)
            // SAFETY: `fids` holds `count` pointers (fi_trywait(3)); each is checked as a
            // live object before anything reads through it.
            .map(|i| unsafe { fids.add(i).read() } as usize)
            .collect();
        st.trywait(&keys).map(|()| 0)
    })
}
unsafe extern "C" fn enosys_domain2(
    _: *mut abi::fid_fabric,
    _: *mut abi::fi_info,
    _: *mut *mut abi::fid_domain,
    _: u64,
    _: *mut c_void,
) -> c_int {
    neg(abi::FI_ENOSYS)
}

/// The fabric operations: domains and (minimal) event queues.
static FABRIC_OPS: abi::fi_ops_fabric = abi::fi_ops_fabric {
    size: std::mem::size_of::<abi::fi_ops_fabric>(),
    domain: Some(ffi::domain_open),
    passive_ep: Some(ffi::passive_ep),
    eq_open: Some(ffi::eq_open),
    wait_open: Some(ffi::wait_open),
    trywait: Some(trywait),
    domain2: Some(enosys_domain2),
};

/// `fi_fabric` for this provider.
unsafe extern "C" fn fabric(
    attr: *mut abi::fi_fabric_attr,
    out: *mut *mut abi::fid_fabric,
    context: *mut c_void,
) -> c_int {
    guard(|| {
        if attr.is_null() || out.is_null() {
            return neg(abi::FI_EINVAL);
        }
        // SAFETY: libfabric passes the attributes of an info this provider returned.
        let name = unsafe { string((*attr).name) };
        if name.as_deref() != Some(info::PROVIDER_NAME) {
            return neg(abi::FI_ENODATA);
        }
        let f = ffi::new_fabric(context, &FABRIC_OPS);
        // SAFETY: `out` is non-NULL (checked) and the caller's to write; the fabric is
        // freed by its close.
        unsafe { *out = f };
        0
    })
}
