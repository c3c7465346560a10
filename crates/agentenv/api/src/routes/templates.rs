//! Template routes: list, build (with its progress stream).

use super::*;
use crate::model::{AssignTemplateTags, AssignedTemplateTags, DeleteTemplateTags};

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
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 403, description = "a shared template: read-only to this key", body = ErrorBody),
        (status = 404, description = "another key's template", body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn build_template(
    State(s): State<AppState>,
    Who(who): Who,
    headers: HeaderMap,
    E2bJson(req): E2bJson<BuildTemplateRequest>,
) -> ApiResult<Response> {
    let base = TemplateSpec::base();
    let spec = TemplateSpec {
        id: req.template_id,
        aliases: req.aliases,
        vcpus: req.cpu_count.unwrap_or(base.vcpus),
        memory_mib: req.memory_mb.map_or(base.memory_mib, u64::from),
        disk_mib: req.disk_size_mb.map_or(base.disk_mib, u64::from),
        from_image: req.from_image.map(|reference| crate::backend::ImageSource {
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

/// A failed or refused template build as an API error: the caller's mistakes are 4xx.
fn template_error(e: crate::sandboxes::TemplateBuildError) -> ApiError {
    use crate::sandboxes::TemplateBuildError as B;
    let e = match e {
        B::InvalidId(_) => return ApiError::bad_request(e.to_string()),
        B::NotFound(_) => return ApiError::new(StatusCode::NOT_FOUND, e.to_string()),
        B::Shared(_) => return ApiError::new(StatusCode::FORBIDDEN, e.to_string()),
        B::Owner(_) => {
            tracing::error!(error = ?e, "template build refused");
            return ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal error; the server log has its cause",
            );
        }
        B::Build(e) => e,
    };
    ApiError::from(crate::sandboxes::LifecycleError::from(e))
}

/// Give a built template more tags (`name:tag` names), moved from any other build of the name.
#[utoipa::path(post, path = "/templates/tags", tag = "templates", request_body = AssignTemplateTags,
    responses((status = 201, body = AssignedTemplateTags), (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn assign_tags(
    State(s): State<AppState>,
    Who(who): Who,
    E2bJson(req): E2bJson<AssignTemplateTags>,
) -> ApiResult<(StatusCode, Json<AssignedTemplateTags>)> {
    let (build_id, tags) = s.sandboxes.assign_tags(&who, &req.target, &req.tags)?;
    Ok((
        StatusCode::CREATED,
        Json(AssignedTemplateTags { build_id, tags }),
    ))
}

/// Take tags from a template's builds.
#[utoipa::path(delete, path = "/templates/tags", tag = "templates", request_body = DeleteTemplateTags,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn delete_tags(
    State(s): State<AppState>,
    Who(who): Who,
    E2bJson(req): E2bJson<DeleteTemplateTags>,
) -> ApiResult<StatusCode> {
    s.sandboxes.remove_tags(&who, &req.name, &req.tags)?;
    Ok(StatusCode::NO_CONTENT)
}
