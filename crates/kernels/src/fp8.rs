//! FP8 cache rows in DeepSeek-V3.2's sparse-decode layout (FlashMLA's "FP8 KV cache": 656 bytes
//! a token): the 512 latent dims as e4m3 with one f32 scale per 128 of them, then the 64 RoPE
//! dims kept in bf16.
//!
//! ```text
//! bytes 0..512    latent dims 0..512, e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa)
//! bytes 512..528  4 f32 scales, little-endian: dims 128 i .. 128 i + 127 are e4m3 x scale[i]
//! bytes 528..656  RoPE dims, 64 bf16, little-endian
//! ```
//!
//! The quantizer picks power-of-two scales (the UE8M0 scale format of DeepSeek-V3's FP8
//! recipes): the smallest power of two with `max |x| / scale <= 448`, e4m3's largest value. A
//! dequantized value, e4m3 (4 significant bits) times a power of two, is then exact in bf16, so
//! dequantizing on the CPU and on the GPU gives the same bits. Rows with other scales are
//! accepted as they come (the kernels round `e4m3 * scale` to bf16, nearest even).

use crate::bf16;
use crate::error::{KernelError, check_len};
use crate::layout::{D_LATENT, D_QK, D_ROPE};

/// Bytes of one FP8 token row.
pub const FP8_ROW_BYTES: usize = D_LATENT + SCALES * 4 + D_ROPE * 2;
/// Latent dims under one scale.
pub const FP8_GROUP: usize = 128;
/// e4m3's largest finite magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Scales per row.
const SCALES: usize = D_LATENT / FP8_GROUP;
/// Where the scales and the RoPE dims start in a row.
const SCALES_AT: usize = D_LATENT;
const ROPE_AT: usize = D_LATENT + SCALES * 4;

/// The magnitude of e4m3 code `c` (0..=126; 127 is NaN), exactly.
const fn e4m3_magnitude(c: u8) -> f32 {
    let (e, m) = ((c >> 3) & 0xf, c & 7);
    if e == 0 {
        m as f32 / 512.0
    } else {
        f32::from_bits(((e as u32 + 120) << 23) | ((m as u32) << 20))
    }
}

/// Every finite e4m3 magnitude, by code: increasing.
const MAGNITUDES: [f32; 127] = {
    let mut t = [0.0f32; 127];
    let mut c = 0;
    while c < 127 {
        t[c] = e4m3_magnitude(c as u8);
        c += 1;
    }
    t
};

/// An e4m3 byte as f32 (exact; `S.1111.111` is NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let mag = match b & 0x7f {
        0x7f => return f32::NAN,
        c => MAGNITUDES[c as usize],
    };
    if b & 0x80 != 0 { -mag } else { mag }
}

/// `x` rounded to the nearest e4m3 (ties to the even code), saturating at +-448; NaN gives NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    let above = MAGNITUDES.partition_point(|&m| m < a);
    let code = match above {
        0 => 0,
        127.. => 126,
        hi => {
            let lo = hi - 1;
            let (below, over) = (a - MAGNITUDES[lo], MAGNITUDES[hi] - a);
            if below < over || (below == over && lo % 2 == 0) {
                lo
            } else {
                hi
            }
        }
    };
    sign | code as u8
}

/// The power-of-two scale for a group whose largest magnitude is `amax`: the smallest with
/// `amax / scale <= 448` (1 for an all-zero group), within f32's normal range.
fn group_scale(amax: f32) -> f32 {
    if amax == 0.0 {
        return 1.0;
    }
    let need = f64::from(amax) / f64::from(E4M3_MAX);
    let mut e = need.log2().ceil() as i32;
    // log2 may land one off at exact powers of two; settle on the smallest power that covers.
    while 2f64.powi(e) < need {
        e += 1;
    }
    while 2f64.powi(e - 1) >= need {
        e -= 1;
    }
    2f32.powi(e.clamp(-126, 127))
}

