//! `ringbell-emu`: runs workloads through the real driver on emulated NICs.

use clap::{Args, Parser, Subcommand, ValueEnum};
use ringbell::ConnectOptions;
use ringbell_emu::faults::{ppm, LinkFaults, PPM};
use ringbell_emu::perf::{PerfOp, PerfPair};
use ringbell_emu::yardstick::Yardstick;
use ringbell_emu::{FabricConfig, Scenario, Topology};
use std::time::{Duration, Instant};

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

#[derive(Clone, Copy, ValueEnum)]
enum BenchOp {
    /// RDMA WRITE.
    Write,
    /// SEND/RECV.
    Send,
    /// RDMA READ.
    Read,
    /// Tag matching through the software layer over a TM-SRQ: matching latency and rate
    /// against posted-list depth (hardware list and software), rendezvous bandwidth
    /// 8 KiB..4 MiB. Uses --count (capped at 2000) messages per figure; ignores --size.
    Tag,
    /// The perftest-equivalent report on two back-to-back nodes: latency (min, median,
    /// average, p99, p99.9) of WRITE, SEND, READ and atomics from 2 B to 64 KiB, then
    /// bandwidth and message rate against size with 1 and 8 QPs, then the emulation speed.
    /// Uses --count latency iterations per size (WRITE/SEND give two samples each).
    Perftest,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CollKind {
    /// Barrier, binomial tree from rank 0.
    Barrier,
    /// Broadcast of --bytes from --root along the binomial tree.
    Bcast,
    /// Allreduce (sum) of --elems u64 values: NIC atomics up the tree, WRITEs down.
    Allreduce,
    /// All three.
    All,
}

#[derive(Clone, Copy, ValueEnum)]
enum PeerRole {
    /// Sends.
    Initiator,
    /// Receives and checks.
    Target,
}

#[derive(Clone, Copy, ValueEnum)]
enum PeerMode {
    /// RDMA WRITE then SEND with immediate, answered by a SEND.
    Rc,
    /// Tagged messages through the TM-SRQ, eager and rendezvous.
    Tag,
}

#[derive(Subcommand)]
enum Cmd {
    /// Offloaded collectives built only from triggered operations on N emulated NICs:
    /// simulated latency per N, each result checked.
    Coll(CollArgs),
    /// N NICs in one process with RC traffic in a ring or all-to-all: wall time per
    /// message and per fabric event beside this run's yardsticks, RSS per node, file
    /// descriptors and mappings (a benchmark, not a test).
    Scale(ScaleArgs),
    /// A bandwidth run on two nodes, optionally over a lossy fabric: goodput, retransmissions
    /// and every transport counter.
    Bench {
        /// Root seed (faults included); a scenario file's seed wins when it sets one.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Probability that a frame is lost on a link (0..1).
        #[arg(long, default_value_t = 0.0)]
        loss: f64,
        /// Probability that a frame arrives twice.
        #[arg(long, default_value_t = 0.0)]
        duplicate: f64,
        /// Probability that a frame is held back up to 2 µs (reordering).
        #[arg(long, default_value_t = 0.0)]
        reorder: f64,
        /// Probability that a frame is corrupted (dropped by the receiver's ICRC check).
        #[arg(long, default_value_t = 0.0)]
        corrupt: f64,
        /// A scenario file (TOML) with the seed and faults; see the README.
        #[arg(long)]
        scenario: Option<String>,
        /// The operation.
        #[arg(long, value_enum, default_value_t = BenchOp::Write)]
        op: BenchOp,
        /// Message size in bytes.
        #[arg(long, default_value_t = 65536)]
        size: u32,
        /// Messages.
        #[arg(long, default_value_t = 2000)]
        count: u32,
        /// Messages outstanding.
        #[arg(long, default_value_t = 128)]
        depth: u32,
        /// Local ACK timeout exponent (4.096 µs × 2^n; 0 = infinite).
        #[arg(long, default_value_t = 14)]
        timeout: u8,
        /// Transport retries.
        #[arg(long, default_value_t = 7)]
        retry_cnt: u8,
        /// Write every frame of the run to FILE as pcapng (simulated ns timestamps).
        #[arg(long, value_name = "FILE")]
        capture: Option<String>,
        /// Timing profile: a built-in name (cx6-100g, cx7-400g) or a TOML file of overrides.
        #[arg(long, default_value = "cx6-100g")]
        profile: String,
        #[command(flatten)]
        timeline: TimelineArgs,
        /// Functional (untimed) mode: eligible WRITEs and SENDs go straight to the peer's
        /// responder, whole, with no frames (faults, --capture and --timeline switch it
        /// off). Simulated figures then mean little; the wall-clock emulation speed is the
        /// point.
        #[arg(long)]
        functional: bool,
    },
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
        /// Write every frame of the run to FILE as pcapng (simulated ns timestamps).
        #[arg(long, value_name = "FILE")]
        capture: Option<String>,
        /// Timing profile: a built-in name (cx6-100g, cx7-400g) or a TOML file of overrides.
        #[arg(long, default_value = "cx6-100g")]
        profile: String,
        #[command(flatten)]
        timeline: TimelineArgs,
    },
    /// Serves N emulated NICs to other processes as vfio-user PCI devices, one socket per
    /// NIC (DIR/nic0.sock ...): the driver reaches them with `VfioPort::connect`. Runs until
    /// killed; simulated time keeps pace with wall time.
    Serve {
        /// Directory for the sockets (created if missing; stale sockets are replaced).
        #[arg(long, value_name = "DIR")]
        socket: std::path::PathBuf,
        /// Number of NICs.
        #[arg(long, default_value_t = 2)]
        nodes: usize,
        /// Root seed (initial fabric randomness, faults).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Probability that a frame is lost on a link (0..1).
        #[arg(long, default_value_t = 0.0)]
        loss: f64,
        /// Timing profile: a built-in name (cx6-100g, cx7-400g) or a TOML file of overrides.
        #[arg(long, default_value = "cx6-100g")]
        profile: String,
        /// Seconds a new client has to send VERSION, and a client to finish a message or take
        /// a reply, before it is closed.
        #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
        client_timeout: f64,
        /// Seconds a client may send nothing (no message, no doorbell store) before it is
        /// closed and its NIC reset.
        #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
        idle_timeout: f64,
        /// Most DMA mappings one client may hold (also capped at an equal share of the
        /// process's vm.max_map_count).
        #[arg(long, default_value_t = ringbell_emu::serve::MAX_DMA_MAPPINGS)]
        max_dma_maps: usize,
    },
    /// One process of a two-process job on a served NIC: connects an RC QP to the other
    /// process through connection management (the target listens, the initiator connects to
    /// the target NIC's address), then runs checked RC or tagged traffic (see `serve`).
    Peer {
        /// The NIC's socket (DIR/nicN.sock).
        #[arg(long)]
        socket: std::path::PathBuf,
        /// Which side: the initiator sends, the target checks.
        #[arg(long, value_enum)]
        role: PeerRole,
        /// The initiator: the target NIC's IPv4 address (node n of a fabric is 10.0.0.n+1;
        /// the target prints its own in its `rb-listening` line).
        #[arg(long, value_name = "IP")]
        peer: Option<String>,
        /// The service id the target listens on and the initiator connects to.
        #[arg(long, default_value_t = ringbell_emu::peer::DEFAULT_SERVICE_ID, value_parser = parse_u64)]
        service: u64,
        /// rc: RDMA WRITE + SEND with immediate; tag: tagged eager and rendezvous messages.
        #[arg(long, value_enum, default_value_t = PeerMode::Rc)]
        mode: PeerMode,
        /// Iterations.
        #[arg(long, default_value_t = 64)]
        count: u32,
        /// Bytes per message (rc), or of the rendezvous messages (tag).
        #[arg(long, default_value_t = 4096)]
        size: u32,
        /// Give up after this many seconds of wall time.
        #[arg(long, default_value_t = 60)]
        deadline: u64,
        /// Give up when nothing completes for this many seconds (the peer is gone).
        #[arg(long, default_value_t = 10)]
        stall: u64,
    },
    /// Prints a timing profile: every parameter with its value and source.
    Profile {
        /// A built-in name (cx6-100g, cx7-400g) or a TOML file of overrides.
        #[arg(default_value = "cx6-100g")]
        profile: String,
    },
    /// Where the latency of one small message goes: a WRITE, a SEND and a READ on two nodes,
    /// each traced, with every stage of its critical path (offset, duration, node, the timing
    /// parameters it comes from) adding up to the measured latency.
    Breakdown {
        /// Root seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Message size in bytes (one packet: 1..=4096).
        #[arg(long, default_value_t = 8)]
        size: u32,
        /// How the two nodes are wired.
        #[arg(long, value_enum, default_value_t = Wiring::B2b)]
        wiring: Wiring,
        /// Timing profile: a built-in name (cx6-100g, cx7-400g) or a TOML file of overrides.
        #[arg(long, default_value = "cx6-100g")]
        profile: String,
    },
}

