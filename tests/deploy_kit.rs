//! The deployment kit under deploy/ validates: `scripts/check-deploy` runs the schema
//! validators (kubernetes-validate, compose-spec), promtool on the alert rules,
//! systemd-analyze on the unit, `graviton check-config` on every configuration, and checks
//! that every metric of the Grafana dashboard and the alert rules is exported by a live
//! node started from this build.

mod support;

use std::process::Command;

#[test]
fn deploy_kit_validates_against_schemas_promtool_and_a_live_node() {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new(format!("{root}/scripts/check-deploy"))
        .arg(env!("CARGO_BIN_EXE_graviton"))
        .current_dir(root)
        .output()
        .expect("run scripts/check-deploy");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    match output.status.code() {
        Some(0) => {
            assert!(
                stderr.contains("check-deploy: ok"),
                "the script did not reach its end:\n{stderr}"
            );
            assert!(
                stderr.contains("metrics; all exported"),
                "the dashboard check did not run:\n{stderr}"
            );
        }
        Some(3) => support::missing_service(
            "deploy_kit",
            &format!("a validation tool could not be installed:\n{stderr}"),
        ),
        code => panic!("scripts/check-deploy failed ({code:?}):\n{stdout}\n{stderr}"),
    }
}

/// `scripts/cluster` as the docs use it: three nodes on free ports with their blocks on the
/// S3 server of `scripts/services.sh`, ready when `up` returns; a blob uploaded through
/// node-1 downloads byte-exact from node-2 and node-3, its pack is in the bucket under the
/// cluster's prefix, `status` prints the three nodes, the console data answers the admin
/// token from `admin-token`, and `down` stops every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_cluster_runs_three_nodes_on_s3_that_serve_each_others_uploads() {
    let root = env!("CARGO_MANIFEST_DIR");
    if std::env::var("GRAVITON_TEST_S3_ENDPOINT").is_err() {
        support::missing_service(
            "deploy_kit",
            "S3 server (GRAVITON_TEST_S3_*; run scripts/services.sh)",
        );
        return;
    }
    let Some(db) = support::TestDatabase::create("deploy_kit").await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cluster = |command: &str| {
        Command::new(format!("{root}/scripts/cluster"))
            .arg(command)
            .current_dir(root)
            .env("GRAVITON_BIN", env!("CARGO_BIN_EXE_graviton"))
            .env("GRAVITON_CLUSTER_DIR", dir.path())
            .env("GRAVITON_CLUSTER_DB", db.name())
            .env("GRAVITON_CLUSTER_SHARDS", "64")
            .output()
            .expect("run scripts/cluster")
    };
    // Stops the nodes however the test ends.
    struct Down<F: Fn(&str) -> std::process::Output>(F);
    impl<F: Fn(&str) -> std::process::Output> Drop for Down<F> {
        fn drop(&mut self) {
            let _ = (self.0)("down");
        }
    }
    let up = cluster("up");
    let down = Down(&cluster);
    let logs = || {
        (1..=3)
            .map(|i| {
                let log = std::fs::read_to_string(dir.path().join(format!("node-{i}.log")))
                    .unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                format!(
                    "node-{i}:\n{}",
                    lines[lines.len().saturating_sub(15)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        up.status.success(),
        "scripts/cluster up failed:\n{}\n{}\n{}",
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr),
        logs()
    );
    let urls: Vec<String> = std::fs::read_to_string(dir.path().join("urls"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(urls.len(), 3, "{urls:?}");
    let ports: std::collections::BTreeSet<&str> =
        urls.iter().filter_map(|u| u.rsplit(':').next()).collect();
    assert_eq!(ports.len(), 3, "three distinct ports: {urls:?}");

    let client = support::client();
    let body: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let upload = client
        .post(format!("{}/v1/blobs", urls[0]))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(upload.status(), 201, "{:?}", upload.text().await);
    let receipt: serde_json::Value = upload.json().await.unwrap();
    let key = receipt["key"].as_str().expect("receipt key").to_string();
    for url in &urls[1..] {
        let download = client
            .get(format!("{url}/v1/blobs/{key}"))
            .send()
            .await
            .unwrap();
        assert_eq!(download.status(), 200, "download from {url}");
        let bytes = download.bytes().await.unwrap();
        assert!(
            bytes[..] == body[..],
            "download from {url} is not byte-exact"
        );
    }
    let packs = support::cluster::s3_packs(&format!("scripts-cluster/{}", db.name())).await;
    assert!(
        packs >= 1,
        "no pack object in the bucket under the cluster's prefix"
    );

    let status = cluster("status");
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.status.success()
            && ["node-1", "node-2", "node-3"]
                .iter()
                .all(|n| table.contains(n)),
        "scripts/cluster status:\n{table}\n{}",
        String::from_utf8_lossy(&status.stderr)
    );

    let token = std::fs::read_to_string(dir.path().join("admin-token")).unwrap();
    let console: serde_json::Value = client
        .get(format!("{}/v1/admin/console", urls[1]))
        .bearer_auth(token.trim())
        .send()
        .await
        .unwrap()
        .error_for_status()
        .expect("the console data answers the admin token")
        .json()
        .await
        .unwrap();
    assert_eq!(console["summary"]["nodes"]["active"], 3, "{console}");

    let pids: Vec<u32> = (1..=3)
        .map(|i| {
            std::fs::read_to_string(dir.path().join(format!("node-{i}.pid")))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    drop(down);
    for pid in pids {
        assert!(
            process_gone(pid),
            "node process {pid} still runs after scripts/cluster down"
        );
    }
}

/// Whether process `pid` has exited (no /proc entry, or a zombie nobody reaped yet).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                == Some('Z')
        }
    }
}

/// The step-by-step section of docs/deployment.md, run as written: its `sh` blocks in one
/// bash, in a fresh home directory, with the one line the text asks the reader to adapt
/// (`export PG=…`, the PostgreSQL server) set to the test server. It must start Garage,
/// Redis and three nodes, download byte-exact from node-2 and node-3 what node-1
/// took, answer the console's data with the admin token, and stop everything.
#[test]
fn the_step_by_step_cluster_in_docs_deployment_md_works_as_written() {
    let root = env!("CARGO_MANIFEST_DIR");
    let Some(garage) = std::env::var("GRAVITON_GARAGE_BIN")
        .ok()
        .filter(|g| std::path::Path::new(g).exists())
    else {
        support::missing_service(
            "deploy_kit",
            "garage binary (GRAVITON_GARAGE_BIN; run scripts/services.sh)",
        );
        return;
    };
    let server = std::env::var("GRAVITON_TEST_DATABASE_URL")
        .unwrap_or_else(|_| support::postgres::DEFAULT_ADMIN_URL.to_string());
    let server = server.rsplit_once('/').map_or(server.as_str(), |(s, _)| s);
    let doc = std::fs::read_to_string(format!("{root}/docs/deployment.md")).unwrap();
    let script = walkthrough_script(&doc);
    const PG_LINE: &str = "export PG=postgres://postgres@127.0.0.1:5432";
    assert!(
        script.lines().any(|l| l == PG_LINE),
        "the walk-through no longer sets PG as this test expects:\n{script}"
    );
    let script = script.replace(PG_LINE, &format!("export PG={server}"));

    // The database the walk-through creates must not exist yet. One that does is never
    // dropped here (it may be somebody's); the run that created it drops it at its end.
    let psql = |sql: &str| {
        Command::new("psql")
            .args([&format!("{server}/postgres"), "-qtAc", sql])
            .output()
            .expect("run psql")
    };
    let exists = psql("SELECT count(*) FROM pg_database WHERE datname = 'graviton'");
    if !exists.status.success() {
        support::missing_service(
            "deploy_kit",
            &format!(
                "PostgreSQL through psql: {}",
                String::from_utf8_lossy(&exists.stderr)
            ),
        );
        return;
    }
    assert_eq!(
        String::from_utf8_lossy(&exists.stdout).trim(),
        "0",
        "a database named graviton exists on {server}; the walk-through creates it \
         (drop it if it is a leftover of this test)"
    );
    // Drops the walk-through's database after the processes below are stopped.
    struct DropDatabase<F: Fn(&str) -> std::process::Output>(F);
    impl<F: Fn(&str) -> std::process::Output> Drop for DropDatabase<F> {
        fn drop(&mut self) {
            let _ = (self.0)("DROP DATABASE IF EXISTS graviton WITH (FORCE)");
        }
    }
    let _drop_database = DropDatabase(&psql);
    let home = tempfile::tempdir().unwrap();
    let work = home.path().join("graviton-try");
    // Stops what the walk-through started, however the test ends.
    struct Stop<'a>(&'a std::path::Path);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            for name in ["node-1", "node-2", "node-3", "redis", "garage"] {
                if let Ok(pid) = std::fs::read_to_string(self.0.join(format!("{name}.pid"))) {
                    let _ = Command::new("kill")
                        .args(["-9", pid.trim()])
                        .stderr(std::process::Stdio::null())
                        .status();
                }
            }
        }
    }
    let _stop = Stop(&work);
    let bin_dirs = [
        std::path::Path::new(env!("CARGO_BIN_EXE_graviton"))
            .parent()
            .unwrap()
            .to_path_buf(),
        std::path::Path::new(&garage)
            .parent()
            .unwrap()
            .to_path_buf(),
    ];
    let path = std::env::join_paths(bin_dirs.into_iter().chain(std::env::split_paths(
        &std::env::var("PATH").unwrap_or_default(),
    )))
    .unwrap();
    // Bounded: the text's wait loops would otherwise wait for ever on a broken step.
    let output = Command::new("timeout")
        .args(["300", "bash", "-euo", "pipefail", "-c", &script])
        .env("HOME", home.path())
        .env("PATH", path)
        .env_remove("GRAVITON_ADMIN__TOKEN")
        .env_remove("GRAVITON_CONTROL__INTERNAL_TOKEN")
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let logs: String = ["node-1.log", "node-2.log", "garage.log"]
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(work.join(f)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            format!(
                "--- {f}\n{}\n",
                lines[lines.len().saturating_sub(15)..].join("\n")
            )
        })
        .collect();
    assert!(
        output.status.success(),
        "the walk-through failed ({:?}):\n{stdout}\n{}\n{logs}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    for expected in [
        "node-2: byte-exact",
        "node-3: byte-exact",
        "\"summary\":{\"status\":\"",
    ] {
        assert!(stdout.contains(expected), "{expected:?} missing:\n{stdout}");
    }
    for name in ["node-1", "node-2", "node-3"] {
        let pid = std::fs::read_to_string(work.join(format!("{name}.pid"))).unwrap();
        assert!(
            process_gone(pid.trim().parse().unwrap()),
            "{name} still runs after step 8"
        );
    }
}

/// The `sh` blocks of the section "A 3-node cluster on S3 on one machine, step by step",
/// in order, with the list indentation removed.
fn walkthrough_script(doc: &str) -> String {
    let start = doc
        .find("## A 3-node cluster on S3 on one machine, step by step")
        .expect("the step-by-step section");
    let section = &doc[start..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    let mut script = String::new();
    let mut indent: Option<usize> = None;
    for line in section[..end].lines() {
        let trimmed = line.trim_start();
        match indent {
            None if trimmed == "```sh" => indent = Some(line.len() - trimmed.len()),
            Some(_) if trimmed == "```" => indent = None,
            Some(n) => {
                script.push_str(line.get(n..).unwrap_or(""));
                script.push('\n');
            }
            None => {}
        }
    }
    assert!(
        !script.is_empty(),
        "no sh block in the step-by-step section"
    );
    script
}
