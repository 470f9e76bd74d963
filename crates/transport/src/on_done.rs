//! How a caller learns that a transfer finished: a callback (run on the engine's callback
//! thread), an atomic flag, a counter, or a future, optionally with a cancellation token.
//! Flags, counters and futures are completed by the worker directly (a few atomics); only
//! callbacks cross to the callback thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::cancel::CancellationToken;
use crate::error::TransferError;

/// A finished transfer's result.
pub type Outcome = Result<(), TransferError>;

/// Runs `future` to completion on the calling thread, parking it between polls (the waker
/// unparks it): how the crate's futures are awaited by code that has no executor.
pub fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

/// A boxed completion callback.
pub type DoneCallback = Box<dyn FnOnce(Outcome) + Send + 'static>;

/// What to do when a transfer (or an expectation) finishes.
pub struct OnDone {
    pub(crate) action: DoneAction,
    pub(crate) cancel: Option<CancellationToken>,
    /// The staging bytes the transfer reads, held as being written out until it finishes
    /// ([`crate::Staging::submit_write`]); released before the action runs, so whoever the
    /// action tells may fill them again at once.
    pub(crate) lease: Option<crate::staging::SendLease>,
}

pub(crate) enum DoneAction {
    Nothing,
    Callback(DoneCallback),
    Flag(Arc<DoneFlag>),
    Counter(Arc<DoneCounter>),
    Future(Arc<FutureSlot>),
}

impl std::fmt::Debug for OnDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.action {
            DoneAction::Nothing => "nothing",
            DoneAction::Callback(_) => "callback",
            DoneAction::Flag(_) => "flag",
            DoneAction::Counter(_) => "counter",
            DoneAction::Future(_) => "future",
        };
        f.debug_struct("OnDone")
            .field("action", &kind)
            .field("cancellable", &self.cancel.is_some())
            .finish()
    }
}

impl OnDone {
    fn new(action: DoneAction) -> Self {
        Self {
            action,
            cancel: None,
            lease: None,
        }
    }

    /// Ignore the result. An immediate-only write given this may go out without a completion
    /// at all ([`TransferEngine::submit_imm`](crate::TransferEngine::submit_imm)).
    pub fn nothing() -> Self {
        Self::new(DoneAction::Nothing)
    }

    /// Whether finishing does nothing: no action, no cancellation token.
    pub(crate) fn reports_nothing(&self) -> bool {
        matches!(self.action, DoneAction::Nothing) && self.cancel.is_none() && self.lease.is_none()
    }

    /// Run `f` with the result on the engine's callback thread. `f` may call back into the
    /// engine. A transfer that raced [`TransferEngine::shutdown`](crate::TransferEngine::shutdown)
    /// past the callback thread's end runs `f` on the thread that failed it instead (the
    /// submitting one), so `f` runs exactly once either way.
    pub fn callback(f: impl FnOnce(Outcome) + Send + 'static) -> Self {
        Self::new(DoneAction::Callback(Box::new(f)))
    }

    /// Set `flag` when done.
    pub fn flag(flag: &Arc<DoneFlag>) -> Self {
        Self::new(DoneAction::Flag(flag.clone()))
    }

    /// Count the result in `counter`.
    pub fn counter(counter: &Arc<DoneCounter>) -> Self {
        Self::new(DoneAction::Counter(counter.clone()))
    }

    /// A future that resolves to the result, and the `OnDone` that completes it. The future
    /// works under any executor (tokio included) and needs none to be running.
    pub fn future() -> (Self, TransferFuture) {
        let slot = Arc::new(FutureSlot::default());
        (
            Self::new(DoneAction::Future(slot.clone())),
            TransferFuture { slot },
        )
    }

    /// The same, cancellable through `token`: cancelling stops further posts of the request,
    /// which then finishes with [`TransferError::Cancelled`] once what was posted completed.
    #[must_use]
    pub fn cancellable(mut self, token: &CancellationToken) -> Self {
        self.cancel = Some(token.clone());
        self
    }

    /// Delivers `outcome`; callbacks are handed to `run_callback`.
    pub(crate) fn finish(self, outcome: Outcome, run_callback: impl FnOnce(DoneCallback, Outcome)) {
        drop(self.lease);
        match self.action {
            DoneAction::Nothing => {}
            DoneAction::Callback(f) => run_callback(f, outcome),
            DoneAction::Flag(flag) => flag.set(outcome),
            DoneAction::Counter(counter) => counter.record(outcome),
            DoneAction::Future(slot) => slot.complete(outcome),
        }
    }
}

impl From<&Arc<DoneFlag>> for OnDone {
    fn from(flag: &Arc<DoneFlag>) -> Self {
        Self::flag(flag)
    }
}

impl From<&Arc<DoneCounter>> for OnDone {
    fn from(counter: &Arc<DoneCounter>) -> Self {
        Self::counter(counter)
    }
}

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

/// A one-shot completion flag (paper 002's `Flag(Atomic<bool>)`, with the error kept).
#[derive(Debug, Default)]
pub struct DoneFlag {
    state: AtomicU8,
    error: Mutex<Option<TransferError>>,
    /// The thread to unpark when the flag is set ([`DoneFlag::wake_when_set`]).
    waiter: Mutex<Option<std::thread::Thread>>,
}

