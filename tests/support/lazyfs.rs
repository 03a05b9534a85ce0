//! A LazyFS-style filesystem for power-loss tests: an in-memory FUSE filesystem served by
//! the test process itself (crate `fuser`), mounted on a fresh temporary directory.
//!
//! Like LazyFS (<https://github.com/dsrhaslab/lazyfs>), it caches file *data*. Every
//! regular file has two copies of its bytes:
//!
//! * `current`: what reads see. `write`, a size change through `setattr` (truncate,
//!   `set_len`) and `fallocate` change only this copy;
//! * `durable`: what survives a power loss. `fsync` and `fdatasync` of the file set it to
//!   `current`.
//!
//! Directories keep two copies of their entries in the same way (LazyFS does not; this
//! layer is stricter): a create, mknod, mkdir, rename, link, unlink or rmdir changes what
//! lookups see at once, and an fsync of the directory (`fsyncdir`) makes its entries as
//! they are then durable. A file's own fsync does not make its name durable (POSIX
//! leaves that to the directory's fsync). An unlinked file or removed directory that a
//! durable entry still names is kept until that entry goes.
//!
//! [`LazyFs::crash`] sets every file's `current` to its `durable` copy and every
//! directory's entries to its durable entries: every write not followed by an fsync of
//! that file is dropped, and so is every size change, every name made or removed since
//! its directory's last fsync, and every file and directory no durable name reaches any
//! more. Call it while no process uses the mount (after `kill -9`). A kill alone cannot
//! catch a missing sync (the page cache outlives the process); this can.
//! [`LazyFs::unsynced_names`] lists beforehand what a crash would do to names.
//!
//! Every open is answered with direct I/O and attributes and entries are never cached
//! (TTL 0), so the kernel's page cache never serves bytes the layer has dropped (nothing
//! graviton runs on a local data directory maps files, which direct I/O would refuse).
//! File locks are left to the kernel: the layer implements no lock methods and asks for
//! no lock capability, so the kernel keeps `flock` and `fcntl` locks (redb's) locally,
//! which is exact for processes on this machine ([`LazyFs::check_locks`]).
//! fsync calls are counted ([`Stats`]).
//!
//! The mount is removed when the [`LazyFs`] is dropped, also when the test panics (stop
//! the processes using it first: a busy mount is detached lazily instead). A mount left by
//! a test process that was killed (its FUSE connection is dead) is detached by the next
//! [`LazyFs::mount`].

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

/// The source (`fsname`) the mounts show in `/proc/self/mountinfo` (type `fuse`).
const FS_NAME: &str = "graviton-lazyfs";
/// Attributes and entries are never cached by the kernel.
const TTL: Duration = Duration::ZERO;
/// Largest file the layer accepts (it holds every file twice in memory).
const MAX_FILE: u64 = 1 << 32;

/// fsync calls the layer answered, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// `fsync` of a regular file (data and metadata).
    pub fsyncs: u64,
    /// `fdatasync` of a regular file.
    pub fdatasyncs: u64,
    /// `fsync` or `fdatasync` of a directory (makes its entries durable).
    pub dir_fsyncs: u64,
    /// `write` calls.
    pub writes: u64,
}

impl Stats {
    /// File syncs of either kind: the calls that make data durable.
    pub fn file_syncs(&self) -> u64 {
        self.fsyncs + self.fdatasyncs
    }
}

/// A file whose data differs from its durable copy (see [`LazyFs::unsynced`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsynced {
    /// Path relative to the mount point.
    pub path: PathBuf,
    /// Length of what reads see now.
    pub len: u64,
    /// Length of what a crash leaves.
    pub durable_len: u64,
}

/// A directory entry whose current state differs from its durable one (see
/// [`LazyFs::unsynced_names`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum UnsyncedName {
    /// The name exists now (created or renamed to) but its directory was not synced
    /// since: a crash removes it, or gives it back its durable target.
    Added(PathBuf),
    /// The name was removed (unlinked, renamed away) but its directory was not synced
    /// since: a crash brings it back.
    Removed(PathBuf),
}

