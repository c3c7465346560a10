//! Wire types of the OCI image spec and Docker's v2 schema 2 (the subset a puller needs).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::reference::Digest;

/// OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image config.
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI layer, uncompressed tar.
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// OCI layer, gzip.
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// OCI layer, zstd.
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// Docker manifest list.
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker v2 schema 2 manifest.
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker image config.
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// Docker layer (gzip).
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// Docker foreign layer (gzip, usually Windows base layers).
pub const DOCKER_LAYER_FOREIGN: &str = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip";

/// The Accept header of a manifest GET: every kind we can read.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";

/// A content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// Media type of the referenced content.
    pub media_type: String,
    /// Its digest.
    pub digest: Digest,
    /// Its size in bytes.
    pub size: u64,
    /// Platform (index entries only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An image platform.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    /// e.g. `amd64`, `arm64`.
    pub architecture: String,
    /// e.g. `linux`.
    pub os: String,
    /// e.g. `v8` for arm64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

impl Platform {
    /// `linux/amd64`, the platform our microVMs run.
    pub fn linux_amd64() -> Platform {
        Platform {
            architecture: "amd64".into(),
            os: "linux".into(),
            variant: None,
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// An image manifest (OCI or Docker v2 schema 2; same shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    /// Always 2.
    pub schema_version: u32,
    /// Media type (optional in OCI, then the Content-Type says it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The image config blob.
    pub config: Descriptor,
    /// Layer blobs, lowest first.
    pub layers: Vec<Descriptor>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An image index / manifest list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    /// Always 2.
    pub schema_version: u32,
    /// Media type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// One manifest per platform.
    pub manifests: Vec<Descriptor>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The image config blob as stored (`os`, `architecture`, `config`, `rootfs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigBlob {
    /// e.g. `amd64`.
    #[serde(default)]
    pub architecture: String,
    /// e.g. `linux`.
    #[serde(default)]
    pub os: String,
    /// The run-time settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<RunConfig>,
    /// Uncompressed layer digests.
    #[serde(default)]
    pub rootfs: RootFs,
}

/// `rootfs` of a config blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootFs {
    /// Always `layers`.
    #[serde(rename = "type")]
    pub kind: String,
    /// sha256 of each uncompressed layer tar, lowest first.
    pub diff_ids: Vec<Digest>,
}

impl Default for RootFs {
    fn default() -> RootFs {
        RootFs {
            kind: "layers".into(),
            diff_ids: vec![],
        }
    }
}

/// `config` of a config blob (the fields a sandbox honours; Docker capitalises them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    /// `user`, `uid`, `user:group` or `uid:gid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `KEY=value` entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    /// Entrypoint argv.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    /// Default arguments (or the command when there is no entrypoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    /// `port/proto` keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    /// Labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Stop signal, e.g. `SIGTERM`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
}

/// What kind of manifest document a body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Index,
    Manifest,
}

/// Decides from the Content-Type, else from the body's `mediaType`, else from its shape.
pub(crate) fn kind_of(content_type: Option<&str>, body: &serde_json::Value) -> Option<Kind> {
    let ct = content_type
        .map(|c| c.split(';').next().unwrap_or("").trim())
        .filter(|c| !c.is_empty() && *c != "application/json" && *c != "text/plain");
    let mt = ct.or_else(|| body.get("mediaType").and_then(|v| v.as_str()));
    match mt {
        Some(OCI_INDEX | DOCKER_LIST) => Some(Kind::Index),
        Some(OCI_MANIFEST | DOCKER_MANIFEST) => Some(Kind::Manifest),
        Some(_) => None,
        None if body.get("manifests").is_some() => Some(Kind::Index),
        None if body.get("layers").is_some() => Some(Kind::Manifest),
        None => None,
    }
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain tar.
    None,
    /// gzip.
    Gzip,
    /// zstd.
    Zstd,
}

impl Compression {
    /// From a layer media type; `None` for a type that is not a layer we can apply.
    pub fn of_media_type(mt: &str) -> Option<Compression> {
        match mt {
            OCI_LAYER_TAR | "application/vnd.oci.image.layer.nondistributable.v1.tar" => {
                Some(Compression::None)
            }
            OCI_LAYER_GZIP
            | DOCKER_LAYER_GZIP
            | DOCKER_LAYER_FOREIGN
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip" => {
                Some(Compression::Gzip)
            }
            OCI_LAYER_ZSTD | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => {
                Some(Compression::Zstd)
            }
            _ => None,
        }
    }
}
