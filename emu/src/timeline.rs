//! The timeline: every stage of every message in simulated time, as a Chrome/Perfetto trace,
//! and the per-stage latency breakdown built from it.
//!
//! While [`crate::Fabric::start_timeline`] runs, the NIC models report their pipeline
//! stages through [`ringbell_model::Env::trace`] (WQE fetch, packet build, serialization,
//! receive checks, DMA writes, visibility, CQEs, commands, counters...) and the fabric adds
//! what is not the NIC's: the host's MMIO stores and their PCIe crossing, and each frame's
//! flight over PHY/MAC, cable and switch. Nothing recorded feeds back into the simulation:
//! results and the trace digest are the same with and without a timeline.
//!
//! [`Timeline::write_json`] writes the Trace Event Format that `ui.perfetto.dev` and
//! `chrome://tracing` open: one process per node, one thread (track) per pipeline resource
//! (host MMIO, each QP's send engine and responder, PCIe read, wire serialization, wire
//! flight, receive, PCIe write, host visibility, completions, commands, counters, async
//! events). Stages that overlap on one resource (pipelined frames, concurrent stores) are
//! spread over numbered lanes of that track so that every `X` event nests. `ts` and `dur`
//! are microseconds of simulated time written exactly from integer picoseconds; nothing in
//! the file depends on the wall clock, so one seed gives one file, byte for byte.
//!
//! A timeline keeps the first `max_events` stages recorded (in simulation order) and counts
//! the rest; the file's `otherData` says how many were left out.

use crate::perf::{PerfOp, PerfPair};
use crate::{FabricConfig, Topology};
use ringbell_model::{Stage, TimingProfile, TraceEvent};
use ringbell_specs::cmd::CmdOpcode;
use ringbell_specs::regs;
use ringbell_specs::wire::Opcode;
use ringbell_specs::wqe::SendOpcode;
use ringbell_specs::SimTime;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, Write};

/// The default cap on recorded stages (about 50 MB of JSON).
pub const DEFAULT_MAX_EVENTS: usize = 250_000;

/// Most lanes one track is spread over; a stage that finds none free is written as an
/// instant event carrying its duration.
const MAX_LANES: usize = 64;

/// A recorded stage and the node it happened on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    /// The node.
    pub node: usize,
    /// The stage.
    pub ev: TraceEvent,
}

/// What [`Timeline::write_json`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimelineStats {
    /// Stages written (metadata records not counted).
    pub events: u64,
    /// Stages recorded past the cap and left out.
    pub dropped: u64,
    /// Tracks (threads) written.
    pub tracks: u64,
    /// Bytes written.
    pub bytes: u64,
}

/// A recorded timeline.
#[derive(Debug)]
pub struct Timeline {
    events: Vec<NodeEvent>,
    max: usize,
    dropped: u64,
    nodes: usize,
    seed: u64,
    profile: String,
    back_to_back: bool,
}

impl Timeline {
    pub(crate) fn new(
        nodes: usize,
        seed: u64,
        profile: String,
        back_to_back: bool,
        max: usize,
    ) -> Self {
        Timeline {
            events: Vec::with_capacity(max.min(1 << 16)),
            max,
            dropped: 0,
            nodes,
            seed,
            profile,
            back_to_back,
        }
    }

    /// Keeps `ev` of node `node` if the cap allows.
    pub(crate) fn record(&mut self, node: usize, ev: TraceEvent) {
        if self.events.len() < self.max {
            self.events.push(NodeEvent { node, ev });
        } else {
            self.dropped += 1;
        }
    }

    /// A CPU store of `len` bytes at BAR0 `offset` of node `node`: the store from `now` to
    /// `stored`, then its PCIe crossing until `at`.
    pub(crate) fn record_host_store(
        &mut self,
        node: usize,
        offset: u64,
        len: usize,
        now: SimTime,
        stored: SimTime,
        at: SimTime,
    ) {
        let (stage, qpn, op) = classify_store(offset, len);
        let ev = |s, a, b| {
            TraceEvent::new(s, a, b)
                .obj(offset as u32)
                .qpn(qpn)
                .op(op)
                .bytes(len)
        };
        self.record(node, ev(stage, now, stored));
        self.record(node, ev(Stage::MmioPost, stored, at));
    }

    /// The stages kept, in the order they were recorded.
    pub fn events(&self) -> &[NodeEvent] {
        &self.events
    }

    /// Stages recorded past the cap and left out.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The cap on stages kept.
    pub fn max_events(&self) -> usize {
        self.max
    }

