//! The wire format's unit and property tests.

use super::*;
use kvroute_kvstore::PAGE_BYTES;
use proptest::prelude::*;

fn sample() -> Vec<u8> {
    let q = vec![0x3f80u16; 3 * D_QK];
    let idx = vec![0i32, 5, -1, 2, 2, 9];
    let pages = vec![4u32, 5, 6];
    let gathered = [3i32, 0, 3];
    let desc = |addr: u64, len: u64, keys: &[u64]| kvroute_transport::MrDesc {
        addr,
        len,
        rkeys: keys
            .iter()
            .map(|&rkey| kvroute_transport::RemoteKey {
                nic: kvroute_transport::DomainAddr {
                    provider: "mem".into(),
                    bytes: vec![1],
                },
                rkey,
            })
            .collect(),
    };
    let (d1, d2) = (
        desc(0x7000_0000, 3 * PAGE_BYTES as u64, &[11, 12]),
        desc(0x9000, 64, &[13, 14]),
    );
    let windows = [
        PoolWindow {
            offset: 4 * PAGE_BYTES as u64,
            desc: &d1,
        },
        PoolWindow {
            offset: 1 << 40,
            desc: &d2,
        },
    ];
    let segs = [
        SegmentSpec {
            kind: SegmentKind::Dense,
            chunk: 7,
            layer: 3,
            queries: QueryRows::Copied(&q[..D_QK]),
            indices: &[],
            pages: &[],
            windows: &[],
        },
        SegmentSpec {
            kind: SegmentKind::Sparse {
                k: 3,
                rows_per_token: 1,
            },
            chunk: 8,
            layer: 0,
            queries: QueryRows::Copied(&q[..2 * D_QK]),
            indices: &idx,
            pages: &[],
            windows: &[],
        },
        SegmentSpec {
            kind: SegmentKind::Fetch,
            chunk: 9,
            layer: 0,
            queries: QueryRows::Copied(&[]),
            indices: &[],
            pages: &pages,
            windows: &windows,
        },
        // Rows 62, 63 of page 4 and row 0 of page 5.
        SegmentSpec {
            kind: SegmentKind::Gather { first: 62 },
            chunk: 9,
            layer: 2,
            queries: QueryRows::Copied(&[]),
            indices: &gathered,
            pages: &pages[..2],
            windows: &[],
        },
    ];
    let mut out = Vec::new();
    encode_request(&mut out, 42, 0x5eed_f00d_cafe_beef, 4096, 0.1147, &segs);
    assert_eq!(out.len(), request_len(&segs));
    assert_eq!(reply_rows(&segs), 3);
    out
}

