//! A requester that finds its holders in a directory: it connects to every holder registered,
//! connects to holders that register later, stops using holders whose registration goes (a
//! clean stop, or a lease that expired after a crash), keeps its last view while the
//! directory cannot be reached and says so, and waits for a chunk that no live holder serves.
//! Every change is logged with its time and step, and each holder's use is counted, with the
//! time from its start of service to its session and to the first route or fetch it served.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvroute_kvstore::directory::{Directory, DirectoryView, Watch, unix_ms};
use kvroute_kvstore::{ChunkId, directory};
use kvroute_remote::{DirectorySync, Requester};
use serde::Serialize;

/// One change the requester saw in the directory, or made because of it.
#[derive(Debug, Clone, Serialize)]
pub struct DirectoryEvent {
    /// Milliseconds since the requester opened the directory.
    pub at_ms: u64,
    /// The decode step it was seen before (0 before the first).
    pub step: u32,
    /// What happened.
    pub what: String,
}

/// How one holder found in the directory was used.
#[derive(Debug, Clone, Serialize)]
pub struct HolderUse {
    /// Its index among the requester's holders.
    pub index: usize,
    /// Its control address.
    pub addr: String,
    /// Chunks it registered.
    pub chunks: Vec<u32>,
    /// When its process started and when it began serving (its record), Unix ms.
    pub started_unix_ms: u64,
    /// When it began serving, Unix ms.
    pub serving_unix_ms: u64,
    /// When the directory's watch published the view through which this requester found it
    /// (the newest when the requester looked), Unix ms.
    pub delivered_unix_ms: u64,
    /// When this requester applied that view, Unix ms (views are applied between decode
    /// steps).
    pub seen_unix_ms: u64,
    /// When this requester had a session with it, Unix ms.
    pub connected_unix_ms: u64,
    /// When it first served this requester a route or a fetch, Unix ms.
    pub first_served_unix_ms: Option<u64>,
    /// Routes and fetches it served this requester.
    pub served: u64,
    /// When this requester stopped using it, Unix ms, and why.
    pub dropped: Option<(u64, String)>,
    /// When its registration was seen gone from the directory (revoked, or its lease
    /// expired), Unix ms.
    pub unregistered_unix_ms: Option<u64>,
}

impl HolderUse {
    /// Milliseconds from its start of service to its session with this requester.
    pub fn discovered_after_ms(&self) -> i64 {
        self.connected_unix_ms as i64 - self.serving_unix_ms as i64
    }

    /// Milliseconds from its start of service to the first route or fetch it served.
    pub fn first_served_after_ms(&self) -> Option<i64> {
        self.first_served_unix_ms
            .map(|t| t as i64 - self.serving_unix_ms as i64)
    }
}

/// The directory's part of a run's report.
#[derive(Debug, Clone, Serialize)]
pub struct DirectoryReport {
    /// Where the directory is.
    pub directory: String,
    /// Every change, in order.
    pub events: Vec<DirectoryEvent>,
    /// Every holder found there.
    pub holders: Vec<HolderUse>,
    /// Entries the directory held that were skipped as malformed (the last view's).
    pub skipped: Vec<String>,
}

impl fmt::Display for DirectoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "directory {}:", self.directory)?;
        for e in &self.events {
            writeln!(f, "  {:>7} ms, before step {}: {}", e.at_ms, e.step, e.what)?;
        }
        for h in &self.holders {
            let first = h
                .first_served_after_ms()
                .map_or_else(|| "never".to_owned(), |ms| format!("{ms} ms"));
            writeln!(
                f,
                "  holder {} ({}), chunks {:?}: session {} ms after it began serving, first served {first}, served {}{}",
                h.index,
                h.addr,
                h.chunks,
                h.discovered_after_ms(),
                h.served,
                h.dropped
                    .as_ref()
                    .map_or_else(String::new, |(_, why)| format!(", dropped: {why}")),
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "  skipped entry: {s}")?;
        }
        Ok(())
    }
}

