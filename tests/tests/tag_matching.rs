//! Hardware tag matching against the model: the four cases of rdma-core's
//! tests/test_tag_matching.py, then the extra cases of the tag-matching reference (§13.3)
//! and bad input.

use ringbell::tm::{rndv_header, Rvh, TmOp, Tmh, TmhOp};
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig};

const MSG: usize = 1024;
const TAG_MASK: u64 = 0xffff;
const SYNC_WRID: u64 = 27;
const FIXED_SEND_TAG: u64 = 0x1234;

/// A client with its own RQ and a server whose QP is on a TM-SRQ, path MTU 1024.
struct Tm {
    fabric: Fabric,
    c_qp: QueuePair,
    c_cq: CompletionQueue,
    c_mr: MemoryRegion,
    c_buf: DmaBuffer,
    s_qp: QueuePair,
    srq: SharedReceiveQueue,
    s_cq: CompletionQueue,
    s_mr: MemoryRegion,
    s_buf: DmaBuffer,
    _pds: (ProtectionDomain, ProtectionDomain),
    _devs: (Device, Device),
    unexp: u32,
}

fn setup(max_num_tags: u32, max_ops: u32) -> Tm {
    let fabric = Fabric::new(FabricConfig::new(2, 77));
    let (cd, sd) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    assert!(sd.caps().caps.contains(ringbell_specs::regs::Caps::TM_RC));
    assert_eq!(sd.caps().max_rndv_hdr_size, 64);
    let (cp, sp) = (cd.alloc_pd().unwrap(), sd.alloc_pd().unwrap());
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let (c_buf, s_buf) = (
        cd.alloc_dma(1 << 16).unwrap(),
        sd.alloc_dma(1 << 16).unwrap(),
    );
    let (c_mr, s_mr) = (
        cp.reg_mr(&c_buf, access).unwrap(),
        sp.reg_mr(&s_buf, access).unwrap(),
    );
    let (c_cq, s_cq) = (cd.create_cq(1024).unwrap(), sd.create_cq(1024).unwrap());
    let mut srq = sp
        .create_tm_srq(&s_cq, 100, 1, max_num_tags, max_ops)
        .unwrap();
    let mut ci = QpInit::new(&c_cq, &c_cq);
    ci.max_recv_wr = 1000;
    let mut c_qp = cp.create_qp(&ci).unwrap();
    let mut si = QpInit::new(&s_cq, &s_cq);
    si.srq = Some(&srq);
    let mut s_qp = sp.create_qp(&si).unwrap();
    let o = ConnectOptions {
        path_mtu: 3,
        max_rd_atomic: 1,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..Default::default()
    };
    c_qp.connect(&s_qp.endpoint(10), 20, &o).unwrap();
    s_qp.connect(&c_qp.endpoint(20), 10, &o).unwrap();
    // 33 receives on each side before any traffic, as the suite does.
    let c_sge = [c_mr.sge(0, MSG as u32)];
    let s_sge = [s_mr.sge(0, MSG as u32)];
    let cr: Vec<RecvWr> = (0..33)
        .map(|_| RecvWr {
            wr_id: 0,
            sgl: &c_sge,
        })
        .collect();
    let sr: Vec<RecvWr> = (0..33)
        .map(|_| RecvWr {
            wr_id: 0,
            sgl: &s_sge,
        })
        .collect();
    c_qp.post_recv(&cr).unwrap();
    srq.post_recv(&sr).unwrap();
    Tm {
        fabric,
        c_qp,
        c_cq,
        c_mr,
        c_buf,
        s_qp,
        srq,
        s_cq,
        s_mr,
        s_buf,
        _pds: (cp, sp),
        _devs: (cd, sd),
        unexp: 0,
    }
}

