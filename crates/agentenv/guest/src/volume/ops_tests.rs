//! Unit tests of the FUSE operations against a fake host: the requests they make, the replies
//! they encode, paging, and hostile or random input.

use std::cell::RefCell;
use std::time::Instant;

use agentenv_envd::volume::{Entry, Kind, MAX_ENTRIES, MAX_IO, Request, Response, Usage};
use rand::Rng;

use super::fuse::{self, Reader, fattr, op};
use super::nodes::ROOT;
use super::ops::{Fs, Host};
use super::tests::{attr, cat, msg, split_reply};

/// A host answering from a closure, recording requests.
struct Fake<F>(RefCell<F>, RefCell<Vec<(Request, usize)>>);

impl<F: FnMut(&Request, &[u8]) -> (Response, Vec<u8>)> Host for Fake<F> {
    fn call(&self, req: &Request, data: &[u8], _: Instant) -> Result<(Response, Vec<u8>), i32> {
        self.1.borrow_mut().push((req.clone(), data.len()));
        Ok((self.0.borrow_mut())(req, data))
    }
}

fn fake<F: FnMut(&Request, &[u8]) -> (Response, Vec<u8>)>(f: F) -> Fs<Fake<F>> {
    Fs::new(Fake(RefCell::new(f), RefCell::new(Vec::new())))
}
#[test]
fn lookup_getattr_and_readlink_encode_the_hosts_answers() {
    let mut fs = fake(|req, _| match req {
        Request::Stat { path } if path == "/d/f" => {
            (Response::Attr(attr(Kind::File, 77, 1025)), vec![])
        }
        Request::Stat { path } if path == "/d" => (Response::Attr(attr(Kind::Dir, 5, 0)), vec![]),
        Request::Readlink { .. } => (Response::Link("../x".into()), vec![]),
        _ => (Response::Errno(libc::ENOENT), vec![]),
    });
    let (e, out) = split_reply(&fs.handle(&msg(op::LOOKUP, 9, ROOT, b"d\0")).unwrap(), 9);
    assert_eq!(e, 0);
    let d = Reader(&out).u64().unwrap();
    let (e, out) = split_reply(&fs.handle(&msg(op::LOOKUP, 10, d, b"f\0")).unwrap(), 10);
    assert_eq!((e, out.len()), (0, 128));
    let mut r = Reader(&out);
    let f = r.u64().unwrap();
    assert_eq!(fs.nodes.path(f), Some("/d/f"));
    assert_eq!(
        (r.u64(), r.u64(), r.u64()),
        (Some(0), Some(1), Some(1)),
        "generation, 1 s timeouts"
    );
    r.bytes(8);
    assert_eq!(
        (r.u64(), r.u64(), r.u64()),
        (Some(77), Some(1025), Some(3)),
        "ino, size, blocks"
    );
    assert_eq!(r.u64(), Some((-2i64) as u64), "atime rounds down");
    assert_eq!(r.u64(), Some(1_700_000_000));
    r.u64();
    assert_eq!((r.u32(), r.u32()), (Some(500_000_000), Some(123_456_789)));
    r.u32();
    assert_eq!(r.u32(), Some(libc::S_IFREG | 0o640));

    let (e, out) = split_reply(&fs.handle(&msg(op::GETATTR, 11, f, &[0; 16])).unwrap(), 11);
    assert_eq!((e, out.len()), (0, 104));
    let (e, out) = split_reply(&fs.handle(&msg(op::READLINK, 12, f, &[])).unwrap(), 12);
    assert_eq!((e, out.as_slice()), (0, &b"../x"[..]));
    let (e, _) = split_reply(&fs.handle(&msg(op::LOOKUP, 13, d, b"nope\0")).unwrap(), 13);
    assert_eq!(e, libc::ENOENT);
    // A forgotten node is unknown.
    fs.handle(&msg(op::FORGET, 0, f, &1u64.to_ne_bytes()));
    let (e, _) = split_reply(&fs.handle(&msg(op::GETATTR, 14, f, &[0; 16])).unwrap(), 14);
    assert_eq!(e, libc::ENOENT);
}

