//! Restore from S3 with a cold cache: a snapshot taken on server A is created, by name, on a fresh server
//! B (its own state folder and an empty chunk cache; only the bucket is shared), through B's E2B API.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hyper::Method;
use k3_common::report::Figure;
use serde_json::{Value, json};

use agentenv_server::runtime_backend;

use crate::{Http, ms, serve_runtime};

/// One in-process server on `state` sharing `bucket` of `weed`.
struct Node {
    http: Http,
    rt: agentenv_runtime::Runtime,
    task: tokio::task::JoinHandle<()>,
}

async fn node(
    state: &Path,
    weed: &agentenv_store::testing::Weed,
    bucket: &str,
    accel: agentenv_runtime::Accel,
) -> anyhow::Result<Node> {
    let mut cfg = agentenv_runtime::RuntimeConfig::new(state.join("runtime"));
    cfg.accel = accel;
    let mut store = agentenv_store::StoreConfig::local(
        state.join("runtime/chunks"),
        agentenv_runtime::config::DEFAULT_STORE_BYTES,
    )
    .with_remote(weed.remote(bucket));
    store.chunk_size = agentenv_runtime::config::DEFAULT_CHUNK_BYTES;
    cfg.store = Some(store);
    let rt = runtime_backend::open_with_default_template(cfg)
        .await
        .context("runtime with the default template")?;
    let (http, task) = serve_runtime(rt.clone(), state).await?;
    Ok(Node { http, rt, task })
}

impl Node {
    async fn stop(self) {
        self.task.abort();
        self.rt.close().await;
    }
}

/// `n` cold restores (each on a new server B) of one snapshot taken on server A, whose guest holds
/// 16 MiB of its own random data in tmpfs. `None`: no S3 server here (the reason).
pub async fn cold_restore(
    accel: agentenv_runtime::Accel,
    n: usize,
) -> anyhow::Result<Result<Vec<Figure>, String>> {
    let dir = tempfile::Builder::new()
        .prefix("agentenv-bench-s3-")
        .tempdir()?;
    let weed = match agentenv_store::testing::Weed::start(dir.path()) {
        Ok(w) => w,
        Err(e) => return Ok(Err(format!("no S3 server: {e}"))),
    };
    let bucket = format!("bench-{:x}", rand::random::<u32>());
    let a = node(&dir.path().join("a"), &weed, &bucket, accel).await?;
    let (id, token) = a
        .http
        .create(json!({"templateID": "base", "timeout": 600}))
        .await?;
    a.http
        .run(
            &id,
            &token,
            "head -c 16777216 /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob",
        )
        .await?;
    let name = format!("cold{:x}", rand::random::<u16>());
    let s = a
        .http
        .json(
            Method::POST,
            &format!("/sandboxes/{id}/snapshots"),
            json!({"name": name}),
            201,
        )
        .await?;
    let snap = s["snapshotID"].as_str().context("snapshotID")?.to_string();
    let end = Instant::now() + Duration::from_secs(180);
    loop {
        let list = a
            .http
            .json(Method::GET, "/snapshots", Value::Null, 200)
            .await?;
        let stored = list
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v["snapshotID"] == snap.as_str() && v.get("storedBytesNew").is_some());
        if stored {
            break;
        }
        if Instant::now() > end {
            bail!("snapshot {snap} was not stored in the bucket within 180 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    a.http.kill(&id).await?;
    a.stop().await;
    let (mut create, mut first_cmd, mut fetched) = (vec![], vec![], vec![]);
    for i in 0..n {
        let state = dir.path().join(format!("b{i}"));
        let b = node(&state, &weed, &bucket, accel).await?;
        let before = dir_bytes(&state.join("runtime/chunks"));
        let t = Instant::now();
        let (nid, ntoken) = b
            .http
            .create(json!({"templateID": name, "timeout": 600}))
            .await?;
        create.push(ms(t));
        let out = b
            .http
            .run(&nid, &ntoken, "stat -c %s /dev/shm/blob")
            .await?;
        first_cmd.push(ms(t));
        if out.trim() != "16777216" {
            bail!("the restored guest lost its tmpfs file: {out:?}");
        }
        b.http.kill(&nid).await?;
        // Stopping waits for the fetched chunks to enter the cache.
        b.stop().await;
        fetched.push((dir_bytes(&state.join("runtime/chunks")) - before) as f64);
        let _ = std::fs::remove_dir_all(&state);
    }
    let mib = |v: &[f64]| k3_common::stats::median(v) / f64::from(1 << 20);
    Ok(Ok(vec![
        Figure::timing(
            "create from a snapshot in S3 on a server with a cold cache (POST /v2/sandboxes)",
            &create,
            "ms",
        )
        .param(
            "chunk bytes fetched (MiB, median)",
            format!("{:.1}", mib(&fetched)),
        ),
        Figure::timing(
            "first command in a sandbox restored from S3 with a cold cache (create + command)",
            &first_cmd,
            "ms",
        )
        .baseline("issue #31 goal", 1000.0, false),
    ]))
}

/// Bytes of the files under `dir` (the chunk cache).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(_) => total += e.metadata().map_or(0, |m| m.len()),
                Err(_) => {}
            }
        }
    }
    total
}
