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
