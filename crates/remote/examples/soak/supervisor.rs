//! The supervisor: the holder processes, the mix of children it keeps running and signals,
//! the malformed and flooding control connections it opens itself, its tally, and the checks
//! at the end (memory and fds flat, no exact step missing, no region left in `/dev/shm`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_remote::{Requester, RequesterConfig};
use kvroute_transport::{MemFabric, TransferEngine};

use crate::children::start_holder;
use crate::common::{Error, digest, footprint, shm_entries, shm_entries_of};
use kvroute_testkit::etcd::EtcdCluster;

use crate::hostile::{Poison, plant};
use crate::{ERRORED, HANG, LIVE, QUERIES, Rng, WRONG, calls, queries};

/// 20-60 silent control connections at once, held for 1-8 s: a newcomer must still get in.
fn connection_flood(addr: SocketAddr, rng: &mut Rng) {
    let n = rng.range(20, 60);
    let hold = rng.millis(1_000, 8_000);
    std::thread::spawn(move || {
        let held: Vec<TcpStream> = (0..n)
            .filter_map(|_| TcpStream::connect(addr).ok())
            .collect();
        std::thread::sleep(hold);
        drop(held);
    });
}

/// Garbage on a control connection; none of it may hurt the holder.
fn malformed_control(addr: SocketAddr, rng: &mut Rng) {
    let kind = rng.range(0, 4);
    let garbage: Vec<u8> = (0..rng.range(1, 2048)).map(|_| rng.next() as u8).collect();
    let hold = rng.millis(0, 3000);
    std::thread::spawn(move || {
        let Ok(mut c) = TcpStream::connect(addr) else {
            return;
        };
        let _ = match kind {
            0 => c.write_all(&garbage),
            1 => c.write_all(b"{\"addr\":{\"nics\":[{\"provider\":\"fabric:shm\",\"bytes\":[1,2"),
            2 => c.write_all(
                b"{\"addr\":{\"nics\":[]},\"reply\":null,\"pool\":null,\"reply_imm\":1,\"fetch_imm\":2}\n",
            ),
            // Says nothing: held until the holder's hello timeout.
            _ => Ok(()),
        };
        std::thread::sleep(hold);
    });
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
enum Kind {
    Honest,
    Killed,
    Stopped,
    Rogue,
    Unproven,
    Hostile,
    Follower,
}

struct Running {
    child: Child,
    kind: Kind,
    provider: &'static str,
    started: Instant,
    /// When to send its signal (SIGKILL for killed, SIGSTOP for stopped), and for how long a
    /// stopped one stays stopped.
    signal_at: Option<Instant>,
    stop_for: Duration,
    stopped_until: Option<Instant>,
}

struct HolderProc {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
}

impl HolderProc {
    /// Starts a holder over `provider`, registered in the directory at `url` if given.
    fn start(me: &std::path::Path, provider: &str, url: Option<&str>) -> Result<Self, Error> {
        let mut child = Command::new(me)
            .args(["--holder", provider])
            .args(url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
        let addr = line
            .trim()
            .parse()
            .map_err(|e| format!("a {provider} holder did not start ({e}): {line:?}"))?;
        Ok(Self {
            stdin: child.stdin.take(),
            child,
            addr,
        })
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Closes its stdin and waits for it to exit cleanly.
    fn stop(mut self) -> Result<(), Error> {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(format!("a holder exited with {status}").into())
                };
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return Err("a holder did not exit within 20 s of being told to".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[derive(Default)]
struct Tally {
    /// Per (provider, kind): children, exact steps, errors.
    runs: BTreeMap<(&'static str, Kind), (u64, u64, u64)>,
    /// Error messages, by their first words.
    errors: BTreeMap<String, u64>,
    malformed: u64,
    floods: u64,
    /// Writes hostile holders forged into their requesters (none may land).
    forged: u64,
    holder_kills: u64,
    regions_removed: usize,
}

/// Sends `sig` to `pid`.
fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions; the pid is a child not yet reaped.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

struct Soak {
    me: std::path::PathBuf,
    reference: String,
    rng: Rng,
    tally: Tally,
    pids: HashSet<u32>,
    /// What each of them was, and how it ended: named when one leaves a region behind.
    roles: HashMap<u32, String>,
    running: Vec<Running>,
    /// Per provider: main and victim holders, and when the victim dies next.
    holders: Vec<(&'static str, HolderProc, HolderProc, Instant)>,
    /// The poisoned directory the main shm holder is registered in (none without etcd).
    poison: Option<Poison>,
}

impl Soak {
    fn spawn(&mut self) -> Result<(), Error> {
        let h = self.rng.range(0, self.holders.len() as u64) as usize;
        let provider = self.holders[h].0;
        let addr = if self.rng.range(0, 3) == 0 {
            self.holders[h].2.addr
        } else {
            self.holders[h].1.addr
        };
        let kind = match self.rng.range(0, 26) {
            0..=10 => Kind::Honest,
            11..=13 => Kind::Killed,
            14..=15 => Kind::Stopped,
            16..=17 => Kind::Rogue,
            18 => Kind::Unproven,
            19..=20 => Kind::Hostile,
            21..=22 if self.poison.is_some() => Kind::Follower,
            21..=22 => Kind::Honest,
            23 => {
                connection_flood(addr, &mut self.rng);
                self.tally.floods += 1;
                return Ok(());
            }
            _ => {
                malformed_control(addr, &mut self.rng);
                self.tally.malformed += 1;
                return Ok(());
            }
        };
        let mut cmd = Command::new(&self.me);
        let (provider, target) = match (kind, &self.poison) {
            // A follower finds the main shm holder, the one registered, through the directory.
            (Kind::Follower, Some(poison)) => ("shm", poison.url()),
            _ => (provider, addr.to_string()),
        };
        match kind {
            Kind::Rogue => cmd.args(["--rogue", provider, &target]),
            Kind::Unproven => cmd.args(["--unproven", provider, &target]),
            Kind::Hostile => cmd.args(["--hostile", provider, &target, &self.reference]),
            Kind::Follower => cmd.args(["--follower", provider, &target, &self.reference]),
            _ => cmd.args(["--requester", provider, &target, &self.reference]),
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        self.pids.insert(child.id());
        self.roles
            .insert(child.id(), format!("{provider} {kind:?} requester"));
        let now = Instant::now();
        let signal_at = match kind {
            Kind::Killed => Some(now + self.rng.millis(0, 2500)),
            Kind::Stopped => Some(now + self.rng.millis(0, 1500)),
            _ => None,
        };
        self.running.push(Running {
            child,
            kind,
            provider,
            started: now,
            signal_at,
            stop_for: self.rng.millis(500, 4000),
            stopped_until: None,
        });
        Ok(())
    }

    /// Signals, reaps and judges the children; an error is a soak failure.
    fn tend(&mut self) -> Result<(), Error> {
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if let Some(at) = r.signal_at.filter(|&at| now >= at) {
                r.signal_at = None;
                match r.kind {
                    Kind::Killed => signal(r.child.id(), libc::SIGKILL),
                    _ => {
                        signal(r.child.id(), libc::SIGSTOP);
                        r.stopped_until = Some(at + r.stop_for);
                    }
                }
            }
            if r.stopped_until.is_some_and(|u| now >= u) {
                r.stopped_until = None;
                signal(r.child.id(), libc::SIGCONT);
            }
            let Some(status) = r.child.try_wait()? else {
                if now - r.started > HANG + r.stop_for {
                    let _ = r.child.kill();
                    return Err(format!(
                        "a {:?} {} requester ran past {HANG:?}: hung",
                        r.kind, r.provider
                    )
                    .into());
                }
                i += 1;
                continue;
            };
            let r = self.running.swap_remove(i);
            self.judge(r, status)?;
        }
        Ok(())
    }

    fn judge(&mut self, mut r: Running, status: std::process::ExitStatus) -> Result<(), Error> {
        use std::io::Read;
        use std::os::unix::process::ExitStatusExt;
        let mut out = String::new();
        let mut err = String::new();
        if let Some(mut s) = r.child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        if let Some(mut s) = r.child.stderr.take() {
            let _ = s.read_to_string(&mut err);
        }
        let steps = out.lines().filter(|l| *l == "step").count() as u64;
        self.tally.forged += out
            .lines()
            .filter_map(|l| l.strip_prefix("forged ")?.parse::<u64>().ok())
            .sum::<u64>();
        let entry = self.tally.runs.entry((r.provider, r.kind)).or_default();
        entry.0 += 1;
        entry.1 += steps;
        let pid = r.child.id();
        if let Some(role) = self.roles.get_mut(&pid) {
            role.push_str(&format!(", {status}"));
        }
        match (status.code(), status.signal()) {
            (Some(0), _) => {}
            (Some(ERRORED), _) => {
                entry.2 += 1;
                // Its first words, with addresses and numbers blanked so that like errors
                // count together.
                let what: String = err
                    .split_whitespace()
                    .take(10)
                    .map(|w| {
                        if w.bytes().any(|b| b.is_ascii_digit()) {
                            "_"
                        } else {
                            w
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" ");
                *self.tally.errors.entry(what).or_default() += 1;
            }
            (Some(WRONG), _) => return Err(format!("a wrong partial: {}", err.trim()).into()),
            (_, Some(libc::SIGKILL)) if r.kind == Kind::Killed => {
                self.tally.regions_removed +=
                    kvroute_transport::fabric::remove_shm_regions_of_dead_process(pid)?;
            }
            _ => {
                return Err(format!(
                    "a {:?} {} process ended with {status}: {}",
                    r.kind,
                    r.provider,
                    err.trim()
                )
                .into());
            }
        }
        Ok(())
    }

    /// Kills and restarts each victim holder that is due.
    fn cull(&mut self) -> Result<(), Error> {
        let now = Instant::now();
        for h in 0..self.holders.len() {
            if now < self.holders[h].3 {
                continue;
            }
            let provider = self.holders[h].0;
            let fresh = HolderProc::start(&self.me, provider, None)?;
            self.pids.insert(fresh.child.id());
            self.roles
                .insert(fresh.child.id(), format!("{provider} victim holder"));
            let next = now + self.rng.millis(10_000, 30_000);
            let (_, _, victim, due) = &mut self.holders[h];
            let mut old = std::mem::replace(victim, fresh);
            *due = next;
            old.child.kill()?;
            old.child.wait()?;
            self.tally.holder_kills += 1;
            self.tally.regions_removed +=
                kvroute_transport::fabric::remove_shm_regions_of_dead_process(old.child.id())?;
        }
        Ok(())
    }

    /// Runs load until `until`.
    fn load(&mut self, until: Instant) -> Result<(), Error> {
        while Instant::now() < until {
            self.tend()?;
            self.cull()?;
            for h in &mut self.holders {
                for p in [&mut h.1] {
                    if let Some(status) = p.child.try_wait()? {
                        return Err(format!("the main {} holder died: {status}", h.0).into());
                    }
                }
            }
            if self.running.len() < LIVE {
                self.spawn()?;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Lets every child finish, then gives the holders a moment to release their sessions.
    fn drain(&mut self) -> Result<(), Error> {
        while !self.running.is_empty() {
            self.tend()?;
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_secs(3));
        Ok(())
    }

    /// (resident KiB, fds) of each main holder.
    fn measure(&self) -> Result<Vec<(u64, usize)>, Error> {
        self.holders.iter().map(|h| footprint(&h.1.pid())).collect()
    }
}

/// The reference digests, over the `mem` domain in this process: `v:chunk:digest,...`.
fn reference() -> Result<String, Error> {
    let fabric = MemFabric::new();
    let engine = TransferEngine::mem(&fabric, 1)?;
    let holder = start_holder(engine)?;
    let config = RequesterConfig {
        link_bytes: 1 << 16,
        pool_pages: 4,
        ..RequesterConfig::new(0.1)
    };
    let mut req = Requester::connect(TransferEngine::mem(&fabric, 1)?, &[holder.addr()], config)?;
    let mut out = Vec::new();
    for v in 0..QUERIES {
        let q = queries(v);
        for (chunk, p) in req.route(&calls(&q)).into_iter().enumerate() {
            out.push(format!("{v}:{chunk}:{:016x}", digest(&p?)));
        }
    }
    Ok(out.join(","))
}

pub(crate) fn supervise(minutes: f64) -> Result<(), Error> {
    let total = Duration::from_secs_f64(minutes * 60.0);
    let started = Instant::now();
    let me = std::env::current_exe()?;
    let shm_before = shm_entries();
    let mut rng = Rng::seeded();
    let mut holders = Vec::new();
    let mut pids = HashSet::new();
    let mut roles = HashMap::new();
    let directory = if kvroute_testkit::etcd::etcd_available() {
        Some(EtcdCluster::start(1)?)
    } else {
        println!("soak: no etcd binary here (cargo xtask deps installs it): no directory poison");
        None
    };
    for provider in ["shm", "tcp"] {
        let url = directory
            .as_ref()
            .filter(|_| provider == "shm")
            .map(EtcdCluster::url);
        let main = HolderProc::start(&me, provider, url.as_deref())?;
        let victim = HolderProc::start(&me, provider, None)?;
        pids.extend([main.child.id(), victim.child.id()]);
        roles.insert(main.child.id(), format!("{provider} main holder"));
        roles.insert(victim.child.id(), format!("{provider} victim holder"));
        holders.push((
            provider,
            main,
            victim,
            Instant::now() + rng.millis(10_000, 30_000),
        ));
    }
    let poison = match directory {
        Some(etcd) => Some(plant(etcd, holders[0].1.addr)?),
        None => None,
    };
    if let Some(p) = &poison {
        println!("soak: directory {} poisoned with {:?}", p.url(), p.planted);
    }
    let mut soak = Soak {
        me,
        reference: reference()?,
        rng,
        tally: Tally::default(),
        pids,
        roles,
        running: Vec::new(),
        holders,
        poison,
    };
    println!(
        "soak: {:.1} min over shm and tcp; main and victim holders {:?}",
        minutes,
        soak.holders
            .iter()
            .map(|h| (h.0, h.1.addr, h.2.addr))
            .collect::<Vec<_>>()
    );
    // Warm-up: a quarter of the run (at least 10 s), then the baseline with nothing running.
    let warm = (total / 4).max(Duration::from_secs(10));
    soak.load(started + warm)?;
    soak.drain()?;
    let base = soak.measure()?;
    soak.load(started + total.saturating_sub(Duration::from_secs(5)))?;
    soak.drain()?;
    let end = soak.measure()?;
    println!("holder        rss MiB (warm -> end)   fds (warm -> end)");
    let mut flat = true;
    for (h, (&(r0, f0), &(r1, f1))) in soak.holders.iter().zip(base.iter().zip(&end)) {
        println!(
            "main {:<8} {:>7.1} -> {:>7.1}          {:>3} -> {:>3}",
            h.0,
            r0 as f64 / 1024.0,
            r1 as f64 / 1024.0,
            f0,
            f1
        );
        flat &= r1 <= r0 + 16 * 1024 && f1 <= f0 + 4;
    }
    println!("children       runs   exact steps   errors");
    for ((provider, kind), (runs, steps, errors)) in &soak.tally.runs {
        println!(
            "{provider} {:<9} {runs:>6}   {steps:>11}   {errors:>6}",
            format!("{kind:?}")
        );
    }
    for (what, n) in &soak.tally.errors {
        println!("  error x{n}: {what}");
    }
    println!(
        "malformed control connections {}, connection floods {}, forged writes into \
         requesters {} (none landed), victim holders killed {}, regions of killed processes \
         removed {}",
        soak.tally.malformed,
        soak.tally.floods,
        soak.tally.forged,
        soak.tally.holder_kills,
        soak.tally.regions_removed
    );
    for h in std::mem::take(&mut soak.holders) {
        h.1.stop()?;
        h.2.stop()?;
    }
    let exact_of = |kind: Kind| -> (u64, u64) {
        soak.tally
            .runs
            .iter()
            .filter(|((_, k), _)| *k == kind)
            .fold((0, 0), |(runs, steps), (_, r)| (runs + r.0, steps + r.1))
    };
    let exact = exact_of(Kind::Honest).1;
    // Requesters beside a hostile holder, or behind a poisoned directory, must get through
    // too: runs enough to expect one, and not one exact step, is a failure.
    for kind in [Kind::Hostile, Kind::Follower] {
        let (runs, steps) = exact_of(kind);
        if runs >= 4 && steps == 0 {
            return Err(format!("{runs} {kind:?} requesters and not one exact step").into());
        }
    }
    let ours = shm_entries_of(&soak.pids);
    let left: Vec<String> = std::fs::read_dir("/dev/shm")?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| {
            let pid = n.split(':').next()?.parse::<u32>().ok()?;
            let role = soak.roles.get(&pid)?;
            Some(format!("{n} ({role})"))
        })
        .collect();
    println!(
        "/dev/shm: {} entries before, {} after; of this soak's processes: {ours}",
        shm_before,
        shm_entries(),
    );
    if ours > 0 {
        return Err(format!("/dev/shm keeps regions of this soak's processes: {left:?}").into());
    }
    if !flat {
        return Err("a main holder's memory or fds grew after warm-up".into());
    }
    if exact == 0 {
        return Err("no honest requester completed a step".into());
    }
    println!(
        "soak passed in {:.1} s: {exact} honest steps exact, no hang, holders flat",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
