//! Millisecond tests of the template builder over the in-memory fake backend.

use std::sync::Arc;

use crate::fake::FakeBackend;
use crate::fake::fake_tests::{me, open};
use crate::sandboxes::*;

async fn wait_built(s: &Sandboxes, t: &BuiltTemplate) -> BuildView {
    wait_built_as(s, &me(), t).await
}

async fn wait_built_as(s: &Sandboxes, caller: &Caller, t: &BuiltTemplate) -> BuildView {
    for _ in 0..500 {
        let v = s
            .build_status(caller, &t.template_id, &t.build_id, 0)
            .unwrap();
        if matches!(v.status, BuildStatus::Ready | BuildStatus::Error) {
            return v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    panic!("build did not end");
}

#[tokio::test]
async fn a_build_runs_its_steps_in_order_and_snapshots_with_the_start_command_running() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let t = s
        .request_build(&me(), "app:v1", &["stable".into()], BuildSize::default())
        .unwrap();
    assert_eq!(t.names, ["app:stable", "app:v1"]);
    let hash = "ab".repeat(32);
    assert!(!s.build_file_present(&me(), &t.template_id, &hash).unwrap());
    let copy = Step::Copy {
        src: "hello.txt".into(),
        dest: "out/".into(),
        user: None,
        mode: Some(0o640),
        files_hash: hash.clone(),
    };
    let plan = BuildPlan {
        steps: vec![
            Step::Env(vec![("GREETING".into(), "hi".into())]),
            Step::Workdir("/app".into()),
            copy,
            Step::Run {
                cmd: "make".into(),
                user: Some("root".into()),
            },
            Step::User("root".into()),
            Step::Run {
                cmd: "whoami".into(),
                user: None,
            },
        ],
        start_cmd: Some("python3 -m http.server".into()),
        ready_cmd: Some("ss -ltn | grep :8000".into()),
        ..Default::default()
    };
    // COPY needs its upload first.
    assert!(matches!(
        s.start_build(&me(), &t.template_id, &t.build_id, plan.clone()),
        Err(LifecycleError::Invalid(_))
    ));
    s.put_build_file(&me(), &t.template_id, &hash, b"\x1f\x8b not really gzip")
        .unwrap();
    assert!(s.build_file_present(&me(), &t.template_id, &hash).unwrap());
    s.start_build(&me(), &t.template_id, &t.build_id, plan.clone())
        .unwrap();
    assert!(matches!(
        s.start_build(&me(), &t.template_id, &t.build_id, plan),
        Err(LifecycleError::Invalid(_))
    ));
    let v = wait_built(&s, &t).await;
    assert_eq!(v.status, BuildStatus::Ready, "{:?}", v.failure);
    let execs = fake.execs.lock().unwrap().clone();
    let cmds: Vec<(&str, &str, Option<&str>, bool)> = execs
        .iter()
        .map(|(_, r)| {
            (
                r.cmd.as_str(),
                r.user.as_str(),
                r.cwd.as_deref(),
                r.background,
            )
        })
        .collect();
    assert!(cmds[0].0.starts_with("mkdir -p '/app'") && cmds[0].1 == "root");
    assert!(cmds[1].0.contains("d='/app/out/'") && cmds[1].0.contains("tar -xz"));
    assert!(execs[1].1.stdin_b64.is_some());
    assert_eq!(cmds[2], ("make", "root", Some("/app"), false));
    assert_eq!(cmds[3].0, "id -u 'root'");
    assert_eq!(cmds[4], ("whoami", "root", Some("/app"), false));
    assert_eq!(
        cmds[5],
        ("python3 -m http.server", "root", Some("/app"), true)
    );
    assert_eq!(cmds[6].0, "ss -ltn | grep :8000");
    // A ready check may run as long as the ready deadline leaves (E2B's `wait_for_timeout(10_000)`
    // is `sleep 10`).
    assert!(execs[6].1.timeout_ms > 60_000, "{}", execs[6].1.timeout_ms);
    assert!(
        execs
            .iter()
            .skip(2)
            .all(|(_, r)| r.envs.get("GREETING").map(String::as_str) == Some("hi"))
    );
    // The snapshot has the names and the template id; the build sandbox is gone.
    let snap = s
        .snapshots(&me(), None, Some("app:v1"))
        .unwrap()
        .pop()
        .expect("snapshot named app:v1");
    assert!(snap.names.contains(&"app:stable".to_string()));
    assert!(snap.names.iter().any(|n| n.starts_with(&t.template_id)));
    assert!(s.list(&me(), &ListFilter::default()).is_empty());
    assert_eq!(
        s.template_by_alias(&me(), "app").as_deref(),
        Some(t.template_id.as_str())
    );
    assert!(s.template_by_alias(&me(), "nope").is_none());
    // Logs page from an offset; each step's lines carry its number.
    assert!(
        v.logs
            .iter()
            .any(|l| l.step.as_deref() == Some("3") && l.message.contains("COPY hello.txt out/"))
    );
    let tail = s
        .build_status(&me(), &t.template_id, &t.build_id, v.logs.len() - 1)
        .unwrap();
    assert_eq!(tail.logs.len(), 1);
    // A second build of the name keeps the template id.
    let again = s
        .request_build(&me(), "app", &[], BuildSize::default())
        .unwrap();
    assert_eq!(again.template_id, t.template_id);
    assert_ne!(again.build_id, t.build_id);
}

#[tokio::test]
async fn a_failing_step_fails_the_build_with_its_number_and_kills_the_vm() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    *fake.net_off.lock().unwrap() = Some("not root".into());
    let s = open(dir.path(), fake.clone()).await;
    let t = s
        .request_build(
            &me(),
            "broken",
            &[],
            BuildSize {
                vcpus: None,
                memory_mib: Some(1024),
            },
        )
        .unwrap();
    let plan = BuildPlan {
        steps: vec![
            Step::Run {
                cmd: "true".into(),
                user: None,
            },
            Step::Run {
                cmd: "exit 3".into(),
                user: None,
            },
            Step::Run {
                cmd: "never".into(),
                user: None,
            },
        ],
        ..Default::default()
    };
    s.start_build(&me(), &t.template_id, &t.build_id, plan)
        .unwrap();
    let v = wait_built(&s, &t).await;
    assert_eq!(v.status, BuildStatus::Error);
    let f = v.failure.unwrap();
    assert_eq!(f.step.as_deref(), Some("2"));
    // Without networking the log says why downloads will fail.
    assert!(
        v.logs
            .iter()
            .any(|l| l.level == LogLevel::Warn && l.message.contains("not root"))
    );
    assert!(f.message.contains("exit status 3"), "{}", f.message);
    assert_eq!(fake.execs.lock().unwrap().len(), 2);
    // Its 1 GiB machine came from a base template of that size, built once.
    assert!(
        fake.built
            .lock()
            .unwrap()
            .iter()
            .any(|t| t.id == "base-1c-1024m" && t.memory_mib == 1024)
    );
    assert!(matches!(
        s.request_build(
            &me(),
            "huge",
            &[],
            BuildSize {
                vcpus: Some(1000),
                memory_mib: None
            }
        ),
        Err(LifecycleError::Invalid(_))
    ));
    assert!(s.snapshots(&me(), None, None).unwrap().is_empty());
    assert!(s.list(&me(), &ListFilter::default()).is_empty());
    // Unknown builds and other tenants' templates are not found; a bad hash is refused.
    let other = Caller::Tenant("other".into());
    assert!(matches!(
        s.build_status(&other, &t.template_id, &t.build_id, 0),
        Err(LifecycleError::TemplateNotFound(_))
    ));
    assert!(matches!(
        s.build_status(&me(), &t.template_id, "bld-nope", 0),
        Err(LifecycleError::TemplateNotFound(_))
    ));
    assert!(matches!(
        s.build_file_present(&me(), &t.template_id, "../x"),
        Err(LifecycleError::Invalid(_))
    ));
    assert!(matches!(
        s.request_build(&me(), "bad name", &[], BuildSize::default()),
        Err(LifecycleError::Invalid(_))
    ));
}

