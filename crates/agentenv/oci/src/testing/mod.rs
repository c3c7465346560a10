//! Test support (feature `testing`): a real registry and test images built in Rust.
//!
//! [`TestRegistry`] runs Debian's `docker-registry` (the CNCF distribution server, v2.8) on
//! `127.0.0.1:<free port>` with filesystem storage in a temporary folder, optionally behind htpasswd
//! basic auth, and kills it on drop. [`LayerBuilder`] writes layer tarballs (including hostile ones
//! with `..`, absolute names and escaping links), and [`TestImage`] turns layers and a run config into
//! an image that [`TestImage::push`] uploads through the distribution API.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::client::{Credentials, RegistryOptions, Scheme};
use crate::error::OciError;
use crate::manifest::{self, Compression, ConfigBlob, Descriptor, Platform, RootFs, RunConfig};
use crate::push::{LayerBlob, Pusher};
use crate::reference::{Digest, ImageRef};

mod token;
pub use token::TokenServer;

/// Where Debian installs the registry.
pub const DEFAULT_BINARY: &str = "/usr/bin/docker-registry";
/// How long a starting registry may take to answer `/v2/`.
pub const START_DEADLINE: Duration = Duration::from_secs(20);

/// Why a test registry did not start.
#[derive(Debug, thiserror::Error)]
pub enum TestRegistryError {
    /// No registry binary.
    #[error(
        "docker-registry not found at {0} (apt-get install docker-registry; ci/setup.sh installs it; or set AGENTENV_DOCKER_REGISTRY)"
    )]
    Missing(PathBuf),
    /// It exited or did not answer in time.
    #[error("docker-registry did not come up: {0}")]
    Start(String),
    /// Temp folder or config i/o.
    #[error("test registry i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// A running `docker-registry serve` on loopback; killed on drop.
pub struct TestRegistry {
    child: Child,
    dir: tempfile::TempDir,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    credentials: Option<Credentials>,
    token: Option<TokenServer>,
    /// DER of the server certificate when serving https.
    tls_cert: Option<Vec<u8>>,
}

/// How a test registry authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auth {
    None,
    Htpasswd,
    Token,
}