/// A mounted LazyFS-style filesystem; unmounted on drop.
pub struct LazyFs {
    session: Option<fuser::BackgroundSession>,
    state: Arc<Mutex<State>>,
    mountpoint: PathBuf,
    // Dropped after the unmount in `Drop` (fields drop after `drop` runs).
    _dir: tempfile::TempDir,
}

impl LazyFs {
    /// Mount a fresh, empty filesystem; `None` (after [`super::missing_service`]) when this
    /// machine has no FUSE device, no `fusermount3`, or the mount fails.
    pub fn mount(test: &str) -> Option<Self> {
        if !Path::new("/dev/fuse").exists() {
            super::missing_service(test, "/dev/fuse (FUSE is not available)");
            return None;
        }
        if !on_path("fusermount3") {
            super::missing_service(
                test,
                "fusermount3 (Debian package fuse3; scripts/services.sh installs it)",
            );
            return None;
        }
        detach_dead_mounts();
        let dir = tempfile::Builder::new()
            .prefix("graviton-lazyfs-")
            .tempdir()
            .expect("create the mount's temporary directory");
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).expect("create the mount point");
        // SAFETY: plain getters without arguments.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let state = Arc::new(Mutex::new(State::new(uid, gid)));
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            MountOption::FSName(FS_NAME.into()),
            MountOption::DefaultPermissions,
            MountOption::NoAtime,
        ];
        config.n_threads = Some(2);
        let layer = Layer {
            state: state.clone(),
        };
        match fuser::spawn_mount(layer, &mountpoint, &config) {
            Ok(session) => Some(Self {
                session: Some(session),
                state,
                mountpoint,
                _dir: dir,
            }),
            Err(err) => {
                super::missing_service(test, &format!("a FUSE mount ({err})"));
                None
            }
        }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The fsync calls answered so far.
    pub fn stats(&self) -> Stats {
        self.lock().stats
    }

    /// Each file synced at least once (fsync or fdatasync) with its number of syncs, by
    /// path (a renamed file under its new name).
    pub fn synced_files(&self) -> Vec<(PathBuf, u64)> {
        let state = self.lock();
        let mut out: Vec<(PathBuf, u64)> = state
            .paths()
            .into_iter()
            .filter_map(|(ino, path)| {
                let syncs = state.nodes.get(&ino)?.syncs;
                (syncs > 0).then_some((path, syncs))
            })
            .collect();
        out.sort();
        out
    }

    /// Every named file whose data would change in a crash now, by path.
    pub fn unsynced(&self) -> Vec<Unsynced> {
        let state = self.lock();
        let mut out: Vec<Unsynced> = state
            .paths()
            .into_iter()
            .filter_map(|(ino, path)| {
                let Body::File { current, durable } = &state.nodes.get(&ino)?.body else {
                    return None;
                };
                (current != durable).then_some(Unsynced {
                    path,
                    len: current.len() as u64,
                    durable_len: durable.len() as u64,
                })
            })
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// Every directory entry a crash would change now, by path (relative to the mount
    /// point, through the current names of its directories), sorted. A name whose
    /// directory is itself lost in the crash is listed too.
    pub fn unsynced_names(&self) -> Vec<UnsyncedName> {
        let state = self.lock();
        let mut out = Vec::new();
        for (ino, path) in std::iter::once((ROOT, PathBuf::new())).chain(state.paths()) {
            let Some(Node {
                body: Body::Dir {
                    entries, durable, ..
                },
                ..
            }) = state.nodes.get(&ino)
            else {
                continue;
            };
            for (name, child) in entries {
                if durable.get(name) != Some(child) {
                    out.push(UnsyncedName::Added(path.join(name)));
                }
            }
            for name in durable.keys() {
                if !entries.contains_key(name) {
                    out.push(UnsyncedName::Removed(path.join(name)));
                }
            }
        }
        out.sort();
        out
    }

    /// Power loss: every file's data becomes its durable copy (each write not followed by
    /// an fsync of its file is lost), and every directory's entries its durable entries
    /// (each name change not followed by an fsync of its directory is undone). Returns the
    /// data changes of files named before the crash (see [`LazyFs::unsynced_names`] for
    /// the names). Call it while no process uses the mount.
    pub fn crash(&self) -> Vec<Unsynced> {
        let dropped = self.unsynced();
        self.lock().crash();
        dropped
    }

    /// Check that file locks on the mount exclude each other (redb relies on them): an
    /// exclusive `flock` through one open file blocks another open of the same file, and
    /// the same for an open-file-description `fcntl` lock (the kind redb takes).
    pub fn check_locks(&self) {
        use std::os::fd::AsRawFd;
        let path = self.mountpoint.join(".lock-check");
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .expect("open the lock check file")
        };
        let (first, second) = (open(), open());
        first.try_lock().expect("first flock");
        assert!(
            matches!(second.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
            "flock on the LazyFS mount does not exclude a second open file"
        );
        first.unlock().expect("flock unlock");
        second.try_lock().expect("flock after the unlock");
        second.unlock().expect("flock unlock");
        let ofd_lock = |file: &std::fs::File| {
            // SAFETY: a zeroed `flock` is a valid value; the call only reads it.
            let mut lock: libc::flock = unsafe { std::mem::zeroed() };
            lock.l_type = libc::F_WRLCK as libc::c_short;
            lock.l_whence = libc::SEEK_SET as libc::c_short;
            lock.l_start = 0;
            lock.l_len = 1;
            // SAFETY: a valid descriptor and a pointer to a live `flock`.
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) }
        };
        assert_eq!(ofd_lock(&first), 0, "first OFD lock");
        assert_eq!(
            ofd_lock(&second),
            -1,
            "an OFD lock on the LazyFS mount does not exclude a second open file"
        );
        drop((first, second));
        std::fs::remove_file(&path).expect("remove the lock check file");
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for LazyFs {
    fn drop(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        if let Err(err) = session.umount_and_join() {
            // Busy (a process still has a file open): detach it now; the connection ends
            // when the last user closes its files.
            eprintln!(
                "lazyfs: unmounting {} failed ({err}); detaching it",
                self.mountpoint.display()
            );
            detach(&self.mountpoint);
        }
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        || ["/bin", "/sbin", "/usr/bin", "/usr/sbin"]
            .iter()
            .any(|dir| Path::new(dir).join(program).is_file())
}

/// Lazily unmount `mountpoint` (`umount2(MNT_DETACH)`, else `fusermount3 -u -z`).
fn detach(mountpoint: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } == 0 {
        return;
    }
    let _ = std::process::Command::new("fusermount3")
        .args(["-u", "-z", "--"])
        .arg(mountpoint)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

/// Detach every LazyFS mount whose FUSE connection is dead (its test process was killed
/// before it could unmount). Live mounts of other test processes answer and are kept.
fn detach_dead_mounts() {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    for line in mountinfo.lines() {
        let Some((fields, rest)) = line.split_once(" - ") else {
            continue;
        };
        let mut described = rest.split(' ');
        let (Some(fs_type), Some(source)) = (described.next(), described.next()) else {
            continue;
        };
        if !fs_type.starts_with("fuse") || source != FS_NAME {
            continue;
        }
        let Some(escaped) = fields.split(' ').nth(4) else {
            continue;
        };
        let mountpoint = PathBuf::from(unescape_mountinfo(escaped));
        let dead =
            std::fs::metadata(&mountpoint).is_err_and(|e| e.raw_os_error() == Some(libc::ENOTCONN));
        if dead {
            eprintln!(
                "lazyfs: detaching the dead mount {} of an earlier run",
                mountpoint.display()
            );
            detach(&mountpoint);
            // and its (empty) temporary directory
            let _ = std::fs::remove_dir(&mountpoint);
            if let Some(parent) = mountpoint.parent().filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("graviton-lazyfs-"))
            }) {
                let _ = std::fs::remove_dir(parent);
            }
        }
    }
}

