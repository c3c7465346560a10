//! HTTP to one repository of a registry: deadlines, status mapping and authentication
//! (anonymous, basic, and bearer tokens from a `WWW-Authenticate: Bearer realm=...` challenge).

use std::sync::Mutex;
use std::time::Duration;

use base64::Engine as _;
use ureq::http::{Response, StatusCode};

use crate::error::OciError;
use crate::reference::{ImageRef, is_loopback_host};

/// User name and password (or token) for a registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// User name.
    pub username: String,
    /// Password or access token.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// How to talk to a registry (shared by pull and push).
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Sent on a 401 (basic auth, or to the bearer token endpoint); anonymous when `None`.
    pub credentials: Option<Credentials>,
    /// http or https (default: http for loopback registries, https otherwise).
    pub scheme: Scheme,
    /// Trust only these roots (DER certificates) for https instead of the Mozilla (webpki) set:
    /// for private registries with their own CA.
    pub root_certificates: Option<Vec<Vec<u8>>>,
    /// Deadline of every small request (manifests, configs, tokens, upload sessions).
    pub timeout: Duration,
    /// A blob request fails when no byte arrives for this long.
    pub stall_timeout: Duration,
    /// Slowest acceptable blob rate: a blob of `n` bytes gets `timeout + n / min_bytes_per_sec`.
    pub min_bytes_per_sec: u64,
    /// Internal address ranges (loopback, private, link-local, CGNAT) this transfer may connect to;
    /// by default none ([`crate::guard`]).
    pub allow: Vec<crate::guard::AllowedNet>,
}

impl Default for RegistryOptions {
    fn default() -> RegistryOptions {
        RegistryOptions {
            credentials: None,
            scheme: Scheme::Auto,
            root_certificates: None,
            timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(30),
            min_bytes_per_sec: 1 << 20,
            allow: Vec::new(),
        }
    }
}

/// Which protocol to speak to a registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scheme {
    /// http for loopback registries (`localhost`, `127.0.0.0/8`, `[::1]`), https (rustls) otherwise.
    #[default]
    Auto,
    /// Always https.
    Https,
    /// Always plain http (insecure; for trusted networks only).
    Http,
}

impl RegistryOptions {
    /// The deadline of one blob transfer of `size` bytes.
    pub fn blob_deadline(&self, size: u64) -> Duration {
        self.timeout + Duration::from_secs(size / self.min_bytes_per_sec.max(1))
    }
}

/// Documents (manifests, configs, error bodies, tokens) are read into memory only up to this size.
pub(crate) const MAX_DOCUMENT: u64 = 4 << 20;

pub(crate) struct Client {
    agent: ureq::Agent,
    base: String,
    pub(crate) registry: String,
    pub(crate) repository: String,
    opts: RegistryOptions,
    actions: &'static str,
    auth: Mutex<Option<String>>,
}

pub(crate) enum Body<'a> {
    Empty,
    Bytes(&'a [u8], &'a str),
}

