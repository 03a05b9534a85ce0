//! The PDF-aware chunker: block boundaries at PDF object boundaries, with stream data
//! in blocks of its own, behind the same contract as [`StreamChunker`]
//! (`push`, `next_chunk`, `take_rest`, `buffered`).
//!
//! Cut rules, for a block starting at `s` (CAS-11):
//! 1. Inside the data of a *large* stream (data of at least `min` bytes, see below): the
//!    cut points are FastCDC's (the pinned parameters of `cas::chunker`) over the stream
//!    data alone, restarted at the data's first byte, and the data's end is always a cut.
//!    Unchanged bytes of a page, image or font stream therefore give the same blocks
//!    whatever precedes the stream (renumbered objects, a page inserted before it).
//! 2. Otherwise the first of, within `(s, s + max]`:
//!    - the end of a revision (after `%%EOF`), at any distance: an incremental update
//!      appended there leaves the previous revision's blocks unchanged;
//!    - an object boundary (`N G obj`, `xref`) at or after `s + target`;
//!    - the first data byte of a large stream (the object's header and dictionary stay in
//!      the block before it, which can then be below `min`: with the end of a revision,
//!      the only cuts allowed below `min`, and the reason stream data deduplicates across
//!      rewrites).
//! 3. No such place: a FastCDC cut of `s .. s + max` (an object larger than `max`, or a
//!    run of small objects with no boundary past the target), counted as a fallback.
//!
//! A stream is large when its end (`StreamEnd`) is at least `min` bytes after its start,
//! or is not found within `min` bytes.
//!
//! Determinism (CAS-10): a decision is made only when `max + LOOKAHEAD` bytes past `s` are
//! buffered (or the body ended), and the scanner has then consumed exactly the bytes up to
//! `s + max + LOOKAHEAD` (it is fed lazily, never further). Each decision is therefore a
//! function of the body's bytes alone, whatever the transport pieces.
//! The decisions are a `Cutter`'s, over a slice that starts at the block start: the
//! chunker's buffer, or a whole body held in memory ([`chunk_lengths`], which so cuts with
//! no copy of the body, like FastCDC's `chunker::chunk_lengths`).
//!
//! Memory (stated, counted by `pipeline::ingest::memory_bound`): the buffer holds less than
//! `max + LOOKAHEAD` bytes between calls, plus the piece being pushed, in buffers of
//! `chunker::BUFFER_CHUNKS` largest blocks like [`StreamChunker`]; the event queue holds
//! at most [`MAX_EVENTS`] events of 16 bytes, allocated at that size up front (further
//! events in the window are dropped, deterministically, and counted); the scanner is a
//! fixed-size struct. `tests/pdf_footprint.rs` measures it. Hence
//! [`EXTRA_MEMORY`] on top of the generic chunker.
//!
//! [`StreamChunker`]: crate::cas::chunker::StreamChunker

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::scan::{
    Event, SCANNER_STATE_LEN, Scanner, StateError, StateReader, StateWriter, Unsupported,
};
use crate::cas::chunker::{self, BUFFER_CHUNKS, MAX_CHUNK, MIN_CHUNK};

/// Bytes past the window the scanner must have read before a cut is decided: a large
/// stream starting at the window's end is recognised `min` bytes later, and the end of
/// data at the window's end is reported once its `endstream` (at most 2 + 9 bytes on) is
/// read.
pub const LOOKAHEAD: usize = MIN_CHUNK + 16;
/// Events kept for the window at most.
pub const MAX_EVENTS: usize = 8192;
/// Memory of a PDF-aware ingest beyond the generic chunker's: the lookahead, the event
/// queue and the scanner.
pub const EXTRA_MEMORY: usize =
    LOOKAHEAD + MAX_EVENTS * std::mem::size_of::<Event>() + std::mem::size_of::<Scanner>();

/// Block sizes of the PDF-aware chunker (`[ingest.pdf]`), validated by [`Self::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdfSizes {
    pub min: usize,
    pub target: usize,
    pub max: usize,
}

impl Default for PdfSizes {
    fn default() -> Self {
        Self {
            min: MIN_CHUNK,
            target: chunker::AVG_CHUNK,
            max: MAX_CHUNK,
        }
    }
}

impl PdfSizes {
    /// `min` is FastCDC's minimum (16 KiB); `target` in `[min, max]`; `max` in
    /// `[min, 256 KiB]` (the largest block of the generic chunker, which every memory
    /// bound and block size limit assumes).
    pub fn new(target: usize, max: usize) -> Result<Self, String> {
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&max) {
            return Err(format!(
                "max must be between {MIN_CHUNK} and {MAX_CHUNK} bytes, not {max}"
            ));
        }
        if !(MIN_CHUNK..=max).contains(&target) {
            return Err(format!(
                "target must be between {MIN_CHUNK} and max ({max}) bytes, not {target}"
            ));
        }
        Ok(Self {
            min: MIN_CHUNK,
            target,
            max,
        })
    }
}

