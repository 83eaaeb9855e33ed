//! Conformance of event counters and triggered operations (ABI 1.3), driven through the
//! driver against the emulated NIC: the arithmetic and host reads of counters, which events
//! count where and when, the wait decision table, the firing rule and release order of
//! triggered operations (reference `triggered-ops.md` §6.6 T1–T15), the libfabric
//! deferred-work cases (`deferred_work.c`), cancel, flush and table limits, every bad input
//! with its exact status, and a property test against a reference model of the firing rule.

use proptest::prelude::*;
use ringbell::*;
use ringbell_specs::cmd::{
    ArmCntrIn, BindCntrIn, CmdOpcode, CmdStatus, CntrWriteback, CreateCntrIn, FlushTriggeredIn,
    ObjectIn, PostTriggeredIn, TrigFlags, TrigKind, UpdateCntrIn, CNTR_BIND_MR, CNTR_BIND_QP,
    CNTR_BIND_UNBIND,
};
use ringbell_specs::wqe::{AtomicSeg, CtrlSeg, DataSeg, RaddrSeg, SendOpcode, WqeFlags};
use ringbell_tests::*;
use zerocopy::IntoBytes;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// `off` bytes into `s`'s registered buffer, as a remote address.
fn remote(s: &Side, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: s.mr.addr() + off,
        rkey: s.mr.rkey(),
    }
}

/// A remote address whose rkey names no MR.
fn bad_remote(s: &Side) -> RemoteAddr {
    RemoteAddr {
        addr: s.mr.addr(),
        rkey: s.mr.rkey() ^ 0x00ab_cd00,
    }
}

/// Posts on A's QP a triggered 8-byte WRITE with id `id` from A's offset `8 * id` to the same
/// offset at B.
fn trig_write_opts(
    p: &Pair,
    c: &Counter,
    thr: u64,
    id: u64,
    opts: TriggerOpts<'_>,
) -> TriggerHandle {
    let sge = [p.a.mr.sge(id * 8, 8)];
    p.a.qp
        .post_triggered(
            c,
            thr,
            &SendWr::new(id, WrOp::Write(remote(&p.b, id * 8)), &sge),
            opts,
        )
        .unwrap()
}

/// [`trig_write_opts`], signaled.
fn trig_write(p: &Pair, c: &Counter, thr: u64, id: u64) -> TriggerHandle {
    trig_write_opts(
        p,
        c,
        thr,
        id,
        TriggerOpts {
            signaled: true,
            ..Default::default()
        },
    )
}

/// Runs the fabric to idle and returns the `wr_id`s of A's completions, checking each is a
/// successful triggered one.
fn fired(p: &mut Pair) -> Vec<u64> {
    drain(&p.fabric, &mut p.a.cq)
        .iter()
        .map(|w| {
            assert_eq!(w.status, WcStatus::Success, "{w:?}");
            assert!(w.trigger.is_some(), "not a triggered completion: {w:?}");
            w.wr_id
        })
        .collect()
}

/// The device status of a failed command.
fn status<T: std::fmt::Debug>(r: Result<T, Error>) -> CmdStatus {
    match r {
        Err(Error::Command { status, .. }) => status,
        other => panic!("expected a command failure, got {other:?}"),
    }
}

/// The device status of a failed command, checking the command it was reported for.
fn status_of<T: std::fmt::Debug>(r: Result<T, Error>, want: CmdOpcode) -> CmdStatus {
    match r {
        Err(Error::Command { op, status }) => {
            assert_eq!(op, want, "status {status:?} reported for another command");
            status
        }
        other => panic!("expected a {want:?} failure, got {other:?}"),
    }
}

fn raw(dev: &Device, op: CmdOpcode, input: &[u8]) -> Result<[u8; 112], Error> {
    dev.raw_command(op as u16, input)
}

fn raw_post(dev: &Device, t: &PostTriggeredIn) -> Result<[u8; 112], Error> {
    raw(dev, CmdOpcode::PostTriggered, t.as_bytes())
}

/// A raw POST_TRIGGERED of a counter operation.
fn raw_cntr_op(
    trig: &Counter,
    thr: u64,
    kind: TrigKind,
    flags: TrigFlags,
    target: u32,
    values: (u64, u64),
) -> PostTriggeredIn {
    let mut t = PostTriggeredIn {
        trig_cntr: trig.num().into(),
        threshold: thr.into(),
        kind: kind as u8,
        flags: flags.bits(),
        target: target.into(),
        ..Default::default()
    };
    t.set_body(
        CntrWriteback {
            success: values.0.into(),
            error: values.1.into(),
        }
        .as_bytes(),
    );
    t
}

/// A one-block send WQE: control segment (`opcode`, no flags), then `segs`.
fn raw_wqe(opcode: SendOpcode, segs: &[&[u8]]) -> [u8; 64] {
    let ctrl = CtrlSeg {
        opcode: opcode as u8,
        ds_count: (1 + segs.len()) as u8,
        ..Default::default()
    };
    let mut w = [0u8; 64];
    w[..16].copy_from_slice(ctrl.as_bytes());
    for (i, seg) in segs.iter().enumerate() {
        w[16 * (i + 1)..16 * (i + 2)].copy_from_slice(seg);
    }
    w
}

fn raddr_seg(r: RemoteAddr) -> RaddrSeg {
    RaddrSeg {
        raddr: r.addr.into(),
        rkey: r.rkey.into(),
        ..Default::default()
    }
}

fn data_seg(s: Sge) -> DataSeg {
    DataSeg {
        byte_count: s.len.into(),
        lkey: s.lkey.into(),
        addr: s.addr.into(),
    }
}

/// The WQE of a plain 8-byte WRITE from A's offset 0 to B's.
fn raw_write_wqe(p: &Pair) -> [u8; 64] {
    raw_wqe(
        SendOpcode::Write,
        &[
            raddr_seg(remote(&p.b, 0)).as_bytes(),
            data_seg(p.a.mr.sge(0, 8)).as_bytes(),
        ],
    )
}

/// A raw POST_TRIGGERED of a data transfer on A's QP.
fn raw_wqe_op(p: &Pair, trig: &Counter, thr: u64, body: &[u8]) -> PostTriggeredIn {
    let mut t = PostTriggeredIn {
        trig_cntr: trig.num().into(),
        threshold: thr.into(),
        kind: TrigKind::Wqe as u8,
        target: p.a.qp.qpn().into(),
        wr_id: 77u64.into(),
        ..Default::default()
    };
    t.set_body(body);
    t
}

/// A fresh connected QP pair on `p`'s devices, PDs and CQs.
fn extra_qps(p: &Pair) -> (QueuePair, QueuePair) {
    let mut qa = p.a.pd.create_qp(&QpInit::new(&p.a.cq, &p.a.cq)).unwrap();
    let mut qb = p.b.pd.create_qp(&QpInit::new(&p.b.cq, &p.b.cq)).unwrap();
    let o = ConnectOptions::default();
    qa.connect(&qb.endpoint(5), 5, &o).unwrap();
    qb.connect(&qa.endpoint(5), 5, &o).unwrap();
    (qa, qb)
}

/// After a refused command, the devices still move data: a WRITE on a fresh QP pair
/// completes and lands.
fn still_serving(p: &mut Pair) {
    let (mut qa, _qb) = extra_qps(p);
    drain(&p.fabric, &mut p.a.cq);
    drain(&p.fabric, &mut p.b.cq);
    p.a.buf.write(900_000, b"still serving").unwrap();
    qa.post_send(&[SendWr::new(
        4242,
        WrOp::Write(remote(&p.b, 900_000)),
        &[p.a.mr.sge(900_000, 13)],
    )])
    .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (4242, WcStatus::Success));
    let mut got = [0u8; 13];
    p.b.buf.read(900_000, &mut got).unwrap();
    assert_eq!(&got, b"still serving");
    p.b.buf.fill(900_000, 13, 0).unwrap();
}

fn read_u64(b: &DmaBuffer, off: usize) -> u64 {
    b.read_u64(off).unwrap()
}

fn write_u64(b: &DmaBuffer, off: usize, v: u64) {
    b.write(off, &v.to_le_bytes()).unwrap()
}

fn info(c: &Counter) -> CounterInfo {
    c.query().unwrap()
}

/// Asserts `c`'s values, the same through its registers, its writeback and QUERY_CNTR.
#[track_caller]
fn assert_cntr(c: &Counter, want: (u64, u64)) {
    assert_eq!(c.read(), want, "register read");
    assert_eq!(c.get(), want, "writeback");
    let q = info(c);
    assert_eq!((q.success, q.error), want, "query");
}

// ---------------------------------------------------------------------------------------
// Counters
// ---------------------------------------------------------------------------------------

/// fabtests `fi_cntr_test`: set i / set_error 2i / add i / add_error i on 100 counters reads
/// back 2i and 3i; reads after a set are consistent (CXI `verify_sync`) and the writeback
/// agrees with the registers once the device has caught up.
#[test]
fn counter_arithmetic_matches_fi_cntr_test() {
    let p = pair();
    let cs: Vec<Counter> = (0..100).map(|_| p.a.pd.create_counter().unwrap()).collect();
    let mut nums: Vec<u32> = cs.iter().map(Counter::num).collect();
    nums.sort_unstable();
    nums.dedup();
    assert_eq!(nums.len(), 100, "counter numbers are distinct");
    for (i, c) in cs.iter().enumerate() {
        let i = i as u64 + 1;
        assert_eq!(c.get(), (0, 0));
        assert_eq!(c.read(), (0, 0));
        c.set(i).unwrap();
        assert_eq!(c.read(), (i, 0), "read after set");
        c.set_error(2 * i).unwrap();
        c.add(i as u32);
        c.add_error(i as u32);
        // Posted stores: a read does not pass them.
        assert_eq!(c.read(), (2 * i, 3 * i));
    }
    settle(&p.fabric);
    for (i, c) in cs.iter().enumerate() {
        let i = i as u64 + 1;
        assert_cntr(c, (2 * i, 3 * i));
        let q = info(c);
        assert_eq!((q.pending, q.refs), (0, 0));
    }
    // Wide adds reach the upper halves of both values; values wrap at 2^64.
    let c = &cs[0];
    c.add_wide(1 << 40, 3 << 33).unwrap();
    assert_cntr(c, ((1 << 40) + 2, (3 << 33) + 3));
    c.set(u64::MAX).unwrap();
    c.add(2);
    assert_eq!(c.read().0, 1);
    c.set(0).unwrap();
    c.set_error(0).unwrap();
    settle(&p.fabric);
    assert_cntr(c, (0, 0));
}

/// CXI `cntr/write`, `cntr/read`: a QP's WRITE and READ counters count every completion of
/// its posted work, signaled or not; atomics count as READs.
#[test]
fn bound_write_and_read_counters_count_signaled_and_unsignaled_work() {
    let mut p = pair();
    let wc = p.a.pd.create_counter().unwrap();
    let rc = p.a.pd.create_counter().unwrap();
    wc.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    rc.bind_qp(&p.a.qp, CntrEvents::READ).unwrap();
    assert_eq!(info(&wc).refs, 1);
    p.a.buf.write(0, &[7u8; 64]).unwrap();
    let sge = [p.a.mr.sge(0, 64)];
    let dst = [p.a.mr.sge(4096, 64)];
    let res = [p.a.mr.sge(8192, 8)];
    let unsig = SendFlags::empty();
    p.a.qp
        .post_send(&[
            SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sge).flags(unsig),
            SendWr::new(2, WrOp::Write(remote(&p.b, 64)), &sge).flags(unsig),
            SendWr::new(3, WrOp::Write(remote(&p.b, 128)), &sge).flags(unsig),
            SendWr::new(4, WrOp::Read(remote(&p.b, 0)), &dst).flags(unsig),
            SendWr::new(
                5,
                WrOp::FetchAdd {
                    remote: remote(&p.b, 1024),
                    add: 1,
                },
                &res,
            )
            .flags(unsig),
            SendWr::new(
                6,
                WrOp::CmpSwap {
                    remote: remote(&p.b, 1024),
                    compare: 1,
                    swap: 9,
                },
                &res,
            )
            .flags(unsig),
            SendWr::new(7, WrOp::Write(remote(&p.b, 192)), &sge),
            SendWr::new(8, WrOp::Read(remote(&p.b, 64)), &dst),
        ])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(got, vec![(7, WcStatus::Success), (8, WcStatus::Success)]);
    assert_cntr(&wc, (4, 0));
    assert_cntr(&rc, (4, 0));
    assert_eq!(read_u64(&p.b.buf, 1024), 9);
    // Unbound, they stop counting.
    wc.unbind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    assert_eq!(info(&wc).refs, 0);
    p.a.qp
        .post_send(&[SendWr::new(9, WrOp::Write(remote(&p.b, 0)), &sge)])
        .unwrap();
    wait(&p.fabric, &mut p.a.cq, 1);
    settle(&p.fabric);
    assert_cntr(&wc, (4, 0));
    assert_cntr(&rc, (4, 0));
}

