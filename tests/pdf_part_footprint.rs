//! The admission footprint of a resumable (tus) PATCH covers the heap its pipeline really
//! holds, also for the last few bytes of an upload (ADM-14): a counting global allocator
//! measures `pipeline::ingest::ingest_part` resuming a PDF upload (the PDF-aware chunker
//! restored from its saved state over a staged tail) for its last bytes, against
//! [`Footprint::for_part`], the reservation `upload::resumable` takes for that PATCH.
//!
//! One test in this binary: the allocator counts every thread of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use graviton::admission::Footprint;
use graviton::cas::pdf::select::MediaType;
use graviton::cas::pdf::{PdfPolicy, SavedChunker, Selection};
use graviton::config::UploadConfig;
use graviton::pipeline::ingest::{IngestLimits, PartStart, ingest_part};
use graviton::storage::BlockStore;
use graviton::storage::pack::{PackOptions, PackStore};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now =
                LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst) + layout.size() as isize;
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A PDF with one large stream of incompressible data (a scanned page), so a part that
/// stops short of its end leaves a staged tail and a saved PDF-aware chunker.
fn pdf(stream: usize) -> Vec<u8> {
    let mut out = b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog >>\nendobj\n".to_vec();
    out.extend_from_slice(
        format!("2 0 obj\n<< /Subtype /Image /Filter /DCTDecode /Length {stream} >>\nstream\n")
            .as_bytes(),
    );
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    while out.len() < 100 + stream {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        out.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.extend_from_slice(b"\nendstream\nendobj\ntrailer\n<< /Root 1 0 R >>\n%%EOF\n");
    out
}

fn body(data: &[u8]) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Unpin {
    let frames: Vec<_> = data
        .chunks(64 << 10)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    futures_util::stream::iter(frames)
}

fn limits() -> IngestLimits {
    IngestLimits {
        max_size: 1 << 30,
        declared_size: None,
        idle_timeout: Duration::from_secs(60),
        digest: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_bytes_of_a_pdf_upload_reserve_what_their_pipeline_holds() {
    // Checks ADM-14: the reservation of a PATCH that carries the last 16 bytes of a PDF
    // upload is at least the live heap its pipeline reaches.
    let dir = tempfile::tempdir().unwrap();
    let options = PackOptions {
        pack_size: 1 << 20,
        fsync: false,
        trace: None,
    };
    let blocks: Arc<dyn BlockStore> = Arc::new(PackStore::open_local(dir.path(), options).unwrap());
    let content = pdf(3 << 20);
    let split = content.len() - 16;
    let selection = Selection {
        declared: MediaType::Pdf,
        policy: PdfPolicy::default(),
    };

    // The first PATCH: everything but the last 16 bytes.
    let mut session = blocks.begin().unwrap();
    let first = ingest_part(
        body(&content[..split]),
        limits(),
        PartStart {
            tail: Bytes::new(),
            chunker: SavedChunker::Undecided,
            offset: 0,
            selection,
            whole: blake3::Hasher::new(),
            remaining: content.len() as u64,
            keep_partial: false,
        },
        session.as_mut(),
        |_| {},
    )
    .await
    .unwrap();
    session.commit().await.unwrap();
    assert!(matches!(first.chunker, SavedChunker::Pdf(_)));
    assert!(!first.tail.is_empty());

    // The last PATCH, measured: what `upload::resumable` reserves for it, against the
    // peak live heap while it runs.
    let remaining = (content.len() - split) as u64;
    let cap = UploadConfig::default().resumable_part_footprint.bytes();
    let reserved = Footprint::for_part(cap, remaining).bytes();
    let baseline = LIVE.load(Ordering::SeqCst);
    PEAK.store(baseline, Ordering::SeqCst);
    let mut session = blocks.begin().unwrap();
    let last = ingest_part(
        body(&content[split..]),
        limits(),
        PartStart {
            tail: first.tail,
            chunker: first.chunker,
            offset: split as u64,
            selection,
            whole: first.whole,
            remaining,
            keep_partial: false,
        },
        session.as_mut(),
        |_| {},
    )
    .await
    .unwrap();
    let held = (PEAK.load(Ordering::SeqCst) - baseline).max(0) as u64;
    session.commit().await.unwrap();
    assert!(last.complete);
    assert_eq!(
        *last.whole.finalize().as_bytes(),
        *blake3::hash(&content).as_bytes()
    );
    println!("last PATCH of {remaining} B: peak heap +{held} B, reserved {reserved} B");
    assert!(
        held <= reserved,
        "the last PATCH held {held} B of heap but reserved {reserved} B"
    );
}
