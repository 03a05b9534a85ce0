//! The PDF-aware chunker's memory is bounded as stated (docs/admission.md, "Footprints";
//! `cas::pdf::chunk::EXTRA_MEMORY`, counted in every upload's admission footprint):
//!
//! * in this process, a counting allocator measures the peak heap the PDF-aware chunker
//!   holds while it cuts worst-case bodies (a window full of tiny objects, so its event
//!   queue is full; large streams whose `/Length` is indirect; a body that is no PDF),
//!   against FastCDC's `StreamChunker` on the same bodies in the same pieces: the
//!   difference stays within `EXTRA_MEMORY`, and both within their stated buffers; and
//!   the chunker's own heap beyond its buffer (the event queue, allocated at its bound,
//!   never grown), measured apart from the buffers, stays within `EXTRA_MEMORY` less
//!   the lookahead (which lives in the buffer);
//! * a real `graviton serve` process ingests a PDF of large image streams, generated
//!   while it is sent (several hundred MiB here; `GRAVITON_PDF_FOOTPRINT_MIB=1024` for
//!   the 1 GiB run), and its resident memory (`VmHWM` of `/proc/<pid>/status`, reset
//!   after warm-up) grows by no more than one upload's admission footprint plus the
//!   fixed overhead `tests/admission_footprint.rs` states; the blob downloads with the
//!   same BLAKE3.

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use graviton::admission::{Footprint, Operation};
use graviton::cas::MAX_CHUNK;
use graviton::cas::chunker::{BUFFER_CHUNKS, StreamChunker};
use graviton::cas::pdf::chunk::{EXTRA_MEMORY, LOOKAHEAD, MAX_EVENTS};
use graviton::cas::pdf::{PdfChunker, PdfSizes};
use graviton::pipeline::ingest::{BATCH_BYTES, MAX_BODY_FRAME};

/// Counts the live heap bytes allocated by each thread, and their peak since the last
/// [`reset_peak`] (per thread, so the chunking measured on the test's thread is not mixed
/// with other tests' allocations).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn add(delta: isize) {
    // `try_with`: a thread's allocations while its locals are torn down are not counted.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        add(-(layout.size() as isize));
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn reset_peak() -> isize {
    let live = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(live));
    live
}

/// Peak heap bytes this thread held above its baseline while `cut` ran.
fn peak_of(cut: impl FnOnce()) -> usize {
    let base = reset_peak();
    cut();
    (PEAK.with(Cell::get) - base) as usize
}

/// Deterministic pseudo-random bytes (xorshift64*), appended to `out`.
fn noise_into(out: &mut Vec<u8>, len: usize, state: &mut u64) {
    let end = out.len() + len;
    while out.len() < end {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        let word = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        let take = (end - out.len()).min(8);
        out.extend_from_slice(&word[..take]);
    }
}

/// Worst cases for the PDF-aware chunker's own memory.
fn bodies() -> Vec<(&'static str, Vec<u8>)> {
    let mut state = 27;
    // Tiny objects: about 20 bytes each, so a window of 272 KiB holds more events than
    // the queue keeps.
    let mut tiny = b"%PDF-1.7\n".to_vec();
    for n in 1..200_000u32 {
        tiny.extend_from_slice(format!("{n} 0 obj null endobj\n").as_bytes());
    }
    tiny.extend_from_slice(b"%%EOF\n");
    assert!(tiny.len() / 20 > 4 * MAX_EVENTS);
    // Large streams whose length is indirect: the scanner searches `endstream`.
    let mut streams = b"%PDF-1.7\n".to_vec();
    for n in 1..24u32 {
        streams.extend_from_slice(format!("{n} 0 obj << /Length 999 0 R >>\nstream\n").as_bytes());
        noise_into(&mut streams, 700_000 + n as usize * 1013, &mut state);
        streams.extend_from_slice(b"\nendstream\nendobj\n");
    }
    streams.extend_from_slice(b"%%EOF\n");
    let mut random = b"%PDF-".to_vec();
    noise_into(&mut random, 12 << 20, &mut state);
    vec![
        ("tiny objects", tiny),
        ("indirect lengths", streams),
        ("no PDF", random),
    ]
}

