//! Resumable (tus) uploads in the upload service: creation, status, termination, and
//! each PATCH as one staged part (docs/resumable.md).
//!
//! A PATCH, in order (every refusal before the body leaves it unread): the ledger row is
//! checked (exists, not expired, offset matches, length not exceeded) → the claim with
//! the part's footprint ([`Footprint::for_part`]: admission, ingest permit,
//! session ticket, the same [`UploadClaim`] as a plain upload) → the row is read again
//! under the ticket → the body runs through `pipeline::ingest::ingest_part` from the staged
//! tail → the write session commits (with the manifest, under the commit fence, on the
//! final PATCH) → the ledger advances, conditional on the offset the PATCH started from
//! (TUS-1: the offset counts only bytes that are durable) → the claim is finished.
//!
//! Every ledger write is fenced (TUS-5): a PATCH's advance carries its claim's
//! [`CommitFence`]; a creation and a termination hold the shard's ingest permit for
//! their write and carry its fence; the expiry sweep removes only rows of shards this
//! node owns, under their fences, on this node's clock (the owner's, which stamped the
//! expiry and answers 410). A node that lost the shard writes nothing and answers the
//! retryable 503 `shard_moved`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;

use super::{UploadClaim, UploadError, UploadService};
use crate::admission::{AdmissionPermit, Footprint};
use crate::cas::digest::BodyDigest;
use crate::cas::pdf::select::MediaType;
use crate::cas::pdf::{SavedChunker, Selection};
use crate::cas::{BlobKey, BlockKey, Manifest};
use crate::pipeline::ingest::{IngestError, IngestLimits, PartOutcome, PartStart, ingest_part};
use crate::placement::{IngestPermit, LocalRoute, Route};
use crate::storage::StoreError;
use crate::storage::manifest::CommitFence;
use crate::tus::{UploadId, now_ms};

pub use super::ledger::{Advance, RowVersion, UploadLedger, UploadRow, new_generation};

/// Limits of resumable uploads (`[upload]`).
#[derive(Debug, Clone, Copy)]
pub struct ResumableLimits {
    /// The admission footprint cap of one PATCH.
    pub part_footprint: u64,
    /// How long an upload lives after its last progress.
    pub expiry: Duration,
}

/// What a PATCH declared about its body.
#[derive(Debug, Clone, Copy, Default)]
pub struct PartDeclared {
    /// `Content-Length` of the PATCH.
    pub length: Option<u64>,
    /// `Upload-Checksum`.
    pub checksum: Option<BodyDigest>,
}

/// The state of an upload after a PATCH (or at a HEAD).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartReceipt {
    pub offset: u64,
    pub length: u64,
    pub expires_ms: u64,
    pub blob_key: Option<String>,
}

/// How many whole-content hashers a node keeps (about 2 KiB each). Past it the oldest
/// goes; a PATCH that finds none rebuilds its hasher from the committed blocks.
const HASHERS_KEPT: usize = 4096;

/// Whole-content hashers of the uploads this node is ingesting, each bound to the
/// [`RowVersion`] (generation and offset) it has hashed to (`blake3::Hasher` cannot be
/// stored; see docs/resumable.md). A hasher is taken only for exactly that version of
/// that upload, so it never outlives the row it was made from (CAS-7): an upload created
/// again under the same id, elsewhere in the cluster, has another generation.
#[derive(Default)]
pub(super) struct Hashers {
    map: Mutex<HashMap<UploadId, (RowVersion, Instant, blake3::Hasher)>>,
}

impl Hashers {
    fn take(&self, id: &UploadId, at: RowVersion) -> Option<blake3::Hasher> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        match map.remove(id) {
            Some((version, _, hasher)) if version == at => Some(hasher),
            _ => None,
        }
    }

    fn put(&self, id: UploadId, at: RowVersion, hasher: blake3::Hasher, max_age: Duration) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        // Uploads that moved to another owner, or were abandoned, are never taken here
        // again: drop what outlived the upload expiry, and keep the map bounded.
        map.retain(|_, (_, at, _)| now.duration_since(*at) < max_age);
        if map.len() >= HASHERS_KEPT
            && let Some(oldest) = map
                .iter()
                .min_by_key(|(_, (_, at, _))| *at)
                .map(|(id, _)| *id)
        {
            map.remove(&oldest);
        }
        map.insert(id, (at, now, hasher));
    }

    fn forget(&self, id: &UploadId) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(id);
    }
}

fn receipt(row: &UploadRow) -> PartReceipt {
    PartReceipt {
        offset: row.offset,
        length: row.length,
        expires_ms: row.expires_ms,
        blob_key: row.blob_key.clone(),
    }
}

