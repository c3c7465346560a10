//! The etcd schema: every key the cluster writes and the records under them.
//!
//! Layout (under a prefix, `/agentenv/v1/` by default; tests give each cluster its own):
//! - `nodes/<node>`: [`NodeRecord`], attached to the node's lease, so it disappears when the node stops
//!   refreshing it.
//! - `claims/<node>/<random>`: [`Claim`], one per placement in flight or not yet in the node's record,
//!   on a short lease of the gateway's.
//! - `placed/<sandbox>`: the node that holds the sandbox (gateways write it; see [`crate::map`]).
//! - `sandboxes/<node>/<sandbox>`: [`SandboxEntry`], its state and the handoff of a paused one; a node
//!   writes only under its own `sandboxes/<node>/`.
//! - `tokens/<sha256 of access token>`: the sandbox id (data-plane routing by access token).
//! - `idempotency/<tenant>/<key>`: [`IdempotencyEntry`] of a create with an `Idempotency-Key`, leased.
//! - `snapshots/<snapshot>`: [`SnapshotEntry`], where a snapshot was taken (locality before the node's
//!   next record lists it).
//!
//! Invariant: records are JSON with a `version` field; a reader refuses a newer version instead of
//! misreading it ([`decode`]).

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Version of every record this build writes.
pub const SCHEMA_VERSION: u32 = 1;
/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "/agentenv/v1/";

/// Key names under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// `prefix` gets a trailing `/` if it lacks one.
    pub fn new(prefix: &str) -> Keys {
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Keys { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn nodes(&self) -> String {
        format!("{}nodes/", self.prefix)
    }
    pub fn node(&self, node: &str) -> String {
        format!("{}nodes/{node}", self.prefix)
    }
    pub fn claims(&self) -> String {
        format!("{}claims/", self.prefix)
    }
    pub fn claim(&self, node: &str, claim: &str) -> String {
        format!("{}claims/{node}/{claim}", self.prefix)
    }
    pub fn sandboxes(&self) -> String {
        format!("{}sandboxes/", self.prefix)
    }
    /// The entries of the sandboxes on `node`: the only map keys that node writes.
    pub fn sandboxes_on(&self, node: &str) -> String {
        format!("{}sandboxes/{node}/", self.prefix)
    }
    pub fn sandbox(&self, node: &str, id: &str) -> String {
        format!("{}sandboxes/{node}/{id}", self.prefix)
    }
    /// `(node, id)` of a [`Keys::sandbox`] key.
    pub fn parse_sandbox<'a>(&self, key: &'a str) -> Option<(&'a str, &'a str)> {
        let (node, id) = key.strip_prefix(&self.sandboxes())?.split_once('/')?;
        (!node.is_empty() && !id.is_empty() && !id.contains('/')).then_some((node, id))
    }
    pub fn placements(&self) -> String {
        format!("{}placed/", self.prefix)
    }
    pub fn placed(&self, id: &str) -> String {
        format!("{}placed/{id}", self.prefix)
    }
    pub fn token(&self, token_sha256: &str) -> String {
        format!("{}tokens/{token_sha256}", self.prefix)
    }
    pub fn idempotency(&self, tenant: &str, key: &str) -> String {
        format!("{}idempotency/{tenant}/{key}", self.prefix)
    }
    pub fn snapshot(&self, id: &str) -> String {
        format!("{}snapshots/{id}", self.prefix)
    }
}

impl Default for Keys {
    fn default() -> Keys {
        Keys::new(DEFAULT_PREFIX)
    }
}

/// What a node publishes about itself, refreshed every few seconds under its lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub version: u32,
    /// Stable id (kept in the node's state folder).
    pub id: String,
    /// Base URL gateways reach its API at (`--advertise`).
    pub url: String,
    /// Host CPUs.
    pub cpus: u32,
    /// vCPUs of its running sandboxes, with creates in flight.
    pub vcpus_used: u32,
    /// Host memory, MiB.
    pub memory_mb: u64,
    /// Memory the host can still give (MemAvailable), MiB.
    pub free_memory_mb: u64,
    /// Running sandboxes, with creates in flight.
    pub running: u32,
    pub paused: u32,
    /// Its `--max-running`, if any.
    pub max_running: Option<u32>,
    /// Template ids and aliases it can start sandboxes from.
    pub templates: Vec<String>,
    /// Snapshots whose files it holds (ids and scoped names): the chunk summary placement uses for
    /// locality. Others it imports from the shared bucket first.
    pub snapshots: Vec<String>,
    /// Whether its snapshots go to the shared bucket (only then can another node take over its sandboxes).
    pub shared_store: bool,
    pub updated_at_ms: i64,
    /// Size of the sandboxes made from each of its templates and snapshots, by every id and name listed
    /// above (records of older nodes have none).
    #[serde(default)]
    pub sizes: BTreeMap<String, MachineSize>,
}

