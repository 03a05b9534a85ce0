//! A cluster on S3 with no shared directory: separate `graviton serve` processes, each
//! with its own data directory, packs in one bucket of a real Garage server, the block
//! index and the manifests in one real PostgreSQL database. Also the collector's races
//! against a commit, in process, on the same real servers.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use graviton::cas::{BlobKey, BlockKey, BlockRef, Manifest};
use graviton::storage::config::S3Config;
use graviton::storage::pack::cluster_gc::GC_LOCK_KEY;
use graviton::storage::pack::gc::{self, GcOptions, Quiet};
use graviton::storage::pack::medium::Medium;
use graviton::storage::pack::s3::S3Medium;
use graviton::storage::pack::shared::PgIndex;
use graviton::storage::pack::{PackOptions, PackStore};
use graviton::storage::pg::PgManifestStore;
use graviton::storage::{BlockStore, ManifestStore, StoreError};
use sqlx::Connection;
use support::client;
use support::cluster::{NodeProcess, is_ready, s3_storage_toml};
use support::node::random_bytes;

const SHARDS: u32 = 16;
const ADMIN: &str = "admin-token-for-cluster-s3-tests-01";

fn s3_config(prefix: &str) -> S3Config {
    support::cluster::test_s3_config(prefix)
}

async fn upload(url: &str, data: Vec<u8>) -> serde_json::Value {
    let response = client()
        .post(format!("{url}/v1/blobs"))
        .body(data)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    assert_eq!(status, 201, "upload to {url}: {text}");
    serde_json::from_str(&text).unwrap()
}

