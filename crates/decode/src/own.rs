//! The requester's own KV (each request's prompt and generated tokens), kept as an engine
//! keeps it: per layer one pool of fixed-size blocks of B tokens, each request a block table
//! into it. Blocks are handed out as the requests grow, so consecutive blocks of one request
//! are interleaved with the others' and its table is not a run.

use kvroute_kernels::Cache;
use kvroute_kernels::layout::D_QK;

use crate::error::DecodeError;

/// Every layer's pool, every request's block tables.
#[derive(Debug)]
pub struct OwnKv {
    block: usize,
    layers: Vec<LayerPool>,
}

#[derive(Debug)]
struct LayerPool {
    pool: Vec<u16>,
    tables: Vec<Vec<u32>>,
    tokens: Vec<usize>,
}

impl OwnKv {
    /// Empty pools for `layers` layers of `requests` requests, blocks of `block_tokens`.
    pub fn new(layers: usize, requests: usize, block_tokens: usize) -> Result<Self, DecodeError> {
        if block_tokens == 0 {
            return Err(DecodeError::Config(
                "own KV blocks need at least one token".into(),
            ));
        }
        Ok(Self {
            block: block_tokens,
            layers: (0..layers)
                .map(|_| LayerPool {
                    pool: Vec::new(),
                    tables: vec![Vec::new(); requests],
                    tokens: vec![0; requests],
                })
                .collect(),
        })
    }

    /// Appends one cache row (`[576]` bf16) of request `request` at layer `layer`, taking a
    /// new block where its last is full.
    pub fn push(&mut self, layer: usize, request: usize, row: &[u16]) -> Result<(), DecodeError> {
        let block = self.block;
        let l = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| DecodeError::Config(format!("no own KV for layer {layer}")))?;
        if row.len() != D_QK || request >= l.tables.len() {
            return Err(DecodeError::Config(format!(
                "request {request}: a cache row of {} values (576 wanted)",
                row.len()
            )));
        }
        let t = l.tokens[request];
        if t.is_multiple_of(block) {
            let next = l.pool.len() / (block * D_QK);
            l.pool.resize(l.pool.len() + block * D_QK, 0);
            l.tables[request].push(next as u32);
        }
        let b = l.tables[request][t / block] as usize;
        let at = (b * block + t % block) * D_QK;
        l.pool[at..at + D_QK].copy_from_slice(row);
        l.tokens[request] += 1;
        Ok(())
    }

    /// Request `request`'s rows at layer `layer`, read through its block table.
    pub fn cache(&self, layer: usize, request: usize) -> Result<Cache<'_>, DecodeError> {
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| DecodeError::Config(format!("no own KV for layer {layer}")))?;
        let table = l
            .tables
            .get(request)
            .ok_or_else(|| DecodeError::Config(format!("no own KV for request {request}")))?;
        Ok(Cache::paged_blocks(
            &l.pool,
            self.block,
            table,
            l.tokens[request],
        )?)
    }

    /// Tokens request `request` holds (every layer holds as many).
    pub fn tokens(&self, request: usize) -> usize {
        self.layers
            .first()
            .map_or(0, |l| l.tokens.get(request).copied().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows pushed by two requests in turn come back in order through each one's table, and
    /// the tables interleave.
    #[test]
    fn rows_come_back_in_order_through_interleaved_tables() -> Result<(), DecodeError> {
        let mut own = OwnKv::new(2, 2, 3)?;
        for t in 0..7u16 {
            for r in 0..2u16 {
                own.push(1, usize::from(r), &[t * 10 + r; D_QK])?;
            }
        }
        for r in 0..2 {
            let cache = own.cache(1, r)?;
            assert_eq!(cache.tokens(), 7);
            for t in 0..7 {
                assert_eq!(cache.row(t)[0], t as u16 * 10 + r as u16);
            }
        }
        assert_eq!(own.layers[1].tables[0], vec![0, 2, 4]);
        assert_eq!(own.layers[1].tables[1], vec![1, 3, 5]);
        assert!(own.push(1, 2, &[0; D_QK]).is_err());
        assert!(own.push(1, 0, &[0; 5]).is_err());
        Ok(())
    }
}
