//! A discrete-event simulation of a PrfaaS-PD deployment (paper 001 sections 3.3 to 4).
//!
//! Resources, each first-come first-served:
//!
//! - `N_prfaas` PrfaaS prefill instances and `Np` PD-P instances, each prefilling one request
//!   at a time for `T_prefill(l)` of its profile (the paper's table 5 measures whole 8-GPU
//!   instances this way);
//! - the PrfaaS egress link of `B_out`, which a PrfaaS request's `S_kv(l)` crosses layer by
//!   layer while it is prefilled (eq. 3's pipelining: it occupies the link for `S_kv / B_out`
//!   but cannot finish before its prefill does), and the ingress link in the other direction
//!   for prefixes the router moves to PrfaaS;
//! - `Nd x BS_max` decode slots, each holding a request for `L_out x T_decode` (eq. 5's
//!   SLO-governed constants); the intra-cluster RDMA hop is not a bottleneck (eq. 4) and takes
//!   no time here.
//!
//! The router ([`crate::prfaas::PrfaasRouter`]) decides per request and gets a load sample
//! every `sample_interval_s`. TTFT is arrival to the first decode step (prefill, egress and
//! waiting for a decode slot included); TBT is `T_decode`.
//!
//! [`sustainable_rate`] finds the highest Poisson arrival rate the deployment keeps up with,
//! which is what eq. 6's `Lambda_max` predicts, and [`case_study`] runs the paper's three
//! deployments side by side.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvroute_costmodel::prfaas::{
    H20_OVER_H200_PREFILL, LengthProfile, PrfaasCluster, PrfaasPlanner, TruncatedLogNormal,
};
use kvroute_kvstore::{Eviction, PrefixCache, TraceRecord};
use serde::Serialize;

use crate::des::{EventQueue, FifoLink, Nanos, nanos, seconds};
use crate::error::{Result, SchedError, count, positive};
use crate::prfaas::{Cluster, LoadSample, PrfaasRouter, RouteQuery, RouterConfig};
use crate::rng::Rng;
use crate::stats::Percentiles;

/// One deployment: instances, profiles, links and the router.
#[derive(Debug, Clone, Serialize)]
pub struct Deployment {
    /// What it is called in reports.
    pub name: String,
    /// PrfaaS prefill instances (0: none).
    pub prfaas_instances: u32,
    /// The PrfaaS instances' prefill profile.
    pub prfaas_profile: LengthProfile,
    /// PD-P instances (0: none).
    pub pd_prefill_instances: u32,
    /// The PD instances' prefill profile.
    pub pd_profile: LengthProfile,
    /// PD-D instances.
    pub pd_decode_instances: u32,
    /// `BS_max` per decode instance.
    pub max_decode_batch: u32,
    /// `T_decode`, seconds per decode step.
    pub decode_step_s: f64,
    /// `B_out`, Gbps (each direction).
    pub egress_gbps: f64,
    /// The router.
    pub router: RouterConfig,
    /// Seconds between the router's load samples.
    pub sample_interval_s: f64,
}

/// The three deployments of paper 001 table 6.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CaseStudy {
    /// 4 PrfaaS instances (32 H200) and an 8-instance PD cluster (64 H20), `t` and `Np / Nd`
    /// from the throughput model's search.
    PrfaasPd,
    /// 12 H20 instances (96 GPUs), split by the same search with no PrfaaS.
    HomogeneousPd,
    /// All prefill on the 4 PrfaaS instances, all 8 PD instances decoding, no routing.
    NaiveHeterogeneous,
}

impl Deployment {
    /// Paper 001 section 4.1's deployment `which`, the PD cluster's prefill `slowdown` times
    /// slower than table 5's H200 profile (the paper does not publish its H20 profile; see
    /// [`case_study`] for the two readings).
    pub fn paper_001(which: CaseStudy, slowdown: f64) -> Result<Self> {
        Self::paper_001_for(which, slowdown, TruncatedLogNormal::paper_001_workload())
    }

