//! Packet capture: every frame the fabric carries, written as pcapng.
//!
//! [`crate::Fabric::start_capture`] (or [`crate::Fabric::capture_to_file`], or the CLI's
//! `--capture FILE`) records each frame at its sender's egress, as the NIC put it on the wire:
//!
//! - **File layout.** One Section Header Block (little-endian, fixed options), then one
//!   Interface Description Block per node (`node0`, `node1`, ...: that node's egress port,
//!   link type Ethernet, `if_tsresol` 9) and a last one, `inject`, for frames handed to
//!   [`crate::Fabric::inject_frame`]; then one Enhanced Packet Block per frame, on the
//!   interface of the node that sent it, flagged outbound.
//! - **Timestamps** are simulated time in nanoseconds (truncated from the fabric's
//!   picoseconds), counted from the fabric's time zero (so Wireshark shows them as
//!   1970-01-01 plus simulated time): the instant the frame's first bit goes on the wire at
//!   the sender (the NIC's transmit time minus the frame's serialization time), never earlier
//!   than the simulated time the NIC handed the frame over. Frames are written in timestamp
//!   order (ties in the order they were sent), so timestamps never go backwards.
//! - **Faults.** A frame is recorded once, as sent, whatever fault injection then does to it:
//!   a lost frame is still in the file, with a comment saying it was dropped (or lost to a
//!   link that was down); a duplicated, held-back or corrupted frame carries a comment saying
//!   so (the bytes recorded are the ones sent, so the ICRC in the file is the sender's). A
//!   frame whose destination MAC is on no port is recorded with a comment saying it was not
//!   delivered.
//! - **Comments** (`opt_comment` of each EPB) name the sending and receiving node, the BTH
//!   opcode, the destination QP and PSN, and the source QP once the fabric knows it. The
//!   fabric learns it from the traffic: both directions of an RC connection carry the same
//!   UDP source port (WIRE.md section 7), so the first frame seen in the other direction
//!   gives the peer QP; frames sent before that (usually only a connection's first request)
//!   have no source QP. A UD datagram (ABI 1.5) carries its source QP in its DETH: its
//!   comment names that source QP and the Q_Key from the DETH, and the fabric learns no
//!   connection from it. Work-request ids are not on the wire and are never shown.
//! - **Determinism.** Nothing in the file comes from the wall clock or the host: the same
//!   seed and workload give a byte-identical file.
//!
//! The pcapng blocks are written by the `pcap-file` crate (version 2). That version always
//! encodes EPB timestamps in nanoseconds, which is why every interface declares
//! `if_tsresol` = 9.

use crate::faults::Verdict;
use pcap_file::pcapng::blocks::enhanced_packet::{EnhancedPacketBlock, EnhancedPacketOption};
use pcap_file::pcapng::blocks::interface_description::{
    InterfaceDescriptionBlock, InterfaceDescriptionOption,
};
use pcap_file::pcapng::blocks::section_header::{SectionHeaderBlock, SectionHeaderOption};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::{DataLink, Endianness};
use ringbell_specs::wire::{
    udp_src_port, Opcode, BTH_LEN, ETH_HDR_LEN, ROCEV2_UDP_PORT, ROCE_OUTER_LEN,
};
use ringbell_specs::{Qpn, SimTime};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{self, Write};
use std::time::Duration;

/// What a capture wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Enhanced Packet Blocks written: every frame recorded.
    pub frames: u64,
    /// Of those, frames that never reached a NIC (fault injection losses, unroutable).
    pub lost: u64,
    /// Bytes of frame data recorded.
    pub bytes: u64,
}

/// What happened to a frame after the sender put it on the wire, as far as the fabric knows
/// when it is recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Delivered once, on time.
    Delivered,
    /// Lost to fault injection (random loss or a rule).
    Dropped,
    /// Lost because a link was down.
    LinkDown,
    /// No port has the destination MAC.
    Unroutable,
    /// Delivered, with the listed changes made by fault injection.
    Faulted {
        /// Delivered twice.
        duplicated: bool,
        /// Held back by this much.
        delay: SimTime,
        /// This bit (from the start of the frame) flipped on the way.
        flipped: Option<usize>,
    },
}

