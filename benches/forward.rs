//! Forwarded vs direct upload, with real `graviton serve` processes in cluster mode on one
//! PostgreSQL database (two nodes): throughput of an upload sent straight to the session's
//! owner against the same upload sent to the other node, which streams it to the owner;
//! and the forwarding node's peak RSS during a large forwarded upload.
//!
//! Run: `cargo bench --bench forward` (PostgreSQL from scripts/services.sh or
//! GRAVITON_TEST_DATABASE_URL). `GRAVITON_BENCH_LARGE_GIB` sets the large upload (default 2).
//! The nodes' data directory is a temporary directory, so `TMPDIR=/dev/shm` takes the
//! disk out of the comparison (the file-per-block store of a shared mount writes through
//! the page cache, and other writers on the disk then slow both paths unevenly).
//!
//! Fairness: every upload starts with clean page-cache state (`sync` first, so one
//! upload's writeback does not land in the next one's time), and the rounds alternate
//! which path goes first.
//!
//! `GRAVITON_BENCH_S3=1` puts the blocks on the test S3 server (the cluster's default
//! medium; `source scripts/services.sh` first) instead of a shared mount with fsync off.
//!
//! `GRAVITON_BENCH_PIN=1` pins the owner to CPU 1 and the forwarding node and the client
//! to CPU 0 (`taskset`, every thread), in both paths: the relay's CPU is then not the
//! owner's, as when the forwarding node is another machine, and the owner has one core
//! whichever path is measured. Without it all three processes share every core, so the
//! relay's kernel work (a second loopback hop) comes out of the owner's ingest.
//!
//! CPU: besides wall-clock throughput, the bench reads the CPU time (user + system, from
//! `/proc/<pid>/stat`) that the owner, the forwarding node and the client (this process)
//! spend on each upload. On a shared, loaded box the wall-clock ratio swings with other
//! jobs; the CPU cost ratio (direct CPU / forwarded CPU, all three processes) is what the
//! throughput ratio tends to on a CPU-bound machine, and it is much steadier.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::time::{Duration, Instant};

use graviton::ids::{SessionId, SessionKey, TenantId};
use graviton::placement::hash::shard_of;
use support::cluster::{NodeProcess, is_ready};

const SHARDS: u32 = 16;

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn upload(
    client: &reqwest::Client,
    url: &str,
    key: &SessionKey,
    size: u64,
    seed: u64,
) -> Duration {
    // Generated on the fly in 1 MiB pieces so the client holds no large buffer. Every
    // piece is fresh pseudo-random content: nothing deduplicates, so the owner really
    // stores every block (an earlier version repeated one piece with 8 bytes changed, and
    // the store wrote almost nothing).
    let pieces = size.div_ceil(1 << 20);
    let stream = futures_util::stream::iter((0..pieces).map(move |i| {
        let take = (size - i * (1 << 20)).min(1 << 20) as usize;
        let buf = support::node::random_bytes(take, seed ^ (i + 1).wrapping_mul(0x2545_F491));
        Ok::<_, std::io::Error>(bytes::Bytes::from(buf))
    }));
    let started = Instant::now();
    let response = client
        .post(format!("{url}/v1/blobs"))
        .header("x-graviton-tenant-id", key.tenant.to_string())
        .header("x-graviton-upload-session-id", key.session.to_string())
        .header("content-length", size)
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .expect("upload");
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    started.elapsed()
}

/// CPU time (user + system) of a process so far, in clock ticks.
fn cpu_ticks(pid: &str) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is field 3, utime 14.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(14) + field(15)
}

/// Wall time and CPU of one upload: the owner's, the forwarding node's and the client's.
#[derive(Debug, Clone, Copy, Default)]
struct Cost {
    wall: Duration,
    /// CPU seconds: owner, front, client.
    cpu: [f64; 3],
}

impl Cost {
    fn cpu_total(&self) -> f64 {
        self.cpu.iter().sum()
    }
}

