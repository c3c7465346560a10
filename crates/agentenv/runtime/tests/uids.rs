//! Per-VM uids (issue 9 "Confinement"): every QEMU runs as a uid of its own with no supplementary
//! groups, can open no other sandbox's RAM or disk, and uids stay unique across releases and restarts.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use agentenv_runtime::vmm::VmmError;
use agentenv_runtime::vmm::uid::UidRange;
use agentenv_runtime::{CreateError, Runtime, SnapshotMode, VmState};
use common::{StateDir, run, runtime_with, spec, token};

fn record(state: &Path, id: &str) -> serde_json::Value {
    let p = state.join("sandboxes").join(id).join("sandbox.json");
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

/// The uid of sandbox `id`'s QEMU, after checking that its real, effective, saved and filesystem uids
/// are that one uid of `range`, its gids all `range.gid` and its supplementary groups empty.
fn vm_uid(state: &Path, id: &str, range: &UidRange) -> u32 {
    let pid = record(state, id)["phase"]["pid"]
        .as_u64()
        .expect("running pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uids = agentenv_runtime::vmm::uid::status_ids(&status, "Uid:").unwrap();
    let gids = agentenv_runtime::vmm::uid::status_ids(&status, "Gid:").unwrap();
    let groups = status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .unwrap();
    assert!(uids.iter().all(|u| *u == uids[0]), "{id}: uids {uids:?}");
    assert!(
        range.contains(uids[0]),
        "{id}: uid {} outside {range:?}",
        uids[0]
    );
    assert_eq!(gids, [range.gid; 4], "{id}: gids");
    assert_eq!(groups.trim(), "", "{id}: supplementary groups");
    uids[0]
}

/// Checks that sandbox `id`'s QEMU runs in a network namespace of its own (not the host's, not another
/// VM's) and, where this host has writable cgroups, in its own groups with a process and I/O limit.
fn confined(state: &Path, id: &str) {
    let pid = record(state, id)["phase"]["pid"].as_u64().unwrap();
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).unwrap();
    assert_ne!(
        ns(&pid.to_string()),
        ns("self"),
        "{id}: QEMU in the host's network namespace"
    );
    let links = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let devs: Vec<&str> = links
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(devs, ["lo"], "{id}: QEMU sees network devices");
    in_its_own_view(state, id, pid);
    if agentenv_runtime::vmm::cgroup::Hierarchy::host().is_none() {
        return;
    }
    let groups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let mine = format!("/agentenv/{id}");
    for c in ["memory", "pids", "blkio"] {
        if let Some(l) = groups.lines().find(|l| {
            l.split(':')
                .nth(1)
                .is_some_and(|cs| cs.split(',').any(|x| x == c))
        }) {
            assert!(l.ends_with(&mine), "{id}: {c} group {l}");
            // Its disk I/O is limited on the disk of its files.
            if c == "blkio"
                && let Some(d) = agentenv_runtime::vmm::cgroup::disk_of(state)
            {
                let group = l.splitn(3, ':').nth(2).unwrap().trim_start_matches('/');
                let f = Path::new("/sys/fs/cgroup/blkio")
                    .join(group)
                    .join("blkio.throttle.write_bps_device");
                let want = format!(
                    "{}:{} {}",
                    d.major,
                    d.minor,
                    agentenv_runtime::vmm::cgroup::IO_BPS
                );
                assert_eq!(std::fs::read_to_string(&f).unwrap().trim(), want, "{id}");
            }
        }
    }
}

/// Checks that QEMU `pid` of sandbox `id` sees only what it needs of the host's files: its root (read
/// as root through `/proc/<pid>/root`) has `/usr` and its devices but neither the state folder, nor a
/// world-readable file the test leaves on the host, nor `/etc/passwd`; other users' processes are
/// hidden from it.
fn in_its_own_view(state: &Path, id: &str, pid: u64) {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).unwrap();
    assert_ne!(
        ns(&pid.to_string()),
        ns("self"),
        "{id}: QEMU in the host's mounts"
    );
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
    let bait = std::env::temp_dir().join(format!("k3-jail-bait-{}", rand::random::<u64>()));
    std::fs::write(&bait, "host secret").unwrap();
    std::fs::set_permissions(&bait, std::fs::Permissions::from_mode(0o644)).unwrap();
    let seen = |p: &Path| std::fs::symlink_metadata(inside(p)).is_ok();
    let (bait_seen, state_seen) = (seen(&bait), seen(state));
    std::fs::remove_file(&bait).unwrap();
    assert!(!bait_seen, "{id}: QEMU sees a world-readable host file");
    assert!(!state_seen, "{id}: QEMU sees the state folder");
    assert!(
        !seen(Path::new("/etc/passwd")),
        "{id}: QEMU sees /etc/passwd"
    );
    assert!(
        seen(Path::new("/usr/bin")) && seen(Path::new("/dev/null")),
        "{id}: an empty view"
    );
    // QEMU's uid can walk its folders (the loader reads `/etc/ld.so.cache`).
    for d in ["/etc", "/dev"] {
        let mode = std::fs::metadata(inside(Path::new(d))).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o755, "{id}: {d} has mode {mode:o}");
    }
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let proc_line = mounts
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/proc"))
        .unwrap_or_else(|| panic!("{id}: no /proc: {mounts}"));
    assert!(
        proc_line.contains("hidepid=2") || proc_line.contains("hidepid=invisible"),
        "{id}: other users' processes visible: {proc_line}"
    );
    for l in mounts.lines() {
        let point = l.split(' ').nth(4).unwrap_or("");
        if point != "/proc" {
            assert!(
                l.split(' ').nth(5).is_some_and(|o| o.starts_with("ro")),
                "{id}: writable {l}"
            );
        }
    }
}

