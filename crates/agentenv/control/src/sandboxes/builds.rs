//! Template builds as E2B's `Template.build` drives them: a VM made from the base template runs the
//! steps (RUN, COPY, ENV, WORKDIR, USER), starts the start command and waits for its ready check;
//! it is then snapshotted with the start command running. The snapshot carries the build's names
//! and the template id, so `Sandbox.create(name)` restores it as fast as any snapshot.
//!
//! Builds live in memory (their result, the snapshot, is durable); uploaded COPY archives live under
//! `<state>/server/build-files/<template>/<hash>`, bounded (`build_files.rs`).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Caller, LifecycleError, Result, Sandboxes};
use crate::backend::{ExecEvent, ExecRequest};
use crate::tenants;

use super::build_files::BuildFiles;
use super::build_script::{copy_script, sh};

mod run;

/// Largest uploaded COPY archive.
pub const MAX_BUILD_FILE_BYTES: usize = 64 << 20;
/// Metadata key of a build's sandbox (its value: the template id); such a sandbox ends with a restart.
pub const BUILD_MARK: &str = "agentenv.build";
/// Steps of one build.
pub const MAX_STEPS: usize = 256;
/// A whole build, steps and ready check included.
const BUILD_DEADLINE: Duration = Duration::from_secs(3600);
/// The ready check, from the start command's start.
const READY_DEADLINE: Duration = Duration::from_secs(300);
use super::build_log::MAX_BUILDS_KEPT;
use super::build_log::{Build, BuildLog, entry, evict_finished, take_lines};
pub use super::build_view::*;

/// Images that mean "E2B's base": our `base` template is its counterpart.
const BASE_IMAGES: [&str; 2] = ["e2bdev/base", "e2bdev/base:latest"];
/// The base template.
const BASE: &str = "base";
/// E2B's step names for what comes before and after the steps.
const BASE_STEP: &str = "base";
const FINALIZE_STEP: &str = "finalize";

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
    files: BuildFiles,
    templates: Mutex<HashMap<String, TemplateEntry>>,
    /// Per tenant, the build of a built-in template started on first use (`builtin.rs`).
    pub(super) builtin: Mutex<HashMap<String, (String, String)>>,
}

impl Builds {
    pub(super) fn new(state_dir: &std::path::Path) -> Builds {
        Builds {
            files: BuildFiles::open(state_dir.join("server").join("build-files")),
            templates: Mutex::new(HashMap::new()),
            builtin: Mutex::new(HashMap::new()),
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
        size.spec()
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
            tags.push(agentenv_vm::DEFAULT_TAG.into());
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
        evict_finished(&mut entry.builds, MAX_BUILDS_KEPT - 1);
        entry
            .builds
            .insert(build_id.clone(), Arc::new(Mutex::new(Build::new(size))));
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
        self.builds.files.path(template_id, hash)
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
        Ok(self.builds.files.present(template_id, hash))
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
        let owner = caller.owner();
        let owned = |t: &str| self.builds.lock().get(t).is_some_and(|e| e.owner == owner);
        self.builds.files.put(template_id, hash, data, owned)
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
                    b.log(entry(
                        LogLevel::Info,
                        None,
                        format!("Template is ready ({snapshot})"),
                    ));
                    b.status = BuildStatus::Ready;
                }
                Err(f) => {
                    tracing::warn!(template = %tid, build = %bid, error = %f.message, "template build failed");
                    b.log(entry(LogLevel::Error, f.step.clone(), f.message.clone()));
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
            logs: b.page(offset),
            failure: b.failure.clone(),
        })
    }

    /// The template id that name or alias `alias` stands for, for `caller`.
    pub fn template_by_alias(&self, caller: &Caller, alias: &str) -> Option<String> {
        let wanted = agentenv_vm::normalize_name(alias);
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
}
