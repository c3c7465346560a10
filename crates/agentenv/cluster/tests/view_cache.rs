//! The watch-fed view against a real etcd on loopback: it follows registrations, claims (its own at
//! once, other gateways' through the watch) and leaves, falls back to etcd while the watch is down, and
//! comes back after an outage.

use std::sync::Arc;
use std::time::Duration;

use agentenv_cluster::store::ClusterStore;
use agentenv_cluster::testing::{etcd_or_skip, eventually};
use agentenv_cluster::{
    Claim, ClaimOutcome, ClusterError, ClusterView, NodeRecord, Registration, SCHEMA_VERSION,
    ViewCache,
};

fn node(id: &str) -> NodeRecord {
    agentenv_cluster::testing::idle_node(id, &format!("http://{id}"))
}

fn claim(n: &str) -> Claim {
    Claim {
        version: SCHEMA_VERSION,
        node: n.into(),
        vcpus: 1,
        memory_mb: 256,
        at_ms: 0,
    }
}

/// Node ids and, per node, the pending sandboxes placement would count.
fn summary(v: &ClusterView) -> Vec<(String, u32)> {
    let mut s: Vec<_> = v
        .candidates()
        .iter()
        .map(|c| (c.node.id.clone(), c.pending.sandboxes))
        .collect();
    s.sort();
    s
}

#[tokio::test]
async fn the_cached_view_follows_etcd_and_survives_an_outage() {
    let dir = tempfile::tempdir().unwrap();
    let Some(mut etcd) = etcd_or_skip("view_cache", dir.path()) else {
        return;
    };
    let connect = || {
        ClusterStore::connect(
            std::slice::from_ref(&etcd.endpoint),
            "/test/v",
            Duration::from_secs(2),
        )
    };
    let store = connect().await.unwrap();
    let other = connect().await.unwrap();
    let cache = ViewCache::start(store.clone());
    eventually("the watch is live", || async { cache.is_live() }).await;
    assert!(cache.view().await.unwrap().nodes.is_empty());

    // Registrations arrive through the watch. Refreshed rarely, so claims stay pending.
    let mut regs = vec![];
    for id in ["n1", "n2"] {
        let report: agentenv_cluster::node::Report = Arc::new(move || node(id));
        let interval = Duration::from_secs(30);
        regs.push(
            Registration::start(other.clone(), Duration::from_secs(60), interval, report)
                .await
                .unwrap(),
        );
    }
    let want = |a: u32, b: u32| vec![("n1".to_string(), a), ("n2".to_string(), b)];
    eventually("both nodes in the cached view", || async {
        summary(&cache.view().await.unwrap()) == want(0, 0)
    })
    .await;
    // Its own claim counts at once; another gateway's once the watch reports it.
    assert_eq!(
        cache.claim(&claim("n1"), None).await.unwrap(),
        ClaimOutcome::Claimed
    );
    assert_eq!(summary(&cache.view().await.unwrap()), want(1, 0));
    assert_eq!(
        other.claim(&claim("n2"), None).await.unwrap(),
        ClaimOutcome::Claimed
    );
    eventually("the other gateway's claim", || async {
        summary(&cache.view().await.unwrap()) == want(1, 1)
    })
    .await;
    // The cached view is what a read of etcd gives.
    assert_eq!(
        summary(&cache.view().await.unwrap()),
        summary(&store.view().await.unwrap())
    );
    // A node that leaves goes from the view.
    regs.pop().unwrap().leave().await;
    eventually("n2 left", || async {
        summary(&cache.view().await.unwrap()) == vec![("n1".to_string(), 1)]
    })
    .await;

    // An idle watch stays: progress answers keep it live past the staleness bound.
    tokio::time::sleep(agentenv_cluster::watch::STALE_AFTER * 2).await;
    assert!(cache.is_live());
    assert_eq!(
        cache.syncs(),
        1,
        "the first watch lived through the idle time"
    );

    // etcd away: the watch is given up within seconds and views fail cleanly, as reads do.
    etcd.stop();
    eventually("the watch is given up", || async { !cache.is_live() }).await;
    match cache.view().await {
        Err(ClusterError::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    etcd.resume().unwrap();
    eventually("the watch is live again", || async { cache.is_live() }).await;
    assert!(cache.syncs() >= 2);
    let report: agentenv_cluster::node::Report = Arc::new(|| node("n3"));
    let _n3 = Registration::start(
        other.clone(),
        Duration::from_secs(60),
        Duration::from_secs(30),
        report,
    )
    .await
    .unwrap();
    eventually("a node registered after the outage", || async {
        summary(&cache.view().await.unwrap())
            .iter()
            .any(|(n, _)| n == "n3")
    })
    .await;
}
