//! Tenants through the HTTP app on the fake backend: each key sees and controls only its own sandboxes,
//! snapshots and templates, and has its own quota and request budget.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use crate::app::{self, AppState, ServerConfig};
use crate::fake::FakeBackend;
use crate::ratelimit::RateLimit;
use crate::sandboxes::{LifecycleConfig, Quota};
use crate::tenants;

mod matrix;
mod quotas;
mod uploads;
mod volumes;

struct Api {
    app: axum::Router,
}

impl Api {
    async fn call(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("x-api-key", key);
        let body = match body {
            Some(b) => {
                req = req.header("content-type", "application/json");
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        let resp = self
            .app
            .clone()
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let v = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}: {bytes:?}"))
        };
        if !status.is_success() {
            assert_eq!(v["code"].as_u64(), Some(u64::from(status.as_u16())), "{v}");
            assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        }
        (status, v)
    }

    async fn create(&self, key: &str, template: &str) -> (StatusCode, Value) {
        self.call(
            key,
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": template})),
        )
        .await
    }

    async fn ids(&self, key: &str) -> Vec<String> {
        self.listed(key.to_string(), "/v2/sandboxes", "sandboxID")
            .await
    }

    /// The `field` of every item `path` lists for `key`, sorted.
    async fn listed(&self, key: String, path: &str, field: &str) -> Vec<String> {
        let (st, v) = self.call(&key, Method::GET, path, None).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let mut ids: Vec<String> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s[field].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    }

    /// Snapshots `id` as `name` with `key`; returns the snapshot id.
    async fn snapshot(&self, key: &str, id: &str, name: &str) -> String {
        let (st, v) = self
            .call(
                key,
                Method::POST,
                &format!("/sandboxes/{id}/snapshots"),
                Some(json!({"name": name})),
            )
            .await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        assert_eq!(
            v["names"],
            json!([format!("{name}:default")]),
            "a tenant sees its names as it wrote them"
        );
        v["snapshotID"].as_str().unwrap().to_string()
    }
}

async fn open(dir: &std::path::Path, rate: Option<RateLimit>) -> (Api, String) {
    let default_key = crate::keys::generate_api_key();
    let state = AppState::open(
        Arc::new(FakeBackend::default()),
        ServerConfig {
            state_dir: dir.to_path_buf(),
            api_key: default_key.clone(),
            max_upload_bytes: 1 << 20,
            lifecycle: LifecycleConfig::default(),
            rate_limit: rate,
        },
    )
    .await
    .unwrap();
    (
        Api {
            app: app::app(state),
        },
        default_key,
    )
}

fn key(dir: &std::path::Path, name: &str, quota: Quota) -> String {
    tenants::create_key(dir, name, quota).unwrap().0
}

