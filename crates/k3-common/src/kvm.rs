//! Whether this machine can run microVMs under KVM, or only under QEMU's TCG emulator.
//!
//! Opening `/dev/kvm` is not enough: a PVM-only host (our dev and CI machines) opens it and creates VMs, but a
//! standard guest kernel hangs there. So [`check`] boots a probe guest (the host's Debian kernel plus a busybox
//! initramfs that prints a marker and powers off) under KVM, and under TCG as the fallback.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cpio::CpioWriter;

const MARKER: &str = "K3-PROBE-OK";
/// The QEMU binary of the host-level probe.
pub const QEMU: &str = "qemu-system-x86_64";
/// Kernel command line that boots fast under TCG: PVH-friendly, a fast serial console, and
/// `tsc_early_khz` set to the host's TSC, because TSC calibration can hang under TCG without it.
pub fn fast_boot_cmdline() -> String {
    format!(
        "console=ttyS0,115200 panic=-1 quiet edd=off i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd \
         noreplace-smp tsc=reliable tsc_early_khz={} no_timer_check cryptomgr.notests rcupdate.rcu_expedited=1 \
         mitigations=off random.trust_cpu=on audit=0 nowatchdog",
        host_tsc_khz()
    )
}

fn host_tsc_khz() -> u64 {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find(|l| l.starts_with("cpu MHz"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(2_000_000, |mhz| (mhz * 1000.0) as u64)
}

/// What to boot for a probe: the QEMU binary, a kernel, and an initramfs from [`probe_initramfs`].
#[derive(Debug, Clone, Copy)]
pub struct ProbeGuest<'a> {
    pub qemu: &'a Path,
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    /// `-M microvm` (needs a PVH vmlinux or a bzImage) instead of QEMU's default machine.
    pub microvm: bool,
}

/// Accelerator for QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    /// Lowercase name, as in QEMU's `-accel` option.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            _ => Err(format!("unknown accelerator `{s}` (expected kvm or tcg)")),
        }
    }
}

/// The verdict for the `kvm` tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum KvmVerdict {
    /// A standard guest booted under KVM.
    Kvm { boot_ms: u64 },
    /// KVM cannot boot a standard guest; TCG can. `pvm` marks a PVM-only host.
    TcgOnly {
        pvm: bool,
        reason: String,
        tcg_boot_ms: Option<u64>,
    },
    /// No guest could be booted at all (no QEMU, no kernel, ...).
    None { reason: String },
}

impl KvmVerdict {
    pub fn kvm_usable(&self) -> bool {
        matches!(self, KvmVerdict::Kvm { .. })
    }

    /// The accelerator microVMs should use.
    pub fn accel(&self) -> Option<Accel> {
        match self {
            KvmVerdict::Kvm { .. } => Some(Accel::Kvm),
            KvmVerdict::TcgOnly {
                tcg_boot_ms: Some(_),
                ..
            } => Some(Accel::Tcg),
            _ => None,
        }
    }
}

/// Errors of the individual probe steps.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("/dev/kvm: {0}")]
    DevKvm(std::io::Error),
    #[error("KVM_GET_API_VERSION returned {0}")]
    ApiVersion(i32),
    #[error("no guest kernel found (set K3_GUEST_KERNEL, or install linux-image-amd64)")]
    NoKernel,
    #[error("no static busybox at {0} (install busybox-static)")]
    NoBusybox(PathBuf),
    #[error("cannot start {qemu}: {source}")]
    Spawn {
        qemu: String,
        source: std::io::Error,
    },
    #[error("the probe guest printed no marker within {0:?}")]
    Timeout(Duration),
    #[error("the probe guest exited without the marker: {0}")]
    NoMarker(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Opens `/dev/kvm` and returns the KVM API version (12 on every current kernel).
pub fn open_dev_kvm() -> Result<i32, ProbeError> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(ProbeError::DevKvm)?;
    const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
    // SAFETY: ioctl without arguments on an open fd.
    let v = unsafe { libc::ioctl(f.as_raw_fd(), KVM_GET_API_VERSION as _, 0) };
    if v == 12 {
        Ok(v)
    } else {
        Err(ProbeError::ApiVersion(v))
    }
}

