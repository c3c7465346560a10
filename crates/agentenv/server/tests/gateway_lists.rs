//! The gateway's merged list against a real etcd and two stand-in nodes (small HTTP servers that page
//! their sandboxes as `GET /v2/sandboxes` does): paging through the gateway yields every sandbox of
//! both nodes once, in start-time order, and a sandbox the map puts on another node is left out. A paused
//! sandbox whose node is down but still registered is answered from its handoff record.

use std::sync::Arc;
use std::time::Duration;

use agentenv_cluster::{ClusterStore, EntryState, SCHEMA_VERSION, SandboxEntry};
use axum::extract::{RawQuery, State};
use axum::response::IntoResponse;
use http_body_util::BodyExt;

/// (start ms, id) of one stand-in node's sandboxes.
type Listed = Arc<Vec<(i64, String)>>;

/// `GET /v2/sandboxes` as the server pages it: by (start, id), newest first unless `order=asc`,
/// `limit`, after `nextToken`.
async fn list(State(items): State<Listed>, RawQuery(q): RawQuery) -> axum::response::Response {
    let q: Vec<(String, String)> = form_urlencoded::parse(q.unwrap_or_default().as_bytes())
        .into_owned()
        .collect();
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let limit: usize = get("limit").and_then(|l| l.parse().ok()).unwrap_or(100);
    let after = get("nextToken").map(|t| {
        let (ms, id) = t.split_once('_').unwrap();
        (ms.parse::<i64>().unwrap(), id.to_string())
    });
    let asc = get("order").as_deref() == Some("asc");
    let mut sorted: Vec<&(i64, String)> = items.iter().collect();
    sorted.sort();
    if !asc {
        sorted.reverse();
    }
    let rest: Vec<&(i64, String)> = sorted
        .into_iter()
        .filter(|x| {
            after.as_ref().is_none_or(|a| {
                let k = (x.0, &x.1);
                if asc {
                    k > (a.0, &a.1)
                } else {
                    k < (a.0, &a.1)
                }
            })
        })
        .collect();
    let page: Vec<serde_json::Value> = rest
        .iter()
        .take(limit)
        .map(|(ms, id)| {
            serde_json::json!({"sandboxID": id, "startedAt": k3_common::time::rfc3339_from_unix_ms(*ms),
                "state": "running", "templateID": "base"})
        })
        .collect();
    let mut resp = axum::Json(page).into_response();
    if rest.len() > limit {
        let (ms, id) = rest[limit - 1];
        resp.headers_mut()
            .insert("x-next-token", format!("{ms}_{id}").parse().unwrap());
    }
    resp
}

async fn serve(router: axum::Router) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(axum::serve(l, router).into_future());
    format!("http://{addr}")
}

use agentenv_cluster::testing::idle_node as node;

/// A gateway over `store` (its state in `dir`), served on loopback: its URL and the server's key.
async fn gateway(dir: &std::path::Path, store: ClusterStore) -> (String, String) {
    let key = agentenv_server::keys::generate_api_key();
    let ring = Arc::new(agentenv_server::tenants::KeyRing::open(
        dir,
        key.clone(),
        Default::default(),
        None,
    ));
    let gw = agentenv_server::gateway::Gateway::new(store, ring, key.clone(), None);
    (serve(agentenv_server::gateway::app(gw)).await, key)
}

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<bytes::Bytes>,
>;

