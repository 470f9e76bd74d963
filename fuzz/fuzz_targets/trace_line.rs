//! Request-trace lines as `kvroute trace replay` reads them: any bytes give records or typed
//! errors, never a panic, and a short replay of what parses never panics either.
#![no_main]

use kvroute_kvstore::{Eviction, ReplayConfig, TraceReader, replay};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let records: Vec<_> = TraceReader::new(data, 512).collect();
    let config = ReplayConfig {
        block_tokens: 512,
        capacity_blocks: 4,
        policy: Eviction::TailFirst,
        limit: 0,
    };
    let _ = replay(records.into_iter().filter(Result::is_ok), config, None);
});
