//! The route / fetch / local predicate of paper 000 ("Move the Query, Not the Cache"),
//! section 5.1: evaluate the three costs of section 4 and take the minimum, per (chunk,
//! request). The answer carries every cost and a reason a log line can print.

use serde::{Deserialize, Serialize};

use crate::cost::{CostBreakdown, CostModel, Term};
use crate::error::Result;
use crate::request::{Primitive, Request};

/// One primitive's priced option.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrimitiveCost {
    /// Which primitive.
    pub primitive: Primitive,
    /// Whether the request allowed it.
    pub allowed: bool,
    /// Its whole cost, microseconds.
    pub total_us: f64,
    /// Term by term.
    pub breakdown: CostBreakdown,
}

impl PrimitiveCost {
    fn new(primitive: Primitive, allowed: bool, breakdown: CostBreakdown) -> Self {
        Self {
            primitive,
            allowed,
            total_us: breakdown.total_us(),
            breakdown,
        }
    }
}

/// Why the choice won, in the terms a scheduler log wants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reason {
    /// The term the chosen primitive spends most in.
    pub chosen_bound_by: Term,
    /// The cheapest allowed alternative, if any was allowed.
    pub runner_up: Option<Primitive>,
    /// The term the runner-up spends most in.
    pub runner_up_bound_by: Option<Term>,
    /// How much the runner-up would cost on top, microseconds (0 with no runner-up).
    pub margin_us: f64,
    /// Runner-up cost over chosen cost (1 with no runner-up).
    pub speedup: f64,
}

/// The predicate's answer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The cheapest allowed primitive.
    pub choice: Primitive,
    /// Route's priced option.
    pub route: PrimitiveCost,
    /// Fetch's priced option.
    pub fetch: PrimitiveCost,
    /// Local's priced option.
    pub local: PrimitiveCost,
    /// Why.
    pub reason: Reason,
}

impl Decision {
    /// The priced option of `primitive`.
    pub const fn cost(&self, primitive: Primitive) -> &PrimitiveCost {
        match primitive {
            Primitive::Route => &self.route,
            Primitive::Fetch => &self.fetch,
            Primitive::Local => &self.local,
        }
    }

    /// The chosen option.
    pub const fn chosen(&self) -> &PrimitiveCost {
        self.cost(self.choice)
    }
}

impl std::fmt::Display for Decision {
    /// One line: `route (87.4 us, merge-bound) beats fetch (5.447 ms, splice-bound) by 62.3x`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chosen = self.chosen();
        write!(
            f,
            "{} ({}, {}-bound)",
            self.choice,
            Micros(chosen.total_us),
            self.reason.chosen_bound_by
        )?;
        match (self.reason.runner_up, self.reason.runner_up_bound_by) {
            (Some(runner_up), Some(bound)) => write!(
                f,
                " beats {runner_up} ({}, {bound}-bound) by {:.1}x",
                Micros(self.cost(runner_up).total_us),
                self.reason.speedup
            ),
            _ => f.write_str(", the only allowed primitive"),
        }
    }
}

/// Formats microseconds with a unit that keeps three significant figures readable.
#[derive(Debug, Clone, Copy)]
pub struct Micros(pub f64);

impl std::fmt::Display for Micros {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = self.0;
        if us >= 1e6 {
            write!(f, "{:.3} s", us / 1e6)
        } else if us >= 1e3 {
            write!(f, "{:.3} ms", us / 1e3)
        } else {
            write!(f, "{us:.1} us")
        }
    }
}

impl CostModel {
    /// Prices all three primitives and picks the cheapest allowed one. Ties go to the earlier
    /// of route, fetch, local. Allocation-free.
    pub fn decide(&self, request: &Request) -> Result<Decision> {
        request.validate()?;
        let allowed = request.allowed;
        let route = PrimitiveCost::new(
            Primitive::Route,
            allowed.route,
            self.route_unchecked(request),
        );
        let fetch = PrimitiveCost::new(
            Primitive::Fetch,
            allowed.fetch,
            self.fetch_unchecked(request),
        );
        let local = PrimitiveCost::new(
            Primitive::Local,
            allowed.local,
            self.local_unchecked(request),
        );

        for (name, cost) in [("route", &route), ("fetch", &fetch), ("local", &local)] {
            if !cost.total_us.is_finite() {
                return Err(crate::error::CostModelError::NonFiniteCost {
                    primitive: name,
                    value: cost.total_us,
                });
            }
        }
        let mut best: Option<&PrimitiveCost> = None;
        let mut second: Option<&PrimitiveCost> = None;
        for option in [&route, &fetch, &local].into_iter().filter(|o| o.allowed) {
            match best {
                Some(b) if option.total_us >= b.total_us => {
                    if second.is_none_or(|s| option.total_us < s.total_us) {
                        second = Some(option);
                    }
                }
                _ => {
                    second = best;
                    best = Some(option);
                }
            }
        }
        // `validate` guarantees at least one primitive is allowed.
        let best = best.ok_or(crate::error::CostModelError::NoPrimitiveAllowed)?;
        let reason = Reason {
            chosen_bound_by: best.breakdown.dominant(),
            runner_up: second.map(|s| s.primitive),
            runner_up_bound_by: second.map(|s| s.breakdown.dominant()),
            margin_us: second.map_or(0.0, |s| s.total_us - best.total_us),
            speedup: second.map_or(1.0, |s| s.total_us / best.total_us),
        };
        Ok(Decision {
            choice: best.primitive,
            route,
            fetch,
            local,
            reason,
        })
    }
}