    /// The same deployment with `t` and `Np / Nd` searched for another distribution of
    /// uncached lengths (section 3.4.3: the threshold is searched "based on the incremental
    /// prefill-length distribution after prefix matching"), e.g. [`fit_lengths`] of a trace.
    pub fn paper_001_for(
        which: CaseStudy,
        slowdown: f64,
        lengths: TruncatedLogNormal,
    ) -> Result<Self> {
        positive("slowdown", slowdown)?;
        let h200 = LengthProfile::paper_001_table_5();
        let planner = PrfaasPlanner {
            pd_profile: h200.with_prefill_scaled(slowdown)?,
            lengths,
            ..PrfaasPlanner::paper_001_case_study()
        };
        let c = PrfaasCluster::PAPER_001_CASE_STUDY;
        let (prfaas_profile, pd_profile) =
            (planner.prfaas_profile.clone(), planner.pd_profile.clone());
        let base = |name: &str, prfaas: u32, np: u32, nd: u32, router: RouterConfig| Self {
            name: name.to_owned(),
            prfaas_instances: prfaas,
            prfaas_profile: prfaas_profile.clone(),
            pd_prefill_instances: np,
            pd_profile: pd_profile.clone(),
            pd_decode_instances: nd,
            max_decode_batch: c.max_decode_batch,
            decode_step_s: c.decode_step_s,
            egress_gbps: c.egress_gbps,
            router,
            sample_interval_s: 1.0,
        };
        Ok(match which {
            CaseStudy::PrfaasPd => {
                let best = planner.search(2001)?;
                base(
                    "prfaas-pd",
                    c.prfaas_instances,
                    best.np,
                    best.nd,
                    RouterConfig::fixed(best.threshold_tokens),
                )
            }
            CaseStudy::HomogeneousPd => {
                let homogeneous = PrfaasPlanner {
                    cluster: PrfaasCluster {
                        prfaas_instances: 0,
                        pd_instances: c.prfaas_instances + c.pd_instances,
                        ..c
                    },
                    ..planner.clone()
                };
                let best = homogeneous.search(257)?;
                base(
                    "homogeneous-pd",
                    0,
                    best.np,
                    best.nd,
                    RouterConfig {
                        prfaas: false,
                        ..RouterConfig::fixed(f64::INFINITY)
                    },
                )
            }
            CaseStudy::NaiveHeterogeneous => base(
                "naive-heterogeneous",
                c.prfaas_instances,
                0,
                c.pd_instances,
                RouterConfig {
                    pd_prefill: false,
                    ..RouterConfig::fixed(0.0)
                },
            ),
        })
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        self.router.validate()?;
        count("pd_decode_instances", u64::from(self.pd_decode_instances))?;
        count("max_decode_batch", u64::from(self.max_decode_batch))?;
        positive("decode_step_s", self.decode_step_s)?;
        positive("egress_gbps", self.egress_gbps)?;
        positive("sample_interval_s", self.sample_interval_s)?;
        if self.router.prfaas != (self.prfaas_instances > 0)
            || self.router.pd_prefill != (self.pd_prefill_instances > 0)
        {
            return Err(SchedError::OutOfRange {
                name: "router stages",
                value: f64::from(self.prfaas_instances),
                range: "the router's stages must be the deployment's non-empty ones",
            });
        }
        Ok(())
    }
}

