//! The measured costs of the steps that are not wire transfers: the fetch splice, the sparse
//! gather's per-holder overhead, the holder's partial attention, and local re-prefill.
//!
//! Each default is calibrated from measurements paper 000 ("Move the Query, Not the Cache")
//! states in its text; the tests below recompute the calibration from those statements, so
//! the constants cannot drift from their sources unnoticed.

use serde::{Deserialize, Serialize};

use crate::error::{Result, finite, non_negative, positive};

/// The position-adaptation splice of a contiguous fetch: `fixed_us + per_token_us x ct`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpliceCost {
    /// Chunk-size-independent part (launch-bound per-layer delta rotation), microseconds.
    pub fixed_us: f64,
    /// Part that grows with the chunk (the scatter), microseconds per token.
    pub per_token_us: f64,
}

impl SpliceCost {
    /// The least-squares line through paper 000 section 7's measured splices on H100 with
    /// DeepSeek-V2-Lite: 2.77 / 2.78 / 2.91 / 3.06 ms at ct = 55 / 1024 / 2048 / 4096.
    pub const MEASURED_H100_V2_LITE: Self = Self {
        fixed_us: 2741.2,
        per_token_us: 0.076_866,
    };
    /// The rounded "flat ~3 ms splice" paper 000 sections 2.2 and 5.1 reason with.
    pub const FLAT_3_MS: Self = Self {
        fixed_us: 3000.0,
        per_token_us: 0.0,
    };

    /// Checks both terms (the fixed part must be positive: a splice is never free).
    pub fn validate(&self) -> Result<()> {
        positive("splice.fixed_us", self.fixed_us)?;
        non_negative("splice.per_token_us", self.per_token_us)?;
        Ok(())
    }

    /// The splice of a `tokens`-token chunk, in microseconds.
    #[inline]
    pub fn at(&self, tokens: f64) -> f64 {
        self.fixed_us + self.per_token_us * tokens
    }
}

/// The non-byte overhead of gathering a scattered selection from several holders, per layer:
/// `fixed_us_per_layer + holders x per_holder_us_per_layer` (each holder is a separate
/// transfer because scattering defeats bulk coalescing, paper 000 section 5.4).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GatherCost {
    /// Per-layer setup of a gather, microseconds.
    pub fixed_us_per_layer: f64,
    /// Per-layer handshake with each holder, microseconds.
    pub per_holder_us_per_layer: f64,
}

impl GatherCost {
    /// Paper 000 section 5.4 measures a top-2048 gather at ~1.3 ms per layer from one holder
    /// and ~3.9 ms from seven (2-node H100, IBGDA, host-copy-bound prototype). The per-holder
    /// term is the slope, (3.9 - 1.3) / 6 ms; the fixed term is what remains at one holder
    /// after the slope and the 2048 x 1152 B payload at IBGDA's 25 GB/s (94.4 us).
    pub const PROTOTYPE_H100_IBGDA: Self = Self {
        fixed_us_per_layer: 772.3,
        per_holder_us_per_layer: 433.3,
    };

    /// Checks both terms.
    pub fn validate(&self) -> Result<()> {
        non_negative("gather.fixed_us_per_layer", self.fixed_us_per_layer)?;
        non_negative(
            "gather.per_holder_us_per_layer",
            self.per_holder_us_per_layer,
        )?;
        Ok(())
    }

    /// The overhead of one layer's gather from `holders` holders, microseconds.
    #[inline]
    pub fn per_layer_us(&self, holders: f64) -> f64 {
        self.fixed_us_per_layer + holders * self.per_holder_us_per_layer
    }
}

/// A holder's partial attention: `rows` query rows against `tokens` attended entries, priced
/// as a fixed dispatch cost plus a roofline of three bounds, whichever is largest:
///
/// - `floor_us`: the latency of a kernel that underuses its device (launch, one wave);
/// - `tokens x us_per_token`: reading the attended entries once (memory-bound: few rows);
/// - `rows x tokens x us_per_row_token`: the row-by-entry work (compute-bound: many rows).
///
/// `rows` is the holder's whole batch: the routed requesters it serves at once share one
/// kernel call (paper 000 section 6.3), so a decision prices `Mq x holder_requesters` rows.
/// Under sparse selection the holder attends its share of the top-k entries through an
/// indexed gather, which costs [`SparsePremium`] over the dense kernel at the same count.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HolderCompute {
    /// Dispatch cost added to every call whatever its size (waking a CPU holder's worker
    /// threads, for one), microseconds; 0 where the floor covers it, as on a GPU.
    #[serde(default)]
    pub fixed_us: f64,
    /// Latency floor of one kernel call, microseconds.
    pub floor_us: f64,
    /// Memory bound: microseconds per attended entry.
    pub us_per_token: f64,
    /// Compute bound: microseconds per (query row, attended entry) pair.
    pub us_per_row_token: f64,
    /// The indexed-gather premium of the sparse kernel.
    pub sparse: SparsePremium,
    /// A kernel measured at several batch sizes, used instead of the three bounds where
    /// present (a CPU kernel's efficiency moves with the batch in steps no roofline has:
    /// register blocking, the rows at which it starts a second thread).
    #[serde(default)]
    pub table: Option<KernelTable>,
}

