//! Data plane on the API port (`docs/specs/e2b-compat.md §1, §3`): decides whether a request belongs to a sandbox's
//! envd, checks its access token and forwards it as HTTP/1.1 over one agent stream.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode, Uri, Version, header};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use crate::access::{refusal, request_ok, user_port};
use crate::backend::{AgentStream, VmError};
use crate::conn::TENANT_HEADER;
use crate::error::ApiError;
use crate::sandboxes::SandboxState;
use crate::state::AppState;
use crate::store::SandboxRecord;

/// The envd port inside every sandbox: `agentenv_envd::ENVD_PORT` as header text (a test checks it).
pub const ENVD_PORT: &str = "49983";
/// Longest wait for envd to open a tunnel to a user port.
const TUNNEL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Paths served by envd.
pub fn is_envd_path(path: &str) -> bool {
    agentenv_envd::paths::is_envd(path)
}

/// Where a request goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Plane {
    Control,
    /// Data plane for the sandbox with this id (from `E2b-Sandbox-Id`).
    SandboxById(String),
    /// Data plane for the sandbox owning this `X-Access-Token` (no id header).
    SandboxByToken(String),
    /// A signed `/files` URL with neither header (E2B's `download_url`/`upload_url` through a
    /// shared sandbox URL): the sandbox whose access token the signature holds under.
    SignedFile,
}

/// Routes by `E2b-Sandbox-Id` + path/port, never by the header alone; envd paths without the
/// header but with an access token go by token.
pub fn classify(path: &str, query: Option<&str>, headers: &HeaderMap) -> Plane {
    let get = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
    };
    let envd_path = is_envd_path(path);
    if let Some(id) = get("e2b-sandbox-id") {
        if envd_path || user_port(headers) {
            return Plane::SandboxById(id.to_string());
        }
        return Plane::Control;
    }
    if envd_path && let Some(token) = get("x-access-token") {
        return Plane::SandboxByToken(token.to_string());
    }
    if path == "/files"
        && query.is_some_and(|q| q.split('&').any(|kv| kv.starts_with("signature=")))
    {
        return Plane::SignedFile;
    }
    Plane::Control
}

pub const HOP_HEADERS: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
];

/// The client's (or a gateway's) credentials for us, never for the guest.
const CREDENTIAL_HEADERS: [&str; 4] = ["x-api-key", TENANT_HEADER, "cookie", "proxy-authorization"];

/// Removes hop-by-hop headers (and those `Connection` names): what every proxy hop drops.
pub fn strip_hop(h: &mut HeaderMap) {
    let named: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    for n in named {
        h.remove(n.as_str());
    }
    for n in HOP_HEADERS {
        h.remove(n);
    }
}

/// [`strip_hop`], and the client's credentials. `Authorization: Basic` keeps only its user name,
/// which envd reads as the acting user; any password or other scheme is dropped. `X-Access-Token`
/// stays: envd checks it too.
pub fn strip_for_guest(h: &mut HeaderMap) {
    strip_hop(h);
    for n in CREDENTIAL_HEADERS {
        h.remove(n);
    }
    let user = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(basic_user);
    h.remove(header::AUTHORIZATION);
    if let Some(user) = user {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
        if let Ok(v) = header::HeaderValue::from_str(&format!("Basic {b64}")) {
            h.insert(header::AUTHORIZATION, v);
        }
    }
}

/// The user name of `Basic base64(user:password)`.
fn basic_user(v: &str) -> Option<String> {
    use base64::Engine;
    let (scheme, b64) = v.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let user = text.split_once(':').map_or(text.as_str(), |(u, _)| u);
    (!user.is_empty()).then(|| user.to_string())
}

/// Whether the request names a user port: a port header that is not envd's number (an unparsable one
/// counts, so the proxy answers it with a 400).
/// The sandbox id and port that `host` names in E2B's form `<port>-<sandbox id>.<domain>`, for the
/// server's sandbox domain `domain` (without case; a domain without a port also matches a host with
/// one).
pub fn host_route(host: &str, domain: &str) -> Option<(String, u16)> {
    let (host, domain) = (host.to_ascii_lowercase(), domain.to_ascii_lowercase());
    let suffix = format!(".{domain}");
    let label = match host.strip_suffix(&suffix) {
        Some(l) => l,
        None if !domain.contains(':') => host.rsplit_once(':')?.0.strip_suffix(&suffix)?,
        None => return None,
    };
    let (port, id) = label.split_once('-')?;
    let digits = !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit());
    let port = port.parse::<u16>().ok().filter(|p| digits && *p > 0)?;
    let id_ok = !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    id_ok.then(|| (id.to_string(), port))
}

