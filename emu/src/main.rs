//! `ringbell-emu`: runs workloads through the real driver on emulated NICs.

use clap::{Parser, Subcommand, ValueEnum};
use ringbell_emu::perf::{PerfOp, PerfPair};
use ringbell_emu::Topology;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "ringbell-emu",
    version,
    about = "Emulated ringbell NICs on a simulated fabric"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Wiring {
    /// One cable between the two nodes (the perftest set-up).
    B2b,
    /// Both nodes on a switch.
    Switch,
}

#[derive(Subcommand)]
enum Cmd {
    /// Two nodes through the real driver: latency (WRITE, SEND, READ; 8 B..64 KiB) and
    /// bandwidth, in simulated time, plus the wall-clock emulation speed.
    Demo {
        /// Root seed of the run (initial PSNs and every other random choice).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Latency iterations per size.
        #[arg(long, default_value_t = 200)]
        iters: u32,
        /// How the two nodes are wired.
        #[arg(long, value_enum, default_value_t = Wiring::B2b)]
        wiring: Wiring,
    },
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Demo {
            seed,
            iters,
            wiring,
        } => {
            if let Err(e) = demo(seed, iters, wiring) {
                eprintln!("ringbell-emu: {e}");
                std::process::exit(1);
            }
        }
    }
}

fn demo(seed: u64, iters: u32, wiring: Wiring) -> Result<(), ringbell::Error> {
    println!("seed {seed}");
    let topology = match wiring {
        Wiring::B2b => Topology::BackToBack,
        Wiring::Switch => Topology::Switch,
    };
    let wall = Instant::now();
    let mut p = PerfPair::new(seed, topology)?;
    let prof = p.fabric().timing();
    println!(
        "two nodes, {} wiring, timing profile {}, path MTU 4096, inline up to 220 B",
        if topology == Topology::BackToBack {
            "back-to-back"
        } else {
            "switched"
        },
        prof.name
    );
    println!();
    println!("latency (simulated µs; WRITE/SEND one-way by ping-pong, READ round trip), {iters} iterations");
    println!(
        "{:>9} {:>10} {:>10} {:>10}",
        "bytes", "write", "send", "read"
    );
    let mut messages = 0u64;
    let mut size = 8u32;
    while size <= 65536 {
        let mut row = format!("{size:>9}");
        for op in [PerfOp::Write, PerfOp::Send, PerfOp::Read] {
            let t = p.latency(op, size, iters)?;
            messages += iters as u64 * if op == PerfOp::Read { 1 } else { 2 };
            row += &format!(" {:>10.3}", t.as_us_f64());
        }
        println!("{row}");
        size *= 2;
    }
    println!();
    println!("bandwidth (simulated Gb/s, one QP, 128 outstanding, every 16th signaled)");
    println!(
        "{:>9} {:>10} {:>10} {:>9}",
        "bytes", "write", "send", "messages"
    );
    let mut size = 64u32;
    while size <= 1 << 20 {
        let count = ((256u64 << 20) / size as u64).clamp(256, 20_000) as u32;
        let w = p.bandwidth(PerfOp::Write, size, count, 128)?;
        let s = p.bandwidth(PerfOp::Send, size, count, 128)?;
        messages += 2 * count as u64;
        println!("{size:>9} {:>10.2} {:>10.2} {count:>9}", w / 1e9, s / 1e9);
        size *= 4;
    }
    let el = wall.elapsed().as_secs_f64();
    let sim = p.fabric().now();
    let st = p.fabric().stats();
    println!();
    println!(
        "emulation: {:.3} simulated ms in {:.2} wall s = {:.0} simulated µs per wall s; {:.2} M events/s, {:.2} M messages/s, {:.2} M frames/s",
        sim.as_us_f64() / 1e3,
        el,
        sim.as_us_f64() / el,
        st.events as f64 / el / 1e6,
        messages as f64 / el / 1e6,
        st.frames_delivered as f64 / el / 1e6
    );
    println!("trace digest {:016x}", p.fabric().trace_digest());
    Ok(())
}
