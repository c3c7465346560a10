//! E2B control-plane JSON objects (`docs/specs/e2b-compat.md §4.2`). Only this crate knows this JSON.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Every control-plane 4xx/5xx body: `{"code": <http status>, "message": "..."}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub code: u16,
    pub message: String,
    /// The sandbox a data-plane error is about (E2B's proxy names it).
    #[serde(default, rename = "sandboxId", skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
}

/// Body of `POST /v2/sandboxes` and `POST /sandboxes`. Unknown fields are ignored.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    /// Template id or alias.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds until the sandbox is killed (or paused with `autoPause`); default 300.
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    /// Environment of every process started in the sandbox.
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// On timeout pause instead of kill.
    #[serde(default)]
    pub auto_pause: Option<bool>,
    /// `false`: that pause keeps only the filesystem (a resume cold-boots; not with `autoResume`).
    #[serde(default)]
    pub auto_pause_memory: Option<bool>,
    /// `{"enabled": true}`: data-plane traffic to a paused sandbox resumes it.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub auto_resume: Option<serde_json::Value>,
    /// Accepted for old SDKs; an access token is always issued.
    #[serde(default)]
    pub secure: Option<bool>,
    /// `false` blocks all egress (as `deny_out: ["0.0.0.0/0"]`); default on.
    #[serde(
        default,
        alias = "allowInternetAccess",
        rename = "allow_internet_access"
    )]
    pub allow_internet_access: Option<bool>,
    /// Egress rules.
    #[serde(default)]
    pub network: Option<NetworkConfig>,
    /// Volumes (by name) to mount at absolute paths in the sandbox.
    #[serde(default, rename = "volumeMounts")]
    pub volume_mounts: Option<Vec<SandboxVolumeMount>>,
}

/// E2B's `SandboxVolumeMount`: a volume by name and where it is mounted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxVolumeMount {
    pub name: String,
    pub path: String,
}

/// E2B's `SandboxNetworkConfig`: the egress fields are enforced, the proxy-side ones accepted.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    /// Reachable destinations (IPv4, CIDR, host name or `*.domain`); they win over `denyOut`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    /// Blocked destinations (IPv4, CIDR, host name or `*.domain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    /// Resolvers allowed when `allowOut` names a domain (the sandbox's own resolver always is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    /// Whether its user ports answer requests without its `trafficAccessToken` (default true, as in
    /// E2B); false: they need that token (or the envd access token). envd's port always needs a token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
    /// The `Host` header requests from outside carry to the sandbox's user ports (`${PORT}` stands
    /// for the port); by default `localhost:<port>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Per-domain transforms (`host`, `*.suffix`, `host:port`) of the sandbox's HTTP and HTTPS
    /// requests, applied by the egress proxy; a domain listed here is not allowed by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<NetworkRules>,
}

/// E2B's `rules`: domain to its rules.
pub type NetworkRules = std::collections::BTreeMap<String, Vec<NetworkRule>>;

/// E2B's `SandboxNetworkRule`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct NetworkRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<NetworkTransform>,
}

/// E2B's `SandboxNetworkTransform`: headers set (replacing the sandbox's own) on each request.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct NetworkTransform {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<std::collections::BTreeMap<String, String>>,
}

/// One sample of `GET /sandboxes/{id}/metrics` (E2B's `SandboxMetric`, plus the network counters).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    /// RFC 3339.
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
    /// Bytes the guest sent out (absent without a network).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net_tx_bytes: Option<u64>,
    /// Bytes the guest received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net_rx_bytes: Option<u64>,
    /// Packets dropped by the egress rules, isolation or limits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net_dropped_packets: Option<u64>,
}

/// `PUT /sandboxes/{id}/network`: replaces every egress rule at once.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkUpdate {
    #[serde(default)]
    pub allow_out: Option<Vec<String>>,
    #[serde(default)]
    pub deny_out: Option<Vec<String>>,
    #[serde(default)]
    pub dns_servers: Option<Vec<String>>,
    /// `false`: as `denyOut: ["0.0.0.0/0"]`.
    #[serde(default)]
    pub allow_internet_access: Option<bool>,
    /// Replaces every transform rule (see [`NetworkConfig::rules`]).
    #[serde(default)]
    pub rules: Option<NetworkRules>,
}

