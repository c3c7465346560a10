//! HTTP client for the agentenv (E2B-compatible) API: control plane with the API key, envd
//! (data plane) with the sandbox's access token, Connect-RPC JSON streaming.

use anyhow::{Context, bail};
use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// The envd port every sandbox exposes.
const ENVD_PORT: &str = "49983";

/// A connection to one agentenv server.
#[derive(Clone)]
pub struct ApiClient {
    base: String,
    api_key: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

/// What envd requests need to reach one sandbox.
#[derive(Clone, Debug)]
pub struct SandboxTarget {
    pub id: String,
    pub access_token: String,
}

impl ApiClient {
    pub fn new(base: &str, api_key: &str) -> Self {
        ApiClient {
            base: base.trim_end_matches('/').to_string(),
            api_key: api_key.to_string(),
            http: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    async fn send(&self, req: Request<Full<Bytes>>) -> anyhow::Result<Response<Incoming>> {
        let uri = req.uri().clone();
        self.http
            .request(req)
            .await
            .with_context(|| format!("request to {uri} failed (is the server running?)"))
    }

    /// A control-plane call; returns status and parsed JSON (Null for empty bodies).
    /// Errors carry the server's `{code, message}`.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<(StatusCode, Value)> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("X-API-KEY", &self.api_key);
        let bytes = match body {
            Some(v) => {
                b = b.header("Content-Type", "application/json");
                Bytes::from(serde_json::to_vec(&v)?)
            }
            None => Bytes::new(),
        };
        let resp = self.send(b.body(Full::new(bytes))?).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        let json = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).unwrap_or(Value::Null)
        };
        if !status.is_success() {
            let msg = json
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            bail!("server answered {status}: {msg}");
        }
        Ok((status, json))
    }

    /// A control-plane call answered with JSON lines (`Accept: application/x-ndjson`): `on_line` gets
    /// each line as it arrives. A non-2xx answer is an error with the server's message.
    pub async fn call_lines(
        &self,
        method: Method,
        path: &str,
        body: Value,
        mut on_line: impl FnMut(Value),
    ) -> anyhow::Result<()> {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("X-API-KEY", &self.api_key)
            .header("Content-Type", "application/json")
            .header("Accept", "application/x-ndjson")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body)?)))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body.collect().await?.to_bytes();
            let json: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let msg = json
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            bail!("server answered {status}: {msg}");
        }
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                buf.extend_from_slice(&data);
            }
            for v in complete_lines(&mut buf)? {
                on_line(v);
            }
        }
        if !buf.is_empty() {
            bail!(
                "the answer ended inside a line: {:?}",
                String::from_utf8_lossy(&buf)
            );
        }
        Ok(())
    }

    /// `PUT` of raw bytes (a build's COPY archive).
    pub async fn put_bytes(&self, path: &str, bytes: Vec<u8>) -> anyhow::Result<()> {
        let req = Request::builder()
            .method(Method::PUT)
            .uri(format!("{}{path}", self.base))
            .header("X-API-KEY", &self.api_key)
            .header("Content-Type", "application/octet-stream")
            .body(Full::new(Bytes::from(bytes)))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!(
                "server answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(())
    }

    /// A control-plane GET that also returns one response header.
    pub async fn call_with_header(
        &self,
        method: Method,
        path: &str,
        name: &str,
    ) -> anyhow::Result<(Value, Option<String>)> {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("X-API-KEY", &self.api_key)
            .body(Full::new(Bytes::new()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let header = resp
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_string);
        let body = resp.into_body().collect().await?.to_bytes();
        let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if !status.is_success() {
            bail!(
                "server answered {status}: {}",
                json.get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("no message")
            );
        }
        Ok((json, header))
    }

    /// The sandbox's id and envd access token (from `GET /sandboxes/{id}`).
    pub async fn target(&self, id: &str) -> anyhow::Result<SandboxTarget> {
        let (_, detail) = self
            .call(Method::GET, &format!("/sandboxes/{id}"), None)
            .await?;
        let token = detail
            .get("envdAccessToken")
            .and_then(Value::as_str)
            .context("detail without envdAccessToken")?;
        Ok(SandboxTarget {
            id: id.to_string(),
            access_token: token.to_string(),
        })
    }

    fn envd_request(
        &self,
        t: &SandboxTarget,
        path: &str,
        content_type: &str,
    ) -> hyper::http::request::Builder {
        Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.base))
            .header("E2b-Sandbox-Id", &t.id)
            .header("E2b-Sandbox-Port", ENVD_PORT)
            .header("X-Access-Token", &t.access_token)
            .header("Content-Type", content_type)
            .header("Connect-Protocol-Version", "1")
    }

    /// A unary Connect-RPC call to envd (`/process.Process/SendInput` etc).
    pub async fn rpc(&self, t: &SandboxTarget, path: &str, msg: &Value) -> anyhow::Result<Value> {
        let req = self
            .envd_request(t, path, "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(msg)?)))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if !status.is_success() {
            bail!(
                "{path}: {status}: {}",
                json.get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("no message")
            );
        }
        Ok(json)
    }

    /// A server-streaming Connect-RPC call; returns a reader of its messages.
    /// `authorization` selects the OS user (`Basic base64("<user>:")`).
    pub async fn rpc_stream_with_user(
        &self,
        t: &SandboxTarget,
        path: &str,
        msg: &Value,
        authorization: Option<String>,
    ) -> anyhow::Result<ConnectStream> {
        let mut env = BytesMut::new();
        let json = serde_json::to_vec(msg)?;
        env.extend_from_slice(&[0]);
        env.extend_from_slice(&(json.len() as u32).to_be_bytes());
        env.extend_from_slice(&json);
        let mut req = self
            .envd_request(t, path, "application/connect+json")
            .header("Keepalive-Ping-Interval", "50");
        if let Some(a) = authorization {
            req = req.header("Authorization", a);
        }
        let req = req.body(Full::new(env.freeze()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.into_body().collect().await?.to_bytes();
            bail!("{path}: {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(ConnectStream {
            body: resp.into_body(),
            buf: BytesMut::new(),
        })
    }
}

