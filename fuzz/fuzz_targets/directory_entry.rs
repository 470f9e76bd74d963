//! Directory contents as a requester reads them back from etcd: any keys and values give a
//! validated view (bad entries skipped and named), never a panic. The input is split into
//! entries at 0xFF bytes, each entry into key and value at its first 0xFE byte.
#![no_main]

use kvroute_kvstore::directory::DirectoryView;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let entries: Vec<(&[u8], &[u8], i64)> = data
        .split(|&b| b == 0xff)
        .enumerate()
        .map(|(i, e)| {
            let cut = e.iter().position(|&b| b == 0xfe).unwrap_or(e.len());
            let value = e.get(cut + 1..).unwrap_or_default();
            (&e[..cut], value, i as i64)
        })
        .collect();
    let view = DirectoryView::from_entries(entries.iter().copied());
    // Every chunk accepted is served by a holder with a record.
    for id in view.registry.ids() {
        for e in view.registry.holders(id).unwrap_or_default() {
            assert!(view.holder_by_engine(&e.holder).is_some());
        }
    }
});
