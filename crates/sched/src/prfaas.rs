//! The PrfaaS router (paper 001 section 3.4.3): which cluster prefills a request.
//!
//! A pure state machine. It is fed two kinds of events and answers one question:
//!
//! - [`PrfaasRouter::route`]: a request arrives with its total length and the prefix each
//!   cluster holds; the router says which cluster prefills it, how many tokens that is, and
//!   whether a cached prefix must first cross between the clusters;
//! - [`PrfaasRouter::on_sample`]: the short-timescale feedback, a sample of PrfaaS egress
//!   utilisation and of the wait a new request would see at each prefill stage.
//!
//! Routing follows the paper's rule. Let `l_total` be the input length and `l_pd`, `l_prfaas`
//! the cached prefixes in the PD and PrfaaS clusters. When egress bandwidth is scarce the
//! caches are judged separately: `l_total - l_pd <= t` prefills in PD-P, anything longer goes
//! to PrfaaS (which then computes `l_total - l_prfaas`). When bandwidth is abundant the best
//! cache counts: `l_prefix = max(l_pd, l_prfaas)`, `l_total - l_prefix <= t` goes to PD-P,
//! and the prefix crosses clusters when the longer cache is on the other side.
//!
//! The threshold `t` comes from the long-timescale optimisation (eqs. 7 and 8, solved by
//! [`kvroute_costmodel::prfaas::PrfaasPlanner::search`]). With adaptation on, the router also
//! moves `t` between samples: up (offload fewer, longer requests) when the egress is near its
//! ceiling or the PrfaaS queue is longer than PD-P's, down when PD-P's is the longer one; the
//! paper describes this trigger ("when utilization approaches a threshold or queuing surges")
//! without giving a rule, so the rule here is a multiplicative step bounded to a range.

use serde::{Deserialize, Serialize};

use crate::error::{Result, SchedError, positive, within};

/// A cluster role that prefills.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cluster {
    /// The prefill nodes of the local PD cluster (PD-P).
    Pd,
    /// The remote PrfaaS prefill cluster.
    Prfaas,
}

/// Threshold adaptation from load samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Adaptation {
    /// Multiplicative step per sample (0.05: 5%).
    pub step: f64,
    /// Lowest threshold, tokens.
    pub min_tokens: f64,
    /// Highest threshold, tokens.
    pub max_tokens: f64,
    /// Egress utilisation at or above which `t` goes up whatever the queues say.
    pub high_utilization: f64,
    /// Wait difference between the stages that triggers a step, seconds.
    pub wait_margin_s: f64,
}

/// What the router is configured with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RouterConfig {
    /// Routing threshold `t`, tokens of incremental prefill.
    pub threshold_tokens: f64,
    /// Egress utilisation at or above which bandwidth counts as scarce.
    pub scarce_utilization: f64,
    /// Whether the PD cluster has prefill instances (a naive heterogeneous deployment has none).
    pub pd_prefill: bool,
    /// Whether a PrfaaS cluster exists (a homogeneous PD deployment has none).
    pub prfaas: bool,
    /// Threshold adaptation, if any.
    pub adapt: Option<Adaptation>,
}

impl RouterConfig {
    /// A fixed threshold `t` with both prefill stages present.
    pub fn fixed(threshold_tokens: f64) -> Self {
        Self {
            threshold_tokens,
            scarce_utilization: 0.8,
            pd_prefill: true,
            prfaas: true,
            adapt: None,
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.threshold_tokens.is_nan() || self.threshold_tokens < 0.0 {
            return Err(SchedError::OutOfRange {
                name: "threshold_tokens",
                value: self.threshold_tokens,
                range: "[0, inf]",
            });
        }
        within(
            "scarce_utilization",
            self.scarce_utilization,
            0.0,
            1.0,
            "[0, 1]",
        )?;
        if !self.pd_prefill && !self.prfaas {
            return Err(SchedError::Zero {
                name: "prefill stages",
                value: 0,
            });
        }
        if let Some(a) = self.adapt {
            positive("adapt.step", a.step)?;
            positive("adapt.min_tokens", a.min_tokens)?;
            positive("adapt.max_tokens", a.max_tokens)?;
            within(
                "adapt.high_utilization",
                a.high_utilization,
                0.0,
                1.0,
                "[0, 1]",
            )?;
            if a.wait_margin_s.is_nan() || a.wait_margin_s < 0.0 || a.min_tokens > a.max_tokens {
                return Err(SchedError::OutOfRange {
                    name: "adapt.wait_margin_s",
                    value: a.wait_margin_s,
                    range: "[0, inf) with min_tokens <= max_tokens",
                });
            }
        }
        Ok(())
    }
}

/// One request as the router sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteQuery {
    /// `l_total`: input tokens.
    pub total_tokens: u64,
    /// `l_pd`: tokens of the longest prefix cached in the PD cluster.
    pub cached_pd: u64,
    /// `l_prfaas`: tokens of the longest prefix cached in the PrfaaS cluster.
    pub cached_prfaas: u64,
}

