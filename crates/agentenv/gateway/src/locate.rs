//! Where a sandbox is, and taking over a paused one whose node left the cluster.
//!
//! A sandbox's entry names its node. When that node's lease is gone:
//! - a paused sandbox with a handoff (its snapshot in the shared bucket) is moved: the entry is
//!   switched to a new node in state `moving` by a compare-and-put (one gateway wins), then the new node
//!   adopts it (same id, owner, access token) and the entry says `running`. Adopting is idempotent, so a
//!   gateway that finds an entry `moving` (another gateway's move, or one that died mid-move) just
//!   finishes it;
//! - a running one is lost: its memory was on that node only.

use agentenv_cluster::placement::{Demand, place};
use agentenv_cluster::{EntryState, NodeRecord, SandboxEntry, Versioned};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use sha2::Digest;

use super::{CONTROL_DEADLINE, DATA_DEADLINE, Gateway, GatewayError, proxy};
use agentenv_api::dataplane::Plane;
use agentenv_api::routes::HandoffBody;
use agentenv_control::sandboxes::HandoffRecord;

/// Where a sandbox is.
pub enum Located {
    /// On a live node.
    Live {
        node: NodeRecord,
        entry: Versioned<SandboxEntry>,
    },
    /// Paused with a handoff, on a node that left.
    Orphaned { entry: Versioned<SandboxEntry> },
    /// Running on a node that left.
    Lost { node: String },
}

