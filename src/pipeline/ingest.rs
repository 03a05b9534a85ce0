//! The streaming ingest pipeline: body -> chunks -> blocks -> manifest.
//!
//! ```text
//!  body frames --(bounded queue)--> chunk thread ---------(bounded queue)--> write session
//!  (async: counts bytes, enforces   (blocking pool: FastCDC cut,            (async: BLAKE3 of
//!   limits, BLAKE3 of the whole,     nothing else, the one serial            each block, appends
//!   batches frames)                  stage)                                  in order; the pack
//!                                                                            store writes on its
//!                                                                            own thread)
//! ```
//! Every stage is bounded, so memory per upload stays a few MiB whatever the blob size,
//! and a slow or stopped block store stops the reading of the request body (back-pressure
//! reaches the client through TCP). The cut-point search runs on the blocking pool; the
//! hashing (whole content, each block) runs on the async stages in slices of at most one
//! frame or one block (a few hundred microseconds), in parallel with the cut.
//!
//! The blocks go through one [`WriteSession`](crate::storage::WriteSession) per upload.
//! The session is committed (blocks durable, index committed, deduplicated blocks
//! confirmed) only after the byte count matches the declared length, and the manifest is
//! written only after the commit, so a failed, truncated or cancelled upload never makes
//! a blob visible. Dropping the future cancels the pipeline and aborts the session.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;

use crate::cas::chunker::StreamChunker;
use crate::cas::digest::{BodyDigest, BodyHasher};
use crate::cas::keys::{BlobKey, BlockKey};
use crate::cas::manifest::{BlockRef, Manifest};
use crate::cas::pdf::scan::StateError;
use crate::cas::pdf::{
    Chunking, CutCounts, PdfChunker, SavedChunker, Selection, SelectionError, UnsupportedPolicy,
};
use crate::storage::manifest::CommitFence;
use crate::storage::{
    BlockStore, CreateOutcome, ManifestStore, PutOutcome, StoreError, WriteSession,
};

/// Frame batches queued between the reader and the chunker.
const FRAME_QUEUE: usize = 4;
/// Body bytes gathered into one batch before it is handed to the chunker thread.
pub const BATCH_BYTES: usize = 256 * 1024;
/// Chunks queued between the chunker and the block writes.
const CHUNK_QUEUE: usize = 4;
/// Queued chunks handed to the write session in one `append_many` at most. The queue was
/// 8 deep before batching; 4 queued plus a batch of 5 keeps the memory bound (and so
/// every admission footprint) exactly where it was.
const APPEND_BATCH: usize = CHUNK_QUEUE + 1;

/// Largest body frame the memory bound assumes: hyper's HTTP/1 read buffer limit
/// (8 KiB + 100 × 4 KiB = 408 KiB), rounded up. A body frame is cut from that buffer.
pub const MAX_BODY_FRAME: usize = 416 * 1024;

/// Upper bound of the body bytes one ingest holds at once, from the queue depths above
/// (admission reserves this, see `admission::footprint`): `FRAME_QUEUE` queued batches,
/// the batch being gathered and the batch the chunker works on (each below
/// `BATCH_BYTES + MAX_BODY_FRAME`); the chunker's buffer (below `max_chunk`) and the chunk
/// it is cutting; `CHUNK_QUEUE` queued chunks and one the chunker waits to send; and
/// `STORE_IN_FLIGHT` blocks inside the write session (the batch being appended and those
/// queued for the pack writer) and what the pack writer holds while writing
/// (`pack::spool::held_bytes`: the blocks of one vectored write, or two direct-write
/// stages); and the chunker buffer that the oldest block in
/// flight is a view of (`chunker::BUFFER_CHUNKS` chunks), whose blocks already stored stay
/// resident until that block is dropped; and what the PDF-aware chunker holds beyond the
/// generic one (`cas::pdf::chunk::EXTRA_MEMORY`: its lookahead, event queue and scanner),
/// since any upload may be selected for it.
pub const fn memory_bound(max_chunk: usize) -> usize {
    (FRAME_QUEUE + 2) * (BATCH_BYTES + MAX_BODY_FRAME)
        + 2 * max_chunk
        + (CHUNK_QUEUE + 1) * max_chunk
        + STORE_IN_FLIGHT * max_chunk
        + crate::storage::pack::spool::held_bytes(max_chunk)
        + crate::cas::chunker::BUFFER_CHUNKS * max_chunk
        + crate::cas::pdf::chunk::EXTRA_MEMORY
}

/// Blocks a write session holds before its pack writer takes them: the batch being
/// appended (`APPEND_BATCH`) and the pack writer's queue.
const STORE_IN_FLIGHT: usize = crate::storage::pack::WRITER_QUEUE + APPEND_BATCH;

/// [`memory_bound`] of the chunker in use.
pub const MEMORY_BOUND: usize = memory_bound(crate::cas::chunker::MAX_CHUNK);

/// Limits checked while the body streams.
#[derive(Debug, Clone, Copy)]
pub struct IngestLimits {
    /// Largest blob accepted.
    pub max_size: u64,
    /// `Content-Length` of the request, when declared.
    pub declared_size: Option<u64>,
    /// Abort when the body delivers nothing for this long.
    pub idle_timeout: Duration,
    /// The digest the client declared for this body (a whole upload's SHA-256, or one
    /// PATCH's `Upload-Checksum`); checked before anything commits (a mismatch is
    /// [`IngestError::DigestMismatch`]).
    pub digest: Option<BodyDigest>,
}

