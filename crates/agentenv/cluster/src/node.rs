//! Node registration: a lease, a record under it refreshed every `interval`, and keepalives.
//!
//! When etcd is away the loop keeps trying (each call under the store's deadline); when the lease is
//! gone (etcd forgot it, or the node was away longer than the TTL) a new one is granted and the record
//! written again. Stopping revokes the lease, so the node leaves at once instead of after the TTL.

use std::sync::Arc;
use std::time::Duration;

use crate::schema::NodeRecord;
use crate::store::ClusterStore;

/// Default lease TTL of a node.
pub const DEFAULT_TTL: Duration = Duration::from_secs(6);
/// Default refresh interval (a third of the TTL: two refreshes may fail before the node expires).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(2);

/// What a node reports about itself at each refresh.
pub type Report = Arc<dyn Fn() -> NodeRecord + Send + Sync>;

/// A running registration; dropping it stops refreshing (the record then expires with the lease).
pub struct Registration {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Registration {
    /// Starts registering: the first record is written before this returns, or the error says why not.
    pub async fn start(
        store: ClusterStore,
        ttl: Duration,
        interval: Duration,
        report: Report,
    ) -> Result<Registration, crate::ClusterError> {
        let lease = store.grant(ttl).await?;
        store.put_node(&report(), lease).await?;
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut lease = Some(lease);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(interval) => {}
                }
                lease = match lease {
                    Some(id) => refresh(&store, id, &report).await.then_some(id),
                    None => None,
                };
                if lease.is_none() {
                    lease = rejoin(&store, ttl, &report).await;
                }
            }
            if let Some(id) = lease {
                let _ = store.revoke(id).await;
            }
        });
        Ok(Registration {
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Leaves the cluster now (revokes the lease), waiting at most the store's deadline.
    pub async fn leave(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(t) = &self.task
            && self.stop.is_some()
        {
            t.abort();
        }
    }
}

/// Keeps lease `id` alive and rewrites the record; false when the lease is lost.
async fn refresh(store: &ClusterStore, id: i64, report: &Report) -> bool {
    let mut lease = store.client().lease_client();
    let alive = tokio::time::timeout(store.deadline(), async {
        let (mut keeper, mut stream) = lease.keep_alive(id).await?;
        keeper.keep_alive().await?;
        let ttl = stream.message().await?.map_or(0, |m| m.ttl());
        Ok::<bool, etcd_client::Error>(ttl > 0)
    })
    .await;
    match alive {
        Ok(Ok(true)) => match store.put_node(&report(), id).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "refreshing the node record failed; retrying");
                // The lease may still be fine: keep it and try again next time.
                true
            }
        },
        Ok(Ok(false)) => {
            tracing::warn!("the node's lease expired; registering again");
            false
        }
        // etcd answers a keepalive of a forgotten lease with TTL 0, which the client reports as this.
        Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m.contains("lease not found") => {
            tracing::warn!("the node's lease expired; registering again");
            false
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "etcd keepalive failed; retrying");
            true
        }
        Err(_) => {
            tracing::warn!("etcd keepalive got no answer in time; retrying");
            true
        }
    }
}

async fn rejoin(store: &ClusterStore, ttl: Duration, report: &Report) -> Option<i64> {
    let id = match store.grant(ttl).await {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(error = %e, "registering with etcd failed; retrying");
            return None;
        }
    };
    match store.put_node(&report(), id).await {
        Ok(()) => {
            tracing::info!("registered with etcd again");
            Some(id)
        }
        Err(e) => {
            tracing::warn!(error = %e, "publishing the node record failed; retrying");
            let _ = store.revoke(id).await;
            None
        }
    }
}
