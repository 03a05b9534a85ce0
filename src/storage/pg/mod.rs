//! PostgreSQL adapters: connection setup, migrations, the placement store and the manifest
//! store.
//!
//! Failure model: every query runs under the pool's `statement_timeout`, so a hung server
//! turns into an error within a bound instead of a stuck caller. Connection options carry
//! the password: they are never logged.

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

/// Connection options from a URL, with a statement timeout on every session.
pub fn connect_options(
    url: &str,
    statement_timeout: Duration,
) -> Result<PgConnectOptions, PlacementStoreError> {
    let options = PgConnectOptions::from_str(url).map_err(|_| PlacementStoreError::InvalidUrl)?;
    let ms = statement_timeout.as_millis().max(1).to_string();
    Ok(options
        .options([("statement_timeout", ms.as_str())])
        .application_name("graviton-placement"))
}

/// A pool for the placement store.
pub async fn connect_pool(
    url: &str,
    max_connections: u32,
    statement_timeout: Duration,
) -> Result<PgPool, PlacementStoreError> {
    let options = connect_options(url, statement_timeout)?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(statement_timeout.max(Duration::from_secs(1)) * 2)
        .connect_with(options)
        .await
        .map_err(PlacementStoreError::Database)
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
