//! Cluster admission against a real `redis-server` (one private server per test, a random
//! cell per test, two independent `Admission` providers per server where it matters).

#[allow(unused_imports)] // the shared harness also exports PostgreSQL helpers
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use graviton::admission::{
    Admission, AdmissionConfig, AdmissionMetrics, Dimension, Error, FencingToken, Footprint,
    Operation, Outcome, QuotaKind, RedisAdmissionConfig, TenantOverride, TransferRequest,
};
use graviton::config::{ByteSize, HumanDuration};
use graviton::edge::ApiError;
use graviton::ids::TenantId;
use graviton::storage::redis::reply::{AcquireReply, LeaseId, ReleaseReply, RenewReply};
use graviton::storage::redis::{LeaseRequest, RedisCoordinator};
use support::admission_events::n;
use support::{RedisServer, unique_suffix, wait_until};

const MIB: u64 = 1 << 20;

fn config(url: &str, cell: &str) -> AdmissionConfig {
    AdmissionConfig {
        process_bytes: ByteSize::mib(64),
        tenant_bytes: ByteSize::mib(64),
        tenant_transfers: 64,
        backend_transfers: 64,
        acquisition_timeout: HumanDuration::secs(5),
        redis: Some(RedisAdmissionConfig {
            url: url.to_string(),
            cell: cell.to_string(),
            key_prefix: "it".to_string(),
            lease_ttl: HumanDuration::secs(3),
            renew_interval: HumanDuration::secs(1),
            wait: HumanDuration::millis(400),
            retry_interval: HumanDuration::millis(10),
            service_bytes: ByteSize::mib(64),
            service_transfers: 4,
            tenant_bytes: ByteSize::mib(32),
            tenant_transfers: 2,
            backend_transfers: 4,
            max_events: 100_000,
            ..RedisAdmissionConfig::default()
        }),
        ..AdmissionConfig::default()
    }
}

fn edit(mut config: AdmissionConfig, f: impl FnOnce(&mut RedisAdmissionConfig)) -> AdmissionConfig {
    f(config.redis.as_mut().unwrap());
    assert!(config.problems().is_empty(), "{:?}", config.problems());
    config
}

fn provider(config: &AdmissionConfig) -> Admission {
    assert!(config.problems().is_empty(), "{:?}", config.problems());
    Admission::new(config, AdmissionMetrics::default()).unwrap()
}

fn request(tenant: Option<TenantId>, mib: u64) -> TransferRequest {
    TransferRequest {
        operation: Operation::Upload,
        tenant,
        backend: "fs".to_string(),
        footprint: Footprint::new(mib * MIB).unwrap(),
    }
}

fn lease_request(tenant: Option<TenantId>, mib: u64) -> LeaseRequest {
    LeaseRequest {
        lease_id: LeaseId::random(),
        tenant,
        backend: "fs".to_string(),
        bytes: mib * MIB,
        operation: Operation::Download.as_str(),
    }
}

/// Wait (at most 10 s) until Redis's own clock (`TIME`, the clock the scripts expire
/// leases by) is past `ms`; whether it got there.
async fn redis_time_passes(conn: &redis::aio::MultiplexedConnection, ms: u64) -> bool {
    wait_until(Duration::from_secs(10), || {
        let mut conn = conn.clone();
        async move {
            let (secs, micros): (u64, u64) =
                redis::cmd("TIME").query_async(&mut conn).await.unwrap();
            secs * 1000 + micros / 1000 > ms
        }
    })
    .await
}

fn cell() -> String {
    format!("it-{}", unique_suffix())
}

async fn snapshot(
    admission: &Admission,
    tenant: Option<&TenantId>,
) -> graviton::storage::redis::reply::SnapshotReply {
    admission
        .snapshot(tenant, Some("fs"))
        .await
        .unwrap()
        .cluster
        .unwrap()
}

