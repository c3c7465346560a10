//! One guest connection: classify it by its first bytes, then intercept it (TLS ended here, rule
//! headers set on each request, requests sent on over one upstream connection) or splice it.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddrV4;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use agentenv_vm::EgressPolicy;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert};
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream};
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::hello::{Hello, Replay, read_hello};
use crate::{Ca, EgressError};

/// Serves one end of an in-memory pipe as an HTTP/1 connection to the server's own data plane.
pub type Hairpin = Arc<dyn Fn(DuplexStream) + Send + Sync>;

/// Opens a TCP connection from the sandbox's side (its namespace, so its egress rules apply).
pub type Dialer = Arc<
    dyn Fn(SocketAddrV4) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>>
        + Send
        + Sync,
>;

/// Deadline of a connection's first bytes (the ClientHello or the request head), and of a TLS
/// handshake.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Deadline of connecting to the destination.
const CONNECT_DEADLINE: Duration = Duration::from_secs(10);
/// Deadline of each later request head on an intercepted connection.
const HEAD_DEADLINE: Duration = Duration::from_secs(60);
/// Buffer of the hairpin's pipe.
const PIPE_BYTES: usize = 256 * 1024;

/// Where a redirected connection was going.
#[derive(Debug, Clone, Copy)]
pub struct Flow {
    /// Its destination before the redirect.
    pub original: SocketAddrV4,
    /// It went to the guest's gateway (the sandbox domain's address).
    pub to_gateway: bool,
}

/// The proxy of one server: its CA, TLS settings and the hairpin.
pub struct Proxy {
    ca: Arc<Ca>,
    acceptor: tokio_rustls::TlsAcceptor,
    connector: tokio_rustls::TlsConnector,
    local: Option<(String, Hairpin)>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("local", &self.local_domain())
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Mint(Arc<Ca>);

impl ResolvesServerCert for Mint {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.leaf(hello.server_name()?).ok()
    }
}

enum Up {
    Hairpin,
    Dial(SocketAddrV4, Dialer),
}

type Body = BoxBody<Bytes, hyper::Error>;

