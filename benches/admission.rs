//! Cluster admission throughput against the same machine's Redis baseline.
//!
//! `cargo bench --bench admission` (release). Starts a private `redis-server` on a free
//! port, measures `redis-benchmark -c 32 EVALSHA <trivial script> 0` as the baseline, then
//! runs 32 concurrent tokio clients doing acquire + release through the coordinator, and
//! then through the full `Admission` facade (local permits, lease, holder actor). Prints
//! throughput, the ratio to the baseline, acquire latency percentiles, and Redis CPU per
//! admission (from `INFO cpu`). Environment: `ADMISSION_BENCH_OPS` (default 40000).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use graviton::admission::{
    Admission, AdmissionConfig, AdmissionMetrics, Footprint, Operation, Outcome,
    RedisAdmissionConfig, TransferRequest,
};
use graviton::config::{ByteSize, HumanDuration};
use graviton::ids::TenantId;
use graviton::storage::redis::reply::{AcquireReply, LeaseId};
use graviton::storage::redis::{LeaseRequest, RedisCoordinator};

const CLIENTS: usize = 32;

struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis() -> Server {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server on PATH");
    let server = Server {
        child,
        port,
        _dir: dir,
    };
    for _ in 0..500 {
        if cli(port, &["PING"]).trim() == "PONG" {
            return server;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("redis-server did not start");
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Redis CPU seconds (user + sys) so far.
fn redis_cpu(port: u16) -> f64 {
    cli(port, &["INFO", "cpu"])
        .lines()
        .filter_map(|line| {
            let (key, value) = line.trim().split_once(':')?;
            matches!(key, "used_cpu_sys" | "used_cpu_user").then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// (script calls, total µs inside them) so far, from `INFO commandstats`: `FCALL` (the
/// admission library) plus `EVALSHA` (the baseline's trivial script is measured before).
fn evalsha_stats(port: u16) -> (f64, f64) {
    let text = cli(port, &["INFO", "commandstats"]);
    let mut total = (0.0, 0.0);
    for line in text
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_fcall:"))
    {
        let field = |name: &str| {
            line.split([':', ',', '\r'])
                .find_map(|kv| {
                    kv.strip_prefix(name)?
                        .strip_prefix('=')?
                        .parse::<f64>()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        total.0 += field("calls");
        total.1 += field("usec");
    }
    total
}

/// CPU seconds (user + system) this bench process used so far, from `/proc/self/stat`
/// (clock ticks of 10 ms: runs of a few seconds are exact to about 1 %).
fn own_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is the 12th, stime
    // the 13th of those.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn baseline(port: u16, ops: usize) -> f64 {
    let sha = cli(port, &["SCRIPT", "LOAD", "return 1"])
        .trim()
        .to_string();
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &port.to_string(),
            "-c",
            &CLIENTS.to_string(),
            "-n",
            &ops.to_string(),
            "-q",
            "EVALSHA",
            &sha,
            "0",
        ])
        .output()
        .expect("redis-benchmark");
    let text = String::from_utf8_lossy(&out.stdout);
    // The last carriage-return-separated segment holds "...: <n> requests per second".
    text.rsplit(['\r', '\n'])
        .find_map(|segment| {
            let (_, rest) = segment.split_once(": ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .unwrap_or_else(|| panic!("cannot parse redis-benchmark output: {text:?}"))
}

fn config(port: u16) -> AdmissionConfig {
    AdmissionConfig {
        process_bytes: ByteSize::gib(64),
        tenant_bytes: ByteSize::gib(64),
        tenant_transfers: 100_000,
        backend_transfers: 100_000,
        acquisition_timeout: HumanDuration::secs(30),
        redis: Some(RedisAdmissionConfig {
            url: format!("redis://127.0.0.1:{port}/"),
            cell: "bench".into(),
            service_bytes: ByteSize::gib(1024),
            service_transfers: 1_000_000,
            tenant_bytes: ByteSize::gib(1024),
            tenant_transfers: 1_000_000,
            backend_transfers: 1_000_000,
            ..RedisAdmissionConfig::default()
        }),
        ..AdmissionConfig::default()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

struct Run {
    per_second: f64,
    latencies: Vec<Duration>,
}

async fn coordinator_run(
    coordinator: RedisCoordinator,
    tenants: Arc<Vec<TenantId>>,
    ops: usize,
) -> Run {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let coordinator = coordinator.clone();
        let tenants = tenants.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(ops / CLIENTS);
            for i in 0..ops / CLIENTS {
                let request = LeaseRequest {
                    lease_id: LeaseId::random(),
                    tenant: Some(tenants[(client + i) % tenants.len()]),
                    backend: "fs".into(),
                    bytes: 16 << 20,
                    operation: Operation::Upload.as_str(),
                };
                let t = Instant::now();
                let reply = coordinator
                    .try_acquire(&request, true)
                    .await
                    .expect("acquire");
                latencies.push(t.elapsed());
                let AcquireReply::Admitted { token, .. } = reply else {
                    panic!("rejected: {reply:?}")
                };
                coordinator
                    .release(&request.lease_id, &token, Outcome::Completed.as_str())
                    .await
                    .expect("release");
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    Run {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
    }
}

async fn unbatched_run(
    coordinator: RedisCoordinator,
    tenants: Arc<Vec<TenantId>>,
    ops: usize,
) -> Run {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let coordinator = coordinator.clone();
        let tenants = tenants.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(ops / CLIENTS);
            for i in 0..ops / CLIENTS {
                let request = LeaseRequest {
                    lease_id: LeaseId::random(),
                    tenant: Some(tenants[(client + i) % tenants.len()]),
                    backend: "fs".into(),
                    bytes: 16 << 20,
                    operation: Operation::Upload.as_str(),
                };
                let t = Instant::now();
                let reply = coordinator
                    .try_acquire_unbatched(&request, true)
                    .await
                    .expect("acquire");
                latencies.push(t.elapsed());
                let AcquireReply::Admitted { token, .. } = reply else {
                    panic!("rejected: {reply:?}")
                };
                coordinator
                    .release_unbatched(&request.lease_id, &token, Outcome::Completed.as_str())
                    .await
                    .expect("release");
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    Run {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
    }
}

async fn facade_run(admission: Admission, tenants: Arc<Vec<TenantId>>, ops: usize) -> Run {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..CLIENTS {
        let admission = admission.clone();
        let tenants = tenants.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(ops / CLIENTS);
            for i in 0..ops / CLIENTS {
                let t = Instant::now();
                let permit = admission
                    .admit(TransferRequest {
                        operation: Operation::Upload,
                        tenant: Some(tenants[(client + i) % tenants.len()]),
                        backend: "fs".into(),
                        footprint: Footprint::new(16 << 20).unwrap(),
                    })
                    .await
                    .expect("admit");
                latencies.push(t.elapsed());
                permit.finish(Outcome::Completed).await;
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    Run {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        latencies,
    }
}

fn report(name: &str, run: &Run, baseline: f64, cpu: f64, calls: (f64, f64), client_cpu: f64) {
    let n = run.latencies.len() as f64;
    println!(
        "{name}: {:.0} admissions/s, ratio to baseline {:.2}, acquire p50 {:.3} ms, p99 {:.3} ms, redis CPU {:.1} us/admission, {:.2} script calls/admission, {:.1} us script time/admission, client CPU {:.1} us/admission",
        run.per_second,
        run.per_second / baseline,
        percentile(&run.latencies, 0.50).as_secs_f64() * 1e3,
        percentile(&run.latencies, 0.99).as_secs_f64() * 1e3,
        cpu / n * 1e6,
        calls.0 / n,
        calls.1 / n,
        client_cpu / n * 1e6,
    );
}

fn delta(before: (f64, f64), after: (f64, f64)) -> (f64, f64) {
    (after.0 - before.0, after.1 - before.1)
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let ops: usize = std::env::var("ADMISSION_BENCH_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40_000);
    let server = start_redis();
    let cpu0 = redis_cpu(server.port);
    let base = baseline(server.port, ops * 2);
    let base_cpu = redis_cpu(server.port) - cpu0;
    println!(
        "baseline: redis-benchmark -c {CLIENTS} -n {} EVALSHA <return 1> 0: {base:.0} ops/s, redis CPU {:.1} us/op",
        ops * 2,
        base_cpu / (ops * 2) as f64 * 1e6
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let cfg = config(server.port);
        let admission = Admission::new(&cfg, AdmissionMetrics::default()).unwrap();
        let coordinator = admission.coordinator().unwrap().clone();
        let tenants = Arc::new((0..8).map(|_| TenantId::new_random()).collect::<Vec<_>>());
        coordinator.ping().await.expect("redis reachable");
        // Warm up (script load, connection).
        coordinator_run(coordinator.clone(), tenants.clone(), CLIENTS * 20).await;

        let (cpu, calls, own) = (
            redis_cpu(server.port),
            evalsha_stats(server.port),
            own_cpu(),
        );
        let run = unbatched_run(coordinator.clone(), tenants.clone(), ops / 2).await;
        report(
            "coordinator acquire+release, one script call each (unbatched)",
            &run,
            base,
            redis_cpu(server.port) - cpu,
            delta(calls, evalsha_stats(server.port)),
            own_cpu() - own,
        );

        let (cpu, calls, own) = (
            redis_cpu(server.port),
            evalsha_stats(server.port),
            own_cpu(),
        );
        let run = coordinator_run(coordinator.clone(), tenants.clone(), ops).await;
        report(
            "coordinator acquire+release (batched)",
            &run,
            base,
            redis_cpu(server.port) - cpu,
            delta(calls, evalsha_stats(server.port)),
            own_cpu() - own,
        );

        // The full path with 4, 2 and 1 batch calls in flight per node
        // (`admission.redis.batch_in_flight`): fewer calls in flight, larger batches.
        for in_flight in [4, 2, 1] {
            let mut cfg = config(server.port);
            if let Some(redis) = cfg.redis.as_mut() {
                redis.batch_in_flight = in_flight;
            }
            let admission = Admission::new(&cfg, AdmissionMetrics::default()).unwrap();
            facade_run(admission.clone(), tenants.clone(), CLIENTS * 20).await;
            let (cpu, calls, own) = (
                redis_cpu(server.port),
                evalsha_stats(server.port),
                own_cpu(),
            );
            let run = facade_run(admission.clone(), tenants.clone(), ops).await;
            report(
                &format!(
                    "Admission::admit+finish (local + lease + holder actor), {in_flight} batch call(s) in flight"
                ),
                &run,
                base,
                redis_cpu(server.port) - cpu,
                delta(calls, evalsha_stats(server.port)),
                own_cpu() - own,
            );
        }
        let snap = coordinator.snapshot(None, None).await.unwrap();
        assert_eq!(snap.occupancy.service_transfers, 0, "every lease released");
    });
    // The box is shared: a second baseline at the end shows how much it moved meanwhile.
    let again = baseline(server.port, ops * 2);
    println!("baseline again at the end: {again:.0} ops/s");
}
