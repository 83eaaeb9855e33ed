//! `fi_trecvmsg` with `FI_PEEK`, `FI_CLAIM` and `FI_DISCARD`, and `fi_cancel` of tagged
//! receives (what Open MPI's MPI_Probe, MPI_Mprobe/MPI_Mrecv and MPI_Cancel use), between
//! two endpoints of one process on the in-process fabric: eager and rendezvous messages,
//! the error entries `FI_ENOMSG` and `FI_ECANCELED`, and the calls the provider refuses.
//! One test: the provider's state is process-wide and reads the environment.

mod common;

use common::fi::{ctx, one, one_err, pages, pair, quiet, read, Side, EAGAIN, EAVAIL};
use ringbell_fi::abi;
use std::ffi::c_void;
use std::ptr::null_mut;

const PEEK: u64 = abi::FI_PEEK as u64;
const CLAIM: u64 = abi::FI_CLAIM;
const DISCARD: u64 = abi::FI_DISCARD;
const COMPLETION: u64 = abi::FI_COMPLETION as u64;
const TRECV: u64 = abi::FI_TAGGED as u64 | abi::FI_RECV as u64;

/// `fi_trecvmsg` of `buf` (may be empty) for `tag` from any source.
unsafe fn trecvmsg(s: &Side, buf: &mut [u8], tag: u64, c: usize, flags: u64) -> isize {
    let iov = abi::iovec {
        iov_base: buf.as_mut_ptr() as *mut c_void,
        iov_len: buf.len(),
    };
    let mut desc: *mut c_void = null_mut();
    let msg = abi::fi_msg_tagged {
        msg_iov: &iov,
        desc: &mut desc,
        iov_count: usize::from(!buf.is_empty()),
        addr: u64::MAX,
        tag,
        ignore: 0,
        context: ctx(c),
        data: 0,
    };
    // SAFETY: a live endpoint; the message lives for the call and `buf` is leaked test
    // memory.
    unsafe { ((*(*s.ep).tagged).recvmsg.unwrap())(s.ep, &msg, flags) }
}