/// CXI `cntr/ping`: one send and one receive count 1 each; a WRITE with immediate counts as
/// a receive, a plain WRITE does not; receives flushed by an error count as errors.
#[test]
fn ping_counts_one_send_and_one_receive() {
    let mut p = pair();
    let sc = p.a.pd.create_counter().unwrap();
    let rcv = p.b.pd.create_counter().unwrap();
    sc.bind_qp(&p.a.qp, CntrEvents::SEND).unwrap();
    rcv.bind_qp(&p.b.qp, CntrEvents::RECV).unwrap();
    let rs = [p.b.mr.sge(0, 64)];
    p.b.qp
        .post_recv(&[RecvWr { wr_id: 1, sgl: &rs }, RecvWr { wr_id: 2, sgl: &rs }])
        .unwrap();
    p.a.buf.fill(0, 64, 0x42).unwrap();
    p.a.qp
        .post_send(&[SendWr::new(10, WrOp::Send, &[p.a.mr.sge(0, 64)])])
        .unwrap();
    assert_eq!(wait(&p.fabric, &mut p.a.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&p.fabric, &mut p.b.cq, 1)[0].byte_len, 64);
    settle(&p.fabric);
    assert_cntr(&sc, (1, 0));
    assert_cntr(&rcv, (1, 0));
    let mut got = [0u8; 64];
    p.b.buf.read(0, &mut got).unwrap();
    assert_eq!(got, [0x42; 64]);
    // WRITE with immediate consumes the second receive; a plain WRITE counts nothing.
    p.a.qp
        .post_send(&[
            SendWr::new(
                11,
                WrOp::WriteImm(remote(&p.b, 128), 5),
                &[p.a.mr.sge(0, 8)],
            ),
            SendWr::new(12, WrOp::Write(remote(&p.b, 256)), &[p.a.mr.sge(0, 8)]),
        ])
        .unwrap();
    wait(&p.fabric, &mut p.a.cq, 2);
    wait(&p.fabric, &mut p.b.cq, 1);
    settle(&p.fabric);
    assert_cntr(&rcv, (2, 0));
    assert_cntr(&sc, (1, 0));
    // Receives flushed by the error state are error completions.
    p.b.qp
        .post_recv(&[RecvWr { wr_id: 3, sgl: &rs }, RecvWr { wr_id: 4, sgl: &rs }])
        .unwrap();
    p.b.qp.to_error().unwrap();
    let got = outcomes(&p.fabric, &mut p.b.cq);
    assert_eq!(
        got,
        vec![(3, WcStatus::WrFlushErr), (4, WcStatus::WrFlushErr)]
    );
    assert_cntr(&rcv, (2, 2));
}

/// CXI `rma/rem_cntr`: each WRITE bumps the target MR's counter exactly once, and only once
/// its data is in the target buffer.
#[test]
fn remote_mr_counter_moves_once_per_write_after_the_data_landed() {
    let mut p = pair_with(2, 1, 11);
    let rem = p.b.pd.create_counter().unwrap();
    rem.bind_mr(&p.b.mr, CntrEvents::REMOTE_WRITE).unwrap();
    let mut len = 1u32;
    let mut n = 0u64;
    while len <= 64 * 1024 {
        let fill = (n as u8).wrapping_mul(37).wrapping_add(1);
        p.a.buf.fill(0, len as usize, fill).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(
                n,
                WrOp::Write(remote(&p.b, 4096)),
                &[p.a.mr.sge(0, len)],
            )])
            .unwrap();
        while rem.get().0 == n {
            assert!(
                p.fabric.step(),
                "idle before the counter moved ({len} bytes)"
            );
        }
        assert_eq!(rem.get(), (n + 1, 0), "{len} bytes");
        let mut got = vec![0u8; len as usize];
        p.b.buf.read(4096, &mut got).unwrap();
        assert!(
            got.iter().all(|&b| b == fill),
            "{len} bytes: the counter moved before the data was visible"
        );
        let wc = wait(&p.fabric, &mut p.a.cq, 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (n, WcStatus::Success));
        n += 1;
        len *= 2;
    }
    settle(&p.fabric);
    assert_cntr(&rem, (n, 0));
}

/// CXI `atomic/rem_cntr` and the REMOTE_READ event: remote atomics count as remote writes
/// (target updated when the counter moves), READs as remote reads, on both the QP and the MR
/// bindings; failed accesses count nothing at the target.
#[test]
fn remote_counters_count_atomics_and_reads_and_only_successful_accesses() {
    let mut p = pair();
    let qw = p.b.pd.create_counter().unwrap();
    let qr = p.b.pd.create_counter().unwrap();
    let mw = p.b.pd.create_counter().unwrap();
    let mr_ = p.b.pd.create_counter().unwrap();
    qw.bind_qp(&p.b.qp, CntrEvents::REMOTE_WRITE).unwrap();
    qr.bind_qp(&p.b.qp, CntrEvents::REMOTE_READ).unwrap();
    mw.bind_mr(&p.b.mr, CntrEvents::REMOTE_WRITE).unwrap();
    mr_.bind_mr(&p.b.mr, CntrEvents::REMOTE_READ).unwrap();
    write_u64(&p.b.buf, 512, 100);
    let res = [p.a.mr.sge(0, 8)];
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::FetchAdd {
                remote: remote(&p.b, 512),
                add: 5,
            },
            &res,
        )])
        .unwrap();
    while mw.get().0 == 0 {
        assert!(p.fabric.step());
    }
    assert_eq!(read_u64(&p.b.buf, 512), 105, "target updated when counted");
    p.a.qp
        .post_send(&[
            SendWr::new(
                2,
                WrOp::CmpSwap {
                    remote: remote(&p.b, 512),
                    compare: 105,
                    swap: 1,
                },
                &res,
            ),
            SendWr::new(3, WrOp::Read(remote(&p.b, 0)), &[p.a.mr.sge(64, 64)]),
            SendWr::new(4, WrOp::Write(remote(&p.b, 1024)), &[p.a.mr.sge(64, 64)]),
        ])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert!(got.iter().all(|&(_, s)| s == WcStatus::Success), "{got:?}");
    assert_eq!(read_u64(&p.b.buf, 512), 1);
    assert_cntr(&qw, (3, 0));
    assert_cntr(&mw, (3, 0));
    assert_cntr(&qr, (1, 0));
    assert_cntr(&mr_, (1, 0));
    // A WRITE past the end of the MR is refused at the target: nothing counted there.
    p.a.qp
        .post_send(&[SendWr::new(
            5,
            WrOp::Write(remote(&p.b, BUF as u64 - 4)),
            &[p.a.mr.sge(0, 8)],
        )])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(got, vec![(5, WcStatus::RemAccessErr)]);
    // The same for a READ and an atomic past the end, each on a fresh QP pair.
    for op in [
        WrOp::Read(remote(&p.b, BUF as u64 - 4)),
        WrOp::FetchAdd {
            remote: remote(&p.b, BUF as u64),
            add: 1,
        },
    ] {
        let (mut qa, _qb) = extra_qps(&p);
        qa.post_send(&[SendWr::new(6, op, &[p.a.mr.sge(0, 8)])])
            .unwrap();
        let got = outcomes(&p.fabric, &mut p.a.cq);
        assert_eq!(got, vec![(6, WcStatus::RemAccessErr)], "{op:?}");
    }
    assert_cntr(&qw, (3, 0));
    assert_cntr(&mw, (3, 0));
    assert_cntr(&qr, (1, 0));
    assert_cntr(&mr_, (1, 0));
}

/// CXI `write_mr_overrun_cntr`: a failed WRITE adds exactly one to the initiator's WRITE
/// counter error value, and the work flushed behind it adds to the error values too.
#[test]
fn failed_and_flushed_work_counts_as_errors() {
    let mut p = pair();
    let wc = p.a.pd.create_counter().unwrap();
    let sc = p.a.pd.create_counter().unwrap();
    let rc = p.a.pd.create_counter().unwrap();
    wc.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    sc.bind_qp(&p.a.qp, CntrEvents::SEND).unwrap();
    rc.bind_qp(&p.a.qp, CntrEvents::READ).unwrap();
    let sge = [p.a.mr.sge(0, 8)];
    p.a.qp
        .post_send(&[SendWr::new(1, WrOp::Write(bad_remote(&p.b)), &sge)])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(got, vec![(1, WcStatus::RemAccessErr)]);
    assert_cntr(&wc, (0, 1));
    // Posted to the QP now in ERR: flushed, counted as errors (signaled or not).
    p.a.qp
        .post_send(&[
            SendWr::new(2, WrOp::Write(remote(&p.b, 0)), &sge).flags(SendFlags::empty()),
            SendWr::new(3, WrOp::Send, &sge),
            SendWr::new(4, WrOp::Write(remote(&p.b, 0)), &sge),
            SendWr::new(
                5,
                WrOp::FetchAdd {
                    remote: remote(&p.b, 0),
                    add: 1,
                },
                &sge,
            ),
        ])
        .unwrap();
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(
        got,
        vec![
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr),
            (4, WcStatus::WrFlushErr),
            (5, WcStatus::WrFlushErr)
        ]
    );
    assert_cntr(&wc, (0, 3));
    assert_cntr(&sc, (0, 1));
    assert_cntr(&rc, (0, 1));
}

// ---------------------------------------------------------------------------------------
// Counter waits (reference §2.4)
// ---------------------------------------------------------------------------------------

/// Success reaching the threshold after the call: `Reached`; already reached at entry: at
/// once, even with a zero timeout.
#[test]
fn wait_returns_reached() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    let sge = [p.a.mr.sge(0, 8)];
    let wr = SendWr::new(0, WrOp::Write(remote(&p.b, 0)), &sge).flags(SendFlags::empty());
    p.a.qp.post_send(&[wr, wr, wr]).unwrap();
    assert_eq!(c.wait(3, None).unwrap(), CounterWait::Reached(3));
    assert_eq!(c.wait(2, Some(0)).unwrap(), CounterWait::Reached(3));
    // Host adds count too.
    c.add(4);
    assert_eq!(c.wait(7, None).unwrap(), CounterWait::Reached(7));
    assert_cntr(&c, (7, 0));
}

/// CXI `cntr_wait_error_increment`: the error value changing while the success value is
/// below the threshold ends the wait with `ErrorChanged` (libfabric's `-FI_EAVAIL`).
#[test]
fn wait_returns_error_changed_when_the_error_value_moves_after_entry() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    c.add(2);
    // A long WRITE first, so the failure comes well after the wait is armed.
    p.a.qp
        .post_send(&[
            SendWr::new(
                1,
                WrOp::Write(remote(&p.b, 0)),
                &[p.a.mr.sge(0, 256 * 1024)],
            ),
            SendWr::new(2, WrOp::Write(bad_remote(&p.b)), &[p.a.mr.sge(0, 8)]),
        ])
        .unwrap();
    let t0 = p.a.dev.clock_ps();
    assert_eq!(
        c.wait(5, None).unwrap(),
        CounterWait::ErrorChanged {
            success: 3,
            error: 1
        }
    );
    assert!(p.a.dev.clock_ps() - t0 > 10_000_000);
    assert_cntr(&c, (3, 1));
    let got = outcomes(&p.fabric, &mut p.a.cq);
    assert_eq!(
        got,
        vec![(1, WcStatus::Success), (2, WcStatus::RemAccessErr)]
    );
}

/// Whatever the point at which the wait starts, an error change after it began ends it with
/// `ErrorChanged`: the wait is started after every prefix of the failing WRITE's events.
#[test]
fn wait_sees_an_error_change_that_lands_while_it_is_being_armed() {
    let mut k = 0;
    loop {
        let mut p = pair();
        let c = p.a.pd.create_counter().unwrap();
        c.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
        p.a.qp
            .post_send(&[SendWr::new(
                1,
                WrOp::Write(bad_remote(&p.b)),
                &[p.a.mr.sge(0, 8)],
            )])
            .unwrap();
        for _ in 0..k {
            assert!(p.fabric.step());
        }
        if c.read().1 != 0 {
            assert!(k > 3, "the sweep covered the failing WRITE's events");
            break;
        }
        assert_eq!(
            c.wait(1, None).unwrap(),
            CounterWait::ErrorChanged {
                success: 0,
                error: 1
            },
            "wait started after {k} events"
        );
        k += 1;
    }
}

/// CXI `cntr_wait_success_increment` with a non-zero error value at entry: an error that does
/// not change is no reason to end the wait (the snapshot is taken at entry).
#[test]
fn wait_ignores_an_error_value_already_non_zero_at_entry() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    c.set_error(4).unwrap();
    let sge = [p.a.mr.sge(0, 8)];
    let wr = SendWr::new(0, WrOp::Write(remote(&p.b, 0)), &sge).flags(SendFlags::empty());
    p.a.qp.post_send(&[wr, wr]).unwrap();
    assert_eq!(c.wait(2, None).unwrap(), CounterWait::Reached(2));
    assert_cntr(&c, (2, 4));
}