/// `--timeline FILE` (demo, bench).
#[derive(Args, Clone, Default)]
struct TimelineArgs {
    /// Write a Chrome/Perfetto timeline (Trace Event Format JSON, simulated time) of the run
    /// to FILE: every stage of every message, one process per node, one track per resource.
    #[arg(long, value_name = "FILE")]
    timeline: Option<String>,
    /// Most stages the timeline keeps (the first ones; the rest are counted).
    #[arg(long, value_name = "N", default_value_t = ringbell_emu::timeline::DEFAULT_MAX_EVENTS)]
    timeline_max: usize,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = timeline_args(&cli.cmd) {
        eprintln!("ringbell-emu: {e}");
        std::process::exit(1);
    }
    let r = match cli.cmd {
        Cmd::Coll(a) => coll(a),
        Cmd::Scale(a) => scale(a),
        Cmd::Serve {
            socket,
            nodes,
            seed,
            loss,
            profile,
            client_timeout,
            idle_timeout,
            max_dma_maps,
        } => {
            let secs = |name: &str, v: f64| {
                Duration::try_from_secs_f64(v)
                    .ok()
                    // At most a year: deadlines are instants plus this, which must not
                    // overflow.
                    .filter(|d| !d.is_zero() && d.as_secs() <= 365 * 86_400)
                    .ok_or_else(|| {
                        format!("--{name} {v}: a positive number of seconds, at most a year")
                    })
            };
            secs("client-timeout", client_timeout).and_then(|client_timeout| {
                let opts = ringbell_emu::serve::ServeOptions {
                    client_timeout,
                    idle_timeout: secs("idle-timeout", idle_timeout)?,
                    max_dma_maps,
                    ..Default::default()
                };
                serve(&socket, nodes, seed, loss, &profile, opts)
            })
        }
        Cmd::Peer {
            socket,
            role,
            peer,
            service,
            mode,
            count,
            size,
            deadline,
            stall,
        } => {
            let peer = match (role, peer) {
                (PeerRole::Initiator, None) => {
                    Err("the initiator needs --peer IP (the target NIC's address)".to_string())
                }
                (_, Some(p)) => ringbell_emu::peer::parse_ip(&p).map(Some),
                (_, None) => Ok(None),
            };
            peer.and_then(|peer| {
                let cfg = ringbell_emu::peer::PeerConfig {
                    socket,
                    peer,
                    service_id: service,
                    role: match role {
                        PeerRole::Initiator => ringbell_emu::peer::Role::Initiator,
                        PeerRole::Target => ringbell_emu::peer::Role::Target,
                    },
                    mode: match mode {
                        PeerMode::Rc => ringbell_emu::peer::Mode::Rc,
                        PeerMode::Tag => ringbell_emu::peer::Mode::Tag,
                    },
                    count,
                    size,
                    deadline: std::time::Duration::from_secs(deadline),
                    stall: std::time::Duration::from_secs(stall),
                };
                ringbell_emu::peer::run_peer(&cfg, std::io::stdout().lock()).map(|_| ())
            })
        }
        Cmd::Profile { profile } => ringbell_emu::profile::load(&profile)
            .map(|p| print!("{}", ringbell_emu::profile::describe(&p)))
            .map_err(|e| e.to_string()),
        Cmd::Demo {
            seed,
            iters,
            wiring,
            capture,
            profile,
            timeline,
        } => demo(seed, iters, wiring, capture, &profile, &timeline).map_err(|e| e.to_string()),
        Cmd::Breakdown {
            seed,
            size,
            wiring,
            profile,
        } => breakdown(seed, size, wiring, &profile),
        Cmd::Bench {
            seed,
            loss,
            duplicate,
            reorder,
            corrupt,
            scenario,
            op,
            size,
            count,
            depth,
            timeout,
            retry_cnt,
            capture,
            profile,
            timeline,
            functional,
        } => {
            let links = LinkFaults {
                drop_ppm: ppm(loss),
                duplicate_ppm: ppm(duplicate),
                reorder_ppm: ppm(reorder),
                reorder_delay: ringbell_specs::SimTime(2_000_000),
                corrupt_ppm: ppm(corrupt),
                down: Vec::new(),
            };
            bench(BenchArgs {
                seed,
                links,
                scenario,
                op,
                size,
                count,
                depth,
                timeout,
                retry_cnt,
                capture,
                profile,
                timeline,
                functional,
            })
        }
    };
    if let Err(e) = r {
        eprintln!("ringbell-emu: {e}");
        std::process::exit(1);
    }
}

