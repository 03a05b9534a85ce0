//! Redis key names of one admission cell (pure).
//!
//! Every key starts with `<prefix>:{<cell>}:` so all of them hash to one Redis Cluster
//! slot and one script call may touch them together. Tenant and backend ids appear only
//! as keyed hashes (see [`super::hashing`]).

/// Which kind of traffic quota refused a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuotaKind {
    Requests,
    Egress,
}

impl QuotaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaKind::Requests => "request",
            QuotaKind::Egress => "egress",
        }
    }
}

/// The keys of one cell, in the order `lua/admission.lua` expects them as `KEYS[1..8]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellKeys {
    base: String,
    admission: [String; 8],
}

impl CellKeys {
    pub fn new(prefix: &str, cell: &str) -> Self {
        let base = format!("{prefix}:{{{cell}}}");
        let admission = [
            "counts",
            "expirations",
            "leases",
            "fence",
            "policy",
            "events",
            "waiters",
            "waiting",
        ]
        .map(|name| format!("{base}:admission:{name}"));
        Self { base, admission }
    }

    /// `KEYS[1..8]` of every script call.
    pub fn admission(&self) -> &[String; 8] {
        &self.admission
    }

    pub fn events(&self) -> &str {
        &self.admission[5]
    }

    pub fn counts(&self) -> &str {
        &self.admission[0]
    }

    /// `KEYS[9]` of a traffic charge: `<prefix>:{<cell>}:traffic:<kind>:<tenant hash>`.
    pub fn traffic(&self, kind: QuotaKind, tenant_hash: &str) -> String {
        format!("{}:traffic:{}:{tenant_hash}", self.base, kind.as_str())
    }

    /// Pattern matching every key of the cell (tests and operators).
    pub fn pattern(&self) -> String {
        format!("{}:*", self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_one_hash_tag() {
        let keys = CellKeys::new("graviton", "eu-1");
        assert_eq!(keys.admission()[0], "graviton:{eu-1}:admission:counts");
        assert_eq!(keys.events(), "graviton:{eu-1}:admission:events");
        assert_eq!(
            keys.traffic(QuotaKind::Egress, "ab"),
            "graviton:{eu-1}:traffic:egress:ab"
        );
        for key in keys.admission() {
            assert!(key.starts_with("graviton:{eu-1}:"), "{key}");
        }
    }
}
