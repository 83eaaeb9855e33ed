//! The discrete-event core: a queue of events totally ordered by (time, sequence).
//!
//! Simulated time is integer picoseconds ([`SimTime`]). Events scheduled for the same instant
//! fire in the order they were scheduled, so a run is a pure function of its inputs.

use ringbell_specs::SimTime;

/// One pending event: its order key and the slab slot of its payload.
#[derive(Clone, Copy)]
struct Entry {
    /// `time << 64 | sequence`: the total order of events as one integer.
    key: u128,
    slot: u32,
}

/// Buckets of the radix heap: bucket 0 holds keys equal to the last key taken out, bucket
/// `b` (1..=128) keys whose highest bit differing from it is bit `b - 1`.
const BUCKETS: usize = 129;

/// A queue of events ordered by (time, sequence number).
///
/// A monotone radix heap: no event is ever scheduled before the last one taken out (times in
/// the past are clamped to now, and sequence numbers only grow), so keys can be kept in
/// buckets by the highest bit in which they differ from the last key taken out. A push is
/// one append; a pop takes the smallest key of the lowest non-empty bucket and spreads that
/// bucket over the lower ones, so each event moves a few times at most whatever the number
/// pending, and a bucket is a plain vector walked in order. The events themselves sit in a
/// slab whose slots are reused: nothing is allocated once the queue has grown to the largest
/// number of pending events.
pub struct EventQueue<E> {
    buckets: Vec<Vec<Entry>>,
    /// Bit `b` set: bucket `b` is not empty.
    occupied: [u64; 3],
    /// The key of the last event taken out (the base the buckets are relative to).
    last: u128,
    len: usize,
    slab: Vec<Option<E>>,
    free: Vec<u32>,
    seq: u64,
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
            buckets: (0..BUCKETS).map(|_| Vec::new()).collect(),
            occupied: [0; 3],
            last: 0,
            len: 0,
            slab: Vec::new(),
            free: Vec::new(),
            seq: 0,
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

    fn bucket_of(&self, key: u128) -> usize {
        (128 - (key ^ self.last).leading_zeros()) as usize
    }

    fn place(&mut self, e: Entry) {
        let b = self.bucket_of(e.key);
        self.buckets[b].push(e);
        self.occupied[b / 64] |= 1 << (b % 64);
    }

    /// Schedules `ev` at `at`; a time in the past is clamped to now.
    pub fn push(&mut self, at: SimTime, ev: E) {
        let at = at.max(self.now);
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
        let key = u128::from(at.ps()) << 64 | u128::from(self.seq);
        self.seq += 1;
        self.len += 1;
        self.place(Entry { key, slot });
    }

    /// Brings the smallest pending key into bucket 0 (and makes it the base, so only a pop
    /// may call this: a push may not go below the base); false if nothing is pending.
    fn settle(&mut self) -> bool {
        if !self.buckets[0].is_empty() {
            return true;
        }
        let Some(b) = (0..3).find_map(|w| {
            let bits = self.occupied[w] & !u64::from(w == 0);
            (bits != 0).then(|| w * 64 + bits.trailing_zeros() as usize)
        }) else {
            return false;
        };
        let mut moving = std::mem::take(&mut self.buckets[b]);
        self.occupied[b / 64] &= !(1 << (b % 64));
        self.last = moving.iter().map(|e| e.key).min().unwrap_or(self.last);
        // Every key of bucket b shares the bits above b - 1 with the new base, so each
        // lands in a lower bucket: the smallest in bucket 0.
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
        let b = (0..3).find_map(|w| {
            let bits = self.occupied[w];
            (bits != 0).then(|| w * 64 + bits.trailing_zeros() as usize)
        })?;
        let key = self.buckets[b].iter().map(|e| e.key).min()?;
        Some(SimTime((key >> 64) as u64))
    }
    /// Removes the next event and advances the clock to its time.
    pub fn pop(&mut self) -> Option<(SimTime, E)> {
        if !self.settle() {
            return None;
        }
        let e = self.buckets[0].pop()?;
        if self.buckets[0].is_empty() {
            self.occupied[0] &= !1;
        }
        self.len -= 1;
        let at = SimTime((e.key >> 64) as u64);
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
