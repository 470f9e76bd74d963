//! A discrete-event simulation of a PD-disaggregated cluster loading cached KV from storage
//! (paper 003), driven by the [`DualPath`] scheduler under any of its policies.
//!
//! Resources:
//!
//! - one storage NIC per node (`snic_gbps`, section 7.2: 400 Gbps, shared by the node's
//!   engines), a FIFO of reads; a request's cached KV (`hit_tokens x kv_bytes_per_token`) is
//!   read through the PE's node or the DE's node as the scheduler decides;
//! - one compute NIC per engine (`cnic_gbps`, 400 Gbps), a FIFO for the hop that brings a
//!   request's cached KV into the PE's HBM once it is read: on the PE path through the PE's
//!   NIC (section 5.2's CNIC-assisted host-to-device copy), on the DE path through the DE's NIC
//!   and the PE's (the request is ready when both are through). The hop is taken whole before
//!   prefill starts, where the paper overlaps it layer by layer: conservative by one hop. The
//!   rest of the compute-NIC traffic (the prompt's KV to the DE after prefill) is counted, not
//!   queued: section 4.2 shows it is not the bottleneck at practical P/D ratios, and
//!   `cnic_peak_utilization` says how far from it a run was;
//! - prefill nodes run forward passes in lock step (one expert-parallel group per node). Each
//!   PE fills its part of the batch FIFO under the compute quota of section 6.2 (predicted
//!   attention time at most `compute_quota_s`, the last request chunked by binary search);
//!   a pass takes the slowest PE's attention time plus the FFN time of all the node's tokens
//!   spread over its GPUs;
//! - decode engines hold a request from the moment its KV arrives for `gen_tokens x tpot_s`
//!   (HBM reserved by the scheduler at placement).
//!
//! The same request stream runs under each policy; `throughput_ratio` compares makespans.
//! Balance is paper 003's max/avg: storage-NIC read bytes per `balance_window_s` across all
//! nodes (figure 13), and attention time across the PEs of one forward pass (figure 14),
//! both averaged over the loaded phase, until half of the requests have finished.

use std::collections::VecDeque;

use serde::Serialize;

use crate::des::{EventQueue, FifoLink, Nanos, nanos, seconds};
use crate::dualpath::{DualPath, Placement, Policy, ReadSide, Request, Requeued, pack_forward};
use crate::error::{Result, SchedError};
use crate::stats::{Percentiles, max_over_avg};
use crate::window_totals::WindowTotals;

mod arrivals;
mod config;

use arrivals::mean_request;
pub use arrivals::{AgenticSpec, Arrivals, Turn, trace_arrivals};
pub use config::{ClusterConfig, ModelProfile};

/// A point of the time series (for plots).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SeriesPoint {
    /// Window start, seconds.
    pub t_s: f64,
    /// Prompt and generated tokens finished in the window, per second.
    pub tokens_per_s: f64,
    /// Storage-NIC read bytes max/avg across nodes in the window (`None`: no reads).
    pub snic_max_over_avg: Option<f64>,
    /// Mean over the window's forward passes of PE attention-time max/avg (`None`: none).
    pub attention_max_over_avg: Option<f64>,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct DualPathRun {
    /// The policy.
    pub policy: &'static str,
    /// Requests.
    pub requests: u64,
    /// Time of the last completion, seconds (the offline JCT).
    pub makespan_s: f64,
    /// Requests finished per second over the makespan.
    pub throughput_rps: f64,
    /// Prompt and generated tokens finished per second over the makespan.
    pub throughput_tokens_per_s: f64,
    /// Arrival to end of prefill (first token), seconds.
    pub ttft_s: Percentiles,
    /// Time between tokens, seconds (the configured decode step).
    pub tbt_s: f64,
    /// Storage-NIC read bytes per node.
    pub snic_read_bytes: Vec<f64>,
    /// Storage-NIC write bytes per node (new blocks persisted by the DEs).
    pub snic_write_bytes: Vec<f64>,
    /// Mean over loaded-phase windows of storage-NIC max/avg.
    pub snic_balance: Option<f64>,
    /// Mean over loaded-phase forward passes of PE attention-time max/avg.
    pub attention_balance: Option<f64>,
    /// Fraction of cached bytes read on the DE side.
    pub decode_side_read_fraction: f64,
    /// Compute-NIC bytes per engine, busiest engine, over its capacity for the makespan.
    pub cnic_peak_utilization: f64,
    /// Mean busy fraction of the prefill nodes.
    pub prefill_busy: f64,
    /// Events simulated.
    pub events: u64,
    /// Per-window series (for plots; left out of JSON): a point for every window in which
    /// something happened, and for each stretch of idle windows between them only its first
    /// and last window, so that a line through the points is the line through every window
    /// and a trace with long gaps costs no point per idle second.
    #[serde(skip)]
    pub series: Vec<SeriesPoint>,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrive(u32),
    ReadDone(u32),
    Landed(u32),
    ForwardDone(u32),
    DecodeDone(u32),
    Fail(u32),
}

