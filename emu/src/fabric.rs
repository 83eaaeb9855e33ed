//! The fabric: nodes, links, the switch, and the one event queue that orders them all.

use crate::capture::{Capture, CaptureStats, Fate};
use crate::faults::{FaultPlan, FaultRule, FaultStats, Faults};
use crate::iommu::Iommu;
use crate::port::EmuPort;
use crate::timeline::{Timeline, TimelineStats};
use rand_core::SeedableRng;
use rand_pcg::Pcg64Mcg;
use ringbell_model::sim::EventQueue;
use ringbell_model::{
    DmaFault, Env, FmMsg, Nic, NicConfig, NicEvent, NicStats, Stage, TimingProfile, TraceEvent,
};
use ringbell_specs::{regs, wire, SimTime};
use std::cell::RefCell;
use std::io::{self, Write};
use std::path::Path;
use std::rc::Rc;

/// How the nodes are wired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// Every node on one switch port; the switch serializes per egress port.
    Switch,
    /// Two nodes joined by one cable (the perftest set-up); only valid for two nodes.
    BackToBack,
}

/// Fabric configuration.
#[derive(Clone, Debug)]
pub struct FabricConfig {
    /// Number of nodes (1..=1024).
    pub nodes: usize,
    /// Root of every random stream.
    pub seed: u64,
    /// Wiring.
    pub topology: Topology,
    /// Timing profile for NICs and links.
    pub timing: TimingProfile,
    /// Faults injected on the links.
    pub faults: FaultPlan,
    /// Functional (untimed) mode: messages of RC QPs that are eligible (SEND, WRITE, READ and
    /// atomics; see `ringbell_model::Nic::fm_receive`) go straight from the requester to the
    /// peer responder, whole and in one copy, with no frames and no ACKs; everything else takes
    /// the packet path. Off by default. It is in force only while no fault plan, capture or
    /// timeline is active (those need the frames).
    pub functional: bool,
}

impl FabricConfig {
    /// `nodes` nodes on a switch, default timing.
    pub fn new(nodes: usize, seed: u64) -> Self {
        FabricConfig {
            nodes,
            seed,
            topology: Topology::Switch,
            timing: TimingProfile::default(),
            faults: FaultPlan::default(),
            functional: false,
        }
    }
}

/// Fabric-wide counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricStats {
    /// Events processed.
    pub events: u64,
    /// Frames delivered to a NIC.
    pub frames_delivered: u64,
    /// Frames whose destination MAC is on no port.
    pub frames_unroutable: u64,
    /// Payload-carrying bytes put on links.
    pub bytes_on_wire: u64,
    /// Frames that are not RoCE dropped because the fault plan changed a bit of them: their
    /// receiver's MAC would find the FCS wrong (a RoCE frame's ICRC catches the change at
    /// its receiver instead).
    pub frames_fcs_dropped: u64,
}

#[derive(Debug)]
pub(crate) enum Event {
    Nic(usize, NicEvent),
    /// A frame for a node; `true`: exactly as its sender built it, sums not yet written
    /// (see [`Env::defers_sums`]).
    Frame(usize, Vec<u8>, bool),
}

#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) nic: Nic,
    pub(crate) iommu: Iommu,
    pub(crate) interrupts: u64,
}

/// The digest of the event trace: FNV-1a's offset and prime over 64-bit words (one
/// multiply per word, not per byte), each step followed by a rotation so that high bits
/// reach the low ones.
#[derive(Debug, Clone, Copy)]
struct Digest(u64);

impl Digest {
    fn word(&mut self, w: u64) {
        self.0 = (self.0 ^ w)
            .wrapping_mul(0x0000_0100_0000_01B3)
            .rotate_left(23);
    }
    /// Feeds `bytes` as little-endian words, the last one zero-padded, then the length.
    fn bytes(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.word(u64::from_le_bytes(c.try_into().unwrap_or_default()));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.word(u64::from_le_bytes(w));
        }
        self.word(bytes.len() as u64);
    }
}

/// Byte buffers kept for reuse (frames, posted DMA writes, BlueFlame blocks): at most this
/// many, each of at most [`POOL_MAX_CAP`] bytes of capacity.
const POOL_MAX: usize = 4096;
const POOL_MAX_CAP: usize = 16 << 10;

