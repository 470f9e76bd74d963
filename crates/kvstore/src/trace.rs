//! Mooncake-format request traces, and their replay through the prefix cache.
//!
//! A trace is JSON lines, one request each: `timestamp` (arrival, ms from the trace's start),
//! `input_length` and `output_length` (tokens) and `hash_ids` (the prompt's chained block
//! hashes, one per `block_tokens` tokens; Mooncake FAST'25 release, `FAST25-release/traces/`).
//! Every line is untrusted input: [`TraceReader`] gives each a typed [`TraceError`] naming the
//! line, and never panics.
//!
//! [`replay`] follows the semantics trace studies use, so its ratios compare with other tools:
//! requests in arrival order; a request's hit is the longest prefix of its `hash_ids` cached at
//! its arrival; then all its blocks are touched in order (a cached block becomes the most
//! recent, a missing one is inserted, evicting the least recently used when over capacity;
//! capacity 0 is unbounded). With a [`BlockStore`] below, an evicted block is demoted to disk
//! and a block found on disk is promoted back, so the bytes the storage tier moves are real.

use std::collections::HashSet;
use std::io::{BufRead, Read};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::prefix::{BlockKey, CacheError, Eviction, PrefixCache};
use crate::storage::{BlockStore, StorageError, StorageStats};

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceRecord {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// The prompt's chained block hashes.
    pub hash_ids: Vec<u64>,
}

/// The longest line the reader takes (a request of a million blocks is about 8 MiB of JSON).
pub const MAX_LINE_BYTES: u64 = 16 << 20;

/// A line the reader refuses, with its 1-based line number.
#[derive(Debug, Error)]
pub enum TraceError {
    /// A line longer than [`MAX_LINE_BYTES`].
    #[error("line {line}: longer than {MAX_LINE_BYTES} bytes")]
    TooLong {
        /// The line.
        line: usize,
    },
    /// The file could not be read.
    #[error("line {line}: reading the trace: {source}")]
    Io {
        /// The line being read.
        line: usize,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The line is not a JSON object of the trace's fields.
    #[error("line {line}: not a trace record: {why}")]
    Json {
        /// The line.
        line: usize,
        /// serde_json's reason.
        why: String,
    },
    /// A field is negative, fractional or too large.
    #[error("line {line}: `{field}` is {value}, not a non-negative integer")]
    Field {
        /// The line.
        line: usize,
        /// Which field.
        field: &'static str,
        /// The value as written.
        value: String,
    },
    /// More block hashes than the prompt has blocks.
    #[error(
        "line {line}: {hashes} block hashes for {input_length} prompt tokens ({blocks} blocks of {block_tokens})"
    )]
    TooManyHashes {
        /// The line.
        line: usize,
        /// Hashes given.
        hashes: usize,
        /// Prompt tokens.
        input_length: u64,
        /// Blocks the prompt has.
        blocks: u64,
        /// Tokens per block.
        block_tokens: u32,
    },
    /// Arrivals must not go back in time (a replay is in arrival order).
    #[error("line {line}: timestamp {timestamp} before the previous request's {previous}")]
    OutOfOrder {
        /// The line.
        line: usize,
        /// Its timestamp.
        timestamp: u64,
        /// The previous line's.
        previous: u64,
    },
}

/// Why a replay stopped.
#[derive(Debug, Error)]
pub enum ReplayError {
    /// A bad trace line.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The cache refused (only with pinned blocks, which a replay does not make).
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The storage tier failed.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Bad replay settings.
    #[error("{0}")]
    Config(&'static str),
}

#[derive(Deserialize)]
struct Raw {
    timestamp: serde_json::Number,
    input_length: serde_json::Number,
    output_length: serde_json::Number,
    hash_ids: Vec<serde_json::Number>,
}

/// Reads a trace line by line, checking each record against `block_tokens`.
#[derive(Debug)]
pub struct TraceReader<R> {
    input: R,
    block_tokens: u32,
    line: usize,
    previous: u64,
    text: String,
}

impl<R: BufRead> TraceReader<R> {
    /// A reader of `input` whose blocks are `block_tokens` tokens (512 in Mooncake's traces).
    pub fn new(input: R, block_tokens: u32) -> Self {
        Self {
            input,
            block_tokens: block_tokens.max(1),
            line: 0,
            previous: 0,
            text: String::new(),
        }
    }

