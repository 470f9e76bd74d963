//! Traces and the block store on disk: `trace replay`, `store verify` and `store bench`,
//! and files that are not what they claim to be.

use super::{busy_turn, json, kvroute, scratch};

#[test]
fn trace_replay_prints_the_traces_published_figures_and_names_a_bad_line() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/mooncake/conversation_trace.jsonl"
    );
    let v = json(&kvroute(&["trace", "replay", "--trace", trace, "--json"]));
    assert_eq!(v["distinct_blocks"], 182_790);
    assert_eq!(
        format!("{:.3}", v["block_prefix_hit_ratio"].as_f64().unwrap()),
        "0.366"
    );
    let text = kvroute(&[
        "trace",
        "replay",
        "--trace",
        trace,
        "--capacity-blocks",
        "1000",
    ]);
    assert!(
        String::from_utf8_lossy(&text.stdout)
            .contains("block prefix hit ratio 0.044 (12831 of 288500 blocks)")
    );

    let dir = scratch("trace");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": -600, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out = kvroute(&["trace", "replay", "--trace", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2: `input_length` is -600"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn store_verify_exits_1_naming_a_corrupt_and_a_missing_block() {
    let dir = scratch("store");
    let d = dir.to_str().unwrap();
    let w = json(&kvroute(&[
        "store", "write", "--dir", d, "--chunks", "3", "--tokens", "64", "--layers", "2", "--json",
    ]));
    assert_eq!(w["blocks"], 3);
    let v = json(&kvroute(&["store", "verify", "--dir", d, "--json"]));
    assert_eq!(
        (
            v["ok"].as_u64(),
            v["corrupt"].as_u64(),
            v["missing"].as_u64()
        ),
        (Some(3), Some(0), Some(0))
    );
    // One byte flipped in block 1's second layer, block 2 deleted.
    let one = dir.join("0000000000000001.kvb");
    let mut bytes = std::fs::read(&one).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 1;
    std::fs::write(&one, bytes).unwrap();
    std::fs::remove_file(dir.join("0000000000000002.kvb")).unwrap();
    let out = kvroute(&["store", "verify", "--dir", d]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("1 ok, 1 corrupt, 1 missing"), "{text}");
    assert!(
        text.contains("0000000000000001.kvb") && text.contains("layer 1 checksum mismatch"),
        "{text}"
    );
    assert!(text.contains("0000000000000002: missing"), "{text}");
    // With --json, stdout is the report alone, one document, and the exit status says the
    // rest.
    let out = kvroute(&["store", "verify", "--dir", d, "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON document");
    assert_eq!(v["corrupt"], 1, "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("2 bad blocks"));
    // A FIFO named like a block file is reported, not waited on.
    let fifo = dir.join("0000000000000007.kvb");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let started = std::time::Instant::now();
    let out = kvroute(&["store", "verify", "--dir", d]);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("0000000000000007.kvb: ") && text.contains("FIFO"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trace that is a device or a FIFO would be read without end: refused at once.
#[test]
fn a_trace_that_is_not_a_regular_file_is_refused() {
    for args in [
        &[
            "trace",
            "replay",
            "--trace",
            "/dev/zero",
            "--capacity-blocks",
            "8",
        ][..],
        &["simulate", "prfaas", "--trace", "/dev/zero"][..],
    ] {
        let started = std::time::Instant::now();
        let out = kvroute(args);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{args:?}"
        );
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("/dev/zero") && err.contains("a device"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn store_bench_reports_reads_and_writes_beside_dd() {
    let _turn = busy_turn();
    let dir = scratch("bench");
    let d = dir.to_str().unwrap();
    json(&kvroute(&[
        "store", "write", "--dir", d, "--chunks", "2", "--tokens", "128", "--layers", "3", "--json",
    ]));
    let v = json(&kvroute(&[
        "store", "bench", "--dir", d, "--rounds", "1", "--json",
    ]));
    let readers: Vec<&str> = v["reads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["what"].as_str().unwrap())
        .collect();
    assert!(readers.contains(&"dd bs=4M"), "{readers:?}");
    assert!(v["read_ratio"].as_f64().unwrap() > 0.0 && v["write_ratio"].as_f64().unwrap() > 0.0);
    assert!(
        !dir.join(".bench-write").exists(),
        "the write scratch is removed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