/// `/proc/self/mountinfo` writes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> OsString {
    use std::os::unix::ffi::OsStringExt;
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

// ---------------------------------------------------------------------------------------
// The filesystem state.

enum Body {
    File {
        current: Vec<u8>,
        durable: Vec<u8>,
    },
    Dir {
        parent: u64,
        /// What lookups see.
        entries: BTreeMap<OsString, u64>,
        /// What survives a power loss: the entries at the directory's last fsync.
        durable: BTreeMap<OsString, u64>,
    },
}

struct Node {
    body: Body,
    perm: u16,
    uid: u32,
    gid: u32,
    /// Current names of this inode (files; a directory's count is derived, and 0 once
    /// removed). A node without a name, an open handle and a durable name is freed.
    links: u32,
    /// Open file handles (an unlinked file lives until the last is released).
    open: u32,
    /// fsync and fdatasync calls on this file.
    syncs: u64,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
}

impl Node {
    fn new(body: Body, perm: u16, uid: u32, gid: u32) -> Self {
        let now = SystemTime::now();
        Self {
            body,
            perm,
            uid,
            gid,
            links: 1,
            open: 0,
            syncs: 0,
            atime: now,
            mtime: now,
            ctime: now,
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir { .. })
    }
}

/// A directory listing taken at `opendir`, so removals during a listing skip nothing.
type Listing = Vec<(u64, FileType, OsString)>;

struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    listings: HashMap<u64, Listing>,
    next_fh: u64,
    stats: Stats,
}

const ROOT: u64 = 1;

impl State {
    fn new(uid: u32, gid: u32) -> Self {
        let root = Node::new(
            Body::Dir {
                parent: ROOT,
                entries: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
            0o755,
            uid,
            gid,
        );
        Self {
            nodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            listings: HashMap::new(),
            next_fh: 1,
            stats: Stats::default(),
        }
    }

    fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn entries(&self, dir: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match &self.node(dir)?.body {
            Body::Dir { entries, .. } => Ok(entries),
            Body::File { .. } => Err(Errno::ENOTDIR),
        }
    }

    fn entries_mut(&mut self, dir: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match &mut self.node_mut(dir)?.body {
            Body::Dir { entries, .. } => Ok(entries),
            Body::File { .. } => Err(Errno::ENOTDIR),
        }
    }

    fn child(&self, dir: u64, name: &OsStr) -> Result<u64, Errno> {
        self.entries(dir)?.get(name).copied().ok_or(Errno::ENOENT)
    }

    fn touch(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            let now = SystemTime::now();
            node.mtime = now;
            node.ctime = now;
        }
    }

    fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let node = self.node(ino)?;
        let (kind, size, nlink) = match &node.body {
            Body::File { current, .. } => (FileType::RegularFile, current.len() as u64, node.links),
            Body::Dir { entries, .. } => {
                let subdirs = entries
                    .values()
                    .filter(|child| self.nodes.get(child).is_some_and(Node::is_dir))
                    .count() as u32;
                (FileType::Directory, 4096, 2 + subdirs)
            }
        };
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: node.atime,
            mtime: node.mtime,
            ctime: node.ctime,
            crtime: node.ctime,
            kind,
            perm: node.perm,
            nlink,
            uid: node.uid,
            gid: node.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    /// A new inode named `name` in `parent`.
    fn add(&mut self, parent: u64, name: &OsStr, node: Node) -> Result<u64, Errno> {
        if name.len() > 255 {
            return Err(Errno::ENAMETOOLONG);
        }
        if self.entries(parent)?.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, node);
        self.entries_mut(parent)?.insert(name.to_owned(), ino);
        self.touch(parent);
        Ok(ino)
    }

    /// One name of `ino` is gone: free it when it has no name and no open handle.
    fn unlinked(&mut self, ino: u64) {
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        node.links = node.links.saturating_sub(1);
        node.ctime = SystemTime::now();
        self.collect(ino);
    }

    /// A directory's only name is gone.
    fn removed_dir(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.links = 0;
            node.ctime = SystemTime::now();
        }
        self.collect(ino);
    }

    fn collect(&mut self, ino: u64) {
        if self
            .nodes
            .get(&ino)
            .is_some_and(|node| node.links == 0 && node.open == 0)
            && !self.durably_named().contains(&ino)
        {
            self.nodes.remove(&ino);
        }
    }

    /// Every inode some directory's durable entries name.
    fn durably_named(&self) -> std::collections::HashSet<u64> {
        self.nodes
            .values()
            .filter_map(|node| match &node.body {
                Body::Dir { durable, .. } => Some(durable.values().copied()),
                Body::File { .. } => None,
            })
            .flatten()
            .collect()
    }

    /// Free every node without a current name, an open handle or a durable name.
    fn sweep(&mut self) {
        let named = self.durably_named();
        self.nodes.retain(|ino, node| {
            *ino == ROOT || node.links > 0 || node.open > 0 || named.contains(ino)
        });
    }

    /// An fsync of directory `ino`: its entries as they are now become durable.
    fn sync_dir(&mut self, ino: u64) -> Result<(), Errno> {
        match &mut self.node_mut(ino)?.body {
            Body::Dir {
                entries, durable, ..
            } => durable.clone_from(entries),
            Body::File { .. } => return Err(Errno::ENOTDIR),
        }
        self.stats.dir_fsyncs += 1;
        self.sweep();
        Ok(())
    }

    /// Power loss: data and entries become their durable copies; what no durable name
    /// reaches from the root is gone. No handle survives (every user was killed).
    fn crash(&mut self) {
        let now = SystemTime::now();
        for node in self.nodes.values_mut() {
            node.open = 0;
            match &mut node.body {
                Body::File { current, durable } => {
                    if current != durable {
                        current.clone_from(durable);
                        node.mtime = now;
                    }
                }
                Body::Dir {
                    entries, durable, ..
                } => {
                    if entries != durable {
                        entries.clone_from(durable);
                        node.mtime = now;
                    }
                }
            }
            node.links = 0;
        }
        // Walk the tree from the root: count each file's names, fix each directory's
        // parent, and keep a directory under its first name only (a directory durably
        // named in two places, renamed between two synced parents, is cut from the second).
        let mut reached = std::collections::HashSet::from([ROOT]);
        let mut stack = vec![ROOT];
        while let Some(dir) = stack.pop() {
            let children: Vec<(OsString, u64)> = match self.nodes.get(&dir).map(|n| &n.body) {
                Some(Body::Dir { entries, .. }) => {
                    entries.iter().map(|(n, i)| (n.clone(), *i)).collect()
                }
                _ => continue,
            };
            for (name, child) in children {
                let Some(is_dir) = self.nodes.get(&child).map(Node::is_dir) else {
                    continue;
                };
                if !is_dir {
                    if let Some(node) = self.nodes.get_mut(&child) {
                        node.links += 1;
                    }
                    reached.insert(child);
                } else if reached.insert(child) {
                    if let Some(node) = self.nodes.get_mut(&child) {
                        if let Body::Dir { parent, .. } = &mut node.body {
                            *parent = dir;
                        }
                        node.links = 1;
                    }
                    stack.push(child);
                } else if let Some(Body::Dir {
                    entries, durable, ..
                }) = self.nodes.get_mut(&dir).map(|n| &mut n.body)
                {
                    entries.remove(&name);
                    durable.remove(&name);
                }
            }
        }
        self.nodes.retain(|ino, _| reached.contains(ino));
        if let Some(root) = self.nodes.get_mut(&ROOT) {
            root.links = 1;
        }
        self.listings.clear();
    }

    fn file_data(&mut self, ino: u64) -> Result<&mut Vec<u8>, Errno> {
        match &mut self.node_mut(ino)?.body {
            Body::File { current, .. } => Ok(current),
            Body::Dir { .. } => Err(Errno::EISDIR),
        }
    }

    fn resize(&mut self, ino: u64, len: u64) -> Result<(), Errno> {
        if len > MAX_FILE {
            return Err(Errno::EFBIG);
        }
        self.file_data(ino)?.resize(len as usize, 0);
        self.touch(ino);
        Ok(())
    }

    fn write(&mut self, ino: u64, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|end| *end <= MAX_FILE)
            .ok_or(Errno::EFBIG)?;
        let current = self.file_data(ino)?;
        if current.len() < end as usize {
            current.resize(end as usize, 0);
        }
        current[offset as usize..end as usize].copy_from_slice(data);
        self.touch(ino);
        self.stats.writes += 1;
        Ok(data.len() as u32)
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<&[u8], Errno> {
        match &self.node(ino)?.body {
            Body::File { current, .. } => {
                let len = current.len() as u64;
                let start = offset.min(len) as usize;
                let end = offset.saturating_add(u64::from(size)).min(len) as usize;
                Ok(&current[start..end])
            }
            Body::Dir { .. } => Err(Errno::EISDIR),
        }
    }

    fn sync(&mut self, ino: u64, datasync: bool) -> Result<(), Errno> {
        let node = self.node_mut(ino)?;
        match &mut node.body {
            Body::File { current, durable } => durable.clone_from(current),
            Body::Dir { .. } => return Err(Errno::EISDIR),
        }
        node.syncs += 1;
        if datasync {
            self.stats.fdatasyncs += 1;
        } else {
            self.stats.fsyncs += 1;
        }
        Ok(())
    }

    fn rename(
        &mut self,
        parent: u64,
        name: &OsStr,
        new_parent: u64,
        new_name: &OsStr,
        flags: RenameFlags,
    ) -> Result<(), Errno> {
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return Err(Errno::EINVAL);
        }
        if new_name.len() > 255 {
            return Err(Errno::ENAMETOOLONG);
        }
        let ino = self.child(parent, name)?;
        let moving_dir = self.node(ino)?.is_dir();
        if moving_dir {
            // not into itself or its own subtree
            let mut at = new_parent;
            loop {
                if at == ino {
                    return Err(Errno::EINVAL);
                }
                match &self.node(at)?.body {
                    Body::Dir { parent, .. } if *parent != at => at = *parent,
                    _ => break,
                }
            }
        }
        if let Some(&target) = self.entries(new_parent)?.get(new_name) {
            if target == ino {
                return Ok(());
            }
            if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                return Err(Errno::EEXIST);
            }
            match (&self.node(target)?.body, moving_dir) {
                (Body::Dir { entries, .. }, true) if !entries.is_empty() => {
                    return Err(Errno::ENOTEMPTY);
                }
                (Body::Dir { .. }, false) => return Err(Errno::EISDIR),
                (Body::File { .. }, true) => return Err(Errno::ENOTDIR),
                _ => {}
            }
            self.entries_mut(new_parent)?.remove(new_name);
            if moving_dir {
                self.removed_dir(target);
            } else {
                self.unlinked(target);
            }
        }
        self.entries_mut(parent)?.remove(name);
        self.entries_mut(new_parent)?
            .insert(new_name.to_owned(), ino);
        if let Body::Dir { parent: up, .. } = &mut self.node_mut(ino)?.body {
            *up = new_parent;
        }
        self.node_mut(ino)?.ctime = SystemTime::now();
        self.touch(parent);
        self.touch(new_parent);
        Ok(())
    }

    /// Every named inode with one of its paths (relative to the mount point). An unlinked
    /// file still open (or whose release the kernel has not sent yet) has no path: after a
    /// crash it is gone anyway.
    fn paths(&self) -> Vec<(u64, PathBuf)> {
        let mut out = Vec::new();
        let mut named = std::collections::HashSet::new();
        let mut stack = vec![(ROOT, PathBuf::new())];
        while let Some((dir, path)) = stack.pop() {
            let Some(Node {
                body: Body::Dir { entries, .. },
                ..
            }) = self.nodes.get(&dir)
            else {
                continue;
            };
            for (name, &ino) in entries {
                if !named.insert(ino) {
                    continue;
                }
                let child = path.join(name);
                if self.nodes.get(&ino).is_some_and(Node::is_dir) {
                    stack.push((ino, child.clone()));
                }
                out.push((ino, child));
            }
        }
        out
    }
}

