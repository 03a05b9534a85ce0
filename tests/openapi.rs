//! The OpenAPI document (docs/openapi.json, served at /openapi.json) against the router,
//! both ways: every route of `graviton::http::routes` is documented, every documented path
//! is a route, and on a live node each path answers exactly the documented methods (any
//! other method gets 405 from the router).

mod support;

use std::collections::{BTreeMap, BTreeSet};

use graviton::config::Secret;
use graviton::http::openapi::DOCUMENT;
use support::node::TestNode;

const ADMIN_TOKEN: &str = "openapi-test-admin-token";
const METHODS: [&str; 6] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"];

fn document() -> serde_json::Value {
    serde_json::from_str(DOCUMENT).expect("docs/openapi.json is JSON")
}

/// Documented methods per path (upper case).
fn documented() -> BTreeMap<String, BTreeSet<String>> {
    let doc = document();
    doc["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .map(|(path, item)| {
            let methods = item
                .as_object()
                .expect("path item")
                .keys()
                .filter(|k| METHODS.contains(&k.to_uppercase().as_str()))
                .map(|k| k.to_uppercase())
                .collect();
            (path.clone(), methods)
        })
        .collect()
}

#[test]
fn document_is_openapi_3_1_with_operation_ids_and_error_schemas() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut ids = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let id = op["operationId"]
                .as_str()
                .unwrap_or_else(|| panic!("{method} {path} has no operationId"));
            assert!(ids.insert(id.to_string()), "operationId {id} twice");
            let responses = op["responses"].as_object().unwrap();
            assert!(
                !responses.is_empty(),
                "{method} {path} documents no response"
            );
            for (status, response) in responses {
                let code: u16 = status.parse().expect("numeric status");
                if code >= 400 && method != "head" && path != "/readyz" {
                    assert_eq!(
                        response["content"]["application/json"]["schema"]["$ref"],
                        "#/components/schemas/Error",
                        "{method} {path} {status} must use the Error schema"
                    );
                }
            }
        }
    }
}

#[test]
fn every_route_is_documented_and_every_documented_path_is_routed() {
    let routed: BTreeSet<String> = graviton::http::route_paths()
        .into_iter()
        .map(String::from)
        .collect();
    let documented: BTreeSet<String> = documented().into_keys().collect();
    let undocumented: Vec<_> = routed.difference(&documented).collect();
    let unrouted: Vec<_> = documented.difference(&routed).collect();
    assert!(
        undocumented.is_empty(),
        "routes missing from docs/openapi.json: {undocumented:?}"
    );
    assert!(
        unrouted.is_empty(),
        "documented paths the router does not serve: {unrouted:?}"
    );
}

/// Fill path parameters with values the router matches (handlers may still refuse them).
fn concrete(path: &str) -> String {
    path.split('/')
        .map(|segment| {
            if segment.starts_with('{') {
                "x"
            } else {
                segment
            }
        })
        .collect::<Vec<_>>()
        .join("/")
}

#[tokio::test]
async fn each_path_answers_exactly_its_documented_methods() {
    let node = TestNode::start_with(
        |c| c.admin.token = Some(Secret::new(ADMIN_TOKEN)),
        Default::default(),
    )
    .await;
    let client = support::client();
    let mut mismatches = Vec::new();
    for (path, mut expected) in documented() {
        // axum serves HEAD wherever it serves GET.
        if expected.contains("GET") {
            expected.insert("HEAD".to_string());
        }
        let mut served = BTreeSet::new();
        for method in METHODS {
            // With the admin token, so the admin gate lets the router answer 405.
            let response = client
                .request(
                    method.parse().unwrap(),
                    format!("{}{}", node.url, concrete(&path)),
                )
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let body = response.bytes().await.unwrap();
            // 405: the path is routed, the method is not. An empty 404: no route at all
            // (every handler's 404 carries an Error body).
            let unrouted = status == 405 || (status == 404 && body.is_empty() && method != "HEAD");
            if !unrouted {
                served.insert(method.to_string());
            }
        }
        if served != expected {
            mismatches.push(format!(
                "{path}: documented {expected:?}, served {served:?}"
            ));
        }
    }
    assert!(mismatches.is_empty(), "{mismatches:#?}");
    let served: serde_json::Value = client
        .get(format!("{}/openapi.json", node.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(served, document(), "/openapi.json serves docs/openapi.json");
}

#[tokio::test]
async fn admin_requests_without_the_token_are_refused_before_their_body_is_parsed() {
    let node = TestNode::start_with(
        |c| c.admin.token = Some(Secret::new(ADMIN_TOKEN)),
        Default::default(),
    )
    .await;
    let client = support::client();
    let tenant = "5b3a2c1d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let url = format!("{}/v1/admin/tenants/{tenant}/admission", node.url);
    // no body, no content type: without the gate this was 415
    let response = client.put(&url).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "unauthorized");
    // a malformed query string: without the gate this was 400
    let response = client
        .get(format!("{}/v1/admin/admission?tenant=a&tenant=b", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    // with the token the same requests reach the extractors, answered as JSON errors
    let response = client
        .put(&url)
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 415);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "unsupported_media_type");
    let response = client
        .get(format!("{}/v1/admin/admission?tenant=a&tenant=b", node.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"], "invalid_request");
}
