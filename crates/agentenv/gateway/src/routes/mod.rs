//! The gateway's control plane: creates are placed and claimed in etcd, calls on a sandbox go to its
//! node, lists are merged from every node.

use agentenv_cluster::placement::{Demand, place};
use agentenv_cluster::{Claim, ClaimOutcome, EntryState, Handoff, NodeRecord, SCHEMA_VERSION};
use agentenv_cluster::{MachineSize, SandboxEntry, SnapshotEntry, StateChange};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};

use super::locate::{handoff_record, running_node, token_hash};
use super::{CONTROL_DEADLINE, Gateway, GatewayError, proxy};
use agentenv_api::app::MAX_JSON_BYTES;
use agentenv_api::error::ApiError;
use agentenv_control::tenants::Tenant;

type Result<T, E = GatewayError> = std::result::Result<T, E>;

/// What placement assumes a new sandbox needs when no node reports its source's size (a template or
/// snapshot only the shared bucket holds).
const DEFAULT_SIZE: MachineSize = MachineSize {
    vcpus: 2,
    memory_mb: 512,
};
/// Nodes tried for one create (a node that refuses it, e.g. 429 at its quota, is skipped next time).
const CREATE_ATTEMPTS: usize = 3;
/// Largest create/fork/snapshot answer the gateway reads to learn ids.
const MAX_ANSWER_BYTES: usize = 4 << 20;
/// Longest wait for a new snapshot's chunks to reach the shared bucket.
const STORE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);

pub fn router() -> Router<Gateway> {
    Router::new()
        .route("/sandboxes", any(sandboxes))
        .route("/v2/sandboxes", any(sandboxes))
        .route("/sandboxes/{id}", any(by_id))
        .route("/sandboxes/{id}/{*rest}", any(by_id))
        .route("/v2/sandboxes/{id}/{*rest}", any(by_id))
        .route("/snapshots", get(list_snapshots))
        .route("/cluster/nodes", get(nodes))
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route(
            "/metrics",
            get(|| async { ApiError::not_found("the gateway has no metrics; ask each node") }),
        )
        .fallback(template_node)
}

fn tenant_of(req: &Request) -> Result<Tenant> {
    req.extensions()
        .get::<Tenant>()
        .cloned()
        .ok_or_else(|| GatewayError::Forbidden("Missing X-API-KEY header".into()))
}

/// `/sandboxes` and `/v2/sandboxes`: create (POST) or list (GET).
async fn sandboxes(State(gw): State<Gateway>, req: Request) -> Response {
    let r = match *req.method() {
        Method::POST => create(&gw, req).await,
        Method::GET => list(&gw, req).await,
        _ => Err(GatewayError::Invalid(format!(
            "method {} is not allowed here",
            req.method()
        ))),
    };
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn create(gw: &Gateway, req: Request) -> Result<Response> {
    let tenant = tenant_of(&req)?;
    let (parts, body) = req.into_parts();
    let body = proxy::read_body(body, MAX_JSON_BYTES).await?;
    let json: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| GatewayError::Invalid(format!("the body is not JSON: {e}")))?;
    let source = json
        .get("templateID")
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| GatewayError::Invalid("templateID is required".into()))?
        .to_string();
    let idempotency = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| {
            (1..=255).contains(&k.len())
                && k.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
        .map(str::to_string);
    let mounts = json
        .get("volumeMounts")
        .and_then(|m| m.as_array())
        .is_some_and(|m| !m.is_empty());
    let mut exclude: Vec<String> = vec![];
    let mut last_refusal = None;
    for _ in 0..CREATE_ATTEMPTS {
        let view = gw.views.view().await?;
        if mounts {
            // Volumes live on one node: a sandbox that mounts one runs there.
            let home = view.volume_node().map(|n| n.id.clone());
            exclude.extend(
                view.nodes
                    .iter()
                    .map(|n| &n.value.id)
                    .filter(|id| Some(*id) != home.as_ref() && !exclude.contains(id))
                    .cloned()
                    .collect::<Vec<_>>(),
            );
        }
        let size = view.size_of(&source).unwrap_or(DEFAULT_SIZE);
        let choice = match place(
            &view.candidates(),
            &Demand {
                vcpus: size.vcpus,
                memory_mb: size.memory_mb,
                source: &source,
                exclude: &exclude,
            },
        ) {
            Ok(c) => c,
            Err(e) => return last_refusal.ok_or(e.into()),
        };
        let claim = Claim {
            version: SCHEMA_VERSION,
            node: choice.node.clone(),
            vcpus: size.vcpus,
            memory_mb: size.memory_mb,
            at_ms: agentenv_control::sandboxes::now_ms(),
        };
        let idem = idempotency.as_deref().map(|k| (&*tenant.name, k));
        let node = match gw.views.claim(&claim, idem).await? {
            ClaimOutcome::Claimed => view.node(&choice.node).cloned(),
            // The first create with this key went there: the node answers it (it dedupes the key).
            ClaimOutcome::Duplicate(n) => gw.store.node(&n).await?,
            ClaimOutcome::NodeGone => None,
        };
        let Some(node) = node else { continue };
        let fwd = Request::from_parts(parts.clone(), Body::from(body.clone()));
        let resp = match proxy::forward(&gw.http, &node.id, &node.url, fwd, CONTROL_DEADLINE).await
        {
            Ok(r) => r,
            Err(e @ GatewayError::Node { .. }) => {
                tracing::warn!(node = %node.id, error = %e, "create: node unreachable; placing again");
                exclude.push(node.id.clone());
                continue;
            }
            Err(e) => return Err(e),
        };
        if matches!(
            resp.status(),
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) && idempotency.is_none()
        {
            // The node is full (its quota or its uids): another may have room.
            exclude.push(node.id.clone());
            last_refusal = Some(resp);
            continue;
        }
        let a_template = view
            .nodes
            .iter()
            .any(|n| n.value.templates.contains(&source));
        if resp.status() == StatusCode::NOT_FOUND && a_template && !choice.local {
            // A template that was to be imported from the bucket is not there (built before the node
            // shared one): only its holders can start it.
            tracing::warn!(node = %node.id, source = %source, "create: source not found on a node importing it; placing again");
            exclude.push(node.id.clone());
            last_refusal = Some(resp);
            continue;
        }
        if resp.status() != StatusCode::CREATED {
            return Ok(resp);
        }
        return record_created(gw, &node, &tenant, resp).await;
    }
    last_refusal.ok_or(GatewayError::NoPlacement(
        agentenv_cluster::Unplaceable::NoNodes,
    ))
}

