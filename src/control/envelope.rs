//! Control-plane envelopes: the versioned MessagePack messages nodes exchange.
//!
//! Pure: no I/O, no actors. Every message on the wire is a [`Frame`] `{v, msg}` encoded
//! with `rmp_serde::to_vec_named` (structs as maps with field names, so fields can be
//! added with `#[serde(default)]` without a version bump). `v` is the wire major version;
//! a peer refuses a frame whose `v` it does not know with [`EnvelopeError::UnsupportedVersion`].
//!
//! Failure model: [`decode_request`] / [`decode_reply`] never panic. Input is rejected
//! before parsing when it exceeds [`MAX_ENVELOPE_BYTES`]; parsing runs with a nesting
//! limit of [`MAX_DEPTH`]; trailing bytes after the frame are an error; decoded values
//! are re-validated (ids canonical, node id charset, addresses parse, counters sane).
//! Upload bytes never appear here: the hot-state snapshot is phase and counters only.

use std::io::Cursor;
use std::net::SocketAddr;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::{NodeId, SessionId, SessionKey, TenantId};

/// Wire major version written by this build.
pub const ENVELOPE_VERSION: u16 = 1;
/// Largest encoded frame accepted or produced (64 KiB).
pub const MAX_ENVELOPE_BYTES: usize = 64 * 1024;
/// Deepest nesting accepted while decoding.
pub const MAX_DEPTH: usize = 16;
/// Longest node id accepted in an envelope.
pub use crate::ids::MAX_NODE_ID_LEN;
/// Longest free-text error message carried in a reply.
pub const MAX_MESSAGE_LEN: usize = 1024;

/// Why an envelope could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("control envelope of {0} bytes exceeds the 64 KiB cap")]
    TooLarge(usize),
    #[error("control envelope is not valid MessagePack for this message: {0}")]
    Malformed(String),
    #[error("control envelope has {0} trailing bytes")]
    TrailingBytes(usize),
    #[error("control envelope version {0} is not supported (this node speaks {ENVELOPE_VERSION})")]
    UnsupportedVersion(u16),
    #[error("control envelope field {field} is invalid: {reason}")]
    Invalid {
        field: &'static str,
        reason: &'static str,
    },
}

/// The outer frame of every message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame<T> {
    /// Wire major version.
    pub v: u16,
    /// The message.
    pub msg: T,
}

/// A request for the owner of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRequest {
    pub tenant: TenantId,
    pub session: SessionId,
    /// Shard of the session as computed by the caller.
    pub shard: u32,
    /// Shard epoch the caller routed by.
    pub epoch: u64,
}

impl SessionRequest {
    pub fn key(&self) -> SessionKey {
        SessionKey {
            tenant: self.tenant,
            session: self.session,
        }
    }
}

/// A control request (the "envelope" a caller sends).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Envelope {
    /// Who owns this session? Read-only: does not create hot state.
    ResolveSession(SessionRequest),
    /// Who owns this session? The owner creates (or touches) the session's hot state.
    ActivateSession(SessionRequest),
    /// Hint: the assignment table changed; re-read PostgreSQL. Never authoritative.
    AssignmentChanged {
        /// Manager term that wrote the change.
        term: u64,
        /// Highest shard epoch after the change, if known.
        #[serde(default)]
        epoch_hint: Option<u64>,
    },
    /// Hint: this node is draining; stop routing new sessions to it.
    Drain { node: NodeId },
}

impl Envelope {
    /// Short stable name for logs and metrics (no ids).
    pub fn kind(&self) -> &'static str {
        match self {
            Envelope::ResolveSession(_) => "resolve_session",
            Envelope::ActivateSession(_) => "activate_session",
            Envelope::AssignmentChanged { .. } => "assignment_changed",
            Envelope::Drain { .. } => "drain",
        }
    }
}

/// Phase of an upload session's hot state (mirrors `session::Phase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionPhase {
    /// Known, no upload running.
    Idle,
    /// An upload is streaming into the owner.
    Receiving,
    /// A phase added by a newer node; tolerated so new phases need no version bump.
    #[serde(other)]
    Unknown,
}

