//! Waiting for a holder: for completion flags, with a deadline, while watching the holder's
//! control connection.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_transport::{DoneFlag, TransferEngine};

/// How often a wait on a holder looks at its control connection.
const CONTROL_LOOK: Duration = Duration::from_millis(1);

/// Why [`wait_all`] gave up.
#[derive(Debug)]
pub(crate) enum Unfinished {
    /// Flag `.0` (the first not set) was not set by the deadline.
    Late(usize),
    /// The holder's control connection closed or failed: its process ended, or it closed
    /// the session. What was awaited will not come.
    Closed(String),
}

impl Unfinished {
    /// Why the wait failed, in words: `awaited[i]` names flag `i`, `timeout` the wait's
    /// length.
    pub(crate) fn describe(self, awaited: &[&str], timeout: Duration) -> String {
        match self {
            Self::Late(i) => format!("no {} within {timeout:?}", awaited[i]),
            Self::Closed(why) => why,
        }
    }
}

/// Waits for every flag or the deadline. Polls (yielding the core) for `spin`, then parks
/// until a flag is set (each unparks this thread) or the next look at the control connection
/// is due; an engine progressed by its caller is progressed every 50 us instead. With
/// `control`, the holder's control connection is looked at every [`CONTROL_LOOK`] of
/// waiting, so a holder whose process died mid-request fails the wait at once rather than at
/// the deadline.
pub(crate) fn wait_all(
    engine: &TransferEngine,
    flags: &[&Arc<DoneFlag>],
    deadline: Instant,
    spin: Duration,
    control: Option<&TcpStream>,
) -> Result<(), Unfinished> {
    let started = Instant::now();
    let mut next_look = started + CONTROL_LOOK;
    let mut parking = false;
    let manual = engine.manual_progress();
    loop {
        let Some(pending) = flags.iter().position(|f| !f.is_done()) else {
            return Ok(());
        };
        let now = Instant::now();
        if now > deadline {
            return Err(Unfinished::Late(pending));
        }
        if let Some(stream) = control
            && now >= next_look
        {
            next_look = now + CONTROL_LOOK;
            if let Some(why) = closed(stream) {
                return Err(Unfinished::Closed(why));
            }
        }
        if manual {
            engine.progress();
        }
        if now.duration_since(started) < spin {
            std::thread::yield_now();
        } else if manual {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            if !parking {
                parking = true;
                let me = std::thread::current();
                for flag in flags {
                    flag.wake_when_set(me.clone());
                }
            }
            let until = if control.is_some() {
                next_look.min(deadline)
            } else {
                deadline
            };
            std::thread::park_timeout(until.saturating_duration_since(now));
        }
    }
}

/// Whether the other end closed `stream`, or the socket failed: a look that takes nothing
/// from it (bytes waiting, or none yet, mean it is open). The socket is non-blocking only
/// for the look.
pub(super) fn closed(stream: &TcpStream) -> Option<String> {
    use std::io::ErrorKind::{Interrupted, WouldBlock};
    let look = stream
        .set_nonblocking(true)
        .and_then(|()| stream.peek(&mut [0u8; 1]));
    let restored = stream.set_nonblocking(false);
    match (look, restored) {
        (Ok(0), _) => Some("the holder closed its control connection".to_owned()),
        (Err(e), _) if !matches!(e.kind(), WouldBlock | Interrupted) => {
            Some(format!("control connection: {e}"))
        }
        (_, Err(e)) => Some(format!("control connection: {e}")),
        _ => None,
    }
}
