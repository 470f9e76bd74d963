//! Latency percentiles and max/avg balance, as the papers report them.

pub use kvroute_costmodel::fit::Percentiles;

/// Max over avg of `loads` (1.0 is perfect balance); `None` when every load is zero.
pub fn max_over_avg(loads: &[f64]) -> Option<f64> {
    let sum: f64 = loads.iter().sum();
    if loads.is_empty() || sum <= 0.0 {
        return None;
    }
    let max = loads.iter().copied().fold(0.0, f64::max);
    Some(max / (sum / loads.len() as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance() {
        assert_eq!(max_over_avg(&[1.0, 1.0, 1.0]), Some(1.0));
        assert_eq!(max_over_avg(&[3.0, 0.0, 0.0]), Some(3.0));
        assert_eq!(max_over_avg(&[0.0, 0.0]), None);
        assert_eq!(max_over_avg(&[]), None);
    }
}