#[derive(Debug, Clone, Copy)]
struct Live {
    request: Request,
    arrival: Nanos,
    agent: u32,
    turn: u32,
    remaining: u64,
    pe: u32,
    de: u32,
    read: ReadSide,
    /// Bumped when the request is requeued, so stale events of an earlier placement are
    /// recognised and dropped.
    epoch: u32,
    done: bool,
    /// Whether a first token was produced (a request restarted after a DE failure keeps its
    /// first TTFT).
    first_token: bool,
}

/// A failure to inject: engine `engine` dies at `at_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Failure {
    /// Seconds from the start.
    pub at_s: f64,
    /// The engine.
    pub engine: u32,
}

struct Sim<'a> {
    cfg: &'a ClusterConfig,
    policy: Policy,
    /// Requests in all (agents' later turns included).
    total: usize,
    sched: DualPath,
    q: EventQueue<(Event, u32)>,
    live: Vec<Live>,
    agents: &'a [Vec<Turn>],
    snic_read: Vec<FifoLink>,
    snic_write: Vec<f64>,
    cnic: Vec<f64>,
    cnic_link: Vec<FifoLink>,
    ready: Vec<VecDeque<u32>>,
    node_busy: Vec<bool>,
    /// The batches of each node's pass in flight: (request, tokens computed, its epoch).
    batch: Vec<Vec<(u32, u64, u32)>>,
    busy_ns: Vec<u64>,
    windows: WindowTotals,
    /// Attention max/avg of each forward pass, at its start.
    attention: Vec<(Nanos, f64)>,
    ttft: Vec<f64>,
    completions: Vec<Nanos>,
    decode_side_bytes: f64,
    read_bytes: f64,
    placements: Vec<Placement>,
    requeued: Vec<Requeued>,
    finished_tokens: f64,
}

