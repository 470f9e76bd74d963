//! The holder's control plane: one thread serves the listener and every rendezvous
//! connection, non-blocking, woken by `poll(2)`. A connection costs a socket and a few
//! buffers, never a thread: [`super::HolderConfig::max_connections`] bounds them, a
//! connection that sends no hello within [`super::HolderConfig::hello_timeout`] is closed,
//! and one that leaves more than [`OUT_LIMIT`] of answers unread is closed too.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_transport::NetAddr;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::{PROOF_FAILED, PROOF_OK, PROOF_PENDING, Session, Shared, check_hello, lock, new_token};
use crate::error::RemoteError;
use crate::observe::SessionEvent;
use crate::session::{Ack, Answer, Control, Hello, Welcome};

/// Longest hello line (its descriptors are small).
const HELLO_LIMIT: usize = 1 << 20;
/// Longest control line after the hello.
const LINE_LIMIT: usize = 1 << 16;
/// Answer bytes a connection may leave unread (a welcome listing many chunks is the largest
/// answer) before it is closed.
const OUT_LIMIT: usize = 64 << 20;
/// Longest sleep in `poll`: how often the loop looks at the stop flag and at sessions past
/// their `open_timeout`.
const TICK: Duration = Duration::from_millis(50);

/// Where a connection is in the rendezvous.
enum Phase {
    /// Waiting for its hello until the deadline.
    Hello { deadline: Instant },
    /// A granted session: released when the connection ends.
    Session { slot: usize, session: Session },
    /// Answered busy or refused: closed once the answer is out.
    Closing,
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    /// When it was accepted: the oldest makes room first.
    opened: Instant,
    phase: Phase,
    /// Bytes read and not yet a whole line.
    input: Vec<u8>,
    /// Answer bytes not yet written, from `sent` on.
    output: Vec<u8>,
    sent: usize,
    /// Until when the session's proof is waited for, once the requester asked
    /// ([`Control::Prove`]).
    proving: Option<Instant>,
}

impl Conn {
    /// Queues `msg` as one JSON line.
    fn answer<T: serde::Serialize>(&mut self, msg: &T) -> Result<(), RemoteError> {
        let line = serde_json::to_vec(msg).map_err(|e| RemoteError::MalformedControl {
            peer: self.peer,
            why: format!("encoding: {e}"),
        })?;
        self.output.extend_from_slice(&line);
        self.output.push(b'\n');
        Ok(())
    }

