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
            let cfg = agentenv_cluster::node_tls::server_config(&t.cert, &t.key).unwrap();
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
    let ca = agentenv_cluster::node_tls::client_config(&tls_b.ca).unwrap();
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