impl Tm {
    fn poll(&mut self, server: bool) -> WorkCompletion {
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            let cq = if server {
                &mut self.s_cq
            } else {
                &mut self.c_cq
            };
            if cq.poll_ready(&mut wc) == 1 {
                return wc[0];
            }
            assert!(self.fabric.step(), "fabric idle: a completion never came");
        }
    }

    /// Polls the server like the suite's helper: counts unexpected receives and reports the
    /// count with a SYNC right away.
    fn poll_server(&mut self) -> WorkCompletion {
        let wc = self.poll(true);
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        if wc.opcode == WcOpcode::TmRecv && !wc.tm_match && !wc.tm_data_valid {
            self.unexp += 1;
            self.post_sync();
        }
        if wc.opcode == WcOpcode::TmAdd && wc.tm_sync_req {
            self.post_sync();
        }
        wc
    }

    fn post_sync(&mut self) {
        self.srq
            .post_tm_ops(&mut [TmOp::sync(SYNC_WRID, self.unexp)])
            .unwrap();
        let wc = self.poll(true);
        verify(&wc, SYNC_WRID, WcOpcode::TmSync, (false, false), 0);
    }

    fn post_recv_tm(&mut self, tag: u64) -> u32 {
        let mut op = [TmOp::add(
            tag,
            tag,
            self.s_mr.sge(0, MSG as u32),
            tag,
            TAG_MASK,
        )];
        self.srq.post_tm_ops(&mut op).unwrap();
        let wc = self.poll_server();
        verify(&wc, tag, WcOpcode::TmAdd, (false, false), 0);
        op[0].handle
    }

    /// The client's message: MSG bytes of 'c' with the TMH opcode at 0 and the tag at 8.
    fn send(&mut self, tag: u64, op: TmhOp) {
        self.c_buf.fill(0, MSG, b'c').unwrap();
        let len = if op == TmhOp::Rndv {
            let rvh = Rvh {
                va: self.c_mr.addr(),
                rkey: self.c_mr.rkey(),
                len: MSG as u32,
            };
            self.c_buf.write(16, &rvh.to_bytes()).unwrap();
            // One more receive for the FIN.
            let fin = [self.c_mr.sge(8192, 64)];
            self.c_qp
                .post_recv(&[RecvWr {
                    wr_id: 0,
                    sgl: &fin,
                }])
                .unwrap();
            64
        } else {
            MSG as u32
        };
        self.c_buf.write(0, &[op as u8]).unwrap();
        self.c_buf.write(8, &tag.to_be_bytes()).unwrap();
        self.c_qp
            .post_send(&[SendWr::new(1, WrOp::Send, &[self.c_mr.sge(0, len)])])
            .unwrap();
        assert_eq!(self.poll(false).opcode, WcOpcode::Send);
    }

    fn server_bytes(&self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s_buf.read(0, &mut b).unwrap();
        b
    }

    fn client_bytes(&self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.c_buf.read(0, &mut b).unwrap();
        b
    }

    fn repost_untagged(&mut self) {
        self.srq
            .post_recv(&[RecvWr {
                wr_id: 0,
                sgl: &[self.s_mr.sge(0, MSG as u32)],
            }])
            .unwrap();
    }
}

fn verify(wc: &WorkCompletion, wr_id: u64, opcode: WcOpcode, (m, d): (bool, bool), tag: u64) {
    assert_eq!(
        (
            wc.wr_id,
            wc.opcode,
            wc.tm_match,
            wc.tm_data_valid,
            wc.tm_sync_req,
            wc.tag
        ),
        (wr_id, opcode, m, d, false, tag),
        "{wc:?}"
    );
}

/// The suite's loop: add tags 1..9, send 9..1 (out of order), check each completion.
fn tm_traffic(op: TmhOp, fixed: bool) {
    let mut t = setup(127, 10);
    for tag in 1..10 {
        t.post_recv_tm(tag);
    }
    for send_tag in (1..10u64).rev() {
        let tag = if fixed { FIXED_SEND_TAG } else { send_tag };
        t.server_bytes(0);
        t.s_buf.fill(0, MSG, 0).unwrap();
        t.send(tag, op);
        let wc = t.poll_server();
        match (op, fixed) {
            (TmhOp::NoTag, _) => {
                verify(&wc, 0, WcOpcode::TmNoTag, (false, false), 0);
                assert_eq!(t.server_bytes(MSG), t.client_bytes(MSG));
            }
            (TmhOp::Eager, true) => {
                verify(&wc, 0, WcOpcode::TmRecv, (false, false), 0);
                assert_eq!(
                    t.server_bytes(MSG),
                    t.client_bytes(MSG),
                    "the whole message, TMH included"
                );
                assert_eq!(t.unexp as u64, 10 - send_tag);
            }
            (TmhOp::Eager, false) => {
                verify(&wc, send_tag, WcOpcode::TmRecv, (true, true), send_tag);
                assert_eq!(wc.byte_len, (MSG - 16) as u32);
                assert!(
                    t.server_bytes(MSG - 16).iter().all(|b| *b == b'c'),
                    "payload at 0, TMH stripped"
                );
            }
            (TmhOp::Rndv, _) => {
                verify(&wc, send_tag, WcOpcode::TmRecv, (true, false), send_tag);
                let fin = t.poll(false);
                assert_eq!(
                    (fin.wr_id, fin.opcode, fin.byte_len),
                    (0, WcOpcode::Recv, 32),
                    "the FIN"
                );
                let data = t.poll_server();
                verify(&data, send_tag, WcOpcode::TmRecv, (false, true), 0);
                assert_eq!(data.byte_len, MSG as u32);
                // The FIN landed in the client's oldest receive, which (as in the suite) aliases
                // the start of the buffer the NIC read: compare past the 32 FIN bytes, and the
                // request bytes against what was sent.
                let (srv, cli) = (t.server_bytes(MSG), t.client_bytes(MSG));
                assert_eq!(srv[32..], cli[32..], "the NIC read the whole buffer");
                assert_eq!(srv[0], TmhOp::Rndv as u8);
                let mut f = [0u8; 32];
                t.c_buf.read(0, &mut f).unwrap();
                assert_eq!(f[0], TmhOp::Fin as u8);
                assert_eq!(&f[8..16], &send_tag.to_be_bytes());
                assert_eq!(Rvh::parse(&f[16..]).unwrap().len, MSG as u32);
            }
            _ => unreachable!(),
        }
        t.repost_untagged();
    }
}

