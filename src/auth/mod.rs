//! JWT bearer authentication: which caller (organization) a request acts for.
//!
//! Owns token verification only; the HTTP glue (which requests need a token, the
//! tenant-header binding, error responses) is `edge::auth`.
//!
//! Verification of one token, in order: the header parses (`alg: none` and garbage are
//! malformed) -> the unverified `iss` claim picks one configured issuer (none matches:
//! invalid) -> `alg` is one the issuer accepts -> the key is found by `kid` in the
//! issuer's JWKS (an unknown `kid` refetches a JWKS URL, at most once per
//! `refetch_min_interval`) -> `jsonwebtoken::decode` checks the signature, `exp`, `nbf`
//! (with the leeway), `iss` and `aud` -> the organization claim is a canonical UUID.
//! Signature checks are jsonwebtoken's (aws-lc-rs); nothing here handles key bytes.
//!
//! Failure model: every refusal is an [`AuthError`] whose text names what was wrong
//! with the token but never echoes it. A JWKS URL that cannot be fetched keeps the last
//! good key set; an issuer that never loaded keys answers [`AuthError::KeysUnavailable`].

pub mod config;
mod jwks;

use std::sync::Arc;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};

pub use config::{AuthConfig, IssuerConfig, ORG_CLAIM_DEFAULT};
pub use jwks::JwksStats;

use crate::ids::TenantId;
use jwks::IssuerKeys;

/// The authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The organization the token speaks for: the tenant of every quota and admission.
    pub org: TenantId,
    /// `iss` of the token.
    pub issuer: String,
}

/// Why a token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("a bearer token is required")]
    Missing,
    #[error("the bearer token is malformed")]
    Malformed,
    #[error("the token is not from a trusted issuer")]
    UnknownIssuer,
    #[error("the token's algorithm is not accepted")]
    Algorithm,
    #[error("the token names a signing key this server does not know")]
    UnknownKey,
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid yet")]
    NotYetValid,
    #[error("the token is not meant for this audience")]
    Audience,
    #[error("the token's signature is invalid")]
    Signature,
    #[error("the token carries no valid organization claim")]
    Organization,
    #[error("the token is invalid")]
    Invalid,
    #[error("the issuer's signing keys are not available yet")]
    KeysUnavailable,
}

/// Verifies bearer tokens against the configured issuers.
pub struct Authenticator {
    issuers: Vec<Issuer>,
}

struct Issuer {
    name: String,
    algorithms: Vec<Algorithm>,
    validation: Validation,
    org_claim: String,
    keys: Arc<IssuerKeys>,
}

impl Authenticator {
    /// Load every issuer's keys (files read, URLs fetched once) and start the refresh
    /// of URL key sets. A URL that cannot be fetched now is retried by the refresh.
    pub async fn start(config: &AuthConfig) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|e| format!("JWKS client: {e}"))?;
        let mut issuers = Vec::new();
        for issuer in &config.issuers {
            let algorithms: Vec<Algorithm> = issuer
                .algorithms
                .iter()
                .map(|a| a.parse().map_err(|_| format!("unsupported algorithm {a}")))
                .collect::<Result<_, _>>()?;
            let keys = Arc::new(IssuerKeys::new(issuer, http.clone()));
            keys.load_initial().await?;
            jwks::spawn_refresh(&keys, issuer.refresh_interval.get());
            let mut validation = Validation::new(algorithms[0]);
            validation.algorithms = algorithms.clone();
            validation.leeway = issuer.leeway.get().as_secs();
            validation.validate_nbf = true;
            validation.set_issuer(&[issuer.issuer.as_str()]);
            validation.set_audience(&issuer.audience);
            validation.set_required_spec_claims(&["exp", "iss", "aud"]);
            issuers.push(Issuer {
                name: issuer.issuer.clone(),
                algorithms,
                validation,
                org_claim: issuer.org_claim.clone(),
                keys,
            });
        }
        Ok(Self { issuers })
    }

    /// JWKS fetch counters of the issuer named `issuer` (tests, metrics).
    pub fn jwks_stats(&self, issuer: &str) -> Option<&JwksStats> {
        self.issuers
            .iter()
            .find(|i| i.name == issuer)
            .map(|i| i.keys.stats())
    }

    /// Verify one bearer token (the text after `Bearer `).
    pub async fn verify(&self, token: &str) -> Result<Principal, AuthError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| AuthError::Malformed)?;
        let unverified = jsonwebtoken::dangerous::insecure_decode::<serde_json::Value>(token)
            .map_err(|_| AuthError::Malformed)?;
        let iss = unverified
            .claims
            .get("iss")
            .and_then(|v| v.as_str())
            .ok_or(AuthError::UnknownIssuer)?;
        let issuer = self
            .issuers
            .iter()
            .find(|i| i.name == iss)
            .ok_or(AuthError::UnknownIssuer)?;
        if !issuer.algorithms.contains(&header.alg) {
            return Err(AuthError::Algorithm);
        }
        let key = issuer.keys.find(header.kid.as_deref(), header.alg).await?;
        // jsonwebtoken wants every listed algorithm in the key's family: list only this
        // token's (already checked against the issuer's list above).
        let mut validation = issuer.validation.clone();
        validation.algorithms = vec![header.alg];
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token,
            &key,
            &validation,
        )
        .map_err(|e| classify(e.kind()))?;
        let org = data
            .claims
            .get(&issuer.org_claim)
            .and_then(|v| v.as_str())
            .and_then(|v| v.parse::<TenantId>().ok())
            .ok_or(AuthError::Organization)?;
        Ok(Principal {
            org,
            issuer: issuer.name.clone(),
        })
    }
}

fn classify(kind: &ErrorKind) -> AuthError {
    match kind {
        ErrorKind::ExpiredSignature => AuthError::Expired,
        ErrorKind::ImmatureSignature => AuthError::NotYetValid,
        ErrorKind::InvalidAudience => AuthError::Audience,
        ErrorKind::InvalidIssuer => AuthError::UnknownIssuer,
        ErrorKind::InvalidSignature => AuthError::Signature,
        ErrorKind::InvalidAlgorithm | ErrorKind::InvalidAlgorithmName => AuthError::Algorithm,
        ErrorKind::InvalidToken
        | ErrorKind::Base64(_)
        | ErrorKind::Json(_)
        | ErrorKind::Utf8(_) => AuthError::Malformed,
        ErrorKind::MissingRequiredClaim(_) => AuthError::Invalid,
        _ => AuthError::Invalid,
    }
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field(
                "issuers",
                &self.issuers.iter().map(|i| &i.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}
