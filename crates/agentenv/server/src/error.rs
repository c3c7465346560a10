//! `ApiError`: every failure leaves the server as `{"code": <status>, "message": "..."}` JSON.

use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use crate::model::ErrorBody;
use crate::sandboxes::LifecycleError;

/// An error answered to the client with a status and the E2B error body.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
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
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::not_found(format!("sandbox {id} was not found"))
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
            L::Invalid(_) => StatusCode::BAD_REQUEST,
            L::Runtime(_) | L::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
            L::DeadlineExceeded { .. } => StatusCode::GATEWAY_TIMEOUT,
            L::QuotaExceeded(_) => StatusCode::TOO_MANY_REQUESTS,
            L::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.status.as_u16(),
            message: self.message,
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

/// The one place where gateway failures become HTTP statuses. On the data plane, a sandbox that is gone
/// (unknown, lost with its node, paused on a node that left) is a 502 whose text says "was not found",
/// which the SDK reads as "not running" (`docs/specs/e2b-compat.md §3`); on the control plane it is 404,
/// 410 (lost) or 409 (paused: connect to resume).
pub fn gateway_response(e: crate::gateway::GatewayError, data_plane: bool) -> Response {
    use crate::gateway::GatewayError as G;
    let gone = matches!(
        e,
        G::SandboxNotFound(_) | G::SandboxLost { .. } | G::PausedElsewhere { .. }
    );
    let status = match &e {
        G::Upstream(_) => {
            return match e {
                G::Upstream(r) => *r,
                _ => unreachable!(),
            };
        }
        G::Api(a) => a.status,
        _ if gone && data_plane => StatusCode::BAD_GATEWAY,
        G::Etcd(_) | G::NoPlacement(_) => StatusCode::SERVICE_UNAVAILABLE,
        G::Node { .. } | G::Takeover { .. } => StatusCode::BAD_GATEWAY,
        G::NodeTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        G::SandboxNotFound(_) => StatusCode::NOT_FOUND,
        G::SandboxLost { .. } => StatusCode::GONE,
        G::PausedElsewhere { .. } => StatusCode::CONFLICT,
        G::Invalid(_) => StatusCode::BAD_REQUEST,
        G::Forbidden(_) => StatusCode::FORBIDDEN,
    };
    let message = match &e {
        G::Api(a) => a.message.clone(),
        G::SandboxNotFound(id) if data_plane => format!("The sandbox {id} was not found"),
        _ if gone && data_plane => format!("The sandbox was not found: {e}"),
        _ => e.to_string(),
    };
    ApiError::new(status, message).into_response()
}

#[cfg(test)]
mod tests {
    use crate::gateway::GatewayError as G;

    async fn answer(e: G, data_plane: bool) -> (u16, serde_json::Value) {
        let r = super::gateway_response(e, data_plane);
        let status = r.status().as_u16();
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn gateway_errors_are_typed_json() {
        let lost = || G::SandboxLost {
            id: "s1".into(),
            node: "n1".into(),
        };
        let (status, body) = answer(lost(), false).await;
        assert_eq!((status, body["code"].as_u64()), (410, Some(410)));
        assert!(body["message"].as_str().unwrap().contains("lost"), "{body}");
        // On the data plane the SDK must read it as "not running": 502 and "was not found".
        let (status, body) = answer(lost(), true).await;
        assert_eq!(status, 502);
        assert!(
            body["message"].as_str().unwrap().contains("was not found"),
            "{body}"
        );
        let (status, _) = answer(G::SandboxNotFound("s2".into()), false).await;
        assert_eq!(status, 404);
        let etcd = || agentenv_cluster::ClusterError::Unavailable {
            what: "get",
            why: "deadline".into(),
        };
        for data_plane in [false, true] {
            let (status, body) = answer(G::Etcd(etcd()), data_plane).await;
            assert_eq!((status, body["code"].as_u64()), (503, Some(503)));
        }
        let (status, _) = answer(G::Invalid("bad".into()), false).await;
        assert_eq!(status, 400);
        let (status, _) = answer(
            G::NodeTimeout {
                node: "n".into(),
                secs: 1,
            },
            false,
        )
        .await;
        assert_eq!(status, 504);
    }

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
    fn no_free_vm_uid_is_503_with_retry_after() {
        use crate::backend::{CreateError, ResumeError};
        use agentenv_runtime::vmm::VmmError;
        use axum::response::IntoResponse;
        let why = format!("all {} uids in use", rand::random_range(1..9));
        for e in [
            crate::sandboxes::LifecycleError::from(CreateError::Vmm(VmmError::NoUid(why.clone()))),
            crate::sandboxes::LifecycleError::from(ResumeError::Vmm(VmmError::NoUid(why.clone()))),
        ] {
            let r = super::ApiError::from(e).into_response();
            assert_eq!(r.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(r.headers()["retry-after"], "1");
        }
    }
}
