//! Errors that say what to change, from the real `graviton` binary: PostgreSQL down or a
//! database missing at start, a missing S3 bucket, and `gc`/`verify` against the data
//! directory of a running node. Each message names the address (never a password), the
//! cause and the configuration key, once.

mod support;

use support::process::{Graviton, isolated_command};

use std::process::Output;
use std::time::Duration;

const PASSWORD: &str = "pw-n0t-in-any-message";

/// `graviton ARGS` with no inherited `GRAVITON_*` configuration, plus `env`.
fn graviton(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = isolated_command();
    command.args(args);
    command.envs(env.iter().copied());
    command.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A cluster node's config on `database_url` (shared-mount blocks, so only PostgreSQL
/// is needed).
fn cluster_config(dir: &std::path::Path, database_url: &str) -> std::path::PathBuf {
    let path = dir.join("node.toml");
    let (public, internal, control) = (
        support::free_port(),
        support::free_port(),
        support::free_port(),
    );
    std::fs::write(
        &path,
        format!(
            "[node]\nid = \"node-a\"\nlisten = \"127.0.0.1:{public}\"\n\
             [storage]\ndata_dir = \"{}\"\nbackend = \"fs\"\nshared_mount = true\n\
             [cluster]\nenabled = true\ndatabase_url = \"{database_url}\"\n\
             [control]\ninternal_listen = \"127.0.0.1:{internal}\"\ncontrol_listen = \"127.0.0.1:{control}\"\n\
             internal_token = \"test-internal-token-0123456789abcdefghijkl\"\n",
            dir.join("data").display()
        ),
    )
    .unwrap();
    path
}

// Checks OPS-10.
#[test]
fn postgresql_down_at_start_names_the_server_the_cause_and_the_key_once() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on this port: a real connection attempt, refused by the kernel.
    let port = support::free_port();
    let url = format!("postgres://graviton:{PASSWORD}@127.0.0.1:{port}/graviton");
    let migrate = graviton(
        &["migrate"],
        &[("GRAVITON_CLUSTER__DATABASE_URL", url.as_str())],
    );
    let config = cluster_config(dir.path(), &url);
    let serve = graviton(&["serve", "--config", config.to_str().unwrap()], &[]);
    for (what, out) in [("migrate", &migrate), ("serve", &serve)] {
        let text = stderr(out);
        assert_eq!(out.status.code(), Some(1), "{what}: {text}");
        assert!(
            text.contains(&format!("127.0.0.1:{port}")),
            "{what}: {text}"
        );
        assert!(text.contains("cluster.database_url"), "{what}: {text}");
        assert_eq!(
            text.matches("connection refused").count(),
            1,
            "{what}: the cause once: {text}"
        );
        assert!(!text.contains(PASSWORD), "{what}: password shown: {text}");
        assert!(!text.contains("pool timed out"), "{what}: {text}");
    }
}

// Checks OPS-10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_database_is_reported_once() {
    let test = "a_missing_database_is_reported_once";
    // A real server (the test database proves it answers); a database name it lacks.
    let Some(db) = support::TestDatabase::create(test).await else {
        return;
    };
    let missing = format!("{}_absent", db.name());
    let url = db.url().replace(db.name(), &missing);
    let out = graviton(
        &["migrate"],
        &[("GRAVITON_CLUSTER__DATABASE_URL", url.as_str())],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert_eq!(text.matches("does not exist").count(), 1, "{text}");
    assert!(text.contains(&missing), "{text}");
    assert!(text.contains("cluster.database_url"), "{text}");
}

// Checks OPS-10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_names_the_bucket_the_endpoint_and_the_key_once() {
    let test = "a_missing_bucket_names_the_bucket_the_endpoint_and_the_key_once";
    let endpoint = std::env::var("GRAVITON_TEST_S3_ENDPOINT").unwrap_or_default();
    let key_id = std::env::var("GRAVITON_TEST_S3_ACCESS_KEY").unwrap_or_default();
    let secret = std::env::var("GRAVITON_TEST_S3_SECRET_KEY").unwrap_or_default();
    if endpoint.is_empty() || key_id.is_empty() {
        support::missing_service(test, "no test S3 server (GRAVITON_TEST_S3_*)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let bucket = format!("graviton-absent-{}", support::unique_suffix());
    let port = support::free_port();
    let listen = format!("127.0.0.1:{port}");
    let data = dir.path().join("data");
    let out = graviton(
        &[
            "serve",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &[
            ("GRAVITON_STORAGE__BACKEND", "s3"),
            ("GRAVITON_STORAGE__S3__BUCKET", bucket.as_str()),
            ("GRAVITON_STORAGE__S3__ENDPOINT", endpoint.as_str()),
            ("GRAVITON_STORAGE__S3__REGION", "garage"),
            ("GRAVITON_STORAGE__S3__ACCESS_KEY_ID", key_id.as_str()),
            ("GRAVITON_STORAGE__S3__SECRET_ACCESS_KEY", secret.as_str()),
        ],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert_eq!(text.matches(&bucket).count(), 1, "the bucket once: {text}");
    assert!(text.contains(&endpoint), "{text}");
    assert!(text.contains("storage.s3.bucket"), "{text}");
    assert!(!text.contains("pack missing"), "{text}");
    assert!(!text.contains(&secret), "{text}");
}

// Checks OPS-10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_and_verify_on_a_running_node_say_to_stop_it_or_use_the_admin_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut node = Graviton::serve_listen(dir.path().join("serve.log"), |command| {
        command
            .arg("--data-dir")
            .arg(&data)
            .env_remove("GRAVITON_CONFIG");
    });
    node.ready(Duration::from_secs(30)).await;
    let data_env = [("GRAVITON_STORAGE__DATA_DIR", data.to_str().unwrap())];
    for args in [&["gc", "--dry-run"][..], &["verify"][..]] {
        let out = graviton(args, &data_env);
        let text = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {text}");
        assert!(text.contains("running"), "{args:?}: {text}");
        assert!(text.contains("Stop it first"), "{args:?}: {text}");
        assert!(text.contains("POST /v1/admin/gc"), "{args:?}: {text}");
        assert!(!text.contains("Database already open"), "{args:?}: {text}");
    }
    node.kill9();
}
