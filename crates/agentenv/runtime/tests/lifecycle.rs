//! Real QEMU (TCG here) guests from the real debootstrap template with the real guest agent.

mod common;

use agentenv_runtime::{
    ConnectError, CreateError, CreateSpec, KillError, PauseError, ResumeError, VmState,
};
use common::{StateDir, run, runtime, spec, token};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_from_base_template_runs_commands_in_debian() {
    let state = StateDir::new();
    let rt = runtime(state.path()).await;
    let info = rt
        .templates()
        .into_iter()
        .find(|t| t.id == "base")
        .expect("base listed");
    assert_eq!((info.vcpus, info.memory_mib), (1, 256));
    let id = format!("cmd-{}", &token()[..8]);
    let mut s = spec(&id);
    let value = token();
    s.env_vars.insert("AENV_TEST".into(), value.clone());
    let vm = rt.create(s).await.expect("create");
    assert_eq!(vm.template_id, "base");
    assert_eq!(rt.vm_state(&id), Some(VmState::Running));

    let (a, b) = (
        rand::random_range(1000..9999u32),
        rand::random_range(1000..9999u32),
    );
    let (out, code) = run(
        &rt,
        &id,
        &format!("echo $(({a}*{b})); . /etc/os-release; echo $VERSION_CODENAME; echo $AENV_TEST"),
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(out, format!("{}\nbookworm\n{value}\n", a * b));
    let (out, _) = run(
        &rt,
        &id,
        "id -u user; stat -c %U /home/user; test -x /usr/local/bin/agentenv-guest && echo agent",
    )
    .await;
    assert_eq!(out, "1000\nuser\nagent\n");
    let (_, code) = run(&rt, &id, "exit 7").await;
    assert_eq!(code, 7);

    // Confinement: QEMU runs under seccomp, and nothing it or the runtime wrote is readable by others.
    // A QEMU of a warm-pool refill may still be starting (seccomp comes on after argument parsing):
    // each gets 10 s to enable it or exit.
    for pid in common::qemu_pids_under(state.path()) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // Until it exits (its status file goes) or has seccomp on.
        while let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if status.contains("Seccomp:\t2") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "QEMU {pid} without seccomp:\n{status}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    common::assert_private(&state.path().join("sandboxes"));
    // The cache (unpacked layers, templates) is closed to other users.
    {
        use std::os::unix::fs::PermissionsExt;
        let cache = k3_common::fsutil::cache_dir().join("agentenv");
        let mode = std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{} is {mode:o}", cache.display());
    }
    // Each QEMU sits in its own cgroup with a memory limit of guest RAM plus QEMU's headroom.
    match agentenv_runtime::vmm::cgroup::Hierarchy::host() {
        None => eprintln!("cgroup check skipped: this host mounts no writable cgroup hierarchy"),
        Some(h) => {
            // Named after the VM's folder: the sandbox's own, or the warm VM's it took.
            let vm_dir = common::vm_dir(state.path(), &id);
            let name = vm_dir.file_name().unwrap().to_string_lossy().into_owned();
            let pids = common::qemu_pids_under(&vm_dir);
            assert_eq!(pids.len(), 1, "{pids:?}");
            let own = std::fs::read_to_string(format!("/proc/{}/cgroup", pids[0])).unwrap();
            assert!(own.contains(&format!("agentenv/{name}")), "{own}");
            let want = agentenv_runtime::vmm::cgroup::Limits::for_vm(256, 1, None).memory_bytes;
            let file = match &h {
                agentenv_runtime::vmm::cgroup::Hierarchy::V1 { .. } => "memory.limit_in_bytes",
                agentenv_runtime::vmm::cgroup::Hierarchy::V2 { .. } => "memory.max",
            };
            let limit = std::fs::read_to_string(h.groups(&name)[0].join(file)).unwrap();
            assert_eq!(limit.trim().parse::<u64>().unwrap(), want);
        }
    }

    let vm_dir = common::vm_dir(state.path(), &id);
    let name = vm_dir.file_name().unwrap().to_string_lossy().into_owned();
    rt.kill(&id).await.expect("kill");
    assert_eq!(rt.vm_state(&id), None);
    if let Some(h) = agentenv_runtime::vmm::cgroup::Hierarchy::host() {
        assert!(
            h.groups(&name).iter().all(|g| !g.exists()),
            "cgroups of {id} left"
        );
    }
    assert!(!vm_dir.exists(), "the VM's folder is removed");
    assert!(
        common::qemu_pids_under(&vm_dir).is_empty(),
        "no QEMU of the sandbox left after kill"
    );
    // Closing kills the warm VMs the create left for the next one.
    rt.close().await;
    assert!(
        common::qemu_pids_under(state.path()).is_empty(),
        "no QEMU left after close"
    );
}

/// After one create from a template, the next ones take warm VMs (restored and stopped ahead): each is
/// a distinct machine with the host's clock and its own random stream, its files live in the warm VM's
/// folder, pause and resume work on it, and kill and close leave nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_vms_serve_creates_as_distinct_machines() {
    let state = StateDir::new();
    let rt = runtime(state.path()).await;
    let first = format!("w0-{}", &token()[..8]);
    rt.create(spec(&first)).await.expect("create");
    assert_eq!(
        common::vm_dir(state.path(), &first),
        state.path().join("sandboxes").join(&first)
    );
    // The create left warm VMs behind (made in the background, one at a time).
    let vms = state.path().join("vms");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while rt.warm_ready("base") < 2 {
        assert!(std::time::Instant::now() < deadline, "no warm VMs made");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut seen = Vec::new();
    let mut ids = vec![first];
    for i in 0..2 {
        let id = format!("w{}-{}", i + 1, &token()[..8]);
        let mut s = spec(&id);
        let value = token();
        s.env_vars.insert("AENV_W".into(), value.clone());
        rt.create(s).await.expect("create on a warm VM");
        ids.push(id.clone());
        let dir = common::vm_dir(state.path(), &id);
        assert!(dir.starts_with(&vms), "{} took no warm VM", dir.display());
        let (out, code) = run(
            &rt,
            &id,
            "echo $AENV_W; date +%s; head -c 16 /dev/urandom | od -An -tx1",
        )
        .await;
        assert_eq!(code, 0, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], value);
        let guest: i64 = lines[1].trim().parse().unwrap();
        let host = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert!(
            (guest - host).abs() <= 2,
            "guest clock {guest}, host {host}"
        );
        seen.push(lines[2].to_owned());
        seen.push(dir.display().to_string());
        rt.pause(&id).await.expect("pause");
        rt.resume(&id).await.expect("resume");
        let (out, _) = run(&rt, &id, "echo $AENV_W").await;
        assert_eq!(out.trim(), value);
    }
    let unique: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!(
        unique.len(),
        seen.len(),
        "two warm VMs look alike: {seen:?}"
    );
    for id in &ids {
        rt.kill(id).await.expect("kill");
    }
    rt.close().await;
    assert!(
        common::qemu_pids_under(state.path()).is_empty(),
        "no QEMU left after close"
    );
}

