//! The pack store on a real S3-compatible server (Garage, started by scripts/services.sh;
//! `GRAVITON_TEST_S3_*` say where). No mock: every request goes to the server.

mod support;

use std::time::Duration;

use graviton::config::{Config, Secret};
use graviton::node::NodeOptions;
use graviton::storage::config::{Backend, S3Config};
use graviton::storage::pack::medium::Medium;
use graviton::storage::pack::s3::S3Medium;
use support::node::{TestNode, random_bytes};

fn s3_config(test: &str) -> Option<S3Config> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let (Some(endpoint), Some(bucket), Some(key), Some(secret)) = (
        var("GRAVITON_TEST_S3_ENDPOINT"),
        var("GRAVITON_TEST_S3_BUCKET"),
        var("GRAVITON_TEST_S3_ACCESS_KEY"),
        var("GRAVITON_TEST_S3_SECRET_KEY"),
    ) else {
        support::missing_service(
            test,
            "S3 server (GRAVITON_TEST_S3_*; run scripts/services.sh)",
        );
        return None;
    };
    Some(S3Config {
        endpoint,
        bucket,
        region: var("GRAVITON_TEST_S3_REGION").unwrap_or_else(|| "garage".into()),
        path_style: true,
        // a prefix per test keeps listings apart
        prefix: format!("test-{}", support::unique_suffix()),
        access_key_id: key,
        secret_access_key: Some(Secret::new(secret)),
        request_timeout: graviton::config::HumanDuration(Duration::from_secs(10)),
        max_retries: 2,
        ..Default::default()
    })
}

// Checks STO-8.
#[tokio::test]
async fn uploads_land_in_packs_on_s3_and_download_byte_exact() {
    let Some(s3) = s3_config("uploads_land_in_packs_on_s3_and_download_byte_exact") else {
        return;
    };
    let node = TestNode::start_with(
        |config: &mut Config| {
            config.storage.backend = Some(Backend::S3);
            config.storage.pack_size = graviton::config::ByteSize(8 << 20);
            config.storage.s3 = s3.clone();
        },
        NodeOptions::default(),
    )
    .await;
    let client = support::client();
    let data = random_bytes(20 << 20, 5);
    let response = client
        .post(format!("{}/v1/blobs", node.url))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let created: serde_json::Value = response.json().await.unwrap();
    let key = created["key"].as_str().unwrap().to_string();
    // nothing but the spool directory is local: the packs are in the bucket
    assert_eq!(
        support::node::packed_blocks(&node.dir.path().join("packs")),
        0
    );
    let medium = S3Medium::new(&s3, None).unwrap();
    // Medium calls block (they run on the blocking pool in the store)
    let packs = tokio::task::spawn_blocking(move || medium.list())
        .await
        .unwrap()
        .unwrap();
    // 20 MiB in 8 MiB packs: three PUTs, not one per block
    assert_eq!(packs.len(), 3, "{packs:?}");

    let body = client
        .get(format!("{}/v1/blobs/{key}", node.url))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(body[..] == data[..], "byte-exact through ranged GETs");
    // a range reads only what it needs
    let ranged = client
        .get(format!("{}/v1/blobs/{key}", node.url))
        .header("range", "bytes=10000000-10000999")
        .send()
        .await
        .unwrap();
    assert_eq!(ranged.status(), 206);
    assert!(ranged.bytes().await.unwrap()[..] == data[10_000_000..10_001_000]);
}

/// A client of the test bucket of its own (not the product's medium), for what the server
/// itself does.
fn raw_bucket(s3: &S3Config) -> object_store::aws::AmazonS3 {
    object_store::aws::AmazonS3Builder::new()
        .with_bucket_name(&s3.bucket)
        .with_region(&s3.region)
        .with_access_key_id(&s3.access_key_id)
        .with_secret_access_key(s3.secret_access_key.as_ref().unwrap().expose())
        .with_virtual_hosted_style_request(false)
        .with_endpoint(&s3.endpoint)
        .with_client_options(object_store::ClientOptions::new().with_allow_http(true))
        .build()
        .unwrap()
}

