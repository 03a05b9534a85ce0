//! JWT authentication of the public API against a real node: every bad token is refused
//! with a JSON error before any body byte is read (the request declares 1,000,000 bytes
//! and sends 10; the answer arrives while the body is incomplete), nothing is stored,
//! the tenant header is bound to the token's organization, and a session-less upload is
//! attributed to the token's organization. JWKS from a file and from a real local HTTP
//! server (refetch on an unknown `kid`, rate limited).
//!
//! Checks EDGE-1, EDGE-2, EDGE-3, EDGE-4 (docs/invariants.md).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use graviton::auth::{AuthConfig, IssuerConfig};
use graviton::config::{Config, HumanDuration};
use graviton::node::NodeOptions;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;
use support::node::{TestNode, raw_exchange};

const ISSUER: &str = "https://idp.test";
const AUDIENCE: &str = "graviton";
const ORG: &str = "0b9c7a52-7f3e-4a1f-9d2e-2a4c6e8f0a11";
const OTHER_ORG: &str = "5d1e2f30-4a5b-4c6d-8e7f-9a0b1c2d3e4f";
const SESSION: &str = "7c9e6679-7425-40de-944b-e07fc1f90ae7";

/// A signing key of the test identity provider.
struct SigningKey {
    kid: String,
    alg: Algorithm,
    key: EncodingKey,
    jwk: Jwk,
}

impl SigningKey {
    fn es256(kid: &str) -> Self {
        Self::from_rcgen(kid, &rcgen::PKCS_ECDSA_P256_SHA256, Algorithm::ES256)
    }

    fn eddsa(kid: &str) -> Self {
        Self::from_rcgen(kid, &rcgen::PKCS_ED25519, Algorithm::EdDSA)
    }

    fn from_rcgen(kid: &str, alg: &'static rcgen::SignatureAlgorithm, jwt_alg: Algorithm) -> Self {
        let pair = rcgen::KeyPair::generate_for(alg).expect("generate key");
        let pem = pair.serialize_pem();
        let key = match jwt_alg {
            Algorithm::EdDSA => EncodingKey::from_ed_pem(pem.as_bytes()),
            _ => EncodingKey::from_ec_pem(pem.as_bytes()),
        }
        .expect("encoding key");
        let jwk: Jwk = match jwt_alg {
            // jsonwebtoken cannot derive an OKP JWK; build it from the raw public key.
            Algorithm::EdDSA => {
                use base64::Engine;
                let x =
                    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(pair.public_key_raw());
                serde_json::from_value(
                    json!({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid, "alg": "EdDSA"}),
                )
                .expect("OKP jwk")
            }
            _ => {
                let mut jwk = Jwk::from_encoding_key(&key, jwt_alg).expect("jwk");
                jwk.common.key_id = Some(kid.to_string());
                jwk
            }
        };
        Self {
            kid: kid.to_string(),
            alg: jwt_alg,
            key,
            jwk,
        }
    }

    fn sign(&self, claims: &serde_json::Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.key).expect("sign")
    }
}

fn now() -> i64 {
    jsonwebtoken::get_current_timestamp() as i64
}

fn claims(org: &str) -> serde_json::Value {
    json!({"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1", "org_id": org, "exp": now() + 600, "iat": now()})
}

fn issuer_with_file(path: &std::path::Path) -> IssuerConfig {
    IssuerConfig {
        issuer: ISSUER.into(),
        audience: vec![AUDIENCE.into()],
        jwks_file: Some(path.to_path_buf()),
        leeway: HumanDuration::secs(5),
        ..IssuerConfig::default()
    }
}

fn jwks(keys: &[&SigningKey]) -> String {
    serde_json::to_string(&JwkSet {
        keys: keys.iter().map(|k| k.jwk.clone()).collect(),
    })
    .unwrap()
}

async fn node_with_file(keys: &[&SigningKey], tweak: impl FnOnce(&mut Config)) -> TestNode {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jwks.json");
    std::fs::write(&path, jwks(keys)).unwrap();
    let node = TestNode::start_with(
        |c| {
            c.auth = AuthConfig {
                enabled: true,
                issuers: vec![issuer_with_file(&path)],
            };
            tweak(c);
        },
        NodeOptions::default(),
    )
    .await;
    drop(dir); // the file is read at start
    node
}

