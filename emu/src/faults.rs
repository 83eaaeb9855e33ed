//! Fault injection on the fabric: random faults per link drawn from the seed, link-down
//! intervals, and targeted rules for tests ("drop the 5th packet to QP 3", "drop the ACK
//! for PSN 100", "delay a READ response", "drop the 2nd datagram from QP 4 to QP 7").
//!
//! Every random decision draws from the link's own stream (derived from the fabric seed by a
//! pinned algorithm) with integer probabilities in parts per million, so a seed reproduces a
//! run exactly, faults included.

use rand_core::{RngCore, SeedableRng};
use rand_pcg::Pcg64Mcg;
use ringbell_specs::wire::{Opcode, BTH_LEN, ROCE_OUTER_LEN};
use ringbell_specs::SimTime;
use std::collections::BTreeMap;

/// One part per million: probabilities are integers in 0..=1_000_000.
pub const PPM: u32 = 1_000_000;

/// Random faults of one link (both directions of a node's cable).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkFaults {
    /// Probability (ppm) that a frame is lost.
    pub drop_ppm: u32,
    /// Probability (ppm) that a frame arrives twice.
    pub duplicate_ppm: u32,
    /// Probability (ppm) that a frame is held back, so later frames overtake it.
    pub reorder_ppm: u32,
    /// Longest extra delay of a held-back frame.
    pub reorder_delay: SimTime,
    /// Probability (ppm) that a bit of the frame flips (the receiver's ICRC check drops it).
    pub corrupt_ppm: u32,
    /// Intervals `[start, end)` during which the link is down and loses every frame.
    pub down: Vec<(SimTime, SimTime)>,
}

impl LinkFaults {
    /// Whether these faults can never touch a frame (every probability zero, no down time;
    /// the reorder delay alone does nothing).
    pub fn is_quiet(&self) -> bool {
        self.drop_ppm == 0
            && self.duplicate_ppm == 0
            && self.reorder_ppm == 0
            && self.corrupt_ppm == 0
            && self.down.is_empty()
    }

    /// Loss only, with probability `p` (0..=1).
    pub fn loss(p: f64) -> Self {
        LinkFaults {
            drop_ppm: ppm(p),
            ..Default::default()
        }
    }
}

/// Converts a probability to parts per million (clamped to 0..=1).
pub fn ppm(p: f64) -> u32 {
    (p.clamp(0.0, 1.0) * PPM as f64).round() as u32
}

/// The class of a frame, for matching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A request: SEND, WRITE, READ request, atomic (RC), and the UC SENDs and WRITEs.
    Request,
    /// An ACKNOWLEDGE (ACK, NAK or RNR NAK).
    Ack,
    /// A READ response packet.
    ReadResponse,
    /// An ATOMIC_ACKNOWLEDGE.
    AtomicAck,
    /// A UD datagram (ABI 1.5): UD SEND_ONLY or SEND_ONLY_WITH_IMMEDIATE. Nothing
    /// acknowledges or resends it: a datagram a rule drops is gone.
    Datagram,
}

/// Which frames a rule applies to; every field that is set must match.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FrameMatch {
    /// Sending node.
    pub from: Option<usize>,
    /// Receiving node.
    pub to: Option<usize>,
    /// Destination QPN in the BTH.
    pub qpn: Option<u32>,
    /// Source QPN in the DETH: only datagrams carry one, so a rule that sets it matches
    /// datagrams only. With `qpn` and `psn` (the sender's PSN), it names one datagram.
    pub src_qpn: Option<u32>,
    /// Kind of frame.
    pub kind: Option<FrameKind>,
    /// PSN in the BTH.
    pub psn: Option<u32>,
    /// BTH opcode.
    pub opcode: Option<u8>,
}

/// What a rule does to the frames it picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Lose the frame.
    Drop,
    /// Deliver it twice.
    Duplicate,
    /// Flip a bit (the ICRC check at the receiver drops it).
    Corrupt,
    /// Deliver it this much later.
    Delay(SimTime),
}

/// A targeted fault: acts on the `nth` matching frame (1 = the first) and the `times - 1`
/// matching frames after it (`times` 0: every one from the `nth` on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// Frames considered.
    pub when: FrameMatch,
    /// First matching frame acted on (1-based).
    pub nth: u64,
    /// How many matching frames are acted on (0: unlimited).
    pub times: u64,
    /// The fault.
    pub action: FaultAction,
}

