//! `pull`: resolve a reference to the linux/amd64 manifest, fetch and verify the config and layers,
//! and apply the layers in order. Layer downloads run one ahead of application on a second thread.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use sha2::{Digest as _, Sha256};

use crate::apply::{ApplyOptions, ApplyStats, apply_layer};
use crate::client::{Body, Client, MAX_DOCUMENT, RegistryOptions, header, read_document};
use crate::error::{OciError, io};
use crate::manifest::{
    Compression, ConfigBlob, Descriptor, Index, Kind, MANIFEST_ACCEPT, Manifest, Platform, kind_of,
};
use crate::reference::{Digest, ImageRef};

/// What to pull and the limits that guard it.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Connection, credentials and deadlines.
    pub registry: RegistryOptions,
    /// Platform picked from an index (default linux/amd64; a variant, when set, must match).
    pub platform: Platform,
    /// Refuse a layer whose blob is larger (checked on the manifest, before any download).
    pub max_layer_bytes: u64,
    /// Refuse an image whose layer blobs together are larger.
    pub max_total_bytes: u64,
    /// Refuse an image whose unpacked file content is larger (guards against decompression bombs).
    pub max_unpacked_bytes: u64,
    /// Refuse a layer with more archive entries (guards against inode bombs).
    pub max_layer_entries: u64,
    /// Keep verified blobs here (`sha256/<hex>`) and reuse them; `None`: a temporary folder next to the
    /// destination, removed afterwards.
    pub blob_dir: Option<PathBuf>,
}

impl Default for PullOptions {
    fn default() -> PullOptions {
        PullOptions {
            registry: RegistryOptions::default(),
            platform: Platform::linux_amd64(),
            max_layer_bytes: 4 << 30,
            max_total_bytes: 16 << 30,
            max_unpacked_bytes: 64 << 30,
            max_layer_entries: 4_000_000,
            blob_dir: None,
        }
    }
}

/// The image settings a sandbox honours, from the config blob.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// e.g. `linux`.
    pub os: String,
    /// e.g. `amd64`.
    pub architecture: String,
    /// `KEY=value` entries.
    pub env: Vec<String>,
    /// Working directory.
    pub working_dir: Option<String>,
    /// `user`, `uid`, `user:group` or `uid:gid`.
    pub user: Option<String>,
    /// Entrypoint argv.
    pub entrypoint: Vec<String>,
    /// Cmd argv.
    pub cmd: Vec<String>,
    /// `port/proto` entries.
    pub exposed_ports: Vec<String>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Stop signal.
    pub stop_signal: Option<String>,
}

impl ImageConfig {
    /// uid and gid of `user` in the pulled tree `rootfs` (root when unset).
    pub fn user_ids(&self, rootfs: &Path) -> Result<crate::UserIds, OciError> {
        crate::resolve_user(rootfs, self.user.as_deref().unwrap_or(""))
    }

    /// The default start command: Entrypoint followed by Cmd.
    pub fn command(&self) -> Vec<String> {
        self.entrypoint.iter().chain(&self.cmd).cloned().collect()
    }

    fn from_blob(b: ConfigBlob) -> ImageConfig {
        let c = b.config.unwrap_or_default();
        ImageConfig {
            os: b.os,
            architecture: b.architecture,
            env: c.env.unwrap_or_default(),
            working_dir: c.working_dir.filter(|w| !w.is_empty()),
            user: c.user.filter(|u| !u.is_empty()),
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            exposed_ports: c.exposed_ports.unwrap_or_default().into_keys().collect(),
            labels: c.labels.unwrap_or_default(),
            stop_signal: c.stop_signal,
        }
    }
}

/// One applied layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledLayer {
    /// Blob digest.
    pub digest: Digest,
    /// Media type.
    pub media_type: String,
    /// Blob size.
    pub size: u64,
    /// sha256 of the uncompressed tar (checked against the config's `rootfs.diff_ids`).
    pub diff_id: Digest,
    /// Archive entries.
    pub entries: u64,
    /// Whether the blob came from `blob_dir` instead of the registry.
    pub cached: bool,
}

