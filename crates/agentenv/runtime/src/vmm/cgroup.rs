//! Per-VM cgroups: a memory, CPU, process-count and disk I/O limit for every QEMU process, in a group
//! `agentenv/<vm>` nested under this process's own group. cgroup v2 (unified) or the v1 `memory`,
//! `cpu` (and `pids` and `blkio`, where mounted) controllers, whichever this host mounts writable; without either,
//! VMs run unconfined and a warning says so. A root runtime places each QEMU in its groups before it
//! execs ([`Hierarchy::prepare`], then the child writes itself in), and refuses to start one it
//! cannot place.

use std::path::{Path, PathBuf};

/// Limits of one VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPU time per 100 ms period, microseconds.
    pub cpu_quota_us: u64,
    /// Tasks (threads included) the VM's QEMU may have at once.
    pub pids_max: u64,
    /// The disk its files are on: QEMU's own reads and writes there are held to [`IO_BPS`] and
    /// [`IO_IOPS`] each way (the guest's disk is throttled below that by QEMU itself).
    pub io: Option<Disk>,
    /// A background CPU weight ([`Hierarchy::set_background`]) from the start.
    pub background: bool,
}

/// A whole block device (`major:minor`), as cgroups' I/O limits name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disk {
    pub major: u32,
    pub minor: u32,
}

/// Bytes a second one QEMU may read, and write, on its disk: twice the guest disk's throttle burst.
pub const IO_BPS: u64 = 1 << 30;
/// Operations a second one QEMU may issue each way on its disk.
pub const IO_IOPS: u64 = 16_000;

/// The whole disk holding `path` (the parent of a partition); `None` for a filesystem on no block
/// device (tmpfs, overlay) or one sysfs does not show.
pub fn disk_of(path: &Path) -> Option<Disk> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    if major == 0 {
        return None;
    }
    let sys = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    let whole = if sys.join("partition").exists() {
        sys.parent()?.to_path_buf()
    } else {
        sys
    };
    let text = std::fs::read_to_string(whole.join("dev")).ok()?;
    let (ma, mi) = text.trim().split_once(':')?;
    Some(Disk {
        major: ma.parse().ok()?,
        minor: mi.parse().ok()?,
    })
}

/// Tasks of one QEMU: a thread per vCPU, its I/O and RCU threads, and headroom; far below what
/// exhausts a host (QEMU's seccomp refuses fork anyway).
const PIDS_MAX: u64 = 512;

/// Headroom above guest RAM for QEMU itself (TCG's translation cache above all).
const QEMU_OVERHEAD: u64 = 1 << 30;
const CPU_PERIOD_US: u64 = 100_000;
/// Groups younger than this are never swept.
pub const SWEEP_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(120);

impl Limits {
    /// Guest RAM plus QEMU's own headroom; one CPU per vCPU plus one for QEMU's I/O threads; I/O on
    /// `disk` limited.
    pub fn for_vm(memory_mib: u64, vcpus: u32, disk: Option<Disk>) -> Limits {
        Limits {
            memory_bytes: (memory_mib << 20) + QEMU_OVERHEAD,
            cpu_quota_us: (u64::from(vcpus) + 1) * CPU_PERIOD_US,
            pids_max: PIDS_MAX,
            io: disk,
            background: false,
        }
    }
}

/// Where groups are made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// The unified hierarchy: `<base>/agentenv/<vm>` with `memory.max`, `cpu.max`, and `pids.max` and
    /// `io.max` where the base offers those controllers.
    V2 { base: PathBuf },
    /// v1: `<memory>/agentenv/<vm>` (`memory.limit_in_bytes`), `<cpu>/agentenv/<vm>` (`cpu.cfs_*`) and,
    /// where mounted, `<pids>/agentenv/<vm>` (`pids.max`) and `<blkio>/agentenv/<vm>`
    /// (`blkio.throttle.*`).
    V1 {
        memory: PathBuf,
        cpu: PathBuf,
        pids: Option<PathBuf>,
        blkio: Option<PathBuf>,
    },
}

