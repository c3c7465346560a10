//! The kernel's barrier under [`apply_layer`](crate::apply_layer)'s path rules: a layer is unpacked
//! (as root) on a thread of its own that
//!
//! 1. takes its own mount namespace and root/cwd (`unshare(CLONE_NEWNS | CLONE_FS)`: per thread),
//! 2. makes every mount in it private (nothing propagates back to the host),
//! 3. bind-mounts the destination onto itself and remounts that bind `nosuid,nodev`,
//! 4. `chroot`s into it and `chdir("/")`s,
//! 5. keeps only `CAP_CHOWN`, `CAP_DAC_OVERRIDE`, `CAP_FOWNER`, `CAP_FSETID`, `CAP_MKNOD` and
//!    `CAP_SETFCAP` (raw `capset` on this thread alone; the bounding set too where it may).
//!
//! So a path resolves inside the destination whatever it says (`/..`, absolute symlinks), device
//! nodes and setuid files are created as entries but are inert through the mount, and the thread
//! can neither chroot out, nor mount, nor unshare again (no `CAP_SYS_CHROOT`, no `CAP_SYS_ADMIN`).
//! The jail is permanent for its thread, so [`run_in`] spawns a fresh one and joins it.
//!
//! Not a user namespace (a multithreaded process cannot enter one): the thread stays uid 0 with
//! the capabilities above, which unpacking owners, modes and devices needs.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr;

use crate::error::OciError;

