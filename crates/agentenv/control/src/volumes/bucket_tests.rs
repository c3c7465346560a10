//! Volumes in a real bucket (SeaweedFS on loopback): a wiped node restores them, flushes upload
//! only what changed, hostile manifests are refused, and without a bucket nothing changes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentenv_store::testing::{Weed, fill_random, weed_or_skip};
use agentenv_store::{ChunkStore, Compression, RemoteConfig, StoreConfig};

use crate::volumes::bucket::key;
use crate::volumes::pack::{Entry, Kind, VolumeManifest};
use crate::volumes::*;

const KEY: &str = "server-key-for-volume-tests";

/// A folder, SeaweedFS in it, and a new bucket's name; `None` (the test skips) without SeaweedFS.
fn bucket_or_skip(tag: &str) -> Option<(tempfile::TempDir, Weed, String)> {
    let dir = tempfile::tempdir().unwrap();
    let weed = weed_or_skip(&format!("volume {tag}"), dir.path())?;
    Some((dir, weed, format!("k3-vol-{tag}-{}", rand::random::<u32>())))
}

/// A node: its own state folder and chunk cache, the bucket `b`.
async fn node(weed: &Weed, b: &str, state: &Path) -> (Arc<Volumes>, ChunkStore) {
    node_with(weed.remote(b), state, Duration::from_secs(3600)).await
}

/// With the sync task looking every `tick` (flushes are the test's own with a long one).
async fn node_with(
    remote: RemoteConfig,
    state: &Path,
    tick: Duration,
) -> (Arc<Volumes>, ChunkStore) {
    let mut cfg = StoreConfig::local(state.join("volumes-chunks"), 64 << 20).with_remote(remote);
    cfg.chunk_size = 16 << 10;
    cfg.compression = Compression::Zstd { level: 1 };
    let store = ChunkStore::open(cfg).await.unwrap();
    let v = Arc::new(Volumes::open(state, KEY).unwrap());
    v.attach_bucket_every(Arc::new(store.clone()), tick)
        .unwrap();
    (v, store)
}

fn random(n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    fill_random(&mut b, rand::random());
    b
}

