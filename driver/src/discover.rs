//! Which ringbell NICs a process uses, from its environment: the rule the libraries that
//! unmodified programs load (`libringbell_verbs.so`, `libringbell_fi.so`) share.
//!
//! - `RINGBELL_SERVE=DIR`: the NICs of a running `ringbell-emu serve`, `DIR/nic0.sock`,
//!   `DIR/nic1.sock`, ... as long as they exist;
//! - otherwise an in-process fabric of `RINGBELL_NICS` NICs (default 2, 1..=64) with seed
//!   `RINGBELL_SEED` (default 1; decimal or `0x` hexadecimal). An empty `RINGBELL_SERVE`
//!   counts as unset.
//!
//! NIC `i` is named `rb{i}`.
//!
//! Of those, a process uses ([`NicPlan::choice`]):
//! - `RINGBELL_NIC=i`: NIC `i` only; `RINGBELL_NIC=all`: every NIC, no claim (one process
//!   driving several served NICs);
//! - otherwise, on a served fabric (which serves one client per NIC), the NIC it claims:
//!   the first `i` whose lock file `DIR/nic{i}.lock` it can lock with an exclusive,
//!   non-blocking `flock(2)`, held for the life of the process (the kernel drops it at
//!   exit). Processes started with the same environment (the ranks of an MPI job) each get
//!   their own NIC; when every NIC is taken a process gets none. Both libraries of one
//!   process get the same NIC: the claimant writes its process id into the lock file, and a
//!   lock held under this process's own id is this process's claim;
//! - otherwise (the in-process fabric) every NIC.

use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable: directory of a running `ringbell-emu serve` (its `nic{i}.sock`).
pub const ENV_SERVE: &str = "RINGBELL_SERVE";
/// Environment variable: how many NICs the in-process fabric has (default 2, at most 64).
pub const ENV_NICS: &str = "RINGBELL_NICS";
/// Environment variable: the in-process fabric's seed (default 1).
pub const ENV_SEED: &str = "RINGBELL_SEED";
/// Environment variable: the NIC this process uses (`i`), or `all` of them.
pub const ENV_NIC: &str = "RINGBELL_NIC";
/// The value of [`ENV_NIC`] that asks for every NIC.
pub const NIC_ALL: &str = "all";
/// NICs of the in-process fabric when [`ENV_NICS`] is not set.
pub const DEFAULT_NICS: usize = 2;
/// Seed of the in-process fabric when [`ENV_SEED`] is not set.
pub const DEFAULT_SEED: u64 = 1;

/// Where a NIC is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicSource {
    /// Node `n` of the in-process fabric.
    InProcess(usize),
    /// A served NIC's vfio-user socket.
    Served(PathBuf),
}

/// The NICs of this process and the in-process fabric's seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicPlan {
    /// NIC `i` (named `rb{i}`).
    pub nics: Vec<NicSource>,
    /// The seed of the in-process fabric (unused for served NICs).
    pub seed: u64,
}

impl NicPlan {
    /// The plan the environment gives (see the module documentation).
    pub fn from_env() -> NicPlan {
        NicPlan::from_vars(|k| std::env::var_os(k))
    }

    /// The plan given a lookup of environment variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> NicPlan {
        let text = |k: &str| var(k).and_then(|v| v.into_string().ok());
        let seed = text(ENV_SEED)
            .and_then(|s| {
                let s = s.trim().to_string();
                match s.strip_prefix("0x") {
                    Some(h) => u64::from_str_radix(h, 16).ok(),
                    None => s.parse().ok(),
                }
            })
            .unwrap_or(DEFAULT_SEED);
        let nics = match var(ENV_SERVE).filter(|d| !d.is_empty()) {
            Some(dir) => {
                let dir = PathBuf::from(dir);
                (0..)
                    .map(|i| dir.join(format!("nic{i}.sock")))
                    .take_while(|p| p.exists())
                    .map(NicSource::Served)
                    .collect()
            }
            None => {
                let n = text(ENV_NICS)
                    .and_then(|s| s.trim().parse::<usize>().ok())
                    .unwrap_or(DEFAULT_NICS)
                    .clamp(1, 64);
                (0..n).map(NicSource::InProcess).collect()
            }
        };
        NicPlan { nics, seed }
    }

    /// The name of NIC `i`.
    pub fn name(i: usize) -> String {
        format!("rb{i}")
    }

    /// Which of the plan's NICs this process uses (see the module documentation). On a
    /// served fabric without [`ENV_NIC`], the first call claims a NIC and every later call
    /// answers the same.
    pub fn choice(&self) -> Choice {
        self.choice_with(std::env::var(ENV_NIC).ok().as_deref())
    }

    /// [`NicPlan::choice`] given the value of [`ENV_NIC`].
    pub fn choice_with(&self, nic: Option<&str>) -> Choice {
        match nic.map(str::trim) {
            Some(NIC_ALL) => return Choice::All,
            Some(v) => {
                if let Ok(i) = v.parse() {
                    return Choice::One(i);
                }
            }
            None => {}
        }
        let dir = match self.nics.first() {
            Some(NicSource::Served(p)) => match p.parent() {
                Some(d) => d.to_path_buf(),
                None => return Choice::All,
            },
            _ => return Choice::All,
        };
        static CLAIM: OnceLock<Option<Claim>> = OnceLock::new();
        match CLAIM.get_or_init(|| claim_first_free(&dir, self.nics.len())) {
            Some(c) => Choice::One(c.nic),
            None => Choice::None,
        }
    }
}