async fn all_events(coordinator: &RedisCoordinator) -> Vec<BTreeMap<String, String>> {
    coordinator.recent_events(1_000_000).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_providers_never_exceed_any_ceiling_under_concurrent_load() {
    let Some(server) =
        RedisServer::start("two_providers_never_exceed_any_ceiling_under_concurrent_load")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.service_transfers = 6;
        r.tenant_transfers = 3;
        r.backend_transfers = 5;
        r.wait = HumanDuration::secs(2);
    });
    let providers = [provider(&cfg), provider(&cfg)];
    let tenants: Vec<TenantId> = (0..3).map(|_| TenantId::new_random()).collect();
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for worker in 0..24u64 {
        let admission = providers[(worker % 2) as usize].clone();
        let tenant = tenants[(worker % 3) as usize];
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..6u64 {
                let mib = 4 + (worker * 7 + round * 3) % 17;
                match admission.admit(request(Some(tenant), mib)).await {
                    Ok(permit) => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5 + (worker + round) % 15)).await;
                        permit.finish(Outcome::Completed).await;
                    }
                    Err(Error::TimedOut(_)) => {}
                    Err(other) => panic!("unexpected admission error {other:?}"),
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        admitted.load(Ordering::Relaxed) >= 40,
        "too few admissions to prove anything"
    );

    let coordinator = providers[0].coordinator().unwrap();
    let events = all_events(coordinator).await;
    let redis = cfg.redis.as_ref().unwrap();
    let kinds = support::admission_events::sweep(&events, redis);
    assert_eq!(kinds.get("admitted"), kinds.get("completed"), "{kinds:?}");
    assert!(
        kinds.get("queued").copied().unwrap_or(0) > 0,
        "the load never contended: {kinds:?}"
    );
    let idle = snapshot(&providers[1], Some(&tenants[0])).await;
    assert_eq!(idle.occupancy.service_bytes, 0);
    assert_eq!(idle.occupancy.service_transfers, 0);
    assert_eq!(idle.occupancy.tenant_transfers, Some(0));
    assert_eq!(idle.waiters, 0, "every waiter left the queue");
}

#[tokio::test]
async fn tenants_stay_independent_under_the_shared_service_ceiling() {
    let Some(server) =
        RedisServer::start("tenants_stay_independent_under_the_shared_service_ceiling")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| r.tenant_transfers = 1);
    let (p1, p2) = (provider(&cfg), provider(&cfg));
    let (a, b) = (TenantId::new_random(), TenantId::new_random());
    let held = p1.admit(request(Some(a), 8)).await.unwrap();
    let err = p2.admit(request(Some(a), 8)).await.unwrap_err();
    // The cluster lease (not a local permit) is what timed out, and the coordinator records
    // that the wait ended on the tenant's own transfer ceiling.
    assert!(matches!(err, Error::TimedOut("cluster lease")), "{err:?}");
    let coordinator = p1.coordinator().unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || async {
            all_events(coordinator)
                .await
                .iter()
                .any(|e| e["kind"] == "timed_out" && e["outcome"] == "tenant_transfers")
        })
        .await,
        "no timed_out event on tenant_transfers: {:?}",
        all_events(coordinator).await
    );
    let api: ApiError = err.into();
    assert_eq!(
        (api.status.as_u16(), api.code.as_str()),
        (503, "transfer_admission_busy")
    );
    assert!(api.retry_after.is_some());
    let other = p2.admit(request(Some(b), 8)).await.unwrap();
    let snap = snapshot(&p1, Some(&a)).await;
    assert_eq!(snap.occupancy.service_transfers, 2);
    assert_eq!(snap.occupancy.tenant_transfers, Some(1));
    held.finish(Outcome::Completed).await;
    let again = p2.admit(request(Some(a), 8)).await.unwrap();
    drop((other, again));
}

#[tokio::test]
async fn request_and_egress_quotas_are_shared_by_providers() {
    let Some(server) = RedisServer::start("request_and_egress_quotas_are_shared_by_providers")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.tenant_requests_per_minute = 2;
        r.tenant_egress_per_hour = ByteSize(10);
    });
    let (p1, p2) = (provider(&cfg), provider(&cfg));
    // Stay clear of a Redis-time minute boundary so the window cannot roll mid-test.
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    if secs % 60 >= 57 {
        tokio::time::sleep(Duration::from_secs(60 - secs % 60)).await;
    }
    let (a, b) = (TenantId::new_random(), TenantId::new_random());
    p1.charge_request(&a).await.unwrap();
    p2.charge_request(&a).await.unwrap();
    match p1.charge_request(&a).await {
        Err(Error::QuotaExceeded {
            kind: QuotaKind::Requests,
            retry_after,
        }) => {
            assert!(
                retry_after > Duration::ZERO && retry_after <= Duration::from_secs(60),
                "{retry_after:?}"
            );
            let api: ApiError = Error::QuotaExceeded {
                kind: QuotaKind::Requests,
                retry_after,
            }
            .into();
            assert_eq!(
                (api.status.as_u16(), api.code.as_str()),
                (429, "quota_exceeded")
            );
        }
        other => panic!("third request in the minute was not refused: {other:?}"),
    }
    p2.charge_request(&b).await.unwrap();
    p2.charge_egress(&a, 10).await.unwrap();
    assert!(matches!(
        p1.charge_egress(&a, 1).await,
        Err(Error::QuotaExceeded { kind: QuotaKind::Egress, retry_after }) if retry_after <= Duration::from_secs(3600)
    ));
    p1.charge_egress(&b, 10).await.unwrap();
    assert_eq!(p2.metrics().egress_bytes.get(), 10);
    // Quota keys carry the tenant hash, never the raw id.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        keys.iter().any(|k| k.contains(":traffic:request:")),
        "{keys:?}"
    );
    assert!(
        keys.iter()
            .all(|k| !k.contains(&a.to_string()) && !k.contains(&b.to_string())),
        "{keys:?}"
    );
}

