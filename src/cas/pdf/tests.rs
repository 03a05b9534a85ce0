//! Tests of the scanner and the chunker on synthetic PDFs built here (the real-tool
//! corpus is the benchmark's, `scripts/pdf-corpus.py`).

use proptest::prelude::*;

use super::chunk::{PdfChunker, PdfSizes, chunk_lengths};
use super::scan::{Event, Scanner, Unsupported, scan_all};
use crate::cas::chunker::{MAX_CHUNK, MIN_CHUNK};

/// Deterministic pseudo-random bytes (xorshift64*).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// How an object's stream declares its length.
#[derive(Clone, Copy, Debug)]
enum Len {
    Direct,
    Indirect,
    Wrong(i64),
}

/// A PDF of objects numbered from `first`, each with a dictionary (with tricky strings)
/// and, for each entry of `streams`, a stream of that data; then an xref table, trailer,
/// startxref and %%EOF. Returns the file and the (start, end) of every stream's data.
fn pdf(first: u64, streams: &[(Vec<u8>, Len)]) -> (Vec<u8>, Vec<(usize, usize)>) {
    let mut out = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n".to_vec();
    let mut spans = Vec::new();
    let mut n = first;
    for (data, len) in streams {
        out.extend_from_slice(
            format!(
                "{n} 0 obj\n<< /Type /Page /T (a (nested) \\) endobj stream) /H <656e646f626a> % endobj\n /Kids [1 0 R] >>\nendobj\n"
            )
            .as_bytes(),
        );
        n += 1;
        let length = match len {
            Len::Direct => format!("{}", data.len()),
            Len::Indirect => format!("{} 0 R", n + 1000),
            Len::Wrong(d) => format!("{}", (data.len() as i64 + d).max(0)),
        };
        out.extend_from_slice(
            format!("{n} 0 obj\n<< /Filter /FlateDecode /Length {length} >>\nstream\r\n")
                .as_bytes(),
        );
        let start = out.len();
        out.extend_from_slice(data);
        spans.push((start, out.len()));
        out.extend_from_slice(b"\r\nendstream\nendobj\n");
        n += 1;
    }
    out.extend_from_slice(b"xref\n0 1\n0000000000 65535 f \ntrailer\n<< /Size 9 /Root 1 0 R >>\nstartxref\n123\n%%EOF\n");
    (out, spans)
}

fn events_in_pieces(data: &[u8], pieces: &[usize]) -> Vec<Event> {
    let mut scanner = Scanner::new();
    let mut events = Vec::new();
    let mut offset = 0;
    let mut sizes = pieces.iter().cycle();
    while offset < data.len() {
        let take = (*sizes.next().unwrap()).max(1).min(data.len() - offset);
        scanner.feed(&data[offset..offset + take], &mut |e| events.push(e));
        offset += take;
    }
    events
}

#[test]
fn the_scanner_finds_objects_streams_xref_and_eof() {
    // Checks CAS-10.
    let (file, spans) = pdf(
        1,
        &[
            (noise(300, 1), Len::Direct),
            (b"q endobj Q".to_vec(), Len::Indirect),
        ],
    );
    let (events, unsupported) = scan_all(&file);
    assert_eq!(unsupported, None);
    let starts: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::StreamStart(p) => Some(*p as usize),
            _ => None,
        })
        .collect();
    let ends: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::StreamEnd(p) => Some(*p as usize),
            _ => None,
        })
        .collect();
    assert_eq!(starts, spans.iter().map(|s| s.0).collect::<Vec<_>>());
    assert_eq!(ends, spans.iter().map(|s| s.1).collect::<Vec<_>>());
    let boundaries: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Boundary(p) => Some(*p as usize),
            _ => None,
        })
        .collect();
    // Four object headers and the xref table; nothing inside strings or comments.
    assert_eq!(boundaries.len(), 5, "{boundaries:?}");
    for b in &boundaries[..4] {
        assert!(file[*b..].starts_with(b"1 0 obj") || file[*b].is_ascii_digit());
    }
    assert!(file[boundaries[4]..].starts_with(b"xref"));
    assert_eq!(events.last(), Some(&Event::Revision(file.len() as u64)));
}

