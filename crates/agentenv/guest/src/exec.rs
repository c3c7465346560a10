//! `POST /exec` for the host: one command run to its end (or started in the background), its output
//! and exit streamed back as [`ExecEvent`] lines. Template builds run their steps through it.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use agentenv_envd::{ExecEvent, ExecRequest, MAX_EXEC_BODY, START_TAG};

use crate::Agent;
use crate::envd::{ProcessConfig, Stream};
use crate::http::{Body, channel_body, http_error, read_body};
use crate::process::{ProcEvent, SpawnSpec};

fn line(ev: &ExecEvent) -> Bytes {
    let mut v = serde_json::to_vec(ev).unwrap_or_default();
    v.push(b'\n');
    v.into()
}

/// Serves one `/exec`.
pub async fn exec(agent: &Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let body = match read_body(req.into_body(), MAX_EXEC_BODY).await {
        Ok(b) => b,
        Err(e) => return http_error(StatusCode::PAYLOAD_TOO_LARGE, e.message),
    };
    let r: ExecRequest = match crate::envd::parse(&body) {
        Ok(r) => r,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, e.message),
    };
    let Some(user) = crate::users::lookup(&r.user) else {
        return http_error(
            StatusCode::BAD_REQUEST,
            format!("user '{}' does not exist", r.user),
        );
    };
    let stdin = match r
        .stdin_b64
        .as_deref()
        .map(|s| base64::engine::general_purpose::STANDARD.decode(s))
    {
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => return http_error(StatusCode::BAD_REQUEST, format!("stdinB64: {e}")),
        None => None,
    };
    agent.network_settled().await;
    let settings = agent.settings();
    let spec = SpawnSpec {
        config: ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), r.cmd.clone()],
            envs: r.envs.clone().into_iter().collect(),
            cwd: r.cwd.clone(),
        },
        tag: r.background.then(|| START_TAG.to_string()),
        pty: None,
        stdin: stdin.is_some(),
        user,
        base_env: settings.env_vars,
        default_cwd: None,
        timeout: (r.timeout_ms > 0).then(|| Duration::from_millis(r.timeout_ms)),
    };
    let (tx, body) = channel_body();
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(body)
        .unwrap_or_else(|_| Response::new(crate::http::full(Bytes::new())));
    let (proc, mut rx) = match agent.procs.spawn(spec) {
        Ok(p) => p,
        Err(e) => {
            let _ = tx.try_send(line(&ExecEvent::Error(e.message)));
            return resp;
        }
    };
    if let Some(input) = stdin {
        let p = proc.clone();
        tokio::spawn(async move {
            if let Err(e) = p.write_input(input).await {
                tracing::warn!(pid = p.pid, error = %e.message, "exec stdin");
            }
            let _ = p.close_input().await;
        });
    }
    if r.background {
        drop(rx);
        tracing::info!(pid = proc.pid, cmd = %r.cmd, "start command running");
        let _ = tx.try_send(line(&ExecEvent::Started(proc.pid)));
        return resp;
    }
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            let out = match ev {
                ProcEvent::Data(Stream::Stderr, b) => {
                    ExecEvent::Stderr(String::from_utf8_lossy(&b).into_owned())
                }
                ProcEvent::Data(_, b) => {
                    ExecEvent::Stdout(String::from_utf8_lossy(&b).into_owned())
                }
                ProcEvent::End {
                    exit_code, status, ..
                } => ExecEvent::Exit {
                    code: exit_code,
                    status,
                },
            };
            let end = matches!(out, ExecEvent::Exit { .. });
            if tx.send(line(&out)).await.is_err() {
                // The host went away: the command is not wanted any more.
                let _ = proc.signal(libc::SIGKILL);
                return;
            }
            if end {
                return;
            }
        }
    });
    resp
}
