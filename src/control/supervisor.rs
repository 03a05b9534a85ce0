//! `ControlSupervisor`: owns a node's three control-plane actors (the ractor_cluster
//! `NodeServer`, the [`ControlActor`] and the [`PeerDialer`]), linked under it, and is
//! itself linked under the node's `NodeSupervisor` (`ClusterTransport::start_under`).
//!
//! The three are restarted as one unit: the dialer subscribes to the NodeServer's session
//! events and the peer table maps the NodeServer's sessions, so none of them is valid
//! alone. When any of them exits unexpectedly (a panic skips its own `post_stop`), the
//! supervisor stops the others with `stop_and_wait` (their `post_stop` runs; stopping the
//! NodeServer closes its listener and every peer session), forgets the sessions and
//! the dial state, and starts a fresh plane after the restart backoff
//! (`actors::restart`: 50 ms doubling to 5 s). The fresh dialer dials every listed peer
//! at once.
//!
//! Bounded: at most [`MAX_RESTARTS`] restarts in [`RESTART_WINDOW`]. Past that the
//! supervisor gives up: it fires the transport's `lost` token and stops. The node reacts
//! to that (`node::RunningNode::run_until_signal`): it fails readiness at once, drains its
//! shards through the graceful handoff (no new ingest for them), and the process exits
//! with status 1 so that its orchestrator restarts it (docs/locality.md §12).
//!
//! Safety does not depend on the control plane: every ownership decision reads
//! PostgreSQL and the local placement view, and control messages are hints. A node
//! whose plane is down keeps its placement, heartbeats and fence; peers' calls to it
//! fail as "unknown" (`ControlError`), never as a verdict.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use ractor_cluster::{NodeServer, NodeServerMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::cluster::{
    ClusterOptions, ControlActor, ControlActorArgs, ControlMsg, ControlTls, DialerArgs, DialerMsg,
    Events, HOSTNAME, MAX_FRAME_BYTES, PeerDialer, PeerEntry, Shared, StartError, lock,
};
use super::transport::ControlHandler;
use crate::actors::restart::{Restart, RestartBudget, exited};
use crate::ids::NodeId;

/// Most restarts of the control plane within [`RESTART_WINDOW`] before it gives up.
pub const MAX_RESTARTS: usize = 5;
/// The window of [`MAX_RESTARTS`].
pub const RESTART_WINDOW: Duration = Duration::from_secs(60);
/// How long each actor of the plane gets to stop.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Everything needed to (re)start the plane.
pub(super) struct PlaneSpec {
    pub options: ClusterOptions,
    pub handler: Arc<dyn ControlHandler>,
    pub tls: Option<ControlTls>,
    pub shared: Shared,
    /// Fired when the supervisor gives up.
    pub lost: CancellationToken,
    /// Restarts done so far.
    pub restarts: Arc<AtomicU64>,
}

/// The three running actors of one incarnation of the plane.
struct Plane {
    server: ActorRef<NodeServerMessage>,
    control: ActorRef<ControlMsg>,
    dialer: ActorRef<DialerMsg>,
}

impl Plane {
    fn holds(&self, id: ActorId) -> bool {
        [
            self.server.get_id(),
            self.control.get_id(),
            self.dialer.get_id(),
        ]
        .contains(&id)
    }

    /// Stop the dialer, the control actor and the NodeServer (closing its listener and
    /// every session), each waiting for its `post_stop`.
    async fn stop(self, reason: &str) {
        let _ = self
            .dialer
            .stop_and_wait(Some(reason.into()), Some(STOP_WAIT))
            .await;
        let _ = self
            .control
            .stop_and_wait(Some(reason.into()), Some(STOP_WAIT))
            .await;
        let _ = self
            .server
            .stop_and_wait(Some(reason.into()), Some(STOP_WAIT))
            .await;
    }
}