impl Fate {
    /// The fate fault injection chose (`link_down`: the loss was a link that was down).
    pub(crate) fn of(v: &Verdict, link_down: bool) -> Fate {
        match v.copies.as_slice() {
            [] if link_down => Fate::LinkDown,
            [] => Fate::Dropped,
            [d] if *d == SimTime::ZERO && v.flip.is_none() => Fate::Delivered,
            copies => Fate::Faulted {
                duplicated: copies.len() > 1,
                delay: copies[0],
                flipped: v.flip,
            },
        }
    }
}

struct Pending {
    interface: u32,
    frame: Vec<u8>,
    comment: String,
}

/// An open capture: the pcapng writer plus the frames not yet written because a frame with
/// an earlier timestamp could still be sent.
pub(crate) struct Capture {
    writer: PcapNgWriter<Box<dyn Write>>,
    nodes: usize,
    /// Frames by (timestamp in ps, order recorded).
    pending: BTreeMap<(u64, u64), Pending>,
    seq: u64,
    /// (from node, to node, UDP source port) -> destination QPN seen on that path.
    peers: HashMap<(usize, usize, u16), u32>,
    error: Option<io::Error>,
    stats: CaptureStats,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("nodes", &self.nodes)
            .field("pending", &self.pending.len())
            .field("stats", &self.stats)
            .finish()
    }
}

fn pcap_err(e: pcap_file::PcapError) -> io::Error {
    match e {
        pcap_file::PcapError::IoError(e) => e,
        e => io::Error::other(e),
    }
}

impl Capture {
    /// Starts a capture of a fabric of `nodes` nodes: writes the section header and the
    /// interfaces at once.
    pub(crate) fn new(
        out: Box<dyn Write>,
        nodes: usize,
        seed: u64,
        link_bits_per_s: u64,
    ) -> io::Result<Capture> {
        let shb = SectionHeaderBlock {
            endianness: Endianness::Little,
            options: vec![
                SectionHeaderOption::UserApplication(Cow::Borrowed("ringbell-emu")),
                SectionHeaderOption::Comment(Cow::Owned(format!(
                    "ringbell simulated fabric, {nodes} nodes, seed {seed}; timestamps are \
                     simulated ns since the fabric's time zero, taken when a frame's first bit \
                     leaves its sender"
                ))),
            ],
            ..Default::default()
        };
        let mut writer = PcapNgWriter::with_section_header(out, shb).map_err(pcap_err)?;
        for i in 0..=nodes {
            let (name, description) = if i < nodes {
                (
                    format!("node{i}"),
                    format!("egress of node {i} (simulated)"),
                )
            } else {
                (
                    "inject".to_string(),
                    "frames injected by Fabric::inject_frame".to_string(),
                )
            };
            let mut options = vec![
                InterfaceDescriptionOption::IfName(Cow::Owned(name)),
                InterfaceDescriptionOption::IfDescription(Cow::Owned(description)),
                InterfaceDescriptionOption::IfTsResol(9),
            ];
            if link_bits_per_s > 0 {
                options.push(InterfaceDescriptionOption::IfSpeed(link_bits_per_s));
            }
            writer
                .write_pcapng_block(InterfaceDescriptionBlock {
                    linktype: DataLink::ETHERNET,
                    snaplen: 0,
                    options,
                })
                .map_err(pcap_err)?;
        }
        Ok(Capture {
            writer,
            nodes,
            pending: BTreeMap::new(),
            seq: 0,
            peers: HashMap::new(),
            error: None,
            stats: CaptureStats::default(),
        })
    }

    /// Records `frame`, sent by `from` (`None`: injected) towards `to` (`None`: unroutable),
    /// with its first bit on the wire at `at`.
    pub(crate) fn record(
        &mut self,
        from: Option<usize>,
        to: Option<usize>,
        at: SimTime,
        frame: &[u8],
        fate: Fate,
    ) {
        let comment = self.describe(from, to, frame, fate);
        if !matches!(fate, Fate::Delivered | Fate::Faulted { .. }) {
            self.stats.lost += 1;
        }
        let interface = from.unwrap_or(self.nodes) as u32;
        self.pending.insert(
            (at.ps(), self.seq),
            Pending {
                interface,
                frame: frame.to_vec(),
                comment,
            },
        );
        self.seq += 1;
    }

