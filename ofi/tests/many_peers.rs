//! One endpoint that receives tagged messages from more peers than one CQ group of its tag
//! matcher serves (64): 100 endpoints of their own domains on rb1 each send to one endpoint
//! on rb0, eager and rendezvous, and each message lands whole in the receive for its tag.
//! One test: the provider's state is process-wide and reads the environment.

mod common;

use common::fi::{ctx, insert, pages, pair, read, side, EAGAIN};
use ringbell_fi::{abi, info};
use std::ffi::c_void;
use std::ptr::null_mut;

const PEERS: usize = 100;

#[test]
fn an_endpoint_takes_tagged_messages_from_a_hundred_peers() {
    common::fi::in_process(5);
    // SAFETY: pointers to live locals, leaked test buffers and objects the provider made.
    unsafe {
        let p = pair(info::FI_TAGGED | info::FI_MSG);
        let rx = &p.a;
        let i1 = (*p.list).next;
        let len = |k: usize| if k % 10 == 0 { 8192usize } else { 16 };
        let recv = pages(PEERS * 8192);
        for k in 0..PEERS {
            let buf = &mut recv[k * 8192..k * 8192 + len(k)];
            let r = ((*(*rx.ep).tagged).recv.unwrap())(
                rx.ep,
                buf.as_mut_ptr() as *mut c_void,
                buf.len(),
                null_mut(),
                u64::MAX,
                k as u64,
                0,
                ctx(1000 + k),
            );
            assert_eq!(r, 0, "trecv {k}");
        }
        let mut senders = Vec::new();
        for k in 0..PEERS {
            let mut s = side(p.fabric, i1);
            s.peer = insert(s.av, &rx.name);
            let data = pages(8192);
            for (i, b) in data.iter_mut().enumerate() {
                *b = (i as u8).wrapping_mul(7) ^ k as u8;
            }
            let r = ((*(*s.ep).tagged).send.unwrap())(
                s.ep,
                data.as_ptr() as *const c_void,
                len(k),
                null_mut(),
                s.peer,
                k as u64,
                ctx(k),
            );
            assert_eq!(r, 0, "tsend from peer {k}");
            senders.push((s, data));
        }
        // Progress is made by reading the CQs: every one, in turn.
        let (mut got, mut sent) = (vec![false; PEERS], vec![false; PEERS]);
        for _ in 0..200_000 {
            if got.iter().all(|g| *g) && sent.iter().all(|s| *s) {
                break;
            }
            match read(rx.cq) {
                Ok(e) => {
                    let k = e.op_context as usize - 1000;
                    assert!(!got[k], "message {k} twice");
                    assert_eq!((e.tag, e.len), (k as u64, len(k)));
                    assert_eq!(
                        recv[k * 8192..k * 8192 + len(k)],
                        senders[k].1[..len(k)],
                        "message {k}"
                    );
                    got[k] = true;
                }
                Err(EAGAIN) => {}
                Err(r) => panic!("receiver's CQ: {r}"),
            }
            for (k, (s, _)) in senders.iter().enumerate() {
                match read(s.cq) {
                    Ok(e) => {
                        assert_eq!(e.op_context, ctx(k));
                        assert_eq!(e.flags, abi::FI_TAGGED as u64 | abi::FI_SEND as u64);
                        sent[k] = true;
                    }
                    Err(EAGAIN) => {}
                    Err(r) => panic!("peer {k}'s CQ: {r}"),
                }
            }
        }
        let missing: Vec<usize> = (0..PEERS).filter(|&k| !got[k] || !sent[k]).collect();
        assert!(missing.is_empty(), "not received or not sent: {missing:?}");
    }
}
