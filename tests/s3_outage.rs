//! The S3 server goes away mid-service: uploads answer 503 with Retry-After and write no
//! manifest; when it returns, the next upload works without a restart. The test runs its
//! own Garage process (the binary scripts/services.sh installs) on free ports.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use graviton::config::{Config, HumanDuration, Secret};
use graviton::node::NodeOptions;
use graviton::storage::config::{Backend, S3Config};
use support::node::{TestNode, random_bytes};

const KEY_ID: &str = "GKoutagetest00001";
const SECRET: &str = "outage-test-secret-0123456789abcdef";

fn garage_bin() -> Option<String> {
    if let Ok(bin) = std::env::var("GRAVITON_GARAGE_BIN") {
        return Some(bin);
    }
    let home = std::env::var("HOME").ok()?;
    let bin = format!("{home}/.cargo/bin/garage");
    std::path::Path::new(&bin).exists().then_some(bin)
}

struct Garage {
    bin: String,
    config: std::path::PathBuf,
    s3_port: u16,
    child: Option<Child>,
}

impl Garage {
    fn start(dir: &std::path::Path, bin: String) -> Self {
        let (s3_port, rpc, admin) = (
            support::free_port(),
            support::free_port(),
            support::free_port(),
        );
        let config = dir.join("garage.toml");
        std::fs::write(
            &config,
            format!(
                r#"metadata_dir = "{d}/meta"
data_dir = "{d}/data"
db_engine = "sqlite"
replication_factor = 1
metadata_fsync = true
data_fsync = true
rpc_bind_addr = "127.0.0.1:{rpc}"
rpc_public_addr = "127.0.0.1:{rpc}"
rpc_secret = "{secret}"
[s3_api]
api_bind_addr = "127.0.0.1:{s3_port}"
s3_region = "garage"
[admin]
api_bind_addr = "127.0.0.1:{admin}"
"#,
                d = dir.display(),
                secret = "ab".repeat(32)
            ),
        )
        .unwrap();
        let mut garage = Self {
            bin,
            config,
            s3_port,
            child: None,
        };
        garage.spawn(true);
        garage
    }

    fn spawn(&mut self, first: bool) {
        let mut command = Command::new(&self.bin);
        command.arg("-c").arg(&self.config).arg("server");
        if first {
            command
                .args(["--single-node", "--default-access-key", "--default-bucket"])
                .env("GARAGE_DEFAULT_ACCESS_KEY", KEY_ID)
                .env("GARAGE_DEFAULT_SECRET_KEY", SECRET)
                .env("GARAGE_DEFAULT_BUCKET", "outage");
        }
        self.child = Some(
            command
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn garage"),
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.s3_port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "garage did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        self.kill();
    }
}

// Checks STO-9.
#[tokio::test]
async fn a_stopped_s3_server_gives_503_and_no_manifest_then_recovers_without_restart() {
    let Some(bin) = garage_bin() else {
        support::missing_service("s3_outage", "garage binary (run scripts/services.sh)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut garage = Garage::start(dir.path(), bin);
    let s3 = S3Config {
        endpoint: format!("http://127.0.0.1:{}", garage.s3_port),
        bucket: "outage".into(),
        region: "garage".into(),
        access_key_id: KEY_ID.into(),
        secret_access_key: Some(Secret::new(SECRET)),
        request_timeout: HumanDuration(Duration::from_secs(5)),
        max_retries: 2,
        ..Default::default()
    };
    // the bucket may take a moment to be usable after the first start
    let mut node = None;
    for _ in 0..50 {
        let s3 = s3.clone();
        let started = tokio::spawn(async move {
            TestNode::start_with(
                move |config: &mut Config| {
                    config.storage.backend = Some(Backend::S3);
                    config.storage.s3 = s3;
                },
                NodeOptions::default(),
            )
            .await
        })
        .await;
        if let Ok(started) = started {
            node = Some(started);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let node = node.expect("node on garage");
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let post = |data: Vec<u8>| {
        client
            .post(format!("{}/v1/blobs", node.url))
            .body(data)
            .send()
    };

    let first = random_bytes(2 << 20, 1);
    let response = post(first.clone()).await.unwrap();
    assert_eq!(response.status(), 201);
    let first_key: serde_json::Value = response.json().await.unwrap();

    garage.kill();
    let second = random_bytes(2 << 20, 2);
    let response = post(second.clone()).await.unwrap();
    assert_eq!(response.status(), 503, "never 201 while the store is down");
    assert!(response.headers().get("retry-after").is_some());
    let second_key = graviton::cas::BlobKey::of(&second).to_string();
    let missing = client
        .get(format!("{}/v1/blobs/{second_key}", node.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404, "no manifest for the failed upload");
    assert_eq!(node.manifest_count(), 1);

    garage.spawn(false);
    let response = post(second.clone()).await.unwrap();
    assert_eq!(response.status(), 201, "works again with no node restart");
    let body = client
        .get(format!(
            "{}/v1/blobs/{}",
            node.url,
            first_key["key"].as_str().unwrap()
        ))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(body[..] == first[..]);
}
