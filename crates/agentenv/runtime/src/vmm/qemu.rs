//! The QEMU `-M microvm` backend, driven over QMP.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use crate::config::AccelKind;
use crate::vmm::cgroup::{self, Hierarchy, Limits, disk_of};
use crate::vmm::jail::Jail;
use crate::vmm::launch::{self, LazyBacking, Owner, VmFiles};
use crate::vmm::lazy::{Export, LazyDisks};
use crate::vmm::qmp::QmpClient;
use crate::vmm::uid::{Lease, UidPool, UidRange};
use crate::vmm::{
    BoxFuture, JAIL_DIR, Pausable, Restored, Snapshottable, VmInstance, VmSpec, Vmm, VmmError,
};

/// Name of the virtio-serial port that carries the guest agent channel.
pub const AGENT_PORT_NAME: &str = agentenv_envd::AGENT_CHANNEL;
const QMP_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest save of device state and private RAM (a few GiB under TCG).
const MIGRATION_DEADLINE: Duration = Duration::from_secs(120);
/// Longest wait for an incoming state to load.
const RESTORE_DEADLINE: Duration = Duration::from_secs(60);
/// Longest wait for a QEMU process to exit after `quit` or SIGKILL.
const EXIT_DEADLINE: Duration = Duration::from_secs(10);

/// QEMU `-M microvm` with RAM in a shared memory-backend-file.
pub struct QemuVmm {
    bin: PathBuf,
    accel: AccelKind,
    /// TCG translation cache cap in MiB (`None`: QEMU's default; unused under KVM).
    tcg_tb_mib: Option<u32>,
    /// KSM may merge its pages ([`crate::RuntimeConfig::mem_merge`]).
    mem_merge: bool,
    /// Where each QEMU gets its memory and CPU limits (`None`: this host has no writable cgroups).
    cgroups: Option<Hierarchy>,
    /// Per-VM uids (`None`: QEMU runs as this process, which is not root or was told not to).
    uids: Option<Uids>,
    /// Exports of lazily served disks (`None`: every disk is a local file).
    lazy: Option<Arc<LazyDisks>>,
    /// QEMU maps a file private from a read-only open (`readonly=on,rom=off`, QEMU 8.2 or newer).
    private_ro_ram: bool,
    /// First line of `qemu --version` (a saved device state loads only into a matching QEMU).
    version: String,
}

/// The uid pool and the group of every VM.
#[derive(Clone)]
struct Uids {
    pool: Arc<UidPool>,
    gid: u32,
}

impl QemuVmm {
    /// A backend running `bin` with `accel`, confining each QEMU to a cgroup where the host allows it,
    /// and, when this process is root, starting each QEMU as a uid of its own from `uids`.
    pub fn new(bin: PathBuf, accel: AccelKind, uids: Option<UidRange>) -> QemuVmm {
        // Found on `PATH` once, not by every spawn (its exec and its jail's plan).
        let bin = crate::vmm::jail::resolve(&bin).unwrap_or(bin);
        let uids = match uids {
            Some(r) if crate::vmm::uid::running_as_root() => {
                let gid = crate::vmm::uid::vm_gid(&r, accel == AccelKind::Kvm);
                tracing::info!(
                    base = r.base,
                    count = r.count,
                    gid,
                    "each QEMU runs as a uid of its own"
                );
                Some(Uids {
                    pool: Arc::new(UidPool::new(r)),
                    gid,
                })
            }
            Some(_) => {
                // SAFETY: geteuid(2) cannot fail.
                let uid = unsafe { libc::geteuid() };
                tracing::info!(
                    uid,
                    "the runtime is not root: QEMU runs as its uid, already unprivileged (no per-VM uids)"
                );
                None
            }
            None => {
                if crate::vmm::uid::running_as_root() {
                    tracing::warn!("per-VM uids are off: QEMU runs as root");
                }
                None
            }
        };
        let cgroups = Hierarchy::host();
        match &cgroups {
            Some(h) => {
                h.sweep();
                tracing::info!(hierarchy = ?h, "QEMU processes get per-VM cgroups")
            }
            None => {
                tracing::warn!("no writable cgroup hierarchy: VMs run without memory or CPU limits")
            }
        }
        let version = probe(&bin, &["--version"])
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        let private_ro_ram = probe(&bin, &["-object", "memory-backend-file,help"]).contains("rom=");
        tracing::info!(%version, private_ro_ram, "QEMU");
        QemuVmm {
            bin,
            accel,
            tcg_tb_mib: None,
            mem_merge: false,
            cgroups,
            uids,
            lazy: None,
            private_ro_ram,
            version,
        }
    }

