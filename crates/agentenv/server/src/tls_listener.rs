//! HTTPS for a node's API (`agentenv serve --tls-cert --tls-key`, see `agentenv_cluster::node_tls`):
//! an axum listener whose connections arrive after their TLS handshake. Handshakes run in tasks of
//! their own, at most [`MAX_HANDSHAKES`] at once and each within [`HANDSHAKE_DEADLINE`], so a slow or
//! silent client holds up no other.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentenv_api::conn::{Conn, CutStream};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// Longest a TLS handshake may take.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Most handshakes in flight; further connections wait in the kernel's backlog.
pub const MAX_HANDSHAKES: usize = 256;

/// Connections of `tcp`, each once its handshake with `cfg` is done.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<CutStream>, Conn)>,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, cfg: Arc<rustls::ServerConfig>) -> std::io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(cfg);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            while !tx.is_closed() {
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    return;
                };
                let (sock, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: wait, do not spin.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = sock.set_nodelay(true);
                let (sock, mut conn) = CutStream::new(sock, peer);
                let (tx, acceptor) = (tx.clone(), acceptor.clone());
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(sock)).await {
                        Ok(Ok(s)) => {
                            conn.gateway = agentenv_cluster::node_tls::is_gateway(s.get_ref().1);
                            conn.tls = true;
                            let _ = tx.send((s, conn)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<CutStream>;
    type Addr = Conn;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Conn> {
        Ok(Conn::new(self.local))
    }
}

impl agentenv_api::conn::ConnListener for TlsListener {}