    /// Writes the timeline as Trace Event Format JSON (`{"traceEvents":[...]}` with
    /// `displayTimeUnit` "ns"): `M` records naming each node's process and tracks, then
    /// every stage in order of start time (ties in the order recorded), `X` for a stage
    /// with a duration and `i` for an instant.
    pub fn write_json(&self, out: &mut dyn Write) -> io::Result<TimelineStats> {
        let mut out = Counting {
            inner: out,
            bytes: 0,
        };
        let mut order: Vec<usize> = (0..self.events.len()).collect();
        order.sort_by_key(|&i| (self.events[i].ev.start, i));
        // Lanes: each track's stages go to the first lane free at their start.
        let mut lanes: BTreeMap<(usize, Track), Vec<SimTime>> = BTreeMap::new();
        let mut placed = Vec::with_capacity(order.len());
        for &i in &order {
            let NodeEvent { node, ev } = self.events[i];
            let track = Track::of(&ev);
            let ends = lanes.entry((node, track)).or_default();
            if is_instant(ev.stage) {
                if ends.is_empty() {
                    ends.push(SimTime::ZERO);
                }
                placed.push((i, track, 0usize, true));
                continue;
            }
            let lane = match ends.iter().position(|e| *e <= ev.start) {
                Some(l) => Some(l),
                None if ends.len() < MAX_LANES => {
                    ends.push(SimTime::ZERO);
                    Some(ends.len() - 1)
                }
                None => None,
            };
            match lane {
                Some(l) => {
                    ends[l] = ev.end;
                    placed.push((i, track, l, false));
                }
                None => placed.push((i, track, 0, true)),
            }
        }
        let mut tids: BTreeMap<(usize, Track, usize), u32> = BTreeMap::new();
        let mut next_tid = vec![1u32; self.nodes];
        for (&(node, track), ends) in &lanes {
            for lane in 0..ends.len() {
                let tid = &mut next_tid[node];
                tids.insert((node, track, lane), *tid);
                *tid += 1;
            }
        }
        let topology = if self.back_to_back {
            "back-to-back"
        } else {
            "switch"
        };
        write!(
            out,
            "{{\"displayTimeUnit\":\"ns\",\"otherData\":{{\"generator\":\"ringbell-emu timeline\",\
             \"seed\":\"{}\",\"timing_profile\":\"{}\",\"topology\":\"{topology}\",\
             \"time\":\"ts and dur in microseconds of simulated time (exact to the picosecond)\",\
             \"events\":\"{}\",\"events_dropped\":\"{}\",\"max_events\":\"{}\",\"note\":\"{}\"}},\
             \n\"traceEvents\":[\n",
            self.seed,
            escape(&self.profile),
            self.events.len(),
            self.dropped,
            self.max,
            if self.dropped > 0 {
                "truncated: only the first max_events stages are recorded"
            } else {
                "complete"
            }
        )?;
        let mut first = true;
        let mut sep = |out: &mut Counting<'_>| -> io::Result<()> {
            if !first {
                out.write_all(b",\n")?;
            }
            first = false;
            Ok(())
        };
        for node in 0..self.nodes {
            sep(&mut out)?;
            write!(
                out,
                "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{node},\"args\":{{\"name\":\"node {node}\"}}}},\n\
                 {{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":{node},\"args\":{{\"sort_index\":{node}}}}}"
            )?;
        }
        for (&(node, track, lane), &tid) in &tids {
            let mut name = track.name();
            if lane > 0 {
                let _ = write!(name, " #{}", lane + 1);
            }
            sep(&mut out)?;
            write!(
                out,
                "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{node},\"tid\":{tid},\"args\":{{\"name\":\"{}\"}}}},\n\
                 {{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{node},\"tid\":{tid},\"args\":{{\"sort_index\":{tid}}}}}",
                escape(&name)
            )?;
        }
        let mut line = String::new();
        let mut last = SimTime::ZERO;
        for &(i, track, lane, instant) in &placed {
            let NodeEvent { node, ev } = self.events[i];
            let tid = tids[&(node, track, lane)];
            last = last.max(ev.start);
            line.clear();
            let (name, cat) = describe(&ev);
            let _ = write!(
                line,
                "{{\"name\":\"{}\",\"cat\":\"{cat}\",\"ph\":\"{}\",\"ts\":{}",
                escape(&name),
                if instant { "i" } else { "X" },
                Us(ev.start)
            );
            if instant {
                line.push_str(",\"s\":\"t\"");
            } else {
                let _ = write!(line, ",\"dur\":{}", Us(ev.end - ev.start));
            }
            let _ = write!(line, ",\"pid\":{node},\"tid\":{tid},\"args\":{{");
            args(&mut line, &ev, instant && !is_instant(ev.stage));
            line.push_str("}}");
            sep(&mut out)?;
            out.write_all(line.as_bytes())?;
        }
        if self.dropped > 0 {
            sep(&mut out)?;
            write!(
                out,
                "{{\"name\":\"timeline truncated: {} later stages not recorded (max_events {})\",\
                 \"ph\":\"i\",\"s\":\"g\",\"ts\":{},\"pid\":0,\"tid\":0}}",
                self.dropped,
                self.max,
                Us(last)
            )?;
        }
        out.write_all(b"\n]}\n")?;
        out.flush()?;
        Ok(TimelineStats {
            events: placed.len() as u64,
            dropped: self.dropped,
            tracks: tids.len() as u64,
            bytes: out.bytes,
        })
    }
}

