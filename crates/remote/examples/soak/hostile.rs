//! The soak's hostile peers on the requester's side: a holder that writes into the requester
//! it serves (`--hostile`), and a requester that finds its holder through a poisoned
//! directory (`--follower`); and the poison itself, planted by the supervisor.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvroute_kvstore::ChunkId;
use kvroute_kvstore::directory::{self, Directory, HolderRecord, Registration, SCHEMA};
use kvroute_remote::{Requester, RequesterConfig};
use kvroute_testkit::etcd::EtcdCluster;
use kvroute_transport::{MrDesc, OnDone, RegisteredBuffer, TransferEngine};

use crate::children::{
    connect_or_exit, finish, requester_config, route_checked, start_holder, want_digests,
};
use crate::common::{Error, engine};
use crate::{ERRORED, QUERIES, Rng, WRONG};

/// The directory's lease: a killed holder's records go within this.
pub(crate) const TTL: Duration = Duration::from_secs(5);

/// Forged writes aimed at the requester from an engine of the hostile holder's process,
/// counted as they finish.
struct Forger {
    engine: TransferEngine,
    junk: RegisteredBuffer,
    landed: Arc<AtomicUsize>,
    done: Arc<AtomicUsize>,
    sent: usize,
}

impl Forger {
    fn new(provider: &str) -> Result<Self, Error> {
        let engine = engine(provider)?;
        let junk = engine.alloc_mr(4096)?;
        junk.write_at(0, &[0x7f; 4096])?;
        Ok(Self {
            engine,
            junk,
            landed: Arc::default(),
            done: Arc::default(),
            sent: 0,
        })
    }

