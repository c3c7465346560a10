//! What a QEMU process is handed: its files as inherited descriptors, so that a QEMU running as a
//! VM uid of its own ([`crate::vmm::uid`]) needs no permission on the state folder at all.
//!
//! - Disks (the overlay and its whole qcow2 backing chain, read-only) and the console log are opened
//!   here and passed as fd sets (`-add-fd`, `/dev/fdset/N`); the chain is named on the command line
//!   (`backing.file.filename=`), so QEMU never opens the paths in the qcow2 headers. They stay
//!   `root 0600`.
//! - The RAM file is inherited and named `/proc/self/fd/N`. Reopening through that link skips the path
//!   but not the file's own mode. A VM's own RAM file (mapped shared) is `chown`ed to the VM (`0600`)
//!   while it runs. A snapshot's RAM file mapped copy-on-write (`share=off,readonly=on,rom=off`, QEMU
//!   8.2 or newer; older ones open it `O_RDWR`) stays root's, `0640` to the VMs' group.
//! - The kernel and initrd (public, shared by all VMs, in the cache folder) go in as sealed memfds
//!   (read-only for everyone, sharable between VMs) when QEMU runs as another uid.
//! - QEMU creates its QMP and agent sockets in `<vm dir>/qemu/`, a folder owned by the VM (`0700`),
//!   named `/proc/self/fd/N/…` on the command line. The VM folder itself and its records stay
//!   `root 0700`/`0600`.
//!
//! Every `-add-fd` carries the real path as its `opaque` string, so the command line still names the
//! VM's folder (recovery finds a sandbox's QEMU by it: [`process_runs_vm`]). The steps a forked child
//! takes before exec (cgroups, namespaces, uid, KSM) are here too.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::vmm::{DiskFormat, SOCKET_DIR, VmSpec, VmmError};

/// Socket file name inside a lazy disk export's folder (`crate::vmm::lazy` serves it).
pub const LAZY_SOCKET: &str = "disk.sock";

/// Longest qcow2 backing chain accepted (snapshots of sandboxes made from snapshots, and so on).
const MAX_CHAIN: usize = 32;

/// A raw disk of the backing chain served over NBD ([`crate::vmm::lazy`]) instead of read from a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LazyBacking {
    /// Where the disk would be (as the chain names it).
    pub path: PathBuf,
    /// The export's socket folder, handed to QEMU as a descriptor.
    pub socket_dir: PathBuf,
    /// The NBD export name.
    pub export: String,
}

/// How long QEMU's NBD client waits for a lost export to come back (a runtime restart) before failing
/// reads.
const NBD_RECONNECT_S: u32 = 30;

/// The uid and gid a QEMU runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// The files of one QEMU start, open; dropped once QEMU has started (it has its own copies).
pub struct VmFiles {
    held: Vec<File>,
    shared: Vec<Arc<File>>,
    n_sets: usize,
    /// `-add-fd` values.
    pub add_fds: Vec<String>,
    /// `-kernel`, `-initrd`.
    pub kernel: String,
    pub initrd: String,
    /// `mem-path=` of the RAM backend.
    pub ram: String,
    /// `path=` of the console chardev.
    pub console: String,
    /// QMP and agent socket paths as QEMU binds them.
    pub qmp_socket: String,
    pub agent_socket: String,
    /// The `-drive` value of the root disk.
    pub drive: String,
    /// `-blockdev` values of the nodes the drive's chain references (lazy disks over NBD).
    pub blockdevs: Vec<String>,
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VmmError {
    let path = path.to_owned();
    move |source| VmmError::Io { what, path, source }
}

/// The guest's disk I/O, whatever the guest does: 256 MiB/s and 4,000 operations a second sustained,
/// bursts to twice that for a second (QEMU's block throttling), so one sandbox cannot take the host's
/// disk from the others.
pub const DISK_THROTTLE: &str = "throttling.bps-total=268435456,throttling.iops-total=4000,\
     throttling.bps-total-max=536870912,throttling.iops-total-max=8000";

/// A comma inside a QEMU option value is written twice.
fn opt(s: &str) -> String {
    s.replace(',', ",,")
}

impl VmFiles {
    /// Opens every file of `spec` for a QEMU running as `owner` (`None`: as this process), prepares
    /// its socket folder and hands it and the RAM file to `owner`. Disks of the chain named in `lazy`
    /// are read over NBD. `ram_via_memfd`: a private RAM file goes in as its [`ram_base`] memfd.
    pub fn open(
        spec: &VmSpec,
        owner: Option<Owner>,
        lazy: &[LazyBacking],
        ram_via_memfd: bool,
    ) -> Result<VmFiles, VmmError> {
        let mut f = VmFiles {
            held: Vec::new(),
            shared: Vec::new(),
            n_sets: 0,
            add_fds: Vec::new(),
            kernel: String::new(),
            initrd: String::new(),
            ram: String::new(),
            console: String::new(),
            qmp_socket: String::new(),
            agent_socket: String::new(),
            drive: String::new(),
            blockdevs: Vec::new(),
        };
        let console = spec.console_log();
        let log = File::options()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&console)
            .map_err(io("open", &console))?;
        f.console = format!("/dev/fdset/{}", f.add_set(&console, vec![log]));