fn ram_file(state: &Path, id: &str) -> PathBuf {
    PathBuf::from(record(state, id)["ram_file"].as_str().unwrap())
}

/// Whether KSM may merge sandbox `id`'s guest RAM (its mapping's `mg` flag; the kernel merges only
/// private mappings, so a fork's) and the rest of its QEMU (`ksm_merge_any`; `None` on kernels without it).
fn mergeable(state: &Path, id: &str) -> (bool, Option<bool>) {
    let pid = record(state, id)["phase"]["pid"].as_u64().unwrap();
    let name = ram_file(state, id).file_name().unwrap().to_owned();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    // "start-end perms offset dev inode [path]", then its fields, the last being VmFlags.
    let header = |l: &str| {
        let mut t = l.split_whitespace();
        t.next().is_some_and(|a| a.contains('-')) && t.next().is_some_and(|p| p.len() == 4)
    };
    let mut in_ram = false;
    let mut ram = None;
    for l in smaps.lines() {
        if let Some(flags) = l.strip_prefix("VmFlags:") {
            if in_ram {
                ram = Some(flags.split_whitespace().any(|f| f == "mg"));
            }
            in_ram = false;
        } else if header(l) {
            in_ram = l.contains("/memfd:agentenv-ram")
                || Path::new(l.split_whitespace().last().unwrap_or_default()).file_name()
                    == Some(name.as_os_str());
        }
    }
    let any = std::fs::read_to_string(format!("/proc/{pid}/ksm_stat"))
        .ok()
        .and_then(|k| {
            k.lines()
                .find_map(|l| l.strip_prefix("ksm_merge_any:"))
                .map(|v| v.trim() == "yes")
        });
    (ram.expect("guest RAM mapping in smaps"), any)
}

/// Opens `path` for reading, then for appending, as `uid`:`gid` in a helper process; both must fail
/// with EACCES.
fn assert_denied(uid: u32, gid: u32, path: &Path) {
    assert!(path.exists(), "{} missing", path.display());
    for redirect in ["3<", "3>>"] {
        let out = std::process::Command::new("/bin/sh")
            .args(["-c", &format!("exec {redirect}\"$1\""), "sh"])
            .arg(path)
            .uid(uid)
            .gid(gid)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("Permission denied"),
            "uid {uid} opened {} ({redirect}): {err}",
            path.display()
        );
    }
}