/// The frame bytes the digest sees: the BTH and up to 20 bytes after it (every RC opcode's
/// RETH, AETH, atomic header or immediate lies within them), behind the Ethernet, IPv4 and
/// UDP headers; never the ICRC.
const DIGEST_HDR: std::ops::Range<usize> = 42..74;

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) nodes: Vec<Node>,
    /// Everything but the nodes: what a node's NIC reaches through its [`NodeEnv`].
    pub(crate) w: World,
    /// Register writes of each node still on their way to the device.
    pending_mmio: Vec<u32>,
    /// When each node's last posted store reaches its device.
    mmio_last: Vec<SimTime>,
    digest: Digest,
}

/// The fabric apart from its nodes, so that a node's environment is one reference to it
/// beside the node's own parts (built for every event).
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) queue: EventQueue<Event>,
    macs: MacTable,
    switch_free: Vec<SimTime>,
    faults: Faults,
    /// ACK-timer events pending (most are cancelled timers that fire into nothing).
    timers: u64,
    /// Frames on their way to each node.
    in_flight: Vec<u32>,
    /// Per node: an interrupt was raised since the node was last reported by `take_raised`.
    irq_flag: Vec<bool>,
    /// The nodes whose flag is set, in the order they were raised.
    raised: Vec<usize>,
    cfg: FabricConfig,
    stats: FabricStats,
    /// The packet capture, when one runs.
    capture: Option<Box<Capture>>,
    /// The timeline being recorded, when one is.
    timeline: Option<Box<Timeline>>,
    /// Byte buffers for reuse.
    pool: Vec<Vec<u8>>,
}

pub(crate) type Shared = Rc<RefCell<Inner>>;

/// Which node owns a MAC address. Node `i`'s NIC has the MAC `NicConfig::for_node(i)`
/// gives it, whose last two bytes are `i + 1`: a frame's destination is found from those
/// two bytes and one comparison, whatever the number of nodes (a tree lookup cost a few
/// cache misses per frame on a large fabric). Any other address goes through a sorted list.
#[derive(Debug)]
struct MacTable {
    by_node: Vec<[u8; 6]>,
    sorted: Vec<([u8; 6], usize)>,
}

impl MacTable {
    fn new(by_node: Vec<[u8; 6]>) -> MacTable {
        let mut sorted: Vec<_> = by_node.iter().copied().zip(0..).collect();
        sorted.sort_unstable();
        MacTable { by_node, sorted }
    }

    fn node(&self, mac: &[u8; 6]) -> Option<usize> {
        let guess = (usize::from(mac[4]) << 8 | usize::from(mac[5])).wrapping_sub(1);
        if self.by_node.get(guess) == Some(mac) {
            return Some(guess);
        }
        let i = self.sorted.binary_search_by(|(m, _)| m.cmp(mac)).ok()?;
        Some(self.sorted[i].1)
    }
}

/// The environment a NIC sees while it handles one input.
struct NodeEnv<'a> {
    node: usize,
    now: SimTime,
    /// The rest of the fabric.
    w: &'a mut World,
    iommu: &'a Iommu,
    interrupts: &'a mut u64,
    /// The nodes before and after this one (functional mode reaches the peer through them).
    before: &'a mut [Node],
    after: &'a mut [Node],
    /// While a functional message is delivered: the requester's IOMMU (and functional
    /// mode is then not in force for the receiving node, which sends nothing on).
    src_iommu: Option<&'a Iommu>,
}

/// Keeps `buf` in `pool` for reuse if there is room and it is not too large.
fn recycle_into(pool: &mut Vec<Vec<u8>>, mut buf: Vec<u8>) {
    if pool.len() < POOL_MAX && buf.capacity() <= POOL_MAX_CAP {
        buf.clear();
        pool.push(buf);
    }
}

