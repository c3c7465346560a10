//! An in-memory [`VmBackend`] for millisecond tests of the lifecycle layer (idempotency, timeouts,
//! auto-pause, paging, fork bookkeeping, restart reconciliation). It runs no VM and serves no agent
//! stream; the real runtime proves the seams in the QEMU and SDK tests.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::*;

/// What the fake holds.
#[derive(Default)]
pub struct FakeBackend {
    pub vms: Mutex<BTreeMap<String, VmState>>,
    pub snaps: Mutex<Vec<SnapshotInfo>>,
    /// VMs `recover` reports (set before opening `Sandboxes` to model a restart).
    pub recovered: Mutex<Vec<RecoveredVm>>,
    pub creates: AtomicUsize,
    pub kills: AtomicUsize,
    /// Sandboxes whose pause, resume and snapshot never return (a wedged QEMU); kill still works.
    pub wedged: Mutex<std::collections::HashSet<String>>,
    /// Templates "built" (instantly) besides `base`.
    pub built: Mutex<Vec<TemplateInfo>>,
    /// Egress policies of sandboxes created with one.
    pub nets: Mutex<BTreeMap<String, EgressPolicy>>,
    /// Commands `exec` ran, in order, with their sandbox. A command exits with the number after its
    /// last `exit ` (else 0) and prints itself.
    pub execs: Mutex<Vec<(String, ExecRequest)>>,
    /// What `networking_off` answers.
    pub net_off: Mutex<Option<String>>,
}

fn template() -> TemplateInfo {
    TemplateInfo {
        id: "base".into(),
        aliases: vec!["default".into()],
        vcpus: 1,
        memory_mib: 256,
        disk_mib: 2048,
        built_at: "2026-12-01T00:00:00Z".into(),
        envd_version: agentenv_envd::ENVD_VERSION.into(),
        from_image: None,
    }
}

fn vm(id: &str) -> SandboxVm {
    SandboxVm {
        id: id.into(),
        template_id: "base".into(),
        vcpus: 1,
        memory_mib: 256,
        envd_version: agentenv_envd::ENVD_VERSION.into(),
    }
}

impl FakeBackend {
    fn state(&self, id: &str) -> Option<VmState> {
        self.vms.lock().unwrap().get(id).copied()
    }
    async fn hang_if_wedged(&self, id: &str) {
        if self.wedged.lock().unwrap().contains(id) {
            std::future::pending::<()>().await;
        }
    }
}

