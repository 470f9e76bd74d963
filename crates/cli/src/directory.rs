//! `kvroute directory list`: what a cluster directory holds, validated as a requester reads
//! it.

use std::fmt;
use std::time::Duration;

use anyhow::Result;
use kvroute_kvstore::directory::{self, DirectoryView};
use serde::Serialize;

use crate::args::DirectoryListArgs;

/// What `directory list` shows.
#[derive(Debug, Serialize)]
pub struct Listing {
    /// Where the directory is.
    pub directory: String,
    /// The validated view: holders (with lease time left) and the entries skipped.
    #[serde(flatten)]
    pub view: DirectoryView,
    /// Per chunk: its holders' ids, in the order they are offered.
    pub chunks: Vec<(u32, Vec<String>)>,
}

impl fmt::Display for Listing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} holders, {} chunks",
            self.directory,
            self.view.holders.len(),
            self.chunks.len()
        )?;
        for (id, h) in &self.view.holders {
            let ttl = h.ttl_left_ms.map_or_else(
                || "no lease".to_owned(),
                |ms| format!("lease {} s left", ms / 1000),
            );
            let chunks: Vec<String> = h
                .chunks
                .iter()
                .map(|(c, r)| format!("{} (replica {r})", c.0))
                .collect();
            writeln!(f, "  holder {id}: {ttl}; chunks {}", chunks.join(", "))?;
        }
        for (c, holders) in &self.chunks {
            writeln!(f, "  chunk {c}: {}", holders.join(", "))?;
        }
        for s in &self.view.skipped {
            writeln!(f, "  skipped: {s}")?;
        }
        Ok(())
    }
}

/// `kvroute directory list`.
pub(crate) fn list(args: &DirectoryListArgs) -> Result<Listing> {
    // The TTL is for registrations, which listing makes none of.
    let dir = directory::open(&args.directory, Duration::from_secs(5))?;
    let view = dir.view()?;
    let chunks = view
        .registry
        .ids()
        .map(|c| {
            let holders = view
                .registry
                .holders(c)
                .map(|entries| {
                    entries
                        .iter()
                        .filter_map(|e| view.holder_by_engine(&e.holder))
                        .map(|h| h.record.id.clone())
                        .collect()
                })
                .unwrap_or_default();
            (c.0, holders)
        })
        .collect();
    Ok(Listing {
        directory: dir.describe(),
        view,
        chunks,
    })
}
