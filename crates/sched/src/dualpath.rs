//! The DualPath scheduler (paper 003 section 6): which prefill engine (PE) and decode engine
//! (DE) take a request, and which side reads its cached KV from storage.
//!
//! A pure state machine. The caller reports what happens ([`DualPath::submit`],
//! [`DualPath::read_done`], [`DualPath::prefill_done`], [`DualPath::decode_done`],
//! [`DualPath::engine_failed`]) and asks for work ([`DualPath::schedule`]); the scheduler
//! keeps, per engine, the unfinished requests and tokens assigned to it (`req_e`, `tok_e`) and,
//! per node, the bytes queued on its storage NIC, which is what section 6.1's engines report
//! when they fetch.
//!
//! Policies:
//!
//! - [`Policy::DualPath`], section 6.1. PE groups fetch from one FIFO queue. A PE is
//!   overloaded when `tok_e > beta`; the others are split by their node's storage read queue
//!   (at most `alpha` bytes: preferred). The head request goes to the least-loaded (`tok_e`)
//!   PE of the preferred class, else of the other, and the fetch ends when both are empty. The
//!   DE is chosen in two phases: the DE group with the least `tok`, then within it a DE with
//!   room in HBM, preferring those at or below the group's mean `tok` and among them the
//!   fewest requests (else, among the high-token ones, the most free HBM). The read goes to
//!   the side whose node has the shorter read queue (the DE side on a tie).
//! - [`Policy::RoundRobin`]: both read paths, but engines taken in turn and read sides
//!   alternated, with no load information (the round-robin scheduling of section 7.5).
//! - [`Policy::PrefillRead`]: the baseline without DualPath: engines in turn, every read on
//!   the PE side (storage to prefill only).
//!
//! [`pack_forward`] is section 6.2's intra-engine scheduling: a PE's part of a forward pass
//! under the compute quota, the last request chunked.
//!
//! Simplification: the paper's DE groups fetch from their own queues; here the DE is picked in
//! the same step as the PE, with the same two-phase rule, so that the read side can be chosen
//! at once. A request is placed only when a DE has HBM for its whole KV at the end of decode.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::error::{Result, SchedError, count, positive};

/// Which policy places requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Section 6.1's inter-engine scheduler over both read paths.
    DualPath,
    /// Both read paths, engines and sides in turn.
    RoundRobin,
    /// Storage to prefill only, engines in turn (the baseline).
    PrefillRead,
}

impl Policy {
    /// Every policy, the one under test first.
    pub const ALL: [Policy; 3] = [Policy::DualPath, Policy::RoundRobin, Policy::PrefillRead];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Policy::DualPath => "dualpath",
            Policy::RoundRobin => "round-robin",
            Policy::PrefillRead => "prefill-read",
        }
    }
}

/// Which side reads a request's cached KV from storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReadSide {
    /// Storage -> PE buffer -> PE HBM (figure 4a).
    Prefill,
    /// Storage -> DE buffer -> PE HBM over the compute network (figure 4b).
    Decode,
}

/// Nodes and engines. Engines `0 .. prefill_nodes * engines_per_node` are PEs, the rest DEs;
/// engine `e` sits on node `e / engines_per_node`; a group is `nodes_per_group` consecutive
/// nodes of one role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Prefill nodes.
    pub prefill_nodes: u32,
    /// Decode nodes.
    pub decode_nodes: u32,
    /// Engines (GPUs) per node, each with its own compute NIC; the node's engines share one
    /// storage NIC.
    pub engines_per_node: u32,
    /// Nodes per scheduling group.
    pub nodes_per_group: u32,
}

impl Topology {
    /// Checks every count.
    pub fn validate(&self) -> Result<()> {
        count("prefill_nodes", u64::from(self.prefill_nodes))?;
        count("decode_nodes", u64::from(self.decode_nodes))?;
        count("engines_per_node", u64::from(self.engines_per_node))?;
        count("nodes_per_group", u64::from(self.nodes_per_group))?;
        let engines = (u64::from(self.prefill_nodes) + u64::from(self.decode_nodes))
            * u64::from(self.engines_per_node);
        if engines > u64::from(u32::MAX) {
            return Err(SchedError::OutOfRange {
                name: "engines",
                value: engines as f64,
                range: "at most 2^32 - 1",
            });
        }
        Ok(())
    }
    /// All nodes.
    pub fn nodes(&self) -> u32 {
        self.prefill_nodes + self.decode_nodes
    }
    /// All engines.
    pub fn engines(&self) -> u32 {
        self.nodes() * self.engines_per_node
    }
    /// Prefill engines.
    pub fn prefill_engines(&self) -> u32 {
        self.prefill_nodes * self.engines_per_node
    }
    /// The node of engine `e`.
    pub fn node_of(&self, e: u32) -> u32 {
        e / self.engines_per_node
    }
    /// Whether node `n` is a prefill node.
    pub fn is_prefill_node(&self, n: u32) -> bool {
        n < self.prefill_nodes
    }
}

