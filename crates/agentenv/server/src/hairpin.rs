//! The egress proxy of a server: its CA in the state folder, and the hairpin through which guests
//! reach the sandbox domain (`<port>-<sandbox id>.<domain>`) by the server's own router, as clients
//! outside do.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use agentenv_egress::{Ca, Hairpin, Proxy};
use anyhow::Context;
use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::TokioIo;
use tower::ServiceExt;

/// The proxy of the server with state folder `state_dir`; with a sandbox domain (`host[:port]`),
/// its names are served by the router `app` holds once the server has built it.
pub fn proxy(
    state_dir: &Path,
    sandbox_domain: Option<&str>,
    app: Arc<OnceLock<Router>>,
) -> anyhow::Result<Arc<Proxy>> {
    let dir = state_dir.join("egress-ca");
    let ca =
        Ca::load_or_create(&dir).with_context(|| format!("the egress CA in {}", dir.display()))?;
    let proxy = Proxy::new(Arc::new(ca), &[]).context("the egress proxy's TLS settings")?;
    Ok(Arc::new(match sandbox_domain {
        Some(d) => {
            let host = d.rsplit_once(':').map_or(d, |(h, _)| h);
            proxy.with_hairpin(host, hairpin(app))
        }
        None => proxy,
    }))
}

/// Serves each pipe as an HTTP/1 connection to the router (closed at once before it exists).
fn hairpin(app: Arc<OnceLock<Router>>) -> Hairpin {
    Arc::new(move |io| {
        let Some(router) = app.get().cloned() else {
            return;
        };
        tokio::spawn(async move {
            let conn = agentenv_api::conn::Conn::new(SocketAddr::from(([0, 0, 0, 0], 0)));
            let svc = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(ConnectInfo(conn.clone()));
                    router.clone().oneshot(req)
                },
            );
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), svc)
                .with_upgrades()
                .await
            {
                tracing::debug!(error = %e, "hairpin connection ended");
            }
        });
    })
}