#[tokio::test]
async fn live_override_is_applied_and_cleared_without_restart() {
    let Some(server) = RedisServer::start("live_override_is_applied_and_cleared_without_restart")
    else {
        return;
    };
    let cfg = config(&server.url(), &cell());
    let (p1, p2) = (provider(&cfg), provider(&cfg));
    let tenant = TenantId::new_random();
    let v1 = p1
        .set_override(
            &tenant,
            TenantOverride {
                bytes: None,
                transfers: Some(1),
            },
        )
        .await
        .unwrap();
    assert!(v1 >= 1);
    let held = p2.admit(request(Some(tenant), 4)).await.unwrap();
    assert_eq!(held.lease().unwrap().policy_version, v1);
    assert!(matches!(
        p1.admit(request(Some(tenant), 4)).await,
        Err(Error::TimedOut(_))
    ));
    let v2 = p2.clear_override(&tenant).await.unwrap();
    assert!(v2 > v1);
    let second = p1.admit(request(Some(tenant), 4)).await.unwrap();
    assert_eq!(second.lease().unwrap().policy_version, v2);
    // A bytes override below the footprint makes it a never-fitting request: 429 at once.
    let v3 = p1
        .set_override(
            &tenant,
            TenantOverride {
                bytes: Some(ByteSize::mib(2)),
                transfers: None,
            },
        )
        .await
        .unwrap();
    assert!(v3 > v2);
    let waits = |events: &[BTreeMap<String, String>]| {
        events
            .iter()
            .filter(|e| e["kind"] == "queued" || e["kind"] == "timed_out")
            .count()
    };
    let waits_before = waits(&all_events(p1.coordinator().unwrap()).await);
    assert!(matches!(
        p2.admit(request(Some(tenant), 4)).await,
        Err(Error::NeverFits(Dimension::TenantBytes))
    ));
    // At once: the attempt never queued, and left no waiter behind.
    assert_eq!(
        waits(&all_events(p1.coordinator().unwrap()).await),
        waits_before,
        "a never-fitting request waited"
    );
    assert_eq!(snapshot(&p1, Some(&tenant)).await.waiters, 0);
    assert!(matches!(
        p1.set_override(
            &tenant,
            TenantOverride {
                bytes: None,
                transfers: Some(0)
            }
        )
        .await,
        Err(Error::InvalidOverride(_))
    ));
    let events = all_events(p1.coordinator().unwrap()).await;
    let changes: Vec<_> = events
        .iter()
        .filter(|e| e["kind"] == "policy_changed")
        .collect();
    assert_eq!(changes.len(), 3);
    assert_eq!(changes[1]["outcome"], "cleared");
    assert_eq!(n(changes[2], "policy_version") as u64, v3);
    drop((held, second));
}