/// An upload head declaring 1,000,000 bytes, followed by only 10 of them.
fn partial_upload(extra_headers: &str) -> Vec<u8> {
    format!(
        "POST /v1/blobs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n{extra_headers}\r\n0123456789"
    )
    .into_bytes()
}

fn status_of(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn json_body(answer: &str) -> serde_json::Value {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|_| panic!("JSON error body: {answer}"))
}

fn assert_nothing_read_or_stored(node: &TestNode) {
    let text = node.metrics_text();
    assert_eq!(
        support::metrics::count(&text, "graviton_upload_bytes_total"),
        Some(0),
        "{text}"
    );
    assert_eq!(node.manifest_count(), 0);
    assert_eq!(node.block_count(), 0);
}

// Checks EDGE-1 and EDGE-2.
#[tokio::test]
async fn bad_tokens_are_refused_before_the_body_with_json_errors() {
    let key = SigningKey::es256("k1");
    let node = node_with_file(&[&key], |_| {}).await;
    let impostor = SigningKey::es256("k1"); // same kid, different key: wrong signature
    let stranger = SigningKey::es256("k-unknown");

    let mut expired = claims(ORG);
    expired["exp"] = json!(now() - 3600);
    let mut not_yet = claims(ORG);
    not_yet["nbf"] = json!(now() + 3600);
    let mut wrong_aud = claims(ORG);
    wrong_aud["aud"] = json!("someone-else");
    let mut wrong_iss = claims(ORG);
    wrong_iss["iss"] = json!("https://evil.test");
    let mut no_org = claims(ORG);
    no_org["org_id"] = json!("not-a-uuid");
    let valid = key.sign(&claims(ORG));
    // `alg: none`: header {"alg":"none"}, the valid payload, no signature.
    let payload = valid.split('.').nth(1).unwrap();
    let alg_none = format!("eyJhbGciOiJub25lIn0.{payload}.");

    let cases: Vec<(&str, String, u16, &str, &str)> = vec![
        ("missing", String::new(), 401, "unauthenticated", "required"),
        (
            "expired",
            format!("Authorization: Bearer {}\r\n", key.sign(&expired)),
            401,
            "invalid_token",
            "expired",
        ),
        (
            "not yet valid",
            format!("Authorization: Bearer {}\r\n", key.sign(&not_yet)),
            401,
            "invalid_token",
            "not valid yet",
        ),
        (
            "wrong audience",
            format!("Authorization: Bearer {}\r\n", key.sign(&wrong_aud)),
            401,
            "invalid_token",
            "audience",
        ),
        (
            "wrong issuer",
            format!("Authorization: Bearer {}\r\n", key.sign(&wrong_iss)),
            401,
            "invalid_token",
            "issuer",
        ),
        (
            "alg none",
            format!("Authorization: Bearer {alg_none}\r\n"),
            401,
            "invalid_token",
            "malformed",
        ),
        (
            "wrong signature",
            format!("Authorization: Bearer {}\r\n", impostor.sign(&claims(ORG))),
            401,
            "invalid_token",
            "signature",
        ),
        (
            "malformed",
            "Authorization: Bearer not.a.jwt\r\n".to_string(),
            401,
            "invalid_token",
            "malformed",
        ),
        (
            "not bearer",
            "Authorization: Basic dXNlcjpwdw==\r\n".to_string(),
            401,
            "invalid_token",
            "malformed",
        ),
        (
            "unknown kid (file JWKS)",
            format!("Authorization: Bearer {}\r\n", stranger.sign(&claims(ORG))),
            401,
            "invalid_token",
            "signing key",
        ),
        (
            "no organization",
            format!("Authorization: Bearer {}\r\n", key.sign(&no_org)),
            401,
            "invalid_token",
            "organization",
        ),
        (
            "tenant mismatch",
            format!(
                "Authorization: Bearer {valid}\r\nX-Graviton-Tenant-Id: {OTHER_ORG}\r\nX-Graviton-Upload-Session-Id: {SESSION}\r\n"
            ),
            403,
            "tenant_mismatch",
            "organization",
        ),
    ];
    for (name, headers, status, code, needle) in &cases {
        let (_stream, answer) = raw_exchange(node.addr(), &partial_upload(headers)).await;
        assert_eq!(status_of(&answer), *status, "{name}: {answer}");
        let body = json_body(&answer);
        assert_eq!(body["error"], *code, "{name}: {answer}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .to_lowercase()
                .contains(needle),
            "{name}: {answer}"
        );
        if *status == 401 {
            let challenge = answer
                .lines()
                .find(|l| l.to_ascii_lowercase().starts_with("www-authenticate:"))
                .unwrap_or_else(|| panic!("{name}: no WWW-Authenticate: {answer}"));
            assert!(challenge.contains("Bearer"), "{name}: {challenge}");
        }
        // The token never comes back in the answer.
        if let Some(token) = headers.strip_prefix("Authorization: Bearer ") {
            let token = token.split("\r\n").next().unwrap();
            assert!(!answer.contains(token), "{name}: token echoed");
        }
    }
    assert_nothing_read_or_stored(&node);
    // Downloads need the token too.
    let blob = graviton::cas::BlobKey::of(b"never stored").to_string();
    let response = reqwest::get(format!("{}/v1/blobs/{blob}", node.url))
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    // Refusals are counted by reason (bounded labels, no ids).
    let text = node.metrics_text();
    assert_eq!(
        support::metrics::count(&text, "graviton_auth_failures_total{reason=\"expired\"}"),
        Some(1),
        "{text}"
    );
    assert!(!text.contains(ORG), "tenant id in metrics");
}