impl TestRegistry {
    /// The binary: `$AGENTENV_DOCKER_REGISTRY`, else [`DEFAULT_BINARY`].
    pub fn binary() -> PathBuf {
        std::env::var_os("AGENTENV_DOCKER_REGISTRY")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_BINARY))
    }

    /// Starts a registry without auth.
    pub fn start() -> Result<TestRegistry, TestRegistryError> {
        Self::start_inner(None, Auth::None, false)
    }

    /// Starts a registry serving https with a self-signed certificate for `127.0.0.1` (made with the
    /// `openssl` CLI); [`TestRegistry::options`] then trusts exactly that certificate.
    pub fn start_tls() -> Result<TestRegistry, TestRegistryError> {
        Self::start_inner(None, Auth::None, true)
    }

    /// Starts a registry in `auth: token` mode with a [`TokenServer`] on loopback: clients follow the
    /// `WWW-Authenticate: Bearer realm=...` challenge. With `credentials` the token endpoint wants
    /// them as basic auth; without, tokens are anonymous.
    pub fn start_with_token_auth(
        credentials: Option<(&str, &str)>,
    ) -> Result<TestRegistry, TestRegistryError> {
        let c = credentials.map(|(u, p)| Credentials {
            username: u.into(),
            password: p.into(),
        });
        Self::start_inner(c, Auth::Token, false)
    }

    /// Starts a registry that requires basic auth with these credentials (htpasswd, bcrypt).
    pub fn start_with_auth(
        username: &str,
        password: &str,
    ) -> Result<TestRegistry, TestRegistryError> {
        Self::start_inner(
            Some(Credentials {
                username: username.into(),
                password: password.into(),
            }),
            Auth::Htpasswd,
            false,
        )
    }

    /// For tests: a registry, or `None` after printing why it is skipped. Under
    /// `K3_REQUIRE_REGISTRY=1` a missing binary panics instead (CI sets it).
    pub fn start_or_skip(test: &str, auth: Option<(&str, &str)>) -> Option<TestRegistry> {
        if !Self::available(test) {
            return None;
        }
        let r = match auth {
            Some((u, p)) => Self::start_with_auth(u, p),
            None => Self::start(),
        };
        Some(r.unwrap_or_else(|e| panic!("{test}: {e}")))
    }

    /// Like [`TestRegistry::start_or_skip`] for [`TestRegistry::start_with_token_auth`] (also needs `openssl`).
    pub fn start_token_or_skip(
        test: &str,
        credentials: Option<(&str, &str)>,
    ) -> Option<TestRegistry> {
        if !Self::openssl_available(test) || !Self::available(test) {
            return None;
        }
        Some(Self::start_with_token_auth(credentials).unwrap_or_else(|e| panic!("{test}: {e}")))
    }

    /// Like [`TestRegistry::start_or_skip`] for [`TestRegistry::start_tls`] (also needs `openssl`).
    pub fn start_tls_or_skip(test: &str) -> Option<TestRegistry> {
        if !Self::openssl_available(test) || !Self::available(test) {
            return None;
        }
        Some(Self::start_tls().unwrap_or_else(|e| panic!("{test}: {e}")))
    }

    fn openssl_available(test: &str) -> bool {
        let has_openssl = Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_openssl {
            k3_common::require::skip_part(
                k3_common::require::Part::Registry,
                test,
                "the openssl CLI is missing (apt-get install openssl)",
            );
            return false;
        }
        true
    }

    fn available(test: &str) -> bool {
        let bin = Self::binary();
        if bin.is_file() {
            return true;
        }
        let why = TestRegistryError::Missing(bin);
        k3_common::require::skip_part(k3_common::require::Part::Registry, test, why);
        false
    }

    /// Tokens the token server issued (0 without token auth).
    pub fn tokens_issued(&self) -> usize {
        self.token.as_ref().map_or(0, |t| t.issued())
    }

    fn start_inner(
        credentials: Option<Credentials>,
        auth: Auth,
        tls: bool,
    ) -> Result<TestRegistry, TestRegistryError> {
        let bin = Self::binary();
        if !bin.is_file() {
            return Err(TestRegistryError::Missing(bin));
        }
        let mut dir = tempfile::Builder::new().prefix("k3-registry-").tempdir()?;
        let tls_cert = if tls {
            Some(token::make_tls_cert(dir.path())?)
        } else {
            None
        };
        let mut last = String::new();
        // The free port can be taken between probe and bind; try a few.
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let addr = format!("127.0.0.1:{port}");
            let config = dir.path().join("config.yml");
            let token = match auth {
                Auth::Token => Some(TokenServer::start(dir.path(), credentials.clone())?),
                _ => None,
            };
            let realm = token.as_ref().map(|t| t.realm.clone());
            std::fs::write(
                &config,
                config_yaml(dir.path(), &addr, auth, realm.as_deref(), tls),
            )?;
            if let (Some(c), Auth::Htpasswd) = (&credentials, auth) {
                let hash = bcrypt::hash(&c.password, 5)
                    .map_err(|e| TestRegistryError::Start(format!("bcrypt: {e}")))?;
                std::fs::write(
                    dir.path().join("htpasswd"),
                    format!("{}:{hash}\n", c.username),
                )?;
            }
            let log = std::fs::File::create(dir.path().join("registry.log"))?;
            let child = Command::new(&bin)
                .arg("serve")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?;
            let mut reg = TestRegistry {
                child,
                dir,
                addr,
                credentials: credentials.clone(),
                token,
                tls_cert: tls_cert.clone(),
            };
            match reg.wait_ready() {
                Ok(()) => return Ok(reg),
                Err(e) => {
                    last = e;
                    let _ = reg.child.kill();
                    let _ = reg.child.wait();
                    dir = std::mem::replace(&mut reg.dir, tempfile::tempdir()?);
                }
            }
        }
        Err(TestRegistryError::Start(last))
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let mut cfg = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_global(Some(Duration::from_secs(2)));
        let scheme = match &self.tls_cert {
            Some(der) => {
                let cert = ureq::tls::Certificate::from_der(der).to_owned();
                cfg = cfg.tls_config(
                    ureq::tls::TlsConfig::builder()
                        .root_certs(ureq::tls::RootCerts::new_with_certs(&[cert]))
                        .build(),
                );
                "https"
            }
            None => "http",
        };
        let agent: ureq::Agent = cfg.build().into();
        let url = format!("{scheme}://{}/v2/", self.addr);
        let start = Instant::now();
        while start.elapsed() < START_DEADLINE {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exited with {status}: {}", self.log_tail()));
            }
            if let Ok(r) = agent.get(&url).call()
                && matches!(r.status().as_u16(), 200 | 401)
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "no answer on {url} within {START_DEADLINE:?}: {}",
            self.log_tail()
        ))
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default();
        let start = s.len().saturating_sub(2000);
        s.get(start..).unwrap_or("").to_owned()
    }

    /// `127.0.0.1:<port>/<name>` parsed (`name` is `repo[:tag]`).
    pub fn image(&self, name: &str) -> ImageRef {
        ImageRef::parse(&format!("{}/{name}", self.addr))
            .unwrap_or_else(|e| panic!("test image name {name:?}: {e}"))
    }

    /// Options that reach this registry (with its credentials when it has auth).
    pub fn options(&self) -> RegistryOptions {
        RegistryOptions {
            credentials: self.credentials.clone(),
            scheme: if self.tls_cert.is_some() {
                Scheme::Https
            } else {
                Scheme::Auto
            },
            root_certificates: self.tls_cert.clone().map(|c| vec![c]),
            // The test registry listens on loopback, which pulls refuse unless allowed.
            allow: vec![crate::AllowedNet::parse("127.0.0.0/8").expect("a CIDR")],
            ..RegistryOptions::default()
        }
    }

    /// Where the registry stores a blob's bytes (tests corrupt it to check digest verification).
    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        let hex = d.hex();
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// The registry's temporary folder.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config_yaml(dir: &Path, addr: &str, auth: Auth, realm: Option<&str>, tls: bool) -> String {
    let mut y = format!(
        "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n  maintenance:\n    uploadpurging:\n      enabled: false\n  redirect:\n    disable: true\nhealth:\n  storagedriver:\n    enabled: false\nhttp:\n  addr: {addr}\n  secret: k3-test-registry\n",
        dir.join("data").display()
    );
    if tls {
        y.push_str(&format!(
            "  tls:\n    certificate: {}\n    key: {}\n",
            dir.join("tls-cert.pem").display(),
            dir.join("tls-key.pem").display()
        ));
    }
    match auth {
        Auth::None => {}
        Auth::Htpasswd => y.push_str(&format!(
            "auth:\n  htpasswd:\n    realm: k3-test\n    path: {}\n",
            dir.join("htpasswd").display()
        )),
        Auth::Token => y.push_str(&format!(
            "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
            realm.unwrap_or(""),
            token::SERVICE,
            token::ISSUER,
            dir.join("cert.pem").display()
        )),
    }
    y
}