/// `ringbell-emu scale`.
#[derive(Args)]
struct ScaleArgs {
    /// Node counts of the ring (comma separated, each 2..=1024; `0`: none).
    #[arg(long, value_delimiter = ',', default_values_t = vec![2, 8, 64, 256, 1024])]
    ring: Vec<usize>,
    /// Node counts of the all-to-all (comma separated, each 2..=1024; `0`: none).
    #[arg(long = "all-to-all", value_delimiter = ',', default_values_t = vec![2, 8, 64, 256])]
    all_to_all: Vec<usize>,
    /// Messages in each run, spread evenly over its sending QPs (the same total traffic at
    /// every N).
    #[arg(long, default_value_t = 1 << 18)]
    messages: u64,
    /// Messages outstanding per ring QP.
    #[arg(long, default_value_t = 256)]
    depth: u32,
    /// Messages outstanding per all-to-all QP.
    #[arg(long, default_value_t = 4)]
    a2a_depth: u32,
    /// Root seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn scale(a: ScaleArgs) -> Result<(), String> {
    use nix::sys::resource::{getrlimit, Resource};
    use ringbell_emu::scale::{run, Pattern, ScaleConfig};
    // Each node holds a few descriptors (its device's memory arena): let the process use
    // what the hard limit allows.
    raise_fd_limit();
    let fd_limit = getrlimit(Resource::RLIMIT_NOFILE).map_or(0, |(soft, _)| soft);
    let y = Yardstick::measure();
    println!(
        "seed {}; {} messages per run (8-byte inline RC WRITEs); descriptor limit {fd_limit}",
        a.seed, a.messages
    );
    println!("{}", y.describe());
    println!(
        "{:<10} {:>5} {:>7} {:>9} {:>10} {:>9} {:>9} {:>7} {:>9} {:>8} {:>10} {:>6} {:>6} {:>8}",
        "pattern",
        "N",
        "QPs",
        "messages",
        "events",
        "ns/msg",
        "chases",
        "loops",
        "ns/event",
        "setup s",
        "KiB/node",
        "fds",
        "maps",
        "wall s"
    );
    let runs = a
        .ring
        .iter()
        .map(|&n| (Pattern::Ring, n, a.depth))
        .chain(
            a.all_to_all
                .iter()
                .map(|&n| (Pattern::AllToAll, n, a.a2a_depth)),
        )
        .filter(|&(_, n, _)| n != 0);
    for (pattern, n, depth) in runs {
        if !(2..=1024).contains(&n) {
            return Err(format!("{} at {n} nodes: must be 2..=1024", pattern.name()));
        }
        let senders = match pattern {
            Pattern::Ring => n as u64,
            Pattern::AllToAll => (n * (n - 1)) as u64,
        };
        let msgs = (a.messages / senders).max(1) as u32;
        let o = run(ScaleConfig {
            nodes: n,
            pattern,
            msgs,
            depth,
            seed: a.seed,
        })?;
        println!(
            "{:<10} {:>5} {:>7} {:>9} {:>10} {:>9.0} {:>9.1} {:>7.2} {:>9.0} {:>8.2} {:>10.0} {:>6} {:>6} {:>8.2}",
            pattern.name(),
            n,
            o.qps,
            o.messages,
            o.events,
            o.ns_per_message(),
            y.in_chases(o.ns_per_message()),
            y.in_loops(o.ns_per_message()),
            o.ns_per_event(),
            o.setup.as_secs_f64(),
            o.rss_kib_per_node,
            o.fds,
            o.maps,
            o.wall.as_secs_f64()
        );
    }
    println!("ns/msg and ns/event are wall time during the traffic; chases and loops = ns/msg in pointer-chase loads and in runs of the cached loop (yardsticks of this run)");
    Ok(())
}

