//! RMA on the in-process fabric: an endpoint on rb0 writes into and reads from memory that
//! an endpoint on rb1 registered (virtual addresses, the MR's provider key), with every byte
//! checked, remote CQ data, injects, iovecs and messages, selective completion, bad keys
//! and bad objects. One test: the provider's state is process-wide and reads the environment.

mod common;

use common::fi::{ctx, insert, one, one_err, pages, pair, quiet, side_bound};
use ringbell_fi::{abi, info};
use std::ffi::c_void;
use std::ptr::{null, null_mut};

const WRITE: u64 = abi::FI_RMA as u64 | abi::FI_WRITE as u64;
const READ: u64 = abi::FI_RMA as u64 | abi::FI_READ as u64;

/// Registers `buf` in `dom` for remote access; the region and its key.
unsafe fn reg(dom: *mut abi::fid_domain, buf: &mut [u8]) -> (*mut abi::fid_mr, u64) {
    let mut mr = null_mut();
    let acc = (abi::FI_REMOTE_READ | abi::FI_REMOTE_WRITE | abi::FI_READ | abi::FI_WRITE) as u64;
    // SAFETY: a live domain; `buf` is mapped for the test's life.
    let r = unsafe {
        ((*(*dom).mr).reg.unwrap())(
            &mut (*dom).fid,
            buf.as_mut_ptr() as *const c_void,
            buf.len(),
            acc,
            0,
            0,
            0,
            &mut mr,
            null_mut(),
        )
    };
    assert_eq!(r, 0);
    // SAFETY: the region just made (fi_mr_key reads this field).
    (mr, unsafe { (*mr).key })
}