/// Requests to replay.
#[derive(Debug, Clone)]
pub enum Workload {
    /// Poisson arrivals with truncated log-normal input lengths (paper 001 section 4.1's
    /// distribution) and a fixed output length; nothing cached.
    LogNormal {
        /// Input lengths.
        lengths: TruncatedLogNormal,
        /// Output tokens of every request.
        output_tokens: u64,
        /// Arrivals per second.
        rate_rps: f64,
        /// How many.
        requests: u64,
        /// Seed of the draws.
        seed: u64,
    },
    /// A Mooncake-format trace: its arrival times (divided by `time_scale`), lengths and
    /// prefix hashes, each cluster with a prefix cache of `cache_blocks` blocks (0: unbounded).
    Trace {
        /// The records, in arrival order.
        records: Vec<TraceRecord>,
        /// Tokens per hash block.
        block_tokens: u32,
        /// Blocks each cluster's prefix cache holds.
        cache_blocks: usize,
        /// Arrival times are divided by this (2: twice the trace's rate).
        time_scale: f64,
    },
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct PrfaasRun {
    /// The deployment.
    pub deployment: String,
    /// Offered load, requests per second (arrivals / arrival window).
    pub offered_rps: f64,
    /// Requests that arrived.
    pub requests: u64,
    /// Delivered throughput: requests through prefill per second of the arrival window.
    pub throughput_rps: f64,
    /// Requests arrived but not yet decoding when the last one arrived.
    pub backlog_at_last_arrival: u64,
    /// Whether the deployment kept up (backlog at most 1% of the requests).
    pub kept_up: bool,
    /// Arrival to first decode step, seconds.
    pub ttft_s: Percentiles,
    /// Time between tokens, seconds.
    pub tbt_s: f64,
    /// Fraction of requests prefilled by PrfaaS.
    pub p_prfaas: f64,
    /// Mean PrfaaS egress over the arrival window, Gbps.
    pub egress_gbps: f64,
    /// Bytes of cached prefix moved between the clusters.
    pub cache_transfer_bytes: f64,
    /// Tokens prefilled over tokens arrived (below 1 when prefixes are reused).
    pub computed_fraction: f64,
    /// The router's threshold at the end.
    pub final_threshold_tokens: f64,
    /// Events simulated.
    pub events: u64,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrive(u32),
    PrefillDone(u32),
    Sample,
}

struct Job {
    arrival: Nanos,
    total: u64,
    output: u64,
    route_cluster: Cluster,
}

/// Servers that each take one job at a time, first come first served.
struct Servers(BinaryHeap<Reverse<Nanos>>);

impl Servers {
    fn new(n: u64) -> Self {
        Self((0..n).map(|_| Reverse(0)).collect())
    }
    /// Starts a job ready at `ready` taking `took`; returns (start, end).
    fn take(&mut self, ready: Nanos, took: Nanos) -> Option<(Nanos, Nanos)> {
        let mut slot = self.0.peek_mut()?;
        let start = slot.0.max(ready);
        slot.0 = start.saturating_add(took);
        Some((start, slot.0))
    }
    fn wait(&self, now: Nanos) -> Nanos {
        self.0.peek().map_or(0, |s| s.0.saturating_sub(now))
    }
}

/// Runs `workload` through `deployment`.
pub fn simulate(deployment: &Deployment, workload: &Workload) -> Result<PrfaasRun> {
    deployment.validate()?;
    let arrivals = Arrivals::of(workload)?;
    if arrivals.requests.is_empty() {
        return Err(SchedError::EmptyWorkload);
    }
    let n = u32::try_from(arrivals.requests.len()).map_err(|_| SchedError::OutOfRange {
        name: "requests",
        value: arrivals.requests.len() as f64,
        range: "at most 2^32 - 1",
    })?;
    let mut q = EventQueue::new();
    for (i, a) in arrivals.requests.iter().enumerate() {
        q.at(a.0, Event::Arrive(i as u32));
    }
    let mut sim = Sim::new(deployment, arrivals)?;
    q.at(sim.sample_every, Event::Sample);
    while let Some((now, event)) = q.pop() {
        match event {
            Event::Arrive(i) => {
                let done = sim.arrive(now, i);
                q.at(done, Event::PrefillDone(i));
            }
            Event::PrefillDone(i) => sim.prefill_done(now, i)?,
            Event::Sample => {
                if sim.sample(now) {
                    q.after(sim.sample_every, Event::Sample);
                }
            }
        }
    }
    Ok(sim.report(u64::from(n), q.popped()))
}

/// A workload's requests as the simulator takes them.
struct Arrivals<'w> {
    /// (arrival time, total tokens, output tokens), in arrival order.
    requests: Vec<(Nanos, u64, u64)>,
    /// Each request's prefix block hashes (a trace's; none for a synthetic load).
    hashes: Vec<&'w [u64]>,
    /// Tokens per hashed block (0 without hashes).
    block_tokens: u64,
    /// Blocks each cluster's prefix cache holds (0: unbounded).
    cache_blocks: usize,
}

