//! What the step API adds to a decode step that only routes: `Stepper::step` (decisions,
//! staging, per-request merge) against `dispatch::route_merged` on the same calls, through the
//! same requester, alternated call by call in one run; the median of each and their ratio.
//!
//!     cargo run --release -p kvroute-remote --example step_overhead            # mem and shm
//!     cargo run --release -p kvroute-remote --example step_overhead -- shm     # one of them

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvroute_costmodel::{Primitive, model_preset};
use kvroute_kernels::RopeLayout;
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::dispatch::route_merged;
use kvroute_remote::probe::ProbeConfig;
use kvroute_remote::step::{CalibrationInputs, ChunkRef, StepConfig, StepRequest, Stepper};
use kvroute_remote::{Call, HeldChunks, Holder, HolderConfig, Requester, RequesterConfig};
use kvroute_transport::{FabricConfig, MemFabric, ProviderChoice, TransferEngine};

const SCALE: f32 = 0.1147;
/// Timed calls of each, after 20 of each to warm up.
const CALLS: usize = 300;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let which = std::env::args().nth(1);
    println!(
        "{:<5} {:>4} {:>16} {:>12} {:>10}",
        "fabric", "Mq", "route_merged us", "step us", "step / it"
    );
    for fabric in ["mem", "shm"] {
        if which.as_deref().is_some_and(|w| w != fabric) {
            continue;
        }
        for mq in [16usize, 64] {
            let (a, b) = measure(fabric, mq)?;
            println!("{fabric:<5} {mq:>4} {a:>16.1} {b:>12.1} {:>9.3}x", b / a);
        }
    }
    Ok(())
}

fn engine(fabric: &str, mem: &MemFabric) -> Result<TransferEngine, Box<dyn std::error::Error>> {
    if fabric == "mem" {
        return Ok(TransferEngine::mem(mem, 1)?);
    }
    let config = FabricConfig {
        provider: ProviderChoice::Shm,
        required: true,
        ..FabricConfig::default()
    };
    Ok(TransferEngine::fabric(&config, Default::default())?.0)
}

/// Medians (route_merged, step) in microseconds for one request of `mq` rows over four
/// 512-token chunks on two holders, every chunk routed.
fn measure(fabric: &str, mq: usize) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let spec = CorpusSpec {
        layers: 2,
        chunk_tokens: 512,
        chunks: 4,
        seed: 3,
        rope_theta: 10_000.0,
        yarn: Some(kvroute_kernels::Yarn::DEEPSEEK),
        rope_layout: RopeLayout::Interleaved,
    };
    let mem = MemFabric::new();
    let mut holders = Vec::new();
    for chunks in [[0u32, 1], [2, 3]] {
        let engine = engine(fabric, &mem)?;
        let ids: Vec<ChunkId> = chunks.iter().map(|&c| ChunkId(c)).collect();
        let held = HeldChunks::generate(&engine, &spec, &ids)?;
        holders.push(Holder::start(
            engine,
            TcpListener::bind("127.0.0.1:0")?,
            held,
            HolderConfig::default(),
        )?);
    }
    let addrs: Vec<_> = holders.iter().map(Holder::addr).collect();
    let config = RequesterConfig {
        timeout: Duration::from_secs(5),
        ..RequesterConfig::new(SCALE)
    };
    let req = Requester::connect(engine(fabric, &mem)?, &addrs, config)?;
    let mut model = model_preset("deepseek-v2-lite")?.dims;
    model.layers = spec.layers;
    let probe_rows = queries(64, 5000, &spec.rope()?, 1);
    let probe = ProbeConfig {
        mq: vec![1, 16, 64],
        reps: 10,
        ..ProbeConfig::default()
    };
    let inputs = CalibrationInputs {
        model,
        rope: spec.rope()?,
        chunk_tokens: spec.chunk_tokens,
        probe_rows: &probe_rows,
        pull: None,
        probe: &probe,
    };
    let mut step_config = StepConfig::new(model, spec.rope()?);
    step_config.force = Some(Primitive::Route);
    let mut stepper = Stepper::calibrated(req, inputs, step_config)?;
    let q = queries(mq, 3000, &spec.rope()?, 2);
    // Every chunk where it is stored: the step routes the same query rows route_merged does.
    let refs: Vec<ChunkRef<'_>> = (0..spec.chunks)
        .map(|c| ChunkRef::dense(ChunkId(c), spec.positions(ChunkId(c))[0]))
        .collect();
    let request = [StepRequest {
        queries: &q,
        heads: 16.min(mq),
        chunks: &refs,
        local: None,
    }];
    let calls: Vec<Call<'_>> = (0..spec.chunks)
        .map(|c| Call {
            chunk: ChunkId(c),
            layer: 1,
            queries: &q,
            sparse: None,
        })
        .collect();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..CALLS + 20 {
        let t = Instant::now();
        route_merged(stepper.requester(), &calls)?;
        let ua = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        stepper.step(1, &request)?;
        let ub = t.elapsed().as_secs_f64() * 1e6;
        if i >= 20 {
            a.push(ua);
            b.push(ub);
        }
    }
    let median = |v: &mut [f64]| kvroute_costmodel::fit::median(v).unwrap_or(f64::NAN);
    Ok((median(&mut a), median(&mut b)))
}
