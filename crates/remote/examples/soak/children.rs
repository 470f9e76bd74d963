//! The soak's child processes: the holder (`--holder`), the honest requester
//! (`--requester`), the rogue session (`--rogue`) and the session that never proves its address
//! (`--unproven`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use kvroute_kvstore::ChunkId;
use kvroute_remote::session::{self, Hello};
use kvroute_remote::wire;
use kvroute_remote::{HeldChunks, Holder, Requester, RequesterConfig};
use kvroute_transport::{OnDone, TransferEngine};

use crate::common::{Error, digest, engine};
use crate::{ERRORED, QUERIES, Rng, WRONG, calls, corpus, holder_config, queries};

/// A holder of the corpus on `engine`, listening on a loopback port.
pub(crate) fn start_holder(engine: TransferEngine) -> Result<Holder, Error> {
    let held = HeldChunks::generate(&engine, &corpus(), &[ChunkId(0), ChunkId(1)])?;
    Ok(Holder::start(
        engine,
        TcpListener::bind("127.0.0.1:0")?,
        held,
        holder_config(),
    )?)
}

/// `--holder PROVIDER [URL]`: serves the corpus (registered in the directory at URL, if one
/// is named), prints its control address, and exits cleanly when its stdin closes.
pub(crate) fn holder(provider: &str, url: Option<&str>) -> Result<(), Error> {
    let engine = engine(provider)?;
    let holder = start_holder(engine)?;
    let registration = url
        .map(|url| crate::hostile::register(&holder, url))
        .transpose()?;
    println!("{}", holder.addr());
    std::io::stdout().flush()?;
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line)? > 0 {
        line.clear();
    }
    drop(registration);
    drop(holder);
    Ok(())
}

/// The reference digests (`v:chunk:digest,...`) by (query set, chunk).
pub(crate) fn want_digests(reference: &str) -> Result<BTreeMap<(u64, u32), u64>, Error> {
    reference
        .split(',')
        .map(|e| {
            let f: Vec<&str> = e.split(':').collect();
            match f[..] {
                [v, c, d] => Some((
                    (v.parse().ok()?, c.parse().ok()?),
                    u64::from_str_radix(d, 16).ok()?,
                )),
                _ => None,
            }
        })
        .collect::<Option<_>>()
        .ok_or_else(|| "a malformed reference".into())
}

/// The config of every requester in the soak.
pub(crate) fn requester_config() -> RequesterConfig {
    RequesterConfig {
        timeout: Duration::from_secs(5),
        link_bytes: 1 << 16,
        pool_pages: 4,
        ..RequesterConfig::new(0.1)
    }
}

/// Routes one step of query set `v` and checks each partial against `want`; the exit code
/// to end with otherwise (3 for a wrong partial, 2 for an error), the reason on stderr.
pub(crate) fn route_checked(
    req: &mut Requester,
    v: u64,
    want: &BTreeMap<(u64, u32), u64>,
) -> Result<(), i32> {
    let q = queries(v);
    for (chunk, result) in req.route(&calls(&q)).into_iter().enumerate() {
        match result {
            Ok(p) if want.get(&(v, chunk as u32)) == Some(&digest(&p)) => {}
            Ok(_) => {
                eprintln!("query set {v}, chunk {chunk}: a partial differs from the reference");
                return Err(WRONG);
            }
            Err(e) => {
                eprintln!("route: {e}");
                return Err(ERRORED);
            }
        }
    }
    Ok(())
}

/// `--requester PROVIDER HOLDER REFERENCE`: routes 1-12 steps and checks every partial
/// against the reference digests. Exit 0: all exact; 2: an error; 3: a wrong partial.
pub(crate) fn requester(provider: &str, holder: &str, reference: &str) -> Result<(), Error> {
    let want = want_digests(reference)?;
    let mut rng = Rng::seeded();
    let mut req = connect_or_exit(provider, &[holder.parse()?], requester_config())?;
    let steps = rng.range(1, 13);
    let outcome = (|| {
        for _ in 0..steps {
            route_checked(&mut req, rng.range(0, QUERIES), &want)?;
            println!("step");
            std::thread::sleep(rng.millis(0, 200));
        }
        Ok(())
    })();
    finish(req, outcome)
}

/// A requester over `provider` connected to `holders`; a refusal (busy, a holder gone) ends
/// the process as an error outcome (exit 2).
pub(crate) fn connect_or_exit(
    provider: &str,
    holders: &[std::net::SocketAddr],
    config: RequesterConfig,
) -> Result<Requester, Error> {
    match Requester::connect(engine(provider)?, holders, config) {
        Ok(r) => Ok(r),
        Err(e) => {
            eprintln!("connect: {e}");
            std::process::exit(ERRORED);
        }
    }
}

/// Drops `req`, then ends the process with `outcome`'s exit code if it is one: the engine
/// closes its endpoints (unlinking their shm regions) when dropped, which `exit` would skip.
pub(crate) fn finish(req: Requester, outcome: Result<(), i32>) -> Result<(), Error> {
    drop(req);
    if let Err(code) = outcome {
        std::process::exit(code);
    }
    Ok(())
}

