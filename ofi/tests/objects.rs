//! The provider's objects called directly, as libfabric calls them, over two NICs of a
//! `ringbell-emu serve`: domains, event and completion queues, address vectors, memory
//! registration, endpoints, messages between two endpoints with their data checked, and
//! bad pointers (a fid that is not a live object of the right kind is `-FI_EINVAL`, never
//! a crash). One test: the provider's state is process-wide and reads the environment.

mod common;

use ringbell_fi::{abi, fi_prov_ini, info};
use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

const EINVAL: isize = -(abi::FI_EINVAL as isize);
const EAGAIN: isize = -(abi::FI_EAGAIN as isize);

/// Polls `cq` (format MSG) until one entry comes, or panics.
unsafe fn one(cq: *mut abi::fid_cq) -> abi::fi_cq_msg_entry {
    let mut e = abi::fi_cq_msg_entry::default();
    for _ in 0..2_000_000 {
        // SAFETY: a live CQ and room for one entry.
        let r = unsafe { ((*(*cq).ops).read.unwrap())(cq, &mut e as *mut _ as *mut c_void, 1) };
        if r == 1 {
            return e;
        }
        assert_eq!(r, EAGAIN, "cq read");
    }
    panic!("no completion");
}

/// The provider's `close`, taken from a live object's ops table once: called on a closed
/// object, the provider must refuse it without reading the freed memory (the test must not
/// read it either).
static CLOSE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

unsafe fn close(fid: *mut abi::fid) -> i32 {
    type Close = unsafe extern "C" fn(*mut abi::fid) -> i32;
    // SAFETY: CLOSE holds the provider's close entry point, set before any close.
    unsafe {
        let f: Close = std::mem::transmute::<usize, Close>(*CLOSE.get().expect("set"));
        f(fid)
    }
}

/// `len` bytes on pages of their own (two devices in one process cannot share a page:
/// each adopts the pages it registers).
fn pages(len: usize) -> &'static mut [u8] {
    // SAFETY: an anonymous private mapping, checked; never unmapped (leaked for the test).
    unsafe {
        let p = libc::mmap(
            null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        std::slice::from_raw_parts_mut(p as *mut u8, len)
    }
}

struct Side {
    dom: *mut abi::fid_domain,
    cq: *mut abi::fid_cq,
    av: *mut abi::fid_av,
    ep: *mut abi::fid_ep,
    name: [u8; 16],
}

