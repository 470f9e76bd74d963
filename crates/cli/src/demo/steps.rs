//! The requester side of the demo: connect (to given holders or through a directory),
//! calibrate, and drive the checked decode steps of `kvroute_remote::checked` through a
//! `Stepper`, between steps following the directory and acting as the demo asks (a pause, a
//! killed holder). Decisions, transfers, local partials, merges and checks are the library's.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvroute_costmodel::Primitive;
use kvroute_kernels::Backend;
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::checked::{CheckedConfig, CheckedRun};
use kvroute_remote::step::{StepConfig, Stepper};
use kvroute_remote::{Requester, RequesterConfig};
use kvroute_transport::ProviderChoice;

use super::follow::Follower;
use super::{DemoReport, HEADS, SCALE, Served, TOPK};
use crate::args::{PrimitiveArg, StepArgs};
use crate::calibrate::{CalibrationSummary, calibrate, corpus_model};

/// The requests' own prompt before the document: the chunks are placed past it, so every
/// route rotates its queries and every fetch splices its chunk.
const PREFIX: i64 = 4096;
/// Rows of each request's own KV at the first step (its prompt's tail); one more a step.
const OWN_TOKENS: usize = 64;

/// The primitive `--force` names.
fn forced(arg: PrimitiveArg) -> Primitive {
    match arg {
        PrimitiveArg::Route => Primitive::Route,
        PrimitiveArg::Fetch => Primitive::Fetch,
        PrimitiveArg::Local => Primitive::Local,
    }
}

/// How the requester finds its holders.
pub(super) enum Discovery<'a> {
    /// These control addresses, connected at start.
    Addrs(&'a [SocketAddr]),
    /// A directory, followed for the whole run.
    Directory {
        /// `etcd://...`.
        url: &'a str,
        /// The lease TTL the directory is opened with.
        ttl: Duration,
        /// How long a step waits for a chunk with no live holder.
        wait: Duration,
    },
}

/// The most holders a requester following a directory connects to over a run (each reserves
/// a link of staging and reply region).
const MAX_DIRECTORY_HOLDERS: usize = 16;

/// Connects a requester to the holders, calibrates its selector, and runs the checked decode
/// steps `plan` asks for (R = `--batch` requests a step), then the sparse step, with queries
/// and the selection drawn from `seed`; `before_step` may act before each step (the demo's
/// kill) and report what it did.
pub(super) fn decode_steps(
    command: &str,
    spec: &CorpusSpec,
    provider: &ProviderChoice,
    discovery: Discovery<'_>,
    (plan, seed): (&StepArgs, u64),
    before_step: &mut dyn FnMut(u32) -> Result<Option<String>>,
) -> Result<DemoReport> {
    let (engine, provider_name) =
        super::holders::requester_engine(provider, Duration::from_millis(plan.timeout_ms))?;
    let config = RequesterConfig {
        timeout: Duration::from_millis(plan.timeout_ms),
        link_bytes: 4 << 20,
        // Every chunk in the fetch cache, and room for a gather.
        pool_pages: spec.layout().pages() as u32 * (spec.chunks + 1),
        scale: SCALE,
        spin: Duration::from_millis(1),
        max_holders: 0,
    };
    let (mut req, mut follower) = match discovery {
        Discovery::Addrs(holders) => (Requester::connect(engine, holders, config)?, None),
        Discovery::Directory { url, ttl, wait } => {
            let mut follower = Follower::open(url, ttl, wait)?;
            let config = RequesterConfig {
                max_holders: MAX_DIRECTORY_HOLDERS,
                ..config
            };
            let mut req = Requester::connect(engine, &[], config)?;
            follower.await_chunks(&mut req, spec.chunks, 0)?;
            (req, Some(follower))
        }
    };
    let rope = spec.rope()?;
    let probe_rows = queries(2048, spec.tokens() as i64, &rope, 99);
    let to0: Vec<i64> = spec
        .positions(ChunkId(0))
        .iter()
        .map(|p| p + PREFIX)
        .collect();
    let cal = calibrate(&mut req, spec, &probe_rows, Some((ChunkId(0), &to0)))?;
    let summary = CalibrationSummary::of(&cal)?;
    let (probe_sweep, fitted, probe_fallback) = (
        cal.probe.points.clone(),
        (summary.probe_us, summary.bw_gbps),
        cal.probe.fallback.clone(),
    );
    let mut step_config = StepConfig::new(corpus_model(spec)?, rope);
    step_config.force = plan.force.map(forced);
    step_config.backend = Backend::Cpu;
    step_config.poll_every = Duration::from_millis(plan.poll_ms);
    step_config.fetch_budget = spec.chunks as usize * spec.layout().full_bytes();
    let mut stepper = Stepper::new(req, cal, step_config).context("the step API")?;
    let layers = vec![0, spec.layers / 2, spec.layers - 1];
    let mut run = CheckedRun::new(
        spec,
        CheckedConfig {
            requests: plan.batch as usize,
            heads: HEADS,
            prefix: PREFIX,
            own_tokens: OWN_TOKENS,
            topk: TOPK,
            layers,
            seed,
        },
    )?;
    let mut step_ms = Vec::with_capacity(plan.steps as usize + 1);
    for step in 0..=plan.steps {
        if step > 0 && plan.pause_ms > 0 && step < plan.steps {
            let pause = Duration::from_millis(plan.pause_ms);
            match follower.as_mut() {
                Some(f) => f.pause(stepper.requester(), pause, step),
                None => std::thread::sleep(pause),
            }
        }
        if step < plan.steps
            && let Some(what) = before_step(step)?
        {
            run.note(what);
        }
        let started = Instant::now();
        if let Some(f) = follower.as_mut() {
            follow(f, stepper.requester(), spec.chunks, step)?;
        }
        // The dense steps, then the sparse one.
        let served = if step < plan.steps {
            run.dense_step(&mut stepper, step)
        } else {
            run.sparse_step(&mut stepper, step)
        }
        .with_context(|| format!("decode step {step}"))?;
        step_ms.push(started.elapsed().as_secs_f64() * 1e3);
        if let Some(f) = follower.as_mut() {
            for h in served {
                f.served(h);
            }
        }
    }
    let stats = stepper.stats();
    let holders = stepper.requester().holders();
    let served = Served::by_live_holders(stepper.requester());
    let checked = run.finish();
    Ok(DemoReport {
        command: command.to_owned(),
        provider: provider_name,
        holders,
        chunks: spec.chunks,
        chunk_tokens: spec.chunk_tokens,
        layers: spec.layers,
        requests: plan.batch as usize,
        probe_sweep,
        fitted,
        probe_fallback,
        calibration: summary,
        passed: checked.passed(),
        checked,
        stats,
        served,
        step_ms,
        directory: follower.map(|f| f.report),
    })
}

/// With a directory: notes holders the stepper found dead, applies the newest view, and
/// waits for every chunk to have a live holder (the stepper brings its selector in line).
fn follow(follower: &mut Follower, req: &mut Requester, chunks: u32, step: u32) -> Result<()> {
    // A route or fetch that failed since the last step took its holder out of use inside
    // the requester; the report notes when (the earliest way it was found dead wins).
    for h in 0..req.holders() {
        if !req.is_alive(h) {
            follower.dead(h, "a route or fetch to it failed");
        }
    }
    follower.await_chunks(req, chunks, step)
}