    /// The same, serving disks that end in a lazy disk ([`crate::vmm::lazy`]) through `lazy`'s exports.
    pub fn with_lazy_disks(mut self, lazy: Arc<LazyDisks>) -> QemuVmm {
        self.lazy = Some(lazy);
        self
    }

    /// The same, capping each QEMU's TCG translation cache at `mib` MiB (`None`: QEMU's default).
    pub fn with_tcg_tb_mib(mut self, mib: Option<u32>) -> QemuVmm {
        self.tcg_tb_mib = mib;
        self
    }

    /// The same, letting the host's KSM merge the VMs' pages (guest RAM and QEMU's own) when `on`;
    /// otherwise guest RAM is marked unmergeable.
    pub fn with_mem_merge(mut self, on: bool) -> QemuVmm {
        if on {
            launch::warn_where_merging_is_off();
        }
        self.mem_merge = on;
        self
    }

    /// The exports `spec`'s QEMU needs, started where none runs.
    async fn exports(&self, spec: &VmSpec) -> Result<Vec<(LazyBacking, Arc<Export>)>, VmmError> {
        match &self.lazy {
            Some(l) => l.exports_for(spec).await,
            None => Ok(Vec::new()),
        }
    }

    /// The full QEMU argument list for `spec` with its files `f`; `incoming` adds `-S -incoming defer`
    /// for a restore.
    pub fn args(&self, spec: &VmSpec, f: &VmFiles, incoming: bool) -> Vec<String> {
        let mut a: Vec<String> = f
            .add_fds
            .iter()
            .flat_map(|v| ["-add-fd".to_string(), v.clone()])
            .chain(
                f.blockdevs
                    .iter()
                    .flat_map(|v| ["-blockdev".to_string(), v.clone()]),
            )
            .collect();
        a.extend([
            "-M".into(),
            "microvm,memory-backend=mem".into(),
            "-accel".into(),
            crate::vmm::accel::qemu_arg(self.accel, self.tcg_tb_mib),
            "-m".into(),
            format!("{}M", spec.memory_mib),
            "-smp".into(),
            spec.vcpus.to_string(),
        ]);
        if let Some(cpu) = &spec.cpu {
            a.extend(["-cpu".into(), cpu.clone()]);
        }
        a.extend([
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            // seccomp: no obsolete syscalls, no setuid, no fork/exec, no scheduler or affinity changes.
            "-sandbox".into(),
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
            "-object".into(),
            format!(
                "memory-backend-file,id=mem,size={}M,mem-path={},{},{}",
                spec.memory_mib,
                f.ram,
                match (spec.ram_shared, self.private_ro_ram) {
                    (true, _) => "share=on",
                    (false, true) => "share=off,readonly=on,rom=off",
                    (false, false) => "share=off",
                },
                if self.mem_merge {
                    "merge=on"
                } else {
                    "merge=off"
                }
            ),
            "-kernel".into(),
            f.kernel.clone(),
            "-initrd".into(),
            f.initrd.clone(),
            "-append".into(),
            spec.cmdline.clone(),
            "-chardev".into(),
            format!("file,id=con,path={},append=on", f.console),
            "-serial".into(),
            "chardev:con".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", f.qmp_socket),
            "-drive".into(),
            f.drive.clone(),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            format!("socket,id=agent,path={},server=on,wait=off", f.agent_socket),
            "-device".into(),
            format!("virtserialport,chardev=agent,name={AGENT_PORT_NAME}"),
        ]);
        if spec.free_page_reporting {
            a.extend([
                "-device".into(),
                "virtio-balloon-device,free-page-reporting=on".into(),
            ]);
        }
        if spec.nic {
            let device = match &spec.tap {
                Some(tap) => {
                    use std::os::fd::AsRawFd;
                    a.extend([
                        "-netdev".into(),
                        format!("tap,id=net0,fd={}", tap.as_raw_fd()),
                    ]);
                    "virtio-net-device,netdev=net0,guest_announce=off"
                }
                // A NIC without a peer: the machine shape stays that of its snapshots.
                None => "virtio-net-device,guest_announce=off",
            };
            a.extend(["-device".into(), device.into()]);
        }
        if incoming {
            a.extend(["-S".into(), "-incoming".into(), "defer".into()]);
        }
        a
    }

