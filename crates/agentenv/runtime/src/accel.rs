//! Accelerator choice: KVM only where a probe guest really boots under it (a PVM-only host opens
//! /dev/kvm but hangs a standard kernel), TCG otherwise. The verdict is cached per host and guest kernel.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{Accel, AccelKind, RuntimeConfig};
use crate::kernel::GuestKernel;

/// How long the probe guest may take to print its marker under KVM.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Serialize, Deserialize)]
struct Verdict {
    host_kernel: String,
    guest_kernel: String,
    kvm_boots: bool,
    detail: String,
}

/// Resolves `cfg.accel` to the accelerator to use.
pub async fn choose(cfg: &RuntimeConfig, kernel: &GuestKernel, cache: &Path) -> AccelKind {
    match cfg.accel {
        Accel::Tcg => AccelKind::Tcg,
        Accel::Kvm => AccelKind::Kvm,
        Accel::Auto => {
            if std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/kvm")
                .is_err()
            {
                return AccelKind::Tcg;
            }
            let host = std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_owned();
            let path = cache.join(format!("kvm-probe-{host}-{}.json", kernel.release));
            if let Ok(v) = std::fs::read(&path)
                .map_err(|_| ())
                .and_then(|b| serde_json::from_slice::<Verdict>(&b).map_err(|_| ()))
            {
                return if v.kvm_boots {
                    AccelKind::Kvm
                } else {
                    AccelKind::Tcg
                };
            }
            let (kvm_boots, detail) = probe_kvm(&cfg.qemu_bin, kernel).await;
            tracing::info!(kvm_boots, %detail, "KVM probe");
            let v = Verdict {
                host_kernel: host,
                guest_kernel: kernel.release.clone(),
                kvm_boots,
                detail,
            };
            if let Ok(bytes) = serde_json::to_vec_pretty(&v) {
                let _ = k3_common::fsutil::write_atomic(&path, &bytes);
            }
            if kvm_boots {
                AccelKind::Kvm
            } else {
                AccelKind::Tcg
            }
        }
    }
}

/// Boots the probe initramfs under `-accel kvm`; true when the marker appears within [`PROBE_TIMEOUT`].
pub async fn probe_kvm(qemu: &Path, kernel: &GuestKernel) -> (bool, String) {
    let (qemu, vmlinux, initrd) = (
        qemu.to_path_buf(),
        kernel.vmlinux.clone(),
        kernel.probe_initrd.clone(),
    );
    let probe = tokio::task::spawn_blocking(move || {
        let guest = k3_common::kvm::ProbeGuest {
            qemu: &qemu,
            kernel: &vmlinux,
            initrd: &initrd,
            microvm: true,
        };
        k3_common::kvm::boot_probe(&guest, k3_common::kvm::Accel::Kvm, PROBE_TIMEOUT)
    })
    .await;
    match probe {
        Ok(Ok(t)) => (
            true,
            format!("probe guest booted under KVM in {} ms", t.as_millis()),
        ),
        Ok(Err(e)) => (false, e.to_string()),
        Err(e) => (false, format!("probe task failed: {e}")),
    }
}
