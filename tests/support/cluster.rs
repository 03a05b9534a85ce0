//! Separate `graviton serve` processes forming a cluster on one PostgreSQL database.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The `graviton` binary (also `support::process::BIN`; `nemesis_util` names it here).
#[allow(unused_imports)]
pub use super::process::BIN;
use super::process::{Graviton, Ports};
pub const TOKEN: &str = "test-internal-token-0123456789abcdefghijkl";

/// The `[cluster]` timing keys of test nodes (fast failover).
pub const FAST_TIMINGS: &str = r#"heartbeat_interval = "100ms"
self_fence = "400ms"
node_ttl = "1s"
poll_interval = "250ms"
rebalance_interval = "200ms"
lock_retry_interval = "100ms"
lock_ping_interval = "100ms""#;

/// One node process: its config file, written for the ports of each launch attempt, and
/// the [`Graviton`] process wrapper (port race retry, log, kill on drop).
pub struct NodeProcess {
    pub id: String,
    pub config: PathBuf,
    pub url: String,
    pub internal: u16,
    process: Graviton,
}

impl NodeProcess {
    /// Write the node's config (fast test timings) and start it.
    pub fn start(
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        data_dir: &Path,
    ) -> Self {
        Self::start_with_extra(dir, id, database_url, shard_count, data_dir, "", "")
    }

    /// [`Self::start`] with `cluster_extra` (TOML lines) added to `[cluster]` and `extra`
    /// TOML appended to the config (more sections).
    pub fn start_with_extra(
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        data_dir: &Path,
        cluster_extra: &str,
        extra: &str,
    ) -> Self {
        let storage = format!(
            "[storage]\ndata_dir = \"{}\"\nfsync = false\nbackend = \"fs\"\nshared_mount = true",
            data_dir.display()
        );
        Self::start_config(
            dir,
            id,
            database_url,
            shard_count,
            &storage,
            cluster_extra,
            extra,
        )
    }

    /// The one config writer and launcher: `storage` is the whole `[storage]` section,
    /// `cluster_extra` lines go into `[cluster]` (fast test timings), `extra` is appended.
    /// Public for a node on S3 with `cluster_extra` (e.g. `embedded_manager = false`).
    pub fn start_config(
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        storage: &str,
        cluster_extra: &str,
        extra: &str,
    ) -> Self {
        let config = dir.join(format!("{id}.toml"));
        let text = |ports: Ports| {
            let Ports {
                public,
                internal,
                control,
            } = ports;
            format!(
                r#"[node]
id = "{id}"
listen = "127.0.0.1:{public}"
shutdown_grace = "5s"

{storage}

[cluster]
enabled = true
database_url = "{database_url}"
shard_count = {shard_count}
{FAST_TIMINGS}
{cluster_extra}

[control]
internal_listen = "127.0.0.1:{internal}"
control_listen = "127.0.0.1:{control}"
internal_token = "{TOKEN}"

{extra}
"#
            )
        };
        let process = Graviton::serve_config(dir.join(format!("{id}.log")), &config, text, |c| {
            c.env("RUST_LOG", "info");
        });
        Self {
            id: id.to_string(),
            url: process.url.clone(),
            internal: process.ports.expect("serving").internal,
            config,
            process,
        }
    }

    /// Start the same node again (after a kill) with `env` added to its environment
    /// (e.g. a test-only pause hook of `src/storage/pack/pause.rs`).
    pub fn restart_with_env(&mut self, env: &[(&str, &str)]) {
        self.process.restart_with_env(env);
    }