async fn run_gc(url: &str) -> (u16, serde_json::Value) {
    let response = client()
        .post(format!("{url}/v1/admin/gc?purge=true"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// Pack objects under `prefix` in the bucket.
async fn objects(prefix: &str) -> usize {
    let medium = S3Medium::new(&s3_config(prefix), None).unwrap();
    tokio::task::spawn_blocking(move || medium.list().unwrap().len())
        .await
        .unwrap()
}

async fn pack_rows(db: &str) -> i64 {
    let mut conn = sqlx::PgConnection::connect(db).await.unwrap();
    sqlx::query_scalar("SELECT count(*) FROM pack_packs")
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

/// A request whose body stops short of its Content-Length: the connection closes once
/// the node has sealed `packs` packs of it (pack objects under `prefix` grew by that).
async fn aborted_upload(url: &str, prefix: &str, declared: usize, sent: Vec<u8>, packs: usize) {
    use tokio::io::AsyncWriteExt;
    let before = objects(prefix).await;
    let addr = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/octet-stream\r\nContent-Length: {declared}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&sent).await.unwrap();
    stream.flush().await.unwrap();
    let sealed = support::wait_until(Duration::from_secs(60), || async {
        objects(prefix).await >= before + packs
    })
    .await;
    assert!(
        sealed,
        "the node did not seal {packs} packs of the aborted upload"
    );
    drop(stream);
}

// Checks STO-10 (cluster reads, cross-node dedup, one collector, aborted uploads
// reclaimed, live blobs kept) and STO-8 on the shared bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_on_s3_share_blocks_dedup_and_collect_under_one_lock() {
    let test = "two_nodes_on_s3_share_blocks_dedup_and_collect_under_one_lock";
    let Some(db) = support::TestDatabase::create(test).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("cluster-{}", support::unique_suffix());
    let gc = "\n[storage.gc]\nmin_age = \"1s\"\nretention = \"0s\"";
    let admin = format!("[admin]\ntoken = \"{ADMIN}\"");
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b"] {
        // Every node has a directory of its own: nothing is shared but PG and the bucket.
        let data = dir.path().join(id);
        let Some(storage) = s3_storage_toml(test, &data, &prefix, gc) else {
            return;
        };
        nodes.push(NodeProcess::start_with_storage(
            dir.path(),
            id,
            db.url(),
            SHARDS,
            &storage,
            &admin,
        ));
    }
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let ready = support::wait_until(Duration::from_secs(60), || {
        let urls = urls.clone();
        async move {
            for url in &urls {
                if !is_ready(&client(), url).await {
                    return false;
                }
            }
            true
        }
    })
    .await;
    assert!(
        ready,
        "nodes not ready:\n{}\n{}",
        nodes[0].log_text(),
        nodes[1].log_text()
    );
    let (a, b) = (&urls[0], &urls[1]);

    // Upload through A, download through B, byte-exact.
    let live = random_bytes(20 << 20, 31);
    let created = upload(a, live.clone()).await;
    let live_key = created["key"].as_str().unwrap().to_string();
    assert!(created["fresh_blocks"].as_u64().unwrap() > 0);
    let (status, got) = support::download(b, &live_key).await;
    assert_eq!(status, 200);
    assert!(
        got == live,
        "download through B differs from the upload through A"
    );
    let packs_after_first = pack_rows(db.url()).await;
    assert!(packs_after_first >= 3, "20 MiB in 8 MiB packs");

    // Dedup across nodes: the same bytes through B store no block and no pack.
    let again = upload(b, live.clone()).await;
    assert_eq!(again["key"], created["key"]);
    assert_eq!(again["fresh_blocks"].as_u64(), Some(0), "{again}");
    assert_eq!(pack_rows(db.url()).await, packs_after_first);

    // A blob deleted, and an upload aborted after sealing packs (orphans in the bucket).
    let doomed = random_bytes(3 << 20, 32);
    let doomed_key = upload(b, doomed).await["key"].as_str().unwrap().to_string();
    let response = client()
        .delete(format!("{a}/v1/blobs/{doomed_key}"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204);
    let objects_before_abort = objects(&prefix).await;
    // 20 MiB in 8 MiB packs: two packs sealed and stored, the rest never arrives.
    aborted_upload(a, &prefix, 30 << 20, random_bytes(20 << 20, 33), 2).await;
    let orphaned = objects(&prefix).await - objects_before_abort;
    assert_eq!(orphaned, 2);
    let rows = pack_rows(db.url()).await;

    // A second collector is kept out while the lock is held elsewhere.
    let mut holder = sqlx::PgConnection::connect(db.url()).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(GC_LOCK_KEY)
        .execute(&mut holder)
        .await
        .unwrap();
    let (status, body) = run_gc(b).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"], "gc_running");
    assert_eq!(objects(&prefix).await, objects_before_abort + orphaned);
    assert_eq!(
        pack_rows(db.url()).await,
        rows,
        "a refused run changes nothing"
    );
    holder.close().await.unwrap();

    // Past the grace period: the run reclaims the orphans and quarantines and retires the
    // deleted blob's pack; the next run purges it (retention 0). Live blocks stay.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, first) = run_gc(b).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        first["orphan_packs_deleted"].as_u64(),
        Some(orphaned as u64)
    );
    assert!(first["quarantined"].as_u64().unwrap() > 0, "{first}");
    assert!(first["packs_retired"].as_u64().unwrap() >= 1, "{first}");
    let (status, second) = run_gc(a).await;
    assert_eq!(status, 200, "{second}");
    assert!(second["packs_deleted"].as_u64().unwrap() >= 1, "{second}");
    assert_eq!(
        objects(&prefix).await as i64,
        pack_rows(db.url()).await,
        "every object left is indexed"
    );
    assert_eq!(pack_rows(db.url()).await, packs_after_first);
    for url in [a, b] {
        let (status, got) = support::download(url, &live_key).await;
        assert_eq!(status, 200);
        assert!(got == live, "a live blob changed after collection");
        assert_eq!(support::download(url, &doomed_key).await.0, 404);
    }
    // `graviton verify` checks the shared index and bucket beside the running nodes.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graviton"))
        .args(["verify", "--config"])
        .arg(&nodes[0].config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["packs_checked"].as_i64(),
        Some(pack_rows(db.url()).await),
        "{report}"
    );
    assert_eq!(report["damaged"], serde_json::json!([]), "{report}");
}

/// A shared store on the test servers, in process (the collector's races).
async fn shared_store(test: &str) -> Option<(support::TestDatabase, PackStore, tempfile::TempDir)> {
    shared_store_in(test, tempfile::tempdir().unwrap()).await
}

/// [`shared_store`] with `dir` (prepared by the test) as its data directory.
async fn shared_store_in(
    test: &str,
    dir: tempfile::TempDir,
) -> Option<(support::TestDatabase, PackStore, tempfile::TempDir)> {
    let db = support::TestDatabase::create(test).await?;
    s3_storage_toml(test, std::path::Path::new("/"), "", "")?;
    let pool = sqlx::PgPool::connect(db.url()).await.unwrap();
    graviton::storage::pg::migrate(&pool).await.unwrap();
    let medium = S3Medium::new(
        &s3_config(&format!("race-{}", support::unique_suffix())),
        None,
    )
    .unwrap();
    medium.probe().await.unwrap();
    let store = PackStore::open_shared(
        dir.path(),
        Arc::new(medium),
        PackOptions {
            pack_size: 1 << 20,
            fsync: false,
            trace: None,
        },
        PgIndex::new(pool),
    )
    .unwrap();
    Some((db, store, dir))
}

fn no_grace(purge: bool) -> GcOptions {
    GcOptions {
        min_age: Duration::ZERO,
        retention: Duration::ZERO,
        compact_below: 0.5,
        dry_run: false,
        purge,
        // Small batches: every run spans several quarantine and purge transactions.
        batch: 2,
    }
}

fn manifest_of(blocks: &[Bytes]) -> Manifest {
    let refs: Vec<BlockRef> = blocks
        .iter()
        .map(|b| BlockRef {
            key: BlockKey::of(b),
            size: b.len() as u32,
        })
        .collect();
    let whole: Vec<u8> = blocks.iter().flat_map(|b| b.iter().copied()).collect();
    let key = BlobKey {
        hash: *blake3::hash(&whole).as_bytes(),
        size: whole.len() as u64,
    };
    Manifest::new(key, refs, 1)
}

// Checks STO-10: a pack the collector deleted as an orphan while its upload was still
// running fails that upload's commit (no manifest), instead of indexing missing bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_pack_was_collected_as_an_orphan_fails() {
    let test = "a_commit_whose_pack_was_collected_as_an_orphan_fails";
    let Some((db, store, _dir)) = shared_store(test).await else {
        return;
    };
    let manifests = Arc::new(PgManifestStore::new(store.shared().unwrap().pool().clone()));
    let blocks: Vec<Bytes> = (0..24)
        .map(|i| Bytes::from(random_bytes(64 << 10, 100 + i)))
        .collect();
    let mut session = store.begin().unwrap();
    for block in &blocks {
        session
            .append(BlockKey::of(block), block.clone())
            .await
            .unwrap();
    }
    // More than one pack's worth was appended: the first pack is on S3, not indexed.
    let medium = store.medium().clone();
    let sealed = support::wait_until(Duration::from_secs(30), || {
        let medium = medium.clone();
        async move {
            tokio::task::spawn_blocking(move || !medium.list().unwrap().is_empty())
                .await
                .unwrap()
        }
    })
    .await;
    assert!(sealed, "no pack was sealed");
    let report = gc::collect(&store, manifests.as_ref(), no_grace(false), &mut Quiet)
        .await
        .unwrap();
    assert!(report.orphan_packs_deleted >= 1, "{report:?}");
    let manifest = manifest_of(&blocks);
    let key = manifest.key;
    let err = session
        .commit_manifest(manifest, manifests.clone(), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Unavailable(m) if m.contains("deleted by the collector")),
        "{err}"
    );
    assert!(manifests.get(key).await.unwrap().is_none());
    assert_eq!(
        pack_rows(db.url()).await,
        0,
        "the failed commit indexed nothing"
    );
}

