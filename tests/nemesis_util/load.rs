//! Client load: concurrent uploads of random content (never deduplicating) with the session
//! headers, sent to random nodes, retried on the documented retryable answers. Every HTTP
//! attempt goes into the shared history.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use graviton::ids::{SessionId, SessionKey, TenantId};
use graviton::placement::hash::shard_of;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::history::{Attempt, Outcome};
use crate::support::node::random_bytes;

/// A node as clients see it (its URL stays the same across restarts).
#[derive(Clone, Debug)]
pub struct Target {
    pub id: String,
    pub url: String,
}

/// Attempts per logical upload before the client gives up.
pub const MAX_ATTEMPTS: usize = 12;
/// Per-request bound (a SIGSTOPped node holds connections open).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct History {
    pub t0: Instant,
    /// `t0` on the wall clock (µs since the Unix epoch), the nodes' record timeline.
    pub t0_unix_us: u64,
    pub attempts: Arc<Mutex<Vec<Attempt>>>,
    next_op: Arc<AtomicU64>,
    pub acked_ops: Arc<AtomicU64>,
    pub failed_ops: Arc<AtomicU64>,
    /// One line per logical upload that failed after its retries (its last answer).
    pub failures: Arc<Mutex<Vec<String>>>,
    pub client: reqwest::Client,
    pub shard_count: u32,
}

impl History {
    pub fn new(shard_count: u32) -> Self {
        Self {
            t0: Instant::now(),
            t0_unix_us: graviton::upload::record::unix_micros(std::time::SystemTime::now()),
            attempts: Arc::default(),
            next_op: Arc::default(),
            acked_ops: Arc::default(),
            failed_ops: Arc::default(),
            failures: Arc::default(),
            client: reqwest::Client::builder()
                .no_proxy()
                .timeout(REQUEST_TIMEOUT)
                .build()
                .unwrap(),
            shard_count,
        }
    }

    pub fn snapshot(&self) -> Vec<Attempt> {
        self.attempts.lock().unwrap().clone()
    }

    pub fn shard(&self, key: &SessionKey) -> u32 {
        shard_of(key, self.shard_count).0
    }

    /// One HTTP attempt; `trickle` streams the body in 64 KiB pieces 10 ms apart so that
    /// concurrent attempts of one session overlap for certain.
    pub async fn attempt(
        &self,
        target: &Target,
        key: &SessionKey,
        op: u64,
        content_seed: u64,
        len: usize,
        trickle: bool,
    ) -> Attempt {
        let data = random_bytes(len, content_seed);
        let body = if trickle {
            let pieces: Vec<bytes::Bytes> = data
                .chunks(64 << 10)
                .map(bytes::Bytes::copy_from_slice)
                .collect();
            let stream = futures_util::stream::unfold(pieces.into_iter(), |mut it| async move {
                let next = it.next()?;
                tokio::time::sleep(Duration::from_millis(10)).await;
                Some((Ok::<_, std::io::Error>(next), it))
            });
            reqwest::Body::wrap_stream(stream)
        } else {
            reqwest::Body::from(data)
        };
        let start = self.t0.elapsed();
        let sent = self
            .client
            .post(format!("{}/v1/blobs", target.url))
            .header("x-graviton-tenant-id", key.tenant.to_string())
            .header("x-graviton-upload-session-id", key.session.to_string())
            .header(reqwest::header::CONTENT_LENGTH, len.to_string())
            .body(body)
            .send()
            .await;
        let outcome = match sent {
            Err(err) => Outcome::Transport(if err.is_timeout() {
                "timeout".into()
            } else if err.is_connect() {
                "connect".into()
            } else {
                "io".into()
            }),
            Ok(response) => {
                let code = response.status().as_u16();
                let retry_after = response.headers().contains_key("retry-after");
                match response.json::<serde_json::Value>().await {
                    Ok(json) if code == 201 => Outcome::Created {
                        key: json["key"].as_str().unwrap_or_default().to_string(),
                        owner: json["owner"].as_str().unwrap_or_default().to_string(),
                    },
                    Ok(json) => Outcome::Status {
                        code,
                        error: json["error"].as_str().map(str::to_string),
                        retry_after,
                    },
                    Err(_) if code == 201 => Outcome::Transport("201 body lost".into()),
                    Err(_) => Outcome::Status {
                        code,
                        error: None,
                        retry_after,
                    },
                }
            }
        };
        let attempt = Attempt {
            op,
            session: format!("{}/{}", key.tenant, key.session),
            tag: graviton::upload::record::session_tag(key),
            shard: self.shard(key),
            node: target.id.clone(),
            start,
            end: self.t0.elapsed(),
            content_seed,
            len,
            outcome,
        };
        self.attempts.lock().unwrap().push(attempt.clone());
        attempt
    }

    pub fn new_op(&self) -> u64 {
        self.next_op.fetch_add(1, Ordering::Relaxed)
    }

    /// One logical upload: retried on retryable answers, on a random node each time.
    pub async fn upload(
        &self,
        rng: &mut StdRng,
        targets: &[Target],
        key: &SessionKey,
        len: usize,
    ) -> bool {
        let op = self.new_op();
        let content_seed = rng.random::<u64>();
        let mut last = None;
        for n in 1..=MAX_ATTEMPTS {
            let target = &targets[rng.random_range(0..targets.len())];
            let attempt = self
                .attempt(target, key, op, content_seed, len, false)
                .await;
            if attempt.created().is_some() {
                self.acked_ops.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            let retryable = attempt.retryable();
            last = Some((n, attempt));
            if !retryable {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..250))).await;
        }
        self.failed_ops.fetch_add(1, Ordering::Relaxed);
        if let Some((n, attempt)) = last {
            self.failures.lock().unwrap().push(format!(
                "op {op} session {} failed after {n} attempt(s), last: {:?} from {} at {:.3}s",
                attempt.session,
                attempt.outcome,
                attempt.node,
                attempt.end.as_secs_f64()
            ));
        }
        false
    }

    /// `workers` clients uploading until `stop`, each with its own RNG from `seed`.
    pub fn spawn_workers(
        &self,
        workers: usize,
        seed: u64,
        sessions: Arc<Vec<SessionKey>>,
        targets: Arc<Vec<Target>>,
        stop: CancellationToken,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        (0..workers)
            .map(|w| {
                let history = self.clone();
                let sessions = sessions.clone();
                let targets = targets.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut rng = StdRng::seed_from_u64(seed ^ ((w as u64 + 1) * 0x9E37_79B9));
                    while !stop.is_cancelled() {
                        let key = sessions[rng.random_range(0..sessions.len())];
                        let len = rng.random_range(16 << 10..384 << 10);
                        history.upload(&mut rng, &targets, &key, len).await;
                    }
                })
            })
            .collect()
    }
}

/// Sessions from a seeded RNG (ids are uuids built from RNG bytes).
pub fn sessions(rng: &mut StdRng, n: usize) -> Vec<SessionKey> {
    (0..n)
        .map(|_| SessionKey {
            tenant: random_id::<TenantId>(rng),
            session: random_id::<SessionId>(rng),
        })
        .collect()
}

fn random_id<T: std::str::FromStr>(rng: &mut StdRng) -> T
where
    T::Err: std::fmt::Debug,
{
    uuid::Builder::from_random_bytes(rng.random())
        .into_uuid()
        .to_string()
        .parse()
        .expect("canonical uuid")
}