/// How each cut was chosen (metrics, benchmark).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutCounts {
    /// At an object boundary at or after the target.
    pub boundary: u64,
    /// At the start or end of a large stream's data, or FastCDC inside it.
    pub stream: u64,
    /// FastCDC outside stream data (no boundary in the window).
    pub fallback: u64,
    /// Events dropped because the window held more than [`MAX_EVENTS`].
    pub dropped_events: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Region {
    Normal,
    /// The block starts inside a large stream's data.
    InData,
}

/// The PDF-aware chunker (see the module docs): a buffer, and the [`Cutter`] that
/// decides each cut over it.
#[derive(Debug)]
pub struct PdfChunker {
    buffer: BytesMut,
    cutter: Cutter,
}

/// Everything that decides the cuts, over a slice that starts at the block start: the
/// buffer of a [`PdfChunker`], or a whole body held in memory ([`chunk_lengths`], which
/// then cuts with no copy of the body).
#[derive(Debug)]
struct Cutter {
    sizes: PdfSizes,
    /// Offset of the slice's first byte in the body.
    start: u64,
    scanner: Scanner,
    events: VecDeque<Event>,
    region: Region,
    counts: CutCounts,
    finished: bool,
}

const BUFFER_CAPACITY: usize = BUFFER_CHUNKS * MAX_CHUNK;

impl PdfChunker {
    pub fn new(sizes: PdfSizes) -> Self {
        Self {
            buffer: BytesMut::with_capacity(BUFFER_CAPACITY),
            cutter: Cutter::new(sizes),
        }
    }

    /// Append the next piece of input.
    pub fn push(&mut self, data: &[u8]) {
        if self.buffer.capacity() - self.buffer.len() < data.len() {
            // As `StreamChunker::push`: a fresh buffer holding the bytes not cut yet.
            let mut fresh =
                BytesMut::with_capacity(BUFFER_CAPACITY.max(self.buffer.len() + data.len()));
            fresh.extend_from_slice(&self.buffer);
            self.buffer = fresh;
        }
        self.buffer.extend_from_slice(data);
    }

    /// Bytes buffered but not cut yet.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// How the cuts so far were chosen.
    pub fn counts(&self) -> CutCounts {
        self.cutter.counts
    }

    /// The first unsupported structure the scanner saw (complete after the last
    /// `next_chunk(true)`).
    pub fn unsupported(&self) -> Option<Unsupported> {
        self.cutter.scanner.unsupported()
    }

    /// The next block, if its cut is decided. With `eof`, the rest is cut as the end.
    pub fn next_chunk(&mut self, eof: bool) -> Option<Bytes> {
        let len = self.cutter.next_cut(&self.buffer, eof)?;
        Some(self.buffer.split_to(len).freeze())
    }

    /// Take the bytes not cut yet (the chunker's state is then spent).
    pub fn take_rest(&mut self) -> Bytes {
        self.buffer.split().freeze()
    }
}

impl Cutter {
    fn new(sizes: PdfSizes) -> Self {
        Self {
            sizes,
            start: 0,
            scanner: Scanner::new(),
            // At its bound from the start: a queue that grew by doubling would hold the old
            // and the new allocation at once (1.5 times the bound) while it copies.
            events: VecDeque::with_capacity(MAX_EVENTS),
            region: Region::Normal,
            counts: CutCounts::default(),
            finished: false,
        }
    }

    /// Bytes the chunker must hold past a block start before it decides the cut.
    fn horizon(&self) -> usize {
        self.sizes.max + LOOKAHEAD
    }

    /// Feed the scanner up to `limit` bytes of `buf` (which starts at the block start).
    fn scan_to(&mut self, buf: &[u8], limit: usize) {
        let scanned = (self.scanner.position() - self.start) as usize;
        if scanned >= limit {
            return;
        }
        let events = &mut self.events;
        let dropped = &mut self.counts.dropped_events;
        self.scanner.feed(&buf[scanned..limit], &mut |e| {
            if events.len() < MAX_EVENTS {
                events.push_back(e);
            } else {
                *dropped += 1;
            }
        });
    }

