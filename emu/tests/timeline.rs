//! The timeline: a Chrome/Perfetto trace of the simulated pipeline, checked as JSON, for the
//! causal order of one message's stages, for determinism and for leaving every simulated
//! result alone; and the latency breakdown built from it, against the measured latency.

use ringbell_emu::perf::{PerfOp, PerfPair};
use ringbell_emu::timeline::{breakdown, NodeEvent};
use ringbell_emu::{FabricConfig, FabricStats, Topology};
use ringbell_model::{Stage, TimingProfile};
use ringbell_specs::wire::Opcode;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

fn pair(seed: u64) -> PerfPair {
    PerfPair::new(seed, Topology::BackToBack).unwrap()
}

/// A little of everything: latency of each operation at 8 B (inline, BlueFlame) and 8 KiB
/// (two packets), and a short WRITE stream. Returns every figure measured.
fn workload(p: &mut PerfPair) -> Vec<u64> {
    let mut out = Vec::new();
    for op in [PerfOp::Write, PerfOp::Send, PerfOp::Read] {
        for size in [8, 8192] {
            out.push(p.latency(op, size, 3).unwrap().ps());
        }
    }
    out.push(p.bandwidth(PerfOp::Write, 4096, 64, 16).unwrap().to_bits());
    p.fabric().run_until_quiet();
    out
}

/// The workload of seed `seed` with a timeline: (figures, JSON, end of the run in ps).
fn traced(seed: u64, max: usize) -> (Vec<u64>, Vec<u8>, u64) {
    let mut p = pair(seed);
    p.fabric().start_timeline(max).unwrap();
    let figures = workload(&mut p);
    let tl = p.fabric().take_timeline().unwrap();
    let mut json = Vec::new();
    let st = tl.write_json(&mut json).unwrap();
    assert_eq!(st.bytes, json.len() as u64);
    (figures, json, p.fabric().now().ps())
}

/// Microseconds with six decimals back to integer picoseconds.
fn ps(v: &Value) -> u64 {
    (v.as_f64().unwrap() * 1e6).round() as u64
}

#[test]
fn the_timeline_is_trace_event_json_with_every_node_and_track_named() {
    let (_, json, end) = traced(5, 1_000_000);
    let doc: Value = serde_json::from_slice(&json).expect("the timeline parses as JSON");
    assert_eq!(doc["displayTimeUnit"], "ns");
    assert_eq!(doc["otherData"]["events_dropped"], "0");
    let events = doc["traceEvents"].as_array().unwrap();
    let mut processes = BTreeSet::new();
    let mut threads = BTreeSet::new();
    for e in events.iter().filter(|e| e["ph"] == "M") {
        let pid = e["pid"].as_u64().unwrap();
        match e["name"].as_str().unwrap() {
            "process_name" => {
                assert_eq!(e["args"]["name"], format!("node {pid}"));
                processes.insert(pid);
            }
            "thread_name" => {
                assert!(!e["args"]["name"].as_str().unwrap().is_empty());
                threads.insert((pid, e["tid"].as_u64().unwrap()));
            }
            _ => {}
        }
    }
    assert_eq!(processes, BTreeSet::from([0, 1]), "one process per node");
    let mut last_ts = 0;
    let mut lane_end: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let mut stages = BTreeSet::new();
    let mut n = 0;
    for e in events.iter().filter(|e| e["ph"] != "M") {
        n += 1;
        let ph = e["ph"].as_str().unwrap();
        assert!(ph == "X" || ph == "i", "{e}");
        let key = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        assert!(threads.contains(&key), "an event on an unnamed track: {e}");
        assert!(!e["name"].as_str().unwrap().is_empty());
        let ts = ps(&e["ts"]);
        assert!(ts >= last_ts, "events are sorted by start: {e}");
        last_ts = ts;
        let dur = if ph == "X" {
            let d = e["dur"].as_f64().unwrap();
            assert!(d >= 0.0, "{e}");
            ps(&e["dur"])
        } else {
            0
        };
        assert!(ts + dur <= end, "an event past the end of the run: {e}");
        if ph == "X" {
            // Complete events on one track never overlap: they nest in Perfetto.
            let free = lane_end.entry(key).or_insert(0);
            assert!(*free <= ts, "overlapping events on one track: {e}");
            *free = ts + dur;
        }
        stages.insert(e["args"]["stage"].as_str().unwrap().to_string());
    }
    assert!(n > 1000, "{n} events");
    for s in [
        Stage::HostBlueFlame,
        Stage::HostDoorbell,
        Stage::MmioPost,
        Stage::BlueFlameWqe,
        Stage::TxBuild,
        Stage::PayloadRead,
        Stage::Serialize,
        Stage::Flight,
        Stage::Rx,
        Stage::ReadRespSetup,
        Stage::DmaWrite,
        Stage::Visible,
        Stage::CqeDma,
        Stage::CqeVisible,
        Stage::CqeOrder,
        Stage::CqeWrite,
    ] {
        assert!(stages.contains(s.name()), "no {} in the timeline", s.name());
    }
}

