//! Endpoints by service number on this host. An endpoint opened on a service number of the
//! application's choosing (`fi_getinfo(node, "9228", FI_SOURCE, ...)`, as fabtests'
//! servers do) is published under that number while it is enabled, so that a peer given
//! only this host's address and the number (`fi_getinfo("127.0.0.1", "9228", 0, ...)`,
//! fabtests' clients without an out-of-band exchange) reaches it: an address whose IPv4
//! address is no NIC's on the fabric names the endpoint published under its service.
//!
//! A datagram endpoint (`FI_EP_DGRAM`) is published with its QP number too, which a
//! datagram needs beside the NIC.
//!
//! On a served fabric (`RINGBELL_SERVE=DIR`) the names are files `DIR/service-N` holding
//! the NIC's index (and, for a datagram endpoint, a space and its QP number), visible to
//! every process of the fabric; on the in-process fabric, a table of the process. A name is replaced by the next endpoint opened on its number and
//! removed when its endpoint closes.

use ringbell::discover::ENV_SERVE;
use std::path::PathBuf;
use std::sync::Mutex;

/// The in-process fabric's names: (service, NIC index, datagram QP number).
static LOCAL: Mutex<Vec<(u64, usize, Option<u32>)>> = Mutex::new(Vec::new());

fn dir() -> Option<PathBuf> {
    std::env::var_os(ENV_SERVE)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

fn file(d: &std::path::Path, service: u64) -> PathBuf {
    d.join(format!("service-{service}"))
}

/// The contents of a name's file: the NIC's index and, for a datagram endpoint, a space
/// and its QP number.
fn text(nic: usize, dgram: Option<u32>) -> String {
    match dgram {
        Some(q) => format!("{nic} {q}"),
        None => nic.to_string(),
    }
}

fn local() -> std::sync::MutexGuard<'static, Vec<(u64, usize, Option<u32>)>> {
    LOCAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Publishes the endpoint on `service` of NIC `nic`, with its QP number `dgram` when it is a
/// datagram endpoint (best effort: a directory that cannot be written leaves the endpoint
/// reachable by its full address only).
pub fn publish(service: u64, nic: usize, dgram: Option<u32>) {
    match dir() {
        Some(d) => {
            // Written aside and renamed, so a reader sees the old name or the new one.
            let tmp = d.join(format!(".service-{service}.{}", std::process::id()));
            if std::fs::write(&tmp, text(nic, dgram)).is_ok()
                && std::fs::rename(&tmp, file(&d, service)).is_err()
            {
                let _ = std::fs::remove_file(&tmp);
            }
        }
        None => {
            let mut t = local();
            t.retain(|e| e.0 != service);
            t.push((service, nic, dgram));
        }
    }
}

/// The service numbers the provider picks for endpoints of the sockaddr formats that have
/// none of the application's: the ephemeral ports of RFC 6335.
pub const EPHEMERAL: std::ops::RangeInclusive<u64> = 49152..=65535;

/// Claims a free number of [`EPHEMERAL`] for the endpoint on NIC `nic` (with its QP number
/// `dgram` when it is a datagram endpoint), published at once: a number nobody on the
/// fabric holds, found by exclusive creation of its name (on a served fabric the file,
/// made aside and linked into place, which fails when the name exists; in-process under
/// the table's lock). The caller withdraws it with [`unpublish`]. `None` when every number
/// is taken (or the directory cannot be written).
pub fn claim(nic: usize, dgram: Option<u32>) -> Option<u64> {
    claim_in(dir(), nic, dgram)
}

/// [`claim`] in directory `d` (a served fabric's), or the in-process table.
fn claim_in(d: Option<PathBuf>, nic: usize, dgram: Option<u32>) -> Option<u64> {
    let span = EPHEMERAL.end() - EPHEMERAL.start() + 1;
    // Start where another process is unlikely to: its id and a counter of the process's.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seed = u64::from(std::process::id())
        .wrapping_mul(2654435761)
        .wrapping_add(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
        % span;
    let text = text(nic, dgram);
    let tmp = d
        .as_ref()
        .map(|d| d.join(format!(".claim.{}.{seed}", std::process::id())));
    if let Some(t) = &tmp {
        std::fs::write(t, &text).ok()?;
    }
    let mut found = None;
    for i in 0..span {
        let service = EPHEMERAL.start() + (seed + i) % span;
        let taken = match (&d, &tmp) {
            (Some(d), Some(t)) => std::fs::hard_link(t, file(d, service)).is_err(),
            _ => {
                let mut t = local();
                let taken = t.iter().any(|e| e.0 == service);
                if !taken {
                    t.push((service, nic, dgram));
                }
                taken
            }
        };
        if !taken {
            found = Some(service);
            break;
        }
    }
    if let Some(t) = &tmp {
        let _ = std::fs::remove_file(t);
    }
    found
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
    resolve_full(service).map(|(nic, _)| nic)
}

/// The NIC whose endpoint is published under `service`, and the endpoint's QP number when it
/// is a datagram endpoint.
pub fn resolve_full(service: u64) -> Option<(usize, Option<u32>)> {
    match dir() {
        Some(d) => {
            let text = std::fs::read_to_string(file(&d, service)).ok()?;
            let mut words = text.split_whitespace();
            let nic = words.next()?.parse().ok()?;
            let qpn = match words.next() {
                Some(w) => Some(w.parse().ok()?),
                None => None,
            };
            Some((nic, qpn))
        }
        None => local().iter().find(|e| e.0 == service).map(|e| (e.1, e.2)),
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
        publish(s, 3, None);
        assert_eq!(resolve(s), Some(3));
        assert_eq!(resolve_full(s), Some((3, None)));
        publish(s, 1, Some(0x1234));
        assert_eq!(resolve(s), Some(1));
        assert_eq!(resolve_full(s), Some((1, Some(0x1234))));
        unpublish(s, 3);
        assert_eq!(resolve(s), Some(1));
        unpublish(s, 1);
        assert_eq!(resolve(s), None);
    }

    #[test]
    fn claimed_numbers_are_ephemeral_ports_nobody_else_holds() {
        if dir().is_some() {
            return;
        }
        let a = claim(2, None).unwrap();
        let b = claim(3, Some(0x77)).unwrap();
        assert!(EPHEMERAL.contains(&a) && EPHEMERAL.contains(&b) && a != b);
        assert_eq!(resolve_full(a), Some((2, None)));
        assert_eq!(resolve_full(b), Some((3, Some(0x77))));
        unpublish(a, 2);
        unpublish(b, 3);
        assert_eq!(resolve(a), None);
    }

    #[test]
    fn claims_on_a_served_fabric_are_exclusive_files() {
        let d = std::env::temp_dir().join(format!("ringbell-names-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let mut seen = std::collections::HashSet::new();
        for i in 0..50 {
            let s = claim_in(Some(d.clone()), i, Some(i as u32 + 100)).unwrap();
            assert!(EPHEMERAL.contains(&s) && seen.insert(s), "{s} twice");
            let text = std::fs::read_to_string(file(&d, s)).unwrap();
            assert_eq!(text, format!("{i} {}", i + 100));
        }
        // Only the names are left (the files made aside are gone).
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 50);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
