//! The exchange's completion bookkeeping, free of I/O: which rounds are open, which ranks each
//! expects a contribution from and sends one to, and what has arrived and completed.
//!
//! Every contribution to a round is one write carrying the immediate [`imm`]`(round, source)`,
//! so the receiver counts contributions per source (the transfer engine's IMM counter fires an
//! expectation per `(round, source)`) and can name the ranks that never delivered. A round is
//! complete when every expected source has arrived exactly once and every write this rank
//! posted for it has completed; events it cannot account for (an unopened round, a source it
//! does not expect, a second arrival) are typed errors that change nothing.

use std::collections::BTreeMap;

use crate::layout::MAX_RANKS;

/// Bits of the immediate that carry the source rank.
const SOURCE_BITS: u32 = 6;
/// Rounds are numbered modulo this (the immediate's other bits).
pub const ROUND_MODULUS: u32 = 1 << (32 - SOURCE_BITS);
/// Rounds one rank may have open at once.
pub const MAX_OPEN_ROUNDS: usize = 4096;

/// The immediate of `source`'s contribution to `round`.
pub const fn imm(round: u32, source: usize) -> u32 {
    ((round % ROUND_MODULUS) << SOURCE_BITS) | (source as u32 & ((1 << SOURCE_BITS) - 1))
}

/// `(round, source)` of an immediate.
pub const fn parse_imm(imm: u32) -> (u32, usize) {
    (
        imm >> SOURCE_BITS,
        (imm & ((1 << SOURCE_BITS) - 1)) as usize,
    )
}

/// Something that happened to an open round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `source`'s contribution landed here.
    Arrived {
        /// The round.
        round: u32,
        /// The contributing rank.
        source: usize,
    },
    /// This rank's write to `dest` completed, with an error if it failed.
    Sent {
        /// The round.
        round: u32,
        /// The destination rank.
        dest: usize,
        /// Why the write failed, if it did.
        error: Option<String>,
    },
}

/// An event the bookkeeping cannot account for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackError {
    /// The round was never opened, or was already closed.
    #[error("round {0} is not open")]
    NotOpen(u32),
    /// The round is open already.
    #[error("round {0} is already open")]
    AlreadyOpen(u32),
    /// Too many rounds are open at once.
    #[error("{MAX_OPEN_ROUNDS} rounds open: close some first")]
    TooManyOpen,
    /// A rank outside the pool.
    #[error("rank {0} is outside the pool of {MAX_RANKS}")]
    BadRank(usize),
    /// An arrival from a rank the round does not expect.
    #[error("round {round}: rank {rank} was not expected to contribute")]
    Unexpected {
        /// The round.
        round: u32,
        /// The rank.
        rank: usize,
    },
    /// A second arrival, or a second completion, for the same rank.
    #[error("round {round}: rank {rank} counted twice")]
    Duplicate {
        /// The round.
        round: u32,
        /// The rank.
        rank: usize,
    },
    /// Closing a round that is not complete.
    #[error("round {0} is not complete")]
    Incomplete(u32),
}

#[derive(Debug, Clone, Default)]
struct Round {
    expect_from: u64,
    arrived: u64,
    sends_to: u64,
    sent: u64,
    failed: Option<(usize, String)>,
}

/// Where one round stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundStatus {
    /// Every expected source arrived and every write completed.
    pub complete: bool,
    /// The first write that failed: destination and error.
    pub failed: Option<(usize, String)>,
    /// Sources still missing, in rank order.
    pub missing: Vec<usize>,
    /// Destinations whose write has not completed, in rank order.
    pub unacknowledged: Vec<usize>,
}

/// The open rounds of one rank.
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    rounds: BTreeMap<u32, Round>,
}

fn bit(rank: usize) -> Result<u64, TrackError> {
    if rank < MAX_RANKS {
        Ok(1 << rank)
    } else {
        Err(TrackError::BadRank(rank))
    }
}

