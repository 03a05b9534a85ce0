//! Cluster admission against a real 3-primary Redis Cluster (one replica per primary)
//! started by the test (`tests/support/redis_cluster.rs`): the coordinator uses the
//! cluster client (`admission.redis.cluster = true`), follows `MOVED`/`ASK` through a slot
//! migration of the cell's slot and a primary failover while two providers keep admitting,
//! and the event-stream sweep shows no ceiling exceeded and no fencing token going
//! backwards (ADM-9, ADM-10). The same cluster TLS-only (client, bus and replication
//! links; `rediss://` seeds) admits through a seed that does not serve the cell's slot with
//! verification against its CA, and fails closed against another CA or the system roots
//! (ADM-9, ADM-11).

#[allow(unused_imports)] // the shared harness also exports PostgreSQL helpers
mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use graviton::admission::{
    Admission, AdmissionConfig, AdmissionMetrics, Error, Footprint, Operation, Outcome,
    RedisAdmissionConfig, TransferRequest,
};
use graviton::config::{ByteSize, HumanDuration};
use graviton::ids::TenantId;
use graviton::storage::redis::CellKeys;
use support::admission_events::{self, n};
use support::pki::TestPki;
use support::redis_cluster::{ClusterTls, RedisCluster};
use support::{unique_suffix, wait_until};

const MIB: u64 = 1 << 20;

fn config(url: String, seeds: Vec<String>, cell: &str) -> AdmissionConfig {
    let config = AdmissionConfig {
        process_bytes: ByteSize::mib(64),
        tenant_bytes: ByteSize::mib(64),
        tenant_transfers: 64,
        backend_transfers: 64,
        acquisition_timeout: HumanDuration::secs(10),
        redis: Some(RedisAdmissionConfig {
            url,
            cluster: true,
            seeds,
            cell: cell.to_string(),
            key_prefix: "it".to_string(),
            lease_ttl: HumanDuration::secs(3),
            renew_interval: HumanDuration::secs(1),
            wait: HumanDuration::secs(8),
            retry_interval: HumanDuration::millis(10),
            service_bytes: ByteSize::mib(64),
            service_transfers: 6,
            tenant_bytes: ByteSize::mib(32),
            tenant_transfers: 3,
            backend_transfers: 5,
            max_events: 100_000,
            ..RedisAdmissionConfig::default()
        }),
        ..AdmissionConfig::default()
    };
    assert!(config.problems().is_empty(), "{:?}", config.problems());
    config
}

fn request(tenant: TenantId, mib: u64) -> TransferRequest {
    TransferRequest {
        operation: Operation::Upload,
        tenant: Some(tenant),
        backend: "fs".to_string(),
        footprint: Footprint::new(mib * MIB).unwrap(),
    }
}

/// The cell's slot and a primary that does not serve it (a seed that must redirect).
fn slot_and_other_primary(cluster: &RedisCluster, cell: &str) -> (u16, usize) {
    let keys = CellKeys::new("it", cell);
    let slot = cluster.keyslot(keys.counts());
    let owner = cluster.owner(slot);
    let other = cluster
        .topology()
        .into_iter()
        .find(|n| n.primary && n.id != owner.id)
        .unwrap();
    let index = cluster
        .nodes
        .iter()
        .position(|node| node.port == other.port)
        .unwrap();
    (slot, index)
}

#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    timed_out: AtomicU64,
    unavailable: AtomicU64,
}

/// 24 workers over two providers and three tenants, admitting until `stop`.
fn load(
    providers: &[Admission; 2],
    stop: &Arc<AtomicBool>,
    tally: &Arc<Tally>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let tenants: Vec<TenantId> = (0..3).map(|_| TenantId::new_random()).collect();
    (0..24u64)
        .map(|worker| {
            let admission = providers[(worker % 2) as usize].clone();
            let tenant = tenants[(worker % 3) as usize];
            let (stop, tally) = (stop.clone(), tally.clone());
            tokio::spawn(async move {
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    let mib = 4 + (worker * 7 + round * 3) % 17;
                    match admission.admit(request(tenant, mib)).await {
                        Ok(permit) => {
                            tally.admitted.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(5 + (worker + round) % 15))
                                .await;
                            permit.finish(Outcome::Completed).await;
                        }
                        Err(Error::TimedOut(_)) => {
                            tally.timed_out.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::Unavailable(_)) => {
                            tally.unavailable.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        Err(other) => panic!("unexpected admission error {other:?}"),
                    }
                }
            })
        })
        .collect()
}