    /// Is the stream whose data starts at `p` (the event at `index`) large?
    fn large(&self, index: usize, p: u64) -> bool {
        match self.events.get(index + 1) {
            Some(Event::StreamEnd(q)) => q.saturating_sub(p) >= self.sizes.min as u64,
            Some(_) => false,
            None => self.scanner.position() >= p + self.sizes.min as u64,
        }
    }

    /// The length of the next block at the start of `buf` (every byte not cut yet, or, for
    /// an in-memory body, all the rest of it), if its cut is decided, and the state moved
    /// past it. With `eof`, `buf` ends where the body does.
    fn next_cut(&mut self, buf: &[u8], eof: bool) -> Option<usize> {
        let avail = buf.len();
        let horizon = self.horizon();
        if avail == 0 || (!eof && avail < horizon) {
            return None;
        }
        let last_window = avail < horizon;
        self.scan_to(buf, avail.min(horizon));
        if last_window && !self.finished {
            self.finished = true;
            self.scanner.finish();
        }
        let s = self.start;
        let window = avail.min(self.sizes.max);
        let window_end = s + window as u64;
        if self.region == Region::InData {
            let end = self.events.iter().find_map(|e| match e {
                Event::StreamEnd(q) if *q > s => Some(*q),
                _ => None,
            });
            let lost = end.is_none()
                && self
                    .events
                    .iter()
                    .any(|e| !matches!(e, Event::StreamEnd(_)));
            if lost {
                // The stream's end event was dropped (a window of more than MAX_EVENTS
                // events): continue as outside stream data.
                self.region = Region::Normal;
            } else {
                let len = match end {
                    Some(q) if q <= window_end => (q - s) as usize,
                    _ => window,
                };
                let cut = chunker::first_cut(&buf[..len]);
                if end == Some(s + cut as u64) {
                    self.region = Region::Normal;
                }
                self.counts.stream += 1;
                return Some(self.advance(cut, avail));
            }
        }
        let target = s + self.sizes.target as u64;
        let mut found = None;
        for (index, event) in self.events.iter().enumerate() {
            match *event {
                Event::Boundary(b) | Event::Revision(b) | Event::StreamStart(b)
                    if b > window_end =>
                {
                    break;
                }
                // The end of a revision is always a cut, even below `min`: an incremental
                // update then leaves every block of the revision before it as it was.
                Event::Revision(r) if r > s => {
                    found = Some((r, false));
                    break;
                }
                Event::Boundary(b) if b >= target && b > s => {
                    found = Some((b, false));
                    break;
                }
                Event::StreamStart(p) if p > s && self.large(index, p) => {
                    found = Some((p, true));
                    break;
                }
                _ => {}
            }
        }
        let cut = match found {
            Some((at, true)) => {
                self.counts.stream += 1;
                self.region = Region::InData;
                (at - s) as usize
            }
            Some((at, false)) => {
                self.counts.boundary += 1;
                (at - s) as usize
            }
            // The last block of the body.
            None if last_window && avail <= self.sizes.max => avail,
            None => {
                self.counts.fallback += 1;
                chunker::first_cut(&buf[..window])
            }
        };
        Some(self.advance(cut, avail))
    }

    /// Move the block start `len` bytes on (at least 1, at most `avail`) and drop the
    /// events those bytes covered; returns the length cut.
    fn advance(&mut self, len: usize, avail: usize) -> usize {
        let len = len.clamp(1, avail);
        self.start += len as u64;
        let start = self.start;
        while let Some(e) = self.events.front() {
            let at = match *e {
                Event::Boundary(at)
                | Event::Revision(at)
                | Event::StreamStart(at)
                | Event::StreamEnd(at) => at,
            };
            if at > start {
                break;
            }
            self.events.pop_front();
        }
        len
    }
}

/// Block lengths of a complete in-memory body (tests and the benchmark): the cuts a
/// [`PdfChunker`] makes for the body in any pieces (CAS-10), decided over the body itself
/// rather than a copy of it in a chunker buffer.
pub fn chunk_lengths(data: &[u8], sizes: PdfSizes) -> (Vec<usize>, CutCounts) {
    let mut cutter = Cutter::new(sizes);
    let mut lengths = Vec::new();
    let mut at = 0;
    // As `next_chunk(false)` until fewer than `max + LOOKAHEAD` bytes are left, then
    // `next_chunk(true)`; a cut never depends on bytes past the horizon, so the slice may
    // run to the body's end.
    while let Some(len) = cutter.next_cut(&data[at..], data.len() - at < cutter.horizon()) {
        lengths.push(len);
        at += len;
    }
    (lengths, cutter.counts)
}
/// Version tag of a saved [`PdfChunker`] state.
const STATE_VERSION: u8 = 1;
/// Bytes of one saved event.
const EVENT_STATE_LEN: usize = 9;
/// The largest saved state (see [`PdfChunker::save`]): bounded by the event queue.
pub const MAX_STATE_LEN: usize =
    1 + 8 + 8 + 1 + 1 + 4 * 8 + SCANNER_STATE_LEN + 4 + MAX_EVENTS * EVENT_STATE_LEN;