    /// Writes what the socket takes now; false once the peer has left more than
    /// [`OUT_LIMIT`] unread or the socket failed.
    fn flush(&mut self) -> bool {
        while self.sent < self.output.len() {
            match self.stream.write(&self.output[self.sent..]) {
                Ok(0) => return false,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        if self.sent == self.output.len() {
            self.output.clear();
            self.sent = 0;
        }
        self.output.len() - self.sent <= OUT_LIMIT
    }

    fn wants_write(&self) -> bool {
        self.sent < self.output.len()
    }

    /// How readily it gives its place to a newcomer: a connection that has not said hello
    /// first, then a session that has not proven its address; `None` for a proven session
    /// or one already closing.
    fn yields(&self) -> Option<u8> {
        match &self.phase {
            Phase::Hello { .. } => Some(0),
            Phase::Session { session, .. } if !session.proven() => Some(1),
            _ => None,
        }
    }
}

/// The index of the connection of `conns` (among those `of` accepts) that gives its place to
/// a newcomer first: the most yielding, oldest first.
fn yielding(conns: &[Conn], of: impl Fn(&Conn) -> bool) -> Option<usize> {
    conns
        .iter()
        .enumerate()
        .filter(|(_, c)| of(c))
        .filter_map(|(i, c)| Some((c.yields()?, c.opened, i)))
        .min()
        .map(|(.., i)| i)
}

impl Shared {
    /// The control thread: accepts connections, reads hellos and control lines, answers them,
    /// and releases each session when its connection ends, until the holder stops.
    pub(super) fn control(self: &Arc<Self>, listener: &TcpListener) {
        let mut conns: Vec<Conn> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            self.close_unopened();
            let now = Instant::now();
            let wait = conns
                .iter()
                .filter_map(|c| match (&c.phase, c.proving) {
                    // A proof lands through the transport, not a socket: look often.
                    (_, Some(_)) => Some(Duration::from_millis(1)),
                    (Phase::Hello { deadline }, _) => Some(deadline.saturating_duration_since(now)),
                    _ => None,
                })
                .fold(TICK, Duration::min);
            let Some(revents) = poll_ready(listener, &conns, wait) else {
                continue;
            };
            self.take_proofs();
            let now = Instant::now();
            let mut i = 0;
            conns.retain_mut(|c| {
                i += 1;
                let keep = self.drive(c, revents[i], now);
                if !keep {
                    self.end(c);
                }
                keep
            });
            if revents[0].contains(PollFlags::POLLIN) {
                self.accept_ready(listener, &mut conns);
            }
        }
        for c in &mut conns {
            self.end(c);
        }
    }

    /// Takes every pending connection. One past `max_per_source` from its address, or past
    /// `max_connections`, takes the place of the connection that yields first (see
    /// `Conn::yields`: of its own address, or of any when the holder is full); with none
    /// to yield it is closed at once, unread.
    fn accept_ready(&self, listener: &TcpListener, conns: &mut Vec<Conn>) {
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    let same = |c: &Conn| c.peer.ip() == peer.ip();
                    let room =
                        if conns.iter().filter(|c| same(c)).count() >= self.config.max_per_source {
                            yielding(conns, same)
                        } else if conns.len() >= self.config.max_connections {
                            yielding(conns, |_| true)
                        } else {
                            None
                        };
                    let full = conns.iter().filter(|c| same(c)).count()
                        >= self.config.max_per_source
                        || conns.len() >= self.config.max_connections;
                    match (full, room) {
                        (false, _) => {}
                        (true, Some(i)) => {
                            let mut gone = conns.swap_remove(i);
                            self.end(&mut gone);
                            self.session_event(SessionEvent::Evicted);
                        }
                        (true, None) => {
                            self.session_event(SessionEvent::Busy);
                            continue;
                        }
                    }
                    let ready = stream
                        .set_nonblocking(true)
                        .and_then(|()| stream.set_nodelay(true));
                    if let Err(e) = ready {
                        tracing::debug!(%e, %peer, "setting up a control connection");
                        continue;
                    }
                    conns.push(Conn {
                        stream,
                        peer,
                        opened: Instant::now(),
                        phase: Phase::Hello {
                            deadline: Instant::now() + self.config.hello_timeout,
                        },
                        input: Vec::new(),
                        output: Vec::new(),
                        sent: 0,
                        proving: None,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors, most likely: leave the rest queued for later.
                    tracing::warn!(%e, "accept failed");
                    return;
                }
            }
        }
    }

