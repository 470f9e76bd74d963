//! The transport's metrics, read when they are exported rather than reported as they happen:
//! the engine already counts what an operator asks of a transport (work requests posted,
//! completed and failed, bytes, arrivals, transfers in flight, registered bytes, peers), so
//! the data path pays nothing more for metrics, recorder or not. A process that serves
//! metrics calls [`export_metrics`] before each render; it sums the engines alive in the
//! process per provider, plus what the engines that have stopped counted, and hands the
//! totals to the `metrics` facade.
//!
//! Counters stay monotonic: an engine's counts are added to its provider's retired totals
//! when it stops, and a total is never exported below the last value exported (an engine
//! caught between its last handle going and its counts being retired is missing from one
//! export, never counted twice).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use super::Inner;
use crate::error::TransferError;

/// Upper bounds, seconds, of the buckets transfers' submit-to-finish times are counted in
/// (the exporter's buckets of every `_seconds` histogram, so a count recorded at its bucket's
/// bound lands in the same bucket there); a last bucket takes the longer ones.
pub const TRANSFER_BUCKETS: [f64; 13] = [
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0,
];

/// Whether submits take a timestamp for `kvroute_transport_transfer_seconds`.
static TIMING: AtomicBool = AtomicBool::new(false);

/// Times every transfer submitted from now on, in every engine of the process (a clock read
/// at submit and at finish): what an exporter turns on, for
/// `kvroute_transport_transfer_seconds`. Off by default, so an embedding that exports nothing
/// reads no clock.
pub fn time_transfers() {
    TIMING.store(true, Ordering::Relaxed);
}

/// Whether [`time_transfers`] was called.
pub(super) fn timing() -> bool {
    !cfg!(kvroute_no_metrics) && TIMING.load(Ordering::Relaxed)
}

/// The bucket of [`TRANSFER_BUCKETS`] `d` falls in.
pub(super) fn bucket(d: Duration) -> usize {
    let s = d.as_secs_f64();
    TRANSFER_BUCKETS
        .iter()
        .position(|&le| s <= le)
        .unwrap_or(TRANSFER_BUCKETS.len())
}

/// The engines of the process, registered when they start.
static LIVE: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());
/// Per provider: what stopped engines counted, and the counters last exported.
static TOTALS: Mutex<BTreeMap<String, Totals>> = Mutex::new(BTreeMap::new());

/// Counters of one provider's engines.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    posted: u64,
    completed: u64,
    failed: u64,
    unreported: u64,
    bytes: u64,
    arrivals: u64,
    imm_dropped: u64,
    /// Transfers finished: succeeded, then failed per [`TransferError::KINDS`].
    finished: [u64; 1 + TransferError::KINDS.len()],
    /// Timed transfers per bucket of [`TRANSFER_BUCKETS`], the last one for longer.
    time: [u64; TRANSFER_BUCKETS.len() + 1],
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.posted += o.posted;
        self.completed += o.completed;
        self.failed += o.failed;
        self.unreported += o.unreported;
        self.bytes += o.bytes;
        self.arrivals += o.arrivals;
        self.imm_dropped += o.imm_dropped;
        for (a, b) in self.finished.iter_mut().zip(&o.finished) {
            *a += b;
        }
        for (a, b) in self.time.iter_mut().zip(&o.time) {
            *a += b;
        }
    }

    fn max(&self, o: &Counts) -> Counts {
        Counts {
            posted: self.posted.max(o.posted),
            completed: self.completed.max(o.completed),
            failed: self.failed.max(o.failed),
            unreported: self.unreported.max(o.unreported),
            bytes: self.bytes.max(o.bytes),
            arrivals: self.arrivals.max(o.arrivals),
            imm_dropped: self.imm_dropped.max(o.imm_dropped),
            finished: std::array::from_fn(|i| self.finished[i].max(o.finished[i])),
            time: std::array::from_fn(|i| self.time[i].max(o.time[i])),
        }
    }
}

/// Gauges of one provider's live engines.
#[derive(Debug, Default, Clone, Copy)]
struct Gauges {
    engines: u64,
    in_flight: u64,
    registered_bytes: u64,
    peers: u64,
    imm_values: u64,
}