/// The result of [`pull`].
#[derive(Debug, Clone)]
pub struct PulledImage {
    /// The reference pulled.
    pub image: ImageRef,
    /// Digest of the platform manifest that was applied.
    pub digest: Digest,
    /// Digest of the index it was picked from, when the reference named an index.
    pub index_digest: Option<Digest>,
    /// Digest of the config blob.
    pub config_digest: Digest,
    /// The image config.
    pub config: ImageConfig,
    /// Layers, lowest first.
    pub layers: Vec<PulledLayer>,
    /// Layer blob bytes (compressed, as transferred).
    pub bytes: u64,
    /// Bytes downloaded from the registry (layers not in `blob_dir`).
    pub downloaded_bytes: u64,
    /// Regular-file bytes written to the destination.
    pub unpacked_bytes: u64,
}

/// Progress of a pull, for progress bars: one bar per layer sized `size`, advanced by `LayerBytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullEvent {
    /// The manifest is known.
    Resolved {
        /// Platform manifest digest.
        digest: Digest,
        /// Layer sizes, lowest first.
        layer_sizes: Vec<u64>,
    },
    /// A layer download starts (`cached`: found in `blob_dir`, no download).
    LayerStart {
        /// Layer index.
        index: usize,
        /// Blob digest.
        digest: Digest,
        /// Blob size.
        size: u64,
        /// Served from `blob_dir`.
        cached: bool,
    },
    /// Bytes of a layer received so far.
    LayerBytes {
        /// Layer index.
        index: usize,
        /// Bytes done.
        done: u64,
        /// Blob size.
        total: u64,
    },
    /// A layer is downloaded and verified.
    LayerDownloaded {
        /// Layer index.
        index: usize,
    },
    /// A layer is being applied to the destination.
    Applying {
        /// Layer index.
        index: usize,
    },
    /// A layer is applied.
    Applied {
        /// Layer index.
        index: usize,
        /// Archive entries.
        entries: u64,
    },
}

/// What [`resolve`] found: the platform manifest and its config.
#[derive(Debug, Clone)]
pub struct ResolvedImage {
    /// Platform manifest digest.
    pub digest: Digest,
    /// Index digest, when the reference named an index.
    pub index_digest: Option<Digest>,
    /// The platform manifest.
    pub manifest: Manifest,
    /// Config blob digest.
    pub config_digest: Digest,
    /// The parsed config blob (with `rootfs.diff_ids`).
    pub config_blob: ConfigBlob,
}

/// Resolves `image` to its platform manifest and config, checking media types and size limits,
/// without downloading layers.
pub fn resolve(image: &ImageRef, opts: &PullOptions) -> Result<ResolvedImage, OciError> {
    let client = Client::new(image, &opts.registry, "pull");
    resolve_with(&client, image, opts)
}

