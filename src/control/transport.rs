//! The control-plane ports and the in-memory transport.
//!
//! [`ControlTransport`] is what the node uses to talk to peers; [`ControlHandler`] is
//! what the node implements to answer them. Two transports exist: [`InMemoryTransport`]
//! (this file; for actor unit tests, it still runs every message through the real
//! codec) and `cluster::ClusterTransport` (ractor_cluster over TCP).
//!
//! Failure model: every call has a deadline. A timeout, a missing session or a
//! transport error means "unknown", never "the peer is dead": liveness comes from the
//! PostgreSQL heartbeat table, not from this layer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::control::envelope::{self, Envelope, EnvelopeError, Reply};
use crate::ids::NodeId;

/// Why a control call did not produce a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("peer {0} is not in the peer list")]
    UnknownPeer(NodeId),
    #[error("no live control session to peer {0}")]
    NotConnected(NodeId),
    #[error("control call to {peer} timed out after {after:?}")]
    Timeout { peer: NodeId, after: Duration },
    #[error("could not encode the request: {0}")]
    Encode(EnvelopeError),
    #[error("peer {peer} sent an undecodable reply: {error}")]
    Decode { peer: NodeId, error: EnvelopeError },
    #[error("control transport failure towards {peer}: {reason}")]
    Transport { peer: NodeId, reason: String },
    #[error("the control plane is shut down")]
    Shutdown,
}

/// Implemented by the node: answers control requests from peers.
///
/// Called concurrently, one task per request; keep it fast (a local placement lookup,
/// a hot-state touch). The reply must encode within 64 KiB.
pub trait ControlHandler: Send + Sync + 'static {
    fn handle(&self, request: Envelope) -> BoxFuture<'_, Reply>;
}

/// A closure-backed handler, handy in tests and for simple nodes.
pub struct FnHandler<F>(pub F);

impl<F> ControlHandler for FnHandler<F>
where
    F: Fn(Envelope) -> Reply + Send + Sync + 'static,
{
    fn handle(&self, request: Envelope) -> BoxFuture<'_, Reply> {
        let reply = (self.0)(request);
        Box::pin(async move { reply })
    }
}

/// How the node talks to its peers.
pub trait ControlTransport: Send + Sync + 'static {
    /// This node's id.
    fn local_node(&self) -> &NodeId;

    /// Send `request` to `peer` and wait at most `timeout` for the reply.
    fn call<'a>(
        &'a self,
        peer: &'a NodeId,
        request: Envelope,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Reply, ControlError>>;

    /// Fire and forget (hints). Delivery is not guaranteed.
    fn cast(&self, peer: &NodeId, request: Envelope) -> Result<(), ControlError>;

    /// Replace the peer list (from the PostgreSQL node table). The local node may be in
    /// it; it is ignored. Peers no longer listed are no longer re-dialed.
    fn set_peers(&self, peers: Vec<(NodeId, SocketAddr)>);

    /// Peers with a ready session right now. Diagnostic only: not a liveness verdict.
    fn connected_peers(&self) -> Vec<NodeId>;

    /// Cast `request` to every connected peer (hints such as `AssignmentChanged`).
    /// Returns how many casts were handed to the transport. Best effort.
    fn broadcast(&self, request: Envelope) -> usize {
        self.connected_peers()
            .iter()
            .filter(|peer| self.cast(peer, request.clone()).is_ok())
            .count()
    }
}

/// A shared in-process "network" of handlers for [`InMemoryTransport`].
#[derive(Default, Clone)]
pub struct InMemoryNetwork {
    nodes: Arc<Mutex<HashMap<NodeId, Arc<dyn ControlHandler>>>>,
}

impl InMemoryNetwork {
    pub fn new() -> Self {
        Self::default()
    }

    /// Attach `node` with its handler and return its transport.
    pub fn join(&self, node: NodeId, handler: Arc<dyn ControlHandler>) -> InMemoryTransport {
        self.lock().insert(node.clone(), handler);
        InMemoryTransport {
            me: node,
            network: self.clone(),
            peers: Arc::default(),
        }
    }