impl NodeEnv<'_> {
    /// Puts `frame`, whose last bit leaves its sender at `at`, on its way to node `dst`:
    /// through the switch, the fault plan and the capture.
    fn deliver(&mut self, at: SimTime, frame: Vec<u8>, dst: usize, unsealed: bool) {
        let t = &self.w.cfg.timing;
        let ser = SimTime(t.serialize_ps(frame.len()));
        // A capture stamps the frame when its first bit goes on the wire.
        let first_bit = (at - ser).max(self.now);
        let hop = SimTime(t.link_phy_mac_ps + t.link_prop_ps);
        self.w.stats.bytes_on_wire += frame.len() as u64;
        let arrival = match self.w.cfg.topology {
            Topology::BackToBack => at + hop,
            Topology::Switch => {
                // Head of the frame reaches the switch, is forwarded after the cut-through
                // latency once the egress port is free, and arrives whole one hop later.
                let head = at - ser + hop;
                let free = &mut self.w.switch_free[dst];
                let start = (head + SimTime(t.switch_cut_through_ps)).max(*free);
                *free = start + ser;
                start + ser + hop
            }
        };
        if self.w.faults.inactive() {
            self.trace_flight(&frame, Some(dst), at, arrival, 0);
            if let Some(c) = &mut self.w.capture {
                c.record(
                    Some(self.node),
                    Some(dst),
                    first_bit,
                    &frame,
                    Fate::Delivered,
                );
            }
            self.w.in_flight[dst] += 1;
            self.w
                .queue
                .push(arrival, Event::Frame(dst, frame, unsealed));
            return;
        }
        let link_down = self.w.faults.stats.link_down;
        let v = self.w.faults.decide(self.node, dst, at, &frame);
        if self.w.timeline.is_some() {
            match v.copies.as_slice() {
                [] => {
                    let lost = 1 + (self.w.faults.stats.link_down > link_down) as u8;
                    self.trace_flight(&frame, Some(dst), at, arrival, lost);
                }
                copies => {
                    let plain = copies.len() == 1 && copies[0] == SimTime::ZERO && v.flip.is_none();
                    for extra in copies {
                        let status = if plain { 0 } else { 4 };
                        self.trace_flight(&frame, Some(dst), at, arrival + *extra, status);
                    }
                }
            }
        }
        if let Some(c) = &mut self.w.capture {
            let fate = Fate::of(&v, self.w.faults.stats.link_down > link_down);
            c.record(Some(self.node), Some(dst), first_bit, &frame, fate);
        }
        let mut frame = frame;
        if let Some(bit) = v.flip {
            if !wire::is_rocev2(&frame) {
                self.w.stats.frames_fcs_dropped += 1;
                return;
            }
            if let Some(b) = frame.get_mut(bit / 8) {
                *b ^= 1 << (bit % 8);
            }
        }
        let mut copies = v.copies.into_iter().peekable();
        while let Some(extra) = copies.next() {
            let f = if copies.peek().is_some() {
                frame.clone()
            } else {
                std::mem::take(&mut frame)
            };
            self.w.in_flight[dst] += 1;
            self.w
                .queue
                .push(arrival + extra, Event::Frame(dst, f, unsealed));
        }
    }
    /// Whether functional mode is in force: looked up when the model asks (about once per
    /// message) rather than for every event.
    fn functional_mode(&self) -> bool {
        let w = &*self.w;
        self.src_iommu.is_none()
            && w.cfg.functional
            && w.faults.inactive()
            && w.capture.is_none()
            && w.timeline.is_none()
    }

    /// Records the flight of `frame` (sent by this node, last bit out at `at`) towards `dst`,
    /// arriving at `arrival`, with fate `status` (see [`Stage::Flight`]).
    fn trace_flight(
        &mut self,
        frame: &[u8],
        dst: Option<usize>,
        at: SimTime,
        arrival: SimTime,
        status: u8,
    ) {
        if let Some(t) = &mut self.w.timeline {
            let stage = match self.w.cfg.topology {
                Topology::BackToBack => Stage::Flight,
                Topology::Switch => Stage::SwitchedFlight,
            };
            let (op, dqpn, psn) = crate::timeline::bth_of(frame);
            let ev = TraceEvent::new(stage, at, arrival)
                .obj(dst.map_or(u32::MAX, |d| d as u32))
                .qpn(dqpn)
                .psn(psn)
                .op(op)
                .status(status)
                .bytes(frame.len());
            t.record(self.node, ev);
        }
    }
}

