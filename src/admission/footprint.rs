//! Transfer operations and the conservative byte footprint each one reserves.
//!
//! A footprint is an upper bound on the bytes a transfer can hold in memory at once. It is
//! reserved before the first byte is read, so it must be derived from configuration, not
//! from the request body. The formulas, with `C` the largest chunk the chunker emits:
//!
//! | operation | footprint | why |
//! |---|---|---|
//! | upload | `4 * C + 1 MiB` | one chunk being cut, one being hashed, two in flight to the block store, plus socket read buffers |
//! | download | `3 * C` | three blocks of ordered output (one sending, one read ahead, one being fetched) |
//! | forwarded upload | `2 MiB` | the forwarder only relays body frames; two 1 MiB frame windows in flight |
//!
//! Each is rounded up to whole KiB (the local budget's unit).

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
            Operation::Upload => chunk.saturating_mul(4).saturating_add(MIB),
            Operation::Download => chunk.saturating_mul(3),
            Operation::ForwardedUpload => 2 * MIB,
        };
        Self(NonZeroU64::new(bytes.div_ceil(1024).saturating_mul(1024)).expect("positive"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn documented_values_for_a_4_mib_chunker() {
        let chunk = 4 * MIB;
        assert_eq!(
            Footprint::for_operation(Operation::Upload, chunk).bytes(),
            17 * MIB
        );
        assert_eq!(
            Footprint::for_operation(Operation::Download, chunk).bytes(),
            12 * MIB
        );
        assert_eq!(
            Footprint::for_operation(Operation::ForwardedUpload, chunk).bytes(),
            2 * MIB
        );
        assert!(Footprint::new(0).is_none());
        assert_eq!(Footprint::new(1).unwrap().kib(), 1);
        assert_eq!(Footprint::new(1025).unwrap().kib(), 2);
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
