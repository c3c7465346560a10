//! Template builds as E2B's `Template.build` drives them: a VM made from the base template runs the
//! steps (RUN, COPY, ENV, WORKDIR, USER), starts the start command and waits for its ready check;
//! it is then snapshotted with the start command running. The snapshot carries the build's names
//! and the template id, so `Sandbox.create(name)` restores it as fast as any snapshot.
//!
//! Builds live in memory (their result, the snapshot, is durable); uploaded COPY archives live under
//! `<state>/server/build-files/<template>/<hash>`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Caller, LifecycleError, Result, Sandboxes, internal, now_ms};
use crate::backend::{ExecEvent, ExecRequest};
use crate::model::NewSandbox;
use crate::tenants;

use super::build_script::{copy_script, sh};

/// Largest uploaded COPY archive.
pub const MAX_BUILD_FILE_BYTES: usize = 64 << 20;
/// Steps of one build.
pub const MAX_STEPS: usize = 256;
/// A whole build, steps and ready check included.
const BUILD_DEADLINE: Duration = Duration::from_secs(3600);
/// The ready check, from the start command's start.
const READY_DEADLINE: Duration = Duration::from_secs(300);
/// Log entries per status answer (E2B's page).
pub const LOGS_PAGE: usize = 100;
/// Images that mean "E2B's base": our `base` template is its counterpart.
const BASE_IMAGES: [&str; 2] = ["e2bdev/base", "e2bdev/base:latest"];
/// The base template.
const BASE: &str = "base";
/// E2B's step names for what comes before and after the steps.
const BASE_STEP: &str = "base";
const FINALIZE_STEP: &str = "finalize";

/// Where a build stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildStatus {
    /// Created; its steps have not come yet.
    Waiting,
    Building,
    Ready,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Info,
    Warn,
    Error,
}

/// One line of a build's log.
#[derive(Debug, Clone)]
pub struct LogEntry {
    pub at_ms: i64,
    pub level: LogLevel,
    pub message: String,
    /// `base`, the step number (1-based, as the SDK counts), or `finalize`.
    pub step: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Clone)]
pub struct BuildFailure {
    pub message: String,
    pub step: Option<String>,
}

