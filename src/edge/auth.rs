//! Who a request acts for, over HTTP and gRPC alike: the JWT binding of the tenant (see
//! `crate::auth`), and the tenant header ([`tenant_header`]).
//!
//! [`caller_tenant`] is called by uploads, downloads and every gRPC call before anything
//! else that charges a quota or touches the body. With `auth.enabled = false` the tenant is the
//! `X-Graviton-Tenant-Id` header as sent (the embedded default). With auth on:
//! - no `Authorization: Bearer` -> 401 `unauthenticated` with `WWW-Authenticate: Bearer`;
//! - a token that fails verification -> 401 `invalid_token` (the challenge says
//!   `error="invalid_token"`), or 503 `auth_unavailable` while an issuer has no keys;
//! - a tenant header that differs from the token's organization -> 403 `tenant_mismatch`;
//! - otherwise the tenant is the token's organization, whether the header was sent or
//!   not: quotas and admission never see a tenant the caller did not prove.

use axum::http::HeaderMap;

use super::headers::{TENANT_HEADER, single_value};
use super::{ApiError, AppState, ErrorCode};
use crate::auth::AuthError;
use crate::ids::TenantId;

/// The optional `X-Graviton-Tenant-Id` header as a tenant.
pub fn tenant_header(headers: &HeaderMap) -> Result<Option<TenantId>, ApiError> {
    let Some(text) = single_value(headers, TENANT_HEADER, ErrorCode::InvalidTenantId)? else {
        return Ok(None);
    };
    text.parse().map(Some).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidTenantId,
            format!("X-Graviton-Tenant-Id {e}"),
        )
    })
}

const REALM: &str = "Bearer realm=\"graviton\"";

/// The tenant of this request (see the module doc).
pub async fn caller_tenant(
    app: &AppState,
    headers: &HeaderMap,
    header_tenant: Option<TenantId>,
) -> Result<Option<TenantId>, ApiError> {
    let Some(auth) = &app.auth else {
        return Ok(header_tenant);
    };
    let token = bearer(headers)?;
    let principal = auth.verify(token).await.map_err(|err| {
        app.edge
            .auth_failures
            .get_or_create(&crate::metrics::ReasonLabels {
                reason: reason(&err),
            })
            .inc();
        refusal(err)
    })?;
    if let Some(tenant) = header_tenant
        && tenant != principal.org
    {
        app.edge
            .auth_failures
            .get_or_create(&crate::metrics::ReasonLabels {
                reason: "tenant_mismatch",
            })
            .inc();
        return Err(ApiError::new(
            ErrorCode::TenantMismatch,
            "X-Graviton-Tenant-Id differs from the organization of the bearer token",
        ));
    }
    Ok(Some(principal.org))
}

fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    super::headers::bearer_token(headers).map_err(|err| {
        refusal(match err {
            super::headers::BearerError::Missing => AuthError::Missing,
            super::headers::BearerError::Malformed => AuthError::Malformed,
        })
    })
}

/// Every `reason` label of `graviton_auth_failures_total` ([`reason`] and the tenant check).
pub const FAILURE_REASONS: [&str; 13] = [
    "missing",
    "malformed",
    "issuer",
    "algorithm",
    "unknown_key",
    "expired",
    "not_yet_valid",
    "audience",
    "signature",
    "organization",
    "invalid",
    "keys_unavailable",
    "tenant_mismatch",
];

fn reason(err: &AuthError) -> &'static str {
    match err {
        AuthError::Missing => "missing",
        AuthError::Malformed => "malformed",
        AuthError::UnknownIssuer => "issuer",
        AuthError::Algorithm => "algorithm",
        AuthError::UnknownKey => "unknown_key",
        AuthError::Expired => "expired",
        AuthError::NotYetValid => "not_yet_valid",
        AuthError::Audience => "audience",
        AuthError::Signature => "signature",
        AuthError::Organization => "organization",
        AuthError::Invalid => "invalid",
        AuthError::KeysUnavailable => "keys_unavailable",
    }
}

/// The response for a refused token. Messages say what was wrong, never the token.
pub fn refusal(err: AuthError) -> ApiError {
    match err {
        AuthError::Missing => {
            ApiError::new(ErrorCode::Unauthenticated, err.to_string()).with_challenge(REALM)
        }
        AuthError::KeysUnavailable => ApiError::new(ErrorCode::AuthUnavailable, err.to_string()),
        other => ApiError::new(ErrorCode::InvalidToken, other.to_string()).with_challenge(format!(
            "{REALM}, error=\"invalid_token\", error_description=\"{other}\""
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_missing_bearer_is_unauthenticated_and_a_malformed_one_an_invalid_token() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            bearer(&headers).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
        headers.insert(
            axum::http::header::AUTHORIZATION,
            HeaderValue::from_static("Basic abc"),
        );
        assert_eq!(bearer(&headers).unwrap_err().code, ErrorCode::InvalidToken);
    }

    #[test]
    fn refusals_carry_a_challenge() {
        let err = refusal(AuthError::Expired);
        assert_eq!(err.status.as_u16(), 401);
        assert!(err.challenge.unwrap().contains("error=\"invalid_token\""));
        assert_eq!(refusal(AuthError::Missing).challenge.unwrap(), REALM);
    }
}
