//! A holder among untrusted peers, over the in-process `mem` fabric: a peer that speaks the
//! protocol by hand tries to make the holder write where it should not. Each test names the
//! attack and checks that the holder refuses it and goes on serving the honest requester.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use anyhow::Result;
use kvroute_kernels::RopeLayout;
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::session::{Answer, Hello, Welcome};
use kvroute_remote::{Call, Holder, HolderConfig, Requester, RequesterConfig, wire};
use kvroute_transport::{MemFabric, OnDone, RegisteredBuffer, TransferEngine};

const CAP: usize = 4;

/// The tests of this file run one at a time: one of them counts the process's session
/// threads.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn holder(fabric: &MemFabric) -> Result<Holder> {
    holder_with(fabric, |_| {})
}

/// A holder of one two-layer chunk, with small regions and `tune` applied to its config.
fn holder_with(fabric: &MemFabric, tune: impl FnOnce(&mut HolderConfig)) -> Result<Holder> {
    holder_on(TransferEngine::mem(fabric, 1)?, tune)
}

/// The corpus every holder here serves chunk 0 of: one chunk of two layers of 64 tokens.
fn spec() -> CorpusSpec {
    CorpusSpec {
        layers: 2,
        chunk_tokens: 64,
        chunks: 1,
        seed: 5,
        rope_theta: 10_000.0,
        yarn: None,
        rope_layout: RopeLayout::Interleaved,
    }
}

/// [`holder_with`] on `engine`.
fn holder_on(engine: TransferEngine, tune: impl FnOnce(&mut HolderConfig)) -> Result<Holder> {
    let spec = spec();
    let mut config = HolderConfig {
        max_requesters: CAP,
        slot_bytes: 1 << 16,
        reply_bytes: 1 << 16,
        gather_bytes: 1 << 16,
        ..HolderConfig::default()
    };
    tune(&mut config);
    common::start_holder(engine, &spec, &[0], config)
}

fn requester(fabric: &MemFabric, holder: &Holder) -> Result<Requester> {
    let config = RequesterConfig {
        timeout: Duration::from_secs(2),
        link_bytes: 1 << 16,
        pool_pages: 8,
        ..RequesterConfig::new(0.1)
    };
    common::connect(fabric, &[holder.addr()], config)
}

fn route_once(req: &mut Requester) -> Result<()> {
    let q = vec![0x3f80u16; D_QK];
    let call = Call {
        chunk: ChunkId(0),
        layer: 1,
        queries: &q,
        sparse: None,
    };
    req.route(&[call]).remove(0)?;
    Ok(())
}

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

/// Sends `hello` by hand and returns the holder's answer (and the connection, which keeps a
/// granted session open).
fn hello(holder: &Holder, hello: &Hello) -> Result<(Answer, TcpStream)> {
    let mut control = TcpStream::connect(holder.addr())?;
    writeln!(control, "{}", serde_json::to_string(hello)?)?;
    let mut line = String::new();
    BufReader::new(control.try_clone()?).read_line(&mut line)?;
    Ok((serde_json::from_str(&line)?, control))
}

/// A rogue engine with a real session of its own.
struct Rogue {
    engine: TransferEngine,
    _reply: RegisteredBuffer,
    welcome: Welcome,
    _control: TcpStream,
}

fn rogue(fabric: &MemFabric, holder: &Holder) -> Result<Rogue> {
    let engine = TransferEngine::mem(fabric, 1)?;
    let reply = engine.alloc_mr(1 << 16)?;
    let control = TcpStream::connect(holder.addr())?;
    let welcome = kvroute_remote::session::open(
        &engine,
        (
            &mut control.try_clone()?,
            &mut BufReader::new(control.try_clone()?),
        ),
        &Hello {
            addr: engine.main_address(),
            reply: reply.desc().clone(),
            pool: None,
            reply_imm: 77,
            fetch_imm: 78,
        },
        Duration::from_secs(5),
    )?;
    Ok(Rogue {
        engine,
        _reply: reply,
        welcome,
        _control: control,
    })
}