/// CXI `cntr_wait_timeout`, `cntr_wait_success_increment_timeout`: the timeout is device time;
/// with the device busy (a long WRITE on its way) the wait ends `TimedOut` about then, the
/// values unchanged; waiting again without a timeout sees the WRITE complete.
#[test]
fn wait_times_out_in_device_time_while_the_device_is_busy() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    c.set(2).unwrap();
    p.a.qp
        .post_send(&[SendWr::new(
            1,
            WrOp::Write(remote(&p.b, 0)),
            &[p.a.mr.sge(0, 512 * 1024)],
        )])
        .unwrap();
    let t0 = p.a.dev.clock_ps();
    assert_eq!(c.wait(3, Some(1_000_000)).unwrap(), CounterWait::TimedOut);
    let t1 = p.a.dev.clock_ps();
    assert!(
        (1_000_000..5_000_000).contains(&(t1 - t0)),
        "timed out after {} ps",
        t1 - t0
    );
    assert_eq!(c.read(), (2, 0));
    assert_eq!(c.wait(3, None).unwrap(), CounterWait::Reached(3));
    assert!(
        p.a.dev.clock_ps() - t0 > 10_000_000,
        "a 512 KiB WRITE takes a while"
    );
    assert_eq!(wait(&p.fabric, &mut p.a.cq, 1)[0].status, WcStatus::Success);
}

/// A wait the device can never satisfy ends with `DeviceIdle` once it has nothing left to
/// do, timeout or not.
#[test]
fn wait_on_an_idle_device_is_device_idle() {
    let p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.add(1);
    settle(&p.fabric);
    assert!(matches!(c.wait(2, None), Err(Error::DeviceIdle(_))));
    assert!(matches!(
        c.wait(2, Some(u64::MAX)),
        Err(Error::DeviceIdle(_))
    ));
    // And the counter still serves a later wait.
    c.add(1);
    assert_eq!(c.wait(2, None).unwrap(), CounterWait::Reached(2));
}

// ---------------------------------------------------------------------------------------
// Firing rule and release order (reference §6.6)
// ---------------------------------------------------------------------------------------

/// T1: thresholds 5, 3, 4 posted in that order, one add of 5: released 3, 4, 5 (the CQEs
/// of triggered WRITEs on one QP come back in the order they were sent). Each CQE carries
/// its operation's handle and `wr_id`.
#[test]
fn t1_one_update_passing_several_thresholds_fires_in_threshold_order() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let hs: Vec<(u64, TriggerHandle)> = [5, 3, 4]
        .iter()
        .map(|&t| (t, trig_write(&p, &c, t, t)))
        .collect();
    settle(&p.fabric);
    assert_eq!(info(&c).pending, 3);
    assert!(
        drain(&p.fabric, &mut p.a.cq).is_empty(),
        "nothing fired early"
    );
    c.add(5);
    let wc = drain(&p.fabric, &mut p.a.cq);
    let got: Vec<u64> = wc.iter().map(|w| w.wr_id).collect();
    assert_eq!(got, vec![3, 4, 5]);
    for w in &wc {
        assert_eq!(
            (w.status, w.opcode),
            (WcStatus::Success, WcOpcode::RdmaWrite)
        );
        assert_eq!(w.qpn, p.a.qp.qpn());
        let h = hs.iter().find(|(t, _)| *t == w.wr_id).unwrap().1;
        assert_eq!(w.trigger, Some(h));
    }
    assert_eq!(info(&c).pending, 0);
    assert_cntr(&c, (5, 0));
}

/// T2: equal thresholds fire in post order.
#[test]
fn t2_equal_thresholds_fire_in_post_order() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    for id in [11, 12, 13] {
        trig_write(&p, &c, 4, id);
    }
    c.add(3);
    assert!(fired(&mut p).is_empty());
    c.add(1);
    assert_eq!(fired(&mut p), vec![11, 12, 13]);
}

/// T3: 5A, 5B, 7C, 5D, add 7: A, B, D, C (a stable sort by threshold).
#[test]
fn t3_out_of_order_insert_behind_equal_thresholds_is_stable() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    for (t, id) in [(5, 1), (5, 2), (7, 3), (5, 4)] {
        trig_write(&p, &c, t, id);
    }
    c.add(7);
    assert_eq!(fired(&mut p), vec![1, 2, 4, 3]);
}

/// T4 and T5: an operation whose threshold is already met (or 0) fires when posted, before
/// operations posted after it; one not met waits.
#[test]
fn t4_t5_thresholds_already_met_fire_at_post() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    trig_write(&p, &c, 0, 1);
    assert_eq!(info(&c).pending, 0, "threshold 0 fires at once");
    c.set(10).unwrap();
    trig_write(&p, &c, 12, 2);
    trig_write(&p, &c, 7, 3);
    assert_eq!(info(&c).pending, 1, "@7 fired at post, @12 waits");
    trig_write(&p, &c, 7, 4);
    trig_write(&p, &c, 10, 5);
    assert_eq!(fired(&mut p), vec![1, 3, 4, 5]);
    c.add(2);
    assert_eq!(fired(&mut p), vec![2]);
    assert_cntr(&c, (12, 0));
}

/// T6: success 3 and error 2 meet threshold 5 by default (success + error), not with
/// `success_only`, which waits for the success value alone.
#[test]
fn t6_errors_count_towards_thresholds_unless_success_only() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.set(3).unwrap();
    c.set_error(2).unwrap();
    let so = TriggerOpts {
        signaled: true,
        success_only: true,
        ..Default::default()
    };
    trig_write_opts(&p, &c, 5, 1, so);
    trig_write(&p, &c, 5, 2);
    assert_eq!(fired(&mut p), vec![2]);
    assert_eq!(info(&c).pending, 1);
    c.add_error(10);
    assert!(
        fired(&mut p).is_empty(),
        "errors do not count with success_only"
    );
    c.add(1);
    assert!(fired(&mut p).is_empty());
    c.add(1);
    assert_eq!(fired(&mut p), vec![1]);
    assert_cntr(&c, (5, 12));
}

/// T7: a set that lowers the counter un-fires nothing; pending operations wait until the
/// value reaches their threshold again.
#[test]
fn t7_lowering_a_counter_keeps_pending_operations_pending() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.add(7);
    trig_write(&p, &c, 8, 1);
    trig_write(&p, &c, 6, 2);
    assert_eq!(fired(&mut p), vec![2]);
    c.set(2).unwrap();
    trig_write(&p, &c, 6, 3);
    assert_eq!(info(&c).pending, 2);
    c.add(3);
    assert!(fired(&mut p).is_empty(), "5 meets neither 6 nor 8");
    c.add(1);
    assert_eq!(fired(&mut p), vec![3]);
    c.add(1);
    assert!(fired(&mut p).is_empty());
    c.add(1);
    assert_eq!(fired(&mut p), vec![1]);
    // A lowering set by a triggered operation behaves the same.
    trig_write(&p, &c, 9, 4);
    c.post_triggered_set(8, &c, 1, 0).unwrap();
    assert_cntr(&c, (1, 0));
    c.add(7);
    assert!(fired(&mut p).is_empty());
    c.add(1);
    assert_eq!(fired(&mut p), vec![4]);
}

/// T8: a chain through a counter operation: op1 @ C1 >= 1 adds 1 to C2, op2 @ C2 >= 1 is a
/// SEND; the SEND goes only once op1 fired, and counts on its completion counter.
#[test]
fn t8_chain_through_a_counter_add_to_a_send() {
    let mut p = pair();
    let c1 = p.a.pd.create_counter().unwrap();
    let c2 = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    p.b.qp
        .post_recv(&[RecvWr {
            wr_id: 9,
            sgl: &[p.b.mr.sge(0, 64)],
        }])
        .unwrap();
    c1.post_triggered_add(1, &c2, 1, 0).unwrap();
    p.a.qp
        .post_triggered(
            &c2,
            1,
            &SendWr::inline(5, WrOp::Send, b"chained"),
            TriggerOpts {
                completion: Some(&comp),
                ..Default::default()
            },
        )
        .unwrap();
    settle(&p.fabric);
    assert!(drain(&p.fabric, &mut p.b.cq).is_empty(), "nothing sent yet");
    assert_cntr(&c2, (0, 0));
    assert_eq!(info(&c2).refs, 2, "target of op1, trigger of op2");
    c1.add(1);
    let r = wait(&p.fabric, &mut p.b.cq, 1);
    assert_eq!((r[0].wr_id, r[0].byte_len), (9, 7));
    let mut got = [0u8; 7];
    p.b.buf.read(0, &mut got).unwrap();
    assert_eq!(&got, b"chained");
    assert_eq!(comp.wait(1, None).unwrap(), CounterWait::Reached(1));
    settle(&p.fabric);
    assert_cntr(&c1, (1, 0));
    assert_cntr(&c2, (1, 0));
    assert_cntr(&comp, (1, 0));
    assert!(drain(&p.fabric, &mut p.a.cq).is_empty(), "not signaled");
    for c in [&c1, &c2, &comp] {
        assert_eq!((info(c).pending, info(c).refs), (0, 0));
    }
}

/// T9: a self-targeted counter operation (@ C >= 5 add 5 to C) raises C to 10 and releases
/// the operations @ 6..10 in threshold order, queued behind an operation @ 5 posted after it
/// (released by the same update, no recursion); @ 11 waits.
#[test]
fn t9_self_targeted_add_releases_the_next_thresholds_in_order() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    c.post_triggered_add(5, &c, 5, 0).unwrap();
    for t in [9, 6, 11, 10, 5, 8, 7] {
        trig_write(&p, &c, t, t);
    }
    assert_eq!(info(&c).refs, 9, "two for the self-add, one for each WRITE");
    c.add(5);
    assert_eq!(fired(&mut p), vec![5, 6, 7, 8, 9, 10]);
    assert_cntr(&c, (10, 0));
    assert_eq!((info(&c).pending, info(&c).refs), (1, 1));
    c.add(1);
    assert_eq!(fired(&mut p), vec![11]);
}

/// T10 and CXI `flush_work`: flushing mixed operations on two counters, per counter then
/// PD-wide, returns how many were flushed; raising the counters past every threshold then
/// fires nothing (no CQE, no data, no counter change); references go back to 0; another
/// PD's operations are untouched.
#[test]
fn t10_flush_mixed_operations_on_two_counters() {
    let mut p = pair();
    let c1 = p.a.pd.create_counter().unwrap();
    let c2 = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    let pd2 = p.a.dev.alloc_pd().unwrap();
    let other = pd2.create_counter().unwrap();
    let other_t = pd2.create_counter().unwrap();
    let with_comp = TriggerOpts {
        completion: Some(&comp),
        signaled: true,
        ..Default::default()
    };
    write_u64(&p.b.buf, 2048, 1000);
    p.a.buf.fill(0, 4096, 0xee).unwrap();
    let res = [p.a.mr.sge(3000, 8)];
    let sge = [p.a.mr.sge(0, 8)];
    // On c1: WRITEs, a SEND, a fetch-and-add, a set and an add of c2.
    trig_write_opts(&p, &c1, 5, 1, with_comp);
    trig_write_opts(&p, &c1, 6, 2, with_comp);
    let post =
        |c: &Counter, t: u64, wr: SendWr<'_>| p.a.qp.post_triggered(c, t, &wr, with_comp).unwrap();
    post(&c1, 8, SendWr::new(3, WrOp::Send, &sge));
    post(
        &c1,
        4,
        SendWr::new(
            4,
            WrOp::FetchAdd {
                remote: remote(&p.b, 2048),
                add: 1,
            },
            &res,
        ),
    );
    c1.post_triggered_set(7, &c2, 100, 0).unwrap();
    c1.post_triggered_add(3, &c2, 1, 0).unwrap();
    // On c2: a WRITE, a READ and an add of c1.
    trig_write_opts(&p, &c2, 2, 5, with_comp);
    post(
        &c2,
        3,
        SendWr::new(6, WrOp::Read(remote(&p.b, 0)), &[p.a.mr.sge(64, 8)]),
    );
    let h = c2.post_triggered_add(1, &c1, 50, 0).unwrap();
    // Another PD's operation.
    other.post_triggered_add(1, &other_t, 1, 0).unwrap();
    settle(&p.fabric);
    assert_eq!((info(&c1).pending, info(&c2).pending), (6, 3));
    assert_eq!(info(&comp).refs, 6);

    assert_eq!(p.a.pd.flush_triggered(Some(&c1)).unwrap(), 6);
    assert_eq!((info(&c1).pending, info(&c2).pending), (0, 3));
    assert_eq!(info(&c1).refs, 1, "still the target of c2's add");
    c1.add(100);
    settle(&p.fabric);
    assert_cntr(&c2, (0, 0));
    assert_eq!(p.a.pd.flush_triggered(None).unwrap(), 3);
    assert_eq!(p.a.pd.flush_triggered(None).unwrap(), 0);
    assert_eq!(status(p.a.dev.cancel_triggered(h)), CmdStatus::BadResource);
    c2.add(100);
    settle(&p.fabric);
    assert!(drain(&p.fabric, &mut p.a.cq).is_empty());
    assert!(drain(&p.fabric, &mut p.b.cq).is_empty());
    assert_cntr(&c1, (100, 0));
    assert_cntr(&c2, (100, 0));
    assert_cntr(&comp, (0, 0));
    for c in [&c1, &c2, &comp] {
        assert_eq!((info(c).pending, info(c).refs), (0, 0));
    }
    assert_eq!(
        read_u64(&p.b.buf, 2048),
        1000,
        "the fetch-and-add never ran"
    );
    assert_eq!(read_u64(&p.b.buf, 8), 0, "the WRITEs never ran");
    assert_eq!(read_u64(&p.a.buf, 3000), 0xeeee_eeee_eeee_eeee);
    assert_eq!(p.fabric.nic_stats(0).tx_frames, 0, "nothing was sent");
    // The other PD's operation is still there.
    assert_eq!(info(&other).pending, 1);
    assert_eq!(pd2.flush_triggered(None).unwrap(), 1);
    other.add(1);
    settle(&p.fabric);
    assert_cntr(&other_t, (0, 0));
    still_serving(&mut p);
}

