//! PostgreSQL side of the nemesis: one role per process, faults done from the test's own
//! (superuser) connections, and the shard-table sampler that feeds the LOC-1 check.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection, Row};
use tokio::time::Instant;

use super::history::{ManifestRow, ShardRow, ShardSample, TxSnapshot};

/// Roles created for one test, dropped (after the test database) when this is dropped.
/// Declare it before the `TestDatabase` so it is dropped after it.
pub struct Roles {
    admin_url: String,
    pub names: Vec<String>,
}

impl Roles {
    pub fn new(admin_url: &str) -> Self {
        Self {
            admin_url: admin_url.to_string(),
            names: Vec::new(),
        }
    }
}

impl Drop for Roles {
    fn drop(&mut self) {
        let url = self.admin_url.clone();
        let names = std::mem::take(&mut self.names);
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Ok(mut admin) = PgConnection::connect(&url).await {
                    for name in names {
                        let _ = admin
                            .execute(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {name}")))
                            .await;
                    }
                }
            });
        })
        .join();
    }
}

/// `url` with its user replaced by `role` (trust authentication, no password).
pub fn url_for_role(url: &str, role: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("postgres URL");
    let host = rest.split_once('@').map(|(_, h)| h).unwrap_or(rest);
    format!("{scheme}://{role}@{host}")
}

/// A backend idle inside a transaction: `(pid, application_name, [(relation, mode)])`,
/// the relations it holds a granted lock on.
pub type OpenTransaction = (i32, String, Vec<(String, String)>);

/// Superuser connections to the test database.
#[derive(Clone)]
pub struct Pg {
    /// The test database as the admin user.
    pub url: String,
    pub db: String,
}

impl Pg {
    pub async fn conn(&self) -> PgConnection {
        PgConnection::connect(&self.url).await.expect("admin conn")
    }

    pub async fn exec(&self, sql: &str) {
        let mut conn = self.conn().await;
        conn.execute(sqlx::AssertSqlSafe(sql.to_string()))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let _ = conn.close().await;
    }

    /// Create a login role with every privilege on the (migrated) schema.
    pub async fn create_role(&self, roles: &mut Roles, name: &str) -> String {
        self.exec(&format!("CREATE ROLE {name} LOGIN")).await;
        roles.names.push(name.to_string());
        self.exec(&format!(
            "GRANT ALL ON SCHEMA public TO {name}; \
             GRANT ALL ON ALL TABLES IN SCHEMA public TO {name}; \
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {name}"
        ))
        .await;
        url_for_role(&self.url, name)
    }

