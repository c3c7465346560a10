//! What a template build is asked for and reports: its plan, steps, status, log entries and failure.

/// Log entries per status answer (E2B's page).
pub const LOGS_PAGE: usize = 100;

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

impl BuildSize {
    /// The default template's spec at this size (unset parts keep the default's).
    pub fn spec(&self) -> crate::backend::TemplateSpec {
        let base = crate::backend::TemplateSpec::base();
        crate::backend::TemplateSpec {
            vcpus: self.vcpus.unwrap_or(base.vcpus),
            memory_mib: self.memory_mib.unwrap_or(base.memory_mib),
            ..base
        }
    }
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
