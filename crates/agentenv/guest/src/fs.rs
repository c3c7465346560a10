//! filesystem.Filesystem unary methods: Stat, ListDir, MakeDir, Move, Remove; EntryInfo.

use std::fs::Metadata;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use crate::envd::{Code, EntryInfo, FileType, RpcError};
use crate::users::{self, User};

/// Linux's PATH_MAX and NAME_MAX.
const MAX_PATH_BYTES: usize = 4095;
const MAX_NAME_BYTES: usize = 255;

/// Resolves a request path: relative paths are relative to the user's home; `.`/`..` are
/// folded lexically. Empty → home. Rejects NUL bytes and over-long paths or names.
pub fn resolve(user: &User, path: &str) -> Result<PathBuf, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::new(
            Code::InvalidArgument,
            "path contains a NUL byte",
        ));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!(
                "path is {} bytes long; at most {MAX_PATH_BYTES} are allowed",
                path.len()
            ),
        ));
    }
    if let Some(c) = path.split('/').find(|c| c.len() > MAX_NAME_BYTES) {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!(
                "path component of {} bytes; at most {MAX_NAME_BYTES} are allowed",
                c.len()
            ),
        ));
    }
    let p = Path::new(path);
    let joined = if p.is_absolute() {
        p.to_path_buf()
    } else {
        user.home.join(p)
    };
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// Builds the EntryInfo of `path` (not following a final symlink for `isSymlink`).
pub fn entry_info(path: &Path) -> std::io::Result<EntryInfo> {
    let lmeta = std::fs::symlink_metadata(path)?;
    let is_symlink = lmeta.file_type().is_symlink();
    let (meta, symlink_target) = if is_symlink {
        let target = std::fs::read_link(path).ok().map(|t| {
            let abs = if t.is_absolute() {
                t
            } else {
                path.parent().unwrap_or(Path::new("/")).join(t)
            };
            std::fs::canonicalize(&abs)
                .unwrap_or(abs)
                .display()
                .to_string()
        });
        (std::fs::metadata(path).ok(), target)
    } else {
        (Some(lmeta.clone()), None)
    };
    let file_type = match &meta {
        Some(m) if m.is_dir() => FileType::Directory,
        Some(_) => FileType::File,
        None => FileType::Symlink,
    };
    let m = meta.as_ref().unwrap_or(&lmeta);
    // The permission bits only, as E2B's envd (Go's `Mode().Perm()`): the type is in `type`.
    let mode = m.permissions().mode() & 0o777;
    Ok(EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        file_type: file_type.name(),
        path: path.display().to_string(),
        size: m.len().to_string(),
        mode,
        permissions: permissions_string(m, file_type),
        owner: users::user_name(m.uid()),
        group: users::group_name(m.gid()),
        modified_time: k3_common::time::rfc3339_from_unix(m.mtime().max(0) as u64),
        symlink_target,
        is_symlink,
        metadata: Some(crate::meta::read(path)).filter(|m| !m.is_empty()),
    })
}

fn permissions_string(m: &Metadata, ty: FileType) -> String {
    let bits = m.permissions().mode();
    let mut s = String::with_capacity(10);
    s.push(match ty {
        FileType::Directory => 'd',
        FileType::Symlink => 'L',
        FileType::File => '-',
    });
    for (i, ch) in "rwxrwxrwx".chars().enumerate() {
        s.push(if bits & (1 << (8 - i)) != 0 { ch } else { '-' });
    }
    s
}

fn io_err(e: std::io::Error, what: &str, path: &Path) -> RpcError {
    RpcError::from_io(&e, &format!("{what} '{}'", path.display()))
}

/// Stat.
pub fn stat(path: &Path) -> Result<EntryInfo, RpcError> {
    entry_info(path).map_err(|e| io_err(e, "stat", path))
}

/// ListDir: entries below `path` up to `depth` levels (0 → 1), not `path` itself.
pub fn list_dir(path: &Path, depth: u32) -> Result<Vec<EntryInfo>, RpcError> {
    let meta = std::fs::metadata(path).map_err(|e| io_err(e, "list", path))?;
    if !meta.is_dir() {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("'{}' is not a directory", path.display()),
        ));
    }
    let mut out = Vec::new();
    walk(path, depth.max(1), &mut out).map_err(|e| io_err(e, "list", path))?;
    Ok(out)
}

