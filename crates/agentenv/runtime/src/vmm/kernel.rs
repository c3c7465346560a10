//! Guest kernel and initramfs: Debian's kernel as an uncompressed PVH vmlinux plus a busybox initramfs
//! that loads the virtio and ext4 modules, mounts the root disk and switch_roots into the guest agent.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use k3_common::cpio::CpioWriter;

/// Modules loaded by the initramfs, in load order (`virtio_ring` before `virtio`).
pub const MODULES: [&str; 15] = [
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_console",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "crc32c_generic",
    "crc16",
    "mbcache",
    "jbd2",
    "ext4",
    // Volume mounts (the guest agent's FUSE file system).
    "fuse",
    // Free page reporting (virtio-balloon).
    "virtio_balloon",
];

/// What the guest init becomes after switch_root.
pub const GUEST_INIT: &str = "/usr/local/bin/agentenv-guest";

/// Errors while preparing the guest kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No Debian 6.1 kernel found on the host and `apt-get download` failed.
    #[error("no Debian kernel: {0}")]
    NotFound(String),
    /// A helper program failed.
    #[error("{program} failed: {detail}")]
    Tool { program: String, detail: String },
    /// A kernel module is missing from the modules tree.
    #[error("module {name} not found under {dir}")]
    Module { name: String, dir: PathBuf },
    /// The xz payload did not decompress to an ELF vmlinux.
    #[error("vmlinux extraction from {0} failed: {1}")]
    Extract(PathBuf, String),
    /// File i/o.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> KernelError + 'a {
    move |source| KernelError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// The prepared kernel artefacts in the cache.
#[derive(Debug, Clone)]
pub struct GuestKernel {
    /// Kernel release, e.g. `6.1.0-57-amd64`.
    pub release: String,
    /// Uncompressed ELF kernel (PVH boot).
    pub vmlinux: PathBuf,
    /// Initramfs that boots the root disk into the guest agent.
    pub initrd: PathBuf,
    /// Initramfs that prints k3-common's probe marker and powers off (accelerator probe).
    pub probe_initrd: PathBuf,
}

/// The kernel command line (PVH boot, fast serial, `tsc_early_khz` against TCG calibration hangs).
/// Env `AGENTENV_GUEST_RUST_LOG` (for diagnosis) becomes the guest agent's `RUST_LOG`.
pub fn cmdline() -> String {
    let log = std::env::var("AGENTENV_GUEST_RUST_LOG")
        .map(|v| format!(" RUST_LOG={v}"))
        .unwrap_or_default();
    k3_common::kvm::fast_boot_cmdline() + &log
}

fn initrd_key() -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (MODULES, boot_script()).hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Finds Debian's kernel (host `/boot` + `/lib/modules`, else `apt-get download` + `dpkg -x`) and builds
/// vmlinux and both initramfs images under `cache` (reused when present).
pub fn prepare(cache: &Path) -> Result<GuestKernel, KernelError> {
    let (vmlinuz, modules_dir, release) = find_kernel(cache)?;
    let dir = cache.join(format!("kernel-{release}"));
    let k = GuestKernel {
        release: release.clone(),
        vmlinux: dir.join("vmlinux"),
        // Named by its content (modules, boot script): a changed list builds a new one.
        initrd: dir.join(format!("initrd-{}.cpio", initrd_key())),
        probe_initrd: dir.join("probe-k3.cpio"),
    };
    if k.vmlinux.exists() && k.initrd.exists() && k.probe_initrd.exists() {
        return Ok(k);
    }
    std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    let vmlinux = extract_vmlinux(&vmlinuz)?;
    let busybox = std::fs::read("/bin/busybox").map_err(io("read", Path::new("/bin/busybox")))?;
    let mut modules = Vec::new();
    for name in MODULES {
        modules.push((name, read_module(&modules_dir, name)?));
    }
    let initrd = build_initrd(&busybox, &modules, &boot_script())?;
    let probe = k3_common::kvm::probe_initramfs(Path::new("/bin/busybox")).map_err(|e| {
        KernelError::Tool {
            program: "probe initramfs".into(),
            detail: e.to_string(),
        }
    })?;
    k3_common::fsutil::write_atomic(&k.initrd, &initrd).map_err(io("write", &k.initrd))?;
    k3_common::fsutil::write_atomic(&k.probe_initrd, &probe)
        .map_err(io("write", &k.probe_initrd))?;
    k3_common::fsutil::write_atomic(&k.vmlinux, &vmlinux).map_err(io("write", &k.vmlinux))?;
    Ok(k)
}

