//! Client connections of the API's listeners. Each carries a flag that a data-plane answer sets when
//! its body is cut upstream (the sandbox died under a streaming command): the connection then ends with
//! a TCP reset instead of a clean close, as E2B's proxy resets its HTTP/2 stream. Over HTTP/1.1 a clean
//! close after a cut chunked body reads as a protocol error; a reset reads as the transport failure it
//! is, after which the SDK asks whether the sandbox is gone (and says so).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The tenant a gateway asserts for a request it forwards (its name), in place of the client's key:
/// taken only on a connection with a gateway's certificate ([`Conn::gateway`]).
pub const TENANT_HEADER: &str = "x-agentenv-tenant";

/// One client connection, as handlers see it (`ConnectInfo<Conn>`).
#[derive(Debug, Clone)]
pub struct Conn {
    pub remote: SocketAddr,
    /// The client showed a gateway's certificate (`agentenv_cluster::node_tls::is_gateway`): it may
    /// assert the tenant of its requests ([`TENANT_HEADER`]).
    pub gateway: bool,
    /// The connection is TLS (`--tls-cert`): URLs the server hands out for it are `https`.
    pub tls: bool,
    cut: Arc<AtomicBool>,
}

impl Conn {
    /// The connection of the client at `remote` (a listener's own address, for `local_addr`).
    pub fn new(remote: SocketAddr) -> Conn {
        Conn {
            remote,
            gateway: false,
            tls: false,
            cut: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Ends the connection with a reset once its server lets go of it.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }
}

/// A listener whose connections are [`Conn`]s: serving with `into_make_service_with_connect_info::<Conn>`
/// hands each request its connection.
pub trait ConnListener: axum::serve::Listener<Addr = Conn> {}

impl<L: ConnListener> Connected<IncomingStream<'_, L>> for Conn {
    fn connect_info(stream: IncomingStream<'_, L>) -> Conn {
        stream.remote_addr().clone()
    }
}

/// `body`, marking `conn` cut when it fails (the upstream it streams from broke off).
pub fn cut_on_error(body: Body, conn: Option<Conn>) -> Body {
    match conn {
        Some(c) => Body::new(body.map_err(move |e| {
            c.cut();
            e
        })),
        None => body,
    }
}

/// A TCP connection that closes with a reset (`SO_LINGER` 0, no FIN first) once its [`Conn`] is cut.
pub struct CutStream {
    tcp: TcpStream,
    cut: Arc<AtomicBool>,
}

impl CutStream {
    /// `tcp` of the client at `remote`, and the [`Conn`] that can cut it.
    pub fn new(tcp: TcpStream, remote: SocketAddr) -> (CutStream, Conn) {
        let conn = Conn::new(remote);
        let s = CutStream {
            tcp,
            cut: conn.cut.clone(),
        };
        (s, conn)
    }

    fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Relaxed)
    }
}

impl Drop for CutStream {
    fn drop(&mut self) {
        if self.is_cut() {
            let linger = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: setsockopt(2) on a socket this value owns, with a pointer to a live struct.
            unsafe {
                libc::setsockopt(
                    self.tcp.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&raw const linger).cast(),
                    size_of::<libc::linger>() as libc::socklen_t,
                );
            }
        }
    }
}

impl AsyncRead for CutStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for CutStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // A cut connection sends no FIN: the reset at drop is its end.
        if self.is_cut() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

/// The plain-HTTP listener of the API: connections as [`CutStream`]s, addressed by [`Conn`].
pub struct Listener {
    tcp: TcpListener,
}

impl Listener {
    pub fn new(tcp: TcpListener) -> Listener {
        Listener { tcp }
    }
}

impl axum::serve::Listener for Listener {
    type Io = CutStream;
    type Addr = Conn;

    async fn accept(&mut self) -> (CutStream, Conn) {
        loop {
            match self.tcp.accept().await {
                Ok((s, remote)) => {
                    let _ = s.set_nodelay(true);
                    return CutStream::new(s, remote);
                }
                Err(e) => {
                    // Out of descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Conn> {
        self.tcp.local_addr().map(Conn::new)
    }
}

impl ConnListener for Listener {}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A cut connection ends with a reset, an uncut one with a clean close; both after their bytes.
    #[tokio::test]
    async fn a_cut_connection_ends_with_a_reset() {
        for cut in [false, true] {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let payload = rand::random::<[u8; 16]>();
            let server = tokio::spawn(async move {
                let (s, remote) = l.accept().await.unwrap();
                let (mut s, conn) = CutStream::new(s, remote);
                s.write_all(&payload).await.unwrap();
                s.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
                if cut {
                    conn.cut();
                }
                s.shutdown().await.unwrap();
            });
            let mut c = TcpStream::connect(addr).await.unwrap();
            let mut got = [0u8; 16];
            c.read_exact(&mut got).await.unwrap();
            assert_eq!(got, payload);
            server.await.unwrap();
            let mut rest = Vec::new();
            let end = c.read_to_end(&mut rest).await;
            match cut {
                true => assert_eq!(
                    end.map_err(|e| e.kind()),
                    Err(std::io::ErrorKind::ConnectionReset)
                ),
                false => assert_eq!(end.unwrap(), 0),
            }
        }
    }
}
