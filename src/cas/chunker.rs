//! Content-defined chunking: FastCDC (the 2020 algorithm of `fastcdc = "=5.0.0"`,
//! normalization level 1, seed 0) with fixed sizes.
//!
//! | parameter | value |
//! |---|---|
//! | minimum chunk | 16 KiB |
//! | average chunk | 64 KiB |
//! | maximum chunk | 256 KiB |
//!
//! Chunk boundaries decide deduplication, so these numbers and the crate version are part
//! of the storage format: changing either changes which blocks new uploads produce (old
//! blobs stay readable; only deduplication against them suffers). The golden vectors in
//! the tests catch an accidental change.
//!
//! [`StreamChunker`] finds the same cut points as FastCDC over the whole input while the
//! input arrives in arbitrary pieces: a cut is decided only once `MAX_CHUNK` bytes (or
//! the end of input) are buffered, which is all FastCDC ever looks at. Chunks come out as
//! zero-copy [`Bytes`] views of the buffer.

use bytes::{Bytes, BytesMut};
use fastcdc::v2020::FastCDC;

/// Smallest chunk (except the last chunk of a blob).
pub const MIN_CHUNK: usize = 16 * 1024;
/// Target average chunk size.
pub const AVG_CHUNK: usize = 64 * 1024;
/// Largest chunk.
pub const MAX_CHUNK: usize = 256 * 1024;

