//! Lease loss on the local monotonic clock, against a real `redis-server` that stops
//! answering (`CLIENT PAUSE ALL`): the holder cancels the transfer at its loss deadline,
//! before the server could expire the lease, however long the hanging renew call takes.
//!
//! Checks ADM-3.

#[allow(unused_imports)]
mod support;

use std::time::Duration;

use graviton::admission::{
    Admission, AdmissionMetrics, Footprint, Operation, RedisAdmissionConfig, TransferRequest,
};
use graviton::config::HumanDuration;
use graviton::ids::TenantId;
use support::RedisServer;
use tokio::time::Instant;

// Checks ADM-3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_renewal_is_a_loss_at_the_loss_deadline_before_the_ttl() {
    let Some(server) = RedisServer::start("a_hanging_renewal_is_a_loss_at_the_loss_deadline")
    else {
        return;
    };
    let ttl = Duration::from_secs(3);
    let redis = RedisAdmissionConfig {
        retry_interval: HumanDuration::millis(50),
        ..support::admission::redis(server.url(), "lease")
    };
    let config = support::admission::limits(redis, HumanDuration::secs(5));
    let admission = Admission::new(&config, AdmissionMetrics::default()).unwrap();
    // Taken before the admit call: the server's expiry is later than this + TTL.
    let before_admit = Instant::now();
    let permit = admission
        .admit(TransferRequest {
            operation: Operation::Upload,
            tenant: Some(TenantId::new_random()),
            backend: "fs".into(),
            footprint: Footprint::new(1 << 20).unwrap(),
        })
        .await
        .unwrap();
    let cancelled = permit.cancellation();
    // Redis stops answering every client for longer than the TTL (4.5 s) (the renew calls hang
    // until the client's 1s response timeout, and are retried).
    let mut control = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(4500)
        .arg("ALL")
        .query_async(&mut control)
        .await
        .unwrap();
    // The lease must be declared lost (and the transfer cancelled) before the earliest
    // moment the server could expire it.
    let lost_in_time = tokio::time::timeout_at(before_admit + ttl, cancelled.cancelled())
        .await
        .is_ok();
    // (The pause ends on its own; `CLIENT UNPAUSE` would itself wait behind it.)
    assert!(
        lost_in_time,
        "the holder declared the loss only after the server-side TTL"
    );
    let losses = admission
        .metrics()
        .lease_losses
        .get_or_create(&graviton::admission::metrics::OperationLabels {
            operation: "upload",
        })
        .get();
    assert_eq!(losses, 1);
    drop(permit);
}

/// A caller that goes away while it waits (the client disconnected) is recorded as
/// `abandoned`, not `timed_out`; `completed` carries the policy version the lease was
/// admitted under, not the current one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_wait_is_abandoned_and_completed_keeps_its_admitted_policy_version() {
    let Some(server) = RedisServer::start("a_dropped_wait_is_abandoned") else {
        return;
    };
    let redis = RedisAdmissionConfig {
        wait: HumanDuration::secs(20),
        retry_interval: HumanDuration::millis(20),
        tenant_transfers: 1,
        ..support::admission::redis(server.url(), "drop")
    };
    let config = support::admission::limits(redis, HumanDuration::secs(20));
    let admission = Admission::new(&config, AdmissionMetrics::default()).unwrap();
    let coordinator = admission.coordinator().unwrap().clone();
    let tenant = TenantId::new_random();
    let request = || TransferRequest {
        operation: Operation::Upload,
        tenant: Some(tenant),
        backend: "fs".into(),
        footprint: Footprint::new(1 << 20).unwrap(),
    };
    let held = admission.admit(request()).await.unwrap();
    let admitted_version = held.lease().unwrap().policy_version;
    let waiter = {
        let admission = admission.clone();
        let request = request();
        tokio::spawn(async move { admission.admit(request).await.map(drop) })
    };
    let events_of = |kind: &'static str| {
        let coordinator = coordinator.clone();
        async move {
            coordinator
                .recent_events(100)
                .await
                .unwrap()
                .into_iter()
                .filter(|e| e["kind"] == kind)
                .count()
        }
    };
    assert!(
        support::wait_until(Duration::from_secs(10), || async {
            events_of("queued").await == 1
        })
        .await
    );
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert!(
        support::wait_until(Duration::from_secs(10), || async {
            events_of("abandoned").await == 1
        })
        .await,
        "the dropped wait is recorded as abandoned"
    );
    assert_eq!(events_of("timed_out").await, 0);
    // A policy change while the lease is held; `completed` still names the old version.
    let current = coordinator
        .set_policy(&TenantId::new_random(), Some(1 << 20), None)
        .await
        .unwrap();
    assert!(current > admitted_version);
    held.finish(graviton::admission::Outcome::Completed).await;
    let completed = coordinator
        .recent_events(100)
        .await
        .unwrap()
        .into_iter()
        .find(|e| e["kind"] == "completed")
        .expect("completed event");
    assert_eq!(completed["policy_version"], admitted_version.to_string());
}