        let sock_dir = spec.dir.join(SOCKET_DIR);
        let _ = std::fs::remove_dir_all(&sock_dir);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&sock_dir)
            .map_err(io("create", &sock_dir))?;
        let dir = File::open(&sock_dir).map_err(io("open", &sock_dir))?;
        if let Some(o) = owner {
            std::os::unix::fs::fchown(&dir, Some(o.uid), Some(o.gid))
                .map_err(io("chown", &sock_dir))?;
        }
        let d = f.inherit(dir);
        f.qmp_socket = format!("/proc/self/fd/{d}/qmp.sock");
        f.agent_socket = format!("/proc/self/fd/{d}/agent.sock");
        f.ram = if ram_via_memfd && !spec.ram_shared {
            f.share(ram_base(&spec.ram_file)?)
        } else {
            let ram = File::options()
                .read(true)
                .write(spec.ram_shared)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&spec.ram_file)
                .map_err(io("open", &spec.ram_file))?;
            if let Some(o) = owner {
                // A RAM file of its own is the VM's alone; a snapshot's, mapped copy-on-write by several
                // VMs (`readonly=on,rom=off`), stays root's and is only readable by the VMs' group.
                let (uid, mode) = match spec.ram_shared {
                    true => (Some(o.uid), 0o600),
                    false => (None, 0o640),
                };
                std::os::unix::fs::fchown(&ram, uid, Some(o.gid))
                    .map_err(io("chown", &spec.ram_file))?;
                ram.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
                    .map_err(io("chmod", &spec.ram_file))?;
            }
            format!("/proc/self/fd/{}", f.inherit(ram))
        };

        match owner {
            Some(_) => {
                f.kernel = f.share(boot_file(&spec.kernel)?);
                f.initrd = f.share(boot_file(&spec.initrd)?);
            }
            None => {
                f.kernel = spec.kernel.display().to_string();
                f.initrd = spec.initrd.display().to_string();
            }
        }

        let top_format = match spec.disk_format {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        };
        let rw = File::options()
            .read(true)
            .write(true)
            .open(&spec.disk)
            .map_err(io("open", &spec.disk))?;
        let ro = File::open(&spec.disk).map_err(io("open", &spec.disk))?;
        // QEMU reopens the image read-only while nothing writes it (before `cont`), then read-write:
        // the set holds both. No image locking: QEMU's locks are per open file, and the set keeps
        // both open files alive after QEMU closes its copies, so a read lock taken through the
        // read-only one would outlive its use and refuse the write lock `cont` takes after a
        // migration. The runtime itself never lets two QEMUs open one overlay.
        let set = f.add_set(&spec.disk, vec![rw, ro]);
        f.drive = format!(
            "id=root,file=/dev/fdset/{set},format={top_format},if=none,cache=writeback,file.locking=off,{}",
            DISK_THROTTLE
        );
        let chain = match spec.disk_format {
            DiskFormat::Raw => Vec::new(),
            DiskFormat::Qcow2 => {
                backing_chain_with(&spec.disk, &|p| lazy.iter().any(|l| l.path == p))
                    .map_err(io("read backing chain of", &spec.disk))?
            }
        };
        for (depth, (path, format)) in chain.iter().enumerate() {
            let p = "backing.".repeat(depth + 1);
            if let Some(l) = lazy.iter().find(|l| &l.path == path) {
                // Nodes of their own, referenced by name: QEMU then ignores the file name in the header.
                let dir = File::open(&l.socket_dir).map_err(io("open", &l.socket_dir))?;
                let d = f.inherit(dir);
                let node = format!("lazy{depth}");
                f.blockdevs.push(format!(
                    "driver=nbd,node-name={node}-nbd,server.type=unix,\
                     server.path=/proc/self/fd/{d}/{sock},export={export},\
                     reconnect-delay={NBD_RECONNECT_S},read-only=on",
                    sock = LAZY_SOCKET,
                    export = opt(&l.export),
                ));
                f.blockdevs.push(format!(
                    "driver=raw,node-name={node},file={node}-nbd,read-only=on"
                ));
                let p = p.trim_end_matches('.');
                f.drive.push_str(&format!(",{p}={node}"));
                break;
            }
            let file = File::open(path).map_err(io("open", path))?;
            let set = f.add_set(path, vec![file]);
            f.drive.push_str(&format!(
                ",{p}driver={format},{p}file.filename=/dev/fdset/{set}"
            ));
        }
        Ok(f)
    }

    /// Descriptors QEMU must inherit.
    pub fn fds(&self) -> Vec<RawFd> {
        self.held
            .iter()
            .map(|f| f.as_raw_fd())
            .chain(self.shared.iter().map(|f| f.as_raw_fd()))
            .collect()
    }

    fn inherit(&mut self, f: File) -> RawFd {
        let fd = f.as_raw_fd();
        self.held.push(f);
        fd
    }

    fn share(&mut self, f: Arc<File>) -> String {
        let fd = f.as_raw_fd();
        self.shared.push(f);
        format!("/proc/self/fd/{fd}")
    }

    /// Adds `files` (all of `path`) as a new fd set; returns its id.
    fn add_set(&mut self, path: &Path, files: Vec<File>) -> usize {
        self.n_sets += 1;
        let set = self.n_sets;
        let opaque = opt(&path.display().to_string());
        for file in files {
            let fd = self.inherit(file);
            self.add_fds
                .push(format!("fd={fd},set={set},opaque={opaque}"));
        }
        set
    }
}

