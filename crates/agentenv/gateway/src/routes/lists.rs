//! Lists merged over the nodes (sandboxes, snapshots) and the node list.

use super::*;

/// Asks every live node (the client's key and query), in parallel; the answers in node order, without
/// nodes that cannot be reached.
pub(super) async fn ask_all(gw: &Gateway, req: Request) -> Result<Vec<(NodeRecord, Response)>> {
    let view = gw.views.view().await?;
    let (parts, _) = req.into_parts();
    let calls = view.nodes.iter().map(|n| {
        let node = n.value.clone();
        let req = Request::from_parts(parts.clone(), Body::empty());
        async move {
            let r = proxy::forward(&gw.http, &node.id, &node.url, req, CONTROL_DEADLINE).await;
            (node, r)
        }
    });
    let mut out = vec![];
    for (node, r) in futures_util::future::join_all(calls).await {
        let resp = match r {
            Ok(r) => r,
            // A node that just died is still registered until its lease expires: list without it.
            Err(e @ (GatewayError::Node { .. } | GatewayError::NodeTimeout { .. })) => {
                tracing::warn!(node = %node.id, error = %e, "listing without an unreachable node");
                continue;
            }
            Err(e) => return Err(e),
        };
        if !resp.status().is_success() {
            // A 4xx is the same for every node (bad query, bad key): pass the first one on.
            return Err(GatewayError::Upstream(Box::new(resp)));
        }
        out.push((node, resp));
    }
    Ok(out)
}

/// Merged `GET /sandboxes` and `GET /v2/sandboxes`: every node's page after the cursor, merged in
/// the nodes' order (start time, id), cut to `limit`. A sandbox a node still lists but the map puts
/// elsewhere (it moved) is left out; paused ones whose node left are listed from their handoff.
pub(super) async fn list(gw: &Gateway, req: Request) -> Result<Response> {
    let tenant = tenant_of(&req)?;
    let q = agentenv_api::views::parse_list_query(req.uri().query()).map_err(GatewayError::Api)?;
    let v2 = req.uri().path().starts_with("/v2/");
    let answers = ask_all(gw, req).await?;
    let entries = gw.store.sandboxes().await?;
    let live: std::collections::HashSet<String> =
        answers.iter().map(|(n, _)| n.id.clone()).collect();
    let mut more = false;
    let mut items: Vec<(i64, String, serde_json::Value)> = vec![];
    for (node, resp) in answers {
        more |= resp.headers().contains_key("x-next-token");
        let bytes = proxy::read_body(resp.into_body(), MAX_ANSWER_BYTES * 4).await?;
        let listed: Vec<serde_json::Value> = serde_json::from_slice(&bytes).unwrap_or_default();
        for item in listed {
            let id = item
                .get("sandboxID")
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            let owner = entries.iter().find(|e| e.sandbox_id == id);
            if owner.is_some_and(|e| e.node != node.id || e.state == EntryState::Killed) {
                continue;
            }
            items.push(sort_key(item));
        }
    }
    let want_paused = q
        .filter
        .states
        .as_ref()
        .is_none_or(|s| s.contains(&agentenv_control::sandboxes::SandboxState::Paused));
    for e in entries
        .iter()
        .filter(|e| v2 && want_paused && e.owner == *tenant.name && !live.contains(&e.node))
    {
        let Ok(rec) = super::handoff_record(e) else {
            continue;
        };
        let meta_ok = q
            .filter
            .metadata
            .iter()
            .all(|(k, v)| rec.sandbox.metadata.get(k) == Some(v));
        if meta_ok {
            let view = agentenv_api::views::listed(&rec.sandbox);
            items.push(sort_key(serde_json::to_value(view).unwrap_or_default()));
        }
    }
    items.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    if q.filter.descending {
        items.reverse();
    }
    let more = more || items.len() > q.limit;
    items.truncate(q.limit);
    let next = more
        .then(|| items.last().map(|(ms, id, _)| format!("{ms}_{id}")))
        .flatten();
    let body: Vec<serde_json::Value> = items.into_iter().map(|(_, _, v)| v).collect();
    let mut resp = axum::Json(body).into_response();
    if let Some(t) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        resp.headers_mut().insert("x-next-token", t);
    }
    Ok(resp)
}

pub(super) fn sort_key(item: serde_json::Value) -> (i64, String, serde_json::Value) {
    let ms = item
        .get("startedAt")
        .and_then(|v| v.as_str())
        .and_then(agentenv_control::sandboxes::parse_rfc3339_ms)
        .unwrap_or(0);
    let id = item
        .get("sandboxID")
        .and_then(|v| v.as_str())
        .unwrap_or_default()
        .to_string();
    (ms, id, item)
}

/// Merged `GET /snapshots`: every node's, each snapshot once (nodes that imported one list it too).
pub(super) async fn list_snapshots(State(gw): State<Gateway>, req: Request) -> Response {
    let r: Result<Response> = async {
        let mut seen = std::collections::HashSet::new();
        let mut out = vec![];
        for (_, resp) in ask_all(&gw, req).await? {
            let bytes = proxy::read_body(resp.into_body(), MAX_ANSWER_BYTES * 4).await?;
            let listed: Vec<serde_json::Value> = serde_json::from_slice(&bytes).unwrap_or_default();
            for s in listed {
                let id = s
                    .get("snapshotID")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default();
                if seen.insert(id.to_string()) {
                    out.push(s);
                }
            }
        }
        Ok(axum::Json(out).into_response())
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /cluster/nodes` (server key only): the live nodes' records.
pub(super) async fn nodes(State(gw): State<Gateway>, req: Request) -> Response {
    let is_default = tenant_of(&req).map(|t| t.is_default());
    let r: Result<Response> = async {
        if !is_default? {
            return Err(GatewayError::Forbidden(
                "the node list needs the server's own key".into(),
            ));
        }
        let view = gw.views.view().await?;
        let nodes: Vec<NodeRecord> = view.nodes.into_iter().map(|n| n.value).collect();
        Ok(axum::Json(nodes).into_response())
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}