// The probe's answer is checked against what the server does with a second
// `If-None-Match: *` create of one key (observed through a client of the test's own):
// it honours the header exactly when the first object's bytes survive the second create,
// and the second create is then refused. And what the product relies on holds whatever
// the answer: publishing a pack whose object already exists (a racing copy: same name,
// same bytes) succeeds and leaves the bytes readable.
#[tokio::test]
async fn the_conditional_create_probe_answers_and_secrets_stay_out_of_debug() {
    use graviton::storage::pack::format::PackId;
    use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
    let Some(s3) = s3_config("the_conditional_create_probe_answers_and_secrets_stay_out_of_debug")
    else {
        return;
    };
    let medium = S3Medium::new(&s3, None).unwrap();
    let honoured = medium.probe().await.unwrap();
    assert_eq!(medium.conditional_create(), honoured);

    let raw = raw_bucket(&s3);
    let key = object_store::path::Path::from(format!("{}/if-none-match-check", s3.prefix));
    let create = || PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    raw.put_opts(&key, PutPayload::from_static(b"first"), create())
        .await
        .expect("a create of a new key succeeds");
    let second = raw
        .put_opts(&key, PutPayload::from_static(b"second"), create())
        .await;
    let kept = raw.get(&key).await.unwrap().bytes().await.unwrap();
    match &second {
        Ok(_) => assert_eq!(&kept[..], b"second", "an accepted create overwrote"),
        Err(
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. },
        ) => {
            assert_eq!(&kept[..], b"first", "a refused create changed nothing")
        }
        Err(other) => panic!("the server answered a second create with {other}"),
    }
    eprintln!("server honours If-None-Match: {honoured}");
    assert_eq!(
        honoured,
        second.is_err(),
        "the probe says {honoured}, the server {} a second create",
        if second.is_err() {
            "refused"
        } else {
            "accepted"
        }
    );
    raw.delete(&key).await.unwrap();

    let medium = std::sync::Arc::new(medium);
    let id = PackId::try_from_slice(blake3::hash(s3.prefix.as_bytes()).as_bytes()).unwrap();
    let bytes = bytes::Bytes::from(random_bytes(64 << 10, 17));
    let (m, b) = (medium.clone(), bytes.clone());
    let read = tokio::task::spawn_blocking(move || {
        m.put_pack(&id, b.clone())?;
        m.put_pack(&id, b)?; // the racing copy
        m.read_all(&id)
    })
    .await
    .unwrap()
    .expect("a pack published twice is stored once and reads back");
    assert!(read == bytes, "the pack's bytes after the second publish");
    let m = medium.clone();
    tokio::task::spawn_blocking(move || m.delete(&id))
        .await
        .unwrap()
        .unwrap();

    let secret = s3.secret_access_key.as_ref().unwrap().expose().to_string();
    assert!(!format!("{medium:?}").contains(&secret));
    assert!(!format!("{s3:?}").contains(&secret));
    // a wrong secret is refused by the server: the probe fails, without the secret in it
    let mut wrong = s3.clone();
    wrong.secret_access_key = Some(Secret::new("not-the-secret-0123456789"));
    let err = S3Medium::new(&wrong, None)
        .unwrap()
        .probe()
        .await
        .unwrap_err();
    assert!(!err.to_string().contains("not-the-secret"), "{err}");
}

/// A pack store on the test bucket with its index in `dir`, and a blob of `data` in it.
async fn ingested_on_s3(
    s3: &S3Config,
    dir: &std::path::Path,
    data: &[u8],
) -> (
    std::sync::Arc<S3Medium>,
    std::sync::Arc<dyn graviton::storage::BlockStore>,
    std::sync::Arc<graviton::cas::Manifest>,
) {
    use graviton::pipeline::ingest::{IngestLimits, ingest};
    use graviton::storage::ManifestStore;
    use graviton::storage::fs::FsManifestStore;
    use graviton::storage::pack::{PackOptions, PackStore};
    use std::sync::Arc;

    let medium = Arc::new(S3Medium::new(s3, None).unwrap());
    medium.probe().await.unwrap();
    let options = PackOptions {
        pack_size: 8 << 20,
        fsync: false,
        trace: None,
    };
    let store: Arc<dyn graviton::storage::BlockStore> =
        Arc::new(PackStore::open(dir, medium.clone(), options).unwrap());
    let manifests: Arc<dyn ManifestStore> = Arc::new(FsManifestStore::open(dir, false).unwrap());
    let frames: Vec<Result<bytes::Bytes, std::io::Error>> = data
        .chunks(64 << 10)
        .map(|piece| Ok(bytes::Bytes::copy_from_slice(piece)))
        .collect();
    let limits = IngestLimits {
        max_size: u64::MAX,
        declared_size: Some(data.len() as u64),
        idle_timeout: Duration::from_secs(60),
        digest: None,
    };
    let report = ingest(
        futures_util::stream::iter(frames),
        limits,
        store.clone(),
        manifests.clone(),
        |_| {},
    )
    .await
    .unwrap();
    let manifest = manifests.get(report.key).await.unwrap().unwrap();
    (medium, store, Arc::new(manifest))
}

async fn read_all(
    store: std::sync::Arc<dyn graviton::storage::BlockStore>,
    manifest: std::sync::Arc<graviton::cas::Manifest>,
    range: Option<graviton::cas::range::ByteRange>,
) -> Result<Vec<u8>, graviton::pipeline::read::ReadError> {
    use futures_util::StreamExt;
    let mut stream = Box::pin(graviton::pipeline::read::read_blob(store, manifest, range));
    let mut out = Vec::new();
    while let Some(piece) = stream.next().await {
        out.extend_from_slice(&piece?);
    }
    Ok(out)
}

