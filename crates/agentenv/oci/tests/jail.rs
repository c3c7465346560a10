//! The layer jail (as root): a thread chrooted into the destination, mounted nosuid,nodev in a
//! mount namespace of its own, with only the capabilities unpacking needs; and `apply_layer` in it.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use agentenv_oci::testing::{LayerBuilder, TestLayer, read};
use agentenv_oci::{ApplyOptions, ApplyStats, Compression, Digest, OciError, apply_layer, jail};
use k3_common::require::{Part, skip_part};

/// The capabilities the jail keeps: CHOWN, DAC_OVERRIDE, FOWNER, FSETID, MKNOD, SETFCAP.
const KEPT: u64 = 1 << 0 | 1 << 1 | 1 << 3 | 1 << 4 | 1 << 27 | 1 << 31;
const CAP_SETPCAP: u64 = 1 << 8;
const CAP_SYS_ADMIN: u64 = 1 << 21;

fn not_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return false;
    }
    skip_part(
        Part::Root,
        test,
        "the jail needs root (unshare, mount, chroot); without it apply_layer runs unjailed",
    );
    true
}

fn apply(dest: &Path, tar: &[u8]) -> Result<ApplyStats, OciError> {
    let layer = TestLayer::new(tar, Compression::Gzip);
    apply_layer(
        dest,
        &layer.blob.bytes[..],
        &ApplyOptions {
            layer: Digest::of(&layer.blob.bytes).to_string(),
            compression: Compression::Gzip,
            diff_id: Some(layer.diff_id),
            max_file_bytes: u64::MAX,
            max_entries: u64::MAX,
        },
    )
}

fn c(p: impl AsRef<Path>) -> CString {
    CString::new(p.as_ref().as_os_str().as_bytes()).unwrap()
}

/// errno of a failed libc call (`rc` -1), or `None` when it succeeded.
fn errno(rc: libc::c_int) -> Option<i32> {
    (rc != 0).then(|| io::Error::last_os_error().raw_os_error().unwrap())
}

/// This thread's (effective, permitted) capabilities.
fn caps() -> (u64, u64) {
    agentenv_oci::jail::thread_caps().expect("capget")
}

/// Sets this thread's effective and permitted capabilities.
fn set_caps(mask: u64) {
    agentenv_oci::jail::set_thread_caps(mask).expect("capset");
}

fn thread_view() -> (PathBuf, PathBuf) {
    (
        std::fs::read_link("/proc/thread-self/ns/mnt").unwrap(),
        std::fs::read_link("/proc/thread-self/root").unwrap(),
    )
}

