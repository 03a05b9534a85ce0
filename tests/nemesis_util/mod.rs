//! The nemesis harness: a cluster of real processes on a fresh database, one PostgreSQL role
//! per process, client load recording a history, a shard-table sampler, fault bookkeeping,
//! the owner-side ownership records read from the nodes' logs, and the after-run checks
//! of docs/locality.md §13 (LOC-1..LOC-6).
//!
//! Reproducible from a seed: `GRAVITON_NEMESIS_SEED` (random when unset, printed at start);
//! each scenario iteration derives its own seed from it. `GRAVITON_NEMESIS_ITERATIONS`
//! (default 1) repeats every scenario on a fresh cluster.

pub mod history;
pub mod load;
pub mod pg;
pub mod procs;
pub mod records;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use graviton::cli::ClusterStatus;
use graviton::ids::SessionKey;
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio_util::sync::CancellationToken;

use crate::support::TestDatabase;
use crate::support::node::random_bytes;
use crate::support::pg_proxy::{PgProxy, upstream_of, url_through};
use crate::support::postgres_server::PostgresServer;
use history::{ShardSample, TxSnapshot, Violation};
use load::{History, Target};
use pg::{Pg, Roles};
use procs::{Kind, Proc};

pub const SHARDS: u32 = 16;

/// The run's seed (printed once per scenario so a failure can be replayed).
pub fn base_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("GRAVITON_NEMESIS_SEED") {
        Ok(text) => text.trim().parse().expect("GRAVITON_NEMESIS_SEED is a u64"),
        Err(_) => rand::random(),
    })
}

pub fn iterations() -> usize {
    std::env::var("GRAVITON_NEMESIS_ITERATIONS")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(1)
        .clamp(1, 1000)
}

