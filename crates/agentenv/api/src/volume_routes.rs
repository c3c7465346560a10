//! E2B's volumes: `/volumes` (the tenant's volumes, API key) and the volume content API
//! (`/volumecontent/{volumeID}/...`, the volume's token as `Authorization: Bearer`), over
//! `agentenv_control::volumes`.

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, E2bJson};
use crate::routes::Who;
use crate::state::AppState;
use agentenv_control::volumes::{Content, EntryStat, Meta, VolumeError};

type ApiResult<T> = Result<T, ApiError>;

/// Largest file one content request uploads.
pub const MAX_VOLUME_FILE_BYTES: usize = 64 << 20;

/// The one place where volume failures become HTTP statuses.
impl From<VolumeError> for ApiError {
    fn from(e: VolumeError) -> Self {
        use VolumeError as V;
        let status = match &e {
            V::NotFound(_) | V::PathNotFound(_) => StatusCode::NOT_FOUND,
            V::NameTaken(_) | V::Exists(_) | V::NotADirectory(_) | V::IsADirectory(_) => {
                StatusCode::CONFLICT
            }
            V::BadName(_) | V::BadPath(_) => StatusCode::BAD_REQUEST,
            V::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            V::Unauthorized => StatusCode::UNAUTHORIZED,
            V::Full(_) | V::TooManyEntries(_) => StatusCode::INSUFFICIENT_STORAGE,
            V::Store { .. } => StatusCode::SERVICE_UNAVAILABLE,
            V::Io { .. } | V::BadManifest { .. } | V::Runtime(_) => {
                tracing::error!(error = ?e, "volume I/O failed");
                return ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error; the server log has its cause",
                );
            }
        };
        ApiError::new(status, e.to_string())
    }
}

