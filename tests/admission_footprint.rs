//! Footprints are upper bounds (ADM-13): a real `graviton serve` process with a small
//! `admission.process_bytes` budget stays within that budget plus a fixed overhead in
//! resident memory while
//!
//! * N concurrent uploads push bodies at a block store that does not answer (a private
//!   Garage stopped with SIGSTOP while the packs are being PUT), and
//! * N concurrent downloads are read by clients that take a few KiB at a time through a
//!   4 KiB socket receive buffer.
//!
//! The transfers beyond the budget wait and are refused with 503 and `Retry-After` before
//! their body; the admitted ones stop reading (uploads) or stop fetching (downloads) when
//! their pipeline is full. The peak is the kernel's own high-water mark (`VmHWM` of
//! `/proc/<pid>/status`, reset with `clear_refs` after warm-up) minus the resident size
//! measured idle just before. When the stall ends every admitted transfer completes
//! byte-exact, and the local budget is whole again.
//!
//! The bodies are worst-case for the pipelines: every block is a maximum-size chunk
//! (`MAX_CHUNK`, no content-defined cut point) and new, so the queues, counted in blocks,
//! hold as many bytes as they can.
//!
//! ADM-4 is checked here against a measurement too, not against the footprint's own
//! formula: the ingest pipeline runs in this process, under a global allocator that counts
//! live heap bytes, on a worst-case body whose frames are allocated as a server's would
//! be, into a real pack store whose medium holds its first publish until the pipeline
//! has stopped pulling the body (full). The heap's high-water mark above the level before
//! the upload must stay within the upload footprint. The tests of this file take one
//! lock, so under `cargo test` (one process) no other test's allocations are counted.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use graviton::admission::{Footprint, Operation};
use graviton::cas::{BlobKey, MAX_CHUNK};
use graviton::pipeline::ingest::{BATCH_BYTES, MAX_BODY_FRAME};
use graviton::storage::config::default_pack_size;
use support::client;
use support::process::{Graviton, Ports, reset_peak_resident, status_bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

/// One test of this file at a time in a process (the heap count is process-wide).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Live heap bytes of this process and their high-water mark since the last reset.
static LIVE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
static PEAK: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// The system allocator, counting live bytes (ADM-4's measurement).
struct Counting;

fn counted(delta: i64) {
    let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// only updated around it.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let ptr = unsafe { std::alloc::System.alloc(layout) };
        if !ptr.is_null() {
            counted(layout.size() as i64);
        }
        ptr
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let ptr = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            counted(layout.size() as i64);
        }
        ptr
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's pointer and layout, from `alloc` above.
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        counted(-(layout.size() as i64));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's pointer, layout and size.
        let moved = unsafe { std::alloc::System.realloc(ptr, layout, new) };
        if !moved.is_null() {
            counted(new as i64 - layout.size() as i64);
        }
        moved
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;
const ADMIN_TOKEN: &str = "admin-token-for-footprint-tests-01";
const KEY_ID: &str = "GKfootprinttest0001";
const SECRET: &str = "footprint-test-secret-0123456789abcdef";
const BUCKET: &str = "footprint";

/// The resident memory a loaded process may hold beyond `process_bytes` (ADM-13), also
/// documented in docs/admission.md ("Footprints"): what no footprint counts because it is
/// not a transfer's buffer.
///
/// * The runtime, 4 MiB: stacks of the blocking-pool threads the transfers start (two per
///   upload), tokio and hyper state of every connection, waiting ones included, and code
///   pages first touched under load.
/// * glibc's free memory, per arena: glibc does not trim an arena's top below twice its
///   dynamic mmap threshold, and the threshold rises to the largest block freed, here a
///   frame batch (below `BATCH_BYTES + MAX_BODY_FRAME`); glibc makes up to 8 arenas per
///   core.
fn fixed_overhead() -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let arena_slack = 2 * (BATCH_BYTES + MAX_BODY_FRAME) as u64;
    (4 << 20) + 8 * cores * arena_slack
}

