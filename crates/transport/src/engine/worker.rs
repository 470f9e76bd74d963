//! The worker of one domain group (paper 002 section 3.4). Each pass: take new submissions
//! first (their first work request is posted at once), then progress pending posts, then poll
//! completions in batches, then repost receive buffers.
//!
//! A pass is run by the group's worker thread ([`run`]): when a pass finds nothing to do the
//! thread spins briefly (to keep submit-to-post latency low under load) and then, if its NICs
//! allow it, parks until a submitter or a peer wakes it. With manual progress
//! ([`crate::Progress::Manual`]) there is no thread: whoever calls
//! [`crate::TransferEngine::progress`] runs the pass ([`Manual`]), and a submitting thread
//! that finds the pass free takes its own transfer as the pass would ([`Driver::take`]),
//! which saves the queue's hand-off on the path of a small write.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};

use super::group::Group;
use super::message::{Command, Message, RemoteTarget, Submission};
use super::shared::{RetireOnExit, WorkerWake};
use crate::domain::Domain;

/// Messages taken per pass, so completions are polled even under a flood of submissions.
const DRAIN: usize = 64;
/// Passes that find the queue empty between receive attempts on it. An empty queue is seen
/// by a plain look at it; only a receive attempt reports that every sender has gone (a
/// dropped engine), and on an empty queue it costs a full fence, every pass.
const EMPTY_LOOKS: u32 = 64;
/// Idle passes between looks at the clock (and yields of the core).
const IDLE_CHECK: u32 = 64;
/// Longest park: a safety net only; wake-ups normally come through `WorkerWake`.
const MAX_PARK: Duration = Duration::from_millis(20);

/// How a worker thread runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkerConfig {
    /// CPU core to pin the worker to.
    pub(crate) core: Option<usize>,
    /// How long an idle worker keeps polling before it parks.
    pub(crate) idle_spin: Duration,
}

/// What a pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Something was taken, posted, completed or reposted.
    Busy,
    /// Nothing to do.
    Idle,
    /// Told to stop: everything in flight has been failed.
    Stopped,
}

/// A group and its submission queue: the pass, whoever runs it.
pub(crate) struct Driver<D: Domain> {
    group: Group<D>,
    rx: Receiver<Message>,
    /// Passes since the last receive attempt on an empty queue.
    empty_looks: u32,
}

impl<D: Domain> Driver<D> {
    pub(crate) fn new(group: Group<D>, rx: Receiver<Message>) -> Self {
        Self {
            group,
            rx,
            empty_looks: 0,
        }
    }

    /// One pass over submissions, pending posts, completions and receive buffers.
    pub(crate) fn pass(&mut self) -> Pass {
        let mut busy = false;
        let drain = if self.rx.is_empty() && self.empty_looks < EMPTY_LOOKS {
            self.empty_looks += 1;
            0
        } else {
            self.empty_looks = 0;
            DRAIN
        };
        for _ in 0..drain {
            match self.rx.try_recv() {
                Ok(Message::Transfer(sub)) => self.group.accept(sub),
                Ok(Message::Command(Command::Stop)) | Err(TryRecvError::Disconnected) => {
                    self.group.shutdown();
                    return Pass::Stopped;
                }
                Ok(Message::Command(c)) => self.group.command(c),
                Err(TryRecvError::Empty) => break,
            }
            busy = true;
        }
        busy |= self.group.progress();
        busy |= self.group.poll();
        busy |= self.group.repost_recvs();
        if busy { Pass::Busy } else { Pass::Idle }
    }

    /// Takes `sub` as a pass would take it from the queue, unless messages are queued: they
    /// were submitted first and go first, so `sub` is handed back to queue behind them.
    fn take(&mut self, sub: Submission) -> Option<Submission> {
        if !self.rx.is_empty() {
            return Some(sub);
        }
        self.group.accept(sub);
        None
    }

    /// Posts an immediate-only write nobody waits on without a completion, as a pass would
    /// take it, unless messages are queued ahead of it or the NIC cannot; whether it did.
    fn post_unreported_imm(&mut self, dst: &RemoteTarget, imm: u32) -> bool {
        self.rx.is_empty() && self.group.post_unreported_imm(dst, imm)
    }
}

