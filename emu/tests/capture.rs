//! Packet capture: the pcapng file a fabric writes, read back with a parser of our own and,
//! where it is installed, with tshark.

use rand_core::RngCore;
use ringbell::*;
use ringbell_emu::{Fabric, FabricConfig, FaultRule, FrameKind, FrameMatch};
use ringbell_specs::wire::{parse_packet, Opcode};
use std::cell::RefCell;
use std::io::{self, Write};
use std::path::Path;
use std::process::Command;
use std::rc::Rc;

/// A `Write` whose bytes the test can still read after the fabric took it.
#[derive(Clone, Default)]
struct Sink(Rc<RefCell<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct Side {
    qp: QueuePair,
    /// Created first so that `qp` is not QP 1: InfiniBand reserves QPs 0 and 1 (SMI, GSI),
    /// and Wireshark dissects the payload of any packet to QP 1 as a management datagram.
    _spare: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
    buf: DmaBuffer,
    _pd: ProtectionDomain,
    _dev: Device,
}

fn side(fabric: &Fabric, node: usize) -> Side {
    side_of(fabric, node, QpType::Rc)
}

/// [`side`] with a QP of transport `qp_type` (the spare QP is RC).
fn side_of(fabric: &Fabric, node: usize, qp_type: QpType) -> Side {
    let dev = Device::open(Box::new(fabric.port(node))).unwrap();
    let pd = dev.alloc_pd().unwrap();
    let buf = dev.alloc_dma(1 << 16).unwrap();
    let mr = pd
        .reg_mr(
            &buf,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let cq = dev.create_cq(64).unwrap();
    let mut init = QpInit::new(&cq, &cq);
    init.max_send_wr = 16;
    init.max_recv_wr = 16;
    let spare = pd.create_qp(&init).unwrap();
    init.qp_type = qp_type;
    let qp = pd.create_qp(&init).unwrap();
    assert!(qp.qpn() >= 2);
    Side {
        qp,
        _spare: spare,
        cq,
        mr,
        buf,
        _pd: pd,
        _dev: dev,
    }
}

/// Steps the fabric until `s` has a completion; returns it.
fn wait(fabric: &Fabric, s: &mut Side) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    for _ in 0..1_000_000 {
        if s.cq.poll_ready(&mut wc) == 1 {
            assert_eq!(wc[0].status, WcStatus::Success, "{:?}", wc[0]);
            return wc[0];
        }
        assert!(fabric.step(), "fabric went idle before a completion");
    }
    panic!("no completion");
}

/// What the exchange posted: the requests node 0 sent, in order.
#[derive(Debug)]
struct Sent {
    qpn_a: u32,
    qpn_b: u32,
    /// (opcode, PSN, RETH DMA length) of each request packet from A.
    requests: Vec<(u8, u32, Option<u32>)>,
}

const WRITE_LEN: u32 = 6000;
const SEND_LEN: u32 = 64;
const READ_LEN: u32 = 5000;

/// Two nodes; with the capture running from the start, A WRITEs 6000 B to B (two packets at
/// path MTU 4096), SENDs 64 B that B receives, and READs 5000 B from B (two response packets).
fn exchange(seed: u64, out: Option<Sink>, drop: Option<FaultRule>) -> (Fabric, Sent) {
    let fabric = Fabric::new(FabricConfig::new(2, seed));
    if let Some(out) = out {
        fabric.start_capture(out).unwrap();
    }
    if let Some(rule) = drop {
        fabric.add_fault_rule(rule);
    }
    let mut a = side(&fabric, 0);
    let mut b = side(&fabric, 1);
    let mut rng = fabric.rng(1);
    let (pa, pb) = (rng.next_u32() & 0xFF_FFFF, rng.next_u32() & 0xFF_FFFF);
    let (ea, eb) = (a.qp.endpoint(pa), b.qp.endpoint(pb));
    let opts = ConnectOptions::default();
    a.qp.connect(&eb, pa, &opts).unwrap();
    b.qp.connect(&ea, pb, &opts).unwrap();
    assert_eq!(fabric.stats().frames_delivered, 0, "set-up sends no frame");

    let psn = |i: u32| (pa + i) & 0xFF_FFFF;
    a.buf.write(0, &[0x5A; WRITE_LEN as usize]).unwrap();
    let remote = RemoteAddr {
        addr: b.mr.addr() + 0x1000,
        rkey: b.mr.rkey(),
    };
    let sge = [a.mr.sge(0, WRITE_LEN)];
    a.qp.post_send(&[SendWr::new(1, WrOp::Write(remote), &sge)])
        .unwrap();
    assert_eq!(wait(&fabric, &mut a).wr_id, 1);

    let rs = [b.mr.sge(0x8000, SEND_LEN)];
    b.qp.post_recv(&[RecvWr { wr_id: 7, sgl: &rs }]).unwrap();
    let sge = [a.mr.sge(0, SEND_LEN)];
    a.qp.post_send(&[SendWr::new(2, WrOp::Send, &sge)]).unwrap();
    assert_eq!(wait(&fabric, &mut a).wr_id, 2);
    assert_eq!(wait(&fabric, &mut b).wr_id, 7);

    let remote = RemoteAddr {
        addr: b.mr.addr(),
        rkey: b.mr.rkey(),
    };
    let sge = [a.mr.sge(0x8000, READ_LEN)];
    a.qp.post_send(&[SendWr::new(3, WrOp::Read(remote), &sge)])
        .unwrap();
    assert_eq!(wait(&fabric, &mut a).wr_id, 3);
    fabric.run_until_quiet();

    let sent = Sent {
        qpn_a: a.qp.qpn(),
        qpn_b: b.qp.qpn(),
        requests: vec![
            (Opcode::WriteFirst as u8, psn(0), Some(WRITE_LEN)),
            (Opcode::WriteLast as u8, psn(1), None),
            (Opcode::SendOnly as u8, psn(2), None),
            (Opcode::ReadRequest as u8, psn(3), Some(READ_LEN)),
        ],
    };
    (fabric, sent)
}

/// One Enhanced Packet Block.
#[derive(Debug, Clone)]
struct Epb {
    interface: u32,
    ts_ns: u64,
    data: Vec<u8>,
    comment: Option<String>,
    flags: Option<u32>,
}

/// A pcapng file as this test reads it: the blocks' types in order, the interfaces' names
/// and `if_tsresol`, and the packets.
#[derive(Debug, Default)]
struct Pcapng {
    types: Vec<u32>,
    interfaces: Vec<(u16, Option<String>, Option<u8>)>,
    packets: Vec<Epb>,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// (code, value) of each option in `b`, up to opt_endofopt.
fn options(mut b: &[u8]) -> Vec<(u16, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 4 {
        let code = u16::from_le_bytes([b[0], b[1]]);
        let len = u16::from_le_bytes([b[2], b[3]]) as usize;
        if code == 0 {
            assert_eq!(len, 0, "opt_endofopt has length 0");
            return out;
        }
        assert!(4 + len <= b.len(), "option overruns its block");
        out.push((code, b[4..4 + len].to_vec()));
        b = &b[4 + len.next_multiple_of(4)..];
    }
    assert!(b.is_empty(), "options end mid-option");
    out
}

/// A strict little-endian pcapng reader: every block well-formed, lengths consistent.
fn parse(file: &[u8]) -> Pcapng {
    let mut p = Pcapng::default();
    let mut at = 0;
    while at < file.len() {
        assert!(at + 12 <= file.len(), "truncated block at {at}");
        let ty = le32(file, at);
        let len = le32(file, at + 4) as usize;
        assert!(
            len >= 12 && len.is_multiple_of(4),
            "block length {len} at {at}"
        );
        assert!(at + len <= file.len(), "block at {at} overruns the file");
        assert_eq!(le32(file, at + len - 4) as usize, len, "trailing length");
        let body = &file[at + 8..at + len - 4];
        match ty {
            0x0A0D_0D0A => {
                assert_eq!(
                    le32(body, 0),
                    0x1A2B_3C4D,
                    "byte-order magic, little-endian"
                );
                assert_eq!(&body[4..8], &[1, 0, 0, 0], "version 1.0");
                assert_eq!(&body[8..16], &[0xFF; 8], "section length unspecified");
            }
            1 => {
                let linktype = u16::from_le_bytes([body[0], body[1]]);
                let opts = options(&body[8..]);
                let name = opts
                    .iter()
                    .find(|o| o.0 == 2)
                    .map(|o| String::from_utf8(o.1.clone()).unwrap());
                let tsresol = opts.iter().find(|o| o.0 == 9).map(|o| o.1[0]);
                p.interfaces.push((linktype, name, tsresol));
            }
            6 => {
                let caplen = le32(body, 12) as usize;
                assert_eq!(le32(body, 16) as usize, caplen, "nothing truncated");
                let data = body[20..20 + caplen].to_vec();
                let opts = options(&body[20 + caplen.next_multiple_of(4)..]);
                p.packets.push(Epb {
                    interface: le32(body, 0),
                    ts_ns: (le32(body, 4) as u64) << 32 | le32(body, 8) as u64,
                    data,
                    comment: opts
                        .iter()
                        .find(|o| o.0 == 1)
                        .map(|o| String::from_utf8(o.1.clone()).unwrap()),
                    flags: opts
                        .iter()
                        .find(|o| o.0 == 2)
                        .map(|o| u32::from_le_bytes(o.1[..4].try_into().unwrap())),
                });
            }
            t => panic!("unexpected block type {t:#x}"),
        }
        p.types.push(ty);
        at += len;
    }
    p
}

/// BTH fields of a frame: (opcode, dest QP, PSN).
fn bth(f: &[u8]) -> (u8, u32, u32) {
    let p = parse_packet(f).expect("a valid RoCEv2 frame with a correct ICRC");
    (
        p.repr.bth.opcode,
        p.repr.bth.dest_qp.get(),
        p.repr.bth.psn.get(),
    )
}

#[test]
fn capture_holds_every_frame_with_simulated_ns_timestamps_and_comments() {
    let out = Sink::default();
    let (fabric, sent) = exchange(11, Some(out.clone()), None);
    let st = fabric.stop_capture().unwrap();
    let file = out.0.borrow().clone();
    let p = parse(&file);

    // Block structure: one section header, an interface per node plus "inject", then packets.
    assert_eq!(p.types[0], 0x0A0D_0D0A);
    assert_eq!(&p.types[1..4], &[1, 1, 1]);
    assert!(p.types[4..].iter().all(|&t| t == 6));
    assert_eq!(
        p.interfaces,
        vec![
            (1, Some("node0".into()), Some(9)),
            (1, Some("node1".into()), Some(9)),
            (1, Some("inject".into()), Some(9)),
        ]
    );

    // One EPB per frame the fabric carried.
    let fs = fabric.stats();
    assert_eq!(p.packets.len() as u64, fs.frames_delivered);
    assert_eq!(st.frames, fs.frames_delivered);
    assert_eq!(st.lost, 0);
    assert_eq!(
        st.bytes,
        p.packets.iter().map(|e| e.data.len() as u64).sum::<u64>()
    );
    assert!(p.packets.len() >= 8, "{} packets", p.packets.len());

    // Timestamps: simulated ns, never backwards, within the run.
    let end_ns = fabric.now().ps() / 1000;
    let mut last = 0;
    for e in &p.packets {
        assert!(e.ts_ns >= last, "timestamps go backwards");
        last = e.ts_ns;
    }
    assert!(
        p.packets[0].ts_ns > 0 && last <= end_ns,
        "{last} > {end_ns}"
    );
    assert!(end_ns < 1_000_000_000, "simulated, not wall-clock, time");

    // Every frame: valid RoCEv2 (ICRC checked), outbound on its sender's interface, with a
    // comment naming sender, receiver, opcode, QPs and PSN.
    let mut requests = Vec::new();
    for e in &p.packets {
        let (op, dqpn, psn) = bth(&e.data);
        let from = e.interface;
        assert!(from < 2);
        assert_eq!(e.flags, Some(2), "outbound");
        let (dst, src) = if from == 0 {
            (sent.qpn_b, sent.qpn_a)
        } else {
            (sent.qpn_a, sent.qpn_b)
        };
        assert_eq!(dqpn, dst);
        let c = e.comment.as_deref().expect("every packet has a comment");
        let name = Opcode::from_u8(op).unwrap().name();
        let head = format!(
            "node {from} -> node {}: {name}, dest QP {dst:#08x}",
            1 - from
        );
        assert!(c.starts_with(&head), "{c:?} vs {head:?}");
        assert!(c.ends_with(&format!(", PSN {psn}")), "{c}");
        if c.contains("src QP") {
            assert!(c.contains(&format!("src QP {src:#08x}")), "{c}");
        }
        if from == 0 {
            let pk = parse_packet(&e.data).unwrap();
            requests.push((op, psn, pk.repr.reth.map(|r| r.len)));
        }
    }
    assert_eq!(requests, sent.requests);
    // The source QP is learnt from the first frame back; everything after it names it.
    let later = p.packets.iter().skip_while(|e| e.interface == 0).skip(1);
    for e in later {
        assert!(e.comment.as_deref().unwrap().contains("src QP"), "{e:?}");
    }
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let run = |seed| {
        let out = Sink::default();
        let (fabric, _) = exchange(seed, Some(out.clone()), None);
        fabric.stop_capture().unwrap();
        let v = out.0.borrow().clone();
        v
    };
    let (a, b, c) = (run(5), run(5), run(6));
    assert!(!a.is_empty());
    assert_eq!(a, b, "same seed: byte-identical capture");
    assert_ne!(a, c, "other seed: other capture");
}

#[test]
fn capturing_does_not_change_the_simulation() {
    let with = exchange(5, Some(Sink::default()), None).0;
    let without = exchange(5, None, None).0;
    assert_eq!(with.trace_digest(), without.trace_digest());
    assert_eq!(with.stats(), without.stats());
    assert_eq!(with.now(), without.now());
}

#[test]
fn dropped_frames_are_captured_with_a_comment() {
    let rule = FaultRule::drop_nth(
        FrameMatch {
            from: Some(0),
            kind: Some(FrameKind::Request),
            ..Default::default()
        },
        3,
    );
    let out = Sink::default();
    let (fabric, sent) = exchange(11, Some(out.clone()), Some(rule));
    let st = fabric.stop_capture().unwrap();
    let p = parse(&out.0.borrow());
    let fs = fabric.fault_stats();
    assert_eq!(fs.rule_hits, 1);
    assert_eq!(st.lost, 1);
    assert_eq!(
        p.packets.len() as u64,
        fabric.stats().frames_delivered + 1,
        "delivered frames plus the one lost"
    );
    let lost: Vec<&Epb> = p
        .packets
        .iter()
        .filter(|e| {
            e.comment
                .as_deref()
                .unwrap()
                .ends_with("; dropped by fault injection")
        })
        .collect();
    assert_eq!(lost.len(), 1);
    // The third request (the SEND) was lost and sent again with the same PSN.
    let (op, _, psn) = bth(&lost[0].data);
    assert_eq!((op, psn), (sent.requests[2].0, sent.requests[2].1));
    let resent = p
        .packets
        .iter()
        .filter(|e| e.interface == 0 && bth(&e.data).2 == psn)
        .count();
    assert_eq!(resent, 2, "original and retransmission");
    let mut last = 0;
    for e in &p.packets {
        assert!(e.ts_ns >= last);
        last = e.ts_ns;
    }
}

#[test]
fn injected_frames_are_captured_on_the_inject_interface() {
    let out = Sink::default();
    let fabric = Fabric::new(FabricConfig::new(2, 1));
    fabric.start_capture(out.clone()).unwrap();
    assert!(
        fabric.start_capture(Sink::default()).is_err(),
        "one at a time"
    );
    fabric.inject_frame(1, vec![0xAB; 60]);
    fabric.run_until_idle(100);
    let st = fabric.stop_capture().unwrap();
    assert_eq!(st.frames, 1);
    assert_eq!(fabric.stop_capture().unwrap().frames, 0, "stopped already");
    let p = parse(&out.0.borrow());
    assert_eq!(p.packets.len(), 1);
    assert_eq!(p.packets[0].interface, 2);
    assert_eq!(
        p.packets[0].comment.as_deref(),
        Some("injected -> node 1: not a RoCEv2 frame")
    );
}

/// tshark on PATH, or `None` with a note (CI installs it; see .ci/run).
fn tshark() -> Option<&'static str> {
    match Command::new("tshark").arg("--version").output() {
        Ok(o) if o.status.success() => Some("tshark"),
        _ => {
            eprintln!("note: tshark is not on PATH; skipping the Wireshark decode check");
            None
        }
    }
}

/// Options of every tshark run: Wireshark 4.0's Mellanox EoIB heuristic, which it tries on
/// the payload of every UD SEND, throws on an empty payload and flags a correct datagram as
/// malformed; it is off. (It never runs on RC packets.)
const TSHARK_OPTS: [&str; 2] = ["--disable-heuristic", "mellanox_eoib"];

fn num(s: &str) -> u64 {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap(),
    }
}

