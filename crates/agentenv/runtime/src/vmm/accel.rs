//! Accelerator choice: KVM only where a probe guest really boots under it (a PVM-only host opens
//! /dev/kvm but hangs a standard kernel), TCG otherwise. The verdict lives in k3-common's
//! [`VerdictCache`], keyed by host kernel, QEMU version and guest kernel file.

use std::path::Path;
use std::time::Duration;

use k3_common::kvm::{KvmVerdict, VerdictCache};

use crate::config::{Accel, AccelKind, RuntimeConfig};
use crate::vmm::kernel::GuestKernel;

/// How long the probe guest may take to print its marker under KVM.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The verdict cache of the runtime: `kvm-verdict.json` in `cache`.
pub fn verdict_cache(cache: &Path) -> VerdictCache {
    VerdictCache::new(cache.join("kvm-verdict.json"))
}

/// Resolves `cfg.accel` to the accelerator to use.
pub async fn choose(cfg: &RuntimeConfig, kernel: &GuestKernel, cache: &Path) -> AccelKind {
    match cfg.accel {
        Accel::Tcg => AccelKind::Tcg,
        Accel::Kvm => AccelKind::Kvm,
        Accel::Auto => {
            if k3_common::kvm::open_dev_kvm().is_err() {
                return AccelKind::Tcg;
            }
            let verdicts = verdict_cache(cache);
            let key = VerdictCache::key(&cfg.qemu_bin, &kernel.vmlinux);
            let verdict = match verdicts.get(&key) {
                Some(v) => v,
                None => {
                    let v = probe_kvm(&cfg.qemu_bin, kernel).await;
                    tracing::info!(?v, "KVM probe");
                    if let Err(e) = verdicts.put(&key, &v) {
                        tracing::warn!(path = %verdicts.path().display(), "cannot cache the KVM verdict: {e}");
                    }
                    v
                }
            };
            if verdict.kvm_usable() {
                AccelKind::Kvm
            } else {
                AccelKind::Tcg
            }
        }
    }
}

/// Boots the probe initramfs under `-accel kvm` within [`PROBE_TIMEOUT`]. A failure is a
/// [`KvmVerdict::TcgOnly`] without a TCG boot time (the runtime does not probe TCG).
pub async fn probe_kvm(qemu: &Path, kernel: &GuestKernel) -> KvmVerdict {
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
    let reason = match probe {
        Ok(Ok(t)) => {
            return KvmVerdict::Kvm {
                boot_ms: t.as_millis() as u64,
            };
        }
        Ok(Err(e)) => e.to_string(),
        Err(e) => format!("probe task failed: {e}"),
    };
    KvmVerdict::TcgOnly {
        pvm: k3_common::kvm::is_pvm_host(),
        reason,
        tcg_boot_ms: None,
    }
}

/// QEMU's `-accel` value for `accel`: under TCG with `tcg_tb_mib`, the translation cache capped at that
/// many MiB ([`RuntimeConfig::tcg_tb_mib`]); KVM has no translation cache and ignores it.
pub fn qemu_arg(accel: AccelKind, tcg_tb_mib: Option<u32>) -> String {
    match (accel, tcg_tb_mib) {
        (AccelKind::Tcg, Some(mib)) => format!("tcg,tb-size={mib}"),
        _ => accel.as_str().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use k3_common::Tier;
    use k3_common::require::skip_or_fail;

    use super::*;

    #[test]
    fn the_tb_size_goes_to_tcg_only() {
        assert_eq!(qemu_arg(AccelKind::Tcg, None), "tcg");
        assert_eq!(qemu_arg(AccelKind::Tcg, Some(16)), "tcg,tb-size=16");
        assert_eq!(qemu_arg(AccelKind::Kvm, Some(16)), "kvm");
        assert_eq!(qemu_arg(AccelKind::Kvm, None), "kvm");
    }

    /// Auto resolves through the verdict cache: the first choice probes and stores the verdict under
    /// the key of this QEMU and guest kernel, the second reads it back. Under TCG the kvm tier skips
    /// (fails under `K3_REQUIRE_KVM=1`).
    #[tokio::test(flavor = "multi_thread")]
    async fn kvm_auto_picks_kvm_through_the_verdict_cache() {
        let shared = k3_common::fsutil::cache_dir().join("agentenv");
        let kernel = match tokio::task::spawn_blocking(move || crate::vmm::kernel::prepare(&shared))
            .await
            .expect("prepare task")
        {
            Ok(k) => k,
            Err(e) => {
                skip_or_fail(Tier::Kvm, format!("no guest kernel: {e}"));
                return;
            }
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = RuntimeConfig::new(dir.path());
        let first = choose(&cfg, &kernel, dir.path()).await;
        let key = VerdictCache::key(&cfg.qemu_bin, &kernel.vmlinux);
        let stored = verdict_cache(dir.path()).get(&key);
        match &stored {
            Some(v) => assert_eq!(v.kvm_usable(), first == AccelKind::Kvm, "{v:?}"),
            None => assert!(
                k3_common::kvm::open_dev_kvm().is_err() && first == AccelKind::Tcg,
                "/dev/kvm opens but no verdict was cached"
            ),
        }
        assert_eq!(choose(&cfg, &kernel, dir.path()).await, first);
        if stored.is_some() {
            // A stored verdict decides without a new probe: flip it and the choice follows.
            let flipped = match first {
                AccelKind::Kvm => KvmVerdict::TcgOnly {
                    pvm: false,
                    reason: "flipped by the test".into(),
                    tcg_boot_ms: None,
                },
                AccelKind::Tcg => KvmVerdict::Kvm { boot_ms: 1 },
            };
            verdict_cache(dir.path()).put(&key, &flipped).expect("put");
            assert_ne!(choose(&cfg, &kernel, dir.path()).await, first);
        }
        if first == AccelKind::Tcg {
            let why = stored.map_or_else(
                || "/dev/kvm does not open".to_string(),
                |v| format!("{v:?}"),
            );
            skip_or_fail(Tier::Kvm, format!("the runtime chose TCG: {why}"));
        }
    }
}
