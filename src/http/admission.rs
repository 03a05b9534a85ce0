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
//!   the occupancy snapshot; `GET`/`PUT /v1/admin/admission/limits` read and change the
//!   cluster-wide limits; `PUT`/`DELETE /v1/admin/backends/{backend}/admission` set or
//!   clear a backend's transfer override. All need `Authorization: Bearer <admin.token>`.
//!
//! The tenant is the `X-Graviton-Tenant-Id` header (uploads: with the session header).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use serde::{Deserialize, Serialize};

use crate::admission::{AdmissionSnapshot, LimitsUpdate, TenantOverride};
use crate::edge::AppState;
use crate::edge::{ApiError, ErrorCode};
use crate::ids::TenantId;
use crate::storage::redis::reply::StoredLimits;

/// A boxed error for streamed bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
            ErrorCode::AdminDisabled,
            "admin endpoints are disabled: set admin.token (or GRAVITON_ADMIN__TOKEN) on this node",
        ));
    };
    let presented = crate::edge::headers::bearer_token(headers).unwrap_or("");
    if token.matches(presented.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::Unauthorized,
            "a valid admin bearer token is required",
        ))
    }
}

fn tenant_path(text: &str) -> Result<TenantId, ApiError> {
    text.parse()
        .map_err(|e| ApiError::new(ErrorCode::InvalidTenantId, format!("tenant {e}")))
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

/// `GET /v1/admin/admission/limits`: the cluster-wide limits every node enforces.
pub async fn get_limits(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<StoredLimits>, ApiError> {
    require_admin(&app, &headers)?;
    Ok(Json(app.admission.cluster_limits().await?))
}

/// `PUT /v1/admin/admission/limits` with any of `service_bytes`, `service_transfers`,
/// `tenant_bytes`, `tenant_transfers`, `backend_transfers`.
pub async fn put_limits(
    State(app): State<Arc<AppState>>,
    headers: HeaderMap,
    Json(update): Json<LimitsUpdate>,
) -> Result<Json<StoredLimits>, ApiError> {
    require_admin(&app, &headers)?;
    Ok(Json(app.admission.set_cluster_limits(update).await?))
}

fn backend_path(text: &str) -> Result<String, ApiError> {
    let ok = !text.is_empty()
        && text.len() <= 64
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(text.to_string())
    } else {
        Err(ApiError::new(
            ErrorCode::InvalidBackend,
            "backend must be 1 to 64 ASCII letters, digits, '-', '_' or '.'",
        ))
    }
}

/// Body of `PUT /v1/admin/backends/{backend}/admission`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendOverride {
    pub transfers: u32,
}

/// `PUT /v1/admin/backends/{backend}/admission` with `{"transfers": n}`.
pub async fn put_backend_override(
    State(app): State<Arc<AppState>>,
    Path(backend): Path<String>,
    headers: HeaderMap,
    Json(value): Json<BackendOverride>,
) -> Result<Json<PolicyVersion>, ApiError> {
    require_admin(&app, &headers)?;
    let backend = backend_path(&backend)?;
    let policy_version = app
        .admission
        .set_backend_override(&backend, Some(value.transfers))
        .await?;
    Ok(Json(PolicyVersion { policy_version }))
}

/// `DELETE /v1/admin/backends/{backend}/admission`
pub async fn delete_backend_override(
    State(app): State<Arc<AppState>>,
    Path(backend): Path<String>,
    headers: HeaderMap,
) -> Result<Json<PolicyVersion>, ApiError> {
    require_admin(&app, &headers)?;
    let backend = backend_path(&backend)?;
    let policy_version = app.admission.set_backend_override(&backend, None).await?;
    Ok(Json(PolicyVersion { policy_version }))
}