/// Decodes `path` with tshark and checks every frame against our own parse of the file.
fn check_with_tshark(tshark: &str, path: &Path, file: &[u8]) -> Vec<Vec<String>> {
    let fields = [
        "frame.interface_name",
        "frame.time_epoch",
        "udp.dstport",
        "infiniband.bth.opcode",
        "infiniband.bth.destqp",
        "infiniband.bth.psn",
        "infiniband.reth.dmalen",
        "infiniband.aeth.syndrome",
        "infiniband.aeth.msn",
        "frame.comment",
        "infiniband.invariant.crc",
        "_ws.col.Info",
    ];
    let mut cmd = Command::new(tshark);
    cmd.args(TSHARK_OPTS)
        .arg("-r")
        .arg(path)
        .args(["-T", "fields", "-E", "separator=|"]);
    for f in fields {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<String>> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split('|').map(str::to_owned).collect())
        .collect();
    let p = parse(file);
    assert_eq!(rows.len(), p.packets.len(), "tshark sees every packet");
    for (r, e) in rows.iter().zip(&p.packets) {
        let pk = parse_packet(&e.data).unwrap();
        assert_eq!(r[0], format!("node{}", e.interface));
        // Nanosecond resolution survives: epoch seconds with nine decimals.
        let (s, ns) = r[1].split_once('.').unwrap();
        assert_eq!(ns.len(), 9, "{}", r[1]);
        assert_eq!(num(s) * 1_000_000_000 + num(ns), e.ts_ns);
        assert_eq!(r[2], "4791");
        assert_eq!(num(&r[3]), pk.repr.bth.opcode as u64, "opcode, {r:?}");
        assert_eq!(
            num(&r[4]),
            pk.repr.bth.dest_qp.get() as u64,
            "dest QP, {r:?}"
        );
        assert_eq!(num(&r[5]), pk.repr.bth.psn.get() as u64, "PSN, {r:?}");
        match pk.repr.reth {
            Some(reth) => assert_eq!(num(&r[6]), reth.len as u64, "RETH length, {r:?}"),
            None => assert_eq!(r[6], "", "no RETH, {r:?}"),
        }
        match pk.repr.aeth {
            Some(aeth) => {
                assert_eq!(num(&r[7]), aeth.syndrome.to_u8() as u64, "syndrome, {r:?}");
                assert_eq!(num(&r[8]), aeth.msn as u64, "MSN, {r:?}");
            }
            None => assert_eq!(r[7], "", "no AETH, {r:?}"),
        }
        assert_eq!(Some(r[9].as_str()), e.comment.as_deref());
        // Wireshark finds the ICRC where it is, except when it took the payload for a MAD.
        if pk.repr.bth.dest_qp.get() > 1 {
            let icrc = &e.data[e.data.len() - 4..];
            assert_eq!(
                num(&r[10]),
                u32::from_be_bytes(icrc.try_into().unwrap()) as u64
            );
            let transport = match Opcode::from_u8(pk.repr.bth.opcode) {
                Some(o) if o.is_ud() => "UD ",
                Some(o) if o.is_uc() => "UC ",
                _ => "RC ",
            };
            assert!(r[11].starts_with(transport), "{r:?}");
        }
    }
    // Nothing malformed, no warnings or errors from any dissector.
    let bad = Command::new(tshark)
        .args(TSHARK_OPTS)
        .arg("-r")
        .arg(path)
        .args(["-Y", "_ws.malformed || _ws.expert.severity >= \"Warning\""])
        .output()
        .unwrap();
    assert!(
        bad.status.success(),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&bad.stdout),
        "",
        "tshark flags these packets"
    );
    rows
}

