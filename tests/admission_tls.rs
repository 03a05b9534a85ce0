//! `rediss://` end to end against a real `redis-server` with `--tls-port` and a CA made in
//! the test (openssl CLI): `verify_tls = false` connects and admits; `verify_tls = true`
//! refuses the certificate of a CA the system does not trust (fails closed, 503 kind).

#[allow(unused_imports)]
mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use graviton::admission::{
    Admission, AdmissionConfig, AdmissionMetrics, Error, Footprint, Operation,
    RedisAdmissionConfig, TransferRequest,
};
use graviton::config::{ByteSize, HumanDuration};
use graviton::ids::TenantId;

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl on PATH");
    assert!(status.success(), "openssl {args:?}");
}

struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn config(port: u16, verify_tls: bool) -> AdmissionConfig {
    AdmissionConfig {
        process_bytes: ByteSize::mib(64),
        tenant_bytes: ByteSize::mib(64),
        acquisition_timeout: HumanDuration::secs(3),
        redis: Some(RedisAdmissionConfig {
            url: format!("rediss://127.0.0.1:{port}/"),
            verify_tls,
            cell: format!("tls-{}", support::unique_suffix()),
            lease_ttl: HumanDuration::secs(3),
            renew_interval: HumanDuration::secs(1),
            wait: HumanDuration::secs(2),
            retry_interval: HumanDuration::millis(20),
            ..RedisAdmissionConfig::default()
        }),
        ..AdmissionConfig::default()
    }
}

fn request() -> TransferRequest {
    TransferRequest {
        operation: Operation::Upload,
        tenant: Some(TenantId::new_random()),
        backend: "fs".into(),
        footprint: Footprint::new(1 << 20).unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_connects_without_verification_and_refuses_an_untrusted_ca_with_it() {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        support::missing_service("rediss", "redis-server binary not found on PATH");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    openssl(d, &["genrsa", "-out", "ca.key", "2048"]);
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-days",
            "2",
            "-subj",
            "/CN=graviton-test-ca",
            "-out",
            "ca.crt",
        ],
    );
    openssl(d, &["genrsa", "-out", "server.key", "2048"]);
    openssl(
        d,
        &[
            "req",
            "-new",
            "-key",
            "server.key",
            "-subj",
            "/CN=127.0.0.1",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(d.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "server.crt",
        ],
    );
    let port = support::free_port();
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
            .args(["--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(d.join("server.crt"))
            .arg("--tls-key-file")
            .arg(d.join("server.key"))
            .arg("--tls-ca-cert-file")
            .arg(d.join("ca.crt"))
            .args(["--tls-auth-clients", "no", "--dir"])
            .arg(d)
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

    // Without verification: connects over TLS and admits.
    let insecure = Admission::new(&config(port, false), AdmissionMetrics::default()).unwrap();
    let permit = insecure
        .admit(request())
        .await
        .expect("admitted over rediss://");
    assert!(permit.lease().is_some());
    permit.finish(graviton::admission::Outcome::Completed).await;
    let snapshot = insecure.snapshot(None, None).await.unwrap();
    assert_eq!(snapshot.cluster.unwrap().occupancy.service_transfers, 0);

    // With verification: the test CA is not a trusted root, so the handshake fails and
    // admission fails closed.
    let strict = Admission::new(&config(port, true), AdmissionMetrics::default()).unwrap();
    match strict.admit(request()).await {
        Err(Error::Unavailable(_)) => {}
        other => panic!("an untrusted certificate must fail closed, got {other:?}"),
    }
}