impl Sim<'_> {
    fn new_request(&mut self, request: Request, arrival: Nanos, agent: u32, turn: u32) -> u32 {
        let i = self.live.len() as u32;
        self.live.push(Live {
            request,
            arrival,
            agent,
            turn,
            remaining: request.miss_tokens,
            pe: 0,
            de: 0,
            read: ReadSide::Prefill,
            epoch: 0,
            done: false,
            first_token: false,
        });
        i
    }

    fn agent_request(&mut self, agent: u32, turn: u32, context: u64, now: Nanos) -> u32 {
        let t = self.agents[agent as usize][turn as usize];
        let b = self.cfg.block_tokens;
        let hit = context / b * b;
        let id = self.live.len() as u64;
        let request = Request {
            id,
            hit_tokens: hit,
            miss_tokens: context - hit + t.append,
            gen_tokens: t.generate,
        };
        self.new_request(request, now, agent, turn)
    }

    fn schedule(&mut self, now: Nanos) {
        let mut placements = std::mem::take(&mut self.placements);
        self.sched.schedule(&mut placements);
        for p in placements.drain(..) {
            let i = p.request.id as u32;
            let l = &mut self.live[i as usize];
            l.pe = p.pe;
            l.de = p.de;
            l.read = p.read;
            l.remaining = p.request.miss_tokens;
            let epoch = l.epoch;
            let bytes = p.request.hit_tokens as f64 * self.cfg.model.kv_bytes_per_token;
            let link = &mut self.snic_read[p.read_node as usize];
            let end = link.push(now, bytes);
            let took = nanos(bytes / (self.cfg.snic_gbps * 1e9 / 8.0));
            self.windows
                .add_read(p.read_node, end.saturating_sub(took), end, bytes);
            self.read_bytes += bytes;
            let pe_cnic = bytes + p.request.tokens() as f64 * self.cfg.model.kv_bytes_per_token;
            match p.read {
                ReadSide::Prefill => {
                    self.cnic[p.pe as usize] += pe_cnic;
                    self.cnic[p.de as usize] +=
                        p.request.tokens() as f64 * self.cfg.model.kv_bytes_per_token;
                }
                ReadSide::Decode => {
                    self.decode_side_bytes += bytes;
                    let new = p.request.miss_tokens as f64 * self.cfg.model.kv_bytes_per_token;
                    self.cnic[p.pe as usize] += bytes + new;
                    self.cnic[p.de as usize] += bytes + new;
                }
            }
            self.q.at(end, (Event::ReadDone(i), epoch));
        }
        self.placements = placements;
    }

    fn start_forward(&mut self, node: u32, now: Nanos) {
        if self.node_busy[node as usize] {
            return;
        }
        let per = self.cfg.topology.engines_per_node;
        let mut attn = Vec::with_capacity(per as usize);
        let mut batch = std::mem::take(&mut self.batch[node as usize]);
        batch.clear();
        let mut new_tokens = 0u64;
        for e in node * per..(node + 1) * per {
            let ready = &self.ready[e as usize];
            let live = &self.live;
            let (model, flops) = (&self.cfg.model, self.cfg.gpu_flops);
            let spent = pack_forward(
                ready.iter().map(|&i| {
                    let l = &live[i as usize];
                    (l.request.tokens() - l.remaining, l.remaining)
                }),
                self.cfg.compute_quota_s,
                |cached, n| model.attention_flops(cached, n) / flops,
                |k, take| {
                    let i = ready[k];
                    new_tokens += take;
                    batch.push((i, take, live[i as usize].epoch));
                },
            );
            attn.push(spent);
        }
        if batch.is_empty() {
            self.batch[node as usize] = batch;
            return;
        }
        let ffn = new_tokens as f64 * self.cfg.model.linear_flops_per_token
            / (f64::from(per) * self.cfg.gpu_flops);
        let slowest = attn.iter().copied().fold(0.0, f64::max);
        if let Some(b) = max_over_avg(&attn) {
            self.attention.push((now, b));
        }
        let took = nanos(slowest + ffn).max(1);
        self.busy_ns[node as usize] += took;
        self.node_busy[node as usize] = true;
        self.batch[node as usize] = batch;
        self.q.after(took, (Event::ForwardDone(node), 0));
    }

    fn forward_done(&mut self, node: u32, now: Nanos) {
        self.node_busy[node as usize] = false;
        let batch = std::mem::take(&mut self.batch[node as usize]);
        for &(i, took, epoch) in &batch {
            let l = &mut self.live[i as usize];
            if l.epoch != epoch || l.done {
                // Requeued by a failure while in the pass: its progress is lost.
                continue;
            }
            l.remaining = l.remaining.saturating_sub(took);
            if l.remaining > 0 {
                continue;
            }
            let pe = l.pe;
            let r = l.request;
            if let Some(pos) = self.ready[pe as usize].iter().position(|&x| x == i) {
                self.ready[pe as usize].remove(pos);
            }
            if !l.first_token {
                l.first_token = true;
                self.ttft.push(seconds(now - l.arrival));
            }
            self.sched.prefill_done(r.id);
            // The KV reaches the DE over the compute network (not a bottleneck: counted at
            // placement); decoding starts at once in the HBM reserved for it.
            self.q.after(
                nanos(r.gen_tokens as f64 * self.cfg.tpot_s),
                (Event::DecodeDone(i), epoch),
            );
        }
        self.batch[node as usize] = batch;
        self.start_forward(node, now);
    }
}

