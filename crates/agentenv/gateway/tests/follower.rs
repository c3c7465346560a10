//! A joined node keeps its cluster entries true even when a transition report is lost: against a real
//! etcd and the lifecycle layer over the fake backend, a pause and a resume the node never reports are
//! found by its periodic check and recorded (handed off, then running with the handoff deleted).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agentenv_cluster::{ClusterStore, EntryState, SCHEMA_VERSION, SandboxEntry};
use agentenv_control::fake::FakeBackend;
use agentenv_control::sandboxes::{
    Caller, CreateRequest, LifecycleConfig, OpObserver, SandboxState, Sandboxes,
};
use agentenv_control::store::SandboxStore;
use agentenv_control::tenants::{DEFAULT_TENANT, KeyRing, Quota};
use agentenv_gateway::join::{JoinConfig, join};

struct NoOps;
impl OpObserver for NoOps {
    fn observe_op(&self, _: &'static str, _: Duration) {}
}

/// Polls `probe` every 50 ms until it returns `Some`, at most 30 s.
async fn wait<T>(what: &str, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_pause_and_resume_are_repaired_from_the_cluster_entries() {
    let dir = tempfile::tempdir().unwrap();
    let Some(etcd) = agentenv_cluster::testing::etcd_or_skip("follower", dir.path()) else {
        return;
    };
    let state = dir.path().join("node");
    std::fs::create_dir_all(&state).unwrap();
    let fake = Arc::new(FakeBackend::default());
    fake.store_snapshots.store(true, Ordering::Relaxed);
    let ring = KeyRing::open(&state, "e2b_test".into(), Quota::default(), None);
    let sandboxes = Sandboxes::open(
        fake.clone(),
        SandboxStore::open(&state).unwrap(),
        Arc::new(NoOps),
        LifecycleConfig::default(),
        Arc::new(ring),
        Arc::new(agentenv_control::volumes::Volumes::open(&state, "key").unwrap()),
    )
    .await
    .unwrap();
    let prefix = format!("/follower-{:08x}/", rand::random::<u32>());
    let cfg = JoinConfig {
        etcd: vec![etcd.endpoint.clone()],
        tls: None,
        node_id: Some("node-a".into()),
        prefix: prefix.clone(),
        advertise: "http://127.0.0.1:9".into(),
        ttl: Duration::from_secs(6),
        interval: Duration::from_secs(2),
        max_running: None,
        shared_store: true,
        reconcile_every: Duration::from_millis(200),
    };
    let _reg = join(&state, sandboxes.clone(), cfg).await.unwrap();
    let store = ClusterStore::connect(
        std::slice::from_ref(&etcd.endpoint),
        &prefix,
        agentenv_cluster::store::DEFAULT_DEADLINE,
    )
    .await
    .unwrap();

    // A sandbox, recorded as a gateway records a create.
    let me = Caller::Tenant(DEFAULT_TENANT.into());
    let req = CreateRequest {
        template: "base".into(),
        ..Default::default()
    };
    let rec = sandboxes.create(&me, req, None).await.unwrap();
    let id = rec.sandbox_id.clone();
    let entry = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: id.clone(),
        node: "node-a".into(),
        owner: DEFAULT_TENANT.into(),
        state: EntryState::Running,
        handoff: None,
        updated_at_ms: 0,
        token_sha256: None,
    };
    let token = agentenv_gateway::locate::token_hash(&rec.access_token);
    assert!(store.insert_sandbox(&entry, &token).await.unwrap());

    // Every later transition report is lost (the node's follower no longer hears them).
    let _lost = sandboxes.transitions();
    sandboxes.pause(&me, &id).await.unwrap();
    let handoff = wait("the paused sandbox is handed off", async || {
        let e = store.sandbox(&id).await.unwrap()?.value;
        (e.state == EntryState::Paused).then_some(e.handoff?)
    })
    .await;
    let held = |sid: &str| fake.snaps.lock().unwrap().iter().any(|s| s.id == sid);
    assert!(held(&handoff.snapshot_id), "the handoff snapshot is held");
    let record: serde_json::Value = handoff.record.clone();
    assert_eq!(record["sandbox"]["sandbox_id"], id.as_str(), "{record}");
    // A true entry is left alone: no second handoff in many checks.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(fake.snaps.lock().unwrap().len(), 1, "one handoff snapshot");
    let e = store.sandbox(&id).await.unwrap().unwrap().value;
    assert_eq!(e.handoff.as_ref(), Some(&handoff));

    sandboxes.connect(&me, &id, None).await.unwrap();
    assert_eq!(sandboxes.get(&id).unwrap().state, SandboxState::Running);
    wait("the resumed sandbox is recorded running", async || {
        let e = store.sandbox(&id).await.unwrap()?.value;
        (e.state == EntryState::Running && e.handoff.is_none()).then_some(())
    })
    .await;
    wait("its handoff snapshot is deleted", async || {
        (!held(&handoff.snapshot_id)).then_some(())
    })
    .await;
    // Another node's entry is never touched: one that disagrees with a sandbox of the same id here
    // stays as it is.
    let other = SandboxEntry {
        node: "node-b".into(),
        state: EntryState::Paused,
        updated_at_ms: 1,
        ..e
    };
    let cur = store.sandbox(&id).await.unwrap().unwrap();
    assert!(
        store
            .update_sandbox(&other, cur.mod_revision)
            .await
            .unwrap()
            .is_some()
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = store.sandbox(&id).await.unwrap().unwrap().value;
    assert_eq!(
        (after.node.as_str(), after.state),
        ("node-b", EntryState::Paused)
    );
}