/// Clears close-on-exec on `fds` in a forked child, so exec hands them to QEMU at the same numbers.
///
/// # Safety
/// For `pre_exec`: runs between fork and exec and only calls fcntl(2).
pub unsafe fn inherit_in_child(fds: &[RawFd]) -> std::io::Result<()> {
    for fd in fds {
        // SAFETY: fcntl on descriptors this process holds open; async-signal-safe.
        if unsafe { libc::fcntl(*fd, libc::F_SETFD, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// True when `pid` is alive (not a zombie) and its command line names this VM's folder (its QMP
/// socket for older versions, its console log's `-add-fd` now).
pub fn process_runs_vm(pid: u32, spec: &VmSpec) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = format!("{}/", spec.dir.display());
    let cmdline = String::from_utf8_lossy(&cmdline);
    cmdline.contains(&needle) && !is_zombie(pid)
}

/// True when `pid` is gone or a zombie.
pub fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// prctl(2) option of Linux 6.4+: every mapping of the process, now and after exec, is KSM-mergeable.
const PR_SET_MEMORY_MERGE: libc::c_int = 67;
/// Its query.
const PR_GET_MEMORY_MERGE: libc::c_int = 68;

/// Logs why `mem_merge` will merge less than asked on this host: a kernel without
/// [`PR_SET_MEMORY_MERGE`] (guest RAM only), or KSM not running (nothing).
pub fn warn_where_merging_is_off() {
    // SAFETY: a query with no pointers.
    if unsafe { libc::prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) } < 0 {
        tracing::warn!(
            "this kernel cannot merge a whole process (PR_SET_MEMORY_MERGE, Linux 6.4+): only guest RAM is mergeable"
        );
    }
    if !std::fs::read_to_string("/sys/kernel/mm/ksm/run").is_ok_and(|r| r.trim() == "1") {
        tracing::warn!(
            "mem_merge is on but the host's KSM is not running (/sys/kernel/mm/ksm/run): nothing is merged until it is"
        );
    }
}

/// Makes the whole process KSM-mergeable, across exec. Best effort ([`warn_where_merging_is_off`] told
/// at startup): an older kernel merges only guest RAM.
///
/// # Safety
/// For `pre_exec`: one prctl(2) with no pointers.
pub unsafe fn merge_any_in_child() {
    // SAFETY: as above.
    unsafe { libc::prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) };
}

/// For `pre_exec` of a root runtime's QEMU: joins its cgroups (writes `0` to each `cgroup.procs`
/// descriptor), moves to an empty network namespace of its own (its tap arrives as a descriptor) and
/// into `jail`, then drops to `uid`:`gid` with no supplementary groups. Any step that fails fails the
/// spawn.
///
/// # Safety
/// For `pre_exec`: runs between fork and exec and only makes async-signal-safe system calls.
pub unsafe fn confine_in_child(
    procs: &[RawFd],
    jail: &crate::vmm::jail::Jail,
    uid: u32,
    gid: u32,
) -> std::io::Result<()> {
    let check = |r: libc::c_int| {
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    for fd in procs {
        // SAFETY: write(2) of a static byte to a descriptor this process holds open.
        if unsafe { libc::write(*fd, b"0".as_ptr().cast(), 1) } != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    // SAFETY: unshare(2), setgroups(2), setgid(2), setuid(2): plain system calls with no pointers
    // but setgroups' empty list; `Jail::enter` has the same contract as this function.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNET))?;
        jail.enter()?;
        check(libc::setgroups(0, std::ptr::null()))?;
        check(libc::setgid(gid))?;
        check(libc::setuid(uid))?;
    }
    Ok(())
}

/// The backing files of the qcow2 image `disk`, nearest first, each with its format.
pub fn backing_chain(disk: &Path) -> std::io::Result<Vec<(PathBuf, &'static str)>> {
    backing_chain_with(disk, &|_| false)
}

/// [`backing_chain`] where files `lazy` says are served lazily (raw, not held here) end the chain.
pub fn backing_chain_with(
    disk: &Path,
    lazy: &dyn Fn(&Path) -> bool,
) -> std::io::Result<Vec<(PathBuf, &'static str)>> {
    let mut out = Vec::new();
    let mut cur = disk.to_owned();
    while let Some(next) = qcow2_backing(&cur)? {
        if out.len() >= MAX_CHAIN {
            return Err(std::io::Error::other(format!(
                "backing chain longer than {MAX_CHAIN}"
            )));
        }
        let format = if lazy(&next) || !is_qcow2(&next)? {
            "raw"
        } else {
            "qcow2"
        };
        out.push((next.clone(), format));
        if format == "raw" {
            break;
        }
        cur = next;
    }
    Ok(out)
}

fn is_qcow2(path: &Path) -> std::io::Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let n = File::open(path)?.read(&mut magic)?;
    Ok(n == 4 && &magic == b"QFI\xfb")
}

/// The backing file named in the header of qcow2 image `path` (relative names resolve against its
/// folder), `None` without one.
fn qcow2_backing(path: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::FileExt;
    let f = File::open(path)?;
    let mut h = [0u8; 20];
    f.read_exact_at(&mut h, 0)?;
    if &h[..4] != b"QFI\xfb" {
        return Ok(None);
    }
    let offset = u64::from_be_bytes(h[8..16].try_into().unwrap_or_default());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap_or_default()) as usize;
    if offset == 0 || len == 0 {
        return Ok(None);
    }
    if len > 1023 {
        return Err(std::io::Error::other(format!(
            "backing file name of {} bytes",
            len
        )));
    }
    let mut name = vec![0u8; len];
    f.read_exact_at(&mut name, offset)?;
    let name = PathBuf::from(std::ffi::OsString::from_vec(name));
    Ok(Some(match path.parent() {
        Some(dir) if name.is_relative() => dir.join(name),
        _ => name,
    }))
}