#[tokio::test]
async fn lease_renews_past_its_ttl_and_is_released_on_cancellation() {
    let Some(server) =
        RedisServer::start("lease_renews_past_its_ttl_and_is_released_on_cancellation")
    else {
        return;
    };
    let cell = cell();
    let cfg = edit(config(&server.url(), &cell), |r| {
        r.lease_ttl = HumanDuration::secs(2);
        r.renew_interval = HumanDuration::millis(250);
    });
    let p1 = provider(&cfg);
    let tenant = TenantId::new_random();
    let before = p1.metrics().local_available_bytes.get();
    let conn = connection(&server.url()).await;
    let transfer = {
        let p1 = p1.clone();
        tokio::spawn(async move {
            let permit = p1.admit(request(Some(tenant), 8)).await.unwrap();
            // A transfer that never ends on its own: it is cancelled from outside.
            std::future::pending::<()>().await;
            drop(permit);
        })
    };
    // The lease's first expiry, as Redis records it once the transfer is admitted; then
    // wait until Redis's own clock is past it, so only renewals can have kept the lease.
    let expirations = format!("it:{{{cell}}}:admission:expirations");
    let first_expiry = || {
        let mut conn = conn.clone();
        let expirations = expirations.clone();
        async move {
            let scores: Vec<(String, u64)> = redis::cmd("ZRANGE")
                .arg(&expirations)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query_async(&mut conn)
                .await
                .unwrap();
            scores.first().map(|(_, score)| *score)
        }
    };
    let admitted_expiry = Arc::new(AtomicU64::new(0));
    assert!(
        wait_until(Duration::from_secs(10), || {
            let (next, slot) = (first_expiry(), admitted_expiry.clone());
            async move {
                match next.await {
                    Some(expiry) => {
                        slot.store(expiry, Ordering::SeqCst);
                        true
                    }
                    None => false,
                }
            }
        })
        .await,
        "the transfer was never admitted"
    );
    let admitted_expiry = admitted_expiry.load(Ordering::SeqCst);
    assert!(redis_time_passes(&conn, admitted_expiry).await);
    p1.coordinator().unwrap().reap().await.unwrap();
    let snap = snapshot(&p1, Some(&tenant)).await;
    assert_eq!(
        snap.occupancy.service_transfers, 1,
        "renewed beyond the original 2s TTL"
    );
    transfer.abort();
    assert!(transfer.await.unwrap_err().is_cancelled());
    let coordinator = p1.coordinator().unwrap().clone();
    assert!(
        wait_until(Duration::from_secs(3), || {
            let coordinator = coordinator.clone();
            async move {
                coordinator
                    .snapshot(None, None)
                    .await
                    .unwrap()
                    .occupancy
                    .service_transfers
                    == 0
            }
        })
        .await
    );
    let snap = p1.snapshot(Some(&tenant), Some("fs")).await.unwrap();
    assert_eq!(
        snap.local.process_bytes_available,
        snap.local.process_bytes_capacity
    );
    assert_eq!(before, p1.metrics().local_available_bytes.get());
    let events = all_events(&coordinator).await;
    let last = events
        .iter()
        .rev()
        .find(|e| e["kind"] == "completed")
        .unwrap();
    assert_eq!(last["outcome"], "interrupted");
    assert_eq!(n(last, "service_transfers"), 0);
}

#[tokio::test]
async fn abandoned_lease_is_reaped_by_server_time_restoring_every_counter() {
    let Some(server) =
        RedisServer::start("abandoned_lease_is_reaped_by_server_time_restoring_every_counter")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.lease_ttl = HumanDuration::secs(2);
        r.renew_interval = HumanDuration::millis(300);
    });
    let p1 = provider(&cfg);
    let coordinator = p1.coordinator().unwrap();
    let tenant = TenantId::new_random();
    // A holder killed with -9: the lease is granted and then nobody renews or releases it.
    let reply = coordinator
        .try_acquire(&lease_request(Some(tenant), 8), true)
        .await
        .unwrap();
    let AcquireReply::Admitted { expires_at_ms, .. } = reply else {
        panic!("not admitted: {reply:?}");
    };
    let snap = snapshot(&p1, Some(&tenant)).await;
    assert_eq!(
        (
            snap.occupancy.service_bytes,
            snap.occupancy.tenant_transfers
        ),
        (8 * MIB, Some(1))
    );
    // Until Redis's own clock is past the lease's expiry (not a guessed sleep).
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    assert!(redis_time_passes(&conn, expires_at_ms).await);
    let snap = snapshot(&p1, Some(&tenant)).await;
    assert_eq!(snap.occupancy.service_bytes, 0);
    assert_eq!(snap.occupancy.service_transfers, 0);
    assert_eq!(snap.occupancy.tenant_bytes, Some(0));
    assert_eq!(snap.occupancy.tenant_transfers, Some(0));
    assert_eq!(snap.occupancy.backend_transfers, 0);
    let fields: u64 = redis::cmd("HLEN")
        .arg(coordinator.keys().counts())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(fields, 0, "zeroed counters are deleted, none left negative");
    let events = all_events(coordinator).await;
    let expired = events
        .iter()
        .find(|e| e["kind"] == "expired")
        .expect("an expired event");
    assert_eq!(expired["outcome"], "lease_expired");
    assert_eq!(n(expired, "service_bytes"), 0);
}

