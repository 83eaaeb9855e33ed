//! Atomics on the in-process fabric: an endpoint on rb0 adds to, fetches and swaps 64-bit
//! words in memory an endpoint on rb1 registered; the valid/query calls; unsupported types
//! and operations; bad objects. One test: the provider's state is process-wide and reads the
//! environment.

mod common;

use common::fi::{ctx, one, one_err, pages, pair, quiet};
use ringbell_fi::{abi, info};
use std::ffi::c_void;
use std::ptr::{null, null_mut};

const AWRITE: u64 = abi::FI_ATOMIC as u64 | abi::FI_WRITE as u64;
const AREAD: u64 = abi::FI_ATOMIC as u64 | abi::FI_READ as u64;
const U64: abi::fi_datatype = abi::fi_datatype_FI_UINT64;
const I64: abi::fi_datatype = abi::fi_datatype_FI_INT64;
const SUM: abi::fi_op = abi::fi_op_FI_SUM;
const CSWAP: abi::fi_op = abi::fi_op_FI_CSWAP;
const NOTSUP: isize = -(abi::FI_EOPNOTSUPP as isize);
const EINVAL: isize = -(abi::FI_EINVAL as isize);

#[test]
fn atomics_add_fetch_and_swap_remote_words() {
    common::fi::in_process(13);
    // SAFETY: pointers to live locals, mapped test buffers and objects the provider made.
    unsafe {
        let p = pair(info::FI_MSG | info::FI_ATOMIC);
        let (a, b) = (&p.a, &p.b);
        let remote = pages(4096);
        let mut mr = null_mut();
        let acc = (abi::FI_REMOTE_READ | abi::FI_REMOTE_WRITE) as u64;
        assert_eq!(
            ((*(*b.dom).mr).reg.unwrap())(
                &mut (*b.dom).fid,
                remote.as_ptr() as *const c_void,
                remote.len(),
                acc,
                0,
                0,
                0,
                &mut mr,
                null_mut()
            ),
            0
        );
        let key = (*mr).key;
        // The words are read and written through the base pointer only: the NIC writes them.
        let base = remote.as_mut_ptr() as *mut u64;
        let word = |i: usize| base as u64 + 8 * i as u64;
        let get = |i: usize| base.add(i).read_volatile();
        base.write_volatile(40);
        let at = &*(*a.ep).atomic;
        // fi_atomic FI_SUM: 40 + 2.
        let two = 2u64;
        assert_eq!(
            (at.write.unwrap())(
                a.ep,
                &two as *const u64 as *const c_void,
                1,
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                SUM,
                ctx(1)
            ),
            0
        );
        let c = one(a.cq);
        assert_eq!((c.op_context, c.flags), (ctx(1), AWRITE));
        assert_eq!(get(0), 42);
        // fi_fetch_atomic FI_SUM on INT64: -50, the old value fetched.
        let minus = -50i64;
        let mut old = 0u64;
        assert_eq!(
            (at.readwrite.unwrap())(
                a.ep,
                &minus as *const i64 as *const c_void,
                1,
                null_mut(),
                &mut old as *mut u64 as *mut c_void,
                null_mut(),
                a.peer,
                word(0),
                key,
                I64,
                SUM,
                ctx(2)
            ),
            0
        );
        let c = one(a.cq);
        assert_eq!((c.op_context, c.flags), (ctx(2), AREAD));
        assert_eq!(old, 42);
        assert_eq!(get(0) as i64, -8);
        // fi_compare_atomic FI_CSWAP: a compare that fails, then one that succeeds.
        let (swap, mut res) = (777u64, 0u64);
        for (n, cmp, after) in [(3usize, 5u64, -8i64 as u64), (4, -8i64 as u64, 777)] {
            assert_eq!(
                (at.compwrite.unwrap())(
                    a.ep,
                    &swap as *const u64 as *const c_void,
                    1,
                    null_mut(),
                    &cmp as *const u64 as *const c_void,
                    null_mut(),
                    &mut res as *mut u64 as *mut c_void,
                    null_mut(),
                    a.peer,
                    word(0),
                    key,
                    U64,
                    CSWAP,
                    ctx(n)
                ),
                0
            );
            let c = one(a.cq);
            assert_eq!((c.op_context, c.flags), (ctx(n), AREAD));
            assert_eq!(res, -8i64 as u64, "the old value, swapped or not");
            assert_eq!(get(0), after);
        }
        // fi_inject_atomic: no completion; a fetch afterwards sees its sum.
        let ten = 10u64;
        assert_eq!(
            (at.inject.unwrap())(
                a.ep,
                &ten as *const u64 as *const c_void,
                1,
                a.peer,
                word(1),
                key,
                U64,
                SUM
            ),
            0
        );
        let zero = 0u64;
        let mut seen = 1u64;
        assert_eq!(
            (at.readwrite.unwrap())(
                a.ep,
                &zero as *const u64 as *const c_void,
                1,
                null_mut(),
                &mut seen as *mut u64 as *mut c_void,
                null_mut(),
                a.peer,
                word(1),
                key,
                U64,
                SUM,
                ctx(5)
            ),
            0
        );
        assert_eq!(one(a.cq).op_context, ctx(5));
        assert_eq!((seen, get(1)), (10, 10));
        // The msg forms: fi_atomicmsg and fi_compare_atomicmsg.
        let five = abi::fi_ioc {
            addr: &ten as *const u64 as *mut c_void,
            count: 1,
        };
        let rioc = abi::fi_rma_ioc {
            addr: word(1),
            count: 1,
            key,
        };
        let msg = abi::fi_msg_atomic {
            msg_iov: &five,
            desc: null_mut(),
            iov_count: 1,
            addr: a.peer,
            rma_iov: &rioc,
            rma_iov_count: 1,
            datatype: U64,
            op: SUM,
            context: ctx(6),
            data: 0,
        };
        assert_eq!((at.writemsg.unwrap())(a.ep, &msg, 0), 0);
        assert_eq!(one(a.cq).op_context, ctx(6));
        assert_eq!(get(1), 20);
        let cmpv = 20u64;
        let cioc = abi::fi_ioc {
            addr: &cmpv as *const u64 as *mut c_void,
            count: 1,
        };
        let mut r = 0u64;
        let mut resioc = abi::fi_ioc {
            addr: &mut r as *mut u64 as *mut c_void,
            count: 1,
        };
        let cmsg = abi::fi_msg_atomic {
            op: CSWAP,
            context: ctx(7),
            ..msg
        };
        assert_eq!(
            (at.compwritemsg.unwrap())(
                a.ep,
                &cmsg,
                &cioc,
                null_mut(),
                1,
                &mut resioc,
                null_mut(),
                1,
                0
            ),
            0
        );
        assert_eq!(one(a.cq).op_context, ctx(7));
        assert_eq!((r, get(1)), (20, 10), "swapped in the operand, 10");
        quiet(a.cq);
        quiet(b.cq);
        // Valid and query: one element of FI_UINT64/FI_INT64 with FI_SUM (atomic, fetch)
        // and FI_CSWAP (compare); everything else FI_EOPNOTSUPP.
        let mut n = 0usize;
        for dt in [U64, I64] {
            for (f, op) in [
                (at.writevalid, SUM),
                (at.readwritevalid, SUM),
                (at.compwritevalid, CSWAP),
            ] {
                n = 0;
                assert_eq!((f.unwrap())(a.ep, dt, op, &mut n), 0);
                assert_eq!(n, 1);
            }
        }
        for (f, dt, op) in [
            (at.writevalid, U64, CSWAP),
            (at.writevalid, abi::fi_datatype_FI_UINT32, SUM),
            (at.writevalid, abi::fi_datatype_FI_DOUBLE, SUM),
            (at.writevalid, U64, abi::fi_op_FI_MIN),
            (at.readwritevalid, U64, abi::fi_op_FI_ATOMIC_READ),
            (at.compwritevalid, U64, SUM),
            (at.compwritevalid, abi::fi_datatype_FI_INT32, CSWAP),
            (at.writevalid, 999, SUM),
        ] {
            assert_eq!(
                (f.unwrap())(a.ep, dt, op, &mut n) as isize,
                NOTSUP,
                "{dt} {op}"
            );
        }
        let bogus = base as *mut abi::fid_ep;
        assert_eq!(
            (at.writevalid.unwrap())(bogus, U64, SUM, &mut n) as isize,
            EINVAL
        );
        assert_eq!(
            (at.writevalid.unwrap())(a.ep, U64, SUM, null_mut()) as isize,
            EINVAL
        );
        let q = (*(*a.dom).ops).query_atomic.unwrap();
        let mut attr = abi::fi_atomic_attr::default();
        assert_eq!(q(a.dom, U64, SUM, &mut attr, 0), 0);
        assert_eq!((attr.count, attr.size), (1, 8));
        assert_eq!(q(a.dom, I64, SUM, &mut attr, abi::FI_FETCH_ATOMIC), 0);
        assert_eq!(q(a.dom, U64, CSWAP, &mut attr, abi::FI_COMPARE_ATOMIC), 0);
        assert_eq!(q(a.dom, U64, CSWAP, &mut attr, 0) as isize, NOTSUP);
        assert_eq!(
            q(a.dom, abi::fi_datatype_FI_FLOAT, SUM, &mut attr, 0) as isize,
            NOTSUP
        );
        assert_eq!(
            q(
                a.dom,
                U64,
                SUM,
                &mut attr,
                abi::FI_FETCH_ATOMIC | abi::FI_COMPARE_ATOMIC
            ) as isize,
            EINVAL
        );
        assert_eq!(
            q(a.dom, U64, SUM, &mut attr, abi::FI_TAGGED as u64) as isize,
            NOTSUP
        );
        assert_eq!(q(bogus as *mut _, U64, SUM, &mut attr, 0) as isize, EINVAL);
        // The operations refuse what the valid calls refuse, bad counts, misaligned
        // targets, missing results and bad endpoints.
        let op1 = &two as *const u64 as *const c_void;
        let w = at.write.unwrap();
        assert_eq!(
            w(
                a.ep,
                op1,
                1,
                null_mut(),
                a.peer,
                word(0),
                key,
                abi::fi_datatype_FI_UINT32,
                SUM,
                null_mut()
            ),
            NOTSUP
        );
        assert_eq!(
            w(
                a.ep,
                op1,
                1,
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                abi::fi_op_FI_BOR,
                null_mut()
            ),
            NOTSUP
        );
        assert_eq!(
            w(
                a.ep,
                op1,
                2,
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                SUM,
                null_mut()
            ),
            -(abi::FI_EMSGSIZE as isize)
        );
        assert_eq!(
            w(
                a.ep,
                null(),
                1,
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                SUM,
                null_mut()
            ),
            EINVAL
        );
        assert_eq!(
            w(
                a.ep,
                op1,
                1,
                null_mut(),
                a.peer,
                word(0) + 4,
                key,
                U64,
                SUM,
                null_mut()
            ),
            EINVAL
        );
        assert_eq!(
            w(
                bogus,
                op1,
                1,
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                SUM,
                null_mut()
            ),
            EINVAL
        );
        assert_eq!(
            (at.readwrite.unwrap())(
                a.ep,
                op1,
                1,
                null_mut(),
                null_mut(),
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                SUM,
                null_mut()
            ),
            EINVAL
        );
        assert_eq!(
            (at.compwrite.unwrap())(
                a.ep,
                op1,
                1,
                null_mut(),
                op1,
                null_mut(),
                &mut res as *mut u64 as *mut c_void,
                null_mut(),
                a.peer,
                word(0),
                key,
                U64,
                SUM,
                null_mut()
            ),
            NOTSUP
        );
        assert_eq!((at.writemsg.unwrap())(a.ep, null(), 0), EINVAL);
        quiet(a.cq);
        assert_eq!(get(0), 777);
        // A key the target does not know: an error completion.
        assert_eq!(
            w(
                a.ep,
                op1,
                1,
                null_mut(),
                a.peer,
                word(0),
                key ^ 0x3c3c00,
                U64,
                SUM,
                ctx(9)
            ),
            0
        );
        let e = one_err(a.cq);
        assert_eq!(
            (e.op_context, e.err, e.flags),
            (ctx(9), abi::FI_EACCES as i32, AWRITE)
        );
        assert_eq!(get(0), 777);
        ringbell_fi::free_info(p.list);
    }
}
