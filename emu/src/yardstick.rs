//! Yardsticks: two fixed pieces of work timed in the same run as a benchmark, so that a
//! wall-clock figure can be given as a ratio that holds from one machine to another of the
//! same class (a slower machine is slower at both).
//!
//! - **memcpy**: copying a 64 MiB buffer (beyond the caches), in nanoseconds per 4 KiB.
//! - **chase**: dependent loads through a random cycle over 8 MiB of `u32` indices, in
//!   nanoseconds per load (the latency of a cache miss, what an event queue and scattered
//!   per-QP state cost).
//!
//! - **loop**: 100 steps of a dependent multiply-xor-rotate chain through a 4 KiB table
//!   (all in the first-level cache), in nanoseconds: the core's speed on the emulator's kind
//!   of work, branchy integer code over data the caches hold, with no memory system in it.
//!
//! Each is the best of a few repetitions (the least disturbed by other load). The chase's
//! table is an anonymous mapping of its own, unmapped when done: 8 MiB taken from the heap
//! and freed would stay with the allocator, already faulted in, and a benchmark run after
//! the yardstick would find that much heap for free (the first size `coll` ran did: its
//! 64-rank group was built in memory the chase had faulted in, the 1024-rank group mostly
//! in fresh pages).

use memmap2::MmapMut;
use std::time::Instant;
use zerocopy::FromBytes;

/// Yardsticks measured now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yardstick {
    /// Nanoseconds to copy 4 KiB within a 64 MiB copy.
    pub memcpy_ns_per_4k: f64,
    /// Nanoseconds per dependent load of the pointer chase.
    pub chase_ns: f64,
    /// Nanoseconds per 100 steps of the cached integer loop.
    pub loop_ns: f64,
}

const COPY_BYTES: usize = 64 << 20;
const CHASE_ENTRIES: usize = 2 << 20;
const CHASE_STEPS: usize = 4 << 20;
const REPEATS: usize = 3;
const LOOP_STEPS: usize = 4 << 20;

impl Yardstick {
    /// Measures all three (about a quarter of a second on a current machine).
    pub fn measure() -> Yardstick {
        Yardstick {
            memcpy_ns_per_4k: best(|| memcpy_once() / (COPY_BYTES / 4096) as f64),
            chase_ns: best(chase_once),
            loop_ns: best(loop_once),
        }
    }

    /// `ns` as a multiple of one chase load.
    pub fn in_chases(&self, ns: f64) -> f64 {
        ns / self.chase_ns
    }

    /// `ns` as a multiple of one run of the cached loop (100 steps).
    pub fn in_loops(&self, ns: f64) -> f64 {
        ns / self.loop_ns
    }

    /// One line for a report.
    pub fn describe(&self) -> String {
        format!(
            "yardsticks: memcpy {:.1} ns per 4 KiB, pointer chase {:.2} ns per load, loop {:.1} ns per 100 steps",
            self.memcpy_ns_per_4k, self.chase_ns, self.loop_ns
        )
    }
}

fn best(f: impl Fn() -> f64) -> f64 {
    (0..REPEATS).map(|_| f()).fold(f64::INFINITY, f64::min)
}

/// Nanoseconds for one copy of `COPY_BYTES`.
fn memcpy_once() -> f64 {
    // 64 MiB is above the most glibc's allocator ever serves from its heap: these buffers
    // are mappings of their own already, returned to the system when dropped.
    let src = vec![0x5Au8; COPY_BYTES];
    // Touched first: the copy is timed, not the page faults of fresh memory.
    let mut dst = vec![0xA5u8; COPY_BYTES];
    let t = Instant::now();
    dst.copy_from_slice(&src);
    let ns = t.elapsed().as_nanos() as f64;
    std::hint::black_box(&dst);
    ns
}

/// `bytes` of fresh anonymous memory outside the heap (None if the system refuses it).
fn anon(bytes: usize) -> Option<MmapMut> {
    MmapMut::map_anon(bytes).ok()
}

/// Nanoseconds per 100 steps of a dependent chain: each step loads a word of a 4 KiB
/// table chosen by the running value, and mixes it in with a rotation and a multiply.
fn loop_once() -> f64 {
    let mut table = [0u64; 512];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for t in table.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *t = x;
    }
    let table = std::hint::black_box(table);
    let t = Instant::now();
    for _ in 0..LOOP_STEPS {
        x = (table[(x >> 55) as usize] ^ x.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    let ns = t.elapsed().as_nanos() as f64;
    std::hint::black_box(x);
    ns * 100.0 / LOOP_STEPS as f64
}

/// Makes `next` a successor table forming one cycle through all its entries (Sattolo's
/// shuffle), from a fixed xorshift stream.
fn cycle(next: &mut [u32]) {
    let n = next.len();
    for (i, v) in next.iter_mut().enumerate() {
        *v = i as u32;
    }
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = (x % i as u64) as usize;
        next.swap(i, j);
    }
}

/// Nanoseconds per step of a dependent walk through one random cycle.
fn chase_once() -> f64 {
    let Some(mut map) = anon(CHASE_ENTRIES * 4) else {
        return f64::NAN;
    };
    // A mapping is page-aligned and its length a multiple of 4: the view always exists.
    let Ok(next) = <[u32]>::mut_from_bytes(&mut map[..]) else {
        return f64::NAN;
    };
    cycle(next);
    let mut at = 0u32;
    let t = Instant::now();
    for _ in 0..CHASE_STEPS {
        at = next[at as usize];
    }
    let ns = t.elapsed().as_nanos() as f64;
    std::hint::black_box(at);
    ns / CHASE_STEPS as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chase_visits_every_entry_once() {
        let n = 1000usize;
        let mut next = vec![0u32; n];
        cycle(&mut next);
        let mut seen = vec![false; n];
        let mut at = 0usize;
        for _ in 0..n {
            assert!(!seen[at]);
            seen[at] = true;
            at = next[at] as usize;
        }
        assert_eq!(at, 0);
        assert!(seen.iter().all(|&s| s));
    }
}