const CAP_CHOWN: u32 = 0;
const CAP_DAC_OVERRIDE: u32 = 1;
const CAP_FOWNER: u32 = 3;
const CAP_FSETID: u32 = 4;
const CAP_MKNOD: u32 = 27;
const CAP_SETFCAP: u32 = 31;
/// What unpacking needs: owners, reading and writing any entry, modes and times of others' files,
/// setuid/setgid bits, device nodes, `security.capability` xattrs.
const KEEP: [u32; 6] = [
    CAP_CHOWN,
    CAP_DAC_OVERRIDE,
    CAP_FOWNER,
    CAP_FSETID,
    CAP_MKNOD,
    CAP_SETFCAP,
];
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Runs `f` on a fresh thread jailed in `dest` (see the module) and returns its result; a panic in
/// `f` is resumed here. The calling thread's root, namespace and capabilities are untouched. Needs
/// root (`CAP_SYS_ADMIN`, `CAP_SYS_CHROOT`); any step that fails is [`OciError::Jail`] and `f` does
/// not run.
pub fn run_in<T: Send>(dest: &Path, f: impl FnOnce() -> T + Send) -> Result<T, OciError> {
    let root = dest.canonicalize().map_err(|source| OciError::Jail {
        step: "canonicalize",
        path: dest.to_owned(),
        source,
    })?;
    let root = &root;
    std::thread::scope(|s| {
        let jailed = std::thread::Builder::new()
            .name("oci-jail".into())
            .spawn_scoped(s, move || {
                enter(root).map_err(|(step, source)| OciError::Jail {
                    step,
                    path: root.clone(),
                    source,
                })?;
                Ok(f())
            })
            .map_err(|source| OciError::Jail {
                step: "spawn thread",
                path: root.clone(),
                source,
            })?;
        // Joining waits for the thread itself to end, and the jail with it.
        jailed
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

type Step = (&'static str, io::Error);

/// `Ok` for a zero return, else the step with `errno`.
fn check(step: &'static str, rc: impl Into<i64>) -> Result<(), Step> {
    if rc.into() == 0 {
        Ok(())
    } else {
        Err((step, io::Error::last_os_error()))
    }
}

/// Jails the calling thread in `root` (canonical); permanent for the thread.
fn enter(root: &Path) -> Result<(), Step> {
    let dir = CString::new(root.as_os_str().as_bytes()).map_err(|_| {
        let e = io::Error::new(io::ErrorKind::InvalidInput, "NUL in path");
        ("path", e)
    })?;
    let none = ptr::null::<libc::c_char>();
    // SAFETY: no pointers; it changes only this thread's fs context (root, cwd) and mount namespace.
    check("unshare", unsafe {
        libc::unshare(libc::CLONE_NEWNS | libc::CLONE_FS)
    })?;
    // SAFETY: a NUL-terminated target; NULL source, type and data are allowed for a propagation change.
    check("make mounts private", unsafe {
        libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            ptr::null(),
        )
    })?;
    // SAFETY: NUL-terminated source and target; NULL type and data are allowed for a bind mount.
    check("bind-mount", unsafe {
        libc::mount(dir.as_ptr(), dir.as_ptr(), none, libc::MS_BIND, ptr::null())
    })?;
    // A bind remount sets all per-mount flags: keep read-only and noexec (locked in a user namespace).
    // SAFETY: all-zero is a valid statvfs (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: dir is NUL-terminated and st a live, writable statvfs.
    check("statvfs", unsafe { libc::statvfs(dir.as_ptr(), &mut st) })?;
    let kept = st.f_flag & (libc::ST_RDONLY | libc::ST_NOEXEC);
    // SAFETY: as for the bind mount; MS_REMOUNT | MS_BIND changes only this mount's flags.
    check("remount nosuid,nodev", unsafe {
        libc::mount(
            none,
            dir.as_ptr(),
            none,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV | kept,
            ptr::null(),
        )
    })?;
    // SAFETY: NUL-terminated paths; both act on this thread's own fs context (unshared above).
    check("chroot", unsafe { libc::chroot(dir.as_ptr()) })?;
    // SAFETY: as above.
    check("chdir", unsafe { libc::chdir(c"/".as_ptr()) })?;
    drop_capabilities()
}

/// Leaves this thread only the [`KEEP`] capabilities (of those it has), effective and permitted; none
/// inheritable (so no ambient ones either).
fn drop_capabilities() -> Result<(), Step> {
    let keep = KEEP.iter().fold(0u64, |m, c| m | 1 << c);
    // The bounding set first: dropping from it needs CAP_SETPCAP, which capset removes. It only limits
    // what an execve could gain, and the jailed thread never execs: without CAP_SETPCAP it stays.
    for cap in 0..64u32 {
        if keep & (1 << cap) != 0 {
            continue;
        }
        // SAFETY: integer arguments only; PR_CAPBSET_DROP changes this thread's bounding set.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Past the kernel's last capability, or not allowed to drop (no CAP_SETPCAP).
                Some(libc::EINVAL) | Some(libc::EPERM) => break,
                _ => return Err(("drop bounding set", e)),
            }
        }
    }
    let (_, permitted) = thread_caps().map_err(|e| ("capget", e))?;
    set_thread_caps(permitted & keep).map_err(|e| ("capset", e))
}

/// This thread's (effective, permitted) capabilities, as bit masks.
#[doc(hidden)]
pub fn thread_caps() -> io::Result<(u64, u64)> {
    let mut hdr = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0, // this thread
    };
    let mut d = [CapData::default(); 2];
    // SAFETY: a version-3 header and the two-element data array that version writes.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut CapHeader, d.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let join = |f: fn(&CapData) -> u32| u64::from(f(&d[0])) | (u64::from(f(&d[1])) << 32);
    Ok((join(|x| x.effective), join(|x| x.permitted)))
}

/// Sets this thread's effective and permitted capabilities to `mask`, none inheritable (the raw
/// syscall: no other thread changes).
#[doc(hidden)]
pub fn set_thread_caps(mask: u64) -> io::Result<()> {
    let hdr = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let d = [0, 1].map(|i| {
        let m = (mask >> (32 * i)) as u32;
        CapData {
            effective: m,
            permitted: m,
            inheritable: 0,
        }
    });
    // SAFETY: a version-3 header and the two-element data array that version reads; pid 0 is the
    // calling thread only.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &hdr as *const CapHeader, d.as_ptr()) };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}