/// Pulls `image` into `dest` (created if missing; must be empty) and returns its digest, config and
/// layers. `progress` is called on this thread. On error `dest` may hold part of the image: remove it.
pub fn pull(
    image: &ImageRef,
    dest: &Path,
    opts: &PullOptions,
    progress: &mut dyn FnMut(&PullEvent),
) -> Result<PulledImage, OciError> {
    std::fs::create_dir_all(dest).map_err(io("create", dest))?;
    let mut rd = std::fs::read_dir(dest).map_err(io("read dir", dest))?;
    if rd.next().is_some() {
        return Err(OciError::Io {
            what: "pull into",
            path: dest.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::DirectoryNotEmpty,
                "destination is not empty",
            ),
        });
    }
    let client = Client::new(image, &opts.registry, "pull");
    let r = resolve_with(&client, image, opts)?;
    let layers = &r.manifest.layers;
    progress(&PullEvent::Resolved {
        digest: r.digest.clone(),
        layer_sizes: layers.iter().map(|l| l.size).collect(),
    });

    let (blobs, _guard) = match &opts.blob_dir {
        Some(d) => (d.clone(), None),
        None => {
            let parent = dest.parent().unwrap_or(Path::new("."));
            let d = parent.join(format!(
                ".oci-blobs.{}.{}",
                std::process::id(),
                r.digest.hex().get(..12).unwrap_or("")
            ));
            (d.clone(), Some(RemoveOnDrop(d)))
        }
    };
    let sha_dir = blobs.join("sha256");
    std::fs::create_dir_all(&sha_dir).map_err(io("create", &sha_dir))?;

    let cancel = AtomicBool::new(false);
    let (tx, rx) = mpsc::channel::<Msg>();
    let mut out = Vec::with_capacity(layers.len());
    let mut downloaded = 0u64;
    let mut unpacked = 0u64;
    // Three parts: a downloader thread, an applier thread, and this thread, which alone calls
    // `progress`, so bars move while a layer is being applied.
    let result = std::thread::scope(|s| {
        let (client, cancel, sha_dir) = (&client, &cancel, &sha_dir);
        let dl_tx = tx.clone();
        s.spawn(move || {
            for (index, l) in layers.iter().enumerate() {
                if cancel.load(Ordering::Relaxed) {
                    return;
                }
                let r = fetch_layer(client, index, l, sha_dir, &dl_tx, cancel);
                let failed = r.is_err();
                let _ = dl_tx.send(Msg::Done(index, r));
                if failed {
                    return;
                }
            }
        });
        let (apply_tx, apply_rx) = mpsc::channel::<(usize, PathBuf)>();
        let diff_ids = &r.config_blob.rootfs.diff_ids;
        s.spawn(move || {
            let mut unpacked = 0u64;
            for (index, path) in apply_rx {
                if cancel.load(Ordering::Relaxed) {
                    return;
                }
                let _ = tx.send(Msg::Event(PullEvent::Applying { index }));
                let res = apply_one(
                    dest,
                    &layers[index],
                    &path,
                    &diff_ids[index],
                    opts,
                    unpacked,
                );
                if let Ok(st) = &res {
                    unpacked += st.file_bytes;
                }
                let failed = res.is_err();
                let _ = tx.send(Msg::Applied(index, res));
                if failed {
                    return;
                }
            }
        });
        let mut cached_of = vec![false; layers.len()];
        let run: Result<(), OciError> = (|| {
            while out.len() < layers.len() {
                let msg = rx.recv().map_err(|_| OciError::BadLayer {
                    layer: layers[out.len()].digest.to_string(),
                    reason: "pull threads ended early".into(),
                })?;
                match msg {
                    Msg::Event(e) => progress(&e),
                    Msg::Done(index, res) => {
                        let (path, cached) = res?;
                        cached_of[index] = cached;
                        if !cached {
                            downloaded += layers[index].size;
                        }
                        progress(&PullEvent::LayerDownloaded { index });
                        let _ = apply_tx.send((index, path));
                    }
                    Msg::Applied(index, res) => {
                        let stats = res?;
                        unpacked += stats.file_bytes;
                        progress(&PullEvent::Applied {
                            index,
                            entries: stats.entries,
                        });
                        let l = &layers[index];
                        out.push(PulledLayer {
                            digest: l.digest.clone(),
                            media_type: l.media_type.clone(),
                            size: l.size,
                            diff_id: diff_ids[index].clone(),
                            entries: stats.entries,
                            cached: cached_of[index],
                        });
                    }
                }
            }
            Ok(())
        })();
        if run.is_err() {
            cancel.store(true, Ordering::Relaxed);
        }
        drop(apply_tx);
        run
    });
    result?;
    Ok(PulledImage {
        image: image.clone(),
        digest: r.digest.clone(),
        index_digest: r.index_digest.clone(),
        config_digest: r.config_digest.clone(),
        config: ImageConfig::from_blob(r.config_blob.clone()),
        bytes: layers.iter().map(|l| l.size).sum(),
        layers: out,
        downloaded_bytes: downloaded,
        unpacked_bytes: unpacked,
    })
}

