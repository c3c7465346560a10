//! Connect-RPC methods of `process.Process` and `filesystem.Filesystem` (docs/specs/e2b-compat.md §6).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::Agent;
use crate::envd::{self, Code, RpcError};
use crate::http::{
    Body, MAX_JSON_BODY, channel_body, full, json_response, read_body, request_user, rpc_error,
};
use crate::process::{ProcEvent, SpawnSpec};
use crate::users::User;
use crate::{fs, watch};

/// Keepalive interval when the client sends no `Keepalive-Ping-Interval`.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

/// Routes `/process.Process/*` and `/filesystem.Filesystem/*`.
pub async fn dispatch(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = path.rsplit('/').next().unwrap_or("").to_string();
    let service = if path.starts_with("/process.") {
        Service::Process
    } else {
        Service::Filesystem
    };
    let streaming = matches!(
        (service, method.as_str()),
        (Service::Process, "Start" | "Connect" | "StreamInput") | (Service::Filesystem, "WatchDir")
    );
    if let Err(resp) = check_content_type(req.headers(), streaming) {
        return *resp;
    }
    let user = match request_user(&agent, req.headers(), None) {
        Ok(u) => u,
        Err(e) => return rpc_error(&e),
    };
    let headers = req.headers().clone();
    match (service, method.as_str()) {
        (Service::Process, "StreamInput") => stream_input(&agent, req.into_body()).await,
        (Service::Process, "Start" | "Connect") | (Service::Filesystem, "WatchDir") => {
            let msg = match read_stream_request(req.into_body()).await {
                Ok(m) => m,
                Err(e) => return stream_error(&e),
            };
            let ka = keepalive_interval(&headers);
            let r = match (service, method.as_str()) {
                (Service::Process, "Start") => {
                    agent.network_settled().await;
                    start(&agent, &user, &msg, &headers, ka)
                }
                (Service::Process, _) => connect(&agent, &msg, &headers, ka),
                _ => watch_dir(&user, &msg, ka),
            };
            r.unwrap_or_else(|e| stream_error(&e))
        }
        _ => {
            let body = match read_body(req.into_body(), MAX_JSON_BODY).await {
                Ok(b) => b,
                Err(e) => return rpc_error(&e),
            };
            let result = match service {
                Service::Process => unary_process(&agent, &method, &body).await,
                Service::Filesystem => crate::blocking(|| unary_fs(&agent, &user, &method, &body)),
            };
            match result {
                Ok(v) => json_response(StatusCode::OK, &v),
                Err(e) => rpc_error(&e),
            }
        }
    }
}

/// The Connect protocol's content types for the one codec envd speaks: unary calls carry
/// `application/json`, streaming calls `application/connect+json`. Anything else is refused with
/// 415 and the accepted type in `Accept-Post`, before the body is read.
fn check_content_type(h: &HeaderMap, streaming: bool) -> Result<(), Box<Response<Body>>> {
    let want = if streaming {
        "application/connect+json"
    } else {
        "application/json"
    };
    let got = h
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?"))
        .unwrap_or("");
    let base = got.split(';').next().unwrap_or("").trim();
    if base.eq_ignore_ascii_case(want) {
        return Ok(());
    }
    let e = RpcError::new(
        Code::InvalidArgument,
        format!("unsupported content type {got:?}: this method takes {want}"),
    );
    let mut resp = json_response(StatusCode::UNSUPPORTED_MEDIA_TYPE, &e.to_json());
    resp.headers_mut()
        .insert("accept-post", http::HeaderValue::from_static(want));
    Err(Box::new(resp))
}

#[derive(Clone, Copy)]
enum Service {
    Process,
    Filesystem,
}

fn keepalive_interval(h: &HeaderMap) -> Duration {
    h.get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_KEEPALIVE, Duration::from_secs)
}

fn timeout_header(h: &HeaderMap) -> Option<Duration> {
    h.get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
}

/// The single message of a server-streaming request (enveloped, or bare JSON).
async fn read_stream_request(body: Incoming) -> Result<Bytes, RpcError> {
    let raw = read_body(body, MAX_JSON_BODY).await?;
    let mut buf = raw.to_vec();
    match envd::take_envelope(&mut buf, MAX_JSON_BODY) {
        Ok(Some((_, msg))) if raw.first().is_some_and(|b| *b == 0) => Ok(msg.into()),
        _ => Ok(raw),
    }
}

/// A server-streaming call's error, as connect-go sends it: HTTP 200 and one end-of-stream message
/// carrying the error (connect-es reads any other status as a bare HTTP code, 404 as `unimplemented`).
fn stream_error(e: &RpcError) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/connect+json")
        .body(full(envd::end_stream(Some(e))))
        .unwrap_or_else(|_| rpc_error(e))
}