#[test]
fn test_tm_traffic() {
    tm_traffic(TmhOp::Eager, false);
}

#[test]
fn test_tm_unexpected_tag() {
    tm_traffic(TmhOp::Eager, true);
}

#[test]
fn test_tm_no_tag() {
    tm_traffic(TmhOp::NoTag, true);
}

#[test]
fn test_tm_rndv() {
    tm_traffic(TmhOp::Rndv, false);
}

/// A tagged eager message of `len` bytes (TMH + payload) from the client.
fn eager(t: &mut Tm, tag: u64, len: usize) {
    let payload: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
    t.c_buf.write(0, &payload).unwrap();
    t.c_buf
        .write(
            0,
            &Tmh {
                opcode: TmhOp::Eager as u8,
                app_ctx: 0xabc,
                tag,
            }
            .to_bytes(),
        )
        .unwrap();
    t.c_qp
        .post_send(&[SendWr::new(1, WrOp::Send, &[t.c_mr.sge(0, len as u32)])])
        .unwrap();
    assert_eq!(t.poll(false).status, WcStatus::Success);
}

fn add(
    t: &mut Tm,
    wr: u64,
    tag: u64,
    mask: u64,
    at: u64,
    len: u32,
    count: Option<u32>,
) -> (u32, WorkCompletion) {
    let mut op = TmOp::add(wr, wr, t.s_mr.sge(at, len), tag, mask);
    op.unexpected_cnt = count;
    let mut ops = [op];
    t.srq.post_tm_ops(&mut ops).unwrap();
    let wc = t.poll(true);
    assert_eq!(wc.opcode, WcOpcode::TmAdd);
    (ops[0].handle, wc)
}

#[test]
fn out_of_sync_adds_wait_for_the_count_and_older_entries_keep_matching() {
    let mut t = setup(16, 16);
    let (_, wc) = add(&mut t, 1, 0x10, TAG_MASK, 0, 256, Some(0));
    assert!(!wc.tm_sync_req);
    // An unexpected message the application has not reported yet.
    eager(&mut t, 0x99, 100);
    let u = t.poll(true);
    assert_eq!((u.opcode, u.tm_match), (WcOpcode::TmRecv, false));
    // ADD with the stale count: appended disabled, and the device asks for a SYNC.
    let (_, wc) = add(&mut t, 2, 0x20, TAG_MASK, 4096, 256, Some(0));
    assert!(wc.tm_sync_req, "{wc:?}");
    assert_eq!(wc.tm_hw_count, 1);
    // The old entry still matches; the new one does not, yet.
    eager(&mut t, 0x10, 100);
    let m = t.poll(true);
    assert_eq!((m.wr_id, m.tm_match, m.tag), (1, true, 0x10));
    eager(&mut t, 0x20, 100);
    let u2 = t.poll(true);
    assert!(!u2.tm_match, "disabled while out of sync: {u2:?}");
    // Report both unexpected messages: the entry comes alive.
    t.srq.post_tm_ops(&mut [TmOp::sync(SYNC_WRID, 2)]).unwrap();
    assert_eq!(t.poll(true).opcode, WcOpcode::TmSync);
    eager(&mut t, 0x20, 100);
    let m2 = t.poll(true);
    assert_eq!(
        (m2.wr_id, m2.tm_match, m2.tm_data_valid, m2.tag, m2.app_ctx),
        (2, true, true, 0x20, 0xabc)
    );
}

