//! `kvroute trace replay` and `kvroute store write | verify | bench`: the prefix cache driven by
//! a real trace, and the storage tier for operators.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;

use kvroute_transport::file::{Links, open_regular};
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kvroute_kvstore::storage::{BlockStore, Verify};
use kvroute_kvstore::{
    BlockKey, BlockLayout, ChunkId, CorpusSpec, ReplayConfig, ReplayReport, TraceReader,
};
use serde::Serialize;

use crate::args::{StoreBenchArgs, StoreDirArgs, StoreWriteArgs, TraceReplayArgs};

/// A replay and its same-run baseline.
#[derive(Debug, Clone, Serialize)]
pub struct TraceReplayReport {
    /// The trace file.
    pub trace: String,
    /// What the replay measured.
    #[serde(flatten)]
    pub replay: ReplayReport,
    /// Prefix-cache cost per block of the trace (lookup of the longest prefix plus the touch or
    /// insert of every block), nanoseconds.
    pub cache_ns_per_block: f64,
    /// Block lookups per second that cost allows.
    pub lookups_per_second: f64,
    /// The same lookups and inserts into the standard library's `HashSet` (SipHash, no
    /// recency order, no eviction), in the same run, nanoseconds per block.
    pub baseline_ns_per_block: f64,
}

pub(crate) fn replay(args: &TraceReplayArgs) -> Result<TraceReplayReport> {
    // A regular file: a FIFO or a device (`/dev/zero`) would be read without end.
    let file = open_regular(&args.trace, Links::Follow)
        .with_context(|| format!("opening the trace {}", args.trace.display()))?;
    let records: Vec<_> = TraceReader::new(BufReader::new(file), args.block_tokens)
        .take(if args.limit == 0 {
            usize::MAX
        } else {
            args.limit
        })
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {}", args.trace.display()))?;
    let config = ReplayConfig {
        block_tokens: args.block_tokens,
        capacity_blocks: args.capacity_blocks,
        policy: args.policy.parse()?,
        limit: args.limit,
    };
    let mut store = match &args.store {
        Some(dir) => {
            let layout = BlockLayout::new(args.store_layers, args.block_tokens)?;
            Some(BlockStore::open(dir, layout)?.0)
        }
        None => None,
    };
    // Baseline: the same lookups and inserts into a plain hash set.
    let started = Instant::now();
    let mut set: HashSet<BlockKey> = HashSet::new();
    let mut hits = 0usize;
    for r in &records {
        let h = &r.hash_ids;
        let key = |i: usize| BlockKey::in_prompt(h, i);
        hits += (0..h.len()).take_while(|&i| set.contains(&key(i))).count();
        set.extend((0..h.len()).map(key));
    }
    let baseline = started.elapsed().as_secs_f64();
    std::hint::black_box(hits);
    let report = kvroute_kvstore::replay(records.into_iter().map(Ok), config, store.as_mut())?;
    let blocks = report.blocks.max(1) as f64;
    Ok(TraceReplayReport {
        trace: args.trace.display().to_string(),
        cache_ns_per_block: report.cache_seconds * 1e9 / blocks,
        lookups_per_second: blocks / report.cache_seconds.max(1e-12),
        baseline_ns_per_block: baseline * 1e9 / blocks,
        replay: report,
    })
}

impl fmt::Display for TraceReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.replay;
        let c = &r.config;
        let capacity = if c.capacity_blocks == 0 {
            "unbounded".to_owned()
        } else {
            format!("{} blocks", c.capacity_blocks)
        };
        writeln!(
            f,
            "trace {}: {} requests, {} blocks of {} tokens, {} distinct",
            self.trace, r.requests, r.blocks, c.block_tokens, r.distinct_blocks
        )?;
        writeln!(f, "cache: {capacity}, {:?} eviction", c.policy)?;
        writeln!(
            f,
            "block prefix hit ratio {:.3} ({} of {} blocks), token hit ratio {:.3}, {} evictions",
            r.block_prefix_hit_ratio, r.hit_blocks, r.blocks, r.token_hit_ratio, r.evictions
        )?;
        if let Some(s) = &r.storage {
            writeln!(
                f,
                "storage tier: {} prefix blocks promoted from disk; {:.1} MB read, {:.1} MB written ({} blocks)",
                r.storage_hit_blocks,
                s.bytes_read as f64 / 1e6,
                s.bytes_written as f64 / 1e6,
                s.puts
            )?;
        }
        writeln!(
            f,
            "prefix cache {:.0} ns per block ({:.1} M lookups/s); std HashSet, same lookups and inserts, same run: {:.0} ns",
            self.cache_ns_per_block,
            self.lookups_per_second / 1e6,
            self.baseline_ns_per_block
        )
    }
}