// Checks EDGE-2 and EDGE-3.
#[tokio::test]
async fn valid_tokens_bind_the_tenant_and_session_less_uploads_to_the_org() {
    let es = SigningKey::es256("k-es");
    let ed = SigningKey::eddsa("k-ed");
    // One transfer per tenant at a time, refused quickly: shows whose budget is used.
    let node = node_with_file(&[&es, &ed], |c| {
        c.admission.tenant_transfers = 1;
        c.admission.acquisition_timeout = HumanDuration::millis(300);
    })
    .await;
    let client = reqwest::Client::new();
    // ES256 and EdDSA tokens are both accepted; the matching tenant header is fine.
    for (key, body) in [(&es, "es256 body"), (&ed, "eddsa body")] {
        let response = client
            .post(format!("{}/v1/blobs", node.url))
            .bearer_auth(key.sign(&claims(ORG)))
            .header("X-Graviton-Tenant-Id", ORG)
            .header("X-Graviton-Upload-Session-Id", SESSION)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "{:?}", response.text().await);
    }
    // A session-less upload without the tenant header holds ORG's one transfer...
    let mut held = tokio::net::TcpStream::connect(node.addr()).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut held,
        &partial_upload(&format!(
            "Authorization: Bearer {}\r\n",
            es.sign(&claims(ORG))
        )),
    )
    .await
    .unwrap();
    // It is admitted once its first body bytes are being ingested.
    let before = "es256 body".len() + "eddsa body".len();
    let admitted = support::wait_until(Duration::from_secs(10), || async {
        node.metric("graviton_upload_bytes_total") == Some(before as u64 + 10)
    })
    .await;
    assert!(admitted, "{}", node.metrics_text());
    // ...so a second one for ORG is refused by ORG's tenant limit (it was charged to the
    // token's organization, not to "no tenant"), while OTHER_ORG's upload goes through.
    let second = client
        .post(format!("{}/v1/blobs", node.url))
        .bearer_auth(es.sign(&claims(ORG)))
        .body("second body")
        .send()
        .await
        .unwrap();
    let status = second.status().as_u16();
    assert!(status == 429 || status == 503, "{status}");
    let other = client
        .post(format!("{}/v1/blobs", node.url))
        .bearer_auth(es.sign(&claims(OTHER_ORG)))
        .body("other org body")
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 201);
    drop(held);
    // Download with the token works; a mismatching tenant header is refused.
    let key: serde_json::Value = other.json().await.unwrap();
    let url = format!("{}/v1/blobs/{}", node.url, key["key"].as_str().unwrap());
    let got = client
        .get(&url)
        .bearer_auth(es.sign(&claims(OTHER_ORG)))
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);
    assert_eq!(got.bytes().await.unwrap(), "other org body");
    let mismatch = client
        .get(&url)
        .bearer_auth(es.sign(&claims(OTHER_ORG)))
        .header("X-Graviton-Tenant-Id", ORG)
        .send()
        .await
        .unwrap();
    assert_eq!(mismatch.status(), 403);
}

