//! A small seeded generator (xoshiro256++ seeded by SplitMix64) and the distributions the
//! workloads draw from. Runs are reproducible from their seed on every platform.

/// xoshiro256++ (Blackman and Vigna, 2019).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole stream follows from `seed`.
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self {
            s: [next(), next(), next(), next()],
        }
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Exponential with the given mean.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.uniform()).ln()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `LogNormal(mu, sigma)` truncated to `[lo, hi]`, by rejection (the callers' truncations
    /// keep most of the mass, so few draws are rejected).
    pub fn truncated_lognormal(&mut self, mu: f64, sigma: f64, lo: f64, hi: f64) -> f64 {
        for _ in 0..10_000 {
            let x = (mu + sigma * self.normal()).exp();
            if (lo..=hi).contains(&x) {
                return x;
            }
        }
        // Only a truncation holding almost no mass gets here.
        lo.max((mu).exp().min(hi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_follows_from_the_seed() {
        let a: Vec<u64> = (0..4)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let b: Vec<u64> = (0..4)
            .scan(Rng::new(7), |r, _| Some(r.next_u64()))
            .collect();
        let c: Vec<u64> = (0..4)
            .scan(Rng::new(8), |r, _| Some(r.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn moments_are_right() {
        let mut r = Rng::new(1);
        let n = 200_000;
        let mean_u = (0..n).map(|_| r.uniform()).sum::<f64>() / f64::from(n);
        let mean_e = (0..n).map(|_| r.exponential(3.0)).sum::<f64>() / f64::from(n);
        let z: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean_z = z.iter().sum::<f64>() / f64::from(n);
        let var_z = z.iter().map(|x| x * x).sum::<f64>() / f64::from(n);
        assert!((mean_u - 0.5).abs() < 0.005, "{mean_u}");
        assert!((mean_e - 3.0).abs() < 0.05, "{mean_e}");
        assert!(
            mean_z.abs() < 0.01 && (var_z - 1.0).abs() < 0.02,
            "{mean_z} {var_z}"
        );
        assert!((0..1000).all(|_| r.below(10) < 10));
    }
}