/// The requester's side of a directory.
pub(super) struct Follower {
    /// Kept open: the watch's follower talks through it.
    _dir: Arc<dyn Directory>,
    watch: Watch,
    applied: u64,
    stale: bool,
    opened: Instant,
    wait: Duration,
    /// When the last view applied was published and when it was applied, Unix ms.
    seen: (u64, u64),
    pub(super) report: DirectoryReport,
}

impl Follower {
    /// Opens the directory at `url` and its watch.
    pub(super) fn open(url: &str, ttl: Duration, wait: Duration) -> Result<Self> {
        let dir = directory::open(url, ttl)?;
        let watch = dir
            .watch()
            .with_context(|| format!("watching {}", dir.describe()))?;
        Ok(Self {
            report: DirectoryReport {
                directory: dir.describe(),
                events: Vec::new(),
                holders: Vec::new(),
                skipped: Vec::new(),
            },
            _dir: dir,
            watch,
            applied: 0,
            stale: false,
            opened: Instant::now(),
            wait,
            seen: (0, 0),
        })
    }

    fn event(&mut self, step: u32, what: String) {
        tracing::info!(step, %what, "directory");
        self.report.events.push(DirectoryEvent {
            at_ms: self.opened.elapsed().as_millis() as u64,
            step,
            what,
        });
    }

    /// Applies the newest view to `req` if it changed since the last one applied.
    pub(super) fn apply(&mut self, req: &mut Requester, step: u32) {
        let Some(state) = self.watch.current() else {
            return;
        };
        if state.generation == self.applied {
            return;
        }
        self.applied = state.generation;
        match (&state.stale, self.stale) {
            (Some(why), false) => {
                self.stale = true;
                self.event(
                    step,
                    format!("directory unreachable ({why}): keeping the last view"),
                );
                return;
            }
            (Some(_), true) => return,
            (None, true) => {
                self.stale = false;
                self.event(step, "directory reachable again".to_owned());
            }
            (None, false) => {}
        }
        self.sync(req, &state.view, state.published_unix_ms, step)
    }

    fn sync(&mut self, req: &mut Requester, view: &DirectoryView, delivered: u64, step: u32) {
        if view.skipped != self.report.skipped {
            for s in view
                .skipped
                .iter()
                .filter(|s| !self.report.skipped.contains(s))
            {
                tracing::warn!(entry = %s, "directory entry skipped");
            }
            self.report.skipped.clone_from(&view.skipped);
        }
        self.seen = (delivered, unix_ms());
        let sync = req.sync_in_background(view);
        self.report_sync(view, &sync, step);
    }

    /// Takes in the sessions opened in the background since the last look (never waits on
    /// a holder: a record whose holder does not answer costs no step its wait).
    pub(super) fn poll(&mut self, req: &mut Requester, step: u32) {
        let sync = req.poll_directory();
        if sync.added.is_empty() && sync.failed.is_empty() {
            return;
        }
        if let Some(state) = self.watch.current() {
            self.report_sync(&state.view, &sync, step);
        }
    }

