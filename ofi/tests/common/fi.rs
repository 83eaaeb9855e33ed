//! Calling the provider's objects directly, as libfabric does, for the tests that run on
//! the in-process fabric: one process, two endpoints (one per domain, rb0 and rb1).

use ringbell_fi::{abi, fi_prov_ini, info};
use std::ffi::c_void;
use std::ptr::{null, null_mut};

pub const EAGAIN: isize = -(abi::FI_EAGAIN as isize);
pub const EAVAIL: isize = -(abi::FI_EAVAIL as isize);

/// `len` bytes on pages of their own (two devices in one process cannot share a page:
/// each adopts the pages it registers). Leaked for the test.
pub fn pages(len: usize) -> &'static mut [u8] {
    // SAFETY: an anonymous private mapping, checked; never unmapped.
    unsafe {
        let p = libc::mmap(
            null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        std::slice::from_raw_parts_mut(p as *mut u8, len)
    }
}

/// Sets the environment for the provider's own in-process fabric of two NICs (rb0, rb1)
/// seeded with `seed`: no served fabric, no NIC chosen.
pub fn in_process(seed: u64) {
    std::env::remove_var("RINGBELL_SERVE");
    std::env::remove_var("RINGBELL_NIC");
    std::env::set_var("RINGBELL_NICS", "2");
    std::env::set_var("RINGBELL_SEED", seed.to_string());
}

/// One endpoint with its domain, CQ (format TAGGED, both directions) and AV.
pub struct Side {
    pub dom: *mut abi::fid_domain,
    pub cq: *mut abi::fid_cq,
    pub av: *mut abi::fid_av,
    pub ep: *mut abi::fid_ep,
    pub name: [u8; 16],
    /// The peer, in this side's AV.
    pub peer: u64,
}

/// The provider's fabric and two connected-by-address sides on NICs rb0 and rb1.
pub struct Pair {
    pub fabric: *mut abi::fid_fabric,
    pub list: *mut abi::fi_info,
    pub a: Side,
    pub b: Side,
}

/// Opens everything with `caps` in the hints (FI_MSG, FI_TAGGED, ...).
///
/// # Safety
/// The provider's state is process-wide: call once per test process, with the environment
/// set up.
pub unsafe fn pair(caps: u64) -> Pair {
    // SAFETY: the provider structure lives for the process.
    let prov = unsafe { &*fi_prov_ini() };
    // SAFETY: pointers to live locals and to objects the provider made.
    unsafe {
        let mut ep_attr = abi::fi_ep_attr {
            type_: abi::fi_ep_type_FI_EP_RDM,
            ..Default::default()
        };
        let mut dom_attr = abi::fi_domain_attr {
            mr_mode: (abi::FI_MR_LOCAL
                | abi::FI_MR_ALLOCATED
                | abi::FI_MR_PROV_KEY
                | abi::FI_MR_VIRT_ADDR) as i32,
            ..Default::default()
        };
        let hints = abi::fi_info {
            caps,
            ep_attr: &mut ep_attr,
            domain_attr: &mut dom_attr,
            ..Default::default()
        };
        let mut list = null_mut();
        assert_eq!(
            (prov.getinfo.unwrap())(info::API_VERSION, null(), null(), 0, &hints, &mut list),
            0
        );
        let i0 = list;
        let i1 = (*list).next;
        assert!(!i1.is_null(), "two NICs offered");
        let mut fabric = null_mut();
        assert_eq!(
            (prov.fabric.unwrap())((*i0).fabric_attr, &mut fabric, null_mut()),
            0
        );
        let mut a = side(fabric, i0);
        let mut b = side(fabric, i1);
        a.peer = insert(a.av, &b.name);
        b.peer = insert(b.av, &a.name);
        Pair { fabric, list, a, b }
    }
}

pub unsafe fn insert(av: *mut abi::fid_av, name: &[u8; 16]) -> u64 {
    let mut out = 0u64;
    // SAFETY: a live AV, one address, one output.
    let r = unsafe {
        ((*(*av).ops).insert.unwrap())(
            av,
            name.as_ptr() as *const c_void,
            1,
            &mut out,
            0,
            null_mut(),
        )
    };
    assert_eq!(r, 1);
    out
}

pub unsafe fn side(fabric: *mut abi::fid_fabric, info: *mut abi::fi_info) -> Side {
    // SAFETY: per the caller.
    unsafe { side_bound(fabric, info, 0) }
}

