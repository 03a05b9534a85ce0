//! Capacity of one PostgreSQL and one shard manager, by simulation (issue 29, item 4).
//!
//! Each cell runs N simulated nodes in this process: every node is a real placement
//! participant started with [`Cluster::start`] (its own registration, heartbeat task, table
//! polling, LISTEN connection and revocation acks, default production timings) against a
//! real PostgreSQL, with the real standalone shard manager ([`run_standalone_manager`]).
//! Per cell, on a fresh database:
//! - start: time until the first N nodes own every shard, balanced, and every node's local
//!   table agrees with PostgreSQL;
//! - join: start 10 % more nodes; time until the same holds over all of them;
//! - steady state over a window: PostgreSQL transactions/s (`pg_stat_database`
//!   `xact_commit + xact_rollback` delta of the cell's database), PostgreSQL CPU (all
//!   processes of the private server, from `/proc`) and this process's CPU (`getrusage`),
//!   each per node per second; connections per node;
//! - manager round: the manager's own round function ([`run_round`]) timed on the idle,
//!   converged cluster under the manager's term (what the actor runs every
//!   `rebalance_interval`), p50 and max over 20 rounds;
//! - kill: drop 10 % of the nodes (their heartbeats stop at once, rows stay); time until
//!   their shards belong to the survivors, balanced, in every survivor's table. This
//!   includes `node_ttl` (2.5 s by default), printed beside it;
//! - table sizes (`pg_total_relation_size`).
//!
//! PostgreSQL: a private server (`initdb` into a temporary directory, durable defaults:
//! fsync and synchronous_commit on; `max_connections` sized for the largest cell), so its
//! CPU and transaction counters are this bench's alone. `GRAVITON_CAPACITY_ADMIN_URL` uses
//! an existing server instead (then the PostgreSQL CPU column is blank).
//!
//! Run: `cargo bench --bench capacity` (release). Environment:
//! - `GRAVITON_CAPACITY_CELLS`: comma-separated `NODESxSHARDS`, default
//!   `10x1024,50x1024,10x4096,50x4096`;
//! - `GRAVITON_CAPACITY_WINDOW_S`: steady-state window, default 10;
//! - `GRAVITON_CAPACITY_DEADLINE_S`: per-phase convergence deadline, default 180.
//!
//! Redis: admissions per second on one primary (a private `redis-server`, no persistence,
//! as `benches/admission.rs` starts it) from 1, 4 and 16 simulated nodes sharing one
//! cell: each node is its own [`Admission`] (its own connections, batcher and lease holder
//! actor), 64 clients in all spread over the nodes, each doing `admit` + `finish`. Printed:
//! admissions/s, Redis CPU per admission (`INFO cpu`) and the primary's ceiling it implies
//! (one core / CPU per admission). `GRAVITON_CAPACITY_REDIS_NODES` (default `1,4,16`, empty
//! to skip), `GRAVITON_CAPACITY_REDIS_OPS` (default 40000).
//!
//! No figure is asserted; a phase that does not converge within its deadline is printed as
//! such, with the state reached.

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use graviton::actors::shard_manager::run_round;
use graviton::actors::{Cluster, ClusterHandle, run_standalone_manager};
use graviton::admission::{
    Admission, AdmissionConfig, AdmissionMetrics, Footprint, Operation, Outcome,
    RedisAdmissionConfig, TransferRequest,
};
use graviton::config::{ByteSize, HumanDuration, Secret};
use graviton::ids::NodeId;
use graviton::ids::TenantId;
use graviton::placement::ClusterConfig;
use graviton::storage::pg::PlacementStore;
use sqlx::{Connection, Executor, PgConnection};
use support::postgres_server::{PostgresServer, Settings};
use support::redis::RedisServer;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) of `pid` and its direct children (the postmaster and its
/// backends), from `/proc`.
fn tree_cpu_secs(root: u32) -> f64 {
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut total = 0u64;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name (which may contain spaces) start after ") ".
        let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // rest[0] = state, [1] = ppid, [11] = utime, [12] = stime.
        let ppid: u32 = fields.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        if pid == root || ppid == root {
            let utime: u64 = fields.get(11).and_then(|s| s.parse().ok()).unwrap_or(0);
            let stime: u64 = fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
            total += utime + stime;
        }
    }
    total as f64 / ticks
}