impl UploadService {
    /// The shard's ingest permit of `route` and the fence a ledger write under it carries
    /// (TUS-5): refused ([`UploadError::ShardUnavailable`]) while the shard is moving or
    /// this node is fenced, as an upload is. Without a route (no session), neither.
    fn hold_shard(
        &self,
        route: Option<LocalRoute>,
    ) -> Result<(Option<IngestPermit>, Option<CommitFence>), UploadError> {
        let Some(route) = route else {
            return Ok((None, None));
        };
        let permit = self
            .parts
            .cluster
            .begin_ingest(route.shard, route.epoch)
            .ok_or(UploadError::ShardUnavailable)?;
        let fence = CommitFence {
            shard: permit.shard(),
            epoch: permit.epoch(),
            node: self.parts.node.clone(),
        };
        Ok((Some(permit), Some(fence)))
    }

    /// The live row of `id`: [`UploadError::UploadNotFound`] or
    /// [`UploadError::UploadExpired`] otherwise.
    async fn live_row(&self, id: UploadId) -> Result<(UploadRow, Bytes), UploadError> {
        let (row, tail) = self
            .ledger()
            .get(id)
            .await
            .map_err(IngestError::from)?
            .ok_or(UploadError::UploadNotFound)?;
        if row.is_expired(now_ms()) {
            return Err(UploadError::UploadExpired);
        }
        Ok((row, tail))
    }

    /// Create an upload of `length` bytes (the tus `creation` extension), under the
    /// ingest permit and fence of `route` (the upload's session on this node).
    pub async fn create_upload(
        &self,
        route: Option<LocalRoute>,
        id: UploadId,
        length: u64,
        metadata: Option<String>,
    ) -> Result<PartReceipt, UploadError> {
        let (_permit, fence) = self.hold_shard(route)?;
        let now = now_ms();
        let row = UploadRow {
            length,
            offset: 0,
            expires_ms: now.saturating_add(self.parts.resumable.expiry.as_millis() as u64),
            created_ms: now,
            metadata,
            block_count: 0,
            blob_key: None,
            generation: new_generation(),
            chunker: Bytes::new(),
        };
        if !self
            .ledger()
            .create(id, &row, now, fence)
            .await
            .map_err(IngestError::from)?
        {
            return Err(UploadError::UploadExists);
        }
        self.hashers.forget(&id);
        Ok(receipt(&row))
    }

    /// The state of an upload (HEAD), with its metadata.
    pub async fn upload_status(
        &self,
        id: UploadId,
    ) -> Result<(PartReceipt, Option<String>), UploadError> {
        let (row, _) = self.live_row(id).await?;
        Ok((receipt(&row), row.metadata))
    }

    /// Terminate an upload (the tus `termination` extension), under the ingest permit
    /// and fence of `route`: its row, tail and block list go; its blocks are left to the
    /// collector. No session ticket: a DELETE may land while a PATCH streams (tus
    /// clients abort that way), and that PATCH then writes nothing (CAS-7).
    pub async fn terminate(
        &self,
        route: Option<LocalRoute>,
        id: UploadId,
    ) -> Result<(), UploadError> {
        let (_permit, fence) = self.hold_shard(route)?;
        self.hashers.forget(&id);
        if self
            .ledger()
            .delete(id, fence)
            .await
            .map_err(IngestError::from)?
        {
            Ok(())
        } else {
            Err(UploadError::UploadNotFound)
        }
    }

    /// Remove expired uploads (the background sweep); returns how many. See
    /// [`Self::sweep_expired_at`].
    pub async fn sweep_expired(&self) -> Result<u64, StoreError> {
        self.sweep_expired_at(now_ms()).await
    }

