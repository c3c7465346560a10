//! The cluster store against a real etcd on loopback: transactional claims, the sandbox map,
//! registration and its expiry, and clean errors while etcd is away.

use std::sync::Arc;
use std::time::Duration;

use agentenv_cluster::store::ClusterStore;
use agentenv_cluster::testing::{etcd_or_skip, eventually};
use agentenv_cluster::{
    Claim, ClaimOutcome, ClusterError, EntryState, Handoff, NodeRecord, Registration,
    SCHEMA_VERSION, SandboxEntry, StateChange,
};

fn node(id: &str) -> NodeRecord {
    agentenv_cluster::testing::idle_node(id, &format!("http://{id}"))
}

async fn store(endpoint: &str, prefix: &str) -> ClusterStore {
    ClusterStore::connect(&[endpoint.to_string()], prefix, Duration::from_secs(2))
        .await
        .expect("connect to etcd")
}

#[tokio::test]
async fn claims_registration_and_an_etcd_outage() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut etcd) = etcd_or_skip("etcd_store", dir.path()) else {
        return;
    };
    let s = store(&etcd.endpoint, "/test/a").await;

    // A node registers; its record is visible and goes when it leaves.
    // Refreshed rarely here, so the claims below stay newer than its record (pending load).
    let report: agentenv_cluster::node::Report = Arc::new(|| node("n1"));
    let reg = Registration::start(
        s.clone(),
        Duration::from_secs(60),
        Duration::from_secs(30),
        report,
    )
    .await
    .unwrap();
    assert_eq!(s.view().await.unwrap().nodes.len(), 1);

    // Two gateways place the same idempotent create: one claim wins, the other sees its node.
    let claim = |n: &str| Claim {
        version: SCHEMA_VERSION,
        node: n.into(),
        vcpus: 1,
        memory_mb: 256,
        at_ms: 0,
    };
    let other = store(&etcd.endpoint, "/test/a").await;
    let c1 = claim("n1");
    let (a, b) = tokio::join!(
        s.claim(&c1, Some(("team", "k1"))),
        other.claim(&c1, Some(("team", "k1")))
    );
    let mut outcomes = vec![a.unwrap(), b.unwrap()];
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        outcomes,
        [ClaimOutcome::Claimed, ClaimOutcome::Duplicate("n1".into())]
    );
    // A claim counts as pending load until the node's record is newer than it.
    let view = s.view().await.unwrap();
    assert_eq!(view.claims.len(), 1);
    assert_eq!(view.candidates()[0].pending.sandboxes, 1);
    // A claim on a node that is not registered fails.
    assert_eq!(
        s.claim(&claim("nope"), None).await.unwrap(),
        ClaimOutcome::NodeGone
    );

    // The sandbox map: an id is recorded once.
    let entry = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: "sbx1".into(),
        node: "n1".into(),
        owner: "default".into(),
        state: EntryState::Running,
        handoff: None,
        updated_at_ms: 0,
        token_sha256: None,
    };
    assert!(s.insert_sandbox(&entry, "tok").await.unwrap());
    assert!(!other.insert_sandbox(&entry, "tok").await.unwrap());
    assert_eq!(
        s.sandbox_by_token("tok").await.unwrap().as_deref(),
        Some("sbx1")
    );
    // Updates compare the revision: of two writers at one revision, one wins.
    let seen = s.sandbox("sbx1").await.unwrap().unwrap();
    let mut moved = entry.clone();
    moved.node = "n2".into();
    assert!(
        s.update_sandbox(&moved, seen.mod_revision)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        other
            .update_sandbox(&entry, seen.mod_revision)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(s.sandbox("sbx1").await.unwrap().unwrap().value.node, "n2");

    // etcd away: calls fail with Unavailable within the deadline, and work again after.
    etcd.stop();
    match s.view().await {
        Err(ClusterError::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    etcd.resume().unwrap();
    eventually("reads after etcd is back", || async {
        s.view().await.is_ok()
    })
    .await;
    // The registration survived the outage (or registered again).
    eventually("the node record after the outage", || async {
        s.view().await.is_ok_and(|v| v.nodes.len() == 1)
    })
    .await;

    reg.leave().await;
    assert!(
        s.view().await.unwrap().nodes.is_empty(),
        "leave revokes the lease"
    );

    // A node that stops refreshing (kill -9) expires with its lease.
    let report: agentenv_cluster::node::Report = Arc::new(|| node("n2"));
    let reg = Registration::start(
        s.clone(),
        Duration::from_secs(2),
        Duration::from_millis(500),
        report,
    )
    .await
    .unwrap();
    drop(reg);
    eventually("the dropped node's record expires", || async {
        s.view().await.is_ok_and(|v| v.nodes.is_empty())
    })
    .await;
}

/// A node whose lease etcd forgot (it missed the TTL under load, or etcd lost it) registers again under a
/// new one instead of keeping the dead lease alive forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_lease_is_gone_registers_again() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = etcd_or_skip("etcd_store", dir.path()) else {
        return;
    };
    let s = store(&etcd.endpoint, "/test/rejoin").await;
    let report: agentenv_cluster::node::Report = Arc::new(|| node("n1"));
    let reg = Registration::start(
        s.clone(),
        Duration::from_secs(6),
        Duration::from_millis(300),
        report,
    )
    .await
    .unwrap();
    let first = s.view().await.unwrap().nodes[0].create_revision;
    let mut raw = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
        .await
        .unwrap();
    for l in raw.leases().await.unwrap().leases() {
        raw.lease_revoke(l.id()).await.unwrap();
    }
    eventually("the node registers again under a new lease", || async {
        s.view()
            .await
            .is_ok_and(|v| v.nodes.len() == 1 && v.nodes[0].create_revision > first)
    })
    .await;
    reg.leave().await;
}

