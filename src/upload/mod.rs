//! Owner-local ingest: what happens to an upload on the node that stores its bytes.
//!
//! [`UploadService`] owns the path from an admitted body to a committed manifest: it
//! claims the upload ([`UploadClaim`]: the admission permit, the shard's ingest permit
//! and the session's ticket), streams the body through `pipeline::ingest` into the block and
//! manifest stores under the claim's [`CommitFence`], and records the outcome. The public
//! listener (`http::upload`, direct uploads) and the internal listener (`http::internal`,
//! uploads forwarded by another node) both call it; neither holds ingest logic.
//!
//! It returns domain errors ([`UploadError`]); `edge::error` is the one place they become
//! HTTP answers. It holds its own dependencies, not the HTTP `AppState`.
//!
//! Order of work (every refusal before the body leaves it unread): admission (unless a
//! forwarder's pre-flight already admitted this transfer) → ingest permit for the shard
//! → session ticket → `ingest begin` record → body → commit (binds: LOC-1) → `ingest
//! commit` record → outcome (the records: [`record`]).

mod claim;
mod error;
pub mod ledger;
pub mod record;
pub mod resumable;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;
use serde::{Deserialize, Serialize};

pub use claim::UploadClaim;
pub use error::UploadError;

use crate::actors::ClusterHandle;
use crate::actors::{IngestTicket, SessionRegionHandle};
use crate::admission::{Admission, AdmissionPermit, Operation};
use crate::cas::digest::ContentDigest;
use crate::cas::pdf::select::MediaType;
use crate::cas::pdf::{Chunking, PdfPolicy, Selection, SelectionError};
use crate::ids::{NodeId, SessionKey, TenantId};
use crate::metrics::KindLabels;
use crate::metrics::{BlockLabels, Metrics, OutcomeLabels};
use crate::pipeline::ingest::{IngestError, IngestLimits, IngestReport, ingest_selected};
use crate::placement::LocalRoute;
use crate::storage::manifest::CommitFence;
use crate::storage::{BlockStore, ManifestStore};

/// Send a progress update to the session owner every this many bytes.
const PROGRESS_EVERY: u64 = 8 * 1024 * 1024;

/// The result of an ingested upload (the 201 body of `POST /v1/blobs`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct UploadReceipt {
    pub key: String,
    pub size: u64,
    pub blocks: usize,
    pub fresh_blocks: usize,
    pub duplicate_blocks: usize,
    /// Node that ingested the upload.
    pub owner: String,
    /// The chunker that cut the blocks: `fastcdc` or `pdf` (also in the manifest).
    #[serde(default = "fastcdc_name")]
    pub chunker: String,
    /// The blob's entity tag (also sent as `ETag`; not part of the JSON body).
    #[serde(skip)]
    pub etag: String,
}

fn fastcdc_name() -> String {
    "fastcdc".to_string()
}

/// What the client declared about its body, checked by the pipeline before the commit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Declared {
    /// `Content-Length`.
    pub length: Option<u64>,
    /// `Content-Digest` / `X-Content-Hash` (SHA-256).
    pub digest: Option<ContentDigest>,
    /// `Content-Type`, as far as the chunker selection needs it (`cas::pdf::select`).
    pub media: MediaType,
}

/// Size and time limits of one upload.
#[derive(Debug, Clone, Copy)]
pub struct UploadLimits {
    pub max_blob_size: u64,
    /// Longest wait for the next body frame.
    pub body_idle_timeout: Duration,
}

/// What the service needs.
pub struct UploadParts {
    pub node: NodeId,
    pub blocks: Arc<dyn BlockStore>,
    pub manifests: Arc<dyn ManifestStore>,
    pub sessions: SessionRegionHandle,
    pub admission: Admission,
    pub cluster: Arc<ClusterHandle>,
    pub limits: UploadLimits,
    pub metrics: Metrics,
    /// The ledger of resumable uploads.
    pub ledger: Arc<dyn ledger::UploadLedger>,
    pub resumable: resumable::ResumableLimits,
    /// `[ingest.pdf]`: the PDF-aware chunker's selection and sizes.
    pub pdf: PdfPolicy,
}

/// Owner-local ingest of uploads (see the module docs).
pub struct UploadService {
    parts: UploadParts,
    hashers: resumable::Hashers,
}

