//! Unit tests of `bench`.

use super::*;

#[test]
fn the_engine_is_scored_as_fabtests_scores_fi_pingpong() {
    // 1000 round trips of 64 KiB in 80 ms: 40 us per transfer, 1638.4 MB/s.
    let p = Pingpong::from_elapsed(65536, 1000, Duration::from_millis(80));
    assert!((p.usec_per_xfer - 40.0).abs() < 1e-9);
    assert!((p.mb_per_s - 1638.4).abs() < 1e-9);
}

#[test]
fn the_bare_stream_writes_each_page_to_its_own_offset() {
    let config = FabricConfig::provider(crate::ProviderChoice::Shm);
    let (page, pages) = (1024u64, 8u64);
    let len = (page * pages) as usize;
    let (to_parent, from_child) = std::sync::mpsc::channel();
    let (to_child, from_parent) = std::sync::mpsc::channel();
    let (settled, until_settled) = std::sync::mpsc::channel();
    let landed = std::thread::scope(|s| {
        let config = &config;
        let child = s.spawn(move || {
            let mut y = RawEndpoint::open(config, len).unwrap();
            to_parent.send(y.address()).unwrap();
            let parent: RawAddress = from_parent.recv().unwrap();
            y.connect(&parent).unwrap();
            // Twice round the buffer: the second pass lands on the first.
            y.absorb(2 * pages).unwrap();
            // Kept open until the sender's writes have completed: closed earlier, in one
            // process with other tests running, the sender's completion-queue read
            // crashed inside shm (about half the runs of the crate's tests).
            until_settled.recv().unwrap();
            y.buf.to_vec()
        });
        let mut x = RawEndpoint::open(config, len).unwrap();
        for (k, chunk) in x.buf.chunks_mut(page as usize).enumerate() {
            chunk.fill(k as u8 + 1);
        }
        x.connect(&from_child.recv().unwrap()).unwrap();
        to_child.send(x.address()).unwrap();
        let streamed = x.stream(page, 2 * pages, 4);
        settled.send(()).unwrap();
        assert_eq!(streamed.unwrap().count, 2 * pages);
        child.join().unwrap()
    });
    for (k, chunk) in landed.chunks(page as usize).enumerate() {
        assert!(chunk.iter().all(|&b| b == k as u8 + 1), "page {k}");
    }
    // A page the buffers cannot hold is refused, not written past their end.
    let mut x = RawEndpoint::open(&config, len).unwrap();
    let own = x.address();
    x.connect(&own).unwrap();
    assert!(matches!(
        x.stream(2 * len as u64, 1, 1),
        Err(TransportError::InvalidArgument(_))
    ));
}

#[test]
fn fi_pingpong_rows_parse_with_their_abbreviations() {
    let out = "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
               64k     10k     =10k     1.2g        0.78s   1677.63      39.06       0.03\n";
    let p = parse_fi_pingpong(out, 65536).unwrap();
    assert_eq!(p.iters, 10_000);
    assert!((p.mb_per_s - 1677.63).abs() < 1e-9);
    assert!((p.usec_per_xfer - 39.06).abs() < 1e-9);
    assert!(parse_fi_pingpong("bytes #sent\n", 1).is_err());
    assert!(parse_fi_pingpong("64k 10k =10k 1.2g 0.78s x 39.06 0.03", 1).is_err());
}
