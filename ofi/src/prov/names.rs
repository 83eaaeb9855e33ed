//! Endpoints by service number on this host. An endpoint opened on a service number of the
//! application's choosing (`fi_getinfo(node, "9228", FI_SOURCE, ...)`, as fabtests'
//! servers do) is published under that number while it is enabled, so that a peer given
//! only this host's address and the number (`fi_getinfo("127.0.0.1", "9228", 0, ...)`,
//! fabtests' clients without an out-of-band exchange) reaches it: an address whose IPv4
//! address is no NIC's on the fabric names the endpoint published under its service.
//!
//! On a served fabric (`RINGBELL_SERVE=DIR`) the names are files `DIR/service-N` holding
//! the NIC's index, visible to every process of the fabric; on the in-process fabric, a
//! table of the process. A name is replaced by the next endpoint opened on its number and
//! removed when its endpoint closes.

use ringbell::discover::ENV_SERVE;
use std::path::PathBuf;
use std::sync::Mutex;

/// The in-process fabric's names: (service, NIC index).
static LOCAL: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());

fn dir() -> Option<PathBuf> {
    std::env::var_os(ENV_SERVE)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

fn file(d: &std::path::Path, service: u64) -> PathBuf {
    d.join(format!("service-{service}"))
}

fn local() -> std::sync::MutexGuard<'static, Vec<(u64, usize)>> {
    LOCAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Publishes the endpoint on `service` of NIC `nic` (best effort: a directory that cannot
/// be written leaves the endpoint reachable by its full address only).
pub fn publish(service: u64, nic: usize) {
    match dir() {
        Some(d) => {
            // Written aside and renamed, so a reader sees the old name or the new one.
            let tmp = d.join(format!(".service-{service}.{}", std::process::id()));
            if std::fs::write(&tmp, nic.to_string()).is_ok()
                && std::fs::rename(&tmp, file(&d, service)).is_err()
            {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        None => {
            let mut t = local();
            t.retain(|e| e.0 != service);
            t.push((service, nic));
        }
    }
}

/// Withdraws the name, unless another NIC's endpoint has taken the number since.
pub fn unpublish(service: u64, nic: usize) {
    if resolve(service) != Some(nic) {
        return;
    }
    match dir() {
        Some(d) => {
            let _ = std::fs::remove_file(file(&d, service));
        }
        None => local().retain(|e| e.0 != service),
    }
}

/// The NIC whose endpoint is published under `service`, if any.
pub fn resolve(service: u64) -> Option<usize> {
    match dir() {
        Some(d) => std::fs::read_to_string(file(&d, service))
            .ok()?
            .trim()
            .parse()
            .ok(),
        None => local().iter().find(|e| e.0 == service).map(|e| e.1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_resolves_until_withdrawn_and_only_its_owner_withdraws_it() {
        // The in-process table (no RINGBELL_SERVE in the unit tests' environment).
        if dir().is_some() {
            return;
        }
        let s = 0x5eed_0000_0001;
        assert_eq!(resolve(s), None);
        publish(s, 3);
        assert_eq!(resolve(s), Some(3));
        publish(s, 1);
        assert_eq!(resolve(s), Some(1));
        unpublish(s, 3);
        assert_eq!(resolve(s), Some(1));
        unpublish(s, 1);
        assert_eq!(resolve(s), None);
    }
}