impl<'w> Arrivals<'w> {
    fn of(workload: &'w Workload) -> Result<Self> {
        let mut requests = Vec::new();
        let mut hashes: Vec<&[u64]> = Vec::new();
        let (block_tokens, cache_blocks) = match workload {
            Workload::LogNormal {
                lengths,
                output_tokens,
                rate_rps,
                requests: n,
                seed,
            } => {
                positive("rate_rps", *rate_rps)?;
                count("requests", *n)?;
                let spec = lengths.spec();
                let mut rng = Rng::new(*seed);
                let mut t = 0.0;
                for _ in 0..*n {
                    t += rng.exponential(1.0 / rate_rps);
                    let l = rng.truncated_lognormal(
                        spec.mu,
                        spec.sigma,
                        spec.min_tokens,
                        spec.max_tokens,
                    );
                    requests.push((nanos(t), l.round() as u64, *output_tokens));
                }
                (0, 0)
            }
            Workload::Trace {
                records,
                block_tokens,
                cache_blocks,
                time_scale,
            } => {
                positive("time_scale", *time_scale)?;
                count("block_tokens", u64::from(*block_tokens))?;
                for r in records {
                    requests.push((
                        nanos(r.timestamp_ms as f64 * 1e-3 / time_scale),
                        r.input_length,
                        r.output_length,
                    ));
                    hashes.push(&r.hash_ids);
                }
                (u64::from(*block_tokens), *cache_blocks)
            }
        };
        Ok(Self {
            requests,
            hashes,
            block_tokens,
            cache_blocks,
        })
    }
}

/// The simulation's state: the clusters' servers, links and caches, the router, and what
/// the report counts.
struct Sim<'a> {
    d: &'a Deployment,
    arrivals: Arrivals<'a>,
    /// The PD cluster's prefix cache, then PrfaaS's.
    caches: [PrefixCache<()>; 2],
    link_bps: f64,
    egress: FifoLink,
    ingress: FifoLink,
    prfaas: Servers,
    pd: Servers,
    slots: Servers,
    router: PrfaasRouter,
    jobs: Vec<Job>,
    last_arrival: Nanos,
    sample_every: Nanos,
    computed: u64,
    arrived_tokens: u64,
    cache_bytes: f64,
    ttft: Vec<f64>,
    decoding_by_last_arrival: u64,
    egress_bytes_seen: f64,
    egress_bytes_in_window: f64,
    routed_prfaas: u64,
}

impl<'a> Sim<'a> {
    fn new(d: &'a Deployment, arrivals: Arrivals<'a>) -> Result<Self> {
        let link_bps = d.egress_gbps * 1e9 / 8.0;
        let n = arrivals.requests.len();
        Ok(Self {
            caches: [
                PrefixCache::<()>::new(arrivals.cache_blocks, Eviction::Lru),
                PrefixCache::<()>::new(arrivals.cache_blocks, Eviction::Lru),
            ],
            link_bps,
            egress: FifoLink::new(link_bps),
            ingress: FifoLink::new(link_bps),
            prfaas: Servers::new(u64::from(d.prfaas_instances)),
            pd: Servers::new(u64::from(d.pd_prefill_instances)),
            slots: Servers::new(u64::from(d.pd_decode_instances) * u64::from(d.max_decode_batch)),
            router: PrfaasRouter::new(d.router)?,
            jobs: Vec::with_capacity(n),
            last_arrival: arrivals.requests.last().map_or(0, |a| a.0),
            sample_every: nanos(d.sample_interval_s).max(1),
            computed: 0,
            arrived_tokens: 0,
            cache_bytes: 0.0,
            ttft: Vec::with_capacity(n),
            decoding_by_last_arrival: 0,
            egress_bytes_seen: 0.0,
            egress_bytes_in_window: 0.0,
            routed_prfaas: 0,
            arrivals,
            d,
        })
    }