enum Msg {
    Event(PullEvent),
    Done(usize, Result<(PathBuf, bool), OciError>),
    Applied(usize, Result<ApplyStats, OciError>),
}

/// Applies one verified layer blob; `unpacked` is what earlier layers wrote.
fn apply_one(
    dest: &Path,
    l: &Descriptor,
    path: &Path,
    diff_id: &Digest,
    opts: &PullOptions,
    unpacked: u64,
) -> Result<ApplyStats, OciError> {
    let f = std::fs::File::open(path).map_err(io("open", path))?;
    let compression = Compression::of_media_type(&l.media_type).ok_or_else(|| unsupported(l))?;
    apply_layer(
        dest,
        f,
        &ApplyOptions {
            layer: l.digest.to_string(),
            compression,
            diff_id: Some(diff_id.clone()),
            max_file_bytes: opts.max_unpacked_bytes.saturating_sub(unpacked),
            max_entries: opts.max_layer_entries,
        },
    )
    .map_err(|e| match e {
        OciError::UnpackedTooLarge { digest, .. } => OciError::UnpackedTooLarge {
            digest,
            limit: opts.max_unpacked_bytes,
        },
        e => e,
    })
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if self.0.as_os_str().is_empty() {
            return;
        }
        if std::fs::remove_file(&self.0).is_err() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn unsupported(l: &Descriptor) -> OciError {
    OciError::UnsupportedLayer {
        digest: l.digest.clone(),
        media_type: l.media_type.clone(),
    }
}

fn resolve_with(
    client: &Client,
    image: &ImageRef,
    opts: &PullOptions,
) -> Result<ResolvedImage, OciError> {
    let (body, ct, digest) = get_manifest(client, image.reference(), image.digest.as_ref())?;
    let doc = parse_json(&body, "manifest", image.reference())?;
    let (manifest_body, digest, index_digest) = match kind_of(ct.as_deref(), &doc) {
        Some(Kind::Manifest) => (body, digest, None),
        Some(Kind::Index) => {
            let index: Index = serde_json::from_value(doc).map_err(|e| bad("index", &digest, e))?;
            let chosen =
                pick_platform(&index, &opts.platform).ok_or_else(|| OciError::PlatformMissing {
                    image: image.to_string(),
                    wanted: opts.platform.to_string(),
                    present: index
                        .manifests
                        .iter()
                        .map(|m| {
                            m.platform
                                .as_ref()
                                .map_or("(no platform)".into(), |p| p.to_string())
                        })
                        .collect(),
                })?;
            let (b, _, d) = get_manifest(client, chosen.digest.as_str(), Some(&chosen.digest))?;
            (b, d, Some(digest))
        }
        None => {
            return Err(OciError::BadDocument {
                what: "manifest",
                reference: image.reference().into(),
                reason: format!(
                    "unsupported media type {}",
                    ct.as_deref().unwrap_or("(none)")
                ),
            });
        }
    };
    let manifest: Manifest =
        serde_json::from_slice(&manifest_body).map_err(|e| bad("manifest", &digest, e))?;
    if manifest.config.size > MAX_DOCUMENT {
        return Err(OciError::TooLarge {
            what: "config",
            digest: manifest.config.digest.to_string(),
            size: manifest.config.size,
            limit: MAX_DOCUMENT,
        });
    }
    let mut total = 0u64;
    for l in &manifest.layers {
        Compression::of_media_type(&l.media_type).ok_or_else(|| unsupported(l))?;
        if l.size > opts.max_layer_bytes {
            return Err(OciError::TooLarge {
                what: "layer",
                digest: l.digest.to_string(),
                size: l.size,
                limit: opts.max_layer_bytes,
            });
        }
        total = total.saturating_add(l.size);
    }
    if total > opts.max_total_bytes {
        return Err(OciError::ImageTooLarge {
            image: image.to_string(),
            total,
            limit: opts.max_total_bytes,
        });
    }
    let cfg_bytes = get_small_blob(client, &manifest.config, "config")?;
    let config_blob: ConfigBlob = serde_json::from_slice(&cfg_bytes)
        .map_err(|e| bad("config", &manifest.config.digest, e))?;
    let p = &opts.platform;
    if config_blob.os != p.os || config_blob.architecture != p.architecture {
        return Err(OciError::PlatformMissing {
            image: image.to_string(),
            wanted: p.to_string(),
            present: vec![format!("{}/{}", config_blob.os, config_blob.architecture)],
        });
    }
    if config_blob.rootfs.diff_ids.len() != manifest.layers.len() {
        return Err(OciError::BadDocument {
            what: "config",
            reference: manifest.config.digest.to_string(),
            reason: format!(
                "{} diff_ids for {} layers",
                config_blob.rootfs.diff_ids.len(),
                manifest.layers.len()
            ),
        });
    }
    Ok(ResolvedImage {
        digest,
        index_digest,
        config_digest: manifest.config.digest.clone(),
        manifest,
        config_blob,
    })
}

fn bad(what: &'static str, d: &Digest, e: serde_json::Error) -> OciError {
    OciError::BadDocument {
        what,
        reference: d.to_string(),
        reason: e.to_string(),
    }
}

fn parse_json(
    body: &[u8],
    what: &'static str,
    reference: &str,
) -> Result<serde_json::Value, OciError> {
    serde_json::from_slice(body).map_err(|e| OciError::BadDocument {
        what,
        reference: reference.into(),
        reason: e.to_string(),
    })
}

/// Index entries that are image manifests for `want` (an unset variant matches any).
fn pick_platform<'a>(index: &'a Index, want: &Platform) -> Option<&'a Descriptor> {
    index.manifests.iter().find(|m| {
        m.platform.as_ref().is_some_and(|p| {
            p.os == want.os
                && p.architecture == want.architecture
                && (want.variant.is_none() || p.variant == want.variant)
        }) && kind_of(Some(&m.media_type), &serde_json::Value::Null).is_some()
    })
}