// Checks STO-3 and STO-10 on the shared index: a dedup hit looked up before the
// collector quarantined and purged the block fails its commit; one taken before the
// quarantine only (the pack still there) restores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedup_hit_on_a_block_collected_meanwhile_fails_its_commit() {
    let test = "a_dedup_hit_on_a_block_collected_meanwhile_fails_its_commit";
    let Some((_db, store, _dir)) = shared_store(test).await else {
        return;
    };
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(PgManifestStore::new(store.shared().unwrap().pool().clone()));
    let block = Bytes::from(random_bytes(100 << 10, 7));
    let key = BlockKey::of(&block);
    let mut first = store.begin().unwrap();
    first.append(key, block.clone()).await.unwrap();
    first.commit().await.unwrap();
    assert_eq!(store.get(key).await.unwrap().as_ref(), Some(&block));

    // Looked up as stored, then quarantined by a run (no manifest names it): the commit
    // restores it, since its pack is still there.
    let mut restorer = store.begin().unwrap();
    assert_eq!(
        restorer.append(key, block.clone()).await.unwrap(),
        graviton::storage::PutOutcome::Duplicate
    );
    let run = gc::collect(&store, manifests.as_ref(), no_grace(false), &mut Quiet)
        .await
        .unwrap();
    assert_eq!(run.quarantined, 1, "{run:?}");
    restorer
        .commit_manifest(
            manifest_of(std::slice::from_ref(&block)),
            manifests.clone(),
            None,
        )
        .await
        .unwrap();
    assert_eq!(store.get(key).await.unwrap().as_ref(), Some(&block));
    manifests
        .delete(manifest_of(std::slice::from_ref(&block)).key)
        .await
        .unwrap();

    // Looked up as stored, then quarantined, retired and purged: the commit fails.
    let mut late = store.begin().unwrap();
    assert_eq!(
        late.append(key, block.clone()).await.unwrap(),
        graviton::storage::PutOutcome::Duplicate
    );
    gc::collect(&store, manifests.as_ref(), no_grace(true), &mut Quiet)
        .await
        .unwrap();
    let purge = gc::collect(&store, manifests.as_ref(), no_grace(true), &mut Quiet)
        .await
        .unwrap();
    assert!(purge.packs_deleted >= 1, "{purge:?}");
    let manifest = manifest_of(std::slice::from_ref(&block));
    let blob = manifest.key;
    let err = late
        .commit_manifest(manifest, manifests.clone(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(manifests.get(blob).await.unwrap().is_none());
    assert!(store.get(key).await.unwrap().is_none());
}

// Checks STO-18: on the shared index, a pack whose live bytes fell below
// `compact_below` is rewritten: its live blocks move to a new pack (published, then
// relocated in one transaction), the old pack is retired and kept for readers that
// located it before, then purged; a dedup hit taken before the compaction still
// commits; a dry run reports the rewrite and changes nothing; every object left is named
// by a row, and every live block reads byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_pack_on_s3_is_compacted_and_every_live_block_still_reads() {
    let test = "a_sparse_pack_on_s3_is_compacted_and_every_live_block_still_reads";
    let Some((db, store, _dir)) = shared_store(test).await else {
        return;
    };
    let index = store.shared().unwrap().clone();
    let manifests: Arc<dyn ManifestStore> = Arc::new(PgManifestStore::new(index.pool().clone()));
    // Twelve 64 KiB blocks in one pack (1 MiB packs), then two of them kept by a second
    // blob and the first blob deleted: the pack is about 1/6 live.
    let blocks: Vec<Bytes> = (0..12)
        .map(|i| Bytes::from(random_bytes(64 << 10, 300 + i)))
        .collect();
    let mut session = store.begin().unwrap();
    for block in &blocks {
        session
            .append(BlockKey::of(block), block.clone())
            .await
            .unwrap();
    }
    let all = manifest_of(&blocks);
    session
        .commit_manifest(all.clone(), manifests.clone(), None)
        .await
        .unwrap();
    let kept = &blocks[..2];
    let mut session = store.begin().unwrap();
    for block in kept {
        session
            .append(BlockKey::of(block), block.clone())
            .await
            .unwrap();
    }
    session
        .commit_manifest(manifest_of(kept), manifests.clone(), None)
        .await
        .unwrap();
    manifests.delete(all.key).await.unwrap();
    let old = index
        .lookup(&BlockKey::of(&kept[0]))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pack_rows(db.url()).await, 1, "one pack holds every block");

    // A dedup hit taken before the compaction, committed after it.
    let mut pending = store.begin().unwrap();
    assert_eq!(
        pending
            .append(BlockKey::of(&kept[1]), kept[1].clone())
            .await
            .unwrap(),
        graviton::storage::PutOutcome::Duplicate
    );

    let dry = GcOptions {
        dry_run: true,
        ..no_grace(false)
    };
    let report = gc::collect(&store, manifests.as_ref(), dry, &mut Quiet)
        .await
        .unwrap();
    assert_eq!(report.packs_rewritten, 1, "{report:?}");
    assert_eq!(
        index
            .lookup(&BlockKey::of(&kept[0]))
            .await
            .unwrap()
            .unwrap()
            .pack,
        old.pack,
        "a dry run moves nothing"
    );
    assert_eq!(pack_rows(db.url()).await, 1);

    let report = gc::collect(&store, manifests.as_ref(), no_grace(false), &mut Quiet)
        .await
        .unwrap();
    assert_eq!(report.quarantined, 10, "{report:?}");
    assert_eq!(report.packs_rewritten, 1, "{report:?}");
    assert!(report.packs_retired >= 1, "{report:?}");
    for block in kept {
        let at = index.lookup(&BlockKey::of(block)).await.unwrap().unwrap();
        assert_ne!(
            at.pack, old.pack,
            "a live block still names the sparse pack"
        );
        assert_eq!(
            store.get(BlockKey::of(block)).await.unwrap().as_ref(),
            Some(block)
        );
    }
    // A reader that located the block before the compaction still reads the old pack.
    let medium = store.medium().clone();
    let stale =
        tokio::task::spawn_blocking(move || medium.read(&old.pack, old.offset, u64::from(old.len)))
            .await
            .unwrap()
            .unwrap();
    assert!(stale == kept[0], "the retired pack is kept until the purge");
    pending
        .commit_manifest(manifest_of(&kept[1..]), manifests.clone(), None)
        .await
        .unwrap();

    let purge = gc::collect(&store, manifests.as_ref(), no_grace(true), &mut Quiet)
        .await
        .unwrap();
    assert!(purge.packs_deleted >= 1, "{purge:?}");
    let medium = store.medium().clone();
    let listed: Vec<_> = tokio::task::spawn_blocking(move || medium.list().unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert!(!listed.contains(&old.pack), "the sparse pack is purged");
    assert_eq!(
        listed.len() as i64,
        pack_rows(db.url()).await,
        "every object left is named"
    );
    let keys: Vec<BlockKey> = kept.iter().map(|b| BlockKey::of(b)).collect();
    let read: Vec<Option<Bytes>> =
        futures_util::TryStreamExt::try_collect(Arc::new(store.clone()).read_blocks(keys))
            .await
            .unwrap();
    let want: Vec<Option<Bytes>> = kept.iter().cloned().map(Some).collect();
    assert!(read == want, "live blocks read byte-exact after the purge");
}

