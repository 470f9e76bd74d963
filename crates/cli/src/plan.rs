//! `kvroute plan prfaas` and `kvroute plan helix`.

use std::fmt;

use anyhow::{Context, Result};
use kvroute_costmodel::helix::{HelixLayout, HelixRoofline, HopB, HopBTimeline};
use kvroute_costmodel::prfaas::{
    H20_OVER_H200_PREFILL, LengthProfile, OperatingPoint, PrfaasCluster, PrfaasPlanner,
    TruncatedLogNormal,
};
use serde::Serialize;

use crate::args::{HelixArgs, PrfaasArgs};
use crate::units::Micros;

/// What `plan prfaas` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PrfaasReport {
    /// The model the plan was computed with.
    pub planner: PrfaasPlanner,
    /// Threshold grid points searched; `None` when one point was evaluated.
    pub grid: Option<u32>,
    /// The best (or the evaluated) configuration.
    pub point: OperatingPoint,
}

pub(crate) fn prfaas(args: &PrfaasArgs) -> Result<PrfaasReport> {
    let prfaas_profile = match &args.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<LengthProfile>(&text)
                .with_context(|| format!("{} is not a valid length profile", path.display()))?
        }
        None => LengthProfile::paper_001_table_5(),
    };
    let pd_profile = prfaas_profile
        .with_prefill_scaled(args.pd_prefill_slowdown.unwrap_or(H20_OVER_H200_PREFILL))?;
    if !(args.decode_tps.is_finite() && args.decode_tps > 0.0) {
        anyhow::bail!(
            "--decode-tps = {} is invalid: it must be finite and > 0",
            args.decode_tps
        );
    }
    let decode_step_s = 1.0 / args.decode_tps;
    let planner = PrfaasPlanner {
        prfaas_profile,
        pd_profile,
        cluster: PrfaasCluster {
            prfaas_instances: args.n_prfaas,
            pd_instances: args.n_pd,
            egress_gbps: args.egress_gbps,
            max_decode_batch: args.bs_max,
            decode_step_s,
            output_tokens: args.output_tokens,
        },
        lengths: TruncatedLogNormal::new(args.mu, args.sigma, args.min_tokens, args.max_tokens)?,
    };
    let (grid, point) = match (args.threshold, args.np) {
        (Some(t), Some(np)) => (None, planner.evaluate(t, np)?),
        _ => (Some(args.grid), planner.search(args.grid)?),
    };
    Ok(PrfaasReport {
        planner,
        grid,
        point,
    })
}

fn opt(value: Option<f64>, unit: &str) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}{unit}"))
}

impl fmt::Display for PrfaasReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.point;
        let c = &self.planner.cluster;
        let how = self.grid.map_or_else(
            || "evaluated".to_owned(),
            |g| format!("best of {g} thresholds x splits"),
        );
        writeln!(
            f,
            "PrfaaS-PD ({how}): {} PrfaaS + {} PD instances, {} Gbps egress",
            c.prfaas_instances, c.pd_instances, c.egress_gbps
        )?;
        writeln!(
            f,
            "  threshold t = {:.0} tokens -> {:.1}% of requests to PrfaaS (l_long {}, l_short {} tokens)",
            p.threshold_tokens,
            100.0 * p.p_prfaas,
            opt(p.l_long, ""),
            opt(p.l_short, "")
        )?;
        writeln!(f, "  Np / Nd = {} / {}", p.np, p.nd)?;
        writeln!(
            f,
            "  Theta prfaas / pd-p / pd-d = {} / {} / {:.2} req/s",
            opt(p.theta_prfaas, ""),
            opt(p.theta_pd_p, ""),
            p.theta_pd_d
        )?;
        writeln!(
            f,
            "  Lambda_max = {:.3} req/s, limited by {:?}",
            p.lambda_max, p.bottleneck
        )?;
        writeln!(
            f,
            "  PrfaaS egress at Lambda_max: {:.1} Gbps of {}",
            p.egress_gbps, c.egress_gbps
        )
    }
}

/// What `plan helix` prints.
#[derive(Debug, Clone, Serialize)]
pub struct HelixReport {
    /// The configuration.
    pub layout: HelixLayout,
    /// Its per-layer read times.
    pub roofline: HelixRoofline,
    /// Both reads together, microseconds.
    pub total_us: f64,
    /// The HOP-B timeline, if asked for.
    pub hopb: Option<HopBTimeline>,
}

pub(crate) fn helix(args: &HelixArgs) -> Result<HelixReport> {
    let layout = HelixLayout {
        batch: args.batch,
        q_heads: args.q_heads,
        kv_heads: args.kv_heads,
        head_size: args.head_size,
        seq_len: args.seq_len,
        ffn_dim: args.ffn_dim,
        tpa: args.tpa,
        tpf: args.tpf,
        kvp: args.kvp,
        bytes_per_param: args.bytes_per_param,
        mem_bw_gbps: args.mem_bw_gbps,
    };
    let roofline = layout.roofline()?;
    let hopb = match (args.hopb_requests, args.hopb_attention, args.hopb_comm) {
        (Some(requests), Some(attention_per_request), Some(comm_per_request)) => Some(
            HopB {
                requests,
                attention_per_request,
                comm_per_request,
            }
            .timeline()?,
        ),
        _ => None,
    };
    Ok(HelixReport {
        layout,
        roofline,
        total_us: roofline.total_us(),
        hopb,
    })
}

impl fmt::Display for HelixReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.layout;
        writeln!(
            f,
            "Helix layer: B={} Q={} K={} Hsz={} S={} F={} | KVP={} x TPA={} ({} GPUs), TPF={}",
            l.batch,
            l.q_heads,
            l.kv_heads,
            l.head_size,
            l.seq_len,
            l.ffn_dim,
            l.kvp,
            l.tpa,
            self.roofline.gpus,
            l.tpf
        )?;
        writeln!(
            f,
            "  KV read {} + weight read {} = {} per layer at {} GB/s",
            Micros(self.roofline.kv_read_us),
            Micros(self.roofline.weight_read_us),
            Micros(self.total_us),
            l.mem_bw_gbps
        )?;
        if let Some(t) = &self.hopb {
            writeln!(
                f,
                "  HOP-B: span {:.2} -> {:.2} (exposed communication {:.2} -> {:.2})",
                t.span_without, t.span_with, t.exposed_comm_without, t.exposed_comm_with
            )?;
        }
        Ok(())
    }
}
