//! A cluster node's control plane is supervised (issue 9, defect 9): its actors are
//! linked under the node's actor tree, a crashed one is replaced together with its
//! siblings, and a plane that keeps crashing makes the node fail readiness, drain, and
//! report that it must exit non-zero. Real node (in process), real PostgreSQL, blocks on
//! the test S3 server; the faults are `kill`s of the plane's actors found by walking the
//! node's actor tree.

#[allow(unused_imports)]
mod support;

use std::time::Duration;

use graviton::control::supervisor::MAX_RESTARTS;
use graviton::node::StopCause;
use ractor::ActorCell;
use support::TestDatabase;

/// The node's config, or `None` (after the skip report) without the test S3 server.
fn config_toml(test: &str, dir: &std::path::Path, db: &str) -> Option<String> {
    let port = support::free_port;
    let prefix = format!("control-supervision-{}", support::unique_suffix());
    let storage = support::cluster::s3_storage_toml(test, &dir.join("data"), &prefix, "")?;
    Some(format!(
        r#"[node]
id = "ctl-sup"
listen = "127.0.0.1:0"
shutdown_grace = "2s"

{storage}

[cluster]
enabled = true
database_url = "{db}"
shard_count = 8
{timings}
handoff_grace = "0s"

[control]
internal_listen = "127.0.0.1:{internal}"
control_listen = "127.0.0.1:{control}"
internal_token = "{token}"
"#,
        internal = port(),
        control = port(),
        token = support::cluster::TOKEN,
        timings = support::cluster::FAST_TIMINGS,
    ))
}

/// The control plane's supervisor: the child of the node's root named for it.
fn control_supervisor(root: &ActorCell) -> Option<ActorCell> {
    root.get_children().into_iter().find(|child| {
        child
            .get_name()
            .is_some_and(|name| name.contains(".control-plane."))
    })
}

async fn ready(client: &reqwest::Client, url: &str) -> bool {
    support::cluster::is_ready(client, url).await
}

// Checks LOC-8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_that_keeps_crashing_fences_and_stops_the_node() {
    let Some(db) = TestDatabase::create("control_plane_supervision").await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("node.toml");
    let test = "a_control_plane_that_keeps_crashing_fences_and_stops_the_node";
    let Some(toml) = config_toml(test, dir.path(), db.url()) else {
        return;
    };
    std::fs::write(&path, toml).expect("config");
    let config = graviton::config::Config::load(Some(&path)).expect("config");
    let node = graviton::node::start(config).await.expect("start node");
    let url = node.base_url();
    let client = support::client();
    assert!(
        support::wait_until(Duration::from_secs(30), || ready(&client, &url)).await,
        "the node becomes ready"
    );

    // Linked under the node's root, with the plane's three actors under it.
    let root = node.actor_root();
    let supervisor = control_supervisor(&root).expect("the control plane is in the tree");
    assert_eq!(supervisor.get_children().len(), 3);

    // Each crash replaces the whole plane; the node stays ready meanwhile.
    for restart in 1..=MAX_RESTARTS {
        let victims = supervisor.get_children();
        victims[restart % victims.len()].kill();
        let replaced = support::wait_until(Duration::from_secs(15), || {
            let now = supervisor.get_children();
            let fresh = now.len() == 3
                && now
                    .iter()
                    .all(|c| victims.iter().all(|v| v.get_id() != c.get_id()));
            async move { fresh }
        })
        .await;
        assert!(replaced, "restart {restart}: a fresh plane of three actors");
        assert!(ready(&client, &url).await, "restart {restart}: still ready");
    }

    // One crash too many: the supervisor gives up, the node fails readiness at once and
    // asks to stop with the cause that makes `graviton serve` exit with status 1.
    supervisor.get_children()[0].kill();
    let cause = tokio::time::timeout(
        Duration::from_secs(15),
        node.wait_for_stop(std::future::pending()),
    )
    .await
    .expect("the node asks to stop");
    assert_eq!(cause, StopCause::ControlPlaneLost);
    assert!(
        support::wait_until(Duration::from_secs(5), || async {
            !ready(&client, &url).await
        })
        .await,
        "readiness fails once the control plane is lost"
    );
    // The supervisor fires `lost` as its state drops; it leaves the node's tree a moment
    // later, when the root handles its exit (later still on a loaded machine).
    assert!(
        support::wait_until(Duration::from_secs(10), || {
            let gone = control_supervisor(&root).is_none();
            async move { gone }
        })
        .await,
        "the supervisor stopped"
    );
    // The drain and shutdown still complete without a control plane.
    tokio::time::timeout(Duration::from_secs(30), node.shutdown())
        .await
        .expect("shutdown completes");
}
