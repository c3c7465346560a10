//! envd's HTTP routes: the dispatch of every request, the access-token check, and the plain endpoints
//! (`/health`, `/init`, `/envs`, `/metrics`).

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::Agent;
use crate::envd::{Code, RpcError};
use crate::users::{self};

use crate::http::*;

/// Routes one request.
pub async fn handle(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if path == "/health" {
        return Response::builder()
            .status(StatusCode::NO_CONTENT)
            .body(full(Bytes::new()))
            .unwrap_or_else(|_| Response::new(full(Bytes::new())));
    }
    if let Some(token) = agent.settings().access_token {
        let given = req
            .headers()
            .get("x-access-token")
            .and_then(|v| v.to_str().ok());
        let signed = path == "/files" && query_params(req.uri()).contains_key("signature");
        if signed {
            if let Err(why) = check_signature(&req, &token) {
                return http_error(StatusCode::UNAUTHORIZED, why);
            }
        } else if given != Some(token.as_str()) {
            return if path.starts_with("/process.") || path.starts_with("/filesystem.") {
                rpc_error(&RpcError::new(
                    Code::Unauthenticated,
                    "missing or wrong X-Access-Token",
                ))
            } else {
                http_error(StatusCode::UNAUTHORIZED, "missing or wrong X-Access-Token")
            };
        }
    }
    if method == Method::CONNECT {
        return crate::tunnel::connect(req).await;
    }
    match (method, path.as_str()) {
        (Method::GET, "/files") => crate::files::download(&agent, req).await,
        (Method::POST, "/files") => crate::files::upload(&agent, req).await,
        (Method::POST, "/init") => init(&agent, req).await,
        (Method::POST, agentenv_envd::paths::EXEC) => crate::exec::exec(&agent, req).await,
        (Method::POST, agentenv_envd::paths::VOLUME) => volume_attach(req).await,
        (Method::POST, "/sync") => {
            // SAFETY: sync(2) takes no arguments.
            tokio::task::spawn_blocking(|| unsafe { libc::sync() })
                .await
                .ok();
            json_response(StatusCode::OK, &json!({}))
        }
        (Method::GET, "/envs") => json_response(StatusCode::OK, &json!(agent.settings().env_vars)),
        (Method::GET, "/metrics") => json_response(StatusCode::OK, &metrics().await),
        (Method::POST, p)
            if p.starts_with("/process.Process/") || p.starts_with("/filesystem.Filesystem/") =>
        {
            crate::rpc::dispatch(agent, req).await
        }
        (_, p) => http_error(StatusCode::NOT_FOUND, format!("no route for {p}")),
    }
}