/// The router's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Route {
    /// Who prefills.
    pub cluster: Cluster,
    /// Tokens it computes.
    pub prefill_tokens: u64,
    /// Cached tokens that must first cross from the other cluster (0: none).
    pub transfer_tokens: u64,
}

/// A load sample, the short-timescale input.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LoadSample {
    /// PrfaaS egress utilisation over the last window, 0 to 1.
    pub egress_utilization: f64,
    /// Wait a request arriving now would see before PrfaaS prefill starts, seconds.
    pub prfaas_wait_s: f64,
    /// The same at PD-P.
    pub pd_wait_s: f64,
}

/// The router.
#[derive(Debug, Clone)]
pub struct PrfaasRouter {
    config: RouterConfig,
    threshold: f64,
    scarce: bool,
    routed: [u64; 2],
}

impl PrfaasRouter {
    /// A router; bandwidth starts out abundant.
    pub fn new(config: RouterConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            threshold: config.threshold_tokens,
            scarce: false,
            routed: [0; 2],
        })
    }

    /// The threshold in force.
    pub fn threshold_tokens(&self) -> f64 {
        self.threshold
    }

    /// Whether the last sample found bandwidth scarce.
    pub fn bandwidth_scarce(&self) -> bool {
        self.scarce
    }

    /// Requests routed to PD-P and to PrfaaS so far.
    pub fn routed(&self) -> (u64, u64) {
        (self.routed[0], self.routed[1])
    }

    /// Routes one request. Cached lengths above the total are taken as the total.
    pub fn route(&mut self, q: RouteQuery) -> Route {
        let total = q.total_tokens;
        let (pd, prfaas) = (q.cached_pd.min(total), q.cached_prfaas.min(total));
        let to_pd = |prefill: u64, transfer: u64| Route {
            cluster: Cluster::Pd,
            prefill_tokens: prefill,
            transfer_tokens: transfer,
        };
        let to_prfaas = |prefill: u64, transfer: u64| Route {
            cluster: Cluster::Prfaas,
            prefill_tokens: prefill,
            transfer_tokens: transfer,
        };
        let route = if !self.config.prfaas {
            to_pd(total - pd, 0)
        } else if !self.config.pd_prefill {
            // Everything is prefilled remotely; a longer PD prefix crosses if bandwidth allows.
            if !self.scarce && pd > prfaas {
                to_prfaas(total - pd, pd - prfaas)
            } else {
                to_prfaas(total - prfaas, 0)
            }
        } else if self.scarce {
            if (total - pd) as f64 <= self.threshold {
                to_pd(total - pd, 0)
            } else {
                to_prfaas(total - prfaas, 0)
            }
        } else {
            let best = pd.max(prfaas);
            if (total - best) as f64 <= self.threshold {
                to_pd(total - best, best - pd)
            } else {
                to_prfaas(total - best, best - prfaas)
            }
        };
        self.routed[match route.cluster {
            Cluster::Pd => 0,
            Cluster::Prfaas => 1,
        }] += 1;
        route
    }

    /// Feeds a load sample. Non-finite fields are ignored (a broken probe changes nothing).
    pub fn on_sample(&mut self, s: LoadSample) {
        if !(s.egress_utilization.is_finite()
            && s.prfaas_wait_s.is_finite()
            && s.pd_wait_s.is_finite())
        {
            return;
        }
        self.scarce = s.egress_utilization >= self.config.scarce_utilization;
        let Some(a) = self.config.adapt else { return };
        if !(self.config.prfaas && self.config.pd_prefill) {
            return;
        }
        if s.egress_utilization >= a.high_utilization
            || s.prfaas_wait_s > s.pd_wait_s + a.wait_margin_s
        {
            self.threshold *= 1.0 + a.step;
        } else if s.pd_wait_s > s.prfaas_wait_s + a.wait_margin_s {
            self.threshold /= 1.0 + a.step;
        }
        self.threshold = self.threshold.clamp(a.min_tokens, a.max_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(r: Route) -> (Cluster, u64, u64) {
        (r.cluster, r.prefill_tokens, r.transfer_tokens)
    }

    fn q(total: u64, pd: u64, prfaas: u64) -> RouteQuery {
        RouteQuery {
            total_tokens: total,
            cached_pd: pd,
            cached_prfaas: prfaas,
        }
    }

    #[test]
    fn length_threshold_without_caches() {
        let mut r = PrfaasRouter::new(RouterConfig::fixed(19_400.0)).unwrap();
        assert_eq!(r.route(q(19_400, 0, 0)).cluster, Cluster::Pd);
        let long = r.route(q(19_401, 0, 0));
        assert_eq!(parts(long), (Cluster::Prfaas, 19_401, 0));
        assert_eq!(r.routed(), (1, 1));
    }

    /// Abundant bandwidth: the best cache anywhere decides, and crosses when it is remote.
    #[test]
    fn abundant_bandwidth_uses_the_best_cache_and_moves_it() {
        let mut r = PrfaasRouter::new(RouterConfig::fixed(10_000.0)).unwrap();
        // 50K total, PrfaaS holds 45K: 5K left <= t, so PD-P prefills 5K after 45K - 10K
        // cross from PrfaaS.
        let a = r.route(q(50_000, 10_000, 45_000));
        assert_eq!(parts(a), (Cluster::Pd, 5_000, 35_000));
        // 50K total, PD holds 20K: 30K > t, PrfaaS prefills 30K after the 20K PD prefix
        // crosses.
        let b = r.route(q(50_000, 20_000, 0));
        assert_eq!(parts(b), (Cluster::Prfaas, 30_000, 20_000));
    }

    /// Scarce bandwidth: each cache on its own, nothing crosses.
    #[test]
    fn scarce_bandwidth_judges_each_cache_alone() {
        let mut r = PrfaasRouter::new(RouterConfig::fixed(10_000.0)).unwrap();
        r.on_sample(LoadSample {
            egress_utilization: 0.95,
            prfaas_wait_s: 0.0,
            pd_wait_s: 0.0,
        });
        assert!(r.bandwidth_scarce());
        let a = r.route(q(50_000, 10_000, 45_000));
        assert_eq!(parts(a), (Cluster::Prfaas, 5_000, 0));
        let b = r.route(q(50_000, 42_000, 0));
        assert_eq!(parts(b), (Cluster::Pd, 8_000, 0));
        r.on_sample(LoadSample {
            egress_utilization: 0.1,
            prfaas_wait_s: 0.0,
            pd_wait_s: 0.0,
        });
        assert!(!r.bandwidth_scarce());
    }

    #[test]
    fn deployments_missing_a_stage_never_route_to_it() {
        let mut homogeneous = PrfaasRouter::new(RouterConfig {
            prfaas: false,
            ..RouterConfig::fixed(0.0)
        })
        .unwrap();
        assert_eq!(homogeneous.route(q(100_000, 0, 0)).cluster, Cluster::Pd);
        let mut naive = PrfaasRouter::new(RouterConfig {
            pd_prefill: false,
            ..RouterConfig::fixed(f64::INFINITY)
        })
        .unwrap();
        let r = naive.route(q(100, 100, 0));
        assert_eq!(parts(r), (Cluster::Prfaas, 0, 100));
        assert!(
            PrfaasRouter::new(RouterConfig {
                pd_prefill: false,
                prfaas: false,
                ..RouterConfig::fixed(1.0)
            })
            .is_err()
        );
    }

    #[test]
    fn adaptation_moves_the_threshold_within_its_bounds() {
        let adapt = Adaptation {
            step: 0.1,
            min_tokens: 1_000.0,
            max_tokens: 12_000.0,
            high_utilization: 0.9,
            wait_margin_s: 0.5,
        };
        let mut r = PrfaasRouter::new(RouterConfig {
            adapt: Some(adapt),
            ..RouterConfig::fixed(10_000.0)
        })
        .unwrap();
        // PrfaaS queue longer: offload less.
        r.on_sample(LoadSample {
            egress_utilization: 0.2,
            prfaas_wait_s: 3.0,
            pd_wait_s: 1.0,
        });
        assert!((r.threshold_tokens() - 11_000.0).abs() < 1e-6);
        // Saturated egress: up again, capped at the maximum.
        r.on_sample(LoadSample {
            egress_utilization: 0.95,
            prfaas_wait_s: 0.0,
            pd_wait_s: 0.0,
        });
        assert_eq!(r.threshold_tokens(), 12_000.0);
        // PD-P queue longer: offload more.
        r.on_sample(LoadSample {
            egress_utilization: 0.2,
            prfaas_wait_s: 0.0,
            pd_wait_s: 2.0,
        });
        assert!((r.threshold_tokens() - 12_000.0 / 1.1).abs() < 1e-6);
        // Within the margin: unchanged. A NaN sample: ignored.
        let t = r.threshold_tokens();
        r.on_sample(LoadSample {
            egress_utilization: 0.2,
            prfaas_wait_s: 1.0,
            pd_wait_s: 1.2,
        });
        r.on_sample(LoadSample {
            egress_utilization: f64::NAN,
            prfaas_wait_s: 9.0,
            pd_wait_s: 0.0,
        });
        assert_eq!(r.threshold_tokens(), t);
    }

    #[test]
    fn bad_configurations_are_typed_errors() {
        assert!(PrfaasRouter::new(RouterConfig::fixed(f64::NAN)).is_err());
        assert!(PrfaasRouter::new(RouterConfig::fixed(-1.0)).is_err());
        assert!(
            PrfaasRouter::new(RouterConfig {
                scarce_utilization: 1.5,
                ..RouterConfig::fixed(1.0)
            })
            .is_err()
        );
        let bad = Adaptation {
            step: 0.1,
            min_tokens: 10.0,
            max_tokens: 1.0,
            high_utilization: 0.9,
            wait_margin_s: 0.0,
        };
        assert!(
            PrfaasRouter::new(RouterConfig {
                adapt: Some(bad),
                ..RouterConfig::fixed(1.0)
            })
            .is_err()
        );
    }
}
