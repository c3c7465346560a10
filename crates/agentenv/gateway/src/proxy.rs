//! Forwarding one request to a node, streaming both bodies (Connect streams, file transfers) and
//! upgraded connections (`agentenv_api::upgrade`), with a deadline on the connection and on the response head.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Uri, Version, header};
use axum::response::Response;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::TokioExecutor;

use agentenv_control::tenants::Tenant;

use super::GatewayError;

/// Longest wait for a TCP connection to a node.
pub const CONNECT_DEADLINE: Duration = Duration::from_secs(3);

type TlsClient = Client<HttpsConnector<HttpConnector<NodeHosts>>, Body>;

/// How gateways reach nodes: pooled HTTP/1.1 keep-alive connections. With a node CA
/// ([`agentenv_cluster::node_tls`]) only HTTPS, each node's certificate checked against its node id;
/// without one only plain HTTP.
#[derive(Clone)]
pub struct HttpClient {
    plain: Client<HttpConnector, Body>,
    tls: Option<(TlsClient, NodeHosts)>,
    /// The TLS client shows a gateway's certificate: requests carry the tenant the gateway
    /// authenticated ([`agentenv_api::conn::TENANT_HEADER`]), never a key.
    asserts_tenant: bool,
}

/// Node id -> the host its record names. A TLS request goes to `https://<node id>:<port>` (the name
/// its certificate must carry); this resolves that name to the record's host.
#[derive(Clone, Default)]
pub struct NodeHosts(Arc<RwLock<HashMap<String, String>>>);

impl tower_service::Service<Name> for NodeHosts {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let host = self
            .0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name.as_str())
            .cloned();
        Box::pin(async move {
            let host = host.ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("no node {:?} routed", name.as_str()),
                )
            })?;
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            Ok(tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .collect::<Vec<_>>()
                .into_iter())
        })
    }
}

fn http_connector<R>(mut c: HttpConnector<R>) -> HttpConnector<R> {
    c.set_connect_timeout(Some(CONNECT_DEADLINE));
    c.set_nodelay(true);
    c.enforce_http(false);
    c
}

/// A client for nodes; `node_tls` is the client side of `agentenv_cluster::node_tls`.
pub fn client(node_tls: Option<Arc<rustls::ClientConfig>>) -> HttpClient {
    let builder = || {
        let mut b = Client::builder(TokioExecutor::new());
        b.pool_idle_timeout(Duration::from_secs(90));
        b
    };
    let asserts_tenant = node_tls
        .as_ref()
        .is_some_and(|c| c.client_auth_cert_resolver.has_certs());
    let tls = node_tls.map(|cfg| {
        let hosts = NodeHosts::default();
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*cfg).clone())
            .https_only()
            .enable_http1()
            .wrap_connector(http_connector(HttpConnector::new_with_resolver(
                hosts.clone(),
            )));
        (builder().build(https), hosts)
    });
    HttpClient {
        plain: builder().build(http_connector(HttpConnector::new())),
        tls,
        asserts_tenant,
    }
}

impl HttpClient {
    /// Sends `parts` (path and query already set) and `body` to node `node` at `base`.
    async fn send(
        &self,
        node: &str,
        base: &str,
        mut parts: axum::http::request::Parts,
        body: Body,
    ) -> Result<hyper::Response<hyper::body::Incoming>, GatewayError> {
        let bad = |why: String| GatewayError::Node {
            node: node.into(),
            why,
        };
        let base_uri = base
            .parse::<Uri>()
            .map_err(|e| bad(format!("bad node URL {base:?}: {e}")))?;
        let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let target = match (&self.tls, base_uri.scheme_str(), base_uri.host()) {
            (None, Some("http"), Some(_)) => format!("{}{pq}", base.trim_end_matches('/')),
            (Some((_, hosts)), Some("https"), Some(host)) => {
                // The node id is the name its certificate must carry.
                if !agentenv_cluster::schema::valid_node_id(node) {
                    return Err(bad(format!("node id {node:?} is no certificate name")));
                }
                hosts
                    .0
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(node.to_string(), host.to_string());
                let port = base_uri.port_u16().unwrap_or(443);
                format!("https://{node}:{port}{pq}")
            }
            (Some(_), _, _) => {
                return Err(bad(format!(
                    "node URL {base:?} is not HTTPS; this gateway checks nodes against --node-ca"
                )));
            }
            (None, _, _) => {
                return Err(bad(format!(
                    "node URL {base:?}: only http:// without --node-ca"
                )));
            }
        };
        parts.uri = target
            .parse::<Uri>()
            .map_err(|e| bad(format!("bad node URL {base:?}: {e}")))?;
        let req = Request::from_parts(parts, body);
        let call = match &self.tls {
            Some((client, _)) => client.request(req).await,
            None => self.plain.request(req).await,
        };
        call.map_err(|e| {
            use std::error::Error;
            let mut why = e.to_string();
            let mut src = e.source();
            while let Some(s) = src {
                why = format!("{why}: {s}");
                src = s.source();
            }
            bad(why)
        })
    }
}

/// Sends `req` to the node at `base` (e.g. `https://10.0.0.5:3000`) and streams its answer back;
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
    parts.version = Version::HTTP_11;
    agentenv_api::dataplane::strip_hop(&mut parts.headers);
    if let Some(protocol) = upgrade {
        agentenv_api::upgrade::keep(&mut parts.headers, protocol);
    }
    parts.headers.remove(header::HOST);
    present_tenant(client, &mut parts)?;
    let call = client.send(node, base, parts, body);
    let resp = match tokio::time::timeout(deadline, call).await {
        Err(_) => {
            return Err(GatewayError::NodeTimeout {
                node: node.into(),
                secs: deadline.as_secs(),
            });
        }
        Ok(r) => r?,
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

/// Credentials for the node: a client never asserts a tenant; a gateway with a certificate asserts the
/// one it authenticated (a [`Tenant`] in the extensions) and drops the client's key, so nodes never see
/// keys; without one, the client's key goes on as it came.
fn present_tenant(
    client: &HttpClient,
    parts: &mut axum::http::request::Parts,
) -> Result<(), GatewayError> {
    use agentenv_api::conn::TENANT_HEADER;
    parts.headers.remove(TENANT_HEADER);
    if !client.asserts_tenant {
        return Ok(());
    }
    parts.headers.remove("x-api-key");
    if let Some(t) = parts.extensions.get::<Tenant>() {
        let v = header::HeaderValue::from_str(&t.name)
            .map_err(|_| GatewayError::Invalid(format!("tenant name {:?}", t.name)))?;
        parts.headers.insert(TENANT_HEADER, v);
    }
    Ok(())
}

/// Reads a (small, control-plane) body whole, at most `limit` bytes.
pub async fn read_body(body: Body, limit: usize) -> Result<bytes::Bytes, GatewayError> {
    axum::body::to_bytes(body, limit)
        .await
        .map_err(|e| GatewayError::Invalid(format!("reading the body: {e}")))
}