impl DoneFlag {
    /// A flag not yet set.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn set(&self, outcome: Outcome) {
        let state = match outcome {
            Ok(()) => OK,
            Err(e) => {
                *self.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                FAILED
            }
        };
        self.state.store(state, Ordering::Release);
        self.wake_waiter();
    }

    /// Unparks and forgets the registered waiter, if there is one.
    fn wake_waiter(&self) {
        let waiter = self
            .waiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = waiter {
            thread.unpark();
        }
    }

    /// Unparks `thread` when the flag is set, or at once if it is already: a waiter can
    /// `park_timeout` between looks instead of polling. One waiter at a time (a later call
    /// replaces it); it may also be woken for other reasons, as parking allows.
    pub fn wake_when_set(&self, thread: std::thread::Thread) {
        *self.waiter.lock().unwrap_or_else(PoisonError::into_inner) = Some(thread);
        // Either `set` took the waiter after it was stored, or its state is visible here
        // (it stored the state before taking the lock this store released).
        if self.is_done() {
            self.wake_waiter();
        }
    }

    /// Whether the transfer finished (either way).
    pub fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }

    /// The result, once finished.
    pub fn result(&self) -> Option<Outcome> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            OK => Some(Ok(())),
            _ => Some(Err(self
                .error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
                .unwrap_or(TransferError::Provider("unknown error".to_owned())))),
        }
    }
}

/// Counts finished transfers: many transfers may share one counter.
#[derive(Debug, Default)]
pub struct DoneCounter {
    ok: AtomicU64,
    failed: AtomicU64,
}

impl DoneCounter {
    /// A counter at zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn record(&self, outcome: Outcome) {
        let counter = if outcome.is_ok() {
            &self.ok
        } else {
            &self.failed
        };
        counter.fetch_add(1, Ordering::Release);
    }

    /// Transfers finished successfully.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Acquire)
    }

    /// Transfers finished with an error.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// All finished transfers.
    pub fn total(&self) -> u64 {
        self.ok() + self.failed()
    }
}

#[derive(Debug, Default)]
pub(crate) struct FutureSlot {
    inner: Mutex<(Option<Outcome>, Option<Waker>)>,
}

impl FutureSlot {
    fn complete(&self, outcome: Outcome) {
        let waker = {
            let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            inner.0 = Some(outcome);
            inner.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// Resolves to a transfer's result. Dropping it does not cancel the transfer.
#[derive(Debug)]
pub struct TransferFuture {
    slot: Arc<FutureSlot>,
}

impl TransferFuture {
    /// Blocks the calling thread until the result is in (parking, not spinning): for code
    /// that has no executor.
    pub fn wait(self) -> Outcome {
        block_on(self)
    }
}

impl Future for TransferFuture {
    type Output = Outcome;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut inner = self
            .slot
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match inner.0.take() {
            Some(outcome) => Poll::Ready(outcome),
            None => {
                inner.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_waiter_is_woken_when_its_flag_is_set_and_at_once_if_it_was() {
        let flag = DoneFlag::new();
        let waiter = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                let started = std::time::Instant::now();
                flag.wake_when_set(std::thread::current());
                while !flag.is_done() && started.elapsed() < std::time::Duration::from_secs(20) {
                    std::thread::park_timeout(std::time::Duration::from_secs(20));
                }
                started.elapsed()
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        flag.set(Ok(()));
        let waited = waiter.join().unwrap_or_default();
        assert!(
            waited < std::time::Duration::from_secs(10),
            "the waiter slept {waited:?} past its flag"
        );
        // Registered after the flag was set: woken at once, so its park returns.
        let started = std::time::Instant::now();
        flag.wake_when_set(std::thread::current());
        std::thread::park_timeout(std::time::Duration::from_secs(20));
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    fn finish(done: OnDone, outcome: Outcome) {
        done.finish(outcome, |f, o| f(o));
    }

    #[test]
    fn flags_counters_and_callbacks_see_the_outcome() {
        let flag = DoneFlag::new();
        assert_eq!(flag.result(), None);
        finish(OnDone::from(&flag), Err(TransferError::PeerUnreachable));
        assert_eq!(flag.result(), Some(Err(TransferError::PeerUnreachable)));

        let counter = DoneCounter::new();
        finish(OnDone::from(&counter), Ok(()));
        finish(OnDone::from(&counter), Err(TransferError::Cancelled));
        assert_eq!((counter.ok(), counter.failed(), counter.total()), (1, 1, 2));

        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        finish(
            OnDone::callback(move |o| *s.lock().unwrap() = Some(o)),
            Ok(()),
        );
        assert_eq!(*seen.lock().unwrap(), Some(Ok(())));
    }

    #[test]
    fn the_future_resolves_under_tokio_and_by_waiting_without_a_runtime() {
        let (done, fut) = OnDone::future();
        std::thread::spawn(move || finish(done, Ok(())));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(fut), Ok(()));

        let (done, fut) = OnDone::future();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(5));
            finish(done, Err(TransferError::Shutdown));
        });
        assert_eq!(
            fut.wait(),
            Err(TransferError::Shutdown),
            "wait() parks until the result is in"
        );
    }
}
