//! CUDA device inventory: devices, compute capability, memory, peer access and link kind.
//!
//! Everything goes through cudarc's dynamically loaded driver API, so a machine without the NVIDIA driver
//! gets [`CudaProbe::Unavailable`] with the reason instead of a link error or a panic. The NVLink link
//! count comes from NVML (`libnvidia-ml.so.1`, part of the driver) where the driver provides it.

use serde::{Deserialize, Serialize};

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    pub memory_bytes: u64,
    pub multiprocessors: i32,
    pub pci_bus_id: String,
}

impl GpuInfo {
    /// True for Hopper or newer (compute capability >= 9.0): the sm90 tier.
    pub fn is_sm90_or_newer(&self) -> bool {
        self.compute_capability.0 >= 9
    }
}

/// How two devices are connected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LinkKind {
    /// NVLink with this many active links (NV18 on our 2xH200).
    Nvlink { links: u32 },
    /// Peer traffic over PCIe.
    Pcie,
    /// The driver did not tell (NVML missing).
    Unknown,
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkKind::Nvlink { links } => write!(f, "NVLink (NV{links})"),
            LinkKind::Pcie => f.write_str("PCIe"),
            LinkKind::Unknown => f.write_str("unknown link"),
        }
    }
}

/// Peer relation of an ordered pair of devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerLink {
    pub from: usize,
    pub to: usize,
    pub can_access_peer: bool,
    pub native_atomics: bool,
    pub link: LinkKind,
}

/// What the CUDA driver reports on this machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CudaInventory {
    /// Driver API version, e.g. 13000.
    pub driver_version: i32,
    pub devices: Vec<GpuInfo>,
    /// Every ordered pair of distinct devices.
    pub peers: Vec<PeerLink>,
}

impl CudaInventory {
    /// Devices usable by the sm90 tier.
    pub fn sm90_devices(&self) -> impl Iterator<Item = &GpuInfo> {
        self.devices.iter().filter(|d| d.is_sm90_or_newer())
    }

    /// True when every ordered pair of devices has peer access (and there are at least two).
    pub fn all_pairs_peer_capable(&self) -> bool {
        self.devices.len() >= 2 && self.peers.iter().all(|p| p.can_access_peer)
    }
}

/// Result of probing for CUDA.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum CudaProbe {
    Available(CudaInventory),
    Unavailable { reason: String },
}