impl Client {
    /// `actions` is the bearer scope asked for: `pull` or `pull,push`.
    pub(crate) fn new(image: &ImageRef, opts: &RegistryOptions, actions: &'static str) -> Client {
        let loopback = is_loopback_host(&image.registry);
        let scheme = match opts.scheme {
            Scheme::Http => "http",
            Scheme::Https => "https",
            Scheme::Auto if loopback => "http",
            Scheme::Auto => "https",
        };
        let mut cfg = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(5)
            .timeout_connect(Some(opts.timeout))
            .timeout_per_read(Some(opts.stall_timeout))
            .timeout_per_write(Some(opts.stall_timeout))
            .user_agent(concat!("agentenv-oci/", env!("CARGO_PKG_VERSION")));
        if loopback {
            cfg = cfg.proxy(None);
        }
        if let Some(roots) = &opts.root_certificates {
            let certs: Vec<_> = roots
                .iter()
                .map(|d| ureq::tls::Certificate::from_der(d).to_owned())
                .collect();
            let tls = ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::new_with_certs(&certs))
                .build();
            cfg = cfg.tls_config(tls);
        }
        let resolver = crate::guard::GuardedResolver {
            allow: opts.allow.clone(),
        };
        Client {
            agent: ureq::Agent::with_parts(
                cfg.build(),
                ureq::unversioned::transport::DefaultConnector::default(),
                resolver,
            ),
            base: format!("{scheme}://{}", image.api_host()),
            registry: image.registry.clone(),
            repository: image.repository.clone(),
            opts: opts.clone(),
            actions,
            auth: Mutex::new(None),
        }
    }

    pub(crate) fn opts(&self) -> &RegistryOptions {
        &self.opts
    }

    /// `/v2/<repo>/<rest>` as a full URL.
    pub(crate) fn url(&self, rest: &str) -> String {
        format!("{}/v2/{}/{rest}", self.base, self.repository)
    }

    /// Turns a `Location` header (absolute or relative) into a URL.
    pub(crate) fn resolve(&self, location: &str) -> String {
        if location.starts_with("http://") || location.starts_with("https://") {
            location.to_owned()
        } else if location.starts_with('/') {
            format!("{}{location}", self.base)
        } else {
            format!("{}/{location}", self.base)
        }
    }

    /// One request with deadline `deadline`, authenticating once on a 401.
    pub(crate) fn send(
        &self,
        method: &'static str,
        url: &str,
        headers: &[(&str, &str)],
        body: Body<'_>,
        deadline: Duration,
    ) -> Result<Response<ureq::Body>, OciError> {
        let resp = self.send_once(method, url, headers, &body, deadline)?;
        if resp.status() != StatusCode::UNAUTHORIZED {
            return Ok(resp);
        }
        let challenge = header(&resp, "www-authenticate").unwrap_or_default();
        self.authenticate(&challenge)?;
        let resp = self.send_once(method, url, headers, &body, deadline)?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            let detail = error_detail(resp);
            return Err(self.unauthorized(self.opts.credentials.is_some(), &detail));
        }
        Ok(resp)
    }

    fn send_once(
        &self,
        method: &'static str,
        url: &str,
        headers: &[(&str, &str)],
        body: &Body<'_>,
        deadline: Duration,
    ) -> Result<Response<ureq::Body>, OciError> {
        let auth = self.auth.lock().ok().and_then(|a| a.clone());
        let mut req = ureq::http::Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(a) = &auth {
            req = req.header("authorization", a);
        }
        let r = match body {
            Body::Empty => req.body(()).map(|r| self.run(r, deadline)),
            Body::Bytes(b, ct) => req
                .header("content-type", *ct)
                .body(*b)
                .map(|r| self.run(r, deadline)),
        };
        r.map_err(|e| OciError::Transport {
            method,
            url: url.into(),
            reason: e.to_string(),
        })?
        .map_err(|e| transport(method, url, deadline, e))
    }

    fn run<S: ureq::AsSendBody>(
        &self,
        req: ureq::http::Request<S>,
        deadline: Duration,
    ) -> Result<Response<ureq::Body>, ureq::Error> {
        let req = self
            .agent
            .configure_request(req)
            .timeout_global(Some(deadline))
            .build();
        self.agent.run(req)
    }

    fn authenticate(&self, challenge: &str) -> Result<(), OciError> {
        let (scheme, params) = parse_challenge(challenge);
        let value = match scheme.to_ascii_lowercase().as_str() {
            "bearer" => {
                let realm = params
                    .iter()
                    .find(|(k, _)| k == "realm")
                    .map(|(_, v)| v.clone())
                    .ok_or_else(|| OciError::Token {
                        realm: String::new(),
                        reason: format!("bearer challenge without a realm: {challenge:?}"),
                    })?;
                format!("Bearer {}", self.token(&realm, &params)?)
            }
            "basic" => match &self.opts.credentials {
                Some(c) => basic(c),
                None => return Err(self.unauthorized(false, challenge)),
            },
            _ => return Err(self.unauthorized(self.opts.credentials.is_some(), challenge)),
        };
        if let Ok(mut a) = self.auth.lock() {
            *a = Some(value);
        }
        Ok(())
    }

    fn token(&self, realm: &str, params: &[(String, String)]) -> Result<String, OciError> {
        let own_scope = format!("repository:{}:{}", self.repository, self.actions);
        let mut query = Vec::new();
        if let Some((_, s)) = params.iter().find(|(k, _)| k == "service") {
            query.push(format!("service={}", urlencode(s)));
        }
        // The challenge's scope, plus ours so one token serves the whole pull or push.
        if let Some((_, s)) = params.iter().find(|(k, _)| k == "scope")
            && *s != own_scope
        {
            query.push(format!("scope={}", urlencode(s)));
        }
        query.push(format!("scope={}", urlencode(&own_scope)));
        let sep = if realm.contains('?') { '&' } else { '?' };
        let url = format!("{realm}{sep}{}", query.join("&"));
        let terr = |reason: String| OciError::Token {
            realm: realm.into(),
            reason,
        };
        let mut req = ureq::http::Request::builder().method("GET").uri(&url);
        if let Some(c) = &self.opts.credentials {
            req = req.header("authorization", basic(c));
        }
        let req = req.body(()).map_err(|e| terr(e.to_string()))?;
        let resp = self
            .run(req, self.opts.timeout)
            .map_err(|e| transport("GET", &url, self.opts.timeout, e))?;
        match resp.status().as_u16() {
            200 => {}
            401 | 403 => {
                let detail = error_detail(resp);
                return Err(self.unauthorized(self.opts.credentials.is_some(), &detail));
            }
            s => return Err(terr(format!("HTTP {s}: {}", error_detail(resp)))),
        }
        let body = read_document(resp, "GET", &url)?;
        let v: serde_json::Value =
            serde_json::from_slice(&body).map_err(|e| terr(format!("bad JSON: {e}")))?;
        v.get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| terr("answer has no token".into()))
    }

    fn unauthorized(&self, had_credentials: bool, detail: &str) -> OciError {
        OciError::Unauthorized {
            registry: self.registry.clone(),
            repository: self.repository.clone(),
            had_credentials,
            detail: detail.to_owned(),
        }
    }

    /// Maps a non-success status to a typed error (reads the error body).
    pub(crate) fn status_error(
        &self,
        method: &'static str,
        url: &str,
        what: &'static str,
        reference: &str,
        resp: Response<ureq::Body>,
    ) -> OciError {
        let status = resp.status().as_u16();
        let detail = error_detail(resp);
        match status {
            401 => self.unauthorized(self.opts.credentials.is_some(), &detail),
            403 => OciError::Forbidden {
                registry: self.registry.clone(),
                repository: self.repository.clone(),
                detail,
            },
            404 => OciError::NotFound {
                registry: self.registry.clone(),
                repository: self.repository.clone(),
                what,
                reference: reference.into(),
                detail,
            },
            _ => OciError::Status {
                method,
                url: url.into(),
                status,
                detail,
            },
        }
    }
}

