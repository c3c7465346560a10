//! Templates from OCI images, end to end: a real registry on loopback holds an image this test builds
//! (host glibc + bash + busybox, files, a whiteout, a config with Env/WorkingDir/User/Entrypoint/Cmd);
//! `POST /templates` with `fromImage` pulls it, boots it once and keeps the base snapshot; a sandbox made
//! from it has the image's files, environment, folder, user and running start command.

mod common;

use agentenv_oci::manifest::{Compression, RunConfig};
use agentenv_oci::testing::{LayerBuilder, TestImage, TestRegistry};
use common::{TestServer, state_dir};
use hyper::{Method, StatusCode};
use serde_json::json;

fn host_file(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn image(token: &str) -> TestImage {
    let mut base = LayerBuilder::new()
        .dir("bin", 0o755)
        .dir("lib/x86_64-linux-gnu", 0o755)
        .dir("lib64", 0o755)
        .dir("etc", 0o755)
        .dir("tmp", 0o1777)
        .dir("app", 0o755)
        .file("bin/busybox", &host_file("/bin/busybox"), 0o755)
        .file("bin/bash", &host_file("/bin/bash"), 0o755)
        .file(
            "lib64/ld-linux-x86-64.so.2",
            &host_file("/lib64/ld-linux-x86-64.so.2"),
            0o755,
        );
    for lib in ["libc.so.6", "libm.so.6", "libgcc_s.so.1", "libtinfo.so.6"] {
        base = base.file(
            &format!("lib/x86_64-linux-gnu/{lib}"),
            &host_file(&format!("/lib/x86_64-linux-gnu/{lib}")),
            0o755,
        );
    }
    for applet in ["sh", "sleep", "cat", "ps", "id", "pwd", "env", "test", "ls"] {
        base = base.symlink(&format!("bin/{applet}"), "busybox");
    }
    let base = base
        .file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\napp:x:1001:1001:app:/app:/bin/sh\n",
            0o644,
        )
        .file("etc/group", b"root:x:0:\napp:x:1001:\n", 0o644)
        .file_owned("app/hello.txt", token.as_bytes(), 0o644, 1001, 1001)
        .file("app/old.txt", b"removed by the next layer", 0o644)
        .tar();
    let top = LayerBuilder::new().whiteout("app/old.txt").tar();
    TestImage::new(RunConfig {
        user: Some("app".into()),
        env: Some(vec!["GREETING=hello-oci".into(), "PATH=/bin".into()]),
        entrypoint: Some(vec!["/bin/sleep".into()]),
        cmd: Some(vec!["4242".into()]),
        working_dir: Some("/app".into()),
        ..RunConfig::default()
    })
    .layer(&base, Compression::Gzip)
    .layer(&top, Compression::None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_from_an_oci_image_honours_its_config() {
    common::ensure_guest_binary();
    let Some(registry) = TestRegistry::start_or_skip("template_from_an_oci_image", None) else {
        return;
    };
    let token = format!("t{}", rand::random::<u64>());
    let reference = registry.image("k3/oci-template:v1");
    image(&token)
        .push(&reference, &registry.options())
        .expect("push the test image");
    let dir = state_dir();
    // The test registry is on loopback, which pulls reach only where the operator allows it.
    let server = TestServer::start_configured(dir.path(), true, |cfg| {
        cfg.registry_allow = vec![agentenv_oci::AllowedNet::parse("127.0.0.0/8").unwrap()];
    })
    .await;
    let api = server.client();

    // Built with its progress streamed: the pull's bytes rise to every layer's size, then the template.
    let key = api.key.clone();
    let body = json!({"templateID": "oci-test", "fromImage": reference.to_string()});
    let r = api
        .raw(
            Method::POST,
            "/templates",
            &[
                ("X-API-KEY", &key),
                ("Content-Type", "application/json"),
                ("Accept", "application/x-ndjson"),
            ],
            serde_json::to_vec(&body).unwrap(),
        )
        .await;
    let text = String::from_utf8_lossy(&r.body).to_string();
    assert_eq!(r.status, StatusCode::OK, "{text}");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let pulled: Vec<(u64, u64)> = lines
        .iter()
        .filter_map(|l| Some((l["bytesDone"].as_u64()?, l["bytesTotal"].as_u64()?)))
        .collect();
    assert!(pulled.windows(2).all(|w| w[0].0 <= w[1].0), "{pulled:?}");
    let (done, total) = *pulled.last().expect("pull progress lines");
    assert!(total > 100 << 10 && done == total, "{pulled:?}");
    assert!(lines.iter().any(|l| l["step"] == "boot"), "{text}");
    let t = lines.last().unwrap()["template"].clone();
    assert!(
        t["fromImage"]
            .as_str()
            .is_some_and(|f| f.contains("@sha256:")),
        "{t}"
    );

    let c = api
        .call(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "oci-test"})),
        )
        .await;
    assert_eq!(
        c.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&c.body)
    );
    let c = c.json();
    let (id, tok) = (
        c["sandboxID"].as_str().unwrap(),
        c["envdAccessToken"].as_str().unwrap(),
    );
    let run = |cmd: &'static str| api.run(id, tok, cmd);
    assert_eq!(run("cat /app/hello.txt").await.unwrap().0, token);
    assert_eq!(
        run("test -e /app/old.txt; echo $?").await.unwrap().0,
        "1\n",
        "whiteout applied"
    );
    assert_eq!(run("echo $GREETING").await.unwrap().0, "hello-oci\n");
    assert_eq!(run("pwd").await.unwrap().0, "/app\n");
    assert_eq!(run("id -u").await.unwrap().0, "1001\n");
    let ps = run("ps -o args").await.unwrap().0;
    assert!(
        ps.contains("/bin/sleep 4242"),
        "start command runs in the sandbox: {ps}"
    );

    for (body, want) in [
        (
            json!({"templateID": "bad-ref", "fromImage": "Not A Reference"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"templateID": "no-tag", "fromImage": registry.image("k3/oci-template:missing").to_string()}),
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let r = api.call(Method::POST, "/templates", Some(body)).await;
        assert_eq!(r.status, want, "{}", String::from_utf8_lossy(&r.body));
        assert!(
            r.json()["message"]
                .as_str()
                .is_some_and(|m| m.contains("image"))
        );
    }
    let gone = api
        .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    assert_eq!(gone.status, StatusCode::NO_CONTENT);
    server.close().await;
    // No QEMU of this state folder outlives the test (its folder is deleted with it).
    let left = common::qemu_pids_under(dir.path());
    assert!(left.is_empty(), "QEMU left running: {left:?}");
}

/// Security: without `--registry-allow`, a `fromImage` on a loopback (or any internal) address is
/// refused before any connection, with a 400 that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_from_an_internal_address_is_refused_without_a_connection() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let dir = state_dir();
    let server = TestServer::start_with(dir.path(), false).await;
    let api = server.client();
    for reference in [
        format!("127.0.0.1:{port}/internal/service:latest"),
        format!("localhost:{port}/internal/service:latest"),
    ] {
        let body = json!({"templateID": "ssrf", "fromImage": reference});
        let c = api.call(Method::POST, "/templates", Some(body)).await;
        assert_eq!(c.status, StatusCode::BAD_REQUEST, "{}", c.json());
        let msg = c.json()["message"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains("--registry-allow"), "{msg}");
    }
    assert!(
        listener.accept().is_err(),
        "the server connected to the internal address"
    );
}
