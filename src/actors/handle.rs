//! Typed handles over the actors: callers never build message enums.
//!
//! A handle finds its actor by registered name on every call, so it keeps working after
//! the supervisor restarted the actor (a restart yields a new `ActorRef`).

use std::time::Duration;

use ractor::ActorRef;
use ractor::rpc::CallResult;

use super::session_owner::OwnerMsg;
use super::session_region::{RegionMsg, RegionStats, SessionFilter};
use crate::ids::SessionKey;
use crate::session::{HotSnapshot, SessionError};

/// How long a caller waits for the region to answer.
const REGION_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Access to the node's session region.
#[derive(Debug, Clone)]
pub struct SessionRegionHandle {
    name: String,
}

impl SessionRegionHandle {
    pub fn new(name: String) -> Self {
        Self { name }
    }

    pub fn actor_name(&self) -> &str {
        &self.name
    }

    fn actor(&self) -> Result<ActorRef<RegionMsg>, SessionError> {
        ActorRef::where_is(self.name.clone())
            .ok_or_else(|| SessionError::Unavailable("session region is restarting".into()))
    }

    async fn call<T: Send + 'static>(
        &self,
        build: impl FnOnce(ractor::RpcReplyPort<T>) -> RegionMsg,
    ) -> Result<T, SessionError> {
        match self.actor()?.call(build, Some(REGION_CALL_TIMEOUT)).await {
            Ok(CallResult::Success(value)) => Ok(value),
            Ok(CallResult::Timeout) => {
                Err(SessionError::Unavailable("session region timed out".into()))
            }
            Ok(CallResult::SenderError) | Err(_) => {
                Err(SessionError::Unavailable("session region stopped".into()))
            }
        }
    }

    /// Start an upload of `key`: spawns or reuses its owner. At most one upload of a
    /// session runs at a time on this node.
    ///
    /// The region answers with the ticket itself, so an answer that never reaches a
    /// caller (its call timed out, or its future was dropped while the answer was in
    /// flight) is dropped with the ticket, and the drop ends the upload (SES-3).
    pub async fn begin(&self, key: SessionKey) -> Result<IngestTicket, SessionError> {
        self.call(|reply| RegionMsg::Begin(key, reply)).await?
    }

    pub async fn stats(&self) -> Result<RegionStats, SessionError> {
        self.call(RegionMsg::Stats).await
    }

    pub async fn snapshot(&self, key: SessionKey) -> Result<Option<HotSnapshot>, SessionError> {
        self.call(|reply| RegionMsg::Snapshot(key, reply)).await
    }

    /// Stop the owners of all idle sessions matching `filter` (for example, sessions of
    /// shards this node no longer owns); uploading ones are left alone and counted.
    pub async fn stop_matching(
        &self,
        filter: SessionFilter,
    ) -> Result<super::session_region::StopReport, SessionError> {
        self.call(|reply| RegionMsg::StopMatching(filter, reply))
            .await
    }
}

/// One running upload of a session. Report progress while streaming and `finish` at the
/// end; dropping an unfinished ticket reports a failed upload.
pub struct IngestTicket {
    region: ActorRef<RegionMsg>,
    owner: ActorRef<OwnerMsg>,
    key: SessionKey,
    finished: bool,
}

impl IngestTicket {
    /// The ticket of an upload the region has just marked active (built only by the
    /// region, inside its `Begin`).
    pub(super) fn new(
        region: ActorRef<RegionMsg>,
        owner: ActorRef<OwnerMsg>,
        key: SessionKey,
    ) -> Self {
        Self {
            region,
            owner,
            key,
            finished: false,
        }
    }

    /// Body bytes arrived (counters only).
    pub fn progress(&self, bytes: u64, frames: u64) {
        let _ = self.owner.cast(OwnerMsg::Progress { bytes, frames });
    }

    pub fn finish(mut self, succeeded: bool) {
        self.report(succeeded);
    }

    fn report(&mut self, succeeded: bool) {
        if !self.finished {
            self.finished = true;
            let _ = self.region.cast(RegionMsg::End {
                key: self.key,
                succeeded,
            });
        }
    }
}

impl Drop for IngestTicket {
    fn drop(&mut self) {
        self.report(false);
    }
}

impl std::fmt::Debug for IngestTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestTicket")
            .field("session", &self.key.session)
            .finish()
    }
}
