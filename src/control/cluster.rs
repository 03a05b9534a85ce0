//! The control transport over `ractor_cluster`.
//!
//! Owns three actors per node, linked under a [`ControlSupervisor`] (itself linked under
//! the node's supervisor), which restarts them as one unit and gives up after a bounded
//! number of restarts (see `control::supervisor`):
//! - the `NodeServer` (ractor_cluster) listening on `control.control_listen`, with the
//!   internal token as the magic cookie;
//! - a [`ControlActor`] joined to the pg group `graviton.control.<node id>`. Its
//!   payloads are a raw-bytes newtype ([`Wire`]) decoded in the handler with the
//!   64 KiB cap, so a malformed payload gets a typed `bad_request` reply instead of a
//!   dead session;
//! - a [`PeerDialer`] that dials the peers the caller lists ([`ClusterTransport::set_peers`],
//!   fed from the PostgreSQL node table) and re-dials with exponential backoff and jitter
//!   when a session drops or a handshake does not complete.
//!
//! Failure model: ractor_cluster has no reconnect, no pong timeout and no keepalive.
//! Every call carries a deadline; timeouts and missing sessions are reported as
//! "unknown" ([`ControlError`]), never as a liveness verdict. Frames above
//! [`MAX_FRAME_BYTES`] make ractor_cluster drop the session (it is re-dialed).
//!
//! Limitation: ractor's pg groups and pid registry are process-global. Several nodes
//! in one process work (tests do it), but a remote actor id can collide between two
//! local NodeServers that talk to the same peer; production runs one node per process.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use ractor::rpc::CallResult;
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, BytesConvertable, RpcReplyPort,
};
use ractor_cluster::{
    NodeEventSubscription, NodeServerMessage, RactorClusterMessage, RactorMessage,
};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::control::envelope::{self, Envelope, Reply};
use crate::control::supervisor::{ControlSupervisor, PlaneMsg, PlaneSpec};
use crate::control::transport::{ControlError, ControlHandler, ControlTransport, serve_bytes};
use crate::ids::NodeId;
use crate::values::Secret;

/// Inbound ractor_cluster frame cap: one 64 KiB envelope plus protocol overhead.
pub const MAX_FRAME_BYTES: u64 = 256 * 1024;
/// Most control requests handled at once per node.
pub const MAX_REQUESTS_IN_FLIGHT: usize = 1024;
/// Host part of ractor_cluster node names (`<node id>@graviton`).
pub(super) const HOSTNAME: &str = "graviton";

/// The pg group of a node's control actor.
pub fn control_group(node: &NodeId) -> String {
    format!("graviton.control.{node}")
}

/// Raw MessagePack bytes on the wire; decoded (with the cap) by the receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wire(pub Vec<u8>);

impl BytesConvertable for Wire {
    fn into_bytes(self) -> Vec<u8> {
        self.0
    }
    fn from_bytes(bytes: Vec<u8>) -> Self {
        Wire(bytes)
    }
}

/// Messages of the [`ControlActor`]; variant names are wire contract (never rename).
#[derive(RactorClusterMessage)]
pub enum ControlMsg {
    /// A hint; no reply.
    Cast(Wire),
    /// A request; the reply is an encoded [`Reply`].
    #[rpc]
    Call(Wire, RpcReplyPort<Wire>),
}

/// Answers peers' control messages with the node's [`ControlHandler`].
pub struct ControlActor;

/// Arguments of [`ControlActor`].
pub struct ControlActorArgs {
    pub node: NodeId,
    pub handler: Arc<dyn ControlHandler>,
}

/// State of a [`ControlActor`].
pub struct ControlActorState {
    handler: Arc<dyn ControlHandler>,
    /// Bounds requests in progress; beyond it callers get `unavailable` at once.
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl Actor for ControlActor {
    type Msg = ControlMsg;
    type State = ControlActorState;
    type Arguments = ControlActorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(control_group(&args.node), vec![myself.get_cell()]);
        Ok(ControlActorState {
            handler: args.handler,
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_REQUESTS_IN_FLIGHT)),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // One task per request: a slow handler never blocks the mailbox, and a handler
        // panic only drops that request's reply port (the caller sees an error).
        let handler = state.handler.clone();
        let permit = state.in_flight.clone().try_acquire_owned();
        match message {
            ControlMsg::Call(wire, reply) => {
                let Ok(permit) = permit else {
                    let _ = reply.send(Wire(overloaded()));
                    return Ok(());
                };
                tokio::spawn(async move {
                    let _permit = permit;
                    if reply.is_closed() {
                        return;
                    }
                    let bytes = serve_bytes(handler.as_ref(), &wire.0).await;
                    let _ = reply.send(Wire(bytes));
                });
            }
            ControlMsg::Cast(wire) => {
                // Hints beyond the bound are dropped: PostgreSQL is the source of truth.
                let Ok(permit) = permit else { return Ok(()) };
                tokio::spawn(async move {
                    let _permit = permit;
                    let _ = serve_bytes(handler.as_ref(), &wire.0).await;
                });
            }
        }
        Ok(())
    }
}

