//! The timing profile: every cost the model charges, named, with its value in each built-in
//! profile and the source it comes from.
//!
//! The stages of a message, in order: the host builds the WQE (`host_post_wqe_ps`) and
//! stores the doorbell (`host_doorbell_ps`), the store crosses PCIe (`mmio_post_ps`; a
//! BlueFlame store carries the WQE with it), the NIC fetches the WQE (`dma_read_rtt_ps`,
//! skipped for BlueFlame) and the payload (`dma_read_rtt_ps` again plus
//! `pcie_read_bytes_per_us`), prepares the packet (`nic_tx_wqe_ps`), serializes it
//! (`link_bits_per_us`, `link_frame_overhead_bytes`), the bits cross the PHY/MAC and the cable
//! (`link_phy_mac_ps`, `link_prop_ps`) and a switch if there is one (`switch_cut_through_ps`),
//! the receiving NIC checks the packet (`nic_rx_pkt_ps`) and writes the payload
//! (`pcie_write_bytes_per_us`), which becomes visible to a polling host after
//! `dma_write_visible_ps`, then the CQE (`nic_cqe_after_data_ps`). A READ's responder adds
//! its payload fetch and `nic_read_resp_extra_ps`.
//!
//! Contention is modelled on shared resources that are busy while used: the egress link
//! (serialization), the PCIe read and write paths (bandwidth), each QP's processing unit
//! (`nic_per_qp_wqe_ps`), the whole NIC's message rate (`nic_msg_ps`), and the READ/atomic
//! credits of `max_rd_atomic`.
//!
//! Values are integer picoseconds (or bytes per microsecond, bits per microsecond) so that
//! no float decides anything. Labels in the docs follow the performance anchors
//! (`shared/reference/performance-anchors.md`): M measured, V vendor figure, D derived from a
//! model, Mod a vendor cost model (UCX), A assumed to close a latency budget; the bracketed
//! codes are that document's sources.

