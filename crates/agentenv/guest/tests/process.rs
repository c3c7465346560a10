//! process.Process over HTTP against the real `agentenv-guest serve`.

mod common;

use common::{Guest, bash, expect_start, random_bytes, to_b64, token};
use http::StatusCode;
use serde_json::json;

#[tokio::test]
async fn start_streams_stdout_stderr_and_exit_code() {
    let g = Guest::start(&[]).await;
    let t = token();
    let code = rand::random_range(1..120);
    let mut s = g
        .stream(
            "/process.Process/Start",
            bash(&format!("echo out{t}; echo err{t} >&2; exit {code}")),
            &[],
        )
        .await;
    let pid = expect_start(&mut s).await;
    assert!(pid > 0);
    let out = s.collect_process().await;
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("out{t}\n"));
    assert_eq!(String::from_utf8(out.stderr).unwrap(), format!("err{t}\n"));
    let end = out.end.expect("end event");
    assert_eq!(end["exitCode"], code);
    assert_eq!(end["exited"], true);
    assert_eq!(end["status"], format!("exit status {code}"));
    assert_eq!(out.eos.unwrap(), json!({}));
}

#[tokio::test]
async fn large_output_arrives_complete() {
    let g = Guest::start(&[]).await;
    let n = rand::random_range(200_000..400_000);
    let mut s = g
        .stream(
            "/process.Process/Start",
            bash(&format!("head -c {n} /dev/zero | tr '\\0' x")),
            &[],
        )
        .await;
    expect_start(&mut s).await;
    let out = s.collect_process().await;
    assert_eq!(out.stdout.len(), n);
    assert!(out.stdout.iter().all(|b| *b == b'x'));
    assert!(out.end.unwrap().get("exitCode").is_none());
}

#[tokio::test]
async fn env_cwd_and_missing_cwd() {
    let g = Guest::start(&[]).await;
    let t = token();
    let dir = g.dir.path().to_path_buf();
    let req = json!({"process": {"cmd": "/bin/bash", "args": ["-c", "echo $K3VAR; pwd"],
        "envs": {"K3VAR": t}, "cwd": dir.display().to_string()}, "stdin": false});
    let mut s = g.stream("/process.Process/Start", req, &[]).await;
    expect_start(&mut s).await;
    let out = s.collect_process().await;
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{t}\n{}\n", dir.display())
    );

    let req = json!({"process": {"cmd": "/bin/true", "cwd": format!("/nonexistent-{t}")}});
    let err = g.stream_error("/process.Process/Start", req).await;
    assert_eq!(err["code"], "invalid_argument", "{err}");
}

