//! The cut-point search of FastCDC 2020: where the first chunk of a buffer ends.
//!
//! The result is exactly that of `fastcdc::v2020` (`=5.0.0`, normalization level 1,
//! seed 0) for the sizes in [`super::chunker`]; the gear table and the two masks are taken
//! from that crate, so the storage format stays the crate's. Only the scan is done here,
//! because it is the one serial stage of an upload (`cas::ingest` runs it on its own
//! thread) and the crate's loop is bound by the latency of its hash chain: each byte's
//! hash needs the previous one.
//!
//! The gear hash at position `p` is `H(p) = Σ gear[data[j]] << (p − j)` over the bytes
//! `j ≤ p` since the scan began (at the minimum chunk size). A shift by 64 or more leaves
//! nothing, so for `p` at least 64 bytes past the scan's start `H(p)` depends only on the
//! 64 bytes ending at `p`, and can be computed from any point 64 bytes back. The search
//! below therefore scans [`LANES`] segments of [`SEGMENT`] bytes at once, each segment
//! after the first warmed up over the 64 bytes before it, so the four hash chains are
//! independent and the CPU runs them side by side. After each round of
//! `LANES × SEGMENT` bytes the earliest match, if any, is the cut; the first lane carries
//! its hash from round to round, so no byte is tested twice and the warm-up costs
//! 64 of every `SEGMENT` bytes. What is left at the end (less than a round) is scanned one
//! byte at a time. `tests` check the equality with the crate on random and degenerate
//! inputs of every length class; `cas::chunker`'s golden vectors pin the format.

use std::sync::LazyLock;

use fastcdc::v2020::{Normalization, get_gear_with_seed, select_masks};

use super::chunker::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};

/// Hash chains scanned side by side.
const LANES: usize = 4;
/// Bytes each chain scans per round. Larger segments waste less on warm-ups (64 bytes
/// each) and more past a cut (on average half a round is scanned after the cut's round
/// began); 2 KiB was fastest on the benchmark machine (docs/performance.md).
const SEGMENT: usize = 2048;
/// Bytes a hash depends on: `H(p)` has no contribution from bytes 64 or more back.
const WARM_UP: usize = 64;

/// The gear table and masks of FastCDC 2020 for the pinned sizes.
struct Gear {
    table: [u64; 256],
    /// Mask tested below the average chunk size (more one-bits: cuts are rarer).
    mask_small: u64,
    /// Mask tested from the average size on.
    mask_large: u64,
}

static GEAR: LazyLock<Gear> = LazyLock::new(|| {
    let (table, _) = get_gear_with_seed(0);
    let table: [u64; 256] = table[..]
        .try_into()
        .expect("FastCDC's gear table has 256 entries");
    let (mask_small, mask_large) = select_masks(AVG_CHUNK, Normalization::Level1);
    // The crate tests even positions with both the hash and the mask shifted left by one
    // (its two-bytes-per-step loop); that equals testing `hash & mask` as long as the
    // mask's top bit is clear, which holds for every mask it has.
    assert_eq!(
        (mask_small | mask_large) >> 63,
        0,
        "FastCDC mask with its top bit set"
    );
    Gear {
        table,
        mask_small,
        mask_large,
    }
});

/// Length of the first chunk of `data`, given that `data` is all there is or holds at
/// least `MAX_CHUNK` bytes (FastCDC never looks further).
pub fn first_cut(data: &[u8]) -> usize {
    if data.len() <= MIN_CHUNK {
        return data.len();
    }
    let end = data.len().min(MAX_CHUNK);
    let data = &data[..end];
    // As in the crate: positions are tested in pairs, so an odd end leaves its last
    // position untested; below the average size (or below `end` when shorter) the
    // stricter mask applies.
    let center = AVG_CHUNK.min(end) & !1;
    let tested_end = end & !1;
    let gear = &*GEAR;
    scan(gear, data, MIN_CHUNK, center, gear.mask_small)
        .or_else(|| scan(gear, data, center, tested_end, gear.mask_large))
        .unwrap_or(end)
}