#[tokio::test]
async fn fencing_loss_is_reported_by_the_holder() {
    let Some(server) = RedisServer::start("fencing_loss_is_reported_by_the_holder") else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.lease_ttl = HumanDuration::secs(2);
        r.renew_interval = HumanDuration::millis(200);
    });
    let (p1, p2) = (provider(&cfg), provider(&cfg));
    let permit = p1.admit(request(None, 8)).await.unwrap();
    let lease = permit.lease().unwrap();
    let other = p2.coordinator().unwrap();
    // A stale token cannot touch the lease.
    let wrong = FencingToken::for_test(lease.fencing_token.value() + 1000);
    assert_eq!(
        other
            .release(&lease.lease_id, &wrong, Outcome::Failed.as_str())
            .await
            .unwrap(),
        ReleaseReply::Stale
    );
    assert_eq!(
        other.renew(&lease.lease_id, &wrong).await.unwrap(),
        RenewReply::Stale
    );
    // Released behind the holder's back: the holder notices at its next renewal.
    let token = FencingToken::for_test(lease.fencing_token.value());
    assert_eq!(
        other
            .release(&lease.lease_id, &token, Outcome::Failed.as_str())
            .await
            .unwrap(),
        ReleaseReply::Released
    );
    tokio::time::timeout(Duration::from_secs(3), permit.cancellation().cancelled())
        .await
        .expect("the transfer is cancelled after its lease is lost");
    let losses =
        p1.metrics()
            .lease_losses
            .get_or_create(&graviton::admission::metrics::OperationLabels {
                operation: "upload",
            });
    assert_eq!(losses.get(), 1);
}

#[tokio::test]
async fn event_stream_is_bounded_and_follows_the_schema() {
    let Some(server) = RedisServer::start("event_stream_is_bounded_and_follows_the_schema") else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| r.max_events = 1000);
    let p1 = provider(&cfg);
    let coordinator = p1.coordinator().unwrap();
    let tenant = TenantId::new_random();
    for _ in 0..700 {
        let request = lease_request(Some(tenant), 1);
        let AcquireReply::Admitted { token, .. } =
            coordinator.try_acquire(&request, true).await.unwrap()
        else {
            panic!("not admitted");
        };
        coordinator
            .release(&request.lease_id, &token, Outcome::Completed.as_str())
            .await
            .unwrap();
    }
    let len = coordinator.event_count().await.unwrap();
    assert!((1000..1200).contains(&len), "stream length {len}");
    let fields = [
        "schema",
        "kind",
        "at_ms",
        "lease",
        "fencing_token",
        "tenant",
        "backend",
        "bytes",
        "operation",
        "outcome",
        "policy_version",
        "service_bytes",
        "service_transfers",
        "tenant_bytes",
        "tenant_transfers",
        "backend_transfers",
    ];
    let hashed_tenant = coordinator.hasher().tenant(&tenant);
    for event in all_events(coordinator).await {
        assert_eq!(
            event
                .keys()
                .map(String::as_str)
                .collect::<std::collections::BTreeSet<_>>(),
            fields.into()
        );
        assert_eq!(event["schema"], "graviton-admission-event-v1");
        assert!(
            ["admitted", "completed"].contains(&event["kind"].as_str()),
            "{event:?}"
        );
        assert_eq!(event["tenant"], hashed_tenant);
        assert!(!event.values().any(|v| v.contains(&tenant.to_string())));
        assert!(n(&event, "at_ms") > 1_600_000_000_000);
    }
}

#[tokio::test]
async fn acquire_is_idempotent_on_a_retried_lease_id_and_survives_script_flush() {
    let Some(server) =
        RedisServer::start("acquire_is_idempotent_on_a_retried_lease_id_and_survives_script_flush")
    else {
        return;
    };
    let p1 = provider(&config(&server.url(), &cell()));
    let coordinator = p1.coordinator().unwrap();
    let request = lease_request(Some(TenantId::new_random()), 8);
    let AcquireReply::Admitted { token: first, .. } =
        coordinator.try_acquire(&request, true).await.unwrap()
    else {
        panic!("not admitted");
    };
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The script runs as a Redis Function: flushing the library is the same test.
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let AcquireReply::Admitted {
        token: again,
        occupancy,
        ..
    } = coordinator.try_acquire(&request, false).await.unwrap()
    else {
        panic!("retry not admitted");
    };
    assert_eq!(first, again);
    assert_eq!(
        (occupancy.service_transfers, occupancy.service_bytes),
        (1, 8 * MIB)
    );
    let events = all_events(coordinator).await;
    assert_eq!(events.iter().filter(|e| e["kind"] == "admitted").count(), 1);
}

