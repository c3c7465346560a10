//! [`ClusterStore`]: the cluster's state in etcd, read and written under deadlines.
//!
//! Invariant: every call has a deadline ([`ClusterStore::deadline`]); a missed one or a refused
//! connection is [`ClusterError::Unavailable`], never a hang. Writes that decide something (a
//! placement, a sandbox's node, a takeover) are transactions that compare before they put.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};

use crate::error::ClusterError;
use crate::schema::{
    Claim, Handoff, IdempotencyEntry, Keys, NodeRecord, SCHEMA_VERSION, SnapshotEntry, decode,
    encode,
};

type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// Default deadline of one etcd call.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(3);
/// How long a placement claim counts as load if its node never reports it.
pub const CLAIM_TTL: Duration = Duration::from_secs(15);
/// How long the entry of a sandbox killed while its node was away waits for that node to return.
pub const KILLED_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long an `Idempotency-Key` maps to its node (the server's own dedupe window).
pub const IDEMPOTENCY_TTL: Duration = Duration::from_secs(300);

/// What [`ClusterStore::set_state`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum StateChange {
    /// Written; the handoff the entry held before (now unreferenced unless it is the one written).
    Written { replaced: Option<Handoff> },
    /// Not written: no entry, another node's or a killed one, or it kept changing.
    Skipped,
}

/// A record and the etcd revisions it was read at.
#[derive(Debug, Clone)]
pub struct Versioned<T> {
    pub value: T,
    pub create_revision: i64,
    pub mod_revision: i64,
}

/// Nodes, and the claims their records may not include yet.
#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    pub nodes: Vec<Versioned<NodeRecord>>,
    pub claims: Vec<Versioned<Claim>>,
}

impl ClusterView {
    /// Placement candidates: each node with the claims newer than its record.
    pub fn candidates(&self) -> Vec<crate::placement::Candidate<'_>> {
        self.nodes
            .iter()
            .map(|n| {
                let mut pending = crate::placement::Pending::default();
                for c in self
                    .claims
                    .iter()
                    .filter(|c| c.value.node == n.value.id && c.create_revision > n.mod_revision)
                {
                    pending.sandboxes += 1;
                    pending.vcpus += c.value.vcpus;
                    pending.memory_mb += c.value.memory_mb;
                }
                crate::placement::Candidate {
                    node: &n.value,
                    pending,
                }
            })
            .collect()
    }

    pub fn node(&self, id: &str) -> Option<&NodeRecord> {
        self.nodes.iter().map(|n| &n.value).find(|n| n.id == id)
    }

    /// The node that holds volumes (E2B's `/volumes`) and runs the sandboxes that mount them: the
    /// one with the least id.
    pub fn volume_node(&self) -> Option<&NodeRecord> {
        self.nodes
            .iter()
            .map(|n| &n.value)
            .min_by(|a, b| a.id.cmp(&b.id))
    }

    /// The size of sandboxes made from template or snapshot `source`, as a node holding it reports it.
    pub fn size_of(&self, source: &str) -> Option<crate::MachineSize> {
        self.nodes
            .iter()
            .find_map(|n| n.value.sizes.get(source).copied())
    }
}

/// How a placement claim came out.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimOutcome {
    /// The node is claimed for this create.
    Claimed,
    /// A create with the same idempotency key went to this node already.
    Duplicate(String),
    /// The node left between the read and the claim: place again.
    NodeGone,
}

/// The cluster's state in etcd.
#[derive(Clone)]
pub struct ClusterStore {
    client: Client,
    keys: Keys,
    deadline: Duration,
    /// Leases shared by the claims (and idempotency keys) written within a third of their TTL, so a
    /// placement costs one transaction, not a lease grant too.
    claim_lease: Arc<SharedLease>,
    idempotency_lease: Arc<SharedLease>,
}

/// One lease for every record written within a window of `ttl / 3`; each lives `ttl` to `ttl · 4/3`.
struct SharedLease {
    ttl: Duration,
    current: tokio::sync::Mutex<Option<(i64, Instant)>>,
}

impl SharedLease {
    fn new(ttl: Duration) -> Arc<SharedLease> {
        Arc::new(SharedLease {
            ttl,
            current: tokio::sync::Mutex::new(None),
        })
    }
}

impl ClusterStore {
    /// Connects to `endpoints` (e.g. `http://127.0.0.1:2379`); the first connection has the deadline too,
    /// later ones are re-made by the client on demand.
    pub async fn connect(endpoints: &[String], prefix: &str, deadline: Duration) -> Result<Self> {
        Self::connect_with(endpoints, None, prefix, deadline).await
    }