fn kind_of(node: &Node) -> FileType {
    if node.is_dir() {
        FileType::Directory
    } else {
        FileType::RegularFile
    }
}

// ---------------------------------------------------------------------------------------
// The FUSE operations.

struct Layer {
    state: Arc<Mutex<State>>,
}

impl Layer {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn new_node(req: &Request, body: Body, mode: u32, umask: u32) -> Node {
        let perm = (mode & !umask & 0o7777) as u16;
        Node::new(body, perm, req.uid(), req.gid())
    }

    fn reply_entry(&self, result: Result<u64, Errno>, reply: ReplyEntry) {
        let state = self.lock();
        match result.and_then(|ino| state.attr(ino)) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(err) => reply.error(err),
        }
    }
}

fn empty(result: Result<(), Errno>, reply: ReplyEmpty) {
    match result {
        Ok(()) => reply.ok(),
        Err(err) => reply.error(err),
    }
}

fn time(value: TimeOrNow) -> SystemTime {
    match value {
        TimeOrNow::SpecificTime(time) => time,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl Filesystem for Layer {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = self.lock().child(parent.0, name);
        self.reply_entry(found, reply);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.lock().attr(ino.0) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(err) => reply.error(err),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut state = self.lock();
        let result = (|| {
            if let Some(size) = size {
                state.resize(ino.0, size)?;
            }
            let node = state.node_mut(ino.0)?;
            if let Some(mode) = mode {
                node.perm = (mode & 0o7777) as u16;
            }
            if let Some(uid) = uid {
                node.uid = uid;
            }
            if let Some(gid) = gid {
                node.gid = gid;
            }
            if let Some(atime) = atime {
                node.atime = time(atime);
            }
            if let Some(mtime) = mtime {
                node.mtime = time(mtime);
            }
            node.ctime = SystemTime::now();
            state.attr(ino.0)
        })();
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(err) => reply.error(err),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            reply.error(Errno::EPERM);
            return;
        }
        let body = Body::File {
            current: Vec::new(),
            durable: Vec::new(),
        };
        let node = Self::new_node(req, body, mode, umask);
        let added = self.lock().add(parent.0, name, node);
        self.reply_entry(added, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let body = Body::Dir {
            parent: parent.0,
            entries: BTreeMap::new(),
            durable: BTreeMap::new(),
        };
        let node = Self::new_node(req, body, mode, umask);
        let added = self.lock().add(parent.0, name, node);
        self.reply_entry(added, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut state = self.lock();
        let result = (|| {
            let ino = state.child(parent.0, name)?;
            if state.node(ino)?.is_dir() {
                return Err(Errno::EISDIR);
            }
            state.entries_mut(parent.0)?.remove(name);
            state.touch(parent.0);
            state.unlinked(ino);
            Ok(())
        })();
        empty(result, reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut state = self.lock();
        let result = (|| {
            let ino = state.child(parent.0, name)?;
            if !state.entries(ino)?.is_empty() {
                return Err(Errno::ENOTEMPTY);
            }
            state.entries_mut(parent.0)?.remove(name);
            state.touch(parent.0);
            state.removed_dir(ino);
            Ok(())
        })();
        empty(result, reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let result = self
            .lock()
            .rename(parent.0, name, newparent.0, newname, flags);
        empty(result, reply);
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let linked = (|| {
            let mut state = self.lock();
            if state.node(ino.0)?.is_dir() {
                return Err(Errno::EPERM);
            }
            if state.entries(newparent.0)?.contains_key(newname) {
                return Err(Errno::EEXIST);
            }
            state
                .entries_mut(newparent.0)?
                .insert(newname.to_owned(), ino.0);
            state.touch(newparent.0);
            let node = state.node_mut(ino.0)?;
            node.links += 1;
            node.ctime = SystemTime::now();
            Ok(ino.0)
        })();
        self.reply_entry(linked, reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut state = self.lock();
        match state.node_mut(ino.0) {
            Ok(node) if node.is_dir() => reply.error(Errno::EISDIR),
            Ok(node) => {
                node.open += 1;
                reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
            }
            Err(err) => reply.error(err),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            reply.error(Errno::EPERM);
            return;
        }
        let body = Body::File {
            current: Vec::new(),
            durable: Vec::new(),
        };
        let mut node = Self::new_node(req, body, mode, umask);
        node.open = 1;
        let mut state = self.lock();
        match state
            .add(parent.0, name, node)
            .and_then(|ino| state.attr(ino))
        {
            Ok(attr) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(0),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(err) => reply.error(err),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let state = self.lock();
        match state.read(ino.0, offset, size) {
            Ok(data) => reply.data(data),
            Err(err) => reply.error(err),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.lock().write(ino.0, offset, data) {
            Ok(written) => reply.written(written),
            Err(err) => reply.error(err),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) makes nothing durable
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut state = self.lock();
        if let Some(node) = state.nodes.get_mut(&ino.0) {
            node.open = node.open.saturating_sub(1);
        }
        state.collect(ino.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(self.lock().sync(ino.0, datasync), reply);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut state = self.lock();
        let listing = (|| {
            let Body::Dir {
                parent, entries, ..
            } = &state.node(ino.0)?.body
            else {
                return Err(Errno::ENOTDIR);
            };
            let mut listing: Listing = vec![
                (ino.0, FileType::Directory, ".".into()),
                (*parent, FileType::Directory, "..".into()),
            ];
            for (name, &child) in entries {
                let kind = state
                    .nodes
                    .get(&child)
                    .map_or(FileType::RegularFile, kind_of);
                listing.push((child, kind, name.clone()));
            }
            Ok(listing)
        })();
        match listing {
            Ok(listing) => {
                let fh = state.next_fh;
                state.next_fh += 1;
                state.listings.insert(fh, listing);
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(err) => reply.error(err),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let state = self.lock();
        let Some(listing) = state.listings.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        for (i, (ino, kind, name)) in listing.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*ino), i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.lock().listings.remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(self.lock().sync_dir(ino.0), reply);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let state = self.lock();
        let used: u64 = state
            .nodes
            .values()
            .map(|node| match &node.body {
                Body::File { current, .. } => (current.len() as u64).div_ceil(4096),
                Body::Dir { .. } => 1,
            })
            .sum();
        let blocks = 1 << 22; // 16 GiB of 4 KiB blocks
        let free = blocks - used.min(blocks);
        let files = 1 << 20;
        let ffree = files - (state.nodes.len() as u64).min(files);
        reply.statfs(blocks, free, free, files, ffree, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        // permissions are checked by the kernel (default_permissions)
        empty(self.lock().node(ino.0).map(|_| ()), reply);
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut state = self.lock();
        let result = (|| {
            let end = offset.checked_add(length).ok_or(Errno::EFBIG)?;
            match mode {
                0 => {
                    let len = state.file_data(ino.0)?.len() as u64;
                    if end > len {
                        state.resize(ino.0, end)?;
                    }
                    Ok(())
                }
                // space is never short here
                libc::FALLOC_FL_KEEP_SIZE => state.file_data(ino.0).map(|_| ()),
                _ => Err(Errno::EOPNOTSUPP),
            }
        })();
        empty(result, reply);
    }
}
