//! The callback thread: every user callback runs here, never on a worker, so a slow or
//! re-entrant callback cannot stall posting and polling. Its queue is unbounded on purpose:
//! a worker never waits for it, so a callback that submits (and waits for room in a full
//! submission queue) cannot deadlock against the worker that would make room.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, unbounded};

use crate::on_done::{DoneCallback, Outcome};
use crate::recv_pool::RecvPool;

/// A handler for received messages and their sender.
pub(crate) type RecvHandler = Box<dyn FnMut(&[u8], Option<&crate::addr::NetAddr>) + Send>;
/// A handler for arrivals nobody expected.
pub(crate) type ImmHandler = Box<dyn FnMut(u32, u64) + Send>;
/// A memory-word watcher's callback.
pub(crate) type WatchHandler = Box<dyn FnMut(u64, u64) + Send>;

pub(crate) enum Job {
    Done(PendingDone),
    Recv {
        pool: Arc<RecvPool>,
        index: u32,
        len: usize,
        from: Option<crate::addr::NetAddr>,
    },
    SetRecvHandler(RecvHandler),
    Unexpected {
        imm: u32,
        count: u64,
    },
    SetUnexpectedHandler(ImmHandler),
    WatchInstall {
        id: u64,
        handler: WatchHandler,
    },
    WatchChanged {
        id: u64,
        old: u64,
        new: u64,
    },
    WatchRemove {
        id: u64,
    },
    Stop,
}

/// A completion callback with its outcome. It runs exactly once: on the callback thread, or,
/// when the engine has stopped and the job can no longer reach that thread (the queue was
/// discarded, or the push failed), on the thread that drops it.
pub(crate) struct PendingDone(Option<(DoneCallback, Outcome)>);

impl PendingDone {
    fn fire(&mut self) {
        if let Some((f, outcome)) = self.0.take() {
            guarded("completion", || f(outcome));
        }
    }
}

impl Drop for PendingDone {
    fn drop(&mut self) {
        self.fire();
    }
}

/// The sending side of the callback thread's queue.
#[derive(Debug, Clone)]
pub(crate) struct CallbackQueue {
    tx: Sender<Job>,
}

impl CallbackQueue {
    pub(crate) fn push(&self, job: Job) {
        // Fails only after the callback thread stopped (engine shutdown). The job is dropped
        // here then: moot, except a completion, which runs as it drops (see PendingDone).
        let _ = self.tx.send(job);
    }

    pub(crate) fn run_done(&self, callback: DoneCallback, outcome: Outcome) {
        self.push(Job::Done(PendingDone(Some((callback, outcome)))));
    }
}

/// Starts the callback thread.
pub(crate) fn spawn(name: String) -> std::io::Result<(CallbackQueue, JoinHandle<()>)> {
    let (tx, rx) = unbounded();
    let handle = std::thread::Builder::new()
        .name(name)
        .spawn(move || run(&rx))?;
    Ok((CallbackQueue { tx }, handle))
}

/// Runs user code, keeping the thread alive if it panics.
fn guarded(what: &str, f: impl FnOnce()) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        tracing::error!(what, "a user callback panicked; the engine carries on");
    }
}

fn run(rx: &Receiver<Job>) {
    let mut recv_handler: Option<RecvHandler> = None;
    let mut imm_handler: Option<ImmHandler> = None;
    let mut watchers: HashMap<u64, WatchHandler> = HashMap::new();
    while let Ok(job) = rx.recv() {
        match job {
            Job::Done(mut done) => done.fire(),
            Job::Recv {
                pool,
                index,
                len,
                from,
            } => {
                if let Some(handler) = recv_handler.as_mut() {
                    // SAFETY: the worker delivered buffer `index` (posted -> in callback) before
                    // queueing this job, and only the `release` below ends that state.
                    let message = unsafe { pool.message(index, len) };
                    guarded("receive", || handler(message, from.as_ref()));
                }
                if let Err(e) = pool.release(index) {
                    tracing::error!(%e, "receive pool out of order");
                }
            }
            Job::SetRecvHandler(h) => recv_handler = Some(h),
            Job::Unexpected { imm, count } => {
                if let Some(h) = imm_handler.as_mut() {
                    guarded("unexpected immediate", || h(imm, count));
                }
            }
            Job::SetUnexpectedHandler(h) => imm_handler = Some(h),
            Job::WatchInstall { id, handler } => {
                watchers.insert(id, handler);
            }
            Job::WatchChanged { id, old, new } => {
                if let Some(h) = watchers.get_mut(&id) {
                    guarded("watcher", || h(old, new));
                }
            }
            Job::WatchRemove { id } => {
                watchers.remove(&id);
            }
            Job::Stop => break,
        }
    }
}
