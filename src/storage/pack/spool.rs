//! How a pack's bytes reach its spool file: the one place that decides between buffered
//! and direct writes.
//!
//! - **Direct** (the local medium with fsync on, where the spool file becomes the pack and
//!   must reach the disk anyway): records are copied into one of two aligned stage
//!   buffers of [`STAGE`] bytes; a full stage is written with `O_DIRECT` by a helper
//!   thread while the writer fills the other, so the bytes skip the page cache: no copy
//!   into it, no dirty-page and extent bookkeeping, no write-back work on the writer's
//!   core. Buffered writes cost more CPU than the cut-point search on a 2-core VM
//!   (docs/performance.md, "Ingest"). The last partial stage is written with the
//!   aligned part direct and the rest buffered; the medium's `fdatasync` at publish
//!   covers both, so durability (STO-1) is unchanged.
//! - **Buffered** (S3 spools, which are read back for the PUT and then deleted; fsync
//!   off; file systems that refuse `O_DIRECT` at open): records are gathered and written
//!   with one vectored write per [`WRITE_BATCH`] blocks, never copied in user space; with
//!   fsync on, write-back is started every [`WRITEBACK_EVERY`] bytes so the seal's
//!   `fdatasync` has little left to do.
//!
//! Either way the file holds exactly the bytes appended, in order, once [`SpoolWriter::flush`]
//! or [`SpoolWriter::finish`] returns.

