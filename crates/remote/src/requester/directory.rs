//! Following a directory: bringing the requester's holders in line with a view of it.
//! Sessions for new records are opened on threads of their own, side by side, so that
//! records whose holders never answer cost one wait together, not one each, and, with
//! [`Requester::sync_in_background`], none at all of the caller's steps.

use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute_kvstore::{ChunkId, DirectoryView};
use kvroute_transport::{NetAddr, TransferEngine};

use super::{Opened, Requester, connect_control, open_session_over};
use crate::error::RemoteError;

/// How long a registered holder whose session could not be opened is left alone before
/// [`Requester::sync_with`] tries it again; each further failure doubles it, up to
/// [`UNREACHABLE_LONGEST_WAIT`]. A record whose control address never answers then costs a
/// timeout now and then, not at every view.
pub const UNREACHABLE_FIRST_WAIT: Duration = Duration::from_secs(5);
/// See [`UNREACHABLE_FIRST_WAIT`].
pub const UNREACHABLE_LONGEST_WAIT: Duration = Duration::from_secs(60);

/// The most sessions a requester opens at once (one thread each, for at most a few
/// timeouts); a view with more new control addresses opens them in turns of this many.
const PARALLEL_OPENS: usize = 16;

/// A session being opened with the holder at `control`, on a thread of its own.
pub(super) struct Opening {
    control: SocketAddr,
    thread: JoinHandle<Result<Opened, RemoteError>>,
    state: Arc<Mutex<OpeningState>>,
}

/// What an opening thread and a requester being dropped share. The thread takes the engine
/// only once its control connection is made, recording a handle to it; a requester being
/// dropped takes the engine back from a thread still connecting (whoever takes it first has
/// it), and shuts the connection of one past it, which then fails at once. So no thread
/// keeps the engine (its endpoints, and their `shm` regions) past the requester's drop,
/// however slow a holder is to answer.
struct OpeningState {
    engine: Option<TransferEngine>,
    control: Option<TcpStream>,
}

impl Opening {
    /// Ends the opening for a requester being dropped: a thread still connecting is left
    /// to fail on its own without the engine; one past that is stopped and waited for.
    pub(super) fn cancel(self) {
        let engaged = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            drop(state.engine.take());
            match state.control.take() {
                Some(control) => {
                    let _ = control.shutdown(Shutdown::Both);
                    true
                }
                None => false,
            }
        };
        if engaged {
            // Whatever it opened is closed as it drops here.
            let _ = self.thread.join();
        }
    }
}

/// The engine for an opening thread whose control connection is `control`, recording a
/// handle to the connection; an error once the requester is being dropped.
fn engage(state: &Mutex<OpeningState>, control: &TcpStream) -> std::io::Result<TransferEngine> {
    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
    let handle = control.try_clone()?;
    let engine = state.engine.take().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "the requester was dropped while this session opened",
        )
    })?;
    state.control = Some(handle);
    Ok(engine)
}

/// What [`Requester::sync_with`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirectorySync {
    /// Holders connected: (index, control address).
    pub added: Vec<(usize, SocketAddr)>,
    /// Holders no longer registered, now unused: (index, control address).
    pub dropped: Vec<(usize, SocketAddr)>,
    /// Holders registered again while their session still works, used again.
    pub relisted: Vec<(usize, SocketAddr)>,
    /// Registered holders that could not be used, and why.
    pub failed: Vec<(SocketAddr, String)>,
    /// Control addresses whose sessions are still being opened (in the background; see
    /// [`Requester::sync_in_background`]).
    pub opening: Vec<SocketAddr>,
}

impl DirectorySync {
    /// Appends what `later` changed.
    fn extend(&mut self, later: Self) {
        self.added.extend(later.added);
        self.dropped.extend(later.dropped);
        self.relisted.extend(later.relisted);
        self.failed.extend(later.failed);
        self.opening = later.opening;
    }
}

impl Requester {
    /// Brings the holders in use in line with a directory's view: opens a session with
    /// every registered holder not yet connected ([`Requester::add_holder`]), stops choosing
    /// every one no longer registered (its lease expired or it left), and chooses again one
    /// that registers again while its session still works (the directory lost its data and
    /// the holder wrote its registration anew). A holder is the pair (control address, engine
    /// address), so a holder restarted on the same port is a new one.
    ///
    /// Records are taken by control address: one session is opened per address, kept only if
    /// some record of the address names the engine it proves (a session that no record names
    /// is closed before it takes a link), and every other record of the address is reported
    /// and not used, so that no record can hide another of the same address or spend the
    /// requester's links. Sessions with different addresses are opened side by side (up to
    /// 16 at once), and this call returns when every one has opened or failed: about one
    /// timeout however many records never answer. An address whose session cannot be opened
    /// is not tried again for [`UNREACHABLE_FIRST_WAIT`], doubling at each failure. Each
    /// chunk's replicas are then preferred in the view's order (ascending replica number).
    pub fn sync_with(&mut self, view: &DirectoryView) -> DirectorySync {
        self.follow_view(view, true)
    }

