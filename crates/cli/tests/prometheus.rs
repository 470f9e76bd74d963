//! A real Prometheus scraping two holder processes' `/metrics` pages: through Prometheus'
//! HTTP query API, the rows each holder attended equal what its requester read from the
//! holder's own counters, and a killed holder shows up as `up == 0`. Skipped (named) where
//! Debian's `prometheus` is not installed (`cargo xtask deps` installs it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A holder process, stopped when dropped by closing its stdin (it then removes its shm
/// regions), killed if it has not gone within 5 s.
struct HolderProc(Child);

impl HolderProc {
    /// SIGKILL, as a crash would; its shm regions are removed after it (a killed process
    /// cannot, and `cargo xtask test` fails on leftovers).
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(self.0.id());
    }
}

impl Drop for HolderProc {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

/// A holder of chunk `chunk` of a two-chunk corpus over shm, serving its metrics: the
/// process, its control address and its `/metrics` address.
fn holder(chunk: u32) -> (HolderProc, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "holder",
            "--provider",
            "shm",
            "--chunks",
            &chunk.to_string(),
        ])
        .args(["--tokens", "64", "--doc-chunks", "2", "--lifeline", "stdin"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let (control, metrics) = (
        v["listen"].as_str().unwrap().to_owned(),
        v["metrics"].as_str().unwrap().to_owned(),
    );
    (HolderProc(child), control, metrics)
}

/// Prometheus' answer to the instant query `query` (no characters that need escaping).
fn query(prometheus: &str, query: &str) -> serde_json::Value {
    let Ok(mut s) = TcpStream::connect(prometheus) else {
        return serde_json::Value::Null;
    };
    write!(
        s,
        "GET /api/v1/query?query={query} HTTP/1.1\r\nHost: {prometheus}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return serde_json::Value::Null;
    };
    // Prometheus (Go's HTTP server) sends answers past a few kilobytes chunked.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        unchunked(body)
    } else {
        body.to_owned()
    };
    serde_json::from_str(&body).unwrap_or(serde_json::Value::Null)
}

/// The payload of a chunked HTTP body: each chunk is a hex length line, then that many bytes
/// and a line end; a zero length ends it.
fn unchunked(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// `text` as a URL's query value.
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The value per `instance` of an instant vector.
fn by_instance(answer: &serde_json::Value) -> Vec<(String, f64)> {
    answer["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|r| {
            let instance = r["metric"]["instance"].as_str()?.to_owned();
            let value = r["value"][1].as_str()?.parse().ok()?;
            Some((instance, value))
        })
        .collect()
}

/// Polls `ok` every 250 ms for up to `limit`.
fn until(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    false
}

#[test]
fn prometheus_scrapes_the_holders_counters_and_sees_a_killed_one_down() {
    if Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
    {
        kvroute_testkit::skip!(
            "no prometheus binary (cargo xtask deps installs Debian's prometheus)"
        );
        return;
    }
    let (h0, c0, m0) = holder(0);
    let (mut h1, c1, m1) = holder(1);
    let dir = std::env::temp_dir().join(format!("kvroute-prometheus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let free = || {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let prometheus = format!("127.0.0.1:{}", free());
    let requester = format!("127.0.0.1:{}", free());
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: kvroute\n    static_configs:\n      - targets: ['{m0}', '{m1}', '{requester}']\n"
        ),
    )
    .unwrap();
    let _server = Killed(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={prometheus}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["--json", "requester", "--provider", "shm", "--holders"])
        .arg(format!("{c0},{c1}"))
        .args([
            "--tokens",
            "64",
            "--doc-chunks",
            "2",
            "--steps",
            "1",
            "--force",
            "route",
        ])
        .args([
            "--metrics-listen",
            &requester,
            "--metrics-linger-ms",
            "4000",
        ])
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let served: Vec<(String, f64)> = report["served"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let control = s["holder"].as_str().unwrap().to_owned();
            let metrics = if control == c0 {
                m0.clone()
            } else {
                m1.clone()
            };
            (metrics, s["rows"].as_f64().unwrap())
        })
        .collect();
    assert_eq!(served.len(), 2, "{report}");
    // Both holders' rows, as Prometheus scraped them after the requester finished.
    let mut seen = Vec::new();
    let agreed = until(Duration::from_secs(30), || {
        seen = by_instance(&query(&prometheus, "kvroute_holder_query_rows_total"));
        seen.sort_by(|a, b| a.0.cmp(&b.0));
        let mut want = served.clone();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        seen == want
    });
    assert!(
        agreed,
        "Prometheus has {seen:?}, the requester read {served:?}"
    );
    // The requester's decisions by choice, as Prometheus scraped them before it exited (the
    // series is stale since: a range query still has its samples).
    let stats = &report["stats"];
    for (how, n) in [("route", &stats["routes"]), ("fetch", &stats["fetches"])] {
        let want = n.as_f64().unwrap();
        let q = percent_encoded(&format!(
            "max_over_time(kvroute_step_pairs_total{{how=\"{how}\"}}[5m])"
        ));
        let mut got = Vec::new();
        let seen = until(Duration::from_secs(10), || {
            got = by_instance(&query(&prometheus, &q));
            got.iter().map(|(_, v)| v).sum::<f64>() == want || (want == 0.0 && got.is_empty())
        });
        assert!(
            seen,
            "{how}: Prometheus has {got:?}, the report says {want}"
        );
    }
    // Every query of the dashboard in docs/ is one this Prometheus accepts.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/grafana/kvroute.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap())
        .map(|t| t["expr"].as_str().unwrap())
        .collect();
    assert!(exprs.len() >= 8);
    for expr in exprs {
        let answer = query(&prometheus, &percent_encoded(expr));
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
    }
    // Holder 1 killed: its target goes down.
    h1.kill();
    let mut up = Vec::new();
    let down = until(Duration::from_secs(20), || {
        up = by_instance(&query(&prometheus, "up"));
        up.contains(&(m1.clone(), 0.0)) && up.contains(&(m0.clone(), 1.0))
    });
    assert!(down, "up: {up:?}");
    drop((h0, h1));
    let _ = std::fs::remove_dir_all(&dir);
}
