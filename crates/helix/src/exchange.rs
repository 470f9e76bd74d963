//! The exchange rounds Helix's collectives are made of, over the transfer engine's one-sided
//! writes with immediates (paper 002's primitives; no sockets, no two-sided messages).
//!
//! Each rank registers one send region (local access only) and one receive region (writable by
//! peers). A decode step is a fixed list of rounds (its [`StepPlan`]); round `i` of a step has
//! an area in each region with one slot per rank: the sender stages its part for rank `d` in
//! slot `d` of its send area and writes it to slot `me` of `d`'s receive area, with the
//! immediate `(round, me)`, so the receiver counts each source's part on its own and can name
//! the ranks that never delivered. Areas alternate between two halves by step parity: a peer
//! can be writing step `s + 1` only once this rank posted its last round of step `s`, by which
//! time it has read everything of step `s - 1`, the half the peer writes into.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};
use kvroute_transport::{
    Access, MrDesc, NetAddr, OnDone, RegisteredBuffer, TransferEngine, TransferShape,
};
use serde::{Deserialize, Serialize};

use crate::error::{HelixError, Result};
use crate::layout::MAX_RANKS;
use crate::tracker::{Event, ROUND_MODULUS, Tracker, imm};

/// What peers need to reach a rank: its engine and its receive region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// The rank.
    pub rank: usize,
    /// Its engine's address.
    pub addr: NetAddr,
    /// Its receive region.
    pub recv: MrDesc,
    /// Its process id (for an operator, and for tests that kill it).
    pub pid: u32,
}

/// The rounds of one step: the largest part (bytes) one rank sends another in each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    slots: Vec<usize>,
}

impl StepPlan {
    /// Rounds whose parts are at most `slots[i]` bytes.
    pub fn new(slots: Vec<usize>) -> Result<Self> {
        if slots.is_empty() || slots.contains(&0) {
            return Err(HelixError::Config(
                "a step needs rounds, each with a non-empty part".to_owned(),
            ));
        }
        Ok(Self { slots })
    }

    /// Rounds per step.
    pub fn rounds(&self) -> usize {
        self.slots.len()
    }
}

/// One rank's side of the exchange.
#[derive(Debug)]
pub struct Exchange {
    engine: TransferEngine,
    rank: usize,
    ranks: usize,
    plan: StepPlan,
    /// Offset of each round's area within a half.
    areas: Vec<usize>,
    half: usize,
    send: RegisteredBuffer,
    recv: RegisteredBuffer,
    peers: Vec<PeerInfo>,
    tracker: Tracker,
    events: (Sender<Event>, Receiver<Event>),
    timeout: Duration,
    bytes_sent: u64,
}

/// A round that was posted: its number, and where its parts land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    /// The round's number (the same on every rank).
    pub round: u32,
    area: usize,
    slot: usize,
}

impl Exchange {
    /// Registers the regions for `plan` among `ranks` ranks; every wait gives up after
    /// `timeout`.
    pub fn new(
        engine: TransferEngine,
        rank: usize,
        ranks: usize,
        plan: StepPlan,
        timeout: Duration,
    ) -> Result<Self> {
        if ranks == 0 || ranks > MAX_RANKS || rank >= ranks {
            return Err(HelixError::Config(format!(
                "rank {rank} of {ranks} (at most {MAX_RANKS})"
            )));
        }
        let mut areas = Vec::with_capacity(plan.rounds());
        let mut half = 0usize;
        for &slot in &plan.slots {
            areas.push(half);
            half = slot
                .checked_mul(ranks)
                .and_then(|a| half.checked_add(a))
                .ok_or_else(|| HelixError::Config("exchange regions overflow".to_owned()))?;
        }
        let send = engine.alloc_mr_with(2 * half, Access::Local)?;
        let recv = engine.alloc_mr_with(2 * half, Access::RemoteWrite)?;
        Ok(Self {
            engine,
            rank,
            ranks,
            plan,
            areas,
            half,
            send,
            recv,
            peers: Vec::new(),
            tracker: Tracker::new(),
            events: unbounded(),
            timeout,
            bytes_sent: 0,
        })
    }

    /// What peers need to reach this rank.
    pub fn info(&self) -> PeerInfo {
        PeerInfo {
            rank: self.rank,
            addr: self.engine.main_address(),
            recv: self.recv.desc().clone(),
            pid: std::process::id(),
        }
    }

    /// Takes the pool's infos (one per rank, in any order), checks them and connects every
    /// peer.
    pub fn connect(&mut self, mut peers: Vec<PeerInfo>) -> Result<()> {
        peers.sort_by_key(|p| p.rank);
        if peers.len() != self.ranks || peers.iter().enumerate().any(|(i, p)| p.rank != i) {
            return Err(HelixError::Rendezvous(format!(
                "expected ranks 0..{}, got {:?}",
                self.ranks,
                peers.iter().map(|p| p.rank).collect::<Vec<_>>()
            )));
        }
        if peers[self.rank] != self.info() {
            return Err(HelixError::Rendezvous(format!(
                "the pool lists another rank {}",
                self.rank
            )));
        }
        for p in peers.iter().filter(|p| p.rank != self.rank) {
            if p.recv.len < 2 * self.half as u64 {
                return Err(HelixError::Rendezvous(format!(
                    "rank {}'s receive region is {} bytes, this plan needs {}",
                    p.rank,
                    p.recv.len,
                    2 * self.half
                )));
            }
            self.engine.connect(&p.addr)?;
        }
        self.peers = peers;
        Ok(())
    }

