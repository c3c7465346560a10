//! Millisecond tests of the lifecycle layer over the in-memory fake backend.
use super::FakeBackend;
use crate::backend::{RecoveredVm, VmBackend, VmState};
use crate::sandboxes::*;
use crate::store::SandboxStore;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(crate) async fn open(dir: &std::path::Path, fake: Arc<FakeBackend>) -> Arc<Sandboxes> {
    open_with(dir, fake, LifecycleConfig::default()).await
}

pub(crate) async fn open_with(
    dir: &std::path::Path,
    fake: Arc<FakeBackend>,
    cfg: LifecycleConfig,
) -> Arc<Sandboxes> {
    let ring =
        crate::tenants::KeyRing::open(dir, crate::keys::generate_api_key(), Quota::default(), None);
    Sandboxes::open(
        fake,
        SandboxStore::open(dir).unwrap(),
        Arc::new(NoOps),
        cfg,
        Arc::new(ring),
        Arc::new(crate::volumes::Volumes::open(dir, "key").unwrap()),
    )
    .await
    .unwrap()
}

/// Backend call timings go nowhere here.
struct NoOps;
impl OpObserver for NoOps {
    fn observe_op(&self, _: &'static str, _: std::time::Duration) {}
}

/// The server key's tenant, as its requests arrive.
pub(crate) fn me() -> Caller {
    Caller::Tenant(crate::tenants::DEFAULT_TENANT.into())
}

fn req(template: &str) -> CreateRequest {
    CreateRequest {
        template: template.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn idempotent_creates_make_one_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let key = format!("k-{}", rand::random::<u32>());
    let a = s
        .create(&me(), req("base"), Some(key.clone()))
        .await
        .unwrap();
    let b = s.create(&me(), req("default"), Some(key)).await.unwrap();
    assert_eq!(a.sandbox_id, b.sandbox_id);
    assert_eq!(fake.creates.load(Ordering::SeqCst), 1);
    let c = s.create(&me(), req("base"), None).await.unwrap();
    assert_ne!(a.sandbox_id, c.sandbox_id);
    assert!(matches!(
        s.create(&me(), req("nope"), None).await,
        Err(LifecycleError::TemplateNotFound(_))
    ));
}

#[tokio::test]
async fn expiry_kills_or_pauses() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let kill_me = s
        .create(
            &me(),
            CreateRequest {
                timeout_s: Some(0),
                ..req("base")
            },
            None,
        )
        .await
        .unwrap();
    let pause_me = s
        .create(
            &me(),
            CreateRequest {
                timeout_s: Some(0),
                auto_pause: true,
                ..req("base")
            },
            None,
        )
        .await
        .unwrap();
    let keep = s.create(&me(), req("base"), None).await.unwrap();
    s.expire_due().join_all().await;
    assert!(s.get(&kill_me.sandbox_id).is_none());
    assert_eq!(
        s.get(&pause_me.sandbox_id).unwrap().state,
        SandboxState::Paused
    );
    assert_eq!(
        s.get(&keep.sandbox_id).unwrap().state,
        SandboxState::Running
    );
    assert_eq!(fake.vm_state(&pause_me.sandbox_id), Some(VmState::Paused));
    assert!(matches!(
        s.pause(&me(), &pause_me.sandbox_id).await,
        Err(LifecycleError::AlreadyPaused(_))
    ));
    assert!(matches!(
        s.set_timeout(&me(), &pause_me.sandbox_id, 10).await,
        Err(LifecycleError::Paused(_))
    ));
    let (rec, resumed) = s
        .connect(&me(), &pause_me.sandbox_id, Some(60))
        .await
        .unwrap();
    assert!(resumed && rec.state == SandboxState::Running);
}

#[tokio::test]
async fn restart_reconciles_records_with_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let (a, b, c) = (
        s.create(&me(), req("base"), None).await.unwrap(),
        s.create(&me(), req("base"), None).await.unwrap(),
        s.create(&me(), req("base"), None).await.unwrap(),
    );
    s.pause(&me(), &b.sandbox_id).await.unwrap();
    drop(s);
    // The runtime kept a (running) and b (paused), lost c, and has an orphan VM.
    let fake2 = Arc::new(FakeBackend::default());
    let rv = |id: &str, state| RecoveredVm {
        id: id.into(),
        template_id: "base".into(),
        state,
        detail: String::new(),
    };
    *fake2.recovered.lock().unwrap() = vec![
        rv(&a.sandbox_id, Some(VmState::Running)),
        rv(&b.sandbox_id, Some(VmState::Paused)),
        rv(&c.sandbox_id, None),
        rv("orphan", Some(VmState::Running)),
    ];
    let s = open(dir.path(), fake2.clone()).await;
    assert_eq!(s.get(&a.sandbox_id).unwrap().state, SandboxState::Running);
    assert_eq!(s.get(&b.sandbox_id).unwrap().state, SandboxState::Paused);
    assert!(s.get(&c.sandbox_id).is_none());
    assert_eq!(fake2.vm_state("orphan"), None, "the orphan VM was killed");
    assert_eq!(s.list(&me(), &ListFilter::default()).len(), 2);
}