/// GETs a manifest; returns body, Content-Type and its digest (checked against `expect`).
fn get_manifest(
    client: &Client,
    reference: &str,
    expect: Option<&Digest>,
) -> Result<(Vec<u8>, Option<String>, Digest), OciError> {
    let url = client.url(&format!("manifests/{reference}"));
    let resp = client.send(
        "GET",
        &url,
        &[("accept", MANIFEST_ACCEPT)],
        Body::Empty,
        client.opts().timeout,
    )?;
    if resp.status() != 200 {
        return Err(client.status_error("GET", &url, "manifest", reference, resp));
    }
    let ct = header(&resp, "content-type");
    let served = header(&resp, "docker-content-digest");
    let body = read_document(resp, "GET", &url)?;
    let actual = Digest::of(&body);
    let expected = match (expect, served.as_deref().map(Digest::parse)) {
        (Some(d), _) => Some(d.clone()),
        (None, Some(Ok(d))) => Some(d),
        _ => None,
    };
    if let Some(expected) = expected
        && expected != actual
    {
        return Err(OciError::DigestMismatch {
            what: "manifest",
            expected,
            actual,
        });
    }
    Ok((body, ct, actual))
}

fn get_small_blob(
    client: &Client,
    d: &Descriptor,
    what: &'static str,
) -> Result<Vec<u8>, OciError> {
    let url = client.url(&format!("blobs/{}", d.digest));
    let resp = client.send("GET", &url, &[], Body::Empty, client.opts().timeout)?;
    if resp.status() != 200 {
        return Err(client.status_error("GET", &url, "blob", d.digest.as_str(), resp));
    }
    let body = read_document(resp, "GET", &url)?;
    check_blob(what, d, body.len() as u64, Digest::of(&body))?;
    Ok(body)
}

