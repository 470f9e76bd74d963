//! Per-window totals of a DualPath run: storage-NIC read bytes per node and finished tokens,
//! and from them (with the forward passes' attention balance) the storage-NIC balance figure
//! and the time series of [`DualPathRun`](crate::dualpath_sim::DualPathRun).
//!
//! Sparse: a window has an entry only if something happened in it (a read in progress, a
//! completion, a forward pass), so time and memory follow the events and the time the storage
//! NICs are busy, not the simulated seconds. Kept densely (a slot per window per node, a series
//! point per window), a trace whose arrivals are far apart cost about 8 bytes per simulated
//! second per reading node and 48 per series point: 500 requests 1,000 s apart at
//! `--time-scale` 0.01 (5e7 simulated seconds, three policies) took 20 s and 9 GB, round robin
//! at ~450 events/s; sparse, 0.01 s and 9 MB, ~2.5M events/s, with the same figures.

use std::collections::{BTreeMap, BTreeSet};

use crate::des::{Nanos, seconds};
use crate::dualpath_sim::SeriesPoint;
use crate::stats::max_over_avg;

/// Totals of the windows in which something happened.
#[derive(Debug)]
pub(crate) struct WindowTotals {
    window: Nanos,
    nodes: usize,
    /// Storage-NIC read bytes by (window, node).
    reads: BTreeMap<(u64, u32), f64>,
    /// Prompt and generated tokens finished, by window.
    done: BTreeMap<u64, f64>,
}

/// What the totals say about a run.
#[derive(Debug)]
pub(crate) struct Summary {
    /// Storage-NIC read max/avg across nodes of each window that had reads and ended by the
    /// end of the loaded phase, in window order.
    pub(crate) balances: Vec<f64>,
    /// The time series; see [`WindowTotals::summarise`].
    pub(crate) series: Vec<SeriesPoint>,
}

impl WindowTotals {
    /// No totals yet, for windows of `window` ns (at least 1) over `nodes` nodes.
    pub(crate) fn new(window: Nanos, nodes: usize) -> Self {
        Self {
            window: window.max(1),
            nodes,
            reads: BTreeMap::new(),
            done: BTreeMap::new(),
        }
    }

    /// Adds `bytes` read by `node`'s storage NIC, spread evenly over `[start, end)` (all in
    /// the window of `end - 1` when the interval is empty). One entry per window the read
    /// spans: a read costs its duration in windows, never the idle time before it.
    pub(crate) fn add_read(&mut self, node: u32, start: Nanos, end: Nanos, bytes: f64) {
        if bytes <= 0.0 {
            return;
        }
        if end <= start {
            *self
                .reads
                .entry((end.saturating_sub(1) / self.window, node))
                .or_insert(0.0) += bytes;
            return;
        }
        let rate = bytes / (end - start) as f64;
        let mut t = start;
        while t < end {
            let w = t / self.window;
            let edge = (w + 1).saturating_mul(self.window).min(end);
            *self.reads.entry((w, node)).or_insert(0.0) += (edge - t) as f64 * rate;
            t = edge;
        }
    }

    /// Adds `tokens` finished at `at`.
    pub(crate) fn add_done(&mut self, at: Nanos, tokens: f64) {
        *self.done.entry(at / self.window).or_insert(0.0) += tokens;
    }