/// Push `data` in `BATCH_BYTES` pieces and drop every block as it is cut (the chunk
/// thread's loop, without the queues downstream).
fn cut_pdf(data: &[u8]) -> u64 {
    let mut chunker = PdfChunker::new(PdfSizes::default());
    let mut blocks = 0;
    for piece in data.chunks(BATCH_BYTES) {
        chunker.push(piece);
        while let Some(block) = chunker.next_chunk(false) {
            drop(block);
            blocks += 1;
        }
    }
    while chunker.next_chunk(true).is_some() {
        blocks += 1;
    }
    blocks
}

fn cut_fastcdc(data: &[u8]) -> u64 {
    let mut chunker = StreamChunker::new();
    let mut blocks = 0;
    for piece in data.chunks(BATCH_BYTES) {
        chunker.push(piece);
        while let Some(block) = chunker.next_chunk(false) {
            drop(block);
            blocks += 1;
        }
    }
    while chunker.next_chunk(true).is_some() {
        blocks += 1;
    }
    blocks
}

#[test]
fn the_pdf_chunker_holds_at_most_its_stated_extra_memory() {
    // Checks CAS-15: the PDF-aware chunker's memory beyond the generic chunker's is at
    // most `EXTRA_MEMORY`, measured on the heap, with its event queue full.
    let buffer = BUFFER_CHUNKS * MAX_CHUNK;
    for (name, data) in bodies() {
        let pdf = peak_of(|| {
            cut_pdf(&data);
        });
        let fast = peak_of(|| {
            cut_fastcdc(&data);
        });
        println!(
            "{name}: PDF-aware peak {pdf} B, FastCDC peak {fast} B, extra bound {EXTRA_MEMORY} B"
        );
        // Two chunker buffers at once (the fresh one filled from the old one), and the
        // small shared headers of the frozen blocks (`bytes::Bytes`).
        let slack = 4096;
        assert!(fast <= 2 * buffer + slack, "{name}: FastCDC held {fast} B");
        assert!(
            pdf <= fast + EXTRA_MEMORY,
            "{name}: the PDF-aware chunker held {pdf} B, FastCDC {fast} B, stated extra {EXTRA_MEMORY} B"
        );
        assert!(pdf <= 2 * buffer + slack + EXTRA_MEMORY, "{name}: {pdf} B");
    }
    // The chunker's own heap beyond its buffer (the event queue: the scanner and the
    // lookahead take none), measured apart from the buffers. The comparison above cannot
    // see a queue that grows by doubling instead of being allocated at its bound: the
    // growth (old and new allocation at once, 1.5 times the bound) happens while only one
    // buffer is held, below the two-buffer peak.
    for (name, data) in bodies() {
        let own = own_heap(&data);
        println!("{name}: PDF-aware chunker's own heap beyond its buffer {own} B");
        assert!(
            own <= EXTRA_MEMORY - LOOKAHEAD + 1024,
            "{name}: the PDF-aware chunker held {own} B beyond its buffer, stated {} B",
            EXTRA_MEMORY - LOOKAHEAD
        );
    }
    // The event queue was full in the tiny-objects body (its bound was reached).
    let mut chunker = PdfChunker::new(PdfSizes::default());
    chunker.push(&bodies()[0].1[..1 << 20]);
    while chunker.next_chunk(false).is_some() {}
    assert!(chunker.counts().dropped_events > 0);
}

/// The peak heap a PDF-aware chunker holds beyond its buffer while it cuts `data`: what
/// `new` allocates besides the buffer, plus the peak growth while it cuts `data` held in
/// one buffer (pushed whole, so the buffer is never replaced and every other allocation
/// is the chunker's own, or the small shared header of the frozen blocks).
fn own_heap(data: &[u8]) -> usize {
    let before = LIVE.with(Cell::get);
    let mut chunker = PdfChunker::new(PdfSizes::default());
    let at_start = (LIVE.with(Cell::get) - before) as usize - BUFFER_CHUNKS * MAX_CHUNK;
    chunker.push(data);
    let cutting = peak_of(|| {
        while chunker.next_chunk(false).is_some() {}
        while chunker.next_chunk(true).is_some() {}
    });
    at_start + cutting
}

