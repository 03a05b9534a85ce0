//! Coalesced reads for a remote medium (S3), where every request costs a round trip.
//!
//! A download asks for its blocks in order. On S3 one ranged GET per block is bound by
//! latency (about 10 MB/s on a local Garage, docs/performance.md), so the store locates a
//! batch of the blocks in the index and [`plan`]s *runs*: consecutive blocks of the
//! request that sit in one pack in increasing order, at most [`MAX_GAP`] bytes apart (a
//! record header, or a few blocks of other uploads) and spanning at most [`MAX_RUN`]
//! bytes. Each run is one ranged GET whose body is *streamed*: [`RunReader`] cuts the
//! blocks out of it as the caller pulls them, so a long run costs no more memory than one
//! block plus the HTTP client's read buffer. Blocks the index does not name (absent, or in
//! the legacy file-per-block directory) are read on their own.
//!
//! `plan` and its batch-at-a-time form [`Planner`] are pure; the tests check that the
//! plan covers every requested block once, in order, at its indexed place, and that
//! planning batch by batch gives the same steps (runs continue across lookup batches).

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use super::format::PackId;
use super::index::Location;
use crate::storage::StoreError;

/// Bytes one run's request covers at most (a single block longer than this is a run of
/// its own).
pub const MAX_RUN: u64 = 16 << 20;

/// Bytes a run may skip between two of its blocks: the 40-byte record header always, and
/// up to one large block of another upload (reading it costs less than a round trip).
pub const MAX_GAP: u64 = 256 << 10;

/// Blocks located in the index with one call.
pub const LOCATE_BATCH: usize = 256;

/// One block of a run: where its bytes start, relative to the run's start, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub at: u64,
    pub len: u32,
}

/// One step of a read plan, covering the next requested blocks in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The next `pieces.len()` blocks, read with one request of `len` bytes at `offset`
    /// of `pack`.
    Run {
        pack: PackId,
        offset: u64,
        len: u64,
        pieces: Vec<Piece>,
    },
    /// The next block is not in the index: read it on its own.
    Alone,
}

impl Step {
    /// How many requested blocks this step covers.
    pub fn blocks(&self) -> usize {
        match self {
            Step::Run { pieces, .. } => pieces.len(),
            Step::Alone => 1,
        }
    }
}

/// Group `located` (the index's answer for each requested block, in order) into steps.
pub fn plan(located: &[Option<Location>]) -> Vec<Step> {
    let mut planner = Planner::default();
    let mut steps = planner.push(located);
    steps.extend(planner.finish());
    steps
}

/// [`plan`] fed one lookup batch at a time: a run still open at the end of a batch stays
/// open for the next one, so a download's runs do not split at batch boundaries. The
/// steps of all pushes and the finish, in order, equal `plan` of the whole request.
#[derive(Debug, Default)]
pub struct Planner {
    /// The open run: pack, start, end, pieces.
    open: Option<(PackId, u64, u64, Vec<Piece>)>,
}

impl Planner {
    /// The steps that `located` (the next blocks of the request) completes.
    pub fn push(&mut self, located: &[Option<Location>]) -> Vec<Step> {
        let mut steps = Vec::new();
        for at in located {
            let Some(at) = at else {
                steps.extend(self.open.take().map(close));
                steps.push(Step::Alone);
                continue;
            };
            let end = at.offset + u64::from(at.len);
            if let Some((pack, start, run_end, pieces)) = &mut self.open {
                let joins = *pack == at.pack
                    && at.offset >= *run_end
                    && at.offset - *run_end <= MAX_GAP
                    && end - *start <= MAX_RUN;
                if joins {
                    pieces.push(Piece {
                        at: at.offset - *start,
                        len: at.len,
                    });
                    *run_end = end;
                    continue;
                }
            }
            steps.extend(self.open.take().map(close));
            self.open = Some((at.pack, at.offset, end, vec![Piece { at: 0, len: at.len }]));
        }
        steps
    }

    /// The run still open at the end of the request, if any.
    pub fn finish(self) -> Option<Step> {
        self.open.map(close)
    }
}

fn close((pack, start, end, pieces): (PackId, u64, u64, Vec<Piece>)) -> Step {
    Step::Run {
        pack,
        offset: start,
        len: end - start,
        pieces,
    }
}

/// A run's response body, cut into its blocks as they are pulled.
pub struct RunReader {
    body: BoxStream<'static, Result<Bytes, StoreError>>,
    /// Received bytes not yet consumed, starting at run offset `pos`.
    buf: Bytes,
    pos: u64,
    pieces: VecDeque<Piece>,
    pack: PackId,
}

