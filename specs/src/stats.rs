//! Transport counters the device keeps per QP and per port, as returned by QUERY_QP_STATS and
//! QUERY_PORT_STATS: each a sequence of little-endian u64 in the order declared here.

macro_rules! counters {
    ($(#[$m:meta])* $name:ident { $( $(#[$fm:meta])* $f:ident, )* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name { $( $(#[$fm])* pub $f: u64, )* }

        impl $name {
            /// Field names in wire order.
            pub const NAMES: &'static [&'static str] = &[$(stringify!($f)),*];
            /// Encoded size in bytes.
            pub const SIZE: usize = Self::NAMES.len() * 8;

            /// The counters in wire order.
            pub fn values(&self) -> impl Iterator<Item = (&'static str, u64)> {
                [$((stringify!($f), self.$f)),*].into_iter()
            }

            /// Encodes into `out` (at least [`Self::SIZE`] bytes).
            pub fn encode(&self, out: &mut [u8]) {
                for (i, (_, v)) in self.values().enumerate() {
                    if let Some(dst) = out.get_mut(i * 8..i * 8 + 8) {
                        dst.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }

            /// Decodes from `b`; missing bytes read as zero.
            pub fn decode(b: &[u8]) -> Self {
                let mut it = b.chunks(8).map(|c| {
                    let mut w = [0u8; 8];
                    w[..c.len()].copy_from_slice(c);
                    u64::from_le_bytes(w)
                });
                $name { $( $f: it.next().unwrap_or(0), )* }
            }
        }
    };
}

counters!(
    /// Per-QP transport counters.
    QpStats {
        /// Request packets sent (first transmissions and retransmissions).
        packets_sent,
        /// Request packets sent again (go-back-N after a NAK, a timeout or an RNR NAK).
        retransmitted,
        /// Local ACK timeouts.
        timeouts,
        /// Sequence-error NAKs received.
        seq_naks_received,
        /// RNR NAKs received.
        rnr_naks_received,
        /// Other NAKs received (invalid request, remote access, remote operational).
        naks_received,
        /// Sequence-error NAKs sent.
        seq_naks_sent,
        /// RNR NAKs sent.
        rnr_naks_sent,
        /// Other NAKs sent.
        naks_sent,
        /// Duplicate requests received (re-acknowledged or replayed, never executed twice).
        duplicates_received,
        /// Out-of-sequence requests dropped.
        out_of_sequence,
        /// READs answered again from the responder resources.
        read_replays,
        /// Atomics answered again from the saved result.
        atomic_replays,
        /// UC packets the responder dropped (ABI 1.7): the rest of a message after a lost
        /// packet, a packet out of its message's order, no receive WQE, a bad R_Key, range or
        /// rights, or a SEND longer than its receive WQE. UC has no NAK: the sender is never
        /// told; a receive WQE the lost message was filling waits for the next one (or, from
        /// an SRQ, completes in error).
        uc_dropped,
    }
);
counters!(
    /// Per-QP datagram counters (ABI 1.5, QUERY_QP_UD_STATS). A UD receiver drops a datagram
    /// silently, and these say why; the sender is never told.
    UdStats {
        /// Datagrams sent (UD QPs).
        sent,
        /// Datagrams delivered to a receive WQE (UD QPs).
        received,
        /// Datagrams dropped because their Q_Key was not the QP's.
        qkey_dropped,
        /// Datagrams dropped because no receive WQE was posted.
        no_recv_dropped,
        /// Datagrams dropped because the receive WQE was too small (GRH area included).
        too_long_dropped,
        /// Packets of the other transport dropped: RC packets at a UD QP, UD packets at an RC
        /// QP.
        wrong_transport_dropped,
    }
);

counters!(
    /// Per-port (per-NIC) counters.
    PortStats {
        /// Frames put on the link.
        tx_frames,
        /// Frames received.
        rx_frames,
        /// Frames dropped because they did not parse.
        rx_malformed,
        /// Frames dropped because their ICRC was wrong.
        rx_icrc_errors,
        /// Frames dropped for addressing, QP or state reasons.
        rx_dropped,
        /// NAKs sent (sequence error, invalid request, remote access, remote operational).
        naks_sent,
        /// RNR NAKs sent.
        rnr_naks_sent,
        /// CQEs written.
        cqes,
        /// Events written to the EQ.
        eqes,
        /// Events lost because the EQ was full or disabled.
        eqes_lost,
        /// IOMMU faults.
        iommu_faults,
        /// Guest programming errors (bad register access, bad doorbell).
        guest_errors,
    }
);

const _: () = assert!(
    QpStats::SIZE <= crate::cmd::PARAMS_SIZE
        && PortStats::SIZE <= crate::cmd::PARAMS_SIZE
        && UdStats::SIZE <= crate::cmd::PARAMS_SIZE
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip() {
        let s = QpStats {
            retransmitted: 7,
            atomic_replays: u64::MAX,
            ..Default::default()
        };
        let mut b = [0u8; QpStats::SIZE];
        s.encode(&mut b);
        assert_eq!(QpStats::decode(&b), s);
        assert_eq!(&b[8..16], &7u64.to_le_bytes());
        assert_eq!(QpStats::NAMES[1], "retransmitted");
    }

    #[test]
    fn ud_stats_layout_and_round_trip() {
        assert_eq!(
            UdStats::NAMES,
            [
                "sent",
                "received",
                "qkey_dropped",
                "no_recv_dropped",
                "too_long_dropped",
                "wrong_transport_dropped",
            ]
        );
        assert_eq!(UdStats::SIZE, 48);
        let s = UdStats {
            sent: 1,
            received: 0x0102_0304_0506_0708,
            qkey_dropped: 3,
            no_recv_dropped: 4,
            too_long_dropped: 5,
            wrong_transport_dropped: u64::MAX,
        };
        let mut b = [0u8; UdStats::SIZE];
        s.encode(&mut b);
        assert_eq!(UdStats::decode(&b), s);
        assert_eq!(&b[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        for (i, (name, v)) in s.values().enumerate() {
            assert_eq!(name, UdStats::NAMES[i]);
            assert_eq!(b[i * 8..i * 8 + 8], v.to_le_bytes());
        }
        // The whole output area, as the mailbox returns it: the rest is zero and ignored.
        let mut area = [0u8; crate::cmd::PARAMS_SIZE];
        s.encode(&mut area);
        assert!(area[UdStats::SIZE..].iter().all(|&x| x == 0));
        assert_eq!(UdStats::decode(&area), s);
        // A short output (a device that wrote fewer counters) reads as zeros.
        assert_eq!(
            UdStats::decode(&b[..16]),
            UdStats {
                sent: 1,
                received: 0x0102_0304_0506_0708,
                ..Default::default()
            }
        );
    }
}
