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
/// An empty body reads as `T::default()` (pause and connect may come without a body).
pub struct E2bJson<T>(pub T);

impl<S, T> FromRequest<S> for E2bJson<T>
where
    T: DeserializeOwned + Default,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::new(e.status(), e.body_text()))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(E2bJson(T::default()));
        }
        serde_json::from_slice(&bytes)
            .map(E2bJson)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}