impl FaultRule {
    /// Drops the `nth` frame matching `when`.
    pub fn drop_nth(when: FrameMatch, nth: u64) -> Self {
        FaultRule {
            when,
            nth,
            times: 1,
            action: FaultAction::Drop,
        }
    }
}

/// Every fault of a fabric.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Random faults of every link without an entry in `per_node`.
    pub links: LinkFaults,
    /// Random faults of particular nodes' links.
    pub per_node: BTreeMap<usize, LinkFaults>,
    /// Targeted rules, checked before the random faults.
    pub rules: Vec<FaultRule>,
}

impl FaultPlan {
    /// Whether the plan can never touch a frame: quiet links everywhere and no rule.
    pub fn injects_nothing(&self) -> bool {
        self.links.is_quiet()
            && self.per_node.values().all(LinkFaults::is_quiet)
            && self.rules.is_empty()
    }
}

/// What fault injection did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Frames lost at random.
    pub dropped: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
    /// Frames held back.
    pub delayed: u64,
    /// Frames with a flipped bit.
    pub corrupted: u64,
    /// Frames lost to a link that was down.
    pub link_down: u64,
    /// Frames acted on by targeted rules.
    pub rule_hits: u64,
}

/// The deliveries a frame turns into.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Extra delay of each copy delivered (none: the frame is lost).
    pub(crate) copies: Vec<SimTime>,
    /// Flip this bit of the frame (bit index from the start of the frame).
    pub(crate) flip: Option<usize>,
}

/// Fault state of a fabric: the plan, one random stream per link, rule counters.
#[derive(Debug)]
pub(crate) struct Faults {
    plan: FaultPlan,
    rngs: Vec<Pcg64Mcg>,
    seen: Vec<u64>,
    fired: Vec<u64>,
    /// The plan injects nothing (kept with the plan: asked twice per frame).
    quiet: bool,
    pub(crate) stats: FaultStats,
}

impl Faults {
    pub(crate) fn new(plan: FaultPlan, nodes: usize, seed: u64) -> Self {
        let rngs = (0..nodes)
            .map(|n| Pcg64Mcg::seed_from_u64(crate::fabric::stream_seed(seed, 0x1000 + n as u64)))
            .collect();
        let rules = plan.rules.len();
        Faults {
            rngs,
            seen: vec![0; rules],
            fired: vec![0; rules],
            quiet: plan.injects_nothing(),
            plan,
            stats: FaultStats::default(),
        }
    }

    pub(crate) fn set_plan(&mut self, plan: FaultPlan) {
        self.seen = vec![0; plan.rules.len()];
        self.fired = vec![0; plan.rules.len()];
        self.quiet = plan.injects_nothing();
        self.plan = plan;
    }

    pub(crate) fn add_rule(&mut self, rule: FaultRule) {
        self.plan.rules.push(rule);
        self.seen.push(0);
        self.fired.push(0);
        self.quiet = false;
    }

    fn link(&self, node: usize) -> &LinkFaults {
        self.plan.per_node.get(&node).unwrap_or(&self.plan.links)
    }

    /// Whether nothing can happen (the common case costs one check).
    pub(crate) fn inactive(&self) -> bool {
        self.quiet
    }

