//! A two-node cluster of real `graviton serve` processes (blocks on the test S3 server)
//! with mutual TLS on the internal listener: forwarding works with the node certificates; a client without a
//! certificate, or with one from another CA, cannot even complete the handshake; a valid
//! certificate without the internal token still gets 401 (second factor); a slowloris
//! client is cut off the internal listener; the ractor_cluster control plane forms its
//! sessions over mutual TLS and refuses a client without a certificate; and `POST /v1/admin/nodes/{id}/drain` moves
//! a node's shards like `graviton drain`.
//!
//! Checks EDGE-5, EDGE-6 (docs/invariants.md).

mod support;

use std::time::Duration;

use graviton::ids::{NodeId, SessionId, SessionKey, TenantId};
use support::client;
use support::cluster::{NodeProcess, TOKEN, all_nodes_own_shards, wait_converged};
use support::pki::TestPki;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SHARDS: u32 = 16;
const ADMIN: &str = "edge-admin-token-0123456789";

async fn status(url: &str) -> graviton::cli::ClusterStatus {
    graviton::cli::cluster_status(url)
        .await
        .expect("cluster status")
}

fn owner_of(status: &graviton::cli::ClusterStatus, key: &SessionKey) -> Option<NodeId> {
    support::cluster::owner_of(status, SHARDS, key)
}

async fn curl(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new("curl")
        .args(["--silent", "--show-error", "--max-time", "20"])
        .args(args)
        .output()
        .await
        .expect("run curl")
}