#[tokio::test]
async fn set_state_writes_only_the_named_nodes_live_entries() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = etcd_or_skip("etcd_store", dir.path()) else {
        return;
    };
    let s = store(&etcd.endpoint, "/test/b").await;
    let id = "sbx-b".to_string();
    let handoff = |snap: &str| Handoff {
        snapshot_id: snap.into(),
        record: serde_json::json!({"sandbox": id}),
    };
    // No entry: nothing written.
    assert_eq!(
        s.set_state(&id, Some("n1"), EntryState::Paused, None, 1)
            .await
            .unwrap(),
        StateChange::Skipped
    );
    let entry = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: id.clone(),
        node: "n1".into(),
        owner: "default".into(),
        state: EntryState::Running,
        handoff: None,
        updated_at_ms: 0,
        token_sha256: None,
    };
    assert!(s.insert_sandbox(&entry, "tok-b").await.unwrap());
    // The entry's node pauses it with a handoff; another node's write is refused.
    assert_eq!(
        s.set_state(&id, Some("n1"), EntryState::Paused, Some(handoff("s1")), 5)
            .await
            .unwrap(),
        StateChange::Written { replaced: None }
    );
    assert_eq!(
        s.set_state(&id, Some("n2"), EntryState::Running, None, 6)
            .await
            .unwrap(),
        StateChange::Skipped
    );
    let seen = s.sandbox(&id).await.unwrap().unwrap().value;
    assert_eq!(
        (seen.state, seen.handoff, seen.updated_at_ms),
        (EntryState::Paused, Some(handoff("s1")), 5)
    );
    // A later write returns the handoff it replaced; without a node name anyone may write.
    assert_eq!(
        s.set_state(&id, None, EntryState::Running, None, 7)
            .await
            .unwrap(),
        StateChange::Written {
            replaced: Some(handoff("s1"))
        }
    );
    // A killed entry stays killed, and its token is forgotten (the entry names it).
    assert_eq!(
        s.sandbox_by_token("tok-b").await.unwrap().as_deref(),
        Some(id.as_str())
    );
    s.mark_killed(&s.sandbox(&id).await.unwrap().unwrap().value, None)
        .await
        .unwrap();
    assert_eq!(s.sandbox_by_token("tok-b").await.unwrap(), None);
    assert_eq!(
        s.set_state(&id, Some("n1"), EntryState::Paused, None, 8)
            .await
            .unwrap(),
        StateChange::Skipped
    );
    assert_eq!(
        s.sandbox(&id).await.unwrap().unwrap().value.state,
        EntryState::Killed
    );
    // Removing an entry forgets the token it names.
    let other = SandboxEntry {
        sandbox_id: "sbx-c".into(),
        ..entry.clone()
    };
    assert!(s.insert_sandbox(&other, "tok-c").await.unwrap());
    s.remove_sandbox("sbx-c", None).await.unwrap();
    assert!(s.sandbox("sbx-c").await.unwrap().is_none());
    assert_eq!(s.sandbox_by_token("tok-c").await.unwrap(), None);
}

#[tokio::test]
async fn entries_of_the_flat_layout_move_to_their_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = etcd_or_skip("etcd_store", dir.path()) else {
        return;
    };
    let s = store(&etcd.endpoint, "/test/c").await;
    let id = format!("sbx{:08x}", rand::random::<u32>());
    let entry = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: id.clone(),
        node: "n7".into(),
        owner: "default".into(),
        state: EntryState::Paused,
        handoff: None,
        updated_at_ms: 3,
        token_sha256: None,
    };
    let flat = serde_json::to_vec(&entry).unwrap();
    agentenv_cluster::testing::put_raw(&s, &format!("sandboxes/{id}"), &flat)
        .await
        .unwrap();
    // An entry whose key and id disagree is left alone.
    agentenv_cluster::testing::put_raw(&s, "sandboxes/other", &flat)
        .await
        .unwrap();
    assert!(
        s.sandbox(&id).await.unwrap().is_none(),
        "the flat layout is not read"
    );
    assert_eq!(s.migrate_flat_entries().await.unwrap(), 1);
    assert_eq!(s.migrate_flat_entries().await.unwrap(), 0, "once");
    assert_eq!(s.sandbox(&id).await.unwrap().unwrap().value, entry);
    assert_eq!(s.sandboxes().await.unwrap(), vec![entry.clone()]);
    let paused = s
        .set_state(&id, Some("n7"), EntryState::Running, None, 4)
        .await
        .unwrap();
    assert!(matches!(paused, StateChange::Written { .. }));
}