/// Probes the CUDA driver. Never panics; without the `cuda` feature it reports why it cannot look.
pub fn probe_cuda() -> CudaProbe {
    #[cfg(feature = "cuda")]
    {
        match std::panic::catch_unwind(cuda::probe) {
            Ok(Ok(inv)) => CudaProbe::Available(inv),
            Ok(Err(reason)) => CudaProbe::Unavailable { reason },
            Err(_) => CudaProbe::Unavailable {
                reason: "the CUDA driver library panicked while loading".into(),
            },
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        CudaProbe::Unavailable {
            reason: "k3-common was built without the `cuda` feature".into(),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::ffi::{CStr, c_char, c_int};

    use cudarc::driver::sys::{
        self, CUdevice_P2PAttribute as P, CUdevice_attribute as A, CUresult,
    };

    use super::{CudaInventory, GpuInfo, LinkKind, PeerLink};

    fn check(r: CUresult, what: &str) -> Result<(), String> {
        crate::cuda::check(r, what).map_err(|e| e.to_string())
    }

    fn attr(dev: sys::CUdevice, a: A) -> Result<i32, String> {
        let mut v: c_int = 0;
        // SAFETY: out-pointer to a live local; the driver library is loaded (checked in `probe`).
        check(
            unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) },
            "cuDeviceGetAttribute",
        )?;
        Ok(v)
    }

    pub(super) fn probe() -> Result<CudaInventory, String> {
        // SAFETY: only asks whether the shared library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(
                "no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver on this machine)"
                    .into(),
            );
        }
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut version: c_int = 0;
            check(sys::cuDriverGetVersion(&mut version), "cuDriverGetVersion")?;
            let mut count: c_int = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            let mut handles = Vec::new();
            let mut devices = Vec::new();
            for ordinal in 0..count {
                let mut dev: sys::CUdevice = 0;
                check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
                let mut name = [0 as c_char; 256];
                check(
                    sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev),
                    "cuDeviceGetName",
                )?;
                let mut mem: usize = 0;
                check(sys::cuDeviceTotalMem_v2(&mut mem, dev), "cuDeviceTotalMem")?;
                let mut bus = [0 as c_char; 64];
                check(
                    sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 64, dev),
                    "cuDeviceGetPCIBusId",
                )?;
                devices.push(GpuInfo {
                    ordinal: ordinal as usize,
                    name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                    compute_capability: (
                        attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                        attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                    ),
                    memory_bytes: mem as u64,
                    multiprocessors: attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                    pci_bus_id: CStr::from_ptr(bus.as_ptr()).to_string_lossy().into_owned(),
                });
                handles.push(dev);
            }
            let nvml = super::nvml::Nvml::load();
            let mut peers = Vec::new();
            for (i, &a) in handles.iter().enumerate() {
                for (j, &b) in handles.iter().enumerate() {
                    if i == j {
                        continue;
                    }
                    let mut can: c_int = 0;
                    check(
                        sys::cuDeviceCanAccessPeer(&mut can, a, b),
                        "cuDeviceCanAccessPeer",
                    )?;
                    let mut atomics: c_int = 0;
                    let _ = sys::cuDeviceGetP2PAttribute(
                        &mut atomics,
                        P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                        a,
                        b,
                    );
                    let link = match &nvml {
                        Some(n) => n.link(&devices[i].pci_bus_id, &devices[j].pci_bus_id),
                        None => LinkKind::Unknown,
                    };
                    peers.push(PeerLink {
                        from: i,
                        to: j,
                        can_access_peer: can != 0,
                        native_atomics: atomics != 0,
                        link,
                    });
                }
            }
            Ok(CudaInventory {
                driver_version: version,
                devices,
                peers,
            })
        }
    }
}

#[cfg(feature = "cuda")]
mod nvml {
    //! The few NVML calls that tell NVLink from PCIe, loaded with dlopen (NVML ships with the driver).

    use std::ffi::{CString, c_char, c_int, c_uint, c_void};

    use super::LinkKind;

    type Device = *mut c_void;
    const NVML_P2P_CAPS_INDEX_NVLINK: c_int = 2;
    const NVML_NVLINK_MAX_LINKS: c_uint = 18;

    pub(super) struct Nvml {
        by_bus: unsafe extern "C" fn(*const c_char, *mut Device) -> c_int,
        p2p: unsafe extern "C" fn(Device, Device, c_int, *mut c_int) -> c_int,
        link_state: unsafe extern "C" fn(Device, c_uint, *mut c_int) -> c_int,
    }

