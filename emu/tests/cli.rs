//! The `ringbell-emu` commands as a user runs them.

use std::process::{Command, Output};

#[test]
fn demo_prints_the_seed_first_then_latency_bandwidth_and_speed() {
    let text = run_ok(&["demo", "--seed", "3", "--iters", "3"]);
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
    let again = run(&["demo", "--seed", "3", "--iters", "3"]);
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
    let out = run(&["demo", "--iters", "lots"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value"));
}

/// Runs `ringbell-emu` with `args`.
fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ringbell-emu"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `ringbell-emu` with `args`, expects success and returns what it printed.
fn run_ok(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn bench(args: &[&str]) -> String {
    let all: Vec<&str> = ["bench"].iter().chain(args).copied().collect();
    run_ok(&all)
}

fn field(text: &str, line: &str, name: &str) -> u64 {
    let l = text
        .lines()
        .find(|l| l.starts_with(line))
        .unwrap_or_else(|| panic!("no {line} in {text}"));
    l.split(", ")
        .map(|p| p.trim_start_matches(&format!("{line}: ")))
        .find_map(|p| p.strip_prefix(&format!("{name} ")))
        .map_or(0, |v| v.parse().unwrap())
}

#[test]
fn bench_at_one_percent_loss_prints_goodput_and_retransmissions() {
    let args = [
        "--loss",
        "0.01",
        "--seed",
        "7",
        "--count",
        "300",
        "--timeout",
        "8",
    ];
    let text = bench(&args);
    assert_eq!(text.lines().next(), Some("seed 7"));
    assert!(text.contains("loss 1.000%"), "{text}");
    let goodput: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("goodput: "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(goodput > 1.0 && goodput < 100.0, "{goodput}");
    assert!(field(&text, "requester QP", "retransmitted") > 0, "{text}");
    assert!(field(&text, "responder QP", "seq_naks_sent") > 0, "{text}");
    let dropped: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("injected: "))
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(dropped > 0);
    // Same seed, same run; another seed, another run.
    let digest = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("trace digest"))
            .map(str::to_owned)
    };
    assert_eq!(digest(&text), digest(&bench(&args)));
    let other = bench(&[
        "--loss",
        "0.01",
        "--seed",
        "8",
        "--count",
        "300",
        "--timeout",
        "8",
    ]);
    assert_ne!(digest(&text), digest(&other));
}

#[test]
fn bench_reads_a_scenario_file() {
    let dir = std::env::temp_dir().join(format!("ringbell-scenario-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.toml");
    std::fs::write(
        &path,
        "seed = 11\n[faults]\ncorrupt = 0.01\n[[faults.rule]]\naction = \"drop\"\nkind = \"ack\"\nnth = 2\ntimes = 3\n",
    )
    .unwrap();
    let text = bench(&[
        "--scenario",
        path.to_str().unwrap(),
        "--count",
        "200",
        "--size",
        "4096",
        "--timeout",
        "8",
    ]);
    assert_eq!(text.lines().next(), Some("seed 11"));
    assert!(
        text.contains("corrupt 1.000%") && text.contains("1 rules"),
        "{text}"
    );
    assert!(text.contains("3 rule hits"), "{text}");
    assert!(field(&text, "port 1", "rx_icrc_errors") > 0, "{text}");
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[faults]\nloss = 2.0\n").unwrap();
    let out = run(&["bench", "--scenario", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a probability"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn coll_prints_a_latency_per_collective_and_rank_count_growing_with_the_tree() {
    let text = run_ok(&["coll", "--nodes", "2,16,64", "--iters", "1", "--root", "5"]);
    assert_eq!(text.lines().next(), Some("seed 1"));
    for op in ["barrier", "bcast", "allreduce"] {
        let lat: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with(op))
            .map(|l| l.split_whitespace().nth(3).unwrap().parse().unwrap())
            .collect();
        assert_eq!(lat.len(), 3, "{text}");
        // A binomial tree: deeper with more ranks, and never free.
        assert!(
            lat[0] > 1.0 && lat[0] < lat[1] && lat[1] < lat[2],
            "{op}: {lat:?}"
        );
    }
    // The root is taken modulo N: rank 5 of 16 and 64, rank 1 of 2.
    assert!(
        text.lines()
            .any(|l| l.starts_with("bcast") && l.contains(" 2     1 ")),
        "{text}"
    );
    let bad = run(&["coll", "--nodes", "1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("2..=1024"));
}

#[test]
fn bench_perftest_reports_latency_percentiles_bandwidth_and_speed() {
    let text = run_ok(&["bench", "--op", "perftest", "--count", "10"]);
    let rows = |op: &str| -> Vec<Vec<f64>> {
        text.lines()
            .filter(|l| l.split_whitespace().next() == Some(op))
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .map(|w| w.parse().unwrap())
                    .collect()
            })
            .collect()
    };
    for op in ["write", "send", "read"] {
        let r = rows(op);
        assert_eq!(r.len(), 16, "{op}: 2 B .. 64 KiB");
        for row in &r {
            // bytes, min <= median <= p99 <= p99.9, and min <= avg <= p99.9.
            assert!(
                row[1] <= row[2] && row[2] <= row[4] && row[4] <= row[5],
                "{row:?}"
            );
            assert!(row[1] <= row[3] && row[3] <= row[5], "{row:?}");
        }
        assert!(r[15][1] > r[0][1] + 5.0, "{op}: 64 KiB costs more than 2 B");
    }
    assert_eq!(rows("atomic").len(), 1);
    // Bandwidth rows: 8 QPs never below 1 QP, and large messages near line rate.
    let bw: Vec<Vec<f64>> = text
        .lines()
        .skip_while(|l| !l.contains("1 QP Gb/s"))
        .skip(1)
        .take(16)
        .map(|l| l.split_whitespace().map(|w| w.parse().unwrap()).collect())
        .collect();
    assert_eq!(bw.len(), 16);
    for row in &bw {
        assert!(row[3] >= row[1] * 0.99, "{row:?}");
    }
    assert!(bw[15][1] > 95.0 && bw[15][1] < 100.0, "{:?}", bw[15]);
    assert!(
        bw[0][4] > 5.0 * bw[0][2],
        "8 QPs lift the small-message rate: {:?}",
        bw[0]
    );
    assert!(text.contains("simulated µs per wall s"));
}

#[test]
fn profiles_print_and_load_from_files() {
    let out = run(&["profile", "cx7-400g"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("timing profile cx7-400g"), "{text}");
    assert!(text.contains("link_bits_per_us") && text.contains("400000"));
    let dir = std::env::temp_dir().join(format!("rb-prof-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("slow.toml");
    std::fs::write(&f, "name = \"slow-mmio\"\nmmio_post_ps = 1200000\n").unwrap();
    let run = |profile: &str| run(&["demo", "--iters", "2", "--profile", profile]);
    let slow = String::from_utf8(run(f.to_str().unwrap()).stdout).unwrap();
    assert!(slow.contains("timing profile slow-mmio"), "{slow}");
    let lat = |t: &str| -> f64 {
        let row = t
            .lines()
            .find(|l| l.trim_start().starts_with("8 "))
            .unwrap();
        row.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let base = String::from_utf8(run("cx6-100g").stdout).unwrap();
    // One microsecond more per MMIO store shows in the one-way WRITE latency.
    assert!(
        (lat(&slow) - lat(&base) - 1.0).abs() < 0.01,
        "{} vs {}",
        lat(&slow),
        lat(&base)
    );
    let bad = run("no-such-profile");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cx6-100g, cx7-400g"));
    std::fs::remove_dir_all(&dir).ok();
}

/// The frames a `bench` run delivered per wall second, from its emulation line.
fn frames_per_s(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("emulation:"))
        .expect("an emulation line");
    let at = line.find(" M frames/s").expect("frames per second");
    let num = line[..at].rsplit(' ').next().unwrap();
    num.parse().unwrap()
}

#[test]
fn bench_functional_skips_frames_unless_faults_need_them() {
    let args = ["--size", "64", "--count", "2000", "--depth", "64"];
    let timed = bench(&args);
    let functional = bench(&[&args[..], &["--functional"]].concat());
    for out in [&timed, &functional] {
        assert!(out.contains("goodput:"), "{out}");
    }
    assert!(frames_per_s(&timed) > 0.0, "{timed}");
    assert_eq!(frames_per_s(&functional), 0.0, "{functional}");
    // Wall time per message comes with the yardsticks of the same run, as a ratio.
    for out in [&timed, &functional] {
        let line = out
            .lines()
            .find(|l| l.starts_with("wall per message:"))
            .unwrap_or_else(|| panic!("no wall-per-message line: {out}"));
        let chases: f64 = line
            .split(" = ")
            .nth(1)
            .and_then(|c| c.strip_suffix(" chases")?.parse().ok())
            .unwrap_or_else(|| panic!("no chase ratio: {line}"));
        assert!(
            chases > 0.0 && line.contains("yardsticks: memcpy"),
            "{line}"
        );
        // And in runs of the cached loop, which agree with the loop's own figure.
        let num = |s: &str| -> f64 {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{s:?} in {line}"))
        };
        let ns = num(line["wall per message:".len()..]
            .split(" ns")
            .next()
            .unwrap());
        let loops = num(line
            .split(" = ")
            .nth(3)
            .and_then(|c| c.split(" loops").next())
            .unwrap());
        let loop_ns = num(line
            .split("loop ")
            .nth(1)
            .and_then(|c| c.split(" ns per 100 steps").next())
            .unwrap());
        assert!(
            loop_ns > 0.0 && (ns / loop_ns - loops).abs() <= 0.01 + loops * 0.01,
            "{line}"
        );
    }
    // A fault plan needs frames: functional mode steps aside and the run still completes.
    let lossy = bench(&[&args[..], &["--functional", "--loss", "0.01"]].concat());
    assert!(frames_per_s(&lossy) > 0.0, "{lossy}");
}
