//! Debian's `fi_pingpong` (libfabric-bin), unmodified, between two processes over the
//! provider: each on its own NIC of one `ringbell-emu serve` (`RINGBELL_NIC`), reliable
//! datagram endpoints (`-e rdm`), its default, datagram endpoints (no `-e`), and connected
//! endpoints (`-e msg`), message transfers, data checked (`-c`). libfabric
//! programs run under `timeout`: a provider fault can leave them hanging.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

fn need_fi_pingpong() {
    assert!(
        Command::new("fi_pingpong").arg("-h").output().is_ok(),
        "fi_pingpong is missing: install Debian's libfabric-bin (.ci/run does)"
    );
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a server and a client `fi_pingpong -p ringbell -e rdm ARGS` on NICs 0 and 1 and
/// returns both outputs.
fn pingpong(name: &str, port: u16, args: &[&str]) -> (Output, Output) {
    pingpong_on(name, port, &["-e", "rdm"], args)
}

/// As [`pingpong`], with `ep` (`-e TYPE`, or nothing for fi_pingpong's default) before
/// `args`.
fn pingpong_on(name: &str, port: u16, ep: &[&str], args: &[&str]) -> (Output, Output) {
    need_fi_pingpong();
    let served = common::Served::start(name);
    let prov = common::provider_dir(name);
    let port = port.to_string();
    let cmd = |nic: &str| {
        let mut c = Command::new("timeout");
        c.args(["120", "fi_pingpong", "-p", "ringbell"])
            .args(ep)
            .args(args)
            .env("FI_PROVIDER_PATH", &prov)
            .env("RINGBELL_SERVE", &served.dir)
            .env("RINGBELL_NIC", nic)
            .env_remove("FI_PROVIDER")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let server = cmd("0").args(["-B", &port]).spawn().unwrap();
    // The client's control connection is retried by fi_pingpong itself for a while; give
    // the server a moment to listen.
    std::thread::sleep(Duration::from_millis(500));
    let client = cmd("1")
        .args(["-P", &port, "127.0.0.1"])
        .spawn()
        .unwrap()
        .wait_with_output()
        .unwrap();
    let server = server.wait_with_output().unwrap();
    (server, client)
}

/// The lines of fi_pingpong's table: `(bytes, sent, acked)`.
fn rows(o: &Output) -> Vec<(String, u64, String)> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .skip_while(|l| !l.starts_with("bytes"))
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.parse().ok()?,
                f.get(2)?.to_string(),
            ))
        })
        .collect()
}

/// Both sides succeeded and printed a row for every size up to `largest` (at least `min`
/// rows), each with 10 messages sent and acknowledged.
fn every_size(s: &Output, c: &Output, min: usize, largest: &str) {
    assert!(s.status.success(), "server failed:\n{}", text(s));
    assert!(c.status.success(), "client failed:\n{}", text(c));
    for o in [s, c] {
        let r = rows(o);
        assert!(r.len() >= min, "every size ran:\n{}", text(o));
        assert!(
            r.iter().all(|(_, sent, ack)| *sent == 10 && ack == "=10"),
            "{}",
            text(o)
        );
        assert!(r.iter().any(|(b, _, _)| b == largest), "{}", text(o));
    }
}

/// Both sides succeeded with one row: 500 messages of 64 bytes.
fn five_hundred_small(s: &Output, c: &Output) {
    assert!(s.status.success(), "server failed:\n{}", text(s));
    assert!(c.status.success(), "client failed:\n{}", text(c));
    for o in [s, c] {
        assert_eq!(
            rows(o),
            [("64".to_string(), 500, "=500".to_string())],
            "{}",
            text(o)
        );
    }
}

fn port(offset: u16) -> u16 {
    // Distinct control ports per test process and test, below Linux's ephemeral range
    // (32768 and up), where another program's outgoing connection could hold the number.
    20000 + (std::process::id() % 1500) as u16 * 8 + offset
}

#[test]
fn fi_pingpong_rdm_every_size_checked() {
    let (s, c) = pingpong("all", port(0), &["-I", "10", "-S", "all", "-c"]);
    // 0, 1, 2, 3, 4, 6, 8, ... up to the largest size fi_pingpong tries.
    every_size(&s, &c, 40, "1m");
}

#[test]
fn fi_pingpong_rdm_many_small_messages() {
    let (s, c) = pingpong("small", port(1), &["-I", "500", "-S", "64", "-c"]);
    five_hundred_small(&s, &c);
}

#[test]
fn fi_pingpong_rdm_tagged_every_size_checked() {
    let (s, c) = pingpong(
        "tagged",
        port(2),
        &["-m", "tagged", "-I", "10", "-S", "all", "-c"],
    );
    every_size(&s, &c, 40, "1m");
}

#[test]
fn fi_pingpong_rdm_tagged_many_small_messages() {
    let (s, c) = pingpong(
        "tsmall",
        port(3),
        &["-m", "tagged", "-I", "500", "-S", "64", "-c"],
    );
    five_hundred_small(&s, &c);
}

/// fi_pingpong's default endpoint type is `FI_EP_DGRAM`: the plain command line works, every
/// size up to one packet (4096 bytes, the offer's `max_msg_size`) checked.
#[test]
fn fi_pingpong_default_dgram_every_size_checked() {
    let (s, c) = pingpong_on("dgram", port(4), &[], &["-I", "10", "-S", "all", "-c"]);
    every_size(&s, &c, 20, "4k");
    for o in [&s, &c] {
        assert_eq!(
            rows(o).last().map(|x| x.0.clone()),
            Some("4k".into()),
            "{}",
            text(o)
        );
    }
}

#[test]
fn fi_pingpong_dgram_many_small_messages() {
    let (s, c) = pingpong_on(
        "dsmall",
        port(5),
        &["-e", "dgram"],
        &["-I", "500", "-S", "64", "-c"],
    );
    five_hundred_small(&s, &c);
}

/// A datagram is one packet: asking for more than 4096 bytes finds no datagram endpoint.
#[test]
fn fi_pingpong_dgram_larger_than_a_packet_is_refused() {
    let (s, c) = pingpong_on("dbig", port(6), &["-e", "dgram"], &["-S", "5000"]);
    assert!(!s.status.success() && !c.status.success());
    assert!(
        text(&s).contains("fi_getinfo") || text(&c).contains("fi_getinfo"),
        "{}{}",
        text(&s),
        text(&c)
    );
}

/// Connected endpoints: a passive endpoint, a connection request accepted, every size.
#[test]
fn fi_pingpong_msg_every_size_checked() {
    let (s, c) = pingpong_on(
        "msg",
        port(7),
        &["-e", "msg"],
        &["-I", "10", "-S", "all", "-c"],
    );
    every_size(&s, &c, 40, "1m");
}