/// The ranks of a mask, in order.
fn ranks_of(mask: u64) -> Vec<usize> {
    (0..MAX_RANKS).filter(|r| mask & (1 << r) != 0).collect()
}

impl Tracker {
    /// No rounds open.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens `round`, expecting a contribution from each rank of `from` and completions of
    /// writes to each rank of `to` (bit `r` for rank `r`).
    pub fn open(&mut self, round: u32, from: u64, to: u64) -> Result<(), TrackError> {
        if self.rounds.contains_key(&round) {
            return Err(TrackError::AlreadyOpen(round));
        }
        if self.rounds.len() >= MAX_OPEN_ROUNDS {
            return Err(TrackError::TooManyOpen);
        }
        self.rounds.insert(
            round,
            Round {
                expect_from: from,
                sends_to: to,
                ..Round::default()
            },
        );
        Ok(())
    }

    /// Accounts for `event`; an error leaves every round as it was.
    pub fn apply(&mut self, event: Event) -> Result<(), TrackError> {
        match event {
            Event::Arrived { round, source } => {
                let b = bit(source)?;
                let r = self
                    .rounds
                    .get_mut(&round)
                    .ok_or(TrackError::NotOpen(round))?;
                if r.expect_from & b == 0 {
                    return Err(TrackError::Unexpected {
                        round,
                        rank: source,
                    });
                }
                if r.arrived & b != 0 {
                    return Err(TrackError::Duplicate {
                        round,
                        rank: source,
                    });
                }
                r.arrived |= b;
            }
            Event::Sent { round, dest, error } => {
                let b = bit(dest)?;
                let r = self
                    .rounds
                    .get_mut(&round)
                    .ok_or(TrackError::NotOpen(round))?;
                if r.sends_to & b == 0 {
                    return Err(TrackError::Unexpected { round, rank: dest });
                }
                if r.sent & b != 0 {
                    return Err(TrackError::Duplicate { round, rank: dest });
                }
                r.sent |= b;
                if let Some(why) = error {
                    r.failed.get_or_insert((dest, why));
                }
            }
        }
        Ok(())
    }

    /// Where `round` stands, if it is open.
    pub fn status(&self, round: u32) -> Option<RoundStatus> {
        self.rounds.get(&round).map(|r| RoundStatus {
            complete: r.arrived == r.expect_from && r.sent == r.sends_to,
            failed: r.failed.clone(),
            missing: ranks_of(r.expect_from & !r.arrived),
            unacknowledged: ranks_of(r.sends_to & !r.sent),
        })
    }

    /// Closes a complete round.
    pub fn close(&mut self, round: u32) -> Result<(), TrackError> {
        match self.status(round) {
            None => Err(TrackError::NotOpen(round)),
            Some(s) if !s.complete => Err(TrackError::Incomplete(round)),
            Some(_) => {
                self.rounds.remove(&round);
                Ok(())
            }
        }
    }

    /// Drops `round` whatever its state (a step that failed).
    pub fn abandon(&mut self, round: u32) {
        self.rounds.remove(&round);
    }