/// Messages of a Connect server stream (5-byte envelopes; flag 2 ends the stream).
pub struct ConnectStream {
    body: Incoming,
    buf: BytesMut,
}

impl ConnectStream {
    /// The next message, or `None` at a clean end of stream. An end-of-stream error is an `Err`.
    pub async fn next(&mut self) -> anyhow::Result<Option<Value>> {
        loop {
            if self.buf.len() >= 5 {
                let flag = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let payload = self.buf.split_to(len);
                    let v: Value =
                        serde_json::from_slice(&payload).context("stream message is not JSON")?;
                    if flag & 2 != 0 {
                        if let Some(err) = v.get("error") {
                            bail!("stream ended with error: {err}");
                        }
                        return Ok(None);
                    }
                    return Ok(Some(v));
                }
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                None if self.buf.is_empty() => return Ok(None),
                None => bail!("stream cut inside a message"),
            }
        }
    }
}

/// Takes the complete JSON lines out of `buf`, leaving a partial last line there.
fn complete_lines(buf: &mut BytesMut) -> anyhow::Result<Vec<Value>> {
    let mut out = vec![];
    while let Some(end) = buf.iter().position(|&b| b == b'\n') {
        let line = buf.split_to(end + 1);
        out.push(serde_json::from_slice(&line[..end]).with_context(|| {
            format!("a bad progress line: {:?}", String::from_utf8_lossy(&line))
        })?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines split across frames anywhere come out whole and in order; a bad line is an error.
    #[test]
    fn json_lines_survive_any_framing() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64;
        let want: Vec<Value> = (0..20u64)
            .map(|i| serde_json::json!({"step": "pull", "bytesDone": i * (seed % 1000)}))
            .collect();
        let text: String = want.iter().map(|v| format!("{v}\n")).collect();
        let bytes = text.as_bytes();
        let (mut buf, mut got) = (BytesMut::new(), vec![]);
        let mut at = 0;
        let mut step = seed;
        while at < bytes.len() {
            step = step
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = (1 + (step >> 60) as usize).min(bytes.len() - at);
            buf.extend_from_slice(&bytes[at..at + n]);
            at += n;
            got.extend(complete_lines(&mut buf).unwrap());
        }
        assert_eq!(got, want);
        assert!(buf.is_empty());
        buf.extend_from_slice(b"{\"step\": \"boot\"}\nnot json\n");
        assert!(complete_lines(&mut buf).is_err());
    }
}