/// What an upload produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestReport {
    pub key: BlobKey,
    pub blocks: usize,
    pub fresh_blocks: usize,
    pub duplicate_blocks: usize,
    pub fresh_bytes: u64,
    pub manifest: CreateOutcome,
    /// When the manifest commit was sent (after every block was stored): the lower bound
    /// of the commit instant, for the owner-side ownership record (`upload::record`).
    pub commit_sent: std::time::SystemTime,
    /// The chunker that cut the blocks (also recorded in the manifest).
    pub chunking: Chunking,
    /// How the PDF-aware chunker chose its cuts (`None` for FastCDC).
    pub pdf_cuts: Option<CutCounts>,
}

/// Why an upload failed. Nothing is visible after any of these.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("blob exceeds the maximum size of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("body length {received} does not match Content-Length {declared}")]
    LengthMismatch { declared: u64, received: u64 },
    #[error("no body data for {0:?}")]
    BodyIdle(Duration),
    #[error("request body failed: {0}")]
    Body(String),
    #[error("the body's digest differs from the declared digest")]
    DigestMismatch,
    #[error("the body runs past the upload's declared length ({remaining} bytes were left)")]
    PastUploadLength { remaining: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("ingest pipeline stopped unexpectedly: {0}")]
    Pipeline(String),
    /// The PDF selection (declared type against the first bytes) or, with
    /// `unsupported = "reject"`, the scanner refused the body.
    #[error(transparent)]
    Pdf(#[from] SelectionError),
}

enum Frame {
    /// The chunker to use, decided from the first bytes; always the first frame.
    Start(Chunking),
    /// A batch of body frames (batched to keep thread hand-offs few when frames are small).
    Data(Vec<Bytes>),
    /// The end of this body; `eof`: also the end of the blob (cut everything), else the
    /// bytes after the last cut are handed back as the staged tail of a resumable upload.
    End { eof: bool },
}

/// How the body of one run relates to the blob.
#[derive(Debug, Clone, Copy)]
enum Span {
    /// The whole blob: the end of the body is the end of the input.
    Whole,
    /// One PATCH of a resumable upload with `remaining` bytes left in the blob. With
    /// `keep_partial`, a body that breaks or goes idle ends the part where it broke (what
    /// arrived is kept), instead of failing it.
    Part { remaining: u64, keep_partial: bool },
}

/// Chunk, hash and store a body; write the manifest; report. `on_bytes` is called with
/// the size of every body frame as it is accepted (progress, counters).
pub async fn ingest<S, E>(
    body: S,
    limits: IngestLimits,
    blocks: Arc<dyn BlockStore>,
    manifests: Arc<dyn ManifestStore>,
    on_bytes: impl FnMut(u64) + Send,
) -> Result<IngestReport, IngestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    ingest_fenced(body, limits, blocks, manifests, None, on_bytes).await
}

/// [`ingest_selected`] with FastCDC for every body (no type declared to select with).
pub async fn ingest_fenced<S, E>(
    body: S,
    limits: IngestLimits,
    blocks: Arc<dyn BlockStore>,
    manifests: Arc<dyn ManifestStore>,
    fence: Option<CommitFence>,
    on_bytes: impl FnMut(u64) + Send,
) -> Result<IngestReport, IngestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    let selection = Selection::generic();
    ingest_selected(body, limits, selection, blocks, manifests, fence, on_bytes).await
}

/// [`ingest`] whose chunker is chosen by `selection` from the body's first bytes
/// (`cas::pdf::select`: a refusal there fails before any block is cut), and whose
/// manifest commit is conditional on `fence` (a session upload in cluster mode: the
/// commit binds, see `placement::handoff`).
pub async fn ingest_selected<S, E>(
    body: S,
    limits: IngestLimits,
    selection: Selection,
    blocks: Arc<dyn BlockStore>,
    manifests: Arc<dyn ManifestStore>,
    fence: Option<CommitFence>,
    mut on_bytes: impl FnMut(u64) + Send,
) -> Result<IngestReport, IngestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    let mut session = blocks.begin()?;
    let run = run_pipeline(
        body,
        limits,
        Span::Whole,
        Some((selection, Vec::new())),
        ChunkStart::Select(Bytes::new()),
        blake3::Hasher::new(),
        session.as_mut(),
        &mut on_bytes,
    )
    .await?;
    let received = run.fed.received;
    let stored_bytes: u64 = run.stored.refs.iter().map(|r| u64::from(r.size)).sum();
    if stored_bytes != received || !run.tail.is_empty() {
        return Err(IngestError::Pipeline(format!(
            "stored {stored_bytes} bytes of {received} received"
        )));
    }
    if let (Some(what), UnsupportedPolicy::Reject) =
        (run.chunked.unsupported, selection.policy.unsupported)
    {
        // Before the commit: the session is dropped (aborted), nothing becomes visible.
        return Err(IngestError::Pdf(SelectionError::Unsupported(what)));
    }
    let key = BlobKey {
        hash: *run.fed.whole.finalize().as_bytes(),
        size: received,
    };
    let stored = run.stored;
    let chunking = run.chunked.chunking;
    // Blocks durable and indexed (dedup hits confirmed) before the manifest names them,
    // or with it in one transaction when the index shares the manifests' database.
    let blocks_total = stored.refs.len();
    let mut manifest = Manifest::new(key, stored.refs, unix_millis());
    manifest.chunking = chunking.info();
    let commit_sent = std::time::SystemTime::now();
    let (_, outcome) = session.commit_manifest(manifest, manifests, fence).await?;
    Ok(IngestReport {
        key,
        blocks: blocks_total,
        fresh_blocks: stored.fresh,
        duplicate_blocks: blocks_total - stored.fresh,
        fresh_bytes: stored.fresh_bytes,
        manifest: outcome,
        commit_sent,
        chunking,
        pdf_cuts: run.chunked.counts,
    })
}

