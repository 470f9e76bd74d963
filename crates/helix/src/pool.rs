//! Ranks as threads of this process, each on an engine of its own: what the `mem` domain runs
//! and what tests drive.

use kvroute_transport::TransferEngine;

use crate::error::{HelixError, Result};
use crate::rank::{HelixConfig, HelixRank, StepReport};
use crate::rendezvous::LocalRendezvous;

/// Runs `config`'s ranks on `engines` (one per rank, in rank order) for one step per entry of
/// `hopb` (whether that step overlaps with HOP-B); returns each rank's reports, or its error.
pub fn run_threads(
    config: HelixConfig,
    engines: Vec<TransferEngine>,
    hopb: &[bool],
) -> Vec<Result<Vec<StepReport>>> {
    if engines.len() != config.layout.ranks() {
        let why = format!(
            "{} engines for {} ranks",
            engines.len(),
            config.layout.ranks()
        );
        return vec![Err(HelixError::Config(why))];
    }
    let rendezvous = LocalRendezvous::new();
    std::thread::scope(|scope| {
        let handles: Vec<_> = engines
            .into_iter()
            .enumerate()
            .map(|(rank, engine)| {
                let rendezvous = rendezvous.clone();
                std::thread::Builder::new()
                    .name(format!("helix-rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        let mut r = HelixRank::start(config, rank, engine, &rendezvous)?;
                        hopb.iter().map(|&on| r.step(on)).collect()
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(HelixError::Config("a rank's thread panicked".to_owned()))
                }),
                Err(e) => Err(HelixError::Config(format!("spawning a rank: {e}"))),
            })
            .collect()
    })
}
