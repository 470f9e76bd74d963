//! What the KV store reports to a metrics recorder, through the `metrics` facade (nothing is
//! installed by this crate; without a recorder each call is a load of the facade's recorder
//! pointer and a return): prefix-cache accesses, the storage tier's reads, writes and corrupt
//! blocks, and the directory's registrations, lease renewals, watch events and views.
//! Names follow Prometheus' conventions (`kvroute_` prefix, base units, `_total` counters);
//! labels take a few fixed values.

use metrics::counter;

/// One [`crate::prefix::PrefixCache::access`]: blocks asked for, found cached at arrival,
/// evicted to make room.
pub(crate) fn prefix_access(blocks: usize, hit: usize, evicted: usize) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_prefix_cache_accesses_total").increment(1);
    counter!("kvroute_prefix_cache_blocks_total", "result" => "hit").increment(hit as u64);
    counter!("kvroute_prefix_cache_blocks_total", "result" => "miss")
        .increment(blocks.saturating_sub(hit) as u64);
    counter!("kvroute_prefix_cache_evictions_total").increment(evicted as u64);
}

/// A block written to the storage tier (`bytes` with its header).
pub(crate) fn storage_write(bytes: u64) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_storage_writes_total").increment(1);
    counter!("kvroute_storage_written_bytes_total").increment(bytes);
}

/// A block, or one layer of it, read from the storage tier (`bytes` with its header).
pub(crate) fn storage_read(bytes: u64) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_storage_reads_total").increment(1);
    counter!("kvroute_storage_read_bytes_total").increment(bytes);
}

/// A block file found corrupt (on a read or by a verify).
pub(crate) fn storage_corrupt() {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_storage_corrupt_blocks_total").increment(1);
}

/// A holder's registration written under a new lease (`again`: after its lease was lost).
#[cfg(feature = "etcd")]
pub(crate) fn directory_registration(again: bool, ok: bool) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    let kind = if again { "again" } else { "first" };
    let outcome = if ok { "ok" } else { "failed" };
    counter!("kvroute_directory_registrations_total", "kind" => kind, "outcome" => outcome)
        .increment(1);
}

/// A lease renewal answered (`ok`) or failed.
#[cfg(feature = "etcd")]
pub(crate) fn directory_renewal(ok: bool) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    let outcome = if ok { "ok" } else { "failed" };
    counter!("kvroute_directory_lease_renewals_total", "outcome" => outcome).increment(1);
}

/// Events a directory watch delivered.
#[cfg(feature = "etcd")]
pub(crate) fn directory_watch_events(n: usize) {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_directory_watch_events_total").increment(n as u64);
}

/// A new directory view published to a requester's watch.
pub(crate) fn directory_view() {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_directory_views_total").increment(1);
}

/// A requester's directory view marked stale (the directory was lost).
pub(crate) fn directory_stale() {
    if cfg!(kvroute_no_metrics) {
        return;
    }
    counter!("kvroute_directory_stale_views_total").increment(1);
}

/// Describes this crate's metrics (their `# HELP` lines) to the recorder installed now: call
/// once after installing one.
pub fn describe_metrics() {
    use Kind::Counter;
    describe_all(&[
        (
            Counter,
            "kvroute_prefix_cache_accesses_total",
            "Prefix-cache accesses (one per request).",
        ),
        (
            Counter,
            "kvroute_prefix_cache_blocks_total",
            "Blocks asked of the prefix cache, by result (hit, miss).",
        ),
        (
            Counter,
            "kvroute_prefix_cache_evictions_total",
            "Blocks evicted from the prefix cache.",
        ),
        (
            Counter,
            "kvroute_storage_writes_total",
            "Blocks written to the storage tier.",
        ),
        (
            Counter,
            "kvroute_storage_written_bytes_total",
            "Bytes written to the storage tier, headers included.",
        ),
        (
            Counter,
            "kvroute_storage_reads_total",
            "Blocks or layers read from the storage tier.",
        ),
        (
            Counter,
            "kvroute_storage_read_bytes_total",
            "Bytes read from the storage tier, headers included.",
        ),
        (
            Counter,
            "kvroute_storage_corrupt_blocks_total",
            "Block files found corrupt.",
        ),
        (
            Counter,
            "kvroute_directory_registrations_total",
            "Holder registrations under a new lease, by kind (first, again) and outcome.",
        ),
        (
            Counter,
            "kvroute_directory_lease_renewals_total",
            "Lease renewals, by outcome.",
        ),
        (
            Counter,
            "kvroute_directory_watch_events_total",
            "Events delivered by directory watches.",
        ),
        (
            Counter,
            "kvroute_directory_views_total",
            "Directory views published to requesters.",
        ),
        (
            Counter,
            "kvroute_directory_stale_views_total",
            "Directory views marked stale (the directory was lost).",
        ),
    ]);
}

/// What kind of metric a description is for.
#[derive(Clone, Copy)]
enum Kind {
    Counter,
}

/// Hands `(kind, name, help)` to the installed recorder (none: nothing happens).
fn describe_all(all: &[(Kind, &'static str, &'static str)]) {
    for &(kind, name, help) in all {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
        }
    }
}