impl VmBackend for FakeBackend {
    fn accel_name(&self) -> String {
        "fake".into()
    }
    fn templates(&self) -> Vec<TemplateInfo> {
        let mut all = vec![template()];
        all.extend(self.built.lock().unwrap().iter().cloned());
        all
    }
    fn build_template(
        &self,
        spec: TemplateSpec,
        progress: crate::backend::ProgressFn,
    ) -> BoxFuture<'_, Result<TemplateInfo, TemplateError>> {
        Box::pin(async move {
            if self.templates().iter().any(|t| t.id == spec.id) {
                return Err(TemplateError::InvalidSpec(format!("{} exists", spec.id)));
            }
            // A pull of two 1 MiB layers, then the build's own steps.
            for done in [0, 1 << 20, 2 << 20] {
                progress(agentenv_runtime::BuildProgress {
                    step: agentenv_runtime::BuildStep::Pull,
                    detail: format!("{done} bytes"),
                    bytes: Some((done, 2 << 20)),
                });
            }
            for step in [
                agentenv_runtime::BuildStep::Image,
                agentenv_runtime::BuildStep::Boot,
            ] {
                progress(agentenv_runtime::BuildProgress {
                    step,
                    detail: String::new(),
                    bytes: None,
                });
            }
            let t = TemplateInfo {
                id: spec.id,
                aliases: spec.aliases,
                vcpus: spec.vcpus,
                memory_mib: spec.memory_mib,
                ..template()
            };
            self.built.lock().unwrap().push(t.clone());
            Ok(t)
        })
    }
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxVm, CreateError>> {
        Box::pin(async move {
            let known = self.templates().iter().any(|t| t.id == spec.template_id)
                || self
                    .snaps
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|s| s.id == spec.template_id);
            if !known {
                return Err(CreateError::UnknownTemplate(spec.template_id));
            }
            self.creates.fetch_add(1, Ordering::SeqCst);
            self.vms
                .lock()
                .unwrap()
                .insert(spec.sandbox_id.clone(), VmState::Running);
            if let Some(p) = spec.network {
                self.nets.lock().unwrap().insert(spec.sandbox_id.clone(), p);
            }
            Ok(vm(&spec.sandbox_id))
        })
    }
    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), PauseError>> {
        Box::pin(async move {
            self.hang_if_wedged(id).await;
            match self.state(id) {
                None => Err(PauseError::NotFound(id.into())),
                Some(VmState::Paused) => Err(PauseError::AlreadyPaused(id.into())),
                Some(VmState::Running) => {
                    self.vms.lock().unwrap().insert(id.into(), VmState::Paused);
                    Ok(())
                }
            }
        })
    }
    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ResumeError>> {
        Box::pin(async move {
            self.hang_if_wedged(id).await;
            match self.state(id) {
                None => Err(ResumeError::NotFound(id.into())),
                Some(VmState::Running) => Err(ResumeError::NotPaused(id.into())),
                Some(VmState::Paused) => {
                    self.vms.lock().unwrap().insert(id.into(), VmState::Running);
                    Ok(())
                }
            }
        })
    }
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), KillError>> {
        Box::pin(async move {
            self.kills.fetch_add(1, Ordering::SeqCst);
            self.nets.lock().unwrap().remove(id);
            self.vms
                .lock()
                .unwrap()
                .remove(id)
                .map(|_| ())
                .ok_or_else(|| KillError::NotFound(id.into()))
        })
    }
    fn open_agent_stream<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<AgentStream, ConnectError>> {
        Box::pin(async move { Err(ConnectError::NotFound(id.into())) })
    }
    fn recover(&self) -> BoxFuture<'_, Result<Vec<RecoveredVm>, RecoverError>> {
        Box::pin(async move {
            let r = std::mem::take(&mut *self.recovered.lock().unwrap());
            let mut vms = self.vms.lock().unwrap();
            for v in &r {
                if let Some(s) = v.state {
                    vms.insert(v.id.clone(), s);
                }
            }
            Ok(r)
        })
    }
    fn vm_state(&self, id: &str) -> Option<VmState> {
        self.state(id)
    }
    fn snapshot<'a>(
        &'a self,
        sandbox_id: &'a str,
        snapshot_id: &'a str,
        names: &'a [String],
        mode: SnapshotMode,
    ) -> BoxFuture<'a, Result<SnapshotInfo, SnapshotError>> {
        Box::pin(async move {
            self.hang_if_wedged(sandbox_id).await;
            if self.state(sandbox_id).is_none() {
                return Err(SnapshotError::SandboxNotFound(sandbox_id.into()));
            }
            let names = names
                .iter()
                .map(|n| {
                    agentenv_runtime::snapshot::normalize_name(n)
                        .ok_or_else(|| SnapshotError::InvalidName(n.clone()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut snaps = self.snaps.lock().unwrap();
            for s in snaps.iter_mut() {
                s.names.retain(|n| !names.contains(n));
            }
            let info = SnapshotInfo {
                id: snapshot_id.into(),
                names,
                source_sandbox: Some(sandbox_id.into()),
                template_id: "base".into(),
                mode,
                created_at: format!("2026-12-01T00:00:{:02}Z", snaps.len()),
                bytes: 0,
                vcpus: 1,
                memory_mib: 256,
                paused_ms: 0.0,
                stored: None,
            };
            snaps.push(info.clone());
            Ok(info)
        })
    }
    fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.snaps.lock().unwrap().clone()
    }
    fn import_snapshot<'a>(
        &'a self,
        id_or_name: &'a str,
    ) -> BoxFuture<'a, Result<Option<SnapshotInfo>, SnapshotError>> {
        // The fake shares no store with other machines: only its own snapshots exist.
        let snap = self.snapshots().into_iter().find(|s| s.id == id_or_name);
        Box::pin(async move { Ok(snap) })
    }
    fn delete_snapshot(&self, id: &str) -> Result<(), SnapshotError> {
        let mut snaps = self.snaps.lock().unwrap();
        let before = snaps.len();
        snaps.retain(|s| s.id != id);
        if snaps.len() == before {
            return Err(SnapshotError::NotFound(id.into()));
        }
        Ok(())
    }
    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<ForkResults, SnapshotError>> {
        Box::pin(async move {
            if self.state(sandbox_id).is_none() {
                return Err(SnapshotError::SandboxNotFound(sandbox_id.into()));
            }
            let mut vms = self.vms.lock().unwrap();
            Ok(ids
                .iter()
                .map(|id| {
                    vms.insert(id.clone(), VmState::Running);
                    Ok(vm(id))
                })
                .collect())
        })
    }
    fn set_network<'a>(
        &'a self,
        id: &'a str,
        policy: EgressPolicy,
    ) -> BoxFuture<'a, Result<(), NetworkError>> {
        Box::pin(async move {
            if self.state(id).is_none() {
                return Err(NetworkError::NotFound(id.into()));
            }
            self.nets.lock().unwrap().insert(id.into(), policy);
            Ok(())
        })
    }
    fn network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<NetworkInfo>> {
        Box::pin(async move {
            let policy = self.nets.lock().unwrap().get(id).cloned()?;
            Some(NetworkInfo {
                address: std::net::Ipv4Addr::new(10, 200, 0, 2),
                policy,
            })
        })
    }
    fn networking_off(&self) -> Option<String> {
        self.net_off.lock().unwrap().clone()
    }
    fn exec<'a>(
        &'a self,
        id: &'a str,
        req: ExecRequest,
        _deadline: std::time::Duration,
        mut on_event: Box<dyn FnMut(ExecEvent) + Send + 'a>,
    ) -> BoxFuture<'a, Result<(i32, String), ConnectError>> {
        Box::pin(async move {
            match self.state(id) {
                None => return Err(ConnectError::NotFound(id.into())),
                Some(VmState::Paused) => return Err(ConnectError::Paused(id.into())),
                Some(VmState::Running) => {}
            }
            self.execs.lock().unwrap().push((id.into(), req.clone()));
            if req.background {
                return Ok((42, "started".into()));
            }
            on_event(ExecEvent::Stdout(format!("{}\n", req.cmd)));
            let code = req
                .cmd
                .rsplit_once("exit ")
                .and_then(|(_, n)| n.trim().parse().ok())
                .unwrap_or(0);
            Ok((code, format!("exit status {code}")))
        })
    }
    fn sample<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Sample, ConnectError>> {
        Box::pin(async move {
            match self.state(id) {
                None => Err(ConnectError::NotFound(id.into())),
                Some(VmState::Paused) => Err(ConnectError::Paused(id.into())),
                Some(VmState::Running) => Ok(Sample {
                    guest: agentenv_envd::GuestMetrics {
                        ts: 1_764_547_200,
                        cpu_count: 1,
                        mem_total: 256 << 20,
                        ..Default::default()
                    },
                    net: self.nets.lock().unwrap().contains_key(id).then_some(
                        agentenv_runtime::net::NetStats {
                            tx_bytes: 10,
                            rx_bytes: 20,
                            dropped_packets: 1,
                        },
                    ),
                }),
            }
        })
    }
}

