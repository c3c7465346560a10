//! Volumes through the HTTP app: each key sees and deletes only its own; their files answer only to
//! their token, stay below their root and follow E2B's content API.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{key, open};
use crate::sandboxes::Quota;

/// One content-API request with `token` as its bearer: status and body bytes.
async fn content(
    app: &axum::Router,
    token: Option<&str>,
    method: Method,
    uri: &str,
    body: Vec<u8>,
) -> (StatusCode, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = app
        .clone()
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
        .await
        .unwrap();
    (status, bytes.to_vec())
}

fn json_of(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

#[tokio::test]
async fn volumes_are_per_key_and_their_files_need_their_token() {
    let dir = tempfile::tempdir().unwrap();
    let (api, _admin) = open(dir.path(), None).await;
    let (a, b) = (
        key(dir.path(), "alpha", Quota::default()),
        key(dir.path(), "beta", Quota::default()),
    );
    let name = format!("data-{}", rand::random::<u32>());
    let (st, made) = api
        .call(&a, Method::POST, "/volumes", Some(json!({"name": name})))
        .await;
    assert_eq!(st, StatusCode::CREATED, "{made}");
    let (id, token) = (
        made["volumeID"].as_str().unwrap().to_string(),
        made["token"].as_str().unwrap().to_string(),
    );
    let (st, v) = api
        .call(&a, Method::POST, "/volumes", Some(json!({"name": name})))
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{v}");
    let (st, v) = api
        .call(
            &a,
            Method::POST,
            "/volumes",
            Some(json!({"name": "no/slash"})),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    let mine = api.listed(a.clone(), "/volumes", "volumeID").await;
    assert_eq!(mine, vec![id.clone()]);
    assert!(
        api.listed(b.clone(), "/volumes", "volumeID")
            .await
            .is_empty()
    );
    let (st, got) = api
        .call(&a, Method::GET, &format!("/volumes/{id}"), None)
        .await;
    assert_eq!((st, &got["token"]), (StatusCode::OK, &json!(token)));
    for m in [Method::GET, Method::DELETE] {
        let (st, v) = api
            .call(&b, m.clone(), &format!("/volumes/{id}"), None)
            .await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{m} as another key: {v}");
    }
    // Another key's token, none, or a key instead of a token: 401.
    let (st, theirs) = api
        .call(&b, Method::POST, "/volumes", Some(json!({"name": name})))
        .await;
    assert_eq!(st, StatusCode::CREATED, "names are per key: {theirs}");
    let file = format!("/volumecontent/{id}/file?path=/docs/a.bin");
    for t in [
        None,
        Some(theirs["token"].as_str().unwrap()),
        Some(a.as_str()),
    ] {
        let (st, _) = content(&api.app, t, Method::GET, &file, vec![]).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{t:?}");
    }

    let t = Some(token.as_str());
    let body: Vec<u8> = (0..rand::random_range(1..100_000))
        .map(|_| rand::random())
        .collect();
    let (st, _) = content(&api.app, t, Method::PUT, &file, body.clone()).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "no folder yet");
    let dirs = format!("/volumecontent/{id}/dir?path=/docs/deep&force=true");
    let (st, made) = content(&api.app, t, Method::POST, &dirs, vec![]).await;
    assert_eq!(
        st,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&made)
    );
    let (st, stat) = content(
        &api.app,
        t,
        Method::PUT,
        &(file.clone() + "&mode=420"),
        body.clone(),
    )
    .await;
    assert_eq!(st, StatusCode::CREATED);
    let stat = json_of(&stat);
    assert_eq!(
        (&stat["type"], &stat["path"], &stat["size"], &stat["mode"]),
        (
            &json!("file"),
            &json!("/docs/a.bin"),
            &json!(body.len()),
            &json!(0o644)
        )
    );
    assert!(stat["mtime"].as_str().unwrap().ends_with('Z'), "{stat}");
    let (st, _) = content(&api.app, t, Method::PUT, &file, b"other".to_vec()).await;
    assert_eq!(st, StatusCode::CONFLICT, "an existing file without force");
    let (st, got) = content(&api.app, t, Method::GET, &file, vec![]).await;
    assert_eq!((st, got), (StatusCode::OK, body));
    let list = format!("/volumecontent/{id}/dir?path=/&depth=2");
    let (st, listed) = content(&api.app, t, Method::GET, &list, vec![]).await;
    assert_eq!(st, StatusCode::OK);
    let paths: Vec<String> = json_of(&listed)
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(paths, ["/docs", "/docs/a.bin", "/docs/deep"]);
    let meta = format!("/volumecontent/{id}/path?path=/docs/a.bin");
    let req = Request::builder()
        .method(Method::PATCH)
        .uri(&meta)
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(Body::from(json!({"mode": 0o6700}).to_string()))
        .unwrap();
    let resp = api.app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let (_, stat) = content(&api.app, t, Method::GET, &meta, vec![]).await;
    assert_eq!(
        json_of(&stat)["mode"],
        json!(0o700),
        "setuid and setgid dropped"
    );
    let escape = format!("/volumecontent/{id}/path?path=/docs/../../x");
    let (st, _) = content(&api.app, t, Method::GET, &escape, vec![]).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, _) = content(&api.app, t, Method::DELETE, &meta, vec![]).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let (st, _) = content(&api.app, t, Method::GET, &file, vec![]).await;
    assert_eq!(st, StatusCode::NOT_FOUND);

    // A mount names the tenant's own volumes only, at an absolute path.
    for (vol, path) in [("not-mine", "/data"), (name.as_str(), "data")] {
        let (st, v) = api
            .call(
                &a,
                Method::POST,
                "/v2/sandboxes",
                Some(json!({"templateID": "base", "volumeMounts": [{"name": vol, "path": path}]})),
            )
            .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    }
    let (st, _) = api
        .call(&a, Method::DELETE, &format!("/volumes/{id}"), None)
        .await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let (st, _) = content(&api.app, t, Method::GET, &list, vec![]).await;
    assert_eq!(
        st,
        StatusCode::NOT_FOUND,
        "a deleted volume's token opens nothing"
    );
}