/// The first position `p` in `from..to` with `H(p) & mask == 0`, where the hash starts at
/// `MIN_CHUNK` (`from >= MIN_CHUNK`).
#[inline(always)]
fn scan(gear: &Gear, data: &[u8], from: usize, to: usize, mask: u64) -> Option<usize> {
    let table = &gear.table;
    let step = |hash: u64, byte: u8| (hash << 1).wrapping_add(table[byte as usize]);
    // The hash of the position before `from`.
    let warm_from = from.saturating_sub(WARM_UP).max(MIN_CHUNK);
    let mut hash = data[warm_from..from].iter().fold(0, |h, &b| step(h, b));
    let mut base = from;
    while to.saturating_sub(base) >= LANES * SEGMENT {
        let round = &data[base..base + LANES * SEGMENT];
        // Lanes 1..4 start cold 64 bytes before their segment (inside the round, and so
        // at or past `from`, at or past `MIN_CHUNK`).
        let (mut h1, mut h2, mut h3) = (0u64, 0u64, 0u64);
        for i in SEGMENT - WARM_UP..SEGMENT {
            h1 = step(h1, round[i]);
            h2 = step(h2, round[SEGMENT + i]);
            h3 = step(h3, round[2 * SEGMENT + i]);
        }
        let mut earliest = usize::MAX;
        for i in 0..SEGMENT {
            hash = step(hash, round[i]);
            h1 = step(h1, round[SEGMENT + i]);
            h2 = step(h2, round[2 * SEGMENT + i]);
            h3 = step(h3, round[3 * SEGMENT + i]);
            if hash & mask == 0 {
                return Some(base + i);
            }
            if h1 & mask == 0 {
                earliest = lower(earliest, SEGMENT + i);
            }
            if h2 & mask == 0 {
                earliest = lower(earliest, 2 * SEGMENT + i);
            }
            if h3 & mask == 0 {
                earliest = lower(earliest, 3 * SEGMENT + i);
            }
        }
        if earliest != usize::MAX {
            return Some(base + earliest);
        }
        // The last lane ended where the next round begins.
        hash = h3;
        base += LANES * SEGMENT;
    }
    for (offset, &byte) in data[base..to].iter().enumerate() {
        hash = step(hash, byte);
        if hash & mask == 0 {
            return Some(base + offset);
        }
    }
    None
}

/// The smaller offset; out of line, as a match is rare (once per chunk).
#[cold]
#[inline(never)]
fn lower(a: usize, b: usize) -> usize {
    a.min(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::chunker::tests::pseudo_random;
    use fastcdc::v2020::FastCDC;
    use proptest::prelude::*;

    /// The crate's chunk lengths of a whole input.
    fn crate_lengths(data: &[u8]) -> Vec<usize> {
        FastCDC::new(data, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
            .map(|chunk| chunk.length)
            .collect()
    }

    fn our_lengths(data: &[u8]) -> Vec<usize> {
        let mut lengths = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let length = first_cut(&data[at..]);
            assert!(length > 0);
            lengths.push(length);
            at += length;
        }
        lengths
    }

    // These tests check CAS-5 (the crate's cut points, whichever scan finds them).

    #[test]
    fn lengths_around_every_size_boundary_match_the_crate() {
        // One buffer per length class: at and around the minimum, the average (where the
        // mask changes), a round of the lanes, and the maximum; odd and even.
        let data = pseudo_random(MAX_CHUNK + LANES * SEGMENT + 3, 11);
        let mut lengths: Vec<usize> = vec![0, 1, 2, 100];
        for edge in [
            MIN_CHUNK,
            MIN_CHUNK + WARM_UP,
            MIN_CHUNK + LANES * SEGMENT,
            AVG_CHUNK,
            AVG_CHUNK + LANES * SEGMENT,
            MAX_CHUNK,
        ] {
            lengths.extend((edge - 3)..=(edge + 3));
        }
        for length in lengths {
            let buffer = &data[..length];
            let expected = FastCDC::new(buffer, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
                .next()
                .map(|chunk| chunk.length)
                .unwrap_or(0);
            assert_eq!(first_cut(buffer), expected, "length {length}");
        }
    }

    #[test]
    fn degenerate_inputs_match_the_crate() {
        // No cut point at all (zeros: every chunk is the largest), a short period, and a
        // long random run broken by a zero run (cuts resume after it).
        let zeros = vec![0u8; 3 * MAX_CHUNK + 5];
        assert_eq!(our_lengths(&zeros), crate_lengths(&zeros));
        let periodic: Vec<u8> = (0..2 * MAX_CHUNK).map(|i| (i % 251) as u8).collect();
        assert_eq!(our_lengths(&periodic), crate_lengths(&periodic));
        let mut mixed = pseudo_random(4 << 20, 3);
        mixed[1 << 20..(1 << 20) + 700_000].fill(0);
        assert_eq!(our_lengths(&mixed), crate_lengths(&mixed));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn cuts_match_the_crate_on_random_inputs(
            seed in any::<u64>(),
            len in 0usize..(3 << 20),
            zero_run in proptest::option::of((0usize..(3 << 20), 0usize..300_000)),
        ) {
            let mut data = pseudo_random(len, seed);
            if let Some((start, run)) = zero_run {
                let start = start.min(len);
                let end = (start + run).min(len);
                data[start..end].fill(0);
            }
            prop_assert_eq!(our_lengths(&data), crate_lengths(&data));
        }
    }
}