    /// [`Requester::sync_with`] without waiting for sessions to open: what the view changed
    /// in the holders already connected happens now, and the sessions it needs are opened on
    /// threads of their own, each joining the requester at the next
    /// [`Requester::poll_directory`] (or sync) after it opened. A decode loop calls this when
    /// a new view arrives and `poll_directory` before each step, so that no record, however
    /// slow its holder is to answer, costs a step its wait. A requester dropped while
    /// sessions are being opened stops them: a session past its connect fails at once and
    /// is waited for, and a thread still connecting finishes later on its own, without the
    /// engine. The engine thus goes with the requester, as it does without a directory.
    pub fn sync_in_background(&mut self, view: &DirectoryView) -> DirectorySync {
        self.follow_view(view, false)
    }

    /// Takes in the sessions opened since the last call (see
    /// [`Requester::sync_in_background`]) and starts those the last view still needs: cheap,
    /// and never waits on a holder.
    pub fn poll_directory(&mut self) -> DirectorySync {
        self.advance(false)
    }

    fn follow_view(&mut self, view: &DirectoryView, wait: bool) -> DirectorySync {
        let mut out = DirectorySync::default();
        self.follow_listings(view, &mut out);
        for r in view.holders.values() {
            let control = r.record.control;
            // A live session at that address proved another engine: the record is wrong, and
            // opening another session would only spend a link on it.
            if !self.links.iter().any(|l| l.serves(&r.record))
                && self.links.iter().any(|l| l.alive() && l.addr == control)
            {
                out.failed.push((
                    control,
                    "the session at its control address is another engine's than its record's"
                        .to_owned(),
                ));
            }
        }
        self.view = Some(Arc::new(view.clone()));
        out.extend(self.advance(wait));
        out
    }

    /// Takes in finished sessions (with `wait`, every one, waiting) and starts the ones the
    /// last view needs (with `wait`, until none is left to start).
    fn advance(&mut self, wait: bool) -> DirectorySync {
        let mut out = DirectorySync::default();
        let Some(view) = self.view.clone() else {
            return out;
        };
        loop {
            let mut i = 0;
            while i < self.opening.len() {
                if wait || self.opening[i].thread.is_finished() {
                    let Opening {
                        control, thread, ..
                    } = self.opening.swap_remove(i);
                    let opened = thread
                        .join()
                        .unwrap_or_else(|p| std::panic::resume_unwind(p));
                    self.take_opened(control, opened, &view, &mut out);
                } else {
                    i += 1;
                }
            }
            let started = self.start_openings(&view, &mut out);
            if !wait || (started == 0 && self.opening.is_empty()) {
                break;
            }
        }
        self.order_replicas(&view);
        out.opening = self.opening.iter().map(|o| o.control).collect();
        out
    }

    /// Ends the sessions whose holder closed its control connection (it stopped, or its
    /// process died: their room goes to the sessions the view needs), marks links whose
    /// holder left the view unlisted, and those back in it listed again.
    fn follow_listings(&mut self, view: &DirectoryView, out: &mut DirectorySync) {
        let closed: Vec<usize> = (0..self.links.len())
            .filter(|&h| self.links[h].control().and_then(super::closed).is_some())
            .collect();
        for h in closed {
            self.kill(h);
        }
        for (h, l) in self.links.iter_mut().enumerate() {
            let registered = view.holders.values().any(|r| l.serves(&r.record));
            if l.listed && !registered {
                l.listed = false;
                if l.alive() {
                    out.dropped.push((h, l.addr));
                }
            } else if !l.listed && registered {
                l.listed = true;
                if l.alive() {
                    out.relisted.push((h, l.addr));
                }
            }
        }
    }

