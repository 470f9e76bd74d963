//! Unit tests of `prfaas_sim`.

use kvroute_costmodel::prfaas::ProfilePoint;

use super::*;

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() / want <= tol
}

/// A trace whose end no rate keeps up with (requests arriving together at its last
/// timestamp) ends in a typed error within a bounded search, where the bisection used to
/// halve the rate without end, each run simulating more sampling periods.
#[test]
fn a_trace_kept_up_at_no_rate_is_an_error_not_a_hang() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/mooncake/conversation_trace.jsonl"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let records: Vec<TraceRecord> = kvroute_kvstore::TraceReader::new(text.as_bytes(), 512)
        .take(300)
        .collect::<std::result::Result<_, _>>()
        .unwrap();
    let d = Deployment::paper_001(CaseStudy::PrfaasPd, PD_P_READING_SLOWDOWN).unwrap();
    let started = std::time::Instant::now();
    let got = sustainable_trace_rate(&d, &records, 512, 0);
    assert!(
        matches!(got, Err(SchedError::NeverKeptUp { requests: 300, .. })),
        "{got:?}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    // The whole trace is kept up with at some rate.
    let all: Vec<TraceRecord> = kvroute_kvstore::TraceReader::new(text.as_bytes(), 512)
        .collect::<std::result::Result<_, _>>()
        .unwrap();
    assert!(sustainable_trace_rate(&d, &all, 512, 0).is_ok_and(|r| r.kept_up));
}

/// Paper 001 table 6 and section 4.3, by simulation (sampled lengths, Poisson arrivals,
/// FCFS instances and slots), under the two readings of the unpublished H20 profile:
///
/// - slowdown 2.19 (table 6's PD-P column): PrfaaS-PD keeps up with 3.24 req/s, naive
///   heterogeneous with 2.45, PrfaaS-PD is 1.32x naive, egress about 13 Gbps;
/// - slowdown 2.61 (table 6's homogeneous column): homogeneous PD keeps up with 2.11
///   req/s and PrfaaS-PD is 1.54x it.
///
/// Within 10%. The simulator lands 3% to 8% below the closed form on absolute rates
/// because eqs. 3-4 charge every request `T_prefill(E[L])` while a sampled mix costs
/// `E[T_prefill(L)]`, larger for a convex profile.
#[test]
fn case_study_reproduces_table_6_under_both_readings() {
    let a = case_study(PD_P_READING_SLOWDOWN, 40_000, 1).unwrap();
    assert_eq!(a.splits, [(3, 5), (9, 3)]);
    assert!(
        close(a.prfaas_pd.offered_rps, 3.24, 0.10),
        "{}",
        a.prfaas_pd.offered_rps
    );
    assert!(
        close(a.naive.offered_rps, 2.45, 0.10),
        "{}",
        a.naive.offered_rps
    );
    assert!(
        close(a.throughput_ratio_vs_naive, 1.32, 0.10),
        "{}",
        a.throughput_ratio_vs_naive
    );
    assert!(
        close(a.prfaas_pd.egress_gbps, 13.0, 0.10),
        "{}",
        a.prfaas_pd.egress_gbps
    );
    assert!(
        close(a.prfaas_pd.p_prfaas, 0.496, 0.10),
        "{}",
        a.prfaas_pd.p_prfaas
    );
    let b = case_study(homogeneous_reading_slowdown(), 40_000, 1).unwrap();
    assert!(
        close(b.homogeneous.offered_rps, 2.11, 0.10),
        "{}",
        b.homogeneous.offered_rps
    );
    assert!(
        close(b.throughput_ratio_vs_homogeneous, 1.54, 0.10),
        "{}",
        b.throughput_ratio_vs_homogeneous
    );
    // Section 4.3.2's direction: offloading long prefills cuts TTFT against homogeneous PD.
    for r in [&a, &b] {
        assert!(
            r.ttft_at_common_load_s[0].p90 < 0.6 * r.ttft_at_common_load_s[1].p90,
            "{r:?}"
        );
    }
}

#[test]
fn the_homogeneous_reading_is_about_2_61() {
    let s = homogeneous_reading_slowdown();
    assert!((s - 2.61).abs() < 0.02, "{s}");
}

