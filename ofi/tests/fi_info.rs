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
    let out = std::env::temp_dir().join(format!("ringbell-fi-{}", std::process::id()));
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
fn fi_info_lists_the_provider_and_one_rdm_domain_per_nic() {
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
    assert_eq!(t.matches("provider: ringbell\n").count(), 2, "{t}");
    assert!(
        t.contains("domain: rb0") && t.contains("domain: rb1"),
        "{t}"
    );
    assert!(
        t.contains("type: FI_EP_RDM") && !t.contains("FI_EP_MSG"),
        "{t}"
    );
    // RDM only: no utility provider layers over ringbell.
    let all = text(&fi_info(&dir, &[], &[]));
    assert!(!all.contains("ringbell;"), "a layered ringbell: {all}");

    let three = text(&fi_info(
        &dir,
        &["-p", "ringbell"],
        &[("RINGBELL_NICS", "3")],
    ));
    assert_eq!(three.matches("provider: ringbell\n").count(), 3, "{three}");
}

#[test]
fn hints_select_and_refuse() {
    let dir = provider_dir();
    let one = fi_info(&dir, &["-p", "ringbell", "-d", "rb1"], &[]);
    let t = text(&one);
    assert_eq!(t.matches("provider: ringbell\n").count(), 1, "{t}");
    assert!(t.contains("domain: rb1"));
    // Endpoint types the provider does not offer: no data (FI_ENODATA, 61).
    for ep in ["FI_EP_MSG", "FI_EP_DGRAM"] {
        let o = fi_info(&dir, &["-p", "ringbell", "-t", ep], &[]);
        assert!(!o.status.success(), "{ep}: {o:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("-61"), "{o:?}");
    }
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
