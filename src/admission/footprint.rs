//! Transfer operations and the conservative byte footprint each one reserves.
//!
//! A footprint is an upper bound on the bytes a transfer can hold in memory at once. It is
//! reserved before the first byte is read, so it must be derived from configuration, not
//! from the request body. The pipelines export their own bounds, computed from their queue
//! depths, and this module only adds fixed socket overhead, so the figure lives in one
//! place. With `C` the largest chunk the chunker emits:
//!
//! | operation | footprint | why |
//! |---|---|---|
//! | upload | `pipeline::ingest::memory_bound(C) + 1 MiB` | frame batches, chunker buffer, queued chunks and block writes in flight (see `pipeline::ingest`), plus socket read buffers |
//! | download | `pipeline::read::memory_bound(C)` | blocks read ahead by the store and its open responses on S3, blocks being checked, the block being sent, one in the body writer (see `pipeline::read`) |
//! | forwarded upload | `2 MiB` | the forwarder only relays body frames; two 1 MiB frame windows in flight |
//!
//! Each is rounded up to whole KiB (the local budget's unit).
//!
//! One PATCH of a resumable (tus) upload reserves [`Footprint::for_part`]:
//! `min(upload.resumable_part_footprint, remaining length)`, but never less than the
//! upload footprint above. The pipeline of a PATCH is an upload's pipeline (its chunker
//! buffer, the PDF-aware chunker's fixed extra, the staged tail it resumes from, frame
//! batches and socket buffers are there whatever few bytes are left), so a last PATCH of a
//! few bytes holds about as much as a one-shot upload of a few bytes, which reserves the
//! upload footprint too (ADM-14).
//!
//! Footprints bound anonymous memory (heap and stacks). An upload on S3 also keeps the
//! pack it is sealing mapped while its PUT is in flight (`storage::pack::s3`): file-backed,
//! reclaimable page cache, up to `pack_size` plus one block per upload, which resident-size
//! figures show and footprints do not count. `tests/admission_footprint.rs` measures both
//! in a real process (ADM-13; docs/admission.md, "Peak RSS").

use std::fmt;
use std::num::NonZeroU64;

use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;

/// What a transfer does; a bounded metric label and the `operation` event field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operation {
    Upload,
    Download,
    ForwardedUpload,
}

