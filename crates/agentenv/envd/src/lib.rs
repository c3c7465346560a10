//! The envd contract: the one place that names what the guest agent (envd), the runtime and the server
//! agree on. Spec: `docs/specs/e2b-compat.md` §5–6.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// envd protocol version the guest agent implements (E2B `envdVersion`).
pub const ENVD_VERSION: &str = "0.6.4";
/// Port the SDK addresses envd on (`E2b-Sandbox-Port`, `49983-<id>.<domain>`).
pub const ENVD_PORT: u16 = 49983;
/// Name of the virtio-serial port that carries the agent channel (guest: `/dev/virtio-ports/<name>`).
pub const AGENT_CHANNEL: &str = "agentenv.0";

/// envd's plain HTTP paths.
pub mod signing;
pub mod volume;

pub mod paths {
    /// `GET`: 204 once the agent serves.
    pub const HEALTH: &str = "/health";
    /// `POST` [`super::InitRequest`]: host → agent settings. Reachable from the host only.
    pub const INIT: &str = "/init";
    /// `GET`: the default environment.
    pub const ENVS: &str = "/envs";
    /// `GET`: cpu, memory and disk usage.
    pub const METRICS: &str = "/metrics";
    /// `GET` download, `POST` multipart upload.
    pub const FILES: &str = "/files";
    /// `POST`: compose uploaded parts into one file.
    pub const FILES_COMPOSE: &str = "/files/compose";
    /// `POST`: flush the guest's file systems (agentenv extension; before filesystem snapshots).
    pub const SYNC: &str = "/sync";
    /// `POST` [`super::ExecRequest`]: runs a command for the host (template builds), answering with
    /// [`super::ExecEvent`]s, one JSON object per line (agentenv extension).
    pub const EXEC: &str = "/exec";
    /// `POST`, an upgrade to [`super::volume::UPGRADE`]: the host attaches a volume's channel
    /// (agentenv extension; [`super::volume`]).
    pub const VOLUME: &str = "/volume";
    /// Every plain path above.
    pub const ALL: [&str; 9] = [
        HEALTH,
        INIT,
        ENVS,
        METRICS,
        FILES,
        FILES_COMPOSE,
        SYNC,
        EXEC,
        VOLUME,
    ];
    /// Paths only the host (runtime) may call; the data-plane proxy refuses them.
    pub const HOST_ONLY: [&str; 4] = [INIT, SYNC, EXEC, VOLUME];
    /// Connect RPC service prefixes (`/process.Process/Start`, ...).
    pub const RPC_PREFIXES: [&str; 2] = ["/process.Process/", "/filesystem.Filesystem/"];

    /// True for a path envd serves (a plain path or a Connect method).
    pub fn is_envd(path: &str) -> bool {
        ALL.contains(&path) || RPC_PREFIXES.iter().any(|p| path.starts_with(p))
    }
}

/// The `POST /init` body (host → agent), camelCase on the wire as E2B's orchestrator sends it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct InitRequest {
    /// Merged into the default environment.
    #[serde(alias = "env_vars", skip_serializing_if = "Option::is_none")]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Token envd requires from data-plane callers.
    #[serde(alias = "access_token", skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// Default user of processes.
    #[serde(alias = "default_user", skip_serializing_if = "Option::is_none")]
    pub default_user: Option<String>,
    /// Default working folder of processes.
    #[serde(alias = "default_workdir", skip_serializing_if = "Option::is_none")]
    pub default_workdir: Option<String>,
    /// Host wall-clock time: Unix seconds (number) or RFC 3339 UTC string. The guest sets its clock.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<serde_json::Value>,
    /// Hex-encoded random bytes from the host, credited to the guest kernel's entropy pool and followed
    /// by a CRNG reseed, so machines restored from one snapshot draw distinct random streams.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entropy: Option<String>,
    /// A template's start command (argv), started once as a background process with tag [`START_TAG`],
    /// the default user, folder and environment; it then runs in every sandbox made from the template.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<Vec<String>>,
    /// Address, route and resolver of the guest's NIC (agentenv extension), sent at every create,
    /// resume and fork: each gets an address of its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<GuestNetwork>,
}

