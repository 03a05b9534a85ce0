//! Server-side bounds of every PostgreSQL session the product opens, on real PostgreSQL
//! (PG-1): a client that stops inside a transaction (SIGSTOP, a frozen VM and a cut
//! network all look the same to the server: a session idle in its transaction) loses the
//! transaction and its row locks within `idle_in_transaction_session_timeout`, so the
//! manager's term bump and other nodes' commits are not blocked for hours; a wait on a row
//! lock fails as a lock timeout; a transaction that widens its idle bound for an object
//! store call keeps its locks for that wait only; sessions are named by purpose and node.

#[allow(unused_imports)]
mod support;

use std::time::Duration;

use sqlx::{Connection, PgConnection, Row};
use support::TestDatabase;

const NAME: &str = "graviton-data:pg-bounds-node";

async fn admin(db: &TestDatabase) -> PgConnection {
    PgConnection::connect(db.url())
        .await
        .expect("admin connection")
}

async fn table(db: &TestDatabase) {
    let mut conn = admin(db).await;
    sqlx::query("CREATE TABLE IF NOT EXISTS bound_rows (id int PRIMARY KEY, v int NOT NULL)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("INSERT INTO bound_rows VALUES (1, 0) ON CONFLICT DO NOTHING")
        .execute(&mut conn)
        .await
        .unwrap();
}

/// The state of the session named `name`, if it is still there.
async fn session_state(conn: &mut PgConnection, name: &str) -> Option<String> {
    sqlx::query("SELECT state FROM pg_stat_activity WHERE application_name = $1")
        .bind(name)
        .fetch_optional(conn)
        .await
        .unwrap()
        .map(|row| row.get::<Option<String>, _>(0).unwrap_or_default())
}

#[tokio::test]
async fn a_session_stopped_inside_a_transaction_loses_its_locks_within_the_bound() {
    // Checks PG-1.
    let Some(db) = TestDatabase::create("a_session_stopped_inside_a_transaction").await else {
        return;
    };
    table(&db).await;
    let pool = graviton::storage::pg::connect_pool(db.url(), 1, Duration::from_secs(1), NAME)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    // What the fence of a commit (and the manager's round) holds: a row FOR SHARE.
    sqlx::query("SELECT v FROM bound_rows WHERE id = 1 FOR SHARE")
        .execute(&mut *tx)
        .await
        .unwrap();
    // The client now does nothing, as a stopped process would. The session is there, idle
    // in its transaction, under its purpose and node name.
    let mut other = admin(&db).await;
    assert_eq!(
        session_state(&mut other, NAME).await.as_deref(),
        Some("idle in transaction")
    );
    // A writer of that row (the manager's move, another node's dedup update) waits for the
    // lock, and gets it once the server ends the stopped session: no lock_timeout on this
    // admin session, so it would wait for good without the bound.
    let update = sqlx::query("UPDATE bound_rows SET v = v + 1 WHERE id = 1")
        .execute(&mut other)
        .await
        .unwrap();
    assert_eq!(update.rows_affected(), 1);
    // The lock went when the server ended the session; its activity row goes just after.
    let other = std::sync::Arc::new(tokio::sync::Mutex::new(other));
    let ended = support::wait_until(Duration::from_secs(10), || {
        let other = other.clone();
        async move {
            session_state(&mut *other.lock().await, NAME)
                .await
                .is_none()
        }
    })
    .await;
    assert!(ended, "the stopped session was not ended");
    // The stopped client, resumed, learns that its transaction is gone.
    let resumed = sqlx::query("SELECT 1").execute(&mut *tx).await;
    assert!(resumed.is_err(), "the transaction survived its bound");
    drop(tx);
    pool.close().await;
}

#[tokio::test]
async fn a_wait_on_a_row_lock_fails_as_a_lock_timeout() {
    // Checks PG-1 (lock_timeout).
    let Some(db) = TestDatabase::create("a_wait_on_a_row_lock_fails_as_a_lock_timeout").await
    else {
        return;
    };
    table(&db).await;
    let mut holder = admin(&db).await;
    let mut held = holder.begin().await.unwrap();
    sqlx::query("SELECT v FROM bound_rows WHERE id = 1 FOR UPDATE")
        .execute(&mut *held)
        .await
        .unwrap();
    let pool = graviton::storage::pg::connect_pool(db.url(), 1, Duration::from_secs(1), NAME)
        .await
        .unwrap();
    let err = sqlx::query("UPDATE bound_rows SET v = 2 WHERE id = 1")
        .execute(&pool)
        .await
        .expect_err("the row is locked");
    let code = err
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("55P03"), "{err}");
    held.rollback().await.unwrap();
    pool.close().await;
}

#[tokio::test]
async fn a_transaction_waiting_on_the_object_store_keeps_its_locks_for_that_wait_only() {
    // Checks PG-1 (the widened bound of the pack commit's and the collector's waits).
    let Some(db) = TestDatabase::create("a_transaction_waiting_on_the_object_store").await else {
        return;
    };
    table(&db).await;
    let pool = graviton::storage::pg::connect_pool(db.url(), 1, Duration::from_secs(1), NAME)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT v FROM bound_rows WHERE id = 1 FOR SHARE")
        .execute(&mut *tx)
        .await
        .unwrap();
    graviton::storage::pg::allow_idle_for_medium(&mut tx)
        .await
        .unwrap();
    let mut other = admin(&db).await;
    // Past the session's own bound (1 s), the transaction is still there while it waits:
    // the wait itself is what is tested, so this sleeps (three times the session bound).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        session_state(&mut other, NAME).await.as_deref(),
        Some("idle in transaction"),
        "a widened transaction was ended during its wait"
    );
    // Narrowed again after the wait, it is bounded like any other.
    graviton::storage::pg::restore_idle(&mut tx).await.unwrap();
    let update = sqlx::query("UPDATE bound_rows SET v = v + 1 WHERE id = 1")
        .execute(&mut other)
        .await
        .unwrap();
    assert_eq!(update.rows_affected(), 1);
    assert!(sqlx::query("SELECT 1").execute(&mut *tx).await.is_err());
    drop(tx);
    pool.close().await;
}