    async fn spawn(&self, spec: &VmSpec, incoming: bool) -> Result<QemuVm, VmmError> {
        let lease = match &self.uids {
            Some(u) => Some(u.pool.allocate()?),
            None => None,
        };
        let owner = lease.as_ref().zip(self.uids.as_ref()).map(|(l, u)| Owner {
            uid: l.uid,
            gid: u.gid,
        });
        match self.spawn_as(spec, incoming, lease).await {
            Ok(vm) => Ok(vm),
            Err(e) => {
                if let (Some(o), Some(u)) = (owner, &self.uids) {
                    if spec.ram_shared {
                        crate::vmm::launch::reclaim(&spec.ram_file);
                    }
                    u.pool.release(o.uid);
                }
                Err(e)
            }
        }
    }

    /// Starts QEMU as the uid of `lease` (as this process without one); the lease ends once QEMU has
    /// exec'd, the uid stays held by the pool.
    async fn spawn_as(
        &self,
        spec: &VmSpec,
        incoming: bool,
        lease: Option<Lease>,
    ) -> Result<QemuVm, VmmError> {
        let owner = lease.as_ref().zip(self.uids.as_ref()).map(|(l, u)| Owner {
            uid: l.uid,
            gid: u.gid,
        });
        // Sockets of a QEMU of an older version, in the VM folder itself.
        for old in ["qmp.sock", "agent.sock"] {
            let _ = std::fs::remove_file(spec.dir.join(old));
        }
        let (lazy, exports): (Vec<_>, Vec<_>) = self.exports(spec).await?.into_iter().unzip();
        // QEMU before 8.2 opens a private RAM file for writing, and its discards (free page reporting)
        // punch holes into the file itself: the VM gets a sealed memfd of it instead.
        let ram_via_memfd = self.ram_via_memfd();
        let files = VmFiles::open(spec, owner, &lazy, ram_via_memfd)?;
        for sock in [spec.qmp_socket(), spec.agent_socket()] {
            let len = sock.as_os_str().len();
            if len > 107 {
                return Err(VmmError::SocketPath { path: sock, len });
            }
        }
        let log_path = spec.dir.join(crate::vmm::QEMU_LOG);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| VmmError::Io {
                what: "open",
                path: log_path.clone(),
                source: e,
            })?;
        let mut cmd = Command::new(&self.bin);
        cmd.args(self.args(spec, &files, incoming))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        let mut fds = files.fds();
        if let Some(tap) = &spec.tap {
            use std::os::fd::AsRawFd;
            fds.push(tap.as_raw_fd());
        }
        let limits = Limits {
            background: spec.background,
            ..Limits::for_vm(spec.memory_mib, spec.vcpus, disk_of(&spec.dir))
        };
        // A root runtime's QEMU is in its cgroups and an empty network namespace before it execs, and
        // is not started where that fails.
        let procs = match (owner, &self.cgroups) {
            (Some(_), Some(h)) => {
                h.prepare(&cgroup::vm_name(spec), limits)
                    .map_err(|e| VmmError::Io {
                        what: "cgroup",
                        path: spec.dir.clone(),
                        source: e,
                    })?
            }
            _ => Vec::new(),
        };
        let procs_fds: Vec<_> = {
            use std::os::fd::AsRawFd;
            procs.iter().map(|f| f.as_raw_fd()).collect()
        };
        // A root runtime's QEMU sees only the files it needs (`crate::vmm::jail`).
        let confine = match owner {
            Some(o) => {
                let root = spec.dir.join(JAIL_DIR);
                let jail = Jail::new(&root, &self.bin).map_err(|e| VmmError::Io {
                    what: "plan the mount namespace of",
                    path: root,
                    source: e,
                })?;
                Some((jail, o.uid, o.gid))
            }
            None => None,
        };
        let merge = self.mem_merge;
        // SAFETY: the closure only calls fcntl(2), prctl(2), write(2), unshare(2), mount(2) and the
        // set*id calls on descriptors this process holds open and strings prepared above.
        unsafe {
            cmd.pre_exec(move || {
                crate::vmm::launch::inherit_in_child(&fds)?;
                if merge {
                    launch::merge_any_in_child();
                }
                match &confine {
                    Some((jail, uid, gid)) => {
                        crate::vmm::launch::confine_in_child(&procs_fds, jail, *uid, *gid)
                    }
                    None => Ok(()),
                }
            });
        }
        let mut child = cmd.spawn().map_err(|e| VmmError::Spawn {
            bin: self.bin.display().to_string(),
            source: e,
        })?;
        // QEMU has exec'd as its uid (spawn returns after exec): other runtimes' checks see it now.
        drop(lease);
        drop(files);
        drop(procs);
        let pid = child.id().unwrap_or(0);
        if owner.is_none()
            && let Some(h) = &self.cgroups
            && let Err(e) = h.confine(&cgroup::vm_name(spec), pid, limits)
        {
            tracing::warn!(pid, error = %e, "QEMU runs without its cgroup limits");
        }
        let qmp_path = spec.qmp_socket();
        let qmp = tokio::select! {
            r = QmpClient::connect(&qmp_path, QMP_TIMEOUT) => r,
            status = child.wait() => {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(VmmError::Exited { during: "startup", detail: format!("{status:?}: {log}") });
            }
        };
        let qmp = match qmp {
            Ok(q) => q,
            Err(e) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Err(e.into());
            }
        };
        Ok(QemuVm {
            spec: spec.clone(),
            pid,
            qmp: Mutex::new(qmp),
            child: Mutex::new(Some(child)),
            cgroups: self.cgroups.clone(),
            uid: owner.map(|o| o.uid),
            pool: self.uids.as_ref().map(|u| u.pool.clone()),
            released: Default::default(),
            _exports: exports,
        })
    }

    /// The uid pool, when each VM gets a uid of its own.
    pub fn uid_pool(&self) -> Option<&UidPool> {
        self.uids.as_ref().map(|u| u.pool.as_ref())
    }
}