/// A `Write` that counts what passes through it.
struct Counting<'a> {
    inner: &'a mut dyn Write,
    bytes: u64,
}

impl Write for Counting<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(b)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Picoseconds written as microseconds with six decimals (exact, no float).
struct Us(SimTime);

impl std::fmt::Display for Us {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ps = self.0.ps();
        write!(f, "{}.{:06}", ps / 1_000_000, ps % 1_000_000)
    }
}

fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o
}

/// The resource a stage occupies: one track (thread) of its node's process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Track {
    Host,
    SendEngine(u32),
    PcieRead,
    Serialize,
    Flight,
    Receive,
    Responder(u32),
    PcieWrite,
    Visibility,
    Completions,
    Commands,
    Counters,
    Events,
}

impl Track {
    fn of(ev: &TraceEvent) -> Track {
        match ev.stage {
            Stage::HostDoorbell | Stage::HostBlueFlame | Stage::HostRegWrite | Stage::MmioPost => {
                Track::Host
            }
            Stage::WqeFetch
            | Stage::BlueFlameWqe
            | Stage::PayloadFetch
            | Stage::MsgRateWait
            | Stage::TxBuild
            | Stage::TriggerDispatch
            | Stage::Retry
            | Stage::AckTimeout
            | Stage::RnrWait => Track::SendEngine(ev.qpn),
            Stage::PayloadRead => Track::PcieRead,
            Stage::Serialize => Track::Serialize,
            Stage::Flight | Stage::SwitchedFlight => Track::Flight,
            Stage::Rx | Stage::TagMatch => Track::Receive,
            Stage::RespWait | Stage::ReadRespSetup | Stage::AtomicFetch => Track::Responder(ev.qpn),
            Stage::DmaWrite | Stage::CqeDma => Track::PcieWrite,
            Stage::Visible | Stage::CqeVisible => Track::Visibility,
            Stage::CqeOrder | Stage::CqeWrite => Track::Completions,
            Stage::Command => Track::Commands,
            Stage::CounterUpdate => Track::Counters,
            Stage::AsyncEvent => Track::Events,
        }
    }

    fn name(self) -> String {
        match self {
            Track::Host => "host: MMIO stores (doorbell, BlueFlame) + PCIe post".into(),
            Track::SendEngine(q) => format!("QP {q} send engine (WQE fetch, packet build)"),
            Track::PcieRead => "PCIe read: payload to NIC".into(),
            Track::Serialize => "wire: serialization (egress)".into(),
            Track::Flight => "wire: PHY/MAC + cable (+ switch)".into(),
            Track::Receive => "receive: packet checks".into(),
            Track::Responder(q) => format!("QP {q} responder (READ/atomic)"),
            Track::PcieWrite => "PCIe write: payload and CQE DMA to host".into(),
            Track::Visibility => "host: DMA write visible".into(),
            Track::Completions => "completions: CQE".into(),
            Track::Commands => "commands".into(),
            Track::Counters => "counters + triggered operations".into(),
            Track::Events => "async events (EQ)".into(),
        }
    }
}

fn is_instant(s: Stage) -> bool {
    matches!(
        s,
        Stage::BlueFlameWqe
            | Stage::CqeWrite
            | Stage::CounterUpdate
            | Stage::AsyncEvent
            | Stage::Retry
            | Stage::AckTimeout
    )
}

/// (stage, QPN, op) of a CPU store at `offset`: QP doorbells carry op 0 (SQ) or 1 (RQ), SRQ
/// doorbells 2, CQ doorbells 3.
fn classify_store(offset: u64, len: usize) -> (Stage, u32, u8) {
    if (regs::DB_BASE..regs::DB_END).contains(&offset) {
        let (base, kind) = if offset >= regs::CQ_DB_BASE {
            (regs::CQ_DB_BASE, 3)
        } else if offset >= regs::SRQ_DB_BASE {
            (regs::SRQ_DB_BASE, 2)
        } else {
            (regs::QP_DB_BASE, 0)
        };
        let num = ((offset - base) / regs::DB_STRIDE) as u32;
        let which = offset % regs::DB_STRIDE;
        return match kind {
            0 => (Stage::HostDoorbell, num, (which == regs::DB_RQ) as u8),
            k => (Stage::HostDoorbell, 0, k),
        };
    }
    if (regs::BF_BASE..regs::BF_END).contains(&offset) {
        let qpn = ((offset - regs::BF_BASE) / regs::BF_STRIDE) as u32;
        if len > 4 && (offset - regs::BF_BASE).is_multiple_of(regs::BF_STRIDE) {
            return (Stage::HostBlueFlame, qpn, 0);
        }
        return (Stage::HostRegWrite, qpn, 0);
    }
    (Stage::HostRegWrite, 0, 0)
}