#[tokio::test]
async fn snapshots_name_list_page_and_delete() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let a = s.create(&me(), req("base"), None).await.unwrap();
    let b = s.create(&me(), req("base"), None).await.unwrap();
    let s1 = s
        .snapshot(&me(), &a.sandbox_id, Some("app".into()), true)
        .await
        .unwrap();
    let s2 = s
        .snapshot(&me(), &a.sandbox_id, Some("app:v2".into()), true)
        .await
        .unwrap();
    let s3 = s
        .snapshot(&me(), &b.sandbox_id, Some("app".into()), false)
        .await
        .unwrap();
    assert_eq!(s3.names, vec!["app:default".to_string()]);
    // The name moved from s1 to s3.
    let of_a = s.snapshots(&me(), Some(&a.sandbox_id), None).unwrap();
    assert_eq!(
        of_a.iter().map(|x| x.id.clone()).collect::<Vec<_>>(),
        vec![s1.id.clone(), s2.id.clone()]
    );
    assert!(of_a[0].names.is_empty());
    assert_eq!(s.snapshots(&me(), None, Some("app")).unwrap()[0].id, s3.id);
    assert!(matches!(
        s.snapshots(&me(), None, Some("a/b")),
        Err(LifecycleError::Invalid(_))
    ));
    assert!(matches!(
        s.snapshot(&me(), &a.sandbox_id, Some("bad name".into()), true)
            .await,
        Err(LifecycleError::Invalid(_))
    ));
    assert!(matches!(
        s.snapshot(&me(), "ghost", None, true).await,
        Err(LifecycleError::SandboxNotFound(_))
    ));
    // A snapshot name creates a sandbox.
    let from = s.create(&me(), req("app:v2"), None).await.unwrap();
    assert_eq!(from.template_id, s2.id);
    s.delete_snapshot(&me(), "app:v2").unwrap();
    assert!(matches!(
        s.delete_snapshot(&me(), &s2.id),
        Err(LifecycleError::SnapshotNotFound(_))
    ));
    assert!(matches!(
        s.create(&me(), req("app:v2"), None).await,
        Err(LifecycleError::TemplateNotFound(_))
    ));
}

#[tokio::test]
async fn fork_checks_count_and_copies_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let mut r = req("base");
    r.metadata = BTreeMap::from([("k".to_string(), "v".to_string())]);
    let src = s.create(&me(), r, None).await.unwrap();
    for bad in [0, MAX_FORKS + 1] {
        assert!(matches!(
            s.fork(&me(), &src.sandbox_id, Some(bad), None).await,
            Err(LifecycleError::Invalid(_))
        ));
    }
    assert!(matches!(
        s.fork(&me(), "ghost", None, None).await,
        Err(LifecycleError::SandboxNotFound(_))
    ));
    let n = rand::random_range(1..=MAX_FORKS);
    let forks = s
        .fork(&me(), &src.sandbox_id, Some(n), Some(30))
        .await
        .unwrap();
    assert_eq!(forks.len(), n as usize);
    let mut ids = std::collections::BTreeSet::new();
    for f in forks {
        let f = f.unwrap();
        assert_eq!(f.metadata, src.metadata);
        assert_ne!(f.access_token, src.access_token);
        assert!(ids.insert(f.sandbox_id.clone()));
        assert_eq!(s.get(&f.sandbox_id).unwrap().state, SandboxState::Running);
    }
    assert_eq!(s.list(&me(), &ListFilter::default()).len(), n as usize + 1);
}

