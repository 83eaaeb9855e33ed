//! Calibration: the default profile (`cx6-100g`, back to back, path MTU 4096) reproduces the
//! hardware anchors of performance-anchors.md within ±10 %: 8-byte WRITE and SEND one-way
//! latency 0.83-0.93 µs (ConnectX-4 SEND 0.83 µs [S11], mlx5 inline WRITE 0.93 µs [S10b]),
//! 8-byte READ round trip ~1.91 µs [S10b], and large-message bandwidth 97-99 Gb/s
//! ([S10c] 98.4, [S31] 97.5). All figures are simulated time, so the test is exact and
//! deterministic, not a timing test of this machine.

use ringbell::ConnectOptions;
use ringbell_emu::perf::{PerfOp, PerfPair};
use ringbell_emu::{FabricConfig, Topology};
use ringbell_model::TimingProfile;

fn pair(profile: TimingProfile) -> PerfPair {
    let mut cfg = FabricConfig::new(2, 1);
    cfg.topology = Topology::BackToBack;
    cfg.timing = profile;
    PerfPair::with(cfg, &ConnectOptions::default()).unwrap()
}

fn within(v: f64, lo: f64, hi: f64) -> bool {
    v >= lo * 0.9 && v <= hi * 1.1
}

#[test]
fn default_profile_meets_the_latency_and_bandwidth_anchors() {
    let mut p = pair(TimingProfile::default());
    let us = |p: &mut PerfPair, op| p.latency(op, 8, 50).unwrap().ps() as f64 / 1e6;
    let (w, s, r) = (
        us(&mut p, PerfOp::Write),
        us(&mut p, PerfOp::Send),
        us(&mut p, PerfOp::Read),
    );
    assert!(within(w, 0.83, 0.93), "8 B WRITE {w} µs");
    assert!(within(s, 0.83, 0.93), "8 B SEND {s} µs");
    assert!(within(r, 1.91, 1.91), "8 B READ {r} µs");
    // Within the window and in the order the hardware shows: a SEND also writes a CQE.
    assert!(s > w && r > 2.0 * w, "{w} {s} {r}");
    for size in [65536, 262144, 1 << 20] {
        for op in [PerfOp::Write, PerfOp::Send] {
            let gbps = p.bandwidth(op, size, 8 * (1 << 20) / size, 64).unwrap() / 1e9;
            assert!(within(gbps, 97.0, 99.0), "{op:?} {size} B: {gbps} Gb/s");
        }
    }
}

#[test]
fn the_400g_profile_has_four_times_the_bandwidth_and_the_same_small_latency() {
    let mut a = pair(TimingProfile::cx6_100g());
    let mut b = pair(TimingProfile::cx7_400g());
    let wa = a.latency(PerfOp::Write, 8, 20).unwrap();
    let wb = b.latency(PerfOp::Write, 8, 20).unwrap();
    // Small messages: latency is PCIe and NIC pipeline, barely the wire (the 400 G link's
    // heavier FEC costs about what its faster serialization saves).
    let (fa, fb) = (wa.ps() as f64, wb.ps() as f64);
    assert!((fb - fa).abs() < fa * 0.05, "{wa} vs {wb}");
    let gb = b.bandwidth(PerfOp::Write, 1 << 20, 16, 32).unwrap() / 1e9;
    // Four times the link rate, minus headers: 390-400 Gb/s of payload.
    assert!(
        (385.0..400.0).contains(&gb),
        "cx7-400g 1 MiB WRITE {gb} Gb/s"
    );
}