    /// Request `i` arrives at `now`: routed, its cached KV moved where the router sends
    /// it, its prefill queued; returns when the prefill ends.
    fn arrive(&mut self, now: Nanos, i: u32) -> Nanos {
        let d = self.d;
        let (at, total, output) = self.arrivals.requests[i as usize];
        let (hashes, block_tokens) = (&self.arrivals.hashes, self.arrivals.block_tokens);
        let held = |c: &PrefixCache<()>| {
            hashes.get(i as usize).map_or(0, |h| {
                (c.longest_prefix(h) as u64 * block_tokens).min(total)
            })
        };
        let route = self.router.route(RouteQuery {
            total_tokens: total,
            cached_pd: held(&self.caches[0]),
            cached_prfaas: held(&self.caches[1]),
        });
        self.computed += route.prefill_tokens;
        self.arrived_tokens += total;
        let l = route.prefill_tokens.max(1) as f64;
        let done = match route.cluster {
            Cluster::Pd => {
                let mut ready = now;
                if route.transfer_tokens > 0 {
                    let bytes = d.prfaas_profile.kv_bytes(route.transfer_tokens as f64);
                    self.cache_bytes += bytes;
                    ready = self.egress.push(now, bytes);
                }
                self.pd
                    .take(ready, nanos(d.pd_profile.prefill_s(l)))
                    .map(|(_, end)| end)
            }
            Cluster::Prfaas => {
                self.routed_prfaas += 1;
                let mut ready = now;
                if route.transfer_tokens > 0 {
                    let bytes = d.prfaas_profile.kv_bytes(route.transfer_tokens as f64);
                    self.cache_bytes += bytes;
                    ready = self.ingress.push(now, bytes);
                }
                let egress = &mut self.egress;
                self.prfaas
                    .take(ready, nanos(d.prfaas_profile.prefill_s(l)))
                    .map(|(start, end)| {
                        egress.push_stream(start, end, d.prfaas_profile.kv_bytes(l))
                    })
            }
        };
        self.jobs.push(Job {
            arrival: at,
            total,
            output,
            route_cluster: route.cluster,
        });
        // `validate` guarantees the routed-to stage has servers.
        done.unwrap_or(now)
    }

    /// Request `i`'s prefill ends at `now`: it takes a decode slot (its first token then),
    /// and its prefix lands in the caches of the clusters that now hold it.
    fn prefill_done(&mut self, now: Nanos, i: u32) -> Result<()> {
        let job = &self.jobs[i as usize];
        let took = nanos(job.output as f64 * self.d.decode_step_s);
        let (start, _) = self.slots.take(now, took).unwrap_or((now, now));
        self.ttft.push(seconds(start - job.arrival));
        if start <= self.last_arrival {
            self.decoding_by_last_arrival += 1;
        }
        if let Some(h) = self.arrivals.hashes.get(i as usize) {
            // The KV lands in the PD cluster for decode; PrfaaS keeps what it computed.
            let blocks = (job.total / self.arrivals.block_tokens.max(1)) as usize;
            let h = &h[..blocks.min(h.len())];
            self.caches[0].access(h, |_| (), &mut |_, _| ())?;
            if job.route_cluster == Cluster::Prfaas {
                self.caches[1].access(h, |_| (), &mut |_, _| ())?;
            }
        }
        Ok(())
    }

    /// The router's sample at `now` of the egress link's use and the clusters' waits;
    /// returns whether another sample is due (arrivals are still to come).
    fn sample(&mut self, now: Nanos) -> bool {
        let window = seconds(self.sample_every);
        let carried = self.egress.bytes - self.egress_bytes_seen;
        self.egress_bytes_seen = self.egress.bytes;
        if now <= self.last_arrival {
            self.egress_bytes_in_window = self.egress.bytes;
        }
        self.router.on_sample(LoadSample {
            egress_utilization: (carried / (self.link_bps * window)).min(1.0),
            prfaas_wait_s: seconds(self.prfaas.wait(now)),
            pd_wait_s: seconds(self.pd.wait(now)),
        });
        now < self.last_arrival
    }

    /// The run's figures over the window up to the last arrival, `requests` requests and
    /// `events` events simulated.
    fn report(mut self, requests: u64, events: u64) -> PrfaasRun {
        let window = seconds(self.last_arrival).max(1e-9);
        let backlog = requests - self.decoding_by_last_arrival;
        PrfaasRun {
            deployment: self.d.name.clone(),
            offered_rps: requests as f64 / window,
            requests,
            throughput_rps: self.decoding_by_last_arrival as f64 / window,
            backlog_at_last_arrival: backlog,
            // The last request to arrive cannot be decoding at its own arrival: one request
            // of backlog is always allowed, so a short trace can keep up.
            kept_up: backlog * 100 <= requests || backlog <= 1,
            ttft_s: Percentiles::of(&mut self.ttft),
            tbt_s: self.d.decode_step_s,
            p_prfaas: self.routed_prfaas as f64 / requests as f64,
            egress_gbps: self.egress_bytes_in_window * 8.0 / 1e9 / window,
            cache_transfer_bytes: self.cache_bytes,
            computed_fraction: self.computed as f64 / self.arrived_tokens.max(1) as f64,
            final_threshold_tokens: self.router.threshold_tokens(),
            events,
        }
    }
}

