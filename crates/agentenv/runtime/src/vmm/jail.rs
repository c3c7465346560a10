//! A root runtime's QEMU sees almost none of the host's files: before it execs, it moves to a mount
//! namespace of its own whose root is an empty read-only tmpfs holding only what QEMU itself needs:
//! `/usr` (its binary, libraries, firmware and modules; the install prefix of a QEMU outside `/usr`),
//! the merged-`/usr` links, `/etc/ld.so.cache`, a `/proc` of its own that hides other users'
//! processes, a read-only `/sys` and `/dev/{null,zero,random,urandom,kvm}`, all read-only and nosuid.
//! Its VM files arrive as descriptors ([`crate::vmm::launch`]), so it names no host path: the state
//! folder, other sandboxes' files and everything world-readable elsewhere on the host are out of view.

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Top-level names that merged-`/usr` hosts keep as links (bound as folders where they are not).
const USR_LINKS: [&str; 6] = ["bin", "sbin", "lib", "lib64", "lib32", "libx32"];
/// Devices QEMU may open (where the host has them).
const DEVICES: [&str; 5] = ["null", "zero", "random", "urandom", "kvm"];

/// One QEMU's view, planned in the parent (paths as C strings) and built in the child by [`Jail::enter`].
#[derive(Debug)]
pub struct Jail {
    root: CString,
    dirs: Vec<CString>,
    files: Vec<CString>,
    binds: Vec<Bind>,
    links: Vec<(CString, CString)>,
    proc_dir: CString,
}

#[derive(Debug)]
struct Bind {
    src: CString,
    dst: CString,
    flags: libc::c_ulong,
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
}

/// The absolute path of `bin` (searched on `PATH` when it has no `/`).
pub(crate) fn resolve(bin: &Path) -> io::Result<PathBuf> {
    let found = if bin.components().count() > 1 {
        Some(bin.to_path_buf())
    } else {
        bin.to_str().and_then(k3_common::fsutil::which)
    };
    found
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{}", bin.display())))?
        .canonicalize()
}

impl Jail {
    /// The view of the QEMU at `bin`, to be built on `root` (created here if missing; it stays empty
    /// in the host's view).
    pub fn new(root: &Path, bin: &Path) -> io::Result<Jail> {
        std::fs::create_dir_all(root)?;
        let mut j = Jail {
            root: cstr(root)?,
            dirs: Vec::new(),
            files: Vec::new(),
            binds: Vec::new(),
            links: Vec::new(),
            proc_dir: cstr(&root.join("proc"))?,
        };
        let ro = (libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV) as libc::c_ulong;
        j.dir(root, "usr")?;
        j.bind(Path::new("/usr"), &root.join("usr"), ro)?;
        for name in USR_LINKS {
            let host = Path::new("/").join(name);
            match std::fs::symlink_metadata(&host) {
                Ok(m) if m.file_type().is_symlink() => {
                    let target = std::fs::read_link(&host)?;
                    j.links.push((cstr(&target)?, cstr(&root.join(name))?));
                }
                Ok(m) if m.is_dir() => {
                    j.dir(root, name)?;
                    j.bind(&host, &root.join(name), ro)?;
                }
                _ => {}
            }
        }
        let bin = resolve(bin)?;
        if !bin.starts_with("/usr") {
            // A QEMU installed elsewhere brings its prefix (its firmware, libraries, modules).
            let prefix = bin
                .parent()
                .and_then(Path::parent)
                .filter(|p| p.parent().is_some());
            let prefix = prefix.ok_or_else(|| {
                io::Error::other(format!("{}: no install prefix to show QEMU", bin.display()))
            })?;
            let rel = prefix.strip_prefix("/").map_err(io::Error::other)?;
            let mut at = PathBuf::new();
            for c in rel.components() {
                at.push(c);
                j.dir(root, &at.display().to_string())?;
            }
            j.bind(prefix, &root.join(rel), ro)?;
        }
        let cache = Path::new("/etc/ld.so.cache");
        if cache.is_file() {
            j.dir(root, "etc")?;
            j.files.push(cstr(&root.join("etc/ld.so.cache"))?);
            j.bind(cache, &root.join("etc/ld.so.cache"), ro)?;
        }
        j.dir(root, "sys")?;
        let noexec = ro | libc::MS_NOEXEC as libc::c_ulong;
        j.bind(Path::new("/sys"), &root.join("sys"), noexec)?;
        j.dir(root, "dev")?;
        for d in DEVICES {
            let host = Path::new("/dev").join(d);
            if host.exists() {
                let at = root.join("dev").join(d);
                j.files.push(cstr(&at)?);
                // Devices need the mount without `nodev`.
                let flags = (libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC) as libc::c_ulong;
                j.bind(&host, &at, flags)?;
            }
        }
        j.dir(root, "proc")?;
        Ok(j)
    }