#[test]
fn a_wrong_length_falls_back_to_searching_endstream() {
    // Checks CAS-10: `/Length` too short, too long, indirect.
    for len in [
        Len::Wrong(-7),
        Len::Wrong(5),
        Len::Indirect,
        Len::Wrong(-300),
    ] {
        let (file, spans) = pdf(3, &[(noise(300, 2), len)]);
        let (events, unsupported) = scan_all(&file);
        let end = events.iter().find_map(|e| match e {
            Event::StreamEnd(q) => Some(*q as usize),
            _ => None,
        });
        match len {
            Len::Wrong(d) if d > 0 => {
                // Too long: the data overran its real end (noted, never a panic).
                assert_eq!(unsupported, Some(Unsupported::LengthMismatch), "{len:?}");
            }
            Len::Indirect => {
                assert_eq!(end, Some(spans[0].1), "{len:?}");
                assert_eq!(unsupported, None);
            }
            _ => {
                assert_eq!(end, Some(spans[0].1), "{len:?}");
                assert_eq!(unsupported, Some(Unsupported::LengthMismatch));
            }
        }
    }
}

#[test]
fn incremental_updates_and_truncation_are_reported() {
    let (mut file, _) = pdf(1, &[(noise(100, 3), Len::Direct)]);
    let first_eof = file.len();
    file.extend_from_slice(b"9 0 obj\n<< /Producer (x) >>\nendobj\nxref\n9 1\n0000000000 00000 n \ntrailer\n<< /Prev 1 >>\nstartxref\n9\n%%EOF\r\n");
    let (events, unsupported) = scan_all(&file);
    assert_eq!(unsupported, None);
    assert!(events.contains(&Event::Revision(first_eof as u64)));
    assert!(events.contains(&Event::Revision(file.len() as u64)));
    let (events, unsupported) = scan_all(&file[..first_eof - 200]);
    assert_eq!(unsupported, Some(Unsupported::Unterminated));
    assert!(!events.is_empty());
    assert_eq!(scan_all(b"%PDF-1.4\nhello").1, Some(Unsupported::NoObjects));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    // Checks CAS-10: any split gives the same events; arbitrary bytes never panic.
    fn any_split_gives_the_same_events_and_arbitrary_bytes_never_panic(
        junk in proptest::collection::vec(any::<u8>(), 0..4096),
        seed in any::<u64>(),
        mutations in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..16),
        pieces in proptest::collection::vec(1usize..400, 1..16),
    ) {
        // Arbitrary bytes.
        let whole = scan_all(&junk).0;
        prop_assert_eq!(events_in_pieces(&junk, &pieces), whole);
        // A mutated synthetic PDF: bytes replaced at random places.
        let (mut file, _) = pdf(seed % 50, &[
            (noise(2000 + (seed % 3000) as usize, seed), Len::Direct),
            (noise(500, seed ^ 1), Len::Indirect),
        ]);
        for (at, byte) in &mutations {
            let i = at % file.len();
            file[i] = *byte;
        }
        let whole = scan_all(&file).0;
        let mut last = 0;
        for e in &whole {
            let at = match e { Event::Boundary(a) | Event::Revision(a) | Event::StreamStart(a) | Event::StreamEnd(a) => *a };
            prop_assert!(at >= last && at <= file.len() as u64);
            last = at;
        }
        prop_assert_eq!(events_in_pieces(&file, &pieces), whole);
    }
}

/// Blocks of `data` pushed in `pieces` (cycled), as the ingest's chunk thread does.
fn blocks_in_pieces(data: &[u8], sizes: PdfSizes, pieces: &[usize]) -> Vec<usize> {
    let mut chunker = PdfChunker::new(sizes);
    let mut out = Vec::new();
    let mut offset = 0;
    let mut step = pieces.iter().cycle();
    while offset < data.len() {
        let take = (*step.next().unwrap()).max(1).min(data.len() - offset);
        chunker.push(&data[offset..offset + take]);
        offset += take;
        while let Some(block) = chunker.next_chunk(false) {
            out.push(block.len());
        }
        assert!(chunker.buffered() < sizes.max + super::chunk::LOOKAHEAD);
    }
    while let Some(block) = chunker.next_chunk(true) {
        out.push(block.len());
    }
    out
}

fn cuts(lengths: &[usize]) -> Vec<usize> {
    lengths
        .iter()
        .scan(0, |at, len| {
            *at += len;
            Some(*at)
        })
        .collect()
}

