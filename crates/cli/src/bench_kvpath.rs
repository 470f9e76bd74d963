//! `kvroute bench kvpath`: DualPath's two ways for cached KV to reach a prefill engine (paper
//! 003 section 4.1), run for real between two processes over libfabric with the storage tier.
//!
//! - **Direct** (storage -> PE): this process (the PE) reads each full block from the store
//!   into its staging buffer.
//! - **DE path** (storage -> DE -> PE): a second process (the DE, `kvroute bench kvpath-peer`)
//!   reads each block into its staging buffer and writes it on layer by layer (one paged
//!   write per layer, an immediate per page) into this process's inbox. Two slots: block `i + 1`
//!   is read while block `i` is written.
//! - **Hop alone**: the DE writes blocks already in memory, so the DE path's extra hop is
//!   measured on its own.
//!
//! The page cache is dropped before every pass that reads. Every block that lands is checked
//! against the CRC-32C of the store's copy. The figures calibrate the simulator: the direct
//! read is this machine's storage rate per node and the hop its compute-NIC rate
//! (`kvroute simulate dualpath --snic-gbps ... --cnic-gbps ...`).

use std::fmt;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use kvroute_kvstore::{BlockStore, StagingRegion};
use kvroute_transport::{
    MrDesc, NetAddr, Progress, ProviderChoice, RegisteredBuffer, TransferEngine,
};
use serde::{Deserialize, Serialize};

use crate::args::{KvPathBenchArgs, KvPathPeerArgs};
use crate::bench::machine;
use crate::bench_fabric::{Peer, open};
use crate::store::drop_cache;

/// The most bytes the inbox may take (every block of a pass lands in its own slot).
const MAX_INBOX: usize = 4 << 30;

#[derive(Debug, Serialize, Deserialize)]
enum PeerCommand {
    /// The PE's address and inbox.
    Hello { addr: NetAddr, inbox: MrDesc },
    /// Get ready to write `keys` (reading each first if `read`; otherwise reading the first
    /// two now, untimed, and writing those slots in turn), each page with `imm`.
    Prepare {
        keys: Vec<u64>,
        read: bool,
        imm: u32,
    },
    /// Start.
    Go,
    /// Exit.
    Exit,
}

#[derive(Debug, Serialize, Deserialize)]
enum PeerReply {
    Hello {
        addr: NetAddr,
    },
    Ready,
    /// Seconds the DE spent reading, and in all.
    Done {
        read_s: f64,
        total_s: f64,
    },
    Failed(String),
}

/// One way's rate over the rounds.
#[derive(Debug, Clone, Serialize)]
pub struct PathBand {
    /// What moved.
    pub what: String,
    /// Median MB/s (1e6 bytes per second of block payload).
    pub median_mb_s: f64,
    /// Best round's MB/s (this VM's disk reads are bimodal from pass to pass, so the best
    /// rounds compare the paths in the disk's same state).
    pub best_mb_s: f64,
    /// Every round's.
    pub rounds_mb_s: Vec<f64>,
}

/// `kvroute bench kvpath`.
#[derive(Debug, Clone, Serialize)]
pub struct KvPathReport {
    /// The machine.
    pub machine: String,
    /// The store.
    pub dir: String,
    /// libfabric provider.
    pub provider: String,
    /// Blocks per pass.
    pub blocks: usize,
    /// Bytes per block (payload).
    pub block_bytes: usize,
    /// Layers per block (one paged write each).
    pub layers: u32,
    /// Storage -> PE, storage -> DE -> PE, and the DE -> PE hop alone.
    pub paths: Vec<PathBand>,
    /// The DE's own reads within the DE path, MB/s (median).
    pub de_read_mb_s: f64,
    /// DE path over direct, medians.
    pub de_path_ratio: f64,
    /// DE path over direct, best rounds.
    pub de_path_ratio_best: f64,
    /// Blocks checked at the PE against the store's checksums, and how many matched.
    pub checked: usize,
    /// How many matched.
    pub matched: usize,
    /// The storage rate (best direct round) as the simulator's `--snic-gbps`.
    pub implied_snic_gbps: f64,
    /// The hop (best round) as its `--cnic-gbps`.
    pub implied_cnic_gbps: f64,
}