impl HolderCompute {
    /// FlashMLA on one H100, fitted to paper 000 section 6.3's statements at ct = 2048 with
    /// 16 rows per requester: flat up to N ~ 8 requesters, 15-37 us for N <= 16, <= 0.4 ms at
    /// N = 256. The floor is the flat 15 us; the compute bound passes through 400 us at
    /// N = 256 (4096 rows x 2048 entries), which leaves the floor at N ~ 9.8 and gives 25 us
    /// at N = 16; the memory bound is 1152 B per entry at the H100's 3.35 TB/s, never the
    /// largest at these shapes.
    pub const FLASHMLA_H100: Self = Self {
        fixed_us: 0.0,
        floor_us: 15.0,
        us_per_token: 1152.0 / 3.35e6,
        us_per_row_token: 400.0 / (4096.0 * 2048.0),
        sparse: SparsePremium::FLASHMLA_H100,
        table: None,
    };

    /// Checks the terms.
    pub fn validate(&self) -> Result<()> {
        if let Some(table) = &self.table {
            table.validate()?;
        }
        non_negative("holder.fixed_us", self.fixed_us)?;
        non_negative("holder.floor_us", self.floor_us)?;
        non_negative("holder.us_per_token", self.us_per_token)?;
        positive("holder.us_per_row_token", self.us_per_row_token)?;
        self.sparse.validate()
    }

    /// The dense partial of `rows` rows over `tokens` entries, microseconds.
    #[inline]
    pub fn dense_us(&self, rows: f64, tokens: f64) -> f64 {
        self.fixed_us + self.shape_us(rows, tokens)
    }

    /// The call's cost without the fixed dispatch: the measured table where there is one,
    /// else the roofline.
    #[inline]
    pub fn shape_us(&self, rows: f64, tokens: f64) -> f64 {
        match &self.table {
            Some(table) => table.at(rows, tokens),
            None => self.roofline_us(rows, tokens),
        }
    }

    /// The roofline alone (no fixed cost): the largest of the three bounds.
    #[inline]
    pub fn roofline_us(&self, rows: f64, tokens: f64) -> f64 {
        self.floor_us
            .max(tokens * self.us_per_token)
            .max(rows * tokens * self.us_per_row_token)
    }

    /// The sparse partial of `rows` rows over `entries` selected entries, of a selection of
    /// `topk` per query, microseconds.
    #[inline]
    pub fn sparse_us(&self, rows: f64, entries: f64, topk: f64) -> f64 {
        self.dense_us(rows, entries) * self.sparse.at(topk)
    }
}

/// A kernel timed at [`KernelTable::ROWS`] query rows, each at two chunk sizes: per row
/// count, a fixed cost and a cost per attended entry. Between two row counts both are
/// interpolated in log rows (the cost per entry as a cost per row-entry); beyond the last,
/// the cost per row-entry of the last holds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KernelTable {
    /// Per row count, the fixed part, microseconds.
    pub fixed_us: [f64; 5],
    /// Per row count, microseconds per attended entry (all rows together).
    pub us_per_token: [f64; 5],
}

impl KernelTable {
    /// The row counts the table is measured at.
    pub const ROWS: [f64; 5] = [1.0, 16.0, 64.0, 256.0, 1024.0];

    /// Checks every entry: finite, the fixed parts non-negative, the rates positive.
    pub fn validate(&self) -> Result<()> {
        for (&fixed, &rate) in self.fixed_us.iter().zip(&self.us_per_token) {
            non_negative("holder.table.fixed_us", fixed)?;
            positive("holder.table.us_per_token", rate)?;
        }
        Ok(())
    }

    /// The call of `rows` rows over `tokens` entries, microseconds.
    pub fn at(&self, rows: f64, tokens: f64) -> f64 {
        let r = rows.max(1.0);
        let last = Self::ROWS.len() - 1;
        let per_row_token = |i: usize| self.us_per_token[i] / Self::ROWS[i];
        if r >= Self::ROWS[last] {
            return self.fixed_us[last] + r * tokens * per_row_token(last);
        }
        let i = Self::ROWS.iter().rposition(|&x| x <= r).unwrap_or(0);
        let w = (r.ln() - Self::ROWS[i].ln()) / (Self::ROWS[i + 1].ln() - Self::ROWS[i].ln());
        let fixed = self.fixed_us[i] + w * (self.fixed_us[i + 1] - self.fixed_us[i]);
        let rate = per_row_token(i) + w * (per_row_token(i + 1) - per_row_token(i));
        fixed + r * tokens * rate
    }
}

