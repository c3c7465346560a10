//! FUSE operations as volume requests: each kernel message becomes zero or more
//! [`Request`]s to the host and one reply. The host's answers are untrusted: an answer of the
//! wrong kind, an oversized read or a bad name is `EIO` (or skipped), never a panic.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use agentenv_envd::volume::{Attr, MAX_ENTRIES, MAX_IO, MAX_PATH, Request, Response};

use super::fuse::{self, InHeader, Reader, fattr, op};
use super::listing::{self, DirPage};
use super::nodes::{Nodes, join, name};

/// How long one operation may take in all, waiting for a channel included.
pub const OP_DEADLINE: Duration = Duration::from_secs(30);
/// Open folder handles whose listing page is kept; past it a handle lists uncached.
const MAX_DIR_HANDLES: usize = 1024;
const RENAME_NOREPLACE: u32 = 1;

/// Where requests go: the mount's current host channel (or a test's fake).
pub trait Host {
    /// The host's answer to `req` (with `data`) and its data, by `deadline`; an errno (`EIO`) when
    /// no answer came in time.
    fn call(
        &self,
        req: &Request,
        data: &[u8],
        deadline: Instant,
    ) -> Result<(Response, Vec<u8>), i32>;
}

/// The file system of one mount.
pub struct Fs<H> {
    host: H,
    pub nodes: Nodes,
    dirs: HashMap<u64, DirPage>,
    next_fh: u64,
}

type Answer = Result<Vec<u8>, i32>;