impl Operation {
    pub const ALL: [Operation; 3] = [
        Operation::Upload,
        Operation::Download,
        Operation::ForwardedUpload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Upload => "upload",
            Operation::Download => "download",
            Operation::ForwardedUpload => "forwarded_upload",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A positive number of bytes a transfer reserves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Footprint(NonZeroU64);

impl Footprint {
    /// `None` for zero.
    pub fn new(bytes: u64) -> Option<Self> {
        NonZeroU64::new(bytes).map(Self)
    }

    pub fn bytes(self) -> u64 {
        self.0.get()
    }

    /// Whole KiB, rounded up (the unit of the local semaphores).
    pub fn kib(self) -> u64 {
        self.0.get().div_ceil(1024)
    }

    /// The documented conservative footprint of `operation` for a chunker whose largest
    /// chunk is `max_chunk` bytes.
    pub fn for_operation(operation: Operation, max_chunk: u64) -> Self {
        let chunk = max_chunk.max(1);
        let bytes = match operation {
            Operation::Upload => upload_bound(chunk).saturating_add(MIB),
            Operation::Download => download_bound(chunk),
            Operation::ForwardedUpload => 2 * MIB,
        };
        Self(NonZeroU64::new(bytes.div_ceil(1024).saturating_mul(1024)).expect("positive"))
    }

    /// The footprint of one resumable (tus) PATCH with `remaining` bytes left until the
    /// upload's declared length, under the configured cap `limit`
    /// (`upload.resumable_part_footprint`): `min(limit, remaining)`, raised to the upload
    /// footprint of the generic chunker's largest block (see the module docs).
    pub fn for_part(limit: u64, remaining: u64) -> Self {
        let pipeline =
            Self::for_operation(Operation::Upload, crate::cas::chunker::MAX_CHUNK as u64);
        let staged = limit.min(remaining).div_ceil(1024).saturating_mul(1024);
        Self(NonZeroU64::new(staged.max(pipeline.bytes())).expect("positive"))
    }
}

fn as_usize(chunk: u64) -> usize {
    usize::try_from(chunk).unwrap_or(usize::MAX)
}

/// The ingest pipeline's bound (saturating for absurd chunk sizes).
fn upload_bound(chunk: u64) -> u64 {
    let chunk = as_usize(chunk.min(1 << 40));
    crate::pipeline::ingest::memory_bound(chunk) as u64
}

/// The read pipeline's bound.
fn download_bound(chunk: u64) -> u64 {
    let chunk = as_usize(chunk.min(1 << 40));
    crate::pipeline::read::memory_bound(chunk) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn footprints_cover_the_pipelines_own_bounds() {
        // The footprint adds to the pipelines' exported bounds and pins the documented
        // figures (docs/admission.md). That the bounds hold for the real pipeline is
        // measured, not restated: ADM-4's evidence is
        // `admission_footprint::a_full_ingest_pipeline_holds_no_more_heap_than_the_upload_footprint`.
        let chunk = crate::cas::chunker::MAX_CHUNK as u64;
        let upload = Footprint::for_operation(Operation::Upload, chunk).bytes();
        assert!(upload >= crate::pipeline::ingest::MEMORY_BOUND as u64 + MIB);
        let download = Footprint::for_operation(Operation::Download, chunk).bytes();
        assert!(download >= crate::pipeline::read::memory_bound(chunk as usize) as u64);
        // The 256 KiB chunker: 6 x (256 + 416) KiB + 33 x 256 KiB + the PDF chunker's
        // extra (any upload may be selected for it) + 1 MiB, rounded up to KiB.
        let pdf = crate::cas::pdf::chunk::EXTRA_MEMORY as u64;
        assert_eq!(
            upload,
            ((6 * (256 + 416) + 33 * 256 + 1024) * 1024 + pdf).div_ceil(1024) * 1024
        );
        // 8 x 256 KiB of blocks + 3 x 416 KiB response buffers of a remote medium's reads.
        assert_eq!(download, (8 * 256 + 3 * 416) * 1024);
    }

    #[test]
    fn documented_values_for_a_4_mib_chunker() {
        let chunk = 4 * MIB;
        let pdf = crate::cas::pdf::chunk::EXTRA_MEMORY as u64;
        assert_eq!(
            Footprint::for_operation(Operation::Upload, chunk).bytes(),
            ((6 * (256 + 416) * 1024) + 33 * chunk + MIB + pdf).div_ceil(1024) * 1024
        );
        assert_eq!(
            Footprint::for_operation(Operation::Download, chunk).bytes(),
            8 * chunk + 3 * 416 * 1024
        );
        assert_eq!(
            Footprint::for_operation(Operation::ForwardedUpload, chunk).bytes(),
            2 * MIB
        );
        assert!(Footprint::new(0).is_none());
        assert_eq!(Footprint::new(1).unwrap().kib(), 1);
        assert_eq!(Footprint::new(1025).unwrap().kib(), 2);
    }

    #[test]
    fn a_part_reserves_its_cap_but_never_less_than_the_upload_footprint() {
        // Checks ADM-14 (the formula; `pdf_part_footprint` measures the pipeline).
        let upload =
            Footprint::for_operation(Operation::Upload, crate::cas::chunker::MAX_CHUNK as u64);
        let cap = 128 * MIB;
        assert_eq!(Footprint::for_part(cap, 1 << 40).bytes(), cap);
        assert_eq!(
            Footprint::for_part(cap, 100 * MIB + 1).bytes(),
            100 * MIB + 1024
        );
        for remaining in [0, 1, 10, MIB, upload.bytes()] {
            assert_eq!(Footprint::for_part(cap, remaining), upload, "{remaining}");
        }
        // A cap below the pipeline's bound cannot make a part reserve less than it holds.
        assert_eq!(Footprint::for_part(MIB, 1 << 40), upload);
    }

    proptest! {
        #[test]
        fn footprints_are_whole_kib_and_cover_the_chunks(chunk in 1u64..(1 << 40)) {
            for op in Operation::ALL {
                let f = Footprint::for_operation(op, chunk);
                prop_assert_eq!(f.bytes() % 1024, 0);
                if op != Operation::ForwardedUpload {
                    prop_assert!(f.bytes() >= 3 * chunk);
                }
            }
        }
    }
}
