//! PostgreSQL adapters: connection setup, migrations, the placement store, the manifest
//! store, and the statements on a connection ([`connection`]: the manager's advisory lock,
//! the pool probe).
//!
//! Failure model: every session carries server-side bounds ([`connect_options`]):
//! `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout`, TCP
//! keepalives and `tcp_user_timeout`. So a hung server turns into an error within a bound
//! instead of a stuck caller, and a client that stops (SIGSTOP, a frozen VM, a cut
//! network) inside a transaction loses that transaction and its row locks within a bound
//! instead of blocking the manager and other nodes' commits until the kernel gives up on
//! the connection (hours). A transaction that must wait on the object store while it
//! holds rows widens its own bound for that wait only ([`allow_idle_for_medium`]).
//! Connection options carry the password: they are never logged.

pub mod connection;
pub mod manifest;
pub mod placement;

use std::str::FromStr;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use manifest::PgManifestStore;
pub use placement::{PlacementStore, PlacementStoreError};

/// The embedded migrations of `sql/`.
pub static MIGRATOR: Migrator = sqlx::migrate!("./sql");

/// How long a transaction may stay idle while it waits on the object store (a HEAD or a
/// DELETE of a pack, retried by the S3 client): see [`allow_idle_for_medium`].
pub const MEDIUM_WAIT_IDLE: Duration = Duration::from_secs(60);

/// The server-side bounds of every session, from the statement timeout `t`:
/// `statement_timeout` = `t`; `lock_timeout` = ¾ `t` (a wait on a row lock fails as a
/// lock timeout, SQLSTATE 55P03, which names the cause, before the statement timeout); `idle_in_transaction_session_
/// timeout` = `t`, at least 1 s (no transaction of the product waits on anything but
/// PostgreSQL between statements, except the pack commit's and the collector's object
/// store calls, which widen it); server TCP keepalives after 5 s idle, every 2 s, 3
/// probes; `tcp_user_timeout` 10 s (unacknowledged data).
pub fn session_bounds(statement_timeout: Duration) -> Vec<(&'static str, String)> {
    let ms = statement_timeout.as_millis().max(1);
    let idle_ms = ms.max(1_000);
    let lock_ms = (ms * 3 / 4).max(1);
    vec![
        ("statement_timeout", ms.to_string()),
        ("lock_timeout", lock_ms.to_string()),
        ("idle_in_transaction_session_timeout", idle_ms.to_string()),
        ("tcp_keepalives_idle", "5".into()),
        ("tcp_keepalives_interval", "2".into()),
        ("tcp_keepalives_count", "3".into()),
        ("tcp_user_timeout", "10000".into()),
    ]
}

/// Connection options from a URL, with [`session_bounds`] on every session and
/// `application_name` `name` (operators find a node's sessions, and who holds a lock, in
/// `pg_stat_activity` by it: `graviton-<purpose>:<node>`).
pub fn connect_options(
    url: &str,
    statement_timeout: Duration,
    name: &str,
) -> Result<PgConnectOptions, PlacementStoreError> {
    let options = PgConnectOptions::from_str(url).map_err(|_| PlacementStoreError::InvalidUrl)?;
    let bounds = session_bounds(statement_timeout);
    Ok(options
        .options(bounds.iter().map(|(k, v)| (*k, v.as_str())))
        .application_name(name))
}

/// Widen this transaction's idle bound to [`MEDIUM_WAIT_IDLE`] for a wait on the object
/// store while it holds rows; [`restore_idle`] narrows it again after the wait.
pub async fn allow_idle_for_medium(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    set_idle(conn, MEDIUM_WAIT_IDLE).await
}

/// Narrow this transaction's idle bound back to the session's ([`session_bounds`]).
pub async fn restore_idle(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("RESET idle_in_transaction_session_timeout")
        .execute(conn)
        .await
        .map(|_| ())
}

async fn set_idle(conn: &mut sqlx::PgConnection, idle: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('idle_in_transaction_session_timeout', $1, true)")
        .bind(idle.as_millis().to_string())
        .execute(conn)
        .await
        .map(|_| ())
}

