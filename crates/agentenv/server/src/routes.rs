//! Control-plane handlers (`docs/specs/e2b-compat.md §4`). The route table is in [`crate::app::control_router`].

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::app::AppState;
use crate::backend::TemplateSpec;
use crate::error::{ApiError, E2bJson};
use crate::model::{
    BuildTemplateRequest, ConnectRequest, CreatedSandbox, ErrorBody, ForkRequest, ForkResult,
    ListedSandbox, NetworkUpdate, NewSandbox, PauseRequest, ResumeRequest, SandboxDetail,
    SandboxMetric, SandboxState, SnapshotRequest, SnapshotView, TemplateView, TimeoutRequest,
};
use crate::sandboxes::{Caller, ListFilter};
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
) -> ApiResult<(StatusCode, Json<CreatedSandbox>)> {
    if req.template_id.is_empty() {
        return Err(ApiError::bad_request("templateID is required"));
    }
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| {
            (1..=255).contains(&k.len())
                && k.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
        .map(str::to_string);
    let rec = state.sandboxes.create(&who, req, key).await?;
    Ok((StatusCode::CREATED, Json(views::created(&rec))))
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
    let (page, next) = views::paginate(all, q.next_token.as_deref(), q.limit)?;
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
        states: Some(vec![SandboxState::Running]),
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
    Ok(Json(views::detail(&rec, net.as_ref())))
}

/// The sandbox's current CPU, memory, disk and network use (an empty list while paused).
#[utoipa::path(get, path = "/sandboxes/{sandboxID}/metrics", tag = "sandboxes",
    params(("sandboxID" = String, Path)),
    responses((status = 200, body = Vec<SandboxMetric>), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn sandbox_metrics(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<SandboxMetric>>> {
    Ok(Json(s.sandboxes.metrics(&who, &id).await?))
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
    s.sandboxes.set_network(&who, &id, req).await?;
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
    E2bJson(_req): E2bJson<PauseRequest>,
) -> ApiResult<StatusCode> {
    s.sandboxes.pause(&who, &id).await?;
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
    Ok((status, Json(views::created(&rec))))
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
    Ok((StatusCode::CREATED, Json(views::created(&rec))))
}

/// Templates this server can create sandboxes from.
#[utoipa::path(get, path = "/templates", tag = "templates",
    responses((status = 200, body = Vec<TemplateView>), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list_templates(State(s): State<AppState>, Who(who): Who) -> Json<Vec<TemplateView>> {
    Json(
        s.sandboxes
            .templates(&who)
            .iter()
            .map(views::template)
            .collect(),
    )
}

/// Templates this server can create sandboxes from (the v2 path of newer SDKs; same answer).
#[utoipa::path(get, path = "/v2/templates", tag = "templates",
    responses((status = 200, body = Vec<TemplateView>), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list_templates_v2(s: State<AppState>, who: Who) -> Json<Vec<TemplateView>> {
    list_templates(s, who).await
}

/// Build a template through the runtime (minutes; returns when it is ready). With `Accept:
/// application/x-ndjson` the answer is 200 and a stream of progress lines (`step`, `detail`, and for an image
/// pull `bytesDone`/`bytesTotal`), ending with `{"template": ...}` or `{"error": {"code", "message"}}`.
#[utoipa::path(post, path = "/templates", tag = "templates", request_body = BuildTemplateRequest,
    responses((status = 201, body = TemplateView),
        (status = 200, description = "progress lines, then the template or an error (Accept: application/x-ndjson)", content_type = "application/x-ndjson", body = String),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn build_template(
    State(s): State<AppState>,
    Who(who): Who,
    headers: HeaderMap,
    E2bJson(req): E2bJson<BuildTemplateRequest>,
) -> ApiResult<Response> {
    let valid = !req.template_id.is_empty()
        && req.template_id.len() <= 63
        && req
            .template_id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(ApiError::bad_request(
            "templateID must be 1-63 of [a-z0-9-]",
        ));
    }
    let base = TemplateSpec::base();
    let spec = TemplateSpec {
        id: req.template_id,
        aliases: req.aliases,
        vcpus: req.cpu_count.unwrap_or(base.vcpus),
        memory_mib: req.memory_mb.map_or(base.memory_mib, u64::from),
        disk_mib: req.disk_size_mb.map_or(base.disk_mib, u64::from),
        from_image: req
            .from_image
            .map(|reference| agentenv_runtime::template::ImageSource {
                reference,
                username: req.registry_username,
                password: req.registry_password,
            }),
    };
    let streams = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    if !streams {
        let t = s
            .sandboxes
            .build_template(&who, spec, std::sync::Arc::new(|_| {}))
            .await
            .map_err(template_error)?;
        return Ok((StatusCode::CREATED, Json(views::template(&t))).into_response());
    }
    // The build runs to its end even if the client goes away; lines it cannot send are dropped.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let line = |v: serde_json::Value| format!("{v}\n");
    let progress_tx = tx.clone();
    let progress: crate::backend::ProgressFn = std::sync::Arc::new(move |p| {
        let mut v = serde_json::json!({
            "step": format!("{:?}", p.step).to_lowercase(),
            "detail": p.detail,
        });
        if let Some((done, total)) = p.bytes {
            v["bytesDone"] = done.into();
            v["bytesTotal"] = total.into();
        }
        let _ = progress_tx.send(line(v));
    });
    let sandboxes = s.sandboxes.clone();
    tokio::spawn(async move {
        let end = match sandboxes.build_template(&who, spec, progress).await {
            Ok(t) => serde_json::json!({"template": views::template(&t)}),
            Err(e) => {
                let e = template_error(e);
                serde_json::json!({"error": {"code": e.status.as_u16(), "message": e.message}})
            }
        };
        let _ = tx.send(line(end));
    });
    let lines = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|l| (Ok::<_, std::convert::Infallible>(l), rx))
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(lines),
    )
        .into_response())
}

/// A failed template build as an API error: the caller's mistakes are 400s.
fn template_error(e: agentenv_runtime::TemplateError) -> ApiError {
    match e {
        agentenv_runtime::TemplateError::InvalidId(_)
        | agentenv_runtime::TemplateError::InvalidSpec(_)
        | agentenv_runtime::TemplateError::Image(_) => ApiError::bad_request(e.to_string()),
        e => {
            tracing::error!(error = %e, "template build failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
        }
    }
}

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

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "server", responses((status = 200, body = Object)))]
pub async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::document_json(),
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
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/snapshots", tag = "snapshots", request_body = SnapshotRequest,
    params(("sandboxID" = String, Path)),
    responses((status = 201, body = SnapshotView), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn create_snapshot(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<SnapshotRequest>,
) -> ApiResult<(StatusCode, Json<SnapshotView>)> {
    let info = s
        .sandboxes
        .snapshot(&who, &id, req.name, req.memory.unwrap_or(true))
        .await?;
    Ok((StatusCode::CREATED, Json(views::snapshot(&info))))
}

/// List snapshots, oldest first. Query: `sandboxID`, `name` (`name[:tag]`), `limit`, `nextToken`.
/// More pages: header `x-next-token`.
#[utoipa::path(get, path = "/snapshots", tag = "snapshots",
    params(("sandboxID" = Option<String>, Query), ("name" = Option<String>, Query),
        ("limit" = Option<u32>, Query), ("nextToken" = Option<String>, Query)),
    responses((status = 200, body = Vec<SnapshotView>, headers(("x-next-token" = String, description = "cursor of the next page"))),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list_snapshots(
    State(s): State<AppState>,
    Who(who): Who,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = views::parse_snapshot_query(raw.as_deref())?;
    let all = s
        .sandboxes
        .snapshots(&who, q.sandbox_id.as_deref(), q.name.as_deref())?;
    let start = match &q.next_token {
        None => 0,
        Some(t) => all
            .iter()
            .position(|x| &x.id == t)
            .map(|i| i + 1)
            .ok_or_else(|| ApiError::bad_request(format!("invalid nextToken '{t}'")))?,
    };
    let page: Vec<SnapshotView> = all[start..]
        .iter()
        .take(q.limit)
        .map(views::snapshot)
        .collect();
    let mut resp = Json(&page).into_response();
    if start + page.len() < all.len()
        && let Some(last) = page.last()
        && let Ok(v) = HeaderValue::from_str(&last.snapshot_id)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// Delete a snapshot (E2B lists snapshots as templates). Sandboxes made from it keep running.
#[utoipa::path(delete, path = "/templates/{templateID}", tag = "snapshots",
    params(("templateID" = String, Path, description = "snapshot id or name")),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn delete_template(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    s.sandboxes.delete_snapshot(&who, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Fork a sandbox into `count` (1-20) new running sandboxes: one capture, restored copy-on-write.
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/fork", tag = "sandboxes", request_body = ForkRequest,
    params(("sandboxID" = String, Path)),
    responses((status = 201, body = Vec<ForkResult>), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn fork(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<ForkRequest>,
) -> ApiResult<(StatusCode, Json<Vec<ForkResult>>)> {
    let results = s.sandboxes.fork(&who, &id, req.count, req.timeout).await?;
    let out = results
        .into_iter()
        .map(|r| match r {
            Ok(rec) => ForkResult {
                sandbox: Some(views::created(&rec)),
                error: None,
            },
            Err(e) => {
                let e = ApiError::from(e);
                ForkResult {
                    sandbox: None,
                    error: Some(ErrorBody {
                        code: e.status.as_u16(),
                        message: e.message,
                    }),
                }
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(out)))
}

/// Body of `POST /cluster/adopt` and answer of `POST /cluster/sandboxes/{id}/handoff`: node to node
/// through the gateway, not part of the E2B API (so not in the OpenAPI document).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HandoffBody {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub handoff: crate::sandboxes::HandoffRecord,
}

/// The cluster routes are the server key's only (gateways hold it); any other key gets 403.
fn server_key_only(who: &Caller) -> ApiResult<()> {
    match who {
        Caller::Tenant(t) if &**t == crate::tenants::DEFAULT_TENANT => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "cluster routes need the server's own key",
        )),
    }
}

/// Snapshots a paused sandbox into the shared store for another node (`agentenv gateway` calls it after
/// a pause).
pub async fn cluster_handoff(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<HandoffBody>> {
    server_key_only(&who)?;
    let (snapshot_id, handoff) = s.sandboxes.handoff(&Caller::Server, &id).await?;
    Ok(Json(HandoffBody {
        snapshot_id,
        handoff,
    }))
}

/// Continues a sandbox handed off by a node that left the cluster.
pub async fn cluster_adopt(
    State(s): State<AppState>,
    Who(who): Who,
    body: Result<Json<HandoffBody>, axum::extract::rejection::JsonRejection>,
) -> ApiResult<(StatusCode, Json<CreatedSandbox>)> {
    server_key_only(&who)?;
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let rec = s.sandboxes.adopt(body.handoff, &body.snapshot_id).await?;
    Ok((StatusCode::CREATED, Json(views::created(&rec))))
}

/// Whether a snapshot's chunks are durable in the store yet (`GET /cluster/snapshots/{id}`), so a
/// gateway can answer a snapshot request only once every node can import it.
pub async fn cluster_snapshot(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    server_key_only(&who)?;
    let snap = s
        .sandboxes
        .backend()
        .snapshots()
        .into_iter()
        .find(|x| x.id == id)
        .ok_or_else(|| ApiError::not_found(format!("snapshot '{id}' not found")))?;
    Ok(Json(
        serde_json::json!({"snapshotID": snap.id, "stored": snap.stored.is_some()}),
    ))
}

/// Deletes a handoff snapshot (`DELETE /cluster/snapshots/{id}`) once its sandbox runs again.
pub async fn cluster_drop_handoff(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    server_key_only(&who)?;
    s.sandboxes.drop_handoff(&id)?;
    Ok(StatusCode::NO_CONTENT)
}