#[test]
fn a_hello_naming_another_engines_region_is_refused() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder(&fabric)?;
    let victim = TransferEngine::mem(&fabric, 1)?;
    let victims_region = victim.alloc_mr(1 << 16)?;
    let attacker = TransferEngine::mem(&fabric, 1)?;
    let own = attacker.alloc_mr(1 << 16)?;
    for (reply, pool) in [
        (victims_region.desc().clone(), None),
        (own.desc().clone(), Some(victims_region.desc().clone())),
    ] {
        let (answer, _control) = hello(
            &h,
            &Hello {
                addr: attacker.main_address(),
                reply,
                pool,
                reply_imm: 1,
                fetch_imm: 2,
            },
        )?;
        assert!(
            matches!(&answer, Answer::Refused(why) if why.contains("another engine")),
            "{answer:?}"
        );
    }
    assert_eq!(h.stats().active, 0, "no session was granted");
    Ok(())
}

/// A hello that claims another engine's address (its descriptors name that engine's NIC, with
/// a made-up key) is refused before the holder writes anything: the attacker's proof message
/// reaches the holder from the attacker's own address. Before, the holder welcomed it and
/// answered its first ping with a bad-key write to the victim, which over `shm` cut the
/// holder's path to the victim off.
fn a_claimed_address(make: &dyn Fn() -> Result<TransferEngine>) -> Result<()> {
    let h = holder_on(make()?, |_| {})?;
    let config = RequesterConfig {
        timeout: Duration::from_secs(2),
        link_bytes: 1 << 16,
        pool_pages: 8,
        ..RequesterConfig::new(0.1)
    };
    let mut victim = Requester::connect(make()?, &[h.addr()], config)?;
    route_once(&mut victim)?;
    let attacker = make()?;
    let own = attacker.alloc_mr(1 << 16)?;
    let claimed = victim.engine().main_address();
    let mut forged = own.desc().clone();
    for (key, nic) in forged.rkeys.iter_mut().zip(&claimed.nics) {
        key.nic = nic.clone();
        key.rkey ^= 0x5a5a;
    }
    let before = h.stats();
    let control = TcpStream::connect(h.addr())?;
    let opened = kvroute_remote::session::open(
        &attacker,
        (
            &mut control.try_clone()?,
            &mut BufReader::new(control.try_clone()?),
        ),
        &Hello {
            addr: claimed,
            reply: forged,
            pool: None,
            reply_imm: 1,
            fetch_imm: 2,
        },
        Duration::from_secs(5),
    );
    assert!(
        matches!(&opened, Err(kvroute_remote::RemoteError::SessionRefused { why, .. }) if why.contains("proof")),
        "{opened:?}"
    );
    let after = h.stats();
    assert_eq!(after.pings, before.pings, "nothing of it was answered");
    assert!(after.refused > before.refused);
    // Its session is closed and the victim is still served.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.stats().active, 1);
    route_once(&mut victim)?;
    Ok(())
}

#[test]
fn a_hello_claiming_another_engines_address_is_refused_unserved() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    a_claimed_address(&|| Ok(TransferEngine::mem(&fabric, 1)?))
}

#[test]
fn a_hello_claiming_another_engines_address_is_refused_unserved_over_tcp() -> Result<()> {
    let _serial = serial();
    let config = kvroute_transport::FabricConfig {
        node: Some("127.0.0.1".to_owned()),
        ..kvroute_transport::FabricConfig::provider(kvroute_transport::ProviderChoice::Tcp)
    };
    match TransferEngine::fabric(&config, Default::default()) {
        Ok(_) => {}
        Err(e) => {
            kvroute_testkit::skip!("no libfabric tcp here: {e}");
            return Ok(());
        }
    }
    a_claimed_address(&|| Ok(TransferEngine::fabric(&config, Default::default())?.0))
}