fn find_kernel(cache: &Path) -> Result<(PathBuf, PathBuf, String), KernelError> {
    for root in [PathBuf::from("/"), cache.join("linux-image")] {
        let boot = root.join("boot");
        let Ok(rd) = std::fs::read_dir(&boot) else {
            continue;
        };
        let mut found: Vec<String> = rd
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter_map(|n| n.strip_prefix("vmlinuz-").map(str::to_owned))
            .filter(|r| r.starts_with("6.1.0-") && r.ends_with("-amd64"))
            .filter(|r| root.join("lib/modules").join(r).join("kernel").is_dir())
            .collect();
        found.sort_by_key(|r| {
            r.split('-')
                .nth(2)
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(0)
        });
        if let Some(r) = found.pop() {
            return Ok((
                boot.join(format!("vmlinuz-{r}")),
                root.join("lib/modules").join(&r),
                r,
            ));
        }
    }
    download_kernel(cache)?;
    let root = cache.join("linux-image");
    let boot = root.join("boot");
    let r = std::fs::read_dir(&boot)
        .map_err(io("read", &boot))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find_map(|n| n.strip_prefix("vmlinuz-").map(str::to_owned))
        .ok_or_else(|| KernelError::NotFound(format!("no vmlinuz in {}", boot.display())))?;
    Ok((
        boot.join(format!("vmlinuz-{r}")),
        root.join("lib/modules").join(&r),
        r,
    ))
}

