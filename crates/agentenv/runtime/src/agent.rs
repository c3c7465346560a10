//! Host side of the guest agent channel: the mux client over the virtio-serial unix socket, and the
//! small HTTP/1.1 exchanges the runtime itself makes with envd (`/health`, `/init`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use agentenv_mux::{MuxError, MuxStream, Session};
use tokio::net::UnixStream;

/// Errors talking to the guest agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent socket of QEMU could not be opened.
    #[error("agent socket {path}: {source}")]
    Socket {
        path: String,
        source: std::io::Error,
    },
    /// The mux session failed.
    #[error(transparent)]
    Mux(#[from] MuxError),
    /// The HTTP exchange on a stream failed.
    #[error("agent http {what}: {detail}")]
    Http { what: String, detail: String },
    /// The agent did not answer within the deadline.
    #[error("guest agent did not answer {what} within {secs} s")]
    Timeout { what: String, secs: u64 },
}

/// A live mux session to one guest agent.
#[derive(Clone)]
pub struct AgentLink {
    session: Arc<Session>,
}

impl AgentLink {
    /// Opens one stream (one HTTP/1.1 connection to envd).
    pub async fn open(&self) -> Result<MuxStream, MuxError> {
        self.session.open().await
    }

    /// True while the session is alive.
    pub fn is_alive(&self) -> bool {
        self.session.close_reason().is_none()
    }
}

/// Connects to the agent socket and waits until `GET /health` answers 2xx, reconnecting (a fresh
/// session, so a fresh HELLO) after each `attempt` without an answer, until `deadline` passes.
pub async fn connect_healthy(
    socket: &Path,
    attempt: Duration,
    deadline: Duration,
) -> Result<AgentLink, AgentError> {
    healthy_from(None, socket, attempt, deadline).await
}

/// Like [`connect_healthy`], starting with the already connected `first` socket when given.
///
/// The connection is kept while the session lives: QEMU does not notice a client that went away while
/// the guest is not reading its port, so reconnecting early would only queue connections QEMU never
/// accepts. A new connection (fresh session, fresh HELLO) is made only once the session has ended.
pub async fn healthy_from(
    first: Option<UnixStream>,
    socket: &Path,
    attempt: Duration,
    deadline: Duration,
) -> Result<AgentLink, AgentError> {
    answering(first, socket, attempt, deadline, Probe::Health).await
}

/// What [`answering`] sends until the agent answers 2xx.
pub enum Probe<'a> {
    /// `GET /health`.
    Health,
    /// `POST /init` ([`init_body`], built afresh per attempt): a restored machine is then up and
    /// configured in one round trip. A 4xx answer is final.
    Init {
        env_vars: &'a BTreeMap<String, String>,
        network: Option<agentenv_envd::GuestNetwork>,
    },
}

impl Probe<'_> {
    fn path(&self) -> &'static str {
        match self {
            Probe::Health => agentenv_envd::paths::HEALTH,
            Probe::Init { .. } => agentenv_envd::paths::INIT,
        }
    }
}

