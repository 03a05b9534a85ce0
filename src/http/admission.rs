//! Admission at the HTTP edge: admitting uploads and downloads before their bytes move,
//! charging download egress per chunk, and the admin endpoints.
//!
//! - Uploads: the receiving node charges the request quota; the upload service admits the
//!   transfer where its bytes are held (`admission::transfer` says what each transfer
//!   asks for). All of it happens before the body is read.
//! - Downloads (`GET`): request quota and admission before the manifest is read; each
//!   outgoing chunk is charged to the egress quota just before it is sent
//!   (`admission::egress`). A refused charge or a lost lease ends the stream with an
//!   error, so the client sees an aborted transfer, never a silently short `200`.
//! - `PUT`/`DELETE /v1/admin/tenants/{tenant}/admission` set or clear a live tenant override
//!   and answer `{"policy_version": n}`; `GET /v1/admin/admission?tenant=&backend=` answers
//!   the occupancy snapshot. All need `Authorization: Bearer <admin.token>`.
//!
//! The tenant is the `X-Graviton-Tenant-Id` header (uploads: with the session header).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};

use super::headers::{TENANT_HEADER, single_value};
use super::{ApiError, AppState};
use crate::admission::{AdmissionSnapshot, TenantOverride};
use crate::ids::TenantId;

/// A boxed error for streamed bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The optional `X-Graviton-Tenant-Id` header as a tenant.
pub fn tenant_header(headers: &HeaderMap) -> Result<Option<TenantId>, ApiError> {
    let Some(text) = single_value(headers, TENANT_HEADER, "invalid_tenant_id")? else {
        return Ok(None);
    };
    text.parse().map(Some).map_err(|e| {
        ApiError::bad_request("invalid_tenant_id", format!("X-Graviton-Tenant-Id {e}"))
    })
}

/// Charge one request to the tenant's quota (no-op without a tenant or without Redis).
/// Only the node that receives the client's request charges it.
pub async fn charge_request(app: &AppState, tenant: Option<&TenantId>) -> Result<(), ApiError> {
    if let Some(tenant) = tenant {
        app.admission.charge_request(tenant).await?;
    }
    Ok(())
}

pub(crate) fn require_admin(app: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &app.config.admin.token else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "admin_disabled",
            "admin endpoints are disabled",
        ));
    };
    let presented = super::headers::bearer_token(headers).unwrap_or("");
    if token.matches(presented.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid admin bearer token is required",
        ))
    }
}

fn tenant_path(text: &str) -> Result<TenantId, ApiError> {
    text.parse()
        .map_err(|e| ApiError::bad_request("invalid_tenant_id", format!("tenant {e}")))
}

#[derive(Debug, Serialize, Deserialize)]
pub struct PolicyVersion {
    pub policy_version: u64,
}

/// `PUT /v1/admin/tenants/{tenant}/admission` with `{"bytes": "64MiB", "transfers": 4}`.
pub async fn put_override(
    State(app): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    Json(value): Json<TenantOverride>,
) -> Result<Json<PolicyVersion>, ApiError> {
    require_admin(&app, &headers)?;
    let tenant = tenant_path(&tenant)?;
    let policy_version = app.admission.set_override(&tenant, value).await?;
    Ok(Json(PolicyVersion { policy_version }))
}

/// `DELETE /v1/admin/tenants/{tenant}/admission`
pub async fn delete_override(
    State(app): State<Arc<AppState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<PolicyVersion>, ApiError> {
    require_admin(&app, &headers)?;
    let tenant = tenant_path(&tenant)?;
    let policy_version = app.admission.clear_override(&tenant).await?;
    Ok(Json(PolicyVersion { policy_version }))
}

#[derive(Debug, Deserialize)]
pub struct SnapshotQuery {
    pub tenant: Option<String>,
    pub backend: Option<String>,
}

/// `GET /v1/admin/admission?tenant=<uuid>&backend=<label>`
pub async fn snapshot(
    State(app): State<Arc<AppState>>,
    Query(query): Query<SnapshotQuery>,
    headers: HeaderMap,
) -> Result<Json<AdmissionSnapshot>, ApiError> {
    require_admin(&app, &headers)?;
    let tenant = query.tenant.as_deref().map(tenant_path).transpose()?;
    let backend = query
        .backend
        .as_deref()
        .unwrap_or(crate::admission::BACKEND);
    Ok(Json(
        app.admission
            .snapshot(tenant.as_ref(), Some(backend))
            .await?,
    ))
}
