//! bfloat16 carried as its raw bits (`u16`): the upper half of an IEEE f32. Conversion to f32 is
//! exact; conversion from f32 rounds to nearest, ties to even, as CUDA's `__float2bfloat16_rn`
//! and PyTorch's `.to(torch.bfloat16)` do, and keeps NaN a NaN.

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bf16 bits, round to nearest even.
#[inline]
pub fn from_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    // A NaN becomes a quiet NaN with the sign kept (rounding could carry it into infinity).
    // A select, not a branch, so loops over slices vectorise.
    let nan = ((bits >> 16) as u16) | 0x0040;
    if x.is_nan() { nan } else { from_f32_not_nan(x) }
}

/// [`from_f32`] for an `x` known not to be NaN (a NaN's rounding may carry into infinity):
/// the rounding alone, for hot loops that deal with NaN elsewhere.
#[inline]
pub(crate) fn from_f32_not_nan(x: f32) -> u16 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// f64 to bf16 bits with a single rounding (through f32 would round twice).
#[inline]
pub fn from_f64(x: f64) -> u16 {
    let f = x as f32; // round to nearest f32
    // If the f32 rounding landed exactly on a bf16 tie, the tie is not real: nudge towards x.
    let bits = f.to_bits();
    if !f.is_finite() || bits & 0xffff != 0x8000 {
        return from_f32(f);
    }
    // Sign-magnitude: bits + 1 grows the magnitude, bits - 1 shrinks it, whatever the sign.
    let (back, want) = (f64::from(f).abs(), x.abs());
    let adjusted = if back < want {
        f32::from_bits(bits + 1)
    } else if back > want {
        f32::from_bits(bits - 1)
    } else {
        f
    };
    from_f32(adjusted)
}

/// A slice of bf16 to f32.
pub fn slice_to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| to_f32(b)).collect()
}

/// A slice of f32 to bf16 (round to nearest even).
pub fn slice_from_f32(values: &[f32]) -> Vec<u16> {
    values.iter().map(|&v| from_f32(v)).collect()
}

/// The spacing of bf16 values at `x` (one unit in the last place), for tolerances.
pub fn ulp(x: f32) -> f32 {
    let b = from_f32(x.abs());
    to_f32(b.wrapping_add(1)) - to_f32(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rounds_to_nearest_even() {
        for b in [0u16, 0x3f80, 0xbf80, 0x7f7f, 0x0001, 0x8000] {
            assert_eq!(from_f32(to_f32(b)), b);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
        assert_eq!(from_f32(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
        assert_eq!(from_f32(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(from_f32(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3f81);
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        assert_eq!(from_f32(f32::INFINITY), 0x7f80);
        assert_eq!(from_f32(f32::MAX), 0x7f80, "overflow rounds to infinity");
    }

    #[test]
    fn from_f64_rounds_once() {
        // Just above a bf16 tie in f64, but the tie after rounding to f32.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(from_f32(x as f32), 0x3f80, "double rounding goes down");
        assert_eq!(from_f64(x), 0x3f81, "single rounding goes up");
        assert_eq!(from_f64(-x), 0xbf81, "and in magnitude for negative values");
        let below = 1.0 + 2f64.powi(-8) - 2f64.powi(-40);
        assert_eq!(
            from_f64(-below),
            0xbf80,
            "a negative value just under a tie rounds down"
        );
        let y = 1.0 + 2f64.powi(-8) - 2f64.powi(-40);
        assert_eq!(from_f64(y), 0x3f80);
        assert_eq!(from_f64(1.5), from_f32(1.5));
    }

    #[test]
    fn ulp_is_the_bf16_spacing() {
        assert_eq!(ulp(1.0), 2f32.powi(-7));
        assert_eq!(ulp(-3.0), 2f32.powi(-6));
    }
}
