//! What the tests that use served NICs share: the emulator binary, a running
//! `ringbell-emu serve`, the provider library and a directory for `FI_PROVIDER_PATH`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The build directory of this test (target/<profile>).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The provider library cargo built with this test (in `deps/` for tests).
pub fn library() -> PathBuf {
    let dir = profile_dir();
    [dir.join("deps"), dir]
        .into_iter()
        .map(|d| d.join("libringbell_fi.so"))
        .find(|p| p.exists())
        .expect("libringbell_fi.so was not built")
}

/// A directory holding only the provider (libfabric loads every `*fi.so` of a directory in
/// `FI_PROVIDER_PATH`), kept with the build under cargo's temporary directory for tests.
pub fn provider_dir(tag: &str) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ringbell-fi-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let link = out.join("libringbell-fi.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(library(), &link).unwrap();
    out
}

/// The emulator binary of this test's profile, brought up to date once per test process
/// (`cargo test -p ringbell-ofi` does not build other packages' binaries).
pub fn emulator() -> PathBuf {
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

/// A running `ringbell-emu serve`, stopped on drop.
pub struct Served {
    child: Child,
    pub dir: PathBuf,
}

impl Served {
    /// Serves two NICs.
    pub fn start(name: &str) -> Served {
        Served::start_nodes(name, 2)
    }

    /// Serves `nodes` NICs.
    pub fn start_nodes(name: &str, nodes: usize) -> Served {
        let dir = std::env::temp_dir().join(format!("ringbell-ofi-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(emulator())
            .args(["serve", "--socket"])
            .arg(&dir)
            .arg("--nodes")
            .arg(nodes.to_string())
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
        Served { child, dir }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
pub mod fi;