#[test]
fn duplicate_tags_are_consumed_oldest_first_and_masks_work() {
    let mut t = setup(16, 16);
    add(&mut t, 1, 0x5, u64::MAX, 0, 256, None);
    add(&mut t, 2, 0x5, u64::MAX, 1024, 256, None);
    add(
        &mut t,
        3,
        0xAB00_0000_0000_0000,
        0xFF00_0000_0000_0000,
        2048,
        256,
        None,
    );
    add(&mut t, 4, 0, 0, 3072, 256, None);
    for (tag, want) in [(0x5, 1), (0x5, 2), (0xABCD_0000_1234_5678, 3), (0x42, 4)] {
        eager(&mut t, tag, 64);
        let wc = t.poll(true);
        assert_eq!(
            (wc.wr_id, wc.tm_match, wc.tag),
            (want, true, tag),
            "tag {tag:#x}"
        );
        assert_eq!(wc.byte_len, 48);
    }
    assert_eq!(t.srq.tm_free_tags(), 16, "every handle came back");
}

#[test]
fn del_racing_a_match_fails_with_tm_err_and_the_handle_is_reused() {
    let mut t = setup(4, 16);
    let (h, _) = add(&mut t, 1, 0x7, u64::MAX, 0, 256, None);
    eager(&mut t, 0x7, 64);
    // The DEL is posted after the message consumed the entry.
    t.srq.post_tm_ops(&mut [TmOp::del(9, h)]).unwrap();
    let m = t.poll(true);
    assert_eq!((m.wr_id, m.tm_match, m.tm_data_valid), (1, true, true));
    let d = t.poll(true);
    assert_eq!(
        (d.wr_id, d.opcode, d.status),
        (9, WcOpcode::TmDel, WcStatus::TmErr)
    );
    // A DEL that wins removes the entry: no message lands there.
    let (h2, _) = add(&mut t, 2, 0x8, u64::MAX, 0, 256, None);
    t.srq.post_tm_ops(&mut [TmOp::del(10, h2)]).unwrap();
    let d2 = t.poll(true);
    assert_eq!((d2.wr_id, d2.status), (10, WcStatus::Success));
    eager(&mut t, 0x8, 64);
    assert!(!t.poll(true).tm_match, "the removed entry is gone");
    // A stale or foreign handle.
    t.srq
        .post_tm_ops(&mut [TmOp::del(11, h2), TmOp::del(12, 999)])
        .unwrap();
    assert_eq!(t.poll(true).status, WcStatus::TmErr);
    assert_eq!(t.poll(true).status, WcStatus::TmErr);
    assert_eq!(t.srq.tm_free_tags(), 4);
}

#[test]
fn a_multi_packet_eager_completes_twice_with_the_immediate_on_the_second() {
    let mut t = setup(16, 16);
    add(&mut t, 1, 0x33, u64::MAX, 0, 8192, None);
    let len = 5000;
    let payload: Vec<u8> = (0..len).map(|i| (i * 13) as u8).collect();
    t.c_buf.write(0, &payload).unwrap();
    t.c_buf
        .write(
            0,
            &Tmh {
                opcode: TmhOp::Eager as u8,
                app_ctx: 5,
                tag: 0x33,
            }
            .to_bytes(),
        )
        .unwrap();
    t.c_qp
        .post_send(&[SendWr::new(
            1,
            WrOp::SendImm(0xfeed),
            &[t.c_mr.sge(0, len as u32)],
        )])
        .unwrap();
    let first = t.poll(true);
    assert_eq!(
        (
            first.wr_id,
            first.tm_match,
            first.tm_data_valid,
            first.tag,
            first.app_ctx,
            first.byte_len
        ),
        (1, true, false, 0x33, 5, 0)
    );
    let second = t.poll(true);
    assert_eq!(
        (
            second.wr_id,
            second.tm_match,
            second.tm_data_valid,
            second.byte_len,
            second.imm
        ),
        (1, false, true, (len - 16) as u32, Some(0xfeed))
    );
    let mut got = vec![0u8; len - 16];
    t.s_buf.read(0, &mut got).unwrap();
    assert_eq!(got, payload[16..]);
}