use std::fs::{File, OpenOptions};
use std::io::{IoSlice, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use bytes::Bytes;

use super::format::RECORD_HEADER;
use crate::storage::StoreError;

/// Blocks a buffered writer gathers before one vectored write.
pub const WRITE_BATCH: usize = 8;
/// Buffered with fsync on: start write-back of the file every this many bytes.
const WRITEBACK_EVERY: u64 = 8 << 20;
/// Alignment of direct writes (buffer address, file offset, length): the largest
/// logical block size in common use.
const ALIGN: usize = 4096;
/// Bytes of one direct write. Two stages, each allocated with `ALIGN` bytes of slack to
/// align it, take exactly 2 MiB.
pub const STAGE: usize = (1 << 20) - ALIGN;

/// Memory a spool writer holds beyond the blocks queued for it (for
/// `pipeline::ingest::memory_bound`): the blocks of one vectored write, or two stages.
pub const fn held_bytes(max_chunk: usize) -> usize {
    let buffered = WRITE_BATCH * max_chunk;
    let direct = 2 * (STAGE + ALIGN);
    if buffered > direct { buffered } else { direct }
}

/// The record header written before a block.
pub(crate) type Header = [u8; RECORD_HEADER as usize];

/// Writes the bytes of one spool file (see the module docs).
pub(crate) struct SpoolWriter {
    file: Arc<File>,
    /// Bytes appended so far.
    len: u64,
    mode: Mode,
}

enum Mode {
    Buffered(Buffered),
    Direct(Direct),
}

struct Buffered {
    /// Records appended but not written yet.
    pending: Vec<(Header, Bytes)>,
    /// Start write-back every `WRITEBACK_EVERY` bytes (fsync on).
    writeback: bool,
    /// Bytes written to the file (its position).
    written: u64,
    written_back: u64,
}

struct Direct {
    /// The stage being filled.
    stage: Stage,
    /// A stage not in use (allocated when a second one is first needed).
    spare: Option<Stage>,
    /// A stage is being written by the helper.
    in_flight: bool,
    io: Option<IoThread>,
    /// File offset of the stage being filled.
    offset: u64,
}

/// One aligned stage buffer.
struct Stage {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Stage {
    fn new() -> Self {
        // Safe alignment: allocate `ALIGN` bytes of slack and start at the first aligned
        // address inside.
        let buf = vec![0u8; STAGE + ALIGN];
        let start = buf.as_ptr().align_offset(ALIGN);
        Self { buf, start, len: 0 }
    }

    /// Copy as much of `data` as fits; returns how much.
    fn fill(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(STAGE - self.len);
        let at = self.start + self.len;
        self.buf[at..at + n].copy_from_slice(&data[..n]);
        self.len += n;
        n
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// The helper thread writing full stages, one at a time.
struct IoThread {
    submit: SyncSender<(Stage, u64)>,
    done: Receiver<(Stage, std::io::Result<()>)>,
    handle: JoinHandle<()>,
}

impl IoThread {
    fn start(file: Arc<File>) -> Result<Self, StoreError> {
        let (submit, work) = sync_channel::<(Stage, u64)>(1);
        let (report, done) = sync_channel(1);
        let handle = std::thread::Builder::new()
            .name("pack-write".into())
            .spawn(move || {
                while let Ok((stage, offset)) = work.recv() {
                    let result = file.write_all_at(stage.bytes(), offset);
                    if report.send((stage, result)).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| StoreError::io("start pack write thread", e))?;
        Ok(Self {
            submit,
            done,
            handle,
        })
    }
}

fn write_error(e: std::io::Error) -> StoreError {
    StoreError::io("write spool file", e)
}

fn stopped() -> StoreError {
    StoreError::Unavailable("pack write thread stopped".into())
}

impl SpoolWriter {
    /// Create the spool file at `path` (which must not exist). With `direct`, its bytes
    /// skip the page cache when the file system allows it; `writeback` starts write-back
    /// early on the buffered path (fsync on).
    pub fn create(path: &Path, direct: bool, writeback: bool) -> Result<Self, StoreError> {
        let create = |flags: i32| {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(flags)
                .open(path)
        };
        let buffered = || {
            Mode::Buffered(Buffered {
                pending: Vec::with_capacity(WRITE_BATCH),
                writeback,
                written: 0,
                written_back: 0,
            })
        };
        let direct_flag = if direct { DIRECT_FLAG } else { None };
        let (file, mode) = if let Some(flag) = direct_flag {
            match create(flag) {
                Ok(file) => (
                    file,
                    Mode::Direct(Direct {
                        stage: Stage::new(),
                        spare: None,
                        in_flight: false,
                        io: None,
                        offset: 0,
                    }),
                ),
                // The file system has no direct I/O (EINVAL at open): write buffered.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    let _ = std::fs::remove_file(path);
                    (create(0).map_err(create_error)?, buffered())
                }
                Err(e) => return Err(create_error(e)),
            }
        } else {
            (create(0).map_err(create_error)?, buffered())
        };
        Ok(Self {
            file: Arc::new(file),
            len: 0,
            mode,
        })
    }

    /// Whether the bytes go to the disk directly.
    #[cfg(test)]
    pub fn is_direct(&self) -> bool {
        matches!(self.mode, Mode::Direct(_))
    }

    /// Bytes appended so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Append one record (its header, then the block).
    pub fn append(&mut self, header: Header, data: Bytes) -> Result<(), StoreError> {
        self.len += RECORD_HEADER + data.len() as u64;
        match &mut self.mode {
            Mode::Buffered(b) => {
                b.pending.push((header, data));
                if b.pending.len() >= WRITE_BATCH {
                    b.write(&self.file, &[])?;
                }
                Ok(())
            }
            Mode::Direct(d) => {
                d.push(&self.file, &header)?;
                d.push(&self.file, &data)
            }
        }
    }

    /// Write everything appended so far; later appends are written buffered.
    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.flush_with(&[])
    }

    /// Append `tail` (the pack's footer), write everything and hand back the file.
    pub fn finish(mut self, tail: &[u8]) -> Result<File, StoreError> {
        self.flush_with(tail)?;
        Arc::try_unwrap(self.file)
            .map_err(|_| StoreError::Unavailable("spool file still shared".into()))
    }

    fn flush_with(&mut self, tail: &[u8]) -> Result<(), StoreError> {
        self.len += tail.len() as u64;
        match &mut self.mode {
            Mode::Buffered(b) => b.write(&self.file, tail),
            Mode::Direct(d) => {
                d.push(&self.file, tail)?;
                let written = d.drain(&self.file)?;
                // Buffered from here: the file's position follows the bytes written.
                (&*self.file)
                    .seek(SeekFrom::Start(written))
                    .map_err(write_error)?;
                self.mode = Mode::Buffered(Buffered {
                    pending: Vec::with_capacity(WRITE_BATCH),
                    writeback: false,
                    written,
                    written_back: written,
                });
                Ok(())
            }
        }
    }
}

impl Buffered {
    /// Write the pending records and `tail` with vectored writes.
    fn write(&mut self, file: &File, tail: &[u8]) -> Result<(), StoreError> {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * self.pending.len() + 1);
        for (header, data) in &self.pending {
            slices.push(IoSlice::new(header));
            slices.push(IoSlice::new(data));
        }
        if !tail.is_empty() {
            slices.push(IoSlice::new(tail));
        }
        let total: usize = slices.iter().map(|s| s.len()).sum();
        let mut rest = &mut slices[..];
        let mut out = file;
        while !rest.is_empty() {
            match out.write_vectored(rest) {
                Ok(0) => return Err(write_error(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(write_error(e)),
            }
        }
        drop(slices);
        self.pending.clear();
        self.written += total as u64;
        if self.writeback && self.written - self.written_back >= WRITEBACK_EVERY {
            start_writeback(file, self.written_back, self.written - self.written_back);
            self.written_back = self.written;
        }
        Ok(())
    }
}

impl Direct {
    /// Copy `data` into the stages, handing each full stage to the helper thread.
    fn push(&mut self, file: &Arc<File>, mut data: &[u8]) -> Result<(), StoreError> {
        while !data.is_empty() {
            let n = self.stage.fill(data);
            data = &data[n..];
            if self.stage.len == STAGE {
                self.submit(file)?;
            }
        }
        Ok(())
    }

    /// Hand the full stage to the helper and continue in the other one.
    fn submit(&mut self, file: &Arc<File>) -> Result<(), StoreError> {
        let next = if self.in_flight {
            self.collect()?
        } else {
            self.spare.take().unwrap_or_else(Stage::new)
        };
        let full = std::mem::replace(&mut self.stage, next);
        let io = match &mut self.io {
            Some(io) => io,
            None => self.io.insert(IoThread::start(file.clone())?),
        };
        io.submit.send((full, self.offset)).map_err(|_| stopped())?;
        self.in_flight = true;
        self.offset += STAGE as u64;
        Ok(())
    }

    /// Wait for the write in flight; returns its stage, emptied.
    fn collect(&mut self) -> Result<Stage, StoreError> {
        let io = self.io.as_ref().ok_or_else(stopped)?;
        let (mut stage, result) = io.done.recv().map_err(|_| stopped())?;
        self.in_flight = false;
        result.map_err(write_error)?;
        stage.len = 0;
        Ok(stage)
    }

    /// Write everything staged: wait for the helper, write the aligned part of the last
    /// stage directly and the rest (under `ALIGN` bytes) buffered. Returns the bytes in
    /// the file.
    fn drain(&mut self, file: &Arc<File>) -> Result<u64, StoreError> {
        if self.in_flight {
            self.spare = Some(self.collect()?);
        }
        if let Some(io) = self.io.take() {
            drop(io.submit);
            let _ = io.handle.join();
        }
        let bytes = self.stage.bytes();
        let aligned = bytes.len() / ALIGN * ALIGN;
        file.write_all_at(&bytes[..aligned], self.offset)
            .map_err(write_error)?;
        clear_direct(file).map_err(write_error)?;
        file.write_all_at(&bytes[aligned..], self.offset + aligned as u64)
            .map_err(write_error)?;
        Ok(self.offset + bytes.len() as u64)
    }
}

/// The open flag of direct I/O where the crate uses it (Linux); elsewhere every spool is
/// written buffered.
#[cfg(target_os = "linux")]
const DIRECT_FLAG: Option<i32> = Some(libc::O_DIRECT);
#[cfg(not(target_os = "linux"))]
const DIRECT_FLAG: Option<i32> = None;

/// Turn `O_DIRECT` off for an open file (its last bytes are not aligned).
#[cfg(target_os = "linux")]
fn clear_direct(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this process owns; F_GETFL/F_SETFL only read and set
    // its status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn clear_direct(_file: &File) -> std::io::Result<()> {
    Ok(())
}

fn create_error(e: std::io::Error) -> StoreError {
    StoreError::io("create spool file", e)
}

/// Ask the kernel to start writing a range back now (no wait): Linux only, best effort.
fn start_writeback(file: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor and a plain range; the call only schedules I/O.
        unsafe {
            libc::sync_file_range(
                file.as_raw_fd(),
                offset as libc::off64_t,
                len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A directory on the disk the crate is built on (the system temp dir may be tmpfs).
    fn disk_dir() -> tempfile::TempDir {
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        std::fs::create_dir_all(&target).unwrap();
        tempfile::tempdir_in(target).unwrap()
    }

    fn header(i: usize) -> Header {
        let mut h = [0u8; RECORD_HEADER as usize];
        h[..8].copy_from_slice(&(i as u64).to_le_bytes());
        h[8] = 0xAB;
        h
    }

    fn block(i: usize, len: usize) -> Bytes {
        Bytes::from((0..len).map(|j| (i * 31 + j * 7) as u8).collect::<Vec<_>>())
    }

    /// Append records of `sizes` (a flush after `flush_after` of them), finish with a
    /// footer; returns the expected bytes, the file's bytes and whether it was direct.
    fn round_trip(
        dir: &Path,
        direct: bool,
        sizes: &[usize],
        flush_after: Option<usize>,
    ) -> (Vec<u8>, Vec<u8>, bool) {
        let path = dir.join(format!("{}.spool", uuid::Uuid::new_v4().simple()));
        let mut writer = SpoolWriter::create(&path, direct, true).unwrap();
        let was_direct = writer.is_direct();
        let mut expected = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            if flush_after == Some(i) {
                writer.flush().unwrap();
                assert_eq!(std::fs::read(&path).unwrap(), expected, "flushed bytes");
            }
            let (h, b) = (header(i), block(i, len));
            expected.extend_from_slice(&h);
            expected.extend_from_slice(&b);
            writer.append(h, b).unwrap();
        }
        assert_eq!(writer.len(), expected.len() as u64);
        let footer = b"footer of odd length".to_vec();
        expected.extend_from_slice(&footer);
        let file = writer.finish(&footer).unwrap();
        file.sync_data().unwrap();
        drop(file);
        (expected, std::fs::read(&path).unwrap(), was_direct)
    }

    // Checks STO-22.
    #[test]
    fn direct_writes_hold_exactly_the_bytes_appended_across_many_stages() {
        let dir = disk_dir();
        // About 5 stages of blocks of awkward sizes: records straddle stage boundaries.
        let sizes: Vec<usize> = (0..40).map(|i| 100_000 + i * 3_001).collect();
        let (expected, written, direct) = round_trip(dir.path(), true, &sizes, None);
        assert!(
            direct,
            "the build directory's file system refused O_DIRECT; this test needs a disk"
        );
        assert!(expected.len() > 4 * STAGE);
        assert_eq!(written.len(), expected.len());
        assert!(written == expected, "direct spool bytes differ");
    }

    // Checks STO-22.
    #[test]
    fn a_flush_in_the_middle_switches_to_buffered_and_keeps_every_byte() {
        let dir = disk_dir();
        let sizes: Vec<usize> = (0..20).map(|i| 70_000 + i * 977).collect();
        let (expected, written, _) = round_trip(dir.path(), true, &sizes, Some(17));
        assert!(written == expected);
    }

    // Checks STO-22.
    #[test]
    fn a_small_direct_spool_is_written_by_the_unaligned_tail_alone() {
        let dir = disk_dir();
        let (expected, written, direct) = round_trip(dir.path(), true, &[10, 0, 3], None);
        assert!(direct);
        assert!(written == expected);
    }

    // Checks STO-22.
    #[test]
    fn the_memory_held_matches_the_buffered_batch_it_replaces() {
        // Two stages cost what WRITE_BATCH largest blocks cost, so the upload footprint
        // (admission) does not depend on the path taken.
        assert_eq!(
            held_bytes(crate::cas::MAX_CHUNK),
            WRITE_BATCH * crate::cas::MAX_CHUNK
        );
        assert_eq!(2 * (STAGE + ALIGN), WRITE_BATCH * crate::cas::MAX_CHUNK);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        // Checks STO-22.
        #[test]
        fn both_paths_write_the_same_bytes(
            sizes in proptest::collection::vec(0usize..300_000, 0..24),
            flush_at in proptest::option::of(0usize..24),
        ) {
            let dir = disk_dir();
            let flush_after = flush_at.filter(|&i| i < sizes.len());
            let (expected, direct_bytes, _) = round_trip(dir.path(), true, &sizes, flush_after);
            let (_, buffered_bytes, was_direct) =
                round_trip(dir.path(), false, &sizes, flush_after);
            prop_assert!(!was_direct);
            prop_assert!(direct_bytes == expected);
            prop_assert!(buffered_bytes == expected);
        }
    }
}
