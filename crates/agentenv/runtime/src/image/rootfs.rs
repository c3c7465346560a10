//! The default template's userland: a cached `debootstrap --variant=minbase bookworm` tree plus
//! [`PACKAGES`] (apt-get in a chroot), the default user (passwordless sudo) and the guest agent, turned
//! into an ext4 image with `mkfs.ext4 -d` (no mounts). The guest has no network, so every package comes
//! in here, on the host.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use crate::config::{MIRROR, mirror};
/// Debian packages installed on top of minbase (with their dependencies, without Recommends).
pub const PACKAGES: &[&str] = &[
    "python3",
    "python3-pip",
    "python3-venv",
    "python-is-python3",
    "nodejs",
    "npm",
    "git",
    "curl",
    "wget",
    "ca-certificates",
    "procps",
    "iproute2",
    "unzip",
    "jq",
    "build-essential",
    "sudo",
];
/// Cache folder of the tree under the cache dir, keyed by [`recipe_key`]: a changed recipe never
/// reuses an old tree.
pub fn tree_dir() -> String {
    format!("debootstrap-bookworm-{:016x}", recipe_key())
}

/// Hash of this file, which holds the whole recipe (`PACKAGES`, the debootstrap and apt steps, the
/// customization): part of every cache key built from its output.
pub fn recipe_key() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    include_str!("rootfs.rs").hash(&mut h);
    h.finish()
}
/// Deadline for the debootstrap run (downloads and installs of minbase).
const DEBOOTSTRAP_DEADLINE: Duration = Duration::from_secs(20 * 60);
/// Deadline for each `apt-get` step inside the tree.
const APT_DEADLINE: Duration = Duration::from_secs(30 * 60);
/// Deadline for the mirror reachability check.
const PROBE_DEADLINE: Duration = Duration::from_secs(60);
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
    /// The Debian mirror does not answer: the default template cannot be built.
    #[error(
        "Debian mirror {mirror} is unreachable, so the default template cannot be built (the host needs network access to it, or set AGENTENV_DEBIAN_MIRROR to a reachable mirror or proxy): {detail}"
    )]
    Mirror { mirror: String, detail: String },
    /// The userland tree does not fit the template's disk.
    #[error(
        "the userland tree {tree} needs about {need_mib} MiB, more than the {disk_mib} MiB disk"
    )]
    DiskTooSmall {
        tree: PathBuf,
        need_mib: u64,
        disk_mib: u64,
    },
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