/// `ringbell-emu coll`.
#[derive(Args)]
struct CollArgs {
    /// Which collective.
    #[arg(long, value_enum, default_value_t = CollKind::All)]
    op: CollKind,
    /// Rank counts (comma separated, each 2..=1024).
    #[arg(long, value_delimiter = ',', default_values_t = vec![2, 4, 8, 16, 32, 64])]
    nodes: Vec<usize>,
    /// Broadcast root (taken modulo N).
    #[arg(long, default_value_t = 0)]
    root: usize,
    /// Broadcast payload bytes.
    #[arg(long, default_value_t = 4096)]
    bytes: u32,
    /// Allreduce elements (u64).
    #[arg(long, default_value_t = 4)]
    elems: usize,
    /// Collectives run one after the other on the same set-up (counters reused).
    #[arg(long, default_value_t = 3)]
    iters: u32,
    /// Root seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Probability that a frame is lost on a link (0..1).
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Local ACK timeout exponent (4.096 µs × 2^n).
    #[arg(long, default_value_t = 14)]
    timeout: u8,
    /// Timing profile: a built-in name (cx6-100g, cx7-400g) or a TOML file of overrides.
    #[arg(long, default_value = "cx6-100g")]
    profile: String,
}

fn coll(a: CollArgs) -> Result<(), String> {
    use ringbell_emu::coll::{run_checked, CollGroup, CollOp};
    let timing = ringbell_emu::profile::load(&a.profile).map_err(|e| e.to_string())?;
    let y = Yardstick::measure();
    println!("seed {}", a.seed);
    println!(
        "{} (wall M chases: the wall time in loads of the chase)",
        y.describe()
    );
    println!(
        "offloaded collectives: triggered operations only between start and completion; timing profile {}; loss {} per link; {} runs each",
        timing.name,
        pct(ppm(a.loss)),
        a.iters.max(1)
    );
    println!(
        "{:<10} {:>5} {:>5} {:>14} {:>10} {:>10} {:>9} {:>13}",
        "op", "N", "root", "latency (us)", "ops/rank", "ops total", "wall (ms)", "wall M chases"
    );
    let kinds: &[CollKind] = match a.op {
        CollKind::All => &[CollKind::Barrier, CollKind::Bcast, CollKind::Allreduce],
        k => std::slice::from_ref(match k {
            CollKind::Barrier => &CollKind::Barrier,
            CollKind::Bcast => &CollKind::Bcast,
            _ => &CollKind::Allreduce,
        }),
    };
    for &kind in kinds {
        for &n in &a.nodes {
            if !(2..=1024).contains(&n) {
                return Err(format!("--nodes {n}: must be 2..=1024"));
            }
            let (op, name) = match kind {
                CollKind::Barrier => (CollOp::Barrier, "barrier"),
                CollKind::Bcast => (
                    CollOp::Broadcast {
                        root: a.root % n,
                        bytes: a.bytes,
                    },
                    "bcast",
                ),
                _ => (CollOp::Allreduce { elems: a.elems }, "allreduce"),
            };
            let mut cfg = FabricConfig::new(n, a.seed);
            cfg.faults.links = LinkFaults::loss(a.loss);
            cfg.timing = timing.clone();
            let opts = ConnectOptions {
                timeout: a.timeout,
                ..Default::default()
            };
            let capacity = (a.bytes as usize).max(a.elems * 8).next_multiple_of(8);
            let wall = Instant::now();
            let group = CollGroup::new(cfg, op_root(op), capacity, &opts)?;
            let runs = run_checked(&group, op, a.iters.max(1))
                .map_err(|e| format!("{name} on {n} ranks: {e}"))?;
            let avg = runs.iter().map(|o| o.latency_ps).sum::<u64>() / runs.len() as u64;
            let el = wall.elapsed().as_secs_f64();
            println!(
                "{:<10} {:>5} {:>5} {:>14.3} {:>10} {:>10} {:>9.2} {:>13.3}",
                name,
                n,
                op_root(op),
                avg as f64 / 1e6,
                runs[0].max_ops,
                runs[0].total_ops,
                el * 1e3,
                y.in_chases(el * 1e9) / 1e6
            );
        }
    }
    Ok(())
}