fn stream_response() -> (mpsc::Sender<Bytes>, Response<Body>) {
    let (tx, body) = channel_body();
    let resp = Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/connect+json")
        .body(body)
        .unwrap_or_else(|_| Response::new(full(Bytes::new())));
    (tx, resp)
}

fn start(
    agent: &Agent,
    user: &User,
    msg: &[u8],
    h: &HeaderMap,
    ka: Duration,
) -> Result<Response<Body>, RpcError> {
    let req: envd::StartRequest = envd::parse(msg)?;
    if req.process.cmd.is_empty() {
        return Err(RpcError::new(Code::InvalidArgument, "process.cmd is empty"));
    }
    let settings = agent.settings();
    let spec = SpawnSpec {
        config: req.process,
        tag: req.tag,
        pty: req.pty.map(|p| p.size),
        stdin: req.stdin.unwrap_or(true),
        user: user.clone(),
        base_env: settings.env_vars,
        default_cwd: settings.default_workdir,
        timeout: timeout_header(h),
    };
    let (proc, rx) = agent.procs.spawn(spec)?;
    let (tx, resp) = stream_response();
    // The deadline kills the process (SpawnSpec::timeout); its end then ends the stream.
    tokio::spawn(pump_process(proc.pid, rx, tx, ka, None));
    Ok(resp)
}

fn connect(
    agent: &Agent,
    msg: &[u8],
    h: &HeaderMap,
    ka: Duration,
) -> Result<Response<Body>, RpcError> {
    let req: envd::SelectorRequest = envd::parse(msg)?;
    let proc = agent.procs.find(&req.process)?;
    let rx = proc
        .subscribe()
        .ok_or_else(|| RpcError::new(Code::NotFound, format!("process {} has ended", proc.pid)))?;
    let (tx, resp) = stream_response();
    // The stream's deadline ends the stream only: the process keeps running.
    tokio::spawn(pump_process(proc.pid, rx, tx, ka, timeout_header(h)));
    Ok(resp)
}

/// The end of a stream cut by its Connect-Timeout-Ms, as envd ends it.
fn deadline_exceeded() -> Bytes {
    envd::end_stream(Some(&RpcError::new(
        Code::DeadlineExceeded,
        "the request ran past its Connect-Timeout-Ms",
    )))
}

async fn send(tx: &mpsc::Sender<Bytes>, v: &Value) -> bool {
    tx.send(envd::envelope(0, v)).await.is_ok()
}

/// Forwards process events as Connect envelopes; stops quietly when the client goes away
/// (the process keeps running). A process killed at its deadline, or a stream past `deadline`,
/// ends with `deadline_exceeded`.
async fn pump_process(
    pid: u32,
    mut rx: mpsc::Receiver<ProcEvent>,
    tx: mpsc::Sender<Bytes>,
    ka: Duration,
    deadline: Option<Duration>,
) {
    if !send(&tx, &envd::start_event(pid)).await {
        return;
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + ka, ka);
    let expire = async {
        match deadline {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expire);
    loop {
        tokio::select! {
            () = &mut expire => {
                let _ = tx.send(deadline_exceeded()).await;
                return;
            }
            ev = rx.recv() => match ev {
                Some(ProcEvent::Data(stream, bytes)) => {
                    if !send(&tx, &envd::data_event(stream, &bytes)).await {
                        return;
                    }
                }
                Some(ProcEvent::End { timed_out: true, .. }) => {
                    let _ = tx.send(deadline_exceeded()).await;
                    return;
                }
                Some(ProcEvent::End { exit_code, exited, status, .. }) => {
                    if send(&tx, &envd::end_event(exit_code, exited, &status, None)).await {
                        let _ = tx.send(envd::end_stream(None)).await;
                    }
                    return;
                }
                None => {
                    let e = RpcError::new(Code::Unknown, "process ended without an end event");
                    let _ = tx.send(envd::end_stream(Some(&e))).await;
                    return;
                }
            },
            _ = tick.tick() => {
                if !send(&tx, &envd::keepalive_event()).await {
                    return;
                }
            }
            _ = tx.closed() => return,
        }
    }
}

fn watch_dir(user: &User, msg: &[u8], ka: Duration) -> Result<Response<Body>, RpcError> {
    let req: envd::WatchRequest = envd::parse(msg)?;
    let dir = fs::resolve(user, &req.path)?;
    let w = watch::watch_dir(&dir, &req)?;
    let (tx, resp) = stream_response();
    tokio::spawn(async move {
        let mut w = w; // move the whole watch (not just `rx`) so inotify stays registered
        if !send(&tx, &json!({"start": {}})).await {
            return;
        }
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + ka, ka);
        loop {
            tokio::select! {
                ev = w.rx.recv() => match ev {
                    Some(ev) => if !send(&tx, &json!({"filesystem": ev})).await { return },
                    None => {
                        let _ = tx.send(envd::end_stream(None)).await;
                        return;
                    }
                },
                _ = tick.tick() => if !send(&tx, &json!({"keepalive": {}})).await { return },
                _ = tx.closed() => return,
            }
        }
    });
    Ok(resp)
}