/// The scheduler's constants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SchedConfig {
    /// Placement policy.
    pub policy: Policy,
    /// `alpha`: a node whose storage read queue holds at most this many bytes is preferred.
    pub short_read_queue_bytes: f64,
    /// `beta`: a PE with more unfinished tokens than this takes no new request.
    pub max_unfinished_tokens: f64,
    /// KV bytes a DE can hold in HBM.
    pub de_hbm_bytes: f64,
    /// KV bytes per token (all layers).
    pub kv_bytes_per_token: f64,
}

impl SchedConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        positive("short_read_queue_bytes", self.short_read_queue_bytes)?;
        positive("max_unfinished_tokens", self.max_unfinished_tokens)?;
        positive("de_hbm_bytes", self.de_hbm_bytes)?;
        positive("kv_bytes_per_token", self.kv_bytes_per_token)?;
        Ok(())
    }
}

/// One request (one turn of an agent, or one trace line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Unique id.
    pub id: u64,
    /// Tokens whose KV is read from storage.
    pub hit_tokens: u64,
    /// Tokens to prefill.
    pub miss_tokens: u64,
    /// Tokens to generate.
    pub gen_tokens: u64,
}

impl Request {
    /// Tokens of the prompt (section 6.1's per-request token count).
    pub fn tokens(&self) -> u64 {
        self.hit_tokens + self.miss_tokens
    }
    /// KV a DE holds at the end of decode.
    pub fn decode_bytes(&self, kv_bytes_per_token: f64) -> f64 {
        (self.tokens() + self.gen_tokens) as f64 * kv_bytes_per_token
    }
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// The request.
    pub request: Request,
    /// Its prefill engine.
    pub pe: u32,
    /// Its decode engine.
    pub de: u32,
    /// Who reads its cached KV.
    pub read: ReadSide,
    /// The node whose storage NIC reads it.
    pub read_node: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    placement: Placement,
    phase: Phase,
    read_pending: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct Engine {
    tok: u64,
    req: u32,
    hbm_used: f64,
    dead: bool,
}

/// The scheduler.
#[derive(Debug)]
pub struct DualPath {
    topo: Topology,
    config: SchedConfig,
    queue: VecDeque<Request>,
    engines: Vec<Engine>,
    /// Bytes queued on each node's storage NIC by this scheduler's placements.
    read_queue: Vec<f64>,
    held: HashMap<u64, Held>,
    next_pe: u32,
    next_de: u32,
    next_side: bool,
    next_group: u32,
    /// The smallest decode footprint (bytes) known to fit in no DE's HBM; infinite when none
    /// is known. Between frees ([`DualPath::decode_done`], [`DualPath::engine_failed`] reset
    /// it) HBM only fills and engines only die, so a queue head at least this large is
    /// blocked without a scan. Rescanning every DE on every event while the head waited held
    /// round robin to 0.53M events/s against 1.1M with this (conversation trace x 40, 42P84D,
    /// 5.1 GB of DE HBM; identical placements).
    blocked_need_bytes: f64,
    /// DEs examined for room, for [`DualPath::decode_engines_examined`].
    decode_engines_examined: u64,
}

/// A request lost to a failed engine, and what to do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requeued {
    /// The request, back at the head of the queue.
    pub request: Request,
    /// The placement it had.
    pub was: Placement,
}

impl DualPath {
    /// A scheduler with no requests and every engine alive.
    pub fn new(topo: Topology, config: SchedConfig) -> Result<Self> {
        topo.validate()?;
        config.validate()?;
        Ok(Self {
            topo,
            config,
            queue: VecDeque::new(),
            engines: vec![Engine::default(); topo.engines() as usize],
            read_queue: vec![0.0; topo.nodes() as usize],
            held: HashMap::new(),
            next_pe: 0,
            next_de: 0,
            next_side: false,
            next_group: 0,
            blocked_need_bytes: f64::INFINITY,
            decode_engines_examined: 0,
        })
    }

    /// The topology.
    pub fn topology(&self) -> Topology {
        self.topo
    }