/// Every entry below `root`: (path, kind, size, mode, bytes or link target).
fn tree(root: &Path) -> Vec<(String, &'static str, u64, u32, Vec<u8>)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = vec![];
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let md = std::fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let mode = md.permissions().mode() & 0o7777;
            if md.is_symlink() {
                let t = std::fs::read_link(&p).unwrap();
                out.push((rel, "link", 0, 0, t.display().to_string().into_bytes()));
            } else if md.is_dir() {
                dirs.push(p.clone());
                out.push((rel, "dir", 0, mode, vec![]));
            } else {
                out.push((rel, "file", md.len(), mode, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn data(state: &Path, id: &str) -> PathBuf {
    state.join("volumes").join(id).join("data")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_node_restores_every_flushed_volume_from_the_bucket() {
    let Some((dir, weed, b)) = bucket_or_skip("restore") else {
        return;
    };
    let state = dir.path().join("node");
    let (v, _store) = node(&weed, &b, &state).await;
    let (vol, token) = v.create("alpha", "work").unwrap();
    let (other, _) = v.create("beta", "theirs").unwrap();
    let c = v.content(&vol.volume_id, Some(&token)).unwrap();
    let meta = |mode| Meta {
        mode: Some(mode),
        ..Meta::default()
    };
    c.mkdir("/src/deep/er", meta(0o750), true).unwrap();
    c.mkdir("/empty", Meta::default(), false).unwrap();
    let big = random(rand::random_range(100_000..300_000));
    c.write("/src/big.bin", &big, meta(0o600), false).unwrap();
    c.write(
        "/src/deep/er/small",
        &random(rand::random_range(1..100)),
        meta(0o644),
        false,
    )
    .unwrap();
    c.write("/src/zero", &[], Meta::default(), false).unwrap();
    // Identical content twice (stored once), and a file that is mostly zeros.
    c.write("/copy.bin", &big, meta(0o640), false).unwrap();
    let mut sparse = vec![0u8; 70_000];
    sparse[69_000..].copy_from_slice(&random(1000));
    c.write("/sparse", &sparse, Meta::default(), false).unwrap();
    // As a guest makes them through its mount.
    let d = data(&state, &vol.volume_id);
    std::os::unix::fs::symlink("../etc/passwd", d.join("src/up")).unwrap();
    std::os::unix::fs::symlink("big.bin", d.join("src/link")).unwrap();
    let before = tree(&d);
    let st = v
        .flush(&vol.volume_id)
        .await
        .unwrap()
        .expect("a first flush");
    assert_eq!(st.entries, before.len());
    assert!(st.bytes_uploaded < 2 * big.len() as u64, "{st:?}");
    // The other tenant's volume is in the bucket too once flushed.
    v.flush(&other.volume_id).await.unwrap().expect("flushed");
    assert!(
        v.flush(&other.volume_id).await.unwrap().is_none(),
        "unchanged"
    );
    drop((c, v, _store));

    std::fs::remove_dir_all(&state).unwrap();
    let (v2, _s2) = node(&weed, &b, &state).await;
    assert_eq!(v2.list("alpha"), vec![vol.clone()]);
    assert_eq!(v2.list("beta"), vec![other.clone()]);
    assert!(
        !data(&state, &vol.volume_id).exists(),
        "files come on first use"
    );
    let c2 = v2.content(&vol.volume_id, Some(&token)).unwrap();
    assert_eq!(tree(&data(&state, &vol.volume_id)), before);
    let mut back = vec![];
    std::io::Read::read_to_end(&mut c2.read("/src/big.bin").unwrap(), &mut back).unwrap();
    assert_eq!(back, big);
    assert_eq!(c2.stat("/src/deep/er").unwrap().mode, 0o750);
    // Nothing changed since the restore: nothing to flush.
    assert!(v2.flush(&vol.volume_id).await.unwrap().is_none());

    // A third node finds the volume by id alone (the content API knows no owner).
    let state3 = dir.path().join("node3");
    let (v3, _s3) = node(&weed, &b, &state3).await;
    v3.content(&vol.volume_id, Some(&token)).unwrap();
    assert_eq!(tree(&data(&state3, &vol.volume_id)), before);
    assert!(matches!(
        v3.content(&vol.volume_id, Some("vol_0")),
        Err(VolumeError::Unauthorized)
    ));

    // Deleting removes the bucket's copy: a fresh node lists nothing.
    v3.delete("alpha", &vol.volume_id).unwrap();
    assert_eq!(
        _s3.get_meta(&key("alpha", &vol.volume_id)).await.unwrap(),
        None
    );
    let (v4, _s4) = node(&weed, &b, &dir.path().join("node4")).await;
    assert!(v4.list("alpha").is_empty());
    assert_eq!(v4.list("beta"), vec![other]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_flush_uploads_only_the_changed_chunks() {
    let Some((dir, weed, b)) = bucket_or_skip("incr") else {
        return;
    };
    let state = dir.path().join("node");
    let (v, _store) = node(&weed, &b, &state).await;
    let (vol, token) = v.create("alpha", "incr").unwrap();
    let c = v.content(&vol.volume_id, Some(&token)).unwrap();
    let big = random(1 << 20);
    c.write("/big", &big, Meta::default(), false).unwrap();
    for i in 0..20 {
        c.write(&format!("/f{i}"), &random(3000), Meta::default(), false)
            .unwrap();
    }
    let first = v.flush(&vol.volume_id).await.unwrap().unwrap();
    assert!(first.bytes_uploaded >= 1 << 20, "{first:?}");
    assert!(v.flush(&vol.volume_id).await.unwrap().is_none());

    // One 16 KiB chunk of the big file and one small file change.
    let mut edited = big.clone();
    let at = rand::random_range(0..64) * (16 << 10) + 100;
    edited[at] ^= 0xff;
    c.write("/big", &edited, Meta::default(), true).unwrap();
    c.write("/f7", b"changed", Meta::default(), true).unwrap();
    let second = v.flush(&vol.volume_id).await.unwrap().unwrap();
    // Two changed chunks and the pack's header.
    assert_eq!(second.chunks_new, 3, "{second:?}");
    assert!(second.bytes_uploaded < 40 << 10, "{second:?}");

    let state2 = dir.path().join("node2");
    let (v2, _s2) = node(&weed, &b, &state2).await;
    let c2 = v2.content(&vol.volume_id, Some(&token)).unwrap();
    let mut back = vec![];
    std::io::Read::read_to_end(&mut c2.read("/big").unwrap(), &mut back).unwrap();
    assert!(back == edited, "the restored file is the edited one");
    assert_eq!(
        std::fs::read(data(&state2, &vol.volume_id).join("f7")).unwrap(),
        b"changed"
    );

    // Node 2 writes next; node 1's stale copy never overwrites that.
    c2.write("/f7", b"from node 2", Meta::default(), true)
        .unwrap();
    v2.flush(&vol.volume_id)
        .await
        .unwrap()
        .expect("node 2 flushes");
    c.write("/stale", b"stale", Meta::default(), false).unwrap();
    let stale = v.flush(&vol.volume_id).await;
    assert!(matches!(stale, Err(VolumeError::Store { .. })), "{stale:?}");
    let state3 = dir.path().join("node3");
    let (v3, _s3) = node(&weed, &b, &state3).await;
    v3.content(&vol.volume_id, Some(&token)).unwrap();
    let d3 = data(&state3, &vol.volume_id);
    assert_eq!(std::fs::read(d3.join("f7")).unwrap(), b"from node 2");
    assert!(!d3.join("stale").exists());
}

fn entry(path: &str, kind: Kind) -> Entry {
    Entry {
        path: path.into(),
        kind,
        mode: 0o755,
        uid: 0,
        gid: 0,
        mtime_ns: 0,
        size: 0,
        first: 0,
        target: None,
    }
}

/// Names anywhere below `root`.
fn names(root: &Path) -> Vec<String> {
    let mut out = vec![];
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            out.push(e.file_name().to_string_lossy().into_owned());
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(e.path());
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_manifests_are_refused_before_anything_is_written() {
    let Some((dir, weed, b)) = bucket_or_skip("hostile") else {
        return;
    };
    let (v, store) = node(&weed, &b, &dir.path().join("a")).await;
    let (vol, token) = v.create("alpha", "target").unwrap();
    v.content(&vol.volume_id, Some(&token))
        .unwrap()
        .write("/evil", b"x", Meta::default(), false)
        .unwrap();
    v.flush(&vol.volume_id).await.unwrap().unwrap();
    let k = key("alpha", &vol.volume_id);
    let good: VolumeManifest =
        serde_json::from_slice(&store.get_meta(&k).await.unwrap().unwrap()).unwrap();
    let file = |path: &str, size, first| Entry {
        size,
        first,
        ..entry(path, Kind::File)
    };
    let link = Entry {
        target: Some("/".into()),
        ..entry("a", Kind::Symlink)
    };
    let huge: Vec<Entry> = (0..=MAX_VOLUME_ENTRIES)
        .map(|i| entry(&format!("d{i}"), Kind::Dir))
        .collect();
    let cases: Vec<(&str, Vec<Entry>)> = vec![
        ("dot-dot", vec![file("../evil", 1, 1)]),
        (
            "deep dot-dot",
            vec![entry("a", Kind::Dir), file("a/../../evil", 1, 1)],
        ),
        (
            "dot-dot folder",
            vec![entry("..", Kind::Dir), file("../evil", 1, 1)],
        ),
        (
            "dot folder",
            vec![entry(".", Kind::Dir), file("./evil", 1, 1)],
        ),
        ("absolute", vec![file("/tmp/evil", 1, 1)]),
        ("empty component", vec![file("a//evil", 1, 1)]),
        ("through a symlink", vec![link, file("a/evil", 1, 1)]),
        ("no parent", vec![file("x/evil", 1, 1)]),
        ("twice", vec![file("evil", 1, 1), file("evil", 1, 1)]),
        ("too big", vec![file("evil", MAX_VOLUME_BYTES + 1, 1)]),
        ("outside the pack", vec![file("evil", 1 << 20, 1)]),
        ("the header", vec![file("evil", 1, 0)]),
        ("huge", huge),
    ];
    let odd = |chunk_size, pack: &str| VolumeManifest {
        chunk_size,
        pack: pack.into(),
        ..good.clone()
    };
    let mut cases: Vec<(&str, VolumeManifest)> = cases
        .into_iter()
        .map(|(what, entries)| {
            let vm = VolumeManifest {
                entries,
                ..good.clone()
            };
            (what, vm)
        })
        .collect();
    cases.push(("odd chunk size", odd(3000, &good.pack)));
    cases.push(("pack name", odd(good.chunk_size, "../../meta/x")));
    // Another volume's larger pack: more than these files need is never fetched.
    let (big, big_token) = v.create("alpha", "big").unwrap();
    v.content(&big.volume_id, Some(&big_token))
        .unwrap()
        .write("/big", &random(1 << 20), Meta::default(), false)
        .unwrap();
    v.flush(&big.volume_id).await.unwrap().unwrap();
    let big_vm: VolumeManifest = serde_json::from_slice(
        &store
            .get_meta(&key("alpha", &big.volume_id))
            .await
            .unwrap()
            .unwrap(),
    )
    .unwrap();
    cases.push(("oversized pack", odd(good.chunk_size, &big_vm.pack)));
    for (what, vm) in cases {
        store
            .put_meta(&k, &serde_json::to_vec(&vm).unwrap())
            .await
            .unwrap();
        let fresh = dir.path().join(format!("fresh-{}", rand::random::<u32>()));
        let (v2, _s2) = node(&weed, &b, &fresh).await;
        let got = v2.content(&vol.volume_id, Some(&token));
        assert!(
            matches!(got, Err(VolumeError::BadManifest { .. })),
            "{what}: {:?}",
            got.err()
        );
        assert!(!data(&fresh, &vol.volume_id).exists(), "{what}");
        let all = names(dir.path());
        assert_eq!(
            all.iter().filter(|n| *n == "evil").count(),
            1,
            "{what}: {all:?}"
        );
    }
    // A manifest written with the bucket's credentials but not its key is not believed.
    let forger = weed.remote(&b).with_meta_key([7; 32]);
    let (_vf, sf) = node_with(
        forger,
        &dir.path().join("forger"),
        Duration::from_secs(3600),
    )
    .await;
    let (other, _) = v.create("alpha", "forged").unwrap();
    let vm = VolumeManifest {
        volume: other.clone(),
        ..good.clone()
    };
    sf.put_meta(
        &key("alpha", &other.volume_id),
        &serde_json::to_vec(&vm).unwrap(),
    )
    .await
    .unwrap();
    let (v3, _s3) = node(&weed, &b, &dir.path().join("c")).await;
    assert!(
        v3.list("alpha")
            .iter()
            .all(|x| x.volume_id != other.volume_id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_api_writes_reach_the_bucket_by_themselves() {
    let Some((dir, weed, b)) = bucket_or_skip("tick") else {
        return;
    };
    let (v, store) = node_with(weed.remote(&b), &dir.path().join("a"), bucket::TICK).await;
    let (vol, token) = v.create("alpha", "auto").unwrap();
    let body = random(5000);
    v.content(&vol.volume_id, Some(&token))
        .unwrap()
        .write("/f", &body, Meta::default(), false)
        .unwrap();
    let found = manifest_when(&store, "alpha", &vol.volume_id, 30, |vm| {
        vm.entries.iter().any(|e| e.path == "f" && e.size == 5000)
    })
    .await;
    let vm = found.expect("flushed within 30 s");
    assert_eq!(vm.volume, vol);
}

#[test]
fn without_a_bucket_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let v = Volumes::open(dir.path(), KEY).unwrap();
    let (vol, token) = v.create("alpha", "local").unwrap();
    v.content(&vol.volume_id, Some(&token))
        .unwrap()
        .write("/f", b"bytes", Meta::default(), false)
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert!(rt.block_on(v.flush(&vol.volume_id)).unwrap().is_none());
    rt.block_on(v.restore(&vol.volume_id)).unwrap();
    rt.block_on(v.flush_all());
    let mut top: Vec<String> = std::fs::read_dir(dir.path().join("volumes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    assert_eq!(top, vec![vol.volume_id.clone()]);
    assert_eq!(
        sorted(names(&dir.path().join("volumes").join(&vol.volume_id))),
        ["data", "f", "volume.json"]
    );
    v.delete("alpha", &vol.volume_id).unwrap();
    assert!(v.list("alpha").is_empty());
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// The manifest of `owner`'s volume `id` once `ok` holds for it (polled up to `secs`).
async fn manifest_when(
    store: &ChunkStore,
    owner: &str,
    id: &str,
    secs: u64,
    ok: impl Fn(&VolumeManifest) -> bool,
) -> Option<VolumeManifest> {
    for _ in 0..secs * 10 {
        if let Some(b) = store.get_meta(&key(owner, id)).await.unwrap() {
            let vm: VolumeManifest = serde_json::from_slice(&b).unwrap();
            if ok(&vm) {
                return Some(vm);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_flushed_when_its_last_mount_goes() {
    let Some((dir, weed, b)) = bucket_or_skip("unmount") else {
        return;
    };
    let state = dir.path().join("a");
    let tick = Duration::from_millis(200);
    let (v, store) = node_with(weed.remote(&b), &state, tick).await;
    let (vol, _) = v.create("alpha", "mounted").unwrap();
    let (one, two) = (
        v.mount_dir(&vol.volume_id).unwrap(),
        v.mount_dir(&vol.volume_id).unwrap(),
    );
    // Mounted: flushed at once, then every 30 s.
    manifest_when(&store, "alpha", &vol.volume_id, 10, |_| true)
        .await
        .expect("a mounted volume is flushed");
    // What a guest writes meanwhile goes when the last mount goes, not before.
    std::fs::write(data(&state, &vol.volume_id).join("g"), b"guest").unwrap();
    drop(one);
    let has_g = |vm: &VolumeManifest| vm.entries.iter().any(|e| e.path == "g");
    assert!(
        manifest_when(&store, "alpha", &vol.volume_id, 1, has_g)
            .await
            .is_none()
    );
    drop(two);
    manifest_when(&store, "alpha", &vol.volume_id, 10, has_g)
        .await
        .expect("flushed after the last mount went");
}