/// The warm VMs of all images stay within the server-wide budget (`max_warm_vms`, here below the
/// per-image floor), and an image idle for `warm_idle` keeps none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_vms_stay_within_their_budget_and_go_when_their_image_is_idle() {
    use std::time::{Duration, Instant};
    let state = StateDir::new();
    let idle = Duration::from_secs(20);
    let rt = common::runtime_with(state.path(), |c| {
        (c.warm_vms, c.max_warm_vms, c.warm_idle) = (2, 1, idle);
    })
    .await;
    let id = format!("wb-{}", &token()[..8]);
    let before = Instant::now();
    rt.create(spec(&id)).await.expect("create");
    let used = Instant::now();
    let vms = state.path().join("vms");
    while common::qemu_pids_under(&vms).is_empty() {
        assert!(used.elapsed() < idle, "no warm VM made");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A second one (the image's floor is 2) would have come by now: the budget holds it back.
    while used.elapsed() < idle / 2 {
        let n = common::qemu_pids_under(&vms).len();
        assert_eq!(n, 1, "{n} warm VMs with a budget of 1");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // No create since: once the image is idle, its warm VM goes.
    while !common::qemu_pids_under(&vms).is_empty() {
        assert!(used.elapsed() < 2 * idle, "the idle image kept its warm VM");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(before.elapsed() >= idle, "went before the image was idle");
    rt.kill(&id).await.expect("kill");
    rt.close().await;
    assert!(common::qemu_pids_under(state.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_keep_files_and_processes() {
    let state = StateDir::new();
    let rt = runtime(state.path()).await;
    let id = format!("pz-{}", &token()[..8]);
    rt.create(spec(&id)).await.expect("create");
    let (tmp_tok, disk_tok) = (token(), token());
    let (pid, code) = run(
        &rt,
        &id,
        &format!("echo {tmp_tok} > /tmp/t; echo {disk_tok} > /home/user/d; sync; sleep 100000 >/dev/null 2>&1 & echo $!"),
    )
    .await;
    assert_eq!(code, 0);
    let pid = pid.trim().to_owned();

    rt.pause(&id).await.expect("pause");
    assert_eq!(rt.vm_state(&id), Some(VmState::Paused));
    assert!(matches!(
        rt.pause(&id).await,
        Err(PauseError::AlreadyPaused(_))
    ));
    assert!(matches!(
        rt.open_agent_stream(&id).await,
        Err(ConnectError::Paused(_))
    ));
    rt.resume(&id).await.expect("resume");
    assert_eq!(rt.vm_state(&id), Some(VmState::Running));
    assert!(matches!(
        rt.resume(&id).await,
        Err(ResumeError::NotPaused(_))
    ));

    let (out, _) = run(
        &rt,
        &id,
        &format!("cat /tmp/t /home/user/d; kill -0 {pid} && echo alive"),
    )
    .await;
    assert_eq!(out, format!("{tmp_tok}\n{disk_tok}\nalive\n"));

    // A second cycle works on the same RAM file.
    rt.pause(&id).await.expect("pause again");
    rt.resume(&id).await.expect("resume again");
    let (out, _) = run(&rt, &id, "cat /tmp/t").await;
    assert_eq!(out, format!("{tmp_tok}\n"));
    rt.kill(&id).await.expect("kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_without_memory_keeps_the_disk_and_cold_boots_on_resume_also_after_a_restart() {
    let state = StateDir::new();
    let id = format!("fs-{}", &token()[..8]);
    let (disk_tok, env_tok) = (token(), token());
    let boot_before = {
        let rt = runtime(state.path()).await;
        rt.create(spec(&id)).await.expect("create");
        // No `sync`: the pause flushes the guest's writes itself.
        let (out, code) = run(
            &rt,
            &id,
            &format!("echo {disk_tok} > /home/user/d; sleep 100000 >/dev/null 2>&1 & cat /proc/sys/kernel/random/boot_id"),
        )
        .await;
        assert_eq!(code, 0);
        let rec = state
            .path()
            .join("sandboxes")
            .join(&id)
            .join("sandbox.json");
        let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(rec).unwrap()).unwrap();
        let pid = rec["phase"]["pid"].as_u64().expect("running pid") as u32;
        let ram = std::path::PathBuf::from(rec["ram_file"].as_str().unwrap());
        // A RAM file of its own goes; a snapshot's it mapped copy-on-write stays.
        let own_ram = rec["ram_shared"].as_bool().unwrap_or(true);
        rt.pause_filesystem(&id)
            .await
            .expect("pause without memory");
        assert_eq!(rt.vm_state(&id), Some(VmState::Paused));
        assert!(matches!(
            rt.pause_filesystem(&id).await,
            Err(PauseError::AlreadyPaused(_))
        ));
        // Its QEMU is gone and its RAM with it.
        assert!(!common::qemu_pids_under(state.path()).contains(&pid));
        assert_eq!(ram.exists(), !own_ram, "{}", ram.display());
        out
        // The server goes away here; the next one finds it paused.
    };
    let rt = runtime(state.path()).await;
    let recovered = rt.recover().await.expect("recover");
    assert!(
        recovered
            .iter()
            .any(|r| r.id == id && r.state == Some(VmState::Paused)),
        "{recovered:?}"
    );
    let env = std::collections::BTreeMap::from([("AENV_TEST".to_string(), env_tok.clone())]);
    rt.resume_with(&id, &env).await.expect("cold boot");
    assert_eq!(rt.vm_state(&id), Some(VmState::Running));
    let (out, _) = run(
        &rt,
        &id,
        "cat /home/user/d; echo $AENV_TEST; pgrep -x sleep || echo none; cat /proc/sys/kernel/random/boot_id",
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..3],
        [disk_tok.as_str(), env_tok.as_str(), "none"],
        "{out}"
    );
    assert_ne!(lines[3], boot_before.trim(), "a new boot");
    // Paused with memory after that, it continues as usual.
    rt.pause(&id).await.expect("pause");
    rt.resume(&id).await.expect("resume");
    let (out, _) = run(&rt, &id, "cat /home/user/d").await;
    assert_eq!(out, format!("{disk_tok}\n"));
    rt.kill(&id).await.expect("kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_running_and_paused_and_cleans_dead() {
    let state = StateDir::new();
    let (run_id, pause_id, dead_id, half_id) = ("keep-run", "keep-paused", "dies", "half");
    let (tok_run, tok_paused) = (token(), token());
    {
        let rt = runtime(state.path()).await;
        for id in [run_id, pause_id, dead_id, half_id] {
            rt.create(spec(id)).await.expect("create");
        }
        run(&rt, run_id, &format!("echo {tok_run} > /tmp/t")).await;
        run(&rt, pause_id, &format!("echo {tok_paused} > /tmp/t")).await;
        rt.pause(pause_id).await.expect("pause");
        // The server process goes away here (the Runtime is dropped); QEMU processes survive it.
    }
    let rec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            state
                .path()
                .join("sandboxes")
                .join(dead_id)
                .join("sandbox.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let dead_pid = rec["phase"]["pid"].as_u64().expect("running pid") as i32;
    // A crash in the middle of a create leaves a `starting` record and a live QEMU: an orphan to kill.
    let half_path = state
        .path()
        .join("sandboxes")
        .join(half_id)
        .join("sandbox.json");
    let mut half: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&half_path).unwrap()).unwrap();
    let half_pid = half["phase"]["pid"].as_u64().expect("running pid") as u32;
    half["phase"] = serde_json::json!({"phase": "starting"});
    std::fs::write(&half_path, serde_json::to_vec(&half).unwrap()).unwrap();
    // SAFETY: plain syscall on the QEMU of this test's sandbox.
    unsafe { libc::kill(dead_pid, libc::SIGKILL) };

    let rt = runtime(state.path()).await;
    let mut recovered = rt.recover().await.expect("recover");
    recovered.sort_by(|a, b| a.id.cmp(&b.id));
    let states: Vec<_> = recovered.iter().map(|r| (r.id.as_str(), r.state)).collect();
    assert_eq!(
        states,
        vec![
            (dead_id, None),
            (half_id, None),
            (pause_id, Some(VmState::Paused)),
            (run_id, Some(VmState::Running))
        ],
        "{recovered:?}"
    );
    assert!(!state.path().join("sandboxes").join(dead_id).exists());
    assert!(!state.path().join("sandboxes").join(half_id).exists());
    for _ in 0..1000 {
        if !std::path::Path::new(&format!("/proc/{half_pid}")).exists() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        !common::qemu_pids_under(state.path()).contains(&half_pid),
        "orphan QEMU killed"
    );
    let (out, _) = run(&rt, run_id, "cat /tmp/t").await;
    assert_eq!(out, format!("{tok_run}\n"));
    rt.resume(pause_id).await.expect("resume after restart");
    let (out, _) = run(&rt, pause_id, "cat /tmp/t").await;
    assert_eq!(out, format!("{tok_paused}\n"));
    for id in [run_id, pause_id] {
        rt.kill(id).await.expect("kill");
    }
    assert!(
        common::qemu_pids_under(state.path()).is_empty(),
        "no orphan QEMU"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused() {
    let state = StateDir::new();
    let rt = runtime(state.path()).await;
    let unknown = format!("no-such-{}", &token()[..6]);
    let r = rt
        .create(CreateSpec {
            sandbox_id: "x1".into(),
            template_id: unknown.clone(),
            ..Default::default()
        })
        .await;
    assert!(matches!(r, Err(CreateError::UnknownTemplate(t)) if t == unknown));
    for bad in ["", "../x", "a/b", ".hidden", &"x".repeat(65)] {
        assert!(
            matches!(rt.create(spec(bad)).await, Err(CreateError::InvalidId(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(
        rt.pause(&unknown).await,
        Err(PauseError::NotFound(_))
    ));
    assert!(matches!(
        rt.resume(&unknown).await,
        Err(ResumeError::NotFound(_))
    ));
    assert!(matches!(
        rt.kill(&unknown).await,
        Err(KillError::NotFound(_))
    ));
    assert!(matches!(
        rt.open_agent_stream(&unknown).await,
        Err(ConnectError::NotFound(_))
    ));
    assert_eq!(rt.vm_state(&unknown), None);

    rt.create(spec("dup")).await.expect("create");
    assert!(matches!(
        rt.create(spec("dup")).await,
        Err(CreateError::AlreadyExists(_))
    ));
    rt.kill("dup").await.expect("kill");
    assert!(matches!(rt.kill("dup").await, Err(KillError::NotFound(_))));
    assert!(
        state
            .path()
            .join("sandboxes")
            .read_dir()
            .unwrap()
            .next()
            .is_none(),
        "no files left"
    );
}