impl<'a> Sim<'a> {
    /// A cluster at time 0 with `arrivals` and `failures` scheduled.
    fn new(
        cfg: &'a ClusterConfig,
        policy: Policy,
        arrivals: &'a Arrivals,
        failures: &[Failure],
    ) -> Result<Self> {
        cfg.validate()?;
        let total = arrivals.requests();
        if total == 0 {
            return Err(SchedError::EmptyWorkload);
        }
        if total > u32::MAX as usize {
            return Err(SchedError::OutOfRange {
                name: "requests",
                value: total as f64,
                range: "at most 2^32 - 1",
            });
        }
        let (mean_tokens, mean_new) = mean_request(arrivals);
        let topo = cfg.topology;
        let nodes = topo.nodes() as usize;
        let engines = topo.engines() as usize;
        let mut sim = Sim {
            cfg,
            policy,
            total,
            sched: DualPath::new(topo, cfg.sched_config(policy, mean_tokens, mean_new))?,
            q: EventQueue::new(),
            live: Vec::with_capacity(total),
            agents: match arrivals {
                Arrivals::Agents(a) => a.as_slice(),
                Arrivals::Open(_) => &[],
            },
            snic_read: (0..nodes)
                .map(|_| FifoLink::new(cfg.snic_gbps * 1e9 / 8.0))
                .collect(),
            snic_write: vec![0.0; nodes],
            cnic: vec![0.0; engines],
            cnic_link: (0..engines)
                .map(|_| FifoLink::new(cfg.cnic_gbps * 1e9 / 8.0))
                .collect(),
            ready: vec![VecDeque::new(); engines],
            node_busy: vec![false; nodes],
            batch: vec![Vec::new(); nodes],
            busy_ns: vec![0; nodes],
            windows: WindowTotals::new(nanos(cfg.balance_window_s).max(1), nodes),
            attention: Vec::new(),
            ttft: Vec::with_capacity(total),
            completions: Vec::with_capacity(total),
            decode_side_bytes: 0.0,
            read_bytes: 0.0,
            placements: Vec::new(),
            requeued: Vec::new(),
            finished_tokens: 0.0,
        };
        match arrivals {
            Arrivals::Open(requests) => {
                for (n, &(at, r)) in requests.iter().enumerate() {
                    let i = sim.new_request(Request { id: n as u64, ..r }, at, u32::MAX, 0);
                    sim.q.at(at, (Event::Arrive(i), 0));
                }
            }
            Arrivals::Agents(a) => {
                for (agent, turns) in a.iter().enumerate() {
                    if !turns.is_empty() {
                        let i = sim.agent_request(agent as u32, 0, 0, 0);
                        sim.q.at(0, (Event::Arrive(i), 0));
                    }
                }
            }
        }
        for f in failures {
            sim.q.at(nanos(f.at_s), (Event::Fail(f.engine), 0));
        }
        Ok(sim)
    }

    /// Pops events until none is left.
    fn run(&mut self) -> Result<()> {
        let topo = self.cfg.topology;
        while let Some((now, (event, epoch))) = self.q.pop() {
            match event {
                Event::Arrive(i) => {
                    self.sched.submit(self.live[i as usize].request)?;
                    self.schedule(now);
                }
                Event::ReadDone(i) => self.read_done(i, epoch, now),
                Event::Landed(i) => {
                    let l = self.live[i as usize];
                    if l.epoch != epoch || l.done {
                        continue;
                    }
                    self.ready[l.pe as usize].push_back(i);
                    self.start_forward(topo.node_of(l.pe), now);
                    self.schedule(now);
                }
                Event::ForwardDone(node) => {
                    self.forward_done(node, now);
                    self.schedule(now);
                }
                Event::DecodeDone(i) => self.decode_done(i, epoch, now),
                Event::Fail(e) => self.engine_failed(e, now),
            }
        }
        Ok(())
    }

    fn read_done(&mut self, i: u32, epoch: u32, now: Nanos) {
        let l = self.live[i as usize];
        if l.epoch != epoch || l.done {
            return;
        }
        self.sched.read_done(l.request.id);
        // The hop into the PE's HBM.
        let bytes = l.request.hit_tokens as f64 * self.cfg.model.kv_bytes_per_token;
        let mut landed = self.cnic_link[l.pe as usize].push(now, bytes);
        if l.read == ReadSide::Decode {
            landed = landed.max(self.cnic_link[l.de as usize].push(now, bytes));
        }
        self.q.at(landed, (Event::Landed(i), epoch));
    }

    fn decode_done(&mut self, i: u32, epoch: u32, now: Nanos) {
        let l = self.live[i as usize];
        if l.epoch != epoch || l.done {
            return;
        }
        self.live[i as usize].done = true;
        self.sched.decode_done(l.request.id);
        let r = l.request;
        let kv_bytes_per_token = self.cfg.model.kv_bytes_per_token;
        let node = self.cfg.topology.node_of(l.de) as usize;
        self.snic_write[node] += (r.miss_tokens + r.gen_tokens) as f64 * kv_bytes_per_token;
        self.completions.push(now);
        let tokens = (r.tokens() + r.gen_tokens) as f64;
        self.finished_tokens += tokens;
        self.windows.add_done(now, tokens);
        let agents = self.agents;
        if l.agent != u32::MAX && ((l.turn + 1) as usize) < agents[l.agent as usize].len() {
            let context = r.tokens() + r.gen_tokens;
            let next = self.agent_request(l.agent, l.turn + 1, context, now);
            self.q.at(now, (Event::Arrive(next), 0));
        }
        self.schedule(now);
    }

