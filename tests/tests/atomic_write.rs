//! IBTA 1.5 ATOMIC WRITE (ABI 1.10) end to end: 8 bytes stored whole at an aligned remote
//! address the R_Key allows writing, completing as ATOMIC_WRITE; what the driver refuses
//! before posting and what the responder refuses (each as the NIC reports it); timed and
//! functional mode alike; and, over a fabric that drops, duplicates, reorders and corrupts
//! frames, a property test against a reference model: a mix of ATOMIC WRITEs and RDMA
//! WRITEs to a few words leaves each word with the value of the last request to it, in
//! order, however often its packets were resent or duplicated.

use proptest::prelude::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};
use ringbell_specs::cqe::VendorSyndrome;
use ringbell_tests::*;

fn full() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

fn atomic_write(p: &mut Pair, remote: RemoteAddr, value: [u8; 8]) -> WorkCompletion {
    let wr = SendWr::inline(3, WrOp::AtomicWrite(remote), &value).flags(SendFlags::SIGNALED);
    p.a.qp.post_send(&[wr]).unwrap();
    wait(&p.fabric, &mut p.a.cq, 1)[0]
}

fn b_word(p: &Pair, off: u64) -> [u8; 8] {
    let mut w = [0u8; 8];
    p.b.buf.read(off as usize, &mut w).unwrap();
    w
}

fn at(p: &Pair, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: p.b.mr.addr() + off,
        rkey: p.b.mr.rkey(),
    }
}

#[test]
fn an_atomic_write_stores_its_eight_bytes_in_both_modes() {
    for functional in [false, true] {
        let mut p = pair_in(functional, 3, full());
        p.b.buf.write(0, &[0xAA; 32]).unwrap();
        let remote = at(&p, 8);
        let wc = atomic_write(&mut p, remote, *b"ringbell");
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        assert_eq!(wc.opcode, WcOpcode::AtomicWrite);
        assert_eq!(wc.wr_id, 3);
        // Exactly the eight bytes, nothing around them.
        let mut got = [0u8; 32];
        p.b.buf.read(0, &mut got).unwrap();
        assert_eq!(&got[..8], &[0xAA; 8]);
        assert_eq!(&got[8..16], b"ringbell");
        assert_eq!(&got[16..], &[0xAA; 16]);
        // The responder counted it as a message (MSN) and the QP goes on.
        let remote = at(&p, 0);
        let wc = atomic_write(&mut p, remote, 7u64.to_le_bytes());
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(b_word(&p, 0), 7u64.to_le_bytes());
    }
}

