//! Typed views of the replies of `lua/admission.lua`, the lease id and the fencing token.
//!
//! Every script reply is an array of bulk strings whose first element names the outcome;
//! integers are written by the script with `%d`, so they parse as `u64`/`i64` exactly.
//! Anything unexpected becomes [`ReplyError`] (a protocol error, surfaced as 503).

use std::fmt;
use std::time::Duration;

/// A cluster dimension, in the order the script checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dimension {
    ServiceBytes,
    ServiceTransfers,
    TenantBytes,
    TenantTransfers,
    BackendTransfers,
    /// Local process byte pool (never produced by the script).
    ProcessBytes,
}

impl Dimension {
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::ServiceBytes => "service_bytes",
            Dimension::ServiceTransfers => "service_transfers",
            Dimension::TenantBytes => "tenant_bytes",
            Dimension::TenantTransfers => "tenant_transfers",
            Dimension::BackendTransfers => "backend_transfers",
            Dimension::ProcessBytes => "process_bytes",
        }
    }

    fn parse(text: &str) -> Result<Self, ReplyError> {
        Ok(match text {
            "service_bytes" => Dimension::ServiceBytes,
            "service_transfers" => Dimension::ServiceTransfers,
            "tenant_bytes" => Dimension::TenantBytes,
            "tenant_transfers" => Dimension::TenantTransfers,
            "backend_transfers" => Dimension::BackendTransfers,
            _ => return Err(ReplyError::new("unknown dimension")),
        })
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Cluster occupancy seen by one script call. Tenant values are `None` without a tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Occupancy {
    pub service_bytes: u64,
    pub service_transfers: u64,
    pub tenant_bytes: Option<u64>,
    pub tenant_transfers: Option<u64>,
    pub backend_transfers: u64,
}

/// The token issued with a lease: strictly increasing per cell. Deliberately neither
/// `Clone` nor `Copy` and only built by reply parsing, so the lease holder is the one
/// place that can present it to `renew`/`release`; others may read its value.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FencingToken(u64);

impl FencingToken {
    pub fn value(&self) -> u64 {
        self.0
    }

    /// A second handle on the same token, for the lease facts a permit exposes
    /// (`admission::LeaseInfo`); only the holder presents its own to the coordinator.
    pub(crate) fn duplicate(&self) -> Self {
        Self(self.0)
    }

    /// For in-memory test doubles of the coordinator only.
    #[doc(hidden)]
    pub fn for_test(value: u64) -> Self {
        Self(value)
    }
}

/// The id of one cluster lease: a random UUID chosen once per transfer and reused on every
/// acquire attempt (acquire is idempotent on it). It names the lease in Redis, events and
/// logs; it carries nothing about the tenant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LeaseId(String);

impl LeaseId {
    /// A fresh random (v4) id, from the thread-local generator (`Uuid::new_v4` would make
    /// a `getrandom` system call per id).
    pub fn random() -> Self {
        let id = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
        Self(id.hyphenated().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A malformed or unexpected script reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unexpected admission script reply: {0}")]
pub struct ReplyError(String);

impl ReplyError {
    pub fn new(what: impl Into<String>) -> Self {
        Self(what.into())
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum AcquireReply {
    Admitted {
        token: FencingToken,
        expires_at_ms: u64,
        policy_version: u64,
        occupancy: Occupancy,
    },
    Rejected {
        dimension: Dimension,
        policy_version: u64,
        occupancy: Occupancy,
    },
    /// The footprint exceeds a ceiling outright; waiting cannot help.
    NeverFits {
        dimension: Dimension,
        policy_version: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewReply {
    Renewed {
        expires_at_ms: u64,
    },
    /// No such lease (released or reaped).
    Lost,
    /// The lease exists with another token.
    Stale,
    /// The lease is past its expiry; the script reaped it instead of renewing.
    Expired,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReply {
    Released,
    Missing,
    Stale,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotReply {
    pub occupancy: Occupancy,
    pub policy_version: u64,
    pub server_time_ms: u64,
    pub waiters: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChargeReply {
    Charged { total: u64 },
    Rejected { limit: u64, retry_after: Duration },
}

fn head<'a>(
    reply: &'a [String],
    status: &str,
    len: usize,
) -> Result<Option<&'a [String]>, ReplyError> {
    match reply.first() {
        Some(first) if first == status => {
            if reply.len() == len {
                Ok(Some(&reply[1..]))
            } else {
                Err(ReplyError::new(format!(
                    "{status} with {} fields",
                    reply.len()
                )))
            }
        }
        _ => Ok(None),
    }
}

fn unexpected(reply: &[String]) -> ReplyError {
    match reply {
        [status, reason] if status == "PROTOCOL" => ReplyError::new(format!("protocol: {reason}")),
        [status, ..] => ReplyError::new(format!("status {status:?}")),
        [] => ReplyError::new("empty reply"),
    }
}

fn int(text: &str) -> Result<u64, ReplyError> {
    text.parse()
        .map_err(|_| ReplyError::new("not an unsigned integer"))
}

fn opt_int(text: &str) -> Result<Option<u64>, ReplyError> {
    if text == "-1" {
        Ok(None)
    } else {
        int(text).map(Some)
    }
}

fn occupancy(f: &[String]) -> Result<Occupancy, ReplyError> {
    Ok(Occupancy {
        service_bytes: int(&f[0])?,
        service_transfers: int(&f[1])?,
        tenant_bytes: opt_int(&f[2])?,
        tenant_transfers: opt_int(&f[3])?,
        backend_transfers: int(&f[4])?,
    })
}

pub fn parse_acquire(reply: &[String]) -> Result<AcquireReply, ReplyError> {
    if let Some(f) = head(reply, "ADMITTED", 9)? {
        let token = int(&f[0])?;
        if token == 0 {
            return Err(ReplyError::new("zero fencing token"));
        }
        return Ok(AcquireReply::Admitted {
            token: FencingToken(token),
            expires_at_ms: int(&f[1])?,
            policy_version: int(&f[2])?,
            occupancy: occupancy(&f[3..8])?,
        });
    }
    if let Some(f) = head(reply, "REJECTED", 8)? {
        return Ok(AcquireReply::Rejected {
            dimension: Dimension::parse(&f[0])?,
            policy_version: int(&f[1])?,
            occupancy: occupancy(&f[2..7])?,
        });
    }
    if let Some(f) = head(reply, "NEVER", 3)? {
        return Ok(AcquireReply::NeverFits {
            dimension: Dimension::parse(&f[0])?,
            policy_version: int(&f[1])?,
        });
    }
    Err(unexpected(reply))
}

pub fn parse_renew(reply: &[String]) -> Result<RenewReply, ReplyError> {
    if let Some(f) = head(reply, "RENEWED", 2)? {
        return Ok(RenewReply::Renewed {
            expires_at_ms: int(&f[0])?,
        });
    }
    for (status, value) in [
        ("LOST", RenewReply::Lost),
        ("STALE", RenewReply::Stale),
        ("EXPIRED", RenewReply::Expired),
    ] {
        if head(reply, status, 1)?.is_some() {
            return Ok(value);
        }
    }
    Err(unexpected(reply))
}

pub fn parse_release(reply: &[String]) -> Result<ReleaseReply, ReplyError> {
    for (status, value) in [
        ("RELEASED", ReleaseReply::Released),
        ("MISSING", ReleaseReply::Missing),
        ("STALE", ReleaseReply::Stale),
    ] {
        if head(reply, status, 1)?.is_some() {
            return Ok(value);
        }
    }
    Err(unexpected(reply))
}

pub fn parse_snapshot(reply: &[String]) -> Result<SnapshotReply, ReplyError> {
    match head(reply, "SNAPSHOT", 9)? {
        Some(f) => Ok(SnapshotReply {
            occupancy: occupancy(&f[0..5])?,
            policy_version: int(&f[5])?,
            server_time_ms: int(&f[6])?,
            waiters: int(&f[7])?,
        }),
        None => Err(unexpected(reply)),
    }
}

/// `POLICY|<version>`.
pub fn parse_policy(reply: &[String]) -> Result<u64, ReplyError> {
    match head(reply, "POLICY", 2)? {
        Some(f) => int(&f[0]),
        None => Err(unexpected(reply)),
    }
}

/// The cluster-wide limits stored in the cell (`LIMITS` reply), in the order of
/// [`super::coordinator::Limits`]; `None` where none is stored yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct StoredLimits {
    pub policy_version: u64,
    pub service_bytes: Option<u64>,
    pub service_transfers: Option<u64>,
    pub tenant_bytes: Option<u64>,
    pub tenant_transfers: Option<u64>,
    pub backend_transfers: Option<u64>,
}

pub fn parse_limits(reply: &[String]) -> Result<StoredLimits, ReplyError> {
    let stored = |text: &str| {
        if text == "-" {
            Ok(None)
        } else {
            int(text).map(Some)
        }
    };
    match head(reply, "LIMITS", 7)? {
        Some(f) => Ok(StoredLimits {
            policy_version: int(&f[0])?,
            service_bytes: stored(&f[1])?,
            service_transfers: stored(&f[2])?,
            tenant_bytes: stored(&f[3])?,
            tenant_transfers: stored(&f[4])?,
            backend_transfers: stored(&f[5])?,
        }),
        None => Err(unexpected(reply)),
    }
}

/// `REAPED|<count>` and `ABANDONED|<0|1>` both carry one count.
pub fn parse_count(reply: &[String], status: &str) -> Result<u64, ReplyError> {
    match head(reply, status, 2)? {
        Some(f) => int(&f[0]),
        None => Err(unexpected(reply)),
    }
}

pub fn parse_charge(reply: &[String]) -> Result<ChargeReply, ReplyError> {
    if let Some(f) = head(reply, "CHARGED", 2)? {
        return Ok(ChargeReply::Charged { total: int(&f[0])? });
    }
    if let Some(f) = head(reply, "QUOTA", 3)? {
        return Ok(ChargeReply::Rejected {
            limit: int(&f[0])?,
            retry_after: Duration::from_millis(int(&f[1])?.max(1)),
        });
    }
    Err(unexpected(reply))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_lease_ids_are_distinct_version_4_uuids() {
        let (a, b) = (LeaseId::random(), LeaseId::random());
        assert_ne!(a, b);
        let parsed = uuid::Uuid::parse_str(a.as_str()).unwrap();
        assert_eq!(parsed.get_version_num(), 4);
        assert_eq!(parsed.get_variant(), uuid::Variant::RFC4122);
        assert_eq!(a.as_str(), parsed.hyphenated().to_string());
    }
    use proptest::prelude::*;

    fn r(text: &str) -> Vec<String> {
        text.split('|').map(str::to_string).collect()
    }

    #[test]
    fn acquire_replies_parse() {
        assert_eq!(
            parse_acquire(&r("ADMITTED|7|1700000030000|2|512|1|512|1|1")).unwrap(),
            AcquireReply::Admitted {
                token: FencingToken(7),
                expires_at_ms: 1_700_000_030_000,
                policy_version: 2,
                occupancy: Occupancy {
                    service_bytes: 512,
                    service_transfers: 1,
                    tenant_bytes: Some(512),
                    tenant_transfers: Some(1),
                    backend_transfers: 1
                }
            }
        );
        assert_eq!(
            parse_acquire(&r("REJECTED|tenant_transfers|0|512|1|-1|-1|1")).unwrap(),
            AcquireReply::Rejected {
                dimension: Dimension::TenantTransfers,
                policy_version: 0,
                occupancy: Occupancy {
                    service_bytes: 512,
                    service_transfers: 1,
                    tenant_bytes: None,
                    tenant_transfers: None,
                    backend_transfers: 1
                }
            }
        );
        assert_eq!(
            parse_acquire(&r("NEVER|tenant_bytes|3")).unwrap(),
            AcquireReply::NeverFits {
                dimension: Dimension::TenantBytes,
                policy_version: 3
            }
        );
    }

    #[test]
    fn malformed_replies_are_errors() {
        for bad in [
            "ADMITTED|0|1|0|0|0|0|0|0",
            "ADMITTED|1|2",
            "ADMITTED|1|1.7e+12|0|0|0|0|0|0",
            "REJECTED|nope|0|0|0|0|0|0",
            "PROTOCOL|unknown_op",
            "",
        ] {
            assert!(parse_acquire(&r(bad)).is_err(), "{bad}");
        }
        assert!(parse_acquire(&[]).is_err());
        assert!(parse_renew(&r("RENEWED")).is_err());
        assert!(parse_charge(&r("QUOTA|1")).is_err());
    }

    #[test]
    fn other_replies_parse() {
        assert_eq!(
            parse_renew(&r("RENEWED|5")).unwrap(),
            RenewReply::Renewed { expires_at_ms: 5 }
        );
        assert_eq!(parse_renew(&r("EXPIRED")).unwrap(), RenewReply::Expired);
        assert_eq!(parse_release(&r("STALE")).unwrap(), ReleaseReply::Stale);
        assert_eq!(parse_policy(&r("POLICY|4")).unwrap(), 4);
        assert_eq!(parse_count(&r("REAPED|2"), "REAPED").unwrap(), 2);
        assert_eq!(
            parse_charge(&r("QUOTA|10|0")).unwrap(),
            ChargeReply::Rejected {
                limit: 10,
                retry_after: Duration::from_millis(1)
            }
        );
        let snap = parse_snapshot(&r("SNAPSHOT|1|2|-1|-1|3|4|5|6")).unwrap();
        assert_eq!(snap.waiters, 6);
        assert_eq!(snap.occupancy.tenant_bytes, None);
    }

    proptest! {
        #[test]
        fn admitted_roundtrip(token in 1u64.., exp in any::<u64>(), v in any::<u64>(), sb in any::<u64>()) {
            let text = format!("ADMITTED|{token}|{exp}|{v}|{sb}|1|-1|-1|1");
            match parse_acquire(&r(&text)).unwrap() {
                AcquireReply::Admitted { token: t, expires_at_ms, policy_version, occupancy } => {
                    prop_assert_eq!(t.value(), token);
                    prop_assert_eq!(expires_at_ms, exp);
                    prop_assert_eq!(policy_version, v);
                    prop_assert_eq!(occupancy.service_bytes, sb);
                }
                other => prop_assert!(false, "{:?}", other),
            }
        }

        #[test]
        fn arbitrary_text_never_panics(parts in proptest::collection::vec("[A-Z_a-z0-9.-]{0,12}", 0..12)) {
            let _ = parse_acquire(&parts);
            let _ = parse_renew(&parts);
            let _ = parse_release(&parts);
            let _ = parse_snapshot(&parts);
            let _ = parse_charge(&parts);
        }
    }
}