/// What a store at `offset` is, in words.
fn describe_store(offset: u64) -> String {
    if (regs::DB_BASE..regs::DB_END).contains(&offset) {
        let (base, what) = if offset >= regs::CQ_DB_BASE {
            (regs::CQ_DB_BASE, "CQ")
        } else if offset >= regs::SRQ_DB_BASE {
            (regs::SRQ_DB_BASE, "SRQ")
        } else {
            (regs::QP_DB_BASE, "QP")
        };
        let num = (offset - base) / regs::DB_STRIDE;
        let which = offset % regs::DB_STRIDE;
        let kind = match (what, which) {
            ("QP", regs::DB_SQ) => "SQ doorbell",
            ("QP", _) => "RQ doorbell",
            ("SRQ", regs::DB_SRQ_TM_OPS) => "TM list doorbell",
            ("SRQ", _) => "doorbell",
            (_, regs::DB_CQ_CI) => "CI doorbell",
            _ => "arm doorbell",
        };
        return format!("{what} {num} {kind}");
    }
    if (regs::BF_BASE..regs::BF_END).contains(&offset) {
        let rel = offset - regs::BF_BASE;
        return format!(
            "BlueFlame QP {} +{}",
            rel / regs::BF_STRIDE,
            rel % regs::BF_STRIDE
        );
    }
    if (regs::CNTR_BASE..regs::CNTR_END).contains(&offset) {
        return format!("counter register 0x{offset:x}");
    }
    match regs::register_at(offset) {
        Some(r) => r.name.to_string(),
        None => format!("BAR0 0x{offset:x}"),
    }
}

fn bth_name(op: u8) -> String {
    match Opcode::from_u8(op) {
        Some(o) => o.name().to_string(),
        None => format!("opcode 0x{op:02x}"),
    }
}

fn send_name(op: u8) -> String {
    match SendOpcode::from_u8(op) {
        Some(o) => format!("{o:?}").to_uppercase(),
        None => format!("opcode 0x{op:02x}"),
    }
}

