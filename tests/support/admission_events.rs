//! The event-stream ceiling sweep shared by the admission suites: every decision event
//! reports an occupancy within every ceiling, replaying `admitted` against `completed` and
//! `expired` reproduces the service occupancy each event reports, and fencing tokens of
//! admissions only ever rise.

use std::collections::BTreeMap;

use graviton::admission::RedisAdmissionConfig;

pub type Event = BTreeMap<String, String>;

/// Integer field of an event.
pub fn n(event: &Event, field: &str) -> i64 {
    event[field]
        .parse()
        .unwrap_or_else(|_| panic!("{field} is not an integer: {:?}", event[field]))
}

/// Check every event against the ceilings of `redis`; returns the count of each kind.
pub fn sweep(events: &[Event], redis: &RedisAdmissionConfig) -> BTreeMap<String, u64> {
    let (mut bytes, mut count, mut kinds) = (0i64, 0i64, BTreeMap::<String, u64>::new());
    let mut last_token = 0i64;
    for event in events {
        *kinds.entry(event["kind"].clone()).or_default() += 1;
        assert!(
            n(event, "service_bytes") <= redis.service_bytes.bytes() as i64,
            "{event:?}"
        );
        assert!(
            n(event, "service_transfers") <= i64::from(redis.service_transfers),
            "{event:?}"
        );
        assert!(
            n(event, "tenant_bytes") <= redis.tenant_bytes.bytes() as i64,
            "{event:?}"
        );
        assert!(
            n(event, "tenant_transfers") <= i64::from(redis.tenant_transfers),
            "{event:?}"
        );
        assert!(
            n(event, "backend_transfers") <= i64::from(redis.backend_transfers),
            "{event:?}"
        );
        match event["kind"].as_str() {
            "admitted" => {
                let token = n(event, "fencing_token");
                assert!(
                    token > last_token,
                    "fencing token went backwards: {event:?}"
                );
                last_token = token;
                bytes += n(event, "bytes");
                count += 1;
            }
            "completed" | "expired" => {
                bytes -= n(event, "bytes");
                count -= 1;
            }
            _ => continue,
        }
        assert_eq!(
            (bytes, count),
            (n(event, "service_bytes"), n(event, "service_transfers")),
            "{event:?}"
        );
    }
    kinds
}
