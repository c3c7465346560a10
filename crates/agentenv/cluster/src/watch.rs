//! [`ViewCache`]: a gateway's copy of the node records and placement claims, kept current by one etcd
//! watch, so a placement reads nothing from etcd and costs only its claim transaction.
//!
//! Invariant: the copy is served only while its watch is live: it answers within
//! [`STALE_AFTER`] of each progress request, else the copy is dropped and [`ViewCache::view`] reads
//! etcd as [`ClusterStore::view`] does until a new watch has caught up. A claim this process wins is
//! entered at once ([`ViewCache::claim`]), so its next placement counts it before the watch reports it.
//! Claims decide nothing on their own: the claim transaction still checks the node in etcd.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use etcd_client::{EventType, WatchOptions};

use crate::error::ClusterError;
use crate::schema::{Claim, NodeRecord};
use crate::store::{ClaimOutcome, ClusterStore, ClusterView, Versioned};

type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// How often the watch is asked to confirm it is caught up.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// A watch silent this long after a progress request is taken for dead.
pub const STALE_AFTER: Duration = Duration::from_secs(3);

/// Nodes and claims as the watch last saw them (keys are etcd keys).
#[derive(Default)]
struct Copy {
    live: bool,
    nodes: BTreeMap<Vec<u8>, Versioned<NodeRecord>>,
    claims: BTreeMap<Vec<u8>, Versioned<Claim>>,
}

struct Inner {
    store: ClusterStore,
    copy: Mutex<Copy>,
    /// Watches that caught up so far (1 while the first lives).
    syncs: AtomicU64,
}

/// The cluster view a gateway places with; clones share one watch.
#[derive(Clone)]
pub struct ViewCache {
    inner: Arc<Inner>,
}

impl ViewCache {
    /// Starts watching (in a task that ends when the last clone is dropped); until the first sync,
    /// views are read from etcd.
    pub fn start(store: ClusterStore) -> ViewCache {
        let inner = Arc::new(Inner {
            store,
            copy: Mutex::new(Copy::default()),
            syncs: AtomicU64::new(0),
        });
        tokio::spawn(keep(Arc::downgrade(&inner)));
        ViewCache { inner }
    }

    /// The nodes and the claims newer than the oldest node record, from the copy while its watch is
    /// live, else from etcd.
    pub async fn view(&self) -> Result<ClusterView> {
        match self.cached() {
            Some(v) => Ok(v),
            None => self.inner.store.view().await,
        }
    }

    /// How many watches have caught up since the start (a new one after each failure).
    pub fn syncs(&self) -> u64 {
        self.inner.syncs.load(Ordering::Relaxed)
    }

    /// Whether views come from the watched copy now.
    pub fn is_live(&self) -> bool {
        self.inner.copy.lock().expect("view copy").live
    }

    fn cached(&self) -> Option<ClusterView> {
        let copy = self.inner.copy.lock().expect("view copy");
        if !copy.live {
            return None;
        }
        let nodes: Vec<_> = copy.nodes.values().cloned().collect();
        let claims = match nodes.iter().map(|n| n.mod_revision).min() {
            None => vec![],
            Some(oldest) => copy
                .claims
                .values()
                .filter(|c| c.create_revision > oldest)
                .cloned()
                .collect(),
        };
        Some(ClusterView { nodes, claims })
    }

    /// [`ClusterStore::claim`], entering a won claim into the copy at once.
    pub async fn claim(
        &self,
        claim: &Claim,
        idempotency: Option<(&str, &str)>,
    ) -> Result<ClaimOutcome> {
        let (outcome, written) = self.inner.store.claim_written(claim, idempotency).await?;
        if let Some((key, revision)) = written {
            let mut copy = self.inner.copy.lock().expect("view copy");
            if copy.live {
                copy.claims.entry(key.into_bytes()).or_insert(Versioned {
                    value: claim.clone(),
                    create_revision: revision,
                    mod_revision: revision,
                });
            }
        }
        Ok(outcome)
    }
}

/// Syncs and follows the watch until the cache is dropped; after a failure, drops the copy and
/// starts again (100 ms, doubling to 2 s).
async fn keep(weak: Weak<Inner>) {
    let mut backoff = Duration::from_millis(100);
    while let Some(inner) = weak.upgrade() {
        let store = inner.store.clone();
        drop(inner);
        let err = follow(&store, &weak).await;
        if let Some(inner) = weak.upgrade() {
            *inner.copy.lock().expect("view copy") = Copy::default();
        }
        match err {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(error = %e, "cluster view watch ended; reading etcd until it is back")
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// One watch's life: read both prefixes at one revision, watch from the next, apply every event.
/// `Ok` when the cache was dropped.
async fn follow(store: &ClusterStore, weak: &Weak<Inner>) -> Result<()> {
    let (nodes, claims, revision) = store.nodes_and_claims().await?;
    let keys = store.keys().clone();
    let opts = || {
        WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1)
    };
    let unavailable = |e: etcd_client::Error| ClusterError::unavailable("watch the cluster", e);
    let deadline = store.deadline();
    let mut client = store.client().watch_client();
    let mut stream = tokio::time::timeout(deadline, client.watch(keys.nodes(), Some(opts())))
        .await
        .map_err(|_| ClusterError::unavailable("watch the cluster", "no answer"))?
        .map_err(unavailable)?;
    stream
        .watch(keys.claims(), Some(opts()))
        .await
        .map_err(unavailable)?;
    {
        let Some(inner) = weak.upgrade() else {
            return Ok(());
        };
        let mut copy = inner.copy.lock().expect("view copy");
        copy.nodes = nodes;
        copy.claims = claims;
        copy.live = true;
        inner.syncs.fetch_add(1, Ordering::Relaxed);
    }
    let mut tick = tokio::time::interval(PROGRESS_EVERY);
    let mut heard = Instant::now();
    loop {
        tokio::select! {
            msg = stream.message() => {
                let Some(resp) = msg.map_err(unavailable)? else {
                    return Err(ClusterError::unavailable("watch the cluster", "the stream ended"));
                };
                heard = Instant::now();
                if resp.canceled() || resp.compact_revision() > 0 {
                    return Err(ClusterError::unavailable(
                        "watch the cluster",
                        format!("canceled: {}", resp.cancel_reason()),
                    ));
                }
                let Some(inner) = weak.upgrade() else {
                    return Ok(());
                };
                let mut copy = inner.copy.lock().expect("view copy");
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let key = kv.key();
                    let is_node = key.starts_with(keys.nodes().as_bytes());
                    match ev.event_type() {
                        EventType::Delete if is_node => drop(copy.nodes.remove(key)),
                        EventType::Delete => drop(copy.claims.remove(key)),
                        EventType::Put if is_node => {
                            if let Some(v) = ClusterStore::decode_kv(kv) {
                                copy.nodes.insert(key.to_vec(), v);
                            }
                        }
                        EventType::Put => {
                            if let Some(v) = ClusterStore::decode_kv(kv) {
                                copy.claims.insert(key.to_vec(), v);
                            }
                        }
                    }
                }
            }
            _ = tick.tick() => {
                if weak.strong_count() == 0 {
                    return Ok(());
                }
                if heard.elapsed() > STALE_AFTER + PROGRESS_EVERY {
                    return Err(ClusterError::unavailable("watch the cluster", "no progress"));
                }
                // Answered by a progress notice (or events): proof the watch is caught up.
                stream.request_progress().await.map_err(unavailable)?;
            }
        }
    }
}
