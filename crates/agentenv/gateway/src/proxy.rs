//! Forwarding one request to a node, streaming both bodies (Connect streams, file transfers) and
//! upgraded connections (`agentenv_api::upgrade`), with a deadline on the connection and on the response head.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Uri, Version, header};
use axum::response::Response;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::GatewayError;

/// The HTTP/1.1 client gateways reach nodes with (pooled keep-alive connections).
pub type HttpClient = Client<HttpConnector, Body>;

/// Longest wait for a TCP connection to a node.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(3);

pub fn client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_connect_timeout(Some(CONNECT_DEADLINE));
    c.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(c)
}

/// Sends `req` to the node at `base` (e.g. `http://10.0.0.5:3000`) and streams its answer back;
/// `deadline` bounds the wait for the answer's head.
pub async fn forward(
    client: &HttpClient,
    node: &str,
    base: &str,
    req: Request,
    deadline: Duration,
) -> Result<Response, GatewayError> {
    let mut req = req;
    let upgrade = agentenv_api::upgrade::requested(req.headers());
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    parts.uri = format!("{}{pq}", base.trim_end_matches('/'))
        .parse::<Uri>()
        .map_err(|e| GatewayError::Node {
            node: node.into(),
            why: format!("bad node URL {base:?}: {e}"),
        })?;
    parts.version = Version::HTTP_11;
    agentenv_api::dataplane::strip_hop(&mut parts.headers);
    if let Some(protocol) = upgrade {
        agentenv_api::upgrade::keep(&mut parts.headers, protocol);
    }
    parts.headers.remove(header::HOST);
    let call = client.request(Request::from_parts(parts, body));
    let resp = match tokio::time::timeout(deadline, call).await {
        Err(_) => {
            return Err(GatewayError::NodeTimeout {
                node: node.into(),
                secs: deadline.as_secs(),
            });
        }
        Ok(Err(e)) => {
            return Err(GatewayError::Node {
                node: node.into(),
                why: e.to_string(),
            });
        }
        Ok(Ok(r)) => r,
    };
    let mut resp = resp;
    if let Some(client) = client_side
        && resp.status() == axum::http::StatusCode::SWITCHING_PROTOCOLS
    {
        // The 101 keeps its Connection and Upgrade headers.
        let upstream = hyper::upgrade::on(&mut resp);
        agentenv_api::upgrade::splice(client, upstream, format!("node {node}"));
        return Ok(resp.map(Body::new));
    }
    let (mut parts, body) = resp.into_parts();
    agentenv_api::dataplane::strip_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// Reads a (small, control-plane) body whole, at most `limit` bytes.
pub async fn read_body(body: Body, limit: usize) -> Result<bytes::Bytes, GatewayError> {
    axum::body::to_bytes(body, limit)
        .await
        .map_err(|e| GatewayError::Invalid(format!("reading the body: {e}")))
}
