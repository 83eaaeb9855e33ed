//! Tagged rendezvous with buffers that have no descriptor (as Open MPI passes them) goes
//! through the provider's bounce buffers: the data arrives intact (one buffer, and two
//! receive buffers filled in order), and the application's pages are never adopted for DMA
//! (no `ringbell-host` memory file is mapped over them, see `ringbell::hostmem`). On the
//! in-process fabric; one test (the provider's state is process-wide).

mod common;

use common::fi::{ctx, one, pages, pair, quiet, tsend, Side};
use ringbell_fi::abi;
use std::ffi::c_void;
use std::ptr::null_mut;

/// Whether any byte of `b` lies in memory the driver adopted (a `ringbell-host` file).
fn adopted(b: &[u8]) -> bool {
    let (lo, hi) = (b.as_ptr() as usize, b.as_ptr() as usize + b.len());
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("ringbell-host"))
        .any(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (a, z) = range.split_once('-').unwrap();
            let a = usize::from_str_radix(a, 16).unwrap();
            let z = usize::from_str_radix(z, 16).unwrap();
            a < hi && lo < z
        })
}

unsafe fn trecvv(s: &Side, bufs: &mut [&mut [u8]], tag: u64, c: usize) {
    let iov: Vec<abi::iovec> = bufs
        .iter_mut()
        .map(|b| abi::iovec {
            iov_base: b.as_mut_ptr() as *mut c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut desc = vec![null_mut::<c_void>(); iov.len()];
    // SAFETY: a live endpoint; the buffers are leaked test memory.
    let r = unsafe {
        ((*(*s.ep).tagged).recvv.unwrap())(
            s.ep,
            iov.as_ptr(),
            desc.as_mut_ptr(),
            iov.len(),
            u64::MAX,
            tag,
            0,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "trecvv");
}

#[test]
fn rendezvous_without_descriptors_uses_bounce_buffers() {
    common::fi::in_process(19);
    // SAFETY: one test in this process; the objects live until the process ends.
    unsafe {
        let p = pair(abi::FI_TAGGED as u64);
        let (a, b) = (&p.a, &p.b);
        let out = pages(1 << 20);
        let inp = pages(1 << 20);
        for (i, x) in out.iter_mut().enumerate() {
            *x = (i * 7 + (i >> 10)) as u8;
        }

        // 300 KiB into one buffer, received before it is sent.
        let n = 300 * 1024;
        trecvv(a, &mut [&mut inp[..n + 100]], 1, 1);
        tsend(b, &out[..n], 1, 2);
        let e = one(a.cq);
        assert_eq!((e.op_context, e.len), (ctx(1), n));
        assert_eq!(&inp[..n], &out[..n]);
        assert_eq!(one(b.cq).op_context, ctx(2));

        // 5000 bytes sent before the receive, into two buffers (3000 + 4096).
        inp.fill(0);
        tsend(b, &out[1000..6000], 2, 3);
        quiet(a.cq);
        let (x, rest) = inp.split_at_mut(3000);
        trecvv(a, &mut [x, &mut rest[10_000..14_096]], 2, 4);
        let e = one(a.cq);
        assert_eq!((e.op_context, e.len), (ctx(4), 5000));
        assert_eq!(&inp[..3000], &out[1000..4000]);
        assert_eq!(&inp[13_000..15_000], &out[4000..6000]);
        assert_eq!(inp[15_000], 0, "nothing past the message");
        assert_eq!(one(b.cq).op_context, ctx(3));

        // The check sees memory registered in place (fi_mr_reg adopts its pages).
        let extra = pages(4096);
        let mut mr = null_mut();
        let r = ((*(*a.dom).mr).reg.unwrap())(
            &mut (*a.dom).fid,
            extra.as_ptr() as *const c_void,
            4096,
            (abi::FI_SEND | abi::FI_RECV) as u64,
            0,
            0,
            0,
            &mut mr,
            null_mut(),
        );
        assert_eq!(r, 0);
        assert!(adopted(extra), "fi_mr_reg adopts");
        assert!(!adopted(out), "the send buffer was registered in place");
        assert!(!adopted(inp), "the receive buffer was registered in place");
        quiet(a.cq);
        quiet(b.cq);
    }
}
