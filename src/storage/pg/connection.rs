//! Statements on a connection rather than on the tables: the shard manager's advisory lock
//! on its dedicated connection (the options that let the server free it soon after the
//! holder vanishes, take, ping, release), and the liveness probe of a pool. The election
//! actor (`actors::manager_election`) and the node's dependency probe call these; they
//! hold no SQL of their own.

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{PgConnection, PgPool};

use super::placement::MANAGER_LOCK_KEY;

/// Options for the dedicated lock connection: keepalives and an idle-session timeout so the
/// server frees the lock soon after the holder disappears.
pub fn lock_connection_options(base: PgConnectOptions, ping: Duration) -> PgConnectOptions {
    let idle_ms = (ping * 10)
        .max(Duration::from_secs(3))
        .as_millis()
        .to_string();
    base.options([
        ("tcp_keepalives_idle", "5"),
        ("tcp_keepalives_interval", "2"),
        ("tcp_keepalives_count", "3"),
        ("tcp_user_timeout", "10000"),
        ("idle_session_timeout", idle_ms.as_str()),
    ])
}

/// Try the lock once on `conn`. `Ok(true)`: this connection now holds it.
pub async fn try_lock(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(MANAGER_LOCK_KEY)
        .fetch_one(conn)
        .await
}

/// Is the lock connection still alive (`SELECT 1`)? An error means the lock may be gone.
pub async fn ping(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(conn).await.map(drop)
}

/// Release every advisory lock this connection holds.
pub async fn unlock_all(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(conn)
        .await
        .map(drop)
}

/// One round trip on a pooled connection (the node's dependency probe).
pub async fn probe(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(pool).await.map(drop)
}
