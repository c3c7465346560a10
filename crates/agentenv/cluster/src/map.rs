//! The sandbox map: which node holds each sandbox, its state and the handoff of a paused one.
//!
//! Layout (see [`crate::schema`]): `placed/<id>` names the node of sandbox `id` and only gateways
//! write it; `sandboxes/<node>/<id>` is the entry, which its node updates (state, handoff) and may
//! drop, and which a move replaces under another node, together with `placed/<id>`, in one
//! transaction; `tokens/<sha256>` maps an access token to its sandbox (gateways only).
//!
//! Invariant: an entry counts only where `placed/<id>` names the node its key is under (and its own
//! `node` field agrees), so a node, which may write under `sandboxes/<itself>/` alone, can neither
//! change another node's sandboxes nor claim one. What a node drops leaves `placed/<id>` and its
//! token behind; [`ClusterStore::sweep`] (run by gateways) removes them.

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

use crate::error::ClusterError;
use crate::schema::{EntryState, Handoff, SandboxEntry, encode};
use crate::store::{ClusterStore, KILLED_TTL, StateChange, Versioned};

type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// What one [`ClusterStore::sweep`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    /// `placed/<id>` keys whose entry was gone.
    pub placements: usize,
    /// Access tokens of sandboxes no longer placed.
    pub tokens: usize,
}

impl ClusterStore {
    /// The node `placed/<id>` names, and that key's mod revision.
    async fn placed(&self, id: &str) -> Result<Option<(String, i64)>> {
        let mut kv = self.client().kv_client();
        let resp = self
            .call("find a sandbox", kv.get(self.keys().placed(id), None))
            .await?;
        Ok(resp.kvs().first().map(|kv| {
            (
                String::from_utf8_lossy(kv.value()).into_owned(),
                kv.mod_revision(),
            )
        }))
    }