/// The workspace's one median ([`kvroute_costmodel::fit::median`]); 0 for no values.
fn median(v: &[f64]) -> f64 {
    kvroute_costmodel::fit::median(&mut v.to_vec()).unwrap_or(0.0)
}

fn provider_and_node(provider: &str) -> Result<(String, Option<&'static str>)> {
    crate::demo::holders::refuse_verbs(provider)?;
    let choice: ProviderChoice = provider.parse()?;
    let name = choice
        .prov_name()
        .ok_or_else(|| anyhow!("bench kvpath needs a named provider (shm, tcp, efa), not auto"))?
        .to_owned();
    Ok((name, (choice == ProviderChoice::Tcp).then_some("127.0.0.1")))
}

pub(crate) fn run(args: &KvPathBenchArgs) -> Result<KvPathReport> {
    let (provider, node) = provider_and_node(&args.provider)?;
    let mut pe = Pe::open(args, &provider, node)?;
    let dir = args
        .dir
        .to_str()
        .ok_or_else(|| anyhow!("the store path is not UTF-8"))?;
    let mut peer_args = vec![
        "bench",
        "kvpath-peer",
        "--dir",
        dir,
        "--provider",
        &provider,
    ];
    if let Some(n) = node {
        peer_args.extend(["--node", n]);
    }
    let mut peer = Peer::spawn(&peer_args)?;
    let PeerReply::Hello { addr: _ } = peer.recv()? else {
        bail!("the DE process did not say hello");
    };
    peer.send(&PeerCommand::Hello {
        addr: pe.engine.main_address(),
        inbox: pe.inbox.desc().clone(),
    })?;
    let mut rates = Rates::default();
    let mut imm = 0u32;
    for round in 0..args.rounds.max(1) {
        // Rotate who goes first, so drift in the machine does not favour one path.
        for turn in 0..3 {
            match (round as usize + turn) % 3 {
                0 => rates.direct.push(pe.direct()?),
                kind => {
                    imm += 1;
                    pe.through_the_de(&mut peer, kind == 1, imm, &mut rates)?;
                }
            }
        }
    }
    drop(peer);
    let report = pe.report(args, provider, rates);
    if report.matched != report.checked {
        print!("{report}");
        bail!(
            "{} of {} blocks landed wrong at the PE",
            report.checked - report.matched,
            report.checked
        );
    }
    Ok(report)
}

/// The PE process's side of a run: the blocks it moves, from the store into its staging
/// slots (the direct path) or from the DE into its inbox.
struct Pe {
    /// Where the DE writes every block of a pass, one after another.
    inbox: RegisteredBuffer,
    /// Two slots the direct path reads blocks into, in turn.
    staging: StagingRegion,
    engine: TransferEngine,
    store: BlockStore,
    /// The blocks moved each pass, and their files (whose pages are dropped from the cache
    /// before each read).
    keys: Vec<u64>,
    files: Vec<PathBuf>,
    /// The store's checksum of each block.
    reference: Vec<u32>,
    /// Bytes per block.
    full: usize,
    /// Layers per block.
    layers: u32,
}

/// Each path's MB/s per round, and the blocks checked at the PE.
#[derive(Default)]
struct Rates {
    direct: Vec<f64>,
    de_path: Vec<f64>,
    hop: Vec<f64>,
    de_reads: Vec<f64>,
    checked: usize,
    matched: usize,
}

impl Pe {
    /// Opens the store and the PE's engine, and reads every block once, untimed, for its
    /// checksum.
    fn open(args: &KvPathBenchArgs, provider: &str, node: Option<&str>) -> Result<Self> {
        let (mut store, _) = BlockStore::open_existing(&args.dir)?;
        let layout = store.layout();
        let keys: Vec<u64> = store
            .keys()
            .take(if args.blocks == 0 {
                usize::MAX
            } else {
                args.blocks
            })
            .collect();
        if keys.len() < 2 {
            bail!(
                "{} holds fewer than 2 blocks (kvroute store write first)",
                args.dir.display()
            );
        }
        let full = layout.full_bytes();
        if keys.len().saturating_mul(full) > MAX_INBOX {
            bail!(
                "{} blocks of {full} bytes pass the {} GiB inbox: take fewer with --blocks",
                keys.len(),
                MAX_INBOX >> 30
            );
        }
        let files: Vec<PathBuf> = keys.iter().map(|&k| store.path(k)).collect();
        let (engine, _) = open(provider, node, Progress::Thread)?;
        let mut staging = StagingRegion::new(&engine, layout, 2)?;
        let inbox = engine.alloc_mr(keys.len() * full)?;
        // The store's checksums of each block, read once, untimed.
        let mut reference = Vec::with_capacity(keys.len());
        for &k in &keys {
            staging.read(&engine, &mut store, k, 0)?;
            reference.push(staging.crc(&engine, 0)?);
        }
        Ok(Self {
            inbox,
            staging,
            engine,
            store,
            keys,
            files,
            reference,
            full,
            layers: layout.layers,
        })
    }