async fn start_plane(myself: &ActorRef<PlaneMsg>, spec: &PlaneSpec) -> Result<Plane, StartError> {
    let options = &spec.options;
    let encryption = spec
        .tls
        .as_ref()
        .map(|t| ractor_cluster::IncomingEncryptionMode::Tls(t.acceptor.clone()));
    let server = NodeServer::new(
        options.listen.port(),
        options.token.expose().to_string(),
        options.node.to_string(),
        HOSTNAME.to_string(),
        encryption,
        Some(ractor_cluster::node::NodeConnectionMode::Isolated),
    )
    .with_listen_addr(options.listen.ip())
    .with_max_inbound_frame_size(MAX_FRAME_BYTES);
    let cell = myself.get_cell();
    let (server, _) = Actor::spawn_linked(None, server, (), cell.clone())
        .await
        .map_err(|e| StartError(format!("node server on {}: {e}", options.listen)))?;
    let stop_server = |e: String| {
        server.stop(None);
        StartError(e)
    };
    let (control, _) = Actor::spawn_linked(
        None,
        ControlActor,
        ControlActorArgs {
            node: options.node.clone(),
            handler: spec.handler.clone(),
        },
        cell.clone(),
    )
    .await
    .map_err(|e| stop_server(format!("control actor: {e}")))?;
    let (dialer, _) = Actor::spawn_linked(
        None,
        PeerDialer,
        DialerArgs {
            me: options.node.clone(),
            server: server.clone(),
            shared: spec.shared.clone(),
            backoff: options.backoff,
            dial_timeout: options.dial_timeout,
            tls: spec.tls.as_ref().map(|t| t.connector.clone()),
        },
        cell,
    )
    .await
    .map_err(|e| {
        control.stop(None);
        stop_server(format!("dialer: {e}"))
    })?;
    let plane = Plane {
        server,
        control,
        dialer,
    };
    if let Err(e) = plane.server.cast(NodeServerMessage::SubscribeToEvents {
        id: "graviton.dialer".to_string(),
        subscription: Box::new(Events(plane.dialer.clone())),
    }) {
        plane.stop("start failed").await;
        return Err(StartError(format!("subscribe: {e}")));
    }
    Ok(plane)
}

/// Messages of the [`ControlSupervisor`].
pub(super) enum PlaneMsg {
    /// The peers to dial (kept for restarts).
    SetPeers(Vec<(NodeId, SocketAddr)>),
    /// Start a fresh plane (after the backoff).
    Restart,
    /// Stop the plane for good, then reply.
    Shutdown(RpcReplyPort<()>),
    /// Test fault injection: make the current dialer panic in its handler.
    #[cfg(test)]
    PanicDialer,
    /// Test fault injection: kill the current NodeServer (no `post_stop`).
    #[cfg(test)]
    KillServer,
}

impl ractor::Message for PlaneMsg {}

/// Supervises the control plane (see the module docs).
pub(super) struct ControlSupervisor;

pub(super) struct PlaneState {
    spec: PlaneSpec,
    plane: Option<Plane>,
    peers: Vec<(NodeId, SocketAddr)>,
    restart: Restart,
    budget: RestartBudget,
    shutting_down: bool,
}

impl PlaneState {
    /// Forget what died with the old plane: its sessions, and the dial state of every
    /// peer, so the next dialer sees every listed peer as new and dials it at once.
    fn forget_sessions(&self) {
        let mut table = lock(&self.spec.shared);
        table.sessions.clear();
        // Still listed (calls say "not connected"), but with no address: the fresh
        // dialer's first `SetPeers` dials each one at once.
        table.listed.values_mut().for_each(PeerEntry::forget);
    }
}

/// The one place that declares the plane lost: the supervisor's state goes away without
/// a requested shutdown (it gave up, or it failed itself, which kills the plane with it).
impl Drop for PlaneState {
    fn drop(&mut self) {
        if !self.shutting_down {
            self.spec.lost.cancel();
        }
    }
}