    /// Decides the fate of `frame` from `from` to `to`, leaving the NIC at `at`.
    pub(crate) fn decide(&mut self, from: usize, to: usize, at: SimTime, frame: &[u8]) -> Verdict {
        let one = Verdict {
            copies: vec![SimTime::ZERO],
            flip: None,
        };
        let down = |l: &LinkFaults| l.down.iter().any(|&(s, e)| s <= at && at < e);
        if down(self.link(from)) || down(self.link(to)) {
            self.stats.link_down += 1;
            return Verdict::default();
        }
        let hdr = Header::of(frame);
        for i in 0..self.plan.rules.len() {
            let r = &self.plan.rules[i];
            if !hdr.matches(&r.when, from, to) {
                continue;
            }
            self.seen[i] += 1;
            let active = self.seen[i] >= r.nth.max(1) && (r.times == 0 || self.fired[i] < r.times);
            if !active {
                continue;
            }
            self.fired[i] += 1;
            self.stats.rule_hits += 1;
            return match r.action {
                FaultAction::Drop => Verdict::default(),
                FaultAction::Duplicate => Verdict {
                    copies: vec![SimTime::ZERO, SimTime(1_000)],
                    flip: None,
                },
                FaultAction::Delay(d) => Verdict {
                    copies: vec![d],
                    flip: None,
                },
                FaultAction::Corrupt => Verdict {
                    copies: vec![SimTime::ZERO],
                    flip: Some(self.flip_bit(from, frame.len())),
                },
            };
        }
        let l = self.link(from).clone();
        if l == LinkFaults::default() {
            return one;
        }
        let rng = &mut self.rngs[from];
        let mut hit = |p: u32| p > 0 && rng.next_u32() % PPM < p;
        if hit(l.drop_ppm) {
            self.stats.dropped += 1;
            return Verdict::default();
        }
        let mut v = one;
        if hit(l.corrupt_ppm) {
            self.stats.corrupted += 1;
            v.flip = Some(self.flip_bit(from, frame.len()));
        }
        let rng = &mut self.rngs[from];
        if l.reorder_ppm > 0 && rng.next_u32() % PPM < l.reorder_ppm {
            self.stats.delayed += 1;
            let d = l.reorder_delay.ps().max(1);
            v.copies[0] = SimTime(rng.next_u64() % d);
        }
        let rng = &mut self.rngs[from];
        if l.duplicate_ppm > 0 && rng.next_u32() % PPM < l.duplicate_ppm {
            self.stats.duplicated += 1;
            v.copies.push(v.copies[0] + SimTime(1_000));
        }
        v
    }

    /// A bit behind the BTH (payload, extended headers or ICRC): covered by the ICRC and
    /// never one of the fields it masks.
    fn flip_bit(&mut self, from: usize, len: usize) -> usize {
        let start = (ROCE_OUTER_LEN + 12) * 8;
        let span = (len * 8).saturating_sub(start).max(1);
        start + (self.rngs[from].next_u64() % span as u64) as usize
    }
}

/// The fields a rule can match, read from a frame without a full parse.
struct Header {
    opcode: u8,
    qpn: u32,
    psn: u32,
    /// The DETH's source QPN, for a datagram.
    src_qpn: Option<u32>,
}

impl Header {
    fn of(f: &[u8]) -> Header {
        let b = |i: usize| f.get(ROCE_OUTER_LEN + i).copied().unwrap_or(0) as u32;
        let opcode = b(0) as u8;
        // DETH: Q_Key (4 bytes), a reserved byte, then the 24-bit source QP.
        let d = BTH_LEN;
        let src_qpn = Opcode::from_u8(opcode)
            .is_some_and(Opcode::has_deth)
            .then(|| b(d + 5) << 16 | b(d + 6) << 8 | b(d + 7));
        Header {
            opcode,
            qpn: b(5) << 16 | b(6) << 8 | b(7),
            psn: b(9) << 16 | b(10) << 8 | b(11),
            src_qpn,
        }
    }

    fn kind(&self) -> Option<FrameKind> {
        let op = Opcode::from_u8(self.opcode)?;
        Some(match op {
            o if o.is_ud() => FrameKind::Datagram,
            Opcode::Acknowledge => FrameKind::Ack,
            Opcode::AtomicAcknowledge => FrameKind::AtomicAck,
            o if o.is_response() => FrameKind::ReadResponse,
            _ => FrameKind::Request,
        })
    }