    /// Detach `node` (simulates a crash or partition): calls to it fail `NotConnected`.
    pub fn leave(&self, node: &NodeId) {
        self.lock().remove(node);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, Arc<dyn ControlHandler>>> {
        self.nodes
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    fn handler(&self, node: &NodeId) -> Option<Arc<dyn ControlHandler>> {
        self.lock().get(node).cloned()
    }
}

/// In-process transport: same codec and deadlines as the real one, no sockets.
#[derive(Clone)]
pub struct InMemoryTransport {
    me: NodeId,
    network: InMemoryNetwork,
    peers: Arc<Mutex<HashMap<NodeId, SocketAddr>>>,
}

impl InMemoryTransport {
    fn is_listed(&self, peer: &NodeId) -> bool {
        *peer == self.me
            || self
                .peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(peer)
    }
}

/// Round-trip a request through the codec into `handler`, as a remote peer would.
pub(crate) async fn serve_bytes(handler: &dyn ControlHandler, bytes: &[u8]) -> Vec<u8> {
    let reply = match envelope::decode_request(bytes) {
        Ok(request) => handler.handle(request).await,
        Err(error) => bad_request(&error),
    };
    envelope::encode_reply(&reply).unwrap_or_else(|error| {
        envelope::encode_reply(&Reply::Error {
            code: envelope::ReplyErrorCode::Internal,
            message: format!("reply not encodable: {error}"),
        })
        .unwrap_or_default()
    })
}

pub(crate) fn bad_request(error: &EnvelopeError) -> Reply {
    Reply::Error {
        code: envelope::ReplyErrorCode::BadRequest,
        message: error.to_string(),
    }
}

impl ControlTransport for InMemoryTransport {
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
            if !self.is_listed(peer) {
                return Err(ControlError::UnknownPeer(peer.clone()));
            }
            let bytes = envelope::encode_request(&request).map_err(ControlError::Encode)?;
            let handler = self
                .network
                .handler(peer)
                .ok_or_else(|| ControlError::NotConnected(peer.clone()))?;
            let reply = tokio::time::timeout(timeout, serve_bytes(handler.as_ref(), &bytes))
                .await
                .map_err(|_| ControlError::Timeout {
                    peer: peer.clone(),
                    after: timeout,
                })?;
            envelope::decode_reply(&reply).map_err(|error| ControlError::Decode {
                peer: peer.clone(),
                error,
            })
        })
    }

    fn cast(&self, peer: &NodeId, request: Envelope) -> Result<(), ControlError> {
        if !self.is_listed(peer) {
            return Err(ControlError::UnknownPeer(peer.clone()));
        }
        let bytes = envelope::encode_request(&request).map_err(ControlError::Encode)?;
        let handler = self
            .network
            .handler(peer)
            .ok_or_else(|| ControlError::NotConnected(peer.clone()))?;
        tokio::spawn(async move {
            let _ = serve_bytes(handler.as_ref(), &bytes).await;
        });
        Ok(())
    }

    fn set_peers(&self, peers: Vec<(NodeId, SocketAddr)>) {
        let mut map = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        *map = peers.into_iter().filter(|(id, _)| *id != self.me).collect();
    }

    fn connected_peers(&self) -> Vec<NodeId> {
        let listed = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<_> = listed
            .keys()
            .filter(|id| self.network.handler(id).is_some())
            .cloned()
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::envelope::{OwnerReply, ReplyErrorCode, SessionRequest};

    fn owner_of(node: &str) -> Arc<dyn ControlHandler> {
        let node = NodeId::parse(node).unwrap();
        Arc::new(FnHandler(move |request| match request {
            Envelope::ActivateSession(req) | Envelope::ResolveSession(req) => {
                Reply::Owner(OwnerReply {
                    owner: node.clone(),
                    owner_internal_addr: "127.0.0.1:9".parse().unwrap(),
                    shard_epoch: req.epoch,
                    hot_state: None,
                })
            }
            _ => Reply::Ack,
        }))
    }

    fn req() -> Envelope {
        Envelope::ActivateSession(SessionRequest {
            tenant: crate::ids::TenantId::new_random(),
            session: crate::ids::SessionId::new_random(),
            shard: 1,
            epoch: 4,
        })
    }

    #[tokio::test]
    async fn calls_reach_the_peer_handler_through_the_codec() {
        let net = InMemoryNetwork::new();
        let a = net.join(NodeId::parse("a").unwrap(), owner_of("a"));
        let _b = net.join(NodeId::parse("b").unwrap(), owner_of("b"));
        a.set_peers(vec![(
            NodeId::parse("b").unwrap(),
            "127.0.0.1:1".parse().unwrap(),
        )]);
        let reply = a
            .call(&NodeId::parse("b").unwrap(), req(), Duration::from_secs(1))
            .await
            .unwrap();
        match reply {
            Reply::Owner(owner) => {
                assert_eq!(owner.owner.as_str(), "b");
                assert_eq!(owner.shard_epoch, 4);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(a.connected_peers(), vec![NodeId::parse("b").unwrap()]);
    }

    #[tokio::test]
    async fn unknown_departed_and_slow_peers_are_typed_errors() {
        let net = InMemoryNetwork::new();
        let a = net.join(NodeId::parse("a").unwrap(), owner_of("a"));
        let b = NodeId::parse("b").unwrap();
        assert_eq!(
            a.call(&b, req(), Duration::from_secs(1)).await,
            Err(ControlError::UnknownPeer(b.clone()))
        );
        a.set_peers(vec![(b.clone(), "127.0.0.1:1".parse().unwrap())]);
        assert_eq!(
            a.call(&b, req(), Duration::from_secs(1)).await,
            Err(ControlError::NotConnected(b.clone()))
        );

        struct Never;
        impl ControlHandler for Never {
            fn handle(&self, _: Envelope) -> BoxFuture<'_, Reply> {
                Box::pin(std::future::pending())
            }
        }
        let _b = net.join(b.clone(), Arc::new(Never));
        let err = a
            .call(&b, req(), Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(err, ControlError::Timeout { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn malformed_bytes_get_a_bad_request_reply() {
        let handler = owner_of("a");
        let reply = serve_bytes(handler.as_ref(), b"\xc1garbage").await;
        match envelope::decode_reply(&reply).unwrap() {
            Reply::Error { code, .. } => assert_eq!(code, ReplyErrorCode::BadRequest),
            other => panic!("unexpected {other:?}"),
        }
    }
}
