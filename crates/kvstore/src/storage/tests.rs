//! Unit tests of `storage`.

use super::dir::MANIFEST;
use super::format::CRC_TABLE;
use super::*;

fn block(layout: BlockLayout, key: u64) -> Vec<u8> {
    (0..layout.full_bytes())
        .map(|i| (i as u64).wrapping_mul(0x9e37_79b9).wrapping_add(key) as u8)
        .collect()
}

fn tmpdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-storage-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Files planted in a store's directory: a FIFO named like a block file, a directory
/// named like a partial write, a manifest linked to a device, a symlink where the layout's
/// temporary file goes. None hangs, none is read without bound, none is written through.
#[test]
fn planted_files_are_refused_not_followed() -> Result<(), StorageError> {
    let layout = BlockLayout::new(2, 64)?;
    // A symlink at `.layout.tmp` in a new store: its target keeps its bytes.
    let dir = tmpdir("planted-layout");
    std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let target = dir.join("target");
    std::fs::write(&target, b"keep").map_err(io("writing", &target))?;
    std::os::unix::fs::symlink(&target, dir.join(".layout.tmp")).map_err(io("linking", &dir))?;
    let (mut store, _) = BlockStore::open(&dir, layout)?;
    assert_eq!(
        std::fs::read(&target).map_err(io("reading", &target))?,
        b"keep"
    );
    store.put(3, &block(layout, 3))?;
    // A FIFO named like a block file, and a directory named like a partial write.
    let fifo = dir.join(format!("{:016x}.{SUFFIX}", 4));
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU)
        .map_err(|e| io("mkfifo", &fifo)(e.into()))?;
    std::fs::create_dir(dir.join(".junk.tmp")).map_err(io("creating", &dir))?;
    let started = std::time::Instant::now();
    let (mut store, recovery) = BlockStore::open(&dir, layout)?;
    let verify = store.verify()?;
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(verify.ok, 1, "{verify:?}");
    assert!(
        verify
            .corrupt
            .iter()
            .any(|(n, why)| n.ends_with(SUFFIX) && why.contains("FIFO")),
        "{verify:?}"
    );
    assert!(
        recovery.refused.iter().any(|(n, _)| n == ".junk.tmp"),
        "{recovery:?}"
    );
    drop(store);
    // A manifest linked to a device: refused, naming it, not read until memory runs out.
    let manifest = dir.join(MANIFEST);
    std::fs::remove_file(&manifest).map_err(io("removing", &manifest))?;
    std::os::unix::fs::symlink("/dev/zero", &manifest).map_err(io("linking", &manifest))?;
    let e = BlockStore::open(&dir, layout).err().map(|e| e.to_string());
    assert!(
        e.as_deref()
            .is_some_and(|e| e.contains("manifest") && e.contains("symlink")),
        "{e:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn blocks_and_layers_round_trip_and_survive_reopen() -> Result<(), StorageError> {
    let dir = tmpdir("roundtrip");
    let layout = BlockLayout::new(3, 100)?;
    let (mut store, rec) = BlockStore::open(&dir, layout)?;
    assert_eq!(rec, Recovery::default());
    for key in [1u64, 2, 0xdead_beef] {
        store.put(key, &block(layout, key))?;
    }
    drop(store);
    let (mut store, rec) = BlockStore::open(&dir, layout)?;
    assert_eq!(rec.blocks, 3);
    let mut out = vec![0u8; layout.full_bytes()];
    store.get_into(2, &mut out)?;
    assert_eq!(out, block(layout, 2));
    let lb = layout.layer_elems() * 2;
    let mut layer = vec![0u8; lb];
    store.get_layer_into(0xdead_beef, 2, &mut layer)?;
    assert_eq!(layer, block(layout, 0xdead_beef)[2 * lb..]);
    assert_eq!(
        store.stats().bytes_read,
        (2 * HEADER_BYTES + layout.full_bytes() + lb) as u64
    );
    assert!(matches!(
        store.get_into(7, &mut out),
        Err(StorageError::Missing { key: 7 })
    ));
    assert!(matches!(
        store.get_into(2, &mut out[1..]),
        Err(StorageError::Shape { .. })
    ));
    store.remove(1)?;
    let v = store.verify()?;
    assert_eq!(
        (v.ok, v.corrupt.len(), v.missing.len()),
        (2, 0, 0),
        "a removed block is not missing"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A block leaves memory for disk and comes back into another slot of a registered pool,
/// the bytes the transport would then send.
#[test]
fn a_block_is_demoted_to_disk_and_promoted_into_a_registered_slot()
-> Result<(), Box<dyn std::error::Error>> {
    use kvroute_transport::{MemFabric, TransferEngine};
    let dir = tmpdir("promote");
    let layout = BlockLayout::new(2, 100)?;
    let engine = TransferEngine::mem(&MemFabric::new(), 1)?;
    let slots = crate::PagedPool::new(4, layout.full_bytes())?;
    let region = engine.alloc_mr(slots.bytes())?;
    let (mut store, _) = BlockStore::open(&dir, layout)?;
    // In memory at slot 0; demoted: written out, slot freed.
    let held = slots.alloc(1)?;
    let bytes = block(layout, 77);
    region.write_at(slots.offset(held[0])?, &bytes)?;
    let mut copy = vec![0u8; layout.full_bytes()];
    region.read_at(slots.offset(held[0])?, &mut copy)?;
    store.put(77, &copy)?;
    slots.release(&held)?;
    region.fill(0);
    // Promoted into another slot.
    let _other = slots.alloc(1)?;
    let back = slots.alloc(1)?;
    assert_ne!(back, held);
    // SAFETY: the slot was just allocated to this read and nothing else touches it.
    unsafe { store.get_into_region(77, &region, slots.offset(back[0])?)? };
    let mut got = vec![0u8; layout.full_bytes()];
    region.read_at(slots.offset(back[0])?, &mut got)?;
    assert_eq!(got, bytes);
    // Past the region's end: refused, nothing read.
    // SAFETY: nothing else uses the region.
    let past = unsafe { store.get_into_region(77, &region, slots.offset(3)? + 1) };
    assert!(matches!(past, Err(StorageError::Shape { .. })));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// One flipped byte anywhere in a record (header, checksum table, any layer, the padding of
/// a page) is caught: by the header checksum, by a layer's, or by the open-time checks.
#[test]
fn every_flipped_byte_is_detected() -> Result<(), StorageError> {
    let dir = tmpdir("flip");
    let layout = BlockLayout::new(2, 64)?;
    let (mut store, _) = BlockStore::open(&dir, layout)?;
    store.put(5, &block(layout, 5))?;
    let path = store.path(5);
    let good = std::fs::read(&path).map_err(io("reading", &path))?;
    let mut out = vec![0u8; layout.full_bytes()];
    // Every byte of the meaningful header, then a stride through the payload.
    let used = CRC_TABLE + 4 * 2 + 4;
    let positions = (0..used)
        .chain((HEADER_BYTES..good.len()).step_by(997))
        .chain([good.len() - 1]);
    for at in positions {
        let mut bad = good.clone();
        bad[at] ^= 0x10;
        std::fs::write(&path, &bad).map_err(io("writing", &path))?;
        let (mut s, _) = BlockStore::open(&dir, layout)?;
        assert!(
            s.get_into(5, &mut out).is_err(),
            "a flip at byte {at} was read as good"
        );
        if at >= HEADER_BYTES {
            let layer = ((at - HEADER_BYTES) / (layout.layer_elems() * 2)) as u32;
            let mut l = vec![0u8; layout.layer_elems() * 2];
            assert!(
                s.get_layer_into(5, layer, &mut l).is_err(),
                "layer {layer} read at flip {at}"
            );
            // The other layer is untouched and still reads.
            s.get_layer_into(5, 1 - layer, &mut l)?;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn truncated_and_foreign_files_are_refused() -> Result<(), StorageError> {
    let dir = tmpdir("trunc");
    let layout = BlockLayout::new(2, 64)?;
    let (mut store, _) = BlockStore::open(&dir, layout)?;
    store.put(9, &block(layout, 9))?;
    let path = store.path(9);
    let good = std::fs::read(&path).map_err(io("reading", &path))?;
    for len in [
        0,
        7,
        HEADER_BYTES - 1,
        HEADER_BYTES,
        HEADER_BYTES + 1,
        good.len() - 1,
    ] {
        std::fs::write(&path, &good[..len]).map_err(io("writing", &path))?;
        let (mut s, rec) = BlockStore::open(&dir, layout)?;
        assert_eq!(rec.refused.len(), 1, "truncated to {len}");
        assert!(matches!(
            s.get_into(9, &mut vec![0; layout.full_bytes()]),
            Err(StorageError::Missing { .. })
        ));
        let v = s.verify()?;
        assert_eq!(
            v.corrupt.len(),
            1,
            "verify names the truncated block ({len})"
        );
    }
    // A block of another layout under the right name.
    let other = BlockLayout::new(3, 64)?;
    let odir = tmpdir("trunc-other");
    let (mut o, _) = BlockStore::open(&odir, other)?;
    o.put(9, &block(other, 9))?;
    std::fs::copy(o.path(9), &path).map_err(io("copying", &path))?;
    let (_, rec) = BlockStore::open(&dir, layout)?;
    assert!(
        rec.refused[0].1.contains("3 layers x 64 tokens"),
        "{:?}",
        rec.refused
    );
    // The whole store opened as another layout.
    assert!(matches!(
        BlockStore::open(&dir, other),
        Err(StorageError::WrongLayout {
            found_layers: 2,
            ..
        })
    ));
    assert_eq!(BlockStore::open_existing(&dir)?.0.layout(), layout);
    // A block of the right layout under another key's name.
    std::fs::write(&path, &good).map_err(io("writing", &path))?;
    std::fs::rename(&path, store.path(10)).map_err(io("renaming", &path))?;
    let (mut s, rec) = BlockStore::open(&dir, layout)?;
    assert!(
        rec.refused[0].1.contains("holds block 0000000000000009"),
        "{:?}",
        rec.refused
    );
    assert!(matches!(
        s.get_into(10, &mut vec![0; layout.full_bytes()]),
        Err(StorageError::Missing { .. })
    ));
    let v = s.verify()?;
    assert_eq!(v.missing, ["0000000000000009"]);
    assert_eq!(v.corrupt.len(), 1);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&odir);
    Ok(())
}