    /// Requests waiting for placement.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Requests placed and not yet finished.
    pub fn in_flight(&self) -> usize {
        self.held.len()
    }

    /// Unfinished tokens assigned to engine `e` (`tok_e`).
    pub fn tokens_of(&self, e: u32) -> u64 {
        self.engines[e as usize].tok
    }

    /// DEs examined for HBM room so far: the work of placement, which a queue head that fits
    /// nowhere does not add to until HBM is freed.
    pub fn decode_engines_examined(&self) -> u64 {
        self.decode_engines_examined
    }

    /// Bytes queued on node `n`'s storage NIC.
    pub fn read_queue_bytes(&self, n: u32) -> f64 {
        self.read_queue[n as usize]
    }

    /// A request arrives (FIFO). A request that no DE could ever hold is refused.
    pub fn submit(&mut self, r: Request) -> Result<()> {
        let need = r.decode_bytes(self.config.kv_bytes_per_token);
        if need > self.config.de_hbm_bytes {
            return Err(SchedError::RequestTooLarge {
                request: r.id,
                needed_bytes: need as u64,
                hbm_bytes: self.config.de_hbm_bytes as u64,
            });
        }
        self.queue.push_back(r);
        Ok(())
    }

    /// Places as many waiting requests as the policy allows, in FIFO order.
    pub fn schedule(&mut self, out: &mut Vec<Placement>) {
        match self.config.policy {
            Policy::DualPath => self.schedule_dualpath(out),
            Policy::RoundRobin | Policy::PrefillRead => self.schedule_round_robin(out),
        }
    }

    /// The storage read of request `id` finished.
    pub fn read_done(&mut self, id: u64) {
        if let Some(h) = self.held.get_mut(&id)
            && h.read_pending
        {
            h.read_pending = false;
            let bytes = h.placement.request.hit_tokens as f64 * self.config.kv_bytes_per_token;
            let q = &mut self.read_queue[h.placement.read_node as usize];
            *q = (*q - bytes).max(0.0);
        }
    }

    /// Request `id` finished prefill; it now counts against its DE only.
    pub fn prefill_done(&mut self, id: u64) {
        let Some(h) = self.held.get_mut(&id) else {
            return;
        };
        if h.phase != Phase::Prefill {
            return;
        }
        h.phase = Phase::Decode;
        let p = h.placement;
        let pe = &mut self.engines[p.pe as usize];
        pe.tok = pe.tok.saturating_sub(p.request.tokens());
        pe.req = pe.req.saturating_sub(1);
    }

    /// Request `id` finished decoding; its DE's HBM is free again.
    pub fn decode_done(&mut self, id: u64) {
        let Some(h) = self.held.get(&id) else { return };
        if h.phase != Phase::Decode {
            return;
        }
        let p = h.placement;
        self.held.remove(&id);
        let de = &mut self.engines[p.de as usize];
        de.tok = de.tok.saturating_sub(p.request.tokens());
        de.req = de.req.saturating_sub(1);
        de.hbm_used =
            (de.hbm_used - p.request.decode_bytes(self.config.kv_bytes_per_token)).max(0.0);
        self.blocked_need_bytes = f64::INFINITY;
    }

