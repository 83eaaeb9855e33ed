//! C programs of `tests/c/`, compiled against the installed libfabric headers and run
//! through libfabric itself (`FI_PROVIDER_PATH`) on NICs of the in-process fabric:
//! `trigger.c` (counters, `FI_TRIGGER`, the deferred work queue and their bad inputs) and
//! `allreduce.c` (an allreduce of 8 ranks built only from deferred work, its results
//! checked and its simulated latency printed).

mod common;

use std::path::Path;
use std::process::Command;

/// Compiles `tests/c/{name}.c` and runs it with `args` on `nics` in-process NICs; its
/// output, after asserting that it succeeded.
fn run_c(name: &str, args: &[&str], nics: usize) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let out = std::env::temp_dir().join(format!("ringbell-{name}-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O1", "-g", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-lfabric")
        .output()
        .expect("cc");
    assert!(
        cc.status.success(),
        "compiling {name}.c: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = Command::new("timeout")
        .arg("120")
        .arg(&out)
        .args(args)
        .env("FI_PROVIDER_PATH", common::provider_dir(name))
        .env("FI_PROVIDER", "ringbell")
        .env("RINGBELL_NICS", nics.to_string())
        .env_remove("RINGBELL_SERVE")
        .env_remove("RINGBELL_NIC")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    println!("{text}");
    let _ = std::fs::remove_file(&out);
    assert!(run.status.success(), "{text}");
    text
}

#[test]
fn triggered_operations_through_libfabric() {
    let text = run_c("trigger", &[], 2);
    assert!(text.contains(", 0 failed"), "{text}");
}

#[test]
fn allreduce_of_deferred_work_on_8_ranks() {
    let text = run_c("allreduce", &["8"], 8);
    assert!(
        text.contains("allreduce: 8 ranks, 3 rounds") && text.contains("results checked"),
        "{text}"
    );
}
