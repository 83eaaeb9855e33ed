//! Debian's Open MPI 4.1 (openmpi-bin, libopenmpi-dev), unmodified, over the provider:
//! `mpirun --mca pml cm --mca mtl ofi` with `FI_PROVIDER=ringbell` on 2 and 4 ranks, each
//! rank on its own NIC of one `ringbell-emu serve` (claimed by lock file: every rank has the
//! same environment). The programs (`tests/mpi/*.c`) check their own results and exit
//! non-zero with a message on a mismatch: a ring, wildcard receives, barriers and
//! allreduces, large (rendezvous) messages, and probes (MPI_Probe, MPI_Iprobe, MPI_Mprobe,
//! MPI_Improbe with MPI_Mrecv) with a cancelled receive; three of them again through the ob1
//! PML over Open MPI's ofi BTL (wildcard on eight ranks). And NetPIPE (netpipe-openmpi),
//! unmodified: its integrity check of every message size up to 1 MiB between two ranks.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const PROGRAMS: [&str; 5] = ["ring", "wildcard", "collectives", "large", "probe"];

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Compiles the test programs with `mpicc` into a directory of this test process (once).
fn build() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(compile).clone()
}

fn compile() -> PathBuf {
    assert!(
        Command::new("mpicc").arg("--version").output().is_ok(),
        "mpicc is missing: install Debian's libopenmpi-dev and openmpi-bin (.ci/run does)"
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mpi");
    let out =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ringbell-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for p in PROGRAMS {
        let o = Command::new("mpicc")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(out.join(p))
            .arg(src.join(format!("{p}.c")))
            .output()
            .unwrap();
        assert!(o.status.success(), "mpicc {p}.c: {}", text(&o));
    }
    out
}

/// The MCA parameters of the cm PML over the ofi MTL on the provider.
const MTL: &[&str] = &[
    "--mca",
    "pml",
    "cm",
    "--mca",
    "mtl",
    "ofi",
    "--mca",
    "mtl_ofi_provider_include",
    "ringbell",
    "--mca",
    "btl",
    "self",
    "--mca",
    "mtl_ofi_verbose",
    "1",
];

/// `mpirun` (under a 300 s `timeout`) of `ranks` ranks over the provider on the served
/// fabric `served`, in directory `dir`, through the ofi MTL; the caller adds the program
/// and its arguments.
fn launcher(prov: &Path, served: &Path, ranks: usize, dir: &Path) -> Command {
    launcher_with(prov, served, ranks, dir, MTL)
}

/// [`launcher`] with the MCA parameters `mca`.
fn launcher_with(prov: &Path, served: &Path, ranks: usize, dir: &Path, mca: &[&str]) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["300", "mpirun", "--allow-run-as-root", "--oversubscribe"])
        .args(["-np", &ranks.to_string()])
        .args(mca)
        .args(["-x", "FI_PROVIDER_PATH", "-x", "RINGBELL_SERVE"])
        .args(["-x", "FI_PROVIDER"])
        .current_dir(dir)
        .env("FI_PROVIDER_PATH", prov)
        .env("RINGBELL_SERVE", served)
        .env("FI_PROVIDER", "ringbell")
        .env_remove("RINGBELL_NIC");
    cmd
}

/// Runs `prog` on `ranks` ranks over a served fabric of as many NICs.
fn mpirun(bin: &Path, prov: &Path, served: &Path, ranks: usize, prog: &str) -> Output {
    let mut cmd = launcher(prov, served, ranks, bin);
    cmd.arg(bin.join(prog));
    cmd.output().unwrap()
}

fn run_all(ranks: usize) {
    let bin = build();
    let prov = common::provider_dir(&format!("mpi{ranks}"));
    let served = common::Served::start_nodes(&format!("mpi{ranks}"), ranks);
    for prog in PROGRAMS {
        let o = mpirun(&bin, &prov, &served.dir, ranks, prog);
        let out = text(&o);
        assert!(
            o.status.success(),
            "{prog} on {ranks} ranks failed ({}):\n{out}",
            o.status
        );
        let want = format!("{prog} ok: {ranks} ranks");
        assert!(
            out.lines().any(|l| l.starts_with(&want)),
            "{prog}: no '{want}' line:\n{out}"
        );
        // Every rank's MTL chose the provider.
        let chosen = out
            .lines()
            .filter(|l| l.ends_with("mtl:ofi:prov: ringbell"))
            .count();
        assert_eq!(chosen, ranks, "{prog}: the ofi MTL chose ringbell:\n{out}");
        for l in out.lines().filter(|l| l.contains(" ok: ")) {
            println!("{l}");
        }
    }
}

