//! The proxy between a real TLS client and real TLS and HTTP servers, over loopback and pipes.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use agentenv_vm::{EgressPolicy, HeaderRule, Target};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rand::Rng;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::hello::{Hello, classify};
use super::*;

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

fn token() -> String {
    let n: u64 = rand::rng().random();
    format!("t-{n:016x}")
}

/// A TLS client trusting `roots` only.
fn client_config(roots: rustls::RootCertStore) -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// The bytes a real rustls client opens with for `name`.
fn client_hello(name: &str) -> Vec<u8> {
    let cfg = client_config(rustls::RootCertStore::empty());
    let sn = ServerName::try_from(name.to_string()).unwrap();
    let mut c = rustls::ClientConnection::new(Arc::new(cfg), sn).unwrap();
    let mut out = Vec::new();
    c.write_tls(&mut out).unwrap();
    out
}

#[test]
fn hellos_classify_by_their_first_bytes_and_garbage_never_panics() {
    let name = format!("{}.api.example.test", token());
    let h = client_hello(&name);
    assert_eq!(classify(&h), Some(Hello::Tls { sni: Some(name) }));
    for cut in 0..h.len() {
        assert_eq!(classify(&h[..cut]), None, "a cut hello waits for more");
    }
    let req = b"GET /x HTTP/1.1\r\nUser-Agent: c\r\nhOsT: Sbx.Test:8443\r\n\r\n";
    assert_eq!(
        classify(req),
        Some(Hello::Http {
            host: Some("sbx.test".into())
        })
    );
    assert_eq!(classify(&req[..20]), None);
    assert_eq!(classify(b"\x00\x01"), Some(Hello::Other));
    let mut rng = rand::rng();
    for _ in 0..2000 {
        let n = rng.random_range(0..64);
        let mut junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        if !junk.is_empty() && rng.random_bool(0.5) {
            junk[0] = 0x16;
        }
        let _ = classify(&junk);
    }
}

#[test]
fn the_ca_persists_and_its_leaves_chain_to_the_stored_certificate() {
    use rustls::client::danger::ServerCertVerifier;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let a = Ca::load_or_create(dir.path()).unwrap();
    let b = Ca::load_or_create(dir.path()).unwrap();
    assert_eq!(a.pem(), b.pem());
    let mode = std::fs::metadata(dir.path().join("ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // A leaf of the reloaded CA verifies under the first one's certificate.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der(a.pem())).unwrap();
    let leaf = b.leaf("x.example.test").unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    let now = rustls::pki_types::UnixTime::now();
    let sn = ServerName::try_from("x.example.test").unwrap();
    verifier
        .verify_server_cert(&leaf.cert[0], &[], &sn, &[], now)
        .unwrap();
    let other = ServerName::try_from("y.example.test").unwrap();
    assert!(
        verifier
            .verify_server_cert(&leaf.cert[0], &[], &other, &[], now)
            .is_err()
    );
}

/// An HTTP server that answers each request with `<path> <X-Test-Token> <Host> <body>`.
async fn echo(req: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let h = |k: &str| {
        req.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string()
    };
    let head = format!("{} {} {}", req.uri().path(), h("x-test-token"), h("host"));
    let body = req.into_body().collect().await?.to_bytes();
    let text = format!("{head} {}", String::from_utf8_lossy(&body));
    Ok(Response::new(Full::new(Bytes::from(text))))
}

fn serve_echo<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: S) {
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(echo);
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), svc)
            .await;
    });
}

/// A TLS echo server for `name` under `ca`, on loopback.
async fn tls_upstream(ca: Arc<Ca>, name: &str) -> SocketAddrV4 {
    let leaf = ca.leaf(name).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(One(leaf)));
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = match l.local_addr().unwrap() {
        std::net::SocketAddr::V4(a) => a,
        _ => unreachable!(),
    };
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(t) = acceptor.accept(s).await {
                    serve_echo(t);
                }
            });
        }
    });
    addr
}