#[test]
fn names_are_checked_before_the_host_is_asked() {
    let mut fs = fake(|_, _| (Response::Attr(attr(Kind::File, 1, 0)), vec![]));
    let long = cat(&[&[b'x'; 256], b"\0"]);
    for (name, want) in [
        (&long[..], libc::ENAMETOOLONG),
        (&b"\xff\xfe\0"[..], libc::EINVAL),
        (&b"..\0"[..], libc::EINVAL),
        (&b"no-nul"[..], libc::EINVAL),
    ] {
        let (e, _) = split_reply(&fs.handle(&msg(op::LOOKUP, 1, ROOT, name)).unwrap(), 1);
        assert_eq!(e, want);
    }
    assert!(
        fs.handle(&msg(op::LOOKUP, 1, ROOT, &cat(&[&[b'y'; 255], b"\0"])))
            .is_some()
    );
    assert_eq!(fs.host_calls(), 1);
}

impl<F: FnMut(&Request, &[u8]) -> (Response, Vec<u8>)> Fs<Fake<F>> {
    fn host_calls(&self) -> usize {
        self.host().1.borrow().len()
    }
    fn requests(&self) -> Vec<(Request, usize)> {
        self.host().1.borrow().clone()
    }
}

#[test]
fn setattr_rename_mknod_create_and_write_become_the_right_requests() {
    let mut fs = fake(|req, data| match req {
        Request::Write { .. } => (Response::Written(data.len() as u32), vec![]),
        Request::Rename { .. } | Request::Unlink { .. } => (Response::Done, vec![]),
        _ => (Response::Attr(attr(Kind::File, 3, 9)), vec![]),
    });
    // SETATTR: mode, size, atime now, mtime set.
    let mut sa = vec![0u8; 88];
    let valid = fattr::MODE | fattr::SIZE | fattr::ATIME | fattr::ATIME_NOW | fattr::MTIME;
    sa[..4].copy_from_slice(&valid.to_ne_bytes());
    sa[16..24].copy_from_slice(&5u64.to_ne_bytes());
    sa[40..48].copy_from_slice(&7u64.to_ne_bytes());
    sa[60..64].copy_from_slice(&9u32.to_ne_bytes());
    sa[68..72].copy_from_slice(&(libc::S_IFREG | 0o4755).to_ne_bytes());
    let (e, _) = split_reply(&fs.handle(&msg(op::SETATTR, 1, ROOT, &sa)).unwrap(), 1);
    assert_eq!(e, 0);
    let Request::SetAttr {
        mode,
        size,
        atime_ns,
        mtime_ns,
        uid,
        ..
    } = fs.requests()[0].0.clone()
    else {
        panic!("{:?}", fs.requests());
    };
    assert_eq!(
        (mode, size, mtime_ns, uid),
        (Some(0o4755), Some(5), Some(7_000_000_009), None)
    );
    assert!(atime_ns.unwrap() > 1_700_000_000_000_000_000);

    // RENAME2: NOREPLACE passes, EXCHANGE is refused.
    let r2 = |flags: u32| {
        cat(&[
            &ROOT.to_ne_bytes(),
            &flags.to_ne_bytes(),
            &[0; 4],
            b"a\0b\0",
        ])
    };
    let (e, _) = split_reply(&fs.handle(&msg(op::RENAME2, 2, ROOT, &r2(1))).unwrap(), 2);
    assert_eq!(e, 0);
    assert!(
        matches!(&fs.requests()[1].0, Request::Rename { from, to, noreplace: true } if from == "/a" && to == "/b")
    );
    let (e, _) = split_reply(&fs.handle(&msg(op::RENAME2, 3, ROOT, &r2(2))).unwrap(), 3);
    assert_eq!(e, libc::EINVAL);

    // MKNOD: a regular file is an exclusive create; a FIFO is refused.
    let mk = |mode: u32| cat(&[&mode.to_ne_bytes(), &[0; 12], b"n\0"]);
    let (e, _) = split_reply(
        &fs.handle(&msg(op::MKNOD, 4, ROOT, &mk(libc::S_IFREG | 0o600)))
            .unwrap(),
        4,
    );
    assert_eq!(e, 0);
    assert!(matches!(
        &fs.requests()[2].0,
        Request::Create {
            exclusive: true,
            mode: 0o600,
            uid: 1000,
            ..
        }
    ));
    let (e, _) = split_reply(
        &fs.handle(&msg(op::MKNOD, 5, ROOT, &mk(libc::S_IFIFO | 0o600)))
            .unwrap(),
        5,
    );
    assert_eq!(e, libc::EPERM);

    // CREATE with O_EXCL: entry + open out.
    let cr = cat(&[
        &((libc::O_EXCL | libc::O_CREAT) as u32).to_ne_bytes(),
        &0o644u32.to_ne_bytes(),
        &[0; 8],
        b"c\0",
    ]);
    let (e, out) = split_reply(&fs.handle(&msg(op::CREATE, 6, ROOT, &cr)).unwrap(), 6);
    assert_eq!((e, out.len()), (0, 144));
    assert!(matches!(
        &fs.requests()[3].0,
        Request::Create {
            exclusive: true,
            ..
        }
    ));

    // WRITE larger than MAX_IO is split.
    let data = vec![7u8; MAX_IO as usize * 2 + 5];
    let wr = cat(&[
        &[0; 8],
        &100u64.to_ne_bytes(),
        &(data.len() as u32).to_ne_bytes(),
        &[0; 20],
        &data,
    ]);
    let (e, out) = split_reply(&fs.handle(&msg(op::WRITE, 7, ROOT, &wr)).unwrap(), 7);
    assert_eq!((e, Reader(&out).u32()), (0, Some(data.len() as u32)));
    let writes: Vec<_> = fs.requests()[4..].to_vec();
    assert_eq!(writes.len(), 3);
    assert!(
        matches!(&writes[2].0, Request::Write { offset, .. } if *offset == 100 + 2 * u64::from(MAX_IO))
    );
    assert_eq!(writes[2].1, 5);

    // No host for LINK, xattrs, unknown ops.
    let before = fs.host_calls();
    for (o, want) in [
        (op::LINK, libc::EPERM),
        (op::GETXATTR, libc::ENOSYS),
        (4242, libc::ENOSYS),
    ] {
        let (e, _) = split_reply(&fs.handle(&msg(o, 8, ROOT, &[0; 64])).unwrap(), 8);
        assert_eq!(e, want);
    }
    assert_eq!(fs.host_calls(), before);
}

