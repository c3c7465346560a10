//! One unprivileged uid per QEMU process, like Firecracker's jailer: a QEMU taken over by its guest
//! runs as a uid no other VM has, so it can open no other sandbox's files.
//!
//! QEMU is *started* as that uid (`Command::uid`/`gid`; std clears the supplementary groups when it
//! drops from root): `-runas` cannot be used, because QEMU installs its seccomp filter
//! (`elevateprivileges=deny`) before it would drop privileges and dies with "Bad system call".
//!
//! A uid is free when this runtime does not hold it *and* no live process on the host has it as its
//! real, effective, saved or filesystem uid. The host check keeps other runtimes (other state folders,
//! parallel tests) and QEMU processes of a previous run that are not adopted yet from ever sharing a
//! uid; a host-wide `flock` makes "check, then start QEMU" atomic between runtimes.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;

/// Default first uid (and the VMs' group id): far above the ids distributions hand out.
pub const DEFAULT_UID_BASE: u32 = 1_000_000;
/// Default number of uids (one per concurrent VM).
pub const DEFAULT_UID_COUNT: u32 = 65_536;
/// Host-wide lock serialising allocations of all runtimes (root only: /run is root's).
const HOST_LOCK: &str = "/run/agentenv-qemu-uids.lock";

/// The uids VMs get: `base..base + count`, all in group `gid`.
///
/// gid choice: one group shared by all VMs, not a group per VM. A VM's own files grant its group
/// nothing (RAM files are 0600 and socket folders 0700, owned by the VM's uid; disks, console logs,
/// kernel and initrd reach QEMU as file descriptors). A fork capture's RAM is root's and 0640 to the
/// group, so that the forks can map it read-only, but it sits in 0700 root folders: only a VM handed
/// its descriptor can open it. A shared gid is what KVM needs: `/dev/kvm` is `root:kvm 0660`, QEMU must
/// open it itself (it takes no fd for it) and supplementary groups are cleared, so under KVM the VMs'
/// gid is the group of `/dev/kvm` (see [`vm_gid`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// First uid.
    pub base: u32,
    /// Number of uids.
    pub count: u32,
    /// Group id of every VM.
    pub gid: u32,
}

impl Default for UidRange {
    fn default() -> UidRange {
        UidRange {
            base: DEFAULT_UID_BASE,
            count: DEFAULT_UID_COUNT,
            gid: DEFAULT_UID_BASE,
        }
    }
}

impl UidRange {
    /// Whether `uid` is one of the range.
    pub fn contains(&self, uid: u32) -> bool {
        uid >= self.base && uid - self.base < self.count
    }
}

/// The gid VMs run with: `range.gid`, or under KVM the group of `/dev/kvm` when only its group may
/// open it.
pub fn vm_gid(range: &UidRange, kvm: bool) -> u32 {
    use std::os::unix::fs::MetadataExt;
    if kvm
        && let Ok(m) = std::fs::metadata("/dev/kvm")
        && m.mode() & 0o006 != 0o006
    {
        return m.gid();
    }
    range.gid
}

/// The uids this runtime has handed out.
#[derive(Debug)]
pub struct UidPool {
    range: UidRange,
    held: Mutex<BTreeSet<u32>>,
}

/// A uid taken from a [`UidPool`] for a QEMU about to start. Keep it until the process has been
/// spawned (it holds the host-wide allocation lock), then drop it: the pool keeps the uid until
/// [`UidPool::release`].
pub struct Lease {
    /// The uid.
    pub uid: u32,
    _host_lock: Option<std::fs::File>,
}

/// No uid of the range is free.
#[derive(Debug, thiserror::Error)]
#[error("no free QEMU uid in {base}..{} ({count} VMs run)", base + count)]
pub struct Exhausted {
    pub base: u32,
    pub count: u32,
}

impl UidPool {
    /// An empty pool over `range`.
    pub fn new(range: UidRange) -> UidPool {
        UidPool {
            range,
            held: Mutex::new(BTreeSet::new()),
        }
    }

    /// The range.
    pub fn range(&self) -> UidRange {
        self.range
    }

    /// The lowest uid that neither this pool holds nor any live process of the host uses.
    pub fn allocate(&self) -> Result<Lease, Exhausted> {
        let lock = host_lock();
        let live = live_uids(Path::new("/proc"));
        let uid = self.take_lowest(&live)?;
        Ok(Lease {
            uid,
            _host_lock: lock,
        })
    }

    fn take_lowest(&self, live: &BTreeSet<u32>) -> Result<u32, Exhausted> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let r = self.range;
        let uid = (r.base..r.base.saturating_add(r.count))
            .find(|u| !held.contains(u) && !live.contains(u))
            .ok_or(Exhausted {
                base: r.base,
                count: r.count,
            })?;
        held.insert(uid);
        Ok(uid)
    }

    /// Marks `uid` held (a re-attached QEMU from a previous run); uids outside the range are ignored.
    pub fn adopt(&self, uid: u32) {
        if self.range.contains(uid) {
            self.held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid);
        }
    }

    /// Gives `uid` back once its QEMU has exited.
    pub fn release(&self, uid: u32) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&uid);
    }

    /// The uids held now.
    pub fn held(&self) -> Vec<u32> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.iter().copied().collect()
    }
}