/// A pool with [`connect_options`] named `name`.
pub async fn connect_pool(
    url: &str,
    max_connections: u32,
    statement_timeout: Duration,
    name: &str,
) -> Result<PgPool, PlacementStoreError> {
    let options = connect_options(url, statement_timeout, name)?;
    first_connection(&options, statement_timeout).await?;
    pool_options(
        max_connections,
        statement_timeout.max(Duration::from_secs(1)) * 2,
        PoolUse::Any,
    )
    .connect_with(options)
    .await
    .map_err(PlacementStoreError::Database)
}

/// How long the first connection of [`connect_pool`] may take, retries included: the
/// statement timeout, at least 1 s and at most 5 s.
fn first_connection_bound(statement_timeout: Duration) -> Duration {
    statement_timeout.clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// Open and close one connection, so that a server that is down, a database that does
/// not exist or a refused password fails promptly and once, naming the server (never the
/// password), the cause and `cluster.database_url` (a pool would retry until its acquire
/// timeout and report only "pool timed out"). A server that refuses or drops the
/// connection is tried again within [`first_connection_bound`] (one starting beside us);
/// an answer from PostgreSQL itself (no such database, a refused password) is final.
async fn first_connection(
    options: &PgConnectOptions,
    statement_timeout: Duration,
) -> Result<(), PlacementStoreError> {
    use sqlx::Connection;
    let bound = first_connection_bound(statement_timeout);
    let deadline = tokio::time::Instant::now() + bound;
    let unreachable = |cause: String| PlacementStoreError::Unreachable {
        endpoint: format!(
            "{}:{} (database {:?})",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("")
        ),
        cause,
    };
    let mut pause = Duration::from_millis(50);
    loop {
        match tokio::time::timeout_at(deadline, sqlx::PgConnection::connect_with(options)).await {
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                return Ok(());
            }
            Ok(Err(err)) => {
                let transient = matches!(err, sqlx::Error::Io(_));
                if !transient || tokio::time::Instant::now() + pause >= deadline {
                    return Err(unreachable(connect_cause(&err)));
                }
            }
            Err(_) => {
                return Err(unreachable(format!(
                    "no answer within {} ms (is the host reachable, and the port PostgreSQL's?)",
                    bound.as_millis()
                )));
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// What an operator should read about a failed first connection.
pub fn connect_cause(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            "connection refused (is PostgreSQL running and listening there?)".to_string()
        }
        sqlx::Error::Io(io) => io.to_string(),
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("3D000") => format!(
                "{} (create it, or correct the database name in the URL)",
                db.message()
            ),
            Some("28P01" | "28000") => {
                format!("{} (check the user and password in the URL)", db.message())
            }
            _ => db.message().to_string(),
        },
        other => other.to_string(),
    }
}

/// A lazily connecting pool of its own for one purpose of a node (placement reads,
/// heartbeats, the manager), so slow data-path queries never delay the calls that
/// liveness depends on. The connections carry `application_name`
/// `graviton-<purpose>:<node>`, which operators (and the fault tests) use to find them in
/// `pg_stat_activity`.
pub fn purpose_pool(base: &PgPool, purpose: &str, node: &str, max_connections: u32) -> PgPool {
    let options = (*base.connect_options())
        .clone()
        .application_name(&format!("graviton-{purpose}:{node}"));
    let acquire = base.options().get_acquire_timeout();
    pool_options(max_connections, acquire, PoolUse::Any).connect_lazy_with(options)
}

/// The heartbeat pool of `node` ([`purpose_pool`]'s naming, `graviton-heartbeat:<node>`):
/// [`PoolUse::SingleStatements`], so a heartbeat is one round trip (no check before it),
/// and two connections, so the check of the connection the last heartbeat handed back
/// overlaps the next heartbeat instead of delaying it. With a 100 ms delay each way on the
/// node's PostgreSQL link, a heartbeat that also waited for a ping before its statement
/// and for the last one's release took three round trips (600 ms) against an 800 ms
/// self-fence, and the node flapped between healthy and fenced.
pub fn heartbeat_pool(base: &PgPool, node: &str) -> PgPool {
    let options = (*base.connect_options())
        .clone()
        .application_name(&format!("graviton-heartbeat:{node}"));
    let acquire = base.options().get_acquire_timeout();
    pool_options(2, acquire, PoolUse::SingleStatements).connect_lazy_with(options)
}

/// What a pool's connections are used for, which decides when [`outside_transaction`]
/// runs (PG-2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolUse {
    /// Anything, transactions included (the data, block index, placement and manager
    /// pools). An idle connection is checked when it is acquired, in place of sqlx's ping
    /// (one round trip, as before; nothing added to the release).
    Any,
    /// Single autocommit statements under a deadline only (heartbeats): nothing is checked
    /// on acquire, so a call is one round trip, and a connection is checked as it is
    /// handed back, on the pool's release task, while the next call takes another
    /// connection. No `BEGIN` is ever sent on such a pool; the check is defence in depth.
    SingleStatements,
}

