//! [`VmBackend`] for the real runtime (`agentenv_runtime::Runtime`: QEMU microvm over QMP).

use std::collections::BTreeMap;

use agentenv_runtime::{
    AccelKind, ConnectError, CreateError, CreateSpec, KillError, PauseError, ResumeError, Runtime,
    RuntimeConfig, TemplateError, TemplateInfo, TemplateSpec, VmState,
};

use crate::backend::{
    AgentStream, BackendError, BackendErrorKind, BoxFuture, TemplateBuild, TemplateFacts,
    VmBackend, VmRunState,
};

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
    let progress =
        |p: agentenv_runtime::BuildProgress| tracing::info!(progress = ?p, "default template");
    rt.ensure_default_template(&progress).await?;
    Ok(rt)
}

fn facts(t: TemplateInfo) -> TemplateFacts {
    TemplateFacts {
        id: t.id,
        aliases: t.aliases,
        vcpus: t.vcpus,
        memory_mib: u32::try_from(t.memory_mib).unwrap_or(u32::MAX),
        disk_mib: u32::try_from(t.disk_mib).unwrap_or(u32::MAX),
        built_at: t.built_at,
        envd_version: t.envd_version,
    }
}

fn err(kind: BackendErrorKind, e: impl std::fmt::Display) -> BackendError {
    BackendError::new(kind, e.to_string())
}

fn create_err(e: CreateError) -> BackendError {
    let kind = match e {
        CreateError::UnknownTemplate(_) => BackendErrorKind::NotFound,
        CreateError::AlreadyExists(_) => BackendErrorKind::Conflict,
        CreateError::InvalidId(_) => BackendErrorKind::BadRequest,
        _ => BackendErrorKind::Internal,
    };
    err(kind, e)
}

fn template_err(e: TemplateError) -> BackendError {
    let kind = match e {
        TemplateError::InvalidId(_) | TemplateError::InvalidSpec(_) => BackendErrorKind::BadRequest,
        _ => BackendErrorKind::Internal,
    };
    err(kind, e)
}

fn pause_err(e: PauseError) -> BackendError {
    let kind = match e {
        PauseError::NotFound(_) => BackendErrorKind::NotFound,
        PauseError::AlreadyPaused(_) => BackendErrorKind::Conflict,
        _ => BackendErrorKind::Internal,
    };
    err(kind, e)
}

fn resume_err(e: ResumeError) -> BackendError {
    let kind = match e {
        ResumeError::NotFound(_) => BackendErrorKind::NotFound,
        ResumeError::NotPaused(_) => BackendErrorKind::Conflict,
        _ => BackendErrorKind::Internal,
    };
    err(kind, e)
}

fn kill_err(e: KillError) -> BackendError {
    let kind = match e {
        KillError::NotFound(_) => BackendErrorKind::NotFound,
        _ => BackendErrorKind::Internal,
    };
    err(kind, e)
}

fn connect_err(e: ConnectError) -> BackendError {
    let kind = match e {
        ConnectError::NotFound(_) => BackendErrorKind::NotFound,
        ConnectError::Paused(_) => BackendErrorKind::Conflict,
        _ => BackendErrorKind::Internal,
    };
    err(kind, e)
}

fn run_state(s: VmState) -> VmRunState {
    match s {
        VmState::Running => VmRunState::Running,
        VmState::Paused => VmRunState::Paused,
    }
}

impl VmBackend for Runtime {
    fn accel_name(&self) -> String {
        accel_label(self).to_string()
    }

    fn templates(&self) -> Vec<TemplateFacts> {
        Runtime::templates(self).into_iter().map(facts).collect()
    }

    fn build_template(
        &self,
        build: TemplateBuild,
    ) -> BoxFuture<'_, Result<TemplateFacts, BackendError>> {
        Box::pin(async move {
            let base = TemplateSpec::base();
            let spec = TemplateSpec {
                id: build.id,
                aliases: build.aliases,
                vcpus: build.vcpus.unwrap_or(base.vcpus),
                memory_mib: build.memory_mib.map_or(base.memory_mib, u64::from),
                disk_mib: build.disk_mib.map_or(base.disk_mib, u64::from),
            };
            let id = spec.id.clone();
            let progress = move |p: agentenv_runtime::BuildProgress| tracing::info!(template = %id, progress = ?p, "template build");
            Runtime::build_template(self, spec, &progress)
                .await
                .map(facts)
                .map_err(template_err)
        })
    }

    fn create<'a>(
        &'a self,
        sandbox_id: &'a str,
        template_id: &'a str,
        env_vars: BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let spec = CreateSpec {
                sandbox_id: sandbox_id.to_string(),
                template_id: template_id.to_string(),
                env_vars,
            };
            Runtime::create(self, spec)
                .await
                .map(|_| ())
                .map_err(create_err)
        })
    }

    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move { Runtime::pause(self, id).await.map_err(pause_err) })
    }

    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move { Runtime::resume(self, id).await.map_err(resume_err) })
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move { Runtime::kill(self, id).await.map_err(kill_err) })
    }

    fn open_agent_stream<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<AgentStream, BackendError>> {
        Box::pin(async move {
            let s = Runtime::open_agent_stream(self, id)
                .await
                .map_err(connect_err)?;
            Ok(Box::new(s) as AgentStream)
        })
    }

    fn recover(&self) -> BoxFuture<'_, Result<Vec<(String, VmRunState)>, BackendError>> {
        Box::pin(async move {
            let vms = Runtime::recover(self)
                .await
                .map_err(|e| err(BackendErrorKind::Internal, e))?;
            for v in vms.iter().filter(|v| v.state.is_none()) {
                tracing::warn!(sandbox = %v.id, detail = %v.detail, "runtime dropped a sandbox VM during recovery");
            }
            Ok(vms
                .into_iter()
                .filter_map(|v| Some((v.id, run_state(v.state?))))
                .collect())
        })
    }

    fn vm_state(&self, id: &str) -> Option<VmRunState> {
        Runtime::vm_state(self, id).map(run_state)
    }
}