/// `kvroute store write`.
#[derive(Debug, Clone, Serialize)]
pub struct StoreWriteReport {
    /// The store.
    pub dir: String,
    /// Blocks written (keys 0..blocks).
    pub blocks: u32,
    /// Layers x tokens of each.
    pub layout: BlockLayout,
    /// Bytes written, headers included.
    pub bytes: u64,
    /// Wall time of the writes (fsync included), seconds.
    pub seconds: f64,
    /// `bytes / seconds`, MB/s.
    pub mb_per_s: f64,
}

pub(crate) fn write(args: &StoreWriteArgs) -> Result<StoreWriteReport> {
    let spec = CorpusSpec {
        layers: args.layers,
        chunk_tokens: args.tokens,
        chunks: args.chunks,
        seed: args.seed,
        rope_theta: 10_000.0,
        yarn: None,
        rope_layout: kvroute_kernels::RopeLayout::Interleaved,
    };
    spec.validate()?;
    let (mut store, _) = BlockStore::open(&args.dir, spec.layout())?;
    let mut seconds = 0.0;
    for c in 0..args.chunks {
        let block = spec.chunk(ChunkId(c))?;
        let bytes: Vec<u8> = block.iter().flat_map(|w| w.to_le_bytes()).collect();
        let started = Instant::now();
        store.put(u64::from(c), &bytes)?;
        seconds += started.elapsed().as_secs_f64();
    }
    let bytes = store.stats().bytes_written;
    Ok(StoreWriteReport {
        dir: args.dir.display().to_string(),
        blocks: args.chunks,
        layout: spec.layout(),
        bytes,
        seconds,
        mb_per_s: bytes as f64 / seconds.max(1e-12) / 1e6,
    })
}

impl fmt::Display for StoreWriteReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} full blocks of {} layers x {} tokens, {:.1} MB in {:.3} s ({:.0} MB/s, fsync per block)",
            self.dir,
            self.blocks,
            self.layout.layers,
            self.layout.tokens,
            self.bytes as f64 / 1e6,
            self.seconds,
            self.mb_per_s
        )
    }
}

/// `kvroute store verify`.
#[derive(Debug, Clone, Serialize)]
pub struct StoreVerifyReport {
    /// The store.
    pub dir: String,
    /// Good blocks.
    pub ok: usize,
    /// Corrupt blocks.
    pub corrupt: usize,
    /// Missing blocks.
    pub missing: usize,
    /// Each bad block: file or key, and why.
    pub bad: Vec<(String, String)>,
}

pub(crate) fn verify(args: &StoreDirArgs) -> Result<StoreVerifyReport> {
    let (mut store, _) = BlockStore::open_existing(&args.dir)?;
    let Verify {
        ok,
        corrupt,
        missing,
    } = store.verify()?;
    let mut bad = corrupt.clone();
    bad.extend(missing.iter().map(|k| (k.clone(), "missing".to_owned())));
    Ok(StoreVerifyReport {
        dir: args.dir.display().to_string(),
        ok,
        corrupt: corrupt.len(),
        missing: missing.len(),
        bad,
    })
}

impl fmt::Display for StoreVerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} ok, {} corrupt, {} missing",
            self.dir, self.ok, self.corrupt, self.missing
        )?;
        for (what, why) in &self.bad {
            writeln!(f, "  {what}: {why}")?;
        }
        Ok(())
    }
}