#[derive(Debug)]
struct One(Arc<rustls::sign::CertifiedKey>);
impl rustls::server::ResolvesServerCert for One {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

fn loopback_dialer(log: Arc<std::sync::Mutex<Vec<SocketAddrV4>>>) -> Dialer {
    Arc::new(move |to| {
        log.lock().unwrap().push(to);
        Box::pin(TcpStream::connect(to))
    })
}

/// A guest's HTTPS request for `name` through `proxy` over a pipe; the answer's body, or `None`
/// when the connection failed.
async fn guest_get(
    proxy: Arc<Proxy>,
    flow: Flow,
    policy: EgressPolicy,
    dial: Dialer,
    name: &str,
    sent_token: &str,
    body: &str,
) -> Option<String> {
    guest_request(proxy, flow, policy, dial, name, name, sent_token, body)
        .await
        .map(|(_, text)| text)
}

/// As [`guest_get`], with `host` as the request's `Host` (TLS still names `name`); the status too.
#[allow(clippy::too_many_arguments)]
async fn guest_request(
    proxy: Arc<Proxy>,
    flow: Flow,
    policy: EgressPolicy,
    dial: Dialer,
    name: &str,
    host: &str,
    sent_token: &str,
    body: &str,
) -> Option<(u16, String)> {
    let (guest, proxy_end) = tokio::io::duplex(64 * 1024);
    let task = tokio::spawn(proxy.clone().handle(proxy_end, flow, policy, dial));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der(proxy.ca().pem())).unwrap();
    let cfg = client_config(roots);
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from(name.to_string()).unwrap(), guest)
        .await
        .ok()?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .ok()?;
    tokio::spawn(conn);
    let req = Request::post("/echo")
        .header("host", host)
        .header("x-test-token", sent_token)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = send.send_request(req).await.ok()?;
    let status = resp.status().as_u16();
    let text = resp.into_body().collect().await.ok()?.to_bytes();
    drop(send);
    let _ = task.await;
    Some((status, String::from_utf8_lossy(&text).into_owned()))
}

fn rule(key: &str, value: &str) -> HeaderRule {
    HeaderRule::new(key, vec![("X-Test-Token".into(), value.into())]).unwrap()
}