unsafe fn side(fabric: *mut abi::fid_fabric, info: *mut abi::fi_info) -> Side {
    // SAFETY: live objects of this provider; out-pointers to locals.
    unsafe {
        let mut dom = null_mut();
        assert_eq!(
            ((*(*fabric).ops).domain.unwrap())(fabric, info, &mut dom, null_mut()),
            0
        );
        let mut attr = abi::fi_cq_attr {
            format: abi::fi_cq_format_FI_CQ_FORMAT_MSG,
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
        // Enabling before the binds fails.
        assert!((fops.control.unwrap())(epfid, abi::FI_ENABLE as i32, null_mut()) < 0);
        assert_eq!((fops.bind.unwrap())(epfid, &mut (*av).fid, 0), 0);
        let both = abi::FI_TRANSMIT as u64 | abi::FI_RECV as u64;
        assert_eq!((fops.bind.unwrap())(epfid, &mut (*cq).fid, both), 0);
        // Binding something that is not an object.
        let mut junk = [0u64; 8];
        assert_eq!(
            (fops.bind.unwrap())(epfid, junk.as_mut_ptr() as *mut abi::fid, 0) as isize,
            EINVAL
        );
        assert_eq!(
            (fops.control.unwrap())(epfid, abi::FI_ENABLE as i32, null_mut()),
            0
        );
        // getname: too small says how much is needed.
        let getname = (*(*ep).cm).getname.unwrap();
        let mut len = 4usize;
        let mut name = [0u8; 16];
        assert_eq!(
            getname(epfid, name.as_mut_ptr() as *mut c_void, &mut len),
            -(abi::FI_ETOOSMALL as i32)
        );
        assert_eq!(len, 16);
        assert_eq!(
            getname(epfid, null_mut(), &mut len),
            -(abi::FI_ETOOSMALL as i32)
        );
        assert_eq!(
            getname(epfid, name.as_mut_ptr() as *mut c_void, &mut len),
            0
        );
        Side {
            dom,
            cq,
            av,
            ep,
            name,
        }
    }
}

#[test]
fn objects_messages_and_bad_pointers() {
    let served = common::Served::start("objects");
    std::env::set_var("RINGBELL_SERVE", &served.dir);
    // One process on both served NICs: no claim of one NIC by lock file.
    std::env::set_var("RINGBELL_NIC", "all");
    // SAFETY: the provider structure lives for the process.
    let prov = unsafe { &*fi_prov_ini() };
    let v = info::API_VERSION;
    // SAFETY: every call below passes pointers to live locals, objects the provider made,
    // or deliberately bad pointers that the provider must refuse without reading.
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
            caps: info::FI_MSG,
            ep_attr: &mut ep_attr,
            domain_attr: &mut dom_attr,
            ..Default::default()
        };
        let mut list = null_mut();
        assert_eq!(
            (prov.getinfo.unwrap())(v, null(), null(), 0, &hints, &mut list),
            0
        );
        let i0 = list;
        let i1 = (*list).next;
        assert!(!i1.is_null(), "two NICs offered");
        assert_eq!(
            CStr::from_ptr((*(*i1).domain_attr).name).to_str(),
            Ok("rb1")
        );

        let mut fabric = null_mut();
        assert_eq!(
            (prov.fabric.unwrap())((*i0).fabric_attr, &mut fabric, null_mut()),
            0
        );
        let fops = &*(*fabric).ops;
        CLOSE.get_or_init(|| (*(*fabric).fid.ops).close.unwrap() as usize);
        // A fabric pointer that is not one.
        let mut junk = [0u64; 16];
        let bogus = junk.as_mut_ptr() as *mut c_void;
        assert_eq!(
            (fops.domain.unwrap())(bogus as *mut _, i0, &mut null_mut(), null_mut()) as isize,
            EINVAL
        );
        // The event queue fi_pingpong opens: nothing to read.
        let mut eq = null_mut();
        let mut eq_attr = abi::fi_eq_attr::default();
        assert_eq!(
            (fops.eq_open.unwrap())(fabric, &mut eq_attr, &mut eq, null_mut()),
            0
        );
        let mut ev = 0u32;
        let eops = &*(*eq).ops;
        assert_eq!((eops.read.unwrap())(eq, &mut ev, null_mut(), 0, 0), EAGAIN);
        assert_eq!(close(&mut (*eq).fid), 0);
        assert_eq!(close(&mut (*eq).fid) as isize, EINVAL, "closed twice");
        assert_eq!(
            (eops.read.unwrap())(eq, &mut ev, null_mut(), 0, 0),
            EINVAL,
            "closed"
        );

        let a = side(fabric, i0);
        let b = side(fabric, i1);
        assert_ne!(a.name, b.name);

        // Address vectors: the peer, a bad address; lookup and straddr.
        let av_ops = &*(*a.av).ops;
        let mut peer = 0u64;
        assert_eq!(
            (av_ops.insert.unwrap())(
                a.av,
                b.name.as_ptr() as *const c_void,
                1,
                &mut peer,
                0,
                null_mut()
            ),
            1
        );
        let mut bad = 7u64;
        let zeros = [0u8; 16];
        assert_eq!(
            (av_ops.insert.unwrap())(
                a.av,
                zeros.as_ptr() as *const c_void,
                1,
                &mut bad,
                0,
                null_mut()
            ),
            0
        );
        assert_eq!(bad, u64::MAX, "FI_ADDR_NOTAVAIL");
        let mut back = [0u8; 16];
        let mut len = 16usize;
        assert_eq!(
            (av_ops.lookup.unwrap())(a.av, peer, back.as_mut_ptr() as *mut c_void, &mut len),
            0
        );
        assert_eq!(back, b.name);
        let mut s = [0 as std::ffi::c_char; 64];
        let mut slen = s.len();
        let p = (av_ops.straddr.unwrap())(
            a.av,
            b.name.as_ptr() as *const c_void,
            s.as_mut_ptr(),
            &mut slen,
        );
        assert!(CStr::from_ptr(p)
            .to_str()
            .unwrap()
            .starts_with("ringbell://10.0."));
        let mut a_on_b = 0u64;
        let bav = &*(*b.av).ops;
        assert_eq!(
            (bav.insert.unwrap())(
                b.av,
                a.name.as_ptr() as *const c_void,
                1,
                &mut a_on_b,
                0,
                null_mut()
            ),
            1
        );

        // Memory registration.
        let sbuf = pages(8192);
        let rbuf = pages(8192);
        let mut smr = null_mut();
        let mut rmr = null_mut();
        let areg = (*(*a.dom).mr).reg.unwrap();
        let breg = (*(*b.dom).mr).reg.unwrap();
        assert_eq!(
            areg(
                &mut (*a.dom).fid,
                sbuf.as_ptr() as *const c_void,
                sbuf.len(),
                0,
                0,
                0,
                0,
                &mut smr,
                null_mut()
            ),
            0
        );
        assert_eq!(
            breg(
                &mut (*b.dom).fid,
                rbuf.as_ptr() as *const c_void,
                rbuf.len(),
                0,
                0,
                0,
                0,
                &mut rmr,
                null_mut()
            ),
            0
        );
        assert_eq!(
            areg(
                bogus as *mut _,
                sbuf.as_ptr() as *const c_void,
                1,
                0,
                0,
                0,
                0,
                &mut null_mut(),
                null_mut()
            ) as isize,
            EINVAL
        );

        // Messages: a registered send, an inject, a send without a descriptor.
        let amsg = &*(*a.ep).msg;
        let bmsg = &*(*b.ep).msg;
        for (i, x) in sbuf.iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
        let ctx = 0x1234usize as *mut c_void;
        assert_eq!(
            (bmsg.recv.unwrap())(
                b.ep,
                rbuf.as_mut_ptr() as *mut c_void,
                8192,
                (*rmr).mem_desc,
                u64::MAX,
                ctx
            ),
            0
        );
        assert_eq!(
            (amsg.send.unwrap())(
                a.ep,
                sbuf.as_ptr() as *const c_void,
                5000,
                (*smr).mem_desc,
                peer,
                ctx
            ),
            0
        );
        let tx = one(a.cq);
        assert_eq!(tx.op_context, ctx);
        assert_ne!(tx.flags & abi::FI_SEND as u64, 0);
        let rx = one(b.cq);
        assert_eq!((rx.op_context, rx.len), (ctx, 5000));
        assert_ne!(rx.flags & abi::FI_RECV as u64, 0);
        assert_eq!(rbuf[..5000], sbuf[..5000]);

        // An inject: no completion at the sender.
        assert_eq!(
            (bmsg.recv.unwrap())(
                b.ep,
                rbuf.as_mut_ptr() as *mut c_void,
                8192,
                (*rmr).mem_desc,
                u64::MAX,
                null_mut()
            ),
            0
        );
        let word = *b"injected!";
        assert_eq!(
            (amsg.inject.unwrap())(a.ep, word.as_ptr() as *const c_void, 9, peer),
            0
        );
        let rx = one(b.cq);
        assert_eq!(rx.len, 9);
        assert_eq!(&rbuf[..9], b"injected!");

        // The other direction, with no descriptors (the provider registers) and data.
        let back = pages(4096);
        assert_eq!(
            (amsg.recv.unwrap())(
                a.ep,
                back.as_mut_ptr() as *mut c_void,
                100,
                null_mut(),
                u64::MAX,
                null_mut()
            ),
            0
        );
        let reply = pages(4096);
        reply[..100].fill(0xab);
        assert_eq!(
            (bmsg.senddata.unwrap())(
                b.ep,
                reply.as_ptr() as *const c_void,
                100,
                null_mut(),
                77,
                a_on_b,
                null_mut()
            ),
            0
        );
        let _ = one(b.cq);
        let mut e = abi::fi_cq_msg_entry::default();
        let rx = loop {
            let r = ((*(*a.cq).ops).read.unwrap())(a.cq, &mut e as *mut _ as *mut c_void, 1);
            if r == 1 {
                break e;
            }
        };
        assert_eq!(rx.len, 100);
        assert_ne!(rx.flags & abi::FI_REMOTE_CQ_DATA as u64, 0);
        assert_eq!(back[..100], reply[..100]);

        // Bad pointers everywhere: refused, not dereferenced.
        assert_eq!(
            (amsg.send.unwrap())(
                bogus as *mut _,
                sbuf.as_ptr() as *const c_void,
                1,
                null_mut(),
                peer,
                null_mut()
            ),
            EINVAL
        );
        assert_eq!(
            (amsg.send.unwrap())(
                a.ep,
                sbuf.as_ptr() as *const c_void,
                1,
                bogus,
                peer,
                null_mut()
            ),
            EINVAL,
            "a descriptor that is no memory region"
        );
        assert_eq!(
            (amsg.send.unwrap())(
                a.ep,
                sbuf.as_ptr() as *const c_void,
                1,
                null_mut(),
                99,
                null_mut()
            ),
            EINVAL,
            "no such address"
        );
        assert_eq!(
            ((*(*a.cq).ops).read.unwrap())(bogus as *mut _, null_mut(), 1),
            EINVAL
        );
        assert_eq!(
            ((*(*a.cq).ops).readerr.unwrap())(bogus as *mut _, null_mut(), 0),
            EINVAL
        );
        assert_eq!(
            (av_ops.insert.unwrap())(bogus as *mut _, null(), 1, null_mut(), 0, null_mut())
                as isize,
            EINVAL
        );
        assert_eq!(close(bogus as *mut abi::fid) as isize, EINVAL);
        // RMA on something that is no endpoint (tests/rma.rs has the rest).
        let read = (*(*a.ep).rma).read.unwrap();
        assert_eq!(
            read(
                bogus as *mut _,
                null_mut(),
                0,
                null_mut(),
                peer,
                0,
                0,
                null_mut()
            ),
            EINVAL
        );

        // Close, in fi_pingpong's order; everything once only.
        for f in [
            &mut (*smr).fid as *mut abi::fid,
            &mut (*rmr).fid,
            &mut (*a.ep).fid,
            &mut (*b.ep).fid,
            &mut (*a.cq).fid,
            &mut (*b.cq).fid,
            &mut (*a.av).fid,
            &mut (*b.av).fid,
            &mut (*a.dom).fid,
            &mut (*b.dom).fid,
            &mut (*fabric).fid,
        ] {
            assert_eq!(close(f), 0);
            assert_eq!(close(f) as isize, EINVAL);
        }
        ringbell_fi::free_info(list);
    }
}