// Checks STO-19: `verify` on the shared index reads every live pack from the bucket and
// checks every block hash and every live row; a lost object and a pack whose bytes were
// changed under its name are both reported, with the rows they affect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_on_the_shared_index_reports_a_lost_and_a_corrupt_pack() {
    let test = "verify_on_the_shared_index_reports_a_lost_and_a_corrupt_pack";
    let Some((db, store, dir)) = shared_store(test).await else {
        return;
    };
    let index = store.shared().unwrap().clone();
    let blocks: Vec<Bytes> = (0..24)
        .map(|i| Bytes::from(random_bytes(64 << 10, 400 + i)))
        .collect();
    let mut session = store.begin().unwrap();
    for block in &blocks {
        session
            .append(BlockKey::of(block), block.clone())
            .await
            .unwrap();
    }
    session.commit().await.unwrap();
    let packs = pack_rows(db.url()).await;
    assert!(packs >= 2, "1.5 MiB in 1 MiB packs");
    let clean = gc::verify(&store, &mut Quiet).await.unwrap();
    assert_eq!(clean.packs_checked as i64, packs, "{clean:?}");
    assert_eq!(clean.blocks_checked, 24, "{clean:?}");
    assert!(
        clean.damaged.is_empty() && clean.entries_affected == 0,
        "{clean:?}"
    );

    // The first block's pack loses its object; the last block's pack has one byte of a
    // block changed under the same name.
    let lost = index
        .lookup(&BlockKey::of(&blocks[0]))
        .await
        .unwrap()
        .unwrap();
    let bent = index
        .lookup(&BlockKey::of(&blocks[23]))
        .await
        .unwrap()
        .unwrap();
    assert_ne!(lost.pack, bent.pack);
    let per_pack = |id: graviton::storage::pack::format::PackId| {
        let url = db.url().to_string();
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pack_blocks WHERE pack_id = $1")
                .bind(id.0.as_slice())
                .fetch_one(&mut conn)
                .await
                .unwrap()
        }
    };
    let affected = per_pack(lost.pack).await + per_pack(bent.pack).await;
    let medium = store.medium().clone();
    let spool = dir.path().join("bent.spool");
    tokio::task::spawn_blocking(move || {
        let mut bytes = medium.read_all(&bent.pack).unwrap().to_vec();
        bytes[bent.offset as usize + 7] ^= 0x40;
        std::fs::write(&spool, &bytes).unwrap();
        medium.delete(&lost.pack).unwrap();
        medium.delete(&bent.pack).unwrap();
        let file = std::fs::File::open(&spool).unwrap();
        medium.publish(file, &spool, &bent.pack).unwrap();
    })
    .await
    .unwrap();
    let report = gc::verify(&store, &mut Quiet).await.unwrap();
    assert_eq!(report.damaged.len(), 2, "{report:?}");
    for id in [lost.pack, bent.pack] {
        assert!(
            report
                .damaged
                .iter()
                .any(|d| d.starts_with(&id.to_string())),
            "{id} not reported: {report:?}"
        );
    }
    assert_eq!(report.entries_affected as i64, affected, "{report:?}");
}

