//! A real etcd on loopback for tests and benches (Debian's `etcd-server`), on free ports, data in a
//! folder of its own; stopped and removed on drop. [`Etcd::start_secure`] runs it over mutual TLS
//! with client-certificate users, its certificates from a throwaway [`Pki`] (the `openssl` command).
//! Tests skip with the reason when there is no `etcd`, and fail instead under `K3_REQUIRE_CLUSTER=1`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `etcd` binary: `$K3_ETCD`, else `etcd` on `PATH`.
pub fn find_etcd() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("K3_ETCD") {
        return Ok(PathBuf::from(p));
    }
    k3_common::fsutil::which("etcd")
        .ok_or_else(|| "no etcd binary ($K3_ETCD, PATH); ci/setup.sh installs etcd-server".into())
}

/// Whether a missing etcd fails the test instead of skipping it.
pub fn cluster_required() -> bool {
    k3_common::require::Part::Etcd.required()
}

/// A throwaway certificate authority in a folder: etcd's server certificate and client certificates,
/// made with the `openssl` command (ECDSA P-256, one day).
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// A new CA in `dir` (`ca.pem`, `ca.key`).
    pub fn new(dir: &Path) -> Result<Pki, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let pki = Pki {
            dir: dir.to_owned(),
        };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "1",
            "-subj",
            "/CN=k3-test-ca",
        ])?;
        Ok(pki)
    }

    fn openssl(&self, args: &[&str]) -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .map_err(|e| format!("openssl: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "openssl {}: {}",
                args[0],
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }

    /// A certificate with common name `cn` for server and client use on 127.0.0.1 and as DNS name
    /// `cn` (a node's id, see [`crate::node_tls`]), and the CA.
    pub fn issue(&self, cn: &str) -> Result<crate::EtcdTls, String> {
        let ext = self.dir.join(format!("{cn}.ext"));
        std::fs::write(
            &ext,
            format!(
                "subjectAltName=IP:127.0.0.1,DNS:{cn}\nextendedKeyUsage=serverAuth,clientAuth\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let (key, csr, pem) = (
            format!("{cn}.key"),
            format!("{cn}.csr"),
            format!("{cn}.pem"),
        );
        let subj = format!("/CN={cn}");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &subj,
        ])?;
        let ext = ext.display().to_string();
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "1",
            "-extfile",
            &ext,
        ])?;
        Ok(crate::EtcdTls {
            ca: self.dir.join("ca.pem"),
            cert: self.dir.join(pem),
            key: self.dir.join(key),
        })
    }
}

/// One etcd process.
pub struct Etcd {
    child: Option<Child>,
    binary: PathBuf,
    dir: PathBuf,
    peer_port: u16,
    /// Plain-HTTP `/health` (and `/metrics`) port.
    metrics_port: u16,
    /// With [`Etcd::start_secure`]: its CA and its own certificate.
    secure: Option<(Pki, crate::EtcdTls)>,
    /// `http://127.0.0.1:<port>` (`https://` when secure).
    pub endpoint: String,
}

/// An etcd for `test`, or `None` after printing why it is skipped (panics under `K3_REQUIRE_CLUSTER=1`).
pub fn etcd_or_skip(test: &str, parent: &Path) -> Option<Etcd> {
    skip_unless(test, Etcd::start(parent))
}

/// [`etcd_or_skip`] of [`Etcd::start_secure`].
pub fn secure_etcd_or_skip(test: &str, parent: &Path) -> Option<Etcd> {
    skip_unless(test, Etcd::start_secure(parent))
}

