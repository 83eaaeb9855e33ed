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

/// Width of the low digits of the radix heap, and how many there are: times are compared 4
/// bits at a time up to 65 ns.
const NARROW: u32 = 4;
const NARROW_LEVELS: usize = 4;
/// Width of the digits above them. The events pending are mostly those of the next
/// microsecond or so: with 4-bit digits throughout, the times of about half of them crossed
/// a boundary of the digit above 65 ns (every 1.05 µs) and had to be moved once more after
/// they were pushed; with that digit 7 bits wide (a boundary every 8.4 µs), few do (8-bit
/// digits everywhere were tried before, and were no gain: every time then has 256 buckets
/// per level to spread over).
const WIDE: u32 = 7;
/// Digits in a 64-bit time (the last one narrower).
const LEVELS: usize =
    NARROW_LEVELS + (64 - NARROW_LEVELS * NARROW as usize).div_ceil(WIDE as usize);
/// Each digit, lowest first: its lowest bit and its width.
const DIGITS: [(u32, u32); LEVELS] = {
    let mut d = [(0, 0); LEVELS];
    let (mut l, mut shift) = (0, 0);
    while l < LEVELS {
        let w = if l < NARROW_LEVELS { NARROW } else { WIDE };
        let w = if shift + w > 64 { 64 - shift } else { w };
        d[l] = (shift, w);
        shift += w;
        l += 1;
    }
    d
};
/// The first bucket of each level: level `l` has a bucket for each value of its digit.
const FIRST: [usize; LEVELS + 1] = {
    let mut f = [0; LEVELS + 1];
    let mut l = 0;
    while l < LEVELS {
        f[l + 1] = f[l] + (1 << DIGITS[l].1);
        l += 1;
    }
    f
};
/// Buckets of the radix heap: bucket `FIRST[l] + v` holds the times whose highest digit
/// differing from the base is digit `l`, with value `v` there.
const BUCKETS: usize = FIRST[LEVELS];
/// For each bit of a time: the digit it belongs to, as its first bucket (low 16 bits), its
/// shift (next 8) and its mask (top 8), so that a time's bucket is one lookup by its highest
/// bit differing from the base.
const BY_BIT: [u32; 64] = {
    let mut t = [0u32; 64];
    let mut l = 0;
    while l < LEVELS {
        let (shift, width) = DIGITS[l];
        let mut bit = shift;
        while bit < shift + width {
            t[bit as usize] = FIRST[l] as u32 | shift << 16 | ((1 << width) - 1) << 24;
            bit += 1;
        }
        l += 1;
    }
    t
};
/// For each bucket: the lowest bit of its digit. Its times share every bit from there up, so
/// when it becomes the run, the run's block is `2^shift` picoseconds wide.
const SHIFT_OF: [u8; BUCKETS] = {
    let mut t = [0u8; BUCKETS];
    let mut l = 0;
    while l < LEVELS {
        let mut b = FIRST[l];
        while b < FIRST[l + 1] {
            t[b] = DIGITS[l].0 as u8;
            b += 1;
        }
        l += 1;
    }
    t
};
/// Events every bucket has room for when the queue is made.
const BUCKET_ROOM: usize = 8;
/// Words of the bitmap of non-empty buckets.
const WORDS: usize = BUCKETS.div_ceil(64);
/// The most events a bucket may hold to become the run by sorting (more are spread over the
/// buckets below it, as a radix heap does), and the most the run may hold before an event
/// is scheduled into a block wider than one instant (then it is spread likewise): a sorted
/// insertion costs up to the run's length.
const RUN_MAX: usize = 32;

