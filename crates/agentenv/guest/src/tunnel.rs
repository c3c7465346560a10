//! `CONNECT 127.0.0.1:<port>` for the host: a raw tunnel to a TCP port on the guest's loopback
//! (see `agentenv_envd::tunnel_request`), so the data plane reaches servers in the sandbox.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::http::{Body, full, http_error};

/// Longest wait for the guest port to accept.
const CONNECT_DEADLINE: Duration = Duration::from_secs(5);

/// Serves one CONNECT: only `127.0.0.1:<port>` (or `localhost:<port>`) of this guest.
pub async fn connect(req: Request<Incoming>) -> Response<Body> {
    let Some(port) = req
        .uri()
        .authority()
        .filter(|a| matches!(a.host(), "127.0.0.1" | "localhost"))
        .and_then(|a| a.port_u16())
    else {
        return http_error(
            StatusCode::BAD_REQUEST,
            "CONNECT takes 127.0.0.1:<port> of this guest only",
        );
    };
    let tcp = match tokio::time::timeout(
        CONNECT_DEADLINE,
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            return http_error(
                StatusCode::BAD_GATEWAY,
                format!("port is not open: {port}: {e}"),
            );
        }
        Err(_) => {
            return http_error(
                StatusCode::BAD_GATEWAY,
                format!("port is not open: {port}: no answer"),
            );
        }
    };
    tokio::spawn(async move {
        match hyper::upgrade::on(req).await {
            Ok(up) => {
                let mut up = hyper_util::rt::TokioIo::new(up);
                let mut tcp = tcp;
                if let Err(e) = tokio::io::copy_bidirectional(&mut up, &mut tcp).await {
                    tracing::debug!(port, error = %e, "tunnel ended");
                }
            }
            Err(e) => tracing::warn!(port, error = %e, "tunnel upgrade failed"),
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .body(full(Bytes::new()))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}
