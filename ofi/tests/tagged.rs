//! Tagged messages between two endpoints of one process on the in-process fabric (rb0 and
//! rb1), all progress made by reading the completion queues: tags matched out of order,
//! ignore masks, messages that arrive before their receive (unexpected), truncation
//! (`FI_ETRUNC` with the lost length), remote CQ data, injects, several buffers, and
//! FI_DIRECTED_RECV source filtering with a third endpoint. One test: the provider's state
//! is process-wide and reads the environment.

mod common;

use common::fi::{ctx, insert, one, one_err, pages, pair, quiet, side, tsend, Side};
use ringbell_fi::{abi, info};
use std::ffi::c_void;
use std::ptr::null_mut;

const TRECV: u64 = abi::FI_TAGGED as u64 | abi::FI_RECV as u64;
const TSEND: u64 = abi::FI_TAGGED as u64 | abi::FI_SEND as u64;

unsafe fn trecv(s: &Side, buf: &mut [u8], src: u64, tag: u64, ignore: u64, c: usize) {
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe {
        ((*(*s.ep).tagged).recv.unwrap())(
            s.ep,
            buf.as_mut_ptr() as *mut c_void,
            buf.len(),
            null_mut(),
            src,
            tag,
            ignore,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "trecv");
}

fn fill(b: &mut [u8], seed: u8) {
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
}

#[test]
fn tagged_messages_in_one_process() {
    common::fi::in_process(3);
    // SAFETY: pointers to live locals, leaked test buffers and objects the provider made.
    unsafe {
        let p = pair(info::FI_TAGGED | info::FI_MSG | info::FI_DIRECTED_RECV);
        let (a, b) = (&p.a, &p.b);
        let s1 = pages(1 << 17);
        let s2 = pages(1 << 17);
        let r1 = pages(1 << 17);
        let r2 = pages(1 << 17);

        // One message, both directions, with the entries' fields.
        for (tx, rx, len) in [(a, b, 5000usize), (b, a, 1 << 17), (a, b, 0)] {
            fill(&mut s1[..len], 1);
            r1.fill(0);
            trecv(rx, r1, u64::MAX, 5, 0, 11);
            tsend(tx, &s1[..len], 5, 12);
            let r = one(rx.cq);
            assert_eq!((r.op_context, r.len, r.tag), (ctx(11), len, 5));
            assert_eq!(r.flags, TRECV);
            assert_eq!(r.buf, r1.as_mut_ptr() as *mut c_void);
            assert_eq!(r1[..len], s1[..len]);
            let s = one(tx.cq);
            assert_eq!((s.op_context, s.flags), (ctx(12), TSEND));
        }

        // Out of order: receives for tags 1 and 2; the message tagged 2 is sent first.
        fill(&mut s1[..3000], 2);
        fill(&mut s2[..2000], 3);
        r1.fill(0);
        r2.fill(0);
        trecv(b, &mut r1[..4096], u64::MAX, 1, 0, 21);
        trecv(b, &mut r2[..4096], u64::MAX, 2, 0, 22);
        tsend(a, &s2[..2000], 2, 23);
        tsend(a, &s1[..3000], 1, 24);
        let mut got = [one(b.cq), one(b.cq)];
        got.sort_by_key(|e| e.op_context as usize);
        assert_eq!(
            (got[0].op_context, got[0].tag, got[0].len),
            (ctx(21), 1, 3000)
        );
        assert_eq!(
            (got[1].op_context, got[1].tag, got[1].len),
            (ctx(22), 2, 2000)
        );
        assert_eq!(r1[..3000], s1[..3000]);
        assert_eq!(r2[..2000], s2[..2000]);
        let mut sent = [one(a.cq).op_context as usize, one(a.cq).op_context as usize];
        sent.sort();
        assert_eq!(sent, [23, 24]);

        // Ignore masks: 0x12ab matches 0x1200 ignoring the low byte; 0x13ab does not, and
        // waits until a receive for it comes. Above the eager size, its send is not
        // complete until a receive has read it.
        fill(&mut s1[..1000], 4);
        fill(&mut s2[..1000], 5);
        trecv(b, &mut r1[..1000], u64::MAX, 0x1200, 0xff, 31);
        tsend(a, &s2[..1000], 0x13ab, 32);
        tsend(a, &s1[..1000], 0x12ab, 33);
        let r = one(b.cq);
        assert_eq!((r.op_context, r.tag, r.len), (ctx(31), 0x12ab, 1000));
        assert_eq!(r1[..1000], s1[..1000]);
        assert_eq!(one(a.cq).op_context, ctx(33));
        quiet(b.cq);
        quiet(a.cq);
        trecv(b, &mut r2[..1000], u64::MAX, 0x13ab, 0, 34);
        let r = one(b.cq);
        assert_eq!((r.op_context, r.tag), (ctx(34), 0x13ab));
        assert_eq!(r2[..1000], s2[..1000]);
        assert_eq!(one(a.cq).op_context, ctx(32));

        // Unexpected: three messages before any receive, then receives in another order;
        // the two with the same tag are matched in the order they were sent. The small one
        // goes eagerly (its send completes at once), the others wait for their receives.
        fill(&mut s1[..700], 6);
        fill(&mut s2[..1100], 7);
        tsend(a, &s1[..700], 40, 41);
        tsend(a, &s2[..900], 40, 42);
        tsend(a, &s2[1000..1050], 50, 43);
        assert_eq!(one(a.cq).op_context, ctx(43));
        quiet(b.cq);
        quiet(a.cq);
        trecv(b, &mut r1[..50], u64::MAX, 50, 0, 44);
        let r = one(b.cq);
        assert_eq!((r.op_context, r.tag, r.len), (ctx(44), 50, 50));
        assert_eq!(r1[..50], s2[1000..1050]);
        trecv(b, &mut r1[..4096], u64::MAX, 40, 0, 45);
        trecv(b, &mut r2[..4096], u64::MAX, 40, 0, 46);
        let mut got = [one(b.cq), one(b.cq)];
        got.sort_by_key(|e| e.op_context as usize);
        assert_eq!((got[0].op_context, got[0].len), (ctx(45), 700));
        assert_eq!((got[1].op_context, got[1].len), (ctx(46), 900));
        assert_eq!(r1[..700], s1[..700]);
        assert_eq!(r2[..900], s2[..900]);
        let mut sent: Vec<usize> = (0..2).map(|_| one(a.cq).op_context as usize).collect();
        sent.sort();
        assert_eq!(sent, [41, 42]);

        // Eager messages unexpected in a row, then matched in order, one truncated.
        fill(&mut s1[..150], 13);
        for (i, len) in [150usize, 20, 1].into_iter().enumerate() {
            tsend(a, &s1[i..i + len], 45, 47 + i);
        }
        let mut sent: Vec<usize> = (0..3).map(|_| one(a.cq).op_context as usize).collect();
        sent.sort();
        assert_eq!(sent, [47, 48, 49]);
        r1.fill(0);
        trecv(b, &mut r1[..100], u64::MAX, 45, 0, 55);
        let e = one_err(b.cq);
        assert_eq!(e.err, abi::FI_ETRUNC as i32);
        assert_eq!((e.op_context, e.len, e.olen, e.tag), (ctx(55), 100, 50, 45));
        assert_eq!(r1[..100], s1[..100]);
        assert_eq!(r1[100], 0);
        trecv(b, &mut r2[..100], u64::MAX, 45, 0, 56);
        let r = one(b.cq);
        assert_eq!((r.op_context, r.len), (ctx(56), 20));
        assert_eq!(r2[..20], s1[1..21]);
        trecv(b, &mut r2[200..300], u64::MAX, 45, 0, 57);
        let r = one(b.cq);
        assert_eq!((r.op_context, r.len), (ctx(57), 1));
        assert_eq!(r2[200], s1[2]);

        // Truncation (rendezvous): 3000 bytes into 100: an error entry with the 2900 bytes
        // lost; the first 100 arrive and the send completes.
        fill(&mut s1[..3000], 8);
        r1.fill(0);
        trecv(b, &mut r1[..100], u64::MAX, 7, 0, 51);
        tsend(a, &s1[..3000], 7, 52);
        let e = one_err(b.cq);
        assert_eq!(e.err, abi::FI_ETRUNC as i32);
        assert_eq!(
            (e.op_context, e.len, e.olen, e.tag),
            (ctx(51), 100, 2900, 7)
        );
        assert_eq!(e.flags & TRECV, TRECV);
        assert_eq!(r1[..100], s1[..100]);
        assert_eq!(r1[100], 0);
        assert_eq!(one(a.cq).op_context, ctx(52));

        // Remote CQ data and injects (no completion at the sender).
        let t = &*(*a.ep).tagged;
        trecv(b, &mut r1[..64], u64::MAX, 60, 0, 61);
        trecv(b, &mut r2[..64], u64::MAX, 60, 0, 62);
        trecv(b, &mut r2[64..128], u64::MAX, 70, 0, 63);
        let word = *b"tagged!";
        assert_eq!(
            (t.senddata.unwrap())(
                a.ep,
                word.as_ptr() as *const c_void,
                7,
                null_mut(),
                0xbeef,
                a.peer,
                60,
                ctx(64)
            ),
            0
        );
        assert_eq!(
            (t.injectdata.unwrap())(a.ep, word.as_ptr() as *const c_void, 6, 77, a.peer, 60),
            0
        );
        assert_eq!(
            (t.inject.unwrap())(a.ep, word.as_ptr() as *const c_void, 3, a.peer, 70),
            0
        );
        let r = one(b.cq);
        assert_eq!((r.op_context, r.len, r.data), (ctx(61), 7, 0xbeef));
        assert_eq!(r.flags, TRECV | abi::FI_REMOTE_CQ_DATA as u64);
        assert_eq!(&r1[..7], b"tagged!");
        let r = one(b.cq);
        assert_eq!((r.op_context, r.len, r.data), (ctx(62), 6, 77));
        let r = one(b.cq);
        assert_eq!((r.op_context, r.len, r.flags), (ctx(63), 3, TRECV));
        assert_eq!(&r2[64..67], b"tag");
        assert_eq!(one(a.cq).op_context, ctx(64));
        quiet(a.cq);

        // Several buffers on both sides.
        fill(&mut s1[..1000], 9);
        fill(&mut s2[..500], 10);
        r1.fill(0);
        r2.fill(0);
        let siov = [
            abi::iovec {
                iov_base: s1.as_mut_ptr() as *mut c_void,
                iov_len: 1000,
            },
            abi::iovec {
                iov_base: s2.as_mut_ptr() as *mut c_void,
                iov_len: 500,
            },
        ];
        let riov = [
            abi::iovec {
                iov_base: r1.as_mut_ptr() as *mut c_void,
                iov_len: 600,
            },
            abi::iovec {
                iov_base: r2.as_mut_ptr() as *mut c_void,
                iov_len: 4096,
            },
        ];
        let bt = &*(*b.ep).tagged;
        assert_eq!(
            (bt.recvv.unwrap())(b.ep, riov.as_ptr(), null_mut(), 2, u64::MAX, 80, 0, ctx(81)),
            0
        );
        assert_eq!(
            (t.sendv.unwrap())(a.ep, siov.as_ptr(), null_mut(), 2, a.peer, 80, ctx(82)),
            0
        );
        let r = one(b.cq);
        assert_eq!((r.op_context, r.len), (ctx(81), 1500));
        let mut whole = s1[..1000].to_vec();
        whole.extend_from_slice(&s2[..500]);
        assert_eq!(r1[..600], whole[..600]);
        assert_eq!(r2[..900], whole[600..]);
        assert_eq!(one(a.cq).op_context, ctx(82));

        // FI_DIRECTED_RECV: a third endpoint c (on rb0) and a both send tag 9; b's receive
        // for a's address takes a's message even though c's came first; readfrom names the
        // source.
        let mut c = side(p.fabric, p.list);
        c.peer = insert(c.av, &b.name);
        let c_on_b = insert(b.av, &c.name);
        fill(&mut s1[..64], 11);
        fill(&mut s2[..64], 12);
        tsend(&c, &s2[..64], 9, 91);
        quiet(b.cq);
        trecv(b, &mut r1[..64], b.peer, 9, 0, 92);
        quiet(b.cq);
        tsend(a, &s1[..64], 9, 93);
        let mut e = abi::fi_cq_tagged_entry::default();
        let mut from = 0u64;
        let readfrom = (*(*b.cq).ops).readfrom.unwrap();
        let mut n = 0;
        while readfrom(b.cq, &mut e as *mut _ as *mut c_void, 1, &mut from) != 1 {
            n += 1;
            assert!(n < 5_000_000, "no completion");
        }
        assert_eq!((e.op_context, from), (ctx(92), b.peer));
        assert_eq!(r1[..64], s1[..64]);
        trecv(b, &mut r2[..64], u64::MAX, 9, 0, 94);
        while readfrom(b.cq, &mut e as *mut _ as *mut c_void, 1, &mut from) != 1 {}
        assert_eq!((e.op_context, from), (ctx(94), c_on_b));
        assert_eq!(r2[..64], s2[..64]);
        assert_eq!(one(a.cq).op_context, ctx(93));
        assert_eq!(one(c.cq).op_context, ctx(91));
        ringbell_fi::free_info(p.list);
    }
}
