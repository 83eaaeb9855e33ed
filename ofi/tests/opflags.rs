//! Default operation flags under selective completion (fi_endpoint(3)): an endpoint whose
//! CQ is bound with `FI_SELECTIVE_COMPLETION` reports a call without a flags argument
//! (`fi_tsend`, `fi_trecv`, `fi_send`, ...) when the info it was opened with has
//! `FI_COMPLETION` in `tx_attr`/`rx_attr->op_flags` (as Open MPI's ofi MTL asks), and not
//! otherwise; a `*msg` call reports only with `FI_COMPLETION` in its own flags;
//! `fi_control` `FI_GETOPSFLAG`/`FI_SETOPSFLAG` read and replace those defaults. On the
//! in-process fabric; one test (the provider's state is process-wide).

mod common;

use common::fi::{ctx, insert, one, pages, pair, quiet, side, side_bound, tsend, Side};
use ringbell_fi::abi;
use std::ffi::c_void;
use std::ptr::null_mut;

const COMPLETION: u64 = abi::FI_COMPLETION as u64;

unsafe fn trecv(s: &Side, buf: &mut [u8], tag: u64, c: usize) {
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe {
        ((*(*s.ep).tagged).recv.unwrap())(
            s.ep,
            buf.as_mut_ptr() as *mut c_void,
            buf.len(),
            null_mut(),
            s.peer,
            tag,
            0,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "trecv");
}

unsafe fn tsendmsg(s: &Side, buf: &[u8], tag: u64, c: usize, flags: u64) {
    let iov = abi::iovec {
        iov_base: buf.as_ptr() as *mut c_void,
        iov_len: buf.len(),
    };
    let mut desc: *mut c_void = null_mut();
    let msg = abi::fi_msg_tagged {
        msg_iov: &iov,
        desc: &mut desc,
        iov_count: 1,
        addr: s.peer,
        tag,
        ignore: 0,
        context: ctx(c),
        data: 0,
    };
    // SAFETY: a live endpoint; the message and `buf` outlive the call (the data is sent
    // from leaked test memory).
    let r = unsafe { ((*(*s.ep).tagged).sendmsg.unwrap())(s.ep, &msg, flags) };
    assert_eq!(r, 0, "tsendmsg");
}

/// An endpoint on the NIC of `info`, opened with `op_flags` as the default operation flags
/// of both directions and its CQ bound with FI_SELECTIVE_COMPLETION.
unsafe fn selective_side(
    fabric: *mut abi::fid_fabric,
    info: *mut abi::fi_info,
    op_flags: u64,
) -> Side {
    // SAFETY: `info` is an info of the provider's list, with its attributes.
    unsafe {
        let (t, r) = ((*(*info).tx_attr).op_flags, (*(*info).rx_attr).op_flags);
        (*(*info).tx_attr).op_flags = op_flags;
        (*(*info).rx_attr).op_flags = op_flags;
        let s = side_bound(fabric, info, abi::FI_SELECTIVE_COMPLETION);
        (*(*info).tx_attr).op_flags = t;
        (*(*info).rx_attr).op_flags = r;
        s
    }
}

#[test]
fn default_op_flags_decide_selective_completions() {
    common::fi::in_process(5);
    // SAFETY: one test in this process; the objects live until the process ends.
    unsafe {
        let p = pair(abi::FI_TAGGED as u64);
        let (i0, i1) = (p.list, (*p.list).next);
        let buf = pages(4096);
        let got = pages(4096);
        buf[..5].copy_from_slice(b"hello");

        // Open MPI's setup: op_flags FI_COMPLETION, CQ bound selectively.
        let mut c = selective_side(p.fabric, i0, COMPLETION);
        let mut d = side(p.fabric, i1);
        c.peer = insert(c.av, &d.name);
        d.peer = insert(d.av, &c.name);
        trecv(&d, &mut got[..16], 5, 1);
        tsend(&c, &buf[..5], 5, 2);
        let e = one(c.cq);
        assert_eq!(e.op_context, ctx(2), "fi_tsend reports by default");
        let e = one(d.cq);
        assert_eq!((e.op_context, e.len, e.tag), (ctx(1), 5, 5));
        assert_eq!(&got[..5], b"hello");

        // A tsendmsg with flags 0 reports nothing; with FI_COMPLETION it does.
        trecv(&d, &mut got[..16], 6, 3);
        tsendmsg(&c, &buf[..5], 6, 4, 0);
        let e = one(d.cq);
        assert_eq!(e.op_context, ctx(3));
        quiet(c.cq);
        trecv(&d, &mut got[..16], 7, 5);
        tsendmsg(&c, &buf[..5], 7, 6, COMPLETION);
        assert_eq!(one(c.cq).op_context, ctx(6));
        assert_eq!(one(d.cq).op_context, ctx(5));

        // fi_trecv on the selective endpoint reports by default too.
        trecv(&c, &mut got[..16], 8, 7);
        tsend(&d, &buf[..5], 8, 8);
        assert_eq!(one(d.cq).op_context, ctx(8));
        assert_eq!(one(c.cq).op_context, ctx(7));

        // op_flags 0 and a selective CQ: calls without flags report nothing.
        let mut s = selective_side(p.fabric, i0, 0);
        let mut t = side(p.fabric, i1);
        s.peer = insert(s.av, &t.name);
        t.peer = insert(t.av, &s.name);
        trecv(&t, &mut got[..16], 9, 9);
        tsend(&s, &buf[..5], 9, 10);
        assert_eq!(one(t.cq).op_context, ctx(9));
        quiet(s.cq);
        trecv(&s, &mut got[..16], 10, 11);
        tsend(&t, &buf[..5], 10, 12);
        assert_eq!(one(t.cq).op_context, ctx(12));
        quiet(s.cq);

        // fi_control FI_GETOPSFLAG / FI_SETOPSFLAG: read and replace one side's defaults.
        let tx = abi::FI_TRANSMIT as u64;
        let rx = abi::FI_RECV as u64;
        assert_eq!(opsflag(&c, abi::FI_GETOPSFLAG, tx), Ok(COMPLETION));
        assert_eq!(opsflag(&s, abi::FI_GETOPSFLAG, rx), Ok(0));
        assert_eq!(
            opsflag(&s, abi::FI_SETOPSFLAG, tx | COMPLETION),
            Ok(tx | COMPLETION)
        );
        assert_eq!(opsflag(&s, abi::FI_GETOPSFLAG, tx), Ok(COMPLETION));
        assert_eq!(opsflag(&s, abi::FI_GETOPSFLAG, rx), Ok(0), "one side only");
        let einval = Err(-(abi::FI_EINVAL as i32));
        assert_eq!(opsflag(&s, abi::FI_GETOPSFLAG, tx | rx), einval);
        assert_eq!(opsflag(&s, abi::FI_SETOPSFLAG, COMPLETION), einval);
        // Now s's fi_tsend reports.
        trecv(&t, &mut got[..16], 11, 13);
        tsend(&s, &buf[..5], 11, 14);
        assert_eq!(one(t.cq).op_context, ctx(13));
        assert_eq!(one(s.cq).op_context, ctx(14));
        quiet(s.cq);
    }
}

/// `fi_control(ep, cmd, &flags)` with `flags` in; the word after the call, or the error.
unsafe fn opsflag(s: &Side, cmd: u32, flags: u64) -> Result<u64, i32> {
    let mut f = flags;
    // SAFETY: a live endpoint and a flags word.
    let r = unsafe {
        ((*(*s.ep).fid.ops).control.unwrap())(
            &mut (*s.ep).fid,
            cmd as i32,
            &mut f as *mut u64 as *mut c_void,
        )
    };
    if r == 0 {
        Ok(f)
    } else {
        Err(r)
    }
}
