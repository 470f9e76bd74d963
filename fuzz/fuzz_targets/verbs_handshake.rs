//! What a verbs domain's UD queue pair receives: anyone on the fabric can send it datagrams.
//! Any bytes parse to a handshake or to nothing, never a panic; what parses encodes back to
//! the same bytes; addresses likewise.
#![no_main]

use kvroute_transport::verbs::{Handshake, VerbsAddr};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some(h) = Handshake::decode(data) {
        let mut out = vec![0u8; Handshake::BYTES];
        h.encode(&mut out);
        assert_eq!(out[..], data[..Handshake::BYTES]);
    }
    if let Ok(a) = VerbsAddr::decode(data) {
        assert_eq!(a.encode(), data);
    }
});