/// A real local HTTP server serving a JWKS that the test can rotate, counting GETs.
struct JwksServer {
    url: String,
    set: Arc<std::sync::Mutex<String>>,
    gets: Arc<AtomicU64>,
}

impl JwksServer {
    async fn start(initial: String) -> Self {
        let set = Arc::new(std::sync::Mutex::new(initial));
        let gets = Arc::new(AtomicU64::new(0));
        let (s, g) = (set.clone(), gets.clone());
        let app = axum::Router::new().route(
            "/jwks.json",
            axum::routing::get(move || {
                let (s, g) = (s.clone(), g.clone());
                async move {
                    g.fetch_add(1, Ordering::SeqCst);
                    let body = s.lock().unwrap().clone();
                    ([("content-type", "application/json")], body)
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            url: format!("http://{addr}/jwks.json"),
            set,
            gets,
        }
    }

    fn gets(&self) -> u64 {
        self.gets.load(Ordering::SeqCst)
    }
}

async fn node_with_url(url: &str, refetch_min: HumanDuration) -> TestNode {
    let url = url.to_string();
    TestNode::start_with(
        move |c| {
            c.auth = AuthConfig {
                enabled: true,
                issuers: vec![IssuerConfig {
                    issuer: ISSUER.into(),
                    audience: vec![AUDIENCE.into()],
                    jwks_url: Some(url),
                    refetch_min_interval: refetch_min,
                    refresh_interval: HumanDuration::secs(3600),
                    ..IssuerConfig::default()
                }],
            };
        },
        NodeOptions::default(),
    )
    .await
}

// Checks EDGE-4.
#[tokio::test]
async fn unknown_kid_with_a_stale_jwks_url_refetches_once_then_refuses_before_the_body() {
    let k1 = SigningKey::es256("k1");
    let server = JwksServer::start(jwks(&[&k1])).await;
    let node = node_with_url(&server.url, HumanDuration::secs(3600)).await;
    assert_eq!(server.gets(), 1, "fetched at start");
    let client = reqwest::Client::new();
    let ok = client
        .post(format!("{}/v1/blobs", node.url))
        .bearer_auth(k1.sign(&claims(ORG)))
        .body("known key")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 201);
    assert_eq!(server.gets(), 1, "a known kid needs no fetch");
    let manifests_before = node.manifest_count();
    let stranger = SigningKey::es256("k-new");
    for round in 0..3 {
        let (_s, answer) = raw_exchange(
            node.addr(),
            &partial_upload(&format!(
                "Authorization: Bearer {}\r\n",
                stranger.sign(&claims(ORG))
            )),
        )
        .await;
        assert_eq!(status_of(&answer), 401, "round {round}: {answer}");
        assert_eq!(json_body(&answer)["error"], "invalid_token");
        // The first unknown kid refetched the stale set; later ones are rate limited.
        assert_eq!(server.gets(), 2, "round {round}");
    }
    assert_eq!(node.manifest_count(), manifests_before);
    let text = node.metrics_text();
    assert_eq!(
        support::metrics::count(&text, "graviton_upload_bytes_total"),
        Some("known key".len() as u64),
        "{text}"
    );
}

// Checks EDGE-4.
#[tokio::test]
async fn rotated_keys_are_picked_up_by_the_refetch() {
    let k1 = SigningKey::es256("k1");
    let server = JwksServer::start(jwks(&[&k1])).await;
    let node = node_with_url(&server.url, HumanDuration::millis(0)).await;
    let k2 = SigningKey::eddsa("k2");
    *server.set.lock().unwrap() = jwks(&[&k1, &k2]);
    let response = reqwest::Client::new()
        .post(format!("{}/v1/blobs", node.url))
        .bearer_auth(k2.sign(&claims(ORG)))
        .body("rotated key")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    assert_eq!(server.gets(), 2);
}

#[tokio::test]
async fn unreachable_jwks_url_answers_503_not_401() {
    let port = support::free_port();
    let node = node_with_url(
        &format!("http://127.0.0.1:{port}/jwks.json"),
        HumanDuration::secs(3600),
    )
    .await;
    let k1 = SigningKey::es256("k1");
    let (_s, answer) = raw_exchange(
        node.addr(),
        &partial_upload(&format!(
            "Authorization: Bearer {}\r\n",
            k1.sign(&claims(ORG))
        )),
    )
    .await;
    assert_eq!(status_of(&answer), 503, "{answer}");
    assert_eq!(json_body(&answer)["error"], "auth_unavailable");
    assert_nothing_read_or_stored(&node);
}

#[tokio::test]
async fn auth_off_by_default_keeps_header_tenants_working() {
    let node = TestNode::start().await;
    assert!(node.node.as_ref().unwrap().state().auth.is_none());
    let response = reqwest::Client::new()
        .post(format!("{}/v1/blobs", node.url))
        .header("X-Graviton-Tenant-Id", ORG)
        .header("X-Graviton-Upload-Session-Id", SESSION)
        .body("no auth")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
}

#[tokio::test]
async fn hs256_is_refused_unless_explicitly_allowed() {
    let secret = b"a-shared-secret-of-at-least-32-bytes!!";
    let jwk: Jwk = {
        use base64::Engine;
        let k = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret);
        serde_json::from_value(json!({"kty": "oct", "k": k, "kid": "hs", "alg": "HS256"})).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("jwks.json");
    std::fs::write(
        &path,
        serde_json::to_string(&JwkSet { keys: vec![jwk] }).unwrap(),
    )
    .unwrap();
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some("hs".into());
    let token =
        jsonwebtoken::encode(&header, &claims(ORG), &EncodingKey::from_secret(secret)).unwrap();

    // Default issuer (RS256, ES256, EdDSA): an HS256 token is refused before the body.
    let default_path = path.clone();
    let node = TestNode::start_with(
        move |c| {
            c.auth = AuthConfig {
                enabled: true,
                issuers: vec![issuer_with_file(&default_path)],
            }
        },
        NodeOptions::default(),
    )
    .await;
    let (_s, answer) = raw_exchange(
        node.addr(),
        &partial_upload(&format!("Authorization: Bearer {token}\r\n")),
    )
    .await;
    assert_eq!(status_of(&answer), 401, "{answer}");
    assert!(
        json_body(&answer)["message"]
            .as_str()
            .unwrap()
            .contains("algorithm")
    );
    assert_nothing_read_or_stored(&node);

    // Explicitly allowed: the same token is accepted.
    let node = TestNode::start_with(
        move |c| {
            let mut issuer = issuer_with_file(&path);
            issuer.algorithms = vec!["HS256".into()];
            issuer.allow_hs256 = true;
            c.auth = AuthConfig {
                enabled: true,
                issuers: vec![issuer],
            }
        },
        NodeOptions::default(),
    )
    .await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/blobs", node.url))
        .bearer_auth(&token)
        .body("hs256 body")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
}

/// `graviton put` / `graviton get` (the library behind them) send the bearer token, and
/// a refusal names the fix.
#[tokio::test]
async fn the_cli_client_sends_its_token_and_names_the_fix_when_refused() {
    use graviton::client::{Credentials, get, put};
    let es = SigningKey::es256("k-cli");
    let node = node_with_file(&[&es], |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.bin");
    // Small enough to be sent whole before the server's early 401 is read.
    std::fs::write(&file, support::node::random_bytes(20_000, 5)).unwrap();

    let anonymous = Credentials::default();
    let refused = put(&node.url, &file, None, &anonymous).await.unwrap_err();
    let text = format!("{refused:#}");
    assert!(text.contains("401") && text.contains("--token"), "{text}");
    assert_eq!(node.manifest_count(), 0);

    let signed = Credentials {
        token: Some(graviton::config::Secret::new(es.sign(&claims(ORG)))),
        tenant: Some(ORG.parse().unwrap()),
    };
    let receipt = put(&node.url, &file, None, &signed).await.unwrap();
    let out = dir.path().join("out.bin");
    let refused = get(&node.url, &receipt.key, Some(&out), &anonymous)
        .await
        .unwrap_err();
    assert!(format!("{refused:#}").contains("--token"));
    assert!(!out.exists(), "a refused download writes nothing");
    let bytes = get(&node.url, &receipt.key, Some(&out), &signed)
        .await
        .unwrap();
    assert_eq!(bytes, 20_000);
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&file).unwrap());
}
