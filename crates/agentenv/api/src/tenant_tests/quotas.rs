//! Snapshot quotas through the HTTP app: a key past its snapshots' count or bytes gets 429, any key
//! past the server's stored-bytes budget 507, each with a JSON body.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::{Api, key};
use crate::app::{self, AppState, ServerConfig};
use crate::fake::FakeBackend;
use crate::sandboxes::{LifecycleConfig, Quota};

async fn open(
    dir: &std::path::Path,
    lifecycle: LifecycleConfig,
) -> (Api, String, Arc<FakeBackend>) {
    let fake = Arc::new(FakeBackend::default());
    let default_key = crate::keys::generate_api_key();
    let state = AppState::open(
        fake.clone(),
        ServerConfig {
            state_dir: dir.to_path_buf(),
            api_key: default_key.clone(),
            max_upload_bytes: 1 << 20,
            lifecycle,
            rate_limit: None,
        },
    )
    .await
    .unwrap();
    let api = Api {
        app: app::app(state),
    };
    (api, default_key, fake)
}

async fn sandbox(api: &Api, key: &str) -> String {
    let (st, v) = api.create(key, "base").await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    v["sandboxID"].as_str().unwrap().to_string()
}

async fn snapshot(api: &Api, key: &str, id: &str) -> (StatusCode, Value) {
    let path = format!("/sandboxes/{id}/snapshots");
    api.call(key, Method::POST, &path, Some(json!({}))).await
}

#[tokio::test]
async fn a_key_past_its_snapshot_count_or_bytes_gets_429() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin, fake) = open(dir.path(), LifecycleConfig::default()).await;
    let max = rand::random_range(1..4);
    let a = key(
        dir.path(),
        "alpha",
        Quota {
            max_snapshots: Some(max),
            ..Default::default()
        },
    );
    let b = key(
        dir.path(),
        "beta",
        Quota {
            max_snapshot_gb: Some(1),
            ..Default::default()
        },
    );
    let (sa, sb, sd) = (
        sandbox(&api, &a).await,
        sandbox(&api, &b).await,
        sandbox(&api, &admin).await,
    );
    for _ in 0..max {
        assert_eq!(snapshot(&api, &a, &sa).await.0, StatusCode::CREATED);
    }
    let (st, v) = snapshot(&api, &a, &sa).await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("key alpha: snapshots"),
        "{v}"
    );
    // 600 MiB each: beta's second snapshot takes it over its 1 GiB, and is undone.
    fake.snapshot_bytes.store(600 << 20, Ordering::Relaxed);
    assert_eq!(snapshot(&api, &b, &sb).await.0, StatusCode::CREATED);
    let (st, v) = snapshot(&api, &b, &sb).await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(v["message"].as_str().unwrap().contains("key beta"), "{v}");
    assert_eq!(
        api.listed(b.clone(), "/snapshots", "snapshotID")
            .await
            .len(),
        1
    );
    // The operator's key is held to neither.
    for _ in 0..=max + 1 {
        assert_eq!(snapshot(&api, &admin, &sd).await.0, StatusCode::CREATED);
    }
}

#[tokio::test]
async fn past_the_servers_stored_bytes_budget_a_snapshot_gets_507() {
    let dir = tempfile::tempdir().unwrap();
    let lifecycle = LifecycleConfig {
        max_stored_gb: Some(1),
        ..Default::default()
    };
    let (api, admin, fake) = open(dir.path(), lifecycle).await;
    let a = key(dir.path(), "alpha", Quota::default());
    let (sa, sd) = (sandbox(&api, &a).await, sandbox(&api, &admin).await);
    fake.snapshot_bytes.store(512 << 20, Ordering::Relaxed);
    assert_eq!(snapshot(&api, &a, &sa).await.0, StatusCode::CREATED);
    assert_eq!(snapshot(&api, &admin, &sd).await.0, StatusCode::CREATED);
    for (k, id) in [(&a, &sa), (&admin, &sd)] {
        let (st, v) = snapshot(&api, k, id).await;
        assert_eq!(st, StatusCode::INSUFFICIENT_STORAGE, "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("storage is full"),
            "{v}"
        );
    }
}
