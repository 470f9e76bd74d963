//! When a transfer is done: the aggregation of its work requests' completions.
//!
//! A transfer becomes many work requests (shards over NICs, pages, scatter targets), posted
//! incrementally as the NICs accept them, and completed in any order. It is done when no more
//! will be posted (*sealed*) and every posted one has completed; its result is the first error
//! any of them reported. A cancellation refuses further posts; the transfer then completes
//! once what was already posted has completed.
//!
//! Public engines get this wrong in three ways: firing when the posted requests have all
//! completed but more are still to be posted (completions outrunning posting), firing twice,
//! and never firing after an error path skips a count. Here the outstanding count and the
//! sealed, cancelled and fired bits share one atomic word, so "sealed and nothing outstanding"
//! is observed by exactly one operation, which alone returns the outcome. A fourth bit says an
//! error was recorded, so the operation that fires an errorless transfer takes no lock.

use crate::error::TransferError;
use crate::sync::{AtomicU64, Mutex, Ordering, lock};

const SEALED: u64 = 1 << 63;
const CANCELLED: u64 = 1 << 62;
const FIRED: u64 = 1 << 61;
/// An error was recorded: the outcome must be read from `first_error` (without it, firing
/// takes no lock).
const ERRORED: u64 = 1 << 60;
const OUTSTANDING: u64 = ERRORED - 1;

/// The completion state of one transfer.
#[derive(Debug, Default)]
pub(crate) struct TransferState {
    word: AtomicU64,
    first_error: Mutex<Option<TransferError>>,
}

/// A transfer's final result, returned to whichever operation finished it.
pub(crate) type Outcome = Result<(), TransferError>;

