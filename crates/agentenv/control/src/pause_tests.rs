//! Filesystem-only pauses over the fake backend: asked for by a pause or kept for the auto-pause, a
//! resume by connect only (cold boot with the sandbox's environment), never by traffic.
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::fake::FakeBackend;
use crate::fake::fake_tests::{me, open};
use crate::sandboxes::*;

fn env() -> BTreeMap<String, String> {
    BTreeMap::from([(
        "K3_SECRET".into(),
        format!("{:016x}", rand::random::<u64>()),
    )])
}

#[tokio::test]
async fn a_pause_without_memory_resumes_only_by_connect_with_its_environment() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let env_vars = env();
    let req = CreateRequest {
        template: "base".into(),
        env_vars: env_vars.clone(),
        auto_resume: true,
        ..Default::default()
    };
    let id = s.create(&me(), req, None).await.unwrap().sandbox_id;
    s.pause_keeping(&me(), &id, false).await.unwrap();
    let rec = s.get(&id).unwrap();
    assert!(rec.state == SandboxState::Paused && rec.paused_filesystem);
    assert_eq!(fake.boots.lock().unwrap().get(&id), Some(&BTreeMap::new()));
    // Traffic does not wake it (it would have to boot); connect does, with its environment.
    assert!(matches!(
        s.auto_resume(&id).await,
        Err(LifecycleError::Paused(_))
    ));
    let (rec, resumed) = s.connect(&me(), &id, None).await.unwrap();
    assert!(resumed && rec.state == SandboxState::Running && !rec.paused_filesystem);
    assert_eq!(fake.boots.lock().unwrap().get(&id), Some(&env_vars));
    // An ordinary pause after it keeps memory again, and traffic resumes that one.
    s.pause(&me(), &id).await.unwrap();
    assert!(!s.get(&id).unwrap().paused_filesystem);
    s.auto_resume(&id).await.unwrap();
    assert_eq!(s.get(&id).unwrap().state, SandboxState::Running);
}

#[tokio::test]
async fn the_auto_pause_keeps_only_the_filesystem_when_asked_and_never_with_auto_resume() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let asked = |auto_resume| CreateRequest {
        template: "base".into(),
        timeout_s: Some(0),
        auto_pause: true,
        auto_pause_filesystem: true,
        auto_resume,
        ..Default::default()
    };
    assert!(matches!(
        s.create(&me(), asked(true), None).await,
        Err(LifecycleError::Invalid(m)) if m.contains("autoPauseMemory")
    ));
    let fs = s
        .create(&me(), asked(false), None)
        .await
        .unwrap()
        .sandbox_id;
    let full = CreateRequest {
        auto_pause_filesystem: false,
        ..asked(false)
    };
    let full = s.create(&me(), full, None).await.unwrap().sandbox_id;
    s.expire_due().join_all().await;
    let (a, b) = (s.get(&fs).unwrap(), s.get(&full).unwrap());
    assert_eq!(
        (a.state, b.state),
        (SandboxState::Paused, SandboxState::Paused)
    );
    assert!(a.paused_filesystem && !a.auto_pause_memory, "{a:?}");
    assert!(!b.paused_filesystem && b.auto_pause_memory, "{b:?}");
    let boots = fake.boots.lock().unwrap();
    assert!(boots.contains_key(&fs) && !boots.contains_key(&full));
}
