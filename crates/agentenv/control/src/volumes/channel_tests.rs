//! The host's end of volume channels on a real folder: a hostile guest's requests stay inside the
//! volume and its limit; random writes read back.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::Arc;

use agentenv_envd::volume::{self, Kind, Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::channel::{VolumeDir, serve};
use super::{MAX_VOLUME_BYTES, MAX_VOLUME_ENTRIES};

fn dir() -> (tempfile::TempDir, VolumeDir) {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("data")).unwrap();
    let v = VolumeDir::open(&d.path().join("data")).unwrap();
    (d, v)
}

fn ask(v: &VolumeDir, r: Request) -> Response {
    v.answer(r, b"").0
}

fn create(v: &VolumeDir, path: &str) -> Response {
    ask(
        v,
        Request::Create {
            path: path.into(),
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            exclusive: true,
        },
    )
}

#[test]
fn random_writes_read_back_and_entries_page() {
    let (d, v) = dir();
    assert!(matches!(create(&v, "/f"), Response::Attr(a) if a.kind == Kind::File && a.uid == 1000));
    // Opened with O_CREAT but not O_EXCL: a new file is the asker's, an existing one keeps its owner.
    for (uid, want) in [(7, 7), (8, 7)] {
        let open = Request::Create {
            path: "/g".into(),
            mode: 0o600,
            uid,
            gid: uid,
            exclusive: false,
        };
        assert!(matches!(ask(&v, open), Response::Attr(a) if a.uid == want && a.mode == 0o600));
    }
    let mut model = vec![];
    for _ in 0..40 {
        let off = rand::random::<u32>() as u64 % 300_000;
        let len = rand::random::<u32>() as usize % (volume::MAX_IO as usize + 1);
        let bytes: Vec<u8> = (0..len).map(|_| rand::random()).collect();
        let w = Request::Write {
            path: "/f".into(),
            offset: off,
        };
        assert_eq!(v.answer(w, &bytes).0, Response::Written(len as u32));
        let end = off as usize + len;
        if model.len() < end {
            model.resize(end, 0);
        }
        model[off as usize..end].copy_from_slice(&bytes);
    }
    assert_eq!(std::fs::read(d.path().join("data/f")).unwrap(), model);
    let (r, got) = v.answer(
        Request::Read {
            path: "/f".into(),
            offset: 1000,
            len: u32::MAX,
        },
        b"",
    );
    assert_eq!(r, Response::Data);
    let want = &model[1000.min(model.len())..];
    assert_eq!(got, want[..want.len().min(volume::MAX_IO as usize)]);

    let n = volume::MAX_ENTRIES + 7;
    ask(
        &v,
        Request::Mkdir {
            path: "/many".into(),
            mode: 0o750,
            uid: 0,
            gid: 0,
        },
    );
    for i in 0..n {
        create(&v, &format!("/many/{i:04}"));
    }
    let page = |offset| match ask(
        &v,
        Request::List {
            path: "/many".into(),
            offset,
        },
    ) {
        Response::Entries(e) => e,
        r => panic!("{r:?}"),
    };
    let (a, b) = (page(0), page(volume::MAX_ENTRIES as u64));
    assert_eq!((a.len(), b.len()), (volume::MAX_ENTRIES, 7));
    assert_eq!(b.last().unwrap().name, format!("{:04}", n - 1));
}

#[test]
fn a_guest_never_reaches_past_the_volume() {
    let (d, v) = dir();
    let outside = d.path().join("secret");
    std::fs::write(&outside, b"host only").unwrap();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = |path: &str, target: &str| {
        ask(
            &v,
            Request::Symlink {
                path: path.into(),
                target: target.into(),
                uid: 0,
                gid: 0,
            },
        )
    };
    assert!(matches!(link("/up", ".."), Response::Attr(_)));
    assert!(matches!(
        link("/s", outside.to_str().unwrap()),
        Response::Attr(_)
    ));
    let refused = |r: Response| assert!(matches!(r, Response::Errno(_)), "{r:?}");
    refused(ask(
        &v,
        Request::Stat {
            path: "/up/secret".into(),
        },
    ));
    refused(ask(
        &v,
        Request::Stat {
            path: "/../secret".into(),
        },
    ));
    refused(ask(
        &v,
        Request::Read {
            path: "/s".into(),
            offset: 0,
            len: 100,
        },
    ));
    refused(
        v.answer(
            Request::Write {
                path: "/s".into(),
                offset: 0,
            },
            b"x",
        )
        .0,
    );
    refused(create(&v, "/up/new"));
    refused(ask(
        &v,
        Request::SetAttr {
            path: "/s".into(),
            mode: Some(0o777),
            uid: None,
            gid: None,
            size: Some(0),
            atime_ns: None,
            mtime_ns: None,
        },
    ));
    refused(ask(
        &v,
        Request::Rename {
            from: "/up/secret".into(),
            to: "/mine".into(),
            noreplace: false,
        },
    ));
    refused(ask(
        &v,
        Request::Unlink {
            path: "/up/secret".into(),
        },
    ));
    refused(ask(&v, Request::Unlink { path: "/".into() }));
    assert_eq!(std::fs::read(&outside).unwrap(), b"host only");
    let m = std::fs::metadata(&outside).unwrap();
    assert_eq!(m.permissions().mode() & 0o777, 0o600);
    // A symlink itself is the guest's to read, to date (lutimes: tar does), and to remove.
    let touch = Request::SetAttr {
        path: "/s".into(),
        mode: None,
        uid: None,
        gid: None,
        size: None,
        atime_ns: Some(7_000_000_000),
        mtime_ns: Some(9_000_000_000),
    };
    assert!(matches!(ask(&v, touch), Response::Attr(a) if a.mtime_ns == 9_000_000_000));
    assert_ne!(std::fs::metadata(&outside).unwrap().mtime(), 9);
    assert_eq!(
        ask(&v, Request::Readlink { path: "/up".into() }),
        Response::Link("..".into())
    );
    assert_eq!(
        ask(&v, Request::Unlink { path: "/s".into() }),
        Response::Done
    );
}

