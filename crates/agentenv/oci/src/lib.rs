//! `agentenv_oci`: pulls OCI and Docker images from a registry into a directory, for agentenv
//! templates.
//!
//! ```no_run
//! use agentenv_oci::{ImageRef, PullOptions, pull};
//! let image = ImageRef::parse("debian:bookworm-slim")?;
//! let pulled = pull(&image, "/tmp/rootfs".as_ref(), &PullOptions::default(), &mut |e| eprintln!("{e:?}"))?;
//! println!("{} {:?}", pulled.digest, pulled.config.command());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! - [`ImageRef`]: `registry[:port]/repo[:tag|@sha256:...]` with Docker Hub defaults.
//! - [`pull`]: distribution API client (index → linux/amd64 manifest → config → layers), every blob
//!   checked against its digest and size, size limits enforced from the manifest before any layer is
//!   downloaded, anonymous / basic / bearer-token auth, a deadline on every request; plain http only
//!   for loopback registries unless [`RegistryOptions::scheme`] says otherwise.
//! - [`apply_layer`]: tar / gzip / zstd layers with whiteouts, opaque directories, links, devices,
//!   modes, owners and xattrs; no entry can land outside the destination. As root the extraction
//!   runs jailed (`jail`): a thread of its own chrooted into the destination, mounted nosuid,nodev
//!   in a mount namespace of its own, with only the capabilities unpacking needs.
//! - [`resolve_user`]: the config's `User` against the image's own passwd and group files.
//! - [`push`]: blob, manifest and index upload (tests, and `aenv` later).
//! - `testing` (feature `testing`): a real `docker-registry` on loopback and test image builders.
//!
//! The API is blocking (one helper thread per pull); async callers use `spawn_blocking`.

mod apply;
mod client;
mod error;
pub mod guard;
#[doc(hidden)]
pub mod jail;
pub mod manifest;
mod pull;
pub mod push;
mod reference;
mod stream;
#[cfg(feature = "testing")]
pub mod testing;
mod user;

pub use apply::{ApplyOptions, ApplyStats, apply_layer};
pub use client::{Credentials, RegistryOptions, Scheme};
pub use error::OciError;
pub use guard::AllowedNet;
pub use manifest::{Compression, Platform};
pub use pull::{
    ImageConfig, PullEvent, PullOptions, PulledImage, PulledLayer, ResolvedImage, pull, resolve,
};
pub use reference::{DEFAULT_TAG, DOCKER_HUB, Digest, ImageRef, RefError};
pub use user::{UserIds, resolve_user};
