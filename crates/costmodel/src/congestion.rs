//! Congestion: how a contended fabric reprices a redistribution.
//!
//! Paper 000 section 8 ("Congestion") names two effects on axes the model already has: a
//! lower effective bandwidth and an additive queueing delay on the probe. A third input,
//! concurrent flows sharing one link, is priced as a fair share of the link's peak; that is
//! the bound for backlogged flows. Bursty route flows degrade later than it predicts (the
//! paper measures flat latency through K = 2 extra flows on NDR-200), so it is conservative.

use serde::{Deserialize, Serialize};

use crate::error::{CostModelError, Result, at_least_one, count};
use crate::fabric::Fabric;

/// The contention a redistribution runs under.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Congestion {
    /// Effective bandwidth is divided by this (1 = uncontended).
    pub bw_degradation: f64,
    /// The probe is multiplied by this (1 = no queueing).
    pub probe_inflation: f64,
    /// Flows sharing the link, this one included (1 = alone).
    pub concurrent_flows: u32,
}

impl Default for Congestion {
    fn default() -> Self {
        Self::NONE
    }
}

impl Congestion {
    /// An idle fabric.
    pub const NONE: Self = Self {
        bw_degradation: 1.0,
        probe_inflation: 1.0,
        concurrent_flows: 1,
    };

    /// Checks the factors: each at least 1, finite.
    pub fn validate(&self) -> Result<()> {
        at_least_one("bw_degradation", self.bw_degradation)?;
        at_least_one("probe_inflation", self.probe_inflation)?;
        count("concurrent_flows", self.concurrent_flows)?;
        Ok(())
    }

    /// The fabric as one flow sees it under this contention.
    pub fn apply(&self, fabric: &Fabric) -> Result<Fabric> {
        self.validate()?;
        fabric.validate()?;
        let mut bw_gbps = fabric.bw_gbps / self.bw_degradation;
        if self.concurrent_flows > 1 {
            let link = fabric
                .link_gbps
                .ok_or(CostModelError::MissingLinkCapacity {
                    flows: self.concurrent_flows,
                })?;
            bw_gbps = bw_gbps.min(link / f64::from(self.concurrent_flows));
        }
        Ok(Fabric {
            probe_us: fabric.probe_us * self.probe_inflation,
            bw_gbps,
            ..*fabric
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::fabric_preset;

    #[test]
    fn no_congestion_leaves_the_fabric_unchanged() {
        let f = fabric_preset("h100-ibgda").unwrap().fabric;
        assert_eq!(Congestion::NONE.apply(&f).unwrap(), f);
    }

    #[test]
    fn flows_share_the_link_and_degradation_divides_bandwidth() {
        let f = fabric_preset("h100-nvlink4").unwrap().fabric; // 21 GB/s dispatch, 125 GB/s link
        let five = Congestion {
            concurrent_flows: 5,
            ..Congestion::NONE
        }
        .apply(&f)
        .unwrap();
        assert_eq!(
            five.bw_gbps, 21.0,
            "a fifth of 125 GB/s still exceeds one block's 21 GB/s"
        );
        let ten = Congestion {
            concurrent_flows: 10,
            ..Congestion::NONE
        }
        .apply(&f)
        .unwrap();
        assert_eq!(ten.bw_gbps, 12.5);
        let slow = Congestion {
            bw_degradation: 125.0,
            probe_inflation: 10.0,
            concurrent_flows: 1,
        };
        let g = slow
            .apply(&fabric_preset("h100-ibgda").unwrap().fabric)
            .unwrap();
        assert_eq!((g.bw_gbps, g.probe_us), (0.2, 160.0));
    }

    #[test]
    fn flows_without_a_link_capacity_or_factors_below_one_are_errors() {
        let f = Fabric::measured(10.0, 10.0).unwrap();
        let flows = Congestion {
            concurrent_flows: 3,
            ..Congestion::NONE
        };
        assert_eq!(
            flows.apply(&f),
            Err(CostModelError::MissingLinkCapacity { flows: 3 })
        );
        assert!(
            Congestion {
                bw_degradation: 0.5,
                ..Congestion::NONE
            }
            .validate()
            .is_err()
        );
        assert!(
            Congestion {
                probe_inflation: f64::NAN,
                ..Congestion::NONE
            }
            .validate()
            .is_err()
        );
        assert!(
            Congestion {
                concurrent_flows: 0,
                ..Congestion::NONE
            }
            .validate()
            .is_err()
        );
    }
}