/// Quantizes one bf16 cache row (576 values) into `out` (656 bytes). Refuses a row with a NaN
/// or an infinity among its latent dims (no scale represents it), naming the dim.
pub fn quantize_row(row: &[u16], out: &mut [u8]) -> Result<(), KernelError> {
    check_len("bf16 cache row", D_QK, row.len())?;
    check_len("FP8 cache row bytes", FP8_ROW_BYTES, out.len())?;
    if let Some(d) = row[..D_LATENT].iter().position(|&b| b & 0x7f80 == 0x7f80) {
        return Err(KernelError::Parameter {
            what: "latent dim to quantize (its index)",
            value: d as f64,
            why: "must be finite: FP8 has no infinity and a NaN scale corrupts its group",
        });
    }
    for (g, group) in row[..D_LATENT].chunks_exact(FP8_GROUP).enumerate() {
        let amax = group
            .iter()
            .map(|&b| bf16::to_f32(b).abs())
            .fold(0.0f32, f32::max);
        let scale = group_scale(amax);
        for (d, &b) in group.iter().enumerate() {
            out[g * FP8_GROUP + d] = f32_to_e4m3(bf16::to_f32(b) / scale);
        }
        out[SCALES_AT + 4 * g..SCALES_AT + 4 * g + 4].copy_from_slice(&scale.to_le_bytes());
    }
    for (d, &b) in row[D_LATENT..].iter().enumerate() {
        out[ROPE_AT + 2 * d..ROPE_AT + 2 * d + 2].copy_from_slice(&b.to_le_bytes());
    }
    Ok(())
}

/// Quantizes `[tokens, 576]` bf16 rows into `[tokens, 656]` bytes.
pub fn quantize(rows: &[u16]) -> Result<Vec<u8>, KernelError> {
    check_len("bf16 cache rows", rows.len() / D_QK * D_QK, rows.len())?;
    let mut out = vec![0u8; rows.len() / D_QK * FP8_ROW_BYTES];
    for (row, dst) in rows
        .chunks_exact(D_QK)
        .zip(out.chunks_exact_mut(FP8_ROW_BYTES))
    {
        quantize_row(row, dst)?;
    }
    Ok(out)
}

/// One FP8 row (656 bytes) as the bf16 row the kernels attend: each latent dim
/// `e4m3 * scale` rounded to bf16 (nearest even), the RoPE dims as stored. Any bytes decode (a
/// NaN code or scale gives NaN values, which the kernels refuse as non-finite).
pub fn dequantize_row(row: &[u8], out: &mut [u16]) {
    debug_assert_eq!((row.len(), out.len()), (FP8_ROW_BYTES, D_QK));
    for g in 0..SCALES {
        let s = &row[SCALES_AT + 4 * g..SCALES_AT + 4 * g + 4];
        let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        for d in g * FP8_GROUP..(g + 1) * FP8_GROUP {
            out[d] = bf16::from_f32(e4m3_to_f32(row[d]) * scale);
        }
    }
    for d in 0..D_ROPE {
        out[D_LATENT + d] = u16::from_le_bytes([row[ROPE_AT + 2 * d], row[ROPE_AT + 2 * d + 1]]);
    }
}

