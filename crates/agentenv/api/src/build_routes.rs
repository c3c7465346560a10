//! The HTTP edge of template builds, as the SDK's `Template.build` calls it: request a build, upload
//! COPY archives by hash, start the build, poll its status and log, look a name up.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};

use crate::error::{ApiError, E2bJson};
use crate::model::{
    ErrorBody, TemplateAliasResponse, TemplateBuildFileUpload, TemplateBuildInfo,
    TemplateBuildRequestV3, TemplateBuildStartV2, TemplateRequestResponseV3,
};
use crate::routes::Who;
use crate::state::AppState;
use crate::views;

type ApiResult<T> = Result<T, ApiError>;

/// Request a build of template `name` (`name[:tag]`); its steps come with the start call.
#[utoipa::path(post, path = "/v3/templates", tag = "templates", request_body = TemplateBuildRequestV3,
    responses((status = 202, body = TemplateRequestResponseV3), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn request_build(
    State(s): State<AppState>,
    Who(who): Who,
    E2bJson(req): E2bJson<TemplateBuildRequestV3>,
) -> ApiResult<(StatusCode, Json<TemplateRequestResponseV3>)> {
    let name = req
        .name
        .or(req.alias)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    let t = s.sandboxes.request_build(
        &who,
        &name,
        &req.tags.unwrap_or_default(),
        crate::sandboxes::BuildSize {
            vcpus: req.cpu_count,
            memory_mib: req.memory_mb.map(u64::from),
        },
    )?;
    let base = name
        .split_once(':')
        .map_or(name.as_str(), |(n, _)| n)
        .to_string();
    Ok((
        StatusCode::ACCEPTED,
        Json(TemplateRequestResponseV3 {
            template_id: t.template_id,
            build_id: t.build_id,
            public: false,
            names: t.names,
            tags: t.tags,
            aliases: vec![base],
        }),
    ))
}

/// Whether a COPY archive is uploaded, and where to `PUT` it: this route, presigned for the caller
/// (no key travels in the answer; the URL holds for [`UPLOAD_URL_VALID_S`]).
#[utoipa::path(get, path = "/templates/{templateID}/files/{hash}", tag = "templates",
    params(("templateID" = String, Path), ("hash" = String, Path)),
    responses((status = 201, body = TemplateBuildFileUpload), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn file_link(
    State(s): State<AppState>,
    Who(who): Who,
    Path((tid, hash)): Path<(String, String)>,
    conn: Option<axum::Extension<axum::extract::ConnectInfo<crate::conn::Conn>>>,
    h: HeaderMap,
) -> ApiResult<(StatusCode, Json<TemplateBuildFileUpload>)> {
    let present = s.sandboxes.build_file_present(&who, &tid, &hash)?;
    let host = h
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or_else(|| ApiError::bad_request("a Host header is required"))?;
    // Served over TLS, or behind a TLS proxy, the URL stays https.
    let forwarded = h
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|p| p.eq_ignore_ascii_case("https"));
    let scheme = if forwarded || conn.is_some_and(|c| c.0.0.tls) {
        "https"
    } else {
        "http"
    };
    let expires = crate::sandboxes::now_ms() / 1000 + UPLOAD_URL_VALID_S;
    let url = (!present).then(|| {
        let q = s.keys.sign_upload(who.owner(), &tid, &hash, expires);
        format!("{scheme}://{host}/templates/{tid}/files/{hash}?{q}")
    });
    Ok((
        StatusCode::CREATED,
        Json(TemplateBuildFileUpload {
            present,
            url,
            headers: None,
        }),
    ))
}

/// How long a presigned upload URL holds (the SDK's upload timeout).
pub const UPLOAD_URL_VALID_S: i64 = 3600;

/// The tenant of a key-less `PUT /templates/{id}/files/{hash}` whose presigned query holds.
pub fn presigned_upload(
    keys: &crate::tenants::KeyRing,
    method: &axum::http::Method,
    uri: &axum::http::Uri,
) -> Option<crate::tenants::Tenant> {
    if method != axum::http::Method::PUT {
        return None;
    }
    let rest = uri.path().strip_prefix("/templates/")?;
    let (tid, rest) = rest.split_once('/')?;
    let hash = rest.strip_prefix("files/")?;
    if hash.contains('/') {
        return None;
    }
    let query: std::collections::HashMap<String, String> =
        form_urlencoded::parse(uri.query()?.as_bytes())
            .into_owned()
            .collect();
    keys.check_upload(tid, hash, &query, crate::sandboxes::now_ms() / 1000)
}

/// Upload a COPY archive (tar, or tar.gz) of a build.
#[utoipa::path(put, path = "/templates/{templateID}/files/{hash}", tag = "templates",
    params(("templateID" = String, Path), ("hash" = String, Path)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn upload_file(
    State(s): State<AppState>,
    Who(who): Who,
    Path((tid, hash)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    s.sandboxes.put_build_file(&who, &tid, &hash, &body)?;
    Ok(StatusCode::CREATED)
}

/// Start a requested build with its steps; it runs in the background (poll its status).
#[utoipa::path(post, path = "/v2/templates/{templateID}/builds/{buildID}", tag = "templates",
    request_body = TemplateBuildStartV2,
    params(("templateID" = String, Path), ("buildID" = String, Path)),
    responses((status = 202), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn start_build(
    State(s): State<AppState>,
    Who(who): Who,
    Path((tid, bid)): Path<(String, String)>,
    E2bJson(req): E2bJson<TemplateBuildStartV2>,
) -> ApiResult<StatusCode> {
    let plan = views::build_plan(req)?;
    s.sandboxes.start_build(&who, &tid, &bid, plan)?;
    Ok(StatusCode::ACCEPTED)
}

/// A build's status and its log from `logsOffset` on (at most 100 entries).
#[utoipa::path(get, path = "/templates/{templateID}/builds/{buildID}/status", tag = "templates",
    params(("templateID" = String, Path), ("buildID" = String, Path), ("logsOffset" = Option<u32>, Query),
        ("limit" = Option<u32>, Query), ("level" = Option<String>, Query)),
    responses((status = 200, body = TemplateBuildInfo), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn build_status(
    State(s): State<AppState>,
    Who(who): Who,
    Path((tid, bid)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<TemplateBuildInfo>> {
    let mut offset = 0usize;
    for (k, v) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        if k == "logsOffset" {
            offset = v
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid logsOffset '{v}'")))?;
        }
    }
    let v = s.sandboxes.build_status(&who, &tid, &bid, offset)?;
    Ok(Json(views::build_info(&v)))
}

/// The template a name or alias stands for (`Template.exists`).
#[utoipa::path(get, path = "/templates/aliases/{alias}", tag = "templates",
    params(("alias" = String, Path)),
    responses((status = 200, body = TemplateAliasResponse), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn alias(
    State(s): State<AppState>,
    Who(who): Who,
    Path(alias): Path<String>,
) -> ApiResult<Json<TemplateAliasResponse>> {
    let template_id = s
        .sandboxes
        .template_by_alias(&who, &alias)
        .ok_or_else(|| ApiError::not_found(format!("template '{alias}' not found")))?;
    Ok(Json(TemplateAliasResponse {
        template_id,
        public: false,
    }))
}