/// One bandwidth, MB/s, per round.
#[derive(Debug, Clone, Serialize)]
pub struct Bandwidth {
    /// What read or wrote.
    pub what: String,
    /// MB/s of each round.
    pub rounds: Vec<f64>,
    /// Their median.
    pub median: f64,
}

/// `kvroute store bench`.
#[derive(Debug, Clone, Serialize)]
pub struct StoreBenchReport {
    /// The store.
    pub dir: String,
    /// Blocks and bytes read per round.
    pub blocks: usize,
    /// Payload bytes of one block.
    pub block_bytes: usize,
    /// Reads, each with the page cache dropped for the files first (`posix_fadvise`
    /// DONTNEED): the store's whole-block reads (checksums checked), `dd bs=4M` over the same
    /// files, and `fio` (psync, 4 MiB reads, one job) over the same files when installed.
    pub reads: Vec<Bandwidth>,
    /// Writes of as many new blocks: the store's `put` (fsync per block) against `dd bs=4M
    /// conv=fsync` of the same sizes.
    pub writes: Vec<Bandwidth>,
    /// Store reads over the best baseline reader's median.
    pub read_ratio: f64,
    /// Store writes over dd's median.
    pub write_ratio: f64,
}

pub(crate) fn bench(args: &StoreBenchArgs) -> Result<StoreBenchReport> {
    let (mut store, _) = BlockStore::open_existing(&args.dir)?;
    let keys: Vec<u64> = store.keys().collect();
    if keys.is_empty() {
        bail!(
            "{} holds no blocks (kvroute store write first)",
            args.dir.display()
        );
    }
    let layout = store.layout();
    let files: Vec<PathBuf> = keys.iter().map(|&k| store.path(k)).collect();
    let file_bytes: u64 = files
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()))
        .sum::<Result<u64, _>>()?;
    let has_fio = Command::new("fio")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // Blocks land page-aligned, as in a registered buffer (the kernel's copy out of the page
    // cache runs slower into a destination that is not).
    let mut backing = vec![0u8; layout.full_bytes() + 4096];
    let skew = backing.as_ptr().align_offset(4096).min(4096);
    let buf = &mut backing[skew..skew + layout.full_bytes()];
    // fio refuses a block size past a file's end: small blocks are read whole.
    let fio_bs = (4u64 << 20).min(file_bytes / keys.len() as u64);
    let mut ours = Vec::new();
    let mut dd = Vec::new();
    let mut fio = Vec::new();
    for round in 0..args.rounds.max(1) {
        // Rotate who goes first, so drift in the machine does not favour one reader.
        for turn in 0..3 {
            match (round as usize + turn) % 3 {
                0 => {
                    drop_cache(&files)?;
                    let started = Instant::now();
                    for &k in &keys {
                        store.get_into(k, buf)?;
                    }
                    ours.push(mb_s(file_bytes, started));
                }
                1 => {
                    drop_cache(&files)?;
                    let started = Instant::now();
                    for f in &files {
                        run(Command::new("dd")
                            .arg(format!("if={}", f.display()))
                            .args(["of=/dev/null", "bs=4M"]))?;
                    }
                    dd.push(mb_s(file_bytes, started));
                }
                _ if has_fio => {
                    drop_cache(&files)?;
                    fio.push(fio_read(&files, fio_bs)?);
                }
                _ => {}
            }
        }
    }
    // Writes: as many new blocks into a scratch store beside it, then dd of the same sizes.
    let scratch = args.dir.join(".bench-write");
    let _ = std::fs::remove_dir_all(&scratch);
    let mut our_writes = Vec::new();
    let mut dd_writes = Vec::new();
    let block = vec![0x5au8; layout.full_bytes()];
    for _ in 0..args.rounds.max(1) {
        let (mut w, _) = BlockStore::open(&scratch.join("store"), layout)?;
        let started = Instant::now();
        for &k in &keys {
            w.put(k, &block)?;
        }
        our_writes.push(mb_s(file_bytes, started));
        let dir = scratch.join("dd");
        std::fs::create_dir_all(&dir)?;
        let count = file_bytes / keys.len() as u64;
        let started = Instant::now();
        for (i, _) in keys.iter().enumerate() {
            run(Command::new("dd")
                .args(["if=/dev/zero", "bs=4M", "iflag=count_bytes", "conv=fsync"])
                .arg(format!("count={count}"))
                .arg(format!("of={}", dir.join(i.to_string()).display())))?;
        }
        dd_writes.push(mb_s(file_bytes, started));
        std::fs::remove_dir_all(&scratch)?;
    }
    let mut reads = vec![
        band("kvroute store (checksummed)", ours),
        band("dd bs=4M", dd),
    ];
    if !fio.is_empty() {
        let what = if fio_bs == 4 << 20 {
            "fio psync bs=4M".to_owned()
        } else {
            format!("fio psync bs={fio_bs}")
        };
        reads.push(band(&what, fio));
    }
    let best = reads[1..].iter().map(|b| b.median).fold(0.0, f64::max);
    let writes = vec![
        band("kvroute store (fsync per block)", our_writes),
        band("dd bs=4M conv=fsync", dd_writes),
    ];
    Ok(StoreBenchReport {
        dir: args.dir.display().to_string(),
        blocks: keys.len(),
        block_bytes: layout.full_bytes(),
        read_ratio: reads[0].median / best.max(1e-12),
        write_ratio: writes[0].median / writes[1].median.max(1e-12),
        reads,
        writes,
    })
}

