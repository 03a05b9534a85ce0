//! The PostgreSQL manifest store against real PostgreSQL: the `ManifestStore` contract (run
//! against the filesystem store too), first-writer-wins without rewrites, corrupt rows
//! reported as `Corrupt`, and an unreachable or stuck database reported as `Unavailable`.

#[allow(unused_imports)]
mod support;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use graviton::cas::{BlobKey, BlockKey, BlockRef, Manifest};
use graviton::storage::fs::FsManifestStore;
use graviton::storage::pg::PgManifestStore;
use graviton::storage::{CreateOutcome, ManifestStore, StoreError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use support::TestDatabase;

/// A migrated pool on the test database, with the given statement timeout.
async fn pool(db: &TestDatabase, statement_timeout: Duration) -> PgPool {
    let pool =
        graviton::storage::pg::connect_pool(db.url(), 10, statement_timeout, "graviton-test")
            .await
            .expect("pool");
    graviton::storage::pg::MIGRATOR
        .run(&pool)
        .await
        .expect("migrate");
    pool
}

async fn pg_store(db: &TestDatabase) -> PgManifestStore {
    PgManifestStore::new(pool(db, Duration::from_secs(10)).await)
}

/// The manifest of `content` cut into blocks of the given sizes (which must add up).
fn manifest_of(content: &[u8], sizes: &[usize], created_at_ms: u64) -> Manifest {
    assert_eq!(sizes.iter().sum::<usize>(), content.len());
    let mut at = 0;
    let blocks = sizes
        .iter()
        .map(|&size| {
            let part = &content[at..at + size];
            at += size;
            BlockRef {
                key: BlockKey::of(part),
                size: size as u32,
            }
        })
        .collect();
    Manifest::new(BlobKey::of(content), blocks, created_at_ms)
}

/// Deterministic content of `n` blocks of 1..=97 bytes, with its manifest.
fn many_blocks(n: usize, seed: u8) -> Manifest {
    let sizes: Vec<usize> = (0..n).map(|i| 1 + (i * 37 + seed as usize) % 97).collect();
    let content: Vec<u8> = (0..sizes.iter().sum::<usize>())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    manifest_of(&content, &sizes, 1_700_000_000_000 + n as u64)
}

/// The `ManifestStore` contract: the same assertions for every backend. `tag` makes the
/// blobs of one run distinct from those of another on a shared store.
async fn manifest_store_contract(store: Arc<dyn ManifestStore>, tag: &str) {
    // Unknown key.
    let unknown = BlobKey::of(format!("{tag}: never stored").as_bytes());
    assert_eq!(store.get(unknown).await.unwrap(), None);

    // Create, then read back exactly.
    let content = format!("{tag}: hello, manifest store").into_bytes();
    let manifest = manifest_of(&content, &[5, 7, content.len() - 12], 1_234);
    assert_eq!(
        store.create(&manifest).await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(
        store.get(manifest.key).await.unwrap(),
        Some(manifest.clone())
    );

    // Later writers of the same key get AlreadyExists and never replace the first manifest,
    // even with different (valid) blocks and timestamp.
    assert_eq!(
        store.create(&manifest).await.unwrap(),
        CreateOutcome::AlreadyExists
    );
    let other = manifest_of(&content, &[content.len()], 9_999);
    assert_eq!(other.key, manifest.key);
    assert_eq!(
        store.create(&other).await.unwrap(),
        CreateOutcome::AlreadyExists
    );
    assert_eq!(
        store.get(manifest.key).await.unwrap(),
        Some(manifest.clone())
    );

    // The same hash with another size is another blob.
    let mut other_size = BlobKey::of(&content);
    other_size.size += 1;
    assert_eq!(store.get(other_size).await.unwrap(), None);

    // The empty blob: zero blocks.
    let empty = manifest_of(b"", &[], 42);
    assert!(empty.blocks.is_empty());
    assert_eq!(store.create(&empty).await.unwrap(), CreateOutcome::Created);
    assert_eq!(store.get(empty.key).await.unwrap(), Some(empty.clone()));
    assert_eq!(
        store.create(&empty).await.unwrap(),
        CreateOutcome::AlreadyExists
    );

    // Thousands of blocks, order kept.
    let big = many_blocks(5_000, tag.len() as u8);
    assert_eq!(big.blocks.len(), 5_000);
    assert_eq!(store.create(&big).await.unwrap(), CreateOutcome::Created);
    assert_eq!(store.get(big.key).await.unwrap(), Some(big.clone()));

    // Eight concurrent creators of one manifest: exactly one wins.
    let contested_content = format!("{tag}: contested manifest").into_bytes();
    let contested = manifest_of(&contested_content, &[4, 3, contested_content.len() - 7], 77);
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            let manifest = contested.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                store.create(&manifest).await.unwrap()
            })
        })
        .collect();
    let mut created = 0;
    for task in tasks {
        match task.await.unwrap() {
            CreateOutcome::Created => created += 1,
            CreateOutcome::AlreadyExists => {}
        }
    }
    assert_eq!(created, 1, "exactly one concurrent create must win");
    assert_eq!(store.get(contested.key).await.unwrap(), Some(contested));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_fs() {
    let dir = tempfile::tempdir().unwrap();
    // With fsync on: the store's durable publish path (file, rename, directory syncs) is
    // the one the contract runs through, as in production.
    let store = FsManifestStore::open(dir.path(), true).unwrap();
    manifest_store_contract(Arc::new(store), "fs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_pg() {
    let Some(db) = TestDatabase::create("contract_pg").await else {
        return;
    };
    let store = pg_store(&db).await;
    manifest_store_contract(Arc::new(store.clone()), "pg").await;
    // Every manifest of the contract is one row, and nothing else was written.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM manifests")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 4);
}

/// A stored row's identity and insert time: xmin changes if the row is ever rewritten.
async fn row_version(pool: &PgPool, key: &BlobKey) -> (String, String, i64) {
    sqlx::query_as(
        "SELECT xmin::text, created_at::text, created_at_ms FROM manifests
         WHERE blob_hash = $1 AND blob_size = $2",
    )
    .bind(key.hash.as_slice())
    .bind(key.size as i64)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn pg_second_create_leaves_the_row_untouched() {
    let Some(db) = TestDatabase::create("pg_second_create_leaves_the_row_untouched").await else {
        return;
    };
    let store = pg_store(&db).await;
    let content = b"first writer wins";
    let first = manifest_of(content, &[6, 11], 1);
    assert_eq!(store.create(&first).await.unwrap(), CreateOutcome::Created);
    let before = row_version(store.pool(), &first.key).await;
    assert_eq!(before.2, 1);

    // Any rewrite of the row changes its xmin (and its `created_at_ms` to 2), whenever it
    // happens: no wait is needed for a rewrite to show.
    let second = manifest_of(content, &[17], 2);
    assert_eq!(
        store.create(&second).await.unwrap(),
        CreateOutcome::AlreadyExists
    );
    assert_eq!(row_version(store.pool(), &first.key).await, before);
    assert_eq!(store.get(first.key).await.unwrap(), Some(first));
}

#[tokio::test]
async fn pg_create_refuses_an_invalid_manifest() {
    let Some(db) = TestDatabase::create("pg_create_refuses_an_invalid_manifest").await else {
        return;
    };
    let store = pg_store(&db).await;
    let mut bad = manifest_of(b"abcdef", &[3, 3], 1);
    bad.key.size = 7;
    let err = store.create(&bad).await.unwrap_err();
    assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    assert_eq!(store.get(bad.key).await.unwrap(), None);
    // Block sizes beyond the integer[] column are refused, not truncated.
    let mut huge = manifest_of(b"x", &[1], 1);
    huge.blocks[0].size = u32::MAX;
    huge.key.size = u64::from(u32::MAX);
    let err = store.create(&huge).await.unwrap_err();
    assert!(err.to_string().contains("block size"), "{err}");
    assert_eq!(store.get(huge.key).await.unwrap(), None);
}

#[tokio::test]
async fn pg_schema_rejects_malformed_keys() {
    let Some(db) = TestDatabase::create("pg_schema_rejects_malformed_keys").await else {
        return;
    };
    let store = pg_store(&db).await;
    let insert = "INSERT INTO manifests (blob_hash, blob_size, format, created_at_ms,
        chunk_algorithm, chunk_min, chunk_avg, chunk_max, block_count, block_keys, block_sizes)
        VALUES ($1, $2, 1, 0, 'x', 1, 2, 3, 0, '', '{}')";
    for (hash, size, constraint) in [
        (vec![0u8; 31], 0i64, "manifests_hash_len"),
        (vec![0u8; 33], 0, "manifests_hash_len"),
        (vec![0u8; 32], -1, "manifests_size_nonneg"),
    ] {
        let err = sqlx::query(insert)
            .bind(hash)
            .bind(size)
            .execute(store.pool())
            .await
            .unwrap_err();
        let db_err = err.as_database_error().expect("database error");
        assert_eq!(db_err.constraint(), Some(constraint), "{err}");
    }
    // A well-formed empty row is accepted.
    sqlx::query(insert)
        .bind(vec![0u8; 32])
        .bind(0i64)
        .execute(store.pool())
        .await
        .unwrap();
}

#[tokio::test]
async fn pg_corrupt_rows_are_reported_not_served() {
    let Some(db) = TestDatabase::create("pg_corrupt_rows_are_reported_not_served").await else {
        return;
    };
    let store = pg_store(&db).await;
    // Each case corrupts its own blob's row with direct SQL ($1 hash, $2 size).
    let cases: [(&str, &str, &str); 5] = [
        (
            "sizes no longer add up to the key's size",
            "UPDATE manifests SET block_sizes[1] = block_sizes[1] + 1
             WHERE blob_hash = $1 AND blob_size = $2",
            "add up to",
        ),
        (
            "unknown format",
            "UPDATE manifests SET format = 2 WHERE blob_hash = $1 AND blob_size = $2",
            "unsupported manifest format 2",
        ),
        (
            "block keys truncated",
            "UPDATE manifests SET block_keys = substring(block_keys FROM 1 FOR 40)
             WHERE blob_hash = $1 AND blob_size = $2",
            "40 bytes of block keys",
        ),
        (
            "a negative block size",
            "UPDATE manifests SET block_sizes[1] = -block_sizes[1]
             WHERE blob_hash = $1 AND blob_size = $2",
            "is negative",
        ),
        (
            "a NULL block size",
            "UPDATE manifests SET block_sizes[2] = NULL WHERE blob_hash = $1 AND blob_size = $2",
            "decoding column \"block_sizes\"",
        ),
    ];
    // Drop the checks that would stop some of these writes: the reader must not trust them.
    sqlx::query(
        "ALTER TABLE manifests DROP CONSTRAINT manifests_block_keys_len,
         DROP CONSTRAINT manifests_block_sizes_pos, DROP CONSTRAINT manifests_format_pos",
    )
    .execute(store.pool())
    .await
    .unwrap();
    for (what, corrupt, expected) in cases {
        let manifest = manifest_of(what.as_bytes(), &[2, 3, what.len() - 5], 5);
        assert_eq!(
            store.create(&manifest).await.unwrap(),
            CreateOutcome::Created
        );
        let changed = sqlx::query(corrupt)
            .bind(manifest.key.hash.as_slice())
            .bind(manifest.key.size as i64)
            .execute(store.pool())
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(changed, 1, "{what}");
        let err = store.get(manifest.key).await.unwrap_err();
        assert!(matches!(err, StoreError::Corrupt(_)), "{what}: {err:?}");
        assert!(
            err.to_string().contains(&manifest.key.to_string()),
            "{what}: the error names the blob: {err}"
        );
        assert!(err.to_string().contains(expected), "{what}: {err}");
        // Still never rewritten by a later create.
        assert_eq!(
            store.create(&manifest).await.unwrap(),
            CreateOutcome::AlreadyExists
        );
    }
}

#[tokio::test]
async fn pg_unreachable_database_is_unavailable_without_secrets() {
    // A port nothing listens on; the pool connects lazily and gives up after 300ms.
    let port = support::free_port();
    let url = format!("postgres://graviton:hunter2-secret@127.0.0.1:{port}/graviton");
    let options = PgConnectOptions::from_str(&url).unwrap();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(options);
    let store = PgManifestStore::new(pool);
    let manifest = manifest_of(b"unreachable", &[11], 1);

    // Errors, not hangs: a hang would stop the test (nextest's slow-test bound); no
    // timing is asserted.
    let errors = [
        store.create(&manifest).await.unwrap_err(),
        store.get(manifest.key).await.unwrap_err(),
    ];
    for err in errors {
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
        let text = format!("{err} {err:?}");
        assert!(!text.contains("hunter2"), "password leaked: {text}");
        assert!(!text.contains("postgres://"), "URL leaked: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_statement_timeout_is_unavailable() {
    let Some(db) = TestDatabase::create("pg_statement_timeout_is_unavailable").await else {
        return;
    };
    let store = PgManifestStore::new(pool(&db, Duration::from_millis(300)).await);
    let manifest = manifest_of(b"blocked by an open transaction", &[30], 1);

    // Another session inserts the same key and does not commit: the store's insert has to
    // wait for its lock and runs into the session's lock timeout (PG-1), which names the
    // cause (55P03) before the statement timeout would.
    let mut other = PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(
        "INSERT INTO manifests (blob_hash, blob_size, format, created_at_ms, chunk_algorithm,
         chunk_min, chunk_avg, chunk_max, block_count, block_keys, block_sizes)
         VALUES ($1, $2, 1, 0, 'x', 1, 2, 3, 0, '', '{}')",
    )
    .bind(manifest.key.hash.as_slice())
    .bind(manifest.key.size as i64)
    .execute(&mut other)
    .await
    .unwrap();

    let err = store.create(&manifest).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(err.to_string().contains("55P03"), "{err}");

    // Once the other writer goes away the key is free again.
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    assert_eq!(
        store.create(&manifest).await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(store.get(manifest.key).await.unwrap(), Some(manifest));
}

/// Issue 9, item 2: a session upload's manifest commits only while its node still owns
/// the shard at the permit's epoch, checked in the same transaction. A shard that moved
/// (epoch bumped), or whose revocation the node already acknowledged, refuses the commit;
/// a move in progress and the commit serialize on the shard row. Checks LOC-1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_commit_is_refused_once_the_shard_moved() {
    use graviton::ids::NodeId;
    use graviton::placement::{Epoch, ShardId};
    use graviton::storage::manifest::CommitFence;
    let Some(db) = TestDatabase::create("a_fenced_commit_is_refused_once_the_shard_moved").await
    else {
        return;
    };
    let pool = pool(&db, Duration::from_secs(10)).await;
    let placement = graviton::storage::pg::PlacementStore::new(pool.clone());
    placement.bootstrap(8).await.unwrap();
    sqlx::query(
        "INSERT INTO placement_nodes (id, public_addr, internal_addr, control_addr, version, state)
         VALUES ('a', '', '', '', 't', 'active'), ('b', '', '', '', 't', 'active')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE placement_shards SET node_id = 'a', epoch = 4 WHERE shard = 3")
        .execute(&pool)
        .await
        .unwrap();
    let store = PgManifestStore::new(pool.clone());
    let fence = CommitFence {
        shard: ShardId(3),
        node: NodeId::parse("a").unwrap(),
        epoch: Epoch(4),
    };
    let first = manifest_of(b"fenced commit one", &[17], 1);
    assert_eq!(
        store.create_fenced(&first, Some(&fence)).await.unwrap(),
        CreateOutcome::Created
    );
    // A revocation not yet acknowledged still allows the commit (graceful handoff) ...
    sqlx::query("UPDATE placement_shards SET moving_to = 'b' WHERE shard = 3")
        .execute(&pool)
        .await
        .unwrap();
    let second = manifest_of(b"fenced commit two", &[17], 2);
    assert_eq!(
        store.create_fenced(&second, Some(&fence)).await.unwrap(),
        CreateOutcome::Created
    );
    // ... an acknowledged one does not.
    sqlx::query("UPDATE placement_shards SET revoke_acked = true WHERE shard = 3")
        .execute(&pool)
        .await
        .unwrap();
    let third = manifest_of(b"fenced commit three", &[19], 3);
    assert!(matches!(
        store.create_fenced(&third, Some(&fence)).await,
        Err(StoreError::Fenced { shard: 3, epoch: 4 })
    ));
    assert!(
        store.get(third.key).await.unwrap().is_none(),
        "nothing visible"
    );

    // A move in progress holds the shard row: the commit waits for it, then is refused.
    sqlx::query(
        "UPDATE placement_shards SET moving_to = NULL, revoke_acked = false WHERE shard = 3",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut mover = pool.begin().await.unwrap();
    sqlx::query("UPDATE placement_shards SET node_id = 'b', epoch = epoch + 1 WHERE shard = 3")
        .execute(&mut *mover)
        .await
        .unwrap();
    let mover_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *mover)
        .await
        .unwrap();
    let racing = tokio::spawn({
        let store = store.clone();
        let fence = fence.clone();
        let manifest = manifest_of(b"fenced commit four", &[18], 4);
        async move {
            store
                .create_fenced(&manifest, Some(&fence))
                .await
                .map(|_| manifest.key)
        }
    });
    // The fault is confirmed before the test relies on it: the commit's backend waits on
    // a lock that the move's backend holds (PostgreSQL's own view, not a guessed sleep).
    let blocked = support::wait_until(Duration::from_secs(7), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                   AND $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(mover_pid)
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        }
    })
    .await;
    assert!(blocked, "the commit never waited on the move's row lock");
    assert!(
        !racing.is_finished(),
        "the commit waits for the move's transaction"
    );
    mover.commit().await.unwrap();
    let raced = racing.await.unwrap();
    assert!(matches!(raced, Err(StoreError::Fenced { .. })), "{raced:?}");
    // Unfenced creates (blobs without a session) are unaffected.
    assert_eq!(
        store.create_fenced(&third, None).await.unwrap(),
        CreateOutcome::Created
    );
    pool.close().await;
}