    /// Logs and records what applying a view, or a session it needed, changed.
    fn report_sync(&mut self, view: &DirectoryView, sync: &DirectorySync, step: u32) {
        let (delivered, seen) = self.seen;
        let now = unix_ms();
        let mut gone = Vec::new();
        for u in &mut self.report.holders {
            let registered = view
                .holders
                .values()
                .any(|r| r.record.control.to_string() == u.addr);
            if !registered && u.unregistered_unix_ms.is_none() {
                u.unregistered_unix_ms = Some(now);
                gone.push((u.index, u.addr.clone()));
            }
        }
        for (h, addr) in gone {
            self.event(
                step,
                format!("holder {h} ({addr}): registration gone from the directory"),
            );
        }
        for &(h, addr) in &sync.dropped {
            if let Some(u) = self.report.holders.iter_mut().find(|u| u.index == h) {
                u.dropped = Some((now, "its registration is gone".to_owned()));
            }
            self.event(
                step,
                format!("holder {h} ({addr}) no longer registered: not used from now on"),
            );
        }
        for &(h, addr) in &sync.added {
            let record = view.holders.values().find(|r| r.record.control == addr);
            let (started, serving, chunks) = record.map_or((0, 0, Vec::new()), |r| {
                (
                    r.record.started_unix_ms,
                    r.record.serving_unix_ms,
                    r.chunks.iter().map(|(c, _)| c.0).collect(),
                )
            });
            self.report.holders.push(HolderUse {
                index: h,
                addr: addr.to_string(),
                chunks: chunks.clone(),
                started_unix_ms: started,
                serving_unix_ms: serving,
                delivered_unix_ms: delivered,
                seen_unix_ms: seen,
                connected_unix_ms: now,
                first_served_unix_ms: None,
                served: 0,
                dropped: None,
                unregistered_unix_ms: None,
            });
            self.event(
                step,
                format!(
                    "holder {h} ({addr}) joined with chunks {chunks:?}: in a view {} ms, applied {} ms, session open {} ms after it began serving",
                    delivered as i64 - serving as i64,
                    seen as i64 - serving as i64,
                    now as i64 - serving as i64
                ),
            );
        }
        for &(h, addr) in &sync.relisted {
            if let Some(u) = self.report.holders.iter_mut().find(|u| u.index == h) {
                u.dropped = None;
                u.unregistered_unix_ms = None;
            }
            self.event(
                step,
                format!("holder {h} ({addr}) registered again: used again"),
            );
        }
        for (addr, why) in &sync.failed {
            self.event(step, format!("registered holder {addr} not used: {why}"));
        }
    }

    /// Notes that holder `h` served a route or a fetch.
    pub(super) fn served(&mut self, h: usize) {
        if let Some(u) = self.report.holders.iter_mut().find(|u| u.index == h) {
            u.served += 1;
            u.first_served_unix_ms.get_or_insert_with(unix_ms);
        }
    }

    /// Notes that holder `h` was found dead by other means than the directory (its control
    /// connection, or a failed route or fetch); the first such note stands.
    pub(super) fn dead(&mut self, h: usize, why: &str) {
        if let Some(u) = self.report.holders.iter_mut().find(|u| u.index == h)
            && u.dropped.is_none()
        {
            u.dropped = Some((unix_ms(), why.to_owned()));
        }
    }

    /// Waits `d`, applying every view that arrives meanwhile as it arrives.
    pub(super) fn pause(&mut self, req: &mut Requester, d: Duration, step: u32) {
        let deadline = Instant::now() + d;
        loop {
            self.apply(req, step);
            self.poll(req, step);
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            self.watch.wait_newer(self.applied, left);
        }
    }

    /// Applies views until every one of `chunks` chunks has a live holder, or fails after
    /// the configured wait naming the chunks still missing.
    pub(super) fn await_chunks(
        &mut self,
        req: &mut Requester,
        chunks: u32,
        step: u32,
    ) -> Result<()> {
        let deadline = Instant::now() + self.wait;
        let mut waited = false;
        loop {
            self.apply(req, step);
            self.poll(req, step);
            let missing: Vec<u32> = (0..chunks)
                .filter(|&c| req.live_replicas(ChunkId(c)).is_empty())
                .collect();
            if missing.is_empty() {
                if waited {
                    self.event(step, "every chunk has a live holder".to_owned());
                }
                return Ok(());
            }
            if !waited {
                self.event(step, format!("waiting for a holder of chunks {missing:?}"));
                waited = true;
            }
            if Instant::now() >= deadline {
                bail!(
                    "no live holder of chunks {missing:?} in {} after {:?}",
                    self.report.directory,
                    self.wait
                );
            }
            self.watch
                .wait_newer(self.applied, Duration::from_millis(100));
        }
    }
}