#[tokio::test]
async fn stdin_send_input_and_close_stdin() {
    let g = Guest::start(&[]).await;
    let req = json!({"process": {"cmd": "/bin/cat"}, "stdin": true});
    let mut s = g.stream("/process.Process/Start", req, &[]).await;
    let pid = expect_start(&mut s).await;
    let data = random_bytes(rand::random_range(1..50_000));
    for chunk in data.chunks(7000) {
        let (st, v) = g
            .unary(
                "/process.Process/SendInput",
                json!({"process": {"pid": pid}, "input": {"stdin": to_b64(chunk)}}),
            )
            .await;
        assert_eq!(st, StatusCode::OK, "{v}");
    }
    let (st, _) = g
        .unary(
            "/process.Process/CloseStdin",
            json!({"process": {"pid": pid}}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let out = s.collect_process().await;
    assert_eq!(out.stdout, data);
    assert_eq!(out.end.unwrap()["exited"], true);
}

#[tokio::test]
async fn stream_input_feeds_stdin() {
    let g = Guest::start(&[]).await;
    let tag = format!("cat-{}", token());
    let req = json!({"process": {"cmd": "/bin/cat"}, "stdin": true, "tag": tag});
    let mut s = g.stream("/process.Process/Start", req, &[]).await;
    expect_start(&mut s).await;
    let data = random_bytes(10_000);
    let mut body = Vec::new();
    body.extend_from_slice(&common::envelope(
        0,
        &json!({"start": {"process": {"tag": tag}}}),
    ));
    body.extend_from_slice(&common::envelope(0, &json!({"keepalive": {}})));
    body.extend_from_slice(&common::envelope(
        0,
        &json!({"data": {"input": {"stdin": to_b64(&data)}}}),
    ));
    let req = http::Request::post("/process.Process/StreamInput")
        .header("content-type", "application/connect+json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = g.send(req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(bytes[bytes.len() - 7], 2, "last envelope is end-of-stream");
    assert_eq!(&bytes[bytes.len() - 2..], b"{}");
    let (st, _) = g
        .unary(
            "/process.Process/CloseStdin",
            json!({"process": {"tag": tag}}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(s.collect_process().await.stdout, data);
}

#[tokio::test]
async fn background_process_outlives_its_stream_and_is_killed() {
    let g = Guest::start(&[]).await;
    let tag = format!("sleeper-{}", token());
    let req = json!({"process": {"cmd": "/bin/bash", "args": ["-c", "sleep 600"]}, "stdin": false, "tag": tag});
    let mut s = g.stream("/process.Process/Start", req, &[]).await;
    let pid = expect_start(&mut s).await;
    drop(s); // client disconnects; the process must keep running

    let (st, list) = g.unary("/process.Process/List", json!({})).await;
    assert_eq!(st, StatusCode::OK);
    let me = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .expect("listed")
        .clone();
    assert_eq!(me["tag"], tag.as_str());
    assert_eq!(me["config"]["cmd"], "/bin/bash");

    let mut watch = g
        .stream(
            "/process.Process/Connect",
            json!({"process": {"tag": tag}}),
            &[],
        )
        .await;
    assert_eq!(expect_start(&mut watch).await, pid);
    let (st, _) = g
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let out = watch.collect_process().await;
    let end = out.end.unwrap();
    assert_eq!(end["exitCode"], -1);
    assert_eq!(end["exited"], false);
    assert_eq!(end["status"], "signal: killed");

    let (_, list) = g.unary("/process.Process/List", json!({})).await;
    assert!(
        list["processes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["pid"] != pid)
    );
    let (st, err) = g
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(err["code"], "not_found");
    let err = g
        .stream_error("/process.Process/Connect", json!({"process": {"pid": pid}}))
        .await;
    assert_eq!(err["code"], "not_found", "{err}");
}

async fn listed(g: &Guest, pid: u32) -> bool {
    let (_, list) = g.unary("/process.Process/List", json!({})).await;
    list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["pid"] == pid)
}

#[tokio::test]
async fn connect_timeout_kills_the_process_and_ends_the_stream_deadline_exceeded() {
    let g = Guest::start(&[]).await;
    let mut s = g
        .stream(
            "/process.Process/Start",
            bash("sleep 60"),
            &[("connect-timeout-ms", "300")],
        )
        .await;
    let pid = expect_start(&mut s).await;
    let out = s.collect_process().await;
    assert!(out.end.is_none(), "no end event, as envd: {out:?}");
    assert_eq!(out.eos.unwrap()["error"]["code"], "deadline_exceeded");
    assert!(!listed(&g, pid).await, "the process was killed");
}

#[tokio::test]
async fn a_connect_past_its_timeout_ends_while_the_process_runs_on() {
    let g = Guest::start(&[]).await;
    let mut started = g
        .stream("/process.Process/Start", bash("sleep 60"), &[])
        .await;
    let pid = expect_start(&mut started).await;
    let mut s = g
        .stream(
            "/process.Process/Connect",
            json!({"process": {"pid": pid}}),
            &[("connect-timeout-ms", "300")],
        )
        .await;
    assert_eq!(expect_start(&mut s).await, pid);
    let out = s.collect_process().await;
    assert!(out.end.is_none(), "{out:?}");
    assert_eq!(out.eos.unwrap()["error"]["code"], "deadline_exceeded");
    assert!(listed(&g, pid).await, "the process runs on");
    let (st, _) = g
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test]
async fn keepalives_flow_on_idle_streams() {
    let g = Guest::start(&[]).await;
    let mut s = g
        .stream(
            "/process.Process/Start",
            bash("sleep 3"),
            &[("keepalive-ping-interval", "1")],
        )
        .await;
    expect_start(&mut s).await;
    let (flags, v) = s.next().await.unwrap();
    assert_eq!(flags, 0);
    assert_eq!(v, json!({"event": {"keepalive": {}}}));
}

#[tokio::test]
async fn pty_process_echoes_size_and_resizes() {
    let g = Guest::start(&[]).await;
    let req = json!({"process": {"cmd": "/bin/sh"}, "pty": {"size": {"cols": 80, "rows": 24}}});
    let mut s = g.stream("/process.Process/Start", req, &[]).await;
    let pid = expect_start(&mut s).await;
    let send =
        |text: &str| json!({"process": {"pid": pid}, "input": {"pty": to_b64(text.as_bytes())}});
    let (st, _) = g
        .unary(
            "/process.Process/SendInput",
            send("stty size; echo mark$((40+2))\n"),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    // Wait for the first command's output (the echoed input line does not contain "mark42").
    let mut first = Vec::new();
    while !String::from_utf8_lossy(&first).contains("mark42") {
        let m = s.message().await;
        let chunk = m["event"]["data"]["pty"].as_str().expect("pty data");
        first.extend(common::b64(chunk));
    }
    let first = String::from_utf8_lossy(&first).into_owned();
    assert!(first.contains("24 80"), "{first}");
    let (st, v) = g
        .unary(
            "/process.Process/Update",
            json!({"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 30}}}),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let (st, _) = g
        .unary("/process.Process/SendInput", send("stty size; exit 0\n"))
        .await;
    assert_eq!(st, StatusCode::OK);
    let out = s.collect_process().await;
    let text = String::from_utf8_lossy(&out.pty).into_owned();
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
    assert!(text.contains("30 100"), "{text}");
    assert_eq!(out.end.unwrap()["exited"], true);
}

#[tokio::test]
async fn user_from_basic_auth() {
    let g = Guest::start(&[]).await;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        k3_common::require::skip_part(
            k3_common::require::Part::Root,
            "user_from_basic_auth",
            "switching users needs root",
        );
        return;
    }
    let auth = format!("Basic {}", to_b64(b"nobody:"));
    let mut s = g
        .stream(
            "/process.Process/Start",
            json!({"process": {"cmd": "/bin/sh", "args": ["-c", "id -u; echo $USER"], "cwd": "/"}, "stdin": false}),
            &[("authorization", &auth)],
        )
        .await;
    expect_start(&mut s).await;
    assert_eq!(
        String::from_utf8(s.collect_process().await.stdout).unwrap(),
        "65534\nnobody\n"
    );
    let (st, v) = g
        .unary_as(
            "/process.Process/List",
            json!({}),
            &[(
                "authorization",
                &format!("Basic {}", to_b64(b"no-such-user:")),
            )],
        )
        .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], "unauthenticated");
}

#[tokio::test]
async fn unknown_method_and_bad_json() {
    let g = Guest::start(&[]).await;
    let (st, v) = g.unary("/process.Process/Nope", json!({})).await;
    assert_eq!(st, StatusCode::NOT_IMPLEMENTED);
    assert_eq!(v["code"], "unimplemented");
    let (st, v) = g
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": "x"}}),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(v["code"], "invalid_argument");
}

#[tokio::test]
async fn slow_client_gets_all_output() {
    let g = Guest::start(&[]).await;
    let n = rand::random_range(2_000_000..3_000_000);
    let mut s = g
        .stream(
            "/process.Process/Start",
            bash(&format!(
                "head -c {n} /dev/urandom | od -An -v | wc -c; head -c {n} /dev/zero"
            )),
            &[],
        )
        .await;
    expect_start(&mut s).await;
    // The client stalls while the process finishes; backpressure must not drop output.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let out = s.collect_process().await;
    let text = String::from_utf8_lossy(&out.stdout);
    let (first, rest) = text.split_once('\n').unwrap();
    assert!(first.trim().parse::<usize>().unwrap() > n);
    assert_eq!(rest.len(), n);
    assert_eq!(out.end.unwrap()["exited"], true);
}
