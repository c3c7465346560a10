//! [`VmBackend`] for the real runtime (`agentenv_runtime::Runtime`: QEMU microvm over QMP), and the one
//! place that sorts the runtime's errors into the lifecycle's cases ([`VmError`]).

use agentenv_runtime::{
    AccelKind, ConnectError, CreateError, KillError, PauseError, RecoverError, ResumeError,
    Runtime, RuntimeConfig, SnapshotError, TemplateError, error::NetworkError,
};

use crate::backend::*;

/// "KVM" or "TCG", for logs and bench notes.
pub fn accel_label(rt: &Runtime) -> &'static str {
    match rt.accel() {
        AccelKind::Kvm => "KVM",
        AccelKind::Tcg => "TCG",
    }
}

/// Opens the runtime and makes sure the default template `base` exists (built on first use,
/// with the steps logged).
pub async fn open_with_default_template(cfg: RuntimeConfig) -> anyhow::Result<Runtime> {
    let rt = Runtime::open(cfg).await?;
    // One published to a shared bucket is imported (its disk served lazily), not built again.
    match rt.import_template("base").await {
        Ok(Some(_)) => return Ok(rt),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(error = %e, "importing the published default template failed; building it")
        }
    }
    let progress =
        |p: agentenv_runtime::BuildProgress| tracing::info!(progress = ?p, "default template");
    rt.ensure_default_template(&progress).await?;
    Ok(rt)
}

/// The runtime as the lifecycle's [`VmBackend`].
#[derive(Clone)]
pub struct RuntimeBackend(pub Runtime);

fn failed(e: impl std::error::Error + Send + Sync + 'static) -> VmError {
    VmError::Failed(Box::new(e))
}

fn template_err(e: TemplateError) -> VmError {
    match e {
        TemplateError::InvalidId(_) | TemplateError::InvalidSpec(_) | TemplateError::Image(_) => {
            VmError::Invalid(Box::new(e))
        }
        e => failed(e),
    }
}

fn create_err(e: CreateError) -> VmError {
    match e {
        CreateError::UnknownTemplate(t) => VmError::TemplateNotFound(t),
        CreateError::InvalidId(_) => VmError::Invalid(Box::new(e)),
        CreateError::NetworkUnavailable(_) => VmError::NetworkUnavailable(Box::new(e)),
        e if e.no_capacity() => VmError::NoCapacity(Box::new(e)),
        e => failed(e),
    }
}

fn pause_err(e: PauseError) -> VmError {
    match e {
        PauseError::NotFound(i) => VmError::SandboxNotFound(i),
        PauseError::AlreadyPaused(i) => VmError::AlreadyPaused(i),
        e => failed(e),
    }
}

fn resume_err(e: ResumeError) -> VmError {
    match e {
        ResumeError::NotFound(i) => VmError::SandboxNotFound(i),
        ResumeError::NotPaused(i) => VmError::NotPaused(i),
        e if e.no_capacity() => VmError::NoCapacity(Box::new(e)),
        e => failed(e),
    }
}

fn kill_err(e: KillError) -> VmError {
    match e {
        KillError::NotFound(i) => VmError::SandboxNotFound(i),
        e => failed(e),
    }
}

fn connect_err(e: ConnectError) -> VmError {
    match e {
        ConnectError::NotFound(i) => VmError::SandboxNotFound(i),
        ConnectError::Paused(i) => VmError::Paused(i),
        e => failed(e),
    }
}

fn recover_err(e: RecoverError) -> VmError {
    failed(e)
}

fn snapshot_err(e: SnapshotError) -> VmError {
    match e {
        SnapshotError::SandboxNotFound(i) => VmError::SandboxNotFound(i),
        SnapshotError::NotFound(i) => VmError::SnapshotNotFound(i),
        SnapshotError::InvalidName(_) | SnapshotError::NoMemory(_) => VmError::Invalid(Box::new(e)),
        e => failed(e),
    }
}

fn network_err(e: NetworkError) -> VmError {
    match e {
        NetworkError::NotFound(i) => VmError::SandboxNotFound(i),
        NetworkError::Unavailable { .. } => VmError::NetworkUnavailable(Box::new(e)),
        e => failed(e),
    }
}

impl VmBackend for RuntimeBackend {
    fn accel_name(&self) -> String {
        accel_label(&self.0).to_string()
    }

