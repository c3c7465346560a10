//! COPY uploads by presigned URL, as the SDK makes them: a `PUT` that carries no key.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use serde_json::json;
use tower::ServiceExt;

use super::{key, open};
use crate::sandboxes::Quota;

#[tokio::test]
async fn a_copy_upload_url_carries_no_key_and_holds_only_for_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let (api, _) = open(dir.path(), None).await;
    let a = key(dir.path(), "alpha", Quota::default());
    let name = format!("up-{:x}", rand::random::<u32>());
    let (st, v) = api
        .call(
            &a,
            Method::POST,
            "/v3/templates",
            Some(json!({ "name": name })),
        )
        .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{v}");
    let tid = v["templateID"].as_str().unwrap().to_string();
    let hex = |n: usize| -> String {
        (0..n)
            .map(|_| char::from(b"0123456789abcdef"[rand::random_range(0..16)]))
            .collect()
    };
    let (hash, other) = (hex(64), hex(64));
    let link = format!("/templates/{tid}/files/{hash}");
    let (link_ref, a_ref, api_ref) = (&link, &a, &api);
    let get_link_on = move |tls: bool| async move {
        let mut req = Request::builder()
            .uri(link_ref)
            .header("x-api-key", a_ref)
            .header("host", "agentenv.test:3000")
            .body(Body::empty())
            .unwrap();
        let mut conn = crate::conn::Conn::new(([127, 0, 0, 1], 40000).into());
        conn.tls = tls;
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(conn));
        let r = api_ref.app.clone().oneshot(req).await.unwrap();
        let st = r.status();
        let b = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (st, serde_json::from_slice::<serde_json::Value>(&b).unwrap())
    };
    let get_link = || get_link_on(false);
    // A URL handed out on a TLS connection is https.
    let (_, v) = get_link_on(true).await;
    assert!(
        v["url"]
            .as_str()
            .unwrap()
            .starts_with("https://agentenv.test:3000/"),
        "{v}"
    );
    let (st, v) = get_link().await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    assert!(
        v["url"]
            .as_str()
            .unwrap()
            .starts_with("http://agentenv.test:3000/templates/"),
        "{v}"
    );
    assert_eq!(v["present"], false);
    let url = v["url"].as_str().unwrap();
    assert!(
        !url.contains(&a) && v.get("headers").is_none(),
        "the key left in {v}"
    );
    let at = url.find("/templates/").unwrap();
    let signed = &url[at..];
    assert!(signed.starts_with(&format!("{link}?")), "{url}");
    let put = |uri: String| {
        let req = Request::builder()
            .method(Method::PUT)
            .uri(uri)
            .body(Body::from(vec![7u8; rand::random_range(1..4096)]))
            .unwrap();
        api.app.clone().oneshot(req)
    };
    // Another file, a stripped or altered signature, another method: no key, no entry.
    let query = &signed[signed.find('?').unwrap()..];
    for bad in [
        format!("/templates/{tid}/files/{other}{query}"),
        link.clone(),
        signed.replace("signature=", "signature=0"),
        signed.replace("expires=", "expires=9"),
    ] {
        let r = put(bad.clone()).await.unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED, "{bad}");
    }
    let r = put(signed.to_string()).await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let (_, v) = get_link().await;
    assert_eq!(v["present"], true, "{v}");
    // The URL is no key: a GET with it alone is refused.
    let r = api
        .app
        .clone()
        .oneshot(Request::builder().uri(signed).body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}
