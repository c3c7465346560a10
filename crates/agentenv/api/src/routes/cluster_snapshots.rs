//! Snapshot and fork routes, and the node's cluster routes (handoff, adopt).

use super::*;

#[utoipa::path(post, path = "/sandboxes/{sandboxID}/snapshots", tag = "snapshots", request_body = SnapshotRequest,
    params(("sandboxID" = String, Path)),
    responses((status = 201, body = SnapshotView), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 429, body = ErrorBody, description = "past the key's snapshot quota (count or bytes)"),
        (status = 507, body = ErrorBody, description = "past the server's budget for stored snapshots")),
    security(("ApiKeyAuth" = [])))]
pub async fn create_snapshot(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<SnapshotRequest>,
) -> ApiResult<(StatusCode, Json<SnapshotView>)> {
    let info = s
        .sandboxes
        .snapshot(&who, &id, req.name, req.memory.unwrap_or(true))
        .await?;
    Ok((StatusCode::CREATED, Json(views::snapshot(&info))))
}

/// List snapshots, oldest first. Query: `sandboxID`, `name` (`name[:tag]`), `limit`, `nextToken`.
/// More pages: header `x-next-token`.
#[utoipa::path(get, path = "/snapshots", tag = "snapshots",
    params(("sandboxID" = Option<String>, Query), ("name" = Option<String>, Query),
        ("limit" = Option<u32>, Query), ("nextToken" = Option<String>, Query)),
    responses((status = 200, body = Vec<SnapshotView>, headers(("x-next-token" = String, description = "cursor of the next page"))),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn list_snapshots(
    State(s): State<AppState>,
    Who(who): Who,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = views::parse_snapshot_query(raw.as_deref())?;
    let all = s
        .sandboxes
        .snapshots(&who, q.sandbox_id.as_deref(), q.name.as_deref())?;
    let start = match &q.next_token {
        None => 0,
        Some(t) => all
            .iter()
            .position(|x| &x.id == t)
            .map(|i| i + 1)
            .ok_or_else(|| ApiError::bad_request(format!("invalid nextToken '{t}'")))?,
    };
    let page: Vec<SnapshotView> = all[start..]
        .iter()
        .take(q.limit)
        .map(views::snapshot)
        .collect();
    let mut resp = Json(&page).into_response();
    if start + page.len() < all.len()
        && let Some(last) = page.last()
        && let Ok(v) = HeaderValue::from_str(&last.snapshot_id)
    {
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// Delete a snapshot (E2B lists snapshots as templates). Sandboxes made from it keep running.
#[utoipa::path(delete, path = "/templates/{templateID}", tag = "snapshots",
    params(("templateID" = String, Path, description = "snapshot id or name")),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 401, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn delete_template(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    s.sandboxes.delete_snapshot(&who, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Fork a sandbox into `count` (1-20) new running sandboxes: one capture, restored copy-on-write.
#[utoipa::path(post, path = "/sandboxes/{sandboxID}/fork", tag = "sandboxes", request_body = ForkRequest,
    params(("sandboxID" = String, Path)),
    responses((status = 201, body = Vec<ForkResult>), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub async fn fork(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
    E2bJson(req): E2bJson<ForkRequest>,
) -> ApiResult<(StatusCode, Json<Vec<ForkResult>>)> {
    let results = s.sandboxes.fork(&who, &id, req.count, req.timeout).await?;
    let out = results
        .into_iter()
        .map(|r| match r {
            Ok(rec) => ForkResult {
                sandbox: Some(views::created(&rec, s.sandbox_domain.as_deref())),
                error: None,
            },
            Err(e) => {
                let e = ApiError::from(e);
                ForkResult {
                    sandbox: None,
                    error: Some(ErrorBody {
                        code: e.status.as_u16(),
                        message: e.message,
                        sandbox_id: e.sandbox_id,
                    }),
                }
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(out)))
}

/// Body of `POST /cluster/adopt` and answer of `POST /cluster/sandboxes/{id}/handoff`: node to node
/// through the gateway, not part of the E2B API (so not in the OpenAPI document).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HandoffBody {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub handoff: crate::sandboxes::HandoffRecord,
}

/// The cluster routes are the server key's only (gateways hold it); any other key gets 403.
fn server_key_only(who: &Caller) -> ApiResult<()> {
    match who {
        Caller::Tenant(t) if &**t == crate::tenants::DEFAULT_TENANT => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "cluster routes need the server's own key",
        )),
    }
}

/// Snapshots a paused sandbox into the shared store for another node (`agentenv gateway` calls it after
/// a pause).
pub async fn cluster_handoff(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<HandoffBody>> {
    server_key_only(&who)?;
    let (snapshot_id, handoff) = s.sandboxes.handoff(&Caller::Server, &id).await?;
    Ok(Json(HandoffBody {
        snapshot_id,
        handoff,
    }))
}

/// Continues a sandbox handed off by a node that left the cluster.
pub async fn cluster_adopt(
    State(s): State<AppState>,
    Who(who): Who,
    body: Result<Json<HandoffBody>, axum::extract::rejection::JsonRejection>,
) -> ApiResult<(StatusCode, Json<CreatedSandbox>)> {
    server_key_only(&who)?;
    let Json(body) = body.map_err(|e| ApiError::bad_request(e.body_text()))?;
    let rec = s.sandboxes.adopt(body.handoff, &body.snapshot_id).await?;
    let domain = s.sandbox_domain.as_deref();
    Ok((StatusCode::CREATED, Json(views::created(&rec, domain))))
}

/// Whether a snapshot's chunks are durable in the store yet (`GET /cluster/snapshots/{id}`), so a
/// gateway can answer a snapshot request only once every node can import it.
pub async fn cluster_snapshot(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    server_key_only(&who)?;
    let snap = s
        .sandboxes
        .backend()
        .snapshots()
        .into_iter()
        .find(|x| x.id == id)
        .ok_or_else(|| ApiError::not_found(format!("snapshot '{id}' not found")))?;
    Ok(Json(
        serde_json::json!({"snapshotID": snap.id, "stored": snap.stored.is_some()}),
    ))
}

/// Deletes a handoff snapshot (`DELETE /cluster/snapshots/{id}`) once its sandbox runs again.
pub async fn cluster_drop_handoff(
    State(s): State<AppState>,
    Who(who): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    server_key_only(&who)?;
    s.sandboxes.drop_handoff(&id)?;
    Ok(StatusCode::NO_CONTENT)
}
