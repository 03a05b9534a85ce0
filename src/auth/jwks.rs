//! One issuer's signing keys: a JWKS from a file (read once) or a URL (fetched at start,
//! every `refresh_interval`, and on an unknown `kid` at most once per
//! `refetch_min_interval`). The last good set is kept when a fetch fails.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};

use super::AuthError;
use super::config::IssuerConfig;

/// Largest JWKS document accepted.
const MAX_JWKS_BYTES: usize = 1 << 20;

/// Fetch counters of one issuer.
#[derive(Debug, Default)]
pub struct JwksStats {
    /// Successful and failed fetches of the JWKS URL.
    pub fetches: AtomicU64,
    /// Fetches triggered by an unknown `kid`.
    pub kid_refetches: AtomicU64,
    pub failures: AtomicU64,
}

#[derive(Default)]
struct KeySet {
    by_kid: HashMap<String, (AlgorithmFamily, DecodingKey)>,
    without_kid: Vec<(AlgorithmFamily, DecodingKey)>,
    loaded: bool,
}

enum Source {
    File(PathBuf),
    Url(String),
}

pub(super) struct IssuerKeys {
    source: Source,
    allow_hmac: bool,
    refetch_min_interval: Duration,
    http: reqwest::Client,
    keys: RwLock<Arc<KeySet>>,
    /// When the URL was last fetched (serializes refetches, too).
    last_fetch: tokio::sync::Mutex<Option<Instant>>,
    /// When an unknown `kid` last caused a fetch (the rate limit of such refetches).
    last_kid_refetch: std::sync::Mutex<Option<Instant>>,
    stats: JwksStats,
}

impl IssuerKeys {
    pub(super) fn new(config: &IssuerConfig, http: reqwest::Client) -> Self {
        let source = match (&config.jwks_file, &config.jwks_url) {
            (Some(path), _) => Source::File(path.clone()),
            (None, Some(url)) => Source::Url(url.clone()),
            (None, None) => Source::File(PathBuf::new()),
        };
        Self {
            source,
            allow_hmac: config.allow_hs256,
            refetch_min_interval: config.refetch_min_interval.get(),
            http,
            keys: RwLock::new(Arc::new(KeySet::default())),
            last_fetch: tokio::sync::Mutex::new(None),
            last_kid_refetch: std::sync::Mutex::new(None),
            stats: JwksStats::default(),
        }
    }

    pub(super) fn stats(&self) -> &JwksStats {
        &self.stats
    }

    /// A file must load; a URL that fails now is retried by the refresh.
    pub(super) async fn load_initial(&self) -> Result<(), String> {
        match &self.source {
            Source::File(path) => {
                let text = std::fs::read(path)
                    .map_err(|e| format!("auth JWKS file {}: {e}", path.display()))?;
                let set = self
                    .parse(&text)
                    .map_err(|e| format!("auth JWKS file {}: {e}", path.display()))?;
                self.install(set);
                Ok(())
            }
            Source::Url(_) => {
                let mut last = self.last_fetch.lock().await;
                if let Err(err) = self.fetch(&mut last).await {
                    tracing::warn!(error = %err, "JWKS fetch failed at start; will retry");
                }
                Ok(())
            }
        }
    }

