//! `--metrics-listen`: a holder process serves Prometheus' text format at `/metrics`, and
//! what it says it served agrees with the counters its requester read from it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

/// `GET path` from `addr`: the status line and the body.
fn get(addr: &str, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// The value of the sample of `name` whose labels contain `labels` (summed over the others).
fn sample(body: &str, name: &str, labels: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_holders_metrics_page_counts_what_its_requester_saw_it_serve() {
    let exe = env!("CARGO_BIN_EXE_kvroute");
    let mut holder = Command::new(exe)
        .args([
            "holder",
            "--provider",
            "tcp",
            "--chunks",
            "0",
            "--tokens",
            "64",
        ])
        .args(["--doc-chunks", "1", "--lifeline", "stdin"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let (control, metrics) = (
        v["listen"].as_str().unwrap().to_owned(),
        v["metrics"].as_str().unwrap().to_owned(),
    );
    let out = Command::new(exe)
        .args([
            "--json",
            "requester",
            "--provider",
            "tcp",
            "--holders",
            &control,
        ])
        .args([
            "--tokens",
            "64",
            "--doc-chunks",
            "1",
            "--steps",
            "1",
            "--force",
            "route",
        ])
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let served = report["served"][0]["rows"].as_f64().unwrap();
    let (status, body) = get(&metrics, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert_eq!(
        sample(&body, "kvroute_holder_query_rows_total", ""),
        served,
        "{body}"
    );
    assert!(
        sample(&body, "kvroute_holder_requests_total", "") > 0.0,
        "{body}"
    );
    assert_eq!(
        sample(&body, "kvroute_holder_sessions_total", "event=\"opened\""),
        1.0,
        "{body}"
    );
    assert!(
        body.contains("kvroute_holder_kernel_seconds_bucket"),
        "{body}"
    );
    // The transport's counters, read at the scrape: the holder answered the requester's
    // writes with writes of its own, and its regions are registered.
    let tcp = "provider=\"fabric:tcp;ofi_rxm\"";
    for family in [
        "kvroute_transport_bytes_total",
        "kvroute_transport_arrivals_total",
        "kvroute_transport_registered_bytes",
        "kvroute_transport_engines",
        "kvroute_transport_transfer_seconds_count",
    ] {
        assert!(sample(&body, family, tcp) > 0.0, "{family}: {body}");
    }
    assert_eq!(
        sample(
            &body,
            "kvroute_transport_work_requests_total",
            "state=\"posted\""
        ),
        sample(
            &body,
            "kvroute_transport_work_requests_total",
            "state=\"completed\""
        ) + sample(
            &body,
            "kvroute_transport_work_requests_total",
            "state=\"unreported\""
        ) + sample(
            &body,
            "kvroute_transport_work_requests_total",
            "state=\"failed\""
        ),
        "every posted work request finished: {body}"
    );
    assert_eq!(
        sample(&body, "kvroute_transport_transfers_total", tcp),
        sample(&body, "kvroute_transport_transfer_seconds_count", tcp),
        "every transfer finished, whatever its outcome, is timed: {body}"
    );
    assert!(
        sample(&body, "kvroute_transport_transfers_total", "outcome=\"ok\"") > 0.0,
        "{body}"
    );
    // Prometheus' own linter accepts the page (names, types, units, help).
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (cargo xtask deps installs Debian's prometheus)");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let lint = promtool.wait_with_output().unwrap();
    assert!(
        lint.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    let (status, _) = get(&metrics, "/other");
    assert!(status.contains("404"), "{status}");
    drop(holder.stdin.take());
    let _ = holder.wait();
}