/// Which NICs of a plan a process uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Every NIC of the plan.
    All,
    /// Only this one.
    One(usize),
    /// None (every served NIC is claimed by another process).
    None,
}

impl Choice {
    /// Whether NIC `i` is among the chosen.
    pub fn includes(self, i: usize) -> bool {
        match self {
            Choice::All => true,
            Choice::One(n) => n == i,
            Choice::None => false,
        }
    }
}

/// A NIC held under its lock file; the lock is released when this is dropped (or the
/// process exits). A claim adopted from another library of this process holds no lock of
/// its own.
#[derive(Debug)]
pub struct Claim {
    /// The NIC.
    pub nic: usize,
    _lock: Option<Flock<File>>,
}

/// The lock file of NIC `i` in a serve directory.
pub fn lock_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("nic{i}.lock"))
}

/// Claims the first of NICs `0..count` whose lock file in `dir` is free, or whose lock this
/// process already holds (through another library's claim).
pub fn claim_first_free(dir: &Path, count: usize) -> Option<Claim> {
    let me = std::process::id();
    (0..count).find_map(|nic| {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(lock_path(dir, nic))
            .ok()?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(mut lock) => {
                // Who holds it, for another library of this process (best effort: a lock
                // whose holder is unreadable is just not adopted).
                let _ = lock
                    .set_len(0)
                    .and_then(|()| lock.rewind())
                    .and_then(|()| write!(lock, "{me}"));
                Some(Claim {
                    nic,
                    _lock: Some(lock),
                })
            }
            Err((mut file, _)) => {
                let mut holder = String::new();
                file.read_to_string(&mut holder).ok()?;
                (holder.trim().parse() == Ok(me)).then_some(Claim { nic, _lock: None })
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn plan(vars: &[(&str, &str)]) -> NicPlan {
        let vars: Vec<(String, OsString)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        NicPlan::from_vars(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn defaults_counts_seeds_and_served_directories() {
        assert_eq!(
            plan(&[]).nics,
            vec![NicSource::InProcess(0), NicSource::InProcess(1)]
        );
        assert_eq!(plan(&[]).seed, 1);
        assert_eq!(plan(&[(ENV_NICS, "3")]).nics.len(), 3);
        assert_eq!(plan(&[(ENV_NICS, "999")]).nics.len(), 64);
        assert_eq!(plan(&[(ENV_NICS, "0")]).nics.len(), 1);
        assert_eq!(plan(&[(ENV_NICS, "x")]).nics.len(), 2);
        assert_eq!(plan(&[(ENV_SEED, "0x10")]).seed, 16);
        assert_eq!(plan(&[(ENV_SEED, " 7 ")]).seed, 7);
        assert_eq!(
            plan(&[(ENV_SERVE, "")]).nics.len(),
            2,
            "empty means in-process"
        );
        let dir = std::env::temp_dir().join(format!("rb-discover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for i in [0, 1, 3] {
            std::fs::write(dir.join(format!("nic{i}.sock")), b"").unwrap();
        }
        let p = plan(&[(ENV_SERVE, dir.to_str().unwrap())]);
        assert_eq!(
            p.nics,
            vec![
                NicSource::Served(dir.join("nic0.sock")),
                NicSource::Served(dir.join("nic1.sock"))
            ],
            "up to the first missing socket"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(NicPlan::name(3), "rb3");
    }

    #[test]
    fn the_variable_wins_and_the_in_process_fabric_gives_every_nic() {
        let p = plan(&[]);
        assert_eq!(p.choice_with(Some("1")), Choice::One(1));
        assert_eq!(p.choice_with(Some(" all ")), Choice::All);
        assert_eq!(p.choice_with(None), Choice::All);
        assert_eq!(
            p.choice_with(Some("x")),
            Choice::All,
            "unparsable: as unset"
        );
        assert!(Choice::All.includes(5) && Choice::One(2).includes(2));
        assert!(!Choice::One(2).includes(1) && !Choice::None.includes(0));
    }

    #[test]
    fn claims_are_distinct_released_on_drop_and_shared_within_the_process() {
        let dir = std::env::temp_dir().join(format!("rb-claim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = claim_first_free(&dir, 3).unwrap();
        assert_eq!(
            std::fs::read_to_string(lock_path(&dir, 0)).unwrap(),
            std::process::id().to_string(),
            "the claimant is named in the lock file"
        );
        // Another library of this process asking again gets the same NIC, adopted.
        let again = claim_first_free(&dir, 3).unwrap();
        assert_eq!((a.nic, again.nic), (0, 0));
        // A lock held under another process's id is skipped.
        std::fs::write(lock_path(&dir, 0), "1").unwrap();
        let b = claim_first_free(&dir, 3).unwrap();
        let c = claim_first_free(&dir, 3).unwrap();
        assert_eq!((b.nic, c.nic), (1, 1), "the second adopts the first's lock");
        drop((b, c));
        let d = claim_first_free(&dir, 3).unwrap();
        assert_eq!(d.nic, 1, "released when dropped");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