/// Routes a request by its `Host` (or HTTP/2 authority) when it names a sandbox port under `domain`:
/// the sandbox id and port headers are set from it, whatever the client sent.
pub fn route_by_host(req: &mut Request, domain: &str) -> Option<Plane> {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))?;
    let (id, port) = host_route(host, domain)?;
    let h = req.headers_mut();
    h.insert("e2b-sandbox-id", id.parse().ok()?);
    h.insert("e2b-sandbox-port", port.into());
    Some(Plane::SandboxById(id))
}

/// Which plane `req` is for: by its host under `sandbox_domain` ([`route_by_host`]), else by path and
/// headers ([`classify`]). The one decision of nodes and gateways alike.
pub fn plane_of(req: &mut Request, sandbox_domain: Option<&str>) -> Plane {
    sandbox_domain
        .and_then(|d| route_by_host(req, d))
        .unwrap_or_else(|| classify(req.uri().path(), req.uri().query(), req.headers()))
}

/// Serves one data-plane request for `plane`.
pub async fn serve(state: &AppState, plane: Plane, req: Request) -> Result<Response, ApiError> {
    let rec = match &plane {
        Plane::SandboxById(id) => {
            let rec = state
                .sandboxes
                .get(id)
                .ok_or_else(|| ApiError::sandbox_gone(id))?;
            if !request_ok(req.headers(), &rec) {
                return Err(refusal(req.headers()));
            }
            rec
        }
        Plane::SandboxByToken(token) => state.sandboxes.by_token(token).ok_or_else(|| {
            ApiError::bad_gateway("The sandbox of this access token was not found")
        })?,
        Plane::SignedFile => {
            let q: std::collections::HashMap<String, String> =
                form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes())
                    .into_owned()
                    .collect();
            let write = req.method() != axum::http::Method::GET;
            let now = u64::try_from(crate::sandboxes::now_ms() / 1000).unwrap_or(0);
            let check = |r: &crate::store::SandboxRecord| {
                agentenv_envd::signing::check(&q, write, &r.access_token, now)
            };
            let rec = state
                .sandboxes
                .find(|r| check(r) != Err(agentenv_envd::signing::INVALID))
                .ok_or_else(|| ApiError::unauthorized("no sandbox's signature matches this URL"))?;
            // Its sandbox is known now: an expired signature says so, as envd does.
            check(&rec).map_err(ApiError::unauthorized)?;
            rec
        }
        Plane::Control => unreachable!("control-plane requests never reach the proxy"),
    };
    let port_text = req
        .headers()
        .get("e2b-sandbox-port")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(ENVD_PORT);
    let port = port_text
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("invalid E2b-Sandbox-Port {port_text:?}")))?;
    if req.method() == axum::http::Method::CONNECT {
        return Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "CONNECT is not forwarded to sandboxes",
        ));
    }
    // By number: `049983` is envd too, and stays subject to the host-only paths.
    let port = (port != agentenv_envd::ENVD_PORT).then_some(port);
    if port.is_none() && agentenv_envd::paths::HOST_ONLY.contains(&req.uri().path()) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("{} is reachable from the host only", req.uri().path()),
        ));
    }
    let rec = ensure_running(state, rec).await?;
    forward(state, &rec, req, port).await
}

/// Turns agent stream `s` into a tunnel to guest port `port` (envd's `CONNECT`).
async fn open_tunnel(s: &mut AgentStream, id: &str, port: u16) -> Result<(), ApiError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let closed = |why: String| {
        ApiError::bad_gateway(format!(
            "The sandbox {id} is running but port is not open: {port} ({why})"
        ))
    };
    let head = async {
        s.write_all(agentenv_envd::tunnel_request(port).as_bytes())
            .await
            .map_err(|e| closed(e.to_string()))?;
        let mut head = Vec::with_capacity(128);
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() > 8192 || s.read(&mut b).await.map_err(|e| closed(e.to_string()))? == 0 {
                return Err(closed("envd closed the tunnel".into()));
            }
            head.push(b[0]);
        }
        Ok(head)
    };
    let head = tokio::time::timeout(TUNNEL_DEADLINE, head)
        .await
        .map_err(|_| closed("no answer from envd".into()))??;
    let status = head.split(|b| *b == b' ').nth(1).unwrap_or_default();
    if status != b"200" {
        return Err(closed(format!(
            "envd answered {}",
            String::from_utf8_lossy(status)
        )));
    }
    Ok(())
}