/// The software half of a rendezvous: READ the data the RVH names, then send the FIN.
fn software_rendezvous(t: &mut Tm, req: &[u8], into: u64) {
    let rvh = Rvh::parse(&req[16..]).unwrap();
    let remote = RemoteAddr {
        addr: rvh.va,
        rkey: rvh.rkey,
    };
    t.s_qp
        .post_send(&[SendWr::new(
            50,
            WrOp::Read(remote),
            &[t.s_mr.sge(into, rvh.len)],
        )])
        .unwrap();
    let r = t.poll(true);
    assert_eq!(
        (r.wr_id, r.opcode, r.status),
        (50, WcOpcode::RdmaRead, WcStatus::Success)
    );
    let mut fin = [0u8; 32];
    fin.copy_from_slice(&req[..32]);
    fin[0] = TmhOp::Fin as u8;
    t.s_qp
        .post_send(&[SendWr::inline(51, WrOp::Send, &fin)])
        .unwrap();
    assert_eq!(t.poll(true).wr_id, 51);
    let f = t.poll(false);
    assert_eq!((f.opcode, f.byte_len), (WcOpcode::Recv, 32));
}

/// Writes a rendezvous request (TMH then RVH) for `tag` into the client's buffer at `at`,
/// naming `len` bytes at client offset `from`.
fn write_rndv(t: &Tm, at: usize, tag: u64, app_ctx: u32, from: u64, len: u32) {
    let req = rndv_header(
        &Tmh {
            opcode: TmhOp::Rndv as u8,
            app_ctx,
            tag,
        },
        &Rvh {
            va: t.c_mr.addr() + from,
            rkey: t.c_mr.rkey(),
            len,
        },
    );
    t.c_buf.write(at, &req).unwrap();
}

fn rndv_request(t: &mut Tm, tag: u64, len: u32) {
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    t.c_buf.write(4096, &data).unwrap();
    write_rndv(t, 0, tag, 9, 4096, len);
    let fin = [t.c_mr.sge(8192, 64)];
    t.c_qp
        .post_recv(&[RecvWr {
            wr_id: 0,
            sgl: &fin,
        }])
        .unwrap();
    t.c_qp
        .post_send(&[SendWr::new(1, WrOp::Send, &[t.c_mr.sge(0, 32)])])
        .unwrap();
    assert_eq!(t.poll(false).opcode, WcOpcode::Send);
}

