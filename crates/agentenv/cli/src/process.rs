//! Running commands in a sandbox through envd's `process.Process` service: `exec` (plain
//! pipes) and an interactive shell on a PTY with the local terminal in raw mode.

use std::io::Write;

use anyhow::{Context, bail};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::client::{ApiClient, SandboxTarget};

fn b64(v: &Value) -> Vec<u8> {
    v.as_str()
        .and_then(|s| B64.decode(s).ok())
        .unwrap_or_default()
}

/// Output of one command.
pub struct ExecOutput {
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `bash -l -c <cmd>` as `user`, streaming output to our stdout/stderr when `echo` is set.
pub async fn exec(
    api: &ApiClient,
    t: &SandboxTarget,
    cmd: &str,
    user: Option<&str>,
    echo: bool,
) -> anyhow::Result<ExecOutput> {
    let msg = json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": false});
    let mut stream = api
        .rpc_stream_as(t, "/process.Process/Start", &msg, user)
        .await?;
    let mut out = ExecOutput {
        exit_code: -1,
        stdout: Vec::new(),
        stderr: Vec::new(),
    };
    let mut ended = false;
    while let Some(m) = stream.next().await? {
        let ev = &m["event"];
        if let Some(d) = ev.get("data") {
            if let Some(s) = d.get("stdout") {
                let bytes = b64(s);
                if echo {
                    std::io::stdout().write_all(&bytes)?;
                    std::io::stdout().flush()?;
                }
                out.stdout.extend(bytes);
            }
            if let Some(s) = d.get("stderr") {
                let bytes = b64(s);
                if echo {
                    std::io::stderr().write_all(&bytes)?;
                }
                out.stderr.extend(bytes);
            }
        } else if let Some(end) = ev.get("end") {
            out.exit_code = end.get("exitCode").and_then(Value::as_i64).unwrap_or(0) as i32;
            ended = true;
        }
    }
    if !ended {
        bail!("command stream ended without an end event");
    }
    Ok(out)
}

/// Terminal size of our stdin (cols, rows), 80x24 when unknown.
fn term_size() -> (u16, u16) {
    // SAFETY: TIOCGWINSZ writes one `winsize` into the zeroed struct we pass.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::ioctl(libc::STDIN_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col > 0 {
        (ws.ws_col, ws.ws_row)
    } else {
        (80, 24)
    }
}

/// Puts stdin into raw mode; restores the old settings when dropped.
struct RawMode(Option<libc::termios>);

impl RawMode {
    fn enter() -> RawMode {
        // SAFETY: tcgetattr fills the zeroed termios; cfmakeraw/tcsetattr only read our copy.
        unsafe {
            if libc::isatty(libc::STDIN_FILENO) != 1 {
                return RawMode(None);
            }
            let mut old: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(libc::STDIN_FILENO, &mut old) != 0 {
                return RawMode(None);
            }
            let mut raw = old;
            libc::cfmakeraw(&mut raw);
            libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &raw);
            RawMode(Some(old))
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(old) = self.0 {
            // SAFETY: restores the settings read in `enter`.
            unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &old) };
        }
    }
}

/// An interactive login shell on a PTY in the sandbox; returns the shell's exit code.
pub async fn shell(api: &ApiClient, t: &SandboxTarget, user: Option<&str>) -> anyhow::Result<i32> {
    let (cols, rows) = term_size();
    let term = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into());
    let msg = json!({
        "process": {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": {"TERM": term}},
        "pty": {"size": {"cols": cols, "rows": rows}},
        "stdin": true,
    });
    let mut stream = api
        .rpc_stream_as(t, "/process.Process/Start", &msg, user)
        .await?;
    let first = stream
        .next()
        .await?
        .context("shell stream ended before it started")?;
    let pid = first["event"]["start"]["pid"]
        .as_u64()
        .context("first stream message is not a start event")?;
    let _raw = RawMode::enter();

    let (api_in, t_in) = (api.clone(), t.clone());
    let input = tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut buf = vec![0u8; 4096];
        loop {
            let n = match stdin.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let msg = json!({"process": {"pid": pid}, "input": {"pty": B64.encode(&buf[..n])}});
            if api_in
                .rpc(&t_in, "/process.Process/SendInput", &msg)
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let (api_rs, t_rs) = (api.clone(), t.clone());
    let resize = tokio::spawn(async move {
        let Ok(mut winch) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        else {
            return;
        };
        while winch.recv().await.is_some() {
            let (cols, rows) = term_size();
            let msg =
                json!({"process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}});
            let _ = api_rs.rpc(&t_rs, "/process.Process/Update", &msg).await;
        }
    });

    let mut code = 0;
    let mut stdout = std::io::stdout();
    while let Some(m) = stream.next().await? {
        let ev = &m["event"];
        if let Some(p) = ev.get("data").and_then(|d| d.get("pty")) {
            stdout.write_all(&b64(p))?;
            stdout.flush()?;
        } else if let Some(end) = ev.get("end") {
            code = end.get("exitCode").and_then(Value::as_i64).unwrap_or(0) as i32;
        }
    }
    input.abort();
    resize.abort();
    Ok(code)
}

impl ApiClient {
    /// [`ApiClient::rpc_stream`] as an OS user (`Authorization: Basic base64("<user>:")`).
    pub async fn rpc_stream_as(
        &self,
        t: &SandboxTarget,
        path: &str,
        msg: &Value,
        user: Option<&str>,
    ) -> anyhow::Result<crate::client::ConnectStream> {
        self.rpc_stream_with_user(
            t,
            path,
            msg,
            user.map(|u| format!("Basic {}", B64.encode(format!("{u}:")))),
        )
        .await
    }
}