/// Identity of a file's content: device, inode, size, modification time.
type FileKey = (u64, u64, u64, i64, i64);
/// Files made into sealed memfds, newest first. `None`: a capture made straight into the memfd
/// ([`register_ram_base`]), served by path until [`forget_ram_base`] and never evicted.
type Sealed = Vec<(PathBuf, Option<FileKey>, Arc<File>)>;

/// `path` as a sealed memfd (no writes, no size change, ever), made once per file and process.
/// Its inode is a memfd's (mode 0777): any VM uid may reopen it through `/proc/self/fd`, none can change
/// it. The file's own permissions stay as they are.
pub fn boot_file(path: &Path) -> Result<Arc<File>, VmmError> {
    static CACHE: Mutex<Sealed> = Mutex::new(Vec::new());
    sealed_copy(path, c"agentenv-boot", &CACHE, usize::MAX)
}

/// How many private RAM files [`ram_base`] keeps as memfds for later VMs (each holds the file's data in
/// memory while kept; VMs that map one hold it on their own).
pub const RAM_BASES_KEPT: usize = 4;

static RAM_BASES: Mutex<Sealed> = Mutex::new(Vec::new());

/// A private RAM file (a snapshot's, mapped copy-on-write by its forks) as a sealed memfd, made once
/// and mapped by every VM restored from it, so their untouched pages are one copy in memory. QEMU older
/// than 8.2 opens a `share=off` RAM file for writing, which a VM uid may not do to the snapshot's file
/// (root's, `0640`), but may to a memfd whose seals refuse every write and size change; its private
/// mapping still takes the guest's writes. Holes stay holes.
pub fn ram_base(path: &Path) -> Result<Arc<File>, VmmError> {
    sealed_copy(path, c"agentenv-ram", &RAM_BASES, RAM_BASES_KEPT)
}