/// Owner-side hot state of a session: phase and counters, never bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotStateSnapshot {
    pub phase: SessionPhase,
    pub bytes_seen: u64,
    #[serde(default)]
    pub frames_seen: u64,
    #[serde(default)]
    pub uploads_completed: u32,
    #[serde(default)]
    pub uploads_failed: u32,
    /// Unix milliseconds.
    pub started_at_ms: u64,
    /// Unix milliseconds; never before `started_at_ms`.
    pub last_activity_ms: u64,
}

/// Where a session lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerReply {
    pub owner: NodeId,
    /// The owner's internal listener (forwarded uploads go there).
    #[serde(with = "addr_as_string")]
    pub owner_internal_addr: SocketAddr,
    /// Current epoch of the session's shard.
    pub shard_epoch: u64,
    /// Hot state when the owner has any for the session.
    #[serde(default)]
    pub hot_state: Option<HotStateSnapshot>,
}

/// Typed refusal codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplyErrorCode {
    /// The responder does not own the shard (or the epoch is stale).
    NotOwner,
    /// The request could not be decoded or validated.
    BadRequest,
    /// The responder is shutting down or not ready.
    Unavailable,
    /// Anything else.
    Internal,
}

/// A control reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    Owner(OwnerReply),
    /// Accepted (hints and drains).
    Ack,
    Error {
        code: ReplyErrorCode,
        message: String,
    },
}

/// Encode a request frame, refusing output over the cap.
pub fn encode_request(msg: &Envelope) -> Result<Vec<u8>, EnvelopeError> {
    validate_request(msg)?;
    encode(msg)
}

/// Encode a reply frame, refusing output over the cap.
pub fn encode_reply(msg: &Reply) -> Result<Vec<u8>, EnvelopeError> {
    validate_reply(msg)?;
    encode(msg)
}

/// Decode and validate a request frame.
pub fn decode_request(buf: &[u8]) -> Result<Envelope, EnvelopeError> {
    let msg: Envelope = decode(buf)?;
    validate_request(&msg)?;
    Ok(msg)
}

/// Decode and validate a reply frame.
pub fn decode_reply(buf: &[u8]) -> Result<Reply, EnvelopeError> {
    let msg: Reply = decode(buf)?;
    validate_reply(&msg)?;
    Ok(msg)
}

