//! A hang is a failure, not a stuck CI job: [`Watchdog`] ends the test process with a message
//! if a test is still running past its limit (for example when a provider call never returns,
//! which no timeout inside the test can catch).

use std::sync::mpsc::{Sender, channel};
use std::time::Duration;

/// Exits the process (status 101, as a failed test) if not dropped within its limit.
#[derive(Debug)]
pub struct Watchdog {
    // Dropping the sender disarms the watchdog.
    _disarm: Sender<()>,
}

impl Watchdog {
    /// Arms a watchdog for `what`.
    pub fn arm(what: &str, limit: Duration) -> Self {
        let (disarm, armed) = channel::<()>();
        let what = what.to_owned();
        std::thread::spawn(move || {
            if armed.recv_timeout(limit) == Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                eprintln!("watchdog: {what} still running after {limit:?}; failing the test run");
                std::process::exit(101);
            }
        });
        Self { _disarm: disarm }
    }
}
