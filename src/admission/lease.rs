//! What a held cluster lease needs from the coordinator, and how a transfer ended.
//!
//! [`LeaseBackend`] is the port of the `LeaseHolder` actor (`admission::lease_holder`): the
//! two calls a holder makes. The Redis coordinator implements it here, mapping its
//! storage-level errors into [`Error`]; in-memory doubles implement it in the actor's unit
//! tests. [`Outcome`] is recorded by the transfer and sent with the release.

use futures_util::future::BoxFuture;

use super::error::Error;
use crate::storage::redis::RedisCoordinator;
use crate::storage::redis::reply::{FencingToken, LeaseId, ReleaseReply, RenewReply};

/// How a transfer ended; sent with the release and recorded in the `completed` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    Failed,
    Interrupted,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Failed => "failed",
            Outcome::Interrupted => "interrupted",
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_u8(value: u8) -> Self {
        match value {
            0 => Outcome::Completed,
            1 => Outcome::Failed,
            _ => Outcome::Interrupted,
        }
    }
}

/// The two coordinator calls a holder makes. Implemented by the Redis coordinator and by
/// in-memory doubles in unit tests.
pub trait LeaseBackend: Send + Sync + 'static {
    fn renew<'a>(
        &'a self,
        lease_id: &'a LeaseId,
        token: &'a FencingToken,
    ) -> BoxFuture<'a, Result<RenewReply, Error>>;
    fn release<'a>(
        &'a self,
        lease_id: &'a LeaseId,
        token: &'a FencingToken,
        outcome: Outcome,
    ) -> BoxFuture<'a, Result<ReleaseReply, Error>>;
}

impl LeaseBackend for RedisCoordinator {
    fn renew<'a>(
        &'a self,
        lease_id: &'a LeaseId,
        token: &'a FencingToken,
    ) -> BoxFuture<'a, Result<RenewReply, Error>> {
        Box::pin(async move { Ok(RedisCoordinator::renew(self, lease_id, token).await?) })
    }

    fn release<'a>(
        &'a self,
        lease_id: &'a LeaseId,
        token: &'a FencingToken,
        outcome: Outcome,
    ) -> BoxFuture<'a, Result<ReleaseReply, Error>> {
        Box::pin(async move {
            Ok(RedisCoordinator::release(self, lease_id, token, outcome.as_str()).await?)
        })
    }
}
