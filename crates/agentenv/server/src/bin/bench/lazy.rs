//! `agentenv-bench --lazy`: first-command latency of a template image that a node does not hold (the
//! default template's disk: 4 GiB of ext4, about 1 GB of data).
//! Node A publishes the default template to a real S3 server (SeaweedFS on loopback); each round opens a
//! fresh node B (own state folder, empty chunk cache, same bucket) whose sandbox disk is served lazily over
//! NBD. Cold: create (template import: RAM and device state from S3, the disk left there) until a command
//! that reads a file of the image answers, its chunks fetched from S3. Warm: the same on the same node
//! again, the chunks now in its cache. Local: node A, whose disk is a local file. All through the E2B API
//! of an in-process server per node.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use k3_common::report::{Better, Figure};
use serde_json::json;

use super::{Http, ms, serve_runtime};

/// The command timed: reads a 6.6 MB binary of the image that the template's snapshot never read.
const READ_CMD: &str = "md5sum /usr/bin/python3.11";

pub struct LazyFigures {
    pub figures: Vec<Figure>,
    pub notes: Vec<String>,
}

/// Create until [`READ_CMD`] answers (ms), then kill.
async fn first_command(http: &Http) -> anyhow::Result<f64> {
    let t = Instant::now();
    let (id, token) = http
        .create(json!({"templateID": "base", "timeout": 600}))
        .await?;
    let out = http.run(&id, &token, READ_CMD).await?;
    let took = ms(t);
    anyhow::ensure!(out.len() >= 32, "{READ_CMD}: {out:?}");
    http.kill(&id).await?;
    Ok(took)
}

fn runtime_cfg(
    dir: &Path,
    accel: agentenv_runtime::Accel,
    remote: agentenv_store::RemoteConfig,
) -> agentenv_runtime::RuntimeConfig {
    let mut cfg = agentenv_runtime::RuntimeConfig::new(dir.join("runtime"));
    cfg.accel = accel;
    cfg.warm_vms = 0;
    let mut store = agentenv_store::StoreConfig::local(
        dir.join("runtime/chunks"),
        agentenv_runtime::config::DEFAULT_STORE_BYTES,
    )
    .with_remote(remote);
    store.chunk_size = agentenv_runtime::config::DEFAULT_CHUNK_BYTES;
    cfg.store = Some(store);
    cfg
}

pub async fn run(
    state: &Path,
    accel: agentenv_runtime::Accel,
    rounds: usize,
) -> anyhow::Result<LazyFigures> {
    let weed = agentenv_store::testing::Weed::start(state)
        .map_err(|e| anyhow::anyhow!("S3 server (weed) for the lazy disk bench: {e}"))?;
    let bucket = format!("k3-bench-lazy-{:x}", std::process::id());
    let progress =
        |p: agentenv_runtime::BuildProgress| tracing::info!(progress = ?p, "default template");

    // Node A: the default template with its disk as a local file, published to the bucket.
    let dir_a = state.join("a");
    let rt_a = agentenv_runtime::Runtime::open(runtime_cfg(&dir_a, accel, weed.remote(&bucket)))
        .await
        .context("runtime A")?;
    rt_a.ensure_default_template(&progress).await?;
    let t = Instant::now();
    rt_a.publish_template("base").await?;
    let publish_ms = ms(t);
    let (http_a, task_a) = serve_runtime(rt_a, &dir_a).await?;
    let mut local = vec![];
    for _ in 0..rounds {
        local.push(first_command(&http_a).await?);
    }
    task_a.abort();

    let (mut cold, mut cold_disk, mut imports) = (vec![], vec![], vec![]);
    let (mut warm, mut fetched, mut image) = (vec![], vec![], 0u64);
    for round in 0..rounds {
        let dir_b = state.join(format!("b{round}"));
        let rt = agentenv_runtime::Runtime::open(runtime_cfg(&dir_b, accel, weed.remote(&bucket)))
            .await
            .context("runtime B")?;
        anyhow::ensure!(rt.templates().is_empty() && rt.store_stats().chunks == 0);
        let (http, task) = serve_runtime(rt.clone(), &dir_b).await?;
        // The server lists only templates the runtime has: import it (timed as part of cold).
        let t = Instant::now();
        rt.import_template("base")
            .await?
            .context("base is not in the bucket")?;
        let import_ms = ms(t);
        let took = first_command(&http).await?;
        imports.push(import_ms);
        cold_disk.push(took);
        cold.push(import_ms + took);
        fetched.push(rt.store_stats().bytes as f64 / 1e6);
        image = rt.templates().first().map_or(0, |t| t.disk_mib << 20);
        warm.push(first_command(&http).await?);
        task.abort();
    }
    let n = rounds;
    let figures = vec![
        Figure::timing(
            "lazy image, cold: create (template import from S3) -> a command reading a file answers",
            &cold,
            "ms",
        )
        .param("n", n),
        Figure::timing(
            "lazy image, cold, template imported: create -> a command reading a file answers (disk chunks from S3)",
            &cold_disk,
            "ms",
        )
        .param("n", n),
        Figure::timing(
            "lazy image, cold: template import (RAM and device state from S3)",
            &imports,
            "ms",
        )
        .param("n", n),
        Figure::timing(
            "lazy image, warm (chunks in the local cache): create -> a command reading a file answers",
            &warm,
            "ms",
        )
        .param("n", n),
        Figure::timing(
            "local disk file (baseline): create -> a command reading a file answers",
            &local,
            "ms",
        )
        .param("n", n),
        Figure::timing(
            "lazy cold: chunk cache after the first command (RAM + state + disk chunks read)",
            &fetched,
            "MB",
        )
        .param("image MiB", image >> 20),
        Figure::new("publish the template (ingest + upload)", publish_ms, "ms", Better::Lower),
    ];
    let notes = vec![
        format!("command timed: `{READ_CMD}` (6.6 MB of the image that the template snapshot never read)"),
        "cold includes the template import (256 MiB RAM file and device state materialized from S3); the disk stays in S3 and QEMU reads it over NBD from the runtime's export".into(),
        "warm VMs off; the warm create and the local baseline's later rounds use the runtime's prepared RAM copy and overlay, as any repeated create does".into(),
    ];
    Ok(LazyFigures { figures, notes })
}