#[tokio::test]
async fn snapshots_and_templates_are_per_key_and_names_never_collide() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin) = open(dir.path(), None).await;
    let (a, b) = (
        key(dir.path(), "alpha", Quota::default()),
        key(dir.path(), "beta", Quota::default()),
    );
    let sbx = |v: Value| v["sandboxID"].as_str().unwrap().to_string();
    let sa = sbx(api.create(&a, "base").await.1);
    let sb = sbx(api.create(&b, "base").await.1);
    let snap_a = api.snapshot(&a, &sa, "app").await;
    let snap_b = api.snapshot(&b, &sb, "app").await;
    let listed = |k: &str| api.listed(k.to_string(), "/snapshots", "snapshotID");
    assert_eq!(listed(&a).await, vec![snap_a.clone()]);
    assert_eq!(listed(&b).await, vec![snap_b.clone()]);
    assert!(listed(&admin).await.is_empty());

    // "app" is each tenant's own: a create from it starts from that tenant's snapshot.
    let (st, v) = api.create(&b, "app").await;
    assert_eq!(
        (st, v["templateID"].as_str()),
        (StatusCode::CREATED, Some(snap_b.as_str()))
    );
    let (st, _) = api.create(&admin, "app").await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _) = api.create(&b, &snap_a).await;
    assert_eq!(
        st,
        StatusCode::NOT_FOUND,
        "another tenant's snapshot id is unknown"
    );
    let (st, _) = api
        .call(&b, Method::DELETE, &format!("/templates/{snap_a}"), None)
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _) = api.call(&b, Method::DELETE, "/templates/app", None).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    assert_eq!(
        listed(&a).await,
        vec![snap_a.clone()],
        "alpha's app survives"
    );
    let (st, _) = api
        .call(
            &a,
            Method::POST,
            &format!("/sandboxes/{sa}/snapshots"),
            Some(json!({"name": "x..y"})),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);

    // Templates built through the API are their builder's; the base is everyone's.
    let (st, v) = api
        .call(
            &a,
            Method::POST,
            "/templates",
            Some(json!({"templateID": "alpha-tpl"})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let tpl_ids = |k: &str| api.listed(k.to_string(), "/templates", "templateID");
    assert_eq!(tpl_ids(&a).await, vec!["alpha-tpl", "base"]);
    assert_eq!(tpl_ids(&b).await, vec!["base"]);
    assert_eq!(api.create(&a, "alpha-tpl").await.0, StatusCode::CREATED);
    assert_eq!(api.create(&b, "alpha-tpl").await.0, StatusCode::NOT_FOUND);
}

/// Security: no tenant can rebuild a shared template or another tenant's, nor take over another
/// tenant's unnamed snapshot by starting from its id.
#[tokio::test]
async fn templates_and_unnamed_snapshots_cannot_be_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin) = open(dir.path(), None).await;
    let (a, b) = (
        key(dir.path(), "alpha", Quota::default()),
        key(dir.path(), "beta", Quota::default()),
    );
    let build = |k: String, body: Value| {
        let api = &api;
        async move { api.call(&k, Method::POST, "/templates", Some(body)).await }
    };
    let (st, v) = build(b.clone(), json!({"templateID": "base", "memoryMB": 192})).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    assert!(v["message"].as_str().unwrap().contains("read-only"), "{v}");
    let (st, v) = build(
        a.clone(),
        json!({"templateID": "alpha-tpl", "memoryMB": 512}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    for body in [
        json!({"templateID": "alpha-tpl", "memoryMB": 128}),
        json!({"templateID": "beta-tpl", "aliases": ["alpha-tpl"]}),
    ] {
        let (st, v) = build(b.clone(), body).await;
        assert_eq!(
            st,
            StatusCode::NOT_FOUND,
            "another tenant's template is unknown: {v}"
        );
    }
    let (st, v) = build(
        b.clone(),
        json!({"templateID": "beta-tpl", "aliases": ["base"]}),
    )
    .await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
    let tpl = |k: String| {
        let api = &api;
        async move {
            let (_, v) = api.call(&k, Method::GET, "/templates", None).await;
            v.as_array().unwrap().clone()
        }
    };
    let mine = tpl(a.clone()).await;
    let alpha = mine
        .iter()
        .find(|t| t["templateID"] == "alpha-tpl")
        .unwrap();
    assert_eq!(alpha["memoryMB"], 512, "alpha's template is unchanged");
    assert!(
        tpl(b.clone())
            .await
            .iter()
            .all(|t| t["templateID"] != "beta-tpl")
    );
    // Its owner may rebuild it.
    let (st, v) = build(
        a.clone(),
        json!({"templateID": "alpha-tpl", "memoryMB": 384}),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");

    // An unnamed snapshot stays its maker's whoever starts from its id.
    let sa = api.create(&a, "base").await.1["sandboxID"]
        .as_str()
        .unwrap()
        .to_string();
    let (st, v) = api
        .call(
            &a,
            Method::POST,
            &format!("/sandboxes/{sa}/snapshots"),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let snap = v["snapshotID"].as_str().unwrap().to_string();
    for k in [&b, &admin] {
        let (st, v) = api.create(k, &snap).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
    }
    let listed = api.listed(a.clone(), "/snapshots", "snapshotID").await;
    assert_eq!(
        listed,
        vec![snap.clone()],
        "alpha keeps its unnamed snapshot"
    );
    assert!(
        api.listed(b.clone(), "/snapshots", "snapshotID")
            .await
            .is_empty()
    );
    assert_eq!(api.create(&a, &snap).await.0, StatusCode::CREATED);
}

/// Security: the host-only envd paths stay host-only whatever spelling of envd's port a client uses.
#[tokio::test]
async fn host_only_envd_paths_are_refused_for_every_spelling_of_the_envd_port() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin) = open(dir.path(), None).await;
    let (_, v) = api.create(&admin, "base").await;
    let (id, token) = (
        v["sandboxID"].as_str().unwrap().to_string(),
        v["envdAccessToken"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    );
    for path in agentenv_envd::paths::HOST_ONLY {
        for port in ["49983", "049983", "0049983", "+49983"] {
            let req = Request::builder()
                .method(Method::POST)
                .uri(path)
                .header("e2b-sandbox-id", &id)
                .header("e2b-sandbox-port", port)
                .header("x-access-token", &token)
                .body(Body::from("{}"))
                .unwrap();
            let resp = api.app.clone().oneshot(req).await.unwrap();
            assert_eq!(
                resp.status(),
                StatusCode::FORBIDDEN,
                "{path} on port {port:?}"
            );
        }
    }
}

#[tokio::test]
async fn each_key_has_its_own_quota_and_request_budget() {
    let dir = tempfile::tempdir().unwrap();
    let burst = rand::random_range(20..40);
    let (api, admin) = open(
        dir.path(),
        Some(RateLimit {
            per_second: 0.001,
            burst: burst as f64,
        }),
    )
    .await;
    let max = rand::random_range(1..4);
    let a = key(
        dir.path(),
        "alpha",
        Quota {
            max_running: Some(max),
            ..Default::default()
        },
    );
    let b = key(dir.path(), "beta", Quota::default());
    for _ in 0..max {
        assert_eq!(api.create(&a, "base").await.0, StatusCode::CREATED);
    }
    let (st, v) = api.create(&a, "base").await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(v["message"].as_str().unwrap().contains("key alpha"), "{v}");
    // Others are not held to alpha's quota.
    for _ in 0..=max {
        assert_eq!(api.create(&b, "base").await.0, StatusCode::CREATED);
    }
    // alpha spends its own budget; beta and the server key keep theirs.
    let mut limited = false;
    for _ in 0..burst {
        let (st, _) = api.call(&a, Method::GET, "/v2/sandboxes", None).await;
        limited |= st == StatusCode::TOO_MANY_REQUESTS;
    }
    assert!(limited, "alpha ran out of requests");
    assert_eq!(
        api.call(&b, Method::GET, "/v2/sandboxes", None).await.0,
        StatusCode::OK
    );
    assert_eq!(
        api.call(&admin, Method::GET, "/v2/sandboxes", None).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn network_options_are_checked_shown_and_replaced_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin) = open(dir.path(), None).await;
    let other = key(dir.path(), "other", Quota::default());
    let body = json!({"templateID": "base", "network": {"allowOut": ["allowed.test", "10.1.2.3/8"], "denyOut": ["0.0.0.0/0"]}});
    let (st, v) = api
        .call(&admin, Method::POST, "/v2/sandboxes", Some(body))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let (st, v) = api
        .call(&admin, Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["allowInternetAccess"], json!(false));
    assert_eq!(
        v["network"]["allowOut"],
        json!(["allowed.test", "10.0.0.0/8"])
    );
    assert_eq!(v["network"]["denyOut"], json!(["0.0.0.0/0"]));
    for bad in [
        json!({"allowOut": ["not a name!"]}),
        json!({"denyOut": ["::1"]}),
        json!({"allowOut": ["x.test"], "dnsServers": ["nope"]}),
    ] {
        let (st, v) = api
            .call(
                &admin,
                Method::PUT,
                &format!("/sandboxes/{id}/network"),
                Some(bad.clone()),
            )
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{bad}: {v}");
        let mut create = json!({"templateID": "base"});
        create["network"] = bad.clone();
        let (st, _) = api
            .call(&admin, Method::POST, "/v2/sandboxes", Some(create))
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "create with {bad}");
    }
    // Another key's sandbox is unknown to it; the owner's update replaces every rule.
    let (st, _) = api
        .call(
            &other,
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(json!({})),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, v) = api
        .call(
            &admin,
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(json!({"allowInternetAccess": true})),
        )
        .await;
    assert_eq!(st, StatusCode::NO_CONTENT, "{v}");
    let (_, v) = api
        .call(&admin, Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(v["allowInternetAccess"], json!(true));
    assert_eq!(v["network"]["allowOut"], json!([]));
    let (st, _) = api
        .call(
            &admin,
            Method::PUT,
            "/sandboxes/nope/network",
            Some(json!({})),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

/// `POST /templates` with `Accept: application/x-ndjson`: progress lines (the pull's bytes rising to its
/// total), then the template; a build that fails ends the stream with a typed error line.
#[tokio::test]
async fn template_builds_stream_their_progress_as_ndjson() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin) = open(dir.path(), None).await;
    let id = format!("tpl-{:x}", rand::random::<u32>());
    let build = |id: String| {
        let req = Request::builder()
            .method(Method::POST)
            .uri("/templates")
            .header("x-api-key", &admin)
            .header("content-type", "application/json")
            .header("accept", "application/x-ndjson")
            .body(Body::from(json!({"templateID": id}).to_string()))
            .unwrap();
        api.app.clone().oneshot(req)
    };
    let lines = |bytes: &[u8]| -> Vec<Value> {
        String::from_utf8_lossy(bytes)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    };
    let resp = build(id.clone()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let v = lines(
        &axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap(),
    );
    let pulled: Vec<(u64, u64)> = v
        .iter()
        .filter(|l| l["step"] == "pull")
        .map(|l| {
            (
                l["bytesDone"].as_u64().unwrap(),
                l["bytesTotal"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(pulled.len() >= 2, "{v:?}");
    assert!(pulled.windows(2).all(|w| w[0].0 <= w[1].0));
    assert_eq!(pulled.last().unwrap().0, pulled.last().unwrap().1);
    assert!(
        v.iter()
            .any(|l| l["step"] == "boot" && l.get("bytesDone").is_none())
    );
    assert_eq!(
        v.last().unwrap()["template"]["templateID"],
        id.as_str(),
        "{v:?}"
    );
    // The built-in base: the fake refuses to rebuild it, and the stream ends with the error.
    let resp = build("base".into()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v = lines(
        &axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap(),
    );
    let end = v.last().unwrap();
    assert_eq!(end["error"]["code"], 400, "{v:?}");
    assert!(
        end["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("base"))
    );
    // Without the header: one JSON answer, as before.
    let (st, t) = api
        .call(
            &admin,
            Method::POST,
            "/templates",
            Some(json!({"templateID": format!("{id}-b")})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{t}");
}