/// Runs a worker thread until it is told to stop.
pub(crate) fn run<D: Domain>(mut driver: Driver<D>, wake: &Arc<WorkerWake>, config: WorkerConfig) {
    wake.bind(std::thread::current());
    if let Some(core) = config.core
        && !core_affinity::set_for_current(core_affinity::CoreId { id: core })
    {
        tracing::warn!(core, "could not pin the worker; running unpinned");
    }
    let mut idle_since: Option<Instant> = None;
    let mut idle_passes: u32 = 0;
    loop {
        match driver.pass() {
            Pass::Stopped => return,
            Pass::Busy => {
                idle_since = None;
                idle_passes = 0;
                continue;
            }
            Pass::Idle => {}
        }
        // Idle: spin with the pause hint (a submission is picked up within a pass), and only
        // every IDLE_CHECK passes look at the clock and yield the core (a syscall a submission
        // arriving mid-way would have to wait out).
        idle_passes = idle_passes.wrapping_add(1);
        if !idle_passes.is_multiple_of(IDLE_CHECK) {
            std::hint::spin_loop();
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < config.idle_spin || !driver.group.may_park() {
            std::thread::yield_now();
            continue;
        }
        // Announce, look once more, then park: see WorkerWake for why no wake-up is lost.
        wake.announce_sleep();
        if !driver.rx.is_empty() || driver.group.poll() {
            wake.awake();
            idle_since = None;
            continue;
        }
        let timeout = driver
            .group
            .next_deadline()
            .map_or(MAX_PARK, |d| d.saturating_duration_since(Instant::now()))
            .min(MAX_PARK);
        std::thread::park_timeout(timeout);
        wake.awake();
    }
}

/// A group without a thread: its passes run inside [`crate::TransferEngine::progress`].
pub(crate) trait ManualProgress: Send {
    /// Runs one pass; returns whether it did anything.
    fn pass(&mut self) -> bool;
    /// Takes a submission on the submitting thread (its first work requests are posted at
    /// once); hands it back when messages are queued ahead of it or the group has stopped.
    fn take(&mut self, sub: Submission) -> Option<Submission>;
    /// [`Driver::post_unreported_imm`] on the submitting thread; `false` once stopped.
    fn post_unreported_imm(&mut self, dst: &RemoteTarget, imm: u32) -> bool;
    /// Fails everything in flight or queued, closes the NICs and retires the group.
    fn stop(&mut self);
}

/// The manual counterpart of a worker thread.
pub(crate) struct Manual<D: Domain> {
    driver: Option<Driver<D>>,
    retire: Option<RetireOnExit>,
}

impl<D: Domain> Manual<D> {
    pub(crate) fn new(driver: Driver<D>, retire: RetireOnExit) -> Self {
        Self {
            driver: Some(driver),
            retire: Some(retire),
        }
    }
}

impl<D: Domain> ManualProgress for Manual<D> {
    fn pass(&mut self) -> bool {
        match self.driver.as_mut().map(Driver::pass) {
            Some(Pass::Busy) => true,
            Some(Pass::Idle) | None => false,
            Some(Pass::Stopped) => {
                self.stop();
                false
            }
        }
    }

    fn take(&mut self, sub: Submission) -> Option<Submission> {
        match self.driver.as_mut() {
            Some(driver) => driver.take(sub),
            None => Some(sub),
        }
    }

    fn post_unreported_imm(&mut self, dst: &RemoteTarget, imm: u32) -> bool {
        self.driver
            .as_mut()
            .is_some_and(|d| d.post_unreported_imm(dst, imm))
    }

    fn stop(&mut self) {
        if let Some(mut driver) = self.driver.take() {
            driver.group.shutdown();
            // The group and its NICs go first; then the group retires (as a worker thread's
            // RetireOnExit does when the thread ends).
            drop(driver);
        }
        drop(self.retire.take());
    }
}
