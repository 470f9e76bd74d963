//! Holders found after connect and through a directory: sessions opened for new records
//! (side by side, or in the background), poisoned and silent records, and what a dropped
//! requester leaves behind.

use super::*;

#[test]
fn holders_added_after_connect_serve_their_chunks_and_replicas() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0, 1], 8)?;
    let mut req = requester(&fabric, &[&a])?;
    assert!(matches!(
        req.holder_for(ChunkId(2)),
        Err(RouteError::NoHolder(_))
    ));
    // b brings chunk 2 and 3, c a replica of chunk 0; a fourth does not fit (room for 3).
    let (b, c, d) = (
        holder(&fabric, &[2, 3], 8)?,
        holder(&fabric, &[0], 8)?,
        holder(&fabric, &[1], 8)?,
    );
    assert_eq!(req.add_holder(b.addr())?, 1);
    assert_eq!(req.add_holder(c.addr())?, 2);
    assert!(req.add_holder(d.addr()).is_err());
    assert_eq!(req.holders(), 3);
    assert_eq!(req.live_replicas(ChunkId(0)), [0, 2]);
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let q = queries(16, 900, &s.rope()?, 5);
    let whole = |layer: u16| -> Result<Vec<f32>> {
        let doc = s.document_layer(&blocks, u32::from(layer))?;
        Ok(partial_dense(
            Backend::Reference,
            &Queries::new(&q)?,
            &Cache::contiguous(&doc)?,
            SCALE,
        )?
        .o)
    };
    let parts: Vec<_> = req
        .route(&dense_calls(&q, 1, 0..4))
        .into_iter()
        .collect::<Result<_, _>>()?;
    let merged = merge(&parts.iter().collect::<Vec<_>>())?;
    assert!(max_abs(&merged.o, &whole(1)?) < 4e-3);
    // Holder a leaves: chunk 0 goes to its replica on c; chunk 1 has none.
    req.mark_dead(0)?;
    assert_eq!(req.holder_for(ChunkId(0))?, 2);
    assert!(matches!(
        req.holder_for(ChunkId(1)),
        Err(RouteError::NoHolder(_))
    ));
    let parts: Vec<_> = req
        .route(&dense_calls(&q, 2, 0..1))
        .into_iter()
        .collect::<Result<_, _>>()?;
    assert_eq!(req.holder_stats(2)?.kernel_calls, 1);
    assert_eq!(parts.len(), 1);
    Ok(())
}

/// The newest view a watch holds.
fn latest(
    watch: &kvroute_kvstore::directory::Watch,
) -> Result<std::sync::Arc<kvroute_kvstore::DirectoryView>> {
    watch
        .current()
        .map(|s| s.view)
        .ok_or_else(|| anyhow::anyhow!("no view"))
}

#[test]
fn a_requester_follows_the_directory_holders_register_in() -> Result<()> {
    use kvroute_kvstore::directory::{Directory, InProcessDirectory};
    let fabric = MemFabric::new();
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let (a, b) = (holder(&fabric, &[0, 1], 8)?, holder(&fabric, &[2, 3], 8)?);
    let (ra, ca) = a.directory_records(0);
    let reg_a = dir.register(ra, ca)?;
    let mut req = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[],
        RequesterConfig {
            max_holders: 4,
            link_bytes: 1 << 20,
            ..RequesterConfig::new(SCALE)
        },
    )?;
    let view = latest(&watch)?;
    let sync = req.sync_with(&view);
    assert_eq!(sync.added, [(0, a.addr())]);
    assert_eq!(req.holder_for(ChunkId(1))?, 0);
    let (rb, cb) = b.directory_records(0);
    let reg_b = dir.register(rb, cb)?;
    let view = latest(&watch)?;
    assert_eq!(req.sync_with(&view).added, [(1, b.addr())]);
    // Syncing again changes nothing.
    assert_eq!(
        req.sync_with(&view),
        kvroute_remote::DirectorySync::default()
    );
    let q = queries(16, 900, &spec().rope()?, 5);
    assert!(
        req.route(&dense_calls(&q, 0, 0..4))
            .iter()
            .all(Result::is_ok)
    );
    // a leaves the directory: the requester stops using it.
    reg_a.revoke()?;
    let view = latest(&watch)?;
    assert_eq!(req.sync_with(&view).dropped, [(0, a.addr())]);
    assert!(!req.is_alive(0) && req.is_alive(1));
    assert!(matches!(
        req.holder_for(ChunkId(0)),
        Err(RouteError::NoHolder(_))
    ));
    // a registers again (the directory lost its data): its session still works, it is used
    // again on the same link.
    let (ra, ca) = a.directory_records(0);
    let _reg_a = dir.register(ra, ca)?;
    let view = latest(&watch)?;
    let sync = req.sync_with(&view);
    assert_eq!(
        (sync.relisted, sync.added),
        (vec![(0, a.addr())], Vec::new())
    );
    assert_eq!(req.holder_for(ChunkId(0))?, 0);
    assert!(
        req.route(&dense_calls(&q, 0, 0..4))
            .iter()
            .all(Result::is_ok)
    );
    // c joins as the first copy of chunk 2, b becomes the second: c is preferred at once.
    let c = holder(&fabric, &[2], 8)?;
    drop(reg_b);
    let (rb, cb) = b.directory_records(1);
    let _reg_b = dir.register(rb, cb)?;
    let (rc, cc) = c.directory_records(0);
    let _reg_c = dir.register(rc, cc)?;
    let view = latest(&watch)?;
    assert_eq!(req.sync_with(&view).added, [(2, c.addr())]);
    assert_eq!(req.live_replicas(ChunkId(2)), [2, 1]);
    assert_eq!(req.holder_for(ChunkId(3))?, 1);
    Ok(())
}

