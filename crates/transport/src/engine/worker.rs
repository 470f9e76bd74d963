//! The worker thread of one domain group (paper 002 section 3.4). Each pass: take new
//! submissions first (their first work request is posted at once), then progress pending
//! posts, then poll completions in batches, then repost receive buffers. When a pass finds
//! nothing to do the worker spins briefly (to keep submit-to-post latency low under load) and
//! then, if its NICs allow it, parks until a submitter or a peer wakes it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};

use super::group::Group;
use super::message::{Command, Message};
use super::shared::WorkerWake;
use crate::domain::Domain;

/// Messages taken per pass, so completions are polled even under a flood of submissions.
const DRAIN: usize = 64;
/// Idle passes between looks at the clock (and yields of the core).
const IDLE_CHECK: u32 = 64;
/// Longest park: a safety net only; wake-ups normally come through `WorkerWake`.
const MAX_PARK: Duration = Duration::from_millis(20);

/// How a worker runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkerConfig {
    /// CPU core to pin the worker to.
    pub(crate) core: Option<usize>,
    /// How long an idle worker keeps polling before it parks.
    pub(crate) idle_spin: Duration,
}

/// Runs a worker until it is told to stop or its engine is dropped.
pub(crate) fn run<D: Domain>(
    mut group: Group<D>,
    rx: &Receiver<Message>,
    wake: &Arc<WorkerWake>,
    config: WorkerConfig,
) {
    wake.bind(std::thread::current());
    if let Some(core) = config.core
        && !core_affinity::set_for_current(core_affinity::CoreId { id: core })
    {
        tracing::warn!(core, "could not pin the worker; running unpinned");
    }
    let mut idle_since: Option<Instant> = None;
    let mut idle_passes: u32 = 0;
    loop {
        let mut busy = false;
        for _ in 0..DRAIN {
            match rx.try_recv() {
                Ok(Message::Transfer(sub)) => group.accept(sub),
                Ok(Message::Command(Command::Stop)) | Err(TryRecvError::Disconnected) => {
                    group.shutdown();
                    return;
                }
                Ok(Message::Command(c)) => group.command(c),
                Err(TryRecvError::Empty) => break,
            }
            busy = true;
        }
        busy |= group.progress();
        busy |= group.poll();
        busy |= group.repost_recvs();
        if busy {
            idle_since = None;
            idle_passes = 0;
            continue;
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
        if since.elapsed() < config.idle_spin || !group.may_park() {
            std::thread::yield_now();
            continue;
        }
        // Announce, look once more, then park: see WorkerWake for why no wake-up is lost.
        wake.announce_sleep();
        if !rx.is_empty() || group.poll() {
            wake.awake();
            idle_since = None;
            continue;
        }
        let timeout = group
            .next_deadline()
            .map_or(MAX_PARK, |d| d.saturating_duration_since(Instant::now()))
            .min(MAX_PARK);
        std::thread::park_timeout(timeout);
        wake.awake();
    }
}
