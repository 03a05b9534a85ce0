//! Why an upload did not commit. `edge::error` maps every variant to an answer.

use crate::admission;
use crate::pipeline::ingest::IngestError;
use crate::session::SessionError;
use crate::storage::StoreError;

/// Why an upload did not commit.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// Admission refused or could not decide (quota, ceiling, coordinator).
    #[error(transparent)]
    Admission(#[from] admission::Error),
    /// The session is busy, or the node holds too many sessions.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// The body or the stores failed the ingest; `IngestError::Store(StoreError::Fenced)`
    /// is a commit refused because the shard moved (LOC-1).
    #[error(transparent)]
    Ingest(#[from] IngestError),
    /// The shard is moving or this node is fenced: the upload did not start.
    #[error("the session's shard is moving or its owner is fenced")]
    ShardUnavailable,
    /// The shard's ingest permit was revoked while the body streamed.
    #[error("the session's shard moved during the upload")]
    ShardMoved,
    /// The cluster admission lease was lost while the body streamed.
    #[error("the transfer's admission lease was lost")]
    LeaseLost,
    /// No such resumable upload (never created, terminated, or swept after expiry).
    #[error("no such upload")]
    UploadNotFound,
    /// The resumable upload expired (not swept yet).
    #[error("the upload expired")]
    UploadExpired,
    /// A PATCH's `Upload-Offset` is not the upload's offset (or the upload is complete).
    #[error("Upload-Offset differs from the upload's offset {current}")]
    OffsetMismatch { current: u64 },
    /// The session already has a live resumable upload.
    #[error("the session already has an upload")]
    UploadExists,
}

impl UploadError {
    /// Is the server (or the cluster), not the request, the reason? `edge::error` answers
    /// these with a 5xx (a test there checks the two agree).
    pub fn is_server_side(&self) -> bool {
        match self {
            UploadError::Admission(err) => matches!(
                err,
                admission::Error::TimedOut(_)
                    | admission::Error::Saturated(_)
                    | admission::Error::Unavailable(_)
                    | admission::Error::Protocol(_)
            ),
            UploadError::Session(err) => !matches!(err, SessionError::Busy),
            UploadError::Ingest(err) => {
                matches!(err, IngestError::Store(_) | IngestError::Pipeline(_))
            }
            UploadError::ShardUnavailable | UploadError::ShardMoved | UploadError::LeaseLost => {
                true
            }
            UploadError::UploadNotFound
            | UploadError::UploadExpired
            | UploadError::OffsetMismatch { .. }
            | UploadError::UploadExists => false,
        }
    }

    /// A commit refused by the fence, or a revocation mid-upload: the client retries with
    /// the same session and reaches the new owner.
    pub fn shard_moved(&self) -> bool {
        matches!(
            self,
            UploadError::ShardMoved
                | UploadError::Ingest(IngestError::Store(StoreError::Fenced { .. }))
        )
    }
}