/// An errno from the host, or `EIO` for one out of range.
fn host_errno(e: i32) -> i32 {
    if (1..4096).contains(&e) { e } else { libc::EIO }
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

fn ns(secs: u64, nsec: u32) -> Result<i64, i32> {
    (secs as i64)
        .checked_mul(1_000_000_000)
        .and_then(|v| v.checked_add(i64::from(nsec)))
        .ok_or(libc::EINVAL)
}

impl<H: Host> Fs<H> {
    pub fn new(host: H) -> Self {
        Fs {
            host,
            nodes: Nodes::default(),
            dirs: HashMap::new(),
            next_fh: 1,
        }
    }

    /// Where requests go.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// The reply to one kernel message (`None`: the message takes none, or cannot be answered).
    pub fn handle(&mut self, msg: &[u8]) -> Option<Vec<u8>> {
        let Some((h, body)) = fuse::parse(msg) else {
            // A short message: answer it if its unique can be read at all.
            let mut r = Reader(msg);
            let (_, _, unique) = (r.u32()?, r.u32()?, r.u64()?);
            return Some(fuse::reply(unique, Err(libc::EIO)));
        };
        let deadline = Instant::now() + OP_DEADLINE;
        let answer = match h.opcode {
            op::FORGET => {
                if let Some(n) = Reader(body).u64() {
                    self.nodes.forget(h.nodeid, n);
                }
                return None;
            }
            op::BATCH_FORGET => {
                self.batch_forget(body);
                return None;
            }
            op::INTERRUPT => return None,
            op::INIT => fuse::init_reply(body),
            op::DESTROY | op::RELEASE | op::FLUSH => Ok(Vec::new()),
            op::RELEASEDIR => {
                if let Some(fh) = Reader(body).u64() {
                    self.dirs.remove(&fh);
                }
                Ok(Vec::new())
            }
            op::OPEN => Ok(fuse::open_out(0)),
            op::OPENDIR => Ok(self.opendir()),
            op::SETXATTR | op::GETXATTR | op::LISTXATTR | op::REMOVEXATTR => Err(libc::ENOSYS),
            op::LINK => Err(libc::EPERM),
            op::LOOKUP
            | op::GETATTR
            | op::SETATTR
            | op::READLINK
            | op::SYMLINK
            | op::MKNOD
            | op::MKDIR
            | op::UNLINK
            | op::RMDIR
            | op::RENAME
            | op::RENAME2
            | op::CREATE
            | op::READ
            | op::WRITE
            | op::STATFS
            | op::FSYNC
            | op::FSYNCDIR
            | op::READDIR => self.host_op(&h, body, deadline),
            _ => Err(libc::ENOSYS),
        };
        Some(fuse::reply(h.unique, answer))
    }

    fn batch_forget(&mut self, body: &[u8]) {
        let mut r = Reader(body);
        let Some(count) = r.u32() else { return };
        r.u32();
        for _ in 0..count {
            let (Some(id), Some(n)) = (r.u64(), r.u64()) else {
                return;
            };
            self.nodes.forget(id, n);
        }
    }

    fn opendir(&mut self) -> Vec<u8> {
        if self.dirs.len() >= MAX_DIR_HANDLES {
            return fuse::open_out(0);
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        self.dirs.insert(fh, DirPage::default());
        fuse::open_out(fh)
    }

    /// Operations that ask the host.
    fn host_op(&mut self, h: &InHeader, body: &[u8], dl: Instant) -> Answer {
        let path = self.nodes.path(h.nodeid).ok_or(libc::ENOENT)?.to_string();
        let mut r = Reader(body);
        let short = libc::EINVAL;
        match h.opcode {
            op::LOOKUP => {
                let p = join(&path, name(r.cstr().ok_or(short)?)?)?;
                let a = self.attr(Request::Stat { path: p.clone() }, dl)?;
                Ok(self.entry(&p, &a))
            }
            op::GETATTR => Ok(fuse::attr_out(&self.attr(Request::Stat { path }, dl)?)),
            op::SETATTR => self.setattr(path, &mut r, dl),
            op::READLINK => match self.ask(Request::Readlink { path }, &[], dl)?.0 {
                Response::Link(t) if !t.is_empty() && t.len() < MAX_PATH && !t.contains('\0') => {
                    Ok(t.into_bytes())
                }
                _ => Err(libc::EIO),
            },
            op::SYMLINK => {
                let p = join(&path, name(r.cstr().ok_or(short)?)?)?;
                let target = r.cstr().ok_or(short)?;
                if target.len() >= MAX_PATH {
                    return Err(libc::ENAMETOOLONG);
                }
                let target = std::str::from_utf8(target)
                    .map_err(|_| libc::EINVAL)?
                    .into();
                let (uid, gid) = (h.uid, h.gid);
                let req = Request::Symlink {
                    path: p.clone(),
                    target,
                    uid,
                    gid,
                };
                let a = self.attr(req, dl)?;
                Ok(self.entry(&p, &a))
            }
            op::MKNOD => {
                let mode = r.u32().ok_or(short)?;
                r.bytes(12).ok_or(short)?;
                let p = join(&path, name(r.cstr().ok_or(short)?)?)?;
                if mode & libc::S_IFMT != libc::S_IFREG {
                    return Err(libc::EPERM);
                }
                let a = self.create(h, p.clone(), mode, true, dl)?;
                Ok(self.entry(&p, &a))
            }
            op::MKDIR => {
                let mode = r.u32().ok_or(short)? & 0o7777;
                r.u32().ok_or(short)?;
                let p = join(&path, name(r.cstr().ok_or(short)?)?)?;
                let (uid, gid) = (h.uid, h.gid);
                let a = self.attr(
                    Request::Mkdir {
                        path: p.clone(),
                        mode,
                        uid,
                        gid,
                    },
                    dl,
                )?;
                Ok(self.entry(&p, &a))
            }
            op::UNLINK | op::RMDIR => {
                let p = join(&path, name(r.cstr().ok_or(short)?)?)?;
                let req = if h.opcode == op::UNLINK {
                    Request::Unlink { path: p.clone() }
                } else {
                    Request::Rmdir { path: p.clone() }
                };
                self.done(req, dl)?;
                self.nodes.detach(&p);
                Ok(Vec::new())
            }
            op::RENAME | op::RENAME2 => self.rename(h.opcode, path, &mut r, dl),
            op::CREATE => {
                let flags = r.u32().ok_or(short)?;
                let mode = r.u32().ok_or(short)?;
                r.bytes(8).ok_or(short)?;
                let p = join(&path, name(r.cstr().ok_or(short)?)?)?;
                let exclusive = flags & libc::O_EXCL as u32 != 0;
                let mut a = self.create(h, p.clone(), mode, exclusive, dl)?;
                if flags & libc::O_TRUNC as u32 != 0 && a.size != 0 {
                    // An existing file opened with O_TRUNC (it appeared meanwhile).
                    a = self.attr(
                        Request::SetAttr {
                            path: p.clone(),
                            mode: None,
                            uid: None,
                            gid: None,
                            size: Some(0),
                            atime_ns: None,
                            mtime_ns: None,
                        },
                        dl,
                    )?;
                }
                let mut out = self.entry(&p, &a);
                out.extend_from_slice(&fuse::open_out(0));
                Ok(out)
            }
            op::READ => {
                r.u64().ok_or(short)?;
                let offset = r.u64().ok_or(short)?;
                let size = r.u32().ok_or(short)?;
                self.read(path, offset, size.min(MAX_IO * 8), dl)
            }
            op::WRITE => {
                r.u64().ok_or(short)?;
                let offset = r.u64().ok_or(short)?;
                let size = r.u32().ok_or(short)? as usize;
                r.bytes(20).ok_or(short)?;
                let data = r.rest().get(..size).ok_or(short)?;
                self.write(path, offset, data, dl)
            }
            op::STATFS => match self.ask(Request::Usage, &[], dl)?.0 {
                Response::Usage(u) => Ok(fuse::statfs_out(&u)),
                _ => Err(libc::EIO),
            },
            op::FSYNC | op::FSYNCDIR => self.done(Request::Fsync { path }, dl).map(|()| Vec::new()),
            op::READDIR => {
                let fh = r.u64().ok_or(short)?;
                let offset = r.u64().ok_or(short)?;
                let size = r.u32().ok_or(short)? as usize;
                self.readdir(h.nodeid, path, fh, offset, size.min(MAX_IO as usize), dl)
            }
            _ => Err(libc::ENOSYS),
        }
    }

    /// The host's answer, its `Errno` made an error.
    fn ask(&self, req: Request, data: &[u8], dl: Instant) -> Result<(Response, Vec<u8>), i32> {
        match self.host.call(&req, data, dl)? {
            (Response::Errno(e), _) => Err(host_errno(e)),
            other => Ok(other),
        }
    }

    fn attr(&self, req: Request, dl: Instant) -> Result<Attr, i32> {
        match self.ask(req, &[], dl)?.0 {
            Response::Attr(a) => Ok(a),
            _ => Err(libc::EIO),
        }
    }

    fn done(&self, req: Request, dl: Instant) -> Result<(), i32> {
        match self.ask(req, &[], dl)?.0 {
            Response::Done => Ok(()),
            _ => Err(libc::EIO),
        }
    }

    /// An entry reply: the node for `path` gets one more lookup.
    fn entry(&mut self, path: &str, a: &Attr) -> Vec<u8> {
        let id = self.nodes.lookup(path, a.kind);
        fuse::entry_out(id, a)
    }

    fn create(
        &self,
        h: &InHeader,
        path: String,
        mode: u32,
        exclusive: bool,
        dl: Instant,
    ) -> Result<Attr, i32> {
        let (uid, gid, mode) = (h.uid, h.gid, mode & 0o7777);
        self.attr(
            Request::Create {
                path,
                mode,
                uid,
                gid,
                exclusive,
            },
            dl,
        )
    }

    fn setattr(&self, path: String, r: &mut Reader<'_>, dl: Instant) -> Answer {
        let short = libc::EINVAL;
        let valid = r.u32().ok_or(short)?;
        r.bytes(12).ok_or(short)?; // padding, fh
        let size = r.u64().ok_or(short)?;
        r.u64().ok_or(short)?; // lock_owner
        let (atime, mtime) = (r.u64().ok_or(short)?, r.u64().ok_or(short)?);
        r.u64().ok_or(short)?; // ctime
        let (atimensec, mtimensec) = (r.u32().ok_or(short)?, r.u32().ok_or(short)?);
        r.u32().ok_or(short)?; // ctimensec
        let mode = r.u32().ok_or(short)?;
        r.u32().ok_or(short)?;
        let (uid, gid) = (r.u32().ok_or(short)?, r.u32().ok_or(short)?);
        let has = |bit: u32| valid & bit != 0;
        let time = |now: u32, set: u32, s: u64, n: u32| -> Result<Option<i64>, i32> {
            Ok(if has(now) {
                Some(now_ns())
            } else if has(set) {
                Some(ns(s, n)?)
            } else {
                None
            })
        };
        let req = Request::SetAttr {
            path: path.clone(),
            mode: has(fattr::MODE).then_some(mode & 0o7777),
            uid: has(fattr::UID).then_some(uid),
            gid: has(fattr::GID).then_some(gid),
            size: has(fattr::SIZE).then_some(size),
            atime_ns: time(fattr::ATIME_NOW, fattr::ATIME, atime, atimensec)?,
            mtime_ns: time(fattr::MTIME_NOW, fattr::MTIME, mtime, mtimensec)?,
        };
        let req = match req {
            Request::SetAttr {
                mode: None,
                uid: None,
                gid: None,
                size: None,
                atime_ns: None,
                mtime_ns: None,
                ..
            } => Request::Stat { path },
            req => req,
        };
        Ok(fuse::attr_out(&self.attr(req, dl)?))
    }

    fn rename(&mut self, opcode: u32, path: String, r: &mut Reader<'_>, dl: Instant) -> Answer {
        let short = libc::EINVAL;
        let newdir = r.u64().ok_or(short)?;
        let flags = if opcode == op::RENAME2 {
            let f = r.u32().ok_or(short)?;
            r.u32().ok_or(short)?;
            f
        } else {
            0
        };
        if flags & !RENAME_NOREPLACE != 0 {
            return Err(libc::EINVAL); // RENAME_EXCHANGE, RENAME_WHITEOUT
        }
        let from = join(&path, name(r.cstr().ok_or(short)?)?)?;
        let dir = self.nodes.path(newdir).ok_or(libc::ENOENT)?;
        let to = join(dir, name(r.cstr().ok_or(short)?)?)?;
        let noreplace = flags & RENAME_NOREPLACE != 0;
        let req = Request::Rename {
            from: from.clone(),
            to: to.clone(),
            noreplace,
        };
        self.done(req, dl)?;
        self.nodes.rename(&from, &to);
        Ok(Vec::new())
    }

    fn read(&self, path: String, offset: u64, size: u32, dl: Instant) -> Answer {
        let mut out = Vec::with_capacity(size as usize);
        while out.len() < size as usize {
            let len = (size - out.len() as u32).min(MAX_IO);
            let at = offset.checked_add(out.len() as u64).ok_or(libc::EINVAL)?;
            let req = Request::Read {
                path: path.clone(),
                offset: at,
                len,
            };
            let data = match self.ask(req, &[], dl)? {
                (Response::Data, d) if d.len() <= len as usize => d,
                _ => return Err(libc::EIO),
            };
            out.extend_from_slice(&data);
            if data.len() < len as usize {
                break;
            }
        }
        Ok(out)
    }

    fn write(&self, path: String, offset: u64, data: &[u8], dl: Instant) -> Answer {
        let mut done = 0usize;
        for chunk in data.chunks(MAX_IO as usize) {
            let at = offset.checked_add(done as u64).ok_or(libc::EFBIG)?;
            let req = Request::Write {
                path: path.clone(),
                offset: at,
            };
            let n = match self.ask(req, chunk, dl)?.0 {
                Response::Written(n) if n as usize <= chunk.len() => n as usize,
                _ => return Err(libc::EIO),
            };
            done += n;
            if n < chunk.len() {
                break;
            }
        }
        Ok(fuse::write_out(done as u32))
    }

    /// READDIR through the handle's cached listing page (a handle the kernel did not get from
    /// OPENDIR lists uncached).
    fn readdir(
        &mut self,
        node: u64,
        path: String,
        fh: u64,
        offset: u64,
        size: usize,
        dl: Instant,
    ) -> Answer {
        let cached = self.dirs.remove(&fh);
        let known = cached.is_some();
        let mut page = cached.unwrap_or_default();
        let out = listing::dirents(&mut page, node, &path, offset, size, |from| {
            let req = Request::List {
                path: path.clone(),
                offset: from,
            };
            match self.ask(req, &[], dl)?.0 {
                Response::Entries(v) if v.len() <= MAX_ENTRIES => Ok(v),
                _ => Err(libc::EIO),
            }
        });
        if known {
            self.dirs.insert(fh, page);
        }
        out
    }
}