#[test]
fn a_session_cannot_make_the_holder_answer_another_or_replay_it() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder(&fabric)?;
    // The victim has pinged (at connect) and routed: its slot holds a valid request.
    let mut victim = requester(&fabric, &h)?;
    route_once(&mut victim)?;
    let rogue = rogue(&fabric, &h)?;
    let before = h.stats();
    // Immediates naming every other session, as requests and as pings, sent to the rogue's
    // own inbox (the only one it has a descriptor of).
    for session in (0..CAP as u16).filter(|&s| s != rogue.welcome.session) {
        for imm in [wire::request_imm(session, 1), wire::ping_imm(session, 1)] {
            rogue
                .engine
                .submit_imm(imm, &rogue.welcome.inbox, OnDone::nothing())?;
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    let after = h.stats();
    assert_eq!(
        (after.requests, after.pings),
        (before.requests, before.pings),
        "a foreign immediate was answered: {after:?}"
    );
    assert!(after.refused >= before.refused + 2, "{after:?}");
    // The victim's own session goes on working.
    route_once(&mut victim)?;
    assert_eq!(h.stats().requests, before.requests + 1);
    Ok(())
}

#[test]
fn a_request_without_the_sessions_token_is_not_answered() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder(&fabric)?;
    let rogue = rogue(&fabric, &h)?;
    let q = vec![0x3f80u16; D_QK];
    let seg = wire::SegmentSpec {
        kind: wire::SegmentKind::Dense,
        chunk: 0,
        layer: 0,
        queries: wire::QueryRows::Copied(&q),
        indices: &[],
        pages: &[],
        windows: &[],
    };
    let buf = rogue.engine.alloc_mr(1 << 16)?;
    let imm = wire::request_imm(rogue.welcome.session, 1);
    let inbox = (&rogue.welcome.inbox, rogue.welcome.slot_offset);
    let send = |seq: u64, token: u64| -> Result<()> {
        let mut bytes = Vec::new();
        wire::encode_request(&mut bytes, seq, token, 0, 0.1, &[seg]);
        buf.write_at(0, &bytes)?;
        let (done, fut) = OnDone::future();
        rogue.engine.submit_single_write(
            bytes.len() as u64,
            Some(imm),
            (buf.handle(), 0),
            inbox,
            done,
        )?;
        kvroute_transport::block_on(fut)?;
        std::thread::sleep(Duration::from_millis(100));
        Ok(())
    };
    send(1, rogue.welcome.token ^ 1)?;
    assert_eq!(h.stats().requests, 0, "a wrong token was answered");
    send(2, rogue.welcome.token)?;
    assert_eq!(h.stats().requests, 1, "the right token was not answered");
    // The same write again (a replayed immediate) and an older sequence number: refused.
    rogue
        .engine
        .submit_imm(imm, &rogue.welcome.inbox, OnDone::nothing())?;
    send(1, rogue.welcome.token)?;
    assert_eq!(h.stats().requests, 1, "a replay was answered");
    assert!(h.stats().refused >= 2, "{:?}", h.stats());
    Ok(())
}

#[test]
fn a_holder_that_never_answers_the_hello_is_named_in_a_timeout() -> Result<()> {
    let _serial = serial();
    let silent = TcpListener::bind("127.0.0.1:0")?;
    let addr = silent.local_addr()?;
    // Accepts (the kernel does, from the backlog) and never answers.
    let fabric = MemFabric::new();
    let config = RequesterConfig {
        timeout: Duration::from_millis(300),
        link_bytes: 1 << 16,
        pool_pages: 8,
        ..RequesterConfig::new(0.1)
    };
    let started = std::time::Instant::now();
    let err = Requester::connect(TransferEngine::mem(&fabric, 1)?, &[addr], config)
        .expect_err("a silent holder gives no session");
    assert!(
        matches!(err, kvroute_remote::RemoteError::TimedOut { holder, .. } if holder == addr),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&addr.to_string()) && text.contains("did not answer within"),
        "{text}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(silent);
    Ok(())
}