    /// Engine `e` failed: it takes nothing more, and every unfinished request placed on it
    /// (as PE or DE) goes back to the head of the queue, in id order. Their other engine's
    /// accounting is released. Returns them, so the driver can cancel their work.
    pub fn engine_failed(&mut self, e: u32, requeued: &mut Vec<Requeued>) {
        if e as usize >= self.engines.len() || self.engines[e as usize].dead {
            return;
        }
        self.engines[e as usize].dead = true;
        let mut lost: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| {
                h.placement.pe == e && h.phase == Phase::Prefill || h.placement.de == e
            })
            .map(|(&id, _)| id)
            .collect();
        lost.sort_unstable();
        if !lost.is_empty() {
            // Their DEs' HBM is freed, and the queue has a new head.
            self.blocked_need_bytes = f64::INFINITY;
        }
        for &id in lost.iter().rev() {
            let Some(h) = self.held.remove(&id) else {
                continue;
            };
            let p = h.placement;
            if h.read_pending {
                let bytes = p.request.hit_tokens as f64 * self.config.kv_bytes_per_token;
                let q = &mut self.read_queue[p.read_node as usize];
                *q = (*q - bytes).max(0.0);
            }
            if h.phase == Phase::Prefill {
                let pe = &mut self.engines[p.pe as usize];
                pe.tok = pe.tok.saturating_sub(p.request.tokens());
                pe.req = pe.req.saturating_sub(1);
            }
            let de = &mut self.engines[p.de as usize];
            de.tok = de.tok.saturating_sub(p.request.tokens());
            de.req = de.req.saturating_sub(1);
            de.hbm_used =
                (de.hbm_used - p.request.decode_bytes(self.config.kv_bytes_per_token)).max(0.0);
            self.queue.push_front(p.request);
            requeued.push(Requeued {
                request: p.request,
                was: p,
            });
        }
        requeued.reverse();
    }

    fn place(&mut self, r: Request, pe: u32, de: u32, read: ReadSide, out: &mut Vec<Placement>) {
        let read_node = self.topo.node_of(match read {
            ReadSide::Prefill => pe,
            ReadSide::Decode => de,
        });
        let bytes = r.hit_tokens as f64 * self.config.kv_bytes_per_token;
        self.read_queue[read_node as usize] += bytes;
        for (e, tok) in [(pe, r.tokens()), (de, r.tokens())] {
            let eng = &mut self.engines[e as usize];
            eng.tok += tok;
            eng.req += 1;
        }
        self.engines[de as usize].hbm_used += r.decode_bytes(self.config.kv_bytes_per_token);
        let placement = Placement {
            request: r,
            pe,
            de,
            read,
            read_node,
        };
        self.held.insert(
            r.id,
            Held {
                placement,
                phase: Phase::Prefill,
                read_pending: r.hit_tokens > 0,
            },
        );
        if r.hit_tokens == 0 {
            // Nothing to read: the read is done at once.
            self.read_queue[read_node as usize] -= bytes;
        }
        out.push(placement);
    }

    /// Whether a request needing `need` bytes of DE HBM is known to fit in no DE.
    fn decode_blocked(&self, need: f64) -> bool {
        need >= self.blocked_need_bytes
    }

    fn de_fits(&self, e: u32, need: f64) -> bool {
        let eng = &self.engines[e as usize];
        !eng.dead && eng.hbm_used + need <= self.config.de_hbm_bytes
    }

    fn schedule_round_robin(&mut self, out: &mut Vec<Placement>) {
        let pes = self.topo.prefill_engines();
        let des = self.topo.engines() - pes;
        while let Some(&r) = self.queue.front() {
            let need = r.decode_bytes(self.config.kv_bytes_per_token);
            if self.decode_blocked(need) {
                return;
            }
            let Some(pe) = (0..pes)
                .map(|i| (self.next_pe + i) % pes)
                .find(|&e| !self.engines[e as usize].dead)
            else {
                return;
            };
            let mut examined = 0;
            let de = (0..des).map(|i| pes + (self.next_de + i) % des).find(|&e| {
                examined += 1;
                self.de_fits(e, need)
            });
            self.decode_engines_examined += examined;
            let Some(de) = de else {
                self.blocked_need_bytes = need;
                return;
            };
            self.queue.pop_front();
            self.next_pe = (pe + 1) % pes;
            self.next_de = (de - pes + 1) % des;
            let read = if self.config.policy == Policy::PrefillRead {
                ReadSide::Prefill
            } else {
                self.next_side = !self.next_side;
                if self.next_side {
                    ReadSide::Prefill
                } else {
                    ReadSide::Decode
                }
            };
            self.place(r, pe, de, read, out);
        }
    }

    fn schedule_dualpath(&mut self, out: &mut Vec<Placement>) {
        let t = self.topo;
        let groups = t.prefill_nodes.div_ceil(t.nodes_per_group);
        // Every PE group fetches in turn, starting after the one that fetched first last
        // time, until the queue is empty or no group takes anything.
        let mut idle = 0;
        let mut g = self.next_group % groups;
        self.next_group = (self.next_group + 1) % groups;
        while !self.queue.is_empty() && idle < groups {
            if self.fetch_prefill_group(g, out) == 0 {
                idle += 1;
            } else {
                idle = 0;
            }
            g = (g + 1) % groups;
        }
    }

    /// Section 6.1's PE scheduling for one group's fetch; returns how many it placed.
    fn fetch_prefill_group(&mut self, g: u32, out: &mut Vec<Placement>) -> usize {
        let t = self.topo;
        let first_node = g * t.nodes_per_group;
        let last_node = (first_node + t.nodes_per_group).min(t.prefill_nodes);
        let engines = first_node * t.engines_per_node..last_node * t.engines_per_node;
        let mut placed = 0;
        while let Some(&r) = self.queue.front() {
            if self.decode_blocked(r.decode_bytes(self.config.kv_bytes_per_token)) {
                // No DE has room: nothing to place, whichever PE would take it.
                break;
            }
            let mut best: [Option<(u64, u32)>; 2] = [None, None];
            for e in engines.clone() {
                let eng = &self.engines[e as usize];
                if eng.dead || eng.tok as f64 > self.config.max_unfinished_tokens {
                    continue;
                }
                let class = usize::from(
                    self.read_queue[t.node_of(e) as usize] > self.config.short_read_queue_bytes,
                );
                if best[class].is_none_or(|(tok, _)| eng.tok < tok) {
                    best[class] = Some((eng.tok, e));
                }
            }
            let Some((_, pe)) = best[0].or(best[1]) else {
                break;
            };
            let Some(de) = self.pick_de(r) else { break };
            self.queue.pop_front();
            let (pe_node, de_node) = (t.node_of(pe), t.node_of(de));
            // Ties go to the DE side: DE nodes outnumber PE nodes at practical P/D ratios,
            // and their NICs are otherwise idle.
            let read = if self.read_queue[de_node as usize] <= self.read_queue[pe_node as usize] {
                ReadSide::Decode
            } else {
                ReadSide::Prefill
            };
            self.place(r, pe, de, read, out);
            placed += 1;
        }
        placed
    }

    /// The two-phase DE choice: the DE group with the least `tok`, then within it.
    fn pick_de(&mut self, r: Request) -> Option<u32> {
        let t = self.topo;
        let need = r.decode_bytes(self.config.kv_bytes_per_token);
        let per_group = t.nodes_per_group * t.engines_per_node;
        let first = t.prefill_engines();
        let groups = t.decode_nodes.div_ceil(t.nodes_per_group);
        let group_range =
            |g: u32| first + g * per_group..(first + (g + 1) * per_group).min(t.engines());
        // Phase 1: groups by total tok, least first; a group with no DE that fits is skipped
        // (the paper's fetch would end there; skipping keeps the FIFO head moving).
        let mut order: Vec<(u64, u32)> = (0..groups)
            .map(|g| {
                (
                    group_range(g).map(|e| self.engines[e as usize].tok).sum(),
                    g,
                )
            })
            .collect();
        order.sort_unstable();
        for (total, g) in order {
            let range = group_range(g);
            let mean = total as f64 / range.len() as f64;
            let mut low: Option<(u32, u32)> = None;
            let mut high: Option<(f64, u32)> = None;
            self.decode_engines_examined += range.len() as u64;
            for e in range {
                if !self.de_fits(e, need) {
                    continue;
                }
                let eng = &self.engines[e as usize];
                if eng.tok as f64 <= mean {
                    if low.is_none_or(|(req, _)| eng.req < req) {
                        low = Some((eng.req, e));
                    }
                } else {
                    let free = self.config.de_hbm_bytes - eng.hbm_used;
                    if high.is_none_or(|(f, _)| free > f) {
                        high = Some((free, e));
                    }
                }
            }
            if let Some(e) = low.map(|l| l.1).or(high.map(|h| h.1)) {
                return Some(e);
            }
        }
        // Every DE was examined and none fits.
        self.blocked_need_bytes = need;
        None
    }
}