#[tokio::test]
async fn a_ruled_https_request_is_intercepted_and_gets_the_rules_headers() {
    let upstream_ca = Arc::new(Ca::ephemeral().unwrap());
    let name = format!("{}.api.example.test", token());
    let up = tls_upstream(upstream_ca.clone(), &name).await;
    let proxy = Arc::new(
        Proxy::new(
            Arc::new(Ca::ephemeral().unwrap()),
            &[der(upstream_ca.pem())],
        )
        .unwrap(),
    );
    let (injected, body) = (token(), token());
    let policy = EgressPolicy::default()
        .with_rules(vec![rule(&name, &injected)])
        .unwrap();
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let flow = Flow {
        original: up,
        to_gateway: false,
    };
    let got = guest_get(
        proxy.clone(),
        flow,
        policy,
        loopback_dialer(log.clone()),
        &name,
        "from-guest",
        &body,
    )
    .await
    .expect("intercepted request answered");
    assert_eq!(got, format!("/echo {injected} {name} {body}"));
    assert_eq!(
        *log.lock().unwrap(),
        vec![up],
        "went to the original destination"
    );
    // Without a rule for the name, the guest's TLS goes through unchanged: it then meets the
    // destination's certificate, which it does not trust, and fails.
    let other = EgressPolicy::default()
        .with_rules(vec![rule("other.test", "x")])
        .unwrap();
    let got = guest_get(
        proxy,
        flow,
        other,
        loopback_dialer(log.clone()),
        &name,
        "g",
        &body,
    )
    .await;
    assert_eq!(
        got, None,
        "spliced, so the guest sees the destination's own certificate"
    );
    assert_eq!(log.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn the_sandbox_domain_is_served_through_the_hairpin_under_the_policy() {
    let hairpin: Hairpin = Arc::new(serve_echo);
    let proxy = Arc::new(
        Proxy::new(Arc::new(Ca::ephemeral().unwrap()), &[])
            .unwrap()
            .with_hairpin("Sbx.Test", hairpin),
    );
    assert!(proxy.is_local("8080-abc.sbx.test") && !proxy.is_local("xsbx.test"));
    let name = format!("8080-{}.sbx.test", token());
    let (injected, body) = (token(), token());
    let flow = Flow {
        original: SocketAddrV4::new(Ipv4Addr::new(10, 200, 0, 1), 3000),
        to_gateway: true,
    };
    let never: Dialer = Arc::new(|_| Box::pin(async { Err(std::io::Error::other("no dialing")) }));
    let keyed = EgressPolicy::default()
        .with_rules(vec![rule(&format!("{name}:3000"), &injected)])
        .unwrap();
    let got = guest_get(proxy.clone(), flow, keyed, never.clone(), &name, "g", &body).await;
    assert_eq!(got.unwrap(), format!("/echo {injected} {name} {body}"));
    // No rule: the request passes as sent.
    let got = guest_get(
        proxy.clone(),
        flow,
        EgressPolicy::default(),
        never.clone(),
        &name,
        "g",
        &body,
    )
    .await;
    assert_eq!(got.unwrap(), format!("/echo g {name} {body}"));
    // A request on that connection for another host (the server's API, say) is refused.
    let (status, text) = guest_request(
        proxy.clone(),
        flow,
        EgressPolicy::default(),
        never.clone(),
        &name,
        "127.0.0.1:3000",
        "g",
        &body,
    )
    .await
    .unwrap();
    assert_eq!(status, 421, "{text}");
    // Internet off, or another name at the gateway: refused.
    let closed = EgressPolicy::new(false, vec![], vec![]).unwrap();
    assert_eq!(
        guest_get(
            proxy.clone(),
            flow,
            closed,
            never.clone(),
            &name,
            "g",
            &body
        )
        .await,
        None
    );
    let allowed =
        EgressPolicy::new(false, vec![Target::parse("*.sbx.test").unwrap()], vec![]).unwrap();
    assert!(
        guest_get(
            proxy.clone(),
            flow,
            allowed,
            never.clone(),
            &name,
            "g",
            &body
        )
        .await
        .is_some()
    );
    let (mut guest, end) = tokio::io::duplex(64 * 1024);
    let t = tokio::spawn(proxy.handle(end, flow, EgressPolicy::default(), never));
    guest
        .write_all(b"GET / HTTP/1.1\r\nHost: api.example.test\r\n\r\n")
        .await
        .unwrap();
    assert!(matches!(t.await.unwrap(), Err(EgressError::Refused(_))));
}

#[tokio::test]
async fn unruled_bytes_are_spliced_unchanged_and_a_silent_guest_times_out() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let std::net::SocketAddr::V4(up) = l.local_addr().unwrap() else {
        unreachable!()
    };
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    let proxy = Arc::new(Proxy::new(Arc::new(Ca::ephemeral().unwrap()), &[]).unwrap());
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (mut guest, end) = tokio::io::duplex(1 << 16);
    let flow = Flow {
        original: up,
        to_gateway: false,
    };
    tokio::spawn(
        proxy
            .clone()
            .handle(end, flow, EgressPolicy::default(), loopback_dialer(log)),
    );
    let mut data = b"PUT / HTTP/1.1\r\nHost: a.test\r\n\r\n".to_vec();
    data.extend((0..40_000).map(|_| rand::random::<u8>()));
    guest.write_all(&data).await.unwrap();
    let mut back = vec![0u8; data.len()];
    guest.read_exact(&mut back).await.unwrap();
    assert_eq!(back, data);
    tokio::time::pause();
    let (_quiet, end) = tokio::io::duplex(1024);
    let never: Dialer = Arc::new(|_| Box::pin(async { Err(std::io::Error::other("no")) }));
    let r = proxy
        .handle(end, flow, EgressPolicy::default(), never)
        .await;
    assert!(matches!(r, Err(EgressError::Slow(_))), "{r:?}");
}