    fn dir(&mut self, root: &Path, rel: &str) -> io::Result<()> {
        self.dirs.push(cstr(&root.join(rel))?);
        Ok(())
    }

    fn bind(&mut self, src: &Path, dst: &Path, flags: libc::c_ulong) -> io::Result<()> {
        self.binds.push(Bind {
            src: cstr(src)?,
            dst: cstr(dst)?,
            flags,
        });
        Ok(())
    }

    /// Builds the view and makes it this process's root. Needs `CAP_SYS_ADMIN`; run before dropping
    /// root.
    ///
    /// # Safety
    /// For `pre_exec`: runs between fork and exec and only makes async-signal-safe system calls on
    /// strings prepared by [`Jail::new`].
    pub unsafe fn enter(&self) -> io::Result<()> {
        let check = |r: libc::c_int| {
            if r == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        // SAFETY: plain system calls on NUL-terminated strings that outlive them.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
            let inert = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC; // no suid, devices or exec
            let tmpfs = Some(c"tmpfs");
            mount(tmpfs, &self.root, tmpfs, inert, Some(c"mode=0755,size=64k"))?;
            // chmod: the runtime's umask (0077) would leave `/etc` and `/dev` closed to QEMU's uid.
            for d in &self.dirs {
                check(libc::mkdir(d.as_ptr(), 0o755))?;
                check(libc::chmod(d.as_ptr(), 0o755))?;
            }
            for f in &self.files {
                let fd = libc::open(
                    f.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                    0o644,
                );
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                libc::close(fd);
            }
            for b in &self.binds {
                mount(Some(&b.src), &b.dst, None, libc::MS_BIND, None)?;
                mount(
                    None,
                    &b.dst,
                    None,
                    libc::MS_BIND | libc::MS_REMOUNT | b.flags,
                    None,
                )?;
            }
            for (target, at) in &self.links {
                check(libc::symlink(target.as_ptr(), at.as_ptr()))?;
            }
            let proc = Some(c"proc");
            mount(proc, &self.proc_dir, proc, inert, Some(c"hidepid=2"))?;
            // pivot_root(".", "."): the old root ends up on top of the new one, then goes.
            check(libc::chdir(self.root.as_ptr()))?;
            if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
            check(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            check(libc::chdir(c"/".as_ptr()))?;
            let flags = libc::MS_REMOUNT | libc::MS_RDONLY | inert;
            mount(None, c"/", None, flags, None)?;
        }
        Ok(())
    }
}

/// mount(2), async-signal-safe: `None` is a NULL source, type or data.
///
/// # Safety
/// A plain system call on NUL-terminated strings that outlive it.
unsafe fn mount(
    src: Option<&CStr>,
    dst: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let p = |c: Option<&CStr>| c.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: see the function's contract.
    match unsafe { libc::mount(p(src), dst.as_ptr(), p(fstype), flags, p(data).cast()) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_shows_only_what_qemu_needs() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let j = Jail::new(&root, Path::new("sh")).unwrap();
        let names: Vec<String> = j
            .binds
            .iter()
            .map(|b| b.src.to_string_lossy().into_owned())
            .collect();
        assert!(names.contains(&"/usr".to_string()), "{names:?}");
        assert!(
            names.iter().all(|n| n == "/usr"
                || n == "/sys"
                || n.starts_with("/dev/")
                || n.starts_with("/etc/ld.so")
                || USR_LINKS.iter().any(|l| n == &format!("/{l}"))),
            "{names:?}"
        );
        for b in &j.binds {
            assert_ne!(
                b.flags & libc::MS_RDONLY as libc::c_ulong,
                0,
                "{b:?} writable"
            );
            assert_ne!(b.flags & libc::MS_NOSUID as libc::c_ulong, 0, "{b:?} suid");
        }
        assert!(
            std::fs::read_dir(&root).unwrap().next().is_none(),
            "root not empty"
        );
    }
}