    fn parse(&mut self) -> Result<TraceRecord, TraceError> {
        let line = self.line;
        let raw: Raw = serde_json::from_str(&self.text).map_err(|e| TraceError::Json {
            line,
            why: e.to_string(),
        })?;
        let int = |field: &'static str, n: &serde_json::Number| {
            n.as_u64().ok_or_else(|| TraceError::Field {
                line,
                field,
                value: n.to_string(),
            })
        };
        let record = TraceRecord {
            timestamp_ms: int("timestamp", &raw.timestamp)?,
            input_length: int("input_length", &raw.input_length)?,
            output_length: int("output_length", &raw.output_length)?,
            hash_ids: raw
                .hash_ids
                .iter()
                .map(|n| int("hash_ids", n))
                .collect::<Result<_, _>>()?,
        };
        let blocks = record.input_length.div_ceil(u64::from(self.block_tokens));
        if record.hash_ids.len() as u64 > blocks {
            return Err(TraceError::TooManyHashes {
                line,
                hashes: record.hash_ids.len(),
                input_length: record.input_length,
                blocks,
                block_tokens: self.block_tokens,
            });
        }
        if record.timestamp_ms < self.previous {
            return Err(TraceError::OutOfOrder {
                line,
                timestamp: record.timestamp_ms,
                previous: self.previous,
            });
        }
        self.previous = record.timestamp_ms;
        Ok(record)
    }
}

impl<R: BufRead> Iterator for TraceReader<R> {
    type Item = Result<TraceRecord, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.text.clear();
            self.line += 1;
            match (&mut self.input)
                .take(MAX_LINE_BYTES + 1)
                .read_line(&mut self.text)
            {
                Ok(0) => return None,
                Ok(n) if n as u64 > MAX_LINE_BYTES => {
                    // Skip the rest of the line (without keeping it) so the next record
                    // starts clean.
                    if !self.text.ends_with('\n') {
                        skip_line(&mut self.input);
                    }
                    return Some(Err(TraceError::TooLong { line: self.line }));
                }
                Ok(_) if self.text.trim().is_empty() => continue,
                Ok(_) => return Some(self.parse()),
                Err(source) => {
                    return Some(Err(TraceError::Io {
                        line: self.line,
                        source,
                    }));
                }
            }
        }
    }
}

/// Consumes input up to and including the next newline, holding none of it.
fn skip_line(input: &mut impl BufRead) {
    loop {
        let (found, used) = match input.fill_buf() {
            Ok([]) | Err(_) => return,
            Ok(buf) => match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (true, i + 1),
                None => (false, buf.len()),
            },
        };
        input.consume(used);
        if found {
            return;
        }
    }
}

