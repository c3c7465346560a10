//! The egress proxy's side in a slot: the listener on the gateway that the namespace's rules
//! redirect to, each connection's original destination, and connections out that start in the
//! namespace (so the sandbox's egress rules hold for them too). The proxy itself is
//! `agentenv_egress`.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::{Arc, RwLock};

use agentenv_egress::{Dialer, Flow, Proxy};
use tokio::sync::Semaphore;

use super::policy::EgressPolicy;
use super::slot::{self, SlotAddrs};

/// Connections of one sandbox through the proxy at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 256;

/// The destination a redirected connection had (`SO_ORIGINAL_DST`).
fn original_dst(s: &tokio::net::TcpStream) -> std::io::Result<SocketAddrV4> {
    const SO_ORIGINAL_DST: libc::c_int = 80;
    // SAFETY: sockaddr_in is plain data; getsockopt writes at most `len` bytes into it.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a valid socket, a buffer of `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&raw mut addr).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    ))
}

/// Connections from slot `a`'s namespace.
fn dialer(a: SlotAddrs) -> Dialer {
    Arc::new(move |to| {
        Box::pin(async move {
            let sock = tokio::task::spawn_blocking(move || slot::tcp_socket(&a))
                .await
                .map_err(std::io::Error::other)?
                .map_err(std::io::Error::other)?;
            tokio::net::TcpSocket::from_std_stream(sock)
                .connect(to.into())
                .await
        })
    })
}

/// Serves the guest's redirected connections on `listener` under the current `policy` until the
/// task is aborted (the slot is released).
pub fn serve(
    a: SlotAddrs,
    listener: std::net::TcpListener,
    policy: Arc<RwLock<EgressPolicy>>,
    proxy: Arc<Proxy>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let dial = dialer(a);
    Ok(tokio::spawn(async move {
        loop {
            let Ok((s, peer)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            if peer.ip() != std::net::IpAddr::V4(a.guest) {
                continue;
            }
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                tracing::debug!(netns = %a.netns(), "egress proxy: too many connections");
                continue;
            };
            let original = match original_dst(&s) {
                Ok(o) => o,
                Err(e) => {
                    tracing::debug!(error = %e, "egress proxy: no original destination");
                    continue;
                }
            };
            let flow = Flow {
                original,
                to_gateway: *original.ip() == a.gateway,
            };
            let p = policy.read().unwrap_or_else(|e| e.into_inner()).clone();
            let (proxy, dial) = (proxy.clone(), dial.clone());
            tokio::spawn(async move {
                let _permit = permit;
                if let Err(e) = proxy.handle(s, flow, p, dial).await {
                    tracing::debug!(to = %original, error = %e, "egress proxy connection ended");
                }
            });
        }
    }))
}
