//! The etcd directory against real etcd processes (skipped, and counted as skipped, where no
//! etcd binary is installed; `cargo xtask deps` installs one).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_kernels::RopeLayout;
use kvroute_kvstore::directory::etcd::{EtcdConfig, EtcdDirectory};
use kvroute_kvstore::directory::{
    ChunkRecord, Directory, DirectoryError, HolderRecord, SCHEMA, Watch, WatchState, chunk_key,
    holder_key,
};
use kvroute_kvstore::{BlockLayout, ChunkEntry, ChunkId};
use kvroute_testkit::etcd::{EtcdCluster, etcd_available};
use kvroute_transport::{DomainAddr, MrDesc, NetAddr, RemoteKey};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn holder(n: u8) -> HolderRecord {
    let control = SocketAddr::from(([127, 0, 0, 1], 5000 + u16::from(n)));
    HolderRecord::new(
        control,
        NetAddr {
            nics: vec![DomainAddr {
                provider: "mem".to_owned(),
                bytes: vec![n],
            }],
        },
    )
}

fn chunk(id: u32, h: &HolderRecord, replica: u32) -> ChunkRecord {
    let layout = BlockLayout {
        layers: 2,
        tokens: 64,
    };
    ChunkRecord {
        schema: SCHEMA,
        holder: h.id.clone(),
        replica,
        entry: ChunkEntry {
            id: ChunkId(id),
            holder: h.engine.clone(),
            desc: MrDesc {
                addr: 0,
                len: layout.full_bytes() as u64,
                rkeys: vec![RemoteKey {
                    nic: h.engine.nics[0].clone(),
                    rkey: 1,
                }],
            },
            offset: 0,
            block_tokens: 0,
            layout,
            rope_layout: RopeLayout::Interleaved,
            positions: (0..64).collect(),
        },
    }
}

fn directory(
    cluster: &EtcdCluster,
    ttl_s: u64,
) -> std::result::Result<EtcdDirectory, DirectoryError> {
    EtcdDirectory::connect(
        &cluster.endpoints(),
        EtcdConfig::with_ttl(Duration::from_secs(ttl_s))?,
    )
}

/// Waits up to `limit` for a watch state that satisfies `ok`.
fn until(watch: &Watch, limit: Duration, ok: impl Fn(&WatchState) -> bool) -> Option<WatchState> {
    let deadline = Instant::now() + limit;
    let mut generation = 0;
    loop {
        let state = watch.wait_newer(
            generation,
            deadline.saturating_duration_since(Instant::now()),
        )?;
        if ok(&state) {
            return Some(state);
        }
        if Instant::now() >= deadline {
            return None;
        }
        generation = state.generation;
    }
}

fn no_etcd() -> bool {
    if etcd_available() {
        return false;
    }
    kvroute_testkit::skip!("no etcd binary (cargo xtask deps installs etcd-server)");
    true
}