/// A directory with hostile contents beside an honest holder's records: 16 records naming
/// its control address with another engine (ids that sort first), 3 whose control address
/// accepts connections and never answers, and one naming another holder's control address
/// (listed nowhere else) with an engine that is not that holder's. The requester routes to
/// the honest holder on one link (the poisoned records neither hide its record nor spend
/// links: before, the first poisoned record's session was killed and then taken to serve the
/// honest record, and the record of the unlisted holder cost a link of its own); the silent
/// ones cost the first view one wait together, not one each, and a second view none (each
/// is left alone for a while).
#[test]
fn poisoned_and_silent_directory_records_neither_hide_a_holder_nor_stall_the_requester()
-> Result<()> {
    use kvroute_kvstore::directory::{Directory, HolderRecord, InProcessDirectory, SCHEMA};
    let fabric = MemFabric::new();
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let honest = holder(&fabric, &[0, 1], 8)?;
    let (record, chunks) = honest.directory_records(0);
    let _honest_reg = dir.register(record.clone(), chunks)?;
    let elsewhere = TransferEngine::mem(&fabric, 1)?;
    let mut regs = Vec::new();
    for i in 0..16 {
        let poisoned = HolderRecord {
            schema: SCHEMA,
            id: format!("0-poisoned-{i:02}"),
            engine: elsewhere.main_address(),
            ..record.clone()
        };
        regs.push(dir.register(poisoned, Vec::new())?);
    }
    let unlisted = holder(&fabric, &[0], 8)?;
    regs.push(dir.register(
        HolderRecord {
            schema: SCHEMA,
            id: "2-unlisted".to_owned(),
            control: unlisted.addr(),
            engine: elsewhere.main_address(),
            ..record.clone()
        },
        Vec::new(),
    )?);
    let silent = silent_records(&dir, &record, &elsewhere, "1-silent", &mut regs)?;
    let mut req = following_requester(&fabric)?;
    let view = latest(&watch)?;
    assert_eq!(view.holders.len(), 21);
    let started = std::time::Instant::now();
    let sync = req.sync_with(&view);
    // Each silent record costs a welcome's wait (at least 1 s): side by side, the three
    // cost one (in turn they took over 3 s).
    assert!(
        started.elapsed() < Duration::from_millis(2000),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(sync.added, [(0, honest.addr())], "{sync:?}");
    assert_eq!(sync.failed.len(), 20, "{sync:?}");
    assert!(
        sync.failed
            .iter()
            .any(|(at, why)| *at == unlisted.addr() && why.contains("no record")),
        "{sync:?}"
    );
    assert_eq!(req.holders(), 1, "one link");
    assert_eq!(req.holder_for(ChunkId(1))?, 0);
    let q = queries(16, 900, &spec().rope()?, 5);
    assert!(
        req.route(&dense_calls(&q, 0, 0..2))
            .iter()
            .all(Result::is_ok)
    );
    // The next view: the silent records are not tried again yet.
    let started = std::time::Instant::now();
    let sync = req.sync_with(&view);
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert!(sync.added.is_empty() && req.holders() == 1, "{sync:?}");
    drop((regs, silent));
    Ok(())
}

/// Followed in the background, a view whose records include three holders that accept
/// connections and never answer costs the caller no wait: applying it and each later poll
/// return at once while the sessions open on threads of their own, the honest holder joins
/// at a poll once its session is open, and the silent ones are reported failed at a later
/// poll, one wait after the view, together. (`sync_with` on the same view waits at least
/// that wait: the silent holders' welcome, 1 s.)
#[test]
fn a_view_followed_in_the_background_never_waits_on_a_silent_holder() -> Result<()> {
    let fabric = MemFabric::new();
    let listed = SilentlyListed::new(&fabric)?;
    let mut req = following_requester(&fabric)?;
    let view = latest(&listed.watch)?;
    assert_eq!(view.holders.len(), 4);
    let started = std::time::Instant::now();
    let sync = req.sync_in_background(&view);
    let mut slowest = started.elapsed();
    assert_eq!(sync.opening.len(), 4, "{sync:?}");
    let (mut added, mut failed) = (sync.added, sync.failed);
    while failed.len() < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{added:?} {failed:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
        let polled = std::time::Instant::now();
        let sync = req.poll_directory();
        slowest = slowest.max(polled.elapsed());
        added.extend(sync.added);
        failed.extend(sync.failed);
        if !added.is_empty() {
            // The honest holder serves while the silent ones are still being waited on.
            let q = queries(16, 900, &spec().rope()?, 5);
            let routed = req.route(&dense_calls(&q, 0, 0..2));
            assert!(routed.iter().all(Result::is_ok), "{routed:?}");
        }
    }
    assert!(slowest < Duration::from_millis(200), "{slowest:?}");
    assert_eq!(added, [(0, listed.honest.addr())]);
    let silent_addrs: Vec<_> = listed
        .silent
        .iter()
        .map(TcpListener::local_addr)
        .collect::<Result<_, _>>()?;
    assert!(
        failed.iter().all(|(at, _)| silent_addrs.contains(at)),
        "{failed:?}"
    );
    // Together: one welcome's wait (1 s at least), not three.
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    assert!(req.poll_directory().opening.is_empty());
    Ok(())
}

/// Dropping a requester stops its engine when nothing else holds it: a write to one of its
/// regions then finds no peer at all, not a region gone from a live engine. (Each link kept
/// a clone of the engine that was never dropped, so every requester's engine, its threads
/// and, over shm, its regions outlived it.)
#[test]
fn a_dropped_requester_takes_its_engine_with_it() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0, 1], 8)?;
    let req = requester(&fabric, &[&a])?;
    let region = req.reply_region(0).expect("a link").clone();
    drop(req);
    let other = TransferEngine::mem(&fabric, 1)?;
    let (done, fut) = kvroute_transport::OnDone::future();
    // Refused at submit (the fabric has no such endpoint) or in flight (no peer): either way
    // gone; a live engine would refuse the write for its deregistered region instead.
    let gone = match other.submit_imm(1, &region, done) {
        Err(e) => e.to_string().contains("no endpoint"),
        Ok(()) => matches!(
            kvroute_transport::block_on(fut),
            Err(kvroute_transport::TransferError::PeerUnreachable)
        ),
    };
    assert!(gone, "the requester's engine outlived it");
    Ok(())
}