impl Proxy {
    /// A proxy signing with `ca`; destinations are verified against the host's roots and `roots`.
    pub fn new(ca: Arc<Ca>, roots: &[CertificateDer<'static>]) -> Result<Proxy, EgressError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = |e: rustls::Error| EgressError::Tls(e.to_string());
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Mint(ca.clone())));
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut store = rustls::RootCertStore::empty();
        for c in rustls_native_certs::load_native_certs().certs {
            let _ = store.add(c);
        }
        for c in roots {
            store.add(c.clone()).map_err(tls)?;
        }
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_root_certificates(store)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Proxy {
            ca,
            acceptor: Arc::new(server).into(),
            connector: Arc::new(client).into(),
            local: None,
        })
    }

    /// Serves names under `domain` (the sandbox domain, no port) through `hairpin`.
    pub fn with_hairpin(mut self, domain: &str, hairpin: Hairpin) -> Proxy {
        self.local = Some((domain.to_ascii_lowercase(), hairpin));
        self
    }

    /// The CA guests trust.
    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// The sandbox domain, if this proxy serves it.
    pub fn local_domain(&self) -> Option<&str> {
        self.local.as_ref().map(|(d, _)| d.as_str())
    }

    /// Whether `name` is under the sandbox domain.
    pub fn is_local(&self, name: &str) -> bool {
        self.local_domain()
            .is_some_and(|d| agentenv_vm::egress::in_domain(name, d))
    }

    /// Handles one redirected guest connection under `policy`, to its end.
    pub async fn handle<S>(
        self: Arc<Self>,
        mut guest: S,
        flow: Flow,
        policy: EgressPolicy,
        dial: Dialer,
    ) -> Result<(), EgressError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (head, hello) = timeout(HELLO_DEADLINE, read_hello(&mut guest))
            .await
            .map_err(|_| EgressError::Slow(HELLO_DEADLINE))?
            .map_err(EgressError::net("read the guest"))?;
        let tls = matches!(hello, Hello::Tls { .. });
        let name = hello.name().map(str::to_owned);
        let io = Replay::new(head, guest);
        let port = flow.original.port();
        if flow.to_gateway {
            let name = name.filter(|n| self.is_local(n)).ok_or_else(|| {
                EgressError::Refused("only the sandbox domain is served at the gateway".into())
            })?;
            if !policy.name_allowed(&name) {
                return Err(EgressError::Refused(format!("{name}: not allowed")));
            }
            return self
                .intercept(io, tls, name, port, &policy, Up::Hairpin)
                .await;
        }
        match name {
            Some(n) if policy.name_verdict(&n) == Some(false) => {
                Err(EgressError::Refused(format!("{n}: denied")))
            }
            Some(n) if policy.has_rule_for(&n) => {
                let up = Up::Dial(flow.original, dial);
                self.intercept(io, tls, n, port, &policy, up).await
            }
            _ => splice(io, flow.original, dial).await,
        }
    }

    async fn intercept<S>(
        self: Arc<Self>,
        io: S,
        tls: bool,
        name: String,
        port: u16,
        policy: &EgressPolicy,
        up: Up,
    ) -> Result<(), EgressError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let headers: Arc<Vec<(HeaderName, HeaderValue)>> = Arc::new(
            policy
                .headers_for(&name, port)
                .into_iter()
                .filter_map(|(k, v)| Some((k.parse().ok()?, v.parse().ok()?)))
                .collect(),
        );
        let io: Box<dyn Io> = match tls {
            true => Box::new(
                timeout(HELLO_DEADLINE, self.acceptor.accept(io))
                    .await
                    .map_err(|_| EgressError::Slow(HELLO_DEADLINE))?
                    .map_err(|e| EgressError::Tls(format!("with the guest: {e}")))?,
            ),
            false => Box::new(io),
        };
        let conn = Arc::new(tokio::sync::Mutex::new(None::<SendRequest<Incoming>>));
        let up = Arc::new(up);
        let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let (me, conn, up, headers, name) = (
                self.clone(),
                conn.clone(),
                up.clone(),
                headers.clone(),
                name.clone(),
            );
            async move {
                // Every request on the connection is for the name it was intercepted for: the rule's
                // headers never go to another site of the same server, and the hairpin serves the
                // sandbox domain only.
                if request_host(&req).as_deref() != Some(name.as_str()) {
                    return Ok(refusal(
                        StatusCode::MISDIRECTED_REQUEST,
                        &format!("this connection serves {name} only"),
                    ));
                }
                for (k, v) in headers.iter() {
                    req.headers_mut().insert(k.clone(), v.clone());
                }
                let mut sender = conn.lock().await;
                if sender.as_ref().is_none_or(|s| s.is_closed()) {
                    match me.open(&up, &name, tls).await {
                        Ok(s) => *sender = Some(s),
                        Err(e) => return Ok::<_, Infallible>(bad_gateway(&e)),
                    }
                }
                let Some(s) = sender.as_mut() else {
                    return Ok(bad_gateway(&EgressError::Refused("no upstream".into())));
                };
                let sent = match s.ready().await {
                    Ok(()) => s.send_request(req).await,
                    Err(e) => Err(e),
                };
                Ok(match sent {
                    Ok(r) => r.map(|b| b.boxed()),
                    Err(e) => bad_gateway(&EgressError::Http(e)),
                })
            }
        });
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_DEADLINE)
            .serve_connection(TokioIo::new(io), svc)
            .await
            .map_err(EgressError::Http)
    }

    /// A client connection to the destination.
    async fn open(
        &self,
        up: &Up,
        name: &str,
        tls: bool,
    ) -> Result<SendRequest<Incoming>, EgressError> {
        match up {
            Up::Hairpin => {
                let Some((_, hairpin)) = &self.local else {
                    return Err(EgressError::Refused("no sandbox domain".into()));
                };
                let (a, b) = tokio::io::duplex(PIPE_BYTES);
                hairpin(b);
                handshake(a).await
            }
            Up::Dial(to, dial) => {
                let tcp = timeout(CONNECT_DEADLINE, dial(*to))
                    .await
                    .map_err(|_| EgressError::Slow(CONNECT_DEADLINE))?
                    .map_err(EgressError::net("connect to the destination"))?;
                if !tls {
                    return handshake(tcp).await;
                }
                let sn = ServerName::try_from(name.to_string())
                    .map_err(|e| EgressError::Tls(e.to_string()))?;
                let s = timeout(HELLO_DEADLINE, self.connector.connect(sn, tcp))
                    .await
                    .map_err(|_| EgressError::Slow(HELLO_DEADLINE))?
                    .map_err(|e| EgressError::Tls(format!("with {name}: {e}")))?;
                handshake(s).await
            }
        }
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn handshake<T>(io: T) -> Result<SendRequest<Incoming>, EgressError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "egress upstream connection ended");
        }
    });
    Ok(sender)
}

/// The host a request names (its URI's authority, else its `Host`), lower case, no port.
fn request_host<B>(req: &Request<B>) -> Option<String> {
    let raw = match req.uri().authority() {
        Some(a) => a.host().to_string(),
        None => {
            let h = req.headers().get(hyper::header::HOST)?.to_str().ok()?;
            match h.rsplit_once(':') {
                Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host.to_string(),
                _ => h.to_string(),
            }
        }
    };
    Some(raw.trim_end_matches('.').to_ascii_lowercase())
}

fn refusal(status: StatusCode, why: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(format!("agentenv egress proxy: {why}\n")))
        .map_err(|never| match never {})
        .boxed();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r
}

fn bad_gateway(e: &EgressError) -> Response<Body> {
    refusal(StatusCode::BAD_GATEWAY, &e.to_string())
}

/// Carries the connection unchanged to its destination.
async fn splice<S>(mut io: S, to: SocketAddrV4, dial: Dialer) -> Result<(), EgressError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut up = timeout(CONNECT_DEADLINE, dial(to))
        .await
        .map_err(|_| EgressError::Slow(CONNECT_DEADLINE))?
        .map_err(EgressError::net("connect to the destination"))?;
    tokio::io::copy_bidirectional(&mut io, &mut up)
        .await
        .map_err(EgressError::net("splice"))?;
    Ok(())
}