/// A holder that trickles its welcome a byte at a time, each well within the timeout: the
/// timeout is the whole line's deadline, so the connect fails within it (plus 10%), naming
/// the holder.
#[test]
fn a_holder_trickling_its_welcome_fails_the_connect_within_the_timeout() -> Result<()> {
    let _serial = serial();
    let trickler = TcpListener::bind("127.0.0.1:0")?;
    let addr = trickler.local_addr()?;
    let feeder = std::thread::spawn(move || {
        let Ok((mut s, _)) = trickler.accept() else {
            return;
        };
        let text = b"{\"Welcome\":{\"holder\":\"";
        for b in text.iter().cycle().take(100) {
            if std::io::Write::write_all(&mut s, &[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let fabric = MemFabric::new();
    let timeout = Duration::from_millis(1500);
    let config = RequesterConfig {
        timeout,
        link_bytes: 1 << 16,
        pool_pages: 8,
        ..RequesterConfig::new(0.1)
    };
    let started = std::time::Instant::now();
    let err = Requester::connect(TransferEngine::mem(&fabric, 1)?, &[addr], config)
        .expect_err("a trickling holder gives no session");
    let took = started.elapsed();
    assert!(
        matches!(err, kvroute_remote::RemoteError::TimedOut { holder, .. } if holder == addr),
        "{err:?}"
    );
    assert!(
        took <= timeout.mul_f64(1.1),
        "took {took:?} against {timeout:?}"
    );
    feeder.join().ok();
    Ok(())
}

/// Threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |tasks| tasks.flatten().count())
}

#[test]
fn idle_control_connections_are_bounded_and_closed() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder_with(&fabric, |c| {
        c.max_requesters = 2;
        c.hello_timeout = Duration::from_millis(300);
        c.max_connections = 24;
    })?;
    let before = threads();
    // Forty connections that never say hello, from one address: at most 16 (the per-source
    // limit) are held at once, each newcomer taking the place of the oldest, and none of
    // them costs a thread.
    let idle: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(h.addr()))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(100));
    let during = threads();
    // (Slack of two for threads of the test harness; a thread per connection is 24.)
    assert!(
        during <= before + 2,
        "{} threads more for 40 idle connections",
        during.saturating_sub(before)
    );
    // After the hello timeout every one of them is closed.
    std::thread::sleep(Duration::from_millis(600));
    for mut c in idle {
        let mut byte = [0u8; 1];
        c.set_read_timeout(Some(Duration::from_secs(1)))?;
        assert_eq!(
            std::io::Read::read(&mut c, &mut byte)?,
            0,
            "closed by the holder"
        );
    }
    let stats = h.stats();
    assert_eq!(
        stats.evicted, 24,
        "connections past the limit made room: {stats:?}"
    );
    assert_eq!(stats.busy, 0, "no newcomer was refused: {stats:?}");
    // An honest requester is served.
    let mut req = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[h.addr()],
        RequesterConfig {
            link_bytes: 1 << 16,
            pool_pages: 8,
            ..RequesterConfig::new(0.1)
        },
    )?;
    route_once(&mut req)?;
    Ok(())
}

/// A query row holding NaN (or one whose scores overflow f32) is refused for its own segment
/// with `Status::Kernel`, never answered `Ok` with a NaN or silently empty row; a clean call in
/// the same request is still answered exactly as alone.
#[test]
fn a_non_finite_query_is_refused_for_its_segment_only() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let holder = holder(&fabric)?;
    let mut req = requester(&fabric, &holder)?;
    let clean = vec![0x3f80u16; 2 * D_QK];
    let mut nan = clean.clone();
    nan[D_QK + 9] = 0x7fc0;
    let mut huge = clean.clone();
    huge[..D_QK].fill(0x7f7f); // the largest finite bf16: scores overflow f32
    let call = |queries| Call {
        chunk: ChunkId(0),
        layer: 1,
        queries,
        sparse: None,
    };
    let alone = req.route(&[call(&clean)]).remove(0)?;
    let got = req.route(&[call(&nan), call(&clean), call(&huge)]);
    for bad in [&got[0], &got[2]] {
        assert!(
            matches!(
                bad,
                Err(kvroute_remote::RouteError::Refused {
                    status: wire::Status::Kernel,
                    ..
                })
            ),
            "{bad:?}"
        );
    }
    assert_eq!(got[1].as_ref().unwrap(), &alone);
    Ok(())
}

fn is_busy(connected: Result<Requester>) -> bool {
    matches!(
        connected
            .err()
            .and_then(|e| e.downcast::<kvroute_remote::RemoteError>().ok()),
        Some(kvroute_remote::RemoteError::HolderBusy { .. })
    )
}

