//! Tag-matching benchmarks through [`ringbell::tagmatch::TagMatcher`] on two emulated nodes:
//! matching latency and rate against the depth of the posted-receive list, for the hardware
//! list and for software matching, and rendezvous bandwidth.
//!
//! Simulated time covers the wire, the NICs and the hardware list walk (the timing profile's
//! `tm_match_fixed` + `tm_match_per_entry` × entries compared). Host software is not charged
//! in simulated time, so the software figures also report the wall-clock time the receiver's
//! software spent per message on this machine (CQ poll, list walk, copy out of the staging
//! buffer, repost, SYNC).

use crate::{Fabric, FabricConfig};
use ringbell::tagmatch::{TagConfig, TagEvent, TagMatcher};
use ringbell::{ConnectOptions, Device, Error};
use ringbell_specs::SimTime;
use std::time::{Duration, Instant};

/// Where the receives are matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matching {
    /// In the NIC's list (falls back to software when the list is full).
    Hardware,
    /// Only in host software.
    Software,
}

/// Tag of the receives that never match.
const MISS: u64 = 1 << 40;
/// Tag of the measured messages.
const HIT: u64 = 7;
/// Receive buffer length (holds any eager message, so hardware may take it).
const RECV_LEN: u32 = 8192;

struct Bench {
    fabric: Fabric,
    s: TagMatcher,
    r: TagMatcher,
    _devs: (Device, Device),
    next_id: u64,
    sw_time: Duration,
    sw_msgs: u64,
}

fn bench(
    cfg: &FabricConfig,
    m: Matching,
    eager_max: u32,
    user_bytes: usize,
) -> Result<Bench, Error> {
    let fabric = Fabric::new(cfg.clone());
    let ds = Device::open(Box::new(fabric.port(0)))?;
    let dr = Device::open(Box::new(fabric.port(1)))?;
    let cfg = TagConfig {
        eager_max,
        hw_min: 0,
        hw_tags: match m {
            Matching::Hardware => dr.caps().max_num_tags,
            Matching::Software => 0,
        },
        staging_slots: 256,
        user_bytes,
        ..TagConfig::default()
    };
    let mut s = TagMatcher::new(&ds, cfg)?;
    let mut r = TagMatcher::new(&dr, cfg)?;
    let (cs, es) = s.add_conn()?;
    let (cr, er) = r.add_conn()?;
    let o = ConnectOptions {
        rnr_retry: 7,
        ..Default::default()
    };
    s.connect(cs, &er, &o)?;
    r.connect(cr, &es, &o)?;
    Ok(Bench {
        fabric,
        s,
        r,
        _devs: (ds, dr),
        next_id: 0,
        sw_time: Duration::ZERO,
        sw_msgs: 0,
    })
}

impl Bench {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// One round of progress on both sides; returns the receiver's events and whether
    /// anything moved.
    fn turn(&mut self, got: &mut Vec<TagEvent>, sent: &mut u64) -> Result<bool, Error> {
        let mut moved = self.s.progress_ready()? > 0;
        while let Some(e) = self.s.next_event() {
            match e {
                TagEvent::Send { .. } => *sent += 1,
                TagEvent::Failed { status, .. } => return Err(failed(status)),
                TagEvent::Recv { .. } | TagEvent::Cancelled { .. } => {}
            }
        }
        let t = Instant::now();
        let n = self.r.progress_ready()?;
        if n > 0 {
            self.sw_time += t.elapsed();
            moved = true;
        }
        while let Some(e) = self.r.next_event() {
            if let TagEvent::Failed { status, .. } = e {
                return Err(failed(status));
            }
            self.sw_msgs += 1;
            got.push(e);
        }
        Ok(moved || self.fabric.step())
    }

    /// Posts `depth` receives that no message matches.
    fn fill(&mut self, depth: u32) -> Result<(), Error> {
        for k in 0..depth {
            let id = self.id();
            self.r.recv(id, MISS + k as u64, u64::MAX, 0, RECV_LEN)?;
        }
        Ok(())
    }
}

fn failed(status: ringbell_specs::cqe::CqeStatus) -> Error {
    Error::InvalidArgument(match status {
        ringbell_specs::cqe::CqeStatus::RetryExcErr => "tag bench: retries exhausted",
        _ => "tag bench: an operation failed",
    })
}

/// One matching measurement.
#[derive(Clone, Copy, Debug)]
pub struct MatchPoint {
    /// Non-matching receives ahead of the matching one.
    pub depth: u32,
    /// Mean time from posting the send to the receiver's event, one message at a time.
    pub latency: SimTime,
    /// Messages per second of simulated time, `window` in flight.
    pub rate: f64,
    /// Receiver software time per message (wall clock, this machine).
    pub host_per_msg: Duration,
    /// Messages the hardware matched (of `2 × count`).
    pub hw_matched: u64,
}

