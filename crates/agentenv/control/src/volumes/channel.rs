//! The host's end of a volume channel (`agentenv_envd::volume`): answers a guest's requests from the
//! volume's folder, confined by [`super::beneath`], within the volume's byte limit.
//!
//! A guest is hostile: frames are bounded ([`volume::frame_len`]), a frame's body must arrive within
//! [`BODY_DEADLINE`], every path is checked, and owners and modes are the guest's to choose inside
//! the volume only (setuid and setgid bits are dropped).

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentenv_envd::volume::{self, Attr, Entry, Kind, Request, Response};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::beneath::Root;
use super::{MAX_VOLUME_BYTES, MAX_VOLUME_ENTRIES, components};

/// Longest wait for the rest of a frame once its length arrived, and for an answer to be taken.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);
/// How long a measured use of the volume is trusted before it is measured again.
const USAGE_TTL: Duration = Duration::from_secs(2);

/// Why a channel ended with an error (a clean end of the stream is `Ok`).
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("volume channel i/o: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Frame(#[from] volume::FrameError),
    #[error("the guest stopped mid-frame for {0:?}")]
    Deadline(Duration),
}

/// A volume's measured use.
struct Usage {
    bytes: u64,
    entries: u64,
    at: Instant,
}

/// One volume's folder, shared by every channel (sandbox) that mounts it.
pub struct VolumeDir {
    root: Root,
    /// Bytes and entries in use, and when measured; raised by each change in between.
    used: Mutex<Usage>,
}

fn errno(e: io::Error) -> Response {
    Response::Errno(e.raw_os_error().unwrap_or(libc::EIO))
}

fn err(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

fn attr(st: &libc::stat) -> Attr {
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFLNK => Kind::Symlink,
        _ => Kind::Other,
    };
    let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
    Attr {
        kind,
        ino: st.st_ino,
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        nlink: st.st_nlink as u32,
        atime_ns: ns(st.st_atime, st.st_atime_nsec),
        mtime_ns: ns(st.st_mtime, st.st_mtime_nsec),
        ctime_ns: ns(st.st_ctime, st.st_ctime_nsec),
    }
}

fn timespec(ns: i64) -> libc::timespec {
    libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000),
    }
}

impl VolumeDir {
    /// The volume folder at `path`.
    pub fn open(path: &std::path::Path) -> io::Result<VolumeDir> {
        Ok(VolumeDir {
            root: Root::open(path)?,
            used: Mutex::new(Usage {
                bytes: 0,
                entries: 0,
                at: Instant::now() - USAGE_TTL * 2,
            }),
        })
    }