/// Like [`healthy_from`], with `probe` as the question.
pub async fn answering(
    mut first: Option<UnixStream>,
    socket: &Path,
    attempt: Duration,
    deadline: Duration,
    probe: Probe<'_>,
) -> Result<AgentLink, AgentError> {
    let end = tokio::time::Instant::now() + deadline;
    let mut last = String::from("no attempt");
    let mut link: Option<AgentLink> = None;
    while tokio::time::Instant::now() < end {
        let current = match link.as_ref().filter(|l| l.is_alive()) {
            Some(l) => l.clone(),
            None => {
                let conn = match first.take() {
                    Some(s) => Ok(s),
                    None => UnixStream::connect(socket).await,
                };
                match conn {
                    Ok(io) => link
                        .insert(AgentLink {
                            session: Arc::new(Session::client(io)),
                        })
                        .clone(),
                    Err(e) => {
                        last = e.to_string();
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                }
            }
        };
        let path = probe.path();
        let answer = match &probe {
            Probe::Health => {
                tokio::time::timeout(attempt, request_text(&current, "GET", path, None)).await
            }
            Probe::Init { env_vars, network } => {
                let body = init_body(env_vars, network.clone())?;
                let answer = request_text(&current, "POST", path, Some(&body));
                tokio::time::timeout(attempt, answer).await
            }
        };
        match answer {
            Ok(Ok((status, _))) if (200..300).contains(&status) => return Ok(current),
            Ok(Ok((status, text))) if matches!(probe, Probe::Init { .. }) && status < 500 => {
                return Err(AgentError::Http {
                    what: path.into(),
                    detail: format!("HTTP {status}: {}", text.trim()),
                });
            }
            Ok(Ok((status, _))) => last = format!("{path} answered {status}"),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("no answer within {} ms", attempt.as_millis()),
        }
        tracing::debug!(socket = %socket.display(), %last, "agent not healthy yet");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let path = probe.path();
    Err(AgentError::Timeout {
        what: format!("{path} ({last})"),
        secs: deadline.as_secs(),
    })
}

/// Sends one HTTP/1.1 request to envd on a fresh stream and returns the response status code.
pub async fn request(
    link: &AgentLink,
    method: &str,
    path: &str,
    json_body: Option<&str>,
) -> Result<u16, AgentError> {
    request_text(link, method, path, json_body)
        .await
        .map(|(s, _)| s)
}

/// [`request`], also returning the response body (at most 4 KiB of it, as text).
pub async fn request_text(
    link: &AgentLink,
    method: &str,
    path: &str,
    json_body: Option<&str>,
) -> Result<(u16, String), AgentError> {
    request_on(link.open().await?, method, path, json_body).await
}

/// Sends one HTTP/1.1 request to envd on stream `s` (a JSON body when given); returns the response and
/// the connection's driver task (abort it once the body is read).
async fn send_on(
    s: MuxStream,
    method: &str,
    path: &str,
    json_body: Option<Vec<u8>>,
) -> Result<
    (
        hyper::Response<hyper::body::Incoming>,
        tokio::task::JoinHandle<()>,
    ),
    AgentError,
> {
    use http_body_util::Full;
    let http = |what: &str, e: &dyn std::fmt::Display| AgentError::Http {
        what: format!("{what} {path}"),
        detail: e.to_string(),
    };
    let (mut tx, conn) = hyper::client::conn::http1::handshake::<_, Full<bytes::Bytes>>(
        hyper_util::rt::TokioIo::new(s),
    )
    .await
    .map_err(|e| http("handshake", &e))?;
    let driver = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "envd");
    if json_body.is_some() {
        req = req.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(bytes::Bytes::from(json_body.unwrap_or_default())))
        .map_err(|e| http("build", &e))?;
    let resp = tx.send_request(req).await.map_err(|e| http("send", &e))?;
    Ok((resp, driver))
}

/// Longest answer body read from a guest for a short request (`/init`, metrics); the rest is not read.
pub const MAX_ANSWER_BYTES: usize = 64 << 10;
/// Longest line of an `/exec` event stream (envd's output chunks are far smaller).
pub const MAX_EVENT_LINE: usize = 1 << 20;
/// Deadline of a short request's whole answer.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(10);

/// Reads at most `cap` bytes of `body`, then stops reading; never waits past the caller's deadline.
async fn read_capped(mut body: hyper::body::Incoming, cap: usize) -> Vec<u8> {
    use http_body_util::BodyExt;
    let mut out = Vec::new();
    while out.len() < cap {
        let Some(Ok(frame)) = body.frame().await else {
            break;
        };
        if let Ok(data) = frame.into_data() {
            let take = data.len().min(cap - out.len());
            out.extend_from_slice(&data[..take]);
        }
    }
    out
}

/// [`request_text`] on a stream already open: the status and at most [`MAX_ANSWER_BYTES`] of the
/// body, within [`ANSWER_DEADLINE`].
pub async fn request_on(
    s: MuxStream,
    method: &str,
    path: &str,
    json_body: Option<&str>,
) -> Result<(u16, String), AgentError> {
    request_within(s, method, path, json_body, ANSWER_DEADLINE).await
}

/// [`request_on`] with its own deadline.
pub async fn request_within(
    s: MuxStream,
    method: &str,
    path: &str,
    json_body: Option<&str>,
    deadline: Duration,
) -> Result<(u16, String), AgentError> {
    let run = async {
        let (resp, driver) =
            send_on(s, method, path, json_body.map(|b| b.as_bytes().to_vec())).await?;
        let status = resp.status().as_u16();
        let body = read_capped(resp.into_body(), MAX_ANSWER_BYTES).await;
        driver.abort();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(deadline, run)
        .await
        .map_err(|_| AgentError::Timeout {
            what: path.into(),
            secs: deadline.as_secs(),
        })?
}

/// Runs `req` through envd `/exec` on stream `s`, handing each output event to `on_event`, within
/// `deadline`. Returns the exit code and status text, or, for a background start, the pid as code.
pub async fn exec_on(
    s: MuxStream,
    req: &agentenv_envd::ExecRequest,
    deadline: Duration,
    mut on_event: impl FnMut(agentenv_envd::ExecEvent) + Send,
) -> Result<(i32, String), AgentError> {
    use agentenv_envd::ExecEvent;
    use http_body_util::BodyExt;
    let path = agentenv_envd::paths::EXEC;
    let http = |what: &str, e: &dyn std::fmt::Display| AgentError::Http {
        what: format!("{what} {path}"),
        detail: e.to_string(),
    };
    let run = async {
        let body = serde_json::to_vec(req).map_err(|e| http("encode", &e))?;
        let (resp, driver) = send_on(s, "POST", path, Some(body)).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let text = read_capped(body, MAX_ANSWER_BYTES).await;
            driver.abort();
            return Err(AgentError::Http {
                what: path.into(),
                detail: format!("HTTP {status}: {}", String::from_utf8_lossy(&text).trim()),
            });
        }
        let mut buf: Vec<u8> = Vec::new();
        let end = loop {
            let Some(frame) = body.frame().await else {
                break Err(http("read", &"the answer ended before the command"));
            };
            let frame = frame.map_err(|e| http("read", &e))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            if buf.len() > MAX_EVENT_LINE && !buf[..MAX_EVENT_LINE].contains(&b'\n') {
                driver.abort();
                return Err(http(
                    "read",
                    &format!("an event line over {MAX_EVENT_LINE} bytes"),
                ));
            }
            let mut done = None;
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let lineb: Vec<u8> = buf.drain(..=nl).collect();
                let ev: ExecEvent =
                    serde_json::from_slice(&lineb).map_err(|e| http("decode", &e))?;
                match ev {
                    ExecEvent::Exit { code, status } => done = Some(Ok((code, status))),
                    ExecEvent::Started(pid) => done = Some(Ok((pid as i32, "started".into()))),
                    ExecEvent::Error(e) => done = Some(Err(http("start", &e))),
                    ev => on_event(ev),
                }
            }
            if let Some(d) = done {
                break d;
            }
        };
        driver.abort();
        end
    };
    tokio::time::timeout(deadline, run)
        .await
        .map_err(|_| AgentError::Timeout {
            what: path.into(),
            secs: deadline.as_secs(),
        })?
}