const BIN: &str = env!("CARGO_BIN_EXE_graviton");

/// One `graviton serve` process on a free port, killed when dropped.
struct Serve {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Serve {
    async fn start(dir: &Path) -> Self {
        let port = support::free_port();
        let config = dir.join("graviton.toml");
        std::fs::write(
            &config,
            format!(
                "[node]\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace = \"1s\"\n\n\
                 [storage]\ndata_dir = \"{}\"\n",
                dir.join("data").display()
            ),
        )
        .unwrap();
        let log = dir.join("graviton.log");
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&config)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn graviton serve");
        let mut serve = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        let client = client();
        let ready = support::wait_until(Duration::from_secs(60), || {
            let exited = matches!(serve.child.try_wait(), Ok(Some(_)));
            let request = client.get(format!("{}/readyz", serve.url)).send();
            async move { exited || request.await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
        assert!(
            ready && !matches!(serve.child.try_wait(), Ok(Some(_))),
            "graviton serve did not get ready: {}",
            std::fs::read_to_string(&serve.log).unwrap_or_default()
        );
        serve
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        support::kill9(&mut self.child);
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// One `kB` field of `/proc/<pid>/status`, in bytes.
fn status_field(pid: u32, field: &str) -> u64 {
    let file = std::fs::File::open(format!("/proc/{pid}/status")).expect("proc status");
    for line in BufReader::new(file).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().unwrap();
            return kib * 1024;
        }
    }
    panic!("no {field} in /proc/{pid}/status");
}

/// The resident memory a loaded process may hold beyond its transfers' footprints, as
/// `tests/admission_footprint.rs` states it (docs/admission.md): 4 MiB of runtime, and
/// glibc's untrimmed free memory, up to two frame batches per arena, 8 arenas per core.
fn fixed_overhead() -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    (4 << 20) + 8 * cores * 2 * (BATCH_BYTES + MAX_BODY_FRAME) as u64
}

/// A PDF of `images` image XObjects of `image_bytes` each (incompressible, like JPEG
/// data), one page per image, with a correct cross-reference table; produced piece by
/// piece, so the test never holds it.
struct ImagePdf {
    images: usize,
    image_bytes: usize,
    next: usize,
    offset: u64,
    offsets: Vec<u64>,
    state: u64,
    done: bool,
}

impl ImagePdf {
    fn new(total: u64) -> Self {
        let image_bytes = 6 << 20;
        Self {
            images: total.div_ceil(image_bytes as u64).max(1) as usize,
            image_bytes,
            next: 0,
            offset: 0,
            offsets: Vec::new(),
            state: 0x9e37_79b9_7f4a_7c15,
            done: false,
        }
    }

    fn object(&mut self, out: &mut Vec<u8>, text: &str) {
        self.offsets.push(self.offset + out.len() as u64);
        out.extend_from_slice(text.as_bytes());
    }

