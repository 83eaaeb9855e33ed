//! A NIC per process on a served fabric: with `RINGBELL_SERVE` and no `RINGBELL_NIC`, a
//! process claims the first NIC whose `nic{i}.lock` it can `flock` and offers only that NIC
//! (`fi_info -p ringbell`, Debian's libfabric-bin, run as a user would). Locks held by helper
//! processes stand for other programs; `RINGBELL_NIC` (a NIC, or `all`) still wins.

mod common;

use ringbell_fi::claim::lock_path;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// Another process holding NIC `i`'s lock file (a shell that locks it with `flock(1)` and
/// sleeps), until dropped.
struct Holder(Child);

impl Holder {
    fn hold(dir: &Path, i: usize) -> Holder {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("exec 9>>\"$0\" && flock -n 9 && echo held && exec sleep 600")
            .arg(lock_path(dir, i))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "held", "could not lock NIC {i}");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
/// The domains of the RDM offers `fi_info -p ringbell` lists (a NIC's datagram offer names
/// the same domain), and whether it succeeded.
fn domains(prov: &Path, serve: &Path, nic: Option<&str>) -> (bool, Vec<String>) {
    assert!(
        Command::new("fi_info").arg("--version").output().is_ok(),
        "fi_info is missing: install Debian's libfabric-bin (.ci/run does)"
    );
    let mut cmd = Command::new("timeout");
    cmd.args(["30", "fi_info", "-p", "ringbell", "-t", "FI_EP_RDM"])
        .env("FI_PROVIDER_PATH", prov)
        .env("RINGBELL_SERVE", serve)
        .env_remove("RINGBELL_NIC")
        .env_remove("FI_PROVIDER");
    if let Some(n) = nic {
        cmd.env("RINGBELL_NIC", n);
    }
    let o = cmd.output().unwrap();
    let doms = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("domain: ").map(str::to_string))
        .collect();
    (o.status.success(), doms)
}

#[test]
fn each_process_offers_the_first_nic_it_can_lock() {
    let served = common::Served::start_nodes("claim", 3);
    let prov = common::provider_dir("claim");
    let dir = &served.dir;
    // Nothing claimed: NIC 0 (the fi_info process's lock ends with it).
    assert_eq!(domains(&prov, dir, None), (true, vec!["rb0".to_string()]));
    assert_eq!(domains(&prov, dir, None), (true, vec!["rb0".to_string()]));
    let c0 = Holder::hold(dir, 0);
    assert_eq!(domains(&prov, dir, None), (true, vec!["rb1".to_string()]));
    let c1 = Holder::hold(dir, 1);
    assert_eq!(domains(&prov, dir, None), (true, vec!["rb2".to_string()]));
    // RINGBELL_NIC wins over the locks.
    assert_eq!(
        domains(&prov, dir, Some("0")),
        (true, vec!["rb0".to_string()])
    );
    let c2 = Holder::hold(dir, 2);
    // Every NIC taken: no offer (fi_info fails with no data).
    let (ok, doms) = domains(&prov, dir, None);
    assert!(!ok && doms.is_empty(), "{doms:?}");
    // RINGBELL_NIC=all: every NIC, claimed or not.
    let all = ["rb0", "rb1", "rb2"].map(String::from).to_vec();
    assert_eq!(domains(&prov, dir, Some("all")), (true, all));
    // A released claim is free again.
    drop(c1);
    assert_eq!(domains(&prov, dir, None), (true, vec!["rb1".to_string()]));
    drop((c0, c2));
}
