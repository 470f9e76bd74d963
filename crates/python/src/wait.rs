//! Long calls that Ctrl-C can interrupt: the work runs on a thread of its own while the
//! caller waits with the GIL released, checking Python's signals every 50 ms. An interrupted
//! call's work finishes in the background and its result is dropped.

use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

use pyo3::prelude::*;

use crate::errors::{Kind, error};

/// How often a waiting call checks for Ctrl-C.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Runs `f` on its own thread and waits for it with the GIL released; a signal handler that
/// raises (Ctrl-C: `KeyboardInterrupt`) ends the wait with its exception.
pub(crate) fn interruptible<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, mut rx) = channel();
    std::thread::Builder::new()
        .name("kvroute-call".into())
        .spawn(move || {
            // The receiver is gone when the caller was interrupted: the result is dropped.
            let _ = tx.send(f());
        })
        .map_err(|e| error(Kind::Other, format!("starting a thread: {e}")))?;
    loop {
        let waiting = &mut rx;
        match py.detach(move || waiting.recv_timeout(SIGNAL_CHECK)) {
            Ok(v) => return Ok(v),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(error(
                    Kind::Other,
                    "the call's thread stopped without an answer",
                ));
            }
        }
    }
}