#[test]
fn large_stream_data_starts_and_ends_its_own_blocks() {
    // Checks CAS-11.
    let streams = vec![
        (noise(100_000, 1), Len::Direct),
        (noise(700, 2), Len::Direct),
        (noise(600_000, 3), Len::Indirect),
        (noise(40_000, 4), Len::Direct),
    ];
    let (file, spans) = pdf(1, &streams);
    let (lengths, counts) = chunk_lengths(&file, PdfSizes::default());
    assert_eq!(lengths.iter().sum::<usize>(), file.len());
    assert!(lengths.iter().all(|&l| l <= MAX_CHUNK && l > 0));
    let at = cuts(&lengths);
    for (i, (start, end)) in spans.iter().enumerate() {
        if end - start >= MIN_CHUNK {
            assert!(
                at.contains(start),
                "stream {i} start {start} not a cut: {at:?}"
            );
            assert!(at.contains(end), "stream {i} end {end} not a cut: {at:?}");
        }
    }
    assert!(counts.stream >= 6, "{counts:?}");
}

#[test]
fn stream_blocks_survive_renumbering_and_an_inserted_object() {
    // Checks CAS-11: the point of the chunker. Renumbered objects and a new object in
    // the middle change headers only; the stream data's blocks stay the same.
    let streams: Vec<_> = (0..6)
        .map(|i| (noise(30_000 + 20_000 * i, i as u64 + 10), Len::Direct))
        .collect();
    let (a, _) = pdf(1, &streams);
    let mut inserted = streams.clone();
    inserted.insert(3, (noise(5_000, 99), Len::Direct));
    let (b, _) = pdf(40, &inserted);
    let keys = |data: &[u8], lengths: Vec<usize>| -> Vec<blake3::Hash> {
        let mut at = 0;
        lengths
            .into_iter()
            .map(|l| {
                at += l;
                blake3::hash(&data[at - l..at])
            })
            .collect()
    };
    let ka = keys(&a, chunk_lengths(&a, PdfSizes::default()).0);
    let kb = keys(&b, chunk_lengths(&b, PdfSizes::default()).0);
    let fresh: usize = {
        let (lb, _) = chunk_lengths(&b, PdfSizes::default());
        lb.iter()
            .zip(&kb)
            .filter(|(_, k)| !ka.contains(k))
            .map(|(l, _)| *l)
            .sum()
    };
    assert!(
        fresh * 10 < b.len(),
        "{fresh} fresh bytes of {} after a renumbering rewrite",
        b.len()
    );
    let generic = |d: &[u8]| keys(d, crate::cas::chunker::chunk_lengths(d));
    let (ga, gb) = (generic(&a), generic(&b));
    let generic_fresh = gb.iter().filter(|k| !ga.contains(k)).count();
    assert!(
        generic_fresh * 2 > gb.len(),
        "FastCDC kept {generic_fresh}/{}",
        gb.len()
    );
}

#[test]
fn an_incremental_update_leaves_every_block_of_the_previous_revision() {
    // Checks CAS-11: the end of a revision is a cut.
    let streams: Vec<_> = (0..5)
        .map(|i| (noise(9_000 + 7_000 * i, i as u64), Len::Direct))
        .collect();
    let (old, _) = pdf(1, &streams);
    let mut new = old.clone();
    new.extend_from_slice(b"12 0 obj\n<< /Title (v2) >>\nendobj\nxref\n12 1\n0000000000 00000 n \ntrailer\n<< /Prev 9 >>\nstartxref\n99\n%%EOF\n");
    let (a, _) = chunk_lengths(&old, PdfSizes::default());
    let (b, _) = chunk_lengths(&new, PdfSizes::default());
    assert_eq!(b[..a.len()], a[..]);
    assert_eq!(b[a.len()..].iter().sum::<usize>(), new.len() - old.len());
}

