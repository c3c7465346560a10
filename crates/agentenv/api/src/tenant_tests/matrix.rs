//! The route matrix of the tenant tests, generated from the router's own source (`app.rs`), so a new
//! route cannot be missed: every route is in the OpenAPI document or named here as not E2B's, every
//! route on a sandbox id is in the matrix, and every other route with an id is named with the test
//! that covers it.

use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::{key, open};
use crate::sandboxes::Quota;
use crate::tenants;

/// Routes that are not E2B's (the server key's cluster routes): not in the OpenAPI document.
const NOT_E2B: &[&str] = &[
    "/cluster/sandboxes/{}/handoff",
    "/cluster/adopt",
    "/cluster/snapshots/{}",
];

/// Routes on another id than a sandbox's, with the test that attacks them as another tenant.
const ELSEWHERE: &[(&str, &str)] = &[
    (
        "/templates/{}",
        "templates_and_unnamed_snapshots_cannot_be_taken_over",
    ),
    (
        "/templates/{}/files/{}",
        "templates_and_unnamed_snapshots_cannot_be_taken_over",
    ),
    (
        "/v2/templates/{}/builds/{}",
        "templates_and_unnamed_snapshots_cannot_be_taken_over",
    ),
    (
        "/templates/{}/builds/{}/status",
        "templates_and_unnamed_snapshots_cannot_be_taken_over",
    ),
    (
        "/templates/aliases/{}",
        "snapshots_and_templates_are_per_key_and_names_never_collide",
    ),
    (
        "/volumes/{}",
        "volumes_are_per_key_and_their_files_need_their_token",
    ),
    (
        "/volumecontent/{}/path",
        "volumes_are_per_key_and_their_files_need_their_token",
    ),
    (
        "/volumecontent/{}/dir",
        "volumes_are_per_key_and_their_files_need_their_token",
    ),
    (
        "/volumecontent/{}/file",
        "volumes_are_per_key_and_their_files_need_their_token",
    ),
];

/// Every `.route(path, method(handler)...)` of `app.rs`: the path (each `{param}` as `{}`) and its
/// methods.
fn router_routes() -> Vec<(String, Vec<Method>)> {
    let src = include_str!("../app.rs");
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find(".route(") {
        let call = &rest[i + ".route(".len()..];
        // The call's text, up to its closing parenthesis.
        let mut depth = 1;
        let end = call
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map(|(j, _)| j)
            .expect("a closed .route(");
        let call = &call[..end];
        let path = call.split('"').nth(1).expect("a path literal");
        let methods = [
            ("get(", Method::GET),
            ("post(", Method::POST),
            ("put(", Method::PUT),
            ("delete(", Method::DELETE),
        ]
        .into_iter()
        .filter(|(f, _)| {
            call.match_indices(f)
                .any(|(k, _)| !call[..k].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
        })
        .map(|(_, m)| m)
        .collect();
        out.push((generic(path), methods));
        rest = &rest[i + ".route(".len() + end..];
    }
    out
}

/// `path` with every `{param}` as `{}`.
fn generic(path: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for c in path.chars() {
        match c {
            '{' => inside = true,
            '}' => {
                inside = false;
                out.push_str("{}");
            }
            _ if !inside => out.push(c),
            _ => {}
        }
    }
    out
}

/// Every route on a sandbox id, with `id` filled in.
pub(super) fn sandbox_routes(id: &str) -> Vec<(Method, String)> {
    let routes: Vec<_> = router_routes()
        .into_iter()
        .filter(|(p, _)| p.starts_with("/sandboxes/{}") || p.starts_with("/v2/sandboxes/{}"))
        .flat_map(|(p, ms)| {
            let path = p.replacen("{}", id, 1);
            ms.into_iter().map(move |m| (m, path.clone()))
        })
        .collect();
    assert!(
        routes.len() >= 11,
        "the router parse lost routes: {routes:?}"
    );
    routes
}

#[test]
fn every_route_is_documented_or_named_and_every_id_route_is_attacked() {
    let routes = router_routes();
    assert!(routes.len() >= 25, "{routes:?}");
    let doc: Value = serde_json::from_str(&crate::openapi::document_json()).unwrap();
    let documented: Vec<String> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(|p| generic(p))
        .collect();
    for (path, methods) in &routes {
        assert!(!methods.is_empty(), "{path}: no method parsed");
        let known = documented.contains(path) || NOT_E2B.contains(&path.as_str());
        assert!(
            known,
            "{path} is neither in the OpenAPI document nor named as not E2B's"
        );
        let on_sandbox = path.starts_with("/sandboxes/{}") || path.starts_with("/v2/sandboxes/{}");
        let covered = on_sandbox
            || !path.contains("{}")
            || NOT_E2B.contains(&path.as_str())
            || ELSEWHERE.iter().any(|(p, _)| p == path);
        assert!(covered, "{path} takes an id but no tenant test attacks it");
    }
    for p in &documented {
        assert!(
            routes.iter().any(|(r, _)| r == p),
            "the document names {p}, which the router lacks"
        );
    }
}

#[tokio::test]
async fn a_key_sees_and_controls_only_its_own_sandboxes() {
    let dir = tempfile::tempdir().unwrap();
    let (api, admin) = open(dir.path(), None).await;
    let (a, b) = (
        key(dir.path(), "alpha", Quota::default()),
        key(dir.path(), "beta", Quota::default()),
    );
    let n = rand::random_range(1..4);
    let mut mine = vec![];
    for _ in 0..n {
        let (st, v) = api.create(&a, "base").await;
        assert_eq!(st, StatusCode::CREATED, "{v}");
        mine.push(v["sandboxID"].as_str().unwrap().to_string());
    }
    mine.sort();
    let (_, v) = api.create(&b, "base").await;
    let theirs = v["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(api.ids(&a).await, mine);
    assert_eq!(api.ids(&b).await, vec![theirs.clone()]);
    assert!(
        api.ids(&admin).await.is_empty(),
        "the server key is a tenant too"
    );

    let id = &mine[0];
    for (m, path) in sandbox_routes(id) {
        let body = Some(json!({"timeout": 30, "name": "x", "count": 1}));
        for k in [&b, &admin] {
            let (st, v) = api.call(k, m.clone(), &path, body.clone()).await;
            assert_eq!(st, StatusCode::NOT_FOUND, "{m} {path}: {v}");
        }
    }
    // Nothing of alpha's changed.
    let (st, v) = api
        .call(&a, Method::GET, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!((st, v["state"].as_str()), (StatusCode::OK, Some("running")));
    let (st, _) = api
        .call(&a, Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(st, StatusCode::NO_CONTENT);

    let (st, _) = api.call(&b, Method::GET, "/metrics", None).await;
    assert_eq!(
        st,
        StatusCode::FORBIDDEN,
        "server-wide metrics are the operator's"
    );
    tenants::revoke_key(dir.path(), "beta").unwrap();
    let (st, _) = api.call(&b, Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
}