/// [`upload`] after flushing dirty pages, so earlier uploads' writeback is not timed.
async fn timed_upload(
    client: &reqwest::Client,
    url: &str,
    key: &SessionKey,
    size: u64,
    seed: u64,
    pids: &[String; 3],
) -> Cost {
    let _ = std::process::Command::new("sync").status();
    let before = pids.clone().map(|p| cpu_ticks(&p));
    let wall = upload(client, url, key, size, seed).await;
    let after = pids.clone().map(|p| cpu_ticks(&p));
    let tick = 1.0 / 100.0; // USER_HZ
    Cost {
        wall,
        cpu: [0, 1, 2].map(|i| after[i].saturating_sub(before[i]) as f64 * tick),
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let Some(db) = support::TestDatabase::create("bench_forward").await else {
            println!("forward bench: PostgreSQL unavailable; nothing measured");
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        // `GRAVITON_BENCH_S3=1`: blocks on the test S3 server (a cluster's default medium),
        // each node with a data directory of its own; else a shared mount with fsync off.
        let on_s3 = std::env::var("GRAVITON_BENCH_S3").is_ok_and(|v| v == "1");
        let prefix = format!("bench-forward-{}", support::unique_suffix());
        let start = |id: &str| {
            if on_s3 {
                NodeProcess::start_on_s3("bench_forward", dir.path(), id, db.url(), SHARDS, &prefix, "")
                    .expect("GRAVITON_BENCH_S3=1 needs the test S3 server (source scripts/services.sh)")
            } else {
                NodeProcess::start(dir.path(), id, db.url(), SHARDS, &data)
            }
        };
        let owner = start("owner");
        let front = start("front");
        println!("blocks: {}", if on_s3 { "test S3 server (Garage)" } else { "shared mount, fsync off" });
        let client = reqwest::Client::builder().no_proxy().build().expect("client");
        // Ready, and the table settled (no shard in motion, balanced), so the session's
        // owner does not change under the measurement.
        let ready = support::wait_until(Duration::from_secs(60), || async {
            if !(is_ready(&client, &owner.url).await && is_ready(&client, &front.url).await) {
                return false;
            }
            let Ok(status) = graviton::cli::cluster_status(db.url()).await else {
                return false;
            };
            let counts: Vec<usize> = status.nodes.iter().map(|n| n.shards).collect();
            status.moving_shards == 0
                && status.unassigned_shards == 0
                && counts.len() == 2
                && counts.iter().max().unwrap_or(&0) - counts.iter().min().unwrap_or(&0) <= 1
        })
        .await;
        assert!(ready, "nodes not ready");
        // A session owned by "owner".
        let status = graviton::cli::cluster_status(db.url()).await.expect("status");
        let key = loop {
            let key = SessionKey { tenant: TenantId::new_random(), session: SessionId::new_random() };
            let shard = shard_of(&key, SHARDS);
            if status.shards.iter().any(|s| s.shard == shard && s.owner.as_ref().is_some_and(|o| o.as_str() == "owner")) {
                break key;
            }
        };
        let size = 512u64 << 20;
        const ROUNDS: u64 = 4;
        let mbps = |d: Duration| size as f64 / d.as_secs_f64() / 1e6;
        let pids = [
            owner.pid().expect("owner pid").to_string(),
            front.pid().expect("front pid").to_string(),
            "self".to_string(),
        ];
        let pinned = std::env::var("GRAVITON_BENCH_PIN").is_ok_and(|v| v == "1");
        if pinned {
            let own = std::process::id().to_string();
            for (cpu, pid) in [("1", &pids[0]), ("0", &pids[1]), ("0", &own)] {
                let status = std::process::Command::new("taskset")
                    .args(["-a", "-p", "-c", cpu, pid])
                    .stdout(std::process::Stdio::null())
                    .status()
                    .expect("taskset");
                assert!(status.success(), "taskset -a -p -c {cpu} {pid} failed");
            }
            println!("pinned: owner on CPU 1, forwarding node and client on CPU 0");
        }
        let mut direct = Duration::MAX;
        let mut forwarded = Duration::MAX;
        let (mut direct_cpu, mut forwarded_cpu) = ([0.0f64; 3], [0.0f64; 3]);
        for round in 0..ROUNDS {
            let (d, f) = if round % 2 == 0 {
                let d = timed_upload(&client, &owner.url, &key, size, 100 + round, &pids).await;
                (d, timed_upload(&client, &front.url, &key, size, 200 + round, &pids).await)
            } else {
                let f = timed_upload(&client, &front.url, &key, size, 200 + round, &pids).await;
                (timed_upload(&client, &owner.url, &key, size, 100 + round, &pids).await, f)
            };
            println!(
                "  round {round} ({} first): direct {:>7.1} MB/s (CPU s owner/front/client {:.2}/{:.2}/{:.2}), forwarded {:>7.1} MB/s ({:.2}/{:.2}/{:.2}), ratio {:.2}",
                if round % 2 == 0 { "direct" } else { "forwarded" },
                mbps(d.wall),
                d.cpu[0], d.cpu[1], d.cpu[2],
                mbps(f.wall),
                f.cpu[0], f.cpu[1], f.cpu[2],
                d.wall.as_secs_f64() / f.wall.as_secs_f64()
            );
            direct = direct.min(d.wall);
            forwarded = forwarded.min(f.wall);
            for i in 0..3 {
                direct_cpu[i] += d.cpu[i];
                forwarded_cpu[i] += f.cpu[i];
            }
        }
        let (dc, fc) = (
            Cost { cpu: direct_cpu, ..Cost::default() },
            Cost { cpu: forwarded_cpu, ..Cost::default() },
        );
        println!(
            "graviton forward benchmark: {} MiB per upload, best of {ROUNDS}, two serve processes",
            size >> 20
        );
        println!("direct to owner                 {:>8.1} MB/s   (baseline)", mbps(direct));
        println!(
            "forwarded via the other node    {:>8.1} MB/s   ratio vs direct: {:.2}   target >= 0.9",
            mbps(forwarded),
            direct.as_secs_f64() / forwarded.as_secs_f64()
        );
        let per_gib = |cpu: f64| cpu / (ROUNDS as f64 * size as f64 / f64::from(1u32 << 30));
        println!(
            "CPU s per GiB, owner/front/client: direct {:.2}/{:.2}/{:.2} = {:.2}, forwarded {:.2}/{:.2}/{:.2} = {:.2}   CPU cost ratio (direct/forwarded): {:.2}",
            per_gib(dc.cpu[0]), per_gib(dc.cpu[1]), per_gib(dc.cpu[2]), per_gib(dc.cpu_total()),
            per_gib(fc.cpu[0]), per_gib(fc.cpu[1]), per_gib(fc.cpu[2]), per_gib(fc.cpu_total()),
            dc.cpu_total() / fc.cpu_total()
        );

        let gib: u64 = std::env::var("GRAVITON_BENCH_LARGE_GIB").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
        let pid = front.pid().expect("front pid");
        let before = vm_hwm_kib(pid);
        upload(&client, &front.url, &key, gib << 30, 999).await;
        let after = vm_hwm_kib(pid);
        println!(
            "forwarding node peak RSS: {} MiB before, {} MiB after a {} GiB forwarded upload (+{} MiB, target < 64 MiB)",
            before / 1024,
            after / 1024,
            gib,
            after.saturating_sub(before) / 1024
        );
    });
}