    /// Records a new sandbox (and its access token's hash) unless its id is placed already; false if
    /// it was.
    pub async fn insert_sandbox(&self, entry: &SandboxEntry, token_sha256: &str) -> Result<bool> {
        let keys = self.keys();
        let placed = keys.placed(&entry.sandbox_id);
        let entry = SandboxEntry {
            token_sha256: Some(token_sha256.to_string()),
            ..entry.clone()
        };
        let txn = Txn::new()
            .when([Compare::create_revision(
                placed.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(placed, entry.node.as_bytes().to_vec(), None),
                TxnOp::put(
                    keys.sandbox(&entry.node, &entry.sandbox_id),
                    encode(&entry),
                    None,
                ),
                TxnOp::put(
                    keys.token(token_sha256),
                    entry.sandbox_id.as_bytes().to_vec(),
                    None,
                ),
            ]);
        let mut kv = self.client().kv_client();
        Ok(self
            .call("record a sandbox", kv.txn(txn))
            .await?
            .succeeded())
    }

    /// Sandbox `id`'s entry, under the node it is placed on.
    pub async fn sandbox(&self, id: &str) -> Result<Option<Versioned<SandboxEntry>>> {
        // A move between the two reads replaces the entry: read again.
        for _ in 0..3 {
            let Some((node, _)) = self.placed(id).await? else {
                return Ok(None);
            };
            match self
                .get::<SandboxEntry>(&self.keys().sandbox(&node, id))
                .await?
            {
                Some(e) if e.value.node == node && e.value.sandbox_id == id => return Ok(Some(e)),
                Some(_) => {
                    tracing::warn!(sandbox = %id, %node, "an entry names another sandbox or node; ignored");
                    return Ok(None);
                }
                None => continue,
            }
        }
        Ok(None)
    }

    /// Every placed sandbox's entry (list merges), read at one revision.
    pub async fn sandboxes(&self) -> Result<Vec<SandboxEntry>> {
        let (placed, entries, _) = self.read_map(false).await?;
        let keys = self.keys();
        Ok(entries
            .into_iter()
            .filter_map(|(key, e)| {
                let (node, id) = keys.parse_sandbox(&key)?;
                let ok = placed.get(id).is_some_and(|(n, _)| n == node)
                    && e.value.node == node
                    && e.value.sandbox_id == id;
                ok.then_some(e.value)
            })
            .collect())
    }

    /// `placed/` (id -> node and mod revision), `sandboxes/` (key -> entry) and, with `tokens`,
    /// `tokens/` (key -> sandbox id and mod revision), all at one revision.
    #[allow(clippy::type_complexity)]
    async fn read_map(
        &self,
        tokens: bool,
    ) -> Result<(
        std::collections::HashMap<String, (String, i64)>,
        Vec<(String, Versioned<SandboxEntry>)>,
        Vec<(String, String, i64)>,
    )> {
        let keys = self.keys();
        let mut kv = self.client().kv_client();
        let opts = GetOptions::new().with_prefix();
        let resp = self
            .call("list placements", kv.get(keys.placements(), Some(opts)))
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let placed = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let id = String::from_utf8_lossy(kv.key());
                let id = id.strip_prefix(&keys.placements())?.to_string();
                let node = String::from_utf8_lossy(kv.value()).into_owned();
                Some((id, (node, kv.mod_revision())))
            })
            .collect();
        let at = || GetOptions::new().with_prefix().with_revision(revision);
        let resp = self
            .call("list sandboxes", kv.get(keys.sandboxes(), Some(at())))
            .await?;
        let entries = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                Some((key, Self::decode_kv(kv)?))
            })
            .collect();
        let mut toks = vec![];
        if tokens {
            let resp = self
                .call("list tokens", kv.get(keys.token(""), Some(at())))
                .await?;
            toks = resp
                .kvs()
                .iter()
                .map(|kv| {
                    (
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        String::from_utf8_lossy(kv.value()).into_owned(),
                        kv.mod_revision(),
                    )
                })
                .collect();
        }
        Ok((placed, entries, toks))
    }

    /// Replaces a sandbox's entry if it is still at `mod_revision`, returning its new revision; `None`
    /// if another writer came first. An entry naming another node moves the sandbox there (gateways).
    pub async fn update_sandbox(
        &self,
        entry: &SandboxEntry,
        mod_revision: i64,
    ) -> Result<Option<i64>> {
        let id = &entry.sandbox_id;
        let Some((from, placed_rev)) = self.placed(id).await? else {
            return Ok(None);
        };
        let keys = self.keys();
        let (cur, next) = (keys.sandbox(&from, id), keys.sandbox(&entry.node, id));
        let mut ops = vec![TxnOp::put(next, encode(entry), None)];
        if from != entry.node {
            ops.push(TxnOp::delete(cur.clone(), None));
            ops.push(TxnOp::put(
                keys.placed(id),
                entry.node.as_bytes().to_vec(),
                None,
            ));
        }
        let txn = Txn::new()
            .when([
                Compare::mod_revision(cur, CompareOp::Equal, mod_revision),
                Compare::mod_revision(keys.placed(id), CompareOp::Equal, placed_rev),
            ])
            .and_then(ops);
        let mut kv = self.client().kv_client();
        let resp = self.call("update a sandbox", kv.txn(txn)).await?;
        Ok(resp
            .succeeded()
            .then(|| resp.header().map_or(0, |h| h.revision())))
    }

    /// Sets sandbox `id`'s state and handoff by compare-and-put, read again after a concurrent write.
    /// With `on_node`, only while it is placed on that node. `updated_at_ms` is the caller's clock.
    pub async fn set_state(
        &self,
        id: &str,
        on_node: Option<&str>,
        state: EntryState,
        handoff: Option<Handoff>,
        updated_at_ms: i64,
    ) -> Result<StateChange> {
        for _ in 0..3 {
            let Some(cur) = self.sandbox(id).await? else {
                return Ok(StateChange::Skipped);
            };
            if on_node.is_some_and(|n| n != cur.value.node) || cur.value.state == EntryState::Killed
            {
                return Ok(StateChange::Skipped);
            }
            let mut next = cur.value.clone();
            next.state = state;
            next.handoff = handoff.clone();
            next.updated_at_ms = updated_at_ms;
            if self
                .update_sandbox(&next, cur.mod_revision)
                .await?
                .is_some()
            {
                return Ok(StateChange::Written {
                    replaced: cur.value.handoff,
                });
            }
        }
        Ok(StateChange::Skipped)
    }

    /// Forgets a sandbox: where it is placed, its entry and its token (`token_sha256`, else the one its
    /// entry names). Gateways.
    pub async fn remove_sandbox(&self, id: &str, token_sha256: Option<&str>) -> Result<()> {
        let keys = self.keys();
        let cur = self.sandbox(id).await?;
        let token = token_sha256
            .map(str::to_string)
            .or_else(|| cur.as_ref().and_then(|e| e.value.token_sha256.clone()));
        let mut ops = vec![TxnOp::delete(keys.placed(id), None)];
        if let Some(e) = cur {
            ops.push(TxnOp::delete(keys.sandbox(&e.value.node, id), None));
        }
        if let Some(t) = token {
            ops.push(TxnOp::delete(keys.token(&t), None));
        }
        let mut kv = self.client().kv_client();
        self.call("forget a sandbox", kv.txn(Txn::new().and_then(ops)))
            .await
            .map(drop)
    }

    /// Drops node `node`'s entry of sandbox `id` (the sandbox ended there): the one map key a node
    /// deletes. Its placement and token go at the next [`ClusterStore::sweep`].
    pub async fn release_sandbox(&self, node: &str, id: &str) -> Result<()> {
        let mut kv = self.client().kv_client();
        self.call(
            "release a sandbox",
            kv.delete(self.keys().sandbox(node, id), None),
        )
        .await
        .map(drop)
    }

    /// Removes placements whose entry is gone (released by their node, or a killed entry's lease
    /// ended) and tokens of sandboxes no longer placed, each by compare-and-delete.
    pub async fn sweep(&self) -> Result<Swept> {
        let keys = self.keys();
        let (placed, entries, tokens) = self.read_map(true).await?;
        let held: std::collections::HashSet<&str> = entries.iter().map(|(k, _)| &**k).collect();
        let mut swept = Swept::default();
        let mut gone = std::collections::HashSet::new();
        let mut kv = self.client().kv_client();
        for (id, (node, rev)) in &placed {
            let entry = keys.sandbox(node, id);
            if held.contains(&*entry) {
                continue;
            }
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(keys.placed(id), CompareOp::Equal, *rev),
                    Compare::create_revision(entry, CompareOp::Equal, 0),
                ])
                .and_then([TxnOp::delete(keys.placed(id), None)]);
            if self
                .call("sweep a placement", kv.txn(txn))
                .await?
                .succeeded()
            {
                swept.placements += 1;
                gone.insert(id.as_str());
            }
        }
        for (key, id, rev) in tokens {
            if placed.contains_key(&id) && !gone.contains(id.as_str()) {
                continue;
            }
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(key.clone(), CompareOp::Equal, rev),
                    Compare::create_revision(keys.placed(&id), CompareOp::Equal, 0),
                ])
                .and_then([TxnOp::delete(key, None)]);
            if self.call("sweep a token", kv.txn(txn)).await?.succeeded() {
                swept.tokens += 1;
            }
        }
        Ok(swept)
    }

    /// Moves entries of the layout before per-node keys (`sandboxes/<id>`) to `placed/<id>` and
    /// `sandboxes/<node>/<id>` (keeping a killed entry's lease), each in one transaction; how many
    /// moved. Gateways run it when they start, so an upgraded cluster keeps its sandboxes.
    pub async fn migrate_flat_entries(&self) -> Result<usize> {
        let keys = self.keys();
        let mut kv = self.client().kv_client();
        let opts = GetOptions::new().with_prefix();
        let resp = self
            .call("list sandboxes", kv.get(keys.sandboxes(), Some(opts)))
            .await?;
        let mut moved = 0;
        for old in resp.kvs() {
            let key = String::from_utf8_lossy(old.key()).into_owned();
            let Some(id) = key
                .strip_prefix(&keys.sandboxes())
                .filter(|i| !i.contains('/'))
            else {
                continue;
            };
            let Some(e) = Self::decode_kv::<SandboxEntry>(old) else {
                continue;
            };
            if e.value.sandbox_id != id || !crate::schema::valid_node_id(&e.value.node) {
                continue;
            }
            let put = (old.lease() != 0).then(|| PutOptions::new().with_lease(old.lease()));
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(key.clone(), CompareOp::Equal, old.mod_revision()),
                    Compare::create_revision(keys.placed(id), CompareOp::Equal, 0),
                ])
                .and_then([
                    TxnOp::put(keys.placed(id), e.value.node.as_bytes().to_vec(), None),
                    TxnOp::put(keys.sandbox(&e.value.node, id), old.value().to_vec(), put),
                    TxnOp::delete(key.clone(), None),
                ]);
            if self.call("move an entry", kv.txn(txn)).await?.succeeded() {
                moved += 1;
            }
        }
        Ok(moved)
    }

    /// Marks a sandbox killed while its node is away (the entry then lives [`KILLED_TTL`], so the node
    /// can kill its copy when it returns) and forgets its token.
    pub async fn mark_killed(
        &self,
        entry: &SandboxEntry,
        token_sha256: Option<&str>,
    ) -> Result<()> {
        let lease = self.lease(KILLED_TTL).await?;
        let mut e = entry.clone();
        e.state = EntryState::Killed;
        e.handoff = None;
        let mut ops = vec![TxnOp::put(
            self.keys().sandbox(&e.node, &e.sandbox_id),
            encode(&e),
            Some(PutOptions::new().with_lease(lease)),
        )];
        if let Some(t) = token_sha256.or(entry.token_sha256.as_deref()) {
            ops.push(TxnOp::delete(self.keys().token(t), None));
        }
        let mut kv = self.client().kv_client();
        self.call("mark a sandbox killed", kv.txn(Txn::new().and_then(ops)))
            .await
            .map(drop)
    }

    /// The sandbox whose access token has this SHA-256.
    pub async fn sandbox_by_token(&self, token_sha256: &str) -> Result<Option<String>> {
        let mut kv = self.client().kv_client();
        let resp = self
            .call(
                "find a token",
                kv.get(self.keys().token(token_sha256), None),
            )
            .await?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }
}