/// `apt-get download linux-image-6.1.0-N-amd64` (newest N) and `dpkg -x` into `<cache>/linux-image`.
fn download_kernel(cache: &Path) -> Result<(), KernelError> {
    let out = run(
        "apt-cache",
        &[
            "search",
            "--names-only",
            "^linux-image-6\\.1\\.0-[0-9]+-amd64$",
        ],
        None,
    )?;
    let mut names: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    names.sort_by_key(|n| {
        n.split('-')
            .nth(4)
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    let pkg = names.last().ok_or_else(|| {
        KernelError::NotFound("apt-cache knows no linux-image-6.1.0-*-amd64".into())
    })?;
    let dl = cache.join("linux-image-deb");
    std::fs::create_dir_all(&dl).map_err(io("create", &dl))?;
    run("apt-get", &["download", pkg], Some(&dl))?;
    let deb = std::fs::read_dir(&dl)
        .map_err(io("read", &dl))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| KernelError::NotFound(format!("apt-get download {pkg} left no .deb")))?;
    let root = cache.join("linux-image");
    run(
        "dpkg",
        &[
            "-x",
            &deb.display().to_string(),
            &root.display().to_string(),
        ],
        None,
    )?;
    Ok(())
}

fn run(program: &str, args: &[&str], cwd: Option<&Path>) -> Result<String, KernelError> {
    let mut c = Command::new(program);
    c.args(args);
    if let Some(d) = cwd {
        c.current_dir(d);
    }
    let o = c.output().map_err(|e| KernelError::Tool {
        program: program.into(),
        detail: e.to_string(),
    })?;
    if !o.status.success() {
        return Err(KernelError::Tool {
            program: format!("{program} {}", args.join(" ")),
            detail: String::from_utf8_lossy(&o.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// Decompresses the xz payload of a bzImage into the ELF vmlinux.
fn extract_vmlinux(vmlinuz: &Path) -> Result<Vec<u8>, KernelError> {
    let data = std::fs::read(vmlinuz).map_err(io("read", vmlinuz))?;
    let magic = b"\xfd7zXZ\x00";
    let at = data
        .windows(magic.len())
        .position(|w| w == magic)
        .ok_or_else(|| KernelError::Extract(vmlinuz.to_owned(), "no xz payload".into()))?;
    let out = xz_decompress(&data[at..])?;
    if !out.starts_with(b"\x7fELF") {
        return Err(KernelError::Extract(
            vmlinuz.to_owned(),
            "payload is not an ELF file".into(),
        ));
    }
    Ok(out)
}

fn xz_decompress(input: &[u8]) -> Result<Vec<u8>, KernelError> {
    let mut child = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| KernelError::Tool {
            program: "xz".into(),
            detail: e.to_string(),
        })?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let owned = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&owned));
    let o = child.wait_with_output().map_err(|e| KernelError::Tool {
        program: "xz".into(),
        detail: e.to_string(),
    })?;
    let _ = writer.join();
    if o.stdout.is_empty() {
        return Err(KernelError::Tool {
            program: "xz".into(),
            detail: String::from_utf8_lossy(&o.stderr).into(),
        });
    }
    Ok(o.stdout)
}

fn read_module(dir: &Path, name: &str) -> Result<Vec<u8>, KernelError> {
    let found =
        find_file(dir, &[format!("{name}.ko"), format!("{name}.ko.xz")]).ok_or_else(|| {
            KernelError::Module {
                name: name.into(),
                dir: dir.to_owned(),
            }
        })?;
    let data = std::fs::read(&found).map_err(io("read", &found))?;
    if found.extension().is_some_and(|e| e == "xz") {
        xz_decompress(&data)
    } else {
        Ok(data)
    }
}

fn find_file(dir: &Path, names: &[String]) -> Option<PathBuf> {
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).ok()?.flatten() {
            let p = e.path();
            let ft = e.file_type().ok()?;
            if ft.is_dir() {
                stack.push(p);
            } else if names
                .iter()
                .any(|n| e.file_name().to_str() == Some(n.as_str()))
            {
                return Some(p);
            }
        }
    }
    None
}

fn build_initrd(
    busybox: &[u8],
    modules: &[(&str, Vec<u8>)],
    init: &str,
) -> Result<Vec<u8>, KernelError> {
    let mut w = CpioWriter::new();
    for d in ["bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"] {
        w.dir(d, 0o755);
    }
    w.char_dev("dev/console", 0o600, 5, 1);
    w.char_dev("dev/null", 0o666, 1, 3);
    w.file("bin/busybox", 0o755, busybox);
    w.symlink("bin/sh", "busybox");
    for (name, data) in modules {
        w.file(&format!("lib/modules/{name}.ko"), 0o644, data);
    }
    w.file("init", 0o755, init.as_bytes());
    Ok(w.finish())
}

fn boot_script() -> String {
    format!(
        r#"#!/bin/busybox sh
B=/bin/busybox
$B mount -t devtmpfs dev /dev
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
for m in {modules}; do $B insmod /lib/modules/$m.ko || echo "agentenv-initramfs: insmod $m failed"; done
i=0
while [ ! -b /dev/vda ]; do
  i=$((i+1)); if [ $i -gt 5000 ]; then echo "agentenv-initramfs: no /dev/vda"; $B poweroff -f; fi
  $B usleep 1000
done
$B mount -t ext4 -o rw,noatime /dev/vda /newroot || {{ echo "agentenv-initramfs: mount failed"; $B poweroff -f; }}
$B mkdir -p /dev/virtio-ports
i=0
while :; do
  n=""
  for d in /sys/class/virtio-ports/vport*; do
    [ -e "$d/name" ] || continue
    n=$($B cat "$d/name")
    [ -n "$n" ] && $B ln -sf "../$($B basename "$d")" "/dev/virtio-ports/$n"
  done
  [ -n "$n" ] && break
  i=$((i+1)); if [ $i -gt 5000 ]; then echo "agentenv-initramfs: no virtio port"; break; fi
  $B usleep 1000
done
$B umount /sys
$B umount /proc
$B umount /dev
echo "agentenv-initramfs: switch_root"
exec $B switch_root /newroot {init} init
echo "agentenv-initramfs: switch_root failed"
$B poweroff -f
"#,
        modules = MODULES.join(" "),
        init = GUEST_INIT
    )
}
