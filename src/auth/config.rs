//! `[auth]`: JWT bearer authentication of the public API (shape, defaults, validation).
//!
//! Off by default (the embedded single node needs no identity provider). When on, every
//! `[[auth.issuers]]` entry names one trusted issuer with its keys (a JWKS file or URL),
//! accepted algorithms, audience, clock leeway, and the claim that carries the caller's
//! organization (tenant) UUID.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::values::HumanDuration;
use crate::values::Problem;

/// Default claim carrying the organization (tenant) UUID.
pub const ORG_CLAIM_DEFAULT: &str = "org_id";

/// `[auth]` section.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Require a valid bearer token on uploads, downloads and quota-charging requests.
    pub enabled: bool,
    /// Trusted issuers (`[[auth.issuers]]`); at least one when enabled.
    pub issuers: Vec<IssuerConfig>,
}

/// One trusted token issuer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IssuerConfig {
    /// Exact `iss` claim value.
    pub issuer: String,
    /// Accepted `aud` values; a token must name at least one.
    pub audience: Vec<String>,
    /// JWKS document on disk (read at start).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwks_file: Option<PathBuf>,
    /// JWKS URL, fetched at start and every `refresh_interval`: `https://`, or `http://`
    /// to a loopback host (or anywhere with `allow_insecure_jwks_url`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jwks_url: Option<String>,
    /// Accept an `http://` JWKS URL to a host that is not loopback. Off by default: anyone
    /// on the path could install signing keys, and tokens they sign would be admitted.
    pub allow_insecure_jwks_url: bool,
    /// How often a JWKS URL is fetched again.
    pub refresh_interval: HumanDuration,
    /// A token naming an unknown `kid` refetches the JWKS URL at most this often.
    pub refetch_min_interval: HumanDuration,
    /// Accepted `alg` values: any of `RS256`, `ES256`, `EdDSA`, and `HS256` only with
    /// `allow_hs256`.
    pub algorithms: Vec<String>,
    /// Accept HS256 (shared-secret) tokens and `oct` keys. Off by default.
    pub allow_hs256: bool,
    /// Clock skew tolerated on `exp` and `nbf`.
    pub leeway: HumanDuration,
    /// Claim carrying the caller's organization UUID (the tenant).
    pub org_claim: String,
}

impl Default for IssuerConfig {
    fn default() -> Self {
        Self {
            issuer: String::new(),
            audience: Vec::new(),
            jwks_file: None,
            jwks_url: None,
            allow_insecure_jwks_url: false,
            refresh_interval: HumanDuration::secs(300),
            refetch_min_interval: HumanDuration::secs(30),
            algorithms: vec!["RS256".into(), "ES256".into(), "EdDSA".into()],
            allow_hs256: false,
            leeway: HumanDuration::secs(30),
            org_claim: ORG_CLAIM_DEFAULT.to_string(),
        }
    }
}

/// Whether an `http://` URL names a loopback host (`localhost`, `127.0.0.0/8`, `::1`).
fn is_loopback_url(url: &str) -> bool {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return false;
    };
    let Some(host) = parsed.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

/// The algorithms an issuer may name.
pub const SUPPORTED_ALGORITHMS: &[&str] = &["RS256", "ES256", "EdDSA", "HS256"];

impl AuthConfig {
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.enabled && self.issuers.is_empty() {
            problems.push(Problem::new(
                "auth.issuers",
                "at least one issuer is required when auth.enabled = true",
            ));
        }
        for issuer in &self.issuers {
            issuer.problems(&mut problems);
        }
        let mut names: Vec<&str> = self.issuers.iter().map(|i| i.issuer.as_str()).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            problems.push(Problem::new(
                "auth.issuers.issuer",
                "each issuer may appear only once",
            ));
        }
        problems
    }
}