/// T11 and CXI `enforce_limit_single_thread`: the table holds exactly `max_triggered`
/// operations; the next post is `Exhausted`; flushing, firing and cancelling each give the
/// slots back, so the table fills exactly again.
#[test]
fn t11_table_fills_to_max_triggered_and_every_way_out_frees_it() {
    let mut p = pair();
    let max = p.a.dev.caps().max_triggered;
    assert_eq!(max, 2048);
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    let opts = TriggerOpts {
        completion: Some(&comp),
        ..Default::default()
    };
    let fill = |p: &Pair, thr: u64| {
        for i in 0..max as u64 {
            if i % 2 == 0 {
                c.post_triggered_add(thr, &t, 1, 0).unwrap();
            } else {
                trig_write_opts(p, &c, thr, i % 1000, opts);
            }
        }
        let full = c.post_triggered_add(thr, &t, 1, 0);
        assert_eq!(
            status_of(full, CmdOpcode::PostTriggered),
            CmdStatus::Exhausted
        );
        let sge = [p.a.mr.sge(0, 8)];
        let full =
            p.a.qp
                .post_triggered(&c, 0, &SendWr::new(1, WrOp::Send, &sge), opts);
        assert_eq!(
            status_of(full, CmdOpcode::PostTriggered),
            CmdStatus::Exhausted
        );
        let q = info(&c);
        assert_eq!((q.pending, q.refs), (max, max));
        assert_eq!(info(&t).refs, max / 2);
        assert_eq!(info(&comp).refs, max / 2);
    };
    // Filled, flushed.
    fill(&p, 1_000_000);
    assert_eq!(p.a.pd.flush_triggered(None).unwrap(), max);
    for x in [&c, &t, &comp] {
        assert_eq!((info(x).pending, info(x).refs), (0, 0));
    }
    // Filled again, all fired.
    fill(&p, 10);
    c.add(10);
    assert!(drain(&p.fabric, &mut p.a.cq).is_empty(), "none signaled");
    assert_cntr(&t, (max as u64 / 2, 0));
    assert_cntr(&comp, (max as u64 / 2, 0));
    for x in [&c, &t, &comp] {
        assert_eq!((info(x).pending, info(x).refs), (0, 0));
    }
    // Filled again; one cancelled makes room for exactly one.
    fill(&p, 1_000_000);
    let h = c.post_triggered_add(1_000_000, &t, 1, 0);
    assert!(h.is_err());
    p.a.pd.flush_triggered(None).unwrap();
    for _ in 0..max - 1 {
        c.post_triggered_add(1_000_000, &t, 1, 0).unwrap();
    }
    let h = c.post_triggered_add(1_000_000, &t, 1, 0).unwrap();
    assert!(c.post_triggered_add(1_000_000, &t, 1, 0).is_err());
    p.a.dev.cancel_triggered(h).unwrap();
    c.post_triggered_add(1_000_000, &t, 1, 0).unwrap();
    assert_eq!(
        status(c.post_triggered_add(1_000_000, &t, 1, 0)),
        CmdStatus::Exhausted
    );
    assert_eq!(p.a.pd.flush_triggered(Some(&c)).unwrap(), max);
    assert_eq!((info(&c).pending, info(&c).refs), (0, 0));
    still_serving(&mut p);
}

/// T12: a triggered WRITE with an invalid rkey: its completion counter's error value moves
/// by one and an error CQE is written though it was not signaled; an operation waiting on the
/// completion counter fires by default (success + error) but not with `success_only`. A
/// triggered WRITE fired behind it on the same QP is flushed: error CQE, error count.
#[test]
fn t12_failed_triggered_write_counts_an_error_and_releases_only_sum_dependents() {
    let mut p = pair();
    let (qa2, _qb2) = extra_qps(&p);
    let t = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    // The QP's own WRITE counter counts neither the failure nor the flush.
    let own = p.a.pd.create_counter().unwrap();
    own.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    let sge = [p.a.mr.sge(0, 8)];
    let bad =
        p.a.qp
            .post_triggered(
                &t,
                1,
                &SendWr::new(1, WrOp::Write(bad_remote(&p.b)), &sge),
                TriggerOpts {
                    completion: Some(&comp),
                    ..Default::default()
                },
            )
            .unwrap();
    let behind = trig_write_opts(
        &p,
        &t,
        1,
        2,
        TriggerOpts {
            completion: Some(&comp),
            ..Default::default()
        },
    );
    let dep = |id: u64, success_only: bool| {
        qa2.post_triggered(
            &comp,
            1,
            &SendWr::new(id, WrOp::Write(remote(&p.b, id * 8)), &sge),
            TriggerOpts {
                signaled: true,
                success_only,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let d_sum = dep(3, false);
    let d_so = dep(4, true);
    p.a.buf.write(0, b"dep-data").unwrap();
    t.add(1);
    let wc = drain(&p.fabric, &mut p.a.cq);
    let got: Vec<_> = wc
        .iter()
        .map(|w| (w.wr_id, w.status, w.trigger, w.qpn))
        .collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::RemAccessErr, Some(bad), p.a.qp.qpn()),
            (2, WcStatus::WrFlushErr, Some(behind), p.a.qp.qpn()),
            (3, WcStatus::Success, Some(d_sum), qa2.qpn()),
        ]
    );
    assert_cntr(&comp, (0, 2));
    assert_cntr(&own, (0, 0));
    let mut got = [0u8; 8];
    p.b.buf.read(24, &mut got).unwrap();
    assert_eq!(&got, b"dep-data");
    assert_eq!(info(&comp).pending, 1, "the success-only dependent waits");
    comp.add(1);
    let wc = drain(&p.fabric, &mut p.a.cq);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].trigger),
        (4, WcStatus::Success, Some(d_so))
    );
}

/// T15: a triggered transfer reads its buffers when it fires, not when it is posted.
#[test]
fn t15_buffers_are_read_when_the_operation_fires() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    p.a.buf.write(0, b"posted contents!").unwrap();
    let sge = [p.a.mr.sge(0, 16)];
    p.a.qp
        .post_triggered(
            &c,
            1,
            &SendWr::new(1, WrOp::Write(remote(&p.b, 100)), &sge),
            TriggerOpts {
                signaled: true,
                ..Default::default()
            },
        )
        .unwrap();
    settle(&p.fabric);
    p.a.buf.write(0, b"changed contents").unwrap();
    c.add(1);
    assert_eq!(fired(&mut p), vec![1]);
    let mut got = [0u8; 16];
    p.b.buf.read(100, &mut got).unwrap();
    assert_eq!(&got, b"changed contents");
}

// ---------------------------------------------------------------------------------------
// libfabric deferred work (CXI deferred_work.c, fabtests fi_rdm_deferred_wq)
// ---------------------------------------------------------------------------------------

/// `rma_write`, `rma_write_no_event`: trigger = the QP's bound WRITE counter, completion =
/// its bound READ counter. The WRITE counter stays at the threshold (the triggered WRITE does
/// not count on it), the completion counter reads 1, a CQE only with `signaled`.
#[test]
fn deferred_rma_write_with_and_without_completion_event() {
    for signaled in [true, false] {
        let mut p = pair();
        let wcnt = p.a.pd.create_counter().unwrap();
        let rcnt = p.a.pd.create_counter().unwrap();
        wcnt.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
        rcnt.bind_qp(&p.a.qp, CntrEvents::READ).unwrap();
        let data: Vec<u8> = (0..12345u32).map(|i| (i * 13 % 251) as u8).collect();
        p.a.buf.write(0, &data).unwrap();
        let sge = [p.a.mr.sge(0, 12345)];
        let h =
            p.a.qp
                .post_triggered(
                    &wcnt,
                    54321,
                    &SendWr::new(0x77, WrOp::Write(remote(&p.b, 8192)), &sge),
                    TriggerOpts {
                        completion: Some(&rcnt),
                        signaled,
                        ..Default::default()
                    },
                )
                .unwrap();
        settle(&p.fabric);
        assert!(drain(&p.fabric, &mut p.a.cq).is_empty());
        wcnt.add_wide(54321, 0).unwrap();
        assert_eq!(rcnt.wait(1, None).unwrap(), CounterWait::Reached(1));
        let wc = drain(&p.fabric, &mut p.a.cq);
        if signaled {
            assert_eq!(wc.len(), 1);
            assert_eq!(
                (wc[0].wr_id, wc[0].status, wc[0].opcode, wc[0].trigger),
                (0x77, WcStatus::Success, WcOpcode::RdmaWrite, Some(h))
            );
        } else {
            assert!(wc.is_empty(), "{wc:?}");
        }
        assert_cntr(&wcnt, (54321, 0));
        assert_cntr(&rcnt, (1, 0));
        let mut got = vec![0u8; 12345];
        p.b.buf.read(8192, &mut got).unwrap();
        assert_eq!(got, data);
    }
}

/// `rma_read`, `rma_read_no_event`: a triggered READ counts once on its completion counter
/// (the QP's READ counter), not a second time as the QP's own READ.
#[test]
fn deferred_rma_read_with_and_without_completion_event() {
    for signaled in [true, false] {
        let mut p = pair();
        let wcnt = p.a.pd.create_counter().unwrap();
        let rcnt = p.a.pd.create_counter().unwrap();
        wcnt.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
        rcnt.bind_qp(&p.a.qp, CntrEvents::READ).unwrap();
        let data: Vec<u8> = (0..12345u32).map(|i| (i * 7 % 253) as u8).collect();
        p.b.buf.write(8192, &data).unwrap();
        let sge = [p.a.mr.sge(4096, 12345)];
        let h =
            p.a.qp
                .post_triggered(
                    &wcnt,
                    54321,
                    &SendWr::new(0x78, WrOp::Read(remote(&p.b, 8192)), &sge),
                    TriggerOpts {
                        completion: Some(&rcnt),
                        signaled,
                        ..Default::default()
                    },
                )
                .unwrap();
        wcnt.add_wide(54320, 0).unwrap();
        settle(&p.fabric);
        assert_cntr(&rcnt, (0, 0));
        wcnt.add(1);
        let wc = drain(&p.fabric, &mut p.a.cq);
        if signaled {
            assert_eq!(
                wc.iter()
                    .map(|w| (w.wr_id, w.status, w.opcode, w.trigger))
                    .collect::<Vec<_>>(),
                vec![(0x78, WcStatus::Success, WcOpcode::RdmaRead, Some(h))]
            );
        } else {
            assert!(wc.is_empty(), "{wc:?}");
        }
        assert_cntr(&wcnt, (54321, 0));
        assert_cntr(&rcnt, (1, 0));
        let mut got = vec![0u8; 12345];
        p.a.buf.read(4096, &mut got).unwrap();
        assert_eq!(got, data);
    }
}

