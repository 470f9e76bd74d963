//! How ranks learn each other's [`PeerInfo`] before the first step: in one process, through
//! shared memory; across processes, through a directory every rank can see (each writes
//! `rank-<r>.json` atomically and waits for the others', as a file store does).

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{HelixError, Result};
use crate::exchange::PeerInfo;

/// A way for `n` ranks to swap their infos.
pub trait Rendezvous: Send + Sync {
    /// Publishes `me` and returns every rank's info, or fails after `timeout`.
    fn exchange(&self, me: PeerInfo, n: usize, timeout: Duration) -> Result<Vec<PeerInfo>>;
}

/// Ranks that are threads of one process.
#[derive(Debug, Clone, Default)]
pub struct LocalRendezvous {
    slots: Arc<(Mutex<Vec<Option<PeerInfo>>>, Condvar)>,
}

impl LocalRendezvous {
    /// An empty meeting point.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Rendezvous for LocalRendezvous {
    fn exchange(&self, me: PeerInfo, n: usize, timeout: Duration) -> Result<Vec<PeerInfo>> {
        let (lock, ready) = &*self.slots;
        let mut slots = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slots.len() < n {
            slots.resize(n, None);
        }
        let rank = me.rank;
        match slots.get_mut(rank) {
            Some(slot @ None) => *slot = Some(me),
            _ => {
                return Err(HelixError::Rendezvous(format!(
                    "rank {rank} is outside 0..{n} or already here"
                )));
            }
        }
        ready.notify_all();
        let deadline = Instant::now() + timeout;
        loop {
            if slots.iter().take(n).all(Option::is_some) {
                return Ok(slots.iter().take(n).flatten().cloned().collect());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HelixError::Rendezvous(format!(
                    "rank {rank}: not every rank arrived within {timeout:?}"
                )));
            }
            slots = ready
                .wait_timeout(slots, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

/// Ranks that are processes sharing a directory (which must be new for each pool).
#[derive(Debug, Clone)]
pub struct DirRendezvous {
    dir: PathBuf,
}

impl DirRendezvous {
    /// Meets in `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    fn path(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}.json"))
    }

    /// Whatever rank infos are in the directory now (an operator's or a test's view).
    pub fn published(&self, n: usize) -> Vec<PeerInfo> {
        (0..n)
            .filter_map(|r| std::fs::read(self.path(r)).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect()
    }
}

impl Rendezvous for DirRendezvous {
    fn exchange(&self, me: PeerInfo, n: usize, timeout: Duration) -> Result<Vec<PeerInfo>> {
        let io = |what: &str, e: std::io::Error| {
            HelixError::Rendezvous(format!("{what} in {}: {e}", self.dir.display()))
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| io("creating the directory", e))?;
        let rank = me.rank;
        if rank >= n {
            return Err(HelixError::Rendezvous(format!(
                "rank {rank} outside 0..{n}"
            )));
        }
        let tmp = self
            .dir
            .join(format!(".rank-{rank}.{}.tmp", std::process::id()));
        let json = serde_json::to_vec(&me).map_err(|e| HelixError::Rendezvous(e.to_string()))?;
        std::fs::write(&tmp, json).map_err(|e| io("writing", e))?;
        std::fs::rename(&tmp, self.path(rank)).map_err(|e| io("publishing", e))?;
        let deadline = Instant::now() + timeout;
        let mut infos: Vec<Option<PeerInfo>> = vec![None; n];
        loop {
            for (r, slot) in infos.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                let Ok(bytes) = std::fs::read(self.path(r)) else {
                    continue;
                };
                let info: PeerInfo = serde_json::from_slice(&bytes).map_err(|e| {
                    HelixError::Rendezvous(format!("rank-{r}.json is not a rank's info: {e}"))
                })?;
                if info.rank != r {
                    return Err(HelixError::Rendezvous(format!(
                        "rank-{r}.json names rank {}",
                        info.rank
                    )));
                }
                *slot = Some(info);
            }
            if infos.iter().all(Option::is_some) {
                return Ok(infos.into_iter().flatten().collect());
            }
            if Instant::now() >= deadline {
                let missing: Vec<usize> = (0..n).filter(|&r| infos[r].is_none()).collect();
                return Err(HelixError::Rendezvous(format!(
                    "rank {rank}: ranks {missing:?} did not publish within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
