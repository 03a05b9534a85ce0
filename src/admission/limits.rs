//! Cluster-wide admission limits (pure): the five ceilings every node of a cell enforces,
//! stored in the cell's policy hash in Redis (`svc:b`, `svc:c`, `t:b`, `t:c`, `b:c`).
//!
//! The first script call that finds them absent stores the calling node's configured
//! values (`lua/admission.lua`, `bootstrap_limits`), atomically with that call; from then
//! on every node's acquire uses the stored values, whatever its own file says (ADM-12).
//! An operator changes them through `PUT /v1/admin/admission/limits`. This module
//! compares a node's file with the stored values (for the start-up warning) and checks an
//! update before it is sent.

use serde::{Deserialize, Serialize};

use super::config::{MAX_BYTES, MAX_TRANSFERS, RedisAdmissionConfig};
use crate::storage::redis::reply::StoredLimits;
use crate::values::ByteSize;

/// The dotted config keys of the five limits, in the stored order.
pub const KEYS: [&str; 5] = [
    "admission.redis.service_bytes",
    "admission.redis.service_transfers",
    "admission.redis.tenant_bytes",
    "admission.redis.tenant_transfers",
    "admission.redis.backend_transfers",
];

/// A change of the cluster-wide limits (admin API body); absent fields stay unchanged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_bytes: Option<ByteSize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_transfers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_bytes: Option<ByteSize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_transfers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_transfers: Option<u32>,
}

impl LimitsUpdate {
    /// The five values in the stored order (`None` = unchanged).
    pub fn values(&self) -> [Option<u64>; 5] {
        [
            self.service_bytes.map(ByteSize::bytes),
            self.service_transfers.map(u64::from),
            self.tenant_bytes.map(ByteSize::bytes),
            self.tenant_transfers.map(u64::from),
            self.backend_transfers.map(u64::from),
        ]
    }
}

/// A limit whose value in this node's file differs from the cluster's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disagreement {
    pub key: &'static str,
    pub file: u64,
    pub cluster: u64,
}

/// The stored values in order (`None` where absent).
pub fn stored_values(stored: &StoredLimits) -> [Option<u64>; 5] {
    [
        stored.service_bytes,
        stored.service_transfers,
        stored.tenant_bytes,
        stored.tenant_transfers,
        stored.backend_transfers,
    ]
}

/// The file's five limits in the stored order.
pub fn file_values(file: &RedisAdmissionConfig) -> [u64; 5] {
    [
        file.service_bytes.bytes(),
        u64::from(file.service_transfers),
        file.tenant_bytes.bytes(),
        u64::from(file.tenant_transfers),
        u64::from(file.backend_transfers),
    ]
}

/// Every limit where the file and the stored cluster value differ.
pub fn disagreements(file: &RedisAdmissionConfig, stored: &StoredLimits) -> Vec<Disagreement> {
    file_values(file)
        .into_iter()
        .zip(stored_values(stored))
        .zip(KEYS)
        .filter_map(|((file, cluster), key)| match cluster {
            Some(cluster) if cluster != file => Some(Disagreement { key, file, cluster }),
            _ => None,
        })
        .collect()
}

/// Check `update` applied over `current` (the stored values, the file's where absent):
/// ranges, and tenant and backend limits within the service's.
pub fn check(current: [u64; 5], update: &LimitsUpdate) -> Result<[u64; 5], &'static str> {
    let values = update.values();
    if values.iter().all(Option::is_none) {
        return Err(
            "set at least one of service_bytes, service_transfers, tenant_bytes, tenant_transfers, backend_transfers",
        );
    }
    let mut merged = current;
    for (slot, value) in merged.iter_mut().zip(values) {
        if let Some(value) = value {
            *slot = value;
        }
    }
    let [
        service_bytes,
        service_transfers,
        tenant_bytes,
        tenant_transfers,
        backend_transfers,
    ] = merged;
    if [service_bytes, tenant_bytes]
        .iter()
        .any(|&b| b == 0 || b > MAX_BYTES)
    {
        return Err("byte limits must be between 1B and 1024TiB");
    }
    if [service_transfers, tenant_transfers, backend_transfers]
        .iter()
        .any(|&c| c == 0 || c > u64::from(MAX_TRANSFERS))
    {
        return Err("transfer limits must be between 1 and 1000000");
    }
    if tenant_bytes > service_bytes
        || tenant_transfers > service_transfers
        || backend_transfers > service_transfers
    {
        return Err("tenant and backend limits must not exceed the service limits");
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(values: [Option<u64>; 5]) -> StoredLimits {
        StoredLimits {
            policy_version: 1,
            service_bytes: values[0],
            service_transfers: values[1],
            tenant_bytes: values[2],
            tenant_transfers: values[3],
            backend_transfers: values[4],
        }
    }

    #[test]
    fn disagreements_name_the_keys_that_differ() {
        let file = RedisAdmissionConfig::default();
        let mut same = file_values(&file).map(Some);
        assert!(disagreements(&file, &stored(same)).is_empty());
        same[1] = Some(4);
        same[4] = None;
        assert_eq!(
            disagreements(&file, &stored(same)),
            [Disagreement {
                key: "admission.redis.service_transfers",
                file: 256,
                cluster: 4
            }]
        );
    }

    #[test]
    fn updates_are_checked_against_the_merged_limits() {
        let current = [1 << 30, 8, 1 << 20, 4, 8];
        let raise = LimitsUpdate {
            service_transfers: Some(16),
            ..LimitsUpdate::default()
        };
        assert_eq!(check(current, &raise), Ok([1 << 30, 16, 1 << 20, 4, 8]));
        let too_low = LimitsUpdate {
            service_transfers: Some(2),
            ..LimitsUpdate::default()
        };
        assert!(check(current, &too_low).is_err());
        assert!(check(current, &LimitsUpdate::default()).is_err());
        let zero = LimitsUpdate {
            tenant_transfers: Some(0),
            ..LimitsUpdate::default()
        };
        assert!(check(current, &zero).is_err());
    }
}
