//! Applies layer tarballs to a directory: whiteouts, opaque directories, hard links, symlinks, devices,
//! modes, ownership, mtimes and xattrs, with every path resolved inside the destination.
//!
//! Path rules: entry names must be relative and free of `..`. Parents are resolved component by
//! component with `lstat`; a symlink parent is followed *inside* the destination (an absolute target
//! means the destination's root, as the guest sees it), and one whose target climbs above the root is
//! refused. The final component is never followed: an existing symlink there is replaced, not written
//! through. Hard-link targets obey the same rules.
//!
//! As root these rules run inside [`crate::jail`] (the kernel's barrier under them); see [`apply_layer`].

use std::collections::{HashSet, VecDeque};
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{OciError, io};
use crate::manifest::Compression;
use crate::reference::Digest;
use crate::stream::decoder;

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";
const MAX_SYMLINK_HOPS: usize = 40;

/// What applying one layer did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Archive entries seen.
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub file_bytes: u64,
    /// `.wh.` whiteouts and opaque markers applied.
    pub whiteouts: u64,
    /// Device nodes not created (no permission).
    pub devices_skipped: u64,
    /// sha256 of the uncompressed tar stream (the layer's diff_id).
    pub diff_id: Option<Digest>,
}

/// Limits and names for [`apply_layer`].
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    /// Name used in errors (the layer digest).
    pub layer: String,
    /// Compression of the stream.
    pub compression: Compression,
    /// The uncompressed tar must hash to this.
    pub diff_id: Option<Digest>,
    /// At most this many bytes of file content (a decompression-bomb guard).
    pub max_file_bytes: u64,
    /// At most this many archive entries (an inode-bomb guard).
    pub max_entries: u64,
}

/// Applies one layer read from `blob` on top of `dest` (an existing directory).
///
/// As root, the extraction runs in a [`jail`](crate::jail::run_in): a fresh thread whose root is
/// `dest`, bind-mounted `nosuid,nodev` in a mount namespace of its own, holding only the capabilities
/// unpacking needs (no chroot, no mount). The path rules (relative names without `..`, parents
/// resolved inside `dest`) are then not the only barrier: even past a bug in them (or a race with
/// another writer of `dest`) nothing outside `dest` can be reached, and the device nodes and setuid
/// files the layer creates are inert through that mount. A jail step that fails fails the apply
/// ([`OciError::Jail`]); there is no fallback to the unjailed path.
///
/// Without root there are no privileges to contain: the layer is applied in the calling thread, as
/// the calling user, with the path rules alone (devices are skipped, owners kept as ours).
pub fn apply_layer(
    dest: &Path,
    blob: impl Read + Send,
    opts: &ApplyOptions,
) -> Result<ApplyStats, OciError> {
    let root = dest.canonicalize().map_err(io("open", dest))?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return extract(&root, blob, opts);
    }
    crate::jail::run_in(&root, || extract(Path::new("/"), blob, opts))?.map_err(|e| match e {
        // Paths in the jail are relative to its root: name them as the host sees them.
        OciError::Io { what, path, source } => OciError::Io {
            what,
            path: root.join(path.strip_prefix("/").unwrap_or(&path)),
            source,
        },
        e => e,
    })
}

