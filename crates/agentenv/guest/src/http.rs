//! envd's HTTP toolkit: bodies (whole or streamed), JSON and error answers, bounded reads, query
//! strings and the request's user.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use base64::Engine;
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::Agent;
use crate::envd::{Code, RpcError};
use crate::users::{self, User};

/// Response body of every route.
pub type Body = BoxBody<Bytes, std::io::Error>;

/// Largest unary request body (JSON) accepted.
pub const MAX_JSON_BODY: usize = 8 << 20;

/// A body fed from a channel: every chunk is flushed as soon as it is sent.
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// A streaming body and the sender that feeds it.
pub fn channel_body() -> (mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = mpsc::channel(64);
    (tx, ChannelBody { rx }.boxed())
}

/// A complete body.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed()
}

/// `status` + JSON body.
pub fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(full(serde_json::to_vec(v).unwrap_or_default()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

/// Plain-endpoint error: `{"code": <int>, "message": "..."}`.
pub fn http_error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(
        status,
        &json!({"code": status.as_u16(), "message": message.into()}),
    )
}

/// Unary Connect error response.
pub fn rpc_error(e: &RpcError) -> Response<Body> {
    let status =
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &e.to_json())
}

/// Reads a whole request body, failing with `resource_exhausted` above `max` bytes.
pub async fn read_body(body: Incoming, max: usize) -> Result<Bytes, RpcError> {
    let limited = http_body_util::Limited::new(body, max);
    limited.collect().await.map(|c| c.to_bytes()).map_err(|e| {
        RpcError::new(
            Code::ResourceExhausted,
            format!("reading request body: {e}"),
        )
    })
}

/// Query parameters (percent-decoded).
pub fn query_params(uri: &http::Uri) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for pair in uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|s| !s.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(percent_decode(k), percent_decode(v));
    }
    out
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(v)) => {
                out.push(v);
                i += 2;
            }
            (c, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The user a request acts as: `Authorization: Basic base64(user:)`, else `username`, else
/// the default user.
pub fn request_user(
    agent: &Agent,
    headers: &HeaderMap,
    username: Option<&str>,
) -> Result<User, RpcError> {
    let from_header = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Basic ")
                .or_else(|| v.strip_prefix("basic "))
        })
        .and_then(|b64| {
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .ok()
        })
        .map(|raw| {
            let s = String::from_utf8_lossy(&raw).into_owned();
            s.split_once(':').map(|(u, _)| u.to_string()).unwrap_or(s)
        })
        .filter(|u| !u.is_empty());
    let name = from_header
        .or_else(|| username.filter(|u| !u.is_empty()).map(str::to_string))
        .unwrap_or_else(|| agent.settings().default_user);
    users::lookup(&name).ok_or_else(|| {
        RpcError::new(
            Code::Unauthenticated,
            format!("user '{name}' does not exist"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let uri: http::Uri = "/files?path=%2Fhome%2Fa%20b.txt&username=root&x"
            .parse()
            .unwrap();
        let q = query_params(&uri);
        assert_eq!(q["path"], "/home/a b.txt");
        assert_eq!(q["username"], "root");
        assert_eq!(q["x"], "");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