/// The resident size an upload adds on S3 beyond its footprint: the S3 medium PUTs a
/// sealed pack from a read-only mapping of its spool file (`storage::pack::s3`), which
/// stays resident (file-backed, `RssFile`) while the PUT is in flight. A pack is sealed
/// once it reaches `pack_size`, so it is below `pack_size` plus one block and its record
/// header, and one writer seals one pack at a time. These are page-cache pages of the
/// spool file (there on the local medium too, outside the process), clean and
/// reclaimable; the footprint does not count them (docs/admission.md, "Footprints").
fn mapped_pack(pack_size: u64) -> u64 {
    pack_size + MAX_CHUNK as u64 + 4096
}

/// The default `storage.pack_size` (the bound must hold with the defaults).
const PACK_SIZE: u64 = 32 << 20;

/// Uploads started at once, and how many footprints the budget holds.
const UPLOADS: usize = 16;
const UPLOADS_ADMITTED: u64 = 4;
/// Downloads started at once, and how many footprints the budget holds.
const DOWNLOADS: usize = 24;
const DOWNLOADS_ADMITTED: u64 = 16;

/// One `graviton serve` process on a free port (the process wrapper of `tests/support`).
struct Serve {
    node: Graviton,
    url: String,
    port: u16,
}

impl Serve {
    /// Start `graviton serve --config` with `sections` (TOML) and wait for `/readyz`;
    /// its log as the error when the process exits first or never gets ready.
    async fn start(dir: &Path, sections: &str) -> Result<Self, String> {
        let config = dir.join("graviton.toml");
        let text = |ports: Ports| {
            format!(
                "[node]\nlisten = \"{}\"\nshutdown_grace = \"1s\"\n\n\
                 [admin]\ntoken = \"{ADMIN_TOKEN}\"\n\n{sections}",
                ports.listen()
            )
        };
        let mut node = Graviton::serve_config(dir.join("graviton.log"), &config, text, |c| {
            c.env("RUST_LOG", "info");
        });
        node.wait_ready(Duration::from_secs(60)).await?;
        Ok(Self {
            url: node.url.clone(),
            port: node.port(),
            node,
        })
    }

    fn pid(&self) -> u32 {
        self.node.pid().expect("running")
    }

    fn log_text(&self) -> String {
        self.node.log_text()
    }

    /// `POST /v1/blobs` of `data`, answered 201; its key.
    async fn upload(&self, data: &[u8]) -> String {
        let response = client()
            .post(format!("{}/v1/blobs", self.url))
            .body(data.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let key = BlobKey::of(data).to_string();
        let receipt: serde_json::Value = response.json().await.unwrap();
        assert_eq!(receipt["key"], key.as_str());
        key
    }

    /// Exactly `admitted` footprints of `operation` are taken from `budget`.
    async fn assert_holding(&self, budget: u64, operation: Operation, admitted: u64) {
        let footprint = Footprint::for_operation(operation, MAX_CHUNK as u64).bytes();
        assert_eq!(
            budget - self.available_bytes().await,
            admitted * footprint,
            "exactly the budget's {operation}s hold permits"
        );
    }

    /// The local budget's free bytes (`GET /v1/admin/admission`).
    async fn available_bytes(&self) -> u64 {
        let snapshot: serde_json::Value = client()
            .get(format!("{}/v1/admin/admission", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        snapshot["local"]["process_bytes_available"]
            .as_u64()
            .unwrap_or_else(|| panic!("no local.process_bytes_available in {snapshot}"))
    }
}

/// The most a client can write on a connection whose server reads nothing: the largest
/// TCP send buffer plus the largest receive buffer (`net.ipv4.tcp_wmem`, `tcp_rmem`).
fn socket_buffers() -> u64 {
    let max = |name: &str| -> u64 {
        let text = std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).unwrap();
        text.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    max("tcp_wmem") + max("tcp_rmem")
}

/// Samples of the anonymous and file-backed resident sizes while a phase runs (the kernel
/// keeps a peak of their sum only).
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u64, u64)>,
}

impl Sampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut anon, mut file) = (0, 0);
            while !flag.load(Ordering::SeqCst) {
                anon = anon.max(status_bytes(pid, "RssAnon"));
                file = file.max(status_bytes(pid, "RssFile"));
                std::thread::sleep(Duration::from_millis(5));
            }
            (anon, file)
        });
        Self { stop, thread }
    }

    /// The phase's peaks: the kernel's `VmHWM`, and the largest anonymous and
    /// file-backed sizes sampled (every 5 ms).
    fn finish(self, pid: u32) -> Resident {
        self.stop.store(true, Ordering::SeqCst);
        let (anon, file) = self.thread.join().unwrap();
        Resident {
            total: status_bytes(pid, "VmHWM"),
            anon,
            file,
        }
    }
}