    /// Terminate every backend of `role` on the test database; returns how many.
    pub async fn terminate(&self, role: &str) -> i64 {
        let mut conn = self.conn().await;
        let n: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE usename = $1 AND datname = $2",
        )
        .bind(role)
        .bind(&self.db)
        .fetch_one(&mut conn)
        .await
        .expect("terminate backends");
        let _ = conn.close().await;
        n
    }

    /// Cut `role` off: no new logins, existing backends terminated.
    pub async fn cut_off(&self, role: &str) -> i64 {
        self.exec(&format!("ALTER ROLE {role} NOLOGIN")).await;
        self.terminate(role).await
    }

    pub async fn let_in(&self, role: &str) {
        self.exec(&format!("ALTER ROLE {role} LOGIN")).await;
    }

    /// Take `LOCK TABLE placement_shards IN ACCESS EXCLUSIVE MODE` on a connection of its
    /// own and hold it for `hold` from a task. Returns only once the lock is confirmed held
    /// from another connection (`pg_locks`, granted, by the holder's backend pid); a
    /// failure to take it fails the test. Await the handle: it fails if the release did.
    pub async fn lock_shards_for(
        &self,
        hold: Duration,
    ) -> tokio::task::JoinHandle<Result<(), String>> {
        let pg = self.clone();
        let (locked, taken) = tokio::sync::oneshot::channel::<i32>();
        let handle = tokio::spawn(async move {
            let mut conn = pg.conn().await;
            let mut tx = conn.begin().await.map_err(|e| format!("begin: {e}"))?;
            tx.execute("LOCK TABLE placement_shards IN ACCESS EXCLUSIVE MODE")
                .await
                .map_err(|e| format!("LOCK TABLE placement_shards: {e}"))?;
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| format!("pg_backend_pid: {e}"))?;
            let _ = locked.send(pid);
            tokio::time::sleep(hold).await;
            tx.commit()
                .await
                .map_err(|e| format!("release placement_shards: {e}"))
        });
        let Ok(pid) = taken.await else {
            let error = handle.await.map_err(|e| e.to_string()).and_then(|r| r);
            panic!("the LOCK TABLE fault was not applied: {error:?}");
        };
        assert!(
            self.holds_lock(pid, "placement_shards", "AccessExclusiveLock")
                .await,
            "LOCK TABLE placement_shards: backend {pid} holds no granted AccessExclusiveLock"
        );
        handle
    }

    /// Whether backend `pid` holds a granted `mode` lock on `table` (from `pg_locks`).
    pub async fn holds_lock(&self, pid: i32, table: &str, mode: &str) -> bool {
        let mut conn = self.conn().await;
        let held: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND locktype = 'relation' \
             AND relation = $2::regclass AND mode = $3 AND granted)",
        )
        .bind(pid)
        .bind(table)
        .bind(mode)
        .fetch_one(&mut conn)
        .await
        .expect("read pg_locks");
        let _ = conn.close().await;
        held
    }

    /// The backends of `role` on the test database that are idle inside a transaction,
    /// with the relations each holds a granted lock on: `(pid, application_name,
    /// [(relation, mode)])`.
    pub async fn open_transactions(&self, role: &str) -> Vec<OpenTransaction> {
        let mut conn = self.conn().await;
        let rows: Vec<(i32, String, Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT a.pid, a.application_name, l.relation::regclass::text, l.mode \
             FROM pg_stat_activity a LEFT JOIN pg_locks l \
               ON l.pid = a.pid AND l.granted AND l.locktype = 'relation' \
             WHERE a.usename = $1 AND a.datname = $2 AND a.state = 'idle in transaction'",
        )
        .bind(role)
        .bind(&self.db)
        .fetch_all(&mut conn)
        .await
        .expect("read pg_stat_activity");
        let _ = conn.close().await;
        let mut out: Vec<OpenTransaction> = Vec::new();
        for (pid, name, relation, mode) in rows {
            let i = match out.iter().position(|(p, _, _)| *p == pid) {
                Some(i) => i,
                None => {
                    out.push((pid, name, Vec::new()));
                    out.len() - 1
                }
            };
            if let (Some(relation), Some(mode)) = (relation, mode) {
                out[i].2.push((relation, mode));
            }
        }
        out
    }

    /// Whether some session holds the manager's advisory lock on the test database.
    pub async fn manager_lock_held(&self) -> bool {
        let key = graviton::storage::pg::placement::MANAGER_LOCK_KEY;
        let (classid, objid) = ((key >> 32) as u32 as i64, key as u32 as i64);
        let Ok(mut conn) = PgConnection::connect(&self.url).await else {
            return false;
        };
        let held: Result<bool, _> = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_database d ON d.oid = l.database \
             WHERE l.locktype = 'advisory' AND l.granted AND d.datname = $1 \
             AND l.classid::bigint = $2 AND l.objid::bigint = $3)",
        )
        .bind(&self.db)
        .bind(classid)
        .bind(objid)
        .fetch_one(&mut conn)
        .await;
        let _ = conn.close().await;
        held.unwrap_or(false)
    }

    /// Take `pg_current_snapshot()` every `every` until `stop` (it reads no table, so a
    /// held table lock never delays it); snapshots are timed from `t0`.
    pub fn snapshot_sampler(
        &self,
        t0: Instant,
        every: Duration,
        snapshots: Arc<Mutex<Vec<TxSnapshot>>>,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let pg = self.clone();
        tokio::spawn(async move {
            let mut conn: Option<PgConnection> = None;
            while !stop.is_cancelled() {
                if conn.is_none() {
                    conn = PgConnection::connect(&pg.url).await.ok();
                }
                if let Some(c) = conn.as_mut() {
                    let sent = t0.elapsed();
                    match sqlx::query_scalar::<_, String>("SELECT pg_current_snapshot()::text")
                        .fetch_one(&mut *c)
                        .await
                    {
                        Ok(text) => {
                            if let Some(s) = TxSnapshot::parse(&text, sent, t0.elapsed()) {
                                snapshots.lock().unwrap().push(s);
                            }
                        }
                        Err(_) => conn = None,
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.cancelled() => {}
                }
            }
        })
    }

    /// Every manifest row by blob key (`blake3:<hex>:<size>`): its writing transaction and
    /// that transaction's start in run time (`t0_unix_us` is the run's start on the wall
    /// clock; the server runs on this machine).
    pub async fn manifest_rows(&self, t0_unix_us: u64) -> HashMap<String, ManifestRow> {
        let mut conn = self.conn().await;
        let rows: Vec<(Vec<u8>, i64, i64, i64)> = sqlx::query_as(
            "SELECT blob_hash, blob_size, (xmin::text)::bigint, \
             (extract(epoch FROM created_at) * 1000000)::bigint FROM manifests",
        )
        .fetch_all(&mut conn)
        .await
        .expect("read manifests");
        let _ = conn.close().await;
        rows.into_iter()
            .map(|(hash, size, xid, created_us)| {
                let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
                let begun = Duration::from_micros((created_us as u64).saturating_sub(t0_unix_us));
                (
                    format!("blake3:{hex}:{size}"),
                    ManifestRow {
                        begun,
                        xid: xid as u32,
                    },
                )
            })
            .collect()
    }

    /// Sample `placement_shards` every `every` until `stop`; samples are timed from `t0`.
    pub fn sampler(
        &self,
        t0: Instant,
        every: Duration,
        samples: Arc<Mutex<Vec<ShardSample>>>,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let pg = self.clone();
        tokio::spawn(async move {
            let mut conn: Option<PgConnection> = None;
            while !stop.is_cancelled() {
                if conn.is_none() {
                    conn = PgConnection::connect(&pg.url).await.ok();
                }
                if let Some(c) = conn.as_mut() {
                    let sent = t0.elapsed();
                    match sqlx::query(
                        "SELECT shard, node_id, epoch, moving_to FROM placement_shards",
                    )
                    .fetch_all(&mut *c)
                    .await
                    {
                        Ok(rows) => {
                            let received = t0.elapsed();
                            let shards: HashMap<u32, ShardRow> = rows
                                .iter()
                                .map(|r| {
                                    (
                                        r.get::<i32, _>(0) as u32,
                                        ShardRow {
                                            owner: r.get(1),
                                            epoch: r.get(2),
                                            moving_to: r.get(3),
                                        },
                                    )
                                })
                                .collect();
                            samples.lock().unwrap().push(ShardSample {
                                sent,
                                received,
                                shards,
                            });
                        }
                        Err(_) => conn = None,
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.cancelled() => {}
                }
            }
        })
    }
}
