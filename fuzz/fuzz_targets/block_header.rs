//! Storage-tier block headers as a read parses them: any 4 KiB (or shorter) gives a key and
//! checksums or a reason, never a panic, whatever the layout the store expects.
#![no_main]

use kvroute_kvstore::BlockLayout;
use kvroute_kvstore::storage::parse_header;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let (layers, tokens) = match data {
        [a, b, ..] => (u32::from(*a % 8) + 1, u32::from(*b) * 4 + 1),
        _ => (1, 64),
    };
    if let Ok(layout) = BlockLayout::new(layers, tokens) {
        let _ = parse_header(data, layout);
        let _ = parse_header(data.get(2..).unwrap_or_default(), layout);
    }
});
