//! A pause answers before the RAM file reaches the disk (issue 31): the flush follows in the background
//! and is recorded. A recovery in the same host boot flushes a pause left unflushed and resumes it with its
//! memory; one after a reboot (a power loss could have torn the file) cold-boots it from its disk.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use agentenv_runtime::VmState;
use common::{StateDir, run, runtime, spec, token};

fn record_path(state: &Path, id: &str) -> std::path::PathBuf {
    state.join("sandboxes").join(id).join("sandbox.json")
}

fn record(state: &Path, id: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(record_path(state, id)).unwrap()).unwrap()
}

/// Rewrites the record of paused sandbox `id` as if its RAM file had not been flushed in host boot `boot`.
fn unflushed_in(state: &Path, id: &str, boot: &str) {
    let mut r = record(state, id);
    r["ram_boot_id"] = boot.into();
    std::fs::write(record_path(state, id), serde_json::to_vec(&r).unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_flushes_its_ram_after_answering_and_recovery_settles_an_unflushed_one() {
    let state = StateDir::new();
    let s = state.path();
    let (a, b) = (
        format!("da-{}", &token()[..8]),
        format!("db-{}", &token()[..8]),
    );
    let (disk_a, mem_a, disk_b, mem_b) = (token(), token(), token(), token());
    let setup = |disk: &str, mem: &str| {
        format!(
            "echo {disk} > /home/user/d; sync; echo {mem} > /dev/shm/m; \
             sleep 100000 >/dev/null 2>&1 & cat /proc/sys/kernel/random/boot_id"
        )
    };
    let (boot_a, boot_b) = {
        let rt = runtime(s).await;
        rt.create(spec(&a)).await.expect("create a");
        rt.create(spec(&b)).await.expect("create b");
        let (boot_a, _) = run(&rt, &a, &setup(&disk_a, &mem_a)).await;
        let (boot_b, _) = run(&rt, &b, &setup(&disk_b, &mem_b)).await;
        for id in [&a, &b] {
            assert_eq!(
                record(s, id)["ram_shared"],
                true,
                "{id}: a RAM file of its own"
            );
            rt.pause(id).await.expect("pause");
        }
        // The flush follows the answer and is recorded.
        let deadline = Instant::now() + Duration::from_secs(60);
        while [&a, &b]
            .iter()
            .any(|id| !record(s, id)["ram_boot_id"].is_null())
        {
            assert!(
                Instant::now() < deadline,
                "the RAM files were never flushed"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (boot_a, boot_b)
        // The server goes away here.
    };
    // `a` as if the process died before the flush, `b` as if the host then lost power.
    let this_boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    unflushed_in(s, &a, this_boot.trim());
    unflushed_in(s, &b, "00000000-0000-0000-0000-000000000000");
    let rt = runtime(s).await;
    let recovered = rt.recover().await.expect("recover");
    for id in [&a, &b] {
        assert!(
            recovered
                .iter()
                .any(|r| &r.id == id && r.state == Some(VmState::Paused)),
            "{id}: {recovered:?}"
        );
        assert!(record(s, id)["ram_boot_id"].is_null(), "{id}: not settled");
    }
    let probe = "cat /home/user/d; cat /dev/shm/m 2>/dev/null || echo gone; \
                 pgrep -x sleep >/dev/null && echo running || echo none; cat /proc/sys/kernel/random/boot_id";
    rt.resume(&a).await.expect("resume a");
    let (out, _) = run(&rt, &a, probe).await;
    assert_eq!(
        out,
        format!("{disk_a}\n{mem_a}\nrunning\n{}", boot_a),
        "a keeps its memory"
    );
    let env = std::collections::BTreeMap::new();
    rt.resume_with(&b, &env).await.expect("cold boot b");
    let (out, _) = run(&rt, &b, probe).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(&lines[..3], [disk_b.as_str(), "gone", "none"], "{out}");
    assert_ne!(lines[3], boot_b.trim(), "b: a new boot");
    rt.kill(&a).await.expect("kill a");
    rt.kill(&b).await.expect("kill b");
}