#[derive(Debug, Default)]
struct Totals {
    retired: Counts,
    exported: Counts,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Registers a started engine.
pub(super) fn register(inner: &Arc<Inner>) {
    let mut live = lock(&LIVE);
    live.retain(|w| w.strong_count() > 0);
    live.push(Arc::downgrade(inner));
}

/// Adds a stopping engine's counts to its providers' retired totals.
pub(super) fn retire(inner: &Inner) {
    let mut totals = lock(&TOTALS);
    for (provider, counts, _) in measure(inner) {
        totals.entry(provider).or_default().retired.add(&counts);
    }
}

/// An engine's counters and gauges, per group (each labelled by its provider); the IMM
/// counter's drops go to the first group's.
fn measure(inner: &Inner) -> Vec<(String, Counts, Gauges)> {
    let imm = &inner.engine.imm;
    inner
        .groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let s = super::stats::snapshot(&g.counters, &g.worker_written);
            let mut counts = Counts::default();
            for d in &s.domains {
                counts.add(&Counts {
                    posted: d.posted,
                    completed: d.completed,
                    failed: d.failed,
                    unreported: d.unreported,
                    bytes: d.bytes,
                    arrivals: d.arrivals,
                    ..Counts::default()
                });
            }
            let w = &g.worker_written;
            counts.finished = std::array::from_fn(|i| w.finished[i].load(Ordering::Relaxed));
            counts.time = std::array::from_fn(|i| w.transfer_time[i].load(Ordering::Relaxed));
            let first = i == 0;
            if first {
                counts.imm_dropped = imm.dropped();
            }
            let gauges = Gauges {
                engines: u64::from(first),
                in_flight: s.in_flight,
                registered_bytes: s.registered_bytes,
                peers: s.peers,
                imm_values: if first {
                    imm.tracked_values() as u64
                } else {
                    0
                },
            };
            (g.provider.clone(), counts, gauges)
        })
        .collect()
}

/// Hands the transport's totals to the `metrics` facade (labelled by provider):
/// `kvroute_transport_work_requests_total{state}` (posted, completed, failed, unreported),
/// `kvroute_transport_bytes_total` (posted), `kvroute_transport_arrivals_total`,
/// `kvroute_transport_dropped_immediates_total`, and the gauges `kvroute_transport_engines`,
/// `kvroute_transport_in_flight`, `kvroute_transport_registered_bytes`,
/// `kvroute_transport_peers` and `kvroute_transport_immediate_values`. Call it before each
/// render of an exporter; without a recorder it only reads the counters.
pub fn export_metrics() {
    // Strong handles are taken under the lock and dropped after every lock is released: the
    // last handle of an engine may be one of these, and its drop retires it (locking TOTALS).
    let engines: Vec<Arc<Inner>> = lock(&LIVE).iter().filter_map(Weak::upgrade).collect();
    let mut live: BTreeMap<String, (Counts, Gauges)> = BTreeMap::new();
    for inner in &engines {
        for (provider, counts, g) in measure(inner) {
            let (c, sum) = live.entry(provider).or_default();
            c.add(&counts);
            sum.engines += g.engines;
            sum.in_flight += g.in_flight;
            sum.registered_bytes += g.registered_bytes;
            sum.peers += g.peers;
            sum.imm_values += g.imm_values;
        }
    }
    let mut totals = lock(&TOTALS);
    for provider in live.keys() {
        totals.entry(provider.clone()).or_default();
    }
    for (provider, t) in totals.iter_mut() {
        let (counts, gauges) = live.get(provider).copied().unwrap_or_default();
        let mut now = t.retired;
        now.add(&counts);
        let before = t.exported;
        t.exported = now.max(&before);
        publish(provider, &t.exported, &gauges);
        record_times(provider, &before.time, &t.exported.time);
    }
    drop(totals);
    drop(engines);
}

/// Records the timed transfers counted since the last export into the facade's histogram,
/// each at its bucket's bound (beyond the last bound: twice it), so the exporter's buckets
/// (the same bounds) count exactly what the engines counted; its sum is therefore an upper
/// bound of the true sum.
fn record_times(provider: &str, before: &[u64], now: &[u64]) {
    let h = metrics::histogram!("kvroute_transport_transfer_seconds", "provider" => provider.to_owned());
    for (i, (&b, &n)) in before.iter().zip(now).enumerate() {
        let at = TRANSFER_BUCKETS
            .get(i)
            .copied()
            .unwrap_or(2.0 * TRANSFER_BUCKETS[TRANSFER_BUCKETS.len() - 1]);
        if n > b {
            h.record_many(at, usize::try_from(n - b).unwrap_or(usize::MAX));
        }
    }
}

