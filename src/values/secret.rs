//! A string secret (tokens, passwords) that never prints.

use std::fmt;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A secret read from configuration. `Debug`, `Display` and `Serialize` all show
/// `[redacted]`; only [`Secret::expose`] returns the value, at the point of use.
#[derive(Clone)]
pub struct Secret(SecretString);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(SecretString::from(value.into()))
    }

    /// The secret's value. Call it only where the value is used (an HTTP header compare, a
    /// connection handshake), never to log or format.
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }

    /// Comparison against a presented value that leaks neither the secret's bytes nor its
    /// length: both sides are hashed (BLAKE3; the time depends only on the presented
    /// length, which the caller knows) and the digests compared in constant time
    /// (`blake3::Hash`'s `PartialEq`).
    pub fn matches(&self, presented: &[u8]) -> bool {
        blake3::hash(self.expose().as_bytes()) == blake3::hash(presented)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("[redacted]")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_never_prints_its_value() {
        let secret = Secret::new("hunter2-very-secret");
        assert_eq!(format!("{secret:?}"), "[redacted]");
        assert_eq!(format!("{secret}"), "[redacted]");
        assert_eq!(serde_json::to_string(&secret).unwrap(), "\"[redacted]\"");
        assert!(secret.matches(b"hunter2-very-secret"));
        assert!(!secret.matches(b"hunter2-very-secreT"));
        assert!(!secret.matches(b"short"));
    }
}