#[tokio::test(start_paused = true)]
async fn a_wedged_vm_is_killed_at_its_deadline_and_blocks_no_other_expiry() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let mut cfg = LifecycleConfig::default();
    cfg.deadlines.pause = std::time::Duration::from_secs(10);
    let s = open_with(dir.path(), fake.clone(), cfg).await;
    let due = |auto_pause| CreateRequest {
        timeout_s: Some(0),
        auto_pause,
        ..req("base")
    };
    let wedged = s.create(&me(), due(true), None).await.unwrap().sandbox_id;
    let other = s.create(&me(), due(false), None).await.unwrap().sandbox_id;
    fake.wedged.lock().unwrap().insert(wedged.clone());
    let tasks = s.expire_due();
    // The other sandbox expires while the wedged one's pause is still pending.
    for _ in 0..100 {
        if s.get(&other).is_none() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        s.get(&other).is_none(),
        "expiry of {other} waited on the wedged VM"
    );
    assert!(s.get(&wedged).is_some());
    // A second reaper pass does not start a second expiry of the same sandbox.
    assert!(s.expire_due().is_empty());
    tasks.join_all().await;
    assert!(s.get(&wedged).is_none(), "the wedged sandbox ends gone");
    assert_eq!(fake.vm_state(&wedged), None, "and its VM is killed");
    assert!(matches!(
        s.kill(&me(), &wedged).await,
        Err(LifecycleError::SandboxNotFound(_))
    ));
    // Its record is gone from disk as well: a restart does not bring it back.
    drop(s);
    let s = open(dir.path(), fake.clone()).await;
    assert!(s.get(&wedged).is_none());
}

#[tokio::test(start_paused = true)]
async fn wedged_calls_answer_deadline_exceeded() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let mut cfg = LifecycleConfig::default();
    cfg.deadlines.snapshot = std::time::Duration::from_secs(5);
    let s = open_with(dir.path(), fake.clone(), cfg).await;
    let id = s.create(&me(), req("base"), None).await.unwrap().sandbox_id;
    fake.wedged.lock().unwrap().insert(id.clone());
    let e = s.snapshot(&me(), &id, None, true).await.unwrap_err();
    assert!(
        matches!(&e, LifecycleError::DeadlineExceeded { op: "snapshot", id: i, .. } if *i == id),
        "{e:?}"
    );
    assert!(s.get(&id).is_none() && fake.vm_state(&id).is_none());
}

#[tokio::test]
async fn a_vm_that_dies_on_its_own_takes_its_sandbox_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let n = rand::random_range(2..6);
    let mut ids = vec![];
    for _ in 0..n {
        ids.push(s.create(&me(), req("base"), None).await.unwrap().sandbox_id);
    }
    let dead = ids.swap_remove(rand::random_range(0..n));
    fake.vms.lock().unwrap().remove(&dead);
    let kills = fake.kills.load(Ordering::SeqCst);
    s.reap_dead().join_all().await;
    assert!(s.get(&dead).is_none(), "the dead VM's sandbox is gone");
    assert_eq!(
        fake.kills.load(Ordering::SeqCst),
        kills + 1,
        "its files were cleaned up"
    );
    let mut left: Vec<String> = s
        .list(&me(), &ListFilter::default())
        .into_iter()
        .map(|r| r.sandbox_id)
        .collect();
    left.sort();
    ids.sort();
    assert_eq!(left, ids, "the others keep running");
    assert!(matches!(
        s.kill(&me(), &dead).await,
        Err(LifecycleError::SandboxNotFound(_))
    ));
}