impl UploadService {
    pub fn new(parts: UploadParts) -> Self {
        Self {
            parts,
            hashers: Default::default(),
        }
    }

    /// The ledger of resumable uploads (the collector marks its blocks live).
    pub fn ledger(&self) -> &Arc<dyn ledger::UploadLedger> {
        &self.parts.ledger
    }

    /// The node that ingests here.
    pub fn node(&self) -> &NodeId {
        &self.parts.node
    }

    /// Ingest one upload on this node. With a route, the upload is a session's: it holds
    /// the shard's ingest permit and the session's ticket, and its manifest commits only
    /// if this node still owns the shard at the route's epoch. `admitted` is the admission
    /// a forwarder's pre-flight made; without it the service admits the transfer for
    /// `tenant` first.
    pub async fn ingest<S, E>(
        &self,
        route: Option<LocalRoute>,
        admitted: Option<AdmissionPermit>,
        tenant: Option<TenantId>,
        declared: Declared,
        body: S,
    ) -> Result<UploadReceipt, UploadError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
        E: std::fmt::Display,
    {
        let claim = self.claim(route, admitted, tenant).await?;
        let result = tokio::select! {
            // A finished ingest wins over a cancellation that fires at the same moment.
            biased;
            result = self.run(declared, body, &claim) => result.map_err(UploadError::from),
            cancelled = claim.cancelled() => Err(cancelled),
        };
        if let Ok(report) = &result {
            claim.record_commit(report.commit_sent);
        }
        claim.finish(&result);
        let outcome = match &result {
            Ok(_) => "ok",
            Err(err) if err.is_server_side() => "server_error",
            Err(_) => "client_error",
        };
        self.parts
            .metrics
            .uploads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
        result.map(|report| self.receipt(&report))
    }

    /// Take the guards of one upload, in order: admission, ingest permit, session ticket.
    /// A refusal releases what was taken before it.
    pub async fn claim(
        &self,
        route: Option<LocalRoute>,
        admitted: Option<AdmissionPermit>,
        tenant: Option<TenantId>,
    ) -> Result<UploadClaim, UploadError> {
        self.claim_with(route, admitted, tenant, None).await
    }

    /// [`Self::claim`] with an explicit admission footprint (a resumable upload's part)
    /// instead of the plain upload's.
    pub(crate) async fn claim_with(
        &self,
        route: Option<LocalRoute>,
        admitted: Option<AdmissionPermit>,
        tenant: Option<TenantId>,
        footprint: Option<crate::admission::Footprint>,
    ) -> Result<UploadClaim, UploadError> {
        let tenant = route.map(|r| r.key.tenant).or(tenant);
        let admission = match (admitted, footprint, tenant) {
            (Some(permit), _, _) => permit,
            (None, Some(footprint), Some(tenant)) => {
                self.parts.admission.admit_part(tenant, footprint).await?
            }
            (None, _, _) => {
                self.parts
                    .admission
                    .admit_transfer(Operation::Upload, tenant)
                    .await?
            }
        };
        let Some(route) = route else {
            return Ok(UploadClaim::new(admission, None));
        };
        let permit = self
            .parts
            .cluster
            .begin_ingest(route.shard, route.epoch)
            .ok_or(UploadError::ShardUnavailable)?;
        let ticket = self.parts.sessions.begin(route.key).await?;
        let fence = CommitFence {
            shard: permit.shard(),
            epoch: permit.epoch(),
            node: self.parts.node.clone(),
        };
        let record = record::OwnershipRecord::begin(&route.key, &fence);
        Ok(UploadClaim::new(
            admission,
            Some((permit, ticket, fence, record)),
        ))
    }

    /// Admit a forwarded upload in its pre-flight and park the admission for the POST;
    /// returns the reservation id the forwarder repeats.
    pub async fn reserve_forwarded(&self, key: &SessionKey) -> Result<String, UploadError> {
        let permit = self.parts.admission.admit_forwarded(key.tenant).await?;
        Ok(self.parts.admission.park(permit, reservation_tag(key)))
    }

    /// The admission parked for `key` under `reservation`, if it is still live.
    pub fn adopt_reservation(
        &self,
        key: &SessionKey,
        reservation: &str,
    ) -> Option<AdmissionPermit> {
        self.parts
            .admission
            .adopt(reservation, &reservation_tag(key))
    }