// Checks STO-5 in a cluster: the file-per-block directory of a shared mount moves into
// the bucket and the shared index (`graviton migrate-blocks` in cluster mode): every
// block indexed and byte-exact, the files removed only after their commit, a rerun
// finds nothing left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_mounts_blocks_migrate_into_the_bucket_and_the_shared_index() {
    let test = "a_shared_mounts_blocks_migrate_into_the_bucket_and_the_shared_index";
    let dir = tempfile::tempdir().unwrap();
    let legacy = graviton::storage::fs::FsBlockStore::open(dir.path(), false).unwrap();
    let blocks: Vec<Bytes> = (0..30)
        .map(|i| Bytes::from(random_bytes(40 << 10, 600 + i)))
        .collect();
    for block in &blocks {
        legacy
            .put(BlockKey::of(block), block.clone())
            .await
            .unwrap();
    }
    let Some((db, store, _dir)) = shared_store_in(test, dir).await else {
        return;
    };
    assert_eq!(gc::migrate_blocks(&store, &mut Quiet).await.unwrap(), 30);
    assert!(legacy.list().unwrap().is_empty(), "the files are gone");
    let index = store.shared().unwrap();
    for block in &blocks {
        assert!(index.lookup(&BlockKey::of(block)).await.unwrap().is_some());
        assert_eq!(
            store.get(BlockKey::of(block)).await.unwrap().as_ref(),
            Some(block)
        );
    }
    assert!(pack_rows(db.url()).await >= 2, "1.2 MiB in 1 MiB packs");
    assert_eq!(gc::migrate_blocks(&store, &mut Quiet).await.unwrap(), 0);
    let report = gc::verify(&store, &mut Quiet).await.unwrap();
    assert!(
        report.damaged.is_empty() && report.entries_affected == 0,
        "{report:?}"
    );
    assert_eq!(report.blocks_checked, 30, "{report:?}");
}