#[tokio::test]
async fn the_servers_own_pauses_resumes_and_kills_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let mut rx = s.transitions();
    let mut next = async || {
        tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
            .await
            .expect("a transition within 5 s")
            .unwrap()
    };
    let due = |auto_pause| CreateRequest {
        timeout_s: Some(0),
        auto_pause,
        ..req("base")
    };
    let paused = s.create(&me(), due(true), None).await.unwrap();
    let killed = s.create(&me(), due(false), None).await.unwrap();
    s.create(&me(), req("base"), None).await.unwrap();
    s.expire_due().join_all().await;
    let mut seen = vec![next().await, next().await];
    seen.sort_by_key(|t| format!("{t:?}"));
    let mut want = vec![
        Transition::AutoPaused(paused.sandbox_id.clone()),
        Transition::Expired {
            id: killed.sandbox_id.clone(),
            access_token: killed.access_token.clone(),
        },
    ];
    want.sort_by_key(|t| format!("{t:?}"));
    assert_eq!(seen, want);
    // Data-plane traffic resumes it once; a second call finds it running and reports nothing.
    s.auto_resume(&paused.sandbox_id).await.unwrap();
    s.auto_resume(&paused.sandbox_id).await.unwrap();
    assert_eq!(
        next().await,
        Transition::AutoResumed(paused.sandbox_id.clone())
    );
    // A client's own pause and resume are the gateway's to record: nothing is reported.
    s.pause(&me(), &paused.sandbox_id).await.unwrap();
    s.connect(&me(), &paused.sandbox_id, Some(60))
        .await
        .unwrap();
    assert!(rx.try_recv().is_err());
    // `while_in` runs only in the named state.
    let id = paused.sandbox_id.as_str();
    assert_eq!(
        s.while_in(id, SandboxState::Paused, async |_| 1).await,
        None
    );
    assert_eq!(
        s.while_in(id, SandboxState::Running, async |r| r.sandbox_id.clone())
            .await
            .as_deref(),
        Some(id)
    );
}

#[tokio::test]
async fn paused_sandboxes_expire_after_the_retention() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let keep_cfg = LifecycleConfig::default();
    let s = open_with(dir.path(), fake.clone(), keep_cfg).await;
    let id = s.create(&me(), req("base"), None).await.unwrap().sandbox_id;
    s.pause(&me(), &id).await.unwrap();
    let paused_at = s
        .get(&id)
        .unwrap()
        .paused_at_ms
        .expect("pause time recorded");
    assert!((now_ms() - paused_at).abs() < 60_000);
    s.expire_due().join_all().await;
    assert_eq!(
        s.get(&id).unwrap().state,
        SandboxState::Paused,
        "kept within the retention"
    );
    // The same records under a zero retention: the paused sandbox is deleted, its VM too.
    drop(s);
    fake.recovered.lock().unwrap().push(RecoveredVm {
        id: id.clone(),
        template_id: "base".into(),
        state: Some(VmState::Paused),
        detail: String::new(),
    });
    let cfg = LifecycleConfig {
        paused_retention: std::time::Duration::ZERO,
        ..Default::default()
    };
    let s = open_with(dir.path(), fake.clone(), cfg).await;
    let running = s.create(&me(), req("base"), None).await.unwrap().sandbox_id;
    s.expire_due().join_all().await;
    assert!(s.get(&id).is_none() && fake.vm_state(&id).is_none());
    assert_eq!(s.get(&running).unwrap().state, SandboxState::Running);
    // A resume clears the pause time.
    s.pause(&me(), &running).await.unwrap();
    let (rec, _) = s.connect(&me(), &running, Some(60)).await.unwrap();
    assert_eq!(rec.paused_at_ms, None);
}

#[tokio::test]
async fn an_unreadable_record_does_not_stop_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let id = s.create(&me(), req("base"), None).await.unwrap().sandbox_id;
    drop(s);
    std::fs::write(dir.path().join("server/sandboxes/broken.json"), b"\xff{").unwrap();
    fake.recovered.lock().unwrap().push(RecoveredVm {
        id: id.clone(),
        template_id: "base".into(),
        state: Some(VmState::Running),
        detail: String::new(),
    });
    let s = open(dir.path(), fake.clone()).await;
    assert_eq!(s.get(&id).unwrap().state, SandboxState::Running);
    assert!(
        dir.path()
            .join("server/quarantine")
            .read_dir()
            .unwrap()
            .count()
            == 1
    );
}

