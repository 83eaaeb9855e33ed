//! Which NIC this process uses.
//!
//! - `RINGBELL_NIC=i`: NIC `i` only; `RINGBELL_NIC=all`: every NIC of the plan, no claim
//!   (one process driving several served NICs).
//! - Otherwise, with `RINGBELL_SERVE=DIR` (the NICs of a `ringbell-emu serve`, which serves
//!   one client per NIC): the process claims the first NIC `i` whose lock file
//!   `DIR/nic{i}.lock` it can lock with an exclusive, non-blocking `flock(2)`. The lock is
//!   held for the life of the process (the kernel drops it when the process exits), so
//!   processes started with the same environment (the ranks of an MPI job) each get their own
//!   NIC. When every NIC is taken the process gets none (`fi_getinfo` finds no data).
//! - Otherwise (the in-process fabric) every NIC of the plan.
//!
//! The claim is made once, by the first `fi_getinfo` or `fi_domain` that needs it.

use ringbell::discover::{NicPlan, NicSource};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::OnceLock;

/// The value of `RINGBELL_NIC` that asks for every NIC.
pub const ALL: &str = "all";

/// A NIC held under its lock file; the lock is released when this is dropped (or the
/// process exits).
#[derive(Debug)]
pub struct Claim {
    pub nic: usize,
    _file: File,
}

/// The lock file of NIC `i` in a serve directory.
pub fn lock_path(dir: &Path, i: usize) -> std::path::PathBuf {
    dir.join(format!("nic{i}.lock"))
}

/// Claims the first of NICs `0..count` whose lock file in `dir` is free.
pub fn claim_first_free(dir: &Path, count: usize) -> Option<Claim> {
    (0..count).find_map(|i| {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(lock_path(dir, i))
            .ok()?;
        // SAFETY: flock on a descriptor this function owns (open above); no memory involved.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        (r == 0).then_some(Claim {
            nic: i,
            _file: file,
        })
    })
}

/// Which NICs of `plan` this process may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Every NIC of the plan.
    All,
    /// Only this one.
    One(usize),
    /// None (every served NIC is claimed by another process).
    None,
}

/// This process's choice: `RINGBELL_NIC` (a NIC or `all`), else its claim on a served NIC (made on the first
/// call and kept), else every NIC.
pub fn choice(plan: &NicPlan) -> Choice {
    if let Some(i) = crate::prov::selected_nic() {
        return Choice::One(i);
    }
    if std::env::var(crate::prov::ENV_NIC).is_ok_and(|v| v.trim() == ALL) {
        return Choice::All;
    }
    let dir = match plan.nics.first() {
        Some(NicSource::Served(p)) => match p.parent() {
            Some(d) => d.to_path_buf(),
            None => return Choice::All,
        },
        _ => return Choice::All,
    };
    static CLAIM: OnceLock<Option<Claim>> = OnceLock::new();
    match CLAIM.get_or_init(|| claim_first_free(&dir, plan.nics.len())) {
        Some(c) => Choice::One(c.nic),
        None => Choice::None,
    }
}

/// The NIC a domain opens when its info names none: the process's own, else NIC 0.
pub fn default_nic() -> usize {
    match choice(&NicPlan::from_env()) {
        Choice::One(i) => i,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_distinct_and_released_on_drop() {
        let dir = std::env::temp_dir().join(format!("rb-claim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = claim_first_free(&dir, 3).unwrap();
        let b = claim_first_free(&dir, 3).unwrap();
        let c = claim_first_free(&dir, 3).unwrap();
        assert_eq!((a.nic, b.nic, c.nic), (0, 1, 2));
        assert!(claim_first_free(&dir, 3).is_none(), "all taken");
        drop(b);
        assert_eq!(claim_first_free(&dir, 3).unwrap().nic, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
