//! Host side of the guest agent channel: the mux client over the virtio-serial unix socket, and the
//! small HTTP/1.1 exchanges the runtime itself makes with envd (`/health`, `/init`).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use agentenv_mux::{MuxError, MuxStream, Session};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    mut first: Option<UnixStream>,
    socket: &Path,
    attempt: Duration,
    deadline: Duration,
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
        match tokio::time::timeout(attempt, request(&current, "GET", "/health", None)).await {
            Ok(Ok(status)) if (200..300).contains(&status) => return Ok(current),
            Ok(Ok(status)) => last = format!("/health answered {status}"),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("no answer within {} ms", attempt.as_millis()),
        }
        tracing::debug!(socket = %socket.display(), %last, "agent not healthy yet");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Err(AgentError::Timeout {
        what: format!("/health ({last})"),
        secs: deadline.as_secs(),
    })
}

/// Sends one HTTP/1.1 request on a fresh stream and returns the response status code.
pub async fn request(
    link: &AgentLink,
    method: &str,
    path: &str,
    json_body: Option<&str>,
) -> Result<u16, AgentError> {
    let mut s = link.open().await?;
    let body = json_body.unwrap_or("");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: envd\r\nConnection: close\r\n");
    if json_body.is_some() {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    let http = |what: &str, e: std::io::Error| AgentError::Http {
        what: what.into(),
        detail: e.to_string(),
    };
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| http("write", e))?;
    s.flush().await.map_err(|e| http("flush", e))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 512];
    while !head.windows(2).any(|w| w == b"\r\n") {
        let n = s.read(&mut buf).await.map_err(|e| http("read", e))?;
        if n == 0 {
            return Err(AgentError::Http {
                what: path.into(),
                detail: "stream closed before a status line".into(),
            });
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| AgentError::Http {
            what: path.into(),
            detail: format!("bad status line: {line}"),
        })?;
    Ok(status)
}