/// A node's answer: its head, its body (at most [`MAX_ANSWER_BYTES`]) and the body as JSON (the
/// default when it is not).
async fn read_answer<T: serde::de::DeserializeOwned + Default>(
    resp: Response,
) -> Result<(axum::http::response::Parts, axum::body::Bytes, T)> {
    let (parts, body) = resp.into_parts();
    let bytes = proxy::read_body(body, MAX_ANSWER_BYTES).await?;
    let json = serde_json::from_slice(&bytes).unwrap_or_default();
    Ok((parts, bytes, json))
}

/// Puts a created sandbox into the map; a sandbox that cannot be recorded is killed (it could not be
/// routed to).
async fn record_created(
    gw: &Gateway,
    node: &NodeRecord,
    tenant: &Tenant,
    resp: Response,
) -> Result<Response> {
    let (parts, bytes, created) = read_answer::<serde_json::Value>(resp).await?;
    let (Some(id), Some(token)) = (
        created.get("sandboxID").and_then(|v| v.as_str()),
        created.get("envdAccessToken").and_then(|v| v.as_str()),
    ) else {
        return Err(GatewayError::Node {
            node: node.id.clone(),
            why: "its create answer has no sandboxID and envdAccessToken".into(),
        });
    };
    insert_entry(gw, node, &tenant.name, id, token).await?;
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

async fn insert_entry(
    gw: &Gateway,
    node: &NodeRecord,
    owner: &str,
    id: &str,
    token: &str,
) -> Result<()> {
    let entry = SandboxEntry {
        version: SCHEMA_VERSION,
        sandbox_id: id.into(),
        node: node.id.clone(),
        owner: owner.into(),
        state: EntryState::Running,
        handoff: None,
        updated_at_ms: agentenv_control::sandboxes::now_ms(),
        token_sha256: None,
    };
    match gw.store.insert_sandbox(&entry, &token_hash(token)).await {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::error!(sandbox = %id, node = %node.id, error = %e, "recording a new sandbox failed; killing it");
            let _ = gw
                .node_call(node, Method::DELETE, &format!("/sandboxes/{id}"), None)
                .await;
            Err(e.into())
        }
    }
}

/// The info of sandbox `id` from its entry's handoff record, when it is paused with one.
async fn paused_detail(gw: &Gateway, id: &str) -> Result<Option<Response>> {
    let Some(entry) = gw.store.sandbox(id).await? else {
        return Ok(None);
    };
    if !matches!(entry.value.state, EntryState::Paused | EntryState::Moving) {
        return Ok(None);
    }
    let Ok(rec) = handoff_record(&entry.value) else {
        return Ok(None);
    };
    let mut sandbox = rec.sandbox;
    sandbox.state = agentenv_control::sandboxes::SandboxState::Paused;
    Ok(Some(
        axum::Json(agentenv_api::views::detail(&sandbox, None, None)).into_response(),
    ))
}