/// The first event of `stage` on `node` starting at or after `t`.
fn next(ev: &[NodeEvent], node: usize, stage: Stage, t: u64) -> NodeEvent {
    *ev.iter()
        .filter(|e| e.node == node && e.ev.stage == stage && e.ev.start.ps() >= t)
        .min_by_key(|e| e.ev.start)
        .unwrap_or_else(|| panic!("no {stage:?} on node {node} after {t} ps"))
}

#[test]
fn a_write_goes_through_its_stages_in_causal_order_and_is_acknowledged() {
    let mut p = pair(2);
    p.fabric().run_until_quiet();
    let t0 = p.fabric().now().ps();
    p.fabric().start_timeline(10_000).unwrap();
    p.latency(PerfOp::Write, 8, 1).unwrap();
    p.fabric().run_until_quiet();
    let tl = p.fabric().take_timeline().unwrap();
    let ev = tl.events();
    let mut t = t0;
    let mut chain = Vec::new();
    for (node, stage) in [
        (0, Stage::HostBlueFlame),
        (0, Stage::MmioPost),
        (0, Stage::BlueFlameWqe),
        (0, Stage::TxBuild),
        (0, Stage::Serialize),
        (0, Stage::Flight),
        (1, Stage::Rx),
        (1, Stage::DmaWrite),
        (1, Stage::Visible),
    ] {
        let e = next(ev, node, stage, t);
        assert!(e.ev.end >= e.ev.start);
        t = e.ev.end.ps();
        chain.push(e);
    }
    // The same packet all along: the requester's QP, its PSN, RDMA_WRITE_ONLY to node 1.
    let (tx, flight, rx) = (chain[4].ev, chain[5].ev, chain[6].ev);
    assert_eq!(tx.op, Opcode::WriteOnly as u8);
    assert_eq!((flight.op, flight.psn, flight.obj), (tx.op, tx.psn, 1));
    assert_eq!((rx.op, rx.psn), (tx.op, tx.psn));
    assert_eq!(chain[0].ev.qpn, tx.qpn);
    assert_eq!(chain[7].ev.bytes, 8);
    // The ACK for that PSN goes back and completes the WRITE on the sender.
    let ack = next(ev, 1, Stage::Serialize, rx.end.ps());
    assert_eq!((ack.ev.op, ack.ev.psn), (Opcode::Acknowledge as u8, tx.psn));
    let back = next(ev, 0, Stage::Rx, ack.ev.end.ps());
    assert_eq!(
        (back.ev.op, back.ev.psn),
        (Opcode::Acknowledge as u8, tx.psn)
    );
    let cqe = next(ev, 0, Stage::CqeWrite, back.ev.end.ps());
    assert_eq!(cqe.ev.qpn, tx.qpn);
    assert_eq!(cqe.ev.status, 0);
    assert_eq!(
        cqe.ev.op,
        ringbell_specs::cqe::CqeOpcode::RdmaWrite as u8,
        "the sender's WRITE completion"
    );
}