#[test]
fn open_mpi_on_two_ranks() {
    run_all(2);
}

#[test]
fn open_mpi_on_four_ranks() {
    run_all(4);
}

/// Open MPI's ob1 PML over its ofi BTL in the BTL's two-sided mode (`btl_ofi_mode 2`).
const OB1_OVER_THE_OFI_BTL: [&str; 12] = [
    "--mca",
    "pml",
    "ob1",
    "--mca",
    "btl",
    "self,ofi",
    "--mca",
    "btl_ofi_mode",
    "2",
    "--mca",
    "btl_ofi_provider_include",
    "ringbell",
];

/// Runs `prog` on `ranks` ranks of `served` with [`OB1_OVER_THE_OFI_BTL`] and checks its
/// "`prog` ok: `ranks` ranks" line.
fn over_the_ofi_btl(bin: &Path, prov: &Path, served: &Path, ranks: usize, prog: &str) {
    let o = launcher_with(prov, served, ranks, bin, &OB1_OVER_THE_OFI_BTL)
        .arg(bin.join(prog))
        .output()
        .unwrap();
    let out = text(&o);
    assert!(
        o.status.success(),
        "{prog} over the ofi BTL failed ({}):\n{out}",
        o.status
    );
    let want = format!("{prog} ok: {ranks} ranks");
    let line = out.lines().find(|l| l.starts_with(&want));
    assert!(line.is_some(), "{prog}: no '{want}':\n{out}");
    println!("over the ofi BTL: {}", line.unwrap_or(""));
}

/// The ob1 PML over Open MPI's ofi BTL in its two-sided mode: messages as sends, and large
/// ones moved by RDMA READ and WRITE of registered memory. The BTL reads `FI_MR_VIRT_ADDR`
/// in the info to address remote memory by virtual address rather than by offset (it asks
/// for the remote-key bits without `FI_MR_LOCAL`).
#[test]
fn open_mpi_ob1_over_the_ofi_btl() {
    let bin = build();
    let prov = common::provider_dir("mpi-btl");
    let served = common::Served::start_nodes("mpi-btl", 2);
    for prog in ["collectives", "large"] {
        over_the_ofi_btl(&bin, &prov, &served.dir, 2, prog);
    }
}

/// The wildcard program on eight ranks over the ofi BTL: rank 0 receives many small
/// messages from every other rank while the BTL registers pieces of its receive pool beside
/// pages receives are landing in. Registering memory once moved adopted pages again (a
/// merge), and a DMA into them in that moment failed (`fi_cq_readerr`, provider error 11 or
/// 21); pages adopted once now stay where they are.
#[test]
fn open_mpi_ob1_over_the_ofi_btl_with_wildcard_receives_on_eight_ranks() {
    let bin = build();
    let prov = common::provider_dir("mpi-btl8");
    let served = common::Served::start_nodes("mpi-btl8", 8);
    over_the_ofi_btl(&bin, &prov, &served.dir, 8, "wildcard");
}

/// NetPIPE's integrity run (`NPopenmpi -i`) over the provider: every message size from 1 byte
/// to 1 MiB (with perturbations) sent between two ranks and checked by the receiver.
#[test]
fn netpipe_integrity_over_the_provider() {
    assert!(
        Command::new("NPopenmpi").arg("-h").output().is_ok(),
        "NPopenmpi is missing: install Debian's netpipe-openmpi (.ci/run does)"
    );
    let prov = common::provider_dir("netpipe");
    let served = common::Served::start_nodes("netpipe", 2);
    let dir = std::env::temp_dir().join(format!("ringbell-np-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let o = launcher(&prov, &served.dir, 2, &dir)
        .args(["NPopenmpi", "-i", "-u", "1048576", "-o"])
        .arg(dir.join("np.out"))
        .output()
        .unwrap();
    let out = text(&o);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(o.status.success(), "NetPIPE failed ({}):\n{out}", o.status);
    let sizes: Vec<&str> = out.lines().filter(|l| l.contains("-->")).collect();
    let passed = sizes
        .iter()
        .filter(|l| l.ends_with("Integrity check passed"))
        .count();
    assert!(
        sizes.len() >= 30 && passed == sizes.len(),
        "NetPIPE: {passed} of {} sizes passed:\n{out}",
        sizes.len()
    );
    println!("NetPIPE over the provider: {passed} sizes passed");
}
