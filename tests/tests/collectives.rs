//! Offloaded collectives built only from triggered operations, on 2..64 emulated NICs:
//! every result checked against the host, every counter ending exactly at its threshold
//! with nothing left pending, also over lossy links.

use ringbell::ConnectOptions;
use ringbell_emu::coll::{run_checked, CollGroup, CollOp};
use ringbell_emu::{FabricConfig, LinkFaults};

fn group(n: usize, root: usize, seed: u64, loss: f64) -> CollGroup {
    let mut cfg = FabricConfig::new(n, seed);
    cfg.faults.links = LinkFaults::loss(loss);
    // A short ACK timeout (262 µs) keeps lossy runs short in simulated time.
    let opts = ConnectOptions {
        timeout: if loss > 0.0 { 6 } else { 14 },
        ..Default::default()
    };
    CollGroup::new(cfg, root, 4096, &opts).expect("group")
}

fn check(g: &CollGroup, op: CollOp, iters: u32) -> u64 {
    let runs =
        run_checked(g, op, iters).unwrap_or_else(|e| panic!("{op:?} on {} ranks: {e}", g.size()));
    assert_eq!(runs.len(), iters as usize);
    runs.iter().map(|o| o.latency_ps).max().unwrap()
}

#[test]
fn barrier_broadcast_and_allreduce_for_every_n_from_2_to_64() {
    for n in 2..=64 {
        let g = group(n, 0, n as u64, 0.0);
        check(&g, CollOp::Barrier, 2);
        check(&g, CollOp::Allreduce { elems: 3 }, 2);
        check(
            &g,
            CollOp::Broadcast {
                root: 0,
                bytes: 1000,
            },
            1,
        );
        // Counters keep counting across collectives: the second run's thresholds sit on
        // top of the first's, and the group can switch collectives freely.
        check(&g, CollOp::Barrier, 1);
    }
}

#[test]
fn broadcast_from_any_root() {
    for n in [2usize, 3, 5, 8, 13, 31, 64] {
        let roots: Vec<usize> = if n <= 8 {
            (0..n).collect()
        } else {
            vec![1, n / 2, n - 1]
        };
        for root in roots {
            let g = group(n, root, 7 + root as u64, 0.0);
            // Small (all children at once) and large (one child after the other).
            check(&g, CollOp::Broadcast { root, bytes: 8 }, 1);
            check(&g, CollOp::Broadcast { root, bytes: 4096 }, 1);
        }
        let g = CollGroup::new(
            FabricConfig::new(n, 3),
            n - 1,
            64 * 1024,
            &Default::default(),
        )
        .unwrap();
        check(
            &g,
            CollOp::Broadcast {
                root: n - 1,
                bytes: 64 * 1024,
            },
            1,
        );
    }
}

#[test]
fn collectives_survive_seeded_packet_loss() {
    let mut slowest = 0;
    for (i, n) in [2usize, 3, 6, 16, 33, 64].into_iter().enumerate() {
        let g = group(n, n / 3, 100 + i as u64, 0.02);
        check(&g, CollOp::Barrier, 2);
        check(
            &g,
            CollOp::Broadcast {
                root: n / 3,
                bytes: 4096,
            },
            2,
        );
        slowest = slowest.max(check(&g, CollOp::Allreduce { elems: 4 }, 2));
    }
    // Some frame was lost somewhere: at least one run waited for an ACK timeout.
    assert!(
        slowest > 262_000_000,
        "no retransmission was needed: {slowest} ps"
    );
}

#[test]
fn the_same_seed_gives_the_same_latency() {
    let a = check(&group(24, 0, 5, 0.01), CollOp::Allreduce { elems: 2 }, 1);
    let b = check(&group(24, 0, 5, 0.01), CollOp::Allreduce { elems: 2 }, 1);
    assert_eq!(a, b);
}

#[test]
fn a_collective_for_another_root_is_refused() {
    let g = group(4, 0, 1, 0.0);
    let e = run_checked(&g, CollOp::Broadcast { root: 2, bytes: 8 }, 1).unwrap_err();
    assert!(e.contains("wired for root 0"), "{e}");
}