    /// [`ClusterStore::connect`], over mutual TLS with `tls` (`https://` endpoints).
    pub async fn connect_with(
        endpoints: &[String],
        tls: Option<&crate::tls::EtcdTls>,
        prefix: &str,
        deadline: Duration,
    ) -> Result<Self> {
        if endpoints.is_empty() {
            return Err(ClusterError::Invalid("no etcd endpoint given".into()));
        }
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(deadline)
            .with_timeout(deadline)
            .with_keep_alive(Duration::from_secs(5), deadline);
        if let Some(t) = tls {
            opts = opts.with_tls(t.options()?);
        }
        let client = tokio::time::timeout(deadline, Client::connect(endpoints, Some(opts)))
            .await
            .map_err(|_| ClusterError::unavailable("connect", "deadline passed"))?
            .map_err(|e| ClusterError::unavailable("connect", e))?;
        Ok(ClusterStore {
            client,
            keys: Keys::new(prefix),
            deadline,
            claim_lease: SharedLease::new(CLAIM_TTL),
            idempotency_lease: SharedLease::new(IDEMPOTENCY_TTL),
        })
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Runs one etcd call under the deadline.
    pub(crate) async fn call<T, F>(&self, what: &'static str, f: F) -> Result<T>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        match tokio::time::timeout(self.deadline, f).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(etcd_client::Error::GRpcStatus(s)))
                if matches!(
                    s.code(),
                    tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
                ) =>
            {
                Err(ClusterError::Denied {
                    what,
                    why: s.message().to_string(),
                })
            }
            Ok(Err(e)) => Err(ClusterError::unavailable(what, e)),
            Err(_) => Err(ClusterError::unavailable(
                what,
                format!("no answer within {} ms", self.deadline.as_millis()),
            )),
        }
    }

    pub(crate) fn decode_all<T: serde::de::DeserializeOwned>(
        kvs: &[etcd_client::KeyValue],
    ) -> Vec<Versioned<T>> {
        kvs.iter().filter_map(Self::decode_kv).collect()
    }

    fn decode_keyed<T: serde::de::DeserializeOwned>(
        kvs: &[etcd_client::KeyValue],
    ) -> BTreeMap<Vec<u8>, Versioned<T>> {
        kvs.iter()
            .filter_map(|kv| Some((kv.key().to_vec(), Self::decode_kv(kv)?)))
            .collect()
    }

    /// One record with its revisions; an unreadable one is logged and skipped.
    pub(crate) fn decode_kv<T: serde::de::DeserializeOwned>(
        kv: &etcd_client::KeyValue,
    ) -> Option<Versioned<T>> {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        match decode::<T>(&key, kv.value()) {
            Ok(value) => Some(Versioned {
                value,
                create_revision: kv.create_revision(),
                mod_revision: kv.mod_revision(),
            }),
            Err(e) => {
                tracing::warn!(error = %e, "skipping an unreadable cluster record");
                None
            }
        }
    }

    /// Live nodes, and the claims newer than the oldest node record (older ones count for nothing:
    /// every node's record already includes them).
    ///
    /// Serializable reads (the member's own copy, no consensus round): placement may see a state a few
    /// milliseconds old; the claim transaction is what must be current, and it is linearizable.
    pub async fn view(&self) -> Result<ClusterView> {
        let mut kv = self.client.kv_client();
        let opts = GetOptions::new().with_prefix().with_serializable();
        let resp = self
            .call("read nodes", kv.get(self.keys.nodes(), Some(opts)))
            .await?;
        let nodes: Vec<Versioned<NodeRecord>> = Self::decode_all(resp.kvs());
        let Some(oldest) = nodes.iter().map(|n| n.mod_revision).min() else {
            return Ok(ClusterView::default());
        };
        let opts = GetOptions::new()
            .with_prefix()
            .with_serializable()
            .with_min_create_revision(oldest + 1);
        let resp = self
            .call("read claims", kv.get(self.keys.claims(), Some(opts)))
            .await?;
        let claims = Self::decode_all(resp.kvs());
        Ok(ClusterView { nodes, claims })
    }

