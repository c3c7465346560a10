//! Volumes on a real folder: per-tenant names and tokens, and the content rules.

use crate::keys;
use crate::volumes::*;

fn vols() -> (tempfile::TempDir, Volumes) {
    let dir = tempfile::tempdir().unwrap();
    let v = Volumes::open(dir.path(), &keys::generate_api_key()).unwrap();
    (dir, v)
}

#[test]
fn volumes_are_per_tenant_and_tokens_open_only_their_own() {
    let (_d, v) = vols();
    let name = format!("v-{}", rand::random::<u32>());
    let (a, ta) = v.create("alpha", &name).unwrap();
    assert!(matches!(
        v.create("alpha", &name),
        Err(VolumeError::NameTaken(_))
    ));
    let (b, tb) = v.create("beta", &name).unwrap();
    assert_ne!((&a.volume_id, &ta), (&b.volume_id, &tb));
    assert_eq!(v.list("alpha"), vec![a.clone()]);
    assert!(matches!(
        v.get("beta", &a.volume_id),
        Err(VolumeError::NotFound(_))
    ));
    assert!(matches!(
        v.delete("beta", &a.volume_id),
        Err(VolumeError::NotFound(_))
    ));
    assert!(v.content(&a.volume_id, Some(&ta)).is_ok());
    for wrong in [None, Some(tb.as_str()), Some("vol_0")] {
        assert!(matches!(
            v.content(&a.volume_id, wrong),
            Err(VolumeError::Unauthorized)
        ));
    }
    for bad in ["", "a b", "../x", &"x".repeat(65)] {
        assert!(matches!(
            v.create("alpha", bad),
            Err(VolumeError::BadName(_))
        ));
    }
    v.delete("alpha", &a.volume_id).unwrap();
    assert!(matches!(
        v.content(&a.volume_id, Some(&ta)),
        Err(VolumeError::NotFound(_))
    ));
    for i in 1..MAX_VOLUMES {
        v.create("beta", &format!("n{i}")).unwrap();
    }
    assert!(matches!(
        v.create("beta", "one-more"),
        Err(VolumeError::TooMany(_))
    ));
}

#[test]
fn content_stays_below_the_root_and_follows_e2bs_rules() {
    let (d, v) = vols();
    let (vol, t) = v.create("alpha", "files").unwrap();
    let c = v.content(&vol.volume_id, Some(&t)).unwrap();
    let body: Vec<u8> = (0..rand::random_range(1..4096))
        .map(|_| rand::random())
        .collect();
    assert!(matches!(
        c.write("/a/b.bin", &body, Meta::default(), false),
        Err(VolumeError::PathNotFound(_))
    ));
    let dir = c.mkdir("/a/deep", Meta::default(), true).unwrap();
    assert_eq!((dir.kind, dir.path.as_str()), ("directory", "/a/deep"));
    assert!(matches!(
        c.mkdir("/a", Meta::default(), false),
        Err(VolumeError::Exists(_))
    ));
    let st = c
        .write(
            "//a/./b.bin",
            &body,
            Meta {
                mode: Some(0o4755),
                ..Meta::default()
            },
            false,
        )
        .unwrap();
    assert_eq!(
        (st.path.as_str(), st.size, st.mode),
        ("/a/b.bin", body.len() as u64, 0o755)
    );
    assert!(matches!(
        c.write("/a/b.bin", b"x", Meta::default(), false),
        Err(VolumeError::Exists(_))
    ));
    let mut got = vec![];
    std::io::Read::read_to_end(&mut c.read("/a/b.bin").unwrap(), &mut got).unwrap();
    assert_eq!(got, body);
    let names: Vec<String> = c
        .list("/", 2)
        .unwrap()
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(names, ["/a", "/a/b.bin", "/a/deep"]);
    for escape in ["../x", "/a/../../x", "/a/.."] {
        assert!(
            matches!(c.stat(escape), Err(VolumeError::BadPath(_))),
            "{escape}"
        );
    }
    // A symlink (left by anyone) is never followed, as a parent or to read.
    let outside = d.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let link = d
        .path()
        .join("volumes")
        .join(&vol.volume_id)
        .join("data/link");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    assert!(matches!(
        c.write("/link/x", b"x", Meta::default(), true),
        Err(VolumeError::NotADirectory(_))
    ));
    assert!(matches!(c.read("/link"), Err(VolumeError::PathNotFound(_))));
    assert!(std::fs::read_dir(&outside).unwrap().next().is_none());
    c.remove("/a").unwrap();
    assert!(matches!(
        c.stat("/a/b.bin"),
        Err(VolumeError::PathNotFound(_))
    ));
    assert!(matches!(c.remove("/"), Err(VolumeError::BadPath(_))));
}

#[test]
fn a_folder_swapped_for_a_symlink_mid_request_never_leads_out() {
    let (d, v) = vols();
    let (vol, t) = v.create("alpha", "race").unwrap();
    let c = v.content(&vol.volume_id, Some(&t)).unwrap();
    let outside = d.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"host").unwrap();
    let data = d.path().join("volumes").join(&vol.volume_id).join("data");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A guest swaps folder `d` and a symlink `d -> outside` as fast as it can.
    let swapper = {
        let (data, outside, stop) = (data.clone(), outside.clone(), stop.clone());
        std::thread::spawn(move || {
            let (dir, link) = (data.join("d"), data.join("d.link"));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::fs::create_dir(&dir);
                let _ = std::fs::write(dir.join("secret"), b"mine");
                let _ = std::fs::remove_file(&link);
                let _ = std::os::unix::fs::symlink(&outside, &link);
                let _ = std::fs::rename(&link, &dir);
                let _ = std::fs::remove_file(&dir);
            }
        })
    };
    for _ in 0..2000 {
        if let Ok(mut f) = c.read("/d/secret") {
            let mut got = vec![];
            std::io::Read::read_to_end(&mut f, &mut got).unwrap();
            assert_ne!(got, b"host");
        }
        let _ = c.write("/d/new", b"x", Meta::default(), true);
        let _ = c.set_meta(
            "/d/secret",
            Meta {
                mode: Some(0o777),
                ..Meta::default()
            },
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    swapper.join().unwrap();
    let names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names, ["secret"]);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(outside.join("secret"))
        .unwrap()
        .permissions()
        .mode();
    assert_ne!(mode & 0o777, 0o777);
}