#[test]
fn setuid_bits_are_dropped_and_the_limit_holds() {
    let (_d, v) = dir();
    let Response::Attr(a) = ask(
        &v,
        Request::Create {
            path: "/x".into(),
            mode: 0o6755,
            uid: 0,
            gid: 0,
            exclusive: true,
        },
    ) else {
        panic!()
    };
    assert_eq!(a.mode, 0o755);
    let set = |size| {
        ask(
            &v,
            Request::SetAttr {
                path: "/x".into(),
                mode: Some(0o4777),
                uid: None,
                gid: None,
                size: Some(size),
                atime_ns: None,
                mtime_ns: Some(1_500_000_000_123_456_789),
            },
        )
    };
    assert_eq!(set(MAX_VOLUME_BYTES + 1), Response::Errno(libc::EDQUOT));
    let Response::Attr(a) = set(4096) else {
        panic!()
    };
    assert_eq!(
        (a.mode, a.size, a.mtime_ns),
        (0o777, 4096, 1_500_000_000_123_456_789)
    );
    let big = Request::Write {
        path: "/x".into(),
        offset: MAX_VOLUME_BYTES,
    };
    assert_eq!(v.answer(big, b"y").0, Response::Errno(libc::EDQUOT));
    let Response::Usage(u) = ask(&v, Request::Usage) else {
        panic!()
    };
    assert_eq!(u.total_bytes - u.free_bytes, 4096);
}

#[tokio::test]
async fn a_channel_answers_in_order_and_ends_on_a_bad_frame() {
    let (_d, v) = dir();
    let (mut guest, host) = tokio::io::duplex(1 << 20);
    let task = tokio::spawn(serve(Arc::new(v), host));
    let mut frames = volume::encode(
        &Request::Create {
            path: "/a".into(),
            mode: 0o600,
            uid: 1,
            gid: 2,
            exclusive: true,
        },
        b"",
    );
    frames.extend(volume::encode(&Request::Stat { path: "/b".into() }, b""));
    guest.write_all(&frames).await.unwrap();
    let mut next = async || {
        let mut w = [0u8; 4];
        guest.read_exact(&mut w).await.unwrap();
        let mut body = vec![0; volume::frame_len(w).unwrap()];
        guest.read_exact(&mut body).await.unwrap();
        volume::decode::<Response>(&body).unwrap().0
    };
    assert!(matches!(next().await, Response::Attr(a) if (a.uid, a.gid) == (1, 2)));
    assert_eq!(next().await, Response::Errno(libc::ENOENT));
    guest
        .write_all(&(volume::MAX_FRAME as u32 + 1).to_le_bytes())
        .await
        .unwrap();
    assert!(task.await.unwrap().is_err());
}

#[test]
fn a_volume_holds_a_bounded_number_of_entries() {
    let (d, v) = dir();
    // Made on the host directly (fast); the guest then asks for one more of each kind.
    let many = d.path().join("data/many");
    std::fs::create_dir(&many).unwrap();
    for i in 0..MAX_VOLUME_ENTRIES - 1 {
        std::fs::File::create(many.join(i.to_string())).unwrap();
    }
    assert_eq!(create(&v, "/one-more"), Response::Errno(libc::EDQUOT));
    let mkdir = Request::Mkdir {
        path: "/d".into(),
        mode: 0o755,
        uid: 0,
        gid: 0,
    };
    assert_eq!(ask(&v, mkdir), Response::Errno(libc::EDQUOT));
    // Writing to what exists still works; removing makes room.
    let w = Request::Write {
        path: "/many/7".into(),
        offset: 0,
    };
    assert_eq!(v.answer(w, b"ok").0, Response::Written(2));
    assert_eq!(
        ask(
            &v,
            Request::Unlink {
                path: "/many/0".into()
            }
        ),
        Response::Done
    );
    std::thread::sleep(std::time::Duration::from_millis(2100));
    assert!(matches!(create(&v, "/one-more"), Response::Attr(_)));
}
