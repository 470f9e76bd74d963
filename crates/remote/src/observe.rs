//! What a holder and a requester's step API report to a metrics recorder, through the
//! `metrics` facade: the crate names what happened and how long it took; whoever embeds it
//! installs a recorder (the `kvroute` binary's Prometheus exporter, `--metrics-listen`) or
//! none, and then every call here is a load of the facade's recorder pointer and a return.
//!
//! Built with `--cfg kvroute_no_metrics`, every call here is compiled out: the build the
//! instrumented one is measured against (docs/metrics.md, "Cost").
//!
//! Names follow Prometheus' conventions: a `kvroute_` prefix, base units (seconds, bytes),
//! `_total` on counters; labels take a few fixed values (never a request, a peer or a chunk).

use metrics::{counter, gauge, histogram};

use crate::session::HolderStats;
use crate::step::{How, StepReport, StepStats};

/// One batch a holder served (the counters it added to its stats).
pub(crate) fn holder_batch(batch: &HolderStats, backend: &'static str) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
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
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_holder_sessions_total", "event" => event.label()).increment(1);
}

/// Sessions a holder has open now.
pub(crate) fn holder_active(active: usize) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    gauge!("kvroute_holder_active_sessions").set(active as f64);
}

/// A request a holder could not answer (no reply offset to answer at, or no session).
pub(crate) fn holder_refused_request() {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_holder_refused_total", "reason" => "request").increment(1);
}

/// Immediates a holder received that named no session of its own.
pub(crate) fn holder_stray_imms(count: u64) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_holder_stray_immediates_total").increment(count);
}

/// Why a requester gave a holder's request up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// No reply (or send completion) by the deadline.
    Timeout,
    /// The holder's control connection closed.
    Closed,
    /// The request's write failed.
    WriteFailed,
    /// The reply came but its fetch pages did not, or it could not be read.
    Fetch,
}

/// A holder's request given up by its requester (the link is then dead to it).
pub(crate) fn holder_failure(reason: Failure) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    let reason = match reason {
        Failure::Timeout => "timeout",
        Failure::Closed => "closed",
        Failure::WriteFailed => "write_failed",
        Failure::Fetch => "fetch",
    };
    counter!("kvroute_requester_holder_failures_total", "reason" => reason).increment(1);
}

/// One step of the step API: its decisions, times, fallbacks and losses, the fetch cache.
pub(crate) fn step(report: &StepReport, stats: &StepStats) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
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

/// The selector's fitted lines now: the routed round trip's (`fabric`) and the whole-chunk
/// pull's, each as its fixed cost, bandwidth, residual, age and number of fits, and whether
/// the last fabric refit was refused.
pub(crate) fn selector(calibrated: &crate::step::Calibrated) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    let cal = calibrated.selector.calibration(calibrated.now_ms());
    for (line, fit, age_ms) in [
        ("fabric", cal.fabric, cal.ages_ms.fabric),
        ("pull", cal.pull, cal.ages_ms.pull),
    ] {
        let Some(fit) = fit else {
            continue;
        };
        counter!("kvroute_selector_fits_total", "line" => line).absolute(fit.fits);
        gauge!("kvroute_selector_fixed_seconds", "line" => line).set(fit.fixed_us / 1e6);
        gauge!("kvroute_selector_bandwidth_bytes_per_second", "line" => line)
            .set(fit.bw_gbps * 1e9);
        gauge!("kvroute_selector_median_residual_ratio", "line" => line)
            .set(fit.median_residual_pct / 100.0);
        if let Some(age) = age_ms {
            gauge!("kvroute_selector_fit_age_seconds", "line" => line).set(age as f64 / 1e3);
        }
    }
    gauge!("kvroute_selector_fabric_refit_refused")
        .set(f64::from(u8::from(cal.fabric_rejected.is_some())));
}

fn how_label(how: How) -> &'static str {
    match how {
        How::Route => "route",
        How::Fetch => "fetch",
        How::Cached => "cached",
        How::Gather => "gather",
    }
}

/// Describes this crate's metrics (their `# HELP` lines) to the recorder installed now: call
/// once after installing one.
pub fn describe_metrics() {
    describe_holder_metrics();
    describe_step_metrics();
    describe_selector_metrics();
}