macro_rules! profile {
    ($( $(#[doc = $doc:literal])* $field:ident = $cx6:expr, $cx7:expr; )*) => {
        /// A named set of stage costs.
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct TimingProfile {
            /// Profile name, printed by tools.
            pub name: String,
            $( $(#[doc = $doc])* pub $field: u64, )*
        }

        impl TimingProfile {
            /// The default ConnectX-6-like profile: 100 Gb/s link, PCIe Gen4 x16.
            pub fn cx6_100g() -> Self {
                TimingProfile { name: "cx6-100g".into(), $( $field: $cx6, )* }
            }

            /// A ConnectX-7-like profile: 400 Gb/s link, PCIe Gen5 x16.
            pub fn cx7_400g() -> Self {
                TimingProfile { name: "cx7-400g".into(), $( $field: $cx7, )* }
            }

            /// Every parameter's name, in declaration order.
            pub const FIELDS: &'static [&'static str] = &[ $( stringify!($field), )* ];

            /// The value of parameter `field`.
            pub fn get(&self, field: &str) -> Option<u64> {
                match field {
                    $( stringify!($field) => Some(self.$field), )*
                    _ => None,
                }
            }

            /// Sets parameter `field`; false when there is no such parameter.
            pub fn set(&mut self, field: &str, value: u64) -> bool {
                match field {
                    $( stringify!($field) => { self.$field = value; true } )*
                    _ => false,
                }
            }

            /// The documentation of parameter `field` (what it is, its source).
            pub fn doc(field: &str) -> Option<&'static str> {
                match field {
                    $( stringify!($field) => Some(concat!($( $doc, )*)), )*
                    _ => None,
                }
            }
        }
    };
}

profile! {
    /// Host CPU cost to build one WQE: 40 ns (Mod: UCX wqe_post [S6]). Charged to a BlueFlame
    /// store, which is where the WQE is copied.
    host_post_wqe_ps = 40_000, 40_000;
    /// Host CPU cost of a doorbell store: 40 ns (Mod: UCX db [S6]).
    host_doorbell_ps = 40_000, 40_000;
    /// CPU store to the NIC seeing the MMIO write: 200 ns (D/A: under half the 480-550 ns
    /// PCIe read round trip [S3]).
    mmio_post_ps = 200_000, 200_000;
    /// PCIe DMA read round trip of a small read (WQE fetch, receive WQE, first payload
    /// bytes): 400 ns (M/Mod: inline-vs-not delta 390 ns [S10b], UCX wqe_fetch 350 ns [S6]).
    dma_read_rtt_ps = 400_000, 400_000;
    /// Posted DMA write until a polling host sees it: 200 ns plus 70 ns poll detection
    /// (D/A [S3]; M: the 70 ns LLC effect [S3], core-to-core 130-175 ns [S33]).
    dma_write_visible_ps = 270_000, 270_000;
    /// PCIe read bandwidth, bytes per µs: Gen4 x16 26.4 GB/s; Gen5 x16 twice that (D: pcie
    /// model [S4]).
    pcie_read_bytes_per_us = 26_400, 52_800;
    /// PCIe write bandwidth, bytes per µs: Gen4 x16 26.0 GB/s; Gen5 x16 twice that (D [S4]).
    pcie_write_bytes_per_us = 26_000, 52_000;
    /// Doorbell or WQE in to the first packet at the MAC: 100 ns (A: closes the budget of
    /// anchors §6.2).
    nic_tx_wqe_ps = 100_000, 100_000;
    /// Packet from the MAC to its DMA issued, with QP, PSN and key checks: 100 ns (A).
    nic_rx_pkt_ps = 100_000, 100_000;
    /// Per-QP processing unit, one WQE per: 50 ns = 20 M/s (A: Connect-IB ~8 M/s per QP
    /// [S1], scaled); 30 ns on the newer part (A).
    nic_per_qp_wqe_ps = 50_000, 30_000;
    /// Whole-NIC message rate, one message per: 4.65 ns = 215 M/s (V: ConnectX-6 [S7]);
    /// 2.86 ns = 350 M/s (V: ConnectX-7 330-370 M/s [S9]).
    nic_msg_ps = 4_651, 2_857;
    /// CQE written after the payload DMA: 20 ns (A; ordering of CQE behind data).
    nic_cqe_after_data_ps = 20_000, 20_000;
    /// Responder READ handling beyond the payload fetch (context lookup, response build,
    /// requester ordering): 390 ns (A: the calibration knob of anchors §6.2, set so an 8 B
    /// READ takes 1.9 µs, against 1.91 µs measured [S10b]).
    nic_read_resp_extra_ps = 390_000, 390_000;
    /// Command execution from CMD_DOORBELL to CMD_STATUS: 2 µs (A; firmware commands are
    /// slow, and nothing on the data path waits for them).
    cmd_exec_ps = 2_000_000, 2_000_000;
    /// RESIZE_CQ from CMD_DOORBELL to CMD_STATUS, the ring switched at its end: 20 µs (A; the
    /// firmware moves a ring, and the kernel call around it takes longer still, so work
    /// posted just before a resize has completed into the old ring when it switches).
    cmd_resize_cq_ps = 20_000_000, 20_000_000;
    /// Link data rate in bits per µs: 100 Gb/s; 400 Gb/s (V).
    link_bits_per_us = 100_000, 400_000;
    /// MAC, PCS and FEC on both ends of a hop: 100 ns (A; FEC-dependent); 120 ns for the
    /// PAM4 400 G link with its heavier FEC (A).
    link_phy_mac_ps = 100_000, 120_000;
    /// Cable propagation: 2 m at 5 ns/m (physics).
    link_prop_ps = 10_000, 10_000;
    /// Preamble, start delimiter, FCS and inter-frame gap added to every frame: 24 bytes
    /// (Ethernet).
    link_frame_overhead_bytes = 24, 24;
    /// Switch cut-through latency: 250 ns (M: ~270 ns one way [S12]).
    switch_cut_through_ps = 250_000, 250_000;
    /// Tag matching: fixed cost of a match decision: 50 ns (A; no public figure).
    tm_match_fixed_ps = 50_000, 50_000;
    /// Tag matching: cost per list entry compared: 2 ns (L: in-cache compare [S33]).
    tm_match_per_entry_ps = 2_000, 2_000;
    /// Triggered operations: from the counter update that releases a data transfer to the
    /// transfer entering the send pipeline: 50 ns (A; no public figure exists, triggered-ops
    /// reference §4.5).
    trig_dispatch_ps = 50_000, 50_000;
}

impl Default for TimingProfile {
    fn default() -> Self {
        Self::cx6_100g()
    }
}

impl TimingProfile {
    /// The built-in profile called `name`.
    pub fn builtin(name: &str) -> Option<TimingProfile> {
        match name {
            "cx6-100g" => Some(Self::cx6_100g()),
            "cx7-400g" => Some(Self::cx7_400g()),
            _ => None,
        }
    }

    /// Names of the built-in profiles.
    pub const BUILTIN: &'static [&'static str] = &["cx6-100g", "cx7-400g"];

    /// Time to serialize a frame of `bytes` (without FCS) on the link.
    pub fn serialize_ps(&self, bytes: usize) -> u64 {
        let bits = (bytes as u64 + self.link_frame_overhead_bytes) * 8;
        (bits * 1_000_000).div_ceil(self.link_bits_per_us.max(1))
    }

    /// Time to move `bytes` across PCIe towards the NIC (DMA read).
    pub fn pcie_read_ps(&self, bytes: usize) -> u64 {
        (bytes as u64 * 1_000_000).div_ceil(self.pcie_read_bytes_per_us.max(1))
    }

    /// Time to move `bytes` across PCIe towards the host (DMA write).
    pub fn pcie_write_ps(&self, bytes: usize) -> u64 {
        (bytes as u64 * 1_000_000).div_ceil(self.pcie_write_bytes_per_us.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialization_of_a_full_mtu_frame_is_about_335_ns() {
        let p = TimingProfile::default();
        // 4096 payload + 58 bytes of headers/ICRC + 24 overhead = 4178 bytes = 334.24 ns.
        assert_eq!(p.serialize_ps(4096 + 58), 334_240);
        assert_eq!(p.pcie_read_ps(4096), 155_152);
        // Four times faster on the 400 G link.
        assert_eq!(TimingProfile::cx7_400g().serialize_ps(4096 + 58), 83_560);
    }

    #[test]
    fn every_parameter_is_named_documented_and_settable() {
        let mut p = TimingProfile::cx7_400g();
        for f in TimingProfile::FIELDS {
            let doc = TimingProfile::doc(f).unwrap();
            assert!(doc.len() > 20, "{f} is undocumented");
            let v = p.get(f).unwrap();
            assert!(p.set(f, v + 1));
            assert_eq!(p.get(f), Some(v + 1));
        }
        assert!(!p.set("no_such_stage_ps", 1));
        assert_eq!(p.get("no_such_stage_ps"), None);
        for name in TimingProfile::BUILTIN {
            assert_eq!(TimingProfile::builtin(name).unwrap().name, *name);
        }
    }
}
