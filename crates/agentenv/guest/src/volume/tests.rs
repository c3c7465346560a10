//! Unit tests of the volume mount's parts that need no kernel: the node table, the FUSE message
//! encoding, the channel switch and the path checks (the operations: `ops_tests.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_envd::volume::{self, Attr, Kind, MAX_IO, Request, Response, Usage};
use rand::Rng;

use super::fuse::{self, Reader};
use super::nodes::{Nodes, ROOT};
use super::ops::Host;

pub fn attr(kind: Kind, ino: u64, size: u64) -> Attr {
    Attr {
        kind,
        ino,
        size,
        mode: 0o640,
        uid: 1000,
        gid: 1000,
        nlink: 1,
        atime_ns: -1_500_000_000,
        mtime_ns: 1_700_000_000_123_456_789,
        ctime_ns: 0,
    }
}
#[test]
fn node_lookups_forgets_and_renames_of_subtrees() {
    let mut n = Nodes::default();
    assert_eq!(n.lookup("/", Kind::Dir), ROOT);
    let a = n.lookup("/a", Kind::Dir);
    let f = n.lookup("/a/f", Kind::File);
    let deep = n.lookup("/a/b/c", Kind::File);
    let ab = n.lookup("/ab", Kind::File);
    assert_eq!(n.lookup("/a", Kind::Dir), a);
    assert_eq!(n.lookups(a), 2);
    n.forget(a, 1);
    assert_eq!((n.lookups(a), n.path(a)), (1, Some("/a")));

    n.rename("/a", "/z");
    assert_eq!(n.path(a), Some("/z"));
    assert_eq!(n.path(f), Some("/z/f"));
    assert_eq!(n.path(deep), Some("/z/b/c"));
    assert_eq!(
        n.path(ab),
        Some("/ab"),
        "a sibling sharing the prefix stays"
    );
    assert_eq!(n.lookup("/z/f", Kind::File), f);

    // A rename onto an existing entry: the old target's node is gone, the moved one keeps its id.
    let g = n.lookup("/g", Kind::File);
    n.rename("/z/f", "/g");
    assert_eq!(n.path(g), None);
    assert_eq!(n.path(f), Some("/g"));
    n.forget(g, 1);
    assert_eq!(n.lookups(g), 0);

    // A path that now holds another kind gets a new id.
    let g2 = n.lookup("/g", Kind::Dir);
    assert_ne!(g2, f);
    assert_eq!(n.path(f), None);

    n.detach("/z");
    assert_eq!((n.path(a), n.path(deep)), (None, None));
    n.forget(ROOT, 100);
    assert_eq!(n.path(ROOT), Some("/"));
    for id in [a, f, deep, ab, g2] {
        n.forget(id, u64::MAX);
    }
    assert!(n.is_empty(), "{n:?}");
}

#[test]
fn node_table_survives_random_operations() {
    let mut rng = rand::rng();
    let mut n = Nodes::default();
    let names = ["/a", "/a/b", "/a/b/c", "/b", "/b/a", "/ab", "/a/bc"];
    let mut ids = vec![ROOT];
    for _ in 0..5000 {
        let p = names[rng.random_range(0..names.len())];
        let q = names[rng.random_range(0..names.len())];
        match rng.random_range(0..4) {
            0 => ids.push(n.lookup(p, Kind::File)),
            1 => n.forget(ids[rng.random_range(0..ids.len())], rng.random_range(0..3)),
            2 => n.rename(p, q),
            _ => n.detach(p),
        }
        // Every live path is unique to its id.
        let mut seen = std::collections::HashMap::new();
        for &id in &ids {
            if let Some(p) = n.path(id) {
                let other = *seen.entry(p.to_string()).or_insert(id);
                assert_eq!(other, id, "{p} has two nodes");
            }
        }
    }
}
/// A FUSE message as the kernel writes it.
pub fn msg(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&((fuse::IN_HEADER + body.len()) as u32).to_ne_bytes());
    m.extend_from_slice(&opcode.to_ne_bytes());
    m.extend_from_slice(&unique.to_ne_bytes());
    m.extend_from_slice(&nodeid.to_ne_bytes());
    for v in [1000u32, 1000, 42, 0] {
        m.extend_from_slice(&v.to_ne_bytes());
    }
    m.extend_from_slice(body);
    m
}

