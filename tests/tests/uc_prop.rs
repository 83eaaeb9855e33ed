//! Property test: random UC traffic on a lossy fabric, against a reference model.
//!
//! Node 0's UC QP sends node 1's UC QP a random list of messages (SEND, SEND_WITH_IMM,
//! WRITE, WRITE_WITH_IMM; 0..=1500 bytes at path MTU 256, so up to six packets; some WRITEs
//! with a bad R_Key) over links that lose, duplicate, hold back and corrupt frames at random
//! rates. Node 1 has a random list of receive WQEs posted (some too small).
//!
//! What reached node 1's QP, in order, is read from the fabric's timeline: every frame a NIC
//! takes off the wire (its ICRC good) is an `Rx` stage with its PSN, which names the message
//! and the packet. The reference model replays those arrivals through the UC receive rules of
//! ABI.md 19.4, written here from the text at message level:
//!
//! - a PSN other than the expected one, or a FIRST/ONLY packet, ends the message in progress
//!   (a SEND's receive WQE waits for the next SEND or WRITE_WITH_IMM, from its start);
//! - a MIDDLE/LAST with no message in progress, a SEND with no receive WQE or longer than its
//!   WQE, a WRITE with a bad R_Key, or a WRITE_WITH_IMM's last packet with no receive WQE is
//!   dropped (counted), and so is the rest of its message;
//! - otherwise the packet's bytes land, and a LAST/ONLY completes the message.
//!
//! The test checks that every send completes once, in order, SUCCESS (UC never tells the
//! sender); that node 1's receive completions are exactly the model's (which WQE, in order,
//! opcode, length, immediate) and each buffer holds its message byte for byte; that node 1's
//! write area is byte for byte the model's image (including the first packets of WRITEs lost
//! later); that `uc_dropped` and `out_of_sequence` are the model's; and that no frame ever
//! went from node 1 to node 0.

use proptest::prelude::*;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultPlan, LinkFaults};
use ringbell_model::Stage;
use ringbell_specs::wire::Opcode;
use ringbell_tests::{lossy_links, poll_all, settle};
use std::collections::VecDeque;

const MTU: u32 = 256;
const BUF: usize = 1 << 20;
/// Node 1: receive buffers from here, one slot each.
const RECV_AREA: u64 = 0;
const RECV_SLOT: u64 = 2048;
/// Node 1: WRITE targets from here, one slot per message.
const WRITE_AREA: u64 = 512 << 10;
const WRITE_SLOT: u64 = 2048;
const SENTINEL: u8 = 0xEE;
const PSN0: u32 = 0xFF_FFF0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Send,
    SendImm,
    Write,
    WriteImm,
    /// A WRITE with a bad R_Key.
    BadWrite,
}

#[derive(Clone, Debug)]
struct Msg {
    kind: Kind,
    len: u32,
}

fn msg() -> impl Strategy<Value = Msg> {
    let kind = prop_oneof![
        3 => Just(Kind::Send),
        2 => Just(Kind::SendImm),
        3 => Just(Kind::Write),
        2 => Just(Kind::WriteImm),
        1 => Just(Kind::BadWrite),
    ];
    let len = prop_oneof![
        1 => Just(0u32),
        2 => 1u32..=MTU,
        3 => (MTU + 1)..=1500,
        1 => prop::sample::select(vec![MTU, 2 * MTU, 4 * MTU, 1500]),
    ];
    (kind, len).prop_map(|(kind, len)| Msg { kind, len })
}

use ringbell_tests::message_byte as byte;

fn npsn(len: u32) -> u32 {
    len.div_ceil(MTU).max(1)
}

/// A completed receive as the model predicts it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Recv {
    wqe: usize,
    op: WcOpcode,
    len: u32,
    imm: Option<u32>,
    /// The SEND whose bytes the buffer holds.
    data_of: Option<usize>,
}