    fn path_of<'p>(&self, path: &'p str) -> io::Result<Vec<&'p str>> {
        if path.len() > volume::MAX_PATH {
            return Err(err(libc::ENAMETOOLONG));
        }
        components(path).map_err(|_| err(libc::EINVAL))
    }

    /// Takes `bytes` more bytes and `entries` more entries of the volume's limits, or `EDQUOT`.
    fn reserve(&self, bytes: u64, entries: u64) -> io::Result<()> {
        let mut u = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let over = |u: &Usage| {
            u.bytes.saturating_add(bytes) > MAX_VOLUME_BYTES
                || u.entries.saturating_add(entries) > MAX_VOLUME_ENTRIES
        };
        if u.at.elapsed() > USAGE_TTL || over(&u) {
            *u = self.measure();
        }
        if over(&u) {
            return Err(err(libc::EDQUOT));
        }
        u.bytes += bytes;
        u.entries += entries;
        Ok(())
    }

    fn measure(&self) -> Usage {
        let (bytes, entries) = self.root.usage(MAX_VOLUME_ENTRIES);
        Usage {
            bytes,
            entries,
            at: Instant::now(),
        }
    }

    /// Answers one request (blocking file I/O); the data part goes with [`Response::Data`].
    pub fn answer(&self, req: Request, data: &[u8]) -> (Response, Vec<u8>) {
        let mut out = vec![];
        let r = self.run(req, data, &mut out);
        (r.unwrap_or_else(errno), out)
    }

    fn run(&self, req: Request, data: &[u8], out: &mut Vec<u8>) -> io::Result<Response> {
        let root = &self.root;
        let stat = |p: &[&str]| root.stat(p).map(|s| Response::Attr(attr(&s)));
        Ok(match req {
            Request::Stat { path } => stat(&self.path_of(&path)?)?,
            Request::List { path, offset } => {
                let p = self.path_of(&path)?;
                let all = root.list(&p)?;
                Response::Entries(
                    all.into_iter()
                        .skip(usize::try_from(offset).unwrap_or(usize::MAX))
                        .take(volume::MAX_ENTRIES)
                        .map(|(name, st)| Entry {
                            name,
                            attr: attr(&st),
                        })
                        .collect(),
                )
            }
            Request::Read { path, offset, len } => {
                let f = root.open_file(&self.path_of(&path)?, false)?;
                out.resize(len.min(volume::MAX_IO) as usize, 0);
                let mut got = 0;
                while got < out.len() {
                    match f.read_at(&mut out[got..], offset.saturating_add(got as u64))? {
                        0 => break,
                        n => got += n,
                    }
                }
                out.truncate(got);
                Response::Data
            }
            Request::Write { path, offset } => {
                if data.len() > volume::MAX_IO as usize {
                    return Err(err(libc::EINVAL));
                }
                let f = root.open_file(&self.path_of(&path)?, true)?;
                let end = offset
                    .checked_add(data.len() as u64)
                    .ok_or_else(|| err(libc::EFBIG))?;
                self.reserve(end.saturating_sub(f.metadata()?.len()), 0)?;
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
                let p = self.path_of(&path)?;
                // A new file is the asker's; an existing one (not `exclusive`) stays as it is.
                if root.stat(&p).is_err() {
                    self.reserve(0, 1)?;
                }
                match root.create(&p, mode, true) {
                    Ok(_) => root.chown(&p, Some(uid), Some(gid))?,
                    Err(e) if !exclusive && e.raw_os_error() == Some(libc::EEXIST) => {
                        root.create(&p, mode, false)?;
                    }
                    Err(e) => return Err(e),
                }
                stat(&p)?
            }
            Request::Mkdir {
                path,
                mode,
                uid,
                gid,
            } => {
                let p = self.path_of(&path)?;
                self.reserve(0, 1)?;
                root.mkdir(&p, mode)?;
                root.chown(&p, Some(uid), Some(gid))?;
                stat(&p)?
            }
            Request::Symlink {
                path,
                target,
                uid,
                gid,
            } => {
                if target.is_empty() || target.len() >= volume::MAX_PATH {
                    return Err(err(libc::EINVAL));
                }
                let p = self.path_of(&path)?;
                self.reserve(0, 1)?;
                root.symlink(&p, &target)?;
                root.chown(&p, Some(uid), Some(gid))?;
                stat(&p)?
            }
            Request::Readlink { path } => Response::Link(root.readlink(&self.path_of(&path)?)?),
            Request::Unlink { path } => {
                root.remove(&self.path_of(&path)?, false)?;
                Response::Done
            }
            Request::Rmdir { path } => {
                root.remove(&self.path_of(&path)?, true)?;
                Response::Done
            }
            Request::Rename {
                from,
                to,
                noreplace,
            } => {
                root.rename(&self.path_of(&from)?, &self.path_of(&to)?, noreplace)?;
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
                let p = self.path_of(&path)?;
                if let Some(size) = size {
                    let f = root.open_file(&p, true)?;
                    self.reserve(size.saturating_sub(f.metadata()?.len()), 0)?;
                    f.set_len(size)?;
                }
                if uid.is_some() || gid.is_some() {
                    root.chown(&p, uid, gid)?;
                }
                if let Some(mode) = mode {
                    root.chmod(&p, mode)?;
                }
                if atime_ns.is_some() || mtime_ns.is_some() {
                    root.utimes(&p, atime_ns.map(timespec), mtime_ns.map(timespec))?;
                }
                stat(&p)?
            }
            Request::Fsync { path } => {
                root.open_any(&self.path_of(&path)?)?.sync_all()?;
                Response::Done
            }
            Request::Usage => {
                let u = self.measure();
                let free_bytes = MAX_VOLUME_BYTES.saturating_sub(u.bytes);
                *self.used.lock().unwrap_or_else(|p| p.into_inner()) = u;
                Response::Usage(volume::Usage {
                    total_bytes: MAX_VOLUME_BYTES,
                    free_bytes,
                })
            }
        })
    }
}

/// Answers a guest's requests on `io` until the guest closes it.
pub async fn serve<S>(dir: Arc<VolumeDir>, mut io: S) -> Result<(), ChannelError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        let mut word = [0u8; 4];
        match io.read_exact(&mut word).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let n = volume::frame_len(word)?;
        let mut body = vec![0u8; n];
        tokio::time::timeout(BODY_DEADLINE, io.read_exact(&mut body))
            .await
            .map_err(|_| ChannelError::Deadline(BODY_DEADLINE))??;
        let (resp, data) = match volume::decode::<Request>(&body) {
            Ok((req, data)) => {
                let (dir, data) = (dir.clone(), data.to_vec());
                tokio::task::spawn_blocking(move || dir.answer(req, &data))
                    .await
                    .unwrap_or_else(|_| (Response::Errno(libc::EIO), vec![]))
            }
            Err(_) => (Response::Errno(libc::EINVAL), vec![]),
        };
        tokio::time::timeout(BODY_DEADLINE, io.write_all(&volume::encode(&resp, &data)))
            .await
            .map_err(|_| ChannelError::Deadline(BODY_DEADLINE))??;
    }
}
