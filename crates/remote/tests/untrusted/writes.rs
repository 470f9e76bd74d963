//! Writes a peer must not be able to land: into an ended session's inbox, into another
//! holder's replies or fetched pages, and floods of immediates nobody uses.

use super::*;

/// Forged writes from an engine of an attacker's own, 256 bytes of `0x7f` each, counted as
/// they finish.
struct Forger {
    engine: TransferEngine,
    forged: RegisteredBuffer,
    landed: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    done: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    sent: usize,
}

impl Forger {
    fn new(fabric: &MemFabric) -> Result<Self> {
        let engine = TransferEngine::mem(fabric, 1)?;
        let forged = engine.alloc_mr(4096)?;
        forged.write_at(0, &[0x7f; 4096])?;
        Ok(Self {
            engine,
            forged,
            landed: Default::default(),
            done: Default::default(),
            sent: 0,
        })
    }

    /// Writes through `desc` with its address, length and first key replaced by `forged`'s,
    /// carrying `imm`.
    fn write(&mut self, desc: &kvroute_transport::MrDesc, forged: (u64, u64, u64), imm: u32) {
        use std::sync::atomic::Ordering;
        let mut desc = desc.clone();
        (desc.addr, desc.len, desc.rkeys[0].rkey) = forged;
        let (landed, done) = (self.landed.clone(), self.done.clone());
        self.sent += 1;
        let submitted = self.engine.submit_single_write(
            256,
            Some(imm),
            (self.forged.handle(), 0),
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

    /// How many writes landed, once every one has finished (20 s at most).
    fn landed(&self) -> usize {
        use std::sync::atomic::Ordering;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while self.done.load(Ordering::Relaxed) < self.sent && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            self.done.load(Ordering::Relaxed),
            self.sent,
            "every forged write finished"
        );
        self.landed.load(Ordering::Relaxed)
    }
}

/// `key` and the keys an attacker who was given it would try: the `mem` domain's neighbouring
/// slots and tags (its keys are `tag << 32 | slot`), and every single-bit change; sorted.
fn derived_keys(key: u64) -> Vec<u64> {
    let (slot, tag) = (key & 0xFFFF_FFFF, key >> 32);
    let mut keys = vec![key];
    for ds in 0..=16u64 {
        for dt in 0..=8u64 {
            for (s, t) in [
                (slot.wrapping_add(ds), tag.wrapping_add(dt)),
                (slot.wrapping_sub(ds), tag.wrapping_sub(dt)),
            ] {
                keys.push((t & 0xFFFF_FFFF) << 32 | (s & 0xFFFF_FFFF));
            }
        }
    }
    keys.extend((0..64).map(|bit| key ^ (1 << bit)));
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// A session's inbox is registered for it alone: after it ends, its descriptor reaches nothing,
/// so a peer that kept it cannot write into the request of the session that has the slot now.
#[test]
fn an_ended_sessions_inbox_descriptor_reaches_nothing() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder(&fabric)?;
    let Rogue {
        engine,
        welcome,
        _control,
        ..
    } = rogue(&fabric, &h)?;
    drop(_control);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(h.stats().active, 0);
    let mut honest = requester(&fabric, &h)?;
    let junk = engine.alloc_mr(1 << 12)?;
    junk.write_at(0, &[0xff; 1 << 12])?;
    let (done, fut) = OnDone::future();
    let wrote = engine
        .submit_single_write(1 << 12, None, (junk.handle(), 0), (&welcome.inbox, 0), done)
        .map_err(anyhow::Error::from)
        .and_then(|()| Ok(kvroute_transport::block_on(fut)?));
    assert!(
        wrote.is_err(),
        "a write through an ended session's inbox descriptor landed"
    );
    route_once(&mut honest)?;
    Ok(())
}

/// A holder writes into its requester with every key it could derive from the one it was
/// given (its own reply region's: neighbouring slots and tags, single-bit changes) at every
/// address within 20 regions of its own: 10,000 forged writes, and none lands anywhere but
/// its own region, so no answer of the other holder can be changed. (With one reply region
/// shared by every link, the key it was given reached the other holder's replies.)
#[test]
fn a_holder_cannot_write_into_another_holders_replies() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let (_honest, _hostile, mut req, given) = honest_and_hostile(&fabric, Duration::from_secs(2))?;
    let honest_region = req
        .reply_region(0)
        .expect("the honest holder's region")
        .clone();
    assert_ne!(given.rkeys[0].rkey, honest_region.rkeys[0].rkey);

    let mut forger = Forger::new(&fabric)?;
    let key = given.rkeys[0].rkey;
    let keys = derived_keys(key);
    let span = 1u64 << 16;
    let mut attempts = 0;
    'attack: for &k in &keys {
        for step in -20i64..=20 {
            let addr = given.addr.wrapping_add_signed(step * span as i64);
            if k == key && step == 0 {
                continue; // its own region: it may write there
            }
            if attempts == 10_000 {
                break 'attack;
            }
            attempts += 1;
            forger.write(&given, (addr, span, k), 0x6100_0000);
        }
    }
    assert_eq!(attempts, 10_000);
    assert_eq!(forger.landed(), 0, "forged writes that landed");
    // The honest holder still answers, and the requester is undisturbed.
    route_once(&mut req)?;
    Ok(())
}