#[test]
fn the_driver_refuses_what_is_not_an_atomic_write() {
    let mut p = pair();
    let remote = at(&p, 0);
    let refused = |qp: &mut QueuePair, wr: SendWr<'_>| {
        matches!(qp.post_send(&[wr]), Err(Error::InvalidArgument(_)))
    };
    // Seven or nine bytes, an SGE instead of inline bytes, a misaligned target.
    assert!(refused(
        &mut p.a.qp,
        SendWr::inline(1, WrOp::AtomicWrite(remote), &[0; 7])
    ));
    assert!(refused(
        &mut p.a.qp,
        SendWr::inline(1, WrOp::AtomicWrite(remote), &[0; 9])
    ));
    let sge = [p.a.mr.sge(0, 8)];
    assert!(refused(
        &mut p.a.qp,
        SendWr::new(1, WrOp::AtomicWrite(remote), &sge)
    ));
    let odd = RemoteAddr {
        addr: remote.addr + 4,
        ..remote
    };
    assert!(refused(
        &mut p.a.qp,
        SendWr::inline(1, WrOp::AtomicWrite(odd), &[0; 8])
    ));
    // A QP whose max_inline is 0 still carries the eight bytes.
    let fabric = Fabric::new(FabricConfig::new(4, 4));
    let mut a = side(&fabric, 0, full());
    let mut b = side(&fabric, 1, full());
    let mut init = QpInit::new(&a.cq, &a.cq);
    init.max_inline = 0;
    a.qp = a.pd.create_qp(&init).unwrap();
    connect(&mut a, &mut b, &ConnectOptions::default());
    let remote = RemoteAddr {
        addr: b.mr.addr(),
        rkey: b.mr.rkey(),
    };
    let wr = SendWr::inline(9, WrOp::AtomicWrite(remote), &[5; 8]).flags(SendFlags::SIGNALED);
    a.qp.post_send(&[wr]).unwrap();
    assert_eq!(wait(&fabric, &mut a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 8];
    b.buf.read(0, &mut got).unwrap();
    assert_eq!(got, [5; 8]);
    // UC and UD have no ATOMIC WRITE.
    let mut uc = side_of(&fabric, 2, full(), QpType::Uc);
    let mut peer = side_of(&fabric, 3, full(), QpType::Uc);
    connect(&mut uc, &mut peer, &ConnectOptions::default());
    let r = uc
        .qp
        .post_send(&[SendWr::inline(1, WrOp::AtomicWrite(remote), &[0; 8])]);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "UC: {r:?}");
    let mut init = QpInit::new(&uc.cq, &uc.cq);
    init.qp_type = QpType::Ud;
    let mut ud = uc.pd.create_qp(&init).unwrap();
    ud.ud_ready(0x11, 0).unwrap();
    let ah = uc.pd.create_ah(&peer.dev.ah_attr()).unwrap();
    let to = UdDest {
        ah: &ah,
        qpn: 1,
        qkey: 0x11,
    };
    let wr = SendWr::inline(1, WrOp::AtomicWrite(remote), &[0; 8]).to(to);
    let r = ud.post_send(&[wr]);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "UD: {r:?}");
}

/// What the responder refuses, with the requester's status and the QP going to ERR.
#[test]
fn the_responder_refuses_bad_keys_rights_and_bounds() {
    // (B's region access, B's QP access, offset from B's region start, rkey change) →
    // the requester's status.
    let cases: [(Access, bool, u64, bool, WcStatus); 4] = [
        // A region without REMOTE_WRITE.
        (
            Access::LOCAL_WRITE | Access::REMOTE_READ,
            true,
            0,
            false,
            WcStatus::RemAccessErr,
        ),
        // A key naming no region.
        (full(), true, 0, true, WcStatus::RemAccessErr),
        // The last word of the region, and one past it.
        (full(), true, BUF as u64, false, WcStatus::RemAccessErr),
        // A QP that does not allow remote writes.
        (full(), false, 0, false, WcStatus::RemInvReqErr),
    ];
    for (i, (region, qp_write, off, bad_key, want)) in cases.into_iter().enumerate() {
        let fabric = Fabric::new(FabricConfig::new(2, 10 + i as u64));
        let mut a = side(&fabric, 0, full());
        let mut b = side(&fabric, 1, region);
        let mut opts = ConnectOptions::default();
        if !qp_write {
            opts.access = Access::REMOTE_READ;
        }
        connect(&mut a, &mut b, &opts);
        let remote = RemoteAddr {
            addr: b.mr.addr() + off,
            rkey: if bad_key {
                b.mr.rkey() ^ 0x100
            } else {
                b.mr.rkey()
            },
        };
        let wr = SendWr::inline(2, WrOp::AtomicWrite(remote), &[1; 8]).flags(SendFlags::SIGNALED);
        a.qp.post_send(&[wr]).unwrap();
        let wc = wait(&fabric, &mut a.cq, 1)[0];
        assert_eq!(wc.status, want, "case {i}: {wc:?}");
        assert_eq!(wc.opcode, WcOpcode::AtomicWrite, "case {i}");
        let mut got = [0u8; 8];
        b.buf.read(0, &mut got).unwrap();
        assert_eq!(got, [0; 8], "case {i}: nothing was written");
        assert_eq!(a.qp.query().unwrap().state, QpState::Err as u8, "case {i}");
    }
    // The bounds check is exact: the region's last word is reachable.
    let mut p = pair();
    let remote = at(&p, BUF as u64 - 8);
    let wc = atomic_write(&mut p, remote, [9; 8]);
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(b_word(&p, BUF as u64 - 8), [9; 8]);
}