#[test]
fn object_boundaries_are_cut_at_or_after_the_target_never_below_the_minimum() {
    // Checks CAS-11: many small objects (no large streams).
    let streams: Vec<_> = (0..400).map(|i| (noise(900, i), Len::Direct)).collect();
    let (file, _) = pdf(1, &streams);
    let sizes = PdfSizes::new(32 * 1024, 128 * 1024).unwrap();
    let (lengths, counts) = chunk_lengths(&file, sizes);
    let (events, _) = scan_all(&file);
    let boundaries: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Boundary(b) => Some(*b),
            _ => None,
        })
        .collect();
    let at = cuts(&lengths);
    for (i, len) in lengths[..lengths.len() - 1].iter().enumerate() {
        assert!(*len >= sizes.target, "block {i} of {len}");
        assert!(boundaries.contains(&(at[i] as u64)));
    }
    assert_eq!(counts.fallback, 0);
    assert!(counts.boundary as usize >= lengths.len() - 1);
}

#[test]
fn sizes_are_validated() {
    assert!(PdfSizes::new(64 * 1024, 256 * 1024).is_ok());
    assert!(PdfSizes::new(8 * 1024, 256 * 1024).is_err());
    assert!(PdfSizes::new(64 * 1024, 512 * 1024).is_err());
    assert!(PdfSizes::new(200 * 1024, 100 * 1024).is_err());
}

#[test]
fn a_body_that_is_not_pdf_falls_back_to_fastcdc_cut_points() {
    // Checks CAS-11: no boundary at all: FastCDC's cuts.
    let data = noise(3 << 20, 5);
    let (lengths, counts) = chunk_lengths(&data, PdfSizes::default());
    assert_eq!(lengths.iter().sum::<usize>(), data.len());
    let generic = crate::cas::chunker::chunk_lengths(&data);
    assert_eq!(lengths[..lengths.len() - 1], generic[..lengths.len() - 1]);
    assert!(counts.fallback > 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    // Checks CAS-10: any split of the body gives the same blocks; every block fits.
    fn any_split_gives_the_same_blocks(
        seed in any::<u64>(),
        sizes in proptest::collection::vec(0usize..300_000, 1..8),
        mutations in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        pieces in proptest::collection::vec(1usize..200_000, 1..12),
        target in (MIN_CHUNK..=MAX_CHUNK),
    ) {
        let streams: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (noise(n, seed ^ i as u64), [Len::Direct, Len::Indirect, Len::Wrong(-3)][i % 3]))
            .collect();
        let (mut file, _) = pdf(seed % 7, &streams);
        for (at, byte) in &mutations {
            let i = at % file.len();
            file[i] = *byte;
        }
        let sizes = PdfSizes::new(target.min(MAX_CHUNK), MAX_CHUNK).unwrap();
        let (whole, _) = chunk_lengths(&file, sizes);
        prop_assert_eq!(whole.iter().sum::<usize>(), file.len());
        prop_assert!(whole.iter().all(|&l| l > 0 && l <= MAX_CHUNK));
        prop_assert_eq!(blocks_in_pieces(&file, sizes, &pieces), whole);
    }
}

/// The real PDFs of `tests/fixtures/pdf` (made by `scripts/pdf-fixtures.py` with
/// reportlab and pikepdf/qpdf).
fn fixtures() -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pdf");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pdf"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn real_pdfs_scan_cleanly_linearized_encrypted_object_streams_and_pdf_2() {
    // Checks CAS-10 on files written by real tools.
    let files = fixtures();
    let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
    for name in ["encrypted.pdf", "linearized.pdf", "objstm.pdf", "pdf20.pdf"] {
        assert!(names.contains(&name), "{names:?}");
    }
    for (name, file) in &files {
        let (events, unsupported) = scan_all(file);
        assert_eq!(unsupported, None, "{name}");
        let starts = events
            .iter()
            .filter(|e| matches!(e, Event::StreamStart(_)))
            .count();
        let ends: Vec<usize> = events
            .iter()
            .filter_map(|e| match e {
                Event::StreamEnd(q) => Some(*q as usize),
                _ => None,
            })
            .collect();
        assert!(
            starts > 0 && starts == ends.len(),
            "{name}: {starts} {ends:?}"
        );
        for q in ends {
            let after = &file[q..];
            let after = after
                .strip_prefix(b"\r\n")
                .or_else(|| after.strip_prefix(b"\n"))
                .or_else(|| after.strip_prefix(b"\r"))
                .unwrap_or(after);
            assert!(after.starts_with(b"endstream"), "{name} at {q}");
        }
        assert!(
            events.iter().any(|e| matches!(e, Event::Revision(_))),
            "{name}"
        );
        assert_eq!(events_in_pieces(file, &[1, 7, 300]), events, "{name}");
    }
}