fn op_root(op: ringbell_emu::coll::CollOp) -> usize {
    match op {
        ringbell_emu::coll::CollOp::Broadcast { root, .. } => root,
        _ => 0,
    }
}

struct BenchArgs {
    seed: u64,
    links: LinkFaults,
    scenario: Option<String>,
    op: BenchOp,
    size: u32,
    count: u32,
    depth: u32,
    timeout: u8,
    retry_cnt: u8,
    capture: Option<String>,
    profile: String,
    timeline: TimelineArgs,
    functional: bool,
}

/// Prints the wall time per message of a run that took `el` seconds for `msgs` messages,
/// beside the yardsticks measured now (after the run, so they do not disturb it), so that
/// the figure can be compared across machines.
fn print_per_message(el: f64, msgs: u64) {
    let y = Yardstick::measure();
    let ns = el * 1e9 / msgs.max(1) as f64;
    println!(
        "wall per message: {ns:.0} ns = {:.1} chases = {:.3} memcpy-4KiB = {:.2} loops; {}",
        y.in_chases(ns),
        ns / y.memcpy_ns_per_4k,
        y.in_loops(ns),
        y.describe()
    );
}

/// Shows progress on stderr once a run has taken more than two seconds of wall time.
struct Progress {
    start: Instant,
    shown: bool,
}

impl Progress {
    fn new() -> Self {
        Progress {
            start: Instant::now(),
            shown: false,
        }
    }
    fn tick(&mut self, what: &str, done: usize, total: usize) {
        if self.start.elapsed().as_secs_f64() > 2.0 {
            eprint!("\r[{done}/{total}] {what:<40}");
            self.shown = true;
        }
    }
    fn finish(&self) {
        if self.shown {
            eprintln!("\r{:60}", "");
        }
    }
}

/// The perftest-equivalent report (`bench --op perftest`).
fn perftest(cfg: FabricConfig, a: &BenchArgs) -> Result<(), String> {
    use ringbell_specs::SimTime;
    let e = |e: ringbell::Error| e.to_string();
    let wall = Instant::now();
    let mut cfg = cfg;
    cfg.topology = Topology::BackToBack;
    let prof = cfg.timing.name.clone();
    let iters = a.count.clamp(10, 100_000);
    println!("perftest: two back-to-back nodes, timing profile {prof}, path MTU 4096, {iters} iterations per size");
    println!();
    println!("latency (simulated µs; WRITE/SEND one-way, READ/atomic round trip)");
    println!(
        "{:<7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "op", "bytes", "min", "median", "avg", "p99", "p99.9"
    );
    let mut p = PerfPair::with(cfg.clone(), &ConnectOptions::default()).map_err(e)?;
    let sizes: Vec<u32> = (1..=16).map(|k| 1u32 << k).collect();
    let mut progress = Progress::new();
    let mut sim_total = SimTime::ZERO;
    let mut msgs = 0u64;
    // Latency: WRITE, SEND and READ at every size, one atomic; then bandwidth at every size.
    let total = 3 * sizes.len() + 1 + sizes.len();
    let mut done = 0;
    for op in [PerfOp::Write, PerfOp::Send, PerfOp::Read, PerfOp::Atomic] {
        let op_sizes: &[u32] = if op == PerfOp::Atomic { &[8] } else { &sizes };
        for &size in op_sizes {
            progress.tick(&format!("latency {} {size} B", op.name()), done, total);
            let t0 = p.fabric().now();
            let mut s = p.latency_samples(op, size, iters).map_err(e)?;
            sim_total = sim_total + (p.fabric().now() - t0);
            msgs += s.len() as u64;
            s.sort_unstable();
            let us = |t: SimTime| t.ps() as f64 / 1e6;
            let q = |f: f64| s[((s.len() as f64 * f).ceil() as usize).clamp(1, s.len()) - 1];
            let avg = s.iter().map(|t| t.ps()).sum::<u64>() / s.len() as u64;
            println!(
                "{:<7} {:>7} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.3}",
                op.name(),
                size,
                us(s[0]),
                us(q(0.5)),
                avg as f64 / 1e6,
                us(q(0.99)),
                us(q(0.999))
            );
            done += 1;
        }
    }
    println!();
    println!("bandwidth (simulated Gb/s) and message rate (simulated M/s), WRITE, 128 outstanding per QP, every 16th signaled");
    println!(
        "{:>9} {:>10} {:>10} {:>10} {:>10}",
        "bytes", "1 QP Gb/s", "1 QP M/s", "8 QP Gb/s", "8 QP M/s"
    );
    let mut p1 = PerfPair::with_qps(cfg.clone(), &ConnectOptions::default(), 1).map_err(e)?;
    let mut p8 = PerfPair::with_qps(cfg, &ConnectOptions::default(), 8).map_err(e)?;
    for &size in &sizes {
        progress.tick(&format!("bandwidth {size} B"), done, total);
        let count = ((64u64 << 20) / size as u64).clamp(512, 20_000) as u32;
        let mut row = Vec::new();
        for pp in [&mut p1, &mut p8] {
            let t0 = pp.fabric().now();
            let (bps, mps) = pp.throughput(PerfOp::Write, size, count, 128).map_err(e)?;
            sim_total = sim_total + (pp.fabric().now() - t0);
            msgs += count as u64;
            row.push((bps / 1e9, mps / 1e6));
        }
        println!(
            "{:>9} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
            size, row[0].0, row[0].1, row[1].0, row[1].1
        );
        done += 1;
    }
    progress.finish();
    let el = wall.elapsed().as_secs_f64();
    println!();
    println!(
        "emulation: {:.3} simulated ms in {:.2} wall s = {:.0} simulated µs per wall s; {:.3} M messages per wall s",
        sim_total.as_us_f64() / 1e3,
        el,
        sim_total.as_us_f64() / el,
        msgs as f64 / el / 1e6
    );
    print_per_message(el, msgs);
    Ok(())
}