/// The event's name and category.
fn describe(ev: &TraceEvent) -> (String, &'static str) {
    let (q, psn) = (ev.qpn, ev.psn);
    match ev.stage {
        Stage::HostDoorbell | Stage::HostRegWrite => {
            (format!("store {}", describe_store(ev.obj as u64)), "host")
        }
        Stage::HostBlueFlame => (
            format!("BlueFlame store QP {q} ({} B WQE)", ev.bytes),
            "host",
        ),
        Stage::MmioPost => (
            format!("PCIe post {}", describe_store(ev.obj as u64)),
            "host",
        ),
        Stage::WqeFetch => (
            format!("WQE fetch QP {q} #{psn} {}", send_name(ev.op)),
            "send",
        ),
        Stage::BlueFlameWqe => (
            format!("WQE from BlueFlame QP {q} #{psn} {}", send_name(ev.op)),
            "send",
        ),
        Stage::PayloadFetch => (format!("payload fetch QP {q} #{psn}"), "send"),
        Stage::MsgRateWait => (format!("message-rate wait QP {q} #{psn}"), "send"),
        Stage::TxBuild => (
            format!("packet build QP {q} #{psn} {}", send_name(ev.op)),
            "send",
        ),
        Stage::PayloadRead => (
            format!("payload read QP {q} PSN {psn} ({} B)", ev.bytes),
            "pcie",
        ),
        Stage::Serialize => (format!("TX {} PSN {psn} QP {q}", bth_name(ev.op)), "wire"),
        Stage::Flight | Stage::SwitchedFlight => {
            let fate = match ev.status {
                0 => "",
                1 => " (dropped)",
                2 => " (lost: link down)",
                3 => " (unroutable)",
                _ => " (faulted)",
            };
            let to = if ev.obj == u32::MAX {
                "nowhere".to_string()
            } else {
                format!("node {}", ev.obj)
            };
            (
                format!("{} PSN {psn} -> {to} QP {q}{fate}", bth_name(ev.op)),
                "wire",
            )
        }
        Stage::Rx => (format!("RX {} PSN {psn} QP {q}", bth_name(ev.op)), "recv"),
        Stage::TagMatch => (
            format!("tag match SRQ {} ({} compared)", ev.obj, ev.bytes),
            "recv",
        ),
        Stage::RespWait => (format!("wait for earlier writes QP {q} PSN {psn}"), "resp"),
        Stage::ReadRespSetup => (
            format!("READ fetch + response set-up QP {q} PSN {psn}"),
            "resp",
        ),
        Stage::AtomicFetch => (format!("atomic operand QP {q} PSN {psn}"), "resp"),
        Stage::DmaWrite => (format!("payload DMA QP {q} ({} B)", ev.bytes), "pcie"),
        Stage::Visible => (format!("payload visible QP {q}"), "host"),
        Stage::CqeDma => (format!("CQE DMA CQ {} QP {q}", ev.obj), "pcie"),
        Stage::CqeVisible => (format!("CQE visible CQ {} QP {q}", ev.obj), "host"),
        Stage::CqeOrder => (format!("CQE behind data CQ {} QP {q}", ev.obj), "cqe"),
        Stage::CqeWrite => (
            format!(
                "CQE CQ {} QP {q} #{psn} opcode {} status {}",
                ev.obj, ev.op, ev.status
            ),
            "cqe",
        ),
        Stage::Command => {
            let name = match u16::try_from(ev.obj).ok().and_then(CmdOpcode::from_u16) {
                Some(c) => format!("{c:?}"),
                None => format!("0x{:x}", ev.obj),
            };
            (format!("command {name}"), "cmd")
        }
        Stage::CounterUpdate => (
            format!("counter {} = {} ok / {} err", ev.obj, ev.psn, ev.bytes),
            "cntr",
        ),
        Stage::TriggerDispatch => (
            format!("triggered #{} -> QP {q} {}", ev.obj, send_name(ev.op)),
            "cntr",
        ),
        Stage::AsyncEvent => (format!("event type {} object {q}", ev.op), "event"),
        Stage::Retry => (format!("retry QP {q} from PSN {psn}"), "send"),
        Stage::AckTimeout => (format!("ACK timeout QP {q} PSN {psn}"), "send"),
        Stage::RnrWait => (format!("RNR wait QP {q} PSN {psn}"), "send"),
    }
}

/// The event's arguments (the inside of the `args` object).
fn args(s: &mut String, ev: &TraceEvent, overflow: bool) {
    let _ = write!(s, "\"stage\":\"{}\"", ev.stage.name());
    let cost = ev.stage.cost();
    if !cost.is_empty() {
        let _ = write!(s, ",\"cost\":\"{}\"", cost.join(" + "));
    }
    if ev.qpn != 0 {
        let _ = write!(s, ",\"qpn\":{}", ev.qpn);
    }
    match ev.stage {
        Stage::Serialize
        | Stage::Flight
        | Stage::SwitchedFlight
        | Stage::Rx
        | Stage::PayloadRead
        | Stage::ReadRespSetup
        | Stage::RespWait
        | Stage::AtomicFetch
        | Stage::Retry
        | Stage::AckTimeout
        | Stage::RnrWait
        | Stage::TagMatch => {
            let _ = write!(s, ",\"psn\":{}", ev.psn);
        }
        Stage::WqeFetch | Stage::BlueFlameWqe | Stage::PayloadFetch | Stage::TxBuild => {
            let _ = write!(s, ",\"wqe_index\":{}", ev.psn);
        }
        Stage::CqeDma | Stage::CqeVisible | Stage::CqeOrder | Stage::CqeWrite => {
            let _ = write!(
                s,
                ",\"cqn\":{},\"wqe_counter\":{},\"cqe_opcode\":{},\"status\":{}",
                ev.obj, ev.psn, ev.op, ev.status
            );
        }
        Stage::HostDoorbell | Stage::HostBlueFlame | Stage::HostRegWrite | Stage::MmioPost => {
            let _ = write!(s, ",\"bar0_offset\":\"0x{:x}\"", ev.obj);
        }
        _ => {}
    }
    if matches!(ev.stage, Stage::Flight | Stage::SwitchedFlight) && ev.obj != u32::MAX {
        let _ = write!(s, ",\"to_node\":{}", ev.obj);
    }
    if ev.bytes != 0 && !matches!(ev.stage, Stage::CounterUpdate | Stage::TagMatch) {
        let _ = write!(s, ",\"bytes\":{}", ev.bytes);
    }
    if overflow {
        let _ = write!(
            s,
            ",\"dur_us\":{},\"note\":\"more than {MAX_LANES} overlapping stages on this track: shown as an instant\"",
            Us(ev.end - ev.start)
        );
    }
}

