//! Gateway-to-node HTTPS against a real etcd, real certificates (`openssl`) and stand-in nodes served by
//! the node's own TLS listener: with `--node-ca` a gateway reaches a node only when the node's
//! certificate names the node id its record has; an impostor at a node's address (the cluster's CA, but
//! another node's certificate) and a plain-HTTP node get no request, and the client a JSON 502.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentenv_cluster::testing::idle_node;
use agentenv_cluster::{ClusterStore, EntryState, SCHEMA_VERSION, SandboxEntry};
use http_body_util::BodyExt;

/// A stand-in node's `GET /sandboxes/{id}`: counts calls and answers with the id.
async fn detail(
    axum::extract::State(hits): axum::extract::State<Arc<AtomicUsize>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> axum::Json<serde_json::Value> {
    hits.fetch_add(1, Ordering::SeqCst);
    axum::Json(serde_json::json!({"sandboxID": id, "templateID": "base", "state": "running"}))
}

/// Serves a stand-in node, over TLS with `tls`; its base URL and call counter.
async fn stand_in(tls: Option<&agentenv_cluster::EtcdTls>) -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let router = axum::Router::new()
        .route("/sandboxes/{id}", axum::routing::get(detail))
        .with_state(hits.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    match tls {
        Some(t) => {
            let cfg = agentenv_cluster::node_tls::server_config(&t.cert, &t.key, None).unwrap();
            let l = agentenv_server::tls_listener::TlsListener::new(l, cfg).unwrap();
            tokio::spawn(axum::serve(l, router).into_future());
            (format!("https://{addr}"), hits)
        }
        None => {
            tokio::spawn(axum::serve(l, router).into_future());
            (format!("http://{addr}"), hits)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_reaches_only_the_node_its_certificate_names() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = agentenv_cluster::testing::etcd_or_skip("gateway_tls", dir.path()) else {
        return;
    };
    let pki = agentenv_cluster::testing::Pki::new(&dir.path().join("pki"))
        .expect("openssl (ci/setup.sh installs it)");
    let (tls_a, tls_b) = (pki.issue("node-a").unwrap(), pki.issue("node-b").unwrap());
    // node-a honest; at node-b's address an impostor with node-a's certificate; node-c plain HTTP.
    let (url_a, hits_a) = stand_in(Some(&tls_a)).await;
    let (url_b, hits_b) = stand_in(Some(&tls_a)).await;
    let (url_c, hits_c) = stand_in(None).await;
    let prefix = format!("/t/tls-{:08x}/", rand::random::<u32>());
    let store = ClusterStore::connect(
        std::slice::from_ref(&etcd.endpoint),
        &prefix,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let mut regs = vec![];
    for (id, url) in [("node-a", &url_a), ("node-b", &url_b), ("node-c", &url_c)] {
        let rec = idle_node(id, url);
        regs.push(
            agentenv_cluster::testing::register(&store, rec)
                .await
                .unwrap(),
        );
        let entry = SandboxEntry {
            version: SCHEMA_VERSION,
            sandbox_id: format!("sbx-{id}"),
            node: id.into(),
            owner: "default".into(),
            state: EntryState::Running,
            handoff: None,
            updated_at_ms: 0,
            token_sha256: None,
        };
        assert!(
            store
                .insert_sandbox(&entry, &format!("t-{id}"))
                .await
                .unwrap()
        );
    }
    let key = agentenv_server::keys::generate_api_key();
    let ring = Arc::new(agentenv_server::tenants::KeyRing::open(
        dir.path(),
        key.clone(),
        Default::default(),
        None,
    ));
    let ca = agentenv_cluster::node_tls::client_config(&tls_b.ca, None).unwrap();
    let gw = agentenv_server::gateway::Gateway::new(store, ring, key.clone(), Some(ca));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(axum::serve(l, agentenv_server::gateway::app(gw)).into_future());
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let get = async |id: &str| {
        let req = hyper::Request::get(format!("{base}/sandboxes/sbx-{id}"))
            .header("x-api-key", &key)
            .body(Default::default())
            .unwrap();
        let resp = client.request(req).await.unwrap();
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
        )
    };
    // The gateway's view of the nodes comes from a watch: wait for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (status, body) = loop {
        let (status, body) = get("node-a").await;
        if status == 200 || std::time::Instant::now() > deadline {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (status, &body["sandboxID"]),
        (200, &"sbx-node-a".into()),
        "{body}"
    );
    assert_eq!(hits_a.load(Ordering::SeqCst), 1);

    let (status, body) = get("node-b").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["code"], 502, "{body}");
    let msg = body["message"].as_str().unwrap();
    assert!(
        msg.contains("node-b") && msg.contains("certificate"),
        "{msg}"
    );
    let (status, body) = get("node-c").await;
    assert_eq!(status, 502, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("not HTTPS"),
        "{body}"
    );
    assert_eq!(
        hits_b.load(Ordering::SeqCst),
        0,
        "the impostor got a request"
    );
    assert_eq!(
        hits_c.load(Ordering::SeqCst),
        0,
        "the plain node got a request"
    );
    for r in regs {
        r.leave().await;
    }
}

/// One request to `addr` over TLS as `cfg`'s client (its certificate or none), the node's name
/// `node-a`: its status, or `None` when the handshake fails.
async fn call_as(
    cfg: Arc<rustls::ClientConfig>,
    addr: std::net::SocketAddr,
    req: hyper::Request<http_body_util::Full<bytes::Bytes>>,
) -> Option<(u16, serde_json::Value)> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("node-a").unwrap();
    let tls = tokio_rustls::TlsConnector::from(cfg)
        .connect(name, tcp)
        .await
        .ok()?;
    let io = hyper_util::rt::TokioIo::new(tls);
    let (mut send, conn) = hyper::client::conn::http1::handshake(io).await.ok()?;
    tokio::spawn(conn);
    // TLS 1.3 reports a refused client certificate only on the first read.
    let resp = send.send_request(req).await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, serde_json::from_slice(&body).unwrap_or_default()))
}