    /// The next piece of the file (one image with its page, or the header, or the end).
    fn piece(&mut self) -> Option<Vec<u8>> {
        if self.done {
            return None;
        }
        let mut out = Vec::new();
        let pages = 2 + 2 * self.images;
        if self.next == 0 {
            out.extend_from_slice(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n");
            self.object(
                &mut out,
                "1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n",
            );
            let kids: Vec<String> = (0..self.images)
                .map(|i| format!("{} 0 R", 3 + 2 * i))
                .collect();
            self.object(
                &mut out,
                &format!(
                    "2 0 obj\n<< /Type /Pages /Count {} /Kids [{}] >>\nendobj\n",
                    self.images,
                    kids.join(" ")
                ),
            );
        }
        if self.next < self.images {
            let page = 3 + 2 * self.next;
            self.object(
                &mut out,
                &format!(
                    "{page} 0 obj\n<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] \
                     /Resources << /XObject << /Im{page} {} 0 R >> >> >>\nendobj\n",
                    page + 1
                ),
            );
            self.object(
                &mut out,
                &format!(
                    "{} 0 obj\n<< /Type /XObject /Subtype /Image /Width 2048 /Height 1024 \
                     /ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /DCTDecode /Length {} >>\nstream\n",
                    page + 1,
                    self.image_bytes
                ),
            );
            noise_into(&mut out, self.image_bytes, &mut self.state);
            out.extend_from_slice(b"\nendstream\nendobj\n");
            self.next += 1;
        } else {
            let xref = self.offset + out.len() as u64;
            out.extend_from_slice(
                format!("xref\n0 {}\n0000000000 65535 f \n", pages - 1).as_bytes(),
            );
            for at in &self.offsets {
                out.extend_from_slice(format!("{at:010} 00000 n \n").as_bytes());
            }
            out.extend_from_slice(
                format!(
                    "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
                    pages - 1
                )
                .as_bytes(),
            );
            self.done = true;
        }
        self.offset += out.len() as u64;
        Some(out)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_image_pdf_is_ingested_within_the_upload_footprint() {
    // Checks CAS-15 on a real process: the resident memory of `graviton serve` while it
    // ingests a PDF of hundreds of MiB of image streams (PDF-aware chunker) grows by no
    // more than one upload's admission footprint plus the fixed overhead, and the blob
    // is stored exactly.
    let mib: u64 = std::env::var("GRAVITON_PDF_FOOTPRINT_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(384);
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path()).await;
    let pid = serve.child.id();
    // Warm-up: a small PDF through the same path, so code pages and pools exist.
    let mut warm = Vec::new();
    let mut small = ImagePdf::new(1);
    small.image_bytes = 2 << 20;
    while let Some(piece) = small.piece() {
        warm.extend_from_slice(&piece);
    }
    let response = client()
        .post(format!("{}/v1/blobs", serve.url))
        .header("content-type", "application/pdf")
        .body(warm)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let idle = status_field(pid, "VmRSS");
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("reset VmHWM");

    // The body, generated while it is sent; its BLAKE3 on the side.
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(2);
    let generator = std::thread::spawn(move || {
        let mut pdf = ImagePdf::new(mib << 20);
        let mut hasher = blake3::Hasher::new();
        let mut len = 0u64;
        while let Some(piece) = pdf.piece() {
            for frame in piece.chunks(256 << 10) {
                hasher.update(frame);
                len += frame.len() as u64;
                if tx.blocking_send(frame.to_vec()).is_err() {
                    return (hasher.finalize(), len);
                }
            }
        }
        (hasher.finalize(), len)
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        let frame = rx.recv().await?;
        Some((Ok::<_, std::io::Error>(Bytes::from(frame)), rx))
    });
    let response = client()
        .post(format!("{}/v1/blobs", serve.url))
        .header("content-type", "application/pdf")
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .unwrap();
    let status = response.status();
    let receipt: serde_json::Value = response.json().await.unwrap();
    assert_eq!(status, 201, "{receipt}");
    let peak = status_field(pid, "VmHWM");
    let (hash, len) = generator.join().unwrap();
    assert!(len >= mib << 20);
    assert_eq!(receipt["chunker"], "pdf");
    let key = format!("blake3:{}:{len}", hash.to_hex());
    assert_eq!(receipt["key"], key.as_str());
    let grown = peak.saturating_sub(idle);
    let footprint = Footprint::for_operation(Operation::Upload, MAX_CHUNK as u64).bytes();
    let bound = footprint + fixed_overhead();
    println!(
        "{} MiB PDF: resident {} MiB idle, peak {} MiB (+{} KiB); bound +{} KiB (footprint {} KiB)",
        len >> 20,
        idle >> 20,
        peak >> 20,
        grown >> 10,
        bound >> 10,
        footprint >> 10
    );
    assert!(
        grown <= bound,
        "resident memory grew by {grown} B while ingesting {len} B; bound {bound} B"
    );
    // Stored exactly: the download hashes to the key.
    let response = client()
        .get(format!("{}/v1/blobs/{key}", serve.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut hasher = blake3::Hasher::new();
    let mut got = 0u64;
    let mut stream = response.bytes_stream();
    while let Some(frame) = stream.next().await {
        let frame = frame.unwrap();
        got += frame.len() as u64;
        hasher.update(&frame);
    }
    assert_eq!((got, hasher.finalize()), (len, hash));
}