/// The model's receiver.
#[derive(Default)]
struct Model {
    epsn: u32,
    /// The message in progress: (message, next packet, receive WQE for a SEND).
    cur: Option<(usize, u32, Option<usize>)>,
    parked: Option<usize>,
    rq: VecDeque<usize>,
    done: Vec<Recv>,
    dropped: u64,
    out_of_seq: u64,
    /// Node 1's write area.
    image: Vec<u8>,
}

impl Model {
    fn abandon(&mut self) {
        if let Some((_, _, Some(w))) = self.cur.take() {
            self.parked = Some(w);
        }
    }

    fn take_wqe(&mut self) -> Option<usize> {
        self.parked.take().or_else(|| self.rq.pop_front())
    }

    fn drop_packet(&mut self, psn: u32) {
        self.dropped += 1;
        self.abandon();
        self.epsn = (psn + 1) & 0xFF_FFFF;
    }

    fn arrive(&mut self, seed: u64, msgs: &[Msg], caps: &[u32], m: usize, j: u32, psn: u32) {
        let msg = &msgs[m];
        let n = npsn(msg.len);
        if psn != self.epsn {
            self.out_of_seq += 1;
            self.abandon();
        } else if j == 0 {
            self.abandon();
        }
        self.epsn = psn;
        let last = j + 1 == n;
        if j != 0 && self.cur.is_none_or(|(cm, cj, _)| (cm, cj) != (m, j)) {
            return self.drop_packet(psn);
        }
        let off = j * MTU;
        let plen = (msg.len - off).min(MTU);
        match msg.kind {
            Kind::Send | Kind::SendImm => {
                let wqe = match self.cur {
                    Some((_, _, w)) => w,
                    None => self.take_wqe(),
                };
                let Some(w) = wqe else {
                    return self.drop_packet(psn);
                };
                if off + plen > caps[w] {
                    // Too long for its WQE: the WQE waits for the next SEND.
                    self.cur = Some((m, j, Some(w)));
                    return self.drop_packet(psn);
                }
                if last {
                    self.cur = None;
                    self.done.push(Recv {
                        wqe: w,
                        op: WcOpcode::Recv,
                        len: msg.len,
                        imm: (msg.kind == Kind::SendImm).then_some(m as u32),
                        data_of: Some(m),
                    });
                } else {
                    self.cur = Some((m, j + 1, Some(w)));
                }
            }
            // A WRITE of no bytes checks no key (ABI.md 11.3).
            Kind::BadWrite if msg.len > 0 => return self.drop_packet(psn),
            Kind::Write | Kind::WriteImm | Kind::BadWrite => {
                let mut recv = None;
                if last && msg.kind == Kind::WriteImm {
                    match self.take_wqe() {
                        Some(w) => recv = Some(w),
                        None => return self.drop_packet(psn),
                    }
                }
                let base = (m as u64 * WRITE_SLOT) as usize;
                for i in off..off + plen {
                    self.image[base + i as usize] = byte(seed, m, i as usize);
                }
                if last {
                    self.cur = None;
                    if let Some(w) = recv {
                        self.done.push(Recv {
                            wqe: w,
                            op: WcOpcode::RecvRdmaWithImm,
                            len: msg.len,
                            imm: Some(m as u32),
                            data_of: None,
                        });
                    }
                } else {
                    self.cur = Some((m, j + 1, None));
                }
            }
        }
        self.epsn = (psn + 1) & 0xFF_FFFF;
    }
}

struct End {
    qp: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
    buf: DmaBuffer,
    _pd: ProtectionDomain,
    dev: Device,
}