impl RunReader {
    pub fn new(
        pack: PackId,
        pieces: Vec<Piece>,
        body: BoxStream<'static, Result<Bytes, StoreError>>,
    ) -> Self {
        Self {
            body,
            buf: Bytes::new(),
            pos: 0,
            pieces: pieces.into(),
            pack,
        }
    }

    /// The run's blocks in order, as a stream.
    pub fn into_stream(self) -> BoxStream<'static, Result<Option<Bytes>, StoreError>> {
        futures_util::stream::unfold(Some(self), |reader| async move {
            let mut reader = reader?;
            match reader.next_block().await {
                Some(Ok(block)) => Some((Ok(Some(block)), Some(reader))),
                // Stop after an error: the rest of the run cannot be trusted.
                Some(Err(e)) => Some((Err(e), None)),
                None => None,
            }
        })
        .boxed()
    }

    /// More body bytes, or an error if the body ended before the run did.
    async fn fill(&mut self) -> Result<(), StoreError> {
        loop {
            match self.body.next().await {
                Some(Ok(chunk)) if chunk.is_empty() => continue,
                Some(Ok(chunk)) => {
                    self.buf = chunk;
                    return Ok(());
                }
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(StoreError::Corrupt(format!(
                        "pack {} is truncated (a ranged read ended early)",
                        self.pack
                    )));
                }
            }
        }
    }

    /// The next block, `None` after the last.
    async fn next_block(&mut self) -> Option<Result<Bytes, StoreError>> {
        let piece = self.pieces.pop_front()?;
        Some(self.cut(piece).await)
    }

    async fn cut(&mut self, piece: Piece) -> Result<Bytes, StoreError> {
        // Skip to the block (record header, blocks of other uploads).
        while self.pos < piece.at {
            if self.buf.is_empty() {
                self.fill().await?;
            }
            let skip = (piece.at - self.pos).min(self.buf.len() as u64) as usize;
            let _ = self.buf.split_to(skip);
            self.pos += skip as u64;
        }
        // The block is copied out even when it lies inside one received chunk: a slice
        // would keep the HTTP client's whole read buffer alive for as long as the block
        // is held downstream, so memory would no longer be counted in blocks.
        let len = piece.len as usize;
        let mut block = BytesMut::with_capacity(len);
        while block.len() < len {
            if self.buf.is_empty() {
                self.fill().await?;
            }
            let take = (len - block.len()).min(self.buf.len());
            block.extend_from_slice(&self.buf.split_to(take));
        }
        self.pos += len as u64;
        Ok(block.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(future)
    }

    fn pack(n: u8) -> PackId {
        PackId([n; 32])
    }

    fn loc(p: u8, offset: u64, len: u32) -> Option<Location> {
        Some(Location {
            pack: pack(p),
            offset,
            len,
            last_ref_ms: 0,
        })
    }

    #[test]
    fn adjacent_records_of_one_pack_form_one_run() {
        // Three blocks written one after another (40-byte record headers between them).
        let steps = plan(&[loc(1, 40, 100), loc(1, 180, 200), loc(1, 420, 50)]);
        assert_eq!(
            steps,
            vec![Step::Run {
                pack: pack(1),
                offset: 40,
                len: 430,
                pieces: vec![
                    Piece { at: 0, len: 100 },
                    Piece { at: 140, len: 200 },
                    Piece { at: 380, len: 50 },
                ],
            }]
        );
    }

    #[test]
    fn a_new_pack_a_backward_block_a_wide_gap_or_an_absent_block_starts_a_new_step() {
        let far = 40 + 100 + MAX_GAP + 1;
        let steps = plan(&[
            loc(1, 40, 100),
            loc(2, 40, 100), // another pack
            loc(2, 40, 100), // the same block again (a repeat in the blob): backward
            loc(2, far, 10), // too far ahead
            None,            // not indexed
            loc(2, far + 50, 10),
        ]);
        let sizes: Vec<usize> = steps.iter().map(Step::blocks).collect();
        assert_eq!(sizes, vec![1, 1, 1, 1, 1, 1]);
        assert_eq!(steps[4], Step::Alone);
    }

    #[test]
    fn a_run_stops_at_max_run_bytes() {
        let block = 4 << 20;
        let located: Vec<_> = (0..10)
            .map(|i| loc(1, 40 + i * (block + 40), block as u32))
            .collect();
        for step in plan(&located) {
            let Step::Run { len, .. } = step else {
                panic!("all indexed")
            };
            assert!(len <= MAX_RUN);
        }
    }

    proptest! {
        // Planning in lookup batches of any sizes gives exactly the plan of the whole
        // request: a run open at a batch's end continues into the next batch.
        #[test]
        fn planning_in_batches_equals_planning_the_whole_request(
            blocks in proptest::collection::vec((0u8..3, 0u64..4, 1u32..300, any::<bool>()), 0..60),
            cuts in proptest::collection::vec(1usize..20, 1..10),
        ) {
            // Mostly increasing offsets within a pack, with gaps and absent blocks.
            let mut next = [0u64; 3];
            let located: Vec<Option<Location>> = blocks
                .iter()
                .map(|(p, gap, len, present)| {
                    let at = next[*p as usize] + 40 + gap * 100_000;
                    next[*p as usize] = at + u64::from(*len);
                    if *present { loc(*p, at, *len) } else { None }
                })
                .collect();
            let mut planner = Planner::default();
            let mut steps = Vec::new();
            let mut rest = &located[..];
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (batch, tail) = rest.split_at((*cut).min(rest.len()));
                steps.extend(planner.push(batch));
                rest = tail;
            }
            steps.extend(planner.finish());
            prop_assert_eq!(steps, plan(&located));
        }

        /// Every requested block is covered once, in order, at its indexed bytes, and
        /// every run stays within its limits.
        #[test]
        fn the_plan_covers_each_block_once_in_order(
            blocks in proptest::collection::vec(
                (proptest::option::weighted(0.9, (0u8..3, 0u64..1_000_000, 1u32..300_000)),),
                0..200,
            )
        ) {
            let located: Vec<Option<Location>> = blocks
                .iter()
                .map(|(b,)| b.map(|(p, offset, len)| loc(p, offset, len).unwrap()))
                .collect();
            let steps = plan(&located);
            let mut next = 0;
            for step in &steps {
                match step {
                    Step::Alone => prop_assert!(located[next].is_none()),
                    Step::Run { pack, offset, len, pieces } => {
                        prop_assert!(!pieces.is_empty());
                        prop_assert!(*len <= MAX_RUN || pieces.len() == 1);
                        let mut end = 0;
                        for (i, piece) in pieces.iter().enumerate() {
                            let at = located[next + i].as_ref().unwrap();
                            prop_assert_eq!(at.pack, *pack);
                            prop_assert_eq!(at.offset, offset + piece.at);
                            prop_assert_eq!(at.len, piece.len);
                            if i > 0 {
                                prop_assert!(piece.at >= end && piece.at - end <= MAX_GAP);
                            }
                            end = piece.at + u64::from(piece.len);
                        }
                        prop_assert_eq!(end, *len);
                    }
                }
                next += step.blocks();
            }
            prop_assert_eq!(next, located.len());
        }

        /// However the body is split into chunks, the reader returns exactly each piece's
        /// bytes.
        #[test]
        fn the_reader_cuts_the_pieces_out_of_any_chunking(
            gaps in proptest::collection::vec((0u64..100, 1u32..5_000), 1..20),
            cuts in proptest::collection::vec(1usize..7_000, 1..40),
        ) {
            let mut pieces = Vec::new();
            let mut at = 0;
            for (gap, len) in &gaps {
                at += gap;
                pieces.push(Piece { at, len: *len });
                at += u64::from(*len);
            }
            let body: Vec<u8> = (0..at).map(|i| (i * 7 % 251) as u8).collect();
            let mut chunks = Vec::new();
            let mut rest = Bytes::from(body.clone());
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                chunks.push(Ok(rest.split_to((*cut).min(rest.len()))));
            }
            let reader = RunReader::new(pack(1), pieces.clone(), futures_util::stream::iter(chunks).boxed());
            let got: Vec<_> = block_on(reader.into_stream().collect::<Vec<_>>());
            prop_assert_eq!(got.len(), pieces.len());
            for (piece, block) in pieces.iter().zip(got) {
                let block = block.unwrap().unwrap();
                let start = piece.at as usize;
                prop_assert_eq!(&block[..], &body[start..start + piece.len as usize]);
            }
        }
    }

    #[test]
    fn a_body_that_ends_early_is_an_error_and_ends_the_stream() {
        let pieces = vec![Piece { at: 0, len: 10 }, Piece { at: 10, len: 10 }];
        let body = futures_util::stream::iter(vec![Ok(Bytes::from(vec![1u8; 15]))]).boxed();
        let got: Vec<_> = block_on(
            RunReader::new(pack(1), pieces, body)
                .into_stream()
                .collect::<Vec<_>>(),
        );
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].as_ref().unwrap().as_deref(), Some(&[1u8; 10][..]));
        assert!(matches!(got[1], Err(StoreError::Corrupt(_))));
    }
}