impl Vmm for QemuVmm {
    fn accel(&self) -> AccelKind {
        self.accel
    }

    fn per_vm_uids(&self) -> bool {
        self.uids.is_some()
    }

    fn cow_ram(&self) -> bool {
        // With uids of their own, QEMUs before 8.2 map a sealed memfd of the file (`launch::ram_base`).
        true
    }

    fn ram_via_memfd(&self) -> bool {
        !self.private_ro_ram
    }

    fn version(&self) -> &str {
        &self.version
    }

    fn boot<'a>(
        &'a self,
        spec: &'a VmSpec,
    ) -> BoxFuture<'a, Result<Box<dyn VmInstance>, VmmError>> {
        Box::pin(async move {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(&spec.ram_file)
                .map_err(|e| VmmError::Io {
                    what: "create",
                    path: spec.ram_file.clone(),
                    source: e,
                })?;
            f.set_len(spec.memory_mib << 20).map_err(|e| VmmError::Io {
                what: "size",
                path: spec.ram_file.clone(),
                source: e,
            })?;
            let vm = self.spawn(spec, false).await?;
            Ok(Box::new(vm) as Box<dyn VmInstance>)
        })
    }

    fn restore<'a>(
        &'a self,
        spec: &'a VmSpec,
        device_state: &'a Path,
    ) -> BoxFuture<'a, Result<Restored, VmmError>> {
        Box::pin(async move {
            let state = std::fs::File::open(device_state).map_err(|e| VmmError::Io {
                what: "open",
                path: device_state.to_owned(),
                source: e,
            })?;
            let t0 = std::time::Instant::now();
            let vm = self.spawn(spec, true).await?;
            let spawned = t0.elapsed();
            let r = async {
                let sock = spec.agent_socket();
                let agent =
                    tokio::net::UnixStream::connect(&sock)
                        .await
                        .map_err(|e| VmmError::Io {
                            what: "connect",
                            path: sock,
                            source: e,
                        })?;
                let mut q = vm.qmp.lock().await;
                q.execute("migrate-set-capabilities", Some(ignore_shared_caps()))
                    .await?;
                q.execute_with_fd("getfd", Some(json!({"fdname": "infd"})), state.as_raw_fd())
                    .await?;
                q.execute("migrate-incoming", Some(json!({"uri": "fd:infd"})))
                    .await?;
                let end = tokio::time::Instant::now() + RESTORE_DEADLINE;
                loop {
                    if tokio::time::Instant::now() >= end {
                        return Err(VmmError::Exited {
                            during: "restore",
                            detail: format!(
                                "{} did not load within {} s",
                                device_state.display(),
                                RESTORE_DEADLINE.as_secs()
                            ),
                        });
                    }
                    let st = q.run_state().await?;
                    match st.as_str() {
                        "inmigrate" => tokio::time::sleep(Duration::from_micros(300)).await,
                        "paused" | "prelaunch" | "postmigrate" | "running" => break,
                        other => {
                            return Err(VmmError::Exited {
                                during: "restore",
                                detail: format!(
                                    "run state {other} after loading {}",
                                    device_state.display()
                                ),
                            });
                        }
                    }
                }
                tracing::debug!(?spawned, loaded = ?t0.elapsed(), "restore phases");
                Ok::<_, VmmError>(agent)
            }
            .await;
            match r {
                Ok(agent) => Ok(Restored {
                    vm: Box::new(vm),
                    agent,
                }),
                Err(e) => {
                    let _ = vm.kill().await;
                    Err(e)
                }
            }
        })
    }

    fn attach<'a>(
        &'a self,
        spec: &'a VmSpec,
        pid: u32,
    ) -> BoxFuture<'a, Result<Box<dyn VmInstance>, VmmError>> {
        Box::pin(async move {
            if !launch::process_runs_vm(pid, spec) {
                return Err(VmmError::NotRunning { pid });
            }
            let qmp = QmpClient::connect(&spec.qmp_socket(), Duration::from_secs(2)).await?;
            // Its NBD client reconnects to the exports it used (same socket paths).
            let exports = self
                .exports(spec)
                .await?
                .into_iter()
                .map(|(_, e)| e)
                .collect();
            // The QEMU keeps the uid it was started with: hold it, so no new VM gets it too.
            let uid = crate::vmm::uid::process_uid(pid);
            let pool = self.uids.as_ref().map(|u| u.pool.clone());
            let uid = match (&pool, uid) {
                (Some(p), Some(u)) if p.range().contains(u) => {
                    p.adopt(u);
                    Some(u)
                }
                _ => None,
            };
            Ok(Box::new(QemuVm {
                spec: spec.clone(),
                pid,
                qmp: Mutex::new(qmp),
                child: Mutex::new(None),
                cgroups: self.cgroups.clone(),
                uid,
                pool,
                released: Default::default(),
                _exports: exports,
            }) as Box<dyn VmInstance>)
        })
    }
}