fn overloaded() -> Vec<u8> {
    envelope::encode_reply(&Reply::Error {
        code: envelope::ReplyErrorCode::Unavailable,
        message: "too many control requests in progress".to_string(),
    })
    .unwrap_or_default()
}

/// Options to start the cluster transport.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub node: NodeId,
    /// NodeServer listen address (a concrete port; ractor_cluster does not report the
    /// port it picked for 0).
    pub listen: SocketAddr,
    /// The internal token, used as the ractor_cluster cookie.
    pub token: Secret,
    pub backoff: Backoff,
    /// Deadline of a TCP connect plus handshake before a re-dial is scheduled.
    pub dial_timeout: Duration,
}

impl ClusterOptions {
    /// Options from the `[control]` section.
    pub fn from_config(
        node: NodeId,
        config: &crate::control::ControlConfig,
    ) -> Result<Self, StartError> {
        let token = config.internal_token.clone().ok_or_else(|| {
            StartError("control.internal_token is required in cluster mode".to_string())
        })?;
        Ok(Self {
            node,
            listen: config.control_listen,
            token,
            backoff: Backoff::new(config.dial_backoff_min.get(), config.dial_backoff_max.get()),
            dial_timeout: config.call_timeout.get(),
        })
    }
}

/// Why the cluster transport did not start.
#[derive(Debug, thiserror::Error)]
#[error("control plane failed to start: {0}")]
pub struct StartError(pub(super) String);

#[derive(Debug, Default)]
pub(super) struct PeerEntry {
    addr: Option<SocketAddr>,
    attempt: u32,
    generation: u64,
}

impl PeerEntry {
    /// Forget the address and the dial state (its sessions died with the plane).
    pub(super) fn forget(&mut self) {
        self.addr = None;
        self.attempt = 0;
        self.generation += 1; // cancels dials scheduled by the old dialer
    }
}

/// Shared between the dialer (writer) and the transport (reader).
#[derive(Debug, Default)]
pub(super) struct PeerTable {
    pub(super) listed: HashMap<NodeId, PeerEntry>,
    /// ractor_cluster session node id -> our node id, for ready sessions.
    pub(super) sessions: HashMap<u64, NodeId>,
    redials: u64,
}

impl PeerTable {
    fn sessions_of(&self, peer: &NodeId) -> HashSet<u64> {
        self.sessions
            .iter()
            .filter(|(_, p)| *p == peer)
            .map(|(id, _)| *id)
            .collect()
    }
}

pub(super) type Shared = Arc<Mutex<PeerTable>>;

pub(super) fn lock(shared: &Shared) -> MutexGuard<'_, PeerTable> {
    shared.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Messages of the [`PeerDialer`].
#[derive(RactorMessage)]
pub enum DialerMsg {
    SetPeers(Vec<(NodeId, SocketAddr)>),
    SessionReady {
        session: u64,
        peer_name: Option<String>,
    },
    SessionDown {
        session: u64,
    },
    Dial {
        peer: NodeId,
        generation: u64,
    },
    DialFailed {
        peer: NodeId,
        generation: u64,
    },
    HandshakeDeadline {
        peer: NodeId,
        generation: u64,
    },
    /// Test fault injection: panic in the handler.
    #[cfg(test)]
    Panic,
}

/// Dials listed peers and re-dials them with backoff.
pub struct PeerDialer;

pub struct DialerArgs {
    pub(super) me: NodeId,
    pub(super) server: ActorRef<NodeServerMessage>,
    pub(super) shared: Shared,
    pub(super) backoff: Backoff,
    pub(super) dial_timeout: Duration,
    /// Mutual TLS towards peers (`[http.internal_tls]`), or plaintext.
    pub(super) tls: Option<tokio_rustls::TlsConnector>,
}

