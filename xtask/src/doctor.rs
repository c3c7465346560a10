//! `cargo xtask doctor`: which tiers can run here, and why not.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use k3_common::Tier;
use k3_common::device::{CudaProbe, probe_cuda};
use k3_common::kvm::{self, KvmVerdict, VerdictCache};
use k3_common::machine;
use k3_common::report::Machine;
use serde::{Deserialize, Serialize};

use crate::util;

/// Whether one tier can run here.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TierStatus {
    pub tier: Tier,
    pub runs: bool,
    /// What was found (devices, link kind, accelerator) or why the tier cannot run.
    pub detail: String,
}

/// Everything doctor found.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Findings {
    pub tiers: Vec<TierStatus>,
    pub cuda: CudaProbe,
    pub kvm: KvmVerdict,
    /// Why agentenv sandboxes get no network here (`None`: they do).
    pub sandbox_network_off: Option<String>,
}

impl Findings {
    pub fn status(&self, tier: Tier) -> &TierStatus {
        self.tiers
            .iter()
            .find(|t| t.tier == tier)
            .expect("every tier is probed")
    }
}

/// Probes every tier. The KVM verdict is cached per (host kernel, QEMU version) unless `recheck`.
pub fn probe(recheck: bool) -> Findings {
    let cuda = probe_cuda();
    let kvm = kvm_verdict(recheck);
    let cpu = TierStatus {
        tier: Tier::Cpu,
        runs: true,
        detail: format!("{} cores, {}", machine::cores(), machine::cpu_model()),
    };
    let (sm90, nvlink) = match &cuda {
        CudaProbe::Unavailable { reason } => (
            TierStatus {
                tier: Tier::Sm90,
                runs: false,
                detail: reason.clone(),
            },
            TierStatus {
                tier: Tier::Nvlink,
                runs: false,
                detail: reason.clone(),
            },
        ),
        CudaProbe::Available(inv) => {
            let sm90: Vec<String> = inv
                .sm90_devices()
                .map(|d| {
                    format!(
                        "GPU{} {} (sm_{}{})",
                        d.ordinal, d.name, d.compute_capability.0, d.compute_capability.1
                    )
                })
                .collect();
            let sm90 = if sm90.is_empty() {
                TierStatus {
                    tier: Tier::Sm90,
                    runs: false,
                    detail: format!(
                        "{} CUDA device(s), none with compute capability >= 9.0",
                        inv.devices.len()
                    ),
                }
            } else {
                TierStatus {
                    tier: Tier::Sm90,
                    runs: true,
                    detail: format!("driver {}: {}", inv.driver_version, sm90.join(", ")),
                }
            };
            let nvlink = if inv.devices.len() < 2 {
                TierStatus {
                    tier: Tier::Nvlink,
                    runs: false,
                    detail: format!("{} CUDA device(s); needs at least 2", inv.devices.len()),
                }
            } else {
                let pairs: Vec<String> = inv
                    .peers
                    .iter()
                    .filter(|p| p.from < p.to)
                    .map(|p| {
                        format!(
                            "GPU{}<->GPU{}: peer access {}, {}",
                            p.from,
                            p.to,
                            if p.can_access_peer { "yes" } else { "no" },
                            p.link
                        )
                    })
                    .collect();
                TierStatus {
                    tier: Tier::Nvlink,
                    runs: inv.all_pairs_peer_capable(),
                    detail: pairs.join("; "),
                }
            };
            (sm90, nvlink)
        }
    };
    let kvm_status = match &kvm {
        KvmVerdict::Kvm { boot_ms } => TierStatus {
            tier: Tier::Kvm,
            runs: true,
            detail: format!("a standard guest booted under KVM in {boot_ms} ms"),
        },
        KvmVerdict::TcgOnly {
            pvm,
            reason,
            tcg_boot_ms,
        } => TierStatus {
            tier: Tier::Kvm,
            runs: false,
            detail: format!(
                "{}: {reason}; TCG {}",
                if *pvm { "PVM-only: TCG" } else { "TCG only" },
                tcg_boot_ms.map_or("does not boot either".into(), |ms| format!(
                    "boots the probe guest in {ms} ms"
                ))
            ),
        },
        KvmVerdict::None { reason } => TierStatus {
            tier: Tier::Kvm,
            runs: false,
            detail: reason.clone(),
        },
    };
    Findings {
        tiers: vec![cpu, sm90, nvlink, kvm_status],
        cuda,
        kvm,
        sandbox_network_off: k3_common::netcheck::sandbox_network_blocker(),
    }
}

