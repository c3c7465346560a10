//! Restore on another machine: two servers with separate state folders share one S3 bucket (a real
//! SeaweedFS S3 server on loopback). A snapshot taken on the first starts on the second, which fetches its
//! chunks, with the files and the RAM (a process and a file in tmpfs) the first had.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::TestServer;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

fn store(
    dir: &std::path::Path,
    weed: &agentenv_store::testing::Weed,
    bucket: &str,
) -> agentenv_store::StoreConfig {
    let mut c = agentenv_store::StoreConfig::local(
        dir.join("runtime/chunks"),
        agentenv_runtime::config::DEFAULT_STORE_BYTES,
    )
    .with_remote(weed.remote(bucket));
    c.chunk_size = agentenv_runtime::config::DEFAULT_CHUNK_BYTES;
    c
}

/// A server on `dir` with the default template and a chunk store in `bucket`.
async fn node(
    dir: &std::path::Path,
    weed: &agentenv_store::testing::Weed,
    bucket: &str,
) -> TestServer {
    TestServer::start_with_store(dir, true, Some(store(dir, weed, bucket))).await
}

/// `POST /v2/sandboxes` from `source` (a template, or a snapshot id or name).
async fn create_from(api: &common::Api, source: &str) -> common::Resp {
    api.call(
        Method::POST,
        "/v2/sandboxes",
        Some(json!({"templateID": source})),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_taken_on_one_server_starts_on_another() {
    common::ensure_guest_binary();
    let weed_dir = common::state_dir();
    let Some(weed) = agentenv_store::testing::weed_or_skip("s3 restore", weed_dir.path()) else {
        return;
    };
    let bucket = format!("k3-{:x}", rand::random::<u32>());
    let (dir_a, dir_b) = (common::state_dir(), common::state_dir());
    let a = node(dir_a.path(), &weed, &bucket).await;
    let api_a = a.client();
    let r = create_from(&api_a, "base").await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let (id, token) = (
        r.json()["sandboxID"].as_str().unwrap().to_string(),
        r.json()["envdAccessToken"].as_str().unwrap().to_string(),
    );
    let secret = format!("{:x}", rand::random::<u64>());
    api_a
        .run(
            &id,
            &token,
            &format!("echo {secret} > /home/user/disk.txt; echo {secret} > /dev/shm/ram.txt; sync"),
        )
        .await
        .unwrap();
    let name = format!("moved{:x}", rand::random::<u16>());
    let r = api_a
        .call(
            Method::POST,
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({"name": name})),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let snap = r.json()["snapshotID"].as_str().unwrap().to_string();
    // Stored as chunks in the background: wait for it.
    let t0 = Instant::now();
    loop {
        let l = api_a.call(Method::GET, "/snapshots", None).await.json();
        if l.as_array()
            .unwrap()
            .iter()
            .any(|s| s["snapshotID"] == snap.as_str() && s.get("storedBytesNew").is_some())
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "snapshot not stored: {l}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    api_a
        .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
        .await;
    a.close().await;

    // Server B has its own state folder and an empty cache; only the bucket is shared.
    let b = node(dir_b.path(), &weed, &bucket).await;
    let api_b = b.client();
    let listed = api_b.call(Method::GET, "/snapshots", None).await.json();
    assert!(
        listed.as_array().unwrap().is_empty(),
        "nothing local yet: {listed}"
    );
    for source in [name.clone(), snap.clone()] {
        let r = create_from(&api_b, &source).await;
        assert_eq!(r.status, StatusCode::CREATED, "{source}: {:?}", r.json());
        let v = r.json();
        let (nid, ntoken) = (
            v["sandboxID"].as_str().unwrap(),
            v["envdAccessToken"].as_str().unwrap(),
        );
        assert_eq!(v["templateID"], snap.as_str());
        for f in ["/home/user/disk.txt", "/dev/shm/ram.txt"] {
            let (out, code) = api_b.run(nid, ntoken, &format!("cat {f}")).await.unwrap();
            assert_eq!((out.trim(), code), (secret.as_str(), 0), "{source}: {f}");
        }
        api_b
            .call(Method::DELETE, &format!("/sandboxes/{nid}"), None)
            .await;
    }
    let listed = api_b.call(Method::GET, "/snapshots", None).await.json();
    assert_eq!(
        listed.as_array().unwrap().len(),
        1,
        "imported once: {listed}"
    );
    let r = create_from(&api_b, "never-stored").await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "{:?}", r.json());

    // The imported RAM copy is not flushed: its record names this boot. After a host restart (here a
    // record naming another boot) the copy goes and is made again from the chunks on first use.
    let rec_path = dir_b
        .path()
        .join(format!("runtime/snapshots/{snap}/snapshot.json"));
    let mut rec: Value = serde_json::from_slice(&std::fs::read(&rec_path).unwrap()).unwrap();
    assert_eq!(
        rec["boot_id"].as_str(),
        k3_common::machine::boot_id().as_deref(),
        "{rec}"
    );
    let ram = PathBuf::from(rec["ram"].as_str().unwrap());
    assert!(ram.exists());
    b.close().await;
    rec["boot_id"] = json!("a-boot-before");
    std::fs::write(&rec_path, rec.to_string()).unwrap();
    let b = node(dir_b.path(), &weed, &bucket).await;
    let api_b = b.client();
    assert!(!ram.exists(), "a RAM copy that may be torn is kept");
    let r = create_from(&api_b, &name).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let (nid, ntoken) = (
        r.json()["sandboxID"].as_str().unwrap().to_string(),
        r.json()["envdAccessToken"].as_str().unwrap().to_string(),
    );
    let (out, code) = api_b
        .run(&nid, &ntoken, "cat /dev/shm/ram.txt")
        .await
        .unwrap();
    assert_eq!((out.trim(), code), (secret.as_str(), 0), "after a restart");
    api_b
        .call(Method::DELETE, &format!("/sandboxes/{nid}"), None)
        .await;
    // Deleted on B: neither B (which may still keep the files) nor a third server imports it again.
    let r = api_b
        .call(Method::DELETE, &format!("/templates/{snap}"), None)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.json());
    for source in [name.as_str(), snap.as_str()] {
        let r = create_from(&api_b, source).await;
        assert_eq!(
            r.status,
            StatusCode::NOT_FOUND,
            "B, {source}: {:?}",
            r.json()
        );
    }
    b.close().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let dir_c = common::state_dir();
    let c = node(dir_c.path(), &weed, &bucket).await;
    let r = create_from(&c.client(), &name).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "C: {:?}", r.json());
    c.close().await;
    for d in [&dir_a, &dir_b, &dir_c] {
        assert!(common::qemu_pids_under(d.path()).is_empty());
    }
}