    /// Writes every frame stamped at or before `now`: no frame sent from now on can be
    /// stamped earlier.
    pub(crate) fn flush_until(&mut self, now: SimTime) {
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now.ps() {
                break;
            }
            let ((ps, _), p) = entry.remove_entry();
            self.write(ps, p);
        }
    }

    /// Writes every frame still held and flushes the output.
    pub(crate) fn finish(&mut self) -> io::Result<CaptureStats> {
        while let Some(((ps, _), p)) = self.pending.pop_first() {
            self.write(ps, p);
        }
        if self.error.is_none() {
            if let Err(e) = self.writer.get_mut().flush() {
                self.error = Some(e);
            }
        }
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(self.stats),
        }
    }

    fn write(&mut self, ps: u64, p: Pending) {
        if self.error.is_some() {
            return;
        }
        let len = p.frame.len();
        let epb = EnhancedPacketBlock {
            interface_id: p.interface,
            timestamp: Duration::from_nanos(ps / 1000),
            original_len: len as u32,
            data: Cow::Owned(p.frame),
            options: vec![
                EnhancedPacketOption::Comment(Cow::Owned(p.comment)),
                // epb_flags: direction outbound.
                EnhancedPacketOption::Flags(2),
            ],
        };
        match self.writer.write_pcapng_block(epb) {
            Ok(_) => {
                self.stats.frames += 1;
                self.stats.bytes += len as u64;
            }
            Err(e) => self.error = Some(pcap_err(e)),
        }
    }

    /// The comment of one frame; learns the QP pairing from it.
    fn describe(&mut self, from: Option<usize>, to: Option<usize>, f: &[u8], fate: Fate) -> String {
        let mut s = String::new();
        match from {
            Some(n) => {
                let _ = write!(s, "node {n}");
            }
            None => s.push_str("injected"),
        }
        match to {
            Some(n) => {
                let _ = write!(s, " -> node {n}: ");
            }
            None => s.push_str(" -> no node: "),
        }
        let b = |i: usize| f.get(i).copied().unwrap_or(0);
        let is_roce = f.len() >= ROCE_OUTER_LEN + 12
            && b(12) == 0x08
            && b(13) == 0x00
            && b(ETH_HDR_LEN + 9) == 17
            && u16::from_be_bytes([b(36), b(37)]) == ROCEV2_UDP_PORT;
        if is_roce {
            let bth = |i: usize| b(ROCE_OUTER_LEN + i) as u32;
            let opcode = bth(0) as u8;
            let dqpn = bth(5) << 16 | bth(6) << 8 | bth(7);
            let psn = bth(9) << 16 | bth(10) << 8 | bth(11);
            let sport = u16::from_be_bytes([b(34), b(35)]);
            let op = Opcode::from_u8(opcode);
            match op {
                Some(op) => s.push_str(op.name()),
                None => {
                    let _ = write!(s, "opcode 0x{opcode:02x}");
                }
            }
            let _ = write!(s, ", dest QP 0x{dqpn:06x}");
            if op.is_some_and(Opcode::has_deth) {
                // A datagram names its sender in its DETH: Q_Key, a reserved byte, source QP.
                let deth = |i: usize| b(ROCE_OUTER_LEN + BTH_LEN + i) as u32;
                let qkey = deth(0) << 24 | deth(1) << 16 | deth(2) << 8 | deth(3);
                let sqpn = deth(5) << 16 | deth(6) << 8 | deth(7);
                let _ = write!(s, ", src QP 0x{sqpn:06x}, Q_Key 0x{qkey:08x}");
            } else if let (Some(from), Some(to)) = (from, to) {
                self.peers.insert((from, to, sport), dqpn);
                if let Some(&sqpn) = self.peers.get(&(to, from, sport)) {
                    // Both ends of a connection use the port of their QP pair (WIRE.md 7).
                    if udp_src_port(Qpn::from_bits(sqpn), Qpn::from_bits(dqpn)) == sport {
                        let _ = write!(s, ", src QP 0x{sqpn:06x}");
                    }
                }
            }
            let _ = write!(s, ", PSN {psn}");
        } else {
            s.push_str("not a RoCEv2 frame");
        }
        match fate {
            Fate::Delivered => {}
            Fate::Dropped => s.push_str("; dropped by fault injection"),
            Fate::LinkDown => s.push_str("; lost by fault injection: link down"),
            Fate::Unroutable => s.push_str("; not delivered: no node has its destination MAC"),
            Fate::Faulted {
                duplicated,
                delay,
                flipped,
            } => {
                if delay > SimTime::ZERO {
                    let _ = write!(s, "; held back {delay} by fault injection");
                }
                if duplicated {
                    s.push_str("; duplicated by fault injection");
                }
                if let Some(bit) = flipped {
                    let _ = write!(
                        s,
                        "; bit {bit} flipped by fault injection after capture (the receiver \
                         drops it: bad ICRC)"
                    );
                }
            }
        }
        s
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        // A capture nobody stopped still ends as a complete file; errors have no one to go to.
        let _ = self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcap_file::pcapng::{Block, PcapNgReader};
    use std::cell::RefCell;
    use std::rc::Rc;

    #[derive(Clone, Default)]
    struct Shared(Rc<RefCell<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.borrow_mut().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn frames_are_written_in_timestamp_order_with_ns_resolution() {
        let out = Shared::default();
        let mut c = Capture::new(Box::new(out.clone()), 2, 7, 100_000_000_000).unwrap();
        c.record(Some(0), Some(1), SimTime(5_999), &[1; 60], Fate::Delivered);
        c.record(Some(1), Some(0), SimTime(2_000), &[2; 61], Fate::Dropped);
        c.flush_until(SimTime(3_000));
        c.record(Some(1), Some(0), SimTime(4_000), &[3; 62], Fate::Delivered);
        let st = c.finish().unwrap();
        assert_eq!(
            st,
            CaptureStats {
                frames: 3,
                lost: 1,
                bytes: 183
            }
        );
        drop(c);
        let bytes = out.0.borrow().clone();
        let mut r = PcapNgReader::new(&bytes[..]).unwrap();
        let mut got = Vec::new();
        while let Some(b) = r.next_block() {
            if let Block::EnhancedPacket(p) = b.unwrap() {
                got.push((p.interface_id, p.timestamp.as_nanos(), p.data[0]));
            }
        }
        assert_eq!(got, vec![(1, 2, 2), (1, 4, 3), (0, 5, 1)]);
        assert_eq!(r.interfaces().len(), 3);
        assert!(r.interfaces().iter().all(|i| i
            .options
            .contains(&InterfaceDescriptionOption::IfTsResol(9))));
    }

    #[test]
    fn a_datagram_is_described_with_its_deth_and_teaches_no_connection() {
        let mut c = Capture::new(Box::new(io::sink()), 2, 0, 0).unwrap();
        // Ethernet (IPv4), IPv4 (UDP), UDP to 4791, then BTH and DETH.
        let mut f = vec![0u8; ROCE_OUTER_LEN + BTH_LEN + 8 + 4];
        f[12] = 0x08;
        f[ETH_HDR_LEN + 9] = 17;
        f[36..38].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
        let sport = udp_src_port(Qpn::from_bits(0x12), Qpn::from_bits(0x34));
        f[34..36].copy_from_slice(&sport.to_be_bytes());
        let bth = ROCE_OUTER_LEN;
        f[bth] = Opcode::UdSendOnlyImm.to_u8();
        f[bth + 7] = 0x34;
        f[bth + 11] = 9;
        f[bth + 12..bth + 16].copy_from_slice(&0x8000_0042u32.to_be_bytes());
        f[bth + 19] = 0x12;
        let d = c.describe(Some(0), Some(1), &f, Fate::Delivered);
        assert_eq!(
            d,
            "node 0 -> node 1: UD_SEND_ONLY_WITH_IMMEDIATE, dest QP 0x000034, src QP 0x000012, \
             Q_Key 0x80000042, PSN 9"
        );
        assert!(c.peers.is_empty(), "no connection learnt from a datagram");
    }

    #[test]
    fn non_roce_frames_are_described_as_such() {
        let mut c = Capture::new(Box::new(io::sink()), 1, 0, 0).unwrap();
        let d = c.describe(None, Some(0), &[0; 10], Fate::Delivered);
        assert_eq!(d, "injected -> node 0: not a RoCEv2 frame");
    }
}
