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