/// Hellos that never use the data plane hold their slots only for `open_timeout`: then each
/// is closed and an honest requester gets a session and routes.
#[test]
fn sessions_that_never_route_lose_their_slots() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder_with(&fabric, |c| {
        c.open_timeout = Duration::from_millis(300);
        c.idle_evict = Duration::from_secs(3600);
    })?;
    let rogues = (0..CAP)
        .map(|_| rogue(&fabric, &h))
        .collect::<Result<Vec<_>>>()?;
    assert!(is_busy(requester(&fabric, &h)), "every slot is taken");
    std::thread::sleep(Duration::from_millis(700));
    let stats = h.stats();
    assert_eq!((stats.active, stats.evicted), (0, CAP as u64), "{stats:?}");
    for r in &rogues {
        let mut rest = String::new();
        let read = BufReader::new(r._control.try_clone()?).read_line(&mut rest)?;
        assert_eq!(
            read, 0,
            "the holder closed the unopened session's connection"
        );
    }
    let mut honest = requester(&fabric, &h)?;
    route_once(&mut honest)?;
    Ok(())
}

/// A holder that closes a session idle 400 ms (and none for never routing) when a newcomer
/// finds every slot taken, and a requester in each of its slots.
fn every_slot_taken(fabric: &MemFabric) -> Result<(Holder, Vec<Requester>)> {
    let h = holder_with(fabric, |c| {
        c.open_timeout = Duration::from_secs(3600);
        c.idle_evict = Duration::from_millis(400);
    })?;
    let sessions = (0..CAP)
        .map(|_| requester(fabric, &h))
        .collect::<Result<Vec<_>>>()?;
    Ok((h, sessions))
}

/// A session idle for `idle_evict` yields its slot to a requester that finds every slot
/// taken; sessions in use are not closed for it, and the newcomer is told busy while every
/// session is in use.
#[test]
fn an_idle_session_yields_its_slot_to_a_waiting_requester() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let (h, mut sessions) = every_slot_taken(&fabric)?;
    assert!(
        is_busy(requester(&fabric, &h)),
        "every session was just used"
    );
    // Sessions 1.. keep routing; session 0 goes idle.
    let until = std::time::Instant::now() + Duration::from_millis(700);
    while std::time::Instant::now() < until {
        for s in &mut sessions[1..] {
            route_once(s)?;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut newcomer = requester(&fabric, &h)?;
    route_once(&mut newcomer)?;
    assert_eq!(h.stats().evicted, 1);
    for s in &mut sessions[1..] {
        route_once(s)?;
    }
    assert!(
        route_once(&mut sessions[0]).is_err(),
        "the evicted session still routes"
    );
    Ok(())
}

/// Sessions that only ping keep no slot from a requester waiting for one: every slot held by
/// proven sessions pinging every 50 ms (one process squatting), a newcomer is welcomed once
/// the longest of them has gone `idle_evict` without a request, and routes. (When pings
/// counted as use, the newcomer was told busy for as long as the pings went on.)
#[test]
fn sessions_that_only_ping_yield_their_slots_to_a_waiting_requester() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let (h, mut squatters) = every_slot_taken(&fabric)?;
    fn ping(s: &mut Requester) -> Result<Duration, kvroute_remote::RouteError> {
        s.ping(0, wire::PING_HEADER, 64, wire::Pong::Staged)
    }
    assert!(is_busy(requester(&fabric, &h)), "every slot is held");
    let until = std::time::Instant::now() + Duration::from_millis(700);
    while std::time::Instant::now() < until {
        for s in &mut squatters {
            ping(s)?;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut newcomer = requester(&fabric, &h)?;
    route_once(&mut newcomer)?;
    assert_eq!(h.stats().evicted, 1, "{:?}", h.stats());
    let still = squatters.iter_mut().map(ping).filter(Result::is_ok).count();
    assert_eq!(still, CAP - 1, "one squatter gave its slot up");
    Ok(())
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

/// Reads what the holder sent within `wait`: the bytes (none if it sent nothing).
fn read_within(stream: &TcpStream, wait: Duration) -> Result<Vec<u8>> {
    let mut stream = stream.try_clone()?;
    stream.set_read_timeout(Some(wait))?;
    let mut got = vec![0u8; 1 << 16];
    match std::io::Read::read(&mut stream, &mut got) {
        Ok(n) => Ok(got[..n].to_vec()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Ok(Vec::new())
        }
        Err(e) => Err(e.into()),
    }
}

/// A session `engine` is welcomed to and never proves its address: its connection.
fn welcomed_unproven(
    h: &Holder,
    engine: &TransferEngine,
    reply: &RegisteredBuffer,
) -> Result<TcpStream> {
    let (answer, control) = hello(
        h,
        &Hello {
            addr: engine.main_address(),
            reply: reply.desc().clone(),
            pool: None,
            reply_imm: 7,
            fetch_imm: 8,
        },
    )?;
    assert!(matches!(answer, Answer::Welcome(_)), "{answer:?}");
    Ok(control)
}

/// One client holds more silent connections than the holder takes, from the honest
/// requester's own address: the requester still connects and routes (each newcomer takes
/// the oldest silent connection's place; before, every one past the cap was closed unread,
/// the honest requester among them).
#[test]
fn a_flood_of_silent_connections_does_not_lock_an_honest_requester_out() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder_with(&fabric, |c| c.max_connections = 32)?;
    let flood: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(h.addr()))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(50));
    let mut req = requester(&fabric, &h)?;
    route_once(&mut req)?;
    // And the flood goes on: forty more while the session is open leave it serving.
    let more: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(h.addr()))
        .collect::<Result<_, _>>()?;
    std::thread::sleep(Duration::from_millis(50));
    route_once(&mut req)?;
    assert_eq!(h.stats().busy, 0, "{:?}", h.stats());
    drop((flood, more));
    Ok(())
}

