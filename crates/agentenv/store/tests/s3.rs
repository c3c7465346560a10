//! Against a real S3 server (SeaweedFS on loopback): restore on another machine, incremental uploads,
//! the cache bound with pins, remote corruption, remote gc.

mod common;

use std::time::Duration;

use agentenv_store::{ChunkStore, StoreConfig, StoreError};
use common::{file_hash, overwrite, seed, sparse_file};
use object_store::{ObjectStore, ObjectStoreExt};

const MIB: u64 = 1 << 20;

/// The bucket `b` of `weed` without the store: what anyone holding its credentials can write.
fn raw_bucket(weed: &agentenv_store::testing::Weed, b: &str) -> object_store::aws::AmazonS3 {
    object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&weed.endpoint)
        .with_bucket_name(b)
        .with_region("us-east-1")
        .with_access_key_id(agentenv_store::testing::ACCESS_KEY)
        .with_secret_access_key(agentenv_store::testing::SECRET_KEY)
        .with_allow_http(true)
        .build()
        .unwrap()
}

/// Objects under `prefix/`.
async fn count(raw: &object_store::aws::AmazonS3, prefix: &str) -> usize {
    let mut n = 0;
    let mut l = raw.list(Some(&object_store::path::Path::from(prefix)));
    while let Some(o) = futures_util::StreamExt::next(&mut l).await {
        o.unwrap();
        n += 1;
    }
    n
}

/// A store in `path` on bucket `b` of `weed`; its remote gc spares nothing for age when `gc_now`.
async fn open(
    path: &std::path::Path,
    weed: &agentenv_store::testing::Weed,
    b: &str,
    gc_now: bool,
) -> ChunkStore {
    let mut cfg = StoreConfig::local(path, 1 << 40).with_remote(weed.remote(b));
    if gc_now {
        cfg.remote_gc_grace = Duration::ZERO;
    }
    ChunkStore::open(cfg).await.unwrap()
}

