//! The coordinator's connection to Redis: one server or a Redis Cluster, plain or TLS.
//!
//! * **One server**: a redis-rs `ConnectionManager` (multiplexed, reconnects in the
//!   background).
//! * **Cluster** (`[admission.redis] cluster = true`): redis-rs's cluster-async client,
//!   seeded from `url` plus `seeds`. It learns the slot map from `CLUSTER SLOTS`, follows
//!   `MOVED` (and refreshes the map) and `ASK`, waits and retries on `TRYAGAIN`,
//!   `CLUSTERDOWN` and `MASTERDOWN`, and refreshes the map on `READONLY` (a write that hit a
//!   demoted primary). Every key of a cell carries the `{cell}` hash tag, so each script
//!   call names keys of exactly one slot and runs on that slot's primary
//!   ([`check_one_slot`] checks this before a call is sent).
//! * **TLS** (`rediss://`): the server certificate is verified against the system roots,
//!   or against `ca_file` only when one is given; `verify_tls = false` accepts any
//!   certificate (tests only).
//!
//! Both kinds implement `redis::aio::ConnectionLike`, so scripts and commands are sent the
//! same way. Connection details and credentials never leave this module in an error: the
//! callers reduce errors to a category.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;
use redis::{
    Cmd, ConnectionInfo, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, RedisResult,
    TlsCertificates, Value,
};

/// Retries of one command by the cluster client (redirects, `TRYAGAIN`, reconnects). A
/// slot migration answers `TRYAGAIN` to a multi-key script while the cell's keys are split
/// between two nodes, so this must outlast the migration of a few keys.
pub const CLUSTER_RETRIES: u32 = 12;

/// What [`connect`] needs; built by the coordinator from its config.
pub struct ConnectSpec<'a> {
    pub urls: Vec<String>,
    pub cluster: bool,
    pub username: Option<&'a str>,
    pub password: Option<&'a str>,
    pub verify_tls: bool,
    /// PEM roots that replace the system roots (`ca_file`'s contents).
    pub ca_pem: Option<Vec<u8>>,
    pub call_timeout: Duration,
}

/// A connection to one server or to a cluster. Cheap to clone; clones share the sockets.
#[derive(Clone)]
pub enum Connection {
    Single(ConnectionManager),
    Cluster {
        conn: ClusterConnection,
        /// Over TLS, a plain client of the first seed with the same roots: when the
        /// cluster client finds no connection, it tells why (see [`diagnose`]).
        seed: Option<std::sync::Arc<(redis::Client, Duration)>>,
    },
}

impl Connection {
    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster { .. })
    }
}

/// A TLS handshake that failed on the server's certificate (untrusted issuer, wrong name,
/// expired): rustls's error travels inside an I/O error, so look at its text.
pub fn is_certificate_error(err: &RedisError) -> bool {
    let text = err.to_string();
    text.contains("invalid peer certificate") || text.contains("certificate")
}

