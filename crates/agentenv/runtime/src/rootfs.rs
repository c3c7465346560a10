//! The default template's userland: a cached `debootstrap --variant=minbase bookworm` tree with the
//! default user and the guest agent, turned into an ext4 image with `mkfs.ext4 -d` (no mounts).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Debian mirror used by debootstrap.
pub const MIRROR: &str = "http://deb.debian.org/debian";
/// uid and gid of the default user `user`.
pub const USER_ID: u32 = 1000;

/// Errors while building the root filesystem.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// The guest agent binary was not found.
    #[error(
        "agentenv-guest binary not found (set RuntimeConfig.guest_bin or AGENTENV_GUEST_BIN, or build it with `cargo build -p agentenv-guest`); looked at: {0}"
    )]
    GuestBinary(String),
    /// debootstrap or mkfs.ext4 failed.
    #[error("{program} failed ({status}): {stderr}")]
    Tool {
        program: String,
        status: String,
        stderr: String,
    },
    /// File i/o.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RootfsError + 'a {
    move |source| RootfsError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// Finds the guest agent: `explicit`, env `AGENTENV_GUEST_BIN`, else `target/{release,debug}/agentenv-guest`
/// in the target folder of the running executable (also from `target/*/deps/` test binaries).
pub fn find_guest_binary(explicit: Option<&Path>) -> Result<PathBuf, RootfsError> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        candidates.push(p.to_owned());
    } else {
        if let Some(p) = std::env::var_os("AGENTENV_GUEST_BIN") {
            candidates.push(PathBuf::from(p));
        }
        if let Ok(exe) = std::env::current_exe() {
            for dir in exe.ancestors().skip(1).take(4) {
                if dir.file_name().is_some_and(|n| n == "target")
                    || dir.join("CACHEDIR.TAG").exists()
                {
                    candidates.push(dir.join("release/agentenv-guest"));
                    candidates.push(dir.join("debug/agentenv-guest"));
                }
            }
            if let Some(dir) = exe.parent() {
                candidates.push(dir.join("agentenv-guest"));
                if let Some(up) = dir.parent() {
                    candidates.push(up.join("agentenv-guest"));
                }
            }
        }
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(RootfsError::GuestBinary(tried.join(", ")))
}

/// Runs debootstrap once into `<cache>/debootstrap-bookworm-minbase` (reused afterwards).
pub fn debootstrap(cache: &Path) -> Result<PathBuf, RootfsError> {
    let dir = cache.join("debootstrap-bookworm-minbase");
    if dir.join("bin/bash").exists() || dir.join("usr/bin/bash").exists() {
        return Ok(dir);
    }
    let partial = cache.join(format!(
        "debootstrap-bookworm-minbase.partial.{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(cache).map_err(io("create", cache))?;
    let partial_s = partial.display().to_string();
    tool(
        "debootstrap",
        &["--variant=minbase", "bookworm", &partial_s, MIRROR],
    )?;
    match std::fs::rename(&partial, &dir) {
        Ok(()) => Ok(dir),
        // Another build won the race; its tree is as good as ours.
        Err(_) if dir.join("usr/bin/bash").exists() => {
            let _ = std::fs::remove_dir_all(&partial);
            Ok(dir)
        }
        Err(e) => Err(io("rename", &dir)(e)),
    }
}

/// Adds the default user, hostname and the guest agent to `tree` (idempotent).
pub fn customize(tree: &Path, guest_bin: &Path) -> Result<(), RootfsError> {
    let passwd = tree.join("etc/passwd");
    let text = std::fs::read_to_string(&passwd).map_err(io("read", &passwd))?;
    if !text.lines().any(|l| l.starts_with("user:")) {
        append(
            &passwd,
            &format!("user:x:{USER_ID}:{USER_ID}:user:/home/user:/bin/bash\n"),
        )?;
        append(&tree.join("etc/group"), &format!("user:x:{USER_ID}:\n"))?;
        append(&tree.join("etc/shadow"), "user:*:20000:0:99999:7:::\n")?;
    }
    let home = tree.join("home/user");
    std::fs::create_dir_all(&home).map_err(io("create", &home))?;
    std::os::unix::fs::chown(&home, Some(USER_ID), Some(USER_ID)).map_err(io("chown", &home))?;
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755))
        .map_err(io("chmod", &home))?;
    for (file, body) in [
        ("etc/hostname", "agentenv\n"),
        ("etc/hosts", "127.0.0.1 localhost agentenv\n::1 localhost\n"),
    ] {
        let p = tree.join(file);
        std::fs::write(&p, body).map_err(io("write", &p))?;
    }
    let dst = tree.join("usr/local/bin/agentenv-guest");
    let tmp = tree.join(format!(
        "usr/local/bin/.agentenv-guest.{}",
        std::process::id()
    ));
    std::fs::create_dir_all(tree.join("usr/local/bin")).map_err(io("create", &dst))?;
    std::fs::copy(guest_bin, &tmp).map_err(io("copy", guest_bin))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(io("chmod", &tmp))?;
    std::fs::rename(&tmp, &dst).map_err(io("rename", &dst))?;
    Ok(())
}

/// `mkfs.ext4 -d tree` into a `size_mib` raw image at `out`.
pub fn make_ext4(tree: &Path, out: &Path, size_mib: u64) -> Result<(), RootfsError> {
    let _ = std::fs::remove_file(out);
    let (t, o) = (tree.display().to_string(), out.display().to_string());
    tool(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-L",
            "root",
            "-E",
            "root_owner=0:0",
            "-d",
            &t,
            &o,
            &format!("{size_mib}M"),
        ],
    )
}

fn append(path: &Path, line: &str) -> Result<(), RootfsError> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(io("open", path))?;
    f.write_all(line.as_bytes()).map_err(io("write", path))
}

fn tool(program: &str, args: &[&str]) -> Result<(), RootfsError> {
    let o = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| RootfsError::Tool {
            program: program.into(),
            status: "not started".into(),
            stderr: e.to_string(),
        })?;
    if !o.status.success() {
        let stderr = String::from_utf8_lossy(&o.stderr);
        let tail: String = stderr
            .chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(RootfsError::Tool {
            program: program.into(),
            status: o.status.to_string(),
            stderr: tail,
        });
    }
    Ok(())
}
