//! The axum application: route table, API-key check and plane dispatch.

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};

use crate::build_routes;
use crate::conn::TENANT_HEADER;
use crate::dataplane::{self, Plane};
use crate::error::ApiError;
use crate::routes;
use crate::volume_routes;

pub use crate::state::{AppState, DEFAULT_MAX_UPLOAD_BYTES, MAX_JSON_BYTES, ServerConfig};

/// Control-plane route table (`docs/specs/e2b-compat.md §0` lists which SDK uses which route).
fn control_router() -> Router<AppState> {
    Router::new()
        .route(
            "/v2/sandboxes",
            post(routes::create_v2).get(routes::list_v2),
        )
        .route("/sandboxes", post(routes::create_v1).get(routes::list_v1))
        .route(
            "/sandboxes/{id}",
            get(routes::get_sandbox).delete(routes::kill_sandbox),
        )
        .route("/sandboxes/{id}/timeout", post(routes::set_timeout))
        .route("/sandboxes/{id}/pause", post(routes::pause))
        .route("/sandboxes/{id}/network", put(routes::set_network))
        .route("/sandboxes/{id}/metrics", get(routes::sandbox_metrics))
        .route("/v2/sandboxes/{id}/connect", post(routes::connect_v2))
        .route("/sandboxes/{id}/connect", post(routes::connect_v1))
        .route("/sandboxes/{id}/resume", post(routes::resume))
        .route("/sandboxes/{id}/snapshots", post(routes::create_snapshot))
        .route("/sandboxes/{id}/fork", post(routes::fork))
        .route("/snapshots", get(routes::list_snapshots))
        .route(
            "/templates/{id}",
            axum::routing::delete(routes::delete_template),
        )
        .route(
            "/templates",
            get(routes::list_templates).post(routes::build_template),
        )
        .route("/v2/templates", get(routes::list_templates_v2))
        .route(
            "/templates/tags",
            post(routes::assign_tags).delete(routes::delete_tags),
        )
        .route("/v3/templates", post(build_routes::request_build))
        .route(
            "/templates/{id}/files/{hash}",
            get(build_routes::file_link)
                .put(build_routes::upload_file)
                .layer(axum::extract::DefaultBodyLimit::max(
                    crate::sandboxes::MAX_BUILD_FILE_BYTES,
                )),
        )
        .route(
            "/v2/templates/{id}/builds/{build}",
            post(build_routes::start_build),
        )
        .route(
            "/templates/{id}/builds/{build}/status",
            get(build_routes::build_status),
        )
        .route("/templates/aliases/{alias}", get(build_routes::alias))
        .route(
            "/cluster/sandboxes/{id}/handoff",
            post(routes::cluster_handoff),
        )
        .route("/cluster/adopt", post(routes::cluster_adopt))
        .route(
            "/cluster/snapshots/{id}",
            get(routes::cluster_snapshot).delete(routes::cluster_drop_handoff),
        )
        .route(
            "/volumes",
            get(volume_routes::list).post(volume_routes::create),
        )
        .route(
            "/volumes/{id}",
            get(volume_routes::get).delete(volume_routes::delete),
        )
        .route(
            "/volumecontent/{id}/path",
            get(volume_routes::stat)
                .patch(volume_routes::set_meta)
                .delete(volume_routes::remove),
        )
        .route(
            "/volumecontent/{id}/dir",
            get(volume_routes::list_dir).post(volume_routes::make_dir),
        )
        .route(
            "/volumecontent/{id}/file",
            get(volume_routes::read_file)
                .put(volume_routes::write_file)
                .layer(axum::extract::DefaultBodyLimit::max(
                    volume_routes::MAX_VOLUME_FILE_BYTES,
                )),
        )
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON_BYTES))
        .layer(middleware::from_fn(crate::error::json_errors))
        .layer(middleware::from_fn(refuse_declared_oversize))
}

/// Answers 413 from `Content-Length` alone, before any of an oversized body is read
/// (`DefaultBodyLimit` still bounds bodies without a declared length).
async fn refuse_declared_oversize(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    // COPY archives of template builds and volume files are larger than JSON bodies.
    let put = req.method() == axum::http::Method::PUT;
    let path = req.uri().path();
    let limit = if put && path.contains("/files/") {
        crate::sandboxes::MAX_BUILD_FILE_BYTES
    } else if put && volume_routes::is_content_path(path) {
        volume_routes::MAX_VOLUME_FILE_BYTES
    } else {
        MAX_JSON_BYTES
    };
    if declared.is_some_and(|n| n > limit) {
        return crate::error::ApiError::new(
            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body exceeds the limit of {limit} bytes"),
        )
        .into_response();
    }
    next.run(req).await
}

/// The whole server: data plane first (by `E2b-Sandbox-Id` + path, or access token), then
/// the API-key check, then the control plane.
pub fn app(state: AppState) -> Router {
    control_router()
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), dispatch))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

async fn dispatch(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let method = req.method().to_string();
    let plane = dataplane::plane_of(&mut req, state.sandbox_domain.as_deref());
    let data = plane != Plane::Control;
    let resp = if data {
        dataplane::serve(&state, plane, req)
            .await
            .unwrap_or_else(IntoResponse::into_response)
    } else {
        next.run(req).await
    };
    state
        .metrics
        .count_request(data, &method, resp.status().as_u16());
    resp
}

/// Resolves the key (or a gateway's [`TENANT_HEADER`]) to its [`crate::tenants::Tenant`] (put in the
/// request's extensions) and spends one of its requests (a gateway spent it already).
async fn require_api_key(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    // The volume content API authenticates with a volume's token (`volume_routes`).
    if req.uri().path() == "/health" || volume_routes::is_content_path(req.uri().path()) {
        return next.run(req).await;
    }
    if let Some(asserted) = req.headers().get(TENANT_HEADER) {
        let gateway = req
            .extensions()
            .get::<axum::extract::ConnectInfo<crate::conn::Conn>>()
            .is_some_and(|c| c.0.gateway);
        if !gateway {
            return ApiError::unauthorized(
                "X-Agentenv-Tenant is taken only from a gateway's certificate",
            )
            .into_response();
        }
        let tenant = asserted.to_str().ok().and_then(|n| state.keys.named(n));
        let Some(tenant) = tenant else {
            return ApiError::unauthorized("the gateway asserted an unknown tenant")
                .into_response();
        };
        req.extensions_mut().insert(tenant);
        return next.run(req).await;
    }
    let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    match key.map(|k| (k, state.keys.authenticate(k))) {
        Some((_, Some(tenant))) => {
            if let Some(Err(wait)) = tenant.limiter.as_ref().map(|b| b.take()) {
                return ApiError::rate_limited(wait).into_response();
            }
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        Some(_) => ApiError::unauthorized("Invalid API key").into_response(),
        None => match build_routes::presigned_upload(&state.keys, req.method(), req.uri()) {
            Some(tenant) => {
                req.extensions_mut().insert(tenant);
                next.run(req).await
            }
            None => ApiError::unauthorized("Missing X-API-KEY header").into_response(),
        },
    }
}