/// Applies the layer to `root` (canonical: `/` inside the jail).
fn extract(root: &Path, blob: impl Read, opts: &ApplyOptions) -> Result<ApplyStats, OciError> {
    let bad = |e: io::Error| OciError::BadLayer {
        layer: opts.layer.clone(),
        reason: e.to_string(),
    };
    let mut hashed = decoder(blob, opts.compression).map_err(bad)?;
    let mut stats = ApplyStats::default();
    {
        let mut archive = tar::Archive::new(&mut hashed);
        let mut a = Applier {
            root,
            layer: &opts.layer,
            written: HashSet::new(),
            dirs: Vec::new(),
            max_file_bytes: opts.max_file_bytes,
            stats: &mut stats,
            // SAFETY: geteuid has no preconditions.
            euid: unsafe { libc::geteuid() },
        };
        for entry in archive.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            a.stats.entries += 1;
            if a.stats.entries > opts.max_entries {
                return Err(OciError::TooManyEntries {
                    layer: opts.layer.clone(),
                    limit: opts.max_entries,
                });
            }
            a.entry(&mut entry)?;
        }
        a.finish_dirs();
    }
    // The end-of-archive blocks and padding are part of the diff_id.
    io::copy(&mut hashed, &mut io::sink()).map_err(bad)?;
    let actual = hashed.digest();
    if let Some(expected) = &opts.diff_id
        && *expected != actual
    {
        return Err(OciError::DigestMismatch {
            what: "layer diff_id",
            expected: expected.clone(),
            actual,
        });
    }
    stats.diff_id = Some(actual);
    Ok(stats)
}

struct Applier<'a> {
    root: &'a Path,
    layer: &'a str,
    /// Resolved paths (relative to root) this layer created; an opaque marker keeps them.
    written: HashSet<PathBuf>,
    /// Directory mtimes, set after the layer (children change them).
    dirs: Vec<(PathBuf, i64)>,
    max_file_bytes: u64,
    stats: &'a mut ApplyStats,
    euid: u32,
}

/// Owner, mode, mtime and xattrs of an entry.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    xattrs: Vec<(OsString, Vec<u8>)>,
}