    /// Rounds open now.
    pub fn open_rounds(&self) -> usize {
        self.rounds.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn immediates_carry_round_and_source() {
        for (round, source) in [(0, 0), (1, 63), (ROUND_MODULUS - 1, 5), (12345, 7)] {
            assert_eq!(parse_imm(imm(round, source)), (round, source));
        }
        assert_eq!(parse_imm(imm(ROUND_MODULUS + 3, 2)), (3, 2), "rounds wrap");
    }

    #[test]
    fn events_it_cannot_account_for_are_refused_and_change_nothing() {
        let mut t = Tracker::new();
        t.open(7, 0b0110, 0b0010).unwrap();
        assert_eq!(t.open(7, 1, 1), Err(TrackError::AlreadyOpen(7)));
        let arrive = |source| Event::Arrived { round: 7, source };
        assert_eq!(
            t.apply(Event::Arrived {
                round: 8,
                source: 1
            }),
            Err(TrackError::NotOpen(8))
        );
        assert_eq!(
            t.apply(arrive(0)),
            Err(TrackError::Unexpected { round: 7, rank: 0 })
        );
        assert_eq!(t.apply(arrive(64)), Err(TrackError::BadRank(64)));
        t.apply(arrive(1)).unwrap();
        assert_eq!(
            t.apply(arrive(1)),
            Err(TrackError::Duplicate { round: 7, rank: 1 })
        );
        assert_eq!(t.status(7).unwrap().missing, vec![2]);
        assert_eq!(t.close(7), Err(TrackError::Incomplete(7)));
        t.apply(arrive(2)).unwrap();
        assert!(!t.status(7).unwrap().complete, "its own write is still out");
        t.apply(Event::Sent {
            round: 7,
            dest: 1,
            error: Some("peer gone".into()),
        })
        .unwrap();
        let s = t.status(7).unwrap();
        assert!(s.complete && s.failed == Some((1, "peer gone".into())));
        t.close(7).unwrap();
        assert_eq!(t.open_rounds(), 0);
    }

    proptest! {
        /// Any interleaving of several rounds' arrivals and completions: a round completes
        /// exactly when its last expected event is applied, never before, and foreign events
        /// mixed in are refused without effect.
        #[test]
        fn rounds_complete_exactly_when_their_last_contribution_lands(
            n in 1usize..=MAX_RANKS,
            rounds in 1u32..6,
            masks in proptest::collection::vec((any::<u64>(), any::<u64>()), 6),
            order in any::<u64>(),
            withheld in any::<bool>(),
        ) {
            let pool = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
            let mut t = Tracker::new();
            let mut events = Vec::new();
            for round in 0..rounds {
                let (from, to) = (masks[round as usize].0 & pool, masks[round as usize].1 & pool);
                t.open(round, from, to).unwrap();
                events.extend(ranks_of(from).into_iter().map(|source| Event::Arrived { round, source }));
                events.extend(ranks_of(to).into_iter().map(|dest| Event::Sent { round, dest, error: None }));
            }
            // A deterministic shuffle from `order`.
            let mut state = order | 1;
            for i in (1..events.len()).rev() {
                state ^= state << 13; state ^= state >> 7; state ^= state << 17;
                events.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let held = if withheld { events.pop() } else { None };
            let mut left: BTreeMap<u32, usize> = BTreeMap::new();
            for e in &events {
                let r = match e { Event::Arrived { round, .. } | Event::Sent { round, .. } => *round };
                *left.entry(r).or_default() += 1;
            }
            for e in events {
                let r = match e { Event::Arrived { round, .. } | Event::Sent { round, .. } => round };
                prop_assert!(!t.status(r).unwrap().complete || left[&r] == 0);
                t.apply(e.clone()).unwrap();
                prop_assert!(t.apply(e).is_err(), "a duplicate is refused");
                *left.get_mut(&r).unwrap() -= 1;
                let complete = t.status(r).unwrap().complete;
                let waiting_on_held = held.as_ref().is_some_and(|h| matches!(h,
                    Event::Arrived { round, .. } | Event::Sent { round, .. } if *round == r));
                prop_assert_eq!(complete, left[&r] == 0 && !waiting_on_held);
            }
            for round in 0..rounds {
                let s = t.status(round).unwrap();
                let is_held_round = held.as_ref().is_some_and(|h| matches!(h,
                    Event::Arrived { round: hr, .. } | Event::Sent { round: hr, .. } if *hr == round));
                prop_assert_eq!(s.complete, !is_held_round);
                match &held {
                    Some(Event::Arrived { round: hr, source }) if *hr == round => {
                        prop_assert_eq!(&s.missing, &vec![*source]);
                    }
                    Some(Event::Sent { round: hr, dest, .. }) if *hr == round => {
                        prop_assert_eq!(&s.unacknowledged, &vec![*dest]);
                    }
                    _ => prop_assert!(s.missing.is_empty() && s.unacknowledged.is_empty()),
                }
            }
        }
    }
}