    /// Start the same node again (after a kill).
    pub fn restart(&mut self) {
        self.process.restart();
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// SIGKILL: no drain, no goodbye.
    pub fn kill9(&mut self) {
        self.process.kill9();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        self.process.terminate()
    }

    pub fn log_text(&self) -> String {
        self.process.log_text()
    }
}

pub async fn is_ready(client: &reqwest::Client, url: &str) -> bool {
    matches!(client.get(format!("{url}/readyz")).send().await, Ok(r) if r.status() == 200)
}

/// The client settings of the test S3 server (`GRAVITON_TEST_S3_*`, set by
/// scripts/services.sh) under `prefix`, for tests that look into the bucket themselves.
pub fn test_s3_config(prefix: &str) -> graviton::storage::config::S3Config {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    graviton::storage::config::S3Config {
        endpoint: var("GRAVITON_TEST_S3_ENDPOINT"),
        bucket: var("GRAVITON_TEST_S3_BUCKET"),
        region: std::env::var("GRAVITON_TEST_S3_REGION").unwrap_or_else(|_| "garage".into()),
        path_style: true,
        prefix: prefix.to_string(),
        access_key_id: var("GRAVITON_TEST_S3_ACCESS_KEY"),
        secret_access_key: Some(graviton::config::Secret::new(var(
            "GRAVITON_TEST_S3_SECRET_KEY",
        ))),
        request_timeout: graviton::config::HumanDuration(Duration::from_secs(10)),
        max_retries: 2,
        ..Default::default()
    }
}

/// `[storage]` TOML of a cluster node on the test S3 server (`GRAVITON_TEST_S3_*`, set by
/// scripts/services.sh) under `prefix`, or `None` (after the skip report) without one.
pub fn s3_storage_toml(test: &str, data_dir: &Path, prefix: &str, extra: &str) -> Option<String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let (Some(endpoint), Some(bucket), Some(key), Some(secret)) = (
        var("GRAVITON_TEST_S3_ENDPOINT"),
        var("GRAVITON_TEST_S3_BUCKET"),
        var("GRAVITON_TEST_S3_ACCESS_KEY"),
        var("GRAVITON_TEST_S3_SECRET_KEY"),
    ) else {
        super::missing_service(
            test,
            "S3 server (GRAVITON_TEST_S3_*; run scripts/services.sh)",
        );
        return None;
    };
    let region = var("GRAVITON_TEST_S3_REGION").unwrap_or_else(|| "garage".into());
    Some(format!(
        r#"[storage]
data_dir = "{data}"
fsync = false
backend = "s3"
pack_size = "8MiB"
{extra}

[storage.s3]
endpoint = "{endpoint}"
bucket = "{bucket}"
region = "{region}"
path_style = true
prefix = "{prefix}"
access_key_id = "{key}"
secret_access_key = "{secret}"
request_timeout = "10s"
max_retries = 2
"#,
        data = data_dir.display(),
    ))
}

impl NodeProcess {
    /// A cluster node with blocks on the test S3 server under `prefix` (shared by the
    /// test's nodes) and a data directory of its own, `<dir>/<id>-data`; `None` (after
    /// the skip report) without an S3 server. `extra` is appended as more sections.
    pub fn start_on_s3(
        test: &str,
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        prefix: &str,
        extra: &str,
    ) -> Option<Self> {
        let storage = s3_storage_toml(test, &s3_node_data_dir(dir, id), prefix, "")?;
        Some(Self::start_with_storage(
            dir,
            id,
            database_url,
            shard_count,
            &storage,
            extra,
        ))
    }

    /// A cluster node whose `[storage]` section is `storage` (e.g. from
    /// [`s3_storage_toml`]) instead of the shared mount; `extra` is appended as more
    /// sections.
    pub fn start_with_storage(
        dir: &Path,
        id: &str,
        database_url: &str,
        shard_count: u32,
        storage: &str,
        extra: &str,
    ) -> Self {
        Self::start_config(dir, id, database_url, shard_count, storage, "", extra)
    }
}

/// The data directory of node `id` started by [`NodeProcess::start_on_s3`] in `dir`.
pub fn s3_node_data_dir(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}-data"))
}

/// Pack objects under `prefix` in the test bucket (the server and credentials of
/// [`test_s3_config`]).
pub async fn s3_packs(prefix: &str) -> usize {
    use graviton::storage::pack::medium::Medium;
    let medium = graviton::storage::pack::s3::S3Medium::new(&test_s3_config(prefix), None)
        .expect("S3 client");
    // Medium calls block (the store runs them on the blocking pool).
    tokio::task::spawn_blocking(move || medium.list().expect("list packs").len())
        .await
        .unwrap()
}