/// Builds a layer tarball in memory.
pub struct LayerBuilder {
    b: tar::Builder<Vec<u8>>,
}

impl Default for LayerBuilder {
    fn default() -> Self {
        Self::new()
    }
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    h
}

impl LayerBuilder {
    /// An empty archive.
    pub fn new() -> LayerBuilder {
        LayerBuilder {
            b: tar::Builder::new(Vec::new()),
        }
    }

    fn add(mut self, mut h: tar::Header, path: &str, data: &[u8]) -> Self {
        self.b
            .append_data(&mut h, path, data)
            .unwrap_or_else(|e| panic!("tar entry {path}: {e}"));
        self
    }

    /// A directory.
    pub fn dir(self, path: &str, mode: u32) -> Self {
        self.add(header(tar::EntryType::Directory, mode, 0), path, &[])
    }

    /// A regular file owned by root.
    pub fn file(self, path: &str, contents: &[u8], mode: u32) -> Self {
        self.file_owned(path, contents, mode, 0, 0)
    }

    /// A regular file with an owner.
    pub fn file_owned(self, path: &str, contents: &[u8], mode: u32, uid: u64, gid: u64) -> Self {
        let mut h = header(tar::EntryType::Regular, mode, contents.len() as u64);
        h.set_uid(uid);
        h.set_gid(gid);
        self.add(h, path, contents)
    }

