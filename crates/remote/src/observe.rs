//! What a holder and a requester's step API report to a metrics recorder, through the
//! `metrics` facade: the crate names what happened and how long it took; whoever embeds it
//! installs a recorder (the `kvroute` binary's Prometheus exporter, `--metrics-listen`) or
//! none, and then every call here is a load of the facade's recorder pointer and a return.
//!
//! Names follow Prometheus' conventions: a `kvroute_` prefix, base units (seconds, bytes),
//! `_total` on counters; labels take a few fixed values (never a request, a peer or a chunk).

use metrics::{counter, gauge, histogram};

use crate::session::HolderStats;
use crate::step::{How, StepReport, StepStats};

/// One batch a holder served (the counters it added to its stats).
pub(crate) fn holder_batch(batch: &HolderStats, backend: &'static str) {
    counter!("kvroute_holder_requests_total").increment(batch.requests);
    counter!("kvroute_holder_segments_total").increment(batch.segments);
    counter!("kvroute_holder_refused_total", "reason" => "request").increment(batch.refused);
    counter!("kvroute_holder_fetches_total").increment(batch.fetches);
    counter!("kvroute_holder_query_rows_total", "backend" => backend).increment(batch.rows);
    counter!("kvroute_holder_kernel_calls_total", "backend" => backend)
        .increment(batch.kernel_calls);
    if batch.kernel_calls > 0 {
        histogram!("kvroute_holder_kernel_seconds", "backend" => backend)
            .record(batch.kernel_us / 1e6);
    }
    histogram!("kvroute_holder_batch_seconds").record(batch.serve_us / 1e6);
}

/// A session event at a holder's control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SessionEvent {
    /// A session granted.
    Opened,
    /// A session or connection closed to make room, or for a missing proof or first request.
    Evicted,
    /// A newcomer turned away.
    Busy,
    /// A hello, a proof or a control line refused.
    Refused,
}

impl SessionEvent {
    fn label(self) -> &'static str {
        match self {
            Self::Opened => "opened",
            Self::Evicted => "evicted",
            Self::Busy => "busy",
            Self::Refused => "refused",
        }
    }
}

/// A session event at a holder's control plane.
pub(crate) fn holder_session(event: SessionEvent) {
    counter!("kvroute_holder_sessions_total", "event" => event.label()).increment(1);
}

/// Sessions a holder has open now.
pub(crate) fn holder_active(active: usize) {
    gauge!("kvroute_holder_active_sessions").set(active as f64);
}

/// A request a holder could not answer (no reply offset to answer at, or no session).
pub(crate) fn holder_refused_request() {
    counter!("kvroute_holder_refused_total", "reason" => "request").increment(1);
}

/// Immediates a holder received that named no session of its own.
pub(crate) fn holder_stray_imms(count: u64) {
    counter!("kvroute_holder_stray_immediates_total").increment(count);
}

/// One step of the step API: its decisions, times, fallbacks and losses, the fetch cache.
pub(crate) fn step(report: &StepReport, stats: &StepStats) {
    for how in [How::Route, How::Fetch, How::Cached, How::Gather] {
        let n = report.decisions.iter().filter(|d| d.how == how).count() as u64;
        if n > 0 {
            counter!("kvroute_step_pairs_total", "how" => how_label(how)).increment(n);
        }
    }
    histogram!("kvroute_step_seconds").record(report.step_us / 1e6);
    if report.route_us > 0.0 {
        histogram!("kvroute_step_route_round_seconds").record(report.route_us / 1e6);
        if let Some(round) = report.priced_route_round() {
            histogram!("kvroute_selector_predicted_over_measured", "primitive" => "route")
                .record(round.price.total_us() / report.route_us);
        }
    }
    if report.fetch_us > 0.0 {
        histogram!("kvroute_step_fetch_seconds").record(report.fetch_us / 1e6);
        if let Some((_, price)) = report.priced_fetches() {
            histogram!("kvroute_selector_predicted_over_measured", "primitive" => "fetch")
                .record(price.total_us() / report.fetch_us);
        }
    }
    if report.gather_us > 0.0 {
        histogram!("kvroute_step_gather_seconds").record(report.gather_us / 1e6);
    }
    histogram!("kvroute_step_local_seconds").record(report.local_us / 1e6);
    counter!("kvroute_step_fallbacks_total").increment(report.fallbacks.len() as u64);
    counter!("kvroute_step_lost_holders_total").increment(report.lost.len() as u64);
    gauge!("kvroute_step_fetch_cache_bytes").set(stats.cache_bytes as f64);
    counter!("kvroute_step_chunk_fetches_total").absolute(stats.chunk_fetches);
    counter!("kvroute_step_fetched_bytes_total").absolute(stats.fetched_bytes);
    counter!("kvroute_step_fetch_cache_evictions_total").absolute(stats.evicted);
}

fn how_label(how: How) -> &'static str {
    match how {
        How::Route => "route",
        How::Fetch => "fetch",
        How::Cached => "cached",
        How::Gather => "gather",
    }
}
