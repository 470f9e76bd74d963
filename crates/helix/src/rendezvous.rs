//! How ranks learn each other's [`PeerInfo`] before the first step: in one process, through
//! shared memory; across processes, through a directory every rank can see (each writes
//! `rank-<r>.json` atomically and waits for the others', as a file store does).

use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvroute_transport::file::{Links, create_replacing, read_bounded};

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

/// The most bytes a rank's info file is read to (a few hundred in practice).
const INFO_MAX_BYTES: u64 = 1 << 20;

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

    /// Rank `rank`'s published info file, if there is one: a regular file (a FIFO, device or
    /// symlink planted under its name is an error, never waited on or followed) of at most
    /// [`INFO_MAX_BYTES`].
    fn read_info(&self, rank: usize) -> std::io::Result<Vec<u8>> {
        read_bounded(&self.path(rank), INFO_MAX_BYTES, Links::Refuse)
    }

    /// Whatever rank infos are in the directory now (an operator's or a test's view).
    pub fn published(&self, n: usize) -> Vec<PeerInfo> {
        (0..n)
            .filter_map(|r| self.read_info(r).ok())
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
        create_replacing(&tmp)
            .and_then(|mut f| std::io::Write::write_all(&mut f, &json))
            .map_err(|e| io("writing", e))?;
        std::fs::rename(&tmp, self.path(rank)).map_err(|e| io("publishing", e))?;
        let deadline = Instant::now() + timeout;
        let mut infos: Vec<Option<PeerInfo>> = vec![None; n];
        loop {
            for (r, slot) in infos.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                let bytes = match self.read_info(r) {
                    Ok(b) => b,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(HelixError::Rendezvous(format!(
                            "rank-{r}.json in {}: {e}",
                            self.dir.display()
                        )));
                    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO planted under a rank's info name is an error at once, where reading it would
    /// block until a writer came; a symlink is not followed.
    #[test]
    fn a_planted_fifo_or_link_is_refused_without_waiting() {
        let dir = std::env::temp_dir().join(format!("kvroute-rendezvous-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let r = DirRendezvous::new(&dir);
        let made = std::process::Command::new("mkfifo")
            .arg(r.path(1))
            .status()
            .unwrap();
        assert!(made.success());
        let started = Instant::now();
        let e = r.read_info(1).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(1));
        std::fs::write(dir.join("elsewhere"), b"{}").unwrap();
        std::os::unix::fs::symlink(dir.join("elsewhere"), r.path(2)).unwrap();
        assert!(r.read_info(2).is_err());
        assert!(r.published(3).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