/// Where one PATCH of a resumable upload starts (see docs/resumable.md).
pub struct PartStart {
    /// The staged tail: the bytes after the last cut point so far (< `MAX_CHUNK` for
    /// FastCDC, < `max + LOOKAHEAD` for the PDF-aware chunker).
    pub tail: Bytes,
    /// The chunker state saved by the previous PATCH (`cas::pdf::resume`).
    pub chunker: SavedChunker,
    /// Bytes accepted before this PATCH (the tail ends there).
    pub offset: u64,
    /// How the chunker is chosen while it is undecided, and the `[ingest.pdf]` policy.
    pub selection: Selection,
    /// The whole-content BLAKE3 of every byte accepted so far (tail included).
    pub whole: blake3::Hasher,
    /// Bytes left until the upload's declared length.
    pub remaining: u64,
    /// Keep what arrived when the body breaks (no per-PATCH checksum was declared).
    pub keep_partial: bool,
}

/// What one PATCH produced; nothing of it is durable until the caller commits the
/// session and records the part in its ledger.
pub struct PartOutcome {
    /// Body bytes accepted by this PATCH.
    pub received: u64,
    /// Blocks cut and appended by this PATCH, in order.
    pub refs: Vec<BlockRef>,
    pub fresh_blocks: usize,
    pub fresh_bytes: u64,
    /// The new staged tail (empty when `complete`).
    pub tail: Bytes,
    /// The whole-content hash after this PATCH.
    pub whole: blake3::Hasher,
    /// The upload reached its declared length: the last block was cut as the end.
    pub complete: bool,
    /// The body broke or went idle, and the part was kept up to there.
    pub interrupted: Option<IngestError>,
    /// The chunker state to save with the new tail (meaningless when `complete`).
    pub chunker: SavedChunker,
    /// The chunker in use (`None` while undecided).
    pub chunking: Option<Chunking>,
    /// How the PDF-aware chunker chose its cuts, over the whole upload so far.
    pub pdf_cuts: Option<CutCounts>,
}

/// Run one PATCH of a resumable upload through the pipeline into `session`: the chunker
/// resumes at the last cut point (its staged tail), so the blocks are those a one-shot
/// upload of the same bytes produces. The caller commits the session (with the manifest
/// when `complete`).
pub async fn ingest_part<S, E>(
    body: S,
    limits: IngestLimits,
    start: PartStart,
    session: &mut dyn WriteSession,
    mut on_bytes: impl FnMut(u64) + Send,
) -> Result<PartOutcome, IngestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    let tail_in = start.tail.len() as u64;
    let span = Span::Part {
        remaining: start.remaining,
        keep_partial: start.keep_partial,
    };
    // The chunker resumes where the previous PATCH left it: FastCDC from its staged tail
    // alone, the PDF-aware chunker from its saved state over the tail (CAS-14); an
    // undecided one is chosen by the selection from the tail and the first new bytes.
    let bad_state = |e: StateError| IngestError::Store(StoreError::Corrupt(e.to_string()));
    let (selection, chunk_start) = match start.chunker {
        SavedChunker::Undecided => (
            Some((start.selection, start.tail.to_vec())),
            ChunkStart::Select(start.tail),
        ),
        SavedChunker::FastCdc => {
            let mut chunker = StreamChunker::new();
            chunker.push(&start.tail);
            (None, ChunkStart::Ready(Chunker::Fast(chunker)))
        }
        SavedChunker::Pdf(state) => {
            let chunker =
                PdfChunker::restore(&state, &start.tail, start.offset).map_err(bad_state)?;
            (None, ChunkStart::Ready(Chunker::Pdf(Box::new(chunker))))
        }
    };
    let run = run_pipeline(
        body,
        limits,
        span,
        selection,
        chunk_start,
        start.whole,
        session,
        &mut on_bytes,
    )
    .await?;
    if run.fed.eof
        && let (Some(what), UnsupportedPolicy::Reject) =
            (run.chunked.unsupported, start.selection.policy.unsupported)
    {
        // The final PATCH, before its commit: nothing of the blob becomes visible.
        return Err(IngestError::Pdf(SelectionError::Unsupported(what)));
    }
    let stored_bytes: u64 = run.stored.refs.iter().map(|r| u64::from(r.size)).sum();
    if stored_bytes + run.tail.len() as u64 != tail_in + run.fed.received {
        return Err(IngestError::Pipeline(format!(
            "stored {stored_bytes} bytes and staged {} of {} received",
            run.tail.len(),
            tail_in + run.fed.received
        )));
    }
    Ok(PartOutcome {
        received: run.fed.received,
        refs: run.stored.refs,
        fresh_blocks: run.stored.fresh,
        fresh_bytes: run.stored.fresh_bytes,
        tail: run.tail,
        whole: run.fed.whole,
        complete: run.fed.eof,
        interrupted: run.fed.interrupted,
        chunker: run.chunked.saved,
        chunking: run.chunked.decided.then_some(run.chunked.chunking),
        pdf_cuts: run.chunked.counts,
    })
}

struct Run {
    fed: Fed,
    stored: Stored,
    tail: Bytes,
    chunked: Chunked,
}

/// What the chunk thread reports besides the tail.
struct Chunked {
    chunking: Chunking,
    /// False: a part ended before the selection could decide (`chunking` is then a
    /// placeholder).
    decided: bool,
    counts: Option<CutCounts>,
    unsupported: Option<crate::cas::pdf::scan::Unsupported>,
    /// The state to resume from (a resumable upload's next part).
    saved: SavedChunker,
}

