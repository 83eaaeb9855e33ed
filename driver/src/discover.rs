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

use std::path::PathBuf;

/// Environment variable: directory of a running `ringbell-emu serve` (its `nic{i}.sock`).
pub const ENV_SERVE: &str = "RINGBELL_SERVE";
/// Environment variable: how many NICs the in-process fabric has (default 2, at most 64).
pub const ENV_NICS: &str = "RINGBELL_NICS";
/// Environment variable: the in-process fabric's seed (default 1).
pub const ENV_SEED: &str = "RINGBELL_SEED";
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
}