#[test]
fn holders_register_watchers_see_them_and_revoke_removes_them() -> Result<()> {
    if no_etcd() {
        return Ok(());
    }
    let cluster = EtcdCluster::start(1)?;
    let dir = directory(&cluster, 2)?;
    let watch = dir.watch()?;
    assert!(watch.current().is_some_and(|s| s.view.holders.is_empty()));
    let (a, b) = (holder(1), holder(2));
    let ra = dir.register(a.clone(), vec![chunk(0, &a, 0), chunk(1, &a, 1)])?;
    let rb = dir.register(b.clone(), vec![chunk(1, &b, 0)])?;
    let seen = until(&watch, Duration::from_secs(5), |s| {
        s.view.holders.len() == 2
    })
    .ok_or("the watch never saw both holders")?;
    assert!(seen.view.skipped.is_empty(), "{:?}", seen.view.skipped);
    // Chunk 1: b's replica 0 is offered before a's replica 1.
    let ones = seen.view.registry.holders(ChunkId(1))?;
    assert_eq!(
        (ones[0].holder.clone(), ones[1].holder.clone()),
        (b.engine.clone(), a.engine.clone())
    );
    // Renewals keep the keys past several TTLs.
    std::thread::sleep(Duration::from_secs(5));
    let view = dir.view()?;
    assert_eq!(view.holders.len(), 2);
    let left = view.holders[&a.id].ttl_left_ms.ok_or("no TTL read")?;
    assert!((1..=2000).contains(&left), "{left} ms left");
    assert!(ra.status().registered && ra.status().re_registrations == 0);
    ra.revoke()?;
    let gone = until(&watch, Duration::from_secs(5), |s| {
        s.view.holders.len() == 1
    });
    assert!(gone.is_some_and(|s| s.view.holders.contains_key(&b.id)));
    drop(rb);
    assert!(dir.view()?.holders.is_empty());
    // Revoked at once, whatever its keeper was doing: nothing registers again behind it.
    for _ in 0..5 {
        dir.register(a.clone(), vec![chunk(0, &a, 0)])?.revoke()?;
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(dir.view()?.holders.is_empty());
    Ok(())
}

#[test]
fn bad_values_in_etcd_are_skipped() -> Result<()> {
    if no_etcd() {
        return Ok(());
    }
    let cluster = EtcdCluster::start(1)?;
    let dir = directory(&cluster, 2)?;
    let (a, b) = (holder(1), holder(2));
    let _ra = dir.register(a.clone(), vec![chunk(0, &a, 0)])?;
    // b claims chunk 0 with another layout.
    let mut other = chunk(0, &b, 1);
    other.entry.layout.tokens = 128;
    other.entry.desc.len = other.entry.layout.full_bytes() as u64;
    other.entry.positions = (0..128).collect();
    let _rb = dir.register(b.clone(), vec![other])?;
    // Garbage and a future schema, written by someone else.
    let raw = EtcdRaw::new(&cluster)?;
    raw.put(&holder_key("garbage"), b"\xff\x00 not json")?;
    let mut future = holder(3);
    future.schema = SCHEMA + 1;
    raw.put(&holder_key(&future.id), &serde_json::to_vec(&future)?)?;
    raw.put(&chunk_key(ChunkId(9), "nobody"), b"{}")?;
    let view = dir.view()?;
    assert_eq!(view.holders.len(), 2, "{:?}", view.skipped);
    assert_eq!(view.skipped.len(), 4, "{:?}", view.skipped);
    assert_eq!(view.registry.holders(ChunkId(0))?.len(), 1);
    Ok(())
}

/// Four 1.4 MB junk values under the directory's prefix (5.6 MB together, past the client's
/// 4 MiB message limit): the listing and a fresh watch still see the honest holder, and name
/// the junk as skipped (before, every listing failed: `directory list`, and a new
/// requester's first view).
#[test]
fn oversized_values_neither_break_a_listing_nor_a_watch() -> Result<()> {
    if no_etcd() {
        return Ok(());
    }
    let cluster = EtcdCluster::start(1)?;
    let dir = directory(&cluster, 5)?;
    let a = holder(1);
    let _ra = dir.register(a.clone(), vec![chunk(0, &a, 0)])?;
    let raw = EtcdRaw::new(&cluster)?;
    let junk = vec![b'x'; 1_400_000];
    for i in 0..4 {
        raw.put(&holder_key(&format!("junk-{i}")), &junk)?;
    }
    let view = dir.view()?;
    assert_eq!(view.holders.len(), 1, "{:?}", view.skipped);
    assert_eq!(view.skipped.len(), 4, "{:?}", view.skipped);
    let watch = dir.watch()?;
    let seen = until(&watch, Duration::from_secs(10), |s| {
        s.view.holders.len() == 1
    });
    assert!(seen.is_some(), "the watch's first listing");
    Ok(())
}

/// Values past a view's byte budget are left out and named, in a listing and in a watch:
/// whoever can write under the prefix cannot grow a requester's memory without bound. (Three
/// 600 kB junk values against a 1 MB budget: the honest holder and one junk value are held.)
#[test]
fn a_view_holds_at_most_its_budget_of_values() -> Result<()> {
    if no_etcd() {
        return Ok(());
    }
    let cluster = EtcdCluster::start(1)?;
    let config = EtcdConfig {
        view_bytes: 1_000_000,
        ..EtcdConfig::with_ttl(Duration::from_secs(5))?
    };
    let dir = EtcdDirectory::connect(&cluster.endpoints(), config)?;
    let a = holder(1);
    let _ra = dir.register(a.clone(), vec![chunk(0, &a, 0)])?;
    let raw = EtcdRaw::new(&cluster)?;
    // `~` sorts after the honest holder's key: the listing reads it first.
    for i in 0..3 {
        raw.put(&holder_key(&format!("~junk-{i}")), &vec![b'x'; 600_000])?;
    }
    let over = |skipped: &[String]| skipped.iter().filter(|s| s.contains("past its")).count();
    let view = dir.view()?;
    assert_eq!(view.holders.len(), 1, "{:?}", view.skipped);
    assert_eq!(over(&view.skipped), 2, "{:?}", view.skipped);
    let watch = dir.watch()?;
    let seen = until(&watch, Duration::from_secs(10), |s| {
        s.view.holders.len() == 1 && over(&s.view.skipped) == 2
    });
    assert!(seen.is_some(), "the watch's listing");
    // Deleting the junk frees the budget; a value put now is held.
    for i in 0..3 {
        raw.delete(&holder_key(&format!("~junk-{i}")))?;
    }
    raw.put(&holder_key("~late"), &vec![b'y'; 900_000])?;
    let seen = until(&watch, Duration::from_secs(10), |s| {
        over(&s.view.skipped) == 0 && s.view.skipped.len() == 1
    });
    assert!(seen.is_some(), "the freed budget holds the late value");
    Ok(())
}

/// Raw puts through the client, for contents the directory itself never writes.
struct EtcdRaw {
    runtime: tokio::runtime::Runtime,
    client: etcd_client::Client,
}

impl EtcdRaw {
    fn new(cluster: &EtcdCluster) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = runtime.block_on(etcd_client::Client::connect(cluster.endpoints(), None))?;
        Ok(Self { runtime, client })
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut client = self.client.clone();
        self.runtime.block_on(client.put(key, value, None))?;
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<()> {
        let mut client = self.client.clone();
        self.runtime.block_on(client.delete(key, None))?;
        Ok(())
    }
}

#[test]
fn an_etcd_restart_keeps_or_restores_registrations() -> Result<()> {
    if no_etcd() {
        return Ok(());
    }
    let mut cluster = EtcdCluster::start(1)?;
    let dir = directory(&cluster, 2)?;
    let watch = dir.watch()?;
    let a = holder(1);
    let ra = dir.register(a.clone(), vec![chunk(0, &a, 0)])?;
    until(&watch, Duration::from_secs(5), |s| {
        s.view.holders.len() == 1
    })
    .ok_or("not seen")?;
    // A crash and restart on the same data: the lease survives, the watch reconnects.
    cluster.kill(0);
    let stale = until(&watch, Duration::from_secs(10), |s| s.stale.is_some())
        .ok_or("the watch did not notice etcd going away")?;
    assert_eq!(stale.view.holders.len(), 1, "the last view is kept");
    cluster.restart(0)?;
    let back = until(&watch, Duration::from_secs(15), |s| {
        s.stale.is_none() && s.view.holders.len() == 1
    });
    assert!(back.is_some(), "the watch did not come back");
    // A restart with the data lost: the keeper writes the registration again.
    cluster.kill(0);
    std::fs::remove_dir_all(cluster.dir().join("m0"))?;
    cluster.restart(0)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while ra.status().re_registrations == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ra.status().re_registrations >= 1, "{:?}", ra.status());
    let again = until(&watch, Duration::from_secs(15), |s| {
        s.stale.is_none() && s.view.holders.len() == 1
    });
    assert!(again.is_some(), "the re-registration was not seen");
    assert_eq!(dir.view()?.holders.len(), 1);
    Ok(())
}

