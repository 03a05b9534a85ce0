//! `rediss://` end to end against a real `redis-server` with `--tls-port --port 0`, a CA and
//! a server certificate made in the test (rcgen, `tests/support/pki.rs`) and a password
//! (`--requirepass`):
//! * `verify_tls = true` with `ca_file` naming the test CA verifies the server and admits;
//! * `verify_tls = false` admits without verification;
//! * verification against the system roots, or against another CA's `ca_file`, is refused
//!   with the category `tls_certificate_rejected` (fails closed, 503 kind);
//! * a wrong password fails closed; neither password appears in an error, in `Debug`, or in
//!   anything logged at any level (ADM-11).

#[allow(unused_imports)]
mod support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use graviton::admission::{
    Admission, AdmissionConfig, AdmissionMetrics, Error, Footprint, Operation, Outcome,
    RedisAdmissionConfig, TransferRequest,
};
use graviton::config::{HumanDuration, Secret};
use graviton::ids::TenantId;
use support::pki::TestPki;

const PASSWORD: &str = "tls-redis-pw-51c0ffee";
const WRONG_PASSWORD: &str = "not-the-pw-7d1e9";

struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Everything logged by the test process, at every level.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn config(
    port: u16,
    verify_tls: bool,
    ca_file: Option<&std::path::Path>,
    password: &str,
) -> AdmissionConfig {
    let redis = RedisAdmissionConfig {
        verify_tls,
        ca_file: ca_file.map(Into::into),
        password: Some(Secret::new(password)),
        wait: HumanDuration::secs(2),
        retry_interval: HumanDuration::millis(20),
        ..support::admission::redis(format!("rediss://127.0.0.1:{port}/"), "tls")
    };
    support::admission::limits(redis, HumanDuration::secs(3))
}

fn request() -> TransferRequest {
    TransferRequest {
        operation: Operation::Upload,
        tenant: Some(TenantId::new_random()),
        backend: "fs".into(),
        footprint: Footprint::new(1 << 20).unwrap(),
    }
}

async fn admits(config: &AdmissionConfig) -> Admission {
    let admission = Admission::new(config, AdmissionMetrics::default()).unwrap();
    let permit = admission
        .admit(request())
        .await
        .expect("admitted over rediss://");
    assert!(permit.lease().is_some());
    permit.finish(Outcome::Completed).await;
    let snapshot = admission.snapshot(None, None).await.unwrap();
    assert_eq!(snapshot.cluster.unwrap().occupancy.service_transfers, 0);
    admission
}

async fn refused(config: &AdmissionConfig) -> String {
    let admission = Admission::new(config, AdmissionMetrics::default()).unwrap();
    match admission.admit(request()).await {
        Err(err @ Error::Unavailable(_)) => err.to_string(),
        other => panic!("must fail closed, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_verifies_against_ca_file_refuses_a_wrong_ca_and_never_shows_the_password() {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        support::missing_service("rediss", "redis-server binary not found on PATH");
        return;
    }
    let logs = Captured::default();
    let writer = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .expect("one subscriber per test binary");

    let pki = TestPki::new();
    let (cert, key) = pki.issue("redis");
    let other_ca = TestPki::new();
    let port = support::free_port();
    let dir = tempfile::tempdir().unwrap();
    let _server = Killed(
        Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--tls-port", &port.to_string(), "--requirepass", PASSWORD])
            .arg("--tls-cert-file")
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&key)
            .arg("--tls-ca-cert-file")
            .arg(&pki.ca)
            .args(["--tls-auth-clients", "no", "--dir"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server with TLS"),
    );
    let listening = support::wait_until(Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    assert!(listening, "redis-server did not open its TLS port");

    // Verified against the test CA named by ca_file.
    let verified = admits(&config(port, true, Some(&pki.ca), PASSWORD)).await;
    // Without verification.
    admits(&config(port, false, None, PASSWORD)).await;
    // Verified against the system roots, which do not hold the test CA.
    let system = refused(&config(port, true, None, PASSWORD)).await;
    assert!(system.contains("tls_certificate_rejected"), "{system}");
    // Verified against the wrong CA.
    let wrong_ca = refused(&config(port, true, Some(&other_ca.ca), PASSWORD)).await;
    assert!(wrong_ca.contains("tls_certificate_rejected"), "{wrong_ca}");
    // A wrong password over a verified connection.
    let wrong_password = refused(&config(port, true, Some(&pki.ca), WRONG_PASSWORD)).await;
    assert!(
        !wrong_password.contains("tls_certificate"),
        "{wrong_password}"
    );

    let debug = format!(
        "{:?} {:?}",
        verified.coordinator().unwrap(),
        config(port, true, Some(&pki.ca), PASSWORD)
    );
    let logged = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    for shown in [&system, &wrong_ca, &wrong_password, &debug, &logged] {
        assert!(!shown.contains(PASSWORD), "password shown: {shown}");
        assert!(!shown.contains(WRONG_PASSWORD), "password shown: {shown}");
    }
    assert!(
        logged.contains("admission coordinator call failed"),
        "the capture saw the failures' debug lines"
    );
}
