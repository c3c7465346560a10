//! End to end through the HTTP API with the real runtime and real guests: create, command
//! through the data-plane proxy, pause (data plane answers 502), resume with state kept,
//! server restart (running re-attached, paused kept), kill.

mod common;

use common::{TestServer, ensure_guest_binary, state_dir};
use hyper::{Method, StatusCode};
use rand::Rng;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_through_the_api_survives_restart() {
    ensure_guest_binary();
    let dir = state_dir();
    let server = TestServer::start(dir.path()).await;
    println!("accelerator: {}", server.accel);
    let api = server.client();

    let val = format!("{:016x}", rand::rng().random::<u64>());
    let r = api
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "envVars": {"VAL": val}, "metadata": {"k": "v"}})),
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let created = r.json();
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    // Legacy create route, with an Idempotency-Key: a retried create returns the same sandbox.
    let idem = format!("retry-{:08x}", rand::rng().random::<u32>());
    let key = api.key.clone();
    let headers = [
        ("X-API-KEY", key.as_str()),
        ("Content-Type", "application/json"),
        ("Idempotency-Key", idem.as_str()),
    ];
    let body = br#"{"templateID": "base"}"#.to_vec();
    let other = api
        .raw(Method::POST, "/sandboxes", &headers, body.clone())
        .await;
    assert_eq!(other.status, StatusCode::CREATED);
    let other = other.json();
    let again = api
        .raw(Method::POST, "/sandboxes", &headers, body)
        .await
        .json();
    assert_eq!(again["sandboxID"], other["sandboxID"]);
    let other_id = other["sandboxID"].as_str().unwrap().to_string();
    let other_token = other["envdAccessToken"].as_str().unwrap().to_string();

    let (out, code) = api
        .run(&id, &token, "echo $VAL; echo $VAL > /tmp/val")
        .await
        .unwrap();
    assert_eq!((out.trim(), code), (val.as_str(), 0));
    let (_, code) = api.run(&id, &token, "exit 7").await.unwrap();
    assert_eq!(code, 7);
    assert!(
        api.run(&id, "wrong-token", "true")
            .await
            .unwrap_err()
            .starts_with("401")
    );

    assert_eq!(
        api.call(Method::POST, &format!("/sandboxes/{id}/pause"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        api.call(Method::POST, &format!("/sandboxes/{id}/pause"), None)
            .await
            .status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        api.call(Method::GET, &format!("/sandboxes/{id}"), None)
            .await
            .json()["state"],
        "paused"
    );
    let err = api.run(&id, &token, "true").await.unwrap_err();
    assert!(
        err.starts_with("502") && err.contains("was not found"),
        "{err}"
    );
    assert_eq!(
        api.call(
            Method::POST,
            &format!("/sandboxes/{id}/timeout"),
            Some(json!({"timeout": 60}))
        )
        .await
        .status,
        StatusCode::CONFLICT
    );

    // Restart: the paused sandbox stays paused, the running one is re-attached.
    server.stop();
    let server = TestServer::start(dir.path()).await;
    let api = server.client();
    assert_eq!(
        api.call(Method::GET, &format!("/sandboxes/{id}"), None)
            .await
            .json()["state"],
        "paused"
    );
    assert_eq!(
        api.call(Method::GET, &format!("/sandboxes/{other_id}"), None)
            .await
            .json()["state"],
        "running"
    );
    let (out, _) = api
        .run(&other_id, &other_token, "echo still-here")
        .await
        .unwrap();
    assert_eq!(out, "still-here\n");

    let r = api
        .call(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 120})),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.json()["envdAccessToken"].as_str(), Some(token.as_str()));
    let (out, _) = api.run(&id, &token, "cat /tmp/val").await.unwrap();
    assert_eq!(out.trim(), val);
    assert_eq!(
        api.call(Method::POST, &format!("/sandboxes/{id}/connect"), None)
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        api.call(Method::POST, &format!("/sandboxes/{id}/resume"), None)
            .await
            .status,
        StatusCode::CONFLICT
    );

    let listed = api
        .call(Method::GET, "/v2/sandboxes?metadata=k%3Dv", None)
        .await
        .json();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["sandboxID"].as_str(), Some(id.as_str()));

    for sid in [&id, &other_id] {
        assert_eq!(
            api.call(Method::DELETE, &format!("/sandboxes/{sid}"), None)
                .await
                .status,
            StatusCode::NO_CONTENT
        );
        assert_eq!(
            api.call(Method::GET, &format!("/sandboxes/{sid}"), None)
                .await
                .status,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            api.call(Method::DELETE, &format!("/sandboxes/{sid}"), None)
                .await
                .status,
            StatusCode::NOT_FOUND
        );
    }
    let err = api.run(&id, &token, "true").await.unwrap_err();
    assert!(
        err.starts_with("502") && err.contains("was not found"),
        "{err}"
    );
    assert!(
        api.call(Method::GET, "/v2/sandboxes", None)
            .await
            .json()
            .as_array()
            .unwrap()
            .is_empty()
    );
    server.stop();
}
