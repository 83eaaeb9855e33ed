//! The discrete-event core: a queue of events totally ordered by (time, sequence).
//!
//! Simulated time is integer picoseconds ([`SimTime`]). Events scheduled for the same instant
//! fire in the order they were scheduled, so a run is a pure function of its inputs.

use ringbell_specs::SimTime;

/// One pending event: its time and the slab slot of its payload.
#[derive(Clone, Copy)]
struct Entry {
    at: u64,
    slot: u32,
}

/// Bits per digit of the radix heap: times are compared 4 bits at a time.
const DIGIT: u32 = 4;
/// Digits in a 64-bit time.
const LEVELS: usize = 64 / DIGIT as usize;
/// Values of one digit.
const RADIX: usize = 1 << DIGIT;
/// Buckets of the radix heap: bucket 0 holds the events at the time of the last one taken
/// out; bucket `1 + RADIX * l + v` the times whose highest digit differing from it is digit
/// `l` (bits `4l..4l+4`), with value `v` there.
const BUCKETS: usize = 1 + LEVELS * RADIX;
/// Words of the bitmap of non-empty buckets.
const WORDS: usize = BUCKETS.div_ceil(64);

/// A queue of events ordered by (time, sequence number).
///
/// A monotone radix heap over picosecond times, with 4-bit digits: no event is ever
/// scheduled before the last one taken out (times in the past are clamped to now), so
/// events can be kept in buckets by the highest digit in which their time differs from that
/// of the last one taken out, and by their value of that digit. Bucket order is time order:
/// every time in a bucket is below every time in a later one. A push is one append; a pop
/// takes the front of bucket 0, and when bucket 0 is empty, first makes the earliest time
/// of the lowest non-empty bucket the base and spreads that bucket over the lower ones.
/// An event moves only to a lower digit, so at most once per digit its time has below the
/// highest one it differs in; with times a few microseconds ahead, once or twice (with
/// 1-bit digits it was three times on average in a small WRITE's traffic).
///
/// Every bucket holds its events in the order they were pushed: a push appends, and a
/// bucket is only ever spread into buckets that are empty at that moment, in order. So
/// bucket 0, whose events share one time, gives them out first in, first out: the order
/// of scheduling among equal times, with no sequence numbers stored. The events themselves
/// sit in a slab whose slots are reused, so nothing is allocated once the queue has grown
/// to the largest number of pending events.
pub struct EventQueue<E> {
    buckets: Box<[Vec<Entry>; BUCKETS]>,
    /// How many entries at the front of bucket 0 were already taken out.
    head: usize,
    /// Bit `b` set: bucket `b` may be non-empty (bucket 0: has entries from `head` on).
    occupied: [u64; WORDS],
    /// The time of the last event taken out (the base the buckets are relative to).
    last: u64,
    len: usize,
    slab: Vec<Option<E>>,
    free: Vec<u32>,
    now: SimTime,
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("len", &self.len)
            .field("now", &self.now)
            .finish()
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            buckets: Box::new(std::array::from_fn(|_| Vec::new())),
            head: 0,
            occupied: [0; WORDS],
            last: 0,
            len: 0,
            slab: Vec::new(),
            free: Vec::new(),
            now: SimTime::ZERO,
        }
    }
}

impl<E> EventQueue<E> {
    /// An empty queue at time zero.
    pub fn new() -> Self {
        Self::default()
    }
    /// The time of the last event popped.
    pub fn now(&self) -> SimTime {
        self.now
    }

    /// The bucket of time `at` (not below the base).
    fn bucket_of(&self, at: u64) -> usize {
        let diff = at ^ self.last;
        if diff == 0 {
            return 0;
        }
        let level = (63 - diff.leading_zeros()) / DIGIT;
        let digit = (at >> (level * DIGIT)) as usize & (RADIX - 1);
        1 + level as usize * RADIX + digit
    }

    fn place(&mut self, e: Entry) {
        let b = self.bucket_of(e.at);
        self.buckets[b].push(e);
        self.occupied[b / 64] |= 1 << (b % 64);
    }

    /// Schedules `ev` at `at`; a time in the past is clamped to now.
    #[inline]
    pub fn push(&mut self, at: SimTime, ev: E) {
        let at = at.max(self.now).ps().max(self.last);
        let slot = match self.free.pop() {
            Some(s) => {
                self.slab[s as usize] = Some(ev);
                s
            }
            None => {
                self.slab.push(Some(ev));
                (self.slab.len() - 1) as u32
            }
        };
        self.len += 1;
        self.place(Entry { at, slot });
    }

    /// The lowest non-empty bucket above 0.
    fn lowest_above_zero(&self) -> Option<usize> {
        let first = self.occupied[0] & !1;
        if first != 0 {
            return Some(first.trailing_zeros() as usize);
        }
        self.occupied[1..]
            .iter()
            .position(|&w| w != 0)
            .map(|i| (i + 1) * 64 + self.occupied[i + 1].trailing_zeros() as usize)
    }

    /// Makes bucket 0 hold the earliest events (their time the base); only a pop may call
    /// this, since a push may not go below the base. False if nothing is pending.
    #[inline]
    fn settle(&mut self) -> bool {
        self.head < self.buckets[0].len() || self.refill()
    }

