//! HTTP upgrades (WebSocket and the like) through the data plane: a request that asks for one keeps
//! its `Connection: upgrade` and `Upgrade` headers on the way to the guest, and once the guest answers
//! 101 the client's connection and the guest's are joined, both ways, until either side closes or
//! neither sends for [`IDLE`]. The node's proxy (`dataplane`) and the gateway's (`gateway::proxy`) share it.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue, header};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// An upgraded connection with no bytes either way for this long is closed.
pub const IDLE: Duration = Duration::from_secs(600);

/// The `Upgrade` protocol a request asks for (its `Connection` names `upgrade`), if any.
pub fn requested(h: &HeaderMap) -> Option<HeaderValue> {
    let asks = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| h.get(header::UPGRADE).cloned()).flatten()
}

/// Puts an upgrade's headers back after the hop-by-hop ones were stripped.
pub fn keep(h: &mut HeaderMap, protocol: HeaderValue) {
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, protocol);
}

/// Joins the client's side of an accepted upgrade to the upstream side, in a task of its own.
pub fn splice(client: OnUpgrade, upstream: OnUpgrade, what: String) {
    tokio::spawn(async move {
        let (c, u) = match tokio::join!(client, upstream) {
            (Ok(c), Ok(u)) => (c, u),
            (c, u) => {
                let e = c
                    .err()
                    .or(u.err())
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                tracing::debug!(%what, error = %e, "upgrade not completed");
                return;
            }
        };
        let since = Arc::new(AtomicU64::new(0));
        let t0 = Instant::now();
        let mut c = Watched::new(TokioIo::new(c), since.clone(), t0);
        let mut u = Watched::new(TokioIo::new(u), since.clone(), t0);
        let idle = async {
            loop {
                let quiet = t0
                    .elapsed()
                    .saturating_sub(Duration::from_millis(since.load(Ordering::Relaxed)));
                if quiet >= IDLE {
                    return;
                }
                tokio::time::sleep(IDLE - quiet).await;
            }
        };
        tokio::select! {
            r = tokio::io::copy_bidirectional(&mut c, &mut u) => match r {
                Ok((up, down)) => tracing::debug!(%what, up, down, "upgraded connection closed"),
                Err(e) => tracing::debug!(%what, error = %e, "upgraded connection ended"),
            },
            () = idle => tracing::debug!(%what, idle_s = IDLE.as_secs(), "upgraded connection idle; closed"),
        }
    });
}

/// An I/O object that records when it last moved bytes (ms since `t0`).
struct Watched<T> {
    io: T,
    last: Arc<AtomicU64>,
    t0: Instant,
}

impl<T> Watched<T> {
    fn new(io: T, last: Arc<AtomicU64>, t0: Instant) -> Self {
        Watched { io, last, t0 }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn only_a_connection_naming_upgrade_asks_for_one() {
        let ws = headers(&[
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
        ]);
        assert_eq!(requested(&ws).unwrap(), "websocket");
        assert!(requested(&headers(&[("upgrade", "websocket")])).is_none());
        assert!(requested(&headers(&[("connection", "upgrade")])).is_none());
        assert!(requested(&headers(&[("connection", "close"), ("upgrade", "h2c")])).is_none());
        let mut stripped = HeaderMap::new();
        keep(&mut stripped, HeaderValue::from_static("websocket"));
        assert_eq!(requested(&stripped).unwrap(), "websocket");
    }
}
