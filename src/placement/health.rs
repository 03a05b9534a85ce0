//! Readiness of a node as a pure state machine.
//!
//! | status | ready | when |
//! |---|---|---|
//! | `starting` | no | before the first probe |
//! | `healthy` | yes | placement readable, this node owns >= 1 shard, every shard assigned and settled |
//! | `rebalancing` | yes | owns >= 1 shard while some shards are unassigned or moving |
//! | `unassigned` | no | placement readable but this node owns no shard |
//! | `unavailable` | no | placement unreadable (or the node is self-fenced) |
//!
//! A failed probe keeps `last_successful_at_ms` from the last good one.

use serde::Serialize;

/// Health status code (serialized lowercase).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    Starting,
    Healthy,
    Rebalancing,
    Unassigned,
    Unavailable,
}

impl HealthStatus {
    pub fn is_ready(self) -> bool {
        matches!(self, HealthStatus::Healthy | HealthStatus::Rebalancing)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            HealthStatus::Starting => "starting",
            HealthStatus::Healthy => "healthy",
            HealthStatus::Rebalancing => "rebalancing",
            HealthStatus::Unassigned => "unassigned",
            HealthStatus::Unavailable => "unavailable",
        }
    }
}

/// What one probe observed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub configured_shards: u32,
    pub assigned_shards: u32,
    pub local_shards: u32,
    pub moving_shards: u32,
    pub observed_nodes: u32,
}

/// Why a probe failed (fixed text, safe to expose).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeFailure {
    PlacementUnreadable,
    SelfFenced,
}

/// The readiness snapshot served at `/readyz` and inside `/v1/ops/cluster`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HealthSnapshot {
    pub status: HealthStatus,
    pub ready: bool,
    pub configured_shards: u32,
    pub assigned_shards: u32,
    pub local_shards: u32,
    pub moving_shards: u32,
    pub observed_nodes: u32,
    pub checked_at_ms: Option<u64>,
    pub last_successful_at_ms: Option<u64>,
    pub detail: &'static str,
}

impl HealthSnapshot {
    pub fn starting(configured_shards: u32) -> Self {
        Self {
            status: HealthStatus::Starting,
            ready: false,
            configured_shards,
            assigned_shards: 0,
            local_shards: 0,
            moving_shards: 0,
            observed_nodes: 0,
            checked_at_ms: None,
            last_successful_at_ms: None,
            detail: "waiting for the first placement check",
        }
    }
}

/// The next snapshot after a probe at `now_ms` (Unix milliseconds).
pub fn next(
    prev: &HealthSnapshot,
    probe: Result<Probe, ProbeFailure>,
    now_ms: u64,
) -> HealthSnapshot {
    match probe {
        Ok(p) => {
            let (status, detail) = if p.local_shards == 0 {
                (HealthStatus::Unassigned, "this node owns no shard")
            } else if p.assigned_shards < p.configured_shards || p.moving_shards > 0 {
                (
                    HealthStatus::Rebalancing,
                    "uploads are served while shard assignments converge",
                )
            } else {
                (
                    HealthStatus::Healthy,
                    "placement is settled and this node owns shards",
                )
            };
            HealthSnapshot {
                status,
                ready: status.is_ready(),
                configured_shards: p.configured_shards,
                assigned_shards: p.assigned_shards,
                local_shards: p.local_shards,
                moving_shards: p.moving_shards,
                observed_nodes: p.observed_nodes,
                checked_at_ms: Some(now_ms),
                last_successful_at_ms: Some(now_ms),
                detail,
            }
        }
        Err(failure) => HealthSnapshot {
            status: HealthStatus::Unavailable,
            ready: false,
            configured_shards: prev.configured_shards,
            assigned_shards: 0,
            local_shards: 0,
            moving_shards: 0,
            observed_nodes: 0,
            checked_at_ms: Some(now_ms),
            last_successful_at_ms: prev.last_successful_at_ms,
            detail: match failure {
                ProbeFailure::PlacementUnreadable => "the placement table could not be read",
                ProbeFailure::SelfFenced => "heartbeats are failing; this node fenced itself",
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(assigned: u32, local: u32, moving: u32) -> Result<Probe, ProbeFailure> {
        Ok(Probe {
            configured_shards: 16,
            assigned_shards: assigned,
            local_shards: local,
            moving_shards: moving,
            observed_nodes: 2,
        })
    }

    #[test]
    fn transitions() {
        let s0 = HealthSnapshot::starting(16);
        assert!(!s0.ready);
        let s1 = next(&s0, probe(16, 8, 0), 1000);
        assert_eq!((s1.status, s1.ready), (HealthStatus::Healthy, true));
        let s2 = next(&s1, probe(16, 8, 3), 2000);
        assert_eq!((s2.status, s2.ready), (HealthStatus::Rebalancing, true));
        let s3 = next(&s2, probe(8, 8, 0), 2500);
        assert_eq!(s3.status, HealthStatus::Rebalancing);
        let s4 = next(&s3, probe(16, 0, 0), 3000);
        assert_eq!((s4.status, s4.ready), (HealthStatus::Unassigned, false));
    }

    #[test]
    fn failure_keeps_last_success() {
        let ok = next(&HealthSnapshot::starting(16), probe(16, 8, 0), 1000);
        let failed = next(&ok, Err(ProbeFailure::PlacementUnreadable), 2000);
        assert_eq!(failed.status, HealthStatus::Unavailable);
        assert!(!failed.ready);
        assert_eq!(failed.checked_at_ms, Some(2000));
        assert_eq!(failed.last_successful_at_ms, Some(1000));
        let fenced = next(&failed, Err(ProbeFailure::SelfFenced), 3000);
        assert_eq!(fenced.last_successful_at_ms, Some(1000));
    }
}
