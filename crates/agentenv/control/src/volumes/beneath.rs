//! File operations confined below a volume's folder. Every folder on a path is opened by the kernel
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from the folder's
//! descriptor, and the last component is acted on with `*at` calls that never follow it. So neither a
//! `..` nor a symlink, not even one a guest swaps in mid-operation, leads out of the volume.
//!
//! Paths are components already checked by `volumes::components` (no `.`, `..`, `/` or NUL).

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

const RESOLVE: u64 =
    libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;

/// `struct open_how` of openat2(2) (libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An open volume folder.
pub(crate) struct Root(OwnedFd);

/// A path's folder (open) and last name.
struct Node {
    dir: OwnedFd,
    name: CString,
}

impl Root {
    pub(crate) fn open(path: &Path) -> io::Result<Root> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(path)?;
        Ok(Root(f.into()))
    }

    /// `openat2` below the root; `rel` is `.` for the root itself.
    fn open_at(&self, rel: &CStr, flags: libc::c_int, mode: u32) -> io::Result<OwnedFd> {
        let how = OpenHow {
            // openat2 refuses O_PATH with any flag but O_DIRECTORY, O_NOFOLLOW and O_CLOEXEC.
            flags: (flags | libc::O_CLOEXEC) as u64,
            mode: u64::from(mode),
            resolve: RESOLVE,
        };
        // SAFETY: valid descriptor, NUL-terminated path and an `open_how` of the size passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.0.as_raw_fd(),
                rel.as_ptr(),
                &how as *const OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us alone.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
    }

    fn rel(parts: &[&str]) -> io::Result<CString> {
        if parts.is_empty() {
            cstr(".")
        } else {
            cstr(&parts.join("/"))
        }
    }

    /// The folder holding `parts` and its last name; the root itself has none (`EBUSY`).
    fn node(&self, parts: &[&str]) -> io::Result<Node> {
        let Some((last, up)) = parts.split_last() else {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        };
        let dir = self.open_at(&Self::rel(up)?, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok(Node {
            dir,
            name: cstr(last)?,
        })
    }

    /// What `parts` is, its last component not followed.
    pub(crate) fn stat(&self, parts: &[&str]) -> io::Result<libc::stat> {
        if parts.is_empty() {
            let fd = self.open_at(&Self::rel(parts)?, libc::O_PATH, 0)?;
            return fstat(&fd);
        }
        let n = self.node(parts)?;
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        // SAFETY: valid descriptor, C string and a stat buffer.
        check(unsafe {
            libc::fstatat(
                n.dir.as_raw_fd(),
                n.name.as_ptr(),
                st.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        // SAFETY: fstatat filled it.
        Ok(unsafe { st.assume_init() })
    }

    /// A regular file for reading or writing (`EISDIR`/`EINVAL` for anything else).
    pub(crate) fn open_file(&self, parts: &[&str], write: bool) -> io::Result<File> {
        let acc = if write {
            libc::O_WRONLY
        } else {
            libc::O_RDONLY
        };
        let fd = self.open_at(&Self::rel(parts)?, acc | libc::O_NONBLOCK, 0)?;
        regular(fd)
    }

    /// Creates (or with `!exclusive` opens) regular file `parts` for writing, with exactly `mode`.
    pub(crate) fn create(&self, parts: &[&str], mode: u32, exclusive: bool) -> io::Result<File> {
        let n = self.node(parts)?;
        let excl = if exclusive { libc::O_EXCL } else { 0 };
        // SAFETY: valid descriptor and C string.
        let fd = unsafe {
            libc::openat(
                n.dir.as_raw_fd(),
                n.name.as_ptr(),
                libc::O_WRONLY
                    | libc::O_CREAT
                    | excl
                    | libc::O_NOFOLLOW
                    | libc::O_NONBLOCK
                    | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor of ours.
        let f = regular(unsafe { OwnedFd::from_raw_fd(fd) })?;
        if exclusive {
            set_mode(&f, mode)?;
        }
        Ok(f)
    }

    pub(crate) fn mkdir(&self, parts: &[&str], mode: u32) -> io::Result<()> {
        let n = self.node(parts)?;
        // SAFETY: valid descriptor and C string.
        check(unsafe { libc::mkdirat(n.dir.as_raw_fd(), n.name.as_ptr(), 0o700) })?;
        let fd = self.open_at(&Self::rel(parts)?, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        set_mode(&File::from(fd), mode)
    }

    pub(crate) fn symlink(&self, parts: &[&str], target: &str) -> io::Result<()> {
        let n = self.node(parts)?;
        let t = cstr(target)?;
        // SAFETY: valid descriptor and C strings.
        check(unsafe { libc::symlinkat(t.as_ptr(), n.dir.as_raw_fd(), n.name.as_ptr()) })
    }

    pub(crate) fn readlink(&self, parts: &[&str]) -> io::Result<String> {
        let n = self.node(parts)?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: valid descriptor, C string and a buffer of the length passed.
        let r = unsafe {
            libc::readlinkat(
                n.dir.as_raw_fd(),
                n.name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(r as usize);
        String::from_utf8(buf).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
    }

    /// Removes a file or symlink, or (`dir`) an empty folder.
    pub(crate) fn remove(&self, parts: &[&str], dir: bool) -> io::Result<()> {
        let n = self.node(parts)?;
        let flag = if dir { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: valid descriptor and C string.
        check(unsafe { libc::unlinkat(n.dir.as_raw_fd(), n.name.as_ptr(), flag) })
    }

    pub(crate) fn rename(&self, from: &[&str], to: &[&str], noreplace: bool) -> io::Result<()> {
        let (a, b) = (self.node(from)?, self.node(to)?);
        let flags = if noreplace { libc::RENAME_NOREPLACE } else { 0 };
        // SAFETY: valid descriptors and C strings.
        check(unsafe {
            libc::renameat2(
                a.dir.as_raw_fd(),
                a.name.as_ptr(),
                b.dir.as_raw_fd(),
                b.name.as_ptr(),
                flags,
            )
        })
    }

    /// Owner of `parts` itself (a symlink is not followed).
    pub(crate) fn chown(
        &self,
        parts: &[&str],
        uid: Option<u32>,
        gid: Option<u32>,
    ) -> io::Result<()> {
        let (uid, gid) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
        if parts.is_empty() {
            let fd = self.open_at(&Self::rel(parts)?, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
            // SAFETY: valid descriptor.
            return check(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) });
        }
        let n = self.node(parts)?;
        // SAFETY: valid descriptor and C string.
        check(unsafe {
            libc::fchownat(
                n.dir.as_raw_fd(),
                n.name.as_ptr(),
                uid,
                gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })
    }

    /// Permission bits of a file or folder (setuid and setgid dropped); symlinks have none.
    pub(crate) fn chmod(&self, parts: &[&str], mode: u32) -> io::Result<()> {
        let fd = self.open_at(&Self::rel(parts)?, libc::O_PATH, 0)?;
        let path = cstr(&format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        // SAFETY: C string; the O_PATH descriptor pins the inode the magic link names.
        check(unsafe { libc::chmod(path.as_ptr(), mode & 0o1777) })
    }

    /// Access and change times (`None`: leave), of `parts` itself.
    pub(crate) fn utimes(
        &self,
        parts: &[&str],
        atime: Option<libc::timespec>,
        mtime: Option<libc::timespec>,
    ) -> io::Result<()> {
        let omit = libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        };
        let ts = [atime.unwrap_or(omit), mtime.unwrap_or(omit)];
        if parts.is_empty() {
            let fd = self.open_at(&Self::rel(parts)?, libc::O_PATH, 0)?;
            let path = cstr(&format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
            // SAFETY: C string and two timespecs; the descriptor pins the inode.
            return check(unsafe {
                libc::utimensat(libc::AT_FDCWD, path.as_ptr(), ts.as_ptr(), 0)
            });
        }
        let n = self.node(parts)?;
        // SAFETY: valid descriptor, C string and two timespecs; a symlink's own times are set.
        check(unsafe {
            libc::utimensat(
                n.dir.as_raw_fd(),
                n.name.as_ptr(),
                ts.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })
    }

    /// Flushes the file system the root is on (a restored volume, before it appears).
    pub(crate) fn syncfs(&self) -> io::Result<()> {
        // SAFETY: valid descriptor.
        check(unsafe { libc::syncfs(self.0.as_raw_fd()) })
    }

    /// Opens `parts` for `fsync` (a file or a folder).
    pub(crate) fn open_any(&self, parts: &[&str]) -> io::Result<File> {
        let fd = self.open_at(&Self::rel(parts)?, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
        Ok(File::from(fd))
    }

    /// Bytes of the files and the number of entries below the root, counted without leaving it
    /// (a folder swapped for a symlink meanwhile is skipped); stops once past `max_entries`.
    pub(crate) fn usage(&self, max_entries: u64) -> (u64, u64) {
        let (mut bytes, mut entries) = (0u64, 0u64);
        let mut dirs: Vec<Vec<String>> = vec![vec![]];
        while let Some(d) = dirs.pop() {
            let refs: Vec<&str> = d.iter().map(String::as_str).collect();
            for (name, st) in self.list(&refs).unwrap_or_default() {
                entries += 1;
                if entries > max_entries {
                    return (bytes, entries);
                }
                if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
                    let mut child = d.clone();
                    child.push(name);
                    dirs.push(child);
                } else {
                    bytes += st.st_size.max(0) as u64;
                }
            }
        }
        (bytes, entries)
    }

    /// The names in folder `parts`, sorted, each with what it is (not followed).
    pub(crate) fn list(&self, parts: &[&str]) -> io::Result<Vec<(String, libc::stat)>> {
        let fd = self.open_at(&Self::rel(parts)?, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let mut names: Vec<String> =
            std::fs::read_dir(format!("/proc/self/fd/{}", fd.as_raw_fd()))?
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect();
        names.sort();
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let c = cstr(&name)?;
            let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
            // SAFETY: valid descriptor, C string and a stat buffer.
            let r = unsafe {
                libc::fstatat(
                    fd.as_raw_fd(),
                    c.as_ptr(),
                    st.as_mut_ptr(),
                    libc::AT_SYMLINK_NOFOLLOW,
                )
            };
            if r == 0 {
                // SAFETY: fstatat filled it.
                out.push((name, unsafe { st.assume_init() }));
            }
        }
        Ok(out)
    }
}

fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: valid descriptor and a stat buffer.
    check(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat filled it.
    Ok(unsafe { st.assume_init() })
}

fn regular(fd: OwnedFd) -> io::Result<File> {
    let st = fstat(&fd)?;
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Ok(File::from(fd)),
        libc::S_IFDIR => Err(io::Error::from_raw_os_error(libc::EISDIR)),
        _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
    }
}

fn set_mode(f: &File, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    f.set_permissions(std::fs::Permissions::from_mode(mode & 0o1777))
}