/// Length of the first chunk of `data`, given that `data` is all there is (`eof`) or holds
/// at least `MAX_CHUNK` bytes.
pub(crate) fn first_cut(data: &[u8]) -> usize {
    let window = &data[..data.len().min(MAX_CHUNK)];
    FastCDC::new(window, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
        .next()
        .map(|chunk| chunk.length)
        .unwrap_or(window.len())
}

/// Chunk lengths of a complete in-memory input (reference implementation for tests and
/// the benchmark baseline).
pub fn chunk_lengths(data: &[u8]) -> Vec<usize> {
    FastCDC::new(data, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK)
        .map(|chunk| chunk.length)
        .collect()
}

/// Incremental chunker fed with pieces of a stream.
#[derive(Debug, Default)]
pub struct StreamChunker {
    buffer: BytesMut,
}

/// Capacity of each buffer the chunker fills, in largest chunks. Chunks are views of it,
/// so a buffer stays allocated (and the bytes written into it resident) until its last
/// chunk is dropped; `pipeline::ingest::memory_bound` counts one such buffer.
pub const BUFFER_CHUNKS: usize = 4;
const BUFFER_CAPACITY: usize = BUFFER_CHUNKS * MAX_CHUNK;

impl StreamChunker {
    pub fn new() -> Self {
        Self {
            buffer: BytesMut::with_capacity(BUFFER_CAPACITY),
        }
    }

    /// Append the next piece of input.
    pub fn push(&mut self, data: &[u8]) {
        if self.buffer.capacity() - self.buffer.len() < data.len() {
            // A fresh buffer of `BUFFER_CAPACITY` (or more for a large piece), holding the
            // bytes not cut yet. `BytesMut::reserve` would size a buffer that chunks still
            // share to just the bytes needed, so every push would allocate and copy the
            // uncut tail again (measured: about 5 % of a durable ingest in `memmove`).
            let mut fresh =
                BytesMut::with_capacity(BUFFER_CAPACITY.max(self.buffer.len() + data.len()));
            fresh.extend_from_slice(&self.buffer);
            self.buffer = fresh;
        }
        self.buffer.extend_from_slice(data);
    }

    /// Bytes buffered but not yet cut into chunks (always < `MAX_CHUNK` between calls that
    /// drained all ready chunks).
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// Take the bytes not cut yet (the staged tail of a resumable upload part).
    pub fn take_rest(&mut self) -> Bytes {
        self.buffer.split().freeze()
    }

    /// The next chunk, if its boundary is already decided. With `eof` set, the remaining
    /// bytes are cut as the end of the input.
    pub fn next_chunk(&mut self, eof: bool) -> Option<Bytes> {
        if self.buffer.is_empty() || (!eof && self.buffer.len() < MAX_CHUNK) {
            return None;
        }
        let length = first_cut(&self.buffer);
        Some(self.buffer.split_to(length).freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Deterministic pseudo-random bytes (xorshift64*), stable across platforms.
    pub(crate) fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
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

    #[test]
    fn golden_cut_points_are_stable() {
        // Checks CAS-5.
        // Recorded with fastcdc =5.0.0 and the sizes above. A failure here means chunk
        // boundaries changed: deduplication against existing blocks would break.
        let data = pseudo_random(1 << 20, 42);
        let lengths = chunk_lengths(&data);
        assert_eq!(lengths.iter().sum::<usize>(), data.len());
        assert_eq!(lengths, GOLDEN_1MIB_SEED42);
        let digest = blake3::hash(&data);
        assert_eq!(&digest.to_hex()[..16], GOLDEN_1MIB_SEED42_PREFIX);
    }

    const GOLDEN_1MIB_SEED42: &[usize] = &[
        68430, 75594, 21205, 92742, 199438, 70183, 66607, 104760, 81600, 77011, 73310, 117696,
    ];
    const GOLDEN_1MIB_SEED42_PREFIX: &str = "4e3c830acb9d5117";

    #[test]
    fn small_inputs_are_one_chunk() {
        let mut chunker = StreamChunker::new();
        chunker.push(b"hello");
        assert_eq!(chunker.next_chunk(false), None);
        assert_eq!(chunker.next_chunk(true).as_deref(), Some(&b"hello"[..]));
        assert_eq!(chunker.next_chunk(true), None);
    }

    #[test]
    fn the_uncut_tail_is_copied_once_per_buffer_not_once_per_push() {
        // Pushed in small pieces, consecutive chunks are views of one buffer until it is
        // full; a new buffer (one copy of the uncut tail) starts at most once per
        // `BUFFER_CAPACITY - MAX_CHUNK` bytes, not at every push.
        let data = pseudo_random(3 * BUFFER_CAPACITY, 7);
        let mut chunker = StreamChunker::new();
        let mut chunks = Vec::new();
        for piece in data.chunks(32 * 1024) {
            chunker.push(piece);
            while let Some(chunk) = chunker.next_chunk(false) {
                chunks.push(chunk);
            }
        }
        while let Some(chunk) = chunker.next_chunk(true) {
            chunks.push(chunk);
        }
        let new_buffers = chunks
            .windows(2)
            .filter(|pair| pair[1].as_ptr() as usize != pair[0].as_ptr() as usize + pair[0].len())
            .count();
        assert!(chunks.len() > 30, "{} chunks", chunks.len());
        assert!(new_buffers <= 3, "{new_buffers} buffers after the first");
        assert_eq!(chunks.concat(), data);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        // Checks CAS-5.
        fn streaming_cuts_match_whole_input_cuts(
            seed in any::<u64>(),
            len in 0usize..(2 << 20),
            pieces in proptest::collection::vec(1usize..300_000, 1..64),
        ) {
            let data = pseudo_random(len, seed);
            let expected = chunk_lengths(&data);
            let mut chunker = StreamChunker::new();
            let mut got = Vec::new();
            let mut offset = 0;
            let mut piece = pieces.iter().cycle();
            while offset < data.len() {
                let take = (*piece.next().unwrap()).min(data.len() - offset);
                chunker.push(&data[offset..offset + take]);
                offset += take;
                while let Some(chunk) = chunker.next_chunk(false) {
                    prop_assert!(chunk.len() >= MIN_CHUNK && chunk.len() <= MAX_CHUNK);
                    got.push(chunk.len());
                }
                prop_assert!(chunker.buffered() < MAX_CHUNK);
            }
            while let Some(chunk) = chunker.next_chunk(true) {
                got.push(chunk.len());
            }
            prop_assert_eq!(got, expected);
        }
    }
}