#[derive(Clone, Debug)]
enum Req {
    /// ATOMIC WRITE of `value` to word `slot`.
    Atomic { slot: u8, value: u64 },
    /// RDMA WRITE of 8 bytes of `value` to word `slot`.
    Write { slot: u8, value: u64 },
}

const SLOTS: u8 = 4;

fn req() -> impl Strategy<Value = Req> {
    prop_oneof![
        (0..SLOTS, any::<u64>()).prop_map(|(slot, value)| Req::Atomic { slot, value }),
        (0..SLOTS, any::<u64>()).prop_map(|(slot, value)| Req::Write { slot, value }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Over a lossy fabric every request completes, in order, and each word ends with the
    /// value of the last request to it: a resent or duplicated ATOMIC WRITE is never
    /// stored again over a later value.
    #[test]
    fn atomic_writes_and_writes_land_in_order_over_a_lossy_fabric(
        reqs in proptest::collection::vec(req(), 1..40),
        seed in 0u64..1000,
        functional in any::<bool>(),
    ) {
        let mut cfg = FabricConfig::new(2, seed);
        cfg.functional = functional;
        cfg.faults = lossy(40_000);
        let fabric = Fabric::new(cfg);
        let mut a = side(&fabric, 0, full());
        let mut b = side(&fabric, 1, full());
        connect(&mut a, &mut b, &ConnectOptions { timeout: 8, retry_cnt: 7, ..Default::default() });
        let mut model = [0u64; SLOTS as usize];
        let mut sources = vec![0u8; reqs.len() * 8];
        for (i, r) in reqs.iter().enumerate() {
            let (slot, value) = match *r {
                Req::Atomic { slot, value } | Req::Write { slot, value } => (slot, value),
            };
            sources[i * 8..i * 8 + 8].copy_from_slice(&value.to_le_bytes());
            model[slot as usize] = value;
        }
        a.buf.write(0, &sources).unwrap();
        for (i, r) in reqs.iter().enumerate() {
            let (slot, value) = match *r {
                Req::Atomic { slot, value } | Req::Write { slot, value } => (slot, value),
            };
            let remote = RemoteAddr { addr: b.mr.addr() + u64::from(slot) * 8, rkey: b.mr.rkey() };
            let bytes = value.to_le_bytes();
            let sge = [a.mr.sge(i as u64 * 8, 8)];
            let wr = match r {
                Req::Atomic { .. } => SendWr::inline(i as u64, WrOp::AtomicWrite(remote), &bytes),
                Req::Write { .. } => SendWr::new(i as u64, WrOp::Write(remote), &sge),
            };
            a.qp.post_send(&[wr.flags(SendFlags::SIGNALED)]).unwrap();
            // Keep the send queue from overflowing.
            if i % 64 == 63 {
                let _ = wait(&fabric, &mut a.cq, 64);
            }
        }
        let wc = drain(&fabric, &mut a.cq);
        let all: Vec<_> = wc.iter().map(|w| (w.wr_id, w.status)).collect();
        prop_assert_eq!(wc.len(), reqs.len(), "{:?}", all);
        for (i, w) in wc.iter().enumerate() {
            prop_assert_eq!(w.status, WcStatus::Success, "{:?}", w);
            prop_assert_eq!(w.wr_id, i as u64);
            let want = match reqs[i] {
                Req::Atomic { .. } => WcOpcode::AtomicWrite,
                Req::Write { .. } => WcOpcode::RdmaWrite,
            };
            prop_assert_eq!(w.opcode, want);
            prop_assert_eq!(w.vendor_syndrome, VendorSyndrome::None as u8);
        }
        for s in 0..SLOTS {
            let mut w = [0u8; 8];
            b.buf.read(usize::from(s) * 8, &mut w).unwrap();
            prop_assert_eq!(u64::from_le_bytes(w), model[usize::from(s)], "word {}", s);
        }
    }
}
