//! The OpenAPI document of the control plane (committed as `openapi.json`; a test keeps it fresh).

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::OpenApi;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};

use crate::{build_routes, routes, volume_routes};

struct ApiKeyScheme;

impl utoipa::Modify for ApiKeyScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "ApiKeyAuth",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("X-API-KEY"))),
        );
        components.add_security_scheme(
            "VolumeToken",
            SecurityScheme::Http(utoipa::openapi::security::Http::new(
                utoipa::openapi::security::HttpAuthScheme::Bearer,
            )),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "agentenv", description = "E2B-compatible sandbox API. Data-plane (envd) requests share this port: \
        they carry `E2b-Sandbox-Id` and an envd path, and are forwarded to the sandbox (see docs/specs/e2b-compat.md §1)."),
    paths(
        routes::create_v2, routes::create_v1, routes::list_v2, routes::list_v1, routes::get_sandbox,
        routes::kill_sandbox, routes::set_timeout, routes::pause, routes::connect_v2, routes::connect_v1,
        routes::resume, routes::list_templates, routes::build_template, routes::health, routes::metrics,
        openapi_json, routes::create_snapshot, routes::list_snapshots, routes::delete_template,
        routes::fork, routes::list_templates_v2, routes::set_network, routes::sandbox_metrics,
        build_routes::request_build, build_routes::file_link, build_routes::upload_file,
        build_routes::start_build, build_routes::build_status, build_routes::alias,
        routes::assign_tags, routes::delete_tags, volume_routes::create, volume_routes::list,
        volume_routes::get, volume_routes::delete, volume_routes::stat, volume_routes::set_meta,
        volume_routes::remove, volume_routes::list_dir, volume_routes::make_dir,
        volume_routes::read_file, volume_routes::write_file,
    ),
    modifiers(&ApiKeyScheme)
)]
struct ApiDoc;

/// The document as pretty JSON.
pub fn document_json() -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    doc.to_pretty_json().expect("OpenAPI document serializes")
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "server", responses((status = 200, body = Object)))]
pub async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document_json(),
    )
        .into_response()
}