/// Mutual TLS of the control plane: the NodeServer's acceptor (client certificates
/// required) and the dialer's connector (this node's certificate). Built by
/// `edge::tls::control_tls`.
#[derive(Clone)]
pub struct ControlTls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub connector: tokio_rustls::TlsConnector,
}

impl PeerDialer {
    fn schedule(myself: &ActorRef<DialerMsg>, args: &DialerArgs, peer: &NodeId, now: bool) {
        let mut table = lock(&args.shared);
        let Some(entry) = table.listed.get_mut(peer) else {
            return;
        };
        entry.generation += 1;
        let generation = entry.generation;
        let delay = if now {
            Duration::ZERO
        } else {
            let delay = args.backoff.delay(entry.attempt, &mut rand::rng());
            entry.attempt = entry.attempt.saturating_add(1);
            table.redials += 1;
            delay
        };
        let peer = peer.clone();
        drop(table);
        tracing::debug!(peer = %peer, ?delay, "control: dial scheduled");
        myself.send_after(delay, move || DialerMsg::Dial { peer, generation });
    }

    fn is_connected(table: &PeerTable, peer: &NodeId) -> bool {
        table.sessions.values().any(|p| p == peer)
    }
}

impl Actor for PeerDialer {
    type Msg = DialerMsg;
    type State = DialerArgs;
    type Arguments = DialerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            #[cfg(test)]
            DialerMsg::Panic => panic!("injected dialer panic"),
            DialerMsg::SetPeers(peers) => {
                let mut fresh = Vec::new();
                {
                    let mut table = lock(&state.shared);
                    let wanted: HashMap<NodeId, SocketAddr> = peers
                        .into_iter()
                        .filter(|(id, _)| *id != state.me)
                        .collect();
                    table.listed.retain(|id, _| wanted.contains_key(id));
                    for (id, addr) in wanted {
                        let entry = table.listed.entry(id.clone()).or_default();
                        if entry.addr != Some(addr) {
                            entry.addr = Some(addr);
                            entry.attempt = 0;
                            fresh.push(id);
                        }
                    }
                }
                for peer in fresh {
                    Self::schedule(&myself, state, &peer, true);
                }
            }
            DialerMsg::Dial { peer, generation } => {
                let addr = {
                    let table = lock(&state.shared);
                    match table.listed.get(&peer) {
                        Some(entry)
                            if entry.generation == generation
                                && !Self::is_connected(&table, &peer) =>
                        {
                            entry.addr
                        }
                        _ => None,
                    }
                };
                let Some(addr) = addr else { return Ok(()) };
                let server = state.server.clone();
                let timeout = state.dial_timeout;
                let me = myself.clone();
                let tls = state.tls.clone();
                tokio::spawn(async move {
                    let connect = async {
                        match tls {
                            None => ractor_cluster::client_connect(&server, addr).await,
                            Some(connector) => {
                                // Peers are dialled by address: the certificate must
                                // name that IP.
                                let name =
                                    rustls_pki_types::ServerName::IpAddress(addr.ip().into());
                                ractor_cluster::client_connect_enc(&server, addr, connector, name)
                                    .await
                            }
                        }
                    };
                    match tokio::time::timeout(timeout, connect).await {
                        Ok(Ok(())) => {
                            me.send_after(timeout, move || DialerMsg::HandshakeDeadline {
                                peer,
                                generation,
                            });
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(peer = %peer, %error, "control: dial failed");
                            let _ = me.cast(DialerMsg::DialFailed { peer, generation });
                        }
                        Err(_) => {
                            tracing::debug!(peer = %peer, "control: dial timed out");
                            let _ = me.cast(DialerMsg::DialFailed { peer, generation });
                        }
                    }
                });
            }
            DialerMsg::DialFailed { peer, generation }
            | DialerMsg::HandshakeDeadline { peer, generation } => {
                let retry = {
                    let table = lock(&state.shared);
                    table
                        .listed
                        .get(&peer)
                        .is_some_and(|e| e.generation == generation)
                        && !Self::is_connected(&table, &peer)
                };
                if retry {
                    Self::schedule(&myself, state, &peer, false);
                }
            }
            DialerMsg::SessionReady { session, peer_name } => {
                let Some(name) = peer_name else { return Ok(()) };
                let Ok(peer) = NodeId::parse(name.split('@').next().unwrap_or_default()) else {
                    tracing::warn!("a peer announced an invalid node name; ignoring its session");
                    return Ok(());
                };
                let mut table = lock(&state.shared);
                table.sessions.insert(session, peer.clone());
                if let Some(entry) = table.listed.get_mut(&peer) {
                    entry.attempt = 0;
                    entry.generation += 1; // cancels pending dials and deadlines
                }
                drop(table);
                tracing::info!(peer = %peer, "control: peer session ready");
            }
            DialerMsg::SessionDown { session } => {
                let (peer, redial) = {
                    let mut table = lock(&state.shared);
                    match table.sessions.remove(&session) {
                        Some(peer) => {
                            let redial = table.listed.contains_key(&peer)
                                && !Self::is_connected(&table, &peer);
                            (Some(peer), redial)
                        }
                        None => (None, false),
                    }
                };
                if let Some(peer) = peer {
                    tracing::info!(peer = %peer, "control: peer session lost");
                    if redial {
                        Self::schedule(&myself, state, &peer, false);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Forwards NodeServer session events to the dialer.
pub(super) struct Events(pub(super) ActorRef<DialerMsg>);

impl NodeEventSubscription for Events {
    fn node_session_opened(&self, _: ractor_cluster::node::NodeServerSessionInformation) {}

    fn node_session_disconnected(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        let _ = self.0.cast(DialerMsg::SessionDown {
            session: ses.node_id,
        });
    }

    fn node_session_authenticated(&self, _: ractor_cluster::node::NodeServerSessionInformation) {}

    fn node_session_ready(&self, ses: ractor_cluster::node::NodeServerSessionInformation) {
        let _ = self.0.cast(DialerMsg::SessionReady {
            session: ses.node_id,
            peer_name: ses.peer_name.map(|n| n.name),
        });
    }
}

/// The control transport over ractor_cluster. Cheap to clone.
#[derive(Clone)]
pub struct ClusterTransport {
    me: NodeId,
    listen: SocketAddr,
    supervisor: ActorRef<PlaneMsg>,
    handler: Arc<dyn ControlHandler>,
    shared: Shared,
    lost: CancellationToken,
    restarts: Arc<AtomicU64>,
}

impl ClusterTransport {
    /// Start the NodeServer, the control actor and the dialer under their own
    /// supervisor (not linked to any other actor: tests and tools).
    pub async fn start(
        options: ClusterOptions,
        handler: Arc<dyn ControlHandler>,
    ) -> Result<Self, StartError> {
        Self::start_under(None, options, handler, None).await
    }

    /// [`Self::start`] with mutual TLS on the NodeServer and the dialer (the cookie, the
    /// internal token, is still checked by ractor_cluster's handshake).
    pub async fn start_with_tls(
        options: ClusterOptions,
        handler: Arc<dyn ControlHandler>,
        tls: Option<ControlTls>,
    ) -> Result<Self, StartError> {
        Self::start_under(None, options, handler, tls).await
    }

    /// Start the plane with its [`ControlSupervisor`] linked under `parent` (the node's
    /// `NodeSupervisor`). The supervisor restarts the plane when one of its actors
    /// exits, and gives up after a bounded number of restarts, firing [`Self::lost`].
    pub async fn start_under(
        parent: Option<ActorCell>,
        options: ClusterOptions,
        handler: Arc<dyn ControlHandler>,
        tls: Option<ControlTls>,
    ) -> Result<Self, StartError> {
        let shared = Shared::default();
        let lost = CancellationToken::new();
        let restarts = Arc::new(AtomicU64::new(0));
        let (me, listen) = (options.node.clone(), options.listen);
        let spec = PlaneSpec {
            options,
            handler: handler.clone(),
            tls,
            shared: shared.clone(),
            lost: lost.clone(),
            restarts: restarts.clone(),
        };
        // Named (uniquely: ractor's registry is process-wide) so that diagnostics and
        // fault tests can find it in the node's tree.
        let name = format!(
            "graviton.{me}.control-plane.{}",
            uuid::Uuid::new_v4().simple()
        );
        let spawned = match parent {
            Some(parent) => Actor::spawn_linked(Some(name), ControlSupervisor, spec, parent).await,
            None => Actor::spawn(Some(name), ControlSupervisor, spec).await,
        };
        // The supervisor's start error carries the plane's (never the token).
        let (supervisor, _) = spawned.map_err(|e| StartError(e.to_string()))?;
        tracing::info!(node = %me, %listen, "control plane started");
        Ok(Self {
            me,
            listen,
            supervisor,
            handler,
            shared,
            lost,
            restarts,
        })
    }

    /// Fired once the control plane's supervisor gave up restarting it (the node then
    /// stops: see `control::supervisor`).
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// How many times the plane was restarted after one of its actors exited.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub(super) fn inject(&self, fault: PlaneMsg) {
        let _ = self.supervisor.cast(fault);
    }

    /// The control listener address.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen
    }

    /// How many re-dials were scheduled so far (for tests and the operator snapshot).
    pub fn redials(&self) -> u64 {
        lock(&self.shared).redials
    }

    /// The remote control actor of `peer`, through one of this node's ready sessions.
    fn remote_control(&self, peer: &NodeId) -> Option<ActorRef<ControlMsg>> {
        let sessions = lock(&self.shared).sessions_of(peer);
        if sessions.is_empty() {
            return None;
        }
        ractor::pg::get_members(&control_group(peer))
            .into_iter()
            .find(|cell| match cell.get_id() {
                ActorId::Remote { node_id, .. } => sessions.contains(&node_id),
                ActorId::Local(_) => false,
            })
            .map(ActorRef::from)
    }

    /// Send raw bytes as a request and return the raw reply. Diagnostics and tests of
    /// the receiver's input validation; normal code uses [`ControlTransport::call`].
    pub async fn call_raw(
        &self,
        peer: &NodeId,
        bytes: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ControlError> {
        let actor = self
            .remote_control(peer)
            .ok_or_else(|| self.missing(peer))?;
        match actor
            .call(|port| ControlMsg::Call(Wire(bytes), port), Some(timeout))
            .await
        {
            Ok(CallResult::Success(wire)) => Ok(wire.0),
            Ok(CallResult::Timeout) => Err(ControlError::Timeout {
                peer: peer.clone(),
                after: timeout,
            }),
            Ok(CallResult::SenderError) => Err(ControlError::Transport {
                peer: peer.clone(),
                reason: "reply channel dropped".to_string(),
            }),
            Err(error) => Err(ControlError::Transport {
                peer: peer.clone(),
                reason: error.to_string(),
            }),
        }
    }

    fn missing(&self, peer: &NodeId) -> ControlError {
        if lock(&self.shared).listed.contains_key(peer) {
            ControlError::NotConnected(peer.clone())
        } else {
            ControlError::UnknownPeer(peer.clone())
        }
    }

    /// Stop the dialer, the control actor and the NodeServer (closing every session),
    /// then their supervisor. Returns at once if the supervisor already gave up.
    pub async fn shutdown(&self) {
        let wait = Some(Duration::from_secs(10));
        let _ = self.supervisor.call(PlaneMsg::Shutdown, wait).await;
        let _ = self.supervisor.stop_and_wait(None, wait).await;
    }
}

impl ControlTransport for ClusterTransport {
    fn local_node(&self) -> &NodeId {
        &self.me
    }

    fn call<'a>(
        &'a self,
        peer: &'a NodeId,
        request: Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Reply, ControlError>> {
        Box::pin(async move {
            let bytes = envelope::encode_request(&request).map_err(ControlError::Encode)?;
            let reply = if *peer == self.me {
                // Local short-cut through the same codec.
                tokio::time::timeout(timeout, serve_bytes(self.handler.as_ref(), &bytes))
                    .await
                    .map_err(|_| ControlError::Timeout {
                        peer: peer.clone(),
                        after: timeout,
                    })?
            } else {
                self.call_raw(peer, bytes, timeout).await?
            };
            envelope::decode_reply(&reply).map_err(|error| ControlError::Decode {
                peer: peer.clone(),
                error,
            })
        })
    }

    fn cast(&self, peer: &NodeId, request: Envelope) -> Result<(), ControlError> {
        let bytes = envelope::encode_request(&request).map_err(ControlError::Encode)?;
        let actor = self
            .remote_control(peer)
            .ok_or_else(|| self.missing(peer))?;
        actor
            .cast(ControlMsg::Cast(Wire(bytes)))
            .map_err(|e| ControlError::Transport {
                peer: peer.clone(),
                reason: e.to_string(),
            })
    }

    fn set_peers(&self, peers: Vec<(NodeId, SocketAddr)>) {
        let _ = self.supervisor.cast(PlaneMsg::SetPeers(peers));
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        let listed: Vec<NodeId> = lock(&self.shared).listed.keys().cloned().collect();
        let mut out: Vec<NodeId> = listed
            .into_iter()
            .filter(|p| self.remote_control(p).is_some())
            .collect();
        out.sort();
        out
    }
}