impl Hierarchy {
    /// The hierarchy under `root` (normally `/sys/fs/cgroup`) for this process, as `/proc/self/cgroup`
    /// (`self_cgroup`) places it; `None` when no writable one is there.
    pub fn detect(root: &Path, self_cgroup: &str) -> Option<Hierarchy> {
        let own = |controller: &str| {
            self_cgroup.lines().find_map(|l| {
                let mut f = l.splitn(3, ':');
                let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
                ctrls
                    .split(',')
                    .any(|c| c == controller)
                    .then(|| path.trim_start_matches('/').to_string())
            })
        };
        let v1 = |c: &str| {
            let mount = root.join(c);
            let dir = mount.join(own(c)?);
            (dir.join("cgroup.procs").exists() && writable(&dir)).then_some(dir)
        };
        if let (Some(memory), Some(cpu)) = (v1("memory"), v1("cpu")) {
            let (pids, blkio) = (v1("pids"), v1("blkio"));
            return Some(Hierarchy::V1 {
                memory,
                cpu,
                pids,
                blkio,
            });
        }
        let unified = self_cgroup
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .map(|p| p.trim_start_matches('/').to_string())?;
        let base = root.join(unified);
        let controllers = std::fs::read_to_string(base.join("cgroup.controllers")).ok()?;
        let has = |c| controllers.split_whitespace().any(|x| x == c);
        (has("memory") && has("cpu") && writable(&base)).then_some(Hierarchy::V2 { base })
    }

    /// This host's hierarchy, if any.
    pub fn host() -> Option<Hierarchy> {
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        Hierarchy::detect(Path::new("/sys/fs/cgroup"), &own)
    }

    /// The `agentenv` folders that hold the VMs' groups (v1: memory, cpu, pids, blkio).
    fn parents(&self) -> Vec<PathBuf> {
        match self {
            Hierarchy::V2 { base } => vec![base.join("agentenv")],
            Hierarchy::V1 {
                memory,
                cpu,
                pids,
                blkio,
            } => [Some(memory), Some(cpu), pids.as_ref(), blkio.as_ref()]
                .into_iter()
                .flatten()
                .map(|p| p.join("agentenv"))
                .collect(),
        }
    }

    /// The group folders of VM `vm`.
    pub fn groups(&self, vm: &str) -> Vec<PathBuf> {
        self.parents().into_iter().map(|p| p.join(vm)).collect()
    }

    /// Creates the groups of `vm` with `limits` and moves `pid` into them.
    pub fn confine(&self, vm: &str, pid: u32, limits: Limits) -> std::io::Result<()> {
        use std::io::Write;
        for mut procs in self.prepare(vm, limits)? {
            procs.write_all(pid.to_string().as_bytes())?;
        }
        Ok(())
    }