fn basic(c: &Credentials) -> String {
    let raw = format!("{}:{}", c.username, c.password);
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    )
}

pub(crate) fn header(resp: &Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn transport(method: &'static str, url: &str, deadline: Duration, e: ureq::Error) -> OciError {
    match e {
        ureq::Error::Timeout(_) => OciError::Timeout {
            method,
            url: url.into(),
            after: deadline,
        },
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => OciError::Timeout {
            method,
            url: url.into(),
            after: deadline,
        },
        e => OciError::Transport {
            method,
            url: url.into(),
            reason: e.to_string(),
        },
    }
}

/// Reads a small body (at most [`MAX_DOCUMENT`] bytes).
pub(crate) fn read_document(
    resp: Response<ureq::Body>,
    method: &'static str,
    url: &str,
) -> Result<Vec<u8>, OciError> {
    resp.into_body()
        .into_with_config()
        .limit(MAX_DOCUMENT)
        .read_to_vec()
        .map_err(|e| match e {
            ureq::Error::BodyExceedsLimit(n) => OciError::TooLarge {
                what: "document",
                digest: url.into(),
                size: n,
                limit: MAX_DOCUMENT,
            },
            e => transport(method, url, Duration::ZERO, e),
        })
}

/// The registry's `errors[].code` list, or the status: an upstream's error text is never passed on
/// (it could carry what an internal service answered).
pub(crate) fn error_detail(resp: Response<ureq::Body>) -> String {
    let status = resp.status();
    let body = resp
        .into_body()
        .into_with_config()
        .limit(64 << 10)
        .read_to_vec()
        .unwrap_or_default();
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body)
        && let Some(errs) = v.get("errors").and_then(|e| e.as_array())
    {
        let parts: Vec<String> = errs
            .iter()
            .map(|e| {
                // The registry's code only (a short constant); its free text is not passed on.
                let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("");
                code.chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .take(64)
                    .collect::<String>()
            })
            .collect();
        if !parts.is_empty() {
            return parts.join("; ");
        }
    }
    status.to_string()
}

/// Parses `Bearer realm="...",service="...",scope="..."` into the scheme and its parameters.
pub(crate) fn parse_challenge(h: &str) -> (String, Vec<(String, String)>) {
    let h = h.trim();
    let (scheme, rest) = h.split_once(' ').unwrap_or((h, ""));
    let mut params = Vec::new();
    let mut s = rest.trim();
    while !s.is_empty() {
        let Some(eq) = s.find('=') else { break };
        let key = s[..eq]
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        s = &s[eq + 1..];
        let value;
        if let Some(q) = s.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = q.char_indices();
            let mut end = q.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            out.push(n);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => out.push(c),
                }
            }
            value = out;
            s = &q[end.min(q.len())..];
        } else {
            let end = s.find(',').unwrap_or(s.len());
            value = s[..end].trim().to_owned();
            s = &s[end..];
        }
        s = s.trim_start().trim_start_matches(',').trim_start();
        params.push((key, value));
    }
    (scheme.to_owned(), params)
}

fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse() {
        let (s, p) = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/debian:pull""#,
        );
        assert_eq!(s, "Bearer");
        assert_eq!(
            p,
            vec![
                ("realm".into(), "https://auth.docker.io/token".into()),
                ("service".into(), "registry.docker.io".into()),
                ("scope".into(), "repository:library/debian:pull".into()),
            ]
        );
        let (s, p) = parse_challenge(r#"Basic realm="a \"b\", c""#);
        assert_eq!(
            (s.as_str(), p),
            ("Basic", vec![("realm".into(), r#"a "b", c"#.into())])
        );
        let (s, p) = parse_challenge("Bearer realm=http://x/t, service=y");
        assert_eq!(s, "Bearer");
        assert_eq!(p[0], ("realm".into(), "http://x/t".into()));
        assert_eq!(p[1], ("service".into(), "y".into()));
    }

    #[test]
    fn urlencode_scope() {
        assert_eq!(
            urlencode("repository:a/b:pull,push"),
            "repository%3Aa%2Fb%3Apull%2Cpush"
        );
    }
}
