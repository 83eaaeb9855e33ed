//! The `ringbell-emu demo` command as a user runs it.

use std::process::Command;

#[test]
fn demo_prints_the_seed_first_then_latency_bandwidth_and_speed() {
    let out = Command::new(env!("CARGO_BIN_EXE_ringbell-emu"))
        .args(["demo", "--seed", "3", "--iters", "3"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "seed 3");
    // One latency row per size from 8 B to 64 KiB, each with three positive figures.
    let rows: Vec<&str> = lines
        .iter()
        .copied()
        .skip_while(|l| !l.contains("write       send       read"))
        .skip(1)
        .take(14)
        .collect();
    assert_eq!(rows.len(), 14);
    for (i, row) in rows.iter().enumerate() {
        let f: Vec<f64> = row.split_whitespace().map(|w| w.parse().unwrap()).collect();
        assert_eq!(f[0] as u64, 8 << i);
        assert!(f[1..].iter().all(|v| *v > 0.1 && *v < 100.0), "{row}");
    }
    assert!(text.contains("bandwidth (simulated Gb/s"));
    assert!(text.contains("simulated µs per wall s"));
    assert!(text.contains("trace digest"));
    // Same seed, same digest.
    let again = Command::new(env!("CARGO_BIN_EXE_ringbell-emu"))
        .args(["demo", "--seed", "3", "--iters", "3"])
        .output()
        .unwrap();
    let digest = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("trace digest"))
            .map(str::to_owned)
    };
    assert_eq!(
        digest(&text),
        digest(&String::from_utf8(again.stdout).unwrap())
    );
}

#[test]
fn bad_arguments_are_refused_with_usage() {
    let out = Command::new(env!("CARGO_BIN_EXE_ringbell-emu"))
        .args(["demo", "--iters", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value"));
}
