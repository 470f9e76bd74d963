//! The CPU splice: angles once per token in f64 (shared by all layers), rotation in f64 with a
//! single rounding (bit-identical to the reference), latent dims copied, tokens in parallel.

use rayon::prelude::*;

use crate::layout::{D_LATENT, D_QK};
use crate::rope::rotate_row_f64;
use crate::splice::SpliceJob;

/// A destination row pointer that may cross threads: every (layer, token) has its own row, and
/// [`SpliceJob::new`] refused block tables that repeat a page, so no two writes overlap.
#[derive(Clone, Copy)]
struct Pool(*mut u16);
// SAFETY: used only to write disjoint rows (see above) while the job's `&mut` pool is held.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    // A method, so closures capture the whole `Pool` (Send + Sync), not its raw field.
    fn base(self) -> *mut u16 {
        self.0
    }
}

pub(crate) fn splice(job: &mut SpliceJob<'_>) {
    let pool = Pool(job.pool.as_mut_ptr());
    let pool_len = job.pool.len();
    let job = &*job;
    (0..job.tokens()).into_par_iter().for_each(|t| {
        let angles = job.rope.angles(job.to[t] - job.from[t]);
        for layer in 0..job.layers {
            let start = job.dst_start(layer, t);
            assert!(start + D_QK <= pool_len, "validated by SpliceJob::new");
            // SAFETY: `start..start + 576` is inside the pool (checked above) and is this
            // (layer, token)'s own row: distinct pages per table entry, distinct slots per token.
            let dst = unsafe { std::slice::from_raw_parts_mut(pool.base().add(start), D_QK) };
            let src = job.src_row(layer, t);
            dst[..D_LATENT].copy_from_slice(&src[..D_LATENT]);
            dst[D_LATENT..].copy_from_slice(&src[D_LATENT..]);
            rotate_row_f64(dst, &angles, job.rope.layout());
        }
    });
}