impl TransferState {
    /// A transfer with nothing posted yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Reserves `n` work requests about to be posted. Refused (false) once the transfer is
    /// cancelled, sealed or finished: nothing may be posted then.
    pub(crate) fn try_post(&self, n: u64) -> bool {
        let mut current = self.word.load(Ordering::Acquire);
        loop {
            if current & (CANCELLED | SEALED | FIRED) != 0 {
                return false;
            }
            debug_assert!(
                (current & OUTSTANDING) + n < ERRORED,
                "outstanding count overflow"
            );
            match self.word.compare_exchange_weak(
                current,
                current + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }

    /// Returns `n` reserved requests the NIC did not accept. Cannot finish the transfer: it is
    /// not sealed while its poster still holds reservations.
    pub(crate) fn unpost(&self, n: u64) {
        let prev = self.word.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(
            prev & SEALED == 0 && prev & OUTSTANDING >= n,
            "unpost after seal or below zero"
        );
    }

    /// Records that `n` posted requests completed with `result`. Returns the outcome if this
    /// finished the transfer.
    pub(crate) fn complete(&self, n: u64, result: Outcome) -> Option<Outcome> {
        if let Err(error) = result {
            self.record(error);
        }
        let prev = self.word.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(prev & OUTSTANDING >= n, "more completions than posts");
        let now = prev - n;
        if now & SEALED != 0 && now & OUTSTANDING == 0 {
            self.fire()
        } else {
            None
        }
    }

    /// Declares that nothing more will be posted. Returns the outcome if nothing is
    /// outstanding.
    pub(crate) fn seal(&self) -> Option<Outcome> {
        let prev = self.word.fetch_or(SEALED, Ordering::AcqRel);
        if prev & SEALED == 0 && prev & OUTSTANDING == 0 {
            self.fire()
        } else {
            None
        }
    }

    /// Seals a transfer whose posting was stopped by a cancellation: its result is the first
    /// error if one was reported, else [`TransferError::Cancelled`].
    pub(crate) fn seal_cancelled(&self) -> Option<Outcome> {
        self.record(TransferError::Cancelled);
        self.seal()
    }

    /// Keeps `error` unless an earlier one was kept, and marks the word. Done before the
    /// caller's own update of the word, so whoever finishes the transfer sees the mark.
    fn record(&self, error: TransferError) {
        lock(&self.first_error).get_or_insert(error);
        self.word.fetch_or(ERRORED, Ordering::AcqRel);
    }

    /// Refuses every further post. The transfer finishes when what was posted completes.
    pub(crate) fn cancel(&self) {
        self.word.fetch_or(CANCELLED, Ordering::AcqRel);
    }

    /// Whether cancellation was requested.
    #[cfg(test)]
    pub(crate) fn is_cancelled(&self) -> bool {
        self.word.load(Ordering::Acquire) & CANCELLED != 0
    }

    /// Whether the outcome has been handed out.
    #[cfg(test)]
    pub(crate) fn is_finished(&self) -> bool {
        self.word.load(Ordering::Acquire) & FIRED != 0
    }

    fn fire(&self) -> Option<Outcome> {
        let prev = self.word.fetch_or(FIRED, Ordering::AcqRel);
        if prev & FIRED != 0 {
            return None;
        }
        if prev & ERRORED == 0 {
            return Some(Ok(()));
        }
        Some(lock(&self.first_error).take().map_or(Ok(()), Err))
    }
}

#[cfg(all(test, not(kvroute_loom)))]
mod tests {
    use super::*;

    #[test]
    fn fires_once_after_seal_and_the_last_completion() {
        let s = TransferState::new();
        assert!(s.try_post(3));
        assert_eq!(s.complete(2, Ok(())), None);
        assert_eq!(s.seal(), None, "one still outstanding");
        assert_eq!(s.complete(1, Ok(())), Some(Ok(())));
        assert!(s.is_finished());
        assert!(!s.try_post(1), "nothing is posted after the end");
    }

    #[test]
    fn completions_outrunning_posting_do_not_finish_an_unsealed_transfer() {
        let s = TransferState::new();
        assert!(s.try_post(1));
        assert_eq!(s.complete(1, Ok(())), None, "more to post");
        assert!(s.try_post(1));
        assert_eq!(s.seal(), None);
        assert_eq!(s.complete(1, Ok(())), Some(Ok(())));
    }

    #[test]
    fn the_first_error_is_the_result_and_later_ones_are_dropped() {
        let s = TransferState::new();
        assert!(s.try_post(3));
        s.complete(1, Err(TransferError::PeerUnreachable));
        s.complete(1, Err(TransferError::Injected));
        s.seal();
        assert_eq!(
            s.complete(1, Ok(())),
            Some(Err(TransferError::PeerUnreachable))
        );
    }

    #[test]
    fn an_error_reported_with_no_count_decides_the_outcome_at_seal() {
        // A NIC refusing a work request as malformed: the error alone, then the seal.
        let s = TransferState::new();
        assert_eq!(s.complete(0, Err(TransferError::Injected)), None);
        s.cancel();
        assert_eq!(s.seal(), Some(Err(TransferError::Injected)));
        let clean = TransferState::new();
        assert!(clean.try_post(1));
        assert_eq!(clean.seal(), None);
        assert_eq!(
            clean.complete(1, Ok(())),
            Some(Ok(())),
            "no error, no error bit"
        );
    }

    #[test]
    fn cancellation_stops_posting_and_finishes_when_posted_work_completes() {
        let s = TransferState::new();
        assert!(s.try_post(2));
        s.cancel();
        assert!(!s.try_post(1));
        assert_eq!(s.seal_cancelled(), None, "two still in flight");
        assert_eq!(s.complete(2, Ok(())), Some(Err(TransferError::Cancelled)));
    }

    #[test]
    fn an_empty_transfer_finishes_at_seal_and_refused_reservations_can_be_returned() {
        let s = TransferState::new();
        assert!(s.try_post(4));
        s.unpost(4);
        assert_eq!(s.seal(), Some(Ok(())));
        assert_eq!(s.seal(), None, "sealing twice fires nothing");
    }
}

/// loom models: `cargo xtask loom`. Each runs against the real state and a broken one that
/// fires whenever nothing is outstanding, forgetting that more may still be posted.
#[cfg(all(test, kvroute_loom))]
mod loom_models {
    use super::*;
    use crate::sync::{Arc, AtomicU64, Ordering::SeqCst};
    use loom::thread;
    use std::collections::VecDeque;

    trait State: Default + Send + Sync + 'static {
        fn try_post(&self, n: u64) -> bool;
        fn complete(&self, n: u64, ok: bool) -> Option<Outcome>;
        fn seal(&self) -> Option<Outcome>;
        fn seal_cancelled(&self) -> Option<Outcome>;
        fn cancel(&self);
    }

    impl State for TransferState {
        fn try_post(&self, n: u64) -> bool {
            TransferState::try_post(self, n)
        }
        fn complete(&self, n: u64, ok: bool) -> Option<Outcome> {
            TransferState::complete(
                self,
                n,
                if ok {
                    Ok(())
                } else {
                    Err(TransferError::Injected)
                },
            )
        }
        fn seal(&self) -> Option<Outcome> {
            TransferState::seal(self)
        }
        fn seal_cancelled(&self) -> Option<Outcome> {
            TransferState::seal_cancelled(self)
        }
        fn cancel(&self) {
            TransferState::cancel(self)
        }
    }

    #[derive(Default)]
    struct BrokenState {
        outstanding: AtomicU64,
        fired: AtomicU64,
    }

    impl State for BrokenState {
        fn try_post(&self, n: u64) -> bool {
            self.outstanding.fetch_add(n, SeqCst);
            true
        }
        fn complete(&self, n: u64, ok: bool) -> Option<Outcome> {
            let left = self.outstanding.fetch_sub(n, SeqCst) - n;
            (left == 0 && self.fired.swap(1, SeqCst) == 0).then(|| {
                if ok {
                    Ok(())
                } else {
                    Err(TransferError::Injected)
                }
            })
        }
        fn seal(&self) -> Option<Outcome> {
            (self.outstanding.load(SeqCst) == 0 && self.fired.swap(1, SeqCst) == 0)
                .then_some(Ok(()))
        }
        fn seal_cancelled(&self) -> Option<Outcome> {
            self.seal()
        }
        fn cancel(&self) {}
    }

    /// A poster posts two requests and seals while a completer completes them as they appear,
    /// the second with an error: the transfer finishes exactly once, only after both
    /// completed, with the error.
    fn completions_racing_posting_with_a_failing_shard<S: State>() {
        loom::model(|| {
            let state = Arc::new(S::default());
            let wire = Arc::new(Mutex::new(VecDeque::new()));
            let (completed, fired) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
            let record = |outcome: Option<Outcome>, completed: &AtomicU64, fired: &AtomicU64| {
                if let Some(outcome) = outcome {
                    assert_eq!(
                        completed.load(SeqCst),
                        2,
                        "finished before every posted request completed"
                    );
                    assert!(outcome.is_err(), "the failing shard's error is the result");
                    fired.fetch_add(1, SeqCst);
                }
            };
            let completer = {
                let (state, wire, completed, fired) = (
                    state.clone(),
                    wire.clone(),
                    completed.clone(),
                    fired.clone(),
                );
                thread::spawn(move || {
                    let mut done = 0;
                    while done < 2 {
                        let next = lock(&wire).pop_front();
                        match next {
                            Some(wr) => {
                                completed.fetch_add(1, SeqCst);
                                record(state.complete(1, wr == 0), &completed, &fired);
                                done += 1;
                            }
                            None => thread::yield_now(),
                        }
                    }
                })
            };
            for wr in 0..2u64 {
                assert!(state.try_post(1));
                lock(&wire).push_back(wr);
            }
            record(state.seal(), &completed, &fired);
            completer.join().unwrap();
            assert_eq!(fired.load(SeqCst), 1, "finished exactly once");
        });
    }

    /// A cancellation races a worker that posts and completes two requests (the second
    /// failing) and then seals: whatever the interleaving, it finishes exactly once, with an
    /// error (cancelled or the failure), and nothing is posted after the cancellation is seen.
    fn cancellation_racing_post_and_complete<S: State>() {
        loom::model(|| {
            let state = Arc::new(S::default());
            let canceller = {
                let state = state.clone();
                thread::spawn(move || state.cancel())
            };
            let mut outcomes = Vec::new();
            let mut stopped = false;
            for wr in 0..2 {
                if state.try_post(1) {
                    outcomes.extend(state.complete(1, wr == 0));
                } else {
                    outcomes.extend(state.seal_cancelled());
                    stopped = true;
                    break;
                }
            }
            if !stopped {
                outcomes.extend(state.seal());
            }
            canceller.join().unwrap();
            assert_eq!(outcomes.len(), 1, "finished exactly once");
            assert!(outcomes[0].is_err());
        });
    }

    #[test]
    fn transfer_state_finishes_once_under_racing_completion_and_cancellation() {
        completions_racing_posting_with_a_failing_shard::<TransferState>();
        cancellation_racing_post_and_complete::<TransferState>();
    }

    #[test]
    fn broken_transfer_state_is_caught_by_the_models() {
        let caught = std::panic::catch_unwind(
            completions_racing_posting_with_a_failing_shard::<BrokenState>,
        );
        assert!(
            caught.is_err(),
            "the model must catch the early finish of BrokenState"
        );
    }
}