#[cfg(test)]
pub(crate) mod fake_tests {
    //! Millisecond tests of the lifecycle layer over the in-memory fake backend.
    use super::FakeBackend;
    use crate::backend::{RecoveredVm, VmBackend, VmState};
    use crate::metrics::Metrics;
    use crate::model::{NewSandbox, SandboxState};
    use crate::sandboxes::*;
    use crate::store::SandboxStore;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    pub(crate) async fn open(dir: &std::path::Path, fake: Arc<FakeBackend>) -> Arc<Sandboxes> {
        open_with(dir, fake, LifecycleConfig::default()).await
    }

    async fn open_with(
        dir: &std::path::Path,
        fake: Arc<FakeBackend>,
        cfg: LifecycleConfig,
    ) -> Arc<Sandboxes> {
        let ring = crate::tenants::KeyRing::open(
            dir,
            crate::keys::generate_api_key(),
            Quota::default(),
            None,
        );
        Sandboxes::open(
            fake,
            SandboxStore::open(dir).unwrap(),
            Arc::new(Metrics::new()),
            cfg,
            Arc::new(ring),
        )
        .await
        .unwrap()
    }

    /// The server key's tenant, as its requests arrive.
    pub(crate) fn me() -> Caller {
        Caller::Tenant(crate::tenants::DEFAULT_TENANT.into())
    }

    fn req(template: &str) -> NewSandbox {
        NewSandbox {
            template_id: template.into(),
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
                NewSandbox {
                    timeout: Some(0),
                    ..req("base")
                },
                None,
            )
            .await
            .unwrap();
        let pause_me = s
            .create(
                &me(),
                NewSandbox {
                    timeout: Some(0),
                    auto_pause: Some(true),
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
        r.metadata = Some(BTreeMap::from([("k".to_string(), "v".to_string())]));
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
        let due = |auto_pause| NewSandbox {
            timeout: Some(0),
            auto_pause: Some(auto_pause),
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
        let api = crate::error::ApiError::from(e);
        assert_eq!(api.status, axum::http::StatusCode::GATEWAY_TIMEOUT);
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
            let api = crate::error::ApiError::from(r.clone());
            assert_eq!(api.status, axum::http::StatusCode::TOO_MANY_REQUESTS);
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
}
