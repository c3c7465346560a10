//! Test harness: runs the real `agentenv-guest serve` binary and talks HTTP/1.1 to it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};

/// A running `agentenv-guest serve` on a unix socket (plain HTTP or mux).
pub struct Guest {
    child: Child,
    pub sock: PathBuf,
    pub dir: tempfile::TempDir,
    pub mux: bool,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Random lowercase hex.
pub fn token() -> String {
    format!("{:016x}", rand::random::<u64>())
}

pub fn random_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random()).collect()
}

impl Guest {
    /// Starts a guest serving plain HTTP/1.1 on a unix socket.
    pub async fn start(extra: &[&str]) -> Guest {
        Guest::spawn(extra, false).await
    }

    /// Starts a guest whose unix socket carries mux sessions.
    pub async fn start_mux(extra: &[&str]) -> Guest {
        Guest::spawn(extra, true).await
    }

    async fn spawn(extra: &[&str], mux: bool) -> Guest {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("envd.sock");
        let scheme = if mux { "mux-unix" } else { "unix" };
        let child = Command::new(env!("CARGO_BIN_EXE_agentenv-guest"))
            .arg("serve")
            .arg("--listen")
            .arg(format!("{scheme}:{}", sock.display()))
            .args(extra)
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("spawning agentenv-guest");
        let g = Guest {
            child,
            sock,
            dir,
            mux,
        };
        // The socket file appears at bind, before the agent listens: ready once a connect succeeds.
        for _ in 0..500 {
            if tokio::net::UnixStream::connect(&g.sock).await.is_ok() {
                return g;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("agentenv-guest did not listen on {}", g.sock.display());
    }

    /// Sends one request on a fresh connection; returns status, headers and the body.
    pub async fn send(&self, req: Request<Full<Bytes>>) -> http::Response<Incoming> {
        let stream = tokio::net::UnixStream::connect(&self.sock).await.unwrap();
        if self.mux {
            // The stream keeps the session's tasks alive after `session` is dropped.
            let session = agentenv_mux::Session::client(stream);
            let s = session.open().await.unwrap();
            send_on(s, req).await
        } else {
            send_on(stream, req).await
        }
    }

    /// POST a unary Connect call; returns (status, JSON body).
    pub async fn unary(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.unary_as(path, body, &[]).await
    }

    pub async fn unary_as(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value) {
        let mut b = Request::post(path).header("content-type", "application/json");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .send(b.body(Full::new(Bytes::from(body.to_string()))).unwrap())
            .await;
        let status = resp.status();
        assert_eq!(resp.headers()["content-type"], "application/json");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    /// Opens a server-streaming Connect call.
    pub async fn stream(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> EnvelopeReader {
        let resp = self.stream_raw(path, body, headers).await;
        assert_eq!(resp.status(), StatusCode::OK, "stream {path} failed");
        assert_eq!(resp.headers()["content-type"], "application/connect+json");
        EnvelopeReader {
            body: resp.into_body(),
            buf: Vec::new(),
        }
    }

    /// A server-streaming call that fails: HTTP 200 and one end-of-stream message; its `error`.
    pub async fn stream_error(&self, path: &str, body: Value) -> Value {
        let resp = self.stream_raw(path, body, &[]).await;
        assert_eq!(resp.status(), StatusCode::OK, "stream {path}");
        assert_eq!(resp.headers()["content-type"], "application/connect+json");
        let mut r = EnvelopeReader::new(resp.into_body());
        let (flags, v) = r.next().await.expect("no end of stream");
        assert_eq!(flags, 2, "{v}");
        assert!(r.next().await.is_none(), "data after end of stream");
        v["error"].clone()
    }

    pub async fn stream_raw(
        &self,
        path: &str,
        body: Value,
        headers: &[(&str, &str)],
    ) -> http::Response<Incoming> {
        let mut b = Request::post(path).header("content-type", "application/connect+json");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        self.send(b.body(Full::new(envelope(0, &body))).unwrap())
            .await
    }
}

pub async fn send_on<IO>(io: IO, req: Request<Full<Bytes>>) -> http::Response<Incoming>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .unwrap();
    tokio::spawn(conn);
    sender.send_request(req).await.unwrap()
}

/// One Connect envelope.
pub fn envelope(flags: u8, v: &Value) -> Bytes {
    let body = serde_json::to_vec(v).unwrap();
    let mut out = vec![flags];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out.into()
}

/// Reads Connect envelopes from a streaming response.
pub struct EnvelopeReader {
    body: Incoming,
    buf: Vec<u8>,
}

impl EnvelopeReader {
    pub fn new(body: Incoming) -> EnvelopeReader {
        EnvelopeReader {
            body,
            buf: Vec::new(),
        }
    }

    /// Next envelope `(flags, json)`; `None` at the end of the body.
    pub async fn next(&mut self) -> Option<(u8, Value)> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    let v = serde_json::from_slice(&self.buf[5..5 + len]).unwrap();
                    self.buf.drain(..5 + len);
                    return Some((flags, v));
                }
            }
            match self.body.frame().await {
                None => {
                    assert!(self.buf.is_empty(), "partial envelope at end of body");
                    return None;
                }
                Some(f) => {
                    if let Ok(d) = f.unwrap().into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }

    /// Next non-keepalive message (flag 0); panics on end of stream.
    pub async fn message(&mut self) -> Value {
        loop {
            let (flags, v) = self.next().await.expect("stream ended early");
            assert_eq!(flags, 0, "unexpected end of stream: {v}");
            if v.pointer("/event/keepalive").is_none() && v.get("keepalive").is_none() {
                return v;
            }
        }
    }

    /// Collects a process stream to its end: (stdout, stderr, pty, end event, end-of-stream JSON).
    pub async fn collect_process(&mut self) -> ProcessOutput {
        let mut out = ProcessOutput::default();
        while let Some((flags, v)) = self.next().await {
            if flags & 2 != 0 {
                out.eos = Some(v);
                assert!(self.next().await.is_none(), "data after end of stream");
                break;
            }
            let ev = &v["event"];
            if let Some(d) = ev.get("data") {
                for (key, sink) in [
                    ("stdout", &mut out.stdout),
                    ("stderr", &mut out.stderr),
                    ("pty", &mut out.pty),
                ] {
                    if let Some(s) = d.get(key).and_then(Value::as_str) {
                        sink.extend(b64(s));
                    }
                }
            } else if let Some(e) = ev.get("end") {
                assert!(out.end.is_none(), "two end events");
                out.end = Some(e.clone());
            } else if ev.get("start").is_some() {
                panic!("second start event");
            }
        }
        out
    }
}

#[derive(Default, Debug)]
pub struct ProcessOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub pty: Vec<u8>,
    pub end: Option<Value>,
    pub eos: Option<Value>,
}

pub fn b64(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

pub fn to_b64(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// Start request for `bash -c <script>`.
pub fn bash(script: &str) -> Value {
    serde_json::json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}, "stdin": false})
}

/// Reads the mandatory first `start` event and returns the pid.
pub async fn expect_start(r: &mut EnvelopeReader) -> u32 {
    let first = r.message().await;
    first["event"]["start"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("first message is not start: {first}")) as u32
}