    /// The pool, once connected.
    pub fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    /// Bytes this rank has written to peers.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn locate(&self, step: u64, index: usize) -> Result<Posted> {
        let slot = *self.plan.slots.get(index).ok_or_else(|| {
            HelixError::Config(format!(
                "round {index} of a {}-round step",
                self.plan.rounds()
            ))
        })?;
        let round = (step % u64::from(ROUND_MODULUS))
            .wrapping_mul(self.plan.rounds() as u64)
            .wrapping_add(index as u64)
            % u64::from(ROUND_MODULUS);
        Ok(Posted {
            round: round as u32,
            area: (step % 2) as usize * self.half + self.areas[index],
            slot,
        })
    }

    /// Posts round `index` of step `step`: `parts` are `(dest, bytes)` (this rank's own part
    /// is copied into its receive slot), `from` the `(source, bytes)` this rank expects.
    pub fn post(
        &mut self,
        step: u64,
        index: usize,
        parts: &[(usize, &[u8])],
        from: &[(usize, usize)],
    ) -> Result<Posted> {
        if self.peers.is_empty() {
            return Err(HelixError::Config("post before connect".to_owned()));
        }
        let at = self.locate(step, index)?;
        let (mut from_mask, mut to_mask) = (0u64, 0u64);
        for &(source, len) in from {
            if source >= self.ranks || len > at.slot {
                return Err(HelixError::Config(format!(
                    "part from rank {source} of {len} bytes (slot {})",
                    at.slot
                )));
            }
            if source != self.rank {
                from_mask |= 1 << source;
            }
        }
        for &(dest, bytes) in parts {
            if dest >= self.ranks || bytes.len() > at.slot || bytes.is_empty() {
                return Err(HelixError::Config(format!(
                    "part to rank {dest} of {} bytes (slot {})",
                    bytes.len(),
                    at.slot
                )));
            }
            if dest != self.rank {
                to_mask |= 1 << dest;
            }
        }
        self.tracker.open(at.round, from_mask, to_mask)?;
        for &(source, len) in from.iter().filter(|(s, _)| *s != self.rank) {
            let tx = self.events.0.clone();
            let round = at.round;
            let count = self
                .engine
                .expected_arrivals(TransferShape::SingleWrite { len: len as u64 });
            self.engine.expect_imm_count(
                imm(round, source),
                count,
                OnDone::callback(move |outcome| {
                    if outcome.is_ok() {
                        let _ = tx.send(Event::Arrived { round, source });
                    }
                }),
            );
        }
        for &(dest, bytes) in parts {
            let offset = at.area + dest * at.slot;
            if dest == self.rank {
                self.recv.write_at(at.area + self.rank * at.slot, bytes)?;
                continue;
            }
            self.send.write_at(offset, bytes)?;
            let tx = self.events.0.clone();
            let round = at.round;
            self.engine.submit_single_write(
                bytes.len() as u64,
                Some(imm(round, self.rank)),
                (self.send.handle(), offset as u64),
                (
                    &self.peers[dest].recv,
                    (at.area + self.rank * at.slot) as u64,
                ),
                OnDone::callback(move |outcome| {
                    let _ = tx.send(Event::Sent {
                        round,
                        dest,
                        error: outcome.err().map(|e| e.to_string()),
                    });
                }),
            )?;
            self.bytes_sent += bytes.len() as u64;
        }
        Ok(at)
    }

    /// Waits until `posted` is complete (every part here, every write of this rank done); a
    /// failed write or a part missing after the timeout is an error naming the ranks.
    pub fn wait(&mut self, posted: Posted, what: &str) -> Result<()> {
        let started = Instant::now();
        loop {
            let status = self
                .tracker
                .status(posted.round)
                .ok_or(crate::tracker::TrackError::NotOpen(posted.round))?;
            if let Some((peer, why)) = status.failed {
                self.tracker.abandon(posted.round);
                return Err(HelixError::WriteFailed {
                    rank: self.rank,
                    round: posted.round,
                    what: what.to_owned(),
                    peer,
                    why,
                });
            }
            if status.complete {
                self.tracker.close(posted.round)?;
                return Ok(());
            }
            let left = self.timeout.saturating_sub(started.elapsed());
            match self.events.1.recv_timeout(left) {
                Ok(event) => match self.tracker.apply(event) {
                    // A late event of a round given up on.
                    Err(crate::tracker::TrackError::NotOpen(_)) => {}
                    other => other?,
                },
                Err(_) => {
                    self.tracker.abandon(posted.round);
                    return Err(HelixError::Timeout {
                        rank: self.rank,
                        round: posted.round,
                        what: what.to_owned(),
                        waited: started.elapsed(),
                        missing: status.missing,
                        unacknowledged: status.unacknowledged,
                    });
                }
            }
        }
    }

    /// The `len` bytes `source` delivered in `posted` (after [`Exchange::wait`]).
    pub fn read(&self, posted: Posted, source: usize, len: usize) -> Result<Vec<u8>> {
        if source >= self.ranks || len > posted.slot {
            return Err(HelixError::Config(format!(
                "read of {len} bytes from rank {source}"
            )));
        }
        let mut out = vec![0u8; len];
        self.recv
            .read_at(posted.area + source * posted.slot, &mut out)?;
        Ok(out)
    }
}
