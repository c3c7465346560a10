//! Gateway failures as HTTP.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use agentenv_api::error::ApiError;

/// The one place where gateway failures become HTTP statuses. On the data plane, a sandbox that is gone
/// (unknown, lost with its node, paused on a node that left) is a 502 whose text says "was not found",
/// which the SDK reads as "not running" (`docs/specs/e2b-compat.md §3`); on the control plane it is 404,
/// 410 (lost) or 409 (paused: connect to resume).
pub fn gateway_response(e: crate::GatewayError, data_plane: bool) -> Response {
    use crate::GatewayError as G;
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
        G::Api(a) => return a.clone().into_response(),
        G::SandboxNotFound(id) if data_plane => {
            return ApiError::sandbox_gone(id).into_response();
        }
        _ if gone && data_plane => format!("The sandbox was not found: {e}"),
        _ => e.to_string(),
    };
    ApiError::new(status, message).into_response()
}

#[cfg(test)]
mod tests {
    use crate::GatewayError as G;

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
}