/// Answer of create, connect and resume.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreatedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    pub envd_access_token: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    pub domain: Option<String>,
    pub traffic_access_token: Option<String>,
}

/// Visible sandbox state; transitional states are never shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Running,
    Paused,
}

impl From<agentenv_control::SandboxState> for SandboxState {
    fn from(s: agentenv_control::SandboxState) -> Self {
        match s {
            agentenv_control::SandboxState::Running => SandboxState::Running,
            agentenv_control::SandboxState::Paused => SandboxState::Paused,
        }
    }
}

impl From<SandboxState> for agentenv_control::SandboxState {
    fn from(s: SandboxState) -> Self {
        match s {
            SandboxState::Running => agentenv_control::SandboxState::Running,
            SandboxState::Paused => agentenv_control::SandboxState::Paused,
        }
    }
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
        }
    }
}

/// One item of `GET /v2/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// RFC 3339 UTC.
    pub started_at: String,
    /// RFC 3339 UTC.
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    pub state: SandboxState,
    pub metadata: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<SandboxVolumeMount>,
}

/// Answer of `GET /sandboxes/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(flatten)]
    pub listed: ListedSandbox,
    pub envd_access_token: String,
    pub domain: Option<String>,
    pub allow_internet_access: bool,
    /// The egress rules in force (absent without a network).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkConfig>,
    pub lifecycle: Lifecycle,
}

/// What happens at `endAt` and on traffic to a paused sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    pub auto_resume: bool,
    /// `kill` or `pause`.
    pub on_timeout: String,
}

/// Body of `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TimeoutRequest {
    /// Seconds from now.
    pub timeout: u64,
}

/// Body of the connect routes (may be absent or `{}`).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ConnectRequest {
    #[serde(default)]
    pub timeout: Option<u64>,
}

/// Body of `POST /sandboxes/{id}/pause` (may be absent or `{}`).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PauseRequest {
    /// `false`: keep only the filesystem (processes end; a resume cold-boots). Default `true`.
    #[serde(default)]
    pub memory: Option<bool>,
}

/// Body of the legacy `POST /sandboxes/{id}/resume`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResumeRequest {
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default)]
    pub auto_pause: Option<bool>,
}

/// One template as listed by `GET /templates`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateView {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub aliases: Vec<String>,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    pub envd_version: String,
    /// RFC 3339 UTC.
    pub built_at: String,
    /// `reference@digest` of the OCI image it was built from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_image: Option<String>,
}

/// Body of `POST /templates`: build a template through the runtime.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BuildTemplateRequest {
    /// Template id (lowercase letters, digits and `-`).
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Other names of the template.
    #[serde(default)]
    pub aliases: Vec<String>,
    #[serde(default)]
    pub cpu_count: Option<u32>,
    #[serde(default, rename = "memoryMB")]
    pub memory_mb: Option<u32>,
    #[serde(default, rename = "diskSizeMB")]
    pub disk_size_mb: Option<u32>,
    /// Build from this OCI image (`registry[:port]/repo[:tag|@sha256:...]`) instead of Debian minbase.
    #[serde(default)]
    pub from_image: Option<String>,
    /// Registry user name for `fromImage`.
    #[serde(default)]
    pub registry_username: Option<String>,
    /// Registry password or token for `fromImage`.
    #[serde(default)]
    pub registry_password: Option<String>,
}

/// Body of `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SnapshotRequest {
    /// `name[:tag]`; moves the name from an older snapshot holding it.
    #[serde(default)]
    pub name: Option<String>,
    /// `false`: filesystem only (sandboxes made from it cold-boot). Default `true`.
    #[serde(default)]
    pub memory: Option<bool>,
}