/// The host-level probe's verdict, cached by k3-common per (host kernel, QEMU version, guest kernel).
fn kvm_verdict(recheck: bool) -> KvmVerdict {
    let kernel = kvm::find_guest_kernel().unwrap_or_default();
    let key = VerdictCache::key(Path::new(kvm::QEMU), &kernel);
    VerdictCache::default().get_or_probe(&key, recheck, || {
        let pb = util::spinner("booting the KVM probe guest (falls back to TCG)");
        let verdict = kvm::check(Duration::from_secs(15));
        pb.finish_and_clear();
        verdict
    })
}

pub fn run(json: bool, recheck: bool) -> anyhow::Result<()> {
    let f = probe(recheck);
    if json {
        println!("{}", serde_json::to_string_pretty(&f)?);
        return Ok(());
    }
    let mut table = Table::new();
    table
        .load_style(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec!["tier", "runs here", "detail"]);
    for t in &f.tiers {
        table.add_row(vec![
            t.tier.to_string(),
            if t.runs { "yes".into() } else { "no".into() },
            t.detail.clone(),
        ]);
    }
    println!("{table}");
    match &f.sandbox_network_off {
        None => println!("agentenv sandbox networking: yes (namespaces, taps, nftables)"),
        Some(why) => {
            println!("agentenv sandbox networking: no ({why}); sandboxes start without a network")
        }
    }
    if let CudaProbe::Available(inv) = &f.cuda {
        for d in &inv.devices {
            println!(
                "GPU{}: {} sm_{}{} {} SMs {:.1} GiB bus {}",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.multiprocessors,
                d.memory_bytes as f64 / (1u64 << 30) as f64,
                d.pci_bus_id
            );
        }
    }
    Ok(())
}

/// This machine, for the report header.
pub fn machine(f: &Findings) -> Machine {
    let mut versions = BTreeMap::new();
    for (name, prog, args) in [
        ("rustc", "rustc", &["--version"][..]),
        ("nvcc", "nvcc", &["--version"][..]),
        ("qemu", "qemu-system-x86_64", &["--version"][..]),
        ("python3", "python3", &["--version"][..]),
    ] {
        if let Some(v) = util::tool_version(prog, args) {
            let v = if name == "nvcc" {
                util::tool_version_last(prog, args).unwrap_or(v)
            } else {
                v
            };
            versions.insert(name.to_string(), v);
        }
    }
    if let Some(v) = util::tool_version("python3", &["-c", "import torch;print(torch.__version__)"])
    {
        versions.insert("torch".into(), v);
    }
    let gpus = match &f.cuda {
        CudaProbe::Available(inv) => {
            versions.insert("cuda_driver_api".into(), inv.driver_version.to_string());
            inv.devices
                .iter()
                .map(|d| {
                    format!(
                        "{} ({} SMs, {:.0} GiB)",
                        d.name,
                        d.multiprocessors,
                        d.memory_bytes as f64 / (1u64 << 30) as f64
                    )
                })
                .collect()
        }
        CudaProbe::Unavailable { .. } => Vec::new(),
    };
    versions.insert("kvm".into(), f.status(Tier::Kvm).detail.clone());
    machine::probe(gpus, versions)
}