fn walk(dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> std::io::Result<()> {
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    names.sort();
    for p in names {
        let Ok(info) = entry_info(&p) else { continue }; // vanished while listing
        let descend = depth > 1 && info.file_type == FileType::Directory.name() && !info.is_symlink;
        out.push(info);
        if descend {
            // Unreadable subdirectories are listed but not entered.
            let _ = walk(&p, depth - 1, out);
        }
    }
    Ok(())
}

/// MakeDir with parents; `already_exists` if the path exists. New dirs belong to `user`.
pub fn make_dir(path: &Path, user: &User) -> Result<EntryInfo, RpcError> {
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(RpcError::new(
            Code::AlreadyExists,
            format!("'{}' already exists", path.display()),
        ));
    }
    create_dirs_owned(path, user).map_err(|e| io_err(e, "mkdir", path))?;
    stat(path)
}

/// Creates `dir` and missing parents, chowning each new directory to `user`.
pub fn create_dirs_owned(dir: &Path, user: &User) -> std::io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(d) = cur {
        if d.exists() {
            break;
        }
        missing.push(d.to_path_buf());
        cur = d.parent();
    }
    std::fs::create_dir_all(dir)?;
    for d in missing.iter().rev() {
        chown_to(d, user)?;
    }
    Ok(())
}

/// Gives `path` to `user` when the agent runs as root (no-op otherwise).
pub fn chown_to(path: &Path, user: &User) -> std::io::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(());
    }
    // Skip no-op chowns: they would show up as CHMOD events in watches.
    let m = std::fs::symlink_metadata(path)?;
    if m.uid() == user.uid && m.gid() == user.gid {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))
}

/// Move (rename), creating the destination's parent directories.
pub fn move_entry(src: &Path, dst: &Path, user: &User) -> Result<EntryInfo, RpcError> {
    std::fs::symlink_metadata(src).map_err(|e| io_err(e, "move", src))?;
    if let Some(parent) = dst.parent() {
        create_dirs_owned(parent, user).map_err(|e| io_err(e, "mkdir", parent))?;
    }
    std::fs::rename(src, dst).map_err(|e| io_err(e, "move", src))?;
    stat(dst)
}

/// Remove a file, link or directory tree.
pub fn remove(path: &Path) -> Result<(), RpcError> {
    // As E2B's envd: removing what is not there succeeds.
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        r => r.map_err(|e| io_err(e, "remove", path))?,
    };
    let r = if meta.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    r.map_err(|e| io_err(e, "remove", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_what_is_not_there_succeeds() {
        let d = tempfile::tempdir().unwrap();
        assert!(remove(&d.path().join("missing")).is_ok());
        let f = d.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        remove(&f).unwrap();
        assert!(!f.exists());
    }

    #[test]
    fn entry_modes_are_the_permission_bits_only() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("sub");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = d.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        std::os::unix::fs::symlink(&dir, d.path().join("l")).unwrap();
        assert_eq!(entry_info(&dir).unwrap().mode, 0o755);
        assert_eq!(entry_info(&file).unwrap().mode, 0o640);
        assert_eq!(entry_info(&d.path().join("l")).unwrap().mode, 0o755);
    }

    #[test]
    fn resolve_folds_relative_paths() {
        let u = User {
            name: "u".into(),
            uid: 1,
            gid: 1,
            home: "/home/u".into(),
            shell: String::new(),
        };
        assert_eq!(resolve(&u, "a/../b").unwrap(), PathBuf::from("/home/u/b"));
        assert_eq!(resolve(&u, "/x/./y/..").unwrap(), PathBuf::from("/x"));
        assert_eq!(resolve(&u, "").unwrap(), PathBuf::from("/home/u"));
        assert_eq!(resolve(&u, "../../../..").unwrap(), PathBuf::from("/"));
        assert!(resolve(&u, "a\0b").is_err());
    }
}