impl Applier<'_> {
    fn escape(&self, entry: &[u8], reason: &'static str) -> OciError {
        OciError::PathEscape {
            layer: self.layer.to_owned(),
            entry: String::from_utf8_lossy(entry).into_owned(),
            reason,
        }
    }

    fn bad(&self, reason: String) -> OciError {
        OciError::BadLayer {
            layer: self.layer.to_owned(),
            reason,
        }
    }

    /// Splits an archive name into plain components; refuses absolute names and `..`.
    fn components(&self, name: &[u8]) -> Result<Vec<OsString>, OciError> {
        if name.first() == Some(&b'/') {
            return Err(self.escape(name, "absolute path"));
        }
        let mut out = Vec::new();
        for c in name.split(|b| *b == b'/') {
            match c {
                b"" | b"." => {}
                b".." => return Err(self.escape(name, "`..` component")),
                c if c.contains(&0) => return Err(self.escape(name, "NUL in name")),
                c => out.push(OsStr::from_bytes(c).to_owned()),
            }
        }
        Ok(out)
    }

    /// Resolves `parents` to a real directory under root (relative path), following symlinks inside
    /// root. Missing directories are created when `create`; otherwise `None` is returned for them.
    fn resolve_dir(
        &self,
        entry: &[u8],
        parents: &[OsString],
        create: bool,
    ) -> Result<Option<PathBuf>, OciError> {
        let mut resolved: Vec<OsString> = Vec::new();
        let mut todo: VecDeque<OsString> = parents.iter().cloned().collect();
        let mut hops = 0;
        while let Some(c) = todo.pop_front() {
            if c == ".." {
                if resolved.pop().is_none() {
                    return Err(self.escape(entry, "symlink parent points outside the destination"));
                }
                continue;
            }
            let rel: PathBuf = resolved.iter().chain(std::iter::once(&c)).collect();
            let abs = self.root.join(&rel);
            match std::fs::symlink_metadata(&abs) {
                Ok(m) if m.is_dir() => resolved.push(c),
                Ok(m) if m.file_type().is_symlink() => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(self.escape(entry, "too many symlinks in parent"));
                    }
                    let target = std::fs::read_link(&abs).map_err(io("readlink", &abs))?;
                    let t = target.as_os_str().as_bytes();
                    if t.first() == Some(&b'/') {
                        resolved.clear();
                    }
                    let mut parts: Vec<OsString> = t
                        .split(|b| *b == b'/')
                        .filter(|p| !p.is_empty() && *p != b".")
                        .map(|p| OsStr::from_bytes(p).to_owned())
                        .collect();
                    while let Some(p) = parts.pop() {
                        todo.push_front(p);
                    }
                }
                Ok(_) if create => {
                    // A non-directory where this layer needs a directory: the layer replaces it.
                    std::fs::remove_file(&abs).map_err(io("remove", &abs))?;
                    self.mkdir_implicit(&abs)?;
                    resolved.push(c);
                }
                Ok(_) => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::NotFound && create => {
                    self.mkdir_implicit(&abs)?;
                    resolved.push(c);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(io("stat", &abs)(e)),
            }
        }
        Ok(Some(resolved.iter().collect()))
    }

    fn mkdir_implicit(&self, abs: &Path) -> Result<(), OciError> {
        std::fs::create_dir(abs).map_err(io("mkdir", abs))?;
        set_mode(abs, 0o755)
    }

    fn entry<R: Read>(&mut self, e: &mut tar::Entry<'_, R>) -> Result<(), OciError> {
        use tar::EntryType as T;
        let kind = e.header().entry_type();
        if matches!(
            kind,
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink
        ) {
            return Ok(());
        }
        let name = e.path_bytes().into_owned();
        let comps = self.components(&name)?;
        let Some((last, parents)) = comps.split_last() else {
            return Ok(()); // "./": the destination itself keeps its own metadata
        };
        let last_b = last.as_bytes();
        if last_b == OPAQUE.as_bytes() {
            if let Some(dir) = self.resolve_dir(&name, parents, false)? {
                self.clear_opaque(&dir)?;
            }
            self.stats.whiteouts += 1;
            return Ok(());
        }
        if let Some(hidden) = last_b.strip_prefix(WHITEOUT.as_bytes()) {
            // `.wh..` and `.wh...` would name the folder itself or its parent.
            if hidden == b"." || hidden == b".." {
                return Err(self.escape(&name, "whiteout of `.` or `..`"));
            }
            if !hidden.starts_with(WHITEOUT.as_bytes()) && !hidden.is_empty() {
                if let Some(dir) = self.resolve_dir(&name, parents, false)? {
                    let rel = dir.join(OsStr::from_bytes(hidden));
                    if !self.written.contains(&rel) {
                        remove_any(&self.root.join(&rel))?;
                    }
                }
                self.stats.whiteouts += 1;
            }
            return Ok(());
        }
        let meta = self.meta(e)?;
        let dir = self.resolve_dir(&name, parents, true)?.unwrap_or_default();
        let rel = dir.join(last);
        let abs = self.root.join(&rel);
        match kind {
            T::Directory => {
                match std::fs::symlink_metadata(&abs) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        remove_any(&abs)?;
                        std::fs::create_dir(&abs).map_err(io("mkdir", &abs))?;
                    }
                    Err(_) => std::fs::create_dir(&abs).map_err(io("mkdir", &abs))?,
                }
                self.own(&abs, &meta)?;
                set_mode(&abs, meta.mode)?;
                self.xattrs(&abs, &meta);
                self.dirs.push((abs.clone(), meta.mtime));
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                remove_any(&abs)?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&abs)
                    .map_err(io("create", &abs))?;
                self.copy(e, &mut f, &abs)?;
                drop(f);
                self.own(&abs, &meta)?;
                set_mode(&abs, meta.mode)?;
                self.xattrs(&abs, &meta);
                set_mtime(&abs, meta.mtime);
            }
            T::Symlink => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| self.bad(format!("symlink {} has no target", abs.display())))?
                    .into_owned();
                remove_any(&abs)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), &abs)
                    .map_err(io("symlink", &abs))?;
                self.own(&abs, &meta)?;
                set_mtime(&abs, meta.mtime);
            }
            T::Link => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| self.bad(format!("hard link {} has no target", abs.display())))?
                    .into_owned();
                let outside = |e: OciError| match e {
                    OciError::PathEscape { .. } => {
                        self.escape(&name, "hard link target outside the destination")
                    }
                    e => e,
                };
                let tc = self.components(&target).map_err(outside)?;
                let Some((tlast, tparents)) = tc.split_last() else {
                    return Err(self.escape(&name, "hard link to the destination itself"));
                };
                let tdir = self
                    .resolve_dir(&target, tparents, false)
                    .map_err(outside)?
                    .ok_or_else(|| {
                        self.bad(format!(
                            "hard link target {:?} missing",
                            String::from_utf8_lossy(&target)
                        ))
                    })?;
                let tabs = self.root.join(tdir.join(tlast));
                match std::fs::symlink_metadata(&tabs) {
                    Ok(m) if m.is_dir() => {
                        return Err(self.escape(&name, "hard link to a directory"));
                    }
                    Ok(_) => {}
                    Err(_) => {
                        return Err(self.bad(format!(
                            "hard link target {:?} missing",
                            String::from_utf8_lossy(&target)
                        )));
                    }
                }
                if tabs != abs {
                    remove_any(&abs)?;
                    std::fs::hard_link(&tabs, &abs).map_err(io("link", &abs))?;
                }
            }
            T::Char | T::Block | T::Fifo => {
                remove_any(&abs)?;
                let fmt = match kind {
                    T::Char => libc::S_IFCHR,
                    T::Block => libc::S_IFBLK,
                    _ => libc::S_IFIFO,
                };
                let major = e.header().device_major().ok().flatten().unwrap_or(0);
                let minor = e.header().device_minor().ok().flatten().unwrap_or(0);
                let c = cstr(&abs)?;
                let dev = libc::makedev(major, minor);
                // SAFETY: c is a valid NUL-terminated path.
                let rc = unsafe { libc::mknod(c.as_ptr(), fmt | (meta.mode & 0o7777), dev) };
                if rc != 0 {
                    let err = io::Error::last_os_error();
                    if kind != T::Fifo && err.raw_os_error() == Some(libc::EPERM) {
                        self.stats.devices_skipped += 1;
                        return Ok(());
                    }
                    return Err(io("mknod", &abs)(err));
                }
                self.own(&abs, &meta)?;
                set_mode(&abs, meta.mode)?;
                set_mtime(&abs, meta.mtime);
            }
            other => {
                tracing::debug!(layer = self.layer, ?other, "skipping tar entry type");
                return Ok(());
            }
        }
        self.written.insert(rel);
        Ok(())
    }

    fn meta<R: Read>(&self, e: &mut tar::Entry<'_, R>) -> Result<Meta, OciError> {
        let h = e.header();
        let num = |r: io::Result<u64>| r.map_err(|x| self.bad(x.to_string()));
        let mut m = Meta {
            mode: h.mode().map_err(|x| self.bad(x.to_string()))? & 0o7777,
            uid: num(h.uid())? as u32,
            gid: num(h.gid())? as u32,
            mtime: num(h.mtime())? as i64,
            xattrs: Vec::new(),
        };
        if let Some(pax) = e.pax_extensions().map_err(|x| self.bad(x.to_string()))? {
            for ext in pax.flatten() {
                let Ok(key) = ext.key() else { continue };
                let val = ext.value_bytes();
                let parse = || {
                    std::str::from_utf8(val)
                        .ok()
                        .and_then(|v| v.split('.').next()?.parse::<i64>().ok())
                };
                match key {
                    "uid" => m.uid = parse().unwrap_or(m.uid as i64) as u32,
                    "gid" => m.gid = parse().unwrap_or(m.gid as i64) as u32,
                    "mtime" => m.mtime = parse().unwrap_or(m.mtime),
                    k => {
                        if let Some(x) = k.strip_prefix("SCHILY.xattr.") {
                            m.xattrs.push((OsString::from(x), val.to_vec()));
                        }
                    }
                }
            }
        }
        Ok(m)
    }

    fn copy(&mut self, from: &mut impl Read, to: &mut File, abs: &Path) -> Result<(), OciError> {
        let mut buf = vec![0u8; 128 << 10];
        loop {
            let n = from
                .read(&mut buf)
                .map_err(|e| self.bad(format!("{}: {e}", abs.display())))?;
            if n == 0 {
                return Ok(());
            }
            self.stats.file_bytes += n as u64;
            if self.stats.file_bytes > self.max_file_bytes {
                return Err(OciError::UnpackedTooLarge {
                    digest: Digest::parse(self.layer)
                        .unwrap_or_else(|_| Digest::of(self.layer.as_bytes())),
                    limit: self.max_file_bytes,
                });
            }
            to.write_all(&buf[..n]).map_err(io("write", abs))?;
        }
    }

    fn own(&self, abs: &Path, m: &Meta) -> Result<(), OciError> {
        let c = cstr(abs)?;
        // SAFETY: c is a valid NUL-terminated path; lchown does not follow the final symlink.
        let rc = unsafe { libc::lchown(c.as_ptr(), m.uid, m.gid) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            // Without root, files keep our own uid; as root a failure is real.
            if self.euid == 0 || err.raw_os_error() != Some(libc::EPERM) {
                return Err(io("chown", abs)(err));
            }
        }
        Ok(())
    }

    fn xattrs(&self, abs: &Path, m: &Meta) {
        for (k, v) in &m.xattrs {
            let (Ok(p), Ok(n)) = (cstr(abs), CString::new(k.as_bytes())) else {
                continue;
            };
            // SAFETY: valid NUL-terminated strings and a live buffer of v.len() bytes.
            let rc =
                unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
            if rc != 0 {
                tracing::warn!(path = %abs.display(), xattr = ?k, err = %io::Error::last_os_error(), "xattr not set");
            }
        }
    }

    /// Empties `dir` (relative) of everything lower layers put there; keeps what this layer wrote.
    fn clear_opaque(&self, dir: &Path) -> Result<(), OciError> {
        let abs = self.root.join(dir);
        let rd = match std::fs::read_dir(&abs) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io("read dir", &abs)(e)),
        };
        for ent in rd {
            let ent = ent.map_err(io("read dir", &abs))?;
            let rel = dir.join(ent.file_name());
            if self.written.contains(&rel) {
                let is_dir = ent.file_type().map(|t| t.is_dir()).unwrap_or(false);
                if is_dir {
                    self.clear_opaque(&rel)?;
                }
            } else {
                remove_any(&ent.path())?;
            }
        }
        Ok(())
    }

    fn finish_dirs(&mut self) {
        for (abs, mtime) in self.dirs.iter().rev() {
            set_mtime(abs, *mtime);
        }
    }
}

fn cstr(p: &Path) -> Result<CString, OciError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| OciError::Io {
        what: "path",
        path: p.to_owned(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"),
    })
}

fn set_mode(abs: &Path, mode: u32) -> Result<(), OciError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(abs, std::fs::Permissions::from_mode(mode)).map_err(io("chmod", abs))
}

fn set_mtime(abs: &Path, mtime: i64) {
    let Ok(c) = cstr(abs) else { return };
    let t = libc::timespec {
        tv_sec: mtime as libc::time_t,
        tv_nsec: 0,
    };
    let times = [t, t];
    // SAFETY: valid path and a two-element timespec array; AT_SYMLINK_NOFOLLOW keeps links untouched.
    unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        );
    }
}

/// Removes a file, symlink or directory tree at `abs` without following symlinks; absent is fine.
fn remove_any(abs: &Path) -> Result<(), OciError> {
    match std::fs::symlink_metadata(abs) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(abs).map_err(io("remove", abs)),
        Ok(_) => std::fs::remove_file(abs).map_err(io("remove", abs)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("stat", abs)(e)),
    }
}