fn pct(p: u32) -> String {
    format!("{:.3}%", p as f64 * 100.0 / PPM as f64)
}

fn bench(a: BenchArgs) -> Result<(), String> {
    let mut cfg = FabricConfig::new(2, a.seed);
    cfg.functional = a.functional;
    cfg.timing = ringbell_emu::profile::load(&a.profile).map_err(|e| e.to_string())?;
    cfg.faults.links = a.links.clone();
    if let Some(path) = &a.scenario {
        let s = Scenario::load(path).map_err(|e| e.to_string())?;
        if let Some(seed) = s.seed {
            cfg.seed = seed;
        }
        // The scenario adds its per-node links and rules; its default link applies unless
        // the flags set one.
        let l = &cfg.faults.links;
        if l.drop_ppm == 0 && l.duplicate_ppm == 0 && l.reorder_ppm == 0 && l.corrupt_ppm == 0 {
            cfg.faults.links = s.faults.links;
        }
        cfg.faults.per_node = s.faults.per_node;
        cfg.faults.rules = s.faults.rules;
    }
    println!("seed {}", cfg.seed);
    let l = &cfg.faults.links;
    println!(
        "faults: loss {} duplicate {} reorder {} corrupt {} on every link; {} node overrides, {} rules",
        pct(l.drop_ppm),
        pct(l.duplicate_ppm),
        pct(l.reorder_ppm),
        pct(l.corrupt_ppm),
        cfg.faults.per_node.len(),
        cfg.faults.rules.len()
    );
    let (op, name) = match a.op {
        BenchOp::Write => (PerfOp::Write, "write"),
        BenchOp::Send => (PerfOp::Send, "send"),
        BenchOp::Read => (PerfOp::Read, "read"),
        BenchOp::Tag if a.capture.is_some() => {
            return Err("--capture does not apply to --op tag (it runs many fabrics)".into())
        }
        BenchOp::Tag => return tag_bench(&cfg, a.count.min(2000)),
        BenchOp::Perftest => return perftest(cfg, &a),
    };
    println!(
        "bench: {name} {} B x {}, {} outstanding, two switched nodes, ACK timeout {}, retry_cnt {}",
        a.size, a.count, a.depth, a.timeout, a.retry_cnt
    );
    let wall = Instant::now();
    let opts = ConnectOptions {
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        ..Default::default()
    };
    let mut p = PerfPair::with(cfg, &opts).map_err(|e| e.to_string())?;
    if let Some(path) = &a.capture {
        start_capture(p.fabric(), path)?;
    }
    start_timeline(p.fabric(), &a.timeline)?;
    let start = p.fabric().now();
    let bw = p.bandwidth(op, a.size, a.count, a.depth);
    let sim = p.fabric().now() - start;
    let el = wall.elapsed().as_secs_f64();
    match &bw {
        // Functional mode does not model time: a rate over simulated time means nothing, so
        // the run reports what it measures, the wall-clock rate of the emulation.
        Ok(_) if a.functional => println!(
            "goodput: not modelled (functional mode is untimed); {} messages of {} B in {:.3} wall s: {:.2} M msg/s, {:.2} Gb/s of wall time",
            a.count,
            a.size,
            el,
            a.count as f64 / el.max(1e-9) / 1e6,
            a.count as f64 * a.size as f64 * 8.0 / el.max(1e-9) / 1e9
        ),
        Ok(bw) => println!(
            "goodput: {:.2} Gb/s of simulated time ({} messages in {:.3} simulated ms)",
            bw / 1e9,
            a.count,
            sim.as_us_f64() / 1e3
        ),
        Err(e) => println!("run failed: {e}"),
    }
    let (qa, qb, pa, pb) = p.stats().map_err(|e| e.to_string())?;
    let line = |title: &str, it: &mut dyn Iterator<Item = (&'static str, u64)>| {
        let parts: Vec<String> = it
            .filter(|(_, v)| *v != 0)
            .map(|(n, v)| format!("{n} {v}"))
            .collect();
        println!(
            "{title}: {}",
            if parts.is_empty() {
                "-".to_string()
            } else {
                parts.join(", ")
            }
        );
    };
    line("requester QP", &mut qa.values());
    line("responder QP", &mut qb.values());
    line("port 0", &mut pa.values());
    line("port 1", &mut pb.values());
    let f = p.fabric().fault_stats();
    println!(
        "injected: {} dropped, {} duplicated, {} held back, {} corrupted, {} lost to link-down, {} rule hits",
        f.dropped, f.duplicated, f.delayed, f.corrupted, f.link_down, f.rule_hits
    );
    let st = p.fabric().stats();
    print_per_message(el, a.count as u64);
    println!(
        "emulation: {:.3} simulated ms in {:.2} wall s; {:.2} M events/s, {:.2} M frames/s",
        p.fabric().now().as_us_f64() / 1e3,
        el,
        st.events as f64 / el / 1e6,
        st.frames_delivered as f64 / el / 1e6
    );
    println!("trace digest {:016x}", p.fabric().trace_digest());
    if let Some(path) = &a.capture {
        stop_capture(p.fabric(), path)?;
    }
    write_timeline(p.fabric(), &a.timeline)?;
    bw.map(|_| ()).map_err(|e| e.to_string())
}