/// `fetch_amo_event`, `compare_amo_event` (and `_no_event`): a triggered fetch-and-add and
/// compare-and-swap update the target and return the old value; the remote MR's counter sees
/// both; each counts 1 on its completion counter.
#[test]
fn deferred_fetch_add_and_compare_swap() {
    const INIT: u64 = 0x7FFF_FFFF_FFFF_FFFF;
    for signaled in [true, false] {
        let mut p = pair();
        let trig = p.a.pd.create_counter().unwrap();
        let comp = p.a.pd.create_counter().unwrap();
        let rem = p.b.pd.create_counter().unwrap();
        rem.bind_mr(&p.b.mr, CntrEvents::REMOTE_WRITE).unwrap();
        write_u64(&p.b.buf, 64, INIT);
        let opts = TriggerOpts {
            completion: Some(&comp),
            signaled,
            ..Default::default()
        };
        let fa = [p.a.mr.sge(0, 8)];
        let cs = [p.a.mr.sge(8, 8)];
        let h1 =
            p.a.qp
                .post_triggered(
                    &trig,
                    12345,
                    &SendWr::new(
                        1,
                        WrOp::FetchAdd {
                            remote: remote(&p.b, 64),
                            add: 1,
                        },
                        &fa,
                    ),
                    opts,
                )
                .unwrap();
        let h2 =
            p.a.qp
                .post_triggered(
                    &comp,
                    1,
                    &SendWr::new(
                        2,
                        WrOp::CmpSwap {
                            remote: remote(&p.b, 64),
                            compare: INIT + 1,
                            swap: 1,
                        },
                        &cs,
                    ),
                    opts,
                )
                .unwrap();
        trig.add(12345);
        settle(&p.fabric);
        let wc = drain(&p.fabric, &mut p.a.cq);
        let got: Vec<_> = wc
            .iter()
            .map(|w| (w.wr_id, w.status, w.opcode, w.trigger))
            .collect();
        if signaled {
            assert_eq!(
                got,
                vec![
                    (1, WcStatus::Success, WcOpcode::FetchAdd, Some(h1)),
                    (2, WcStatus::Success, WcOpcode::CompSwap, Some(h2))
                ]
            );
        } else {
            assert!(got.is_empty(), "{got:?}");
        }
        assert_eq!(read_u64(&p.a.buf, 0), INIT, "fetched");
        assert_eq!(read_u64(&p.a.buf, 8), INIT + 1, "compared");
        assert_eq!(read_u64(&p.b.buf, 64), 1, "swapped");
        assert_cntr(&trig, (12345, 0));
        assert_cntr(&comp, (2, 0));
        assert_cntr(&rem, (2, 0));
    }
}

/// Atomics with `operand`: the add or swap operand is read from local memory when the
/// operation fires, not taken from the work request or from memory at post time.
#[test]
fn deferred_atomics_read_their_operand_from_memory_at_fire_time() {
    let mut p = pair();
    let trig = p.a.pd.create_counter().unwrap();
    write_u64(&p.b.buf, 64, 1000);
    write_u64(&p.a.buf, 256, 1);
    write_u64(&p.a.buf, 264, 2);
    let res = [p.a.mr.sge(0, 8)];
    let res2 = [p.a.mr.sge(8, 8)];
    let opts = |off: u64| TriggerOpts {
        signaled: true,
        operand: Some(p.a.mr.sge(off, 8)),
        ..Default::default()
    };
    p.a.qp
        .post_triggered(
            &trig,
            1,
            &SendWr::new(
                1,
                WrOp::FetchAdd {
                    remote: remote(&p.b, 64),
                    add: 5,
                },
                &res,
            ),
            opts(256),
        )
        .unwrap();
    p.a.qp
        .post_triggered(
            &trig,
            2,
            &SendWr::new(
                2,
                WrOp::CmpSwap {
                    remote: remote(&p.b, 64),
                    compare: 1040,
                    swap: 3,
                },
                &res2,
            ),
            opts(264),
        )
        .unwrap();
    settle(&p.fabric);
    write_u64(&p.a.buf, 256, 40);
    write_u64(&p.a.buf, 264, 0xabcdef);
    trig.add(2);
    assert_eq!(fired(&mut p), vec![1, 2]);
    assert_eq!(read_u64(&p.a.buf, 0), 1000);
    assert_eq!(read_u64(&p.a.buf, 8), 1040);
    assert_eq!(read_u64(&p.b.buf, 64), 0xabcdef);
}

/// `cntr_add`, `cntr_set`: target preset to 1; add (or set) 123456 @ trigger >= 1234; the
/// trigger reads exactly 1234 afterwards, the target 123457 (or 123456).
#[test]
fn deferred_counter_add_and_set() {
    for set in [false, true] {
        let p = pair();
        let trig = p.a.pd.create_counter().unwrap();
        let target = p.a.pd.create_counter().unwrap();
        target.add(1);
        if set {
            trig.post_triggered_set(1234, &target, 123456, 0).unwrap();
        } else {
            trig.post_triggered_add(1234, &target, 123456, 0).unwrap();
        }
        trig.add(1233);
        settle(&p.fabric);
        assert_cntr(&target, (1, 0));
        trig.add(1);
        settle(&p.fabric);
        assert_cntr(&trig, (1234, 0));
        assert_cntr(&target, (if set { 123456 } else { 123457 }, 0));
        // Error values are set and added the same way.
        trig.post_triggered_add(0, &target, 0, 7).unwrap();
        trig.post_triggered_set(0, &target, 5, 9).unwrap();
        trig.post_triggered_add(0, &target, 1, 1).unwrap();
        assert_cntr(&target, (6, 10));
    }
}

/// fabtests `fi_rdm_deferred_wq`: a set to 5 and an add of 5 at the same threshold give 10
/// (posted the other way round, 5).
#[test]
fn deferred_wq_set_then_add_at_the_same_threshold() {
    let p = pair();
    let trig = p.a.pd.create_counter().unwrap();
    let x = p.a.pd.create_counter().unwrap();
    let y = p.a.pd.create_counter().unwrap();
    x.add(3);
    y.add(3);
    trig.post_triggered_set(3, &x, 5, 0).unwrap();
    trig.post_triggered_add(3, &x, 5, 0).unwrap();
    trig.post_triggered_add(3, &y, 5, 0).unwrap();
    trig.post_triggered_set(3, &y, 5, 0).unwrap();
    trig.add(3);
    settle(&p.fabric);
    assert_cntr(&x, (10, 0));
    assert_cntr(&y, (5, 0));
}

/// `eager_message_comp_event`, `_no_event`: a triggered SEND lands in a posted receive only
/// after the trigger; the send side writes a CQE only when signaled; the completion counter
/// (here also the trigger) reads threshold + 1.
#[test]
fn deferred_send_into_a_posted_receive() {
    for signaled in [true, false] {
        let mut p = pair();
        let c = p.a.pd.create_counter().unwrap();
        c.bind_qp(&p.a.qp, CntrEvents::SEND).unwrap();
        p.b.qp
            .post_recv(&[RecvWr {
                wr_id: 31,
                sgl: &[p.b.mr.sge(0, 2048)],
            }])
            .unwrap();
        let data: Vec<u8> = (0..1024u32).map(|i| (i % 200) as u8).collect();
        p.a.buf.write(0, &data).unwrap();
        let sge = [p.a.mr.sge(0, 1024)];
        p.a.qp
            .post_triggered(
                &c,
                1000,
                &SendWr::new(30, WrOp::Send, &sge),
                TriggerOpts {
                    completion: Some(&c),
                    signaled,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(info(&c).refs, 3, "binding, trigger, completion");
        c.add(999);
        settle(&p.fabric);
        assert!(drain(&p.fabric, &mut p.b.cq).is_empty(), "no receive yet");
        c.add(1);
        let r = wait(&p.fabric, &mut p.b.cq, 1);
        assert_eq!(
            (r[0].wr_id, r[0].status, r[0].byte_len),
            (31, WcStatus::Success, 1024)
        );
        let mut got = vec![0u8; 1024];
        p.b.buf.read(0, &mut got).unwrap();
        assert_eq!(got, data);
        let s = drain(&p.fabric, &mut p.a.cq);
        assert_eq!(s.len(), signaled as usize, "{s:?}");
        if signaled {
            assert_eq!((s[0].wr_id, s[0].opcode), (30, WcOpcode::Send));
        }
        assert_cntr(&c, (1001, 0));
        assert_eq!(info(&c).refs, 1);
    }
}

/// A pending triggered transfer whose QP is destroyed is dropped with it: the references it
/// held go, nothing fires or counts when the trigger is raised, and the counters can be
/// destroyed.
#[test]
fn pending_transfer_on_a_destroyed_qp_is_dropped() {
    let mut p = pair();
    let (qa2, qb2) = extra_qps(&p);
    let trig = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    let sge = [p.a.mr.sge(0, 8)];
    let h = qa2
        .post_triggered(
            &trig,
            5,
            &SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sge),
            TriggerOpts {
                completion: Some(&comp),
                signaled: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((info(&trig).pending, info(&trig).refs), (1, 1));
    assert_eq!(info(&comp).refs, 1);
    drop(qa2);
    drop(qb2);
    assert_eq!((info(&trig).pending, info(&trig).refs), (0, 0));
    assert_eq!(info(&comp).refs, 0);
    assert_eq!(status(p.a.dev.cancel_triggered(h)), CmdStatus::BadResource);
    trig.add(5);
    assert!(drain(&p.fabric, &mut p.a.cq).is_empty());
    assert_cntr(&comp, (0, 0));
    assert_eq!(p.fabric.nic_stats(0).tx_frames, 0);
    // Nothing holds the counters: they are destroyed with their handles.
    let nums = [trig.num(), comp.num()];
    drop((trig, comp));
    for n in nums {
        let q = raw(
            &p.a.dev,
            CmdOpcode::QueryCntr,
            ObjectIn { num: n.into() }.as_bytes(),
        );
        assert_eq!(status(q), CmdStatus::BadResource);
    }
    still_serving(&mut p);
}

/// A cancelled operation never fires; cancelling it again, or one that fired, is
/// `BadResource`.
#[test]
fn cancel_before_and_after_firing() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    let w = trig_write(&p, &c, 2, 1);
    let a = c.post_triggered_add(2, &t, 1, 0).unwrap();
    let kept = trig_write(&p, &c, 2, 2);
    let early = trig_write(&p, &c, 1, 3);
    assert_ne!(w, a);
    p.a.dev.cancel_triggered(w).unwrap();
    p.a.dev.cancel_triggered(a).unwrap();
    assert_eq!(status(p.a.dev.cancel_triggered(w)), CmdStatus::BadResource);
    assert_eq!(
        status_of(p.a.dev.cancel_triggered(a), CmdOpcode::CancelTriggered),
        CmdStatus::BadResource
    );
    assert_eq!((info(&c).pending, info(&t).refs), (2, 0));
    c.add(1);
    assert_eq!(fired(&mut p), vec![3]);
    assert_eq!(
        status(p.a.dev.cancel_triggered(early)),
        CmdStatus::BadResource
    );
    c.add(1);
    assert_eq!(fired(&mut p), vec![2]);
    assert_eq!(
        status(p.a.dev.cancel_triggered(kept)),
        CmdStatus::BadResource
    );
    assert_cntr(&t, (0, 0));
    assert_eq!(read_u64(&p.b.buf, 8), 0, "the cancelled WRITE never ran");
    assert_eq!(
        status(p.a.dev.cancel_triggered(TriggerHandle(0))),
        CmdStatus::BadResource
    );
    assert_eq!(
        status(p.a.dev.cancel_triggered(TriggerHandle(0xdead_beef))),
        CmdStatus::BadResource
    );
    still_serving(&mut p);
}

// ---------------------------------------------------------------------------------------
// Bad input: each refused with its exact status; the device keeps serving
// ---------------------------------------------------------------------------------------

/// Counter number 999 (and 0) names no counter: every command naming it is `BadResource`,
/// as is a PD, QP or MR that does not exist.
#[test]
fn nonexistent_objects_are_bad_resource() {
    let mut p = pair();
    let dev = p.a.dev.clone();
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    for n in [999u32, 0] {
        let obj = ObjectIn { num: n.into() };
        for op in [
            CmdOpcode::QueryCntr,
            CmdOpcode::DestroyCntr,
            CmdOpcode::CancelTriggered,
        ] {
            assert_eq!(
                status_of(raw(&dev, op, obj.as_bytes()), op),
                CmdStatus::BadResource,
                "{op:?} {n}"
            );
        }
        let u = UpdateCntrIn {
            cntr: n.into(),
            success: 1.into(),
            ..Default::default()
        };
        assert_eq!(
            status(raw(&dev, CmdOpcode::UpdateCntr, u.as_bytes())),
            CmdStatus::BadResource
        );
        let a = ArmCntrIn {
            cntr: n.into(),
            threshold: 1.into(),
            ..Default::default()
        };
        assert_eq!(
            status(raw(&dev, CmdOpcode::ArmCntr, a.as_bytes())),
            CmdStatus::BadResource
        );
        let b = BindCntrIn {
            cntr: n.into(),
            kind: CNTR_BIND_QP,
            obj: p.a.qp.qpn().into(),
            events: CntrEvents::WRITE.bits().into(),
            ..Default::default()
        };
        assert_eq!(
            status(raw(&dev, CmdOpcode::BindCntr, b.as_bytes())),
            CmdStatus::BadResource
        );
        let f = FlushTriggeredIn {
            pdn: p.a.pd.pdn().into(),
            cntr: if n == 0 { 0 } else { n }.into(),
        };
        if n != 0 {
            assert_eq!(
                status(raw(&dev, CmdOpcode::FlushTriggered, f.as_bytes())),
                CmdStatus::BadResource
            );
        }
        // As the trigger, the completion counter or the target of a triggered operation.
        let mut w = raw_wqe_op(&p, &c, 1, &raw_write_wqe(&p));
        w.trig_cntr = n.into();
        assert_eq!(
            status_of(raw_post(&dev, &w), CmdOpcode::PostTriggered),
            CmdStatus::BadResource
        );
        if n != 0 {
            let mut w = raw_wqe_op(&p, &c, 1, &raw_write_wqe(&p));
            w.comp_cntr = n.into();
            assert_eq!(status(raw_post(&dev, &w)), CmdStatus::BadResource);
        }
        for kind in [TrigKind::CntrAdd, TrigKind::CntrSet] {
            let o = raw_cntr_op(&c, 1, kind, TrigFlags::empty(), n, (1, 0));
            assert_eq!(status(raw_post(&dev, &o)), CmdStatus::BadResource);
        }
    }
    // A triggered transfer on a QP that does not exist; a bind to a QP or MR that does not
    // exist; a counter in a PD that does not exist; a flush of a PD that does not exist.
    let mut w = raw_wqe_op(&p, &c, 1, &raw_write_wqe(&p));
    w.target = 999.into();
    assert_eq!(status(raw_post(&dev, &w)), CmdStatus::BadResource);
    for (kind, obj) in [(CNTR_BIND_QP, 999u32), (CNTR_BIND_MR, 0x00ff_ff00)] {
        let b = BindCntrIn {
            cntr: c.num().into(),
            kind,
            obj: obj.into(),
            events: CntrEvents::REMOTE_WRITE.bits().into(),
            ..Default::default()
        };
        assert_eq!(
            status(raw(&dev, CmdOpcode::BindCntr, b.as_bytes())),
            CmdStatus::BadResource
        );
    }
    let wb = dev.alloc_dma(16).unwrap();
    let cr = CreateCntrIn {
        pdn: 999.into(),
        flags: 0.into(),
        wb_iova: wb.iova().into(),
    };
    assert_eq!(
        status(raw(&dev, CmdOpcode::CreateCntr, cr.as_bytes())),
        CmdStatus::BadResource
    );
    let f = FlushTriggeredIn {
        pdn: 999.into(),
        cntr: 0.into(),
    };
    assert_eq!(
        status(raw(&dev, CmdOpcode::FlushTriggered, f.as_bytes())),
        CmdStatus::BadResource
    );
    // Nothing was created or changed by any of it.
    for x in [&c, &t] {
        assert_cntr(x, (0, 0));
        assert_eq!((info(x).pending, info(x).refs), (0, 0));
    }
    still_serving(&mut p);
}

/// A triggered transfer on a QP in ERR or RESET is `BadState`; in RTS it is accepted.
#[test]
fn triggered_transfer_on_a_qp_in_err_or_reset_is_bad_state() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let sge = [p.a.mr.sge(0, 8)];
    let wr = SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sge);
    let fresh = p.a.pd.create_qp(&QpInit::new(&p.a.cq, &p.a.cq)).unwrap();
    assert_eq!(fresh.state(), QpState::Reset);
    assert_eq!(
        status_of(
            fresh.post_triggered(&c, 1, &wr, TriggerOpts::default()),
            CmdOpcode::PostTriggered
        ),
        CmdStatus::BadState
    );
    let (mut qa2, _qb2) = extra_qps(&p);
    qa2.post_triggered(&c, 1, &wr, TriggerOpts::default())
        .unwrap();
    assert_eq!(p.a.pd.flush_triggered(Some(&c)).unwrap(), 1);
    qa2.to_error().unwrap();
    assert_eq!(
        status(qa2.post_triggered(&c, 1, &wr, TriggerOpts::default())),
        CmdStatus::BadState
    );
    // A QP the device moved to ERR (a failed WRITE) refuses them too.
    p.a.qp
        .post_send(&[SendWr::new(2, WrOp::Write(bad_remote(&p.b)), &sge)])
        .unwrap();
    assert_eq!(
        outcomes(&p.fabric, &mut p.a.cq),
        vec![(2, WcStatus::RemAccessErr)]
    );
    assert_eq!(
        status(p.a.qp.post_triggered(&c, 0, &wr, TriggerOpts::default())),
        CmdStatus::BadState
    );
    assert_eq!((info(&c).pending, info(&c).refs), (0, 0));
    still_serving(&mut p);
}