impl IssuerConfig {
    fn problems(&self, problems: &mut Vec<Problem>) {
        if self.issuer.trim().is_empty() {
            problems.push(Problem::new("auth.issuers.issuer", "must not be empty"));
        }
        if self.audience.is_empty() || self.audience.iter().any(|a| a.trim().is_empty()) {
            problems.push(Problem::new(
                "auth.issuers.audience",
                "must list at least one non-empty audience",
            ));
        }
        match (&self.jwks_file, &self.jwks_url) {
            (None, None) | (Some(_), Some(_)) => problems.push(Problem::new(
                "auth.issuers.jwks_file",
                "exactly one of jwks_file and jwks_url is required",
            )),
            (None, Some(url)) if !(url.starts_with("https://") || url.starts_with("http://")) => {
                problems.push(Problem::new(
                    "auth.issuers.jwks_url",
                    "must be an http:// or https:// URL",
                ))
            }
            (None, Some(url))
                if url.starts_with("http://")
                    && !self.allow_insecure_jwks_url
                    && !is_loopback_url(url) =>
            {
                problems.push(Problem::new(
                    "auth.issuers.jwks_url",
                    "plain http:// is accepted only to a loopback host: use https://, or set \
                     allow_insecure_jwks_url = true if the path to this host is trusted",
                ))
            }
            _ => {}
        }
        if self.algorithms.is_empty() {
            problems.push(Problem::new(
                "auth.issuers.algorithms",
                "must list at least one algorithm",
            ));
        }
        for alg in &self.algorithms {
            if !SUPPORTED_ALGORITHMS.contains(&alg.as_str()) {
                problems.push(Problem::new(
                    "auth.issuers.algorithms",
                    format!(
                        "unsupported algorithm {alg:?} (supported: RS256, ES256, EdDSA, HS256)"
                    ),
                ));
            } else if alg == "HS256" && !self.allow_hs256 {
                problems.push(Problem::new(
                    "auth.issuers.algorithms",
                    "HS256 needs allow_hs256 = true (shared-secret tokens are off by default)",
                ));
            }
        }
        if self.refresh_interval.get().is_zero() {
            problems.push(Problem::new(
                "auth.issuers.refresh_interval",
                "must be greater than zero",
            ));
        }
        if self.org_claim.trim().is_empty() {
            problems.push(Problem::new("auth.issuers.org_claim", "must not be empty"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issuer() -> IssuerConfig {
        IssuerConfig {
            issuer: "https://idp.example".into(),
            audience: vec!["graviton".into()],
            jwks_file: Some("/etc/graviton/jwks.json".into()),
            ..IssuerConfig::default()
        }
    }

    #[test]
    fn plain_http_jwks_is_refused_unless_loopback_or_allowed() {
        let with = |url: &str, allow: bool| IssuerConfig {
            jwks_file: None,
            jwks_url: Some(url.into()),
            allow_insecure_jwks_url: allow,
            ..issuer()
        };
        let refused = |c: &IssuerConfig| {
            let mut problems = Vec::new();
            c.problems(&mut problems);
            problems.iter().any(|p| p.key == "auth.issuers.jwks_url")
        };
        assert!(refused(&with("http://idp.example/jwks", false)));
        assert!(refused(&with("http://10.0.0.5:8080/jwks", false)));
        assert!(!refused(&with("http://idp.example/jwks", true)));
        assert!(!refused(&with("https://idp.example/jwks", false)));
        for loopback in [
            "http://127.0.0.1:9000/jwks",
            "http://localhost/jwks",
            "http://[::1]:80/jwks",
        ] {
            assert!(!refused(&with(loopback, false)), "{loopback}");
        }
    }

    #[test]
    fn default_is_off_and_valid() {
        assert!(AuthConfig::default().problems().is_empty());
        assert!(!AuthConfig::default().enabled);
        assert_eq!(IssuerConfig::default().org_claim, "org_id");
    }

    #[test]
    fn enabled_needs_a_well_formed_issuer() {
        let mut config = AuthConfig {
            enabled: true,
            issuers: vec![],
        };
        assert_eq!(config.problems()[0].key, "auth.issuers");
        config.issuers.push(issuer());
        assert!(config.problems().is_empty(), "{:?}", config.problems());

        let mut bad = issuer();
        bad.jwks_url = Some("https://idp.example/jwks".into());
        bad.audience.clear();
        bad.algorithms = vec!["HS256".into(), "none".into()];
        let keys: Vec<_> = AuthConfig {
            enabled: true,
            issuers: vec![bad],
        }
        .problems()
        .into_iter()
        .map(|p| p.key)
        .collect();
        assert!(keys.contains(&"auth.issuers.jwks_file"), "{keys:?}");
        assert!(keys.contains(&"auth.issuers.audience"), "{keys:?}");
        assert_eq!(
            keys.iter()
                .filter(|k| **k == "auth.issuers.algorithms")
                .count(),
            2
        );
    }

    #[test]
    fn hs256_only_when_explicitly_allowed() {
        let mut hs = issuer();
        hs.algorithms = vec!["HS256".into()];
        hs.allow_hs256 = true;
        let config = AuthConfig {
            enabled: true,
            issuers: vec![hs],
        };
        assert!(config.problems().is_empty(), "{:?}", config.problems());
    }
}