fn self_cpu_secs() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

// ---------------------------------------------------------------------------------------
// One cell.

fn node_config(url: &str, shard_count: u32, name: &str, manager: bool) -> ClusterConfig {
    let port = 20_000 + (blake3::hash(name.as_bytes()).as_bytes()[0] as u16) * 64;
    ClusterConfig {
        enabled: true,
        database_url: Some(Secret::new(url)),
        shard_count,
        embedded_manager: manager,
        public_addr: format!("{name}.public:7070"),
        internal_addr: format!("127.0.0.1:{port}"),
        control_addr: format!("127.0.0.1:{}", port + 1),
        ..ClusterConfig::default()
    }
}

/// What a convergence check saw.
#[derive(Debug, Default)]
struct Seen {
    assigned: usize,
    moving: usize,
    spread: (usize, usize),
    stale_views: usize,
}

impl Seen {
    fn converged(&self, shards: usize) -> bool {
        self.assigned == shards
            && self.moving == 0
            && self.spread.1 - self.spread.0 <= 1
            && self.stale_views == 0
    }
}

/// Every shard owned by one of `live`, none moving, counts within one of each other, and
/// every live node's local table equal to PostgreSQL's (same owners and epochs).
async fn check(store: &PlacementStore, live: &[(NodeId, ClusterHandle)]) -> Seen {
    let Ok(table) = store.read_table().await else {
        return Seen::default();
    };
    let mut counts: std::collections::HashMap<&NodeId, usize> =
        live.iter().map(|(id, _)| (id, 0)).collect();
    let mut assigned = 0;
    for s in &table.shards {
        if let Some(owner) = &s.owner
            && let Some(c) = counts.get_mut(owner)
        {
            *c += 1;
            assigned += 1;
        }
    }
    let min = counts.values().copied().min().unwrap_or(0);
    let max = counts.values().copied().max().unwrap_or(0);
    let stale_views =
        live.iter()
            .filter(|(_, h)| {
                let view = h.view().table();
                view.shards.len() != table.shards.len()
                    || view.shards.iter().zip(&table.shards).any(|(a, b)| {
                        a.owner != b.owner || a.epoch != b.epoch || a.moving_to.is_some()
                    })
            })
            .count();
    Seen {
        assigned,
        moving: table.moving(),
        spread: (min, max),
        stale_views,
    }
}