/// The `/init` body of a created, resumed or forked machine: the host's clock, fresh kernel entropy,
/// `env_vars` and its network, so that it has the right time and its own random stream.
pub fn init_body(
    env_vars: &BTreeMap<String, String>,
    network: Option<agentenv_envd::GuestNetwork>,
) -> Result<String, AgentError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let body = agentenv_envd::InitRequest {
        env_vars: (!env_vars.is_empty()).then(|| env_vars.clone()),
        timestamp: Some(serde_json::json!(now)),
        entropy: Some(agentenv_envd::hex(&host_entropy())),
        network,
        ..Default::default()
    };
    serde_json::to_string(&body).map_err(|e| AgentError::Http {
        what: "encode /init".into(),
        detail: e.to_string(),
    })
}

/// Sends envd `/init` ([`init_body`]) on a live link.
pub async fn init(
    link: &AgentLink,
    env_vars: &BTreeMap<String, String>,
    network: Option<agentenv_envd::GuestNetwork>,
) -> Result<(), AgentError> {
    post_init(link, &init_body(env_vars, network)?).await
}

/// Sends one `/init` body as it is.
pub async fn configure(
    link: &AgentLink,
    body: &agentenv_envd::InitRequest,
) -> Result<(), AgentError> {
    let body = serde_json::to_string(body).map_err(|e| AgentError::Http {
        what: "encode /init".into(),
        detail: e.to_string(),
    })?;
    post_init(link, &body).await
}