/// True when the host kernel's KVM is the PVM flavour (module `kvm_pvm` loaded).
pub fn is_pvm_host() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

/// A guest kernel to boot: `$K3_GUEST_KERNEL`, else the newest `/boot/vmlinuz-*`.
pub fn find_guest_kernel() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("K3_GUEST_KERNEL") {
        return Some(PathBuf::from(p));
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/boot")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .collect();
    found.sort();
    found.pop()
}

/// An initramfs whose `/init` prints the probe marker and powers the guest off.
pub fn probe_initramfs(busybox: &Path) -> Result<Vec<u8>, ProbeError> {
    let bb = std::fs::read(busybox).map_err(|_| ProbeError::NoBusybox(busybox.to_path_buf()))?;
    let mut w = CpioWriter::new();
    w.dir("bin", 0o755);
    w.file("bin/busybox", 0o755, &bb);
    w.symlink("bin/sh", "busybox");
    let init = format!("#!/bin/sh\n/bin/busybox echo {MARKER}\n/bin/busybox poweroff -f\n");
    w.file("init", 0o755, init.as_bytes());
    Ok(w.finish())
}

/// Boots the probe guest with `accel` and returns the time until the marker appeared.
pub fn boot_probe(
    guest: &ProbeGuest<'_>,
    accel: Accel,
    timeout: Duration,
) -> Result<Duration, ProbeError> {
    let start = Instant::now();
    let mut cmd = Command::new(guest.qemu);
    if guest.microvm {
        cmd.args(["-M", "microvm"]);
    }
    let mut child = cmd
        .args([
            "-accel",
            accel.as_str(),
            "-m",
            "128",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
        ])
        .args(["-no-reboot", "-serial", "stdio", "-kernel"])
        .arg(guest.kernel)
        .arg("-initrd")
        .arg(guest.initrd)
        .arg("-append")
        .arg(fast_boot_cmdline())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ProbeError::Spawn {
            qemu: guest.qemu.display().to_string(),
            source,
        })?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&seen).contains(MARKER) {
                let _ = tx.send(Ok(start.elapsed()));
                return;
            }
        }
        let tail = String::from_utf8_lossy(&seen[seen.len().saturating_sub(300)..]).into_owned();
        let _ = tx.send(Err(tail));
    });
    let result = rx.recv_timeout(timeout);
    let _ = child.kill();
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    let _ = child.wait();
    match result {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(tail)) => Err(ProbeError::NoMarker(format!(
            "{} {}",
            tail.trim(),
            stderr.trim()
        ))),
        Err(_) => Err(ProbeError::Timeout(timeout)),
    }
}

/// Full check: open `/dev/kvm`, boot under KVM, fall back to a TCG boot. Takes up to `kvm_timeout` + ~5 s.
pub fn check(kvm_timeout: Duration) -> KvmVerdict {
    let kernel = match find_guest_kernel() {
        Some(k) => k,
        None => {
            return KvmVerdict::None {
                reason: ProbeError::NoKernel.to_string(),
            };
        }
    };
    let dir = match tempfile_dir() {
        Ok(d) => d,
        Err(e) => {
            return KvmVerdict::None {
                reason: e.to_string(),
            };
        }
    };
    let initrd = dir.join("probe.cpio");
    let written =
        probe_initramfs(Path::new("/bin/busybox")).and_then(|b| Ok(std::fs::write(&initrd, b)?));
    if let Err(e) = written {
        return KvmVerdict::None {
            reason: e.to_string(),
        };
    }
    let guest = ProbeGuest {
        qemu: Path::new(QEMU),
        kernel: &kernel,
        initrd: &initrd,
        microvm: false,
    };
    let kvm_failure = match open_dev_kvm() {
        Err(e) => e.to_string(),
        Ok(_) => match boot_probe(&guest, Accel::Kvm, kvm_timeout) {
            Ok(t) => {
                let _ = std::fs::remove_dir_all(&dir);
                return KvmVerdict::Kvm {
                    boot_ms: t.as_millis() as u64,
                };
            }
            Err(e) => {
                format!("/dev/kvm opens, but a standard guest kernel does not boot under KVM ({e})")
            }
        },
    };
    let tcg = boot_probe(&guest, Accel::Tcg, Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&dir);
    match tcg {
        Ok(t) => KvmVerdict::TcgOnly {
            pvm: is_pvm_host(),
            reason: kvm_failure,
            tcg_boot_ms: Some(t.as_millis() as u64),
        },
        Err(e) => KvmVerdict::None {
            reason: format!("{kvm_failure}; TCG boot failed too: {e}"),
        },
    }
}

