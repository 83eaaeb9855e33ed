//! Suites other people wrote, run as installed against ringbell NICs through the library:
//! rdma-core's own Python tests (pyverbs), perftest's eight programs (the send tests over
//! UD, the send and write tests over UC, some over XRC) and its raw Ethernet bandwidth and
//! latency programs and ibverbs-utils' pingpongs (RC, SRQ, UD, UC)
//! between two processes on one
//! `ringbell-emu serve`, and `ibv_devinfo`; UCX (`ucx_perftest` over its `rc_verbs` and
//! `ud_verbs` transports), Open MPI with its UCX PML (our MPI programs and NetPIPE's
//! integrity check) and OpenSHMEM (OSHMEM's UCX SPML) on the served NICs.
//! `.ci/run` installs the Debian packages (rdma-core, python3-pyverbs, perftest,
//! ibverbs-utils, ucx-utils, openmpi-bin, libopenmpi-dev, netpipe-openmpi); a missing one
//! fails the test with the package to install. No device node is needed: UCX's check for
//! `/dev/infiniband/<dev_name>` is answered by the library when the node does not exist.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The build directory of this test (target/<profile>).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The library, built with this test: cargo compiles the package's cdylib into `deps/`
/// when it builds the library for the tests (and copies it up only for `cargo build`).
fn library() -> PathBuf {
    let dir = profile_dir();
    [dir.join("deps"), dir]
        .into_iter()
        .map(|d| d.join("libringbell_verbs.so"))
        .find(|p| p.exists())
        .expect("libringbell_verbs.so was not built")
}

/// The emulator binary of this test's profile, brought up to date once per test process
/// (`cargo test -p ringbell-verbs` does not build other packages' binaries, and one left
/// from an older build may lack what the library now uses, such as UD QPs).
fn emulator() -> PathBuf {
    static BUILT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    let dir = profile_dir();
    BUILT.get_or_init(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "ringbell-emu", "--bin", "ringbell-emu"]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let st = cmd.status().unwrap();
        assert!(st.success(), "building ringbell-emu failed");
    });
    dir.join("ringbell-emu")
}

/// Panics with the package to install when `prog` is missing.
fn need(prog: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(prog).exists()))
        .unwrap_or(false)
        || Path::new(prog).exists();
    assert!(
        found,
        "{prog} not found: install the Debian package {package}"
    );
}

/// Runs `cmd` with a deadline; kills it when the deadline passes.
fn run(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait(child, limit)
}