/// The options of every pool of the product (the one place a pool is configured): at
/// most `max_connections`, waiting at most `acquire_timeout` for one, and a connection is
/// lent only outside a transaction ([`outside_transaction`], PG-2), checked where `usage`
/// says.
pub fn pool_options(
    max_connections: u32,
    acquire_timeout: Duration,
    usage: PoolUse,
) -> PgPoolOptions {
    let options = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false);
    match usage {
        PoolUse::Any => options.before_acquire(|conn, _| Box::pin(outside_transaction(conn))),
        PoolUse::SingleStatements => {
            options.after_release(|conn, _| Box::pin(outside_transaction(conn)))
        }
    }
}

/// Whether a connection handed back to its pool is outside any transaction, so that it may
/// serve the next borrower (invariant PG-2). sqlx 0.9.0 can hand one back inside a
/// transaction: a future dropped while `BEGIN` is in flight leaves the session in a
/// transaction that nothing rolls back (transact-rs/sqlx#4393), and the pool's own check
/// on release does not look at the transaction status. The next borrower's autocommit
/// writes would then run inside that transaction and be lost when the server ends the
/// session (`idle_in_transaction_session_timeout`): an acknowledged write, gone.
///
/// Outside a transaction every simple-protocol statement is the first of its own, so its
/// transaction and statement timestamps are equal; inside a stale one they differ. `false` makes the pool
/// close the connection (the server rolls the transaction back) and open a new one; an
/// error (a session in a failed transaction answers 25P02, a dead connection fails) closes
/// it too, and the pool opens another. One round trip: on acquire it replaces sqlx's ping
/// ([`PoolUse::Any`]); on release it runs on the pool's task ([`PoolUse::SingleStatements`]).
async fn outside_transaction(conn: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
    use sqlx::Row;
    // The simple protocol (one message): through the extended protocol the transaction
    // starts at Parse/Bind and the statement timestamp moves at Execute, so they differ
    // even outside a transaction.
    let row = sqlx::raw_sql("SELECT transaction_timestamp() <> statement_timestamp()")
        .fetch_one(conn)
        .await?;
    let stale: bool = row.try_get(0)?;
    if stale {
        tracing::warn!(
            "a pooled PostgreSQL connection was inside a transaction (a request cancelled \
             during BEGIN); closed, so the server rolls that transaction back"
        );
    }
    Ok(!stale)
}

/// The oldest PostgreSQL the product supports (`server_version_num`): 14, the first with
/// `idle_session_timeout`, which the manager's lock connection sets.
pub const MIN_SERVER_VERSION_NUM: i64 = 140_000;

/// Refuse a server older than [`MIN_SERVER_VERSION_NUM`], naming its version.
pub async fn check_server_version(pool: &PgPool) -> Result<(), PlacementStoreError> {
    let (num, text): (String, String) = sqlx::query_as(
        "SELECT current_setting('server_version_num'), current_setting('server_version')",
    )
    .fetch_one(pool)
    .await?;
    if num.parse::<i64>().unwrap_or(0) < MIN_SERVER_VERSION_NUM {
        return Err(PlacementStoreError::UnsupportedServer { found: text });
    }
    Ok(())
}

/// Apply the pending migrations (safe to run concurrently: the migrator takes a lock).
pub async fn migrate(pool: &PgPool) -> Result<(), PlacementStoreError> {
    MIGRATOR
        .run(pool)
        .await
        .map_err(|err| PlacementStoreError::Migration(err.to_string()))
}
