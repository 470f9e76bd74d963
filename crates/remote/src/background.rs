//! A [`Requester`] on a thread of its own, for async code: each call returns a [`Reply`], a
//! plain [`Future`] that any executor (tokio, smol, a hand-rolled `block_on`) can await and
//! that [`Reply::wait`] blocks on without one. No runtime is required or started: the
//! requester's blocking waits happen on its thread, never on the executor's.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use kvroute_kernels::Partial;
use kvroute_kvstore::ChunkId;

use crate::dispatch::{MergedStep, route_merged};
use crate::error::{RemoteError, RouteError};
use crate::requester::{Call, Requester, Sparse};

/// A job for a [`Worker`]'s value.
type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// A value owned by a thread of its own, which runs the jobs sent to it in order; dropping it
/// finishes the queued jobs, then stops the thread and drops the value.
#[derive(Debug)]
pub(crate) struct Worker<S> {
    jobs: Option<Sender<Job<S>>>,
    thread: Option<JoinHandle<()>>,
}

impl<S: Send + 'static> Worker<S> {
    /// Moves `state` onto a new thread named `name`.
    pub(crate) fn spawn(mut state: S, name: &str) -> Result<Self, RemoteError> {
        let (jobs, rx) = crossbeam_channel::unbounded::<Job<S>>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for job in rx {
                    job(&mut state);
                }
            })
            .map_err(RemoteError::io("starting a worker thread"))?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the thread, in call order; its result comes back through the [`Reply`].
    pub(crate) fn with<T, F>(&self, f: F) -> Reply<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut S) -> T + Send + 'static,
    {
        let slot = Arc::new(Slot::default());
        let completer = Completer(Some(slot.clone()));
        let job: Job<S> = Box::new(move |state| completer.complete(f(state)));
        // A send that fails drops the job and with it the completer, which resolves the reply
        // as stopped.
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        Reply { slot }
    }
}

impl<S> Drop for Worker<S> {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A requester served by a thread of its own; dropping it finishes the queued calls, then
/// stops the thread and drops the requester.
#[derive(Debug)]
pub struct BackgroundRequester {
    worker: Worker<Requester>,
}

impl BackgroundRequester {
    /// Moves `requester` onto a new thread.
    pub fn spawn(requester: Requester) -> Result<Self, RemoteError> {
        Ok(Self {
            worker: Worker::spawn(requester, "kvroute-requester")?,
        })
    }

    /// Runs `f` on the requester's thread, in call order; its result comes back through the
    /// [`Reply`].
    pub fn with<T, F>(&self, f: F) -> Reply<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Requester) -> T + Send + 'static,
    {
        self.worker.with(f)
    }

    /// [`Requester::route`] of owned calls.
    pub fn route(&self, calls: Vec<OwnedCall>) -> Reply<Vec<Result<Partial, RouteError>>> {
        self.with(move |req| {
            let calls: Vec<Call<'_>> = calls.iter().map(OwnedCall::as_call).collect();
            req.route(&calls)
        })
    }

    /// [`route_merged`] of owned calls: a decode step merged, with replica fallback.
    pub fn route_merged(&self, calls: Vec<OwnedCall>) -> Reply<Result<MergedStep, RemoteError>> {
        self.with(move |req| {
            let calls: Vec<Call<'_>> = calls.iter().map(OwnedCall::as_call).collect();
            route_merged(req, &calls)
        })
    }
}

/// A [`Call`] that owns its rows and indices, so it can cross to the requester's thread.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedCall {
    /// The chunk.
    pub chunk: ChunkId,
    /// The layer.
    pub layer: u16,
    /// Query rows `[mq, 576]` as bf16 bits.
    pub queries: Vec<u16>,
    /// A sparse selection, or dense.
    pub sparse: Option<OwnedSparse>,
}

/// A [`Sparse`] selection that owns its indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedSparse {
    /// `mq / rows_per_token * k` chunk-local token indices, -1 = padding.
    pub indices: Vec<i32>,
    /// Indices per query token.
    pub k: u32,
    /// Query rows per query token.
    pub rows_per_token: u32,
}

impl OwnedSparse {
    /// The borrowed selection.
    pub fn as_sparse(&self) -> Sparse<'_> {
        Sparse {
            indices: &self.indices,
            k: self.k,
            rows_per_token: self.rows_per_token,
        }
    }
}

impl OwnedCall {
    /// The borrowed call.
    pub fn as_call(&self) -> Call<'_> {
        Call {
            chunk: self.chunk,
            layer: self.layer,
            queries: &self.queries,
            sparse: self.sparse.as_ref().map(OwnedSparse::as_sparse),
        }
    }
}

/// The result of a call on a [`BackgroundRequester`]: await it, or [`Reply::wait`].
/// [`RemoteError::Stopped`] if the requester's thread ended before answering (it panicked).
#[derive(Debug)]
pub struct Reply<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Reply<T> {
    /// Blocks the calling thread until the result is in (parking, not spinning).
    pub fn wait(self) -> Result<T, RemoteError> {
        kvroute_transport::block_on(self)
    }
}

impl<T> Future for Reply<T> {
    type Output = Result<T, RemoteError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut inner = self.slot.0.lock().unwrap_or_else(PoisonError::into_inner);
        match inner.value.take() {
            Some(value) => Poll::Ready(value),
            None => {
                inner.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[derive(Debug)]
struct Slot<T>(Mutex<SlotInner<T>>);

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self(Mutex::new(SlotInner {
            value: None,
            waker: None,
        }))
    }
}

#[derive(Debug)]
struct SlotInner<T> {
    value: Option<Result<T, RemoteError>>,
    waker: Option<Waker>,
}

/// Fills a slot once: with the job's result, or (dropped unrun) with [`RemoteError::Stopped`].
struct Completer<T>(Option<Arc<Slot<T>>>);

impl<T> Completer<T> {
    fn complete(mut self, value: T) {
        if let Some(slot) = self.0.take() {
            fill(&slot, Ok(value));
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            fill(&slot, Err(RemoteError::Stopped));
        }
    }
}

fn fill<T>(slot: &Slot<T>, value: Result<T, RemoteError>) {
    let waker = {
        let mut inner = slot.0.lock().unwrap_or_else(PoisonError::into_inner);
        inner.value = Some(value);
        inner.waker.take()
    };
    if let Some(waker) = waker {
        waker.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_whose_job_never_runs_resolves_as_stopped() {
        let slot = Arc::new(Slot::<u32>::default());
        drop(Completer(Some(slot.clone())));
        let reply = Reply { slot };
        assert!(matches!(reply.wait(), Err(RemoteError::Stopped)));
    }

    #[test]
    fn a_completed_reply_wakes_a_waiter_on_another_thread() {
        let slot = Arc::new(Slot::<u32>::default());
        let completer = Completer(Some(slot.clone()));
        let waiter = std::thread::spawn(move || Reply { slot }.wait());
        std::thread::sleep(std::time::Duration::from_millis(20));
        completer.complete(7);
        assert_eq!(waiter.join().ok().and_then(Result::ok), Some(7));
    }
}