/// An empty memfd for a RAM capture that [`register_ram_base`] then serves.
pub fn ram_memfd() -> Result<File, VmmError> {
    new_memfd(c"agentenv-ram", Path::new("a RAM capture"))
}

/// Seals `mem` (a capture of the RAM file `path` names, which need not exist) and serves it as
/// `path`'s [`ram_base`] until [`forget_ram_base`]: forks map the capture without a second copy.
pub fn register_ram_base(path: &Path, mem: File) -> Result<Arc<File>, VmmError> {
    seal(&mem, path)?;
    let mem = Arc::new(mem);
    let mut cache = RAM_BASES.lock().unwrap_or_else(|e| e.into_inner());
    cache.retain(|(p, _, _)| p != path);
    cache.insert(0, (path.to_owned(), None, mem.clone()));
    Ok(mem)
}

/// Whether `path` is served from a registered capture (its file may not exist).
pub fn registered_ram_base(path: &Path) -> bool {
    let cache = RAM_BASES.lock().unwrap_or_else(|e| e.into_inner());
    cache.iter().any(|(p, k, _)| p == path && k.is_none())
}

/// Stops serving `path` from a registered capture (VMs that map it keep their mapping).
pub fn forget_ram_base(path: &Path) {
    let mut cache = RAM_BASES.lock().unwrap_or_else(|e| e.into_inner());
    cache.retain(|(p, k, _)| !(p == path && k.is_none()));
}