#[tokio::test]
async fn renew_refuses_a_lease_past_expiry_that_was_not_reaped() {
    let Some(server) = RedisServer::start("renew_refuses_a_lease_past_expiry_that_was_not_reaped")
    else {
        return;
    };
    let cell = cell();
    let cfg = edit(config(&server.url(), &cell), |r| {
        r.lease_ttl = HumanDuration::secs(2);
        r.renew_interval = HumanDuration::millis(300);
    });
    let p1 = provider(&cfg);
    let coordinator = p1.coordinator().unwrap();
    let request = lease_request(None, 8);
    let AcquireReply::Admitted {
        token,
        expires_at_ms,
        ..
    } = coordinator.try_acquire(&request, true).await.unwrap()
    else {
        panic!("not admitted");
    };
    // Wait on the server's own clock, not ours: until Redis `TIME` is past the expiry the
    // lease's record names, so the renewal below can neither come early nor by luck.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let expirations = format!("it:{{{cell}}}:admission:expirations");
    let leases = format!("it:{{{cell}}}:admission:leases");
    let recorded: Option<u64> = redis::cmd("ZSCORE")
        .arg(&expirations)
        .arg(request.lease_id.as_str())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(recorded, Some(expires_at_ms), "the expiry Redis holds");
    assert!(
        redis_time_passes(&conn, expires_at_ms).await,
        "Redis time never passed the lease's expiry"
    );
    // No call has reaped yet (renew does not reap): the record still exists but is overdue.
    let exists: bool = redis::cmd("HEXISTS")
        .arg(&leases)
        .arg(request.lease_id.as_str())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        exists,
        "the overdue lease's record was reaped before the renewal"
    );
    assert_eq!(
        coordinator.renew(&request.lease_id, &token).await.unwrap(),
        RenewReply::Expired
    );
    assert_eq!(
        coordinator.renew(&request.lease_id, &token).await.unwrap(),
        RenewReply::Lost
    );
    assert_eq!(snapshot(&p1, None).await.occupancy.service_transfers, 0);
}

#[tokio::test]
async fn a_footprint_that_can_never_fit_is_rejected_at_once() {
    let Some(server) = RedisServer::start("a_footprint_that_can_never_fit_is_rejected_at_once")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.wait = HumanDuration::secs(4)
    });
    let p1 = provider(&cfg);
    let err = p1
        .admit(request(Some(TenantId::new_random()), 40))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NeverFits(Dimension::TenantBytes)),
        "{err:?}"
    );
    // At once: the script answered NEVER on the first attempt, so nothing ever queued.
    let events = all_events(p1.coordinator().unwrap()).await;
    assert!(
        events
            .iter()
            .all(|e| e["kind"] != "queued" && e["kind"] != "timed_out"),
        "a never-fitting request waited: {events:?}"
    );
    let api: ApiError = err.into();
    assert_eq!(
        (api.status.as_u16(), api.code.as_str()),
        (429, "transfer_admission_limited")
    );
    let err = p1.admit(request(None, 65)).await.unwrap_err();
    assert!(
        matches!(err, Error::NeverFits(Dimension::ProcessBytes)),
        "{err:?}"
    );
    let snap = p1.snapshot(None, None).await.unwrap();
    assert_eq!(
        snap.local.process_bytes_available,
        snap.local.process_bytes_capacity
    );
    assert_eq!(snap.cluster.unwrap().waiters, 0);
}