#[test]
fn request_round_trips() {
    let bytes = sample();
    let r = Request::parse(&bytes)
        .map_err(|e| e.0)
        .unwrap_or_else(|s| panic!("{s}"));
    assert_eq!((r.seq, r.reply_offset, r.scale), (42, 4096, 0.1147));
    assert_eq!(r.token, 0x5eed_f00d_cafe_beef);
    assert_eq!(r.reply_rows(), 3);
    let segs: Vec<_> = r
        .segments
        .into_iter()
        .map(|s| s.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    assert_eq!(
        (segs[0].kind, segs[0].chunk, segs[0].layer, segs[0].rows),
        (SegmentKind::Dense, 7, 3, 1)
    );
    assert_eq!(segs[0].queries(), vec![0x3f80u16; D_QK]);
    assert_eq!(segs[1].indices(), [0, 5, -1, 2, 2, 9]);
    assert_eq!(segs[1].queries().len(), 2 * D_QK);
    assert_eq!(segs[2].pages(), [4, 5, 6]);
    let got: Vec<(u64, u64, u64, Vec<u64>)> = segs[2]
        .windows()
        .map(|w| (w.offset, w.len, w.addr, w.keys().collect()))
        .collect();
    assert_eq!(
        got,
        [
            (
                4 * PAGE_BYTES as u64,
                3 * PAGE_BYTES as u64,
                0x7000_0000,
                vec![11, 12]
            ),
            (1 << 40, 64, 0x9000, vec![13, 14]),
        ]
    );
    let w = segs[2]
        .windows()
        .next()
        .unwrap_or_else(|| panic!("a window"));
    assert!(w.covers(4 * PAGE_BYTES as u64, 3 * PAGE_BYTES as u64));
    assert!(!w.covers(4 * PAGE_BYTES as u64 + 1, 3 * PAGE_BYTES as u64));
    assert!(!w.covers(u64::MAX, 2));
    assert_eq!(segs[3].windows().count(), 0);
    assert_eq!(segs[0].windows().count(), 0);
    assert_eq!(
        (
            segs[3].kind,
            segs[3].layer,
            segs[3].rows,
            segs[3].reply_rows()
        ),
        (SegmentKind::Gather { first: 62 }, 2, 3, 0)
    );
    assert_eq!(
        (segs[3].indices(), segs[3].pages()),
        (vec![3, 0, 3], vec![4, 5])
    );
    assert!(segs[3].queries().is_empty() && segs[3].query_words().is_none());
}

#[test]
fn fetch_runs_cover_every_page_once_in_consecutive_runs() {
    let runs = |pages: &[u32]| fetch_runs(pages).collect::<Vec<_>>();
    assert_eq!(runs(&[]), vec![]);
    assert_eq!(runs(&[7]), vec![(0, 1)]);
    assert_eq!(
        runs(&[3, 4, 5, 9, 10, 2, 1]),
        vec![(0, 3), (3, 2), (5, 1), (6, 1)]
    );
    // A run never wraps past u32::MAX, and never exceeds FETCH_RUN_PAGES.
    assert_eq!(runs(&[u32::MAX, 0]), vec![(0, 1), (1, 1)]);
    let long: Vec<u32> = (100..100 + 2 * FETCH_RUN_PAGES as u32 + 5).collect();
    assert_eq!(
        runs(&long),
        vec![
            (0, FETCH_RUN_PAGES),
            (FETCH_RUN_PAGES, FETCH_RUN_PAGES),
            (2 * FETCH_RUN_PAGES, 5)
        ]
    );
}

#[test]
fn fetch_pieces_cut_at_both_block_and_page_ends() {
    let layout = BlockLayout::new(2, 150).unwrap_or_else(|e| panic!("{e}"));
    let cuts = |b: u32| {
        fetch_pieces(layout, b)
            .filter(|p| p.layer == 1)
            .map(|p| (p.token, p.rows, p.page, p.row))
            .collect::<Vec<_>>()
    };
    // 16-token blocks: four writes per 64-token page, the last one short (150 = 9 x 16 + 6).
    assert_eq!(cuts(16).len(), 10);
    assert_eq!(cuts(16)[4], (64, 16, 4, 0));
    assert_eq!(cuts(16)[9], (144, 6, 5, 16));
    // 100-token blocks: cut at 64, 100, 128.
    assert_eq!(
        cuts(100),
        vec![
            (0, 64, 3, 0),
            (64, 36, 4, 0),
            (100, 28, 4, 36),
            (128, 22, 5, 0)
        ]
    );
    // 256-token blocks: one write per page.
    assert_eq!(
        cuts(256),
        vec![(0, 64, 3, 0), (64, 64, 4, 0), (128, 22, 5, 0)]
    );
}

proptest! {
    /// Any layout and block size: the pieces tile every layer's tokens in order, each within
    /// one holder block and one pool page.
    #[test]
    fn fetch_pieces_tile_every_layer(layers in 1u32..4, tokens in 1u32..700, block in 1u32..300) {
        let layout = BlockLayout::new(layers, tokens).unwrap_or_else(|e| panic!("{e}"));
        let mut next = (0u32, 0u32);
        for p in fetch_pieces(layout, block) {
            if p.token == 0 && next.1 == tokens {
                next = (next.0 + 1, 0);
            }
            prop_assert_eq!((p.layer, p.token), next);
            prop_assert!(p.rows >= 1);
            let last = p.token + p.rows - 1;
            prop_assert_eq!(p.token / block, last / block);
            prop_assert_eq!(p.token / 64, last / 64);
            prop_assert_eq!(p.page, (p.layer as usize) * layout.pages_per_layer() + p.token as usize / 64);
            prop_assert_eq!(p.row, p.token as usize % 64);
            next = (p.layer, p.token + p.rows);
        }
        prop_assert_eq!(next, (layers - 1, tokens));
    }

    /// Any page list: the runs tile it in order, each run's pages are consecutive, and
    /// two neighbouring runs could not have been one (unless the first is full).
    #[test]
    fn fetch_runs_tile_any_page_list(pages in proptest::collection::vec(0u32..40, 0..200)) {
        let mut next = 0;
        let mut last: Option<(usize, usize)> = None;
        for (first, count) in fetch_runs(&pages) {
            prop_assert_eq!(first, next);
            prop_assert!((1..=FETCH_RUN_PAGES).contains(&count));
            for i in 1..count {
                prop_assert_eq!(pages[first + i], pages[first] + i as u32);
            }
            if let Some((f, c)) = last {
                prop_assert!(
                    c == FETCH_RUN_PAGES || pages[f + c - 1].checked_add(1) != Some(pages[first])
                );
            }
            last = Some((first, count));
            next = first + count;
        }
        prop_assert_eq!(next, pages.len());
    }
}

#[test]
fn gather_writes_cover_every_row_once_one_write_per_page() {
    for (first, rows) in [
        (0, 1),
        (0, 64),
        (0, 65),
        (63, 1),
        (63, 2),
        (10, 200),
        (5, 1536),
    ] {
        let writes: Vec<_> = gather_writes(first, rows).collect();
        assert_eq!(writes.len(), gather_pages(first, rows), "{first} {rows}");
        let mut next = 0;
        for (i, w) in writes.iter().enumerate() {
            assert_eq!((w.page, w.from), (i, next), "{first} {rows}: {w:?}");
            assert!(w.rows > 0 && w.row + w.rows <= PAGE_TOKENS, "{w:?}");
            // Row `from` of the gather lands at row `first + from` of the page list.
            assert_eq!(w.page * PAGE_TOKENS + w.row, first as usize + w.from);
            next += w.rows;
        }
        assert_eq!(next, rows);
    }
}

/// A gather whose first row is past a page, or whose page list is not the span its rows
/// need, is a bad segment (its neighbours still parse).
#[test]
fn forged_gathers_are_bad_segments() {
    let tokens = [1i32, 2, 3];
    let pages = [7u32, 8, 9];
    for (first, n_pages) in [(64u32, 1usize), (62, 1), (0, 2), (63, 3)] {
        let segs = [
            SegmentSpec {
                kind: SegmentKind::Gather { first },
                chunk: 0,
                layer: 0,
                queries: QueryRows::Copied(&[]),
                indices: &tokens,
                pages: &pages[..n_pages],
                windows: &[],
            },
            SegmentSpec {
                kind: SegmentKind::Gather { first: 0 },
                chunk: 0,
                layer: 0,
                queries: QueryRows::Copied(&[]),
                indices: &tokens,
                pages: &pages[..1],
                windows: &[],
            },
        ];
        let mut out = Vec::new();
        encode_request(&mut out, 1, 7, 0, 0.1, &segs);
        let r = Request::parse(&out)
            .map_err(|e| e.0)
            .unwrap_or_else(|s| panic!("{s}"));
        assert!(
            matches!(r.segments[0], Err(Status::BadSegment)),
            "first {first}, {n_pages} pages: {:?}",
            r.segments[0]
        );
        assert!(r.segments[1].is_ok());
    }
    assert_eq!(
        (
            gather_pages(0, 64),
            gather_pages(1, 64),
            gather_pages(63, 1)
        ),
        (1, 2, 1)
    );
}

/// Each of the 11 statuses survives its word (0 to 10, none skipped); every other word is
/// `Unknown`.
#[test]
fn status_words_round_trip() {
    let mut known = 0;
    for v in 0..64u32 {
        let s = Status::from_u32(v);
        if s == Status::Unknown {
            continue;
        }
        assert_eq!(s as u32, v);
        known += 1;
    }
    assert_eq!(known, 11, "statuses 0..=10 (TransferFailed is the last)");
    assert_eq!(
        Status::from_u32(Status::TransferFailed as u32),
        Status::TransferFailed
    );
    assert_eq!(Status::from_u32(u32::MAX), Status::Unknown);
}

/// The arrivals a requester waits for are exactly the served segments' own, whatever
/// the mix of statuses; a count it cannot know is an error, never a guess.
#[test]
fn served_arrivals_count_only_served_segments() {
    let header = |status, statuses: Vec<Status>| ReplyHeader {
        status,
        seq: 1,
        statuses,
        rows: 0,
        kernel_us: 0.0,
    };
    let per = [5u64, 0, 7, 3];
    let all_ok = header(Status::Ok, vec![Status::Ok; 4]);
    assert_eq!(served_arrivals(Some(&all_ok), &per), Ok(15));
    let mixed = header(
        Status::Ok,
        vec![Status::Ok, Status::Kernel, Status::BadIndex, Status::Ok],
    );
    assert_eq!(served_arrivals(Some(&mixed), &per), Ok(8));
    let refused = header(Status::ReplyTooLarge, vec![]);
    assert_eq!(served_arrivals(Some(&refused), &per), Ok(0));
    assert!(served_arrivals(None, &per).is_err());
    let short = header(Status::Ok, vec![Status::Ok; 3]);
    assert!(served_arrivals(Some(&short), &per).is_err());
    let partly = header(
        Status::Ok,
        vec![Status::Ok, Status::Ok, Status::TransferFailed, Status::Ok],
    );
    assert!(served_arrivals(Some(&partly), &per).is_err());
}

proptest! {
    /// Refusing one more segment lowers the count by exactly that segment's arrivals,
    /// whichever refusal it is; a partly sent segment anywhere makes it unknown.
    #[test]
    fn refusing_a_segment_removes_exactly_its_arrivals(
        words in proptest::collection::vec(0u32..10, 1..12),
        counts in proptest::collection::vec(0u64..1000, 12),
        pick in 0usize..12,
        refusal in 1u32..10,
    ) {
        let statuses: Vec<Status> = words.iter().map(|&w| Status::from_u32(w)).collect();
        let per = &counts[..statuses.len()];
        let at = pick % statuses.len();
        let reply = |statuses: Vec<Status>| ReplyHeader {
            status: Status::Ok,
            seq: 0,
            statuses,
            rows: 0,
            kernel_us: 0.0,
        };
        let mut served = statuses.clone();
        served[at] = Status::Ok;
        let mut refused = statuses;
        refused[at] = Status::from_u32(refusal);
        let before = served_arrivals(Some(&reply(served.clone())), per);
        let after = served_arrivals(Some(&reply(refused)), per);
        prop_assert_eq!(after.map(|n| n + per[at]), before);
        served[at] = Status::TransferFailed;
        prop_assert!(served_arrivals(Some(&reply(served)), per).is_err());
    }
}

#[test]
fn reply_header_round_trips() {
    let statuses = [Status::Ok, Status::UnknownChunk, Status::Ok];
    let mut out = vec![0xaa; reply_len(3, 2)];
    encode_reply_header(&mut out, (Status::Ok, 9), &statuses, 2, 812.5);
    let h = decode_reply_header(&out);
    assert_eq!(
        h,
        Some(ReplyHeader {
            status: Status::Ok,
            seq: 9,
            statuses: statuses.to_vec(),
            rows: 2,
            kernel_us: 812.5,
        })
    );
    assert_eq!(reply_rows_offset(3), 48);
    // The holder's claimed kernel time is bounded before use: never more than the round trip,
    // never negative or NaN.
    let claim = |kernel_us| ReplyHeader {
        kernel_us,
        ..h.clone().expect("decoded")
    };
    assert_eq!(claim(812.5).kernel_us_within(1000.0), 812.5);
    assert_eq!(claim(5e6).kernel_us_within(1000.0), 1000.0);
    for bad in [f32::NAN, -3.0, f32::INFINITY, f32::NEG_INFINITY] {
        assert_eq!(claim(bad).kernel_us_within(1000.0), 0.0, "{bad}");
    }
    assert!(decode_reply_header(&out[..10]).is_none());
}

#[test]
fn bad_headers_and_segments_are_refused() {
    let good = sample();
    let mut b = good.clone();
    b[0] ^= 1;
    assert_eq!(
        Request::parse(&b).err().map(|e| e.0),
        Some(Status::BadHeader)
    );
    let mut b = good.clone();
    b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Request::parse(&b).err().map(|e| e.0),
        Some(Status::BadLength)
    );
    let mut b = good.clone();
    b[6..8].copy_from_slice(&0u16.to_le_bytes());
    assert_eq!(
        Request::parse(&b).err().map(|e| e.0),
        Some(Status::BadSegment)
    );
    // Segment 1 claims more rows than its payload holds: that segment only is refused.
    let mut b = good.clone();
    let at = REQUEST_HEADER + SEGMENT_BYTES + 8;
    b[at..at + 4].copy_from_slice(&3u32.to_le_bytes());
    let r = Request::parse(&b).map_err(|e| e.0);
    let segs = r.map(|r| {
        r.segments
            .iter()
            .map(|s| s.as_ref().err().copied())
            .collect::<Vec<_>>()
    });
    assert_eq!(segs, Ok(vec![None, Some(Status::BadSegment), None, None]));
    // Payload offset pointing into the header.
    let mut b = good;
    let at = REQUEST_HEADER + 20;
    b[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
    let r = Request::parse(&b).map_err(|e| e.0);
    assert!(r.is_ok_and(|r| r.segments[0].as_ref().err() == Some(&Status::BadLength)));
}

#[test]
fn immediates_round_trip() {
    for (s, n) in [(0u16, 1u64), (7, 2), (65535, 4)] {
        assert_eq!(parse_request_imm(request_imm(s, n)), Some((s, n)));
    }
    assert_eq!(parse_request_imm(0x1234), None);
    for (s, n) in [(0u16, 1u64), (9, 3), (65535, 4)] {
        assert_eq!(parse_ping_imm(ping_imm(s, n)), Some((s, n)));
        // A ping is never taken for a request, nor the other way round.
        assert_eq!(parse_request_imm(ping_imm(s, n)), None);
        assert_eq!(parse_ping_imm(request_imm(s, n)), None);
    }
}

#[test]
fn pings_round_trip_and_other_bytes_are_not_pings() {
    let mut b = [0u8; PING_HEADER];
    for pong in [Pong::Staged, Pong::Written] {
        let ping = Ping {
            reply_len: 123_456,
            reply_offset: 1 << 40,
            pong,
            token: u64::MAX - 3,
            seq: 99,
        };
        encode_ping(&mut b, &ping);
        assert_eq!(parse_ping(&b), Some(ping));
    }
    assert_eq!(request_credentials(&b), None, "a ping is not a request");
    assert_eq!(parse_ping(&b[..PING_HEADER - 1]), None);
    assert_eq!(parse_ping(&sample()), None, "a request is not a ping");
    assert_eq!(
        request_credentials(&sample()[..REQUEST_HEADER]),
        Some((0x5eed_f00d_cafe_beef, 42))
    );
    assert_eq!(request_credentials(&sample()[..REQUEST_HEADER - 1]), None);
}

#[test]
fn query_words_borrow_what_queries_copy() {
    // The payload of the sample's first segment starts at an even offset of an aligned
    // buffer (u64 storage), as in an inbox slot.
    let bytes = sample();
    let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
    let view = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..bytes.len()];
    view.copy_from_slice(&bytes);
    let req = Request::parse(view).unwrap();
    for seg in req.segments.iter().flatten() {
        match seg.kind {
            SegmentKind::Fetch | SegmentKind::Gather { .. } => {
                assert_eq!(seg.query_words(), None);
            }
            _ => assert_eq!(seg.query_words().map(<[u16]>::to_vec), Some(seg.queries())),
        }
    }
    // Shifted by one byte the payloads are misaligned: no view, `queries` still works.
    let mut odd = vec![0u8; bytes.len() + 1];
    odd[1..].copy_from_slice(&bytes);
    let req = Request::parse(&odd[1..]).unwrap();
    let seg = req.segments[0].as_ref().unwrap();
    if (seg.payload.as_ptr() as usize) % 2 == 1 {
        assert_eq!(seg.query_words(), None);
    }
    assert_eq!(seg.queries().len(), D_QK);
}

