//! The Redis admission configuration of tests, built in one place.
//!
//! [`redis`] is the base every test edits with struct update syntax
//! (`RedisAdmissionConfig { wait: …, ..support::admission::redis(url, "tls") }`): a cell
//! of its own per test and fast lease timings. [`limits`] wraps it in the admission
//! section of the library tests, [`on_node`] puts it on an in-process node's
//! configuration, and [`coordinator`] is a second client of the same cell (to set
//! policies or read leases from the side).

use graviton::admission::{AdmissionConfig, RedisAdmissionConfig};
use graviton::config::{ByteSize, Config, HumanDuration};
use graviton::storage::redis::RedisCoordinator;

/// Redis admission at `url` in a new cell `<cell_prefix>-<unique suffix>`, with a 3 s
/// lease TTL renewed every second, a 1 s wait for a slot and a 10 ms retry interval.
pub fn redis(url: impl Into<String>, cell_prefix: &str) -> RedisAdmissionConfig {
    RedisAdmissionConfig {
        url: url.into(),
        cell: format!("{cell_prefix}-{}", super::unique_suffix()),
        lease_ttl: HumanDuration::secs(3),
        renew_interval: HumanDuration::secs(1),
        wait: HumanDuration::secs(1),
        retry_interval: HumanDuration::millis(10),
        ..RedisAdmissionConfig::default()
    }
}

/// The admission section of a library test: `redis` under 64 MiB process and tenant
/// budgets, waiting at most `acquisition_timeout`; it must validate.
pub fn limits(redis: RedisAdmissionConfig, acquisition_timeout: HumanDuration) -> AdmissionConfig {
    let config = AdmissionConfig {
        process_bytes: ByteSize::mib(64),
        tenant_bytes: ByteSize::mib(64),
        acquisition_timeout,
        redis: Some(redis),
        ..AdmissionConfig::default()
    };
    assert!(config.problems().is_empty(), "{:?}", config.problems());
    config
}

/// Put `redis` on an in-process node's configuration, with a 2 s acquisition timeout.
pub fn on_node(config: &mut Config, redis: RedisAdmissionConfig) {
    config.admission.acquisition_timeout = HumanDuration::secs(2);
    config.admission.redis = Some(redis);
}

/// A coordinator on `cell` at `url` with default settings: another client of the cell.
pub fn coordinator(url: impl Into<String>, cell: impl Into<String>) -> RedisCoordinator {
    RedisCoordinator::connect(
        &RedisAdmissionConfig {
            url: url.into(),
            cell: cell.into(),
            ..RedisAdmissionConfig::default()
        }
        .coordinator(),
    )
    .expect("a coordinator on the test cell")
}
