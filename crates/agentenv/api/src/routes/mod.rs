//! Control-plane handlers (`docs/specs/e2b-compat.md §4`). The route table is in [`crate::app::control_router`].

use axum::Json;
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::backend::TemplateSpec;
use crate::error::{ApiError, E2bJson};
use crate::model::{
    BuildTemplateRequest, ConnectRequest, CreatedSandbox, ErrorBody, ForkRequest, ForkResult,
    ListedSandbox, NetworkUpdate, NewSandbox, PauseRequest, ResumeRequest, SandboxDetail,
    SandboxMetric, SnapshotRequest, SnapshotView, TemplateView, TimeoutRequest,
};
use crate::sandboxes::{Caller, ListFilter};
use crate::state::AppState;
use crate::tenants::Tenant;
use crate::views;

type ApiResult<T> = Result<T, ApiError>;

/// The tenant a control-plane request acts for, as the API-key check resolved it.
pub struct Who(pub Caller);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Who {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Tenant>()
            .map(|t| Who(Caller::Tenant(t.name.clone())))
            .ok_or_else(|| ApiError::unauthorized("Missing X-API-KEY header"))
    }
}

async fn create(
    state: AppState,
    who: Caller,
    headers: HeaderMap,
    req: NewSandbox,
) -> ApiResult<Response> {
    let req = views::create_request(req)?;
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| {
            (1..=255).contains(&k.len())
                && k.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
        .map(str::to_string);
    // Built-in templates (`code-interpreter-v1`, `httpbin`) are built on their first create. Retries within the SDK's deadline cannot
    // outlast the build: `Should-Retry: false` lets the client show why at once.
    if let Err(e) = state.sandboxes.ensure_builtin(&who, &req.template).await {
        let mut r = ApiError::from(e).into_response();
        r.headers_mut()
            .insert("should-retry", HeaderValue::from_static("false"));
        return Ok(r);
    }
    let rec = state.sandboxes.create(&who, req, key).await?;
    let domain = state.sandbox_domain.as_deref();
    Ok((StatusCode::CREATED, Json(views::created(&rec, domain))).into_response())
}

/// Create a sandbox (SDK >= 2.51). Returns once envd in the sandbox answers.
#[utoipa::path(post, path = "/v2/sandboxes", request_body = NewSandbox, tag = "sandboxes",
    responses((status = 201, body = CreatedSandbox), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, description = "unknown template", body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn create_v2(
    State(s): State<AppState>,
    Who(who): Who,
    h: HeaderMap,
    E2bJson(req): E2bJson<NewSandbox>,
) -> ApiResult<impl IntoResponse> {
    create(s, who, h, req).await
}

/// Create a sandbox (SDK < 2.51). Same as `POST /v2/sandboxes`.
#[utoipa::path(post, path = "/sandboxes", request_body = NewSandbox, tag = "sandboxes",
    responses((status = 201, body = CreatedSandbox), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn create_v1(
    State(s): State<AppState>,
    Who(who): Who,
    h: HeaderMap,
    E2bJson(req): E2bJson<NewSandbox>,
) -> ApiResult<impl IntoResponse> {
    create(s, who, h, req).await
}

/// List sandboxes. Query: `state` (comma list), `metadata` (URL-encoded `k=v&..`), `limit`,
/// `nextToken`, `order`, `startedAfter`, `template`. More pages: header `x-next-token`.
#[utoipa::path(get, path = "/v2/sandboxes", tag = "sandboxes",
    params(("state" = Option<String>, Query, description = "comma-joined running,paused"),
        ("metadata" = Option<String>, Query, description = "URL-encoded k=v&k2=v2; all must match"),
        ("limit" = Option<u32>, Query), ("nextToken" = Option<String>, Query),
        ("order" = Option<String>, Query, description = "asc or desc by start time"),
        ("startedAfter" = Option<String>, Query), ("template" = Option<String>, Query)),
    responses((status = 200, body = Vec<ListedSandbox>, headers(("x-next-token" = String, description = "cursor of the next page"))),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list_v2(
    State(s): State<AppState>,
    Who(who): Who,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = views::parse_list_query(raw.as_deref())?;
    let all = s.sandboxes.list(&who, &q.filter);
    let (page, next) = views::paginate(all, q.next_token.as_deref(), q.limit, q.filter.descending)?;
    let items: Vec<ListedSandbox> = page.iter().map(views::listed).collect();
    let mut resp = Json(items).into_response();
    if let Some(next) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        resp.headers_mut().insert("x-next-token", next);
    }
    Ok(resp)
}

/// Legacy list: running sandboxes only, `metadata` filter, no paging.
#[utoipa::path(get, path = "/sandboxes", tag = "sandboxes",
    params(("metadata" = Option<String>, Query, description = "URL-encoded k=v&k2=v2")),
    responses((status = 200, body = Vec<ListedSandbox>), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list_v1(
    State(s): State<AppState>,
    Who(who): Who,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<ListedSandbox>>> {
    let q = views::parse_list_query(raw.as_deref())?;
    let filter = ListFilter {
        states: Some(vec![crate::sandboxes::SandboxState::Running]),
        metadata: q.filter.metadata,
        ..Default::default()
    };
    Ok(Json(
        s.sandboxes
            .list(&who, &filter)
            .iter()
            .map(views::listed)
            .collect(),
    ))
}

/// Sandbox detail.
#[utoipa::path(get, path = "/sandboxes/{sandboxID}", tag = "sandboxes",
    params(("sandboxID" = String, Path)),
    responses((status = 200, body = SandboxDetail), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn get_sandbox(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxDetail>> {
    let rec = s.sandboxes.get_as(&who, &id)?;
    let net = s.sandboxes.network_view(&id).await;
    let domain = s.sandbox_domain.as_deref();
    Ok(Json(views::detail(&rec, net.as_ref(), domain)))
}

/// The sandbox's current CPU, memory, disk and network use (an empty list while paused).
#[utoipa::path(get, path = "/sandboxes/{sandboxID}/metrics", tag = "sandboxes",
    params(("sandboxID" = String, Path),
        ("start" = Option<i64>, Query, description = "Unix seconds; samples from here on"),
        ("end" = Option<i64>, Query, description = "Unix seconds; samples up to here")),
    responses((status = 200, body = Vec<SandboxMetric>), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn sandbox_metrics(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    Query(range): Query<MetricsRange>,
) -> ApiResult<Json<Vec<SandboxMetric>>> {
    let sample = s.sandboxes.sample(&who, &id).await?;
    Ok(Json(
        sample
            .iter()
            .filter(|x| views::metric_in_range(x.guest.ts as i64, range.start, range.end))
            .map(views::metric)
            .collect(),
    ))
}

/// `start` and `end` of `GET /sandboxes/{id}/metrics`: Unix seconds.
#[derive(Debug, Default, serde::Deserialize)]
pub struct MetricsRange {
    pub start: Option<i64>,
    pub end: Option<i64>,
}

/// Replace the sandbox's egress rules (`allowOut`, `denyOut`, `allowInternetAccess`) at once; new
/// connections follow them without a restart.
#[utoipa::path(put, path = "/sandboxes/{sandboxID}/network", tag = "sandboxes", request_body = NetworkUpdate,
    params(("sandboxID" = String, Path)),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn set_network(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<StatusCode> {
    let req: NetworkUpdate = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    let policy = crate::egress::update_policy(&req)?;
    s.sandboxes.set_network(&who, &id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Kill a running or paused sandbox.
#[utoipa::path(delete, path = "/sandboxes/{sandboxID}", tag = "sandboxes",
    params(("sandboxID" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn kill_sandbox(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    s.sandboxes.kill(&who, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Set `endAt = now + timeout` (may shorten). 409 for a paused sandbox.
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/timeout", tag = "sandboxes", request_body = TimeoutRequest,
    params(("sandboxID" = String, Path)),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn set_timeout(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<StatusCode> {
    let req: TimeoutRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    s.sandboxes.set_timeout(&who, &id, req.timeout).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pause (memory, processes and files kept). Returns when the snapshot is complete.
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/pause", tag = "sandboxes", request_body = Option<PauseRequest>,
    params(("sandboxID" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, description = "already paused", body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn pause(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<PauseRequest>,
) -> ApiResult<StatusCode> {
    let memory = req.memory.unwrap_or(true);
    s.sandboxes.pause_keeping(&who, &id, memory).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn connect(
    s: AppState,
    who: Caller,
    id: String,
    req: ConnectRequest,
) -> ApiResult<(StatusCode, Json<CreatedSandbox>)> {
    let (rec, resumed) = s.sandboxes.connect(&who, &id, req.timeout).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(views::created(&rec, s.sandbox_domain.as_deref())),
    ))
}

/// Connect (SDK >= 2.51): running → 200 and `endAt` only extends; paused → resumed, 201.
#[utoipa::path(post, path = "/v2/sandboxes/{sandboxID}/connect", tag = "sandboxes", request_body = Option<ConnectRequest>,
    params(("sandboxID" = String, Path)),
    responses((status = 200, body = CreatedSandbox), (status = 201, body = CreatedSandbox), (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn connect_v2(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<ConnectRequest>,
) -> ApiResult<impl IntoResponse> {
    connect(s, who, id, req).await
}

/// Connect (SDK 2.7 – 2.50). Same as the `/v2` route.
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/connect", tag = "sandboxes", request_body = Option<ConnectRequest>,
    params(("sandboxID" = String, Path)),
    responses((status = 200, body = CreatedSandbox), (status = 201, body = CreatedSandbox), (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn connect_v1(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<ConnectRequest>,
) -> ApiResult<impl IntoResponse> {
    connect(s, who, id, req).await
}

/// Legacy resume (SDK <= 2.6): paused → 201; running → 409.
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/resume", tag = "sandboxes", request_body = Option<ResumeRequest>,
    params(("sandboxID" = String, Path)),
    responses((status = 201, body = CreatedSandbox), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn resume(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<ResumeRequest>,
) -> ApiResult<(StatusCode, Json<CreatedSandbox>)> {
    let rec = s
        .sandboxes
        .resume_legacy(&who, &id, req.timeout, req.auto_pause)
        .await?;
    let domain = s.sandbox_domain.as_deref();
    Ok((StatusCode::CREATED, Json(views::created(&rec, domain))))
}

/// Templates this server can create sandboxes from.
/// The server's own health check (no key needed; sandbox headers make `/health` data plane).
#[utoipa::path(get, path = "/health", tag = "server", responses((status = 204)))]
pub async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// Prometheus metrics of the whole server, for the server's own key only (they count every tenant's
/// sandboxes). With sandbox headers `/metrics` is the sandbox's envd.
#[utoipa::path(get, path = "/metrics", tag = "server",
    responses((status = 200, content_type = "application/openmetrics-text", body = String),
        (status = 403, description = "a named key", body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn metrics(State(s): State<AppState>, Who(who): Who) -> Response {
    if !matches!(&who, Caller::Tenant(t) if **t == *crate::tenants::DEFAULT_TENANT) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "server metrics need the server's own key",
        )
        .into_response();
    }
    let (running, paused) = s.sandboxes.count_by_state();
    let text = s.metrics.render(running, paused);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Answer for unknown control-plane routes.
pub async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

/// A known route with the wrong method (axum adds `Allow`).
pub async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on this route"),
    )
}

/// Snapshot a sandbox (memory + disk, or the disk only with `memory: false`). The sandbox keeps running.
mod cluster_snapshots;
mod templates;
pub use cluster_snapshots::*;
pub use templates::*;