    unsafe fn sym<T: Copy>(lib: *mut c_void, name: &str) -> Option<T> {
        let c = CString::new(name).ok()?;
        // SAFETY: `lib` is a live dlopen handle; `T` is the matching fn-pointer type.
        let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
        // SAFETY: a non-null symbol of the documented signature.
        (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
    }

    impl Nvml {
        pub(super) fn load() -> Option<Nvml> {
            let name = CString::new("libnvidia-ml.so.1").ok()?;
            // SAFETY: dlopen of a system library; the handle is kept for the process lifetime.
            let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if lib.is_null() {
                return None;
            }
            // SAFETY: symbol types follow nvml.h.
            unsafe {
                let init: unsafe extern "C" fn() -> c_int = sym(lib, "nvmlInit_v2")?;
                if init() != 0 {
                    return None;
                }
                Some(Nvml {
                    by_bus: sym(lib, "nvmlDeviceGetHandleByPciBusId_v2")?,
                    p2p: sym(lib, "nvmlDeviceGetP2PStatus")?,
                    link_state: sym(lib, "nvmlDeviceGetNvLinkState")?,
                })
            }
        }

        fn device(&self, bus: &str) -> Option<Device> {
            let c = CString::new(bus).ok()?;
            let mut d: Device = std::ptr::null_mut();
            // SAFETY: valid C string and out-pointer.
            (unsafe { (self.by_bus)(c.as_ptr(), &mut d) } == 0).then_some(d)
        }

        pub(super) fn link(&self, from_bus: &str, to_bus: &str) -> LinkKind {
            let (Some(a), Some(b)) = (self.device(from_bus), self.device(to_bus)) else {
                return LinkKind::Unknown;
            };
            let mut status: c_int = -1;
            // SAFETY: device handles from NVML, out-pointer to a local.
            let rc = unsafe { (self.p2p)(a, b, NVML_P2P_CAPS_INDEX_NVLINK, &mut status) };
            if rc != 0 {
                return LinkKind::Unknown;
            }
            if status != 0 {
                return LinkKind::Pcie;
            }
            let links = (0..NVML_NVLINK_MAX_LINKS)
                .filter(|&l| {
                    let mut active: c_int = 0;
                    // SAFETY: as above.
                    unsafe { (self.link_state)(a, l, &mut active) == 0 && active != 0 }
                })
                .count() as u32;
            LinkKind::Nvlink { links }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_explains() {
        match probe_cuda() {
            CudaProbe::Available(inv) => {
                println!(
                    "CUDA driver {}: {} device(s)",
                    inv.driver_version,
                    inv.devices.len()
                );
                assert_eq!(
                    inv.peers.len(),
                    inv.devices.len() * inv.devices.len().saturating_sub(1)
                );
            }
            CudaProbe::Unavailable { reason } => {
                println!("skipped GPU inventory: {reason}");
                assert!(!reason.is_empty());
            }
        }
    }

    /// The sm90 tier: a Hopper device with a plausible inventory (fails under `K3_REQUIRE_GPU=1` without one).
    #[test]
    fn sm90_probe_finds_a_hopper_device() {
        let inv = match probe_cuda() {
            CudaProbe::Available(inv) => inv,
            CudaProbe::Unavailable { reason } => {
                crate::require::skip_or_fail(crate::Tier::Sm90, reason);
                return;
            }
        };
        let Some(d) = inv.sm90_devices().next() else {
            crate::require::skip_or_fail(crate::Tier::Sm90, "no device of compute capability 9.0+");
            return;
        };
        assert!(inv.driver_version >= 12000, "driver {}", inv.driver_version);
        assert!(d.multiprocessors > 0 && d.memory_bytes > (1 << 30), "{d:?}");
        assert!(!d.name.is_empty() && !d.pci_bus_id.is_empty(), "{d:?}");
    }

    /// The nvlink tier: two devices with peer access both ways (fails under `K3_REQUIRE_GPU=1` without them).
    #[test]
    fn nvlink_probe_finds_peer_access_between_two_devices() {
        let inv = match probe_cuda() {
            CudaProbe::Available(inv) => inv,
            CudaProbe::Unavailable { reason } => {
                crate::require::skip_or_fail(crate::Tier::Nvlink, reason);
                return;
            }
        };
        if !inv.all_pairs_peer_capable() {
            crate::require::skip_or_fail(
                crate::Tier::Nvlink,
                format!(
                    "{} device(s), not all pairs peer-capable",
                    inv.devices.len()
                ),
            );
            return;
        }
        for p in &inv.peers {
            assert!(p.from != p.to && p.can_access_peer, "{p:?}");
            let back = inv.peers.iter().find(|q| q.from == p.to && q.to == p.from);
            assert!(
                back.is_some_and(|q| q.can_access_peer),
                "{p:?} has no reverse link"
            );
        }
    }

    #[test]
    fn link_kind_reads_like_nvidia_smi() {
        assert_eq!(LinkKind::Nvlink { links: 18 }.to_string(), "NVLink (NV18)");
        let json = serde_json::to_string(&LinkKind::Nvlink { links: 18 }).unwrap();
        assert_eq!(json, r#"{"kind":"nvlink","links":18}"#);
    }
}