fn client() -> Client {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_through_the_gateway_merges_both_nodes_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = agentenv_cluster::testing::etcd_or_skip("gateway_lists", dir.path()) else {
        return;
    };
    // Interleaved start times; "moved" is listed by node a but the map puts it on node b.
    let a: Listed = Arc::new(
        [
            (1000, "a1"),
            (3000, "a3"),
            (5000, "a5"),
            (5000, "moved"),
            (7000, "a7"),
        ]
        .map(|(m, i)| (m, i.to_string()))
        .to_vec(),
    );
    let b: Listed = Arc::new(
        [
            (2000, "b2"),
            (4000, "b4"),
            (6000, "b6"),
            (8000, "b8"),
            (9000, "b9"),
        ]
        .map(|(m, i)| (m, i.to_string()))
        .to_vec(),
    );
    let url_a = serve(
        axum::Router::new()
            .route("/v2/sandboxes", axum::routing::get(list))
            .with_state(a),
    )
    .await;
    let url_b = serve(
        axum::Router::new()
            .route("/v2/sandboxes", axum::routing::get(list))
            .with_state(b),
    )
    .await;
    let store = ClusterStore::connect(
        std::slice::from_ref(&etcd.endpoint),
        "/t/lists",
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    let mut regs = vec![];
    for (id, url) in [("a", url_a), ("b", url_b)] {
        let rec = node(id, &url);
        regs.push(
            agentenv_cluster::testing::register(&store, rec)
                .await
                .unwrap(),
        );
    }
    let moved = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: "moved".into(),
        node: "b".into(),
        owner: "default".into(),
        state: EntryState::Running,
        handoff: None,
        updated_at_ms: 0,
        token_sha256: None,
    };
    assert!(store.insert_sandbox(&moved, "t").await.unwrap());

    let (base, key) = gateway(dir.path(), store).await;

    let client = client();
    let want = ["a1", "b2", "a3", "b4", "a5", "b6", "a7", "b8", "b9"];
    for order in ["", "&order=asc"] {
        let mut seen = vec![];
        let mut token: Option<String> = None;
        for _ in 0..10 {
            let q = match &token {
                Some(t) => format!("limit=3{order}&nextToken={t}"),
                None => format!("limit=3{order}"),
            };
            let req = hyper::Request::get(format!("{base}/v2/sandboxes?{q}"))
                .header("x-api-key", &key)
                .body(Default::default())
                .unwrap();
            let resp = client.request(req).await.unwrap();
            assert_eq!(resp.status(), 200);
            token = resp
                .headers()
                .get("x-next-token")
                .map(|v| v.to_str().unwrap().to_string());
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let page: Vec<serde_json::Value> = serde_json::from_slice(&body).unwrap();
            assert!(page.len() <= 3);
            seen.extend(
                page.iter()
                    .map(|s| s["sandboxID"].as_str().unwrap().to_string()),
            );
            if token.is_none() {
                break;
            }
        }
        // Newest first unless asked otherwise, as E2B lists.
        let mut expected = want.to_vec();
        if order.is_empty() {
            expected.reverse();
        }
        assert_eq!(seen, expected, "order {order:?}");
    }
    for r in regs {
        r.leave().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_on_a_down_but_registered_node_is_answered_from_its_record() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = agentenv_cluster::testing::etcd_or_skip("gateway_down", dir.path()) else {
        return;
    };
    let store = ClusterStore::connect(
        std::slice::from_ref(&etcd.endpoint),
        "/t/down",
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    // A port nothing listens on: the node died, its lease has not run out yet.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let reg = agentenv_cluster::testing::register(&store, node("gone", &dead))
        .await
        .unwrap();
    let token = format!("{:016x}", rand::random::<u64>());
    let entry = |id: &str, state, handoff| SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: id.into(),
        node: "gone".into(),
        owner: "default".into(),
        state,
        handoff,
        updated_at_ms: 0,
        token_sha256: None,
    };
    let record = serde_json::json!({"sandbox": {
        "version": 1, "sandbox_id": "p1", "template_id": "base", "alias": null,
        "metadata": {"k": token}, "env_vars": {}, "started_at_ms": 1000, "end_at_ms": 2000,
        "state": "running", "auto_pause": true, "auto_resume": false, "access_token": "t",
        "cpu_count": 2, "memory_mb": 512, "disk_mb": 1024, "envd_version": "0.2.0"},
        "network": null});
    let handoff = agentenv_cluster::Handoff {
        snapshot_id: "snap".into(),
        record,
    };
    assert!(
        store
            .insert_sandbox(&entry("p1", EntryState::Paused, Some(handoff)), "t")
            .await
            .unwrap()
    );
    assert!(
        store
            .insert_sandbox(&entry("r1", EntryState::Running, None), "t")
            .await
            .unwrap()
    );
    let (base, key) = gateway(dir.path(), store).await;
    let client = client();
    let get = |id: &str| {
        hyper::Request::get(format!("{base}/sandboxes/{id}"))
            .header("x-api-key", &key)
            .body(Default::default())
            .unwrap()
    };
    let resp = client.request(get("p1")).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let info: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(info["state"], "paused", "{info}");
    assert_eq!(info["metadata"]["k"], token.as_str(), "{info}");
    // A running one there is unreachable, said as such.
    let resp = client.request(get("r1")).await.unwrap();
    assert_eq!(resp.status(), 502);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        err["message"].as_str().unwrap().contains("unreachable"),
        "{err}"
    );
    reg.leave().await;
}
