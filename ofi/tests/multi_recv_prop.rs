//! Multi-receive buffers against a reference model (fi_msg(3), README): random sequences
//! of receives posted at B (single buffers and `FI_MULTI_RECV` buffers, each with its own
//! `FI_OPT_MIN_MULTI_RECV`), then messages of random lengths sent from A, one connection,
//! so they arrive in order. The model matches each message to the oldest receive still
//! posted: a single receive takes it whole or truncated; a multi-receive buffer places it
//! right after the previous one, truncated to what is left, and is released (the
//! completion carries `FI_MULTI_RECV`) by a truncation or when fewer than its minimum
//! (at least 1) bytes are left. Every completion at B is checked against the model's, in
//! order (entries and error entries each in order: they are two queues): context, flags,
//! length, where the bytes landed, the bytes themselves, `olen` and `FI_ETRUNC` for
//! truncations. Half the messages are sized to land one byte either side of the
//! boundaries (the minimum, a buffer's end). Each case ends with messages that use up every receive
//! still posted, so the next case starts with none. On the in-process fabric; one test
//! (the provider's state is process-wide).

mod common;

use common::fi::{ctx, in_process, one, one_err, pages, pair, quiet, read, Side, EAGAIN, EAVAIL};
use proptest::prelude::*;
use ringbell_fi::abi;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr::null_mut;

const RECV: u64 = abi::FI_RECV as u64 | abi::FI_MSG as u64;
const MULTI: u64 = abi::FI_MULTI_RECV as u64;

#[derive(Clone, Debug)]
enum Post {
    Single(usize),
    /// Length and minimum.
    Multi(usize, usize),
}

fn post() -> impl Strategy<Value = Post> {
    prop_oneof![
        (1usize..600).prop_map(Post::Single),
        (1usize..3000, 0usize..400).prop_map(|(l, m)| Post::Multi(l, m)),
    ]
}

/// A receive the model holds: context, offset of its buffer in B's memory, length, bytes
/// used, minimum (None: a single receive).
struct Posted {
    ctx: usize,
    off: usize,
    len: usize,
    used: usize,
    min: Option<usize>,
}

/// What B's CQ should report for one message.
#[derive(Debug, PartialEq, Eq)]
struct Want {
    ctx: usize,
    flags: u64,
    /// Bytes placed, and where (offset in B's memory).
    len: usize,
    at: usize,
    cut: usize,
}

/// Matches a message of `m` bytes; None when no receive is posted.
fn deliver(q: &mut VecDeque<Posted>, m: usize) -> Option<Want> {
    let p = q.front_mut()?;
    let left = p.len - p.used;
    let take = m.min(left);
    let cut = m - take;
    let at = p.off + p.used;
    p.used += take;
    let (flags, done) = match p.min {
        None => (RECV, true),
        Some(min) => {
            let released = cut > 0 || p.len - p.used < min.max(1);
            (if released { RECV | MULTI } else { RECV }, released)
        }
    };
    let w = Want {
        ctx: p.ctx,
        flags,
        len: take,
        at,
        cut,
    };
    if done {
        q.pop_front();
    }
    Some(w)
}

unsafe fn set_min(s: &Side, min: usize) {
    // SAFETY: a live endpoint; a size_t of ours.
    let r = unsafe {
        ((*(*s.ep).ops).setopt.unwrap())(
            &mut (*s.ep).fid,
            abi::FI_OPT_ENDPOINT as i32,
            abi::FI_OPT_MIN_MULTI_RECV as i32,
            &min as *const usize as *const c_void,
            std::mem::size_of::<usize>(),
        )
    };
    assert_eq!(r, 0, "setopt");
}

unsafe fn recv(s: &Side, buf: &mut [u8], c: usize, flags: u64) {
    let iov = abi::iovec {
        iov_base: buf.as_mut_ptr() as *mut c_void,
        iov_len: buf.len(),
    };
    let mut desc: *mut c_void = null_mut();
    let msg = abi::fi_msg {
        msg_iov: &iov,
        desc: &mut desc,
        iov_count: 1,
        addr: u64::MAX, // FI_ADDR_UNSPEC
        context: ctx(c),
        data: 0,
    };
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe { ((*(*s.ep).msg).recvmsg.unwrap())(s.ep, &msg, flags) };
    assert_eq!(r, 0, "recvmsg");
}

unsafe fn send(s: &Side, buf: &[u8], c: usize) {
    // SAFETY: a live endpoint; `buf` is leaked test memory.
    let r = unsafe {
        ((*(*s.ep).msg).send.unwrap())(
            s.ep,
            buf.as_ptr() as *const c_void,
            buf.len(),
            null_mut(),
            s.peer,
            ctx(c),
        )
    };
    assert_eq!(r, 0, "send");
}

fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|k| (i * 37 + k * 11 + 1) as u8).collect()
}