    /// Drop a parked admission whose POST was refused before ingest.
    pub fn discard_reservation(&self, key: &SessionKey, reservation: &str) {
        self.parts
            .admission
            .discard(reservation, &reservation_tag(key));
    }

    /// The receipt of an ingested blob.
    pub fn receipt(&self, report: &IngestReport) -> UploadReceipt {
        UploadReceipt {
            key: report.key.to_string(),
            size: report.key.size,
            blocks: report.blocks,
            fresh_blocks: report.fresh_blocks,
            duplicate_blocks: report.duplicate_blocks,
            owner: self.parts.node.to_string(),
            chunker: report.chunking.name().to_string(),
            etag: report.key.etag(),
        }
    }

    /// Run the ingest pipeline over a body under `claim`.
    async fn run<S, E>(
        &self,
        declared: Declared,
        body: S,
        claim: &UploadClaim,
    ) -> Result<IngestReport, IngestError>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + Unpin,
        E: std::fmt::Display,
    {
        let parts = &self.parts;
        let started = Instant::now();
        let limits = IngestLimits {
            max_size: parts.limits.max_blob_size,
            declared_size: declared.length,
            idle_timeout: parts.limits.body_idle_timeout,
            digest: declared.digest.map(Into::into),
        };
        let mut progress = Progress::new(claim.ticket());
        let metrics = parts.metrics.clone();
        let selection = Selection {
            declared: declared.media,
            policy: parts.pdf,
        };
        let result = ingest_selected(
            body,
            limits,
            selection,
            parts.blocks.clone(),
            parts.manifests.clone(),
            claim.fence(),
            |bytes| {
                metrics.upload_bytes.inc_by(bytes);
                progress.add(bytes);
            },
        )
        .await;
        progress.flush();
        if let Ok(report) = &result {
            let blocks = |kind| parts.metrics.blocks.get_or_create(&BlockLabels { kind });
            parts
                .metrics
                .upload_duration
                .observe(started.elapsed().as_secs_f64());
            blocks("fresh").inc_by(report.fresh_blocks as u64);
            blocks("duplicate").inc_by(report.duplicate_blocks as u64);
            record_chunking(&parts.metrics, report.chunking, report.pdf_cuts);
        }
        if let Err(err) = &result {
            record_refusal(&parts.metrics, err);
        }
        result
    }
}

/// Count a PDF selection or scanner refusal (one-shot and resumable uploads).
fn record_refusal(metrics: &Metrics, err: &IngestError) {
    if let IngestError::Pdf(refusal) = err {
        let kind = match refusal {
            SelectionError::SignatureMissing => "signature_missing",
            SelectionError::TypeMismatch => "type_mismatch",
            SelectionError::Unsupported(_) => "unsupported",
        };
        metrics
            .pdf_refusals
            .get_or_create(&KindLabels { kind })
            .inc();
    }
}

/// Count a committed upload's chunker and, for the PDF chunker, how it cut.
fn record_chunking(
    metrics: &Metrics,
    chunking: Chunking,
    cuts: Option<crate::cas::pdf::CutCounts>,
) {
    metrics
        .ingests_by_chunker
        .get_or_create(&KindLabels {
            kind: chunking.name(),
        })
        .inc();
    if let Some(cuts) = cuts {
        for (kind, n) in [
            ("boundary", cuts.boundary),
            ("stream", cuts.stream),
            ("fallback", cuts.fallback),
        ] {
            metrics
                .pdf_cuts
                .get_or_create(&KindLabels { kind })
                .inc_by(n);
        }
    }
}

/// Progress reports to the session owner, batched every [`PROGRESS_EVERY`] bytes.
struct Progress<'a> {
    ticket: Option<&'a IngestTicket>,
    bytes: u64,
    frames: u64,
}

impl<'a> Progress<'a> {
    fn new(ticket: Option<&'a IngestTicket>) -> Self {
        Self {
            ticket,
            bytes: 0,
            frames: 0,
        }
    }

    fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        self.frames += 1;
        if self.bytes >= PROGRESS_EVERY {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if let (Some(ticket), true) = (self.ticket, self.bytes > 0) {
            ticket.progress(self.bytes, self.frames);
        }
        (self.bytes, self.frames) = (0, 0);
    }
}

/// A parked admission is bound to its session.
fn reservation_tag(key: &SessionKey) -> String {
    format!("{}/{}", key.tenant, key.session)
}
