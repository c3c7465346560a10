//! Snapshot quotas over the fake backend: each key's count and bytes, and the server's stored-bytes
//! budget; the operator's key is held only to the server's budget, the server's own handoffs to none.
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::fake::FakeBackend;
use crate::fake::fake_tests::{me, open_with};
use crate::sandboxes::*;
use crate::tenants;

const MIB: u64 = 1 << 20;

fn tenant(dir: &std::path::Path, name: &str, quota: Quota) -> Caller {
    tenants::create_key(dir, name, quota).unwrap();
    Caller::Tenant(name.into())
}

async fn sandbox(s: &Sandboxes, who: &Caller) -> String {
    let req = CreateRequest {
        template: "base".into(),
        ..Default::default()
    };
    s.create(who, req, None).await.unwrap().sandbox_id
}

fn count(s: &Sandboxes, who: &Caller) -> usize {
    s.snapshots(who, None, None).unwrap().len()
}

#[tokio::test]
async fn a_keys_snapshots_are_bounded_in_number_also_under_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open_with(dir.path(), fake.clone(), LifecycleConfig::default()).await;
    let max = rand::random_range(2..6usize);
    let quota = Quota {
        max_snapshots: Some(max),
        ..Default::default()
    };
    let (a, b) = (
        tenant(dir.path(), "alpha", quota),
        tenant(dir.path(), "beta", Quota::default()),
    );
    let (sa, sb) = (sandbox(&s, &a).await, sandbox(&s, &b).await);
    // Twice as many concurrent snapshots as the quota allows: exactly `max` are taken.
    let results = futures_util::future::join_all(
        (0..2 * max).map(|_| async { s.snapshot(&a, &sa, None, true).await }),
    )
    .await;
    let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(refused.len(), max, "{refused:?}");
    for e in refused {
        assert!(
            matches!(e, LifecycleError::QuotaExceeded(m) if m.contains("key alpha: snapshots")),
            "{e:?}"
        );
    }
    assert_eq!(count(&s, &a), max);
    // Others are not held to alpha's quota, and a deleted snapshot makes room.
    let sd = sandbox(&s, &me()).await;
    for _ in 0..=max {
        s.snapshot(&b, &sb, None, true).await.unwrap();
        s.snapshot(&me(), &sd, None, true).await.unwrap();
    }
    let first = s.snapshots(&a, None, None).unwrap()[0].id.clone();
    s.delete_snapshot(&a, &first).unwrap();
    s.snapshot(&a, &sa, None, false).await.unwrap();
    assert!(matches!(
        s.snapshot(&a, &sa, None, false).await,
        Err(LifecycleError::QuotaExceeded(_))
    ));
    assert_eq!(count(&s, &a), max);
}

#[tokio::test]
async fn a_snapshot_that_takes_its_key_over_its_bytes_is_undone_and_its_name_stays() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open_with(dir.path(), fake.clone(), LifecycleConfig::default()).await;
    let gb = rand::random_range(1..4u64);
    let quota = Quota {
        max_snapshot_gb: Some(gb),
        ..Default::default()
    };
    let a = tenant(dir.path(), "alpha", quota);
    let sa = sandbox(&s, &a).await;
    // Over half the limit each: the first fits, the second takes the key over.
    let big = (gb << 10) * MIB / 2 + rand::random_range(1..64) * MIB;
    fake.snapshot_bytes.store(big, Ordering::Relaxed);
    let app = || Some("app".to_string());
    let kept = s.snapshot(&a, &sa, app(), true).await.unwrap();
    let e = s.snapshot(&a, &sa, app(), true).await.unwrap_err();
    assert!(
        matches!(&e, LifecycleError::QuotaExceeded(m) if m.contains("key alpha: snapshots on this node's disk")),
        "{e:?}"
    );
    // Undone: gone from the node, and the name it took is back on the older snapshot.
    assert_eq!(fake.snaps.lock().unwrap().len(), 1);
    let listed = s.snapshots(&a, None, Some("app")).unwrap();
    assert_eq!((listed.len(), listed[0].id.as_str()), (1, kept.id.as_str()));
    assert_eq!(listed[0].names, vec!["app:default".to_string()]);
    // Up to the limit exactly fits; at the limit, nothing more is taken, of any size.
    fake.snapshot_bytes
        .store((gb << 30) - big, Ordering::Relaxed);
    s.snapshot(&a, &sa, None, false).await.unwrap();
    fake.snapshot_bytes.store(0, Ordering::Relaxed);
    assert!(matches!(
        s.snapshot(&a, &sa, app(), true).await,
        Err(LifecycleError::QuotaExceeded(_))
    ));
    assert_eq!(count(&s, &a), 2);
    // The operator's key has no snapshot quota of its own.
    fake.snapshot_bytes.store(big, Ordering::Relaxed);
    let sd = sandbox(&s, &me()).await;
    for _ in 0..3 {
        s.snapshot(&me(), &sd, None, true).await.unwrap();
    }
    assert_eq!(count(&s, &me()), 3);
}