/// Poll [`check`] every 100 ms until converged or `deadline` (from now); the elapsed time
/// from `since`, or the last state.
async fn converge(
    store: &PlacementStore,
    live: &[(NodeId, ClusterHandle)],
    shards: usize,
    since: Instant,
    deadline: Duration,
) -> Result<Duration, Seen> {
    let give_up = Instant::now() + deadline;
    loop {
        let seen = check(store, live).await;
        if seen.converged(shards) {
            return Ok(since.elapsed());
        }
        if Instant::now() > give_up {
            return Err(seen);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn show(result: &Result<Duration, Seen>) -> String {
    match result {
        Ok(d) => format!("{:.2} s", d.as_secs_f64()),
        Err(seen) => format!("NOT CONVERGED ({seen:?})"),
    }
}

async fn xacts(conn: &mut PgConnection, db: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = $1",
    )
    .bind(db)
    .fetch_one(conn)
    .await
    .unwrap_or(0)
}

async fn start_nodes(
    url: &str,
    shards: u32,
    pool: &sqlx::PgPool,
    names: impl Iterator<Item = String>,
) -> Vec<(NodeId, ClusterHandle)> {
    // Eight at a time, as a fleet coming up does.
    futures_util::stream::iter(names)
        .map(|name| async move {
            let id = NodeId::parse(&name).unwrap();
            let handle = Cluster::start(
                id.clone(),
                &node_config(url, shards, &name, false),
                "bench",
                pool.clone(),
            )
            .await
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
            (id, handle)
        })
        .buffer_unordered(8)
        .collect()
        .await
}

async fn cell(admin_url: &str, pg_pid: Option<u32>, nodes: usize, shards: u32) {
    let window = Duration::from_secs(env_or("GRAVITON_CAPACITY_WINDOW_S", 10));
    let deadline = Duration::from_secs(env_or("GRAVITON_CAPACITY_DEADLINE_S", 180));
    let db = format!(
        "capacity_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let mut admin = PgConnection::connect(admin_url).await.expect("admin");
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await
        .unwrap();
    let url = format!("{}/{db}", admin_url.rsplit_once('/').unwrap().0);
    let pool = graviton::storage::pg::connect_pool(&url, 2, Duration::from_secs(5), "bench")
        .await
        .expect("pool");
    graviton::storage::pg::migrate(&pool)
        .await
        .expect("migrate");
    let store = PlacementStore::new(pool.clone());
    let manager = run_standalone_manager(
        NodeId::parse("manager").unwrap(),
        &node_config(&url, shards, "manager", true),
    )
    .await
    .expect("manager");
    let ttl = ClusterConfig::default().node_ttl.get();
    let shard_n = shards as usize;
    println!("cell N={nodes} shards={shards}");

    // Start.
    let started = Instant::now();
    let mut live = start_nodes(&url, shards, &pool, (0..nodes).map(|i| format!("n{i}"))).await;
    let registered = started.elapsed();
    let start = converge(&store, &live, shard_n, started, deadline).await;
    println!(
        "  start    {nodes} nodes registered in {:.2} s, converged {}",
        registered.as_secs_f64(),
        show(&start)
    );

    // Join 10 %.
    let joining = nodes.div_ceil(10);
    let joined_at = Instant::now();
    live.extend(
        start_nodes(
            &url,
            shards,
            &pool,
            (nodes..nodes + joining).map(|i| format!("n{i}")),
        )
        .await,
    );
    let join = converge(&store, &live, shard_n, joined_at, deadline).await;
    println!("  join     +{joining} nodes: converged {}", show(&join));

    // Steady state.
    let total = live.len();
    let mut stats = PgConnection::connect(&url).await.expect("stats connection");
    let connections: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
            .bind(&db)
            .fetch_one(&mut stats)
            .await
            .unwrap_or(0);
    let (x0, pg0, me0, t0) = (
        xacts(&mut stats, &db).await,
        pg_pid.map(tree_cpu_secs),
        self_cpu_secs(),
        Instant::now(),
    );
    tokio::time::sleep(window).await;
    let _ = sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut stats)
        .await;
    let (x1, pg1, me1, secs) = (
        xacts(&mut stats, &db).await,
        pg_pid.map(tree_cpu_secs),
        self_cpu_secs(),
        t0.elapsed().as_secs_f64(),
    );
    let per_node = |v: f64| v / total as f64 / secs;
    let pg_cpu = match (pg0, pg1) {
        (Some(a), Some(b)) => format!(
            "{:.2} ms/node/s (total {:.0} %)",
            per_node(b - a) * 1e3,
            (b - a) / secs * 100.0
        ),
        _ => "n/a".into(),
    };
    println!(
        "  steady   {total} nodes over {secs:.1} s: PostgreSQL {:.0} xact/s ({:.2}/node/s), CPU {pg_cpu}; \
         bench process CPU {:.2} ms/node/s (total {:.0} %); {connections} connections ({:.1}/node)",
        (x1 - x0) as f64 / secs,
        per_node((x1 - x0) as f64),
        per_node(me1 - me0) * 1e3,
        (me1 - me0) / secs * 100.0,
        connections as f64 / total as f64,
    );

    // Manager round on the converged cluster, under the manager's term.
    let term = store.meta().await.expect("meta").manager_term;
    let mut rounds = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        match run_round(&store, term, ttl.as_millis() as i64, 64).await {
            Ok(_) => rounds.push(t.elapsed()),
            Err(e) => println!("  round failed: {e}"),
        }
    }
    rounds.sort();
    if !rounds.is_empty() {
        println!(
            "  round    idle manager round p50 {:.1} ms, max {:.1} ms ({} rounds)",
            rounds[rounds.len() / 2].as_secs_f64() * 1e3,
            rounds[rounds.len() - 1].as_secs_f64() * 1e3,
            rounds.len()
        );
    }

    // Kill 10 %: drop their handles (heartbeats stop at once; the rows stay).
    let killed: Vec<_> = live.drain(..joining).collect();
    let killed_at = Instant::now();
    drop(killed);
    let kill = converge(&store, &live, shard_n, killed_at, deadline).await;
    println!(
        "  kill     -{joining} nodes: converged {} (includes node_ttl {:.1} s, counted from their last heartbeat)",
        show(&kill),
        ttl.as_secs_f64()
    );

    // Table sizes.
    let sizes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT relname::text, pg_total_relation_size(oid) FROM pg_class
         WHERE relname IN ('placement_shards', 'placement_nodes', 'placement_meta') ORDER BY relname",
    )
    .fetch_all(&mut stats)
    .await
    .unwrap_or_default();
    let db_size: i64 = sqlx::query_scalar("SELECT pg_database_size(current_database())")
        .fetch_one(&mut stats)
        .await
        .unwrap_or(0);
    let sizes: Vec<String> = sizes
        .iter()
        .map(|(n, b)| format!("{n} {} KiB", b / 1024))
        .collect();
    println!(
        "  sizes    {}; database {} MiB",
        sizes.join(", "),
        db_size >> 20
    );
    println!(
        "SUMMARY N={nodes} shards={shards} start={} join={} kill={} xact_per_s={:.0} rounds_p50_ms={:.1} rounds_max_ms={:.1}",
        show(&start),
        show(&join),
        show(&kill),
        (x1 - x0) as f64 / secs,
        rounds
            .get(rounds.len() / 2)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
        rounds.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
    );

    for (_, h) in &live {
        h.shutdown().await;
    }
    drop(live);
    manager.shutdown().await;
    pool.close().await;
    let _ = stats.close().await;
    let _ = admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .await;
}

