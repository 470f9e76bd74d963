//! `--metrics-listen`: a process's metrics on a plain `/metrics` page in Prometheus' text
//! format. The library crates report through the `metrics` facade; this installs the
//! Prometheus recorder for the process and serves what it renders, one connection at a time
//! (a scrape is a few kilobytes), each bounded by a 2 s deadline and an 8 KiB request.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Histogram buckets of the `_seconds` metrics: 10 us to 10 s.
const SECONDS: [f64; 13] = [
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0,
];
/// Buckets of predicted-over-measured ratios.
const RATIO: [f64; 9] = [0.25, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 4.0];

/// Installs the process's recorder and serves `/metrics` on `addr` from a thread of its
/// own; returns the address it listens on.
pub(crate) fn serve(addr: &str) -> Result<SocketAddr> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("kvroute_selector_predicted_over_measured".into()),
                &RATIO,
            )
        })
        .context("--metrics-listen: histogram buckets")?
        .install_recorder()
        .context("--metrics-listen: installing the metrics recorder")?;
    kvroute_transport::describe_metrics();
    kvroute_transport::time_transfers();
    kvroute_remote::observe::describe_metrics();
    kvroute_kvstore::observe::describe_metrics();
    let listener = TcpListener::bind(addr).with_context(|| format!("--metrics-listen {addr}"))?;
    let local = listener.local_addr()?;
    tracing::info!(%local, "metrics at http://{local}/metrics");
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(e) = answer(stream, &handle) {
                    tracing::debug!(%e, "a /metrics request");
                }
            }
        })
        .context("starting the /metrics thread")?;
    Ok(local)
}

/// Reads one request (its head, at most 8 KiB, within 2 s) and answers it: the rendered
/// metrics for `GET /metrics`, 404 for any other path, 400 for anything else.
fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf)? {
            0 => break,
            n => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next(), parts.next());
    let (status, body) = match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => {
            // The transport's counters are read now, not reported as they change.
            kvroute_transport::export_metrics();
            ("200 OK", handle.render())
        }
        (Some(b"GET"), Some(_)) => ("404 Not Found", "not found: try /metrics\n".to_owned()),
        _ => ("400 Bad Request", "bad request\n".to_owned()),
    };
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    Ok(())
}