    /// A symlink `path -> target`.
    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        self.b
            .append_link(&mut h, path, target)
            .unwrap_or_else(|e| panic!("tar symlink {path}: {e}"));
        self
    }

    /// A hard link `path` to the earlier entry `target`.
    pub fn hardlink(mut self, path: &str, target: &str) -> Self {
        let mut h = header(tar::EntryType::Link, 0o644, 0);
        self.b
            .append_link(&mut h, path, target)
            .unwrap_or_else(|e| panic!("tar hard link {path}: {e}"));
        self
    }

    /// A whiteout deleting `path` from lower layers (`dir/.wh.name`).
    pub fn whiteout(self, path: &str) -> Self {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        let wh = if dir.is_empty() {
            format!(".wh.{name}")
        } else {
            format!("{dir}/.wh.{name}")
        };
        self.add(header(tar::EntryType::Regular, 0o600, 0), &wh, &[])
    }

    /// Makes `dir` opaque: lower layers' contents of it disappear (`dir/.wh..wh..opq`).
    pub fn opaque(self, dir: &str) -> Self {
        self.add(
            header(tar::EntryType::Regular, 0o600, 0),
            &format!("{dir}/.wh..wh..opq"),
            &[],
        )
    }

    /// A character device.
    pub fn char_device(self, path: &str, major: u32, minor: u32) -> Self {
        let mut h = header(tar::EntryType::Char, 0o666, 0);
        let _ = h.set_device_major(major);
        let _ = h.set_device_minor(minor);
        self.add(h, path, &[])
    }

    /// A FIFO.
    pub fn fifo(self, path: &str) -> Self {
        self.add(header(tar::EntryType::Fifo, 0o644, 0), path, &[])
    }

    /// An entry written byte for byte, bypassing the tar crate's path checks (names under 100
    /// bytes): for hostile archives with `..`, absolute names or escaping link targets.
    pub fn raw(
        mut self,
        kind: tar::EntryType,
        name: &[u8],
        link: Option<&[u8]>,
        data: &[u8],
    ) -> Self {
        let mut h = header(kind, 0o644, data.len() as u64);
        {
            let old = h.as_old_mut();
            old.name = [0; 100];
            old.name[..name.len()].copy_from_slice(name);
            if let Some(l) = link {
                old.linkname = [0; 100];
                old.linkname[..l.len()].copy_from_slice(l);
            }
        }
        h.set_cksum();
        self.b
            .append(&h, data)
            .unwrap_or_else(|e| panic!("raw tar entry: {e}"));
        self
    }

    /// The finished tar.
    pub fn tar(self) -> Vec<u8> {
        self.b
            .into_inner()
            .unwrap_or_else(|e| panic!("finishing tar: {e}"))
    }
}

/// A layer ready to push.
#[derive(Debug, Clone)]
pub struct TestLayer {
    /// The blob.
    pub blob: LayerBlob,
    /// sha256 of the uncompressed tar.
    pub diff_id: Digest,
}

impl TestLayer {
    /// Compresses `tar` as asked.
    pub fn new(tar: &[u8], compression: Compression) -> TestLayer {
        let diff_id = Digest::of(tar);
        let (media_type, bytes) = match compression {
            Compression::None => (manifest::OCI_LAYER_TAR, tar.to_vec()),
            Compression::Gzip => {
                let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                e.write_all(tar)
                    .and_then(|_| e.flush())
                    .unwrap_or_else(|e| panic!("gzip: {e}"));
                (
                    manifest::OCI_LAYER_GZIP,
                    e.finish().unwrap_or_else(|e| panic!("gzip: {e}")),
                )
            }
            Compression::Zstd => (
                manifest::OCI_LAYER_ZSTD,
                ruzstd::encoding::compress_to_vec(tar, ruzstd::encoding::CompressionLevel::Fastest),
            ),
        };
        TestLayer {
            blob: LayerBlob {
                media_type: media_type.into(),
                bytes,
            },
            diff_id,
        }
    }
}

/// An image: layers plus a config blob.
#[derive(Debug, Clone)]
pub struct TestImage {
    /// Layers, lowest first.
    pub layers: Vec<TestLayer>,
    /// The config (its `rootfs.diff_ids` are filled in by [`TestImage::config_json`]).
    pub config: ConfigBlob,
}

impl TestImage {
    /// A linux/amd64 image with this run config and no layers.
    pub fn new(run: RunConfig) -> TestImage {
        TestImage {
            layers: vec![],
            config: ConfigBlob {
                architecture: "amd64".into(),
                os: "linux".into(),
                config: Some(run),
                rootfs: RootFs::default(),
            },
        }
    }

    /// Adds a layer on top.
    pub fn layer(mut self, tar: &[u8], compression: Compression) -> TestImage {
        self.layers.push(TestLayer::new(tar, compression));
        self
    }