impl Chunked {
    fn undecided() -> Self {
        Chunked {
            chunking: Chunking::FastCdc,
            decided: false,
            counts: None,
            unsupported: None,
            saved: SavedChunker::Undecided,
        }
    }
}

/// How the chunk thread starts.
enum ChunkStart {
    /// Wait for the selection's `Frame::Start`, then push these bytes (a staged tail of
    /// an undecided part, or nothing).
    Select(Bytes),
    /// A chunker already chosen (and resumed over its staged tail).
    Ready(Chunker),
}

/// The three stages over one body (see the module docs).
#[allow(clippy::too_many_arguments)]
async fn run_pipeline<S, E>(
    body: S,
    limits: IngestLimits,
    span: Span,
    selection: Option<(Selection, Vec<u8>)>,
    start: ChunkStart,
    whole: blake3::Hasher,
    session: &mut dyn WriteSession,
    on_bytes: &mut (impl FnMut(u64) + Send),
) -> Result<Run, IngestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    let (frame_tx, frame_rx) = mpsc::channel::<Frame>(FRAME_QUEUE);
    let (chunk_tx, chunk_rx) = mpsc::channel::<Bytes>(CHUNK_QUEUE);
    let chunking = tokio::task::spawn_blocking(move || chunk_blocks(frame_rx, chunk_tx, start));
    let feed = feed_frames(body, limits, span, selection, whole, frame_tx, on_bytes);
    let store = store_blocks(chunk_rx, session);
    let (fed, stored) = futures_util::try_join!(feed, store)?;
    let (tail, chunked) = chunking
        .await
        .map_err(|e| IngestError::Pipeline(format!("chunker task: {e}")))?
        .ok_or_else(|| IngestError::Pipeline("chunker ended without the end of the body".into()))?;
    Ok(Run {
        fed,
        stored,
        tail,
        chunked,
    })
}

/// What the reader saw.
struct Fed {
    received: u64,
    whole: blake3::Hasher,
    /// The end of the body was the end of the blob.
    eof: bool,
    interrupted: Option<IngestError>,
}

/// Pull body frames, enforce limits, hash the whole content, pass the frames on in
/// batches. Returns the byte count and the whole-content BLAKE3 hasher. (Hashing here, on
/// the async side, runs in parallel with the chunker thread's cut-point search.)
async fn feed_frames<S, E>(
    mut body: S,
    limits: IngestLimits,
    span: Span,
    selection: Option<(Selection, Vec<u8>)>,
    mut whole: blake3::Hasher,
    frames: mpsc::Sender<Frame>,
    on_bytes: &mut (impl FnMut(u64) + Send),
) -> Result<Fed, IngestError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    let mut received: u64 = 0;
    // The declared digest's hash only when the client declared one (SHA-256 costs about
    // as much as BLAKE3 again).
    let mut declared_digest = limits.digest.map(|d| (d, BodyHasher::for_digest(&d)));
    let keep_partial = matches!(
        span,
        Span::Part {
            keep_partial: true,
            ..
        }
    ) && limits.digest.is_none();
    let mut interrupted = None;
    let mut batch: Vec<Bytes> = Vec::new();
    let mut batch_bytes = 0usize;
    // The first bytes of the blob (an undecided part starts with its staged tail), until
    // the selection decides the chunker (at most 5 bytes); `None`: already decided.
    let mut decided = selection.is_none();
    let (selection, mut head) = selection.unwrap_or((Selection::generic(), Vec::new()));
    let stopped = |_| IngestError::Pipeline("chunker stopped".into());
    loop {
        let next = match tokio::time::timeout(limits.idle_timeout, body.next()).await {
            Ok(next) => next,
            Err(_) if keep_partial => {
                interrupted = Some(IngestError::BodyIdle(limits.idle_timeout));
                break;
            }
            Err(_) => return Err(IngestError::BodyIdle(limits.idle_timeout)),
        };
        let Some(frame) = next else { break };
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) if keep_partial => {
                interrupted = Some(IngestError::Body(e.to_string()));
                break;
            }
            Err(e) => return Err(IngestError::Body(e.to_string())),
        };
        if frame.is_empty() {
            continue;
        }
        received += frame.len() as u64;
        if received > limits.max_size {
            return Err(IngestError::TooLarge {
                limit: limits.max_size,
            });
        }
        if let Span::Part { remaining, .. } = span
            && received > remaining
        {
            return Err(IngestError::PastUploadLength { remaining });
        }
        if let Some(declared) = limits.declared_size
            && received > declared
        {
            return Err(IngestError::LengthMismatch { declared, received });
        }
        if !decided {
            let need = crate::cas::pdf::select::SIGNATURE.len() - head.len().min(5);
            head.extend_from_slice(&frame[..frame.len().min(need)]);
            if let Some(choice) = selection.decide(&head, false) {
                // Refused here, before the chunker saw a byte: nothing is cut or stored.
                frames.send(Frame::Start(choice?)).await.map_err(stopped)?;
                decided = true;
            }
        }
        on_bytes(frame.len() as u64);
        whole.update(&frame);
        if let Some((_, hasher)) = declared_digest.as_mut() {
            hasher.update(&frame);
        }
        batch_bytes += frame.len();
        batch.push(frame);
        if batch_bytes >= BATCH_BYTES {
            batch_bytes = 0;
            if frames
                .send(Frame::Data(std::mem::take(&mut batch)))
                .await
                .is_err()
            {
                // The chunker only stops early when the block writes failed; that error wins.
                return Err(IngestError::Pipeline("chunker stopped".into()));
            }
        }
    }
    if interrupted.is_none()
        && let Some(declared) = limits.declared_size
        && received != declared
    {
        return Err(IngestError::LengthMismatch { declared, received });
    }
    // Before the end of the body reaches the chunker: a mismatch commits nothing.
    if let Some((expected, hasher)) = declared_digest
        && !hasher.matches(&expected)
    {
        return Err(IngestError::DigestMismatch);
    }
    let eof = match span {
        Span::Whole => true,
        Span::Part { remaining, .. } => received == remaining,
    };
    if !decided {
        // A body shorter than the signature, or a part that ended before the selection
        // could decide: the part's bytes are staged undecided, the blob's end decides.
        match selection.decide(&head, eof) {
            Some(choice) => frames.send(Frame::Start(choice?)).await.map_err(stopped)?,
            None => debug_assert!(!eof),
        }
    }
    if !batch.is_empty() {
        frames.send(Frame::Data(batch)).await.map_err(stopped)?;
    }
    frames.send(Frame::End { eof }).await.map_err(stopped)?;
    Ok(Fed {
        received,
        whole,
        eof,
        interrupted,
    })
}