    /// Handles what `poll` reported for `c`; false when the connection is done.
    fn drive(&self, c: &mut Conn, revents: PollFlags, now: Instant) -> bool {
        if revents.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR)
            && !self.read_lines(c)
        {
            return false;
        }
        self.answer_proof(c, now);
        if !c.flush() {
            return false;
        }
        match c.phase {
            // A connection that sends no hello in time is closed.
            Phase::Hello { deadline } => now < deadline,
            Phase::Closing => c.wants_write(),
            Phase::Session { .. } => true,
        }
    }

    /// Marks each session whose proof message came from its hello's address as proven, and
    /// one whose proof came from anywhere else (another engine claiming the address) as
    /// failed; a proof naming no session counts as refused. A session's proof is taken once.
    fn take_proofs(&self) {
        while let Ok((slot, token, from)) = self.proofs.try_recv() {
            let sessions = lock(&self.sessions);
            let session = sessions
                .get(usize::from(slot))
                .and_then(Option::as_ref)
                .filter(|s| s.token == token);
            let Some(s) = session else {
                drop(sessions);
                self.session_event(SessionEvent::Refused);
                continue;
            };
            let outcome = if from.as_ref() == Some(&s.hello.addr) {
                PROOF_OK
            } else {
                tracing::debug!(slot, ?from, "a proof from another address than the hello's");
                PROOF_FAILED
            };
            let _ = s.proof.compare_exchange(
                PROOF_PENDING,
                outcome,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    /// Answers a session's [`Control::Prove`] once its proof is in, or, past the deadline,
    /// refuses and closes it: an engine that cannot prove the hello's address is its own
    /// never has anything written to it.
    fn answer_proof(&self, c: &mut Conn, now: Instant) {
        let (Some(deadline), Phase::Session { session, .. }) = (c.proving, &c.phase) else {
            return;
        };
        let proof = session.proof.load(Ordering::Acquire);
        if proof == PROOF_PENDING && now < deadline {
            return;
        }
        let proven = proof == PROOF_OK;
        c.proving = None;
        let _ = c.answer(&Ack { ok: proven });
        if !proven {
            self.session_event(SessionEvent::Refused);
            self.end(c);
        }
    }

    /// Reads what has arrived and handles each whole line; false when the peer closed, the
    /// socket failed or a line is too long.
    fn read_lines(&self, c: &mut Conn) -> bool {
        let mut chunk = [0u8; 16 << 10];
        let mut open = true;
        loop {
            match c.stream.read(&mut chunk) {
                Ok(0) => {
                    open = false;
                    break;
                }
                Ok(n) => c.input.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
            if c.input.len() > HELLO_LIMIT + LINE_LIMIT {
                break;
            }
        }
        let mut start = 0;
        while let Some(len) = c.input[start..].iter().position(|&b| b == b'\n') {
            let line = std::mem::take(&mut c.input);
            let handled = self.line(c, &line[start..start + len]);
            c.input = line;
            start += len + 1;
            if let Err(e) = handled {
                tracing::debug!(%e, peer = %c.peer, "control connection ended");
                return false;
            }
        }
        c.input.drain(..start);
        let limit = match c.phase {
            Phase::Hello { .. } => HELLO_LIMIT,
            _ => LINE_LIMIT,
        };
        if c.input.len() > limit {
            // A peer that sends a line longer than any this protocol has is cut off.
            if matches!(c.phase, Phase::Hello { .. }) {
                let _ = c.answer(&Answer::Refused("a hello longer than 1 MiB".into()));
                c.phase = Phase::Closing;
                c.input.clear();
                return c.flush();
            }
            return false;
        }
        open
    }

    /// One line of `c`.
    fn line(&self, c: &mut Conn, line: &[u8]) -> Result<(), RemoteError> {
        match &c.phase {
            Phase::Hello { .. } => match serde_json::from_slice::<Hello>(line) {
                Ok(hello) => self.hello(c, hello)?,
                Err(e) => {
                    c.phase = Phase::Closing;
                    c.answer(&Answer::Refused(format!("malformed hello: {e}")))?;
                }
            },
            Phase::Session { session, .. } => {
                let requester = session.hello.addr.clone();
                match serde_json::from_slice::<Control>(line) {
                    // Nothing but the welcome is answered before the proof.
                    Ok(Control::Stats) if !session.proven() => {
                        self.session_event(SessionEvent::Refused);
                    }
                    Ok(Control::Stats) => c.answer(&self.stats())?,
                    Ok(Control::Sender(sender)) => {
                        let adopted = self.engine.adopt_sender(&requester, &sender);
                        if let Err(e) = &adopted {
                            self.session_event(SessionEvent::Refused);
                            tracing::debug!(%e, "refusing a requester's sending address");
                        }
                        c.answer(&Ack {
                            ok: adopted.is_ok(),
                        })?;
                    }
                    Ok(Control::Prove) => {
                        c.proving
                            .get_or_insert(Instant::now() + self.config.hello_timeout);
                    }
                    Err(e) => tracing::debug!(%e, "ignoring a malformed control line"),
                }
            }
            Phase::Closing => {}
        }
        Ok(())
    }

    /// Answers a hello: refused or busy (then `c` closes once the answer is out), or a
    /// session in a slot of its own (`c` holds it from then on, so however `c` ends, `end`
    /// frees the slot).
    fn hello(&self, c: &mut Conn, hello: Hello) -> Result<(), RemoteError> {
        c.phase = Phase::Closing;
        // Connected now, so that the transport can name the requester as the sender of its
        // proof message.
        let checked = check_hello(&hello)
            .and_then(|()| self.engine.connect(&hello.addr).map_err(|e| e.to_string()));
        if let Err(why) = checked {
            self.session_event(SessionEvent::Refused);
            return c.answer(&Answer::Refused(why));
        }
        let token = new_token()?;
        // Registered before the slot is taken; dropped unused if the holder is busy.
        let inbox = Arc::new(self.engine.alloc_mr(self.config.slot_bytes)?);
        let control = c
            .stream
            .try_clone()
            .map_err(|source| RemoteError::Control {
                peer: c.peer,
                source,
            })?;
        let session = Session {
            hello: hello.clone(),
            token,
            next_seq: Arc::new(AtomicU64::new(0)),
            inbox,
            granted: Instant::now(),
            last_used_us: Arc::new(AtomicU64::new(0)),
            last_request_us: Arc::new(AtomicU64::new(0)),
            control: Arc::new(control),
            closing: Arc::new(AtomicBool::new(false)),
            posting: Arc::new(Mutex::new(())),
            proof: Arc::new(AtomicU8::new(PROOF_PENDING)),
        };
        let inbox = session.inbox.desc().clone();
        let slot = {
            let mut sessions = lock(&self.sessions);
            match self.free_slot(&sessions) {
                Some(i) => {
                    sessions[i] = Some(session.clone());
                    crate::observe::holder_session(SessionEvent::Opened);
                    crate::observe::holder_active(sessions.iter().flatten().count());
                    i
                }
                None => {
                    let cap = sessions.len();
                    let in_use = address_in_use(&sessions, &hello.addr);
                    drop(sessions);
                    if !in_use {
                        self.release_peer(&hello.addr);
                    }
                    self.session_event(SessionEvent::Busy);
                    return c.answer(&Answer::Busy { active: cap, cap });
                }
            }
        };
        let config = &self.config;
        let welcome = Welcome {
            session: slot as u16,
            token,
            holder: self.engine.main_address(),
            inbox,
            slot_offset: 0,
            slot_bytes: config.slot_bytes as u64,
            reply_bytes: config.reply_bytes as u64,
            gather_bytes: config.gather_bytes as u64,
            chunks: self.entries.clone(),
        };
        c.phase = Phase::Session { slot, session };
        c.answer(&Answer::Welcome(welcome))
    }

    /// A connection is done: a session's slot is freed (unless it has passed to another
    /// session meanwhile: this one was evicted), and the requester's engine is released in
    /// the transport if no other session has it, so a holder that many requesters came and
    /// went to keeps no endpoint, address entry or mapping for them.
    fn end(&self, c: &mut Conn) {
        let Phase::Session { slot, session } = std::mem::replace(&mut c.phase, Phase::Closing)
        else {
            return;
        };
        session.stop_posting();
        let still_used = {
            let mut sessions = lock(&self.sessions);
            if sessions[slot]
                .as_ref()
                .is_some_and(|s| s.token == session.token)
            {
                sessions[slot] = None;
            }
            crate::observe::holder_active(sessions.iter().flatten().count());
            address_in_use(&sessions, &session.hello.addr)
        };
        if !still_used {
            self.release_peer(&session.hello.addr);
        }
    }

    fn release_peer(&self, peer: &NetAddr) {
        if let Err(e) = self.engine.disconnect(peer) {
            tracing::debug!(%e, "releasing a requester's engine");
        }
    }
}

/// Whether a session of `sessions` is of the engine at `addr` (then its engine stays connected).
fn address_in_use(sessions: &[Option<Session>], addr: &NetAddr) -> bool {
    sessions.iter().flatten().any(|s| s.hello.addr == *addr)
}

/// Waits up to `wait` (at least 1 ms) for the listener to take a connection or a connection
/// to read (or write, where it has output waiting); what happened to each, the listener
/// first. `None` where the poll failed (after a short pause, unless a signal interrupted it).
fn poll_ready(listener: &TcpListener, conns: &[Conn], wait: Duration) -> Option<Vec<PollFlags>> {
    let mut fds = Vec::with_capacity(conns.len() + 1);
    fds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
    for c in conns {
        let write = if c.wants_write() {
            PollFlags::POLLOUT
        } else {
            PollFlags::empty()
        };
        fds.push(PollFd::new(c.stream.as_fd(), PollFlags::POLLIN | write));
    }
    let timeout =
        PollTimeout::try_from(wait.max(Duration::from_millis(1))).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, timeout) {
        Ok(_) => Some(
            fds.iter()
                .map(|f| f.revents().unwrap_or(PollFlags::empty()))
                .collect(),
        ),
        Err(e) => {
            if e != nix::errno::Errno::EINTR {
                tracing::warn!(%e, "poll failed");
                std::thread::sleep(Duration::from_millis(5));
            }
            None
        }
    }
}
