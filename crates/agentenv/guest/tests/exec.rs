//! `/exec` (the host's command runner for template builds), against the real binary: output, exit
//! codes, stdin, environment and folder, background starts, deadlines and bad requests.

mod common;

use agentenv_envd::{ExecEvent, ExecRequest};
use base64::Engine;
use bytes::Bytes;
use common::{Guest, random_bytes, token};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};

fn me() -> String {
    std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "root".into())
}

async fn exec(g: &Guest, req: &ExecRequest) -> (StatusCode, Vec<ExecEvent>) {
    let r = Request::post(agentenv_envd::paths::EXEC)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(req).unwrap())))
        .unwrap();
    let resp = g.send(r).await;
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    if !status.is_success() {
        return (status, vec![]);
    }
    let events = body
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).unwrap())
        .collect();
    (status, events)
}

fn output(evs: &[ExecEvent]) -> (String, String, Option<i32>) {
    let (mut out, mut err, mut code) = (String::new(), String::new(), None);
    for e in evs {
        match e {
            ExecEvent::Stdout(t) => out.push_str(t),
            ExecEvent::Stderr(t) => err.push_str(t),
            ExecEvent::Exit { code: c, .. } => code = Some(*c),
            _ => {}
        }
    }
    (out, err, code)
}

#[tokio::test]
async fn output_exit_code_env_folder_and_stdin() {
    let g = Guest::start(&[]).await;
    let t = token();
    let dir = tempfile::tempdir().unwrap();
    let (st, evs) = exec(
        &g,
        &ExecRequest {
            cmd: "echo out-$TOKEN; pwd; echo err >&2; exit 3".into(),
            user: me(),
            cwd: Some(dir.path().display().to_string()),
            envs: [("TOKEN".to_string(), t.clone())].into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let (out, err, code) = output(&evs);
    assert_eq!(out, format!("out-{t}\n{}\n", dir.path().display()));
    assert_eq!(err, "err\n");
    assert_eq!(code, Some(3));
    assert!(matches!(evs.last(), Some(ExecEvent::Exit { .. })));

    // Standard input arrives whole (binary, larger than a pipe buffer).
    let data = random_bytes(300_000);
    let file = dir.path().join("in.bin");
    let (_, evs) = exec(
        &g,
        &ExecRequest {
            cmd: format!("cat > {}", file.display()),
            user: me(),
            stdin_b64: Some(base64::engine::general_purpose::STANDARD.encode(&data)),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(output(&evs).2, Some(0));
    assert_eq!(std::fs::read(&file).unwrap(), data);
}

#[tokio::test]
async fn background_starts_deadlines_and_bad_requests() {
    let g = Guest::start(&[]).await;
    let (_, evs) = exec(
        &g,
        &ExecRequest {
            cmd: "sleep 30".into(),
            user: me(),
            background: true,
            ..Default::default()
        },
    )
    .await;
    let Some(ExecEvent::Started(pid)) = evs.first() else {
        panic!("no start: {evs:?}")
    };
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    // SAFETY: signals the process group of the child we just started.
    unsafe { libc::kill(-(*pid as i32), libc::SIGKILL) };

    let t0 = std::time::Instant::now();
    let (_, evs) = exec(
        &g,
        &ExecRequest {
            cmd: "sleep 20".into(),
            user: me(),
            timeout_ms: 300,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(output(&evs).2, Some(-1), "{evs:?}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(10));

    let (st, _) = exec(
        &g,
        &ExecRequest {
            cmd: "true".into(),
            user: format!("nobody-{}", token()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, _) = exec(
        &g,
        &ExecRequest {
            cmd: "true".into(),
            user: me(),
            stdin_b64: Some("%%%".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
}