#[test]
fn a_rendezvous_into_a_small_buffer_is_left_to_software() {
    let mut t = setup(16, 16);
    add(&mut t, 1, 0x44, u64::MAX, 0, 512, None);
    rndv_request(&mut t, 0x44, 3000);
    let wc = t.poll(true);
    assert_eq!(
        (
            wc.wr_id,
            wc.status,
            wc.tm_match,
            wc.tm_data_valid,
            wc.byte_len
        ),
        (1, WcStatus::TmRndvIncomplete, true, true, 32)
    );
    let req = t.server_bytes(32);
    assert_eq!(
        Tmh::parse(&req).unwrap().tag,
        0x44,
        "the request is in the tagged buffer"
    );
    // No READ, no FIN from the NIC: software does both.
    software_rendezvous(&mut t, &req, 16384);
    let mut got = vec![0u8; 3000];
    t.s_buf.read(16384, &mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    assert_eq!(t.s_qp.query().unwrap().state, QpState::Rts as u8);
}

#[test]
fn an_unexpected_rendezvous_is_finished_by_software() {
    let mut t = setup(16, 16);
    rndv_request(&mut t, 0x55, 2000);
    let wc = t.poll(true);
    assert_eq!(
        (wc.opcode, wc.tm_match, wc.byte_len, wc.tag),
        (WcOpcode::TmRecv, false, 32, 0)
    );
    let req = t.server_bytes(32);
    software_rendezvous(&mut t, &req, 16384);
}

#[test]
fn limits_of_the_list_and_the_operation_ring() {
    let mut t = setup(4, 4);
    let mut ops: Vec<TmOp> = (0..4)
        .map(|i| TmOp::add(i, i, t.s_mr.sge(i * 256, 256), i, u64::MAX))
        .collect();
    ops.iter_mut().for_each(|o| o.signaled = false);
    t.srq.post_tm_ops(&mut ops).unwrap();
    // Four unsignaled ops fill the ring: a fifth is refused before the ring is touched.
    assert!(matches!(
        t.srq.post_tm_ops(&mut [TmOp::sync(1, 0)]),
        Err(Error::QueueFull { .. })
    ));
    t.fabric.run_until_idle(u64::MAX);
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(
        t.s_cq.poll_ready(&mut wc),
        0,
        "unsignaled successes are silent"
    );
    // The device completed them: the ring has room; the list, with four tags, has none.
    assert!(matches!(
        t.srq
            .post_tm_ops(&mut [TmOp::add(9, 9, t.s_mr.sge(0, 8), 9, 0)]),
        Err(Error::QueueFull {
            queue: "TM tag list",
            ..
        })
    ));
    t.srq
        .post_tm_ops(&mut [TmOp::del(5, ops[2].handle)])
        .unwrap();
    assert_eq!(t.poll(true).status, WcStatus::Success);
    assert_eq!(t.srq.tm_free_tags(), 1, "one DEL frees exactly one slot");
}

#[test]
fn bad_tagged_input_leaves_the_srq_serving() {
    let mut t = setup(16, 16);
    // An RVH pointing outside the sender's MR: the NIC's READ fails, the entry completes in
    // error, only that QP goes to ERR.
    add(&mut t, 1, 0x66, u64::MAX, 0, 4096, None);
    write_rndv(&t, 0, 0x66, 0, 1 << 20, 100);
    t.s_buf.fill(0, 4096, 0xee).unwrap();
    t.c_qp
        .post_send(&[SendWr::new(1, WrOp::Send, &[t.c_mr.sge(0, 32)])])
        .unwrap();
    let m = t.poll(true);
    assert!(m.tm_match);
    let e = t.poll(true);
    // An error completion: no valid data, byte_len 0.
    assert_eq!(
        (e.wr_id, e.status, e.tm_data_valid, e.tm_match, e.byte_len),
        (1, WcStatus::RemAccessErr, false, false, 0)
    );
    assert!(
        t.server_bytes(4096).iter().all(|b| *b == 0xee),
        "nothing written"
    );
    assert_eq!(t.s_qp.query().unwrap().state, QpState::Err as u8);
    // A rendezvous request longer than max_rndv_hdr_size is never matched.
    let mut t = setup(16, 16);
    add(&mut t, 1, 0x77, u64::MAX, 0, 4096, None);
    write_rndv(&t, 0, 0x77, 0, 0, 100);
    t.c_qp
        .post_send(&[SendWr::new(1, WrOp::Send, &[t.c_mr.sge(0, 65)])])
        .unwrap();
    let u = t.poll(true);
    assert_eq!(
        (u.opcode, u.tm_match, u.byte_len),
        (WcOpcode::TmRecv, false, 65)
    );
    // An unknown TMH opcode: the sender's QP gets an invalid-request NAK.
    t.c_buf.write(0, &[0x42]).unwrap();
    t.c_qp
        .post_send(&[SendWr::new(2, WrOp::Send, &[t.c_mr.sge(0, 64)])])
        .unwrap();
    let mut got = None;
    while got.is_none() {
        let mut wc = [WorkCompletion::default(); 1];
        if t.c_cq.poll_ready(&mut wc) == 1 && wc[0].wr_id == 2 {
            got = Some(wc[0]);
        } else {
            assert!(t.fabric.step());
        }
    }
    assert_eq!(got.unwrap().status, WcStatus::RemInvReqErr);
    assert_eq!(
        t.srq.tm_free_tags(),
        15,
        "the entry for 0x77 is still listed"
    );
    // The TM-SRQ still serves a fresh pair of QPs, and its entry still matches.
    let mut ci = QpInit::new(&t.c_cq, &t.c_cq);
    ci.max_inline = 64;
    let mut c2 = t._pds.0.create_qp(&ci).unwrap();
    let mut si = QpInit::new(&t.s_cq, &t.s_cq);
    si.srq = Some(&t.srq);
    let mut s2 = t._pds.1.create_qp(&si).unwrap();
    let o = ConnectOptions {
        path_mtu: 3,
        ..Default::default()
    };
    c2.connect(&s2.endpoint(1), 1, &o).unwrap();
    s2.connect(&c2.endpoint(1), 1, &o).unwrap();
    let mut msg = Tmh {
        opcode: TmhOp::Eager as u8,
        app_ctx: 3,
        tag: 0x77,
    }
    .to_bytes()
    .to_vec();
    msg.extend_from_slice(b"still serving");
    c2.post_send(&[SendWr::inline(7, WrOp::Send, &msg)])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    let m = loop {
        if t.s_cq.poll_ready(&mut wc) == 1 && wc[0].opcode == WcOpcode::TmRecv {
            break wc[0];
        }
        assert!(t.fabric.step());
    };
    assert_eq!(
        (m.wr_id, m.tm_match, m.byte_len, m.qpn),
        (1, true, 13, s2.qpn())
    );
    let mut got = [0u8; 13];
    t.s_buf.read(0, &mut got).unwrap();
    assert_eq!(&got, b"still serving");
}

#[test]
fn a_send_posted_while_the_nic_reads_a_rendezvous_goes_out_behind_it() {
    let mut t = setup(16, 16);
    // Move the server's send queue index well past its ring size first.
    let remote = RemoteAddr {
        addr: t.c_mr.addr() + 30000,
        rkey: t.c_mr.rkey(),
    };
    for i in 0..300 {
        t.s_qp
            .post_send(&[SendWr::new(i, WrOp::Write(remote), &[t.s_mr.sge(0, 8)])])
            .unwrap();
        assert_eq!(t.poll(true).status, WcStatus::Success);
    }
    add(&mut t, 1, 0x66, u64::MAX, 0, 16384, None);
    rndv_request(&mut t, 0x66, 12000);
    // The NIC's READ is at the head of the server's send side now: a SEND posted meanwhile
    // must still be taken (the NIC's own work holds no send-queue slot).
    t.s_buf.write(20000, b"behind the read").unwrap();
    t.s_qp
        .post_send(&[SendWr::new(77, WrOp::Send, &[t.s_mr.sge(20000, 15)])])
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let wc = t.poll(true);
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        seen.push((wc.wr_id, wc.opcode, wc.tm_data_valid));
    }
    assert_eq!(
        seen,
        vec![
            (1, WcOpcode::TmRecv, false),
            (1, WcOpcode::TmRecv, true),
            (77, WcOpcode::Send, false)
        ]
    );
    // The client gets the SEND, then the FIN: the NIC queues the FIN when its READ is done,
    // behind the SEND posted while the READ was under way.
    let (s, f) = (t.poll(false), t.poll(false));
    assert_eq!((s.opcode, s.byte_len, f.byte_len), (WcOpcode::Recv, 15, 32));
    let mut got = vec![0u8; 12000];
    t.s_buf.read(0, &mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
}

#[test]
fn a_rendezvous_arriving_before_rts_is_left_to_software() {
    let fabric = Fabric::new(FabricConfig::new(2, 78));
    let (cd, sd) = (
        Device::open(Box::new(fabric.port(0))).unwrap(),
        Device::open(Box::new(fabric.port(1))).unwrap(),
    );
    let (cp, sp) = (cd.alloc_pd().unwrap(), sd.alloc_pd().unwrap());
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let (c_buf, s_buf) = (
        cd.alloc_dma(1 << 16).unwrap(),
        sd.alloc_dma(1 << 16).unwrap(),
    );
    let (c_mr, s_mr) = (
        cp.reg_mr(&c_buf, access).unwrap(),
        sp.reg_mr(&s_buf, access).unwrap(),
    );
    let (mut c_cq, mut s_cq) = (cd.create_cq(64).unwrap(), sd.create_cq(64).unwrap());
    let mut srq = sp.create_tm_srq(&s_cq, 16, 1, 16, 16).unwrap();
    let mut c_qp = cp.create_qp(&QpInit::new(&c_cq, &c_cq)).unwrap();
    let mut si = QpInit::new(&s_cq, &s_cq);
    si.srq = Some(&srq);
    let mut s_qp = sp.create_qp(&si).unwrap();
    srq.post_recv(&[RecvWr {
        wr_id: 5,
        sgl: &[s_mr.sge(0, 1024)],
    }])
    .unwrap();
    let mut op = [TmOp::add(1, 1, s_mr.sge(4096, 8192), 0x77, u64::MAX)];
    srq.post_tm_ops(&mut op).unwrap();
    // The server stops at RTR; the client is RTS and sends a rendezvous request.
    let o = ConnectOptions {
        path_mtu: 3,
        ..Default::default()
    };
    c_qp.connect(&s_qp.endpoint(10), 20, &o).unwrap();
    use ringbell_specs::cmd::{QpAttr, QpAttrMask as M};
    let init = QpAttr {
        state: QpState::Init as u8,
        access: access.bits().into(),
        ..Default::default()
    };
    s_qp.modify(M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, &init)
        .unwrap();
    let c = c_qp.endpoint(20);
    let rtr = QpAttr {
        state: QpState::Rtr as u8,
        path_mtu: 3,
        dest_qpn: c.qpn.into(),
        rq_psn: c.psn.into(),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        dest_mac: c.mac,
        dest_ip: c.ip,
        ..Default::default()
    };
    let m = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN;
    s_qp.modify(m | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER, &rtr)
        .unwrap();
    c_buf
        .write(
            0,
            &Tmh {
                opcode: TmhOp::Rndv as u8,
                app_ctx: 3,
                tag: 0x77,
            }
            .to_bytes(),
        )
        .unwrap();
    c_buf
        .write(
            16,
            &Rvh {
                va: c_mr.addr() + 8192,
                rkey: c_mr.rkey(),
                len: 5000,
            }
            .to_bytes(),
        )
        .unwrap();
    c_qp.post_send(&[SendWr::new(1, WrOp::Send, &[c_mr.sge(0, 32)])])
        .unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    let mut got = Vec::new();
    while got.len() < 2 {
        let n = s_cq.poll_ready(&mut wc);
        got.extend_from_slice(&wc[..n]);
        if n == 0 {
            assert!(fabric.step(), "fabric idle: {got:?}");
        }
    }
    // The ADD, then the request as an unexpected message in the untagged buffer.
    assert_eq!(got[0].opcode, WcOpcode::TmAdd);
    assert_eq!(
        (
            got[1].wr_id,
            got[1].opcode,
            got[1].tm_match,
            got[1].byte_len
        ),
        (5, WcOpcode::TmRecv, false, 32)
    );
    let _ = c_cq.poll_ready(&mut wc);
}

#[test]
fn resetting_the_qp_during_a_hardware_rendezvous_flushes_its_tagged_buffer() {
    let mut t = setup(16, 16);
    add(&mut t, 1, 0x67, u64::MAX, 0, 60000, None);
    assert_eq!(t.srq.tm_free_tags(), 15);
    rndv_request(&mut t, 0x67, 50000);
    let m = t.poll(true);
    assert_eq!((m.wr_id, m.tm_match, m.tm_data_valid), (1, true, false));
    // The NIC's READ is under way; the QP goes back to RESET.
    t.s_qp
        .modify(
            ringbell_specs::cmd::QpAttrMask::STATE,
            &ringbell_specs::cmd::QpAttr {
                state: QpState::Reset as u8,
                ..Default::default()
            },
        )
        .unwrap();
    let wc = t.poll(true);
    assert_eq!(
        (
            wc.wr_id,
            wc.opcode,
            wc.status,
            wc.tm_data_valid,
            wc.byte_len
        ),
        (1, WcOpcode::TmRecv, WcStatus::WrFlushErr, false, 0)
    );
    assert_eq!(
        t.srq.tm_free_tags(),
        16,
        "the tagged buffer's slot is free again"
    );
    // Nothing else comes: no FIN, no second completion.
    t.fabric.run_until_idle(u64::MAX);
    assert_eq!(t.s_cq.poll_ready(&mut [WorkCompletion::default(); 4]), 0);
}

#[test]
fn the_nics_reads_wait_for_max_rd_atomic() {
    // max_rd_atomic is 1 on both sides: the second rendezvous READ waits for the first.
    let mut t = setup(16, 16);
    add(&mut t, 1, 0x71, u64::MAX, 0, 8192, None);
    add(&mut t, 2, 0x72, u64::MAX, 16384, 8192, None);
    let data: Vec<u8> = (0..8000u32).map(|i| (i % 253) as u8).collect();
    t.c_buf.write(4096, &data).unwrap();
    for (at, tag) in [(0usize, 0x71u64), (64, 0x72)] {
        write_rndv(&t, at, tag, tag as u32, 4096, 8000);
    }
    let fins = [[t.c_mr.sge(20000, 64)], [t.c_mr.sge(20064, 64)]];
    t.c_qp.post_recv(&ringbell_tests::recv_wrs(&fins)).unwrap();
    t.c_qp
        .post_send(&[
            SendWr::new(1, WrOp::Send, &[t.c_mr.sge(0, 32)]),
            SendWr::new(2, WrOp::Send, &[t.c_mr.sge(64, 32)]),
        ])
        .unwrap();
    let mut data_done = Vec::new();
    while data_done.len() < 2 {
        let wc = t.poll(true);
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        if wc.tm_data_valid {
            data_done.push((wc.wr_id, wc.timestamp_ps));
        }
    }
    assert_eq!((data_done[0].0, data_done[1].0), (1, 2));
    // Pipelined, the second READ's data would follow the first's by its serialization
    // (about 0.7 µs); waiting for the first READ's answer adds a round trip.
    let gap = data_done[1].1 - data_done[0].1;
    assert!(gap > 1_500_000, "gap {gap} ps");
    let mut got = vec![0u8; 8000];
    t.s_buf.read(16384, &mut got).unwrap();
    assert_eq!(got, data);
}