    fn engine_failed(&mut self, e: u32, now: Nanos) {
        let mut requeued = std::mem::take(&mut self.requeued);
        requeued.clear();
        self.sched.engine_failed(e, &mut requeued);
        for r in &requeued {
            let i = r.request.id as usize;
            self.live[i].epoch += 1;
            let pe = r.was.pe as usize;
            if let Some(pos) = self.ready[pe].iter().position(|&x| x == i as u32) {
                self.ready[pe].remove(pos);
            }
            // A pass in flight that holds it keeps its slot; its progress is dropped by the
            // epoch check of `forward_done` (the request starts over).
            self.live[i].remaining = r.request.miss_tokens;
        }
        self.requeued = requeued;
        // A dead PE's queued work is gone with it.
        if (e as usize) < self.ready.len() {
            self.ready[e as usize].clear();
        }
        self.schedule(now);
    }

    /// What the run measured; an error if requests were left unfinished.
    fn report(mut self) -> Result<DualPathRun> {
        let (cfg, total) = (self.cfg, self.total);
        let completed = self.completions.len();
        if completed != total {
            return Err(SchedError::OutOfRange {
                name: "requests unfinished",
                value: (total - completed) as f64,
                range: "0: no engine left that can serve them",
            });
        }
        let makespan = self.completions.iter().copied().max().unwrap_or(0);
        let makespan_s = seconds(makespan).max(1e-9);
        let mut sorted = self.completions.clone();
        sorted.sort_unstable();
        let half = sorted[(completed - 1) / 2];
        let summary = self.windows.summarise(&self.attention, half);
        let loaded_attention: Vec<f64> = self
            .attention
            .iter()
            .filter(|(t, _)| *t <= half)
            .map(|&(_, b)| b)
            .collect();
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        let cnic_capacity = cfg.cnic_gbps * 1e9 / 8.0 * makespan_s;
        let prefill_nodes = cfg.topology.prefill_nodes as usize;
        Ok(DualPathRun {
            policy: self.policy.name(),
            requests: total as u64,
            makespan_s,
            throughput_rps: completed as f64 / makespan_s,
            throughput_tokens_per_s: self.finished_tokens / makespan_s,
            ttft_s: Percentiles::of(&mut self.ttft),
            tbt_s: cfg.tpot_s,
            snic_read_bytes: self.snic_read.iter().map(|l| l.bytes).collect(),
            snic_write_bytes: self.snic_write,
            snic_balance: mean(&summary.balances),
            attention_balance: mean(&loaded_attention),
            decode_side_read_fraction: self.decode_side_bytes / self.read_bytes.max(1.0),
            cnic_peak_utilization: self.cnic.iter().copied().fold(0.0, f64::max) / cnic_capacity,
            prefill_busy: self.busy_ns[..prefill_nodes]
                .iter()
                .map(|&b| seconds(b))
                .sum::<f64>()
                / (prefill_nodes as f64 * makespan_s),
            events: self.q.popped(),
            series: summary.series,
        })
    }
}

/// Runs `arrivals` through the cluster under `policy`, with `failures` injected.
pub fn simulate(
    cfg: &ClusterConfig,
    policy: Policy,
    arrivals: &Arrivals,
    failures: &[Failure],
) -> Result<DualPathRun> {
    let mut sim = Sim::new(cfg, policy, arrivals, failures)?;
    sim.run()?;
    sim.report()
}

/// Every policy on the same arrivals.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// DualPath, round robin, storage-to-prefill only.
    pub runs: Vec<DualPathRun>,
    /// DualPath's throughput over the storage-to-prefill baseline's (makespan ratio).
    pub throughput_ratio_vs_prefill_read: f64,
    /// DualPath's over round robin's.
    pub throughput_ratio_vs_round_robin: f64,
}

/// Runs DualPath and both baselines on `arrivals`.
pub fn compare(cfg: &ClusterConfig, arrivals: &Arrivals) -> Result<Comparison> {
    let runs = Policy::ALL
        .iter()
        .map(|&p| simulate(cfg, p, arrivals, &[]))
        .collect::<Result<Vec<_>>>()?;
    Ok(Comparison {
        throughput_ratio_vs_prefill_read: runs[2].makespan_s / runs[0].makespan_s,
        throughput_ratio_vs_round_robin: runs[1].makespan_s / runs[0].makespan_s,
        runs,
    })
}

#[cfg(test)]
mod tests;