/// Objects of different PDs: binding a counter to another PD's QP or MR, a triggered
/// operation whose trigger, completion counter, target counter or QP are of different PDs,
/// a flush naming another PD's counter: `BadPd`.
#[test]
fn mixing_protection_domains_is_bad_pd() {
    let mut p = pair();
    let pd2 = p.a.dev.alloc_pd().unwrap();
    let c = p.a.pd.create_counter().unwrap();
    let c2 = pd2.create_counter().unwrap();
    let mr2 = pd2
        .reg_mr(&p.a.buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    assert_eq!(
        status_of(c2.bind_qp(&p.a.qp, CntrEvents::WRITE), CmdOpcode::BindCntr),
        CmdStatus::BadPd
    );
    assert_eq!(
        status(c.bind_mr(&mr2, CntrEvents::REMOTE_WRITE)),
        CmdStatus::BadPd
    );
    assert_eq!(
        status(c2.bind_mr(&p.a.mr, CntrEvents::REMOTE_WRITE)),
        CmdStatus::BadPd
    );
    let sge = [p.a.mr.sge(0, 8)];
    let wr = SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sge);
    // Trigger of another PD than the QP.
    assert_eq!(
        status_of(
            p.a.qp.post_triggered(&c2, 1, &wr, TriggerOpts::default()),
            CmdOpcode::PostTriggered
        ),
        CmdStatus::BadPd
    );
    // Completion counter of another PD.
    assert_eq!(
        status(p.a.qp.post_triggered(
            &c,
            1,
            &wr,
            TriggerOpts {
                completion: Some(&c2),
                ..Default::default()
            }
        )),
        CmdStatus::BadPd
    );
    // Counter operations across PDs, both ways.
    assert_eq!(status(c.post_triggered_add(1, &c2, 1, 0)), CmdStatus::BadPd);
    assert_eq!(status(c2.post_triggered_set(1, &c, 1, 0)), CmdStatus::BadPd);
    // A flush of PD 1 naming PD 2's counter.
    assert_eq!(
        status_of(p.a.pd.flush_triggered(Some(&c2)), CmdOpcode::FlushTriggered),
        CmdStatus::BadPd
    );
    for x in [&c, &c2] {
        assert_eq!((info(x).pending, info(x).refs), (0, 0));
    }
    // Another device's objects never reach a device.
    let cb = p.b.pd.create_counter().unwrap();
    assert!(matches!(
        cb.bind_qp(&p.a.qp, CntrEvents::WRITE),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.a.qp.post_triggered(&cb, 1, &wr, TriggerOpts::default()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        c.post_triggered_add(1, &cb, 1, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.a.pd.flush_triggered(Some(&cb)),
        Err(Error::InvalidArgument(_))
    ));
    // Unbinding goes by number: another device's QP or MR (here with the same numbers as
    // A's) must not reach this device and undo A's bindings.
    c.bind_qp(&p.a.qp, CntrEvents::WRITE).unwrap();
    c.bind_mr(&p.a.mr, CntrEvents::REMOTE_WRITE).unwrap();
    assert_eq!(p.b.qp.qpn(), p.a.qp.qpn());
    assert_eq!(p.b.mr.lkey(), p.a.mr.lkey());
    assert!(matches!(
        c.unbind_qp(&p.b.qp, CntrEvents::WRITE),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        c.unbind_mr(&p.b.mr, CntrEvents::REMOTE_WRITE),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(info(&c).refs, 2, "A's bindings are intact");
    drop(mr2);
    still_serving(&mut p);
}

/// Bad kinds, flags and bodies: `BadParam`. Unknown kind or flag bits; a counter operation
/// with a completion counter or the COMPLETION / OPERAND_FROM_MEM flags; a WQE that does not
/// decode; an operand for a non-atomic or at a misaligned address; bad bind kinds, flags and
/// event sets; an MR bind of events the MR cannot see; unknown UPDATE_CNTR or CREATE_CNTR
/// flags and a misaligned writeback.
#[test]
fn malformed_counter_and_triggered_commands_are_bad_param() {
    let mut p = pair();
    let dev = p.a.dev.clone();
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    let good = raw_wqe_op(&p, &c, 1_000, &raw_write_wqe(&p));
    let post = |t: &PostTriggeredIn| status_of(raw_post(&dev, t), CmdOpcode::PostTriggered);
    // Sanity: the raw WQE itself is accepted (and flushed again).
    raw_post(&dev, &good).unwrap();
    assert_eq!(p.a.pd.flush_triggered(None).unwrap(), 1);
    let mut bad = Vec::new();
    bad.push(PostTriggeredIn { kind: 3, ..good });
    bad.push(PostTriggeredIn {
        flags: 0x80,
        ..good
    });
    bad.push(PostTriggeredIn {
        flags: TrigFlags::OPERAND_FROM_MEM.bits(),
        operand_addr: p.a.mr.addr().into(),
        operand_lkey: p.a.mr.lkey().into(),
        ..good
    });
    let mut op_only = raw_cntr_op(
        &c,
        1,
        TrigKind::CntrAdd,
        TrigFlags::empty(),
        t.num(),
        (1, 0),
    );
    op_only.comp_cntr = t.num().into();
    bad.push(op_only);
    for f in [TrigFlags::COMPLETION, TrigFlags::OPERAND_FROM_MEM] {
        bad.push(raw_cntr_op(&c, 1, TrigKind::CntrSet, f, t.num(), (1, 0)));
    }
    // WQEs that do not decode: all zero (no segments), an unknown opcode, a WRITE without
    // its remote address segment, more segments than one block holds, a bad inline mark.
    let wqe = raw_write_wqe(&p);
    let mut unknown = wqe;
    unknown[0] = 0x7f;
    let mut short = wqe;
    short[4] = 1;
    let mut long = wqe;
    long[4] = 5;
    // SEND with the inline flag but no inline mark in the byte count.
    let mut inline = raw_wqe(
        SendOpcode::Send,
        &[&[4, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0]],
    );
    inline[1] = WqeFlags::INLINE.bits();
    for body in [[0u8; 64], unknown, short, long, inline] {
        bad.push(raw_wqe_op(&p, &c, 1, &body));
    }
    // Operand from memory: misaligned (for an atomic).
    let fa = raw_wqe(
        SendOpcode::FetchAdd,
        &[
            raddr_seg(remote(&p.b, 0)).as_bytes(),
            AtomicSeg::default().as_bytes(),
            data_seg(p.a.mr.sge(0, 8)).as_bytes(),
        ],
    );
    let fa_ok = PostTriggeredIn {
        flags: TrigFlags::OPERAND_FROM_MEM.bits(),
        operand_addr: (p.a.mr.addr() + 64).into(),
        operand_lkey: p.a.mr.lkey().into(),
        ..raw_wqe_op(&p, &c, 1_000, &fa)
    };
    raw_post(&dev, &fa_ok).unwrap();
    assert_eq!(p.a.pd.flush_triggered(None).unwrap(), 1);
    bad.push(PostTriggeredIn {
        operand_addr: (p.a.mr.addr() + 65).into(),
        ..fa_ok
    });
    for (i, b) in bad.iter().enumerate() {
        assert_eq!(post(b), CmdStatus::BadParam, "case {i}: {b:?}");
    }
    // The typed API refuses a work request that does not fit one block.
    let sges = [p.a.mr.sge(0, 8), p.a.mr.sge(8, 8), p.a.mr.sge(16, 8)];
    assert!(matches!(
        p.a.qp.post_triggered(
            &c,
            1,
            &SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sges),
            TriggerOpts::default()
        ),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.a.qp.post_triggered(
            &c,
            1,
            &SendWr::inline(1, WrOp::Write(remote(&p.b, 0)), &[0u8; 29]),
            TriggerOpts::default()
        ),
        Err(Error::InvalidArgument(_))
    ));
    // Two SGEs and 28 inline bytes do fit.
    for wr in [
        SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sges[..2]),
        SendWr::inline(2, WrOp::Write(remote(&p.b, 0)), &[0u8; 28]),
    ] {
        p.a.qp
            .post_triggered(&c, 1_000, &wr, TriggerOpts::default())
            .unwrap();
    }
    assert_eq!(p.a.pd.flush_triggered(None).unwrap(), 2);

    // BIND_CNTR: unknown kind, unknown flags, no events, unknown event bits, an MR bind of
    // QP-only events, unbinding what is not bound.
    let bind = |kind: u8, flags: u8, obj: u32, events: u32| {
        let b = BindCntrIn {
            cntr: c.num().into(),
            kind,
            flags,
            obj: obj.into(),
            events: events.into(),
            ..Default::default()
        };
        status_of(
            raw(&dev, CmdOpcode::BindCntr, b.as_bytes()),
            CmdOpcode::BindCntr,
        )
    };
    let qpn = p.a.qp.qpn();
    let lkey = p.a.mr.lkey();
    let w = CntrEvents::WRITE.bits();
    assert_eq!(bind(3, 0, qpn, w), CmdStatus::BadParam);
    assert_eq!(bind(CNTR_BIND_QP, 2, qpn, w), CmdStatus::BadParam);
    assert_eq!(bind(CNTR_BIND_QP, 0, qpn, 0), CmdStatus::BadParam);
    assert_eq!(bind(CNTR_BIND_QP, 0, qpn, 1 << 6), CmdStatus::BadParam);
    assert_eq!(bind(CNTR_BIND_MR, 0, lkey, w), CmdStatus::BadParam);
    assert_eq!(
        bind(CNTR_BIND_MR, 0, lkey, CntrEvents::RECV.bits()),
        CmdStatus::BadParam
    );
    assert_eq!(
        status(c.unbind_qp(&p.a.qp, CntrEvents::WRITE)),
        CmdStatus::BadParam
    );
    assert_eq!(
        bind(CNTR_BIND_QP, CNTR_BIND_UNBIND, qpn, w),
        CmdStatus::BadParam
    );
    // An MR without remote write or atomic access cannot count remote writes; without
    // remote read, remote reads. Atomic access alone is enough for remote writes.
    let local = p.a.pd.reg_mr(&p.a.buf, Access::LOCAL_WRITE).unwrap();
    let atomic =
        p.a.pd
            .reg_mr(&p.a.buf, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC)
            .unwrap();
    assert_eq!(
        status_of(
            c.bind_mr(&local, CntrEvents::REMOTE_WRITE),
            CmdOpcode::BindCntr
        ),
        CmdStatus::BadParam
    );
    assert_eq!(
        status(c.bind_mr(&local, CntrEvents::REMOTE_READ)),
        CmdStatus::BadParam
    );
    assert_eq!(
        status(c.bind_mr(&atomic, CntrEvents::REMOTE_READ)),
        CmdStatus::BadParam
    );
    c.bind_mr(&atomic, CntrEvents::REMOTE_WRITE).unwrap();
    c.unbind_mr(&atomic, CntrEvents::REMOTE_WRITE).unwrap();
    assert_eq!(info(&c).refs, 0);
    // UPDATE_CNTR with unknown flags; CREATE_CNTR with flags or a misaligned writeback.
    let u = UpdateCntrIn {
        cntr: c.num().into(),
        flags: 4.into(),
        success: 1.into(),
        ..Default::default()
    };
    assert_eq!(
        status(raw(&dev, CmdOpcode::UpdateCntr, u.as_bytes())),
        CmdStatus::BadParam
    );
    let wb = dev.alloc_dma(64).unwrap();
    for (flags, off) in [(1u32, 0u64), (0, 8)] {
        let cr = CreateCntrIn {
            pdn: p.a.pd.pdn().into(),
            flags: flags.into(),
            wb_iova: (wb.iova() + off).into(),
        };
        assert_eq!(
            status(raw(&dev, CmdOpcode::CreateCntr, cr.as_bytes())),
            CmdStatus::BadParam
        );
    }
    for x in [&c, &t] {
        assert_cntr(x, (0, 0));
        assert_eq!((info(x).pending, info(x).refs), (0, 0));
    }
    drop((local, atomic));
    still_serving(&mut p);
}

/// `Busy`: binding an event already bound to another counter (QP and MR), destroying a
/// counter still bound or named by a pending operation. Once nothing names it (the QP and MR
/// destroyed, the operation fired), dropping the handle destroys it.
#[test]
fn conflicting_bindings_and_destroying_referenced_counters_are_busy() {
    let mut p = pair();
    let dev = p.a.dev.clone();
    let (mut qa2, qb2) = extra_qps(&p);
    let mr2 =
        p.a.pd
            .reg_mr(&p.a.buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    let c = p.a.pd.create_counter().unwrap();
    let d = p.a.pd.create_counter().unwrap();
    c.bind_qp(&qa2, CntrEvents::WRITE | CntrEvents::READ)
        .unwrap();
    // Binding the same counter again is no change.
    c.bind_qp(&qa2, CntrEvents::WRITE).unwrap();
    assert_eq!(info(&c).refs, 2);
    assert_eq!(
        status_of(
            d.bind_qp(&qa2, CntrEvents::SEND | CntrEvents::READ),
            CmdOpcode::BindCntr
        ),
        CmdStatus::Busy
    );
    assert_eq!(info(&d).refs, 0, "all or nothing: SEND was not bound");
    d.bind_qp(&qa2, CntrEvents::SEND).unwrap();
    c.bind_mr(&mr2, CntrEvents::REMOTE_WRITE).unwrap();
    assert_eq!(info(&c).refs, 3);
    assert_eq!(
        status(d.bind_mr(&mr2, CntrEvents::REMOTE_WRITE)),
        CmdStatus::Busy
    );
    // Unbinding another counter's event is refused.
    assert_eq!(
        status(d.unbind_qp(&qa2, CntrEvents::WRITE)),
        CmdStatus::BadParam
    );
    let destroy = |n: u32| {
        raw(
            &dev,
            CmdOpcode::DestroyCntr,
            ObjectIn { num: n.into() }.as_bytes(),
        )
    };
    let exists = |n: u32| match raw(
        &dev,
        CmdOpcode::QueryCntr,
        ObjectIn { num: n.into() }.as_bytes(),
    ) {
        Ok(_) => true,
        Err(e) => {
            assert_eq!(status(Err::<(), _>(e)), CmdStatus::BadResource);
            false
        }
    };
    assert_eq!(
        status_of(destroy(c.num()), CmdOpcode::DestroyCntr),
        CmdStatus::Busy
    );
    assert_eq!(status(destroy(d.num())), CmdStatus::Busy);
    // Named by a pending operation, as the trigger or as the target.
    let e = p.a.pd.create_counter().unwrap();
    let f = p.a.pd.create_counter().unwrap();
    e.post_triggered_add(5, &f, 1, 0).unwrap();
    assert_eq!(status(destroy(e.num())), CmdStatus::Busy);
    assert_eq!(status(destroy(f.num())), CmdStatus::Busy);
    // Still counting after the refusals.
    qa2.post_send(&[SendWr::new(
        1,
        WrOp::Write(remote(&p.b, 0)),
        &[p.a.mr.sge(0, 8)],
    )])
    .unwrap();
    wait(&p.fabric, &mut p.a.cq, 1);
    settle(&p.fabric);
    assert_cntr(&c, (1, 0));
    e.add(5);
    assert_cntr(&f, (1, 0));
    // Nothing names them any more: dropping the handles destroys them.
    assert_eq!((info(&e).refs, info(&f).refs), (0, 0));
    let nums = [c.num(), d.num(), e.num(), f.num()];
    drop((e, f));
    assert!(!exists(nums[2]) && !exists(nums[3]));
    // The QP and MR keep their counters until they go.
    drop((c, d));
    assert!(exists(nums[0]) && exists(nums[1]));
    drop((qa2, qb2, mr2));
    assert!(!exists(nums[0]) && !exists(nums[1]));
    still_serving(&mut p);
}

// ---------------------------------------------------------------------------------------
// Lifetimes: nothing leaks
// ---------------------------------------------------------------------------------------

/// A triggered transfer that fired and is still in flight when its QP is destroyed
/// completes as flushed: one error on its completion counter, its reference released.
#[test]
fn in_flight_transfer_on_a_destroyed_qp_counts_as_flushed() {
    let mut p = pair();
    let (qa2, qb2) = extra_qps(&p);
    let trig = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    let sge = [p.a.mr.sge(0, 900_000)];
    qa2.post_triggered(
        &trig,
        0,
        &SendWr::new(1, WrOp::Write(remote(&p.b, 0)), &sge),
        TriggerOpts {
            completion: Some(&comp),
            signaled: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!((info(&trig).refs, info(&comp).refs), (0, 1));
    assert_eq!(comp.read(), (0, 0), "still on its way");
    drop(qa2);
    drop(qb2);
    settle(&p.fabric);
    assert_cntr(&comp, (0, 1));
    assert_eq!(info(&comp).refs, 0);
    drain(&p.fabric, &mut p.a.cq);
    still_serving(&mut p);
}

/// Dropping a counter takes back the operations waiting on it; one still named by another
/// counter's pending operation is destroyed once that operation is gone.
#[test]
fn dropping_counters_releases_their_operations() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    let u = p.a.pd.create_counter().unwrap();
    c.post_triggered_add(5, &t, 1, 0).unwrap();
    trig_write(&p, &c, 5, 1);
    u.post_triggered_add(5, &t, 1, 0).unwrap();
    assert_eq!(info(&t).refs, 2);
    drop(c);
    assert_eq!(info(&t).refs, 1, "c's operations were flushed");
    // t is still named by u's operation: dropping t cancels it, so t goes at once.
    let t_num = t.num();
    drop(t);
    let query = |n: u32| {
        raw(
            &p.a.dev,
            CmdOpcode::QueryCntr,
            ObjectIn { num: n.into() }.as_bytes(),
        )
    };
    assert_eq!(status(query(t_num).map(|_| ())), CmdStatus::BadResource);
    let iu = info(&u);
    assert_eq!((iu.refs, iu.pending), (0, 0), "u's operation was cancelled");
    u.add(5);
    settle(&p.fabric);
    assert_cntr(&u, (5, 0));
    // c's and t's numbers are both free again.
    let (f1, f2) = (
        p.a.pd.create_counter().unwrap(),
        p.a.pd.create_counter().unwrap(),
    );
    assert!([f1.num(), f2.num()].contains(&t_num));
    assert_cntr(&f1, (0, 0));
    assert_cntr(&f2, (0, 0));
    assert!(
        drain(&p.fabric, &mut p.a.cq).is_empty(),
        "the WRITE was flushed"
    );
    still_serving(&mut p);
}

/// A handle names one operation: once it fired, was cancelled or flushed, a new operation
/// reusing its table slot has another handle, and the old one cancels nothing.
#[test]
fn stale_handles_never_cancel_a_later_operation() {
    let mut p = pair();
    let c = p.a.pd.create_counter().unwrap();
    let t = p.a.pd.create_counter().unwrap();
    let mut old = Vec::new();
    for _ in 0..4 {
        let h = c.post_triggered_add(1, &t, 1, 0).unwrap();
        assert!(!old.contains(&h));
        p.a.dev.cancel_triggered(h).unwrap();
        old.push(h);
    }
    let live = c.post_triggered_add(1, &t, 1, 0).unwrap();
    assert!(!old.contains(&live));
    for h in &old {
        assert_eq!(status(p.a.dev.cancel_triggered(*h)), CmdStatus::BadResource);
    }
    assert_eq!(info(&c).pending, 1);
    c.add(1);
    settle(&p.fabric);
    assert_cntr(&t, (1, 0));
    still_serving(&mut p);
}

/// A triggered atomic whose operand buffer cannot be read (a key that does not exist) fails
/// with a local protection error: an error CQE though not signaled, an error count.
#[test]
fn unreadable_operand_fails_the_triggered_atomic() {
    let mut p = pair();
    let trig = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    write_u64(&p.b.buf, 64, 10);
    let res = [p.a.mr.sge(0, 8)];
    let h =
        p.a.qp
            .post_triggered(
                &trig,
                1,
                &SendWr::new(
                    9,
                    WrOp::FetchAdd {
                        remote: remote(&p.b, 64),
                        add: 1,
                    },
                    &res,
                ),
                TriggerOpts {
                    completion: Some(&comp),
                    operand: Some(Sge {
                        addr: p.a.mr.addr(),
                        len: 8,
                        lkey: 0x00dd_dd00,
                    }),
                    ..Default::default()
                },
            )
            .unwrap();
    trig.add(1);
    let wc = drain(&p.fabric, &mut p.a.cq);
    assert_eq!(wc.len(), 1, "{wc:?}");
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].trigger),
        (9, WcStatus::LocProtErr, Some(h))
    );
    assert_cntr(&comp, (0, 1));
    assert_eq!(read_u64(&p.b.buf, 64), 10, "the atomic never ran");
    still_serving(&mut p);
}

// ---------------------------------------------------------------------------------------
// Property: random scripts against a reference model of the firing rule
// ---------------------------------------------------------------------------------------

/// One step of a script on two counters.
#[derive(Clone, Debug)]
enum Step {
    /// A signaled 8-byte triggered WRITE on A's QP.
    Write { cntr: usize, thr: u64, so: bool },
    /// A triggered add to (or set of) counter `target`.
    CntrOp {
        cntr: usize,
        thr: u64,
        so: bool,
        target: usize,
        set: bool,
        s: u64,
        e: u64,
    },
    /// A host add to the success (or error) value.
    Add { cntr: usize, v: u32, error: bool },
    /// A host set of the success (or error) value.
    Set { cntr: usize, v: u64, error: bool },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..2usize, 0..24u64, any::<bool>())
            .prop_map(|(cntr, thr, so)| Step::Write { cntr, thr, so }),
        2 => (0..2usize, 0..24u64, any::<bool>(), 0..2usize, any::<bool>(), 0..6u64, 0..3u64)
            .prop_map(|(cntr, thr, so, target, set, s, e)| Step::CntrOp {
                cntr, thr, so, target, set, s, e,
            }),
        3 => (0..2usize, 0..5u32, prop::bool::weighted(0.3))
            .prop_map(|(cntr, v, error)| Step::Add { cntr, v, error }),
        1 => (0..2usize, 0..16u64, prop::bool::weighted(0.3))
            .prop_map(|(cntr, v, error)| Step::Set { cntr, v, error }),
    ]
}