fn end(f: &Fabric, node: usize) -> End {
    let dev = Device::open(Box::new(f.port(node))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(BUF).unwrap();
    buf.write(0, &vec![SENTINEL; BUF]).unwrap();
    let mr = pd
        .reg_mr(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let cq = dev.create_cq(1024).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.qp_type = QpType::Uc;
    init.max_send_wr = 128;
    init.max_recv_wr = 128;
    let qp = pd.create_qp(&init).unwrap();
    End {
        qp,
        cq,
        mr,
        buf,
        _pd: pd,
        dev,
    }
}

fn run(seed: u64, msgs: Vec<Msg>, caps: Vec<u32>, links: LinkFaults) {
    let mut cfg = FabricConfig::new(2, seed);
    cfg.faults = FaultPlan {
        links,
        ..Default::default()
    };
    let fabric = Fabric::new(cfg);
    let mut a = end(&fabric, 0);
    let mut b = end(&fabric, 1);
    let o = ConnectOptions {
        path_mtu: 1,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ..Default::default()
    };
    let (ea, eb) = (a.qp.endpoint(PSN0), b.qp.endpoint(0));
    a.qp.connect(&eb, PSN0, &o).unwrap();
    b.qp.connect(&ea, 0, &o).unwrap();
    for (i, &c) in caps.iter().enumerate() {
        let sge = [b.mr.sge(RECV_AREA + i as u64 * RECV_SLOT, c)];
        b.qp.post_recv(&[RecvWr {
            wr_id: i as u64,
            sgl: &sge,
        }])
        .unwrap();
    }
    // Every message's payload, each at its own offset of node 0's buffer.
    for (m, msg) in msgs.iter().enumerate() {
        let data: Vec<u8> = (0..msg.len as usize).map(|i| byte(seed, m, i)).collect();
        a.buf.write(m * 2048, &data).unwrap();
    }
    settle(&fabric);
    fabric.start_timeline(1_000_000).unwrap();
    let mut first_psn = Vec::new();
    let mut psn = PSN0;
    let mut wc = [WorkCompletion::default(); 32];
    let mut sent = Vec::new();
    for (m, msg) in msgs.iter().enumerate() {
        first_psn.push(psn);
        psn = (psn + npsn(msg.len)) & 0xFF_FFFF;
        let sge = [a.mr.sge(m as u64 * 2048, msg.len)];
        let remote = RemoteAddr {
            addr: b.mr.addr() + WRITE_AREA + m as u64 * WRITE_SLOT,
            rkey: b.mr.rkey(),
        };
        let op = match msg.kind {
            Kind::Send => WrOp::Send,
            Kind::SendImm => WrOp::SendImm(m as u32),
            Kind::Write => WrOp::Write(remote),
            Kind::WriteImm => WrOp::WriteImm(remote, m as u32),
            Kind::BadWrite => WrOp::Write(RemoteAddr {
                rkey: remote.rkey ^ 0x300,
                ..remote
            }),
        };
        // Keep the send queue from filling: wait for completions when it is half full.
        while a.qp.sq_free() < 8 {
            let k = a.cq.poll_ready(&mut wc);
            sent.extend_from_slice(&wc[..k]);
            if k == 0 {
                assert!(fabric.step(), "idle with the send queue full");
            }
        }
        a.qp.post_send(&[SendWr::new(m as u64, op, &sge)]).unwrap();
    }
    settle(&fabric);
    sent.extend(poll_all(&mut a.cq));
    let tl = fabric.take_timeline().unwrap();
    assert_eq!(tl.dropped(), 0, "timeline cap too small");

    // Every send completes once, in order, SUCCESS.
    assert_eq!(sent.len(), msgs.len());
    for (m, w) in sent.iter().enumerate() {
        assert_eq!((w.wr_id, w.status), (m as u64, WcStatus::Success), "{w:?}");
    }

    // Replay the arrivals.
    let span: u32 = msgs.iter().map(|m| npsn(m.len)).sum();
    let packet_of = |p: u32| -> (usize, u32) {
        let d = p.wrapping_sub(PSN0) & 0xFF_FFFF;
        assert!(d < span, "a PSN nobody sent: {p:#x}");
        let m = first_psn
            .iter()
            .rposition(|&f| (f.wrapping_sub(PSN0) & 0xFF_FFFF) <= d)
            .unwrap();
        (m, d - (first_psn[m].wrapping_sub(PSN0) & 0xFF_FFFF))
    };
    let mut model = Model {
        epsn: PSN0,
        rq: (0..caps.len()).collect(),
        image: vec![SENTINEL; (msgs.len() as u64 * WRITE_SLOT) as usize],
        ..Default::default()
    };
    for e in tl.events().iter().filter(|e| e.ev.stage == Stage::Rx) {
        assert_eq!(e.node, 1, "a frame went back to the sender: {e:?}");
        assert_eq!(e.ev.qpn, b.qp.qpn());
        let (m, j) = packet_of(e.ev.psn);
        assert!(Opcode::from_u8(e.ev.op).is_some_and(Opcode::is_uc), "{e:?}");
        model.arrive(seed, &msgs, &caps, m, j, e.ev.psn);
    }

    // Receive completions as the model says, each buffer holding its message.
    let got = poll_all(&mut b.cq);
    let want = &model.done;
    assert_eq!(got.len(), want.len(), "got {got:?}\nwant {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.status, WcStatus::Success, "{g:?}");
        assert_eq!(
            (g.wr_id, g.opcode, g.byte_len, g.imm),
            (w.wqe as u64, w.op, w.len, w.imm),
            "{w:?}"
        );
        if let Some(m) = w.data_of {
            let mut v = vec![0u8; w.len as usize];
            b.buf
                .read((RECV_AREA + w.wqe as u64 * RECV_SLOT) as usize, &mut v)
                .unwrap();
            let want: Vec<u8> = (0..w.len as usize).map(|i| byte(seed, m, i)).collect();
            assert!(v == want, "receive {} does not hold message {m}", w.wqe);
        }
    }
    let mut image = vec![0u8; model.image.len()];
    b.buf.read(WRITE_AREA as usize, &mut image).unwrap();
    assert!(
        image == model.image,
        "the write area differs from the model's"
    );
    let st = b.qp.stats().unwrap();
    assert_eq!(
        (st.uc_dropped, st.out_of_sequence),
        (model.dropped, model.out_of_seq)
    );
    assert_eq!(st.naks_sent + st.seq_naks_sent + st.rnr_naks_sent, 0);
    assert_eq!(a.dev.port_stats().unwrap().rx_frames, 0);
    assert_eq!(b.qp.query_state().unwrap(), QpState::Rts);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn lossy_uc_traffic_matches_the_reference_model(
        seed in any::<u64>(),
        msgs in proptest::collection::vec(msg(), 1..=40),
        caps in proptest::collection::vec(
            prop_oneof![1 => 1u32..=300, 3 => 301u32..=1600, 2 => Just(2048u32)],
            0..=40,
        ),
        drop_ppm in prop_oneof![2 => Just(0u32), 3 => 0u32..=150_000],
        duplicate_ppm in prop_oneof![3 => Just(0u32), 1 => 0u32..=100_000],
        reorder_ppm in prop_oneof![3 => Just(0u32), 1 => 0u32..=100_000],
        corrupt_ppm in prop_oneof![3 => Just(0u32), 1 => 0u32..=50_000],
    ) {
        let links = lossy_links(drop_ppm, duplicate_ppm, reorder_ppm, corrupt_ppm);
        run(seed, msgs, caps, links);
    }
}

/// Without faults every message arrives whole: the model agrees with the simple answer.
#[test]
fn a_quiet_link_delivers_everything() {
    let msgs: Vec<Msg> = [
        (Kind::Send, 1500),
        (Kind::WriteImm, 700),
        (Kind::Write, 0),
        (Kind::SendImm, 0),
    ]
    .into_iter()
    .map(|(kind, len)| Msg { kind, len })
    .collect();
    run(7, msgs, vec![2048, 16, 2048], LinkFaults::default());
}
