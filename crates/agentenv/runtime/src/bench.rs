//! Lifecycle latency measurement for `agentenv-bench`: create, pause, resume and kill, one sandbox at a time.

use std::time::Instant;

use crate::error::{CreateError, KillError, OpenError, PauseError, ResumeError, TemplateError};
use crate::{AccelKind, CreateSpec, Runtime, RuntimeConfig};

/// Per-operation wall-clock samples in milliseconds, one per iteration.
#[derive(Debug, Clone)]
pub struct LifecycleStats {
    /// Accelerator the runtime used.
    pub accel: AccelKind,
    /// Iterations run.
    pub n: usize,
    /// `create` (restore from the base snapshot until `/health` answers).
    pub create_ms: Vec<f64>,
    /// `pause` (stop + device state + record commit).
    pub pause_ms: Vec<f64>,
    /// `resume` (restore until `/health` answers).
    pub resume_ms: Vec<f64>,
    /// `kill` (SIGKILL + file removal).
    pub kill_ms: Vec<f64>,
}

impl LifecycleStats {
    /// Median of `samples` (NaN when empty): [`k3_common::stats::median`].
    pub fn median(samples: &[f64]) -> f64 {
        k3_common::stats::median(samples)
    }
}

/// Errors of the lifecycle bench.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Opening the runtime failed.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Building the default template failed.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// A create failed.
    #[error(transparent)]
    Create(#[from] CreateError),
    /// A pause failed.
    #[error(transparent)]
    Pause(#[from] PauseError),
    /// A resume failed.
    #[error(transparent)]
    Resume(#[from] ResumeError),
    /// A kill failed.
    #[error(transparent)]
    Kill(#[from] KillError),
    /// The temporary state folder could not be created.
    #[error("temporary state folder: {0}")]
    TempDir(std::io::Error),
}

/// Runs `n` lifecycles on a fresh runtime in a temporary state folder (default config, default template
/// from the cache or built first).
pub async fn lifecycle(n: usize) -> Result<LifecycleStats, BenchError> {
    let dir = std::env::temp_dir().join(format!("agentenv-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(BenchError::TempDir)?;
    let r = async {
        let rt = Runtime::open(RuntimeConfig::new(&dir)).await?;
        rt.ensure_default_template(
            &|p| tracing::info!(step = ?p.step, detail = %p.detail, "template"),
        )
        .await?;
        lifecycle_on(&rt, n).await
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Runs `n` lifecycles (create, pause, resume, kill) of template `base` on `rt`.
pub async fn lifecycle_on(rt: &Runtime, n: usize) -> Result<LifecycleStats, BenchError> {
    let mut st = LifecycleStats {
        accel: rt.accel(),
        n,
        create_ms: Vec::new(),
        pause_ms: Vec::new(),
        resume_ms: Vec::new(),
        kill_ms: Vec::new(),
    };
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    for i in 0..n {
        let id = format!("bench-{}-{i}", std::process::id());
        let t = Instant::now();
        rt.create(CreateSpec {
            sandbox_id: id.clone(),
            template_id: "base".into(),
            ..Default::default()
        })
        .await?;
        st.create_ms.push(ms(t));
        let t = Instant::now();
        rt.pause(&id).await?;
        st.pause_ms.push(ms(t));
        let t = Instant::now();
        rt.resume(&id).await?;
        st.resume_ms.push(ms(t));
        let t = Instant::now();
        rt.kill(&id).await?;
        st.kill_ms.push(ms(t));
    }
    Ok(st)
}
