//! Identifier newtypes shared across the crate.
//!
//! Tenant and upload-session ids arrive in HTTP headers as canonical UUIDs (the
//! 36-character hyphenated form, any RFC 9562 version). They are held as parsed values
//! and formatted lowercase. Tenant ids are sensitive: never put them raw into logs above
//! debug, metric labels, Redis keys or events (see `admission` for the keyed hash).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Why an id did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("must be a canonical UUID (8-4-4-4-12 hexadecimal digits)")]
    NotCanonicalUuid,
    #[error("the nil UUID is not a valid identifier")]
    Nil,
}

/// Parse the canonical hyphenated UUID form only: no braces, no `urn:uuid:`, no simple form.
fn parse_canonical_uuid(text: &str) -> Result<Uuid, IdError> {
    let bytes = text.as_bytes();
    if bytes.len() != 36 {
        return Err(IdError::NotCanonicalUuid);
    }
    for (i, b) in bytes.iter().enumerate() {
        let hyphen = matches!(i, 8 | 13 | 18 | 23);
        if hyphen != (*b == b'-') || (!hyphen && !b.is_ascii_hexdigit()) {
            return Err(IdError::NotCanonicalUuid);
        }
    }
    let uuid = Uuid::try_parse(text).map_err(|_| IdError::NotCanonicalUuid)?;
    if uuid.is_nil() {
        return Err(IdError::Nil);
    }
    Ok(uuid)
}

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(Uuid);

        impl $name {
            pub fn new_random() -> Self {
                Self(Uuid::new_v4())
            }
            pub fn as_uuid(&self) -> &Uuid {
                &self.0
            }
            pub fn as_bytes(&self) -> &[u8; 16] {
                self.0.as_bytes()
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(text: &str) -> Result<Self, IdError> {
                parse_canonical_uuid(text).map(Self)
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(text: String) -> Result<Self, IdError> {
                text.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.hyphenated().to_string()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0.hyphenated(), f)
            }
        }
    };
}

uuid_id!(
    /// A tenant. `Debug` hides the value, so a stray `{:?}` cannot leak it into logs.
    TenantId
);
uuid_id!(
    /// An upload session within a tenant.
    SessionId
);

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TenantId(..)")
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionId({})", self.0.hyphenated())
    }
}

/// The `(tenant, session)` pair that has exactly one owner node at a time.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub struct SessionKey {
    pub tenant: TenantId,
    pub session: SessionId,
}

/// Longest node id, in bytes.
pub const MAX_NODE_ID_LEN: usize = 128;

/// Why a node id did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeIdError {
    #[error("must be 1 to {MAX_NODE_ID_LEN} characters")]
    Length,
    #[error("only ASCII letters, digits, '-', '_' and '.' are allowed")]
    Character,
}

/// A node of the cluster (`node.id` in the config): 1 to 128 ASCII letters, digits,
/// '-', '_' and '.'. Only [`NodeId::parse`] makes one, so every `NodeId` in the process
/// (from the config, a PostgreSQL row, a control message or a header) obeys the rule.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct NodeId(String);

impl NodeId {
    pub fn parse(text: impl Into<String>) -> Result<Self, NodeIdError> {
        let text = text.into();
        if text.is_empty() || text.len() > MAX_NODE_ID_LEN {
            return Err(NodeIdError::Length);
        }
        if !text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(NodeIdError::Character);
        }
        Ok(Self(text))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for NodeId {
    type Err = NodeIdError;
    fn from_str(text: &str) -> Result<Self, NodeIdError> {
        Self::parse(text)
    }
}

impl TryFrom<String> for NodeId {
    type Error = NodeIdError;
    fn try_from(text: String) -> Result<Self, NodeIdError> {
        Self::parse(text)
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> String {
        id.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_follow_one_rule_when_parsed_and_deserialized() {
        assert_eq!(NodeId::parse("node-a_1.x").unwrap().as_str(), "node-a_1.x");
        assert_eq!(NodeId::parse(""), Err(NodeIdError::Length));
        assert_eq!(NodeId::parse("n".repeat(129)), Err(NodeIdError::Length));
        assert!(NodeId::parse("n".repeat(128)).is_ok());
        for bad in ["a b", "a/b", "é", "a\n"] {
            assert_eq!(NodeId::parse(bad), Err(NodeIdError::Character), "{bad}");
        }
        assert!(serde_json::from_str::<NodeId>("\"a b\"").is_err());
        let id: NodeId = serde_json::from_str("\"node-b\"").unwrap();
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"node-b\"");
    }

    #[test]
    fn canonical_uuids_of_any_version_parse() {
        for text in [
            "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f", // v4
            "01890a5d-ac96-774b-bcce-b302099a8057", // v7
            "6ba7b810-9dad-11d1-80b4-00c04fd430c8", // v1
            "6BA7B810-9DAD-11D1-80B4-00C04FD430C8", // upper case
        ] {
            let id: SessionId = text.parse().unwrap();
            assert_eq!(id.to_string(), text.to_lowercase());
        }
    }

    #[test]
    fn non_canonical_forms_are_rejected() {
        for text in [
            "",
            "0b4e7a1c9a8e4f5e8d8f2c3b4a5d6e7f",
            "{0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f}",
            "urn:uuid:0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f",
            "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7g",
            "0b4e7a1c-9a8e-4f5e-8d8f2-c3b4a5d6e7f",
            " 0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f",
        ] {
            assert_eq!(
                text.parse::<TenantId>(),
                Err(IdError::NotCanonicalUuid),
                "{text:?}"
            );
        }
        assert_eq!(
            "00000000-0000-0000-0000-000000000000".parse::<TenantId>(),
            Err(IdError::Nil)
        );
    }

    #[test]
    fn tenant_debug_does_not_leak() {
        let tenant: TenantId = "0b4e7a1c-9a8e-4f5e-8d8f-2c3b4a5d6e7f".parse().unwrap();
        assert!(!format!("{tenant:?}").contains("0b4e7a1c"));
    }
}
