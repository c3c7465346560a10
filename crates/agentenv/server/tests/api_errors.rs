//! Auth and bad input on the real server: every error is `{code, message}` JSON.

mod common;

use common::{TestServer, state_dir};
use hyper::{Method, StatusCode};

fn assert_error(r: &common::Resp, status: StatusCode) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["code"].as_u64(), Some(u64::from(status.as_u16())));
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_and_bad_input_answer_json_errors() {
    let dir = state_dir();
    let server = TestServer::start_with(dir.path(), false).await;
    let api = server.client();
    let wrong = agentenv_server::keys::generate_api_key();

    assert_error(
        &api.raw(Method::GET, "/v2/sandboxes", &[], vec![]).await,
        StatusCode::UNAUTHORIZED,
    );
    assert_error(
        &api.raw(
            Method::GET,
            "/v2/sandboxes",
            &[("X-API-KEY", &wrong)],
            vec![],
        )
        .await,
        StatusCode::UNAUTHORIZED,
    );
    assert_eq!(
        api.raw(Method::GET, "/health", &[], vec![]).await.status,
        StatusCode::NO_CONTENT
    );
    let key = api.key.clone();
    let hdr = [
        ("X-API-KEY", key.as_str()),
        ("Content-Type", "application/json"),
    ];
    for body in [&b"{oops"[..], b"[]", b"{\"templateID\": 1}", b"{}"] {
        assert_error(
            &api.raw(Method::POST, "/v2/sandboxes", &hdr, body.to_vec())
                .await,
            StatusCode::BAD_REQUEST,
        );
    }
    let missing = agentenv_server::keys::generate_sandbox_id();
    assert_error(
        &api.call(
            Method::POST,
            "/v2/sandboxes",
            Some(serde_json::json!({"templateID": missing})),
        )
        .await,
        StatusCode::NOT_FOUND,
    );
    assert_error(
        &api.call(Method::GET, &format!("/sandboxes/{missing}"), None)
            .await,
        StatusCode::NOT_FOUND,
    );
    assert_error(
        &api.call(Method::POST, &format!("/sandboxes/{missing}/pause"), None)
            .await,
        StatusCode::NOT_FOUND,
    );
    assert_error(
        &api.head_only(Method::POST, "/v2/sandboxes", &hdr, 2 << 20)
            .await,
        StatusCode::PAYLOAD_TOO_LARGE,
    );
    let envd = [
        ("E2b-Sandbox-Id", missing.as_str()),
        ("E2b-Sandbox-Port", "49983"),
    ];
    assert_error(
        &api.raw(Method::GET, "/health", &envd, vec![]).await,
        StatusCode::BAD_GATEWAY,
    );

    // Snapshots and fork: unknown ids 404, a count outside 1..=20 or a bad query 400.
    for (method, path, body) in [
        (
            Method::POST,
            format!("/sandboxes/{missing}/snapshots"),
            Some(serde_json::json!({})),
        ),
        (
            Method::POST,
            format!("/sandboxes/{missing}/fork"),
            Some(serde_json::json!({"count": 2})),
        ),
        (Method::DELETE, format!("/templates/{missing}"), None),
    ] {
        assert_error(&api.call(method, &path, body).await, StatusCode::NOT_FOUND);
    }
    for count in [0, 21, 1000] {
        assert_error(
            &api.call(
                Method::POST,
                &format!("/sandboxes/{missing}/fork"),
                Some(serde_json::json!({"count": count})),
            )
            .await,
            StatusCode::BAD_REQUEST,
        );
    }
    for q in ["limit=0", "limit=x", "name=a/b", "nextToken=nosuch"] {
        assert_error(
            &api.call(Method::GET, &format!("/snapshots?{q}"), None)
                .await,
            StatusCode::BAD_REQUEST,
        );
    }
    let empty = api.call(Method::GET, "/snapshots", None).await;
    assert_eq!(empty.status, StatusCode::OK);
    assert_eq!(empty.json(), serde_json::json!([]));

    let metrics = api.call(Method::GET, "/metrics", None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(
            "agentenv_http_requests_total{plane=\"control\",method=\"POST\",status=\"400\"} 7"
        ),
        "{text}"
    );

    // The router's and the extractors' own rejections are E2B JSON too.
    let key_only = [("X-API-KEY", key.as_str())];
    let r = api
        .raw(Method::PUT, "/v2/sandboxes", &key_only, vec![])
        .await;
    assert_error(&r, StatusCode::METHOD_NOT_ALLOWED);
    assert!(r.headers.contains_key("allow"), "{:?}", r.headers);
    assert_error(
        &api.raw(Method::GET, "/sandboxes/%FF%FE", &key_only, vec![])
            .await,
        StatusCode::BAD_REQUEST,
    );
    assert_error(
        &api.raw(Method::GET, "/no/such/route", &key_only, vec![])
            .await,
        StatusCode::NOT_FOUND,
    );
    let text_plain = [("X-API-KEY", key.as_str()), ("Content-Type", "text/plain")];
    assert_error(
        &api.raw(
            Method::POST,
            "/v2/sandboxes",
            &text_plain,
            br#"{"templateID": "base"}"#.to_vec(),
        )
        .await,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
    );
    server.stop();
}
