//! `/files`, `/health`, `/init`, `/envs`, `/metrics` and the access token, against the real binary.

mod common;

use std::io::Write;

use bytes::Bytes;
use common::{Guest, random_bytes, token};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

fn multipart(parts: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = format!("----k3{}", token());
    let mut body = Vec::new();
    for (filename, data) in parts {
        write!(
            body,
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .unwrap();
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    write!(body, "--{boundary}--\r\n").unwrap();
    (format!("multipart/form-data; boundary={boundary}"), body)
}

async fn get(g: &Guest, uri: &str, headers: &[(&str, &str)]) -> (StatusCode, Bytes) {
    let mut b = Request::get(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = g.send(b.body(Full::new(Bytes::new())).unwrap()).await;
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

async fn post(
    g: &Guest,
    uri: &str,
    ctype: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (StatusCode, Value) {
    let mut b = Request::post(uri).header("content-type", ctype);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = g.send(b.body(Full::new(Bytes::from(body))).unwrap()).await;
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn multipart_upload_then_download() {
    let g = Guest::start(&[]).await;
    let data = random_bytes(rand::random_range(1..300_000));
    let path = g.dir.path().join(format!("{}/deep/f.bin", token()));
    let (ctype, body) = multipart(&[(&path.display().to_string(), &data)]);
    let (st, v) = post(
        &g,
        &format!("/files?path={}", path.display()),
        &ctype,
        body,
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        v,
        json!([{"name": "f.bin", "type": "file", "path": path.display().to_string()}])
    );
    let (st, got) = get(&g, &format!("/files?path={}", path.display()), &[]).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(got.as_ref(), data.as_slice());
}

#[tokio::test]
async fn multipart_many_files_use_their_filenames() {
    let g = Guest::start(&[]).await;
    let base = g.dir.path().join(token());
    let (a, b) = (random_bytes(1000), random_bytes(2000));
    let (pa, pb) = (base.join("a.txt"), base.join("x/b.txt"));
    let (ctype, body) = multipart(&[
        (&pa.display().to_string(), &a),
        (&pb.display().to_string(), &b),
    ]);
    let (st, v) = post(&g, "/files", &ctype, body, &[]).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert_eq!(std::fs::read(&pa).unwrap(), a);
    assert_eq!(std::fs::read(&pb).unwrap(), b);
}

#[tokio::test]
async fn octet_stream_and_gzip_uploads() {
    let g = Guest::start(&[]).await;
    let data = random_bytes(rand::random_range(1..200_000));
    let p1 = g.dir.path().join(token());
    let (st, v) = post(
        &g,
        &format!("/files?path={}", p1.display()),
        "application/octet-stream",
        data.clone(),
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(std::fs::read(&p1).unwrap(), data);

    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(&data).unwrap();
    let p2 = g.dir.path().join(token());
    let (st, v) = post(
        &g,
        &format!("/files?path={}", p2.display()),
        "application/octet-stream",
        enc.finish().unwrap(),
        &[("content-encoding", "gzip")],
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(std::fs::read(&p2).unwrap(), data);
}

#[tokio::test]
async fn files_that_report_no_size_download_whole() {
    let g = Guest::start(&[]).await;
    // `/proc` files stat as 0 bytes; their content is read to its end.
    let (st, body) = get(&g, "/files?path=/proc/sys/kernel/random/boot_id", &[]).await;
    assert_eq!(st, StatusCode::OK);
    let want = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(String::from_utf8(body.to_vec()).unwrap(), want);
    let (st, body) = get(&g, "/files?path=/proc/self/status", &[]).await;
    assert_eq!(st, StatusCode::OK);
    assert!(String::from_utf8(body.to_vec()).unwrap().contains("\nPid:"));
}

#[tokio::test]
async fn download_errors_and_upload_limit() {
    let g = Guest::start(&["--max-upload-bytes", "1000"]).await;
    let (st, body) = get(
        &g,
        &format!("/files?path={}/missing", g.dir.path().display()),
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["code"], 404);
    let (st, _) = get(&g, &format!("/files?path={}", g.dir.path().display()), &[]).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, _) = get(&g, "/files?path=/etc/hostname&username=no-such-user", &[]).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let p = g.dir.path().join(token());
    let (st, v) = post(
        &g,
        &format!("/files?path={}", p.display()),
        "application/octet-stream",
        random_bytes(2000),
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(v["code"], 413);
    assert!(!p.exists());
}

#[tokio::test]
async fn access_token_init_envs_metrics() {
    let t = token();
    let g = Guest::start(&["--access-token", &t]).await;
    let (st, _) = get(&g, "/health", &[]).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let (st, _) = get(&g, "/envs", &[]).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, v) = g.unary("/process.Process/List", json!({})).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], "unauthenticated");

    let val = token();
    let auth = [("x-access-token", t.as_str())];
    let init = json!({"envVars": {"K3_INIT": val}});
    let (st, _) = post(
        &g,
        "/init",
        "application/json",
        init.to_string().into_bytes(),
        &auth,
    )
    .await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let (st, body) = get(&g, "/envs", &auth).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap()["K3_INIT"],
        val.as_str()
    );

    let mut s = g
        .stream(
            "/process.Process/Start",
            common::bash("echo $K3_INIT"),
            &auth,
        )
        .await;
    common::expect_start(&mut s).await;
    assert_eq!(
        String::from_utf8(s.collect_process().await.stdout).unwrap(),
        format!("{val}\n")
    );

    let (st, body) = get(&g, "/metrics", &auth).await;
    assert_eq!(st, StatusCode::OK);
    let m: Value = serde_json::from_slice(&body).unwrap();
    assert!(m["mem_total"].as_u64().unwrap() > 0);
    assert!(m["cpu_count"].as_u64().unwrap() >= 1);
}

fn sign(path: &str, op: &str, user: &str, token: &str, exp: Option<u64>) -> String {
    use base64::Engine;
    use sha2::Digest;
    let raw = match exp {
        Some(e) => format!("{path}:{op}:{user}:{token}:{e}"),
        None => format!("{path}:{op}:{user}:{token}"),
    };
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD
            .encode(sha2::Sha256::digest(raw.as_bytes()))
    )
}

fn urlenc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test]
async fn signed_urls_replace_the_access_token() {
    let t = token();
    let g = Guest::start(&["--access-token", &t]).await;
    let path = g.dir.path().join(token()).display().to_string();
    let data = random_bytes(3000);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let sig = sign(&path, "write", "", &t, Some(exp));
    let uri = format!(
        "/files?path={path}&signature={}&signature_expiration={exp}",
        urlenc(&sig)
    );
    let (st, v) = post(&g, &uri, "application/octet-stream", data.clone(), &[]).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let sig = sign(&path, "read", "", &t, None);
    let (st, got) = get(
        &g,
        &format!("/files?path={path}&signature={}", urlenc(&sig)),
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(got.as_ref(), data.as_slice());
    // A write signature does not allow reading; an expired one is refused.
    let sig = sign(&path, "write", "", &t, None);
    let (st, _) = get(
        &g,
        &format!("/files?path={path}&signature={}", urlenc(&sig)),
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let sig = sign(&path, "read", "", &t, Some(1));
    let (st, _) = get(
        &g,
        &format!(
            "/files?path={path}&signature={}&signature_expiration=1",
            urlenc(&sig)
        ),
        &[],
    )
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn bad_upload_paths_get_4xx_json_not_500() {
    let g = Guest::start(&[]).await;
    let file = g.dir.path().join(format!("{}.txt", token()));
    std::fs::write(&file, b"x").unwrap();
    let long = format!("{}/{}", g.dir.path().display(), "a".repeat(5000));
    let long_name = format!("{}/{}", g.dir.path().display(), "n".repeat(300));
    let cases = [
        // Onto an existing file's path, as if it were a folder.
        format!("{}/child", file.display()),
        "/proc/k3-upload-test".to_string(),
        format!("../../../../../../proc/{}", token()),
        long,
        long_name,
    ];
    for path in &cases {
        let (st, v) = post(
            &g,
            &format!("/files?path={path}"),
            "application/octet-stream",
            common::random_bytes(64),
            &[],
        )
        .await;
        assert!(st.is_client_error(), "{path:.80}: {st} {v}");
        assert_eq!(v["code"], st.as_u16(), "{v}");
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x", "the file is untouched");
}