/// Matching latency and rate on a two-node fabric built from `cfg`, with `depth` non-matching receives posted ahead of every
/// matching one; `size`-byte eager messages, `count` messages per figure.
pub fn matching(
    cfg: &FabricConfig,
    m: Matching,
    depth: u32,
    size: u32,
    count: u32,
) -> Result<MatchPoint, Error> {
    let size = size.min(RECV_LEN);
    let mut b = bench(cfg, m, RECV_LEN, 1 << 20)?;
    b.fill(depth)?;
    let mut got = Vec::new();
    let mut sent = 0;
    // Latency: one message at a time, its receive posted just before.
    let start = b.fabric.now();
    for _ in 0..count {
        let (rid, sid) = (b.id(), b.id());
        b.r.recv(rid, HIT, u64::MAX, 1 << 19, RECV_LEN)?;
        b.s.send(sid, 0, HIT, 0, size)?;
        got.clear();
        while got.is_empty() {
            if !b.turn(&mut got, &mut sent)? {
                return Err(Error::DeviceIdle("tag bench: message lost"));
            }
        }
    }
    let latency = SimTime((b.fabric.now() - start).ps() / count.max(1) as u64);
    // Rate: up to `window` receives and sends outstanding.
    let window = 32u32;
    let (mut posted, mut sends, mut done) = (0u32, 0u32, 0u32);
    let start = b.fabric.now();
    while done < count {
        while posted < count && posted < done + window {
            let id = b.id();
            b.r.recv(id, HIT, u64::MAX, 1 << 19, RECV_LEN)?;
            posted += 1;
        }
        while sends < posted && sends < done + window {
            let id = b.id();
            b.s.send(id, 0, HIT, 0, size)?;
            sends += 1;
        }
        got.clear();
        if !b.turn(&mut got, &mut sent)? {
            return Err(Error::DeviceIdle("tag bench: message lost"));
        }
        done += got.len() as u32;
    }
    let secs = (b.fabric.now() - start).ps() as f64 * 1e-12;
    Ok(MatchPoint {
        depth,
        latency,
        rate: count as f64 / secs,
        host_per_msg: b.sw_time / b.sw_msgs.max(1) as u32,
        hw_matched: b.r.stats().hw_matched,
    })
}

/// Rendezvous bandwidth: `count` messages of `size` bytes (rendezvous above 4 KiB), `window` in flight, receives
/// posted before the messages arrive (`Hardware`: the NIC reads and sends the FIN) or after
/// (`Software`: they arrive unexpected and software reads and sends the FIN). Returns bits per
/// second of simulated time.
pub fn rendezvous(cfg: &FabricConfig, m: Matching, size: u32, count: u32) -> Result<f64, Error> {
    let mut b = bench(cfg, m, 4096, 2 * size as usize + 4096)?;
    let off = size as u64 + 4096;
    let window = 8u32;
    let (mut posted, mut sends, mut done) = (0u32, 0u32, 0u32);
    let mut got = Vec::new();
    let mut sent = 0;
    let start = b.fabric.now();
    while done < count {
        let ahead = match m {
            Matching::Hardware => posted < done + window,
            Matching::Software => posted < sends && b.r.unexpected_len() > 0,
        };
        if posted < count && ahead {
            let id = b.id();
            b.r.recv(id, HIT, u64::MAX, off, size)?;
            posted += 1;
            continue;
        }
        if sends < count && sends < done + window {
            let id = b.id();
            b.s.send(id, 0, HIT, 0, size)?;
            sends += 1;
            continue;
        }
        got.clear();
        if !b.turn(&mut got, &mut sent)? {
            return Err(Error::DeviceIdle("tag bench: message lost"));
        }
        done += got.len() as u32;
    }
    let secs = (b.fabric.now() - start).ps() as f64 * 1e-12;
    Ok(count as f64 * size as f64 * 8.0 / secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> FabricConfig {
        FabricConfig::new(2, 1)
    }

    #[test]
    fn hardware_matching_walks_the_list_and_software_does_not_charge_the_nic() {
        let hw0 = matching(&cfg(), Matching::Hardware, 0, 64, 20).unwrap();
        let hw256 = matching(&cfg(), Matching::Hardware, 256, 64, 20).unwrap();
        let sw256 = matching(&cfg(), Matching::Software, 256, 64, 20).unwrap();
        assert_eq!(hw0.hw_matched, 40);
        assert_eq!(hw256.hw_matched, 40);
        assert_eq!(sw256.hw_matched, 0);
        // 256 more entries compared at 2 ns each: about 512 ns more per message.
        let extra = hw256.latency.ps() as i64 - hw0.latency.ps() as i64;
        assert!((400_000..700_000).contains(&extra), "extra {extra} ps");
        assert!(hw256.rate < hw0.rate);
    }

    #[test]
    fn rendezvous_moves_the_bytes_both_ways() {
        let hw = rendezvous(&cfg(), Matching::Hardware, 65536, 16).unwrap();
        let sw = rendezvous(&cfg(), Matching::Software, 65536, 16).unwrap();
        assert!(hw > 1e9 && sw > 1e9, "{hw} {sw}");
    }
}