// Checks STO-13 (and STO-10 with real processes): `graviton gc` against the cluster stops
// (SIGSTOP) right after it has chosen its candidates, and stays stopped past min_age
// while the node keeps taking uploads, one of which deduplicates against those very
// candidates. Meanwhile its advisory lock stays held (a second run gets 409). Resumed, it
// quarantines and deletes nothing live, and every blob acknowledged meanwhile downloads
// byte-exact, also after two more runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_collector_stopped_past_min_age_deletes_nothing_live() {
    use std::io::BufRead;
    let test = "a_cluster_collector_stopped_past_min_age_deletes_nothing_live";
    let Some(db) = support::TestDatabase::create(test).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("stopped-{}", support::unique_suffix());
    let gc = "\n[storage.gc]\nmin_age = \"1s\"\nretention = \"0s\"";
    let Some(storage) = s3_storage_toml(test, &dir.path().join("node-a"), &prefix, gc) else {
        return;
    };
    let admin = format!("[admin]\ntoken = \"{ADMIN}\"");
    let node =
        NodeProcess::start_with_storage(dir.path(), "node-a", db.url(), SHARDS, &storage, &admin);
    let http = client();
    let ready = support::wait_until(Duration::from_secs(60), || is_ready(&http, &node.url)).await;
    assert!(ready, "node not ready:\n{}", node.log_text());
    let url = &node.url;

    // A blob deleted: its blocks are candidates once older than min_age.
    let doomed = random_bytes(3 << 20, 41);
    let key = upload(url, doomed.clone()).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    support::delete_blob(url, &key, ADMIN).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The collector stops itself once its candidates are chosen.
    let mut collector = std::process::Command::new(env!("CARGO_BIN_EXE_graviton"))
        .args(["gc", "--purge", "--config"])
        .arg(&node.config)
        .env("GRAVITON_TEST_STOP_AFTER", "gc mark again")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = collector.id();
    let stderr = collector.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut log = Vec::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("stopping after gc mark again") {
                let _ = tx.send(Ok(()));
            }
            log.push(line);
        }
        let _ = tx.send(Err(log.join("\n")));
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(Ok(())) => {}
        other => panic!("the collector did not reach its stop: {other:?}"),
    }
    assert!(
        support::wait_until(Duration::from_secs(30), || async {
            support::process_stopped(pid)
        })
        .await,
        "the collector is not stopped"
    );

    // Stopped past min_age; uploads continue, one re-referencing the candidates.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let again = upload(url, doomed.clone()).await;
    assert_eq!(again["key"].as_str(), Some(key.as_str()));
    assert_eq!(again["fresh_blocks"].as_u64(), Some(0), "{again}");
    let fresh = random_bytes(2 << 20, 42);
    let fresh_key = upload(url, fresh.clone()).await["key"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, body) = run_gc(url).await;
    assert_eq!(
        status, 409,
        "the stopped collector still holds the lock: {body}"
    );
    assert!(support::process_stopped(pid));

    // Resumed: it finishes, quarantining and deleting nothing live.
    // SAFETY: kill sends a signal to the collector this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGCONT) }, 0);
    let out = tokio::task::spawn_blocking(move || collector.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["candidates"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["quarantined"], 0, "{report}");
    assert_eq!(report["packs_retired"], 0, "{report}");
    assert_eq!(report["packs_deleted"], 0, "{report}");
    for (k, data) in [(&key, &doomed), (&fresh_key, &fresh)] {
        let (status, got) = support::download(url, k).await;
        assert_eq!(status, 200);
        assert!(got == *data, "a blob acknowledged meanwhile is byte-exact");
    }
    // Later runs (past min_age) keep them too, and leave only indexed objects.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for _ in 0..2 {
        let (status, body) = run_gc(url).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["quarantined"], 0, "{body}");
    }
    for (k, data) in [(&key, &doomed), (&fresh_key, &fresh)] {
        assert!(support::download(url, k).await.1 == *data);
    }
    assert_eq!(objects(&prefix).await as i64, pack_rows(db.url()).await);
}