/// As [`side`], the CQ bound with `flags` added to `FI_TRANSMIT | FI_RECV` (such as
/// `FI_SELECTIVE_COMPLETION`).
///
/// # Safety
/// As [`side`].
pub unsafe fn side_bound(
    fabric: *mut abi::fid_fabric,
    info: *mut abi::fi_info,
    flags: u64,
) -> Side {
    // SAFETY: live objects of this provider; out-pointers to locals.
    unsafe {
        let mut dom = null_mut();
        assert_eq!(
            ((*(*fabric).ops).domain.unwrap())(fabric, info, &mut dom, null_mut()),
            0
        );
        let mut attr = abi::fi_cq_attr {
            format: abi::fi_cq_format_FI_CQ_FORMAT_TAGGED,
            wait_obj: abi::fi_wait_obj_FI_WAIT_NONE,
            size: 64,
            ..Default::default()
        };
        let dops = &*(*dom).ops;
        let mut cq = null_mut();
        assert_eq!(
            (dops.cq_open.unwrap())(dom, &mut attr, &mut cq, null_mut()),
            0
        );
        let mut avattr = abi::fi_av_attr {
            type_: abi::fi_av_type_FI_AV_TABLE,
            ..Default::default()
        };
        let mut av = null_mut();
        assert_eq!(
            (dops.av_open.unwrap())(dom, &mut avattr, &mut av, null_mut()),
            0
        );
        let mut ep = null_mut();
        assert_eq!((dops.endpoint.unwrap())(dom, info, &mut ep, null_mut()), 0);
        let fops = &*(*ep).fid.ops;
        let epfid = &mut (*ep).fid as *mut abi::fid;
        assert_eq!((fops.bind.unwrap())(epfid, &mut (*av).fid, 0), 0);
        let both = abi::FI_TRANSMIT as u64 | abi::FI_RECV as u64 | flags;
        assert_eq!((fops.bind.unwrap())(epfid, &mut (*cq).fid, both), 0);
        assert_eq!(
            (fops.control.unwrap())(epfid, abi::FI_ENABLE as i32, null_mut()),
            0
        );
        let mut len = 16usize;
        let mut name = [0u8; 16];
        assert_eq!(
            ((*(*ep).cm).getname.unwrap())(epfid, name.as_mut_ptr() as *mut c_void, &mut len),
            0
        );
        Side {
            dom,
            cq,
            av,
            ep,
            name,
            peer: 0,
        }
    }
}

/// One read of `cq` (format TAGGED): an entry, or the error number.
///
/// # Safety
/// `cq` is a live CQ of format TAGGED.
pub unsafe fn read(cq: *mut abi::fid_cq) -> Result<abi::fi_cq_tagged_entry, isize> {
    let mut e = abi::fi_cq_tagged_entry::default();
    // SAFETY: a live CQ and room for one entry.
    let r = unsafe { ((*(*cq).ops).read.unwrap())(cq, &mut e as *mut _ as *mut c_void, 1) };
    if r == 1 {
        Ok(e)
    } else {
        Err(r)
    }
}

/// Reads `cq` until an entry comes (progress is only through the CQs), or panics; an
/// error entry is a panic too.
///
/// # Safety
/// `cq` is a live CQ of format TAGGED.
pub unsafe fn one(cq: *mut abi::fid_cq) -> abi::fi_cq_tagged_entry {
    for _ in 0..5_000_000 {
        // SAFETY: per the caller.
        match unsafe { read(cq) } {
            Ok(e) => return e,
            Err(EAGAIN) => {}
            Err(r) => panic!("cq read: {r}"),
        }
    }
    panic!("no completion");
}

/// Reads `cq` until an error entry is available, and returns it.
///
/// # Safety
/// `cq` is a live CQ of format TAGGED.
pub unsafe fn one_err(cq: *mut abi::fid_cq) -> abi::fi_cq_err_entry {
    for _ in 0..5_000_000 {
        // SAFETY: per the caller.
        match unsafe { read(cq) } {
            Ok(e) => panic!("an entry where an error was expected: {e:?}"),
            Err(EAGAIN) => {}
            Err(EAVAIL) => {
                let mut e = abi::fi_cq_err_entry::default();
                // SAFETY: a live CQ; `e` is the caller's entry.
                let r = unsafe { ((*(*cq).ops).readerr.unwrap())(cq, &mut e, 0) };
                assert_eq!(r, 1);
                return e;
            }
            Err(r) => panic!("cq read: {r}"),
        }
    }
    panic!("no error completion");
}

/// Nothing more in `cq` after a few reads (each progresses the fabric).
///
/// # Safety
/// `cq` is a live CQ of format TAGGED.
pub unsafe fn quiet(cq: *mut abi::fid_cq) {
    for _ in 0..2000 {
        // SAFETY: per the caller.
        if let Ok(e) = unsafe { read(cq) } {
            panic!("an unexpected completion: {e:?}");
        }
    }
}

/// An operation context the tests recognize in completions.
pub fn ctx(n: usize) -> *mut c_void {
    n as *mut c_void
}

/// `fi_tsend` of `buf` with `tag` to the side's peer, context `ctx(c)`; asserts it was taken.
///
/// # Safety
/// `s` is a live side; `buf` stays mapped until the send completes.
pub unsafe fn tsend(s: &Side, buf: &[u8], tag: u64, c: usize) {
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe {
        ((*(*s.ep).tagged).send.unwrap())(
            s.ep,
            buf.as_ptr() as *const c_void,
            buf.len(),
            null_mut(),
            s.peer,
            tag,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "tsend");
}
