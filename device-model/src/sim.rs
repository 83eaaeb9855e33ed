//! The discrete-event core: a queue of events totally ordered by (time, sequence).
//!
//! Simulated time is integer picoseconds ([`SimTime`]). Events scheduled for the same instant
//! fire in the order they were scheduled, so a run is a pure function of its inputs.

use ringbell_specs::SimTime;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// What the heap orders: the time, the sequence number and the slab slot of the payload.
/// Small and `Copy`, so that sifting moves 24 bytes whatever the events hold.
#[derive(Clone, Copy)]
struct Key {
    at: SimTime,
    seq: u64,
    slot: u32,
}

impl PartialEq for Key {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at && self.seq == o.seq
    }
}
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Key {
    fn cmp(&self, o: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap and we want the earliest first.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// A queue of events ordered by (time, sequence number).
///
/// The heap holds small keys; the events themselves sit in a slab whose slots are reused,
/// so a push or pop costs a logarithmic number of 24-byte moves and no allocation once the
/// slab has grown to the largest number of pending events.
pub struct EventQueue<E> {
    heap: BinaryHeap<Key>,
    slab: Vec<Option<E>>,
    free: Vec<u32>,
    seq: u64,
    now: SimTime,
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("len", &self.heap.len())
            .field("now", &self.now)
            .finish()
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
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
        self.heap.push(Key {
            at,
            seq: self.seq,
            slot,
        });
        self.seq += 1;
    }
    /// The time of the next event, if any.
    pub fn peek_time(&self) -> Option<SimTime> {
        self.heap.peek().map(|k| k.at)
    }
    /// Removes the next event and advances the clock to its time.
    pub fn pop(&mut self) -> Option<(SimTime, E)> {
        let k = self.heap.pop()?;
        self.now = k.at;
        let ev = self.slab[k.slot as usize].take()?;
        self.free.push(k.slot);
        Some((k.at, ev))
    }
    /// Advances the clock to `t` without an event (no-op if `t` is in the past).
    pub fn advance_to(&mut self, t: SimTime) {
        self.now = self.now.max(t);
    }
    /// Number of pending events.
    pub fn len(&self) -> usize {
        self.heap.len()
    }
    /// Whether no event is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
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