impl Env for NodeEnv<'_> {
    fn now(&self) -> SimTime {
        self.now
    }
    fn dma_read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        self.iommu.read(iova, buf)
    }
    fn dma_write(&mut self, iova: u64, data: &[u8]) -> Result<(), DmaFault> {
        self.iommu.write(iova, data)
    }
    fn dma_check(&self, iova: u64, len: usize) -> Result<(), DmaFault> {
        self.iommu.check(iova, len)
    }
    fn schedule(&mut self, at: SimTime, ev: NicEvent) {
        if matches!(ev, NicEvent::AckTimer { .. }) {
            self.w.timers += 1;
        }
        self.w.queue.push(at, Event::Nic(self.node, ev));
    }
    fn transmit(&mut self, at: SimTime, mut frame: Vec<u8>) {
        // The model leaves the IPv4 checksum and the ICRC to whoever needs them (defers_sums):
        // a capture shows the frame whole, and a frame that may be changed on the way is
        // sealed first so that its receiver's checks see the change.
        let unsealed = self.w.capture.is_none() && self.w.faults.inactive();
        // Only RoCE frames have sums to write: a raw packet QP's frame is sent as it is.
        if !unsealed && wire::is_rocev2(&frame) {
            wire::seal(&mut frame);
        }
        let mut dst_mac = [0u8; 6];
        if let Some(m) = frame.get(..6) {
            dst_mac.copy_from_slice(m);
        }
        // A multicast or broadcast frame (only raw packet QPs send one) goes to every NIC,
        // its sender's own included: the switch floods it, and the sending NIC loops it back
        // to its own flow-steering rules.
        if dst_mac[0] & 1 == 1 {
            let n = self.w.in_flight.len();
            for dst in 0..n {
                let copy = match dst + 1 < n {
                    true => {
                        let mut b = self.buffer();
                        b.clear();
                        b.extend_from_slice(&frame);
                        b
                    }
                    false => std::mem::take(&mut frame),
                };
                self.deliver(at, copy, dst, unsealed);
            }
            return;
        }
        let Some(dst) = self.w.macs.node(&dst_mac) else {
            let t = &self.w.cfg.timing;
            let ser = SimTime(t.serialize_ps(frame.len()));
            let first_bit = (at - ser).max(self.now);
            let hop = SimTime(t.link_phy_mac_ps + t.link_prop_ps);
            self.trace_flight(&frame, None, at, at + hop, 3);
            self.w.stats.frames_unroutable += 1;
            if let Some(c) = &mut self.w.capture {
                c.record(Some(self.node), None, first_bit, &frame, Fate::Unroutable);
            }
            return;
        };
        self.deliver(at, frame, dst, unsealed);
    }

    fn interrupt(&mut self, _vector: u32) {
        *self.interrupts += 1;
        if let Some(f) = self.w.irq_flag.get_mut(self.node) {
            if !*f {
                *f = true;
                self.w.raised.push(self.node);
            }
        }
    }
    fn buffer(&mut self) -> Vec<u8> {
        self.w.pool.pop().unwrap_or_default()
    }
    fn recycle(&mut self, buf: Vec<u8>) {
        recycle_into(&mut self.w.pool, buf);
    }
    fn defers_sums(&self) -> bool {
        true
    }
    fn tracing(&self) -> bool {
        self.w.timeline.is_some()
    }
    fn trace(&mut self, ev: TraceEvent) {
        if let Some(t) = &mut self.w.timeline {
            t.record(self.node, ev);
        }
    }
    fn functional(&self) -> bool {
        self.functional_mode()
    }
    fn fm_deliver(&mut self, msg: &FmMsg<'_>) -> Option<u64> {
        if !self.functional_mode() {
            return None;
        }
        let dst = self.w.macs.node(&msg.dst_mac)?;
        // Nothing of the packet path may be under way between the two nodes (a frame still
        // travelling would arrive behind messages placed since).
        if dst == self.node || self.w.in_flight[dst] != 0 || self.w.in_flight[self.node] != 0 {
            return None;
        }
        let peer = if dst < self.node {
            &mut self.before[dst]
        } else {
            &mut self.after[dst - self.node - 1]
        };
        let Node {
            nic,
            iommu,
            interrupts,
        } = peer;
        let mut env = NodeEnv {
            node: dst,
            now: self.now,
            w: &mut *self.w,
            iommu,
            interrupts,
            before: &mut [],
            after: &mut [],
            src_iommu: Some(self.iommu),
        };
        nic.fm_receive(&mut env, msg)
    }
    fn dma_copy_from_peer(&mut self, iova: u64, src_iova: u64, len: usize) -> Result<(), DmaFault> {
        match self.src_iommu {
            Some(src) => self.iommu.copy_from(iova, src, src_iova, len),
            None => Err(DmaFault { iova }),
        }
    }
    fn dma_copy_to_peer(&mut self, peer_iova: u64, iova: u64, len: usize) -> Result<(), DmaFault> {
        match self.src_iommu {
            Some(peer) => peer.copy_from(peer_iova, self.iommu, iova, len),
            None => Err(DmaFault { iova: peer_iova }),
        }
    }
}