#[tokio::test]
async fn a_build_from_an_image_pulls_it_once_into_a_template_of_the_callers() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Arc::new(FakeBackend::default());
    let s = open(dir.path(), fake.clone()).await;
    let image = format!("registry.test/app:{}", rand::random::<u16>());
    let plan = BuildPlan {
        from_image: Some(image.clone()),
        steps: vec![Step::Run {
            cmd: "true".into(),
            user: None,
        }],
        ..Default::default()
    };
    for name in ["one", "two"] {
        let t = s
            .request_build(&me(), name, &[], BuildSize::default())
            .unwrap();
        s.start_build(&me(), &t.template_id, &t.build_id, plan.clone())
            .unwrap();
        let v = wait_built(&s, &t).await;
        assert_eq!(v.status, BuildStatus::Ready, "{:?}", v.failure);
    }
    let pulled: Vec<_> = fake
        .built
        .lock()
        .unwrap()
        .iter()
        .filter(|t| t.from_image.as_deref() == Some(image.as_str()))
        .map(|t| t.id.clone())
        .collect();
    assert_eq!(pulled.len(), 1, "pulled once: {pulled:?}");
    assert!(pulled[0].starts_with("img-"), "{pulled:?}");
    // Its builds ran in sandboxes of that template.
    assert!(
        fake.execs
            .lock()
            .unwrap()
            .iter()
            .any(|(_, r)| r.cmd == "true")
    );
    // Another tenant's build from the same image gets a template of its own.
    let other = Caller::Tenant("beta".into());
    let t = s
        .request_build(&other, "three", &[], BuildSize::default())
        .unwrap();
    s.start_build(&other, &t.template_id, &t.build_id, plan)
        .unwrap();
    let v = wait_built_as(&s, &other, &t).await;
    assert_eq!(v.status, BuildStatus::Ready, "{:?}", v.failure);
    let n = fake
        .built
        .lock()
        .unwrap()
        .iter()
        .filter(|t| t.from_image.as_deref() == Some(image.as_str()))
        .count();
    assert_eq!(n, 2);
}

#[tokio::test]
async fn a_builds_sandbox_ends_with_a_restart() {
    use crate::backend::{RecoveredVm, VmState};
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path(), Arc::new(FakeBackend::default())).await;
    let base = || CreateRequest {
        template: "base".into(),
        ..Default::default()
    };
    let mut build = base();
    build
        .metadata
        .insert(BUILD_MARK.into(), "some-template".into());
    let (d, kept) = (
        s.create(&me(), build, None).await.unwrap(),
        s.create(&me(), base(), None).await.unwrap(),
    );
    drop(s);
    let fake2 = Arc::new(FakeBackend::default());
    let rv = |id: &str| RecoveredVm {
        id: id.into(),
        template_id: "base".into(),
        state: Some(VmState::Running),
        detail: String::new(),
    };
    *fake2.recovered.lock().unwrap() = vec![rv(&d.sandbox_id), rv(&kept.sandbox_id)];
    let s = open(dir.path(), fake2.clone()).await;
    assert!(
        s.get(&d.sandbox_id).is_none(),
        "no build survives a restart"
    );
    assert!(s.get(&kept.sandbox_id).is_some());
    let kills = fake2.kills.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(kills, 1, "the build's VM is killed");
}