/// Every slot taken by a session that never proves its address: an honest requester takes
/// the oldest one's place (before, it was told busy for as long as they were re-opened).
#[test]
fn unproven_sessions_make_room_for_an_honest_requester() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder_with(&fabric, |c| c.idle_evict = Duration::from_secs(3600))?;
    let engine = TransferEngine::mem(&fabric, 1)?;
    let reply = engine.alloc_mr(1 << 16)?;
    let unproven: Vec<TcpStream> = (0..CAP)
        .map(|_| welcomed_unproven(&h, &engine, &reply))
        .collect::<Result<_>>()?;
    assert_eq!(h.stats().active, CAP as u64);
    let mut req = requester(&fabric, &h)?;
    route_once(&mut req)?;
    assert!(h.stats().evicted >= 1, "{:?}", h.stats());
    // The session that made room had its connection closed.
    assert!(read_within(&unproven[0], Duration::from_secs(2))?.is_empty());
    drop(unproven);
    Ok(())
}

/// A session that has not proven its address is answered nothing but its welcome: a flood of
/// Stats lines gets no answer (before, each was answered, 64 MiB buffered per session), and
/// the session is closed once its proof is overdue.
#[test]
fn nothing_but_the_welcome_is_answered_before_the_proof() -> Result<()> {
    let _serial = serial();
    let fabric = MemFabric::new();
    let h = holder_with(&fabric, |c| c.proof_timeout = Duration::from_millis(500))?;
    let engine = TransferEngine::mem(&fabric, 1)?;
    let reply = engine.alloc_mr(1 << 16)?;
    let mut control = welcomed_unproven(&h, &engine, &reply)?;
    for _ in 0..1000 {
        writeln!(control, "\"Stats\"")?;
    }
    assert!(
        read_within(&control, Duration::from_millis(300))?.is_empty(),
        "a Stats answer before the proof"
    );
    assert!(h.stats().refused >= 1000, "{:?}", h.stats());
    // Past the proof timeout the session is closed and its slot free.
    std::thread::sleep(Duration::from_millis(700));
    assert!(read_within(&control, Duration::from_secs(1))?.is_empty());
    assert_eq!(h.stats().active, 0, "{:?}", h.stats());
    // A proven requester is answered.
    let mut req = requester(&fabric, &h)?;
    route_once(&mut req)?;
    assert!(req.holder_stats(0).is_ok());
    Ok(())
}