async fn ensure_running(state: &AppState, rec: SandboxRecord) -> Result<SandboxRecord, ApiError> {
    if rec.state == SandboxState::Running {
        return Ok(rec);
    }
    if !rec.auto_resume {
        return Err(ApiError::bad_gateway(format!(
            "The sandbox {} was not found: it is paused (connect to resume it)",
            rec.sandbox_id
        )));
    }
    state.sandboxes.auto_resume(&rec.sandbox_id).await?;
    state.sandboxes.get(&rec.sandbox_id).ok_or_else(|| {
        ApiError::bad_gateway(format!("The sandbox {} was not found", rec.sandbox_id))
    })
}

fn too_large(limit: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("upload exceeds the limit of {limit} bytes"),
    )
}

async fn forward(
    state: &AppState,
    rec: &SandboxRecord,
    mut req: Request,
    port: Option<u16>,
) -> Result<Response, ApiError> {
    // Upgrades (WebSocket) go to user ports only; envd speaks none.
    let upgrade = port.and(crate::upgrade::requested(req.headers()));
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut req));
    let client_conn = req
        .extensions()
        .get::<axum::extract::ConnectInfo<crate::conn::Conn>>()
        .map(|c| c.0.clone());
    let (mut parts, body) = req.into_parts();
    let limit = state.max_upload_bytes;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large(limit));
    }
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = Uri::try_from(path_and_query)
        .map_err(|e| ApiError::bad_request(format!("bad URI: {e}")))?;
    parts.version = Version::HTTP_11;
    strip_for_guest(&mut parts.headers);
    if let Some(protocol) = upgrade {
        crate::upgrade::keep(&mut parts.headers, protocol);
    }
    let host = match (port, &rec.mask_request_host) {
        (Some(p), Some(mask)) => mask.replace("${PORT}", &p.to_string()),
        (p, _) => format!(
            "localhost:{}",
            p.map_or(ENVD_PORT.to_string(), |p| p.to_string())
        ),
    };
    parts.headers.insert(
        header::HOST,
        header::HeaderValue::from_str(&host).map_err(|e| ApiError::bad_request(e.to_string()))?,
    );
    let body = Body::new(http_body_util::Limited::new(body, limit as usize));

    let id = &rec.sandbox_id;
    let mut stream = state
        .sandboxes
        .backend()
        .open_agent_stream(id)
        .await
        .map_err(|e| match e {
            VmError::SandboxNotFound(_) => {
                ApiError::bad_gateway(format!("The sandbox {id} was not found"))
            }
            _ => ApiError::bad_gateway(format!(
                "sandbox {id} is running but its port is not open: envd unreachable: {e}"
            )),
        })?;
    if let Some(p) = port {
        open_tunnel(&mut stream, id, p).await?;
    }
    // Header names as E2B's proxy sends them (`Host:`): servers in the sandbox may read them as is.
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .title_case_headers(true)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| {
            ApiError::bad_gateway(format!(
                "sandbox {id}: port is not open: HTTP handshake with envd failed: {e}"
            ))
        })?;
    let sid = id.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(sandbox = %sid, error = %e, "envd connection ended");
        }
    });
    let mut resp = sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|e| {
            if error_chain_has_limit(&e) {
                too_large(limit)
            } else {
                ApiError::bad_gateway(format!("sandbox {id}: envd request failed: {e}"))
            }
        })?;
    if let Some(client) = client_side
        && resp.status() == StatusCode::SWITCHING_PROTOCOLS
    {
        let guest = hyper::upgrade::on(&mut resp);
        let what = format!("sandbox {id} port {}", port.unwrap_or_default());
        crate::upgrade::splice(client, guest, what);
    }
    // A body cut by the sandbox's end resets the client's connection (`crate::conn`).
    Ok(resp.map(|b| crate::conn::cut_on_error(Body::new(b), client_conn)))
}