/// How to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReplayConfig {
    /// Tokens per block (the trace's; 512 for Mooncake's).
    pub block_tokens: u32,
    /// Blocks the memory tier holds (0: unbounded).
    pub capacity_blocks: usize,
    /// Eviction policy.
    pub policy: Eviction,
    /// Stop after this many requests (0: all).
    pub limit: usize,
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayReport {
    /// The settings.
    pub config: ReplayConfig,
    /// Requests replayed.
    pub requests: u64,
    /// Blocks over all requests.
    pub blocks: u64,
    /// Distinct blocks (distinct `(parent, hash)` names; for chained hashes, distinct ids).
    pub distinct_blocks: u64,
    /// Blocks of each request's longest cached prefix (memory or, with a store, disk), summed.
    pub hit_blocks: u64,
    /// `hit_blocks / blocks`.
    pub block_prefix_hit_ratio: f64,
    /// Prompt tokens covered by the cached prefix (`min(hit_blocks * block_tokens,
    /// input_length)` per request) over all prompt tokens.
    pub token_hit_ratio: f64,
    /// Blocks evicted from memory.
    pub evictions: u64,
    /// With a store: prefix blocks that were found on disk and promoted back to memory.
    pub storage_hit_blocks: u64,
    /// With a store: its byte counters.
    pub storage: Option<StorageStats>,
    /// Wall time of the replay, seconds (reading and parsing the trace included).
    pub seconds: f64,
    /// Of that, seconds in the prefix cache (longest-prefix lookups, touches, inserts and
    /// evictions; not the storage tier's I/O).
    pub cache_seconds: f64,
}