/// Finds the guest agent: `explicit`, env `AGENTENV_GUEST_BIN`, else `agentenv-guest` beside the running
/// executable (or one folder up, for `target/*/deps/` test binaries), else `target/{release,debug}/`.
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
            // The running executable's own profile first (`target/debug/deps/x` → `target/debug`), so
            // a stale build of another profile never shadows the fresh one.
            if let Some(dir) = exe.parent() {
                candidates.push(dir.join("agentenv-guest"));
                if let Some(up) = dir.parent() {
                    candidates.push(up.join("agentenv-guest"));
                }
            }
            for dir in exe.ancestors().skip(1).take(4) {
                if dir.file_name().is_some_and(|n| n == "target")
                    || dir.join("CACHEDIR.TAG").exists()
                {
                    candidates.push(dir.join("release/agentenv-guest"));
                    candidates.push(dir.join("debug/agentenv-guest"));
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

/// Builds the tree once into `<cache>/`[`tree_dir`] (reused afterwards): minbase plus [`PACKAGES`], with the
/// package cache and lists removed. Checks first that the mirror answers.
pub fn debootstrap(cache: &Path) -> Result<PathBuf, RootfsError> {
    build_tree(cache, mirror())
}

fn build_tree(cache: &Path, mirror: String) -> Result<PathBuf, RootfsError> {
    let tree_dir = tree_dir();
    let dir = cache.join(&tree_dir);
    // The tree is renamed into place only when complete.
    if dir.join("usr/bin/bash").exists() {
        return Ok(dir);
    }
    let partial = cache.join(format!("{tree_dir}.partial.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(cache).map_err(io("create", cache))?;
    // wget (inside debootstrap) otherwise waits 900 s per stalled read, 20 times.
    let wgetrc = cache.join("debootstrap.wgetrc");
    std::fs::write(&wgetrc, "timeout = 60\ntries = 5\nretry_connrefused = on\n")
        .map_err(io("write", &wgetrc))?;
    let release = format!("{}/dists/bookworm/Release", mirror.trim_end_matches('/'));
    run(
        "wget",
        &["-q", "-T", "20", "-t", "2", "-O", "/dev/null", &release],
        &[],
        PROBE_DEADLINE,
    )
    .map_err(|e| RootfsError::Mirror {
        mirror: mirror.clone(),
        detail: e.to_string(),
    })?;
    let partial_s = partial.display().to_string();
    let r = run(
        "debootstrap",
        &["--variant=minbase", "bookworm", &partial_s, &mirror],
        &[("WGETRC", wgetrc.as_os_str())],
        DEBOOTSTRAP_DEADLINE,
    )
    .and_then(|()| install_packages(&partial));
    if let Err(e) = r {
        // debootstrap mounts these in the target; a failed run can leave them.
        for m in ["proc", "sys"] {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(partial.join(m))
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&partial);
        return Err(match e {
            RootfsError::Tool { stderr, .. }
                if [
                    "Couldn't download",
                    "Failed getting",
                    "Failed to fetch",
                    "Temporary failure resolving",
                    "Could not resolve",
                ]
                .iter()
                .any(|m| stderr.contains(m)) =>
            {
                RootfsError::Mirror {
                    mirror,
                    detail: stderr,
                }
            }
            e => e,
        });
    }
    trim(&partial)?;
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

/// `apt-get install --no-install-recommends PACKAGES` inside the tree (chroot, the host's network and
/// resolv.conf, which debootstrap copied in). debootstrap's own `--include` resolver cannot resolve npm's
/// virtual dependencies, so apt does it.
fn install_packages(tree: &Path) -> Result<(), RootfsError> {
    // No service may start inside the build chroot.
    let policy = tree.join("usr/sbin/policy-rc.d");
    std::fs::write(&policy, "#!/bin/sh\nexit 101\n").map_err(io("write", &policy))?;
    std::fs::set_permissions(&policy, std::fs::Permissions::from_mode(0o755))
        .map_err(io("chmod", &policy))?;
    let t = tree.display().to_string();
    let apt = [
        t.as_str(),
        "apt-get",
        "-q",
        "-o",
        "Acquire::Retries=3",
        "-o",
        "Acquire::http::Timeout=60",
    ];
    let env = [("DEBIAN_FRONTEND", "noninteractive".as_ref())];
    run(
        "chroot",
        &[&apt[..], &["update"]].concat(),
        &env,
        APT_DEADLINE,
    )?;
    let install = [
        &apt[..],
        &["-y", "install", "--no-install-recommends"],
        PACKAGES,
    ]
    .concat();
    run("chroot", &install, &env, APT_DEADLINE)?;
    run(
        "chroot",
        &[&apt[..], &["clean"]].concat(),
        &env,
        APT_DEADLINE,
    )?;
    std::fs::remove_file(&policy).map_err(io("remove", &policy))
}

/// Drops what the guest cannot use (downloaded .debs, package lists: it has no mirror at run time) and
/// lets `pip install` work without `--break-system-packages`, as in E2B's images.
fn trim(tree: &Path) -> Result<(), RootfsError> {
    for d in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        let dir = tree.join(d);
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_file() && p.file_name().is_some_and(|n| n != "lock") {
                std::fs::remove_file(&p).map_err(io("remove", &p))?;
            }
        }
    }
    let lib = tree.join("usr/lib");
    for e in std::fs::read_dir(&lib).map_err(io("read", &lib))?.flatten() {
        let marker = e.path().join("EXTERNALLY-MANAGED");
        if e.file_name().to_string_lossy().starts_with("python3") && marker.exists() {
            std::fs::remove_file(&marker).map_err(io("remove", &marker))?;
        }
    }
    Ok(())
}

/// Bytes allocated by the files under `tree` (symlinks not followed).
pub fn tree_bytes(tree: &Path) -> Result<u64, RootfsError> {
    let mut total = 0;
    let mut stack = vec![tree.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(io("read", &d))? {
            let e = e.map_err(io("read", &d))?;
            let m = e.metadata().map_err(io("stat", &e.path()))?;
            total += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok(total)
}

/// Where the host keeps CA certificates of its own (`update-ca-certificates`' input). Guests trust them
/// too, so HTTPS through an egress proxy the host trusts (a TLS-intercepting one) works in sandboxes.
pub const HOST_CA_DIR: &str = "/usr/local/share/ca-certificates";

/// The host's own CA certificates: the `*.crt` files of [`HOST_CA_DIR`] holding a PEM certificate,
/// sorted by name.
pub fn host_cas() -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<(String, Vec<u8>)> = std::fs::read_dir(HOST_CA_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let pem = std::fs::read(e.path()).ok()?;
            (name.ends_with(".crt") && pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----"))
                .then_some((name, pem))
        })
        .collect();
    all.sort();
    all
}

/// Adds [`host_cas`] to `tree`: the files to its [`HOST_CA_DIR`], the PEMs to its CA bundle, and pip
/// pointed at the bundle (pip in a venv otherwise reads its own). Idempotent.
fn add_host_cas(tree: &Path) -> Result<(), RootfsError> {
    add_cas(tree, &host_cas())
}

fn add_cas(tree: &Path, cas: &[(String, Vec<u8>)]) -> Result<(), RootfsError> {
    let bundle = tree.join("etc/ssl/certs/ca-certificates.crt");
    if cas.is_empty() || !bundle.exists() {
        return Ok(());
    }
    let dir = tree.join(HOST_CA_DIR.trim_start_matches('/'));
    std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    let mut text = std::fs::read(&bundle).map_err(io("read", &bundle))?;
    for (name, pem) in cas {
        let p = dir.join(name);
        std::fs::write(&p, pem).map_err(io("write", &p))?;
        if !text.windows(pem.len()).any(|w| w == pem.as_slice()) {
            if !text.ends_with(b"\n") {
                text.push(b'\n');
            }
            text.extend_from_slice(pem);
        }
    }
    std::fs::write(&bundle, &text).map_err(io("write", &bundle))?;
    let pip = tree.join("etc/pip.conf");
    if !pip.exists() {
        std::fs::write(
            &pip,
            "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n",
        )
        .map_err(io("write", &pip))?;
    }
    Ok(())
}

/// Adds the default user, hostname, the host's own CAs ([`host_cas`]) and the guest agent to `tree`
/// (idempotent).
pub fn customize(tree: &Path, guest_bin: &Path) -> Result<(), RootfsError> {
    add_host_cas(tree)?;
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
    let sudoers = tree.join("etc/sudoers.d/user");
    std::fs::create_dir_all(tree.join("etc/sudoers.d")).map_err(io("create", &sudoers))?;
    std::fs::write(&sudoers, "user ALL=(ALL:ALL) NOPASSWD: ALL\n")
        .map_err(io("write", &sudoers))?;
    std::fs::set_permissions(&sudoers, std::fs::Permissions::from_mode(0o440))
        .map_err(io("chmod", &sudoers))?;
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

/// `mkfs.ext4 -d tree` into a `size_mib` raw image at `out`; refuses a disk the tree does not fit.
pub fn make_ext4(tree: &Path, out: &Path, size_mib: u64) -> Result<(), RootfsError> {
    // Tree plus about 10 % for ext4 metadata and the journal.
    let need_mib = tree_bytes(tree)?.div_ceil(1 << 20) * 11 / 10 + 64;
    if need_mib > size_mib {
        return Err(RootfsError::DiskTooSmall {
            tree: tree.to_owned(),
            need_mib,
            disk_mib: size_mib,
        });
    }
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
    run(program, args, &[], Duration::from_secs(10 * 60))
}

/// Runs `program` to completion within `deadline` (killed after it), keeping the output's tail for errors.
fn run(
    program: &str,
    args: &[&str],
    envs: &[(&str, &std::ffi::OsStr)],
    deadline: Duration,
) -> Result<(), RootfsError> {
    let fail = |status: String, stderr: String| RootfsError::Tool {
        program: program.into(),
        status,
        stderr,
    };
    let mut child = Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| fail("not started".into(), e.to_string()))?;
    let readers = [
        child.stdout.take().map(|r| drain(Box::new(r))),
        child.stderr.take().map(|r| drain(Box::new(r))),
    ];
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if t0.elapsed() > deadline => {
                // SAFETY: signals the process group we created (debootstrap's wget and dpkg too).
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                break Err(format!("killed after {} s", deadline.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(e.to_string()),
        }
    };
    let mut out = String::new();
    for r in readers.into_iter().flatten() {
        out.push_str(&String::from_utf8_lossy(&r.join().unwrap_or_default()));
    }
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(fail(s.to_string(), tail(&out, 2000))),
        Err(why) => Err(fail(why, tail(&out, 2000))),
    }
}

fn drain(mut r: Box<dyn Read + Send>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

fn tail(s: &str, n: usize) -> String {
    let start = s.len().saturating_sub(n);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    s[start..].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_mirror_is_a_typed_error_and_leaves_nothing() {
        let cache = tempfile::tempdir().unwrap();
        // Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
        let err = build_tree(cache.path(), "http://127.0.0.1:9/debian".into()).unwrap_err();
        match &err {
            RootfsError::Mirror { mirror, .. } => assert_eq!(mirror, "http://127.0.0.1:9/debian"),
            e => panic!("expected a mirror error, got {e}"),
        }
        assert!(err.to_string().contains("AGENTENV_DEBIAN_MIRROR"));
        let left: Vec<_> = std::fs::read_dir(cache.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n != "debootstrap.wgetrc")
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn host_cas_join_the_bundle_once_and_pip_reads_it() {
        let tree = tempfile::tempdir().unwrap();
        let certs = tree.path().join("etc/ssl/certs");
        std::fs::create_dir_all(&certs).unwrap();
        std::fs::write(
            certs.join("ca-certificates.crt"),
            b"-----BEGIN CERTIFICATE-----\ndebian\n",
        )
        .unwrap();
        let pem = format!(
            "-----BEGIN CERTIFICATE-----\nk3-{}\n-----END CERTIFICATE-----\n",
            rand::random::<u64>()
        );
        let cas = vec![("proxy.crt".to_string(), pem.clone().into_bytes())];
        add_cas(tree.path(), &cas).unwrap();
        add_cas(tree.path(), &cas).unwrap();
        let bundle = std::fs::read_to_string(certs.join("ca-certificates.crt")).unwrap();
        assert!(bundle.starts_with("-----BEGIN CERTIFICATE-----\ndebian\n"));
        assert_eq!(bundle.matches(&pem).count(), 1);
        let copied = tree
            .path()
            .join("usr/local/share/ca-certificates/proxy.crt");
        assert_eq!(std::fs::read_to_string(copied).unwrap(), pem);
        let pip = std::fs::read_to_string(tree.path().join("etc/pip.conf")).unwrap();
        assert!(pip.contains("cert = /etc/ssl/certs/ca-certificates.crt"));
        // No bundle (an image without ca-certificates): nothing is added.
        let bare = tempfile::tempdir().unwrap();
        add_cas(bare.path(), &cas).unwrap();
        assert!(!bare.path().join("etc/pip.conf").exists());
    }

    #[test]
    fn a_tree_larger_than_the_disk_is_refused() {
        let tree = tempfile::tempdir().unwrap();
        let mut data = vec![0u8; 48 << 20];
        // Incompressible, fully allocated content.
        let mut x = std::process::id() as u64 | 1;
        for b in data.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        std::fs::write(tree.path().join("blob"), &data).unwrap();
        let bytes = tree_bytes(tree.path()).unwrap();
        assert!(bytes >= 48 << 20, "{bytes}");
        let img = tempfile::tempdir().unwrap();
        let out = img.path().join("root.ext4");
        match make_ext4(tree.path(), &out, 64) {
            Err(RootfsError::DiskTooSmall {
                need_mib, disk_mib, ..
            }) => {
                assert!(need_mib > 64 && disk_mib == 64, "{need_mib}")
            }
            r => panic!("expected DiskTooSmall, got {r:?}"),
        }
        assert!(!out.exists());
    }
}
