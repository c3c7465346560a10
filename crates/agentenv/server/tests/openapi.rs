//! The committed `openapi.json` must equal the document the server serves.
//! Refresh with `UPDATE_OPENAPI=1 cargo test -p agentenv-server --test openapi`.

use std::path::Path;

#[test]
fn committed_openapi_json_is_fresh() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    let doc = agentenv_server::openapi::document_json() + "\n";
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &doc).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == doc,
        "{} is stale: run UPDATE_OPENAPI=1 cargo test -p agentenv-server --test openapi",
        path.display()
    );
    let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
    for route in [
        "/v2/sandboxes",
        "/sandboxes",
        "/sandboxes/{sandboxID}/connect",
        "/v2/sandboxes/{sandboxID}/connect",
        "/sandboxes/{sandboxID}/resume",
        "/sandboxes/{sandboxID}/snapshots",
        "/sandboxes/{sandboxID}/fork",
        "/snapshots",
        "/templates/{templateID}",
        "/templates",
        "/v2/templates",
    ] {
        assert!(
            v["paths"].get(route).is_some(),
            "route {route} missing from the document"
        );
    }
    assert!(v["components"]["securitySchemes"]["ApiKeyAuth"].is_object());
}
