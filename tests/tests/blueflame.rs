//! BlueFlame (ABI 1.4): a send WQE written through the QP's BAR0 slot is executed from the
//! copy the NIC received, without a fetch from the send queue in host memory; a slot write
//! that is not the WQE at the producer index is refused as a stale WQE.

use ringbell::*;
use ringbell_specs::cqe::{DoorbellError, EventType};
use ringbell_specs::regs::{self, Caps};
use ringbell_specs::wqe::{CtrlSeg, RaddrSeg, SendOpcode, WqeFlags, INLINE_MARK, SEG};
use ringbell_tests::*;
use zerocopy::IntoBytes;

/// An inline 8-byte WRITE of `data` to `remote`, as WQE index `index`.
fn inline_write(index: u16, remote: RemoteAddr, data: &[u8; 8]) -> [u8; 64] {
    let mut w = [0u8; 64];
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Write as u8,
        flags: (WqeFlags::INLINE).bits(),
        wqe_index: index.into(),
        ds_count: 3,
        ..Default::default()
    };
    w[..SEG].copy_from_slice(ctrl.as_bytes());
    let r = RaddrSeg {
        raddr: remote.addr.into(),
        rkey: remote.rkey.into(),
        ..Default::default()
    };
    w[SEG..2 * SEG].copy_from_slice(r.as_bytes());
    w[2 * SEG..2 * SEG + 4].copy_from_slice(&(8 | INLINE_MARK).to_le_bytes());
    w[2 * SEG + 4..2 * SEG + 12].copy_from_slice(data);
    w
}

fn slot(p: &Pair) -> u64 {
    regs::BF_BASE + p.a.qp.qpn() as u64 * regs::BF_STRIDE
}

#[test]
fn the_nic_executes_the_blueflame_copy_without_reading_the_ring() {
    let p = pair();
    assert!(p.a.dev.caps().caps.contains(Caps::BLUEFLAME));
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 32,
        rkey: p.b.mr.rkey(),
    };
    // Nothing is written to the send queue in host memory: block 0 there is all zeros, so
    // a fetch would find no WQE (a stale-WQE doorbell error) and nothing would land.
    p.a.dev
        .port()
        .write_block(slot(&p), &inline_write(0, remote, b"bf-write"));
    settle(&p.fabric);
    let mut got = [0u8; 8];
    p.b.buf.read(32, &mut got).unwrap();
    assert_eq!(&got, b"bf-write");
    assert_eq!(p.a.dev.poll_event(), None);
}

#[test]
fn thirty_two_bit_stores_to_a_slot_are_assembled_in_any_order() {
    let p = pair();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 64,
        rkey: p.b.mr.rkey(),
    };
    let w = inline_write(0, remote, b"by-words");
    for i in (0..16).rev() {
        let v = u32::from_le_bytes(w[4 * i..4 * i + 4].try_into().unwrap());
        p.a.dev.port().write32(slot(&p) + 4 * i as u64, v);
    }
    settle(&p.fabric);
    let mut got = [0u8; 8];
    p.b.buf.read(64, &mut got).unwrap();
    assert_eq!(&got, b"by-words");
}

#[test]
fn a_slot_write_that_is_not_the_next_wqe_is_a_stale_wqe_and_nothing_runs() {
    let p = pair();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    // Index 5 while the producer index is 0; then a block with no control segment.
    p.a.dev
        .port()
        .write_block(slot(&p), &inline_write(5, remote, b"too-late"));
    p.a.dev.port().write_block(slot(&p), &[0u8; 64]);
    settle(&p.fabric);
    for _ in 0..2 {
        let e = p.a.dev.poll_event().expect("a doorbell error");
        assert_eq!(
            (e.kind, e.subtype, e.obj),
            (
                EventType::DoorbellError,
                DoorbellError::StaleWqe as u8,
                p.a.qp.qpn()
            )
        );
    }
    let mut got = [0u8; 8];
    p.b.buf.read(0, &mut got).unwrap();
    assert_eq!(got, [0; 8]);
    // The QP still works, through the driver (which uses the slot itself).
    let mut p = p;
    let sge = [p.a.mr.sge(0, 8)];
    p.a.buf.write(0, b"still ok").unwrap();
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::Write(remote), &sge)])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    p.b.buf.read(0, &mut got).unwrap();
    assert_eq!(&got, b"still ok");
}

#[test]
fn one_wqe_saves_the_fetch_and_a_batch_takes_the_doorbell() {
    // A single small WRITE costs one DMA read round trip (400 ns) less than the same WRITE
    // posted in a batch of two, whose WQEs the NIC fetches.
    let mut p = pair_with(2, 5, 9);
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let d = [1u8; 8];
    let t0 = p.fabric.now().ps();
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Write(remote), &d)])
        .unwrap();
    let single = wait(&p.fabric, &mut p.a.cq, 1)[0].timestamp_ps - t0;
    settle(&p.fabric);
    let t1 = p.fabric.now().ps();
    let unsignaled = SendWr::inline(2, WrOp::Write(remote), &d).flags(SendFlags::empty());
    p.a.qp
        .post_send(&[unsignaled, SendWr::inline(3, WrOp::Write(remote), &d)])
        .unwrap();
    let batch = wait(&p.fabric, &mut p.a.cq, 1)[0].timestamp_ps - t1;
    assert!(
        batch >= single + 400_000,
        "single {single} ps, second of a batch {batch} ps"
    );
}

#[test]
fn a_doorbell_right_behind_a_blueflame_store_does_not_overtake_it() {
    let mut p = pair();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let d = [7u8; 8];
    // One WQE (BlueFlame), then at the same instant a batch of two (send doorbell).
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Write(remote), &d)])
        .unwrap();
    p.a.qp
        .post_send(&[
            SendWr::inline(2, WrOp::Write(remote), &d),
            SendWr::inline(3, WrOp::Write(remote), &d),
        ])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 3);
    let ids: Vec<u64> = wc.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success));
    settle(&p.fabric);
    assert_eq!(p.a.dev.poll_event(), None, "no stale-WQE event");
}

#[test]
fn a_two_block_wqe_may_arrive_in_two_bursts_in_either_order() {
    let p = pair();
    let remote = RemoteAddr {
        addr: p.b.mr.addr() + 256,
        rkey: p.b.mr.rkey(),
    };
    // An inline WRITE of 40 bytes: 16 + 16 + 4 + 40 = 76 bytes, five segments, two blocks.
    let data: Vec<u8> = (0..40u8).collect();
    let mut w = [0u8; 128];
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Write as u8,
        flags: WqeFlags::INLINE.bits(),
        wqe_index: 0.into(),
        ds_count: 5,
        ..Default::default()
    };
    w[..SEG].copy_from_slice(ctrl.as_bytes());
    let r = RaddrSeg {
        raddr: remote.addr.into(),
        rkey: remote.rkey.into(),
        ..Default::default()
    };
    w[SEG..2 * SEG].copy_from_slice(r.as_bytes());
    w[2 * SEG..2 * SEG + 4].copy_from_slice(&(40 | INLINE_MARK).to_le_bytes());
    w[2 * SEG + 4..2 * SEG + 44].copy_from_slice(&data);
    let port = p.a.dev.port();
    port.write_block(slot(&p) + 64, &w[64..]);
    port.write_block(slot(&p), &w[..64]);
    settle(&p.fabric);
    let mut got = [0u8; 40];
    p.b.buf.read(256, &mut got).unwrap();
    assert_eq!(&got[..], &data[..]);
    assert_eq!(p.a.dev.poll_event(), None);
}
