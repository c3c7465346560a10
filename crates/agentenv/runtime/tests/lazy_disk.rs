//! Lazy disks: a node with an empty state folder and chunk cache starts a template that another node
//! published to a real S3 server (SeaweedFS on loopback); its root disk is served block by block through
//! the runtime's NBD export, never copied here whole, and the cache stays within its bound. A snapshot taken
//! on the first node restores on the second over the same lazy disk (its import brings the template), and
//! a template built on the first node starts on the second.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use agentenv_runtime::{BuildStep, Runtime, RuntimeConfig, SnapshotMode, TemplateSpec, config};
use common::{StateDir, run, spec, token};

fn store(
    dir: &Path,
    weed: &agentenv_store::testing::Weed,
    bucket: &str,
    max: u64,
) -> agentenv_store::StoreConfig {
    let mut c = agentenv_store::StoreConfig::local(dir.join("chunks"), max)
        .with_remote(weed.remote(bucket));
    c.chunk_size = config::DEFAULT_CHUNK_BYTES;
    c
}

/// MD5 of `file` inside the ext4 image `image`, read on the host with debugfs.
fn md5_in_image(image: &Path, file: &str, scratch: &Path) -> String {
    let out = scratch.join("dumped");
    let st = std::process::Command::new("debugfs")
        .args(["-R", &format!("dump {file} {}", out.display())])
        .arg(image)
        .output()
        .expect("debugfs runs");
    assert!(
        out.exists(),
        "debugfs dump {file}: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    let md5 = std::process::Command::new("md5sum")
        .arg(&out)
        .output()
        .unwrap();
    String::from_utf8_lossy(&md5.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// The last lines of the S3 server's log under `dir`.
fn weed_log(dir: &Path) -> String {
    let log = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("weed.log"))
        .find(|p| p.exists())
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_template_starts_lazily_from_s3_on_an_empty_node() {
    let weed_dir = tempfile::tempdir().unwrap();
    let Some(weed) = agentenv_store::testing::weed_or_skip("lazy disks", weed_dir.path()) else {
        return;
    };
    let bucket = format!("k3-lazy-{:x}", rand::random::<u32>());
    // A file of the image that the template's snapshot has not read (not in its page cache).
    let file = "/usr/bin/python3.11";

    // Node A builds (or reuses) the default template and publishes it.
    let a = StateDir::new();
    let rt_a = common::runtime_with(a.path(), |c| {
        c.store = Some(store(a.path(), &weed, &bucket, config::DEFAULT_STORE_BYTES));
        c.warm_vms = 0;
    })
    .await;
    if let Err(e) = rt_a.publish_template("base").await {
        panic!("publish: {e}; S3 server log: {}", weed_log(weed_dir.path()));
    }
    rt_a.publish_template("base")
        .await
        .expect("a second publish is a no-op");
    let image = a.path().join("templates/base");
    let image = std::fs::read_dir(&image)
        .unwrap()
        .flatten()
        .map(|e| e.path().join("base.ext4"))
        .find(|p| p.exists())
        .expect("A's base.ext4");
    let image_len = std::fs::metadata(&image).unwrap().len();
    let want = md5_in_image(&image, file, a.path());
    // A snapshot of a sandbox on A: its disk is an overlay over the template's disk.
    let src = format!("src-{}", &token()[..8]);
    rt_a.create(spec(&src)).await.expect("create on A");
    let secret_a = token();
    let (_, code) = run(
        &rt_a,
        &src,
        &format!("echo {secret_a} > /home/user/snap.txt && sync"),
    )
    .await;
    assert_eq!(code, 0);
    let snap = format!("snap-{}", &token()[..8]);
    rt_a.snapshot(&src, &snap, &[], SnapshotMode::Full)
        .await
        .expect("snapshot on A");
    rt_a.kill(&src).await.expect("kill on A");
    // A template built on A (here the cached build under another id) is in the bucket once its
    // build answers.
    let derived = format!("derived-{}", &token()[..8]);
    let steps = std::sync::Mutex::new(Vec::new());
    rt_a.build_template(
        TemplateSpec {
            id: derived.clone(),
            ..TemplateSpec::base()
        },
        &|p| steps.lock().unwrap().push(p.step),
    )
    .await
    .expect("build on A");
    let steps = steps.into_inner().unwrap();
    assert_eq!(
        steps[steps.len() - 2..],
        [BuildStep::Publish, BuildStep::Done],
        "{steps:?}"
    );
    drop(rt_a);

    // Node B: its own state folder, an empty cache bounded far below the image, the same bucket.
    const BOUND: u64 = 48 << 20;
    assert!(BOUND < image_len / 8, "image of {image_len} bytes");
    let b = StateDir::new();
    let mut cfg = RuntimeConfig::new(b.path());
    cfg.guest_bin = Some(common::guest_bin());
    cfg.store = Some(store(b.path(), &weed, &bucket, BOUND));
    cfg.warm_vms = 0;
    let rt = Runtime::open(cfg).await.expect("runtime B");
    assert!(rt.templates().is_empty(), "B has no template of its own");
    assert!(rt.snapshots().is_empty());
    assert_eq!(rt.store_stats().chunks, 0, "B's cache starts empty");

    // The snapshot first: its import brings the template, whose disk stays in the bucket.
    let t = Instant::now();
    while rt.import_snapshot(&snap).await.expect("import").is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "snapshot not stored on A"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        rt.templates().len(),
        1,
        "the template came with the snapshot"
    );
    let from_snap = format!("fromsnap-{}", &token()[..8]);
    let mut s = spec(&from_snap);
    s.template_id = snap.clone();
    rt.create(s).await.expect("create from the snapshot");
    let (out, code) = run(
        &rt,
        &from_snap,
        &format!("cat /home/user/snap.txt; md5sum {file}"),
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with(&format!("{secret_a}\n{want}")), "{out}");

    let t0 = Instant::now();
    let id1 = format!("lazy-{}", &token()[..8]);
    rt.create(spec(&id1)).await.expect("create from the bucket");
    let (out, code) = run(&rt, &id1, &format!("md5sum {file}")).await;
    eprintln!(
        "create + first command, disk chunks from S3: {:?}",
        t0.elapsed()
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.split_whitespace().next(), Some(want.as_str()), "{out}");

    // The disk exists here only as its marker; one export serves it.
    let tdir = std::fs::read_dir(b.path().join("templates/base"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir())
        .expect("B's template folder");
    assert!(
        !tdir.join("base.ext4").exists(),
        "no whole copy of the disk"
    );
    assert!(tdir.join("base.ext4.lazy").exists());
    assert!(tdir.join("base.mem").exists() && tdir.join("base.state").exists());
    assert_eq!(rt.lazy_exports().await, 1);
    // QEMU (a uid of its own) reaches the socket only through the folder it inherits.
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let nbd = b.path().join("nbd");
    assert_eq!(mode(&nbd), 0o700, "no path leads a VM uid to the sockets");
    let export = std::fs::read_dir(&nbd)
        .unwrap()
        .flatten()
        .next()
        .unwrap()
        .path();
    assert_eq!(mode(&export), 0o711);
    let inside: Vec<_> = std::fs::read_dir(&export)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        inside,
        vec![std::ffi::OsString::from("disk.sock")],
        "the folder holds only the socket"
    );

    // Writes go to the sandbox's own overlay; a second sandbox shares the export, not the writes.
    let secret = token();
    let (out, code) = run(
        &rt,
        &id1,
        &format!("echo {secret} > /home/user/lazy.txt && sync && cat /home/user/lazy.txt"),
    )
    .await;
    assert_eq!((out.trim(), code), (secret.as_str(), 0));
    let id2 = format!("lazy-{}", &token()[..8]);
    rt.create(spec(&id2)).await.expect("second create");
    let (out, code) = run(
        &rt,
        &id2,
        &format!("md5sum {file}; cat /home/user/lazy.txt"),
    )
    .await;
    assert_ne!(
        code, 0,
        "the second sandbox lacks the first one's file: {out}"
    );
    assert!(out.starts_with(&want), "{out}");
    assert_eq!(rt.lazy_exports().await, 1, "one export per manifest");

    let stats = rt.store_stats();
    eprintln!("B's cache: {stats:?} (image {image_len} bytes)");
    assert!(
        stats.bytes <= BOUND,
        "cache {} bytes over its bound {BOUND}",
        stats.bytes
    );
    assert!(stats.bytes < image_len);

    // The export stops when no QEMU uses it.
    for id in [&from_snap, &id1, &id2] {
        rt.kill(id).await.expect("kill");
    }
    let t = Instant::now();
    while rt.lazy_exports().await > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "export still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A later sandbox starts it again.
    let id3 = format!("lazy-{}", &token()[..8]);
    rt.create(spec(&id3))
        .await
        .expect("create after the export stopped");
    let (out, code) = run(&rt, &id3, "head -c 4 /usr/bin/python3.11 | od -c | head -1").await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("E   L   F"), "{out}");
    rt.kill(&id3).await.expect("kill");

    // The template built on A starts here without a build.
    let mut s = spec(&format!("derived-{}", &token()[..8]));
    s.template_id = derived.clone();
    rt.create(s.clone()).await.expect("create from A's build");
    let (out, code) = run(&rt, &s.sandbox_id, "echo ok").await;
    assert_eq!((out.as_str(), code), ("ok\n", 0));
    assert!(rt.templates().iter().any(|t| t.id == derived));
    rt.kill(&s.sandbox_id).await.expect("kill");
    drop(rt);
    assert!(common::qemu_pids_under(b.path()).is_empty());
}