/// Connect with TLS, trusting the CA but presenting no certificate; true when the
/// server refuses (handshake error, alert or close) instead of talking.
async fn uncertified_tls_is_refused(ca: &std::path::Path, port: u16) -> bool {
    use rustls_pki_types::pem::PemObject;
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name =
        rustls_pki_types::ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into());
    let Ok(mut tls) = connector.connect(name, tcp).await else {
        return true; // refused during the handshake
    };
    // TLS 1.3: the client finishes first; the server's refusal arrives as an alert.
    let _ = tls.write_all(b"hello").await;
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_cluster_forwards_refuses_uncertified_peers_and_drains_over_http() {
    let test = "mtls_cluster_forwards_refuses_uncertified_peers_and_drains_over_http";
    let Some(db) = support::TestDatabase::create("mtls_cluster_forwards_and_drains").await else {
        return;
    };
    let pki = TestPki::new();
    let other_ca = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("edge-cluster-{}", support::unique_suffix());
    let names = ["node-a", "node-b"];
    let mut certs = Vec::new();
    let Some(nodes) = names
        .iter()
        .map(|id| {
            let (cert, key) = pki.issue(id);
            certs.push((cert.clone(), key.clone()));
            let extra = format!(
                "[admin]\ntoken = \"{ADMIN}\"\n\n[http]\nheader_read_timeout = \"1s\"\n\n\
                 [http.internal_tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n",
                cert.display(),
                key.display(),
                pki.ca.display()
            );
            NodeProcess::start_on_s3(test, dir.path(), id, db.url(), SHARDS, &prefix, &extra)
        })
        .collect::<Option<Vec<NodeProcess>>>()
    else {
        return;
    };
    let refs: Vec<&NodeProcess> = nodes.iter().collect();
    wait_converged(
        &refs,
        db.url(),
        "the nodes ready, each owning shards",
        all_nodes_own_shards,
    )
    .await;

    // The control plane runs over mutual TLS too: both nodes report a ready session.
    let sessions = support::wait_until(Duration::from_secs(30), || async {
        nodes
            .iter()
            .all(|n| n.log_text().contains("control: peer session ready"))
    })
    .await;
    assert!(sessions, "no control session: {}", nodes[0].log_text());
    // A client without a certificate cannot hold a TLS session with the control
    // listener: the server aborts the handshake ("certificate required").
    let control_port: u16 = std::fs::read_to_string(&nodes[1].config)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("control_listen = \"127.0.0.1:"))
        .and_then(|rest| rest.trim_end_matches('"').parse().ok())
        .expect("control port in config");
    assert!(
        uncertified_tls_is_refused(&pki.ca, control_port).await,
        "control listener accepted a client without a certificate"
    );
    assert!(
        uncertified_tls_is_refused(&pki.ca, nodes[1].internal).await,
        "internal listener accepted a client without a certificate"
    );

    // Forwarding over mutual TLS: a node-b session uploaded through node-a.
    let table = status(db.url()).await;
    let key = loop {
        let key = SessionKey {
            tenant: TenantId::new_random(),
            session: SessionId::new_random(),
        };
        if owner_of(&table, &key).is_some_and(|o| o.as_str() == "node-b") {
            break key;
        }
    };
    let response = client()
        .post(format!("{}/v1/blobs", nodes[0].url))
        .header("x-graviton-tenant-id", key.tenant.to_string())
        .header("x-graviton-upload-session-id", key.session.to_string())
        .body(b"forwarded over mTLS".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{}", nodes[0].log_text());
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["owner"], "node-b");

    // node-b's internal listener: no client certificate -> no handshake.
    let internal = format!(
        "https://127.0.0.1:{}/internal/v1/sessions/{}/{}/blobs",
        nodes[1].internal, key.tenant, key.session
    );
    let ca = pki.ca.to_str().unwrap();
    let out = curl(&["--cacert", ca, "-I", &internal]).await;
    assert!(!out.status.success(), "handshake without a client cert");
    // A certificate from another CA -> no handshake either.
    let (rogue_cert, rogue_key) = other_ca.issue("rogue");
    let out = curl(&[
        "--cacert",
        ca,
        "--cert",
        rogue_cert.to_str().unwrap(),
        "--key",
        rogue_key.to_str().unwrap(),
        "-I",
        &internal,
    ])
    .await;
    assert!(!out.status.success(), "handshake with a foreign cert");
    // A valid certificate but no token -> 401 (the token stays a second factor) ...
    let (cert, cert_key) = &certs[0];
    let with_cert = |extra: Vec<String>| {
        let mut args = vec![
            "--cacert".to_string(),
            ca.to_string(),
            "--cert".to_string(),
            cert.display().to_string(),
            "--key".to_string(),
            cert_key.display().to_string(),
            "-I".to_string(),
            "--write-out".to_string(),
            "%{http_code}".to_string(),
            "--output".to_string(),
            "/dev/null".to_string(),
        ];
        args.extend(extra);
        args.push(internal.clone());
        args
    };
    let args = with_cert(vec![]);
    let out = curl(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "401");
    // ... and with the token the pre-flight reaches the epoch check (400: no shard header).
    let args = with_cert(vec![
        "-H".to_string(),
        format!("X-Graviton-Internal-Token: {TOKEN}"),
    ]);
    let out = curl(&args.iter().map(String::as_str).collect::<Vec<_>>()).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "400");

    // Slowloris on the internal listener: cut off by the 1 s header timeout (here, the
    // TLS handshake never finishes).
    let mut slow = tokio::net::TcpStream::connect(("127.0.0.1", nodes[1].internal))
        .await
        .unwrap();
    slow.write_all(&[0x16, 0x03]).await.unwrap();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(20), slow.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "still open: {closed:?}"
    );

    // The HTTP drain endpoint: admin token required, unknown node 404, then node-b drains.
    let drain = |node: &str, token: Option<&str>| {
        let mut request = client().post(format!("{}/v1/admin/nodes/{node}/drain", nodes[0].url));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    assert_eq!(drain("node-b", None).await.unwrap().status(), 401);
    assert_eq!(
        drain("node-b", Some("wrong-token-0123456789"))
            .await
            .unwrap()
            .status(),
        401
    );
    let unknown = drain("node-zz", Some(ADMIN)).await.unwrap();
    assert_eq!(unknown.status(), 404);
    let body: serde_json::Value = unknown.json().await.unwrap();
    assert_eq!(body["error"], "node_not_found");
    let accepted = drain("node-b", Some(ADMIN)).await.unwrap();
    assert_eq!(accepted.status(), 202);
    let drained = support::wait_until(Duration::from_secs(30), || async {
        status(db.url())
            .await
            .nodes
            .iter()
            .any(|n| n.id.as_str() == "node-b" && n.shards == 0)
    })
    .await;
    assert!(drained, "drain did not move node-b's shards");
    // The drained node's session now lands on node-a.
    let response = client()
        .post(format!("{}/v1/blobs", nodes[1].url))
        .header("x-graviton-tenant-id", key.tenant.to_string())
        .header("x-graviton-upload-session-id", key.session.to_string())
        .body(b"after the HTTP drain".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201, "{}", nodes[1].log_text());
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["owner"], "node-a");

    // Both uploads' blocks are in the bucket (a pack each), none on a node's disk.
    support::cluster::assert_packs_in_bucket_only(dir.path(), &names, &prefix, 2).await;
}

#[tokio::test]
async fn drain_endpoint_in_embedded_mode_is_a_clear_409() {
    let node = support::node::TestNode::start_with(
        |c| c.admin.token = Some(graviton::config::Secret::new(ADMIN)),
        graviton::node::NodeOptions::default(),
    )
    .await;
    let response = client()
        .post(format!("{}/v1/admin/nodes/local/drain", node.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 409);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "not_clustered");
    let bad = client()
        .post(format!("{}/v1/admin/nodes/bad%20id/drain", node.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}