    /// Bytes of a pass.
    fn bytes(&self) -> f64 {
        (self.keys.len() * self.full) as f64
    }

    /// One pass of the direct path, storage -> PE, from a cold cache: its MB/s.
    fn direct(&mut self) -> Result<f64> {
        drop_cache(&self.files)?;
        let started = Instant::now();
        for (i, &k) in self.keys.iter().enumerate() {
            self.staging.read(&self.engine, &mut self.store, k, i % 2)?;
        }
        Ok(self.bytes() / started.elapsed().as_secs_f64() / 1e6)
    }

    /// One pass through the DE, with immediate `imm`: the whole path from a cold cache
    /// (`read`) or the hop alone (two blocks the DE holds in memory), each landed block
    /// checked.
    fn through_the_de(
        &mut self,
        peer: &mut Peer,
        read: bool,
        imm: u32,
        rates: &mut Rates,
    ) -> Result<()> {
        let bytes = self.bytes();
        let pages = self.keys.len() as u64 * u64::from(self.layers);
        self.inbox.fill(0);
        if read {
            drop_cache(&self.files)?;
        }
        peer.send(&PeerCommand::Prepare {
            keys: self.keys.clone(),
            read,
            imm,
        })?;
        match peer.recv()? {
            PeerReply::Ready => {}
            PeerReply::Failed(e) => bail!("the DE process failed: {e}"),
            other => bail!("the DE process said {other:?}"),
        }
        let landed = self.engine.imm_count(imm, pages);
        let started = Instant::now();
        peer.send(&PeerCommand::Go)?;
        landed
            .wait()
            .map_err(|e| anyhow!("the DE's writes failed: {e}"))?;
        let rate = bytes / started.elapsed().as_secs_f64() / 1e6;
        match peer.recv()? {
            PeerReply::Done { read_s, .. } if read => {
                rates.de_reads.push(bytes / read_s.max(1e-9) / 1e6);
                rates.de_path.push(rate);
            }
            PeerReply::Done { .. } => rates.hop.push(rate),
            PeerReply::Failed(e) => bail!("the DE process failed: {e}"),
            other => bail!("the DE process said {other:?}"),
        }
        for i in 0..self.keys.len() {
            let mut got = vec![0u8; self.full];
            self.inbox.read_at(i * self.full, &mut got)?;
            let want = if read {
                self.reference[i]
            } else {
                self.reference[i % 2]
            };
            rates.checked += 1;
            rates.matched += usize::from(crc32c::crc32c(&got) == want);
        }
        Ok(())
    }

    /// The report of a run's `rates`.
    fn report(&self, args: &KvPathBenchArgs, provider: String, rates: Rates) -> KvPathReport {
        let band = |what: &str, rounds: Vec<f64>| PathBand {
            what: what.into(),
            median_mb_s: median(&rounds),
            best_mb_s: rounds.iter().copied().fold(0.0, f64::max),
            rounds_mb_s: rounds,
        };
        let paths = vec![
            band("storage -> PE (direct)", rates.direct),
            band("storage -> DE -> PE (paged writes)", rates.de_path),
            band("DE -> PE hop alone (blocks in memory)", rates.hop),
        ];
        KvPathReport {
            machine: machine(),
            dir: args.dir.display().to_string(),
            provider,
            blocks: self.keys.len(),
            block_bytes: self.full,
            layers: self.layers,
            de_read_mb_s: median(&rates.de_reads),
            de_path_ratio: paths[1].median_mb_s / paths[0].median_mb_s.max(1e-9),
            de_path_ratio_best: paths[1].best_mb_s / paths[0].best_mb_s.max(1e-9),
            checked: rates.checked,
            matched: rates.matched,
            implied_snic_gbps: paths[0].best_mb_s * 8e-3,
            implied_cnic_gbps: paths[2].best_mb_s * 8e-3,
            paths,
        }
    }
}