fn encode<T: Serialize + Clone>(msg: &T) -> Result<Vec<u8>, EnvelopeError> {
    let frame = Frame {
        v: ENVELOPE_VERSION,
        msg,
    };
    let bytes =
        rmp_serde::to_vec_named(&frame).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
    if bytes.len() > MAX_ENVELOPE_BYTES {
        return Err(EnvelopeError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Only the version, so an unknown version is reported as such even when the body
/// shape changed.
#[derive(Deserialize)]
struct VersionOnly {
    v: u16,
}

fn decode<T: DeserializeOwned>(buf: &[u8]) -> Result<T, EnvelopeError> {
    if buf.len() > MAX_ENVELOPE_BYTES {
        return Err(EnvelopeError::TooLarge(buf.len()));
    }
    let version: VersionOnly = parse(buf, false)?;
    if version.v != ENVELOPE_VERSION {
        return Err(EnvelopeError::UnsupportedVersion(version.v));
    }
    let frame: Frame<T> = parse(buf, true)?;
    Ok(frame.msg)
}

fn parse<T: DeserializeOwned>(buf: &[u8], whole: bool) -> Result<T, EnvelopeError> {
    let mut de = rmp_serde::Deserializer::new(Cursor::new(buf));
    de.set_max_depth(MAX_DEPTH);
    let value = T::deserialize(&mut de).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
    let used = usize::try_from(de.position()).unwrap_or(usize::MAX);
    if whole && used != buf.len() {
        return Err(EnvelopeError::TrailingBytes(buf.len().saturating_sub(used)));
    }
    Ok(value)
}

fn invalid(field: &'static str, reason: &'static str) -> EnvelopeError {
    EnvelopeError::Invalid { field, reason }
}

fn validate_request(msg: &Envelope) -> Result<(), EnvelopeError> {
    match msg {
        Envelope::ResolveSession(_) | Envelope::ActivateSession(_) => Ok(()),
        Envelope::AssignmentChanged { .. } => Ok(()),
        // Node ids are valid by construction (`NodeId::parse`, also when decoded).
        Envelope::Drain { .. } => Ok(()),
    }
}

fn validate_reply(msg: &Reply) -> Result<(), EnvelopeError> {
    match msg {
        Reply::Owner(owner) => {
            if owner.owner_internal_addr.port() == 0 {
                return Err(invalid("owner_internal_addr", "port must not be 0"));
            }
            if let Some(hot) = &owner.hot_state
                && hot.last_activity_ms < hot.started_at_ms
            {
                return Err(invalid("hot_state", "last activity before start"));
            }
            Ok(())
        }
        Reply::Ack => Ok(()),
        Reply::Error { message, .. } => {
            if message.len() > MAX_MESSAGE_LEN {
                return Err(invalid("message", "longer than 1024 bytes"));
            }
            Ok(())
        }
    }
}

mod addr_as_string {
    use std::net::SocketAddr;

    use serde::{Deserialize, Deserializer, Serializer, de};

    pub fn serialize<S: Serializer>(addr: &SocketAddr, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(addr)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|_| de::Error::custom("not a socket address"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn request() -> SessionRequest {
        SessionRequest {
            tenant: "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f".parse().unwrap(),
            session: "6ba7b810-9dad-11d1-80b4-00c04fd430c8".parse().unwrap(),
            shard: 17,
            epoch: 3,
        }
    }

    fn owner_reply() -> Reply {
        Reply::Owner(OwnerReply {
            owner: NodeId::parse("node-b").unwrap(),
            owner_internal_addr: "127.0.0.1:7071".parse().unwrap(),
            shard_epoch: 3,
            hot_state: Some(HotStateSnapshot {
                phase: SessionPhase::Receiving,
                bytes_seen: 10,
                frames_seen: 1,
                uploads_completed: 0,
                uploads_failed: 0,
                started_at_ms: 5,
                last_activity_ms: 6,
            }),
        })
    }

    #[test]
    fn frames_carry_version_and_named_fields() {
        let bytes = encode_request(&Envelope::ActivateSession(request())).unwrap();
        let value: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        let text = format!("{value:?}");
        assert!(text.contains("\"v\""), "{text}");
        assert!(text.contains("activate_session"), "{text}");
        assert!(text.contains("epoch"), "{text}");
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = encode_reply(&Reply::Ack).unwrap();
        bytes.push(0xc0);
        assert_eq!(decode_reply(&bytes), Err(EnvelopeError::TrailingBytes(1)));
    }

    #[test]
    fn oversized_input_is_rejected_before_parsing() {
        let bytes = vec![0xc1; MAX_ENVELOPE_BYTES + 1];
        assert_eq!(
            decode_request(&bytes),
            Err(EnvelopeError::TooLarge(MAX_ENVELOPE_BYTES + 1))
        );
    }

    #[test]
    fn oversized_output_is_refused() {
        let reply = Reply::Error {
            code: ReplyErrorCode::Internal,
            message: "x".repeat(2000),
        };
        assert!(matches!(
            encode_reply(&reply),
            Err(EnvelopeError::Invalid { .. })
        ));
    }

    #[test]
    fn unknown_version_is_typed() {
        let frame = Frame {
            v: 9,
            msg: Reply::Ack,
        };
        let bytes = rmp_serde::to_vec_named(&frame).unwrap();
        assert_eq!(
            decode_reply(&bytes),
            Err(EnvelopeError::UnsupportedVersion(9))
        );
    }

    #[test]
    fn deep_nesting_is_rejected() {
        // 100 nested one-element arrays.
        let mut bytes = vec![0x91; 100];
        bytes.push(0x01);
        assert!(matches!(
            decode_request(&bytes),
            Err(EnvelopeError::Malformed(_))
        ));
    }

    #[test]
    fn non_canonical_ids_and_bad_node_ids_are_rejected() {
        #[derive(Serialize, Clone)]
        struct Raw<'a> {
            tenant: &'a str,
            session: &'a str,
            shard: u32,
            epoch: u64,
        }
        #[derive(Serialize, Clone)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum RawEnv<'a> {
            ResolveSession(Raw<'a>),
        }
        let raw = RawEnv::ResolveSession(Raw {
            tenant: "{0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f}",
            session: "6ba7b810-9dad-11d1-80b4-00c04fd430c8",
            shard: 1,
            epoch: 1,
        });
        let bytes = encode(&raw).unwrap();
        assert!(matches!(
            decode_request(&bytes),
            Err(EnvelopeError::Malformed(_))
        ));

        // A node id that breaks the rule does not decode.
        #[derive(Serialize, Clone)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum RawDrain<'a> {
            Drain { node: &'a str },
        }
        let bytes = encode(&RawDrain::Drain { node: "a b" }).unwrap();
        assert!(matches!(
            decode_request(&bytes),
            Err(EnvelopeError::Malformed(_))
        ));
    }

    #[test]
    fn replies_round_trip() {
        for reply in [
            owner_reply(),
            Reply::Ack,
            Reply::Error {
                code: ReplyErrorCode::NotOwner,
                message: "moved".into(),
            },
        ] {
            let bytes = encode_reply(&reply).unwrap();
            assert_eq!(decode_reply(&bytes).unwrap(), reply);
        }
    }

    fn arb_uuid_text() -> impl Strategy<Value = String> {
        any::<u128>()
            .prop_filter("non-nil", |v| *v != 0)
            .prop_map(|v| uuid::Uuid::from_u128(v).to_string())
    }

    fn arb_request() -> impl Strategy<Value = SessionRequest> {
        (arb_uuid_text(), arb_uuid_text(), any::<u32>(), any::<u64>()).prop_map(
            |(t, s, shard, epoch)| SessionRequest {
                tenant: t.parse().unwrap(),
                session: s.parse().unwrap(),
                shard,
                epoch,
            },
        )
    }

    fn arb_envelope() -> impl Strategy<Value = Envelope> {
        prop_oneof![
            arb_request().prop_map(Envelope::ResolveSession),
            arb_request().prop_map(Envelope::ActivateSession),
            (any::<u64>(), any::<Option<u64>>())
                .prop_map(|(term, epoch_hint)| Envelope::AssignmentChanged { term, epoch_hint }),
            "[A-Za-z0-9._-]{1,128}".prop_map(|n| Envelope::Drain {
                node: NodeId::parse(n).unwrap()
            }),
        ]
    }

    fn arb_reply() -> impl Strategy<Value = Reply> {
        let phase = prop_oneof![
            Just(SessionPhase::Idle),
            Just(SessionPhase::Receiving),
            Just(SessionPhase::Unknown)
        ];
        let hot = (
            phase,
            any::<u64>(),
            any::<u64>(),
            0u64..1 << 50,
            0u64..1 << 20,
            any::<(u32, u32)>(),
        )
            .prop_map(
                |(phase, bytes_seen, frames_seen, started_at_ms, delta, counts)| HotStateSnapshot {
                    phase,
                    bytes_seen,
                    frames_seen,
                    uploads_completed: counts.0,
                    uploads_failed: counts.1,
                    started_at_ms,
                    last_activity_ms: started_at_ms + delta,
                },
            );
        let owner = (
            "[A-Za-z0-9._-]{1,128}",
            (any::<std::net::IpAddr>(), 1u16..).prop_map(|(ip, port)| SocketAddr::new(ip, port)),
            any::<u64>(),
            proptest::option::of(hot),
        )
            .prop_map(|(owner, addr, shard_epoch, hot_state)| {
                Reply::Owner(OwnerReply {
                    owner: NodeId::parse(owner).unwrap(),
                    owner_internal_addr: addr,
                    shard_epoch,
                    hot_state,
                })
            });
        prop_oneof![
            owner,
            Just(Reply::Ack),
            ".{0,200}".prop_map(|m| Reply::Error {
                code: ReplyErrorCode::Unavailable,
                message: m
            }),
        ]
    }

    proptest! {
        #[test]
        fn envelopes_round_trip(msg in arb_envelope()) {
            let bytes = encode_request(&msg).unwrap();
            prop_assert!(bytes.len() <= MAX_ENVELOPE_BYTES);
            prop_assert_eq!(decode_request(&bytes).unwrap(), msg);
        }

        #[test]
        fn replies_round_trip_prop(msg in arb_reply()) {
            let bytes = encode_reply(&msg).unwrap();
            prop_assert_eq!(decode_reply(&bytes).unwrap(), msg);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
        }

        #[test]
        fn mutated_frames_never_panic(msg in arb_envelope(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
            let mut bytes = encode_request(&msg).unwrap();
            for (at, value) in flips {
                let len = bytes.len();
                bytes[at % len] = value;
            }
            let _ = decode_request(&bytes);
        }
    }
}