fn start_capture(f: &ringbell_emu::Fabric, path: &str) -> Result<(), String> {
    f.capture_to_file(path)
        .map_err(|e| format!("--capture {path}: {e}"))
}

fn stop_capture(f: &ringbell_emu::Fabric, path: &str) -> Result<(), String> {
    let st = f
        .stop_capture()
        .map_err(|e| format!("--capture {path}: {e}"))?;
    println!(
        "capture: {} frames ({} never delivered) written to {path}",
        st.frames, st.lost
    );
    Ok(())
}

fn tag_bench(cfg: &FabricConfig, count: u32) -> Result<(), String> {
    use ringbell_emu::tmbench::{matching, rendezvous, Matching};
    let y = Yardstick::measure();
    let wall = Instant::now();
    println!("tag matching: 64 B eager messages, {count} per figure, receives of 8 KiB");
    println!("  depth = receives that do not match, posted ahead of each matching one");
    println!(
        "  {:>6}  {:>8} {:>11} {:>9}   {:>8} {:>11} {:>12} {:>8}",
        "depth", "hw lat", "hw rate", "hw match", "sw lat", "sw rate", "sw host/msg", "chases"
    );
    for depth in [0u32, 16, 64, 256, 1023, 1024] {
        let hw = matching(cfg, Matching::Hardware, depth, 64, count).map_err(|e| e.to_string())?;
        let sw = matching(cfg, Matching::Software, depth, 64, count).map_err(|e| e.to_string())?;
        println!(
            "  {:>6}  {:>5.3} µs {:>7.2} M/s {:>8.0}%   {:>5.3} µs {:>7.2} M/s {:>9.2} µs {:>8.1}",
            depth,
            hw.latency.ps() as f64 / 1e6,
            hw.rate / 1e6,
            hw.hw_matched as f64 * 50.0 / count as f64,
            sw.latency.ps() as f64 / 1e6,
            sw.rate / 1e6,
            sw.host_per_msg.as_secs_f64() * 1e6,
            y.in_chases(sw.host_per_msg.as_secs_f64() * 1e9),
        );
    }
    println!("  (simulated time; 'sw host/msg' is the receiver's software time per message on this machine, 'chases' the same in loads of the pointer-chase yardstick)");
    println!(
        "rendezvous bandwidth (8 in flight; hw: receive posted first, the NIC reads and FINs;"
    );
    println!("  sw: the request arrives unexpected, software reads and FINs)");
    let mut size = 8192u32;
    while size <= 4 << 20 {
        let n = count.min(((64u64 << 20) / size as u64).max(16) as u32);
        let hw = rendezvous(cfg, Matching::Hardware, size, n).map_err(|e| e.to_string())?;
        let sw = rendezvous(cfg, Matching::Software, size, n).map_err(|e| e.to_string())?;
        println!(
            "  {:>8} B  hw {:>7.2} Gb/s   sw {:>7.2} Gb/s",
            size,
            hw / 1e9,
            sw / 1e9
        );
        size *= 2;
    }
    let el = wall.elapsed().as_secs_f64();
    println!(
        "wall {el:.2} s = {:.2} M chases; {}",
        y.in_chases(el * 1e9) / 1e6,
        y.describe()
    );
    Ok(())
}