#[tokio::test]
async fn redis_outage_fails_closed_releases_local_permits_and_recovers() {
    let Some(mut server) =
        RedisServer::start("redis_outage_fails_closed_releases_local_permits_and_recovers")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.lease_ttl = HumanDuration::secs(2);
        r.renew_interval = HumanDuration::millis(300);
        r.wait = HumanDuration::secs(2);
    });
    let p1 = provider(&cfg);
    let held = p1.admit(request(None, 8)).await.unwrap();
    let capacity = 64 * MIB;
    server.stop();

    let err = p1.admit(request(None, 8)).await.unwrap_err();
    // Fails closed: unavailable (never a busy or admitted answer) while Redis is down.
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    let api: ApiError = err.into();
    assert_eq!(
        (api.status.as_u16(), api.code.as_str()),
        (503, "admission_unavailable")
    );
    assert!(api.retry_after.is_some());
    // Only the held transfer's bytes are reserved; the failed attempt gave its permits back.
    assert_eq!(
        p1.snapshot(None, None)
            .await
            .map(|_| ())
            .unwrap_err()
            .outcome(),
        "unavailable"
    );
    assert_eq!(
        p1.metrics().local_available_bytes.get() as u64,
        capacity - 8 * MIB
    );
    // The held lease cannot be renewed: it is declared lost and the transfer cancelled.
    tokio::time::timeout(Duration::from_secs(3), held.cancellation().cancelled())
        .await
        .unwrap();
    drop(held);

    server.restart();
    let p1c = p1.clone();
    assert!(
        wait_until(Duration::from_secs(10), move || {
            let p1 = p1c.clone();
            async move {
                match p1.admit(request(None, 8)).await {
                    Ok(permit) => {
                        permit.finish(Outcome::Completed).await;
                        true
                    }
                    Err(_) => false,
                }
            }
        })
        .await,
        "admission recovers without a restart"
    );
    let snap = snapshot(&p1, None).await;
    assert_eq!(
        snap.occupancy.service_transfers, 0,
        "the recovered permit was released again"
    );
    assert_eq!(
        snap.policy_version, 0,
        "the restarted server starts from empty state"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_waiter_is_not_starved_by_a_stream_of_small_transfers() {
    let Some(server) =
        RedisServer::start("a_large_waiter_is_not_starved_by_a_stream_of_small_transfers")
    else {
        return;
    };
    let cfg = edit(config(&server.url(), &cell()), |r| {
        r.service_transfers = 8;
        r.tenant_transfers = 8;
        r.backend_transfers = 8;
        r.wait = HumanDuration::secs(4);
    });
    let (small, large) = (provider(&cfg), provider(&cfg));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..10 {
        let (small, stop) = (small.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(permit) = small.admit(request(None, 8)).await {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    permit.finish(Outcome::Completed).await;
                }
            }
        }));
    }
    // Let the small transfers saturate the 64 MiB pool first (observed, not slept for).
    let busy = wait_until(Duration::from_secs(10), || async {
        snapshot(&large, None).await.occupancy.service_bytes >= 32 * MIB
    })
    .await;
    assert!(busy, "the small transfers never made the pool busy");
    let result = large.admit(request(None, 48)).await;
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    let permit = result.expect("the large waiter is admitted while small transfers keep arriving");
    permit.finish(Outcome::Completed).await;
    let events = all_events(large.coordinator().unwrap()).await;
    let queued = events
        .iter()
        .position(|e| e["kind"] == "queued" && n(e, "bytes") == (48 * MIB) as i64);
    assert!(
        queued.is_some(),
        "the large transfer had to queue behind the small ones"
    );
}

/// Checks ADM-7: a large waiter with a long `retry_interval` (polls up to 8 s apart, far
/// beyond the 2 s a waiter entry used to live) keeps its head-of-line place while small
/// transfers of another tenant keep arriving, and is admitted once the pool frees up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_waiter_with_a_long_retry_interval_keeps_its_place_against_another_tenant() {
    let Some(server) = RedisServer::start(
        "a_large_waiter_with_a_long_retry_interval_keeps_its_place_against_another_tenant",
    ) else {
        return;
    };
    let base = edit(config(&server.url(), &cell()), |r| {
        r.service_transfers = 16;
        r.tenant_transfers = 16;
        r.backend_transfers = 16;
        r.tenant_bytes = ByteSize::mib(64);
        r.wait = HumanDuration::secs(4);
    });
    let mut slow = base.clone();
    slow.acquisition_timeout = HumanDuration::secs(40);
    let slow = edit(slow, |r| {
        r.lease_ttl = HumanDuration::secs(10);
        r.renew_interval = HumanDuration::secs(3);
        r.retry_interval = HumanDuration::secs(1);
        r.wait = HumanDuration::secs(30);
    });
    let (small, large) = (provider(&base), provider(&slow));
    let (small_tenant, large_tenant) = (TenantId::new_random(), TenantId::new_random());
    // A blocker holds most of the 64 MiB pool while the large transfer queues.
    let blocker = small.admit(request(None, 40)).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..10 {
        let (small, stop) = (small.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(permit) = small.admit(request(Some(small_tenant), 8)).await {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    permit.finish(Outcome::Completed).await;
                }
            }
        }));
    }
    let waiting = {
        let large = large.clone();
        tokio::spawn(async move { large.admit(request(Some(large_tenant), 48)).await })
    };
    // The large transfer is queued (its `queued` event is written with its first
    // rejection); hold the blocker until its back-off has passed several polls apart.
    let queued = wait_until(Duration::from_secs(10), || {
        let large = large.clone();
        async move {
            all_events(large.coordinator().unwrap())
                .await
                .iter()
                .any(|e| e["kind"] == "queued" && n(e, "bytes") == (48 * MIB) as i64)
        }
    })
    .await;
    assert!(queued, "the large transfer queued");
    tokio::time::sleep(Duration::from_secs(5)).await;
    blocker.finish(Outcome::Completed).await;
    let result = waiting.await.unwrap();
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    let permit = result.expect("the large waiter kept its place and was admitted");
    permit.finish(Outcome::Completed).await;
}