/// `--rogue PROVIDER HOLDER`: a real session that writes forgeries into its own inbox.
/// A hello of `engine`'s own, replies to `reply`, no pool.
fn hello_of(engine: &TransferEngine, reply: &kvroute_transport::RegisteredBuffer) -> Hello {
    Hello {
        addr: engine.main_address(),
        reply: reply.desc().clone(),
        pool: None,
        reply_imm: 0x6100_0fff,
        fetch_imm: 0x6200_0fff,
    }
}

pub(crate) fn rogue(provider: &str, holder: &str) -> Result<(), Error> {
    let mut rng = Rng::seeded();
    let engine = engine(provider)?;
    let reply = engine.alloc_mr(1 << 16)?;
    let mut control = TcpStream::connect(holder)?;
    control.set_read_timeout(Some(Duration::from_secs(10)))?;
    let hello = hello_of(&engine, &reply);
    // A real session of its own (busy or refused: an error, which ends it).
    let mut reader = BufReader::new(control.try_clone()?);
    let welcome = session::open(
        &engine,
        (&mut control, &mut reader),
        &hello,
        Duration::from_secs(5),
    )?;
    let inbox = (&welcome.inbox, welcome.slot_offset);
    let buf = engine.alloc_mr(1 << 16)?;
    let q = queries(0);
    let seg = wire::SegmentSpec {
        kind: wire::SegmentKind::Dense,
        chunk: 0,
        layer: 0,
        queries: wire::QueryRows::Copied(&q),
        indices: &[],
        pages: &[],
        windows: &[],
    };
    let mut seq = 1;
    for _ in 0..rng.range(4, 24) {
        let mut bytes = Vec::new();
        wire::encode_request(&mut bytes, seq, welcome.token, 0, 0.1, &[seg]);
        seq += 1;
        let imm = match rng.range(0, 7) {
            // A flood of immediates of random values (the holder counts and drops them).
            5 => {
                for _ in 0..rng.range(1_000, 20_000) {
                    engine.submit_imm(rng.next() as u32, &welcome.inbox, OnDone::nothing())?;
                }
                continue;
            }
            // Immediates naming every session, as requests and pings.
            0 => {
                let session = rng.range(0, 8) as u16;
                let imm = if rng.next() & 1 == 0 {
                    wire::request_imm(session, 1)
                } else {
                    wire::ping_imm(session, 1)
                };
                engine.submit_imm(imm, &welcome.inbox, OnDone::nothing())?;
                continue;
            }
            // The wrong token.
            1 => {
                bytes.clear();
                wire::encode_request(&mut bytes, seq, welcome.token ^ rng.next(), 0, 0.1, &[seg]);
                wire::request_imm(welcome.session, 1)
            }
            // A replay of an older sequence number.
            2 => {
                bytes.clear();
                wire::encode_request(&mut bytes, 1, welcome.token, 0, 0.1, &[seg]);
                wire::request_imm(welcome.session, 1)
            }
            // Random bytes.
            3 => {
                let len = rng.range(1, 4096) as usize;
                bytes = (0..len).map(|_| rng.next() as u8).collect();
                wire::request_imm(welcome.session, 1)
            }
            // A request with flipped bytes past its token.
            _ => {
                for _ in 0..rng.range(1, 8) {
                    let at = rng.range(wire::REQUEST_HEADER as u64 - 16, bytes.len() as u64);
                    bytes[at as usize] ^= 1 << rng.range(0, 8);
                }
                wire::request_imm(welcome.session, 1)
            }
        };
        buf.write_at(0, &bytes)?;
        let (done, fut) = OnDone::future();
        engine.submit_single_write(
            bytes.len() as u64,
            Some(imm),
            (buf.handle(), 0),
            inbox,
            done,
        )?;
        kvroute_transport::block_on(fut)?;
        std::thread::sleep(rng.millis(0, 20));
    }
    std::thread::sleep(rng.millis(0, 500));
    Ok(())
}

/// A hello that never proves its address, then `Stats` lines: the holder must answer nothing
/// but the welcome (or turn it away busy) and close it at its proof timeout.
pub(crate) fn unproven(provider: &str, holder: &str) -> Result<(), Error> {
    let mut rng = Rng::seeded();
    let engine = engine(provider)?;
    let reply = engine.alloc_mr(1 << 16)?;
    let hello = hello_of(&engine, &reply);
    let mut control = TcpStream::connect(holder)?;
    control.set_read_timeout(Some(Duration::from_secs(10)))?;
    writeln!(control, "{}", serde_json::to_string(&hello)?)?;
    let mut reader = BufReader::new(control.try_clone()?);
    let mut welcome = String::new();
    reader.read_line(&mut welcome)?;
    if !welcome.contains("Welcome") {
        return Err(format!("no welcome: {}", welcome.trim()).into());
    }
    for _ in 0..rng.range(100, 2_000) {
        if writeln!(control, "\"Stats\"").is_err() {
            break; // closed at the proof timeout: fine
        }
    }
    control.set_read_timeout(Some(rng.millis(500, 6_000)))?;
    let mut more = String::new();
    match reader.read_line(&mut more) {
        Ok(0) | Err(_) => Ok(()),
        Ok(_) => {
            eprintln!("an unproven session was answered: {}", more.trim());
            std::process::exit(WRONG)
        }
    }
}