async fn post_init(link: &AgentLink, body: &str) -> Result<(), AgentError> {
    let (status, text) = request_text(link, "POST", agentenv_envd::paths::INIT, Some(body)).await?;
    if !(200..300).contains(&status) {
        return Err(AgentError::Http {
            what: "/init".into(),
            detail: format!("HTTP {status}: {}", text.trim()),
        });
    }
    Ok(())
}

/// Asks the guest to flush its file systems (before a filesystem-only snapshot).
pub async fn sync(link: &AgentLink) -> Result<(), AgentError> {
    let status = request(link, "POST", agentenv_envd::paths::SYNC, None).await?;
    if !(200..300).contains(&status) {
        return Err(AgentError::Http {
            what: "/sync".into(),
            detail: format!("HTTP {status}"),
        });
    }
    Ok(())
}

/// 32 bytes from the host kernel's CSPRNG.
pub(crate) fn host_entropy() -> [u8; 32] {
    let mut b = [0u8; 32];
    // SAFETY: getrandom writes at most b.len() bytes into the buffer it is given.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        tracing::warn!("getrandom returned {n}; guest entropy falls back to the clock");
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b[..16].copy_from_slice(&t.to_le_bytes());
    }
    b
}

#[cfg(test)]
mod bounded_tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A host session whose guest side answers every stream with `answer` (a hostile agent).
    async fn hostile_guest(
        answer: impl Fn(MuxStream) -> tokio::task::JoinHandle<()> + Send + 'static,
    ) -> Session {
        let (host, guest) = tokio::io::duplex(1 << 16);
        let guest = Session::server(guest);
        tokio::spawn(async move {
            while let Some(s) = guest.accept().await {
                answer(s);
            }
        });
        let host = Session::client(host);
        host.ready().await.unwrap();
        host
    }

    /// Reads the request head, then writes `head` and, forever, `chunk`.
    fn endless(
        head: &'static str,
        chunk: &'static [u8],
    ) -> impl Fn(MuxStream) -> tokio::task::JoinHandle<()> {
        move |mut s| {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                while s.write_all(chunk).await.is_ok() {}
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_endless_answer_is_read_only_up_to_its_cap() {
        // A body that claims 100 GB and keeps coming.
        let host = hostile_guest(endless(
            "HTTP/1.1 200 OK\r\ncontent-length: 100000000000\r\n\r\n",
            &[b'x'; 16384],
        ))
        .await;
        let t = Instant::now();
        let r = request_within(
            host.open().await.unwrap(),
            "GET",
            "/metrics",
            None,
            Duration::from_secs(20),
        )
        .await;
        let (status, text) = r.unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            text.len(),
            MAX_ANSWER_BYTES,
            "read up to the cap, then stopped"
        );
        assert!(t.elapsed() < Duration::from_secs(20));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_or_dribbling_agent_hits_the_deadline() {
        // Headers, then nothing: the body never ends.
        let host = hostile_guest(|mut s| {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\nabc")
                    .await;
                std::future::pending::<()>().await;
            })
        })
        .await;
        let r = request_within(
            host.open().await.unwrap(),
            "GET",
            "/metrics",
            None,
            Duration::from_millis(500),
        )
        .await;
        assert!(matches!(r, Err(AgentError::Timeout { .. })), "{r:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exec_stream_without_newlines_is_refused_at_its_line_cap() {
        let host = hostile_guest(endless(
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n\r\n",
            &[b'y'; 8192],
        ))
        .await;
        let req = agentenv_envd::ExecRequest::default();
        let t = Instant::now();
        let r = exec_on(
            host.open().await.unwrap(),
            &req,
            Duration::from_secs(60),
            |_| {},
        )
        .await;
        match r {
            Err(AgentError::Http { detail, .. }) => {
                assert!(detail.contains("event line"), "{detail}")
            }
            other => panic!("expected the line cap, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(60));
    }
}