// ---------------------------------------------------------------------------------------
// Redis admissions from nodes sharing one cell.

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn redis_cpu(port: u16) -> f64 {
    redis_cli(port, &["INFO", "cpu"])
        .lines()
        .filter_map(|line| {
            let (key, value) = line.trim().split_once(':')?;
            matches!(key, "used_cpu_sys" | "used_cpu_user").then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

fn admission_config(port: u16) -> AdmissionConfig {
    AdmissionConfig {
        process_bytes: ByteSize::gib(64),
        tenant_bytes: ByteSize::gib(64),
        tenant_transfers: 100_000,
        backend_transfers: 100_000,
        acquisition_timeout: HumanDuration::secs(30),
        redis: Some(RedisAdmissionConfig {
            url: format!("redis://127.0.0.1:{port}/"),
            cell: "capacity".into(),
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

const REDIS_CLIENTS: usize = 64;

/// `ops` admit + finish from [`REDIS_CLIENTS`] clients spread over `nodes`; admissions/s.
async fn admissions(nodes: &[Admission], tenants: &[TenantId], ops: usize) -> f64 {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..REDIS_CLIENTS {
        let admission = nodes[client % nodes.len()].clone();
        let tenants = tenants.to_vec();
        tasks.push(tokio::spawn(async move {
            for i in 0..ops / REDIS_CLIENTS {
                let permit = admission
                    .admit(TransferRequest {
                        operation: Operation::Upload,
                        tenant: Some(tenants[(client + i) % tenants.len()]),
                        backend: "fs".into(),
                        footprint: Footprint::new(16 << 20).unwrap(),
                    })
                    .await
                    .expect("admit");
                permit.finish(Outcome::Completed).await;
            }
        }));
    }
    for task in tasks {
        task.await.expect("client");
    }
    (ops / REDIS_CLIENTS * REDIS_CLIENTS) as f64 / started.elapsed().as_secs_f64()
}

async fn redis_cells(port: u16, node_counts: &[usize], ops: usize) {
    let tenants: Vec<TenantId> = (0..8).map(|_| TenantId::new_random()).collect();
    for &n in node_counts {
        let nodes: Vec<Admission> = (0..n)
            .map(|_| Admission::new(&admission_config(port), AdmissionMetrics::default()).unwrap())
            .collect();
        // Warm up: connections, function load.
        admissions(&nodes, &tenants, REDIS_CLIENTS * 10).await;
        let (cpu0, me0) = (redis_cpu(port), self_cpu_secs());
        let rate = admissions(&nodes, &tenants, ops).await;
        let (cpu, me) = (redis_cpu(port) - cpu0, self_cpu_secs() - me0);
        let done = (ops / REDIS_CLIENTS * REDIS_CLIENTS) as f64;
        let us = cpu / done * 1e6;
        println!(
            "redis    {n:>2} nodes, one cell, {REDIS_CLIENTS} clients: {rate:.0} admissions/s, \
             Redis CPU {us:.1} us/admission (ceiling ~{:.0}/s per primary core), Redis busy {:.0} %, \
             client CPU {:.1} us/admission",
            1e6 / us,
            us * rate / 1e4,
            me / done * 1e6
        );
        println!(
            "SUMMARY redis nodes={n} admissions_per_s={rate:.0} redis_us_per_admission={us:.1}"
        );
    }
}

fn main() {
    let cells: Vec<(usize, u32)> = std::env::var("GRAVITON_CAPACITY_CELLS")
        .unwrap_or_else(|_| "10x1024,50x1024,10x4096,50x4096".into())
        .split(',')
        .filter(|c| !c.trim().is_empty())
        .map(|c| {
            let (n, s) = c.trim().split_once('x').expect("NODESxSHARDS");
            (n.parse().expect("nodes"), s.parse().expect("shards"))
        })
        .collect();
    let max_nodes = cells.iter().map(|c| c.0).max().unwrap_or(10);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (server, admin_url) = match std::env::var("GRAVITON_CAPACITY_ADMIN_URL") {
        Ok(url) => (None, url),
        Err(_) if cells.is_empty() => (None, String::new()),
        Err(_) => {
            // Up to four connections per node (placement pool 2, heartbeat 1, LISTEN 1),
            // the manager's, and headroom.
            let settings = Settings {
                max_connections: (max_nodes as u32 * 11 / 10 + 2) * 4 + 40,
                fsync: true,
            };
            let server = PostgresServer::start_with("capacity bench", settings)
                .expect("PostgreSQL server binaries (initdb, pg_ctl)");
            let url = server.admin_url();
            (Some(server), url)
        }
    };
    let pg_pid = server.as_ref().and_then(|s| s.postmaster_pid());
    println!(
        "capacity bench: PostgreSQL {}, default cluster timings (heartbeat 500 ms, poll 1 s, node_ttl 2.5 s, rebalance 500 ms, move_budget 64), {} cores, load {}",
        if server.is_some() {
            "private server (fsync on)"
        } else {
            "GRAVITON_CAPACITY_ADMIN_URL"
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    for (nodes, shards) in cells {
        runtime.block_on(cell(&admin_url, pg_pid, nodes, shards));
    }
    drop(server);
    let redis_nodes: Vec<usize> = std::env::var("GRAVITON_CAPACITY_REDIS_NODES")
        .unwrap_or_else(|_| "1,4,16".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    if !redis_nodes.is_empty() {
        let redis = RedisServer::start("capacity bench").expect("redis-server on PATH");
        runtime.block_on(redis_cells(
            redis.port(),
            &redis_nodes,
            env_or("GRAVITON_CAPACITY_REDIS_OPS", 40_000),
        ));
    }
}
