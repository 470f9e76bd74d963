//! Run-time choice of instruction set: AVX-512 (F/BW/VL, or with BF16 dot products) and AVX2 +
//! FMA, each written with intrinsics ([`super::avx512`], [`super::avx2`]), and the plain loops
//! ([`super::tile`]) for baseline x86-64 (or the target's baseline elsewhere).

use serde::{Deserialize, Serialize};

use super::tile::RowState;
use super::{Scratch, dense_range, sparse_range};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use crate::layout::Cache;

/// An instruction set the CPU kernels can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Isa {
    /// AVX-512 F/BW/VL with BF16 dot products (`vdpbf16ps`, 32 products per instruction) for
    /// the scores, FMA for the values.
    Avx512Bf16,
    /// AVX-512 F/BW/VL with FMA: 16 f32 lanes; bf16 rows widened in registers.
    Avx512,
    /// AVX2 with FMA: 8 f32 lanes.
    Avx2,
    /// The target's baseline (SSE2 on x86-64), no FMA.
    Scalar,
}

impl Isa {
    /// The fastest this CPU supports. AVX-512 with f32 FMAs comes before AVX-512 BF16: on the
    /// Xeon (Emerald Rapids) this was measured on, `vdpbf16ps` retires one per two cycles
    /// against two FMAs per cycle, so its 32 products per instruction lose to 2 x 16 (see
    /// docs/perf.md); [`Isa::Avx512Bf16`] stays available by name.
    pub fn detect() -> Self {
        [Self::Avx512, Self::Avx2]
            .into_iter()
            .find(|i| i.is_available())
            .unwrap_or(Self::Scalar)
    }

    /// Whether this CPU can run it.
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Bf16 => {
                Self::Avx512.is_available() && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512Bf16 | Self::Avx512 | Self::Avx2 => false,
            Self::Scalar => true,
        }
    }

    /// Every instruction set this CPU can run, widest first.
    pub fn available() -> Vec<Self> {
        [Self::Avx512Bf16, Self::Avx512, Self::Avx2, Self::Scalar]
            .into_iter()
            .filter(|i| i.is_available())
            .collect()
    }
}

/// Runs `f`, plain loops written for the compiler to vectorise, compiled for the widest
/// instruction set this CPU has (AVX-512 F/BW/VL, AVX2, or the baseline). `f` must be
/// inlined into the `#[target_feature]` function that calls it, so pass
/// `#[inline(always)] || helper(..)` with `helper` `#[inline(always)]` too: a closure left out
/// of line is compiled as baseline code (the merge's was, without the attribute; its
/// disassembly showed a jump to the SSE2 closure). Results do not depend on the choice: Rust
/// never fuses a multiply and an add on its own.
#[inline]
pub(crate) fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    match Isa::detect() {
        // SAFETY: `Isa::detect` found the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { with_avx512(f) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { with_avx2(f) },
        _ => f(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Avx512Bf16 => "avx512bf16",
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
            Self::Scalar => "scalar",
        })
    }
}

/// Tokens `t0..t1` of `cache` folded into `st` (bf16 query rows `q`, softmax scale `scale`),
/// on `isa` (which must be available; the callers check, and fall back to scalar otherwise).
pub(crate) fn dense(
    isa: Isa,
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    (t0, t1): (usize, usize),
    st: &mut RowState,
    scratch: &mut Scratch,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only used when `Isa::is_available` found its features at run time.
        Isa::Avx512Bf16 if isa.is_available() => unsafe {
            avx512::dense_dp(q, scale, cache, t0, t1, st)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 if isa.is_available() => unsafe {
            avx512::dense_fma(q, scale, cache, t0, t1, st)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if isa.is_available() => unsafe {
            avx2::dense_range(q, scale, cache, (t0, t1), st, scratch)
        },
        _ => dense_range(q, scale, cache, (t0, t1), st, scratch),
    }
}

/// The selected tokens `picked` (padding skipped) folded into `st`, on `isa`.
pub(crate) fn sparse(
    isa: Isa,
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    picked: &[i32],
    st: &mut RowState,
    scratch: &mut Scratch,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is only used when `Isa::is_available` found its features at run time.
        Isa::Avx512Bf16 if isa.is_available() => unsafe {
            avx512::sparse_dp(q, scale, cache, picked, st)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 if isa.is_available() => unsafe {
            avx512::sparse_fma(q, scale, cache, picked, st)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 if isa.is_available() => unsafe {
            avx2::sparse_range(q, scale, cache, picked, st, scratch)
        },
        _ => sparse_range(q, scale, cache, picked, st, scratch),
    }
}