    /// [`EventQueue::settle`] once bucket 0 is used up: takes the next bucket down to 0.
    #[inline(never)]
    fn refill(&mut self) -> bool {
        self.buckets[0].clear();
        self.head = 0;
        self.occupied[0] &= !1;
        let Some(b) = self.lowest_above_zero() else {
            return false;
        };
        self.occupied[b / 64] &= !(1 << (b % 64));
        if let [only] = self.buckets[b][..] {
            // One event: it is the earliest, and no other bucket changes with the base
            // (every other time differs from the new base in the same digit, with the same
            // value, as from the old one), so it is taken from where it is.
            self.buckets[b].clear();
            self.last = only.at;
            self.buckets[0].push(only);
            self.occupied[0] |= 1;
            return true;
        }
        let mut moving = std::mem::take(&mut self.buckets[b]);
        self.last = moving.iter().map(|e| e.at).min().unwrap_or(self.last);
        // Every time in bucket b shares the digits above its level, and its digit there,
        // with the new base, so each lands in a lower bucket, all empty now, in the order
        // it had: the earliest in 0.
        for e in moving.drain(..) {
            self.place(e);
        }
        // Keep the vector's capacity for the bucket's next use.
        if self.buckets[b].is_empty() {
            self.buckets[b] = moving;
        }
        true
    }

    /// The time of the next event, if any. Looks without settling: an event may still be
    /// pushed before the one found here.
    pub fn peek_time(&self) -> Option<SimTime> {
        if self.head < self.buckets[0].len() {
            return Some(SimTime(self.last));
        }
        let b = self.lowest_above_zero()?;
        self.buckets[b].iter().map(|e| SimTime(e.at)).min()
    }
    /// Removes the next event and advances the clock to its time.
    #[inline]
    pub fn pop(&mut self) -> Option<(SimTime, E)> {
        if !self.settle() {
            return None;
        }
        let e = *self.buckets[0].get(self.head)?;
        self.head += 1;
        self.len -= 1;
        let at = SimTime(e.at);
        self.now = at;
        let ev = self.slab[e.slot as usize].take()?;
        self.free.push(e.slot);
        Some((at, ev))
    }
    /// Advances the clock to `t` without an event (no-op if `t` is in the past).
    pub fn advance_to(&mut self, t: SimTime) {
        self.now = self.now.max(t);
    }
    /// Number of pending events.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether no event is pending.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pops_in_time_then_insertion_order(times in proptest::collection::vec(0u64..50, 0..200)) {
            let mut q = EventQueue::new();
            for (i, t) in times.iter().enumerate() {
                q.push(SimTime(*t), i);
            }
            let mut expect: Vec<(u64, usize)> = times.iter().copied().zip(0..).collect();
            expect.sort();
            let mut got = Vec::new();
            while let Some((t, i)) = q.pop() {
                got.push((t.ps(), i));
            }
            prop_assert_eq!(got, expect);
        }

        #[test]
        fn far_and_near_times_interleaved_with_peeks(
            ops in proptest::collection::vec((0u8..4, 0u32..64, any::<u64>()), 0..400)
        ) {
            // Deltas from 0 to 2^63 ps (keys differing in any bit of the time), pushes, pops,
            // peeks and clock advances, against a sorted list.
            let mut q = EventQueue::new();
            let mut model: Vec<(u64, u64, usize)> = Vec::new();
            let (mut seq, mut now) = (0u64, 0u64);
            for (i, (kind, shift, r)) in ops.into_iter().enumerate() {
                model.sort();
                match kind {
                    0 | 1 => {
                        let dt = if shift == 0 { 0 } else { r >> shift.min(63) };
                        let at = now.saturating_add(dt);
                        q.push(SimTime(at), i);
                        model.push((at, seq, i));
                        seq += 1;
                    }
                    2 => {
                        let want = if model.is_empty() { None } else { Some(model.remove(0)) };
                        let got = q.pop();
                        prop_assert_eq!(got.map(|(t, e)| (t.ps(), e)), want.map(|(t, _, e)| (t, e)));
                        if let Some((t, _, _)) = want {
                            now = t;
                        }
                    }
                    _ => {
                        prop_assert_eq!(q.peek_time().map(|t| t.ps()), model.first().map(|m| m.0));
                        // The clock may move ahead with nothing happening, up to the next event.
                        let to = now.saturating_add(r >> 40);
                        let to = model.first().map_or(to, |m| to.min(m.0));
                        q.advance_to(SimTime(to));
                        now = now.max(to);
                    }
                }
                prop_assert_eq!(q.len(), model.len());
                prop_assert_eq!(q.is_empty(), model.is_empty());
            }
        }

        #[test]
        fn interleaved_pushes_and_pops_keep_the_order(ops in proptest::collection::vec((0u64..40, any::<bool>()), 0..300)) {
            // Against a sorted list: slots are reused while events are pending.
            let mut q = EventQueue::new();
            let mut model: Vec<(u64, u64, usize)> = Vec::new();
            let (mut seq, mut now) = (0u64, 0u64);
            for (i, (dt, pop)) in ops.into_iter().enumerate() {
                if pop {
                    model.sort();
                    let want = if model.is_empty() { None } else { Some(model.remove(0)) };
                    let got = q.pop();
                    prop_assert_eq!(got.map(|(t, e)| (t.ps(), e)), want.map(|(t, _, e)| (t, e)));
                    if let Some((t, _, _)) = want {
                        now = t;
                    }
                } else {
                    let at = now + dt;
                    q.push(SimTime(at), i);
                    model.push((at, seq, i));
                    seq += 1;
                }
                prop_assert_eq!(q.len(), model.len());
            }
        }
    }
}