/// A snapshot as E2B lists it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotView {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    /// `name:tag` names.
    pub names: Vec<String>,
    /// agentenv: bytes this snapshot added to the chunk store (absent until its background ingest is done).
    #[serde(rename = "storedBytesNew", skip_serializing_if = "Option::is_none")]
    pub stored_bytes_new: Option<u64>,
    /// agentenv: bytes of data in its files.
    #[serde(rename = "storedBytesData", skip_serializing_if = "Option::is_none")]
    pub stored_bytes_data: Option<u64>,
}

/// Body of `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ForkRequest {
    /// Seconds each fork lives; default 300.
    #[serde(default)]
    pub timeout: Option<u64>,
    /// Forks to make, 1..=20; default 1.
    #[serde(default)]
    pub count: Option<u32>,
}

/// One fork: the new sandbox, or why it failed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<CreatedSandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// Body of `POST /v3/templates` (`Template.build`).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildRequestV3 {
    /// `name` or `name:tag`.
    #[serde(default)]
    pub name: Option<String>,
    /// Deprecated form of `name`.
    #[serde(default)]
    pub alias: Option<String>,
    #[serde(default)]
    pub tags: Option<Vec<String>>,
    /// vCPUs of the template's sandboxes (from `base` only: others keep their size).
    #[serde(default)]
    pub cpu_count: Option<u32>,
    /// Memory of the template's sandboxes, MiB (from `base` only).
    #[serde(default, rename = "memoryMB")]
    pub memory_mb: Option<u32>,
}

/// Answer of `POST /v3/templates`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateRequestResponseV3 {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    pub public: bool,
    pub names: Vec<String>,
    pub tags: Vec<String>,
    pub aliases: Vec<String>,
}

/// `POST /templates/tags`: give the build `target` (`name:tag`) more tags.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct AssignTemplateTags {
    pub target: String,
    /// Each `tag` or `name:tag`.
    pub tags: Vec<String>,
}

/// Answer of `POST /templates/tags`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AssignedTemplateTags {
    /// The build's id (UUID-shaped).
    #[serde(rename = "buildID")]
    pub build_id: String,
    /// The tags, without the name.
    pub tags: Vec<String>,
}

/// `DELETE /templates/tags`: take tags from template `name`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct DeleteTemplateTags {
    pub name: String,
    pub tags: Vec<String>,
}

/// Answer of `GET /templates/{templateID}/files/{hash}`: where to `PUT` the COPY archive.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateBuildFileUpload {
    pub present: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Headers the upload must carry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// One step of a build.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateStep {
    /// `RUN`, `COPY`, `ENV`, `WORKDIR` or `USER`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// SHA-256 of a COPY's files, as uploaded.
    #[serde(default)]
    pub files_hash: Option<String>,
    /// Accepted; every build runs every step.
    #[serde(default)]
    pub force: Option<bool>,
}

/// Body of `POST /v2/templates/{templateID}/builds/{buildID}`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildStartV2 {
    #[serde(default)]
    pub from_image: Option<String>,
    #[serde(default)]
    pub from_template: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    pub force: Option<bool>,
    #[serde(default)]
    pub steps: Vec<TemplateStep>,
    #[serde(default)]
    pub start_cmd: Option<String>,
    #[serde(default)]
    pub ready_cmd: Option<String>,
}

/// One build log line.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BuildLogEntry {
    /// RFC 3339.
    pub timestamp: String,
    pub message: String,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BuildStatusReason {
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    pub log_entries: Vec<BuildLogEntry>,
}

/// Answer of `GET /templates/{templateID}/builds/{buildID}/status`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateBuildInfo {
    /// Always empty (E2B's V1 field); see `logEntries`.
    pub logs: Vec<String>,
    #[serde(rename = "logEntries")]
    pub log_entries: Vec<BuildLogEntry>,
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "buildID")]
    pub build_id: String,
    /// `waiting`, `building`, `ready` or `error`.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<BuildStatusReason>,
}

/// Answer of `GET /templates/aliases/{alias}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TemplateAliasResponse {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub public: bool,
}