impl fmt::Display for StoreBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} blocks of {:.1} MB; page cache dropped before every read",
            self.dir,
            self.blocks,
            self.block_bytes as f64 / 1e6
        )?;
        for (title, list) in [("read", &self.reads), ("write", &self.writes)] {
            for b in list {
                let rounds: Vec<String> = b.rounds.iter().map(|r| format!("{r:.0}")).collect();
                writeln!(
                    f,
                    "  {title} {:<30} median {:>7.0} MB/s  (rounds {})",
                    b.what,
                    b.median,
                    rounds.join(", ")
                )?;
            }
        }
        writeln!(
            f,
            "store reads at {:.2}x the best baseline reader, writes at {:.2}x dd",
            self.read_ratio, self.write_ratio
        )
    }
}

fn band(what: &str, rounds: Vec<f64>) -> Bandwidth {
    let mut sorted = rounds.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    Bandwidth {
        what: what.to_owned(),
        rounds,
        median,
    }
}

fn mb_s(bytes: u64, started: Instant) -> f64 {
    bytes as f64 / started.elapsed().as_secs_f64().max(1e-12) / 1e6
}

/// Evicts the files' clean pages from the page cache, so the next read comes from the device.
pub(crate) fn drop_cache(files: &[PathBuf]) -> Result<()> {
    for path in files {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        nix::fcntl::posix_fadvise(
            &file,
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        )
        .with_context(|| format!("dropping {} from the page cache", path.display()))?;
    }
    Ok(())
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// fio reading `files` sequentially with `bs`-byte `pread`s; its own bandwidth figure, MB/s.
fn fio_read(files: &[PathBuf], bs: u64) -> Result<f64> {
    let list: Vec<String> = files.iter().map(|p| escape_fio(p)).collect();
    let out = Command::new("fio")
        .args([
            "--name=read",
            "--rw=read",
            "--ioengine=psync",
            "--invalidate=0",
            "--output-format=json",
        ])
        .arg(format!("--bs={bs}"))
        .arg(format!("--filename={}", list.join(":")))
        .output()
        .context("starting fio")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio's JSON")?;
    let bw = json["jobs"][0]["read"]["bw_bytes"]
        .as_f64()
        .context("fio's JSON has no jobs[0].read.bw_bytes")?;
    Ok(bw / 1e6)
}

/// fio separates file names with `:`; one inside a name is written `\:`.
fn escape_fio(path: &Path) -> String {
    path.display().to_string().replace(':', "\\:")
}