    /// `n` writes of 256 junk bytes through `given` (the reply region the requester gave this
    /// holder) with its key and address replaced: neighbouring keys and single-bit changes of
    /// it, at addresses up to 8 regions either side; never `given` itself, where this holder
    /// may write.
    fn burst(&mut self, given: &MrDesc, rng: &mut Rng, n: usize) {
        let key = given.rkeys[0].rkey;
        for _ in 0..n {
            let forged_key = match rng.range(0, 3) {
                0 => key ^ (1 << rng.range(0, 64)),
                1 => key.wrapping_add(rng.range(1, 17)),
                _ => key.wrapping_sub(rng.range(0, 17)),
            };
            let step = rng.range(0, 17) as i64 - 8;
            if forged_key == key && step == 0 {
                continue;
            }
            let mut desc = given.clone();
            desc.addr = given.addr.wrapping_add_signed(step * given.len as i64);
            desc.rkeys[0].rkey = forged_key;
            let (landed, done) = (self.landed.clone(), self.done.clone());
            self.sent += 1;
            let submitted = self.engine.submit_single_write(
                256,
                Some(0x6100_0000 | rng.range(0, 1 << 16) as u32),
                (self.junk.handle(), 0),
                (&desc, 0),
                OnDone::callback(move |outcome| {
                    if outcome.is_ok() {
                        landed.fetch_add(1, Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }),
            );
            if submitted.is_err() {
                self.done.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// How many forged writes landed, once all have finished; `Err` if some are still out
    /// after `limit`.
    fn landed(&self, limit: Duration) -> Result<usize, Error> {
        let deadline = Instant::now() + limit;
        while self.done.load(Ordering::Relaxed) < self.sent {
            if Instant::now() > deadline {
                return Err(format!(
                    "{} of {} forged writes still unfinished after {limit:?}",
                    self.sent - self.done.load(Ordering::Relaxed),
                    self.sent
                )
                .into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(self.landed.load(Ordering::Relaxed))
    }
}

/// `--hostile PROVIDER HOLDER REFERENCE`: a requester that uses two holders, HOLDER and one of
/// this process's own, while that second holder forges writes into the requester with every
/// key it could derive from the one it was given, between steps. Every partial must match
/// the reference and no forged write may land (exit 3 otherwise); errors exit 2.
pub(crate) fn hostile(provider: &str, holder: &str, reference: &str) -> Result<(), Error> {
    let want = want_digests(reference)?;
    let mut rng = Rng::seeded();
    let two_faced = start_holder(engine(provider)?)?;
    let holders = [holder.parse()?, two_faced.addr()];
    let mut req = match Requester::connect(engine(provider)?, &holders, requester_config()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("connect: {e}");
            // Its own holder's engine closes its shm regions when dropped; `exit` would not.
            drop(two_faced);
            std::process::exit(ERRORED);
        }
    };
    let given = req
        .reply_region(1)
        .ok_or("the requester gave the second holder no reply region")?
        .clone();
    let mut forger = Forger::new(provider)?;
    let steps = rng.range(1, 13);
    let outcome = (|| {
        for _ in 0..steps {
            forger.burst(&given, &mut rng, 64);
            route_checked(&mut req, rng.range(0, QUERIES), &want)?;
            println!("step");
            std::thread::sleep(rng.millis(0, 100));
        }
        Ok(())
    })();
    let landed = forger.landed(Duration::from_secs(20));
    println!("forged {}", forger.sent);
    drop((req, two_faced, forger));
    match (outcome, landed) {
        (_, Ok(n)) if n > 0 => {
            eprintln!("{n} forged writes landed in the requester");
            std::process::exit(WRONG);
        }
        (Err(code), _) => std::process::exit(code),
        (Ok(()), Err(e)) => {
            eprintln!("forger: {e}");
            std::process::exit(ERRORED);
        }
        (Ok(()), Ok(_)) => Ok(()),
    }
}

/// `--follower PROVIDER URL REFERENCE`: a requester that knows no holder but the directory at
/// URL, which the supervisor has poisoned: it follows the directory in the background, as a
/// decode loop does, until the corpus has a live holder, then for 1-12 checked steps.
pub(crate) fn follower(provider: &str, url: &str, reference: &str) -> Result<(), Error> {
    let want = want_digests(reference)?;
    let mut rng = Rng::seeded();
    let dir = directory::open(url, TTL)?;
    let watch = dir.watch()?;
    // Room for the holder and a few more; the poisoned records must not use it up.
    let config = RequesterConfig {
        max_holders: 4,
        ..requester_config()
    };
    let mut req = connect_or_exit(provider, &[], config)?;
    let mut applied = 0;
    let outcome = (|| {
        // Views until both chunks have a live holder (the first may come before the
        // listing).
        let deadline = Instant::now() + Duration::from_secs(15);
        while [0, 1]
            .iter()
            .any(|&c| req.live_replicas(ChunkId(c)).is_empty())
        {
            if Instant::now() > deadline {
                eprintln!("no live holder of the corpus in the directory after 15 s");
                return Err(ERRORED);
            }
            if let Some(state) = watch.wait_newer(applied, Duration::from_millis(100)) {
                applied = state.generation;
                req.sync_in_background(&state.view);
            }
            // Takes in the sessions opened since, and tries again an address whose session
            // failed (a busy holder) once its backoff is over.
            req.poll_directory();
        }
        for _ in 0..rng.range(1, 13) {
            if let Some(state) = watch.current()
                && state.generation != applied
            {
                applied = state.generation;
                req.sync_in_background(&state.view);
            }
            req.poll_directory();
            route_checked(&mut req, rng.range(0, QUERIES), &want)?;
            println!("step");
            std::thread::sleep(rng.millis(0, 200));
        }
        Ok(())
    })();
    finish(req, outcome)
}

/// What the supervisor planted in the directory and keeps alive for the soak's length.
pub(crate) struct Poison {
    etcd: EtcdCluster,
    _registrations: Vec<Box<dyn Registration>>,
    _silent: Vec<TcpListener>,
    pub(crate) planted: BTreeMap<&'static str, usize>,
}

impl Poison {
    /// The poisoned directory's URL (what a follower is given).
    pub(crate) fn url(&self) -> String {
        self.etcd.url()
    }
}

/// Poisons the directory around `honest` (a control address registered there): 16 records
/// naming its control address with another engine, under ids that sort before its own;
/// 4 junk values of 1.4 MB (together past the etcd client's 4 MiB answer); 3 records whose
/// control address accepts connections and never answers.
pub(crate) fn plant(etcd: EtcdCluster, honest: std::net::SocketAddr) -> Result<Poison, Error> {
    let url = etcd.url();
    let dir: Arc<dyn Directory> = directory::open(&url, TTL)?;
    let watch = dir.watch()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let record = loop {
        let state = watch.wait_newer(0, Duration::from_secs(1));
        if let Some(r) = state.and_then(|s| {
            s.view
                .holders
                .values()
                .find(|h| h.record.control == honest)
                .map(|h| h.record.clone())
        }) {
            break r;
        }
        if Instant::now() > deadline {
            return Err(format!("the holder at {honest} never appeared in {url}").into());
        }
    };
    // An engine address that is not the holder's: one of a throwaway engine of this process.
    let elsewhere = engine("shm")?.main_address();
    let mut registrations = Vec::new();
    for i in 0..16 {
        let poisoned = HolderRecord {
            schema: SCHEMA,
            id: format!("0-poisoned-{i:02}"),
            engine: elsewhere.clone(),
            ..record.clone()
        };
        registrations.push(dir.register(poisoned, Vec::new())?);
    }
    let junk = vec![b'x'; 1_400_000];
    for i in 0..4 {
        etcd.put_raw(&format!("/kvroute/v1/holders/junk-{i}"), &junk)?;
    }
    let silent: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    for (i, l) in silent.iter().enumerate() {
        let black_hole = HolderRecord {
            schema: SCHEMA,
            id: format!("1-silent-{i}"),
            control: l.local_addr()?,
            engine: elsewhere.clone(),
            ..record.clone()
        };
        registrations.push(dir.register(black_hole, Vec::new())?);
    }
    let planted = BTreeMap::from([("poisoned", 16), ("oversized", 4), ("black-hole", 3)]);
    Ok(Poison {
        etcd,
        _registrations: registrations,
        _silent: silent,
        planted,
    })
}

/// A holder's place in the directory: registered while this lives.
pub(crate) struct Registered {
    _dir: Arc<dyn Directory>,
    _registration: Box<dyn Registration>,
}

/// Registers `holder` (`--holder shm URL`) for as long as the returned handle lives.
pub(crate) fn register(holder: &kvroute_remote::Holder, url: &str) -> Result<Registered, Error> {
    let dir = directory::open(url, TTL)?;
    let (record, chunks) = holder.directory_records(0);
    let registration = dir.register(record, chunks)?;
    Ok(Registered {
        _dir: dir,
        _registration: registration,
    })
}