/// A node given the gateways' CA (`--gateway-ca`) takes the tenant a gateway asserts only on a
/// connection whose certificate (of that CA) names `gateway.agentenv.internal`: no certificate, a
/// node's certificate of the same CA, or a gateway-named one of another CA gets no tenant, while a
/// client with a key of the node's is still served. The asserted tenant is the one acted for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_takes_an_asserted_tenant_only_from_a_gateways_certificate() {
    use agentenv_cluster::node_tls::{GATEWAY_NAME, client_config, server_config};
    let dir = tempfile::tempdir().unwrap();
    let Ok(pki) = agentenv_cluster::testing::Pki::new(&dir.path().join("pki")) else {
        assert!(
            !agentenv_cluster::testing::cluster_required(),
            "openssl is missing (ci/setup.sh installs it)"
        );
        eprintln!("skipping: no openssl");
        return;
    };
    let other = agentenv_cluster::testing::Pki::new(&dir.path().join("other")).unwrap();
    let (node, node_b, gw) = (
        pki.issue("node-a").unwrap(),
        pki.issue("node-b").unwrap(),
        pki.issue(GATEWAY_NAME).unwrap(),
    );
    let forged = other.issue(GATEWAY_NAME).unwrap();

    let state_dir = dir.path().join("node");
    let node_key = agentenv_server::keys::generate_api_key();
    let tenant = format!("t{:06x}", rand::random::<u32>() & 0xff_ffff);
    agentenv_server::tenants::create_key(&state_dir, &tenant, Default::default()).unwrap();
    let state = agentenv_api::app::AppState::open(
        Arc::new(agentenv_control::fake::FakeBackend::default()),
        agentenv_api::app::ServerConfig {
            state_dir: state_dir.clone(),
            api_key: node_key.clone(),
            max_upload_bytes: 1 << 20,
            lifecycle: Default::default(),
            rate_limit: None,
        },
    )
    .await
    .unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let cfg = server_config(&node.cert, &node.key, Some(&node.ca)).unwrap();
    let l = agentenv_server::tls_listener::TlsListener::new(l, cfg).unwrap();
    let app = agentenv_api::app::app(state)
        .into_make_service_with_connect_info::<agentenv_api::conn::Conn>();
    tokio::spawn(axum::serve(l, app).into_future());

    let as_gateway = client_config(&node.ca, Some((&gw.cert, &gw.key))).unwrap();
    let as_node_b = client_config(&node.ca, Some((&node_b.cert, &node_b.key))).unwrap();
    let as_forged = client_config(&node.ca, Some((&forged.cert, &forged.key))).unwrap();
    let anonymous = client_config(&node.ca, None).unwrap();
    let req = |method: &str, path: &str, headers: &[(&str, &str)], body: &str| {
        let mut b = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "node-a")
            .header("content-type", "application/json");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_owned(),
        )))
        .unwrap()
    };
    let list = |h: &[(&str, &str)]| req("GET", "/v2/sandboxes", h, "");
    let t = tenant.as_str();

    // The gateway acts for the tenant: a create as it is listed for it, not for the operator.
    let (st, made) = call_as(
        as_gateway.clone(),
        addr,
        req(
            "POST",
            "/sandboxes",
            &[("x-agentenv-tenant", t)],
            r#"{"templateID":"base"}"#,
        ),
    )
    .await
    .unwrap();
    assert_eq!(st, 201, "{made}");
    let id = made["sandboxID"].as_str().unwrap().to_string();
    let ids = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s["sandboxID"].as_str().unwrap().to_string())
            .collect()
    };
    let (st, mine) = call_as(as_gateway.clone(), addr, list(&[("x-agentenv-tenant", t)]))
        .await
        .unwrap();
    assert_eq!((st, ids(&mine)), (200, vec![id.clone()]));
    let (st, ops) = call_as(
        as_gateway.clone(),
        addr,
        list(&[("x-agentenv-tenant", "default")]),
    )
    .await
    .unwrap();
    assert_eq!(st, 200, "{ops}");
    assert!(
        ids(&ops).is_empty(),
        "the operator's list is its own: {ops}"
    );
    // An unknown tenant, or no assertion and no key: 401.
    for h in [&[("x-agentenv-tenant", "nobody")][..], &[][..]] {
        let (st, body) = call_as(as_gateway.clone(), addr, list(h)).await.unwrap();
        assert_eq!(st, 401, "{h:?}: {body}");
    }
    // Not a gateway: no certificate, a node's, a gateway-named one of another CA.
    for (who, cfg) in [("anonymous", &anonymous), ("node-b", &as_node_b)] {
        let (st, body) = call_as(cfg.clone(), addr, list(&[("x-agentenv-tenant", t)]))
            .await
            .unwrap();
        assert_eq!(st, 401, "{who}: {body}");
        assert!(
            body["message"].as_str().unwrap().contains("gateway"),
            "{body}"
        );
    }
    assert_eq!(
        call_as(as_forged, addr, list(&[("x-agentenv-tenant", t)])).await,
        None,
        "a certificate of another CA fails the handshake"
    );
    // A client with a key of the node's own is still served (and sees the operator's list).
    let (st, body) = call_as(anonymous, addr, list(&[("x-api-key", &node_key)]))
        .await
        .unwrap();
    assert_eq!(st, 200, "{body}");
}