#[test]
fn a_jailed_thread_sees_only_its_folder_and_cannot_leave_it() {
    if not_root("a_jailed_thread_sees_only_its_folder_and_cannot_leave_it") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dest = t.path().join("root");
    std::fs::create_dir(&dest).unwrap();
    let host = t.path().join("host-file");
    std::fs::write(&host, b"host secret").unwrap();
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o644)).unwrap();
    let before = thread_view();
    let (caller_caps, _) = caps();
    // SAFETY: gettid has no preconditions.
    let caller_tid = unsafe { libc::gettid() };

    let host_in = host.clone();
    let inside = jail::run_in(&dest, move || {
        // SAFETY: gettid has no preconditions.
        assert_ne!(unsafe { libc::gettid() }, caller_tid, "a fresh thread");
        std::fs::write("/../../x", b"written in the jail").unwrap();
        let host_read = std::fs::read(&host_in).map_err(|e| e.kind());
        // SAFETY: NUL-terminated path; S_IFCHR with 1:3 (/dev/null's numbers).
        let mknod = errno(unsafe {
            libc::mknod(
                c("/null").as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(1, 3),
            )
        });
        let open_dev = std::fs::File::open("/null").map_err(|e| e.raw_os_error());
        // SAFETY: all-zero is a valid statvfs, filled by the call.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: NUL-terminated path and a live statvfs.
        assert_eq!(unsafe { libc::statvfs(c"/".as_ptr(), &mut st) }, 0);
        std::fs::create_dir("/tmp").unwrap();
        // SAFETY: NUL-terminated path.
        let chroot = errno(unsafe { libc::chroot(c"/tmp".as_ptr()) });
        // SAFETY: NUL-terminated strings; NULL data.
        let mount = errno(unsafe {
            libc::mount(
                c"none".as_ptr(),
                c"/tmp".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        });
        // SAFETY: NUL-terminated path; MS_REMOUNT of the jail's own root without nosuid,nodev.
        let remount = errno(unsafe {
            libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_BIND,
                std::ptr::null(),
            )
        });
        // SAFETY: no pointers.
        let unshare = errno(unsafe { libc::unshare(libc::CLONE_NEWNS) });
        // SAFETY: integer arguments only.
        let bounding_admin = unsafe { libc::prctl(libc::PR_CAPBSET_READ, 21, 0, 0, 0) };
        let still_outside = std::fs::metadata("/../../../..").unwrap().ino();
        (
            host_read,
            mknod,
            open_dev,
            st.f_flag,
            chroot,
            mount,
            remount,
            unshare,
            caps(),
            bounding_admin,
            still_outside,
        )
    })
    .unwrap();
    let (host_read, mknod, open_dev, flags, chroot, mount, remount, unshare, jcaps, bset, top) =
        inside;

    assert_eq!(
        read(&dest.join("x")),
        b"written in the jail",
        "/../../x lands in dest"
    );
    assert_eq!(
        host_read,
        Err(io::ErrorKind::NotFound),
        "a host path is not reachable"
    );
    assert_eq!(
        top,
        std::fs::metadata(&dest).unwrap().ino(),
        "`/..` is dest"
    );
    assert_eq!(
        mknod, None,
        "mknod of a char device is allowed (an image entry)"
    );
    let m = std::fs::symlink_metadata(dest.join("null")).unwrap();
    assert!(m.file_type().is_char_device());
    assert_eq!(m.rdev(), libc::makedev(1, 3));
    assert_eq!(
        open_dev.unwrap_err(),
        Some(libc::EACCES),
        "nodev: the device is inert"
    );
    assert_eq!(flags & libc::ST_NOSUID, libc::ST_NOSUID, "mounted nosuid");
    assert_eq!(flags & libc::ST_NODEV, libc::ST_NODEV, "mounted nodev");
    assert_eq!(
        chroot,
        Some(libc::EPERM),
        "no chroot out (no CAP_SYS_CHROOT)"
    );
    assert_eq!(mount, Some(libc::EPERM), "no mount (no CAP_SYS_ADMIN)");
    assert_eq!(remount, Some(libc::EPERM), "no remount of its root");
    assert_eq!(unshare, Some(libc::EPERM), "no new namespace");
    assert_eq!(
        jcaps,
        (caller_caps & KEPT, caller_caps & KEPT),
        "only unpacking's capabilities"
    );
    if caller_caps & CAP_SETPCAP != 0 {
        assert_eq!(bset, 0, "CAP_SYS_ADMIN left the thread's bounding set");
    }

    // The calling thread is as it was.
    assert_eq!(thread_view(), before, "mount namespace and root unchanged");
    assert_eq!(caps().0, caller_caps);
    assert_eq!(read(&host), b"host secret", "the host file reads again");
    println!(
        "jail: caps {:#x} of {caller_caps:#x}, mount flags {flags:#x}",
        jcaps.0
    );
}

#[test]
fn device_nodes_and_setuid_files_are_created_but_inert_through_the_jail() {
    if not_root("device_nodes_and_setuid_files_are_created_but_inert_through_the_jail") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let dest = t.path().join("root");
    std::fs::create_dir(&dest).unwrap();
    let tar = LayerBuilder::new()
        .dir("dev", 0o755)
        .char_device("dev/null", 1, 3)
        .dir("bin", 0o755)
        .file("bin/su", b"#!/bin/sh\nid\n", 0o4755)
        .file_owned("bin/wall", b"#!/bin/sh\n", 0o2755, 0, 5)
        .tar();
    let before = thread_view();
    let stats = apply(&dest, &tar).unwrap();
    assert_eq!(thread_view(), before, "the caller is not jailed");

    assert_eq!(stats.devices_skipped, 0);
    let dev = std::fs::symlink_metadata(dest.join("dev/null")).unwrap();
    assert!(dev.file_type().is_char_device());
    assert_eq!(dev.rdev(), libc::makedev(1, 3));
    assert_eq!(dev.mode() & 0o7777, 0o666);
    let su = std::fs::metadata(dest.join("bin/su")).unwrap();
    assert_eq!(su.mode() & 0o7777, 0o4755, "setuid kept for the image");
    let wall = std::fs::metadata(dest.join("bin/wall")).unwrap();
    assert_eq!(
        (wall.mode() & 0o7777, wall.gid()),
        (0o2755, 5),
        "setgid kept"
    );

    // Through dest as the jail mounts it (where layers are unpacked) the device does not open.
    let open = jail::run_in(&dest, || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map(drop)
            .map_err(|e| e.raw_os_error())
    })
    .unwrap();
    assert_eq!(open, Err(Some(libc::EACCES)));
}