#[test]
fn truncated_and_corrupted_real_pdfs_are_cut_whole_and_never_panic() {
    // Checks CAS-10 and CAS-13: every prefix and many corruptions of each real file are
    // cut into blocks that add up to the input exactly, and the scanner notes a
    // truncation inside an object or stream.
    let sizes = PdfSizes::default();
    for (name, file) in fixtures() {
        // Every 37th prefix of the small files, about 200 of the larger one.
        for cut in (0..file.len()).step_by((file.len() / 200).max(37)) {
            let prefix = &file[..cut];
            let (lengths, _) = chunk_lengths(prefix, sizes);
            assert_eq!(lengths.iter().sum::<usize>(), cut, "{name} at {cut}");
            scan_all(prefix);
        }
        let mut corrupt = file.clone();
        for i in (5..corrupt.len()).step_by(11) {
            corrupt[i] = corrupt[i].wrapping_mul(31).wrapping_add(7);
        }
        let (lengths, _) = chunk_lengths(&corrupt, sizes);
        assert_eq!(lengths.iter().sum::<usize>(), corrupt.len(), "{name}");
    }
}

/// Blocks of `data` uploaded as resumable parts ending at `bounds` (increasing, inside
/// the body): each part starts from a chunker restored from the state the previous part
/// saved over its staged tail, as `pipeline::ingest::ingest_part` does; pieces inside a part
/// are `pieces` (cycled). Also checks the bounds on the saved state and tail.
fn blocks_in_parts(data: &[u8], sizes: PdfSizes, bounds: &[usize], pieces: &[usize]) -> Vec<usize> {
    use super::chunk::{LOOKAHEAD, MAX_STATE_LEN};
    let mut out = Vec::new();
    let mut saved: Option<(Vec<u8>, Vec<u8>)> = None;
    let mut from = 0;
    let mut step = pieces.iter().cycle();
    let ends = bounds.iter().copied().chain([data.len()]);
    for end in ends {
        let end = end.clamp(from, data.len());
        let mut chunker = match saved.take() {
            None => PdfChunker::new(sizes),
            Some((state, tail)) => PdfChunker::restore(&state, &tail, from as u64).unwrap(),
        };
        let mut offset = from;
        while offset < end {
            let take = (*step.next().unwrap()).max(1).min(end - offset);
            chunker.push(&data[offset..offset + take]);
            offset += take;
            while let Some(block) = chunker.next_chunk(false) {
                out.push(block.len());
            }
        }
        if end == data.len() {
            while let Some(block) = chunker.next_chunk(true) {
                out.push(block.len());
            }
            break;
        }
        let tail = chunker.take_rest().to_vec();
        let state = chunker.save();
        assert!(tail.len() < sizes.max + LOOKAHEAD, "tail {}", tail.len());
        assert!(state.len() <= MAX_STATE_LEN, "state {}", state.len());
        saved = Some((state, tail));
        from = end;
    }
    out
}

#[test]
fn a_saved_state_that_does_not_fit_is_refused_not_trusted() {
    // Checks CAS-14: a damaged or mismatched saved state is an error, never a panic or
    // a chunker over the wrong bytes.
    let (file, _) = pdf(1, &[(noise(300_000, 3), Len::Direct)]);
    let sizes = PdfSizes::default();
    let mut chunker = PdfChunker::new(sizes);
    chunker.push(&file[..290_000]);
    while chunker.next_chunk(false).is_some() {}
    let tail = chunker.take_rest().to_vec();
    let state = chunker.save();
    assert!(PdfChunker::restore(&state, &tail, 290_000).is_ok());
    // The tail must end at the offset the row records.
    assert!(PdfChunker::restore(&state, &tail, 290_001).is_err());
    assert!(PdfChunker::restore(&state, &tail[1..], 290_000).is_err());
    assert!(PdfChunker::restore(&[], &tail, 290_000).is_err());
    assert!(PdfChunker::restore(&state[..state.len() - 1], &tail, 290_000).is_err());
    let mut longer = state.clone();
    longer.push(0);
    assert!(PdfChunker::restore(&longer, &tail, 290_000).is_err());
    // Every single-byte change either restores (a value still in range) or is refused.
    for i in 0..state.len() {
        for byte in [0u8, 1, 9, 0xff] {
            let mut bad = state.clone();
            bad[i] = byte;
            let _ = PdfChunker::restore(&bad, &tail, 290_000);
        }
    }
}