impl ControlSupervisor {
    /// The plane is down (`why`): restart it after the backoff, or give up.
    fn down(myself: &ActorRef<PlaneMsg>, state: &mut PlaneState, why: &str) {
        if state.budget.allow(Instant::now()) {
            state
                .restart
                .schedule(myself, "control_plane", why, || PlaneMsg::Restart);
            return;
        }
        tracing::error!(
            reason = %why,
            max_restarts = MAX_RESTARTS,
            window = ?RESTART_WINDOW,
            "control plane: giving up; the node stops so that its orchestrator restarts it"
        );
        // Dropping the state fires `lost` (below).
        myself.stop(Some("control plane gave up".into()));
    }
}

impl Actor for ControlSupervisor {
    type Msg = PlaneMsg;
    type State = PlaneState;
    type Arguments = PlaneSpec;

    async fn pre_start(
        &self,
        myself: ActorRef<PlaneMsg>,
        spec: PlaneSpec,
    ) -> Result<PlaneState, ActorProcessingErr> {
        // The first start fails the node's start (for example on a busy port).
        let plane = start_plane(&myself, &spec).await?;
        let mut restart = Restart::default();
        restart.started();
        Ok(PlaneState {
            spec,
            plane: Some(plane),
            peers: Vec::new(),
            restart,
            budget: RestartBudget::new(MAX_RESTARTS, RESTART_WINDOW),
            shutting_down: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<PlaneMsg>,
        message: PlaneMsg,
        state: &mut PlaneState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            PlaneMsg::SetPeers(peers) => {
                state.peers = peers.clone();
                if let Some(plane) = &state.plane {
                    let _ = plane.dialer.cast(DialerMsg::SetPeers(peers));
                }
            }
            PlaneMsg::Restart => {
                if state.shutting_down || state.plane.is_some() {
                    return Ok(());
                }
                match start_plane(&myself, &state.spec).await {
                    Ok(plane) => {
                        let _ = plane.dialer.cast(DialerMsg::SetPeers(state.peers.clone()));
                        state.plane = Some(plane);
                        state.restart.started();
                        state.spec.restarts.fetch_add(1, Ordering::Relaxed);
                        tracing::info!("control plane restarted");
                    }
                    Err(err) => Self::down(&myself, state, &format!("restart failed: {err}")),
                }
            }
            PlaneMsg::Shutdown(reply) => {
                state.shutting_down = true;
                if let Some(plane) = state.plane.take() {
                    plane.stop("control plane shutdown").await;
                }
                let _ = reply.send(());
                myself.stop(None);
            }
            #[cfg(test)]
            PlaneMsg::PanicDialer => {
                if let Some(plane) = &state.plane {
                    let _ = plane.dialer.cast(DialerMsg::Panic);
                }
            }
            #[cfg(test)]
            PlaneMsg::KillServer => {
                if let Some(plane) = &state.plane {
                    plane.server.kill();
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<PlaneMsg>,
        event: SupervisionEvent,
        state: &mut PlaneState,
    ) -> Result<(), ActorProcessingErr> {
        let Some((id, why)) = exited(&event) else {
            return Ok(());
        };
        if state.shutting_down {
            return Ok(());
        }
        // Events of an older plane's actors (stopped below) are not news.
        let Some(plane) = state.plane.take_if(|p| p.holds(id)) else {
            return Ok(());
        };
        tracing::error!(reason = %why, "control plane: an actor exited; restarting the plane");
        plane.stop("control plane restart").await;
        state.forget_sessions();
        Self::down(&myself, state, &why);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backoff::Backoff;
    use crate::control::cluster::ClusterTransport;
    use crate::control::envelope::{Envelope, OwnerReply, Reply, SessionRequest};
    use crate::control::transport::{ControlTransport, FnHandler};
    use crate::ids::{SessionId, TenantId};
    use crate::values::Secret;

    const TOKEN: &str = "test-token-0123456789abcdefghijklmnopqrstuvwxyz";

    fn node(id: &str) -> NodeId {
        NodeId::parse(id).unwrap()
    }

    fn free_addr() -> SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    async fn start(id: &str, listen: SocketAddr) -> ClusterTransport {
        let me = node(id);
        let handler = Arc::new(FnHandler(move |_request| {
            Reply::Owner(OwnerReply {
                owner: me.clone(),
                owner_internal_addr: "127.0.0.1:7071".parse().unwrap(),
                shard_epoch: 1,
                hot_state: None,
            })
        }));
        let options = ClusterOptions {
            node: node(id),
            listen,
            token: Secret::new(TOKEN),
            backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
            dial_timeout: Duration::from_millis(500),
        };
        ClusterTransport::start(options, handler).await.unwrap()
    }

    fn activate() -> Envelope {
        Envelope::ActivateSession(SessionRequest {
            tenant: TenantId::new_random(),
            session: SessionId::new_random(),
            shard: 1,
            epoch: 1,
        })
    }

    /// `from` gets an answer from `peer` within 10 s.
    async fn reachable(from: &ClusterTransport, peer: &NodeId) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if let Ok(Reply::Owner(owner)) =
                from.call(peer, activate(), Duration::from_secs(1)).await
            {
                return &owner.owner == peer;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < until, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // Checks LOC-8.
    // One test: ractor's pg groups are process-global, so two tests running at once in
    // this binary could see each other's control actors.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crashed_control_actor_restarts_the_plane_until_the_budget_is_spent() {
        let (aa, ba) = (free_addr(), free_addr());
        let a = start("ctl-sup-a", aa).await;
        let b = start("ctl-sup-b", ba).await;
        let peers = vec![(node("ctl-sup-a"), aa), (node("ctl-sup-b"), ba)];
        a.set_peers(peers.clone());
        b.set_peers(peers);
        assert!(reachable(&a, &node("ctl-sup-b")).await);
        assert!(reachable(&b, &node("ctl-sup-a")).await);

        // A panic in a's dialer: the supervisor stops the rest of the plane (the
        // NodeServer too, so b's session drops), starts a fresh one, and the fresh
        // dialer dials b again without being told the peers anew.
        a.inject(PlaneMsg::PanicDialer);
        wait_for("the first restart", || a.restarts() == 1).await;
        assert!(reachable(&a, &node("ctl-sup-b")).await, "a reaches b again");
        assert!(reachable(&b, &node("ctl-sup-a")).await, "b reaches a again");
        assert!(!a.lost().is_cancelled());

        // The NodeServer killed (no post_stop at all): the same recovery, on the same port.
        a.inject(PlaneMsg::KillServer);
        wait_for("the second restart", || a.restarts() == 2).await;
        assert!(reachable(&b, &node("ctl-sup-a")).await);

        // A plane that keeps failing: past MAX_RESTARTS in the window, give up.
        for n in 3..=MAX_RESTARTS as u64 {
            a.inject(PlaneMsg::PanicDialer);
            wait_for("another restart", || a.restarts() == n).await;
        }
        assert!(!a.lost().is_cancelled());
        a.inject(PlaneMsg::PanicDialer);
        let lost = a.lost();
        tokio::time::timeout(Duration::from_secs(10), lost.cancelled())
            .await
            .expect("the supervisor gives up");
        assert_eq!(a.restarts(), MAX_RESTARTS as u64);
        // Every actor of the plane stopped: the control port is free, b cannot reach a.
        wait_for("the control port to be released", || {
            std::net::TcpListener::bind(aa).is_ok()
        })
        .await;
        assert!(
            b.call(&node("ctl-sup-a"), activate(), Duration::from_millis(300))
                .await
                .is_err()
        );
        a.shutdown().await; // a no-op on a stopped plane, and it returns
        b.shutdown().await;
    }
}