#[test]
fn datagrams_are_named_followed_and_their_losses_marked() {
    use ringbell::*;
    use ringbell_emu::{Fabric, FaultRule, FrameKind, FrameMatch};
    let fabric = Fabric::new(FabricConfig::new(2, 3));
    let ud = |n: usize| {
        let dev = Device::open(Box::new(fabric.port(n))).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let buf = dev.alloc_dma(1 << 16).unwrap();
        let mr = pd.reg_mr(&buf, Access::LOCAL_WRITE).unwrap();
        let cq = dev.create_cq(16).unwrap();
        let mut init = QpInit::new(&cq, &cq);
        init.qp_type = QpType::Ud;
        init.max_inline = 64;
        let mut qp = pd.create_qp(&init).unwrap();
        qp.ud_ready(0x77, 500).unwrap();
        (qp, cq, mr, buf, pd, dev)
    };
    let (mut qa, mut cqa, ma, ba, pa, _da) = ud(0);
    let (mut qb, mut cqb, mb, _bb, _pb, db) = ud(1);
    for i in 0..3u64 {
        let sge = [mb.sge(i * 8192, 4136)];
        qb.post_recv(&[RecvWr {
            wr_id: i,
            sgl: &sge,
        }])
        .unwrap();
    }
    // The second datagram (PSN 501) is lost on the wire.
    fabric.add_fault_rule(FaultRule::drop_nth(
        FrameMatch {
            kind: Some(FrameKind::Datagram),
            src_qpn: Some(qa.qpn()),
            psn: Some(501),
            ..Default::default()
        },
        1,
    ));
    fabric.run_until_quiet();
    fabric.start_timeline(100_000).unwrap();
    let ah = pa.create_ah(&db.ah_attr()).unwrap();
    let dest = UdDest {
        ah: &ah,
        qpn: qb.qpn(),
        qkey: 0x77,
    };
    ba.write(0, &[0x5A; 3000]).unwrap();
    let sge = [ma.sge(0, 3000)];
    qa.post_send(&[
        SendWr::new(1, WrOp::Send, &sge).to(dest),
        SendWr::inline(2, WrOp::SendImm(9), b"lost").to(dest),
        SendWr::inline(3, WrOp::SendImm(10), b"kept").to(dest),
    ])
    .unwrap();
    fabric.run_until_quiet();
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(cqa.poll_ready(&mut wc), 3);
    assert_eq!(cqb.poll_ready(&mut wc), 2);
    let tl = fabric.take_timeline().unwrap();
    let ev = tl.events();
    // Each datagram leaves node 0 once; two arrive at node 1, the lost one is a dropped
    // flight.
    let of = |node: usize, stage: Stage| -> Vec<(u8, u32, u8)> {
        ev.iter()
            .filter(|e| e.node == node && e.ev.stage == stage)
            .map(|e| (e.ev.op, e.ev.psn, e.ev.status))
            .collect()
    };
    let (only, imm) = (Opcode::UdSendOnly as u8, Opcode::UdSendOnlyImm as u8);
    assert_eq!(
        of(0, Stage::Serialize),
        vec![(only, 500, 0), (imm, 501, 0), (imm, 502, 0)]
    );
    let flights: Vec<_> = ev
        .iter()
        .filter(|e| matches!(e.ev.stage, Stage::Flight | Stage::SwitchedFlight))
        .map(|e| (e.node, e.ev.op, e.ev.psn, e.ev.status, e.ev.qpn, e.ev.obj))
        .collect();
    let b = qb.qpn();
    assert_eq!(
        flights,
        vec![
            (0, only, 500, 0, b, 1),
            (0, imm, 501, 1, b, 1),
            (0, imm, 502, 0, b, 1)
        ]
    );
    assert_eq!(of(1, Stage::Rx), vec![(only, 500, 0), (imm, 502, 0)]);
    // The JSON names them.
    let mut json = Vec::new();
    tl.write_json(&mut json).unwrap();
    let doc: Value = serde_json::from_slice(&json).unwrap();
    let names: BTreeSet<String> = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str().map(str::to_owned))
        .collect();
    for want in [
        "TX UD_SEND_ONLY PSN 500".to_string(),
        format!("UD_SEND_ONLY_WITH_IMMEDIATE PSN 501 -> node 1 QP {b} (dropped)"),
        format!("RX UD_SEND_ONLY_WITH_IMMEDIATE PSN 502 QP {b}"),
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(&want)),
            "no {want:?} in {names:?}"
        );
    }
}

