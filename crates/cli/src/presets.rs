//! `kvroute presets`: the models and fabrics the other commands know by name.

use std::fmt;

use kvroute_costmodel::{FABRIC_PRESETS, FabricPreset, MODEL_PRESETS, ModelPreset};
use serde::Serialize;

/// Both preset tables.
#[derive(Debug, Clone, Serialize)]
pub struct PresetsReport {
    /// Model presets.
    pub models: &'static [ModelPreset],
    /// Fabric presets.
    pub fabrics: &'static [FabricPreset],
}

pub(crate) fn run() -> PresetsReport {
    PresetsReport {
        models: MODEL_PRESETS,
        fabrics: FABRIC_PRESETS,
    }
}

impl fmt::Display for PresetsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "models (q + p B/row, b_KV B/token/layer):")?;
        for m in self.models {
            let d = &m.dims;
            let topk = d
                .topk
                .map_or_else(|| "dense".to_owned(), |k| format!("top-{k}"));
            writeln!(
                f,
                "  {:<18} L={:<3} h_q={:<4} d_qk={} d_v={} q+p={} b_KV={} {topk}",
                m.id,
                d.layers,
                d.query_heads,
                d.d_qk,
                d.d_v,
                d.routed_row_bytes(),
                d.kv_bytes_per_token_layer()
            )?;
            writeln!(f, "      {}", m.source)?;
        }
        writeln!(f, "fabrics (paper 000 table 2; link peaks from figure 6a):")?;
        for p in self.fabrics {
            let fb = &p.fabric;
            writeln!(
                f,
                "  {:<19} probe {:>4} us, BW {:>2} GB/s, turnaround {} us, link {} GB/s; MAPE {}% / {}%  {}",
                p.id,
                fb.probe_us,
                fb.bw_gbps,
                fb.turnaround_us,
                fb.link_gbps
                    .map_or_else(|| "-".to_owned(), |l| l.to_string()),
                p.published_mape.amortised_pct,
                p.published_mape.full_pct,
                p.description
            )?;
        }
        Ok(())
    }
}