/// How much more the sparse (indexed-gather) partial costs than the dense one over as many
/// entries, as a line in the selection budget `k`, never below 1.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SparsePremium {
    /// The premium extrapolated to k = 0.
    pub at_zero: f64,
    /// Added premium per selected entry.
    pub per_entry: f64,
}

impl SparsePremium {
    /// Paper 000 section 6.3: FlashMLA's bf16 sparse kernel costs 1.1x the dense one at
    /// k = 512, widening to 2-3x at k = 2048; the line through (512, 1.1) and (2048, 2.5).
    pub const FLASHMLA_H100: Self = Self {
        at_zero: 1.1 - 512.0 * (1.4 / 1536.0),
        per_entry: 1.4 / 1536.0,
    };
    /// No premium: a sparse partial costs what a dense one over as many entries does.
    pub const NONE: Self = Self {
        at_zero: 1.0,
        per_entry: 0.0,
    };

    /// Checks the terms.
    pub fn validate(&self) -> Result<()> {
        finite("holder.sparse.at_zero", self.at_zero)?;
        non_negative("holder.sparse.per_entry", self.per_entry)?;
        Ok(())
    }

    /// The premium at a selection budget of `topk`.
    #[inline]
    pub fn at(&self, topk: f64) -> f64 {
        (self.at_zero + self.per_entry * topk).max(1.0)
    }
}

/// The requester's online-softmax merge of the partials a decision brings back:
/// `fixed_us + rows x parts x us_per_row_part`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MergeCost {
    /// Per-merge fixed cost (a kernel launch), microseconds.
    pub fixed_us: f64,
    /// Microseconds per (query row, merged partial) pair.
    pub us_per_row_part: f64,
}

impl MergeCost {
    /// Paper 000 section 4.2 bounds the merge at <= 25 us and gives no curve. This preset is
    /// that bound placed at the paper's operating point (Mq = 1024, the requester's partial
    /// and one routed partial: 2048 row-parts), over a 5 us launch: an upper bound spread
    /// linearly, not a measurement.
    pub const PAPER_BOUND: Self = Self {
        fixed_us: 5.0,
        us_per_row_part: 20.0 / 2048.0,
    };

    /// Checks the terms.
    pub fn validate(&self) -> Result<()> {
        non_negative("merge.fixed_us", self.fixed_us)?;
        non_negative("merge.us_per_row_part", self.us_per_row_part)?;
        Ok(())
    }