/// StreamInput: `start` then `data`/`keepalive` envelopes until the request body ends.
async fn stream_input(agent: &Agent, mut body: Incoming) -> Response<Body> {
    let result: Result<(), RpcError> = async {
        let mut buf = Vec::new();
        let mut target = None;
        loop {
            while let Some((flags, msg)) = envd::take_envelope(&mut buf, MAX_JSON_BODY)? {
                if flags & envd::FLAG_END_STREAM != 0 {
                    return Ok(());
                }
                let m: envd::StreamInputRequest = envd::parse(&msg)?;
                if let Some(start) = m.start {
                    target = Some(agent.procs.find(&start.process)?);
                } else if let Some(data) = m.data {
                    let p = target.as_ref().ok_or_else(|| {
                        RpcError::new(Code::FailedPrecondition, "data before start")
                    })?;
                    p.write_input(data.input.bytes()?).await?;
                }
            }
            match body.frame().await {
                None => return Ok(()),
                Some(Err(e)) => {
                    return Err(RpcError::new(Code::Canceled, format!("request body: {e}")));
                }
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
    .await;
    let mut out = Vec::new();
    match &result {
        Ok(()) => {
            out.extend_from_slice(&envd::envelope(0, &json!({})));
            out.extend_from_slice(&envd::end_stream(None));
        }
        Err(e) => out.extend_from_slice(&envd::end_stream(Some(e))),
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/connect+json")
        .body(full(out))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

async fn unary_process(agent: &Agent, method: &str, body: &[u8]) -> Result<Value, RpcError> {
    match method {
        "List" => {
            // No fields, but the body must still be a JSON object (Connect's invalid_argument).
            let _: serde_json::Map<String, Value> = envd::parse(body)?;
            let procs: Vec<Value> = agent
                .procs
                .list()
                .iter()
                .map(|p| envd::process_info(&p.config, p.pid, p.tag.as_deref()))
                .collect();
            Ok(json!({"processes": procs}))
        }
        "SendInput" => {
            let r: envd::SendInputRequest = envd::parse(body)?;
            agent
                .procs
                .find(&r.process)?
                .write_input(r.input.bytes()?)
                .await?;
            Ok(json!({}))
        }
        "SendSignal" => {
            let r: envd::SendSignalRequest = envd::parse(body)?;
            let sig = r.signal_number()?;
            agent.procs.find(&r.process)?.signal(sig)?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let r: envd::SelectorRequest = envd::parse(body)?;
            agent.procs.find(&r.process)?.close_input().await?;
            Ok(json!({}))
        }
        "Update" => {
            let r: envd::UpdateRequest = envd::parse(body)?;
            let p = agent.procs.find(&r.process)?;
            if let Some(pty) = r.pty {
                p.resize(pty.size)?;
            }
            Ok(json!({}))
        }
        other => Err(RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not implemented"),
        )),
    }
}

fn unary_fs(agent: &Agent, user: &User, method: &str, body: &[u8]) -> Result<Value, RpcError> {
    match method {
        "Stat" => {
            let r: envd::PathRequest = envd::parse(body)?;
            Ok(json!({"entry": fs::stat(&fs::resolve(user, &r.path)?)?}))
        }
        "ListDir" => {
            let r: envd::ListDirRequest = envd::parse(body)?;
            Ok(json!({"entries": fs::list_dir(&fs::resolve(user, &r.path)?, r.depth)?}))
        }
        "MakeDir" => {
            let r: envd::PathRequest = envd::parse(body)?;
            Ok(json!({"entry": fs::make_dir(&fs::resolve(user, &r.path)?, user)?}))
        }
        "Move" => {
            let r: envd::MoveRequest = envd::parse(body)?;
            let (src, dst) = (
                fs::resolve(user, &r.source)?,
                fs::resolve(user, &r.destination)?,
            );
            Ok(json!({"entry": fs::move_entry(&src, &dst, user)?}))
        }
        "Remove" => {
            let r: envd::PathRequest = envd::parse(body)?;
            fs::remove(&fs::resolve(user, &r.path)?)?;
            Ok(json!({}))
        }
        "CreateWatcher" => {
            let r: envd::WatchRequest = envd::parse(body)?;
            let id = agent.watchers.create(&fs::resolve(user, &r.path)?, &r)?;
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" => {
            let r: envd::WatcherIdRequest = envd::parse(body)?;
            Ok(json!({"events": agent.watchers.take_events(&r.watcher_id)?}))
        }
        "RemoveWatcher" => {
            let r: envd::WatcherIdRequest = envd::parse(body)?;
            agent.watchers.remove(&r.watcher_id)?;
            Ok(json!({}))
        }
        other => Err(RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not implemented"),
        )),
    }
}