fn demo(
    seed: u64,
    iters: u32,
    wiring: Wiring,
    capture: Option<String>,
    profile: &str,
    timeline: &TimelineArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    println!("seed {seed}");
    let topology = match wiring {
        Wiring::B2b => Topology::BackToBack,
        Wiring::Switch => Topology::Switch,
    };
    let wall = Instant::now();
    let mut cfg = FabricConfig::new(2, seed);
    cfg.topology = topology;
    cfg.timing = ringbell_emu::profile::load(profile)?;
    let mut p = PerfPair::with(cfg, &ConnectOptions::default())?;
    if let Some(path) = &capture {
        start_capture(p.fabric(), path)?;
    }
    start_timeline(p.fabric(), timeline)?;
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
    print_per_message(el, messages);
    println!("trace digest {:016x}", p.fabric().trace_digest());
    if let Some(path) = &capture {
        stop_capture(p.fabric(), path)?;
    }
    write_timeline(p.fabric(), timeline)?;
    Ok(())
}

/// Checks the `--timeline` options of `cmd`.
fn timeline_args(cmd: &Cmd) -> Result<(), String> {
    let t = match cmd {
        Cmd::Demo { timeline, .. } => timeline.clone(),
        Cmd::Bench {
            timeline,
            op: BenchOp::Tag | BenchOp::Perftest,
            ..
        } if timeline.timeline.is_some() => {
            return Err("--timeline applies to --op write, send and read".into())
        }
        Cmd::Bench { timeline, .. } => timeline.clone(),
        _ => TimelineArgs::default(),
    };
    if t.timeline.is_some() && t.timeline_max == 0 {
        return Err("--timeline-max must be at least 1".into());
    }
    Ok(())
}

/// Starts recording the timeline `--timeline` asked for, if any.
fn start_timeline(f: &ringbell_emu::Fabric, t: &TimelineArgs) -> Result<(), String> {
    match &t.timeline {
        Some(path) => f
            .start_timeline(t.timeline_max)
            .map_err(|e| format!("--timeline {path}: {e}")),
        None => Ok(()),
    }
}

/// Writes the timeline being recorded to the `--timeline` file, and says what it holds.
fn write_timeline(f: &ringbell_emu::Fabric, t: &TimelineArgs) -> Result<(), String> {
    let Some(path) = &t.timeline else {
        return Ok(());
    };
    let st = f
        .write_timeline(path)
        .map_err(|e| format!("--timeline {path}: {e}"))?;
    let cap = t.timeline_max;
    println!(
        "timeline: {} stages on {} tracks, {:.1} MB, written to {path}{}",
        st.events,
        st.tracks,
        st.bytes as f64 / 1e6,
        if st.dropped > 0 {
            format!(
                " (the first {cap} stages only: {} more not recorded; raise --timeline-max)",
                st.dropped
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `ringbell-emu breakdown`.
fn breakdown(seed: u64, size: u32, wiring: Wiring, profile: &str) -> Result<(), String> {
    let timing = ringbell_emu::profile::load(profile).map_err(|e| e.to_string())?;
    let topology = match wiring {
        Wiring::B2b => Topology::BackToBack,
        Wiring::Switch => Topology::Switch,
    };
    println!("seed {seed}");
    println!(
        "latency breakdown: two {} nodes, timing profile {}, path MTU 4096; each message traced, \
         its critical path read from the timeline (simulated ns)",
        if topology == Topology::BackToBack {
            "back-to-back"
        } else {
            "switched"
        },
        timing.name
    );
    let all = ringbell_emu::timeline::breakdown_all(seed, topology, timing.clone(), size)?;
    for b in &all {
        println!();
        print!("{}", b.render(&timing));
    }
    match all.iter().find(|b| !b.matches_measurement()) {
        Some(b) => Err(format!(
            "the stages of {} do not add up to the measured latency",
            b.op.name()
        )),
        None => Ok(()),
    }
}

/// Raises the soft limit on open descriptors to the hard limit: a large fabric needs a few
/// per NIC (its DMA arena, and when served, its BAR file, socket and wake-up eventfd).
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn serve(
    dir: &std::path::Path,
    nodes: usize,
    seed: u64,
    loss: f64,
    profile: &str,
    opts: ringbell_emu::serve::ServeOptions,
) -> Result<(), String> {
    if !(1..=1024).contains(&nodes) {
        return Err(format!("--nodes {nodes}: 1..=1024 NICs can be served"));
    }
    raise_fd_limit();
    let mut cfg = FabricConfig::new(nodes, seed);
    cfg.timing = ringbell_emu::profile::load(profile).map_err(|e| e.to_string())?;
    if !(0.0..=1.0).contains(&loss) {
        return Err(format!("--loss {loss}: a probability is 0..=1"));
    }
    cfg.faults.links = LinkFaults::loss(loss);
    ringbell_emu::serve::serve(dir, cfg, opts, || {
        println!(
            "ringbell-emu serve: {nodes} NICs on {} (nic0.sock .. nic{}.sock), seed {seed}",
            dir.display(),
            nodes - 1
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })
    .map_err(|e| e.to_string())
}

/// A u64 in decimal or 0x-hexadecimal.
fn parse_u64(s: &str) -> Result<u64, String> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|_| format!("not a number: {s:?}"))
}
