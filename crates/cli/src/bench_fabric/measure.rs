//! The measuring side of `bench fabric`: this process connected to its peer, each figure
//! measured beside fi_pingpong and the bare NIC, and the targets the figures are held to.

use std::time::Duration;

use anyhow::{Result, anyhow};
use kvroute_transport::fabric::bench::{self, Pingpong, RawEndpoint, Stream};
use kvroute_transport::{FabricReport, RegisteredBuffer, TransferEngine};

use super::{
    BANDWIDTH_RATIO_TARGET, BUFFER, Compared, Hello, LATENCY_RATIO_TARGET, LATENCY_ROUNDS,
    PAGED_BYTES, PAGED_WINDOW, PAGES, PINGPONG_PORT, PagedRow, Path, Peer, PeerCommand, SINGLE,
    WINDOW, fabric_config, iters_for, middle_run_by, open, paged_ratio_target, progress_of,
    round_order,
};
use crate::args::FabricBenchArgs;
use crate::bench::Target;

/// This process and the peer, connected: the engines' buffers exchanged and the bare NICs'
/// endpoints connected, with how long and how often each figure is measured.
pub(super) struct TwoProcesses {
    /// The peer process (told to exit when this is dropped, before this side's engine).
    peer: Peer,
    /// The peer's addresses and buffer.
    hello: Hello,
    /// This side's bare NIC.
    raw: RawEndpoint,
    /// This side's engine's buffer, registered.
    buf: RegisteredBuffer,
    engine: TransferEngine,
    /// The provider's name, for fi_pingpong.
    pub(super) provider: String,
    /// Rounds each figure is the median of, the round trip's aside.
    pub(super) rounds: usize,
    /// Rounds of the round trip.
    pub(super) latency_rounds: usize,
    /// About how long one ping-pong runs.
    budget: Duration,
    quick: bool,
}

impl TwoProcesses {
    /// Starts the peer and connects to it: its engine and bare NIC, and this side's, which
    /// opened this side's `fabric`.
    pub(super) fn connect(
        args: &FabricBenchArgs,
        provider: String,
        node: Option<&str>,
        manual: bool,
    ) -> Result<(Self, FabricReport)> {
        let mut peer = Peer::start(&args.provider, node, manual)?;
        let hello: Hello = peer.recv()?;
        let (engine, fabric) = open(&args.provider, node, progress_of(manual))?;
        let buf = engine.alloc_mr(BUFFER)?;
        let mut raw = RawEndpoint::open(&fabric_config(&args.provider, node, false)?, BUFFER)?;
        raw.connect(&hello.raw)?;
        peer.send(&Hello {
            addr: engine.main_address(),
            desc: buf.desc().clone(),
            raw: raw.address(),
        })?;
        let two = Self {
            peer,
            hello,
            raw,
            buf,
            engine,
            provider,
            rounds: if args.quick { 1 } else { 3 },
            latency_rounds: if args.quick { 1 } else { LATENCY_ROUNDS },
            budget: Duration::from_millis(if args.quick { 60 } else { 300 }),
            quick: args.quick,
        };
        Ok((two, fabric))
    }

    /// One ping-pong with the peer answering: through the engines, or on the bare NICs.
    fn pingpong(&mut self, raw_path: bool, size: u64, iters: u64) -> Result<Pingpong> {
        let warmup = (iters / 10).max(2);
        let count = warmup + iters;
        if raw_path {
            self.peer.send(&PeerCommand::AnswerRaw {
                parent: self.raw.address(),
                size,
                count,
            })?;
        } else {
            self.peer.send(&PeerCommand::Answer { size, count })?;
        }
        let result = if raw_path {
            self.raw.pingpong(size, warmup, iters)
        } else {
            bench::pingpong(
                &self.engine,
                &self.buf,
                &self.hello.desc,
                size,
                warmup,
                iters,
            )
        };
        let answered: Result<(), String> = self.peer.recv()?;
        answered.map_err(|e| anyhow!("the peer: {e}"))?;
        Ok(result?)
    }

    /// fi_pingpong on the same provider.
    fn fi(&self, size: u64, iters: u64) -> Result<Pingpong> {
        bench::fi_pingpong(&self.provider, size, iters, PINGPONG_PORT).map_err(|e| anyhow!(e))
    }

    /// The engine's ping-pong at `size` beside fi_pingpong's at `fi_size` and the bare NICs',
    /// by usec/xfer (`latency`) or MB/s.
    ///
    /// Rounds interleave the three, so drift on this shared machine hits each alike, and
    /// rotate their order, so each path runs first in a round (right after the peer process
    /// slept, when the host places its processor anew) as often as the others.
    pub(super) fn compare(&mut self, size: u64, fi_size: u64, latency: bool) -> Result<Compared> {
        let iters = iters_for(size, self.budget, self.quick);
        let (mut mine, mut theirs, mut bare) = (Vec::new(), Vec::new(), Vec::new());
        let rounds = if latency {
            self.latency_rounds
        } else {
            self.rounds
        };
        for round in 0..rounds {
            for path in round_order(round) {
                match path {
                    Path::Engine => mine.push(self.pingpong(false, size, iters)?),
                    Path::FiPingpong => theirs.push(self.fi(fi_size, iters)?),
                    Path::Bare => bare.push(self.pingpong(true, size, iters)?),
                }
            }
        }
        let key = |p: &Pingpong| if latency { p.usec_per_xfer } else { p.mb_per_s };
        let (engine, fi_pingpong, raw) = (
            middle_run_by(mine, key),
            middle_run_by(theirs, key),
            middle_run_by(bare, key),
        );
        Ok(Compared {
            size,
            ratio: key(&engine) / key(&fi_pingpong),
            over_raw: key(&engine) / key(&raw),
            engine,
            fi_pingpong,
            raw,
        })
    }