#[test]
fn a_failed_jail_step_fails_the_apply_with_no_unjailed_fallback() {
    if not_root("a_failed_jail_step_fails_the_apply_with_no_unjailed_fallback") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let dest = t.path().join("root");
    std::fs::create_dir(&dest).unwrap();
    let tar = LayerBuilder::new().file("f", b"x", 0o644).tar();
    // A thread of our own (its capabilities are per thread) without CAP_SYS_ADMIN: the jail's
    // thread inherits that, so its unshare fails.
    let d = dest.clone();
    let r = std::thread::spawn(move || {
        let (eff, _) = caps();
        set_caps(eff & !CAP_SYS_ADMIN);
        apply(&d, &tar)
    })
    .join()
    .unwrap();
    match r {
        Err(OciError::Jail { step, path, source }) => {
            assert_eq!(step, "unshare");
            assert_eq!(path, dest.canonicalize().unwrap());
            assert_eq!(source.raw_os_error(), Some(libc::EPERM));
            println!("refused: {}", OciError::Jail { step, path, source });
        }
        other => panic!("expected OciError::Jail, got {other:?}"),
    }
    assert!(!dest.join("f").exists(), "nothing applied");
}

/// A concurrent swap of a parent folder for a symlink to a host folder, between the path rules'
/// `lstat` and the operations that follow it: in the host's view some of them would act in that
/// folder (a gap in the rules: create, replace, chmod there); in the jail the link's absolute target
/// resolves inside the destination. Fails within a few rounds on an unjailed apply.
#[test]
fn a_parent_swapped_for_a_link_outside_mid_apply_still_writes_inside() {
    if not_root("a_parent_swapped_for_a_link_outside_mid_apply_still_writes_inside") {
        return;
    }
    const FILES: usize = 500;
    let t = tempfile::tempdir().unwrap();
    let dest = t.path().join("root");
    // The host folder holds files of the layer's names, so acting through the link is seen whatever
    // the step (removal, creation, owner, mode, time).
    let outside = t.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let mut layer = LayerBuilder::new();
    for i in 0..FILES {
        let f = outside.join(format!("f{i}"));
        std::fs::write(&f, b"host").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        layer = layer.file_owned(&format!("d/f{i}"), b"layer", 0o644, 7, 7);
    }
    let host_state = || {
        let mut v: Vec<_> = std::fs::read_dir(&outside)
            .unwrap()
            .flatten()
            .map(|e| {
                let m = e.metadata().unwrap();
                (e.file_name(), m.mode(), m.uid(), m.mtime(), read(&e.path()))
            })
            .collect();
        v.sort();
        v
    };
    let before = host_state();
    let tar = layer.tar();
    let (mut errors, mut redirected) = (0, 0);
    for round in 1..=30 {
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::create_dir_all(dest.join("d")).unwrap();
        std::os::unix::fs::symlink(&outside, dest.join("s")).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let racer = {
            let (stop, d, s) = (stop.clone(), c(dest.join("d")), c(dest.join("s")));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    // SAFETY: NUL-terminated paths; an atomic exchange of two names.
                    unsafe {
                        libc::renameat2(
                            libc::AT_FDCWD,
                            d.as_ptr(),
                            libc::AT_FDCWD,
                            s.as_ptr(),
                            libc::RENAME_EXCHANGE,
                        )
                    };
                }
            })
        };
        let r = apply(&dest, &tar);
        stop.store(true, Ordering::Relaxed);
        racer.join().unwrap();
        errors += usize::from(r.is_err());
        let inner = dest.join(outside.strip_prefix("/").unwrap());
        redirected += std::fs::read_dir(&inner).map_or(0, |d| d.count());
        assert!(
            host_state() == before,
            "round {round}: the host folder outside the destination was changed"
        );
    }
    println!(
        "30 rounds: {errors} applies failed on the race, {redirected} entries followed the link and \
         stayed inside, nothing outside changed"
    );
}