fn bucket(tag: &str, s: u64) -> String {
    format!("k3-{tag}-{}", s % 1_000_000_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_server_with_a_cold_cache_finds_and_restores_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("s3-restore", dir.path()) else {
        return;
    };
    let s = seed("s3-restore");
    let b = bucket("restore", s);
    let src = dir.path().join("ram.mem");
    sparse_file(
        &src,
        128 * MIB,
        &[(0, 16 * MIB as usize), (64 * MIB + 4096, 8 * MIB as usize)],
        s,
    );
    let a = ChunkStore::open(
        StoreConfig::local(dir.path().join("a"), 1 << 40).with_remote(weed.remote(&b)),
    )
    .await
    .unwrap();
    let (m1, st1) = a.ingest(&src).await.unwrap();
    eprintln!("server A first ingest: {st1:?}");
    assert_eq!(st1.bytes_uploaded, st1.bytes_written);
    a.put_meta("snapshots/snap-1", m1.id().to_hex().as_bytes())
        .await
        .unwrap();

    // Server B: its own empty folder, the same bucket.
    let bs = open(&dir.path().join("b"), &weed, &b, false).await;
    assert_eq!(
        bs.list_meta("snapshots/").await.unwrap(),
        ["snapshots/snap-1"]
    );
    let id = bs.get_meta("snapshots/snap-1").await.unwrap().unwrap();
    let id = agentenv_store::ManifestId::from_hex(std::str::from_utf8(&id).unwrap()).unwrap();
    let m = bs.manifest(&id).await.unwrap();
    assert_eq!(m, m1);
    let out = dir.path().join("restored.mem");
    let r1 = bs.materialize(&m, &out).await.unwrap();
    eprintln!("server B cold restore: {r1:?}");
    assert_eq!(file_hash(&out), file_hash(&src));
    assert_eq!(
        (r1.bytes_local, r1.bytes_fetched_remote),
        (0, st1.bytes_uploaded)
    );
    // Packs of at most 4 MiB, each read whole: one request per pack.
    assert_eq!(r1.requests_remote as usize, m.packs.len(), "{r1:?}");
    assert!(m.packs.len() as u64 <= st1.bytes_uploaded.div_ceil(4 * MIB) + 1);
    // Fetched chunks enter B's cache after the return.
    bs.settle().await;
    let r2 = bs.materialize(&m, &out).await.unwrap();
    assert_eq!(
        (r2.bytes_fetched_remote, r2.bytes_local),
        (0, m.data_bytes()),
        "second restore not local"
    );

    // Incremental: A uploads only the change; B fetches only the change.
    overwrite(&src, 70 * MIB + 1000, MIB as usize, s + 9);
    let (m2, st2) = a.ingest(&src).await.unwrap();
    eprintln!("server A after a 1 MiB change: {st2:?}");
    assert!(
        st2.bytes_uploaded <= MIB + 2 * 65537 && st2.bytes_uploaded >= MIB,
        "{st2:?}"
    );
    let m2b = bs.manifest(&m2.id()).await.unwrap();
    let r3 = bs.materialize(&m2b, &out).await.unwrap();
    assert_eq!(r3.bytes_fetched_remote, st2.bytes_uploaded);
    assert_eq!(file_hash(&out), file_hash(&src));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_stays_within_its_bound_keeps_pinned_chunks_and_refetches_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("s3-bound", dir.path()) else {
        return;
    };
    let s = seed("s3-bound");
    let b = bucket("bound", s);
    let store = ChunkStore::open(
        StoreConfig::local(dir.path().join("a"), 8 * MIB).with_remote(weed.remote(&b)),
    )
    .await
    .unwrap();
    let mut ms = Vec::new();
    for k in 0..4 {
        let f = dir.path().join(format!("f{k}"));
        sparse_file(&f, 6 * MIB, &[(0, 6 * MIB as usize)], s + k);
        let (m, _) = store.ingest(&f).await.unwrap();
        assert!(
            store.local_stats().bytes <= 8 * MIB,
            "{:?}",
            store.local_stats()
        );
        if k == 2 {
            store.pin(&m.id(), "sbx-2").await.unwrap();
        }
        ms.push((m, f));
    }
    let pinned = &ms[2].0;
    assert!(
        pinned.chunks.iter().all(|(_, c)| store.has_local(c)),
        "a pinned chunk was evicted"
    );
    let out = dir.path().join("out");
    let r = store.materialize(&ms[0].0, &out).await.unwrap();
    assert!(r.bytes_fetched_remote > 0);
    assert_eq!(file_hash(&out), file_hash(&ms[0].1));
    store.settle().await;
    assert!(store.local_stats().bytes <= 8 * MIB);
    assert!(pinned.chunks.iter().all(|(_, c)| store.has_local(c)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fetches_never_show_the_cache_over_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("s3-race", dir.path()) else {
        return;
    };
    let s = seed("s3-race");
    let b = bucket("race", s);
    let a = open(&dir.path().join("a"), &weed, &b, false).await;
    let f = dir.path().join("f");
    sparse_file(&f, 16 * MIB, &[(0, 16 * MIB as usize)], s);
    let (m, _) = a.ingest(&f).await.unwrap();
    let cold = ChunkStore::open(
        StoreConfig::local(dir.path().join("b"), 2 * MIB).with_remote(weed.remote(&b)),
    )
    .await
    .unwrap();
    cold.manifest(&m.id()).await.unwrap();
    let ids: Vec<_> = m.chunks.iter().map(|(_, c)| *c).collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (cold, done) = (cold.clone(), done.clone());
        std::thread::spawn(move || {
            let mut worst = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                worst = worst.max(cold.local_stats().bytes);
            }
            worst
        })
    };
    let mut tasks = Vec::new();
    for part in ids.chunks(ids.len().div_ceil(4)) {
        let (cold, part) = (cold.clone(), part.to_vec());
        tasks.push(tokio::spawn(async move {
            for id in part {
                cold.chunk(&id).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let worst = sampler.join().unwrap();
    assert!(
        worst > 0 && worst <= 2 * MIB,
        "peak {worst} bytes, bound {}",
        2 * MIB
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_remote_chunk_is_refused_and_gc_removes_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("s3-tamper", dir.path()) else {
        return;
    };
    let s = seed("s3-tamper");
    let b = bucket("tamper", s);
    let a = open(&dir.path().join("a"), &weed, &b, true).await;
    let (f, g) = (dir.path().join("f"), dir.path().join("g"));
    sparse_file(&f, 4 * MIB, &[(0, 4 * MIB as usize)], s);
    sparse_file(&g, 2 * MIB, &[(0, 2 * MIB as usize)], s + 1);
    let (mf, _) = a.ingest(&f).await.unwrap();
    let (mg, _) = a.ingest(&g).await.unwrap();

    // Tamper with one of f's chunks inside its pack, behind the store's back.
    let raw = raw_bucket(&weed, &b);
    let k = (s % 64) as usize;
    let victim = mf.chunks[k].1;
    let (pack, off, n) = mf.place(k).expect("an uploaded chunk has a place");
    let key = object_store::path::Path::from(format!("packs/{}", pack.to_hex()));
    let mut bytes = raw.get(&key).await.unwrap().bytes().await.unwrap().to_vec();
    bytes[(off + 1 + s % u64::from(n - 1)) as usize] ^= 0x80;
    raw.put(&key, bytes.into()).await.unwrap();

    let cold = open(&dir.path().join("b"), &weed, &b, false).await;
    let out = dir.path().join("out");
    let err = cold.materialize(&mf, &out).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt { ref id, .. } if *id == victim.to_hex()),
        "{err}"
    );
    assert!(!out.exists());
    drop(cold);

    a.delete_manifest(&mf.id()).await.unwrap();
    let st = a.gc().await.unwrap();
    assert_eq!(
        (st.remote_chunks, st.remote_packs),
        (0, mf.packs.len()),
        "{st:?}"
    );
    assert_eq!(count(&raw, "packs").await, mg.packs.len());
    assert_eq!(count(&raw, "chunks").await, 0);
    let cold = open(&dir.path().join("c"), &weed, &b, false).await;
    cold.materialize(&mg, &out).await.unwrap();
    assert_eq!(file_hash(&out), file_hash(&g));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_written_without_the_mac_key_reads_as_absent() {
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("s3-meta-mac", dir.path()) else {
        return;
    };
    let s = seed("s3-meta-mac");
    let b = bucket("metamac", s);
    let open = |name: &str, secret: &[u8]| {
        ChunkStore::open(
            StoreConfig::local(dir.path().join(name), 1 << 40).with_remote(
                weed.remote(&b)
                    .with_meta_key(agentenv_store::meta_key_from_secret(secret)),
            ),
        )
    };
    let (a, peer) = (
        open("a", b"cluster").await.unwrap(),
        open("p", b"cluster").await.unwrap(),
    );
    let body = format!("{{\"id\":\"snap-{s}\"}}");
    a.put_meta("snapshots/x", body.as_bytes()).await.unwrap();
    assert_eq!(
        peer.get_meta("snapshots/x").await.unwrap().as_deref(),
        Some(body.as_bytes()),
        "a server with the same key reads it"
    );
    // Someone with only the bucket's credentials: a store keyed otherwise, and raw writes.
    let outsider = open("o", b"guess").await.unwrap();
    assert_eq!(outsider.get_meta("snapshots/x").await.unwrap(), None);
    outsider
        .put_meta("snapshots/y", b"{\"forged\":1}")
        .await
        .unwrap();
    let raw = raw_bucket(&weed, &b);
    let z = object_store::path::Path::from("meta/snapshots/z");
    raw.put(&z, b"{\"forged\":2}".to_vec().into())
        .await
        .unwrap();
    // The good blob with one byte of its body changed.
    let x = object_store::path::Path::from("meta/snapshots/x");
    let mut bytes = raw.get(&x).await.unwrap().bytes().await.unwrap().to_vec();
    *bytes.last_mut().unwrap() ^= 1;
    let w = object_store::path::Path::from("meta/snapshots/w");
    raw.put(&w, bytes.into()).await.unwrap();
    assert_eq!(
        peer.list_meta("snapshots/").await.unwrap(),
        ["snapshots/w", "snapshots/x", "snapshots/y", "snapshots/z"]
    );
    for forged in ["snapshots/w", "snapshots/y", "snapshots/z"] {
        assert_eq!(peer.get_meta(forged).await.unwrap(), None, "{forged}");
    }
    assert!(peer.get_meta("snapshots/x").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_version_reuses_the_packs_of_the_old_which_gc_keeps_while_it_is_referenced() {
    let dir = tempfile::tempdir().unwrap();
    let Some(weed) = common::weed("s3-packs", dir.path()) else {
        return;
    };
    let s = seed("s3-packs");
    let b = bucket("packs", s);
    let a = open(&dir.path().join("a"), &weed, &b, true).await;
    let f = dir.path().join("f");
    sparse_file(&f, 12 * MIB, &[(0, 12 * MIB as usize)], s);
    let (m1, st1) = a.ingest(&f).await.unwrap();
    let change = rand::random_range(0..12 * MIB - 70_000);
    overwrite(&f, change, 70_000, s + 1);
    let (m2, st2) = a.ingest(&f).await.unwrap();
    assert!(st2.bytes_uploaded < st1.bytes_uploaded / 8, "{st2:?}");
    assert!(
        m1.packs.iter().all(|p| m2.packs.contains(p)),
        "the new version points into the old packs"
    );
    assert_eq!(m2.packs.len(), m1.packs.len() + 1);

    a.delete_manifest(&m1.id()).await.unwrap();
    let st = a.gc().await.unwrap();
    assert_eq!(st.remote_packs, 0, "{st:?}");
    let raw = raw_bucket(&weed, &b);
    assert_eq!(count(&raw, "packs").await, m2.packs.len());
    let cold = open(&dir.path().join("b"), &weed, &b, false).await;
    let out = dir.path().join("out");
    let r = cold.materialize(&m2, &out).await.unwrap();
    assert_eq!(file_hash(&out), file_hash(&f));
    assert!(r.requests_remote as usize <= m2.packs.len() + 2, "{r:?}");

    a.delete_manifest(&m2.id()).await.unwrap();
    let st = a.gc().await.unwrap();
    assert_eq!(st.remote_packs, m2.packs.len(), "{st:?}");
    assert_eq!(count(&raw, "packs").await, 0);
}