unsafe fn tsenddata(s: &Side, buf: &[u8], tag: u64, data: u64, c: usize) {
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe {
        ((*(*s.ep).tagged).senddata.unwrap())(
            s.ep,
            buf.as_ptr() as *const c_void,
            buf.len(),
            null_mut(),
            data,
            s.peer,
            tag,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "tsenddata");
}

unsafe fn trecv(s: &Side, buf: &mut [u8], tag: u64, c: usize) {
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe {
        ((*(*s.ep).tagged).recv.unwrap())(
            s.ep,
            buf.as_mut_ptr() as *mut c_void,
            buf.len(),
            null_mut(),
            u64::MAX,
            tag,
            0,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "trecv");
}

unsafe fn cancel(s: &Side, c: usize) -> isize {
    // SAFETY: a live endpoint.
    unsafe { ((*(*s.ep).ops).cancel.unwrap())(&mut (*s.ep).fid, ctx(c)) }
}

/// Peeks (with `flags` added) until the message is there; the peek's completion.
unsafe fn peek_until(s: &Side, tag: u64, c: usize, flags: u64) -> abi::fi_cq_tagged_entry {
    for _ in 0..100_000 {
        // SAFETY: per the caller.
        unsafe {
            assert_eq!(trecvmsg(s, &mut [], tag, c, PEEK | COMPLETION | flags), 0);
            loop {
                match read(s.cq) {
                    Ok(e) => return e,
                    Err(EAGAIN) => {}
                    Err(EAVAIL) => {
                        let mut e = abi::fi_cq_err_entry::default();
                        let r = ((*(*s.cq).ops).readerr.unwrap())(s.cq, &mut e, 0);
                        assert_eq!(r, 1);
                        assert_eq!(e.err, abi::FI_ENOMSG as i32, "peek error");
                        assert_eq!(e.op_context, ctx(c));
                        break;
                    }
                    Err(r) => panic!("cq read: {r}"),
                }
            }
        }
    }
    panic!("the message never arrived");
}

fn fill(b: &mut [u8], seed: u8) {
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
}

#[test]
fn peek_claim_discard_and_cancel() {
    common::fi::in_process(17);
    // SAFETY: one test in this process; the objects live until the process ends.
    unsafe {
        let p = pair(abi::FI_TAGGED as u64);
        let (a, b) = (&p.a, &p.b);
        let small = pages(4096);
        let big = pages(8192);
        let got = pages(8192);
        fill(&mut small[..100], 1);
        fill(&mut big[..5000], 2);

        // Nothing sent yet: FI_ENOMSG.
        assert_eq!(trecvmsg(a, &mut [], 5, 1, PEEK | COMPLETION), 0);
        let e = one_err(a.cq);
        assert_eq!((e.err, e.op_context), (abi::FI_ENOMSG as i32, ctx(1)));

        // An eager message with CQ data: a peek reports its length, tag, data and flags and
        // leaves it for a receive.
        tsenddata(b, &small[..100], 5, 77, 2);
        let e = peek_until(a, 5, 3, 0);
        assert_eq!((e.op_context, e.len, e.tag, e.data), (ctx(3), 100, 5, 77));
        assert_eq!(e.flags, TRECV | abi::FI_REMOTE_CQ_DATA as u64);
        assert!(e.buf.is_null());
        let e = peek_until(a, 5, 4, 0);
        assert_eq!(e.len, 100, "a peek leaves the message");
        trecv(a, &mut got[..200], 5, 5);
        let e = one(a.cq);
        assert_eq!((e.op_context, e.len, e.data), (ctx(5), 100, 77));
        assert_eq!(&got[..100], &small[..100]);
        assert_eq!(one(b.cq).op_context, ctx(2));

        // A rendezvous message claimed by a peek: a plain receive no longer takes it, the
        // FI_CLAIM receive with the peek's context does.
        tsenddata(b, &big[..5000], 6, 9, 6);
        let e = peek_until(a, 6, 7, CLAIM);
        assert_eq!((e.op_context, e.len, e.tag, e.data), (ctx(7), 5000, 6, 9));
        trecv(a, &mut got[..8192], 6, 8);
        quiet(a.cq);
        got.fill(0);
        assert_eq!(trecvmsg(a, &mut got[..8192], 6, 7, CLAIM | COMPLETION), 0);
        let e = one(a.cq);
        assert_eq!((e.op_context, e.len, e.tag), (ctx(7), 5000, 6));
        assert_eq!(&got[..5000], &big[..5000]);
        assert_eq!(one(b.cq).op_context, ctx(6), "the send completes");
        // The plain receive is still waiting: cancelled, it completes as FI_ECANCELED.
        assert_eq!(cancel(a, 8), 0);
        let e = one_err(a.cq);
        assert_eq!((e.err, e.op_context), (abi::FI_ECANCELED as i32, ctx(8)));
        assert_eq!(e.flags, TRECV);
        // Cancelling it again, or an unknown context, is accepted and does nothing.
        assert_eq!(cancel(a, 8), 0);
        assert_eq!(cancel(a, 999), 0);
        quiet(a.cq);

        // FI_PEEK|FI_DISCARD drops a rendezvous message (its send completes).
        tsenddata(b, &big[..5000], 7, 0, 9);
        let e = peek_until(a, 7, 10, DISCARD);
        assert_eq!(
            (e.op_context, e.len, e.tag),
            (ctx(10), 5000, 7),
            "the peek reports it"
        );
        assert_eq!(one(b.cq).op_context, ctx(9));
        assert_eq!(trecvmsg(a, &mut [], 7, 11, PEEK | COMPLETION), 0);
        assert_eq!(one_err(a.cq).err, abi::FI_ENOMSG as i32, "discarded");

        // FI_PEEK|FI_CLAIM, then FI_CLAIM|FI_DISCARD.
        tsenddata(b, &small[..10], 8, 0, 12);
        assert_eq!(peek_until(a, 8, 13, CLAIM).len, 10);
        assert_eq!(trecvmsg(a, &mut [], 8, 13, CLAIM | DISCARD | COMPLETION), 0);
        let e = one(a.cq);
        assert_eq!((e.op_context, e.len), (ctx(13), 0));
        assert_eq!(one(b.cq).op_context, ctx(12));

        // A claimed message given back by fi_cancel of its peek context is received.
        tsenddata(b, &small[..10], 9, 0, 14);
        assert_eq!(peek_until(a, 9, 15, CLAIM).len, 10);
        assert_eq!(cancel(a, 15), 0);
        trecv(a, &mut got[..64], 9, 16);
        assert_eq!(one(a.cq).op_context, ctx(16));
        assert_eq!(one(b.cq).op_context, ctx(14));

        // Refused: FI_CLAIM with no claimed message, FI_DISCARD alone, a bad endpoint.
        let einval = -(abi::FI_EINVAL as isize);
        assert_eq!(trecvmsg(a, &mut got[..64], 1, 77, CLAIM), einval);
        assert_eq!(trecvmsg(a, &mut [], 1, 78, DISCARD), einval);
        // Not an object of the provider (it refuses it before reading it).
        let mut not_a_fid = abi::fid::default();
        let bad = ((*(*a.ep).ops).cancel.unwrap())(&mut not_a_fid, ctx(1));
        assert_eq!(bad, einval);
        quiet(a.cq);
        quiet(b.cq);
    }
}