/// The seed of one scenario iteration.
pub fn scenario_rng(scenario: &str, iteration: usize) -> (u64, StdRng) {
    let mut seed = base_seed() ^ (iteration as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for b in scenario.bytes() {
        seed = seed.rotate_left(5) ^ b as u64;
    }
    (seed, StdRng::seed_from_u64(seed))
}

/// A cluster under test. Fields drop in order: processes first, the database, then roles.
pub struct Cluster {
    pub scenario: String,
    pub nodes: Vec<Proc>,
    pub manager: Option<Proc>,
    pub pg: Pg,
    pub history: History,
    pub samples: Arc<Mutex<Vec<ShardSample>>>,
    /// Transaction snapshots of the test's own connection (LOC-1's commit windows).
    pub snapshots: Arc<Mutex<Vec<TxSnapshot>>>,
    pub faults: Vec<String>,
    pub violations: Vec<Violation>,
    pub stop: CancellationToken,
    sampler: Option<tokio::task::JoinHandle<()>>,
    snapshot_sampler: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
    db: TestDatabase,
    _roles: Roles,
    /// The private PostgreSQL server the cluster runs on, if any (dropped last).
    pub server: Option<PostgresServer>,
    /// The proxy in front of one node's PostgreSQL connections, if any, and that node.
    pub proxy: Option<(usize, PgProxy)>,
}

fn admin_url() -> String {
    std::env::var("GRAVITON_TEST_DATABASE_URL")
        .unwrap_or_else(|_| crate::support::postgres::DEFAULT_ADMIN_URL.to_string())
}

impl Cluster {
    /// Start `n` nodes (and a standalone manager when `standalone_manager`) and wait until
    /// the cluster converged. `None` when PostgreSQL is missing (loud skip).
    pub async fn start(scenario: &str, n: usize, standalone_manager: bool) -> Option<Self> {
        Self::start_on(scenario, n, standalone_manager, None).await
    }

    /// [`Cluster::start`] on `server` (a private PostgreSQL the scenario may restart)
    /// instead of the machine's shared one.
    pub async fn start_on(
        scenario: &str,
        n: usize,
        standalone_manager: bool,
        server: Option<PostgresServer>,
    ) -> Option<Self> {
        Self::start_with(scenario, n, standalone_manager, server, None).await
    }

    /// [`Cluster::start_on`] with node `proxied` (an index) connected to PostgreSQL
    /// through a [`PgProxy`] the scenario can make delay or black-hole its connections.
    pub async fn start_with(
        scenario: &str,
        n: usize,
        standalone_manager: bool,
        server: Option<PostgresServer>,
        proxied: Option<usize>,
    ) -> Option<Self> {
        let admin = server
            .as_ref()
            .map(PostgresServer::admin_url)
            .unwrap_or_else(admin_url);
        let mut roles = Roles::new(&admin);
        let db = TestDatabase::create_on(scenario, &admin).await?;
        graviton::cli::migrate(db.url())
            .await
            .expect("migrate as admin");
        let pg = Pg {
            url: db.url().to_string(),
            db: db.name().to_string(),
        };
        let dir = tempfile::tempdir().unwrap();
        let suffix = crate::support::unique_suffix();
        // Blocks on the test S3 server (one prefix per cluster), each process with a
        // directory of its own; the block index is the cluster's PostgreSQL.
        let prefix = format!("nemesis-{scenario}-{suffix}");
        let storage = |id: &str| {
            crate::support::cluster::s3_storage_toml(scenario, &dir.path().join(id), &prefix, "")
        };
        let proxy = match proxied {
            Some(i) => Some((i, PgProxy::start(upstream_of(&pg.url)).await)),
            None => None,
        };
        let mut nodes = Vec::new();
        for i in 0..n {
            let id = format!("node-{}", (b'a' + i as u8) as char);
            let role = format!("gnem_{suffix}_{}", (b'a' + i as u8) as char);
            let mut url = pg.create_role(&mut roles, &role).await;
            if let Some((p, proxy)) = &proxy
                && *p == i
            {
                url = url_through(&url, proxy.port);
            }
            let kind = Kind::Node {
                embedded_manager: !standalone_manager,
            };
            let storage = storage(&id)?;
            nodes.push(Proc::start(
                dir.path(),
                &id,
                &role,
                &url,
                SHARDS,
                kind,
                &storage,
            ));
        }
        let manager = if standalone_manager {
            let role = format!("gnem_{suffix}_mgr");
            let url = pg.create_role(&mut roles, &role).await;
            Some(Proc::start(
                dir.path(),
                "manager-1",
                &role,
                &url,
                SHARDS,
                Kind::Manager,
                &storage("manager-1")?,
            ))
        } else {
            None
        };
        let history = History::new(SHARDS);
        let samples = Arc::new(Mutex::new(Vec::new()));
        let snapshots = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let sampler = pg.sampler(
            history.t0,
            Duration::from_millis(50),
            samples.clone(),
            stop.clone(),
        );
        let (pg_for_snapshots, stop_for_snapshots, t0) = (pg.clone(), stop.clone(), history.t0);
        let mut cluster = Self {
            scenario: scenario.to_string(),
            nodes,
            manager,
            pg,
            history,
            samples,
            snapshots: snapshots.clone(),
            faults: Vec::new(),
            violations: Vec::new(),
            stop,
            sampler: Some(sampler),
            snapshot_sampler: Some(pg_for_snapshots.snapshot_sampler(
                t0,
                Duration::from_millis(5),
                snapshots,
                stop_for_snapshots,
            )),
            _dir: dir,
            db,
            _roles: roles,
            server,
            proxy,
        };
        if !cluster.converged(Duration::from_secs(60)).await {
            let logs: String = cluster
                .nodes
                .iter()
                .map(|n| format!("---- {} log tail ----\n{}\n", n.id, n.log_tail(25)))
                .collect();
            panic!(
                "{scenario}: cluster did not converge within 60 s: {}\n{logs}",
                cluster.convergence_report().await
            );
        }
        Some(cluster)
    }

    pub fn targets(&self) -> Arc<Vec<Target>> {
        Arc::new(
            self.nodes
                .iter()
                .map(|n| Target {
                    id: n.id.clone(),
                    url: n.url.clone(),
                })
                .collect(),
        )
    }

    pub async fn status(&self) -> Option<ClusterStatus> {
        graviton::cli::cluster_status(self.db.url()).await.ok()
    }

    /// Current owner of `key`'s shard in PostgreSQL.
    pub async fn owner_of(&self, key: &SessionKey) -> Option<String> {
        let shard = self.history.shard(key);
        let status = self.status().await?;
        status
            .shards
            .iter()
            .find(|s| s.shard.0 == shard)
            .and_then(|s| s.owner.clone())
            .map(|o| o.to_string())
    }

    pub async fn shards_of(&self, node: &str) -> HashSet<u32> {
        self.status()
            .await
            .map(|s| {
                s.shards
                    .iter()
                    .filter(|e| e.owner.as_ref().is_some_and(|o| o.as_str() == node))
                    .map(|e| e.shard.0)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Note a fault in the printed log.
    pub fn fault(&mut self, what: impl Into<String>) {
        let line = format!(
            "{:>8.3}s {}",
            self.history.t0.elapsed().as_secs_f64(),
            what.into()
        );
        eprintln!("NEMESIS {} fault {line}", self.scenario);
        self.faults.push(line);
    }

    /// Restart a standalone manager that exited (the test plays the process supervisor).
    pub fn supervise_manager(&mut self) {
        if let Some(manager) = self.manager.as_mut()
            && let Some(status) = manager.exited()
        {
            eprintln!(
                "NEMESIS {} standalone manager exited ({status}); restarting it",
                self.scenario
            );
            manager.reap();
            manager.spawn();
        }
    }

    /// Every running node ready, every shard assigned to a live node with shards on every
    /// running node, and an acting manager (advisory lock held).
    pub async fn converged(&mut self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        loop {
            self.supervise_manager();
            if self.is_converged(&client).await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn is_converged(&self, client: &reqwest::Client) -> bool {
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            if !crate::support::cluster::is_ready(client, &node.url).await {
                return false;
            }
        }
        let Some(status) = self.status().await else {
            return false;
        };
        let running: HashSet<&str> = self
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(|n| n.id.as_str())
            .collect();
        status.unassigned_shards == 0
            && status.manager_node.is_some()
            && status.shards.iter().all(|s| {
                s.owner
                    .as_ref()
                    .is_some_and(|o| running.contains(o.as_str()))
            })
            && running.iter().all(|id| {
                status
                    .nodes
                    .iter()
                    .any(|n| n.id.as_str() == *id && n.shards > 0)
            })
            && self.pg.manager_lock_held().await
    }

    /// LOC-3: the cluster regains an acting manager and converges after the faults.
    pub async fn check_manager(&mut self, within: Duration, when: &str) {
        if !self.converged(within).await {
            let report = self.convergence_report().await;
            let tail = self
                .manager
                .as_ref()
                .map(|m| m.log_tail(15))
                .unwrap_or_default();
            self.violations.push(Violation::new(
                "LOC-3",
                format!(
                    "{when}: no acting manager / no convergence within {within:?}: {report}\n\
                     manager log tail:\n{tail}"
                ),
            ));
        }
    }

    /// What convergence waits for, as the cluster shows it now: the manager lock, the
    /// term and manager, unassigned shards, and every node's state and shard count.
    async fn convergence_report(&self) -> String {
        let status = self.status().await;
        let lock = self.pg.manager_lock_held().await;
        format!(
            "lock held={lock}, term={:?}, manager={:?}, unassigned={:?}, nodes={:?}",
            status.as_ref().map(|s| s.manager_term),
            status.as_ref().and_then(|s| s.manager_node.clone()),
            status.as_ref().map(|s| s.unassigned_shards),
            status.as_ref().map(|s| s
                .nodes
                .iter()
                .map(|n| format!("{}:{:?}:{}", n.id, n.state, n.shards))
                .collect::<Vec<_>>()),
        )
    }

    /// Stop the client load and collect every worker (a worker that panicked fails the
    /// test), then require at least `min_acked` acknowledged uploads: a load-bearing
    /// scenario cannot pass LOC-1, -2, -4, -5 or -6 with no load. Prints the count.
    pub async fn stop_load(
        &mut self,
        stop: CancellationToken,
        workers: Vec<tokio::task::JoinHandle<()>>,
        min_acked: u64,
    ) {
        stop.cancel();
        for (i, worker) in workers.into_iter().enumerate() {
            if let Err(e) = worker.await {
                panic!("{}: load worker {i} failed: {e}", self.scenario);
            }
        }
        let acked = self
            .history
            .acked_ops
            .load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "NEMESIS {} load: {acked} acknowledged uploads (at least {min_acked} required)",
            self.scenario
        );
        if acked < min_acked {
            self.violations.push(Violation::new(
                "LOAD",
                format!(
                    "too little load to check anything: {acked} acknowledged uploads, at least \
                     {min_acked} required"
                ),
            ));
        }
    }

    /// LOC-7: no logical upload failed after the client's bounded retries of documented
    /// retryable answers (`load::MAX_ATTEMPTS`). Prints the count either way.
    pub fn check_no_failed_uploads(&mut self) {
        let failures = self.history.failures.lock().unwrap().clone();
        let acked = self
            .history
            .acked_ops
            .load(std::sync::atomic::Ordering::Relaxed);
        eprintln!(
            "NEMESIS {} LOC-7 uploads: {acked} succeeded, {} failed after retries (budget {} attempts)",
            self.scenario,
            failures.len(),
            load::MAX_ATTEMPTS
        );
        for f in failures {
            self.violations
                .push(Violation::new("LOC-7", format!("failed upload: {f}")));
        }
    }

    /// LOC-2: every acknowledged blob downloads byte-exact from every node.
    pub async fn check_reads(&mut self) {
        let acked = history::acknowledged(&self.history.snapshot());
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        for (key, len, seed) in &acked {
            let want = random_bytes(*len, *seed);
            for node in self.nodes.iter().filter(|n| n.is_running()) {
                let mut last = String::new();
                let mut ok = false;
                for _ in 0..3 {
                    match client
                        .get(format!("{}/v1/blobs/{key}", node.url))
                        .send()
                        .await
                    {
                        Ok(r) if r.status() == 200 => match r.bytes().await {
                            Ok(got) if got[..] == want[..] => {
                                ok = true;
                                break;
                            }
                            Ok(got) => last = format!("{} bytes differ from {len}", got.len()),
                            Err(e) => last = format!("body: {e}"),
                        },
                        Ok(r) => last = format!("status {}", r.status()),
                        Err(e) => last = format!("transport: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                if !ok {
                    self.violations.push(Violation::new(
                        "LOC-2",
                        format!(
                            "acknowledged blob {key} not readable from {}: {last}",
                            node.id
                        ),
                    ));
                }
            }
        }
        eprintln!(
            "NEMESIS {} LOC-2 read back {} acknowledged blobs from {} nodes",
            self.scenario,
            acked.len(),
            self.nodes.iter().filter(|n| n.is_running()).count()
        );
    }

    /// Stop the sampler, run every check, print the report and panic on violations.
    pub async fn finish(mut self, seed: u64, iteration: usize) {
        let broken = self.violations.iter().any(|v| v.invariant == "LOC-3");
        let bound = Duration::from_secs(if broken { 5 } else { 30 });
        self.check_manager(bound, "after the run").await;
        self.stop.cancel();
        if let Some(sampler) = self.sampler.take() {
            let _ = sampler.await;
        }
        if let Some(sampler) = self.snapshot_sampler.take() {
            let _ = sampler.await;
        }
        self.check_reads().await;
        let attempts = self.history.snapshot();
        let samples = self.samples.lock().unwrap().clone();
        let logs: Vec<&std::path::Path> = self.nodes.iter().map(|n| n.log_path()).collect();
        let records = records::read_logs(&logs);
        let t0_us = self.history.t0_unix_us;
        // LOC-1's windows from the stores and the clients (not the nodes' records).
        let rows = self.pg.manifest_rows(t0_us).await;
        let snapshots = self.snapshots.lock().unwrap().clone();
        let windows = history::store_windows(&attempts, &rows, &snapshots);
        let mut violations = history::check(&attempts, &samples, &windows);
        violations.extend(records::check(&attempts, &records, t0_us));
        violations.append(&mut self.violations);
        let ops = attempts.iter().map(|a| a.op).collect::<HashSet<_>>().len();
        eprintln!(
            "NEMESIS scenario={} iteration={} seed={seed} base_seed={} operations={ops} attempts={} \
             acked_ops={} failed_ops={} shard_samples={} owner_begins={} owner_commits={} \
             faults={} violations={}",
            self.scenario,
            iteration,
            base_seed(),
            attempts.len(),
            self.history
                .acked_ops
                .load(std::sync::atomic::Ordering::Relaxed),
            self.history
                .failed_ops
                .load(std::sync::atomic::Ordering::Relaxed),
            samples.len(),
            records.iter().filter(|r| r.commit.is_none()).count(),
            records.iter().filter(|r| r.commit.is_some()).count(),
            self.faults.len(),
            violations.len()
        );
        eprintln!(
            "NEMESIS {} outcomes: {}",
            self.scenario,
            history::summary(&attempts)
        );
        for f in &self.faults {
            eprintln!("NEMESIS {}   fault {f}", self.scenario);
        }
        if violations.is_empty() {
            return;
        }
        let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
        for v in &violations {
            let kind = v.detail.split(':').next().unwrap_or_default();
            *kinds.entry(format!("{} {kind}", v.invariant)).or_default() += 1;
        }
        eprintln!("NEMESIS {} violations by kind: {kinds:?}", self.scenario);
        let mut shown_kinds: std::collections::HashMap<String, usize> = Default::default();
        let mut shown_sessions = HashSet::new();
        for v in &violations {
            let kind = format!(
                "{} {}",
                v.invariant,
                v.detail.split(':').next().unwrap_or_default()
            );
            let count = shown_kinds.entry(kind).or_default();
            *count += 1;
            if *count > 5 {
                continue;
            }
            eprintln!("NEMESIS {} VIOLATION {v}", self.scenario);
            if let Some(session) = attempts
                .iter()
                .map(|a| a.session.as_str())
                .find(|s| v.detail.contains(s))
                && shown_sessions.len() < 2
                && shown_sessions.insert(session.to_string())
            {
                let lines = history::session_history(&attempts, session);
                for line in lines.iter().take(16) {
                    eprintln!("NEMESIS {}     {session}: {line}", self.scenario);
                }
                if lines.len() > 16 {
                    eprintln!(
                        "NEMESIS {}     ... {} more attempts",
                        self.scenario,
                        lines.len() - 16
                    );
                }
            }
        }
        for node in &self.nodes {
            eprintln!("---- {} log tail ----\n{}", node.id, node.log_tail(25));
        }
        panic!(
            "{}: {} violation(s), first: {} (replay with GRAVITON_NEMESIS_SEED={})",
            self.scenario,
            violations.len(),
            violations[0],
            base_seed()
        );
    }
}