/// Section 6.2's intra-engine scheduling: one PE's part of a forward pass, packed FIFO from
/// its ready requests (`(cached tokens, tokens still to compute)` each) while the predicted
/// attention time `cost(cached, n)` stays within `quota_s`. The request that does not fit
/// whole is chunked: the longest prefix of its tokens that fits, found by binary search (one
/// token if the pass would otherwise be empty), and packing stops there. `take(k, n)` is told
/// each request taken (its index in the iterator) and how many tokens. Returns the predicted
/// attention seconds of the pass.
pub fn pack_forward(
    ready: impl IntoIterator<Item = (u64, u64)>,
    quota_s: f64,
    cost: impl Fn(u64, u64) -> f64,
    mut take: impl FnMut(usize, u64),
) -> f64 {
    let mut left = quota_s;
    let mut spent = 0.0;
    for (k, (cached, remaining)) in ready.into_iter().enumerate() {
        if remaining == 0 {
            continue;
        }
        let n = if cost(cached, remaining) <= left {
            remaining
        } else {
            let (mut lo, mut hi) = (0u64, remaining);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if cost(cached, mid) <= left {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            if lo == 0 && spent == 0.0 { 1 } else { lo }
        };
        if n == 0 {
            break;
        }
        let c = cost(cached, n);
        left -= c;
        spent += c;
        take(k, n);
        if n < remaining || left <= 0.0 {
            break;
        }
    }
    spent
}

#[cfg(test)]
mod tests;
