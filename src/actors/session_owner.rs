//! `SessionOwner`: one actor per hot session, holding its [`HotState`].

use std::time::SystemTime;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::session::{HotSnapshot, HotState};

/// Messages to a session owner. Counters only; never body bytes.
pub enum OwnerMsg {
    /// An upload started (the region already checked that none was running).
    Begin,
    /// Body bytes arrived.
    Progress { bytes: u64, frames: u64 },
    /// The upload ended.
    Finish { succeeded: bool },
    /// A copy of the hot state.
    Snapshot(RpcReplyPort<HotSnapshot>),
    /// Hand the whole state to the region, which parks it and stops this actor.
    Park(RpcReplyPort<HotState>),
}

impl ractor::Message for OwnerMsg {}

/// The owner actor; stateless itself, its state is the session's [`HotState`]. It starts
/// from a parked state when the session was active before (see `SessionRegion`).
pub struct SessionOwner;

impl Actor for SessionOwner {
    type Msg = OwnerMsg;
    type State = HotState;
    type Arguments = Option<HotState>;

    async fn pre_start(
        &self,
        _myself: ActorRef<OwnerMsg>,
        parked: Option<HotState>,
    ) -> Result<HotState, ActorProcessingErr> {
        Ok(parked.unwrap_or_else(|| HotState::new(SystemTime::now())))
    }

    async fn handle(
        &self,
        _myself: ActorRef<OwnerMsg>,
        message: OwnerMsg,
        state: &mut HotState,
    ) -> Result<(), ActorProcessingErr> {
        let now = SystemTime::now();
        match message {
            OwnerMsg::Begin => {
                if let Err(err) = state.begin(now) {
                    // The region serializes uploads per session; reaching this is a bug upstream.
                    tracing::warn!(error = %err, "session owner asked to begin while receiving");
                }
            }
            OwnerMsg::Progress { bytes, frames } => state.progress(bytes, frames, now),
            OwnerMsg::Finish { succeeded } => state.finish(succeeded, now),
            OwnerMsg::Snapshot(reply) => {
                let _ = reply.send(state.snapshot());
            }
            OwnerMsg::Park(reply) => {
                let _ = reply.send(state.clone());
            }
        }
        Ok(())
    }
}