#[tokio::test]
async fn quotas_answer_429_and_hold_under_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let max_running = rand::random_range(2..6usize);
    let cfg = LifecycleConfig {
        quota: Quota {
            max_running: Some(max_running),
            max_paused: Some(1),
            max_memory_mb: None,
            ..Default::default()
        },
        ..Default::default()
    };
    let s = open_with(dir.path(), fake.clone(), cfg).await;
    // Twice as many concurrent creates as the quota allows: exactly `max_running` succeed.
    let results = futures_util::future::join_all(
        (0..2 * max_running).map(|_| async { s.create(&me(), req("base"), None).await }),
    )
    .await;
    let ok: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(ok.len(), max_running);
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(matches!(r, LifecycleError::QuotaExceeded(_)), "{r:?}");
    }
    assert_eq!(
        fake.vms.lock().unwrap().len(),
        max_running,
        "no VM beyond the quota"
    );
    // Forks count as running sandboxes too.
    let src = ok[0].sandbox_id.clone();
    assert!(matches!(
        s.fork(&me(), &src, Some(1), None).await,
        Err(LifecycleError::QuotaExceeded(_))
    ));
    // One paused is allowed, a second is not; resuming needs a running slot.
    s.pause(&me(), &ok[0].sandbox_id).await.unwrap();
    assert!(matches!(
        s.pause(&me(), &ok[1].sandbox_id).await,
        Err(LifecycleError::QuotaExceeded(_))
    ));
    let fresh = s.create(&me(), req("base"), None).await.unwrap();
    assert!(matches!(
        s.connect(&me(), &ok[0].sandbox_id, None).await,
        Err(LifecycleError::QuotaExceeded(_))
    ));
    s.kill(&me(), &fresh.sandbox_id).await.unwrap();
    let (_, resumed) = s.connect(&me(), &ok[0].sandbox_id, None).await.unwrap();
    assert!(resumed);
}

#[tokio::test]
async fn tags_move_between_builds_of_a_name_and_stay_in_their_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let a = s.create(&me(), req("base"), None).await.unwrap();
    let tag = format!("v{}", rand::random::<u16>());
    let v1 = s
        .snapshot(&me(), &a.sandbox_id, Some(format!("app:{tag}")), true)
        .await
        .unwrap();
    let v2 = s
        .snapshot(&me(), &a.sandbox_id, Some("app:v2".into()), true)
        .await
        .unwrap();
    let named = |n: &str| {
        s.snapshots(&me(), None, Some(n))
            .unwrap()
            .into_iter()
            .map(|x| x.id)
            .collect::<Vec<_>>()
    };
    let (build, tags) = s
        .assign_tags(
            &me(),
            &format!("app:{tag}"),
            &["prod".into(), "app:stable".into()],
        )
        .unwrap();
    assert_eq!(build, crate::sandboxes::build_uuid(&v1.id));
    assert_eq!(tags, ["prod", "stable"]);
    assert_eq!(named("app:prod"), std::slice::from_ref(&v1.id));
    // A tag moves: v2 takes prod from v1.
    s.assign_tags(&me(), "app:v2", &["prod".into()]).unwrap();
    assert_eq!(named("app:prod"), std::slice::from_ref(&v2.id));
    assert_eq!(named("app:stable"), std::slice::from_ref(&v1.id));
    s.remove_tags(&me(), "app", &["stable".into()]).unwrap();
    assert!(named("app:stable").is_empty());
    for bad in [":x", "app:", "other:x"] {
        let e = s.assign_tags(&me(), "app:v2", &[bad.into()]).unwrap_err();
        assert!(matches!(e, LifecycleError::Invalid(_)), "{bad}: {e:?}");
    }
    // Another tenant neither sees nor tags them.
    let other = Caller::Tenant("beta".into());
    let e = s
        .assign_tags(&other, "app:v2", &["mine".into()])
        .unwrap_err();
    assert!(matches!(e, LifecycleError::TemplateNotFound(_)), "{e:?}");
    let e = s.remove_tags(&other, "app", &["prod".into()]).unwrap_err();
    assert!(matches!(e, LifecycleError::TemplateNotFound(_)), "{e:?}");
    assert_eq!(named("app:prod"), [v2.id]);
}

#[tokio::test]
async fn a_handoff_whose_snapshot_cannot_be_stored_fails_at_once_and_leaves_no_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    *fake.store_failure.lock().unwrap() = Some("bucket: 500 Internal Server Error".into());
    let s = open(dir.path(), fake.clone()).await;
    let id = s.create(&me(), req("base"), None).await.unwrap().sandbox_id;
    s.pause(&me(), &id).await.unwrap();
    // Well inside the snapshot deadline (300 s): the failure ends the wait.
    let wait = std::time::Duration::from_secs(30);
    let r = tokio::time::timeout(wait, s.handoff(&Caller::Server, &id)).await;
    assert!(matches!(r, Ok(Err(LifecycleError::Store(_)))), "{r:?}");
    assert!(fake.snaps.lock().unwrap().is_empty(), "its snapshot stays");
    // Still paused here, and it resumes.
    assert!(s.connect(&me(), &id, None).await.unwrap().1);
}