proptest! {
    /// Any bytes: parsing never panics, and whatever parses has payloads inside the slot.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), seed in any::<u64>()) {
        let mut b = sample();
        // Mutate a prefix of a valid request so parsing gets past the magic sometimes.
        for (i, x) in bytes.iter().enumerate() {
            if (seed >> (i % 64)) & 1 == 1 && i < b.len() { b[i] = *x; }
        }
        if let Ok(r) = Request::parse(&b) {
            for s in r.segments.into_iter().flatten() {
                let _ = (s.queries(), s.indices(), s.pages());
            }
        }
        let _ = Request::parse(&bytes);
        let _ = decode_reply_header(&bytes);
    }
}

#[test]
fn a_proof_message_round_trips_and_nothing_else_parses_as_one() {
    let proof = encode_proof(7, 0xdead_beef_0123_4567);
    assert_eq!(parse_proof(&proof), Some((7, 0xdead_beef_0123_4567)));
    assert_eq!(parse_proof(&proof[..15]), None, "short");
    let mut long = proof.to_vec();
    long.push(0);
    assert_eq!(parse_proof(&long), None, "long");
    for at in [0, 4] {
        let mut bad = proof;
        bad[at] ^= 1;
        assert_eq!(
            parse_proof(&bad),
            None,
            "magic or version changed at byte {at}"
        );
    }
}