    /// Every node record and claim, read at one revision, and that revision (a watch's start).
    pub(crate) async fn nodes_and_claims(
        &self,
    ) -> Result<(
        BTreeMap<Vec<u8>, Versioned<NodeRecord>>,
        BTreeMap<Vec<u8>, Versioned<Claim>>,
        i64,
    )> {
        let mut kv = self.client.kv_client();
        let resp = self
            .call(
                "read nodes",
                kv.get(self.keys.nodes(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let nodes = Self::decode_keyed(resp.kvs());
        let opts = GetOptions::new().with_prefix().with_revision(revision);
        let resp = self
            .call("read claims", kv.get(self.keys.claims(), Some(opts)))
            .await?;
        Ok((nodes, Self::decode_keyed(resp.kvs()), revision))
    }

    /// One node's record, if it is live.
    pub async fn node(&self, id: &str) -> Result<Option<NodeRecord>> {
        Ok(self
            .get::<NodeRecord>(&self.keys.node(id))
            .await?
            .map(|v| v.value))
    }

    pub(crate) async fn get<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<Versioned<T>>> {
        let mut kv = self.client.kv_client();
        let resp = self.call("get", kv.get(key, None)).await?;
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) => Ok(Some(Versioned {
                value: decode(key, kv.value())?,
                create_revision: kv.create_revision(),
                mod_revision: kv.mod_revision(),
            })),
        }
    }

    /// The shared lease of `slot`, granted anew once its window is over.
    async fn shared_lease(&self, slot: &SharedLease) -> Result<i64> {
        let mut cur = slot.current.lock().await;
        if let Some((id, at)) = *cur
            && at.elapsed() < slot.ttl / 3
        {
            return Ok(id);
        }
        let id = self.lease(slot.ttl + slot.ttl / 3).await?;
        *cur = Some((id, Instant::now()));
        Ok(id)
    }

    /// Forgets the shared leases (after a failed write: the lease may be gone).
    async fn reset_shared_leases(&self) {
        *self.claim_lease.current.lock().await = None;
        *self.idempotency_lease.current.lock().await = None;
    }

    pub(crate) async fn lease(&self, ttl: Duration) -> Result<i64> {
        let mut lease = self.client.lease_client();
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        Ok(self
            .call("grant lease", lease.grant(secs, None))
            .await?
            .id())
    }

    /// Claims `claim.node` for one create, in one transaction that also checks the node is still
    /// registered and, with an idempotency key, that no other create with it was placed (two gateways
    /// never place the same create twice).
    pub async fn claim(
        &self,
        claim: &Claim,
        idempotency: Option<(&str, &str)>,
    ) -> Result<ClaimOutcome> {
        Ok(self.claim_written(claim, idempotency).await?.0)
    }

    /// [`Self::claim`], with the claim's key and revision when it was written.
    pub(crate) async fn claim_written(
        &self,
        claim: &Claim,
        idempotency: Option<(&str, &str)>,
    ) -> Result<(ClaimOutcome, Option<(String, i64)>)> {
        let lease = self.shared_lease(&self.claim_lease).await?;
        let claim_key = self
            .keys
            .claim(&claim.node, &format!("{:016x}", rand::random::<u64>()));
        let mut when = vec![Compare::version(
            self.keys.node(&claim.node),
            CompareOp::Greater,
            0,
        )];
        let mut then = vec![TxnOp::put(
            claim_key.clone(),
            encode(claim),
            Some(PutOptions::new().with_lease(lease)),
        )];
        let mut otherwise = vec![];
        if let Some((tenant, key)) = idempotency {
            let idem_key = self.keys.idempotency(tenant, key);
            let idem_lease = self.shared_lease(&self.idempotency_lease).await?;
            when.push(Compare::create_revision(
                idem_key.clone(),
                CompareOp::Equal,
                0,
            ));
            then.push(TxnOp::put(
                idem_key.clone(),
                encode(&IdempotencyEntry {
                    version: SCHEMA_VERSION,
                    node: claim.node.clone(),
                }),
                Some(PutOptions::new().with_lease(idem_lease)),
            ));
            otherwise.push(TxnOp::get(idem_key, None));
        }
        let txn = Txn::new().when(when).and_then(then).or_else(otherwise);
        let mut kv = self.client.kv_client();
        let resp = match self.call("claim a node", kv.txn(txn)).await {
            Ok(r) => r,
            Err(e) => {
                self.reset_shared_leases().await;
                return Err(e);
            }
        };
        if resp.succeeded() {
            let revision = resp.header().map_or(0, |h| h.revision());
            return Ok((ClaimOutcome::Claimed, Some((claim_key, revision))));
        }
        let existing = resp.op_responses().into_iter().find_map(|r| match r {
            etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        match existing {
            Some(bytes) => {
                let e: IdempotencyEntry = decode("idempotency", &bytes)?;
                Ok((ClaimOutcome::Duplicate(e.node), None))
            }
            None => Ok((ClaimOutcome::NodeGone, None)),
        }
    }

    /// Records where a snapshot was taken.
    pub async fn put_snapshot(&self, entry: &SnapshotEntry) -> Result<()> {
        let mut kv = self.client.kv_client();
        self.call(
            "record a snapshot",
            kv.put(self.keys.snapshot(&entry.snapshot_id), encode(entry), None),
        )
        .await
        .map(drop)
    }

    pub async fn snapshot(&self, id: &str) -> Result<Option<SnapshotEntry>> {
        Ok(self.get(&self.keys.snapshot(id)).await?.map(|v| v.value))
    }

    /// Writes a node's record under `lease` (registration).
    pub(crate) async fn put_node(&self, rec: &NodeRecord, lease: i64) -> Result<()> {
        let mut kv = self.client.kv_client();
        self.call(
            "publish the node",
            kv.put(
                self.keys.node(&rec.id),
                encode(rec),
                Some(PutOptions::new().with_lease(lease)),
            ),
        )
        .await
        .map(drop)
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    pub(crate) async fn grant(&self, ttl: Duration) -> Result<i64> {
        self.lease(ttl).await
    }

    pub(crate) async fn revoke(&self, lease: i64) -> Result<()> {
        let mut l = self.client.lease_client();
        self.call("revoke lease", l.revoke(lease)).await.map(drop)
    }
}