fn skip_unless(test: &str, etcd: Result<Etcd, String>) -> Option<Etcd> {
    match etcd {
        Ok(e) => Some(e),
        Err(e) => {
            k3_common::require::skip_part(k3_common::require::Part::Etcd, test, e);
            None
        }
    }
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

impl Etcd {
    /// Starts etcd with its data in a new folder under `parent` and waits (at most 30 s) until it answers.
    pub fn start(parent: &Path) -> Result<Etcd, String> {
        Self::start_as(parent, false)
    }

    /// [`Etcd::start`] over mutual TLS: clients need a certificate of its [`Etcd::pki`], whose common
    /// name is their user once auth is on ([`crate::auth::provision`] as `root`).
    pub fn start_secure(parent: &Path) -> Result<Etcd, String> {
        Self::start_as(parent, true)
    }

    fn start_as(parent: &Path, secure: bool) -> Result<Etcd, String> {
        let binary = find_etcd()?;
        let (client_port, peer_port, metrics_port) = (free_port()?, free_port()?, free_port()?);
        let dir = parent.join(format!("etcd-{}-{client_port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let secure = match secure {
            true => {
                let pki = Pki::new(&dir.join("pki"))?;
                let own = pki.issue("etcd")?;
                Some((pki, own))
            }
            false => None,
        };
        let scheme = if secure.is_some() { "https" } else { "http" };
        let mut e = Etcd {
            child: None,
            binary,
            dir,
            peer_port,
            metrics_port,
            secure,
            endpoint: format!("{scheme}://127.0.0.1:{client_port}"),
        };
        e.resume()?;
        Ok(e)
    }

    /// The CA of a secure etcd, to issue client certificates with.
    pub fn pki(&self) -> Option<&Pki> {
        self.secure.as_ref().map(|(p, _)| p)
    }

    /// Stops the process (SIGKILL), keeping its data: [`Etcd::resume`] brings it back.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the process again on the same ports and data, and waits until it answers.
    pub fn resume(&mut self) -> Result<(), String> {
        self.stop();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .map_err(|e| e.to_string())?;
        let client = self.endpoint.clone();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(&self.binary);
        cmd.arg(format!("--data-dir={}", self.dir.join("data").display()))
            .arg("--name=k3")
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=k3={peer}"))
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{}",
                self.metrics_port
            ));
        if let Some((_, own)) = &self.secure {
            cmd.arg(format!("--cert-file={}", own.cert.display()))
                .arg(format!("--key-file={}", own.key.display()))
                .arg(format!("--trusted-ca-file={}", own.ca.display()))
                .arg("--client-cert-auth");
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(30))
    }

    fn wait_ready(&mut self, deadline: Duration) -> Result<(), String> {
        use std::io::{Read, Write};
        let t0 = Instant::now();
        while t0.elapsed() < deadline {
            if let Some(Ok(Some(st))) = self.child.as_mut().map(Child::try_wait) {
                return Err(format!(
                    "etcd exited early: {st} (log: {})",
                    self.dir.join("etcd.log").display()
                ));
            }
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.metrics_port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
                let mut body = String::new();
                if s.read_to_string(&mut body).is_ok() && body.contains("\"health\":\"true\"") {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!("etcd did not become healthy within {deadline:?}"))
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A small idle node's record (4 CPUs, 8 GiB, the `base` template, no bucket) for tests.
pub fn idle_node(id: &str, url: &str) -> crate::NodeRecord {
    crate::NodeRecord {
        version: crate::SCHEMA_VERSION,
        id: id.into(),
        url: url.into(),
        cpus: 4,
        vcpus_used: 0,
        memory_mb: 8192,
        free_memory_mb: 8192,
        running: 0,
        paused: 0,
        max_running: None,
        templates: vec!["base".into()],
        snapshots: vec![],
        shared_store: false,
        updated_at_ms: 0,
        sizes: Default::default(),
    }
}

/// Registers a node that always reports `rec` (a 30 s lease, refreshed every 10 s), as the node's
/// own path does: a lease, then its record.
pub async fn register(
    store: &crate::ClusterStore,
    rec: crate::NodeRecord,
) -> Result<crate::Registration, crate::ClusterError> {
    crate::Registration::start(
        store.clone(),
        Duration::from_secs(30),
        Duration::from_secs(10),
        std::sync::Arc::new(move || rec.clone()),
    )
    .await
}

/// Polls `f` every 100 ms until it is true; panics naming `what` after 30 s.
pub async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..300 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within 30 s");
}

/// Puts `value` at `key` under the store's prefix as is (what a hostile member could write).
pub async fn put_raw(
    store: &crate::ClusterStore,
    key: &str,
    value: &[u8],
) -> Result<(), crate::ClusterError> {
    let mut kv = store.client().kv_client();
    let key = format!("{}{key}", store.keys().prefix());
    store
        .call("put", kv.put(key, value.to_vec(), None))
        .await
        .map(drop)
}