    /// Single writes streamed, `WINDOW` in flight, at every size of `SINGLE`, the peer
    /// serving.
    pub(super) fn streams(&mut self) -> Result<Vec<Stream>> {
        self.peer.send(&PeerCommand::Serve)?;
        let mut streams = Vec::new();
        for &size in SINGLE {
            let count = (PAGED_BYTES * 4 / size).clamp(16, 4096) / if self.quick { 4 } else { 1 };
            let runs = (0..self.rounds)
                .map(|_| {
                    bench::stream(
                        &self.engine,
                        &self.buf,
                        &self.hello.desc,
                        size,
                        count,
                        WINDOW,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            streams.push(middle_run_by(runs, |s| s.mb_per_s));
        }
        self.peer.send(&PeerCommand::Rest)?;
        Ok(streams)
    }

    /// Paged transfers at every page size of `PAGES`, beside fi_pingpong and the bare NIC.
    ///
    /// Paged rounds interleave and rotate the engine, fi_pingpong and the bare NIC as the
    /// ping-pongs do.
    pub(super) fn paged(&mut self) -> Result<Vec<PagedRow>> {
        let mut paged = Vec::new();
        for &page in PAGES {
            let pages = PAGED_BYTES / page / if self.quick { 4 } else { 1 };
            let (mut mine, mut bare, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..self.rounds {
                for path in round_order(round) {
                    match path {
                        Path::Engine => mine.push(self.paged_transfer(page, pages)?),
                        Path::Bare => bare.push(self.bare_pages(page, pages)?),
                        Path::FiPingpong => {
                            theirs.push(self.fi(page, iters_for(page, self.budget, self.quick))?);
                        }
                    }
                }
            }
            paged.push(PagedRow {
                engine: middle_run_by(mine, |s| s.mb_per_s),
                fi_pingpong: middle_run_by(theirs, |p| p.mb_per_s),
                raw: middle_run_by(bare, |s| s.mb_per_s),
            });
        }
        Ok(paged)
    }

    /// One paged transfer of `pages` pages of `page` bytes through the engines, the peer
    /// serving.
    fn paged_transfer(&mut self, page: u64, pages: u64) -> Result<Stream> {
        self.peer.send(&PeerCommand::Serve)?;
        let transfer = bench::paged(
            &self.engine,
            &self.buf,
            &self.hello.desc,
            page,
            pages as u32,
        );
        self.peer.send(&PeerCommand::Rest)?;
        Ok(transfer?)
    }

    /// As many page writes streamed on the bare NICs, the peer absorbing them.
    fn bare_pages(&mut self, page: u64, pages: u64) -> Result<Stream> {
        self.peer.send(&PeerCommand::AbsorbRaw {
            parent: self.raw.address(),
            count: pages,
        })?;
        let streamed = self.raw.stream(page, pages, PAGED_WINDOW);
        let absorbed: Result<(), String> = self.peer.recv()?;
        absorbed.map_err(|e| anyhow!("the peer: {e}"))?;
        Ok(streamed?)
    }
}

/// The targets, each with its bound: the bare NIC measured against the same fi_pingpong
/// figure, so a target the provider's own RMA path misses shows as such.
pub(super) fn targets(
    provider: &str,
    round_trip: &Compared,
    single: &[Compared],
    paged: &[PagedRow],
) -> Vec<Target> {
    let bare = |ratio: f64| Some(format!("bare NIC / fi_pingpong {ratio:.2}"));
    let mut targets = vec![Target {
        what: "immediate-only round trip, engine / fi_pingpong usec/xfer",
        target: "<= 1.2",
        measured: round_trip.ratio,
        met: round_trip.ratio <= LATENCY_RATIO_TARGET,
        bound: bare(round_trip.raw.usec_per_xfer / round_trip.fi_pingpong.usec_per_xfer),
    }];
    for c in single {
        targets.push(Target {
            what: "single write >= 64 KiB, engine / fi_pingpong MB/s",
            target: ">= 0.9",
            measured: c.ratio,
            met: c.ratio >= BANDWIDTH_RATIO_TARGET,
            bound: bare(c.raw.mb_per_s / c.fi_pingpong.mb_per_s),
        });
    }
    let (paged_min, paged_target) = paged_ratio_target(provider);
    for p in paged.iter().filter(|p| p.engine.size == 1024) {
        let ratio = p.engine.mb_per_s / p.fi_pingpong.mb_per_s;
        targets.push(Target {
            what: "paged writes, 1 KiB pages, engine / fi_pingpong MB/s at 1 KiB",
            target: paged_target,
            measured: ratio,
            met: ratio >= paged_min,
            bound: bare(p.raw.mb_per_s / p.fi_pingpong.mb_per_s),
        });
    }
    targets
}
