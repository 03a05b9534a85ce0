//! The real-service harness itself: a private Redis that can be stopped and restarted,
//! and a fresh PostgreSQL database per test.

mod support;

use redis::AsyncCommands;
use sqlx::{Connection, Row};

#[tokio::test]
async fn private_redis_stops_and_restarts_on_the_same_port() {
    let Some(mut server) =
        support::RedisServer::start("private_redis_stops_and_restarts_on_the_same_port")
    else {
        return;
    };
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = conn.set("k", "v").await.unwrap();
    let value: String = conn.get("k").await.unwrap();
    assert_eq!(value, "v");
    server.stop();
    assert!(client.get_multiplexed_async_connection().await.is_err());
    server.restart();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let value: Option<String> = conn.get("k").await.unwrap();
    assert_eq!(value, None, "a restarted test server starts empty");
}

#[tokio::test]
async fn each_test_gets_its_own_database() {
    let Some(db) = support::TestDatabase::create("each_test_gets_its_own_database").await else {
        return;
    };
    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let row = sqlx::query("SELECT current_database() AS name")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let name: String = row.get("name");
    assert_eq!(name, db.name());
    conn.close().await.unwrap();
}

// The exact metric reader every test uses (`support::metrics`).
#[test]
fn metric_series_are_matched_whole_never_by_prefix() {
    use support::metrics::{count, count_or_zero, registered, value};
    let text = "# HELP graviton_x_total x.\n# TYPE graviton_x counter\n\
                graviton_x_total{kind=\"a b\"} 12\ngraviton_x_total 10\n\
                graviton_x_total_more 3\ngraviton_g 1.5\n# EOF\n";
    assert_eq!(count(text, "graviton_x_total{kind=\"a b\"}"), Some(12));
    assert_eq!(count(text, "graviton_x_total"), Some(10));
    assert_eq!(count(text, "graviton_x_total{kind=\"a\"}"), None);
    assert_eq!(count(text, "graviton_x"), None);
    assert_eq!(value(text, "graviton_g"), Some(1.5));
    assert_eq!(count_or_zero(text, "graviton_y_total"), 0);
    assert!(registered(text, "graviton_x_total"));
    assert!(!registered(text, "graviton_g"));
}

// The process wrapper every test starts `graviton` with (`support::process`).
#[tokio::test]
async fn a_graviton_that_exits_at_start_fails_with_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node.toml");
    let mut node = support::process::Graviton::serve_config(
        dir.path().join("node.log"),
        &config,
        |ports| format!("[node]\nlisten = \"{}\"\nno_such_key = 1\n", ports.listen()),
        |command| {
            command.env_remove("GRAVITON_CONFIG");
        },
    );
    let failure = node
        .wait_ready(std::time::Duration::from_secs(30))
        .await
        .expect_err("a config with an unknown key must not start");
    assert!(failure.contains("exited"), "{failure}");
    assert!(failure.contains("node.no_such_key"), "the log: {failure}");
}

#[tokio::test]
async fn a_graviton_that_lost_a_port_race_is_started_again_on_new_ports() {
    let dir = tempfile::tempdir().unwrap();
    // The first attempt is made to bind a port another socket holds.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let mut attempts = Vec::new();
    let mut node = support::process::Graviton::serve(dir.path().join("node.log"), |ports| {
        let listen = if attempts.is_empty() {
            taken.clone()
        } else {
            ports.listen()
        };
        attempts.push(listen.clone());
        let mut command = std::process::Command::new(support::process::BIN);
        command
            .args(["serve", "--listen", &listen, "--data-dir"])
            .arg(dir.path().join("data"))
            .env_remove("GRAVITON_CONFIG");
        command
    });
    node.ready(std::time::Duration::from_secs(30)).await;
    assert_eq!(attempts.len(), 2, "started again once: {attempts:?}");
    assert_eq!(node.url, format!("http://{}", attempts[1]));
}

#[tokio::test]
#[should_panic(expected = "waiting for: a condition that never holds")]
async fn wait_for_names_what_it_waited_for() {
    support::wait_for(
        std::time::Duration::from_millis(100),
        "a condition that never holds",
        || async { false },
    )
    .await;
}