/// (BTH opcode, destination QP, PSN) of a RoCEv2 frame; zeros for anything else.
pub(crate) fn bth_of(f: &[u8]) -> (u8, u32, u32) {
    // Ethernet 14 + IPv4 20 + UDP 8 bytes before the BTH.
    const BTH: usize = 42;
    if f.len() < BTH + 12 || f[12] != 0x08 || f[13] != 0x00 || f[14 + 9] != 17 {
        return (0, 0, 0);
    }
    let b = |i: usize| f[BTH + i] as u32;
    (
        f[BTH],
        b(5) << 16 | b(6) << 8 | b(7),
        b(9) << 16 | b(10) << 8 | b(11),
    )
}

/// One line of a [`Breakdown`]: a stage on the latency path, or a wait between two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The node it happens on (for a frame's flight, the sender).
    pub node: usize,
    /// The stage; `None` for a wait no stage accounts for (a busy resource).
    pub stage: Option<Stage>,
    /// When it starts.
    pub start: SimTime,
    /// When it ends.
    pub end: SimTime,
    /// Bytes it moves (frame length for serialization).
    pub bytes: u32,
}

impl Step {
    /// Its duration.
    pub fn dur(&self) -> SimTime {
        self.end - self.start
    }
}

/// Where one message's latency goes: the stages of its critical path, back to back from
/// the host's first store to what the measurement waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breakdown {
    /// The operation.
    pub op: PerfOp,
    /// Message bytes.
    pub size: u32,
    /// The stages, in order, each starting where the one before ends.
    pub steps: Vec<Step>,
    /// For WRITE and SEND, the ACK's way back to the sender's completion (off the latency
    /// path: the receiver sees the data first). Starts where the receiver's checks end.
    pub ack: Vec<Step>,
    /// The latency `PerfPair::latency` measured in the same run (for WRITE and SEND the
    /// mean of the ping and the pong).
    pub measured: SimTime,
    /// The end-to-end time of the way back (the pong) of a WRITE or SEND ping-pong, whose
    /// mean with [`Breakdown::total`] is the measured figure; the total itself for a READ.
    pub pong: SimTime,
}

impl Breakdown {
    /// When the message starts.
    pub fn start(&self) -> SimTime {
        self.steps.first().map_or(SimTime::ZERO, |s| s.start)
    }
    /// The sum of the steps.
    pub fn total(&self) -> SimTime {
        SimTime(self.steps.iter().map(|s| s.dur().ps()).sum())
    }
    /// Whether the steps add up to what was measured.
    pub fn matches_measurement(&self) -> bool {
        let total = self.total().ps();
        match self.op {
            PerfOp::Write | PerfOp::Send => (total + self.pong.ps()) / 2 == self.measured.ps(),
            _ => total == self.measured.ps(),
        }
    }

    /// The breakdown as text: one line per step with its offset from the start, duration,
    /// node, stage and the timing parameters it comes from.
    pub fn render(&self, timing: &TimingProfile) -> String {
        let mut s = String::new();
        let ns = |t: SimTime| t.ps() as f64 / 1e3;
        let t0 = self.start();
        let line = |s: &mut String, st: &Step| {
            let (what, cost) = match st.stage {
                Some(stage) => {
                    let mut what = stage.name().to_string();
                    if st.bytes != 0
                        && matches!(
                            stage,
                            Stage::Serialize
                                | Stage::DmaWrite
                                | Stage::CqeDma
                                | Stage::PayloadRead
                                | Stage::HostBlueFlame
                        )
                    {
                        let _ = write!(what, " ({} B)", st.bytes);
                    }
                    let v = |f: &str| format!("{f} {}", timing.get(f).unwrap_or(0));
                    let cost: Vec<String> = stage.cost().iter().map(|f| v(f)).collect();
                    let cost = match stage {
                        // Two hops, node to switch and switch to node.
                        Stage::SwitchedFlight => format!(
                            "2 x ({} + {}) + {}",
                            v("link_phy_mac_ps"),
                            v("link_prop_ps"),
                            v("switch_cut_through_ps")
                        ),
                        _ if cost.is_empty() => "-".to_string(),
                        _ => cost.join(", "),
                    };
                    (what, cost)
                }
                None => (
                    "wait (resource busy)".to_string(),
                    "queueing behind earlier work".to_string(),
                ),
            };
            let place = match st.stage {
                Some(Stage::Flight | Stage::SwitchedFlight) => format!("wire {}->", st.node),
                _ => format!("node {}", st.node),
            };
            let _ = writeln!(
                s,
                "  {:>10.3} {:>10.3}  {:<8} {:<30} {}",
                ns(st.start - t0),
                ns(st.dur()),
                place,
                what,
                cost
            );
        };
        let _ = writeln!(
            s,
            "{} {} B  ({})",
            self.op.name().to_uppercase(),
            self.size,
            match self.op {
                PerfOp::Write => "one way: until the last byte is visible to the polling receiver",
                PerfOp::Send => "one way: until the receive CQE is visible to the receiver",
                _ => "round trip: until the requester's CQE is visible",
            }
        );
        let _ = writeln!(
            s,
            "  {:>10} {:>10}  {:<8} {:<30} cost from (timing profile, ps or per µs)",
            "start ns", "dur ns", "where", "stage"
        );
        for st in &self.steps {
            line(&mut s, st);
        }
        let total = self.total();
        let _ = write!(
            s,
            "  total {:.3} ns; measured latency {:.3} ns",
            ns(total),
            ns(self.measured)
        );
        match self.op {
            PerfOp::Write | PerfOp::Send => {
                let _ = write!(
                    s,
                    " (mean of this ping and its pong of {:.3} ns)",
                    ns(self.pong)
                );
            }
            _ => {}
        }
        let _ = writeln!(
            s,
            ": {}",
            if self.matches_measurement() {
                "the stages add up to it"
            } else {
                "MISMATCH"
            }
        );
        if !self.ack.is_empty() {
            let _ = writeln!(s, "  the ACK back to the sender (off the latency path):");
            for st in &self.ack {
                line(&mut s, st);
            }
            if let Some(last) = self.ack.last() {
                let _ = writeln!(
                    s,
                    "  the sender's CQE is visible at {:.3} ns",
                    ns(last.end - t0)
                );
            }
        }
        s
    }
}