#[tokio::test]
async fn the_servers_stored_bytes_budget_refuses_every_keys_snapshots_but_not_handoffs() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    fake.store_snapshots.store(true, Ordering::Relaxed);
    let gb = rand::random_range(1..4u64);
    let cfg = LifecycleConfig {
        max_stored_gb: Some(gb),
        ..Default::default()
    };
    let s = open_with(dir.path(), fake.clone(), cfg).await;
    let a = tenant(dir.path(), "alpha", Quota::default());
    let (sa, sd) = (sandbox(&s, &a).await, sandbox(&s, &me()).await);
    let part = (gb << 30) / 2;
    fake.snapshot_bytes.store(part, Ordering::Relaxed);
    s.snapshot(&me(), &sd, None, true).await.unwrap();
    s.snapshot(&a, &sa, None, true).await.unwrap();
    // Full: refused before a capture, for the operator's key too.
    for (who, id) in [(&me(), &sd), (&a, &sa)] {
        let e = s.snapshot(who, id, None, true).await.unwrap_err();
        assert!(
            matches!(&e, LifecycleError::StorageFull(m) if m.contains("storage is full")),
            "{e:?}"
        );
    }
    // Room for a small one only: a larger one is undone.
    let first = s.snapshots(&a, None, None).unwrap()[0].id.clone();
    s.delete_snapshot(&a, &first).unwrap();
    fake.snapshot_bytes.store(part + MIB, Ordering::Relaxed);
    assert!(matches!(
        s.snapshot(&a, &sa, None, true).await,
        Err(LifecycleError::StorageFull(_))
    ));
    assert_eq!(fake.snaps.lock().unwrap().len(), 1);
    fake.snapshot_bytes.store(MIB, Ordering::Relaxed);
    s.snapshot(&a, &sa, None, true).await.unwrap();
    fake.snapshot_bytes.store(part - MIB, Ordering::Relaxed);
    s.snapshot(&me(), &sd, None, false).await.unwrap();
    assert!(matches!(
        s.snapshot(&me(), &sd, None, false).await,
        Err(LifecycleError::StorageFull(_))
    ));
    // The server's own handoff of a paused sandbox (cluster moves) is not refused.
    s.pause(&me(), &sd).await.unwrap();
    s.handoff(&Caller::Server, &sd).await.unwrap();
    assert_eq!(fake.snaps.lock().unwrap().len(), 4);
}

#[test]
fn a_key_made_before_snapshot_quotas_has_none_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let running = rand::random_range(1..9);
    let quota = Quota {
        max_running: Some(running),
        ..Default::default()
    };
    tenants::create_key(dir.path(), "old", quota.clone()).unwrap();
    // keys.json as an older server wrote it: no snapshot fields.
    let path = dir.path().join("server/keys.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let q = v["keys"][0]["quota"].as_object_mut().unwrap();
    assert!(q.remove("max_snapshots").is_some() && q.remove("max_snapshot_gb").is_some());
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let ring = tenants::KeyRing::open(
        dir.path(),
        crate::keys::generate_api_key(),
        Quota::default(),
        None,
    );
    assert_eq!(ring.quota_of("old"), quota);
}
