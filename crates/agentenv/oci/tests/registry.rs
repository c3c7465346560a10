//! Pull and push against a real `docker-registry` on loopback (skipped with a reason if missing).

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use agentenv_oci::manifest::RunConfig;
use agentenv_oci::push::Pusher;
use agentenv_oci::testing::{LayerBuilder, TestImage, TestRegistry, read};
use agentenv_oci::{
    Compression, Digest, ImageRef, OciError, Platform, PullEvent, PullOptions, pull,
};
use rand::Rng;

mod common;
use common::{arch_image, opts};

fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rng().fill(&mut v[..]);
    v
}

/// The sample image plus a top layer with a random file of random size.
fn sample_with_random() -> (TestImage, Vec<u8>) {
    let payload = random_bytes(rand::rng().random_range(1..3_000_000));
    let top = LayerBuilder::new()
        .file("data/random.bin", &payload, 0o644)
        .tar();
    (TestImage::sample().layer(&top, Compression::Gzip), payload)
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn assert_sample_tree(root: &Path, payload: &[u8]) {
    assert_eq!(
        read(&root.join("etc/os-release")),
        b"ID=k3test\nVERSION=2\n"
    );
    assert_eq!(mode(&root.join("bin/tool")), 0o4755, "setuid kept");
    assert_eq!(
        std::fs::read_link(root.join("bin/tool-link")).unwrap(),
        Path::new("tool")
    );
    let (a, b) = (
        std::fs::metadata(root.join("bin/tool")).unwrap(),
        std::fs::metadata(root.join("bin/tool-hard")).unwrap(),
    );
    assert_eq!(
        (a.dev(), a.ino()),
        (b.dev(), b.ino()),
        "hard link shares the inode"
    );
    assert!(root.join("usr/share/doc/keep").exists());
    assert!(
        !root.join("usr/share/doc/gone").exists(),
        "whiteout applied"
    );
    assert!(
        !root.join("usr/share/doc/.wh.gone").exists(),
        "whiteout not materialised"
    );
    let mut cache: Vec<String> = std::fs::read_dir(root.join("var/cache/app"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    cache.sort();
    assert_eq!(
        cache,
        ["new"],
        "opaque directory keeps only the upper layer's entries"
    );
    assert_eq!(mode(&root.join("var/cache/app")), 0o750);
    assert_eq!(mode(&root.join("var/cache/app/new")), 0o600);
    let profile = std::fs::metadata(root.join("home/app/.profile")).unwrap();
    assert_eq!(
        (
            profile.uid(),
            profile.gid(),
            mode(&root.join("home/app/.profile"))
        ),
        (1000, 1000, 0o640)
    );
    assert_eq!(mode(&root.join("home/app")), 0o700);
    assert!(
        std::fs::symlink_metadata(root.join("run-fifo"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert_eq!(
        read(&root.join("srv/work/README")),
        b"hello from the top layer\n"
    );
    assert_eq!(read(&root.join("data/random.bin")), payload);
    assert_eq!(
        std::fs::metadata(root.join("srv/work/README"))
            .unwrap()
            .mtime(),
        1_700_000_000
    );
}

#[test]
fn pull_by_tag_applies_layers_and_honours_config() {
    let Some(reg) = TestRegistry::start_or_skip("pull_by_tag", None) else {
        return;
    };
    let (img, payload) = sample_with_random();
    let image = reg.image("k3/sample:v1");
    let pushed = img.push(&image, &reg.options()).unwrap();
    let t = tempfile::tempdir().unwrap();
    let dest = t.path().join("rootfs");
    let mut events = Vec::new();
    let got = pull(&image, &dest, &opts(&reg), &mut |e| events.push(e.clone())).unwrap();
    assert_sample_tree(&dest, &payload);

    assert_eq!(got.digest, pushed.digest);
    assert_eq!(got.index_digest, None);
    assert_eq!(got.layers.len(), 4);
    assert_eq!(
        got.bytes,
        img.layers
            .iter()
            .map(|l| l.blob.bytes.len() as u64)
            .sum::<u64>()
    );
    assert_eq!(got.downloaded_bytes, got.bytes);
    for (l, t) in got.layers.iter().zip(&img.layers) {
        assert_eq!(l.diff_id, t.diff_id);
        assert_eq!(l.digest, Digest::of(&t.blob.bytes));
        assert!(!l.cached);
    }
    let c = &got.config;
    assert_eq!((c.os.as_str(), c.architecture.as_str()), ("linux", "amd64"));
    assert_eq!(
        c.env,
        ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hi there"]
    );
    assert_eq!(c.working_dir.as_deref(), Some("/srv/work"));
    assert_eq!(c.user.as_deref(), Some("1000:1000"));
    assert_eq!(c.command(), ["/bin/tool", "--serve", "8080"]);
    let ids = c.user_ids(&dest).unwrap();
    assert_eq!((ids.uid, ids.gid), (1000, 1000));

    // Events: Resolved first, then per layer start → bytes → downloaded → applying → applied, in order.
    assert!(
        matches!(&events[0], PullEvent::Resolved { layer_sizes, .. } if layer_sizes.len() == 4)
    );
    let applied: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            PullEvent::Applied { index, .. } => Some(*index),
            _ => None,
        })
        .collect();
    assert_eq!(applied, [0, 1, 2, 3]);
    // Per layer: start, downloaded, applying, applied, in that order.
    for i in 0..4 {
        let at = |want: &dyn Fn(&PullEvent) -> bool| events.iter().position(want).unwrap();
        let start = at(&|e| matches!(e, PullEvent::LayerStart { index, .. } if *index == i));
        let done = at(&|e| matches!(e, PullEvent::LayerDownloaded { index } if *index == i));
        let applying = at(&|e| matches!(e, PullEvent::Applying { index } if *index == i));
        let applied = at(&|e| matches!(e, PullEvent::Applied { index, .. } if *index == i));
        assert!(
            start < done && done < applying && applying < applied,
            "layer {i}: {events:?}"
        );
    }
    for (i, l) in got.layers.iter().enumerate() {
        let last_bytes = events.iter().rev().find_map(|e| match e {
            PullEvent::LayerBytes { index, done, total } if *index == i => Some((*done, *total)),
            _ => None,
        });
        assert_eq!(
            last_bytes,
            Some((l.size, l.size)),
            "layer {i} progress reaches its size"
        );
    }
    // The temporary blob folder is gone.
    let leftovers: Vec<_> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, [std::ffi::OsString::from("rootfs")]);

    // Pulling into a non-empty folder is refused.
    let err = pull(&image, &dest, &opts(&reg), &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            err,
            OciError::Io {
                what: "pull into",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn pull_by_digest_and_blob_cache() {
    let Some(reg) = TestRegistry::start_or_skip("pull_by_digest", None) else {
        return;
    };
    let (img, payload) = sample_with_random();
    let pushed = img
        .push(&reg.image("k3/sample:v1"), &reg.options())
        .unwrap();
    let by_digest = reg.image(&format!("k3/sample@{}", pushed.digest));
    let t = tempfile::tempdir().unwrap();
    let o = PullOptions {
        blob_dir: Some(t.path().join("blobs")),
        ..opts(&reg)
    };
    let got = pull(&by_digest, &t.path().join("a"), &o, &mut |_| {}).unwrap();
    assert_eq!(got.digest, pushed.digest);
    assert_sample_tree(&t.path().join("a"), &payload);
    // Second pull: every layer comes from the verified blob folder.
    let again = pull(&by_digest, &t.path().join("b"), &o, &mut |_| {}).unwrap();
    assert!(again.layers.iter().all(|l| l.cached));
    assert_eq!(again.downloaded_bytes, 0);
    assert_sample_tree(&t.path().join("b"), &payload);

    let unknown = reg.image(&format!("k3/sample@{}", Digest::of(&random_bytes(32))));
    let err = pull(&unknown, &t.path().join("c"), &o, &mut |_| {}).unwrap_err();
    assert!(
        matches!(
            err,
            OciError::NotFound {
                what: "manifest",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn index_picks_the_platform_and_names_the_ones_present() {
    let Some(reg) = TestRegistry::start_or_skip("index_platforms", None) else {
        return;
    };
    let pusher = Pusher::new(&reg.image("k3/multi"), &reg.options());
    let mut entries = Vec::new();
    for (arch, variant) in [("arm64", Some("v8")), ("amd64", None)] {
        let (img, p) = arch_image(arch, variant);
        let d = img
            .push(&reg.image(&format!("k3/multi:{arch}")), &reg.options())
            .unwrap();
        entries.push((p, d));
    }
    let index_digest = pusher.push_index("both", &entries).unwrap();
    let t = tempfile::tempdir().unwrap();
    let got = pull(
        &reg.image("k3/multi:both"),
        &t.path().join("amd"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(read(&t.path().join("amd/arch")), b"amd64");
    assert_eq!(got.index_digest, Some(index_digest));
    assert_eq!(got.digest, entries[1].1.digest);
    assert_eq!(got.config.architecture, "amd64");

    let arm = PullOptions {
        platform: Platform {
            architecture: "arm64".into(),
            os: "linux".into(),
            variant: None,
        },
        ..opts(&reg)
    };
    pull(
        &reg.image("k3/multi:both"),
        &t.path().join("arm"),
        &arm,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(read(&t.path().join("arm/arch")), b"arm64");

    // An index without linux/amd64: the error lists what it has, and nothing is downloaded.
    let (img, p) = arch_image("s390x", None);
    let s390 = img
        .push(&reg.image("k3/multi:s390x"), &reg.options())
        .unwrap();
    pusher
        .push_index("no-amd64", &[entries[0].clone(), (p, s390)])
        .unwrap();
    let mut events = 0;
    let err = pull(
        &reg.image("k3/multi:no-amd64"),
        &t.path().join("x"),
        &opts(&reg),
        &mut |_| events += 1,
    )
    .unwrap_err();
    match &err {
        OciError::PlatformMissing {
            wanted, present, ..
        } => {
            assert_eq!(wanted, "linux/amd64");
            assert_eq!(present, &["linux/arm64/v8", "linux/s390x"]);
        }
        e => panic!("expected PlatformMissing, got {e}"),
    }
    assert!(
        err.to_string().contains("linux/arm64/v8, linux/s390x"),
        "{err}"
    );
    assert_eq!(events, 0);
    // A plain manifest whose config is for another platform.
    let err = pull(
        &reg.image("k3/multi:arm64"),
        &t.path().join("y"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        matches!(&err, OciError::PlatformMissing { present, .. } if present == &["linux/arm64"]),
        "{err}"
    );
}

#[test]
fn unknown_repository_and_tag_are_not_found() {
    let Some(reg) = TestRegistry::start_or_skip("not_found", None) else {
        return;
    };
    let (img, _) = arch_image("amd64", None);
    img.push(&reg.image("k3/there:v1"), &reg.options()).unwrap();
    let t = tempfile::tempdir().unwrap();
    let err = pull(
        &reg.image("k3/absent:v1"),
        &t.path().join("a"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap_err();
    match &err {
        OciError::NotFound {
            repository,
            reference,
            detail,
            what,
            ..
        } => {
            assert_eq!(
                (repository.as_str(), reference.as_str(), *what),
                ("k3/absent", "v1", "manifest")
            );
            // distribution 2.8 answers MANIFEST_UNKNOWN for a repository it never saw, others NAME_UNKNOWN.
            assert!(
                detail.contains("NAME_UNKNOWN") || detail.contains("MANIFEST_UNKNOWN"),
                "{detail}"
            );
        }
        e => panic!("expected NotFound, got {e}"),
    }
    let err = pull(
        &reg.image("k3/there:v2"),
        &t.path().join("b"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        matches!(&err, OciError::NotFound { detail, reference, .. } if detail.contains("MANIFEST_UNKNOWN") && reference == "v2"),
        "{err}"
    );
    // Bad references fail before any request.
    for bad in ["", "UPPER/case", "a:b:c", "x@sha256:1234"] {
        assert!(ImageRef::parse(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn size_limits_refuse_before_downloading() {
    let Some(reg) = TestRegistry::start_or_skip("size_limits", None) else {
        return;
    };
    let (img, payload) = sample_with_random();
    let image = reg.image("k3/big:v1");
    img.push(&image, &reg.options()).unwrap();
    let sizes: Vec<u64> = img
        .layers
        .iter()
        .map(|l| l.blob.bytes.len() as u64)
        .collect();
    let biggest = *sizes.iter().max().unwrap();
    let t = tempfile::tempdir().unwrap();

    let mut started = 0;
    let o = PullOptions {
        max_layer_bytes: biggest - 1,
        ..opts(&reg)
    };
    let err = pull(&image, &t.path().join("a"), &o, &mut |e| {
        if matches!(e, PullEvent::LayerStart { .. }) {
            started += 1;
        }
    })
    .unwrap_err();
    assert!(
        matches!(&err, OciError::TooLarge { what: "layer", size, limit, .. } if *size == biggest && *limit == biggest - 1),
        "{err}"
    );
    assert_eq!(started, 0, "no layer download started");
    assert_eq!(std::fs::read_dir(t.path().join("a")).unwrap().count(), 0);

    let total: u64 = sizes.iter().sum();
    let o = PullOptions {
        max_total_bytes: total - 1,
        ..opts(&reg)
    };
    let err = pull(&image, &t.path().join("b"), &o, &mut |_| {}).unwrap_err();
    assert!(
        matches!(&err, OciError::ImageTooLarge { total: t, .. } if *t == total),
        "{err}"
    );

    // Unpacked content: the random payload alone is over the limit.
    let o = PullOptions {
        max_unpacked_bytes: payload.len() as u64 - 1,
        ..opts(&reg)
    };
    let err = pull(&image, &t.path().join("c"), &o, &mut |_| {}).unwrap_err();
    assert!(matches!(&err, OciError::UnpackedTooLarge { .. }), "{err}");
}

#[test]
fn corrupted_blob_is_a_digest_mismatch() {
    let Some(reg) = TestRegistry::start_or_skip("digest_mismatch", None) else {
        return;
    };
    let (img, _) = sample_with_random();
    let image = reg.image("k3/corrupt:v1");
    img.push(&image, &reg.options()).unwrap();
    // Flip one byte of the top layer as stored by the registry (same length).
    let top = img.layers.last().unwrap();
    let d = Digest::of(&top.blob.bytes);
    let path = reg.blob_path(&d);
    let mut bytes = read(&path);
    let i = rand::rng().random_range(0..bytes.len());
    bytes[i] ^= 0x5a;
    std::fs::write(&path, &bytes).unwrap();

    let t = tempfile::tempdir().unwrap();
    let o = PullOptions {
        blob_dir: Some(t.path().join("blobs")),
        ..opts(&reg)
    };
    let err = pull(&image, &t.path().join("a"), &o, &mut |_| {}).unwrap_err();
    match &err {
        OciError::DigestMismatch {
            what,
            expected,
            actual,
        } => {
            assert_eq!((*what, expected), ("layer", &d));
            assert_eq!(actual, &Digest::of(&bytes));
        }
        e => panic!("expected DigestMismatch, got {e}"),
    }
    assert!(
        !t.path().join("blobs/sha256").join(d.hex()).exists(),
        "bad blob not cached"
    );
    let partials = std::fs::read_dir(t.path().join("blobs/sha256"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".partial")
        })
        .count();
    assert_eq!(partials, 0);
}

#[test]
fn hostile_layer_through_pull_is_refused() {
    let Some(reg) = TestRegistry::start_or_skip("hostile_pull", None) else {
        return;
    };
    let evil = LayerBuilder::new()
        .dir("ok", 0o755)
        .raw(tar::EntryType::Regular, b"ok/../../escaped", None, b"x")
        .tar();
    let img = TestImage::new(RunConfig::default()).layer(&evil, Compression::Gzip);
    let image = reg.image("k3/evil:v1");
    img.push(&image, &reg.options()).unwrap();
    let t = tempfile::tempdir().unwrap();
    let err = pull(&image, &t.path().join("root"), &opts(&reg), &mut |_| {}).unwrap_err();
    assert!(
        matches!(&err, OciError::PathEscape { entry, .. } if entry == "ok/../../escaped"),
        "{err}"
    );
    assert!(!t.path().join("escaped").exists());
}

#[test]
fn declared_size_must_match_the_blob() {
    let Some(reg) = TestRegistry::start_or_skip("size_mismatch", None) else {
        return;
    };
    let (img, _) = sample_with_random();
    let image = reg.image("k3/sized:v1");
    img.push(&image, &reg.options()).unwrap();
    // Re-tag a manifest whose top layer claims one byte less than the stored blob.
    let pusher = Pusher::new(&image, &reg.options());
    let config = pusher
        .push_blob(agentenv_oci::manifest::OCI_CONFIG, &img.config_json())
        .unwrap();
    let mut layers: Vec<_> = img
        .layers
        .iter()
        .map(|l| pusher.push_blob(&l.blob.media_type, &l.blob.bytes).unwrap())
        .collect();
    let top = layers.last_mut().unwrap();
    top.size -= 1;
    let (digest, size) = (top.digest.clone(), top.size);
    let m = agentenv_oci::manifest::Manifest {
        schema_version: 2,
        media_type: Some(agentenv_oci::manifest::OCI_MANIFEST.into()),
        config,
        layers,
        annotations: Default::default(),
    };
    let body = serde_json::to_vec(&m).unwrap();
    // distribution 2.8 does not compare descriptor sizes with its blobs, so the client must.
    pusher
        .push_manifest("short", agentenv_oci::manifest::OCI_MANIFEST, &body)
        .unwrap();
    let t = tempfile::tempdir().unwrap();
    let err = pull(
        &reg.image("k3/sized:short"),
        &t.path().join("a"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(
        matches!(&err, OciError::SizeMismatch { digest: d, expected, more: true, .. } if *d == digest && *expected == size),
        "{err}"
    );
}

#[test]
fn a_silent_registry_times_out() {
    // A listener that never answers: the kernel completes the handshake, nobody reads.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let image = ImageRef::parse(&format!("{}/k3/silent:v1", silent.local_addr().unwrap())).unwrap();
    let mut o = PullOptions::default();
    o.registry.allow = vec![agentenv_oci::AllowedNet::parse("127.0.0.1").unwrap()];
    o.registry.timeout = std::time::Duration::from_millis(500);
    o.registry.stall_timeout = std::time::Duration::from_millis(500);
    let t = tempfile::tempdir().unwrap();
    let err = pull(&image, &t.path().join("a"), &o, &mut |_| {}).unwrap_err();
    assert!(
        matches!(&err, OciError::Timeout { method: "GET", .. }),
        "{err}"
    );
}

#[test]
fn docker_manifest_list_and_v2_manifests() {
    let Some(reg) = TestRegistry::start_or_skip("docker_types", None) else {
        return;
    };
    let pusher = Pusher::new(&reg.image("k3/dock"), &reg.options());
    let mut entries = Vec::new();
    for arch in ["arm64", "amd64"] {
        let (img, p) = arch_image(arch, None);
        let d = img
            .push_docker(&reg.image(&format!("k3/dock:{arch}")), &reg.options())
            .unwrap();
        assert_eq!(d.media_type, agentenv_oci::manifest::DOCKER_MANIFEST);
        entries.push((p, d));
    }
    let list = pusher.push_docker_list("list", &entries).unwrap();
    let t = tempfile::tempdir().unwrap();
    let got = pull(
        &reg.image("k3/dock:list"),
        &t.path().join("a"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(read(&t.path().join("a/arch")), b"amd64");
    assert_eq!(got.index_digest, Some(list));
    assert_eq!(got.digest, entries[1].1.digest);
    assert_eq!(
        got.layers[0].media_type,
        agentenv_oci::manifest::DOCKER_LAYER_GZIP
    );
    // The plain Docker manifest by tag too.
    let got = pull(
        &reg.image("k3/dock:amd64"),
        &t.path().join("b"),
        &opts(&reg),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(
        (got.index_digest, got.digest),
        (None, entries[1].1.digest.clone())
    );
}
