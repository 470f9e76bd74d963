//! A holder among untrusted peers, over the in-process `mem` fabric: a peer that speaks the
//! protocol by hand tries to make the holder write where it should not. Each test names the
//! attack and checks that the holder refuses it and goes on serving the honest requester.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod admission;
#[path = "../common/mod.rs"]
mod common;
mod writes;

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
