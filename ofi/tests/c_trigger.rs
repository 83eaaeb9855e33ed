//! `tests/c/trigger.c`, compiled against the installed libfabric headers and run through
//! libfabric itself (`FI_PROVIDER_PATH`): counters, `FI_TRIGGER`, the deferred work queue
//! and their bad inputs, on two NICs of the in-process fabric.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn triggered_operations_through_libfabric() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/trigger.c");
    let out = std::env::temp_dir().join(format!("ringbell-trigger-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O1", "-g", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-lfabric")
        .output()
        .expect("cc");
    assert!(
        cc.status.success(),
        "compiling trigger.c: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = Command::new("timeout")
        .arg("120")
        .arg(&out)
        .env("FI_PROVIDER_PATH", common::provider_dir("trigger"))
        .env("FI_PROVIDER", "ringbell")
        .env("RINGBELL_NICS", "2")
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
    assert!(text.contains(", 0 failed"), "{text}");
}