#[test]
fn real_pdfs_uploaded_in_parts_give_the_one_shot_blocks() {
    // Checks CAS-14 on files written by real tools: every part boundary on a grid (so
    // parts end inside image streams, dictionaries, strings and between objects), with
    // the default sizes and with small sizes that make many cuts per file.
    let small = PdfSizes::new(MIN_CHUNK, 2 * MIN_CHUNK).unwrap();
    for (name, file) in fixtures() {
        for sizes in [PdfSizes::default(), small] {
            let (whole, _) = chunk_lengths(&file, sizes);
            let step = (file.len() / 97).max(1);
            for first in (1..file.len()).step_by(step) {
                let bounds = [first, first + 1, first + 40_000, first + 150_000];
                let got = blocks_in_parts(&file, sizes, &bounds, &[4096, 65_536]);
                assert_eq!(got, whole, "{name}, parts from {first}");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    // Checks CAS-14: a resumable upload split into parts anywhere (each part resuming
    // the chunker from its saved state and staged tail) gives the one-shot blocks: on
    // real PDFs (the fixtures, alone or one appended to another like an incremental
    // update) and on synthetic ones with large, indirect and wrong-length streams.
    fn any_split_into_parts_gives_the_one_shot_blocks(
        which in any::<usize>(),
        append in any::<usize>(),
        seed in any::<u64>(),
        streams in proptest::collection::vec(0usize..200_000, 0..4),
        mutations in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        bounds in proptest::collection::vec(any::<usize>(), 1..8),
        pieces in proptest::collection::vec(1usize..100_000, 1..6),
        small in any::<bool>(),
    ) {
        let files = fixtures();
        let mut file = files[which % files.len()].1.clone();
        if append % 3 == 0 {
            file.extend_from_slice(&files[append % files.len()].1);
        }
        if !streams.is_empty() {
            let streams: Vec<_> = streams
                .iter()
                .enumerate()
                .map(|(i, &n)| (noise(n, seed ^ i as u64), [Len::Direct, Len::Indirect, Len::Wrong(5)][i % 3]))
                .collect();
            file.extend_from_slice(&pdf(seed % 5, &streams).0);
        }
        for (at, byte) in &mutations {
            let i = at % file.len();
            file[i] = *byte;
        }
        let sizes = if small {
            PdfSizes::new(MIN_CHUNK, 2 * MIN_CHUNK).unwrap()
        } else {
            PdfSizes::default()
        };
        let mut bounds: Vec<usize> = bounds.iter().map(|b| b % (file.len() + 1)).collect();
        bounds.sort_unstable();
        let (whole, _) = chunk_lengths(&file, sizes);
        prop_assert_eq!(blocks_in_parts(&file, sizes, &bounds, &pieces), whole);
    }

    #[test]
    // Checks CAS-14 for the scanner alone: saved and restored between any two pieces, it
    // reports the events of one pass, on arbitrary and mutated bytes too.
    fn a_restored_scanner_reports_the_same_events(
        which in any::<usize>(),
        junk in proptest::collection::vec(any::<u8>(), 0..2048),
        pieces in proptest::collection::vec(1usize..3000, 1..12),
    ) {
        use super::scan::{StateReader, StateWriter};
        let files = fixtures();
        let mut file = files[which % files.len()].1.clone();
        file.truncate(200_000);
        file.extend_from_slice(&junk);
        let (whole, _) = scan_all(&file);
        let mut events = Vec::new();
        let mut scanner = Scanner::new();
        let mut offset = 0;
        for piece in pieces.iter().cycle() {
            if offset >= file.len() {
                break;
            }
            let take = (*piece).min(file.len() - offset);
            scanner.feed(&file[offset..offset + take], &mut |e| events.push(e));
            offset += take;
            let mut w = StateWriter::default();
            scanner.save(&mut w);
            let mut r = StateReader(&w.0);
            scanner = Scanner::restore(&mut r).unwrap();
            prop_assert!(r.end().is_ok());
        }
        prop_assert_eq!(events, whole);
    }
}
