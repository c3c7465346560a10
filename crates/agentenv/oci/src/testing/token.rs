//! A bearer-token issuer for [`super::TestRegistry::start_with_token_auth`]: the registry's `auth: token`
//! mode verifies ES256 JWTs whose `x5c` certificate is in its `rootcertbundle`. The key and the
//! self-signed certificate come from the `openssl` CLI; tokens are signed with ring.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use ring::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};

use super::TestRegistryError;
use crate::client::Credentials;

/// Token `iss` and registry `service` names.
pub(crate) const ISSUER: &str = "k3-test-issuer";
pub(crate) const SERVICE: &str = "k3-test-registry";

/// A running token endpoint (`http://127.0.0.1:<port>/token`); stops on drop.
pub struct TokenServer {
    /// `http://127.0.0.1:<port>/token`.
    pub realm: String,
    stop: Arc<AtomicBool>,
    port: u16,
    issued: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TokenServer {
    /// Makes a P-256 key and certificate in `dir` (`cert.pem` for the registry), then serves tokens.
    /// With `credentials`, a token needs them as basic auth; without, anyone gets one.
    pub(crate) fn start(
        dir: &Path,
        credentials: Option<Credentials>,
    ) -> Result<TokenServer, TestRegistryError> {
        let (key, cert) = make_key(dir)?;
        let rng = ring::rand::SystemRandom::new();
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &key, &rng)
            .map_err(|e| TestRegistryError::Start(format!("token key: {e}")))?;
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let issued = Arc::new(AtomicUsize::new(0));
        let x5c = base64::engine::general_purpose::STANDARD.encode(&cert);
        let (s, n) = (stop.clone(), issued.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                if serve(conn, &key, &rng, &x5c, credentials.as_ref()) {
                    n.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Ok(TokenServer {
            realm: format!("http://127.0.0.1:{port}/token"),
            stop,
            port,
            issued,
            thread: Some(thread),
        })
    }

    /// Tokens issued so far.
    pub fn issued(&self) -> usize {
        self.issued.load(Ordering::Relaxed)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn make_key(dir: &Path) -> Result<(Vec<u8>, Vec<u8>), TestRegistryError> {
    let run = |args: &[&str]| openssl(dir, args);
    run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "key.pem",
        "-out",
        "cert.pem",
        "-days",
        "2",
        "-subj",
        "/CN=k3-test-token",
    ])?;
    run(&[
        "pkcs8", "-topk8", "-nocrypt", "-in", "key.pem", "-outform", "DER", "-out", "key.der",
    ])?;
    run(&[
        "x509", "-in", "cert.pem", "-outform", "DER", "-out", "cert.der",
    ])?;
    Ok((
        std::fs::read(dir.join("key.der"))?,
        std::fs::read(dir.join("cert.der"))?,
    ))
}

/// A self-signed P-256 server certificate for `127.0.0.1` (`tls-cert.pem`, `tls-key.pem` in `dir`);
/// returns its DER.
pub(crate) fn make_tls_cert(dir: &Path) -> Result<Vec<u8>, TestRegistryError> {
    std::fs::write(
        dir.join("tls.cnf"),
        "[req]\ndistinguished_name = dn\nx509_extensions = ext\nprompt = no\n[dn]\nCN = 127.0.0.1\n\
         [ext]\nbasicConstraints = critical,CA:FALSE\nsubjectAltName = IP:127.0.0.1\n\
         keyUsage = critical,digitalSignature\nextendedKeyUsage = serverAuth\n",
    )?;
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-config",
            "tls.cnf",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "tls-key.pem",
            "-out",
            "tls-cert.pem",
            "-days",
            "2",
        ],
    )?;
    openssl(
        dir,
        &[
            "x509",
            "-in",
            "tls-cert.pem",
            "-outform",
            "DER",
            "-out",
            "tls-cert.der",
        ],
    )?;
    Ok(std::fs::read(dir.join("tls-cert.der"))?)
}

fn openssl(dir: &Path, args: &[&str]) -> Result<(), TestRegistryError> {
    let o = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| TestRegistryError::Start(format!("openssl: {e}")))?;
    if !o.status.success() {
        return Err(TestRegistryError::Start(format!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr)
        )));
    }
    Ok(())
}

/// Answers one request; true when a token was issued.
fn serve(
    conn: TcpStream,
    key: &EcdsaKeyPair,
    rng: &ring::rand::SystemRandom,
    x5c: &str,
    credentials: Option<&Credentials>,
) -> bool {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
    let mut reader = BufReader::new(&conn);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return false;
    }
    let target = line.split_whitespace().nth(1).unwrap_or("").to_owned();
    let mut auth = None;
    loop {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(0) | Err(_) => break,
            Ok(_) if h == "\r\n" || h == "\n" => break,
            Ok(_) => {
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("authorization")
                {
                    auth = Some(v.trim().to_owned());
                }
            }
        }
    }
    let mut w = &conn;
    let reply = |w: &mut &TcpStream, status: &str, body: &str| {
        let _ = write!(
            w,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    };
    let user = match (credentials, auth.as_deref().and_then(parse_basic)) {
        (None, _) => String::new(),
        (Some(c), Some((u, p))) if u == c.username && p == c.password => u,
        (Some(_), _) => {
            reply(
                &mut w,
                "401 Unauthorized",
                r#"{"details":"bad or missing credentials"}"#,
            );
            return false;
        }
    };
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let scopes: Vec<String> = query
        .split('&')
        .filter_map(|kv| kv.strip_prefix("scope="))
        .map(urldecode)
        .collect();
    let token = sign(key, rng, x5c, &user, &scopes);
    reply(
        &mut w,
        "200 OK",
        &format!(r#"{{"token":"{token}","expires_in":300}}"#),
    );
    true
}

fn parse_basic(h: &str) -> Option<(String, String)> {
    let b64 = h
        .strip_prefix("Basic ")
        .or_else(|| h.strip_prefix("basic "))?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (u, p) = s.split_once(':')?;
    Some((u.to_owned(), p.to_owned()))
}

fn urldecode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// An ES256 JWT granting every action asked for in `repository:<name>:<actions>` scopes.
fn sign(
    key: &EcdsaKeyPair,
    rng: &ring::rand::SystemRandom,
    x5c: &str,
    user: &str,
    scopes: &[String],
) -> String {
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let access: Vec<serde_json::Value> = scopes
        .iter()
        .filter_map(|s| {
            let mut parts = s.splitn(3, ':');
            let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
            Some(serde_json::json!({
                "type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>(),
            }))
        })
        .collect();
    let header = serde_json::json!({"typ": "JWT", "alg": "ES256", "x5c": [x5c]});
    let claims = serde_json::json!({
        "iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
        "jti": format!("{now}-{}", scopes.len()), "access": access,
    });
    let signing_input = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let sig = key
        .sign(rng, signing_input.as_bytes())
        .map(|s| b64(s.as_ref()))
        .unwrap_or_default();
    format!("{signing_input}.{sig}")
}