/// Standard output of `bin args` (empty when it cannot run). With `-object memory-backend-file,help`, a
/// QEMU 8.2 or newer lists `rom=`: with `readonly=on,rom=off` it opens the file read-only and maps it
/// private and writable.
fn probe(bin: &Path, args: &[&str]) -> String {
    std::process::Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

fn ignore_shared_caps() -> serde_json::Value {
    json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})
}

/// One QEMU process with its QMP connection.
struct QemuVm {
    spec: VmSpec,
    pid: u32,
    qmp: Mutex<QmpClient>,
    child: Mutex<Option<Child>>,
    cgroups: Option<Hierarchy>,
    /// The uid it runs as, held in `pool` until it has exited.
    uid: Option<u32>,
    pool: Option<Arc<UidPool>>,
    /// Set once `uid` went back to the pool (a second exit wait must not free it again).
    released: std::sync::atomic::AtomicBool,
    /// The exports of its lazy disks, held while it runs.
    _exports: Vec<Arc<Export>>,
}

impl QemuVm {
    /// Waits up to `limit` for the process to exit (then drops its cgroup, takes its RAM file back and
    /// frees its uid); true when it did.
    async fn wait_exit(&self, limit: Duration) -> bool {
        let exited = self.wait_exit_only(limit).await;
        if exited && let Some(h) = &self.cgroups {
            h.release(&cgroup::vm_name(&self.spec));
        }
        if exited
            && let (Some(uid), Some(pool)) = (self.uid, &self.pool)
            && !self
                .released
                .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            if self.spec.ram_shared {
                crate::vmm::launch::reclaim(&self.spec.ram_file);
            }
            pool.release(uid);
        }
        exited
    }

    async fn wait_exit_only(&self, limit: Duration) -> bool {
        let wait = async {
            let mut child = self.child.lock().await;
            if let Some(c) = child.as_mut() {
                let _ = c.wait().await;
                *child = None;
                return;
            }
            while std::path::Path::new(&format!("/proc/{}", self.pid)).exists()
                && !launch::is_zombie(self.pid)
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    fn sigkill(&self) {
        // SAFETY: plain syscall; the pid belongs to a QEMU process this runtime started or attached.
        unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) };
    }

    fn not_exited(&self, during: &'static str) -> VmmError {
        VmmError::Exited {
            during,
            detail: format!(
                "QEMU pid {} still runs {} s after SIGKILL",
                self.pid,
                EXIT_DEADLINE.as_secs()
            ),
        }
    }
}