    /// The merge of `parts` partials of `rows` rows each, microseconds.
    #[inline]
    pub fn at(&self, rows: f64, parts: f64) -> f64 {
        self.fixed_us + rows * parts * self.us_per_row_part
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::least_squares;

    #[test]
    fn measured_splice_is_the_least_squares_line_through_section_7s_four_points() {
        let points = [
            (55.0, 2770.0),
            (1024.0, 2780.0),
            (2048.0, 2910.0),
            (4096.0, 3060.0),
        ];
        let line = least_squares(points.iter().copied()).unwrap();
        let s = SpliceCost::MEASURED_H100_V2_LITE;
        assert!((line.intercept - s.fixed_us).abs() < 0.1, "{line:?}");
        assert!((line.slope - s.per_token_us).abs() < 1e-5, "{line:?}");
        for (ct, ms) in points {
            assert!((s.at(ct) - ms).abs() / ms < 0.02, "ct {ct}");
        }
    }

    #[test]
    fn prototype_gather_reproduces_1_3_ms_from_one_holder_and_3_9_ms_from_seven() {
        let g = GatherCost::PROTOTYPE_H100_IBGDA;
        let payload_us = 2048.0 * 1152.0 / 25e3;
        let one = g.per_layer_us(1.0) + payload_us;
        let seven = g.per_layer_us(7.0) + payload_us;
        assert!((one - 1300.0).abs() < 1.0, "{one}");
        assert!((seven - 3900.0).abs() < 1.0, "{seven}");
    }

    /// Paper 000 section 6.3, figure 4(b): FlashMLA at ct = 2048, 16 rows per requester.
    #[test]
    fn holder_compute_honours_section_6_3_flat_to_8_decode_band_and_saturation_bound() {
        let h = HolderCompute::FLASHMLA_H100;
        let at = |n: u32| h.dense_us(16.0 * f64::from(n), 2048.0);
        assert_eq!(at(1), at(8), "flat up to the elbow");
        assert!(at(12) > at(8), "linear beyond it");
        for n in 1..=16 {
            assert!((15.0..=37.0).contains(&at(n)), "N = {n}: {}", at(n));
        }
        assert!(at(256) <= 400.0 + 1e-9, "{}", at(256));
        assert!(at(256) > 390.0, "saturated: {}", at(256));
    }

    #[test]
    fn holder_compute_grows_with_the_chunk_and_with_the_selection_budget() {
        let h = HolderCompute::FLASHMLA_H100;
        // 128 frontier heads x 8 requesters: past the floor, so the chunk shows.
        let rows = 1024.0;
        let mut last = 0.0;
        for ct in [512.0, 2048.0, 8192.0, 65_536.0] {
            let us = h.dense_us(rows, ct);
            assert!(us > last, "ct {ct}: {us} after {last}");
            last = us;
        }
        assert!(h.dense_us(rows, 65_536.0) / h.dense_us(rows, 2048.0) > 31.0);
        let mut last = 0.0;
        for k in [512.0, 1024.0, 2048.0] {
            let us = h.sparse_us(rows, k, k);
            assert!(us > last, "top-{k}: {us} after {last}");
            last = us;
        }
    }

    /// Paper 000 section 6.3: the sparse kernel is 1.1x the dense one at k = 512 and 2-3x at
    /// k = 2048, 17-60 us at h_q = 128.
    #[test]
    fn sparse_premium_matches_section_6_3() {
        let p = SparsePremium::FLASHMLA_H100;
        assert!((p.at(512.0) - 1.1).abs() < 1e-12);
        assert!((2.0..=3.0).contains(&p.at(2048.0)), "{}", p.at(2048.0));
        assert_eq!(p.at(0.0), 1.0, "never below the dense kernel");
        let h = HolderCompute::FLASHMLA_H100;
        for k in [1024.0, 2048.0] {
            let us = h.sparse_us(128.0, k, k);
            assert!((17.0..=60.0).contains(&us), "top-{k}: {us}");
        }
    }

    #[test]
    fn a_kernel_table_reproduces_its_points_and_interpolates_between_them() {
        let t = KernelTable {
            fixed_us: [20.0, 300.0, 400.0, 800.0, 600.0],
            us_per_token: [0.15, 0.85, 3.2, 8.4, 33.0],
        };
        t.validate().unwrap();
        for (i, &rows) in KernelTable::ROWS.iter().enumerate() {
            let want = t.fixed_us[i] + 2048.0 * t.us_per_token[i];
            assert!((t.at(rows, 2048.0) - want).abs() < 1e-9, "rows {rows}");
        }
        // Between 16 and 64 rows, and beyond 1024 at the last row-entry cost.
        let mid = t.at(32.0, 2048.0);
        assert!(mid > t.at(16.0, 2048.0) && mid < t.at(64.0, 2048.0));
        assert!((t.at(2048.0, 1000.0) - (600.0 + 2048.0 * 1000.0 * 33.0 / 1024.0)).abs() < 1e-6);
        let h = HolderCompute {
            table: Some(t),
            fixed_us: 100.0,
            ..HolderCompute::FLASHMLA_H100
        };
        assert!((h.dense_us(16.0, 2048.0) - (100.0 + t.at(16.0, 2048.0))).abs() < 1e-9);
        let bad = KernelTable {
            us_per_token: [0.15, 0.0, 3.2, 8.4, 33.0],
            ..t
        };
        assert!(bad.validate().is_err());
        assert!(
            HolderCompute {
                table: Some(bad),
                ..HolderCompute::FLASHMLA_H100
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn merge_grows_with_rows_and_parts_and_meets_the_section_4_2_bound() {
        let m = MergeCost::PAPER_BOUND;
        assert!((m.at(1024.0, 2.0) - 25.0).abs() < 1e-9);
        assert!(m.at(16.0, 2.0) < m.at(1024.0, 2.0));
        assert!(m.at(1024.0, 7.0) > m.at(1024.0, 2.0));
    }

    #[test]
    fn step_costs_reject_bad_values() {
        assert!(
            SpliceCost {
                fixed_us: 0.0,
                per_token_us: 0.0
            }
            .validate()
            .is_err()
        );
        assert!(
            SpliceCost {
                fixed_us: 1.0,
                per_token_us: -1.0
            }
            .validate()
            .is_err()
        );
        assert!(
            GatherCost {
                fixed_us_per_layer: f64::NAN,
                per_holder_us_per_layer: 0.0
            }
            .validate()
            .is_err()
        );
        assert!(
            HolderCompute {
                us_per_row_token: 0.0,
                ..HolderCompute::FLASHMLA_H100
            }
            .validate()
            .is_err()
        );
        assert!(
            MergeCost {
                fixed_us: -1.0,
                us_per_row_part: 0.0
            }
            .validate()
            .is_err()
        );
    }
}
