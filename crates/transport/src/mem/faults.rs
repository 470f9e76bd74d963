//! Deliberate misbehaviour for tests: delayed, reordered and failed deliveries, drawn from a
//! seeded generator so a failing run can be replayed exactly.

use std::time::Duration;

/// What the `mem` domain does to the writes it delivers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPlan {
    /// Seed of the generator behind every random choice.
    pub seed: u64,
    /// Shortest delay before a write lands.
    pub min_delay: Duration,
    /// Longest delay before a write lands.
    pub max_delay: Duration,
    /// Deliver the writes that are due in a random order instead of posting order.
    pub reorder: bool,
    /// Probability that a write fails instead of landing (the target stays untouched).
    pub fail_probability: f64,
}

impl FaultPlan {
    /// A well-behaved NIC: every write lands at once, in order.
    pub const NONE: Self = Self {
        seed: 0,
        min_delay: Duration::ZERO,
        max_delay: Duration::ZERO,
        reorder: false,
        fail_probability: 0.0,
    };

    /// Random order and delays up to `max_delay`, nothing failing.
    pub const fn chaos(seed: u64, max_delay: Duration) -> Self {
        Self {
            seed,
            min_delay: Duration::ZERO,
            max_delay,
            reorder: true,
            fail_probability: 0.0,
        }
    }

    /// Whether any fault is configured (deliveries then go through the slow, queued path).
    pub fn is_active(&self) -> bool {
        self.reorder || !self.max_delay.is_zero() || self.fail_probability > 0.0
    }
}

impl Default for FaultPlan {
    fn default() -> Self {
        Self::NONE
    }
}

/// SplitMix64: tiny, fast, and its sequence for a seed never changes between versions.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) const fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, bound)` (`bound > 0`).
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// True with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A duration in `[min, max]`.
    pub(crate) fn between(&mut self, min: Duration, max: Duration) -> Duration {
        let span = max.saturating_sub(min).as_nanos().min(u128::from(u64::MAX)) as u64;
        min + Duration::from_nanos(if span == 0 { 0 } else { self.below(span + 1) })
    }

    /// Shuffles `items` (Fisher-Yates).
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_fixed_by_the_seed() {
        let mut a = SplitMix64::new(42);
        let mut b = SplitMix64::new(42);
        let xs: Vec<_> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(xs, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        // The reference SplitMix64 output for seed 0 begins with this value.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn draws_respect_their_bounds() {
        let mut r = SplitMix64::new(7);
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
            let d = r.between(Duration::from_micros(5), Duration::from_micros(9));
            assert!(d >= Duration::from_micros(5) && d <= Duration::from_micros(9));
        }
        assert!(!r.chance(0.0));
        assert!(r.chance(1.0));
        let mut v: Vec<u32> = (0..50).collect();
        r.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(v, sorted, "50 items stay in order with probability 1/50!");
    }
}
