//! A requester's reply region, as any holder may write it: the reply header, the served
//! arrivals it implies, and the partial rows read in place or decoded. Nothing may panic.
#![no_main]

use kvroute_kernels::{Partial, WirePartial};
use kvroute_remote::wire;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let header = wire::decode_reply_header(data);
    if let Some(h) = &header {
        let _ = h.kernel_us_within(1000.0);
        let per: Vec<u64> = (0..h.statuses.len() as u64).collect();
        let _ = wire::served_arrivals(Some(h), &per);
    }
    if let Ok(p) = WirePartial::new(data) {
        for r in 0..p.rows() {
            let _ = (p.m(r), p.l(r), p.row(r));
        }
        let mut out = Partial::empty(0);
        let _ = kvroute_kernels::merge_wire(&[p], &mut out);
    }
    if let Ok(p) = Partial::from_wire(data) {
        let _ = p.validate();
    }
});