/// An exclusive `flock` on [`HOST_LOCK`], or `None` where it cannot be had (then only this process's
/// pool and the `/proc` check keep uids apart).
fn host_lock() -> Option<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(HOST_LOCK)
        .map_err(|e| tracing::warn!(path = HOST_LOCK, error = %e, "no host-wide uid lock"))
        .ok()?;
    // SAFETY: flock on an owned, open fd; held for a fork + exec at most.
    (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0).then_some(f)
}

/// Every uid (real, effective, saved, filesystem) of every process under `proc` that can still run
/// (a zombie, such as a killed QEMU its parent has not reaped yet, holds nothing).
pub fn live_uids(proc: &Path) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for e in std::fs::read_dir(proc).into_iter().flatten().flatten() {
        let is_pid = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.parse::<u32>().is_ok());
        if !is_pid {
            continue;
        }
        if let Ok(s) = std::fs::read_to_string(e.path().join("status"))
            && !is_gone(&s)
            && let Some(ids) = status_ids(&s, "Uid:")
        {
            out.extend(ids);
        }
    }
    out
}

/// Whether a `/proc/<pid>/status` is a zombie's or a dead process's.
fn is_gone(status: &str) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .is_some_and(|st| matches!(st.trim_start().chars().next(), Some('Z' | 'X')))
}

/// The four ids of a `/proc/<pid>/status` line (`Uid:` or `Gid:`): real, effective, saved, filesystem.
pub fn status_ids(status: &str, key: &str) -> Option<[u32; 4]> {
    let line = status.lines().find_map(|l| l.strip_prefix(key))?;
    let mut it = line.split_whitespace().map(|v| v.parse::<u32>());
    let mut ids = [0u32; 4];
    for id in &mut ids {
        *id = it.next()?.ok()?;
    }
    Some(ids)
}

/// The effective uid of process `pid`, if it runs.
pub fn process_uid(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_ids(&s, "Uid:").map(|ids| ids[1])
}

/// Whether this process runs as root (only root can start QEMU as another uid).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid(2) cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(count: u32) -> UidRange {
        let base = 2_000_000 + rand::random_range(0..1_000_000u32);
        UidRange {
            base,
            count,
            gid: base,
        }
    }

    #[test]
    fn lowest_free_uid_is_reused_only_after_release() {
        let r = range(3);
        let pool = UidPool::new(r);
        let none = BTreeSet::new();
        let a = pool.take_lowest(&none).unwrap();
        let b = pool.take_lowest(&none).unwrap();
        let c = pool.take_lowest(&none).unwrap();
        assert_eq!((a, b, c), (r.base, r.base + 1, r.base + 2));
        assert!(pool.take_lowest(&none).is_err(), "range exhausted");
        pool.release(b);
        assert_eq!(pool.take_lowest(&none).unwrap(), b);
        pool.release(a);
        pool.release(c);
        assert_eq!(pool.held(), vec![b]);
    }

    #[test]
    fn uids_of_live_processes_and_adopted_ones_are_skipped() {
        let r = range(4);
        let pool = UidPool::new(r);
        // A QEMU of another runtime (or not adopted yet) runs as base; one adopted runs as base + 1.
        let live = BTreeSet::from([r.base]);
        pool.adopt(r.base + 1);
        pool.adopt(r.base + 99);
        assert_eq!(pool.take_lowest(&live).unwrap(), r.base + 2);
        assert_eq!(pool.held(), vec![r.base + 1, r.base + 2]);
    }

    #[test]
    fn status_lines_parse_and_proc_lists_our_own_uid() {
        let s =
            "Name:\tqemu\nUid:\t1000003\t1000003\t1000003\t1000003\nGid:\t7\t8\t9\t10\nGroups:\t\n";
        assert_eq!(status_ids(s, "Uid:"), Some([1_000_003; 4]));
        assert_eq!(status_ids(s, "Gid:"), Some([7, 8, 9, 10]));
        assert_eq!(status_ids("Uid:\t1 2\n", "Uid:"), None);
        assert!(!is_gone(s) && !is_gone("State:\tS (sleeping)\n"));
        assert!(is_gone("State:\tZ (zombie)\n") && is_gone("State:\tX (dead)\n"));
        // SAFETY: getuid(2) cannot fail.
        let me = unsafe { libc::getuid() };
        assert!(live_uids(Path::new("/proc")).contains(&me));
        assert_eq!(process_uid(std::process::id()), Some(me));
    }

    #[test]
    fn range_membership() {
        let r = range(2);
        assert!(r.contains(r.base) && r.contains(r.base + 1));
        assert!(!r.contains(r.base + 2) && !r.contains(r.base - 1));
    }
}
