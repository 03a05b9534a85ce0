//! The handoff guarantee: at most one node ingests a given session at any instant, through
//! drains, budgeted rebalances and a silent node's TTL expiry.
//!
//! Every node runs workers that try to ingest every session, gated only by
//! `begin_ingest(shard, epoch)` from the node's own view. Each ingest records (node,
//! session, epoch, start, end), with start taken after the permit is granted and end before
//! it is dropped; the ingest also ends early when the permit is revoked. Afterwards the
//! checker asserts that no two nodes' intervals for the same session overlap, and that
//! epochs only grow across owners.

#[allow(unused_imports)]
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use graviton::actors::ClusterHandle;
use graviton::ids::{NodeId, SessionKey};
use rand::Rng;
use support::TestDatabase;
use support::placement::{eventually, random_key, settled, start_node};

const GENEROUS: Duration = Duration::from_secs(20);

#[derive(Clone, Debug)]
struct Ingest {
    node: String,
    session: usize,
    epoch: i64,
    start: Instant,
    end: Instant,
}

fn spawn_worker(
    handle: Arc<ClusterHandle>,
    sessions: Arc<Vec<SessionKey>>,
    log: Arc<Mutex<Vec<Ingest>>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let node = handle.node_id().to_string();
        while !stop.load(Ordering::SeqCst) {
            let i = rand::rng().random_range(0..sessions.len());
            let key = &sessions[i];
            let Ok(owner) = handle.resolve(key) else {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            };
            let Some(permit) = handle.begin_ingest(owner.shard, owner.epoch) else {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            };
            let start = Instant::now();
            let work = Duration::from_millis(rand::rng().random_range(1..25));
            tokio::select! {
                _ = tokio::time::sleep(work) => {}
                _ = permit.revoked() => {}
            }
            let end = Instant::now();
            log.lock().unwrap().push(Ingest {
                node: node.clone(),
                session: i,
                epoch: permit.epoch().0,
                start,
                end,
            });
            drop(permit);
        }
    })
}

/// Ingest workers on several nodes over one set of sessions (see [`spawn_worker`]).
struct Workers {
    sessions: Arc<Vec<SessionKey>>,
    log: Arc<Mutex<Vec<Ingest>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Workers {
    /// `per_node` workers on each of `nodes`, over `sessions` random sessions.
    fn start(nodes: &[&Arc<ClusterHandle>], sessions: usize, per_node: usize) -> Self {
        let mut workers = Self {
            sessions: Arc::new((0..sessions).map(|_| random_key()).collect()),
            log: Arc::new(Mutex::new(Vec::new())),
            stop: Arc::new(AtomicBool::new(false)),
            tasks: Vec::new(),
        };
        for node in nodes {
            workers.add(node, per_node);
        }
        workers
    }

    /// `per_node` more workers on `node`.
    fn add(&mut self, node: &Arc<ClusterHandle>, per_node: usize) {
        for _ in 0..per_node {
            self.tasks.push(spawn_worker(
                node.clone(),
                self.sessions.clone(),
                self.log.clone(),
                self.stop.clone(),
            ));
        }
    }

    /// Stop the workers; the recorded ingests and the number of sessions.
    async fn finish(self) -> (Vec<Ingest>, usize) {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await.unwrap();
        }
        let events = self.log.lock().unwrap().clone();
        (events, self.sessions.len())
    }
}