    /// Sets the config's platform.
    pub fn platform(mut self, p: &Platform) -> TestImage {
        self.config.os = p.os.clone();
        self.config.architecture = p.architecture.clone();
        self
    }

    /// The config blob with the layers' diff_ids.
    pub fn config_json(&self) -> Vec<u8> {
        let mut c = self.config.clone();
        c.rootfs.diff_ids = self.layers.iter().map(|l| l.diff_id.clone()).collect();
        serde_json::to_vec(&c).unwrap_or_else(|e| panic!("config json: {e}"))
    }

    /// Pushes layers, config and manifest; tags the manifest with `image`'s tag.
    pub fn push(&self, image: &ImageRef, opts: &RegistryOptions) -> Result<Descriptor, OciError> {
        let blobs: Vec<LayerBlob> = self.layers.iter().map(|l| l.blob.clone()).collect();
        Pusher::new(image, opts).push_image(image.reference(), &self.config_json(), &blobs)
    }

    /// Pushes as a Docker v2 schema 2 image: Docker media types for manifest, config and layers
    /// (gzip layers only, as Docker has no plain or zstd layer type).
    pub fn push_docker(
        &self,
        image: &ImageRef,
        opts: &RegistryOptions,
    ) -> Result<Descriptor, OciError> {
        let blobs: Vec<LayerBlob> = self
            .layers
            .iter()
            .map(|l| {
                assert_eq!(
                    l.blob.media_type,
                    manifest::OCI_LAYER_GZIP,
                    "Docker layers are gzip"
                );
                LayerBlob {
                    media_type: manifest::DOCKER_LAYER_GZIP.into(),
                    bytes: l.blob.bytes.clone(),
                }
            })
            .collect();
        Pusher::new(image, opts).push_docker_image(image.reference(), &self.config_json(), &blobs)
    }

    /// The standard sample: three layers (gzip, plain tar, zstd) covering files, directories with
    /// modes and owners, a symlink, a hard link, a FIFO, a whiteout and an opaque directory, and a
    /// config with Env, WorkingDir, User, Entrypoint and Cmd.
    pub fn sample() -> TestImage {
        let base = LayerBuilder::new()
            .dir("etc", 0o755)
            .file("etc/os-release", b"ID=k3test\n", 0o644)
            .dir("bin", 0o755)
            .file("bin/tool", b"#!/bin/sh\necho tool\n", 0o4755)
            .symlink("bin/tool-link", "tool")
            .hardlink("bin/tool-hard", "bin/tool")
            .dir("usr/share/doc", 0o755)
            .file("usr/share/doc/keep", b"keep", 0o644)
            .file("usr/share/doc/gone", b"gone", 0o644)
            .dir("var/cache/app", 0o750)
            .file("var/cache/app/old1", b"old1", 0o644)
            .dir("var/cache/app/sub", 0o755)
            .file("var/cache/app/sub/old2", b"old2", 0o644)
            .dir("home/app", 0o700)
            .file_owned("home/app/.profile", b"export A=1\n", 0o640, 1000, 1000)
            .fifo("run-fifo")
            .tar();
        let middle = LayerBuilder::new()
            .whiteout("usr/share/doc/gone")
            .opaque("var/cache/app")
            .file("var/cache/app/new", b"new", 0o600)
            .file("etc/os-release", b"ID=k3test\nVERSION=2\n", 0o644)
            .tar();
        let top = LayerBuilder::new()
            .dir("srv/work", 0o775)
            .file("srv/work/README", b"hello from the top layer\n", 0o644)
            .tar();
        TestImage::new(RunConfig {
            user: Some("1000:1000".into()),
            env: Some(vec![
                "PATH=/usr/local/bin:/usr/bin:/bin".into(),
                "GREETING=hi there".into(),
            ]),
            entrypoint: Some(vec!["/bin/tool".into()]),
            cmd: Some(vec!["--serve".into(), "8080".into()]),
            working_dir: Some("/srv/work".into()),
            ..RunConfig::default()
        })
        .layer(&base, Compression::Gzip)
        .layer(&middle, Compression::None)
        .layer(&top, Compression::Zstd)
    }
}

/// Reads a whole file (panics with the path on error; for tests).
pub fn read(path: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut v))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    v
}
