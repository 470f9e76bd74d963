//! The library's calls on host memory, CUDA against the CPU path: the figures behind
//! `Backend::Auto`'s choices (`AUTO_GPU_MIN_ROWS`, `AUTO_RESIDENT_MIN_ROWS`). A CUDA call
//! here uploads its inputs, runs, and downloads its result; the CPU call runs in place. The
//! resident table is a holder's call: the cache uploaded once beforehand
//! (`Gpu::upload_rows`), each call taking host query rows and writing the wire partial into
//! host memory (`partial_resident_wire`), against the CPU's `partial_dense_wire`; then the
//! same call timed after the GPU sat idle for 1-50 ms, as a holder's GPU does between
//! requests.
//!
//! ```sh
//! cargo run --release -p kvroute-kernels --example host_to_host
//! ```
//!
//! Each figure is the median of 15 calls after one untimed call, in microseconds.

use std::time::{Duration, Instant};

use kvroute_kernels::cuda::Gpu;
use kvroute_kernels::layout::PARTIAL_ROW_BYTES;
use kvroute_kernels::workload::rows;
use kvroute_kernels::{
    Backend, Cache, KernelError, Partial, Queries, WireOut, merge_with, partial_dense,
    partial_dense_wire, partial_resident_wire,
};

const SCALE: f32 = 0.1147;

fn median_us(call: impl FnMut() -> Result<(), KernelError>) -> Result<f64, KernelError> {
    median_after_idle_us(Duration::ZERO, call)
}

/// The median of 15 calls, each timed after `idle` with nothing running (one untimed call
/// first).
fn median_after_idle_us(
    idle: Duration,
    mut call: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    call()?;
    let mut times = Vec::with_capacity(15);
    for _ in 0..15 {
        if !idle.is_zero() {
            std::thread::sleep(idle);
        }
        let start = Instant::now();
        call()?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    Ok(kvroute_costmodel::fit::median(&mut times).unwrap_or(f64::NAN))
}

fn main() -> Result<(), KernelError> {
    println!("dense partial, us per call");
    println!("{:>5} {:>6} {:>10} {:>10}", "Mq", "ct", "cuda", "cpu");
    for ct in [2048usize, 8192] {
        let c = rows(ct, 2);
        let cache = Cache::contiguous(&c)?;
        for mq in [1usize, 16, 64, 128, 256] {
            let q = rows(mq, 1);
            let q = Queries::new(&q)?;
            let on = |backend| median_us(|| partial_dense(backend, &q, &cache, SCALE).map(drop));
            let (gpu, cpu) = (on(Backend::Cuda)?, on(Backend::Cpu)?);
            println!("{mq:>5} {ct:>6} {gpu:>10.1} {cpu:>10.1}");
        }
    }
    println!("a holder's dense partial into its wire rows, us per call");
    println!("{:>5} {:>6} {:>10} {:>10}", "Mq", "ct", "resident", "cpu");
    let gpu = Gpu::global()?;
    for ct in [2048usize, 8192] {
        let c = rows(ct, 2);
        let cache = Cache::contiguous(&c)?;
        let resident = gpu.upload_rows(&c)?;
        for mq in [1usize, 2, 4, 8, 16, 32, 64, 256] {
            let q = rows(mq, 1);
            let q = Queries::new(&q)?;
            let mut out = vec![0u8; mq * PARTIAL_ROW_BYTES];
            let on_gpu = median_us(|| {
                let mut wire = WireOut::new([&mut out[..]])?;
                partial_resident_wire(gpu, &resident, 0..ct, &q, None, SCALE, &mut wire)
            })?;
            let on_cpu = median_us(|| {
                let mut wire = WireOut::new([&mut out[..]])?;
                partial_dense_wire(Backend::Cpu, &q, &cache, SCALE, &mut wire)
            })?;
            println!("{mq:>5} {ct:>6} {on_gpu:>10.1} {on_cpu:>10.1}");
        }
    }
    println!("the same call after the GPU sat idle, ct = 2048, us per call");
    println!("{:>5} {:>8} {:>10}", "Mq", "idle us", "resident");
    let c = rows(2048, 2);
    let resident = gpu.upload_rows(&c)?;
    for mq in [1usize, 16, 256] {
        let q = rows(mq, 1);
        let q = Queries::new(&q)?;
        let mut out = vec![0u8; mq * PARTIAL_ROW_BYTES];
        for idle_us in [0u64, 1_000, 10_000, 50_000] {
            let us = median_after_idle_us(Duration::from_micros(idle_us), || {
                let mut wire = WireOut::new([&mut out[..]])?;
                partial_resident_wire(gpu, &resident, 0..2048, &q, None, SCALE, &mut wire)
            })?;
            println!("{mq:>5} {idle_us:>8} {us:>10.1}");
        }
    }
    println!("merge, us per call");
    println!("{:>6} {:>5} {:>10} {:>10}", "parts", "rows", "cuda", "cpu");
    for (n, mq) in [(2usize, 16usize), (8, 16), (8, 128), (8, 256), (32, 256)] {
        let q = rows(mq, 1);
        let q = Queries::new(&q)?;
        let parts = (0..n)
            .map(|i| {
                let c = rows(64, 10 + i as u64);
                partial_dense(Backend::Cpu, &q, &Cache::contiguous(&c)?, SCALE)
            })
            .collect::<Result<Vec<Partial>, KernelError>>()?;
        let refs: Vec<&Partial> = parts.iter().collect();
        let on = |backend| median_us(|| merge_with(backend, &refs).map(drop));
        let (gpu, cpu) = (on(Backend::Cuda)?, on(Backend::Cpu)?);
        println!("{n:>6} {mq:>5} {gpu:>10.1} {cpu:>10.1}");
    }
    Ok(())
}