fn publish(provider: &str, c: &Counts, g: &Gauges) {
    let p = provider.to_owned();
    metrics::counter!("kvroute_transport_transfers_total", "provider" => p.clone(), "outcome" => "ok")
        .absolute(c.finished[0]);
    for (kind, &n) in TransferError::KINDS.iter().zip(&c.finished[1..]) {
        metrics::counter!("kvroute_transport_transfers_total", "provider" => p.clone(), "outcome" => *kind)
            .absolute(n);
    }
    for (state, v) in [
        ("posted", c.posted),
        ("completed", c.completed),
        ("failed", c.failed),
        ("unreported", c.unreported),
    ] {
        metrics::counter!("kvroute_transport_work_requests_total", "provider" => p.clone(), "state" => state)
            .absolute(v);
    }
    metrics::counter!("kvroute_transport_bytes_total", "provider" => p.clone()).absolute(c.bytes);
    metrics::counter!("kvroute_transport_arrivals_total", "provider" => p.clone())
        .absolute(c.arrivals);
    metrics::counter!("kvroute_transport_dropped_immediates_total", "provider" => p.clone())
        .absolute(c.imm_dropped);
    metrics::gauge!("kvroute_transport_engines", "provider" => p.clone()).set(g.engines as f64);
    metrics::gauge!("kvroute_transport_in_flight", "provider" => p.clone()).set(g.in_flight as f64);
    metrics::gauge!("kvroute_transport_registered_bytes", "provider" => p.clone())
        .set(g.registered_bytes as f64);
    metrics::gauge!("kvroute_transport_peers", "provider" => p.clone()).set(g.peers as f64);
    metrics::gauge!("kvroute_transport_immediate_values", "provider" => p).set(g.imm_values as f64);
}

/// Describes the transport's metrics (their `# HELP` lines) to the recorder installed now: call
/// once after installing one.
pub fn describe_metrics() {
    for (name, help) in [
        (
            "kvroute_transport_work_requests_total",
            "Work requests, by provider and state (posted, completed, failed, unreported).",
        ),
        (
            "kvroute_transport_bytes_total",
            "Bytes of the writes and sends posted, by provider.",
        ),
        (
            "kvroute_transport_arrivals_total",
            "Peers' writes with an immediate that landed, by provider.",
        ),
        (
            "kvroute_transport_dropped_immediates_total",
            "Arrivals dropped because their immediate value found no room in the IMM counter.",
        ),
        (
            "kvroute_transport_transfers_total",
            "Transfers finished, by provider and outcome (ok, or the error's kind).",
        ),
    ] {
        metrics::describe_counter!(name, help);
    }
    metrics::describe_histogram!(
        "kvroute_transport_transfer_seconds",
        "Transfers' submit-to-finish time, by provider (each counted at its bucket's bound)."
    );
    for (name, help) in [
        (
            "kvroute_transport_engines",
            "Transfer engines alive, by provider.",
        ),
        (
            "kvroute_transport_in_flight",
            "Transfers accepted and not yet finished.",
        ),
        (
            "kvroute_transport_registered_bytes",
            "Bytes of memory registered with the NICs.",
        ),
        ("kvroute_transport_peers", "Peers connected."),
        (
            "kvroute_transport_immediate_values",
            "Immediate values with counts or expectations held by the IMM counter.",
        ),
    ] {
        metrics::describe_gauge!(name, help);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_falls_in_the_first_bucket_whose_bound_it_does_not_pass() {
        assert_eq!(bucket(Duration::from_micros(3)), 0);
        assert_eq!(bucket(Duration::from_micros(10)), 0);
        assert_eq!(bucket(Duration::from_micros(11)), 1);
        assert_eq!(bucket(Duration::from_millis(2)), 5);
        assert_eq!(bucket(Duration::from_secs(10)), 12);
        assert_eq!(bucket(Duration::from_secs(11)), TRANSFER_BUCKETS.len());
    }

    #[test]
    fn counts_add_and_keep_the_larger() {
        let a = Counts {
            posted: 3,
            bytes: 10,
            ..Counts::default()
        };
        let mut b = Counts {
            posted: 1,
            bytes: 20,
            ..Counts::default()
        };
        assert_eq!(a.max(&b).posted, 3);
        assert_eq!(a.max(&b).bytes, 20);
        b.add(&a);
        assert_eq!((b.posted, b.bytes), (4, 30));
    }
}