/// A step of the path to look for: stages on one node (`peer`: the other one), and whether
/// it may be absent.
#[derive(Clone, Copy)]
struct Want {
    peer: bool,
    stages: &'static [Stage],
    optional: bool,
}

const fn want(peer: bool, stages: &'static [Stage]) -> Want {
    Want {
        peer,
        stages,
        optional: false,
    }
}

const fn maybe(peer: bool, stages: &'static [Stage]) -> Want {
    Want {
        peer,
        stages,
        optional: true,
    }
}

const FLIGHT: &[Stage] = &[Stage::Flight, Stage::SwitchedFlight];

/// The requester's part, from the host store to the request on the wire.
const REQUEST: &[Want] = &[
    want(false, &[Stage::HostBlueFlame, Stage::HostDoorbell]),
    want(false, &[Stage::MmioPost]),
    want(false, &[Stage::BlueFlameWqe, Stage::WqeFetch]),
    maybe(false, &[Stage::PayloadFetch]),
    maybe(false, &[Stage::MsgRateWait]),
    want(false, &[Stage::TxBuild]),
    want(false, &[Stage::Serialize]),
    want(false, FLIGHT),
    want(true, &[Stage::Rx]),
    maybe(true, &[Stage::TagMatch]),
];

const CQE: [Want; 3] = [
    want(true, &[Stage::CqeDma]),
    want(true, &[Stage::CqeVisible]),
    want(true, &[Stage::CqeOrder]),
];

const WRITE_TAIL: &[Want] = &[
    want(true, &[Stage::DmaWrite]),
    want(true, &[Stage::Visible]),
];

const SEND_TAIL: &[Want] = &[want(true, &[Stage::DmaWrite]), CQE[0], CQE[1], CQE[2]];

/// The READ's way from the responder's checks back to the requester's CQE (roles swap:
/// `peer` is the requester here).
const READ_TAIL: &[Want] = &[
    maybe(false, &[Stage::RespWait]),
    want(false, &[Stage::ReadRespSetup]),
    want(false, &[Stage::PayloadRead]),
    want(false, &[Stage::Serialize]),
    want(false, FLIGHT),
    want(true, &[Stage::Rx]),
    want(true, &[Stage::DmaWrite]),
    CQE[0],
    CQE[1],
    CQE[2],
];

/// The ACK from the receiver's checks back to the sender's CQE (`peer`: the sender).
const ACK_TAIL: &[Want] = &[
    want(false, &[Stage::Serialize]),
    want(false, FLIGHT),
    want(true, &[Stage::Rx]),
    CQE[0],
    CQE[1],
    CQE[2],
];