/// `T_prefill(l) = l / 1000` seconds and `S_kv(l) = l` bytes over the whole range.
fn linear_profile() -> LengthProfile {
    let point = |tokens: f64| ProfilePoint {
        tokens,
        kv_bytes: tokens,
        prefill_s: tokens / 1000.0,
    };
    LengthProfile::new(vec![point(1.0), point(1e9)]).unwrap()
}

fn tiny(prfaas: u32, np: u32, threshold: f64) -> Deployment {
    Deployment {
        name: "tiny".into(),
        prfaas_instances: prfaas,
        prfaas_profile: linear_profile(),
        pd_prefill_instances: np,
        pd_profile: linear_profile(),
        pd_decode_instances: 1,
        max_decode_batch: 1,
        decode_step_s: 0.001,
        egress_gbps: 8e-9, // 1 byte per second
        router: RouterConfig {
            pd_prefill: np > 0,
            prfaas: prfaas > 0,
            ..RouterConfig::fixed(threshold)
        },
        sample_interval_s: 1.0,
    }
}

fn record(ms: u64, input: u64, output: u64, hashes: &[u64]) -> TraceRecord {
    TraceRecord {
        timestamp_ms: ms,
        input_length: input,
        output_length: output,
        hash_ids: hashes.to_vec(),
    }
}

/// Hand-computed: one PD-P instance, one decode slot. Request 0 (t = 0, 2000 tokens)
/// prefills 0-2 s and decodes 2-3 s (1000 x 1 ms); request 1 (t = 1 s, 1000 tokens) waits
/// for the instance, prefills 2-3 s, then for the slot: decodes from 3 s. TTFTs 2 s, 2 s.
#[test]
fn fcfs_instances_and_slots_by_hand() {
    let w = Workload::Trace {
        records: vec![record(0, 2000, 1000, &[]), record(1000, 1000, 10, &[])],
        block_tokens: 512,
        cache_blocks: 0,
        time_scale: 1.0,
    };
    let run = simulate(&tiny(0, 1, f64::INFINITY), &w).unwrap();
    assert_eq!(run.ttft_s.count, 2);
    assert!(
        (run.ttft_s.p50 - 2.0).abs() < 1e-9 && (run.ttft_s.max - 2.0).abs() < 1e-9,
        "{run:?}"
    );
    assert_eq!(run.p_prfaas, 0.0);
}

/// A PrfaaS request's KV crosses a 1 byte/s link: 600 bytes after a 0.6 s prefill end
/// 600 s after arrival, and the cache-aware router sends a repeat of the same prompt to
/// PD-P with only its uncached tail to compute.
#[test]
fn egress_bounds_prfaas_and_prefixes_are_reused() {
    let w = Workload::Trace {
        records: vec![record(0, 600, 1, &[1]), record(1_000_000, 612, 1, &[1, 2])],
        block_tokens: 512,
        cache_blocks: 0,
        time_scale: 1.0,
    };
    let run = simulate(&tiny(1, 1, 100.0), &w).unwrap();
    assert!((run.ttft_s.max - 600.0).abs() < 1e-6, "{run:?}");
    // 600 + 100 tokens computed of 1212 arrived.
    assert!(
        (run.computed_fraction - 700.0 / 1212.0).abs() < 1e-9,
        "{run:?}"
    );
    assert!((run.p_prfaas - 0.5).abs() < 1e-12);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let w = Workload::Trace {
        records: vec![record(0, 10, 1, &[])],
        block_tokens: 512,
        cache_blocks: 0,
        time_scale: 1.0,
    };
    let mut d = tiny(0, 1, 1.0);
    d.pd_decode_instances = 0;
    assert!(matches!(simulate(&d, &w), Err(SchedError::Zero { .. })));
    let mut d = tiny(1, 1, 1.0);
    d.egress_gbps = -1.0;
    assert!(matches!(
        simulate(&d, &w),
        Err(SchedError::NotPositive { .. })
    ));
    let empty = Workload::Trace {
        records: vec![],
        block_tokens: 512,
        cache_blocks: 0,
        time_scale: 1.0,
    };
    assert!(matches!(
        simulate(&tiny(0, 1, 1.0), &empty),
        Err(SchedError::EmptyWorkload)
    ));
    // A router that would send work to a stage with no instances.
    let mut d = tiny(0, 1, 1.0);
    d.router.prfaas = true;
    assert!(simulate(&d, &w).is_err());
    assert!(Deployment::paper_001(CaseStudy::PrfaasPd, f64::NAN).is_err());
}