impl Inner {
    fn with_env<R>(&mut self, node: usize, f: impl FnOnce(&mut Nic, &mut NodeEnv<'_>) -> R) -> R {
        let w = &mut self.w;
        let (before, rest) = self.nodes.split_at_mut(node);
        let Some((
            Node {
                nic,
                iommu,
                interrupts,
            },
            after,
        )) = rest.split_first_mut()
        else {
            panic!("node {node} out of range");
        };
        let mut env = NodeEnv {
            node,
            now: w.queue.now(),
            w,
            iommu,
            interrupts,
            before,
            after,
            src_iommu: None,
        };
        f(nic, &mut env)
    }

    pub(crate) fn mmio_read(&mut self, node: usize, offset: u64) -> u32 {
        // A read does not pass earlier writes (PCIe ordering): the CPU stalls until they
        // have reached the device, and simulated time moves on meanwhile.
        while self.pending_mmio[node] > 0 && self.step() {}
        let now = self.w.queue.now();
        self.nodes[node].nic.mmio_read(now, offset)
    }

    /// A CPU store to BAR0: it reaches the device after the host and PCIe posting costs.
    pub(crate) fn mmio_write(&mut self, node: usize, offset: u64, value: u32) {
        let (db, mmio) = (
            self.w.cfg.timing.host_doorbell_ps,
            self.w.cfg.timing.mmio_post_ps,
        );
        let now = self.w.queue.now();
        let at = self.in_order(node, now + SimTime(db + mmio));
        if let Some(tl) = &mut self.w.timeline {
            tl.record_host_store(node, offset, 4, now, now + SimTime(db), at);
        }
        self.w
            .queue
            .push(at, Event::Nic(node, NicEvent::Mmio { offset, value }));
        self.pending_mmio[node] += 1;
    }

    /// Posted stores reach the device in the order the CPU made them: a store never arrives
    /// before an earlier one from the same node (a BlueFlame store costs more than a
    /// doorbell, so a doorbell right behind it would otherwise overtake it).
    fn in_order(&mut self, node: usize, at: SimTime) -> SimTime {
        let at = at.max(self.mmio_last[node]);
        self.mmio_last[node] = at;
        at
    }

    /// A write-combined store of up to 256 bytes to BAR0 (BlueFlame): the WQE copy costs the
    /// host the post, then it travels as one posted write.
    pub(crate) fn mmio_write_block(&mut self, node: usize, offset: u64, data: &[u8]) {
        let t = &self.w.cfg.timing;
        let (post, mmio) = (t.host_post_wqe_ps + t.host_doorbell_ps, t.mmio_post_ps);
        let now = self.w.queue.now();
        let stored = now + SimTime(post);
        let at = self.in_order(node, stored + SimTime(mmio));
        if let Some(tl) = &mut self.w.timeline {
            tl.record_host_store(node, offset, data.len(), now, stored, at);
        }
        let mut buf = self.w.pool.pop().unwrap_or_default();
        buf.extend_from_slice(data);
        self.w.queue.push(
            at,
            Event::Nic(node, NicEvent::MmioBlock { offset, data: buf }),
        );
        self.pending_mmio[node] += 1;
    }

    /// Processes the next event. Returns `false` if none is pending.
    /// Moves simulated time forward to `t` with nothing happening, or to the next pending
    /// event if that comes first.
    pub(crate) fn idle_until(&mut self, t: SimTime) {
        let t = self.w.queue.peek_time().map_or(t, |next| next.min(t));
        self.w.queue.advance_to(t);
    }

    pub(crate) fn step(&mut self) -> bool {
        let Some((at, ev)) = self.w.queue.pop() else {
            return false;
        };
        self.w.stats.events += 1;
        self.digest.word(at.ps());
        if let Some(c) = &mut self.w.capture {
            c.flush_until(at);
        }
        match ev {
            Event::Nic(node, ev) => {
                if matches!(ev, NicEvent::AckTimer { .. }) {
                    self.w.timers -= 1;
                }
                self.digest.word(node as u64);
                if let NicEvent::Mmio { offset, value } = &ev {
                    self.pending_mmio[node] = self.pending_mmio[node].saturating_sub(1);
                    self.digest.word(*offset);
                    self.digest.word(u64::from(*value));
                }
                if let NicEvent::MmioBlock { offset, data } = &ev {
                    self.pending_mmio[node] = self.pending_mmio[node].saturating_sub(1);
                    self.digest.word(*offset);
                    self.digest.bytes(data);
                }
                self.with_env(node, |nic, env| nic.handle(env, ev));
            }
            Event::Frame(node, frame, unsealed) => {
                self.w.in_flight[node] = self.w.in_flight[node].saturating_sub(1);
                self.digest.word(node as u64 | 1 << 63);
                // Frames enter the digest through their length and transport headers
                // (opcode, QPN, PSN, RETH/AETH/atomic fields): what tells one packet from
                // another without a pass over the payload. A payload that differs shows in
                // what its receiver does next.
                self.digest.word(frame.len() as u64);
                // Never the ICRC, which a capture or a fault seals and an untouched frame
                // leaves unwritten.
                let end = DIGEST_HDR
                    .end
                    .min(frame.len().saturating_sub(wire::ICRC_LEN));
                let hdr = frame.get(DIGEST_HDR.start..end.max(DIGEST_HDR.start));
                self.digest.bytes(hdr.unwrap_or_default());
                self.w.stats.frames_delivered += 1;
                if unsealed {
                    self.with_env(node, |nic, env| nic.receive_unsealed(env, &frame));
                } else {
                    self.with_env(node, |nic, env| nic.receive(env, &frame));
                }
                recycle_into(&mut self.w.pool, frame);
            }
        }
        true
    }
}

/// A simulated fabric of NICs.
#[derive(Debug, Clone)]
pub struct Fabric {
    shared: Shared,
}

/// Derives the seed of random stream `stream` from the root seed (SplitMix64 finalizer).
pub fn stream_seed(seed: u64, stream: u64) -> u64 {
    let mut z = seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Fabric {
    /// Builds a fabric. Panics only on a configuration error made by the caller (0 nodes,
    /// more than 1024, or back-to-back with other than two nodes).
    pub fn new(cfg: FabricConfig) -> Fabric {
        assert!(
            (1..=1024).contains(&cfg.nodes),
            "a fabric has 1..=1024 nodes"
        );
        assert!(
            cfg.topology != Topology::BackToBack || cfg.nodes == 2,
            "back-to-back needs exactly two nodes"
        );
        let mut nodes = Vec::new();
        let mut macs = Vec::new();
        for i in 0..cfg.nodes {
            let mut nc = NicConfig::for_node(i as u32);
            nc.timing = cfg.timing.clone();
            macs.push(nc.mac);
            nodes.push(Node {
                nic: Nic::new(nc),
                iommu: Iommu::default(),
                interrupts: 0,
            });
        }
        let inner = Inner {
            pending_mmio: vec![0; cfg.nodes],
            mmio_last: vec![SimTime::ZERO; cfg.nodes],
            nodes,
            digest: Digest(0xCBF2_9CE4_8422_2325),
            w: World {
                queue: EventQueue::new(),
                switch_free: vec![SimTime::ZERO; cfg.nodes],
                in_flight: vec![0; cfg.nodes],
                irq_flag: vec![false; cfg.nodes],
                raised: Vec::new(),
                timers: 0,
                faults: Faults::new(cfg.faults.clone(), cfg.nodes, cfg.seed),
                macs: MacTable::new(macs),
                stats: FabricStats::default(),
                capture: None,
                timeline: None,
                pool: Vec::new(),
                cfg,
            },
        };
        Fabric {
            shared: Rc::new(RefCell::new(inner)),
        }
    }

    /// The driver's port to node `node`.
    pub fn port(&self, node: usize) -> EmuPort {
        assert!(node < self.nodes(), "node {node} out of range");
        EmuPort {
            shared: self.shared.clone(),
            node,
        }
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.shared.borrow().nodes.len()
    }

    /// The root seed.
    pub fn seed(&self) -> u64 {
        self.shared.borrow().w.cfg.seed
    }

    /// A deterministic random stream derived from the seed (PCG-64 MCG, pinned).
    pub fn rng(&self, stream: u64) -> Pcg64Mcg {
        Pcg64Mcg::seed_from_u64(stream_seed(self.seed(), stream))
    }

    /// Current simulated time.
    pub fn now(&self) -> SimTime {
        self.shared.borrow().w.queue.now()
    }

    /// Processes one event; `false` if the queue was empty.
    pub fn step(&self) -> bool {
        self.shared.borrow_mut().step()
    }

    /// Runs until no event is pending or `limit` events have run; returns the count.
    pub fn run_until_idle(&self, limit: u64) -> u64 {
        let mut n = 0;
        while n < limit && self.step() {
            n += 1;
        }
        n
    }

    /// Runs events until one of `nodes` has written a completion (a CQE now visible in host
    /// memory) or none is pending; true if a CQE was written. A harness that polls CQs
    /// calls this instead of polling after every event: a poll between two events that
    /// wrote no CQE can find nothing, so the run (and every simulated time in it) is the
    /// same.
    pub fn run_until_cqe(&self, nodes: &[usize]) -> bool {
        let mut s = self.shared.borrow_mut();
        let cqes = |s: &Inner| -> u64 {
            nodes
                .iter()
                .filter_map(|&n| s.nodes.get(n))
                .map(|n| n.nic.stats().cqes)
                .sum()
        };
        let before = cqes(&s);
        while s.step() {
            if cqes(&s) != before {
                return true;
            }
        }
        false
    }

    /// Runs until nothing but ACK timers is pending: the fabric is quiet unless a timer finds
    /// work to do (a lost packet). Returns the number of events run.
    pub fn run_until_quiet(&self) -> u64 {
        let mut n = 0;
        loop {
            let quiet = {
                let s = self.shared.borrow();
                s.w.queue.len() as u64 <= s.w.timers
            };
            if quiet || !self.step() {
                return n;
            }
            n += 1;
        }
    }

    /// Digest of every event processed so far.
    pub fn trace_digest(&self) -> u64 {
        self.shared.borrow().digest.0
    }

    /// Fabric counters.
    pub fn stats(&self) -> FabricStats {
        self.shared.borrow().w.stats.clone()
    }

    /// A node's NIC counters.
    pub fn nic_stats(&self, node: usize) -> NicStats {
        *self.shared.borrow().nodes[node].nic.stats()
    }

    /// Moves simulated time forward to `t` with nothing happening, or to the next pending
    /// event if that comes first (an out-of-process server keeps the clock with wall time).
    pub fn advance_to(&self, t: SimTime) {
        self.shared.borrow_mut().idle_until(t);
    }

    /// When the next pending event is due, if one is.
    pub fn next_event_at(&self) -> Option<SimTime> {
        self.shared.borrow().w.queue.peek_time()
    }

    /// The BAR0 offsets of node `node`'s live doorbell slots (see
    /// [`ringbell_model::Nic::doorbell_slots`]).
    pub fn doorbell_slots(&self, node: usize, out: &mut Vec<u64>) {
        self.shared.borrow().nodes[node].nic.doorbell_slots(out)
    }

    /// DMA mappings node `node` holds.
    pub fn dma_mappings(&self, node: usize) -> usize {
        self.shared.borrow().nodes[node].iommu.len()
    }

    /// Resets node `node` as a host that went away leaves it: the device reset (every object
    /// destroyed, nothing completed) and every DMA mapping removed. Returns the number of
    /// mappings removed.
    pub fn reclaim_node(&self, node: usize) -> usize {
        let mut s = self.shared.borrow_mut();
        s.with_env(node, |nic, env| {
            nic.mmio_write(env, regs::RESET, regs::RESET_KEY)
        });
        s.nodes[node].iommu.clear()
    }

    /// Moves into `out` (cleared first) the nodes that raised an interrupt (an event queue
    /// entry, or an armed CQ's event) since the last call, each once, in the order they first
    /// did: a harness polls just those nodes instead of every node after every step.
    pub fn take_raised(&self, out: &mut Vec<usize>) {
        let mut s = self.shared.borrow_mut();
        let s = &mut *s;
        out.clear();
        out.append(&mut s.w.raised);
        for &n in out.iter() {
            s.w.irq_flag[n] = false;
        }
    }

    /// MSI-X interrupts node `node` has raised.
    pub fn interrupts(&self, node: usize) -> u64 {
        self.shared.borrow().nodes[node].interrupts
    }

    /// The timing profile.
    pub fn timing(&self) -> TimingProfile {
        self.shared.borrow().w.cfg.timing.clone()
    }

    /// Replaces the fault plan (rule counters restart; the random streams go on).
    pub fn set_faults(&self, plan: FaultPlan) {
        self.shared.borrow_mut().w.faults.set_plan(plan);
    }

    /// Adds a targeted fault rule.
    pub fn add_fault_rule(&self, rule: FaultRule) {
        self.shared.borrow_mut().w.faults.add_rule(rule);
    }

    /// What fault injection has done so far.
    pub fn fault_stats(&self) -> FaultStats {
        self.shared.borrow().w.faults.stats.clone()
    }

    /// Injects a raw frame towards `node` at the current time (tests and fuzzing).
    pub fn inject_frame(&self, node: usize, frame: Vec<u8>) {
        let mut s = self.shared.borrow_mut();
        let now = s.w.queue.now();
        if let Some(c) = &mut s.w.capture {
            c.record(None, Some(node), now, &frame, Fate::Delivered);
        }
        s.w.in_flight[node] += 1;
        s.w.queue.push(now, Event::Frame(node, frame, false));
    }

    /// Starts a packet capture: every frame the fabric carries from now on is written to `out`
    /// as pcapng, with simulated nanosecond timestamps and a comment per frame (see
    /// [`crate::capture`] for the exact semantics). The section header and interfaces are
    /// written at once. Fails if a capture already runs or `out` fails.
    pub fn start_capture(&self, out: impl Write + 'static) -> io::Result<()> {
        let mut s = self.shared.borrow_mut();
        if s.w.capture.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a capture is already running on this fabric",
            ));
        }
        let bits_per_s = s.w.cfg.timing.link_bits_per_us.saturating_mul(1_000_000);
        let c = Capture::new(Box::new(out), s.nodes.len(), s.w.cfg.seed, bits_per_s)?;
        s.w.capture = Some(Box::new(c));
        Ok(())
    }

    /// Starts a packet capture into the file at `path` (created or truncated); see
    /// [`Fabric::start_capture`].
    pub fn capture_to_file(&self, path: impl AsRef<Path>) -> io::Result<()> {
        let f = std::fs::File::create(path)?;
        self.start_capture(io::BufWriter::with_capacity(1 << 20, f))
    }

    /// Ends the capture: writes the frames still held, flushes the output and returns what
    /// was written, or the first write error. `Ok` with zero counts if none was running.
    /// (Dropping the fabric also ends it, silently.)
    pub fn stop_capture(&self) -> io::Result<CaptureStats> {
        let c = self.shared.borrow_mut().w.capture.take();
        match c {
            Some(mut c) => c.finish(),
            None => Ok(CaptureStats::default()),
        }
    }

    /// Starts recording a timeline of the simulated pipeline (see [`crate::timeline`]): every
    /// stage of every message from now on, the first `max_events` of them (later ones are
    /// counted, not kept). Recording changes no simulated result. Fails if one already runs.
    pub fn start_timeline(&self, max_events: usize) -> io::Result<()> {
        let mut s = self.shared.borrow_mut();
        if s.w.timeline.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a timeline is already being recorded on this fabric",
            ));
        }
        let t = Timeline::new(
            s.nodes.len(),
            s.w.cfg.seed,
            s.w.cfg.timing.name.clone(),
            s.w.cfg.topology == Topology::BackToBack,
            max_events,
        );
        s.w.timeline = Some(Box::new(t));
        Ok(())
    }

    /// Whether a timeline is being recorded.
    pub fn timeline_running(&self) -> bool {
        self.shared.borrow().w.timeline.is_some()
    }

    /// Ends the timeline and returns what it recorded (`None` if none was running).
    pub fn take_timeline(&self) -> Option<Timeline> {
        self.shared.borrow_mut().w.timeline.take().map(|t| *t)
    }

    /// Ends the timeline and writes it to the file at `path` (created or truncated) as
    /// Trace Event Format JSON; see [`Timeline::write_json`]. `Ok` with zero counts and no
    /// file if none was running.
    pub fn write_timeline(&self, path: impl AsRef<Path>) -> io::Result<TimelineStats> {
        let Some(t) = self.take_timeline() else {
            return Ok(TimelineStats::default());
        };
        let f = std::fs::File::create(path)?;
        let mut w = io::BufWriter::with_capacity(1 << 20, f);
        let st = t.write_json(&mut w)?;
        w.flush()?;
        Ok(st)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_table_finds_every_node_and_nothing_else() {
        let nodes: Vec<[u8; 6]> = (0..1024)
            .map(|i| NicConfig::for_node(i as u32).mac)
            .collect();
        let t = MacTable::new(nodes.clone());
        for (i, m) in nodes.iter().enumerate() {
            assert_eq!(t.node(m), Some(i));
        }
        // Right last bytes, wrong prefix; a node number past the end; broadcast; zero.
        for m in [
            [0x04, 0, 0, 0, 0, 1],
            [0x02, 0, 0, 0, 4, 1],
            [0xff; 6],
            [0; 6],
        ] {
            assert_eq!(t.node(&m), None, "{m:x?}");
        }
        // Addresses of another form are found through the sorted list.
        let other = vec![
            [0x0a, 1, 2, 3, 4, 5],
            [0x02, 0, 0, 0, 0, 1],
            [0x0a, 0, 0, 0, 0, 0],
        ];
        let t = MacTable::new(other.clone());
        for (i, m) in other.iter().enumerate() {
            assert_eq!(t.node(m), Some(i));
        }
        assert_eq!(t.node(&[0x0a, 1, 2, 3, 4, 6]), None);
    }
}
