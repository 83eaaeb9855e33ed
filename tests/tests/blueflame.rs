//! BlueFlame (ABI 1.4): a send WQE written through the QP's BAR0 slot is executed from the
//! copy the NIC received, without a fetch from the send queue in host memory; a slot write
//! that is not the WQE at the producer index is refused as a stale WQE; padding, leftovers,
//! refused writes and store ordering.

use ringbell::*;
use ringbell_specs::cqe::{DoorbellError, EventType};
use ringbell_specs::regs::{self, Caps};
use ringbell_specs::wqe::{CtrlSeg, RaddrSeg, SendOpcode, WqeFlags, INLINE_MARK, SEG};
use ringbell_tests::*;
use zerocopy::IntoBytes;

/// An inline WRITE of `data` to `remote` as WQE index `index`, padded to whole blocks:
/// control, remote-address and inline segments, `2 + ceil((4 + len) / 16)` segments.
fn inline_write_wqe(index: u16, remote: RemoteAddr, data: &[u8]) -> Vec<u8> {
    let ds = 2 + (4 + data.len()).div_ceil(SEG);
    let mut w = vec![0u8; ds.div_ceil(4) * 64];
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Write as u8,
        flags: (WqeFlags::INLINE | WqeFlags::SIGNALED).bits(),
        wqe_index: index.into(),
        ds_count: ds as u8,
        ..Default::default()
    };
    w[..SEG].copy_from_slice(ctrl.as_bytes());
    let r = RaddrSeg {
        raddr: remote.addr.into(),
        rkey: remote.rkey.into(),
        ..Default::default()
    };
    w[SEG..2 * SEG].copy_from_slice(r.as_bytes());
    w[2 * SEG..2 * SEG + 4].copy_from_slice(&(data.len() as u32 | INLINE_MARK).to_le_bytes());
    w[2 * SEG + 4..2 * SEG + 4 + data.len()].copy_from_slice(data);
    w
}

/// An inline 8-byte WRITE: one block.
fn inline_write(index: u16, remote: RemoteAddr, data: &[u8; 8]) -> Vec<u8> {
    inline_write_wqe(index, remote, data)
}

fn remote(s: &Side, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: s.mr.addr() + off,
        rkey: s.mr.rkey(),
    }
}

fn events(dev: &Device) -> Vec<AsyncEvent> {
    let mut v = Vec::new();
    while let Some(e) = dev.poll_event() {
        v.push(e);
    }
    v
}

fn slot(qpn: u32) -> u64 {
    regs::BF_BASE + qpn as u64 * regs::BF_STRIDE
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
        .write_block(slot(p.a.qp.qpn()), &inline_write(0, remote, b"bf-write"));
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
        p.a.dev.port().write32(slot(p.a.qp.qpn()) + 4 * i as u64, v);
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
        .write_block(slot(p.a.qp.qpn()), &inline_write(5, remote, b"too-late"));
    p.a.dev.port().write_block(slot(p.a.qp.qpn()), &[0u8; 64]);
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
    let w = inline_write_wqe(0, remote, &data);
    assert_eq!(w.len(), 128);
    let port = p.a.dev.port();
    port.write_block(slot(p.a.qp.qpn()) + 64, &w[64..]);
    port.write_block(slot(p.a.qp.qpn()), &w[..64]);
    settle(&p.fabric);
    let mut got = [0u8; 40];
    p.b.buf.read(256, &mut got).unwrap();
    assert_eq!(&got[..], &data[..]);
    assert_eq!(p.a.dev.poll_event(), None);
}

