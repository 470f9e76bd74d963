//! What the CLI's process tests share: running the built binary with a deadline.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs the built `kvroute` with `args`, killed (and the test failed) past `hang`: its exit
/// status, the first JSON document it printed (a failed run prints its report, then the
/// error object), and everything it printed.
pub(crate) fn kvroute(args: &[&str], hang: Duration) -> (bool, serde_json::Value, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running kvroute {args:?}: {e}"));
    // Drained on threads so a chatty run cannot block on a full pipe.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut text);
            }
            text
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => panic!("waiting for kvroute {args:?}: {e}"),
        }
        if started.elapsed() > hang {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvroute {args:?} hung for {hang:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    let json = serde_json::Deserializer::from_str(&stdout)
        .into_iter::<serde_json::Value>()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    (status.success(), json, format!("{stdout}\n{stderr}"))
}
