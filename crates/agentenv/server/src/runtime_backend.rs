//! [`VmBackend`] for the real runtime (`agentenv_runtime::Runtime`: QEMU microvm over QMP).

use agentenv_runtime::{AccelKind, Runtime, RuntimeConfig};

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

impl VmBackend for Runtime {
    fn accel_name(&self) -> String {
        accel_label(self).to_string()
    }

    fn templates(&self) -> Vec<TemplateInfo> {
        Runtime::templates(self)
    }

    fn build_template(
        &self,
        spec: TemplateSpec,
        progress: crate::backend::ProgressFn,
    ) -> BoxFuture<'_, Result<TemplateInfo, TemplateError>> {
        Box::pin(async move {
            let id = spec.id.clone();
            let report = move |p: agentenv_runtime::BuildProgress| {
                if p.bytes.is_none() {
                    tracing::info!(template = %id, step = ?p.step, detail = %p.detail, "template build");
                }
                progress(p)
            };
            Runtime::build_template(self, spec, &report).await
        })
    }

    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxVm, CreateError>> {
        Box::pin(Runtime::create(self, spec))
    }

    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), PauseError>> {
        Box::pin(Runtime::pause(self, id))
    }

    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ResumeError>> {
        Box::pin(Runtime::resume(self, id))
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), KillError>> {
        Box::pin(Runtime::kill(self, id))
    }

    fn open_agent_stream<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<AgentStream, ConnectError>> {
        Box::pin(async move {
            let s = Runtime::open_agent_stream(self, id).await?;
            Ok(Box::new(s) as AgentStream)
        })
    }

    fn recover(&self) -> BoxFuture<'_, Result<Vec<RecoveredVm>, RecoverError>> {
        Box::pin(Runtime::recover(self))
    }

    fn vm_state(&self, id: &str) -> Option<VmState> {
        Runtime::vm_state(self, id)
    }

    fn snapshot<'a>(
        &'a self,
        sandbox_id: &'a str,
        snapshot_id: &'a str,
        names: &'a [String],
        mode: SnapshotMode,
    ) -> BoxFuture<'a, Result<SnapshotInfo, SnapshotError>> {
        Box::pin(Runtime::snapshot(
            self,
            sandbox_id,
            snapshot_id,
            names,
            mode,
        ))
    }

    fn snapshots(&self) -> Vec<SnapshotInfo> {
        Runtime::snapshots(self)
    }

    fn import_snapshot<'a>(
        &'a self,
        id_or_name: &'a str,
    ) -> BoxFuture<'a, Result<Option<SnapshotInfo>, SnapshotError>> {
        Box::pin(Runtime::import_snapshot(self, id_or_name))
    }
    fn delete_snapshot(&self, id: &str) -> Result<(), SnapshotError> {
        Runtime::delete_snapshot(self, id)
    }

    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<ForkResults, SnapshotError>> {
        Box::pin(Runtime::fork(self, sandbox_id, ids))
    }

    fn set_network<'a>(
        &'a self,
        id: &'a str,
        policy: EgressPolicy,
    ) -> BoxFuture<'a, Result<(), NetworkError>> {
        Box::pin(Runtime::set_network(self, id, policy))
    }

    fn network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<NetworkInfo>> {
        Box::pin(Runtime::network(self, id))
    }

    fn networking_off(&self) -> Option<String> {
        Runtime::networking_off(self).map(str::to_owned)
    }

    fn exec<'a>(
        &'a self,
        id: &'a str,
        req: ExecRequest,
        deadline: std::time::Duration,
        on_event: Box<dyn FnMut(ExecEvent) + Send + 'a>,
    ) -> BoxFuture<'a, Result<(i32, String), ConnectError>> {
        Box::pin(async move { Runtime::exec(self, id, &req, deadline, on_event).await })
    }

    fn sample<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Sample, ConnectError>> {
        Box::pin(Runtime::sample(self, id))
    }
}