#[test]
fn one_seed_gives_one_file_byte_for_byte() {
    let (fa, a, _) = traced(7, 1_000_000);
    let (fb, b, _) = traced(7, 1_000_000);
    assert_eq!(fa, fb);
    assert!(a == b, "same seed, different timeline");
    // Another seed draws other initial PSNs: the file changes, the latencies do not.
    let (fc, c, _) = traced(8, 1_000_000);
    assert!(a != c);
    assert_eq!(fa, fc);
}

#[test]
fn tracing_changes_no_simulated_result() {
    let run = |trace: bool| -> (Vec<u64>, u64, FabricStats, u64) {
        let mut p = pair(11);
        if trace {
            p.fabric().start_timeline(1_000_000).unwrap();
        }
        let f = workload(&mut p);
        if trace {
            assert!(!p.fabric().take_timeline().unwrap().events().is_empty());
        }
        let fab = p.fabric();
        (f, fab.trace_digest(), fab.stats(), fab.now().ps())
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn the_cap_keeps_the_first_stages_and_says_how_many_were_left_out() {
    let mut full = pair(3);
    full.fabric().start_timeline(1_000_000).unwrap();
    workload(&mut full);
    let full = full.fabric().take_timeline().unwrap();
    let mut p = pair(3);
    p.fabric().start_timeline(100).unwrap();
    workload(&mut p);
    let tl = p.fabric().take_timeline().unwrap();
    assert_eq!(tl.events(), &full.events()[..100]);
    assert_eq!(tl.dropped(), full.events().len() as u64 - 100);
    let mut json = Vec::new();
    let st = tl.write_json(&mut json).unwrap();
    assert_eq!((st.events, st.dropped), (100, tl.dropped()));
    let doc: Value = serde_json::from_slice(&json).unwrap();
    assert_eq!(doc["otherData"]["events_dropped"], tl.dropped().to_string());
    assert!(doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"]
            .as_str()
            .unwrap()
            .starts_with("timeline truncated")));
    // A fabric runs one timeline at a time.
    p.fabric().start_timeline(10).unwrap();
    assert!(p.fabric().start_timeline(10).is_err());
}

fn cfg(timing: TimingProfile, topology: Topology) -> FabricConfig {
    let mut c = FabricConfig::new(2, 1);
    c.timing = timing;
    c.topology = topology;
    c
}

#[test]
fn the_breakdown_adds_up_to_the_measured_latency_stage_by_stage() {
    let t = TimingProfile::default();
    let expect: [(PerfOp, &[Stage]); 3] = [
        (
            PerfOp::Write,
            &[
                Stage::HostBlueFlame,
                Stage::MmioPost,
                Stage::BlueFlameWqe,
                Stage::TxBuild,
                Stage::Serialize,
                Stage::Flight,
                Stage::Rx,
                Stage::DmaWrite,
                Stage::Visible,
            ],
        ),
        (
            PerfOp::Send,
            &[
                Stage::HostBlueFlame,
                Stage::MmioPost,
                Stage::BlueFlameWqe,
                Stage::TxBuild,
                Stage::Serialize,
                Stage::Flight,
                Stage::Rx,
                Stage::DmaWrite,
                Stage::CqeDma,
                Stage::CqeVisible,
                Stage::CqeOrder,
            ],
        ),
        (
            PerfOp::Read,
            &[
                Stage::HostBlueFlame,
                Stage::MmioPost,
                Stage::BlueFlameWqe,
                Stage::TxBuild,
                Stage::Serialize,
                Stage::Flight,
                Stage::Rx,
                Stage::ReadRespSetup,
                Stage::PayloadRead,
                Stage::Serialize,
                Stage::Flight,
                Stage::Rx,
                Stage::DmaWrite,
                Stage::CqeDma,
                Stage::CqeVisible,
                Stage::CqeOrder,
            ],
        ),
    ];
    for (op, stages) in expect {
        let b = breakdown(cfg(t.clone(), Topology::BackToBack), op, 8).unwrap();
        eprintln!("{}", b.render(&t));
        let got: Vec<Stage> = b.steps.iter().map(|s| s.stage.unwrap()).collect();
        assert_eq!(got, stages, "{}", op.name());
        // Back to back, no gap, summing to the measured latency (a fresh measurement agrees).
        for w in b.steps.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        assert_eq!(b.total(), b.steps.last().unwrap().end - b.start());
        assert!(b.matches_measurement(), "{}", op.name());
        assert_eq!(b.total(), b.pong, "both directions cost the same");
        assert_eq!(b.total(), b.measured);
        assert_eq!(pair(1).latency(op, 8, 1).unwrap(), b.measured);
        // Each fixed stage costs exactly its parameter.
        for s in &b.steps {
            let want = match s.stage.unwrap() {
                Stage::HostBlueFlame => t.host_post_wqe_ps + t.host_doorbell_ps,
                Stage::MmioPost => t.mmio_post_ps,
                Stage::TxBuild => t.nic_tx_wqe_ps,
                Stage::Flight => t.link_phy_mac_ps + t.link_prop_ps,
                Stage::Rx => t.nic_rx_pkt_ps,
                Stage::Serialize => t.serialize_ps(s.bytes as usize),
                Stage::DmaWrite => t.pcie_write_ps(8),
                Stage::CqeDma => t.pcie_write_ps(64),
                Stage::PayloadRead => t.pcie_read_ps(8),
                Stage::Visible | Stage::CqeVisible => t.dma_write_visible_ps,
                Stage::CqeOrder => t.nic_cqe_after_data_ps,
                Stage::ReadRespSetup => t.dma_read_rtt_ps + t.nic_read_resp_extra_ps,
                Stage::BlueFlameWqe => 0,
                other => panic!("unexpected {other:?}"),
            };
            assert_eq!(s.dur().ps(), want, "{:?} of {}", s.stage, op.name());
        }
    }
}

#[test]
fn the_breakdown_holds_for_other_profiles_wirings_and_sizes() {
    for (timing, topology, size) in [
        (TimingProfile::cx7_400g(), Topology::BackToBack, 8),
        (TimingProfile::default(), Topology::Switch, 8),
        // Past the inline limit: the payload is fetched from host memory.
        (TimingProfile::default(), Topology::BackToBack, 4096),
    ] {
        for op in [PerfOp::Write, PerfOp::Send, PerfOp::Read] {
            let b = breakdown(cfg(timing.clone(), topology), op, size).unwrap();
            assert!(
                b.matches_measurement(),
                "{} {size} B on {} {topology:?}:\n{}",
                op.name(),
                timing.name,
                b.render(&timing)
            );
            if topology == Topology::Switch {
                assert!(b
                    .steps
                    .iter()
                    .any(|s| s.stage == Some(Stage::SwitchedFlight)));
            }
            if size > 220 && op != PerfOp::Read {
                assert!(b.steps.iter().any(|s| s.stage == Some(Stage::PayloadFetch)));
            }
        }
    }
}

#[test]
fn the_cli_prints_the_breakdown_and_writes_a_timeline() {
    let exe = env!("CARGO_BIN_EXE_ringbell-emu");
    let out = Command::new(exe).arg("breakdown").output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().next(), Some("seed 1"));
    assert_eq!(text.matches("the stages add up to it").count(), 3, "{text}");
    for what in [
        "WRITE 8 B",
        "SEND 8 B",
        "READ 8 B",
        "nic_read_resp_extra_ps",
    ] {
        assert!(text.contains(what), "{what}:\n{text}");
    }
    let dir = std::env::temp_dir().join(format!("ringbell-timeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bench.json");
    let run = || {
        let out = Command::new(exe)
            .args(["bench", "--size", "4096", "--count", "64", "--depth", "16"])
            .arg("--timeline")
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains("timeline: "), "{text}");
        std::fs::read(&file).unwrap()
    };
    let a = run();
    let doc: Value = serde_json::from_slice(&a).unwrap();
    assert!(doc["traceEvents"].as_array().unwrap().len() > 100);
    assert!(a == run(), "the same command writes the same file");
    std::fs::remove_dir_all(&dir).unwrap();
}