/// A queue of events ordered by (time, sequence number).
///
/// A monotone radix heap over picosecond times, with 4-bit digits up to 65 ns and 7-bit
/// ones above, whose lowest part is one sorted run. No event is ever scheduled before the
/// last one taken out (times in the past are clamped to now), so events can be kept in
/// buckets by the highest digit in which their time differs from that base, and by their
/// value of that digit. Bucket order is time order: every time in a bucket is below every
/// time in a later one.
///
/// The events being taken out are the run: those of one block of times, the aligned block
/// of `2^run_shift` picoseconds around the base, sorted. When the run is used up, the
/// lowest non-empty bucket becomes the next run: its times share every digit from its level
/// up, so they fill the block of that level around their earliest time, and every time in
/// the other buckets lies above that block and keeps its bucket while the base moves within
/// the block. A bucket of a few events is sorted in place (a small WRITE's traffic keeps
/// about six in the lowest bucket); a larger one is spread over the buckets below it from
/// its earliest time, as a plain radix heap does, leaving the run those at that instant.
/// A pop then takes the run's front; a push into the block is a sorted insertion, anything
/// later an append to its bucket. So an event is moved once or twice where spreading moved
/// it at every digit it shared with the base (with 4-bit digits and times a few
/// microseconds ahead, 2.3 times on average, each with a search for the lowest bucket).
///
/// Every bucket holds its events in the order they were pushed: a push appends, and
/// spreading places events, in the order they had, into buckets that are empty at that
/// moment. A stable sort and an insertion behind equal times keep the run in that order
/// too, so events of one time come out first in, first out: the order of scheduling, with
/// no sequence numbers stored. The events themselves sit in a slab whose slots are reused,
/// so nothing is allocated once the queue has grown to the largest number of pending events.
pub struct EventQueue<E> {
    /// The events of the block being taken out, sorted by time, from `head` on.
    run: Vec<Entry>,
    /// How many entries at the front of the run were already taken out.
    head: usize,
    /// The run's block: the times that agree with the base from this bit up.
    run_shift: u32,
    buckets: Box<[Vec<Entry>; BUCKETS]>,
    /// Bit `b` set: bucket `b` may be non-empty.
    occupied: [u64; WORDS],
    /// The base the buckets are relative to: the time of the last event taken out, or of
    /// the earliest in the run; always within the run's block.
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
            head: 0,
            run_shift: 0,
            // Room for a few events in every bucket from the start: which buckets a run
            // uses moves with the absolute time (a digit's value), so without it a bucket
            // first reached late in a run would allocate then, on the event path.
            buckets: Box::new(std::array::from_fn(|_| Vec::with_capacity(BUCKET_ROOM))),
            run: Vec::with_capacity(RUN_MAX + 1),
            occupied: [0; WORDS],
            last: 0,
            len: 0,
            slab: Vec::new(),
            free: Vec::new(),
            now: SimTime::ZERO,
        }
    }
}