/// Follows `path` through `events` from `from` on node `node` (its peer: `peer`): each
/// step is the earliest matching stage starting at or after the end of the one before;
/// any time between two is a wait. An optional step is taken only if it starts right
/// where the path is. Returns the steps, or the first one that was not found.
fn follow(
    events: &[NodeEvent],
    path: &[Want],
    node: usize,
    peer: usize,
    from: SimTime,
) -> Result<Vec<Step>, String> {
    let mut t = from;
    let mut steps = Vec::new();
    for w in path {
        let on = if w.peer { peer } else { node };
        let hit = events
            .iter()
            .filter(|e| e.node == on && w.stages.contains(&e.ev.stage) && e.ev.start >= t)
            .filter(|e| {
                // A doorbell on the latency path is the SQ's (op 0) of a QP.
                e.ev.stage != Stage::HostDoorbell || (e.ev.qpn != 0 && e.ev.op == 0)
            })
            .min_by_key(|e| e.ev.start);
        let Some(e) = hit.filter(|e| !w.optional || e.ev.start == t) else {
            if w.optional {
                continue;
            }
            return Err(format!(
                "no {} on node {on} after {:.3} µs",
                w.stages[0].name(),
                t.as_us_f64()
            ));
        };
        if e.ev.start > t && !steps.is_empty() {
            steps.push(Step {
                node: on,
                stage: None,
                start: t,
                end: e.ev.start,
                bytes: 0,
            });
        }
        steps.push(Step {
            node: on,
            stage: Some(e.ev.stage),
            start: e.ev.start,
            end: e.ev.end,
            bytes: e.ev.bytes,
        });
        t = e.ev.end;
    }
    Ok(steps)
}

/// The critical path of the first `op` message node `src` sends to its peer after `from`,
/// and for WRITE/SEND the ACK's way back.
fn path_of(
    events: &[NodeEvent],
    op: PerfOp,
    src: usize,
    dst: usize,
    from: SimTime,
) -> Result<(Vec<Step>, Vec<Step>), String> {
    let mut steps = follow(events, REQUEST, src, dst, from)?;
    let rx_end = steps.last().map_or(from, |s| s.end);
    let (tail, ack) = match op {
        PerfOp::Write => (follow(events, WRITE_TAIL, src, dst, rx_end)?, true),
        PerfOp::Send => (follow(events, SEND_TAIL, src, dst, rx_end)?, true),
        _ => (follow(events, READ_TAIL, dst, src, rx_end)?, false),
    };
    steps.extend(tail);
    let ack = if ack {
        follow(events, ACK_TAIL, dst, src, rx_end)?
    } else {
        Vec::new()
    };
    Ok((steps, ack))
}

/// Measures one `size`-byte `op` (WRITE, SEND or READ) with `PerfPair::latency` on a fresh
/// pair of nodes built from `cfg` (two nodes), with a timeline recording, and breaks the
/// latency down into the stages of its critical path.
pub fn breakdown(cfg: FabricConfig, op: PerfOp, size: u32) -> Result<Breakdown, String> {
    if cfg.nodes != 2 {
        return Err("a breakdown runs on two nodes".into());
    }
    if !matches!(op, PerfOp::Write | PerfOp::Send | PerfOp::Read) {
        return Err(format!("no breakdown for {}", op.name()));
    }
    let mtu = 4096;
    if !(1..=mtu).contains(&size) {
        return Err(format!(
            "--size {size}: a breakdown follows one packet (1..={mtu} B)"
        ));
    }
    let mut pair =
        PerfPair::with(cfg, &ringbell::ConnectOptions::default()).map_err(|e| e.to_string())?;
    let fabric = pair.fabric().clone();
    fabric.run_until_quiet();
    let from = fabric.now();
    fabric
        .start_timeline(DEFAULT_MAX_EVENTS)
        .map_err(|e| e.to_string())?;
    let measured = pair.latency(op, size, 1).map_err(|e| e.to_string())?;
    fabric.run_until_quiet();
    let tl = fabric
        .take_timeline()
        .ok_or("the timeline was not running")?;
    let ev = tl.events();
    let (steps, ack) = path_of(ev, op, 0, 1, from)?;
    let end = steps.last().map_or(from, |s| s.end);
    let total = SimTime(steps.iter().map(|s| s.dur().ps()).sum());
    let pong = match op {
        PerfOp::Write | PerfOp::Send => {
            let (back, _) = path_of(ev, op, 1, 0, end)?;
            SimTime(back.iter().map(|s| s.dur().ps()).sum())
        }
        _ => total,
    };
    Ok(Breakdown {
        op,
        size,
        steps,
        ack,
        measured,
        pong,
    })
}

/// The breakdown of an 8-byte WRITE, SEND and READ on two back-to-back nodes with timing
/// profile `timing`, as [`breakdown`] gives them.
pub fn breakdown_all(
    seed: u64,
    topology: Topology,
    timing: TimingProfile,
    size: u32,
) -> Result<Vec<Breakdown>, String> {
    [PerfOp::Write, PerfOp::Send, PerfOp::Read]
        .into_iter()
        .map(|op| {
            let mut cfg = FabricConfig::new(2, seed);
            cfg.topology = topology;
            cfg.timing = timing.clone();
            breakdown(cfg, op, size)
        })
        .collect()
}
