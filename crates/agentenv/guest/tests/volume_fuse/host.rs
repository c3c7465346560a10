//! A test-only volume host: answers `volume::Request`s from a local folder with std::fs. It checks
//! nothing (paths may climb out with `..`); the real host server lives in `agentenv-control`.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use agentenv_envd::volume::{self, Attr, Entry, Kind, MAX_ENTRIES, Request, Response, Usage};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Serves `io` until it closes.
pub async fn serve(root: PathBuf, mut io: impl AsyncRead + AsyncWrite + Unpin) {
    loop {
        let mut word = [0u8; 4];
        if io.read_exact(&mut word).await.is_err() {
            return;
        }
        let n = volume::frame_len(word).expect("frame length");
        let mut body = vec![0u8; n];
        if io.read_exact(&mut body).await.is_err() {
            return;
        }
        let (req, data): (Request, &[u8]) = volume::decode(&body).expect("frame");
        let (resp, out) = answer(&root, req, data).unwrap_or_else(|e| {
            (
                Response::Errno(e.raw_os_error().unwrap_or(libc::EIO)),
                vec![],
            )
        });
        if io.write_all(&volume::encode(&resp, &out)).await.is_err() {
            return;
        }
    }
}

fn local(root: &Path, p: &str) -> PathBuf {
    root.join(p.trim_start_matches('/'))
}

fn attr(p: &Path) -> io::Result<Attr> {
    let m = fs::symlink_metadata(p)?;
    let t = m.file_type();
    let kind = if t.is_dir() {
        Kind::Dir
    } else if t.is_symlink() {
        Kind::Symlink
    } else if t.is_file() {
        Kind::File
    } else {
        Kind::Other
    };
    let ns = |s: i64, n: i64| s * 1_000_000_000 + n;
    Ok(Attr {
        kind,
        ino: m.ino(),
        size: m.size(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        nlink: m.nlink() as u32,
        atime_ns: ns(m.atime(), m.atime_nsec()),
        mtime_ns: ns(m.mtime(), m.mtime_nsec()),
        ctime_ns: ns(m.ctime(), m.ctime_nsec()),
    })
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

fn answer(root: &Path, req: Request, data: &[u8]) -> io::Result<(Response, Vec<u8>)> {
    let at = |p: &str| local(root, p);
    let r = match req {
        Request::Stat { path } => Response::Attr(attr(&at(&path))?),
        Request::List { path, offset } => {
            let mut names: Vec<String> = fs::read_dir(at(&path))?
                .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
                .collect::<io::Result<_>>()?;
            names.sort();
            let dir = at(&path);
            let entries = names
                .into_iter()
                .skip(offset as usize)
                .take(MAX_ENTRIES)
                .map(|name| {
                    Ok(Entry {
                        attr: attr(&dir.join(&name))?,
                        name,
                    })
                })
                .collect::<io::Result<_>>()?;
            Response::Entries(entries)
        }
        Request::Read { path, offset, len } => {
            let f = fs::File::open(at(&path))?;
            let mut buf = vec![0u8; len as usize];
            let mut n = 0;
            while n < buf.len() {
                let k = f.read_at(&mut buf[n..], offset + n as u64)?;
                if k == 0 {
                    break;
                }
                n += k;
            }
            buf.truncate(n);
            return Ok((Response::Data, buf));
        }
        Request::Write { path, offset } => {
            let f = fs::OpenOptions::new().write(true).open(at(&path))?;
            f.write_all_at(data, offset)?;
            Response::Written(data.len() as u32)
        }
        Request::Create {
            path,
            mode,
            uid,
            gid,
            exclusive,
        } => {
            let p = at(&path);
            let mut o = fs::OpenOptions::new();
            o.write(true).mode(mode);
            if exclusive {
                o.create_new(true);
            } else {
                o.create(true);
            }
            o.open(&p)?;
            fs::set_permissions(&p, fs::Permissions::from_mode(mode))?;
            std::os::unix::fs::chown(&p, Some(uid), Some(gid))?;
            Response::Attr(attr(&p)?)
        }
        Request::Mkdir {
            path,
            mode,
            uid,
            gid,
        } => {
            let p = at(&path);
            fs::DirBuilder::new().mode(mode).create(&p)?;
            std::os::unix::fs::chown(&p, Some(uid), Some(gid))?;
            Response::Attr(attr(&p)?)
        }
        Request::Symlink {
            path,
            target,
            uid,
            gid,
        } => {
            let p = at(&path);
            std::os::unix::fs::symlink(target, &p)?;
            std::os::unix::fs::lchown(&p, Some(uid), Some(gid))?;
            Response::Attr(attr(&p)?)
        }
        Request::Readlink { path } => {
            Response::Link(fs::read_link(at(&path))?.to_string_lossy().into_owned())
        }
        Request::Unlink { path } => {
            fs::remove_file(at(&path))?;
            Response::Done
        }
        Request::Rmdir { path } => {
            fs::remove_dir(at(&path))?;
            Response::Done
        }
        Request::Rename {
            from,
            to,
            noreplace,
        } => {
            if noreplace && fs::symlink_metadata(at(&to)).is_ok() {
                return Err(errno(libc::EEXIST));
            }
            fs::rename(at(&from), at(&to))?;
            Response::Done
        }
        Request::SetAttr {
            path,
            mode,
            uid,
            gid,
            size,
            atime_ns,
            mtime_ns,
        } => {
            let p = at(&path);
            if let Some(m) = mode {
                fs::set_permissions(&p, fs::Permissions::from_mode(m))?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::lchown(&p, uid, gid)?;
            }
            if let Some(s) = size {
                fs::OpenOptions::new().write(true).open(&p)?.set_len(s)?;
            }
            if atime_ns.is_some() || mtime_ns.is_some() {
                set_times(&p, atime_ns, mtime_ns)?;
            }
            Response::Attr(attr(&p)?)
        }
        Request::Fsync { path } => {
            fs::File::open(at(&path))?.sync_all()?;
            Response::Done
        }
        Request::Usage => {
            let (total_bytes, free_bytes) = usage(root)?;
            Response::Usage(Usage {
                total_bytes,
                free_bytes,
            })
        }
    };
    Ok((r, vec![]))
}

fn cpath(p: &Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

fn set_times(p: &Path, atime: Option<i64>, mtime: Option<i64>) -> io::Result<()> {
    let ts = |t: Option<i64>| match t {
        Some(ns) => libc::timespec {
            tv_sec: ns.div_euclid(1_000_000_000),
            tv_nsec: ns.rem_euclid(1_000_000_000),
        },
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    };
    let times = [ts(atime), ts(mtime)];
    let c = cpath(p);
    // SAFETY: a live path and two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// (total, free) bytes of the file system holding `p`.
pub fn usage(p: &Path) -> io::Result<(u64, u64)> {
    let c = cpath(p);
    // SAFETY: statvfs writes into a zeroed struct we own.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut s) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize))
    }
}