/// A body whose every block is a maximum-size chunk and unique: one byte value repeated
/// (FastCDC finds no cut point in it, so it cuts at `MAX_CHUNK`), with `seed` and the
/// block's index stamped at the start of each block (inside the minimum chunk size, where
/// no cut is looked for).
fn worst_case_body(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![fill_byte(); len];
    for (index, block) in data.chunks_mut(MAX_CHUNK).enumerate() {
        let mut stamp = [0u8; 16];
        stamp[..8].copy_from_slice(&seed.to_le_bytes());
        stamp[8..].copy_from_slice(&(index as u64).to_le_bytes());
        let n = stamp.len().min(block.len());
        block[..n].copy_from_slice(&stamp[..n]);
    }
    data
}

/// The first byte value whose repetition the chunker cuts only at `MAX_CHUNK`.
fn fill_byte() -> u8 {
    static FILL: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *FILL.get_or_init(|| {
        (1..=255u8)
            .find(|&b| {
                graviton::cas::chunker::chunk_lengths(&vec![b; 4 * MAX_CHUNK])
                    .iter()
                    .all(|&l| l == MAX_CHUNK)
            })
            .expect("a byte value without FastCDC cut points")
    })
}

/// What the server answered on one raw connection.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    /// An admission refusal: `Retry-After` and a `transfer_admission_*` code.
    fn assert_admission_refusal(&self) {
        assert!(
            self.head.to_ascii_lowercase().contains("\r\nretry-after:"),
            "refusal without Retry-After: {self:?}"
        );
        let body = String::from_utf8_lossy(&self.body);
        assert!(body.contains("transfer_admission"), "{body}");
    }

    fn header(&self, name: &str) -> Option<String> {
        let prefix = format!("{}:", name.to_ascii_lowercase());
        self.head.split("\r\n").find_map(|line| {
            line.to_ascii_lowercase()
                .strip_prefix(&prefix)
                .map(|v| v.trim().to_string())
        })
    }
}

/// Parse the head once it is complete; `None` while it is not.
fn parse_head(buf: &[u8]) -> Option<(u16, String, usize)> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end + 2]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Some((status, head, end + 4))
}