/// `kvroute bench kvpath-peer`: the DE process.
pub(crate) fn peer(args: &KvPathPeerArgs) -> Result<()> {
    let (engine, _) = open(&args.provider, args.node.as_deref(), Progress::Thread)?;
    // The PE process holds the same store open; both only read.
    let (mut store, _) = BlockStore::open_existing(&args.dir)?;
    let layout = store.layout();
    let mut staging = StagingRegion::new(&engine, layout, 2)?;
    let mut out = std::io::stdout();
    let mut say = |reply: &PeerReply| -> Result<()> {
        writeln!(out, "{}", serde_json::to_string(reply)?)?;
        out.flush()?;
        Ok(())
    };
    say(&PeerReply::Hello {
        addr: engine.main_address(),
    })?;
    let mut lines = std::io::stdin().lock().lines();
    let mut next = || -> Result<PeerCommand> {
        let line = lines
            .next()
            .ok_or_else(|| anyhow!("the PE process went away"))??;
        Ok(serde_json::from_str(&line)?)
    };
    let PeerCommand::Hello { inbox, .. } = next()? else {
        bail!("the PE process did not say hello");
    };
    loop {
        let (keys, read, imm) = match next()? {
            PeerCommand::Prepare { keys, read, imm } => (keys, read, imm),
            PeerCommand::Exit => break,
            other => bail!("unexpected {other:?}"),
        };
        let mut pass = || -> Result<(f64, f64)> {
            if !read {
                for (slot, &k) in keys.iter().take(2).enumerate() {
                    staging.read(&engine, &mut store, k, slot)?;
                }
            }
            say(&PeerReply::Ready)?;
            if !matches!(next()?, PeerCommand::Go) {
                bail!("expected go");
            }
            let started = Instant::now();
            let mut read_s = 0.0;
            for (i, &k) in keys.iter().enumerate() {
                let slot = i % 2;
                if read {
                    // Waits for this slot's last send, then reads while the other slot's
                    // block is being written.
                    staging.wait(&engine, slot)?;
                    let t = Instant::now();
                    staging.read(&engine, &mut store, k, slot)?;
                    read_s += t.elapsed().as_secs_f64();
                }
                let page = u32::try_from(i)?
                    .checked_mul(layout.layers)
                    .ok_or_else(|| anyhow!("page overflow"))?;
                staging.send_layers(&engine, slot, &inbox, page, Some(imm))?;
            }
            staging.wait(&engine, 0)?;
            staging.wait(&engine, 1)?;
            Ok((read_s, started.elapsed().as_secs_f64()))
        };
        match pass() {
            Ok((read_s, total_s)) => say(&PeerReply::Done { read_s, total_s })?,
            Err(e) => say(&PeerReply::Failed(e.to_string()))?,
        }
    }
    engine.shutdown();
    Ok(())
}

impl fmt::Display for KvPathReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cached KV to a prefill engine, {} blocks of {:.1} MB ({} layers, one paged write each) from {}, over {} ({})",
            self.blocks,
            self.block_bytes as f64 / 1e6,
            self.layers,
            self.dir,
            self.provider,
            self.machine
        )?;
        for p in &self.paths {
            let rounds: Vec<String> = p.rounds_mb_s.iter().map(|r| format!("{r:.0}")).collect();
            writeln!(
                f,
                "  {:<40} median {:>6.0} MB/s, best {:>6.0}  (rounds: {})",
                p.what,
                p.median_mb_s,
                p.best_mb_s,
                rounds.join(", ")
            )?;
        }
        writeln!(
            f,
            "  the DE's reads within its path: {:.0} MB/s",
            self.de_read_mb_s
        )?;
        writeln!(
            f,
            "  DE path / direct: {:.2}x (medians), {:.2}x (best rounds); {} of {} landed blocks match the store's checksums",
            self.de_path_ratio, self.de_path_ratio_best, self.matched, self.checked
        )?;
        writeln!(
            f,
            "  as simulator constants: kvroute simulate dualpath --snic-gbps {:.1} --cnic-gbps {:.1}",
            self.implied_snic_gbps, self.implied_cnic_gbps
        )
    }
}