/// A holder aims writes at the requester's fetch pool while another holder's fetches land in
/// it: the pool's own descriptor (which every holder's hello names), and keys derived from it
/// (neighbouring slots and tags, single-bit changes), at every address within 8 pages of
/// the pool either side: 10,000 forged writes in bursts between 20 honest fetches, and none
/// lands, and every fetch reads exactly what the first did. Holders write into the pool only
/// through the windows a fetch or gather grants them, for its bytes and its duration. (With
/// the pool writable by every holder, the first forged write landed.)
#[test]
fn no_holder_can_write_into_the_fetch_pool_but_through_its_own_grant() -> Result<()> {
    use kvroute_kernels::{Backend, Queries, partial_dense};

    let _serial = serial();
    let fabric = MemFabric::new();
    let (_honest, _hostile, mut req, _) = honest_and_hostile(&fabric, Duration::from_secs(2))?;
    let pool = req.pool_desc().clone();
    let positions = req.registry().holders(ChunkId(0))?[0].positions.clone();
    let rope = spec().rope()?;
    let q = vec![0x3f80u16; 4 * D_QK];
    let fetch_partials = |req: &mut Requester| -> Result<Vec<kvroute_kernels::Partial>> {
        let fetched = req.fetch(ChunkId(0), &positions, rope, Backend::Cpu)?;
        let parts = (0..2)
            .map(|layer| {
                Ok(partial_dense(
                    Backend::Reference,
                    &Queries::new(&q)?,
                    &req.fetched_cache(&fetched, layer)?,
                    0.1,
                )?)
            })
            .collect::<Result<Vec<_>>>();
        req.release(fetched)?;
        parts
    };
    let reference = fetch_partials(&mut req)?;

    let mut forger = Forger::new(&fabric)?;
    let key = pool.rkeys[0].rkey;
    let keys = derived_keys(key);
    let page = kvroute_kvstore::PAGE_BYTES as u64;
    let targets: Vec<(u64, u64)> = keys
        .iter()
        .flat_map(|&k| {
            (-8i64..24).map(move |p| (k, pool.addr.wrapping_add_signed(p * page as i64)))
        })
        .take(10_000)
        .collect();
    assert_eq!(targets.len(), 10_000);
    for burst in targets.chunks(500) {
        for &(k, addr) in burst {
            forger.write(&pool, (addr, page, k), 0x6200_0000);
        }
        assert_eq!(
            fetch_partials(&mut req)?,
            reference,
            "a fetch read forged rows"
        );
    }
    assert_eq!(forger.landed(), 0, "forged writes that landed");
    assert_eq!(fetch_partials(&mut req)?, reference);
    Ok(())
}

/// A holder floods its requester with writes carrying 100,000 distinct immediate values nobody
/// uses: the requester's IMM counter stores at most 4,096 values and drops (and counts) the
/// rest, and every route to the honest holder, during the flood and after it, is answered.
/// (Each stray value used to keep a slot of its own for the life of the engine.)
#[test]
fn a_flood_of_stray_immediates_is_dropped_at_bounded_cost() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let (_honest, _hostile, mut req, given) = honest_and_hostile(&fabric, Duration::from_secs(5))?;
    let attacker = TransferEngine::mem(&fabric, 1)?;
    let junk = attacker.alloc_mr(64)?;
    const FLOOD: u32 = 100_000;
    let flood = std::thread::spawn(move || -> Result<()> {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU32, Ordering};
        let done = Arc::new(AtomicU32::new(0));
        for i in 0..FLOOD {
            let done = done.clone();
            attacker.submit_single_write(
                8,
                Some(0x5000_0000 + i),
                (junk.handle(), 0),
                (&given, 0),
                OnDone::callback(move |_| {
                    done.fetch_add(1, Ordering::Relaxed);
                }),
            )?;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while done.load(Ordering::Relaxed) < FLOOD && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        anyhow::ensure!(
            done.load(Ordering::Relaxed) == FLOOD,
            "the flood did not finish"
        );
        Ok(())
    });
    let mut routes = 0;
    while !flood.is_finished() {
        route_once(&mut req)?;
        routes += 1;
    }
    flood.join().expect("the flood thread")?;
    route_once(&mut req)?;
    let stats = req.engine().stats();
    assert!(
        stats.imm_values_tracked <= 4096,
        "{} values held",
        stats.imm_values_tracked
    );
    assert!(
        stats.imm_dropped >= u64::from(FLOOD) - 4096,
        "{} arrivals dropped",
        stats.imm_dropped
    );
    eprintln!("{routes} routes answered during the flood; {stats:?}");
    Ok(())
}

/// Two holders, one to play hostile, and a requester with `timeout` that has routed once
/// through both; the last is the reply region the requester gave the hostile one.
fn honest_and_hostile(
    fabric: &MemFabric,
    timeout: Duration,
) -> Result<(Holder, Holder, Requester, kvroute_transport::MrDesc)> {
    let (honest, hostile) = (holder(fabric)?, holder(fabric)?);
    let config = RequesterConfig {
        timeout,
        link_bytes: 1 << 16,
        pool_pages: 8,
        ..RequesterConfig::new(0.1)
    };
    let mut req = common::connect(fabric, &[honest.addr(), hostile.addr()], config)?;
    route_once(&mut req)?;
    let given = req
        .reply_region(1)
        .expect("the hostile holder's region")
        .clone();
    Ok((honest, hostile, req, given))
}