#[test]
fn tshark_decodes_bth_reth_aeth_as_sent() {
    let Some(tshark) = tshark() else { return };
    let out = Sink::default();
    let (fabric, sent) = exchange(11, Some(out.clone()), None);
    fabric.stop_capture().unwrap();
    let dir = std::env::temp_dir().join(format!("ringbell-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("exchange.pcapng");
    let file = out.0.borrow().clone();
    std::fs::write(&path, &file).unwrap();
    let rows = check_with_tshark(tshark, &path, &file);
    // The requests as posted, read back by Wireshark.
    let reqs: Vec<(u8, u32, Option<u32>)> = rows
        .iter()
        .filter(|r| r[0] == "node0")
        .map(|r| {
            (
                num(&r[3]) as u8,
                num(&r[5]) as u32,
                (!r[6].is_empty()).then(|| num(&r[6]) as u32),
            )
        })
        .collect();
    assert_eq!(reqs, sent.requests);
    // Node 1 answers with ACKs (syndrome 0x1F: ACK, unlimited credits) and two READ responses.
    let resp: Vec<u8> = rows
        .iter()
        .filter(|r| r[0] == "node1")
        .map(|r| num(&r[3]) as u8)
        .collect();
    assert!(resp.contains(&(Opcode::Acknowledge as u8)));
    assert!(resp.ends_with(&[
        Opcode::ReadResponseFirst as u8,
        Opcode::ReadResponseLast as u8
    ]));
    for r in rows.iter().filter(|r| r[0] == "node1") {
        assert_eq!(num(&r[7]), 0x1F, "{r:?}");
        assert_eq!(num(&r[4]), sent.qpn_a as u64);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// UC (ABI 1.7): a SEND with immediate and a WRITE of three packets each at MTU 256, then a
/// WRITE with immediate of one, decoded by Wireshark as the UC opcodes they are, with the
/// RETH length and the ICRC as sent; nothing comes back.
#[test]
fn tshark_decodes_uc_frames_as_sent() {
    let Some(tshark) = tshark() else { return };
    let out = Sink::default();
    let fabric = Fabric::new(FabricConfig::new(2, 12));
    fabric.start_capture(out.clone()).unwrap();
    let mut a = side_of(&fabric, 0, QpType::Uc);
    let mut b = side_of(&fabric, 1, QpType::Uc);
    let opts = ConnectOptions {
        path_mtu: 1,
        ..Default::default()
    };
    let (ea, eb) = (a.qp.endpoint(200), b.qp.endpoint(300));
    a.qp.connect(&eb, 200, &opts).unwrap();
    b.qp.connect(&ea, 300, &opts).unwrap();
    let data: Vec<u8> = (0..600u32).map(|i| (i * 7 + 3) as u8).collect();
    a.buf.write(0, &data).unwrap();
    for id in [7, 8] {
        let rs = [b.mr.sge(0x8000, 1024)];
        b.qp.post_recv(&[RecvWr {
            wr_id: id,
            sgl: &rs,
        }])
        .unwrap();
    }
    let remote = RemoteAddr {
        addr: b.mr.addr() + 0x1000,
        rkey: b.mr.rkey(),
    };
    let sge = [a.mr.sge(0, 600)];
    a.qp.post_send(&[
        SendWr::new(1, WrOp::SendImm(5), &sge),
        SendWr::new(2, WrOp::Write(remote), &sge),
    ])
    .unwrap();
    let one = [a.mr.sge(0, 100)];
    a.qp.post_send(&[SendWr::new(3, WrOp::WriteImm(remote, 6), &one)])
        .unwrap();
    for id in [1, 2, 3] {
        assert_eq!(wait(&fabric, &mut a).wr_id, id);
    }
    for id in [7, 8] {
        assert_eq!(wait(&fabric, &mut b).wr_id, id);
    }
    fabric.stop_capture().unwrap();
    let dir = std::env::temp_dir().join(format!("ringbell-capture-uc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("uc.pcapng");
    let file = out.0.borrow().clone();
    std::fs::write(&path, &file).unwrap();
    let rows = check_with_tshark(tshark, &path, &file);
    use Opcode::*;
    let want = [
        UcSendFirst,
        UcSendMiddle,
        UcSendLastImm,
        UcWriteFirst,
        UcWriteMiddle,
        UcWriteLast,
        UcWriteOnlyImm,
    ];
    let got: Vec<(String, u8, u64)> = rows
        .iter()
        .map(|r| (r[0].clone(), num(&r[3]) as u8, num(&r[5])))
        .collect();
    let expect: Vec<(String, u8, u64)> = want
        .iter()
        .enumerate()
        .map(|(i, o)| ("node0".to_string(), o.to_u8(), 200 + i as u64))
        .collect();
    assert_eq!(got, expect);
    std::fs::remove_dir_all(&dir).unwrap();
}

const QKEY: u32 = 0x1234_5678;

/// Node 0's two UD QPs, both sending from PSN [`UD_PSN`], and node 1's UD QP.
struct UdNodes {
    a: [QueuePair; 2],
    b: QueuePair,
    a_cq: CompletionQueue,
    b_cq: CompletionQueue,
    a_mr: MemoryRegion,
    a_buf: DmaBuffer,
    b_mr: MemoryRegion,
    _b_buf: DmaBuffer,
    a_pd: ProtectionDomain,
    _b_pd: ProtectionDomain,
    _spares: [QueuePair; 2],
    _a_dev: Device,
    b_dev: Device,
}

const UD_PSN: u32 = 100;

fn ud_nodes(fabric: &Fabric) -> UdNodes {
    let open = |n: usize| {
        let dev = Device::open(Box::new(fabric.port(n))).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let buf = dev.alloc_dma(1 << 16).unwrap();
        let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE).unwrap();
        let cq = dev.create_cq(64).unwrap();
        (dev, pd, buf, mr, cq)
    };
    let (a_dev, a_pd, a_buf, a_mr, a_cq) = open(0);
    let (b_dev, b_pd, b_buf, b_mr, b_cq) = open(1);
    let ud = |pd: &ProtectionDomain, cq: &CompletionQueue| {
        let mut init = QpInit::new(cq, cq);
        init.qp_type = QpType::Ud;
        init.max_inline = 128;
        let mut qp = pd.create_qp(&init).unwrap();
        qp.ud_ready(QKEY, UD_PSN).unwrap();
        // Not QP 0 or 1: Wireshark dissects what goes to QP 1 as a management datagram.
        assert!(qp.qpn() >= 2);
        qp
    };
    // As in `side`: an RC QP first, so that no UD QP is QP 1.
    let spares = [
        a_pd.create_qp(&QpInit::new(&a_cq, &a_cq)).unwrap(),
        b_pd.create_qp(&QpInit::new(&b_cq, &b_cq)).unwrap(),
    ];
    UdNodes {
        a: [ud(&a_pd, &a_cq), ud(&a_pd, &a_cq)],
        b: ud(&b_pd, &b_cq),
        a_cq,
        b_cq,
        a_mr,
        a_buf,
        b_mr,
        _b_buf: b_buf,
        a_pd,
        _b_pd: b_pd,
        _spares: spares,
        _a_dev: a_dev,
        b_dev,
    }
}

/// One datagram as sent: (sending QP 0 or 1 of node 0, payload, immediate, inline).
type Dgram = (usize, Vec<u8>, Option<u32>, bool);

/// The datagrams [`ud_exchange`] sends: SEND_ONLY and SEND_ONLY_WITH_IMMEDIATE from both of
/// node 0's QPs, gathered and inline, one of them empty. The payloads start with two
/// non-zero bytes after two others: Wireshark takes a UD payload whose bytes 2..4 are zero
/// for an IPoIB header.
fn ud_datagrams() -> Vec<Dgram> {
    let body = |n: usize, salt: u8| -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(7) ^ salt | 1)
            .collect()
    };
    vec![
        (0, body(32, 0x10), None, false),
        (0, body(48, 0x20), Some(0xFEED_BEEF), true),
        (1, body(700, 0x30), None, false),
        (1, body(0, 0), Some(0x0102_0304), false),
        (1, body(20, 0x40), Some(0xA5A5_0001), true),
        (0, body(4096, 0x50), None, false),
    ]
}

/// Node 0 sends [`ud_datagrams`] to node 1's UD QP, which has a 4136-byte receive posted for
/// each; with `out`, the fabric captures it all; `rule` is added before anything is sent.
/// Returns the fabric, the QPs and the receive completions.
fn ud_exchange(
    seed: u64,
    out: Option<Sink>,
    rule: impl FnOnce(&UdNodes) -> Option<FaultRule>,
) -> (Fabric, UdNodes, Vec<WorkCompletion>) {
    let fabric = Fabric::new(FabricConfig::new(2, seed));
    if let Some(out) = out {
        fabric.start_capture(out).unwrap();
    }
    let mut u = ud_nodes(&fabric);
    if let Some(rule) = rule(&u) {
        fabric.add_fault_rule(rule);
    }
    let dgrams = ud_datagrams();
    for i in 0..dgrams.len() as u64 {
        let sge = [u.b_mr.sge(i * 8192, 4136)];
        u.b.post_recv(&[RecvWr {
            wr_id: i,
            sgl: &sge,
        }])
        .unwrap();
    }
    let ah = u.a_pd.create_ah(&u.b_dev.ah_attr()).unwrap();
    for (i, (q, data, imm, inline)) in dgrams.iter().enumerate() {
        let dest = UdDest {
            ah: &ah,
            qpn: u.b.qpn(),
            qkey: QKEY,
        };
        let op = match imm {
            Some(v) => WrOp::SendImm(*v),
            None => WrOp::Send,
        };
        let at = i as u64 * 8192;
        u.a_buf.write(at as usize, data).unwrap();
        let sge = [u.a_mr.sge(at, data.len() as u32)];
        let wr = match inline {
            true => SendWr::inline(i as u64, op, data),
            false => SendWr::new(i as u64, op, &sge),
        };
        u.a[*q].post_send(&[wr.to(dest)]).unwrap();
    }
    fabric.run_until_quiet();
    let mut wc = [WorkCompletion::default(); 16];
    let n = u.a_cq.poll_ready(&mut wc);
    assert_eq!(n, dgrams.len(), "a send completion for every datagram");
    assert!(
        wc[..n].iter().all(|w| w.status == WcStatus::Success),
        "the sender is never told: {:?}",
        &wc[..n]
    );
    let n = u.b_cq.poll_ready(&mut wc);
    let recvs = wc[..n].to_vec();
    (fabric, u, recvs)
}

/// The index in `dgrams` of the datagram node 0's QP `src_qpn` sent with PSN `psn`.
fn which(u: &UdNodes, dgrams: &[Dgram], src_qpn: u32, psn: u32) -> usize {
    let q =
        u.a.iter()
            .position(|qp| qp.qpn() == src_qpn)
            .expect("a sending QP");
    dgrams
        .iter()
        .enumerate()
        .filter(|(_, d)| d.0 == q)
        .nth((psn - UD_PSN) as usize)
        .expect("a datagram sent")
        .0
}

/// The RoCEv2 ICRC of `frame`, computed here from the IBTA rules (not with the crate's own
/// code): CRC-32 over eight 0xFF bytes, then the IPv4 header with TOS, TTL and checksum
/// masked to ones, the UDP header with its checksum masked, the BTH with its byte 4 (FECN,
/// BECN, reserved) masked, and everything after it up to the ICRC.
fn icrc_by_the_book(frame: &[u8]) -> u32 {
    let mut m = vec![0xFFu8; 8];
    let mut rest = frame[14..frame.len() - 4].to_vec();
    rest[1] = 0xFF; // TOS
    rest[8] = 0xFF; // TTL
    rest[10..12].fill(0xFF); // IPv4 checksum
    rest[20 + 6..20 + 8].fill(0xFF); // UDP checksum
    rest[28 + 4] = 0xFF; // BTH byte 4
    m.extend_from_slice(&rest);
    let mut crc = !0u32;
    for b in m {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                crc >> 1 ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn tshark_decodes_deth_and_immediate_of_datagrams() {
    let Some(tshark) = tshark() else { return };
    let out = Sink::default();
    let (fabric, u, recvs) = ud_exchange(21, Some(out.clone()), |_| None);
    fabric.stop_capture().unwrap();
    let dgrams = ud_datagrams();
    assert_eq!(recvs.len(), dgrams.len(), "{recvs:?}");
    let dir = std::env::temp_dir().join(format!("ringbell-ud-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ud.pcapng");
    let file = out.0.borrow().clone();
    std::fs::write(&path, &file).unwrap();
    // Every frame as our own parser reads it, no malformed packet, no warning.
    check_with_tshark(tshark, &path, &file);
    let fields = [
        "infiniband.bth.opcode",
        "infiniband.bth.destqp",
        "infiniband.bth.psn",
        "infiniband.deth.q_key",
        "infiniband.deth.srcqp",
        "infiniband.immdt",
        "infiniband.invariant.crc",
        "_ws.col.Info",
    ];
    let mut cmd = Command::new(tshark);
    cmd.args(TSHARK_OPTS)
        .arg("-r")
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=|"]);
    for f in fields {
        cmd.args(["-e", f]);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<Vec<String>> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split('|').map(str::to_owned).collect())
        .collect();
    let frames = parse(&file).packets;
    assert_eq!(rows.len(), dgrams.len(), "only the datagrams: {rows:?}");
    // The two QPs' datagrams interleave on the wire: each row is found by its source QP
    // (DETH) and PSN, and every datagram is seen once.
    let mut seen = vec![false; dgrams.len()];
    for (r, e) in rows.iter().zip(&frames) {
        let i = which(&u, &dgrams, num(&r[4]) as u32, num(&r[2]) as u32);
        assert!(!std::mem::replace(&mut seen[i], true), "{r:?} twice");
        let (q, data, imm, _) = &dgrams[i];
        let want_op = match imm {
            Some(_) => Opcode::UdSendOnlyImm,
            None => Opcode::UdSendOnly,
        };
        assert_eq!(num(&r[0]), want_op as u64, "opcode, {r:?}");
        assert_eq!(num(&r[1]), u.b.qpn() as u64, "dest QP, {r:?}");
        assert_eq!(num(&r[3]), QKEY as u64, "DETH Q_Key, {r:?}");
        assert_eq!(num(&r[4]), u.a[*q].qpn() as u64, "DETH source QP, {r:?}");
        // Wireshark lists the ImmDt field twice (hex bytes, comma-separated).
        match imm {
            Some(v) => assert!(
                r[5].split(',')
                    .all(|x| x.replace(':', "") == format!("{v:08x}")),
                "ImmDt, {r:?}"
            ),
            None => assert_eq!(r[5], "", "no ImmDt, {r:?}"),
        }
        // The ICRC Wireshark shows is the one in the frame, and the one the IBTA rules give.
        let icrc = u32::from_le_bytes(e.data[e.data.len() - 4..].try_into().unwrap());
        assert_eq!(icrc_by_the_book(&e.data), icrc, "ICRC, {r:?}");
        assert_eq!(num(&r[6]), icrc.swap_bytes() as u64, "ICRC, {r:?}");
        let info = match imm {
            Some(_) => "UD Send Only Immediate QP=",
            None => "UD Send Only QP=",
        };
        assert!(
            r[7].starts_with(&format!("{info}{:#08x}", u.b.qpn())),
            "{r:?}"
        );
        // Our parser agrees, payload included.
        let pk = parse_packet(&e.data).unwrap();
        assert_eq!(pk.payload, &data[..]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rule_drops_one_chosen_datagram_and_the_capture_marks_it() {
    // Both of node 0's QPs send from PSN 100 to the same QP: the DETH's source QP tells
    // their second datagrams apart. The rule drops QP 1's second one (datagram 3, the
    // empty one with immediate).
    let out = Sink::default();
    let (fabric, u, recvs) = ud_exchange(22, Some(out.clone()), |u| {
        Some(FaultRule::drop_nth(
            FrameMatch {
                kind: Some(FrameKind::Datagram),
                src_qpn: Some(u.a[1].qpn()),
                qpn: Some(u.b.qpn()),
                psn: Some(UD_PSN + 1),
                ..Default::default()
            },
            1,
        ))
    });
    let st = fabric.stop_capture().unwrap();
    let dgrams = ud_datagrams();
    assert_eq!(fabric.fault_stats().rule_hits, 1);
    assert_eq!(st.lost, 1);
    // Every datagram but the fourth arrived (the two QPs' datagrams interleave).
    let mut got: Vec<(u32, Option<u32>, u32)> = recvs
        .iter()
        .map(|w| {
            assert_eq!(w.status, WcStatus::Success);
            (w.source.unwrap().qpn, w.imm, w.byte_len)
        })
        .collect();
    let mut want: Vec<(u32, Option<u32>, u32)> = dgrams
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != 3)
        .map(|(_, (q, data, imm, _))| (u.a[*q].qpn(), *imm, 40 + data.len() as u32))
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    let stats = u.b.ud_stats().unwrap();
    assert_eq!(
        (stats.received, stats.no_recv_dropped, stats.qkey_dropped),
        (5, 0, 0)
    );
    // The capture has every datagram, the lost one marked, each comment naming the DETH.
    let p = parse(&out.0.borrow());
    assert_eq!(p.packets.len(), dgrams.len());
    for e in &p.packets {
        let pk = parse_packet(&e.data).unwrap();
        let i = which(
            &u,
            &dgrams,
            pk.repr.deth.unwrap().src_qp.get(),
            pk.repr.bth.psn.get(),
        );
        let q = dgrams[i].0;
        let c = e.comment.as_deref().unwrap();
        let src = format!(", src QP {:#08x}, Q_Key {QKEY:#010x}, PSN ", u.a[q].qpn());
        assert!(c.contains(&src), "{c}");
    }
    let lost: Vec<_> = p
        .packets
        .iter()
        .filter(|e| {
            e.comment
                .as_deref()
                .unwrap()
                .ends_with("; dropped by fault injection")
        })
        .collect();
    assert_eq!(lost.len(), 1);
    let pk = parse_packet(&lost[0].data).unwrap();
    assert_eq!(
        (
            pk.repr.deth.unwrap().src_qp.get(),
            pk.repr.bth.psn.get(),
            pk.repr.imm
        ),
        (u.a[1].qpn(), UD_PSN + 1, Some(0x0102_0304))
    );
    // A rule for RC requests leaves datagrams alone.
    let (fabric, _, recvs) = ud_exchange(22, None, |_| {
        Some(FaultRule {
            when: FrameMatch {
                kind: Some(FrameKind::Request),
                ..Default::default()
            },
            nth: 1,
            times: 0,
            action: ringbell_emu::FaultAction::Drop,
        })
    });
    assert_eq!(fabric.fault_stats().rule_hits, 0);
    assert_eq!(recvs.len(), dgrams.len());
}

#[test]
fn cli_bench_and_demo_write_captures() {
    let dir = std::env::temp_dir().join(format!("ringbell-cli-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |args: &[&str], file: &str| {
        let path = dir.join(file);
        let out = Command::new(env!("CARGO_BIN_EXE_ringbell-emu"))
            .args(args)
            .arg("--capture")
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("capture: "))
            .unwrap_or_else(|| panic!("no capture line in {text}"))
            .to_owned();
        (std::fs::read(&path).unwrap(), line, path)
    };
    let bench = ["bench", "--op", "read", "--size", "9000", "--count", "6"];
    let (a, line, path) = run(&bench, "a.pcapng");
    let (b, _, _) = run(&bench, "b.pcapng");
    assert_eq!(a, b, "same seed: byte-identical capture");
    let p = parse(&a);
    assert!(line.starts_with(&format!(
        "capture: {} frames (0 never delivered)",
        p.packets.len()
    )));
    assert!(p.packets.len() > 12);
    for e in &p.packets {
        bth(&e.data);
    }
    if let Some(t) = tshark() {
        check_with_tshark(t, &path, &a);
    }
    // Losses on the wire are in the file too, marked.
    let lossy = ["bench", "--size", "4096", "--count", "50", "--loss", "0.05"];
    let (l, line, _) = run(&lossy, "lossy.pcapng");
    let p = parse(&l);
    let marked = p
        .packets
        .iter()
        .filter(|e| {
            e.comment
                .as_deref()
                .unwrap()
                .contains("dropped by fault injection")
        })
        .count();
    assert!(marked > 0);
    assert!(
        line.contains(&format!("({marked} never delivered)")),
        "{line}"
    );
    // demo takes the option too (a short demo is still a big capture: keep it small).
    let help = Command::new(env!("CARGO_BIN_EXE_ringbell-emu"))
        .args(["demo", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&help.stdout).contains("--capture <FILE>"));
    std::fs::remove_dir_all(&dir).unwrap();
}