/// Sorts `v` by time, keeping the order of equal times: an insertion sort, since a bucket
/// becomes the run only when it is short (in a small WRITE's traffic, six events or so, each
/// one landing about two places from where it was pushed).
fn sort_by_time(v: &mut [Entry]) {
    for i in 1..v.len() {
        let e = v[i];
        let mut j = i;
        while j > 0 && v[j - 1].at > e.at {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = e;
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

    /// The bucket of time `at`, which lies outside the run's block (so above the base).
    fn bucket_of(&self, at: u64) -> usize {
        let diff = at ^ self.last;
        let d = BY_BIT[(63 - (diff | 1).leading_zeros()) as usize];
        let digit = (at >> ((d >> 16) & 63)) as u32 & (d >> 24);
        (d & 0xFFFF) as usize + digit as usize
    }

    fn place(&mut self, e: Entry) {
        let b = self.bucket_of(e.at);
        if let Some(bucket) = self.buckets.get_mut(b) {
            bucket.push(e);
            self.occupied[b / 64] |= 1 << (b % 64);
        }
    }

    /// Schedules `ev` at `at`; a time in the past is clamped to now.
    #[inline(always)]
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
        let e = Entry { at, slot };
        if (at ^ self.last) >> self.run_shift == 0 {
            self.insert_in_run(e);
        } else {
            self.place(e);
        }
    }

    /// Inserts `e`, whose time lies in the run's block, behind every run entry not later
    /// than it. Events are mostly scheduled later than those already pending, so the
    /// place is looked for from the back.
    fn insert_in_run(&mut self, e: Entry) {
        if self.run.len() - self.head >= RUN_MAX && self.run_shift > 0 {
            self.narrow_run();
            if e.at != self.last {
                self.place(e);
                return;
            }
        }
        let mut i = self.run.len();
        while i > self.head && self.run.get(i - 1).is_some_and(|r| r.at > e.at) {
            i -= 1;
        }
        self.run.insert(i, e);
    }

    /// Shrinks the run's block to the base's instant: the run keeps the entries at the base
    /// (its front), and the later ones go to the buckets, all empty below the block's level,
    /// in their order (so equal times stay first in, first out).
    #[cold]
    fn narrow_run(&mut self) {
        let mut run = std::mem::take(&mut self.run);
        let keep = self.head + run[self.head..].partition_point(|r| r.at == self.last);
        for &e in &run[keep..] {
            self.place(e);
        }
        run.truncate(keep);
        self.run = run;
        self.run_shift = 0;
    }

    /// The lowest non-empty bucket.
    fn lowest(&self) -> Option<usize> {
        let w = self.occupied.iter().position(|&w| w != 0)?;
        Some(w * 64 + self.occupied[w].trailing_zeros() as usize)
    }

    /// Makes the lowest non-empty bucket the run once the run is used up; only a pop may
    /// call this, since it moves the base to the earliest pending time. False if nothing
    /// is pending.
    #[inline(never)]
    fn refill(&mut self) -> bool {
        let Some(b) = self.lowest() else {
            return false;
        };
        self.occupied[b / 64] &= !(1 << (b % 64));
        self.run.clear();
        self.head = 0;
        let Some(bucket) = self.buckets.get_mut(b) else {
            return false;
        };
        if bucket.len() <= RUN_MAX {
            // Its times share every digit from its level up: they are the block of that
            // level around the earliest of them.
            // Copied, not swapped: each vector keeps the capacity its use has grown, so a
            // run of the steady state allocates nothing.
            self.run.extend_from_slice(bucket);
            bucket.clear();
            sort_by_time(&mut self.run);
            self.run_shift = SHIFT_OF.get(b).map_or(0, |&s| u32::from(s));
            self.last = self.run.first().map_or(self.last, |e| e.at);
            return true;
        }
        let mut moving = std::mem::take(bucket);
        self.last = moving.iter().map(|e| e.at).min().unwrap_or(self.last);
        self.run_shift = 0;
        // Every time in bucket b shares the digits above its level, and its digit there,
        // with the new base, so each lands in a lower bucket, all empty now, in the order it
        // had: the earliest in the run.
        for e in moving.drain(..) {
            if e.at == self.last {
                self.run.push(e);
            } else {
                self.place(e);
            }
        }
        // Keep the vector's capacity for the bucket's next use.
        if let Some(bucket) = self.buckets.get_mut(b) {
            if bucket.is_empty() {
                *bucket = moving;
            }
        }
        true
    }

    /// The time of the next event, if any. Looks without settling: an event may still be
    /// pushed before the one found here.
    pub fn peek_time(&self) -> Option<SimTime> {
        if let Some(e) = self.run.get(self.head) {
            return Some(SimTime(e.at));
        }
        let b = self.lowest()?;
        self.buckets[b].iter().map(|e| SimTime(e.at)).min()
    }
    /// Removes the next event and advances the clock to its time.
    #[inline]
    pub fn pop(&mut self) -> Option<(SimTime, E)> {
        if self.head >= self.run.len() && !self.refill() {
            return None;
        }
        let e = *self.run.get(self.head)?;
        self.head += 1;
        self.len -= 1;
        self.last = e.at;
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

    /// Runs `ops` on a queue and on a sorted list of (time, push order, event): `None` pops
    /// (checked against the list's first), `Some(dt)` pushes an event `dt` ps after the time
    /// of the last one popped; the lengths agree after every step, and the queue gives out
    /// what is left in the list's order.
    fn against_sorted_list(
        ops: impl IntoIterator<Item = Option<u64>>,
    ) -> Result<(), TestCaseError> {
        let mut q = EventQueue::new();
        let mut model: Vec<(u64, u64, usize)> = Vec::new();
        let (mut seq, mut now) = (0u64, 0u64);
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                None => {
                    model.sort();
                    let want = if model.is_empty() {
                        None
                    } else {
                        Some(model.remove(0))
                    };
                    let got = q.pop();
                    prop_assert_eq!(got.map(|(t, e)| (t.ps(), e)), want.map(|(t, _, e)| (t, e)));
                    if let Some((t, _, _)) = want {
                        now = t;
                    }
                }
                Some(dt) => {
                    let at = now + dt;
                    q.push(SimTime(at), i);
                    model.push((at, seq, i));
                    seq += 1;
                }
            }
            prop_assert_eq!(q.len(), model.len());
        }
        model.sort();
        for (t, _, e) in model {
            prop_assert_eq!(q.pop().map(|(t, e)| (t.ps(), e)), Some((t, e)));
        }
        prop_assert!(q.pop().is_none());
        Ok(())
    }

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
        fn crowded_blocks_keep_the_order(
            ops in proptest::collection::vec((0u64..600, 0u8..4), 0..800)
        ) {
            // Many events a few hundred ps apart, three pushes to a pop: buckets too full to
            // sort, which are spread, and runs that grow past RUN_MAX and are narrowed.
            // Every fourth push is at the current instant, the rest just ahead.
            against_sorted_list(ops.into_iter().map(|(dt, kind)| {
                (kind != 0).then_some(if dt % 4 == 0 { 0 } else { dt })
            }))?;
        }

        #[test]
        fn interleaved_pushes_and_pops_keep_the_order(ops in proptest::collection::vec((0u64..40, any::<bool>()), 0..300)) {
            // Slots are reused while events are pending.
            against_sorted_list(ops.into_iter().map(|(dt, pop)| (!pop).then_some(dt)))?;
        }
    }
}