// The batched dedup lookup of the shared index (one query per batch): `append_many`
// answers exactly what `append` would, in order, including repeats inside the batch and
// blocks stored by another session; the blocks read back after the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_blocks_is_looked_up_in_one_query_with_appends_answers() {
    use graviton::storage::PutOutcome::{Duplicate, Fresh};
    let test = "a_batch_of_blocks_is_looked_up_in_one_query_with_appends_answers";
    let Some((_db, store, _dir)) = shared_store(test).await else {
        return;
    };
    let manifests: Arc<dyn ManifestStore> =
        Arc::new(PgManifestStore::new(store.shared().unwrap().pool().clone()));
    let blocks: Vec<Bytes> = (0..4)
        .map(|i| Bytes::from(random_bytes(40 << 10, 60 + i)))
        .collect();
    let keyed = |i: usize| (BlockKey::of(&blocks[i]), blocks[i].clone());
    let mut first = store.begin().unwrap();
    first.append_many(vec![keyed(0), keyed(1)]).await.unwrap();
    first.commit().await.unwrap();

    let mut second = store.begin().unwrap();
    let outcomes = second
        .append_many(vec![
            keyed(0),
            keyed(2),
            keyed(2),
            keyed(1),
            keyed(3),
            keyed(0),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        vec![Duplicate, Fresh, Duplicate, Duplicate, Fresh, Duplicate]
    );
    second
        .commit_manifest(manifest_of(&blocks), manifests.clone(), None)
        .await
        .unwrap();
    for block in &blocks {
        assert_eq!(
            store.get(BlockKey::of(block)).await.unwrap().as_ref(),
            Some(block)
        );
    }
}