fn check_blob(
    what: &'static str,
    d: &Descriptor,
    len: u64,
    actual: Digest,
) -> Result<(), OciError> {
    if len != d.size {
        return Err(OciError::SizeMismatch {
            what,
            digest: d.digest.clone(),
            expected: d.size,
            actual: len,
            more: len > d.size,
        });
    }
    if actual != d.digest {
        return Err(OciError::DigestMismatch {
            what,
            expected: d.digest.clone(),
            actual,
        });
    }
    Ok(())
}

/// Downloads one layer blob into `sha_dir/<hex>` (verified, then renamed), or reuses it.
fn fetch_layer(
    client: &Client,
    index: usize,
    l: &Descriptor,
    sha_dir: &Path,
    tx: &mpsc::Sender<Msg>,
    cancel: &AtomicBool,
) -> Result<(PathBuf, bool), OciError> {
    let path = sha_dir.join(l.digest.hex());
    let ev = |e: PullEvent| {
        let _ = tx.send(Msg::Event(e));
    };
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == l.size) {
        ev(PullEvent::LayerStart {
            index,
            digest: l.digest.clone(),
            size: l.size,
            cached: true,
        });
        return Ok((path, true));
    }
    ev(PullEvent::LayerStart {
        index,
        digest: l.digest.clone(),
        size: l.size,
        cached: false,
    });
    let url = client.url(&format!("blobs/{}", l.digest));
    let deadline = client.opts().blob_deadline(l.size);
    let resp = client.send("GET", &url, &[], Body::Empty, deadline)?;
    if resp.status() != 200 {
        return Err(client.status_error("GET", &url, "blob", l.digest.as_str(), resp));
    }
    if let Some(n) = header(&resp, "content-length").and_then(|v| v.parse::<u64>().ok())
        && n != l.size
    {
        return Err(OciError::SizeMismatch {
            what: "layer",
            digest: l.digest.clone(),
            expected: l.size,
            actual: n,
            more: n > l.size,
        });
    }
    let tmp = sha_dir.join(format!(
        ".{}.{}.partial",
        l.digest.hex(),
        std::process::id()
    ));
    let mut f = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
    let mut guard = RemoveOnDrop(tmp.clone());
    let mut body = resp.into_body().into_reader();
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 256 << 10];
    let (mut done, mut reported) = (0u64, 0u64);
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(OciError::Transport {
                method: "GET",
                url,
                reason: "cancelled".into(),
            });
        }
        let n = body.read(&mut buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::TimedOut {
                OciError::Timeout {
                    method: "GET",
                    url: url.clone(),
                    after: deadline,
                }
            } else {
                OciError::Transport {
                    method: "GET",
                    url: url.clone(),
                    reason: e.to_string(),
                }
            }
        })?;
        if n == 0 {
            break;
        }
        done += n as u64;
        if done > l.size {
            // Never store more than the descriptor promised.
            return Err(OciError::SizeMismatch {
                what: "layer",
                digest: l.digest.clone(),
                expected: l.size,
                actual: done,
                more: true,
            });
        }
        hash.update(&buf[..n]);
        f.write_all(&buf[..n]).map_err(io("write", &tmp))?;
        if done - reported >= 1 << 20 || done == l.size {
            reported = done;
            ev(PullEvent::LayerBytes {
                index,
                done,
                total: l.size,
            });
        }
    }
    check_blob("layer", l, done, Digest::from_hasher(hash))?;
    f.sync_data().map_err(io("sync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(io("rename", &path))?;
    guard.0 = PathBuf::new();
    Ok((path, false))
}
