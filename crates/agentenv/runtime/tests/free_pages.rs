//! Free page reporting (issue 31): memory a guest frees goes back to the host, and a VM that maps a
//! capture copy-on-write never discards the capture's pages (QEMU before 8.2 punches holes into any
//! RAM file it discards in, so such a VM maps a sealed memfd of it, with or without uids of its own).

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv_runtime::SnapshotMode;
use agentenv_runtime::fsops::allocated_bytes as allocated;
use common::{StateDir, run, runtime, runtime_with, spec, token};
use sha2::Digest;

/// The RAM file of sandbox `id` from its record.
fn ram_file(state: &Path, id: &str) -> PathBuf {
    let rec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(state.join("sandboxes").join(id).join("sandbox.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(rec["machine"]["free_page_reporting"], true, "{rec}");
    PathBuf::from(rec["ram_file"].as_str().expect("ram_file"))
}

/// SHA-256 of every snapshot RAM file under `state`, by path.
fn capture_sums(state: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut sums: Vec<_> = std::fs::read_dir(state.join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("ram.mem"))
        .filter_map(|p| {
            // A fork's capture may live only in the memfd its forks map.
            let bytes = match agentenv_runtime::vmm::launch::registered_ram_base(&p) {
                true => {
                    let m = agentenv_runtime::vmm::launch::ram_base(&p).unwrap();
                    std::fs::read(format!("/proc/self/fd/{}", m.as_raw_fd())).unwrap()
                }
                false => std::fs::read(&p).ok()?,
            };
            Some((p, sha2::Sha256::digest(bytes).to_vec()))
        })
        .collect();
    sums.sort();
    sums
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_the_guest_frees_goes_back_to_the_host() {
    let state = StateDir::new();
    let s = state.path();
    let rt = runtime(s).await;
    let id = format!("fp-{}", &token()[..8]);
    rt.create(spec(&id)).await.expect("create");
    let ram = ram_file(s, &id);
    let before = allocated(&ram);
    let mib = rand::random_range(48..80u64);
    let (out, code) = run(
        &rt,
        &id,
        &format!("head -c {} /dev/urandom > /dev/shm/x && echo ok", mib << 20),
    )
    .await;
    assert_eq!((out.trim(), code), ("ok", 0));
    let full = allocated(&ram);
    assert!(
        full >= before + ((mib - 8) << 20),
        "{mib} MiB written: {before} -> {full} bytes"
    );
    let (_, code) = run(&rt, &id, "rm /dev/shm/x").await;
    assert_eq!(code, 0);
    // The guest reports freed blocks about 2 s after they are freed.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut now = allocated(&ram);
    while now > before + (16 << 20) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        now = allocated(&ram);
    }
    println!("RAM file: {before} bytes, {full} with {mib} MiB written, {now} once freed");
    assert!(
        now <= before + (16 << 20),
        "freed memory stayed in the RAM file: {before} -> {full} -> {now} bytes"
    );
    // Discarded pages come back as new pages: the guest's memory stays sound.
    let (out, code) = run(
        &rt,
        &id,
        "head -c 67108864 /dev/urandom > /dev/shm/y && a=$(md5sum < /dev/shm/y) && sleep 3 && \
         [ \"$a\" = \"$(md5sum < /dev/shm/y)\" ] && echo same",
    )
    .await;
    assert_eq!((out.trim(), code), ("same", 0));
    rt.kill(&id).await.expect("kill");
}

/// Forks of one capture, one of which frees what all of them read: the others and the capture keep
/// every byte.
async fn freeing_in_one_fork_leaves_the_capture_intact(uids: bool) {
    let state = StateDir::new();
    let s = state.path();
    let rt = runtime_with(s, |c| {
        if !uids {
            c.qemu_uids = None;
        }
    })
    .await;
    let id = format!("fq-{}", &token()[..8]);
    rt.create(spec(&id)).await.expect("create");
    let mib = rand::random_range(32..64u64);
    let (sum, code) = run(
        &rt,
        &id,
        &format!(
            "head -c {} /dev/urandom > /dev/shm/base && md5sum < /dev/shm/base",
            mib << 20
        ),
    )
    .await;
    assert_eq!(code, 0, "{sum}");
    let snap = format!("snap-{id}");
    rt.snapshot(&id, &snap, &[], SnapshotMode::Full)
        .await
        .expect("snapshot");
    let ids: Vec<String> = (0..2).map(|i| format!("{id}-f{i}")).collect();
    for r in rt.fork(&id, &ids).await.expect("fork") {
        r.expect("a fork");
    }
    let from_snap = format!("{id}-r");
    let mut restore = spec(&from_snap);
    restore.template_id = snap.clone();
    rt.create(restore).await.expect("create from the snapshot");
    let captures = capture_sums(s);
    assert!(captures.len() >= 2, "{captures:?}");
    for f in &ids {
        let (got, _) = run(&rt, f, "md5sum < /dev/shm/base").await;
        assert_eq!(got, sum, "{f} before");
    }
    // One fork and the restored sandbox free the data and give the guest time to report it.
    for f in [&ids[0], &from_snap] {
        let (_, code) = run(&rt, f, "rm /dev/shm/base && sleep 6").await;
        assert_eq!(code, 0, "{f}");
    }
    let (got, _) = run(&rt, &ids[1], "md5sum < /dev/shm/base").await;
    assert_eq!(got, sum, "the other fork's memory is the capture's");
    assert_eq!(capture_sums(s), captures, "snapshot RAM files changed");
    let again = format!("{id}-r2");
    let mut restore = spec(&again);
    restore.template_id = snap;
    rt.create(restore)
        .await
        .expect("create from the snapshot again");
    let (got, _) = run(&rt, &again, "md5sum < /dev/shm/base").await;
    assert_eq!(got, sum, "a new restore of the snapshot");
    for f in ids.iter().chain([&id, &from_snap, &again]) {
        rt.kill(f).await.expect("kill");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_freeing_memory_leaves_its_capture_intact() {
    freeing_in_one_fork_leaves_the_capture_intact(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_uids_a_fork_freeing_memory_leaves_its_capture_intact() {
    freeing_in_one_fork_leaves_the_capture_intact(false).await;
}