/// The `GET /metrics` answer: the guest's own view of its resources.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GuestMetrics {
    /// Unix seconds.
    pub ts: u64,
    pub cpu_count: u32,
    /// Busy share of all CPUs over 100 ms, percent.
    pub cpu_used_pct: f64,
    /// Bytes.
    pub mem_total: u64,
    pub mem_used: u64,
    pub mem_total_mib: u64,
    pub mem_used_mib: u64,
    /// Root file system, bytes.
    pub disk_total: u64,
    pub disk_used: u64,
}

/// Name of the guest's one NIC.
pub const GUEST_NIC: &str = "eth0";

/// The guest NIC's settings in [`InitRequest::network`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuestNetwork {
    /// IPv4 address of [`GUEST_NIC`].
    pub address: std::net::Ipv4Addr,
    /// Prefix length of its subnet.
    pub prefix_len: u8,
    /// Default gateway.
    pub gateway: std::net::Ipv4Addr,
    /// Resolvers written to `/etc/resolv.conf`.
    pub dns: Vec<std::net::Ipv4Addr>,
    /// MAC address, `02:..` (locally administered).
    pub mac: String,
    /// A CA certificate (PEM) the guest adds to its trust store: the host's egress proxy signs
    /// with it where it intercepts TLS (transform rules, the sandbox domain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
}

/// The request head that asks envd for a raw tunnel to TCP `port` on the guest's loopback
/// (`CONNECT 127.0.0.1:<port>`, agentenv extension); envd answers `200` and then carries bytes both
/// ways, or `502` when nothing listens there. The host opens tunnels for the data plane's user ports.
pub fn tunnel_request(port: u16) -> String {
    format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n")
}

/// The `POST /exec` body: one shell command (`bash -l -c`), run by the guest agent for the host.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ExecRequest {
    /// The script, as `bash -l -c` gets it.
    pub cmd: String,
    /// Run as this user (must exist in the guest).
    pub user: String,
    /// Working folder; `None`: the user's home.
    pub cwd: Option<String>,
    /// Over the sandbox's environment.
    pub envs: BTreeMap<String, String>,
    /// Killed after this long (0: no limit).
    pub timeout_ms: u64,
    /// Standard input, base64 (closed after it; `None`: empty).
    pub stdin_b64: Option<String>,
    /// Start it in the background with tag [`START_TAG`] and answer at once with
    /// [`ExecEvent::Started`] (a template's start command).
    pub background: bool,
}

/// Largest `/exec` body (standard input included), in bytes.
pub const MAX_EXEC_BODY: usize = 96 << 20;

/// One line of the `/exec` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ExecEvent {
    /// Running in the background (`background`), with this pid.
    Started(u32),
    /// Output (UTF-8, lossy).
    Stdout(String),
    Stderr(String),
    /// The end: the exit code (−1 when killed by a signal) and Go-style status text.
    Exit {
        code: i32,
        status: String,
    },
    /// It could not start.
    Error(String),
}

/// Process tag of a template's start command.
pub const START_TAG: &str = "start";

/// Hex encoding of bytes (for [`InitRequest::entropy`]).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Decodes [`hex`]; `None` on odd length or a non-hex digit.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_round_trips_camel_case_and_accepts_snake_case() {
        let r = InitRequest {
            env_vars: Some(BTreeMap::from([("A".into(), "1".into())])),
            timestamp: Some(serde_json::json!(1_700_000_000.5)),
            entropy: Some(hex(&[0, 255, 16])),
            ..Default::default()
        };
        let text = serde_json::to_string(&r).unwrap();
        assert!(
            text.contains("\"envVars\"") && !text.contains("accessToken"),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<InitRequest>(&text).unwrap(), r);
        let snake: InitRequest =
            serde_json::from_str(r#"{"env_vars":{"B":"2"},"default_user":"root"}"#).unwrap();
        assert_eq!(snake.default_user.as_deref(), Some("root"));
    }

    #[test]
    fn hex_round_trips_random_bytes_and_rejects_garbage() {
        for n in 0..64usize {
            let b: Vec<u8> = (0..n).map(|i| (i * 37 + n) as u8).collect();
            assert_eq!(unhex(&hex(&b)).unwrap(), b);
        }
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }

    #[test]
    fn envd_paths_are_classified() {
        assert!(paths::is_envd("/process.Process/Start"));
        assert!(paths::is_envd("/files"));
        assert!(!paths::is_envd("/sandboxes"));
        assert!(paths::HOST_ONLY.iter().all(|p| paths::ALL.contains(p)));
    }
}
