//! Which NIC this process uses: the rule of [`ringbell::discover`], shared with the verbs
//! library (`RINGBELL_NIC=i` or `all`, else on a served fabric the first NIC whose lock file
//! this process can lock, else every NIC). The claim is made once, by the first
//! `fi_getinfo` or `fi_domain` that needs it, and a verbs library loaded in the same
//! process gets the same NIC.

pub use ringbell::discover::lock_path;
use ringbell::discover::{Choice, NicPlan};

/// The NIC a domain opens when its info names none: the process's own, else NIC 0.
pub fn default_nic() -> usize {
    match NicPlan::from_env().choice() {
        Choice::One(i) => i,
        _ => 0,
    }
}