#[test]
fn a_three_member_cluster_survives_losing_one() -> Result<()> {
    if no_etcd() {
        return Ok(());
    }
    let mut cluster = EtcdCluster::start(3)?;
    let dir = directory(&cluster, 2)?;
    let watch = dir.watch()?;
    let (a, b) = (holder(1), holder(2));
    let ra = dir.register(a.clone(), vec![chunk(0, &a, 0)])?;
    until(&watch, Duration::from_secs(5), |s| {
        s.view.holders.len() == 1
    })
    .ok_or("not seen")?;
    for lost in 0..3 {
        cluster.kill(lost);
        cluster.wait_healthy(Duration::from_secs(15))?;
        // Past two TTLs with one member gone: the lease is still renewed through the others.
        std::thread::sleep(Duration::from_secs(5));
        let view = dir.view()?;
        assert!(
            view.holders.contains_key(&a.id),
            "member {lost} lost: {view:?}"
        );
        assert_eq!(ra.status().re_registrations, 0, "{:?}", ra.status());
        cluster.restart(lost)?;
    }
    // And a registration made with a member down is seen by the watch.
    cluster.kill(1);
    cluster.wait_healthy(Duration::from_secs(15))?;
    let _rb = dir.register(b.clone(), vec![chunk(1, &b, 0)])?;
    let both = until(&watch, Duration::from_secs(15), |s| {
        s.stale.is_none() && s.view.holders.len() == 2
    });
    assert!(both.is_some());
    Ok(())
}