fn tempfile_dir() -> std::io::Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("k3-kvm-probe-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// Cached [`KvmVerdict`]s, one per key, in one JSON file (default: `<cache_dir>/kvm-verdict.json`).
///
/// A probe boot takes seconds (up to the KVM timeout on a PVM host), so every caller keeps the verdict
/// and probes again only when its key changes: [`VerdictCache::key`] covers the host kernel, the QEMU
/// version and the guest kernel file. `None` verdicts (no QEMU, no kernel) are never stored: they
/// are fixed by installing something, not by a reboot.
#[derive(Debug, Clone)]
pub struct VerdictCache {
    path: PathBuf,
}

impl Default for VerdictCache {
    fn default() -> Self {
        VerdictCache::new(crate::fsutil::cache_dir().join("kvm-verdict.json"))
    }
}

impl VerdictCache {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        VerdictCache { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key of a verdict for booting `guest_kernel` with `qemu` on this host kernel.
    pub fn key(qemu: &Path, guest_kernel: &Path) -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let qemu_version = Command::new(qemu)
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        let kernel = std::fs::metadata(guest_kernel).map_or(String::new(), |m| {
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs());
            format!("{} {} {mtime}", guest_kernel.display(), m.len())
        });
        format!("{}|{}|{kernel}", host.trim(), qemu_version.trim())
    }

    fn load(&self) -> std::collections::BTreeMap<String, KvmVerdict> {
        std::fs::read(&self.path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// The stored verdict for `key`, if any.
    pub fn get(&self, key: &str) -> Option<KvmVerdict> {
        self.load().remove(key)
    }

    /// Stores `verdict` under `key` (atomic write); `None` verdicts are not stored.
    pub fn put(&self, key: &str, verdict: &KvmVerdict) -> std::io::Result<()> {
        if matches!(verdict, KvmVerdict::None { .. }) {
            return Ok(());
        }
        let mut all = self.load();
        all.insert(key.to_string(), verdict.clone());
        let bytes = serde_json::to_vec_pretty(&all).map_err(std::io::Error::other)?;
        crate::fsutil::write_atomic(&self.path, &bytes)
    }

    /// The stored verdict for `key`, else `probe()` stored and returned; `recheck` skips the lookup.
    pub fn get_or_probe(
        &self,
        key: &str,
        recheck: bool,
        probe: impl FnOnce() -> KvmVerdict,
    ) -> KvmVerdict {
        if !recheck && let Some(v) = self.get(key) {
            return v;
        }
        let v = probe();
        if let Err(e) = self.put(key, &v) {
            tracing::warn!(path = %self.path.display(), "cannot cache the KVM verdict: {e}");
        }
        v
    }
}

/// [`check`] through the default [`VerdictCache`], keyed by the host-level probe's QEMU and kernel.
pub fn cached_check(recheck: bool, kvm_timeout: Duration) -> KvmVerdict {
    let kernel = find_guest_kernel().unwrap_or_default();
    let key = VerdictCache::key(Path::new(QEMU), &kernel);
    VerdictCache::default().get_or_probe(&key, recheck, || check(kvm_timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcg_boots_the_probe_guest_when_qemu_and_a_kernel_exist() {
        let Some(kernel) = find_guest_kernel() else {
            crate::require::skip_or_fail(
                crate::Tier::Cpu,
                "no guest kernel (install linux-image-amd64)",
            );
            return;
        };
        if Command::new(QEMU).arg("--version").output().is_err() {
            crate::require::skip_or_fail(crate::Tier::Cpu, "qemu-system-x86_64 is not installed");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let initrd = dir.path().join("p.cpio");
        std::fs::write(&initrd, probe_initramfs(Path::new("/bin/busybox")).unwrap()).unwrap();
        let guest = ProbeGuest {
            qemu: Path::new(QEMU),
            kernel: &kernel,
            initrd: &initrd,
            microvm: false,
        };
        let t = boot_probe(&guest, Accel::Tcg, Duration::from_secs(90)).unwrap();
        println!("TCG probe boot: {t:?}");
    }

    /// The kvm tier: a standard guest boots under KVM (fails under `K3_REQUIRE_KVM=1` where it cannot).
    #[test]
    fn kvm_boots_the_probe_guest() {
        if let Err(e) = open_dev_kvm() {
            crate::require::skip_or_fail(crate::Tier::Kvm, e);
            return;
        }
        if is_pvm_host() {
            crate::require::skip_or_fail(
                crate::Tier::Kvm,
                "PVM-only host: standard guest kernels do not boot under its KVM",
            );
            return;
        }
        let Some(kernel) = find_guest_kernel() else {
            crate::require::skip_or_fail(crate::Tier::Kvm, ProbeError::NoKernel);
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let initrd = dir.path().join("p.cpio");
        std::fs::write(&initrd, probe_initramfs(Path::new("/bin/busybox")).unwrap()).unwrap();
        let guest = ProbeGuest {
            qemu: Path::new(QEMU),
            kernel: &kernel,
            initrd: &initrd,
            microvm: false,
        };
        match boot_probe(&guest, Accel::Kvm, Duration::from_secs(30)) {
            Ok(t) => println!("KVM probe boot: {t:?}"),
            Err(e) => crate::require::skip_or_fail(crate::Tier::Kvm, e),
        }
    }

    #[test]
    fn verdict_cache_keeps_one_verdict_per_key_and_never_a_none() {
        let dir = tempfile::tempdir().unwrap();
        let cache = VerdictCache::new(dir.path().join("sub/v.json"));
        let kvm = KvmVerdict::Kvm { boot_ms: 41 };
        let tcg = KvmVerdict::TcgOnly {
            pvm: true,
            reason: "no marker".into(),
            tcg_boot_ms: Some(900),
        };
        assert_eq!(cache.get("a"), None);
        cache.put("a", &kvm).unwrap();
        cache.put("b", &tcg).unwrap();
        cache
            .put(
                "c",
                &KvmVerdict::None {
                    reason: "no qemu".into(),
                },
            )
            .unwrap();
        assert_eq!(cache.get("a"), Some(kvm.clone()));
        assert_eq!(cache.get("b"), Some(tcg.clone()));
        assert_eq!(cache.get("c"), None);
        let mut probes = 0;
        let v = cache.get_or_probe("a", false, || {
            probes += 1;
            tcg.clone()
        });
        assert_eq!((v, probes), (kvm, 0), "a cached key is not probed again");
        let v = cache.get_or_probe("a", true, || {
            probes += 1;
            tcg.clone()
        });
        assert_eq!((v, probes), (tcg.clone(), 1), "recheck probes and replaces");
        assert_eq!(cache.get("a"), Some(tcg));
        std::fs::write(cache.path(), "{garbage").unwrap();
        assert_eq!(
            cache.get("a"),
            None,
            "a torn or foreign file reads as empty"
        );
    }

    #[test]
    fn verdict_key_changes_with_the_guest_kernel_file() {
        let dir = tempfile::tempdir().unwrap();
        let k = dir.path().join("vmlinux");
        std::fs::write(&k, b"one").unwrap();
        let a = VerdictCache::key(Path::new("/nonexistent/qemu"), &k);
        std::fs::write(&k, b"longer").unwrap();
        let b = VerdictCache::key(Path::new("/nonexistent/qemu"), &k);
        assert_ne!(a, b);
        assert!(a.contains("vmlinux"), "{a}");
    }

    #[test]
    fn accel_names_round_trip() {
        for a in [Accel::Kvm, Accel::Tcg] {
            assert_eq!(a.to_string().parse::<Accel>(), Ok(a));
        }
        assert!("hvf".parse::<Accel>().is_err());
    }

    #[test]
    fn missing_busybox_is_a_typed_error() {
        let err = probe_initramfs(Path::new("/nonexistent/busybox")).unwrap_err();
        assert!(matches!(err, ProbeError::NoBusybox(_)), "{err}");
    }
}