#[test]
fn readdir_pages_through_the_hosts_listing() {
    let total = MAX_ENTRIES * 2 + 17;
    let names: Vec<String> = (0..total).map(|i| format!("entry-{i:05}")).collect();
    let all = names.clone();
    let mut fs = fake(move |req, _| match req {
        Request::List { offset, .. } => {
            let v = all
                .iter()
                .enumerate()
                .skip(*offset as usize)
                .take(MAX_ENTRIES)
                .map(|(i, n)| Entry {
                    name: n.clone(),
                    attr: attr(Kind::File, i as u64 + 100, 0),
                })
                .collect();
            (Response::Entries(v), vec![])
        }
        _ => (Response::Errno(libc::EIO), vec![]),
    });
    let (_, out) = split_reply(&fs.handle(&msg(op::OPENDIR, 1, ROOT, &[0; 8])).unwrap(), 1);
    let fh = Reader(&out).u64().unwrap();
    let mut seen = Vec::new();
    let mut off = 0u64;
    loop {
        let rd = cat(&[
            &fh.to_ne_bytes(),
            &off.to_ne_bytes(),
            &4096u32.to_ne_bytes(),
            &[0; 20],
        ]);
        let (e, out) = split_reply(&fs.handle(&msg(op::READDIR, 2, ROOT, &rd)).unwrap(), 2);
        assert_eq!(e, 0);
        if out.is_empty() {
            break;
        }
        assert!(out.len() <= 4096);
        let mut r = Reader(&out);
        while !r.0.is_empty() {
            let (_, next, len, _) = (
                r.u64().unwrap(),
                r.u64().unwrap(),
                r.u32().unwrap(),
                r.u32().unwrap(),
            );
            let name = r.bytes(len as usize).unwrap();
            r.bytes((24 + len as usize).next_multiple_of(8) - 24 - len as usize)
                .unwrap();
            seen.push(String::from_utf8(name.to_vec()).unwrap());
            off = next;
        }
    }
    assert_eq!(&seen[..2], [".", ".."]);
    assert_eq!(seen[2..], names[..]);
    // Three host pages for the whole listing (the page is kept per handle).
    assert_eq!(fs.host_calls(), 3);
}

