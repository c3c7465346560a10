//! Per-VM uids (issue 9 "Confinement"): every QEMU runs as a uid of its own with no supplementary
//! groups, can open no other sandbox's RAM or disk, and uids stay unique across releases and restarts.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use agentenv_runtime::uid::UidRange;
use agentenv_runtime::vmm::VmmError;
use agentenv_runtime::{CreateError, CreateSpec, Runtime, SnapshotMode, VmState};
use common::{StateDir, run, runtime_with, token};

fn spec(id: &str) -> CreateSpec {
    CreateSpec {
        sandbox_id: id.into(),
        template_id: "base".into(),
        ..Default::default()
    }
}

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
    let uids = agentenv_runtime::uid::status_ids(&status, "Uid:").unwrap();
    let gids = agentenv_runtime::uid::status_ids(&status, "Gid:").unwrap();
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

fn ram_file(state: &Path, id: &str) -> PathBuf {
    PathBuf::from(record(state, id)["ram_file"].as_str().unwrap())
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

fn mode_and_owner(path: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.permissions().mode() & 0o777, m.uid())
}

fn no_free_uid<T: std::fmt::Debug>(r: Result<T, CreateError>) -> bool {
    matches!(r, Err(CreateError::Vmm(VmmError::NoUid(_))))
}

async fn open(state: &Path, range: UidRange) -> Runtime {
    runtime_with(state, |c| c.qemu_uids = Some(range)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_qemu_runs_as_a_uid_of_its_own() {
    if !agentenv_runtime::uid::running_as_root() {
        eprintln!("skip: per-VM uids need root (QEMU runs as this user, already unprivileged)");
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

    // Snapshot and fork: the fork gets its own copy of the snapshot's RAM, owned by its own uid.
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
        fork_ram.starts_with(s.join("sandboxes/uf")),
        "{}",
        fork_ram.display()
    );
    assert_eq!(mode_and_owner(&fork_ram), (0o600, uf));
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
