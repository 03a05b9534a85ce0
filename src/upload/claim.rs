//! [`UploadClaim`]: the guards one upload holds while its body streams, as one value.
//!
//! An upload holds its admission permit (local permits and, in a cluster, the Redis lease),
//! and for a session upload also the shard's ingest permit and the session's ticket. The
//! claim says when the upload must stop ([`UploadClaim::cancelled`]) and releases the
//! guards in one order when it ends ([`UploadClaim::finish`]): admission first (so its
//! lease and permits are free when the client sees the answer), then the session ticket
//! (the session owner records the outcome), then the ingest permit (the shard's in-flight
//! count, which a revocation acknowledgement waits on, drops last).

use super::UploadError;
use super::record::OwnershipRecord;
use crate::actors::IngestTicket;
use crate::admission::{AdmissionPermit, Outcome};
use crate::placement::IngestPermit;
use crate::storage::manifest::CommitFence;

/// The guards of one upload (see the module docs). Dropping an unfinished claim (the
/// request was cancelled) releases everything: the lease as `interrupted`, the session
/// as a failed upload.
#[derive(Debug)]
pub struct UploadClaim {
    admission: AdmissionPermit,
    session: Option<SessionGuards>,
}

#[derive(Debug)]
struct SessionGuards {
    permit: IngestPermit,
    ticket: IngestTicket,
    fence: CommitFence,
    record: OwnershipRecord,
}

impl UploadClaim {
    pub(super) fn new(
        admission: AdmissionPermit,
        session: Option<(IngestPermit, IngestTicket, CommitFence, OwnershipRecord)>,
    ) -> Self {
        Self {
            admission,
            session: session.map(|(permit, ticket, fence, record)| SessionGuards {
                permit,
                ticket,
                fence,
                record,
            }),
        }
    }

    /// The commit fence of a session upload: `(shard, node, epoch)` of its ingest permit.
    pub fn fence(&self) -> Option<CommitFence> {
        self.session.as_ref().map(|s| s.fence.clone())
    }

    /// Write the owner-side `ingest commit` record of a session upload whose manifest
    /// committed (`commit_sent`: when the commit was sent). Before [`Self::finish`], so the
    /// record precedes the permit's release.
    pub fn record_commit(&self, commit_sent: std::time::SystemTime) {
        if let Some(session) = &self.session {
            session.record.committed(commit_sent);
        }
    }

    /// The session ticket (progress reports), for a session upload.
    pub fn ticket(&self) -> Option<&IngestTicket> {
        self.session.as_ref().map(|s| &s.ticket)
    }

    /// Resolves when the upload must stop: its cluster lease was lost
    /// ([`UploadError::LeaseLost`]) or its shard's ingest permit was revoked
    /// ([`UploadError::ShardMoved`]). Never resolves for an upload that may go on.
    pub async fn cancelled(&self) -> UploadError {
        let lease = self.admission.cancellation();
        let revoked = async {
            match &self.session {
                Some(session) => session.permit.revoked().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = lease.cancelled() => UploadError::LeaseLost,
            () = revoked => UploadError::ShardMoved,
        }
    }

    /// Record the upload's outcome and release the guards in order (see the module docs).
    pub fn finish<T>(self, result: &Result<T, UploadError>) {
        let succeeded = result.is_ok();
        self.admission.set_outcome(if succeeded {
            Outcome::Completed
        } else {
            Outcome::Failed
        });
        drop(self.admission);
        if let Some(session) = self.session {
            session.ticket.finish(succeeded);
            drop(session.permit);
        }
    }
}
