//! etcd over mutual TLS with a user per certificate (a real etcd, certificates from a throwaway CA):
//! a client without a certificate is refused, a node writes its own record and its own sandboxes'
//! entries but not another node's, placements, claims or keys outside the cluster's prefix, and a
//! gateway writes what placement needs.

use std::time::Duration;

use agentenv_cluster::auth::{Members, provision};
use agentenv_cluster::testing::{idle_node, put_raw, secure_etcd_or_skip};
use agentenv_cluster::{
    Claim, ClusterError, ClusterStore, EntryState, EtcdTls, Registration, SCHEMA_VERSION,
    SandboxEntry, StateChange,
};

const PREFIX: &str = "/tls-test/";

async fn as_user(endpoint: &str, tls: Option<&EtcdTls>) -> Result<ClusterStore, ClusterError> {
    ClusterStore::connect_with(&[endpoint.into()], tls, PREFIX, Duration::from_secs(3)).await
}

/// Registers `id` at `url` through `store` (the node's own path: a lease, then its record).
async fn register(store: &ClusterStore, id: &str, url: &str) -> Result<Registration, ClusterError> {
    agentenv_cluster::testing::register(store, idle_node(id, url)).await
}

fn denied<T: std::fmt::Debug>(r: Result<T, ClusterError>, what: &str) {
    assert!(
        matches!(r, Err(ClusterError::Denied { .. })),
        "{what}: {r:?}"
    );
}

#[tokio::test]
async fn each_certificate_writes_only_what_its_job_needs() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = secure_etcd_or_skip("etcd_tls", dir.path()) else {
        return;
    };
    let pki = etcd.pki().unwrap();
    let node_a = format!("node-{:08x}", rand::random::<u32>());
    let cert = |cn: &str| pki.issue(cn).unwrap();
    let (root, gw, a, b) = (cert("root"), cert("gw0"), cert(&node_a), cert("node-b"));

    // No certificate, or one from another CA: no connection, or every call refused.
    let plain = as_user(&etcd.endpoint, None).await;
    if let Ok(s) = plain {
        assert!(
            s.view().await.is_err(),
            "a client without a certificate was served"
        );
    }
    let stranger = agentenv_cluster::testing::Pki::new(&dir.path().join("other-ca"))
        .unwrap()
        .issue("root")
        .unwrap();
    let foreign = EtcdTls {
        ca: root.ca.clone(),
        ..stranger
    };
    if let Ok(s) = as_user(&etcd.endpoint, Some(&foreign)).await {
        assert!(
            s.view().await.is_err(),
            "a certificate of another CA was served"
        );
    }

    // Before auth is on, any certificate of the CA writes anything: what provisioning takes away.
    let early = as_user(&etcd.endpoint, Some(&a)).await.unwrap();
    register(&early, "node-b", "http://before-auth")
        .await
        .unwrap();

    let admin = as_user(&etcd.endpoint, Some(&root)).await.unwrap();
    let members = Members {
        nodes: vec![node_a.clone(), "node-b".into()],
        gateways: vec!["gw0".into()],
    };
    provision(&admin, &members).await.unwrap();
    provision(&admin, &members)
        .await
        .expect("a second run changes nothing");

    // Node A: its own record, yes; node B's, no.
    let sa = as_user(&etcd.endpoint, Some(&a)).await.unwrap();
    let _reg = register(&sa, &node_a, "http://a").await.unwrap();
    denied(
        register(&sa, "node-b", "http://evil").await.map(drop),
        "node A wrote node B's record",
    );
    let claim = Claim {
        version: SCHEMA_VERSION,
        node: node_a.clone(),
        vcpus: 1,
        memory_mb: 256,
        at_ms: 0,
    };
    denied(sa.claim(&claim, None).await, "a node placed a claim");
    let outside = ClusterStore::connect_with(
        std::slice::from_ref(&etcd.endpoint),
        Some(&a),
        "/elsewhere/",
        Duration::from_secs(3),
    )
    .await
    .unwrap();
    denied(outside.view().await, "a node read outside its prefix");

    // The gateway places and records a sandbox; its node updates and releases it; the gateway sweeps.
    let sg = as_user(&etcd.endpoint, Some(&gw)).await.unwrap();
    assert!(sg.view().await.unwrap().node(&node_a).is_some());
    sg.claim(&claim, None).await.unwrap();
    let entry = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: "sbx1".into(),
        node: node_a.clone(),
        owner: "default".into(),
        state: EntryState::Running,
        handoff: None,
        updated_at_ms: 0,
        token_sha256: None,
    };
    assert!(sg.insert_sandbox(&entry, "tok").await.unwrap());
    let paused = sa
        .set_state("sbx1", Some(&node_a), EntryState::Paused, None, 1)
        .await
        .unwrap();
    assert!(matches!(paused, StateChange::Written { .. }), "{paused:?}");

    // Node B can neither change, move, kill nor drop node A's sandbox, nor place one.
    let sb = as_user(&etcd.endpoint, Some(&b)).await.unwrap();
    let seen = sg.sandbox("sbx1").await.unwrap().unwrap();
    let to_b = SandboxEntry {
        node: "node-b".into(),
        state: EntryState::Running,
        ..seen.value.clone()
    };
    denied(
        sb.update_sandbox(&to_b, seen.mod_revision).await,
        "node B moved A's sandbox",
    );
    denied(
        sb.release_sandbox(&node_a, "sbx1").await,
        "node B dropped it",
    );
    denied(sb.mark_killed(&seen.value, None).await, "node B killed it");
    denied(sb.remove_sandbox("sbx1", None).await, "node B forgot it");
    let theirs = SandboxEntry {
        sandbox_id: "sbx2".into(),
        ..to_b.clone()
    };
    denied(
        sb.insert_sandbox(&theirs, "tok2").await,
        "node B placed one",
    );
    // Its own prefix it may write: an entry there for A's sandbox counts for nothing.
    let forged = serde_json::to_vec(&to_b).unwrap();
    put_raw(&sb, "sandboxes/node-b/sbx1", &forged)
        .await
        .unwrap();
    let read = sg.sandbox("sbx1").await.unwrap().unwrap().value;
    assert_eq!(
        (read.node.as_str(), read.state),
        (node_a.as_str(), EntryState::Paused)
    );
    let listed = sg.sandboxes().await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].node, node_a);
    let skipped = sb
        .set_state("sbx1", Some("node-b"), EntryState::Running, None, 2)
        .await
        .unwrap();
    assert_eq!(skipped, StateChange::Skipped);

    sa.release_sandbox(&node_a, "sbx1").await.unwrap();
    assert!(sg.sandbox("sbx1").await.unwrap().is_none());
    assert_eq!(
        sg.sandbox_by_token("tok").await.unwrap().as_deref(),
        Some("sbx1")
    );
    denied(sa.sweep().await.map(drop), "a node swept");
    let swept = sg.sweep().await.unwrap();
    assert_eq!((swept.placements, swept.tokens), (1, 1));
    assert_eq!(sg.sandbox_by_token("tok").await.unwrap(), None);

    // Node B cannot take over node A's record either, and the record is still A's.
    denied(
        register(&sb, &node_a, "http://evil").await.map(drop),
        "node B wrote node A's record",
    );
    let view = sg.view().await.unwrap();
    assert_eq!(view.node(&node_a).unwrap().url, "http://a");
}
