//! Test harness: a real agentenv server (real runtime, real TCG/KVM guests) on a loopback port.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agentenv_server::app::{self, AppState, ServerConfig};
use agentenv_server::{keys, runtime_backend};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Builds `agentenv-guest` into this target folder unless `AGENTENV_GUEST_BIN` names one.
pub fn ensure_guest_binary() {
    if std::env::var_os("AGENTENV_GUEST_BIN").is_some() {
        return;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args(["build", "-p", "agentenv-guest", "--bin", "agentenv-guest"])
        .status()
        .expect("running cargo build -p agentenv-guest");
    assert!(status.success(), "building agentenv-guest failed");
}

/// A running server and its handles.
pub struct TestServer {
    pub addr: SocketAddr,
    pub api_key: String,
    pub state: AppState,
    task: tokio::task::JoinHandle<()>,
    pub accel: String,
    runtime: agentenv_runtime::Runtime,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.runtime.close_now();
    }
}

impl TestServer {
    /// Starts the server on `state_dir` (building the default template on first use).
    pub async fn start(state_dir: &Path) -> TestServer {
        Self::start_with(state_dir, true).await
    }

    /// Starts the server; `with_template: false` skips the default template (no VM boots; for
    /// tests of auth and input checks).
    pub async fn start_with(state_dir: &Path, with_template: bool) -> TestServer {
        Self::start_with_store(state_dir, with_template, None).await
    }

    /// [`Self::start_with`] on the chunk store `store` (`None`: the runtime's local default).
    pub async fn start_with_store(
        state_dir: &Path,
        with_template: bool,
        store: Option<agentenv_store::StoreConfig>,
    ) -> TestServer {
        Self::start_configured(state_dir, with_template, |cfg| cfg.store = store).await
    }