    /// Remove the uploads expired at `now_ms` (this node's clock) whose shard this node
    /// owns, each shard's under its ingest permit and fence (TUS-6): in a cluster every
    /// node sweeps the shared ledger, and only the owner's clock, the one that stamped
    /// the expiry and answers 410, decides. Rows of shards owned elsewhere, moving, or
    /// lost meanwhile (fenced) are left to their owner. Hashers of uploads that are gone
    /// are never taken again (their version is gone) and age out.
    pub async fn sweep_expired_at(&self, now_ms: u64) -> Result<u64, StoreError> {
        let expired = self.ledger().expired(now_ms).await?;
        let mut by_shard: BTreeMap<(u32, i64), (LocalRoute, Vec<UploadId>)> = BTreeMap::new();
        for id in expired {
            if let Ok(Route::Local(local)) = self.parts.cluster.route(&id.key()) {
                by_shard
                    .entry((local.shard.0, local.epoch.0))
                    .or_insert_with(|| (local, Vec::new()))
                    .1
                    .push(id);
            }
        }
        let mut removed = 0;
        for (route, ids) in by_shard.into_values() {
            let Ok((_permit, fence)) = self.hold_shard(Some(route)) else {
                continue;
            };
            match self.ledger().delete_expired(ids, now_ms, fence).await {
                Ok(n) => removed += n,
                Err(StoreError::Fenced { .. }) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(removed)
    }

    /// The footprint a PATCH at `offset` would reserve, after the checks that need no
    /// body: the upload is live, the offset matches, `Content-Length` fits.
    pub async fn check_part(
        &self,
        id: UploadId,
        offset: u64,
        declared: &PartDeclared,
    ) -> Result<Footprint, UploadError> {
        let (row, _) = self.live_row(id).await?;
        check_row(&row, offset, declared)?;
        let remaining = row.length.saturating_sub(row.offset);
        Ok(Footprint::for_part(
            self.parts.resumable.part_footprint,
            remaining,
        ))
    }

    /// Admit a forwarded PATCH in its pre-flight and park the admission for the PATCH.
    pub async fn reserve_forwarded_part(
        &self,
        id: UploadId,
        offset: u64,
        declared: &PartDeclared,
    ) -> Result<String, UploadError> {
        let footprint = self.check_part(id, offset, declared).await?;
        let permit = self
            .parts
            .admission
            .admit_forwarded_part(id.key().tenant, footprint)
            .await?;
        Ok(self
            .parts
            .admission
            .park(permit, super::reservation_tag(&id.key())))
    }

    /// One PATCH (see the module docs). `admitted` is the admission a forwarder's
    /// pre-flight made.
    pub async fn patch<S, E>(
        &self,
        route: Option<LocalRoute>,
        admitted: Option<AdmissionPermit>,
        id: UploadId,
        offset: u64,
        declared: PartDeclared,
        body: S,
    ) -> Result<PartReceipt, UploadError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
        E: std::fmt::Display,
    {
        let footprint = self.check_part(id, offset, &declared).await?;
        let claim = self
            .claim_with(route, admitted, Some(id.key().tenant), Some(footprint))
            .await?;
        let result = tokio::select! {
            biased;
            result = self.run_part(id, offset, declared, body, &claim) => result,
            cancelled = claim.cancelled() => Err(cancelled),
        };
        claim.finish(&result);
        result
    }

    async fn run_part<S, E>(
        &self,
        id: UploadId,
        offset: u64,
        declared: PartDeclared,
        body: S,
        claim: &UploadClaim,
    ) -> Result<PartReceipt, UploadError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
        E: std::fmt::Display,
    {
        // Read again under the session ticket: no other PATCH of this upload runs now.
        let (row, tail) = self.live_row(id).await?;
        check_row(&row, offset, &declared)?;
        let at = row.version();
        let whole = match self.hashers.take(&id, at) {
            Some(hasher) => hasher,
            None => self.rebuild_hasher(id, at, &tail).await?,
        };
        let limits = IngestLimits {
            max_size: self.parts.limits.max_blob_size,
            declared_size: declared.length,
            idle_timeout: self.parts.limits.body_idle_timeout,
            digest: declared.checksum,
        };
        // The chunker resumes from the state saved with the tail (CAS-14); while undecided,
        // the declared type and the first bytes choose it (CAS-12).
        let chunker = SavedChunker::decode(&row.chunker, row.offset)
            .map_err(|e| IngestError::Store(StoreError::Corrupt(e.to_string())))?;
        let selection = Selection {
            declared: MediaType::of_tus_metadata(row.metadata.as_deref()),
            policy: self.parts.pdf,
        };
        let start = PartStart {
            tail,
            chunker,
            offset: row.offset,
            selection,
            whole,
            remaining: row.length.saturating_sub(row.offset),
            keep_partial: declared.checksum.is_none(),
        };
        let mut session = self.parts.blocks.begin().map_err(IngestError::from)?;
        let metrics = self.parts.metrics.clone();
        let part = ingest_part(body, limits, start, session.as_mut(), |bytes| {
            metrics.upload_bytes.inc_by(bytes);
        })
        .await
        .inspect_err(|err| super::record_refusal(&self.parts.metrics, err))?;
        let PartOutcome {
            received,
            refs,
            tail,
            whole,
            complete,
            interrupted,
            chunker,
            chunking,
            pdf_cuts,
            ..
        } = part;
        let new_offset = row.offset + received;
        let blob_key = if complete {
            let key = BlobKey {
                hash: *whole.finalize().as_bytes(),
                size: row.length,
            };
            // The blocks of the earlier PATCHes, of exactly the version this PATCH read:
            // the hasher above covers those bytes and no others (CAS-7). A row that was
            // terminated, swept or created again meanwhile ends the PATCH here, with
            // nothing written under the key.
            let Some(earlier) = self
                .ledger()
                .blocks(id, at)
                .await
                .map_err(IngestError::from)?
            else {
                return Err(self.row_changed(id).await);
            };
            let mut blocks = Vec::with_capacity(earlier.len() + refs.len());
            blocks.extend_from_slice(&earlier);
            blocks.extend_from_slice(&refs);
            let mut manifest = Manifest::new(key, blocks, now_ms());
            if let Some(chunking) = chunking {
                manifest.chunking = chunking.info();
            }
            // CAS-6: checked here too, before any store sees it.
            manifest
                .validate()
                .map_err(|e| IngestError::Store(StoreError::Corrupt(format!("{e}"))))?;
            // Blocks committed by earlier PATCHes are confirmed against the collector in
            // this commit, like the dedup hits of this one (STO-3).
            session.confirm(earlier.iter().map(|b| b.key).collect());
            session
                .commit_manifest(manifest, self.parts.manifests.clone(), claim.fence())
                .await
                .map_err(IngestError::from)?;
            Some(key)
        } else {
            session.commit().await.map_err(IngestError::from)?;
            None
        };
        let expires_ms = now_ms().saturating_add(self.parts.resumable.expiry.as_millis() as u64);
        if received > 0 || complete {
            let step = Advance {
                offset: new_offset,
                tail,
                chunker: chunker.encode(),
                blocks: refs,
                expires_ms,
                blob_key,
            };
            if !self
                .ledger()
                .advance(id, at, step, claim.fence())
                .await
                .map_err(IngestError::from)?
            {
                // Terminated, swept or created again while the PATCH ran, or another
                // writer (a previous owner of the shard) advanced it first: this PATCH's
                // bytes are not counted (its blocks are unreferenced and left to the
                // collector).
                return Err(self.row_changed(id).await);
            }
        }
        if complete {
            self.hashers.forget(&id);
            if let Some(chunking) = chunking {
                super::record_chunking(&self.parts.metrics, chunking, pdf_cuts);
            }
        } else {
            let next = RowVersion {
                generation: at.generation,
                offset: new_offset,
            };
            self.hashers
                .put(id, next, whole, self.parts.resumable.expiry);
        }
        if let Some(err) = interrupted {
            return Err(err.into());
        }
        Ok(PartReceipt {
            offset: new_offset,
            length: row.length,
            expires_ms: if received > 0 || complete {
                expires_ms
            } else {
                row.expires_ms
            },
            blob_key: blob_key.map(|k| k.to_string()),
        })
    }

    /// What a PATCH answers when its row is no longer the version it read: the offset
    /// now recorded, or why there is none (not found, expired).
    async fn row_changed(&self, id: UploadId) -> UploadError {
        match self.live_row(id).await {
            Ok((row, _)) => UploadError::OffsetMismatch {
                current: row.offset,
            },
            Err(err) => err,
        }
    }

    /// The whole-content hasher of an upload rebuilt from its committed blocks (each
    /// checked against its key) and its staged tail, both of version `at`: after a
    /// restart or an owner move.
    async fn rebuild_hasher(
        &self,
        id: UploadId,
        at: RowVersion,
        tail: &Bytes,
    ) -> Result<blake3::Hasher, UploadError> {
        let Some(blocks) = self
            .ledger()
            .blocks(id, at)
            .await
            .map_err(IngestError::from)?
        else {
            return Err(self.row_changed(id).await);
        };
        let mut hasher = blake3::Hasher::new();
        for block in blocks {
            let data = self
                .parts
                .blocks
                .get(block.key)
                .await
                .map_err(IngestError::from)?
                .ok_or_else(|| {
                    IngestError::Store(StoreError::Unavailable(format!(
                        "block {} of a resumable upload is missing",
                        block.key.to_hex()
                    )))
                })?;
            hasher = tokio::task::spawn_blocking(move || {
                if BlockKey::of(&data) != block.key {
                    return Err(IngestError::Store(StoreError::Corrupt(format!(
                        "block {} of a resumable upload is corrupt",
                        block.key.to_hex()
                    ))));
                }
                hasher.update(&data);
                Ok(hasher)
            })
            .await
            .map_err(|e| IngestError::Pipeline(format!("hasher rebuild: {e}")))??;
        }
        hasher.update(tail);
        Ok(hasher)
    }
}

/// The checks of a PATCH against its row that need no body.
fn check_row(row: &UploadRow, offset: u64, declared: &PartDeclared) -> Result<(), UploadError> {
    if row.is_complete() || row.offset != offset {
        return Err(UploadError::OffsetMismatch {
            current: row.offset,
        });
    }
    let remaining = row.length.saturating_sub(row.offset);
    if let Some(length) = declared.length
        && length > remaining
    {
        return Err(IngestError::PastUploadLength { remaining }.into());
    }
    Ok(())
}