fn check_no_overlap(events: &[Ingest], sessions: usize) -> (usize, usize) {
    let mut handed_over = 0;
    for s in 0..sessions {
        let mut mine: Vec<&Ingest> = events.iter().filter(|e| e.session == s).collect();
        mine.sort_by_key(|e| e.start);
        for (i, x) in mine.iter().enumerate() {
            for y in &mine[i + 1..] {
                if x.node != y.node {
                    assert!(
                        x.end <= y.start || y.end <= x.start,
                        "session {s}: {} (epoch {}) and {} (epoch {}) ingested at overlapping times",
                        x.node,
                        x.epoch,
                        y.node,
                        y.epoch
                    );
                }
            }
        }
        // Ownership changes always come with a higher epoch.
        for w in mine.windows(2) {
            if w[0].node != w[1].node {
                assert!(
                    w[1].epoch > w[0].epoch,
                    "session {s}: owner changed without an epoch bump"
                );
                handed_over += 1;
            }
        }
    }
    (events.len(), handed_over)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_nodes_ingest_a_session_at_once() {
    let Some(db) = TestDatabase::create("no_two_nodes_ingest_a_session_at_once").await else {
        return;
    };
    // A small move budget makes the rebalance after a join take several rounds.
    let tweak = |c: &mut graviton::placement::ClusterConfig| c.move_budget = 4;
    let a = Arc::new(start_node(db.url(), "a", tweak).await);
    let b = Arc::new(start_node(db.url(), "b", tweak).await);
    let c = Arc::new(start_node(db.url(), "c", tweak).await);
    eventually(GENEROUS, "balanced", || {
        settled(&[&a, &b, &c], &["a", "b", "c"])
    })
    .await;

    let mut workers = Workers::start(&[&a, &b, &c], 48, 3);
    tokio::time::sleep(Duration::from_millis(300)).await; // let ingest traffic build up

    // 1. Drain c.
    a.drain(&NodeId::parse("c").unwrap()).await.unwrap();
    eventually(GENEROUS, "c drained", || {
        settled(&[&a, &b, &c], &["a", "b"])
    })
    .await;

    // 2. A new node joins: budgeted rebalance over several rounds. Once it is under way the
    //    manager loses its lock connection; a standby (or the same node again) takes over
    //    with a newer term and finishes whatever moves are still pending.
    let d = Arc::new(start_node(db.url(), "d", tweak).await);
    workers.add(&d, 3);
    eventually(GENEROUS, "rebalance under way", || {
        support::placement::owned(&a, "d") > 0
    })
    .await;
    let admin = support::placement::store(db.url()).await;
    let term_before = admin.meta().await.unwrap().manager_term;
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .execute(admin.pool())
    .await
    .unwrap();
    eventually(GENEROUS, "d joined", || {
        settled(&[&a, &b, &d], &["a", "b", "d"])
    })
    .await;
    let since = Instant::now();
    while admin.meta().await.unwrap().manager_term <= term_before {
        assert!(since.elapsed() < GENEROUS, "no manager took over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 3. b goes silent (no drain): its shards move only after the TTL.
    b.shutdown().await;
    eventually(GENEROUS, "b's shards reassigned", || {
        settled(&[&a, &d], &["a", "d"])
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await; // traffic on the final placement

    let (events, sessions) = workers.finish().await;
    let (total, handed_over) = check_no_overlap(&events, sessions);
    println!("FIGURE handoff_checker ingests={total} owner_changes={handed_over}");
    assert!(total > 200, "too little traffic to mean anything: {total}");
    assert!(
        handed_over >= 10,
        "the scenario should move many sessions: {handed_over}"
    );
    for h in [a, c, d] {
        h.shutdown().await;
    }
}

/// A node cut off from PostgreSQL (its role can no longer log in, its sessions are
/// terminated) while its process keeps running: it must fence itself before the manager
/// hands its shards to another node, and rejoin as a new incarnation afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_node_fences_itself_before_its_shards_move() {
    let Some(db) =
        TestDatabase::create("partitioned_node_fences_itself_before_its_shards_move").await
    else {
        return;
    };
    let a = Arc::new(start_node(db.url(), "a", |_| {}).await);
    // b connects as its own role so that only b can be cut off.
    let role = format!("node_b_{}", support::unique_suffix());
    let admin = support::placement::store(db.url()).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {role} LOGIN SUPERUSER"
    )))
    .execute(admin.pool())
    .await
    .unwrap();
    let _role_guard = TempRole(role.clone());
    let b_url = db.url().replacen("postgres@", &format!("{role}@"), 1);
    assert_ne!(
        b_url,
        db.url(),
        "test database URL must name the postgres user"
    );
    let b = Arc::new(start_node(&b_url, "b", |c| c.embedded_manager = false).await);
    eventually(GENEROUS, "balanced", || settled(&[&a, &b], &["a", "b"])).await;

    let workers = Workers::start(&[&a, &b], 32, 3);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Partition b.
    let cut = Instant::now();
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER ROLE {role} NOLOGIN")))
        .execute(admin.pool())
        .await
        .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
        .bind(&role)
        .execute(admin.pool())
        .await
        .unwrap();
    let fenced_after = eventually(GENEROUS, "b fences itself", || b.view().fenced()).await;
    let stale = b.view().table();
    let moved_after = eventually(GENEROUS, "b's shards moved to a", || {
        let t = a.view().table();
        t.owned_by(&NodeId::parse("b").unwrap()) == 0 && t.moving() == 0
    })
    .await;
    println!(
        "FIGURE partition fenced_after_ms={} reassigned_after_ms={} (self_fence=400ms node_ttl=1000ms)",
        fenced_after.as_millis(),
        cut.elapsed().max(moved_after).as_millis()
    );
    // b still believes (stale table) that it owns its shards, yet admits nothing.
    let b_id = NodeId::parse("b").unwrap();
    let mine: Vec<_> = stale
        .shards
        .iter()
        .filter(|s| s.owner.as_ref() == Some(&b_id))
        .collect();
    assert!(!mine.is_empty());
    assert!(mine.iter().all(|s| !b.can_ingest(s.shard, s.epoch)));

    // Heal: b learns it was declared dead, re-registers and gets shards again.
    sqlx::query(sqlx::AssertSqlSafe(format!("ALTER ROLE {role} LOGIN")))
        .execute(admin.pool())
        .await
        .unwrap();
    eventually(GENEROUS, "b rejoined and balanced", || {
        settled(&[&a, &b], &["a", "b"])
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let (events, sessions) = workers.finish().await;
    let (total, handed_over) = check_no_overlap(&events, sessions);
    println!("FIGURE partition_checker ingests={total} owner_changes={handed_over}");
    assert!(handed_over >= 4, "{handed_over}");
    a.shutdown().await;
    b.shutdown().await;
    admin.pool().close().await;
}

/// Issue 9, item 1. A node declared dead comes back while its table reads still fail:
/// its heartbeats succeed again, but its last table (read before it was declared dead)
/// still lists shards that now belong to another node. It must not ingest them: the fence
/// lifts only with a table read after the re-registration. Checks LOC-1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_declared_dead_rejoins_fenced_until_it_rereads_the_table() {
    let Some(db) =
        TestDatabase::create("a_node_declared_dead_rejoins_fenced_until_it_rereads_the_table")
            .await
    else {
        return;
    };
    let a = Arc::new(start_node(db.url(), "a", |_| {}).await);
    // b connects as an ordinary role, so that a REVOKE applies to it.
    let role = format!("node_b_{}", support::unique_suffix());
    let admin = support::placement::store(db.url()).await;
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE, CREATE ON SCHEMA public TO {role}"),
        format!("GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"),
        format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(admin.pool())
            .await
            .unwrap();
    }
    let _role_guard = TempRole(role.clone());
    let b_url = db.url().replacen("postgres@", &format!("{role}@"), 1);
    let b = Arc::new(
        start_node(&b_url, "b", |c| {
            c.embedded_manager = false;
            c.listen_notify = false;
        })
        .await,
    );
    eventually(GENEROUS, "balanced", || settled(&[&a, &b], &["a", "b"])).await;

    let workers = Workers::start(&[&a, &b], 32, 3);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Cut b off until it is declared dead and its shards are on a.
    let run = |sql: String| {
        let pool = admin.pool().clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    run(format!("ALTER ROLE {role} NOLOGIN")).await;
    run(format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .await;
    let b_id = NodeId::parse("b").unwrap();
    eventually(GENEROUS, "b's shards moved to a", || {
        let t = a.view().table();
        t.owned_by(&b_id) == 0 && t.moving() == 0
    })
    .await;
    let stale = b.view().table();
    let stale_mine: Vec<_> = stale
        .shards
        .iter()
        .filter(|s| s.owner.as_ref() == Some(&b_id))
        .map(|s| (s.shard, s.epoch))
        .collect();
    assert!(
        !stale_mine.is_empty(),
        "b's last table still lists its shards"
    );

    // Let b back in, but make its table reads fail.
    run(format!("REVOKE SELECT ON placement_shards FROM {role}")).await;
    run(format!("ALTER ROLE {role} LOGIN")).await;
    eventually(GENEROUS, "b re-registered", || {
        b.view().counters.snapshot().reregistrations > 0
            && b.view().counters.snapshot().heartbeats > 0
    })
    .await;
    // For two seconds of fresh heartbeats, b admits nothing on its stale shards.
    let watch_until = Instant::now() + Duration::from_secs(2);
    let mut samples = 0;
    while Instant::now() < watch_until {
        assert!(b.view().fenced(), "b un-fenced on a stale table");
        for (shard, epoch) in &stale_mine {
            assert!(
                !b.can_ingest(*shard, *epoch),
                "b would ingest shard {shard:?} that a owns"
            );
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(samples > 10);

    // Reads work again: b re-reads, sees a as owner, and rejoins normally.
    run(format!("GRANT SELECT ON placement_shards TO {role}")).await;
    eventually(GENEROUS, "b rejoined and balanced", || {
        settled(&[&a, &b], &["a", "b"])
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (events, sessions) = workers.finish().await;
    let (total, handed_over) = check_no_overlap(&events, sessions);
    println!("FIGURE rejoin_checker ingests={total} owner_changes={handed_over}");
    assert!(handed_over >= 4, "{handed_over}");
    a.shutdown().await;
    b.shutdown().await;
    admin.pool().close().await;
}

/// A node's re-registration can commit after its client-side deadline fired (seen under
/// load in the nemesis suite): the row then holds a newer incarnation, made by this same
/// process, that the process never learned. Its next heartbeat (at the old incarnation)
/// must not read that as another process taking the node id over, which used to end the
/// heartbeat loop for good and leave the node declared dead while it ran. The row is put
/// in exactly that state (incarnation bumped, process token unchanged); the node must
/// register again and rejoin. Checks LOC-3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_committed_after_its_deadline_registers_again_and_rejoins() {
    let Some(db) = TestDatabase::create(
        "a_registration_committed_after_its_deadline_registers_again_and_rejoins",
    )
    .await
    else {
        return;
    };
    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(db.url(), "b", |c| c.embedded_manager = false).await;
    eventually(GENEROUS, "balanced", || settled(&[&a, &b], &["a", "b"])).await;
    let admin = support::placement::store(db.url()).await;

    let before = b.view().counters.snapshot().reregistrations;
    // The unlearned re-registration: what `reregister_node` writes, minus the answer.
    let bumped = sqlx::query(
        "UPDATE placement_nodes SET incarnation = incarnation + 1, state = 'joining',
                registered_at = now(), heartbeat_at = now()
         WHERE id = 'b'",
    )
    .execute(admin.pool())
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(bumped, 1);

    eventually(GENEROUS, "b registered again", || {
        b.view().counters.snapshot().reregistrations > before
    })
    .await;
    // Registered again, b heartbeats on (the loop did not end) and rejoins with shards.
    let beats = b.view().counters.snapshot().heartbeats;
    eventually(GENEROUS, "b heartbeats at its new incarnation", || {
        b.view().counters.snapshot().heartbeats > beats + 3
    })
    .await;
    eventually(GENEROUS, "b rejoined and balanced", || {
        settled(&[&a, &b], &["a", "b"])
    })
    .await;
    let nodes = admin.nodes().await.unwrap();
    let b_id = NodeId::parse("b").unwrap();
    assert_ne!(
        nodes[&b_id].state,
        graviton::placement::NodeState::Dead,
        "b is not left declared dead"
    );
    a.shutdown().await;
    b.shutdown().await;
    admin.pool().close().await;
}

/// A TCP proxy in front of PostgreSQL for one node. It can pause every byte from the
/// server to the node (a node cut off from its database), and, once armed, hold the
/// server's answer to the next `COMMIT` of a transaction whose bytes carried `marker`
/// (the node's registration binds its public address) for `hold`: the commit lands, the
/// node learns of it only after its client-side deadline.
struct PgProxy {
    addr: std::net::SocketAddr,
    paused: Arc<AtomicBool>,
    armed: Arc<AtomicBool>,
    held: Arc<std::sync::atomic::AtomicUsize>,
}

impl PgProxy {
    async fn start(upstream: String, marker: &'static [u8], hold: Duration) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Self {
            addr: listener.local_addr().unwrap(),
            paused: Arc::default(),
            armed: Arc::default(),
            held: Arc::default(),
        };
        let (paused, armed, held) = (
            proxy.paused.clone(),
            proxy.armed.clone(),
            proxy.held.clone(),
        );
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                let hold_until: Arc<Mutex<Option<tokio::time::Instant>>> = Arc::default();
                let (armed, held, hold_from_client) =
                    (armed.clone(), held.clone(), hold_until.clone());
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = vec![0u8; 64 << 10];
                    let mut saw_marker = false;
                    loop {
                        let Ok(n) = client_rx.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        let chunk = &buf[..n];
                        saw_marker |= chunk.windows(marker.len()).any(|w| w == marker);
                        if saw_marker
                            && chunk.windows(6).any(|w| w == b"COMMIT")
                            && armed.swap(false, Ordering::SeqCst)
                        {
                            *hold_from_client.lock().unwrap() =
                                Some(tokio::time::Instant::now() + hold);
                            held.fetch_add(1, Ordering::SeqCst);
                        }
                        if server_tx.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                let paused = paused.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let Ok(n) = server_rx.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        while paused.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        let until = *hold_until.lock().unwrap();
                        if let Some(until) = until {
                            tokio::time::sleep_until(until).await;
                        }
                        if client_tx.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        proxy
    }
}

/// The same lost answer as above, made on the connection: node b reaches PostgreSQL
/// through a proxy; b is cut off until it is declared dead, and the answer to the COMMIT
/// of its re-registration is then held past b's client-side deadline (the commit lands).
/// b must register again and rejoin. Checks LOC-3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reregistration_whose_commit_answer_is_held_past_its_deadline_registers_again() {
    let Some(db) = TestDatabase::create(
        "a_reregistration_whose_commit_answer_is_held_past_its_deadline_registers_again",
    )
    .await
    else {
        return;
    };
    const MARKER: &[u8] = b"b-registration-marker.public";
    let mut url = reqwest::Url::parse(db.url()).unwrap();
    let upstream = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5432));
    // Longer than b's client-side deadline (statement_timeout 2 s + 500 ms).
    let proxy = PgProxy::start(upstream, MARKER, Duration::from_millis(3_500)).await;
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(proxy.addr.port())).unwrap();

    let a = start_node(db.url(), "a", |_| {}).await;
    let b = start_node(url.as_str(), "b", |c| {
        c.embedded_manager = false;
        c.public_addr = format!("{}:7070", std::str::from_utf8(MARKER).unwrap());
    })
    .await;
    eventually(GENEROUS, "balanced", || settled(&[&a, &b], &["a", "b"])).await;
    let admin = support::placement::store(db.url()).await;
    let b_id = NodeId::parse("b").unwrap();

    // Cut b off until a declares it dead, then arm the hold and let b back in.
    proxy.paused.store(true, Ordering::SeqCst);
    let dead = support::wait_until(GENEROUS, || async {
        admin.nodes().await.unwrap()[&b_id].state == graviton::placement::NodeState::Dead
    })
    .await;
    assert!(dead, "b is declared dead while cut off");
    proxy.armed.store(true, Ordering::SeqCst);
    let before = b.view().counters.snapshot().reregistrations;
    proxy.paused.store(false, Ordering::SeqCst);

    eventually(
        GENEROUS,
        "the answer to b's re-registration was held",
        || proxy.held.load(Ordering::SeqCst) == 1,
    )
    .await;
    // The held re-registration timed out although it committed; b must not read its own
    // newer incarnation as a takeover, but register again.
    eventually(
        GENEROUS,
        "b registered again after the unconfirmed one",
        || b.view().counters.snapshot().reregistrations >= before + 2,
    )
    .await;
    eventually(GENEROUS, "b rejoined and balanced", || {
        settled(&[&a, &b], &["a", "b"])
    })
    .await;
    let nodes = admin.nodes().await.unwrap();
    assert_ne!(nodes[&b_id].state, graviton::placement::NodeState::Dead);
    a.shutdown().await;
    b.shutdown().await;
    admin.pool().close().await;
}

/// The checker itself is not vacuous: overlapping ingests on two nodes are caught.
#[test]
#[should_panic(expected = "overlapping")]
fn checker_detects_overlap() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let events = vec![
        Ingest {
            node: "a".into(),
            session: 0,
            epoch: 1,
            start: at(0),
            end: at(10),
        },
        Ingest {
            node: "b".into(),
            session: 0,
            epoch: 2,
            start: at(9),
            end: at(20),
        },
    ];
    check_no_overlap(&events, 1);
}

/// Drops a test role when the test ends, even on panic (after terminating its sessions).
struct TempRole(String);

impl Drop for TempRole {
    fn drop(&mut self) {
        let role = self.0.clone();
        let admin_url = std::env::var("GRAVITON_TEST_DATABASE_URL")
            .unwrap_or_else(|_| support::postgres::DEFAULT_ADMIN_URL.to_string());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                use sqlx::Connection;
                if let Ok(mut conn) = sqlx::PgConnection::connect(&admin_url).await {
                    let _ = sqlx::query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
                    )
                    .bind(&role)
                    .execute(&mut conn)
                    .await;
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
                        .execute(&mut conn)
                        .await;
                    let _ = conn.close().await;
                }
            });
        })
        .join();
    }
}