    /// [`Self::start_with`] after `configure` had its say on the runtime's configuration.
    pub async fn start_configured(
        state_dir: &Path,
        with_template: bool,
        configure: impl FnOnce(&mut agentenv_runtime::RuntimeConfig),
    ) -> TestServer {
        let (api_key, _) = keys::load_or_create_api_key(state_dir).unwrap();
        let mut cfg = agentenv_runtime::RuntimeConfig::new(state_dir.join("runtime"));
        configure(&mut cfg);
        cfg.accel = match std::env::var("AGENTENV_ACCEL").as_deref() {
            Ok("tcg") => agentenv_runtime::Accel::Tcg,
            Ok("kvm") => agentenv_runtime::Accel::Kvm,
            _ if !with_template => agentenv_runtime::Accel::Tcg,
            _ => agentenv_runtime::Accel::Auto,
        };
        let rt = if with_template {
            runtime_backend::open_with_default_template(cfg)
                .await
                .expect("runtime with default template")
        } else {
            agentenv_runtime::Runtime::open(cfg).await.expect("runtime")
        };
        let accel = runtime_backend::accel_label(&rt).to_string();
        let runtime = rt.clone();
        let backend: Arc<dyn agentenv_server::backend::VmBackend> =
            Arc::new(agentenv_server::runtime_backend::RuntimeBackend(rt));
        let state = AppState::open(
            backend,
            ServerConfig {
                state_dir: state_dir.to_path_buf(),
                api_key: api_key.clone(),
                max_upload_bytes: 1 << 20,
                lifecycle: Default::default(),
                rate_limit: None,
            },
        )
        .await
        .expect("server state");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = app::app(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        TestServer {
            addr,
            api_key,
            state,
            task,
            accel,
            runtime,
        }
    }

    /// Stops as a graceful shutdown does: serving ends and the runtime closes (its warm VMs and kept
    /// paused QEMUs exit; sandboxes keep running).
    pub async fn close(self) {
        self.task.abort();
        self.runtime.close().await;
    }

    /// Stops serving (sandbox VMs keep running, as after a process exit; the warm VMs and kept paused
    /// QEMUs a dead process would leave for the next start's recovery are killed at once, since a test
    /// may never start another).
    pub fn stop(self) {
        self.task.abort();
        self.runtime.close_now();
    }

    pub fn client(&self) -> Api {
        Api {
            base: format!("http://{}", self.addr),
            key: self.api_key.clone(),
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }
}

/// A fresh state folder under /tmp (kept small: RAM files live in the runtime's folder).
pub fn state_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("agentenv-test-")
        .tempdir()
        .unwrap()
}

/// Minimal HTTP client for the tests.
#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub key: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// A response: status, headers and body.
pub struct Resp {
    pub status: StatusCode,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

impl Api {
    /// A client of the server at `base` (e.g. `http://127.0.0.1:3000`) with API key `key`.
    pub fn new(base: String, key: String) -> Api {
        Api {
            base,
            key,
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// Like [`Self::call`], but a failed connection (a server that died mid-request) is an `Err`.
    pub async fn try_call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Resp, String> {
        let bytes = body
            .map(|v| serde_json::to_vec(&v).unwrap())
            .unwrap_or_default();
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("X-API-KEY", &self.key)
            .header("Content-Type", "application/json")
            .body(Full::new(Bytes::from(bytes)))
            .unwrap();
        let resp = self.http.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(Resp {
            status,
            headers,
            body,
        })
    }

    /// Sends only the head of a request that declares a `declared_len`-byte body and reads the answer.
    /// The server refuses oversized bodies from `Content-Length` alone; sending the body too would race
    /// its early close (the client sees EPIPE instead of the answer).
    pub async fn head_only(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        declared_len: usize,
    ) -> Resp {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.base.trim_start_matches("http://");
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {declared_len}\r\n"
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("Connection: close\r\n\r\n");
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            tcp.read_to_end(&mut raw),
        );
        let _ = read.await.expect("the server answers without the body");
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a complete response head");
        let head = String::from_utf8_lossy(&raw[..split]);
        let code: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("a status line");
        Resp {
            status: StatusCode::from_u16(code).unwrap(),
            headers: hyper::HeaderMap::new(),
            body: Bytes::copy_from_slice(&raw[split + 4..]),
        }
    }

    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Resp {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .http
            .request(b.body(Full::new(Bytes::from(body))).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Resp {
            status,
            headers,
            body,
        }
    }

    /// Control-plane call with the API key.
    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Resp {
        let bytes = body
            .map(|v| serde_json::to_vec(&v).unwrap())
            .unwrap_or_default();
        let key = self.key.clone();
        self.raw(
            method,
            path,
            &[("X-API-KEY", &key), ("Content-Type", "application/json")],
            bytes,
        )
        .await
    }

    /// Runs `bash -l -c cmd` in the sandbox through the data plane (Connect `Start` stream);
    /// returns (stdout, exit code).
    pub async fn run(&self, id: &str, token: &str, cmd: &str) -> Result<(String, i64), String> {
        let msg = serde_json::json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": false});
        let json = serde_json::to_vec(&msg).unwrap();
        let mut body = vec![0u8];
        body.extend_from_slice(&(json.len() as u32).to_be_bytes());
        body.extend_from_slice(&json);
        let headers = [
            ("E2b-Sandbox-Id", id),
            ("E2b-Sandbox-Port", "49983"),
            ("X-Access-Token", token),
            ("Content-Type", "application/connect+json"),
            ("Connect-Protocol-Version", "1"),
        ];
        let r = self
            .raw(Method::POST, "/process.Process/Start", &headers, body)
            .await;
        if r.status != StatusCode::OK {
            return Err(format!(
                "{}: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            ));
        }
        let mut out = Vec::new();
        let mut code = None;
        let mut rest = &r.body[..];
        while rest.len() >= 5 {
            let flag = rest[0];
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let v: Value = serde_json::from_slice(&rest[5..5 + len]).unwrap();
            rest = &rest[5 + len..];
            if flag & 2 != 0 {
                if v.get("error").is_some() {
                    return Err(v.to_string());
                }
                break;
            }
            let ev = &v["event"];
            if let Some(s) = ev["data"]["stdout"].as_str() {
                out.extend(b64_decode(s));
            }
            if let Some(end) = ev.get("end") {
                code = Some(end["exitCode"].as_i64().unwrap_or(0));
            }
        }
        Ok((String::from_utf8(out).unwrap(), code.ok_or("no end event")?))
    }
}

/// Standard base64 decoding (padded), enough for envd output.
pub fn b64_decode(s: &str) -> Vec<u8> {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes().filter(|c| *c != b'=') {
        let v = A.iter().position(|x| *x == c).expect("base64 character") as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

pub fn path_of(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().to_path_buf()
}

/// [`qemu_pids_under`] without idle warm VMs: QEMUs in a `vms/` folder no sandbox record names.
pub fn sandbox_qemu_pids_under(dir: &Path) -> Vec<u32> {
    let held: Vec<String> = walk_records(dir)
        .into_iter()
        .filter_map(|rec| rec["vm_dir"].as_str().map(|d| format!("{d}/")))
        .collect();
    qemu_pids_under(dir)
        .into_iter()
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            !cmd.contains("/vms/w") || held.iter().any(|d| cmd.contains(d.as_str()))
        })
        .collect()
}

/// Every `sandboxes/*/sandbox.json` under `dir`, parsed.
fn walk_records(dir: &Path) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == "sandbox.json")
                && let Ok(v) = serde_json::from_slice(&std::fs::read(&p).unwrap_or_default())
            {
                out.push(v);
            }
        }
    }
    out
}

/// Live (not zombie) QEMU processes whose command line names `dir`.
pub fn qemu_pids_under(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = stat
                .rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            !zombie && cmd.contains("qemu-system") && cmd.contains(&needle)
        })
        .collect()
}