async fn connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Checks ADM-8: fencing tokens and policy versions never go backwards when a replica that
/// missed the last writes is promoted (`REPLICAOF NO ONE`), nor when the server restarts
/// empty. A real primary and replica, started by the test.
#[tokio::test]
async fn tokens_and_policy_versions_never_go_backwards_across_failover_and_empty_restart() {
    let name = "tokens_and_policy_versions_never_go_backwards_across_failover_and_empty_restart";
    let (Some(primary), Some(mut replica)) = (RedisServer::start(name), RedisServer::start(name))
    else {
        return;
    };
    let cell = cell();
    let mut replica_conn = connection(&replica.url()).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(primary.port())
        .query_async(&mut replica_conn)
        .await
        .unwrap();
    let on_primary = provider(&config(&primary.url(), &cell));
    let tenant = TenantId::new_random();
    let limit = |transfers| TenantOverride {
        bytes: None,
        transfers: Some(transfers),
    };
    let replicated = on_primary.admit(request(Some(tenant), 1)).await.unwrap();
    let v1 = on_primary.set_override(&tenant, limit(3)).await.unwrap();
    let primary_url = primary.url();
    let synced = wait_until(Duration::from_secs(10), move || {
        let url = primary_url.clone();
        async move {
            let mut conn = connection(&url).await;
            let acked: i64 = redis::cmd("WAIT")
                .arg(1)
                .arg(200)
                .query_async(&mut conn)
                .await
                .unwrap();
            acked == 1
        }
    })
    .await;
    assert!(synced, "the replica acknowledged the first writes");

    // The replica loses its primary (pointed at a port nobody listens on): it keeps its
    // data but misses everything the primary issues from now on.
    let nowhere = support::free_port();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(nowhere)
        .query_async(&mut replica_conn)
        .await
        .unwrap();
    let mut lost = Vec::new();
    for _ in 0..2 {
        lost.push(on_primary.admit(request(Some(tenant), 1)).await.unwrap());
    }
    let v2 = on_primary.set_override(&tenant, limit(4)).await.unwrap();
    assert!(v2 > v1);
    let last_token = lost.last().unwrap().lease().unwrap().fencing_token.value();
    assert!(
        last_token > replicated.lease().unwrap().fencing_token.value(),
        "tokens increase on one server"
    );

    // Promote the lagging replica.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut replica_conn)
        .await
        .unwrap();
    let on_replica = provider(&config(&replica.url(), &cell));
    assert_eq!(
        snapshot(&on_replica, Some(&tenant)).await.policy_version,
        v1,
        "the promoted replica really missed the last policy change"
    );
    let promoted = on_replica.admit(request(Some(tenant), 1)).await.unwrap();
    let promoted_token = promoted.lease().unwrap().fencing_token.value();
    assert!(
        promoted_token > last_token,
        "token {promoted_token} after failover is above {last_token}"
    );
    let v3 = on_replica.set_override(&tenant, limit(3)).await.unwrap();
    assert!(v3 > v2, "policy version {v3} after failover is above {v2}");

    // Restart with no data at all.
    drop(promoted);
    replica.restart();
    let restarted = wait_until(Duration::from_secs(10), || {
        let on_replica = on_replica.clone();
        async move { on_replica.snapshot(None, None).await.is_ok() }
    })
    .await;
    assert!(restarted, "the restarted server answers");
    let fresh = on_replica.admit(request(Some(tenant), 1)).await.unwrap();
    let fresh_token = fresh.lease().unwrap().fencing_token.value();
    assert!(
        fresh_token > promoted_token,
        "token {fresh_token} after an empty restart"
    );
    let v4 = on_replica.set_override(&tenant, limit(4)).await.unwrap();
    assert!(v4 > v3, "policy version {v4} after an empty restart");
    drop((replicated, lost, fresh));
}