pub fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// (errno, payload) of a reply, checking its header.
pub fn split_reply(r: &[u8], unique: u64) -> (i32, Vec<u8>) {
    let mut rd = Reader(r);
    assert_eq!(rd.u32().unwrap() as usize, r.len());
    let err = rd.u32().unwrap() as i32;
    assert_eq!(rd.u64().unwrap(), unique);
    (-err, rd.rest().to_vec())
}
#[test]
fn init_takes_only_flags_we_implement() {
    let body = cat(&[
        &7u32.to_ne_bytes(),
        &38u32.to_ne_bytes(),
        &(1u32 << 20).to_ne_bytes(),
        &u32::MAX.to_ne_bytes(),
    ]);
    let out = fuse::init_reply(&body).unwrap();
    let mut r = Reader(&out);
    assert_eq!(
        (r.u32(), r.u32(), r.u32()),
        (Some(7), Some(31), Some(1 << 20))
    );
    let flags = r.u32().unwrap();
    assert_eq!(flags & (1 << 3), 0, "no FUSE_ATOMIC_O_TRUNC");
    assert_eq!(flags, (1 << 5) | (1 << 12));
    r.u32();
    assert_eq!(r.u32(), Some(MAX_IO));
    assert_eq!(out.len(), 64);
    assert_eq!(fuse::init_reply(&body[..12]), Err(libc::EINVAL));
    let old = cat(&[&7u32.to_ne_bytes(), &5u32.to_ne_bytes(), &[0; 8]]);
    assert_eq!(fuse::init_reply(&old), Err(libc::EPROTO));
}
#[test]
fn dirents_and_replies_are_aligned_and_bounded() {
    let mut out = Vec::new();
    assert!(fuse::push_dirent(&mut out, 64, 1, 2, 4, b"abc"));
    assert_eq!(out.len(), 32);
    assert!(!fuse::push_dirent(&mut out, 64, 1, 2, 4, b"0123456789"));
    assert_eq!(out.len(), 32);
    let r = fuse::reply(5, Err(libc::ENOENT));
    assert_eq!(split_reply(&r, 5).0, libc::ENOENT);
    let st = fuse::statfs_out(&Usage {
        total_bytes: 8 << 20,
        free_bytes: 1 << 40,
    });
    let mut r = Reader(&st);
    assert_eq!(
        (r.u64(), r.u64(), r.u64()),
        (Some(2048), Some(2048), Some(2048))
    );
    assert_eq!(st.len(), 80);
}

#[test]
fn mount_paths_are_checked() {
    use std::path::Path;
    for ok in ["/mnt/v", "/home/user/data", "/runner", "/run/user/vol"] {
        assert!(super::check_path(Path::new(ok)).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "/",
        "mnt",
        "/mnt/",
        "/mnt//v",
        "/mnt/./v",
        "/mnt/../etc",
        "/proc",
        "/proc/1",
        "/sys/fs",
        "/dev",
        "/dev/shm",
        "/run",
        "/run/agentenv",
        "/run/agentenv/x",
        "/run/agentenv2",
    ] {
        let e = super::check_path(Path::new(bad)).unwrap_err();
        assert!(e.is_bad_path(), "{bad}: {e}");
    }
}

#[test]
fn mountinfo_lines_parse() {
    let text = "36 35 98:0 / /mnt/my\\040vol rw,nosuid shared:1 - fuse.agentenv agentenv-volume rw,user_id=0\n\
                37 35 0:61 / /proc rw - proc proc rw\nbroken line\n";
    let m = super::parse_mountinfo(text);
    assert_eq!(m.len(), 2);
    assert_eq!(
        (m[0].point.as_str(), m[0].fstype.as_str(), m[0].dev.as_str()),
        ("/mnt/my vol", "fuse.agentenv", "98:0")
    );
    assert_eq!(m[1].fstype, "proc");
}

/// A host end that answers every request with `Errno(tag)` until it is dropped.
async fn answer_with(mut io: tokio::io::DuplexStream, tag: i32) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let mut w = [0u8; 4];
        if io.read_exact(&mut w).await.is_err() {
            return;
        }
        let Ok(n) = volume::frame_len(w) else { return };
        let mut body = vec![0u8; n];
        if io.read_exact(&mut body).await.is_err() {
            return;
        }
        let _: Request = volume::decode(&body).unwrap().0;
        if io
            .write_all(&volume::encode(&Response::Errno(tag), b""))
            .await
            .is_err()
        {
            return;
        }
    }
}

#[test]
fn a_request_waits_for_the_next_channel_after_one_breaks() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let link = Arc::new(super::link::Link::default());
    let (guest, host) = tokio::io::duplex(1 << 20);
    let _g = rt.enter();
    link.install(guest);
    let first = rt.spawn(answer_with(host, 1));
    let dl = || Instant::now() + Duration::from_secs(10);
    assert_eq!(
        link.call(&Request::Usage, b"", dl()).unwrap().0,
        Response::Errno(1)
    );

    first.abort();
    let l2 = link.clone();
    let op = std::thread::spawn(move || l2.call(&Request::Usage, b"", dl()));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!op.is_finished());
    let (guest, host) = tokio::io::duplex(1 << 20);
    link.install(guest);
    rt.spawn(answer_with(host, 2));
    assert_eq!(op.join().unwrap().unwrap().0, Response::Errno(2));

    // No channel at all: the deadline ends the wait with EIO.
    link.close();
    let t = Instant::now();
    assert_eq!(
        link.call(&Request::Usage, b"", t + Duration::from_millis(200)),
        Err(libc::EIO)
    );
}
