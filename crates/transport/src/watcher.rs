//! The memory-word watcher (paper 002 section 3.3, "UVM Watcher"): a thread polls registered
//! 64-bit words and, whenever one changes, queues `handler(old, new)` on the callback thread.
//! The GPU increments a word after each layer and the host starts that layer's transfer; here
//! the words are host memory (GPU-mapped words come with the CUDA work).
//!
//! Polling is adaptive: right after a change the thread keeps looking (yielding between
//! passes) for a short while, then it checks every `poll` interval. A change may therefore be
//! seen up to one interval late, and changes in quick succession may be seen as one, which is
//! why the handler gets the old value too.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::engine::callbacks::{CallbackQueue, Job, WatchHandler};
use crate::error::TransportError;

/// How long the thread keeps looking after a change before falling back to `poll`.
const HOT: Duration = Duration::from_micros(200);

#[derive(Debug)]
struct Watched {
    id: u64,
    cell: Arc<AtomicU64>,
    last: u64,
}

#[derive(Debug, Default)]
struct State {
    words: Mutex<Vec<Watched>>,
    stop: AtomicBool,
}

/// The watcher thread and its words; the thread starts with the first word.
#[derive(Debug)]
pub(crate) struct WatcherService {
    callbacks: CallbackQueue,
    poll: Duration,
    name: String,
    state: Arc<State>,
    thread: Mutex<Option<JoinHandle<()>>>,
    next_id: AtomicU64,
}

impl WatcherService {
    pub(crate) fn new(callbacks: CallbackQueue, poll: Duration, name: String) -> Self {
        Self {
            callbacks,
            poll,
            name,
            state: Arc::default(),
            thread: Mutex::new(None),
            next_id: AtomicU64::new(1),
        }
    }

    pub(crate) fn watch(&self, handler: WatchHandler) -> Result<WatchedWord, TransportError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cell = Arc::new(AtomicU64::new(0));
        // The handler is installed before the word is watched, so no change finds none.
        self.callbacks.push(Job::WatchInstall { id, handler });
        self.state
            .words
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Watched {
                id,
                cell: cell.clone(),
                last: 0,
            });
        let mut thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner);
        if thread.is_none() {
            let (state, callbacks, poll) = (self.state.clone(), self.callbacks.clone(), self.poll);
            let spawned = std::thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || run(&state, &callbacks, poll))
                .map_err(|e| TransportError::Domain(format!("spawning the watcher: {e}")))?;
            *thread = Some(spawned);
        }
        Ok(WatchedWord {
            id,
            cell,
            state: self.state.clone(),
            callbacks: self.callbacks.clone(),
        })
    }

    pub(crate) fn stop(&self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(t) = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

fn run(state: &State, callbacks: &CallbackQueue, poll: Duration) {
    let mut last_change = Instant::now();
    while !state.stop.load(Ordering::Acquire) {
        let mut changed = false;
        for w in state
            .words
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter_mut()
        {
            let now = w.cell.load(Ordering::Acquire);
            if now != w.last {
                callbacks.push(Job::WatchChanged {
                    id: w.id,
                    old: w.last,
                    new: now,
                });
                w.last = now;
                changed = true;
            }
        }
        if changed {
            last_change = Instant::now();
        } else if last_change.elapsed() < HOT {
            std::thread::yield_now();
        } else {
            std::thread::park_timeout(poll);
        }
    }
}

/// A watched 64-bit word. Whoever writes it (another thread, or a device through its
/// address) triggers the handler; dropping it stops the watching.
#[derive(Debug)]
pub struct WatchedWord {
    id: u64,
    cell: Arc<AtomicU64>,
    state: Arc<State>,
    callbacks: CallbackQueue,
}

impl WatchedWord {
    /// The word's address, for a writer outside Rust (8-byte aligned, valid while `self` is).
    pub fn as_ptr(&self) -> *mut u64 {
        self.cell.as_ptr()
    }

    /// The current value.
    pub fn load(&self) -> u64 {
        self.cell.load(Ordering::Acquire)
    }

    /// Sets the value.
    pub fn store(&self, value: u64) {
        self.cell.store(value, Ordering::Release);
    }

    /// Adds `n` (the GPU's `scalar_inc_` in paper 002 appendix A) and returns the old value.
    pub fn fetch_add(&self, n: u64) -> u64 {
        self.cell.fetch_add(n, Ordering::AcqRel)
    }
}

impl Drop for WatchedWord {
    fn drop(&mut self) {
        self.state
            .words
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|w| w.id != self.id);
        self.callbacks.push(Job::WatchRemove { id: self.id });
    }
}