/// Read one response whose body has a `Content-Length` (or ends at close): reads
/// `pace`d (a few KiB, then a pause) while `slow` is set, counting bytes in `received`.
async fn read_answer(
    stream: &mut (impl AsyncReadExt + Unpin),
    slow: Option<&AtomicBool>,
    received: &AtomicU64,
) -> Answer {
    let mut buf = Vec::new();
    let mut piece = vec![0u8; 4096];
    loop {
        if let Some((status, head, start)) = parse_head(&buf) {
            let answer = Answer {
                status,
                head,
                body: Vec::new(),
            };
            if let Some(len) = answer
                .header("content-length")
                .and_then(|v| v.parse::<usize>().ok())
                && buf.len() >= start + len
            {
                return Answer {
                    body: buf[start..start + len].to_vec(),
                    ..answer
                };
            }
        }
        let n = match stream.read(&mut piece).await {
            Ok(0) | Err(_) => 0,
            Ok(n) => n,
        };
        if n == 0 {
            let (status, head, start) =
                parse_head(&buf).unwrap_or((0, String::from_utf8_lossy(&buf).into(), buf.len()));
            return Answer {
                status,
                head,
                body: buf[start..].to_vec(),
            };
        }
        buf.extend_from_slice(&piece[..n]);
        received.fetch_add(n as u64, Ordering::SeqCst);
        if slow.is_some_and(|s| s.load(Ordering::SeqCst)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One raw `POST /v1/blobs` that keeps writing `data` while it waits for the answer;
/// `written` counts the body bytes the kernel accepted.
async fn push_upload(port: u16, data: Arc<Vec<u8>>, written: Arc<AtomicU64>) -> Answer {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        let head = format!(
            "POST /v1/blobs HTTP/1.1\r\nHost: graviton\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            data.len()
        );
        write.write_all(head.as_bytes()).await?;
        for piece in data.chunks(64 * 1024) {
            write.write_all(piece).await?;
            written.fetch_add(piece.len() as u64, Ordering::SeqCst);
        }
        Ok::<_, std::io::Error>(write)
    });
    let answer = read_answer(&mut read, None, &AtomicU64::new(0)).await;
    writer.abort();
    answer
}

/// One raw `GET /v1/blobs/{key}` through a 4 KiB receive buffer, read slowly while
/// `slow` is set.
async fn slow_download(
    port: u16,
    key: String,
    slow: Arc<AtomicBool>,
    received: Arc<AtomicU64>,
) -> Answer {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let request =
        format!("GET /v1/blobs/{key} HTTP/1.1\r\nHost: graviton\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    read_answer(&mut stream, Some(&slow), &received).await
}

/// Wait until `counters` have not moved for `quiet` (every admitted transfer has filled
/// its pipeline and the kernel's socket buffers); panics after `within`.
async fn wait_stalled(counters: &[Arc<AtomicU64>], quiet: Duration, within: Duration) {
    let total = || {
        counters
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .sum::<u64>()
    };
    let deadline = tokio::time::Instant::now() + within;
    let mut last = total();
    let mut since = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = total();
        if now != last {
            last = now;
            since = tokio::time::Instant::now();
        } else if since.elapsed() >= quiet {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the transfers never stalled"
        );
    }
}

/// `[admission]` with a budget of exactly `admitted` footprints of `operation`; every
/// other ceiling above the number of transfers.
fn admission_toml(operation: Operation, admitted: u64) -> (String, u64) {
    let footprint = Footprint::for_operation(operation, MAX_CHUNK as u64);
    let budget = admitted * footprint.bytes();
    let toml = format!(
        "[admission]\nprocess_bytes = \"{kib}KiB\"\ntenant_bytes = \"{kib}KiB\"\n\
         tenant_transfers = 64\nbackend_transfers = 64\nacquisition_timeout = \"2s\"\n",
        kib = budget / 1024
    );
    (toml, budget)
}

/// Resident sizes of the process at one moment (or the phase's peaks).
#[derive(Debug, Clone, Copy)]
struct Resident {
    /// `VmRSS` (for a phase: `VmHWM`, the kernel's own peak).
    total: u64,
    /// `RssAnon`: heap, stacks; what footprints budget.
    anon: u64,
    /// `RssFile`: the binary's code and mapped files.
    file: u64,
}

impl Resident {
    fn now(pid: u32) -> Self {
        Self {
            total: status_bytes(pid, "VmRSS"),
            anon: status_bytes(pid, "RssAnon"),
            file: status_bytes(pid, "RssFile"),
        }
    }
}

/// Check a phase's peaks against the bounds (ADM-13), print the figures either way:
/// anonymous memory within `process_bytes` plus the fixed overhead, and all resident
/// memory within that plus `mapped` (the file-backed pages a transfer maps, see
/// [`mapped_pack`]).
fn assert_within_budget(what: &str, idle: Resident, peak: Resident, budget: u64, mapped: u64) {
    let over = fixed_overhead();
    let anon = peak.anon.saturating_sub(idle.anon);
    let total = peak.total.saturating_sub(idle.total);
    eprintln!(
        "{what}: idle {:.1} MiB (anon {:.1}, file {:.1}); peak VmHWM {:.1} MiB (+{:.1}), \
         sampled anon {:.1} MiB (+{:.1}), file {:.1} MiB (+{:.1}); budget {:.1} MiB, \
         fixed overhead {:.1} MiB, mapped packs {:.1} MiB",
        mib(idle.total),
        mib(idle.anon),
        mib(idle.file),
        mib(peak.total),
        mib(total),
        mib(peak.anon),
        mib(anon),
        mib(peak.file),
        mib(peak.file.saturating_sub(idle.file)),
        mib(budget),
        mib(over),
        mib(mapped),
    );
    assert!(
        anon <= budget + over,
        "{what}: anonymous memory grew by {:.1} MiB, above process_bytes ({:.1} MiB) plus \
         the fixed overhead ({:.1} MiB) (ADM-13)",
        mib(anon),
        mib(budget),
        mib(over)
    );
    assert!(
        total <= budget + over + mapped,
        "{what}: peak RSS grew by {:.1} MiB, above process_bytes ({:.1} MiB) plus the fixed \
         overhead ({:.1} MiB) plus mapped packs ({:.1} MiB) (ADM-13)",
        mib(total),
        mib(budget),
        mib(over),
        mib(mapped)
    );
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Start a node on the private Garage (the bucket can take a moment after Garage's first
/// start, and the node refuses to start without it).
async fn serve_on_garage(dir: &Path, garage: &support::garage::Garage, extra: &str) -> Serve {
    let sections = format!(
        r#"[storage]
data_dir = "{data}"
fsync = false
backend = "s3"
pack_size = "{pack_size}"

[storage.s3]
endpoint = "{endpoint}"
bucket = "{bucket}"
region = "garage"
path_style = true
access_key_id = "{key}"
secret_access_key = "{secret}"
request_timeout = "300s"
max_retries = 0

{extra}"#,
        data = dir.join("data").display(),
        pack_size = PACK_SIZE,
        endpoint = garage.endpoint(),
        bucket = garage.bucket,
        key = garage.key_id,
        secret = garage.secret,
    );
    let mut last = String::new();
    for _ in 0..20 {
        match Serve::start(dir, &sections).await {
            Ok(serve) => return serve,
            Err(log) => last = log,
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!("graviton serve did not start on garage:\n{last}");
}

/// A small upload and download, so the idle figure includes the warmed-up runtime.
async fn warm_up(serve: &Serve, seed: u64) {
    let data = worst_case_body(3 * MAX_CHUNK, seed);
    let key = serve.upload(&data).await;
    let (status, body) = support::download(&serve.url, &key).await;
    assert_eq!(status, 200);
    assert!(body == data);
}

// ADM-13
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uploads_against_a_stopped_block_store_stay_within_process_bytes() {
    let _serial = SERIAL.lock().await;
    let Some(bin) = support::garage::Garage::bin_for("admission_footprint uploads") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let garage_dir = dir.path().join("garage");
    std::fs::create_dir_all(&garage_dir).unwrap();
    let garage = support::garage::Garage::start(&garage_dir, bin, KEY_ID, SECRET, BUCKET);
    assert_eq!(PACK_SIZE, default_pack_size().bytes());
    let (admission, budget) = admission_toml(Operation::Upload, UPLOADS_ADMITTED);
    let serve = serve_on_garage(dir.path(), &garage, &admission).await;
    warm_up(&serve, 1_000).await;

    // Larger than two packs, a pipeline and both sockets' buffers, so an admitted upload
    // is still sending when the hung PUT of its first pack stops it (the writer spools a
    // second pack while the first one is PUT).
    let size = 3 * PACK_SIZE as usize;
    let bodies: Vec<Arc<Vec<u8>>> = (0..UPLOADS as u64)
        .map(|i| Arc::new(worst_case_body(size, i)))
        .collect();
    let pid = serve.pid();
    let idle = Resident::now(pid);
    reset_peak_resident(pid);
    let sampler = Sampler::start(pid);

    garage.signal("STOP");
    let written: Vec<Arc<AtomicU64>> = (0..UPLOADS).map(|_| Arc::default()).collect();
    let uploads: Vec<_> = bodies
        .iter()
        .zip(&written)
        .map(|(body, written)| tokio::spawn(push_upload(serve.port, body.clone(), written.clone())))
        .collect();
    // The admitted uploads fill their pipelines and stop; the others wait, then are refused.
    wait_stalled(&written, Duration::from_secs(3), Duration::from_secs(120)).await;
    serve
        .assert_holding(budget, Operation::Upload, UPLOADS_ADMITTED)
        .await;
    let peak = sampler.finish(pid);
    let stalled: Vec<u64> = written.iter().map(|w| w.load(Ordering::SeqCst)).collect();
    eprintln!("body bytes accepted by the kernel per upload while stopped: {stalled:?}");
    assert!(
        stalled.iter().all(|&w| w < size as u64),
        "no upload can finish while the store is stopped"
    );
    let mapped = UPLOADS_ADMITTED * mapped_pack(PACK_SIZE);
    assert_within_budget("uploads, store stopped", idle, peak, budget, mapped);

    garage.signal("CONT");
    // Every answer first: a download needs admission too, so the checks below wait until
    // the admitted uploads have let go of the budget.
    let mut answers = Vec::new();
    for upload in uploads {
        answers.push(upload.await.unwrap());
    }
    let mut admitted = 0;
    for (i, answer) in answers.into_iter().enumerate() {
        match answer.status {
            201 => {
                admitted += 1;
                let receipt: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
                let key = BlobKey::of(&bodies[i]).to_string();
                assert_eq!(receipt["key"], key.as_str());
                assert_eq!(
                    receipt["blocks"],
                    (size / MAX_CHUNK) as u64,
                    "max-size blocks"
                );
                assert_eq!(receipt["fresh_blocks"], receipt["blocks"]);
                let (status, body) = support::download(&serve.url, &key).await;
                assert_eq!(status, 200);
                assert!(body == *bodies[i], "upload {i} downloads byte-exact");
            }
            503 | 429 => {
                answer.assert_admission_refusal();
                // refused before its body was read: what the client could send fits in
                // the two sockets' buffers
                assert!(
                    stalled[i] <= socket_buffers(),
                    "refused upload {i} had {} body bytes taken",
                    stalled[i]
                );
                let key = BlobKey::of(&bodies[i]).to_string();
                assert_eq!(support::download(&serve.url, &key).await.0, 404);
            }
            _ => panic!(
                "upload {i}: unexpected answer {answer:?}\n{}",
                serve.log_text()
            ),
        }
    }
    assert_eq!(
        admitted, UPLOADS_ADMITTED,
        "the admitted uploads complete once the store answers"
    );
    assert_eq!(serve.available_bytes().await, budget, "no permit leaked");
}

// ADM-13
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_reading_downloads_stay_within_process_bytes() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let (admission, budget) = admission_toml(Operation::Download, DOWNLOADS_ADMITTED);
    let sections = format!(
        "[storage]\ndata_dir = \"{}\"\nfsync = false\nbackend = \"fs\"\n\n{admission}",
        dir.path().join("data").display()
    );
    let serve = Serve::start(dir.path(), &sections)
        .await
        .unwrap_or_else(|log| panic!("graviton serve did not start:\n{log}"));
    warm_up(&serve, 2_000).await;
    let size = 32 << 20;
    let blob = worst_case_body(size, 7);
    let key = serve.upload(&blob).await;

    let pid = serve.pid();
    let idle = Resident::now(pid);
    reset_peak_resident(pid);
    let sampler = Sampler::start(pid);
    let slow = Arc::new(AtomicBool::new(true));
    let received: Vec<Arc<AtomicU64>> = (0..DOWNLOADS).map(|_| Arc::default()).collect();
    let downloads: Vec<_> = received
        .iter()
        .map(|r| {
            tokio::spawn(slow_download(
                serve.port,
                key.clone(),
                slow.clone(),
                r.clone(),
            ))
        })
        .collect();
    // Let the refusals happen (acquisition_timeout) and the admitted readers settle.
    let admitted_reading = || {
        received
            .iter()
            .filter(|r| r.load(Ordering::SeqCst) > 64 * 1024)
            .count() as u64
    };
    support::eventually(
        Duration::from_secs(60),
        "the admitted downloads stream",
        || admitted_reading() >= DOWNLOADS_ADMITTED,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    serve
        .assert_holding(budget, Operation::Download, DOWNLOADS_ADMITTED)
        .await;
    let peak = sampler.finish(pid);
    let progress: Vec<u64> = received.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    eprintln!("bytes read per download while slow: {progress:?}");
    assert!(
        progress.iter().all(|&r| r < size as u64 / 2),
        "the readers were slow"
    );
    assert_within_budget("downloads, slow readers", idle, peak, budget, 0);

    slow.store(false, Ordering::SeqCst);
    let mut admitted = 0;
    for download in downloads {
        let answer = download.await.unwrap();
        match answer.status {
            200 => {
                admitted += 1;
                assert!(answer.body == blob, "a slow download is byte-exact");
            }
            503 | 429 => {
                answer.assert_admission_refusal();
            }
            _ => panic!("unexpected answer {answer:?}\n{}", serve.log_text()),
        }
    }
    assert_eq!(admitted, DOWNLOADS_ADMITTED);
    assert_eq!(serve.available_bytes().await, budget, "no permit leaked");
}

/// A local pack medium whose publishes wait until [`Gated::open`]: the pack writer stops
/// at its first full pack, as behind a block store that does not answer.
#[derive(Debug)]
struct Gated {
    inner: graviton::storage::pack::medium::LocalMedium,
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
    waiting: AtomicU64,
}

impl Gated {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl graviton::storage::pack::medium::Medium for Gated {
    fn publish(
        &self,
        spool: std::fs::File,
        spool_path: &Path,
        id: &graviton::storage::pack::format::PackId,
    ) -> Result<(), graviton::storage::StoreError> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        self.inner.publish(spool, spool_path, id)
    }
    fn read(
        &self,
        id: &graviton::storage::pack::format::PackId,
        offset: u64,
        len: u64,
    ) -> Result<bytes::Bytes, graviton::storage::StoreError> {
        self.inner.read(id, offset, len)
    }
    fn read_all(
        &self,
        id: &graviton::storage::pack::format::PackId,
    ) -> Result<bytes::Bytes, graviton::storage::StoreError> {
        self.inner.read_all(id)
    }
    fn delete(
        &self,
        id: &graviton::storage::pack::format::PackId,
    ) -> Result<(), graviton::storage::StoreError> {
        self.inner.delete(id)
    }
    fn exists(
        &self,
        id: &graviton::storage::pack::format::PackId,
    ) -> Result<bool, graviton::storage::StoreError> {
        self.inner.exists(id)
    }
    fn list(
        &self,
    ) -> Result<Vec<(graviton::storage::pack::format::PackId, u64)>, graviton::storage::StoreError>
    {
        self.inner.list()
    }
    fn describe(&self) -> String {
        format!("gated {}", self.inner.describe())
    }
    fn publish_behind(&self) -> bool {
        self.inner.publish_behind()
    }
    fn direct_spool(&self) -> bool {
        self.inner.direct_spool()
    }
}

// Checks ADM-4 against a measurement: the upload footprint covers the heap a full ingest
// pipeline really holds (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_ingest_pipeline_holds_no_more_heap_than_the_upload_footprint() {
    use graviton::pipeline::ingest::{IngestLimits, ingest};
    use graviton::storage::fs::FsManifestStore;
    use graviton::storage::pack::{PackOptions, PackStore};
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let pack_size = 1u64 << 20; // the smallest: the writer stops at its first pack
    let medium = Arc::new(Gated {
        inner: graviton::storage::pack::medium::LocalMedium::open(
            &dir.path().join("packs"),
            true,
            None,
        )
        .unwrap(),
        open: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
        waiting: AtomicU64::new(0),
    });
    let options = PackOptions {
        pack_size,
        fsync: true,
        trace: None,
    };
    let store: Arc<dyn graviton::storage::BlockStore> =
        Arc::new(PackStore::open(dir.path(), medium.clone(), options).unwrap());
    let manifests: Arc<dyn graviton::storage::ManifestStore> =
        Arc::new(FsManifestStore::open(dir.path(), true).unwrap());

    let body = Arc::new(worst_case_body(64 << 20, 4_000));
    let frames = body.len().div_ceil(MAX_BODY_FRAME);
    let pulled = Arc::new(AtomicU64::new(0));
    // Each frame is a fresh allocation, as a server's body frames are.
    let stream = futures_util::stream::iter((0..frames).map({
        let (body, pulled) = (body.clone(), pulled.clone());
        move |i| {
            pulled.fetch_add(1, Ordering::SeqCst);
            let end = ((i + 1) * MAX_BODY_FRAME).min(body.len());
            Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(
                &body[i * MAX_BODY_FRAME..end],
            ))
        }
    }));
    let limits = IngestLimits {
        max_size: u64::MAX,
        declared_size: Some(body.len() as u64),
        idle_timeout: Duration::from_secs(300),
        digest: None,
    };
    let baseline = LIVE.load(Ordering::SeqCst);
    PEAK.store(baseline, Ordering::SeqCst);
    let upload = tokio::spawn(ingest(stream, limits, store, manifests, |_| {}));
    // Full: the writer waits on its publish and the pipeline stopped pulling the body.
    support::eventually(
        Duration::from_secs(120),
        "the pack writer reaches its first publish",
        || medium.waiting.load(Ordering::SeqCst) >= 1,
    )
    .await;
    wait_stalled(
        std::slice::from_ref(&pulled),
        Duration::from_secs(2),
        Duration::from_secs(120),
    )
    .await;
    let peak = (PEAK.load(Ordering::SeqCst) - baseline).max(0) as u64;
    let taken = pulled.load(Ordering::SeqCst) as usize;
    assert!(
        medium.waiting.load(Ordering::SeqCst) >= 1 && taken < frames,
        "the pipeline stopped short of the body's end behind the held publish \
         ({taken} of {frames} frames taken)"
    );
    medium.open();
    let report = upload
        .await
        .unwrap()
        .expect("the upload completes once released");
    assert_eq!(report.key, BlobKey::of(&body));

    let footprint = Footprint::for_operation(Operation::Upload, MAX_CHUNK as u64).bytes();
    eprintln!(
        "FIGURE ADM-4 peak heap of a full ingest pipeline: {:.2} MiB of the {:.2} MiB upload \
         footprint ({} MiB of body taken before it stopped)",
        mib(peak),
        mib(footprint),
        (taken * MAX_BODY_FRAME) >> 20
    );
    assert!(
        peak <= footprint,
        "a full ingest pipeline held {peak} bytes of heap, more than the upload footprint \
         of {footprint} bytes"
    );
}
