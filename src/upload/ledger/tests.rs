use super::*;
use crate::ids::SessionKey;

fn id(n: u8) -> UploadId {
    UploadId(SessionKey {
        tenant: "6f1c1a8e-5d0b-4c8e-9f55-3f2a8f0e7a11".parse().unwrap(),
        session: format!("0b8e2f3a-1c4d-4e5f-8a9b-0c1d2e3f4a{n:02x}")
            .parse()
            .unwrap(),
    })
}

fn row(length: u64, expires_ms: u64) -> UploadRow {
    UploadRow {
        length,
        offset: 0,
        expires_ms,
        created_ms: 1,
        metadata: Some("name YQ==".into()),
        block_count: 0,
        blob_key: None,
    }
}

fn block(n: u8, size: u32) -> BlockRef {
    BlockRef {
        key: BlockKey([n; 32]),
        size,
    }
}

#[tokio::test]
async fn redb_ledger_advances_only_from_the_offset_it_read() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = RedbLedger::open(&dir.path().join("uploads.redb")).unwrap();
    assert!(ledger.create(id(1), &row(100, 1000), 10).await.unwrap());
    assert!(
        !ledger.create(id(1), &row(100, 1000), 10).await.unwrap(),
        "live: not replaced"
    );
    let step = |offset, tail: &'static [u8], blocks| Advance {
        offset,
        tail: Bytes::from_static(tail),
        blocks,
        expires_ms: 2000,
        blob_key: None,
    };
    assert!(
        ledger
            .advance(id(1), 0, step(40, b"xy", vec![block(1, 38)]))
            .await
            .unwrap()
    );
    // A second writer that read offset 0 loses.
    assert!(
        !ledger
            .advance(id(1), 0, step(40, b"zz", vec![block(9, 38)]))
            .await
            .unwrap()
    );
    assert!(
        ledger
            .advance(id(1), 40, step(90, b"abc", vec![block(2, 47)]))
            .await
            .unwrap()
    );
    let (got, tail) = ledger.get(id(1)).await.unwrap().unwrap();
    assert_eq!((got.offset, got.block_count, got.expires_ms), (90, 2, 2000));
    assert_eq!(&tail[..], b"abc");
    assert_eq!(
        ledger.blocks(id(1)).await.unwrap(),
        vec![block(1, 38), block(2, 47)]
    );
    let mut marked = Vec::new();
    ledger
        .for_each_block(&mut |k| marked.push(k))
        .await
        .unwrap();
    assert_eq!(marked.len(), 2);

    let key = BlobKey {
        hash: [7; 32],
        size: 100,
    };
    let done = Advance {
        blob_key: Some(key),
        ..step(100, b"", vec![])
    };
    assert!(ledger.advance(id(1), 90, done).await.unwrap());
    let (got, tail) = ledger.get(id(1)).await.unwrap().unwrap();
    assert_eq!(got.blob_key, Some(key.to_string()));
    assert!(tail.is_empty());
    assert!(
        ledger.blocks(id(1)).await.unwrap().is_empty(),
        "the manifest holds them now"
    );
    assert!(
        !ledger
            .advance(id(1), 100, step(100, b"", vec![]))
            .await
            .unwrap(),
        "complete"
    );
}

#[tokio::test]
async fn redb_ledger_sweeps_expired_rows_with_their_tails_and_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("uploads.redb");
    let ledger = RedbLedger::open(&path).unwrap();
    ledger.create(id(1), &row(10, 100), 0).await.unwrap();
    ledger.create(id(2), &row(10, 10_000), 0).await.unwrap();
    let step = Advance {
        offset: 5,
        tail: Bytes::from_static(b"12345"),
        blocks: vec![block(3, 1)],
        expires_ms: 100,
        blob_key: None,
    };
    assert!(ledger.advance(id(1), 0, step).await.unwrap());
    assert_eq!(ledger.sweep(500).await.unwrap(), 1);
    assert!(ledger.get(id(1)).await.unwrap().is_none());
    assert!(ledger.blocks(id(1)).await.unwrap().is_empty());
    assert!(ledger.get(id(2)).await.unwrap().is_some());
    // An expired id may be created again.
    ledger.create(id(3), &row(10, 100), 0).await.unwrap();
    assert!(ledger.create(id(3), &row(10, 9000), 200).await.unwrap());
    // Durable across a reopen.
    drop(ledger);
    let ledger = RedbLedger::open(&path).unwrap();
    assert!(ledger.get(id(2)).await.unwrap().is_some());
    assert!(ledger.delete(id(2)).await.unwrap());
    assert!(!ledger.delete(id(2)).await.unwrap());
}