/// One build step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Run {
        cmd: String,
        user: Option<String>,
    },
    Copy {
        src: String,
        dest: String,
        user: Option<String>,
        mode: Option<u32>,
        files_hash: String,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

/// What a build does: its base, steps, and the start command with its ready check.
#[derive(Debug, Clone, Default)]
pub struct BuildPlan {
    pub from_template: Option<String>,
    pub from_image: Option<String>,
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// A build as a status request sees it.
#[derive(Debug, Clone)]
pub struct BuildView {
    pub template_id: String,
    pub build_id: String,
    pub status: BuildStatus,
    /// From the requested offset, at most [`LOGS_PAGE`].
    pub logs: Vec<LogEntry>,
    pub failure: Option<BuildFailure>,
}

/// The machine a build asks for (`cpuCount`, `memoryMB`); `None`: the base template's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuildSize {
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u64>,
}

/// A template the builder made (or is making).
#[derive(Debug, Clone)]
pub struct BuiltTemplate {
    pub template_id: String,
    pub build_id: String,
    /// `name:tag` as the owner wrote them.
    pub names: Vec<String>,
    pub tags: Vec<String>,
}

struct Build {
    size: BuildSize,
    status: BuildStatus,
    logs: Vec<LogEntry>,
    failure: Option<BuildFailure>,
}

struct TemplateEntry {
    owner: String,
    /// The name without tag.
    name: String,
    builds: HashMap<String, Arc<Mutex<Build>>>,
    /// The latest build's names.
    names: Vec<String>,
}

/// The builds of this server.
pub(super) struct Builds {
    files: PathBuf,
    templates: Mutex<HashMap<String, TemplateEntry>>,
}

impl Builds {
    pub(super) fn new(state_dir: &std::path::Path) -> Builds {
        Builds {
            files: state_dir.join("server").join("build-files"),
            templates: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, TemplateEntry>> {
        self.templates.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn valid_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What the steps so far have set.
struct Context {
    user: String,
    cwd: String,
    envs: BTreeMap<String, String>,
}

type StepResult<T> = std::result::Result<T, BuildFailure>;

fn fail(step: &str, message: impl Into<String>) -> BuildFailure {
    BuildFailure {
        message: message.into(),
        step: Some(step.into()),
    }
}

impl Sandboxes {
    /// `POST /v3/templates`: a new build of template `name` (`name[:tag]`, plus `tags`), owned by
    /// `caller`; a name it built before keeps its template id.
    pub fn request_build(
        &self,
        caller: &Caller,
        name: &str,
        tags: &[String],
        size: BuildSize,
    ) -> Result<BuiltTemplate> {
        let base = crate::backend::TemplateSpec::base();
        crate::backend::TemplateSpec {
            vcpus: size.vcpus.unwrap_or(base.vcpus),
            memory_mib: size.memory_mib.unwrap_or(base.memory_mib),
            ..base
        }
        .check_size()
        .map_err(|e| LifecycleError::Invalid(e.to_string()))?;
        let (base, tag) = match name.split_once(':') {
            Some((n, t)) => (n, Some(t)),
            None => (name, None),
        };
        let mut tags: Vec<String> = tags
            .iter()
            .cloned()
            .chain(tag.map(str::to_string))
            .collect();
        if tags.is_empty() {
            tags.push(agentenv_runtime::snapshot::DEFAULT_TAG.into());
        }
        let names: Vec<String> = tags.iter().map(|t| format!("{base}:{t}")).collect();
        for n in &names {
            tenants::scoped_name(caller.owner(), n).map_err(LifecycleError::Invalid)?;
        }
        let owner = caller.owner().to_string();
        let build_id = format!("bld-{}", crate::keys::generate_sandbox_id());
        let mut all = self.builds.lock();
        let template_id = all
            .iter()
            .find(|(_, t)| t.owner == owner && t.name == base)
            .map(|(id, _)| id.clone())
            .unwrap_or_else(|| format!("tpl-{}", crate::keys::generate_sandbox_id()));
        let entry = all
            .entry(template_id.clone())
            .or_insert_with(|| TemplateEntry {
                owner,
                name: base.into(),
                builds: HashMap::new(),
                names: vec![],
            });
        entry.names = names.clone();
        entry.builds.insert(
            build_id.clone(),
            Arc::new(Mutex::new(Build {
                size,
                status: BuildStatus::Waiting,
                logs: vec![],
                failure: None,
            })),
        );
        Ok(BuiltTemplate {
            template_id,
            build_id,
            names,
            tags,
        })
    }

    fn build_entry(&self, caller: &Caller, template_id: &str) -> Result<()> {
        match self.builds.lock().get(template_id) {
            Some(t) if caller.sees(&t.owner) => Ok(()),
            _ => Err(LifecycleError::TemplateNotFound(template_id.into())),
        }
    }

    fn build_of(
        &self,
        caller: &Caller,
        template_id: &str,
        build_id: &str,
    ) -> Result<Arc<Mutex<Build>>> {
        self.build_entry(caller, template_id)?;
        self.builds
            .lock()
            .get(template_id)
            .and_then(|t| t.builds.get(build_id).cloned())
            .ok_or_else(|| LifecycleError::TemplateNotFound(format!("{template_id}/{build_id}")))
    }

    fn file_path(&self, template_id: &str, hash: &str) -> PathBuf {
        self.builds.files.join(template_id).join(hash)
    }

    /// Whether COPY archive `hash` of template `template_id` is uploaded.
    pub fn build_file_present(
        &self,
        caller: &Caller,
        template_id: &str,
        hash: &str,
    ) -> Result<bool> {
        self.build_entry(caller, template_id)?;
        if !valid_hash(hash) {
            return Err(LifecycleError::Invalid(
                "the files hash is 64 hex digits".into(),
            ));
        }
        Ok(self.file_path(template_id, hash).is_file())
    }

    /// Stores COPY archive `hash` of template `template_id`.
    pub fn put_build_file(
        &self,
        caller: &Caller,
        template_id: &str,
        hash: &str,
        data: &[u8],
    ) -> Result<()> {
        self.build_file_present(caller, template_id, hash)?;
        if data.len() > MAX_BUILD_FILE_BYTES {
            return Err(LifecycleError::Invalid(format!(
                "the archive exceeds {MAX_BUILD_FILE_BYTES} bytes"
            )));
        }
        let path = self.file_path(template_id, hash);
        if let Some(dir) = path.parent() {
            k3_common::fsutil::create_private_dir(dir).map_err(internal)?;
        }
        k3_common::fsutil::write_atomic(&path, data).map_err(internal)
    }

    /// `POST /v2/templates/{id}/builds/{build}`: checks `plan` and runs it in the background.
    pub fn start_build(
        self: &Arc<Self>,
        caller: &Caller,
        template_id: &str,
        build_id: &str,
        plan: BuildPlan,
    ) -> Result<()> {
        let build = self.build_of(caller, template_id, build_id)?;
        if plan.steps.len() > MAX_STEPS {
            return Err(LifecycleError::Invalid(format!(
                "at most {MAX_STEPS} steps"
            )));
        }
        for s in &plan.steps {
            if let Step::Copy {
                files_hash, src, ..
            } = s
                && !self.build_file_present(caller, template_id, files_hash)?
            {
                return Err(LifecycleError::Invalid(format!(
                    "COPY {src}: files {files_hash} were not uploaded"
                )));
            }
        }
        let size = {
            let mut b = build.lock().unwrap_or_else(|e| e.into_inner());
            if b.status != BuildStatus::Waiting {
                return Err(LifecycleError::Invalid(format!(
                    "build {build_id} was started already"
                )));
            }
            b.status = BuildStatus::Building;
            b.size
        };
        let names = self
            .builds
            .lock()
            .get(template_id)
            .map(|t| t.names.clone())
            .unwrap_or_default();
        let me = self.clone();
        let (caller, tid, bid) = (
            caller.clone(),
            template_id.to_string(),
            build_id.to_string(),
        );
        tokio::spawn(async move {
            let log = BuildLog(build.clone());
            log.info(None, format!("Building template {tid}/{bid}"));
            let r = tokio::time::timeout(
                BUILD_DEADLINE,
                me.run_build(&caller, &tid, &names, &plan, size, &log),
            )
            .await
            .unwrap_or_else(|_| {
                Err(fail(
                    FINALIZE_STEP,
                    format!("the build exceeded {} s", BUILD_DEADLINE.as_secs()),
                ))
            });
            let mut b = build.lock().unwrap_or_else(|e| e.into_inner());
            match r {
                Ok(snapshot) => {
                    tracing::info!(template = %tid, build = %bid, %snapshot, "template built");
                    b.logs.push(entry(
                        LogLevel::Info,
                        None,
                        format!("Template is ready ({snapshot})"),
                    ));
                    b.status = BuildStatus::Ready;
                }
                Err(f) => {
                    tracing::warn!(template = %tid, build = %bid, error = %f.message, "template build failed");
                    b.logs
                        .push(entry(LogLevel::Error, f.step.clone(), f.message.clone()));
                    b.failure = Some(f);
                    b.status = BuildStatus::Error;
                }
            }
        });
        Ok(())
    }

    /// A build's status and its log from entry `offset` on.
    pub fn build_status(
        &self,
        caller: &Caller,
        template_id: &str,
        build_id: &str,
        offset: usize,
    ) -> Result<BuildView> {
        let build = self.build_of(caller, template_id, build_id)?;
        let b = build.lock().unwrap_or_else(|e| e.into_inner());
        Ok(BuildView {
            template_id: template_id.into(),
            build_id: build_id.into(),
            status: b.status,
            logs: b
                .logs
                .iter()
                .skip(offset)
                .take(LOGS_PAGE)
                .cloned()
                .collect(),
            failure: b.failure.clone(),
        })
    }

    /// The template id that name or alias `alias` stands for, for `caller`.
    pub fn template_by_alias(&self, caller: &Caller, alias: &str) -> Option<String> {
        let wanted = agentenv_runtime::snapshot::normalize_name(alias);
        if let Some((id, _)) = self.builds.lock().iter().find(|(id, t)| {
            caller.sees(&t.owner)
                && (**id == alias
                    || t.name == alias
                    || wanted.as_ref().is_some_and(|w| t.names.contains(w)))
        }) {
            return Some(id.clone());
        }
        self.templates(caller)
            .into_iter()
            .find(|t| t.id == alias || t.aliases.iter().any(|a| a == alias))
            .map(|t| t.id)
            .or_else(|| self.find_snapshot(caller, alias).map(|s| s.id))
    }

    async fn run_build(
        &self,
        caller: &Caller,
        template_id: &str,
        names: &[String],
        plan: &BuildPlan,
        size: BuildSize,
        log: &BuildLog,
    ) -> StepResult<String> {
        let base = match (&plan.from_template, &plan.from_image) {
            (Some(t), _) => t.clone(),
            (None, None) => BASE.into(),
            (None, Some(i)) if BASE_IMAGES.contains(&i.as_str()) => BASE.into(),
            (None, Some(i)) => {
                return Err(fail(
                    BASE_STEP,
                    format!(
                        "fromImage {i}: build an OCI template first (POST /templates with fromImage) and use fromTemplate"
                    ),
                ));
            }
        };
        let base = self.sized_base(caller, base, size, log).await?;
        log.info(Some(BASE_STEP), format!("FROM {base}"));
        if let Some(why) = self.backend.networking_off() {
            log.warn(
                Some(BASE_STEP),
                format!("sandboxes get no network on this server ({why}): steps that download (apt, pip, npm) will fail"),
            );
        }
        let sbx = self
            .create(
                caller,
                NewSandbox {
                    template_id: base.clone(),
                    timeout: Some(BUILD_DEADLINE.as_secs()),
                    metadata: Some(BTreeMap::from([(
                        "agentenv.build".into(),
                        template_id.into(),
                    )])),
                    ..Default::default()
                },
                None,
            )
            .await
            .map_err(|e| fail(BASE_STEP, format!("starting a sandbox from {base}: {e}")))?;
        let id = sbx.sandbox_id.clone();
        let r = self.run_steps(&id, plan, template_id, log).await;
        let r = match r {
            Ok(()) => {
                log.info(Some(FINALIZE_STEP), "Snapshotting the template");
                let mut all = names.to_vec();
                all.push(template_id.into());
                self.snapshot_named(caller, &id, &all, true)
                    .await
                    .map(|s| s.id)
                    .map_err(|e| fail(FINALIZE_STEP, format!("snapshot: {e}")))
            }
            Err(e) => Err(e),
        };
        if let Err(e) = self.kill(caller, &id).await {
            tracing::warn!(sandbox = %id, error = %e, "killing a build sandbox failed");
        }
        r
    }

    /// `base` itself, or, when `size` asks for another machine than the base template's, a base template
    /// of that size (built once, as `base-<vcpus>c-<MiB>m`). Other templates keep their own size.
    async fn sized_base(
        &self,
        caller: &Caller,
        base: String,
        size: BuildSize,
        log: &BuildLog,
    ) -> StepResult<String> {
        let spec = crate::backend::TemplateSpec::base();
        let (vcpus, memory_mib) = (
            size.vcpus.unwrap_or(spec.vcpus),
            size.memory_mib.unwrap_or(spec.memory_mib),
        );
        if base != BASE || (vcpus, memory_mib) == (spec.vcpus, spec.memory_mib) {
            return Ok(base);
        }
        let id = format!("base-{vcpus}c-{memory_mib}m");
        if self.templates(caller).iter().any(|t| t.id == id) {
            return Ok(id);
        }
        log.info(
            Some(BASE_STEP),
            format!("Building the base template with {vcpus} vCPUs and {memory_mib} MiB as {id}"),
        );
        self.build_template(
            &Caller::Server,
            crate::backend::TemplateSpec {
                id: id.clone(),
                vcpus,
                memory_mib,
                ..spec
            },
            std::sync::Arc::new(|_| {}),
        )
        .await
        .map_err(|e| fail(BASE_STEP, format!("building {id}: {e}")))?;
        Ok(id)
    }

    async fn exec(
        &self,
        id: &str,
        req: ExecRequest,
        step: &str,
        log: &BuildLog,
    ) -> StepResult<i32> {
        let mut pending = String::new();
        let deadline = Duration::from_millis(req.timeout_ms.max(1000) + 5000);
        let r = self
            .backend
            .exec(
                id,
                req,
                deadline,
                Box::new(|ev| {
                    let (ExecEvent::Stdout(t) | ExecEvent::Stderr(t)) = ev else {
                        return;
                    };
                    pending.push_str(&t);
                    while let Some(nl) = pending.find('\n') {
                        let line: String = pending.drain(..=nl).collect();
                        log.info(Some(step), line.trim_end().to_string());
                    }
                }),
            )
            .await;
        if !pending.is_empty() {
            log.info(Some(step), pending.trim_end().to_string());
        }
        r.map(|(code, _)| code)
            .map_err(|e| fail(step, e.to_string()))
    }

    async fn run_steps(
        &self,
        id: &str,
        plan: &BuildPlan,
        template_id: &str,
        log: &BuildLog,
    ) -> StepResult<()> {
        let mut cx = Context {
            user: "user".into(),
            cwd: "/home/user".into(),
            envs: BTreeMap::new(),
        };
        let t0 = Instant::now();
        let left = |t0: Instant| BUILD_DEADLINE.saturating_sub(t0.elapsed()).as_millis() as u64;
        let n = plan.steps.len();
        for (i, s) in plan.steps.iter().enumerate() {
            let step = (i + 1).to_string();
            let step = step.as_str();
            let abs = |p: &str| match p.starts_with('/') {
                true => p.to_string(),
                false => format!("{}/{p}", cx.cwd.trim_end_matches('/')),
            };
            let req = |cmd: String, user: &str| ExecRequest {
                cmd,
                user: user.into(),
                cwd: Some(cx.cwd.clone()),
                envs: cx.envs.clone(),
                timeout_ms: left(t0),
                ..Default::default()
            };
            match s {
                Step::Run { cmd, user } => {
                    let user = user.as_deref().unwrap_or(&cx.user);
                    log.info(Some(step), format!("[builder {}/{n}] RUN {cmd}", i + 1));
                    let code = self.exec(id, req(cmd.clone(), user), step, log).await?;
                    if code != 0 {
                        return Err(fail(step, format!("RUN {cmd}: exit status {code}")));
                    }
                }
                Step::Copy {
                    src,
                    dest,
                    user,
                    mode,
                    files_hash,
                } => {
                    log.info(
                        Some(step),
                        format!("[builder {}/{n}] COPY {src} {dest}", i + 1),
                    );
                    let data =
                        std::fs::read(self.file_path(template_id, files_hash)).map_err(|e| {
                            fail(step, format!("COPY {src}: the upload is unreadable: {e}"))
                        })?;
                    let gzip = data.starts_with(&[0x1f, 0x8b]);
                    let owner = user.as_deref().unwrap_or(&cx.user);
                    let mut r = req(copy_script(src, &abs(dest), owner, *mode, gzip), "root");
                    r.stdin_b64 = Some(base64::Engine::encode(
                        &base64::engine::general_purpose::STANDARD,
                        &data,
                    ));
                    let code = self.exec(id, r, step, log).await?;
                    if code != 0 {
                        return Err(fail(step, format!("COPY {src} {dest}: exit status {code}")));
                    }
                }
                Step::Env(kv) => {
                    log.info(
                        Some(step),
                        format!(
                            "[builder {}/{n}] ENV {}",
                            i + 1,
                            kv.iter()
                                .map(|(k, v)| format!("{k}={v}"))
                                .collect::<Vec<_>>()
                                .join(" ")
                        ),
                    );
                    cx.envs.extend(kv.iter().cloned());
                }
                Step::Workdir(dir) => {
                    log.info(Some(step), format!("[builder {}/{n}] WORKDIR {dir}", i + 1));
                    let dir = abs(dir);
                    let code = self
                        .exec(
                            id,
                            req(
                                format!(
                                    "mkdir -p {d} && chown {u} {d}",
                                    d = sh(&dir),
                                    u = sh(&cx.user)
                                ),
                                "root",
                            ),
                            step,
                            log,
                        )
                        .await?;
                    if code != 0 {
                        return Err(fail(step, format!("WORKDIR {dir}: exit status {code}")));
                    }
                    cx.cwd = dir;
                }
                Step::User(u) => {
                    log.info(Some(step), format!("[builder {}/{n}] USER {u}", i + 1));
                    let code = self
                        .exec(id, req(format!("id -u {}", sh(u)), "root"), step, log)
                        .await?;
                    if code != 0 {
                        return Err(fail(step, format!("USER {u}: no such user")));
                    }
                    cx.user = u.clone();
                }
            }
        }
        let Some(start) = &plan.start_cmd else {
            return Ok(());
        };
        log.info(Some(FINALIZE_STEP), format!("Starting: {start}"));
        let mut r = ExecRequest {
            cmd: start.clone(),
            user: cx.user.clone(),
            cwd: Some(cx.cwd.clone()),
            envs: cx.envs.clone(),
            background: true,
            ..Default::default()
        };
        self.exec(id, r.clone(), FINALIZE_STEP, log).await?;
        let ready = plan.ready_cmd.clone().unwrap_or_else(|| "sleep 1".into());
        log.info(Some(FINALIZE_STEP), format!("Waiting for: {ready}"));
        r.cmd = ready.clone();
        r.background = false;
        r.timeout_ms = 10_000;
        let t = Instant::now();
        loop {
            if self.exec(id, r.clone(), FINALIZE_STEP, log).await? == 0 {
                return Ok(());
            }
            if t.elapsed() > READY_DEADLINE {
                return Err(fail(
                    FINALIZE_STEP,
                    format!(
                        "the ready check `{ready}` did not pass within {} s",
                        READY_DEADLINE.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

fn entry(level: LogLevel, step: Option<String>, message: String) -> LogEntry {
    LogEntry {
        at_ms: now_ms(),
        level,
        message,
        step,
    }
}

/// Appends to one build's log.
struct BuildLog(Arc<Mutex<Build>>);

impl BuildLog {
    fn push(&self, level: LogLevel, step: Option<&str>, message: String) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .logs
            .push(entry(level, step.map(str::to_string), message));
    }
    fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.push(LogLevel::Info, step, message.into());
    }
    fn warn(&self, step: Option<&str>, message: impl Into<String>) {
        self.push(LogLevel::Warn, step, message.into());
    }
}