/// Whether `path` is one of the volume content API's, which answers to a volume's token, not a key.
pub fn is_content_path(path: &str) -> bool {
    path.starts_with("/volumecontent/")
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct NewVolume {
    pub name: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VolumeView {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    /// `Authorization: Bearer` of the content API.
    pub token: String,
}

/// Create a volume.
#[utoipa::path(post, path = "/volumes", tag = "volumes", request_body = NewVolume,
    responses((status = 201, body = VolumeAndToken), (status = 400, body = crate::model::ErrorBody),
        (status = 401, body = crate::model::ErrorBody), (status = 409, body = crate::model::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn create(
    State(s): State<AppState>,
    Who(who): Who,
    E2bJson(req): E2bJson<NewVolume>,
) -> ApiResult<(StatusCode, Json<VolumeAndToken>)> {
    let (v, token) = s.sandboxes.volumes().create(who.owner(), &req.name)?;
    Ok((
        StatusCode::CREATED,
        Json(VolumeAndToken {
            volume_id: v.volume_id,
            name: v.name,
            token,
        }),
    ))
}

/// List the caller's volumes.
#[utoipa::path(get, path = "/volumes", tag = "volumes",
    responses((status = 200, body = [VolumeView]), (status = 401, body = crate::model::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list(State(s): State<AppState>, Who(who): Who) -> Json<Vec<VolumeView>> {
    Json(
        s.sandboxes
            .volumes()
            .list(who.owner())
            .into_iter()
            .map(|v| VolumeView {
                volume_id: v.volume_id,
                name: v.name,
            })
            .collect(),
    )
}

/// A volume and its token.
#[utoipa::path(get, path = "/volumes/{volumeID}", tag = "volumes", params(("volumeID" = String, Path)),
    responses((status = 200, body = VolumeAndToken), (status = 401, body = crate::model::ErrorBody),
        (status = 404, body = crate::model::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn get(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<VolumeAndToken>> {
    let (v, token) = s.sandboxes.volumes().get(who.owner(), &id)?;
    Ok(Json(VolumeAndToken {
        volume_id: v.volume_id,
        name: v.name,
        token,
    }))
}

/// Delete a volume and its files.
#[utoipa::path(delete, path = "/volumes/{volumeID}", tag = "volumes", params(("volumeID" = String, Path)),
    responses((status = 204), (status = 401, body = crate::model::ErrorBody),
        (status = 404, body = crate::model::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn delete(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    s.sandboxes.volumes().delete(who.owner(), &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// E2B's `VolumeEntryStat`.
#[derive(Debug, Serialize, ToSchema)]
pub struct EntryView {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
}

impl From<EntryStat> for EntryView {
    fn from(e: EntryStat) -> Self {
        let t = crate::sandboxes::rfc3339_ms;
        EntryView {
            name: e.name,
            kind: e.kind,
            path: e.path,
            size: e.size,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            atime: t(e.atime_ms),
            mtime: t(e.mtime_ms),
            ctime: t(e.ctime_ms),
        }
    }
}

/// Query of the content API.
#[derive(Debug, Deserialize)]
pub struct PathQuery {
    path: String,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

impl PathQuery {
    fn meta(&self) -> Meta {
        Meta {
            uid: self.uid,
            gid: self.gid,
            mode: self.mode,
        }
    }
}

/// Body of `PATCH /volumecontent/{volumeID}/path`.
#[derive(Debug, Default, Deserialize)]
pub struct MetaBody {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

fn content(s: &AppState, id: &str, headers: &HeaderMap) -> ApiResult<Content> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    Ok(s.sandboxes.volumes().content(id, bearer)?)
}

/// A content request: the volume's files (its token checked first) and the query.
pub struct ContentReq(Content, PathQuery);

impl axum::extract::FromRequestParts<AppState> for ContentReq {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        s: &AppState,
    ) -> Result<Self, ApiError> {
        let bad = |e: String| ApiError::bad_request(e);
        let Path(id) = Path::<String>::from_request_parts(parts, s)
            .await
            .map_err(|e| bad(e.body_text()))?;
        let c = content(s, &id, &parts.headers)?;
        let Query(q) = Query::<PathQuery>::from_request_parts(parts, s)
            .await
            .map_err(|e| bad(e.body_text()))?;
        Ok(ContentReq(c, q))
    }
}

/// What a path of a volume is.
#[utoipa::path(get, path = "/volumecontent/{volumeID}/path", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query)),
    responses((status = 200, body = EntryView), (status = 401, body = crate::model::ErrorBody), (status = 404, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn stat(ContentReq(c, q): ContentReq) -> ApiResult<Json<EntryView>> {
    Ok(Json(c.stat(&q.path)?.into()))
}

/// Change the owner or permissions of a path of a volume.
#[utoipa::path(patch, path = "/volumecontent/{volumeID}/path", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query)),
    responses((status = 200, body = EntryView), (status = 401, body = crate::model::ErrorBody), (status = 404, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn set_meta(
    ContentReq(c, q): ContentReq,
    E2bJson(b): E2bJson<MetaBody>,
) -> ApiResult<Json<EntryView>> {
    let meta = Meta {
        uid: b.uid,
        gid: b.gid,
        mode: b.mode,
    };
    Ok(Json(c.set_meta(&q.path, meta)?.into()))
}

/// Delete a path of a volume (a folder with what it holds).
#[utoipa::path(delete, path = "/volumecontent/{volumeID}/path", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query)),
    responses((status = 204), (status = 401, body = crate::model::ErrorBody), (status = 404, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn remove(ContentReq(c, q): ContentReq) -> ApiResult<StatusCode> {
    c.remove(&q.path)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A folder's entries, `depth` levels down.
#[utoipa::path(get, path = "/volumecontent/{volumeID}/dir", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query), ("depth" = Option<u32>, Query)),
    responses((status = 200, body = [EntryView]), (status = 401, body = crate::model::ErrorBody), (status = 404, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn list_dir(ContentReq(c, q): ContentReq) -> ApiResult<Json<Vec<EntryView>>> {
    let entries = c.list(&q.path, q.depth.unwrap_or(1))?;
    Ok(Json(entries.into_iter().map(Into::into).collect()))
}

/// Make a folder (its parents too with `force`).
#[utoipa::path(post, path = "/volumecontent/{volumeID}/dir", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query), ("force" = Option<bool>, Query)),
    responses((status = 201, body = EntryView), (status = 401, body = crate::model::ErrorBody), (status = 404, body = crate::model::ErrorBody),
        (status = 409, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn make_dir(ContentReq(c, q): ContentReq) -> ApiResult<(StatusCode, Json<EntryView>)> {
    let st = c.mkdir(&q.path, q.meta(), q.force.unwrap_or(false))?;
    Ok((StatusCode::CREATED, Json(st.into())))
}

/// A file's bytes, streamed.
#[utoipa::path(get, path = "/volumecontent/{volumeID}/file", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query)),
    responses((status = 200, content_type = "application/octet-stream"), (status = 401, body = crate::model::ErrorBody),
        (status = 404, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn read_file(ContentReq(c, q): ContentReq) -> ApiResult<Response> {
    let f = c.read(&q.path)?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(f));
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Write a file (an existing one only with `force`); at most 64 MiB a request.
#[utoipa::path(put, path = "/volumecontent/{volumeID}/file", tag = "volumes",
    params(("volumeID" = String, Path), ("path" = String, Query), ("force" = Option<bool>, Query)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 201, body = EntryView), (status = 401, body = crate::model::ErrorBody), (status = 404, body = crate::model::ErrorBody),
        (status = 409, body = crate::model::ErrorBody), (status = 507, body = crate::model::ErrorBody)),
    security(("VolumeToken" = [])))]
pub async fn write_file(
    ContentReq(c, q): ContentReq,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<EntryView>)> {
    let force = q.force.unwrap_or(false);
    let st = tokio::task::spawn_blocking(move || c.write(&q.path, &body, q.meta(), force))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    Ok((StatusCode::CREATED, Json(st.into())))
}