/// vCPUs and guest RAM of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineSize {
    pub vcpus: u32,
    pub memory_mb: u64,
}

/// A placement not yet visible in the node's own record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    pub version: u32,
    pub node: String,
    pub vcpus: u32,
    pub memory_mb: u64,
    pub at_ms: i64,
}

/// Whether a sandbox was last seen running or paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryState {
    Running,
    Paused,
    /// Paused, and being adopted by `node` after its first node left (adopting is idempotent, so
    /// whoever sees this state finishes the move).
    Moving,
    /// Killed while `node` was away: gone for clients; `node` kills its copy when it returns. Leased.
    Killed,
}

/// What another node needs to take over a paused sandbox: a snapshot of it in the shared bucket and the
/// server's record of it (opaque here: the server crate owns its format).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Handoff {
    pub snapshot_id: String,
    pub record: serde_json::Value,
}

/// Which node holds a sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxEntry {
    pub version: u32,
    pub sandbox_id: String,
    pub node: String,
    /// Tenant that owns it.
    pub owner: String,
    pub state: EntryState,
    /// Set while it is paused with a snapshot in the shared bucket.
    pub handoff: Option<Handoff>,
    pub updated_at_ms: i64,
    /// SHA-256 of its access token (its `tokens/` key, forgotten with it); absent in older entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_sha256: Option<String>,
}

/// A create with an `Idempotency-Key`: the node the first of them went to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdempotencyEntry {
    pub version: u32,
    pub node: String,
}

/// Where a snapshot was taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotEntry {
    pub version: u32,
    pub snapshot_id: String,
    pub node: String,
    pub owner: String,
    pub names: Vec<String>,
}

/// Why a stored record cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("{key}: not a record: {error}")]
    Json {
        key: String,
        error: serde_json::Error,
    },
    #[error("{key}: record version {found} is newer than this build's {SCHEMA_VERSION}")]
    Newer { key: String, found: u64 },
}

/// Decodes the record under `key`, refusing versions newer than [`SCHEMA_VERSION`].
pub fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, DecodeError> {
    #[derive(Deserialize)]
    struct Version {
        #[serde(default)]
        version: u64,
    }
    let json = |error| DecodeError::Json {
        key: key.to_string(),
        error,
    };
    let found = serde_json::from_slice::<Version>(bytes)
        .map_err(json)?
        .version;
    if found > u64::from(SCHEMA_VERSION) {
        return Err(DecodeError::Newer {
            key: key.to_string(),
            found,
        });
    }
    serde_json::from_slice(bytes).map_err(json)
}

/// JSON bytes of a record.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(record).expect("records serialize")
}

/// Whether `id` is a valid node id: 1-63 of `[a-z0-9-]`, so also a DNS label (a node's certificate
/// names it, see [`crate::node_tls`]).
pub fn valid_node_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_nest_under_the_prefix() {
        let k = Keys::new("/t/x");
        assert_eq!(k.node("n1"), "/t/x/nodes/n1");
        assert!(k.node("n1").starts_with(&k.nodes()));
        assert!(k.claim("n1", "c").starts_with(&k.claims()));
        assert!(k.sandbox("n", "s").starts_with(&k.sandboxes_on("n")));
        assert!(k.sandboxes_on("n").starts_with(&k.sandboxes()));
        assert_eq!(k.parse_sandbox(&k.sandbox("n-1", "s")), Some(("n-1", "s")));
        assert_eq!(k.parse_sandbox(&format!("{}s", k.sandboxes())), None);
        assert!(!k.sandboxes_on("n1").starts_with(&k.sandboxes_on("n")));
        assert_eq!(k.idempotency("team", "abc"), "/t/x/idempotency/team/abc");
    }

    #[test]
    fn newer_records_are_refused() {
        let bytes = br#"{"version": 99, "node": "a"}"#;
        let r = decode::<IdempotencyEntry>("k", bytes);
        assert!(
            matches!(r, Err(DecodeError::Newer { found: 99, .. })),
            "{r:?}"
        );
        let ok: IdempotencyEntry = decode("k", br#"{"version": 1, "node": "a"}"#).unwrap();
        assert_eq!(ok.node, "a");
        assert!(decode::<IdempotencyEntry>("k", b"{").is_err());
    }
}
