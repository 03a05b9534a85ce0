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
        generation: GEN,
        chunker: Bytes::new(),
    }
}

const GEN: u64 = 41;

fn at(offset: u64) -> RowVersion {
    RowVersion {
        generation: GEN,
        offset,
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
    assert!(
        ledger
            .create(id(1), &row(100, 1000), 10, None)
            .await
            .unwrap()
    );
    assert!(
        !ledger
            .create(id(1), &row(100, 1000), 10, None)
            .await
            .unwrap(),
        "live: not replaced"
    );
    let step = |offset, tail: &'static [u8], blocks| Advance {
        offset,
        tail: Bytes::from_static(tail),
        // Checks CAS-14: the saved chunker state travels with the tail.
        chunker: Bytes::copy_from_slice(&tail.len().to_le_bytes()),
        blocks,
        expires_ms: 2000,
        blob_key: None,
    };
    assert!(
        ledger
            .advance(id(1), at(0), step(40, b"xy", vec![block(1, 38)]), None)
            .await
            .unwrap()
    );
    // A second writer that read offset 0 loses.
    assert!(
        !ledger
            .advance(id(1), at(0), step(40, b"zz", vec![block(9, 38)]), None)
            .await
            .unwrap()
    );
    assert!(
        ledger
            .advance(id(1), at(40), step(90, b"abc", vec![block(2, 47)]), None)
            .await
            .unwrap()
    );
    let (got, tail) = ledger.get(id(1)).await.unwrap().unwrap();
    assert_eq!((got.offset, got.block_count, got.expires_ms), (90, 2, 2000));
    assert_eq!(&tail[..], b"abc");
    assert_eq!(&got.chunker[..], &3usize.to_le_bytes()[..]);
    assert_eq!(
        ledger.blocks(id(1), at(90)).await.unwrap(),
        Some(vec![block(1, 38), block(2, 47)])
    );
    assert_eq!(
        ledger.blocks(id(1), at(40)).await.unwrap(),
        None,
        "only for the version the caller read"
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
    assert!(ledger.advance(id(1), at(90), done, None).await.unwrap());
    let (got, tail) = ledger.get(id(1)).await.unwrap().unwrap();
    assert_eq!(got.blob_key, Some(key.to_string()));
    assert!(tail.is_empty());
    assert_eq!(
        ledger.blocks(id(1), at(100)).await.unwrap(),
        None,
        "complete: the manifest holds them now"
    );
    assert!(
        !ledger
            .advance(id(1), at(100), step(100, b"", vec![]), None)
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
    ledger.create(id(1), &row(10, 100), 0, None).await.unwrap();
    ledger
        .create(id(2), &row(10, 10_000), 0, None)
        .await
        .unwrap();
    let step = Advance {
        offset: 5,
        tail: Bytes::from_static(b"12345"),
        chunker: Bytes::new(),
        blocks: vec![block(3, 1)],
        expires_ms: 100,
        blob_key: None,
    };
    assert!(ledger.advance(id(1), at(0), step, None).await.unwrap());
    let expired = ledger.expired(500).await.unwrap();
    assert_eq!(expired, vec![id(1)]);
    // Refreshed since it was listed: not removed.
    assert_eq!(
        ledger.delete_expired(vec![id(2)], 500, None).await.unwrap(),
        0
    );
    assert_eq!(ledger.delete_expired(expired, 500, None).await.unwrap(), 1);
    assert!(ledger.get(id(1)).await.unwrap().is_none());
    assert_eq!(ledger.blocks(id(1), at(5)).await.unwrap(), None);
    assert!(ledger.get(id(2)).await.unwrap().is_some());
    // An expired id may be created again.
    ledger.create(id(3), &row(10, 100), 0, None).await.unwrap();
    assert!(
        ledger
            .create(id(3), &row(10, 9000), 200, None)
            .await
            .unwrap()
    );
    // Durable across a reopen.
    drop(ledger);
    let ledger = RedbLedger::open(&path).unwrap();
    assert!(ledger.get(id(2)).await.unwrap().is_some());
    assert!(ledger.delete(id(2), None).await.unwrap());
    assert!(!ledger.delete(id(2), None).await.unwrap());
}

/// Checks CAS-7 at the ledger: an upload terminated and created again under the same id
/// is another generation, so a PATCH that read the old one gets neither its block list
/// nor an advance, even at the same offset.
pub(super) async fn a_recreated_upload_is_another_version(ledger: &dyn UploadLedger) {
    let first = UploadRow {
        generation: 7,
        ..row(100, u64::MAX)
    };
    assert!(ledger.create(id(5), &first, 0, None).await.unwrap());
    let old = RowVersion {
        generation: 7,
        offset: 0,
    };
    let step = |blocks| Advance {
        offset: 40,
        tail: Bytes::from_static(b"t"),
        chunker: Bytes::new(),
        blocks,
        expires_ms: u64::MAX,
        blob_key: None,
    };
    assert!(
        ledger
            .advance(id(5), old, step(vec![block(1, 39)]), None)
            .await
            .unwrap()
    );
    let old_at_40 = RowVersion {
        generation: 7,
        offset: 40,
    };
    assert_eq!(
        ledger.blocks(id(5), old_at_40).await.unwrap(),
        Some(vec![block(1, 39)])
    );
    assert!(ledger.delete(id(5), None).await.unwrap());
    let second = UploadRow {
        generation: 8,
        ..row(100, u64::MAX)
    };
    assert!(ledger.create(id(5), &second, 0, None).await.unwrap());
    let new = RowVersion {
        generation: 8,
        offset: 0,
    };
    assert!(
        ledger
            .advance(id(5), new, step(vec![block(2, 39)]), None)
            .await
            .unwrap()
    );
    // The new upload is at offset 40 too, with other blocks.
    assert_eq!(ledger.blocks(id(5), old_at_40).await.unwrap(), None);
    assert!(
        !ledger
            .advance(id(5), old_at_40, step(vec![block(3, 1)]), None)
            .await
            .unwrap(),
        "a writer of the old generation must not move the new row"
    );
    let new_at_40 = RowVersion {
        generation: 8,
        offset: 40,
    };
    assert_eq!(
        ledger.blocks(id(5), new_at_40).await.unwrap(),
        Some(vec![block(2, 39)])
    );
}

#[tokio::test]
async fn redb_ledger_tells_a_recreated_upload_apart() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = RedbLedger::open(&dir.path().join("uploads.redb")).unwrap();
    a_recreated_upload_is_another_version(&ledger).await;
}
