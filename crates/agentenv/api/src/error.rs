//! `ApiError`: every failure leaves the server as `{"code": <status>, "message": "..."}` JSON.

use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::model::ErrorBody;
use crate::sandboxes::{LifecycleError, VmCase};

/// An error answered to the client with a status and the E2B error body.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The sandbox a data-plane error is about (`sandboxId` in the body).
    pub sandbox_id: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            sandbox_id: None,
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }
    /// The data plane's answer for a sandbox that does not run (killed, timed out, unknown), as
    /// E2B's proxy gives it: 502, `The sandbox was not found` and its id.
    pub fn sandbox_gone(id: &str) -> Self {
        ApiError {
            sandbox_id: Some(id.into()),
            ..Self::bad_gateway("The sandbox was not found")
        }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }
    /// Sandbox-proxy error (`docs/specs/e2b-compat.md §3`): 502; the text decides how the SDK reads it.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, message)
    }
    /// 429 of a key's request budget.
    pub fn rate_limited(wait: std::time::Duration) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "rate limit exceeded: retry in {} ms",
                wait.as_millis().max(1)
            ),
        )
    }
}

/// The one place where lifecycle failures become HTTP statuses.
impl From<LifecycleError> for ApiError {
    fn from(e: LifecycleError) -> Self {
        use LifecycleError as L;
        let status = match &e {
            L::SandboxNotFound(_) | L::TemplateNotFound(_) | L::SnapshotNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            L::AlreadyPaused(_) | L::AlreadyRunning(_) | L::Paused(_) => StatusCode::CONFLICT,
            L::Invalid(_) | L::VolumeNotFound(_) => StatusCode::BAD_REQUEST,
            L::Mount { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            L::Vm(_) => match e.vm_case() {
                Some(VmCase::BadRequest) => StatusCode::BAD_REQUEST,
                Some(VmCase::NoCapacity) => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            L::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
            L::DeadlineExceeded { .. } => StatusCode::GATEWAY_TIMEOUT,
            L::QuotaExceeded(_) => StatusCode::TOO_MANY_REQUESTS,
            L::StorageFull(_) => StatusCode::INSUFFICIENT_STORAGE,
            L::Building(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            // The cause names host paths and internals: it goes to the log, not to the client.
            tracing::error!(error = ?e, "internal error");
            return ApiError::new(status, "internal error; the server log has its cause");
        }
        ApiError::new(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.status.as_u16(),
            message: self.message,
            sandbox_id: self.sandbox_id,
        };
        let mut resp = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// `Json<T>` whose rejections (malformed JSON, wrong type, too large) answer with [`ApiError`].
/// An empty body reads as `T::default()` (pause and connect may come without a body); a body with a
/// content type other than JSON is refused with 415.
pub struct E2bJson<T>(pub T);

impl<S, T> FromRequest<S> for E2bJson<T>
where
    T: DeserializeOwned + Default,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let ctype = req
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("?").to_string());
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::new(e.status(), e.body_text()))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(E2bJson(T::default()));
        }
        if let Some(c) = ctype.filter(|c| !is_json_type(c)) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("expected Content-Type: application/json, got {c:?}"),
            ));
        }
        serde_json::from_slice(&bytes)
            .map(E2bJson)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// `application/json`, with or without parameters (`; charset=utf-8`).
fn is_json_type(c: &str) -> bool {
    c.split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// Rewrites any error answer that is not already E2B JSON (the router's 404/405, extractor
/// rejections such as a path id that is not UTF-8) into `{code, message}`, keeping `Allow`.
pub async fn json_errors(req: Request, next: axum::middleware::Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(is_json_type);
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let mut out = ApiError::new(status, message).into_response();
    if let Some(allow) = parts.headers.get(header::ALLOW) {
        out.headers_mut().insert(header::ALLOW, allow.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn json_content_types() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
        ] {
            assert!(super::is_json_type(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/jsonx",
            "application/x-www-form-urlencoded",
            "",
        ] {
            assert!(!super::is_json_type(bad), "{bad}");
        }
    }

    #[test]
    fn lifecycle_cases_have_their_status() {
        use crate::backend::VmError;
        use crate::sandboxes::LifecycleError as L;
        use axum::http::StatusCode as S;
        use axum::response::IntoResponse;
        let why = || format!("all {} uids in use", rand::random_range(1..9));
        let path = format!("/var/lib/agentenv/{}", rand::random::<u32>());
        let cases = [
            (
                L::from(VmError::NoCapacity(why().into())),
                S::SERVICE_UNAVAILABLE,
            ),
            (L::from(VmError::invalid(why())), S::BAD_REQUEST),
            (
                L::from(VmError::NetworkUnavailable(why().into())),
                S::BAD_REQUEST,
            ),
            (
                L::from(VmError::Failed(path.clone().into())),
                S::INTERNAL_SERVER_ERROR,
            ),
            (L::from(VmError::Paused("x".into())), S::CONFLICT),
            (L::from(VmError::NotPaused("x".into())), S::CONFLICT),
            (L::from(VmError::SnapshotNotFound("x".into())), S::NOT_FOUND),
            (L::QuotaExceeded(why()), S::TOO_MANY_REQUESTS),
            (L::StorageFull(why()), S::INSUFFICIENT_STORAGE),
            (L::Building(why()), S::SERVICE_UNAVAILABLE),
            (L::VolumeNotFound(why()), S::BAD_REQUEST),
            (
                L::Mount {
                    id: "x".into(),
                    path: "/m".into(),
                    detail: path.clone(),
                },
                S::INTERNAL_SERVER_ERROR,
            ),
            (
                L::DeadlineExceeded {
                    op: "pause",
                    id: "x".into(),
                    secs: 1.0,
                },
                S::GATEWAY_TIMEOUT,
            ),
        ];
        for (e, status) in cases {
            let api = super::ApiError::from(e.clone());
            assert_eq!(api.status, status, "{e:?}");
            assert!(
                !api.message.contains(&path),
                "a host path reached the client: {e:?}"
            );
            let r = api.into_response();
            let retry = matches!(status, S::SERVICE_UNAVAILABLE | S::TOO_MANY_REQUESTS);
            assert_eq!(r.headers().contains_key("retry-after"), retry, "{e:?}");
        }
    }
}