/// A requester dropped while it opens sessions in the background, three of them with
/// holders that never answer, takes its engine with it at once: the sessions past their
/// connect are shut and waited for, none keeps the engine for its 5 s timeout. (The threads
/// kept a clone of the engine until they gave up; a process that exited meanwhile left its
/// `shm` regions behind.)
#[test]
fn a_requester_dropped_while_sessions_open_takes_its_engine_with_it() -> Result<()> {
    let fabric = MemFabric::new();
    let listed = SilentlyListed::new(&fabric)?;
    let nics = fabric.len();
    let mut req = following_requester_timed(&fabric, Duration::from_secs(5))?;
    assert_eq!(fabric.len(), nics + 1);
    let sync = req.sync_in_background(&*latest(&listed.watch)?);
    assert_eq!(sync.opening.len(), 4, "{sync:?}");
    // Until the silent holders' connections are made (at once: they listen).
    std::thread::sleep(Duration::from_millis(100));
    let started = std::time::Instant::now();
    drop(req);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(fabric.len(), nics, "the requester's engine outlived it");
    Ok(())
}

/// An in-process directory listing an honest holder of chunks 0 and 1 and three records
/// whose control addresses accept connections and never answer ([`silent_records`]), all
/// registered while this lives.
struct SilentlyListed {
    honest: Holder,
    silent: Vec<std::net::TcpListener>,
    watch: kvroute_kvstore::directory::Watch,
    _registrations: Vec<Box<dyn kvroute_kvstore::directory::Registration>>,
    _elsewhere: TransferEngine,
    _dir: kvroute_kvstore::directory::InProcessDirectory,
}

