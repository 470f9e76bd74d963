//! Admission: connections that never say hello, sessions that never prove their address
//! or never route, and one client holding every slot; each bounded, and an honest requester
//! still served.

use super::*;

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
