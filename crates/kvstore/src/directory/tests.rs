use std::time::Duration;

use kvroute_kernels::RopeLayout;
use kvroute_transport::{DomainAddr, MrDesc, RemoteKey};
use proptest::prelude::*;

use super::*;
use crate::layout::BlockLayout;

fn engine(n: u8) -> NetAddr {
    NetAddr {
        nics: vec![DomainAddr {
            provider: "mem".to_owned(),
            bytes: vec![n],
        }],
    }
}

fn holder(n: u8) -> HolderRecord {
    let control: SocketAddr = format!("127.0.0.1:{}", 4000 + u16::from(n))
        .parse()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 1)));
    HolderRecord::new(control, engine(n))
}

fn chunk(id: u32, h: &HolderRecord, replica: u32, tokens: u32) -> ChunkRecord {
    let layout = BlockLayout { layers: 2, tokens };
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
            positions: (0..i64::from(tokens)).collect(),
        },
    }
}

#[test]
fn registrations_come_and_go_with_their_handles() -> Result<(), DirectoryError> {
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let g0 = watch.current().map_or(0, |s| s.generation);
    let (a, b) = (holder(1), holder(2));
    // b registers chunk 0 as replica 1 first, a as replica 0 after: a is offered first.
    let rb = dir.register(b.clone(), vec![chunk(0, &b, 1, 64), chunk(1, &b, 0, 64)])?;
    let ra = dir.register(a.clone(), vec![chunk(0, &a, 0, 64)])?;
    let view = dir.view()?;
    assert!(view.skipped.is_empty(), "{:?}", view.skipped);
    assert_eq!(view.holders.len(), 2);
    let replicas = view
        .registry
        .holders(ChunkId(0))
        .map_err(|e| DirectoryError::InvalidRecord(e.to_string()))?;
    assert_eq!(replicas[0].holder, a.engine);
    assert_eq!(replicas[1].holder, b.engine);
    assert_eq!(
        view.holders[&b.id].chunks,
        [(ChunkId(0), 1), (ChunkId(1), 0)]
    );
    assert_eq!(
        view.holder_by_engine(&a.engine).map(|h| &h.record),
        Some(&a)
    );
    let seen = watch.wait_newer(g0, Duration::from_secs(1));
    assert!(seen.is_some_and(|s| s.generation > g0 && s.view.holders.len() == 2));
    ra.revoke()?;
    drop(rb);
    let view = dir.view()?;
    assert!(view.holders.is_empty() && view.registry.is_empty());
    assert!(
        watch
            .current()
            .is_some_and(|s| s.view.holders.is_empty() && s.stale.is_none())
    );
    Ok(())
}

#[test]
fn bad_contents_are_skipped_and_named() -> Result<(), DirectoryError> {
    let dir = InProcessDirectory::new();
    let (a, b) = (holder(1), holder(2));
    let _ra = dir.register(a.clone(), vec![chunk(0, &a, 0, 64)])?;
    // b claims chunk 0 with another layout: skipped, a's copy stays.
    let _rb = dir.register(b.clone(), vec![chunk(0, &b, 1, 128), chunk(2, &b, 0, 64)])?;
    dir.put_raw(&holder_key("garbage"), b"{not json");
    let mut old = holder(3);
    old.schema = 2;
    dir.put_raw(
        &holder_key(&old.id),
        &serde_json::to_vec(&old).unwrap_or_default(),
    );
    // A record under another holder's key.
    dir.put_raw(
        &holder_key("someone-else"),
        &serde_json::to_vec(&holder(4)).unwrap_or_default(),
    );
    // A chunk of a holder with no record, and a chunk under the wrong chunk key.
    let ghost = holder(5);
    dir.put_raw(
        &chunk_key(ChunkId(3), &ghost.id),
        &serde_json::to_vec(&chunk(3, &ghost, 0, 64)).unwrap_or_default(),
    );
    dir.put_raw(
        &chunk_key(ChunkId(4), &a.id),
        &serde_json::to_vec(&chunk(5, &a, 0, 64)).unwrap_or_default(),
    );
    // A forged entry: block past its region.
    let mut forged = chunk(6, &a, 0, 64);
    forged.entry.offset = 1;
    dir.put_raw(
        &chunk_key(ChunkId(6), &a.id),
        &serde_json::to_vec(&forged).unwrap_or_default(),
    );
    dir.put_raw(&format!("{PREFIX}leases/x"), b"1");
    dir.put_raw("/other-app/key", b"ignored silently");
    let view = dir.view()?;
    let skipped = view.skipped.join("\n");
    assert_eq!(view.skipped.len(), 8, "{skipped}");
    for why in [
        "not a holder record",
        "schema version 2",
        "record of holder",
        "has no record",
        "disagrees with its key",
        "outside its region",
        "not a holder or chunk key",
        "replica differs",
    ] {
        assert!(skipped.contains(why), "{why} not in {skipped}");
    }
    assert_eq!(view.holders.len(), 2);
    assert_eq!(
        view.registry.ids().collect::<Vec<_>>(),
        [ChunkId(0), ChunkId(2)]
    );
    assert_eq!(view.holders[&b.id].chunks, [(ChunkId(2), 0)]);
    Ok(())
}

#[test]
fn a_registration_must_describe_its_own_holder() {
    let dir = InProcessDirectory::new();
    let (a, b) = (holder(1), holder(2));
    assert!(matches!(
        dir.register(a.clone(), vec![chunk(0, &b, 0, 64)]),
        Err(DirectoryError::InvalidRecord(_))
    ));
    let mut bad = a.clone();
    bad.id = "a/b".to_owned();
    assert!(matches!(
        dir.register(bad, Vec::new()),
        Err(DirectoryError::InvalidRecord(_))
    ));
    assert!(matches!(
        open("http://x", Duration::from_secs(1)),
        Err(DirectoryError::Config(_))
    ));
    assert!(matches!(
        open("etcd://", Duration::from_secs(1)),
        Err(DirectoryError::Config(_))
    ));
}

proptest! {
    // Whatever bytes a directory holds, reading them never panics, and only validated
    // entries come out.
    #[test]
    fn arbitrary_entries_never_panic(
        entries in proptest::collection::vec(
            (
                prop_oneof![
                    Just(holder_key("h")),
                    Just(chunk_key(ChunkId(1), "h")),
                    "/kvroute/v1/[a-z/0-9]{0,24}",
                ],
                proptest::collection::vec(any::<u8>(), 0..64),
                any::<i64>(),
            ),
            0..8,
        ),
        valid in any::<bool>(),
    ) {
        let h = holder(9);
        let mut owned: Vec<(Vec<u8>, Vec<u8>, i64)> = entries
            .into_iter()
            .map(|(k, v, l)| (k.into_bytes(), v, l))
            .collect();
        if valid {
            owned.push((
                holder_key(&h.id).into_bytes(),
                serde_json::to_vec(&h).unwrap_or_default(),
                7,
            ));
        }
        let view = DirectoryView::from_entries(
            owned.iter().map(|(k, v, l)| (k.as_slice(), v.as_slice(), *l)),
        );
        prop_assert_eq!(view.holders.contains_key(&h.id), valid);
        prop_assert!(view.holders.len() <= usize::from(valid));
    }
}
