//! Who may reach a sandbox over the data plane: the one check of a request's right to a sandbox named
//! by id, used by the node's proxy and by gateways (before one moves a paused sandbox), and its answer.

use axum::http::HeaderMap;

use crate::error::ApiError;
use crate::store::SandboxRecord;

/// The request is for a user port (not envd's).
pub(crate) fn user_port(headers: &HeaderMap) -> bool {
    headers
        .get("e2b-sandbox-port")
        .and_then(|v| v.to_str().ok())
        .filter(|p| !p.is_empty())
        .is_some_and(|p| p.parse::<u16>() != Ok(agentenv_envd::ENVD_PORT))
}

/// Whether the request may reach sandbox `rec`: it carries the sandbox's access token
/// (`X-Access-Token`), or it is for a user port and the sandbox's user ports are public
/// (`allowPublicTraffic`) or it carries their traffic token (the code interpreter sends only that).
pub fn request_ok(headers: &HeaderMap, rec: &SandboxRecord) -> bool {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
    crate::keys::secret_eq(header("x-access-token"), &rec.access_token)
        || (user_port(headers)
            && (rec.public_traffic
                || crate::keys::secret_eq(
                    header("e2b-traffic-access-token"),
                    &crate::keys::traffic_token(&rec.access_token),
                )))
}

/// The answer to a request [`request_ok`] refused: as E2B, 403 on a user port (its traffic token),
/// 401 on envd's (its access token).
pub fn refusal(headers: &HeaderMap) -> ApiError {
    if user_port(headers) {
        ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "missing or wrong E2B-Traffic-Access-Token (or X-Access-Token) for this sandbox",
        )
    } else {
        ApiError::unauthorized("missing or wrong X-Access-Token for this sandbox")
    }
}