    fn matches(&self, m: &FrameMatch, from: usize, to: usize) -> bool {
        m.from.is_none_or(|x| x == from)
            && m.to.is_none_or(|x| x == to)
            && m.qpn.is_none_or(|x| x == self.qpn)
            && m.src_qpn.is_none_or(|x| Some(x) == self.src_qpn)
            && m.psn.is_none_or(|x| x == self.psn)
            && m.opcode.is_none_or(|x| x == self.opcode)
            && m.kind.is_none_or(|k| Some(k) == self.kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame just long enough for the headers a rule reads: BTH opcode, destination QP,
    /// PSN and, for a datagram, the DETH (Q_Key, source QP).
    fn frame(op: Opcode, qpn: u32, psn: u32, src_qpn: u32) -> Vec<u8> {
        let mut f = vec![0u8; ROCE_OUTER_LEN + BTH_LEN + 8 + 4];
        let b = &mut f[ROCE_OUTER_LEN..];
        b[0] = op.to_u8();
        b[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
        b[9..12].copy_from_slice(&psn.to_be_bytes()[1..]);
        if op.has_deth() {
            b[BTH_LEN..BTH_LEN + 4].copy_from_slice(&0x1111_2222u32.to_be_bytes());
            b[BTH_LEN + 5..BTH_LEN + 8].copy_from_slice(&src_qpn.to_be_bytes()[1..]);
        }
        f
    }

    #[test]
    fn every_opcode_has_a_kind_and_datagrams_are_their_own() {
        for op in Opcode::ALL {
            let h = Header::of(&frame(op, 7, 9, 4));
            let want = match op {
                Opcode::UdSendOnly | Opcode::UdSendOnlyImm => FrameKind::Datagram,
                Opcode::Acknowledge => FrameKind::Ack,
                Opcode::AtomicAcknowledge => FrameKind::AtomicAck,
                o if o.is_read_response() => FrameKind::ReadResponse,
                _ => FrameKind::Request,
            };
            assert_eq!(h.kind(), Some(want), "{op}");
            assert_eq!((h.qpn, h.psn), (7, 9), "{op}");
            assert_eq!(h.src_qpn, op.is_ud().then_some(4), "{op}");
        }
        // An unknown opcode has no kind: only rules without one match it.
        let mut f = frame(Opcode::SendOnly, 7, 9, 0);
        f[ROCE_OUTER_LEN] = 0x66;
        let h = Header::of(&f);
        assert_eq!(h.kind(), None);
        assert!(h.matches(&FrameMatch::default(), 0, 1));
        assert!(!h.matches(
            &FrameMatch {
                kind: Some(FrameKind::Datagram),
                ..Default::default()
            },
            0,
            1
        ));
    }

    #[test]
    fn a_rule_picks_one_datagram_by_source_destination_and_psn() {
        let rule = FaultRule::drop_nth(
            FrameMatch {
                kind: Some(FrameKind::Datagram),
                src_qpn: Some(4),
                qpn: Some(7),
                psn: Some(10),
                ..Default::default()
            },
            1,
        );
        let plan = FaultPlan {
            rules: vec![rule],
            ..Default::default()
        };
        let mut f = Faults::new(plan, 2, 1);
        let at = SimTime::ZERO;
        let mut lost = Vec::new();
        // Two senders, QP 4 and QP 5, both at PSN 9..=11 to QP 7; an RC SEND to QP 7 with
        // PSN 10 and a datagram to QP 8 too.
        let frames = [
            frame(Opcode::UdSendOnly, 7, 9, 5),
            frame(Opcode::UdSendOnly, 7, 10, 5),
            frame(Opcode::SendOnly, 7, 10, 4),
            frame(Opcode::UdSendOnly, 8, 10, 4),
            frame(Opcode::UdSendOnly, 7, 9, 4),
            frame(Opcode::UdSendOnlyImm, 7, 10, 4),
            frame(Opcode::UdSendOnly, 7, 10, 4),
            frame(Opcode::UdSendOnly, 7, 11, 4),
        ];
        for (i, fr) in frames.iter().enumerate() {
            if f.decide(0, 1, at, fr).copies.is_empty() {
                lost.push(i);
            }
        }
        assert_eq!(
            lost,
            vec![5],
            "only the first match, the one with immediate"
        );
        assert_eq!(f.stats.rule_hits, 1);
        // A rule for RC requests leaves datagrams alone, and one for datagrams RC traffic.
        let only = |kind| FaultPlan {
            rules: vec![FaultRule {
                when: FrameMatch {
                    kind: Some(kind),
                    ..Default::default()
                },
                nth: 1,
                times: 0,
                action: FaultAction::Drop,
            }],
            ..Default::default()
        };
        f.set_plan(only(FrameKind::Request));
        assert!(!f.decide(0, 1, at, &frames[0]).copies.is_empty());
        assert!(f.decide(0, 1, at, &frames[2]).copies.is_empty());
        f.set_plan(only(FrameKind::Datagram));
        assert!(f.decide(0, 1, at, &frames[0]).copies.is_empty());
        assert!(!f.decide(0, 1, at, &frames[2]).copies.is_empty());
    }
}
