//! The single-instance reference: every request's whole context local (the chunks prefilled
//! here at their canonical positions and spliced to the request's, then its own rows),
//! attended in one call per layer with the CPU kernels. What the same generation gives with
//! nothing on the wire.

use std::collections::BTreeMap;

use kvroute_kernels::layout::D_QK;
use kvroute_kernels::rope::rotate_row_f64;
use kvroute_kvstore::ChunkId;
use kvroute_model::Model;

use crate::context::RequestPlan;
use crate::error::DecodeError;
use crate::held::PrefilledChunk;

/// Per request, per layer, the rows of its whole context so far.
#[derive(Debug)]
pub struct Reference {
    rows: Vec<Vec<Vec<u16>>>,
}

impl Reference {
    /// The requests' contexts from the prefilled `chunks` (each at its canonical positions),
    /// spliced to where `plans` place them.
    pub fn new(
        model: &Model,
        chunks: &[PrefilledChunk],
        plans: &[RequestPlan],
    ) -> Result<Self, DecodeError> {
        let by_id: BTreeMap<ChunkId, &PrefilledChunk> = chunks.iter().map(|c| (c.id, c)).collect();
        let layers = model.config().num_hidden_layers;
        let rope = *model.rope();
        let mut rows = Vec::with_capacity(plans.len());
        for plan in plans {
            let mut per_layer = vec![Vec::new(); layers];
            for &(id, start) in &plan.chunks {
                let PrefilledChunk {
                    layers: kv,
                    positions,
                    ..
                } = by_id.get(&id).ok_or_else(|| {
                    DecodeError::Config(format!("{id} was not prefilled for the reference"))
                })?;
                let delta = start - positions.first().copied().unwrap_or(0);
                let angles = rope.angles(delta);
                for (l, layer_rows) in per_layer.iter_mut().enumerate() {
                    let from = kv
                        .get(l)
                        .ok_or_else(|| DecodeError::Config(format!("{id} has no layer {l}")))?;
                    let at = layer_rows.len();
                    layer_rows.extend_from_slice(from);
                    if delta != 0 {
                        for row in layer_rows[at..].chunks_exact_mut(D_QK) {
                            rotate_row_f64(row, &angles, rope.layout());
                        }
                    }
                }
            }
            rows.push(per_layer);
        }
        Ok(Self { rows })
    }

    /// Appends request `r`'s own cache row at `layer` and attends its whole context with
    /// `queries`: the `[heads, 512]` outputs.
    pub fn attend(
        &mut self,
        model: &Model,
        (r, layer): (usize, usize),
        kv: &[u16],
        queries: &[u16],
    ) -> Result<Vec<f32>, DecodeError> {
        let rows = self
            .rows
            .get_mut(r)
            .and_then(|l| l.get_mut(layer))
            .ok_or_else(|| DecodeError::Config(format!("no reference for request {r}")))?;
        rows.extend_from_slice(kv);
        Ok(model.attend(queries, rows)?)
    }
}
