//! A holder's inbox slot, as any peer may write it: requests (every segment's accessors
//! too), pings and their immediates. Nothing may panic or read out of bounds.
//!
//! Raw bytes rarely get past the header's magic and version, so each input is also read as
//! a recipe: its first bytes choose up to four well-formed segments, the request is encoded
//! as a requester would, and the remaining bytes overwrite it at positions of their choosing
//! (lying counts, offsets and lengths inside a request the parser trusts the header of).
#![no_main]

use kvroute_remote::wire::{self, PoolWindow, QueryRows, SegmentKind, SegmentSpec};
use kvroute_transport::{DomainAddr, MrDesc, RemoteKey};

const ROW: usize = 576;

fn parse_all(data: &[u8]) {
    let _ = wire::request_credentials(data);
    let _ = wire::parse_ping(data);
    // A proof message is read from a holder's receive buffer.
    if let Some((session, token)) = wire::parse_proof(data) {
        assert_eq!(wire::encode_proof(session, token)[..], data[..]);
    }
    if let Ok(req) = wire::Request::parse(data) {
        let _ = req.reply_rows();
        for seg in req.segments.iter().flatten() {
            let _ = (seg.queries(), seg.query_words(), seg.indices(), seg.pages());
            let _ = seg.reply_rows();
            for w in seg.windows() {
                let _ = (w.keys().count(), w.covers(w.offset, w.len), w.covers(u64::MAX, 1));
            }
        }
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    parse_all(data);
    if data.len() >= 4 {
        let imm = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let _ = wire::parse_request_imm(imm);
        let _ = wire::parse_ping_imm(imm);
    }
    // The recipe.
    let mut bytes = data.iter().copied();
    let mut next = || bytes.next().unwrap_or(0);
    let queries = vec![0x3f80u16; 4 * ROW];
    let indices: Vec<i32> = (-1..15).collect();
    let pages: Vec<u32> = (0..8).collect();
    // Windows of one and of two NIC keys, as a one- and a two-NIC requester grants them.
    let desc = |keys: u64| MrDesc {
        addr: 0x7000_0000,
        len: 8 * 73_728,
        rkeys: (0..keys)
            .map(|k| RemoteKey {
                nic: DomainAddr {
                    provider: "mem".into(),
                    bytes: vec![k as u8],
                },
                rkey: 0x1234 + k,
            })
            .collect(),
    };
    let (one, two) = (desc(1), desc(2));
    let windows = [
        [
            PoolWindow { offset: 0, desc: &one },
            PoolWindow { offset: 73_728, desc: &one },
        ],
        [
            PoolWindow { offset: 0, desc: &two },
            PoolWindow { offset: 147_456, desc: &two },
        ],
    ];
    let segments: Vec<SegmentSpec<'_>> = (0..next() % 5)
        .map(|_| {
            let rows = 1 + usize::from(next() % 4);
            let (kind, idx, pg) = match next() % 4 {
                0 => (SegmentKind::Dense, 0, 0),
                1 => (
                    SegmentKind::Sparse {
                        k: 1 + u32::from(next() % 4),
                        rows_per_token: 1,
                    },
                    rows * 4,
                    0,
                ),
                2 => (SegmentKind::Fetch, 0, usize::from(next() % 8)),
                _ => (
                    SegmentKind::Gather {
                        first: u32::from(next() % 64),
                    },
                    usize::from(next() % 16),
                    1,
                ),
            };
            let sparse_k = match kind {
                SegmentKind::Sparse { k, .. } => k as usize * rows,
                _ => idx,
            };
            let with_rows = matches!(kind, SegmentKind::Dense | SegmentKind::Sparse { .. });
            SegmentSpec {
                kind,
                chunk: u32::from(next() % 3),
                layer: u16::from(next() % 3),
                queries: QueryRows::Copied(if with_rows {
                    &queries[..rows * ROW]
                } else {
                    &[]
                }),
                indices: &indices[..sparse_k.min(indices.len())],
                pages: &pages[..pg],
                windows: if with_rows {
                    &[]
                } else {
                    let set = &windows[usize::from(next() % 2)];
                    &set[..usize::from(next() % 3)]
                },
            }
        })
        .collect();
    let mut request = Vec::new();
    wire::encode_request(&mut request, 1, 2, 0, 0.1, &segments);
    let rest: Vec<u8> = bytes.collect();
    for patch in rest.chunks_exact(3) {
        if request.is_empty() {
            break;
        }
        let at = usize::from(u16::from_le_bytes([patch[0], patch[1]])) % request.len();
        request[at] = patch[2];
    }
    parse_all(&request);
});
