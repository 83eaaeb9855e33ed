//! The provider on its in-process fabric (no `RINGBELL_SERVE`): one process opens an
//! endpoint on each of rb0 and rb1 and exchanges messages, with every byte checked and all
//! progress made by reading the completion queues. One test: the provider's state is
//! process-wide and reads the environment.

mod common;

use common::fi::{one, pages, pair, quiet};
use ringbell_fi::{abi, info};
use std::ffi::c_void;
use std::ptr::null_mut;

#[test]
fn two_endpoints_in_one_process_exchange_messages() {
    common::fi::in_process(7);
    // SAFETY: pointers to live locals, mapped test buffers and objects the provider made.
    unsafe {
        let p = pair(info::FI_MSG);
        let (a, b) = (&p.a, &p.b);
        let sbuf = pages(1 << 18);
        let rbuf = pages(1 << 18);
        // Both directions, sizes from empty to 256 KiB, without descriptors (the provider
        // registers), each message's bytes distinct.
        for (round, len) in [0usize, 1, 9, 100, 4096, 5000, 65536, 1 << 18]
            .into_iter()
            .enumerate()
        {
            for (tx, rx) in [(a, b), (b, a)] {
                for (i, x) in sbuf[..len].iter_mut().enumerate() {
                    *x = (i * 13 + round * 7 + 1) as u8;
                }
                rbuf[..len].fill(0);
                let rctx = (0x100 + round) as *mut c_void;
                let sctx = (0x200 + round) as *mut c_void;
                let m = &*(*rx.ep).msg;
                assert_eq!(
                    (m.recv.unwrap())(
                        rx.ep,
                        rbuf.as_mut_ptr() as *mut c_void,
                        rbuf.len(),
                        null_mut(),
                        u64::MAX,
                        rctx
                    ),
                    0
                );
                let m = &*(*tx.ep).msg;
                assert_eq!(
                    (m.send.unwrap())(
                        tx.ep,
                        sbuf.as_ptr() as *const c_void,
                        len,
                        null_mut(),
                        tx.peer,
                        sctx
                    ),
                    0
                );
                let s = one(tx.cq);
                assert_eq!(s.op_context, sctx);
                assert_ne!(s.flags & abi::FI_SEND as u64, 0);
                let r = one(rx.cq);
                assert_eq!((r.op_context, r.len), (rctx, len));
                assert_ne!(r.flags & abi::FI_RECV as u64, 0);
                assert_eq!(rbuf[..len], sbuf[..len], "{len} bytes");
            }
        }
        // Injects and immediate data, a to b.
        let m = &*(*b.ep).msg;
        for _ in 0..2 {
            assert_eq!(
                (m.recv.unwrap())(
                    b.ep,
                    rbuf.as_mut_ptr() as *mut c_void,
                    64,
                    null_mut(),
                    u64::MAX,
                    null_mut()
                ),
                0
            );
        }
        let am = &*(*a.ep).msg;
        let word = *b"injected";
        assert_eq!(
            (am.injectdata.unwrap())(a.ep, word.as_ptr() as *const c_void, 8, 99, a.peer),
            0
        );
        let r = one(b.cq);
        assert_eq!((r.len, r.data), (8, 99));
        assert_ne!(r.flags & abi::FI_REMOTE_CQ_DATA as u64, 0);
        assert_eq!(&rbuf[..8], b"injected");
        assert_eq!(
            (am.inject.unwrap())(a.ep, word.as_ptr() as *const c_void, 3, a.peer),
            0
        );
        let r = one(b.cq);
        assert_eq!(r.len, 3);
        quiet(a.cq);
        ringbell_fi::free_info(p.list);
    }
}
