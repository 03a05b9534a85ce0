//! What each kind of transfer asks admission for: its footprint and backend label, and
//! which node holds the cluster lease of a forwarded upload. The one place the HTTP edge
//! and the upload service turn "this transfer" into a [`TransferRequest`].
//!
//! A forwarded upload holds one cluster lease: the owner admits it in the forwarder's
//! pre-flight, sized for the ingest plus the relay ([`Admission::admit_forwarded`]), and
//! the relaying node takes local permits only ([`Admission::admit_relay`]).

use super::{Admission, AdmissionPermit, Error, Footprint, Operation, TransferRequest};
use crate::cas::chunker::MAX_CHUNK;
use crate::ids::TenantId;

/// Backend label of the block store every transfer reads or writes.
pub const BACKEND: &str = "fs";

fn part_request(tenant: TenantId, footprint: Footprint) -> TransferRequest {
    TransferRequest {
        operation: Operation::Upload,
        tenant: Some(tenant),
        backend: BACKEND.to_string(),
        footprint,
    }
}

fn request(operation: Operation, tenant: Option<TenantId>) -> TransferRequest {
    TransferRequest {
        operation,
        tenant,
        backend: BACKEND.to_string(),
        footprint: Footprint::for_operation(operation, MAX_CHUNK as u64),
    }
}

impl Admission {
    /// Admit one transfer on the node that holds its bytes: local permits, then the
    /// cluster lease.
    pub async fn admit_transfer(
        &self,
        operation: Operation,
        tenant: Option<TenantId>,
    ) -> Result<AdmissionPermit, Error> {
        self.admit(request(operation, tenant)).await
    }

    /// The relay's share of a forwarded upload: local permits only.
    pub async fn admit_relay(&self, tenant: TenantId) -> Result<AdmissionPermit, Error> {
        self.admit_local(request(Operation::ForwardedUpload, Some(tenant)))
            .await
    }

    /// One PATCH of a resumable upload on the node that holds its bytes: local permits
    /// and the cluster lease for `footprint` (the staged part's, [`Footprint::for_part`]).
    pub async fn admit_part(
        &self,
        tenant: TenantId,
        footprint: Footprint,
    ) -> Result<AdmissionPermit, Error> {
        self.admit(part_request(tenant, footprint)).await
    }

    /// [`Admission::admit_part`] made by the owner in a forwarder's pre-flight: one lease
    /// for the part plus the relay.
    pub async fn admit_forwarded_part(
        &self,
        tenant: TenantId,
        footprint: Footprint,
    ) -> Result<AdmissionPermit, Error> {
        let relay = Footprint::for_operation(Operation::ForwardedUpload, MAX_CHUNK as u64);
        self.admit_spanning(part_request(tenant, footprint), relay)
            .await
    }

    /// The owner's admission of a forwarded upload, made in the forwarder's pre-flight:
    /// local permits for the ingest, one cluster lease for the ingest plus the relay.
    pub async fn admit_forwarded(&self, tenant: TenantId) -> Result<AdmissionPermit, Error> {
        let relay = Footprint::for_operation(Operation::ForwardedUpload, MAX_CHUNK as u64);
        self.admit_spanning(request(Operation::Upload, Some(tenant)), relay)
            .await
    }
}
