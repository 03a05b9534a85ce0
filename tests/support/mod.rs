//! Real-service test harness shared by the integration tests.
//!
//! * [`RedisServer`]: a private `redis-server` on a free loopback port, one per test, that a
//!   fault test can stop and restart on the same port.
//! * [`redis_cluster::RedisCluster`]: a private Redis Cluster (primaries plus replicas) with
//!   slot migration and failover; [`admission_events::sweep`]: the event-stream ceiling check.
//! * [`placement`]: placement nodes on one database, with table predicates to poll for.
//! * [`wait_for`]: the polling helper, which panics naming what it awaited;
//!   [`wait_until`] is its boolean form for a caller that adds state to the failure,
//!   [`eventually`] its form for a synchronous check, [`poll_blocking`] its form for a
//!   synchronous test. [`client`]: the one HTTP client of the tests.
//! * [`process::Graviton`]: the one wrapper of a `graviton` process a test starts (fresh
//!   ports and a retry of a lost port race, stderr captured for failure messages,
//!   killed on drop); [`cluster::NodeProcess`] is a cluster node on top of it.
//! * [`admission`]: the Redis admission configuration of tests, built once.
//! * [`wait_ready`], [`download`], [`upload`] and [`kill9`] for tests that talk to a
//!   node over HTTP; [`node::pack_files`]: the one pack walker.
//! * [`TestDatabase`]: a fresh PostgreSQL database per test on the server named by
//!   `GRAVITON_TEST_DATABASE_URL` (default: the local server on 127.0.0.1:5432), dropped
//!   again when the test ends.
//! * [`garage::Garage`]: a private Garage (S3) process for tests that stop or kill it.
//! * [`metrics`]: the one exact reader of a `/metrics` scrape (whole series, never a prefix).
//! * [`pg_proxy::PgProxy`]: a TCP proxy for one process's PostgreSQL connections that
//!   delays or black-holes live connections (by pool label and direction) on command.
//! * [`postgres_server::PostgresServer`]: a private PostgreSQL server (initdb + pg_ctl on a
//!   free port) for faults the shared server must not see: restarts and stops.
//!
//! When a service is missing the helpers return `None` after printing a loud `SKIPPED`
//! line, so a plain `cargo test` on a bare laptop still runs the unit suite. With
//! `GRAVITON_REQUIRE_SERVICES=1` (set by `scripts/test` and `.ci/run`) a missing service
//! fails the test instead: CI can never go green by skipping.
#![allow(dead_code)]

pub mod admission;
pub mod admission_events;
pub mod cluster;
pub mod garage;
pub mod lazyfs;
pub mod metrics;
pub mod node;
pub mod pg_proxy;
pub mod pki;
pub mod placement;
pub mod postgres;
pub mod postgres_server;
pub mod process;
pub mod redis;
pub mod redis_cluster;

#[allow(unused_imports)]
pub use postgres::TestDatabase;
#[allow(unused_imports)]
pub use redis::RedisServer;

/// True when the run demands every external service (`GRAVITON_REQUIRE_SERVICES=1`).
pub fn services_required() -> bool {
    matches!(
        std::env::var("GRAVITON_REQUIRE_SERVICES").as_deref(),
        Ok("1") | Ok("true") | Ok("yes")
    )
}

/// Report a missing service: panic when services are required, else print a loud skip line.
pub fn missing_service(test: &str, what: &str) {
    if services_required() {
        panic!("{test}: required service unavailable: {what} (GRAVITON_REQUIRE_SERVICES=1)");
    }
    eprintln!("SKIPPED {test}: {what}; set GRAVITON_REQUIRE_SERVICES=1 to make this a failure");
}

/// Pick a free TCP port on 127.0.0.1 for a server a test starts: a random port below the
/// kernel's ephemeral range, checked by binding it. Port 0 would hand out an ephemeral
/// port, which any process's next outgoing connection (a PostgreSQL pool, an HTTP client)
/// may take before the server binds it; seen as a nemesis node whose control port was
/// another process's HTTP listener. Random picks from a range of ten thousand or more make
/// two tests choosing the same port rare, and the node harness restarts a node that lost
/// such a race.
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    // Redis Cluster nodes also bind their port + 10000 (the cluster bus).
    let (first, last) = (10_000u16, low.min(55_000));
    if last > first + 1_000 {
        for _ in 0..1_000 {
            let port = first + (uuid::Uuid::new_v4().as_u128() % u128::from(last - first)) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// A short random suffix for names that must be unique per test (cells, databases).
pub fn unique_suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_string()
}

/// The HTTP client of every test: no proxy (a proxy from the environment must never sit
/// between a test and its node).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// Poll `check` until it returns true or `timeout` passes; returns whether it became true.
/// The boolean form of [`wait_for`], for a caller whose failure message needs state it
/// reads afterwards (a log, the last answer).
pub async fn wait_until<F, Fut>(timeout: std::time::Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Poll `check` until it returns true; panic naming `what` after `timeout`. The one
/// polling loop of the tests.
pub async fn wait_for<F, Fut>(timeout: std::time::Duration, what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if !wait_until(timeout, check).await {
        panic!("timed out after {timeout:?} waiting for: {what}");
    }
}

/// Poll the synchronous `check` until it is true; panic naming `what` after `timeout`.
/// Returns how long it took.
pub async fn eventually<F>(
    timeout: std::time::Duration,
    what: &str,
    mut check: F,
) -> std::time::Duration
where
    F: FnMut() -> bool,
{
    let start = std::time::Instant::now();
    wait_for(timeout, what, || std::future::ready(check())).await;
    start.elapsed()
}

/// [`wait_until`] for a synchronous test (it blocks the thread): poll `check` every 20 ms
/// until it is true or `timeout` passes; returns whether it became true.
pub fn poll_blocking(timeout: std::time::Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Wait until the node at `url` answers `GET /readyz` with 200; panics after `within`.
pub async fn wait_ready(url: &str, within: std::time::Duration) {
    let client = client();
    wait_for(
        within,
        &format!("the node at {url} to answer /readyz with 200"),
        || async {
            client
                .get(format!("{url}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
}

/// `GET /v1/blobs/{key}` on the node at `url`: the status and the body.
pub async fn download(url: &str, key: &str) -> (u16, Vec<u8>) {
    let client = client();
    let response = client
        .get(format!("{url}/v1/blobs/{key}"))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.bytes().await.unwrap().to_vec())
}

/// `DELETE /v1/blobs/{key}` with the admin token `admin` on the node at `url`; the
/// deletion must be acknowledged (204).
pub async fn delete_blob(url: &str, key: &str, admin: &str) {
    let client = client();
    let response = client
        .delete(format!("{url}/v1/blobs/{key}"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 204, "DELETE /v1/blobs/{key}");
}

/// SIGKILL a child process (no shutdown code of it runs) and reap it.
pub fn kill9(child: &mut std::process::Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Whether process `pid` is stopped (state `T` in /proc), e.g. by SIGSTOP.
pub fn process_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let after = stat.rsplit_once(')')?.1.trim_start().chars().next()?;
            Some(after == 'T')
        })
        .unwrap_or(false)
}