impl SilentlyListed {
    fn new(fabric: &MemFabric) -> Result<Self> {
        use kvroute_kvstore::directory::{Directory, InProcessDirectory};
        let dir = InProcessDirectory::new();
        let watch = dir.watch()?;
        let honest = holder(fabric, &[0, 1], 8)?;
        let (record, chunks) = honest.directory_records(0);
        let mut regs = vec![dir.register(record.clone(), chunks)?];
        let elsewhere = TransferEngine::mem(fabric, 1)?;
        let silent = silent_records(&dir, &record, &elsewhere, "0-silent", &mut regs)?;
        Ok(Self {
            honest,
            silent,
            watch,
            _registrations: regs,
            _elsewhere: elsewhere,
            _dir: dir,
        })
    }
}

/// Three listeners that accept connections and never answer, each registered in `dir` as
/// `record` with its address, another engine (`elsewhere`'s) and the id `{prefix}-{i}`.
fn silent_records(
    dir: &kvroute_kvstore::directory::InProcessDirectory,
    record: &kvroute_kvstore::directory::HolderRecord,
    elsewhere: &TransferEngine,
    prefix: &str,
    regs: &mut Vec<Box<dyn kvroute_kvstore::directory::Registration>>,
) -> Result<Vec<TcpListener>> {
    use kvroute_kvstore::directory::{Directory, HolderRecord};
    let silent: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    for (i, l) in silent.iter().enumerate() {
        let silent_record = HolderRecord {
            id: format!("{prefix}-{i}"),
            control: l.local_addr()?,
            engine: elsewhere.main_address(),
            ..record.clone()
        };
        regs.push(dir.register(silent_record, Vec::new())?);
    }
    Ok(silent)
}

/// A requester with no holders yet, room for 4 and a 1 s timeout, to follow a directory.
/// (A silent holder's welcome is waited for 1 s at least whatever the timeout; a shorter one
/// would only fail routes and data paths on a loaded machine.)
fn following_requester(fabric: &MemFabric) -> Result<Requester> {
    following_requester_timed(fabric, Duration::from_secs(1))
}

/// [`following_requester`] with another timeout.
fn following_requester_timed(fabric: &MemFabric, timeout: Duration) -> Result<Requester> {
    Ok(Requester::connect(
        TransferEngine::mem(fabric, 1)?,
        &[],
        RequesterConfig {
            max_holders: 4,
            link_bytes: 1 << 20,
            timeout,
            ..RequesterConfig::new(SCALE)
        },
    )?)
}

/// Holders that come and go never use a requester's room up: with room for two sessions,
/// six holders of chunk 0 in turn (each started, registered, routed to, then stopped with its
/// registration gone) each get a session of their own, a new index, and the room of the
/// ones that stopped. (Each session used to keep its room for the requester's life: the
/// third holder was refused, "no room".)
#[test]
fn holders_that_come_and_go_never_use_the_room_up() -> Result<()> {
    use kvroute_kvstore::directory::{Directory, InProcessDirectory};
    let fabric = MemFabric::new();
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let mut req = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[],
        RequesterConfig {
            max_holders: 2,
            link_bytes: 1 << 20,
            timeout: Duration::from_secs(2),
            ..RequesterConfig::new(SCALE)
        },
    )?;
    let q = queries(16, 900, &spec().rope()?, 5);
    for round in 0..6 {
        let h = holder(&fabric, &[0], 8)?;
        let (record, chunks) = h.directory_records(0);
        let reg = dir.register(record, chunks)?;
        // The view with this holder in it (the previous one's registration is gone).
        let view = loop {
            let view = latest(&watch)?;
            if view.holders.len() == 1
                && view.holders.values().any(|v| v.record.control == h.addr())
            {
                break view;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let sync = req.sync_with(&view);
        assert_eq!(sync.added, [(round, h.addr())], "round {round}: {sync:?}");
        assert_eq!(req.holder_for(ChunkId(0))?, round);
        assert!(
            req.route(&dense_calls(&q, 0, 0..1))
                .iter()
                .all(Result::is_ok),
            "round {round}"
        );
        drop((reg, h));
        // Its control connection closes with it; the next sync ends the session.
        std::thread::sleep(Duration::from_millis(50));
    }
    req.sync_with(&*latest(&watch)?);
    assert_eq!(req.holders(), 6);
    assert!(
        (0..6).all(|h| !req.is_alive(h) && req.reply_region(h).is_none()),
        "every stopped holder's session ended, and its reply region with it"
    );
    Ok(())
}
