//! `[admission]` configuration through the public loader, secret redaction, and the
//! embedded default (local admission, no Redis).

use std::time::Duration;

use graviton::admission::{
    Admission, AdmissionMetrics, Error, Footprint, Operation, Outcome, TransferRequest,
};
use graviton::config::{Config, ConfigError};
use graviton::ids::TenantId;

fn problems(toml: &str) -> Vec<String> {
    match Config::from_toml_str(toml) {
        Ok(_) => Vec::new(),
        Err(ConfigError::Invalid(problems)) => problems.iter().map(|p| p.key.to_string()).collect(),
        Err(other) => vec![other.to_string()],
    }
}

#[test]
fn embedded_default_has_no_redis_and_validates() {
    let config = Config::from_toml_str("").unwrap();
    assert!(config.admission.redis.is_none());
    assert!(!config.admission.tenant_mode);
}

#[test]
fn redis_section_takes_human_units_and_defaults() {
    let config = Config::from_toml_str(
        "[admission]\nprocess_bytes = \"1GiB\"\n[admission.redis]\nurl = \"redis://10.0.0.5:6379/\"\nlease_ttl = \"45s\"\nrenew_interval = \"15s\"\nlease_loss = \"report\"\n",
    )
    .unwrap();
    let redis = config.admission.redis.unwrap();
    assert_eq!(redis.lease_ttl.get(), Duration::from_secs(45));
    assert_eq!(redis.cell, "default");
    assert_eq!(
        redis.lease_loss,
        graviton::admission::LeaseLossPolicy::Report
    );
    assert_eq!(config.admission.process_bytes.bytes(), 1 << 30);
}

#[test]
fn unsafe_settings_are_rejected_naming_their_keys() {
    assert_eq!(
        problems("[admission.redis]\nlease_ttl = \"3s\"\nrenew_interval = \"2s\"\n"),
        ["admission.redis.renew_interval"]
    );
    assert_eq!(
        problems(
            "[admission.redis]\ntenant_transfers = 500\nservice_transfers = 100\nbackend_transfers = 50\n"
        ),
        ["admission.redis.tenant_transfers"]
    );
    assert_eq!(
        problems(
            "[admission]\nprocess_bytes = \"8GiB\"\n[admission.redis]\nservice_bytes = \"4GiB\"\n"
        ),
        ["admission.redis.service_bytes"]
    );
    assert_eq!(
        problems("[admission]\nacquisition_timeout = \"5s\"\n[admission.redis]\nwait = \"10s\"\n"),
        ["admission.redis.wait"]
    );
    assert_eq!(
        problems(
            "[admission]\ntenant_mode = true\ncell = \"eu-1\"\n[admission.redis]\nurl = \"redis://r:6379/\"\ncell = \"eu-2\"\n"
        ),
        [
            "admission.redis.url",
            "admission.redis.password",
            "admission.redis.cell",
            // Tenant mode also requires authentication (issue 11).
            "auth.enabled"
        ]
    );
    assert!(
        problems(
            "[admission]\ntenant_mode = true\ncell = \"eu-1\"\n[admission.redis]\nurl = \"rediss://r:6380/\"\ncell = \"eu-1\"\npassword = \"a-long-redis-password\"\n\
             [auth]\nenabled = true\n[[auth.issuers]]\nissuer = \"https://idp.example\"\naudience = [\"graviton\"]\njwks_file = \"/etc/graviton/jwks.json\"\n"
        )
        .is_empty()
    );
    let unknown = problems("[admission.redis]\nleese_ttl = \"3s\"\n");
    assert!(
        unknown.iter().any(|p| p.contains("leese_ttl")),
        "{unknown:?}"
    );
}

#[tokio::test]
async fn secrets_are_absent_from_debug_and_errors() {
    let config = Config::from_toml_str(
        "[admission.redis]\npassword = \"pw-6f1d-very-secret\"\nid_secret = \"ids-9a7c-very-secret\"\n",
    )
    .unwrap();
    let debug = format!("{config:?}");
    assert!(!debug.contains("pw-6f1d"), "{debug}");
    assert!(!debug.contains("ids-9a7c"), "{debug}");
    let admission = Admission::new(&config.admission, AdmissionMetrics::default()).unwrap();
    let debug = format!("{admission:?} {:?}", admission.coordinator().unwrap());
    assert!(
        !debug.contains("pw-6f1d") && !debug.contains("ids-9a7c"),
        "{debug}"
    );
    let err =
        Config::from_toml_str("[admission.redis]\nurl = \"redis://u:pw-in-url-secret@h:1/\"\n")
            .unwrap_err();
    assert!(!err.to_string().contains("pw-in-url-secret"), "{err}");
}

#[tokio::test]
async fn local_mode_admits_without_redis() {
    let config = Config::default();
    let admission = Admission::new(&config.admission, AdmissionMetrics::default()).unwrap();
    assert!(!admission.is_distributed());
    let tenant = TenantId::new_random();
    let request = TransferRequest {
        operation: Operation::Upload,
        tenant: Some(tenant),
        backend: "fs".into(),
        footprint: Footprint::for_operation(
            Operation::Upload,
            graviton::cas::chunker::MAX_CHUNK as u64,
        ),
    };
    let permit = admission.admit(request).await.unwrap();
    assert!(permit.lease().is_none());
    admission.charge_request(&tenant).await.unwrap();
    admission.charge_egress(&tenant, 1 << 40).await.unwrap();
    assert!(matches!(
        admission.clear_override(&tenant).await,
        Err(Error::NotDistributed)
    ));
    let snap = admission.snapshot(None, None).await.unwrap();
    assert!(snap.cluster.is_none());
    assert_eq!(
        snap.local.process_bytes_capacity - snap.local.process_bytes_available,
        Footprint::for_operation(Operation::Upload, graviton::cas::chunker::MAX_CHUNK as u64)
            .bytes()
    );
    permit.finish(Outcome::Completed).await;
    let snap = admission.snapshot(None, None).await.unwrap();
    assert_eq!(
        snap.local.process_bytes_available,
        snap.local.process_bytes_capacity
    );
}
