//! Shared helpers for the VM tests: the real guest agent, a runtime on a fresh state folder, and a
//! tiny HTTP/1.1 + Connect client over agent streams.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use agentenv_runtime::{CreateSpec, Runtime, RuntimeConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A create of sandbox `id` from the default template.
pub fn spec(id: &str) -> CreateSpec {
    CreateSpec {
        sandbox_id: id.into(),
        template_id: "base".into(),
        ..Default::default()
    }
}

/// The real `agentenv-guest` binary: `AGENTENV_GUEST_BIN`, else built now with cargo (release).
pub fn guest_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("AGENTENV_GUEST_BIN") {
            return PathBuf::from(p);
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = std::process::Command::new(cargo)
            .args([
                "build",
                "--release",
                "-p",
                "agentenv-guest",
                "--message-format=json",
            ])
            .output()
            .expect("cargo runs");
        assert!(
            out.status.success(),
            "building agentenv-guest failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"]["name"] == "agentenv-guest")
            .find_map(|v| v["executable"].as_str().map(PathBuf::from))
            .expect("cargo reported the agentenv-guest executable")
    })
    .clone()
}

/// A state folder plus a guard that kills every QEMU still using it when the test ends (also on panic).
pub struct StateDir {
    pub dir: tempfile::TempDir,
}

impl StateDir {
    pub fn new() -> StateDir {
        StateDir {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Keep the guest consoles of a failed test for diagnosis.
            let keep = std::env::temp_dir().join(format!("agentenv-failed-{}", std::process::id()));
            for e in std::fs::read_dir(self.dir.path().join("sandboxes"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let dst = keep.join(e.file_name());
                let _ = std::fs::create_dir_all(&dst);
                for f in ["console.log", "qemu.log", "sandbox.json"] {
                    let _ = std::fs::copy(e.path().join(f), dst.join(f));
                }
            }
            eprintln!("guest logs kept in {}", keep.display());
        }
        for pid in qemu_pids_under(self.dir.path()) {
            // SAFETY: plain syscall on a QEMU started by this test.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// The folder of sandbox `id`'s VM files (its record's `vm_dir`, else its own folder).
pub fn vm_dir(state: &Path, id: &str) -> std::path::PathBuf {
    let dir = state.join("sandboxes").join(id);
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("sandbox.json")).unwrap()).unwrap();
    rec["vm_dir"].as_str().map_or(dir, Into::into)
}

/// Pids of QEMU processes whose command line names `dir`.
pub fn qemu_pids_under(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    let c = String::from_utf8_lossy(&c);
                    c.contains("qemu-system") && c.contains(&needle)
                })
                .unwrap_or(false)
        })
        .collect()
}

/// Every file and folder under `dir` is private to its owner (no group or other bits).
pub fn assert_private(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_path_buf()];
    let mut seen = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if meta.file_type().is_symlink() {
                continue;
            }
            let mode = meta.permissions().mode() & 0o777;
            assert_eq!(mode & 0o077, 0, "{} has mode {mode:o}", e.path().display());
            seen += 1;
            if meta.is_dir() {
                stack.push(e.path());
            }
        }
    }
    assert!(seen > 3, "only {seen} entries under {}", dir.display());
}

/// A runtime on `dir` with the default template installed (built once, then reused from the cache).
pub async fn runtime(dir: &Path) -> Runtime {
    runtime_with(dir, |_| {}).await
}

/// [`runtime`] with `adjust` applied to its configuration.
pub async fn runtime_with(dir: &Path, adjust: impl FnOnce(&mut RuntimeConfig)) -> Runtime {
    let mut cfg = RuntimeConfig::new(dir);
    cfg.guest_bin = Some(guest_bin());
    adjust(&mut cfg);
    // A runtime just dropped may still hold the chunk store for a moment (background ingests).
    let mut attempt = 0;
    let rt = loop {
        match Runtime::open(cfg.clone()).await {
            Ok(rt) => break rt,
            Err(e) if attempt < 300 && e.to_string().contains("lock") => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("runtime opens: {e}"),
        }
    };
    rt.ensure_default_template(&|p| eprintln!("template: {:?} {}", p.step, p.detail))
        .await
        .expect("default template");
    rt
}

/// One HTTP/1.1 request over a fresh agent stream: (status, body).
pub async fn http(
    rt: &Runtime,
    id: &str,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut s = rt.open_agent_stream(id).await.expect("agent stream");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: envd\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    s.flush().await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(
            String::from_utf8_lossy(&b[..eol])
                .split(';')
                .next()
                .unwrap()
                .trim(),
            16,
        )
        .unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
    out
}

/// Runs `cmd` with bash through envd `process.Process/Start` (Connect streaming, JSON): (stdout, exit code).
pub async fn run(rt: &Runtime, id: &str, cmd: &str) -> (String, i64) {
    let msg = serde_json::json!({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}}).to_string();
    let mut body = vec![0u8];
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(msg.as_bytes());
    let (status, resp) = http(
        rt,
        id,
        "POST",
        "/process.Process/Start",
        "application/connect+json",
        &body,
    )
    .await;
    assert_eq!(
        status,
        200,
        "Start answered {status}: {}",
        String::from_utf8_lossy(&resp)
    );
    let (mut stdout, mut code, mut ended) = (Vec::new(), 0i64, false);
    let mut rest = &resp[..];
    while rest.len() >= 5 {
        let flags = rest[0];
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let v: serde_json::Value = serde_json::from_slice(&rest[5..5 + len]).unwrap();
        rest = &rest[5 + len..];
        if flags & 2 != 0 {
            assert!(v.get("error").is_none(), "stream ended with {v}");
            continue;
        }
        let ev = &v["event"];
        if let Some(d) = ev["data"]["stdout"].as_str() {
            stdout.extend(base64_decode(d));
        }
        if ev.get("end").is_some() {
            ended = true;
            code = ev["end"]["exitCode"].as_i64().unwrap_or(0);
        }
    }
    assert!(ended, "no end event in {}", String::from_utf8_lossy(&resp));
    (String::from_utf8_lossy(&stdout).into_owned(), code)
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' | b'-' => 62,
        _ => 63,
    };
    let clean: Vec<u8> = s.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::new();
    for chunk in clean.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= (val(*c) as u32) << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

/// A fresh random token.
pub fn token() -> String {
    format!(
        "{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}