fn error_chain_has_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn hosts_of_e2b_form_name_a_sandbox_port() {
        let id = format!("i{:x}", rand::random::<u64>());
        let port = rand::random_range(1..=u16::MAX);
        for (host, domain) in [
            (format!("{port}-{id}.sbx.test"), "sbx.test"),
            (format!("{port}-{id}.SBX.test:8443"), "sbx.test"),
            (format!("{port}-{id}.sbx.test:8443"), "sbx.test:8443"),
        ] {
            assert_eq!(
                host_route(&host, domain),
                Some((id.clone(), port)),
                "{host}"
            );
        }
        for host in [
            format!("{port}-{id}.other.test"),
            format!("{port}-{id}.sbx.test:1"),
            format!("+80-{id}.sbx.test:8443"),
            format!("0-{id}.sbx.test:8443"),
            format!("99999-{id}.sbx.test:8443"),
            format!("{port}-.sbx.test:8443"),
            format!("{port}-a.b.sbx.test:8443"),
            format!("{port}-{id}sbx.test:8443"),
            "sbx.test:8443".to_string(),
            "localhost:8443".to_string(),
        ] {
            assert_eq!(host_route(&host, "sbx.test:8443"), None, "{host}");
        }
        // The headers follow the host, whatever the client sent.
        let mut req = Request::builder()
            .uri("/files")
            .header(header::HOST, format!("8080-{id}.sbx.test"))
            .header("e2b-sandbox-id", "someone-else")
            .header("e2b-sandbox-port", "49983")
            .body(Body::empty())
            .unwrap();
        assert_eq!(
            route_by_host(&mut req, "sbx.test"),
            Some(Plane::SandboxById(id.clone()))
        );
        assert_eq!(req.headers()["e2b-sandbox-id"], id.as_str());
        assert_eq!(req.headers()["e2b-sandbox-port"], "8080");
    }

    #[test]
    fn credentials_and_hop_headers_never_reach_the_guest() {
        use base64::Engine;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let user = format!("u{}", rand::random::<u32>());
        let secret = format!("s{}", rand::random::<u64>());
        let mut h = headers(&[
            ("X-API-Key", &secret),
            ("Cookie", &format!("session={secret}")),
            ("Proxy-Authorization", &format!("Basic {}", b64(&secret))),
            (
                "Authorization",
                &format!("Basic {}", b64(&format!("{user}:{secret}"))),
            ),
            ("Connection", "keep-alive, X-Private"),
            ("X-Private", &secret),
            ("Keep-Alive", "timeout=5"),
            ("X-Access-Token", "tok"),
            ("Content-Type", "application/json"),
        ]);
        strip_for_guest(&mut h);
        for (_, v) in &h {
            assert!(!v.to_str().unwrap().contains(&secret), "{h:?}");
        }
        assert_eq!(
            h["authorization"],
            format!("Basic {}", b64(&format!("{user}:")))
        );
        assert_eq!(h["x-access-token"], "tok");
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h.len(), 3, "{h:?}");
        let mut bearer = headers(&[("Authorization", &format!("Bearer {secret}"))]);
        strip_for_guest(&mut bearer);
        assert!(bearer.is_empty());
    }

    #[test]
    fn envd_port_text_matches_the_contract() {
        assert_eq!(ENVD_PORT, agentenv_envd::ENVD_PORT.to_string());
    }

    #[test]
    fn routes_by_id_and_path_not_by_header_alone() {
        let id = crate::keys::generate_sandbox_id();
        let with_id = headers(&[("E2b-Sandbox-Id", &id), ("E2b-Sandbox-Port", "49983")]);
        for p in [
            "/health",
            "/files",
            "/metrics",
            "/process.Process/Start",
            "/filesystem.Filesystem/Stat",
            "/envs",
        ] {
            assert_eq!(
                classify(p, None, &with_id),
                Plane::SandboxById(id.clone()),
                "{p}"
            );
        }
        // SDK 2.7-2.26 send the id header on the control-plane connect call.
        assert_eq!(
            classify(&format!("/sandboxes/{id}/connect"), None, &with_id),
            Plane::Control
        );
        let user_port = headers(&[("E2b-Sandbox-Id", &id), ("E2b-Sandbox-Port", "8080")]);
        assert_eq!(
            classify("/anything", None, &user_port),
            Plane::SandboxById(id.clone())
        );
        assert_eq!(classify("/health", None, &HeaderMap::new()), Plane::Control);
        assert_eq!(
            classify("/metrics", None, &HeaderMap::new()),
            Plane::Control
        );
        assert_eq!(
            classify("/v2/sandboxes", None, &HeaderMap::new()),
            Plane::Control
        );
    }

    #[test]
    fn token_fallback_only_on_envd_paths() {
        let token = crate::keys::generate_access_token();
        let h = headers(&[("X-Access-Token", &token)]);
        assert_eq!(
            classify("/process.Process/List", None, &h),
            Plane::SandboxByToken(token.clone())
        );
        assert_eq!(classify("/v2/sandboxes", None, &h), Plane::Control);
        let signed = Some("path=%2Fa&signature=v1_x&signature_expiration=1");
        assert_eq!(
            classify("/files", signed, &HeaderMap::new()),
            Plane::SignedFile
        );
        assert_eq!(
            classify("/files", Some("path=%2Fa"), &HeaderMap::new()),
            Plane::Control
        );
        assert_eq!(
            classify("/filesx", signed, &HeaderMap::new()),
            Plane::Control
        );
    }
}