fn new_memfd(name: &std::ffi::CStr, what: &Path) -> Result<File, VmmError> {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is owned by the File below.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io("memfd_create for", what)(std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just created and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn seal(mem: &File, what: &Path) -> Result<(), VmmError> {
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on the memfd owned by `mem`.
    if unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io("seal", what)(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn sealed_copy(
    path: &Path,
    name: &std::ffi::CStr,
    cache: &Mutex<Sealed>,
    keep: usize,
) -> Result<Arc<File>, VmmError> {
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, f)) = cache.iter().find(|(p, k, _)| p == path && k.is_none()) {
        return Ok(f.clone());
    }
    let src = File::open(path).map_err(io("open", path))?;
    let m = src.metadata().map_err(io("stat", path))?;
    let key = Some((m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec()));
    if let Some(i) = cache.iter().position(|(p, k, _)| p == path && *k == key) {
        let hit = cache.remove(i);
        let f = hit.2.clone();
        cache.insert(0, hit);
        return Ok(f);
    }
    let mem = new_memfd(name, path)?;
    crate::sparse::copy_files(&src, &mem).map_err(io("copy", path))?;
    seal(&mem, path)?;
    let mem = Arc::new(mem);
    cache.retain(|(p, _, _)| p != path);
    cache.insert(0, (path.to_owned(), key, mem.clone()));
    // Registered captures are not counted and never evicted.
    let mut kept = 0;
    cache.retain(|(_, k, _)| {
        kept += usize::from(k.is_some());
        k.is_none() || kept <= keep
    });
    Ok(mem)
}

/// Gives `path` (a VM's RAM file after its QEMU exited) back to this process's uid, so a later VM
/// that gets the same uid cannot open it (a RAM folder such as /dev/shm is reachable by path).
pub fn reclaim(path: &Path) {
    let Ok(f) = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    else {
        return;
    };
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    if let Err(e) = std::os::unix::fs::fchown(&f, Some(uid), Some(gid)) {
        tracing::warn!(path = %path.display(), error = %e, "cannot take a RAM file back from its VM");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img(args: &[&str]) -> bool {
        std::process::Command::new("qemu-img")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    #[test]
    fn backing_chains_are_read_from_qcow2_headers() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n).display().to_string();
        std::fs::write(p("base.raw"), vec![0u8; 1 << 20]).unwrap();
        if !qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            &p("base.raw"),
            &p("mid.qcow2"),
        ]) {
            k3_common::require::skip_part(k3_common::require::Part::Qemu, "launch", "no qemu-img");
            return;
        }
        // The top names its backing file relative to its own folder.
        assert!(qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            "mid.qcow2",
            &p("top.qcow2")
        ]));
        let chain = backing_chain(Path::new(&p("top.qcow2"))).unwrap();
        assert_eq!(
            chain,
            vec![
                (PathBuf::from(p("mid.qcow2")), "qcow2"),
                (PathBuf::from(p("base.raw")), "raw")
            ]
        );
        assert!(backing_chain(Path::new(&p("base.raw"))).unwrap().is_empty());
    }

    #[test]
    fn a_lazy_base_is_an_nbd_node_the_chain_names() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.ext4");
        let marker = crate::vmm::lazy::LazyMarker {
            manifest: "ab".repeat(32),
            len: 1 << 30,
        };
        crate::vmm::lazy::write_marker(&base, &marker).unwrap();
        if !qemu_img(&["--version"]) {
            k3_common::require::skip_part(k3_common::require::Part::Qemu, "launch", "no qemu-img");
            return;
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let overlay = dir.path().join("disk.qcow2");
        rt.block_on(crate::fsops::create_overlay(&base, &overlay))
            .unwrap();
        assert!(!base.exists(), "the overlay is made without the base");
        std::fs::write(dir.path().join("ram"), b"").unwrap();
        let spec = VmSpec {
            dir: dir.path().to_owned(),
            kernel: "vmlinux".into(),
            initrd: "initrd".into(),
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 16,
            ram_file: dir.path().join("ram"),
            ram_shared: true,
            disk: overlay,
            disk_format: DiskFormat::Qcow2,
            nic: false,
            tap: None,
            cpu: None,
            free_page_reporting: false,
            background: false,
        };
        let socks = dir.path().join("nbd");
        std::fs::create_dir(&socks).unwrap();
        let lazy = LazyBacking {
            path: base.clone(),
            socket_dir: socks,
            export: "disk".into(),
        };
        let f = VmFiles::open(&spec, None, &[lazy], false).unwrap();
        assert!(f.drive.ends_with(",backing=lazy0"), "{}", f.drive);
        assert!(
            f.drive
                .contains(",throttling.bps-total=268435456,throttling.iops-total=4000,"),
            "every root disk is throttled: {}",
            f.drive
        );
        assert_eq!(f.blockdevs.len(), 2, "{:?}", f.blockdevs);
        assert!(
            f.blockdevs[0].starts_with(
                "driver=nbd,node-name=lazy0-nbd,server.type=unix,server.path=/proc/self/fd/"
            ) && f.blockdevs[0].contains("/disk.sock,export=disk,"),
            "{}",
            f.blockdevs[0]
        );
        assert_eq!(
            f.blockdevs[1],
            "driver=raw,node-name=lazy0,file=lazy0-nbd,read-only=on"
        );
        // Without the export the same chain cannot start (the base is not here).
        assert!(VmFiles::open(&spec, None, &[], false).is_err());
    }

    #[test]
    fn ram_bases_are_sealed_sparse_copies_kept_for_the_newest_files() {
        use std::os::unix::fs::FileExt;
        let _turn = RAM_BASES_TEST.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let mk = |i: usize| {
            let p = dir.path().join(format!("ram{i}.mem"));
            let f = File::create(&p).unwrap();
            f.set_len(64 << 20).unwrap();
            let off = rand::random_range(0..60u64) << 20;
            f.write_all_at(&rand::random::<[u8; 4096]>(), off).unwrap();
            p
        };
        let first = mk(0);
        let a = ram_base(&first).unwrap();
        assert!(Arc::ptr_eq(&a, &ram_base(&first).unwrap()), "made once");
        let link = format!("/proc/self/fd/{}", a.as_raw_fd());
        assert_eq!(
            std::fs::read(&link).unwrap(),
            std::fs::read(&first).unwrap()
        );
        let held = a.metadata().unwrap().blocks() * 512;
        assert!(held < 1 << 20, "holes were filled: {held} bytes");
        let w = File::options().write(true).open(&link).unwrap();
        assert!(
            w.write_all_at(b"x", 0).is_err(),
            "the memfd is write-sealed"
        );
        for i in 1..=RAM_BASES_KEPT {
            ram_base(&mk(i)).unwrap();
        }
        assert!(
            !Arc::ptr_eq(&a, &ram_base(&first).unwrap()),
            "an evicted file is made again"
        );
    }

    /// The RAM base cache is process-wide: its tests take turns.
    static RAM_BASES_TEST: Mutex<()> = Mutex::new(());

    #[test]
    fn a_registered_capture_is_served_without_its_file_until_forgotten() {
        use std::os::unix::fs::FileExt;
        let _turn = RAM_BASES_TEST.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("capture.mem");
        let mem = ram_memfd().unwrap();
        let data: Vec<u8> = (0..8192).map(|_| rand::random::<u8>()).collect();
        mem.write_all_at(&data, 1 << 20).unwrap();
        let reg = register_ram_base(&path, mem).unwrap();
        assert!(registered_ram_base(&path));
        let link = format!("/proc/self/fd/{}", reg.as_raw_fd());
        let w = File::options().write(true).open(&link).unwrap();
        assert!(w.write_all_at(b"x", 0).is_err(), "the capture is sealed");
        // Other files made into bases do not evict it.
        for i in 0..=RAM_BASES_KEPT {
            let p = dir.path().join(format!("other{i}.mem"));
            std::fs::write(&p, rand::random::<[u8; 4096]>()).unwrap();
            ram_base(&p).unwrap();
        }
        let got = ram_base(&path).unwrap();
        assert!(Arc::ptr_eq(&got, &reg), "served by path, no file needed");
        let mut back = vec![0u8; data.len()];
        got.read_exact_at(&mut back, 1 << 20).unwrap();
        assert_eq!(back, data);
        forget_ram_base(&path);
        assert!(!registered_ram_base(&path));
        assert!(ram_base(&path).is_err(), "forgotten, and there is no file");
    }

    #[test]
    fn boot_files_are_sealed_copies_made_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmlinux");
        let data: Vec<u8> = (0..100_000).map(|_| rand::random::<u8>()).collect();
        std::fs::write(&path, &data).unwrap();
        let a = boot_file(&path).unwrap();
        let b = boot_file(&path).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let link = format!("/proc/self/fd/{}", a.as_raw_fd());
        assert_eq!(std::fs::read(&link).unwrap(), data);
        let w = File::options().write(true).open(&link).unwrap();
        use std::io::Write;
        assert!((&w).write_all(b"x").is_err(), "the memfd is write-sealed");
        assert_eq!(std::fs::read(&link).unwrap(), data);
    }
}