impl Pausable for QemuVm {
    fn stop(&self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move {
            self.qmp.lock().await.execute("stop", None).await?;
            Ok(())
        })
    }

    fn cont(&self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move {
            self.qmp.lock().await.execute("cont", None).await?;
            Ok(())
        })
    }
}

impl Snapshottable for QemuVm {
    fn save_device_state<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<(), VmmError>> {
        Box::pin(async move {
            let io = |what, e| VmmError::Io {
                what,
                path: path.to_owned(),
                source: e,
            };
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(path)
                .map_err(|e| io("create", e))?;
            let mut q = self.qmp.lock().await;
            q.execute("migrate-set-capabilities", Some(ignore_shared_caps()))
                .await?;
            // Private RAM travels in the stream: without this QEMU caps it at 128 MiB/s.
            q.execute(
                "migrate-set-parameters",
                Some(json!({"max-bandwidth": 107_374_182_400u64, "downtime-limit": 2000})),
            )
            .await?;
            q.execute_with_fd("getfd", Some(json!({"fdname": "snapfd"})), file.as_raw_fd())
                .await?;
            q.execute("migrate", Some(json!({"uri": "fd:snapfd"})))
                .await?;
            q.wait_migration(MIGRATION_DEADLINE).await?;
            Ok(())
        })
    }
}

impl VmInstance for QemuVm {
    fn alive(&self) -> bool {
        launch::process_runs_vm(self.pid, &self.spec)
    }

    fn set_background(&self, background: bool) {
        if let (Some(h), Some(_)) = (&self.cgroups, self.uid)
            && let Err(e) = h.set_background(&cgroup::vm_name(&self.spec), background)
        {
            tracing::warn!(pid = self.pid, error = %e, "setting the VM's CPU weight failed");
        }
    }

    fn pid(&self) -> u32 {
        self.pid
    }

    fn spec(&self) -> &VmSpec {
        &self.spec
    }

    fn shutdown(&self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move {
            let r = self.qmp.lock().await.execute("quit", None).await;
            // QEMU may close the socket before answering; either way, wait for the process.
            if let Err(e) = r {
                tracing::debug!(pid = self.pid, error = %e, "quit answered with an error");
            }
            if self.wait_exit(EXIT_DEADLINE).await {
                return Ok(());
            }
            tracing::warn!(pid = self.pid, "QEMU ignored quit; killing it");
            self.sigkill();
            if self.wait_exit(EXIT_DEADLINE).await {
                Ok(())
            } else {
                Err(self.not_exited("shutdown"))
            }
        })
    }

    fn kill(&self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move {
            self.sigkill();
            if self.wait_exit(EXIT_DEADLINE).await {
                Ok(())
            } else {
                Err(self.not_exited("kill"))
            }
        })
    }
}