    fn parse(&self, bytes: &[u8]) -> Result<KeySet, String> {
        let set: JwkSet = serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS: {e}"))?;
        let mut keys = KeySet {
            loaded: true,
            ..KeySet::default()
        };
        for jwk in &set.keys {
            if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_)) && !self.allow_hmac {
                continue; // shared secrets only when HS256 is explicitly allowed
            }
            let Ok(key) = DecodingKey::from_jwk(jwk) else {
                tracing::warn!(kid = ?jwk.common.key_id, "skipping an unusable JWKS key");
                continue;
            };
            let entry = (key.family(), key);
            match &jwk.common.key_id {
                Some(kid) => {
                    keys.by_kid.insert(kid.clone(), entry);
                }
                None => keys.without_kid.push(entry),
            }
        }
        Ok(keys)
    }

    fn install(&self, set: KeySet) {
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(set);
    }

    fn current(&self) -> Arc<KeySet> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn fetch(&self, last: &mut Option<Instant>) -> Result<(), String> {
        let Source::Url(url) = &self.source else {
            return Ok(());
        };
        *last = Some(Instant::now());
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        let result = async {
            let response = self
                .http
                .get(url)
                .send()
                .await
                .map_err(|e| format!("GET JWKS: {e}"))?;
            if !response.status().is_success() {
                return Err(format!("GET JWKS answered {}", response.status()));
            }
            if response
                .content_length()
                .is_some_and(|n| n as usize > MAX_JWKS_BYTES)
            {
                return Err("JWKS document too large".to_string());
            }
            let bytes = response
                .bytes()
                .await
                .map_err(|e| format!("read JWKS: {e}"))?;
            if bytes.len() > MAX_JWKS_BYTES {
                return Err("JWKS document too large".to_string());
            }
            self.parse(&bytes)
        }
        .await;
        match result {
            Ok(set) => {
                self.install(set);
                Ok(())
            }
            Err(err) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                Err(err)
            }
        }
    }

    /// The key for a token's `kid` and `alg`.
    pub(super) async fn find(
        &self,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<DecodingKey, AuthError> {
        if let Some(key) = lookup(&self.current(), kid, alg)? {
            return Ok(key);
        }
        // Unknown kid: maybe the issuer rotated keys. Refetch a URL, rate limited.
        if let Source::Url(_) = &self.source {
            let mut last = self.last_fetch.lock().await;
            // Another request may have refetched while we waited for the lock.
            if let Some(key) = lookup(&self.current(), kid, alg)? {
                return Ok(key);
            }
            let due = {
                let mut kid_last = self
                    .last_kid_refetch
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                let due = kid_last.is_none_or(|at| at.elapsed() >= self.refetch_min_interval);
                if due {
                    *kid_last = Some(Instant::now());
                }
                due
            };
            if due {
                self.stats.kid_refetches.fetch_add(1, Ordering::Relaxed);
                if let Err(err) = self.fetch(&mut last).await {
                    tracing::warn!(error = %err, "JWKS refetch for an unknown key id failed");
                }
                if let Some(key) = lookup(&self.current(), kid, alg)? {
                    return Ok(key);
                }
            }
        }
        if self.current().loaded {
            Err(AuthError::UnknownKey)
        } else {
            Err(AuthError::KeysUnavailable)
        }
    }
}

fn lookup(
    set: &KeySet,
    kid: Option<&str>,
    alg: Algorithm,
) -> Result<Option<DecodingKey>, AuthError> {
    let fits = |family: &AlgorithmFamily| family.algorithms().contains(&alg);
    match kid {
        Some(kid) => match set.by_kid.get(kid) {
            Some((family, key)) if fits(family) => Ok(Some(key.clone())),
            Some(_) => Err(AuthError::Algorithm),
            None => Ok(None),
        },
        None => {
            // Without a kid only an unambiguous key set is usable.
            let mut candidates = set
                .without_kid
                .iter()
                .chain(set.by_kid.values())
                .filter(|(family, _)| fits(family));
            match (candidates.next(), candidates.next()) {
                (Some((_, key)), None) => Ok(Some(key.clone())),
                (None, _) => Ok(None),
                (Some(_), Some(_)) => Err(AuthError::UnknownKey),
            }
        }
    }
}

/// Refetch a URL key set every `interval` while the issuer is alive.
pub(super) fn spawn_refresh(keys: &Arc<IssuerKeys>, interval: Duration) {
    if !matches!(keys.source, Source::Url(_)) {
        return;
    }
    let weak: Weak<IssuerKeys> = Arc::downgrade(keys);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(interval).await;
            let Some(keys) = weak.upgrade() else { return };
            let mut last = keys.last_fetch.lock().await;
            if let Err(err) = keys.fetch(&mut last).await {
                tracing::warn!(error = %err, "JWKS refresh failed; keeping the last key set");
            }
        }
    });
}
