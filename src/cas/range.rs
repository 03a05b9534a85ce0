//! HTTP `Range` requests (one byte range) and the block slices that serve them.

use super::manifest::Manifest;

/// An inclusive byte range within a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    pub first: u64,
    pub last: u64,
}

impl ByteRange {
    pub fn len(&self) -> u64 {
        self.last - self.first + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// `bytes first-last/size` for `Content-Range`.
    pub fn content_range(&self, size: u64) -> String {
        format!("bytes {}-{}/{}", self.first, self.last, size)
    }
}

/// The outcome of reading a `Range` header against a blob of known size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeRequest {
    /// No usable range: serve the whole blob with 200 (also for a syntactically invalid or
    /// multi-range header, as RFC 9110 allows a server to ignore it).
    Full,
    /// Serve this range with 206.
    Partial(ByteRange),
    /// A well-formed range that lies outside the blob: 416.
    Unsatisfiable,
}

/// Interpret a `Range` header value for a blob of `size` bytes.
pub fn parse_range(header: Option<&str>, size: u64) -> RangeRequest {
    let Some(value) = header else {
        return RangeRequest::Full;
    };
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return RangeRequest::Full;
    };
    if spec.contains(',') {
        return RangeRequest::Full;
    }
    let Some((start, end)) = spec.trim().split_once('-') else {
        return RangeRequest::Full;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match (start.trim(), end.trim()) {
        (start, "") if digits(start) => {
            let Ok(first) = start.parse::<u64>() else {
                return RangeRequest::Unsatisfiable;
            };
            if first >= size {
                return RangeRequest::Unsatisfiable;
            }
            RangeRequest::Partial(ByteRange {
                first,
                last: size - 1,
            })
        }
        ("", suffix) if digits(suffix) => {
            let suffix: u64 = suffix.parse().unwrap_or(u64::MAX);
            if suffix == 0 || size == 0 {
                return RangeRequest::Unsatisfiable;
            }
            RangeRequest::Partial(ByteRange {
                first: size.saturating_sub(suffix),
                last: size - 1,
            })
        }
        (start, end) if digits(start) && digits(end) => {
            let (Ok(first), Ok(last)) = (start.parse::<u64>(), end.parse::<u64>()) else {
                return RangeRequest::Unsatisfiable;
            };
            if first > last {
                return RangeRequest::Full;
            }
            if first >= size {
                return RangeRequest::Unsatisfiable;
            }
            RangeRequest::Partial(ByteRange {
                first,
                last: last.min(size - 1),
            })
        }
        _ => RangeRequest::Full,
    }
}

/// A piece of one block: `block` is the index into the manifest's block list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSlice {
    pub block: usize,
    pub start: usize,
    pub end: usize,
}

/// The block slices, in order, that cover `range` of the blob described by `manifest`.
pub fn plan_slices(manifest: &Manifest, range: ByteRange) -> Vec<BlockSlice> {
    let offsets = manifest.offsets();
    let total = *offsets.last().unwrap_or(&0);
    if total == 0 || range.first >= total {
        return Vec::new();
    }
    let last = range.last.min(total - 1);
    // Index of the block holding byte `first`: the last offset <= first.
    let first_block = offsets.partition_point(|&o| o <= range.first) - 1;
    let mut slices = Vec::new();
    let mut block = first_block;
    while block < manifest.blocks.len() && offsets[block] <= last {
        let block_start = offsets[block];
        let block_end = offsets[block + 1]; // exclusive
        let start = range.first.max(block_start) - block_start;
        let end = (last + 1).min(block_end) - block_start;
        slices.push(BlockSlice {
            block,
            start: start as usize,
            end: end as usize,
        });
        block += 1;
    }
    slices
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cas::{BlobKey, BlockKey, BlockRef};
    use proptest::prelude::*;

    #[test]
    fn range_headers_parse_per_rfc9110() {
        let p = |h: &str| parse_range(Some(h), 100);
        assert_eq!(parse_range(None, 100), RangeRequest::Full);
        assert_eq!(
            p("bytes=0-9"),
            RangeRequest::Partial(ByteRange { first: 0, last: 9 })
        );
        assert_eq!(
            p("bytes=90-"),
            RangeRequest::Partial(ByteRange {
                first: 90,
                last: 99
            })
        );
        assert_eq!(
            p("bytes=-10"),
            RangeRequest::Partial(ByteRange {
                first: 90,
                last: 99
            })
        );
        assert_eq!(
            p("bytes=-1000"),
            RangeRequest::Partial(ByteRange { first: 0, last: 99 })
        );
        assert_eq!(
            p("bytes=50-1000"),
            RangeRequest::Partial(ByteRange {
                first: 50,
                last: 99
            })
        );
        assert_eq!(p("bytes=100-"), RangeRequest::Unsatisfiable);
        assert_eq!(p("bytes=100-200"), RangeRequest::Unsatisfiable);
        assert_eq!(p("bytes=-0"), RangeRequest::Unsatisfiable);
        assert_eq!(p("bytes=0-1,5-6"), RangeRequest::Full);
        assert_eq!(p("items=0-1"), RangeRequest::Full);
        assert_eq!(p("bytes=9-3"), RangeRequest::Full);
        assert_eq!(p("bytes=a-b"), RangeRequest::Full);
        assert_eq!(
            parse_range(Some("bytes=0-0"), 0),
            RangeRequest::Unsatisfiable
        );
    }

    fn manifest_with(sizes: &[u32]) -> Manifest {
        let blocks = sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| BlockRef {
                key: BlockKey([i as u8; 32]),
                size,
            })
            .collect();
        let total = sizes.iter().map(|&s| u64::from(s)).sum();
        Manifest::new(
            BlobKey {
                hash: [0; 32],
                size: total,
            },
            blocks,
            0,
        )
    }

    proptest! {
        #[test]
        fn slices_cover_exactly_the_range(
            sizes in proptest::collection::vec(1u32..50, 1..20),
            a in any::<u64>(),
            b in any::<u64>(),
        ) {
            let manifest = manifest_with(&sizes);
            let total = manifest.size();
            let (first, last) = (a % total, b % total);
            let (first, last) = (first.min(last), first.max(last));
            let slices = plan_slices(&manifest, ByteRange { first, last });
            let covered: u64 = slices.iter().map(|s| (s.end - s.start) as u64).sum();
            prop_assert_eq!(covered, last - first + 1);
            let offsets = manifest.offsets();
            prop_assert_eq!(offsets[slices[0].block] + slices[0].start as u64, first);
            let tail = slices.last().unwrap();
            prop_assert_eq!(offsets[tail.block] + tail.end as u64 - 1, last);
            for pair in slices.windows(2) {
                prop_assert_eq!(pair[1].block, pair[0].block + 1);
                prop_assert_eq!(pair[1].start, 0);
                prop_assert_eq!(pair[0].end as u32, sizes[pair[0].block]);
            }
        }
    }
}