/// What a pending operation does in the model.
#[derive(Clone, Copy, Debug)]
enum ModelOp {
    Write(u64),
    Cntr {
        target: usize,
        set: bool,
        s: u64,
        e: u64,
    },
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    cntr: usize,
    thr: u64,
    seq: u64,
    so: bool,
    op: ModelOp,
}

/// The firing rule as the ABI states it: thresholds compared with success + error (or
/// success alone), every satisfied operation of the changed counter released in (threshold,
/// post order) into one FIFO, counter operations run from the FIFO releasing more behind it.
#[derive(Debug, Default)]
struct Model {
    cntr: [(u64, u64); 2],
    pending: Vec<Pending>,
    fifo: std::collections::VecDeque<ModelOp>,
    seq: u64,
    fired: Vec<u64>,
}

impl Model {
    fn release(&mut self, c: usize) {
        let (s, e) = self.cntr[c];
        let mut out: Vec<Pending> = Vec::new();
        self.pending.retain(|p| {
            let v = if p.so { s } else { s + e };
            let hit = p.cntr == c && p.thr <= v;
            if hit {
                out.push(*p);
            }
            !hit
        });
        out.sort_by_key(|p| (p.thr, p.seq));
        self.fifo.extend(out.iter().map(|p| p.op));
    }
    fn drain(&mut self) {
        while let Some(op) = self.fifo.pop_front() {
            match op {
                ModelOp::Write(id) => self.fired.push(id),
                ModelOp::Cntr { target, set, s, e } => {
                    let t = &mut self.cntr[target];
                    *t = if set { (s, e) } else { (t.0 + s, t.1 + e) };
                    self.release(target);
                }
            }
        }
    }
    fn changed(&mut self, c: usize) {
        self.release(c);
        self.drain();
    }
    fn post(&mut self, cntr: usize, thr: u64, so: bool, op: ModelOp) {
        self.pending.push(Pending {
            cntr,
            thr,
            seq: self.seq,
            so,
            op,
        });
        self.seq += 1;
        self.changed(cntr);
    }
    fn refs(&self, c: usize) -> u32 {
        self.pending
            .iter()
            .map(|p| {
                (p.cntr == c) as u32
                    + matches!(p.op, ModelOp::Cntr { target, .. } if target == c) as u32
            })
            .sum()
    }
}