/// The SHA-256 (hex) an access token is found by in etcd.
pub fn token_hash(token: &str) -> String {
    let d = sha2::Sha256::digest(token.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Finds sandbox `id` (of `tenant`, when given: another tenant's is "not found").
pub async fn locate(gw: &Gateway, id: &str, tenant: Option<&str>) -> Result<Located, GatewayError> {
    let entry = gw
        .store
        .sandbox(id)
        .await?
        .filter(|e| tenant.is_none_or(|t| e.value.owner == t))
        .filter(|e| e.value.state != EntryState::Killed)
        .ok_or_else(|| GatewayError::SandboxNotFound(id.into()))?;
    if let Some(node) = gw.store.node(&entry.value.node).await? {
        return Ok(Located::Live { node, entry });
    }
    match entry.value.state {
        EntryState::Paused | EntryState::Moving if entry.value.handoff.is_some() => {
            Ok(Located::Orphaned { entry })
        }
        _ => Ok(Located::Lost {
            node: entry.value.node,
        }),
    }
}

/// The node sandbox `id` runs on, taking it over or finishing a move first when `resume` allows it.
pub async fn running_node(
    gw: &Gateway,
    id: &str,
    tenant: Option<&str>,
    resume: impl Fn(&HandoffRecord) -> bool,
) -> Result<NodeRecord, GatewayError> {
    // A lost compare-and-put means another gateway moved it meanwhile: look again.
    for _ in 0..3 {
        match locate(gw, id, tenant).await? {
            Located::Live { node, entry } if entry.value.state == EntryState::Moving => {
                return finish_move(gw, node, entry).await;
            }
            Located::Live { node, .. } => return Ok(node),
            Located::Lost { node } => {
                return Err(GatewayError::SandboxLost {
                    id: id.into(),
                    node,
                });
            }
            Located::Orphaned { entry } => {
                let rec = handoff_record(&entry.value)?;
                if !resume(&rec) {
                    return Err(GatewayError::PausedElsewhere {
                        id: id.into(),
                        node: entry.value.node,
                    });
                }
                if let Some(node) = start_move(gw, &entry, &rec).await? {
                    let moved = gw
                        .store
                        .sandbox(id)
                        .await?
                        .ok_or_else(|| GatewayError::SandboxNotFound(id.into()))?;
                    return finish_move(gw, node, moved).await;
                }
            }
        }
    }
    Err(GatewayError::Takeover {
        id: id.into(),
        why: "its entry kept changing under this gateway".into(),
    })
}

/// The handoff record of entry `e` (a paused sandbox's, for another node to continue it).
pub(crate) fn handoff_record(e: &SandboxEntry) -> Result<HandoffRecord, GatewayError> {
    let h = e.handoff.as_ref().ok_or_else(|| GatewayError::Takeover {
        id: e.sandbox_id.clone(),
        why: "no handoff snapshot".into(),
    })?;
    serde_json::from_value(h.record.clone()).map_err(|err| GatewayError::Takeover {
        id: e.sandbox_id.clone(),
        why: format!("unreadable handoff record: {err}"),
    })
}

/// Picks a new node and claims the move; `None` when another gateway changed the entry first.
async fn start_move(
    gw: &Gateway,
    entry: &Versioned<SandboxEntry>,
    rec: &HandoffRecord,
) -> Result<Option<NodeRecord>, GatewayError> {
    let snapshot = entry.value.handoff.as_ref().map(|h| h.snapshot_id.clone());
    let view = gw.views.view().await?;
    let exclude = [entry.value.node.clone()];
    let choice = place(
        &view.candidates(),
        &Demand {
            vcpus: rec.sandbox.cpu_count,
            memory_mb: u64::from(rec.sandbox.memory_mb),
            source: snapshot.as_deref().unwrap_or_default(),
            exclude: &exclude,
        },
    )?;
    let mut moved = entry.value.clone();
    moved.node = choice.node.clone();
    moved.state = EntryState::Moving;
    moved.updated_at_ms = agentenv_control::sandboxes::now_ms();
    if gw
        .store
        .update_sandbox(&moved, entry.mod_revision)
        .await?
        .is_none()
    {
        return Ok(None);
    }
    tracing::info!(sandbox = %moved.sandbox_id, from = %entry.value.node, to = %choice.node, "moving a paused sandbox off a node that left");
    Ok(view.node(&choice.node).cloned())
}

/// Has `node` adopt the sandbox of a `moving` entry (idempotent), then marks it running there.
async fn finish_move(
    gw: &Gateway,
    node: NodeRecord,
    entry: Versioned<SandboxEntry>,
) -> Result<NodeRecord, GatewayError> {
    let id = entry.value.sandbox_id.clone();
    let rec = handoff_record(&entry.value)?;
    let snapshot_id = entry
        .value
        .handoff
        .as_ref()
        .map(|h| h.snapshot_id.clone())
        .unwrap_or_default();
    let body = serde_json::to_vec(&HandoffBody {
        snapshot_id,
        handoff: rec,
    })
    .map_err(|e| GatewayError::Invalid(e.to_string()))?;
    let resp = gw
        .node_call(&node, Method::POST, "/cluster/adopt", Some(body))
        .await?;
    if resp.status() != StatusCode::CREATED {
        let status = resp.status();
        let text = proxy::read_body(resp.into_body(), 64 << 10)
            .await
            .unwrap_or_default();
        return Err(GatewayError::Takeover {
            id,
            why: format!(
                "node {} answered {status}: {}",
                node.id,
                String::from_utf8_lossy(&text)
            ),
        });
    }
    let mut done = entry.value.clone();
    done.state = EntryState::Running;
    done.handoff = None;
    done.updated_at_ms = agentenv_control::sandboxes::now_ms();
    // Losing this compare-and-put means another gateway finished the same move. The handoff snapshot
    // stays: the adopted sandbox's disk, and every later snapshot of it, are based on it.
    gw.store.update_sandbox(&done, entry.mod_revision).await?;
    tracing::info!(sandbox = %id, node = %node.id, "sandbox adopted");
    Ok(node)
}

/// Serves one data-plane request: to the sandbox's node, after moving it there when it is paused on
/// a node that left and auto-resumes.
pub async fn data_plane(
    gw: &Gateway,
    plane: Plane,
    req: Request,
) -> Result<Response, GatewayError> {
    let id = match plane {
        Plane::SandboxById(ref id) => id.clone(),
        Plane::SandboxByToken(ref token) => gw
            .store
            .sandbox_by_token(&token_hash(token))
            .await?
            .ok_or_else(|| GatewayError::SandboxNotFound("of this access token".into()))?,
        Plane::Control => return Err(GatewayError::Invalid("not a data-plane request".into())),
        // The gateway holds no access tokens to check a signature under: only a node can.
        Plane::SignedFile => {
            return Err(GatewayError::Api(
                agentenv_api::error::ApiError::unauthorized(
                    "a signed /files URL needs the sandbox's node: use its E2b-Sandbox-Id",
                ),
            ));
        }
    };
    // Only a request with the sandbox's token may move it (a request by token found it by that token);
    // the node checks the token of every request again.
    let by_token = matches!(plane, Plane::SandboxByToken(_));
    let headers = req.headers().clone();
    let bad_token = std::sync::atomic::AtomicBool::new(false);
    let may_move = |r: &HandoffRecord| {
        let ok = by_token || agentenv_api::access::request_ok(&headers, &r.sandbox);
        bad_token.store(!ok, std::sync::atomic::Ordering::Relaxed);
        r.sandbox.auto_resume && ok
    };
    let node = match running_node(gw, &id, None, may_move).await {
        Err(GatewayError::PausedElsewhere { .. })
            if bad_token.load(std::sync::atomic::Ordering::Relaxed) =>
        {
            return Err(GatewayError::Api(agentenv_api::access::refusal(&headers)));
        }
        r => r?,
    };
    let client_conn = req
        .extensions()
        .get::<axum::extract::ConnectInfo<agentenv_api::conn::Conn>>()
        .map(|c| c.0.clone());
    let resp = proxy::forward(&gw.http, &node.id, &node.url, req, DATA_DEADLINE).await?;
    // A body the node cut (its sandbox died under it) resets the client's connection too.
    Ok(resp.map(|b| agentenv_api::conn::cut_on_error(b, client_conn)))
}

impl Gateway {
    /// A call of the gateway's own to a node, as the operator (by certificate, or with the server key).
    pub async fn node_call(
        &self,
        node: &NodeRecord,
        method: Method,
        path: &str,
        json: Option<Vec<u8>>,
    ) -> Result<Response, GatewayError> {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("x-api-key", &self.server_key);
        if json.is_some() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        let mut req = b
            .body(json.map_or_else(Body::empty, Body::from))
            .map_err(|e| GatewayError::Invalid(e.to_string()))?;
        if let Some(operator) = self.keys.named(agentenv_control::tenants::DEFAULT_TENANT) {
            req.extensions_mut().insert(operator);
        }
        proxy::forward(&self.http, &node.id, &node.url, req, CONTROL_DEADLINE).await
    }
}
