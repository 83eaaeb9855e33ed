//! BlueFlame slots: padding, leftovers, refused writes and store ordering.

use ringbell::*;
use ringbell_specs::cqe::{DoorbellError, EventType};
use ringbell_specs::regs;
use ringbell_specs::wqe::{CtrlSeg, RaddrSeg, SendOpcode, WqeFlags, INLINE_MARK, SEG};
use ringbell_tests::*;
use zerocopy::IntoBytes;

fn remote(s: &Side, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: s.mr.addr() + off,
        rkey: s.mr.rkey(),
    }
}

/// An inline 8-byte WRITE of `data` to `remote`, as WQE index `index`.
fn inline_write(index: u16, remote: RemoteAddr, data: &[u8; 8]) -> [u8; 64] {
    let mut w = [0u8; 64];
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Write as u8,
        flags: (WqeFlags::INLINE | WqeFlags::SIGNALED).bits(),
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

/// An inline WRITE of 40 bytes (ds_count 5: two blocks), as WQE index `index`.
fn inline_write_2bb(index: u16, remote: RemoteAddr, data: &[u8; 40]) -> [u8; 128] {
    let mut w = [0u8; 128];
    let ctrl = CtrlSeg {
        opcode: SendOpcode::Write as u8,
        flags: (WqeFlags::INLINE | WqeFlags::SIGNALED).bits(),
        wqe_index: index.into(),
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
    w[2 * SEG + 4..2 * SEG + 44].copy_from_slice(data);
    w
}

fn slot(qpn: u32) -> u64 {
    regs::BF_BASE + qpn as u64 * regs::BF_STRIDE
}

fn events(dev: &Device) -> Vec<AsyncEvent> {
    let mut v = Vec::new();
    while let Some(e) = dev.poll_event() {
        v.push(e);
    }
    v
}

/// A doorbell posted right after a BlueFlame burst does not overtake it (the emulator used
/// to deliver the burst 40 ns later, and it was refused as a stale WQE).
#[test]
fn doorbell_after_blueflame_does_not_overtake_it() {
    let mut p = pair();
    let d = [7u8; 8];
    p.a.qp
        .post_send(&[SendWr::inline(1, WrOp::Write(remote(&p.b, 0)), &d)])
        .unwrap();
    p.a.qp
        .post_send(&[
            SendWr::inline(2, WrOp::Write(remote(&p.b, 8)), &d),
            SendWr::inline(3, WrOp::Write(remote(&p.b, 16)), &d),
        ])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(
        got,
        vec![
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::Success)
        ]
    );
    let evs = events(&p.a.dev);
    assert!(evs.is_empty(), "spurious events: {evs:?}");
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
    let two = inline_write_2bb(1, remote(&p.b, 64), &data);
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
    port.write_block(slot(qpn), &inline_write_2bb(1, remote(&p.b, 64), &data));
    settle(&p.fabric);
    let mut got = [0u8; 40];
    p.b.buf.read(64, &mut got).unwrap();
    assert_eq!(&got, &data, "events: {:?}", events(&p.a.dev));
}