/// Run the load, apply `fault` once at least 20 admissions happened, keep loading until
/// 20 more happened after it, then sweep the event stream: no ceiling exceeded, tokens
/// only rising, every admission completed or expired.
async fn fault_under_load(cluster: &RedisCluster, fault: impl FnOnce(u16) -> u16) -> u16 {
    let cell = format!("cl-{}", unique_suffix());
    let (slot, seed) = slot_and_other_primary(cluster, &cell);
    let other_seed = (seed + 1) % cluster.nodes.len();
    let cfg = config(cluster.url(seed), vec![cluster.url(other_seed)], &cell);
    let providers = [
        Admission::new(&cfg, AdmissionMetrics::default()).unwrap(),
        Admission::new(
            &config(cluster.url(other_seed), vec![cluster.url(seed)], &cell),
            AdmissionMetrics::default(),
        )
        .unwrap(),
    ];
    let (stop, tally) = (Arc::new(AtomicBool::new(false)), Arc::new(Tally::default()));
    let workers = load(&providers, &stop, &tally);
    let started = wait_until(Duration::from_secs(60), || async {
        tally.admitted.load(Ordering::Relaxed) >= 20
    })
    .await;
    assert!(started, "no load before the fault");
    let new_owner = tokio::task::block_in_place(|| fault(slot));
    let before = tally.admitted.load(Ordering::Relaxed);
    let recovered = wait_until(Duration::from_secs(60), || async {
        tally.admitted.load(Ordering::Relaxed) >= before + 20
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(
        recovered,
        "admissions did not resume after the fault (timed out {}, unavailable {})",
        tally.timed_out.load(Ordering::Relaxed),
        tally.unavailable.load(Ordering::Relaxed)
    );
    let coordinator = providers[0].coordinator().unwrap();
    // Leases whose release failed during the fault expire after the TTL; reap them.
    tokio::time::sleep(Duration::from_secs(4)).await;
    coordinator.reap().await.unwrap();
    let events = coordinator.recent_events(1_000_000).await.unwrap();
    let kinds = admission_events::sweep(&events, cfg.redis.as_ref().unwrap());
    let admitted = kinds.get("admitted").copied().unwrap_or(0);
    let ended =
        kinds.get("completed").copied().unwrap_or(0) + kinds.get("expired").copied().unwrap_or(0);
    assert_eq!(admitted, ended, "{kinds:?}");
    assert!(admitted >= 40, "{kinds:?}");
    let idle = providers[1]
        .snapshot(None, Some("fs"))
        .await
        .unwrap()
        .cluster
        .unwrap();
    assert_eq!(idle.occupancy.service_transfers, 0);
    assert_eq!(idle.occupancy.service_bytes, 0);
    eprintln!(
        "fault under load: {kinds:?}, timed out {}, unavailable {}",
        tally.timed_out.load(Ordering::Relaxed),
        tally.unavailable.load(Ordering::Relaxed)
    );
    let _ = slot;
    new_owner
}

/// Admit and release through a seed that does not serve the cell's slot (ADM-9); `tls`
/// `ca` names the CA file (verification on) of a TLS cluster.
async fn admit_and_release_through_another_seed(cluster: &RedisCluster, ca: Option<&Path>) {
    let cell = format!("cl-{}", unique_suffix());
    let (slot, seed) = slot_and_other_primary(cluster, &cell);
    let owner = cluster.owner(slot);
    let admission = Admission::new(
        &with_ca(config(cluster.url(seed), vec![], &cell), ca),
        AdmissionMetrics::default(),
    )
    .unwrap();
    assert!(admission.coordinator().unwrap().is_cluster());
    let tenant = TenantId::new_random();
    let permit = admission.admit(request(tenant, 8)).await.unwrap();
    let token = permit
        .lease()
        .expect("a cluster lease")
        .fencing_token
        .value();
    let busy = admission
        .snapshot(Some(&tenant), Some("fs"))
        .await
        .unwrap()
        .cluster
        .unwrap();
    assert_eq!(busy.occupancy.service_transfers, 1);
    assert_eq!(busy.occupancy.service_bytes, 8 * MIB);
    permit.finish(Outcome::Completed).await;
    let idle = admission
        .snapshot(Some(&tenant), Some("fs"))
        .await
        .unwrap()
        .cluster
        .unwrap();
    assert_eq!(idle.occupancy.service_transfers, 0);
    admission.charge_request(&tenant).await.unwrap();
    // ADM-9: all of the cell's keys live on the slot's primary, none on the seed.
    assert!(cluster.count_keys(owner.port, slot) >= 3);
    assert_eq!(cluster.count_keys(cluster.nodes[seed].port, slot), 0);
    let events = admission
        .coordinator()
        .unwrap()
        .recent_events(100)
        .await
        .unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e["kind"] == "admitted")
            .map(|e| n(e, "fencing_token"))
            .collect::<Vec<_>>(),
        [token as i64]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admits_and_releases_through_a_seed_that_does_not_serve_the_cells_slot() {
    let Some(cluster) = RedisCluster::start("admission_cluster_basic", 3, 1) else {
        return;
    };
    admit_and_release_through_another_seed(&cluster, None).await;
}

/// `verify_tls` stays on; `ca` replaces the system roots.
fn with_ca(mut config: AdmissionConfig, ca: Option<&Path>) -> AdmissionConfig {
    let redis = config.redis.as_mut().expect("a coordinator");
    redis.verify_tls = true;
    redis.ca_file = ca.map(Into::into);
    assert!(config.problems().is_empty(), "{:?}", config.problems());
    config
}

// ADM-9 and ADM-11 over a TLS-only cluster (client, bus and replication links).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_admits_through_another_seed_with_its_ca_and_refuses_a_wrong_ca() {
    let pki = TestPki::new();
    let Some(cluster) =
        RedisCluster::start_tls("admission_cluster_tls", 3, 1, ClusterTls::issued_by(&pki))
    else {
        return;
    };
    admit_and_release_through_another_seed(&cluster, Some(&pki.ca)).await;

    // Another CA's file, then the system roots: neither holds the cluster's CA, so the
    // handshake fails and nothing reaches the cluster. The refusal is `Unavailable` (503)
    // with the category `tls_certificate_rejected`, as on one server (the cluster client
    // itself reports `ClusterConnectionNotFound`; the connection asks the first seed why).
    let cell = format!("cl-{}", unique_suffix());
    let (slot, seed) = slot_and_other_primary(&cluster, &cell);
    let other = TestPki::new();
    for ca in [Some(other.ca.as_path()), None] {
        let admission = Admission::new(
            &with_ca(config(cluster.url(seed), vec![], &cell), ca),
            AdmissionMetrics::default(),
        )
        .unwrap();
        match admission.admit(request(TenantId::new_random(), 1)).await {
            Err(Error::Unavailable(reason)) => assert!(
                reason.contains("tls_certificate_rejected"),
                "the refusal names the certificate: {reason}"
            ),
            other => panic!("a wrong CA must fail closed, got {other:?}"),
        }
    }
    assert_eq!(cluster.count_keys(cluster.owner(slot).port, slot), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_migration_of_the_cells_slot_during_load_keeps_every_ceiling() {
    let Some(cluster) = RedisCluster::start("admission_cluster_migration", 3, 1) else {
        return;
    };
    let mut moved = None;
    let new_owner = fault_under_load(&cluster, |slot| {
        let old = cluster.owner(slot).port;
        moved = Some((slot, old));
        cluster.migrate_slot(slot, Duration::from_millis(30))
    })
    .await;
    let (slot, old) = moved.unwrap();
    assert_ne!(old, new_owner);
    assert_eq!(cluster.owner(slot).port, new_owner);
    assert!(cluster.count_keys(new_owner, slot) > 0, "the cell moved");
    assert_eq!(cluster.count_keys(old, slot), 0, "nothing left behind");
    let redirects = cluster.redirects(old) + cluster.redirects(new_owner);
    eprintln!("MOVED/ASK/TRYAGAIN answers during and after the migration: {redirects}");
    assert!(redirects > 0, "the clients were never redirected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_failover_during_load_keeps_every_ceiling_and_tokens_rise() {
    let Some(mut cluster) = RedisCluster::start("admission_cluster_failover", 3, 1) else {
        return;
    };
    let cell_probe = std::cell::Cell::new(0u16);
    let promoted = fault_under_load(&cluster, |slot| {
        cell_probe.set(slot);
        cluster.failover(slot)
    })
    .await;
    let slot = cell_probe.get();
    assert_eq!(cluster.owner(slot).port, promoted);

    // Then a hard failure: SIGKILL of the new primary, its replica (the old primary) is
    // promoted after cluster-node-timeout. The next token is above every earlier one
    // (ADM-8 across a Cluster failover).
    let cell = format!("cl-{}", unique_suffix());
    let seed = cluster
        .nodes
        .iter()
        .position(|node| node.port != promoted)
        .unwrap();
    let admission = Admission::new(
        &config(cluster.url(seed), vec![], &cell),
        AdmissionMetrics::default(),
    )
    .unwrap();
    let slot = cluster.keyslot(CellKeys::new("it", &cell).counts());
    let tenant = TenantId::new_random();
    let mut tokens = Vec::new();
    for _ in 0..3 {
        let permit = admission.admit(request(tenant, 1)).await.unwrap();
        tokens.push(permit.lease().unwrap().fencing_token.value());
        permit.finish(Outcome::Completed).await;
    }
    let before = *tokens.iter().max().unwrap();
    tokio::task::block_in_place(|| cluster.kill_primary(slot));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let after = loop {
        match admission.admit(request(tenant, 1)).await {
            Ok(permit) => {
                let token = permit.lease().unwrap().fencing_token.value();
                permit.finish(Outcome::Completed).await;
                break token;
            }
            Err(Error::Unavailable(_) | Error::TimedOut(_)) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no admission after the kill -9 failover"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("unexpected admission error {other:?}"),
        }
    };
    assert!(
        after > before,
        "token went backwards: {before} then {after}"
    );
}