/// The cluster client connects lazily and, when no node can be reached, answers
/// `ClusterConnectionNotFound` without the handshake's own error. Over TLS, one direct
/// connection to the first seed tells a refused certificate (answered as that error, so
/// it is categorised and not retried like on one server) from a node that is down (the
/// cluster's error stands).
async fn diagnose(seed: &(redis::Client, Duration), err: RedisError) -> RedisError {
    let (client, timeout) = seed;
    match tokio::time::timeout(*timeout, client.get_multiplexed_async_connection()).await {
        Ok(Err(handshake)) if is_certificate_error(&handshake) => handshake,
        _ => err,
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(conn) => conn.req_packed_command(cmd),
            Connection::Cluster { conn, seed } => Box::pin(async move {
                match conn.req_packed_command(cmd).await {
                    Err(err) if err.kind() == redis::ErrorKind::ClusterConnectionNotFound => {
                        Err(match seed {
                            Some(seed) => diagnose(seed, err).await,
                            None => err,
                        })
                    }
                    other => other,
                }
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            Connection::Cluster { conn, .. } => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(conn) => conn.get_db(),
            Connection::Cluster { conn, .. } => conn.get_db(),
        }
    }
}

fn connection_info(url: &str, spec: &ConnectSpec<'_>) -> RedisResult<ConnectionInfo> {
    let mut url = url.trim().to_string();
    if url.starts_with("rediss://") && !spec.verify_tls {
        url.push_str("#insecure");
    }
    let info = url.into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = spec.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = spec.password {
        settings = settings.set_password(password);
    }
    Ok(info.set_redis_settings(settings))
}

fn uses_tls(spec: &ConnectSpec<'_>) -> bool {
    spec.urls.iter().any(|u| u.trim().starts_with("rediss://"))
}

fn certificates(spec: &ConnectSpec<'_>) -> Option<TlsCertificates> {
    match (&spec.ca_pem, uses_tls(spec) && spec.verify_tls) {
        (Some(pem), true) => Some(TlsCertificates {
            client_tls: None,
            root_cert: Some(pem.clone()),
        }),
        _ => None,
    }
}

/// Build the client without connecting: the node starts while Redis is down, and every
/// call fails until it answers. Needs a tokio runtime (the cluster client spawns its task).
pub fn connect(spec: &ConnectSpec<'_>) -> RedisResult<Connection> {
    let infos = spec
        .urls
        .iter()
        .map(|url| connection_info(url, spec))
        .collect::<RedisResult<Vec<_>>>()?;
    if spec.cluster {
        let first = infos.first().cloned();
        let mut builder = ClusterClientBuilder::new(infos)
            .connection_timeout(spec.call_timeout)
            .response_timeout(spec.call_timeout)
            .retries(CLUSTER_RETRIES)
            .min_retry_wait(20)
            .max_retry_wait(500);
        let certs = certificates(spec);
        if let Some(certs) = certs.clone() {
            builder = builder.certs(certs);
        }
        let seed = match (&certs, first) {
            (Some(certs), Some(info)) => Some(std::sync::Arc::new((
                redis::Client::build_with_tls(info, certs.clone())?,
                spec.call_timeout,
            ))),
            (None, Some(info)) if uses_tls(spec) => Some(std::sync::Arc::new((
                redis::Client::open(info)?,
                spec.call_timeout,
            ))),
            _ => None,
        };
        let client = builder.build()?;
        let config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(spec.call_timeout)
            .set_response_timeout(spec.call_timeout);
        return Ok(Connection::Cluster {
            conn: client.get_pending_async_connection_with_config(config),
            seed,
        });
    }
    let info = infos
        .into_iter()
        .next()
        .ok_or_else(|| RedisError::from((redis::ErrorKind::InvalidClientConfig, "no Redis URL")))?;
    let client = match certificates(spec) {
        Some(certs) => redis::Client::build_with_tls(info, certs)?,
        None => redis::Client::open(info)?,
    };
    let manager_config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(spec.call_timeout))
        .set_connection_timeout(Some(spec.call_timeout))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    Ok(Connection::Single(ConnectionManager::new_lazy_with_config(
        client,
        manager_config,
    )?))
}

/// The Redis Cluster hash slot of `key` (CRC16 of the hash tag, or of the whole key).
pub fn slot(key: &str) -> Slot {
    Slot::for_key(key)
}

/// `true` when every key maps to one hash slot (a script call may name them together).
pub fn check_one_slot<'a>(keys: impl IntoIterator<Item = &'a str>) -> bool {
    let mut slots = keys.into_iter().map(slot);
    match slots.next() {
        Some(first) => slots.all(|s| s == first),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tags_pick_the_slot() {
        // Redis's own examples (CLUSTER KEYSLOT).
        assert_eq!(slot("foo"), Slot::new(12182).unwrap());
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert!(check_one_slot(["a:{x}:1", "b:{x}:2"]));
        assert!(!check_one_slot(["a:{x}:1", "b:{y}:2"]));
    }
}