    /// Entries held: what the bookkeeping costs.
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.reads.len() + self.done.len()
    }

    /// The balance figure and the series, given each forward pass's start and attention
    /// max/avg (`passes`) and the end of the loaded phase (`loaded_until`).
    ///
    /// The series has a point for every window in which something happened, in order, and
    /// for each stretch of idle windows before the last of those, a point for its first and
    /// its last window (zero throughput, no balance): a line through the points is the line
    /// through every window, without a point per idle second. A run with no idle window gets
    /// a point per window, as it always did.
    pub(crate) fn summarise(&self, passes: &[(Nanos, f64)], loaded_until: Nanos) -> Summary {
        // Sum and count of the passes' attention max/avg by window.
        let mut attention: BTreeMap<u64, (f64, u32)> = BTreeMap::new();
        for &(t, b) in passes {
            let sum = attention.entry(t / self.window).or_insert((0.0, 0));
            sum.0 += b;
            sum.1 += 1;
        }
        let active: BTreeSet<u64> = (self.reads.keys().map(|&(w, _)| w))
            .chain(self.done.keys().copied())
            .chain(attention.keys().copied())
            .collect();
        let window_s = seconds(self.window);
        let idle = |w: u64| SeriesPoint {
            t_s: seconds(w * self.window),
            tokens_per_s: 0.0 / window_s,
            snic_max_over_avg: None,
            attention_max_over_avg: None,
        };
        let mut balances = Vec::new();
        let mut series = Vec::new();
        let mut loads = vec![0.0; self.nodes];
        // The first window not yet in the series.
        let mut next = 0;
        for &w in &active {
            if w > next {
                series.push(idle(next));
            }
            if w > next + 1 {
                series.push(idle(w - 1));
            }
            loads.fill(0.0);
            for (&(_, n), &bytes) in self.reads.range((w, 0)..=(w, u32::MAX)) {
                loads[n as usize] = bytes;
            }
            let b = max_over_avg(&loads);
            if (w + 1).saturating_mul(self.window) <= loaded_until
                && let Some(b) = b
            {
                balances.push(b);
            }
            series.push(SeriesPoint {
                t_s: seconds(w * self.window),
                tokens_per_s: self.done.get(&w).copied().unwrap_or(0.0) / window_s,
                snic_max_over_avg: b,
                attention_max_over_avg: attention
                    .get(&w)
                    .filter(|(_, n)| *n > 0)
                    .map(|&(sum, n)| sum / f64::from(n)),
            });
            next = w + 1;
        }
        Summary { balances, series }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// The dense bookkeeping this replaced: a slot per window per node, a point per window.
    struct Dense {
        window: Nanos,
        reads: Vec<Vec<f64>>,
        done: Vec<f64>,
    }

    impl Dense {
        fn add_read(&mut self, node: u32, start: Nanos, end: Nanos, bytes: f64) {
            let windows = &mut self.reads[node as usize];
            let last = (end.saturating_sub(1) / self.window) as usize;
            if windows.len() <= last {
                windows.resize(last + 1, 0.0);
            }
            if end <= start {
                windows[last] += bytes;
                return;
            }
            let rate = bytes / (end - start) as f64;
            let mut t = start;
            while t < end {
                let w = (t / self.window) as usize;
                let edge = ((w as u64 + 1) * self.window).min(end);
                windows[w] += (edge - t) as f64 * rate;
                t = edge;
            }
        }

        fn add_done(&mut self, at: Nanos, tokens: f64) {
            let w = (at / self.window) as usize;
            if self.done.len() <= w {
                self.done.resize(w + 1, 0.0);
            }
            self.done[w] += tokens;
        }

        fn summarise(&self, passes: &[(Nanos, f64)], loaded_until: Nanos) -> Summary {
            let mut attention: Vec<(f64, u32)> = Vec::new();
            for &(t, b) in passes {
                let w = (t / self.window) as usize;
                if attention.len() <= w {
                    attention.resize(w + 1, (0.0, 0));
                }
                attention[w].0 += b;
                attention[w].1 += 1;
            }
            let windows = self.reads.iter().map(Vec::len).max().unwrap_or(0);
            let (mut balances, mut series) = (Vec::new(), Vec::new());
            let mut loads = vec![0.0; self.reads.len()];
            for w in 0..windows.max(self.done.len()).max(attention.len()) {
                for (n, load) in loads.iter_mut().enumerate() {
                    *load = self.reads[n].get(w).copied().unwrap_or(0.0);
                }
                let b = max_over_avg(&loads);
                if (w as u64 + 1) * self.window <= loaded_until
                    && let Some(b) = b
                {
                    balances.push(b);
                }
                series.push(SeriesPoint {
                    t_s: seconds(w as u64 * self.window),
                    tokens_per_s: self.done.get(w).copied().unwrap_or(0.0) / seconds(self.window),
                    snic_max_over_avg: b,
                    attention_max_over_avg: attention
                        .get(w)
                        .filter(|(_, n)| *n > 0)
                        .map(|&(sum, n)| sum / f64::from(n)),
                });
            }
            Summary { balances, series }
        }
    }

    /// Random reads (FIFO per node, some of no duration), completions and passes with idle
    /// stretches between bursts: the sparse totals give bit for bit the dense balances, and
    /// the dense series less the idle windows inside each idle stretch.
    #[test]
    fn sparse_totals_match_the_dense_ones_bit_for_bit() {
        for seed in 0..32 {
            let mut rng = Rng::new(seed);
            let (window, nodes) = (1000, 3);
            let mut sparse = WindowTotals::new(window, nodes);
            let mut dense = Dense {
                window,
                reads: vec![Vec::new(); nodes],
                done: Vec::new(),
            };
            let mut busy = vec![0; nodes];
            let (mut now, mut passes) = (0, Vec::new());
            let mut active = BTreeSet::new();
            for _ in 0..400 {
                // Mostly small steps, sometimes an idle stretch of up to 40 windows.
                now += if rng.below(20) == 0 {
                    rng.below(40_000)
                } else {
                    rng.below(700)
                };
                let node = rng.below(nodes as u64) as u32;
                let took = if rng.below(5) == 0 {
                    0
                } else {
                    rng.below(3000)
                };
                let start = busy[node as usize].max(now);
                let end = start + took;
                busy[node as usize] = end;
                let bytes = 1.0 + rng.uniform() * 1e6;
                sparse.add_read(node, start, end, bytes);
                dense.add_read(node, start, end, bytes);
                let last = end.saturating_sub(1) / window;
                active.extend(if took == 0 { last } else { start / window }..=last);
                if rng.below(3) == 0 {
                    let tokens = 1.0 + rng.below(5000) as f64;
                    sparse.add_done(now, tokens);
                    dense.add_done(now, tokens);
                    active.insert(now / window);
                }
                if rng.below(2) == 0 {
                    passes.push((now, 1.0 + rng.uniform()));
                    active.insert(now / window);
                }
            }
            let loaded_until = now / 2;
            let (got, want) = (
                sparse.summarise(&passes, loaded_until),
                dense.summarise(&passes, loaded_until),
            );
            let bits = |v: &[f64]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got.balances), bits(&want.balances), "seed {seed}");
            assert!(!want.balances.is_empty());
            let is_active = |w: u64| active.contains(&w);
            let kept: Vec<SeriesPoint> = (want.series.iter().enumerate())
                .filter(|&(w, _)| {
                    let w = w as u64;
                    is_active(w) || w == 0 || is_active(w - 1) || is_active(w + 1)
                })
                .map(|(_, p)| *p)
                .collect();
            assert_eq!(got.series, kept, "seed {seed}");
            assert!(
                got.series.len() < want.series.len(),
                "seed {seed}: no idle stretch"
            );
        }
    }
}