/// `/sandboxes/{id}/...` and `/v2/sandboxes/{id}/...`: to the sandbox's node.
async fn by_id(State(gw): State<Gateway>, req: Request) -> Response {
    by_id_inner(&gw, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn by_id_inner(gw: &Gateway, req: Request) -> Result<Response> {
    let tenant = tenant_of(&req)?;
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/v2").unwrap_or(&path);
    let rest = rest.strip_prefix("/sandboxes/").unwrap_or(rest);
    let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
    let (id, action) = (id.to_string(), action.to_string());
    let method = req.method().clone();
    let resumes = method == Method::POST && matches!(action.as_str(), "connect" | "resume");
    let info = method == Method::GET && action.is_empty();
    let node = match running_node(gw, &id, Some(&tenant.name), |_| resumes).await {
        Ok(n) => n,
        // Killing a sandbox whose node is away: gone for clients now; the node kills its copy when
        // it returns (`join::drop_moved`).
        Err(GatewayError::SandboxLost { .. } | GatewayError::PausedElsewhere { .. })
            if method == Method::DELETE && action.is_empty() =>
        {
            if let Some(e) = gw.store.sandbox(&id).await? {
                gw.store.mark_killed(&e.value, None).await?;
            }
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        // Its info, from the handoff record: paused, resumable elsewhere.
        Err(e @ GatewayError::PausedElsewhere { .. }) if info => {
            return paused_detail(gw, &id).await?.ok_or(e);
        }
        Err(e) => return Err(e),
    };
    let resp = match proxy::forward(&gw.http, &node.id, &node.url, req, CONTROL_DEADLINE).await {
        // Its node is down but still holds its lease (no takeover yet): a paused sandbox's info still
        // comes from its handoff record.
        Err(e @ GatewayError::Node { .. }) if info => {
            return paused_detail(gw, &id).await?.ok_or(e);
        }
        r => r?,
    };
    let status = resp.status();
    match (method, action.as_str()) {
        (Method::POST, "pause") if status == StatusCode::NO_CONTENT => {
            paused(gw, &node, &id).await?;
        }
        (Method::POST, "connect" | "resume") if status.is_success() => {
            // Resumed where it was paused: the handoff snapshot is no base of anything (a moved
            // sandbox's is kept, see `locate::finish_move`).
            if let Some(h) = set_state(gw, &id, EntryState::Running, None).await? {
                drop_handoff(gw, &node, &h.snapshot_id).await;
            }
        }
        (Method::DELETE, "")
            if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_FOUND =>
        {
            gw.store.remove_sandbox(&id, None).await?;
        }
        (Method::POST, "fork") if status.is_success() => {
            return record_forks(gw, &node, &tenant, resp).await;
        }
        (Method::POST, "snapshots") if status.is_success() => {
            return record_snapshot(gw, &node, &tenant, resp).await;
        }
        _ => {}
    }
    Ok(resp)
}

/// After a pause: with a shared bucket the node hands the sandbox off (a snapshot in the bucket), so
/// another node can resume it if this one leaves.
async fn paused(gw: &Gateway, node: &NodeRecord, id: &str) -> Result<()> {
    let mut handoff = None;
    if node.shared_store {
        let path = format!("/cluster/sandboxes/{id}/handoff");
        match gw.node_call(node, Method::POST, &path, None).await {
            Ok(r) if r.status().is_success() => {
                let bytes = proxy::read_body(r.into_body(), MAX_ANSWER_BYTES).await?;
                match serde_json::from_slice::<agentenv_api::routes::HandoffBody>(&bytes) {
                    Ok(b) => {
                        handoff = Some(Handoff {
                            snapshot_id: b.snapshot_id,
                            record: serde_json::to_value(&b.handoff).unwrap_or_default(),
                        })
                    }
                    Err(e) => tracing::warn!(sandbox = %id, error = %e, "unreadable handoff"),
                }
            }
            Ok(r) => {
                tracing::warn!(sandbox = %id, status = %r.status(), "handoff refused; the sandbox resumes only on its node")
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "handoff failed; the sandbox resumes only on its node")
            }
        }
    }
    if let Some(old) = set_state(gw, id, EntryState::Paused, handoff).await? {
        drop_handoff(gw, node, &old.snapshot_id).await;
    }
    Ok(())
}

/// Records a sandbox's state; returns the handoff it replaced.
async fn set_state(
    gw: &Gateway,
    id: &str,
    state: EntryState,
    handoff: Option<Handoff>,
) -> Result<Option<Handoff>> {
    let now = agentenv_control::sandboxes::now_ms();
    match gw.store.set_state(id, None, state, handoff, now).await? {
        StateChange::Written { replaced } => Ok(replaced),
        StateChange::Skipped => {
            tracing::warn!(sandbox = %id, "its entry is gone or kept changing; state not recorded");
            Ok(None)
        }
    }
}

/// Deletes a handoff snapshot that is no longer needed (its sandbox runs again); best effort.
async fn drop_handoff(gw: &Gateway, node: &NodeRecord, snapshot_id: &str) {
    let path = format!("/cluster/snapshots/{snapshot_id}");
    match gw.node_call(node, Method::DELETE, &path, None).await {
        Ok(r) if r.status().is_success() => {}
        Ok(r) => {
            tracing::warn!(snapshot = %snapshot_id, status = %r.status(), "deleting a handoff snapshot was refused")
        }
        Err(e) => {
            tracing::warn!(snapshot = %snapshot_id, error = %e, "deleting a handoff snapshot failed")
        }
    }
}

async fn record_forks(
    gw: &Gateway,
    node: &NodeRecord,
    tenant: &Tenant,
    resp: Response,
) -> Result<Response> {
    let (parts, bytes, forks) = read_answer::<Vec<serde_json::Value>>(resp).await?;
    for s in forks.iter().filter_map(|f| f.get("sandbox")) {
        if let (Some(id), Some(token)) = (
            s.get("sandboxID").and_then(|v| v.as_str()),
            s.get("envdAccessToken").and_then(|v| v.as_str()),
        ) {
            insert_entry(gw, node, &tenant.name, id, token).await?;
        }
    }
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

async fn record_snapshot(
    gw: &Gateway,
    node: &NodeRecord,
    tenant: &Tenant,
    resp: Response,
) -> Result<Response> {
    let (parts, bytes, snap) = read_answer::<serde_json::Value>(resp).await?;
    if let Some(id) = snap.get("snapshotID").and_then(|v| v.as_str()) {
        let names = snap
            .get("names")
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if node.shared_store {
            wait_stored(gw, node, id).await?;
        }
        let entry = SnapshotEntry {
            version: SCHEMA_VERSION,
            snapshot_id: id.into(),
            node: node.id.clone(),
            owner: tenant.name.to_string(),
            names,
        };
        if let Err(e) = gw.store.put_snapshot(&entry).await {
            tracing::warn!(snapshot = %id, error = %e, "recording the snapshot's node failed");
        }
    }
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

/// Waits (at most [`STORE_DEADLINE`]) until snapshot `id` is durable in the shared bucket, so any node
/// can start sandboxes from it once the snapshot call answered.
async fn wait_stored(gw: &Gateway, node: &NodeRecord, id: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + STORE_DEADLINE;
    let path = format!("/cluster/snapshots/{id}");
    loop {
        let r = gw.node_call(node, Method::GET, &path, None).await?;
        if r.status().is_success() {
            let bytes = proxy::read_body(r.into_body(), 64 << 10).await?;
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            if v.get("stored").and_then(|s| s.as_bool()) == Some(true) {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(GatewayError::NodeTimeout {
                node: node.id.clone(),
                secs: STORE_DEADLINE.as_secs(),
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Everything else (templates, template builds, snapshot deletes, the OpenAPI document): the node a
/// snapshot was taken on for `/templates/snap-...`, else the live node with the smallest id, so the
/// steps of one template build all reach the same node.
async fn template_node(State(gw): State<Gateway>, req: Request) -> Response {
    let r: Result<Response> = async {
        let view = gw.views.view().await?;
        let id = req
            .uri()
            .path()
            .strip_prefix("/templates/")
            .map(|r| r.split('/').next().unwrap_or_default().to_string());
        let mut target = None;
        if let Some(id) = id.filter(|i| agentenv_control::keys::is_snapshot_id(i))
            && let Some(s) = gw.store.snapshot(&id).await?
        {
            target = view.node(&s.node).cloned();
        }
        let node = match target {
            Some(n) => n,
            None => view
                .volume_node()
                .cloned()
                .ok_or(GatewayError::NoPlacement(
                    agentenv_cluster::Unplaceable::NoNodes,
                ))?,
        };
        proxy::forward(&gw.http, &node.id, &node.url, req, CONTROL_DEADLINE).await
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

mod lists;
use lists::{list, list_snapshots, nodes};