/// `POST /volume` (host only): mounts a volume at the `x-agentenv-mount` path if needed, answers
/// `101`, and makes the upgraded stream the mount's channel ([`crate::volume`]). A bad path (400)
/// or a failed mount (500) is answered before any upgrade.
async fn volume_attach(req: Request<Incoming>) -> Response<Body> {
    use agentenv_envd::volume::{MOUNT_HEADER, UPGRADE};
    let header = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
    if !header(http::header::UPGRADE.as_str()).is_some_and(|u| u.eq_ignore_ascii_case(UPGRADE)) {
        return http_error(
            StatusCode::BAD_REQUEST,
            format!(
                "POST {} takes Upgrade: {UPGRADE}",
                agentenv_envd::paths::VOLUME
            ),
        );
    }
    let Some(path) = header(MOUNT_HEADER).map(std::path::PathBuf::from) else {
        return http_error(StatusCode::BAD_REQUEST, format!("no {MOUNT_HEADER} header"));
    };
    let mount = match crate::volume::prepare(&path).await {
        Ok(m) => m,
        Err(e) if e.is_bad_path() => return http_error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e) => {
            tracing::warn!(error = %e, "volume mount failed");
            return http_error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
    };
    tokio::spawn(async move {
        match hyper::upgrade::on(req).await {
            Ok(up) => mount.install(hyper_util::rt::TokioIo::new(up)),
            Err(e) => tracing::warn!(mount = %path.display(), error = %e, "volume upgrade failed"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, UPGRADE)
        .body(full(Bytes::new()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

/// Verifies a signed `/files` URL ([`agentenv_envd::signing`]).
fn check_signature(req: &Request<Incoming>, token: &str) -> Result<(), String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let q: std::collections::HashMap<String, String> =
        query_params(req.uri()).into_iter().collect();
    agentenv_envd::signing::check(&q, req.method() != Method::GET, token, now)
        .map_err(str::to_string)
}

use agentenv_envd::InitRequest;

async fn init(agent: &Agent, req: Request<Incoming>) -> Response<Body> {
    let body = match read_body(req.into_body(), MAX_JSON_BODY).await {
        Ok(b) => b,
        Err(e) => return http_error(StatusCode::PAYLOAD_TOO_LARGE, e.message),
    };
    let r: InitRequest = match crate::envd::parse(&body) {
        Ok(r) => r,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, e.message),
    };
    if let Some(u) = &r.default_user
        && users::lookup(u).is_none()
    {
        return http_error(
            StatusCode::BAD_REQUEST,
            format!("user '{u}' does not exist"),
        );
    }
    if let Some(n) = &r.network
        && let Err(why) = crate::net::validate(n)
    {
        return http_error(StatusCode::BAD_REQUEST, format!("network: {why}"));
    }
    if agent.config.set_clock
        && let Some(n) = r.network.clone()
    {
        // Applied in the background: it costs tens of ms under TCG (cold code paths after a
        // restore), and only process starts need it (they wait for it).
        agent.net_ready.send_replace(false);
        let ready = agent.net_ready.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = crate::net::configure(&n) {
                tracing::warn!(error = %e, nic = agentenv_envd::GUEST_NIC, "configuring the NIC failed");
            }
            ready.send_replace(true);
        });
    }
    if agent.config.set_clock
        && let Some(secs) = r.timestamp.as_ref().and_then(timestamp_secs)
    {
        set_clock(secs);
    }
    if let Some(e) = &r.entropy {
        match agentenv_envd::unhex(e) {
            Some(bytes) if bytes.len() <= 512 => add_entropy(&bytes),
            _ => {
                return http_error(
                    StatusCode::BAD_REQUEST,
                    "entropy must be at most 512 hex-encoded bytes",
                );
            }
        }
    }
    let start = r.start.clone();
    agent.update_settings(|s| {
        if let Some(env) = r.env_vars {
            s.env_vars.extend(env);
        }
        if let Some(t) = r.access_token.filter(|t| !t.is_empty()) {
            s.access_token = Some(t);
        }
        if let Some(u) = r.default_user {
            s.default_user = u;
        }
        if let Some(w) = r.default_workdir.filter(|w| !w.is_empty()) {
            s.default_workdir = Some(w.into());
        }
    });
    if agent.config.set_clock {
        write_envs(&agent.settings().env_vars);
    }
    if let Some(argv) = start.filter(|a| !a.is_empty()) {
        agent.network_settled().await;
        let settings = agent.settings();
        let Some(user) = users::lookup(&settings.default_user) else {
            return http_error(
                StatusCode::BAD_REQUEST,
                format!("user '{}' does not exist", settings.default_user),
            );
        };
        let spec = crate::process::SpawnSpec {
            config: crate::envd::ProcessConfig {
                cmd: argv[0].clone(),
                args: argv[1..].to_vec(),
                envs: Default::default(),
                cwd: None,
            },
            tag: Some(agentenv_envd::START_TAG.into()),
            pty: None,
            stdin: false,
            user,
            base_env: settings.env_vars,
            default_cwd: settings.default_workdir,
            timeout: None,
        };
        match agent.procs.spawn(spec) {
            Ok((proc, rx)) => {
                tracing::info!(pid = proc.pid, cmd = %argv.join(" "), "template start command running");
                drop(rx);
            }
            Err(e) => {
                return http_error(
                    StatusCode::BAD_REQUEST,
                    format!("start command {:?}: {}", argv, e.message),
                );
            }
        }
    }
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(full(Bytes::new()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

/// The sandbox's environment variables for servers started before the create (the code
/// interpreter's kernels read them): root's alone, replaced whole.
const ENVS_FILE: &str = "/run/agentenv/envs.json";

fn write_envs(envs: &std::collections::HashMap<String, String>) {
    let bytes = serde_json::to_vec(envs).unwrap_or_default();
    if let Err(e) = k3_common::fsutil::write_atomic(std::path::Path::new(ENVS_FILE), &bytes) {
        tracing::warn!(error = %e, path = ENVS_FILE, "writing the environment failed");
    }
}

/// Unix seconds from a number or an RFC 3339 string (`2026-01-02T03:04:05.123Z`, millisecond precision).
fn timestamp_secs(v: &Value) -> Option<f64> {
    if let Some(n) = v.as_f64() {
        return Some(n);
    }
    k3_common::time::parse_rfc3339_ms(v.as_str()?.trim()).map(|ms| ms as f64 / 1000.0)
}

/// Credits `bytes` to the kernel's pool (RNDADDENTROPY) and reseeds the CRNG (RNDRESEEDCRNG), so guests
/// restored from one snapshot draw distinct streams. Needs CAP_SYS_ADMIN; a failure is logged.
fn add_entropy(bytes: &[u8]) {
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    let Ok(f) = std::fs::OpenOptions::new().write(true).open("/dev/urandom") else {
        tracing::warn!("cannot open /dev/urandom");
        return;
    };
    use std::os::fd::AsRawFd;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // SAFETY: the ioctls read a rand_pool_info of the size it declares, from a live buffer.
    let ok = unsafe {
        libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) == 0
            && libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) == 0
    };
    if !ok {
        tracing::warn!(error = %std::io::Error::last_os_error(), "reseeding the kernel RNG failed");
    }
}

fn set_clock(secs: f64) {
    let ts = libc::timespec {
        tv_sec: secs.trunc() as libc::time_t,
        tv_nsec: (secs.fract() * 1e9) as libc::c_long,
    };
    // SAFETY: clock_settime reads a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "setting the clock failed");
    }
}

/// envd-style metrics: cpu, memory and root-disk usage.
async fn metrics() -> Value {
    let cpu1 = cpu_times();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let cpu2 = cpu_times();
    let pct = match (cpu1, cpu2) {
        (Some((b1, i1)), Some((b2, i2))) if b2 > b1 => {
            100.0 * (1.0 - (i2.saturating_sub(i1)) as f64 / (b2 - b1) as f64)
        }
        _ => 0.0,
    };
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| -> u64 {
        mem.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let (total, avail) = (kib("MemTotal:") * 1024, kib("MemAvailable:") * 1024);
    let (disk_total, disk_used) = disk_usage("/");
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let m = agentenv_envd::GuestMetrics {
        ts,
        cpu_count: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        cpu_used_pct: (pct * 100.0).round() / 100.0,
        mem_total: total,
        mem_used: total.saturating_sub(avail),
        mem_total_mib: total >> 20,
        mem_used_mib: total.saturating_sub(avail) >> 20,
        disk_total,
        disk_used,
    };
    serde_json::to_value(m).unwrap_or_default()
}

/// (busy+idle, idle) jiffies from /proc/stat.
fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((v.iter().sum(), idle))
}

fn disk_usage(path: &str) -> (u64, u64) {
    let Ok(c) = std::ffi::CString::new(path) else {
        return (0, 0);
    };
    // SAFETY: statvfs writes into a zeroed struct we own.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut s) != 0 {
            return (0, 0);
        }
        let total = s.f_blocks * s.f_frsize;
        let free = s.f_bfree * s.f_frsize;
        (total, total.saturating_sub(free))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse() {
        for secs in [
            0u64,
            951_782_400,
            1_767_323_045,
            rand::random_range(0..4_000_000_000),
        ] {
            let text = k3_common::time::rfc3339_from_unix(secs);
            assert_eq!(timestamp_secs(&json!(text)), Some(secs as f64), "{text}");
        }
        assert_eq!(
            timestamp_secs(&json!("2026-01-02T03:04:05.5Z")),
            Some(1_767_323_045.5)
        );
        assert_eq!(timestamp_secs(&json!(12.5)), Some(12.5));
        assert_eq!(timestamp_secs(&json!("yesterday")), None);
    }
}