/// The blocks of nodes started by [`NodeProcess::start_on_s3`] in `dir` under `prefix`
/// are in the bucket, not on a node's disk: at least `min_packs` pack objects under
/// `prefix`, and in the data directory of every node of `ids` (which must exist) no pack
/// file and no block file of the file-per-block layout (`blocks/`).
pub async fn assert_packs_in_bucket_only(dir: &Path, ids: &[&str], prefix: &str, min_packs: usize) {
    let packs = s3_packs(prefix).await;
    assert!(
        packs >= min_packs,
        "{packs} pack objects under {prefix}, expected at least {min_packs}"
    );
    for id in ids {
        let data = s3_node_data_dir(dir, id);
        assert!(
            data.is_dir(),
            "{id} has no data directory {}",
            data.display()
        );
        let local = super::node::pack_files(&data);
        assert!(local.is_empty(), "{id} holds packs of its own: {local:?}");
        let blocks = super::node::count_files(&data.join("blocks"));
        assert_eq!(blocks, 0, "{id} holds block files of its own");
    }
}

/// Upload `data` through `url` in session `key` as a well-behaved client does: a
/// documented retryable answer (503 with `Retry-After`, e.g. a shard in motion) is tried
/// again, 200 ms apart, up to 10 attempts in all; the last answer.
pub async fn upload_retrying(
    url: &str,
    key: &graviton::ids::SessionKey,
    data: Vec<u8>,
) -> reqwest::Response {
    let client = super::client();
    let data = bytes::Bytes::from(data);
    let mut attempts = 0;
    loop {
        let response = client
            .post(format!("{url}/v1/blobs"))
            .header("x-graviton-tenant-id", key.tenant.to_string())
            .header("x-graviton-upload-session-id", key.session.to_string())
            .body(data.clone())
            .send()
            .await
            .unwrap();
        let retryable = response.status() == 503 && response.headers().contains_key("retry-after");
        attempts += 1;
        if !retryable || attempts == 10 {
            return response;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Wait (60 s at most) until every node of `nodes` answers `/readyz` with 200 and the
/// cluster status on `database_url` satisfies `settled`; panics naming `what` with every
/// node's log.
pub async fn wait_converged(
    nodes: &[&NodeProcess],
    database_url: &str,
    what: &str,
    settled: impl Fn(&graviton::cli::ClusterStatus) -> bool,
) {
    let client = super::client();
    let settled = &settled;
    let converged = super::wait_until(Duration::from_secs(60), || {
        let client = client.clone();
        async move {
            for node in nodes {
                if !is_ready(&client, &node.url).await {
                    return false;
                }
            }
            graviton::cli::cluster_status(database_url)
                .await
                .is_ok_and(|status| settled(&status))
        }
    })
    .await;
    if !converged {
        let logs: Vec<String> = nodes
            .iter()
            .map(|n| format!("--- {}:\n{}", n.id, n.log_text()))
            .collect();
        panic!(
            "timed out after 60 s waiting for: {what}\n{}",
            logs.join("\n")
        );
    }
}

/// Every shard has an owner and every node listed owns some.
pub fn all_nodes_own_shards(status: &graviton::cli::ClusterStatus) -> bool {
    status.unassigned_shards == 0 && status.nodes.iter().all(|n| n.shards > 0)
}

/// The owner in `status` of `key`'s shard (of `shard_count`), `None` while unassigned.
pub fn owner_of(
    status: &graviton::cli::ClusterStatus,
    shard_count: u32,
    key: &graviton::ids::SessionKey,
) -> Option<graviton::ids::NodeId> {
    let shard = graviton::placement::hash::shard_of(key, shard_count);
    status
        .shards
        .iter()
        .find(|s| s.shard == shard)
        .and_then(|s| s.owner.clone())
}

/// A new session whose shard (of `shard_count`) `node` owns in `status`; panics after a
/// million random tries (the node owns no shard).
pub fn session_owned_by(
    status: &graviton::cli::ClusterStatus,
    shard_count: u32,
    node: &str,
) -> graviton::ids::SessionKey {
    (0..1_000_000)
        .map(|_| graviton::ids::SessionKey {
            tenant: graviton::ids::TenantId::new_random(),
            session: graviton::ids::SessionId::new_random(),
        })
        .find(|key| owner_of(status, shard_count, key).is_some_and(|o| o.as_str() == node))
        .unwrap_or_else(|| panic!("{node} owns no shard in {status:?}"))
}