    fn templates(&self) -> Vec<TemplateInfo> {
        self.0.templates()
    }

    fn build_template(
        &self,
        spec: TemplateSpec,
        progress: crate::backend::ProgressFn,
    ) -> BoxFuture<'_, VmResult<TemplateInfo>> {
        Box::pin(async move {
            let id = spec.id.clone();
            let report = move |p: BuildProgress| {
                if p.bytes.is_none() {
                    tracing::info!(template = %id, step = ?p.step, detail = %p.detail, "template build");
                }
                progress(p)
            };
            self.0
                .build_template(spec, &report)
                .await
                .map_err(template_err)
        })
    }

    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, VmResult<SandboxVm>> {
        Box::pin(async move { self.0.create(spec).await.map_err(create_err) })
    }

    fn pause<'a>(&'a self, id: &'a str, memory: bool) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move {
            match memory {
                true => self.0.pause(id).await,
                false => self.0.pause_filesystem(id).await,
            }
            .map_err(pause_err)
        })
    }

    fn resume<'a>(
        &'a self,
        id: &'a str,
        env_vars: &'a std::collections::BTreeMap<String, String>,
    ) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move { self.0.resume_with(id, env_vars).await.map_err(resume_err) })
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move { self.0.kill(id).await.map_err(kill_err) })
    }

    fn open_agent_stream<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<AgentStream>> {
        Box::pin(async move {
            let s = self.0.open_agent_stream(id).await.map_err(connect_err)?;
            Ok(Box::new(s) as AgentStream)
        })
    }

    fn recover(&self) -> BoxFuture<'_, VmResult<Vec<RecoveredVm>>> {
        Box::pin(async move { self.0.recover().await.map_err(recover_err) })
    }

    fn vm_state(&self, id: &str) -> Option<VmState> {
        self.0.vm_state(id)
    }

    fn snapshot<'a>(
        &'a self,
        sandbox_id: &'a str,
        snapshot_id: &'a str,
        names: &'a [String],
        mode: SnapshotMode,
    ) -> BoxFuture<'a, VmResult<SnapshotInfo>> {
        Box::pin(async move {
            self.0
                .snapshot(sandbox_id, snapshot_id, names, mode)
                .await
                .map_err(snapshot_err)
        })
    }

    fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.0.snapshots()
    }

    fn import_snapshot<'a>(
        &'a self,
        id_or_name: &'a str,
    ) -> BoxFuture<'a, VmResult<Option<SnapshotInfo>>> {
        Box::pin(async move {
            self.0
                .import_snapshot(id_or_name)
                .await
                .map_err(snapshot_err)
        })
    }

    fn delete_snapshot(&self, id: &str) -> VmResult<()> {
        self.0.delete_snapshot(id).map_err(snapshot_err)
    }

    fn rename_snapshot(
        &self,
        id: &str,
        add: &[String],
        remove: &[String],
    ) -> VmResult<SnapshotInfo> {
        self.0
            .rename_snapshot(id, add, remove)
            .map_err(snapshot_err)
    }

    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, VmResult<ForkResults>> {
        Box::pin(async move {
            let forks = self.0.fork(sandbox_id, ids).await.map_err(snapshot_err)?;
            Ok(forks.into_iter().map(|r| r.map_err(create_err)).collect())
        })
    }

    fn set_network<'a>(&'a self, id: &'a str, policy: EgressPolicy) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move { self.0.set_network(id, policy).await.map_err(network_err) })
    }

    fn network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<NetworkInfo>> {
        Box::pin(self.0.network(id))
    }

    fn networking_off(&self) -> Option<String> {
        self.0.networking_off().map(str::to_owned)
    }

    fn exec<'a>(
        &'a self,
        id: &'a str,
        req: ExecRequest,
        deadline: std::time::Duration,
        on_event: Box<dyn FnMut(ExecEvent) + Send + 'a>,
    ) -> BoxFuture<'a, VmResult<(i32, String)>> {
        Box::pin(async move {
            self.0
                .exec(id, &req, deadline, on_event)
                .await
                .map_err(connect_err)
        })
    }

    fn sample<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<Sample>> {
        Box::pin(async move { self.0.sample(id).await.map_err(connect_err) })
    }
}
