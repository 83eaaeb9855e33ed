//! Debian's libfabric 1.17, unmodified, loads `libringbell_fi.so` from `FI_PROVIDER_PATH` and
//! lists its offers: `fi_info` (libfabric-bin) is run as a user would run it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The build directory of this test (target/<profile>).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// A directory holding the provider under the name libfabric's convention gives it (made
/// once per test process).
fn provider_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(make_provider_dir).clone()
}

fn make_provider_dir() -> PathBuf {
    let dir = profile_dir();
    let lib = [dir.join("deps"), dir.clone()]
        .into_iter()
        .map(|d| d.join("libringbell_fi.so"))
        .find(|p| p.exists())
        .expect("libringbell_fi.so was not built");
    let out =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ringbell-fi-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let link = out.join("libringbell-fi.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).unwrap();
    out
}

/// Runs `fi_info ARGS` with the provider on the path and `env` set; libfabric programs run
/// under `timeout` (a provider fault inside fi_getinfo can leave them hanging).
fn fi_info(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    assert!(
        Command::new("fi_info").arg("--version").output().is_ok(),
        "fi_info is missing: install Debian's libfabric-bin (.ci/run does)"
    );
    let mut cmd = Command::new("timeout");
    cmd.arg("30").arg("fi_info").args(args);
    cmd.env("FI_PROVIDER_PATH", dir);
    for k in [
        "RINGBELL_SERVE",
        "RINGBELL_NICS",
        "FI_PROVIDER",
        "FI_LOG_LEVEL",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running fi_info")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn fi_info_lists_the_provider_and_its_rdm_dgram_and_msg_offers_per_nic() {
    let dir = provider_dir();
    let l = fi_info(&dir, &["-l"], &[]);
    assert!(l.status.success());
    assert!(
        text(&l).contains("ringbell:\n    version: 0.1"),
        "{}",
        text(&l)
    );

    let o = fi_info(&dir, &["-p", "ringbell"], &[]);
    assert!(o.status.success(), "{o:?}");
    let t = text(&o);
    assert_eq!(t.matches("provider: ringbell\n").count(), 6, "{t}");
    // Per NIC, in order: its RDM offer, then its datagram and connected ones.
    let offers: Vec<(&str, &str)> = t
        .lines()
        .filter_map(|l| l.trim().strip_prefix("domain: "))
        .zip(t.lines().filter_map(|l| l.trim().strip_prefix("type: ")))
        .collect();
    assert_eq!(
        offers,
        [
            ("rb0", "FI_EP_RDM"),
            ("rb0", "FI_EP_DGRAM"),
            ("rb0", "FI_EP_MSG"),
            ("rb1", "FI_EP_RDM"),
            ("rb1", "FI_EP_DGRAM"),
            ("rb1", "FI_EP_MSG")
        ],
        "{t}"
    );
    // No utility provider layers over ringbell (ofi_rxd and ofi_rxm would offer RDM over its
    // datagram and connected endpoints, ahead of the NIC's own), with or without a provider
    // named.
    let all = text(&fi_info(&dir, &[], &[]));
    assert!(!all.contains("ringbell;"), "a layered ringbell: {all}");
    assert!(!t.contains("ringbell;"), "a layered ringbell: {t}");
    let rdm = text(&fi_info(&dir, &["-p", "ringbell", "-t", "FI_EP_RDM"], &[]));
    assert_eq!(rdm.matches("provider: ringbell\n").count(), 2, "{rdm}");

    let three = text(&fi_info(
        &dir,
        &["-p", "ringbell", "-t", "FI_EP_RDM"],
        &[("RINGBELL_NICS", "3")],
    ));
    assert_eq!(three.matches("provider: ringbell\n").count(), 3, "{three}");
}

#[test]
fn hints_select_and_refuse() {
    let dir = provider_dir();
    let one = fi_info(&dir, &["-p", "ringbell", "-d", "rb1"], &[]);
    let t = text(&one);
    assert_eq!(t.matches("provider: ringbell\n").count(), 3, "{t}");
    assert!(t.contains("domain: rb1"));
    assert_eq!(t.matches("type: FI_EP_RDM").count(), 1, "{t}");
    // What no offer has (tagged datagrams): no data (FI_ENODATA, 61).
    let o = fi_info(
        &dir,
        &["-p", "ringbell", "-t", "FI_EP_DGRAM", "-c", "FI_TAGGED"],
        &[],
    );
    assert!(!o.status.success(), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("-61"), "{o:?}");
    let m = text(&fi_info(&dir, &["-p", "ringbell", "-t", "FI_EP_MSG"], &[]));
    assert_eq!(m.matches("provider: ringbell\n").count(), 2, "{m}");
    // Datagrams: untagged messages of one packet, nothing else.
    let d = text(&fi_info(
        &dir,
        &["-p", "ringbell", "-t", "FI_EP_DGRAM", "-v", "-d", "rb0"],
        &[],
    ));
    assert_eq!(d.matches("type: FI_EP_DGRAM").count(), 1, "{d}");
    assert!(d.contains("max_msg_size: 4096"), "{d}");
    let dcaps = d
        .lines()
        .find(|l| l.trim_start().starts_with("caps:"))
        .unwrap();
    assert!(
        dcaps.contains("FI_MSG") && !dcaps.contains("FI_TAGGED"),
        "{dcaps}"
    );
    let o = fi_info(
        &dir,
        &["-p", "ringbell", "-t", "FI_EP_DGRAM", "-c", "FI_TAGGED"],
        &[],
    );
    assert!(!o.status.success(), "{o:?}");
    assert!(!fi_info(&dir, &["-p", "ringbell", "-d", "rb9"], &[])
        .status
        .success());
    assert!(
        !fi_info(&dir, &["-p", "ringbell", "-c", "FI_MULTICAST"], &[])
            .status
            .success()
    );
    // Capabilities come back as asked, with the secondary ones.
    let v = text(&fi_info(
        &dir,
        &[
            "-p",
            "ringbell",
            "-c",
            "FI_TAGGED|FI_DIRECTED_RECV",
            "-v",
            "-d",
            "rb0",
        ],
        &[],
    ));
    let caps = v
        .lines()
        .find(|l| l.trim_start().starts_with("caps:"))
        .unwrap();
    for c in [
        "FI_TAGGED",
        "FI_DIRECTED_RECV",
        "FI_TRIGGER",
        "FI_LOCAL_COMM",
    ] {
        assert!(caps.contains(c), "{caps}");
    }
    let tokens: Vec<&str> = caps
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    assert!(
        !tokens.contains(&"FI_RMA") && !tokens.contains(&"FI_MSG"),
        "{caps}"
    );
    assert!(tokens.contains(&"FI_RMA_EVENT"), "{caps}");
    assert!(v.contains("mem_tag_format: 0xaaaaaaaaaaaaaaaa"), "{v}");
    assert!(v.contains("threading: FI_THREAD_SAFE"), "{v}");
}