#[test]
fn rma_writes_and_reads_remote_memory() {
    common::fi::in_process(11);
    // SAFETY: pointers to live locals, mapped test buffers and objects the provider made.
    unsafe {
        let p = pair(info::FI_MSG | info::FI_RMA);
        let (a, b) = (&p.a, &p.b);
        let local = pages(1 << 17);
        let remote = pages(1 << 17);
        let (_rmr, key) = reg(b.dom, remote);
        let raddr = remote.as_ptr() as u64;
        let rma = &*(*a.ep).rma;
        // fi_write of several sizes, then fi_read back into a zeroed buffer.
        for (round, len) in [1usize, 8, 100, 4096, 70000].into_iter().enumerate() {
            for (i, x) in local[..len].iter_mut().enumerate() {
                *x = (i * 7 + round * 3 + 1) as u8;
            }
            let off = 8 * round as u64;
            let r = (rma.write.unwrap())(
                a.ep,
                local.as_ptr() as *const c_void,
                len,
                null_mut(),
                a.peer,
                raddr + off,
                key,
                ctx(10 + round),
            );
            assert_eq!(r, 0);
            let c = one(a.cq);
            assert_eq!((c.op_context, c.flags), (ctx(10 + round), WRITE));
            let o = off as usize;
            assert_eq!(remote[o..o + len], local[..len], "{len} bytes written");
            let back = pages(len);
            let r = (rma.read.unwrap())(
                a.ep,
                back.as_mut_ptr() as *mut c_void,
                len,
                null_mut(),
                a.peer,
                raddr + off,
                key,
                ctx(20 + round),
            );
            assert_eq!(r, 0);
            let c = one(a.cq);
            assert_eq!((c.op_context, c.flags), (ctx(20 + round), READ));
            assert_eq!(back[..], local[..len], "{len} bytes read back");
        }
        quiet(b.cq);
        // Iovecs: two local pieces written to one remote range, read back into two pieces.
        local[..16].copy_from_slice(b"0123456789abcdef");
        let iov = [
            abi::iovec {
                iov_base: local.as_mut_ptr() as *mut c_void,
                iov_len: 10,
            },
            abi::iovec {
                iov_base: local[10..].as_mut_ptr() as *mut c_void,
                iov_len: 6,
            },
        ];
        assert_eq!(
            (rma.writev.unwrap())(
                a.ep,
                iov.as_ptr(),
                null_mut(),
                2,
                a.peer,
                raddr + 1000,
                key,
                ctx(30)
            ),
            0
        );
        assert_eq!(one(a.cq).op_context, ctx(30));
        assert_eq!(&remote[1000..1016], b"0123456789abcdef");
        let mut r1 = [0u8; 4];
        let mut r2 = [0u8; 12];
        let riov = [
            abi::iovec {
                iov_base: r1.as_mut_ptr() as *mut c_void,
                iov_len: 4,
            },
            abi::iovec {
                iov_base: r2.as_mut_ptr() as *mut c_void,
                iov_len: 12,
            },
        ];
        assert_eq!(
            (rma.readv.unwrap())(
                a.ep,
                riov.as_ptr(),
                null_mut(),
                2,
                a.peer,
                raddr + 1000,
                key,
                ctx(31)
            ),
            0
        );
        assert_eq!(one(a.cq).flags, READ);
        assert_eq!((&r1, &r2), (b"0123", b"456789abcdef"));
        // fi_writemsg and fi_readmsg with one remote segment.
        let word = *b"messaged";
        let wiov = abi::iovec {
            iov_base: word.as_ptr() as *mut c_void,
            iov_len: 8,
        };
        let seg = abi::fi_rma_iov {
            addr: raddr + 2000,
            len: 8,
            key,
        };
        let msg = abi::fi_msg_rma {
            msg_iov: &wiov,
            desc: null_mut(),
            iov_count: 1,
            addr: a.peer,
            rma_iov: &seg,
            rma_iov_count: 1,
            context: ctx(32),
            data: 0,
        };
        assert_eq!(
            (rma.writemsg.unwrap())(a.ep, &msg, abi::FI_COMPLETION as u64),
            0
        );
        assert_eq!(one(a.cq).op_context, ctx(32));
        assert_eq!(&remote[2000..2008], b"messaged");
        let mut got = [0u8; 8];
        let giov = abi::iovec {
            iov_base: got.as_mut_ptr() as *mut c_void,
            iov_len: 8,
        };
        let rmsg = abi::fi_msg_rma {
            msg_iov: &giov,
            context: ctx(33),
            ..msg
        };
        assert_eq!((rma.readmsg.unwrap())(a.ep, &rmsg, 0), 0);
        assert_eq!(one(a.cq).op_context, ctx(33));
        assert_eq!(&got, b"messaged");
        // A remote segment shorter than the local data, or two segments: refused.
        let short = abi::fi_rma_iov { len: 4, ..seg };
        let bad = abi::fi_msg_rma {
            rma_iov: &short,
            ..msg
        };
        assert_eq!(
            (rma.writemsg.unwrap())(a.ep, &bad, 0),
            -(abi::FI_EINVAL as isize)
        );
        let two = abi::fi_msg_rma {
            rma_iov_count: 2,
            ..msg
        };
        assert_eq!(
            (rma.writemsg.unwrap())(a.ep, &two, 0),
            -(abi::FI_EINVAL as isize)
        );
        // fi_inject_write: no completion, the data is there once a later write completes.
        let inj = *b"injected!";
        assert_eq!(
            (rma.inject.unwrap())(
                a.ep,
                inj.as_ptr() as *const c_void,
                9,
                a.peer,
                raddr + 3000,
                key
            ),
            0
        );
        // fi_writedata: the target's posted receive completes with the data.
        let bm = &*(*b.ep).msg;
        let mut rx = [0u8; 16];
        assert_eq!(
            (bm.recv.unwrap())(
                b.ep,
                rx.as_mut_ptr() as *mut c_void,
                16,
                null_mut(),
                u64::MAX,
                ctx(40)
            ),
            0
        );
        let data = *b"remote";
        assert_eq!(
            (rma.writedata.unwrap())(
                a.ep,
                data.as_ptr() as *const c_void,
                6,
                null_mut(),
                0xabcd,
                a.peer,
                raddr + 3100,
                key,
                ctx(41)
            ),
            0
        );
        let c = one(a.cq);
        assert_eq!((c.op_context, c.flags), (ctx(41), WRITE));
        let t = one(b.cq);
        assert_eq!(t.op_context, ctx(40));
        assert_eq!(t.data, 0xabcd);
        assert_eq!(
            t.flags,
            (abi::FI_RMA | abi::FI_REMOTE_WRITE | abi::FI_REMOTE_CQ_DATA) as u64
        );
        assert_eq!(&remote[3000..3009], b"injected!");
        assert_eq!(&remote[3100..3106], b"remote");
        // fi_inject_writedata: no local completion, the remote one as above.
        assert_eq!(
            (bm.recv.unwrap())(
                b.ep,
                rx.as_mut_ptr() as *mut c_void,
                16,
                null_mut(),
                u64::MAX,
                ctx(42)
            ),
            0
        );
        assert_eq!(
            (rma.injectdata.unwrap())(
                a.ep,
                data.as_ptr() as *const c_void,
                3,
                7,
                a.peer,
                raddr + 3200,
                key
            ),
            0
        );
        let t = one(b.cq);
        assert_eq!((t.op_context, t.data), (ctx(42), 7));
        assert_eq!(&remote[3200..3203], b"rem");
        quiet(a.cq);
        // A third endpoint, on rb0, binds its CQ with FI_SELECTIVE_COMPLETION: only a
        // writemsg/readmsg with FI_COMPLETION reports.
        let c = side_bound(p.fabric, p.list, abi::FI_SELECTIVE_COMPLETION);
        let cpeer = insert(c.av, &b.name);
        let crma = &*(*c.ep).rma;
        local[..4].copy_from_slice(b"quit");
        assert_eq!(
            (crma.write.unwrap())(
                c.ep,
                local.as_ptr() as *const c_void,
                4,
                null_mut(),
                cpeer,
                raddr + 5000,
                key,
                ctx(45)
            ),
            0
        );
        let smsg = abi::fi_msg_rma {
            msg_iov: &wiov,
            addr: cpeer,
            context: ctx(46),
            ..msg
        };
        assert_eq!((crma.writemsg.unwrap())(c.ep, &smsg, 0), 0);
        let rmsg2 = abi::fi_msg_rma {
            addr: cpeer,
            context: ctx(47),
            ..rmsg
        };
        got.fill(0);
        assert_eq!(
            (crma.readmsg.unwrap())(c.ep, &rmsg2, abi::FI_COMPLETION as u64),
            0
        );
        let r = one(c.cq);
        assert_eq!(
            (r.op_context, r.flags),
            (ctx(47), READ),
            "only the one asked for"
        );
        assert_eq!(&remote[5000..5004], b"quit");
        assert_eq!(&got, b"messaged");
        quiet(c.cq);
        // Bad objects and a peer not in the AV.
        let bogus = local.as_mut_ptr() as *mut abi::fid_ep;
        assert_eq!(
            (rma.write.unwrap())(
                bogus,
                local.as_ptr() as *const c_void,
                8,
                null_mut(),
                0,
                raddr,
                key,
                null_mut()
            ),
            -(abi::FI_EINVAL as isize)
        );
        assert_eq!(
            (rma.read.unwrap())(
                a.ep,
                local.as_mut_ptr() as *mut c_void,
                8,
                local.as_mut_ptr() as *mut c_void,
                a.peer,
                raddr,
                key,
                null_mut()
            ),
            -(abi::FI_EINVAL as isize),
            "a descriptor that is no region"
        );
        assert_eq!(
            (rma.readmsg.unwrap())(a.ep, null(), 0),
            -(abi::FI_EINVAL as isize)
        );
        assert_eq!(
            (rma.write.unwrap())(
                a.ep,
                local.as_ptr() as *const c_void,
                8,
                null_mut(),
                99,
                raddr,
                key,
                null_mut()
            ),
            -(abi::FI_EINVAL as isize)
        );
        // A key beyond any the provider gives out: an error completion at once.
        assert_eq!(
            (rma.write.unwrap())(
                a.ep,
                local.as_ptr() as *const c_void,
                8,
                null_mut(),
                a.peer,
                raddr,
                1 << 40,
                ctx(50)
            ),
            0
        );
        let e = one_err(a.cq);
        assert_eq!(
            (e.op_context, e.err, e.flags),
            (ctx(50), abi::FI_EACCES as i32, WRITE)
        );
        // A key that is not the target's: the NAK breaks the RC connection (both ends go
        // to the error state), and the next operation connects anew.
        let wrong = key ^ 0x5a5a00;
        assert_eq!(
            (rma.read.unwrap())(
                a.ep,
                local.as_mut_ptr() as *mut c_void,
                8,
                null_mut(),
                a.peer,
                raddr,
                wrong,
                ctx(51)
            ),
            0
        );
        let e = one_err(a.cq);
        assert_eq!(
            (e.op_context, e.err, e.flags),
            (ctx(51), abi::FI_EACCES as i32, READ)
        );
        local[..8].copy_from_slice(b"again!!!");
        assert_eq!(
            (rma.write.unwrap())(
                a.ep,
                local.as_ptr() as *const c_void,
                8,
                null_mut(),
                a.peer,
                raddr + 4000,
                key,
                ctx(52)
            ),
            0
        );
        assert_eq!(one(a.cq).op_context, ctx(52));
        assert_eq!(&remote[4000..4008], b"again!!!");
        // The target's end of the failed connection is replaced too: it sends back.
        let am = &*(*a.ep).msg;
        let got = pages(8);
        let reply = pages(8);
        reply.copy_from_slice(b"replied!");
        assert_eq!(
            (am.recv.unwrap())(
                a.ep,
                got.as_mut_ptr() as *mut c_void,
                8,
                null_mut(),
                u64::MAX,
                ctx(53)
            ),
            0
        );
        assert_eq!(
            (bm.send.unwrap())(
                b.ep,
                reply.as_ptr() as *const c_void,
                8,
                null_mut(),
                b.peer,
                ctx(54)
            ),
            0
        );
        assert_eq!(one(b.cq).op_context, ctx(54));
        assert_eq!(one(a.cq).op_context, ctx(53));
        assert_eq!(&got[..], b"replied!");
        ringbell_fi::free_info(p.list);
    }
}