/// Dequantizes `[tokens, 656]` bytes into `[tokens, 576]` bf16 rows.
pub fn dequantize(rows: &[u8]) -> Result<Vec<u16>, KernelError> {
    check_len(
        "FP8 cache row bytes",
        rows.len() / FP8_ROW_BYTES * FP8_ROW_BYTES,
        rows.len(),
    )?;
    let mut out = vec![0u16; rows.len() / FP8_ROW_BYTES * D_QK];
    for (row, dst) in rows
        .chunks_exact(FP8_ROW_BYTES)
        .zip(out.chunks_exact_mut(D_QK))
    {
        dequantize_row(row, dst);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_layout_is_656_bytes() {
        assert_eq!(FP8_ROW_BYTES, 656);
        assert_eq!((SCALES_AT, ROPE_AT), (512, 528));
    }

    /// Every code decodes to the value the e4m3 definition gives, and encodes back to itself
    /// (-0 to 0x80); 448 is the largest, 2^-9 the smallest subnormal.
    #[test]
    fn e4m3_codes_round_trip() {
        for b in 0..=255u8 {
            let x = e4m3_to_f32(b);
            if b & 0x7f == 0x7f {
                assert!(x.is_nan());
                assert_eq!(f32_to_e4m3(x) & 0x7f, 0x7f);
                continue;
            }
            let (e, m) = (i32::from((b >> 3) & 0xf), f64::from(b & 7));
            let want = if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            let want = if b & 0x80 != 0 { -want } else { want };
            assert_eq!(f64::from(x), want, "code {b:#x}");
            assert_eq!(f32_to_e4m3(x), b, "code {b:#x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    /// Rounding: to the nearer neighbour, ties to the even code, saturation past 448.
    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // 1.0 (0x38) and 1.125 (0x39): 1.0625 is a tie, goes to the even code 0x38; 1.1875 is
        // a tie between 0x39 and 1.25 (0x3a), goes to 0x3a.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        assert_eq!(f32_to_e4m3(-1.07), 0xb9);
        assert_eq!(f32_to_e4m3(1e6), 0x7e);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        // A quarter of the smallest subnormal (2^-9) goes to 0; 1.5 x 2^-9 is a tie between
        // codes 1 and 2, and goes to 2.
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0x00);
        assert_eq!(f32_to_e4m3(3.0 * 2f32.powi(-10)), 0x02);
    }

    #[test]
    fn scales_are_the_smallest_covering_power_of_two() {
        assert_eq!(group_scale(448.0), 1.0);
        assert_eq!(group_scale(448.5), 2.0);
        assert_eq!(group_scale(1.0), 2f32.powi(-8));
        assert_eq!(group_scale(0.0), 1.0);
        assert_eq!(group_scale(3.75), 2f32.powi(-6)); // 3.75 / 2^-6 = 240 <= 448 < 480
    }

    /// A quantized row dequantizes within e4m3's half-ulp (1/16 relative, or 2^-10 of its
    /// group's scale near zero), keeps the RoPE dims bit for bit, and the result is exactly
    /// `e4m3 x scale` in bf16 (the scales are powers of two).
    #[test]
    fn rows_round_trip_within_e4m3_precision() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut row = vec![0u16; D_QK];
        for (d, v) in row.iter_mut().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let f =
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * (1.0 + (d / 128) as f32 * 30.0);
            *v = bf16::from_f32(f);
        }
        let q = quantize(&row).unwrap();
        assert_eq!(q.len(), FP8_ROW_BYTES);
        let back = dequantize(&q).unwrap();
        assert_eq!(&back[D_LATENT..], &row[D_LATENT..]);
        for g in 0..SCALES {
            let s = f32::from_le_bytes(q[512 + 4 * g..516 + 4 * g].try_into().unwrap());
            assert_eq!(s.to_bits() & 0x007f_ffff, 0, "scale {s} is a power of two");
            for d in g * FP8_GROUP..(g + 1) * FP8_GROUP {
                let (a, b) = (bf16::to_f32(row[d]), bf16::to_f32(back[d]));
                assert_eq!(b, e4m3_to_f32(q[d]) * s, "dim {d}: exact in bf16");
                assert!(
                    (a - b).abs() <= a.abs() / 16.0 + s * 2f32.powi(-10),
                    "dim {d}: {a} {b}"
                );
            }
        }
    }

    #[test]
    fn non_finite_latents_are_refused_naming_the_dim() {
        let mut row = vec![0x3f80u16; D_QK];
        row[300] = 0x7fc0;
        let mut out = vec![0u8; FP8_ROW_BYTES];
        assert!(matches!(
            quantize_row(&row, &mut out),
            Err(KernelError::Parameter { value, .. }) if value == 300.0
        ));
        // A non-finite RoPE value is carried as is (it is bf16 in the layout too).
        row[300] = 0x3f80;
        row[D_LATENT + 3] = 0x7f80;
        assert!(quantize_row(&row, &mut out).is_ok());
        assert!(quantize(&row[..D_QK - 1]).is_err());
        assert!(dequantize(&out[..FP8_ROW_BYTES - 1]).is_err());
    }
}