#[test]
fn hostile_answers_are_eio_not_panics() {
    let big = vec![0u8; 10];
    let mut fs = fake(move |req, _| match req {
        Request::Read { .. } => (Response::Data, big.clone()),
        Request::List { .. } => {
            let e = Entry {
                name: "x".into(),
                attr: attr(Kind::File, 1, 0),
            };
            (Response::Entries(vec![e; MAX_ENTRIES + 1]), vec![])
        }
        Request::Readlink { .. } => (Response::Link("a\0b".into()), vec![]),
        Request::Stat { .. } => (Response::Errno(-3), vec![]),
        _ => (Response::Written(u32::MAX), vec![]),
    });
    let rd = |size: u32| cat(&[&[0; 8], &0u64.to_ne_bytes(), &size.to_ne_bytes(), &[0; 20]]);
    for (o, body) in [
        (op::READ, rd(4)),
        (
            op::READDIR,
            cat(&[&[0; 8], &2u64.to_ne_bytes(), &4096u32.to_ne_bytes()]),
        ),
        (op::READLINK, vec![]),
        (op::GETATTR, vec![0; 16]),
        (op::WRITE, cat(&[&rd(1), b"z"])),
        (op::STATFS, vec![]),
    ] {
        let (e, _) = split_reply(&fs.handle(&msg(o, 1, ROOT, &body)).unwrap(), 1);
        assert_eq!(e, libc::EIO, "op {o}");
    }
}

#[test]
fn random_messages_and_answers_never_panic() {
    let mut rng = rand::rng();
    let mut fs = fake(|_, _| {
        let mut rng = rand::rng();
        let r = match rng.random_range(0..8) {
            0 => Response::Attr(attr(Kind::Other, rng.random(), rng.random())),
            1 => Response::Entries(vec![
                Entry {
                    name: "é/\0".into(),
                    attr: attr(Kind::Dir, 1, 2)
                };
                rng.random_range(0..300)
            ]),
            2 => Response::Data,
            3 => Response::Written(rng.random()),
            4 => Response::Link("t".repeat(rng.random_range(0..5000))),
            5 => Response::Usage(Usage {
                total_bytes: rng.random(),
                free_bytes: rng.random(),
            }),
            6 => Response::Done,
            _ => Response::Errno(rng.random()),
        };
        let data = vec![rng.random::<u8>(); rng.random_range(0..300_000)];
        (r, data)
    });
    for i in 0..3000u64 {
        let opcode = if i % 3 == 0 {
            rng.random_range(0..60)
        } else {
            rng.random()
        };
        let nodeid = if i % 2 == 0 {
            ROOT
        } else {
            rng.random_range(0..5)
        };
        let body: Vec<u8> = (0..rng.random_range(0..200))
            .map(|_| rng.random())
            .collect();
        let mut m = msg(opcode, i, nodeid, &body);
        if i % 7 == 0 {
            m.truncate(rng.random_range(0..m.len()));
        }
        if let Some(r) = fs.handle(&m) {
            let mut rd = Reader(&r);
            assert_eq!(rd.u32().map(|n| n as usize), Some(r.len()));
        }
        let _ = fuse::parse(&m);
    }
}