/// Replays `records` through a prefix cache of `config`, and through `store` below it if given
/// (an evicted block is written to disk unless already there; a prefix block missing from
/// memory but on disk is read back and counts as a hit). Block contents for the store are
/// synthetic, a function of the block's hash, and every read is checksum-checked.
pub fn replay(
    records: impl IntoIterator<Item = Result<TraceRecord, TraceError>>,
    config: ReplayConfig,
    mut store: Option<&mut BlockStore>,
) -> Result<ReplayReport, ReplayError> {
    if config.block_tokens == 0 {
        return Err(ReplayError::Config("block tokens must be positive"));
    }
    let started = Instant::now();
    let mut cache: PrefixCache<()> = PrefixCache::new(config.capacity_blocks, config.policy);
    let mut distinct: HashSet<BlockKey> = HashSet::new();
    let mut report = ReplayReport {
        config,
        requests: 0,
        blocks: 0,
        distinct_blocks: 0,
        hit_blocks: 0,
        block_prefix_hit_ratio: 0.0,
        token_hit_ratio: 0.0,
        evictions: 0,
        storage_hit_blocks: 0,
        storage: None,
        seconds: 0.0,
        cache_seconds: 0.0,
    };
    let mut block = store.as_ref().map(|s| vec![0u8; s.layout().full_bytes()]);
    let (mut tokens, mut hit_tokens) = (0u64, 0u64);
    let mut demoted: Vec<BlockKey> = Vec::new();
    for record in records {
        if config.limit != 0 && report.requests as usize >= config.limit {
            break;
        }
        let record = record?;
        let hashes = &record.hash_ids;
        demoted.clear();
        let timed = Instant::now();
        let access = cache.access(hashes, |_| (), &mut |k, ()| demoted.push(k))?;
        report.cache_seconds += timed.elapsed().as_secs_f64();
        let mut hit = access.hit_blocks;
        if let (Some(store), Some(buf)) = (store.as_deref_mut(), block.as_mut()) {
            // Extend the memory prefix with blocks on disk, promoting each (the blocks this
            // request evicted are written below, after the look).
            while hit < hashes.len() && store.contains(hashes[hit]) {
                store.get_into(hashes[hit], buf)?;
                report.storage_hit_blocks += 1;
                hit += 1;
            }
            for key in &demoted {
                if !store.contains(key.hash) {
                    synthetic(key.hash, buf);
                    store.put(key.hash, buf)?;
                }
            }
        }
        report.evictions += access.evicted as u64;
        distinct.extend((0..hashes.len()).map(|i| BlockKey::in_prompt(hashes, i)));
        report.requests += 1;
        report.blocks += hashes.len() as u64;
        report.hit_blocks += hit as u64;
        tokens += record.input_length;
        hit_tokens += (hit as u64 * u64::from(config.block_tokens)).min(record.input_length);
    }
    report.distinct_blocks = distinct.len() as u64;
    report.block_prefix_hit_ratio = ratio(report.hit_blocks, report.blocks);
    report.token_hit_ratio = ratio(hit_tokens, tokens);
    report.storage = store.map(|s| s.stats());
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Fills `buf` with bytes that are a function of `key` (a stand-in for the block's KV).
pub fn synthetic(key: u64, buf: &mut [u8]) {
    let mut x = key ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<Result<TraceRecord, TraceError>> {
        TraceReader::new(text.as_bytes(), 512).collect()
    }

    #[test]
    fn bad_lines_get_typed_errors_naming_the_line() {
        let good =
            r#"{"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]}"#;
        let cases = [
            ("not json", "line 2: not a trace record"),
            (r#"{"timestamp": 5}"#, "line 2: not a trace record"),
            (
                r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
                "`timestamp` is -1",
            ),
            (
                r#"{"timestamp": 6, "input_length": -5, "output_length": 1, "hash_ids": []}"#,
                "`input_length` is -5",
            ),
            (
                r#"{"timestamp": 6, "input_length": 1.5, "output_length": 1, "hash_ids": []}"#,
                "`input_length` is 1.5",
            ),
            (
                r#"{"timestamp": 6, "input_length": 10, "output_length": 1, "hash_ids": [-3]}"#,
                "`hash_ids` is -3",
            ),
            (
                r#"{"timestamp": 6, "input_length": 513, "output_length": 1, "hash_ids": [1, 2, 3]}"#,
                "3 block hashes for 513 prompt tokens (2 blocks of 512)",
            ),
            (
                r#"{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
                "timestamp 4 before the previous request's 5",
            ),
            (
                r#"{"timestamp": 99999999999999999999999, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
                "`timestamp` is",
            ),
        ];
        for (bad, want) in cases {
            let got = read(&format!("{good}\n{bad}\n"));
            assert!(got[0].is_ok());
            let err = got[1]
                .as_ref()
                .err()
                .map(ToString::to_string)
                .unwrap_or_default();
            assert!(err.contains(want), "{bad}: {err}");
            assert!(err.starts_with("line 2"), "{err}");
        }
        // An over-long line is refused without reading it whole into one string.
        let long = format!("{good}\n[{}]\n{good}\n", "1,".repeat(9 << 20));
        let got = read(&long);
        assert!(
            matches!(got[1], Err(TraceError::TooLong { line: 2 })),
            "{:?}",
            got[1].as_ref().err()
        );
        assert!(got[2].is_ok(), "the line after it reads");
        // Blank lines are skipped but counted.
        let got = read(&format!("{good}\n\nnope\n"));
        assert!(
            got[1]
                .as_ref()
                .err()
                .is_some_and(|e| e.to_string().starts_with("line 3"))
        );
    }

    #[test]
    fn replay_counts_prefix_hits_in_arrival_order() -> Result<(), ReplayError> {
        let text = [
            r#"{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2, 3]}"#,
            r#"{"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]}"#,
            r#"{"timestamp": 2, "input_length": 600, "output_length": 1, "hash_ids": [5, 2]}"#,
        ]
        .join("\n");
        let config = ReplayConfig {
            block_tokens: 512,
            capacity_blocks: 0,
            policy: Eviction::Lru,
            limit: 0,
        };
        let r = replay(read(&text), config, None)?;
        assert_eq!(
            (r.requests, r.blocks, r.distinct_blocks, r.hit_blocks),
            (3, 8, 6, 2)
        );
        assert!((r.block_prefix_hit_ratio - 0.25).abs() < 1e-12);
        // Request 2 hit 2 blocks = 1024 tokens of its 1100.
        assert!((r.token_hit_ratio - 1024.0 / 3200.0).abs() < 1e-12);
        // Capacity 2: request 2 finds only block 1... evicted by then; nothing hits.
        let r = replay(
            read(&text),
            ReplayConfig {
                capacity_blocks: 2,
                ..config
            },
            None,
        )?;
        assert_eq!((r.hit_blocks, r.evictions), (0, 6));
        Ok(())
    }
}
