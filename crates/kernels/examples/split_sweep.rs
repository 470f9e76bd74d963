//! Times the CUDA partial (split-K pass and combine together) at each split the planner
//! could choose, beside the planner's own choice, so the planner can be checked on a GPU:
//!
//! ```sh
//! cargo run --release -p kvroute-kernels --example split_sweep
//! ```
//!
//! Columns: `auto` is `Gpu::prepare_partial`'s plan, `tN` is N tiles of 16 keys per block.
//! Each figure is the mean over 200 launches timed with CUDA events, on resident inputs.
//! docs/kernels.md records an H200's table and the planner's unit test holds its choices.

use kvroute_kernels::cuda::Gpu;
use kvroute_kernels::workload::rows;
use kvroute_kernels::{Cache, KernelError, Queries, Selection};

const SCALE: f32 = 0.1147;
const LAUNCHES: usize = 200;
const TILES_PER_SPLIT: [Option<usize>; 7] =
    [None, Some(1), Some(2), Some(4), Some(8), Some(16), Some(64)];
/// (query rows, cache tokens, top-k: 0 for dense, else one query token's selection shared by
/// its rows as by that many heads)
const POINTS: [(usize, usize, usize); 10] = [
    (1, 2048, 0),
    (16, 2048, 0),
    (64, 2048, 0),
    (256, 2048, 0),
    (1, 8192, 0),
    (16, 8192, 0),
    (128, 8192, 0),
    (16, 8192, 2048),
    (16, 8192, 512),
    (128, 8192, 2048),
];

fn main() -> Result<(), KernelError> {
    let gpu = Gpu::global()?;
    println!(
        "{} ({}, {} SMs), us per call",
        gpu.info().name,
        gpu.info().arch,
        gpu.info().sms
    );
    print!("{:>5} {:>6} {:>6}", "mq", "ct", "top-k");
    for t in TILES_PER_SPLIT {
        print!(" {:>8}", t.map_or("auto".to_owned(), |t| format!("t{t}")));
    }
    println!();
    for (mq, ct, k) in POINTS {
        let (q, c) = (rows(mq, 1), rows(ct, 2));
        let (q, cache) = (Queries::new(&q)?, Cache::contiguous(&c)?);
        // Spread over the cache: a stride coprime to the power-of-two token counts.
        let idx: Vec<i32> = (0..k).map(|i| ((i * 7919) % ct) as i32).collect();
        let sel = (k > 0)
            .then(|| Selection::new(&idx, k, mq, mq, ct))
            .transpose()?;
        print!("{mq:>5} {ct:>6} {k:>6}");
        for t in TILES_PER_SPLIT {
            let mut p = gpu.prepare_partial_split(&q, &cache, sel.as_ref(), SCALE, t)?;
            let us = gpu.time_us(LAUNCHES, || gpu.launch_partial(&mut p))?;
            print!(" {us:>8.1}");
        }
        println!();
    }
    Ok(())
}