/// A BlueFlame write whose implied doorbell is refused (ring full) leaves no copy behind: a
/// later doorbell over that index runs what the ring holds.
#[test]
fn refused_blueflame_leaves_no_stale_stash() {
    let mut p = pair();
    let mut init = QpInit::new(&p.a.cq, &p.a.cq);
    init.max_send_wr = 4;
    init.max_send_sge = 1;
    init.max_inline = 0;
    let mut qa = p.a.pd.create_qp(&init).unwrap();
    let mut qb = p.b.pd.create_qp(&QpInit::new(&p.b.cq, &p.b.cq)).unwrap();
    let o = ConnectOptions {
        timeout: 8,
        ..Default::default()
    };
    // qb stays in RESET for now: A's requests are dropped and stay outstanding.
    qa.connect(&qb.endpoint(5), 5, &o).unwrap();
    assert_eq!(qa.sq_free(), 4, "a four-block send queue");
    let sges: Vec<[Sge; 1]> = (0..4).map(|i| [p.a.mr.sge(1000 + 8 * i, 8)]).collect();
    let wrs: Vec<SendWr<'_>> = (0..4)
        .map(|i| {
            SendWr::new(
                i,
                WrOp::Write(remote(&p.b, 2000 + 8 * i)),
                &sges[i as usize],
            )
        })
        .collect();
    qa.post_send(&wrs).unwrap();
    // Let the engine start all four (their requests are dropped by the peer in RESET; the
    // ACK timeout is about 1 ms, so nothing is retransmitted yet).
    let t0 = p.fabric.now().ps();
    while p.fabric.now().ps() < t0 + 20_000_000 {
        assert!(p.fabric.step());
    }
    // The ring is full on the device: a BlueFlame WQE at index 4 is refused.
    p.a.dev.port().write_block(
        slot(qa.qpn()),
        &inline_write(4, remote(&p.b, 100), b"STALE!!!"),
    );
    // Now let the peer answer: the four WRITEs complete after a retransmission.
    qb.connect(&qa.endpoint(5), 5, &o).unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 4);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    let evs = events(&p.a.dev);
    assert!(
        evs.iter().any(|e| e.kind == EventType::DoorbellError
            && e.subtype == DoorbellError::IndexOutOfRange as u8),
        "the BlueFlame doorbell was refused: {evs:?}"
    );
    // The driver posts two WQEs at 4 and 5 (a batch: the send doorbell, no BlueFlame).
    p.a.buf.write(3000, b"good-one").unwrap();
    let s1 = [p.a.mr.sge(3000, 8)];
    qa.post_send(&[
        SendWr::new(10, WrOp::Write(remote(&p.b, 100)), &s1),
        SendWr::new(11, WrOp::Write(remote(&p.b, 108)), &s1),
    ])
    .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 2);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    settle(&p.fabric);
    let mut got = [0u8; 8];
    p.b.buf.read(100, &mut got).unwrap();
    assert_eq!(&got, b"good-one", "the refused BlueFlame copy ran instead");
}

/// Words stored past a WQE's end (a slot padded to 256 bytes with 32-bit stores) are
/// padding: they do not complete the next, larger WQE with old bytes.
#[test]
fn leftover_words_do_not_complete_the_next_blueflame_wqe() {
    let p = pair();
    let port = p.a.dev.port();
    let qpn = p.a.qp.qpn();
    let mut padded = [0u8; 256];
    padded[..64].copy_from_slice(&inline_write(0, remote(&p.b, 0), b"one-blk."));
    for i in 0..64 {
        let v = u32::from_le_bytes(padded[4 * i..4 * i + 4].try_into().unwrap());
        port.write32(slot(qpn) + 4 * i as u64, v);
    }
    // The first WQE runs; words 16..63 of the padding are left in the partial buffer.
    settle(&p.fabric);
    let mut first = [0u8; 8];
    p.b.buf.read(0, &mut first).unwrap();
    assert_eq!(&first, b"one-blk.");
    let data = *b"0123456789abcdefghijklmnopqrstuvwxyzABCD";
    let two = inline_write_wqe(1, remote(&p.b, 64), &data);
    for i in 0..32 {
        let v = u32::from_le_bytes(two[4 * i..4 * i + 4].try_into().unwrap());
        port.write32(slot(qpn) + 4 * i as u64, v);
    }
    settle(&p.fabric);
    let mut got = [0u8; 40];
    p.b.buf.read(64, &mut got).unwrap();
    assert_eq!(&got, &data, "events: {:?}", events(&p.a.dev));
}

/// The bytes after the WQE in a padded burst are ignored and do not complete the next WQE.
#[test]
fn burst_padding_does_not_complete_the_next_blueflame_wqe() {
    let p = pair();
    let port = p.a.dev.port();
    let qpn = p.a.qp.qpn();
    let mut padded = [0u8; 256];
    padded[..64].copy_from_slice(&inline_write(0, remote(&p.b, 0), b"one-blk."));
    port.write_block(slot(qpn), &padded);
    settle(&p.fabric);
    let mut first = [0u8; 8];
    p.b.buf.read(0, &mut first).unwrap();
    assert_eq!(&first, b"one-blk.");
    let data = *b"0123456789abcdefghijklmnopqrstuvwxyzABCD";
    port.write_block(slot(qpn), &inline_write_wqe(1, remote(&p.b, 64), &data));
    settle(&p.fabric);
    let mut got = [0u8; 40];
    p.b.buf.read(64, &mut got).unwrap();
    assert_eq!(&got, &data, "events: {:?}", events(&p.a.dev));
}
