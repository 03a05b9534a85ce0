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
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(statement_timeout.max(Duration::from_secs(1)) * 2)
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
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire)
        .connect_lazy_with(options)
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