/// Reopens `path` as `uid`:`gid` the way a VM does, through an inherited descriptor
/// (`/proc/self/fd/3`), with a shell `redirect` (`4<` reads, `4>>` appends): it must succeed, or fail
/// with EACCES.
fn assert_opens(uid: u32, gid: u32, path: &Path, redirect: &str, allowed: bool) {
    let f = std::fs::File::open(path).unwrap();
    let fd = f.as_raw_fd();
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", &format!("exec {redirect}/proc/self/fd/3")])
        .uid(uid)
        .gid(gid);
    // SAFETY: dup2(2) on a descriptor this process holds open.
    unsafe {
        cmd.pre_exec(move || match libc::dup2(fd, 3) {
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(()),
        });
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    match allowed {
        true => assert!(
            out.status.success(),
            "uid {uid} cannot open {} ({redirect}): {err}",
            path.display()
        ),
        false => assert!(
            !out.status.success() && err.contains("Permission denied"),
            "uid {uid} opened {} ({redirect}): {err}",
            path.display()
        ),
    }
}

/// Whether the QEMU on PATH opens a file read-only to map it private (`rom=`, QEMU 8.2+).
fn qemu_maps_read_only_files_private() -> bool {
    std::process::Command::new("qemu-system-x86_64")
        .args(["-object", "memory-backend-file,help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("rom="))
}

fn mode_and_owner(path: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.permissions().mode() & 0o777, m.uid())
}

fn no_free_uid<T: std::fmt::Debug>(r: Result<T, CreateError>) -> bool {
    matches!(r, Err(CreateError::Vmm(VmmError::NoUid(_))))
}

/// Without warm VMs or kept paused ones: each would hold one of the test's few uids.
async fn open(state: &Path, range: UidRange) -> Runtime {
    runtime_with(state, |c| {
        c.qemu_uids = Some(range);
        c.warm_vms = 0;
        c.keep_paused = std::time::Duration::ZERO;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_qemu_runs_as_a_uid_of_its_own() {
    if !agentenv_runtime::vmm::uid::running_as_root() {
        k3_common::require::skip_part(
            k3_common::require::Part::Root,
            "each_qemu_runs_as_a_uid_of_its_own",
            "per-VM uids need root (QEMU runs as this user, already unprivileged)",
        );
        return;
    }
    // Three uids of our own (parallel tests take other ranges).
    let base = 3_000_000 + rand::random_range(0..10_000u32) * 8;
    let range = UidRange {
        base,
        count: 3,
        gid: base,
    };
    let state = StateDir::new();
    let s = state.path();
    let rt = open(s, range).await;

    let (a, b) = tokio::join!(rt.create(spec("ua")), rt.create(spec("ub")));
    a.expect("create ua");
    b.expect("create ub");
    rt.create(spec("uc")).await.expect("create uc");
    let (ua, ub, uc) = (
        vm_uid(s, "ua", &range),
        vm_uid(s, "ub", &range),
        vm_uid(s, "uc", &range),
    );
    assert!(ua != ub && ub != uc && ua != uc, "{ua} {ub} {uc}");
    for id in ["ua", "ub", "uc"] {
        confined(s, id);
    }
    assert!(
        no_free_uid(rt.create(spec("ud")).await),
        "a fourth VM got a uid"
    );
    assert!(!s.join("sandboxes/ud").exists());

    // Who owns what: the state stays root's and private; the VM owns its RAM and socket folder.
    for id in ["ua", "ub"] {
        let u = vm_uid(s, id, &range);
        let dir = s.join("sandboxes").join(id);
        assert_eq!(mode_and_owner(&dir), (0o700, 0), "{id} folder");
        assert_eq!(mode_and_owner(&dir.join("sandbox.json")), (0o600, 0));
        assert_eq!(mode_and_owner(&dir.join("disk.qcow2")), (0o600, 0));
        assert_eq!(mode_and_owner(&dir.join("console.log")), (0o600, 0));
        assert_eq!(
            mode_and_owner(&dir.join("qemu")),
            (0o700, u),
            "{id} sockets"
        );
        assert_eq!(mode_and_owner(&ram_file(s, id)), (0o600, u), "{id} RAM");
    }
    common::assert_private(&s.join("sandboxes"));
    let tok = token();
    run(&rt, "ub", &format!("echo {tok} > /home/user/t; sync")).await;

    // A VM's uid opens nothing of another sandbox, of the templates or of the state.
    let tpl: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.join("templates/base/template.json")).unwrap())
            .unwrap();
    let mut theirs = vec![
        ram_file(s, "ub"),
        s.join("sandboxes/ub/disk.qcow2"),
        s.join("sandboxes/ub/sandbox.json"),
        s.join("sandboxes/ua/sandbox.json"),
        PathBuf::from(tpl["base_disk"].as_str().unwrap()),
        PathBuf::from(tpl["base_ram"].as_str().unwrap()),
    ];
    for p in &theirs {
        assert_denied(ua, range.gid, p);
    }

    // Pause frees the uid and takes the RAM file back; the next VM gets exactly that uid.
    // (QEMU exits in the background after a pause returns: the uid is free once it has.)
    rt.pause("ua").await.expect("pause");
    let mut created = rt.create(spec("ud")).await;
    for _ in 0..100 {
        if !matches!(created, Err(CreateError::Vmm(VmmError::NoUid(_)))) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        created = rt.create(spec("ud")).await;
    }
    created.expect("create ud");
    assert_eq!(
        mode_and_owner(&ram_file(s, "ua")).1,
        0,
        "paused RAM is root's"
    );
    assert_eq!(vm_uid(s, "ud", &range), ua, "the released uid is reused");
    rt.kill("ud").await.expect("kill ud");
    rt.resume("ua").await.expect("resume");
    assert_eq!(vm_uid(s, "ua", &range), ua);
    assert_eq!(run(&rt, "ua", "echo ok").await.0, "ok\n");

    // Snapshot and fork: the fork maps its capture's RAM copy-on-write, so forks share its pages: QEMU
    // 8.2+ the file itself (`readonly=on,rom=off`), root's, which it can read but not write; an older
    // QEMU (which opens a private RAM file for writing) the sealed memfd the capture was made into
    // (`launch::register_ram_base`: no file).
    let snap = rt
        .snapshot("ub", "snap-ub", &[], SnapshotMode::Full)
        .await
        .expect("snapshot");
    rt.kill("uc").await.expect("kill uc");
    let forks = rt.fork("ub", &["uf".to_string()]).await.expect("fork");
    forks[0].as_ref().expect("fork uf");
    let uf = vm_uid(s, "uf", &range);
    assert_eq!(uf, uc);
    assert_eq!(
        run(&rt, "uf", "cat /home/user/t").await.0,
        format!("{tok}\n")
    );
    let fork_ram = ram_file(s, "uf");
    assert!(
        fork_ram.starts_with(s.join("snapshots")),
        "{}",
        fork_ram.display()
    );
    let memfd;
    let capture = if qemu_maps_read_only_files_private() {
        assert_eq!(
            mode_and_owner(&fork_ram),
            (0o640, 0),
            "the capture's RAM stays root's"
        );
        assert_eq!(std::fs::metadata(&fork_ram).unwrap().gid(), range.gid);
        assert_opens(uf, range.gid, &fork_ram, "4>>", false);
        assert_opens(uf, range.gid, &fork_ram, "4<", true);
        fork_ram.clone()
    } else {
        assert!(!fork_ram.exists(), "a fork's capture has no RAM file");
        let pid = record(s, "uf")["phase"]["pid"].as_u64().unwrap();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        assert!(
            maps.contains("/memfd:agentenv-ram"),
            "the fork does not map its capture's RAM memfd"
        );
        memfd = agentenv_runtime::vmm::launch::ram_base(&fork_ram).expect("the capture's memfd");
        PathBuf::from(format!("/proc/self/fd/{}", memfd.as_raw_fd()))
    };
    // KSM may not merge its pages with others': merged pages across tenants are a timing side channel.
    let (ram, any) = mergeable(s, "uf");
    assert!(!ram && any != Some(true), "a fork's memory is mergeable");
    // The fork's memory writes stay its own.
    let before = std::fs::read(&capture).unwrap();
    run(
        &rt,
        "uf",
        "head -c 8388608 /dev/urandom > /dev/shm/blob && sync",
    )
    .await;
    assert!(
        std::fs::read(&capture).unwrap() == before,
        "a fork's memory write reached its capture"
    );
    theirs.extend([
        s.join("snapshots").join(&snap.id).join("disk.qcow2"),
        s.join("snapshots").join(&snap.id).join("ram.mem"),
        ram_file(s, "ua"),
    ]);
    for p in &theirs {
        assert_denied(uf, range.gid, p);
    }

    // A restart adopts the running VMs' uids: none is handed out twice.
    drop(rt);
    // Snapshot ingests still finishing in the background keep the chunk store open for a moment.
    let mut cfg = agentenv_runtime::RuntimeConfig::new(s);
    cfg.guest_bin = Some(common::guest_bin());
    cfg.qemu_uids = Some(range);
    cfg.warm_vms = 0;
    cfg.keep_paused = std::time::Duration::ZERO;
    let mut attempt = 0;
    let rt = loop {
        match Runtime::open(cfg.clone()).await {
            Ok(rt) => break rt,
            Err(e) if attempt < 600 => {
                attempt += 1;
                eprintln!("reopen: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => panic!("runtime reopens: {e}"),
        }
    };
    let recovered = rt.recover().await.expect("recover");
    assert!(
        recovered.iter().all(|r| r.state == Some(VmState::Running)),
        "{recovered:?}"
    );
    assert_eq!(recovered.len(), 3, "{recovered:?}");
    assert!(
        no_free_uid(rt.create(spec("ug")).await),
        "a live uid was handed out again"
    );
    rt.kill("ub").await.expect("kill ub");
    rt.create(spec("ug")).await.expect("create ug");
    assert_eq!(vm_uid(s, "ug", &range), ub);
    for id in ["ua", "uf", "ug"] {
        rt.kill(id).await.expect("kill");
    }
    assert!(common::qemu_pids_under(s).is_empty(), "no QEMU left");
}

/// A QEMU started by an older version (as root, sockets in the sandbox folder, paths on its command
/// line) is re-attached after an upgrade, and moves to its own uid at its next pause and resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qemu_of_an_older_version_is_adopted_then_confined() {
    if !agentenv_runtime::vmm::uid::running_as_root() {
        k3_common::require::skip_part(
            k3_common::require::Part::Root,
            "a_qemu_of_an_older_version_is_adopted_then_confined",
            "per-VM uids need root",
        );
        return;
    }
    let base = 3_100_000 + rand::random_range(0..10_000u32) * 8;
    let range = UidRange {
        base,
        count: 2,
        gid: base,
    };
    let state = StateDir::new();
    let s = state.path();
    {
        let rt = open(s, range).await;
        rt.create(spec("old")).await.expect("create");
        rt.pause("old").await.expect("pause");
        // Wait until the paused QEMU is gone.
        for _ in 0..200 {
            if common::qemu_pids_under(s).is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    // The older version's layout: no socket folder, everything named by path, QEMU as root.
    let dir = s.join("sandboxes/old");
    std::fs::remove_dir_all(dir.join("qemu")).unwrap();
    let rec = record(s, "old");
    let m = &rec["machine"];
    let p = |x: &Path| x.display().to_string();
    let mut qemu = std::process::Command::new("qemu-system-x86_64")
        .args([
            "-M",
            "microvm,memory-backend=mem",
            "-accel",
            "tcg",
            "-m",
            "256M",
            "-smp",
            "1",
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-sandbox",
        ])
        .arg("on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny")
        .arg("-object")
        .arg(format!(
            "memory-backend-file,id=mem,size=256M,mem-path={},share=on",
            p(&ram_file(s, "old"))
        ))
        .args(["-kernel", m["kernel"].as_str().unwrap()])
        .args(["-initrd", m["initrd"].as_str().unwrap()])
        .args(["-append", m["cmdline"].as_str().unwrap()])
        .arg("-chardev")
        .arg(format!(
            "file,id=con,path={},append=on",
            p(&dir.join("console.log"))
        ))
        .args(["-serial", "chardev:con", "-qmp"])
        .arg(format!(
            "unix:{},server=on,wait=off",
            p(&dir.join("qmp.sock"))
        ))
        .arg("-drive")
        .arg(format!(
            "id=root,file={},format=qcow2,if=none,cache=writeback",
            p(&dir.join("disk.qcow2"))
        ))
        .args([
            "-device",
            "virtio-blk-device,drive=root",
            "-device",
            "virtio-serial-device",
        ])
        .arg("-chardev")
        .arg(format!(
            "socket,id=agent,path={},server=on,wait=off",
            p(&dir.join("agent.sock"))
        ))
        .args(["-device", "virtserialport,chardev=agent,name=agentenv.0"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("qemu starts");
    let mut rec = rec.clone();
    rec["phase"] = serde_json::json!({"phase": "running", "pid": qemu.id()});
    std::fs::write(dir.join("sandbox.json"), serde_json::to_vec(&rec).unwrap()).unwrap();
    for _ in 0..200 {
        if dir.join("qmp.sock").exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    let rt = open(s, range).await;
    let recovered = rt.recover().await.expect("recover");
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    assert_eq!(recovered[0].state, Some(VmState::Running), "{recovered:?}");
    // Still the old QEMU, as root; the agent answers once its cold boot is done.
    assert_eq!(agentenv_runtime::vmm::uid::process_uid(qemu.id()), Some(0));
    assert_eq!(run(&rt, "old", "echo up").await.0, "up\n");
    rt.pause("old").await.expect("pause the old QEMU");
    rt.resume("old").await.expect("resume confined");
    assert!(range.contains(vm_uid(s, "old", &range)));
    assert_eq!(run(&rt, "old", "echo confined").await.0, "confined\n");
    rt.kill("old").await.expect("kill");
    // The old QEMU exited at the pause (the runtime saw it a zombie); reap it.
    let _ = qemu.wait();
    assert!(common::qemu_pids_under(s).is_empty(), "no QEMU left");
}

/// KSM (issue 31): with `mem_merge` the operator lets the host merge a VM's guest RAM and QEMU's own
/// memory (denser forks where KSM runs); without it (above) neither is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_can_let_ksm_merge_the_vms_pages() {
    let state = StateDir::new();
    let s = state.path();
    let rt = runtime_with(s, |c| {
        c.mem_merge = true;
        c.warm_vms = 0;
    })
    .await;
    let id = format!("mg-{}", &token()[..8]);
    rt.create(spec(&id)).await.expect("create");
    let fork = format!("{id}-f");
    let forks = rt
        .fork(&id, std::slice::from_ref(&fork))
        .await
        .expect("fork");
    forks[0].as_ref().expect("the fork");
    assert_eq!(run(&rt, &fork, "echo up").await, ("up\n".to_string(), 0));
    let (ram, any) = mergeable(s, &fork);
    assert!(ram, "the fork's guest RAM is not mergeable");
    assert_ne!(any, Some(false), "QEMU's own memory is not mergeable");
    for x in [&fork, &id] {
        rt.kill(x).await.unwrap();
    }
}