fn wait(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "timed out after {limit:?}:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `ringbell-emu serve`, stopped on drop.
struct Served {
    child: Child,
    dir: PathBuf,
    /// More environment for the programs run on it.
    env: Vec<(&'static str, String)>,
}

impl Served {
    /// Two NICs.
    fn start(name: &str) -> Served {
        Served::start_nodes(name, 2)
    }

    fn start_nodes(name: &str, nodes: usize) -> Served {
        let dir = std::env::temp_dir().join(format!("ringbell-ext-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(emulator())
            .args(["serve", "--socket"])
            .arg(&dir)
            .args(["--nodes", &nodes.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !(0..nodes).all(|i| dir.join(format!("nic{i}.sock")).exists()) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "serve did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Served {
            child,
            dir,
            env: Vec::new(),
        }
    }

    /// A command of a program that uses the served NICs through the library.
    fn command(&self, prog: &str) -> Command {
        let mut c = Command::new(prog);
        c.env("LD_PRELOAD", library())
            .env("RINGBELL_SERVE", &self.dir)
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    /// Starts `prog` with `args`, line-buffered (coreutils' `stdbuf`, which keeps the
    /// library's `LD_PRELOAD`), and reads its output until a line containing `marker`:
    /// the running program, what it printed so far, and a reader of the rest.
    fn start_until(&self, prog: &str, args: &[&str], marker: &str) -> Watched {
        use std::io::{BufRead, BufReader};
        let mut child = self
            .command("stdbuf")
            .arg("-oL")
            .arg(prog)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut head = String::new();
        for l in lines.by_ref() {
            let l = l.unwrap();
            head += &l;
            head.push('\n');
            if l.contains(marker) {
                break;
            }
        }
        assert!(head.contains(marker), "{prog}:\n{head}");
        let rest = std::thread::spawn(move || lines.map(|l| l.unwrap() + "\n").collect());
        Watched { child, head, rest }
    }

    /// Runs a server and a client program (the client retries its connect until the
    /// server listens) and returns both outputs.
    fn pair(&self, prog: &str, server: &[&str], client: &[&str]) -> (Output, Output) {
        self.pair_of((prog, server), (prog, client))
    }

    /// [`Served::pair`] with a server and a client program of their own.
    fn pair_of(&self, server: (&str, &[&str]), client: (&str, &[&str])) -> (Output, Output) {
        let s = self
            .command(server.0)
            .args(server.1)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let c = self.client(client);
        let s = wait(s, Duration::from_secs(120));
        (s, c)
    }

    /// Runs a client program against a server just started, again while its output says
    /// the server does not listen yet (for up to 20 s); its last run's output.
    fn client(&self, client: (&str, &[&str])) -> Output {
        let limit = Duration::from_secs(120);
        let start = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(300));
            let mut cmd = self.command(client.0);
            cmd.args(client.1);
            let out = run(cmd, limit);
            let text = String::from_utf8_lossy(&out.stderr).to_string()
                + &String::from_utf8_lossy(&out.stdout);
            // The server may not listen yet: perftest, the pingpongs and ucx_perftest then
            // say so; over RDMA-CM the request is rejected (no listener on the port) or
            // unanswered (the server has not opened its NIC yet).
            let refused = text.contains("Couldn't connect")
                || text.contains("Unable to open")
                || text.contains("Connection refused")
                || text.contains("Connection timed out")
                || text.contains("RDMA_CM_EVENT_REJECTED")
                || text.contains("RDMA_CM_EVENT_UNREACHABLE")
                || text.contains("Unexpected CM event");
            if !refused || start.elapsed() > Duration::from_secs(20) {
                break out;
            }
        }
    }
}

/// A program started by [`Served::start_until`].
struct Watched {
    child: Child,
    head: String,
    rest: std::thread::JoinHandle<String>,
}

impl Watched {
    /// Its exit status (waited for up to `limit`), and its whole output, stderr last.
    fn finish(mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let status = wait_status(&mut self.child, limit);
        let mut err = String::new();
        let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
        let out = self.head + &self.rest.join().unwrap() + &err;
        (status, out)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// perftest between two processes on one server: each program completes its run and prints
/// its table. A documented short run: 200 iterations at perftest's default message size,
/// over RC unless `extra` says otherwise.
fn perftest(prog: &str, port: u16, header: &str) {
    perftest_with(prog, port, header, &[]);
}

fn perftest_with(prog: &str, port: u16, header: &str, extra: &[&str]) {
    perftest_to(prog, port, header, extra, "localhost");
}

/// [`perftest_with`], the client naming the server `to`.
fn perftest_to(prog: &str, port: u16, header: &str, extra: &[&str], to: &str) {
    need(prog, "perftest");
    // One server directory per test (a program may run in two tests at once).
    let srv = Served::start(&format!("{prog}-{port}"));
    let p = port.to_string();
    let t0 = Instant::now();
    let server: Vec<&str> = ["-d", "rb0", "-n", "200", "-p", &p]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let client: Vec<&str> = ["-d", "rb1", "-n", "200", "-p", &p]
        .into_iter()
        .chain(extra.iter().copied())
        .chain([to])
        .collect();
    let (s, c) = srv.pair(prog, &server, &client);
    let wall = t0.elapsed();
    // Either side's failure shows both sides' output.
    assert!(
        s.status.success() && c.status.success(),
        "{prog} failed: server {}, client {}\n--- server ---\n{}\n--- client ---\n{}",
        s.status,
        c.status,
        text(&s),
        text(&c)
    );
    let row = result_row(prog, &text(&c), header);
    println!("{prog} ({wall:.2?} wall):\n{header}\n{row}");
}

/// The row under perftest's result `header` in `out`, checked to report 200 iterations
/// per QP.
fn result_row(prog: &str, out: &str, header: &str) -> String {
    assert!(out.contains(header), "{prog}: no result table:\n{out}");
    let row = out
        .lines()
        .skip_while(|l| !l.contains(header))
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert!(
        // 200 iterations on each QP (`-q`).
        cols.len() >= 4 && cols[1].parse::<u32>().is_ok_and(|n| n > 0 && n % 200 == 0),
        "{prog}: unexpected row {row:?}:\n{out}"
    );
    row
}

const LAT: &str = "#bytes #iterations";
const BW: &str = "#bytes     #iterations";

#[test]
fn perftest_ib_write_lat() {
    perftest("ib_write_lat", 18601, LAT);
}
#[test]
fn perftest_ib_write_bw() {
    perftest("ib_write_bw", 18602, BW);
}
#[test]
fn perftest_ib_send_lat() {
    perftest("ib_send_lat", 18603, LAT);
}
#[test]
fn perftest_ib_send_bw() {
    perftest("ib_send_bw", 18604, BW);
}
#[test]
fn perftest_ib_write_lat_uc() {
    perftest_with("ib_write_lat", 18614, LAT, &["-c", "UC"]);
}
#[test]
fn perftest_ib_write_bw_uc() {
    perftest_with("ib_write_bw", 18615, BW, &["-c", "UC"]);
}
#[test]
fn perftest_ib_send_bw_xrc() {
    perftest_with("ib_send_bw", 18631, BW, &["-c", "XRC"]);
}
#[test]
fn perftest_ib_read_lat_xrc() {
    perftest_with("ib_read_lat", 18632, LAT, &["-c", "XRC"]);
}
#[test]
fn perftest_ib_send_lat_uc() {
    perftest_with("ib_send_lat", 18616, LAT, &["-c", "UC"]);
}
#[test]
fn perftest_ib_send_bw_uc() {
    perftest_with("ib_send_bw", 18617, BW, &["-c", "UC"]);
}
#[test]
fn perftest_ib_send_lat_ud() {
    perftest_with("ib_send_lat", 18609, LAT, &["-c", "UD"]);
}
#[test]
fn perftest_ib_send_bw_ud() {
    perftest_with("ib_send_bw", 18610, BW, &["-c", "UD"]);
}
#[test]
fn perftest_ib_read_lat() {
    perftest("ib_read_lat", 18605, LAT);
}
#[test]
fn perftest_ib_read_bw() {
    perftest("ib_read_bw", 18606, BW);
}
#[test]
fn perftest_ib_atomic_lat() {
    perftest("ib_atomic_lat", 18607, LAT);
}
#[test]
fn perftest_ib_atomic_bw() {
    perftest("ib_atomic_bw", 18608, BW);
}

// ---- RDMA-CM: librdmacm's programs and perftest's -R, between two processes. The
// server claims the first NIC (10.0.0.1), the client the second (10.0.0.2). ----

/// The first NIC's address on a served fabric.
const SERVER_IP: &str = "10.0.0.1";

/// perftest connecting through RDMA-CM (`-R`) to the server's address.
fn perftest_cm(prog: &str, port: u16, header: &str, extra: &[&str]) {
    let args: Vec<&str> = ["-R"].into_iter().chain(extra.iter().copied()).collect();
    perftest_to(prog, port, header, &args, SERVER_IP);
}

#[test]
fn perftest_ib_send_bw_over_rdma_cm() {
    perftest_cm("ib_send_bw", 18620, BW, &[]);
}
#[test]
fn perftest_ib_write_lat_over_rdma_cm() {
    perftest_cm("ib_write_lat", 18621, LAT, &[]);
}
#[test]
fn perftest_ib_send_bw_ud_over_rdma_cm() {
    perftest_cm("ib_send_bw", 18623, BW, &["-c", "UD"]);
}
#[test]
fn perftest_ib_read_bw_over_rdma_cm_on_four_qps() {
    perftest_cm("ib_read_bw", 18622, BW, &["-q", "4"]);
}

/// Both sides of an RDMA-CM program pair succeed and print `server_says` and
/// `client_says`.
fn cm_pair(name: &str, server: (&str, &[&str]), client: (&str, &[&str]), says: (&str, &str)) {
    need(server.0, "rdmacm-utils");
    let srv = Served::start(name);
    let (s, c) = srv.pair_of(server, client);
    for (side, o, want) in [("server", &s, says.0), ("client", &c, says.1)] {
        let t = text(o);
        assert!(o.status.success(), "{name} {side} failed:\n{t}");
        assert!(t.contains(want), "{name} {side} did not say {want:?}:\n{t}");
    }
    println!("{name}:\n{}", text(&c));
}

/// rping: 50 pings of 1 KiB, each a SEND of the buffer's keys, an RDMA READ by the server,
/// a SEND back and an RDMA WRITE, every ping's data verified at both ends (`-V`).
#[test]
fn rping_verifies_fifty_pings() {
    let server = ["-s", "-a", SERVER_IP, "-C", "50", "-S", "1024", "-V"];
    let client = ["-c", "-a", SERVER_IP, "-C", "50", "-S", "1024", "-V", "-v"];
    cm_pair(
        "rping",
        ("rping", &server),
        ("rping", &client),
        ("", "ping data: rdma-ping-49"),
    );
}

/// One of librdmacm's connection tests (`ucmatose`, `udaddy`): four connections from one
/// process to another, 20 messages each way on each, then disconnects.
fn four_connections(prog: &str) {
    let args = |side: &'static str| [side, SERVER_IP, "-c", "4", "-C", "20"];
    cm_pair(
        prog,
        (prog, &args("-b")),
        (prog, &args("-s")),
        ("return status 0", "return status 0"),
    );
}

/// ucmatose: RC connections.
#[test]
fn ucmatose_connects_four_times() {
    four_connections("ucmatose");
}

/// udaddy: datagram ids (`RDMA_PS_UDP`), whose connect resolves the server's UD QP (SIDR).
#[test]
fn udaddy_resolves_four_datagram_peers() {
    four_connections("udaddy");
}

/// mckey: both processes join a multicast group on their own NIC; the client sends 20
/// datagrams to the group, which the server receives. Datagrams sent before the server
/// joined would be lost, so the client starts once the server says it joined.
#[test]
fn mckey_sends_to_a_multicast_group() {
    need("mckey", "rdmacm-utils");
    let srv = Served::start("mckey");
    let server = srv.start_until(
        "mckey",
        &["-m", "224.0.0.9", "-b", SERVER_IP, "-C", "20"],
        "joined",
    );
    let mut cmd = srv.command("mckey");
    cmd.args(["-m", "224.0.0.9", "-b", "10.0.0.2", "-s", "-C", "20"]);
    let c = run(cmd, Duration::from_secs(60));
    let (status, server_out) = server.finish(Duration::from_secs(60));
    assert!(c.status.success(), "mckey client failed:\n{}", text(&c));
    assert!(status.success(), "mckey server failed:\n{server_out}");
    assert!(
        server_out.contains("return status 0"),
        "mckey server:\n{server_out}"
    );
    println!("mckey:\n{server_out}");
}

/// The exit status of `child` once it ends; panics after `limit`.
fn wait_status(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- libfabric's own verbs provider, over the verbs library ----

/// Debian's `fi_pingpong` through libfabric's verbs provider `prov` (`-e ep`) on ringbell
/// NICs: 100 round trips of 4 KiB, every message checked (`-c`). The verbs provider finds
/// the NICs through libibverbs and librdmacm, both answered by this library.
fn libfabric_verbs_pingpong(prov: &str, ep: &str, port: u16) {
    need("fi_pingpong", "libfabric-bin");
    let srv = Served::start(&format!("fi-verbs-{ep}"));
    let p = port.to_string();
    let common = ["-p", prov, "-e", ep, "-I", "100", "-S", "4096", "-c"];
    let server: Vec<&str> = common.iter().copied().chain(["-B", &p]).collect();
    let client: Vec<&str> = common
        .iter()
        .copied()
        .chain(["-P", &p, "127.0.0.1"])
        .collect();
    let (s, c) = srv.pair("fi_pingpong", &server, &client);
    for (side, o) in [("server", &s), ("client", &c)] {
        let t = text(o);
        assert!(
            o.status.success(),
            "fi_pingpong -p {prov} {side} failed:\n{t}"
        );
        // The result row: 4k, 100 sent, all 100 acknowledged.
        assert!(
            t.lines()
                .any(|l| l.split_whitespace().take(3).eq(["4k", "100", "=100"])),
            "fi_pingpong -p {prov} {side}: no result row:\n{t}"
        );
    }
    println!("fi_pingpong -p {prov} -e {ep}:\n{}", text(&c));
}

#[test]
fn libfabric_verbs_provider_datagrams() {
    libfabric_verbs_pingpong("verbs", "dgram", 18640);
}

/// RDM over the verbs provider's datagrams (`verbs;ofi_rxd`: libfabric's reliable
/// datagram layer).
#[test]
fn libfabric_verbs_provider_reliable_datagrams() {
    libfabric_verbs_pingpong("verbs;ofi_rxd", "rdm", 18641);
}

/// rdma_xserver and rdma_xclient in mode `mode`: `r`, RC, where the client sends inline
/// data on a QP that asked for no inline room, as mlx5's WQE room allows; `x`, XRC, where
/// the server's target QP and XRC SRQ are made in the library's XRC domain and the client
/// reads the SRQ number from the accept's private data in its id's `event`.
fn rdma_x(mode: &'static str) {
    cm_pair(
        &format!("rdma-x{mode}"),
        ("rdma_xserver", &["-c", mode]),
        ("rdma_xclient", &["-s", SERVER_IP, "-c", mode]),
        ("rdma_xserver: end 0", "rdma_xclient: end 0"),
    );
}

#[test]
fn rdma_xserver_and_rdma_xclient_over_rc() {
    rdma_x("r");
}

#[test]
fn rdma_xserver_and_rdma_xclient_over_xrc() {
    rdma_x("x");
}

/// rdma_server and rdma_client: the synchronous calls (`rdma_getaddrinfo`,
/// `rdma_create_ep`, `rdma_get_request`) and `<rdma/rdma_verbs.h>`'s helpers.
#[test]
fn rdma_server_and_rdma_client_exchange_a_message() {
    cm_pair(
        "rdma-client",
        ("rdma_server", &[]),
        ("rdma_client", &["-s", SERVER_IP]),
        ("rdma_server: end 0", "rdma_client: end 0"),
    );
}

// ---- rsockets: librdmacm's rsocket programs (rdmacm-utils), their `r*` calls answered by
// the library, between two processes; the server on the first NIC (10.0.0.1), the client
// on the second. ----

/// The line after the header (the one naming "usec/xfer") that librdmacm's example
/// programs print before their results (empty if none).
fn row_under_header(out: &str) -> String {
    out.lines()
        .skip_while(|l| !l.contains("usec/xfer"))
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

/// The result row `prog` prints under its header ("name bytes xfers iters total time
/// Gb/sec usec/xfer"): a custom test's (`-I`, `-C` or `-S` given) is named "custom".
fn stream_row(prog: &str, side: &str, out: &str) -> String {
    let row = row_under_header(out);
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert!(
        cols.len() == 8 && cols[0] == "custom" && cols[7].parse::<f64>().is_ok(),
        "{prog} {side}: no result row:\n{out}"
    );
    row
}

/// `prog` (`rstream` or `riostream`) between two processes: the server (bound to the
/// first NIC's address) listens before the client starts (it prints its result header
/// once it does), both run the custom test `args` (`-T` options among them) to the end
/// and print its row.
fn rsocket_stream(prog: &str, port: u16, args: &[&str]) {
    rsocket_stream_with(prog, port, args, None);
}

/// As [`rsocket_stream`], with `preload` (if given) as both programs' `LD_PRELOAD`.
fn rsocket_stream_with(prog: &str, port: u16, args: &[&str], preload: Option<String>) {
    need(prog, "rdmacm-utils");
    let mut srv = Served::start(&format!("{prog}-{port}"));
    if let Some(p) = preload {
        srv.env.push(("LD_PRELOAD", p));
    }
    let p = port.to_string();
    let server: Vec<&str> = ["-b", SERVER_IP, "-p", &p]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let client: Vec<&str> = ["-s", SERVER_IP, "-p", &p]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let t0 = Instant::now();
    let mut server = srv.start_until(prog, &server, "usec/xfer");
    let mut cmd = srv.command(prog);
    cmd.args(&client);
    let c = run(cmd, Duration::from_secs(120));
    if !c.status.success() {
        // A server left without its client would wait for it forever: it has 5 s to end
        // on its own, so that both outputs are shown.
        let t = Instant::now();
        while server.child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = server.child.kill();
    }
    let (status, server_out) = server.finish(Duration::from_secs(60));
    let wall = t0.elapsed();
    let client_out = text(&c);
    assert!(
        c.status.success() && status.success(),
        "{prog} {args:?} failed: server {status}, client {}\n--- server ---\n{server_out}\n\
         --- client ---\n{client_out}",
        c.status
    );
    let row = stream_row(prog, "client", &client_out);
    stream_row(prog, "server", &server_out);
    println!("{prog} {args:?} ({wall:.2?} wall):\n{row}");
}

/// rstream's default: non-blocking calls (`O_NONBLOCK`, `MSG_DONTWAIT`, retried on
/// EAGAIN); 100 messages of 64 KiB each way, every one checked (`-T v`).
#[test]
fn rstream_streams_verified_data_without_blocking() {
    rsocket_stream(
        "rstream",
        18650,
        &["-I", "1", "-C", "100", "-S", "65536", "-T", "v"],
    );
}

/// librdmacm's preload library, which turns a program's socket calls into rsocket calls.
const RSPRELOAD: &str = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";

/// `-T s`: rstream on plain sockets, made rsockets by `librspreload` preloaded after the
/// library (its `rsocket`, `rconnect`, ... are then the library's): the server's address
/// is a ringbell NIC's, which no interface of the host has, so only rsockets reach it.
#[test]
fn rstream_over_sockets_made_rsockets_by_librspreload() {
    assert!(
        Path::new(RSPRELOAD).exists(),
        "{RSPRELOAD} is missing: install Debian's librdmacm1 (.ci/run does)"
    );
    let preload = format!("{} {RSPRELOAD}", library().display());
    rsocket_stream_with(
        "rstream",
        18655,
        &["-I", "1", "-C", "100", "-S", "4096", "-T", "s", "-T", "v"],
        Some(preload),
    );
}

/// `-T b`: blocking calls (with `MSG_WAITALL`).
#[test]
fn rstream_streams_verified_data_blocking() {
    rsocket_stream(
        "rstream",
        18651,
        &["-I", "1", "-C", "100", "-S", "65536", "-T", "b", "-T", "v"],
    );
}

/// `-T a`: asynchronous, every call after an `rpoll` for it (the listener's accept, the
/// non-blocking connect's completion, each send and receive).
#[test]
fn rstream_streams_verified_data_driven_by_rpoll() {
    rsocket_stream(
        "rstream",
        18652,
        &["-I", "1", "-C", "100", "-S", "4096", "-T", "a", "-T", "v"],
    );
}

/// riostream: both sides `riomap` a buffer, the messages are `riowrite`s into the peer's
/// (the last byte of each round's last one a marker the peer spins on), 10 rounds of 100
/// messages of 4 KiB each way, checked (`-T v`).
#[test]
fn riostream_writes_into_the_peers_mapping() {
    rsocket_stream(
        "riostream",
        18654,
        &["-I", "10", "-C", "100", "-S", "4096", "-T", "v"],
    );
}

/// rcopy: the client sends a file of 1 MiB of random bytes (one `rsend` of the whole
/// mapped file) to the server, which receives it into a mapping of the destination file
/// in its own directory; the copy is compared byte for byte. The server runs until it is
/// killed.
#[test]
fn rcopy_copies_a_mebibyte_file() {
    need("rcopy", "rdmacm-utils");
    let srv = Served::start("rcopy");
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ringbell-rcopy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (from, to) = (base.join("from"), base.join("to"));
    std::fs::create_dir_all(&from).unwrap();
    std::fs::create_dir_all(&to).unwrap();
    // xorshift64*, seeded from the clock: different bytes every run.
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let data: Vec<u8> = (0..1 << 20)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect();
    let source = from.join("source.bin");
    std::fs::write(&source, &data).unwrap();
    let port = "18653";
    let mut server = srv
        .command("rcopy")
        .args(["-p", port])
        .current_dir(&to)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let dest = format!("{SERVER_IP}:copy.bin");
    let src = source.to_str().unwrap();
    let c = srv.client(("rcopy", &[src, &dest, "-p", port]));
    let _ = server.kill();
    let server_out = text(&server.wait_with_output().unwrap());
    let client_out = text(&c);
    assert!(
        c.status.success() && client_out.contains("1048576 bytes in"),
        "rcopy client failed ({}):\n{client_out}\n--- server ---\n{server_out}",
        c.status
    );
    let copy = std::fs::read(to.join("copy.bin")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&base);
    assert!(
        copy == data,
        "rcopy: the copy has {} bytes, {} of them as sent:\n{client_out}\n--- server ---\n\
         {server_out}",
        copy.len(),
        copy.iter().zip(&data).filter(|(a, b)| a == b).count()
    );
    // The server names the client by the address raccept gave: the second NIC's.
    assert!(
        server_out.contains("client: 10.0.0.2"),
        "rcopy server:\n{server_out}"
    );
    println!("rcopy:\n{client_out}\n--- server ---\n{server_out}");
}

/// udpong: datagram rsockets (`SOCK_DGRAM`, UDP's port space) between two processes. The
/// server, bound to the first NIC's address, answers each client's login, start and end
/// messages (and echoes its echo messages); it never exits, and is killed once the client
/// ends. The client `rconnect`s to the server, logs in (again every second until the
/// server answers: it may start before the server's socket is bound), sends 100 messages
/// of 1 KiB (with `-T e` each echoed and waited for) and prints its row: the messages the
/// server counted (datagrams may be dropped), or 200 with `-T e`.
fn udpong(port: u16, extra: &[&str]) {
    need("udpong", "rdmacm-utils");
    let srv = Served::start(&format!("udpong-{port}"));
    let p = port.to_string();
    // Line-buffered, so that what it printed survives its kill.
    let mut server = srv
        .command("stdbuf")
        .args(["-oL", "udpong", "-b", SERVER_IP, "-p", &p])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let client: Vec<&str> = ["-s", SERVER_IP, "-p", &p, "-C", "100", "-S", "1024"]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let t0 = Instant::now();
    // The client runs 300 ms after the server starts, and once more if it fails.
    let c = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let c = srv.client(("udpong", &client));
        if c.status.success() || server.try_wait().unwrap().is_some() {
            return c;
        }
        eprintln!(
            "udpong {extra:?}: the client failed ({}), again:\n{}",
            c.status,
            text(&c)
        );
        srv.client(("udpong", &client))
    }));
    let wall = t0.elapsed();
    let _ = server.kill();
    let server_out = text(&server.wait_with_output().unwrap());
    let c = c.unwrap_or_else(|p| {
        eprintln!("udpong {extra:?} server:\n{server_out}");
        std::panic::resume_unwind(p)
    });
    let client_out = text(&c);
    assert!(
        c.status.success(),
        "udpong {extra:?} client failed ({}):\n{client_out}\n--- server ---\n{server_out}",
        c.status
    );
    // "name bytes xfers total time Gb/sec usec/xfer", then the custom test's row.
    let row = row_under_header(&client_out);
    let cols: Vec<&str> = row.split_whitespace().collect();
    let xfers = cols.get(2).and_then(|x| x.parse::<u32>().ok()).unwrap_or(0);
    let echo = extra.contains(&"e");
    assert!(
        cols.len() == 7
            && cols[0] == "custom"
            && cols[1] == "1k"
            && cols[6].parse::<f64>().is_ok()
            && match echo {
                true => xfers == 200,
                false => (1..=100).contains(&xfers),
            },
        "udpong {extra:?}: no result row of 1 KiB messages, {} of them:\n{client_out}\n\
         --- server ---\n{server_out}",
        if echo { "200" } else { "1 to 100" }
    );
    // The server names the client by the source of its login: a NIC's address.
    assert!(
        server_out.contains("client login from 10.0.0."),
        "udpong {extra:?} server:\n{server_out}"
    );
    println!("udpong {extra:?} ({wall:.2?} wall):\n{row}\n--- server ---\n{server_out}");
}

/// udpong's custom test, plain (100 messages one way, the server's count returned) and
/// with `-T e` (each echoed): non-blocking calls (`O_NONBLOCK`), `rsend` on the client's
/// connected socket, `rrecvfrom` and `rsendto` on the server's.
#[test]
fn udpong_exchanges_datagrams() {
    udpong(18660, &[]);
    udpong(18661, &["-T", "e"]);
}

/// perftest's raw Ethernet programs between the two NICs' MAC addresses (no socket: the
/// server's flow rule catches the client's frames). The client starts once the server has
/// printed its result header (its rule is in place; its receives follow at once); a client
/// whose frames still came too early (the server has not finished 20 s after it) runs
/// again, up to three times.
fn raw_perftest(prog: &str, header: &str) {
    need(prog, "perftest");
    let srv = Served::start(&format!("{prog}-raw"));
    let (m0, m1) = ("02:00:00:00:00:01", "02:00:00:00:00:02");
    // Line-buffered, so that the header shows when it is printed.
    let mut server = srv.start_until(
        prog,
        &["-d", "rb0", "-B", m0, "-E", m1, "--server", "-n", "200"],
        header,
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut client = None;
    for _ in 0..3 {
        let mut cmd = srv.command(prog);
        cmd.args(["-d", "rb1", "-B", m1, "-E", m0, "--client", "-n", "200"]);
        client = Some(run(cmd, Duration::from_secs(60)));
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) && server.child.try_wait().unwrap().is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
        if server.child.try_wait().unwrap().is_some() {
            break;
        }
    }
    let c = client.unwrap();
    assert!(
        server.child.try_wait().unwrap().is_some(),
        "{prog} server never finished:\n{}",
        server.head
    );
    let (status, server_out) = server.finish(Duration::from_secs(5));
    assert!(status.success(), "{prog} server failed:\n{server_out}");
    assert!(c.status.success(), "{prog} client failed:\n{}", text(&c));
    for (side, out) in [("server", server_out.clone()), ("client", text(&c))] {
        println!("{prog} {side}: {}", result_row(prog, &out, header));
    }
}

#[test]
fn perftest_raw_ethernet_bw() {
    raw_perftest("raw_ethernet_bw", BW);
}
#[test]
fn perftest_raw_ethernet_lat() {
    raw_perftest("raw_ethernet_lat", LAT);
}

/// ibverbs-utils' pingpongs with data validation (`-c`), between two processes, with
/// `extra` options at both ends.
fn pingpong(prog: &str, port: u16, extra: &[&str]) {
    need(prog, "ibverbs-utils");
    let srv = Served::start(&format!("{prog}-{port}"));
    let p = port.to_string();
    let server: Vec<&str> = ["-d", "rb0", "-g", "0", "-n", "200", "-c", "-p", &p]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let client: Vec<&str> = ["-d", "rb1", "-g", "0", "-n", "200", "-c", "-p", &p]
        .into_iter()
        .chain(extra.iter().copied())
        .chain(["localhost"])
        .collect();
    let (s, c) = srv.pair(prog, &server, &client);
    for (side, o) in [("server", &s), ("client", &c)] {
        let t = text(o);
        assert!(o.status.success(), "{prog} {side} failed:\n{t}");
        assert!(t.contains("200 iters in"), "{prog} {side}:\n{t}");
        assert!(
            !t.contains("Invalid data"),
            "{prog} {side} saw corrupted data:\n{t}"
        );
    }
    println!("{prog}:\n{}", text(&c));
}

#[test]
fn ibv_rc_pingpong_validates_data() {
    pingpong("ibv_rc_pingpong", 18611, &[]);
}

/// `ibv_xsrq_pingpong`: an XRC initiator and target each way, the messages to the peer's
/// XRC SRQ.
#[test]
fn ibv_xsrq_pingpong_succeeds() {
    let prog = "ibv_xsrq_pingpong";
    need(prog, "ibverbs-utils");
    let srv = Served::start(&format!("{prog}-18633"));
    let server = ["-d", "rb0", "-g", "0", "-n", "50", "-p", "18633"];
    let client = [
        "-d",
        "rb1",
        "-g",
        "0",
        "-n",
        "50",
        "-p",
        "18633",
        "localhost",
    ];
    let (s, c) = srv.pair(prog, &server, &client);
    for (side, o) in [("server", &s), ("client", &c)] {
        let t = text(o);
        assert!(o.status.success(), "{prog} {side} failed:\n{t}");
        assert!(t.lines().any(|l| l == "success"), "{prog} {side}:\n{t}");
    }
}

#[test]
fn ibv_srq_pingpong_validates_data() {
    pingpong("ibv_srq_pingpong", 18612, &[]);
}

#[test]
fn ibv_ud_pingpong_validates_data() {
    pingpong("ibv_ud_pingpong", 18613, &[]);
}

#[test]
fn ibv_uc_pingpong_validates_data() {
    pingpong("ibv_uc_pingpong", 18618, &[]);
}

/// `-e`: each side sleeps in `ibv_get_cq_event` and polls at most two completions per
/// event (one, for the SRQ's), re-arming before it polls; a served NIC can take the arm
/// after the CI the program wrote later, and must still wake it for what waits.
#[test]
fn ibv_rc_pingpong_sleeps_on_completion_events() {
    pingpong("ibv_rc_pingpong", 18627, &["-e"]);
}

#[test]
fn ibv_srq_pingpong_sleeps_on_completion_events() {
    pingpong("ibv_srq_pingpong", 18628, &["-e"]);
}

#[test]
fn ibv_ud_pingpong_sleeps_on_completion_events() {
    pingpong("ibv_ud_pingpong", 18629, &["-e"]);
}

#[test]
fn ibv_uc_pingpong_sleeps_on_completion_events() {
    pingpong("ibv_uc_pingpong", 18630, &["-e"]);
}

#[test]
fn ibv_devinfo_shows_the_device_port_and_tag_matching() {
    need("ibv_devinfo", "ibverbs-utils");
    let mut cmd = Command::new("ibv_devinfo");
    cmd.args(["-d", "rb0", "-v"])
        .env("LD_PRELOAD", library())
        .env_remove("RINGBELL_SERVE");
    let o = run(cmd, Duration::from_secs(30));
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for want in [
        "hca_id:\trb0",
        "vendor_id:\t\t\t0x1de5",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tEthernet",
        "max_num_tags:\t\t\t1024",
        "IBV_TM_CAP_RC",
        "GID[  0]:\t\t::ffff:10.0.0.1, RoCE v2",
    ] {
        assert!(t.contains(want), "ibv_devinfo lacks {want:?}:\n{t}");
    }
}

/// rdma-core 44's Python suite (shipped gzipped under /usr/share/doc/rdma-core/tests),
/// copied to a scratch directory `name` and unpacked.
fn rdma_core_tests(name: &str) -> PathBuf {
    let installed = Path::new("/usr/share/doc/rdma-core/tests");
    assert!(
        installed.join("run_tests.py").exists(),
        "rdma-core's tests are missing: install the Debian packages rdma-core and python3-pyverbs"
    );
    need("/usr/bin/python3", "python3");
    let dir = std::env::temp_dir().join(format!("ringbell-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let st = Command::new("cp")
        .arg("-r")
        .arg(installed)
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    let gz: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gz"))
        .collect();
    if !gz.is_empty() {
        let st = Command::new("gunzip").args(&gz).status().unwrap();
        assert!(st.success());
    }
    dir
}

/// The same suite against the two NICs of a `ringbell-emu serve` (over vfio-user): it
/// passes whole. Its `test_multi_process_alloc_dm` has five children of `fork` issue
/// commands on their parent's context at once, which share the served device with it (and
/// the socket): the driver serializes them as the kernel serializes a shared context's.
#[test]
fn rdma_core_test_suite_passes_on_a_served_nic() {
    let dir = rdma_core_tests("rdma-core-served");
    let srv = Served::start("rdma-core-served");
    let mut cmd = srv.command("/usr/bin/python3");
    cmd.current_dir(&dir)
        .args(["run_tests.py", "--dev", "rb0"])
        .env_remove("RINGBELL_NICS");
    let o = run(cmd, Duration::from_secs(600));
    let t = text(&o);
    let _ = std::fs::remove_dir_all(&dir);
    let summary = t
        .lines()
        .rev()
        .find(|l| l.starts_with("OK") || l.starts_with("FAILED"));
    assert!(
        o.status.success() && summary.is_some_and(|l| l.starts_with("OK")),
        "rdma-core suite on a served NIC failed ({summary:?}):\n{t}"
    );
    println!("rdma-core tests against a served rb0: {summary:?}");
}

/// rdma-core's suite against rb0 of the library's in-process fabric.
#[test]
fn rdma_core_test_suite_passes_on_rb0() {
    let dir = rdma_core_tests("rdma-core-tests");
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.current_dir(&dir)
        .args(["run_tests.py", "--dev", "rb0", "-v"])
        .env("LD_PRELOAD", library())
        .env_remove("RINGBELL_SERVE");
    let o = run(cmd, Duration::from_secs(600));
    let t = text(&o);
    let _ = std::fs::remove_dir_all(&dir);
    // Per file: passed / skipped / failed (errors count as failures).
    let mut per_file: std::collections::BTreeMap<String, [u32; 3]> = Default::default();
    // `-v` prints "name (tests.<file>.<Class>.<name>)", a docstring line for some, and the
    // outcome after " ... ".
    let mut file = String::new();
    for line in t.lines() {
        if let Some((_, rest)) = line.split_once(" (tests.") {
            file = rest.split('.').next().unwrap_or_default().to_string();
        }
        let slot = if line.ends_with("... ok") {
            0
        } else if line.contains("... skipped") {
            1
        } else if line.ends_with("... ERROR") || line.ends_with("... FAIL") {
            2
        } else {
            continue;
        };
        per_file.entry(file.clone()).or_default()[slot] += 1;
    }
    let mut total = [0u32; 3];
    println!(
        "{:<28} {:>6} {:>7} {:>6}",
        "file", "passed", "skipped", "failed"
    );
    for (f, c) in &per_file {
        println!("{f:<28} {:>6} {:>7} {:>6}", c[0], c[1], c[2]);
        for i in 0..3 {
            total[i] += c[i];
        }
    }
    println!(
        "rdma-core tests against rb0: {} passed, {} skipped, {} failed",
        total[0], total[1], total[2]
    );
    let summary = t
        .lines()
        .rev()
        .find(|l| l.starts_with("OK") || l.starts_with("FAILED"));
    assert!(
        o.status.success() && total[2] == 0,
        "rdma-core suite failed ({summary:?}):\n{t}"
    );
    // What a device with ringbell's capabilities must run, not skip (UD QPs and address
    // handles included: test_addr, the UD tests of test_qp, test_qpex, test_cqex,
    // test_cq_events and test_relaxed_ordering; UC QPs: five tests of test_qp; parent
    // domains: five of test_parent_domain, the sixth needing huge pages; ATOMIC WRITE:
    // test_qp_ex_rc_atomic_write; imported objects: test_shared_pd, and test_import_dm in
    // test_device; XRC: two of test_atomic, test_qpex, test_relaxed_ordering and
    // test_cqex, and test_odp_xrc_traffic; raw packet QPs: test_qp's raw tests, test_flow's
    // five, and RSS: test_rss_traffic; completion timestamps in real time: the two
    // real-time tests of test_mlx5_timestamp, which need no mlx5 device).
    for (file, at_least) in [
        ("test_device", 10),
        ("test_pd", 4),
        ("test_addr", 3),
        ("test_cq", 4),
        ("test_cqex", 5),
        ("test_odp", 15),
        ("test_cq_events", 2),
        ("test_mr", 1),
        ("test_qp", 26),
        ("test_flow", 5),
        ("test_rss_traffic", 1),
        ("test_mlx5_timestamp", 2),
        ("test_qpex", 20),
        ("test_atomic", 9),
        ("test_tag_matching", 4),
        ("test_relaxed_ordering", 3),
        ("test_parent_domain", 5),
        ("test_shared_pd", 1),
    ] {
        let passed = per_file.get(file).map_or(0, |c| c[0]);
        assert!(
            passed >= at_least,
            "{file}: {passed} passed, {at_least} expected:\n{t}"
        );
    }
}

/// `ucx_perftest` between two processes on one server, over the transports `tls` (RC for
/// the data, UD for UCX's own connection set-up, or UD alone): both ends finish the run
/// and the client prints its final figures.
fn ucx_perftest(test: &str, tls: &str, port: u16) {
    need("ucx_perftest", "ucx-utils");
    let mut srv = Served::start(&format!("ucx-{test}-{port}"));
    let p = port.to_string();
    // 4 KiB messages; an atomic's operand is 8 bytes.
    let atomic = ["add", "swap"].iter().any(|a| test.contains(a));
    let size = if atomic { "8" } else { "4096" };
    let args = ["-t", test, "-n", "1000", "-s", size, "-p", &p];
    let client: Vec<&str> = args.iter().copied().chain(["127.0.0.1"]).collect();
    // UCX may use only these transports, so the run goes through ringbell's NICs or not at
    // all.
    srv.env.push(("UCX_TLS", tls.to_string()));
    let (s, c) = srv.pair("ucx_perftest", &args, &client);
    for (side, o) in [("server", &s), ("client", &c)] {
        assert!(
            o.status.success(),
            "ucx_perftest -t {test} ({tls}) {side} failed:\n{}",
            text(o)
        );
    }
    let out = text(&c);
    let last = out.lines().find(|l| l.starts_with("Final:"));
    assert!(
        last.is_some(),
        "ucx_perftest -t {test}: no final line:\n{out}"
    );
    println!(
        "ucx_perftest -t {test} over {tls}: {}",
        last.unwrap_or_default()
    );
}

#[test]
fn ucx_perftest_tag_latency_over_rc() {
    ucx_perftest("tag_lat", "rc_verbs,ud_verbs", 18621);
}

#[test]
fn ucx_perftest_tag_bandwidth_over_rc() {
    ucx_perftest("tag_bw", "rc_verbs,ud_verbs", 18622);
}

#[test]
fn ucx_perftest_put_get_and_atomics_over_rc() {
    ucx_perftest("ucp_put_bw", "rc_verbs,ud_verbs", 18623);
    ucx_perftest("ucp_get", "rc_verbs,ud_verbs", 18624);
    ucx_perftest("ucp_fadd", "rc_verbs,ud_verbs", 18626);
}

#[test]
fn ucx_perftest_tag_latency_over_ud() {
    ucx_perftest("tag_lat", "ud_verbs", 18625);
}

/// An Open MPI launcher (`mpirun`, `oshrun`) starting `ranks` processes on `srv`'s NICs
/// over the UCX PML with one-sided component `osc`: each rank loads the library and claims
/// its own NIC, and UCX may use ringbell's RC and UD only (and `self`, a rank to itself),
/// so the job runs over ringbell or not at all. The caller adds the program and its
/// arguments.
fn ucx_launcher(launcher: &str, srv: &Served, ranks: usize, osc: &str) -> Command {
    let mut cmd = Command::new(launcher);
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &ranks.to_string(),
    ])
    .args(["--mca", "pml", "ucx", "--mca", "osc", osc])
    .args(["-x", "LD_PRELOAD", "-x", "RINGBELL_SERVE", "-x", "UCX_TLS"])
    .env("LD_PRELOAD", library())
    .env("RINGBELL_SERVE", &srv.dir)
    .env("UCX_TLS", "rc_verbs,ud_verbs,self")
    .env_remove("RINGBELL_NIC");
    cmd
}

/// Open MPI 4.1's UCX PML (`--mca pml ucx`, which Debian's configuration turns off by
/// default) on four ranks, each claiming its own NIC of one server: the MPI programs of the
/// libfabric provider's tests (`ofi/tests/mpi`), checking their own results.
#[test]
fn open_mpi_over_ucx_on_four_ranks() {
    need("mpirun", "openmpi-bin");
    need("mpicc", "libopenmpi-dev");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ofi/tests/mpi");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ringbell-ucx-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let srv = Served::start_nodes("ucx-mpi", 4);
    for prog in ["ring", "wildcard", "collectives", "large", "probe"] {
        let mut cc = Command::new("mpicc");
        cc.args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(out.join(prog))
            .arg(src.join(format!("{prog}.c")));
        let o = run(cc, Duration::from_secs(120));
        assert!(o.status.success(), "mpicc {prog}.c:\n{}", text(&o));
        let mut cmd = ucx_launcher("mpirun", &srv, 4, "^ucx");
        cmd.arg(out.join(prog));
        let o = run(cmd, Duration::from_secs(300));
        let t = text(&o);
        assert!(o.status.success(), "{prog} over UCX failed:\n{t}");
        let want = format!("{prog} ok: 4 ranks");
        let line = t.lines().find(|l| l.starts_with(&want));
        assert!(line.is_some(), "{prog}: no '{want}' line:\n{t}");
        println!("{}", line.unwrap_or_default());
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// MPI one-sided communication (`tests/mpi/rma.c`: puts, gets, fetch-and-op and accumulate,
/// checked by every rank) through Open MPI's UCX one-sided component (`--mca osc ucx`) on
/// four ranks: RDMA WRITEs, READs and atomics of ringbell's RC QPs.
#[test]
fn open_mpi_one_sided_over_ucx_on_four_ranks() {
    need("mpirun", "openmpi-bin");
    need("mpicc", "libopenmpi-dev");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mpi/rma.c");
    let exe = std::env::temp_dir().join(format!("ringbell-rma-{}", std::process::id()));
    let mut cc = Command::new("mpicc");
    cc.args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src);
    let o = run(cc, Duration::from_secs(120));
    assert!(o.status.success(), "mpicc rma.c:\n{}", text(&o));
    let srv = Served::start_nodes("ucx-rma", 4);
    let mut cmd = ucx_launcher("mpirun", &srv, 4, "ucx");
    cmd.arg(&exe);
    let o = run(cmd, Duration::from_secs(300));
    let t = text(&o);
    let _ = std::fs::remove_file(&exe);
    assert!(o.status.success(), "MPI one-sided over UCX failed:\n{t}");
    let line = t.lines().find(|l| l.starts_with("rma ok: 4 ranks"));
    assert!(line.is_some(), "no 'rma ok: 4 ranks' line:\n{t}");
    println!("{}", line.unwrap_or_default());
}

/// OpenSHMEM: Open MPI's OSHMEM with its UCX SPML on four PEs, each claiming its own NIC of
/// one server (`tests/shmem/check.c`: puts, gets and atomics checked by every PE).
/// `--mca memory ^patcher`: Debian's Open MPI 4.1.4 otherwise crashes in `shmem_finalize`
/// (a memory-release hook of a component already closed), over TCP without ringbell too.
#[test]
fn openshmem_over_ucx_on_four_pes() {
    need("oshrun", "openmpi-bin");
    need("oshcc", "libopenmpi-dev");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/shmem/check.c");
    let exe = std::env::temp_dir().join(format!("ringbell-shmem-{}", std::process::id()));
    let mut cc = Command::new("oshcc");
    cc.args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src);
    let o = run(cc, Duration::from_secs(120));
    assert!(o.status.success(), "oshcc check.c:\n{}", text(&o));
    let srv = Served::start_nodes("shmem", 4);
    let mut cmd = ucx_launcher("oshrun", &srv, 4, "^ucx");
    cmd.args(["--mca", "spml", "ucx", "--mca", "memory", "^patcher"])
        .arg(&exe);
    let o = run(cmd, Duration::from_secs(300));
    let t = text(&o);
    let _ = std::fs::remove_file(&exe);
    assert!(o.status.success(), "OpenSHMEM over UCX failed:\n{t}");
    let line = t.lines().find(|l| l.starts_with("shmem ok: 4 PEs"));
    assert!(line.is_some(), "no 'shmem ok: 4 PEs' line:\n{t}");
    println!("{}", line.unwrap_or_default());
}

/// UCX's connection managers: a UCP client and server (`tests/ucx/sockaddr.c`, built here
/// against Debian's libucx-dev) meet at the server NIC's socket address through UCX's
/// rdmacm connection manager, over the library's RDMA-CM (its event channel's descriptor
/// woken by the library's progress thread), then exchange 100 checked messages each way
/// over the transports UCX picked. (UCX_SOCKADDR_TLS_PRIORITY=rdmacm: UCX's TCP manager
/// would try to listen on the NIC's address, which no interface of the host has.)
#[test]
fn ucx_client_and_server_meet_through_rdma_cm() {
    need("cc", "gcc");
    assert!(
        Path::new("/usr/include/ucp/api/ucp.h").exists(),
        "UCX's headers are missing: install Debian's libucx-dev (.ci/run does)"
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ucx/sockaddr.c");
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ringbell-ucx-sockaddr-{}", std::process::id()));
    let mut cc = Command::new("cc");
    cc.args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(["-lucp", "-lucs"]);
    let o = run(cc, Duration::from_secs(120));
    assert!(o.status.success(), "cc sockaddr.c:\n{}", text(&o));
    let mut srv = Served::start("ucx-sockaddr");
    srv.env
        .push(("UCX_SOCKADDR_TLS_PRIORITY", "rdmacm".to_string()));
    let exe_s = exe.to_str().unwrap_or_default();
    let server = srv.start_until(exe_s, &["-s", SERVER_IP], "listening");
    let mut cmd = srv.command(exe_s);
    cmd.args(["-c", SERVER_IP]);
    let c = run(cmd, Duration::from_secs(120));
    let (status, server_out) = server.finish(Duration::from_secs(60));
    let client_out = text(&c);
    let _ = std::fs::remove_file(&exe);
    assert!(
        c.status.success() && status.success(),
        "client {}, server {status}\n--- client ---\n{client_out}\n--- server ---\n{server_out}",
        c.status
    );
    assert!(
        client_out.contains("client: 100 exchanges of 4096 bytes ok"),
        "{client_out}"
    );
    assert!(
        server_out.contains("server: 100 exchanges of 4096 bytes ok"),
        "{server_out}"
    );
}

/// What NetPIPE's integrity run (`NPopenmpi -i`) printed: every size it sent checked, at
/// least `min` of them, none failed. Panics with the output otherwise.
fn netpipe_checked(out: &str, min: usize) -> usize {
    let sizes: Vec<&str> = out.lines().filter(|l| l.contains("-->")).collect();
    let bad: Vec<&&str> = sizes
        .iter()
        .filter(|l| !l.ends_with("Integrity check passed"))
        .collect();
    assert!(
        sizes.len() >= min && bad.is_empty(),
        "NetPIPE: {} sizes, {} not passed:\n{out}",
        sizes.len(),
        bad.len()
    );
    sizes.len()
}

/// NetPIPE (Debian's netpipe-openmpi), unmodified: its integrity check of every message size
/// from 1 byte to 1 MiB (with perturbations) between two ranks, over Open MPI's UCX PML.
#[test]
fn netpipe_integrity_over_ucx() {
    need("NPopenmpi", "netpipe-openmpi");
    need("mpirun", "openmpi-bin");
    let srv = Served::start("netpipe");
    let dir = std::env::temp_dir().join(format!("ringbell-netpipe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = ucx_launcher("mpirun", &srv, 2, "^ucx");
    cmd.args(["NPopenmpi", "-i", "-u", "1048576", "-o"])
        .arg(dir.join("np.out"))
        .current_dir(&dir);
    let o = run(cmd, Duration::from_secs(300));
    let t = text(&o);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success(), "NetPIPE over UCX failed:\n{t}");
    println!("NetPIPE over UCX: {} sizes passed", netpipe_checked(&t, 30));
}