// Checks STO-21: small uploads that commit at the same time on S3 share group packs:
// fewer PUTs than uploads, a block two of them share written once per group pack, every
// block indexed and read back byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_uploads_committing_together_share_group_packs_on_s3() {
    use graviton::cas::BlockKey;
    use graviton::storage::BlockStore;
    use graviton::storage::pack::{PackOptions, PackStore, format};
    use std::sync::Arc;

    let Some(s3) = s3_config("small_uploads_committing_together_share_group_packs_on_s3") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let medium = Arc::new(S3Medium::new(&s3, None).unwrap());
    medium.probe().await.unwrap();
    let options = PackOptions {
        pack_size: 8 << 20,
        fsync: false,
        trace: None,
    };
    let store = PackStore::open(dir.path(), medium.clone(), options).unwrap();
    const UPLOADS: usize = 24;
    let shared = bytes::Bytes::from(random_bytes(32 << 10, 500));
    let mut sessions = Vec::new();
    let mut blocks = Vec::new();
    for u in 0..UPLOADS {
        let mut session = store.begin().unwrap();
        let mut own = vec![shared.clone()];
        own.extend(
            (0..3).map(|b| bytes::Bytes::from(random_bytes(32 << 10, 501 + (u * 3 + b) as u64))),
        );
        for block in &own {
            session
                .append(BlockKey::of(block), block.clone())
                .await
                .unwrap();
        }
        sessions.push(session);
        blocks.extend(own);
    }
    let before = medium.pack_puts();
    let commits = futures_util::future::join_all(sessions.into_iter().map(|s| s.commit())).await;
    for commit in commits {
        assert_eq!(
            commit.unwrap().packs,
            1,
            "each upload names one (group) pack"
        );
    }
    let puts = medium.pack_puts() - before;
    assert!(
        puts < (UPLOADS / 2) as u64,
        "{puts} PUTs for {UPLOADS} small uploads committing together"
    );
    let lister = medium.clone();
    let packs = tokio::task::spawn_blocking(move || lister.list().unwrap())
        .await
        .unwrap();
    assert_eq!(packs.len() as u64, puts, "every PUT is a pack");
    for (id, _) in packs {
        let reader = medium.clone();
        let bytes = tokio::task::spawn_blocking(move || reader.read_all(&id).unwrap())
            .await
            .unwrap();
        let entries = format::verify_pack(&bytes, &id).unwrap();
        let copies = entries
            .iter()
            .filter(|e| e.key == BlockKey::of(&shared))
            .count();
        assert!(
            copies <= 1,
            "a block shared by a group is written once per pack"
        );
    }
    for block in &blocks {
        let got = store.get(BlockKey::of(block)).await.unwrap();
        assert_eq!(got.as_ref(), Some(block), "byte-exact from its group pack");
    }
}

// Checks STO-17: a download from S3 reads each run of adjacent blocks of a pack with one
// ranged GET (here, exactly one per pack), not one GET per block.
#[tokio::test]
async fn a_download_from_s3_reads_each_pack_run_with_one_request() {
    let Some(s3) = s3_config("a_download_from_s3_reads_each_pack_run_with_one_request") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = random_bytes(20 << 20, 17);
    let (medium, store, manifest) = ingested_on_s3(&s3, dir.path(), &data).await;
    let lister = medium.clone();
    let packs = tokio::task::spawn_blocking(move || lister.list())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(packs.len(), 3, "20 MiB in 8 MiB packs");
    assert!(
        manifest.blocks.len() > 200,
        "{} blocks",
        manifest.blocks.len()
    );

    let before = medium.block_reads();
    let body = read_all(store.clone(), manifest.clone(), None)
        .await
        .unwrap();
    assert!(body == data, "byte-exact");
    // One GET per pack: runs continue across lookup batches (more than 200 blocks are
    // located in several batches), and each 8 MiB pack is under the 16 MiB run limit.
    let gets = medium.block_reads() - before;
    assert_eq!(
        gets,
        packs.len() as u64,
        "{gets} ranged GETs for {} packs and {} blocks",
        packs.len(),
        manifest.blocks.len()
    );

    // A range inside one pack: one request, and only its bytes.
    let before = medium.block_reads();
    let range = graviton::cas::range::ByteRange {
        first: 1_000_000,
        last: 3_999_999,
    };
    let part = read_all(store, manifest, Some(range)).await.unwrap();
    assert!(part[..] == data[1_000_000..4_000_000]);
    assert_eq!(medium.block_reads() - before, 1);
}

// Checks STO-4 on the coalesced path: a pack that vanished from the bucket fails the
// download loudly.
#[tokio::test]
async fn a_download_whose_pack_vanished_from_s3_fails_loudly() {
    let Some(s3) = s3_config("a_download_whose_pack_vanished_from_s3_fails_loudly") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = random_bytes(12 << 20, 18);
    let (medium, store, manifest) = ingested_on_s3(&s3, dir.path(), &data).await;
    let m = medium.clone();
    tokio::task::spawn_blocking(move || {
        let packs = m.list().unwrap();
        assert_eq!(packs.len(), 2);
        // the pack holding the blob's last block
        for (id, _) in packs {
            let size = m.read_all(&id).unwrap().len();
            if size < 8 << 20 {
                m.delete(&id).unwrap();
            }
        }
    })
    .await
    .unwrap();
    let error = read_all(store, manifest, None).await.unwrap_err();
    assert!(
        error.to_string().contains("missing") || error.to_string().contains("pack"),
        "{error}"
    );
}