impl PdfChunker {
    /// The chunker's whole state except its buffer (the staged tail, which the caller
    /// keeps), for the next part of a resumable upload: sizes, the block start, the
    /// scanner, the queued events, the region and the cut counts. At most
    /// [`MAX_STATE_LEN`] bytes (about 72 KiB with a full event queue; a few hundred
    /// bytes for ordinary PDFs).
    pub fn save(&self) -> Vec<u8> {
        let mut w = StateWriter(Vec::with_capacity(
            64 + SCANNER_STATE_LEN + self.cutter.events.len() * EVENT_STATE_LEN,
        ));
        w.u8(STATE_VERSION);
        w.u64(self.cutter.sizes.target as u64);
        w.u64(self.cutter.sizes.max as u64);
        w.u8(match self.cutter.region {
            Region::Normal => 0,
            Region::InData => 1,
        });
        w.bool(self.cutter.finished);
        w.u64(self.cutter.start);
        w.u64(self.cutter.counts.boundary);
        w.u64(self.cutter.counts.stream);
        w.u64(self.cutter.counts.fallback);
        w.u64(self.cutter.counts.dropped_events);
        self.cutter.scanner.save(&mut w);
        w.u32(self.cutter.events.len() as u32);
        for event in &self.cutter.events {
            let (tag, at) = match *event {
                Event::Boundary(at) => (0, at),
                Event::Revision(at) => (1, at),
                Event::StreamStart(at) => (2, at),
                Event::StreamEnd(at) => (3, at),
            };
            w.u8(tag);
            w.u64(at);
        }
        w.0
    }

    /// A chunker in exactly the state [`Self::save`] saved, with `tail` (the bytes it
    /// had not cut, which end at body offset `offset`) in its buffer: fed the same
    /// following bytes, it cuts exactly where the saved chunker would have (CAS-14).
    /// A state that does not fit the tail and offset is an error.
    pub fn restore(state: &[u8], tail: &[u8], offset: u64) -> Result<Self, StateError> {
        if state.len() > MAX_STATE_LEN {
            return Err(StateError("too long"));
        }
        let mut r = StateReader(state);
        if r.u8()? != STATE_VERSION {
            return Err(StateError("unknown version"));
        }
        let target = usize::try_from(r.u64()?).map_err(|_| StateError("sizes"))?;
        let max = usize::try_from(r.u64()?).map_err(|_| StateError("sizes"))?;
        let sizes = PdfSizes::new(target, max).map_err(|_| StateError("sizes"))?;
        let region = match r.u8()? {
            0 => Region::Normal,
            1 => Region::InData,
            _ => return Err(StateError("region")),
        };
        let finished = r.bool()?;
        let start = r.u64()?;
        let counts = CutCounts {
            boundary: r.u64()?,
            stream: r.u64()?,
            fallback: r.u64()?,
            dropped_events: r.u64()?,
        };
        let scanner = Scanner::restore(&mut r)?;
        let n = r.u32()? as usize;
        if n > MAX_EVENTS {
            return Err(StateError("too many events"));
        }
        let mut chunker = Self::new(sizes);
        for _ in 0..n {
            let tag = r.u8()?;
            let at = r.u64()?;
            chunker.cutter.events.push_back(match tag {
                0 => Event::Boundary(at),
                1 => Event::Revision(at),
                2 => Event::StreamStart(at),
                3 => Event::StreamEnd(at),
                _ => return Err(StateError("event")),
            });
        }
        r.end()?;
        // The tail is the buffer: it starts at the block start and ends at `offset`, and
        // the scanner has read some of it, never past it.
        if start.checked_add(tail.len() as u64) != Some(offset)
            || scanner.position() < start
            || scanner.position() > offset
            || tail.len() >= sizes.max + LOOKAHEAD
        {
            return Err(StateError("does not fit the staged tail"));
        }
        chunker.push(tail);
        chunker.cutter.start = start;
        chunker.cutter.scanner = scanner;
        chunker.cutter.region = region;
        chunker.cutter.counts = counts;
        chunker.cutter.finished = finished;
        Ok(chunker)
    }

    /// The sizes this chunker cuts with.
    pub fn sizes(&self) -> PdfSizes {
        self.cutter.sizes
    }
}
