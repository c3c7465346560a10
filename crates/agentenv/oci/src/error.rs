//! The error of every registry operation (pull, push) and of layer application.

use std::path::PathBuf;
use std::time::Duration;

use crate::reference::{Digest, RefError};

/// A failed pull, push or layer application.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The image reference or a digest is malformed.
    #[error(transparent)]
    Reference(#[from] RefError),
    /// The registry could not be reached or the connection broke.
    #[error("{method} {url}: {reason}")]
    Transport {
        /// HTTP method.
        method: &'static str,
        /// Request URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// A request ran past its deadline.
    #[error("{method} {url}: no answer within {after:?}")]
    Timeout {
        /// HTTP method.
        method: &'static str,
        /// Request URL.
        url: String,
        /// The deadline.
        after: Duration,
    },
    /// 401: credentials needed or rejected.
    #[error(
        "{registry}/{repository}: authentication required ({detail}); {}",
        if *.had_credentials { "the credentials were rejected" } else { "no credentials were given" }
    )]
    Unauthorized {
        /// Registry host.
        registry: String,
        /// Repository.
        repository: String,
        /// Whether credentials were sent.
        had_credentials: bool,
        /// Registry's message or challenge.
        detail: String,
    },
    /// 403: authenticated but not allowed.
    #[error("{registry}/{repository}: access denied ({detail})")]
    Forbidden {
        /// Registry host.
        registry: String,
        /// Repository.
        repository: String,
        /// Registry's message.
        detail: String,
    },
    /// 404: no such repository, tag, manifest or blob.
    #[error("{registry}/{repository}: {what} {reference} not found ({detail})")]
    NotFound {
        /// Registry host.
        registry: String,
        /// Repository.
        repository: String,
        /// `manifest` or `blob`.
        what: &'static str,
        /// Tag or digest asked for.
        reference: String,
        /// Registry's error code and message (`NAME_UNKNOWN`, `MANIFEST_UNKNOWN`, ...).
        detail: String,
    },
    /// Any other unexpected status.
    #[error("{method} {url}: HTTP {status}: {detail}")]
    Status {
        /// HTTP method.
        method: &'static str,
        /// Request URL.
        url: String,
        /// Status code.
        status: u16,
        /// Registry's message.
        detail: String,
    },
    /// The bearer-token endpoint failed.
    #[error("token request to {realm}: {reason}")]
    Token {
        /// Token realm URL.
        realm: String,
        /// What went wrong.
        reason: String,
    },
    /// A manifest, index or config could not be understood.
    #[error("{what} {reference}: {reason}")]
    BadDocument {
        /// `manifest`, `index` or `config`.
        what: &'static str,
        /// Tag or digest.
        reference: String,
        /// What is wrong.
        reason: String,
    },
    /// The index has no manifest for the wanted platform.
    #[error("{image}: no manifest for {wanted}; the index has: {}", if .present.is_empty() { "nothing".to_string() } else { .present.join(", ") })]
    PlatformMissing {
        /// The image.
        image: String,
        /// The wanted platform.
        wanted: String,
        /// Platforms the index lists.
        present: Vec<String>,
    },
    /// A layer of a media type we cannot apply.
    #[error("layer {digest}: unsupported media type {media_type}")]
    UnsupportedLayer {
        /// Layer digest.
        digest: Digest,
        /// Its media type.
        media_type: String,
    },
    /// A blob is larger than `max_layer_bytes` (or a document than its fixed cap).
    #[error("{what} {digest}: {size} bytes is over the limit of {limit} bytes")]
    TooLarge {
        /// `layer`, `config` or `manifest`.
        what: &'static str,
        /// Its digest.
        digest: String,
        /// Its size (declared or seen so far).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The layers together exceed `max_total_bytes`.
    #[error("image {image}: layers total {total} bytes, over the limit of {limit} bytes")]
    ImageTooLarge {
        /// The image.
        image: String,
        /// Sum of the layer sizes.
        total: u64,
        /// The limit.
        limit: u64,
    },
    /// Unpacked content exceeds `max_unpacked_bytes`.
    #[error("layer {digest}: unpacked content over the limit of {limit} bytes")]
    UnpackedTooLarge {
        /// Layer digest.
        digest: Digest,
        /// The limit.
        limit: u64,
    },
    /// A layer has more archive entries than `max_layer_entries`.
    #[error("layer {layer}: more than {limit} archive entries")]
    TooManyEntries {
        /// Layer digest.
        layer: String,
        /// The limit.
        limit: u64,
    },
    /// Content does not hash to its digest.
    #[error("{what} {expected}: content hashes to {actual}")]
    DigestMismatch {
        /// `manifest`, `config`, `layer` or `layer diff_id`.
        what: &'static str,
        /// Expected digest.
        expected: Digest,
        /// Actual digest.
        actual: Digest,
    },
    /// A blob's length differs from its descriptor.
    #[error("{what} {digest}: expected {expected} bytes, got {actual}{}", if *.more { " or more" } else { "" })]
    SizeMismatch {
        /// `config` or `layer`.
        what: &'static str,
        /// Its digest.
        digest: Digest,
        /// Declared size.
        expected: u64,
        /// Bytes received.
        actual: u64,
        /// The registry sent more than declared (stopped reading).
        more: bool,
    },
    /// A tar entry would land outside the destination.
    #[error("layer {layer}: entry {entry:?} refused: {reason}")]
    PathEscape {
        /// Layer digest.
        layer: String,
        /// Entry path as in the archive.
        entry: String,
        /// Why.
        reason: &'static str,
    },
    /// The layer is not a readable tar stream.
    #[error("layer {layer}: bad archive: {reason}")]
    BadLayer {
        /// Layer digest.
        layer: String,
        /// What is wrong.
        reason: String,
    },
    /// A step of the layer jail (mount namespace, chroot, capabilities) failed; nothing was applied.
    #[error("layer jail for {path}: {step}: {source}")]
    Jail {
        /// The step: `unshare`, `bind-mount`, `chroot`, `capset`, ...
        step: &'static str,
        /// The destination folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The config's `User` names a user or group the image does not have.
    #[error("image user {user:?}: {reason}")]
    UnknownUser {
        /// `User` as in the config.
        user: String,
        /// What is missing.
        reason: String,
    },
    /// Local file i/o.
    #[error("{what} {path}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

pub(crate) fn io<'a>(
    what: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> OciError + 'a {
    move |source| OciError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}