fn run_script(seed: u64, steps: &[Step]) {
    let mut p = pair_with(2, 5, seed);
    let cs = [
        p.a.pd.create_counter().unwrap(),
        p.a.pd.create_counter().unwrap(),
    ];
    let mut m = Model::default();
    for (i, st) in steps.iter().enumerate() {
        match *st {
            Step::Write { cntr, thr, so } => {
                let id = i as u64;
                write_u64(&p.a.buf, 8 * i, id + 1);
                trig_write_opts(
                    &p,
                    &cs[cntr],
                    thr,
                    id,
                    TriggerOpts {
                        signaled: true,
                        success_only: so,
                        ..Default::default()
                    },
                );
                m.post(cntr, thr, so, ModelOp::Write(id));
            }
            Step::CntrOp {
                cntr,
                thr,
                so,
                target,
                set,
                s,
                e,
            } => {
                let kind = if set {
                    TrigKind::CntrSet
                } else {
                    TrigKind::CntrAdd
                };
                let flags = if so {
                    TrigFlags::SUCCESS_ONLY
                } else {
                    TrigFlags::empty()
                };
                let t = raw_cntr_op(&cs[cntr], thr, kind, flags, cs[target].num(), (s, e));
                raw_post(&p.a.dev, &t).unwrap();
                m.post(cntr, thr, so, ModelOp::Cntr { target, set, s, e });
            }
            Step::Add { cntr, v, error } => {
                if error {
                    cs[cntr].add_error(v);
                    m.cntr[cntr].1 += v as u64;
                } else {
                    cs[cntr].add(v);
                    m.cntr[cntr].0 += v as u64;
                }
                m.changed(cntr);
            }
            Step::Set { cntr, v, error } => {
                if error {
                    cs[cntr].set_error(v).unwrap();
                    m.cntr[cntr].1 = v;
                } else {
                    cs[cntr].set(v).unwrap();
                    m.cntr[cntr].0 = v;
                }
                m.changed(cntr);
            }
        }
    }
    let wc = drain(&p.fabric, &mut p.a.cq);
    for w in &wc {
        assert_eq!(w.status, WcStatus::Success, "{w:?}");
        assert!(w.trigger.is_some());
    }
    let got: Vec<u64> = wc.iter().map(|w| w.wr_id).collect();
    assert_eq!(got, m.fired, "fire order");
    for (c, x) in cs.iter().enumerate() {
        assert_cntr(x, m.cntr[c]);
        let q = info(x);
        let pending = m.pending.iter().filter(|x| x.cntr == c).count() as u32;
        assert_eq!((q.pending, q.refs), (pending, m.refs(c)), "counter {c}");
    }
    // Exactly the fired WRITEs landed.
    for (i, st) in steps.iter().enumerate() {
        if matches!(st, Step::Write { .. }) {
            let landed = read_u64(&p.b.buf, 8 * i) != 0;
            assert_eq!(landed, m.fired.contains(&(i as u64)), "WRITE {i}");
        }
    }
    // Flushing the rest leaves nothing behind.
    assert_eq!(
        p.a.pd.flush_triggered(None).unwrap(),
        m.pending.len() as u32
    );
    for c in &cs {
        assert_eq!((info(c).pending, info(c).refs), (0, 0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn random_trigger_scripts_match_the_reference_model(
        seed in any::<u64>(),
        steps in proptest::collection::vec(step(), 1..48),
    ) {
        run_script(seed, &steps);
    }
}

/// A fixed script exercising every kind of step (kept so a regression does not depend on
/// the random draw): success-only and sum thresholds, a chain into the other counter and
/// back by a set, an error add, host sets of both values, a self-targeted add.
#[test]
fn fixed_trigger_script_matches_the_reference_model() {
    let w = |cntr, thr, so| Step::Write { cntr, thr, so };
    let op = |cntr, thr, so, target, set, s, e| Step::CntrOp {
        cntr,
        thr,
        so,
        target,
        set,
        s,
        e,
    };
    let add = |cntr, v, error| Step::Add { cntr, v, error };
    let set = |cntr, v, error| Step::Set { cntr, v, error };
    run_script(
        7,
        &[
            w(0, 3, false),
            w(0, 2, true),
            op(0, 2, false, 1, false, 4, 1),
            w(1, 5, false),
            w(1, 5, true),
            op(1, 5, false, 0, true, 9, 0),
            w(0, 9, false),
            add(0, 1, true),
            add(0, 1, false),
            set(1, 0, false),
            set(1, 0, true),
            w(1, 0, true),
            op(1, 1, true, 1, false, 1, 0),
            add(1, 1, false),
            set(0, 2, true),
            w(0, 13, false),
            w(0, 20, false),
        ],
    );
}

/// A completion counter moves only once the transfer's data is where it goes: a triggered
/// READ's (and fetch-and-add's) result is in local memory when the counter is seen to move.
#[test]
fn completion_counter_moves_after_the_fetched_data_landed() {
    let p = pair_with(2, 1, 21);
    let trig = p.a.pd.create_counter().unwrap();
    let comp = p.a.pd.create_counter().unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 31 % 241) as u8).collect();
    p.b.buf.write(0, &data).unwrap();
    write_u64(&p.b.buf, 70_000, 41);
    let opts = TriggerOpts {
        completion: Some(&comp),
        ..Default::default()
    };
    let dst = [p.a.mr.sge(100_000, 65536)];
    p.a.qp
        .post_triggered(
            &trig,
            1,
            &SendWr::new(1, WrOp::Read(remote(&p.b, 0)), &dst),
            opts,
        )
        .unwrap();
    let res = [p.a.mr.sge(200_000, 8)];
    p.a.qp
        .post_triggered(
            &trig,
            2,
            &SendWr::new(
                2,
                WrOp::FetchAdd {
                    remote: remote(&p.b, 70_000),
                    add: 1,
                },
                &res,
            ),
            opts,
        )
        .unwrap();
    trig.add(1);
    while comp.get().0 == 0 {
        assert!(p.fabric.step());
    }
    let mut got = vec![0u8; 65536];
    p.a.buf.read(100_000, &mut got).unwrap();
    assert!(got == data, "READ counted before its data landed");
    trig.add(1);
    while comp.get().0 == 1 {
        assert!(p.fabric.step());
    }
    assert_eq!(read_u64(&p.a.buf, 200_000), 41, "fetched value landed");
    settle(&p.fabric);
    assert_cntr(&comp, (2, 0));
}

/// fabtests `fi_rdm_deferred_wq -T rma` (F2): a WRITE, then a READ triggered by the WRITE's
/// completion counter, reads back what the WRITE wrote.
#[test]
fn write_then_read_chained_through_a_completion_counter() {
    let mut p = pair_with(2, 2, 22);
    let trig = p.a.pd.create_counter().unwrap();
    let wdone = p.a.pd.create_counter().unwrap();
    let rdone = p.a.pd.create_counter().unwrap();
    let data: Vec<u8> = (0..40_000u32).map(|i| (i * 17 % 239) as u8).collect();
    p.a.buf.write(0, &data).unwrap();
    p.b.buf.fill(4096, 40_000, 0x11).unwrap();
    let src = [p.a.mr.sge(0, 40_000)];
    let dst = [p.a.mr.sge(300_000, 40_000)];
    p.a.qp
        .post_triggered(
            &trig,
            3,
            &SendWr::new(1, WrOp::Write(remote(&p.b, 4096)), &src),
            TriggerOpts {
                completion: Some(&wdone),
                ..Default::default()
            },
        )
        .unwrap();
    p.a.qp
        .post_triggered(
            &wdone,
            1,
            &SendWr::new(2, WrOp::Read(remote(&p.b, 4096)), &dst),
            TriggerOpts {
                completion: Some(&rdone),
                signaled: true,
                ..Default::default()
            },
        )
        .unwrap();
    trig.add(3);
    assert_eq!(fired(&mut p), vec![2]);
    assert_cntr(&wdone, (1, 0));
    assert_cntr(&rdone, (1, 0));
    let mut got = vec![0u8; 40_000];
    p.a.buf.read(300_000, &mut got).unwrap();
    assert!(got == data, "the READ saw the WRITE's data");
}

/// Fired transfers start in fire order even when READs wait for `max_rd_atomic` credits:
/// a WRITE fired after a waiting READ waits behind it, and so does work the host posts
/// after them.
#[test]
fn triggered_transfers_complete_in_fire_order_past_max_rd_atomic() {
    let mut p = pair();
    let go = p.a.pd.create_counter().unwrap();
    let remote = RemoteAddr {
        addr: p.b.mr.addr(),
        rkey: p.b.mr.rkey(),
    };
    let sges: Vec<[Sge; 1]> = (0..48).map(|i| [p.a.mr.sge(64 * i, 8)]).collect();
    for i in 0..48u64 {
        let op = if i % 3 == 2 {
            WrOp::Write(remote)
        } else {
            WrOp::Read(remote)
        };
        p.a.qp
            .post_triggered(
                &go,
                1,
                &SendWr::new(i, op, &sges[i as usize]),
                TriggerOpts {
                    signaled: true,
                    ..Default::default()
                },
            )
            .unwrap();
    }
    go.add(1);
    // Let the fire happen, then post from the host: it must come after all 48.
    while go.read().0 == 0 {
        p.fabric.step();
    }
    let host = [p.a.mr.sge(8192, 8)];
    p.a.qp
        .post_send(&[SendWr::new(100, WrOp::Write(remote), &host)])
        .unwrap();
    let wc = wait(&p.fabric, &mut p.a.cq, 49);
    let ids: Vec<u64> = wc.iter().map(|w| w.wr_id).collect();
    let want: Vec<u64> = (0..48).chain([100]).collect();
    assert_eq!(ids, want);
    assert!(wc.iter().all(|w| w.status == WcStatus::Success));
}