    /// Starts a session with each control address of `view` that has a record no link serves,
    /// no live session, none being opened and no failure too recent, while room is left and
    /// fewer than [`PARALLEL_OPENS`] are being opened; returns how many it started. Sessions
    /// being opened do not hold links (most records that are slow to answer never will), so
    /// more may open than there is room for: those that open when none is left are closed
    /// ([`Requester::adopt`] refuses them).
    fn start_openings(&mut self, view: &Arc<DirectoryView>, out: &mut DirectorySync) -> usize {
        let now = Instant::now();
        let mut controls: Vec<SocketAddr> = view
            .holders
            .values()
            .map(|r| &r.record)
            .filter(|r| !self.links.iter().any(|l| l.serves(r)))
            .map(|r| r.control)
            .filter(|c| {
                !self.links.iter().any(|l| l.alive() && l.addr == *c)
                    && !self.opening.iter().any(|o| o.control == *c)
                    && self
                        .unreachable
                        .get(c)
                        .is_none_or(|&(until, _)| now >= until)
            })
            .collect();
        controls.sort_unstable();
        controls.dedup();
        let mut started = 0;
        for control in controls {
            if self.opening.len() >= PARALLEL_OPENS {
                break;
            }
            if self.links.iter().filter(|l| l.alive()).count() >= self.capacity {
                let full = RemoteError::Config(format!(
                    "no room for holder {control}: {} sessions working, the most this requester holds at once",
                    self.capacity
                ));
                self.back_off(control, full, out);
                continue;
            }

            let config = self.config.clone();
            let pool = self.pool_mem.desc().clone();
            let view = Arc::clone(view);
            let state = Arc::new(Mutex::new(OpeningState {
                engine: Some(self.engine.clone()),
                control: None,
            }));
            let shared = Arc::clone(&state);
            let thread = std::thread::Builder::new()
                .name("kvroute-open".into())
                .spawn(move || {
                    let listed = |engine: &NetAddr| {
                        view.holders
                            .values()
                            .any(|x| x.record.control == control && x.record.engine == *engine)
                    };
                    let stream = connect_control(control, config.timeout)?;
                    let engine =
                        engage(&shared, &stream).map_err(|source| RemoteError::Control {
                            peer: control,
                            source,
                        })?;
                    open_session_over(&engine, (stream, control), (&config, &pool), &listed)
                });
            match thread {
                Ok(thread) => {
                    self.opening.push(Opening {
                        control,
                        thread,
                        state,
                    });
                    started += 1;
                }
                Err(e) => {
                    let source = std::io::Error::new(
                        e.kind(),
                        format!("no thread to open a session on: {e}"),
                    );
                    self.back_off(
                        control,
                        RemoteError::Unreachable {
                            holder: control,
                            source,
                        },
                        out,
                    );
                }
            }
        }
        started
    }

    /// Makes the session opened with `control` a link and opens its data path, reporting
    /// each record of the address in `view` that it does not serve; or, when it failed,
    /// reports the failure and leaves the address alone for a while.
    fn take_opened(
        &mut self,
        control: SocketAddr,
        opened: Result<Opened, RemoteError>,
        view: &DirectoryView,
        out: &mut DirectorySync,
    ) {
        let linked = opened.and_then(|o| {
            let engine = o.welcome.holder.clone();
            let h = self.adopt(o)?;
            if let Err(e) = self.open_data_path(h) {
                self.kill(h);
                return Err(e);
            }
            Ok((h, engine))
        });
        match linked {
            Ok((h, engine)) => {
                self.unreachable.remove(&control);
                out.added.push((h, control));
                let others = view
                    .holders
                    .values()
                    .filter(|r| r.record.control == control && r.record.engine != engine);
                for _ in others {
                    out.failed.push((
                        control,
                        "its welcome names another engine address than its directory record"
                            .to_owned(),
                    ));
                }
            }
            Err(e) => self.back_off(control, e, out),
        }
    }

    /// Reports that `control` could not be used and leaves it alone for
    /// [`UNREACHABLE_FIRST_WAIT`], twice as long as last time if it failed before.
    fn back_off(&mut self, control: SocketAddr, why: RemoteError, out: &mut DirectorySync) {
        let wait = self
            .unreachable
            .get(&control)
            .map_or(UNREACHABLE_FIRST_WAIT, |&(_, w)| {
                (w * 2).min(UNREACHABLE_LONGEST_WAIT)
            });
        self.unreachable
            .insert(control, (Instant::now() + wait, wait));
        out.failed.push((control, why.to_string()));
    }

    /// Each chunk's replicas in the directory's order (ascending replica number), copies it
    /// does not offer last.
    fn order_replicas(&mut self, view: &DirectoryView) {
        let ids: Vec<ChunkId> = self.registry.ids().collect();
        for id in ids {
            let offered = view.registry.holders(id).unwrap_or_default();
            self.registry.reorder(id, |e| {
                offered
                    .iter()
                    .position(|o| o.holder == e.holder)
                    .unwrap_or(usize::MAX)
            });
        }
    }
}
