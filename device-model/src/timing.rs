//! The timing profile: every cost the model charges, named, with its default and source.
//!
//! Defaults are the ConnectX-6-like, 100 Gb/s, PCIe Gen4 x16 values proposed in the
//! performance anchors (`shared/reference/performance-anchors.md` §6.1). All values are in
//! picoseconds or bytes per microsecond so that no float decides anything.

/// A named set of stage costs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimingProfile {
    /// Profile name, printed by tools.
    pub name: &'static str,
    /// Host CPU cost to build one WQE (UCX wqe_post, 40 ns).
    pub host_post_wqe_ps: u64,
    /// Host CPU cost of a doorbell store (UCX db, 40 ns).
    pub host_doorbell_ps: u64,
    /// CPU store to the NIC seeing an MMIO write (200 ns, under half the PCIe read RTT).
    pub mmio_post_ps: u64,
    /// PCIe DMA read round trip for a small read: WQE fetch, RQ WQE fetch (400 ns).
    pub dma_read_rtt_ps: u64,
    /// Posted DMA write until visible to a polling host, including poll detection
    /// (200 ns + 70 ns).
    pub dma_write_visible_ps: u64,
    /// PCIe read bandwidth in bytes per microsecond (Gen4 x16: 26.4 GB/s).
    pub pcie_read_bytes_per_us: u64,
    /// PCIe write bandwidth in bytes per microsecond (Gen4 x16: 26.0 GB/s).
    pub pcie_write_bytes_per_us: u64,
    /// Doorbell/WQE in to first packet at the MAC (100 ns).
    pub nic_tx_wqe_ps: u64,
    /// Packet from the MAC to DMA issued, with QP/PSN/key checks (100 ns).
    pub nic_rx_pkt_ps: u64,
    /// Per-QP processing unit: one WQE per 50 ns (20 M/s).
    pub nic_per_qp_wqe_ps: u64,
    /// CQE written after the payload DMA (20 ns).
    pub nic_cqe_after_data_ps: u64,
    /// Responder READ handling beyond the payload DMA (250 ns, calibration knob).
    pub nic_read_resp_extra_ps: u64,
    /// Command execution time from CMD_DOORBELL to CMD_STATUS (2 µs).
    pub cmd_exec_ps: u64,
    /// Link data rate in bits per microsecond (100 Gb/s).
    pub link_bits_per_us: u64,
    /// MAC+PCS+FEC, TX side plus RX side, per hop (100 ns).
    pub link_phy_mac_ps: u64,
    /// Propagation over the cable: 5 ns/m x 2 m.
    pub link_prop_ps: u64,
    /// Preamble, start delimiter, FCS and inter-frame gap added to every frame (24 B).
    pub link_frame_overhead_bytes: u64,
    /// Switch cut-through latency (250 ns).
    pub switch_cut_through_ps: u64,
    /// Tag matching: fixed cost of a match decision (50 ns, no public figure).
    pub tm_match_fixed_ps: u64,
    /// Tag matching: cost per list entry compared (2 ns, the in-cache compare cost).
    pub tm_match_per_entry_ps: u64,
    /// Triggered operations: from the counter update that releases a data transfer to the
    /// transfer entering the send pipeline (50 ns; no public figure exists, see
    /// triggered-ops reference §4.5, so it is a calibration parameter).
    pub trig_dispatch_ps: u64,
}

impl Default for TimingProfile {
    fn default() -> Self {
        Self::cx6_100g()
    }
}

impl TimingProfile {
    /// The default ConnectX-6-like profile: 100 Gb/s link, PCIe Gen4 x16.
    pub fn cx6_100g() -> Self {
        TimingProfile {
            name: "cx6-100g",
            host_post_wqe_ps: 40_000,
            host_doorbell_ps: 40_000,
            mmio_post_ps: 200_000,
            dma_read_rtt_ps: 400_000,
            dma_write_visible_ps: 270_000,
            pcie_read_bytes_per_us: 26_400,
            pcie_write_bytes_per_us: 26_000,
            nic_tx_wqe_ps: 100_000,
            nic_rx_pkt_ps: 100_000,
            nic_per_qp_wqe_ps: 50_000,
            nic_cqe_after_data_ps: 20_000,
            nic_read_resp_extra_ps: 250_000,
            cmd_exec_ps: 2_000_000,
            link_bits_per_us: 100_000,
            link_phy_mac_ps: 100_000,
            link_prop_ps: 10_000,
            link_frame_overhead_bytes: 24,
            switch_cut_through_ps: 250_000,
            tm_match_fixed_ps: 50_000,
            tm_match_per_entry_ps: 2_000,
            trig_dispatch_ps: 50_000,
        }
    }

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
    }
}