/// Describes a holder's metrics: its sessions, the requests it served, its kernel calls.
fn describe_holder_metrics() {
    use Kind::{Counter, Gauge, Histogram};
    describe_all(&[
        (
            Counter,
            "kvroute_holder_sessions_total",
            "Holder control-plane session events, by event (opened, evicted, busy, refused).",
        ),
        (
            Gauge,
            "kvroute_holder_active_sessions",
            "Sessions a holder has open.",
        ),
        (
            Counter,
            "kvroute_holder_requests_total",
            "Requests a holder served.",
        ),
        (
            Counter,
            "kvroute_holder_segments_total",
            "Segments of the requests a holder served.",
        ),
        (
            Counter,
            "kvroute_holder_fetches_total",
            "Fetch segments a holder served.",
        ),
        (
            Counter,
            "kvroute_holder_refused_total",
            "Requests or segments a holder answered with a refusal.",
        ),
        (
            Counter,
            "kvroute_holder_query_rows_total",
            "Query rows a holder attended, by kernel backend.",
        ),
        (
            Counter,
            "kvroute_holder_kernel_calls_total",
            "Attention kernel calls, by backend.",
        ),
        (
            Histogram,
            "kvroute_holder_kernel_seconds",
            "Kernel time per served batch, by backend.",
        ),
        (
            Histogram,
            "kvroute_holder_batch_seconds",
            "A batch from its first request read to its last reply sent.",
        ),
        (
            Counter,
            "kvroute_holder_stray_immediates_total",
            "Immediates a holder received naming none of its sessions.",
        ),
    ]);
}

/// Describes the step API's metrics: its steps and their phases (with the selector's price of
/// them), fallbacks, holders its requester gave up on or lost, whole-chunk fetches and the
/// fetch cache.
fn describe_step_metrics() {
    use Kind::{Counter, Gauge, Histogram};
    describe_all(&[
        (
            Counter,
            "kvroute_step_pairs_total",
            "(request, chunk) pairs of the step API, by how they were served.",
        ),
        (
            Histogram,
            "kvroute_step_seconds",
            "One step of the step API (a layer of a decode step).",
        ),
        (
            Histogram,
            "kvroute_step_route_round_seconds",
            "A step's route round.",
        ),
        (Histogram, "kvroute_step_fetch_seconds", "A step's fetches."),
        (
            Histogram,
            "kvroute_step_gather_seconds",
            "A step's gathers.",
        ),
        (
            Histogram,
            "kvroute_step_local_seconds",
            "A step's local partials and merge.",
        ),
        (
            Histogram,
            "kvroute_selector_predicted_over_measured",
            "The selector's price of a step's route round or fetches over their measured time, by primitive.",
        ),
        (
            Counter,
            "kvroute_step_fallbacks_total",
            "Calls re-sent to a replica.",
        ),
        (
            Counter,
            "kvroute_requester_holder_failures_total",
            "Requests a requester gave up on their holder for, by reason (timeout, closed, write_failed, fetch).",
        ),
        (
            Counter,
            "kvroute_step_lost_holders_total",
            "Holders the step API found dead.",
        ),
        (
            Counter,
            "kvroute_step_chunk_fetches_total",
            "Whole-chunk fetches.",
        ),
        (
            Counter,
            "kvroute_step_fetched_bytes_total",
            "Bytes of whole-chunk fetches.",
        ),
        (
            Counter,
            "kvroute_step_fetch_cache_evictions_total",
            "Fetch-cache evictions.",
        ),
        (
            Gauge,
            "kvroute_step_fetch_cache_bytes",
            "Bytes the fetch cache holds.",
        ),
    ]);
}

/// Describes the selector's fitted lines (fabric, pull).
fn describe_selector_metrics() {
    use Kind::{Counter, Gauge};
    describe_all(&[
        (
            Counter,
            "kvroute_selector_fits_total",
            "Fits the selector accepted, by line (fabric, pull).",
        ),
        (
            Gauge,
            "kvroute_selector_fixed_seconds",
            "A fitted line's fixed cost, by line.",
        ),
        (
            Gauge,
            "kvroute_selector_bandwidth_bytes_per_second",
            "A fitted line's bandwidth, by line.",
        ),
        (
            Gauge,
            "kvroute_selector_median_residual_ratio",
            "A fitted line's median absolute relative residual, by line.",
        ),
        (
            Gauge,
            "kvroute_selector_fit_age_seconds",
            "How old a fitted line is, by line.",
        ),
        (
            Gauge,
            "kvroute_selector_fabric_refit_refused",
            "1 if the selector's last fabric refit was refused, else 0.",
        ),
    ]);
}

/// What kind of metric a description is for.
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Hands `(kind, name, help)` to the installed recorder (none: nothing happens).
fn describe_all(all: &[(Kind, &'static str, &'static str)]) {
    for &(kind, name, help) in all {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
}