/// The lowest multiple of a workload's rate [`highest_kept_up`] tries before it gives up.
const LOWEST_RATE_MULTIPLE: f64 = 1e-3;

/// The run at the highest value of `x` (a rate, or a multiple of one) at which `run(x)` keeps
/// up: doubling from 1 until it does not, then bisection to 0.5%; an error if it keeps up at
/// no value down to [`LOWEST_RATE_MULTIPLE`].
fn highest_kept_up(run: impl Fn(f64) -> Result<PrfaasRun>) -> Result<PrfaasRun> {
    let mut hi = 1.0;
    while run(hi)?.kept_up {
        hi *= 2.0;
        if hi > 1e6 {
            break;
        }
    }
    let mut lo = 0.0;
    while (hi - lo) / hi > 0.005 {
        if lo == 0.0 && hi < LOWEST_RATE_MULTIPLE {
            // Slower still, every arrival waits on nothing: a deployment that keeps up with
            // none of these rates keeps up with none at all (and each slower run simulates
            // more sampling periods).
            let slowest = run(LOWEST_RATE_MULTIPLE)?;
            return Err(SchedError::NeverKeptUp {
                deployment: slowest.deployment,
                lowest: LOWEST_RATE_MULTIPLE,
                backlog: slowest.backlog_at_last_arrival,
                requests: slowest.requests,
            });
        }
        let mid = 0.5 * (lo + hi);
        if run(mid)?.kept_up {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    run(lo.max(1e-6))
}

/// The highest Poisson rate `deployment` keeps up with under paper 001's length distribution
/// (bisection to 0.5%), and the run at that rate.
pub fn sustainable_rate(deployment: &Deployment, requests: u64, seed: u64) -> Result<PrfaasRun> {
    let run = |rate: f64| {
        simulate(
            deployment,
            &Workload::LogNormal {
                lengths: TruncatedLogNormal::paper_001_workload(),
                output_tokens: PrfaasCluster::PAPER_001_CASE_STUDY.output_tokens as u64,
                rate_rps: rate,
                requests,
                seed,
            },
        )
    };
    highest_kept_up(run)
}

/// A log-normal fitted (maximum likelihood on `ln l`) to a trace's incremental prefill
/// lengths: each request's input minus its longest prefix already seen (an unbounded cache,
/// as the PD cluster's pool), requests with nothing to compute left out; truncated to the
/// shortest and longest seen. The fit ignores the truncation, which the trace's range makes
/// small.
pub fn fit_lengths(records: &[TraceRecord], block_tokens: u32) -> Result<TruncatedLogNormal> {
    count("block_tokens", u64::from(block_tokens))?;
    let mut cache = PrefixCache::<()>::new(0, Eviction::Lru);
    let mut logs = Vec::with_capacity(records.len());
    let (mut lo, mut hi) = (f64::INFINITY, 0f64);
    for r in records {
        let hit = cache.longest_prefix(&r.hash_ids) as u64 * u64::from(block_tokens);
        cache.access(&r.hash_ids, |_| (), &mut |_, _| ())?;
        let l = r.input_length.saturating_sub(hit);
        if l > 0 {
            let l = l as f64;
            logs.push(l.ln());
            lo = lo.min(l);
            hi = hi.max(l);
        }
    }
    if logs.len() < 2 {
        return Err(SchedError::EmptyWorkload);
    }
    let n = logs.len() as f64;
    let mu = logs.iter().sum::<f64>() / n;
    let sigma = (logs.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / n).sqrt();
    Ok(TruncatedLogNormal::new(mu, sigma, lo, hi.max(lo * 1.01))?)
}

/// The highest multiple of a trace's arrival rate `deployment` keeps up with (bisection on
/// the time scale to 0.5%), and the run there.
pub fn sustainable_trace_rate(
    deployment: &Deployment,
    records: &[TraceRecord],
    block_tokens: u32,
    cache_blocks: usize,
) -> Result<PrfaasRun> {
    let run = |scale: f64| {
        simulate(
            deployment,
            &Workload::Trace {
                records: records.to_vec(),
                block_tokens,
                cache_blocks,
                time_scale: scale,
            },
        )
    };
    highest_kept_up(run)
}

/// Paper 001 table 6's three deployments under one reading of the unpublished H20 profile.
#[derive(Debug, Clone, Serialize)]
pub struct CaseStudyReport {
    /// The PD cluster's prefill slowdown against table 5's H200 profile.
    pub h20_slowdown: f64,
    /// PrfaaS-PD at its sustainable rate.
    pub prfaas_pd: PrfaasRun,
    /// Homogeneous PD at its sustainable rate.
    pub homogeneous: PrfaasRun,
    /// Naive heterogeneous PD at its sustainable rate.
    pub naive: PrfaasRun,
    /// PrfaaS-PD's threshold and split.
    pub threshold_tokens: f64,
    /// PrfaaS-PD's `Np` and `Nd`; homogeneous PD's.
    pub splits: [(u32, u32); 2],
    /// PrfaaS-PD over homogeneous PD.
    pub throughput_ratio_vs_homogeneous: f64,
    /// PrfaaS-PD over naive heterogeneous.
    pub throughput_ratio_vs_naive: f64,
    /// TTFT of each at one common load, 90% of the slowest one's sustainable rate:
    /// PrfaaS-PD, homogeneous, naive.
    pub ttft_at_common_load_s: [Percentiles; 3],
    /// That load, requests per second.
    pub common_load_rps: f64,
}

/// Runs the case study at `slowdown` ([`H20_OVER_H200_PREFILL`] is the reading that
/// reproduces table 6's PD-P column; about 2.61 reproduces its homogeneous column).
pub fn case_study(slowdown: f64, requests: u64, seed: u64) -> Result<CaseStudyReport> {
    let deps = [
        CaseStudy::PrfaasPd,
        CaseStudy::HomogeneousPd,
        CaseStudy::NaiveHeterogeneous,
    ]
    .map(|w| Deployment::paper_001(w, slowdown));
    let [prfaas_dep, homogeneous_dep, naive_dep] = deps;
    let (prfaas_dep, homogeneous_dep, naive_dep) = (prfaas_dep?, homogeneous_dep?, naive_dep?);
    let prfaas_pd = sustainable_rate(&prfaas_dep, requests, seed)?;
    let homogeneous = sustainable_rate(&homogeneous_dep, requests, seed)?;
    let naive = sustainable_rate(&naive_dep, requests, seed)?;
    let common = 0.9
        * prfaas_pd
            .offered_rps
            .min(homogeneous.offered_rps)
            .min(naive.offered_rps);
    let at = |dep: &Deployment| -> Result<Percentiles> {
        Ok(simulate(
            dep,
            &Workload::LogNormal {
                lengths: TruncatedLogNormal::paper_001_workload(),
                output_tokens: PrfaasCluster::PAPER_001_CASE_STUDY.output_tokens as u64,
                rate_rps: common,
                requests,
                seed,
            },
        )?
        .ttft_s)
    };
    Ok(CaseStudyReport {
        h20_slowdown: slowdown,
        throughput_ratio_vs_homogeneous: prfaas_pd.offered_rps / homogeneous.offered_rps,
        throughput_ratio_vs_naive: prfaas_pd.offered_rps / naive.offered_rps,
        ttft_at_common_load_s: [at(&prfaas_dep)?, at(&homogeneous_dep)?, at(&naive_dep)?],
        common_load_rps: common,
        threshold_tokens: prfaas_dep.router.threshold_tokens,
        splits: [
            (
                prfaas_dep.pd_prefill_instances,
                prfaas_dep.pd_decode_instances,
            ),
            (
                homogeneous_dep.pd_prefill_instances,
                homogeneous_dep.pd_decode_instances,
            ),
        ],
        prfaas_pd,
        homogeneous,
        naive,
    })
}

/// The H20 slowdown that makes eq. 4 give table 6's homogeneous column (`Theta_pd-p` = 2.11
/// req/s with 9 prefill instances and every request, mean length `E[L]`, on PD-P).
pub fn homogeneous_reading_slowdown() -> f64 {
    let lengths = TruncatedLogNormal::paper_001_workload();
    9.0 / 2.11 / LengthProfile::paper_001_table_5().prefill_s(lengths.mean())
}

/// The reading that reproduces table 6's PD-P column (re-exported from the cost model).
pub const PD_P_READING_SLOWDOWN: f64 = H20_OVER_H200_PREFILL;

#[cfg(test)]
mod tests;