/// Runs on the blocking pool: cut blocks and hash each one, starting from `tail` (the
/// bytes after the last cut of a previous part). Returns the bytes left after the last
/// cut (empty at the end of the blob), or `None` when the body ended without
/// `Frame::End` (the upload was aborted) or the writer went away.
fn chunk_blocks(
    mut frames: mpsc::Receiver<Frame>,
    chunks: mpsc::Sender<Bytes>,
    start: ChunkStart,
) -> Option<(Bytes, Chunked)> {
    let mut chunker = match start {
        ChunkStart::Ready(chunker) => Some(chunker),
        ChunkStart::Select(tail) => {
            // Bytes before the selection decided (only a part's undecided tail and the
            // few bytes after it ever wait here).
            let mut waiting = bytes::BytesMut::from(&tail[..]);
            loop {
                match frames.blocking_recv()? {
                    Frame::Start(chunking) => {
                        let mut chunker = Chunker::new(chunking);
                        chunker.push(&waiting);
                        break Some(chunker);
                    }
                    Frame::Data(batch) => batch.iter().for_each(|d| waiting.extend_from_slice(d)),
                    Frame::End { eof: false } => {
                        // Still undecided: everything is the staged tail.
                        return Some((waiting.freeze(), Chunked::undecided()));
                    }
                    Frame::End { eof: true } => return None,
                }
            }
        }
    };
    let chunker = chunker.as_mut()?;
    let emit = |chunk: Bytes| -> Option<()> { chunks.blocking_send(chunk).ok() };
    loop {
        match frames.blocking_recv()? {
            Frame::Start(_) => return None,
            Frame::Data(batch) => {
                for data in batch {
                    chunker.push(&data);
                    while let Some(chunk) = chunker.next_chunk(false) {
                        emit(chunk)?;
                    }
                }
            }
            Frame::End { eof } => {
                while let Some(chunk) = chunker.next_chunk(eof) {
                    emit(chunk)?;
                }
                let rest = chunker.take_rest();
                return Some((rest, chunker.report()));
            }
        }
    }
}

/// The chunker an ingest selected.
enum Chunker {
    Fast(StreamChunker),
    Pdf(Box<PdfChunker>),
}

impl Chunker {
    fn new(chunking: Chunking) -> Self {
        match chunking {
            Chunking::FastCdc => Chunker::Fast(StreamChunker::new()),
            Chunking::Pdf(sizes) => Chunker::Pdf(Box::new(PdfChunker::new(sizes))),
        }
    }

    fn push(&mut self, data: &[u8]) {
        match self {
            Chunker::Fast(c) => c.push(data),
            Chunker::Pdf(c) => c.push(data),
        }
    }

    fn next_chunk(&mut self, eof: bool) -> Option<Bytes> {
        match self {
            Chunker::Fast(c) => c.next_chunk(eof),
            Chunker::Pdf(c) => c.next_chunk(eof),
        }
    }

    fn take_rest(&mut self) -> Bytes {
        match self {
            Chunker::Fast(c) => c.take_rest(),
            Chunker::Pdf(c) => c.take_rest(),
        }
    }

    /// What the chunk thread reports, with the state a next part resumes from.
    fn report(&self) -> Chunked {
        match self {
            Chunker::Fast(_) => Chunked {
                chunking: Chunking::FastCdc,
                decided: true,
                counts: None,
                unsupported: None,
                saved: SavedChunker::FastCdc,
            },
            Chunker::Pdf(c) => Chunked {
                chunking: Chunking::Pdf(c.sizes()),
                decided: true,
                counts: Some(c.counts()),
                unsupported: c.unsupported(),
                saved: SavedChunker::Pdf(c.save()),
            },
        }
    }
}

struct Stored {
    refs: Vec<BlockRef>,
    fresh: usize,
    fresh_bytes: u64,
}

/// Append blocks to the upload's session, in order.
async fn store_blocks(
    mut chunks: mpsc::Receiver<Bytes>,
    session: &mut dyn WriteSession,
) -> Result<Stored, IngestError> {
    let mut stored = Stored {
        refs: Vec::new(),
        fresh: 0,
        fresh_bytes: 0,
    };
    let mut batch = Vec::with_capacity(APPEND_BATCH);
    // Whatever the chunker has queued (up to APPEND_BATCH) goes to the session at once, so
    // a store with a remote index looks the batch up in one round trip.
    while chunks.recv_many(&mut batch, APPEND_BATCH).await > 0 {
        // Each block's BLAKE3 is computed here, not on the chunk thread: the cut-point
        // search is the one serial stage, so it does nothing else, and the block hashes
        // run beside it on the other cores.
        let keyed: Vec<(BlockKey, Bytes)> = std::mem::take(&mut batch)
            .into_iter()
            .map(|data| (BlockKey::of(&data), data))
            .collect();
        let sizes: Vec<(BlockKey, u32)> = keyed
            .iter()
            .map(|(key, data)| (*key, data.len() as u32))
            .collect();
        let outcomes = session.append_many(keyed).await?;
        for ((key, size), outcome) in sizes.into_iter().zip(outcomes) {
            if outcome == PutOutcome::Fresh {
                stored.fresh += 1;
                stored.fresh_bytes += u64::from(size);
            }
            stored.refs.push(BlockRef { key, size });
        }
    }
    Ok::<_, StoreError>(stored).map_err(IngestError::from)
}

fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::fs::FsManifestStore;
    use crate::storage::pack::{PackOptions, PackStore};

    fn stores(dir: &std::path::Path) -> (Arc<dyn BlockStore>, Arc<dyn ManifestStore>) {
        let options = PackOptions {
            pack_size: 1 << 20,
            fsync: false,
            trace: None,
        };
        (
            Arc::new(PackStore::open_local(dir, options).unwrap()),
            Arc::new(FsManifestStore::open(dir, false).unwrap()),
        )
    }

    fn limits(declared: Option<u64>) -> IngestLimits {
        IngestLimits {
            max_size: 1 << 30,
            declared_size: declared,
            idle_timeout: Duration::from_secs(5),
            digest: None,
        }
    }

    fn body_of(
        data: &[u8],
        piece: usize,
    ) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Unpin {
        let pieces: Vec<_> = data
            .chunks(piece)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        futures_util::stream::iter(pieces)
    }

    fn data(len: usize, seed: u8) -> Vec<u8> {
        let mut state = u64::from(seed) + 1;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) as u8
            })
            .collect()
    }

    // Checks CAS-1: the same content gives the same key, and the second ingest writes no block.
    #[tokio::test]
    async fn ingest_produces_content_key_and_dedups() {
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let content = data(3 << 20, 1);
        let mut seen = 0;
        let first = ingest(
            body_of(&content, 50_000),
            limits(Some(content.len() as u64)),
            blocks.clone(),
            manifests.clone(),
            |n| seen += n,
        )
        .await
        .unwrap();
        assert_eq!(seen, content.len() as u64);
        assert_eq!(first.key, BlobKey::of(&content));
        assert_eq!(first.fresh_blocks, first.blocks);
        assert!(first.blocks > 10);
        assert_eq!(first.manifest, CreateOutcome::Created);

        let second = ingest(
            body_of(&content, 7_777),
            limits(None),
            blocks,
            manifests.clone(),
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(second.key, first.key);
        assert_eq!(second.fresh_blocks, 0);
        assert_eq!(second.duplicate_blocks, first.blocks);
        assert_eq!(second.manifest, CreateOutcome::AlreadyExists);
        assert!(manifests.get(first.key).await.unwrap().is_some());
    }

    // Checks CAS-2: a body shorter or longer than declared leaves no manifest.
    #[tokio::test]
    async fn short_or_long_bodies_store_no_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let content = data(1 << 20, 2);
        for declared in [content.len() as u64 + 1, content.len() as u64 - 1] {
            let err = ingest(
                body_of(&content, 65_536),
                limits(Some(declared)),
                blocks.clone(),
                manifests.clone(),
                |_| {},
            )
            .await
            .unwrap_err();
            assert!(matches!(err, IngestError::LengthMismatch { .. }), "{err}");
        }
        assert!(
            manifests
                .get(BlobKey::of(&content))
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn failing_body_and_size_limit_store_no_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let content = data(1 << 20, 3);
        let mut pieces: Vec<Result<Bytes, std::io::Error>> = content
            .chunks(100_000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        pieces.push(Err(std::io::Error::other("client went away")));
        let err = ingest(
            futures_util::stream::iter(pieces),
            limits(None),
            blocks.clone(),
            manifests.clone(),
            |_| {},
        )
        .await
        .unwrap_err();
        assert!(matches!(err, IngestError::Body(_)), "{err}");

        let small = IngestLimits {
            max_size: 1000,
            ..limits(None)
        };
        let err = ingest(
            body_of(&content, 4096),
            small,
            blocks,
            manifests.clone(),
            |_| {},
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, IngestError::TooLarge { limit: 1000 }),
            "{err}"
        );
        assert!(
            manifests
                .get(BlobKey::of(&content))
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn parts_resumed_at_the_last_cut_give_the_one_shot_blocks_and_key() {
        // Checks TUS-2 at the pipeline: whatever the PATCH boundaries, the blocks of the
        // parts (each starting from the previous part's staged tail and saved chunker
        // state) are the cuts of one pass over the whole input, and the hasher carried
        // along gives the blob key. Checks CAS-14 with a PDF: the PDF-aware chunker is
        // selected from the first bytes (a first part of 1 byte leaves it undecided) and
        // resumed from its saved state.
        use crate::cas::pdf::select::MediaType;
        let dir = tempfile::tempdir().unwrap();
        let (blocks, _) = stores(dir.path());
        let random = data((2 << 20) + 4_321, 5);
        let pdf = small_pdf();
        let cases = [
            (&random, crate::cas::chunker::chunk_lengths(&random), false),
            (
                &pdf,
                crate::cas::pdf::chunk::chunk_lengths(&pdf, Default::default()).0,
                true,
            ),
        ];
        for (content, expected, is_pdf) in cases {
            for splits in [
                vec![1usize, 70_000, 70_001, 300_000],
                vec![3, 4, 5, 262_144, 290_000],
                vec![content.len() - 1],
            ] {
                let mut bounds = vec![0];
                bounds.extend(splits);
                bounds.push(content.len());
                let mut tail = Bytes::new();
                let mut chunker = SavedChunker::Undecided;
                let mut whole = blake3::Hasher::new();
                let mut lengths = Vec::new();
                let mut chunking = None;
                for pair in bounds.windows(2) {
                    let mut session = blocks.begin().unwrap();
                    let start = PartStart {
                        tail: std::mem::take(&mut tail),
                        chunker: std::mem::replace(&mut chunker, SavedChunker::Undecided),
                        offset: pair[0] as u64,
                        selection: selection(MediaType::Generic),
                        whole,
                        remaining: (content.len() - pair[0]) as u64,
                        keep_partial: false,
                    };
                    let part = ingest_part(
                        body_of(&content[pair[0]..pair[1]], 10_000),
                        limits(None),
                        start,
                        session.as_mut(),
                        |_| {},
                    )
                    .await
                    .unwrap();
                    session.commit().await.unwrap();
                    let bound = if is_pdf {
                        crate::cas::chunker::MAX_CHUNK + crate::cas::pdf::chunk::LOOKAHEAD
                    } else {
                        crate::cas::chunker::MAX_CHUNK
                    };
                    assert!(part.tail.len() < bound);
                    assert_eq!(part.complete, pair[1] == content.len());
                    // Undecided only while fewer bytes than the signature have arrived.
                    assert_eq!(part.chunking.is_none(), pair[1] < 5 && is_pdf);
                    lengths.extend(part.refs.iter().map(|r| r.size as usize));
                    tail = part.tail;
                    chunker = SavedChunker::decode(&part.chunker.encode(), pair[1] as u64).unwrap();
                    whole = part.whole;
                    chunking = part.chunking;
                }
                assert!(tail.is_empty());
                assert_eq!(lengths, expected);
                assert_eq!(matches!(chunking, Some(Chunking::Pdf(_))), is_pdf);
                assert_eq!(*whole.finalize().as_bytes(), BlobKey::of(content).hash);
            }
        }
    }

    #[tokio::test]
    async fn a_resumable_part_refuses_a_type_its_first_bytes_contradict() {
        // Checks CAS-12 on resumable parts: declared PDF without the signature, or
        // another type with it, is refused by the part that brings the first bytes, even
        // when an earlier part left the choice undecided; nothing is cut.
        use crate::cas::pdf::select::MediaType;
        let dir = tempfile::tempdir().unwrap();
        let (blocks, _) = stores(dir.path());
        let pdf = small_pdf();
        let png = data(400_000, 9);
        for (content, media, first, code) in [
            (&png, MediaType::Pdf, 0usize, "pdf_signature_missing"),
            (&pdf, MediaType::Other, 0, "pdf_type_mismatch"),
            (&pdf, MediaType::Other, 3, "pdf_type_mismatch"),
        ] {
            let mut tail = Bytes::new();
            let mut chunker = SavedChunker::Undecided;
            if first > 0 {
                let mut session = blocks.begin().unwrap();
                let start = PartStart {
                    tail: Bytes::new(),
                    chunker: SavedChunker::Undecided,
                    offset: 0,
                    selection: selection(media),
                    whole: blake3::Hasher::new(),
                    remaining: content.len() as u64,
                    keep_partial: false,
                };
                let part = ingest_part(
                    body_of(&content[..first], 1),
                    limits(None),
                    start,
                    session.as_mut(),
                    |_| {},
                )
                .await
                .unwrap();
                assert_eq!(part.chunker, SavedChunker::Undecided);
                assert!(part.refs.is_empty());
                tail = part.tail;
                chunker = part.chunker;
            }
            let mut session = blocks.begin().unwrap();
            let start = PartStart {
                tail,
                chunker,
                offset: first as u64,
                selection: selection(media),
                whole: blake3::Hasher::new(),
                remaining: (content.len() - first) as u64,
                keep_partial: true,
            };
            let err = ingest_part(
                body_of(&content[first..], 50_000),
                limits(None),
                start,
                session.as_mut(),
                |_| {},
            )
            .await
            .err()
            .unwrap();
            match err {
                IngestError::Pdf(refusal) => assert_eq!(refusal.code(), code),
                other => panic!("{other}"),
            }
        }
    }

    #[tokio::test]
    async fn a_broken_part_keeps_what_arrived_unless_a_checksum_was_declared() {
        let dir = tempfile::tempdir().unwrap();
        let (blocks, _) = stores(dir.path());
        let content = data(600_000, 6);
        let broken = || {
            let mut pieces: Vec<Result<Bytes, std::io::Error>> = content
                .chunks(100_000)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            pieces.push(Err(std::io::Error::other("connection reset")));
            futures_util::stream::iter(pieces)
        };
        let start = |keep_partial| PartStart {
            tail: Bytes::new(),
            chunker: SavedChunker::Undecided,
            offset: 0,
            selection: Selection::generic(),
            whole: blake3::Hasher::new(),
            remaining: 10 << 20,
            keep_partial,
        };
        let mut session = blocks.begin().unwrap();
        let part = ingest_part(
            broken(),
            limits(None),
            start(true),
            session.as_mut(),
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(part.received, content.len() as u64);
        assert!(matches!(part.interrupted, Some(IngestError::Body(_))));
        let kept: usize =
            part.refs.iter().map(|r| r.size as usize).sum::<usize>() + part.tail.len();
        assert_eq!(kept, content.len());
        let checked = IngestLimits {
            digest: Some(BodyDigest::Sha1([0; 20])),
            ..limits(None)
        };
        let mut session = blocks.begin().unwrap();
        let err = ingest_part(broken(), checked, start(true), session.as_mut(), |_| {})
            .await
            .err()
            .unwrap();
        assert!(matches!(err, IngestError::Body(_)), "{err}");
    }

    /// A small PDF: header, objects with large streams, xref, trailer, %%EOF.
    fn small_pdf() -> Vec<u8> {
        let mut out = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n".to_vec();
        for n in 0..4u8 {
            let body = data(100_000, n + 20);
            out.extend_from_slice(
                format!("{} 0 obj\n<< /Length {} >>\nstream\n", n + 1, body.len()).as_bytes(),
            );
            out.extend_from_slice(&body);
            out.extend_from_slice(b"\nendstream\nendobj\n");
        }
        out.extend_from_slice(
            b"xref\n0 1\n0000000000 65535 f \ntrailer\n<< /Size 5 >>\nstartxref\n0\n%%EOF\n",
        );
        out
    }

    fn selection(media: crate::cas::pdf::select::MediaType) -> Selection {
        Selection {
            declared: media,
            policy: crate::cas::pdf::PdfPolicy::default(),
        }
    }

    #[tokio::test]
    async fn a_pdf_body_is_cut_by_the_pdf_chunker_and_the_manifest_says_so() {
        // Checks CAS-12 (upgrade of an undeclared type) and CAS-11 at the pipeline.
        use crate::cas::pdf::select::MediaType;
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let content = small_pdf();
        for (media, piece) in [(MediaType::Generic, 7_777), (MediaType::Pdf, 100_000)] {
            let report = ingest_selected(
                body_of(&content, piece),
                limits(None),
                selection(media),
                blocks.clone(),
                manifests.clone(),
                None,
                |_| {},
            )
            .await
            .unwrap();
            assert_eq!(report.key, BlobKey::of(&content));
            assert!(matches!(report.chunking, Chunking::Pdf(_)));
            let manifest = manifests.get(report.key).await.unwrap().unwrap();
            assert_eq!(
                manifest.chunking.algorithm,
                crate::cas::pdf::select::PDF_ALGORITHM
            );
            let expected = crate::cas::pdf::chunk::chunk_lengths(&content, Default::default()).0;
            let got: Vec<usize> = manifest.blocks.iter().map(|b| b.size as usize).collect();
            assert_eq!(got, expected);
            assert!(report.pdf_cuts.unwrap().stream >= 8);
        }
        // A body that is not PDF, undeclared: FastCDC, as before.
        let other = data(1 << 20, 9);
        let report = ingest_selected(
            body_of(&other, 65_536),
            limits(None),
            selection(MediaType::Generic),
            blocks,
            manifests,
            None,
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(report.chunking, Chunking::FastCdc);
        assert_eq!(report.pdf_cuts, None);
    }

    #[tokio::test]
    async fn a_type_the_first_bytes_contradict_stores_nothing() {
        // Checks CAS-12: refused before the chunker sees a byte; no block, no manifest.
        use crate::cas::pdf::select::MediaType;
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let pdf = small_pdf();
        let png = data(500_000, 4);
        for (content, media, code) in [
            (&pdf, MediaType::Other, "pdf_type_mismatch"),
            (&png, MediaType::Pdf, "pdf_signature_missing"),
        ] {
            // One byte at a time first: the signature spans frames.
            for piece in [1, 100_000] {
                let err = ingest_selected(
                    body_of(&content[..content.len().min(300_000)], piece),
                    limits(None),
                    selection(media),
                    blocks.clone(),
                    manifests.clone(),
                    None,
                    |_| {},
                )
                .await
                .err()
                .unwrap();
                match err {
                    IngestError::Pdf(refusal) => assert_eq!(refusal.code(), code),
                    other => panic!("{other}"),
                }
            }
            assert!(manifests.get(BlobKey::of(content)).await.unwrap().is_none());
        }
        // Nothing was written: no pack file holds a block.
        let mut session = blocks.begin().unwrap();
        let probe = Bytes::from(pdf[..crate::cas::chunker::MIN_CHUNK].to_vec());
        let outcome = session
            .append_many(vec![(BlockKey::of(&probe), probe)])
            .await
            .unwrap();
        assert_eq!(outcome, vec![PutOutcome::Fresh]);
    }

    #[tokio::test]
    async fn a_truncated_pdf_is_stored_by_default_and_refused_when_strict() {
        // Checks CAS-13.
        use crate::cas::pdf::select::MediaType;
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let content = small_pdf();
        let truncated = &content[..250_000];
        let report = ingest_selected(
            body_of(truncated, 65_536),
            limits(None),
            selection(MediaType::Pdf),
            blocks.clone(),
            manifests.clone(),
            None,
            |_| {},
        )
        .await
        .unwrap();
        assert_eq!(report.key, BlobKey::of(truncated));
        let strict = Selection {
            policy: crate::cas::pdf::PdfPolicy {
                unsupported: UnsupportedPolicy::Reject,
                ..Default::default()
            },
            ..selection(MediaType::Pdf)
        };
        let shorter = &content[..240_000];
        let err = ingest_selected(
            body_of(shorter, 65_536),
            limits(None),
            strict,
            blocks,
            manifests.clone(),
            None,
            |_| {},
        )
        .await
        .err()
        .unwrap();
        assert!(
            matches!(err, IngestError::Pdf(SelectionError::Unsupported(_))),
            "{err}"
        );
        assert!(manifests.get(BlobKey::of(shorter)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn empty_body_is_a_valid_empty_blob() {
        let dir = tempfile::tempdir().unwrap();
        let (blocks, manifests) = stores(dir.path());
        let report = ingest(body_of(b"", 1), limits(Some(0)), blocks, manifests, |_| {})
            .await
            .unwrap();
        assert_eq!(report.key, BlobKey::of(b""));
        assert_eq!(report.blocks, 0);
    }
}