    /// Creates the groups of `vm` with `limits` and opens their `cgroup.procs` for writing: a child
    /// that writes `0` to each (before it execs) is in every group.
    pub fn prepare(&self, vm: &str, limits: Limits) -> std::io::Result<Vec<std::fs::File>> {
        let write = |dir: &Path, file: &str, value: String| {
            std::fs::write(dir.join(file), value).map_err(|e| {
                std::io::Error::new(e.kind(), format!("{}: {e}", dir.join(file).display()))
            })
        };
        let procs = |dir: &Path| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("cgroup.procs"))
        };
        let groups = self.groups(vm);
        match self {
            Hierarchy::V2 { base } => {
                let g = &groups[0];
                let parent = g.parent().unwrap_or(base);
                std::fs::create_dir_all(parent)?;
                let offered = std::fs::read_to_string(base.join("cgroup.controllers"))?;
                let has = |c: &str| offered.split_whitespace().any(|x| x == c);
                let (pids, io) = (has("pids"), limits.io.filter(|_| has("io")));
                let mut ctrl = String::from("+memory +cpu");
                for (on, c) in [(pids, " +pids"), (io.is_some(), " +io")] {
                    if on {
                        ctrl.push_str(c);
                    }
                }
                // Controllers must be enabled on the way down; the base may already allow them.
                let _ = std::fs::write(base.join("cgroup.subtree_control"), &ctrl);
                write(parent, "cgroup.subtree_control", ctrl)?;
                std::fs::create_dir_all(g)?;
                write(g, "memory.max", limits.memory_bytes.to_string())?;
                write(
                    g,
                    "cpu.max",
                    format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
                )?;
                let (file, weight) = self.weight(limits.background);
                write(g, file, weight.to_string())?;
                if pids {
                    write(g, "pids.max", limits.pids_max.to_string())?;
                }
                if let Some(Disk { major, minor }) = io {
                    let max = format!(
                        "{major}:{minor} rbps={IO_BPS} wbps={IO_BPS} riops={IO_IOPS} wiops={IO_IOPS}"
                    );
                    write(g, "io.max", max)?;
                }
                Ok(vec![procs(g)?])
            }
            Hierarchy::V1 {
                memory,
                cpu,
                pids,
                blkio,
            } => {
                let group = |base: &PathBuf| {
                    let g = base.join("agentenv").join(vm);
                    std::fs::create_dir_all(&g).map(|()| g)
                };
                let (m, c) = (group(memory)?, group(cpu)?);
                write(&m, "memory.limit_in_bytes", limits.memory_bytes.to_string())?;
                write(&c, "cpu.cfs_period_us", CPU_PERIOD_US.to_string())?;
                write(&c, "cpu.cfs_quota_us", limits.cpu_quota_us.to_string())?;
                let (file, weight) = self.weight(limits.background);
                write(&c, file, weight.to_string())?;
                let mut files = vec![procs(&m)?, procs(&c)?];
                if let Some(p) = pids {
                    let p = group(p)?;
                    write(&p, "pids.max", limits.pids_max.to_string())?;
                    files.push(procs(&p)?);
                }
                if let (Some(b), Some(Disk { major, minor })) = (blkio, limits.io) {
                    let b = group(b)?;
                    for (file, v) in [
                        ("read_bps_device", IO_BPS),
                        ("write_bps_device", IO_BPS),
                        ("read_iops_device", IO_IOPS),
                        ("write_iops_device", IO_IOPS),
                    ] {
                        write(
                            &b,
                            &format!("blkio.throttle.{file}"),
                            format!("{major}:{minor} {v}"),
                        )?;
                    }
                    files.push(procs(&b)?);
                }
                Ok(files)
            }
        }
    }

    /// Gives VM `vm`'s CPU group a background weight (a tenth of the default) or the default back:
    /// warm VMs preparing for the pool then yield the cores to the VMs and requests that run.
    pub fn set_background(&self, vm: &str, background: bool) -> std::io::Result<()> {
        let dir = match self {
            Hierarchy::V2 { .. } => self.groups(vm).swap_remove(0),
            Hierarchy::V1 { cpu, .. } => cpu.join("agentenv").join(vm),
        };
        let (file, value) = self.weight(background);
        std::fs::write(dir.join(file), value.to_string())
    }

    /// The CPU weight file and its value: the default, or a tenth of it in the background.
    fn weight(&self, background: bool) -> (&'static str, u32) {
        let (file, default) = match self {
            Hierarchy::V2 { .. } => ("cpu.weight", 100),
            Hierarchy::V1 { .. } => ("cpu.shares", 1024),
        };
        (file, if background { default / 10 } else { default })
    }

    /// Removes every empty group a previous process left (VMs it lost, or killed as orphans). A group
    /// made in the last [`SWEEP_MIN_AGE`] stays: another server sharing this hierarchy may be about to
    /// start its QEMU in it (made before the fork, joined before the exec).
    pub fn sweep(&self) {
        for p in self.parents() {
            for e in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                let age = e.metadata().and_then(|m| m.modified()).ok();
                if age.is_none_or(|t| t.elapsed().is_ok_and(|a| a < SWEEP_MIN_AGE)) {
                    continue;
                }
                // rmdir fails on a group that still has processes: those stay.
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }

    /// Removes the groups of `vm` (they must be empty: call after its QEMU exited).
    pub fn release(&self, vm: &str) {
        for g in self.groups(vm) {
            let _ = std::fs::remove_dir(&g);
        }
    }
}

fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: access(2) on a NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// The cgroup name of a VM: its folder's name (the sandbox id, or a template build's folder).
pub fn vm_name(spec: &crate::vmm::VmSpec) -> String {
    spec.dir
        .file_name()
        .map_or_else(|| "vm".into(), |n| n.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_cover_guest_ram_and_qemu() {
        let mib = rand::random_range(128..16_384u64);
        let l = Limits::for_vm(mib, 2, None);
        assert_eq!(l.memory_bytes, (mib << 20) + QEMU_OVERHEAD);
        assert_eq!(l.cpu_quota_us, 300_000);
        assert_eq!(l.pids_max, PIDS_MAX);
    }

    #[test]
    fn a_sweep_leaves_groups_made_lately_for_their_qemu() {
        let root = tempfile::tempdir().unwrap();
        let base = root.path().join("svc");
        let h = Hierarchy::V2 { base: base.clone() };
        let (old, new) = (base.join("agentenv/old-vm"), base.join("agentenv/new-vm"));
        for d in [&old, &new] {
            std::fs::create_dir_all(d).unwrap();
        }
        let then = std::time::SystemTime::now() - SWEEP_MIN_AGE * 2;
        std::fs::File::open(&old)
            .unwrap()
            .set_modified(then)
            .unwrap();
        h.sweep();
        assert!(!old.exists(), "a group left long ago goes");
        assert!(new.exists(), "a group made now may be joined any moment");
    }

    #[test]
    fn background_groups_get_a_tenth_of_the_default_cpu_weight_from_the_start_or_later() {
        let root = tempfile::tempdir().unwrap();
        let vm = format!("w{}", rand::random::<u16>());
        let v2 = Hierarchy::V2 {
            base: root.path().join("svc"),
        };
        let v1 = Hierarchy::V1 {
            memory: root.path().join("memory"),
            cpu: root.path().join("cpu"),
            pids: None,
            blkio: None,
        };
        let v2_file = root
            .path()
            .join("svc/agentenv")
            .join(&vm)
            .join("cpu.weight");
        let v1_file = root
            .path()
            .join("cpu/agentenv")
            .join(&vm)
            .join("cpu.shares");
        for (h, file, low, default) in
            [(&v2, &v2_file, "10", "100"), (&v1, &v1_file, "102", "1024")]
        {
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            h.set_background(&vm, true).unwrap();
            assert_eq!(std::fs::read_to_string(file).unwrap(), low);
            h.set_background(&vm, false).unwrap();
            assert_eq!(std::fs::read_to_string(file).unwrap(), default);
        }
        assert!(v2.set_background("no-such-vm", true).is_err());
        // A warm VM's group starts in the background; another VM's with the default.
        for background in [true, false] {
            let vm = format!("p{}", rand::random::<u32>());
            let c = root.path().join("cpu/agentenv").join(&vm);
            let m = root.path().join("memory/agentenv").join(&vm);
            for d in [&c, &m] {
                std::fs::create_dir_all(d).unwrap();
                std::fs::write(d.join("cgroup.procs"), "").unwrap();
            }
            let limits = Limits {
                background,
                ..Limits::for_vm(256, 1, None)
            };
            assert_eq!(v1.prepare(&vm, limits).unwrap().len(), 2);
            let want = if background { "102" } else { "1024" };
            assert_eq!(std::fs::read_to_string(c.join("cpu.shares")).unwrap(), want);
        }
    }

    #[test]
    fn io_limits_name_the_whole_disk_of_a_path() {
        assert_eq!(disk_of(Path::new("/dev/shm")), None, "tmpfs has no disk");
        if let Some(Disk { major, minor }) = disk_of(&std::env::temp_dir()) {
            let sys = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
            assert!(sys.exists() && !sys.join("partition").exists(), "{sys:?}");
        }
    }

    #[test]
    fn detects_v1_and_v2_layouts_under_our_own_group() {
        let root = tempfile::tempdir().unwrap();
        let own = format!("p{}", rand::random::<u32>());
        for c in ["memory", "cpu"] {
            let d = root.path().join(c).join("svc").join(&own);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cgroup.procs"), "").unwrap();
        }
        let v1 = format!("4:memory:/svc/{own}\n1:cpu:/svc/{own}\n0::/\n");
        assert_eq!(
            Hierarchy::detect(root.path(), &v1),
            Some(Hierarchy::V1 {
                memory: root.path().join("memory/svc").join(&own),
                cpu: root.path().join("cpu/svc").join(&own),
                pids: None,
                blkio: None,
            })
        );
        let v2root = tempfile::tempdir().unwrap();
        let base = v2root.path().join("user.slice").join(&own);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("cgroup.controllers"), "cpuset cpu io memory pids").unwrap();
        let v2 = format!("0::/user.slice/{own}\n");
        assert_eq!(
            Hierarchy::detect(v2root.path(), &v2),
            Some(Hierarchy::V2 { base: base.clone() })
        );
        std::fs::write(base.join("cgroup.controllers"), "cpuset io pids").unwrap();
        assert_eq!(
            Hierarchy::detect(v2root.path(), &v2),
            None,
            "no memory controller"
        );
        assert_eq!(Hierarchy::detect(root.path(), "0::/\n"), None);
    }
}
