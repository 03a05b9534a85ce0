//! SIGTERM to every node of a cluster at once, on real `graviton serve` processes on one
//! PostgreSQL database: with no other node left to take the shards, each node's drain
//! ends at once (nothing to hand over) and the node exits 0, never waiting out its grace
//! period ("drain did not complete before the grace period").

mod support;

use std::process::Command;

use support::cluster::{NodeProcess, all_nodes_own_shards, wait_converged};

const SHARDS: u32 = 16;

// Checks OPS-9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_every_node_at_once_ends_the_drains_without_a_hand_over() {
    let test = "sigterm_to_every_node_at_once_ends_the_drains_without_a_hand_over";
    let Some(db) = support::TestDatabase::create(test).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("shared");
    // A shutdown grace and hand-over grace long enough that a drain waiting them out
    // is the old behaviour, whose log line the assertions below look for.
    let mut nodes: Vec<NodeProcess> = ["node-a", "node-b", "node-c"]
        .iter()
        .map(|id| {
            NodeProcess::start_with_extra(
                dir.path(),
                id,
                db.url(),
                SHARDS,
                &data,
                "handoff_grace = \"20s\"",
                "",
            )
        })
        .collect();
    let refs: Vec<&NodeProcess> = nodes.iter().collect();
    wait_converged(
        &refs,
        db.url(),
        "three nodes ready, each owning shards",
        |status| {
            all_nodes_own_shards(status) && status.moving_shards == 0 && status.nodes.len() == 3
        },
    )
    .await;

    // One signal to each node, all sent before any is waited for.
    for node in &nodes {
        let pid = node.pid().expect("running").to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success());
    }
    for node in &mut nodes {
        // Waits for the exit (the helper kills only after 30 s, which fails below).
        let status = node.terminate().expect("the node was running");
        let log = node.log_text();
        assert!(
            status.success(),
            "{} exited with {status:?}:\n{log}",
            node.id
        );
        assert!(
            !log.contains("drain did not complete before the grace period"),
            "{} waited out its grace period:\n{log}",
            node.id
        );
        assert!(log.contains("graviton node stopped"), "{}:\n{log}", node.id);
    }
    // At least the last nodes to stop found nobody to hand over to, and said so.
    let said = nodes
        .iter()
        .filter(|n| n.log_text().contains("no other node can take shards"))
        .count();
    assert!(said >= 1, "no node reported a drain without a target");
}