#[test]
fn multi_receive_buffers_match_the_model() {
    in_process(11);
    // SAFETY: once in this test process.
    let p = unsafe { pair(abi::FI_MSG as u64 | MULTI) };
    let abuf = RefCell::new(pages(1 << 20));
    let bbuf = RefCell::new(pages(1 << 20));
    let next_ctx = Cell::new(1usize);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let cases = (
        proptest::collection::vec(post(), 1..6),
        proptest::collection::vec((any::<bool>(), 0usize..900), 0..16),
    );
    runner
        .run(&cases, |(posts, msgs)| {
            let mut abuf = abuf.borrow_mut();
            let mut bbuf = bbuf.borrow_mut();
            let mut q = VecDeque::new();
            let mut off = 0usize;
            // Post everything first (later receives wait behind a multi-receive buffer).
            for po in &posts {
                let c = next_ctx.get();
                next_ctx.set(c + 1);
                let (len, min) = match *po {
                    Post::Single(l) => (l, None),
                    Post::Multi(l, m) => (l, Some(m)),
                };
                bbuf[off..off + len + 64].fill(0);
                // SAFETY: live endpoints; leaked buffers.
                unsafe {
                    if let Some(m) = min {
                        set_min(&p.b, m);
                    }
                    recv(
                        &p.b,
                        &mut bbuf[off..off + len],
                        c,
                        if min.is_some() { MULTI } else { 0 },
                    );
                }
                q.push_back(Posted {
                    ctx: c,
                    off,
                    len,
                    used: 0,
                    min,
                });
                off += len + 64;
            }
            // The case's messages while receives last, then ones that use up the rest.
            let mut lens: Vec<usize> = Vec::new();
            let mut model = Vec::new();
            for &(edge, x) in &msgs {
                // Half the messages are sized against the receive they meet: one byte
                // either side of leaving exactly its minimum (or a single receive's size).
                let m = match q.front() {
                    Some(f) if edge => {
                        let room = f.len - f.used;
                        (room - f.min.unwrap_or(0).min(room) + x % 3).saturating_sub(1)
                    }
                    _ => x,
                };
                match deliver(&mut q, m) {
                    Some(w) => {
                        lens.push(m);
                        model.push(w);
                    }
                    None => break,
                }
            }
            while let Some(front) = q.front() {
                let m = front.len - front.used;
                lens.push(m);
                model.push(deliver(&mut q, m).unwrap());
            }
            let mut aoff = 0usize;
            let mut sent = Vec::new();
            for (i, &m) in lens.iter().enumerate() {
                let data = pattern(next_ctx.get() + i, m);
                abuf[aoff..aoff + m].copy_from_slice(&data);
                // SAFETY: a live endpoint; leaked memory.
                unsafe { send(&p.a, &abuf[aoff..aoff + m], 0x10_0000 + i) };
                sent.push(data);
                aoff += m;
            }
            // Entries and error entries are two queues (fi_cq(3)): each in the model's order.
            let (mut oks, mut errs) = (VecDeque::new(), VecDeque::new());
            let mut spins = 0u64;
            while oks.len() + errs.len() < model.len() {
                // SAFETY: a live CQ of format TAGGED.
                match unsafe { read(p.b.cq) } {
                    Ok(e) => {
                        oks.push_back((e.op_context as usize, e.flags, e.len, e.buf as usize, 0))
                    }
                    Err(EAVAIL) => {
                        // SAFETY: as above.
                        let e = unsafe { one_err(p.b.cq) };
                        prop_assert_eq!(e.err, abi::FI_ETRUNC as i32);
                        errs.push_back((
                            e.op_context as usize,
                            e.flags,
                            e.len,
                            e.buf as usize,
                            e.olen,
                        ));
                    }
                    Err(EAGAIN) => {
                        spins += 1;
                        prop_assert!(spins < 5_000_000, "completions missing");
                    }
                    Err(r) => prop_assert!(false, "cq read: {}", r),
                }
            }
            for (i, w) in model.iter().enumerate() {
                let got = if w.cut > 0 {
                    errs.pop_front()
                } else {
                    oks.pop_front()
                };
                let want = (w.ctx, w.flags, w.len, bbuf.as_ptr() as usize + w.at, w.cut);
                prop_assert_eq!(got, Some(want), "message {}", i);
                prop_assert_eq!(&bbuf[w.at..w.at + w.len], &sent[i][..w.len]);
            }
            for i in 0..lens.len() {
                // SAFETY: as above.
                let e = unsafe { one(p.a.cq) };
                prop_assert_eq!(e.op_context as usize, 0x10_0000 + i);
            }
            // SAFETY: as above.
            unsafe { quiet(p.b.cq) };
            next_ctx.set(next_ctx.get() + lens.len());
            Ok(())
        })
        .unwrap();
}
