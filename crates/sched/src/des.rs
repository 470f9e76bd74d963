//! The discrete-event core: a clock in integer nanoseconds and a queue of timed events.
//!
//! Events at the same instant leave in the order they were scheduled, so a run is a pure
//! function of its inputs (no hash-order or float-rounding ties).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Simulated time, nanoseconds from the start of the run.
pub type Nanos = u64;

/// Seconds to simulated nanoseconds, rounding to the nearest; negative and NaN give 0 and
/// anything beyond `u64::MAX` ns (584 years) saturates.
pub fn nanos(seconds: f64) -> Nanos {
    let ns = (seconds * 1e9).round();
    if ns.is_nan() || ns <= 0.0 {
        0
    } else if ns >= u64::MAX as f64 {
        u64::MAX
    } else {
        ns as u64
    }
}

/// Simulated nanoseconds to seconds.
pub fn seconds(ns: Nanos) -> f64 {
    ns as f64 * 1e-9
}

struct Entry<E> {
    at: Nanos,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Entry<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<E> Eq for Entry<E> {}
impl<E> PartialOrd for Entry<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Entry<E> {
    // Reversed: `BinaryHeap` is a max-heap and the earliest event must come out first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// A clock and the events still to happen.
pub struct EventQueue<E> {
    now: Nanos,
    seq: u64,
    heap: BinaryHeap<Entry<E>>,
    popped: u64,
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("now", &self.now)
            .field("pending", &self.heap.len())
            .field("popped", &self.popped)
            .finish()
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    /// An empty queue at time 0.
    pub fn new() -> Self {
        Self {
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            popped: 0,
        }
    }

    /// The time of the event last popped.
    pub fn now(&self) -> Nanos {
        self.now
    }

    /// Events popped so far.
    pub fn popped(&self) -> u64 {
        self.popped
    }

    /// Events still pending.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Schedules `event` at `at`; a time in the past is taken as now (time never runs back).
    pub fn at(&mut self, at: Nanos, event: E) {
        let at = at.max(self.now);
        self.heap.push(Entry {
            at,
            seq: self.seq,
            event,
        });
        self.seq += 1;
    }

    /// Schedules `event` `delay` after now.
    pub fn after(&mut self, delay: Nanos, event: E) {
        self.at(self.now.saturating_add(delay), event);
    }

    /// The next event, advancing the clock to it.
    pub fn pop(&mut self) -> Option<(Nanos, E)> {
        let entry = self.heap.pop()?;
        self.now = entry.at;
        self.popped += 1;
        Some((entry.at, entry.event))
    }
}

/// A first-come first-served server of work measured in bytes (a NIC direction, a link):
/// each job starts when the previous one ends and takes `bytes / rate`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FifoLink {
    bytes_per_ns: f64,
    free_at: Nanos,
    /// Bytes carried (or accepted) so far.
    pub bytes: f64,
    /// Nanoseconds spent busy.
    pub busy_ns: u64,
}

impl FifoLink {
    /// A link of `bytes_per_second`.
    pub fn new(bytes_per_second: f64) -> Self {
        Self {
            bytes_per_ns: bytes_per_second * 1e-9,
            free_at: 0,
            bytes: 0.0,
            busy_ns: 0,
        }
    }

    /// Queues `bytes` that are ready at `ready`; returns when they are through.
    pub fn push(&mut self, ready: Nanos, bytes: f64) -> Nanos {
        let start = self.free_at.max(ready);
        let took = nanos(bytes / self.bytes_per_ns * 1e-9);
        self.free_at = start.saturating_add(took);
        self.bytes += bytes;
        self.busy_ns += took;
        self.free_at
    }

    /// Like [`push`](Self::push), for a job whose bytes are produced over `[ready, done]`
    /// (a layer-wise stream): the bytes occupy the link for `bytes / rate` but the job cannot
    /// finish before `done`. Returns its end.
    pub fn push_stream(&mut self, ready: Nanos, done: Nanos, bytes: f64) -> Nanos {
        let start = self.free_at.max(ready);
        let took = nanos(bytes / self.bytes_per_ns * 1e-9);
        self.free_at = start.saturating_add(took);
        self.bytes += bytes;
        self.busy_ns += took;
        self.free_at.max(done)
    }

    /// Bytes queued but not yet through at `now`.
    pub fn queued_bytes(&self, now: Nanos) -> f64 {
        self.free_at.saturating_sub(now) as f64 * self.bytes_per_ns
    }

    /// When the link is next idle.
    pub fn free_at(&self) -> Nanos {
        self.free_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_leave_in_time_order_and_ties_in_schedule_order() {
        let mut q = EventQueue::new();
        q.at(30, 'c');
        q.at(10, 'a');
        q.at(30, 'd');
        q.at(20, 'b');
        let order: Vec<char> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(order, ['a', 'b', 'c', 'd']);
        assert_eq!((q.now(), q.popped()), (30, 4));
    }

    #[test]
    fn the_past_is_now() {
        let mut q = EventQueue::new();
        q.at(100, 1);
        assert_eq!(q.pop(), Some((100, 1)));
        q.at(5, 2);
        assert_eq!(q.pop(), Some((100, 2)));
    }

    #[test]
    fn a_fifo_link_queues_jobs_back_to_back() {
        let mut link = FifoLink::new(1e9); // 1 byte per ns
        assert_eq!(link.push(0, 100.0), 100);
        assert_eq!(link.push(50, 100.0), 200);
        assert!((link.queued_bytes(150) - 50.0).abs() < 1e-9);
        assert_eq!(link.push(500, 10.0), 510);
        // A stream cannot end before its producer.
        assert_eq!(link.push_stream(600, 900, 10.0), 900);
        assert_eq!(link.free_at(), 610);
        assert_eq!(link.busy_ns, 220);
    }

    #[test]
    fn conversions_clamp() {
        assert_eq!(nanos(-1.0), 0);
        assert_eq!(nanos(f64::NAN), 0);
        assert_eq!(nanos(1.5e-9), 2);
        assert_eq!(nanos(1e30), u64::MAX);
        assert!((seconds(2_500_000_000) - 2.5).abs() < 1e-12);
    }
}
